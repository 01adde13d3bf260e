//! The x86-64 paths, each a raw-register function (`state` in, `state` out;
//! the caller inverts): the `crc32` instruction on three interleaved streams,
//! and carry-less multiply folding on 256- and 512-bit registers.
//!
//! Every function here is `unsafe` for one reason only: it uses instructions
//! the caller must have detected (each names its `target_feature`s).

use std::arch::x86_64::*;

use super::gf2::{fold_pair, shift_multiplier};

/// `FOLD[m]`: the multipliers folding a 128-bit lane `128·m` bits forward.
const FOLD: [(u64, u64); 17] = {
    let mut k = [(0u64, 0u64); 17];
    let mut m = 1;
    while m < 17 {
        k[m] = fold_pair(128 * m as u64);
        m += 1;
    }
    k
};

/// Three-stream rounds: big blocks, then small ones, then one stream.
const BIG: usize = 4096;
const SMALL: usize = 256;
const K_BIG: (u32, u32) = (shift_multiplier(BIG as u64), shift_multiplier(2 * BIG as u64));
const K_SMALL: (u32, u32) = (shift_multiplier(SMALL as u64), shift_multiplier(2 * SMALL as u64));

fn le64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(word)
}

/// One stream of the `crc32` instruction, 8 bytes at a time.
#[target_feature(enable = "sse4.2")]
pub(super) fn one_way(state: u32, data: &[u8]) -> u32 {
    let mut s = u64::from(state);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        s = _mm_crc32_u64(s, le64(w));
    }
    let mut s = s as u32;
    for &b in words.remainder() {
        s = _mm_crc32_u8(s, b);
    }
    s
}

/// `state` moved forward by the bytes `k` was made for (see
/// [`shift_multiplier`]): one carry-less multiply, one `crc32`.
#[target_feature(enable = "sse4.2,pclmulqdq")]
fn shift(state: u32, k: u32) -> u32 {
    let product = _mm_clmulepi64_si128(_mm_cvtsi32_si128(state as i32), _mm_cvtsi32_si128(k as i32), 0x00);
    _mm_crc32_u64(0, _mm_cvtsi128_si64(product) as u64) as u32
}

/// Rounds of three `block`-byte streams while three blocks remain: the
/// instruction's latency (3 cycles) hidden behind two other chains.
#[target_feature(enable = "sse4.2,pclmulqdq")]
fn rounds(mut state: u32, data: &mut &[u8], block: usize, k: (u32, u32)) -> u32 {
    while data.len() >= 3 * block {
        let (a, rest) = data.split_at(block);
        let (b, rest) = rest.split_at(block);
        let (c, rest) = rest.split_at(block);
        let (mut s0, mut s1, mut s2) = (u64::from(state), 0u64, 0u64);
        for ((x, y), z) in a.chunks_exact(8).zip(b.chunks_exact(8)).zip(c.chunks_exact(8)) {
            s0 = _mm_crc32_u64(s0, le64(x));
            s1 = _mm_crc32_u64(s1, le64(y));
            s2 = _mm_crc32_u64(s2, le64(z));
        }
        state = shift(s0 as u32, k.1) ^ shift(s1 as u32, k.0) ^ s2 as u32;
        *data = rest;
    }
    state
}

/// The `crc32` instruction on three interleaved streams.
#[target_feature(enable = "sse4.2,pclmulqdq")]
pub(super) fn three_way(state: u32, mut data: &[u8]) -> u32 {
    let state = rounds(state, &mut data, BIG, K_BIG);
    let state = rounds(state, &mut data, SMALL, K_SMALL);
    one_way(state, data)
}

/// A 128-bit lane folded `128·m` bits forward.
#[target_feature(enable = "pclmulqdq")]
fn fold(lane: __m128i, m: usize) -> __m128i {
    let (lo, hi) = FOLD[m];
    let k = _mm_set_epi64x(hi as i64, lo as i64);
    _mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x00), _mm_clmulepi64_si128(lane, k, 0x11))
}

/// The lanes of the last folded block (consecutive 16-byte lanes, the last
/// ending at `data[at]`) folded into one, the whole 16-byte blocks after
/// them folded in, then the `crc32` instruction over that lane (multiplying
/// it by `x^32`: the register) and over the bytes left.
#[target_feature(enable = "sse4.2,pclmulqdq")]
fn finish(lanes: &[__m128i], data: &[u8], mut at: usize) -> u32 {
    let n = lanes.len();
    let mut acc = lanes[n - 1];
    for (j, &lane) in lanes[..n - 1].iter().enumerate() {
        acc = _mm_xor_si128(acc, fold(lane, n - 1 - j));
    }
    while let Some(block) = data.get(at..at + 16) {
        // SAFETY: `block` is 16 readable bytes; the load is unaligned.
        let next = unsafe { _mm_loadu_si128(block.as_ptr().cast()) };
        acc = _mm_xor_si128(fold(acc, 1), next);
        at += 16;
    }
    let s = _mm_crc32_u64(0, _mm_cvtsi128_si64(acc) as u64);
    let s = _mm_crc32_u64(s, _mm_extract_epi64::<1>(acc) as u64);
    one_way(s as u32, &data[at..])
}

