//! `dmabuf`: DMA-BUF buffers from the guest kernel's own exporters (udmabuf
//! and the system DMA heap), handed to `pdstor serve` over the data plane,
//! stored to and loaded from the raw NVMe block device and a file on XFS, and
//! read back independently with `dd iflag=direct`. On Debian's kernel
//! `dmabuf_fixed` must fail with the capability error and write nothing; on
//! a kernel with the rw-dmabuf series (`vmtest --kernel-series`) it must be
//! available, and the tests that expect a refusal say SKIP. The
//! `dma_buf_begin_cpu_access` kprobe must see no CPU access to a DMA-BUF during
//! a fixed-path transfer, and must see one that a control makes on purpose.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use pdstor::api::wire::DataChunk;
use pdstor::buffer::dmabuf::{Access, DmaBuf};
use pdstor::client::{Client, ClientError, DataConn};
use pdstor::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor::store::Layout;
use pdstor::{Buffer, PayloadPath};
use pdstor_probes::{Declared, TargetClass, Verdict};

use super::io::{dd_direct, nvme_read};
use super::protocol::{SERVER, SOCKET, serve_with};
use super::{Suite, Test, outcome};
use crate::guest::{Ctx, expects_rw_dmabuf, sh};
use crate::{DiskRole, Outcome};

pub const SUITE: Suite = Suite {
    name: "dmabuf",
    tests: &[
        Test { name: "exporters_and_capability_probe", disk: Some(DiskRole::Raw), run: exporters_and_probe },
        Test { name: "cpu_access_seen_only_inside_a_transfer", disk: Some(DiskRole::Raw), run: cpu_access },
        Test { name: "udmabuf_and_heap_on_raw_block", disk: Some(DiskRole::Raw), run: raw_block },
        Test { name: "udmabuf_and_heap_on_xfs", disk: Some(DiskRole::Xfs), run: xfs },
        Test { name: "dmabuf_fixed_refused_writes_nothing", disk: Some(DiskRole::Raw), run: dmabuf_fixed_refused },
        Test { name: "dmabuf_fixed_moves_bytes", disk: Some(DiskRole::Raw), run: dmabuf_fixed_moves_bytes },
        Test { name: "dmabuf_fixed_engine_offsets_and_ebadf", disk: Some(DiskRole::Raw), run: dmabuf_fixed_engine },
        Test { name: "dmabuf_fixed_probes_and_controls", disk: Some(DiskRole::Raw), run: dmabuf_fixed_probes },
        Test { name: "bad_dmabuf_input_is_refused", disk: Some(DiskRole::Raw), run: bad_input },
        Test { name: "dmabuf_fixed_eagain_is_resubmitted", disk: Some(DiskRole::Raw), run: eagain },
        Test { name: "dmabuf_fixed_one_gib_limit", disk: Some(DiskRole::Raw), run: one_gib },
        Test { name: "device_errors_through_the_daemon", disk: Some(DiskRole::Faulty), run: device_errors },
        Test { name: "ladder_on_raw_block", disk: Some(DiskRole::Raw), run: ladder },
    ],
};

const CHUNK: u64 = 1 << 20;
const CHUNKS: u32 = 6;

/// SKIP unless this guest runs the rw-dmabuf series kernel.
fn needs_series() -> Result<(), String> {
    if !expects_rw_dmabuf() {
        return Err("SKIP: Debian's kernel has no rw-dmabuf series (vmtest --kernel-series runs this)".into());
    }
    Ok(())
}

fn e<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn exporters_and_probe(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let disk = ctx.disk(DiskRole::Raw)?;
        let info = sh("/bin/pdstor", &["info", "--target", &disk.block.to_string_lossy()])?;
        let v: serde_json::Value = serde_json::from_str(&info).map_err(e("parsing pdstor info"))?;
        if v["dmabuf_exporters"]["udmabuf"] != true {
            return Err(format!("the guest kernel has udmabuf built in, but pdstor info says: {info}"));
        }
        if !v["dmabuf_exporters"]["dma_heaps"].as_array().is_some_and(|h| h.iter().any(|x| x == "system")) {
            return Err(format!("no system DMA heap reported: {info}"));
        }
        let rw = &v["dmabuf_rw"];
        if expects_rw_dmabuf() {
            // The series kernel: the probe must find the UAPI.
            if rw["state"] != "available" {
                return Err(format!("the guest runs the rw-dmabuf series, but the probe says: {rw}"));
            }
        } else if rw["state"] != "missing" || !rw["detail"].as_str().is_some_and(|d| d.contains("EINVAL")) {
            // Debian's 6.12 has no rw-dmabuf series: the probe must say so, and why.
            return Err(format!("the rw-dmabuf probe should report the UAPI missing (EINVAL): {rw}"));
        }
        Ok(())
    })())
}

/// In-process, with the probes attached to this test process: a `host_fixed`
/// write and read through a udmabuf's memfd mapping are `native` with no CPU
/// access charged, although the test touches the buffer (SYNC-bracketed)
/// before and after each transfer. Control: a CPU access made while a
/// hand-submitted write is in flight is charged to it and judged
/// `fallback(dmabuf-cpu-access)`.
fn cpu_access(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let disk = ctx.disk(DiskRole::Raw)?;
        let probes = pdstor_probes::Probes::attach(std::process::id()).map_err(e("attaching the probes"))?;
        let reader = probes.reader().map_err(e("reading the probes"))?;
        let attached = reader.attached();
        if !attached.dmabuf_cpu {
            return Err("no hook on dma_buf_begin_cpu_access attached in the guest".into());
        }
        let buf = Buffer::udmabuf("vmtest-cpu", 2 * CHUNK as usize).map_err(e("creating a udmabuf"))?;
        let pattern = pdstor::payload::chunk(0xd0a, 1, CHUNK as usize);
        buf.write_at(0, &pattern).map_err(e("filling the udmabuf"))?;
        let before = pdstor::buffer::dmabuf::cpu_accesses();
        {
            let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw block device"))?;
            let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
            let id = engine.register(buf).map_err(e("registering the udmabuf's mapping"))?;
            let req = |transfer: u64, op, buffer_offset| IoRequest {
                transfer: TransferId(transfer),
                op,
                path: PayloadPath::HostFixed,
                buffer: id,
                buffer_offset,
                target_offset: pdstor::io::TargetOffset(64 * CHUNK),
                len: CHUNK,
            };
            engine.execute_all(&[req(0x7701, Op::Write, pdstor::io::BufferOffset(0))]).map_err(e("fixed write"))?;
            engine.execute_all(&[req(0x7702, Op::Read, pdstor::io::BufferOffset(CHUNK))]).map_err(e("fixed read"))?;
            let mut back = vec![0u8; CHUNK as usize];
            engine.buffer(id).map_err(e("buffer"))?.read_at(CHUNK, &mut back).map_err(e("reading back"))?;
            if let Some(at) = pdstor::payload::first_difference(&pattern, &back) {
                return Err(format!("the udmabuf read back differs at byte {at}"));
            }
            for t in [0x7701u64, 0x7702] {
                let s = reader.signals(t).map_err(e("signals"))?.ok_or(format!("no signals for {t:#x}"))?;
                if s.dmabuf_cpu_access != 0 {
                    return Err(format!("transfer {t:#x} was charged {} CPU accesses: {s:?}", s.dmabuf_cpu_access));
                }
                let v = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
                if v != Verdict::Native {
                    return Err(format!("transfer {t:#x}: {v} ({s:?})"));
                }
            }
        }
        let touched = pdstor::buffer::dmabuf::cpu_accesses() - before;
        if touched < 1 {
            return Err("reading the udmabuf back was not counted as a CPU access".into());
        }

        // Control: touch the DMA-BUF while a write from it is in flight.
        let file = std::fs::File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&disk.block)
            .map_err(e("opening the raw block device"))?;
        let region = Buffer::udmabuf("vmtest-ctl", CHUNK as usize).map_err(e("control udmabuf"))?;
        let ctl = DmaBuf::import(
            region.dmabuf().ok_or("no DMA-BUF")?.try_clone_fd().map_err(e("dup of the control DMA-BUF"))?,
        )
        .map_err(e("importing the control dup"))?;
        let transfer = 0x7703u64;
        let res = inflight_touch(&file, &region, &ctl, transfer << 16)?;
        if res != CHUNK as i32 {
            return Err(format!("the control write returned {res}"));
        }
        let s = reader.signals(transfer).map_err(e("signals"))?.ok_or("no signals for the control")?;
        let v = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
        if s.dmabuf_cpu_access == 0 || v != Verdict::Fallback("dmabuf-cpu-access".into()) {
            return Err(format!("a CPU access during the control transfer was not seen: {v} ({s:?})"));
        }
        Ok(())
    })())
}

