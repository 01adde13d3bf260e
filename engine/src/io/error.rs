//! What the engine refuses or fails, each variant naming the operation and
//! the transfer, with the kernel's error as its source.

use std::path::PathBuf;

use super::nvme::{self, NvmeStatus};
use super::{BufferId, MAX_TRANSFER_ID, Op, PayloadPath, TransferId};
use crate::buffer::BufferError;

/// What the engine refused or failed: every variant names the operation, the target or transfer, and what to do.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The target could not be opened.
    #[error("opening target {path}: {source}")]
    Open {
        /// The target.
        path: PathBuf,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// The target is a directory.
    #[error("target {path} is a directory: give a file, a block device or /dev/ngXnY")]
    IsDirectory {
        /// The target.
        path: PathBuf,
    },
    /// The target is neither a file, a block device nor an NVMe generic device.
    #[error("target {path} is {what}: give a file, a block device or /dev/ngXnY")]
    UnsupportedKind {
        /// The target.
        path: PathBuf,
        /// What it is.
        what: &'static str,
    },
    /// The target's filesystem cannot do direct I/O.
    #[error(
        "target {path} is on {fs}, which cannot do direct I/O (it would copy through the page cache): put the target on ext4, XFS or a block device"
    )]
    NoDirectIo {
        /// The target.
        path: PathBuf,
        /// The filesystem.
        fs: String,
    },
    /// Another user holds the target (a mount, an exclusive opener).
    #[error("target {path} is in use{}: unmount it or stop the other user first", mount.as_ref().map(|m| format!(" (mounted on {m})")).unwrap_or_else(|| " by another exclusive opener".into()))]
    Busy {
        /// The target.
        path: PathBuf,
        /// Where it is mounted, if it is.
        mount: Option<String>,
    },
    /// Another process holds the target's lock.
    #[error("target {path} is locked by another process (another pdstor?): stop it first")]
    Locked {
        /// The target.
        path: PathBuf,
    },
    /// The target's geometry could not be read.
    #[error("reading the {what} of target {path}: {source}")]
    Geometry {
        /// The target.
        path: PathBuf,
        /// What was being read (size, block size, …).
        what: &'static str,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// Space for a file target could not be preallocated.
    #[error("preallocating {len} bytes for target {path}: {source} (is the filesystem full, or without fallocate?)")]
    Preallocate {
        /// The target.
        path: PathBuf,
        /// The bytes asked for.
        len: u64,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// An io_uring operation on the ring itself failed.
    #[error("io_uring {op} failed: {source}")]
    Ring {
        /// The operation (setup, register_files, io_uring_enter, …).
        op: &'static str,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// A buffer could not be registered with the ring.
    #[error("registering {buffer} ({len} bytes) with io_uring failed: {source}{hint}", hint = register_hint(source))]
    Register {
        /// The buffer.
        buffer: BufferId,
        /// Its length in bytes.
        len: usize,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// This kernel cannot install a DMA-BUF in the buffer table (`dmabuf_fixed`).
    #[error(
        "the dmabuf_fixed path is not available: {why}. It needs the io_uring rw-dmabuf series (IORING_RSRC_UPDATE_EXTENDED with io_uring_regbuf_desc type DMABUF), which no released kernel has: boot a kernel built with it and kernel-config/dmabuf-rw.config, or use host_fixed"
    )]
    DmabufUnsupported {
        /// What the probe found.
        why: String,
    },
    /// A write or flush on a target opened read-only.
    #[error(
        "{transfer}: {op} refused: {path} was opened read-only (a reader beside the namespace's owner); only the owner's daemon writes it"
    )]
    ReadOnlyTarget {
        /// The transfer.
        transfer: TransferId,
        /// What was asked.
        op: Op,
        /// The target.
        path: std::path::PathBuf,
    },
    /// A DMA-BUF larger than the rw-dmabuf series installs.
    #[error(
        "a {len}-byte DMA-BUF is larger than the {max} bytes (1 GiB) the io_uring rw-dmabuf series installs in one buffer slot; nothing was installed: export it as several DMA-BUFs of at most 1 GiB and register each"
    )]
    DmabufTooLarge {
        /// The DMA-BUF's size.
        len: usize,
        /// The series' limit.
        max: u64,
    },
    /// A buffer cannot be used on the path asked for.
    #[error("{buffer} cannot be used here: {what}")]
    BufferUnusable {
        /// The buffer.
        buffer: BufferId,
        /// Why not.
        what: BufferError,
    },
    /// A DMA-BUF whose CPU mapping cannot be pinned for `host`/`host_fixed`.
    #[error(
        "the {exporter} DMA-BUF's own CPU mapping cannot be pinned for direct I/O ({source}): the exporter maps raw page frames, which host and host_fixed cannot use without a copy; send its backing memfd (udmabuf), or use dmabuf_fixed"
    )]
    DmabufNotPinnable {
        /// The DMA-BUF's exporter.
        exporter: String,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// Every place in the buffer table is taken.
    #[error("all {slots} buffer slots are in use: remove a buffer first or raise EngineOptions::buffer_slots")]
    BufferTableFull {
        /// The table's size.
        slots: u32,
    },
    /// No buffer with this id is held.
    #[error("{0} is not held by this engine")]
    UnknownBuffer(BufferId),
    /// A request's range does not fit its buffer.
    #[error("{transfer}: {what}")]
    Buffer {
        /// The transfer.
        transfer: TransferId,
        /// Why not.
        what: BufferError,
    },
    /// A request is not aligned as direct I/O on this target needs.
    #[error(
        "{transfer}: {field} {value} is not a multiple of {align} bytes, which direct I/O on this target needs; no payload path accepts it: align it"
    )]
    Unaligned {
        /// The transfer.
        transfer: TransferId,
        /// Which number (buffer address, target offset, length).
        field: &'static str,
        /// Its value.
        value: u64,
        /// The alignment needed, in bytes.
        align: u32,
    },
    /// A request of 0 bytes.
    #[error("{transfer}: a request of 0 bytes moves nothing: give a length")]
    EmptyRequest {
        /// The transfer.
        transfer: TransferId,
    },
    /// A request reaches past the end of the target.
    #[error("{transfer}: target range {offset}..{end} is beyond the target's {capacity} bytes", end = offset.saturating_add(*len))]
    BeyondTarget {
        /// The transfer.
        transfer: TransferId,
        /// Where it starts.
        offset: u64,
        /// Its length.
        len: u64,
        /// The target's size in bytes.
        capacity: u64,
    },
    /// A transfer id too large for `user_data` beside the segment bits.
    #[error("{transfer}: id is above {max}, the largest that fits in user_data beside the segment bits", max = MAX_TRANSFER_ID)]
    TransferIdTooLarge {
        /// The transfer.
        transfer: TransferId,
    },
    /// The path cannot serve this request; nothing was submitted.
    #[error("{transfer}: path {path} is not available: {why}; {hint}")]
    PathUnavailable {
        /// The transfer.
        transfer: TransferId,
        /// The path asked for.
        path: PayloadPath,
        /// Why it cannot.
        why: &'static str,
        /// What would work.
        hint: &'static str,
    },
    /// A transfer failed in the kernel or on the device.
    #[error("{transfer}: {op} of {len} bytes at target offset {offset} failed: {source}{hint}", hint = transfer_hint(source))]
    Transfer {
        /// The transfer.
        transfer: TransferId,
        /// Read, write or flush.
        op: Op,
        /// Where on the target the failed command started.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
    /// An NVMe passthrough command completed with an error status.
    #[error("{transfer}: NVMe {cmd} of {len} bytes at target offset {offset} failed: {status}", cmd = nvme_cmd_name(*op))]
    Nvme {
        /// The transfer.
        transfer: TransferId,
        /// Read, write or flush.
        op: Op,
        /// Where on the target the command started.
        offset: u64,
        /// Its length in bytes.
        len: u64,
        /// The controller's status.
        status: NvmeStatus,
    },
    /// A transfer stopped making progress.
    #[error(
        "{transfer}: {op} at target offset {offset} moved 0 of {expected} bytes: the target ended or stopped making progress"
    )]
    ShortTransfer {
        /// The transfer.
        transfer: TransferId,
        /// Read or write.
        op: Op,
        /// Where on the target it stopped.
        offset: u64,
        /// The bytes still expected.
        expected: u64,
    },
}

