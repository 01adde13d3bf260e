//! A comparison of two GPU ranges on the GPU (cargo feature `cuda`).
//!
//! The kernel is PTX written here and compiled by the driver's JIT when it is
//! first needed, so building needs no CUDA toolkit. Every thread walks the
//! two ranges a 32-bit word at a time with a grid-sized stride and, where the
//! words differ, lowers one 64-bit result to its word index with an atomic
//! minimum: the result is the first differing word, or `u64::MAX`.

use std::ffi::{CString, c_void};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

/// What the compare failed on.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// The driver's JIT refused a kernel's PTX.
    #[error("the CUDA driver could not compile the GPU kernel {kernel} ({error}): {log}")]
    Jit {
        /// The kernel.
        kernel: &'static str,
        /// The driver's error.
        error: String,
        /// The JIT's error log.
        log: String,
    },
    /// A CUDA driver call of a GPU check failed.
    #[error("CUDA {what} failed (GPU check): {source:?}")]
    Driver {
        /// The call.
        what: &'static str,
        /// The driver's error.
        source: cu::DriverError,
    },
}

const KERNEL: &str = "pdstor_first_difference";

/// `pdstor_first_difference(a, b, words, out)`: `*out = min(*out, i)` for
/// every word index `i < words` with `a[i] != b[i]`. PTX ISA 6.0 for sm_50
/// and later (the driver JIT-compiles it for the GPU it runs on; 64-bit
/// `atom.min` needs sm_32). NVIDIA's `ptxas` 12.9 accepts it for sm_50,
/// sm_80 and sm_90 (checked by hand: no GPU or toolkit in CI).
const PTX: &str = r#".version 6.0
.target sm_50
.address_size 64

.visible .entry pdstor_first_difference(
	.param .u64 param_a,
	.param .u64 param_b,
	.param .u64 param_words,
	.param .u64 param_out
)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<16>;

	ld.param.u64 %rd1, [param_a];
	ld.param.u64 %rd2, [param_b];
	ld.param.u64 %rd3, [param_words];
	ld.param.u64 %rd4, [param_out];
	cvta.to.global.u64 %rd1, %rd1;
	cvta.to.global.u64 %rd2, %rd2;
	cvta.to.global.u64 %rd4, %rd4;
	mov.u32 %r1, %ctaid.x;
	mov.u32 %r2, %ntid.x;
	mov.u32 %r3, %tid.x;
	mov.u32 %r4, %nctaid.x;
	mul.wide.u32 %rd5, %r1, %r2;
	cvt.u64.u32 %rd6, %r3;
	add.s64 %rd5, %rd5, %rd6;
	mul.wide.u32 %rd7, %r4, %r2;
$L_loop:
	setp.ge.u64 %p1, %rd5, %rd3;
	@%p1 bra $L_done;
	shl.b64 %rd8, %rd5, 2;
	add.s64 %rd9, %rd1, %rd8;
	add.s64 %rd10, %rd2, %rd8;
	ld.global.u32 %r5, [%rd9];
	ld.global.u32 %r6, [%rd10];
	setp.ne.u32 %p2, %r5, %r6;
	@%p2 atom.global.min.u64 %rd11, [%rd4], %rd5;
	add.s64 %rd5, %rd5, %rd7;
	bra.uni $L_loop;
$L_done:
	ret;
}
"#;

pub(super) fn drv(what: &'static str) -> impl FnOnce(cu::DriverError) -> CompareError {
    move |source| CompareError::Driver { what, source }
}

/// Loads `kernel` of the PTX text `ptx` in the current context, with the
/// JIT's error log on failure.
pub(super) fn load(ptx: &str, kernel: &'static str) -> Result<(sys::CUmodule, sys::CUfunction), CompareError> {
    let jit = |log: &str| CompareError::Jit { kernel, error: "NUL".into(), log: log.into() };
    let image = CString::new(ptx).map_err(|_| jit("the PTX holds a NUL"))?;
    let mut log = vec![0u8; 4096];
    let mut options =
        [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module = std::ptr::null_mut();
    // SAFETY: `image` is a NUL-terminated PTX text; the two options name a
    // log buffer and its size (passed by value in the pointer, as the driver
    // API defines), both alive for the call; `module` receives one handle.
    let loaded = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    }
    .result();
    if let Err(e) = loaded {
        let text = String::from_utf8_lossy(&log);
        return Err(CompareError::Jit {
            kernel,
            error: format!("{e:?}"),
            log: text.trim_end_matches('\0').trim().to_owned(),
        });
    }
    let name = CString::new(kernel).map_err(|_| jit("the kernel's name holds a NUL"))?;
    // SAFETY: `module` was just loaded and holds the entry `name`.
    match unsafe { cu::module::get_function(module, name) } {
        Ok(f) => Ok((module, f)),
        Err(e) => {
            // SAFETY: unloads the module loaded above, used by nothing else.
            let _ = unsafe { cu::module::unload(module) };
            Err(drv("cuModuleGetFunction")(e))
        }
    }
}

/// The index of the first 32-bit word in which the `words` words at device
/// addresses `a` and `b` differ, or `None`; computed on the GPU of the
/// current context. Both ranges must be live device memory of that context.
pub(super) fn first_difference(
    a: sys::CUdeviceptr,
    b: sys::CUdeviceptr,
    words: usize,
) -> Result<Option<u64>, CompareError> {
    let (module, function) = load(PTX, KERNEL)?;
    let result = (|| {
        // SAFETY: 8 bytes of device memory, freed below.
        let out = unsafe { cu::malloc_sync(8) }.map_err(drv("cuMemAlloc"))?;
        let run = (|| {
            // SAFETY: `out` is 8 bytes of live device memory.
            unsafe { cu::memset_d8_sync(out, 0xff, 8) }.map_err(drv("cuMemsetD8"))?;
            let (mut pa, mut pb, mut pn, mut po) = (a, b, words as u64, out);
            let mut params: [*mut c_void; 4] = [
                (&mut pa as *mut u64).cast(),
                (&mut pb as *mut u64).cast(),
                (&mut pn as *mut u64).cast(),
                (&mut po as *mut u64).cast(),
            ];
            let threads = 256u32;
            let blocks = words.div_ceil(threads as usize).clamp(1, 4096) as u32;
            // SAFETY: the kernel takes four u64 parameters, each pointed to by
            // `params` and alive until the synchronize below; `a` and `b` hold
            // `words` words and `out` 8 bytes, all device memory of this context.
            unsafe {
                cu::launch_kernel(function, (blocks, 1, 1), (threads, 1, 1), 0, std::ptr::null_mut(), &mut params)
            }
            .map_err(drv("cuLaunchKernel(pdstor_first_difference)"))?;
            cu::ctx::synchronize().map_err(drv("cuCtxSynchronize after the compare kernel"))?;
            let mut first = [0u64; 1];
            // SAFETY: `out` holds one u64.
            unsafe { cu::memcpy_dtoh_sync(&mut first, out) }.map_err(drv("cuMemcpyDtoH"))?;
            Ok(if first[0] == u64::MAX { None } else { Some(first[0]) })
        })();
        // SAFETY: `out` was allocated above and is freed once.
        let _ = unsafe { cu::free_sync(out) };
        run
    })();
    // SAFETY: the module loaded above; the kernel has finished (synchronized) or never ran.
    let _ = unsafe { cu::module::unload(module) };
    result
}
