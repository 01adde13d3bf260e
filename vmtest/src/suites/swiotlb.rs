//! `swiotlb`: a guest booted with `swiotlb=force` bounces every streaming DMA
//! through the software IOTLB. The probes must catch it: a `host_fixed` write
//! to the raw NVMe device is `fallback(swiotlb-bounce)`, never `native`. Run it
//! with `cargo xtask vmtest --suite swiotlb --append swiotlb=force`; in a
//! normal boot it says SKIP.

use pdstor::PayloadPath;
use pdstor_probes::{TargetClass, Verdict};

use super::probes::{expect, fixed_write_verdict};
use super::{Suite, Test, outcome};
use crate::guest::Ctx;
use crate::{DiskRole, Outcome};

pub const SUITE: Suite = Suite {
    name: "swiotlb",
    tests: &[Test { name: "forced_swiotlb_is_a_fallback", disk: Some(DiskRole::Raw), run: forced }],
};

fn forced(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let cmdline = std::fs::read_to_string("/proc/cmdline").map_err(|e| e.to_string())?;
        if !cmdline.split_whitespace().any(|a| a == "swiotlb=force") {
            return Err("SKIP: this guest was not booted with swiotlb=force (use --append swiotlb=force)".into());
        }
        let dev = ctx.disk(DiskRole::Raw)?.block.clone();
        let v = fixed_write_verdict(&dev, None, TargetClass::BlockDevice, PayloadPath::HostFixed, 601)?;
        expect(v, Verdict::Fallback("swiotlb-bounce".into()))
    })())
}
