//! CRC-32C (Castagnoli, iSCSI) at the speed the CPU allows, chosen at run
//! time. Every payload byte pdstor moves is checksummed once as it is stored
//! and once as it is restored, so this is the handoff's speed where the
//! bytes are not DMA'd.
//!
//! The implementations, each the same function ([`Impl::ALL`]):
//! the reference table a byte at a time; the `crc32c` and `crc-fast`
//! crates; the `crc32` instruction on three interleaved streams; and
//! carry-less multiply folding on 256- and 512-bit registers (VPCLMULQDQ).
//! [`chosen`] is the fastest the CPU runs, measured once at first use (a
//! fraction of a millisecond), or the one `PDSTOR_CRC32C` names.
//! `cargo xtask bench --crc` measures them all against a plain read of the
//! same bytes.

pub mod gf2;
pub mod gpu;
pub mod table;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gf2::combine;

/// `crc32c(prefix ‖ data)` from `crc32c(prefix)`: the signature every
/// implementation shares (start from 0 for a whole buffer).
pub type AppendFn = fn(u32, &[u8]) -> u32;

/// One implementation of CRC-32C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Impl {
    /// The byte-at-a-time table: the reference.
    Table,
    /// The `crc32c` crate (the `crc32` instruction where present).
    Crc32cCrate,
    /// The `crc-fast` crate (on x86-64 with AVX-512 and VPCLMULQDQ, its
    /// fusion of folding and the `crc32` instruction, `avx512_vpclmulqdq_v3x2`).
    CrcFast,
    /// The `crc32` instruction (SSE4.2) on three interleaved streams.
    Crc32Instr3Way,
    /// Carry-less multiply folding on 256-bit registers (AVX2, VPCLMULQDQ).
    Fold256,
    /// Carry-less multiply folding on 512-bit registers (AVX-512, VPCLMULQDQ).
    Fold512,
}

impl Impl {
    /// Every implementation, the reference first.
    pub const ALL: [Impl; 6] =
        [Impl::Table, Impl::Crc32cCrate, Impl::CrcFast, Impl::Crc32Instr3Way, Impl::Fold256, Impl::Fold512];

    /// Its name, as `PDSTOR_CRC32C` and the benchmark spell it.
    pub fn name(self) -> &'static str {
        match self {
            Impl::Table => "table",
            Impl::Crc32cCrate => "crc32c-crate",
            Impl::CrcFast => "crc-fast",
            Impl::Crc32Instr3Way => "crc32-instr-3way",
            Impl::Fold256 => "vpclmulqdq-256",
            Impl::Fold512 => "vpclmulqdq-512",
        }
    }

    /// The implementation `name` spells.
    pub fn from_name(name: &str) -> Option<Impl> {
        Impl::ALL.into_iter().find(|i| i.name() == name)
    }

    /// The function, if this CPU has the instructions it needs.
    pub fn function(self) -> Option<AppendFn> {
        match self {
            Impl::Table => Some(table::append),
            Impl::Crc32cCrate => Some(crc32c::crc32c_append),
            Impl::CrcFast => Some(crc_fast_append),
            #[cfg(target_arch = "x86_64")]
            Impl::Crc32Instr3Way if has_crc32_instr() => Some(three_way),
            #[cfg(target_arch = "x86_64")]
            Impl::Fold256 if has_crc32_instr() && has_fold_256() => Some(fold_256),
            #[cfg(target_arch = "x86_64")]
            Impl::Fold512 if has_crc32_instr() && has_fold_256() && has_fold_512() => Some(fold_512),
            _ => None,
        }
    }
}

fn crc_fast_append(crc: u32, data: &[u8]) -> u32 {
    let mut digest = crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

#[cfg(target_arch = "x86_64")]
fn has_crc32_instr() -> bool {
    is_x86_feature_detected!("sse4.2") && is_x86_feature_detected!("pclmulqdq")
}

#[cfg(target_arch = "x86_64")]
fn has_fold_256() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("vpclmulqdq")
}

#[cfg(target_arch = "x86_64")]
fn has_fold_512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
}

#[cfg(target_arch = "x86_64")]
fn three_way(crc: u32, data: &[u8]) -> u32 {
    // SAFETY: handed out by `Impl::function` only once `has_crc32_instr`.
    !unsafe { x86::three_way(!crc, data) }
}

#[cfg(target_arch = "x86_64")]
fn fold_256(crc: u32, data: &[u8]) -> u32 {
    // SAFETY: handed out by `Impl::function` only once `has_crc32_instr`
    // and `has_fold_256`: SSE4.2, PCLMULQDQ, AVX2, VPCLMULQDQ.
    !unsafe { x86::fold_256(!crc, data) }
}

#[cfg(target_arch = "x86_64")]
fn fold_512(crc: u32, data: &[u8]) -> u32 {
    // SAFETY: handed out by `Impl::function` only once every feature
    // `x86::fold_512` names was detected.
    !unsafe { x86::fold_512(!crc, data) }
}

