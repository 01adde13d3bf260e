//! What the engine refuses or fails, each variant naming the operation and
//! the transfer, with the kernel's error as its source.

use std::path::PathBuf;

use super::nvme::{self, NvmeStatus};
use super::{BufferId, MAX_TRANSFER_ID, Op, PayloadPath, TransferId};
use crate::buffer::BufferError;

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("opening target {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("target {path} is a directory: give a file, a block device or /dev/ngXnY")]
    IsDirectory { path: PathBuf },
    #[error("target {path} is {what}: give a file, a block device or /dev/ngXnY")]
    UnsupportedKind { path: PathBuf, what: &'static str },
    #[error(
        "target {path} is on {fs}, which cannot do direct I/O (it would copy through the page cache): put the target on ext4, XFS or a block device"
    )]
    NoDirectIo { path: PathBuf, fs: String },
    #[error("target {path} is in use{}: unmount it or stop the other user first", mount.as_ref().map(|m| format!(" (mounted on {m})")).unwrap_or_else(|| " by another exclusive opener".into()))]
    Busy { path: PathBuf, mount: Option<String> },
    #[error("target {path} is locked by another process (another pdstor?): stop it first")]
    Locked { path: PathBuf },
    #[error("reading the {what} of target {path}: {source}")]
    Geometry {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("preallocating {len} bytes for target {path}: {source} (is the filesystem full, or without fallocate?)")]
    Preallocate {
        path: PathBuf,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("io_uring {op} failed: {source}")]
    Ring {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("registering {buffer} ({len} bytes) with io_uring failed: {source}{hint}", hint = register_hint(source))]
    Register {
        buffer: BufferId,
        len: usize,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the dmabuf_fixed path is not available: {why}. It needs the io_uring rw-dmabuf series (IORING_RSRC_UPDATE_EXTENDED with io_uring_regbuf_desc type DMABUF), which no released kernel has: boot a kernel built with it and kernel-config/dmabuf-rw.config, or use host_fixed"
    )]
    DmabufUnsupported { why: String },
    #[error("{buffer} cannot be used here: {what}")]
    BufferUnusable { buffer: BufferId, what: BufferError },
    #[error(
        "the {exporter} DMA-BUF's own CPU mapping cannot be pinned for direct I/O ({source}): the exporter maps raw page frames, which host and host_fixed cannot use without a copy; send its backing memfd (udmabuf), or use dmabuf_fixed"
    )]
    DmabufNotPinnable {
        exporter: String,
        #[source]
        source: std::io::Error,
    },
    #[error("all {slots} buffer slots are in use: remove a buffer first or raise EngineOptions::buffer_slots")]
    BufferTableFull { slots: u32 },
    #[error("{0} is not held by this engine")]
    UnknownBuffer(BufferId),
    #[error("{transfer}: {what}")]
    Buffer { transfer: TransferId, what: BufferError },
    #[error(
        "{transfer}: {field} {value} is not a multiple of {align} bytes, which direct I/O on this target needs; no payload path accepts it: align it"
    )]
    Unaligned { transfer: TransferId, field: &'static str, value: u64, align: u32 },
    #[error("{transfer}: a request of 0 bytes moves nothing: give a length")]
    EmptyRequest { transfer: TransferId },
    #[error("{transfer}: target range {offset}..{end} is beyond the target's {capacity} bytes", end = offset.saturating_add(*len))]
    BeyondTarget { transfer: TransferId, offset: u64, len: u64, capacity: u64 },
    #[error("{transfer}: id is above {max}, the largest that fits in user_data beside the segment bits", max = MAX_TRANSFER_ID)]
    TransferIdTooLarge { transfer: TransferId },
    #[error("{transfer}: path {path} is not available: {why}; {hint}")]
    PathUnavailable { transfer: TransferId, path: PayloadPath, why: &'static str, hint: &'static str },
    #[error("{transfer}: {op} of {len} bytes at target offset {offset} failed: {source}")]
    Transfer {
        transfer: TransferId,
        op: Op,
        offset: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("{transfer}: NVMe {cmd} of {len} bytes at target offset {offset} failed: {status}", cmd = nvme_cmd_name(*op))]
    Nvme { transfer: TransferId, op: Op, offset: u64, len: u64, status: NvmeStatus },
    #[error(
        "{transfer}: {op} at target offset {offset} moved 0 of {expected} bytes: the target ended or stopped making progress"
    )]
    ShortTransfer { transfer: TransferId, op: Op, offset: u64, expected: u64 },
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
        )
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
        Op::Write => nvme::opcode_name(nvme::OPC_WRITE),
        Op::Flush => nvme::opcode_name(nvme::OPC_FLUSH),
    }
}
