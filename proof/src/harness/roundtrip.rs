//! A verified round trip through the engine: write seeded KV-sized chunks on one
//! path, flush, read them back into cleared buffers, and compare byte for byte —
//! once through the engine and once through an independent `pread` on a
//! separate `O_DIRECT` descriptor that shares no code with the engine's I/O.
//!
//! This is what `cargo xtask demo` runs until the protocol exists.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use pdstor_engine::buffer::{Buffer, BufferError};
use pdstor_engine::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetKind,
    TargetOffset, TargetOptions, TransferId,
};
use pdstor_engine::payload;

/// Largest single buffer the round trip registers (io_uring allows 1 GiB).
const REGION_BYTES: u64 = 256 << 20;

/// What `pdstor roundtrip` runs.
#[derive(Debug, Clone)]
pub struct RoundtripConfig {
    /// The target (overwritten).
    pub target: PathBuf,
    /// `host` or `host_fixed`.
    pub path: PayloadPath,
    /// Chunks to write and read.
    pub chunks: u32,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// Requests in flight.
    pub queue_depth: u32,
    /// Seed of the payload.
    pub seed: u64,
}

/// What one round trip measured and verified.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RoundtripReport {
    /// The target.
    pub target: PathBuf,
    /// Its kind.
    pub target_kind: TargetKind,
    /// The path the chunks took.
    pub path: PayloadPath,
    /// Chunks written and read.
    pub chunks: u32,
    /// Bytes per chunk.
    pub chunk_size: u64,
    /// Bytes in all.
    pub bytes: u64,
    /// Seconds writing.
    pub write_seconds: f64,
    /// Seconds flushing.
    pub flush_seconds: f64,
    /// Seconds reading.
    pub read_seconds: f64,
    /// Write throughput, MiB/s.
    pub write_mib_per_s: f64,
    /// Read throughput, MiB/s.
    pub read_mib_per_s: f64,
    /// The engine read back every byte written.
    pub verified_by_engine: bool,
    /// An independent `pread(O_DIRECT)` read back every byte written (not for passthrough).
    pub verified_independently: bool,
}

/// Why a round trip failed.
#[derive(Debug, thiserror::Error)]
pub enum RoundtripError {
    /// The engine refused or failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A buffer could not be made.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// A configuration that cannot run.
    #[error("round trip: {0}")]
    Config(String),
    /// A chunk read back differs from what was written.
    #[error("chunk {chunk} read back {how} differs from what was written, first at byte {offset}")]
    Mismatch {
        /// The chunk.
        chunk: u64,
        /// Through the engine or independently.
        how: &'static str,
        /// The first differing byte.
        offset: usize,
    },
    /// The independent read failed.
    #[error("independent O_DIRECT read of {path} at offset {offset}: {source}")]
    IndependentRead {
        /// The target.
        path: PathBuf,
        /// Where.
        offset: u64,
        /// The kernel's error.
        #[source]
        source: std::io::Error,
    },
}

