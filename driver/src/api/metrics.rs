//! The daemon's counters, latency histograms and their exposition
//! (`/metrics`, OpenMetrics text built with `prometheus-client`; every
//! family keeps the name it had when the text was written by hand).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::header;
use axum::response::{IntoResponse, Response};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::store::{Phase, Store};

/// Counters the daemon exports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Refusals and failures by code.
    pub errors: Mutex<BTreeMap<String, u64>>,
    /// Payload bytes by path: host, host_fixed, dmabuf_fixed.
    pub bytes_host: AtomicU64,
    /// Payload bytes on `host_fixed`.
    pub bytes_host_fixed: AtomicU64,
    /// Payload bytes on `dmabuf_fixed`.
    pub bytes_dmabuf_fixed: AtomicU64,
    /// Control-plane requests handled.
    pub requests: AtomicU64,
    /// PREPARED publications aborted for going idle.
    pub reaped: AtomicU64,
    /// Observed verdicts by (path, kind): kind is native, fallback or unverifiable.
    pub verdicts: Mutex<BTreeMap<(String, String), u64>>,
    /// Times the slot accounting did not reconcile (each also logged).
    pub invariant_violations: AtomicU64,
    /// Latency histograms of steps and transfers.
    pub latencies: Latencies,
}

impl Metrics {
    /// Counts a probe verdict on `path`.
    pub fn verdict(&self, path: &str, v: &pdstor_probes::Verdict) {
        let kind = match v {
            pdstor_probes::Verdict::Native => "native",
            pdstor_probes::Verdict::Fallback(_) => "fallback",
            pdstor_probes::Verdict::Unverifiable(_) => "unverifiable",
        };
        *self.verdicts.lock().unwrap_or_else(|p| p.into_inner()).entry((path.into(), kind.into())).or_default() += 1;
    }

    /// Checks that every slot is accounted for once (`free + used + reserved
    /// == capacity`, from the allocator's and admission's own counts; debug
    /// builds also run every invariant of [`Store::check`], which walks
    /// every slot); a failure is logged and counted (and a bug: debug builds
    /// stop on it).
    pub fn reconcile(&self, store: &Store) {
        // A failed store's memory is ahead of its media (a step applied, its
        // commit failed) and it refuses every change: its counts need not
        // reconcile, and a restart rebuilds them from the journal.
        if store.failed().is_some() {
            return;
        }
        let checked = if cfg!(debug_assertions) { store.accounting() } else { store.reconcile() };
        if let Err(e) = checked {
            self.invariant_violations.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "slot accounting does not reconcile");
            debug_assert!(false, "slot accounting does not reconcile: {e}");
        }
    }

    /// Counts a refusal or failure of `code`.
    pub fn error(&self, code: &str) {
        *self.errors.lock().unwrap_or_else(|p| p.into_inner()).entry(code.into()).or_default() += 1;
    }
}

