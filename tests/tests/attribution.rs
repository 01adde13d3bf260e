//! Block requests belong to the transfer whose bios they carry, whoever
//! issues or completes them (`ebpf/src/bpf/provenance.bpf.c`, its header):
//! on this host's kernel, on loop devices, with io_uring driven directly so
//! each test controls who submits what and when. Needs root (BPF, loop
//! devices, mount); says SKIP otherwise. The scenarios that need scsi_debug
//! (a queue of depth 1, injected requeues) run in the vmtest guest.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use io_uring::{IoUring, opcode, squeue, types};
use pdstor_engine::{buffer::Buffer, payload};
use pdstor_probes::{Declared, Probes, Signals, SkipRuns, TargetClass, Verdict, judge};
use pdstor_testkit::{LoopDevice, is_root, skip};

/// One test at a time: the probes trace the whole process, and the stress
/// test's load would reach into the others.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SEGMENT_BITS: u32 = pdstor_probes::SEGMENT_BITS;

/// The probes for this process, or None (with the SKIP said) when not root.
fn setup(test: &str) -> Option<(std::sync::MutexGuard<'static, ()>, Probes)> {
    setup_skipping(test, SkipRuns::default())
}

/// [`setup`], with the programs skipping the runs `skip` names.
fn setup_skipping(test: &str, runs: SkipRuns) -> Option<(std::sync::MutexGuard<'static, ()>, Probes)> {
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !is_root() {
        skip(test, "BPF, loop devices and mounts need root");
        return None;
    }
    let probes = Probes::attach_skipping(std::process::id(), runs).unwrap_or_else(|e| panic!("attaching as root: {e}"));
    let a = probes.attached();
    assert!(
        a.block && a.block_identity,
        "the block programs attach and kallsyms names the bio owners: {:#?}",
        probes.status()
    );
    Some((serial, probes))
}

fn open_direct(path: &Path) -> File {
    pdstor_proof::harness::probe_load::open_direct(path).unwrap()
}

/// An io_uring with one registered buffer of `len` bytes (payload-filled).
struct Ring {
    ring: IoUring,
    buf: Buffer,
}

impl Ring {
    fn new(entries: u32, len: usize, seed: u64) -> Ring {
        let ring = IoUring::new(entries).expect("io_uring_setup");
        let buf = Buffer::host(len).expect("a host buffer");
        buf.write_at(0, &payload::chunk(seed, 0, len)).expect("filling the buffer");
        let iov = libc::iovec { iov_base: buf.as_mut_ptr().expect("mapped").cast(), iov_len: len };
        // SAFETY: `buf` lives as long as the ring that registers it (both in `Ring`,
        // the ring dropped first: declared first).
        unsafe { ring.submitter().register_buffers(&[iov]) }.expect("registering the buffer");
        Ring { ring, buf }
    }

    /// A WRITE_FIXED (or READ_FIXED) of `len` bytes at `buffer_offset` of the
    /// registered buffer, to `target_offset` of `fd`, for `transfer`.
    fn fixed(
        &self,
        fd: &File,
        read: bool,
        transfer: u64,
        buffer_offset: usize,
        target_offset: u64,
        len: u32,
    ) -> squeue::Entry {
        let at = self.buf.as_mut_ptr().expect("mapped").wrapping_add(buffer_offset);
        let fd = types::Fd(fd.as_raw_fd());
        let sqe = if read {
            opcode::ReadFixed::new(fd, at, len, 0).offset(target_offset).build()
        } else {
            opcode::WriteFixed::new(fd, at, len, 0).offset(target_offset).build()
        };
        sqe.user_data(transfer << SEGMENT_BITS)
    }

    fn push(&mut self, sqe: &squeue::Entry) {
        // SAFETY: the SQE names the registered buffer, which outlives the ring.
        unsafe { self.ring.submission().push(sqe) }.expect("the submission queue has room");
    }

    /// Waits for `n` completions; each must have moved its whole length.
    fn reap(&mut self, n: usize, len: i32) {
        let mut seen = 0;
        while seen < n {
            self.ring.submit_and_wait(1).expect("io_uring_enter");
            for cqe in self.ring.completion() {
                assert_eq!(cqe.result(), len, "transfer {}", cqe.user_data() >> SEGMENT_BITS);
                seen += 1;
            }
        }
    }
}