/// Writes seeded chunks, flushes, reads them back and verifies byte for byte.
pub fn run(cfg: &RoundtripConfig) -> Result<RoundtripReport, RoundtripError> {
    if cfg.chunks == 0 || cfg.chunk_size == 0 || cfg.chunk_size > REGION_BYTES {
        return Err(RoundtripError::Config(format!(
            "need at least one chunk of 1 byte to {REGION_BYTES} bytes (got {} chunks of {} bytes)",
            cfg.chunks, cfg.chunk_size
        )));
    }
    let total = cfg.chunks as u64 * cfg.chunk_size;
    let target = Target::open(&cfg.target, &TargetOptions { create_len: Some(total), ..Default::default() })?;
    let kind = target.kind();
    let per_region = (REGION_BYTES / cfg.chunk_size).max(1);
    let regions = (cfg.chunks as u64).div_ceil(per_region);
    let mut engine = Engine::new(
        target,
        EngineOptions { queue_depth: cfg.queue_depth, buffer_slots: regions as u32, ..Default::default() },
    )?;
    let mut ids: Vec<BufferId> = Vec::new();
    for r in 0..regions {
        let n = per_region.min(cfg.chunks as u64 - r * per_region);
        let buffer = Buffer::memfd(&format!("pdstor-roundtrip-{r}"), (n * cfg.chunk_size) as usize)?;
        ids.push(match cfg.path {
            PayloadPath::Host => engine.add(buffer)?,
            _ => engine.register(buffer)?,
        });
    }
    let locate = |chunk: u64| (ids[(chunk / per_region) as usize], (chunk % per_region) * cfg.chunk_size);
    let mut scratch = vec![0u8; cfg.chunk_size as usize];
    for chunk in 0..cfg.chunks as u64 {
        payload::fill(cfg.seed, chunk, &mut scratch);
        let (id, off) = locate(chunk);
        engine.buffer(id)?.write_at(off, &scratch)?;
    }
    let batch = |op: Op| -> Vec<IoRequest> {
        (0..cfg.chunks as u64)
            .map(|chunk| {
                let (buffer, buffer_offset) = locate(chunk);
                IoRequest {
                    transfer: TransferId(chunk + 1),
                    op,
                    path: cfg.path,
                    buffer,
                    buffer_offset: BufferOffset(buffer_offset),
                    target_offset: TargetOffset(chunk * cfg.chunk_size),
                    len: cfg.chunk_size,
                }
            })
            .collect()
    };

    let t = Instant::now();
    engine.execute_all(&batch(Op::Write))?;
    let write_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    engine.flush()?;
    let flush_seconds = t.elapsed().as_secs_f64();

    // Clear the buffers so only a real read can put the bytes back.
    let zeros = vec![0u8; cfg.chunk_size as usize];
    for chunk in 0..cfg.chunks as u64 {
        let (id, off) = locate(chunk);
        engine.buffer(id)?.write_at(off, &zeros)?;
    }
    let t = Instant::now();
    engine.execute_all(&batch(Op::Read))?;
    let read_seconds = t.elapsed().as_secs_f64();

    let mut got = vec![0u8; cfg.chunk_size as usize];
    for chunk in 0..cfg.chunks as u64 {
        payload::fill(cfg.seed, chunk, &mut scratch);
        let (id, off) = locate(chunk);
        engine.buffer(id)?.read_at(off, &mut got)?;
        if let Some(offset) = payload::first_difference(&scratch, &got) {
            return Err(RoundtripError::Mismatch { chunk, how: "through the engine", offset });
        }
    }
    let independent = kind != TargetKind::NvmeGeneric;
    if independent {
        verify_independently(&cfg.target, cfg, engine.geometry().mem_align as usize)?;
    }
    let mib = total as f64 / (1024.0 * 1024.0);
    Ok(RoundtripReport {
        target: cfg.target.clone(),
        target_kind: kind,
        path: cfg.path,
        chunks: cfg.chunks,
        chunk_size: cfg.chunk_size,
        bytes: total,
        write_seconds,
        flush_seconds,
        read_seconds,
        write_mib_per_s: mib / write_seconds,
        read_mib_per_s: mib / read_seconds,
        verified_by_engine: true,
        verified_independently: independent,
    })
}

/// Reads every chunk with `pread(2)` on a fresh `O_DIRECT` descriptor into an
/// aligned buffer and compares it with the seeded payload.
fn verify_independently(path: &Path, cfg: &RoundtripConfig, align: usize) -> Result<(), RoundtripError> {
    let err = |offset: u64| move |source| RoundtripError::IndependentRead { path: path.into(), offset, source };
    let file = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).map_err(err(0))?;
    // A page-aligned buffer satisfies any direct-I/O memory alignment up to a page.
    let aligned = Buffer::host(cfg.chunk_size.max(align as u64) as usize)?;
    let mut got = vec![0u8; cfg.chunk_size as usize];
    let mut want = vec![0u8; cfg.chunk_size as usize];
    for chunk in 0..cfg.chunks as u64 {
        let offset = chunk * cfg.chunk_size;
        let slice = aligned.slice(0, cfg.chunk_size as usize)?;
        // SAFETY: `slice` is a live, writable mapping of exactly `chunk_size`
        // bytes owned by `aligned`; nothing else accesses it during the read.
        let dst = unsafe { std::slice::from_raw_parts_mut(slice.ptr_guard_mut().as_ptr(), slice.len()) };
        file.read_exact_at(dst, offset).map_err(err(offset))?;
        aligned.read_at(0, &mut got)?;
        payload::fill(cfg.seed, chunk, &mut want);
        if let Some(at) = payload::first_difference(&want, &got) {
            return Err(RoundtripError::Mismatch { chunk, how: "independently (O_DIRECT pread)", offset: at });
        }
    }
    Ok(())
}