/// The implementation in use and why.
#[derive(Clone, Copy, Debug)]
pub struct Choice {
    /// Which one.
    pub imp: Impl,
    /// Its function.
    pub function: AppendFn,
    /// How it was chosen: `"PDSTOR_CRC32C"` or `"measured"`.
    pub by: &'static str,
}

static CHOSEN: OnceLock<Choice> = OnceLock::new();

/// The implementation [`checksum`] and [`append`] use: the one
/// `PDSTOR_CRC32C` names if this CPU runs it, else the fastest measured here
/// (see [`measure`]), decided once per process.
pub fn chosen() -> Choice {
    *CHOSEN.get_or_init(|| {
        if let Some(name) = std::env::var("PDSTOR_CRC32C").ok().filter(|n| !n.is_empty()) {
            match Impl::from_name(&name).and_then(|i| i.function().map(|f| (i, f))) {
                Some((imp, function)) => return Choice { imp, function, by: "PDSTOR_CRC32C" },
                None => tracing::warn!(
                    "PDSTOR_CRC32C={name}: not an implementation this CPU runs (one of {}); measuring instead",
                    available().iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
                ),
            }
        }
        let candidates: Vec<Impl> = available().into_iter().filter(|i| *i != Impl::Table).collect();
        let fastest = measure(CALIBRATION_BYTES, CALIBRATION_ROUNDS, &candidates)
            .into_iter()
            .min_by_key(|(_, took)| *took)
            .map_or(Impl::Table, |(imp, _)| imp);
        let function = fastest.function().unwrap_or(table::append);
        Choice { imp: fastest, function, by: "measured" }
    })
}

const CALIBRATION_BYTES: usize = 256 << 10;
const CALIBRATION_ROUNDS: u32 = 5;

/// The implementations this CPU runs.
pub fn available() -> Vec<Impl> {
    Impl::ALL.into_iter().filter(|i| i.function().is_some()).collect()
}

/// Each of `candidates`' best time over `rounds` passes of a `bytes`-byte
/// buffer (after one pass to warm up), in their order; those this CPU does
/// not run are left out.
pub fn measure(bytes: usize, rounds: u32, candidates: &[Impl]) -> Vec<(Impl, Duration)> {
    let data: Vec<u8> = (0..bytes).map(|i| (i as u32).wrapping_mul(0x9e37_79b1).to_le_bytes()[3]).collect();
    candidates
        .iter()
        .filter_map(|&imp| {
            let f = imp.function()?;
            std::hint::black_box(f(0, &data));
            let best = (0..rounds.max(1))
                .map(|_| {
                    let t = Instant::now();
                    std::hint::black_box(f(0, std::hint::black_box(&data)));
                    t.elapsed()
                })
                .min()
                .unwrap_or_default();
            Some((imp, best))
        })
        .collect()
}

/// CRC-32C of `data`.
pub fn checksum(data: &[u8]) -> u32 {
    (chosen().function)(0, data)
}

/// `crc32c(prefix ‖ data)` from `crc32c(prefix)`.
pub fn append(crc: u32, data: &[u8]) -> u32 {
    (chosen().function)(crc, data)
}

/// Bytes copied before they are checksummed, in [`copy_append`] where the
/// checksum cannot ride along the copy: small enough that it reads them
/// back from the core's own L2 cache.
pub const COPY_BLOCK: usize = 64 << 10;

/// Copies `src` into `dst` (the same length) and answers
/// `crc32c(prefix ‖ src)` from `crc32c(prefix)`, in one pass over memory:
/// with 512-bit folding, each 64 bytes is loaded once, stored and folded;
/// otherwise each 64 KiB block is copied, then checksummed from the cache
/// the copy left it in. Either way the bytes come from DRAM once, not once
/// for the copy and again for the check.
///
/// The 512-bit fold is used wherever this CPU runs it, whichever
/// implementation [`chosen`] measured fastest for a plain checksum (from
/// DRAM several tie): only it rides along the copy. `PDSTOR_CRC32C` naming
/// another is obeyed here too.
///
/// # Panics
///
/// If the lengths differ (a caller's bug, as for `copy_from_slice`).
pub fn copy_append(crc: u32, dst: &mut [u8], src: &[u8]) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_append: destination and source lengths differ");
    let choice = chosen();
    #[cfg(target_arch = "x86_64")]
    if choice.imp == Impl::Fold512 || (choice.by == "measured" && Impl::Fold512.function().is_some()) {
        // SAFETY: `Impl::Fold512.function()` (which `chosen` also went
        // through) is `Some` only once every feature
        // `x86::fold_512_copying` names was detected on this CPU.
        return !unsafe { x86::fold_512_copying(!crc, src, Some(dst)) };
    }
    copy_blocked(choice.function, crc, dst, src)
}

/// [`copy_append`] a block at a time with `f`.
fn copy_blocked(f: AppendFn, mut crc: u32, dst: &mut [u8], src: &[u8]) -> u32 {
    for (d, s) in dst.chunks_mut(COPY_BLOCK).zip(src.chunks(COPY_BLOCK)) {
        d.copy_from_slice(s);
        crc = f(crc, d);
    }
    crc
}
