//! The `pdstor` command line (see `cli/`).
#![deny(clippy::unwrap_used)]

mod cli;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    cli::main()
}
