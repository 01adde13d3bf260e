//! The attacker of the attack tests: a second local uid (`setpriv --reuid
//! 4002`), a member of the daemon's socket group, mapped by the lab's config
//! to a tenant of its own. A test binary re-runs itself under `setpriv` with
//! one [`Attack`] in `PDSTOR_ATTACK`; its `attacker` test (which calls
//! [`attacker`]) runs it and prints the [`Outcome`].

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;
use pdstor_client::wire::{AdoptRequest, DataChunk};
use pdstor_client::{Client, ClientError, DataConn};
use serde::{Deserialize, Serialize};

use crate::Daemon;

pub const SLOT: u64 = 1 << 20;
/// The attacker's uid and the daemon's socket group.
pub const MALLORY: u32 = 4002;
pub const GROUP: u32 = 4000;

pub fn layout() -> Layout {
    Layout {
        model_id: "attacks".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-attacks".into(),
    }
}

/// One thing the attacker tries.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Attack {
    /// Connect to a Unix socket.
    Connect {
        path: PathBuf,
    },
    /// Open a file for reading.
    Read {
        path: PathBuf,
    },
    /// Look a path up (needs only search permission on the directories above it).
    Stat {
        path: PathBuf,
    },
    Prepare {
        server: String,
        req: String,
        chunks: u32,
    },
    Publish {
        server: String,
        publication: u64,
        token: String,
    },
    Abort {
        server: String,
        publication: u64,
        token: String,
    },
    Cancel {
        server: String,
        req: String,
    },
    /// Register a buffer, store into the publication, and vanish.
    StoreAndVanish {
        server: String,
        data: PathBuf,
        publication: u64,
        token: String,
    },
    /// Look requests up by name: how many READY receipts come back.
    Lookup {
        server: String,
        reqs: Vec<String>,
    },
    Claim {
        server: String,
        receipt: Receipt,
    },
    Release {
        server: String,
        receipt: Receipt,
    },
    Adopt {
        server: String,
        receipt: Receipt,
        namespace: String,
    },
    Load {
        data: PathBuf,
        receipt: Receipt,
    },
    Ack {
        server: String,
        receipt: Receipt,
    },
    CloseSession {
        server: String,
        receipt: Receipt,
    },
    Reclaim {
        server: String,
        receipt: Receipt,
    },
    /// An admin's reclaim by publication number.
    OperatorReclaim {
        server: String,
        publication: u64,
        reason: String,
    },
    /// How many publications the attacker sees.
    List {
        server: String,
    },
    Metrics {
        server: String,
    },
    /// Open up to `n` data-plane connections, register a buffer on each,
    /// hold them for `secs`; report how many were accepted.
    Hoard {
        data: PathBuf,
        n: usize,
        secs: u64,
    },
    /// Create `path` as this uid's own file, mode 0666, empty.
    Plant {
        path: PathBuf,
    },
    /// Make `link` a symbolic link to `to`.
    Symlink {
        to: PathBuf,
        link: PathBuf,
    },
    /// Listen on `path` for `secs`; report connections and bytes received.
    Squat {
        path: PathBuf,
        secs: u64,
    },
}

/// What came of it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub ok: bool,
    /// The daemon's refusal code, if it refused.
    pub code: Option<String>,
    pub detail: String,
}

impl Outcome {
    pub fn of<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Outcome {
        match r {
            Ok(v) => Outcome { ok: true, code: None, detail: format!("{v:?}") },
            Err(ClientError::Api(e)) => Outcome { ok: false, code: Some(e.code.clone()), detail: e.message },
            Err(e) => Outcome { ok: false, code: None, detail: e.to_string() },
        }
    }
}

/// The attacker's side, called by each attack test binary's `attacker`
/// test: does nothing unless the binary was re-run with an attack.
pub fn attacker() {
    let Ok(spec) = std::env::var("PDSTOR_ATTACK") else { return };
    let attack: Attack = serde_json::from_str(&spec).expect("an attack");
    let outcome = run(attack);
    println!("\nATTACK-OUTCOME {}", serde_json::to_string(&outcome).expect("an outcome"));
}

