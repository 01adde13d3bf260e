//! `cargo xtask bench --verify`: what checking every restored byte costs.
//! First each CRC-32C implementation against a plain read of the same bytes
//! (`pdstor bench-crc`), then the daemon's verifier pool at 1 thread and at
//! one per CPU: reloads of a 512 MiB handoff in 8 MiB chunks, verified and
//! not (`bench-handoff --no-verify`), alternating, on each of --targets —
//! their throughput, and the CPU the daemon and the reader spent per GiB —
//! and the same reloads copied out into the reader's own memory, as the
//! readers that stage do (`--copy-out`): checked in that copy, or a plain
//! copy.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use xshell::{Shell, cmd};

use super::{BenchArgs, BenchDaemon, median};

/// Reloads per measurement (each 512 MiB).
const RELOADS: &str = "6";

pub(super) fn run(sh: &Shell, pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    println!("\ncrc32c on one core against a plain read of the same bytes (pdstor bench-crc)");
    let crc = cmd!(sh, "{pdstor} bench-crc --json").read().context("running pdstor bench-crc")?;
    let crc: Value = serde_json::from_str(&crc).context("parsing bench-crc --json")?;
    print_crc(&crc);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut pools = serde_json::Map::new();
    for t in &args.targets {
        let mut by_threads = serde_json::Map::new();
        for threads in [1, cores] {
            let Some(m) = measure_pool(pdstor, out_dir, t, threads, args.rounds.max(3))? else { break };
            by_threads.insert(threads.to_string(), m);
            if cores == 1 {
                break;
            }
        }
        pools.insert(t.clone(), Value::Object(by_threads));
    }
    let report = json!({"crc": crc, "pool": pools});
    std::fs::write(out_dir.join("verify.json"), serde_json::to_string_pretty(&report)?)?;
    println!("  (target/bench/verify.json)");
    Ok(())
}

fn print_crc(crc: &Value) {
    println!("  in use: {} ({}); crc-fast takes {}", crc["chosen"], crc["chosen_by"], crc["crc_fast_path"]);
    for size in crc["sizes"].as_array().into_iter().flatten() {
        let cases = size["cases"].as_array().into_iter().flatten();
        let row: Vec<String> = cases
            .map(|c| format!("{} {:.1}", c["name"].as_str().unwrap_or("?"), c["gib_per_s"].as_f64().unwrap_or(0.0)))
            .collect();
        println!("  {:>10} B  GiB/s: {}", size["bytes"], row.join(", "));
        let copies = size["copies"].as_array().into_iter().flatten();
        let row: Vec<String> = copies
            .map(|c| {
                let (name, rate) = (c["name"].as_str().unwrap_or("?"), c["gib_per_s"].as_f64().unwrap_or(0.0));
                format!("{name} {rate:.1} ({:.2}x the copy's time)", c["of_plain_read"].as_f64().unwrap_or(0.0))
            })
            .collect();
        println!("  {:>10} B  GiB/s: {}", "", row.join(", "));
    }
}

/// One daemon with `threads` verifiers on `target`: `rounds` alternating
/// pairs of verified and unverified reloads. `None` where the target is
/// not available here (said as a SKIP).
fn measure_pool(pdstor: &Path, out_dir: &Path, target: &str, threads: usize, rounds: u32) -> Result<Option<Value>> {
    let n = threads.to_string();
    let extra = ["--verify-threads", n.as_str()];
    let (daemon, _zram) = match target {
        "file" => (BenchDaemon::start(pdstor, out_dir, "verify", &extra)?, None),
        "zram" => match super::zram("1300M") {
            Ok(z) => (BenchDaemon::start_on(pdstor, out_dir, "verify", Some(&z.path), &extra)?, Some(z)),
            Err(why) => {
                println!("SKIP: the verifier pool on zram: {why:#}");
                return Ok(None);
            }
        },
        other => bail!("unknown bench target {other:?}: expected file or zram"),
    };
    let in_place = pairs(&daemon, pdstor, rounds, false)?;
    let copied = pairs(&daemon, pdstor, rounds, true)?;
    drop(daemon);
    let mut out = serde_json::Map::new();
    for (what, (on, off)) in [("in place", in_place), ("copied out", copied)] {
        let gib_s = |v: &[(f64, f64)]| median(v.iter().map(|(s, _)| 0.5 / s).collect());
        let cpu = |v: &[(f64, f64)]| median(v.iter().map(|(_, c)| *c).collect());
        let (on_rate, off_rate, on_cpu, off_cpu) = (gib_s(&on), gib_s(&off), cpu(&on), cpu(&off));
        println!(
            "  {target:<5} {threads} verifier(s), {what:<10}: reload {on_rate:.2} GiB/s verified, {off_rate:.2} \
             unverified; CPU {on_cpu:.3} s/GiB verified, {off_cpu:.3} unverified: {:.2}x",
            on_cpu / off_cpu.max(1e-9)
        );
        let key = if what == "in place" { "in_place" } else { "copied_out" };
        out.insert(
            key.into(),
            json!({
                "verified": {"gib_per_s": on_rate, "cpu_s_per_gib": on_cpu, "rounds": on},
                "unverified": {"gib_per_s": off_rate, "cpu_s_per_gib": off_cpu, "rounds": off},
                "cpu_ratio": on_cpu / off_cpu.max(1e-9),
            }),
        );
    }
    Ok(Some(Value::Object(out)))
}

/// `rounds` alternating pairs of verified and unverified reloads (copied
/// out, or not): who goes first alternates, so neither always follows its
/// own kind.
type Pairs = (Vec<(f64, f64)>, Vec<(f64, f64)>);
fn pairs(daemon: &BenchDaemon, pdstor: &Path, rounds: u32, copy_out: bool) -> Result<Pairs> {
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            on.push(reloads(daemon, pdstor, false, copy_out)?);
            off.push(reloads(daemon, pdstor, true, copy_out)?);
        } else {
            off.push(reloads(daemon, pdstor, true, copy_out)?);
            on.push(reloads(daemon, pdstor, false, copy_out)?);
        }
    }
    Ok((on, off))
}

/// One bench-handoff's reloads: their median seconds per 512 MiB load and
/// the CPU per GiB they took (the daemon's and the reader's).
fn reloads(daemon: &BenchDaemon, pdstor: &Path, unverified: bool, copy_out: bool) -> Result<(f64, f64)> {
    let mut c = std::process::Command::new(pdstor);
    c.args(["bench-handoff", "--json", "--server", &daemon.server, "--data-socket"]).arg(&daemon.data_socket).args([
        "--bytes",
        "512M",
        "--chunk",
        "8M",
        "--rounds",
        "1",
        "--latency-samples",
        "0",
        "--reloads",
        RELOADS,
    ]);
    if unverified {
        c.arg("--no-verify");
    }
    if copy_out {
        c.arg("--copy-out");
    }
    let out = c.output().context("running pdstor bench-handoff")?;
    if !out.status.success() {
        bail!("pdstor bench-handoff --reloads against {}: {}", daemon.server, String::from_utf8_lossy(&out.stderr));
    }
    let r: Value = serde_json::from_slice(&out.stdout).context("parsing bench-handoff --json")?;
    let seconds = r["reload_median_seconds"].as_f64().context("bench-handoff JSON without reload_median_seconds")?;
    let cpu = r["reload_cpu"]["total_s_per_gib"].as_f64().context("bench-handoff JSON without reload_cpu")?;
    Ok((seconds, cpu))
}
