//! `dmabuf_fixed` in the engine: bytes moved at every offset, another file
//! refused EBADF, EAGAIN resubmitted, the 1 GiB limit, and on Debian's kernel
//! the capability error with nothing written.

use std::os::fd::AsRawFd;
use std::path::Path;

use pdstor_client::{Client, ClientError, DataConn};
use pdstor_engine::buffer::dmabuf::DmaBuf;
use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use crate::machine::{Ctx, expects_rw_dmabuf, sh};
use crate::suites::io::{dd_direct, nvme_read};
use crate::suites::protocol::{SERVER, SOCKET, serve_with};
use crate::suites::{Checked, skip};
use pdstor_vmtest_spec::DiskRole;

use super::*;

/// The series kernel: udmabuf and system-heap DMA-BUFs registered for
/// `dmabuf_fixed` move real bytes between the client's DMA-BUF and the raw
/// NVMe namespace through `pdstor serve --provenance --require-native`:
/// every chunk judged native, read back with `dd iflag=direct`, and loaded
/// into a cleared DMA-BUF of each exporter, at the buffer's start and 12 KiB
/// into it.
pub(super) fn dmabuf_fixed_moves_bytes(ctx: &Ctx) -> Checked {
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
}

/// Pieces of a 4 MiB DMA-BUF (offset, length), apart from each other, most
/// not at its start: `dmabuf_fixed` addresses bytes inside the DMA-BUF.
pub(super) const PIECES: [(u64, u64); 4] =
    [(0, 256 << 10), (268 << 10, 1 << 20), ((1 << 20) + (516 << 10), 512 << 10), (3 << 20, 1 << 20)];

/// One `dmabuf_fixed` request per piece of [`PIECES`]: DMA-BUF offset `at`
/// to target offset `base + at`, transfers numbered from `first`.
pub(super) fn pieces(op: Op, id: pdstor_engine::io::BufferId, base: u64, first: u64) -> Vec<IoRequest> {
    PIECES
        .iter()
        .enumerate()
        .map(|(i, &(at, n))| IoRequest {
            transfer: TransferId(first + i as u64),
            op,
            path: PayloadPath::DmabufFixed,
            buffer: id,
            buffer_offset: pdstor_engine::io::BufferOffset(at),
            target_offset: pdstor_engine::io::TargetOffset(base + at),
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
pub(super) fn dmabuf_fixed_engine(ctx: &Ctx) -> Checked {
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
            (0..4).flat_map(|i| pdstor_engine::payload::chunk(0xf1 + n as u64, i, CHUNK as usize)).collect();
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
            if pdstor_engine::payload::first_difference(want, &dd_direct(&disk.block, base + at, n)?).is_some() {
                return Err(
                    format!("{exporter}: the piece at +{at} on the device (dd) is not the DMA-BUF's bytes").into()
                );
            }
            let by_nvme = nvme_read(&disk.generic, base + at, n, 4096, 512 << 10)?;
            if pdstor_engine::payload::first_difference(want, &by_nvme).is_some() {
                return Err(
                    format!("{exporter}: the piece at +{at} read by `nvme read` is not the DMA-BUF's bytes").into()
                );
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
        if let Some(at) = pdstor_engine::payload::first_difference(&want, &back) {
            return Err(format!("{exporter}: the DMA-BUF read back differs at byte {at} (pieces, zero gaps)").into());
        }
    }
    another_file_is_ebadf(&disk.block)
}

/// Installs `dmabuf` in slot 0 of `ring`'s (sparse) buffer table for
/// `target` with `IORING_RSRC_UPDATE_EXTENDED`, as the engine does.
pub(super) fn install_dmabuf(ring: &io_uring::IoUring, dmabuf: &DmaBuf, target: &std::fs::File) -> Checked {
    use pdstor_engine::buffer::dmabuf::uapi;
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
        return Err(format!("installing the DMA-BUF answered {ret}: {}", std::io::Error::last_os_error()).into());
    }
    Ok(())
}

/// A DMA-BUF installed for one open file of the raw namespace, used on
/// another open file of the same device: `EBADF`; on its own file: done.
pub(super) fn another_file_is_ebadf(device: &Path) -> Checked {
    use io_uring::{IoUring, opcode, types};
    let (mine, other) = (open_direct(device)?, open_direct(device)?);
    let region = Buffer::udmabuf("vmtest-ebadf", CHUNK as usize).map_err(e("udmabuf"))?;
    let mut ring = IoUring::new(4).map_err(e("io_uring setup"))?;
    install_dmabuf(&ring, region.dmabuf().ok_or("no DMA-BUF")?, &mine)?;
    let mut read_on = |file: &std::fs::File| -> Checked<i32> {
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
        return Err(format!("READ_FIXED of a DMA-BUF on another file answered {on_other}, not -EBADF").into());
    }
    let on_mine = read_on(&mine)?;
    if on_mine != 4096 {
        return Err(format!("READ_FIXED of a DMA-BUF on its own file answered {on_mine}, not 4096").into());
    }
    Ok(())
}

pub(super) fn dmabuf_fixed_refused(ctx: &Ctx) -> Checked {
    if expects_rw_dmabuf() {
        return Err(skip("this kernel has the rw-dmabuf series: dmabuf_fixed is not refused here"));
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
                return Err(
                    format!("{exporter}: dmabuf_fixed on a stock kernel answered {:?}", other.map(|_| ())).into()
                );
            }
        }
    }
    let after = device_crc(&disk.block)?;
    let pubs = Client::new(SERVER).publications(None, false).map_err(e("publications"))?;
    if before != after || !pubs.is_empty() {
        return Err(format!(
            "the refusal changed the target (crc {before:#x} → {after:#x}) or left publications {pubs:?}"
        )
        .into());
    }
    drop(daemon);
    Ok(())
}

