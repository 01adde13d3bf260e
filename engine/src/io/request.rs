//! The engine's vocabulary: which path a payload takes, what a request
//! asks, and the numbers that name transfers, buffers and offsets.

use std::fmt;
use std::time::Duration;

use super::{IoError, MAX_TRANSFER_ID};

/// Payload provenance (DESIGN §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadPath {
    /// Plain `READ`/`WRITE` from unregistered memory.
    Host,
    /// `READ_FIXED`/`WRITE_FIXED` from a buffer registered with the ring.
    HostFixed,
    /// The DMA-BUF itself installed in the buffer table (the rw-dmabuf series).
    DmabufFixed,
}

impl PayloadPath {
    /// Every path, in ladder order.
    pub const ALL: [PayloadPath; 3] = [PayloadPath::Host, PayloadPath::HostFixed, PayloadPath::DmabufFixed];
    /// The path's name (`host`, `host_fixed`, `dmabuf_fixed`).
    pub fn as_str(self) -> &'static str {
        match self {
            PayloadPath::Host => "host",
            PayloadPath::HostFixed => "host_fixed",
            PayloadPath::DmabufFixed => "dmabuf_fixed",
        }
    }
}

impl fmt::Display for PayloadPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for PayloadPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown path {s:?}: expected host, host_fixed or dmabuf_fixed"))
    }
}

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Target to buffer.
    Read,
    /// Buffer to target.
    Write,
    /// Buffer to target, durable when it completes, whatever the device's
    /// write cache: Force Unit Access on NVMe, `RWF_DSYNC` on files and
    /// block devices (`REQ_FUA`, or a flush after it where the device has no
    /// FUA). Writes before it are not made durable by it.
    WriteFua,
    /// Make earlier writes durable.
    Flush,
}

impl Op {
    /// Whether it moves bytes to the target.
    pub fn writes(self) -> bool {
        matches!(self, Op::Write | Op::WriteFua)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::WriteFua => "write (FUA)",
            Op::Flush => "flush",
        })
    }
}

/// Names one payload transfer end to end; carried in every SQE's `user_data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct TransferId(pub u64);

impl TransferId {
    /// Bits of a chunk's transfer id that number the chunk in its publication.
    pub const CHUNK_BITS: u32 = 16;
    /// The most chunks one publication can have: each needs a transfer id.
    pub const MAX_CHUNKS: u32 = 1 << Self::CHUNK_BITS;
    /// The largest publication number whose chunks all have transfer ids.
    pub const MAX_PUBLICATION: u64 = MAX_TRANSFER_ID >> Self::CHUNK_BITS;

    /// The transfer of chunk `chunk` of publication `publication`: the one
    /// place the two are packed (`publication << CHUNK_BITS | chunk`), which
    /// the probes' verdicts and the timeline read back with
    /// [`chunk_parts`](Self::chunk_parts). The store refuses a prepare whose
    /// numbers would not fit, so a caller past it holds numbers that do.
    pub fn chunk(publication: u64, chunk: u32) -> TransferId {
        match Self::try_chunk(publication, chunk) {
            Some(t) => t,
            None => panic!("chunk {chunk} of publication {publication} has no transfer id"),
        }
    }

    /// [`chunk`](Self::chunk) for numbers not yet checked: `None` where they
    /// do not fit.
    pub fn try_chunk(publication: u64, chunk: u32) -> Option<TransferId> {
        (publication <= Self::MAX_PUBLICATION && chunk < Self::MAX_CHUNKS)
            .then(|| TransferId(publication << Self::CHUNK_BITS | u64::from(chunk)))
    }

    /// The publication and chunk a [`chunk`](Self::chunk) transfer id packs.
    pub fn chunk_parts(self) -> (u64, u32) {
        (self.0 >> Self::CHUNK_BITS, (self.0 & u64::from(Self::MAX_CHUNKS - 1)) as u32)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transfer {}", self.0)
    }
}

/// A buffer held by the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct BufferId(pub u32);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer {}", self.0)
    }
}

/// A byte offset on the target (file, block device or namespace). Kept apart
/// from [`BufferOffset`] so that the two cannot be swapped. Serialized as the
/// bare number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct TargetOffset(pub u64);

/// A byte offset into a held buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BufferOffset(pub u64);

impl fmt::Display for TargetOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "target offset {}", self.0)
    }
}

impl fmt::Display for BufferOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buffer offset {}", self.0)
    }
}

/// One payload transfer between a buffer range and a target range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoRequest {
    /// The transfer this request belongs to (its SQEs carry it).
    pub transfer: TransferId,
    /// Read or write.
    pub op: Op,
    /// The path it must move on.
    pub path: PayloadPath,
    /// The held buffer.
    pub buffer: BufferId,
    /// Where in the buffer.
    pub buffer_offset: BufferOffset,
    /// Where on the target.
    pub target_offset: TargetOffset,
    /// Bytes.
    pub len: u64,
}

/// How one request ended, and on which path its bytes moved.
#[derive(Debug)]
pub struct Completion {
    /// The transfer.
    pub transfer: TransferId,
    /// Read, write or flush.
    pub op: Op,
    /// The path it moved on.
    pub path: PayloadPath,
    /// Bytes moved.
    pub bytes: u64,
    /// From submission to its last completion.
    pub latency: Duration,
    /// How it ended.
    pub result: Result<(), IoError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_transfer_packs_and_unpacks() {
        let t = TransferId::chunk(7, 3);
        assert_eq!(t, TransferId(7 << 16 | 3));
        assert_eq!(t.chunk_parts(), (7, 3));
        let last = TransferId::chunk(TransferId::MAX_PUBLICATION, TransferId::MAX_CHUNKS - 1);
        assert_eq!(last.0, MAX_TRANSFER_ID, "the largest chunk transfer is the largest transfer id");
        assert_eq!(TransferId::try_chunk(1, TransferId::MAX_CHUNKS), None);
        assert_eq!(TransferId::try_chunk(TransferId::MAX_PUBLICATION + 1, 0), None);
    }
}
