//! A small deterministic decoder-only transformer, for the model oracle
//! (`pdstor qualify`). Weights come from a seeded PRNG (nothing is
//! downloaded): 4 layers, d_model 256, 8 query heads sharing 2 KV heads
//! (grouped-query attention), head dim 32, RoPE, RMSNorm, SwiGLU, a byte
//! vocabulary. Arithmetic is plain `f32` in a fixed order, so the same seed
//! gives the same logits bit for bit, and a prompt prefilled in chunks gives
//! exactly the KV cache of the same prompt prefilled at once.
//!
//! The KV cache goes to storage in the layout of [`kv`]: bf16, chunked by
//! `chunk_tokens`.

pub mod kv;

use rand::{Rng, SeedableRng};

/// The deterministic model's shape and weights' seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Config {
    /// Transformer layers.
    pub layers: usize,
    /// Model width.
    pub d_model: usize,
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (grouped-query attention).
    pub kv_heads: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Seed of the weights.
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config { layers: 4, d_model: 256, q_heads: 8, kv_heads: 2, head_dim: 32, ffn: 512, vocab: 256, seed: 1234 }
    }
}

impl Config {
    /// Floats of K (or V) per token per layer.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

/// A small deterministic transformer (f32) whose KV cache pdstor hands off.
pub struct Model {
    cfg: Config,
    embed: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    unembed: Vec<f32>,
    /// RoPE: cos and sin per (position, pair), grown on demand.
    rope: std::sync::Mutex<(Vec<f32>, Vec<f32>)>,
}

/// Per layer, the keys and values of every token so far: `[token][kv_width]`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    /// Keys, per layer, per token.
    pub k: Vec<Vec<f32>>,
    /// Values, per layer, per token.
    pub v: Vec<Vec<f32>>,
    /// Tokens cached.
    pub len: usize,
}

impl KvCache {
    /// An empty cache of `layers` layers.
    pub fn new(layers: usize) -> KvCache {
        KvCache { k: vec![Vec::new(); layers], v: vec![Vec::new(); layers], len: 0 }
    }
}

/// Greedy output: the chosen tokens and each one's log-probability.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Continuation {
    /// The chosen tokens.
    pub tokens: Vec<u32>,
    /// Each one's log-probability.
    pub logprobs: Vec<f32>,
}

/// `Σ a[i]·b[i]` in eight fixed lanes (vectorisable, and the same order every time).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `out[r] = W[r,:]·x` for a row-major `rows × x.len()` matrix.
fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot(&w[r * x.len()..(r + 1) * x.len()], x);
    }
}

fn rmsnorm(x: &[f32], g: &[f32], out: &mut [f32]) {
    let ms = dot(x, x) / x.len() as f32;
    let inv = 1.0 / (ms + 1e-5).sqrt();
    for ((o, xi), gi) in out.iter_mut().zip(x).zip(g) {
        *o = xi * inv * gi;
    }
}

/// log-softmax of `logits` at `token`.
pub fn logprob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
    logits[token as usize] - max - sum.ln()
}

