//! Takeover across owners (issue 35), where this host can check it: a
//! standby needs a namespace with persistent reservations (NVMe; the
//! topology suite's NVMe/TCP target on the series kernel runs the real
//! takeover), so on a file it refuses to start and writes nothing; a
//! takeover is asked of a standby, never of the owner.

use std::process::Command;

use pdstor::client::{Client, ClientError};
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
