//! `pdstor bench-handoff`: the whole handoff against a running daemon, with
//! writer and reader buffers registered once and reused: prepare → store →
//! publish → claim → adopt → load (+ client-side crc32c of every chunk) → ack.
//! Reports the median wall time of a full handoff and the latency of each
//! control-plane step (measured on many small handoffs).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use hdrhistogram::Histogram;

use pdstor_client::layout::Layout;
use pdstor_client::layout::Manifest;
use pdstor_client::{ClientError, Reader, Writer};

/// What `pdstor bench-handoff` runs against a daemon.
#[derive(Debug, Clone)]
pub struct HandoffBenchConfig {
    /// The daemon's control plane.
    pub server: String,
    /// The daemon's data socket.
    pub data_socket: PathBuf,
    /// Bytes per handoff.
    pub bytes: u64,
    /// Bytes per chunk.
    pub chunk: u64,
    /// Handoffs to time.
    pub rounds: u32,
    /// Single-chunk handoffs timed per step.
    pub latency_samples: u32,
    /// Loads of one adopted handoff timed after the rounds.
    pub reloads: u32,
    /// Each reload copies every chunk out into this process's memory,
    /// checked in the copy (unless `verify` is `None`: a plain copy).
    pub copy_out: bool,
    /// Who checksums the reader's loads.
    pub verify: pdstor_client::Verify,
}

/// One step's latency percentiles.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepLatency {
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

/// What the handoff bench measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HandoffBenchReport {
    /// Bytes per handoff.
    pub bytes: u64,
    /// Bytes per chunk.
    pub chunk: u64,
    /// Handoffs timed.
    pub rounds: u32,
    /// Each handoff's wall time.
    pub seconds: Vec<f64>,
    /// Their median.
    pub median_seconds: f64,
    /// Throughput at the median, MiB/s.
    pub mib_per_s: f64,
    /// Per step (prepare, store, publish, claim, …), its latency.
    pub steps: BTreeMap<String, StepLatency>,
    /// Where each full round spent its time, in µs.
    pub round_steps_us: Vec<BTreeMap<String, u64>>,
    /// Each reload's wall time (load + verify of every chunk), s.
    pub reload_seconds: Vec<f64>,
    /// Their median.
    pub reload_median_seconds: Option<f64>,
    /// CPU the reloads took per GiB loaded, the daemon's (every thread: the
    /// I/O thread, the verifiers) and this reader's, s/GiB.
    pub reload_cpu: Option<ReloadCpu>,
    /// Whether each reload copied its chunks out (`HandoffBenchConfig::copy_out`).
    pub reload_copy_out: bool,
}

/// CPU seconds per GiB reloaded.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadCpu {
    /// The daemon's.
    pub daemon_s_per_gib: f64,
    /// This reader's.
    pub reader_s_per_gib: f64,
    /// Both.
    pub total_s_per_gib: f64,
}

/// A process's user + system CPU seconds, all its threads, from
/// `/proc/<pid>/stat` (clock ticks).
fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces), from field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf reads a constant of the running system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

fn layout() -> Layout {
    Layout {
        model_id: "bench".into(),
        dtype: "bf16".into(),
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        chunk_tokens: 256,
        kv_format: "bench".into(),
    }
}

/// Bytes per store request: the whole handoff in one (up to 1,024 chunks),
/// so the daemon keeps its queue full from the first chunk to the last. A
/// request per few chunks drains the queue at every round trip: on zram,
/// prepare + store + publish of 512 MiB in 8 MiB chunks took 223-241 ms in
/// 32 MiB requests, 196-217 ms in 128 MiB ones, 133-205 ms in one.
const STORE_REQUEST_BYTES: u64 = 512 << 20;

