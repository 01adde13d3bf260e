//! `probes`: the provenance probes on the guest kernel, where every program
//! (tracepoints, tp_btf and kprobes) can attach. Positive controls: `host_fixed`
//! on ext4, XFS, the raw block device and NVMe passthrough is `native`.
//! Negative controls: a non-fixed passthrough is `fallback(not-fixed)`, a
//! buffered write is `fallback(page-cache)`. `bpftool` reads the pinned
//! signals map by field name. Also: BTF is present, and a hand-assembled BPF
//! program on `block:block_rq_issue` counts requests and is pinned.
//!
//! The raw `bpf(2)` and `perf_event_open(2)` ABI lives in [`sys`] below.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use super::{Checked, Suite, Test, attach_probes, attribution};
use crate::machine::Ctx;
use pdstor_vmtest_spec::DiskRole;

pub const SUITE: Suite = Suite {
    name: "probes",
    tests: &[
        Test { name: "btf_present", disk: None, run: btf_present },
        Test { name: "every_program_attaches", disk: None, run: every_program_attaches },
        Test {
            name: "host_fixed_is_native_on_ext4",
            disk: Some(DiskRole::Ext4),
            run: |c| native_on_fs(c, DiskRole::Ext4),
        },
        Test {
            name: "host_fixed_is_native_on_xfs",
            disk: Some(DiskRole::Xfs),
            run: |c| native_on_fs(c, DiskRole::Xfs),
        },
        Test { name: "host_fixed_is_native_on_raw_block", disk: Some(DiskRole::Raw), run: native_on_raw_block },
        Test { name: "passthrough_fixed_native_plain_not", disk: Some(DiskRole::Raw), run: passthrough_verdicts },
        Test { name: "buffered_write_is_page_cache_fallback", disk: Some(DiskRole::Xfs), run: page_cache_control },
        Test { name: "bpftool_reads_the_pinned_signals", disk: Some(DiskRole::Xfs), run: bpftool_dump },
        Test { name: "tracepoint_program_counts_requests", disk: Some(DiskRole::Raw), run: tracepoint_counts },
        Test {
            name: "requests_a_kworker_dispatches_keep_their_transfer",
            disk: None,
            run: attribution::kworker_dispatch,
        },
        Test { name: "a_requeued_request_counts_once", disk: None, run: attribution::requeue },
        Test { name: "verdicts_stand_on_their_second_witness", disk: Some(DiskRole::Raw), run: second_witness },
        Test {
            name: "under_load_every_transfer_keeps_its_verdict",
            disk: Some(DiskRole::Raw),
            run: attribution::under_load,
        },
    ],
};

/// Programs on functions only the rw-dmabuf series adds (named by their
/// kprobe fallback, as a program that attaches nowhere is).
const SERIES_ONLY: [&str; 3] =
    ["kprobe:bio_dmabuf_map_set", "kprobe:nvme_dmabuf_token_map", "kretprobe:nvme_dmabuf_token_map"];

/// The guest kernels can run every program in the kind the kernel does not
/// skip for another process's bpf() syscall: tp_btf for the tracepoints,
/// fentry and fexit for the function hooks (see "Runs the kernel skips" in
/// the header of provenance.bpf.c). A fallback there is a regression.
fn skip_proof_kinds(status: &[pdstor_probes::ProgramStatus]) -> Checked {
    let weak: Vec<String> = status
        .iter()
        .filter(|s| s.attached)
        .filter(|s| {
            let tracepoint = s.name.starts_with("io_uring:") || s.name.starts_with("filemap:");
            (tracepoint && !s.name.ends_with("(tp_btf)"))
                || s.name.starts_with("kprobe:")
                || s.name.starts_with("kretprobe:")
        })
        .map(|s| format!("{}: {}", s.name, s.detail))
        .collect();
    if weak.is_empty() { Ok(()) } else { Err(format!("programs attached in a kind the kernel skips: {weak:?}").into()) }
}

