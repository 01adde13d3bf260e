//! One QEMU guest: its command line, one small function per concern, and a
//! bounded wait that reaps the child on every path.
//!
//! Progress is a small state machine read off the console log:
//! `Starting` → (boot marker) `Booted` → (`pdstor-vminit: suite X`) `Suite(X)`
//! → (QEMU exits) done, or `TimedOut`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pdstor_vmtest_spec::{BOOT_MARKER, DiskSpec, NVME_MDTS, RESULT_PORT_NAME};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Tcg,
    Kvm,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

pub struct Vm<'a> {
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub disks: Vec<(DiskSpec, PathBuf)>,
    pub dir: &'a Path,
    pub extra_append: String,
    /// A virtio-net card (a topology's private network).
    pub nic: Option<Nic>,
    /// Set by another thread to stop this guest (its peer in a topology failed).
    pub abort: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Console lines at which the guest asks to be killed, as a host that
    /// dies does: QEMU is killed at once, nothing shut down.
    pub kill_markers: &'static [&'static str],
}

/// A guest's network card on a QEMU `-netdev`.
pub struct Nic {
    /// The `-netdev` (a topology's: `socket,udp=…,localaddr=…`, the two
    /// guests each other's peer).
    pub netdev: String,
    /// Its MAC address: each guest of a network its own (QEMU would give
    /// every guest the same one).
    pub mac: &'static str,
}

pub struct VmRun {
    pub accel: Accel,
    pub timed_out: bool,
    pub booted: bool,
    pub results_file: PathBuf,
    pub console_file: PathBuf,
    pub qemu_stderr: String,
    pub status: Option<std::process::ExitStatus>,
    /// Killed because it asked to be ([`Vm::kill_markers`]).
    pub killed_on_request: bool,
    /// The console line that asked.
    pub kill_line: Option<String>,
}

