//! Issue 34: what an outside campaign against the identity daemon found, and
//! what a hostile local user, a second tenant and a flaky machine try next.
//! The attacker is uid 4002 of tenant `mallory` (`pdstor_tests::mallory`);
//! the victim is root, the daemon's user. Every attack must be refused with
//! nothing changed, and the victim then finishes undisturbed.
//!
//! Needs root and `setpriv` (util-linux); says SKIP otherwise.

use std::time::{Duration, Instant};

use pdstor_client::receipt::Receipt;
use pdstor_client::{Client, ClientError, Reader, Writer};
use pdstor_tests::mallory::{Attack, Lab, MALLORY, SLOT, as_mallory, layout, refused, unavailable};
use pdstor_tests::{Daemon, pdstor_bin};

/// The attacker's side: does nothing unless this binary was re-run with an attack.
#[test]
fn attacker() {
    pdstor_tests::mallory::attacker();
}

/// Polls `what` every 20 ms until it holds, for at most 20 s.
#[track_caller]
fn until(why: &str, mut what: impl FnMut() -> bool) {
    let t = Instant::now();
    while !what() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {why}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A metric's value in the daemon's exposition, by its full name with labels.
fn metric_of(c: &Client, name: &str) -> Option<u64> {
    let text = c.metrics().expect("the metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

/// The value of a metric the daemon always shows.
fn metric(c: &Client, name: &str) -> u64 {
    metric_of(c, name).unwrap_or_else(|| panic!("no {name} in the metrics"))
}

/// Finding 1: another tenant's refused prepare of the id a victim's prepare
/// is waiting with, then its cancel of that id. Before the fix the refused
/// prepare replaced the record of who was preparing the id and removed it
/// on its way out, so the cancel went through and the victim's prepare
/// failed `aborted`.
#[test]
fn a_refused_prepare_cannot_make_another_tenants_waiting_prepare_its_own() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_refused_prepare_cannot_make_another_tenants_waiting_prepare_its_own", &why);
    }
    let lab = Lab::with(4, "slots = 2");
    let d = lab.daemon(&["--admission-timeout-ms", "60000"]);
    let server = d.server.clone();
    let c = Client::new(&server);
    let filler = c.prepare("filler", &layout(), 4, "w").expect("the filler takes every slot");
    let waiting = {
        let server = server.clone();
        std::thread::spawn(move || Client::new(&server).prepare("a-wait", &layout(), 1, "w"))
    };
    until("the victim's prepare waits for capacity", || metric(&c, "pdstor_admission_waiting") == 1);

    refused(
        as_mallory(&Attack::Prepare { server: server.clone(), req: "a-wait".into(), chunks: 1 }),
        "duplicate_request",
    );
    refused(as_mallory(&Attack::Cancel { server: server.clone(), req: "a-wait".into() }), "not_owner");
    assert_eq!(metric(&c, "pdstor_admission_waiting"), 1, "the victim's prepare stopped waiting");

    c.abort(filler.publication, &filler.writer_token).expect("the victim frees the slots");
    let p = waiting.join().expect("the waiting prepare").expect("the victim's prepare is admitted");
    let live = c.publications(None, false).expect("listing");
    let mine = live.iter().find(|l| l.publication == p.publication).expect("the victim's publication");
    assert_eq!((mine.req_id.as_str(), mine.state.as_str()), ("a-wait", "PREPARED"));
}

/// A READY publication of `chunks` chunks of [`SLOT`] bytes, stored and
/// published by the victim; its payload comes back for byte checks.
fn ready(d: &Daemon, req: &str, chunks: u32) -> (Receipt, Vec<u8>) {
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, chunks).expect("a writer");
    let kv: Vec<u8> = (0..chunks).flat_map(|i| pdstor_engine::payload::chunk(7, u64::from(i), SLOT as usize)).collect();
    (w.put(req, &layout(), &kv, chunks, Some(11)).expect("put").receipt, kv)
}

/// Finding 3, the answer lost on the way: the same reader and session
/// claiming again get the same claim receipt (before the fix: `409
/// already_claimed`, and the slots were held for good), and can then read.
/// A claim by another session, or by another identity, is still refused.
#[test]
fn a_claim_whose_answer_was_lost_is_answered_again() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let timeline = dir.path().join("timeline.jsonl");
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let d = Daemon::start_with(&target, dir.path(), &["--timeline", timeline.to_str().expect("UTF-8")]);
    let c = Client::new(&d.server);
    let (receipt, kv) = ready(&d, "lost-answer", 2);
    let first = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("the claim");
    let again = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("the claim, repeated");
    assert_eq!(again, first, "a repeated claim answers the same receipt");
    for (reader, session, lease) in
        [("reader-b", "session-a", 60_000), ("reader-a", "session-b", 60_000), ("reader-a", "session-a", 1_000)]
    {
        match c.claim(&receipt, reader, session, lease) {
            Err(ClientError::Api(e)) => assert_eq!(e.code, "already_claimed", "{}", e.message),
            other => panic!("a different claim ({reader}, {session}, {lease} ms) was answered: {other:?}"),
        }
    }
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    let restored = r.get(&again, &layout()).expect("the reader restores with the repeated answer");
    assert_eq!(r.restored_bytes(restored.len).expect("the bytes"), kv, "byte for byte");
    c.ack(&again, &restored.restore_digest).expect("ack");
    let lines = pdstor_client::timeline::read(&timeline).expect("the timeline");
    assert!(
        lines.iter().any(|(_, e)| e.as_ref().is_ok_and(|e| e.event == "claim_again")),
        "no repeated claim on the timeline"
    );
    // The repeat is no second claim, and names the first's receipt (this
    // reader writes no timeline of its own, and no probes judge the paths:
    // the checker's other findings are not this test's).
    let report = pdstor_proof::timeline::check::check(&lines, pdstor_engine::io::PayloadPath::Host);
    let about_the_claim: Vec<_> = report
        .violations
        .iter()
        .filter(|v| {
            matches!(v.kind, "duplicate_claim" | "receipt_mismatch" | "reader_mismatch") || v.message.contains("claim")
        })
        .collect();
    assert!(about_the_claim.is_empty(), "{about_the_claim:?}");
}