/// The signals of `transfer`, which must have been seen.
fn signals(probes: &Probes, transfer: u64) -> Signals {
    probes
        .signals(transfer)
        .expect("reading the probes")
        .unwrap_or_else(|| panic!("no signals for transfer {transfer}"))
}

/// Every request charged to the transfer completed, once, without error, and
/// carried exactly its `len` bytes: nothing lost, nothing double-counted,
/// nothing of anybody else's.
fn exactly_its_own(transfer: u64, s: &Signals, len: u64) -> Result<(), String> {
    if s.rq_issued == 0 || !s.requests_all_completed() || s.rq_errors != 0 || s.rq_bytes != len {
        return Err(format!("transfer {transfer} ({len} bytes): {s:?}"));
    }
    Ok(())
}

/// IOSQE_ASYNC sends each write to an io-wq worker, a thread that is not the
/// one that submitted it and that no probe tells which transfer it works on
/// (the io-wq kprobe does not attach on this host): each of eight writes,
/// submitted in one batch, must still be charged its own bytes — not the
/// batch's last transfer all of them.
#[test]
fn direct_io_an_io_wq_worker_issues_is_charged_to_its_own_transfer() {
    let Some((_serial, probes)) = setup("direct_io_an_io_wq_worker_issues_is_charged_to_its_own_transfer") else {
        return;
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let lo = LoopDevice::attach(&dir.path().join("disk.img"), 64 << 20)
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    let dev = open_direct(&lo.path);
    const N: u64 = 8;
    const LEN: u32 = 256 << 10;
    let mut ring = Ring::new(16, (N * LEN as u64) as usize, 7);
    for i in 0..N {
        let at = (i * LEN as u64) as usize;
        let sqe = ring.fixed(&dev, false, 700 + i, at, i * LEN as u64, LEN).flags(squeue::Flags::ASYNC);
        ring.push(&sqe);
    }
    ring.reap(N as usize, LEN as i32);
    let a = probes.attached();
    let wrong: Vec<String> = (0..N)
        .filter_map(|i| {
            let s = signals(&probes, 700 + i);
            let v = judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &a);
            exactly_its_own(700 + i, &s, LEN as u64)
                .and_then(|()| if v == Verdict::Native { Ok(()) } else { Err(format!("transfer {}: {v}", 700 + i)) })
                .err()
        })
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// A bio that no transfer made — ext4 reading inode tables for `stat`, a
/// synchronous O_DIRECT read of another file — issued by the very thread
/// whose transfer is in flight, on the same device, is never charged to that
/// transfer.
#[test]
fn io_no_transfer_made_is_never_charged_to_one() {
    const TEST: &str = "io_no_transfer_made_is_never_charged_to_one";
    let Some((_serial, probes)) = setup(TEST) else { return };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let lo = LoopDevice::attach(&dir.path().join("disk.img"), 256 << 20)
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    let mkfs = Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&lo.path).output().expect("running mkfs.ext4");
    assert!(mkfs.status.success(), "mkfs.ext4: {}", String::from_utf8_lossy(&mkfs.stderr));
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    struct Mounted<'a>(&'a Path);
    impl Drop for Mounted<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let mount = |what: &str| {
        let out = Command::new("mount").arg(&lo.path).arg(&mnt).output().expect("running mount");
        assert!(out.status.success(), "mount ({what}): {}", String::from_utf8_lossy(&out.stderr));
        Mounted(&mnt)
    };
    const FILES: usize = 512;
    const LEN: u32 = 16 << 20;
    {
        let _m = mount("to fill it");
        for i in 0..FILES {
            std::fs::write(mnt.join(format!("meta-{i}")), [i as u8]).unwrap();
        }
        let kv = File::create(mnt.join("kv")).unwrap();
        kv.set_len(LEN as u64).unwrap();
        kv.sync_all().unwrap();
        std::fs::write(mnt.join("other"), payload::chunk(9, 0, 1 << 20)).unwrap();
    }
    // Mounted again: no inode of the files above is cached, so stat reads them.
    let _m = mount("cold");
    let stat =
        std::fs::read_to_string(Path::new("/sys/block").join(lo.path.file_name().unwrap()).join("stat")).unwrap();
    let reads_before: u64 = stat.split_whitespace().next().and_then(|r| r.parse().ok()).unwrap_or(0);
    // As the daemon does: page-cache insertions count only for the payload's file.
    assert!(probes.watch_file(&mnt.join("kv")).unwrap());
    let kv = open_direct(&mnt.join("kv"));
    let other = open_direct(&mnt.join("other"));
    let mut ring = Ring::new(4, LEN as usize, 8);
    let sqe = ring.fixed(&kv, false, 800, 0, 0, LEN);
    ring.push(&sqe);
    ring.ring.submit().expect("io_uring_enter");
    // While transfer 800 is in flight, this thread makes other I/O on its device.
    for i in 0..FILES {
        std::fs::metadata(mnt.join(format!("meta-{i}"))).unwrap();
    }
    let mut one = vec![0u8; 2 << 20];
    let at = one.as_mut_ptr().align_offset(4096);
    // SAFETY: the 1 MiB at `at` lies inside `one`, which outlives the call.
    let n = unsafe { libc::pread(other.as_raw_fd(), one.as_mut_ptr().add(at).cast(), 1 << 20, 0) };
    assert_eq!(n, 1 << 20, "{}", std::io::Error::last_os_error());
    ring.reap(1, LEN as i32);
    let stat =
        std::fs::read_to_string(Path::new("/sys/block").join(lo.path.file_name().unwrap()).join("stat")).unwrap();
    let reads_after: u64 = stat.split_whitespace().next().and_then(|r| r.parse().ok()).unwrap_or(0);
    assert!(
        reads_after > reads_before + 1,
        "the device read metadata and the other file ({reads_before} -> {reads_after} reads)"
    );
    let s = signals(&probes, 800);
    exactly_its_own(800, &s, LEN as u64).unwrap();
    assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &probes.attached()), Verdict::Native, "{s:?}");
}

