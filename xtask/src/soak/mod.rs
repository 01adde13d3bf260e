//! `cargo xtask soak --minutes N`: the real daemon on a real target (a file,
//! and zram) under a serving-like mix from several processes of the Python
//! client (`xtask/soak/driver.py`: handoffs of 1 to 512 chunks, slow
//! decodes that keep the store full, orphans, decodes that fail their load,
//! cancels, requests put twice), with faults at seeded random times: a
//! client killed with SIGKILL mid-step, the daemon killed and restarted, its
//! log's disk full for a while, a data-plane connection that hangs, a reload
//! every minute. Every 10 s it records the daemon's memory, descriptors,
//! threads, journal, publications and step latencies; at the end it judges
//! (`verdicts`) and writes `target/soak/<target>/soak.json` and `soak.svg`.

pub mod sample;
mod svg;
mod verdicts;
mod world;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use xshell::Shell;

use crate::project_root;
use world::{Daemon, Drivers, LogDisk, Target};

#[derive(clap::Args)]
pub struct SoakArgs {
    /// How long the load runs on each target, in minutes.
    #[arg(long, default_value_t = 5.0)]
    pub minutes: f64,
    /// Which targets: file, zram (root), or both (at once, each its own daemon).
    #[arg(long, default_value = "both")]
    pub target: String,
    /// The seed of the mix and of the fault times.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Check the soak itself: a debug daemon that leaks one descriptor per
    /// control-plane request (a fault compiled into debug builds only); the
    /// run passes only if the descriptor verdict, and no other, fails.
    #[arg(long)]
    pub plant_leak: bool,
}

