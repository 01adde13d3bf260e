//! DMA-BUF import, and the two host exporters pdstor qualifies with on a CPU.
//!
//! A DMA-BUF is a file descriptor naming memory some driver exported: GPU
//! memory (CUDA, `cuMemGetHandleForAddressRange`), a memfd turned into a
//! DMA-BUF by `udmabuf`, or a buffer from a DMA heap (`/dev/dma_heap/system`).
//! pdstor imports any of them from a data-plane client. It moves the bytes in
//! one of two ways, and says which (DESIGN §6):
//!
//! - `dmabuf_fixed`: the DMA-BUF itself is installed in io_uring's buffer
//!   table (the rw-dmabuf series, see [`uapi`]) and the device DMAs into it;
//! - `host_fixed`: the exporter lets the memory be mapped into this process
//!   (udmabuf through its memfd), and that mapping is registered like any host
//!   buffer. That is a host path and is reported as one.
//!
//! Whenever pdstor itself touches the bytes (checksums), it brackets the access
//! with `DMA_BUF_IOCTL_SYNC` START/END, as the DMA-BUF rules require, and
//! counts it ([`cpu_accesses`]).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The kernel UAPI this module speaks, spelled out (libc does not carry it),
/// with sizes asserted at compile time against the kernel headers.
pub mod uapi {
    /// `struct udmabuf_create` (include/uapi/linux/udmabuf.h).
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct UdmabufCreate {
        /// The memfd (sealed against shrinking) whose pages back the DMA-BUF.
        pub memfd: u32,
        /// `UDMABUF_FLAGS_*`.
        pub flags: u32,
        /// Byte offset into the memfd (page-aligned).
        pub offset: u64,
        /// Bytes (page-aligned).
        pub size: u64,
    }
    /// `UDMABUF_FLAGS_CLOEXEC`: the new fd is close-on-exec.
    pub const UDMABUF_FLAGS_CLOEXEC: u32 = 0x01;
    nix::ioctl_write_ptr!(
        /// `UDMABUF_CREATE`: a DMA-BUF over a sealed memfd range.
        udmabuf_create, b'u', 0x42, UdmabufCreate);

    /// `struct dma_heap_allocation_data` (include/uapi/linux/dma-heap.h).
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct DmaHeapAllocationData {
        /// Bytes to allocate.
        pub len: u64,
        /// Out: the DMA-BUF fd.
        pub fd: u32,
        /// `O_*` flags of the new fd.
        pub fd_flags: u32,
        /// Heap-specific flags (none defined).
        pub heap_flags: u64,
    }
    nix::ioctl_readwrite!(
        /// `DMA_HEAP_IOCTL_ALLOC`: a DMA-BUF from a DMA heap.
        dma_heap_ioctl_alloc, b'H', 0x0, DmaHeapAllocationData);

    /// `struct dma_buf_sync` (include/uapi/linux/dma-buf.h).
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct DmaBufSync {
        /// `DMA_BUF_SYNC_*`: START or END, with READ and/or WRITE.
        pub flags: u64,
    }
    /// `DMA_BUF_SYNC_READ`: the CPU reads.
    pub const DMA_BUF_SYNC_READ: u64 = 1;
    /// `DMA_BUF_SYNC_WRITE`: the CPU writes.
    pub const DMA_BUF_SYNC_WRITE: u64 = 2;
    /// `DMA_BUF_SYNC_START`: the access begins.
    pub const DMA_BUF_SYNC_START: u64 = 0;
    /// `DMA_BUF_SYNC_END`: the access ends.
    pub const DMA_BUF_SYNC_END: u64 = 4;
    nix::ioctl_write_ptr!(
        /// `DMA_BUF_IOCTL_SYNC`: brackets a CPU access to a DMA-BUF.
        dma_buf_ioctl_sync, b'b', 0, DmaBufSync);

