//! `protocol`: the end-to-end handoff inside the guest — `pdstor serve` on the
//! raw NVMe namespace through passthrough (`/dev/ngXnY`, chunks larger than
//! MDTS) and on a file on XFS, a writer process and a reader process running
//! `pdstor handoff`, and the restored bytes compared outside the daemon.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Checked, Suite, Test};
use crate::machine::{Ctx, sh};
use pdstor_vmtest_spec::DiskRole;

pub const SUITE: Suite = Suite {
    name: "protocol",
    tests: &[
        Test { name: "handoff_nvme_passthrough", disk: Some(DiskRole::Raw), run: passthrough },
        Test { name: "handoff_xfs_file", disk: Some(DiskRole::Xfs), run: xfs },
    ],
};

pub(crate) const SERVER: &str = "unix:/tmp/vmtest/pdstor-control.sock";
const CONTROL: &str = "/tmp/vmtest/pdstor-control.sock";
pub(crate) const SOCKET: &str = "/tmp/vmtest/pdstor-data.sock";

/// A `pdstor serve` child, stopped with SIGTERM (then SIGKILL) on drop.
pub(crate) struct Daemon(pub(crate) Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(target: &Path) -> Checked<Daemon> {
    serve_with(target, &[])
}

/// Starts `pdstor serve` on `target` with `extra` arguments and waits for its
/// data and control sockets.
pub(crate) fn serve_with(target: &Path, extra: &[&str]) -> Checked<Daemon> {
    let _ = std::fs::remove_file(SOCKET);
    let log = std::fs::File::create("/tmp/vmtest/serve.log").map_err(|e| e.to_string())?;
    let child = Command::new("/bin/pdstor")
        .args(["serve", "--listen", SERVER, "--data-socket", SOCKET])
        .args(extra)
        .arg("--target")
        .arg(target)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("starting pdstor serve: {e}"))?;
    let d = Daemon(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(SOCKET).exists() || !Path::new(CONTROL).exists() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string("/tmp/vmtest/serve.log").unwrap_or_default();
            return Err(format!("pdstor serve did not come up: {log}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(d)
}

fn handoff(target: &Path, format_args: &[&str]) -> Checked {
    let t = target.to_string_lossy().into_owned();
    let mut args = vec!["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t];
    args.extend_from_slice(format_args);
    sh("/bin/pdstor", &args)?;
    let daemon = serve(target)?;
    let out = sh(
        "/bin/pdstor",
        &["handoff", "--bytes", "24M", "--chunk-size", "1M", "--server", SERVER, "--data-socket", SOCKET],
    )?;
    if !out.contains("restored byte for byte") {
        return Err(format!("handoff did not verify: {out}").into());
    }
    let left = sh("/bin/pdstor", &["publications", "--server", SERVER])?;
    if left.trim() != "[]" {
        return Err(format!("publications left after the ack: {left}").into());
    }
    drop(daemon);
    // The namespace reopens cleanly after the daemon's shutdown.
    let inspect = sh("/bin/pdstor", &["inspect", "--target", &t])?;
    if !inspect.contains("\"journal_stop\": null") {
        return Err(format!("the journal did not close cleanly: {inspect}").into());
    }
    Ok(())
}

fn passthrough(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    handoff(&disk.generic, &[])
}

fn xfs(ctx: &Ctx) -> Checked {
    let mount = ctx.disk(DiskRole::Xfs)?.mount.clone().ok_or("XFS not mounted")?;
    let img = mount.join("pdstor-ns.img");
    let r = handoff(&img, &["--size", "128M"]);
    let _ = std::fs::remove_file(&img);
    r
}
