//! Harnesses: programs that drive the library layers end to end and report
//! what they measured or proved. None of them is a layer the daemon runs on.
//!
//! - [`mod@bench`]: the engine against fio's patterns, the store's publication
//!   rate, the handoff against a running daemon;
//! - [`roundtrip`]: seeded chunks written, flushed, read back and verified;
//! - [`ladder`]: each payload path qualified in turn, byte for byte and by
//!   the probes' verdicts;
//! - [`qualify`]: the model-oracle profile through a real daemon;
//! - [`probe_load`]: the provenance probes under many submitters and deep
//!   queues, each transfer judged as at queue depth 1.

pub mod bench;
pub mod ladder;
pub mod probe_load;
pub mod qualify;
pub mod roundtrip;