    /// `DMA_BUF_MAGIC` (include/uapi/linux/magic.h): `statfs` of a DMA-BUF fd.
    pub const DMA_BUF_MAGIC: i64 = 0x444d_4142;

    /// `struct io_uring_rsrc_update2`, as the rw-dmabuf series extends it
    /// (the former `resv` word becomes `flags`).
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct IoUringRsrcUpdate2 {
        /// The first buffer-table index to update.
        pub offset: u32,
        /// `IORING_RSRC_UPDATE_EXTENDED` when `data` points at descriptors.
        pub flags: u32,
        /// Address of the descriptors (or iovecs).
        pub data: u64,
        /// Address of the tags, or 0.
        pub tags: u64,
        /// Descriptors to apply.
        pub nr: u32,
        /// Reserved, 0.
        pub resv2: u32,
    }
    /// `io_uring_rsrc_update2::flags`: `data` points at `io_uring_regbuf_desc`s.
    pub const IORING_RSRC_UPDATE_EXTENDED: u32 = 1 << 1;

    /// `enum io_uring_regbuf_type`.
    pub const IO_REGBUF_TYPE_EMPTY: u32 = 0;
    /// `IO_REGBUF_TYPE_UADDR`: user memory at `uaddr`.
    pub const IO_REGBUF_TYPE_UADDR: u32 = 1;
    /// `IO_REGBUF_TYPE_DMABUF`: the DMA-BUF `dmabuf_fd`.
    pub const IO_REGBUF_TYPE_DMABUF: u32 = 2;
    /// The largest DMA-BUF the series installs (`SZ_1G`); a larger one is `EINVAL`.
    pub const IO_REGBUF_DMABUF_MAX: u64 = 1 << 30;

    /// `struct io_uring_regbuf_desc` with the series' DMA-BUF fields. For
    /// `IO_REGBUF_TYPE_DMABUF`, `uaddr` and `size` are 0 (the size is the
    /// DMA-BUF's) and `target_fd` is the file the buffer will be used on; an
    /// SQE's `addr` is then an offset into the DMA-BUF.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct IoUringRegbufDesc {
        /// `IO_REGBUF_TYPE_*`.
        pub kind: u32,
        /// Reserved, 0.
        pub flags: u32,
        /// Bytes (0 for a DMA-BUF: its own size).
        pub size: u64,
        /// User address (0 for a DMA-BUF).
        pub uaddr: u64,
        /// The DMA-BUF's fd.
        pub dmabuf_fd: i32,
        /// The file the buffer will be used on (the target).
        pub target_fd: i32,
        /// Reserved, 0.
        pub resv: [u64; 6],
    }

    /// `IORING_REGISTER_BUFFERS_UPDATE`; its `nr_args` is the size of the update.
    pub const IORING_REGISTER_BUFFERS_UPDATE: u32 = 16;

    const _: () = assert!(size_of::<UdmabufCreate>() == 24);
    const _: () = assert!(size_of::<DmaHeapAllocationData>() == 24);
    const _: () = assert!(size_of::<DmaBufSync>() == 8);
    const _: () = assert!(size_of::<IoUringRsrcUpdate2>() == 32);
    const _: () = assert!(size_of::<IoUringRegbufDesc>() == 80);
    const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, dmabuf_fd) == 24);
    const _: () = assert!(std::mem::offset_of!(IoUringRegbufDesc, target_fd) == 28);
    const _: () = assert!(std::mem::offset_of!(IoUringRsrcUpdate2, data) == 8);
    const _: () = assert!(std::mem::offset_of!(IoUringRsrcUpdate2, nr) == 24);
}

/// The `udmabuf` module's default per-buffer limit, in MiB
/// (`/sys/module/udmabuf/parameters/size_limit_mb`).
pub const UDMABUF_DEFAULT_LIMIT_MB: u64 = 64;

