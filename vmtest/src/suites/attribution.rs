//! Block requests belong to the transfer whose bios they carry, whoever
//! issues or completes them (`ebpf/src/bpf/provenance.bpf.c`): the scenarios
//! that need a device the host lacks. A scsi_debug disk (Debian's kernel
//! loads the module at boot: one 8 MiB disk) at queue depth 1 makes blk-mq
//! dispatch from a kworker; its host-busy injection makes the SCSI midlayer
//! requeue; the NVMe namespace takes the load test with requests split at a
//! small limit. Part of the `probes` suite.

use std::path::{Path, PathBuf};

use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};
use pdstor_probes::{Declared, Probes, Signals, TargetClass, Verdict, judge};

use super::{Checked, skip};
use crate::machine::Ctx;
use pdstor_vmtest_spec::DiskRole;

/// The scsi_debug disk the module made at boot, as `sdX`.
fn scsi_debug_disk() -> Checked<String> {
    let found = std::fs::read_dir("/sys/block").ok().and_then(|dir| {
        dir.flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let model = std::fs::read_to_string(e.path().join("device/model")).unwrap_or_default();
            (name.starts_with("sd") && model.trim() == "scsi_debug").then_some(name)
        })
    });
    match found {
        Some(disk) => Ok(disk),
        None if crate::machine::expects_rw_dmabuf() => {
            Err(skip("the series kernel is built without scsi_debug (Debian's kernel runs this)"))
        }
        None => Err("no scsi_debug disk: the module was loaded at boot and should have made one".into()),
    }
}

fn write(path: &Path, value: &str) -> Checked {
    Ok(std::fs::write(path, value).map_err(|e| format!("writing {value} to {}: {e}", path.display()))?)
}

/// Sets a sysfs value and puts the old one back when dropped.
struct Setting {
    path: PathBuf,
    old: String,
}

impl Setting {
    fn set(path: impl Into<PathBuf>, value: &str) -> Checked<Setting> {
        let path = path.into();
        let old = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // A scheduler file lists all with the current one in brackets.
        let old = old.split_whitespace().find(|w| w.starts_with('[')).unwrap_or(old.trim()).trim_matches(['[', ']']);
        let setting = Setting { path, old: old.to_owned() };
        write(&setting.path, value)?;
        Ok(setting)
    }
}

impl Drop for Setting {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.path, &self.old);
    }
}

