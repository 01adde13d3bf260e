//! What a suite knows of the guest it runs in: its NVMe disks ([`Ctx`]),
//! the kernel command line the host wrote (`pdstor.<key>=`, whether the
//! kernel has the rw-dmabuf series), the console, and running a tool. The
//! guest's `/init` ([`crate::guest`]) sets these up and runs the suites; the
//! suites import this, never `/init`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use pdstor_vmtest_spec::{DiskRole, Failure};

/// One NVMe namespace in the guest.
#[derive(Debug, Clone)]
pub struct GuestDisk {
    pub role: DiskRole,
    /// `/dev/nvmeXnY`.
    pub block: PathBuf,
    /// `/dev/ngXnY`.
    pub generic: PathBuf,
    /// Where its filesystem is mounted (ext4 and XFS disks).
    pub mount: Option<PathBuf>,
}

/// What a suite gets.
pub struct Ctx {
    pub disks: BTreeMap<DiskRole, GuestDisk>,
    pub scratch: PathBuf,
}

impl Ctx {
    /// A disk the test needs: a setup failure if the guest has none.
    pub fn disk(&self, role: DiskRole) -> Result<&GuestDisk, Failure> {
        self.disks
            .get(&role)
            .ok_or_else(|| Failure::Setup { message: format!("no {role} disk was found in the guest") })
    }
}

/// Whether the host booted this guest on a kernel with the rw-dmabuf series
/// (`pdstor.rw_dmabuf=1` on the command line): the ground truth the engine's
/// own capability probe is checked against, and what suites branch on.
pub fn expects_rw_dmabuf() -> bool {
    std::fs::read_to_string("/proc/cmdline").is_ok_and(|c| c.split_whitespace().any(|a| a == "pdstor.rw_dmabuf=1"))
}

/// The value of `pdstor.<key>=…` on the kernel command line, if given: how the
/// host tells each guest of a topology its role (`pdstor.role`), its address
/// (`pdstor.ip`) and whether it has disks of its own (`pdstor.nodisks`).
pub fn cmdline(key: &str) -> Option<String> {
    let c = std::fs::read_to_string("/proc/cmdline").ok()?;
    let prefix = format!("pdstor.{key}=");
    c.split_whitespace().find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
}

/// Writes a line to the console (the serial port the host logs).
pub fn console(line: &str) {
    // PID 1's stdout is /dev/console, the serial port the host logs.
    println!("{line}");
}

/// Runs a tool and returns its stdout, or a [`Failure::Command`] with its
/// stderr.
pub fn sh(program: &str, args: &[&str]) -> Result<String, Failure> {
    let command = format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .env("PATH", "/sbin:/bin:/usr/sbin:/usr/bin")
        .output()
        .map_err(|e| Failure::Command { command: command.clone(), detail: format!("could not run it: {e}") })?;
    if !out.status.success() {
        let detail = format!(
            "exited with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
        return Err(Failure::Command { command, detail });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