/// Submits one WRITE_FIXED of `region`'s first MiB on a ring whose completions
/// run only when this thread waits (DEFER_TASKRUN), touches the DMA-BUF with a
/// SYNC-bracketed access while the write is in flight, then waits.
fn inflight_touch(file: &std::fs::File, region: &Buffer, ctl: &DmaBuf, user_data: u64) -> Result<i32, String> {
    use io_uring::{IoUring, opcode, types};
    let mut ring = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(4)
        .map_err(e("io_uring setup"))?;
    let addr = region.slice(0, CHUNK as usize).map_err(e("slice"))?.ptr_guard_mut().as_ptr();
    let iov = libc::iovec { iov_base: addr.cast(), iov_len: CHUNK as usize };
    // SAFETY: the iovec is `region`'s mapping, which outlives the ring (both
    // are dropped at the end of this function, the ring first).
    unsafe { ring.submitter().register_buffers(&[iov]) }.map_err(e("register_buffers"))?;
    let sqe = opcode::WriteFixed::new(types::Fd(file.as_raw_fd()), addr, CHUNK as u32, 0)
        .offset(96 * CHUNK)
        .build()
        .user_data(user_data);
    // SAFETY: the SQE points at the registered buffer, valid until completion.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "the submission queue is full".to_string())?;
    ring.submit().map_err(e("submit"))?;
    drop(ctl.begin_cpu_access(Access::Read).map_err(e("DMA_BUF_IOCTL_SYNC"))?);
    ring.submit_and_wait(1).map_err(e("wait"))?;
    let cqe = ring.completion().next().ok_or("no completion")?;
    Ok(cqe.result())
}