/// `count` host_fixed writes of `len` bytes in one batch through the engine
/// on `device`, transfer ids from `first`; their signals.
fn fixed_writes(probes: &Probes, device: &Path, first: u64, count: u64, len: u64) -> Checked<Vec<Signals>> {
    let target = Target::open(device, &TargetOptions::default()).map_err(|e| e.to_string())?;
    let mut engine = Engine::new(target, EngineOptions::default()).map_err(|e| e.to_string())?;
    let id =
        engine.register(Buffer::host((count * len) as usize).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let requests: Vec<IoRequest> = (0..count)
        .map(|i| IoRequest {
            transfer: TransferId(first + i),
            op: Op::Write,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: pdstor_engine::io::BufferOffset(i * len),
            target_offset: pdstor_engine::io::TargetOffset(i * len),
            len,
        })
        .collect();
    engine.execute_all(&requests).map_err(|e| e.to_string())?;
    (first..first + count)
        .map(|t| Ok(probes.signals(t).map_err(|e| e.to_string())?.ok_or(format!("no signals for transfer {t}"))?))
        .collect()
}

/// Each transfer native on a block device, its requests all completed, its
/// bytes exactly `len`; else the list of those that are not.
fn exactly_native(probes: &Probes, first: u64, all: &[Signals], len: u64) -> Checked {
    let a = probes.attached();
    let wrong: Vec<String> = all
        .iter()
        .zip(first..)
        .filter_map(|(s, t)| {
            let v = judge(Declared::HostFixed, TargetClass::BlockDevice, s, &a);
            let exact = s.rq_issued > 0 && s.requests_all_completed() && s.rq_errors == 0 && s.rq_bytes == len;
            (v != Verdict::Native || !exact).then(|| format!("transfer {t}: {v}, {s:?}"))
        })
        .collect();
    if wrong.is_empty() { Ok(()) } else { Err(format!("{wrong:#?}").into()) }
}

/// Eight 64 KiB host_fixed writes in one batch on the scsi_debug disk,
/// with `settings` (paths relative to the disk's /sys/block directory, or
/// absolute) in force: `happened` must count the scenario in some transfer's
/// signals (else the test tested nothing, and says `nothing`), and every
/// transfer must be native with exactly its own requests.
fn scsi_debug_batch(settings: &[(&str, &str)], first: u64, happened: fn(&Signals) -> u64, nothing: &str) -> Checked {
    let disk = scsi_debug_disk()?;
    let sys = Path::new("/sys/block").join(&disk);
    let _kept: Vec<Setting> =
        settings.iter().map(|(path, value)| Setting::set(sys.join(path), value)).collect::<Result<_, _>>()?;
    let probes = super::attach_probes()?;
    const LEN: u64 = 64 << 10;
    let all = fixed_writes(&probes, &Path::new("/dev").join(&disk), first, 8, LEN)?;
    if all.iter().map(happened).sum::<u64>() == 0 {
        return Err(format!("{nothing}, so this tested nothing: {all:#?}").into());
    }
    exactly_native(&probes, first, &all, LEN)
}

/// Queue depth 1 and scsi_debug's delayed completions: every request of a
/// batch but the first waits for the one before, and blk-mq dispatches it
/// from a kworker when that one completes. Each transfer must still be
/// native with its own requests (on the programs that charged a request to
/// the issuing thread, 7 of 8 were unverifiable).
pub fn kworker_dispatch(_: &Ctx) -> Checked {
    scsi_debug_batch(
        &[("device/queue_depth", "1")],
        530,
        |s| s.rq_off_process,
        "no request was issued outside the process",
    )
}

/// scsi_debug answers every third command "host busy"
/// (`SDEBUG_OPT_HOST_BUSY`): the SCSI midlayer hands the request back,
/// blk-mq requeues it and dispatches the same request again. It is one
/// request: issued once, completed once, its bytes once.
pub fn requeue(_: &Ctx) -> Checked {
    scsi_debug_batch(
        &[("/sys/bus/pseudo/drivers/scsi_debug/every_nth", "3"), ("/sys/bus/pseudo/drivers/scsi_debug/opts", "0x8000")],
        540,
        |s| s.rq_reissued,
        "no request was dispatched again",
    )
}

/// The load test on the NVMe namespace (`pdstor_proof::harness::probe_load`):
/// 8 submitters at queue depth 64, a CPU hog, 1,000 writes and 1,000 reads
/// of 128 KiB, each split into four requests at a 32 KiB limit; every
/// transfer judged as at depth 1, nothing lost, nothing double-counted.
pub fn under_load(ctx: &Ctx) -> Checked {
    let dev = ctx.disk(DiskRole::Raw)?.block.clone();
    let name = dev.file_name().ok_or("a /dev path")?.to_string_lossy().into_owned();
    let _limit = Setting::set(Path::new("/sys/block").join(name).join("queue/max_sectors_kb"), "32")?;
    let probes = super::attach_probes()?;
    let opts = pdstor_proof::harness::probe_load::LoadOptions {
        target: dev,
        // Past what the other probes tests write (64 and 96 MiB).
        offset: 256 << 20,
        threads: 8,
        per_thread: 125,
        depth: 64,
        len: 128 << 10,
        hog: true,
        first_id: 600_000,
    };
    let report = pdstor_proof::harness::probe_load::run(&probes, &opts)?;
    println!("probe load on the NVMe namespace: {report:?}");
    if report.reference == "native" && report.clean() {
        return Ok(());
    }
    // The kernel did not run the probes for some events (see "Runs the
    // kernel skips" in the header of provenance.bpf.c): the byte and
    // completion counts of a transfer may then fall short, but every
    // verdict must still be the reference one (each rests on more than
    // one program) and no transfer may carry someone else's bytes.
    let skipped = report.probe_runs_skipped > 0;
    if report.reference == "native" && skipped && report.other_verdict == 0 && report.excess_bytes == 0 {
        println!(
            "every verdict held while the kernel skipped {} runs of the probes ({:?}); {} transfers were seen \
             with fewer bytes than they moved",
            report.probe_runs_skipped, report.skipped_by_program, report.wrong_bytes
        );
        return Ok(());
    }
    if report.reference == "native" && skipped && report.only_evidence_missing() {
        return Err(skip(format!(
            "the kernel skipped {} runs of the probes under this load ({:?}), and {} of {} transfers lack the \
             evidence for a verdict (none carries wrong evidence)",
            report.probe_runs_skipped, report.skipped_by_program, report.unverifiable, report.transfers
        )));
    }
    Err(format!("{report:#?}").into())
}
