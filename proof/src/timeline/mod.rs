//! The causal timeline (DESIGN §8): its vocabulary ([`Event`]) and writer
//! ([`Timeline`]) live in `pdstor-client`, which every node links; here is
//! what reads one: [`check`] verifies a timeline, [`merge`] joins several
//! hosts', [`mutate`] tests the checker, [`render`] draws it.

pub mod check;
pub mod merge;
pub mod mutate;
pub mod render;

use pdstor_client::timeline::*;
