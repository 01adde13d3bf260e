//! Takeover across owners (issue 35), where this host can check it: a
//! standby needs a namespace with persistent reservations (NVMe; the
//! topology suite's NVMe/TCP target on the series kernel runs the real
//! takeover), so on a file it refuses to start and writes nothing; a
//! takeover is asked of a standby, never of the owner.

use std::process::Command;

use pdstor_client::{Client, ClientError};
use pdstor_tests::{Daemon, pdstor_bin};

const SLOT: u64 = 1 << 20;

fn serve(target: &std::path::Path, dir: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let out = Command::new(pdstor_bin())
        .arg("serve")
        .args(extra)
        .arg("--listen")
        .arg(format!("unix:{}", dir.join("c.sock").display()))
        .arg("--data-socket")
        .arg(dir.join("d.sock"))
        .arg("--target")
        .arg(target)
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_standby_refuses_a_target_without_reservations_and_writes_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let before = std::fs::read(&target).unwrap();
    let (ok, stderr) =
        serve(&target, dir.path(), &["--standby", "--reservation-key", "0x5e", "--owner", "http://127.0.0.1:9"]);
    assert!(!ok, "a standby started on a file");
    assert!(stderr.contains("--standby") && stderr.contains("persistent reservations"), "{stderr}");
    assert!(std::fs::read(&target).unwrap() == before, "the refused standby changed the target");
    assert!(!dir.path().join("c.sock").exists() && !dir.path().join("d.sock").exists(), "it left sockets behind");

    // Without a key of its own it could preempt nothing: refused before it looks.
    let (ok, stderr) = serve(&target, dir.path(), &["--standby"]);
    assert!(!ok && stderr.contains("--reservation-key"), "{stderr}");
    // --owner and --takeover-after-ms belong to a standby.
    let (ok, stderr) = serve(&target, dir.path(), &["--owner", "http://127.0.0.1:9"]);
    assert!(!ok && stderr.contains("--standby"), "{stderr}");
    assert!(std::fs::read(&target).unwrap() == before, "a refused start changed the target");
}

#[test]
fn a_takeover_is_asked_of_a_standby_not_of_the_owner() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let c = Client::new(&d.server);
    let ns = c.namespace().unwrap();
    match c.takeover() {
        Err(ClientError::Api(e)) => {
            assert_eq!((e.status, e.code.as_str()), (409, "takeover_failed"), "{e}");
            assert!(e.message.contains(&ns.namespace) && e.message.contains("standby"), "{e}");
        }
        other => panic!("the owner took itself over: {other:?}"),
    }
    // Nothing changed: the same epoch, still healthy.
    assert_eq!(c.namespace().unwrap().epoch, ns.epoch);
    c.healthz().unwrap();
    // The CLI says the same, with the refusal's exit status.
    let out = Command::new(pdstor_bin()).args(["takeover", "--server", &d.server]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("takeover_failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn layout() -> pdstor_client::layout::Layout {
    pdstor_client::layout::Layout {
        model_id: "owners".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-owners".into(),
    }
}

fn put(d: &Daemon, req: &str, seed: u64) -> pdstor_client::receipt::Receipt {
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 2).unwrap();
    let bytes: Vec<u8> = (0..2).flat_map(|i| pdstor_engine::payload::chunk(seed, i, SLOT as usize)).collect();
    w.put(req, &layout(), &bytes, 2, Some(1)).unwrap().receipt
}

/// Two owners side by side, each its own namespace: a receipt of one is
/// refused by the other (`namespace_mismatch`, nothing done); a client
/// given every address — a dead one first — finds, for each receipt, the
/// daemon that serves its namespace; and one owner's death touches nothing
/// of the other's.
#[test]
fn a_client_given_several_owners_finds_the_one_that_serves_its_receipts_namespace() {
    let (da, db) = (
        tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap(),
        tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap(),
    );
    let a = Daemon::format_and_start(da.path(), 4, SLOT);
    let b = Daemon::format_and_start(db.path(), 4, SLOT);
    let (ra, rb) = (put(&a, "on-a", 1), put(&b, "on-b", 2));
    assert_ne!(ra.namespace, rb.namespace);
    // One owner refuses the other's receipt, changing nothing.
    match Client::new(&b.server).claim(&ra, "r", "s", 60_000) {
        Err(ClientError::Api(e)) => assert_eq!(e.code, "namespace_mismatch", "{e}"),
        other => panic!("owner b claimed a receipt of a's namespace: {other:?}"),
    }
    let dead = format!("unix:{}", da.path().join("nobody.sock").display());
    let all = Client::new(&format!("{dead},{},{}", b.server, a.server));
    let ca = all.claim(&ra, "r", "s", 60_000).unwrap();
    assert_eq!(ca.namespace, ra.namespace);
    let cb = all.claim(&rb, "r", "s", 60_000).unwrap();
    assert_eq!(cb.namespace, rb.namespace);
    // Owner b dies: a's publication is untouched, and the same client
    // still reaches a; b's receipt now reaches no one, said as such.
    drop(b);
    let states: Vec<String> =
        Client::new(&a.server).publications(None, false).unwrap().into_iter().map(|p| p.state).collect();
    assert_eq!(states, ["CLAIMED"]);
    all.release(&put(&a, "on-a-again", 3)).unwrap();
    match all.claim(&rb, "r2", "s2", 60_000) {
        Err(ClientError::Api(e)) => assert_eq!(e.code, "namespace_mismatch", "{e}"),
        other => panic!("b's receipt after b died: {other:?}"),
    }
    let e = Client::new(&format!("{dead},{dead}")).namespace().unwrap_err();
    assert!(e.to_string().contains("none of the 2 daemons could be reached"), "{e}");
}
