//! Scratch storage for the engine's integration tests: files on the root
//! filesystem, loop devices, and ext4/XFS filesystems made on loop devices.
//! Everything is torn down on drop. A test that needs what this machine lacks
//! calls [`skip`] and returns.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The KV layout the store tests publish with.
pub fn layout() -> pdstor::store::Layout {
    pdstor::store::Layout {
        model_id: "test-model".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

/// Reports a skipped test: to stderr, and to `$PDSTOR_SKIP_LOG` so `cargo xtask ci` can list it.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIP: {test}: {reason}");
    eprintln!("{line}");
    if let Ok(log) = std::env::var("PDSTOR_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "{line}");
        }
    }
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success())
}

fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A sparse image file attached to a loop device.
pub struct LoopDevice {
    pub device: PathBuf,
    _dir: tempfile::TempDir,
}

impl LoopDevice {
    /// Returns `Err(reason)` where this machine cannot make one (not root, no losetup).
    pub fn new(size: u64, block_size: u32) -> Result<LoopDevice, String> {
        if !is_root() {
            return Err("loop devices need root".into());
        }
        if !have("losetup") {
            return Err("losetup is not installed (cargo xtask deps)".into());
        }
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).map_err(|e| e.to_string())?;
        let image = dir.path().join("disk.img");
        std::fs::File::create(&image).and_then(|f| f.set_len(size)).map_err(|e| e.to_string())?;
        let device = run(Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on", "--sector-size", &block_size.to_string()])
            .arg(&image))?;
        Ok(LoopDevice { device: device.into(), _dir: dir })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.device).status();
    }
}

/// A zram device (memory speed, and bio-based: it refuses `RWF_NOWAIT`),
/// reset and removed on drop.
pub struct Zram {
    pub device: PathBuf,
    id: String,
}

impl Zram {
    /// Returns `Err(reason)` where this machine cannot make one (not root, no
    /// zram module).
    pub fn new(size: u64) -> Result<Zram, String> {
        if !is_root() {
            return Err("zram devices need root".into());
        }
        let control = Path::new("/sys/class/zram-control/hot_add");
        if !control.exists() {
            let _ = Command::new("modprobe").args(["zram", "num_devices=0"]).status();
        }
        let id = std::fs::read_to_string(control).map_err(|e| format!("no zram here ({}: {e})", control.display()))?;
        let z = Zram { device: PathBuf::from(format!("/dev/zram{}", id.trim())), id: id.trim().to_owned() };
        std::fs::write(format!("/sys/block/zram{}/disksize", z.id), size.to_string())
            .map_err(|e| format!("sizing zram{}: {e}", z.id))?;
        Ok(z)
    }
}

impl Drop for Zram {
    fn drop(&mut self) {
        // The engine's ring may hold the device a moment after it is dropped.
        for _ in 0..100 {
            if std::fs::write(format!("/sys/block/zram{}/reset", self.id), "1").is_ok() {
                let _ = std::fs::write("/sys/class/zram-control/hot_remove", &self.id);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// A filesystem made on its own loop device and mounted in a temp dir.
pub struct Filesystem {
    pub mount: PathBuf,
    pub fstype: &'static str,
    pub dev: LoopDevice,
    _mnt: tempfile::TempDir,
}

impl Filesystem {
    pub fn new(fstype: &'static str, size: u64) -> Result<Filesystem, String> {
        let mkfs = format!("mkfs.{fstype}");
        if !have(&mkfs) {
            return Err(format!("{mkfs} is not installed (cargo xtask deps)"));
        }
        let dev = LoopDevice::new(size, 512)?;
        let mut cmd = Command::new(&mkfs);
        match fstype {
            "xfs" => cmd.args(["-q", "-f"]),
            _ => cmd.args(["-q", "-F"]),
        };
        run(cmd.arg(&dev.device))?;
        let mnt = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).map_err(|e| e.to_string())?;
        run(Command::new("mount").arg(&dev.device).arg(mnt.path()))?;
        Ok(Filesystem { mount: mnt.path().into(), fstype, dev, _mnt: mnt })
    }
}

impl Drop for Filesystem {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// Reads `len` bytes at `offset` of `path` with `dd iflag=direct`: a reader that
/// shares no code with pdstor.
pub fn dd_direct(path: &Path, offset: u64, len: u64) -> Vec<u8> {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=direct,skip_bytes,count_bytes", "bs=1M", "status=none"])
        .arg(format!("skip={offset}"))
        .arg(format!("count={len}"))
        .output()
        .expect("running dd");
    assert!(out.status.success(), "dd failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout.len() as u64, len, "dd read {} of {len} bytes", out.stdout.len());
    out.stdout
}

/// A real daemon run in this process (`pdstor::api::serve` on a thread) on a
/// 16 MiB file target of 1 MiB slots, its control plane on plaintext
/// loopback TCP, its device failing as `fault` says. Its tests stop it by
/// sending SIGTERM to their own process, so each lives alone in its file.
pub struct InProcess {
    pub target: PathBuf,
    /// `http://127.0.0.1:PORT`.
    pub server: String,
    pub socket: PathBuf,
    pub daemon: std::thread::JoinHandle<anyhow::Result<()>>,
}

pub fn serve_in_process(dir: &Path, fault: std::sync::Arc<pdstor::store::FaultPlan>) -> InProcess {
    use std::time::{Duration, Instant};
    let target = dir.join("ns.img");
    pdstor::store::format(
        &target,
        &pdstor::store::FormatOptions {
            slot_size: 1 << 20,
            journal_half: 256 << 10,
            force: false,
            create_len: Some(2 * 4096 + 2 * (256 << 10) + (16 << 20)),
        },
    )
    .expect("format");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let socket = dir.join("data.sock");
    let cfg = pdstor::api::ServeConfig {
        target: target.clone(),
        listen: pdstor::api::Listen::Tcp(format!("127.0.0.1:{port}").parse().unwrap()),
        data_socket: socket.clone(),
        queue_depth: 8,
        merge_bytes: pdstor::store::DEFAULT_MERGE_BYTES,
        verify_threads: 0,
        admission_timeout: Duration::from_secs(2),
        provenance: false,
        require_native: false,
        timeline: None,
        reservation_key: None,
        owner_check: Duration::from_millis(250),
        standby: None,
        fault: Some(fault),
        limits: Default::default(),
        allow_readable_target: false,
        // Plaintext TCP, asked for by name: the caller is taken to be this user.
        insecure_tcp: true,
        config: Default::default(),
        reload_check: None,
        tls: None,
    };
    let daemon = std::thread::spawn(move || pdstor::api::serve(cfg));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !socket.exists() {
        assert!(Instant::now() < deadline, "the daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    InProcess { target, server: format!("http://127.0.0.1:{port}"), socket, daemon }
}
