//! Deterministic, seeded payloads: the stand-in for real KV chunks in the demo,
//! the benchmarks and the tests. The same `(seed, chunk)` always gives the same
//! bytes, in any process, so a reader can verify what a writer stored without
//! either trusting pdstor.

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

/// Fills `dst` with the payload of chunk `chunk` under `seed`.
pub fn fill(seed: u64, chunk: u64, dst: &mut [u8]) {
    // SplitMix-style mixing so neighbouring chunks get unrelated streams.
    let mixed = seed ^ chunk.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    SmallRng::seed_from_u64(mixed).fill_bytes(dst);
}

/// The payload of one chunk as a new vector.
pub fn chunk(seed: u64, chunk: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(seed, chunk, &mut v);
    v
}

/// The first byte offset at which `a` and `b` differ, if any.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    if a == b {
        return None;
    }
    a.iter().zip(b).position(|(x, y)| x != y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_chunk_give_same_bytes() {
        assert_eq!(chunk(7, 3, 4096), chunk(7, 3, 4096));
        assert_ne!(chunk(7, 3, 4096), chunk(7, 4, 4096));
        assert_ne!(chunk(7, 3, 4096), chunk(8, 3, 4096));
    }

    #[test]
    fn first_difference_finds_the_byte() {
        let a = chunk(1, 1, 100);
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b[42] ^= 1;
        assert_eq!(first_difference(&a, &b), Some(42));
        assert_eq!(first_difference(&a, &b[..10]), Some(10));
    }
}
