//! The guest's `/init` (PID 1): mounts the pseudo filesystems, loads the
//! modules the host listed, finds the NVMe disks by serial, makes and mounts
//! ext4 and XFS, runs the requested suites, writes one JSON line per test to
//! the `vmtest.result` virtio-serial port, and powers the guest off.
//!
//! Every failure is reported, never swallowed: a setup step that fails ends the
//! run with a failing result line, and the host treats a missing
//! `guest-finished` line as a failure too.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::{MsFlags, mount, umount};

use crate::machine::{Ctx, GuestDisk, cmdline, console, sh};
use crate::suites;
use pdstor_vmtest_spec::{
    BOOT_MARKER, DISKS, DiskRole, FINISHED_TEST, Failure, GUEST_CONFIG_PATH, GuestConfig, Outcome, RESULT_PORT_NAME,
    TestResult,
};

/// Brings up the topology's private network, when the host gave this guest
/// an address (`pdstor.ip=ADDR/PREFIX` on `eth0`, the one virtio-net card).
fn network() -> Result<(), String> {
    let Some(ip) = cmdline("ip") else { return Ok(()) };
    sh("ip", &["link", "set", "eth0", "up"])?;
    sh("ip", &["addr", "add", &ip, "dev", "eth0"])?;
    console(&format!("pdstor-vminit: eth0 {ip} ({})", cmdline("role").unwrap_or_default()));
    Ok(())
}

/// Entry point of `/init`. Never returns: the guest powers off.
pub fn main() -> ! {
    let started = Instant::now();
    let mut port: Option<File> = None;
    let outcome = run(&mut port);
    let last = TestResult {
        suite: "vmtest".into(),
        test: FINISHED_TEST.into(),
        disk: None,
        outcome: match outcome {
            Ok(()) => Outcome::Pass,
            Err(message) => Outcome::Fail(Failure::Setup { message }),
        },
        millis: started.elapsed().as_millis() as u64,
    };
    report(&mut port, &last);
    if let Some(p) = port.as_mut() {
        let _ = p.flush();
        let _ = p.sync_all();
    }
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    // reboot() only returns on failure; PID 1 must not exit.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn run(port: &mut Option<File>) -> Result<(), String> {
    mount_pseudo_filesystems()?;
    console(BOOT_MARKER);
    let cfg: GuestConfig = serde_json::from_str(
        &std::fs::read_to_string(GUEST_CONFIG_PATH).map_err(|e| format!("reading {GUEST_CONFIG_PATH}: {e}"))?,
    )
    .map_err(|e| format!("parsing {GUEST_CONFIG_PATH}: {e}"))?;
    console(&format!("pdstor-vminit: kernel {}, suites {:?}", cfg.kernel_release, cfg.suites));
    load_modules(&cfg.modules)?;
    // The control plane listens on loopback.
    sh("ip", &["link", "set", "lo", "up"])?;
    network()?;
    *port = Some(open_result_port()?);
    // A topology's reader guest has no NVMe of its own: what it reads comes
    // over the fabric.
    let disks = if cmdline("nodisks").is_some() {
        BTreeMap::new()
    } else {
        let mut disks = find_disks(Duration::from_secs(30))?;
        prepare_filesystems(&mut disks)?;
        disks
    };
    let scratch = PathBuf::from("/tmp/vmtest");
    std::fs::create_dir_all(&scratch).map_err(|e| format!("creating {}: {e}", scratch.display()))?;
    let ctx = Ctx { disks, scratch };
    for name in &cfg.suites {
        let suite = suites::find(name).ok_or_else(|| format!("unknown suite {name:?}"))?;
        console(&format!("pdstor-vminit: suite {name}"));
        // Booted again after a power cut: the suite resumes at the test that asked for it.
        let resume = cmdline("resume");
        let start = resume.as_deref().and_then(|r| suite.tests.iter().position(|t| t.name == r)).unwrap_or(0);
        // `pdstor.only=TEST pdstor.repeat=N` (vmtest --append): one test, N
        // times in one boot, each run reported (a flake hunt, not CI).
        let only = cmdline("only");
        let repeat = cmdline("repeat").and_then(|n| n.parse::<u32>().ok()).unwrap_or(1).max(1);
        let chosen = suite.tests[start..].iter().filter(|t| only.as_deref().is_none_or(|o| o == t.name));
        for test in chosen.flat_map(|t| std::iter::repeat_n(t, repeat as usize)) {
            let t = Instant::now();
            let outcome = match test.disk {
                Some(d) if !cfg.disks.contains(&d) => Outcome::Skip(format!("--fs leaves out the {d} disk")),
                _ => suites::outcome((test.run)(&ctx)),
            };
            let result = TestResult {
                suite: suite.name.into(),
                test: test.name.into(),
                disk: test.disk,
                outcome,
                millis: t.elapsed().as_millis() as u64,
            };
            report(port, &result);
        }
    }
    for d in ctx.disks.values() {
        if let Some(m) = &d.mount {
            let _ = umount(m.as_path());
        }
    }
    Ok(())
}

fn report(port: &mut Option<File>, r: &TestResult) {
    let line = serde_json::to_string(r).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
    console(&format!("pdstor-vminit: result {line}"));
    if let Some(p) = port.as_mut() {
        let _ = writeln!(p, "{line}");
        let _ = p.flush();
    }
}

