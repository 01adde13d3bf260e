//! The `pdstor` command line (see `cli/`).

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