/// Finding 3, the daemon killed after the CLAIM committed: the repeated
/// claim answers the claim's receipt (of the epoch before the kill), which
/// adopt refuses as fenced and its holder reclaims — no operator needed.
#[test]
fn a_claim_lost_to_a_kill_is_answered_again_and_reclaimed_by_its_claimant() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let mut d = Daemon::start(&target, dir.path());
    let (receipt, _) = ready(&d, "killed", 4);
    let lost = Client::new(&d.server).claim(&receipt, "reader-a", "session-a", 60_000).expect("the claim");
    d.kill9_and_restart();
    let c = Client::new(&d.server);
    let again = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("the claim, repeated after the kill");
    assert_eq!(again, lost, "the same claim receipt");
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    match r.adopt(&again, &layout()) {
        Err(ClientError::Api(e)) => assert_eq!(e.code, "fenced", "{}", e.message),
        other => panic!("a claim of the epoch before the kill was adopted: {other:?}"),
    }
    c.reclaim(&again).expect("its claimant reclaims");
    let all = c.prepare("after", &layout(), 4, "w").expect("every slot is free again");
    c.abort(all.publication, &all.writer_token).expect("abort");
}

/// Finding 3, nobody holds the receipt: an admin reclaims by publication
/// (another tenant may not), the claim's session is fenced, the reclaim is
/// journaled (it survives a restart) and on the timeline.
#[test]
fn an_operator_reclaims_a_claim_nobody_holds_a_receipt_for() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("an_operator_reclaims_a_claim_nobody_holds_a_receipt_for", &why);
    }
    let lab = Lab::with(4, "");
    let timeline = lab.dir.path().join("timeline.jsonl");
    let mut d = lab.daemon(&["--timeline", timeline.to_str().expect("UTF-8")]);
    let c = Client::new(&d.server);
    let (receipt, _) = ready(&d, "orphan-claim", 3);
    let lost = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("the claim");
    let id = lost.publication;
    refused(
        as_mallory(&Attack::OperatorReclaim { server: d.server.clone(), publication: id, reason: "mine now".into() }),
        "forbidden",
    );
    assert_eq!(state(&c, id).as_deref(), Some("CLAIMED"), "the refused reclaim changed the claim");
    match c.reclaim_publication(id, " ") {
        Err(ClientError::Api(e)) => assert_eq!(e.code, "bad_request", "{}", e.message),
        other => panic!("a reclaim without a reason went through: {other:?}"),
    }
    let out = std::process::Command::new(pdstor_bin())
        .args(["reclaim", "--server", &d.server, "--publication", &id.to_string(), "--reason", "the reader host died"])
        .output()
        .expect("pdstor reclaim");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(state(&c, id), None, "the publication is gone");
    // Its session is fenced: the claim receipt, found later, reads nothing.
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    assert!(r.adopt(&lost, &layout()).is_err(), "the reclaimed claim was adopted");
    d.kill9_and_restart();
    let c = Client::new(&d.server);
    assert_eq!(state(&c, id), None, "the reclaim was not journaled: the publication is back after a restart");
    let all = c.prepare("after", &layout(), 4, "w").expect("every slot is free again");
    c.abort(all.publication, &all.writer_token).expect("abort");
    let text = std::fs::read_to_string(&timeline).expect("the timeline");
    assert!(
        text.lines()
            .any(|l| l.contains("\"reclaim\"") && l.contains("by an operator") && l.contains("the reader host died")),
        "no operator reclaim on the timeline:\n{text}"
    );
    // With the claim receipt's holder gone, an operator's word is the only way: the
    // refusals name it.
    match c.reclaim_publication(id, "again") {
        Err(ClientError::Api(e)) => assert_eq!(e.code, "unknown_publication", "{}", e.message),
        other => panic!("a second reclaim: {other:?}"),
    }
}

fn state(c: &Client, publication: u64) -> Option<String> {
    c.publications(None, false).expect("listing").into_iter().find(|p| p.publication == publication).map(|p| p.state)
}

