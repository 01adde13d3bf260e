//! `pdstor qualify`: the model-oracle profile (DESIGN §9, steps 4–5). A
//! successful decode does not prove the KV cache was restored — a miss may
//! silently recompute — so this compares continuations, token for token and
//! by chosen-token log-probability, and keeps a causal timeline of all of it.
//!
//! For each case (three prompt groups: shorter than one chunk, an exact chunk
//! multiple, a partial last chunk; batches of 1/4/8 requests; output budgets
//! 48/32/24 by group) it runs the no-cache oracle (f32, from scratch), the
//! monolithic and split prefill controls (the KV through bf16 in memory), a
//! **cold restore** (a reader *process* that never saw the prompt adopts,
//! loads through `pdstor serve`, appends the producer token and decodes in a
//! fresh model) and a **warm repeat** (the same restore again). Then the fault
//! controls: stop handling, cancellation mid-restore, a failed load of a
//! corrupted chunk, mismatched receipts, a duplicate ACK, an unread release and
//! pressure beyond capacity. Output: `qualify.json`, `qualify.md`,
//! `timeline.jsonl` (checked with the path used), `timeline.svg`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use crate::model::{self, Config, Continuation, Model, kv};
use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;
use pdstor_client::timeline::Event;
use pdstor_client::timeline::Timeline;
use pdstor_client::timeline::tokens_digest;
use pdstor_client::wire::Published;
use pdstor_client::{BufferSpec, Client, Exporter, Writer};
use pdstor_engine::io::PayloadPath;

mod controls;
mod reader;

pub use reader::{ReaderJob, ReaderMode, ReaderOutcome, ReaderRequest, reader_main};

/// The chosen-token log-probability tolerance (bf16 KV must stay within it).
pub const LOGPROB_TOLERANCE: f32 = 0.02;
const BUDGETS: [usize; 3] = [48, 32, 24];

/// What `pdstor qualify` runs.
#[derive(Debug, Clone)]
pub struct QualifyConfig {
    /// The scratch target (formatted by qualify).
    pub target: PathBuf,
    /// Size to create a missing file target with.
    pub size: u64,
    /// Where the reports and the timeline go.
    pub out: PathBuf,
    /// Tokens per stored KV chunk.
    pub chunk_tokens: usize,
    /// Batch sizes (the full profile: 1, 4, 8).
    pub batches: Vec<usize>,
    /// Output budgets scale (1.0: 48/32/24).
    pub budget_scale: f32,
    /// The payload path the buffers are registered for.
    pub path: PayloadPath,
    /// Attach the provenance probes to the daemon.
    pub provenance: bool,
    /// Where to corrupt a chunk for the failed-load control (default: the
    /// target; give the block device of a `/dev/ngXnY` target).
    pub corrupt_via: Option<PathBuf>,
    /// The deterministic model.
    pub model: Config,
}

/// One case: a prompt group at one batch size, restored cold and warm.
#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// KV chunks per request.
    pub chunks: usize,
    /// Requests in the batch.
    pub batch: usize,
    /// Output tokens per request.
    pub budget: usize,
    /// Continuations compared against the oracle (mono, split, cold, warm per request).
    pub compared: usize,
    /// Every restored continuation equals the oracle's, token for token.
    pub identical_tokens: bool,
    /// The largest chosen-token log-probability difference from the oracle.
    pub max_logprob_delta: f32,
    /// The case passed.
    pub ok: bool,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// One fault control and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct ControlResult {
    /// The control's name.
    pub name: &'static str,
    /// It held.
    pub ok: bool,
    /// What it saw, or why it did not hold.
    pub detail: String,
}

