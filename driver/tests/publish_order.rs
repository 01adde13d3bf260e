//! The timeline's causal order under a reader that claims the instant a
//! publication is READY: the daemon's `publish` line always comes before the
//! `claim` (and an unread `release`) of the same publication. A reader
//! polling `lookup` by name once claimed in the moment between the store
//! making a publication READY and the publish's line being written, and
//! `pdstor timeline check` then called the run out of order.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pdstor_client::layout::Layout;
use pdstor_client::timeline::Timeline;
use pdstor_daemon::admission::CancelToken;
use pdstor_daemon::protocol::identity::Caller;
use pdstor_daemon::protocol::service::Service;
use pdstor_daemon::store::{self, ChunkSource, FormatOptions, Store, StoreBatch, StoreOptions};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::BufferOffset;

const SLOT: u64 = 64 * 1024;
const ROUNDS: usize = 300;

fn layout() -> Layout {
    Layout {
        model_id: "test-model".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 32,
        chunk_tokens: 16,
        kv_format: "pdstor-test".into(),
    }
}

fn service(dir: &Path) -> (Arc<Service>, std::path::PathBuf) {
    let target = dir.join("ns.img");
    let opts = FormatOptions {
        slot_size: SLOT,
        journal_half: 4 << 20,
        force: false,
        // A slot a round: the claimed publications keep theirs.
        create_len: Some(2 * 4096 + (8 << 20) + ROUNDS as u64 * SLOT),
    };
    store::format(&target, &opts).unwrap();
    let (s, _) = Store::open(&target, StoreOptions { queue_depth: 8, ..Default::default() }).unwrap();
    let timeline = dir.join("timeline.jsonl");
    let t = Arc::new(Timeline::open(&timeline, "daemon").unwrap());
    (Arc::new(Service::new(Arc::new(s)).with_timeline(Some(t))), timeline)
}

#[test]
fn a_reader_claiming_the_instant_a_publication_is_ready_is_recorded_after_its_publish() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (svc, timeline) = service(dir.path());
    let me = Caller::in_process();
    let buf = Buffer::memfd("writer", SLOT as usize).unwrap();
    let id = svc.store().register_buffer(buf).unwrap();
    for round in 0..ROUNDS {
        let req = format!("r{round}");
        let p = svc.prepare_with(&me, &req, &layout(), 1, "w", None, &CancelToken::new()).unwrap();
        let chunk = ChunkSource { index: 0, buffer: id, buffer_offset: BufferOffset(0), len: SLOT, crc32c: None };
        let batch =
            StoreBatch { publication: p.publication, chunks: vec![chunk], is_last_batch: true, total_chunks: 1 };
        svc.store().store_batch(&batch).unwrap();
        // The reader spins on lookup from before the publish; odd rounds release unread instead.
        let started = Arc::new(AtomicBool::new(false));
        let reader = {
            let (svc, req, started, me) = (svc.clone(), req.clone(), started.clone(), me.clone());
            std::thread::spawn(move || {
                started.store(true, Ordering::SeqCst);
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                loop {
                    if let Some(ready) = svc.lookup(&me, std::slice::from_ref(&req)).unwrap().remove(0) {
                        if round % 2 == 0 {
                            svc.claim(&me, &ready, "reader", "s", 60_000, None).unwrap();
                        } else {
                            svc.release(&me, &ready).unwrap();
                        }
                        return;
                    }
                    assert!(std::time::Instant::now() < deadline, "{req} never READY");
                    std::thread::yield_now();
                }
            })
        };
        while !started.load(Ordering::SeqCst) {
            std::hint::spin_loop();
        }
        svc.publish(&me, p.publication, &p.writer_token, Some(1)).unwrap();
        reader.join().unwrap();
    }
    let text = std::fs::read_to_string(&timeline).unwrap();
    let mut published = std::collections::HashSet::new();
    let mut ends = 0;
    for (n, line) in text.lines().enumerate() {
        let e: serde_json::Value = serde_json::from_str(line).unwrap();
        let publication = e["publication"].as_u64();
        match e["event"].as_str() {
            Some("publish") => {
                published.insert(publication);
            }
            Some(step @ ("claim" | "release")) => {
                assert!(
                    published.contains(&publication),
                    "line {}: {step} of {publication:?} before its publish",
                    n + 1
                );
                ends += 1;
            }
            _ => {}
        }
    }
    assert_eq!(ends, ROUNDS);
}
