//! The `pdstor` command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use pdstor::PayloadPath;
use pdstor::bench::store::{self as store_bench, StoreBenchConfig};
use pdstor::bench::{self, BenchConfig, Pattern};
use pdstor::io::{Engine, EngineOptions, Target, TargetOptions};
use pdstor::roundtrip::{self, RoundtripConfig};
use pdstor::store::{self, FormatOptions};
use pdstor::units::parse_size;

#[derive(Parser)]
#[command(
    name = "pdstor",
    version,
    about = "Hands LLM KV cache from prefill to decode through NVMe, and proves it"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a target's kind and geometry as JSON.
    Info {
        #[arg(long)]
        target: PathBuf,
    },
    /// Write a fresh pdstor namespace (superblocks, empty journal) on a target.
    Format {
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
        #[arg(long)]
        target: PathBuf,
    },
    /// Publications per second through prepare + store + publish, and flushes per publication.
    BenchStore {
        /// A file to create (and remove) for the run.
        #[arg(long)]
        target: PathBuf,
        #[arg(long, default_value_t = 8)]
        writers: u32,
        #[arg(long, default_value_t = 2000)]
        publications: u32,
        #[arg(long, default_value = "256k", value_parser = parse_size)]
        chunk: u64,
        #[arg(long)]
        json: bool,
    },
    /// Measure the engine on a target with fio's pattern names.
    Bench {
        #[arg(long)]
        target: PathBuf,
        #[arg(long, default_value = "host_fixed")]
        path: PayloadPath,
        #[arg(long, value_enum, default_value = "read")]
        pattern: Pattern,
        #[arg(long, default_value = "4M", value_parser = parse_size)]
        bs: u64,
        #[arg(long, default_value_t = 16)]
        qd: u32,
        #[arg(long, default_value = "1G", value_parser = parse_size)]
        size: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Write even over a target that holds a filesystem or namespace.
        #[arg(long)]
        force: bool,
    },
    /// Write seeded chunks, flush, read them back and verify byte for byte.
    Roundtrip {
        #[arg(long)]
        target: PathBuf,
        #[arg(long, default_value = "host_fixed")]
        path: PayloadPath,
        #[arg(long, default_value_t = 64)]
        chunks: u32,
        #[arg(long, default_value = "8M", value_parser = parse_size)]
        chunk_size: u64,
        #[arg(long, default_value_t = 16)]
        qd: u32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long)]
        json: bool,
        /// Write even over a target that holds a filesystem or namespace.
        #[arg(long)]
        force: bool,
    },
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pdstor: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Info { target } => {
            let t = Target::open(&target, &TargetOptions::default())?;
            let engine = Engine::new(
                t,
                EngineOptions {
                    queue_depth: 1,
                    buffer_slots: 1,
                    ..Default::default()
                },
            )?;
            let info = serde_json::json!({
                "target": target,
                "kind": engine.target().kind(),
                "geometry": engine.geometry(),
            });
            println!("{}", serde_json::to_string_pretty(&info)?);
        }
        Command::Format {
            target,
            chunk_slot,
            journal,
            size,
            force,
        } => {
            let r = store::format(
                &target,
                &FormatOptions {
                    slot_size: chunk_slot,
                    journal_half: journal,
                    force,
                    create_len: size,
                },
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
        Command::BenchStore {
            target,
            writers,
            publications,
            chunk,
            json,
        } => {
            let r = store_bench::run(&StoreBenchConfig {
                target,
                writers,
                publications,
                chunk,
            })?;
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
        Command::Bench {
            target,
            path,
            pattern,
            bs,
            qd,
            size,
            seed,
            json,
            force,
        } => {
            refuse_signature(&target, force)?;
            let r = bench::run(&BenchConfig {
                target,
                path,
                pattern,
                block_size: bs,
                queue_depth: qd,
                size,
                seed,
            })?;
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
        Command::Roundtrip {
            target,
            path,
            chunks,
            chunk_size,
            qd,
            seed,
            json,
            force,
        } => {
            refuse_signature(&target, force)?;
            let r = roundtrip::run(&RoundtripConfig {
                target,
                path,
                chunks,
                chunk_size,
                queue_depth: qd,
                seed,
            })?;
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
                println!(
                    "  read   {:>8.1} MiB/s  ({:.3} s)",
                    r.read_mib_per_s, r.read_seconds
                );
                println!(
                    "  verified byte for byte: through the engine {}, independently (O_DIRECT pread) {}",
                    if r.verified_by_engine { "yes" } else { "no" },
                    if r.verified_independently {
                        "yes"
                    } else {
                        "n/a for passthrough"
                    }
                );
            }
        }
    }
    Ok(())
}
