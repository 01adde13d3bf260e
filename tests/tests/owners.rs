//! A publication belongs to the writer that prepared it (issue 16): the
//! attacks that a publication id alone used to allow — racing its publish,
//! aborting it, or storing into it and disconnecting so the daemon aborts it
//! — are refused with `not_owner`, and the writer finishes undisturbed.

use pdstor_client::layout::Layout;
use pdstor_client::wire::DataChunk;
use pdstor_client::{Client, ClientError, DataConn};
use pdstor_tests::Daemon;

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "owners".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-owners".into(),
    }
}

fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (u16, String) {
    match r {
        Err(ClientError::Api(e)) => (e.status, e.code),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn state(c: &Client, publication: u64) -> Option<String> {
    c.publications(None, false).unwrap().into_iter().find(|p| p.publication == publication).map(|p| p.state)
}

#[test]
fn only_the_writer_stores_publishes_or_aborts_its_publication() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let c = Client::new(&d.server);
    // The writer prepares and stores its two chunks.
    let p = c.prepare("victim", &layout(), 2, "writer-a").unwrap();
    let mut writer = DataConn::connect(&d.data_socket).unwrap();
    let buf = pdstor_engine::buffer::Buffer::memfd("victim", 2 * SLOT as usize).unwrap();
    buf.write_at(0, &pdstor_engine::payload::chunk(5, 0, SLOT as usize)).unwrap();
    buf.write_at(SLOT, &pdstor_engine::payload::chunk(5, 1, SLOT as usize)).unwrap();
    let b = writer.register(&buf).unwrap();
    let chunk = |buffer: u32, i: u32| DataChunk { index: i, buffer, offset: i as u64 * SLOT, len: SLOT, crc32c: None };
    writer.store(p.publication, &p.writer_token, vec![chunk(b, 0)], false, 2).unwrap();

    // The attacker knows the publication id (they are sequential), not the token.
    let forged = "00".repeat(32);
    assert_eq!(code(c.publish(p.publication, &forged, Some(666))), (403, "not_owner".into()), "publish race");
    assert_eq!(code(c.abort(p.publication, &forged)), (403, "not_owner".into()), "cross-writer abort");
    // Storing into it on its own connection, then vanishing (the daemon aborts
    // what a vanished connection stored into — its own, never another's).
    let mut attacker = DataConn::connect(&d.data_socket).unwrap();
    let evil = pdstor_engine::buffer::Buffer::memfd("evil", SLOT as usize).unwrap();
    let eb = attacker.register(&evil).unwrap();
    let evil_chunk = DataChunk { index: 1, buffer: eb, offset: 0, len: SLOT, crc32c: None };
    assert_eq!(code(attacker.store(p.publication, &forged, vec![evil_chunk], true, 2)), (403, "not_owner".into()));
    drop(attacker);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(state(&c, p.publication).as_deref(), Some("PREPARED"), "every attack changed nothing");

    // The writer finishes: its first token, its bytes.
    writer.store(p.publication, &p.writer_token, vec![chunk(b, 1)], true, 2).unwrap();
    let published = c.publish(p.publication, &p.writer_token, Some(42)).unwrap();
    assert_eq!(published.manifest.first_token, Some(42));
    let m = c.metrics().unwrap();
    assert!(m.contains("pdstor_errors_total{code=\"not_owner\"} 3"), "{m}");
}

#[test]
fn a_retried_prepare_answers_the_same_writer_token() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let c = Client::new(&d.server);
    let first = c.prepare("retry", &layout(), 2, "w").unwrap();
    let again = c.prepare("retry", &layout(), 2, "w").unwrap();
    assert_eq!((again.publication, &again.writer_token), (first.publication, &first.writer_token));
    let other = c.prepare("other", &layout(), 2, "w").unwrap();
    assert_ne!(other.writer_token, first.writer_token, "each publication has its own token");
    assert_eq!(code(c.abort(first.publication, &other.writer_token)), (403, "not_owner".into()));
    c.abort(first.publication, &first.writer_token).unwrap();
}