/// A fault, and when it falls (seconds into the load).
#[derive(Debug, Clone)]
enum Fault {
    KillDaemon,
    KillClient(&'static str, u32),
    DiskFull(u64),
    Hang(u32),
    Reload,
}

/// Writers and readers per target (one pair of processes each).
const PAIRS: u32 = 2;
/// Seconds between samples.
const EVERY: u64 = 10;

pub fn run(sh: &Shell, args: &SoakArgs) -> Result<()> {
    let venv = crate::python::venv(sh)?;
    crate::python::install(sh, &venv)?;
    soak(sh, &venv, args)
}

/// The soak with the package already installed in `venv`.
pub fn soak(sh: &Shell, venv: &Path, args: &SoakArgs) -> Result<()> {
    let pdstor = if args.plant_leak { crate::build_debug_pdstor(sh)? } else { crate::build_pdstor(sh)? };
    let venv = venv.to_path_buf();
    let kinds: Vec<&str> = match args.target.as_str() {
        "both" => vec!["file", "zram"],
        one => vec![one],
    };
    let minutes = if args.plant_leak { args.minutes.min(1.5) } else { args.minutes };
    let outcomes: Vec<(String, Result<verdicts::Judged>)> = std::thread::scope(|s| {
        let running: Vec<_> = kinds
            .iter()
            .enumerate()
            .map(|(i, kind)| {
                let (pdstor, venv) = (pdstor.clone(), venv.clone());
                let kind = kind.to_string();
                // Each target its own fault times: not every daemon restarted at once.
                let seed = args.seed + i as u64;
                s.spawn(move || {
                    let r = soak_one(&kind, &pdstor, &venv, minutes, seed, args.plant_leak);
                    (kind, r)
                })
            })
            .collect();
        let joined = running.into_iter().zip(&kinds).map(|(h, kind)| {
            h.join().unwrap_or_else(|_| (kind.to_string(), Err(anyhow::anyhow!("the soak on {kind} panicked (above)"))))
        });
        joined.collect()
    });
    let mut failed = Vec::new();
    for (kind, outcome) in outcomes {
        match outcome {
            Ok(judged) => {
                judged.print(&kind);
                let wrong = if args.plant_leak { judged.leak_not_caught() } else { judged.failures() };
                if !wrong.is_empty() {
                    failed.push(format!("{kind}: {}", wrong.join("; ")));
                }
            }
            Err(e) if format!("{e:#}").starts_with("SKIP") => println!("{e:#}"),
            Err(e) => failed.push(format!("{kind}: {e:#}")),
        }
    }
    if !failed.is_empty() {
        bail!("the soak failed:\n  {}", failed.join("\n  "));
    }
    Ok(())
}

/// One target's soak: set up, load with faults, drain, judge, draw.
fn soak_one(kind: &str, pdstor: &Path, venv: &Path, minutes: f64, seed: u64, leak: bool) -> Result<verdicts::Judged> {
    let dir = project_root().join("target/soak").join(kind);
    // A soak killed before it cleaned up may have left its log disk mounted.
    LogDisk::unmount_stale(&dir.join("log"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing the last soak's {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let target = match Target::make(kind, &dir)? {
        Ok(t) => t,
        Err(why) => bail!("SKIP: soak on {kind}: {why}"),
    };
    target.format(pdstor)?;
    let config = dir.join("pdstor.toml");
    std::fs::write(&config, config_text(0)).context("writing the soak's config")?;
    let root = crate::deps::is_root(&Shell::new()?);
    let logs = LogDisk::mount(dir.join("log"), dir.join("serve.log"), root)?;
    let mut daemon = Daemon::new(pdstor, target.path(), &dir, logs.dir.join("serve.log"), &config);
    if leak {
        daemon.env("PDSTOR_DEBUG_LEAK_FD_PER_REQUEST", "1");
    }
    daemon.start()?;
    let mut drivers = Drivers {
        python: venv.join("bin/python"),
        script: project_root().join("xtask/soak/driver.py"),
        dir: dir.clone(),
        seed,
        list: Vec::new(),
    };
    for id in 0..PAIRS {
        drivers.spawn("writer", id, &daemon)?;
        drivers.spawn("reader", id, &daemon)?;
    }
    // LMCache with the plugin, and vLLM's scheduler with the connector: a pair of engines each.
    for role in ["lmcache-prefill", "lmcache-decode", "vllm-prefill", "vllm-decode"] {
        drivers.spawn(role, 0, &daemon)?;
    }
    let length = Duration::from_secs_f64(minutes * 60.0);
    let faults = if leak { Vec::new() } else { schedule(length.as_secs_f64(), seed, logs.fillable()) };
    let mut run = Run {
        samples: Vec::new(),
        marks: Vec::new(),
        crashes: Vec::new(),
        reloads: 0,
        reloads_missed: Vec::new(),
        gaps: Vec::new(),
        stopped: 0.0,
        rest: None,
        started: Instant::now(),
        counters: Default::default(),
    };
    run.load(&mut daemon, &mut drivers, &logs, &config, faults, length)?;
    run.drain(&mut daemon, &mut drivers)?;
    let ledger = verdicts::ledgers(&drivers, &daemon)?;
    let status = daemon.stop().map_err(|e| format!("{e:#}"));
    let judged = verdicts::judge(&run, ledger, status, length.as_secs_f64(), minutes >= 30.0);
    judged.write(&dir, kind, &run)?;
    Ok(judged)
}

/// The config the soak's daemon runs with: this user as tenant `soak`, an
/// admin (for /metrics). Each reload applies the other `version`: the
/// tenant's unread window 120 s or 100 s, and a second tenant (`standby`,
/// another user) there or not — rules replaced under load.
fn config_text(version: u32) -> String {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let soak = format!(
        "[[principal]]\ntenant = \"soak\"\nroles = [\"writer\", \"reader\", \"admin\"]\nuids = [{me}]\n\n[tenant.soak]\nunread_release_ms = {}\n",
        if version.is_multiple_of(2) { 120_000 } else { 100_000 }
    );
    let standby = "\n[[principal]]\ntenant = \"standby\"\nroles = [\"reader\"]\nuids = [65534]\n\n[tenant.standby]\nunread_release_ms = 30000\n";
    if version.is_multiple_of(2) { soak } else { soak + standby }
}

/// The daemon's count of reloads applied, if it answers.
fn reloads_applied(control: &Path) -> Option<f64> {
    let m = sample::parse(&sample::metrics(control).ok()?);
    m.get("pdstor_reloads_total{result=\"applied\"}").copied()
}

/// The faults of a run `length` seconds long, at times `seed` draws.
fn schedule(length: f64, seed: u64, disk: bool) -> Vec<(f64, Fault)> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut draw = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 10_000) as f64 / 10_000.0
    };
    let mut faults = vec![(0.30 * length, Fault::KillDaemon), (0.2 * length, Fault::Hang(0))];
    faults.push((0.65 * length, Fault::Hang(1)));
    if disk {
        faults.push((0.5 * length, Fault::DiskFull(5)));
    }
    for i in 0..4 {
        let role = if i % 2 == 0 { "writer" } else { "reader" };
        faults.push(((0.1 + 0.7 * draw()) * length, Fault::KillClient(role, (draw() * PAIRS as f64) as u32 % PAIRS)));
    }
    let mut t = 60.0;
    while t < length {
        faults.push((t, Fault::Reload));
        t += 60.0;
    }
    faults.sort_by(|a, b| a.0.total_cmp(&b.0));
    faults
}