fn layout() -> Layout {
    Layout {
        model_id: "vmtest-dmabuf".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

/// One writer buffer (exporter, path) and one reader buffer (exporter, path):
/// prepare, store, publish, claim, adopt, load, then check the daemon's
/// verdicts, the reader's bytes, and every chunk on the target with `dd`.
fn handoff(target: &Path, writer: (&str, PayloadPath), reader: (&str, PayloadPath), req: &str) -> Result<(), String> {
    handoff_at(target, writer, reader, req, 0)
}

/// [`handoff`] with every chunk `base` bytes into both buffers (the reader's
/// cleared first), so transfers start inside the DMA-BUF, not at its start.
fn handoff_at(
    target: &Path,
    writer: (&str, PayloadPath),
    reader: (&str, PayloadPath),
    req: &str,
    base: u64,
) -> Result<(), String> {
    let client = Client::new(SERVER);
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
    let alloc = |exporter: &str, len: usize| match exporter {
        "udmabuf" => Buffer::udmabuf(req, len),
        _ => Buffer::dma_heap("system", len),
    };
    let total = CHUNK * CHUNKS as u64;
    let room = (total + base).next_multiple_of(CHUNK) as usize;
    let wbuf = alloc(writer.0, room).map_err(e("writer buffer"))?;
    let payload: Vec<u8> = (0..CHUNKS as u64).flat_map(|i| pdstor::payload::chunk(0xd3a, i, CHUNK as usize)).collect();
    wbuf.write_at(base, &payload).map_err(e("filling the writer buffer"))?;
    let wid = data.register_for(&wbuf, writer.1).map_err(e("registering the writer buffer"))?;
    let p = client.prepare(req, &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
    let chunks: Vec<DataChunk> = (0..CHUNKS)
        .map(|i| DataChunk { index: i, buffer: wid, offset: base + i as u64 * CHUNK, len: CHUNK, crc32c: None })
        .collect();
    let stored = data.store(p.publication, &p.writer_token, chunks, true, CHUNKS).map_err(e("store"))?;
    check_chunks("store", &stored.paths, &stored.verdicts, writer.1)?;
    let published = client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
    let claim = client.claim(&published.receipt, "decode-0", req, 60_000).map_err(e("claim"))?;
    let manifest = client.adopt(&pdstor::api::wire::AdoptRequest::of_claim(&claim, layout())).map_err(e("adopt"))?;
    // Independent: every chunk as it lies on the target, read by busybox dd.
    for c in &manifest.chunks {
        let on_disk = dd_direct(target, c.offset.0, c.len)?;
        let want = &payload[(c.index as u64 * CHUNK) as usize..][..c.len as usize];
        if let Some(at) = pdstor::payload::first_difference(want, &on_disk) {
            return Err(format!("chunk {} on the target differs from the writer's bytes at byte {at}", c.index));
        }
    }
    let rbuf = alloc(reader.0, room).map_err(e("reader buffer"))?;
    rbuf.write_at(0, &vec![0u8; room]).map_err(e("clearing the reader buffer"))?;
    let rid = data.register_for(&rbuf, reader.1).map_err(e("registering the reader buffer"))?;
    let chunks: Vec<DataChunk> = manifest
        .chunks
        .iter()
        .map(|c| DataChunk { index: c.index, buffer: rid, offset: base + c.index as u64 * CHUNK, len: 0, crc32c: None })
        .collect();
    let loaded = data.load(&claim, chunks).map_err(e("load"))?;
    check_chunks("load", &loaded.paths, &loaded.verdicts, reader.1)?;
    let mut back = vec![0u8; total as usize];
    rbuf.read_at(base, &mut back).map_err(e("reading the reader buffer"))?;
    if let Some(at) = pdstor::payload::first_difference(&payload, &back) {
        return Err(format!("the reader's {} buffer differs from the writer's at byte {at}", reader.0));
    }
    // The bytes were just compared with the writer's: their crcs are the manifest's.
    let crcs: Vec<u32> = manifest.chunks.iter().map(|c| c.crc32c).collect();
    let digest = pdstor::protocol::service::restore_digest(manifest.restore_nonce.as_deref().unwrap_or(""), &crcs);
    client.ack(&claim, &digest).map_err(e("ack"))?;
    Ok(())
}

fn check_chunks(step: &str, paths: &[String], verdicts: &[String], path: PayloadPath) -> Result<(), String> {
    if paths.len() != CHUNKS as usize || paths.iter().any(|p| p != path.as_str()) {
        return Err(format!("{step}: the daemon reports paths {paths:?}, expected {path} for every chunk"));
    }
    if verdicts.len() != CHUNKS as usize || verdicts.iter().any(|v| v != "native") {
        return Err(format!("{step} on {path}: verdicts {verdicts:?}, expected native for every chunk"));
    }
    Ok(())
}

/// A client buffer: its exporter and the path it is registered for.
type Side = (&'static str, PayloadPath);

/// The udmabuf paths a stock kernel supports, writer → reader.
const COMBOS: &[(Side, Side)] = &[
    (("udmabuf", PayloadPath::HostFixed), ("udmabuf", PayloadPath::HostFixed)),
    (("udmabuf", PayloadPath::Host), ("udmabuf", PayloadPath::HostFixed)),
    (("udmabuf", PayloadPath::HostFixed), ("udmabuf", PayloadPath::Host)),
];

fn run_combos(target: &Path, format_args: &[&str]) -> Result<(), String> {
    let t = target.to_string_lossy().into_owned();
    let mut args = vec!["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t];
    args.extend_from_slice(format_args);
    sh("/bin/pdstor", &args)?;
    let daemon = serve_with(target, &["--provenance", "--require-native"])?;
    for (n, (w, r)) in COMBOS.iter().enumerate() {
        handoff(target, *w, *r, &format!("dmabuf-{n}")).map_err(|err| format!("writer {w:?} → reader {r:?}: {err}"))?;
    }
    // The system heap maps its pages as raw page frames: no host path can pin
    // them. Without the rw-dmabuf series dmabuf_fixed is missing too: every
    // path refuses, up front, with its reason; none copies. With the series,
    // dmabuf_fixed takes it (the dmabuf_fixed tests move bytes through it).
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
    let heap = Buffer::dma_heap("system", CHUNK as usize).map_err(e("dma-heap buffer"))?;
    for (path, says) in [
        (PayloadPath::Host, "cannot be pinned for direct I/O"),
        (PayloadPath::HostFixed, "cannot be pinned for direct I/O"),
        (PayloadPath::DmabufFixed, "rw-dmabuf"),
    ] {
        match data.register_for(&heap, path) {
            Ok(_) if path == PayloadPath::DmabufFixed && expects_rw_dmabuf() => {}
            Err(ClientError::Api(b)) if b.status == 422 && b.message.contains(says) => {}
            other => return Err(format!("a system-heap DMA-BUF on {path} answered {:?}", other.map(|_| ()))),
        }
    }
    let metrics = Client::new(SERVER).metrics().map_err(e("metrics"))?;
    let touched = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pdstor_dmabuf_cpu_accesses_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or("no pdstor_dmabuf_cpu_accesses_total in /metrics")?;
    if touched == 0 {
        return Err("the daemon checksummed DMA-BUF chunks without counting the CPU accesses".into());
    }
    drop(daemon);
    Ok(())
}

fn raw_block(ctx: &Ctx) -> Outcome {
    outcome((|| run_combos(&ctx.disk(DiskRole::Raw)?.block, &[]))())
}

fn xfs(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let mount = ctx.disk(DiskRole::Xfs)?.mount.clone().ok_or("XFS not mounted")?;
        let img = mount.join("pdstor-dmabuf.img");
        let r = run_combos(&img, &["--size", "64M"]);
        let _ = std::fs::remove_file(&img);
        r
    })())
}

/// crc32c of the device's first 64 MiB (superblock, journal and the first
/// slots, where a store would land), read with O_DIRECT outside the daemon.
fn device_crc(path: &Path) -> Result<u32, String> {
    let len = 64 << 20;
    Ok(crc32c::crc32c(&dd_direct(path, 0, len)?))
}

/// A fresh namespace (1 MiB slots) on `device`, served.
fn fresh_daemon(device: &Path) -> Result<super::protocol::Daemon, String> {
    let t = device.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t])?;
    serve_with(device, &[])
}

/// The series kernel: udmabuf and system-heap DMA-BUFs registered for
/// `dmabuf_fixed` move real bytes between the client's DMA-BUF and the raw
/// NVMe namespace through `pdstor serve --provenance --require-native`:
/// every chunk judged native, read back with `dd iflag=direct`, and loaded
/// into a cleared DMA-BUF of each exporter, at the buffer's start and 12 KiB
/// into it.
fn dmabuf_fixed_moves_bytes(ctx: &Ctx) -> Outcome {
    outcome((|| {
        needs_series()?;
        let disk = ctx.disk(DiskRole::Raw)?;
        let t = disk.block.to_string_lossy().into_owned();
        sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t])?;
        let daemon = serve_with(&disk.block, &["--provenance", "--require-native"])?;
        let fixed = PayloadPath::DmabufFixed;
        let sides: [(Side, Side); 4] = [
            (("udmabuf", fixed), ("udmabuf", fixed)),
            (("dma-heap", fixed), ("dma-heap", fixed)),
            (("udmabuf", PayloadPath::HostFixed), ("dma-heap", fixed)),
            (("dma-heap", fixed), ("udmabuf", PayloadPath::HostFixed)),
        ];
        for (n, (w, r)) in sides.iter().enumerate() {
            for base in [0, 12 << 10] {
                handoff_at(&disk.block, *w, *r, &format!("fixed-{n}-{base}"), base)
                    .map_err(|err| format!("writer {w:?} → reader {r:?} at +{base}: {err}"))?;
            }
        }
        drop(daemon);
        Ok(())
    })())
}

/// Pieces of a 4 MiB DMA-BUF (offset, length), apart from each other, most
/// not at its start: `dmabuf_fixed` addresses bytes inside the DMA-BUF.
const PIECES: [(u64, u64); 4] =
    [(0, 256 << 10), (268 << 10, 1 << 20), ((1 << 20) + (516 << 10), 512 << 10), (3 << 20, 1 << 20)];

/// One `dmabuf_fixed` request per piece of [`PIECES`]: DMA-BUF offset `at`
/// to target offset `base + at`, transfers numbered from `first`.
fn pieces(op: Op, id: pdstor::io::BufferId, base: u64, first: u64) -> Vec<IoRequest> {
    PIECES
        .iter()
        .enumerate()
        .map(|(i, &(at, n))| IoRequest {
            transfer: TransferId(first + i as u64),
            op,
            path: PayloadPath::DmabufFixed,
            buffer: id,
            buffer_offset: pdstor::io::BufferOffset(at),
            target_offset: pdstor::io::TargetOffset(base + at),
            len: n,
        })
        .collect()
}

