#![warn(missing_docs)]
//! pdstor: hands an LLM's KV cache from a prefill engine to a decode engine
//! through NVMe storage, and proves every step. The design this code cites as
//! "DESIGN §N" is `docs/design.md`; the rest of the book is beside it in `docs/`.
#![deny(clippy::unwrap_used)]

pub mod admission;
pub mod api;
pub mod harness;
pub mod model;
pub mod payload;
pub mod protocol;
pub mod provenance;
pub mod store;
pub mod timeline;
pub mod units;

/// The payload engine and its buffers live in their own crate, `pdstor-engine`
/// (no daemon, no HTTP, no probes); they are re-exported here whole.
pub use pdstor_engine::{buffer, crc32c, io};

/// The client side — the wire vocabulary, receipts, the writer and the reader —
/// is the crate `pdstor-client`, which engines link without the daemon.
pub use pdstor_client as client;

pub use buffer::{Buffer, BufferKind};
pub use io::{Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOptions, TransferId};
