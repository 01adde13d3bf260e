//! `dmabuf_fixed` judged by the probes: native verdicts, and the controls
//! (a CPU access during a transfer) that must be caught.

use std::os::fd::AsRawFd;
use std::path::Path;

use pdstor_engine::buffer::dmabuf::{Access, DmaBuf};
use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};
use pdstor_probes::{Declared, TargetClass, Verdict};

use crate::machine::Ctx;
use crate::suites::Checked;
use pdstor_vmtest_spec::DiskRole;

use super::*;

/// The series kernel, with the probes attached to this process: a
/// `dmabuf_fixed` write and read are `native` with DMA-token bios seen
/// (the hook on `bio_dmabuf_map_set`) and no CPU access. Controls: the same
/// exporter's memory on `host_fixed` is native `host_fixed` and, judged as
/// `dmabuf_fixed`, `not-dma-token`; a CPU access while a `dmabuf_fixed`
/// write is in flight is `fallback(dmabuf-cpu-access)`.
pub(super) fn dmabuf_fixed_probes(ctx: &Ctx) -> Checked {
    needs_series()?;
    let disk = ctx.disk(DiskRole::Raw)?;
    let probes = pdstor_probes::Probes::attach(std::process::id()).map_err(e("attaching the probes"))?;
    let reader = probes.reader().map_err(e("reading the probes"))?;
    let attached = reader.attached();
    if !attached.dmabuf_token || !attached.dmabuf_cpu {
        return Err(format!("the DMA-token or CPU-access kprobe did not attach: {attached:?}").into());
    }
    let judge = |t: u64, declared| -> Checked<(Verdict, pdstor_probes::Signals)> {
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
        buffer_offset: pdstor_engine::io::BufferOffset(0),
        target_offset: pdstor_engine::io::TargetOffset(176 * CHUNK),
        len: CHUNK,
    };
    engine.execute_all(&[req(0x7901, Op::Write, PayloadPath::DmabufFixed, fixed)]).map_err(e("dmabuf_fixed write"))?;
    engine.execute_all(&[req(0x7902, Op::Read, PayloadPath::DmabufFixed, fixed)]).map_err(e("dmabuf_fixed read"))?;
    engine.execute_all(&[req(0x7903, Op::Write, PayloadPath::HostFixed, host)]).map_err(e("host_fixed write"))?;
    for t in [0x7901u64, 0x7902] {
        let (v, s) = judge(t, Declared::DmabufFixed)?;
        // Both witnesses of the DMA-token path: the bio seen built on the
        // mapping, and the requests seen carrying it (BIO_DMABUF_MAP).
        if v != Verdict::Native || s.dmabuf_token_bios == 0 || s.dmabuf_token_rqs == 0 || s.dmabuf_cpu_access != 0 {
            return Err(format!("dmabuf_fixed transfer {t:#x}: {v} ({s:?})").into());
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
            return Err(
                format!("dmabuf_fixed transfer {t:#x}: the device did not get exactly the request: {s:?}").into()
            );
        }
    }
    let s = reader.signals(0x7903).map_err(e("signals"))?.ok_or("no signals for the host_fixed control")?;
    let as_host = pdstor_probes::judge(Declared::HostFixed, TargetClass::BlockDevice, &s, &attached);
    let as_fixed = pdstor_probes::judge(Declared::DmabufFixed, TargetClass::BlockDevice, &s, &attached);
    if as_host != Verdict::Native || as_fixed != Verdict::Fallback("not-dma-token".into()) || s.dmabuf_token_rqs != 0 {
        return Err(
            format!("the host path of a udmabuf: as host_fixed {as_host}, as dmabuf_fixed {as_fixed} ({s:?})").into()
        );
    }
    inflight_touch_fixed(&disk.block, &reader, &attached)
}

/// A `dmabuf_fixed` WRITE_FIXED on a ring whose completions run only when
/// this thread waits (DEFER_TASKRUN), with a SYNC-bracketed CPU access to the
/// DMA-BUF while it is in flight: judged `fallback(dmabuf-cpu-access)`.
pub(super) fn inflight_touch_fixed(
    device: &Path,
    reader: &pdstor_probes::SignalReader,
    attached: &pdstor_probes::Attached,
) -> Checked {
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
        return Err(format!("the control write returned {res}").into());
    }
    let s = reader.signals(transfer).map_err(e("signals"))?.ok_or("no signals for the control")?;
    let v = pdstor_probes::judge(Declared::DmabufFixed, TargetClass::BlockDevice, &s, attached);
    if v != Verdict::Fallback("dmabuf-cpu-access".into()) {
        return Err(format!("a CPU access during a dmabuf_fixed write was not seen: {v} ({s:?})").into());
    }
    Ok(())
}
