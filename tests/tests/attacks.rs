//! Issue 16's findings, run as the attacker would: a second local uid
//! (`setpriv --reuid 4002`), a member of the daemon's socket group, mapped by
//! the daemon's config to a tenant of its own (`pdstor_tests::mallory`). Each
//! attack must be refused with its code and change nothing; the victim (root,
//! the daemon's user) then finishes undisturbed, byte for byte.
//!
//! Needs root and `setpriv` (util-linux); says SKIP otherwise.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use pdstor_client::wire::DataChunk;
use pdstor_client::{Client, ClientError, DataConn};
use pdstor_tests::mallory::{
    Attack, Lab, MALLORY, Outcome, SLOT, as_mallory, as_uid_4002, layout, mallory_cmd, refused, unavailable,
};
use pdstor_tests::{Daemon, pdstor_bin};

/// The attacker's side: does nothing unless this binary was re-run with an attack.
#[test]
fn attacker() {
    pdstor_tests::mallory::attacker();
}

fn state(c: &Client, publication: u64) -> Option<String> {
    c.publications(None, false).expect("listing").into_iter().find(|p| p.publication == publication).map(|p| p.state)
}

/// "A daemon started with defaults exposes nothing to other uids."
#[test]
fn a_daemon_with_defaults_exposes_nothing_to_another_uid() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_daemon_with_defaults_exposes_nothing_to_another_uid", &why);
    }
    let lab = Lab::with(8, "slots = 2");
    let d = Daemon::start(&lab.target, lab.dir.path());
    for path in [d.control_socket(), d.data_socket.clone()] {
        // The path is reachable: a refusal below is the socket's own mode.
        assert!(as_mallory(&Attack::Stat { path: path.clone() }).ok, "{} is out of reach", path.display());
        let o = as_mallory(&Attack::Connect { path: path.clone() });
        assert!(!o.ok && o.detail.contains("Permission denied"), "{}: {}", path.display(), o.detail);
    }
    let o = as_mallory(&Attack::Read { path: lab.target.clone() });
    assert!(
        !o.ok && o.detail.contains("Permission denied"),
        "the target (and its receipt key) is readable: {}",
        o.detail
    );
    // pdstor inspect as uid 4002 cannot open the target either.
    let out = as_uid_4002()
        .arg(pdstor_bin())
        .args(["inspect", "--target"])
        .arg(&lab.target)
        .output()
        .expect("pdstor inspect");
    assert!(!out.status.success(), "another uid inspected the target");
}