fn every_program_attaches(_: &Ctx) -> Checked {
    let p = attach_probes()?;
    let missing: Vec<String> = p
        .status()
        .iter()
        .filter(|s| !s.attached && !s.detail.starts_with("not built yet"))
        // The DMA-token functions exist only on a kernel with the rw-dmabuf series.
        .filter(|s| !SERIES_ONLY.contains(&s.name) || crate::machine::expects_rw_dmabuf())
        .map(|s| format!("{}: {}", s.name, s.detail))
        .collect();
    if !missing.is_empty() {
        // For a post-mortem: what the kernel calls the series' functions.
        let syms: Vec<String> = std::fs::read_to_string("/proc/kallsyms")
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("dmabuf_token_map") || l.contains("dmabuf_create_map"))
            .map(str::to_owned)
            .collect();
        return Err(format!("programs that did not attach in the guest: {missing:?} (kallsyms: {syms:?})").into());
    }
    skip_proof_kinds(p.status())
}

/// One `host_fixed` write of 1 MiB + 64 KiB through the engine, judged.
pub(crate) fn fixed_write_verdict(
    target: &Path,
    create: Option<u64>,
    class: pdstor_probes::TargetClass,
    path: PayloadPath,
    transfer: u64,
) -> Checked<(pdstor_probes::Verdict, pdstor_probes::Signals)> {
    write_verdict_skipping(target, create, class, path, transfer, pdstor_probes::SkipRuns::default())
}

/// [`fixed_write_verdict`], with the programs skipping the runs `skip` names.
fn write_verdict_skipping(
    target: &Path,
    create: Option<u64>,
    class: pdstor_probes::TargetClass,
    path: PayloadPath,
    transfer: u64,
    skip: pdstor_probes::SkipRuns,
) -> Checked<(pdstor_probes::Verdict, pdstor_probes::Signals)> {
    let probes = pdstor_probes::Probes::attach_skipping(std::process::id(), skip).map_err(|e| e.to_string())?;
    let t =
        Target::open(target, &TargetOptions { create_len: create, ..Default::default() }).map_err(|e| e.to_string())?;
    let mut engine = Engine::new(t, EngineOptions::default()).map_err(|e| e.to_string())?;
    let len = (1 << 20) + (64 << 10);
    let b = Buffer::host(len as usize).map_err(|e| e.to_string())?;
    let id = match path {
        PayloadPath::HostFixed => engine.register(b),
        _ => engine.add(b),
    }
    .map_err(|e| e.to_string())?;
    let req = IoRequest {
        transfer: TransferId(transfer),
        op: Op::Write,
        path,
        buffer: id,
        buffer_offset: pdstor_engine::io::BufferOffset(0),
        target_offset: pdstor_engine::io::TargetOffset(64 << 20),
        len,
    };
    engine.execute_all(&[req]).map_err(|e| e.to_string())?;
    let s = probes.signals(transfer).map_err(|e| e.to_string())?.ok_or("no signals were recorded for the transfer")?;
    Ok((pdstor_probes::judge(pdstor_probes::Declared::HostFixed, class, &s, &probes.attached()), s))
}

pub(crate) fn expect(v: (pdstor_probes::Verdict, pdstor_probes::Signals), want: pdstor_probes::Verdict) -> Checked {
    if v.0 != want {
        return Err(format!("verdict {} where {want} was expected; signals {:?}", v.0, v.1).into());
    }
    Ok(())
}

fn native_on_fs(ctx: &Ctx, role: DiskRole) -> Checked {
    let mount = ctx.disk(role)?.mount.clone().ok_or("not mounted")?;
    let v = fixed_write_verdict(
        &mount.join("probe.img"),
        Some(128 << 20),
        pdstor_probes::TargetClass::File,
        PayloadPath::HostFixed,
        501,
    )?;
    expect(v, pdstor_probes::Verdict::Native)
}

