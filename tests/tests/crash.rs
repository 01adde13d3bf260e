//! The crash campaign: `kill -9` the daemon at random points while writers
//! put concurrently, on a namespace with a 256 KiB journal so checkpoints are
//! frequent. After every restart, every READY receipt a client was given must
//! still claim, load byte-identical and ack. A put that did not get its
//! receipt may have been rolled back (or published without the client
//! knowing): never counted as lost, never counted as checked.
//!
//! `PDSTOR_CRASH_KILLS` sets the number of kills (default 200; `cargo xtask
//! crash --kills N` runs longer campaigns), `PDSTOR_CRASH_SEED` the seed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;
use pdstor_client::{Client, Reader, Writer};
use pdstor_tests::{Daemon, pdstor_bin};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const CHUNK: u64 = 16 << 10;
const SLOTS: u64 = 4096;
const WRITERS: usize = 3;

fn layout() -> Layout {
    Layout {
        model_id: "crash".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-crash".into(),
    }
}

fn kv(seed: u64, chunks: u32) -> Vec<u8> {
    (0..chunks as u64).flat_map(|i| pdstor_engine::payload::chunk(seed, i, CHUNK as usize)).collect()
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// What a writer was told: the receipt, and what it stored.
struct Given {
    receipt: Receipt,
    seed: u64,
    chunks: u32,
}

/// One writer until `stop`: puts of 1–4 chunks, each receipt recorded.
fn writer(d_server: String, socket: std::path::PathBuf, id: u64, stop: Arc<AtomicBool>, given: Arc<Mutex<Vec<Given>>>) {
    let Ok(mut w) = Writer::new(&d_server, &socket, CHUNK, 4) else { return };
    let mut rng = SmallRng::seed_from_u64(id);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let chunks = rng.random_range(1..=4u32);
        let seed = id << 20 | n;
        n += 1;
        match w.put(&format!("crash-{id}-{n}"), &layout(), &kv(seed, chunks), 2, Some(1)) {
            Ok(p) => given.lock().unwrap().push(Given { receipt: p.receipt, seed, chunks }),
            // The daemon died under it: this put may or may not have landed.
            Err(_) => return,
        }
    }
}

#[test]
fn every_ready_receipt_survives_kill_9_with_a_small_journal() {
    let kills = env_or("PDSTOR_CRASH_KILLS", 200);
    let seed = env_or("PDSTOR_CRASH_SEED", 0x9d5c_0417);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut d = Daemon::format_and_start(dir.path(), SLOTS, CHUNK);
    let mut rng = SmallRng::seed_from_u64(seed);
    let started = Instant::now();
    let (mut checked, mut lost) = (0usize, Vec::new());
    let mut writer_ids = 0u64;
    for round in 0..kills {
        let stop = Arc::new(AtomicBool::new(false));
        let given = Arc::new(Mutex::new(Vec::new()));
        let threads: Vec<_> = (0..WRITERS)
            .map(|_| {
                writer_ids += 1;
                let (server, socket, id) = (d.server.clone(), d.data_socket.clone(), seed ^ writer_ids << 32);
                let (stop, given) = (stop.clone(), given.clone());
                std::thread::spawn(move || writer(server, socket, id, stop, given))
            })
            .collect();
        // Kill mid-traffic, never before the writers got going: a round waits
        // for its first READY receipt (on a loaded machine a restarted daemon
        // and its writers may take longer than the random delay alone), then
        // lets them run on for a random while.
        let waiting = Instant::now();
        while given.lock().unwrap().is_empty() {
            assert!(waiting.elapsed() < Duration::from_secs(60), "round {round}: no put completed within 60 s");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(10..120)));
        stop.store(true, Ordering::Relaxed);
        d.kill9();
        for t in threads {
            t.join().unwrap();
        }
        d.restart();

        let c = Client::new(&d.server);
        let mut reader = Reader::new(&d.server, &d.data_socket).unwrap();
        for g in given.lock().unwrap().drain(..) {
            let p = g.receipt.publication;
            let restored = c
                .claim(&g.receipt, "verifier", &format!("round-{round}"), 60_000)
                .map_err(|e| format!("claim: {e}"))
                .and_then(|claim| {
                    let r = reader.get(&claim, &layout()).map_err(|e| format!("get: {e}"))?;
                    let bytes = reader.restored_bytes(r.len).map_err(|e| format!("bytes: {e}"))?;
                    if bytes != kv(g.seed, g.chunks) {
                        return Err("restored bytes differ from the stored ones".into());
                    }
                    c.ack(&claim, &r.restore_digest).map_err(|e| format!("ack: {e}"))
                });
            checked += 1;
            if let Err(e) = restored {
                lost.push(format!("round {round}: publication {p} ({} chunks): {e}", g.chunks));
            }
        }
    }
    let left = Client::new(&d.server).publications(None, false).unwrap();
    let line = format!(
        "crash campaign (seed {seed:#x}): {kills} kill -9, {checked} READY receipts checked, {} lost, \
         {} publications left that no client holds a receipt for, {:.0} s",
        lost.len(),
        left.len(),
        started.elapsed().as_secs_f64()
    );
    eprintln!("{line}");
    if let Ok(f) = std::env::var("PDSTOR_CRASH_REPORT") {
        let _ = std::fs::write(f, format!("{line}\n"));
    }
    assert!(lost.is_empty(), "{line}\n{}", lost.join("\n"));
    assert!(checked >= kills as usize, "every round checks at least the receipt it waited for: {line}");
}