/// Every owner-bound step, tried by another tenant on the victim's
/// publication at each of its states: refused, nothing changed.
#[test]
fn another_tenant_can_neither_write_nor_read_nor_see_what_is_not_its_own() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("another_tenant_can_neither_write_nor_read_nor_see_what_is_not_its_own", &why);
    }
    let lab = Lab::with(8, "slots = 2");
    let d = lab.daemon(&[]);
    let server = d.server.clone();
    let c = Client::new(&server);
    // The victim prepares and stores its first chunk.
    let p = c.prepare("victim", &layout(), 2, "writer-a").expect("prepare");
    let mut writer = DataConn::connect(&d.data_socket).expect("the data plane");
    let kv: Vec<u8> = (0..2).flat_map(|i| pdstor_engine::payload::chunk(9, i, SLOT as usize)).collect();
    let buf = pdstor_engine::buffer::Buffer::memfd("victim", kv.len()).expect("a memfd");
    buf.write_at(0, &kv).expect("writing the payload");
    let b = writer.register(&buf).expect("register");
    let chunk = |i: u32| DataChunk { index: i, buffer: b, offset: i as u64 * SLOT, len: SLOT, crc32c: None };
    writer.store(p.publication, &p.writer_token, vec![chunk(0)], false, 2).expect("store");

    // Even holding the writer's token (leaked, say), another identity is not the writer.
    let (id, token) = (p.publication, p.writer_token.clone());
    refused(
        as_mallory(&Attack::Publish { server: server.clone(), publication: id, token: token.clone() }),
        "not_owner",
    );
    refused(
        as_mallory(&Attack::Publish { server: server.clone(), publication: id, token: "00".repeat(32) }),
        "not_owner",
    );
    refused(as_mallory(&Attack::Abort { server: server.clone(), publication: id, token: token.clone() }), "not_owner");
    refused(as_mallory(&Attack::Cancel { server: server.clone(), req: "victim".into() }), "not_owner");
    let data = d.data_socket.clone();
    refused(
        as_mallory(&Attack::StoreAndVanish { server: server.clone(), data: data.clone(), publication: id, token }),
        "not_owner",
    );
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(
        state(&c, id).as_deref(),
        Some("PREPARED"),
        "the attacker's disconnect aborted the victim's publication"
    );
    // It sees nothing of the victim's, nor the daemon's counters.
    let seen = as_mallory(&Attack::List { server: server.clone() });
    assert_eq!((seen.ok, seen.detail.as_str()), (true, "0"), "the listing shows another tenant's publications");
    refused(as_mallory(&Attack::Metrics { server: server.clone() }), "forbidden");
    // Its own work is held to its tenant's quota (2 slots).
    refused(as_mallory(&Attack::Prepare { server: server.clone(), req: "m-big".into(), chunks: 3 }), "quota_exceeded");
    let own = as_mallory(&Attack::Prepare { server: server.clone(), req: "m-own".into(), chunks: 1 });
    assert!(own.ok, "its own prepare within quota: {}", own.detail);
    let seen = as_mallory(&Attack::List { server: server.clone() });
    assert_eq!(seen.detail, "1", "it sees its own publication");

    // The victim publishes with its own first token.
    writer.store(id, &p.writer_token, vec![chunk(1)], true, 2).expect("store");
    let published = c.publish(id, &p.writer_token, Some(1)).expect("publish");
    assert_eq!(published.manifest.first_token, Some(1), "the publish race set the first token");
    let ready = published.receipt;
    // Known by name, it is still not found: its receipt is only for those who may claim or release it.
    let found = as_mallory(&Attack::Lookup { server: server.clone(), reqs: vec!["victim".into(), "m-own".into()] });
    assert_eq!((found.ok, found.detail.as_str()), (true, "0"), "lookup handed another tenant's receipt");
    let own =
        c.lookup(&["victim".into()]).expect("the owner's lookup").remove(0).expect("the owner finds its READY receipt");
    assert_eq!((own.publication, &own.manifest_digest), (ready.publication, &ready.manifest_digest));
    refused(as_mallory(&Attack::Claim { server: server.clone(), receipt: ready.clone() }), "forbidden");
    refused(as_mallory(&Attack::Release { server: server.clone(), receipt: ready.clone() }), "not_owner");
    let mut forged = ready.clone();
    forged.publication += 1;
    refused(as_mallory(&Attack::Claim { server: server.clone(), receipt: forged }), "bad_signature");

    // The victim claims; the claim is its own alone.
    let claim = c.claim(&ready, "reader-a", "session-a", 60_000).expect("claim");
    let ns = ready.namespace.clone();
    refused(as_mallory(&Attack::Adopt { server: server.clone(), receipt: claim.clone(), namespace: ns }), "not_owner");
    let mut reader = pdstor_client::Reader::new(&server, &d.data_socket).expect("a reader");
    let manifest = reader.adopt(&claim, &layout()).expect("adopt");
    refused(as_mallory(&Attack::Load { data: data.clone(), receipt: claim.clone() }), "not_owner");
    refused(as_mallory(&Attack::Ack { server: server.clone(), receipt: claim.clone() }), "not_owner");
    refused(as_mallory(&Attack::CloseSession { server: server.clone(), receipt: claim.clone() }), "not_owner");
    refused(as_mallory(&Attack::Reclaim { server: server.clone(), receipt: claim.clone() }), "not_owner");
    let restored = reader.load(&claim, manifest).expect("the victim loads undisturbed");
    assert_eq!(reader.restored_bytes(restored.len).expect("the restored bytes"), kv, "byte for byte");
    c.ack(&claim, &restored.restore_digest).expect("ack");

    // The CLI says who was refused with its own exit status.
    let out = as_uid_4002()
        .arg(pdstor_bin())
        .args(["abort", "--publication", &own_publication(&c, &server), "--writer-token", &"00".repeat(32)])
        .args(["--server", &server])
        .output()
        .expect("pdstor abort");
    assert_eq!(
        out.status.code(),
        Some(pdstor_client::code::EXIT_DENIED as i32),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = std::fs::read_to_string(&d.log).expect("the daemon's log");
    assert!(log.contains("refused for who the caller is") && log.contains("uid:4002 (tenant mallory"), "{log}");
}

