//! The vmtest guest's `/init`. See `pdstor_vmtest::guest`.
#![deny(clippy::unwrap_used)]

fn main() {
    pdstor_vmtest::guest::main()
}