/// The middle value (the upper one of an even count); NaN for none.
fn median_of(v: &[f64]) -> f64 {
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Chunks per store request for `chunk`-byte chunks.
fn store_batch(chunk: u64) -> u32 {
    (STORE_REQUEST_BYTES / chunk.max(1)).clamp(4, 1024) as u32
}

/// One handoff; returns each step's duration in µs.
fn handoff(
    w: &mut Writer,
    r: &mut Reader,
    req: &str,
    bytes: u64,
    chunk: u64,
) -> Result<Vec<(&'static str, u64)>, ClientError> {
    let mut steps = Vec::with_capacity(6);
    let t = Instant::now();
    let published = w.put_in_place(req, &layout(), bytes, store_batch(chunk), Some(1))?;
    steps.push(("prepare+store+publish", t.elapsed().as_micros() as u64));
    let t = Instant::now();
    let claim = r.client.claim(&published.receipt, "bench-reader", req, 60_000)?;
    steps.push(("claim", t.elapsed().as_micros() as u64));
    let t = Instant::now();
    let restored = r.get(&claim, &layout())?;
    steps.push(("adopt+load+verify", t.elapsed().as_micros() as u64));
    let t = Instant::now();
    r.client.ack(&claim, &restored.restore_digest)?;
    steps.push(("ack", t.elapsed().as_micros() as u64));
    Ok(steps)
}

/// The load path alone: one adopted handoff loaded `cfg.reloads` times;
/// each load's seconds, and the CPU they took (the daemon's and this
/// process's) per GiB.
fn reloads(
    cfg: &HandoffBenchConfig,
    w: &mut Writer,
    r: &mut Reader,
    run_id: u64,
) -> Result<(Vec<f64>, Option<ReloadCpu>), ClientError> {
    let mut reload_seconds = Vec::new();
    let req = format!("bench-{run_id}-reload");
    let published = w.put_in_place(&req, &layout(), cfg.bytes, store_batch(cfg.chunk), Some(1))?;
    // Copying out: a reader whose buffer the daemon leaves unchecked.
    let mut staging = if cfg.copy_out { Some(Reader::new(&cfg.server, &cfg.data_socket)?) } else { None };
    let r = match staging.as_mut() {
        Some(s) => {
            s.set_verify(pdstor_client::Verify::None);
            s
        }
        None => r,
    };
    let claim = r.client.claim(&published.receipt, "bench-reader", &req, 60_000)?;
    let manifest = r.adopt(&claim, &layout())?;
    let mut dest = if cfg.copy_out { vec![1u8; cfg.bytes as usize] } else { Vec::new() };
    if cfg.copy_out {
        // The new reader's buffer made, shared and pinned by the daemon
        // before the measurement, as the in-place reader's was by the rounds.
        r.load(&claim, manifest.clone())?;
    }
    let mut last = None;
    let daemon = r.daemon_pid().ok();
    let before = (daemon.and_then(cpu_seconds), cpu_seconds(std::process::id() as i32));
    for _ in 0..cfg.reloads {
        let t = Instant::now();
        let restored = r.load(&claim, manifest.clone())?;
        if cfg.copy_out {
            let b = r.buffer().ok_or_else(|| ClientError::Data("the reader loaded into no buffer".into()))?;
            copy_out(b, &manifest, &mut dest, cfg.verify != pdstor_client::Verify::None)?;
        }
        last = Some(restored);
        reload_seconds.push(t.elapsed().as_secs_f64());
    }
    let after = (daemon.and_then(cpu_seconds), cpu_seconds(std::process::id() as i32));
    if let Some(restored) = last {
        r.client.ack(&claim, &restored.restore_digest)?;
    }
    let gib = cfg.bytes as f64 * f64::from(cfg.reloads) / f64::from(1u32 << 30);
    let cpu = match (before, after) {
        ((Some(d0), Some(r0)), (Some(d1), Some(r1))) if gib > 0.0 => Some(ReloadCpu {
            daemon_s_per_gib: (d1 - d0) / gib,
            reader_s_per_gib: (r1 - r0) / gib,
            total_s_per_gib: (d1 - d0 + r1 - r0) / gib,
        }),
        _ => None,
    };
    Ok((reload_seconds, cpu))
}

/// Copies every chunk of `manifest` out of `b` (laid one after another)
/// into `dest`: with `check`, each checked against the manifest in the
/// copy; without, a plain copy.
fn copy_out(
    b: &pdstor_engine::buffer::Buffer,
    manifest: &Manifest,
    dest: &mut [u8],
    check: bool,
) -> Result<(), ClientError> {
    let mut at = 0usize;
    for c in &manifest.chunks {
        let len = c.len as usize;
        let dst = dest.get_mut(at..at + len).ok_or_else(|| ClientError::Data("copy-out: past its memory".into()))?;
        let e =
            |e: pdstor_engine::buffer::BufferError| ClientError::Data(format!("copy-out of chunk {}: {e}", c.index));
        if check {
            let crc =
                b.copy_out_checked(at as u64, len, &mut [pdstor_engine::buffer::Piece { at: 0, dst }]).map_err(e)?;
            if crc != c.crc32c {
                return Err(ClientError::Verify {
                    chunk: c.index,
                    what: format!("copied out with crc32c {crc:#010x}, the manifest says {:#010x}", c.crc32c),
                });
            }
        } else {
            b.read_at(at as u64, dst).map_err(e)?;
        }
        at += len;
    }
    Ok(())
}

/// Control-plane latency: `cfg.latency_samples` small handoffs, each step
/// timed on its own.
fn step_latencies(
    cfg: &HandoffBenchConfig,
    run_id: u64,
) -> Result<BTreeMap<&'static str, Histogram<u64>>, ClientError> {
    let steps = ["prepare", "store (data plane)", "publish", "claim", "adopt", "load (data plane)", "ack"];
    let mut hist: BTreeMap<&'static str, Histogram<u64>> = BTreeMap::new();
    for k in steps {
        hist.insert(k, Histogram::new(3).map_err(|e| ClientError::Data(e.to_string()))?);
    }
    let client = pdstor_client::Client::new(&cfg.server);
    let mut data = pdstor_client::DataConn::connect(&cfg.data_socket)?;
    let small =
        pdstor_engine::buffer::Buffer::memfd("bench-small", 4096).map_err(|e| ClientError::Data(e.to_string()))?;
    let b = data.register(&small)?;
    let chunk = pdstor_client::wire::DataChunk { index: 0, buffer: b, offset: 0, len: 4096, crc32c: None };
    for i in 0..cfg.latency_samples {
        let req = format!("lat-{run_id}-{i}");
        let mut times = Vec::with_capacity(steps.len());
        let mut t = Instant::now();
        let mut lap = |times: &mut Vec<u64>| {
            times.push(t.elapsed().as_micros() as u64);
            t = Instant::now();
        };
        let p = client.prepare(&req, &layout(), 1, "w")?;
        lap(&mut times);
        data.store(p.publication, &p.writer_token, vec![chunk], true, 1)?;
        lap(&mut times);
        let published = client.publish(p.publication, &p.writer_token, None)?;
        lap(&mut times);
        let claim = client.claim(&published.receipt, "lat", &req, 60_000)?;
        lap(&mut times);
        let adopt = pdstor_client::wire::AdoptRequest::of_claim(&claim, layout());
        let manifest = client.adopt(&adopt)?;
        lap(&mut times);
        let loaded = data.load(&claim, vec![chunk])?;
        lap(&mut times);
        let nonce = manifest.restore_nonce.unwrap_or_default();
        client.ack(&claim, &pdstor_client::receipt::restore_digest(&nonce, &loaded.crc32c))?;
        lap(&mut times);
        for (k, us) in steps.iter().zip(times) {
            if let Some(h) = hist.get_mut(k) {
                let _ = h.record(us);
            }
        }
    }
    Ok(hist)
}

