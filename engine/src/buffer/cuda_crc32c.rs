//! CRC-32C of GPU memory on the GPU (cargo feature `cuda`): the kernel of
//! `crc32c/gpu/kernel.cu`, its PTX compiled by the driver at first use,
//! with its tables uploaded once per buffer. The host half — the cut into
//! head, rows and tail, and the combination — is `crate::crc32c::gpu`.

use std::ffi::c_void;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::cuda_compare::{CompareError, drv, load};
use crate::crc32c::gpu::{KERNEL, PTX, Plan, TABLE_WORDS, THREADS, tables};

/// The loaded kernel and its device-side state, in one context.
pub(super) struct GpuCrc {
    module: sys::CUmodule,
    function: sys::CUfunction,
    tables: sys::CUdeviceptr,
    out: sys::CUdeviceptr,
}

impl GpuCrc {
    /// Loads the kernel and uploads its tables in the current context.
    pub(super) fn new() -> Result<GpuCrc, CompareError> {
        let (module, function) = load(PTX, KERNEL)?;
        let mut g = GpuCrc { module, function, tables: 0, out: 0 };
        let t = tables();
        // SAFETY: plain allocations in the current context, freed in Drop
        // (a zero pointer is never freed).
        g.tables = unsafe { cu::malloc_sync(TABLE_WORDS * 4) }.map_err(drv("cuMemAlloc (crc32c tables)"))?;
        // SAFETY: as above.
        g.out = unsafe { cu::malloc_sync(4) }.map_err(drv("cuMemAlloc (crc32c result)"))?;
        // SAFETY: `g.tables` holds TABLE_WORDS u32, as many as `t`.
        unsafe { cu::memcpy_htod_sync(g.tables, &t) }.map_err(drv("cuMemcpyHtoD (crc32c tables)"))?;
        Ok(g)
    }

    /// The raw CRC from zero of `plan.rows` 512-byte rows at device address
    /// `rows` (16-byte aligned, live memory of this context).
    pub(super) fn rows(&self, rows: sys::CUdeviceptr, plan: &Plan) -> Result<u32, CompareError> {
        // SAFETY: `out` is 4 bytes of live device memory.
        unsafe { cu::memset_d8_sync(self.out, 0, 4) }.map_err(drv("cuMemsetD8 (crc32c result)"))?;
        let (mut data, mut count, mut per_warp, mut t, mut out) =
            (rows, plan.rows, plan.rows_per_warp, self.tables, self.out);
        let mut params: [*mut c_void; 5] = [
            (&mut data as *mut u64).cast(),
            (&mut count as *mut u64).cast(),
            (&mut per_warp as *mut u64).cast(),
            (&mut t as *mut u64).cast(),
            (&mut out as *mut u64).cast(),
        ];
        // SAFETY: the kernel takes five u64 parameters, each pointed to by
        // `params` and alive until the synchronize below; `rows` holds
        // `plan.rows` rows (the caller's promise), `t` the tables, `out` 4 bytes.
        unsafe {
            cu::launch_kernel(self.function, (plan.blocks, 1, 1), (THREADS, 1, 1), 0, std::ptr::null_mut(), &mut params)
        }
        .map_err(drv("cuLaunchKernel(pdstor_crc32c_rows)"))?;
        cu::ctx::synchronize().map_err(drv("cuCtxSynchronize after the crc32c kernel"))?;
        let mut raw = [0u32; 1];
        // SAFETY: `out` holds one u32.
        unsafe { cu::memcpy_dtoh_sync(&mut raw, self.out) }.map_err(drv("cuMemcpyDtoH (crc32c result)"))?;
        Ok(raw[0])
    }
}

impl Drop for GpuCrc {
    fn drop(&mut self) {
        // SAFETY: each allocation was made in `new` (or is 0: never made) and
        // is freed once; the module is unloaded once, no kernel running (every
        // launch was synchronized).
        unsafe {
            for p in [self.tables, self.out] {
                if p != 0 {
                    let _ = cu::free_sync(p);
                }
            }
            let _ = cu::module::unload(self.module);
        }
    }
}
