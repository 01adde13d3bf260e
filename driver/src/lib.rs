#![warn(missing_docs)]
//! pdstor's daemon: the store on the target, the ownership protocol,
//! admission, and the HTTP control plane and data plane that serve them. The
//! proof tooling (harnesses, model oracle, timeline checker) is the crate
//! above, `pdstor-proof`; the binary, `pdstor` (`cli/`), is above both. The
//! design this code cites as "DESIGN §N" is `docs/design.md`; the rest of the
//! book is beside it in `docs/`.
#![deny(clippy::unwrap_used)]

pub mod admission;
pub mod api;
pub mod owner;
pub mod protocol;
pub mod provenance;
pub mod store;
pub mod units;