/// The series kernel, the engine alone: udmabuf and system-heap DMA-BUFs
/// installed in the ring's buffer table (`IORING_RSRC_UPDATE_EXTENDED`)
/// against the raw NVMe namespace opened `O_DIRECT`; `WRITE_FIXED` of pieces
/// inside the DMA-BUF, every byte checked by `dd iflag=direct` and by `nvme
/// read` on the generic device; then the DMA-BUF cleared and `READ_FIXED`
/// back, the gaps between pieces still zero. A request on another open file
/// of the same device is refused `EBADF`.
fn dmabuf_fixed_engine(ctx: &Ctx) -> Outcome {
    outcome((|| {
        needs_series()?;
        let disk = ctx.disk(DiskRole::Raw)?;
        let len = 4 * CHUNK as usize;
        for (n, exporter) in ["udmabuf", "dma-heap"].into_iter().enumerate() {
            let buf = match exporter {
                "udmabuf" => Buffer::udmabuf("vmtest-engine", len),
                _ => Buffer::dma_heap("system", len),
            }
            .map_err(e("allocating the DMA-BUF"))?;
            let pattern: Vec<u8> =
                (0..4).flat_map(|i| pdstor::payload::chunk(0xf1 + n as u64, i, CHUNK as usize)).collect();
            buf.write_at(0, &pattern).map_err(e("filling the DMA-BUF"))?;
            let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
            let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
            let id = engine.register_dmabuf(buf).map_err(e("installing the DMA-BUF"))?;
            let base = (160 + 8 * n as u64) * CHUNK;
            let requests = |op| pieces(op, id, base, 0x7800);
            engine.execute_all(&requests(Op::Write)).map_err(e("WRITE_FIXED from the DMA-BUF"))?;
            engine.flush().map_err(e("flush"))?;
            for &(at, n) in &PIECES {
                let want = &pattern[at as usize..(at + n) as usize];
                if pdstor::payload::first_difference(want, &dd_direct(&disk.block, base + at, n)?).is_some() {
                    return Err(format!(
                        "{exporter}: the piece at +{at} on the device (dd) is not the DMA-BUF's bytes"
                    ));
                }
                let by_nvme = nvme_read(&disk.generic, base + at, n, 4096, 512 << 10)?;
                if pdstor::payload::first_difference(want, &by_nvme).is_some() {
                    return Err(format!(
                        "{exporter}: the piece at +{at} read by `nvme read` is not the DMA-BUF's bytes"
                    ));
                }
            }
            let b = engine.buffer(id).map_err(e("buffer"))?;
            b.write_at(0, &vec![0u8; len]).map_err(e("clearing the DMA-BUF"))?;
            engine.execute_all(&requests(Op::Read)).map_err(e("READ_FIXED into the DMA-BUF"))?;
            let mut back = vec![0u8; len];
            engine.buffer(id).map_err(e("buffer"))?.read_at(0, &mut back).map_err(e("reading the DMA-BUF"))?;
            let mut want = vec![0u8; len];
            for &(at, n) in &PIECES {
                want[at as usize..(at + n) as usize].copy_from_slice(&pattern[at as usize..(at + n) as usize]);
            }
            if let Some(at) = pdstor::payload::first_difference(&want, &back) {
                return Err(format!("{exporter}: the DMA-BUF read back differs at byte {at} (pieces, zero gaps)"));
            }
        }
        another_file_is_ebadf(&disk.block)
    })())
}

/// Installs `dmabuf` in slot 0 of `ring`'s (sparse) buffer table for
/// `target` with `IORING_RSRC_UPDATE_EXTENDED`, as the engine does.
fn install_dmabuf(ring: &io_uring::IoUring, dmabuf: &DmaBuf, target: &std::fs::File) -> Result<(), String> {
    use pdstor::buffer::dmabuf::uapi;
    ring.submitter().register_buffers_sparse(1).map_err(e("a sparse buffer table"))?;
    let desc = uapi::IoUringRegbufDesc {
        kind: uapi::IO_REGBUF_TYPE_DMABUF,
        dmabuf_fd: dmabuf.fd().as_raw_fd(),
        target_fd: target.as_raw_fd(),
        ..Default::default()
    };
    let up = uapi::IoUringRsrcUpdate2 {
        offset: 0,
        flags: uapi::IORING_RSRC_UPDATE_EXTENDED,
        data: &desc as *const _ as u64,
        nr: 1,
        ..Default::default()
    };
    // SAFETY: io_uring_register reads one update and, through it, one
    // descriptor, both on this stack frame for the whole call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring.as_raw_fd(),
            uapi::IORING_REGISTER_BUFFERS_UPDATE,
            &up as *const uapi::IoUringRsrcUpdate2,
            size_of::<uapi::IoUringRsrcUpdate2>(),
        )
    };
    if ret != 1 {
        return Err(format!("installing the DMA-BUF answered {ret}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn open_direct(device: &Path) -> Result<std::fs::File, String> {
    std::fs::File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .map_err(e("opening the raw namespace"))
}

/// A DMA-BUF installed for one open file of the raw namespace, used on
/// another open file of the same device: `EBADF`; on its own file: done.
fn another_file_is_ebadf(device: &Path) -> Result<(), String> {
    use io_uring::{IoUring, opcode, types};
    let (mine, other) = (open_direct(device)?, open_direct(device)?);
    let region = Buffer::udmabuf("vmtest-ebadf", CHUNK as usize).map_err(e("udmabuf"))?;
    let mut ring = IoUring::new(4).map_err(e("io_uring setup"))?;
    install_dmabuf(&ring, region.dmabuf().ok_or("no DMA-BUF")?, &mine)?;
    let mut read_on = |file: &std::fs::File| -> Result<i32, String> {
        // The address is an offset into the DMA-BUF, not a pointer.
        let sqe = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), std::ptr::null_mut(), 4096, 0)
            .offset(200 * CHUNK)
            .build();
        // SAFETY: the SQE names buffer slot 0, installed above, alive until completion.
        unsafe { ring.submission().push(&sqe) }.map_err(|_| "the submission queue is full".to_string())?;
        ring.submit_and_wait(1).map_err(e("submit"))?;
        Ok(ring.completion().next().ok_or("no completion")?.result())
    };
    let on_other = read_on(&other)?;
    if on_other != -libc::EBADF {
        return Err(format!("READ_FIXED of a DMA-BUF on another file answered {on_other}, not -EBADF"));
    }
    let on_mine = read_on(&mine)?;
    if on_mine != 4096 {
        return Err(format!("READ_FIXED of a DMA-BUF on its own file answered {on_mine}, not 4096"));
    }
    Ok(())
}

