//! The verbs that run a harness (`pdstor_proof::harness`) and print what it
//! measured or proved: bench, bench-store, bench-handoff, handoff,
//! roundtrip, ladder, qualify.

use std::path::PathBuf;

use pdstor_daemon::units::parse_size;
use pdstor_engine::io::PayloadPath;
use pdstor_proof::harness::bench::store::StoreBenchConfig;
use pdstor_proof::harness::bench::{self, BenchConfig, Pattern};
use pdstor_proof::harness::roundtrip::{self, RoundtripConfig};
use pdstor_proof::harness::{ladder, qualify};

use super::common::{BufferArgs, Daemon, PATHS, one_of, print_report, read_json, refuse_signature};
use super::process_handoff;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// A file, block device or /dev/ngXnY (overwritten).
    #[arg(long)]
    target: PathBuf,
    /// host or host_fixed.
    #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(&["host", "host_fixed"]))]
    path: PayloadPath,
    /// fio's --rw name.
    #[arg(long, default_value = "read", value_parser = one_of::<Pattern>(&["write", "read", "randwrite", "randread"]))]
    pattern: Pattern,
    /// Block size; k, M, G suffixes.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    bs: u64,
    /// Requests in flight.
    #[arg(long, default_value_t = 16)]
    qd: u32,
    /// Bytes of the target to cover.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Seed of the payload and of random offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Write even over a target that holds a filesystem or namespace.
    #[arg(long)]
    force: bool,
    /// Run with the eBPF provenance probes attached to this process (overhead measurement).
    #[arg(long)]
    provenance: bool,
}

impl BenchArgs {
    pub fn run(self) -> anyhow::Result<()> {
        refuse_signature(&self.target, self.force)?;
        let _probes = if self.provenance { Some(pdstor_probes::Probes::attach(std::process::id())?) } else { None };
        let r = bench::run(&BenchConfig {
            target: self.target,
            path: self.path,
            pattern: self.pattern,
            block_size: self.bs,
            queue_depth: self.qd,
            size: self.size,
            seed: self.seed,
        })?;
        print_report(self.json, &r, |r| {
            println!(
                "{:?} {} bs={} qd={} on {}: {:.1} MiB/s, {:.0} IOPS, lat us p50 {:.1} p99 {:.1} p99.9 {:.1} max {:.1}",
                r.pattern,
                r.path,
                r.bs,
                r.qd,
                r.target.display(),
                r.mib_per_s,
                r.iops,
                r.lat_us.p50,
                r.lat_us.p99,
                r.lat_us.p999,
                r.lat_us.max
            );
        })
    }
}

#[derive(clap::Args)]
pub struct BenchStoreArgs {
    /// A file to create (and remove) for the run.
    #[arg(long)]
    target: PathBuf,
    /// Concurrent writer threads.
    #[arg(long, default_value_t = 8)]
    writers: u32,
    /// Publications in all.
    #[arg(long, default_value_t = 2000)]
    publications: u32,
    /// Bytes of each publication's one chunk.
    #[arg(long, default_value = "256k", value_parser = parse_size)]
    chunk: u64,
    /// Each thread claims, adopts, loads and acks every publication it made (a whole handoff,
    /// the readers' ownership records group-committed too) instead of releasing it.
    #[arg(long)]
    handoffs: bool,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

impl BenchStoreArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let cfg = StoreBenchConfig {
            target: self.target,
            writers: self.writers,
            publications: self.publications,
            chunk: self.chunk,
            handoffs: self.handoffs,
        };
        let r = bench::store::run(&cfg)?;
        print_report(self.json, &r, |r| {
            println!(
                "{} writers, {} publications of {} B, then {}: {:.0} publications/s, {:.0} journal records/s, {:.3} flushes and {:.3} commit groups per publication",
                r.writers,
                r.publications,
                r.chunk,
                r.after_publish,
                r.publications_per_s,
                r.journal_records_per_s,
                r.flushes_per_publication,
                r.commit_groups_per_publication
            );
        })
    }
}