fn native_on_raw_block(ctx: &Ctx) -> Checked {
    let dev = ctx.disk(DiskRole::Raw)?.block.clone();
    let v = fixed_write_verdict(&dev, None, pdstor_probes::TargetClass::BlockDevice, PayloadPath::HostFixed, 502)?;
    if v.1.rq_issued == 0 || !v.1.requests_all_completed() || v.1.rq_errors != 0 {
        return Err(format!("block requests issued and completed disagree: {:?}", v.1).into());
    }
    expect(v, pdstor_probes::Verdict::Native)
}

/// A 7.x kernel skips runs of the programs under load (see the header of
/// provenance.bpf.c): with the first witness of each piece of evidence
/// never run, the verdicts stand on the second. A write through the block
/// device whose submission, bio queueing and request issue no program saw
/// is adopted from its io_kiocb and seen at nvme_setup_cmd; a fixed
/// passthrough whose buffer import no program saw is known by its command's
/// IORING_URING_CMD_FIXED. Control: a passthrough on a plain buffer, the
/// import hook skipped, is still `not-fixed`.
fn second_witness(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let skip = |submit, bio_queue, rq_issue, hooks| pdstor_probes::SkipRuns {
        submit,
        bio_queue,
        rq_issue,
        hooks,
        // With completions seen, a request whose issue was skipped is seen
        // completing: the NVMe command is the witness tested here.
        rq_complete: rq_issue,
    };
    let block = pdstor_probes::TargetClass::BlockDevice;
    let (v, s) =
        write_verdict_skipping(&disk.block, None, block, PayloadPath::HostFixed, 521, skip(true, true, true, false))?;
    if s.rq_issued != 0 || s.nvme_cmds == 0 || s.fixed_ops != 1 {
        return Err(format!("expected no issue seen, its NVMe commands seen, the fixed op adopted: {s:?}").into());
    }
    expect((v, s), pdstor_probes::Verdict::Native)?;
    let pt = pdstor_probes::TargetClass::NvmePassthrough;
    let (v, s) =
        write_verdict_skipping(&disk.generic, None, pt, PayloadPath::HostFixed, 522, skip(true, false, false, true))?;
    if s.cmd_fixed_imports != 0 || s.cmd_fixed_rqs == 0 {
        return Err(format!("expected no import seen, the fixed command seen on its requests: {s:?}").into());
    }
    expect((v, s), pdstor_probes::Verdict::Native)?;
    expect(
        write_verdict_skipping(&disk.generic, None, pt, PayloadPath::Host, 523, skip(false, false, false, true))?,
        pdstor_probes::Verdict::Fallback("not-fixed".into()),
    )
}

fn passthrough_verdicts(ctx: &Ctx) -> Checked {
    let ng = ctx.disk(DiskRole::Raw)?.generic.clone();
    let class = pdstor_probes::TargetClass::NvmePassthrough;
    let fixed = fixed_write_verdict(&ng, None, class, PayloadPath::HostFixed, 503)?;
    // The device saw exactly the request: 1 MiB + 64 KiB in 4 KiB blocks,
    // as three commands (MDTS 512 KiB).
    if fixed.1.nvme_blocks * 4096 != (1 << 20) + (64 << 10) || fixed.1.nvme_cmds != 3 {
        return Err(format!(
            "nvme_setup_cmd saw {} commands of {} blocks in all: {:?}",
            fixed.1.nvme_cmds, fixed.1.nvme_blocks, fixed.1
        )
        .into());
    }
    expect(fixed, pdstor_probes::Verdict::Native)?;
    // Negative control: the same passthrough without a registered buffer.
    expect(
        fixed_write_verdict(&ng, None, class, PayloadPath::Host, 504)?,
        pdstor_probes::Verdict::Fallback("not-fixed".into()),
    )?;
    // Negative control: a deliberately misaligned buffer, which the engine
    // refuses, submitted by hand: the block layer copies it through bounce pages.
    expect(misaligned_passthrough(&ng, 507)?, pdstor_probes::Verdict::Fallback("bounce".into()))
}

