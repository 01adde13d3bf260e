//! The `pdstor` command line: one verb per variant of [`Command`], each an
//! args struct with its own `run`, grouped by what the verb works on. The
//! daemon's verbs run `pdstor-daemon`, the proof's `pdstor-proof`.
#![deny(clippy::unwrap_used)]

mod bench_crc;
mod client;
mod common;
mod harness;
mod probe;
mod process_handoff;
mod serve;
mod target;
mod timeline;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use pdstor_client::ClientError;

#[derive(Parser)]
#[command(name = "pdstor", version, about = "Hands LLM KV cache from prefill to decode through NVMe, and proves it")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: the store behind the HTTP control plane and the data plane.
    Serve(Box<serve::ServeArgs>),
    /// prepare + store a file's bytes through a shared buffer + publish; prints the READY receipt.
    Put(client::PutArgs),
    /// Claim a READY publication for one reader and session; prints the claim receipt.
    Claim(client::ClaimArgs),
    /// adopt + load + verify; writes the bytes, prints the restore digest (and acks with --ack).
    Get(client::GetArgs),
    /// Acknowledge a restore: frees the slots.
    Ack(client::AckArgs),
    /// Release a READY, never-claimed publication.
    Release(client::ReleaseArgs),
    /// Abort a publication that is not READY yet (an unknown one is refused).
    Abort(client::AbortArgs),
    /// Give up a request: refuse its waiting prepare, or roll back its PREPARED publication.
    Cancel(client::CancelArgs),
    /// Report a failed or uncertain read: the publication is RETAINED.
    Fail(client::FailArgs),
    /// Free a claimed or retained publication whose reader is fenced.
    Reclaim(client::ReclaimArgs),
    /// End every read of a cache publication whose reader is gone (an admin).
    EndReads(client::EndReadsArgs),
    /// Fence a reader session (its claims become reclaimable).
    CloseSession(client::CloseSessionArgs),
    /// Tell a standby (`serve --standby`) to take its namespace over now: it preempts the owner's
    /// reservation key and serves from a new epoch; prints what it did.
    Takeover(client::TakeoverArgs),
    /// The daemon's metrics (Prometheus text).
    Status(client::StatusArgs),
    /// Live publications, optionally of one state; --verbose adds each chunk's extent on the target.
    Publications(client::PublicationsArgs),
    /// The handoff against a running daemon, buffers registered once: wall time and per-step latency.
    BenchHandoff(harness::BenchHandoffArgs),
    /// A writer process and a reader process hand N bytes through the daemon, verified.
    Handoff(harness::HandoffArgs),
    /// eBPF provenance probes: attach, status, dump, detach.
    Probe {
        #[command(subcommand)]
        command: probe::ProbeCmd,
    },
    /// The payload ladder on a scratch target: host → host_fixed → dmabuf_fixed from a
    /// DMA-BUF exporter's memory, each byte read back independently, each transfer judged by
    /// the probes; writes ladder.json and ladder.md. Exits 1 if a requested path is not qualified.
    Ladder(harness::LadderArgs),
    /// The model-oracle profile: a deterministic model's KV cache handed through `pdstor serve` to
    /// a reader process, continuations compared with a no-cache oracle, fault controls, a checked
    /// timeline. Writes qualify.json, qualify.md, timeline.jsonl, timeline.svg; exits 1 on any failure.
    Qualify(harness::QualifyArgs),
    /// The reader process of `pdstor qualify` (internal).
    #[command(hide = true)]
    QualifyReader(harness::QualifyReaderArgs),
    /// Causal timelines: check one (exit 1 on any violation), or render it as SVG.
    Timeline {
        #[command(subcommand)]
        command: timeline::TimelineCmd,
    },
    /// Print a target's kind and geometry as JSON.
    Info(target::InfoArgs),
    /// Write a fresh pdstor namespace (superblocks, empty journal) on a target.
    Format(target::FormatArgs),
    /// Replace the namespace's receipt key (offline, no live publication): earlier receipts are void.
    RotateKey(target::RotateKeyArgs),
    /// Replay a namespace's journal read-only (no epoch bump, nothing written) and print what
    /// recovery would find and the publications.
    Inspect(target::InspectArgs),
    /// Publications per second through prepare + store + publish, and flushes per publication.
    BenchStore(harness::BenchStoreArgs),
    /// Measure the engine on a target with fio's pattern names.
    Bench(harness::BenchArgs),
    /// Each CRC-32C implementation this CPU runs, on one core, against a plain read of the same
    /// bytes, in cache and in DRAM; names the one the daemon uses.
    BenchCrc(bench_crc::BenchCrcArgs),
    /// Write seeded chunks, flush, read them back and verify byte for byte.
    Roundtrip(harness::RoundtripArgs),
}

impl Command {
    /// Runs the verb: every variant has its own `run`, so a new verb is one
    /// variant and one arm, checked by the compiler.
    fn run(self) -> anyhow::Result<()> {
        match self {
            Command::Serve(a) => (*a).run(),
            Command::Put(a) => a.run(),
            Command::Claim(a) => a.run(),
            Command::Get(a) => a.run(),
            Command::Ack(a) => a.run(),
            Command::Release(a) => a.run(),
            Command::Abort(a) => a.run(),
            Command::Cancel(a) => a.run(),
            Command::Fail(a) => a.run(),
            Command::Reclaim(a) => a.run(),
            Command::EndReads(a) => a.run(),
            Command::Takeover(a) => a.run(),
            Command::CloseSession(a) => a.run(),
            Command::Status(a) => a.run(),
            Command::Publications(a) => a.run(),
            Command::BenchHandoff(a) => a.run(),
            Command::Handoff(a) => a.run(),
            Command::Probe { command } => command.run(),
            Command::Ladder(a) => a.run(),
            Command::Qualify(a) => a.run(),
            Command::QualifyReader(a) => a.run(),
            Command::Timeline { command } => command.run(),
            Command::Info(a) => a.run(),
            Command::Format(a) => a.run(),
            Command::Inspect(a) => a.run(),
            Command::RotateKey(a) => a.run(),
            Command::BenchStore(a) => a.run(),
            Command::Bench(a) => a.run(),
            Command::BenchCrc(a) => a.run(),
            Command::Roundtrip(a) => a.run(),
        }
    }
}

/// Exit status of a command line pdstor cannot parse (`EX_USAGE`): never 2,
/// which means the daemon refused a step.
const EXIT_USAGE: u8 = 64;

/// Parses the command line, runs the verb, and turns its outcome into the
/// exit status: 0 done, 2 refused by the daemon, 3 failed, 64 usage, 1 other.
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
    match cli.command.run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast_ref::<ClientError>() {
            Some(ClientError::Api(body)) => {
                // A 4xx is the daemon refusing a step (nothing changed); a 5xx is it failing one.
                let verb = if (400..500).contains(&body.status) { "refused" } else { "failed" };
                eprintln!("pdstor: {verb}: {} {} ({}): {}", body.status, body.code, body.field, body.message);
                ExitCode::from(pdstor_daemon::api::error::exit_code(body))
            }
            Some(other) => {
                eprintln!("pdstor: error: {other}");
                ExitCode::from(pdstor_client::code::EXIT_FAILED)
            }
            None => {
                eprintln!("pdstor: error: {e:#}");
                ExitCode::from(1)
            }
        },
    }
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