/// Everything `pdstor qualify` found (`qualify.json`).
#[derive(Debug, Clone, Serialize)]
pub struct QualifyReport {
    /// The model.
    pub model: Config,
    /// Tokens per stored KV chunk.
    pub chunk_tokens: usize,
    /// The payload path.
    pub path: PayloadPath,
    /// The target.
    pub target: PathBuf,
    /// Every case.
    pub cases: Vec<CaseResult>,
    /// Every fault control.
    pub controls: Vec<ControlResult>,
    /// The largest log-probability difference over all cases.
    pub max_logprob_delta: f32,
    /// The tolerance it must stay within.
    pub tolerance: f32,
    /// The checked timeline.
    pub timeline: crate::timeline::check::CheckReport,
    /// Wall time.
    pub seconds: f64,
    /// Every case and control passed and the timeline holds.
    pub ok: bool,
}

impl QualifyReport {
    /// The report as Markdown (`qualify.md`).
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "# pdstor qualify\n\nmodel {:?}, chunk {} tokens, path {}, target {}\n\n| case | prompt tokens | chunks | batch | budget | continuations | identical | max Δlogprob | result |\n|---|---|---|---|---|---|---|---|---|\n",
            self.model,
            self.chunk_tokens,
            self.path,
            self.target.display()
        );
        for c in &self.cases {
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.6} | {} |\n",
                c.name,
                c.prompt_tokens,
                c.chunks,
                c.batch,
                c.budget,
                c.compared,
                if c.identical_tokens { "yes" } else { "**no**" },
                c.max_logprob_delta,
                if c.ok { "pass".to_string() } else { format!("**FAIL** {}", c.error.as_deref().unwrap_or("")) }
            );
        }
        s += "\n| control | result | detail |\n|---|---|---|\n";
        for c in &self.controls {
            s += &format!("| {} | {} | {} |\n", c.name, if c.ok { "pass" } else { "**FAIL**" }, c.detail);
        }
        s += &format!(
            "\nmax chosen-token log-probability delta {:.6} (tolerance {}); timeline: {} lines, {} publications, {} acknowledged, {} violations; {:.1} s\n",
            self.max_logprob_delta,
            self.tolerance,
            self.timeline.lines,
            self.timeline.publications,
            self.timeline.acked,
            self.timeline.violations.len(),
            self.seconds
        );
        let shown = 20;
        for v in self.timeline.violations.iter().take(shown) {
            s += &format!("- {v}\n");
        }
        if self.timeline.violations.len() > shown {
            s += &format!("- … and {} more (qualify.json has them all)\n", self.timeline.violations.len() - shown);
        }
        s
    }
}

/// The buffer memory a path takes: a udmabuf for `dmabuf_fixed` (its DMA-BUF
/// moves the bytes; its memfd is how the model reads and writes them), a
/// memfd otherwise.
pub(crate) fn exporter_for(path: pdstor_engine::io::PayloadPath) -> Exporter {
    match path {
        pdstor_engine::io::PayloadPath::DmabufFixed => Exporter::Udmabuf,
        _ => Exporter::Memfd,
    }
}