/// The series kernel, with the probes attached to this process: a
/// `dmabuf_fixed` write and read are `native` with DMA-token bios seen
/// (the hook on `bio_dmabuf_map_set`) and no CPU access. Controls: the same
/// exporter's memory on `host_fixed` is native `host_fixed` and, judged as
/// `dmabuf_fixed`, `not-dma-token`; a CPU access while a `dmabuf_fixed`
/// write is in flight is `fallback(dmabuf-cpu-access)`.
fn dmabuf_fixed_probes(ctx: &Ctx) -> Outcome {
    outcome((|| {
        needs_series()?;
        let disk = ctx.disk(DiskRole::Raw)?;
        let probes = pdstor_probes::Probes::attach(std::process::id()).map_err(e("attaching the probes"))?;
        let reader = probes.reader().map_err(e("reading the probes"))?;
        let attached = reader.attached();
        if !attached.dmabuf_token || !attached.dmabuf_cpu {
            return Err(format!("the DMA-token or CPU-access kprobe did not attach: {attached:?}"));
        }
        let judge = |t: u64, declared| -> Result<(Verdict, pdstor_probes::Signals), String> {
            let s = reader.signals(t).map_err(e("signals"))?.ok_or(format!("no signals for {t:#x}"))?;
            Ok((pdstor_probes::judge(declared, TargetClass::BlockDevice, &s, &attached), s))
        };
        let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
        let fixed = engine
            .register_dmabuf(Buffer::udmabuf("vmtest-token", CHUNK as usize).map_err(e("udmabuf"))?)
            .map_err(e("installing the DMA-BUF"))?;
        let host = engine
            .register(Buffer::udmabuf("vmtest-host", CHUNK as usize).map_err(e("udmabuf"))?)
            .map_err(e("registering the udmabuf's mapping"))?;
        let req = |transfer: u64, op, path, buffer| IoRequest {
            transfer: TransferId(transfer),
            op,
            path,
            buffer,
            buffer_offset: pdstor::io::BufferOffset(0),
            target_offset: pdstor::io::TargetOffset(176 * CHUNK),
            len: CHUNK,
        };
        engine
            .execute_all(&[req(0x7901, Op::Write, PayloadPath::DmabufFixed, fixed)])
            .map_err(e("dmabuf_fixed write"))?;
        engine
            .execute_all(&[req(0x7902, Op::Read, PayloadPath::DmabufFixed, fixed)])
            .map_err(e("dmabuf_fixed read"))?;
        engine.execute_all(&[req(0x7903, Op::Write, PayloadPath::HostFixed, host)]).map_err(e("host_fixed write"))?;
        for t in [0x7901u64, 0x7902] {
            let (v, s) = judge(t, Declared::DmabufFixed)?;
            // Both witnesses of the DMA-token path: the bio seen built on the
            // mapping, and the requests seen carrying it (BIO_DMABUF_MAP).
            if v != Verdict::Native || s.dmabuf_token_bios == 0 || s.dmabuf_token_rqs == 0 || s.dmabuf_cpu_access != 0 {
                return Err(format!("dmabuf_fixed transfer {t:#x}: {v} ({s:?})"));
            }
            // The commands the device got are exactly the request: 1 MiB in
            // 4 KiB blocks, split at MDTS (512 KiB) into two; nothing cached,
            // nothing bounced, every request completed.
            let mdts = 4096u64 << pdstor_vmtest_spec::NVME_MDTS;
            let exact = s.nvme_blocks * 4096 == CHUNK
                && s.nvme_cmds == CHUNK.div_ceil(mdts)
                && s.rq_bytes == CHUNK
                && s.requests_all_completed()
                && s.rq_errors == 0
                && s.page_cache_adds == 0
                && s.swiotlb_bounces == 0
                && s.dmabuf_bounced_bios == 0;
            if !exact {
                return Err(format!("dmabuf_fixed transfer {t:#x}: the device did not get exactly the request: {s:?}"));
            }
        }
        let s = reader.signals(0x7903).map_err(e("signals"))?.ok_or("no signals for the host_fixed control")?;
        let as_host = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
        let as_fixed = pdstor_probes::judge(Declared::DmabufFixed, TargetClass::BlockDevice, &s, &attached);
        if as_host != Verdict::Native
            || as_fixed != Verdict::Fallback("not-dma-token".into())
            || s.dmabuf_token_rqs != 0
        {
            return Err(format!(
                "the host path of a udmabuf: as host_fixed {as_host}, as dmabuf_fixed {as_fixed} ({s:?})"
            ));
        }
        inflight_touch_fixed(&disk.block, &reader, &attached)
    })())
}

/// A `dmabuf_fixed` WRITE_FIXED on a ring whose completions run only when
/// this thread waits (DEFER_TASKRUN), with a SYNC-bracketed CPU access to the
/// DMA-BUF while it is in flight: judged `fallback(dmabuf-cpu-access)`.
fn inflight_touch_fixed(
    device: &Path,
    reader: &pdstor_probes::SignalReader,
    attached: &pdstor_probes::Attached,
) -> Result<(), String> {
    use io_uring::{IoUring, opcode, types};
    let file = open_direct(device)?;
    let region = Buffer::udmabuf("vmtest-touch", CHUNK as usize).map_err(e("udmabuf"))?;
    let dmabuf = region.dmabuf().ok_or("no DMA-BUF")?;
    let ctl = DmaBuf::import(dmabuf.try_clone_fd().map_err(e("dup of the DMA-BUF"))?).map_err(e("import"))?;
    let mut ring = IoUring::<io_uring::squeue::Entry, io_uring::cqueue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(4)
        .map_err(e("io_uring setup"))?;
    install_dmabuf(&ring, dmabuf, &file)?;
    let transfer = 0x7904u64;
    let sqe = opcode::WriteFixed::new(types::Fd(file.as_raw_fd()), std::ptr::null(), CHUNK as u32, 0)
        .offset(184 * CHUNK)
        .build()
        .user_data(transfer << 16);
    // SAFETY: the SQE names buffer slot 0, installed above, alive until completion.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "the submission queue is full".to_string())?;
    ring.submit().map_err(e("submit"))?;
    drop(ctl.begin_cpu_access(Access::Read).map_err(e("DMA_BUF_IOCTL_SYNC"))?);
    ring.submit_and_wait(1).map_err(e("wait"))?;
    let res = ring.completion().next().ok_or("no completion")?.result();
    if res != CHUNK as i32 {
        return Err(format!("the control write returned {res}"));
    }
    let s = reader.signals(transfer).map_err(e("signals"))?.ok_or("no signals for the control")?;
    let v = pdstor_probes::judge(Declared::DmabufFixed, TargetClass::BlockDevice, &s, attached);
    if v != Verdict::Fallback("dmabuf-cpu-access".into()) {
        return Err(format!("a CPU access during a dmabuf_fixed write was not seen: {v} ({s:?})"));
    }
    Ok(())
}

