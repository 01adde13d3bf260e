//! Compiles `src/bpf/provenance.bpf.c` with clang and generates its Rust
//! skeleton. `src/bpf/vmlinux.h` is committed: regenerate it with
//! `bpftool btf dump file /sys/kernel/btf/vmlinux format c > ebpf/src/bpf/vmlinux.h`
//! (CO-RE relocations make one object run on 6.1–6.18).
#![deny(clippy::unwrap_used)]

use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "src/bpf/provenance.bpf.c";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo")).join("provenance.skel.rs");
    SkeletonBuilder::new()
        .source(SRC)
        .clang_args(["-Wall", "-Wno-unused-function", "-I", "src/bpf"])
        .build_and_generate(&out)
        .unwrap_or_else(|e| panic!("building {SRC} (needs clang; `cargo xtask deps` installs it): {e:#}"));
    println!("cargo:rerun-if-changed=src/bpf");
}
