//! The daemon's counters and their Prometheus text exposition (`/metrics`).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::header;
use axum::response::{IntoResponse, Response};

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

/// Prometheus text exposition.
pub(super) fn exposition(store: &Store, metrics: &Metrics) -> Response {
    use std::fmt::Write;
    let st = store.stats();
    let mut by_state: BTreeMap<&'static str, u64> =
        ["PREPARED", "READY", "CLAIMED", "ADOPTED", "RETAINED", "ABORTING"].into_iter().map(|k| (k, 0)).collect();
    for p in store.publications() {
        *by_state.entry(phase_name(p.phase)).or_default() += 1;
    }
    let mut out = String::new();
    let _ = writeln!(out, "# HELP pdstor_publications Live publications by state.\n# TYPE pdstor_publications gauge");
    for (k, v) in &by_state {
        let _ = writeln!(out, "pdstor_publications{{state=\"{k}\"}} {v}");
    }
    slot_gauges(&mut out, store);
    let _ = writeln!(
        out,
        "# HELP pdstor_invariant_violations_total Times the slot accounting did not reconcile after a step (each logged; a bug).\n# TYPE pdstor_invariant_violations_total counter"
    );
    let _ = writeln!(out, "pdstor_invariant_violations_total {}", metrics.invariant_violations.load(Ordering::Relaxed));
    let _ = writeln!(
        out,
        "# HELP pdstor_control_requests_total Protocol steps the control plane handled.\n# TYPE pdstor_control_requests_total counter"
    );
    let _ = writeln!(out, "pdstor_control_requests_total {}", metrics.requests.load(Ordering::Relaxed));
    let _ = writeln!(
        out,
        "# HELP pdstor_control_connections_total Control-plane connections accepted (clients keep theirs alive across requests).\n# TYPE pdstor_control_connections_total counter"
    );
    let _ = writeln!(out, "pdstor_control_connections_total {}", super::listen::accepted_connections());
    let _ = writeln!(
        out,
        "# HELP pdstor_payload_bytes_total Payload bytes moved, by path.\n# TYPE pdstor_payload_bytes_total counter"
    );
    let _ = writeln!(out, "pdstor_payload_bytes_total{{path=\"host\"}} {}", metrics.bytes_host.load(Ordering::Relaxed));
    let _ = writeln!(
        out,
        "pdstor_payload_bytes_total{{path=\"host_fixed\"}} {}",
        metrics.bytes_host_fixed.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "pdstor_payload_bytes_total{{path=\"dmabuf_fixed\"}} {}",
        metrics.bytes_dmabuf_fixed.load(Ordering::Relaxed)
    );
    let _ = writeln!(
        out,
        "# HELP pdstor_dmabuf_cpu_accesses_total CPU accesses the daemon made to DMA-BUF memory (checksums), each bracketed by DMA_BUF_IOCTL_SYNC.\n# TYPE pdstor_dmabuf_cpu_accesses_total counter"
    );
    let _ = writeln!(out, "pdstor_dmabuf_cpu_accesses_total {}", crate::buffer::dmabuf::cpu_accesses());
    let _ = writeln!(
        out,
        "# HELP pdstor_prepared_reaped_total PREPARED publications aborted after --prepare-idle-timeout-ms with no store batch.\n# TYPE pdstor_prepared_reaped_total counter"
    );
    let _ = writeln!(out, "pdstor_prepared_reaped_total {}", metrics.reaped.load(Ordering::Relaxed));
    let _ =
        writeln!(out, "# HELP pdstor_errors_total Refusals and failures by code.\n# TYPE pdstor_errors_total counter");
    for (code, n) in metrics.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(out, "pdstor_errors_total{{code=\"{code}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP pdstor_verdicts_total Observed payload provenance (pdstor serve --provenance).\n# TYPE pdstor_verdicts_total counter"
    );
    for ((path, kind), n) in metrics.verdicts.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = writeln!(out, "pdstor_verdicts_total{{path=\"{path}\",verdict=\"{kind}\"}} {n}");
    }
    let _ = writeln!(
        out,
        "# HELP pdstor_payload_chunks_total Payload chunks stored and loaded.\n# TYPE pdstor_payload_chunks_total counter\npdstor_payload_chunks_total {}",
        st.payload_chunks
    );
    let _ = writeln!(
        out,
        "# HELP pdstor_payload_commands_total Device commands the payload chunks went in (fewer where back-to-back small chunks were merged, serve --merge).\n# TYPE pdstor_payload_commands_total counter\npdstor_payload_commands_total {}",
        st.payload_commands
    );
    let _ = writeln!(out, "# HELP pdstor_flushes_total Device flushes.\n# TYPE pdstor_flushes_total counter");
    let _ = writeln!(out, "pdstor_flushes_total {}", st.flushes);
    let _ =
        writeln!(out, "# HELP pdstor_epoch Daemon epoch.\n# TYPE pdstor_epoch gauge\npdstor_epoch {}", store.epoch());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// Where the slots are (they reconcile: `free + used + reserved ==