impl IoError {
    /// Whether the engine refused a request before submitting anything
    /// because the request itself was wrong (a client's error, nothing moved).
    pub fn is_bad_request(&self) -> bool {
        matches!(
            self,
            IoError::Buffer { .. }
                | IoError::Unaligned { .. }
                | IoError::BeyondTarget { .. }
                | IoError::UnknownBuffer(_)
                | IoError::EmptyRequest { .. }
                | IoError::ReadOnlyTarget { .. }
        )
    }
}

fn transfer_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        // BLK_STS_RESV_CONFLICT: NVMe's Reservation Conflict status.
        Some(libc::EBADE) => {
            " (a persistent-reservation conflict: this host has no registered key on the namespace, or its key was preempted: its reader fenced, or its owner taken over by a standby)"
        }
        _ => "",
    }
}

fn register_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOMEM) => {
            " (pinned memory is limited by RLIMIT_MEMLOCK: raise `ulimit -l` or run with CAP_IPC_LOCK)"
        }
        Some(libc::EINVAL) => " (one registered buffer is at most 1 GiB; use several)",
        Some(libc::EOPNOTSUPP) => " (this memory cannot be pinned for fixed I/O)",
        _ => "",
    }
}

fn nvme_cmd_name(op: Op) -> &'static str {
    match op {
        Op::Read => nvme::opcode_name(nvme::OPC_READ),
        Op::Write | Op::WriteFua => nvme::opcode_name(nvme::OPC_WRITE),
        Op::Flush => nvme::opcode_name(nvme::OPC_FLUSH),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read refused for a reservation says what that means.
    #[test]
    fn a_reservation_conflict_is_named() {
        let e = IoError::Transfer {
            transfer: TransferId(7),
            op: Op::Read,
            offset: 4096,
            len: 4096,
            source: std::io::Error::from_raw_os_error(libc::EBADE),
        };
        assert!(e.to_string().contains("persistent-reservation conflict"), "{e}");
        let e = IoError::Transfer {
            transfer: TransferId(7),
            op: Op::Read,
            offset: 4096,
            len: 4096,
            source: std::io::Error::from_raw_os_error(libc::EIO),
        };
        assert!(!e.to_string().contains("reservation"), "{e}");
    }
}
