#![warn(missing_docs)]
//! pdstor's payload engine: one target owned exclusively, one io_uring with
//! that target as its only registered file, and the buffers payloads move
//! between (host memory, memfds, DMA-BUFs). It knows transfers, paths and
//! segments; it knows nothing of publications, receipts or the daemon — the
//! `pdstor` crate builds those on top. Its design is `docs/paths.md`.
#![deny(clippy::unwrap_used)]

pub mod buffer;
pub mod crc32c;
pub mod io;

pub use buffer::{Buffer, BufferKind};
pub use io::{Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOptions, TransferId};

/// Test support: says `SKIP: <test>: <reason>` on stderr and, when
/// `PDSTOR_SKIP_LOG` names a file, appends it there for CI's skip list.
#[cfg(test)]
pub(crate) fn test_skip(test: &str, reason: &str) {
    let line = format!("SKIP: {test}: {reason}");
    eprintln!("{line}");
    if let Ok(log) = std::env::var("PDSTOR_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "{line}");
        }
    }
}