/// Finding 6: the daemon's timeline (receipt signatures, request ids,
/// tenants) and a reader's restored bytes are the owner's alone, 0600
/// under a umask of 022 (before: 0644).
#[test]
fn the_timeline_and_restored_bytes_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let timeline = dir.path().join("timeline.jsonl");
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let d = Daemon::start_with(&target, dir.path(), &["--timeline", timeline.to_str().expect("UTF-8")]);
    let (receipt, _) = ready(&d, "private", 1);
    let claim = Client::new(&d.server).claim(&receipt, "reader-a", "session-a", 60_000).expect("claim");
    let claim_file = dir.path().join("claim.json");
    std::fs::write(&claim_file, serde_json::to_vec(&claim).expect("a receipt")).expect("the receipt");
    let layout_file = dir.path().join("layout.json");
    std::fs::write(&layout_file, serde_json::to_vec(&layout()).expect("a layout")).expect("the layout");
    let out_file = dir.path().join("restored.bin");
    let client_timeline = dir.path().join("reader.jsonl");
    let out = std::process::Command::new(pdstor_bin())
        .args(["get", "--server", &d.server, "--data-socket"])
        .arg(&d.data_socket)
        .arg("--claim")
        .arg(&claim_file)
        .arg("--layout")
        .arg(&layout_file)
        .arg("--out")
        .arg(&out_file)
        .arg("--timeline")
        .arg(&client_timeline)
        .arg("--ack")
        .output()
        .expect("pdstor get");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in [&timeline, &out_file, &client_timeline] {
        let mode = std::fs::metadata(f).expect("the file").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is {mode:o}", f.display());
    }
}

/// `pdstor serve` as `cmd` prepared it, expected to refuse to start: its
/// stderr. One still running after 20 s started: it is killed, and that fails.
fn refused_start(mut cmd: std::process::Command) -> String {
    use std::io::Read;
    let mut child =
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().expect("pdstor serve");
    let t = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for pdstor serve") {
            break Some(status);
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().expect("its stderr").read_to_string(&mut err).expect("reading its stderr");
    assert!(status.is_some_and(|s| !s.success()), "the daemon started: {err}");
    err
}

/// A directory `name` in the lab, owned by `uid`:`gid` (unchanged where
/// `None`), with `mode`.
fn lab_dir(lab: &Lab, name: &str, owner: (Option<u32>, Option<u32>), mode: u32) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let dir = lab.dir.path().join(name);
    std::fs::create_dir(&dir).expect("mkdir");
    std::os::unix::fs::chown(&dir, owner.0, owner.1).expect("chown");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).expect("chmod");
    dir
}

/// `pdstor serve` of the lab's target with both sockets in `sockets`.
fn serve_in(lab: &Lab, sockets: &std::path::Path) -> std::process::Command {
    let mut serve = std::process::Command::new(pdstor_bin());
    serve.arg("serve").arg("--target").arg(&lab.target);
    serve.arg("--listen").arg(format!("unix:{}", sockets.join("control.sock").display()));
    serve.arg("--data-socket").arg(sockets.join("data.sock"));
    serve
}

/// Finding 4: a socket directory root:4002 0770 (uid 4002 could rename
/// `control.sock` away and bind its own) is refused at start, naming the
/// group; nothing is bound in it.
#[test]
fn a_group_writable_socket_directory_is_refused() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_group_writable_socket_directory_is_refused", &why);
    }
    let lab = Lab::with(2, "");
    let socks = lab_dir(&lab, "sockets", (Some(0), Some(MALLORY)), 0o770);
    let err = refused_start(serve_in(&lab, &socks));
    assert!(err.contains("is writable by group 4002") && err.contains("chmod go-w"), "{err}");
    assert_eq!(std::fs::read_dir(&socks).expect("the directory").count(), 0, "something was bound there");
}

/// Finding 5: with no `XDG_RUNTIME_DIR`, uid 4002 makes uid 4001's fallback
/// socket directory (`pdstor-4001` in the shared temporary directory) a
/// symbolic link to the temporary directory itself; a uid-4001 daemon
/// refuses it instead of serving its sockets there.
#[test]
fn a_daemon_does_not_follow_another_users_symlink_to_its_socket_directory() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_daemon_does_not_follow_another_users_symlink_to_its_socket_directory", &why);
    }
    const VICTIM: u32 = 4001;
    let lab = Lab::with(2, "");
    std::os::unix::fs::chown(&lab.target, Some(VICTIM), None).expect("the target is uid 4001's");
    let tmp = lab_dir(&lab, "tmp", (None, None), 0o1777);
    let link = tmp.join(format!("pdstor-{VICTIM}"));
    let made = as_mallory(&Attack::Symlink { to: tmp.clone(), link: link.clone() });
    assert!(made.ok, "uid 4002 could not plant the link: {}", made.detail);
    let mut serve = pdstor_tests::mallory::as_uid(VICTIM);
    serve.arg(pdstor_bin()).arg("serve").arg("--target").arg(&lab.target);
    serve.env_remove("XDG_RUNTIME_DIR").env("TMPDIR", &tmp);
    let err = refused_start(serve);
    assert!(err.contains("is a symbolic link (to ") && err.contains(&link.display().to_string()), "{err}");
    let sockets: Vec<_> = std::fs::read_dir(&tmp)
        .expect("the temporary directory")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sock"))
        .collect();
    assert!(sockets.is_empty(), "sockets were bound in the shared directory: {sockets:?}");
}