/// The highest logit (the lowest index among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if *l > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Model {
    /// The model `cfg` describes, its weights drawn from `cfg.seed`.
    pub fn new(cfg: Config) -> Model {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(cfg.seed);
        let mut w = |n: usize, fan_in: usize, gain: f32| -> Vec<f32> {
            let s = gain * (3.0 / fan_in as f32).sqrt();
            (0..n).map(|_| rng.random_range(-s..s)).collect()
        };
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let embed = w(cfg.vocab * d, 1, 1.0);
        let layers = (0..cfg.layers)
            .map(|_| Layer {
                attn_norm: vec![1.0; d],
                wq: w(cfg.q_heads * hd * d, d, 1.0),
                wk: w(cfg.kv_heads * hd * d, d, 1.0),
                wv: w(cfg.kv_heads * hd * d, d, 1.0),
                wo: w(d * cfg.q_heads * hd, cfg.q_heads * hd, 1.0),
                ffn_norm: vec![1.0; d],
                w_gate: w(cfg.ffn * d, d, 1.0),
                w_up: w(cfg.ffn * d, d, 1.0),
                w_down: w(d * cfg.ffn, cfg.ffn, 1.0),
            })
            .collect();
        // A large output gain makes greedy choices decisive, as a trained
        // model's are, rather than near-ties between random logits.
        let unembed = w(cfg.vocab * d, d, 6.0);
        Model { cfg, embed, layers, final_norm: vec![1.0; d], unembed, rope: Default::default() }
    }

    /// Its shape.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn rope_at(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.cfg.head_dim / 2;
        let mut g = self.rope.lock().unwrap_or_else(|p| p.into_inner());
        while g.0.len() < (pos + 1) * half {
            let p = g.0.len() / half;
            for i in 0..half {
                let theta = p as f32 / 10000f32.powf(2.0 * i as f32 / self.cfg.head_dim as f32);
                g.0.push(theta.cos());
                g.1.push(theta.sin());
            }
        }
        (g.0[pos * half..(pos + 1) * half].to_vec(), g.1[pos * half..(pos + 1) * half].to_vec())
    }

    fn rotate(&self, v: &mut [f32], pos: usize) {
        let half = self.cfg.head_dim / 2;
        let (cos, sin) = self.rope_at(pos);
        for head in v.chunks_exact_mut(self.cfg.head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Runs `tokens` (at positions `cache.len..`) through the model, appending
    /// their keys and values to `cache`; returns the last token's logits.
    pub fn forward(&self, cache: &mut KvCache, tokens: &[u32]) -> Vec<f32> {
        let c = &self.cfg;
        let (d, hd, kvw) = (c.d_model, c.head_dim, c.kv_width());
        let group = c.q_heads / c.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut last = vec![0f32; d];
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = cache.len + i;
            let mut x = self.embed[tok as usize * d..(tok as usize + 1) * d].to_vec();
            let mut h = vec![0f32; d];
            for (l, layer) in self.layers.iter().enumerate() {
                rmsnorm(&x, &layer.attn_norm, &mut h);
                let mut q = vec![0f32; c.q_heads * hd];
                let mut k = vec![0f32; kvw];
                let mut v = vec![0f32; kvw];
                matvec(&layer.wq, &h, &mut q);
                matvec(&layer.wk, &h, &mut k);
                matvec(&layer.wv, &h, &mut v);
                self.rotate(&mut q, pos);
                self.rotate(&mut k, pos);
                cache.k[l].extend_from_slice(&k);
                cache.v[l].extend_from_slice(&v);
                let n = pos + 1;
                let mut attn = vec![0f32; c.q_heads * hd];
                let mut scores = vec![0f32; n];
                for qh in 0..c.q_heads {
                    let kh = qh / group;
                    let qv = &q[qh * hd..(qh + 1) * hd];
                    for (t, s) in scores.iter_mut().enumerate() {
                        *s = dot(qv, &cache.k[l][t * kvw + kh * hd..t * kvw + (kh + 1) * hd]) * scale;
                    }
                    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let out = &mut attn[qh * hd..(qh + 1) * hd];
                    for (t, s) in scores.iter().enumerate() {
                        let vv = &cache.v[l][t * kvw + kh * hd..t * kvw + (kh + 1) * hd];
                        let p = s / sum;
                        for (o, vi) in out.iter_mut().zip(vv) {
                            *o += p * vi;
                        }
                    }
                }
                let mut proj = vec![0f32; d];
                matvec(&layer.wo, &attn, &mut proj);
                for (xi, pi) in x.iter_mut().zip(&proj) {
                    *xi += pi;
                }
                rmsnorm(&x, &layer.ffn_norm, &mut h);
                let mut gate = vec![0f32; c.ffn];
                let mut up = vec![0f32; c.ffn];
                matvec(&layer.w_gate, &h, &mut gate);
                matvec(&layer.w_up, &h, &mut up);
                for (g, u) in gate.iter_mut().zip(&up) {
                    *g = *g / (1.0 + (-*g).exp()) * u; // SiLU(gate) · up
                }
                matvec(&layer.w_down, &gate, &mut proj);
                for (xi, pi) in x.iter_mut().zip(&proj) {
                    *xi += pi;
                }
            }
            last = x;
        }
        cache.len += tokens.len();
        let mut h = vec![0f32; d];
        rmsnorm(&last, &self.final_norm, &mut h);
        let mut logits = vec![0f32; c.vocab];
        matvec(&self.unembed, &h, &mut logits);
        logits
    }

    /// Prefills `prompt` in pieces of `chunk` tokens (0: all at once).
    pub fn prefill(&self, prompt: &[u32], chunk: usize) -> (KvCache, Vec<f32>) {
        let mut cache = KvCache::new(self.cfg.layers);
        let mut logits = Vec::new();
        let step = if chunk == 0 { prompt.len().max(1) } else { chunk };
        for piece in prompt.chunks(step) {
            logits = self.forward(&mut cache, piece);
        }
        (cache, logits)
    }

    /// Greedy decoding from `cache` (which holds the prompt), starting with
    /// the producer token `first` chosen from the prompt's logits with
    /// log-probability `first_logprob`: `budget` tokens in all, ending early
    /// after `stop`.
    pub fn decode(
        &self,
        cache: &mut KvCache,
        first: u32,
        first_logprob: f32,
        budget: usize,
        stop: Option<u32>,
    ) -> Continuation {
        let mut out = Continuation { tokens: vec![first], logprobs: vec![first_logprob] };
        let mut tok = first;
        while out.tokens.len() < budget && Some(tok) != stop {
            let logits = self.forward(cache, &[tok]);
            tok = argmax(&logits);
            out.tokens.push(tok);
            out.logprobs.push(logprob(&logits, tok));
        }
        out
    }

    /// The no-cache oracle: the prompt and the generation computed from
    /// scratch in f32, nothing reused from anyone.
    pub fn generate(&self, prompt: &[u32], budget: usize, stop: Option<u32>) -> Continuation {
        let (mut cache, logits) = self.prefill(prompt, 0);
        let first = argmax(&logits);
        self.decode(&mut cache, first, logprob(&logits, first), budget, stop)
    }
}

