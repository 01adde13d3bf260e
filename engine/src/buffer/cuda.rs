//! CUDA device memory exported as a DMA-BUF (cargo feature `cuda`).
//!
//! `cudarc` loads `libcuda.so` at run time, so building needs no CUDA toolkit
//! and a machine without a GPU gets [`CudaError::Unavailable`] with the
//! reason, never a panic. The export follows NVIDIA's rules: the device must
//! report `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (open kernel modules), and
//! `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` takes a
//! page-aligned range, so allocations are rounded up to 2 MiB.

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

/// Device memory on one GPU, in the device's primary context.
pub struct CudaBuffer {
    dev: sys::CUdevice,
    ptr: sys::CUdeviceptr,
    len: usize,
    info: DeviceInfo,
}

impl CudaBuffer {
    /// Allocates at least `len` bytes (rounded up to [`CUDA_ALIGN`]) on GPU
    /// `ordinal`, refusing a GPU that cannot export DMA-BUFs.
    pub fn alloc(ordinal: i32, len: usize) -> Result<CudaBuffer, CudaError> {
        let info = device_info(ordinal)?;
        if !info.dmabuf_supported {
            return Err(CudaError::NoDmaBuf { name: info.name });
        }
        let dev = cu::device::get(ordinal).map_err(drv("cuDeviceGet"))?;
        // SAFETY: `dev` came from cuDeviceGet; the context is released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: `ctx` is the live primary context just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(drv("cuCtxSetCurrent"))?;
        let len = len.max(1).next_multiple_of(CUDA_ALIGN);
        // SAFETY: a plain allocation in the current context, freed in Drop.
        let ptr = unsafe { cu::malloc_sync(len) }.map_err(drv("cuMemAlloc"))?;
        Ok(CudaBuffer { dev, ptr, len, info })
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

    /// Copies `src` from host memory into the GPU buffer at `offset`.
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), CudaError> {
        self.check(offset, src.len())?;
        // SAFETY: the destination range was bounds-checked against the allocation.
        unsafe { cu::memcpy_htod_sync(self.ptr + offset, src) }.map_err(drv("cuMemcpyHtoD"))
    }

    /// Copies `dst.len()` bytes at `offset` out of the GPU buffer.
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check(offset, dst.len())?;
        // SAFETY: the source range was bounds-checked against the allocation.
        unsafe { cu::memcpy_dtoh_sync(dst, self.ptr + offset) }.map_err(drv("cuMemcpyDtoH"))
    }

    /// Exports the whole allocation as a DMA-BUF fd, to hand to the daemon.
    pub fn export_dmabuf(&self) -> Result<DmaBuf, CudaError> {
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

    #[test]
    fn a_gpu_buffer_exports_a_dmabuf_and_round_trips_bytes() {
        let b = match CudaBuffer::alloc(0, 1 << 20) {
            Ok(b) => b,
            Err(CudaError::Unavailable(why)) => {
                crate::test_skip(
                    "buffer::cuda::a_gpu_buffer_exports_a_dmabuf_and_round_trips_bytes",
                    &format!("no CUDA device ({why})"),
                );
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(b.len(), CUDA_ALIGN);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        b.copy_from_host(4096, &data).unwrap();
        let mut back = vec![0u8; 4096];
        b.copy_to_host(4096, &mut back).unwrap();
        assert_eq!(back, data);
        let d = b.export_dmabuf().unwrap();
        assert_eq!(d.size(), CUDA_ALIGN as u64);
        assert!(b.copy_to_host(CUDA_ALIGN as u64 - 1, &mut back).is_err(), "bounds are checked");
    }
}
