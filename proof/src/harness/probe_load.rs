//! The provenance probes under load: many submitters, deep queues, a CPU hog
//! beside them, every transfer judged as it is at queue depth 1 and checked
//! for requests lost or counted twice (`pdstor probe load`, the host's
//! `attribution` test, the guest's probes suite).
//!
//! It drives io_uring directly, one ring per submitter thread on one shared
//! `O_DIRECT` descriptor (the engine locks its target for itself), each ring
//! with one registered buffer: `host_fixed` writes, then reads of the same
//! region. The probes must belong to this process.
//!
//! What it does not do: check the bytes (the engine's tests do), or judge
//! any path but `host_fixed`.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use io_uring::{IoUring, opcode, squeue, types};
use pdstor_probes::{Declared, Probes, Signals, TargetClass, Verdict, judge};

use pdstor_engine::{buffer::Buffer, payload};

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// A block device, or a file (then judged as one).
    pub target: PathBuf,
    /// Where on the target the transfers start (bytes; a multiple of 4 KiB).
    pub offset: u64,
    /// Submitter threads, each with its own ring.
    pub threads: u64,
    /// Transfers each thread writes (and then reads back).
    pub per_thread: u64,
    /// io_uring requests each thread keeps in flight.
    pub depth: u32,
    /// Bytes per transfer (a multiple of 4 KiB).
    pub len: u32,
    /// A thread spinning on the CPU beside the submitters.
    pub hog: bool,
    /// Transfer ids start here (and the reference pass's at `first_id + 10_000_000`).
    pub first_id: u64,
}

/// What the probes made of the run.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadReport {
    /// Transfers run under load (writes and reads).
    pub transfers: u64,
    /// The verdict every transfer had at queue depth 1, one submitter.
    pub reference: String,
    /// Transfers whose verdict under load was not the reference one.
    pub other_verdict: u64,
    /// ... of those, unverifiable.
    pub unverifiable: u64,
    /// Transfers with a request issued and never seen completing (or completed twice).
    pub lost_completions: u64,
    /// Transfers charged other bytes than their own (a request of someone else's, or one missed).
    pub wrong_bytes: u64,
    /// ... of those, charged more than their own: someone else's request, never excusable.
    pub excess_bytes: u64,
    /// Requests issued by a task outside this process (a kworker running the queue).
    pub rq_off_process: u64,
    /// Dispatches of a request already issued (requeues), counted once.
    pub rq_reissued: u64,
    /// Requests that also carried bios not of the transfer.
    pub rq_shared: u64,
    /// Requests whose completion no program saw (the kernel skipped it), proven
    /// complete by their io_uring request's.
    pub rq_completed_unseen: u64,
    /// Runs of the probes the kernel skipped during the load (the same program
    /// already running on that CPU: see `Probes::skipped_runs`).
    pub probe_runs_skipped: u64,
    /// ... by program, for those that had any.
    pub skipped_by_program: Vec<(String, u64)>,
    /// Transfers no program recorded anything for (unverifiable).
    pub no_signals: u64,
    /// Up to ten transfers that went wrong, with their signals.
    pub examples: Vec<String>,
}

impl LoadReport {
    /// No transfer unverifiable, lost, misjudged or charged the wrong bytes.
    pub fn clean(&self) -> bool {
        self.other_verdict == 0 && self.lost_completions == 0 && self.wrong_bytes == 0
    }

    /// Every transfer that is not clean lacks evidence (unverifiable, fewer
    /// requests or bytes seen than it moved) rather than carrying wrong
    /// evidence (a fallback, someone else's bytes): what runs of the probes
    /// the kernel skipped can cause, and all they can cause.
    pub fn only_evidence_missing(&self) -> bool {
        self.other_verdict == self.unverifiable && self.excess_bytes == 0
    }
}