/// A write four times the device's request limit is split into requests of
/// that size: each part is charged and completed once, and the parts add up
/// to the write.
#[test]
fn a_bio_split_at_the_device_limit_is_charged_part_by_part() {
    let Some((_serial, probes)) = setup("a_bio_split_at_the_device_limit_is_charged_part_by_part") else { return };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let lo = LoopDevice::attach(&dir.path().join("disk.img"), 64 << 20)
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    lo.set_queue("max_sectors_kb", "64").unwrap_or_else(|e| panic!("{e}"));
    let dev = open_direct(&lo.path);
    const LEN: u32 = 4 << 20;
    let mut ring = Ring::new(4, LEN as usize, 10);
    let sqe = ring.fixed(&dev, false, 900, 0, 0, LEN);
    ring.push(&sqe);
    ring.reap(1, LEN as i32);
    let s = signals(&probes, 900);
    exactly_its_own(900, &s, LEN as u64).unwrap();
    assert!(s.rq_issued >= (LEN as u64) / (64 << 10) && s.bios >= 2, "split into 64 KiB requests: {s:?}");
    assert_eq!(judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &probes.attached()), Verdict::Native);
}

/// A 7.x kernel skips runs of the programs under load (see the header of
/// provenance.bpf.c); each verdict must stand on its second witness. With
/// io_uring_submit_req and block_bio_queue never run, a write split at
/// 64 KiB is still adopted from its io_kiocb and its bios (split ones
/// through bio_chain_endio) identified where their requests are walked:
/// exactly its own bytes, native. With block_rq_issue never run, each request
/// is seen completing. With block_rq_complete never run either (and no NVMe
/// command to see on a loop device) the transfer is unverifiable — missing
/// evidence, never a fallback.
#[test]
fn verdicts_stand_on_their_second_witness_when_runs_are_skipped() {
    const TEST: &str = "verdicts_stand_on_their_second_witness_when_runs_are_skipped";
    const LEN: u32 = 1 << 20;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // One 1 MiB WRITE_FIXED of `transfer` to a fresh loop device whose
    // requests are at most `max_kb`, with the programs skipping `runs`.
    let write = |runs: SkipRuns, transfer: u64, max_kb: &str| -> Option<(Signals, Verdict)> {
        let (_serial, probes) = setup_skipping(TEST, runs)?;
        let lo = LoopDevice::attach(&dir.path().join(format!("{transfer}.img")), 16 << 20)
            .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
        lo.set_queue("max_sectors_kb", max_kb).unwrap_or_else(|e| panic!("{e}"));
        let dev = open_direct(&lo.path);
        let mut ring = Ring::new(4, LEN as usize, transfer);
        let sqe = ring.fixed(&dev, false, transfer, 0, 0, LEN);
        ring.push(&sqe);
        ring.reap(1, LEN as i32);
        let s = signals(&probes, transfer);
        Some((s, judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &probes.attached())))
    };
    let unseen_submit = SkipRuns { submit: true, bio_queue: true, ..Default::default() };
    let Some((s, v)) = write(unseen_submit, 950, "64") else { return };
    assert_eq!((s.submits, s.fixed_ops, s.bios), (1, 1, 0), "adopted, with no bio seen queued: {s:?}");
    exactly_its_own(950, &s, LEN as u64).unwrap();
    assert_eq!(v, Verdict::Native);
    // Issue unseen: each request is seen completing (the third witness).
    let Some((s, v)) = write(SkipRuns { rq_issue: true, ..Default::default() }, 951, "64") else { return };
    assert_eq!((s.rq_issue_unseen, s.rq_issued), (16, 16), "{s:?}");
    exactly_its_own(951, &s, LEN as u64).unwrap();
    assert_eq!(v, Verdict::Native);
    // Issue and completion unseen, and no NVMe command on a loop device:
    // missing evidence, never a fallback.
    let unseen = SkipRuns { rq_issue: true, rq_complete: true, ..Default::default() };
    let Some((s, v)) = write(unseen, 952, "1024") else { return };
    assert_eq!((s.submits, s.rq_issued, s.nvme_cmds), (1, 0, 0), "{s:?}");
    assert_eq!(v, Verdict::Unverifiable("no block request carried this transfer's bios".into()));
}

