//! `swiotlb`: a guest booted with `swiotlb=force` bounces every streaming DMA
//! through the software IOTLB. The probes must catch it: a `host_fixed` write
//! to the raw NVMe device is `fallback(swiotlb-bounce)`, never `native`; on
//! the rw-dmabuf series kernel, so is every `dmabuf_fixed` transfer on a
//! DMA-BUF whose device mapping swiotlb bounced when the series made it —
//! including the transfers after the first, which bounce nothing themselves.
//! Run it with `cargo xtask vmtest --suite swiotlb --append swiotlb=force`
//! (and `--kernel-series DIR`); in a normal boot it says SKIP.

use pdstor_engine::io::{
    BufferOffset, Engine, EngineOptions, IoRequest, Op, Target, TargetOffset, TargetOptions, TransferId,
};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};
use pdstor_probes::{Declared, TargetClass, Verdict};

use super::probes::{expect, fixed_write_verdict};
use super::{Checked, Suite, Test, skip};
use crate::machine::{Ctx, expects_rw_dmabuf};
use pdstor_vmtest_spec::DiskRole;

pub const SUITE: Suite = Suite {
    name: "swiotlb",
    tests: &[
        Test { name: "forced_swiotlb_is_a_fallback", disk: Some(DiskRole::Raw), run: forced },
        Test { name: "forced_swiotlb_dmabuf_fixed_is_a_fallback", disk: Some(DiskRole::Raw), run: forced_dmabuf },
    ],
};

fn swiotlb_forced() -> Checked {
    let cmdline = std::fs::read_to_string("/proc/cmdline").map_err(|e| e.to_string())?;
    if !cmdline.split_whitespace().any(|a| a == "swiotlb=force") {
        return Err(skip("this guest was not booted with swiotlb=force (use --append swiotlb=force)"));
    }
    Ok(())
}

fn forced(ctx: &Ctx) -> Checked {
    swiotlb_forced()?;
    let dev = ctx.disk(DiskRole::Raw)?.block.clone();
    let v = fixed_write_verdict(&dev, None, TargetClass::BlockDevice, PayloadPath::HostFixed, 601)?;
    expect(v, Verdict::Fallback("swiotlb-bounce".into()))
}

const CHUNK: u64 = 1 << 20;

/// Three `dmabuf_fixed` writes from one udmabuf: the first makes the device
/// mapping (bounced inside it), the next two only use it. All three are
/// `fallback(swiotlb-bounce)`; the later ones by the mapping-time evidence
/// (`dmabuf_bounced_bios`), with no bounce of their own. The buffer's
/// contents do not matter here, and cannot be set: under `swiotlb=force` the
/// udmabuf's own CPU-access sync (`DMA_BUF_IOCTL_SYNC`) fails with EIO.
fn forced_dmabuf(ctx: &Ctx) -> Checked {
    swiotlb_forced()?;
    if !expects_rw_dmabuf() {
        return Err(skip("Debian's kernel has no rw-dmabuf series (vmtest --kernel-series runs this)"));
    }
    let dev = ctx.disk(DiskRole::Raw)?.block.clone();
    let probes = pdstor_probes::Probes::attach(std::process::id()).map_err(|e| format!("probes: {e}"))?;
    let reader = probes.reader().map_err(|e| format!("reading the probes: {e}"))?;
    let attached = reader.attached();
    if !attached.dmabuf_map || !attached.swiotlb {
        return Err(format!("the DMA-BUF mapping or swiotlb kprobes did not attach: {attached:?}").into());
    }
    let mut report = Vec::new();
    let mut moved = 0;
    for (n, len) in [128u64 << 10, CHUNK].into_iter().enumerate() {
        let t = Target::open(&dev, &TargetOptions::default()).map_err(|e| format!("opening {}: {e}", dev.display()))?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(|e| format!("engine: {e}"))?;
        let buf = Buffer::udmabuf("vmtest-swiotlb", len as usize).map_err(|e| format!("udmabuf: {e}"))?;
        let id = engine.register_dmabuf(buf).map_err(|e| format!("installing the DMA-BUF: {e}"))?;
        for i in 0..3u64 {
            let transfer = 0x7a00 + 0x10 * n as u64 + i;
            let req = IoRequest {
                transfer: TransferId(transfer),
                op: Op::Write,
                path: PayloadPath::DmabufFixed,
                buffer: id,
                buffer_offset: BufferOffset(0),
                target_offset: TargetOffset((200 + 4 * n as u64 + i) * CHUNK),
                len,
            };
            let result = engine.execute_all(&[req]);
            let s =
                reader.signals(transfer).map_err(|e| e.to_string())?.ok_or(format!("no signals for {transfer:#x}"))?;
            let v = pdstor_probes::judge(Declared::DmabufFixed, TargetClass::BlockDevice, &s, &attached);
            report.push(format!(
                "{} KiB write {i}: {} ({v}; {} bounce(s) of its own, {} bio(s) on a bounced mapping)",
                len >> 10,
                result.as_ref().map_or_else(|e| format!("failed: {e}"), |b| format!("{b} bytes")),
                s.swiotlb_bounces,
                s.dmabuf_bounced_bios
            ));
            if result.is_err() {
                continue;
            }
            moved += 1;
            if v != Verdict::Fallback("swiotlb-bounce".into()) {
                return Err(format!(
                    "a dmabuf_fixed write under swiotlb=force moved its bytes and was judged {v}: {report:?}"
                )
                .into());
            }
            if i > 0 && (s.swiotlb_bounces != 0 || s.dmabuf_bounced_bios == 0) {
                return Err(format!(
                    "a write reusing the bounced mapping: expected no bounce of its own and bounced-mapping bios: {report:?}"
                ).into());
            }
        }
    }
    eprintln!("swiotlb=force, dmabuf_fixed: {}", report.join("; "));
    if moved == 0 {
        return Err(format!(
            "no dmabuf_fixed write under swiotlb=force moved bytes, so the mapping-time evidence was not exercised: {report:?}"
        ).into());
    }
    Ok(())
}
