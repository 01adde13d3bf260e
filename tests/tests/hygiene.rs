//! What the daemon refuses to expose (issue 16): a target others can read,
//! a socket path holding someone else's file, plaintext TCP unless asked for;
//! and what a client refuses: handing its buffers to a daemon of another uid.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

use pdstor_tests::{Daemon, pdstor_bin};

fn serve(args: &[&str]) -> Output {
    Command::new(pdstor_bin()).arg("serve").args(args).output().expect("running pdstor serve")
}

/// `pdstor serve --target T --listen L --data-socket S`, run to its exit.
fn serve_on(target: &std::path::Path, listen: &str, data_socket: &std::path::Path) -> Output {
    let (t, s) = (target.to_str().unwrap(), data_socket.to_str().unwrap());
    serve(&["--target", t, "--listen", listen, "--data-socket", s])
}

fn mode(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn targets_are_created_for_their_owner_and_a_readable_one_is_refused() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, 1 << 20);
    assert_eq!(mode(&target), 0o600, "pdstor creates targets 0600");
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
    let sock = dir.path().join("d.sock");
    let out = serve_on(&target, "127.0.0.1:0", &sock);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a world-readable target was served");
    assert!(err.contains("readable by every user") && err.contains("--allow-readable-target"), "{err}");
    assert!(!sock.exists(), "nothing was exposed");
    // Asked for by name, it is served (with a warning).
    let mut d = Daemon::start_with(&target, dir.path(), &["--allow-readable-target"]);
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(log.contains("served anyway"), "{log}");
    d.stop();
}

#[test]
fn a_unix_socket_path_holding_another_file_is_never_replaced() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, 1 << 20);
    let precious = dir.path().join("precious.txt");
    std::fs::write(&precious, b"not a socket").unwrap();
    let sock = dir.path().join("d.sock");
    let out = serve(&[
        "--target",
        target.to_str().unwrap(),
        "--listen-unix",
        precious.to_str().unwrap(),
        "--data-socket",
        sock.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("a regular file, not a socket: refusing to replace it"), "{err}");
    assert_eq!(std::fs::read(&precious).unwrap(), b"not a socket", "the file is untouched");
    // The same for the data socket.
    let control = format!("unix:{}", dir.path().join("c.sock").display());
    let out = serve_on(&target, &control, &precious);
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&precious).unwrap(), b"not a socket");
}

#[test]
fn sockets_are_owner_only_whatever_the_umask() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, 1 << 20);
    let control = dir.path().join("run/control.sock");
    let data = dir.path().join("run/data.sock");
    let mut serve = Command::new(pdstor_bin());
    serve
        .args(["serve", "--target", target.to_str().unwrap(), "--listen-unix", control.to_str().unwrap()])
        .args(["--data-socket", data.to_str().unwrap()])
        .stderr(std::process::Stdio::null());
    // The daemon alone runs under umask 000: setting this test process's own
    // mask, even for a moment, leaked into the tests running beside it (a
    // temp dir made 0777 meanwhile was refused as a socket directory).
    // SAFETY: umask(2) is async-signal-safe; it runs in the child between
    // fork and exec and touches nothing else.
    unsafe {
        serve.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let mut child = serve.spawn().unwrap();
    let t = std::time::Instant::now();
    while !(control.exists() && data.exists()) {
        assert!(t.elapsed() < std::time::Duration::from_secs(20), "the daemon did not come up");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (cm, dm, run) = (mode(&control), mode(&data), mode(&dir.path().join("run")));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    child.wait().unwrap();
    assert_eq!((cm, dm), (0o600, 0o600), "sockets are the daemon user's only, under umask 000");
    assert_eq!(run, 0o750, "the socket directory it created is not open to others");
}

#[test]
fn plaintext_tcp_needs_to_be_asked_for_even_on_loopback() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, 1 << 20);
    let sock = dir.path().join("d.sock");
    for (addr, why) in
        [("0.0.0.0:0", "every host that reaches it"), ("127.0.0.1:0", "every local user reaches loopback")]
    {
        let out = serve_on(&target, addr, &sock);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{addr} was served in plaintext");
        assert!(err.contains("plaintext TCP") && err.contains(why) && err.contains("--insecure-tcp"), "{err}");
        assert!(!sock.exists(), "nothing was exposed");
    }
}

#[test]
fn a_client_hands_buffers_only_to_a_daemon_it_trusts() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, 1 << 20);
    let layout = dir.path().join("layout.json");
    std::fs::write(
        &layout,
        r#"{"model_id":"m","dtype":"bf16","layers":1,"kv_heads":1,"head_dim":64,"chunk_tokens":16,"kv_format":"f"}"#,
    )
    .unwrap();
    let kv = dir.path().join("kv.bin");
    std::fs::write(&kv, vec![7u8; 4096]).unwrap();
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    let other = if me == 12345 { 12346 } else { 12345 };
    let out = Command::new(pdstor_bin())
        .args(["put", "--req", "r", "--layout", layout.to_str().unwrap(), "--from", kv.to_str().unwrap()])
        .args(["--chunk-size", "4k", "--server", &d.server, "--data-socket", d.data_socket.to_str().unwrap()])
        .env("PDSTOR_DAEMON_UID", other.to_string())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the client shared its buffer with an untrusted daemon");
    assert!(err.contains(&format!("is served by uid {me}")) && err.contains("refusing to share buffers"), "{err}");
    // The same put with the daemon trusted goes through.
    let out = Command::new(pdstor_bin())
        .args(["put", "--req", "r", "--layout", layout.to_str().unwrap(), "--from", kv.to_str().unwrap()])
        .args(["--chunk-size", "4k", "--server", &d.server, "--data-socket", d.data_socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
