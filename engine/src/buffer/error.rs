//! What making, receiving or touching a buffer fails on.

use super::{BufferKind, dmabuf};

/// What making, receiving or touching a buffer failed on.
#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    /// A buffer of 0 bytes.
    #[error("a buffer of 0 bytes is useless: give a length of at least one page")]
    ZeroLength,
    /// Mapping anonymous or memfd memory failed.
    #[error("mapping a {kind} buffer of {len} bytes failed: {source}")]
    Map {
        /// The kind of buffer.
        kind: BufferKind,
        /// Its length.
        len: usize,
        /// vm-memory's error.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// `memfd_create` or sizing the memfd failed.
    #[error("creating memfd {name:?} of {len} bytes failed: {source}")]
    Memfd {
        /// The memfd's name.
        name: String,
        /// Its length.
        len: usize,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// A range outside the buffer.
    #[error(
        "range {offset}..{end} is outside the {len}-byte buffer: keep offset + length within the buffer",
        end = offset.saturating_add(*count as u64)
    )]
    OutOfBounds {
        /// Where it starts.
        offset: u64,
        /// Its length.
        count: usize,
        /// The buffer's length.
        len: usize,
    },
    /// Importing or touching a DMA-BUF failed.
    #[error(transparent)]
    DmaBuf(#[from] dmabuf::DmaBufError),
    /// Device memory this process cannot map.
    #[error(
        "the {exporter} DMA-BUF has no CPU mapping in this process (device memory): only the dmabuf_fixed path can move it, and its checksums must come from the client"
    )]
    NoCpuMapping {
        /// The DMA-BUF's exporter.
        exporter: String,
    },
    /// A received fd that is not a memfd sealed against shrinking (nor a
    /// DMA-BUF): its owner could shrink it under the mapping.
    #[error(
        "the received fd is {what}: only a memfd sealed against shrinking is accepted (memfd_create with MFD_ALLOW_SEALING, then fcntl(F_ADD_SEALS, F_SEAL_SHRINK)), or a DMA-BUF"
    )]
    NotSealedMemfd {
        /// What it is instead.
        what: String,
    },
    /// Not a shared-memory file (or one smaller than asked).
    #[error(transparent)]
    NotShmFile(#[from] NotShmFile),
    /// Reading or writing a shm file buffer through its file failed (it was
    /// shrunk under the range, say).
    #[error(
        "{op} {count} bytes at {offset} of the shm file buffer failed: {source} (did its owner shrink or close the file?)"
    )]
    ShmFileIo {
        /// `reading` or `writing`.
        op: &'static str,
        /// Where.
        offset: u64,
        /// How many bytes.
        count: usize,
        /// The kernel's error, or a short transfer.
        #[source]
        source: std::io::Error,
    },
    /// A shm file buffer an in-place check found shrunk by its owner: its
    /// mapping is zero pages now, so no transfer may use it.
    #[error(
        "the shm file buffer was shrunk by its owner under the daemon's in-place check of a transfer: no transfer uses it again; unregister it and register the file anew once it is whole"
    )]
    Shrunk,
    /// The CPU view of a buffer this process reaches only through its file.
    #[error(
        "a shm file buffer is not touched through its mapping (its owner may shrink the file): use read_at, write_at or crc32c"
    )]
    FileAccessOnly,
    /// Pieces of a range to copy out that do not fit it.
    #[error("copying pieces out of {count} bytes at {offset}: {why}; give pieces in ascending order, within the range")]
    Pieces {
        /// Where the range starts.
        offset: u64,
        /// Its length.
        count: usize,
        /// What is wrong with the pieces.
        why: String,
    },
}

/// An fd offered as a shared-memory file that is not one.
#[derive(Debug, thiserror::Error)]
#[error(
    "the fd is {what}: a shm file buffer must be a file on tmpfs (a POSIX shared-memory object in /dev/shm, or a memfd) of at least {len} bytes"
)]
pub struct NotShmFile {
    /// What it is instead.
    pub what: String,
    /// The length asked for.
    pub len: usize,
}
