//! `claim` with `adopt`: claim and adopt in one step. It answers the claim
//! receipt with the manifest a separate adopt would answer, leaves the
//! publication ADOPTED, answers an exact repeat the same and changes
//! nothing, refuses a request that names no layout before it claims
//! anything, and where the adopt is refused once the claim is made answers
//! the receipt with the refusal, the claim standing (CLAIMED).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pdstor_client::code::RefusalCode;
use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;
use pdstor_client::receipt::manifest_digest;
use pdstor_client::wire::{AdoptRequest, ClaimRequest};
use pdstor_daemon::admission::CancelToken;
use pdstor_daemon::protocol::Clock;
use pdstor_daemon::protocol::identity::Caller;
use pdstor_daemon::protocol::service::{ProtocolError, Service};
use pdstor_daemon::store::{self, ChunkSource, FormatOptions, Phase, Store, StoreBatch, StoreOptions};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::BufferOffset;

const SLOT: u64 = 64 * 1024;

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

/// A clock that moves `step_ms` on every reading.
#[derive(Debug)]
struct Ticking {
    now: AtomicU64,
    step_ms: u64,
}

impl Clock for Ticking {
    fn now_unix_ms(&self) -> u64 {
        self.now.fetch_add(self.step_ms, Ordering::SeqCst)
    }
}

fn service(dir: &Path, step_ms: u64) -> Arc<Service> {
    let target = dir.join("ns.img");
    let opts = FormatOptions { slot_size: SLOT, journal_half: 4 << 20, force: false, create_len: Some(16 << 20) };
    store::format(&target, &opts).unwrap();
    let (s, _) = Store::open(&target, StoreOptions { queue_depth: 8, ..Default::default() }).unwrap();
    let clock = Arc::new(Ticking { now: AtomicU64::new(1_800_000_000_000), step_ms });
    Arc::new(Service::new(Arc::new(s)).with_clock(clock))
}

/// A READY publication of one chunk; its receipt.
fn ready(svc: &Service, req: &str) -> Receipt {
    let me = Caller::in_process();
    let buf = Buffer::memfd("writer", SLOT as usize).unwrap();
    let id = svc.store().register_buffer(buf).unwrap();
    let p = svc.prepare_with(&me, req, &layout(), 1, "w", None, &CancelToken::new()).unwrap();
    let chunk = ChunkSource { index: 0, buffer: id, buffer_offset: BufferOffset(0), len: SLOT, crc32c: None };
    let batch = StoreBatch { publication: p.publication, chunks: vec![chunk], is_last_batch: true, total_chunks: 1 };
    svc.store().store_batch(&batch).unwrap();
    svc.publish(&me, p.publication, &p.writer_token, None).unwrap().receipt
}

fn claim(ready: &Receipt, lease_ms: u64, layout: Option<Layout>) -> ClaimRequest {
    ClaimRequest {
        receipt: ready.clone(),
        reader_id: "decode-0".into(),
        session_id: "s".into(),
        lease_ms,
        layout,
        adopt: true,
    }
}

fn phase(svc: &Service, id: u64) -> Phase {
    svc.store().publication(id).unwrap().phase
}

#[test]
fn a_claim_with_adopt_answers_the_manifest_an_adopt_would_and_leaves_it_adopted() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let svc = service(dir.path(), 0);
    let me = Caller::in_process();
    let (one, two) = (ready(&svc, "one"), ready(&svc, "two"));

    let (receipt, manifest) = svc.claim_and_adopt(&me, &claim(&one, 60_000, Some(layout()))).unwrap();
    let manifest = manifest.unwrap();
    assert_eq!(receipt.publication, one.publication);
    assert_eq!(manifest_digest(&manifest), receipt.manifest_digest, "the manifest claimed");
    assert!(manifest.restore_nonce.is_some(), "with the claim's restore nonce");
    assert_eq!(phase(&svc, one.publication), Phase::Adopted);

    // Its answer lost, the exact repeat gets it again; another reader's is refused.
    let (again, same) = svc.claim_and_adopt(&me, &claim(&one, 60_000, Some(layout()))).unwrap();
    assert_eq!(again.signature, receipt.signature, "the same claim receipt");
    assert_eq!(same.unwrap().restore_nonce, manifest.restore_nonce, "the same manifest and nonce");
    assert_eq!(phase(&svc, one.publication), Phase::Adopted);
    let other = ClaimRequest { reader_id: "decode-1".into(), ..claim(&one, 60_000, Some(layout())) };
    let Err(ProtocolError::Refused(r)) = svc.claim_and_adopt(&me, &other) else {
        panic!("another reader's claim of an adopted publication was taken");
    };
    assert_eq!(r.code, RefusalCode::AlreadyClaimed);

    // The same as claim, then adopt, apart.
    let apart = svc.claim(&me, &two, "decode-0", "s", 60_000, Some(&layout())).unwrap();
    let adopted = svc.adopt(&me, &AdoptRequest::of_claim(&apart, layout())).unwrap();
    assert_eq!(adopted.chunks.len(), manifest.chunks.len());
    assert_eq!(adopted.layout, manifest.layout);
}

#[test]
fn a_claim_with_adopt_and_no_layout_is_refused_before_it_claims() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let svc = service(dir.path(), 0);
    let one = ready(&svc, "one");
    let Err(ProtocolError::Refused(r)) = svc.claim_and_adopt(&Caller::in_process(), &claim(&one, 60_000, None)) else {
        panic!("a claim with adopt and no layout was taken");
    };
    assert_eq!((r.code, r.field), (RefusalCode::BadRequest, "layout"));
    assert_eq!(phase(&svc, one.publication), Phase::Ready, "nothing claimed");
}

#[test]
fn an_adopt_refused_after_its_claim_answers_the_receipt_and_the_refusal() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Every reading of the clock 5 ms on: a 1 ms lease has run out by the adopt.
    let svc = service(dir.path(), 5);
    let me = Caller::in_process();
    let one = ready(&svc, "one");
    let (receipt, adopted) = svc.claim_and_adopt(&me, &claim(&one, 1, Some(layout()))).unwrap();
    let Err(ProtocolError::Refused(r)) = adopted else { panic!("an adopt past its lease was taken") };
    assert_eq!(r.code, RefusalCode::LeaseExpired);
    assert_eq!(phase(&svc, one.publication), Phase::Claimed, "the claim stands");
    // Its holder has the receipt: it reports the claim failed, its bytes kept.
    svc.fail(&me, &receipt, "the lease ran out before the adopt").unwrap();
    assert_eq!(phase(&svc, one.publication), Phase::Retained);
}
