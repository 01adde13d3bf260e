#![warn(missing_docs)]
//! pdstor's proof tooling, above the daemon and never below it: the
//! harnesses that drive the layers and report ([`harness`]), the model
//! oracle ([`model`]) and what reads a causal timeline ([`timeline`]). The
//! daemon (`pdstor-daemon`) runs without any of it; the `pdstor` binary
//! (`cli/`) gives each its verb.
#![deny(clippy::unwrap_used)]

pub mod harness;
pub mod model;
pub mod timeline;
