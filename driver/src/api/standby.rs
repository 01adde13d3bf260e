//! `pdstor serve --standby`: a daemon on another host attached to the same
//! namespace that writes nothing until it takes the namespace over — when an
//! operator says so (`pdstor takeover`, `POST /storage-pd/admin/takeover`),
//! or by itself once the owner's `/healthz` has failed for
//! `--takeover-after-ms`. Taking over preempts the old owner's key (the one
//! the superblock names), then opens the store exactly as a restart does —
//! a new epoch: READY stays READY, direct claims keep their slots,
//! daemon-loaded claims are fenced, PREPARED ones rolled back — and the
//! daemon goes on as the owner. A takeover that fails leaves it a standby.
//!
//! While it stands by it answers `/healthz` 200 (`standby`), `/readyz` and
//! every other route 503 `standby`, naming the namespace and its owner.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::sync::{mpsc, oneshot};

use super::wire::{ErrorBody, TakeoverAnswer};
use super::{ServeConfig, open_store};
use crate::owner::{self, Held};
use crate::protocol::identity::{Caller, Role};
use crate::store::{RecoveryReport, Store};
use pdstor_client::code::RefusalCode;

/// How a standby watches its owner.
#[derive(Debug, Clone)]
pub struct StandbyConfig {
    /// The owner's control plane (`http://host:port`, `https://…`, `unix:/path`):
    /// watched for health. Without one, only an operator's takeover.
    pub owner: Option<String>,
    /// Take over once the owner's health has failed for this long.
    pub takeover_after: Duration,
    /// How often the owner's health is asked.
    pub check_every: Duration,
}

/// What a takeover gives the daemon: the namespace held, its store opened
/// into a new epoch.
pub type TakenOver = (Held, Store, RecoveryReport);

type Reply = oneshot::Sender<Result<TakeoverAnswer, String>>;

struct Standing {
    /// What the standby says of itself, in every 503.
    about: String,
    takeovers: mpsc::Sender<Reply>,
}

