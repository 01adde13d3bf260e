//! The HTTP control plane (axum): one endpoint per protocol step of DESIGN §4,
//! JSON in and out, every refusal as `{status, code, field, message}` with the
//! matching HTTP status. Store work runs on blocking threads. Also `/healthz`,
//! Prometheus `/metrics`, and the OpenAPI document at `/openapi.json`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::Extension;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::from_protocol;
use super::listing;
use super::metrics::{Metrics, exposition};
use super::steps::{Answer, Told, names, run_batch, take};
use super::wire::*;
use crate::admission::CancelToken;
use crate::protocol::identity::{Caller, Role};
use crate::protocol::service::{ProtocolError, Service};
use pdstor_client::code::RefusalCode;
use pdstor_client::wire::Prepared;

/// What every control-plane handler shares.
pub struct AppState {
    /// The protocol over the store.
    pub service: Arc<Service>,
    /// The daemon's counters.
    pub metrics: Arc<Metrics>,
    /// Whether the provenance probes are attached (`serve --provenance`).
    pub provenance: bool,
    /// The limits the daemon enforces.
    pub limits: super::Limits,
    /// `prepare` requests being handled now (admitted or waiting).
    pub prepares: std::sync::atomic::AtomicUsize,
}

/// Liveness: 200 while the daemon can do its job; 503 once the store has
/// failed, since only a restart (replaying the journal) recovers it, or
/// when its target is no longer at its path
/// ([`Store::target_gone`](crate::store::Store::target_gone)).
async fn healthz(State(s): State<Shared>) -> Response {
    let store = s.service.store();
    if let Some(why) = store.target_gone() {
        return json_response(StatusCode::SERVICE_UNAVAILABLE, &ErrorBody::new(RefusalCode::TargetGone, "", why));
    }
    match store.failed() {
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(why) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &ErrorBody::new(
                RefusalCode::StoreFailed,
                "",
                format!("the store failed ({why}) and refuses every change: restart the daemon"),
            ),
        ),
    }
}

/// Readiness: 200 with the facts while the store accepts changes with
/// journal headroom; 503 in the JSON error shape, saying why, otherwise.
async fn readyz(State(s): State<Shared>) -> Response {
    let store = s.service.store();
    let (used, half) = store.journal_usage();
    if let Some(why) = store.target_gone() {
        return json_response(StatusCode::SERVICE_UNAVAILABLE, &ErrorBody::new(RefusalCode::TargetGone, "", why));
    }
    let why = match store.failed() {
        Some(f) => Some(format!("the store failed ({f}) and refuses every change")),
        None if used > half / 4 * 3 => Some(format!("the journal half is {used} of {half} bytes full")),
        None => None,
    };
    match why {
        None => json_response(
            StatusCode::OK,
            &Readiness {
                ready: true,
                journal_used: used,
                journal_half: half,
                epoch: store.epoch(),
                provenance: if s.provenance { ProbesState::Attached } else { ProbesState::Off },
            },
        ),
        Some(message) => {
            json_response(StatusCode::SERVICE_UNAVAILABLE, &ErrorBody::new(RefusalCode::DaemonNotReady, "", message))
        }
    }
}

pub(super) type Shared = Arc<AppState>;

/// One of the `max_prepares` places; given back when dropped.
struct PrepareSlot(Shared);

impl PrepareSlot {
    fn take(s: &Shared) -> Option<PrepareSlot> {
        let was = s.prepares.fetch_add(1, Ordering::SeqCst);
        let slot = PrepareSlot(s.clone());
        (was < s.limits.max_prepares).then_some(slot)
    }
}

