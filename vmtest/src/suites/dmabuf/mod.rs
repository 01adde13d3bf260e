//! `dmabuf`: DMA-BUF buffers from the guest kernel's own exporters (udmabuf
//! and the system DMA heap), handed to `pdstor serve` over the data plane,
//! stored to and loaded from the raw NVMe block device and a file on XFS, and
//! read back independently with `dd iflag=direct`. On Debian's kernel
//! `dmabuf_fixed` must fail with the capability error and write nothing; on
//! a kernel with the rw-dmabuf series (`vmtest --kernel-series`) it must be
//! available, and the tests that expect a refusal say SKIP. The
//! `dma_buf_begin_cpu_access` kprobe must see no CPU access to a DMA-BUF during
//! a fixed-path transfer, and must see one that a control makes on purpose.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use pdstor_client::layout::Layout;

use crate::machine::{expects_rw_dmabuf, sh};
use crate::suites::io::dd_direct;
use crate::suites::protocol::serve_with;
use crate::suites::{Checked, Suite, Test, skip};
use pdstor_vmtest_spec::DiskRole;

mod errors;
mod exporters;
mod fixed;
mod handoff;
mod probes;

use errors::*;
use exporters::*;
use fixed::*;
use handoff::*;
use probes::*;

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
fn needs_series() -> Checked {
    if !expects_rw_dmabuf() {
        return Err(skip("Debian's kernel has no rw-dmabuf series (vmtest --kernel-series runs this)"));
    }
    Ok(())
}

fn e<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err}")
}

fn layout() -> Layout {
    crate::suites::test_layout("vmtest-dmabuf")
}

/// crc32c of the device's first 64 MiB (superblock, journal and the first
/// slots, where a store would land), read with O_DIRECT outside the daemon.
fn device_crc(path: &Path) -> Checked<u32> {
    let len = 64 << 20;
    Ok(crc32c::crc32c(&dd_direct(path, 0, len)?))
}

/// A fresh namespace (1 MiB slots) on `device`, served.
fn fresh_daemon(device: &Path) -> Checked<crate::suites::protocol::Daemon> {
    let t = device.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t])?;
    serve_with(device, &[])
}

fn open_direct(device: &Path) -> Checked<std::fs::File> {
    Ok(std::fs::File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(device)
        .map_err(e("opening the raw namespace"))?)
}