fn dmabuf_fixed_refused(ctx: &Ctx) -> Outcome {
    outcome((|| {
        if expects_rw_dmabuf() {
            return Err("SKIP: this kernel has the rw-dmabuf series: dmabuf_fixed is not refused here".into());
        }
        let disk = ctx.disk(DiskRole::Raw)?;
        let daemon = fresh_daemon(&disk.block)?;
        let before = device_crc(&disk.block)?;
        let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
        for exporter in ["udmabuf", "dma-heap"] {
            let b = match exporter {
                "udmabuf" => Buffer::udmabuf("vmtest-fixed", CHUNK as usize),
                _ => Buffer::dma_heap("system", CHUNK as usize),
            }
            .map_err(e("buffer"))?;
            match data.register_for(&b, PayloadPath::DmabufFixed) {
                Err(ClientError::Api(body))
                    if body.status == 422
                        && body.code == "path_unavailable"
                        && body.message.contains("rw-dmabuf")
                        && body.message.contains("kernel-config/dmabuf-rw.config") => {}
                other => {
                    return Err(format!("{exporter}: dmabuf_fixed on a stock kernel answered {:?}", other.map(|_| ())));
                }
            }
        }
        let after = device_crc(&disk.block)?;
        let pubs = Client::new(SERVER).publications(None, false).map_err(e("publications"))?;
        if before != after || !pubs.is_empty() {
            return Err(format!(
                "the refusal changed the target (crc {before:#x} → {after:#x}) or left publications {pubs:?}"
            ));
        }
        drop(daemon);
        Ok(())
    })())
}

fn bad_input(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let disk = ctx.disk(DiskRole::Raw)?;
        let daemon = fresh_daemon(&disk.block)?;
        let client = Client::new(SERVER);
        let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;

        // A buffer smaller than the batch references: refused, nothing stored.
        let small = Buffer::udmabuf("vmtest-small", CHUNK as usize).map_err(e("udmabuf"))?;
        let id = data.register_for(&small, PayloadPath::HostFixed).map_err(e("register"))?;
        let p = client.prepare("bad-1", &layout(), 2, "vmtest").map_err(e("prepare"))?;
        let chunks: Vec<DataChunk> = (0..2)
            .map(|i| DataChunk { index: i, buffer: id, offset: i as u64 * CHUNK, len: CHUNK, crc32c: None })
            .collect();
        match data.store(p.publication, &p.writer_token, chunks, true, 2) {
            Err(ClientError::Api(b)) if b.status == 422 && b.message.contains("outside the") => {}
            other => return Err(format!("a chunk beyond the buffer answered {:?}", other.map(|_| ()))),
        }
        if !client.publications(None, false).map_err(e("publications"))?.is_empty() {
            return Err("the refused batch left a publication behind".into());
        }

        // The client closes every fd it has and unmaps the buffer after
        // registering: the daemon holds its own references, so a transfer
        // still completes, and the bytes are right. On the series kernel the
        // same holds for a DMA-BUF installed for dmabuf_fixed. Shrinking the
        // udmabuf's memfd first is refused (it is sealed): nothing moves under
        // the daemon's mapping.
        let mut paths = vec![PayloadPath::HostFixed];
        if expects_rw_dmabuf() {
            paths.push(PayloadPath::DmabufFixed);
        }
        for (n, path) in paths.into_iter().enumerate() {
            let b = Buffer::udmabuf("vmtest-closed", CHUNK as usize).map_err(e("udmabuf"))?;
            let payload = pdstor::payload::chunk(0xc105 + n as u64, 0, CHUNK as usize);
            b.write_at(0, &payload).map_err(e("fill"))?;
            let id = data.register_for(&b, path).map_err(e("register"))?;
            let memfd = b.memfd_fd().ok_or("the udmabuf has no memfd")?.as_raw_fd();
            // SAFETY: ftruncate(2) on the udmabuf's own memfd, which `b` keeps open.
            if unsafe { libc::ftruncate(memfd, 4096) } == 0 {
                return Err(format!("{path}: the udmabuf's memfd could be shrunk while registered"));
            }
            drop(b);
            let req = format!("closed-{n}");
            let p = client.prepare(&req, &layout(), 1, "vmtest").map_err(e("prepare"))?;
            let chunk = DataChunk { index: 0, buffer: id, offset: 0, len: CHUNK, crc32c: None };
            data.store(p.publication, &p.writer_token, vec![chunk], true, 1)
                .map_err(|err| format!("{path}: store after the client closed its fds: {err}"))?;
            let published = client.publish(p.publication, &p.writer_token, None).map_err(e("publish"))?;
            let c = published.manifest.chunks.first().ok_or("no chunk in the manifest")?;
            if dd_direct(&disk.block, c.offset.0, c.len)? != payload {
                return Err(format!(
                    "{path}: the chunk stored after the client closed its fds is not the client's bytes"
                ));
            }
            client.release(&published.receipt).map_err(e("release"))?;
        }
        drop(daemon);
        Ok(())
    })())
}

/// `pdstor ladder` with the udmabuf exporter: `host` and `host_fixed` are
/// qualified (every byte read back independently, every verdict native);
/// `dmabuf_fixed` is not, with the kernel's reason, and the command says so
/// with a non-zero exit.
fn ladder(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let disk = ctx.disk(DiskRole::Raw)?;
        let out = Path::new("/tmp/vmtest/ladder");
        // On the series kernel the ladder also measures the rungs against
        // each other (throughput ratio, CPU per GiB): more bytes.
        let (bytes, len) = if expects_rw_dmabuf() { ("32M", 32u64 << 20) } else { ("8M", 8 << 20) };
        let run = std::process::Command::new("/bin/pdstor")
            .args(["ladder", "--force", "--bytes", bytes, "--chunk", "1M", "--exporter", "udmabuf", "--target"])
            .arg(&disk.block)
            .arg("--out")
            .arg(out)
            .output()
            .map_err(e("running pdstor ladder"))?;
        let stderr = String::from_utf8_lossy(&run.stderr);
        let series = expects_rw_dmabuf();
        let expected = if series { Some(0) } else { Some(1) };
        if run.status.code() != expected || (!series && !stderr.contains("not qualified: dmabuf_fixed")) {
            return Err(format!("pdstor ladder exited {:?}: {stderr}", run.status.code()));
        }
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("ladder.json")).map_err(e("ladder.json"))?)
                .map_err(e("parsing ladder.json"))?;
        let rungs = report["rungs"].as_array().ok_or("no rungs in ladder.json")?;
        for (rung, path) in rungs.iter().zip(["host", "host_fixed", "dmabuf_fixed"]) {
            if rung["path"] != path {
                return Err(format!("rungs out of ladder order: {rungs:?}"));
            }
            let verdicts = rung["verdicts"].as_object().map(|v| v.keys().cloned().collect::<Vec<_>>());
            match path {
                "dmabuf_fixed" if series => {
                    if rung["qualified"] != true || verdicts != Some(vec!["native".to_string()]) {
                        return Err(format!("dmabuf_fixed on the series kernel was not qualified native: {rung}"));
                    }
                }
                "dmabuf_fixed" => {
                    if rung["qualified"] != false || !rung["reason"].as_str().is_some_and(|r| r.contains("rw-dmabuf")) {
                        return Err(format!("dmabuf_fixed on a stock kernel: {rung}"));
                    }
                }
                _ => {
                    if rung["qualified"] != true || verdicts != Some(vec!["native".to_string()]) {
                        return Err(format!("{path} was not qualified with native verdicts: {rung}"));
                    }
                    if !rung["independent_readback"].as_str().is_some_and(|r| r.contains(&format!("{len} bytes match")))
                    {
                        return Err(format!("{path}: no independent readback: {rung}"));
                    }
                }
            }
        }
        let md = std::fs::read_to_string(out.join("ladder.md")).map_err(e("ladder.md"))?;
        // The figures, for the host's console.log.
        for line in md.lines().filter(|l| l.starts_with('|') || l.starts_with("- kernel")) {
            crate::guest::console(&format!("ladder: {line}"));
        }
        let dmabuf_row = if series { "| dmabuf_fixed | yes |" } else { "| dmabuf_fixed | **no** |" };
        if !md.contains("| host_fixed | yes |") || !md.contains(dmabuf_row) {
            return Err(format!("ladder.md does not match ladder.json:\n{md}"));
        }
        Ok(())
    })())
}

