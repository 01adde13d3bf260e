//! What a soak runs: the target (a file, or a zram device given back after),
//! the daemon (started, killed, restarted, reloaded), the driver processes
//! (spawned, killed, respawned), and the small filesystem its log lives on
//! (filled, for a full disk, and emptied).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Where the namespace lives.
pub enum Target {
    /// A file (512 MiB, made by `pdstor format`).
    File(PathBuf),
    /// A zram device, reset and removed when dropped.
    Zram(pdstor_testkit::Zram),
}

impl Target {
    /// A 512 MiB target of `kind` in `dir` (about 7,900 slots of 64 KiB:
    /// fewer than the mix keeps held, so prepares contend for room);
    /// `Err(reason)` inside where this
    /// machine cannot make one.
    pub fn make(kind: &str, dir: &Path) -> Result<std::result::Result<Target, String>> {
        match kind {
            "file" => Ok(Ok(Target::File(dir.join("kv.img")))),
            "zram" => Ok(pdstor_testkit::Zram::sized("512M").map(Target::Zram)),
            other => bail!("no target kind {other:?}: file or zram"),
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            Target::File(p) => p,
            Target::Zram(z) => &z.path,
        }
    }

    /// `pdstor format` with 64 KiB slots.
    pub fn format(&self, pdstor: &Path) -> Result<()> {
        let mut c = Command::new(pdstor);
        c.args(["format", "--chunk-slot", "64K", "--journal", "16M", "--force", "--target"]).arg(self.path());
        if let Target::File(p) = self {
            let _ = std::fs::remove_file(p);
            c.args(["--size", "512M"]);
        }
        let out = c.output().context("running pdstor format")?;
        if !out.status.success() {
            bail!("pdstor format {}: {}", self.path().display(), String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }
}

/// A tmpfs of 64 MiB for the daemon's log (root), which the soak fills for
/// a while: a full disk under the daemon. When dropped, the log is copied
/// out beside it (`keep`) and the tmpfs unmounted.
pub struct LogDisk {
    pub dir: PathBuf,
    keep: PathBuf,
    mounted: bool,
}

impl LogDisk {
    pub fn mount(dir: PathBuf, keep: PathBuf, root: bool) -> Result<LogDisk> {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mounted = root
            && Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=64m", "soak-log"])
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
        Ok(LogDisk { dir, keep, mounted })
    }

    /// Unmounts a tmpfs a killed soak left at `dir` (nothing there: nothing done).
    pub fn unmount_stale(dir: &Path) {
        let mounted = std::fs::read_to_string("/proc/self/mounts")
            .is_ok_and(|m| m.lines().any(|l| l.split(' ').nth(1) == Some(&*dir.display().to_string())));
        if mounted {
            let _ = Command::new("umount").arg(dir).status();
        }
    }

    /// Whether the disk can be filled (it is its own filesystem).
    pub fn fillable(&self) -> bool {
        self.mounted
    }

    /// Fills the disk: writes until ENOSPC.
    pub fn fill(&self) -> Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(self.dir.join("balloon")).context("creating the balloon file")?;
        let block = vec![0xa5u8; 64 << 10];
        while f.write_all(&block).is_ok() {}
        Ok(())
    }

    pub fn empty(&self) {
        let _ = std::fs::remove_file(self.dir.join("balloon"));
    }
}

impl Drop for LogDisk {
    fn drop(&mut self) {
        let _ = std::fs::copy(self.dir.join("serve.log"), &self.keep);
        if self.mounted && !Command::new("umount").arg(&self.dir).status().is_ok_and(|s| s.success()) {
            eprintln!("soak: could not unmount {}: unmount it by hand", self.dir.display());
        }
    }
}

/// The daemon under test.
pub struct Daemon {
    pdstor: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    pub control: PathBuf,
    pub data: PathBuf,
    child: Option<Child>,
    envs: Vec<(String, String)>,
}

impl Daemon {
    pub fn new(pdstor: &Path, target: &Path, dir: &Path, log: PathBuf, config: &Path) -> Daemon {
        let (control, data) = (dir.join("control.sock"), dir.join("data.sock"));
        let args = [
            "serve",
            "--target",
            &target.display().to_string(),
            "--listen",
            &format!("unix:{}", control.display()),
            "--data-socket",
            &data.display().to_string(),
            "--config",
            &config.display().to_string(),
            "--prepare-idle-timeout-ms",
            "20000",
            "--admission-timeout-ms",
            "15000",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Daemon { pdstor: pdstor.into(), args, log, control, data, child: None, envs: Vec::new() }
    }

    /// An environment variable for every start (the planted leak).
    pub fn env(&mut self, k: &str, v: &str) {
        self.envs.push((k.into(), v.into()));
    }

    /// Starts it and waits until both sockets answer.
    pub fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut c = Command::new(&self.pdstor);
        c.args(&self.args).stdout(Stdio::null()).stderr(log).env("RUST_LOG", "warn");
        // SAFETY: between fork and exec the closure only calls getrlimit and
        // setrlimit, which are async-signal-safe; it touches no lock or heap.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut c, || {
                // Descriptors up to the hard limit: a leak the soak plants is
                // judged by its verdict, not cut short by EMFILE at 1024.
                let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
                    r.rlim_cur = r.rlim_max;
                    libc::setrlimit(libc::RLIMIT_NOFILE, &r);
                }
                Ok(())
            });
        }
        for (k, v) in &self.envs {
            c.env(k, v);
        }
        self.child = Some(c.spawn().with_context(|| format!("starting {}", self.pdstor.display()))?);
        let deadline = Instant::now() + Duration::from_secs(60);
        while super::sample::metrics(&self.control).is_err() || !self.data.exists() {
            if Instant::now() > deadline || self.exited() {
                bail!("pdstor serve did not come up; see {}", self.log.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Whether it is gone (and not by our hand).
    pub fn exited(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some())
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn signal(&self, sig: libc::c_int) {
        if let Some(c) = &self.child
            && let Ok(pid) = libc::pid_t::try_from(c.id())
        {
            // SAFETY: kill(2) on our own child, not reaped yet.
            unsafe { libc::kill(pid, sig) };
        }
    }

    /// SIGTERM, and the exit status (SIGKILL after 30 s).
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        let Some(mut c) = self.child.take() else { bail!("the daemon is not running") };
        crate::stop(&mut c, Duration::from_secs(30))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One driver process of the mix.
pub struct Driver {
    pub role: &'static str,
    pub id: u32,
    child: Option<Child>,
}

/// How the drivers are started.
pub struct Drivers {
    pub python: PathBuf,
    pub script: PathBuf,
    pub dir: PathBuf,
    pub seed: u64,
    pub list: Vec<Driver>,
}

impl Drivers {
    pub fn spawn(&mut self, role: &'static str, id: u32, daemon: &Daemon) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("driver-{role}-{id}.log")))?;
        let child = Command::new(&self.python)
            .arg(&self.script)
            .arg(role)
            .args(["--id", &id.to_string(), "--seed", &self.seed.to_string(), "--dir"])
            .arg(&self.dir)
            .arg("--server")
            .arg(format!("unix:{}", daemon.control.display()))
            .arg("--data-socket")
            .arg(&daemon.data)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!("starting the {role} driver ({} {})", self.python.display(), self.script.display())
            })?;
        match self.list.iter_mut().find(|d| d.role == role && d.id == id) {
            Some(d) => d.child = Some(child),
            None => self.list.push(Driver { role, id, child: Some(child) }),
        }
        Ok(())
    }

    /// SIGKILL of one driver; answers whether it was running.
    pub fn kill9(&mut self, role: &str, id: u32) -> bool {
        let Some(d) = self.list.iter_mut().find(|d| d.role == role && d.id == id) else { return false };
        let Some(mut c) = d.child.take() else { return false };
        let running = c.try_wait().ok().flatten().is_none();
        let _ = c.kill();
        let _ = c.wait();
        running
    }

    /// The drivers that exited on their own since the last call: role, id, status.
    pub fn exited(&mut self) -> Vec<(&'static str, u32, std::process::ExitStatus)> {
        let mut out = Vec::new();
        for d in &mut self.list {
            if let Some(c) = &mut d.child
                && let Ok(Some(status)) = c.try_wait()
            {
                out.push((d.role, d.id, status));
                d.child = None;
            }
        }
        out
    }

    /// Drivers still running (as of the last [`Drivers::exited`]).
    pub fn running(&self) -> usize {
        self.list.iter().filter(|d| d.child.is_some()).count()
    }
}

impl Drop for Drivers {
    fn drop(&mut self) {
        for d in &mut self.list {
            if let Some(mut c) = d.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