/// Stands by until the namespace is taken over (`Some`) or the daemon is
/// told to stop (`None`). Refuses to start where the target has no
/// persistent reservations, or its owner holds none to preempt.
pub(super) fn run(
    cfg: &ServeConfig,
    standby: &StandbyConfig,
    key: u64,
    live: &Arc<super::reload::Live>,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<Option<TakenOver>> {
    let about = stand(cfg, standby, key)?;
    let (tx, mut rx) = mpsc::channel::<Reply>(4);
    let app = router(Arc::new(Standing { about, takeovers: tx }));
    rt.block_on(async move {
        let (stop_server, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(super::control_plane(
            cfg.listen.clone(),
            live.clone(),
            app,
            cfg.limits,
            async {
                let _ = stopped.await;
            },
        ));
        let mut signals = std::pin::pin!(super::signalled());
        let mut tick = tokio::time::interval(standby.check_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut health = owner::OwnerHealth::new(standby.takeover_after);
        let mut check: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
        let outcome = loop {
            tokio::select! {
                _ = &mut signals => break None,
                Some(reply) = rx.recv() => {
                    let by = "an operator's takeover";
                    match take_over(cfg, key, by).await {
                        Ok((answer, taken)) => {
                            let _ = reply.send(Ok(answer));
                            break Some(taken);
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "{by} failed; standing by");
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                _ = tick.tick(), if standby.owner.is_some() => {
                    let owner = standby.owner.clone().unwrap_or_default();
                    let healthy = match check.take() {
                        Some(h) if h.is_finished() => Some(h.await.unwrap_or_else(|e| Err(e.to_string()))),
                        // The last check is still waiting for the owner: it is not answering.
                        Some(h) => { check = Some(h); Some(Err("the owner has not answered its last health check".into())) }
                        None => None,
                    };
                    if check.is_none() {
                        let o = owner.clone();
                        check = Some(tokio::task::spawn_blocking(move || {
                            pdstor_client::Client::new(&o).healthz().map_err(|e| e.to_string())
                        }));
                    }
                    if let Some(by) = healthy.and_then(|h| health.checked(&owner, h)) {
                        match take_over(cfg, key, &by).await {
                            Ok((_, taken)) => break Some(taken),
                            Err(e) => {
                                tracing::error!(error = %e, "taking over failed; standing by");
                                health.takeover_failed();
                            }
                        }
                    }
                }
            }
        };
        let _ = stop_server.send(());
        server.await??;
        Ok(outcome)
    })
}

/// Stands by ([`owner::stand_by`]) and answers what the standby says of
/// itself.
fn stand(cfg: &ServeConfig, standby: &StandbyConfig, key: u64) -> anyhow::Result<String> {
    let sb = owner::stand_by(&cfg.target, key)?;
    let about = format!(
        "this daemon is a standby for namespace {} (epoch {}, owner key {:#x}{}): it serves no step until it takes over; ask the owner",
        sb.uuid,
        sb.epoch,
        sb.owner_key,
        standby.owner.as_deref().map(|o| format!(", owner at {o}")).unwrap_or_default()
    );
    tracing::info!(
        namespace = %sb.uuid,
        epoch = sb.epoch,
        owner_key = format!("{:#x}", sb.owner_key),
        owner = standby.owner.as_deref().unwrap_or("(none: an operator's takeover only)"),
        takeover_after_ms = standby.takeover_after.as_millis() as u64,
        "standing by"
    );
    Ok(about)
}

/// Preempts the owner's key and opens the store into a new epoch, off the
/// async threads; says what it did.
async fn take_over(cfg: &ServeConfig, key: u64, by: &str) -> Result<(TakeoverAnswer, TakenOver), String> {
    let started = Instant::now();
    let c = cfg.clone();
    let taken = tokio::task::spawn_blocking(move || -> anyhow::Result<TakenOver> {
        let held = owner::hold(&c.target, key, true)?;
        let (store, report) = open_store(&c, key)?;
        Ok((held, store, report))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| format!("{e:#}"))?;
    let (held, store, report) = &taken;
    let answer = TakeoverAnswer {
        namespace: store.superblock().uuid.to_string(),
        epoch: report.epoch,
        preempted_key: held.preempted.map(|k| format!("{k:#x}")),
        previous_epoch: held.before.epoch,
        live: report.live as u64,
        rolled_back: report.rolled_back.clone(),
        took_ms: started.elapsed().as_millis() as u64,
    };
    tracing::warn!(
        namespace = %answer.namespace,
        epoch = answer.epoch,
        preempted = answer.preempted_key.as_deref().unwrap_or("(none)"),
        live = answer.live,
        rolled_back = answer.rolled_back.len(),
        took_ms = answer.took_ms,
        "took the namespace over ({by}): serving it as its owner"
    );
    Ok((answer, taken))
}

type Shared = Arc<Standing>;

fn refusal(code: RefusalCode, message: String) -> Response {
    let body = ErrorBody::new(code, "", message);
    let status = StatusCode::from_u16(body.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

fn router(state: Shared) -> Router {
    Router::new()
        .route("/healthz", get(|| async { (StatusCode::OK, "standby\n") }))
        .route("/storage-pd/admin/takeover", post(takeover))
        .fallback(|State(s): State<Shared>| async move { refusal(RefusalCode::Standby, s.about.clone()) })
        .with_state(state)
        .layer(axum::middleware::from_fn(read_body_first))
}

/// Reads what the client sends before anything answers it: an answer over a
/// body still being sent would cut the client off mid-write (EPIPE) instead
/// of telling it why. No route of a standby reads a body.
async fn read_body_first(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = req.into_parts();
    let _ = axum::body::to_bytes(body, 1 << 20).await;
    next.run(axum::extract::Request::from_parts(parts, axum::body::Body::empty())).await
}

/// `POST /storage-pd/admin/takeover` (admin): takes the namespace over now.
async fn takeover(State(s): State<Shared>, Extension(who): Extension<Caller>) -> Response {
    if let Err(r) = who.require(Role::Admin, "a takeover") {
        return refusal(r.code, r.message);
    }
    let (tx, rx) = oneshot::channel();
    if s.takeovers.send(tx).await.is_err() {
        return refusal(RefusalCode::Standby, "the standby is stopping".into());
    }
    match rx.await {
        Ok(Ok(answer)) => {
            let bytes = serde_json::to_vec(&answer).unwrap_or_default();
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
        }
        Ok(Err(why)) => refusal(RefusalCode::TakeoverFailed, format!("{why}; this daemon stays a standby")),
        Err(_) => refusal(RefusalCode::Standby, "the standby stopped before the takeover was decided".into()),
    }
}
