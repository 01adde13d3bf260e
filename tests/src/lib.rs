//! Helpers for pdstor's end-to-end tests: the `pdstor` binary that
//! `cargo test --workspace` built, a daemon running in its own process on a
//! scratch target, and one HTTP exchange by hand. What they ask of the
//! machine (a skip, root, loop devices, `dd`) is `pdstor-testkit`.
#![deny(clippy::unwrap_used)]

pub mod mallory;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `pdstor` binary of this build profile (built by `cargo test --workspace`;
/// built here if a narrower invocation skipped it).
pub fn pdstor_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/pdstor
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile dir");
    let bin = profile_dir.join("pdstor");
    if !bin.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "pdstor", "--bin", "pdstor"])
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build -p pdstor failed");
    }
    bin
}

/// Formats `dir/target.img`: `slots` slots of `slot` bytes behind a 256 KiB
/// journal (checkpoints come often). Returns its path.
pub fn format_file(dir: &Path, slots: u64, slot: u64) -> PathBuf {
    let target = dir.join("target.img");
    let size = 2 * 4096 + 2 * (256 << 10) + slots * slot;
    let out = Command::new(pdstor_bin())
        .args([
            "format",
            "--journal",
            "256k",
            "--chunk-slot",
            &slot.to_string(),
            "--size",
            &size.to_string(),
            "--target",
        ])
        .arg(&target)
        .output()
        .expect("pdstor format");
    assert!(out.status.success(), "format: {}", String::from_utf8_lossy(&out.stderr));
    target
}