/// The series kernel: `-EAGAIN` on the DMA-BUF path is real and resubmitted.
/// A `WRITE_FIXED` with `RWF_NOWAIT` larger than the device's MDTS (512 KiB
/// here) must be split, which the block layer refuses for a NOWAIT bio: the
/// kernel answers `-EAGAIN`, and the same SQE without NOWAIT moves the bytes.
/// Then the engine with `nowait_first` over the pieces of a DMA-BUF: every
/// piece above MDTS comes back `-EAGAIN` and is resubmitted (counted), every
/// byte checked with `dd` and read back into the cleared DMA-BUF.
pub(super) fn eagain(ctx: &Ctx) -> Checked {
    use io_uring::{IoUring, opcode, types};
    needs_series()?;
    let disk = ctx.disk(DiskRole::Raw)?;
    let file = open_direct(&disk.block)?;
    let region = Buffer::udmabuf("vmtest-eagain", CHUNK as usize).map_err(e("udmabuf"))?;
    let pattern = pdstor_engine::payload::chunk(0xea, 0, CHUNK as usize);
    region.write_at(0, &pattern).map_err(e("filling the udmabuf"))?;
    let mut ring = IoUring::new(4).map_err(e("io_uring setup"))?;
    install_dmabuf(&ring, region.dmabuf().ok_or("no DMA-BUF")?, &file)?;
    let at = 208 * CHUNK;
    let mut write = |flags: i32| -> Checked<i32> {
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
        return Err(format!("the first WRITE_FIXED answered {first}").into());
    }
    let nowait = write(libc::RWF_NOWAIT)?;
    if nowait != -libc::EAGAIN {
        return Err(format!("a NOWAIT 1 MiB WRITE_FIXED above MDTS answered {nowait}, not -EAGAIN").into());
    }
    let again = write(0)?;
    if again != CHUNK as i32 || dd_direct(&disk.block, at, CHUNK)? != pattern {
        return Err(format!("the resubmitted WRITE_FIXED answered {again} or left other bytes on the device").into());
    }

    let len = 4 * CHUNK as usize;
    let buf = Buffer::udmabuf("vmtest-eagain-engine", len).map_err(e("udmabuf"))?;
    let pattern: Vec<u8> = (0..4).flat_map(|i| pdstor_engine::payload::chunk(0xeb, i, CHUNK as usize)).collect();
    buf.write_at(0, &pattern).map_err(e("filling the DMA-BUF"))?;
    let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
    let mut engine = Engine::new(t, EngineOptions { nowait_first: true, ..Default::default() }).map_err(e("engine"))?;
    let id = engine.register_dmabuf(buf).map_err(e("installing the DMA-BUF"))?;
    let base = 216 * CHUNK;
    let requests = |op| pieces(op, id, base, 0x7b00);
    // The mapping first (its request runs blocking in an io-wq worker).
    let warm = IoRequest {
        transfer: TransferId(0x7aff),
        op: Op::Read,
        path: PayloadPath::DmabufFixed,
        buffer: id,
        buffer_offset: pdstor_engine::io::BufferOffset(0),
        target_offset: pdstor_engine::io::TargetOffset(base),
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
        ).into());
    }
    for &(at, n) in &PIECES {
        if dd_direct(&disk.block, base + at, n)? != pattern[at as usize..(at + n) as usize] {
            return Err(
                format!("the piece at +{at}, resubmitted after -EAGAIN, is not the DMA-BUF's bytes (dd)").into()
            );
        }
    }
    engine.buffer(id).map_err(e("buffer"))?.write_at(0, &vec![0u8; len]).map_err(e("clearing"))?;
    engine.execute_all(&requests(Op::Read)).map_err(e("READ_FIXED with NOWAIT first"))?;
    if engine.stats().resubmitted < after_writes + above_mdts {
        return Err(format!("reads: {} resubmitted in all, expected more", engine.stats().resubmitted).into());
    }
    let mut back = vec![0u8; len];
    engine.buffer(id).map_err(e("buffer"))?.read_at(0, &mut back).map_err(e("reading the DMA-BUF"))?;
    for &(at, n) in &PIECES {
        if back[at as usize..(at + n) as usize] != pattern[at as usize..(at + n) as usize] {
            return Err(format!("the piece at +{at} read back after -EAGAIN differs").into());
        }
    }
    Ok(())
}

