//! The kernel's own source, compiled as C++ and run on the CPU (each block's
//! threads as OS threads, shuffles at a barrier: `host_shim.h`), through the
//! same host half the GPU uses, against the reference table.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::*;
use crate::crc32c::table;

#[test]
fn a_plan_cuts_every_range_into_aligned_rows_and_small_ends() {
    for addr in [0u64, 1, 15, 16, 4096, 0x7000_0000_0003] {
        for len in [0u64, 1, 15, 16, 511, 512, 527, 528, 4096, 1 << 20, (8 << 20) + 3, 1 << 30] {
            let p = plan(addr, len);
            assert_eq!(p.head + p.rows * ROW_BYTES + p.tail, len, "{addr:#x}+{len}");
            assert!(p.head < 16 && p.tail < ROW_BYTES + 16, "{p:?}");
            if p.rows > 0 {
                assert_eq!((addr + p.head) % 16, 0, "{p:?}");
                assert!(p.tail < ROW_BYTES, "{p:?}");
                let threads = u64::from(p.blocks) * u64::from(THREADS);
                assert!(threads / 32 * p.rows_per_warp >= p.rows, "every row has a warp: {p:?}");
            }
        }
    }
    let chunk = plan(1 << 21, 8 << 20);
    assert_eq!((chunk.rows, chunk.rows_per_warp, chunk.blocks), (16384, 8, 256));
}

/// The harness built from the kernel's source, once per test process, or
/// why not (no C++20 compiler here).
fn harness() -> Result<&'static Path, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("pdstor-gpu-crc-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            for (name, text) in [("kernel.cu", SOURCE), ("host_shim.h", HOST_SHIM), ("harness.cpp", HARNESS)] {
                std::fs::write(dir.join(name), text).map_err(|e| e.to_string())?;
            }
            let exe = dir.join("harness");
            let out = std::process::Command::new("c++")
                .args(["-std=c++20", "-O2", "-pthread", "-o"])
                .arg(&exe)
                .arg(dir.join("harness.cpp"))
                .output()
                .map_err(|e| format!("no C++ compiler (c++): {e}"))?;
            if !out.status.success() {
                // A compiler that is there but fails on the source is a defect, not a skip.
                panic!("c++ failed on kernel.cu + host_shim.h:\n{}", String::from_utf8_lossy(&out.stderr));
            }
            Ok(exe)
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// CRC-32C of `data` as the GPU path computes it, the kernel run on the CPU;
/// `addr` is where `data` would sit in device memory.
fn on_emulated_gpu(exe: &Path, addr: u64, data: &[u8]) -> u32 {
    let dir = exe.parent().unwrap().join(format!("case-{addr:x}-{}", data.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let crc = crc32c_with(
        addr,
        data.len() as u64,
        |at, out: &mut [u8]| -> Result<(), String> {
            out.copy_from_slice(&data[at as usize..at as usize + out.len()]);
            Ok(())
        },
        |p: &Plan| {
            let t: Vec<u8> = tables().iter().flat_map(|w| w.to_le_bytes()).collect();
            std::fs::write(dir.join("tables"), t).unwrap();
            let rows = &data[p.head as usize..(p.head + p.rows * ROW_BYTES) as usize];
            std::fs::write(dir.join("rows"), rows).unwrap();
            let out = std::process::Command::new(exe)
                .arg(dir.join("tables"))
                .arg(dir.join("rows"))
                .args([p.rows_per_warp.to_string(), p.blocks.to_string(), THREADS.to_string()])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            u32::from_str_radix(String::from_utf8_lossy(&out.stdout).trim(), 16).map_err(|e| e.to_string())
        },
    )
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    crc
}

#[test]
fn the_kernel_run_on_the_cpu_is_the_reference_and_sees_a_flipped_byte() {
    let exe = match harness() {
        Ok(exe) => exe,
        Err(why) => return pdstor_testkit::skip("crc32c::gpu::the_kernel_run_on_the_cpu_is_the_reference", &why),
    };
    let data: Vec<u8> = (0..(300u32 << 10) + 37).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    // Rows: none, one, a warp's part, several warps, several blocks; every
    // head length; tails of every size class.
    let cases: [(u64, usize); 9] = [
        (0, 0),
        (3, 500),
        (0, 512),
        (5, 529),
        (16, 13 * 512 + 7),
        (7, 100 * 512),
        (9, 64 << 10),
        (1, 300 << 10),
        (0, 8 * 2048 * 2 * 16),
    ];
    for (addr, len) in cases {
        let len = len.min(data.len());
        let bytes = &data[..len];
        assert_eq!(on_emulated_gpu(exe, addr, bytes), table::append(0, bytes), "{len} bytes at {addr:#x}");
    }
    let mut flipped = data[..64 << 10].to_vec();
    flipped[40_000] ^= 0x10;
    let (good, bad) = (table::append(0, &data[..64 << 10]), on_emulated_gpu(exe, 0, &flipped));
    assert_ne!(bad, good, "a flipped byte in the rows changes the kernel's CRC");
    assert_eq!(bad, table::append(0, &flipped));
}