/// Writes `raw` to the control socket and reads the answer until the daemon
/// closes: (status, body). A daemon that writes but keeps the connection
/// open past 10 s fails.
fn raw_exchange(socket: &std::path::Path, raw: &[u8]) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).expect("the control socket");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("a read timeout");
    // The daemon may answer and close before it read all of a large request.
    let _ = s.write_all(raw);
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).expect("the daemon answers and closes");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{answer:?}"));
    (status, answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

/// Finding 7: what hyper refuses before any handler runs — two
/// Content-Lengths, a Transfer-Encoding other than chunked, a negative or
/// huge Content-Length, garbage, a header flood, a 1 MiB request line — is
/// answered in the JSON error shape (before: an empty body), and nothing
/// runs: the daemon serves the next caller as before.
#[test]
fn every_refusal_hyper_makes_itself_has_the_json_error_shape() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let d = Daemon::start(&target, dir.path());
    let prepare = r#"{"req_id":"smuggled","layout":{"model_id":"m","dtype":"bf16","layers":1,"kv_heads":1,"head_dim":64,"chunk_tokens":16,"kv_format":"x"},"total_chunks":1,"writer":"w"}"#;
    let flood: String = (0..200).map(|i| format!("x-flood-{i}: y\r\n")).collect();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "two Content-Lengths",
            format!("POST /storage-pd/prepare HTTP/1.1\r\nHost: p\r\nContent-Length: {}\r\nContent-Length: 3\r\n\r\n{prepare}", prepare.len()).into_bytes(),
            400,
            "malformed_http",
        ),
        (
            "an obfuscated Transfer-Encoding",
            format!("POST /storage-pd/prepare HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked, identity\r\n\r\n{:x}\r\n{prepare}\r\n0\r\n\r\n", prepare.len()).into_bytes(),
            400,
            "malformed_http",
        ),
        ("a negative Content-Length", b"POST /storage-pd/prepare HTTP/1.1\r\nHost: p\r\nContent-Length: -1\r\n\r\n".to_vec(), 400, "malformed_http"),
        (
            "a huge Content-Length",
            b"POST /storage-pd/prepare HTTP/1.1\r\nHost: p\r\nContent-Length: 99999999999999999999999\r\n\r\n".to_vec(),
            400,
            "malformed_http",
        ),
        ("garbage", b"\x16\x03\x01garbage\r\n\r\n".to_vec(), 400, "malformed_http"),
        ("a header flood", format!("GET /healthz HTTP/1.1\r\nHost: p\r\n{flood}\r\n").into_bytes(), 431, "headers_too_large"),
        (
            "a 1 MiB request line",
            format!("GET /{} HTTP/1.1\r\nHost: p\r\n\r\n", "a".repeat(1 << 20)).into_bytes(),
            431,
            "headers_too_large",
        ),
    ];
    let socket = d.control_socket();
    for (what, raw, status, code) in cases {
        let (got, body) = raw_exchange(&socket, &raw);
        assert_eq!(got, status, "{what}: {body}");
        let e: pdstor_client::wire::ErrorBody = serde_json::from_str(&body)
            .unwrap_or_else(|err| panic!("{what}: not the JSON error shape ({err}): {body:?}"));
        assert_eq!((e.status, e.code.as_str()), (status, code), "{what}: {}", e.message);
        assert!(!e.message.is_empty(), "{what}: no message");
    }
    let c = Client::new(&d.server);
    assert!(c.publications(None, false).expect("listing").is_empty(), "a refused request prepared something");
    c.healthz().expect("the daemon serves the next caller");
}

/// The daemon's thread count (`/proc/<pid>/status`).
fn threads(d: &Daemon) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid().expect("running"))).expect("its status");
    status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|n| n.trim().parse().ok()).expect("Threads:")
}