/// Byte tokens of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Config {
        Config { layers: 2, d_model: 64, q_heads: 4, kv_heads: 2, head_dim: 16, ffn: 128, vocab: 256, seed: 7 }
    }

    #[test]
    fn the_same_seed_gives_the_same_logits_bit_for_bit() {
        let prompt = tokenize("the KV cache goes through NVMe");
        let a = Model::new(small()).prefill(&prompt, 0).1;
        let b = Model::new(small()).prefill(&prompt, 0).1;
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let c = Model::new(Config { seed: 8, ..small() }).prefill(&prompt, 0).1;
        assert_ne!(a, c, "another seed is another model");
    }

    #[test]
    fn split_prefill_agrees_with_monolithic_exactly() {
        let m = Model::new(small());
        let prompt = tokenize("prefill in chunks, decode from storage, compare");
        let (mono, lm) = m.prefill(&prompt, 0);
        for chunk in [1, 5, 16] {
            let (split, ls) = m.prefill(&prompt, chunk);
            assert_eq!(split, mono, "chunk {chunk}: the KV cache");
            assert_eq!(ls, lm, "chunk {chunk}: the logits");
        }
    }

    #[test]
    fn decoding_from_a_cache_equals_generating_from_scratch() {
        let m = Model::new(small());
        let prompt = tokenize("abc");
        let oracle = m.generate(&prompt, 12, None);
        assert_eq!(oracle.tokens.len(), 12);
        let (mut cache, logits) = m.prefill(&prompt, 2);
        let first = argmax(&logits);
        let got = m.decode(&mut cache, first, logprob(&logits, first), 12, None);
        assert_eq!(got, oracle);
        // A stop token inside the budget ends the continuation right after it.
        let stop = oracle.tokens[4];
        let first_at = oracle.tokens.iter().position(|t| *t == stop).unwrap();
        assert_eq!(m.generate(&prompt, 12, Some(stop)).tokens, oracle.tokens[..=first_at]);
        assert!(oracle.logprobs.iter().all(|l| *l <= 0.0 && l.is_finite()));
    }
}