/// The publication uid 4002 prepared, as the admin sees it.
fn own_publication(c: &Client, _server: &str) -> String {
    c.publications(None, false)
        .expect("listing")
        .into_iter()
        .find(|p| p.req_id == "m-own")
        .map(|p| p.publication.to_string())
        .expect("the attacker's own publication")
}

/// Socket squatting: whoever listens at a path the victim was given receives
/// neither a request nor a buffer; the client refuses a daemon of another uid.
#[test]
fn a_squatted_socket_receives_nothing() {
    if let Some(why) = unavailable() {
        return pdstor_testkit::skip("a_squatted_socket_receives_nothing", &why);
    }
    let lab = Lab::with(8, "slots = 2");
    let d = lab.daemon(&[]);
    let shared = lab.dir.path().join("shared");
    std::fs::create_dir(&shared).expect("a shared directory");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod 1777");
    let (data, control) = (shared.join("data.sock"), shared.join("control.sock"));
    let mut squatters: Vec<_> = [&data, &control]
        .iter()
        .map(|p| {
            mallory_cmd(&Attack::Squat { path: p.to_path_buf(), secs: 6 })
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("a squatter")
        })
        .collect();
    let t = std::time::Instant::now();
    while !(data.exists() && control.exists()) {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the squatters never listened");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let kv = lab.dir.path().join("kv.bin");
    std::fs::write(&kv, pdstor_engine::payload::chunk(1, 0, SLOT as usize)).expect("the payload");
    let layout_file = lab.dir.path().join("layout.json");
    std::fs::write(&layout_file, serde_json::to_vec(&layout()).expect("a layout")).expect("the layout");
    let put = |server: &str, data: &Path| {
        Command::new(pdstor_bin())
            .args(["put", "--req", "r", "--chunk-size", "1M", "--server", server, "--data-socket"])
            .arg(data)
            .arg("--layout")
            .arg(&layout_file)
            .arg("--from")
            .arg(&kv)
            .output()
            .expect("pdstor put")
    };
    let squatted = format!("unix:{}", control.display());
    for (server, sock) in [(squatted.as_str(), &d.data_socket), (d.server.as_str(), &data)] {
        let out = put(server, sock);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "the victim talked to a squatter");
        assert!(err.contains(&format!("is served by uid {MALLORY}")), "{err}");
    }
    for s in squatters.iter_mut() {
        let out = s.wait().expect("the squatter");
        assert!(out.success());
    }
    for s in squatters {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut s.stdout.expect("its stdout"), &mut text).expect("its report");
        let line = text.lines().find_map(|l| l.split_once("ATTACK-OUTCOME ").map(|(_, o)| o)).expect("a report");
        let o: Outcome = serde_json::from_str(line).expect("an outcome");
        assert!(o.detail.ends_with(" 0 bytes"), "the squatter received something: {}", o.detail);
    }
}

/// A TCP caller proves nothing: with a config that names no `plaintext`
/// principal, every step over plaintext TCP is refused `unauthenticated`.
#[test]
fn a_plaintext_tcp_caller_is_nobody() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let config = dir.path().join("pdstor.toml");
    std::fs::write(&config, "[[principal]]\ntenant = \"t\"\nroles = [\"writer\"]\nuids = [4001]\n").expect("a config");
    let d = Daemon::start_with(&target, dir.path(), &["--config", config.to_str().expect("UTF-8"), "--insecure-tcp"]);
    let c = Client::new(&d.server);
    match c.prepare("r", &layout(), 1, "w") {
        Err(ClientError::Api(e)) => assert_eq!((e.status, e.code.as_str()), (401, "unauthenticated"), "{}", e.message),
        other => panic!("a plaintext caller prepared: {other:?}"),
    }
    let out =
        Command::new(pdstor_bin()).args(["cancel", "--req", "r", "--server", &d.server]).output().expect("cancel");
    assert_eq!(out.status.code(), Some(pdstor_client::code::EXIT_DENIED as i32));
    let log = std::fs::read_to_string(&d.log).expect("the log");
    assert!(log.contains("plaintext TCP (--insecure-tcp)"), "the start did not warn: {log}");
}