/// Claims, loads and acks one receipt; the restored bytes must be `expected`.
fn restore(d: &Daemon, receipt: &Receipt, expected: &[u8]) -> Result<(), String> {
    let c = Client::new(&d.server);
    let claim = c.claim(receipt, "verifier", "s", 60_000).map_err(|e| format!("claim: {e}"))?;
    let mut reader = Reader::new(&d.server, &d.data_socket).map_err(|e| e.to_string())?;
    let r = reader.get(&claim, &layout()).map_err(|e| format!("get: {e}"))?;
    if reader.restored_bytes(r.len).map_err(|e| e.to_string())? != expected {
        return Err("restored bytes differ".into());
    }
    c.ack(&claim, &r.restore_digest).map_err(|e| format!("ack: {e}"))
}

/// Records that are never committed (prepare, abort) take journal space
/// too: thousands of them on a 256 KiB journal force checkpoints instead of
/// wrapping over the READY publication written before them. Before the fix
/// they wrapped and a kill -9 lost every publication.
#[test]
fn records_that_never_commit_cannot_wrap_the_journal() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut d = Daemon::format_and_start(dir.path(), 64, CHUNK);
    let target = d.target.clone();
    let put = |d: &Daemon, req: &str, seed: u64| {
        let mut w = Writer::new(&d.server, &d.data_socket, CHUNK, 2).unwrap();
        w.put(req, &layout(), &kv(seed, 2), 2, None).unwrap().receipt
    };
    let before = put(&d, "before", 1);
    let c = Client::new(&d.server);
    // The 1.9 MB request id is refused before it is read (the body
    // limit), and one just over the bound before it is journaled.
    match c.prepare(&"x".repeat(1_900_000), &layout(), 1, "w") {
        Err(pdstor_client::ClientError::Api(e)) => {
            assert_eq!((e.status, e.code.as_str()), (413, "body_too_large"), "{e}")
        }
        // The daemon answers 413 after reading 1 MiB and closes the
        // connection; a client still sending the rest may see the reset first.
        Err(pdstor_client::ClientError::Transport { .. }) => {}
        other => panic!("a 1.9 MB req_id must be refused: {other:?}"),
    }
    match c.prepare(&"x".repeat(257), &layout(), 1, "w") {
        Err(pdstor_client::ClientError::Api(e)) => assert_eq!((e.status, e.field.as_str()), (400, "req_id"), "{e}"),
        other => panic!("a 257-byte req_id must be refused: {other:?}"),
    }
    // ~2,000 prepare + abort pairs of the largest accepted strings: ~12 MB of
    // records through a 256 KiB journal, none of them committed.
    let long = |tag: &str, i: usize| format!("{tag}-{i:06}-{}", "y".repeat(240));
    for i in 0..2000 {
        let p = c.prepare(&long("req", i), &layout(), 1, &long("writer", i)).unwrap();
        c.abort(p.publication, &p.writer_token).unwrap();
    }
    let after = put(&d, "after", 2);
    d.kill9_and_restart();
    restore(&d, &before, &kv(1, 2)).expect("the READY publication from before the flood");
    restore(&d, &after, &kv(2, 2)).expect("the READY publication from after the flood");
    assert!(Client::new(&d.server).publications(None, false).unwrap().is_empty());
    d.stop();
    let out = std::process::Command::new(pdstor_bin()).arg("inspect").arg("--target").arg(&target).output().unwrap();
    let i: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(i["recovery"]["journal_stop"], serde_json::Value::Null, "the journal ends cleanly: {i}");
}
