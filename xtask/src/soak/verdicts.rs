//! The soak's verdicts: what its drivers' ledgers and the daemon say at the
//! end (nothing lost, nothing corrupt, nothing held, every orphan released
//! by policy, every hang closed, no process crashed), and what its samples
//! say (memory, descriptors and threads back to their level after warm-up
//! once the load stops; each step's p99 in the last window within 1.2× of
//! the first).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;

use super::Run;
use super::sample::Sample;
use super::world::{Daemon, Drivers};

/// One verdict.
#[derive(Debug, Serialize)]
pub struct Verdict {
    pub name: &'static str,
    pub pass: bool,
    /// Whether a failure fails the run (the latency verdict is enforced on
    /// runs of 30 minutes or more: shorter ones are too noisy to judge).
    pub enforced: bool,
    pub detail: String,
}

/// Every verdict of a run, and the drivers' account.
#[derive(Debug, Serialize)]
pub struct Judged {
    pub verdicts: Vec<Verdict>,
    pub ledger: Value,
}

/// The drivers' account (`driver.py verdict`), against the daemon still running.
pub fn ledgers(drivers: &Drivers, daemon: &Daemon) -> Result<Value> {
    let out = std::process::Command::new(&drivers.python)
        .arg(&drivers.script)
        .arg("verdict")
        .arg("--dir")
        .arg(&drivers.dir)
        .arg("--server")
        .arg(format!("unix:{}", daemon.control.display()))
        .arg("--data-socket")
        .arg(&daemon.data)
        .output()
        .context("running the soak driver's verdict")?;
    if !out.status.success() {
        bail!("the soak driver's verdict failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).context("parsing the soak driver's verdict")
}

/// Judges a run `length` seconds of load long.
pub fn judge(
    run: &Run,
    ledger: Value,
    status: Result<std::process::ExitStatus, String>,
    length: f64,
    latency: bool,
) -> Judged {
    let n = |k: &str| ledger[k].as_u64().unwrap_or(0);
    let counts = |k: &str| ledger["counts"][k].as_u64().unwrap_or(0);
    let hangs = run.marks.iter().filter(|(_, m)| m == "data-plane hang").count() as u64;
    let mut v = vec![
        check(
            "nothing lost",
            n("lost_count") == 0,
            format!("{} lost of {} handoffs: {}", n("lost_count"), n("handoffs"), ledger["lost"]),
        ),
        check(
            "nothing corrupt",
            n("corrupt_count") == 0,
            format!("{} corrupt: {}", n("corrupt_count"), ledger["corrupt"]),
        ),
        check(
            "nothing held at the end",
            n("held_count") == 0,
            format!("{} publications held after the drain: {}", n("held_count"), ledger["held_at_end"]),
        ),
        check(
            "orphans released by policy",
            n("orphans_held") == 0 && n("orphans") > 0,
            format!("{} orphans, {} still held", n("orphans"), n("orphans_held")),
        ),
        check(
            "no unexpected refusal",
            counts("error") == 0,
            format!("{} writer errors (ledger event `error`)", counts("error")),
        ),
        check("no process crashed", run.crashes.is_empty(), run.crashes.join("; ")),
        check(
            "every reload applied under load",
            run.reloads_missed.is_empty(),
            format!(
                "{} of {} reloads (the config's rules replaced) applied: {}",
                run.reloads as usize - run.reloads_missed.len(),
                run.reloads,
                run.reloads_missed.join("; ")
            ),
        ),
        check(
            "the daemon stopped cleanly",
            status.as_ref().is_ok_and(|s| s.success()),
            match &status {
                Ok(s) => format!("SIGTERM: {s}"),
                Err(e) => e.clone(),
            },
        ),
        check(
            "every sample taken",
            run.gaps.is_empty(),
            format!(
                "{} of {} samples failed: {}",
                run.gaps.len(),
                run.gaps.len() + run.samples.len(),
                run.gaps.join("; ")
            ),
        ),
        check(
            "every hung connection closed",
            n("hangs_not_closed") == 0 && n("hangs") == hangs,
            format!("{} of {hangs} hangs reported, {} not closed by the daemon", n("hangs"), n("hangs_not_closed")),
        ),
    ];
    v.push(decoders(&ledger));
    v.push(pressure(run, length));
    v.extend(resources(run, length));
    v.push(steady(run, length, latency));
    Judged { verdicts: v, ledger }
}

/// Whether every decoding process (each reader, the LMCache and the vLLM
/// decode) restored handoffs, and found few of its handoffs gone after the
/// daemon cut it short (acknowledged, their answer lost: at most 1 % of
/// what it acknowledged) — not an engine that only ever failed, its
/// handoffs reclaimed or gone.
fn decoders(ledger: &Value) -> Verdict {
    let Some(all) = ledger["decoders"].as_object().filter(|d| !d.is_empty()) else {
        return check("every decoder restored", false, "no decoder acknowledged anything".into());
    };
    let mut wrong = Vec::new();
    let mut seen = Vec::new();
    for (name, d) in all {
        let (acked, gone) = (d["acked"].as_u64().unwrap_or(0), d["acked_unrecorded"].as_u64().unwrap_or(0));
        seen.push(format!("{name} {acked}"));
        if acked == 0 || gone as f64 > 0.01 * acked as f64 {
            wrong.push(format!("{name}: {acked} acknowledged, {gone} found gone"));
        }
    }
    let detail = if wrong.is_empty() { format!("acknowledged: {}", seen.join(", ")) } else { wrong.join("; ") };
    check("every decoder restored", wrong.is_empty(), detail)
}

/// Whether the load did what it says: the store at least 90 % taken (used
/// or reserved) in at least 80 % of the samples of the load after its
/// first 30 s — prepares contending for room all along.
fn pressure(run: &Run, length: f64) -> Verdict {
    let taken: Vec<bool> = run
        .samples
        .iter()
        .filter(|s| s.t >= 30.0 && s.t < length)
        .map(|s| {
            let (free, used, reserved) = (s.slots.get("free"), s.slots.get("used"), s.slots.get("reserved"));
            let (f, u, r) = (free.copied().unwrap_or(0), used.copied().unwrap_or(0), reserved.copied().unwrap_or(0));
            (u + r) as f64 >= 0.9 * (f + u + r).max(1) as f64
        })
        .collect();
    let full = taken.iter().filter(|t| **t).count();
    let share = full as f64 / taken.len().max(1) as f64;
    check(
        "the store kept at least 90 % full",
        share >= 0.8,
        format!("{full} of {} samples of the load ({:.0} %)", taken.len(), 100.0 * share),
    )
}

fn check(name: &'static str, pass: bool, detail: String) -> Verdict {
    Verdict { name, pass, enforced: true, detail }
}

/// The samples the resources are judged against: the three from 30 s
/// after the daemon's last start, and after a fifth of the load.
fn baseline(run: &Run, length: f64) -> Vec<&Sample> {
    let last_start = run.marks.iter().filter(|(_, m)| m.starts_with("daemon")).map(|(t, _)| *t).fold(0.0, f64::max);
    let after = (last_start + 30.0).max(0.2 * length);
    run.samples.iter().filter(|s| s.t >= after && s.t < length).take(3).collect()
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn resources(run: &Run, length: f64) -> Vec<Verdict> {
    let base = baseline(run, length);
    let (Some(first), Some(rest)) = (base.first(), run.rest) else {
        return vec![check("resources back after the load", false, "no samples after warm-up, or none at rest".into())];
    };
    let back = |name: &'static str, b: u64, e: u64, unit: &str| {
        let ratio = e as f64 / (b as f64).max(1.0);
        check(
            name,
            ratio <= 1.05,
            format!(
                "{e} {unit} at rest (the least of 15 s) against {b} after warm-up (the median from {:.0} s): {ratio:.2}×",
                first.t
            ),
        )
    };
    let of = |f: fn(&Sample) -> u64| median(base.iter().map(|s| f(s)).collect());
    vec![
        back("memory back after the load (anonymous: the heap)", of(|s| s.rss_anon_kib), rest.0, "KiB"),
        back("descriptors back after the load", of(|s| s.fds), rest.1, "descriptors"),
        back("threads back after the load", of(|s| s.threads), rest.2, "threads"),
    ]
}

/// Each step's and transfer's p99 in the last window of the load against
/// the first (a window: a fifth of the load, at most 10 minutes), each the
/// p99 of the window's summed histogram, leaving out the 30 s after a daemon
/// restart or a full disk. A step with fewer than [`JUDGED_EVENTS`] in
/// either window is reported, not judged (its p99 is a handful of events),
/// as are `prepare` and `batch` (whose prepares wait for room, as long as
/// the store is full) and the soak's own `/metrics` and `/healthz`.
fn steady(run: &Run, length: f64, enforced: bool) -> Verdict {
    let window = (0.2 * length).min(600.0);
    let start = baseline(run, length).first().map_or(0.0, |s| s.t);
    let disturbed = |t: f64| {
        run.marks
            .iter()
            .any(|(at, m)| (m.starts_with("daemon") || m.contains("disk full")) && t >= *at && t < at + 30.0)
    };
    let in_window = |from: f64, to: f64| -> Vec<&Sample> {
        run.samples.iter().filter(|s| s.t >= from && s.t < to && !disturbed(s.t)).collect()
    };
    let (first, last) = (in_window(start, start + window), in_window(length - window, length));
    let steps: std::collections::BTreeSet<&String> = run.samples.iter().flat_map(|s| s.hist.keys()).collect();
    let mut worst = (String::new(), 0.0_f64);
    let mut judged = Vec::new();
    for step in steps {
        let (Some((a, na)), Some((b, nb))) = (window_p99(&first, step), window_p99(&last, step)) else { continue };
        // Prepares wait for room while the store is full; /metrics and
        // /healthz are the soak's own, not the load's.
        let waits = matches!(step.as_str(), "prepare" | "batch" | "metrics" | "healthz");
        let few = na.min(nb) < JUDGED_EVENTS;
        let why = if waits {
            " (waits for room: not judged)"
        } else if few {
            " (too few: not judged)"
        } else {
            ""
        };
        judged.push(format!("{step} {:.2}→{:.2} ms of {na:.0}/{nb:.0}{why}", a * 1e3, b * 1e3));
        let ratio = b / a.max(1e-9);
        if !waits && !few && ratio > worst.1 {
            worst = (step.clone(), ratio);
        }
    }
    let name = "latency steady (p99, last window against the first)";
    if worst.0.is_empty() {
        let detail = format!("no step ran {JUDGED_EVENTS} times in both windows (a run this short is too few samples)");
        return Verdict { name, pass: !enforced, enforced, detail };
    }
    Verdict {
        name,
        pass: worst.1 <= 1.2,
        enforced,
        detail: format!("worst {} {:.2}×; {}", worst.0, worst.1, judged.join(", ")),
    }
}

/// A step's events in a window before its p99 is judged.
const JUDGED_EVENTS: f64 = 1000.0;

/// The p99 (s) of `step`'s histograms summed over `samples`, and how many
/// events they hold; `None` where it never ran.
fn window_p99(samples: &[&Sample], step: &str) -> Option<(f64, f64)> {
    let mut sum: Vec<(f64, f64)> = Vec::new();
    for h in samples.iter().filter_map(|s| s.hist.get(step)) {
        for &(le, c) in h {
            match sum.iter_mut().find(|(l, _)| *l == le) {
                Some(slot) => slot.1 += c,
                None => sum.push((le, c)),
            }
        }
    }
    sum.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = sum.last()?.1;
    Some((super::sample::quantile(&sum, 0.99)?, total))
}

impl Judged {
    /// The enforced verdicts that failed.
    pub fn failures(&self) -> Vec<String> {
        self.verdicts.iter().filter(|v| v.enforced && !v.pass).map(|v| format!("{}: {}", v.name, v.detail)).collect()
    }

    /// With a planted leak: what is wrong if the descriptor verdict passed,
    /// or anything else failed.
    pub fn leak_not_caught(&self) -> Vec<String> {
        let mut wrong = Vec::new();
        for v in self.verdicts.iter().filter(|v| v.enforced) {
            let leak = v.name == "descriptors back after the load";
            if leak && v.pass {
                wrong.push(format!("the planted leak was not caught: {}", v.detail));
            } else if !leak
                && !v.pass
                // A run of a minute and a half: too short to fill the store,
                // see a window pass, or give every engine time to start.
                && !matches!(
                    v.name,
                    "orphans released by policy" | "the store kept at least 90 % full" | "every decoder restored"
                )
            {
                wrong.push(format!("{}: {}", v.name, v.detail));
            }
        }
        wrong
    }

    pub fn print(&self, kind: &str) {
        println!("\n==> soak on {kind}: verdicts");
        for v in &self.verdicts {
            let mark = match (v.pass, v.enforced) {
                (true, _) => "pass",
                (false, true) => "FAIL",
                (false, false) => "note",
            };
            println!("  {mark}  {}: {}", v.name, v.detail);
        }
        println!("  counts: {}", self.ledger["counts"]);
    }

    /// `soak.json` (samples, faults, verdicts, the drivers' account) and `soak.svg`.
    pub fn write(&self, dir: &Path, kind: &str, run: &Run) -> Result<()> {
        let json = serde_json::json!({
            "target": kind,
            "samples": run.samples,
            "faults": run.marks,
            "crashes": run.crashes,
            "reloads": run.reloads,
            "reloads_missed": run.reloads_missed,
            "gaps": run.gaps,
            "rest": run.rest,
            "verdicts": self.verdicts,
            "ledger": self.ledger,
        });
        std::fs::write(dir.join("soak.json"), serde_json::to_vec_pretty(&json)?).context("writing soak.json")?;
        let marks: Vec<super::svg::Mark<'_>> =
            run.marks.iter().filter(|(_, m)| m != "reload").map(|(t, m)| super::svg::Mark { t: *t, what: m }).collect();
        let title = format!("pdstor soak on {kind}: {:.0} min", run.samples.last().map_or(0.0, |s| s.t) / 60.0);
        std::fs::write(dir.join("soak.svg"), super::svg::render(&title, &run.samples, &marks))
            .context("writing soak.svg")?;
        println!("soak on {kind}: {} and {}", dir.join("soak.json").display(), dir.join("soak.svg").display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run of 60 samples 10 s apart whose `claim` takes `fast` s in each
    /// interval (`n` times) and, from `slow_from` s on, 1 in 50 at `slow`.
    fn run(n: f64, slow_from: f64, slow: bool) -> Run {
        let bounds = [0.001, 0.002, 0.004, 0.008, f64::INFINITY];
        let samples = (0..60)
            .map(|i| {
                let t = 10.0 * i as f64;
                let late = slow && t >= slow_from;
                // All under 1 ms, or 2 % of them in 4–8 ms.
                let counts = if late { [0.98 * n, 0.98 * n, 0.98 * n, n, n] } else { [n; 5] };
                let h: Vec<(f64, f64)> = bounds.iter().copied().zip(counts).collect();
                Sample { t, hist: [("claim".to_owned(), h)].into_iter().collect(), ..Default::default() }
            })
            .collect();
        Run {
            samples,
            marks: Vec::new(),
            crashes: Vec::new(),
            reloads: 0,
            reloads_missed: Vec::new(),
            gaps: Vec::new(),
            stopped: 600.0,
            rest: None,
            started: std::time::Instant::now(),
            counters: Default::default(),
        }
    }

    #[test]
    fn a_step_slower_in_the_last_window_fails_and_a_steady_one_passes() {
        let steady_run = steady(&run(200.0, 0.0, false), 600.0, true);
        assert!(steady_run.pass, "{}", steady_run.detail);
        let slowed = steady(&run(200.0, 480.0, true), 600.0, true);
        assert!(!slowed.pass, "the last window's p99 is in 4–8 ms, the first's under 1 ms: {}", slowed.detail);
        assert!(slowed.detail.starts_with("worst claim"), "{}", slowed.detail);
    }

    #[test]
    fn a_step_run_too_few_times_is_reported_not_judged() {
        let few = steady(&run(5.0, 480.0, true), 600.0, true);
        assert!(!few.pass && few.detail.starts_with("no step ran"), "enforced and nothing judged: {}", few.detail);
        assert!(steady(&run(5.0, 480.0, true), 600.0, false).pass, "not enforced: a note");
    }
}