/// Runs the handoff bench against a running daemon.
pub fn run(cfg: &HandoffBenchConfig) -> Result<HandoffBenchReport, ClientError> {
    let chunks = cfg.bytes.div_ceil(cfg.chunk) as u32;
    let mut w = Writer::new(&cfg.server, &cfg.data_socket, cfg.chunk, chunks)?;
    let payload: Vec<u8> = (0..chunks as u64)
        .flat_map(|i| pdstor_engine::payload::chunk(7, i, cfg.chunk as usize))
        .take(cfg.bytes as usize)
        .collect();
    w.buffer().write_at(0, &payload).map_err(|e| ClientError::Data(e.to_string()))?;
    let mut r = Reader::new(&cfg.server, &cfg.data_socket)?;
    r.set_verify(cfg.verify);
    let run_id = pdstor_daemon::protocol::now_unix_ms();
    // Warm-up: first-touch of the reader's buffer pages is not the protocol's cost.
    handoff(&mut w, &mut r, &format!("bench-{run_id}-warm"), cfg.bytes, cfg.chunk)?;
    let mut round_steps_us: Vec<BTreeMap<String, u64>> = Vec::new();
    let mut seconds = Vec::new();
    for i in 0..cfg.rounds {
        let t = Instant::now();
        let steps = handoff(&mut w, &mut r, &format!("bench-{run_id}-{i}"), cfg.bytes, cfg.chunk)?;
        seconds.push(t.elapsed().as_secs_f64());
        round_steps_us.push(steps.into_iter().map(|(k, v)| (k.to_owned(), v)).collect());
    }
    let (reload_seconds, reload_cpu) =
        if cfg.reloads > 0 { reloads(cfg, &mut w, &mut r, run_id)? } else { (Vec::new(), None) };
    let hist = step_latencies(cfg, run_id)?;
    let median = median_of(&seconds);
    let reload_median_seconds = (!reload_seconds.is_empty()).then(|| median_of(&reload_seconds));
    Ok(HandoffBenchReport {
        reload_copy_out: cfg.copy_out,
        reload_cpu,
        reload_seconds,
        reload_median_seconds,
        bytes: cfg.bytes,
        chunk: cfg.chunk,
        rounds: cfg.rounds,
        seconds,
        median_seconds: median,
        mib_per_s: cfg.bytes as f64 / 1048576.0 / median,
        steps: hist
            .into_iter()
            .map(|(k, h)| {
                (
                    k.to_owned(),
                    StepLatency { p50_us: h.value_at_quantile(0.5) as f64, p99_us: h.value_at_quantile(0.99) as f64 },
                )
            })
            .collect(),
        round_steps_us,
    })
}
