#![warn(missing_docs)]
//! pdstor's payload engine: one target owned exclusively, one io_uring with
//! that target as its only registered file, and the buffers payloads move
//! between (host memory, memfds, DMA-BUFs). It knows transfers, paths and
//! segments; it knows nothing of publications, receipts or the daemon — the
//! `pdstor-daemon` crate builds those on top. Its design is `docs/paths.md`.
#![deny(clippy::unwrap_used)]

pub mod buffer;
pub mod crc32c;
pub mod io;
pub mod payload;
