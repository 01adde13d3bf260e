//! CUDA device memory exported as a DMA-BUF (cargo feature `cuda`).
//!
//! `cudarc` loads `libcuda.so` at run time, so building needs no CUDA toolkit
//! and a machine without a GPU gets [`CudaError::Unavailable`] with the
//! reason, never a panic. Any GPU allocates, copies and compares; the export
//! follows NVIDIA's rules: the device must report
//! `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (open kernel modules), or
//! [`CudaBuffer::export_dmabuf`] refuses with [`CudaError::NoDmaBuf`], and
//! `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` takes a
//! page-aligned range, so allocations are rounded up to 2 MiB.
//!
//! [`CudaBuffer::first_difference`] compares on the GPU itself (a PTX kernel
//! the driver compiles at run time), so a restore into GPU memory is checked
//! where it landed, not after another copy to the host.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::dmabuf::{DmaBuf, DmaBufError};

/// CUDA allocations are rounded to this (the GPU's large-page size), which
/// also keeps exported ranges page-aligned.
pub const CUDA_ALIGN: usize = 2 << 20;

/// What a CUDA allocation or export failed on.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver or device.
    #[error("no CUDA device: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA {what} failed: {source:?}")]
    Driver {
        /// The call.
        what: &'static str,
        /// The driver's error.
        source: cu::DriverError,
    },
    /// The GPU cannot export DMA-BUFs.
    #[error(
        "GPU {name} does not support DMA-BUF export (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0): it needs NVIDIA's open kernel modules and a kernel with CONFIG_DMA_SHARED_BUFFER"
    )]
    NoDmaBuf {
        /// The GPU.
        name: String,
    },
    /// A range outside the buffer.
    #[error("range {offset}..{end} is outside the {len}-byte CUDA buffer", end = offset + *count as u64)]
    OutOfBounds {
        /// Where it starts.
        offset: u64,
        /// Its length.
        count: usize,
        /// The buffer's length.
        len: usize,
    },
    /// The compare on the GPU failed.
    #[error(transparent)]
    Compare(#[from] super::cuda_compare::CompareError),
    /// Exporting the allocation as a DMA-BUF failed.
    #[error(transparent)]
    DmaBuf(#[from] DmaBufError),
}

fn drv(what: &'static str) -> impl FnOnce(cu::DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// What `gpu-qual` reports about the GPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    /// The device ordinal.
    pub ordinal: i32,
    /// Its name.
    pub name: String,
    /// Its memory, in bytes.
    pub total_memory: usize,
    /// Its compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// The driver API version.
    pub driver_api_version: i32,
    /// Whether it can export DMA-BUFs.
    pub dmabuf_supported: bool,
}

/// Loads the driver, initialises it and describes device `ordinal`.
pub fn device_info(ordinal: i32) -> Result<DeviceInfo, CudaError> {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made if it fails.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::Unavailable("libcuda.so is not installed (no NVIDIA driver)".into()));
    }
    cu::init().map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e:?}")))?;
    let count = cu::device::get_count().map_err(drv("cuDeviceGetCount"))?;
    if ordinal >= count {
        return Err(CudaError::Unavailable(format!("device {ordinal} requested, {count} present")));
    }
    let dev = cu::device::get(ordinal).map_err(drv("cuDeviceGet"))?;
    let attr = |a| {
        // SAFETY: `dev` came from cuDeviceGet.
        unsafe { cu::device::get_attribute(dev, a) }.map_err(drv("cuDeviceGetAttribute"))
    };
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result().map_err(drv("cuDriverGetVersion"))?;
    Ok(DeviceInfo {
        ordinal,
        name: cu::device::get_name(dev).map_err(drv("cuDeviceGetName"))?,
        // SAFETY: `dev` came from cuDeviceGet.
        total_memory: unsafe { cu::device::total_mem(dev) }.map_err(drv("cuDeviceTotalMem"))?,
        compute_capability: (
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        driver_api_version: version,
        dmabuf_supported: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? != 0,
    })
}

