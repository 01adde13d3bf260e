//! The NVMe/TCP fabric: exporting namespaces with the kernel's target
//! (nvmet, through configfs), allowing hosts, and connecting from the
//! reader host with the kernel's initiator.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::machine::{Ctx, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::{DiskRole, NVME_TCP_PORT, SHARED_NQN, SHARED_SERIAL, STORAGE_ADDR};

use super::*;

pub(super) fn write(path: &Path, value: &str) -> Checked {
    Ok(std::fs::write(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))?)
}

/// Namespace 3: a small file-backed namespace on the ext4 disk, small
/// enough for a writer to fill every free slot of it in seconds.
pub(super) fn small_namespace(ctx: &Ctx) -> Checked<PathBuf> {
    Ok(ctx.disk(DiskRole::Ext4)?.mount.as_ref().ok_or("the ext4 disk is not mounted")?.join("topology-small.img"))
}

/// Exports the raw disk (1), the faulty one (2) and the small namespace (3).
pub(super) fn export_all(ctx: &Ctx, hosts: Option<&[&str]>) -> Checked {
    export_all_on(ctx, hosts, 1, STORAGE_ADDR)
}

/// [`export_all`] on port `port_id`, listening on `traddr` only.
pub(super) fn export_all_on(ctx: &Ctx, hosts: Option<&[&str]>, port_id: u32, traddr: &str) -> Checked {
    let (raw, faulty) = (ctx.disk(DiskRole::Raw)?.block.clone(), ctx.disk(DiskRole::Faulty)?.block.clone());
    export_on(&[raw.as_path(), faulty.as_path(), small_namespace(ctx)?.as_path()], hosts, port_id, traddr)
}

/// Exports `devices` as namespaces 1, 2, … of [`SHARED_NQN`] on NVMe/TCP,
/// port `port_id` listening on `traddr`: to `hosts` only, or (None) to any
/// host (the network is private to the test). Each namespace has a fixed
/// UUID, which every host that reaches it over the fabric sees.
pub(super) fn export_on(devices: &[&Path], hosts: Option<&[&str]>, port_id: u32, traddr: &str) -> Checked {
    let cfs = Path::new("/sys/kernel/config");
    if !cfs.join("nvmet").exists() {
        sh("mount", &["-t", "configfs", "configfs", "/sys/kernel/config"])?;
    }
    let nvmet = cfs.join("nvmet");
    if !nvmet.exists() {
        return Err("no /sys/kernel/config/nvmet: the nvmet module is not loaded".into());
    }
    let subsys = nvmet.join("subsystems").join(SHARED_NQN);
    if subsys.exists() {
        return Ok(());
    }
    let mk = |p: &PathBuf| std::fs::create_dir_all(p).map_err(|e| format!("creating {}: {e}", p.display()));
    mk(&subsys)?;
    match hosts {
        None => write(&subsys.join("attr_allow_any_host"), "1")?,
        Some(hosts) => {
            for h in hosts {
                allow_host(h)?;
            }
        }
    }
    write(&subsys.join("attr_serial"), SHARED_SERIAL)?;
    for (i, device) in devices.iter().enumerate() {
        let ns = subsys.join(format!("namespaces/{}", i + 1));
        mk(&ns)?;
        write(&ns.join("device_path"), &device.to_string_lossy())?;
        // QEMU's emulated NVMe reports no namespace identifiers to Linux
        // (its controller is quirked NVME_QUIRK_BOGUS_NID), so the target
        // gives each namespace a fixed UUID, as an array names its own.
        write(&ns.join("device_uuid"), &format!("5d5e1000-0000-4000-8000-{:012x}", i + 1))?;
        // Persistent reservations, where this kernel's target has them (set
        // before the namespace is enabled).
        if ns.join("resv_enable").exists() {
            write(&ns.join("resv_enable"), "1")?;
        }
        write(&ns.join("enable"), "1")?;
    }
    open_port(port_id, traddr)
}

/// Opens NVMe/TCP port `id` on `traddr` to the shared subsystem: until it
/// is open, a host that reaches for that address has its connection
/// refused, which it retries (a connect the target rejects, for a host it
/// does not allow, is final: the host fails its queued I/O).
pub(super) fn open_port(id: u32, traddr: &str) -> Checked {
    let nvmet = Path::new("/sys/kernel/config/nvmet");
    let port = nvmet.join(format!("ports/{id}"));
    std::fs::create_dir_all(&port).map_err(|e| format!("creating {}: {e}", port.display()))?;
    write(&port.join("addr_trtype"), "tcp")?;
    write(&port.join("addr_adrfam"), "ipv4")?;
    write(&port.join("addr_traddr"), traddr)?;
    write(&port.join("addr_trsvcid"), &NVME_TCP_PORT.to_string())?;
    let (subsys, link) = (nvmet.join("subsystems").join(SHARED_NQN), port.join("subsystems").join(SHARED_NQN));
    std::os::unix::fs::symlink(&subsys, &link).map_err(|e| format!("linking {}: {e}", link.display()))?;
    Ok(())
}

/// Connects the reader host to the storage guest's target, retrying while it boots.
pub(super) fn connect() -> Checked {
    connect_as(READER_HOSTNQN, READER_HOSTID)
}

/// Connects this guest to the shared subsystem as the host `hostnqn`. An
/// explicit host identity: a bare guest has no /etc/nvme/hostnqn, and
/// nvme-cli's made-up NQN and host id disagree.
pub(super) fn connect_as(hostnqn: &str, hostid: &str) -> Checked {
    connect_at(hostnqn, hostid, STORAGE_ADDR)
}

