//! `--suite topology`: two guests on a private network, a storage guest
//! that exports its raw disk over NVMe/TCP and a reader guest, each
//! rebooted where a test cuts its power.

use super::*;
use qemu::Nic;

/// A topology: the storage guest (all disks; it exports the raw one over
/// NVMe/TCP and hosts the writer) and the reader guest (no disks), joined by
/// a private QEMU socket network on the host's loopback and nothing else.
/// Both boot together; when one ends, the other gets 90 s before it is
/// stopped. A guest that asks for its power cut is killed at once and
/// booted again (on the same disks) at the test that asked. Each guest's
/// results are reported; the run fails if either fails.
pub(super) fn run_topology(
    kernel: &Path,
    initrd: &Path,
    disks: Vec<(pdstor_vmtest_spec::DiskSpec, PathBuf)>,
    (dir, append): (&Path, &str),
    timeout: Duration,
    accel: Accel,
    started: Instant,
) -> Result<()> {
    use pdstor_vmtest_spec::{KILL_ME, POWER_CUT_ME};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Two free loopback ports for the two QEMUs' network: UDP, connectionless,
    // so that a guest booted again after a power cut joins its peer again.
    let free_udp = || -> Result<u16> { Ok(std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port()) };
    let (sport, rport) = (free_udp()?, free_udp()?);
    let dirs = ["storage", "storage-reborn", "reader", "reader-reborn"].map(|d| dir.join(d));
    for d in &dirs {
        std::fs::create_dir_all(d)?;
    }
    let (stop_storage, stop_reader) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let storage_net = format!("socket,udp=127.0.0.1:{rport},localaddr=127.0.0.1:{sport}");
    let reader_net = format!("socket,udp=127.0.0.1:{sport},localaddr=127.0.0.1:{rport}");
    // A guest of each role, booted first (`resume` None) or again after its
    // power cut, its console in `dirs[d]`.
    let storage = |d: usize, resume: Option<&str>| Vm {
        kernel,
        initrd,
        disks: disks.clone(),
        dir: &dirs[d],
        extra_append: format!("{append} pdstor.role=storage pdstor.ip={STORAGE_ADDR}/24{}", resume_arg(resume)),
        nic: Some(Nic { netdev: storage_net.clone(), mac: "52:54:00:77:00:01" }),
        abort: Some(stop_storage.clone()),
        kill_markers: if resume.is_none() { &[POWER_CUT_ME] } else { &[] },
    };
    let reader = |d: usize, resume: Option<&str>| Vm {
        kernel,
        initrd,
        disks: Vec::new(),
        dir: &dirs[d],
        extra_append: format!(
            "{append} pdstor.role=reader pdstor.ip={READER_ADDR}/24 pdstor.nodisks=1{}",
            resume_arg(resume)
        ),
        nic: Some(Nic { netdev: reader_net.clone(), mac: "52:54:00:77:00:02" }),
        abort: Some(stop_reader.clone()),
        kill_markers: if resume.is_none() { &[KILL_ME, POWER_CUT_ME] } else { &[KILL_ME] },
    };
    println!(
        "vmtest topology: storage guest {STORAGE_ADDR} and reader guest {READER_ADDR} on UDP 127.0.0.1:{sport}/{rport} ({})",
        accel.name()
    );
    // When one guest ends, its peer has 90 s more (it may be reporting, or
    // fencing the reader host that just died).
    let grace = |peer: Arc<AtomicBool>| {
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(90));
            peer.store(true, Ordering::Relaxed);
        });
    };
    // A guest whose kernel panics in its own early boot, before /init ran
    // (seen under TCG on a loaded host), boots once more, as a single guest does.
    let boot = |vm: &Vm, name: &str| -> Result<qemu::VmRun> {
        let r = vm.run(accel, timeout, None, |p| println!("  {name}: {p}"))?;
        if panicked_in_early_boot(&r) {
            println!("  {name}: the kernel panicked during early boot, before /init ran; booting it once more");
            return vm.run(accel, timeout, None, |p| println!("  {name}: {p}"));
        }
        Ok(r)
    };
    let ((srun, reborn), (rrun, rreborn)) = std::thread::scope(|s| -> Result<_> {
        let st = s.spawn(|| {
            let r = life(&boot, storage(0, None), |t| storage(1, Some(t)), "storage");
            grace(stop_reader.clone());
            r
        });
        let rt = s.spawn(|| {
            let r = life(&boot, reader(2, None), |t| reader(3, Some(t)), "reader");
            grace(stop_storage.clone());
            r
        });
        let srun = st.join().map_err(|_| anyhow::anyhow!("the storage guest's thread panicked"))?;
        let rrun = rt.join().map_err(|_| anyhow::anyhow!("the reader guest's thread panicked"))?;
        Ok((srun?, rrun?))
    })?;
    report_topology([("storage", &srun, reborn.as_ref()), ("reader", &rrun, rreborn.as_ref())], &dirs, started)
}