pub fn run(attack: Attack) -> Outcome {
    let io = |r: std::io::Result<()>| match r {
        Ok(()) => Outcome { ok: true, code: None, detail: String::new() },
        Err(e) => Outcome { ok: false, code: None, detail: e.to_string() },
    };
    match attack {
        Attack::Connect { path } => io(std::os::unix::net::UnixStream::connect(path).map(drop)),
        Attack::Read { path } => io(std::fs::File::open(path).map(drop)),
        Attack::Stat { path } => io(std::fs::symlink_metadata(path).map(drop)),
        Attack::Prepare { server, req, chunks } => {
            Outcome::of(Client::new(&server).prepare(&req, &layout(), chunks, "m"))
        }
        Attack::Publish { server, publication, token } => {
            Outcome::of(Client::new(&server).publish(publication, &token, Some(666)))
        }
        Attack::Abort { server, publication, token } => Outcome::of(Client::new(&server).abort(publication, &token)),
        Attack::Cancel { server, req } => Outcome::of(Client::new(&server).cancel(&req)),
        Attack::StoreAndVanish { server: _, data, publication, token } => Outcome::of((|| {
            let mut conn = DataConn::connect(&data)?;
            let evil = pdstor_engine::buffer::Buffer::memfd("evil", SLOT as usize)
                .map_err(|e| ClientError::Data(e.to_string()))?;
            let b = conn.register(&evil)?;
            let chunk = DataChunk { index: 1, buffer: b, offset: 0, len: SLOT, crc32c: None };
            conn.store(publication, &token, vec![chunk], true, 2)
        })()),
        Attack::Claim { server, receipt } => Outcome::of(Client::new(&server).claim(&receipt, "mallory", "m", 60_000)),
        Attack::Release { server, receipt } => Outcome::of(Client::new(&server).release(&receipt)),
        Attack::Adopt { server, receipt, namespace } => Outcome::of(Client::new(&server).adopt(&AdoptRequest {
            namespace,
            epoch: receipt.epoch,
            manifest_digest: receipt.manifest_digest.clone(),
            layout: layout(),
            direct: false,
            reservation_key: None,
            receipt,
        })),
        Attack::Load { data, receipt } => Outcome::of((|| {
            let mut conn = DataConn::connect(&data)?;
            let into = pdstor_engine::buffer::Buffer::memfd("loot", 2 * SLOT as usize)
                .map_err(|e| ClientError::Data(e.to_string()))?;
            let b = conn.register(&into)?;
            let chunks =
                (0..2).map(|i| DataChunk { index: i, buffer: b, offset: i as u64 * SLOT, len: 0, crc32c: None });
            conn.load(&receipt, chunks.collect())
        })()),
        Attack::Ack { server, receipt } => Outcome::of(Client::new(&server).ack(&receipt, &"00".repeat(32))),
        Attack::CloseSession { server, receipt } => Outcome::of(Client::new(&server).close_session(&receipt)),
        Attack::Reclaim { server, receipt } => Outcome::of(Client::new(&server).reclaim(&receipt)),
        Attack::OperatorReclaim { server, publication, reason } => {
            Outcome::of(Client::new(&server).reclaim_publication(publication, &reason))
        }
        Attack::List { server } => Outcome::of(Client::new(&server).publications(None, false).map(|l| l.len())),
        Attack::Lookup { server, reqs } => {
            Outcome::of(Client::new(&server).lookup(&reqs).map(|l| l.iter().flatten().count()))
        }
        Attack::Metrics { server } => Outcome::of(Client::new(&server).metrics()),
        Attack::Squat { path, secs } => squat(&path, secs),
        Attack::Symlink { to, link } => io(std::os::unix::fs::symlink(to, link)),
        Attack::Plant { path } => {
            io(std::fs::File::create(&path).and_then(|f| f.set_permissions(std::fs::Permissions::from_mode(0o666))))
        }
        Attack::Hoard { data, n, secs } => hoard(&data, n, secs),
    }
}

/// Holds as many data connections, each with a buffer registered, as the
/// daemon lets it; prints `HOARDING` once it has them all.
fn hoard(data: &Path, n: usize, secs: u64) -> Outcome {
    let buf = match pdstor_engine::buffer::Buffer::memfd("hoard", 4096) {
        Ok(b) => b,
        Err(e) => return Outcome { ok: false, code: None, detail: e.to_string() },
    };
    let mut held = Vec::new();
    let mut refusal = String::new();
    for _ in 0..n {
        match DataConn::connect(data).and_then(|mut c| c.register(&buf).map(|_| c)) {
            Ok(c) => held.push(c),
            Err(e) => {
                refusal = e.to_string();
                break;
            }
        }
    }
    println!("\nHOARDING {}", held.len());
    std::thread::sleep(std::time::Duration::from_secs(secs));
    Outcome { ok: true, code: None, detail: format!("{} held; then: {refusal}", held.len()) }
}