/// Runs the reference pass (depth 1, one submitter, eight transfers) and the
/// load, and judges every transfer from `probes` (attached to this process).
pub fn run(probes: &Probes, opts: &LoadOptions) -> Result<LoadReport, String> {
    let file = std::fs::metadata(&opts.target).map_err(|e| format!("{}: {e}", opts.target.display()))?;
    let class = if file.is_file() { TargetClass::File } else { TargetClass::BlockDevice };
    let a = probes.attached();
    let verdict = |s: &Signals| judge(Declared::HostFixed, class, s, &a);
    let signals = |t: u64| -> Result<Signals, String> {
        probes.signals(t).map_err(|e| e.to_string())?.ok_or_else(|| format!("no signals for transfer {t}"))
    };

    let reference_id = opts.first_id + 10_000_000;
    let one = LoadOptions { threads: 1, per_thread: 4, depth: 1, hog: false, first_id: reference_id, ..opts.clone() };
    submit(&one)?;
    let reference = verdict(&signals(reference_id)?);
    for t in reference_id..reference_id + 8 {
        let v = verdict(&signals(t)?);
        if v != reference {
            return Err(format!("at queue depth 1 transfers disagree: {reference} and {v} (transfer {t})"));
        }
    }

    let skipped_before: std::collections::HashMap<String, u64> = probes.skipped_runs_by_program().into_iter().collect();
    let stop = AtomicBool::new(false);
    let loaded = std::thread::scope(|scope| {
        if opts.hog {
            scope.spawn(|| {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
                }
            });
        }
        let r = submit(opts);
        stop.store(true, Ordering::Relaxed);
        r
    });
    loaded?;

    let mut report = LoadReport { reference: reference.to_string(), ..Default::default() };
    for (name, n) in probes.skipped_runs_by_program() {
        let during = n.saturating_sub(skipped_before.get(&name).copied().unwrap_or(0));
        if during > 0 {
            report.probe_runs_skipped += during;
            report.skipped_by_program.push((name, during));
        }
    }
    for t in opts.first_id..opts.first_id + 2 * opts.threads * opts.per_thread {
        report.transfers += 1;
        let Some(s) = probes.signals(t).map_err(|e| e.to_string())? else {
            // Not one program recorded it: evidence missing, nothing wrong.
            report.no_signals += 1;
            report.other_verdict += 1;
            report.unverifiable += 1;
            if report.examples.len() < 10 {
                report.examples.push(format!("transfer {t}: no signal recorded"));
            }
            continue;
        };
        let v = verdict(&s);
        report.rq_off_process += s.rq_off_process;
        report.rq_reissued += s.rq_reissued;
        report.rq_shared += s.rq_shared;
        let mut wrong = Vec::new();
        if v != reference {
            report.other_verdict += 1;
            report.unverifiable += u64::from(matches!(v, Verdict::Unverifiable(_)));
            wrong.push(format!("{v}"));
        }
        report.rq_completed_unseen += s.rq_completed_unseen;
        if (s.rq_issued == 0 && s.nvme_cmds == 0) || !s.requests_all_completed() {
            report.lost_completions += 1;
            wrong.push(format!(
                "{} of {} requests completed ({} of them unseen)",
                s.rq_completed + s.rq_completed_unseen,
                s.rq_issued,
                s.rq_completed_unseen
            ));
        }
        if s.rq_bytes != u64::from(opts.len) {
            report.wrong_bytes += 1;
            report.excess_bytes += u64::from(s.rq_bytes > u64::from(opts.len));
            wrong.push(format!("{} bytes charged of {}", s.rq_bytes, opts.len));
        }
        if !wrong.is_empty() && report.examples.len() < 10 {
            report.examples.push(format!("transfer {t}: {}; {s:?}", wrong.join(", ")));
        }
    }
    Ok(report)
}

/// Transfer `first_id + 2 i` writes region `i` (`offset + i len`), and
/// `first_id + 2 i + 1` reads it back; thread `t` runs `i` in
/// `t per_thread .. (t + 1) per_thread`, writes first, then reads.
fn submit(opts: &LoadOptions) -> Result<(), String> {
    let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..opts.threads).map(|t| scope.spawn(move || submitter(opts, t))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a submitter panicked".into()))).collect()
    });
    results.into_iter().collect()
}

fn submitter(opts: &LoadOptions, t: u64) -> Result<(), String> {
    let fd = open_direct(&opts.target)?;
    let slots = u64::from(opts.depth);
    let len = u64::from(opts.len);
    let buf = Buffer::host((slots * len) as usize).map_err(|e| e.to_string())?;
    buf.write_at(0, &payload::chunk(t, 0, (slots * len) as usize)).map_err(|e| e.to_string())?;
    let base = buf.as_mut_ptr().map_err(|e| e.to_string())?;
    // Declared after `buf`, so dropped before it on every path.
    let mut ring = IoUring::new(opts.depth.next_power_of_two()).map_err(|e| format!("io_uring_setup: {e}"))?;
    let iov = libc::iovec { iov_base: base.cast(), iov_len: (slots * len) as usize };
    // SAFETY: `buf` outlives `ring`, which unregisters it when dropped.
    unsafe { ring.submitter().register_buffers(&[iov]) }.map_err(|e| format!("registering the buffer: {e}"))?;
    for read in [false, true] {
        let (mut next, mut in_flight) = (0u64, 0u32);
        while next < opts.per_thread || in_flight > 0 {
            while next < opts.per_thread && in_flight < opts.depth {
                let i = t * opts.per_thread + next;
                let transfer = opts.first_id + 2 * i + u64::from(read);
                let at = base.wrapping_add(((next % slots) * len) as usize);
                let fd = types::Fd(fd.as_raw_fd());
                let target = opts.offset + i * len;
                let sqe: squeue::Entry = if read {
                    opcode::ReadFixed::new(fd, at, opts.len, 0).offset(target).build()
                } else {
                    opcode::WriteFixed::new(fd, at, opts.len, 0).offset(target).build()
                };
                let sqe = sqe.user_data(transfer << pdstor_probes::SEGMENT_BITS);
                // SAFETY: the SQE names the registered buffer, which outlives the
                // ring and so every request on it.
                unsafe { ring.submission().push(&sqe) }.map_err(|_| "the submission queue is full".to_string())?;
                next += 1;
                in_flight += 1;
            }
            ring.submit_and_wait(1).map_err(|e| format!("io_uring_enter: {e}"))?;
            for cqe in ring.completion() {
                in_flight -= 1;
                let res = cqe.result();
                if res != opts.len as i32 {
                    let what = if res < 0 {
                        std::io::Error::from_raw_os_error(-res).to_string()
                    } else {
                        format!("{res} of {} bytes moved", opts.len)
                    };
                    let transfer = cqe.user_data() >> pdstor_probes::SEGMENT_BITS;
                    return Err(format!("transfer {transfer} on {}: {what}", opts.target.display()));
                }
            }
        }
    }
    Ok(())
}

/// `path` opened for reading and writing with `O_DIRECT`.
pub fn open_direct(path: &Path) -> Result<File, String> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("opening {} with O_DIRECT: {e}", path.display()))
}
