//! `pdstor bench`: the engine's throughput and latency on one target, with fio's
//! pattern names so `cargo xtask bench` can run fio beside it with the same
//! block size, depth and size and report the ratio.
//!
//! This is a measurement, not a test: it asserts nothing about speed.

pub mod crc;
pub mod handoff;
pub mod store;

use std::path::PathBuf;
use std::time::Instant;

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOffset,
    TargetOptions, TransferId,
};

/// fio's `--rw` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Sequential writes.
    Write,
    /// Sequential reads.
    Read,
    /// Random writes.
    Randwrite,
    /// Random reads.
    Randread,
}

impl Pattern {
    /// Every pattern, as fio names them.
    pub const ALL: [Pattern; 4] = [Pattern::Write, Pattern::Read, Pattern::Randwrite, Pattern::Randread];

    /// fio's name for the pattern.
    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::Write => "write",
            Pattern::Read => "read",
            Pattern::Randwrite => "randwrite",
            Pattern::Randread => "randread",
        }
    }

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

impl std::str::FromStr for Pattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown pattern {s:?}: expected write, read, randwrite or randread"))
    }
}

/// What `pdstor bench` measures.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// The target (overwritten).
    pub target: PathBuf,
    /// `host` or `host_fixed`.
    pub path: PayloadPath,
    /// fio's pattern.
    pub pattern: Pattern,
    /// Bytes per request.
    pub block_size: u64,
    /// Requests in flight.
    pub queue_depth: u32,
    /// Bytes of the target the run covers (and, for random patterns, the I/O count is size / bs).
    pub size: u64,
    /// Seed of the payload and of random offsets.
    pub seed: u64,
}

/// Latency percentiles in µs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyUs {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest.
    pub max: f64,
}

/// What one `pdstor bench` run measured, named as fio names it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// The target.
    pub target: PathBuf,
    /// Its kind.
    pub target_kind: pdstor_engine::io::TargetKind,
    /// The path the requests took.
    pub path: PayloadPath,
    /// fio's pattern.
    pub pattern: Pattern,
    /// Bytes per request.
    pub bs: u64,
    /// Requests in flight.
    pub qd: u32,
    /// Bytes of the target covered.
    pub size: u64,
    /// Requests completed.
    pub ios: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// Throughput, MiB/s.
    pub mib_per_s: f64,
    /// Throughput, MB/s (fio's `bw` in decimal units).
    pub mb_per_s: f64,
    /// Requests per second.
    pub iops: f64,
    /// Latency percentiles.
    pub lat_us: LatencyUs,
}

/// Why a bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The engine refused or failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A buffer could not be made.
    #[error(transparent)]
    Buffer(#[from] pdstor_engine::buffer::BufferError),
    /// A configuration that cannot run (sizes, queue depth).
    #[error("bench: {0}")]
    Config(String),
}

/// Runs `cfg` and reports what it measured.
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
    pdstor_engine::payload::fill(cfg.seed, 0, &mut scratch);
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