struct Daemon {
    child: Child,
    server: String,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_daemon(cfg: &QualifyConfig, timeline: &Path) -> anyhow::Result<Daemon> {
    let exe = std::env::current_exe().context("locating the pdstor binary")?;
    let socket = cfg.out.join("data.sock");
    let _ = std::fs::remove_file(&socket);
    let control = cfg.out.join("control.sock");
    let listen = format!("unix:{}", control.display());
    let log = pdstor_client::private::open(&cfg.out.join("serve.log"), false)?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve").arg("--target").arg(&cfg.target).args(["--listen", &listen]).arg("--data-socket").arg(&socket);
    cmd.arg("--timeline").arg(timeline);
    if cfg.provenance {
        cmd.args(["--provenance", "--require-native"]);
    }
    let child = cmd.stdout(Stdio::null()).stderr(log).spawn().context("starting pdstor serve")?;
    let d = Daemon { child, server: listen, socket };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&d.socket).is_err() || Client::new(&d.server).healthz().is_err() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(cfg.out.join("serve.log")).unwrap_or_default();
            bail!("pdstor serve did not come up: {log}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(d)
}

/// A deterministic prompt of `len` byte tokens for request `n`.
fn prompt(len: usize, n: usize) -> Vec<u32> {
    const TEXT: &str = "prefill computes the prompt's KV cache; decode restores it from NVMe and continues. \
                        the receipt binds the reader, the lease never frees bytes by timeout alone. ";
    TEXT.bytes().cycle().skip(n * 37 % TEXT.len()).take(len).map(u32::from).collect()
}

/// One request's writer-side work and its in-process references.
struct Prepared {
    req_id: String,
    chunks: Vec<Vec<u8>>,
    first: u32,
    first_logprob: f32,
    oracle: Continuation,
    controls: Vec<(&'static str, Continuation)>,
}

fn compare(oracle: &Continuation, got: &Continuation) -> Result<f32, String> {
    if got.tokens != oracle.tokens {
        let at = got.tokens.iter().zip(&oracle.tokens).position(|(a, b)| a != b).unwrap_or(got.tokens.len());
        return Err(format!(
            "tokens differ at position {at} ({} vs the oracle's {} tokens)",
            got.tokens.len(),
            oracle.tokens.len()
        ));
    }
    Ok(got.logprobs.iter().zip(&oracle.logprobs).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max))
}

struct Run<'a> {
    cfg: &'a QualifyConfig,
    model: Arc<Model>,
    daemon: &'a Daemon,
    layout: Layout,
    timeline_path: PathBuf,
    writer_tl: Arc<Timeline>,
    oracle_tl: Timeline,
    next_reader: usize,
}

