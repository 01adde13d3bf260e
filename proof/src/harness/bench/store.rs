//! `pdstor bench-store`: publications per second through prepare → one-chunk
//! store batch → publish → release on a formatted target, with concurrent
//! writers, and what group commit saves: flushes and commit groups per
//! publication, journal records per second. With `--handoffs` each
//! publication is instead claimed, adopted, loaded and acked by its thread:
//! the readers' ownership records (CLAIM, ADOPT, ACK) share flushes with one
//! another and with the writers' the same way (the ADOPT, of a reader
//! loading through the store, needs no flush of its own).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_daemon::store::{self, ChunkDest, ChunkSource, FormatOptions, Store, StoreBatch, StoreOptions};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::BufferOffset;

/// What `pdstor bench-store` runs.
#[derive(Debug, Clone)]
pub struct StoreBenchConfig {
    /// A file to create (and remove) for the run.
    pub target: PathBuf,
    /// Concurrent writer threads.
    pub writers: u32,
    /// Publications in all.
    pub publications: u32,
    /// Bytes of each publication's one chunk.
    pub chunk: u64,
    /// Each publication is claimed, adopted, loaded and acked (a whole
    /// handoff) instead of released.
    pub handoffs: bool,
}

/// What the store bench measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreBenchReport {
    /// Writer threads.
    pub writers: u32,
    /// Publications done.
    pub publications: u32,
    /// Bytes per chunk.
    pub chunk: u64,
    /// What followed each publish: `release`, or
    /// `claim+adopt+load+ack` (`--handoffs`).
    pub after_publish: &'static str,
    /// Wall time.
    pub seconds: f64,
    /// Publications per second.
    pub publications_per_s: f64,
    /// Journal records per second (four per publication, six with
    /// `--handoffs`).
    pub journal_records_per_s: f64,
    /// Device flushes during the run.
    pub flushes: u64,
    /// Flushes per publication (group commit shares them).
    pub flushes_per_publication: f64,
    /// Commit groups per publication.
    pub commit_groups_per_publication: f64,
}

/// Formats a scratch target, runs the writers, and reports.
pub fn run(cfg: &StoreBenchConfig) -> anyhow::Result<StoreBenchReport> {
    let slots = 4 * cfg.writers as u64;
    let journal_half = 16 << 20;
    let len = 2 * 4096 + 2 * journal_half + slots * cfg.chunk;
    let _ = std::fs::remove_file(&cfg.target);
    store::format(
        &cfg.target,
        &FormatOptions { slot_size: cfg.chunk, journal_half, force: false, create_len: Some(len) },
    )?;
    let (s, _) = Store::open(
        &cfg.target,
        StoreOptions { queue_depth: 32, admission_timeout: Duration::from_secs(60), ..Default::default() },
    )?;
    let s = Arc::new(s);
    let layout = Layout {
        model_id: "bench".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        chunk_tokens: 256,
        kv_format: "bench".into(),
    };
    let before = s.commit()?;
    let per_writer = cfg.publications / cfg.writers;
    let started = Instant::now();
    let handles: Vec<_> = (0..cfg.writers)
        .map(|w| {
            let (s, layout, chunk, handoffs) = (s.clone(), layout.clone(), cfg.chunk, cfg.handoffs);
            std::thread::spawn(move || -> anyhow::Result<()> {
                let buf = Buffer::host(chunk as usize)?;
                buf.write_at(0, &pdstor_engine::payload::chunk(w as u64, 0, chunk as usize))?;
                let id = s.register_buffer(buf)?;
                let into = s.register_buffer(Buffer::host(chunk as usize)?)?;
                for i in 0..per_writer {
                    let p = s.prepare(&format!("w{w}-{i}"), "bench", &layout, 1)?;
                    let c =
                        ChunkSource { index: 0, buffer: id, buffer_offset: BufferOffset(0), len: chunk, crc32c: None };
                    s.store_batch(&StoreBatch {
                        publication: p,
                        chunks: vec![c],
                        is_last_batch: true,
                        total_chunks: 1,
                    })?;
                    s.publish(p, None)?;
                    if handoffs {
                        // The reader's side: what the protocol service does
                        // for claim, adopt and ack once it has checked who asks.
                        let now_ms = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| d.as_millis() as u64);
                        s.claim(p, &format!("r{w}"), &format!("s{w}-{i}"), 60_000, now_ms, None)?;
                        s.adopt(p, false, None)?;
                        let dest = ChunkDest { index: 0, buffer: into, buffer_offset: BufferOffset(0) };
                        s.load(p, &[dest])?;
                        s.ack(p, "bench")?;
                    } else {
                        s.release(p)?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a bench writer panicked"))??;
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = s.commit()?;
    let done = per_writer * cfg.writers;
    let flushes = after.flushes - before.flushes;
    // prepare, alloc, publish, then release, or claim, adopt and ack.
    let records = if cfg.handoffs { 6.0 } else { 4.0 } * done as f64;
    let _ = std::fs::remove_file(&cfg.target);
    Ok(StoreBenchReport {
        writers: cfg.writers,
        publications: done,
        chunk: cfg.chunk,
        after_publish: if cfg.handoffs { "claim+adopt+load+ack" } else { "release" },
        seconds,
        publications_per_s: done as f64 / seconds,
        journal_records_per_s: records / seconds,
        flushes,
        flushes_per_publication: flushes as f64 / done as f64,
        commit_groups_per_publication: (after.commit_groups - before.commit_groups) as f64 / done as f64,
    })
}