/// One 4 KiB NVMe Write from a buffer one byte off alignment, by raw
/// `URING_CMD`, judged as a `host` transfer.
fn misaligned_passthrough(ng: &Path, transfer: u64) -> Checked<(pdstor_probes::Verdict, pdstor_probes::Signals)> {
    use pdstor_engine::io::nvme;
    let probes = attach_probes()?;
    let file =
        std::fs::OpenOptions::new().read(true).write(true).open(ng).map_err(|e| format!("{}: {e}", ng.display()))?;
    let buffer = Buffer::host(3 * 4096).map_err(|e| e.to_string())?;
    let base = buffer.slice(0, 3 * 4096).map_err(|e| e.to_string())?.ptr_guard_mut().as_ptr() as u64;
    let cmd = nvme::rw_command(nvme::OPC_WRITE, 1, (96 << 20) / 4096, 1, base + 1, 4096);
    let mut ring = io_uring::IoUring::<io_uring::squeue::Entry128, io_uring::cqueue::Entry32>::builder()
        .build(4)
        .map_err(|e| e.to_string())?;
    let sqe = io_uring::opcode::UringCmd80::new(io_uring::types::Fd(file.as_raw_fd()), nvme::URING_CMD_IO)
        .cmd(cmd)
        .build()
        .user_data(transfer << 16);
    // SAFETY: `buffer` outlives the command, which completes before it drops.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full".to_string())?;
    ring.submit_and_wait(1).map_err(|e| e.to_string())?;
    let res = ring.completion().next().map(|c| c.result()).ok_or("no completion")?;
    if res != 0 {
        return Err(format!("the misaligned passthrough write failed: {res}").into());
    }
    let s = probes.signals(transfer).map_err(|e| e.to_string())?.ok_or("no signals for the misaligned write")?;
    let v = pdstor_probes::judge(
        pdstor_probes::Declared::Host,
        pdstor_probes::TargetClass::NvmePassthrough,
        &s,
        &probes.attached(),
    );
    Ok((v, s))
}

fn page_cache_control(ctx: &Ctx) -> Checked {
    use std::os::fd::AsRawFd;
    let probes = attach_probes()?;
    let mount = ctx.disk(DiskRole::Xfs)?.mount.clone().ok_or("not mounted")?;
    let file = std::fs::File::create(mount.join("buffered.img")).map_err(|e| e.to_string())?;
    let data = vec![0x5au8; 1 << 20];
    let mut ring = io_uring::IoUring::new(4).map_err(|e| e.to_string())?;
    let sqe = io_uring::opcode::Write::new(io_uring::types::Fd(file.as_raw_fd()), data.as_ptr(), data.len() as u32)
        .build()
        .user_data(505 << 16);
    // SAFETY: `data` outlives the submission, which completes before it drops.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full".to_string())?;
    ring.submit_and_wait(1).map_err(|e| e.to_string())?;
    let s = probes.signals(505).map_err(|e| e.to_string())?.ok_or("no signals for the buffered write")?;
    let v = pdstor_probes::judge(
        pdstor_probes::Declared::HostFixed,
        pdstor_probes::TargetClass::File,
        &s,
        &probes.attached(),
    );
    expect((v, s), pdstor_probes::Verdict::Fallback("page-cache".into()))
}