#[derive(clap::Args)]
pub struct BenchHandoffArgs {
    #[command(flatten)]
    daemon: Daemon,
    /// Bytes per handoff; k, M, G suffixes.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    bytes: u64,
    /// Bytes per chunk.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    chunk: u64,
    /// Handoffs to time (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Single-chunk handoffs timed per step for the latency percentiles.
    #[arg(long, default_value_t = 300)]
    latency_samples: u32,
    /// After the rounds, load one adopted handoff this many times more, each
    /// timed (the load path alone, e.g. under `perf record`).
    #[arg(long, default_value_t = 0)]
    reloads: u32,
    /// Who checksums the reader's loads: `daemon` (in place in the reader's
    /// buffer; the reader checks the answer against its manifest) or `local`
    /// (the reader checksums every chunk again).
    #[arg(long, default_value = "daemon")]
    verify: pdstor_client::Verify,
    /// Benchmark only: nothing checked by anyone (the reader's buffer registered unchecked, the
    /// manifest's crc32c taken for what was read), to measure what verification costs.
    #[arg(long, conflicts_with = "verify")]
    no_verify: bool,
    /// Each reload then copies every chunk out of the reader's buffer into
    /// this process's own memory, as LMCache's staging and the vLLM
    /// connector on a CPU do: loaded unchecked by the daemon and checked in
    /// that copy (with --no-verify, a plain copy).
    #[arg(long)]
    copy_out: bool,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

impl BenchHandoffArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let cfg = bench::handoff::HandoffBenchConfig {
            server: self.daemon.server,
            data_socket: self.daemon.data_socket,
            bytes: self.bytes,
            chunk: self.chunk,
            rounds: self.rounds,
            latency_samples: self.latency_samples,
            reloads: self.reloads,
            copy_out: self.copy_out,
            verify: if self.no_verify { pdstor_client::Verify::None } else { self.verify },
        };
        let r = bench::handoff::run(&cfg)?;
        print_report(self.json, &r, |r| {
            println!(
                "handoff of {} bytes: median {:.3} s ({:.0} MiB/s) over {} rounds",
                r.bytes, r.median_seconds, r.mib_per_s, r.rounds
            );
            for (k, v) in &r.steps {
                println!("  {k:<22} p50 {:>8.0} us  p99 {:>8.0} us", v.p50_us, v.p99_us);
            }
            if let Some(m) = r.reload_median_seconds {
                println!("  reload (load + verify) median {:.1} ms over {}", m * 1e3, r.reload_seconds.len());
            }
            if let Some(c) = &r.reload_cpu {
                println!(
                    "  reload CPU per GiB: daemon {:.3} s, reader {:.3} s, both {:.3} s",
                    c.daemon_s_per_gib, c.reader_s_per_gib, c.total_s_per_gib
                );
            }
        })
    }
}

#[derive(clap::Args)]
pub struct HandoffArgs {
    #[command(flatten)]
    daemon: Daemon,
    /// Bytes to hand off (a multiple of 4096); k, M, G suffixes.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    bytes: u64,
    /// Bytes per chunk.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    chunk_size: u64,
    #[command(flatten)]
    buffer: BufferArgs,
    /// The writer's and the reader's steps appended to this JSON-lines timeline.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Also write the handoff's figures (bytes, chunks, times, verification) to this JSON file.
    #[arg(long)]
    summary: Option<PathBuf>,
}

impl HandoffArgs {
    pub fn run(self) -> anyhow::Result<()> {
        process_handoff::run(&process_handoff::HandoffArgs {
            server: self.daemon.server,
            data_socket: self.daemon.data_socket,
            bytes: self.bytes,
            chunk_size: self.chunk_size,
            buffer: self.buffer.spec(),
            timeline: self.timeline,
            summary: self.summary,
        })
    }
}

#[derive(clap::Args)]
pub struct RoundtripArgs {
    /// A file, block device or /dev/ngXnY (overwritten).
    #[arg(long)]
    target: PathBuf,
    /// host or host_fixed.
    #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(&["host", "host_fixed"]))]
    path: PayloadPath,
    /// Chunks to write and read.
    #[arg(long, default_value_t = 64)]
    chunks: u32,
    /// Bytes per chunk.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    chunk_size: u64,
    /// Requests in flight.
    #[arg(long, default_value_t = 16)]
    qd: u32,
    /// Seed of the payload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Write even over a target that holds a filesystem or namespace.
    #[arg(long)]
    force: bool,
}

impl RoundtripArgs {
    pub fn run(self) -> anyhow::Result<()> {
        refuse_signature(&self.target, self.force)?;
        let r = roundtrip::run(&RoundtripConfig {
            target: self.target,
            path: self.path,
            chunks: self.chunks,
            chunk_size: self.chunk_size,
            queue_depth: self.qd,
            seed: self.seed,
        })?;
        print_report(self.json, &r, |r| {
            println!(
                "round trip on {} ({:?}) via {}: {} chunks x {} B = {:.1} MiB",
                r.target.display(),
                r.target_kind,
                r.path,
                r.chunks,
                r.chunk_size,
                r.bytes as f64 / 1048576.0
            );
            println!(
                "  write  {:>8.1} MiB/s  ({:.3} s, flush {:.3} s)",
                r.write_mib_per_s, r.write_seconds, r.flush_seconds
            );
            println!("  read   {:>8.1} MiB/s  ({:.3} s)", r.read_mib_per_s, r.read_seconds);
            println!(
                "  verified byte for byte: through the engine {}, independently (O_DIRECT pread) {}",
                if r.verified_by_engine { "yes" } else { "no" },
                if r.verified_independently { "yes" } else { "n/a for passthrough" }
            );
        })
    }
}