/// The series kernel: one DMA-BUF slot holds at most 1 GiB. A system-heap
/// DMA-BUF of 1 GiB + 4 KiB is refused by the engine before the kernel sees
/// it (and the kernel itself answers `EINVAL`); one of exactly 1 GiB is
/// installed and its last MiB written to the device, byte-exact.
pub(super) fn one_gib(ctx: &Ctx) -> Checked {
    needs_series()?;
    let disk = ctx.disk(DiskRole::Raw)?;
    let gib = 1usize << 30;
    {
        let big = Buffer::dma_heap("system", gib + 4096).map_err(e("a 1 GiB + 4 KiB system-heap DMA-BUF"))?;
        // The kernel's own answer, on a bare ring.
        let file = open_direct(&disk.block)?;
        let ring = io_uring::IoUring::new(4).map_err(e("io_uring setup"))?;
        match install_dmabuf(&ring, big.dmabuf().ok_or("no DMA-BUF")?, &file) {
            Err(msg) if msg.to_string().contains("Invalid argument") => {}
            other => {
                return Err(format!("the kernel installed a DMA-BUF over 1 GiB, or said otherwise: {other:?}").into());
            }
        }
        let t = Target::open(&disk.block, &TargetOptions::default()).map_err(e("opening the raw namespace"))?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(e("engine"))?;
        match engine.register_dmabuf(big) {
            Err(err @ pdstor_engine::io::IoError::DmabufTooLarge { .. }) => {
                let msg = err.to_string();
                if !msg.contains("1 GiB") || !msg.contains("nothing was installed") {
                    return Err(format!("the refusal does not say what to do: {msg}").into());
                }
            }
            other => return Err(format!("a DMA-BUF over 1 GiB was not refused: {:?}", other.map(|id| id.0)).into()),
        }
    }
    let exact = Buffer::dma_heap("system", gib).map_err(e("a 1 GiB system-heap DMA-BUF"))?;
    let tail = pdstor_engine::payload::chunk(0x1a1b, 0, CHUNK as usize);
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
        buffer_offset: pdstor_engine::io::BufferOffset(gib as u64 - CHUNK),
        target_offset: pdstor_engine::io::TargetOffset(at),
        len: CHUNK,
    };
    engine.execute_all(&[req]).map_err(e("WRITE_FIXED from the last MiB of a 1 GiB DMA-BUF"))?;
    if dd_direct(&disk.block, at, CHUNK)? != tail {
        return Err("the last MiB of the 1 GiB DMA-BUF did not reach the device (dd)".into());
    }
    Ok(())
}