/// Closing a session fences its reader (its bytes become reclaimable), so
/// it takes a claim receipt of that session: a forged or READY receipt is
/// refused and the reader keeps reading.
#[test]
fn only_a_holder_of_the_session_closes_it() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let c = Client::new(&d.server);
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let published = w.put("s", &layout(), &pdstor_engine::payload::chunk(3, 0, SLOT as usize), 1, None).unwrap();
    let claim = c.claim(&published.receipt, "victim", "victim-session", 60_000).unwrap();
    let mut forged = claim.clone();
    forged.session = Some("victim-session".into());
    forged.reader = Some("attacker".into());
    assert_eq!(code(c.close_session(&forged)), (403, "bad_signature".into()));
    assert_eq!(code(c.close_session(&published.receipt)), (403, "wrong_receipt".into()));
    assert_eq!(code(c.reclaim(&claim)), (409, "not_fenced".into()), "the victim's claim is not fenced");
    let mut r = pdstor_client::Reader::new(&d.server, &d.data_socket).unwrap();
    let restored = r.get(&claim, &layout()).expect("the victim reads undisturbed");
    c.ack(&claim, &restored.restore_digest).unwrap();
}

/// The receipt key can be rotated (offline, with nothing live): every
/// receipt signed before is then void, with its own code.
#[test]
fn a_rotated_key_voids_every_earlier_receipt() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let c = Client::new(&d.server);
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let old = w.put("before", &layout(), &pdstor_engine::payload::chunk(4, 0, SLOT as usize), 1, None).unwrap().receipt;
    drop(w);
    d.stop();
    let target = d.target.clone();
    let rotate = || {
        std::process::Command::new(pdstor_tests::pdstor_bin())
            .args(["rotate-key", "--target"])
            .arg(&target)
            .output()
            .unwrap()
    };
    let out = rotate();
    assert!(!out.status.success(), "rotated with a live publication");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 publications are live"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.restart();
    c.release(&old).unwrap();
    d.stop();
    let out = rotate();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["key_id"], old.key_id + 1);
    d.restart();
    assert_eq!(code(c.claim(&old, "r", "s", 60_000)), (403, "key_rotated".into()));
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let new = w.put("after", &layout(), &pdstor_engine::payload::chunk(5, 0, SLOT as usize), 1, None).unwrap().receipt;
    assert_eq!(new.key_id, old.key_id + 1);
    c.release(&new).unwrap();
}

/// `lookup` answers a READY receipt by request name — one that claims — and
/// nothing for a request that is unknown, still PREPARED or already claimed;
/// a lookup of too many names is refused whole.
#[test]
fn lookup_finds_ready_receipts_by_name_and_nothing_else() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let c = Client::new(&d.server);
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 2).unwrap();
    let kv = pdstor_engine::payload::chunk(3, 0, SLOT as usize);
    let ready = w.put("ready", &layout(), &kv, 1, None).unwrap().receipt;
    let _open = c.prepare("prepared", &layout(), 1, "writer-b").unwrap();
    let names: Vec<String> = ["ready", "prepared", "unknown"].map(String::from).to_vec();
    let found = c.lookup(&names).unwrap();
    let r = found[0].as_ref().expect("the READY publication is found");
    assert_eq!(
        (r.publication, &r.req_id, &r.manifest_digest),
        (ready.publication, &ready.req_id, &ready.manifest_digest)
    );
    assert!(found[1].is_none() && found[2].is_none(), "{found:?}");
    // The looked-up receipt is as good as the writer's: it claims.
    let claim = c.claim(r, "reader", "s", 60_000).unwrap();
    assert_eq!(claim.publication, ready.publication);
    assert!(c.lookup(&names[..1]).unwrap()[0].is_none(), "a claimed publication is no longer READY");
    let many: Vec<String> = (0..4097).map(|i| format!("r{i}")).collect();
    assert_eq!(code(c.lookup(&many)), (400, "bad_request".into()));
}
