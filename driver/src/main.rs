//! The `pdstor` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use pdstor::PayloadPath;
use pdstor::client::ClientError;
use pdstor::protocol::Receipt;
use pdstor::store::Layout;

mod handoff;
use pdstor::bench::store::{self as store_bench, StoreBenchConfig};
use pdstor::bench::{self, BenchConfig, Pattern};
use pdstor::io::{Engine, EngineOptions, Target, TargetOptions};
use pdstor::roundtrip::{self, RoundtripConfig};
use pdstor::store::{self, FormatOptions};
use pdstor::units::parse_size;

#[derive(Parser)]
#[command(name = "pdstor", version, about = "Hands LLM KV cache from prefill to decode through NVMe, and proves it")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The payload paths, as `--path` takes them.
const PATHS: &[&str] = &["host", "host_fixed", "dmabuf_fixed"];
/// Publication states, as `--state` takes them.
const STATES: &[&str] = &["PREPARED", "READY", "CLAIMED", "ADOPTED", "RETAINED", "ABORTING"];

/// A parser that accepts exactly `values` (listed in `--help` and in the
/// error for anything else) and turns the one given into a `T`.
fn one_of<T>(values: &'static [&'static str]) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(values).try_map(|s| s.parse::<T>())
}

/// The control plane, for verbs that only talk to it.
#[derive(clap::Args, Clone)]
struct Server {
    /// Control plane URL of the daemon (`pdstor serve --listen`).
    #[arg(long, env = "PDSTOR_SERVER", default_value = "http://127.0.0.1:7077")]
    server: String,
}

/// Both planes, for verbs that move payload.
#[derive(clap::Args, Clone)]
struct Daemon {
    /// Control plane URL of the daemon (`pdstor serve --listen`).
    #[arg(long, env = "PDSTOR_SERVER", default_value = "http://127.0.0.1:7077")]
    server: String,
    /// The daemon's data-plane Unix socket (`pdstor serve --data-socket`): buffers are shared over it.
    #[arg(long, env = "PDSTOR_DATA_SOCKET", default_value = "/tmp/pdstor-data.sock")]
    data_socket: PathBuf,
}

/// A client's buffer: whose memory, and the path the daemon moves it on.
#[derive(clap::Args, Clone, Copy)]
struct BufferArgs {
    /// Buffer memory: memfd, udmabuf (a DMA-BUF from /dev/udmabuf) or dma-heap (/dev/dma_heap/system).
    #[arg(long = "buffer", default_value = "memfd", value_parser = one_of::<pdstor::client::Exporter>(&["memfd", "udmabuf", "dma-heap"]))]
    exporter: pdstor::client::Exporter,
    /// Payload path: dmabuf_fixed needs a DMA-BUF buffer, a raw block device target and a kernel
    /// with the rw-dmabuf series.
    #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
    path: PayloadPath,
}

impl BufferArgs {
    fn spec(self) -> pdstor::client::BufferSpec {
        pdstor::client::BufferSpec { exporter: self.exporter, path: self.path }
    }
}

/// What one client may hold or take (see `pdstor::api::Limits`).
#[derive(clap::Args, Clone, Copy)]
struct LimitArgs {
    /// Largest control-plane request body; a larger one is 413.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    max_body: u64,
    /// Longest wait for a request body once its headers arrived, in ms (then 408).
    #[arg(long, default_value_t = 10_000)]
    body_timeout_ms: u64,
    /// Longest wait for a request's headers, and for the next request on an idle connection, in ms.
    #[arg(long, default_value_t = 10_000)]
    header_timeout_ms: u64,
    /// Control-plane connections open at once; the next is answered 503 and closed.
    #[arg(long, default_value_t = 512)]
    max_http_connections: usize,
    /// Prepares handled or waiting for capacity at once; the next is 503 too_many_prepares.
    #[arg(long, default_value_t = 64)]
    max_prepares: usize,
    /// Data-plane connections open at once; the next is answered 503 and closed.
    #[arg(long, default_value_t = 256)]
    max_data_connections: usize,
    /// Buffers one data-plane connection may register.
    #[arg(long, default_value_t = 16)]
    max_buffers_per_connection: usize,
    /// Buffer bytes one data-plane connection may have the daemon map.
    #[arg(long, default_value = "16G", value_parser = parse_size)]
    max_pinned_per_connection: u64,
    /// A PREPARED publication that sees no store batch for this long (ms) is aborted.
    #[arg(long, default_value_t = 120_000)]
    prepare_idle_timeout_ms: u64,
}

