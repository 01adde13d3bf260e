//! Payload buffers: the memory that KV chunks are stored from and loaded into.
//!
//! A [`Buffer`] is a page-aligned memory region accessed through `vm-memory`
//! (bounds-checked, volatile): the device writes it by DMA and, for shared
//! buffers, another process writes it too, so Rust references into it would be
//! unsound. Whether a buffer is *registered* with io_uring (the `host_fixed`
//! path) is the engine's business, not the buffer's; see [`crate::io::Engine`].
//!
//! DMA-BUFs ([`dmabuf`]) are buffers too: mapped through their backing memfd
//! (udmabuf) or their own `mmap` (DMA heaps) where the exporter allows, and
//! with no CPU mapping at all where it does not (device memory), in which case
//! only the `dmabuf_fixed` path can move them.

mod copy_out;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod cuda_compare;
#[cfg(feature = "cuda")]
mod cuda_crc32c;
pub mod dmabuf;
mod error;
mod shm_guard;

pub use copy_out::Piece;
pub use error::{BufferError, NotShmFile};

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicBool;

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

/// Where a buffer's memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// Private anonymous memory of this process.
    Host,
    /// A memfd mapping, shareable with another process by passing its fd.
    Memfd,
    /// A DMA-BUF (udmabuf, DMA heap, GPU memory).
    DmaBuf,
    /// A shared-memory file its owner can still shrink (a POSIX `shm_open`
    /// object in `/dev/shm`, an unsealed memfd): LMCache's CPU pool with
    /// `shm_name`. Mapped for the kernel's I/O; this process reads and
    /// writes its bytes through the file (`pread`/`pwrite`), so a truncation
    /// fails an access instead of faulting, except the checksum of a load,
    /// taken in place with the fault a truncation raises caught
    /// (`buffer/shm_guard.rs`).
    ShmFile,
}

impl std::fmt::Display for BufferKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BufferKind::Host => "host",
            BufferKind::Memfd => "memfd",
            BufferKind::DmaBuf => "dmabuf",
            BufferKind::ShmFile => "shm file",
        })
    }
}

/// A page-aligned payload buffer.
#[derive(Debug)]
pub struct Buffer {
    /// The CPU mapping; `None` only for a DMA-BUF this process cannot map.
    region: Option<MmapRegion<()>>,
    kind: BufferKind,
    memfd: Option<File>,
    dmabuf: Option<dmabuf::DmaBuf>,
    /// Length when there is no mapping (the DMA-BUF's size).
    len: usize,
    /// The CPU reaches the bytes through `memfd` (`pread`/`pwrite`) only,
    /// never through `region`: a [`BufferKind::ShmFile`] received from
    /// another process.
    file_access_only: bool,
    /// Its owner asked that loads into it not be checksummed here
    /// ([`Buffer::skip_load_checks`]).
    unchecked: bool,
    /// A file-access-only buffer's mapping was found shrunk under an in-place
    /// check (`buffer/shm_guard.rs`): its bytes are reached through the file only.
    shrunk: AtomicBool,
}

impl Buffer {
    /// Anonymous, page-aligned host memory (`mmap` guarantees the alignment).
    pub fn host(len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let region = MmapRegion::new(len).map_err(|source| BufferError::Map { kind: BufferKind::Host, len, source })?;
        advise_huge_pages(&region);
        Ok(Buffer {
            region: Some(region),
            kind: BufferKind::Host,
            memfd: None,
            dmabuf: None,
            len,
            file_access_only: false,
            unchecked: false,
            shrunk: AtomicBool::new(false),
        })
    }

