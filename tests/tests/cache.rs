//! Cache publications end to end: a real `pdstor serve`, one writer and two
//! reader processes' worth of connections. A cache publication stays READY
//! for every reader; each read is a lease that holds it against release and
//! eviction until it ends; nothing a read does is journaled, so a restart
//! ends the reads and keeps the publication; the daemon's timeline of it
//! passes the checker.

use std::process::Command;

use pdstor_client::layout::Layout;
use pdstor_client::read::ReadAnswer;
use pdstor_client::wire::Published;
use pdstor_client::{Client, ClientError, Reader, Writer};
use pdstor_engine::payload;
use pdstor_tests::{Daemon, pdstor_bin};

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "cache".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 256,
        kv_format: "pdstor-cache".into(),
    }
}

fn kv(seed: u64, chunks: u64) -> Vec<u8> {
    (0..chunks).flat_map(|i| payload::chunk(seed, i, SLOT as usize)).collect()
}

fn put(d: &Daemon, req: &str, seed: u64, chunks: u32, cache: bool) -> Published {
    let w = Writer::new(&d.server, &d.data_socket, SLOT, chunks).unwrap();
    let mut w = if cache { w.publishing_cache() } else { w };
    w.put(req, &layout(), &kv(seed, chunks as u64), 2, None).unwrap()
}

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api(e)) => (e.status, e.code),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn info(c: &Client, publication: u64) -> pdstor_client::wire::PublicationInfo {
    c.publications(None, false).unwrap().into_iter().find(|p| p.publication == publication).expect("live")
}

fn started(dir: &std::path::Path, extra: &[&str]) -> Daemon {
    let target = dir.join("t.img");
    let fmt = Command::new(pdstor_bin())
        .args(["format", "--journal", "256k", "--chunk-slot", "1M", "--size", "24M", "--target"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(fmt.status.success(), "{}", String::from_utf8_lossy(&fmt.stderr));
    Daemon::start_with(&target, dir, extra)
}

/// Two readers read one cache publication at once, each restoring it byte
/// for byte; the writer cannot release it while either read is open, and
/// can once both ended; a read refuses what an ack refuses.
#[test]
fn two_readers_share_a_cache_publication_that_no_release_takes_while_read() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let timeline = dir.path().join("timeline.jsonl");
    let d = started(dir.path(), &["--timeline", timeline.to_str().unwrap()]);
    let p = put(&d, "prefix-1", 11, 3, true);
    let c = Client::new(&d.server);
    assert!(info(&c, p.receipt.publication).cache);
    let (mut r0, mut r1) =
        (Reader::new(&d.server, &d.data_socket).unwrap(), Reader::new(&d.server, &d.data_socket).unwrap());
    let a = r0.client.read(&p.receipt, "decode-0", "s-0", Some(&layout())).unwrap();
    let b = r1.client.read(&p.receipt, "decode-1", "s-1", Some(&layout())).unwrap();
    assert_ne!(a.receipt.signature, b.receipt.signature, "each read is its own lease");
    assert_ne!(a.manifest.restore_nonce, b.manifest.restore_nonce);
    assert_eq!(info(&c, p.receipt.publication).reading, 2);
    // Ending a read before loading it, or with another digest, is refused
    // and leaves the read open.
    assert_eq!(code(c.end_read(&a.receipt, "00")), (409, "not_loaded".into()));
    let ra = r0.load(&a.receipt, a.manifest.clone()).unwrap();
    let rb = r1.load(&b.receipt, b.manifest.clone()).unwrap();
    let want = kv(11, 3);
    assert_eq!(r0.restored_bytes(ra.len).unwrap(), want, "reader 0 restored it byte for byte");
    assert_eq!(r1.restored_bytes(rb.len).unwrap(), want, "reader 1 restored it byte for byte");
    assert_eq!(code(c.end_read(&a.receipt, &rb.restore_digest)), (409, "restore_mismatch".into()));
    // Held: neither a release nor a claim takes it.
    assert_eq!(code(c.release(&p.receipt)), (409, "wrong_state".into()));
    assert_eq!(code(c.claim(&p.receipt, "thief", "s-9", 60_000)), (409, "wrong_state".into()));
    c.end_read(&a.receipt, &ra.restore_digest).unwrap();
    assert_eq!(code(c.end_read(&a.receipt, &ra.restore_digest)), (409, "read_ended".into()));
    assert_eq!(code(r0.load(&a.receipt, a.manifest)), (409, "read_ended".into()), "no load after the end");
    assert_eq!(code(c.release(&p.receipt)), (409, "wrong_state".into()), "reader 1 still holds it");
    c.abandon_read(&b.receipt, "the engine gave up").unwrap();
    assert_eq!(info(&c, p.receipt.publication).reading, 0);
    // A third read, the whole get in one call, then the release.
    let got = r1.get_cached(&p.receipt, "decode-1", "s-1", &layout()).unwrap();
    assert_eq!(r1.restored_bytes(got.len).unwrap(), want);
    c.release(&p.receipt).unwrap();
    assert!(c.publications(None, false).unwrap().is_empty());
    let lines = pdstor_client::timeline::read(&timeline).unwrap();
    let steps: Vec<String> = lines.iter().map(|(_, e)| e.as_ref().unwrap().event.clone()).collect();
    assert_eq!(steps.iter().filter(|s| *s == "read").count(), 3, "{steps:?}");
    assert_eq!(steps.iter().filter(|s| *s == "read_done").count(), 2, "{steps:?}");
    assert_eq!(steps.iter().filter(|s| *s == "read_end").count(), 1, "{steps:?}");
    let report = pdstor_proof::timeline::check::check(&lines, pdstor_engine::io::PayloadPath::HostFixed);
    let kinds: Vec<&str> = report.violations.iter().map(|v| v.kind).filter(|k| *k != "not_native").collect();
    assert!(kinds.is_empty(), "{:#?}", report.violations);
}

/// A handoff is claimed, never read; a cache publication read, never
/// claimed; a read names the layout it restores with.
#[test]
fn each_class_refuses_the_other_classes_step() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = started(dir.path(), &[]);
    let handoff = put(&d, "handoff-1", 1, 2, false);
    let cache = put(&d, "cache-1", 2, 2, true);
    let c = Client::new(&d.server);
    assert_eq!(code(c.read(&handoff.receipt, "r", "s", None)), (409, "wrong_state".into()));
    assert_eq!(code(c.claim(&cache.receipt, "r", "s", 60_000)), (409, "wrong_state".into()));
    let other = Layout { dtype: "fp8".into(), ..layout() };
    assert_eq!(code(c.read(&cache.receipt, "r", "s", Some(&other))), (409, "layout_mismatch".into()));
    assert_eq!(info(&c, cache.receipt.publication).reading, 0, "a refused read holds nothing");
    // A read receipt is not a claim: it cannot report chunks read elsewhere, nor ack.
    let ReadAnswer { receipt, .. } = c.read(&cache.receipt, "r", "s", None).unwrap();
    assert_eq!(code(c.ack(&receipt, "00")).1, "wrong_receipt");
    c.abandon_read(&receipt, "done testing").unwrap();
    // Closing a session ends its reads, and no read begins in it again.
    let a = c.read(&cache.receipt, "r", "s-close", None).unwrap();
    let _b = c.read(&cache.receipt, "r", "s-close", None).unwrap();
    assert_eq!(info(&c, cache.receipt.publication).reading, 2);
    c.close_session(&a.receipt).unwrap();
    assert_eq!(info(&c, cache.receipt.publication).reading, 0);
    assert_eq!(code(c.read(&cache.receipt, "r", "s-close", None)), (409, "fenced".into()));
    c.release(&cache.receipt).unwrap();
}