/// Finding 2, idle connections: 300 data connections that never send a
/// request are closed after `--data-idle-timeout-ms`, each told why; the
/// threads they held come back, and the plane serves again (before: held
/// for good, and legitimate clients answered `too_many_connections`). A
/// frame trickled in is cut off after `--body-timeout-ms`.
#[test]
fn idle_and_trickling_data_connections_are_closed_and_their_threads_come_back() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let d = Daemon::start_with(&target, dir.path(), &["--data-idle-timeout-ms", "1500", "--body-timeout-ms", "1000"]);
    until("the daemon settles", || threads(&d) > 0);
    // A client that connects early and registers late is not hurt: its
    // connection, closed as idle, is replaced (it held nothing).
    let mut late = pdstor_client::DataConn::connect(&d.data_socket).expect("an early data connection");
    std::thread::sleep(Duration::from_millis(100));
    let baseline = threads(&d) - 1;
    let mut idle: Vec<std::os::unix::net::UnixStream> =
        (0..300).map(|_| std::os::unix::net::UnixStream::connect(&d.data_socket).expect("a data connection")).collect();
    until("the daemon holds threads for them", || threads(&d) >= baseline + 200);
    until("room again after the idle ones are closed", || threads(&d) <= baseline + 2);
    // A frame's first two bytes, then nothing.
    let mut trickle = std::os::unix::net::UnixStream::connect(&d.data_socket).expect("a data connection");
    trickle.write_all(&[16, 0]).expect("two bytes of a length");
    for s in idle.iter_mut().take(3) {
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("a read timeout");
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).expect("closed by the daemon");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.contains("data-idle-timeout-ms") || text.contains("too_many_connections"), "{text}");
    }
    trickle.set_read_timeout(Some(Duration::from_secs(5))).expect("a read timeout");
    let mut answer = Vec::new();
    trickle.read_to_end(&mut answer).expect("the trickler is closed");
    assert!(String::from_utf8_lossy(&answer).contains("body_timeout"), "{}", String::from_utf8_lossy(&answer));
    let buf = pdstor_engine::buffer::Buffer::memfd("late", 4096).expect("a memfd");
    late.register(&buf).expect("the late registration, on a connection the daemon closed as idle");
    drop(late);
    let (receipt, _) = ready(&d, "after-the-flood", 1);
    assert_eq!(receipt.req_id, "after-the-flood");
    drop(idle);
    until("the daemon's threads are back to baseline", || threads(&d) <= baseline + 4);
}

/// Finding 2, shares: a tenant with no connection quota holds every data
/// connection it can (each with a buffer, so none is idle); the other tenant
/// still connects and hands off (before: all 24 were the first's, and the
/// second was locked out).
#[test]
fn one_tenant_cannot_take_every_data_connection() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("one_tenant_cannot_take_every_data_connection", &why);
    }
    use std::io::BufRead;
    let lab = Lab::with(4, "");
    let d = lab.daemon(&["--max-data-connections", "24"]);
    let mut hoarder =
        pdstor_tests::mallory::mallory_cmd(&Attack::Hoard { data: d.data_socket.clone(), n: 24, secs: 6 })
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the hoarder");
    let out = hoarder.stdout.take().expect("its stdout");
    let mut lines = std::io::BufReader::new(out).lines();
    let held: usize = loop {
        let line = lines.next().expect("the hoarder reports").expect("a line");
        if let Some(n) = line.strip_prefix("HOARDING ") {
            break n.trim().parse().expect("a count");
        }
    };
    assert_eq!(held, 16, "tenant mallory holds {held} of 24: the default tenant's share is 8");
    let (receipt, kv) = ready(&d, "not-locked-out", 2);
    let c = Client::new(&d.server);
    let claim = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("claim");
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader connects beside the hoard");
    let restored = r.get(&claim, &layout()).expect("restore");
    assert_eq!(r.restored_bytes(restored.len).expect("the bytes"), kv);
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(hoarder.wait().expect("the hoarder").success());
    let report =
        rest.iter().find_map(|l| l.split_once("ATTACK-OUTCOME ").map(|(_, o)| o.to_owned())).expect("a report");
    assert!(report.contains("kept for the other tenants' guaranteed shares"), "{report}");
}