impl Vm<'_> {
    pub fn console_file(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub fn results_file(&self) -> PathBuf {
        self.dir.join("results.jsonl")
    }

    /// `-accel`/`-cpu`: TCG with every CPU feature it emulates (SSE4.2 for
    /// crc32c, etc.); KVM with the host's.
    ///
    /// TCG runs the guest's two CPUs on one host thread (`thread=single`),
    /// round robin. With one thread per CPU (`thread=multi`) a CPU could run
    /// code another CPU had just rewritten — the kernel patches its own text
    /// at run time (static keys, `text_poke_bp`'s int3) — from a stale
    /// translation: a CI run's series-kernel guest died of exactly that, an
    /// int3 oops in the idle task's `set_next_task_fair` two seconds after
    /// boot. One thread makes every rewrite visible before the other CPU
    /// runs again; it costs ~25% of a single guest's wall time (126 -> 155 s
    /// for the series kernel's suites) and nothing in topology (57 s, 66 s
    /// before), whose two guests already share the host's two cores.
    fn machine_args(accel: Accel) -> Vec<String> {
        let (accel, cpu) = match accel {
            Accel::Tcg => ("tcg,thread=single", "max"),
            Accel::Kvm => ("kvm", "host"),
        };
        ["-machine", "q35", "-accel", accel, "-cpu", cpu, "-smp", "2", "-m", "2048"].map(String::from).to_vec()
    }

    /// Kernel command line, each argument for a reason.
    fn append(&self) -> String {
        let mut a = [
            "console=ttyS0", // the serial port QEMU writes to console.log
            "panic=-1",      // reboot at once on panic; with -no-reboot QEMU then exits
            "rdinit=/init",  // our Rust init in the initramfs
            "loglevel=6",    // driver messages land in the log for post-mortems
            "nokaslr",       // stable addresses in panic traces
        ]
        .join(" ");
        if !self.extra_append.is_empty() {
            a.push(' ');
            a.push_str(&self.extra_append);
        }
        a
    }

    fn console_args(&self) -> Vec<String> {
        vec![
            "-chardev".into(),
            format!("file,id=con,path={}", self.console_file().display()),
            "-serial".into(),
            "chardev:con".into(),
        ]
    }

    /// The results port: a virtio-serial port the guest finds by name.
    fn result_args(&self) -> Vec<String> {
        vec![
            "-device".into(),
            "virtio-serial-pci,id=vser".into(),
            "-chardev".into(),
            format!("file,id=res,path={}", self.results_file().display()),
            "-device".into(),
            format!("virtserialport,bus=vser.0,chardev=res,name={RESULT_PORT_NAME}"),
        ]
    }

    /// One NVMe controller per disk, found in the guest by its serial; MDTS is
    /// set so passthrough must be split by the engine.
    fn disk_args(&self) -> Result<Vec<String>> {
        let mut args = Vec::new();
        for (i, (spec, image)) in self.disks.iter().enumerate() {
            args.push("-drive".into());
            let bad = spec.bad_blocks();
            if bad.is_empty() {
                args.push(format!("file={},if=none,id=d{i},format=raw,cache=unsafe", image.display()));
            } else {
                // blkdebug between the raw format and the image: each rule is
                // armed by the raw driver's read_aio/write_aio event and fails
                // any request that covers its sector with EIO.
                let config = self.dir.join(format!("{}.blkdebug", spec.role));
                let rules: String = bad
                    .iter()
                    .map(|(at, event)| {
                        format!("[inject-error]\nevent = \"{event}\"\nerrno = \"5\"\nsector = \"{}\"\n\n", at / 512)
                    })
                    .collect();
                std::fs::write(&config, rules).with_context(|| format!("writing {}", config.display()))?;
                args.push(format!(
                    "if=none,id=d{i},format=raw,cache=unsafe,file.driver=blkdebug,file.config={},file.image.filename={}",
                    config.display(),
                    image.display()
                ));
            }
            args.push("-device".into());
            args.push(format!(
                "nvme,serial={},drive=d{i},logical_block_size={lb},physical_block_size={lb},mdts={NVME_MDTS}",
                spec.serial,
                lb = spec.logical_block
            ));
        }
        Ok(args)
    }

    /// The topology's private network card, if any; `-nodefaults` gives the
    /// guest no other.
    fn net_args(&self) -> Vec<String> {
        let Some(Nic { netdev, mac }) = &self.nic else { return Vec::new() };
        let device = format!("virtio-net-pci,netdev=net0,mac={mac}");
        vec!["-netdev".into(), format!("{netdev},id=net0"), "-device".into(), device]
    }

    fn command(&self, accel: Accel) -> Result<Command> {
        let stderr = std::fs::File::create(self.dir.join("qemu.stderr")).context("creating qemu.stderr")?;
        let mut c = Command::new("qemu-system-x86_64");
        c.args(["-nodefaults", "-no-reboot", "-display", "none"])
            .args(Self::machine_args(accel))
            .arg("-kernel")
            .arg(self.kernel)
            .arg("-initrd")
            .arg(self.initrd)
            .arg("-append")
            .arg(self.append())
            .args(self.console_args())
            .args(self.result_args())
            .args(self.disk_args()?)
            .args(self.net_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        Ok(c)
    }

    /// Boots and waits. With `boot_deadline`, a guest that shows no boot marker
    /// by then is killed and reported as not booted (the accelerator probe).
    pub fn run(
        &self,
        accel: Accel,
        timeout: Duration,
        boot_deadline: Option<Duration>,
        mut on_progress: impl FnMut(&str),
    ) -> Result<VmRun> {
        for f in [self.console_file(), self.results_file()] {
            let _ = std::fs::remove_file(&f);
        }
        let mut child =
            self.command(accel)?.spawn().context("starting qemu-system-x86_64 (cargo xtask deps installs it)")?;
        let started = Instant::now();
        let mut booted = false;
        // Bytes of the console already scanned: whole lines only. A line
        // read while the guest is still writing it is scanned once complete
        // (counting it half-written skipped it for good: a power-cut request
        // was missed that way and the guest ran on for ten minutes).
        let mut scanned = 0usize;
        let mut timed_out = false;
        let mut killed_on_request = false;
        let mut kill_line = None;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            let bytes = std::fs::read(self.console_file()).unwrap_or_default();
            let fresh = new_lines(&bytes, &mut scanned);
            if !booted && fresh.contains(BOOT_MARKER) {
                booted = true;
                on_progress("booted");
            }
            for line in fresh.lines() {
                if let Some(s) = line.strip_prefix("pdstor-vminit: suite ") {
                    on_progress(&format!("suite {s}"));
                }
                if self.kill_markers.iter().any(|m| line.contains(m)) {
                    killed_on_request = true;
                    kill_line = Some(line.to_owned());
                }
            }
            if killed_on_request {
                on_progress("killed, as it asked");
                kill(&mut child);
                break None;
            }
            if let Some(d) = boot_deadline
                && !booted
                && started.elapsed() > d
            {
                kill(&mut child);
                break None;
            }
            if started.elapsed() > timeout {
                timed_out = true;
                kill(&mut child);
                break None;
            }
            if self.abort.as_ref().is_some_and(|a| a.load(std::sync::atomic::Ordering::Relaxed)) {
                kill(&mut child);
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let console = std::fs::read_to_string(self.console_file()).unwrap_or_default();
        booted |= console.contains(BOOT_MARKER);
        let qemu_stderr = std::fs::read_to_string(self.dir.join("qemu.stderr")).unwrap_or_default();
        Ok(VmRun {
            accel,
            timed_out,
            booted,
            results_file: self.results_file(),
            console_file: self.console_file(),
            qemu_stderr,
            status,
            killed_on_request,
            kill_line,
        })
    }
}

/// Kills and reaps QEMU.
fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The whole lines of `console` after the first `scanned` bytes, advancing
/// `scanned` past them; a last line without its newline waits for the next
/// read.
fn new_lines(console: &[u8], scanned: &mut usize) -> String {
    let fresh = console.get(*scanned..).unwrap_or_default();
    let complete = fresh.iter().rposition(|&c| c == b'\n').map_or(0, |i| i + 1);
    *scanned += complete;
    String::from_utf8_lossy(&fresh[..complete]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::new_lines;

    #[test]
    fn a_line_read_half_written_is_scanned_once_complete() {
        let mut scanned = 0;
        assert_eq!(new_lines(b"boot\npdstor-vminit: cut this host's po", &mut scanned), "boot\n");
        let whole = b"boot\npdstor-vminit: cut this host's power, then boot it again at t\n";
        assert_eq!(new_lines(whole, &mut scanned), "pdstor-vminit: cut this host's power, then boot it again at t\n");
        assert_eq!(new_lines(whole, &mut scanned), "", "nothing is scanned twice");
        assert_eq!(
            new_lines(b"\xff\xfe garbage\n", &mut 0),
            "\u{fffd}\u{fffd} garbage\n",
            "invalid UTF-8 does not stop the scan"
        );
    }
}
