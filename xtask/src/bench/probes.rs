//! What the provenance probes cost: the handoff with and without them
//! attached, in alternating rounds.

use super::*;

/// The handoff through a daemon with the provenance probes (`serve
/// --provenance`: every chunk judged) and through one without, strictly
/// alternating, as the median throughput ratio with/without (goal >= 0.95),
/// on each of `--targets`: two files on the root filesystem, or two zram
/// devices (memory speed, where the probes' CPU cost shows).
pub(super) fn handoff_probe_overhead(pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    println!("\nprovenance probe overhead on the handoff: 512 MiB, 8 MiB chunks, a daemon with probes and one without");
    let mut report = serde_json::Map::new();
    for t in &args.targets {
        let (with, without, _devices) = match t.as_str() {
            "file" => (
                BenchDaemon::start(pdstor, out_dir, "probes-on", &["--provenance"])?,
                BenchDaemon::start(pdstor, out_dir, "probes-off", &[])?,
                None,
            ),
            "zram" => match (zram("1300M"), zram("1300M")) {
                (Ok(a), Ok(b)) => (
                    BenchDaemon::start_on(pdstor, out_dir, "probes-on", Some(&a.path), &["--provenance"])?,
                    BenchDaemon::start_on(pdstor, out_dir, "probes-off", Some(&b.path), &[])?,
                    Some((a, b)),
                ),
                (Err(why), _) | (_, Err(why)) => {
                    println!("SKIP: the probes' cost on zram: {why:#}");
                    continue;
                }
            },
            other => bail!("unknown bench target {other:?}: expected file or zram"),
        };
        // Precondition both: the first write of a file allocates its extents.
        with.handoff(pdstor)?;
        without.handoff(pdstor)?;
        let mut ratios = Vec::new();
        for round in 0..args.rounds.max(5) {
            // Who goes first alternates, so neither always follows its own kind.
            let (w, wo) = if round % 2 == 0 {
                let w = with.handoff(pdstor)?;
                (w, without.handoff(pdstor)?)
            } else {
                let wo = without.handoff(pdstor)?;
                (with.handoff(pdstor)?, wo)
            };
            ratios.push(wo / w);
        }
        // The daemons stop before their devices are reset.
        drop((with, without));
        let med = median(ratios.clone());
        println!(
            "  {t:<5} handoff with/without probes (throughput): median {med:.3} (rounds {:?}; goal >= 0.95)",
            ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>()
        );
        report.insert(t.clone(), serde_json::json!({"ratios": ratios, "median": med}));
    }
    std::fs::write(out_dir.join("probe-overhead-handoff.json"), serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

/// The engine's 4 MiB sequential figures with the provenance probes attached
/// and without, alternating, as a ratio (goal >= 0.97).
pub(super) fn probe_overhead(sh: &Shell, pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    println!("\nprovenance probe overhead: 4 MiB sequential, QD16, on a file target, probes attached vs not");
    let target = out_dir.join("probe-overhead.img");
    let _ = std::fs::remove_file(&target);
    let size = &args.size;
    let mut rows = Vec::new();
    for pattern in ["write", "read"] {
        let mut ratios = Vec::new();
        for round in 0..args.rounds.max(3) {
            let run = |probes: bool| -> Result<f64> {
                let flag = if probes { vec!["--provenance"] } else { Vec::new() };
                let json = cmd!(sh, "{pdstor} bench --json --target {target} --pattern {pattern} --bs 4M --qd 16 --size {size} {flag...}").read()?;
                let v: Value = serde_json::from_str(&json)?;
                Ok(v["bytes"].as_f64().unwrap_or(0.0) / v["seconds"].as_f64().unwrap_or(f64::INFINITY))
            };
            let (with, without) = if round % 2 == 0 {
                (run(true)?, run(false)?)
            } else {
                let w = run(false)?;
                (run(true)?, w)
            };
            ratios.push(with / without);
        }
        let med = median(ratios.clone());
        println!(
            "  seq {pattern:<5}: with/without probes median {med:.3} (rounds {:?})",
            ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>()
        );
        rows.push(serde_json::json!({"pattern": pattern, "ratios": ratios, "median": med}));
    }
    let _ = std::fs::remove_file(&target);
    std::fs::write(out_dir.join("probe-overhead.json"), serde_json::to_string_pretty(&rows)?)?;
    Ok(())
}