/// Listens where the victim expects the daemon; counts what arrives.
pub fn squat(path: &Path, secs: u64) -> Outcome {
    use std::io::Read;
    let l = match std::os::unix::net::UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => return Outcome { ok: false, code: None, detail: format!("bind: {e}") },
    };
    l.set_nonblocking(true).expect("a nonblocking listener");
    let (mut conns, mut bytes) = (0, 0);
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        match l.accept() {
            Ok((mut s, _)) => {
                conns += 1;
                s.set_nonblocking(false).expect("a blocking stream");
                s.set_read_timeout(Some(std::time::Duration::from_millis(500))).expect("a read timeout");
                let mut buf = Vec::new();
                let _ = s.read_to_end(&mut buf);
                bytes += buf.len();
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    Outcome { ok: true, code: None, detail: format!("{conns} connections, {bytes} bytes") }
}

/// Why the attacker cannot be run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !pdstor_testkit::is_root() {
        return Some("needs root to run a second uid with setpriv".into());
    }
    match Command::new("setpriv").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => return Some("no setpriv (util-linux) on this machine".into()),
    }
    // The attacker re-runs this binary: every directory above it must let uid 4002 through.
    let exe = std::env::current_exe().ok()?;
    let probe = as_uid_4002().arg(&exe).args(["--exact", "attacker", "--list"]).output().ok()?;
    if !probe.status.success() {
        return Some(format!(
            "uid {MALLORY} cannot run {} (a directory above it is closed to other users): {}",
            exe.display(),
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    None
}

/// `setpriv` running what follows as uid 4002, group 4000, no other groups.
pub fn as_uid_4002() -> Command {
    as_uid(MALLORY)
}

/// `setpriv` running what follows as `uid`, group 4000, no other groups.
pub fn as_uid(uid: u32) -> Command {
    let mut c = Command::new("setpriv");
    c.args(["--reuid", &uid.to_string(), "--regid", &GROUP.to_string(), "--clear-groups"]);
    c
}

/// Runs `attack` as uid 4002 (group 4000, no other groups) and answers its outcome.
pub fn as_mallory(attack: &Attack) -> Outcome {
    let out = mallory_cmd(attack).output().expect("running the attacker");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.split_once("ATTACK-OUTCOME ").map(|(_, o)| o)).unwrap_or_else(|| {
        panic!("the attacker reported nothing for {attack:?}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr))
    });
    serde_json::from_str(line).expect("an outcome")
}

pub fn mallory_cmd(attack: &Attack) -> Command {
    let mut c = as_uid_4002();
    c.arg(std::env::current_exe().expect("this test binary"))
        .args(["--exact", "attacker", "--nocapture", "--test-threads", "1"])
        .env("PDSTOR_ATTACK", serde_json::to_string(attack).expect("an attack"));
    c
}

/// Refused with `code`, for who the caller is.
#[track_caller]
pub fn refused(o: Outcome, code: &str) {
    assert!(!o.ok, "the attack went through: {}", o.detail);
    assert_eq!(o.code.as_deref(), Some(code), "{}", o.detail);
}

/// A directory other users can traverse, a formatted target, and a config
/// that lets the socket group in and makes uid 4002 tenant `mallory`.
pub struct Lab {
    pub dir: tempfile::TempDir,
    pub target: PathBuf,
    pub config: PathBuf,
}

impl Lab {
    /// In the system's temporary directory: the checkout's `target/` may be
    /// closed to other users (a umask of 077), and uid 4002 must reach the lab.
    /// The target has `slots` slots of [`SLOT`]; `quota` is the body of
    /// tenant `mallory`'s quota table (`slots = 2`, say; empty: none).
    pub fn with(slots: u64, quota: &str) -> Lab {
        let dir = tempfile::Builder::new().prefix("pdstor-attacks-").tempdir().expect("a temporary directory");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let reach = as_mallory(&Attack::Stat { path: dir.path().to_path_buf() });
        assert!(reach.ok, "uid {MALLORY} cannot reach {}: {}", dir.path().display(), reach.detail);
        let target = crate::format_file(dir.path(), slots, SLOT);
        let config = dir.path().join("pdstor.toml");
        std::fs::write(
            &config,
            format!(
                "[sockets]\ngroup = \"{GROUP}\"\n\n[[principal]]\ntenant = \"mallory\"\nroles = [\"writer\", \"reader\"]\nuids = [{MALLORY}]\n\n[tenant.mallory.quota]\n{quota}\n"
            ),
        )
        .expect("writing the config");
        Lab { dir, target, config }
    }

    /// `pdstor serve` on the lab's target with its config and `extra` options.
    pub fn daemon(&self, extra: &[&str]) -> Daemon {
        let mut args = vec!["--config", self.config.to_str().expect("a UTF-8 path")];
        args.extend_from_slice(extra);
        Daemon::start_with(&self.target, self.dir.path(), &args)
    }
}