/// [`connect_as`] to the target at `traddr`.
pub(super) fn connect_at(hostnqn: &str, hostid: &str, traddr: &str) -> Checked {
    let deadline = Instant::now() + Duration::from_secs(180);
    let port = NVME_TCP_PORT.to_string();
    loop {
        let args = [
            "connect",
            "-t",
            "tcp",
            "-a",
            traddr,
            "-s",
            &port,
            "-n",
            SHARED_NQN,
            "--hostnqn",
            hostnqn,
            "--hostid",
            hostid,
        ];
        // A second host identity on this guest ([`THIRD_HOSTNQN`]) reaches the
        // same address and subsystem, which nvme-cli calls "already
        // connected" by the first (it does not compare host NQNs): asked of
        // the kernel's fabrics device itself, as nvme-cli would.
        let connected = match hostnqn {
            THIRD_HOSTNQN => fabrics_connect(&format!(
                "transport=tcp,traddr={traddr},trsvcid={port},nqn={SHARED_NQN},hostnqn={hostnqn},hostid={hostid}"
            )),
            _ => sh("nvme", &args).map(drop).map_err(String::from),
        };
        match connected {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(format!("nvme connect for 180 s: {e}").into()),
            Err(_) => std::thread::sleep(Duration::from_secs(2)),
        }
    }
}

/// Connects with `options` written to `/dev/nvme-fabrics` (the kernel
/// answers the new controller's instance); as nvme-cli does underneath.
fn fabrics_connect(options: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/nvme-fabrics")
        .map_err(|e| format!("opening /dev/nvme-fabrics: {e}"))?;
    f.write_all(options.as_bytes()).map_err(|e| format!("connecting with {options:?}: {e}"))?;
    let mut answer = String::new();
    f.read_to_string(&mut answer).map_err(|e| format!("reading the new controller's instance: {e}"))?;
    crate::machine::console(&format!("pdstor-vminit: connected {options:?}: {}", answer.trim()));
    Ok(())
}

/// The fabric namespace 1.
pub(super) fn fabric_namespace() -> Checked<PathBuf> {
    fabric_namespace_n(1)
}

/// Namespace `n` of the shared subsystem, as this host sees it over the
/// fabric: the block device whose subsystem is [`SHARED_NQN`] and whose NSID
/// is `n` (device names number namespaces in the order they were found, and
/// the storage guest has local NVMe namespaces of NSID 1 too), through this
/// guest's own connection (not the [`THIRD_HOSTNQN`] one).
pub(super) fn fabric_namespace_n(n: u32) -> Checked<PathBuf> {
    fabric_namespace_as(n, None)
}

/// [`fabric_namespace_n`] through the connection of host `hostnqn` (None:
/// this guest's own): without NVMe multipath each connection has its own
/// block devices.
pub(super) fn fabric_namespace_as(n: u32, hostnqn: Option<&str>) -> Checked<PathBuf> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let blocks: Vec<String> = std::fs::read_dir("/sys/block")
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let attr = |b: &String, a: &str| std::fs::read_to_string(format!("/sys/block/{b}/{a}")).ok();
        let found = blocks.iter().find(|b| {
            b.starts_with("nvme")
                && attr(b, "device/subsysnqn").is_some_and(|s| s.trim() == SHARED_NQN)
                && attr(b, "nsid").is_some_and(|s| s.trim() == n.to_string())
                && match (attr(b, "device/hostnqn"), hostnqn) {
                    (Some(h), Some(want)) => h.trim() == want,
                    (None, Some(_)) => false,
                    (h, None) => h.is_none_or(|h| h.trim() != THIRD_HOSTNQN),
                }
        });
        if let Some(b) = found {
            let dev = PathBuf::from("/dev").join(b);
            if dev.exists() {
                return Ok(dev);
            }
        }
        if Instant::now() > deadline {
            let who = hostnqn.unwrap_or("this host");
            return Err(
                format!("no namespace {n} of {SHARED_NQN} for {who} within 20 s (block devices: {blocks:?})").into()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether this kernel's NVMe target does persistent reservations (Debian's
/// 6.12 nvmet does not: it has no `resv_enable`; the series kernel, 7.2, does).
/// Both guests boot the same kernel, so both sides answer alike.
pub(super) fn nvmet_has_reservations() -> bool {
    std::fs::read_to_string("/proc/kallsyms").is_ok_and(|k| k.contains(" nvmet_parse_pr_cmd"))
}

/// SKIP where this kernel's NVMe target has no persistent reservations;
/// `without` says what the test could not do there.
pub(super) fn needs_reservations(without: &str) -> Checked {
    if nvmet_has_reservations() {
        return Ok(());
    }
    Err(crate::suites::skip(format!(
        "this kernel's NVMe target has no persistent reservations (Debian's 6.12 nvmet has no resv_enable){without}; \
         the rw-dmabuf series kernel (7.2) runs this test"
    )))
}

/// Lets host `hostnqn` connect to the shared subsystem (exported to named hosts).
pub(super) fn allow_host(hostnqn: &str) -> Checked {
    let nvmet = Path::new("/sys/kernel/config/nvmet");
    let host = nvmet.join("hosts").join(hostnqn);
    if !host.exists() {
        std::fs::create_dir_all(&host).map_err(|e| format!("creating {}: {e}", host.display()))?;
    }
    let link = nvmet.join("subsystems").join(SHARED_NQN).join("allowed_hosts").join(hostnqn);
    Ok(std::os::unix::fs::symlink(&host, &link).map_err(|e| format!("allowing {hostnqn}: {e}"))?)
}
