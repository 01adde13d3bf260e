//! The guest kernel's DMA-BUF exporters (udmabuf, the system DMA heap) and
//! the capability probe, and the `dma_buf_begin_cpu_access` kprobe: it sees
//! a CPU access a control makes, and none inside a fixed transfer.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use pdstor_engine::buffer::dmabuf::{Access, DmaBuf};
use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};
use pdstor_probes::{Declared, TargetClass, Verdict};

use crate::machine::{Ctx, expects_rw_dmabuf, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::DiskRole;

use super::*;

pub(super) fn exporters_and_probe(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let info = sh("/bin/pdstor", &["info", "--target", &disk.block.to_string_lossy()])?;
    let v: serde_json::Value = serde_json::from_str(&info).map_err(e("parsing pdstor info"))?;
    if v["dmabuf_exporters"]["udmabuf"] != true {
        return Err(format!("the guest kernel has udmabuf built in, but pdstor info says: {info}").into());
    }
    if !v["dmabuf_exporters"]["dma_heaps"].as_array().is_some_and(|h| h.iter().any(|x| x == "system")) {
        return Err(format!("no system DMA heap reported: {info}").into());
    }
    let rw = &v["dmabuf_rw"];
    if expects_rw_dmabuf() {
        // The series kernel: the probe must find the UAPI.
        if rw["state"] != "available" {
            return Err(format!("the guest runs the rw-dmabuf series, but the probe says: {rw}").into());
        }
    } else if rw["state"] != "missing" || !rw["detail"].as_str().is_some_and(|d| d.contains("EINVAL")) {
        // Debian's 6.12 has no rw-dmabuf series: the probe must say so, and why.
        return Err(format!("the rw-dmabuf probe should report the UAPI missing (EINVAL): {rw}").into());
    }
    Ok(())
}

/// In-process, with the probes attached to this test process: a `host_fixed`
/// write and read through a udmabuf's memfd mapping are `native` with no CPU
/// access charged, although the test touches the buffer (SYNC-bracketed)
/// before and after each transfer. Control: a CPU access made while a
/// hand-submitted write is in flight is charged to it and judged
/// `fallback(dmabuf-cpu-access)`.
pub(super) fn cpu_access(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let probes = pdstor_probes::Probes::attach(std::process::id()).map_err(e("attaching the probes"))?;
    let reader = probes.reader().map_err(e("reading the probes"))?;
    let attached = reader.attached();
    if !attached.dmabuf_cpu {
        return Err("no hook on dma_buf_begin_cpu_access attached in the guest".into());
    }
    let buf = Buffer::udmabuf("vmtest-cpu", 2 * CHUNK as usize).map_err(e("creating a udmabuf"))?;
    let pattern = pdstor_engine::payload::chunk(0xd0a, 1, CHUNK as usize);
    buf.write_at(0, &pattern).map_err(e("filling the udmabuf"))?;
    let before = pdstor_engine::buffer::dmabuf::cpu_accesses();
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
            target_offset: pdstor_engine::io::TargetOffset(64 * CHUNK),
            len: CHUNK,
        };
        engine.execute_all(&[req(0x7701, Op::Write, pdstor_engine::io::BufferOffset(0))]).map_err(e("fixed write"))?;
        engine
            .execute_all(&[req(0x7702, Op::Read, pdstor_engine::io::BufferOffset(CHUNK))])
            .map_err(e("fixed read"))?;
        let mut back = vec![0u8; CHUNK as usize];
        engine.buffer(id).map_err(e("buffer"))?.read_at(CHUNK, &mut back).map_err(e("reading back"))?;
        if let Some(at) = pdstor_engine::payload::first_difference(&pattern, &back) {
            return Err(format!("the udmabuf read back differs at byte {at}").into());
        }
        for t in [0x7701u64, 0x7702] {
            let s = reader.signals(t).map_err(e("signals"))?.ok_or(format!("no signals for {t:#x}"))?;
            if s.dmabuf_cpu_access != 0 {
                return Err(format!("transfer {t:#x} was charged {} CPU accesses: {s:?}", s.dmabuf_cpu_access).into());
            }
            let v = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
            if v != Verdict::Native {
                return Err(format!("transfer {t:#x}: {v} ({s:?})").into());
            }
        }
    }
    let touched = pdstor_engine::buffer::dmabuf::cpu_accesses() - before;
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
    let ctl =
        DmaBuf::import(region.dmabuf().ok_or("no DMA-BUF")?.try_clone_fd().map_err(e("dup of the control DMA-BUF"))?)
            .map_err(e("importing the control dup"))?;
    let transfer = 0x7703u64;
    let res = inflight_touch(&file, &region, &ctl, transfer << 16)?;
    if res != CHUNK as i32 {
        return Err(format!("the control write returned {res}").into());
    }
    let s = reader.signals(transfer).map_err(e("signals"))?.ok_or("no signals for the control")?;
    let v = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
    if s.dmabuf_cpu_access == 0 || v != Verdict::Fallback("dmabuf-cpu-access".into()) {
        return Err(format!("a CPU access during the control transfer was not seen: {v} ({s:?})").into());
    }
    Ok(())
}

/// Submits one WRITE_FIXED of `region`'s first MiB on a ring whose completions
/// run only when this thread waits (DEFER_TASKRUN), touches the DMA-BUF with a
/// SYNC-bracketed access while the write is in flight, then waits.
pub(super) fn inflight_touch(file: &std::fs::File, region: &Buffer, ctl: &DmaBuf, user_data: u64) -> Checked<i32> {
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