/// What importing, creating or touching a DMA-BUF failed on.
#[derive(Debug, thiserror::Error)]
pub enum DmaBufError {
    /// The fd is not a DMA-BUF.
    #[error(
        "fd {fd} is not a DMA-BUF (its filesystem is {magic:#x}, not DMA_BUF_MAGIC): send the exporter's DMA-BUF fd"
    )]
    NotDmaBuf {
        /// The fd.
        fd: i32,
        /// Its filesystem's magic.
        magic: i64,
    },
    /// An fd could not be inspected.
    #[error("inspecting fd {fd}: {source}")]
    Inspect {
        /// The fd.
        fd: i32,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// A DMA-BUF of 0 bytes.
    #[error("the DMA-BUF on fd {fd} is 0 bytes: nothing can be stored in it")]
    Empty {
        /// The fd.
        fd: i32,
    },
    /// A size or offset that is not page-granular.
    #[error(
        "a {what} of {len} bytes is not a multiple of the {page}-byte page: DMA-BUF sizes and offsets are page-granular"
    )]
    Unaligned {
        /// Which number.
        what: &'static str,
        /// Its value.
        len: u64,
        /// The page size.
        page: u64,
    },
    /// An exporter's device is missing.
    #[error(
        "{} is missing: {why} (load the module: `modprobe {module}`; the kernel needs {config})",
        path.display()
    )]
    NoExporter {
        /// The device node.
        path: std::path::PathBuf,
        /// The module that provides it.
        module: &'static str,
        /// The kernel option it needs.
        config: &'static str,
        /// What was seen.
        why: String,
    },
    /// `UDMABUF_CREATE` failed.
    #[error("creating a {len}-byte udmabuf failed: {source}{hint}")]
    Udmabuf {
        /// Bytes asked for.
        len: u64,
        /// What to change, if known (the module's size limit, say).
        hint: String,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// A DMA heap allocation failed.
    #[error("allocating {len} bytes from DMA heap {heap}: {source}")]
    Heap {
        /// The heap.
        heap: String,
        /// Bytes asked for.
        len: u64,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// `DMA_BUF_IOCTL_SYNC` failed.
    #[error("DMA_BUF_IOCTL_SYNC ({what}) on the {exporter} DMA-BUF failed: {source}")]
    Sync {
        /// The DMA-BUF's exporter.
        exporter: String,
        /// START or END, READ or WRITE.
        what: &'static str,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
}

static CPU_ACCESSES: AtomicU64 = AtomicU64::new(0);

/// How many times this process bracketed a CPU access to a DMA-BUF (each
/// `DMA_BUF_IOCTL_SYNC` START). A native transfer causes none.
pub fn cpu_accesses() -> u64 {
    CPU_ACCESSES.load(Ordering::Relaxed)
}

/// An imported DMA-BUF: the fd, its size and who exported it.
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    size: u64,
    exporter: String,
}

/// The direction of a CPU access, for `DMA_BUF_IOCTL_SYNC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The CPU reads the memory.
    Read,
    /// The CPU writes the memory.
    Write,
}

const PAGE: u64 = 4096;