/// 8 submitters at queue depth 64 on one loop device (its queue holds 128,
/// so submitters wait for tags and their plugs are flushed as they sleep:
/// blk-mq then dispatches from kblockd, and the scheduler from whichever task
/// runs the queue), a CPU hog beside them: 1,000 writes and 1,000 reads, each
/// judged as it is at queue depth 1, each with every request it issued
/// completed once and exactly its own bytes (`pdstor_proof::harness::probe_load`).
#[test]
fn under_load_every_transfer_keeps_its_requests_and_its_verdict() {
    const TEST: &str = "under_load_every_transfer_keeps_its_requests_and_its_verdict";
    let Some((_serial, probes)) = setup(TEST) else { return };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let opts = pdstor_proof::harness::probe_load::LoadOptions {
        target: std::path::PathBuf::new(),
        offset: 0,
        threads: 8,
        per_thread: 125,
        depth: 64,
        len: 512 << 10,
        hog: true,
        first_id: 200_000,
    };
    let lo = LoopDevice::attach(&dir.path().join("disk.img"), opts.threads * opts.per_thread * u64::from(opts.len))
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    // Eight requests a transfer, 64 transfers in flight a thread, 128 tags.
    lo.set_queue("max_sectors_kb", "64").unwrap_or_else(|e| panic!("{e}"));
    lo.set_queue("scheduler", "mq-deadline").unwrap_or_else(|e| panic!("{e}"));
    let opts = pdstor_proof::harness::probe_load::LoadOptions { target: lo.path.clone(), ..opts };
    let report = pdstor_proof::harness::probe_load::run(&probes, &opts).unwrap();
    eprintln!("{TEST}: {report:?}");
    assert_eq!(report.transfers, 2000);
    assert_eq!(report.reference, "native", "at queue depth 1: {report:?}");
    assert!(report.clean(), "{report:#?}");
}
