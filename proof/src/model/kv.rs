//! How the model's KV cache lies in storage (`kv_format` `pdstor-kv-bf16-v1`).
//!
//! The prompt's tokens are cut into chunks of `chunk_tokens`; the last may be
//! partial. Chunk `c` (tokens `c·T .. min((c+1)·T, n)`) is one stored chunk of
//! a fixed size, [`chunk_bytes`]:
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | magic `PDKVBF16` |
//! | 8..12, 12..16 | chunk index, tokens in this chunk (u32 LE) |
//! | 16..20, 20..24 | tokens in the prompt, chunk_tokens |
//! | 24..28, 28..32 | layers, kv width (kv_heads × head_dim) |
//! | 32..64 | zero |
//! | 64.. | per layer: K then V, each `tokens × kv_width` bf16 LE, token-major |
//! | rest | zero, up to a multiple of 4096 (direct I/O) |
//!
//! bf16 is the top half of an f32, rounded to nearest even.

use super::{Config, KvCache};
use pdstor_client::layout::Layout;

const MAGIC: &[u8; 8] = b"PDKVBF16";
const HEADER: usize = 64;
/// The `kv_format` name of this encoding.
pub const KV_FORMAT: &str = "pdstor-kv-bf16-v1";

/// f32 → bf16, rounding to nearest even.
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// bf16 → f32 (exact).
pub fn from_bf16(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Bytes of every stored chunk for `chunk_tokens`.
pub fn chunk_bytes(cfg: &Config, chunk_tokens: usize) -> usize {
    (HEADER + chunk_tokens * cfg.layers * 2 * cfg.kv_width() * 2).next_multiple_of(4096)
}

/// The layout a reader must match exactly.
pub fn layout(cfg: &Config, chunk_tokens: usize) -> Layout {
    Layout {
        model_id: format!("pdstor-tiny-l{}-d{}-seed{}", cfg.layers, cfg.d_model, cfg.seed),
        dtype: "bf16".into(),
        layers: cfg.layers as u32,
        kv_heads: cfg.kv_heads as u32,
        head_dim: cfg.head_dim as u32,
        chunk_tokens: chunk_tokens as u32,
        kv_format: KV_FORMAT.into(),
    }
}

/// The cache as stored chunks, each [`chunk_bytes`] long.
pub fn encode(cache: &KvCache, cfg: &Config, chunk_tokens: usize) -> Vec<Vec<u8>> {
    let kvw = cfg.kv_width();
    let n = cache.len;
    (0..n.div_ceil(chunk_tokens))
        .map(|c| {
            let (t0, t1) = (c * chunk_tokens, ((c + 1) * chunk_tokens).min(n));
            let mut b = vec![0u8; chunk_bytes(cfg, chunk_tokens)];
            b[..8].copy_from_slice(MAGIC);
            for (i, v) in [c, t1 - t0, n, chunk_tokens, cfg.layers, kvw].iter().enumerate() {
                b[8 + 4 * i..12 + 4 * i].copy_from_slice(&(*v as u32).to_le_bytes());
            }
            let mut at = HEADER;
            for l in 0..cfg.layers {
                for plane in [&cache.k[l], &cache.v[l]] {
                    for x in &plane[t0 * kvw..t1 * kvw] {
                        b[at..at + 2].copy_from_slice(&to_bf16(*x).to_le_bytes());
                        at += 2;
                    }
                }
            }
            b
        })
        .collect()
}

/// Rebuilds a cache from stored chunks, checking every header against the
/// model and the chunk's position. Strict: anything unexpected is an error.
pub fn decode(chunks: &[&[u8]], cfg: &Config, chunk_tokens: usize) -> Result<KvCache, String> {
    let kvw = cfg.kv_width();
    let mut cache = KvCache::new(cfg.layers);
    let mut total = None;
    for (c, b) in chunks.iter().enumerate() {
        if b.len() < chunk_bytes(cfg, chunk_tokens) || &b[..8] != MAGIC {
            return Err(format!("chunk {c}: not a {KV_FORMAT} chunk"));
        }
        let f = |i: usize| u32::from_le_bytes([b[8 + 4 * i], b[9 + 4 * i], b[10 + 4 * i], b[11 + 4 * i]]) as usize;
        let (index, tokens, n, ct, layers, width) = (f(0), f(1), f(2), f(3), f(4), f(5));
        if index != c || ct != chunk_tokens || layers != cfg.layers || width != kvw {
            return Err(format!(
                "chunk {c}: header says chunk {index}, {ct} tokens per chunk, {layers} layers, kv width {width}"
            ));
        }
        if *total.get_or_insert(n) != n || tokens != (n - c * ct).min(ct) || tokens == 0 {
            return Err(format!("chunk {c}: {tokens} tokens of {n} is inconsistent"));
        }
        let mut at = HEADER;
        for l in 0..cfg.layers {
            for plane in [&mut cache.k[l], &mut cache.v[l]] {
                for _ in 0..tokens * kvw {
                    plane.push(from_bf16(u16::from_le_bytes([b[at], b[at + 1]])));
                    at += 2;
                }
            }
        }
        cache.len += tokens;
    }
    match total {
        Some(n) if n == cache.len => Ok(cache),
        Some(n) => Err(format!("the chunks hold {} of the prompt's {n} tokens", cache.len)),
        None => Err("no chunks".into()),
    }
}

/// The cache as a reader gets it back: every value through bf16.
pub fn quantize(cache: &KvCache) -> KvCache {
    let q = |p: &Vec<f32>| p.iter().map(|x| from_bf16(to_bf16(*x))).collect();
    KvCache { k: cache.k.iter().map(q).collect(), v: cache.v.iter().map(q).collect(), len: cache.len }
}

#[cfg(test)]
mod tests {
    use super::super::{Model, tokenize};
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        assert_eq!(to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80, "a tie goes to even");
        assert_eq!(to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
    }

    #[test]
    fn chunks_round_trip_and_refuse_anything_else() {
        let cfg =
            Config { layers: 2, d_model: 64, q_heads: 4, kv_heads: 2, head_dim: 16, ffn: 128, vocab: 256, seed: 3 };
        let m = Model::new(cfg);
        let (cache, _) = m.prefill(&tokenize("a partial last chunk here"), 0);
        let chunks = encode(&cache, &cfg, 8);
        assert_eq!(chunks.len(), 25usize.div_ceil(8));
        assert!(chunks.iter().all(|c| c.len() == chunk_bytes(&cfg, 8) && c.len() % 4096 == 0));
        let refs: Vec<&[u8]> = chunks.iter().map(|c| c.as_slice()).collect();
        assert_eq!(decode(&refs, &cfg, 8).unwrap(), quantize(&cache));
        assert!(decode(&refs[..3], &cfg, 8).unwrap_err().contains("24 of the prompt's 25 tokens"), "missing chunk");
        let swapped = [refs[1], refs[0], refs[2], refs[3]];
        assert!(decode(&swapped, &cfg, 8).is_err(), "chunks out of order");
        assert!(decode(&refs, &cfg, 16).is_err(), "another chunk size");
        let mut bad = chunks[0].clone();
        bad[0] ^= 1;
        assert!(decode(&[&bad, refs[1], refs[2], refs[3]], &cfg, 8).is_err(), "a damaged header");
    }
}
