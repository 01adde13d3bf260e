//! Raw kernel ABI used by the I/O engine: block-device ioctls, `statx` direct-I/O
//! alignment, and the NVMe passthrough structures and ioctl numbers.
//!
//! Everything here is `unsafe`-adjacent plumbing; the rest of `io/` only sees the
//! safe wrappers. This module does not decide policy (which alignment to require,
//! whether to refuse a device): it reports what the kernel says.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

/// `_IOC` encoding from `include/uapi/asm-generic/ioctl.h` (x86-64 and arm64 agree).
const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((ty as u32) << 8) | nr as u32
}
const IOC_NONE: u32 = 0;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `BLKSSZGET`: logical block size of a block device (`_IO(0x12, 104)`, takes `int *`).
const BLKSSZGET: u32 = ioc(IOC_NONE, 0x12, 104, 0);
/// `BLKGETSIZE64`: size of a block device in bytes (`_IOR(0x12, 114, size_t)`).
const BLKGETSIZE64: u32 = ioc(IOC_READ, 0x12, 114, size_of::<usize>());

/// `struct nvme_passthru_cmd` / `struct nvme_uring_cmd` from
/// `include/uapi/linux/nvme_ioctl.h`. The two share one layout; the last word is
/// `result` in the ioctl form and `rsvd2` in the io_uring form.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NvmeCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result_or_rsvd2: u32,
}
const _: () = assert!(size_of::<NvmeCmd>() == 72, "struct nvme_uring_cmd is 72 bytes");

/// `NVME_IOCTL_ID`: `_IO('N', 0x40)`, returns the namespace id of the fd.
const NVME_IOCTL_ID: u32 = ioc(IOC_NONE, b'N', 0x40, 0);
/// `NVME_IOCTL_ADMIN_CMD`: `_IOWR('N', 0x41, struct nvme_admin_cmd)`.
pub const NVME_IOCTL_ADMIN_CMD: u32 = ioc(IOC_READ | IOC_WRITE, b'N', 0x41, size_of::<NvmeCmd>());
/// `NVME_URING_CMD_IO`: `_IOWR('N', 0x80, struct nvme_uring_cmd)`, the `cmd_op` of an
/// I/O passthrough `IORING_OP_URING_CMD`.
pub const NVME_URING_CMD_IO: u32 = ioc(IOC_READ | IOC_WRITE, b'N', 0x80, size_of::<NvmeCmd>());

/// Direct-I/O alignment reported by `statx(STATX_DIOALIGN)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of the user buffer address and length.
    pub mem: u32,
    /// Required alignment of the file offset and length.
    pub offset: u32,
}

/// What `statx` says about direct I/O on a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DioSupport {
    /// The kernel reported the alignment.
    Aligned(DioAlign),
    /// The kernel reported `STATX_DIOALIGN` with zeros: this file does not support direct I/O.
    Unsupported,
    /// The kernel (or filesystem) does not report `STATX_DIOALIGN` at all.
    Unknown,
}

pub fn statx_dio_align(path: &Path) -> io::Result<DioSupport> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: `statx` is a plain-old-data struct for which all-zero bytes are valid.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a valid NUL-terminated string and `stx` is a writable
    // `struct statx` that outlives the call.
    let rc = unsafe { libc::statx(libc::AT_FDCWD, c_path.as_ptr(), 0, libc::STATX_DIOALIGN, &mut stx) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(DioSupport::Unknown);
    }
    if stx.stx_dio_mem_align == 0 || stx.stx_dio_offset_align == 0 {
        return Ok(DioSupport::Unsupported);
    }
    Ok(DioSupport::Aligned(DioAlign { mem: stx.stx_dio_mem_align, offset: stx.stx_dio_offset_align }))
}

pub fn block_logical_size(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one `int` through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), BLKSSZGET as _, &mut size) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(size).map_err(|_| io::Error::other(format!("BLKSSZGET returned {size}")))
}

/// Whether the file takes `RWF_NOWAIT` (the kernel's `FMODE_NOWAIT`): one
/// direct read of `buf` at offset 0 with the flag. A device without it (zram
/// and other bio-based drivers) answers `EOPNOTSUPP`, and io_uring then hands
/// every command on it to an io-wq worker. `EAGAIN` (it would block just now)
/// and success both mean it takes the flag.
pub fn takes_nowait(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<bool> {
    let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: one iovec describing `buf`, which outlives the call; the kernel
    // writes at most `buf.len()` bytes into it.
    let rc = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    if rc >= 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => Ok(false),
        Some(libc::EAGAIN) => Ok(true),
        _ => Err(e),
    }
}

pub fn block_size_bytes(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one `u64` (size_t on 64-bit) through the pointer.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64 as _, &mut size) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

pub fn nvme_namespace_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument and returns the nsid or -1.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), NVME_IOCTL_ID as _) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // Values as printed by a C program including <linux/fs.h> and <linux/nvme_ioctl.h>.
        assert_eq!(BLKSSZGET, 0x1268);
        assert_eq!(BLKGETSIZE64, 0x8008_1272);
        assert_eq!(NVME_IOCTL_ID, 0x4e40);
        assert_eq!(NVME_IOCTL_ADMIN_CMD, 0xc048_4e41);
        assert_eq!(NVME_URING_CMD_IO, 0xc048_4e80);
    }

    #[test]
    fn nvme_cmd_field_offsets_match_the_uapi() {
        let c = NvmeCmd::default();
        let base = &c as *const _ as usize;
        assert_eq!(&c.nsid as *const _ as usize - base, 4);
        assert_eq!(&c.metadata as *const _ as usize - base, 16);
        assert_eq!(&c.addr as *const _ as usize - base, 24);
        assert_eq!(&c.data_len as *const _ as usize - base, 36);
        assert_eq!(&c.cdw10 as *const _ as usize - base, 40);
        assert_eq!(&c.timeout_ms as *const _ as usize - base, 64);
    }
}
