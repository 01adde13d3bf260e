#![warn(missing_docs)]
//! pdstor: hands an LLM's KV cache from a prefill engine to a decode engine
//! through NVMe storage, and proves every step. The design this code cites as
//! "DESIGN §N" is `docs/design.md`; the rest of the book is beside it in `docs/`.
#![deny(clippy::unwrap_used)]

pub mod admission;
pub mod api;
pub mod harness;
pub mod model;
pub mod protocol;
pub mod provenance;
pub mod store;
pub mod timeline;
pub mod units;
