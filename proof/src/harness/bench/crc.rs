//! `pdstor bench-crc`: each CRC-32C implementation this CPU runs, on one
//! core, against a plain read of the same bytes (a sum of every 64-bit word:
//! what the memory gives one core), at sizes that live in the L2 cache, in
//! the L3 and in DRAM. A measurement: it asserts nothing about speed.

use std::time::{Duration, Instant};

use serde::Serialize;

use pdstor_engine::crc32c::{self, Impl};

/// What to measure.
#[derive(Debug, Clone)]
pub struct CrcBenchConfig {
    /// Buffer sizes in bytes, each measured separately.
    pub sizes: Vec<usize>,
    /// Passes over each buffer per implementation (the median is reported).
    pub passes: u32,
}

/// One implementation (or the plain read) at one size.
#[derive(Debug, Clone, Serialize)]
pub struct CrcCase {
    /// `plain-read` or an implementation's name.
    pub name: String,
    /// Median GiB/s over the passes.
    pub gib_per_s: f64,
    /// Its median over the plain read's at this size.
    pub of_plain_read: f64,
}

/// One buffer size.
#[derive(Debug, Clone, Serialize)]
pub struct CrcSize {
    /// Bytes per pass.
    pub bytes: usize,
    /// The plain read, then every implementation in `Impl::ALL` order.
    pub cases: Vec<CrcCase>,
    /// A copy of the buffer alone, then a copy followed by a checksum pass
    /// over the copy, then the two fused (`crc32c::copy_append`); each
    /// `of_plain_read` is its time over the copy's alone.
    pub copies: Vec<CrcCase>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct CrcReport {
    /// The implementation the daemon uses here, and how it was chosen.
    pub chosen: String,
    /// How: measured, or named by `PDSTOR_CRC32C`.
    pub chosen_by: String,
    /// The path `crc-fast` takes on this CPU.
    pub crc_fast_path: String,
    /// Each size.
    pub sizes: Vec<CrcSize>,
}

/// Measures every available implementation at every size.
pub fn run(cfg: &CrcBenchConfig) -> CrcReport {
    let choice = crc32c::chosen();
    let sizes = cfg.sizes.iter().map(|&bytes| measure_size(bytes, cfg.passes.max(1))).collect();
    CrcReport {
        chosen: choice.imp.name().to_owned(),
        chosen_by: choice.by.to_owned(),
        crc_fast_path: crc_fast::get_calculator_target(crc_fast::CrcAlgorithm::Crc32Iscsi),
        sizes,
    }
}

fn measure_size(bytes: usize, passes: u32) -> CrcSize {
    // Every page written (faulted in) before any pass, and contents that no
    // path could shortcut.
    let data: Vec<u8> = (0..bytes).map(|i| ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8).collect();
    let plain = median_seconds(passes, || {
        std::hint::black_box(plain_read(std::hint::black_box(&data)));
    });
    let rate = |s: f64| bytes as f64 / s / f64::from(1u32 << 30);
    let mut cases = vec![CrcCase { name: "plain-read".into(), gib_per_s: rate(plain), of_plain_read: 1.0 }];
    for imp in Impl::ALL {
        let Some(f) = imp.function() else { continue };
        // The reference runs near 1 GiB/s: fewer passes where a pass is long.
        let n = if imp == Impl::Table && bytes > 64 << 20 { 1 } else { passes };
        let s = median_seconds(n, || {
            std::hint::black_box(f(0, std::hint::black_box(&data)));
        });
        cases.push(CrcCase { name: imp.name().into(), gib_per_s: rate(s), of_plain_read: plain / s });
    }
    let mut dst = vec![0u8; bytes];
    let copy = median_seconds(passes, || dst.copy_from_slice(std::hint::black_box(&data)));
    let then = median_seconds(passes, || {
        dst.copy_from_slice(std::hint::black_box(&data));
        std::hint::black_box(crc32c::checksum(&dst));
    });
    let fused = median_seconds(passes, || {
        std::hint::black_box(crc32c::copy_append(0, &mut dst, std::hint::black_box(&data)));
    });
    let copies = [("copy", copy), ("copy-then-crc32c", then), ("copy-crc32c-fused", fused)]
        .into_iter()
        .map(|(name, s)| CrcCase { name: name.into(), gib_per_s: rate(s), of_plain_read: s / copy })
        .collect();
    CrcSize { bytes, cases, copies }
}

/// The median of `passes` timed calls, after one untimed (warming caches
/// and the branch predictors as a verifier's steady state would).
fn median_seconds(passes: u32, mut f: impl FnMut()) -> f64 {
    f();
    let mut times: Vec<Duration> = (0..passes)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2].as_secs_f64().max(1e-9)
}

/// Every 64-bit word of `data` summed: the least a pass over the bytes
/// costs. Four independent sums, on 256-bit registers where the CPU has
/// them, so the adds are never what limits it.
pub fn plain_read(data: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { plain_read_avx2(data) };
    }
    sum_words(data)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn plain_read_avx2(data: &[u8]) -> u64 {
    sum_words(data)
}

#[inline(always)]
fn sum_words(data: &[u8]) -> u64 {
    let mut sums = [0u64; 4];
    let mut blocks = data.chunks_exact(32);
    for block in &mut blocks {
        for (s, w) in sums.iter_mut().zip(block.chunks_exact(8)) {
            let mut word = [0u8; 8];
            word.copy_from_slice(w);
            *s = s.wrapping_add(u64::from_le_bytes(word));
        }
    }
    // What is left: its whole words, then its last bytes one by one.
    let tail = blocks.remainder().chunks(8).fold(0u64, |s, w| match <[u8; 8]>::try_from(w) {
        Ok(word) => s.wrapping_add(u64::from_le_bytes(word)),
        Err(_) => w.iter().fold(s, |s, &b| s.wrapping_add(u64::from(b))),
    });
    sums.iter().fold(tail, |a, &s| a.wrapping_add(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_read_sums_every_word_and_the_report_names_every_available_implementation() {
        let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let want = data.chunks(8).fold(0u64, |s, w| {
            if w.len() == 8 {
                s.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))
            } else {
                w.iter().fold(s, |s, &b| s.wrapping_add(u64::from(b)))
            }
        });
        assert_eq!(plain_read(&data), want);
        let r = run(&CrcBenchConfig { sizes: vec![64 << 10], passes: 1 });
        let names: Vec<&str> = r.sizes[0].cases.iter().map(|c| c.name.as_str()).collect();
        let mut want = vec!["plain-read"];
        want.extend(crc32c::available().iter().map(|i| i.name()));
        assert_eq!(names, want);
        assert!(r.sizes[0].cases.iter().all(|c| c.gib_per_s > 0.0));
        assert!(want.contains(&r.chosen.as_str()));
    }
}