/// A restart keeps a cache publication READY and a cache, and ends every
/// read: a read begun before it is refused after it, a new one restores.
#[test]
fn a_restart_keeps_the_cache_publication_and_ends_its_reads() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut d = started(dir.path(), &[]);
    let p = put(&d, "prefix-restart", 5, 2, true);
    let c = Client::new(&d.server);
    let before = c.read(&p.receipt, "decode-0", "s-0", None).unwrap();
    d.kill9_and_restart();
    let i = info(&c, p.receipt.publication);
    assert_eq!((i.state.as_str(), i.cache, i.reading), ("READY", true, 0));
    let mut r = Reader::new(&d.server, &d.data_socket).unwrap();
    assert_eq!(code(r.load(&before.receipt, before.manifest)).1, "read_ended");
    let got = r.get_cached(&p.receipt, "decode-0", "s-1", &layout()).unwrap();
    assert_eq!(r.restored_bytes(got.len).unwrap(), kv(5, 2));
    c.release(&p.receipt).unwrap();
}

/// An operator ends the reads of a reader that died holding them: by
/// publication number (`pdstor end-reads`), each read on the timeline with
/// the reason; their receipts are refused from then on and the publication
/// can be released. A handoff is refused (its claim is reclaimed instead),
/// as is an end without a reason.
#[test]
fn an_operator_ends_the_reads_a_dead_reader_left() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let timeline = dir.path().join("timeline.jsonl");
    let d = started(dir.path(), &["--timeline", timeline.to_str().unwrap()]);
    let p = put(&d, "prefix-orphaned", 9, 2, true);
    let handoff = put(&d, "handoff-2", 10, 1, false);
    let c = Client::new(&d.server);
    let mut r = Reader::new(&d.server, &d.data_socket).unwrap();
    let a = r.client.read(&p.receipt, "decode-0", "s-0", None).unwrap();
    let loaded = r.load(&a.receipt, a.manifest.clone()).unwrap();
    let b = c.read(&p.receipt, "decode-1", "s-1", None).unwrap();
    assert_eq!(code(c.release(&p.receipt)), (409, "wrong_state".into()), "held by two reads");
    let id = p.receipt.publication;
    assert_eq!(code(c.end_reads_of(id, " ")), (400, "bad_request".into()));
    assert_eq!(code(c.end_reads_of(handoff.receipt.publication, "gone")), (409, "wrong_state".into()));
    assert_eq!(info(&c, id).reading, 2, "a refused end ended nothing");
    let out = Command::new(pdstor_bin())
        .args(["end-reads", "--server", &d.server, "--publication", &id.to_string(), "--reason", "decode host died"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 read(s)"), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(info(&c, id).reading, 0);
    assert_eq!(code(c.end_read(&a.receipt, &loaded.restore_digest)), (409, "read_ended".into()));
    assert_eq!(code(r.load(&b.receipt, b.manifest)).1, "read_ended", "no load under an ended read");
    assert_eq!(c.end_reads_of(id, "again").unwrap(), 0, "nothing left to end");
    c.release(&p.receipt).unwrap();
    let lines = pdstor_client::timeline::read(&timeline).unwrap();
    let operator = lines
        .iter()
        .filter_map(|(_, e)| e.as_ref().ok())
        .filter(|e| e.event == "read_end" && e.detail.as_deref().is_some_and(|d| d.contains("decode host died")))
        .count();
    assert_eq!(operator, 2, "each ended read on the timeline with the operator's reason");
    let report = pdstor_proof::timeline::check::check(&lines, pdstor_engine::io::PayloadPath::HostFixed);
    let kinds: Vec<&str> = report.violations.iter().map(|v| v.kind).filter(|k| *k != "not_native").collect();
    assert!(kinds.is_empty(), "{:#?}", report.violations);
}

/// A read by name: the daemon finds the READY publication as `lookup` would
/// and reads it in the same step, one round trip for a lookup and a lock.
#[test]
fn a_read_by_name_is_a_lookup_and_a_read_in_one_step() {
    use pdstor_client::read::ReadRequest;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = started(dir.path(), &[]);
    let cache = put(&d, "named-1", 3, 2, true);
    put(&d, "named-handoff", 4, 1, false);
    let c = Client::new(&d.server);
    let by_name = |name: &str| ReadRequest {
        receipt: None,
        req_id: Some(name.into()),
        reader_id: "r".into(),
        session_id: "s-named".into(),
        layout: Some(layout()),
    };
    let misses = || {
        let m = c.metrics().unwrap();
        let series = "pdstor_errors_total{code=\"unknown_publication\"} ";
        m.lines().find_map(|l| l.strip_prefix(series)).map_or(0.0, |v| v.parse::<f64>().unwrap())
    };
    let before = misses();
    let asks = vec![by_name("named-1"), by_name("named-1"), by_name("never-stored"), by_name("named-handoff")];
    let mut got = c.read_many(asks).unwrap().into_iter();
    let (a, b) = (got.next().unwrap().unwrap(), got.next().unwrap().unwrap());
    assert_eq!(code(got.next().unwrap()), (404, "unknown_publication".into()));
    assert_eq!(misses(), before, "a miss by name is lookup's null, not an error counted");
    // On its own route the same miss is an answer like any refusal, counted.
    let body = r#"{"req_id": "never-stored", "reader_id": "r", "session_id": "s-named"}"#;
    let (status, _) = pdstor_tests::http_exchange(&d.control_socket(), "POST", "/storage-pd/read", Some(body));
    assert_eq!((status, misses()), (404, before + 1.0));
    assert_eq!(code(got.next().unwrap()), (409, "wrong_state".into()), "a handoff is claimed, not read");
    // A read that names its publication twice (or not at all) is refused whole.
    let both = ReadRequest { receipt: Some(cache.receipt.clone()), ..by_name("named-1") };
    assert_eq!(code(c.read_many(vec![both])), (400, "bad_request".into()), "a receipt and a name");
    assert_eq!(a.receipt.publication, cache.receipt.publication);
    assert_eq!(info(&c, cache.receipt.publication).reading, 2, "two reads held, by name");
    // Each restores byte for byte and ends as a read begun by receipt does.
    let mut r = Reader::new(&d.server, &d.data_socket).unwrap();
    for read in [&a, &b] {
        let restored = r.load(&read.receipt, read.manifest.clone()).unwrap();
        assert!(r.restored_bytes(2 * SLOT).unwrap() == kv(3, 2), "byte for byte");
        c.end_read(&read.receipt, &restored.restore_digest).unwrap();
    }
    assert_eq!(info(&c, cache.receipt.publication).reading, 0);
}