/// The series kernel: `-EAGAIN` on the DMA-BUF path is real and resubmitted.
/// A `WRITE_FIXED` with `RWF_NOWAIT` larger than the device's MDTS (512 KiB
/// here) must be split, which the block layer refuses for a NOWAIT bio: the
/// kernel answers `-EAGAIN`, and the same SQE without NOWAIT moves the bytes.
/// Then the engine with `nowait_first` over the pieces of a DMA-BUF: every
/// piece above MDTS comes back `-EAGAIN` and is resubmitted (counted), every
/// byte checked with `dd` and read back into the cleared DMA-BUF.
fn eagain(ctx: &Ctx) -> Outcome {
    outcome((|| {
        use io_uring::{IoUring, opcode, types};
        needs_series()?;
        let disk = ctx.disk(DiskRole::Raw)?;
        let file = open_direct(&disk.block)?;
        let region = Buffer::udmabuf("vmtest-eagain", CHUNK as usize).map_err(e("udmabuf"))?;
        let pattern = pdstor::payload::chunk(0xea, 0, CHUNK as usize);
        region.write_at(0, &pattern).map_err(e("filling the udmabuf"))?;
        let mut ring = IoUring::new(4).map_err(e("io_uring setup"))?;
        install_dmabuf(&ring, region.dmabuf().ok_or("no DMA-BUF")?, &file)?;
        let at = 208 * CHUNK;
        let mut write = |flags: i32| -> Result<i32, String> {
            let sqe = opcode::WriteFixed::new(types::Fd(file.as_raw_fd()), std::ptr::null(), CHUNK as u32, 0)
                .offset(at)
                .rw_flags(flags)
                .build();
            // SAFETY: the SQE names buffer slot 0, installed above, alive until completion.
            unsafe { ring.submission().push(&sqe) }.map_err(|_| "the submission queue is full".to_string())?;
            ring.submit_and_wait(1).map_err(e("submit"))?;
            Ok(ring.completion().next().ok_or("no completion")?.result())
        };
        // The first request on a new registration makes the device mapping
        // in an io-wq worker, where NOWAIT does not apply: make it first.
        let first = write(0)?;
        if first != CHUNK as i32 {
            return Err(format!("the first WRITE_FIXED answered {first}"));
        }
        let nowait = write(libc::RWF_NOWAIT)?;
        if nowait != -libc::EAGAIN {
            return Err(format!("a NOWAIT 1 MiB WRITE_FIXED above MDTS answered {nowait}, not -EAGAIN"));
        }
        let again = write(0)?;
        if again != CHUNK as i32 || dd_direct(&disk.block, at, CHUNK)? != pattern {
            return Err(format!("the resubmitted WRITE_FIXED answered {again} or left other bytes on the device"));
        }

        let len = 4 * CHUNK as usize;
        let buf = Buffer::udmabuf("vmtest-eagain-engine", len).map_err(e("udmabuf"))?;
        let pattern: Vec<u8> = (0..4).flat_map(|i| pdstor::payload::chunk(0xeb, i, CHUNK as usize)).collect();
        buf.write_at(0, &pattern).map_err(e("filling the DMA-BUF"))?;
        let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
        let mut engine =
            Engine::new(t, EngineOptions { nowait_first: true, ..Default::default() }).map_err(e("engine"))?;
        let id = engine.register_dmabuf(buf).map_err(e("installing the DMA-BUF"))?;
        let base = 216 * CHUNK;
        let requests = |op| pieces(op, id, base, 0x7b00);
        // The mapping first (its request runs blocking in an io-wq worker).
        let warm = IoRequest {
            transfer: TransferId(0x7aff),
            op: Op::Read,
            path: PayloadPath::DmabufFixed,
            buffer: id,
            buffer_offset: pdstor::io::BufferOffset(0),
            target_offset: pdstor::io::TargetOffset(base),
            len: 4096,
        };
        engine.execute_all(&[warm]).map_err(e("the first READ_FIXED"))?;
        engine.buffer(id).map_err(e("buffer"))?.write_at(0, &pattern).map_err(e("refilling"))?;
        let resubmitted_before = engine.stats().resubmitted;
        // Pieces above 512 KiB: two of 1 MiB (the 512 KiB one fits).
        let above_mdts = PIECES.iter().filter(|p| p.1 > 512 << 10).count() as u64;
        engine.execute_all(&requests(Op::Write)).map_err(e("WRITE_FIXED with NOWAIT first"))?;
        let after_writes = engine.stats().resubmitted;
        if after_writes - resubmitted_before < above_mdts {
            return Err(format!(
                "{after_writes} write commands resubmitted after -EAGAIN; expected at least {above_mdts} (pieces above MDTS)"
            ));
        }
        for &(at, n) in &PIECES {
            if dd_direct(&disk.block, base + at, n)? != pattern[at as usize..(at + n) as usize] {
                return Err(format!("the piece at +{at}, resubmitted after -EAGAIN, is not the DMA-BUF's bytes (dd)"));
            }
        }
        engine.buffer(id).map_err(e("buffer"))?.write_at(0, &vec![0u8; len]).map_err(e("clearing"))?;
        engine.execute_all(&requests(Op::Read)).map_err(e("READ_FIXED with NOWAIT first"))?;
        if engine.stats().resubmitted < after_writes + above_mdts {
            return Err(format!("reads: {} resubmitted in all, expected more", engine.stats().resubmitted));
        }
        let mut back = vec![0u8; len];
        engine.buffer(id).map_err(e("buffer"))?.read_at(0, &mut back).map_err(e("reading the DMA-BUF"))?;
        for &(at, n) in &PIECES {
            if back[at as usize..(at + n) as usize] != pattern[at as usize..(at + n) as usize] {
                return Err(format!("the piece at +{at} read back after -EAGAIN differs"));
            }
        }
        Ok(())
    })())
}