impl LimitArgs {
    fn limits(self) -> pdstor::api::Limits {
        use std::time::Duration;
        pdstor::api::Limits {
            max_body_bytes: self.max_body as usize,
            body_timeout: Duration::from_millis(self.body_timeout_ms),
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            max_http_connections: self.max_http_connections,
            max_prepares: self.max_prepares,
            max_data_connections: self.max_data_connections,
            max_buffers_per_connection: self.max_buffers_per_connection,
            max_pinned_bytes_per_connection: self.max_pinned_per_connection,
            prepare_idle_timeout: Duration::from_millis(self.prepare_idle_timeout_ms),
        }
    }
}

#[derive(Subcommand)]
enum TimelineCmd {
    /// Verify causality, one ack, receipts across nodes, provenance on the required path with
    /// native verdicts, and continuation records. Reports every violation with its line.
    Check {
        /// The JSON-lines timeline (`serve --timeline`, `put/get --timeline`, `qualify`).
        file: PathBuf,
        /// The payload path every store and load must have taken.
        #[arg(long, default_value = "dmabuf_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
        require_path: PayloadPath,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Draw the timeline: a lane per node, transfers as bars by path and verdict, steps as markers.
    Render {
        /// The JSON-lines timeline to draw.
        file: PathBuf,
        /// The SVG file to write.
        #[arg(short, long, default_value = "timeline.svg")]
        output: PathBuf,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: the store behind the HTTP control plane and the data plane.
    Serve {
        /// The formatted target to serve (`pdstor format`): a file, block device or /dev/ngXnY.
        #[arg(long)]
        target: PathBuf,
        /// Control plane address (loopback by default).
        #[arg(long, default_value = "127.0.0.1:7077", conflicts_with = "listen_unix")]
        listen: std::net::SocketAddr,
        /// Serve the control plane on this Unix socket instead of TCP.
        #[arg(long)]
        listen_unix: Option<PathBuf>,
        /// The data-plane Unix socket clients share their buffers over (created 0600).
        #[arg(long, env = "PDSTOR_DATA_SOCKET", default_value = "/tmp/pdstor-data.sock")]
        data_socket: PathBuf,
        /// io_uring queue depth of the store's I/O thread.
        #[arg(long, default_value_t = 32)]
        qd: u32,
        /// Longest a prepare waits for capacity, in ms; then it is refused with 503.
        #[arg(long, default_value_t = 30_000)]
        admission_timeout_ms: u64,
        /// Attach the eBPF provenance probes and stamp every payload transfer with a verdict (root).
        #[arg(long)]
        provenance: bool,
        /// With --provenance: a fallback verdict on a host_fixed transfer fails it.
        #[arg(long, requires = "provenance")]
        require_native: bool,
        /// Append every protocol step, chunk transfer and refusal to this JSON-lines timeline.
        #[arg(long)]
        timeline: Option<PathBuf>,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// prepare + store a file's bytes through a shared buffer + publish; prints the READY receipt.
    Put {
        #[command(flatten)]
        daemon: Daemon,
        /// The request id this KV cache belongs to (the serving engine's request).
        #[arg(long)]
        req: String,
        /// The writer's identity, recorded with the publication (e.g. the prefill engine's name).
        #[arg(long, env = "PDSTOR_WRITER", default_value = "writer")]
        writer: String,
        /// JSON layout (model_id, dtype, layers, kv_heads, head_dim, chunk_tokens, kv_format).
        #[arg(long)]
        layout: PathBuf,
        /// The KV bytes to store: a file whose size is a non-zero multiple of 4096.
        #[arg(long)]
        from: PathBuf,
        /// Bytes per chunk (at most the namespace's slot size); k, M, G suffixes.
        #[arg(long, default_value = "8M", value_parser = parse_size)]
        chunk_size: u64,
        /// Chunks per store batch.
        #[arg(long, default_value_t = 4)]
        batch: u32,
        /// The first token the reader continues from, recorded in the manifest.
        #[arg(long)]
        first_token: Option<u32>,
        #[command(flatten)]
        buffer: BufferArgs,
        /// Append this node's steps to a JSON-lines timeline (see `pdstor timeline`).
        #[arg(long)]
        timeline: Option<PathBuf>,
    },
    /// Claim a READY publication for one reader and session; prints the claim receipt.
    Claim {
        #[command(flatten)]
        daemon: Server,
        /// The READY receipt `pdstor put` printed (a JSON file).
        #[arg(long)]
        receipt: PathBuf,
        /// The reader's identity (e.g. the decode engine's name); only it may adopt.
        #[arg(long)]
        reader: String,
        /// The reader's session; closing it (`close-session`) fences the claim.
        #[arg(long)]
        session: String,
        /// How long the claim is leased, in ms (expiry never frees claimed bytes).
        #[arg(long, default_value_t = 60_000)]
        lease_ms: u64,
    },
    /// adopt + load + verify; writes the bytes, prints the restore digest (and acks with --ack).
    Get {
        #[command(flatten)]
        daemon: Daemon,
        /// The claim receipt `pdstor claim` printed (a JSON file).
        #[arg(long)]
        claim: PathBuf,
        /// The JSON layout the reader expects; adopt refuses a publication with another.
        #[arg(long)]
        layout: PathBuf,
        /// Where to write the restored bytes.
        #[arg(long)]
        out: PathBuf,
        /// Acknowledge right after a verified restore (no digest to copy by hand).
        #[arg(long)]
        ack: bool,
        #[command(flatten)]
        buffer: BufferArgs,
        /// Append this node's steps to a JSON-lines timeline (see `pdstor timeline`).
        #[arg(long)]
        timeline: Option<PathBuf>,
    },
    /// Acknowledge a restore: frees the slots.
    Ack {
        #[command(flatten)]
        daemon: Server,
        /// The claim receipt (a JSON file).
        #[arg(long)]
        claim: PathBuf,
        /// The restore digest `pdstor get` printed (hex SHA-256 of the restored chunks' crc32c).
        #[arg(long)]
        restore_digest: String,
    },
    /// Release a READY, never-claimed publication.
    Release {
        #[command(flatten)]
        daemon: Server,
        /// The READY receipt (a JSON file).
        #[arg(long)]
        receipt: PathBuf,
    },
    /// Abort a publication that is not READY yet (an unknown one is refused).
    Abort {
        #[command(flatten)]
        daemon: Server,
        /// The publication id (`pdstor publications`).
        #[arg(long)]
        publication: u64,
    },
    /// Report a failed or uncertain read: the publication is RETAINED.
    Fail {
        #[command(flatten)]
        daemon: Server,
        /// The claim receipt (a JSON file).
        #[arg(long)]
        claim: PathBuf,
        /// Why the read failed, recorded in the journal.
        #[arg(long)]
        reason: String,
    },
    /// Free a claimed or retained publication whose reader is fenced.
    Reclaim {
        #[command(flatten)]
        daemon: Server,
        /// The claim receipt (a JSON file).
        #[arg(long)]
        claim: PathBuf,
    },
    /// Fence a reader session (its claims become reclaimable).
    CloseSession {
        #[command(flatten)]
        daemon: Server,
        /// The session id given to `pdstor claim --session`.
        #[arg(long)]
        session: String,
    },
    /// The daemon's metrics (Prometheus text).
    Status {
        #[command(flatten)]
        daemon: Server,
    },
    /// Live publications, optionally of one state; --verbose adds each chunk's extent on the target.
    Publications {
        #[command(flatten)]
        daemon: Server,
        /// Only publications in this state.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(STATES), ignore_case = true)]
        state: Option<String>,
        /// List each chunk's slot, byte offset, length and crc32c on the target.
        #[arg(long, short)]
        verbose: bool,
    },
    /// The handoff against a running daemon, buffers registered once: wall time and per-step latency.
    BenchHandoff {
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
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// A writer process and a reader process hand N bytes through the daemon, verified.
    Handoff {
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
    },
    /// eBPF provenance probes: attach, status, dump, detach.
    Probe {
        #[command(subcommand)]
        command: ProbeCmd,
    },
    /// The payload ladder on a scratch target: host → host_fixed → dmabuf_fixed from a
    /// DMA-BUF exporter's memory, each byte read back independently, each transfer judged by
    /// the probes; writes ladder.json and ladder.md. Exits 1 if a requested path is not qualified.
    Ladder {
        /// Scratch target (it is overwritten): a block device (/dev/nvmeXnY) or a file.
        #[arg(long)]
        target: PathBuf,
        /// Whose memory: udmabuf (CPU hosts) or cuda (GPU 0; needs --features cuda).
        #[arg(long, default_value = "udmabuf", value_parser = one_of::<pdstor::ladder::LadderExporter>(&["udmabuf", "cuda"]))]
        exporter: pdstor::ladder::LadderExporter,
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
    },
    /// The model-oracle profile: a deterministic model's KV cache handed through `pdstor serve` to
    /// a reader process, continuations compared with a no-cache oracle, fault controls, a checked
    /// timeline. Writes qualify.json, qualify.md, timeline.jsonl, timeline.svg; exits 1 on any failure.
    Qualify {
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
    },
    /// The reader process of `pdstor qualify` (internal).
    #[command(hide = true)]
    QualifyReader {
        /// The job file qualify wrote.
        #[arg(long)]
        job: PathBuf,
    },
    /// Causal timelines: check one (exit 1 on any violation), or render it as SVG.
    Timeline {
        #[command(subcommand)]
        command: TimelineCmd,
    },
    /// Print a target's kind and geometry as JSON.
    Info {
        /// A file, block device or /dev/ngXnY.
        #[arg(long)]
        target: PathBuf,
    },
    /// Write a fresh pdstor namespace (superblocks, empty journal) on a target.
    Format {
        /// A file (created with --size if missing), block device or /dev/ngXnY.
        #[arg(long)]
        target: PathBuf,
        /// Bytes per slot: the largest chunk.
        #[arg(long, default_value = "8M", value_parser = parse_size)]
        chunk_slot: u64,
        /// Bytes of each of the two journal halves (power of two, 256k to 1G).
        #[arg(long, default_value = "16M", value_parser = parse_size)]
        journal: u64,
        /// For a file target that does not exist yet: create it this large.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Overwrite a target that holds a filesystem or another namespace.
        #[arg(long)]
        force: bool,
    },
    /// Open a namespace, replay its journal, and print what recovery found and the publications.
    Inspect {
        /// A formatted target not served by a running daemon.
        #[arg(long)]
        target: PathBuf,
    },
    /// Publications per second through prepare + store + publish, and flushes per publication.
    BenchStore {
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
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Measure the engine on a target with fio's pattern names.
    Bench {
        /// A file, block device or /dev/ngXnY (overwritten).
        #[arg(long)]
        target: PathBuf,
        /// host or host_fixed.
        #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(&["host", "host_fixed"]))]
        path: PayloadPath,
        /// fio's --rw name.
        #[arg(long, value_enum, default_value = "read")]
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
    },
    /// Write seeded chunks, flush, read them back and verify byte for byte.
    Roundtrip {
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
    },
}

#[derive(Subcommand)]
enum ProbeCmd {
    /// Load and attach the probes for a process (default: this one); with
    /// --pin they stay attached under /sys/fs/bpf/pdstor after this exits.
    /// Mounts tracefs (and bpffs for --pin) when absent; needs root.
    Attach {
        /// The process to trace (default: this one).
        #[arg(long)]
        tgid: Option<u32>,
        /// Pin maps and links under /sys/fs/bpf/pdstor so they outlive this command.
        #[arg(long)]
        pin: bool,
    },
    /// Which programs attach on this kernel, and which signals are unverifiable here and why.
    Status,
    /// The per-transfer signals of the pinned probe set, as JSON.
    Dump,
    /// Remove the pinned probe set.
    Detach,
}

fn probe(cmd: ProbeCmd) -> anyhow::Result<()> {
    let pin_dir = std::path::Path::new(pdstor_probes::PIN_DIR);
    match cmd {
        ProbeCmd::Attach { tgid, pin } => {
            let mut p = pdstor_probes::Probes::attach(tgid.unwrap_or_else(std::process::id))?;
            if pin {
                p.pin(pin_dir)?;
            }
            println!(
                "{}",
                serde_json::to_string_pretty(
                    &serde_json::json!({"pinned": pin.then_some(pin_dir), "programs": p.status()})
                )?
            );
        }
        ProbeCmd::Status => {
            let p = pdstor_probes::Probes::attach(std::process::id())?;
            let pinned = pin_dir.join("signals").exists();
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({"programs": p.status(), "pinned_set": pinned}))?
            );
        }
        ProbeCmd::Dump => {
            let all = pdstor_probes::read_pinned(pin_dir)?;
            let rows: Vec<_> = all.iter().map(|(t, s)| serde_json::json!({"transfer": t, "signals": s})).collect();
            println!("{}", serde_json::to_string_pretty(&rows)?);
        }
        ProbeCmd::Detach => {
            let n = pdstor_probes::detach_pinned(pin_dir)?;
            println!("removed {n} pins from {}", pin_dir.display());
        }
    }
    Ok(())
}

/// Refuses to let a raw-writing command destroy a filesystem or namespace.
fn refuse_signature(target: &std::path::Path, force: bool) -> anyhow::Result<()> {
    if force || !target.exists() {
        return Ok(());
    }
    if let Some(sig) = store::signature_of(target)? {
        anyhow::bail!(
            "target {} holds {sig}; this command overwrites it: pass --force if that is what you want",
            target.display()
        );
    }
    Ok(())
}

/// Exit status of a command line pdstor cannot parse (`EX_USAGE`): never 2,
/// which means the daemon refused a step.
const EXIT_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; anything else is a usage error.
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<ClientError>() {
            Some(ClientError::Api(body)) => {
                // A 4xx is the daemon refusing a step (nothing changed); a 5xx is it failing one.
                let verb = if (400..500).contains(&body.status) { "refused" } else { "failed" };
                eprintln!("pdstor: {verb}: {} {} ({}): {}", body.status, body.code, body.field, body.message);
                ExitCode::from(pdstor::api::error::exit_code(body))
            }
            Some(other) => {
                eprintln!("pdstor: error: {other}");
                ExitCode::from(pdstor::api::error::EXIT_FAILED)
            }
            None => {
                eprintln!("pdstor: error: {e:#}");
                ExitCode::from(1)
            }
        },
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path, what: &str) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {what} {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{what} {} is not valid: {e}", path.display()))
}

fn client_verbs(command: Command) -> anyhow::Result<()> {
    use pdstor::client::{Client, Reader, Writer};
    match command {
        Command::Put { daemon, req, writer, layout, from, chunk_size, batch, first_token, buffer, timeline } => {
            let layout: Layout = read_json(&layout, "layout")?;
            let payload = std::fs::read(&from).map_err(|e| anyhow::anyhow!("reading {}: {e}", from.display()))?;
            if payload.is_empty() || !payload.len().is_multiple_of(4096) {
                anyhow::bail!(
                    "{} is {} bytes; a KV payload must be a non-empty multiple of 4096 bytes (direct I/O): pad it",
                    from.display(),
                    payload.len()
                );
            }
            let chunks = payload.len().div_ceil(chunk_size as usize) as u32;
            let mut w = Writer::with_buffer(&daemon.server, &daemon.data_socket, chunk_size, chunks, buffer.spec())?
                .with_writer_id(&writer);
            let started = std::time::Instant::now();
            let published = w.put(&req, &layout, &payload, batch, first_token)?;
            eprintln!(
                "pdstor put: {} bytes in {chunks} chunks stored and published in {:.3} s",
                payload.len(),
                started.elapsed().as_secs_f64()
            );
            if let Some(t) = timeline {
                let r = &published.receipt;
                let mut e =
                    pdstor::timeline::Event::new("publish").req(&req).publication(r.publication).receipt(&r.signature);
                e.chunks = Some(chunks);
                pdstor::timeline::Timeline::open(&t, &format!("writer-{}", std::process::id()))?.emit(e);
            }
            println!("{}", serde_json::to_string_pretty(&published.receipt)?);
        }
        Command::Claim { daemon, receipt, reader, session, lease_ms } => {
            let ready: Receipt = read_json(&receipt, "receipt")?;
            let claim = Client::new(&daemon.server).claim(&ready, &reader, &session, lease_ms)?;
            println!("{}", serde_json::to_string_pretty(&claim)?);
        }
        Command::Get { daemon, claim, layout, out, ack, buffer, timeline } => {
            let claim: Receipt = read_json(&claim, "claim receipt")?;
            let layout: Layout = read_json(&layout, "layout")?;
            let mut r = Reader::with_buffer(&daemon.server, &daemon.data_socket, buffer.spec())?;
            let started = std::time::Instant::now();
            let restored = r.get(&claim, &layout)?;
            let restore_seconds = started.elapsed().as_secs_f64();
            let bytes = r.restored_bytes(restored.len)?;
            std::fs::write(&out, &bytes).map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
            let tl = match &timeline {
                Some(t) => Some(pdstor::timeline::Timeline::open(t, &format!("reader-{}", std::process::id()))?),
                None => None,
            };
            let note = |event: &str| {
                if let Some(tl) = &tl {
                    tl.emit(
                        pdstor::timeline::Event::new(event)
                            .req(&claim.req_id)
                            .publication(claim.publication)
                            .receipt(&claim.signature),
                    );
                }
            };
            note("restored");
            if ack {
                r.client.ack(&claim, &restored.restore_digest)?;
                note("ack");
            }
            let summary = serde_json::json!({
                "publication": restored.manifest.publication,
                "chunks": restored.manifest.chunks.len(),
                "bytes": restored.len,
                "first_token": restored.manifest.first_token,
                "restore_digest": restored.restore_digest,
                "acked": ack,
                "restore_seconds": restore_seconds,
            });
            println!("{}", serde_json::to_string_pretty(&summary)?);
        }
        Command::Ack { daemon, claim, restore_digest } => {
            Client::new(&daemon.server).ack(&read_json(&claim, "claim receipt")?, &restore_digest)?;
        }
        Command::Release { daemon, receipt } => {
            Client::new(&daemon.server).release(&read_json(&receipt, "receipt")?)?
        }
        Command::Abort { daemon, publication } => {
            println!("{}", serde_json::to_string(&Client::new(&daemon.server).abort(publication)?)?);
        }
        Command::Fail { daemon, claim, reason } => {
            Client::new(&daemon.server).fail(&read_json(&claim, "claim receipt")?, &reason)?
        }
        Command::Reclaim { daemon, claim } => {
            Client::new(&daemon.server).reclaim(&read_json(&claim, "claim receipt")?)?
        }
        Command::CloseSession { daemon, session } => Client::new(&daemon.server).close_session(&session)?,
        Command::Status { daemon } => print!("{}", Client::new(&daemon.server).metrics()?),
        Command::Publications { daemon, state, verbose } => {
            let list = Client::new(&daemon.server).publications(state.as_deref(), verbose)?;
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
        Command::BenchHandoff { daemon, bytes, chunk, rounds, latency_samples, json } => {
            let cfg = pdstor::bench::handoff::HandoffBenchConfig {
                server: daemon.server,
                data_socket: daemon.data_socket,
                bytes,
                chunk,
                rounds,
                latency_samples,
            };
            let r = pdstor::bench::handoff::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "handoff of {} bytes: median {:.3} s ({:.0} MiB/s) over {} rounds",
                    r.bytes, r.median_seconds, r.mib_per_s, r.rounds
                );
                for (k, v) in &r.steps {
                    println!("  {k:<22} p50 {:>8.0} us  p99 {:>8.0} us", v.p50_us, v.p99_us);
                }
            }
        }
        Command::Handoff { daemon, bytes, chunk_size, buffer, timeline, summary } => {
            handoff::run(&handoff::HandoffArgs {
                server: daemon.server,
                data_socket: daemon.data_socket,
                bytes,
                chunk_size,
                buffer: buffer.spec(),
                timeline,
                summary,
            })?
        }
        _ => unreachable!("client_verbs is only called with client verbs"),
    }
    Ok(())
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Probe { command } => probe(command)?,
        Command::Serve {
            target,
            listen,
            listen_unix,
            data_socket,
            qd,
            admission_timeout_ms,
            provenance,
            require_native,
            timeline,
            limits,
        } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            pdstor::api::serve(pdstor::api::ServeConfig {
                target,
                listen: match listen_unix {
                    Some(p) => pdstor::api::Listen::Unix(p),
                    None => pdstor::api::Listen::Tcp(listen),
                },
                data_socket,
                queue_depth: qd,
                admission_timeout: std::time::Duration::from_millis(admission_timeout_ms),
                provenance,
                require_native,
                timeline,
                fault: None,
                limits: limits.limits(),
            })?;
        }
        c @ (Command::Put { .. }
        | Command::Claim { .. }
        | Command::Get { .. }
        | Command::Ack { .. }
        | Command::Release { .. }
        | Command::Abort { .. }
        | Command::Fail { .. }
        | Command::Reclaim { .. }
        | Command::CloseSession { .. }
        | Command::Status { .. }
        | Command::Publications { .. }
        | Command::Handoff { .. }
        | Command::BenchHandoff { .. }) => client_verbs(c)?,
        Command::Ladder { target, exporter, paths, bytes, chunk, out, force } => {
            let cfg = pdstor::ladder::LadderConfig { target, exporter, paths, bytes, chunk, out, force };
            let report = pdstor::ladder::run(&cfg)?;
            print!("{}", report.markdown());
            println!("\nreport: {}/ladder.json, {}/ladder.md", cfg.out.display(), cfg.out.display());
            if !report.qualified() {
                let not: Vec<String> =
                    report.rungs.iter().filter(|r| !r.qualified).map(|r| r.path.to_string()).collect();
                anyhow::bail!("not qualified: {}", not.join(", "));
            }
        }
        Command::Qualify {
            target,
            size,
            out,
            chunk_tokens,
            batches,
            short,
            path,
            no_provenance,
            corrupt_via,
            seed,
        } => {
            let cfg = pdstor::qualify::QualifyConfig {
                target,
                size,
                out: out.clone(),
                chunk_tokens,
                batches: if short { vec![1] } else { batches },
                budget_scale: if short { 0.5 } else { 1.0 },
                path,
                provenance: !no_provenance,
                corrupt_via,
                model: pdstor::model::Config { seed, ..Default::default() },
            };
            let report = pdstor::qualify::run(&cfg)?;
            print!("{}", report.markdown());
            for v in &report.timeline.violations {
                println!("timeline: {v}");
            }
            println!("\nreport: {}/qualify.json, qualify.md, timeline.jsonl, timeline.svg", out.display());
            if !report.ok {
                anyhow::bail!("qualification failed (see {}/qualify.md)", out.display());
            }
        }
        Command::QualifyReader { job } => {
            let job: pdstor::qualify::ReaderJob = read_json(&job, "reader job")?;
            let outcomes = pdstor::qualify::reader_main(&job)?;
            println!("{}", serde_json::to_string(&outcomes)?);
        }
        Command::Timeline { command: TimelineCmd::Check { file, require_path, json } } => {
            let lines = pdstor::timeline::read(&file)?;
            let report = pdstor::timeline::check::check(&lines, require_path);
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                for v in &report.violations {
                    println!("{}: {v}", file.display());
                }
                println!(
                    "{}: {} lines, {} publications ({} acknowledged), {} payload events, {} continuations: {}",
                    file.display(),
                    report.lines,
                    report.publications,
                    report.acked,
                    report.payload_events,
                    report.continuations,
                    if report.ok() {
                        format!("ok (every payload on {require_path}, native)")
                    } else {
                        format!("{} violations", report.violations.len())
                    }
                );
            }
            if !report.ok() {
                anyhow::bail!(
                    "{} violates the handoff contract ({} violations)",
                    file.display(),
                    report.violations.len()
                );
            }
        }
        Command::Timeline { command: TimelineCmd::Render { file, output } } => {
            let lines = pdstor::timeline::read(&file)?;
            let bad: Vec<usize> = lines.iter().filter(|(_, e)| e.is_err()).map(|(n, _)| *n).collect();
            if !bad.is_empty() {
                anyhow::bail!(
                    "{}: lines {bad:?} are not timeline events (run `pdstor timeline check`)",
                    file.display()
                );
            }
            let events: Vec<_> = lines.into_iter().filter_map(|(_, e)| e.ok()).collect();
            let svg = pdstor::timeline::render::render(&events, &file.display().to_string());
            std::fs::write(&output, svg).map_err(|e| anyhow::anyhow!("writing {}: {e}", output.display()))?;
            println!("{}: {} events drawn", output.display(), events.len());
        }
        Command::Info { target } => {
            let t = Target::open(&target, &TargetOptions::default())?;
            let engine = Engine::new(t, EngineOptions { queue_depth: 1, buffer_slots: 1, ..Default::default() })?;
            let info = serde_json::json!({
                "target": target,
                "kind": engine.target().kind(),
                "geometry": engine.geometry(),
                "dmabuf_rw": engine.dmabuf_rw(),
                "dmabuf_exporters": pdstor::buffer::dmabuf::exporters(),
            });
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
        Command::Format { target, chunk_slot, journal, size, force } => {
            let r = store::format(
                &target,
                &FormatOptions { slot_size: chunk_slot, journal_half: journal, force, create_len: size },
            )?;
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        Command::Inspect { target } => {
            let (s, report) = store::Store::open(&target, store::StoreOptions::default())?;
            let sb = s.superblock();
            let pubs: Vec<_> = s
                .publications()
                .into_iter()
                .map(|p| serde_json::json!({"publication": p.id, "req_id": p.req_id, "phase": p.phase, "chunks": p.total_chunks, "slots": p.slots}))
                .collect();
            let out = serde_json::json!({
                "namespace": sb.uuid.to_string(),
                "epoch": sb.epoch,
                "slot_size": sb.slot_size,
                "slots": sb.slot_count,
                "stats": s.stats(),
                "recovery": report,
                "publications": pubs,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        Command::BenchStore { target, writers, publications, chunk, json } => {
            let r = store_bench::run(&StoreBenchConfig { target, writers, publications, chunk })?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "{} writers, {} publications of {} B: {:.0} publications/s, {:.0} journal records/s, {:.3} flushes and {:.3} commit groups per publication",
                    r.writers,
                    r.publications,
                    r.chunk,
                    r.publications_per_s,
                    r.journal_records_per_s,
                    r.flushes_per_publication,
                    r.commit_groups_per_publication
                );
            }
        }
        Command::Bench { target, path, pattern, bs, qd, size, seed, json, force, provenance } => {
            refuse_signature(&target, force)?;
            let _probes = if provenance { Some(pdstor_probes::Probes::attach(std::process::id())?) } else { None };
            let r = bench::run(&BenchConfig { target, path, pattern, block_size: bs, queue_depth: qd, size, seed })?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
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
            }
        }
        Command::Roundtrip { target, path, chunks, chunk_size, qd, seed, json, force } => {
            refuse_signature(&target, force)?;
            let r = roundtrip::run(&RoundtripConfig { target, path, chunks, chunk_size, queue_depth: qd, seed })?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
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
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    /// Every subcommand, depth first, with its path (`pdstor probe attach`).
    fn walk(cmd: &clap::Command, path: String, out: &mut Vec<(String, clap::Command)>) {
        out.push((path.clone(), cmd.clone()));
        for sub in cmd.get_subcommands() {
            walk(sub, format!("{path} {}", sub.get_name()), out);
        }
    }

    fn all() -> Vec<(String, clap::Command)> {
        let mut out = Vec::new();
        walk(&Cli::command(), "pdstor".into(), &mut out);
        out
    }

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_option_and_verb_has_help_text() {
        let mut missing = Vec::new();
        for (path, cmd) in all() {
            if cmd.get_about().is_none() && path != "pdstor help" {
                missing.push(path.clone());
            }
            for arg in cmd.get_arguments() {
                let builtin = matches!(arg.get_id().as_str(), "help" | "version");
                if !builtin && arg.get_help().is_none() {
                    missing.push(format!("{path} --{}", arg.get_id()));
                }
            }
        }
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }

    #[test]
    fn only_verbs_that_move_payload_take_a_data_socket() {
        let payload_verbs = ["put", "get", "handoff", "bench-handoff", "serve"];
        for (path, cmd) in all() {
            let name = cmd.get_name().to_owned();
            let has = cmd.get_arguments().any(|a| a.get_long() == Some("data-socket"));
            assert_eq!(has, payload_verbs.contains(&name.as_str()), "{path}: --data-socket advertised: {has}");
        }
    }

    #[test]
    fn options_with_a_fixed_set_of_values_list_them() {
        let values = |verb: &str, long: &str| -> Vec<String> {
            let (_, cmd) = all().into_iter().find(|(p, _)| p == verb).unwrap_or_else(|| panic!("{verb}"));
            let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap_or_else(|| panic!("{long}"));
            arg.get_possible_values().iter().map(|v| v.get_name().to_owned()).collect()
        };
        assert_eq!(values("pdstor put", "path"), ["host", "host_fixed", "dmabuf_fixed"]);
        assert_eq!(values("pdstor get", "buffer"), ["memfd", "udmabuf", "dma-heap"]);
        assert_eq!(values("pdstor publications", "state").len(), 6);
        assert_eq!(values("pdstor ladder", "exporter"), ["udmabuf", "cuda"]);
        assert_eq!(values("pdstor timeline check", "require-path").len(), 3);
        assert_eq!(values("pdstor bench", "pattern"), ["write", "read", "randwrite", "randread"]);
        // And each parses to what it names.
        let cli = Cli::try_parse_from(["pdstor", "publications", "--state", "ready", "-v"]);
        assert!(cli.is_ok(), "a state is accepted in any case");
        let err = Cli::try_parse_from(["pdstor", "put", "--req", "r", "--layout", "l", "--from", "f", "--path", "gpu"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("host_fixed") && err.contains("dmabuf_fixed"), "the error lists the values: {err}");
    }
}
