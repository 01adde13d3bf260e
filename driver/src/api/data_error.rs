//! What the data plane refuses or fails, one variant per case, each with its
//! stable code and field; the HTTP-style status follows from the code
//! ([`RefusalCode::status`]), as on the control plane.

use super::error::{from_protocol, from_store};
use super::wire::{ErrorBody, SharedKind};
use crate::protocol::service::ProtocolError;
use crate::store::StoreError;
use pdstor_client::code::RefusalCode;
use pdstor_engine::buffer::BufferError;
use pdstor_engine::buffer::dmabuf::DmaBufError;

/// A data-plane request refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// More data-plane connections than `--max-data-connections`.
    #[error("{max} data-plane connections are open (--max-data-connections): retry later")]
    TooManyConnections {
        /// The limit.
        max: usize,
    },
    /// A frame over the limit: the stream cannot be resynchronised.
    #[error("{what}; the connection is closed")]
    FrameTooLarge {
        /// What the reader saw.
        what: std::io::Error,
    },
    /// A frame that is not a data-plane request.
    #[error("not a data-plane request: {0}")]
    BadFrame(#[source] serde_json::Error),
    /// A chunk names a buffer not registered on this connection.
    #[error("buffer {buffer} is not registered on this connection")]
    UnknownBuffer {
        /// The client's buffer id.
        buffer: u32,
    },
    /// Two chunks of one load land on overlapping bytes of one buffer.
    #[error(
        "chunks {first} and {second} of this load would land on the same bytes of buffer {buffer} (at offset {at}): each needs a place of its own; nothing was loaded"
    )]
    LoadOverlap {
        /// The chunk placed first.
        first: u32,
        /// The chunk whose place overlaps it.
        second: u32,
        /// The client's buffer id.
        buffer: u32,
        /// Where the second starts.
        at: u64,
    },
    /// A `many` frame the data plane cannot take as asked.
    #[error("{0}")]
    BadMany(String),
    /// A `register` of 0 bytes.
    #[error("a buffer of 0 bytes holds nothing: give its length")]
    ZeroLength,
    /// A `register` with the wrong number of fds.
    #[error("register of a {kind:?} buffer needs {expected} in SCM_RIGHTS, got {got}")]
    Fds {
        /// What the frame says the fds are.
        kind: SharedKind,
        /// What that kind needs.
        expected: &'static str,
        /// Fds received.
        got: usize,
    },
    /// The received memfd could not be mapped.
    #[error("mapping the received buffer: {0}")]
    MapMemfd(#[source] BufferError),
    /// The received DMA-BUF could not be imported.
    #[error("importing the DMA-BUF: {0}")]
    ImportDmabuf(#[source] DmaBufError),
    /// The DMA-BUF's size is not the one the request gives.
    #[error("the DMA-BUF is {actual} bytes, the request says {declared}: send its real size")]
    DmabufSize {
        /// Its real size.
        actual: u64,
        /// The size the request gave.
        declared: u64,
    },
    /// A DMA-BUF's backing memfd could not be mapped.
    #[error("mapping the DMA-BUF's backing memfd: {0}")]
    MapBacking(#[source] BufferError),
    /// The connection holds `--max-buffers-per-connection` buffers.
    #[error("this connection has {max} buffers registered (--max-buffers-per-connection)")]
    TooManyBuffers {
        /// The limit.
        max: usize,
    },
    /// The connection would pin more than `--max-pinned-per-connection` bytes.
    #[error(
        "this connection has {pinned} bytes of buffers registered; {len} more would pass {max} (--max-pinned-per-connection)"
    )]
    TooManyBytes {
        /// Bytes registered now.
        pinned: u64,
        /// Bytes asked for.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The probes saw a transfer leave the native path (`--require-native`).
    #[error("chunk {chunk} of publication {publication} took {verdict} on a {path} transfer (--require-native)")]
    NotNative {
        /// The publication.
        publication: u64,
        /// The chunk.
        chunk: u32,
        /// The probes' verdict.
        verdict: String,
        /// The path declared.
        path: pdstor_engine::io::PayloadPath,
    },
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The protocol refused.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A failure several requests share (the commit of a frame's acks).
    #[error("{}", .0.message)]
    Shared(ErrorBody),
}

impl DataError {
    /// The wire body: the code and field of this error, its message.
    pub fn body(&self) -> ErrorBody {
        let (code, field) = match self {
            DataError::TooManyConnections { .. } => (RefusalCode::TooManyConnections, ""),
            DataError::FrameTooLarge { .. } => (RefusalCode::FrameTooLarge, "frame"),
            DataError::BadFrame(_) => (RefusalCode::BadRequest, "frame"),
            DataError::BadMany(_) => (RefusalCode::BadRequest, "requests"),
            DataError::LoadOverlap { .. } => (RefusalCode::BadRequest, "chunks"),
            DataError::UnknownBuffer { .. } => (RefusalCode::UnknownBuffer, "buffer"),
            DataError::ZeroLength | DataError::MapMemfd(_) | DataError::DmabufSize { .. } => {
                (RefusalCode::BadBuffer, "len")
            }
            DataError::Fds { .. } => (RefusalCode::NoFd, "fd"),
            DataError::ImportDmabuf(_) | DataError::MapBacking(_) => (RefusalCode::BadBuffer, "fd"),
            DataError::TooManyBuffers { .. } => (RefusalCode::TooManyBuffers, "buffer"),
            DataError::TooManyBytes { .. } => (RefusalCode::TooManyBytes, "len"),
            DataError::NotNative { .. } => (RefusalCode::NotNative, "chunks"),
            DataError::Store(e) => return from_store(e),
            DataError::Protocol(e) => return from_protocol(e),
            DataError::Shared(body) => return body.clone(),
        };
        ErrorBody::new(code, field, self.to_string())
    }
}