impl DmaBuf {
    /// Checks that `fd` is a DMA-BUF (by its filesystem magic) and learns its
    /// size (`lseek(SEEK_END)`, which every DMA-BUF answers) and exporter
    /// (`exp_name` in `/proc/self/fdinfo`). Refuses a non-DMA-BUF fd, an empty
    /// buffer and a size that is not page-granular.
    pub fn import(fd: OwnedFd) -> Result<DmaBuf, DmaBufError> {
        let raw = fd.as_raw_fd();
        let inspect = |source| DmaBufError::Inspect { fd: raw, source };
        let st = nix::sys::statfs::fstatfs(&fd).map_err(|e| inspect(e.into()))?;
        let magic = st.filesystem_type().0 as i64;
        if magic != uapi::DMA_BUF_MAGIC {
            return Err(DmaBufError::NotDmaBuf { fd: raw, magic });
        }
        let size = nix::unistd::lseek(&fd, 0, nix::unistd::Whence::SeekEnd).map_err(|e| inspect(e.into()))? as u64;
        nix::unistd::lseek(&fd, 0, nix::unistd::Whence::SeekSet).map_err(|e| inspect(e.into()))?;
        if size == 0 {
            return Err(DmaBufError::Empty { fd: raw });
        }
        if !size.is_multiple_of(PAGE) {
            return Err(DmaBufError::Unaligned { what: "DMA-BUF", len: size, page: PAGE });
        }
        let exporter = std::fs::read_to_string(format!("/proc/self/fdinfo/{raw}"))
            .ok()
            .and_then(|info| info.lines().find_map(|l| l.strip_prefix("exp_name:").map(|v| v.trim().to_owned())))
            .unwrap_or_else(|| "unknown".into());
        Ok(DmaBuf { fd, size, exporter })
    }

    /// The DMA-BUF's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The exporter's name as the kernel reports it (`udmabuf`, `system`, ...).
    pub fn exporter(&self) -> &str {
        &self.exporter
    }

    /// The DMA-BUF's fd, borrowed.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Another fd for the same buffer (to send it to the daemon).
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Starts a CPU access: `DMA_BUF_IOCTL_SYNC` START now, END when the
    /// guard drops. Counted in [`cpu_accesses`].
    pub fn begin_cpu_access(&self, access: Access) -> Result<CpuAccess<'_>, DmaBufError> {
        let dir = match access {
            Access::Read => uapi::DMA_BUF_SYNC_READ,
            Access::Write => uapi::DMA_BUF_SYNC_WRITE,
        };
        self.sync(uapi::DMA_BUF_SYNC_START | dir, "START")?;
        CPU_ACCESSES.fetch_add(1, Ordering::Relaxed);
        Ok(CpuAccess { buf: self, dir })
    }

    fn sync(&self, flags: u64, what: &'static str) -> Result<(), DmaBufError> {
        let arg = uapi::DmaBufSync { flags };
        // SAFETY: DMA_BUF_IOCTL_SYNC reads one `struct dma_buf_sync` (8 bytes,
        // asserted above) from a valid pointer; `fd` is an open DMA-BUF.
        unsafe { uapi::dma_buf_ioctl_sync(self.fd.as_raw_fd(), &arg) }.map_err(|e| DmaBufError::Sync {
            exporter: self.exporter.clone(),
            what,
            source: e.into(),
        })?;
        Ok(())
    }
}

/// A CPU access in progress; ends (`DMA_BUF_IOCTL_SYNC` END) on drop.
pub struct CpuAccess<'a> {
    buf: &'a DmaBuf,
    dir: u64,
}

impl Drop for CpuAccess<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.buf.sync(uapi::DMA_BUF_SYNC_END | self.dir, "END") {
            tracing::warn!("{e}");
        }
    }
}

