//! What pdstor's tests ask of the machine, written once for every test tree
//! (`engine/`, `driver/tests/`, `tests/`) and for `cargo xtask`'s zram: a
//! skip that CI lists, whether we are root, whether a tool is installed,
//! scratch loop devices, zram devices and filesystems made on loop devices
//! (each torn down on drop), and `dd iflag=direct`, a reader of device bytes
//! that shares no code with pdstor.
//!
//! A constructor answers `Err(reason)` where this machine cannot make what
//! was asked (not root, a tool missing); the test then calls [`skip`] with
//! that reason and returns.
#![deny(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Reports a skipped test: `SKIP: <test>: <reason>` on stderr, and appended
/// to the file `PDSTOR_SKIP_LOG` names (`cargo xtask ci` lists them at the end).
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

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether `tool` is on the `PATH`.
pub fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success())
}

/// Runs `cmd`, answering its trimmed standard output or why it failed.
fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// A scratch folder on the disk that holds the build (`target/tmp/`, as
/// cargo's `CARGO_TARGET_TMPDIR`), not `/tmp`, which may be a tmpfs that
/// refuses `O_DIRECT`. Removed on drop.
pub fn scratch_dir() -> Result<tempfile::TempDir, String> {
    // target/<profile>/deps/<test binary> → target/tmp
    let exe = std::env::current_exe().map_err(|e| format!("finding the test binary: {e}"))?;
    let target =
        exe.ancestors().nth(3).ok_or_else(|| format!("{} is not under target/<profile>/deps", exe.display()))?;
    let tmp = target.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    tempfile::tempdir_in(&tmp).map_err(|e| format!("a scratch folder in {}: {e}", tmp.display()))
}

/// A loop device over an image file (direct I/O on, so its requests reach
/// the backing file without the page cache), detached on drop.
pub struct LoopDevice {
    /// `/dev/loopN`.
    pub path: PathBuf,
    _scratch: Option<tempfile::TempDir>,
}

impl LoopDevice {
    /// A sparse image of `size` bytes in a scratch folder, attached with
    /// `block_size`-byte sectors.
    pub fn scratch(size: u64, block_size: u32) -> Result<LoopDevice, String> {
        let dir = scratch_dir()?;
        let mut lo = LoopDevice::attach_with(&dir.path().join("disk.img"), size, Some(block_size))?;
        lo._scratch = Some(dir);
        Ok(lo)
    }

    /// Attaches `image` (created sparse at `len` bytes if missing), with the
    /// kernel's default sector size.
    pub fn attach(image: &Path, len: u64) -> Result<LoopDevice, String> {
        LoopDevice::attach_with(image, len, None)
    }

    fn attach_with(image: &Path, len: u64, block_size: Option<u32>) -> Result<LoopDevice, String> {
        if !is_root() {
            return Err("loop devices need root".into());
        }
        if !have("losetup") {
            return Err("losetup is not installed (cargo xtask deps)".into());
        }
        if !image.exists() {
            std::fs::File::create(image)
                .and_then(|f| f.set_len(len))
                .map_err(|e| format!("creating {}: {e}", image.display()))?;
        }
        let mut cmd = Command::new("losetup");
        cmd.args(["--find", "--show", "--direct-io=on"]);
        if let Some(bs) = block_size {
            cmd.args(["--sector-size", &bs.to_string()]);
        }
        let path = run(cmd.arg(image))?;
        Ok(LoopDevice { path: path.into(), _scratch: None })
    }

    /// Writes `value` to `/sys/block/<loopN>/queue/<attr>` (its queue limits
    /// and scheduler).
    pub fn set_queue(&self, attr: &str, value: &str) -> Result<(), String> {
        let name = self.path.file_name().ok_or_else(|| format!("{} has no device name", self.path.display()))?;
        let file = Path::new("/sys/block").join(name).join("queue").join(attr);
        std::fs::write(&file, value).map_err(|e| format!("writing {value} to {}: {e}", file.display()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}

/// A zram device: memory speed, and bio-based (it refuses `RWF_NOWAIT`).
/// Reset and removed on drop.
pub struct Zram {
    /// `/dev/zramN`.
    pub path: PathBuf,
    id: String,
}

impl Zram {
    /// A new zram device of `size` bytes (loading the module if need be).
    pub fn new(size: u64) -> Result<Zram, String> {
        Zram::sized(&size.to_string())
    }

    /// A new zram device of `size` as its `disksize` file takes it (`512M`,
    /// `2G`, or bytes).
    pub fn sized(size: &str) -> Result<Zram, String> {
        if !is_root() {
            return Err("zram devices need root".into());
        }
        let control = Path::new("/sys/class/zram-control/hot_add");
        if !control.exists() {
            let _ = Command::new("modprobe").args(["zram", "num_devices=0"]).status();
        }
        let id = std::fs::read_to_string(control).map_err(|e| format!("no zram here ({}: {e})", control.display()))?;
        let z = Zram { path: PathBuf::from(format!("/dev/zram{}", id.trim())), id: id.trim().to_owned() };
        std::fs::write(format!("/sys/block/zram{}/disksize", z.id), size)
            .map_err(|e| format!("sizing zram{} to {size}: {e}", z.id))?;
        Ok(z)
    }
}

impl Drop for Zram {
    /// The last user's io_uring may hold the device a moment after it is
    /// gone (ring teardown is asynchronous), so `reset` is retried.
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::write(format!("/sys/block/zram{}/reset", self.id), "1").is_ok() {
                let _ = std::fs::write("/sys/class/zram-control/hot_remove", &self.id);
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        eprintln!("could not reset zram{0}: run `echo 1 > /sys/block/zram{0}/reset`", self.id);
    }
}

/// A filesystem made on its own scratch loop device and mounted in a
/// scratch folder; unmounted on drop.
pub struct Filesystem {
    /// Where it is mounted.
    pub mount: PathBuf,
    /// `ext4` or `xfs`.
    pub fstype: &'static str,
    /// The loop device under it.
    pub dev: LoopDevice,
    _mnt: tempfile::TempDir,
}

impl Filesystem {
    /// A `size`-byte `fstype` filesystem, mounted.
    pub fn new(fstype: &'static str, size: u64) -> Result<Filesystem, String> {
        let mkfs = format!("mkfs.{fstype}");
        if !have(&mkfs) {
            return Err(format!("{mkfs} is not installed (cargo xtask deps)"));
        }
        let dev = LoopDevice::scratch(size, 512)?;
        let mut cmd = Command::new(&mkfs);
        match fstype {
            "xfs" => cmd.args(["-q", "-f"]),
            _ => cmd.args(["-q", "-F"]),
        };
        run(cmd.arg(&dev.path))?;
        let mnt = scratch_dir()?;
        run(Command::new("mount").arg(&dev.path).arg(mnt.path()))?;
        Ok(Filesystem { mount: mnt.path().into(), fstype, dev, _mnt: mnt })
    }
}

impl Drop for Filesystem {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// Reads `len` bytes at `offset` of `path` with `dd iflag=direct`: a reader
/// that shares no code with pdstor. Panics (this is for tests) if dd fails
/// or reads short.
pub fn dd_direct(path: &Path, offset: u64, len: u64) -> Vec<u8> {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=direct,skip_bytes,count_bytes", "bs=1M", "status=none"])
        .arg(format!("skip={offset}"))
        .arg(format!("count={len}"))
        .output()
        .expect("running dd");
    assert!(out.status.success(), "dd {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout.len() as u64, len, "dd read {} of {len} bytes of {}", out.stdout.len(), path.display());
    out.stdout
}