#[derive(clap::Args)]
pub struct LadderArgs {
    /// Scratch target (it is overwritten): a block device (/dev/nvmeXnY) or a file.
    #[arg(long)]
    target: PathBuf,
    /// Whose memory: udmabuf (CPU hosts) or cuda (GPU 0; needs --features cuda).
    #[arg(long, default_value = "udmabuf", value_parser = one_of::<ladder::LadderExporter>(&["udmabuf", "cuda"]))]
    exporter: ladder::LadderExporter,
    /// Paths to qualify, in ladder order, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "host,host_fixed,dmabuf_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
    paths: Vec<PayloadPath>,
    /// Bytes per path.
    #[arg(long, default_value = "32M", value_parser = parse_size)]
    bytes: u64,
    /// Bytes per chunk.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    chunk: u64,
    /// Where ladder.json and ladder.md go.
    #[arg(long, default_value = "pdstor-ladder")]
    out: PathBuf,
    /// Overwrite a target that holds a filesystem or a pdstor namespace.
    #[arg(long)]
    force: bool,
}

impl LadderArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let cfg = ladder::LadderConfig {
            target: self.target,
            exporter: self.exporter,
            paths: self.paths,
            bytes: self.bytes,
            chunk: self.chunk,
            out: self.out,
            force: self.force,
        };
        let report = ladder::run(&cfg)?;
        print!("{}", report.markdown());
        println!("\nreport: {}/ladder.json, {}/ladder.md", cfg.out.display(), cfg.out.display());
        if !report.qualified() {
            let not: Vec<String> = report.rungs.iter().filter(|r| !r.qualified).map(|r| r.path.to_string()).collect();
            anyhow::bail!("not qualified: {}", not.join(", "));
        }
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct QualifyArgs {
    /// Scratch target, formatted by qualify (a file is created if missing).
    #[arg(long)]
    target: PathBuf,
    /// Size of a file target to create.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    size: u64,
    /// Where the reports and the timeline go.
    #[arg(long, default_value = "pdstor-qualify")]
    out: PathBuf,
    /// Tokens per stored KV chunk.
    #[arg(long, default_value_t = 16)]
    chunk_tokens: usize,
    /// Requests per batch, one case per batch size and prompt group (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    batches: Vec<usize>,
    /// The short profile (CI): batches of 1 and output budgets halved.
    #[arg(long)]
    short: bool,
    /// The payload path the buffers are registered for (and the timeline must show).
    #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
    path: PayloadPath,
    /// Run the daemon without the provenance probes (the timeline check then fails).
    #[arg(long)]
    no_provenance: bool,
    /// Device to corrupt a chunk through, for a /dev/ngXnY target (its /dev/nvmeXnY).
    #[arg(long)]
    corrupt_via: Option<PathBuf>,
    /// Seed of the model's weights.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

impl QualifyArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let out = self.out.clone();
        let cfg = qualify::QualifyConfig {
            target: self.target,
            size: self.size,
            out: self.out,
            chunk_tokens: self.chunk_tokens,
            batches: if self.short { vec![1] } else { self.batches },
            budget_scale: if self.short { 0.5 } else { 1.0 },
            path: self.path,
            provenance: !self.no_provenance,
            corrupt_via: self.corrupt_via,
            model: pdstor_proof::model::Config { seed: self.seed, ..Default::default() },
        };
        let report = qualify::run(&cfg)?;
        print!("{}", report.markdown());
        for v in &report.timeline.violations {
            println!("timeline: {v}");
        }
        println!("\nreport: {}/qualify.json, qualify.md, timeline.jsonl, timeline.svg", out.display());
        if !report.ok {
            anyhow::bail!("qualification failed (see {}/qualify.md)", out.display());
        }
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct QualifyReaderArgs {
    /// The job file qualify wrote.
    #[arg(long)]
    job: PathBuf,
}

impl QualifyReaderArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let job: qualify::ReaderJob = read_json(&self.job, "reader job")?;
        let outcomes = qualify::reader_main(&job)?;
        println!("{}", serde_json::to_string(&outcomes)?);
        Ok(())
    }
}
