//! The guest side of `cargo xtask vmtest`: the guest `/init` ([`guest`]) and
//! the contract suites ([`suites::SUITES`]). What host and guest agree on (the
//! disk table, suite names, guest configuration, result records) lives in
//! `pdstor-vmtest-spec`; the QEMU launcher and the
//! initramfs builder live in `xtask/src/vmtest/`.
#![deny(clippy::unwrap_used)]

pub mod guest;
pub mod machine;
pub mod suites;
