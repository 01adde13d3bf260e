//! Payload buffers: the memory that KV chunks are stored from and loaded into.
//!
//! A [`Buffer`] is a page-aligned memory region accessed through `vm-memory`
//! (bounds-checked, volatile): the device writes it by DMA and, for shared
//! buffers, another process writes it too, so Rust references into it would be
//! unsound. Whether a buffer is *registered* with io_uring (the `host_fixed`
//! path) is the engine's business, not the buffer's; see [`crate::io::Engine`].
//!
//! This module does not do DMA-BUF or CUDA memory (later kinds).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    #[error("a buffer of 0 bytes is useless: give a length of at least one page")]
    ZeroLength,
    #[error("mapping a {kind} buffer of {len} bytes failed: {source}")]
    Map {
        kind: BufferKind,
        len: usize,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("creating memfd {name:?} of {len} bytes failed: {source}")]
    Memfd {
        name: String,
        len: usize,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "range {offset}..{end} is outside the {len}-byte buffer: keep offset + length within the buffer",
        end = offset.saturating_add(*count as u64)
    )]
    OutOfBounds { offset: u64, count: usize, len: usize },
}

/// Where a buffer's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// Private anonymous memory of this process.
    Host,
    /// A memfd mapping, shareable with another process by passing its fd.
    Memfd,
}

impl std::fmt::Display for BufferKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BufferKind::Host => "host",
            BufferKind::Memfd => "memfd",
        })
    }
}

/// A page-aligned payload buffer.
#[derive(Debug)]
pub struct Buffer {
    region: MmapRegion<()>,
    kind: BufferKind,
    memfd: Option<File>,
}

impl Buffer {
    /// Anonymous, page-aligned host memory (`mmap` guarantees the alignment).
    pub fn host(len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let region = MmapRegion::new(len).map_err(|source| BufferError::Map { kind: BufferKind::Host, len, source })?;
        advise_huge_pages(&region);
        Ok(Buffer { region, kind: BufferKind::Host, memfd: None })
    }

    /// A new memfd of `len` bytes, mapped shared.
    pub fn memfd(name: &str, len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let memfd_err = |source| BufferError::Memfd { name: name.to_owned(), len, source };
        let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| memfd_err(e.into()))?;
        let file = File::from(fd);
        file.set_len(len as u64).map_err(memfd_err)?;
        Self::map_memfd(file, len)
    }

    /// Maps a memfd received from another process (it must be at least `len` bytes).
    pub fn from_memfd(fd: OwnedFd, len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let file = File::from(fd);
        let size =
            file.metadata().map_err(|source| BufferError::Memfd { name: "<received>".into(), len, source })?.len();
        if size < len as u64 {
            return Err(BufferError::OutOfBounds { offset: 0, count: len, len: size as usize });
        }
        Self::map_memfd(file, len)
    }

    fn map_memfd(file: File, len: usize) -> Result<Self, BufferError> {
        let mapping_file =
            file.try_clone().map_err(|source| BufferError::Memfd { name: "<dup>".into(), len, source })?;
        let region = MmapRegion::from_file(FileOffset::new(mapping_file, 0), len)
            .map_err(|source| BufferError::Map { kind: BufferKind::Memfd, len, source })?;
        Ok(Buffer { region, kind: BufferKind::Memfd, memfd: Some(file) })
    }

    pub fn len(&self) -> usize {
        self.region.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn kind(&self) -> BufferKind {
        self.kind
    }

    /// The memfd behind a shared buffer, to pass to another process.
    pub fn memfd_fd(&self) -> Option<BorrowedFd<'_>> {
        self.memfd.as_ref().map(|f| f.as_fd())
    }

    /// Start address, for the kernel (io_uring SQEs, buffer registration).
    pub(crate) fn addr(&self) -> u64 {
        self.region.as_ptr() as u64
    }

    /// A bounds-checked volatile view of `count` bytes at `offset`.
    pub fn slice(&self, offset: u64, count: usize) -> Result<VolatileSlice<'_>, BufferError> {
        let oob = || BufferError::OutOfBounds { offset, count, len: self.len() };
        let offset = usize::try_from(offset).map_err(|_| oob())?;
        self.region.get_slice(offset, count).map_err(|_| oob())
    }

    /// Copies `src` into the buffer at `offset`.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), BufferError> {
        self.slice(offset, src.len())?.copy_from(src);
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), BufferError> {
        self.slice(offset, dst.len())?.copy_to(dst);
        Ok(())
    }
}

/// Asks for transparent huge pages on a large buffer. A 4 MiB direct I/O on
/// 4 KiB pages is ~1,000 scatter-gather segments and several block requests;
/// on 2 MiB pages it is two segments. Advisory: a kernel or policy that
/// declines leaves ordinary pages, which are still correct.
fn advise_huge_pages(region: &MmapRegion<()>) {
    const HUGE: usize = 2 << 20;
    if region.size() >= HUGE {
        // SAFETY: madvise on the whole of a mapping this region owns; the
        // advice changes no contents and no mapping bounds.
        let _ = unsafe { libc::madvise(region.as_ptr().cast(), region.size(), libc::MADV_HUGEPAGE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_is_page_aligned_and_bounds_checked() {
        let b = Buffer::host(3 * 4096).unwrap();
        assert_eq!(b.addr() % 4096, 0);
        b.write_at(4096, b"kv").unwrap();
        let mut out = [0u8; 2];
        b.read_at(4096, &mut out).unwrap();
        assert_eq!(&out, b"kv");
        let err = b.write_at(3 * 4096 - 1, b"kv").unwrap_err();
        assert!(err.to_string().contains("outside the 12288-byte buffer"), "{err}");
        assert!(matches!(Buffer::host(0), Err(BufferError::ZeroLength)));
    }

    #[test]
    fn memfd_buffer_is_shared_through_its_fd() {
        let a = Buffer::memfd("pdstor-test", 8192).unwrap();
        a.write_at(100, b"prefill").unwrap();
        let dup = a.memfd_fd().unwrap().try_clone_to_owned().unwrap();
        let b = Buffer::from_memfd(dup, 8192).unwrap();
        let mut out = [0u8; 7];
        b.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"prefill");
        b.write_at(0, b"decode").unwrap();
        let mut back = [0u8; 6];
        a.read_at(0, &mut back).unwrap();
        assert_eq!(&back, b"decode", "writes through one mapping are seen through the other");
    }

    #[test]
    fn received_memfd_smaller_than_claimed_is_refused() {
        let a = Buffer::memfd("small", 4096).unwrap();
        let dup = a.memfd_fd().unwrap().try_clone_to_owned().unwrap();
        assert!(matches!(Buffer::from_memfd(dup, 8192), Err(BufferError::OutOfBounds { .. })));
    }
}