/// Creates a udmabuf of `len` bytes: a sealable memfd (`F_SEAL_SHRINK`, as
/// `UDMABUF_CREATE` demands) turned into a DMA-BUF. Returns the DMA-BUF and
/// the memfd behind it (through which the memory can be mapped and pinned).
pub fn create_udmabuf(name: &str, len: u64) -> Result<(DmaBuf, File), DmaBufError> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    if len == 0 || !len.is_multiple_of(PAGE) {
        return Err(DmaBufError::Unaligned { what: "udmabuf", len, page: PAGE });
    }
    let dev = Path::new("/dev/udmabuf");
    let ctl = File::options().read(true).write(true).open(dev).map_err(|e| DmaBufError::NoExporter {
        path: dev.into(),
        module: "udmabuf",
        config: "CONFIG_UDMABUF",
        why: e.to_string(),
    })?;
    let err = |source: std::io::Error| DmaBufError::Udmabuf { len, hint: String::new(), source };
    let flags = nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING;
    let memfd = File::from(nix::sys::memfd::memfd_create(name, flags).map_err(|e| err(e.into()))?);
    memfd.set_len(len).map_err(err)?;
    fcntl(&memfd, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).map_err(|e| err(e.into()))?;
    let create = uapi::UdmabufCreate {
        memfd: memfd.as_raw_fd() as u32,
        flags: uapi::UDMABUF_FLAGS_CLOEXEC,
        offset: 0,
        size: len,
    };
    // SAFETY: UDMABUF_CREATE reads one `struct udmabuf_create` (24 bytes,
    // asserted) and returns a new fd that nothing else owns.
    let fd = unsafe { uapi::udmabuf_create(ctl.as_raw_fd(), &create) }.map_err(|e| {
        let limit = udmabuf_limit_mb().unwrap_or(UDMABUF_DEFAULT_LIMIT_MB);
        let hint = if e == nix::errno::Errno::E2BIG || e == nix::errno::Errno::EINVAL {
            format!(
                " (udmabuf allows {limit} MiB per buffer, {UDMABUF_DEFAULT_LIMIT_MB} MiB by default: use several buffers, or raise /sys/module/udmabuf/parameters/size_limit_mb)"
            )
        } else {
            String::new()
        };
        DmaBufError::Udmabuf { len, hint, source: e.into() }
    })?;
    // SAFETY: the ioctl's return value is a new fd owned by no one else.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    Ok((DmaBuf::import(fd)?, memfd))
}

/// Allocates `len` bytes from DMA heap `heap` (`/dev/dma_heap/<heap>`).
pub fn alloc_from_heap(heap: &str, len: u64) -> Result<DmaBuf, DmaBufError> {
    if len == 0 || !len.is_multiple_of(PAGE) {
        return Err(DmaBufError::Unaligned { what: "DMA-heap buffer", len, page: PAGE });
    }
    let dev = Path::new("/dev/dma_heap").join(heap);
    let h = File::options().read(true).open(&dev).map_err(|e| DmaBufError::NoExporter {
        path: dev.clone(),
        module: "system_heap",
        config: "CONFIG_DMABUF_HEAPS_SYSTEM",
        why: e.to_string(),
    })?;
    let mut data =
        uapi::DmaHeapAllocationData { len, fd: 0, fd_flags: (libc::O_RDWR | libc::O_CLOEXEC) as u32, heap_flags: 0 };
    // SAFETY: DMA_HEAP_IOCTL_ALLOC reads and writes one 24-byte
    // `struct dma_heap_allocation_data` (asserted) through a valid pointer.
    unsafe { uapi::dma_heap_ioctl_alloc(h.as_raw_fd(), &mut data) }.map_err(|e| DmaBufError::Heap {
        heap: heap.into(),
        len,
        source: e.into(),
    })?;
    // SAFETY: on success the kernel put a new fd, owned by no one else, in `fd`.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(data.fd as i32) };
    DmaBuf::import(fd)
}

/// What this kernel offers for DMA-BUF payloads, for `pdstor info` and
/// `gpu-qual` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Exporters {
    /// `/dev/udmabuf` exists.
    pub udmabuf: bool,
    /// The udmabuf module's per-buffer limit, if it says.
    pub udmabuf_limit_mb: Option<u64>,
    /// The DMA heaps under `/dev/dma_heap`.
    pub dma_heaps: Vec<String>,
}

/// The loaded udmabuf module's per-buffer limit in MiB, if it says.
fn udmabuf_limit_mb() -> Option<u64> {
    std::fs::read_to_string("/sys/module/udmabuf/parameters/size_limit_mb").ok()?.trim().parse().ok()
}