/// A family of histograms by one label set.
type Histograms = Family<Vec<(&'static str, String)>, Histogram, fn() -> Histogram>;

/// Latency buckets: 50 µs to ~1.6 s, doubling.
fn latency_buckets() -> Histogram {
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

/// The daemon's latency histograms, kept across scrapes.
#[derive(Debug)]
pub struct Latencies {
    /// Control-plane steps, by step (`prepare`, `claim`, … `metrics`).
    steps: Histograms,
    /// Data-plane transfers (one request's chunks), by op and payload path.
    transfers: Histograms,
}

impl Default for Latencies {
    fn default() -> Latencies {
        Latencies {
            steps: Family::new_with_constructor(latency_buckets),
            transfers: Family::new_with_constructor(latency_buckets),
        }
    }
}

impl Metrics {
    /// Observes how long a control-plane step took.
    pub fn step(&self, step: &str, took: std::time::Duration) {
        self.latencies.steps.get_or_create(&vec![("step", step.to_owned())]).observe(took.as_secs_f64());
    }

    /// Observes how long a step taken in a batch took (its series carries
    /// `via="batch"`, apart from the step's own route's).
    pub fn step_in_batch(&self, step: &str, took: std::time::Duration) {
        let labels = vec![("step", step.to_owned()), ("via", "batch".to_owned())];
        self.latencies.steps.get_or_create(&labels).observe(took.as_secs_f64());
    }

    /// Observes how long a data-plane transfer (`store` or `load`) on `path` took.
    pub fn transfer(&self, op: &str, path: &str, took: std::time::Duration) {
        let labels = vec![("op", op.to_owned()), ("path", path.to_owned())];
        self.latencies.transfers.get_or_create(&labels).observe(took.as_secs_f64());
    }
}

/// A registry being filled for one scrape.
struct Scrape(Registry);

/// A help text as the encoder wants it: it ends each with a period itself.
fn help(text: &str) -> &str {
    text.trim_end_matches('.')
}

impl Scrape {
    /// The daemon's own counters: connections, handshakes, reloads, log writes.
    fn process(&mut self) {
        self.counter(
            "pdstor_control_connections",
            "Control-plane connections accepted (clients keep theirs alive across requests).",
            super::listen::accepted_connections(),
        );
        self.counter(
            "pdstor_tls_handshakes_refused",
            "TLS handshakes that failed: a client certificate refused (unknown CA, revoked, expired) or a client that gave up.",
            super::listen::handshakes_refused(),
        );
        let (applied, failed) = super::reload::reloads();
        self.counters(
            "pdstor_reloads",
            "Reloads of the config and TLS files (SIGHUP or a file's change): applied, or failed and nothing changed.",
            [(vec![("result", "applied".to_owned())], applied), (vec![("result", "failed".to_owned())], failed)],
        );
        self.counter(
            "pdstor_log_write_failures",
            "Log writes that failed (standard error on a full disk, say): those lines were dropped.",
            super::log::failed_writes(),
        );
    }

    fn gauge(&mut self, name: &str, text: &str, v: u64) {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        self.0.register(name, help(text), g);
    }

    fn gauges<'a>(
        &mut self,
        name: &str,
        text: &str,
        label: &'static str,
        values: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
        let f = Family::<Vec<(&'static str, String)>, Gauge<i64>>::default();
        for (l, v) in values {
            f.get_or_create(&vec![(label, l.to_owned())]).set(i64::try_from(v).unwrap_or(i64::MAX));
        }
        self.0.register(name, help(text), f);
    }

    /// A counter: `name` without `_total`, which the encoding appends.
    fn counter(&mut self, name: &str, text: &str, v: u64) {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        self.0.register(name, help(text), c);
    }

    fn counters(
        &mut self,
        name: &str,
        text: &str,
        values: impl IntoIterator<Item = (Vec<(&'static str, String)>, u64)>,
    ) {
        let f = Family::<Vec<(&'static str, String)>, Counter<u64>>::default();
        for (labels, v) in values {
            f.get_or_create(&labels).inc_by(v);
        }
        self.0.register(name, help(text), f);
    }
}

/// The exposition (OpenMetrics text, built with `prometheus-client`).
pub(super) fn exposition(store: &Store, metrics: &Metrics) -> Response {
    let mut m = Scrape(Registry::default());
    let mut by_state: BTreeMap<&'static str, u64> =
        ["PREPARED", "READY", "CLAIMED", "ADOPTED", "RETAINED", "ABORTING"].into_iter().map(|k| (k, 0)).collect();
    for p in store.publications() {
        *by_state.entry(phase_name(p.phase)).or_default() += 1;
    }
    m.gauges("pdstor_publications", "Live publications by state.", "state", by_state);
    slot_gauges(&mut m, store);
    m.counter(
        "pdstor_invariant_violations",
        "Times the slot accounting did not reconcile after a step (each logged; a bug).",
        metrics.invariant_violations.load(Ordering::Relaxed),
    );
    m.counter(
        "pdstor_control_requests",
        "Protocol steps the control plane handled.",
        metrics.requests.load(Ordering::Relaxed),
    );
    m.process();
    let bytes = [
        ("host", &metrics.bytes_host),
        ("host_fixed", &metrics.bytes_host_fixed),
        ("dmabuf_fixed", &metrics.bytes_dmabuf_fixed),
    ];
    let by_path = bytes.map(|(p, n)| (vec![("path", p.to_owned())], n.load(Ordering::Relaxed)));
    m.counters("pdstor_payload_bytes", "Payload bytes moved, by path.", by_path);
    m.counter(
        "pdstor_dmabuf_cpu_accesses",
        "CPU accesses the daemon made to DMA-BUF memory (checksums), each bracketed by DMA_BUF_IOCTL_SYNC.",
        pdstor_engine::buffer::dmabuf::cpu_accesses(),
    );
    m.counter(
        "pdstor_prepared_reaped",
        "PREPARED publications aborted after --prepare-idle-timeout-ms with no store batch.",
        metrics.reaped.load(Ordering::Relaxed),
    );
    let errors: Vec<_> = lock(&metrics.errors).iter().map(|(c, n)| (vec![("code", c.clone())], *n)).collect();
    m.counters("pdstor_errors", "Refusals and failures by code.", errors);
    let verdicts: Vec<_> = lock(&metrics.verdicts)
        .iter()
        .map(|((path, kind), n)| (vec![("path", path.clone()), ("verdict", kind.clone())], *n))
        .collect();
    m.counters("pdstor_verdicts", "Observed payload provenance (pdstor serve --provenance).", verdicts);
    let st = store.stats();
    m.counter("pdstor_payload_chunks", "Payload chunks stored and loaded.", st.payload_chunks);
    m.counter(
        "pdstor_payload_commands",
        "Device commands the payload chunks went in (fewer where back-to-back small chunks were merged, serve --merge).",
        st.payload_commands,
    );
    m.counter(
        "pdstor_payload_submissions",
        "Submissions to the device the payload commands went in (fewer where requests of many publications, or of \
         several connections at once, were run together).",
        st.payload_submissions,
    );
    m.counter("pdstor_flushes", "Device flushes.", st.flushes);
    m.counter(
        "pdstor_commit_groups",
        "Group commits: journal records made durable together (one flush of the payload written since the last \
         commit, then the journal write with Force Unit Access).",
        st.commit_groups,
    );
    m.counter(
        "pdstor_flushes_elided",
        "Flushes a commit asked for and pdstor did not issue: the device has no volatile write cache, so a \
         completed write is durable already (the namespace's write_cache says where that was read).",
        st.flushes_elided,
    );
    m.gauge("pdstor_epoch", "Daemon epoch.", store.epoch());
    m.0.register(
        "pdstor_step_seconds",
        "Control-plane steps, from the request to the answer, by step; a step taken in a batch has via=\"batch\" and runs from its run's start to its commit",
        metrics.latencies.steps.clone(),
    );
    m.0.register(
        "pdstor_transfer_seconds",
        "Data-plane transfers (one request's chunks), from the request to the answer, by op and payload path",
        metrics.latencies.transfers.clone(),
    );
    let mut out = String::new();
    if let Err(e) = encode(&mut out, &m.0) {
        return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, format!("encoding the metrics failed: {e}\n"))
            .into_response();
    }
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], out).into_response()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the slots are (they reconcile: `free + used + reserved ==
/// capacity`), and admission's gauges and counters.
fn slot_gauges(m: &mut Scrape, store: &Store) {
    let a = store.accounting().unwrap_or_else(|_| store.accounting_unchecked());
    let st = store.stats();
    m.gauges(
        "pdstor_slots",
        "Data slots by use: free (a prepare can take it), used (owned by a publication), reserved (admitted but owned by no publication yet, or freed by a record not yet durable). free + used + reserved = capacity.",
        "kind",
        [("free", a.free), ("reserved", a.reserved), ("used", a.used)],
    );
    m.gauge("pdstor_slots_capacity", "Data slots in all.", a.capacity);
    m.gauge(
        "pdstor_slots_total_reserved",
        "Slots admission holds: used + reserved (LMCache's total_reserved).",
        a.total_reserved(),
    );
    m.gauge("pdstor_admission_waiting", "Prepares waiting for capacity.", a.waiting as u64);
    let (journal, half) = store.journal_usage();
    m.gauge(
        "pdstor_journal_bytes",
        "Bytes of journal records queued in the active journal half (a checkpoint keeps it under half the half).",
        journal,
    );
    m.gauge("pdstor_journal_half_bytes", "The size of one journal half.", half);
    let c = st.admission;
    for (name, help, v) in [
        ("admissions", "Prepares admitted (at once or after a wait).", c.admitted),
        ("waits", "Admissions that waited for capacity.", c.waits),
        ("timeouts", "Waiting prepares that gave up at their timeout.", c.timeouts),
        ("cancels", "Waiting prepares cancelled by request id or by their client going away.", c.cancelled),
    ] {
        m.counter(&format!("pdstor_admission_{name}"), help, v);
    }
    m.counter(
        "pdstor_protocol_violations",
        "Store batches that broke the protocol (the request was rolled back).",
        st.violations,
    );
    m.counter(
        "pdstor_rollbacks",
        "PREPARED publications rolled back (abort, cancel, violation, failed batch, reaper).",
        st.rollbacks,
    );
    m.counter(
        "pdstor_evicted",
        "READY publications nobody claimed, released to make room for a prepare (tenants that opted in).",
        st.evicted,
    );
    m.counter(
        "pdstor_unread_expired",
        "READY publications no reader claimed within their unread window (their writer's unread_release_ms, --unread-release-ms), released unread.",
        st.expired,
    );
}

/// A publication's phase as the API and `/metrics` name it.
pub(super) fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Prepared => "PREPARED",
        Phase::Ready => "READY",
        Phase::Claimed => "CLAIMED",
        Phase::Adopted => "ADOPTED",
        Phase::Retained => "RETAINED",
        Phase::Aborting => "ABORTING",
    }
}