/// A guest's life: booted, and booted again (`again`) at the test where it
/// asked for its power cut.
pub(super) fn life<'a>(
    boot: &dyn Fn(&Vm<'a>, &str) -> Result<qemu::VmRun>,
    first: Vm<'a>,
    again: impl Fn(&str) -> Vm<'a>,
    name: &str,
) -> Result<(qemu::VmRun, Option<qemu::VmRun>)> {
    let run = boot(&first, name)?;
    let reborn = match resume_point(&run) {
        Some(test) => {
            println!("  {name}: power cut, as it asked; booting it again at {test}");
            Some(boot(&again(&test), &format!("{name} (booted again)"))?)
        }
        None => None,
    };
    Ok((run, reborn))
}

/// The kernel command line's resume point for a guest booted again.
pub(super) fn resume_arg(resume: Option<&str>) -> String {
    resume.map(|t| format!(" pdstor.resume={t}")).unwrap_or_default()
}

/// Where a guest that asked for its power cut resumes: the test
/// named after the marker on its kill line.
pub(super) fn resume_point(first: &qemu::VmRun) -> Option<String> {
    first
        .kill_line
        .as_deref()
        .and_then(|l| l.split(pdstor_vmtest_spec::POWER_CUT_ME).nth(1))
        .map(|t| t.trim().to_owned())
}

/// Each guest's reports (and its report booted again after a power cut),
/// and where their consoles are.
pub(super) fn report_topology(
    guests: [(&str, &qemu::VmRun, Option<&qemu::VmRun>); 2],
    dirs: &[PathBuf; 4],
    started: Instant,
) -> Result<()> {
    let mut outcome = Ok(());
    for (name, run, reborn) in guests {
        println!("\n{name} guest:");
        outcome = outcome.and(report(run, started.elapsed()));
        if let Some(reborn) = reborn {
            println!("\n{name} guest, booted again after its power cut:");
            outcome = outcome.and(report(reborn, started.elapsed()));
        }
    }
    for d in dirs {
        let name = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let console = d.join("console.log");
        println!("logs ({name}): {}", console.display());
        if outcome.is_err() {
            // Into the log: CI removes its clone, and the console files with it.
            print_evidence(&name, &console);
        }
    }
    outcome
}

/// Kernel lines a failed topology is read by: the fabric (nvme, nvmet),
/// the network card, warnings and traces, lockups.
const EVIDENCE: [&str; 11] =
    ["nvme", "virtio_net", "eth0", "WARNING", "Call Trace", "watchdog", "timed out", "lockup", "BUG", "hung", "RIP:"];

/// `console`'s evidence lines (at most 80) and its last 20 lines.
fn print_evidence(name: &str, console: &Path) {
    // Bytes, not text: a guest killed mid-line may leave half a character.
    let Ok(bytes) = std::fs::read(console) else { return };
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.lines().collect();
    let evidence: Vec<&str> = lines.iter().copied().filter(|l| EVIDENCE.iter().any(|e| l.contains(e))).collect();
    println!("--- {name}: {} kernel lines of the fabric, network and warnings (the last 80) ---", evidence.len());
    for l in &evidence[evidence.len().saturating_sub(80)..] {
        println!("  {l}");
    }
    println!("--- {name}: its last 20 lines ---");
    for l in &lines[lines.len().saturating_sub(20)..] {
        println!("  {l}");
    }
}
