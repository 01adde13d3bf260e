//! The vmtest guest's `/init`. See `pdstor_vmtest::guest`.

fn main() {
    pdstor_vmtest::guest::main()
}
