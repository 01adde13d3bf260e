//! JSON bodies of the control plane and the data plane, shared by the daemon
//! and the client so the two cannot drift apart.

use serde::{Deserialize, Serialize};

use crate::protocol::Receipt;
use crate::store::Layout;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareRequest {
    pub req_id: String,
    pub layout: Layout,
    pub total_chunks: u32,
    pub writer: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishRequest {
    pub publication: u64,
    pub first_token: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClaimRequest {
    pub receipt: Receipt,
    pub reader_id: String,
    pub session_id: String,
    pub lease_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptResponse {
    pub receipt: Receipt,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdoptRequest {
    pub receipt: Receipt,
    pub namespace: String,
    pub epoch: u64,
    pub manifest_digest: String,
    pub layout: Layout,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AckRequest {
    pub receipt: Receipt,
    pub restore_digest: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptOnly {
    pub receipt: Receipt,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbortRequest {
    pub publication: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbortResponse {
    /// `aborted`, `pending` (batches in flight) or `not_found`.
    pub outcome: String,
    pub slots: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailRequest {
    pub receipt: Receipt,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionCloseRequest {
    pub session_id: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Done {
    pub ok: bool,
}

/// Every refusal and failure: HTTP status, a stable code, the offending field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub status: u16,
    pub code: String,
    pub field: String,
    pub message: String,
}

impl ErrorBody {
    /// The body for `code`: its status follows from the code.
    pub fn new(code: crate::protocol::RefusalCode, field: &str, message: impl Into<String>) -> ErrorBody {
        ErrorBody { status: code.status(), code: code.as_str().into(), field: field.into(), message: message.into() }
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({}): {}", self.status, self.code, self.field, self.message)
    }
}

impl std::error::Error for ErrorBody {}

/// A publication as listed by `GET /storage-pd/publications`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublicationInfo {
    pub publication: u64,
    pub req_id: String,
    pub state: String,
    pub chunks: u32,
    pub writer: String,
    pub reader: Option<String>,
    /// With `?verbose=1`: where each chunk lives on the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extents: Option<Vec<Extent>>,
}

/// One chunk's place on the target: its slot and the bytes there. `len` and
/// `crc32c` are absent until the chunk is stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub chunk: u32,
    pub slot: u32,
    /// Byte offset of the slot on the target.
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

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
}

/// Data-plane requests: one JSON frame each (`u32` little-endian length, then
/// JSON). `Register` travels with the buffer's fd(s) in `SCM_RIGHTS`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum DataRequest {
    /// Share a buffer for one path (default `host_fixed`); every chunk stored
    /// from or loaded into it moves on that path.
    Register {
        len: u64,
        #[serde(default)]
        kind: SharedKind,
        #[serde(default)]
        path: Option<crate::io::PayloadPath>,
    },
    Store {
        publication: u64,
        chunks: Vec<DataChunk>,
        is_last_batch: bool,
        total_chunks: u32,
    },
    Load {
        receipt: Receipt,
        chunks: Vec<DataChunk>,
    },
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct DataChunk {
    pub index: u32,
    pub buffer: u32,
    pub offset: u64,
    /// Bytes to store (ignored by loads: the manifest says).
    #[serde(default)]
    pub len: u64,
    /// The writer's crc32c of the chunk (stores). Checked against the bytes
    /// where the daemon can map them; required where it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DataResponse {
    pub ok: bool,
    pub buffer: Option<u32>,
    pub completed: Option<u32>,
    pub total: Option<u32>,
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
    pub error: Option<ErrorBody>,
}