/// What this kernel offers for DMA-BUF payloads now.
pub fn exporters() -> Exporters {
    let heaps = std::fs::read_dir("/dev/dma_heap")
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    Exporters { udmabuf: Path::new("/dev/udmabuf").exists(), udmabuf_limit_mb: udmabuf_limit_mb(), dma_heaps: heaps }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // _IOW('u', 0x42, struct udmabuf_create), _IOWR('H', 0, struct
        // dma_heap_allocation_data), _IOW('b', 0, struct dma_buf_sync): the
        // values the kernel headers expand to on x86-64 and arm64.
        assert_eq!(nix::request_code_write!(b'u', 0x42, size_of::<uapi::UdmabufCreate>()), 0x4018_7542);
        assert_eq!(nix::request_code_readwrite!(b'H', 0, size_of::<uapi::DmaHeapAllocationData>()), 0xc018_4800);
        assert_eq!(nix::request_code_write!(b'b', 0, size_of::<uapi::DmaBufSync>()), 0x4008_6200);
        assert_eq!(uapi::DMA_BUF_SYNC_START | uapi::DMA_BUF_SYNC_READ, 1);
        assert_eq!(uapi::DMA_BUF_SYNC_END | uapi::DMA_BUF_SYNC_WRITE, 6);
    }

    #[test]
    fn regbuf_desc_encodes_as_the_series_defines() {
        let d = uapi::IoUringRegbufDesc {
            kind: uapi::IO_REGBUF_TYPE_DMABUF,
            dmabuf_fd: 7,
            target_fd: 9,
            ..Default::default()
        };
        // SAFETY: a repr(C) struct of plain integers viewed as its bytes.
        let bytes: &[u8; 80] = unsafe { &*(&d as *const uapi::IoUringRegbufDesc as *const [u8; 80]) };
        assert_eq!(&bytes[0..4], &2u32.to_ne_bytes(), "type DMABUF is the third enum value");
        assert_eq!(&bytes[24..28], &7i32.to_ne_bytes());
        assert_eq!(&bytes[28..32], &9i32.to_ne_bytes());
        assert!(bytes[32..].iter().all(|b| *b == 0), "reserved words are zero");
        assert_eq!(uapi::IORING_RSRC_UPDATE_EXTENDED, 2);
        assert_eq!((uapi::IO_REGBUF_TYPE_EMPTY, uapi::IO_REGBUF_TYPE_UADDR), (0, 1));
    }

    #[test]
    fn a_memfd_is_not_a_dmabuf() {
        let fd = nix::sys::memfd::memfd_create("not-a-dmabuf", nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap();
        let err = DmaBuf::import(fd).unwrap_err();
        assert!(matches!(err, DmaBufError::NotDmaBuf { .. }), "{err}");
        assert!(err.to_string().contains("is not a DMA-BUF"), "{err}");
    }

    #[test]
    fn exporters_refuse_empty_and_unaligned_sizes_before_touching_the_kernel() {
        for len in [0, 4095, 4097] {
            assert!(matches!(create_udmabuf("t", len), Err(DmaBufError::Unaligned { .. })), "{len}");
            assert!(matches!(alloc_from_heap("system", len), Err(DmaBufError::Unaligned { .. })), "{len}");
        }
    }

    #[test]
    fn udmabuf_round_trip_when_the_kernel_has_it() {
        let (buf, memfd) = match create_udmabuf("pdstor-unit", 1 << 20) {
            Ok(b) => b,
            Err(DmaBufError::NoExporter { .. }) => {
                pdstor_testkit::skip(
                    "buffer::dmabuf::udmabuf_round_trip_when_the_kernel_has_it",
                    "no /dev/udmabuf on this kernel (the vmtest dmabuf suite covers it)",
                );
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(buf.size(), 1 << 20);
        assert_eq!(buf.exporter(), "udmabuf");
        assert_eq!(memfd.metadata().unwrap().len(), 1 << 20);
        let before = cpu_accesses();
        drop(buf.begin_cpu_access(Access::Read).unwrap());
        assert_eq!(cpu_accesses(), before + 1);
    }
}