impl Drop for PrepareSlot {
    fn drop(&mut self) {
        self.0.prepares.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Every 4xx/5xx leaves in the same JSON shape, including those axum makes
/// itself (unknown route, wrong method, an unreadable body).
async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json =
        resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if status.as_u16() < 400 || is_json {
        return resp;
    }
    let text = axum::body::to_bytes(resp.into_body(), 64 << 10)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let code = match status.as_u16() {
        404 => RefusalCode::NotFound,
        405 => RefusalCode::MethodNotAllowed,
        408 => RefusalCode::Timeout,
        413 => RefusalCode::BodyTooLarge,
        415 => RefusalCode::UnsupportedMediaType,
        s if s >= 500 => RefusalCode::Internal,
        _ => RefusalCode::BadRequest,
    };
    let message = if text.is_empty() { status.canonical_reason().unwrap_or("error").to_owned() } else { text };
    // The status is the one axum chose; the code names its class.
    json_response(status, &ErrorBody { status: status.as_u16(), ..ErrorBody::new(code, "", message) })
}

pub(super) fn json_response<T: Serialize>(status: StatusCode, v: &T) -> Response {
    let body = serde_json::to_vec(v).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub(super) fn error_response(state: &AppState, e: ErrorBody) -> Response {
    state.metrics.error(&e.code);
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &e)
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ErrorBody> {
    serde_json::from_slice(body).map_err(|e| {
        ErrorBody::new(RefusalCode::BadRequest, "body", format!("request body is not the expected JSON: {e}"))
    })
}

/// What a refused request was about, read leniently from its body (a
/// `publication` or `req_id` field, or those of the receipt it carries), so
/// the timeline's refusal names the publication it refused.
#[derive(Debug, Default, serde::Deserialize)]
struct Names {
    publication: Option<u64>,
    req_id: Option<String>,
    receipt: Option<ReceiptNames>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct ReceiptNames {
    publication: Option<u64>,
    req_id: Option<String>,
}

impl Names {
    fn of(body: &[u8]) -> Names {
        let n: Names = serde_json::from_slice(body).unwrap_or_default();
        let r = n.receipt.unwrap_or_default();
        Names { publication: n.publication.or(r.publication), req_id: n.req_id.or(r.req_id), receipt: None }
    }
}

/// Reads a request body within the size and time limits.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ErrorBody> {
    let limit = state.limits.max_body_bytes;
    match tokio::time::timeout(state.limits.body_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(ErrorBody::new(
            RefusalCode::BodyTooLarge,
            "body",
            format!("the request body could not be read within {limit} bytes: {e}"),
        )),
        Err(_) => Err(ErrorBody::new(
            RefusalCode::BodyTimeout,
            "body",
            format!("the request body did not arrive within {} ms", state.limits.body_timeout.as_millis()),
        )),
    }
}

/// Counts a control-plane request, reads its body within the limits and
/// parses it; or the refusal to answer.
async fn read_request<Req: DeserializeOwned>(state: &AppState, body: Body) -> Result<(Bytes, Req), Response> {
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let body = match read_body(state, body).await {
        Ok(b) => b,
        Err(e) => {
            // The rest of the body is never read, so this connection cannot
            // carry another request: say so, or a pooling client reuses it.
            let mut resp = error_response(state, e);
            resp.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            return Err(resp);
        }
    };
    match parse(&body) {
        Ok(r) => Ok((body, r)),
        Err(e) => Err(error_response(state, e)),
    }
}

/// Reads and parses the body, runs `f` for `who` on a blocking thread, and
/// maps the outcome. A refusal is recorded on the timeline with its caller.
async fn step<Req, Resp, F>(state: Shared, who: Caller, body: Body, f: F) -> Response
where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: FnOnce(&Service, &Caller, Req) -> Result<Resp, ProtocolError> + Send + 'static,
{
    let (body, req): (Bytes, Req) = match read_request(&state, body).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let (service, metrics, caller) = (state.service.clone(), state.metrics.clone(), who.clone());
    let stepped = tokio::task::spawn_blocking(move || {
        let r = f(&service, &caller, req);
        // Every step leaves every slot accounted for exactly once.
        metrics.reconcile(service.store());
        r
    });
    match stepped.await {
        Ok(Ok(resp)) => json_response(StatusCode::OK, &resp),
        Ok(Err(e)) => {
            let refusal = from_protocol(&e);
            // Only a refusal needs to know what it was about: the body is
            // read a second time here, never on the way to a step.
            let names = Names::of(&body);
            note_refusal(&state.service, &who, names.publication, names.req_id, &refusal);
            error_response(&state, refusal)
        }
        Err(join) => {
            error_response(&state, ErrorBody::new(RefusalCode::Internal, "", format!("handler panicked: {join}")))
        }
    }
}

/// A refused step, seen: a refusal for who the caller is is logged, and every
/// refusal is a `refused` event on the timeline with what it was about.
pub(super) fn note_refusal(
    service: &Service,
    who: &Caller,
    publication: Option<u64>,
    req_id: Option<String>,
    refusal: &ErrorBody,
) {
    if RefusalCode::parse(&refusal.code).is_some_and(|c| c.is_identity()) {
        tracing::warn!(by = %who.audit(), code = %refusal.code, message = %refusal.message, "refused for who the caller is");
    }
    if let Some(timeline) = service.timeline() {
        let mut e = pdstor_client::timeline::Event::new("refused")
            .detail(format!("{} ({}): {}", refusal.code, refusal.field, refusal.message))
            .by(who.audit());
        e.publication = publication;
        e.req_id = req_id;
        timeline.emit(e);
    }
}

/// Where the prepares of one request (a `prepare`, or a batch's) handled
/// on a blocking thread stand, shared with the handler's future. When the
/// client goes away, hyper drops that future; its [`Abandon`] guard then
/// cancels a prepare still waiting for capacity (and any after it), and
/// orphans each publication whose answer will never be delivered (the reaper
/// rolls it back after `--prepare-orphan-grace-ms` unless a batch comes).
#[derive(Debug, Default)]
pub(super) struct PrepareWatch {
    state: Mutex<Watch>,
    pub(super) token: CancelToken,
}

#[derive(Debug)]
enum Watch {
    /// Still to be answered: each publication prepared so far, and its request.
    Running(Vec<(u64, String)>),
    /// The handler's future was dropped while the prepares ran.
    Abandoned,
}

impl Default for Watch {
    fn default() -> Watch {
        Watch::Running(Vec::new())
    }
}

impl PrepareWatch {
    fn lock(&self) -> std::sync::MutexGuard<'_, Watch> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called on the blocking thread as a prepare makes a publication.
    pub(super) fn prepared(&self, service: &Service, req_id: &str, p: &Prepared) {
        match &mut *self.lock() {
            // Nobody will read this answer: give the publication the grace.
            Watch::Abandoned => service.orphan(p.publication, req_id),
            Watch::Running(made) => {
                // Not idle while the rest of its batch is prepared.
                service.store().answering(p.publication);
                made.push((p.publication, req_id.to_owned()));
            }
        }
    }
}

/// Dropped with the handler's future; `delivered` once its answer is built.
pub(super) struct Abandon {
    pub(super) watch: Arc<PrepareWatch>,
    pub(super) service: Arc<Service>,
    pub(super) delivered: bool,
}

impl Drop for Abandon {
    fn drop(&mut self) {
        let mut w = self.watch.lock();
        if self.delivered {
            // Each publication's idle clock starts as its writer gets the answer.
            if let Watch::Running(made) = &*w {
                for (publication, _) in made {
                    self.service.store().answered(*publication);
                }
            }
            return;
        }
        if let Watch::Running(made) = std::mem::replace(&mut *w, Watch::Abandoned) {
            self.watch.token.cancel();
            drop(w);
            self.service.store().wake_waiters();
            for (publication, req) in made {
                self.service.orphan(publication, &req);
            }
        }
    }
}

/// `POST /storage-pd/prepare`. Bounded: each prepare may wait for capacity
/// on a blocking thread, and those threads serve every other step too. A
/// client that goes away while it waits cancels its wait.
async fn prepare(State(s): State<Shared>, Extension(who): Extension<Caller>, b: Body) -> Response {
    let Some(_slot) = PrepareSlot::take(&s) else {
        return error_response(&s, too_many_prepares(&s));
    };
    let watch = Arc::new(PrepareWatch::default());
    let mut guard = Abandon { watch: watch.clone(), service: s.service.clone(), delivered: false };
    let resp = step(s, who, b, move |svc, who, r: PrepareRequest| {
        let step = BatchStep::Prepare(r);
        let answer = take(svc, who, &step, &watch.token);
        if let (BatchStep::Prepare(r), Ok(Answer::Prepared(p))) = (&step, &answer) {
            watch.prepared(svc, &r.req_id, p);
        }
        answer
    })
    .await;
    guard.delivered = true;
    resp
}

fn too_many_prepares(s: &AppState) -> ErrorBody {
    let max = s.limits.max_prepares;
    ErrorBody::new(
        RefusalCode::TooManyPrepares,
        "req_id",
        format!("{max} prepares are already being handled or waiting: retry later"),
    )
}

type S = State<Shared>;
type E = Extension<Caller>;

/// The OpenAPI document, generated once.
fn openapi_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(super::openapi::document_text)
}

/// The control plane's routes: each is a row of [`super::openapi::ROUTES`].
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/openapi.json", get(|| async { ([(header::CONTENT_TYPE, "application/json")], openapi_text()) }))
        .route(
            "/metrics",
            get(|State(s): S, Extension(w): E| async move {
                // Counters span every tenant: only an admin reads them.
                match w.require(Role::Admin, "read /metrics") {
                    Ok(()) => exposition(s.service.store(), &s.metrics),
                    Err(r) => error_response(&s, ErrorBody::new(r.code, r.field, r.message)),
                }
            }),
        )
        .route("/storage-pd/publications", get(publications))
        .route("/storage-pd/namespace", get(namespace))
        .route("/storage-pd/prepare", post(prepare))
        .merge(steps())
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), timed))
        .with_state(state)
        .layer(axum::middleware::map_response(json_errors))
}

