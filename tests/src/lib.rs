//! Helpers for pdstor's end-to-end tests: finding the `pdstor` binary that
//! `cargo test --workspace` built, and reading target bytes with a tool that is
//! not pdstor.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The `pdstor` binary of this build profile (built by `cargo test --workspace`;
/// built here if a narrower invocation skipped it).
pub fn pdstor_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> -> target/<profile>/pdstor
    let profile_dir = exe.parent().and_then(Path::parent).expect("target profile dir");
    let bin = profile_dir.join("pdstor");
    if !bin.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "pdstor", "--bin", "pdstor"])
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build -p pdstor failed");
    }
    bin
}

/// Reads `len` bytes at `offset` of `path` with `dd iflag=direct`.
pub fn dd_direct(path: &Path, offset: u64, len: u64) -> Vec<u8> {
    let out = Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=direct,skip_bytes,count_bytes", "bs=1M", "status=none"])
        .arg(format!("skip={offset}"))
        .arg(format!("count={len}"))
        .output()
        .expect("running dd");
    assert!(out.status.success(), "dd failed: {}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}