impl Run<'_> {
    fn client(&self) -> Client {
        Client::new(&self.daemon.server)
    }

    /// Oracle, controls and the writer's chunks for one prompt.
    fn prepare(&self, req_id: String, prompt: &[u32], budget: usize, stop: Option<u32>) -> Prepared {
        let m = &self.model;
        let oracle = m.generate(prompt, budget, stop);
        let mut e = Event::new("oracle").req(&req_id);
        e.digest = Some(tokens_digest(&oracle.tokens));
        e.tokens = Some(oracle.tokens.clone());
        self.oracle_tl.emit(e);
        let mut controls = Vec::new();
        for (name, chunk) in [("monolithic", 0), ("split", self.cfg.chunk_tokens)] {
            let (cache, logits) = m.prefill(prompt, chunk);
            let first = model::argmax(&logits);
            let mut q = kv::quantize(&cache);
            controls.push((name, m.decode(&mut q, first, model::logprob(&logits, first), budget, stop)));
        }
        // The writer prefills in chunks, as a chunked-prefill engine does.
        let (cache, logits) = m.prefill(prompt, self.cfg.chunk_tokens);
        let first = model::argmax(&logits);
        Prepared {
            req_id,
            chunks: kv::encode(&cache, m.config(), self.cfg.chunk_tokens),
            first,
            first_logprob: model::logprob(&logits, first),
            oracle,
            controls,
        }
    }

    /// Stores and publishes each request (concurrently, one writer each).
    fn publish_all(&self, reqs: &[Prepared]) -> anyhow::Result<Vec<Published>> {
        let chunk = kv::chunk_bytes(self.model.config(), self.cfg.chunk_tokens) as u64;
        let spec = BufferSpec { exporter: exporter_for(self.cfg.path), path: self.cfg.path };
        std::thread::scope(|s| {
            let handles: Vec<_> = reqs
                .iter()
                .map(|r| {
                    let tl = self.writer_tl.clone();
                    s.spawn(move || -> anyhow::Result<Published> {
                        let mut w = Writer::with_buffer(
                            &self.daemon.server,
                            &self.daemon.socket,
                            chunk,
                            r.chunks.len() as u32,
                            spec,
                        )?;
                        let payload: Vec<u8> = r.chunks.concat();
                        let p = w.put(&r.req_id, &self.layout, &payload, 4, Some(r.first))?;
                        tl.emit(
                            Event::new("publish")
                                .req(&r.req_id)
                                .publication(p.receipt.publication)
                                .receipt(&p.receipt.signature),
                        );
                        Ok(p)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a writer thread panicked"))?).collect()
        })
    }

    fn claim(&self, ready: &Receipt, session: &str) -> anyhow::Result<Receipt> {
        let c = self.client().claim(ready, &format!("decode-{session}"), session, 600_000)?;
        self.writer_tl.emit(Event::new("claim").req(&c.req_id).publication(c.publication).receipt(&c.signature));
        Ok(c)
    }

    /// Runs one reader process over `requests`.
    fn reader(&mut self, requests: Vec<ReaderRequest>) -> anyhow::Result<Vec<ReaderOutcome>> {
        self.next_reader += 1;
        let job = ReaderJob {
            server: self.daemon.server.clone(),
            data_socket: self.daemon.socket.clone(),
            timeline: self.timeline_path.clone(),
            node: format!("reader-{}", self.next_reader),
            model: *self.model.config(),
            chunk_tokens: self.cfg.chunk_tokens,
            path: self.cfg.path,
            requests,
        };
        let file = self.cfg.out.join(format!("reader-{}.json", self.next_reader));
        pdstor_client::private::write(&file, serde_json::to_vec(&job)?)?;
        let exe = std::env::current_exe()?;
        let out = Command::new(exe).arg("qualify-reader").arg("--job").arg(&file).output()?;
        if !out.status.success() {
            bail!("the reader process failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
        }
        serde_json::from_slice(&out.stdout).context("parsing the reader's results")
    }

    fn case(&mut self, group: usize, batch: usize) -> CaseResult {
        let t = self.cfg.chunk_tokens;
        let len = [t / 2 + 1, 2 * t, 2 * t + t / 2][group];
        let budget = ((BUDGETS[group] as f32 * self.cfg.budget_scale) as usize).max(2);
        let name = format!("{}-b{batch}", ["short", "exact", "partial"][group]);
        let mut r = CaseResult {
            name: name.clone(),
            prompt_tokens: len,
            chunks: len.div_ceil(t),
            batch,
            budget,
            compared: 0,
            identical_tokens: true,
            max_logprob_delta: 0.0,
            ok: false,
            error: None,
        };
        let outcome = (|| -> anyhow::Result<()> {
            let reqs: Vec<Prepared> = (0..batch)
                .map(|n| self.prepare(format!("{name}-{n}"), &prompt(len, group * 100 + batch * 10 + n), budget, None))
                .collect();
            let ready = self.publish_all(&reqs)?;
            let mut jobs = Vec::new();
            for (p, rd) in reqs.iter().zip(&ready) {
                jobs.push(ReaderRequest {
                    req_id: p.req_id.clone(),
                    claim: self.claim(&rd.receipt, &name)?,
                    layout: self.layout.clone(),
                    budget,
                    stop: None,
                    first_logprob: p.first_logprob,
                    mode: ReaderMode::Restore,
                });
            }
            let outcomes = self.reader(jobs)?;
            for (p, o) in reqs.iter().zip(&outcomes) {
                let mut runs: Vec<(&str, &Continuation)> = p.controls.iter().map(|(n, c)| (*n, c)).collect();
                let (cold, warm) = (o.cold.as_ref().context("no cold restore")?, o.warm.as_ref().context("no warm")?);
                runs.push(("cold restore", cold));
                runs.push(("warm repeat", warm));
                for (what, c) in runs {
                    r.compared += 1;
                    match compare(&p.oracle, c) {
                        Ok(d) => r.max_logprob_delta = r.max_logprob_delta.max(d),
                        Err(e) => {
                            r.identical_tokens = false;
                            bail!("{}: {what}: {e}", p.req_id);
                        }
                    }
                }
            }
            if r.max_logprob_delta > LOGPROB_TOLERANCE {
                bail!("chosen-token log-probability delta {} exceeds {LOGPROB_TOLERANCE}", r.max_logprob_delta);
            }
            Ok(())
        })();
        match outcome {
            Ok(()) => r.ok = true,
            Err(e) => r.error = Some(format!("{e:#}")),
        }
        r
    }

    fn one(&mut self, name: &str, budget: usize, stop: Option<u32>) -> anyhow::Result<(Prepared, Published)> {
        let len = 2 * self.cfg.chunk_tokens + self.cfg.chunk_tokens / 2;
        let p = self.prepare(name.into(), &prompt(len, 900), budget, stop);
        let published = self.publish_all(std::slice::from_ref(&p))?.remove(0);
        Ok((p, published))
    }

    fn restore(
        &mut self,
        p: &Prepared,
        claim: Receipt,
        budget: usize,
        stop: Option<u32>,
        mode: ReaderMode,
    ) -> anyhow::Result<ReaderOutcome> {
        let mut o = self.reader(vec![ReaderRequest {
            req_id: p.req_id.clone(),
            claim,
            layout: self.layout.clone(),
            budget,
            stop,
            first_logprob: p.first_logprob,
            mode,
        }])?;
        o.pop().context("the reader returned nothing")
    }
}

/// Runs the whole profile. Returns the report (also written under `out`).
pub fn run(cfg: &QualifyConfig) -> anyhow::Result<QualifyReport> {
    let started = Instant::now();
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    if cfg.chunk_tokens < 2 {
        bail!("--chunk-tokens must be at least 2");
    }
    let chunk = kv::chunk_bytes(&cfg.model, cfg.chunk_tokens) as u64;
    let create = (!cfg.target.exists()).then_some(cfg.size);
    pdstor_daemon::store::format(
        &cfg.target,
        &pdstor_daemon::store::FormatOptions {
            slot_size: chunk,
            journal_half: 1 << 20,
            force: true,
            create_len: create,
        },
    )?;
    let timeline_path = cfg.out.join("timeline.jsonl");
    let _ = std::fs::remove_file(&timeline_path);
    let daemon = start_daemon(cfg, &timeline_path)?;
    let mut run = Run {
        cfg,
        model: Arc::new(Model::new(cfg.model)),
        daemon: &daemon,
        layout: kv::layout(&cfg.model, cfg.chunk_tokens),
        writer_tl: Arc::new(Timeline::open(&timeline_path, "writer")?),
        oracle_tl: Timeline::open(&timeline_path, "oracle")?,
        timeline_path: timeline_path.clone(),
        next_reader: 0,
    };
    let mut cases = Vec::new();
    for group in 0..3 {
        for &batch in &cfg.batches {
            let c = run.case(group, batch);
            eprintln!(
                "qualify: {:<12} {} ({} continuations, max Δlogprob {:.6})",
                c.name,
                if c.ok { "pass" } else { "FAIL" },
                c.compared,
                c.max_logprob_delta
            );
            cases.push(c);
        }
    }
    let controls = run.controls();
    for c in &controls {
        eprintln!("qualify: {:<20} {} {}", c.name, if c.ok { "pass" } else { "FAIL" }, c.detail);
    }
    drop(run);
    drop(daemon);
    let lines = pdstor_client::timeline::read(&timeline_path)?;
    let check = crate::timeline::check::check(&lines, cfg.path);
    let events: Vec<Event> = lines.into_iter().filter_map(|(_, e)| e.ok()).collect();
    std::fs::write(cfg.out.join("timeline.svg"), crate::timeline::render::render(&events, "pdstor qualify"))?;
    let max = cases.iter().map(|c| c.max_logprob_delta).fold(0.0, f32::max);
    let report = QualifyReport {
        model: cfg.model,
        chunk_tokens: cfg.chunk_tokens,
        path: cfg.path,
        target: cfg.target.clone(),
        ok: cases.iter().all(|c| c.ok) && controls.iter().all(|c| c.ok) && check.ok(),
        cases,
        controls,
        max_logprob_delta: max,
        tolerance: LOGPROB_TOLERANCE,
        timeline: check,
        seconds: started.elapsed().as_secs_f64(),
    };
    std::fs::write(cfg.out.join("qualify.json"), serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(cfg.out.join("qualify.md"), report.markdown())?;
    Ok(report)
}