/// Device memory on one GPU, in the device's primary context, which
/// [`CudaBuffer::alloc`] makes current on the calling thread: the buffer
/// stays on that thread (neither `Send` nor `Sync`).
pub struct CudaBuffer {
    dev: sys::CUdevice,
    /// The device's primary context, retained in `alloc`, released in Drop.
    ctx: sys::CUcontext,
    ptr: sys::CUdeviceptr,
    len: usize,
    info: DeviceInfo,
    /// The CRC-32C kernel, loaded at the first [`CudaBuffer::crc32c`].
    crc: std::cell::RefCell<Option<super::cuda_crc32c::GpuCrc>>,
    _thread: std::marker::PhantomData<*const ()>,
}

impl CudaBuffer {
    /// Allocates at least `len` bytes (rounded up to [`CUDA_ALIGN`]) on GPU
    /// `ordinal`. A GPU that cannot export DMA-BUFs allocates all the same
    /// (the host paths stage through host memory); its export is refused.
    pub fn alloc(ordinal: i32, len: usize) -> Result<CudaBuffer, CudaError> {
        let info = device_info(ordinal)?;
        let dev = cu::device::get(ordinal).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `dev` came from cuDeviceGet; the context is released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` is the live primary context just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let len = len.max(1).next_multiple_of(CUDA_ALIGN);
        // SAFETY: a plain allocation in the current context, freed in Drop.
        let ptr = unsafe { cu::malloc_sync(len) }.map_err(drv("cuMemAlloc"))?;
        Ok(CudaBuffer { dev, ctx, ptr, len, info, crc: Default::default(), _thread: std::marker::PhantomData })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is 0 bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it lives on.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn check(&self, offset: u64, count: usize) -> Result<(), CudaError> {
        if offset.checked_add(count as u64).is_none_or(|end| end > self.len as u64) {
            return Err(CudaError::OutOfBounds { offset, count, len: self.len });
        }
        Ok(())
    }

    /// Copies `src` from host memory into the GPU buffer at `offset`; the
    /// bytes are in device memory when it returns (a copy from pageable
    /// memory may return once staged, so the context is synchronized: a
    /// device that reads the memory next, an NVMe by DMA-BUF, sees them).
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        // SAFETY: the destination range was bounds-checked against the allocation.
        unsafe { cu::memcpy_htod_sync(self.ptr + offset, src) }.map_err(drv("cuMemcpyHtoD"))?;
        cu::ctx::synchronize().map_err(drv("cuCtxSynchronize after cuMemcpyHtoD"))
    }

    /// Copies `dst.len()` bytes at `offset` out of the GPU buffer.
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(offset, dst.len())?;
        // SAFETY: the source range was bounds-checked against the allocation.
        unsafe { cu::memcpy_dtoh_sync(dst, self.ptr + offset) }.map_err(drv("cuMemcpyDtoH"))
    }

    /// Copies `len` bytes at `offset` of the GPU buffer into host memory at
    /// `dst` (a registered staging buffer's mapping, say).
    ///
    /// # Safety
    ///
    /// `dst..dst+len` must be writable host memory that nothing else reads or
    /// writes during the call.
    pub unsafe fn copy_to_host_ptr(&self, offset: u64, dst: *mut u8, len: usize) -> Result<(), CudaError> {
        self.check(offset, len)?;
        // SAFETY: the source range was bounds-checked; the caller vouches for `dst`.
        unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), self.ptr + offset, len) }.result().map_err(drv("cuMemcpyDtoH"))
    }

    /// Copies `len` bytes of host memory at `src` into the GPU buffer at `offset`.
    ///
    /// # Safety
    ///
    /// `src..src+len` must be readable host memory that nothing writes during the call.
    pub unsafe fn copy_from_host_ptr(&self, offset: u64, src: *const u8, len: usize) -> Result<(), CudaError> {
        self.check(offset, len)?;
        // SAFETY: the destination range was bounds-checked; the caller vouches for `src`.
        unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset, src.cast(), len) }.result().map_err(drv("cuMemcpyHtoD"))?;
        cu::ctx::synchronize().map_err(drv("cuCtxSynchronize after cuMemcpyHtoD"))
    }

    /// Sets every byte of the buffer to `value` (on the GPU).
    pub fn fill_bytes(&self, value: u8) -> Result<(), CudaError> {
        // SAFETY: the whole allocation, which this buffer owns.
        unsafe { cu::memset_d8_sync(self.ptr, value, self.len) }.map_err(drv("cuMemsetD8"))?;
        // cuMemsetD8 may return before the memory is set.
        cu::ctx::synchronize().map_err(drv("cuCtxSynchronize after cuMemsetD8"))
    }

    /// The offset of the first 4-byte word in which `self[offset..]` and
    /// `expected` differ, compared **on the GPU**: `expected` is uploaded to
    /// a second allocation and a kernel compares the two where they are.
    /// `None` when every byte is equal. `expected.len()` must be a multiple of 4.
    pub fn first_difference(&self, offset: u64, expected: &[u8]) -> Result<Option<u64>, CudaError> {
        self.check(offset, expected.len())?;
        if !expected.len().is_multiple_of(4) || !offset.is_multiple_of(4) {
            return Err(CudaError::OutOfBounds { offset, count: expected.len(), len: self.len });
        }
        let want = CudaBuffer::alloc(self.info.ordinal, expected.len())?;
        want.copy_from_host(0, expected)?;
        let word = super::cuda_compare::first_difference(self.ptr + offset, want.ptr, expected.len() / 4)?;
        Ok(word.map(|w| offset + 4 * w))
    }

    /// CRC-32C of `len` bytes at `offset`, computed **on the GPU**, in place
    /// where a restore put them: the kernel of `crc32c/gpu/kernel.cu` over
    /// the whole 512-byte rows, the CPU over the under-528 bytes around them
    /// (copied out), combined ([`crate::crc32c::gpu`]). The same function as
    /// [`crate::crc32c::checksum`] over the same bytes.
    pub fn crc32c(&self, offset: u64, len: usize) -> Result<u32, CudaError> {
        self.check(offset, len)?;
        // This buffer's context, whichever another buffer made current: the
        // kernel and its tables live there.
        // SAFETY: `ctx` is the primary context retained in `alloc`, still held.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let mut crc = self.crc.borrow_mut();
        if crc.is_none() {
            *crc = Some(super::cuda_crc32c::GpuCrc::new()?);
        }
        let gpu = crc.as_ref().ok_or_else(|| CudaError::Unavailable("the crc32c kernel is not loaded".into()))?;
        let at = self.ptr + offset;
        crate::crc32c::gpu::crc32c_with(
            at,
            len as u64,
            |from, out| self.copy_to_host(offset + from, out),
            |plan| Ok(gpu.rows(at + plan.head, plan)?),
        )
    }

    /// Exports the whole allocation as a DMA-BUF fd, to hand to the daemon;
    /// refused on a GPU that cannot export ([`CudaError::NoDmaBuf`]).
    pub fn export_dmabuf(&self) -> Result<DmaBuf, CudaError> {
        if !self.info.dmabuf_supported {
            return Err(CudaError::NoDmaBuf { name: self.info.name.clone() });
        }
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `ptr..ptr+len` is one live allocation, page-aligned (2 MiB
        // granular); the driver writes one int, a new fd owned by no one else.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.ptr,
                self.len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(drv("cuMemGetHandleForAddressRange(DMA_BUF_FD)"))?;
        // SAFETY: the call succeeded, so `fd` is a new descriptor we own.
        Ok(DmaBuf::import(unsafe { OwnedFd::from_raw_fd(fd) })?)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // The kernel's module and memory go first, in their own context,
        // still held.
        // SAFETY: `ctx` is the primary context retained in `alloc`.
        let _ = unsafe { cu::ctx::set_current(self.ctx) };
        drop(self.crc.borrow_mut().take());
        // SAFETY: `ptr` was allocated by cuMemAlloc and is freed once; the
        // primary context retained in `alloc` is released once.
        unsafe {
            let _ = cu::free_sync(self.ptr);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer on GPU 0, or `None` after saying why the test is skipped.
    fn alloc_or_skip(test: &str, len: usize) -> Option<CudaBuffer> {
        match CudaBuffer::alloc(0, len) {
            Ok(b) => Some(b),
            Err(CudaError::Unavailable(why)) => {
                pdstor_testkit::skip(&format!("buffer::cuda::{test}"), &format!("no CUDA device ({why})"));
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_gpu_buffer_exports_a_dmabuf_and_round_trips_bytes() {
        let Some(b) = alloc_or_skip("a_gpu_buffer_exports_a_dmabuf_and_round_trips_bytes", 1 << 20) else { return };
        assert_eq!(b.len(), CUDA_ALIGN);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        b.copy_from_host(4096, &data).unwrap();
        let mut back = vec![0u8; 4096];
        b.copy_to_host(4096, &mut back).unwrap();
        assert_eq!(back, data);
        if b.info().dmabuf_supported {
            let d = b.export_dmabuf().unwrap();
            assert_eq!(d.size(), CUDA_ALIGN as u64);
        } else {
            // Proprietary kernel modules: the export is refused, saying so.
            assert!(matches!(b.export_dmabuf(), Err(CudaError::NoDmaBuf { .. })));
        }
        assert!(b.copy_to_host(CUDA_ALIGN as u64 - 1, &mut back).is_err(), "bounds are checked");
    }

    #[test]
    fn the_gpu_compare_finds_the_first_differing_word_and_none_when_equal() {
        let test = "the_gpu_compare_finds_the_first_differing_word_and_none_when_equal";
        let Some(b) = alloc_or_skip(test, 1 << 20) else { return };
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        b.copy_from_host(0, &data).unwrap();
        assert_eq!(b.first_difference(0, &data).unwrap(), None);
        assert_eq!(b.first_difference(8192, &data[8192..]).unwrap(), None);
        for at in [0usize, 5, 4096 * 7 + 3, (1 << 20) - 1] {
            let mut other = data.clone();
            other[at] ^= 0x40;
            assert_eq!(b.first_difference(0, &other).unwrap(), Some((at / 4 * 4) as u64), "byte {at}");
        }
        b.fill_bytes(0).unwrap();
        assert_eq!(b.first_difference(0, &vec![0u8; 1 << 20]).unwrap(), None);
    }

    #[test]
    fn the_gpu_crc32c_is_the_cpus_and_catches_a_flipped_byte() {
        let test = "the_gpu_crc32c_is_the_cpus_and_catches_a_flipped_byte";
        let Some(b) = alloc_or_skip(test, 8 << 20) else { return };
        let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        b.copy_from_host(0, &data).unwrap();
        for (offset, len) in [(0usize, 8usize << 20), (3, 1 << 20), (4096, 511), (17, 0), (1 << 20, (5 << 20) + 77)] {
            let want = crate::crc32c::table::append(0, &data[offset..offset + len]);
            assert_eq!(b.crc32c(offset as u64, len).unwrap(), want, "{len} bytes at {offset}");
        }
        let good = b.crc32c(0, 8 << 20).unwrap();
        b.copy_from_host(5 << 20, &[data[5 << 20] ^ 0x01]).unwrap();
        assert_ne!(b.crc32c(0, 8 << 20).unwrap(), good, "a flipped bit in GPU memory changes the GPU's CRC");
        assert!(b.crc32c((8 << 20) - 4, 8).is_err(), "bounds are checked");
    }
}