/// `umount` when dropped.
struct Mounted(std::path::PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        // A daemon's io_uring lets go of its target file only when the
        // kernel's ring teardown runs, shortly after the process exits: the
        // filesystem is busy until then.
        let t = Instant::now();
        let umount = || std::process::Command::new("umount").arg(&self.0).stderr(std::process::Stdio::null()).status();
        while !umount().is_ok_and(|s| s.success()) {
            if t.elapsed() > Duration::from_secs(10) {
                eprintln!("{} is still busy after 10 s: detached lazily", self.0.display());
                let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A counter's value, or 0 while it has never counted.
fn metric_or_zero(c: &Client, name: &str) -> u64 {
    metric_of(c, name).unwrap_or(0)
}

/// Finding 8: the journal hits ENOSPC (the target's journal blocks are holes
/// on a filesystem that fills up). Clients get `503 store_failed`; the log
/// says why at ERROR when it happens (before: only at exit); the accounting
/// check knows the store failed (before: an invariant violation counted on
/// every request); after the space is back and a restart, what was
/// acknowledged loads byte for byte.
#[test]
fn a_journal_enospc_is_said_when_it_happens_and_is_no_invariant_violation() {
    journal_enospc("a_journal_enospc_is_said_when_it_happens_and_is_no_invariant_violation", false);
}

/// Finding 8 with the daemon's log on the same full filesystem: a log line
/// that cannot be written is dropped and counted, and never fails the step
/// it describes (before: the handler panicked, 500 `internal`).
#[test]
fn a_log_on_a_full_disk_fails_no_step() {
    journal_enospc("a_log_on_a_full_disk_fails_no_step", true);
}

fn journal_enospc(test: &str, log_on_the_full_disk: bool) {
    if !pdstor_testkit::is_root() {
        return pdstor_testkit::skip(test, "needs root for a loop device and a mount");
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let lo = pdstor_testkit::LoopDevice::attach(&dir.path().join("fs.img"), 48 << 20)
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    let mkfs = std::process::Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096"]).arg(&lo.path).output();
    assert!(mkfs.expect("mkfs.ext4").status.success(), "mkfs.ext4 failed");
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).expect("mkdir");
    let out = std::process::Command::new("mount").arg(&lo.path).arg(&mnt).output().expect("mount");
    assert!(out.status.success(), "mount: {}", String::from_utf8_lossy(&out.stderr));
    let _mounted = Mounted(mnt.clone());
    // Formatted elsewhere, copied in with its zeros as holes: nothing of the
    // journal or the slots is allocated until written.
    let formatted = pdstor_tests::format_file(dir.path(), 8, SLOT);
    let target = mnt.join("target.img");
    let cp = std::process::Command::new("cp").arg("--sparse=always").arg(&formatted).arg(&target).status();
    assert!(cp.expect("cp").success());
    let mut d = Daemon::start(&target, if log_on_the_full_disk { &mnt } else { dir.path() });
    let (acked, kv) = ready(&d, "before-the-disk-filled", 2);
    // The daemon allocates its target when it opens it; holes come later
    // (a thin device, a careless `fallocate --dig-holes`): every journal
    // block past the records written so far, both halves, is punched out.
    let (status, body) = pdstor_tests::http_exchange(&d.control_socket(), "GET", "/readyz", None);
    assert_eq!(status, 200, "{body}");
    let ready_z: serde_json::Value = serde_json::from_str(&body).expect("readyz's JSON");
    let used = ready_z["journal_used"].as_u64().expect("journal_used");
    let (journal, half) = (2 * 4096u64, 256u64 << 10);
    let from = (journal + used).next_multiple_of(4096) + 4096;
    let punch = std::process::Command::new("fallocate")
        .args(["--punch-hole", "--offset", &from.to_string(), "--length", &(journal + 2 * half - from).to_string()])
        .arg(&target)
        .status();
    assert!(punch.expect("fallocate").success(), "punching the journal's unwritten blocks");
    // Fill the filesystem.
    let fill = std::fs::File::create(mnt.join("fill")).expect("the filler");
    let mut n = 0u64;
    while std::os::unix::fs::FileExt::write_at(&fill, &[0xAA; 1 << 16], n).is_ok_and(|w| w > 0) {
        n += 1 << 16;
    }
    while std::os::unix::fs::FileExt::write_at(&fill, &[0xAA; 512], n).is_ok_and(|w| w > 0) {
        n += 512;
    }
    let _ = fill.sync_all();
    // Finding 9: a format that runs out of space leaves nothing behind.
    let partial = mnt.join("new-target.img");
    let out = std::process::Command::new(pdstor_bin())
        .args(["format", "--size", "64M", "--chunk-slot", "1M", "--journal", "256k", "--target"])
        .arg(&partial)
        .output()
        .expect("pdstor format");
    assert!(!out.status.success(), "a format on a full disk succeeded");
    assert!(!partial.exists(), "the failed format left {} behind", partial.display());
    let c = Client::new(&d.server);
    let mut failure = None;
    for i in 0..400 {
        match c.prepare(&format!("after-{i}"), &layout(), 1, "w") {
            Ok(p) => {
                if let Err(e) = c.abort(p.publication, &p.writer_token) {
                    failure = Some(e);
                    break;
                }
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    match failure {
        Some(ClientError::Api(e)) => {
            assert_eq!((e.status, e.code.as_str()), (503, "store_failed"), "{}", e.message);
            assert!(e.message.contains("No space left on device"), "{}", e.message);
        }
        other => panic!("the journal never ran out of space: {other:?}"),
    }
    for i in 0..5 {
        assert!(c.prepare(&format!("refused-{i}"), &layout(), 1, "w").is_err(), "a failed store took a change");
    }
    assert_eq!(metric_or_zero(&c, "pdstor_invariant_violations_total"), 0, "the failed store counted as a violation");
    if log_on_the_full_disk {
        assert!(metric_or_zero(&c, "pdstor_log_write_failures_total") > 0, "no log write failed on the full disk");
    } else {
        let log = std::fs::read_to_string(&d.log).expect("the daemon's log");
        let said = log.lines().find(|l| l.contains("ERROR") && l.contains("the store failed")).unwrap_or_default();
        assert!(said.contains("No space left on device"), "no ERROR line named the ENOSPC when it happened:\n{log}");
    }
    let _ = d.stop();
    drop(fill);
    std::fs::remove_file(mnt.join("fill")).expect("the space is given back");
    d.restart();
    let c = Client::new(&d.server);
    let claim =
        c.claim(&acked, "reader-a", "session-a", 60_000).expect("the acknowledged publication, after the restart");
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    let restored = r.get(&claim, &layout()).expect("restore");
    assert_eq!(r.restored_bytes(restored.len).expect("the bytes"), kv, "byte for byte");
}

/// Finding 9: a target removed, then replaced, under the running daemon
/// makes `/healthz` and `/readyz` answer 503 `target_gone`, saying which and
/// what to do, and the log says it at ERROR (before: 200 until a restart).
#[test]
fn a_vanished_or_replaced_target_makes_the_daemon_unhealthy() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let d = Daemon::start(&target, dir.path());
    let socket = d.control_socket();
    assert_eq!(pdstor_tests::http_exchange(&socket, "GET", "/healthz", None).0, 200);
    let moved = dir.path().join("moved.img");
    std::fs::rename(&target, &moved).expect("the target moved away");
    for route in ["/healthz", "/readyz"] {
        let (status, body) = pdstor_tests::http_exchange(&socket, "GET", route, None);
        let e: pdstor_client::wire::ErrorBody = serde_json::from_str(&body).expect("the JSON error shape");
        assert_eq!((status, e.code.as_str()), (503, "target_gone"), "{route}: {body}");
        assert!(e.message.contains("was removed") && e.message.contains("put the target back"), "{}", e.message);
    }
    std::fs::write(&target, b"another file").expect("another file at the path");
    let (status, body) = pdstor_tests::http_exchange(&socket, "GET", "/healthz", None);
    assert!(status == 503 && body.contains("was replaced by another file"), "{status} {body}");
    std::fs::remove_file(&target).expect("the other file goes");
    std::fs::rename(&moved, &target).expect("the target is put back");
    assert_eq!(pdstor_tests::http_exchange(&socket, "GET", "/healthz", None).0, 200, "healthy again");
    let log = std::fs::read_to_string(&d.log).expect("the log");
    assert!(log.lines().any(|l| l.contains("ERROR") && l.contains("was removed while the daemon serves it")), "{log}");
}

/// Finding 9: two chunks of one load placed on the same bytes of a buffer
/// are refused up front, naming the overlap, and nothing is loaded (before:
/// `500 load_failed … checksum mismatch`, pointing at the media); the claim
/// then loads and acknowledges as usual.
#[test]
fn a_load_into_overlapping_places_names_the_overlap() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let d = Daemon::start(&target, dir.path());
    let (receipt, kv) = ready(&d, "overlap", 2);
    let c = Client::new(&d.server);
    let claim = c.claim(&receipt, "reader-a", "session-a", 60_000).expect("claim");
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    let manifest = r.adopt(&claim, &layout()).expect("adopt");
    let mut conn = pdstor_client::DataConn::connect(&d.data_socket).expect("a data connection");
    let into = pdstor_engine::buffer::Buffer::memfd("into", 2 * SLOT as usize).expect("a memfd");
    let b = conn.register(&into).expect("register");
    let at =
        |index: u32, offset: u64| pdstor_client::wire::DataChunk { index, buffer: b, offset, len: 0, crc32c: None };
    for (what, chunks) in
        [("the same offset", vec![at(0, 0), at(1, 0)]), ("half a chunk apart", vec![at(1, SLOT / 2), at(0, 0)])]
    {
        match conn.load(&claim, chunks) {
            Err(ClientError::Api(e)) => {
                assert_eq!((e.status, e.code.as_str()), (400, "bad_request"), "{what}: {}", e.message);
                assert!(e.message.contains("would land on the same bytes of buffer"), "{what}: {}", e.message);
            }
            other => panic!("{what}: an overlapping load was answered {other:?}"),
        }
    }
    let restored = r.load(&claim, manifest).expect("the claim loads as usual after the refusals");
    assert_eq!(r.restored_bytes(restored.len).expect("the bytes"), kv, "byte for byte");
    c.ack(&claim, &restored.restore_digest).expect("ack");
}

/// Past the list: a timeline path in a directory another user can write,
/// got to first — its own world-writable file, or a link to a file it can
/// read — would hand it every receipt signature the daemon writes. The
/// daemon refuses both at start, writing nothing there.
#[test]
fn a_timeline_planted_by_another_user_is_refused() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_timeline_planted_by_another_user_is_refused", &why);
    }
    let lab = Lab::with(2, "");
    // A directory uid 4002 controls (in a sticky shared one the kernel's
    // protected_symlinks may refuse the link first; this is pdstor's own check).
    let shared = lab_dir(&lab, "shared", (Some(MALLORY), None), 0o755);
    let planted = shared.join("timeline.jsonl");
    assert!(as_mallory(&Attack::Plant { path: planted.clone() }).ok, "uid 4002 could not plant its file");
    let loot = shared.join("loot.jsonl");
    assert!(as_mallory(&Attack::Plant { path: loot.clone() }).ok, "uid 4002 could not plant its file");
    let linked = shared.join("linked.jsonl");
    assert!(as_mallory(&Attack::Symlink { to: loot.clone(), link: linked.clone() }).ok, "no link");
    for (path, says) in [(&planted, "belongs to uid 4002"), (&linked, "is a symbolic link")] {
        let mut serve = serve_in(&lab, lab.dir.path());
        serve.arg("--timeline").arg(path);
        let err = refused_start(serve);
        assert!(err.contains(says), "{}: {err}", path.display());
    }
    for f in [&planted, &loot] {
        assert_eq!(std::fs::metadata(f).expect("the planted file").len(), 0, "{} was written to", f.display());
    }
}

/// What the daemon holds: threads, descriptors, resident KiB.
fn held(d: &Daemon) -> (usize, usize, u64) {
    let pid = d.pid().expect("running");
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("its descriptors").count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
    (threads(d), fds, kib.expect("VmRSS"))
}

/// Past the list, a flaky client and a hostile one in turn — idle and
/// trickling connections on both planes, unparsable HTTP, a writer that
/// vanishes mid-store, a client that registers its whole buffer allowance
/// and vanishes — and after each the daemon holds what it held before:
/// threads, descriptors, memory (within 32 MiB), and every slot free.
#[test]
fn after_each_hostile_client_the_daemon_holds_what_it_held_before() {
    use std::io::Write;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let args = ["--data-idle-timeout-ms", "500", "--body-timeout-ms", "500", "--header-timeout-ms", "500"];
    let d = Daemon::start_with(&target, dir.path(), &args);
    // Warm: one whole handoff, so what a first handoff allocates for good is in the baseline.
    let (receipt, _) = ready(&d, "warm", 2);
    let c = Client::new(&d.server);
    let claim = c.claim(&receipt, "r", "s", 60_000).expect("claim");
    let mut r = Reader::new(&d.server, &d.data_socket).expect("a reader");
    let restored = r.get(&claim, &layout()).expect("restore");
    c.ack(&claim, &restored.restore_digest).expect("ack");
    drop(r);
    std::thread::sleep(Duration::from_millis(1500));
    let base = held(&d);
    let settled = |what: &str| {
        let t = Instant::now();
        loop {
            let now = held(&d);
            if now.0 <= base.0 + 2 && now.1 <= base.1 && now.2 <= base.2 + 32 * 1024 {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "after {what}: the daemon holds {now:?}, it held {base:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let p = c.prepare("all-slots", &layout(), 4, "w").unwrap_or_else(|e| panic!("after {what}: {e}"));
        c.abort(p.publication, &p.writer_token).expect("abort");
    };
    {
        let _idle: Vec<_> = (0..200)
            .map(|_| std::os::unix::net::UnixStream::connect(&d.data_socket).expect("a data connection"))
            .collect();
        let mut slow = std::os::unix::net::UnixStream::connect(d.control_socket()).expect("the control socket");
        slow.write_all(b"POST /storage-pd/prepare HTTP/1.1\r\nHost: p\r\n").expect("half a head");
        let mut trickle = std::os::unix::net::UnixStream::connect(&d.data_socket).expect("a data connection");
        trickle.write_all(&[200, 0]).expect("half a length");
        std::thread::sleep(Duration::from_millis(1500));
    }
    settled("idle and trickling connections");
    for raw in [&b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"[..], b"\x00\x01\x02\r\n\r\n"] {
        let _ = raw_exchange(&d.control_socket(), raw);
    }
    settled("unparsable requests");
    {
        let p = c.prepare("vanishing", &layout(), 2, "w").expect("prepare");
        let mut conn = pdstor_client::DataConn::connect(&d.data_socket).expect("a data connection");
        let buf = pdstor_engine::buffer::Buffer::memfd("vanishing", 2 * SLOT as usize).expect("a memfd");
        let b = conn.register(&buf).expect("register");
        let chunk = pdstor_client::wire::DataChunk { index: 0, buffer: b, offset: 0, len: SLOT, crc32c: None };
        conn.store(p.publication, &p.writer_token, vec![chunk], false, 2).expect("store one chunk");
    }
    until("the vanished writer's publication is rolled back", || {
        c.publications(None, false).expect("listing").iter().all(|p| p.req_id != "vanishing")
    });
    settled("a writer that vanished mid-store");
    {
        let mut conn = pdstor_client::DataConn::connect(&d.data_socket).expect("a data connection");
        let bufs: Vec<_> = (0..16)
            .map(|i| pdstor_engine::buffer::Buffer::memfd(&format!("b{i}"), 1 << 20).expect("a memfd"))
            .collect();
        for b in &bufs {
            conn.register(b).expect("register");
        }
        let extra = pdstor_engine::buffer::Buffer::memfd("extra", 1 << 20).expect("a memfd");
        match conn.register(&extra) {
            Err(ClientError::Api(e)) => assert_eq!(e.code, "too_many_buffers", "{}", e.message),
            other => panic!("a 17th buffer: {other:?}"),
        }
    }
    settled("a client that registered all it may and vanished");
}

/// Past the list, a flaky machine: a cleaner empties the directory the
/// sockets are in while the daemon runs. It still stops on SIGTERM, at
/// once (before: its data plane's accept loop was woken by connecting to
/// the socket's path — gone — so it never stopped, and every test that
/// left such a daemon behind leaked a process).
#[test]
fn a_daemon_whose_sockets_were_removed_still_stops() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let mut d = Daemon::start(&target, dir.path());
    std::fs::remove_file(&d.data_socket).expect("the data socket removed");
    std::fs::remove_file(d.control_socket()).expect("the control socket removed");
    let pid = d.pid().expect("running");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(d.stop());
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(status) => assert!(status.success(), "the daemon stopped with {status}"),
        Err(_) => {
            // SAFETY: kill(2) of the child this test started, so that it does not outlive the test.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("the daemon did not stop within 20 s of SIGTERM");
        }
    }
}