fn bpftool_dump(ctx: &Ctx) -> Checked {
    let dir = Path::new(pdstor_probes::PIN_DIR);
    let _ = pdstor_probes::detach_pinned(dir);
    let mut probes = attach_probes()?;
    probes.pin(dir).map_err(|e| e.to_string())?;
    let mount = ctx.disk(DiskRole::Xfs)?.mount.clone().ok_or("not mounted")?;
    let t = Target::open(&mount.join("pin.img"), &TargetOptions { create_len: Some(8 << 20), ..Default::default() })
        .map_err(|e| e.to_string())?;
    let mut engine = Engine::new(t, EngineOptions::default()).map_err(|e| e.to_string())?;
    let id = engine.register(Buffer::host(1 << 20).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    let req = IoRequest {
        transfer: TransferId(506),
        op: Op::Write,
        path: PayloadPath::HostFixed,
        buffer: id,
        buffer_offset: pdstor_engine::io::BufferOffset(0),
        target_offset: pdstor_engine::io::TargetOffset(0),
        len: 1 << 20,
    };
    engine.execute_all(&[req]).map_err(|e| e.to_string())?;
    let out =
        crate::machine::sh("bpftool", &["--json", "map", "dump", "pinned", &dir.join("signals").to_string_lossy()]);
    let links = crate::machine::sh("bpftool", &["--json", "link", "show"]);
    let _ = pdstor_probes::detach_pinned(dir);
    let rows: serde_json::Value = serde_json::from_str(&out?).map_err(|e| format!("bpftool JSON: {e}"))?;
    let row = rows
        .as_array()
        .and_then(|a| a.iter().find(|r| r["formatted"]["key"]["transfer"] == 506 || r["key"]["transfer"] == 506))
        .ok_or_else(|| format!("bpftool shows no entry named transfer 506: {rows}"))?;
    let value = if row["formatted"].is_object() { &row["formatted"]["value"] } else { &row["value"] };
    if value["fixed_ops"] != 1 || value["dio_bvec"].as_u64().unwrap_or(0) == 0 {
        return Err(format!("bpftool's fields disagree: {value}").into());
    }
    let links: serde_json::Value = serde_json::from_str(&links?).map_err(|e| format!("bpftool link JSON: {e}"))?;
    if links.as_array().is_none_or(|l| l.len() < 5) {
        return Err(format!("bpftool link show lists too few links: {links}").into());
    }
    Ok(())
}

/// BTF for the kernel and for NVMe: the module's own BTF on Debian's kernel
/// (NVMe is a module there), vmlinux's on a kernel with NVMe built in.
fn btf_present(_: &Ctx) -> Checked {
    let vmlinux = std::fs::read("/sys/kernel/btf/vmlinux").map_err(|e| format!("/sys/kernel/btf/vmlinux: {e}"))?;
    if vmlinux.is_empty() {
        return Err("/sys/kernel/btf/vmlinux is empty".into());
    }
    let modular = std::fs::read_to_string("/proc/modules").is_ok_and(|m| m.lines().any(|l| l.starts_with("nvme ")));
    if modular {
        for f in ["/sys/kernel/btf/nvme", "/sys/kernel/btf/nvme_core"] {
            let len = std::fs::metadata(f).map_err(|e| format!("{f}: {e}"))?.len();
            if len == 0 {
                return Err(format!("{f} is empty").into());
            }
        }
    } else if !vmlinux.windows(b"nvme_queue\0".len()).any(|w| w == b"nvme_queue\0") {
        // Built in: the driver's types are in vmlinux's BTF string table.
        return Err("NVMe is built in, but vmlinux's BTF names no nvme_queue type".into());
    }
    Ok(())
}

fn tracepoint_counts(ctx: &Ctx) -> Checked {
    let raw = ctx.disk(DiskRole::Raw)?.block.clone();
    let id_file = "/sys/kernel/tracing/events/block/block_rq_issue/id";
    let tp_id: u64 = std::fs::read_to_string(id_file)
        .map_err(|e| format!("{id_file}: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("{id_file}: {e}"))?;
    let map = sys::array_map_u64()?;
    let prog = sys::load_counter(&map)?;
    // A tracepoint's programs hang off the tracepoint itself, so one
    // attachment (through CPU 0's event) sees hits on every CPU; a second
    // attachment of the same program is refused with EEXIST.
    let events = sys::attach_tracepoint(&prog, tp_id, 0)?;
    let before = sys::read_counter(&map)?;
    super::io::dd_direct(&raw, 0, 1 << 20)?;
    let after = sys::read_counter(&map)?;
    drop(events);
    // 1 MiB in 64 KiB direct reads is at least 16 requests.
    if after < before + 16 {
        return Err(format!("block_rq_issue counted {} requests for a 1 MiB direct read", after - before).into());
    }
    let pin = "/sys/fs/bpf/pdstor-vmtest-counter";
    sys::pin(&prog, pin)?;
    // bpftool, not our own code, must see the pinned program as a tracepoint program.
    let shown = crate::machine::sh("bpftool", &["--json", "prog", "show", "pinned", pin]);
    let _ = std::fs::remove_file(pin);
    let shown: serde_json::Value = serde_json::from_str(&shown?).map_err(|e| format!("bpftool --json output: {e}"))?;
    if shown["type"] != "tracepoint" {
        return Err(format!("bpftool shows the pinned program as {}", shown["type"]).into());
    }
    Ok(())
}

mod sys {
    //! `bpf(2)` and `perf_event_open(2)`: a one-entry array map, a program that
    //! adds 1 to it, attachment to a tracepoint, and pinning. Attribute unions
    //! are built as zeroed byte arrays with fields at their UAPI offsets.

    use super::*;

    const BPF_MAP_CREATE: i64 = 0;
    const BPF_MAP_LOOKUP_ELEM: i64 = 1;
    const BPF_PROG_LOAD: i64 = 5;
    const BPF_OBJ_PIN: i64 = 6;
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    const BPF_PROG_TYPE_TRACEPOINT: u32 = 5;
    const PERF_TYPE_TRACEPOINT: u32 = 2;
    /// `_IOW('$', 8, __u32)` and `_IO('$', 0)` from `linux/perf_event.h`.
    const PERF_EVENT_IOC_SET_BPF: u64 = 0x4004_2408;
    const PERF_EVENT_IOC_ENABLE: u64 = 0x2400;
    const PERF_FLAG_FD_CLOEXEC: u64 = 1 << 3;

    /// `union bpf_attr` is larger than this; the kernel takes a prefix.
    type Attr = [u8; 128];

    fn put32(a: &mut [u8], at: usize, v: u32) {
        a[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put64(a: &mut [u8], at: usize, v: u64) {
        a[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }

    fn bpf(cmd: i64, attr: &mut Attr, what: &str) -> Checked<i64> {
        // SAFETY: `attr` is a writable, zero-initialised prefix of `union
        // bpf_attr` whose pointer fields point at memory alive for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
        if rc < 0 {
            return Err(format!("bpf({what}): {}", std::io::Error::last_os_error()).into());
        }
        Ok(rc)
    }

    fn fd(raw: i64) -> OwnedFd {
        // SAFETY: `raw` is a new descriptor the kernel just returned to us.
        unsafe { OwnedFd::from_raw_fd(raw as i32) }
    }

    pub fn array_map_u64() -> Checked<OwnedFd> {
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, BPF_MAP_TYPE_ARRAY);
        put32(&mut a, 4, 4); // key_size
        put32(&mut a, 8, 8); // value_size
        put32(&mut a, 12, 1); // max_entries
        bpf(BPF_MAP_CREATE, &mut a, "MAP_CREATE").map(fd)
    }

    /// `struct bpf_insn`: opcode, dst:4 | src:4, off, imm.
    fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
        let mut i = [0u8; 8];
        i[0] = code;
        i[1] = (src << 4) | (dst & 0xf);
        i[2..4].copy_from_slice(&off.to_ne_bytes());
        i[4..8].copy_from_slice(&imm.to_ne_bytes());
        i
    }

    /// `counter[0] += 1` on every event.
    pub fn load_counter(map: &OwnedFd) -> Checked<OwnedFd> {
        let prog: Vec<[u8; 8]> = vec![
            insn(0x18, 1, 1, 0, map.as_raw_fd()), // r1 = map (ld_imm64, BPF_PSEUDO_MAP_FD)
            insn(0, 0, 0, 0, 0),
            insn(0x62, 10, 0, -4, 0), // *(u32 *)(r10 - 4) = 0
            insn(0xbf, 2, 10, 0, 0),  // r2 = r10
            insn(0x07, 2, 0, 0, -4),  // r2 += -4
            insn(0x85, 0, 0, 0, 1),   // call bpf_map_lookup_elem
            insn(0x15, 0, 0, 2, 0),   // if r0 == 0 goto +2
            insn(0xb7, 1, 0, 0, 1),   // r1 = 1
            insn(0xdb, 0, 1, 0, 0),   // lock *(u64 *)(r0 + 0) += r1
            insn(0xb7, 0, 0, 0, 0),   // r0 = 0
            insn(0x95, 0, 0, 0, 0),   // exit
        ];
        let bytes: Vec<u8> = prog.concat();
        let license = c"GPL";
        let mut log = vec![0u8; 4096];
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, BPF_PROG_TYPE_TRACEPOINT);
        put32(&mut a, 4, prog.len() as u32);
        put64(&mut a, 8, bytes.as_ptr() as u64);
        put64(&mut a, 16, license.as_ptr() as u64);
        put32(&mut a, 24, 1); // log_level
        put32(&mut a, 28, log.len() as u32);
        put64(&mut a, 32, log.as_mut_ptr() as u64);
        Ok(bpf(BPF_PROG_LOAD, &mut a, "PROG_LOAD").map(fd).map_err(|e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            format!("{e}; verifier: {}", String::from_utf8_lossy(&log[..end]))
        })?)
    }

    pub fn read_counter(map: &OwnedFd) -> Checked<u64> {
        let key = 0u32;
        let mut value = 0u64;
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, map.as_raw_fd() as u32);
        put64(&mut a, 8, &key as *const u32 as u64);
        put64(&mut a, 16, &mut value as *mut u64 as u64);
        bpf(BPF_MAP_LOOKUP_ELEM, &mut a, "MAP_LOOKUP_ELEM")?;
        Ok(value)
    }

    pub fn attach_tracepoint(prog: &OwnedFd, tp_id: u64, cpu: i32) -> Checked<OwnedFd> {
        // struct perf_event_attr: type, size, config, sample_period; the rest 0.
        let mut a = [0u8; 128];
        put32(&mut a, 0, PERF_TYPE_TRACEPOINT);
        put32(&mut a, 4, 128);
        put64(&mut a, 8, tp_id);
        put64(&mut a, 16, 1);
        // SAFETY: `a` is a zero-extended `struct perf_event_attr` of the size
        // it declares; pid -1 with a cpu counts every task on that CPU.
        let rc = unsafe { libc::syscall(libc::SYS_perf_event_open, a.as_ptr(), -1, cpu, -1, PERF_FLAG_FD_CLOEXEC) };
        if rc < 0 {
            return Err(
                format!("perf_event_open(tracepoint {tp_id}, cpu {cpu}): {}", std::io::Error::last_os_error()).into()
            );
        }
        let ev = fd(rc);
        // SAFETY: both ioctls take an int argument (the program fd, or none).
        let set = unsafe { libc::ioctl(ev.as_raw_fd(), PERF_EVENT_IOC_SET_BPF as _, prog.as_raw_fd()) };
        // SAFETY: as above.
        let on = unsafe { libc::ioctl(ev.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) };
        if set != 0 || on != 0 {
            return Err(
                format!("attaching the program to tracepoint {tp_id}: {}", std::io::Error::last_os_error()).into()
            );
        }
        Ok(ev)
    }

    pub fn pin(prog: &OwnedFd, path: &str) -> Checked {
        let c = std::ffi::CString::new(path).map_err(|e| e.to_string())?;
        let mut a: Attr = [0; 128];
        put64(&mut a, 0, c.as_ptr() as u64);
        put32(&mut a, 8, prog.as_raw_fd() as u32);
        bpf(BPF_OBJ_PIN, &mut a, "OBJ_PIN").map(|_| ())
    }
}