/// What a run recorded.
pub struct Run {
    pub samples: Vec<sample::Sample>,
    /// Faults as they fell: when, what.
    pub marks: Vec<(f64, String)>,
    /// Processes that died on their own: what, and how.
    pub crashes: Vec<String>,
    /// Reloads done (each applies the other config), and those the daemon
    /// did not count applied within 10 s.
    pub reloads: u32,
    pub reloads_missed: Vec<String>,
    /// Samples that could not be taken: when, and why.
    pub gaps: Vec<String>,
    /// When the load stopped.
    pub stopped: f64,
    /// Each resource's least at rest, over 15 s after the drain: memory
    /// (anonymous), descriptors, threads.
    pub rest: Option<(u64, u64, u64)>,
    started: Instant,
    counters: sample::Counters,
}

impl Run {
    fn t(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The load, the faults as they fall, a sample every interval.
    fn load(
        &mut self,
        daemon: &mut Daemon,
        drivers: &mut Drivers,
        logs: &LogDisk,
        config: &Path,
        mut faults: Vec<(f64, Fault)>,
        length: Duration,
    ) -> Result<()> {
        let mut next_sample = 0.0;
        faults.reverse();
        while self.started.elapsed() < length {
            let t = self.t();
            if t >= next_sample {
                self.sample(daemon);
                next_sample = t + EVERY as f64;
            }
            while faults.last().is_some_and(|(at, _)| *at <= t) {
                let Some((_, fault)) = faults.pop() else { break };
                self.fault(fault, daemon, drivers, logs, config)?;
            }
            self.watch(daemon, drivers, true)?;
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(())
    }

    /// Puts one fault into effect, and marks it.
    fn fault(
        &mut self,
        f: Fault,
        daemon: &mut Daemon,
        drivers: &mut Drivers,
        logs: &LogDisk,
        config: &Path,
    ) -> Result<()> {
        let what = match &f {
            Fault::KillDaemon => {
                daemon.kill9();
                daemon.start()?;
                "daemon kill -9, restart".to_owned()
            }
            Fault::KillClient(role, id) => {
                drivers.kill9(role, *id);
                drivers.spawn(role, *id, daemon)?;
                format!("{role} {id} kill -9")
            }
            Fault::DiskFull(secs) => {
                logs.fill()?;
                std::thread::sleep(Duration::from_secs(*secs));
                logs.empty();
                format!("log disk full {secs} s")
            }
            Fault::Hang(n) => {
                drivers.spawn("hang", *n, daemon)?;
                "data-plane hang".to_owned()
            }
            Fault::Reload => {
                // The config rewritten as deployment tooling does, then SIGHUP.
                let mut before = reloads_applied(&daemon.control);
                self.reloads += 1;
                let tmp = config.with_extension("new");
                std::fs::write(&tmp, config_text(self.reloads))?;
                std::fs::rename(&tmp, config)?;
                daemon.signal(libc::SIGHUP);
                // Applied within 10 s (the load going on), or said why not.
                let deadline = Instant::now() + Duration::from_secs(10);
                loop {
                    let now = reloads_applied(&daemon.control);
                    if now.zip(before).is_some_and(|(n, b)| n > b) {
                        break;
                    }
                    // A scrape that failed before the signal: none missed yet,
                    // so the daemon's count now is the most it can be before.
                    before = before.or(now.map(|n| n - 1.0));
                    if Instant::now() > deadline {
                        let t = self.t();
                        self.reloads_missed.push(format!("{t:.0} s: applied {before:?} before, {now:?} 10 s after"));
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                "reload".to_owned()
            }
        };
        self.marks.push((self.t(), what));
        Ok(())
    }

    /// Notes a process that died on its own, and starts it again.
    fn watch(&mut self, daemon: &mut Daemon, drivers: &mut Drivers, respawn: bool) -> Result<()> {
        if daemon.exited() {
            self.crashes.push(format!("the daemon exited on its own at {:.0} s", self.t()));
            daemon.kill9();
            daemon.start()?;
        }
        for (role, id, status) in drivers.exited() {
            let ended_well = status.success() && (role == "hang" || !respawn);
            if !ended_well {
                self.crashes.push(format!(
                    "{role} {id} exited with {status} at {:.0} s (see driver-{role}-{id}.log)",
                    self.t()
                ));
                if respawn && role != "hang" {
                    // Not faster than once a second, should it crash again at once.
                    std::thread::sleep(Duration::from_secs(1));
                    drivers.spawn(role, id, daemon)?;
                }
            }
        }
        Ok(())
    }

    /// Stops the load, lets the readers finish and the unread windows pass
    /// (3 minutes at most), sampling on.
    fn drain(&mut self, daemon: &mut Daemon, drivers: &mut Drivers) -> Result<()> {
        std::fs::write(drivers.dir.join("stop"), "").context("asking the drivers to stop")?;
        self.stopped = self.t();
        self.marks.push((self.stopped, "load stopped".to_owned()));
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut next_sample = self.t();
        let mut held = usize::MAX;
        while Instant::now() < deadline {
            self.watch(daemon, drivers, false)?;
            let t = self.t();
            if t >= next_sample {
                if let Some(s) = self.sample(daemon) {
                    held = s.publications.values().sum::<u64>() as usize;
                }
                next_sample = t + EVERY as f64;
            }
            if drivers.running() == 0 && held == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        self.marks.push((self.t(), "drained".to_owned()));
        // At rest: each resource's least over 15 s (threads of tokio's
        // blocking pool linger 10 s after their last task).
        let mut rest: Option<(u64, u64, u64)> = None;
        for _ in 0..6 {
            std::thread::sleep(Duration::from_millis(2_500));
            if let Some(s) = self.sample(daemon) {
                let now = (s.rss_anon_kib, s.fds, s.threads);
                rest = Some(rest.map_or(now, |r| (r.0.min(now.0), r.1.min(now.1), r.2.min(now.2))));
            }
        }
        self.rest = rest;
        Ok(())
    }

    /// Takes a sample, or notes why it could not be taken.
    fn sample(&mut self, daemon: &Daemon) -> Option<&sample::Sample> {
        let t = self.t();
        match sample::take(daemon.pid(), &daemon.control, t, &mut self.counters) {
            Ok(s) => {
                self.samples.push(s);
                self.samples.last()
            }
            Err(e) => {
                self.gaps.push(format!("{t:.0} s: {e:#}"));
                None
            }
        }
    }
}
