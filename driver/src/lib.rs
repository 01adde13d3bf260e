//! pdstor: hands an LLM's KV cache from a prefill engine to a decode engine
//! through NVMe storage, and proves every step. See DESIGN.md in the project's
//! shared folder and README.md.

pub mod admission;
pub mod api;
pub mod bench;
pub mod buffer;
pub mod client;
pub mod io;
pub mod payload;
pub mod protocol;
pub mod roundtrip;
pub mod store;
pub mod units;

pub use buffer::{Buffer, BufferKind};
pub use io::{Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOptions, TransferId};