/// Folding on four 256-bit registers (eight 128-bit lanes, 128 bytes a
/// round) with VPCLMULQDQ; under 256 bytes, [`three_way`].
#[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
pub(super) fn fold_256(state: u32, data: &[u8]) -> u32 {
    const ROUND: usize = 128;
    if data.len() < 2 * ROUND {
        return three_way(state, data);
    }
    let load = |at: usize| {
        let bytes = &data[at..at + 32];
        // SAFETY: `bytes` is 32 readable bytes; the load is unaligned.
        unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
    };
    let mut y = [load(0), load(32), load(64), load(96)];
    y[0] = _mm256_xor_si256(y[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128(state as i32)));
    let (lo, hi) = FOLD[ROUND / 16];
    let k = _mm256_set_epi64x(hi as i64, lo as i64, hi as i64, lo as i64);
    let mut at = ROUND;
    while at + ROUND <= data.len() {
        for (i, r) in y.iter_mut().enumerate() {
            let folded = _mm256_xor_si256(_mm256_clmulepi64_epi128(*r, k, 0x00), _mm256_clmulepi64_epi128(*r, k, 0x11));
            *r = _mm256_xor_si256(folded, load(at + 32 * i));
        }
        at += ROUND;
    }
    let mut lanes = [_mm_setzero_si128(); 8];
    for (i, r) in y.iter().enumerate() {
        lanes[2 * i] = _mm256_castsi256_si128(*r);
        lanes[2 * i + 1] = _mm256_extracti128_si256::<1>(*r);
    }
    finish(&lanes, data, at)
}

/// Folding on four 512-bit registers (sixteen lanes, 256 bytes a round)
/// with VPCLMULQDQ, three-input XORs in one instruction; under 512 bytes,
/// [`three_way`].
#[target_feature(enable = "avx512f,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
pub(super) fn fold_512(state: u32, data: &[u8]) -> u32 {
    fold_512_copying(state, data, None)
}

/// [`fold_512`], storing every 64 bytes it loads into `dst` (as long as
/// `data`) as well: a copy that checksums in the same pass. What is folded
/// is what was stored: the register itself in the main loop, and `dst`'s
/// bytes, read back from the cache, for a short range and the tail.
#[target_feature(enable = "avx512f,avx512vl,vpclmulqdq,pclmulqdq,sse4.2")]
pub(super) fn fold_512_copying(state: u32, data: &[u8], mut dst: Option<&mut [u8]>) -> u32 {
    const ROUND: usize = 256;
    if data.len() < 2 * ROUND {
        return match dst {
            Some(d) => {
                d.copy_from_slice(data);
                three_way(state, d)
            }
            None => three_way(state, data),
        };
    }
    let load = |at: usize| {
        let bytes = &data[at..at + 64];
        // SAFETY: `bytes` is 64 readable bytes; the load is unaligned.
        unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
    };
    let mut store = |at: usize, v: __m512i| {
        if let Some(d) = dst.as_deref_mut() {
            let out = &mut d[at..at + 64];
            // SAFETY: `out` is 64 writable bytes; the store is unaligned.
            unsafe { _mm512_storeu_si512(out.as_mut_ptr().cast(), v) }
        }
    };
    let mut z = [load(0), load(64), load(128), load(192)];
    for (i, v) in z.iter().enumerate() {
        store(64 * i, *v);
    }
    z[0] = _mm512_xor_si512(z[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128(state as i32)));
    let (lo, hi) = FOLD[ROUND / 16];
    let k = _mm512_set_epi64(hi as i64, lo as i64, hi as i64, lo as i64, hi as i64, lo as i64, hi as i64, lo as i64);
    let mut at = ROUND;
    while at + ROUND <= data.len() {
        for (i, r) in z.iter_mut().enumerate() {
            let next = load(at + 64 * i);
            store(at + 64 * i, next);
            let (a, b) = (_mm512_clmulepi64_epi128(*r, k, 0x00), _mm512_clmulepi64_epi128(*r, k, 0x11));
            *r = _mm512_ternarylogic_epi64::<0x96>(a, b, next);
        }
        at += ROUND;
    }
    let mut lanes = [_mm_setzero_si128(); 16];
    for (i, r) in z.iter().enumerate() {
        lanes[4 * i] = _mm512_extracti32x4_epi32::<0>(*r);
        lanes[4 * i + 1] = _mm512_extracti32x4_epi32::<1>(*r);
        lanes[4 * i + 2] = _mm512_extracti32x4_epi32::<2>(*r);
        lanes[4 * i + 3] = _mm512_extracti32x4_epi32::<3>(*r);
    }
    match dst {
        Some(d) => {
            d[at..].copy_from_slice(&data[at..]);
            finish(&lanes, d, at)
        }
        None => finish(&lanes, data, at),
    }
}