fn mount_pseudo_filesystems() -> Result<(), String> {
    let mounts: [(&str, &str, &str); 7] = [
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("devtmpfs", "/dev", "devtmpfs"),
        ("tmpfs", "/tmp", "tmpfs"),
        ("tracefs", "/sys/kernel/tracing", "tracefs"),
        ("bpf", "/sys/fs/bpf", "bpf"),
        ("tmpfs", "/run", "tmpfs"),
    ];
    for (source, target, fstype) in mounts {
        let _ = std::fs::create_dir_all(target);
        mount(Some(source), target, Some(fstype), MsFlags::empty(), None::<&str>)
            .map_err(|e| format!("mounting {fstype} on {target}: {e}"))?;
    }
    Ok(())
}

/// Loads each module with `finit_module(2)`. A module that is already there is
/// fine; one the CPU cannot use (`crc32c-intel` without SSE4.2) is noted.
fn load_modules(modules: &[String]) -> Result<(), String> {
    for m in modules {
        let file = File::open(m).map_err(|e| format!("opening module {m}: {e}"))?;
        let params = CString::default();
        // SAFETY: finit_module reads the module from the open fd and the empty,
        // NUL-terminated parameter string; both outlive the call.
        let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EEXIST) => {}
                Some(libc::ENODEV) => console(&format!("pdstor-vminit: module {m} does not apply here: {err}")),
                _ => return Err(format!("loading module {m}: {err}")),
            }
        }
    }
    Ok(())
}

fn open_result_port() -> Result<File, String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(entries) = std::fs::read_dir("/sys/class/virtio-ports") {
            for e in entries.flatten() {
                let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
                if name.trim() == RESULT_PORT_NAME {
                    let dev = Path::new("/dev").join(e.file_name());
                    return OpenOptions::new()
                        .write(true)
                        .open(&dev)
                        .map_err(|err| format!("opening result port {}: {err}", dev.display()));
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no virtio-serial port named {RESULT_PORT_NAME} appeared within 10 s"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Finds each disk of [`DISKS`] by the serial its NVMe subsystem reports.
/// Controller numbering is not stable between boots; serials are.
fn find_disks(timeout: Duration) -> Result<BTreeMap<DiskRole, GuestDisk>, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut found = BTreeMap::new();
        let serial_of = |sys: &Path| std::fs::read_to_string(sys.join("device/serial")).unwrap_or_default();
        let generics: Vec<(String, PathBuf)> = std::fs::read_dir("/sys/class/nvme-generic")
            .map(|rd| rd.flatten().map(|e| (serial_of(&e.path()), Path::new("/dev").join(e.file_name()))).collect())
            .unwrap_or_default();
        if let Ok(blocks) = std::fs::read_dir("/sys/block") {
            for e in blocks.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !name.starts_with("nvme") || name.contains('c') {
                    continue;
                }
                let serial = serial_of(&e.path());
                let Some(spec) = pdstor_vmtest_spec::disk_by_serial(&serial) else {
                    continue;
                };
                let generic = Path::new("/dev").join(name.replacen("nvme", "ng", 1));
                let generic = generics
                    .iter()
                    .find(|(s, p)| s.trim() == spec.serial && p.exists())
                    .map(|(_, p)| p.clone())
                    .unwrap_or(generic);
                let block = Path::new("/dev").join(&name);
                if block.exists() && generic.exists() {
                    found.insert(spec.role, GuestDisk { role: spec.role, block, generic, mount: None });
                }
            }
        }
        if found.len() == DISKS.len() {
            for d in found.values() {
                console(&format!("pdstor-vminit: {} disk is {} / {}", d.role, d.block.display(), d.generic.display()));
            }
            return Ok(found);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "found {} of {} NVMe disks by serial within {timeout:?}: {:?}",
                found.len(),
                DISKS.len(),
                found.keys().collect::<Vec<_>>()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn prepare_filesystems(disks: &mut BTreeMap<DiskRole, GuestDisk>) -> Result<(), String> {
    for (role, fstype) in [(DiskRole::Ext4, "ext4"), (DiskRole::Xfs, "xfs")] {
        let disk = disks.get_mut(&role).ok_or_else(|| format!("no {role} disk"))?;
        let dev = disk.block.to_string_lossy().into_owned();
        // A guest booted again after its power cut keeps its filesystems
        // (mounting replays their journals), as a rebooted host does.
        match fstype {
            _ if cmdline("resume").is_some() => String::new(),
            "xfs" => sh("mkfs.xfs", &["-q", "-f", &dev])?,
            _ => sh("mkfs.ext4", &["-q", "-F", &dev])?,
        };
        let mnt = PathBuf::from(format!("/mnt/{fstype}"));
        std::fs::create_dir_all(&mnt).map_err(|e| format!("creating {}: {e}", mnt.display()))?;
        mount(Some(disk.block.as_path()), mnt.as_path(), Some(fstype), MsFlags::empty(), None::<&str>)
            .map_err(|e| format!("mounting {dev} ({fstype}) on {}: {e}", mnt.display()))?;
        disk.mount = Some(mnt);
    }
    Ok(())
}