/// A `pdstor serve` process on a target, killed on drop.
pub struct Daemon {
    pub target: PathBuf,
    /// The client's `--server`: `unix:<control socket>`, or `http://<addr>` with `--insecure-tcp`.
    pub server: String,
    pub data_socket: PathBuf,
    /// The TCP address (with `--insecure-tcp`), or `unix:<path>`.
    pub addr: String,
    child: Option<Child>,
    pub log: PathBuf,
    extra: Vec<String>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Daemon {
    /// Formats a file target in `dir` (`slots` slots of `slot` bytes) and serves it.
    pub fn format_and_start(dir: &Path, slots: u64, slot: u64) -> Daemon {
        Daemon::start(&format_file(dir, slots, slot), dir)
    }

    /// Formats an existing block device (or file) with 8 MiB slots and serves it.
    pub fn format_device_and_start(device: &Path, dir: &Path) -> Daemon {
        let out = Command::new(pdstor_bin())
            .args(["format", "--journal", "1M", "--chunk-slot", "8M", "--force", "--target"])
            .arg(device)
            .output()
            .expect("pdstor format");
        assert!(out.status.success(), "format: {}", String::from_utf8_lossy(&out.stderr));
        Daemon::start(device, dir)
    }

    /// Serves an already formatted target.
    pub fn start(target: &Path, dir: &Path) -> Daemon {
        Daemon::start_with(target, dir, &[])
    }

    /// Serves an already formatted target with extra `serve` flags.
    /// The control plane is a Unix socket in `dir`, or (when `extra` holds
    /// `--insecure-tcp`) a loopback TCP port.
    pub fn start_with(target: &Path, dir: &Path, extra: &[&str]) -> Daemon {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let tag = format!("{}-{}", std::process::id(), NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let (addr, server) = if extra.contains(&"--tls-cert") {
            let port = free_port();
            (format!("127.0.0.1:{port}"), format!("https://127.0.0.1:{port}"))
        } else if extra.contains(&"--insecure-tcp") {
            let addr = format!("127.0.0.1:{}", free_port());
            (addr.clone(), format!("http://{addr}"))
        } else {
            let sock = format!("unix:{}", dir.join(format!("control-{tag}.sock")).display());
            (sock.clone(), sock)
        };
        let data_socket = dir.join(format!("data-{tag}.sock"));
        let log = dir.join(format!("serve-{tag}.log"));
        let mut d = Daemon {
            target: target.into(),
            server,
            data_socket,
            addr,
            child: None,
            log,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        d.spawn();
        d
    }

    /// The control plane's Unix socket (not with `--insecure-tcp`).
    pub fn control_socket(&self) -> PathBuf {
        PathBuf::from(self.addr.strip_prefix("unix:").expect("a daemon on a Unix control socket"))
    }

    fn spawn(&mut self) {
        // Another start over a running daemon would not replace it (its
        // sockets are taken: the new one refuses and exits, the old one
        // answers) and would leave it running after the test.
        assert!(self.child.is_none(), "the daemon is already running: stop() or kill9() it before restart()");
        let log = std::fs::File::create(&self.log).expect("daemon log");
        // 2 s of admission wait unless the test says otherwise.
        let admission: &[&str] = if self.extra.iter().any(|a| a == "--admission-timeout-ms") {
            &[]
        } else {
            &["--admission-timeout-ms", "2000"]
        };
        let child = Command::new(pdstor_bin())
            .arg("serve")
            .args(admission)
            .args(["--listen", &self.addr, "--target"])
            .arg(&self.target)
            .arg("--data-socket")
            .arg(&self.data_socket)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting pdstor serve");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // Over TLS this harness holds no client certificate: a listening port will do.
            let answers = if self.server.starts_with("https://") {
                std::net::TcpStream::connect(&self.addr).is_ok()
            } else {
                pdstor_client::Client::new(&self.server).healthz().is_ok()
            };
            let up = answers && self.data_socket.exists();
            if up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not come up: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9`, then start again on the same target, port and socket.
    pub fn kill9_and_restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `kill -9` and reap; [`restart`](Self::restart) brings it back.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the daemon again on the same target, port and socket.
    pub fn restart(&mut self) {
        self.spawn();
    }

    /// SIGHUP: the daemon reads its config and TLS files again.
    pub fn hangup(&self) {
        let pid = self.pid().expect("the daemon runs") as libc::pid_t;
        // SAFETY: kill(2) on our own child, not reaped yet.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0, "SIGHUP to the daemon");
    }

    /// What `f` answers once it answers something, polled every 20 ms for
    /// 20 s at most; then a panic naming `what`, with the daemon's log.
    pub fn eventually<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "never: {what}\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait: a graceful stop.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        // Not the `kill` program: a bare machine has none.
        // SAFETY: kill(2) on our own child, not reaped yet.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        c.wait().expect("wait")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One HTTP/1.1 exchange over a Unix socket (`Connection: close`): the
/// status and the body, as the daemon sent them.
pub fn http_exchange(socket: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    let body = body.unwrap_or("");
    let kind = if body.is_empty() { String::new() } else { "Content-Type: application/json\r\n".to_owned() };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: pdstor\r\nConnection: close\r\n{kind}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap_or_else(|e| panic!("sending {method} {path}: {e}"));
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap_or_else(|e| panic!("reading the answer to {method} {path}: {e}"));
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{answer}"));
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// Every file under `dir`, recursively and sorted, leaving out what is no
/// source of ours: build outputs, venvs, caches, git's own folder.
pub fn tree_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let ignored = matches!(
                name.to_str(),
                Some("target" | ".git" | ".venv" | "venv" | "__pycache__" | "node_modules" | ".pytest_cache")
            );
            if path.is_dir() {
                if !ignored {
                    stack.push(path);
                }
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The repository's crates, as folders: the workspace's members (the root
/// `Cargo.toml`'s `members`) and the Python crate, which builds in its own
/// workspace. A new crate is in every check that walks the crates the day it
/// joins the workspace.
pub fn crate_folders(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("reading the workspace's Cargo.toml");
    let members = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("members = ["))
        .and_then(|l| l.strip_suffix(']'))
        .expect("the workspace's members, on one line");
    let mut out: Vec<String> = members.split(',').map(|m| m.trim().trim_matches('"').to_owned()).collect();
    out.push("python".to_owned());
    out
}