    /// A new memfd of `len` bytes, mapped shared.
    pub fn memfd(name: &str, len: usize) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        let memfd_err = |source| BufferError::Memfd { name: name.to_owned(), len, source };
        let flags = nix::sys::memfd::MFdFlags::MFD_CLOEXEC | nix::sys::memfd::MFdFlags::MFD_ALLOW_SEALING;
        let fd = nix::sys::memfd::memfd_create(name, flags).map_err(|e| memfd_err(e.into()))?;
        let file = File::from(fd);
        file.set_len(len as u64).map_err(memfd_err)?;
        // Sealed against shrinking, so whoever it is shared with can map it
        // without a truncation turning their accesses into SIGBUS.
        fcntl(&file, FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK)).map_err(|e| memfd_err(e.into()))?;
        Self::map_memfd(file, len)
    }

    /// Maps a memfd received from another process (it must be at least `len`
    /// bytes). Only a memfd sealed with `F_SEAL_SHRINK` is accepted: its
    /// owner cannot truncate it under the mapping, so no access through it
    /// can fault. Any other fd (a regular file, a tmpfs file, an unsealed
    /// memfd) is refused with the reason.
    pub fn from_memfd(fd: OwnedFd, len: usize) -> Result<Self, BufferError> {
        use nix::fcntl::{FcntlArg, SealFlag, fcntl};
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let seals = match fcntl(&fd, FcntlArg::F_GET_SEALS) {
            Ok(s) => SealFlag::from_bits_truncate(s),
            Err(nix::errno::Errno::EINVAL) => {
                return Err(BufferError::NotSealedMemfd { what: "not a memfd (it cannot carry seals)".into() });
            }
            Err(e) => return Err(BufferError::NotSealedMemfd { what: format!("unreadable (F_GET_SEALS: {e})") }),
        };
        if !seals.contains(SealFlag::F_SEAL_SHRINK) {
            return Err(BufferError::NotSealedMemfd {
                what: format!("a memfd (or shmem file) without F_SEAL_SHRINK (seals {seals:?})"),
            });
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
        Ok(Buffer {
            region: Some(region),
            kind: BufferKind::Memfd,
            memfd: Some(file),
            dmabuf: None,
            len,
            file_access_only: false,
            unchecked: false,
            shrunk: AtomicBool::new(false),
        })
    }

    /// Maps the first `len` bytes of a shared-memory file that its owner
    /// can still shrink — a POSIX shared-memory object (`/dev/shm/<name>`,
    /// LMCache's CPU pool with `shm_name`) or an unsealed memfd: any file on
    /// tmpfs, checked with `fstatfs`. It is mapped for the kernel's I/O (an
    /// io_uring registration pins its pages; a transfer into a range the
    /// owner cut off fails with `EFAULT`). With `owner` (this process made
    /// the file and keeps it whole) the CPU may use the mapping too;
    /// otherwise every CPU access goes through the file, so that a
    /// truncation by the owner fails that access instead of raising SIGBUS —
    /// but [`Buffer::crc32c`], which reads the mapping in place with that
    /// SIGBUS caught (`buffer/shm_guard.rs`); once it has caught one, the buffer
    /// takes no transfer again ([`BufferError::Shrunk`]).
    pub fn from_shm_file(fd: OwnedFd, len: usize, owner: bool) -> Result<Self, BufferError> {
        if len == 0 {
            return Err(BufferError::ZeroLength);
        }
        let refuse = |what: String| BufferError::NotShmFile(NotShmFile { what, len });
        let fs = nix::sys::statfs::fstatfs(&fd).map_err(|e| refuse(format!("unreadable (fstatfs: {e})")))?;
        if fs.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
            return Err(refuse(format!("on a filesystem of type {:#x}, not tmpfs", fs.filesystem_type().0)));
        }
        let file = File::from(fd);
        let meta = file.metadata().map_err(|e| refuse(format!("unreadable (fstat: {e})")))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        if meta.len() < len as u64 {
            return Err(refuse(format!("{} bytes long", meta.len())));
        }
        let mut b = Self::map_memfd(file, len)?;
        b.kind = BufferKind::ShmFile;
        b.file_access_only = !owner;
        if let Some(region) = &b.region {
            populate(region);
        }
        Ok(b)
    }

    /// A new udmabuf of `len` bytes, mapped through its memfd (so it can also
    /// be registered for `host_fixed`).
    pub fn udmabuf(name: &str, len: usize) -> Result<Self, BufferError> {
        let (buf, memfd) = dmabuf::create_udmabuf(name, len as u64)?;
        let mut b = Self::map_memfd(memfd, len)?;
        b.kind = BufferKind::DmaBuf;
        b.dmabuf = Some(buf);
        Ok(b)
    }

    /// A new buffer of `len` bytes from DMA heap `heap`, mapped with the
    /// DMA-BUF's own `mmap`.
    pub fn dma_heap(heap: &str, len: usize) -> Result<Self, BufferError> {
        let buf = dmabuf::alloc_from_heap(heap, len as u64)?;
        Self::from_dmabuf(buf, None)
    }

    /// Wraps an imported DMA-BUF. With `backing` (a udmabuf's memfd), the
    /// memory is mapped through the memfd; otherwise through the DMA-BUF's own
    /// `mmap` if the exporter allows it, else not at all (device memory).
    pub fn from_dmabuf(buf: dmabuf::DmaBuf, backing: Option<OwnedFd>) -> Result<Self, BufferError> {
        let len = usize::try_from(buf.size()).map_err(|_| BufferError::ZeroLength)?;
        let region = match backing {
            Some(fd) => {
                let mut b = Self::from_memfd(fd, len)?;
                b.kind = BufferKind::DmaBuf;
                b.dmabuf = Some(buf);
                return Ok(b);
            }
            None => buf
                .try_clone_fd()
                .ok()
                .and_then(|fd| MmapRegion::from_file(FileOffset::new(File::from(fd), 0), len).ok()),
        };
        Ok(Buffer {
            region,
            kind: BufferKind::DmaBuf,
            memfd: None,
            dmabuf: Some(buf),
            len,
            file_access_only: false,
            unchecked: false,
            shrunk: AtomicBool::new(false),
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is 0 bytes (never: a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whose memory it is.
    pub fn kind(&self) -> BufferKind {
        self.kind
    }

    /// The memfd (or shm file) behind a shared buffer, to pass to another process.
    pub fn memfd_fd(&self) -> Option<BorrowedFd<'_>> {
        self.memfd.as_ref().map(|f| f.as_fd())
    }

    /// The DMA-BUF behind this buffer, if it is one.
    pub fn dmabuf(&self) -> Option<&dmabuf::DmaBuf> {
        self.dmabuf.as_ref()
    }

    /// Whether this process can read and write the bytes (and so register
    /// them for `host`/`host_fixed`).
    pub fn is_mapped(&self) -> bool {
        self.region.is_some()
    }

    /// Whether this process checksums what is stored from it: any buffer it
    /// has mapped — a shm file its owner may shrink too, in place with a
    /// shrink caught (`buffer/shm_guard.rs`) — but not a DMA-BUF it cannot
    /// map (whose checksums come from the side that can).
    pub fn stores_checksummed_here(&self) -> bool {
        self.is_mapped()
    }

    /// Whether this process checksums what is loaded into it: any buffer it
    /// has mapped — a shm file its owner may shrink too, in place with a
    /// shrink caught (`buffer/shm_guard.rs`) — unless its owner asked it not to
    /// ([`Buffer::skip_load_checks`]).
    pub fn loads_checksummed_here(&self) -> bool {
        self.region.is_some() && !self.unchecked
    }

    /// Whether an in-place check found this shm file buffer shrunk by its
    /// owner (from then on its bytes are reached through the file only).
    pub fn found_shrunk(&self) -> bool {
        self.shrunk.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Loads into this buffer are not checksummed here (its chunks are
    /// answered `unverified`, as a DMA-BUF's this process cannot map);
    /// stores from it still are. Only for a benchmark measuring what
    /// verification costs (`pdstor bench-handoff --no-verify`): a reader
    /// that asks for it checks nothing.
    pub fn skip_load_checks(&mut self) {
        self.unchecked = true;
    }

    /// Whether [`Buffer::skip_load_checks`] was asked for.
    pub fn loads_unchecked(&self) -> bool {
        self.unchecked
    }

    /// Start address of the CPU mapping, for the kernel (io_uring SQEs,
    /// buffer registration).
    pub fn addr(&self) -> Result<u64, BufferError> {
        // Found shrunk: the mapping is private zero pages now, not the file.
        if self.found_shrunk() {
            return Err(BufferError::Shrunk);
        }
        Ok(self.region()?.as_ptr() as u64)
    }

    fn region(&self) -> Result<&MmapRegion<()>, BufferError> {
        self.region.as_ref().ok_or_else(|| BufferError::NoCpuMapping {
            exporter: self.dmabuf.as_ref().map_or("unknown", |d| d.exporter()).to_owned(),
        })
    }

    /// Checks that `offset..offset + count` lies within the buffer.
    pub fn check_range(&self, offset: u64, count: usize) -> Result<(), BufferError> {
        let oob = || BufferError::OutOfBounds { offset, count, len: self.len() };
        let end = offset.checked_add(count as u64).ok_or_else(oob)?;
        if end > self.len as u64 { Err(oob()) } else { Ok(()) }
    }

    /// A bounds-checked volatile view of `count` bytes at `offset`.
    pub fn slice(&self, offset: u64, count: usize) -> Result<VolatileSlice<'_>, BufferError> {
        self.check_range(offset, count)?;
        if self.file_access_only {
            return Err(BufferError::FileAccessOnly);
        }
        let oob = || BufferError::OutOfBounds { offset, count, len: self.len() };
        let offset = usize::try_from(offset).map_err(|_| oob())?;
        self.region()?.get_slice(offset, count).map_err(|_| oob())
    }

    /// Copies `src` into the buffer at `offset` (a DMA-BUF's access is
    /// bracketed with `DMA_BUF_IOCTL_SYNC` and counted).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), BufferError> {
        if let Some(file) = self.through_file() {
            self.check_range(offset, src.len())?;
            let io = |source| BufferError::ShmFileIo { op: "writing", offset, count: src.len(), source };
            return std::os::unix::fs::FileExt::write_all_at(file, src, offset).map_err(io);
        }
        let slice = self.slice(offset, src.len())?;
        let _access = self.dmabuf.as_ref().map(|d| d.begin_cpu_access(dmabuf::Access::Write)).transpose()?;
        slice.copy_from(src);
        Ok(())
    }

    /// Start of the CPU mapping, for code that lends the bytes out without a
    /// copy (the Python buffer protocol). Valid while `self` lives. The bytes
    /// are shared with the daemon, which writes them only during a load this
    /// process asked for.
    pub fn as_mut_ptr(&self) -> Result<*mut u8, BufferError> {
        if self.file_access_only {
            return Err(BufferError::FileAccessOnly);
        }
        Ok(self.region()?.as_ptr())
    }

    /// crc32c of `count` bytes at `offset`, computed in place in the mapping:
    /// no copy (bracketed and counted for a DMA-BUF). Call it once whatever
    /// wrote the range (a load, or the device reading a store) has completed.
    ///
    /// The daemon calls it on a client's shared memory too. A client that
    /// writes its own buffer while its own store or load is being checked can
    /// only make the checksum disagree — its store refused, its load failed —
    /// never anything else: the routine reads each byte once and nothing but
    /// the checksum depends on the values. A copy out first (volatile reads
    /// into a scratch block) bought no safety that matters and cost as much
    /// as the checksum itself (measured: the daemon's verifier thread spent
    /// twice as long in memmove as in crc32c).
    pub fn crc32c(&self, offset: u64, count: usize) -> Result<u32, BufferError> {
        self.check_range(offset, count)?;
        if let Some(file) = self.through_file() {
            return match self.crc32c_guarded(offset, count) {
                Some(crc) => Ok(crc),
                None => crc32c_of_file(file, offset, count),
            };
        }
        let base = self.as_mut_ptr()?;
        let _access = self.dmabuf.as_ref().map(|d| d.begin_cpu_access(dmabuf::Access::Read)).transpose()?;
        // SAFETY: `offset..offset + count` lies within the mapping
        // (check_range), which lives as long as `self`; every byte pattern is
        // a valid u8. The transfer that wrote (or read) the range has
        // completed (the caller's contract); the only other writer is the
        // buffer's owner, whose concurrent writes can change the checksum's
        // value and nothing else (see above).
        let bytes = unsafe { std::slice::from_raw_parts(base.add(offset as usize).cast_const(), count) };
        Ok(payload_crc32c(bytes))
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer (bracketed and
    /// counted for a DMA-BUF).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), BufferError> {
        if let Some(file) = self.through_file() {
            self.check_range(offset, dst.len())?;
            let count = dst.len();
            let io = |source| BufferError::ShmFileIo { op: "reading", offset, count, source };
            return std::os::unix::fs::FileExt::read_exact_at(file, dst, offset).map_err(io);
        }
        let slice = self.slice(offset, dst.len())?;
        let _access = self.dmabuf.as_ref().map(|d| d.begin_cpu_access(dmabuf::Access::Read)).transpose()?;
        slice.copy_to(dst);
        Ok(())
    }
}

impl Buffer {
    /// crc32c of a range of a shm file buffer its owner may shrink, in place
    /// with `SIGBUS` caught (`buffer/shm_guard.rs`); `None` if the file was found
    /// shrunk (now or before): read it through the file.
    fn crc32c_guarded(&self, offset: u64, count: usize) -> Option<u32> {
        let region = self.region.as_ref()?;
        let base = region.as_ptr().cast_const();
        shm_guard::check_in_place((base, region.size()), &self.shrunk, || {
            // SAFETY: `offset..offset + count` lies within the mapping (the
            // caller checked the range), which lives as long as `self`; every
            // byte pattern is a valid u8. A truncation by the owner turns a
            // read of a page past the new end into SIGBUS, which the guard
            // answers by mapping zero pages over the mapping (so the read
            // completes, and its answer is discarded); concurrent writes by
            // the owner can change the checksum's value and nothing else.
            let bytes = unsafe { std::slice::from_raw_parts(base.add(offset as usize), count) };
            payload_crc32c(bytes)
        })
    }

    /// The file a [`BufferKind::ShmFile`] from another process is reached
    /// through, if this is one.
    fn through_file(&self) -> Option<&File> {
        if self.file_access_only { self.memfd.as_ref() } else { None }
    }
}

/// crc32c of `count` bytes at `offset` of `file`, read through the file in
/// blocks that stay in the cache (one pass over the bytes from memory, as in
/// place; never a fault if the owner shrank the file: a short read fails).
fn crc32c_of_file(file: &File, offset: u64, count: usize) -> Result<u32, BufferError> {
    const BLOCK: usize = 256 << 10;
    let mut block = vec![0u8; BLOCK.min(count)];
    let mut crc = 0u32;
    let mut done = 0usize;
    while done < count {
        let n = BLOCK.min(count - done);
        let at = offset + done as u64;
        std::os::unix::fs::FileExt::read_exact_at(file, &mut block[..n], at)
            .map_err(|source| BufferError::ShmFileIo { op: "reading", offset: at, count: n, source })?;
        crc = crate::crc32c::append(crc, &block[..n]);
        done += n;
    }
    Ok(crc)
}

/// CRC-32C (Castagnoli, the iSCSI polynomial) of payload bytes, with the
/// fastest implementation this CPU runs ([`crate::crc32c::chosen`]). Every
/// payload byte passes through this once per load and once per store: its
/// speed is the handoff's.
pub fn payload_crc32c(bytes: &[u8]) -> u32 {
    crate::crc32c::checksum(bytes)
}

/// Faults a shared-memory file's pages in, now, writable: its owner (LMCache)
/// made it lazily, and a page first touched by a transfer costs that
/// transfer its allocation, zeroing and fault — measured, a fresh 8 MiB
/// memory object took a load three times as long as a reused one. As
/// LMCache pins its own pool when it starts. Advisory: a kernel without
/// `MADV_POPULATE_WRITE` (before 5.14) leaves the pages to fault later, and
/// a file shrunk meanwhile fails the advice (`EFAULT`), never the process.
fn populate(region: &MmapRegion<()>) {
    // SAFETY: madvise on the whole of a mapping this region owns; populating
    // changes no contents (shmem pages read as zeros until written) and no
    // mapping bounds.
    let _ = unsafe { libc::madvise(region.as_ptr().cast(), region.size(), libc::MADV_POPULATE_WRITE) };
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
mod tests;