/// Times each routed request into `pdstor_step_seconds`, labelled by its
/// route (`/storage-pd/claim` → `claim`).
async fn timed(
    State(s): S,
    path: axum::extract::MatchedPath,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let started = std::time::Instant::now();
    let answer = next.run(req).await;
    let route = path.as_str();
    s.metrics.step(route.strip_prefix("/storage-pd/").unwrap_or(route.trim_start_matches('/')), started.elapsed());
    answer
}

/// The protocol's steps after prepare: each a JSON body in, a
/// [`Service`] call, a JSON answer or refusal out.
fn steps() -> Router<Shared> {
    Router::new()
        .route(
            "/storage-pd/cancel",
            post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Cancel))),
        )
        .route(
            "/storage-pd/publish",
            post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Publish))),
        )
        .route("/storage-pd/claim", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Claim))))
        .route("/storage-pd/adopt", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Adopt))))
        .route("/storage-pd/ack", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Ack))))
        .route("/storage-pd/read", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Read))))
        .route(
            "/storage-pd/read/end",
            post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::EndRead))),
        )
        .route(
            "/storage-pd/loaded",
            post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Loaded))),
        )
        .route(
            "/storage-pd/release",
            post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Release))),
        )
        .route(
            "/storage-pd/lookup",
            post(|State(s): S, Extension(w): E, b: Body| {
                step(s, w, b, |svc, w, r: LookupRequest| {
                    svc.lookup(w, &r.req_ids).map(|receipts| LookupResponse { receipts })
                })
            }),
        )
        .route("/storage-pd/abort", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Abort))))
        .route("/storage-pd/fail", post(|State(s): S, Extension(w): E, b: Body| step(s, w, b, one(BatchStep::Fail))))
        .route(
            "/storage-pd/reclaim",
            post(|State(s): S, Extension(w): E, b: Body| {
                step(s, w, b, |svc, w, r: ReceiptOnly| svc.reclaim(w, &r.receipt).map(|_| Done { ok: true }))
            }),
        )
        .route(
            "/storage-pd/admin/reclaim",
            post(|State(s): S, Extension(w): E, b: Body| {
                step(s, w, b, |svc, w, r: OperatorReclaimRequest| {
                    svc.reclaim_by_operator(w, r.publication, &r.reason).map(|_| Done { ok: true })
                })
            }),
        )
        .route(
            "/storage-pd/admin/end-reads",
            post(|State(s): S, Extension(w): E, b: Body| {
                step(s, w, b, |svc, w, r: OperatorEndReadsRequest| {
                    svc.end_reads_by_operator(w, r.publication, &r.reason).map(|n| EndedReads { ended: n as u64 })
                })
            }),
        )
        .route(
            "/storage-pd/session/close",
            post(|State(s): S, Extension(w): E, b: Body| {
                step(s, w, b, |svc, w, r: SessionCloseRequest| {
                    svc.close_session(w, &r.receipt).map(|_| Done { ok: true })
                })
            }),
        )
        .route("/storage-pd/batch", post(batch))
        .route(
            "/storage-pd/admin/takeover",
            post(|State(s): S, _: Bytes| async move {
                error_response(&s, crate::owner::takeover_asked_of_owner(s.service.store()))
            }),
        )
}