/// The series kernel: one DMA-BUF slot holds at most 1 GiB. A system-heap
/// DMA-BUF of 1 GiB + 4 KiB is refused by the engine before the kernel sees
/// it (and the kernel itself answers `EINVAL`); one of exactly 1 GiB is
/// installed and its last MiB written to the device, byte-exact.
fn one_gib(ctx: &Ctx) -> Outcome {
    outcome((|| {
        needs_series()?;
        let disk = ctx.disk(DiskRole::Raw)?;
        let gib = 1usize << 30;
        {
            let big = Buffer::dma_heap("system", gib + 4096).map_err(e("a 1 GiB + 4 KiB system-heap DMA-BUF"))?;
            // The kernel's own answer, on a bare ring.
            let file = open_direct(&disk.block)?;
            let ring = io_uring::IoUring::new(4).map_err(e("io_uring setup"))?;
            match install_dmabuf(&ring, big.dmabuf().ok_or("no DMA-BUF")?, &file) {
                Err(msg) if msg.contains("Invalid argument") => {}
                other => {
                    return Err(format!("the kernel installed a DMA-BUF over 1 GiB, or said otherwise: {other:?}"));
                }
            }
            let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
            let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
            match engine.register_dmabuf(big) {
                Err(err @ pdstor::io::IoError::DmabufTooLarge { .. }) => {
                    let msg = err.to_string();
                    if !msg.contains("1 GiB") || !msg.contains("nothing was installed") {
                        return Err(format!("the refusal does not say what to do: {msg}"));
                    }
                }
                other => return Err(format!("a DMA-BUF over 1 GiB was not refused: {:?}", other.map(|id| id.0))),
            }
        }
        let exact = Buffer::dma_heap("system", gib).map_err(e("a 1 GiB system-heap DMA-BUF"))?;
        let tail = pdstor::payload::chunk(0x1a1b, 0, CHUNK as usize);
        exact.write_at(gib as u64 - CHUNK, &tail).map_err(e("filling the last MiB"))?;
        let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
        let id = engine.register_dmabuf(exact).map_err(e("installing a DMA-BUF of exactly 1 GiB"))?;
        let at = 232 * CHUNK;
        let req = IoRequest {
            transfer: TransferId(0x7c00),
            op: Op::Write,
            path: PayloadPath::DmabufFixed,
            buffer: id,
            buffer_offset: pdstor::io::BufferOffset(gib as u64 - CHUNK),
            target_offset: pdstor::io::TargetOffset(at),
            len: CHUNK,
        };
        engine.execute_all(&[req]).map_err(e("WRITE_FIXED from the last MiB of a 1 GiB DMA-BUF"))?;
        if dd_direct(&disk.block, at, CHUNK)? != tail {
            return Err("the last MiB of the 1 GiB DMA-BUF did not reach the device (dd)".into());
        }
        Ok(())
    })())
}

/// The faulty namespace through `pdstor serve --provenance --require-native`
/// (reads fail from 4 MiB on, writes from 48 MiB on; `dmabuf_fixed` on the
/// series kernel, `host_fixed` of the same udmabuf on Debian's). A load over
/// failing blocks is an error, the reader's `fail` retains the publication
/// and its slots stay taken; publications are then stored until one reaches
/// the blocks that fail writes: that store is an error that says the request
/// was rolled back, and the publication is gone — it cannot be published and
/// never appears READY.
fn device_errors(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let path = if expects_rw_dmabuf() { PayloadPath::DmabufFixed } else { PayloadPath::HostFixed };
        let disk = ctx.disk(DiskRole::Faulty)?;
        let t = disk.block.to_string_lossy().into_owned();
        sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t])?;
        let daemon = serve_with(&disk.block, &["--provenance", "--require-native"])?;
        let client = Client::new(SERVER);
        let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
        let room = CHUNK as usize * CHUNKS as usize;
        let wbuf = Buffer::udmabuf("vmtest-faulty-w", room).map_err(e("writer buffer"))?;
        let payload: Vec<u8> =
            (0..CHUNKS as u64).flat_map(|i| pdstor::payload::chunk(0xbad, i, CHUNK as usize)).collect();
        wbuf.write_at(0, &payload).map_err(e("filling the writer buffer"))?;
        let wid = data.register_for(&wbuf, path).map_err(e("registering the writer buffer"))?;
        let chunks = |buffer| -> Vec<DataChunk> {
            (0..CHUNKS)
                .map(|i| DataChunk { index: i, buffer, offset: i as u64 * CHUNK, len: CHUNK, crc32c: None })
                .collect()
        };
        let state_of = |publication: u64| -> Result<Option<String>, String> {
            Ok(client
                .publications(None, false)
                .map_err(e("listing publications"))?
                .into_iter()
                .find(|p| p.publication == publication)
                .map(|p| p.state))
        };

        // A publication stored below 48 MiB whose chunks partly lie where reads fail.
        let p = client.prepare("faulty-read", &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
        data.store(p.publication, &p.writer_token, chunks(wid), true, CHUNKS).map_err(e("store below 48 MiB"))?;
        let published = client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
        let claim = client.claim(&published.receipt, "decode-0", "faulty", 60_000).map_err(e("claim"))?;
        let manifest =
            client.adopt(&pdstor::api::wire::AdoptRequest::of_claim(&claim, layout())).map_err(e("adopt"))?;
        if manifest.chunks.iter().all(|c| c.offset.0 < 4 << 20) {
            return Err("every chunk landed below 4 MiB: the read fault cannot be reached".into());
        }
        let rbuf = Buffer::udmabuf("vmtest-faulty-r", room).map_err(e("reader buffer"))?;
        let rid = data.register_for(&rbuf, path).map_err(e("registering the reader buffer"))?;
        let load = manifest
            .chunks
            .iter()
            .map(|c| DataChunk { index: c.index, buffer: rid, offset: c.index as u64 * CHUNK, len: 0, crc32c: None })
            .collect();
        match data.load(&claim, load) {
            Ok(r) => return Err(format!("a load over blocks that fail reads succeeded: {r:?}")),
            Err(err) => eprintln!("device_errors ({path}): load over failing blocks: {err}"),
        }
        client.fail(&claim, "device error on load").map_err(e("fail"))?;
        if state_of(claim.publication)?.as_deref() != Some("RETAINED") {
            return Err(format!("after the failed load: {:?}, expected RETAINED", state_of(claim.publication)?));
        }

        // Store publications until one reaches the blocks that fail writes.
        let mut failed = None;
        for n in 0..20 {
            let p = client.prepare(&format!("faulty-write-{n}"), &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
            match data.store(p.publication, &p.writer_token, chunks(wid), true, CHUNKS) {
                Ok(_) => {
                    client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
                }
                Err(err) => {
                    eprintln!("device_errors ({path}): store over failing blocks: {err}");
                    failed = Some((p, err.to_string()));
                    break;
                }
            }
        }
        let (p, err) = failed.ok_or("twenty publications stored without reaching the blocks that fail writes")?;
        if !err.contains("rolled back") || !err.contains(&format!("publication {}", p.publication)) {
            return Err(format!("the failed store does not say what became of publication {}: {err}", p.publication));
        }
        if client.publish(p.publication, &p.writer_token, Some(7)).is_ok() {
            return Err("a publication whose store failed was published".into());
        }
        if let Some(state) = state_of(p.publication)? {
            return Err(format!("a publication whose store failed and was rolled back is still listed, {state}"));
        }
        if state_of(claim.publication)?.as_deref() != Some("RETAINED") {
            return Err("the retained publication did not stay retained".into());
        }
        drop(daemon);
        Ok(())
    })())
}
