//! The data plane's bodies: the frames a writer or reader sends over the
//! Unix socket (buffers shared by fd, stores, loads, `many`) and their answers.

use serde::{Deserialize, Serialize};

use super::*;

/// What a `register` frame's fds are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SharedKind {
    /// One fd: a memfd.
    #[default]
    Memfd,
    /// One or two fds: a DMA-BUF, then optionally the memfd behind it (a
    /// udmabuf's), through which the daemon maps the memory for host paths.
    Dmabuf,
    /// One fd: a shared-memory file its owner can still shrink (a POSIX
    /// shared-memory object in `/dev/shm`, such as LMCache's CPU pool with
    /// `shm_name`, or an unsealed memfd). The daemon maps it for its I/O and
    /// reads or writes its bytes itself only through the file, so a
    /// truncation fails a transfer rather than the daemon.
    Shm,
}

/// Data-plane requests: one JSON frame each (`u32` little-endian length, then
/// JSON). `Register` travels with the buffer's fd(s) in `SCM_RIGHTS`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum DataRequest {
    /// Share a buffer for one path (default `host_fixed`); every chunk stored
    /// from or loaded into it moves on that path.
    Register {
        /// The buffer's length in bytes.
        len: u64,
        /// What the fds are.
        #[serde(default)]
        kind: SharedKind,
        /// The path its chunks move on (default `host_fixed`).
        #[serde(default)]
        path: Option<pdstor_engine::io::PayloadPath>,
        /// The daemon does not checksum loads into it: their chunks are
        /// answered `unverified`. For a benchmark of what verification
        /// costs only (`pdstor bench-handoff --no-verify`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unchecked: bool,
    },
    /// One store batch from registered buffers.
    Store {
        /// The PREPARED publication.
        publication: u64,
        /// Its writer's token (`prepare` answered it).
        writer_token: String,
        /// The chunks and where their bytes are.
        chunks: Vec<DataChunk>,
        /// The writer sends no batch after this one.
        is_last_batch: bool,
        /// The request's total, as prepared.
        total_chunks: u32,
    },
    /// Load chunks of an adopted publication into registered buffers.
    Load {
        /// The claim receipt.
        receipt: Receipt,
        /// The chunks and where to put them.
        chunks: Vec<DataChunk>,
        /// Acknowledge the claim once this load is done (step 7 in the same
        /// request): the daemon checks every chunk of it against the
        /// manifest itself and commits the ACK (group-committed with the
        /// other acks of the frame) before it answers `acked`. Refused before
        /// anything is loaded where the daemon cannot check a chunk of this
        /// load (a DMA-BUF it cannot map, a buffer registered unchecked), a
        /// chunk loaded earlier was not checked by it (answered `unverified`:
        /// only the reader's own ack vouches for those), chunks of the claim
        /// would be left unloaded, or the claim is loaded by another request
        /// of the same frame; a chunk that does not match fails the request
        /// and acknowledges nothing (fail the claim).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        ack: bool,
    },
    /// Store and load requests of many publications in one frame, at most
    /// [`MAX_DATA_MANY`]: the I/O of consecutive stores (or loads) goes to
    /// the device as one submission. Answered in `many`, one response per
    /// request, in order, each what the request alone would have answered.
    Many {
        /// The requests: `store` or `load` each.
        requests: Vec<DataRequest>,
    },
}

/// The most requests one data-plane `many` frame may carry.
pub const MAX_DATA_MANY: usize = 1024;

/// One chunk of a data-plane store or load.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct DataChunk {
    /// The chunk's index in its publication.
    pub index: u32,
    /// The buffer id `register` answered.
    pub buffer: u32,
    /// Where in that buffer, in bytes.
    pub offset: u64,
    /// Bytes to store (ignored by loads: the manifest says).
    #[serde(default)]
    pub len: u64,
    /// The writer's crc32c of the chunk (stores). Checked against the bytes
    /// where the daemon can map them; required where it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

/// The data plane's answer to one request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DataResponse {
    /// Whether the request succeeded (`error` says why not).
    pub ok: bool,
    /// `register`: the buffer's id on this connection.
    pub buffer: Option<u32>,
    /// `store`: chunks of the request stored so far.
    pub completed: Option<u32>,
    /// `store`: chunks the request declared.
    pub total: Option<u32>,
    /// `store`: every chunk stored and the last batch seen.
    pub publishable: Option<bool>,
    /// The path each chunk moved on.
    pub paths: Vec<String>,
    /// crc32c of each loaded chunk, as read (chunks in `unverified` omitted).
    pub crc32c: Vec<u32>,
    /// Loaded chunks the daemon could not checksum (memory it cannot map):
    /// the reader must verify them.
    #[serde(default)]
    pub unverified: Vec<u32>,
    /// The exporter of a registered DMA-BUF, as the kernel names it.
    #[serde(default)]
    pub exporter: Option<String>,
    /// Observed provenance of each chunk (`native`, `fallback(..)`,
    /// `unverifiable(..)`) when the daemon runs with `--provenance`.
    #[serde(default)]
    pub verdicts: Vec<String>,
    /// Why the request failed.
    pub error: Option<ErrorBody>,
    /// `load` with `ack`: the claim was acknowledged (its ACK durable).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub acked: bool,
    /// `many`: the response to each of its requests, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub many: Vec<DataResponse>,
}
