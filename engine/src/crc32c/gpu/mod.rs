//! CRC-32C where GPU memory holds the bytes: the host half of
//! `kernel.cu`. A range is cut into a head of under 16 bytes (up to the
//! first 16-byte-aligned address), whole 512-byte rows, and a tail of under
//! 512 bytes; the kernel checksums the rows in place, the CPU the head and
//! tail (copied out: under 528 bytes), and the three combine into the
//! range's CRC-32C — the same function as [`super::checksum`], built from
//! the same definition ([`super::gf2`]). This module has no CUDA in it: the
//! CUDA buffer runs the kernel (`buffer::cuda`, feature `cuda`), the tests
//! run the kernel's own source on the CPU.

use super::gf2::{POLY, mul, shift, xpow};
use super::table;

/// The PTX nvcc made of `kernel.cu` (`cargo xtask cuda-ptx`; its ISA
/// version lowered so drivers from CUDA 12.0 on compile it).
pub const PTX: &str = include_str!("kernel.ptx");
/// The kernel's entry point.
pub const KERNEL: &str = "pdstor_crc32c_rows";
/// The kernel's source, for the tests that run it on the CPU.
pub const SOURCE: &str = include_str!("kernel.cu");
/// The CPU shim those tests compile it with, and their harness.
pub const HOST_SHIM: &str = include_str!("host_shim.h");
/// The harness: `harness TABLES ROWS ROWS_PER_WARP BLOCKS THREADS`.
pub const HARNESS: &str = include_str!("harness.cpp");

/// Bytes per row: a warp's 32 lanes × 16 bytes.
pub const ROW_BYTES: u64 = 512;
/// Threads per block (a multiple of 32).
pub const THREADS: u32 = 256;
/// Rows a warp takes at least (fewer warps for small ranges, so each does
/// more than its final shifts).
const MIN_ROWS_PER_WARP: u64 = 8;
/// Warps a launch aims at, at most.
const MAX_WARPS: u64 = 16384;

const T_ROW: usize = 4096;
const T_LANE: usize = 5120;
const T_X2N: usize = 5152;
/// The tables' length in u32 words.
pub const TABLE_WORDS: usize = 5216;

/// The tables the kernel reads, in its layout (see `kernel.cu`).
pub fn tables() -> Vec<u32> {
    let mut t = vec![0u32; TABLE_WORDS];
    let row = xpow(8 * ROW_BYTES);
    for b in 0..256usize {
        let byte = table::raw(0, &[b as u8]);
        for k in 0..16 {
            t[k * 256 + b] = shift(byte, k as u64);
        }
        for i in 0..4 {
            t[T_ROW + i * 256 + b] = mul((b as u32) << (8 * i), row);
        }
    }
    for j in 0..32 {
        t[T_LANE + j] = xpow(8 * 16 * j as u64);
    }
    let mut x2n = 1u32 << 30; // x^1
    for k in 0..64 {
        t[T_X2N + k] = x2n;
        x2n = mul(x2n, x2n);
    }
    debug_assert_eq!(POLY, 0x82f6_3b78, "kernel.cu has the polynomial written in");
    t
}

/// How a range at device address `addr` is cut and launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Bytes before the rows (to the first 16-byte-aligned address).
    pub head: u64,
    /// Whole rows the kernel takes, from `addr + head`.
    pub rows: u64,
    /// Bytes after the rows.
    pub tail: u64,
    /// Rows each warp takes.
    pub rows_per_warp: u64,
    /// Blocks of [`THREADS`].
    pub blocks: u32,
}

/// The plan for `len` bytes at device address `addr`.
pub fn plan(addr: u64, len: u64) -> Plan {
    let head = (addr.next_multiple_of(16) - addr).min(len);
    let rows = (len - head) / ROW_BYTES;
    let tail = len - head - rows * ROW_BYTES;
    let rows_per_warp = rows.div_ceil(MAX_WARPS).max(MIN_ROWS_PER_WARP);
    let warps = rows.div_ceil(rows_per_warp);
    let blocks = warps.div_ceil(u64::from(THREADS / 32)).max(1);
    Plan { head, rows, tail, rows_per_warp, blocks: u32::try_from(blocks).unwrap_or(u32::MAX) }
}

/// The range's CRC-32C from its head's and tail's (finished) and the rows'
/// raw CRC from zero, as the kernel leaves it.
pub fn finish(plan: &Plan, crc_head: u32, rows_raw: u32, crc_tail: u32) -> u32 {
    let rows_len = plan.rows * ROW_BYTES;
    // crc(M) = ~(shift(~0, |M|) ^ raw0(M)): the raw register is linear.
    let crc_rows = !(shift(!0, rows_len) ^ rows_raw);
    let with_rows = super::combine(crc_head, crc_rows, rows_len);
    super::combine(with_rows, crc_tail, plan.tail)
}

/// CRC-32C of `len` bytes at device address `addr`: `read` copies a range
/// (offset from `addr`) to the host, for the head and tail; `rows` runs the
/// kernel over the plan's rows and answers their raw CRC.
pub fn crc32c_with<E>(
    addr: u64,
    len: u64,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<(), E>,
    rows: impl FnOnce(&Plan) -> Result<u32, E>,
) -> Result<u32, E> {
    let p = plan(addr, len);
    let mut head = vec![0u8; p.head as usize];
    let mut tail = vec![0u8; p.tail as usize];
    read(0, &mut head)?;
    read(p.head + p.rows * ROW_BYTES, &mut tail)?;
    let rows_raw = if p.rows > 0 { rows(&p)? } else { 0 };
    Ok(finish(&p, super::checksum(&head), rows_raw, super::checksum(&tail)))
}

#[cfg(test)]
mod tests;