/// One step's route: its body is the step ([`take`] says what it does).
fn one<R>(wrap: fn(R) -> BatchStep) -> impl FnOnce(&Service, &Caller, R) -> Result<Answer, ProtocolError> + Send {
    move |svc, who, r| take(svc, who, &wrap(r), &CancelToken::new())
}

/// `POST /storage-pd/batch`: many steps in one round trip (see
/// [`super::steps`]). A batch that prepares takes one of the
/// `--max-prepares` places, as a prepare does; a client that goes away has
/// its waiting prepare cancelled and what it prepared orphaned.
async fn batch(State(s): State<Shared>, Extension(who): Extension<Caller>, b: Body) -> Response {
    let r: BatchRequest = match read_request(&s, b).await {
        Ok((_, r)) => r,
        Err(refused) => return refused,
    };
    if r.steps.len() > MAX_BATCH_STEPS {
        let message = format!("the batch has {} steps; at most {MAX_BATCH_STEPS} are taken at once", r.steps.len());
        return error_response(&s, ErrorBody::new(RefusalCode::BadRequest, "steps", message));
    }
    let _slot = if r.steps.iter().any(|st| matches!(st, BatchStep::Prepare(_))) {
        match PrepareSlot::take(&s) {
            Some(slot) => Some(slot),
            None => return error_response(&s, too_many_prepares(&s)),
        }
    } else {
        None
    };
    let watch = Arc::new(PrepareWatch::default());
    let mut guard = Abandon { watch: watch.clone(), service: s.service.clone(), delivered: false };
    let (service, metrics, caller) = (s.service.clone(), s.metrics.clone(), who);
    let ran = tokio::task::spawn_blocking(move || {
        let prepared = |req: &str, p: &Prepared| watch.prepared(&service, req, p);
        let refused = |st: &BatchStep, e: &ErrorBody| {
            if super::steps::is_lookup_miss(st, e) {
                return;
            }
            metrics.error(&e.code);
            let (publication, req_id) = names(st);
            note_refusal(&service, &caller, publication, req_id, e);
        };
        // One write for the batch's audit lines.
        let took = |step: &str, took: std::time::Duration| metrics.step_in_batch(step, took);
        let told = Told { prepared: &prepared, refused: &refused, took: &took };
        let results = super::log::gathered(|| run_batch(&service, &caller, r.steps, &watch.token, &told));
        metrics.reconcile(service.store());
        BatchResponse { results }
    })
    .await;
    guard.delivered = true;
    match ran {
        Ok(answer) => json_response(StatusCode::OK, &answer),
        Err(join) => error_response(&s, ErrorBody::new(RefusalCode::Internal, "", format!("handler panicked: {join}"))),
    }
}

/// `GET /storage-pd/namespace` ([`listing::namespace`]).
async fn namespace(State(s): State<Shared>, Extension(who): Extension<Caller>) -> Response {
    match listing::namespace(&s.service, &who) {
        Ok(info) => json_response(StatusCode::OK, &info),
        Err(e) => error_response(&s, e),
    }
}

/// `GET /storage-pd/publications` ([`listing::publications`]).
async fn publications(
    State(s): State<Shared>,
    Extension(who): Extension<Caller>,
    Query(q): Query<std::collections::BTreeMap<String, String>>,
) -> Response {
    match listing::publications(&s.service, &who, &q) {
        Ok(list) => json_response(StatusCode::OK, &list),
        Err(e) => error_response(&s, e),
    }
}