/// capacity`), and admission's gauges and counters.
fn slot_gauges(out: &mut String, store: &Store) {
    use std::fmt::Write;
    let a = store.accounting().unwrap_or_else(|_| store.accounting_unchecked());
    let st = store.stats();
    let _ = writeln!(
        out,
        "# HELP pdstor_slots Data slots by use: free (a prepare can take it), used (owned by a publication), reserved (admitted but owned by no publication yet, or freed by a record not yet durable). free + used + reserved = capacity.\n# TYPE pdstor_slots gauge"
    );
    let _ = writeln!(out, "pdstor_slots{{kind=\"free\"}} {}", a.free);
    let _ = writeln!(out, "pdstor_slots{{kind=\"reserved\"}} {}", a.reserved);
    let _ = writeln!(out, "pdstor_slots{{kind=\"used\"}} {}", a.used);
    let _ = writeln!(out, "# HELP pdstor_slots_capacity Data slots in all.\n# TYPE pdstor_slots_capacity gauge");
    let _ = writeln!(out, "pdstor_slots_capacity {}", a.capacity);
    let _ = writeln!(
        out,
        "# HELP pdstor_slots_total_reserved Slots admission holds: used + reserved (LMCache's total_reserved).\n# TYPE pdstor_slots_total_reserved gauge"
    );
    let _ = writeln!(out, "pdstor_slots_total_reserved {}", a.total_reserved());
    let _ = writeln!(
        out,
        "# HELP pdstor_admission_waiting Prepares waiting for capacity.\n# TYPE pdstor_admission_waiting gauge"
    );
    let _ = writeln!(out, "pdstor_admission_waiting {}", a.waiting);
    let c = st.admission;
    for (name, help, v) in [
        ("admissions", "Prepares admitted (at once or after a wait)", c.admitted),
        ("waits", "Admissions that waited for capacity", c.waits),
        ("timeouts", "Waiting prepares that gave up at their timeout", c.timeouts),
        ("cancels", "Waiting prepares cancelled by request id or by their client going away", c.cancelled),
    ] {
        let _ =
            writeln!(out, "# HELP pdstor_admission_{name}_total {help}.\n# TYPE pdstor_admission_{name}_total counter");
        let _ = writeln!(out, "pdstor_admission_{name}_total {v}");
    }
    let _ = writeln!(
        out,
        "# HELP pdstor_protocol_violations_total Store batches that broke the protocol (the request was rolled back).\n# TYPE pdstor_protocol_violations_total counter"
    );
    let _ = writeln!(out, "pdstor_protocol_violations_total {}", st.violations);
    let _ = writeln!(
        out,
        "# HELP pdstor_rollbacks_total PREPARED publications rolled back (abort, cancel, violation, failed batch, reaper).\n# TYPE pdstor_rollbacks_total counter"
    );
    let _ = writeln!(out, "pdstor_rollbacks_total {}", st.rollbacks);
    let _ = writeln!(
        out,
        "# HELP pdstor_evicted_total READY publications nobody claimed, released to make room for a prepare (tenants that opted in).\n# TYPE pdstor_evicted_total counter"
    );
    let _ = writeln!(out, "pdstor_evicted_total {}", st.evicted);
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
