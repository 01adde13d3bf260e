//! `pdstor bench`: the engine's throughput and latency on one target, with fio's
//! pattern names so `cargo xtask bench` can run fio beside it with the same
//! block size, depth and size and report the ratio.
//!
//! This is a measurement, not a test: it asserts nothing about speed.

pub mod handoff;
pub mod store;

use std::path::PathBuf;
use std::time::Instant;

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::buffer::Buffer;
use crate::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOffset,
    TargetOptions, TransferId,
};

/// fio's `--rw` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Write,
    Read,
    Randwrite,
    Randread,
}

impl Pattern {
    fn op(self) -> Op {
        match self {
            Pattern::Write | Pattern::Randwrite => Op::Write,
            Pattern::Read | Pattern::Randread => Op::Read,
        }
    }
    fn random(self) -> bool {
        matches!(self, Pattern::Randwrite | Pattern::Randread)
    }
}

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub target: PathBuf,
    pub path: PayloadPath,
    pub pattern: Pattern,
    pub block_size: u64,
    pub queue_depth: u32,
    /// Bytes of the target the run covers (and, for random patterns, the I/O count is size / bs).
    pub size: u64,
    pub seed: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyUs {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub target: PathBuf,
    pub target_kind: crate::io::TargetKind,
    pub path: PayloadPath,
    pub pattern: Pattern,
    pub bs: u64,
    pub qd: u32,
    pub size: u64,
    pub ios: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub mib_per_s: f64,
    pub mb_per_s: f64,
    pub iops: f64,
    pub lat_us: LatencyUs,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Buffer(#[from] crate::buffer::BufferError),
    #[error("bench: {0}")]
    Config(String),
}

pub fn run(cfg: &BenchConfig) -> Result<BenchReport, BenchError> {
    if cfg.block_size == 0 || cfg.size < cfg.block_size || cfg.queue_depth == 0 {
        return Err(BenchError::Config(format!(
            "need bs > 0, size >= bs and qd > 0 (got bs {}, size {}, qd {})",
            cfg.block_size, cfg.size, cfg.queue_depth
        )));
    }
    let target = Target::open(&cfg.target, &TargetOptions { create_len: Some(cfg.size), ..Default::default() })?;
    if cfg.size > target.geometry().capacity {
        return Err(BenchError::Config(format!(
            "--size {} is larger than target {} ({} bytes)",
            cfg.size,
            cfg.target.display(),
            target.geometry().capacity
        )));
    }
    let kind = target.kind();
    let mut engine =
        Engine::new(target, EngineOptions { queue_depth: cfg.queue_depth, buffer_slots: 1, ..Default::default() })?;
    let region = usize::try_from(cfg.block_size * cfg.queue_depth as u64)
        .map_err(|_| BenchError::Config("bs * qd does not fit in memory".into()))?;
    let buffer = Buffer::host(region)?;
    // Writes carry real (incompressible) bytes; reads land over them.
    let mut scratch = vec![0u8; region];
    crate::payload::fill(cfg.seed, 0, &mut scratch);
    buffer.write_at(0, &scratch)?;
    drop(scratch);
    let id: BufferId = match cfg.path {
        PayloadPath::HostFixed => engine.register(buffer)?,
        _ => engine.add(buffer)?,
    };

    let blocks = cfg.size / cfg.block_size;
    let ios = blocks;
    let mut rng = SmallRng::seed_from_u64(cfg.seed);
    let mut issued = 0u64;
    let mut hist = Histogram::<u64>::new(3).map_err(|e| BenchError::Config(e.to_string()))?;
    let mut first_error = None;
    let mut bytes = 0u64;
    let start = Instant::now();
    engine.stream(
        |slot| {
            if issued == ios {
                return None;
            }
            let block = if cfg.pattern.random() { rng.random_range(0..blocks) } else { issued };
            issued += 1;
            Some(IoRequest {
                transfer: TransferId(issued),
                op: cfg.pattern.op(),
                path: cfg.path,
                buffer: id,
                buffer_offset: BufferOffset(slot as u64 * cfg.block_size),
                target_offset: TargetOffset(block * cfg.block_size),
                len: cfg.block_size,
            })
        },
        |_, c| {
            bytes += c.bytes;
            let _ = hist.record(c.latency.as_nanos() as u64);
            if let Err(e) = c.result {
                first_error.get_or_insert(e);
            }
        },
    )?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some(e) = first_error {
        return Err(e.into());
    }
    let us = |ns: u64| ns as f64 / 1000.0;
    Ok(BenchReport {
        target: cfg.target.clone(),
        target_kind: kind,
        path: cfg.path,
        pattern: cfg.pattern,
        bs: cfg.block_size,
        qd: cfg.queue_depth,
        size: cfg.size,
        ios,
        bytes,
        seconds,
        mib_per_s: bytes as f64 / seconds / (1024.0 * 1024.0),
        mb_per_s: bytes as f64 / seconds / 1e6,
        iops: ios as f64 / seconds,
        lat_us: LatencyUs {
            mean: hist.mean() / 1000.0,
            p50: us(hist.value_at_quantile(0.50)),
            p90: us(hist.value_at_quantile(0.90)),
            p99: us(hist.value_at_quantile(0.99)),
            p999: us(hist.value_at_quantile(0.999)),
            max: us(hist.max()),
        },
    })
}
