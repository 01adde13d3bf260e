//! The daemon's two planes (DESIGN §2): the HTTP control plane ([`http`]) and
//! the buffer-passing data plane ([`data`]), their wire types ([`wire`]) and
//! the one place errors become statuses and exit codes ([`error`]).

pub mod config;
pub mod data;
pub mod data_error;
pub mod error;
pub mod http;
pub mod hygiene;
mod listen;
mod listing;
pub mod log;
mod lost;
pub mod metrics;
pub mod openapi;
pub mod peer;
pub mod reload;
pub mod routes;
mod shaped;
pub mod standby;
pub mod steps;
pub mod tls;
use pdstor_client::wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::service::Service;
use crate::store::{Store, StoreOptions};

/// Where the control plane listens.
#[derive(Debug, Clone)]
pub enum Listen {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = String;

    /// `unix:/path/control.sock` or `host:port`.
    fn from_str(s: &str) -> Result<Listen, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            return Ok(Listen::Unix(path.trim_start_matches("//").into()));
        }
        s.parse().map(Listen::Tcp).map_err(|e| format!("{s:?} is neither unix:/path nor host:port: {e}"))
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// What `pdstor serve` runs with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The formatted target.
    pub target: PathBuf,
    /// The control plane's address.
    pub listen: Listen,
    /// The data plane's Unix socket.
    pub data_socket: PathBuf,
    /// Payload requests the store's I/O thread keeps in flight.
    pub queue_depth: u32,
    /// Back-to-back small chunks go to the device as one command of up to
    /// this many bytes (`StoreOptions::merge_bytes`); with `provenance` every
    /// chunk goes alone whatever this says, so each has its own verdict.
    pub merge_bytes: u64,
    /// Payload verifier threads (`StoreOptions::verify_threads`; 0: one per CPU).
    pub verify_threads: usize,
    /// The longest a prepare waits for capacity.
    pub admission_timeout: Duration,
    /// Attach the provenance probes and stamp every payload transfer.
    pub provenance: bool,
    /// With `provenance`: a `fallback` verdict fails the transfer.
    pub require_native: bool,
    /// Append every step to this timeline (as node `daemon-e<epoch>`).
    pub timeline: Option<PathBuf>,
    /// Hold the namespace's Exclusive Access — All Registrants reservation
    /// with this key: direct readers register keys of their own, and fencing
    /// one preempts its key at the target.
    pub reservation_key: Option<u64>,
    /// How often an owner holding a reservation checks that its key is still
    /// registered (a standby that took over preempted it: the namespace is lost).
    pub owner_check: Duration,
    /// Stand by for the namespace's owner instead of serving it (`--standby`).
    pub standby: Option<standby::StandbyConfig>,
    /// Fault injection for tests: the device "dies" as this plan says.
    pub fault: Option<Arc<crate::store::FaultPlan>>,
    /// What one client may hold or take.
    pub limits: Limits,
    /// Serve a target other users can read (warned at start).
    pub allow_readable_target: bool,
    /// Serve plaintext TCP (warned at start).
    pub insecure_tcp: bool,
    /// Who is who, and the sockets' group (`--config`, read again on each
    /// reload; [`crate::protocol::identity::Rules::local`] without one).
    pub config: config::ConfigSource,
    /// How often the files a reload reads are checked for a change (none:
    /// only SIGHUP reloads).
    pub reload_check: Option<Duration>,
    /// Mutual TLS for a TCP control plane (its files read again on each reload).
    pub tls: Option<tls::TlsFiles>,
}

/// What one client may hold or take, and how long the daemon waits for it.
/// Every limit is a `pdstor serve` option; refusals name the limit.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest control-plane request body.
    pub max_body_bytes: usize,
    /// Longest wait for a request body once its headers arrived.
    pub body_timeout: Duration,
    /// Longest wait for a request's headers, and for the next request on an idle connection.
    pub header_timeout: Duration,
    /// Control-plane connections open at once; the next is answered 503 and closed.
    pub max_http_connections: usize,
    /// `prepare` requests handled or waiting for capacity at once; the next is 503.
    pub max_prepares: usize,
    /// Data-plane connections open at once; the next is answered 503 and closed.
    pub max_data_connections: usize,
    /// A data-plane connection holding no registered buffer is closed after this long without a request.
    pub data_idle_timeout: Duration,
    /// Buffers one data-plane connection may register.
    pub max_buffers_per_connection: usize,
    /// Bytes of buffer memory one data-plane connection may have the daemon map.
    pub max_pinned_bytes_per_connection: u64,
    /// A PREPARED publication that sees no store batch for this long is aborted.
    pub prepare_idle_timeout: Duration,
    /// A PREPARED publication whose prepare's answer never reached its client
    /// (it went away while waiting) is aborted after this long with no batch.
    pub orphan_grace: Duration,
    /// A READY publication no reader claims for this long is released
    /// unread; `None`: kept until its writer or an operator releases it.
    pub unread_release: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 1 << 20,
            body_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            max_http_connections: 512,
            max_prepares: 64,
            max_data_connections: 256,
            data_idle_timeout: Duration::from_secs(10),
            max_buffers_per_connection: 16,
            max_pinned_bytes_per_connection: 16 << 30,
            prepare_idle_timeout: Duration::from_secs(120),
            orphan_grace: Duration::from_secs(5),
            unread_release: None,
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT, then stops accepting, lets
/// in-flight requests finish, and closes the store (which commits).
pub fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    hygiene::check_target(&cfg.target, cfg.allow_readable_target)?;
    let tls = match (&cfg.listen, &cfg.tls) {
        (Listen::Tcp(_), Some(files)) => Some(files.clone()),
        (Listen::Tcp(addr), None) => {
            hygiene::check_tcp(addr, cfg.insecure_tcp)?;
            None
        }
        (Listen::Unix(p), Some(_)) => anyhow::bail!(
            "--tls-cert is for a TCP control plane; {} is a Unix socket, where callers are identified by SO_PEERCRED",
            p.display()
        ),
        (Listen::Unix(_), None) => None,
    };
    let live = Arc::new(reload::Live::load(cfg.config.clone(), tls)?);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    {
        let _entered = rt.enter();
        rt.spawn(live.clone().watch(reload::Live::hangups(), cfg.reload_check));
    }
    let Some((held, store)) = own(&cfg, &live, &rt)? else {
        tracing::info!("stopped (a standby to the end)");
        return Ok(());
    };
    let store = Arc::new(store);
    let timeline = match &cfg.timeline {
        // One node per daemon incarnation: a restarted daemon appending to the
        // same file starts its line numbers afresh under its own name.
        Some(p) => Some(Arc::new(pdstor_client::timeline::Timeline::open(p, &format!("daemon-e{}", store.epoch()))?)),
        None => None,
    };
    let mut service = Service::new(store.clone()).with_timeline(timeline).with_policy(live.policy().clone());
    let mut watcher = None;
    if let Some(held) = held {
        let key = held.key;
        service = service.with_reservations(held.reservations, key);
        watcher = Some(crate::owner::watch(store.clone(), &cfg.target, key, cfg.owner_check)?);
        tracing::info!(
            key = format!("{key:#x}"),
            "holding the namespace's reservation (exclusive access, all registrants)"
        );
    }
    let service = Arc::new(service);
    let metrics = Arc::new(metrics::Metrics::default());
    // The probes stay attached for as long as `probes` lives: this function.
    let probes = if cfg.provenance { Some(pdstor_probes::Probes::attach(std::process::id())?) } else { None };
    let provenance = match &probes {
        Some(p) => {
            p.watch_file(&cfg.target)?;
            for s in p.status() {
                tracing::info!(program = s.name, attached = s.attached, detail = %s.detail, "provenance probe");
            }
            let class = crate::provenance::target_class(store.target_kind());
            Some(Arc::new(data::Provenance { reader: p.reader()?, class, require_native: cfg.require_native }))
        }
        None => None,
    };
    let data = data::DataPlane::start(
        &cfg.data_socket,
        live.socket_group(),
        service.clone(),
        metrics.clone(),
        provenance,
        cfg.limits,
    )
    .map_err(|e| anyhow::anyhow!("data socket {}: {e:#}", cfg.data_socket.display()))?;
    tracing::info!(data_socket = %data.path().display(), "data plane listening");
    let (reaper_stop, reaper) = spawn_reaper(service.clone(), metrics.clone(), cfg.limits)?;
    let app = http::router(Arc::new(http::AppState {
        service,
        metrics,
        provenance: probes.is_some(),
        limits: cfg.limits,
        prepares: Default::default(),
    }))
    .layer(axum::middleware::from_fn_with_state(store.clone(), lost::refuse_when_lost));
    rt.block_on(control_plane(cfg.listen.clone(), live, app, cfg.limits, signalled()))?;
    reaper_stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = reaper.join();
    if let Some((stop, handle)) = watcher {
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = handle.join();
    }
    drop(data);
    drop(probes);
    let failed = store.failed();
    drop(store);
    tracing::info!("stopped");
    match failed {
        // The journal holds everything acknowledged; a restart replays it.
        Some(why) => anyhow::bail!("the store failed during this run ({why}); restart to recover from the journal"),
        None => Ok(()),
    }
}

/// Takes the namespace as its owner — at once, or as a standby when it
/// takes over (`None`: stopped while standing by) — and opens its store.
fn own(
    cfg: &ServeConfig,
    live: &Arc<reload::Live>,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<Option<(Option<crate::owner::Held>, Store)>> {
    let (held, store, report) = match (&cfg.standby, cfg.reservation_key) {
        (Some(sb), Some(key)) => match standby::run(cfg, sb, key, live, rt)? {
            Some((held, store, report)) => (Some(held), store, report),
            None => return Ok(None),
        },
        (Some(_), None) => anyhow::bail!(
            "--standby needs --reservation-key: a standby takes a namespace over by preempting its owner's key with its own"
        ),
        (None, Some(key)) => {
            let held =
                crate::owner::hold(&cfg.target, key, false).map_err(|e| anyhow::anyhow!("--reservation-key: {e:#}"))?;
            let (store, report) = open_store(cfg, key)?;
            (Some(held), store, report)
        }
        (None, None) => {
            let (store, report) = open_store(cfg, 0)?;
            (None, store, report)
        }
    };
    tracing::info!(
        target = %cfg.target.display(),
        epoch = report.epoch,
        live = report.live,
        rolled_back = report.rolled_back.len(),
        journal_stop = ?report.journal_stop,
        write_cache = %store.write_cache(),
        "store opened"
    );
    Ok(Some((held, store)))
}

/// Opens the store (recovery into a new epoch), recording `owner_key` (0:
/// none) as the key this owner holds the namespace with.
fn open_store(cfg: &ServeConfig, owner_key: u64) -> anyhow::Result<(Store, crate::store::RecoveryReport)> {
    Ok(Store::open(
        &cfg.target,
        StoreOptions {
            queue_depth: cfg.queue_depth,
            merge_bytes: if cfg.provenance { 0 } else { cfg.merge_bytes },
            verify_threads: cfg.verify_threads,
            admission_timeout: cfg.admission_timeout,
            fault: cfg.fault.clone(),
            owner_key,
            ..Default::default()
        },
    )?)
}

/// Completes at SIGTERM or SIGINT.
async fn signalled() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {},
    }
    tracing::info!("shutting down");
}

/// The reaper: PREPARED publications whose writer went quiet give their
/// reservation back after `--prepare-idle-timeout-ms`, those whose
/// prepare's answer never reached the client after `--prepare-orphan-grace-ms`,
/// and READY ones no reader claimed are released after their unread window
/// (their writer's `unread_release_ms`, `--unread-release-ms`, the shorter).
/// Stops when the flag returned is set.
fn spawn_reaper(
    service: Arc<Service>,
    metrics: Arc<metrics::Metrics>,
    limits: Limits,
) -> std::io::Result<(Arc<std::sync::atomic::AtomicBool>, std::thread::JoinHandle<()>)> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let (idle, grace, unread) = (limits.prepare_idle_timeout, limits.orphan_grace, limits.unread_release);
    let shortest = unread.map_or(idle.min(grace), |u| idle.min(grace).min(u));
    let tick = (shortest / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let handle = std::thread::Builder::new().name("pdstor-reaper".into()).spawn(move || {
        while !flag.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(tick);
            let n = service.reap_idle(idle, grace);
            if n > 0 {
                tracing::warn!(
                    publications = n,
                    idle_ms = idle.as_millis() as u64,
                    "aborted idle or orphaned PREPARED publications"
                );
                metrics.reaped.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            let expired = service.release_unread_after(unread).unwrap_or_else(|e| {
                tracing::error!("releasing unread publications failed (tried again next tick): {e}");
                0
            });
            if n + expired > 0 {
                metrics.reconcile(service.store());
            }
        }
    })?;
    Ok((stop, handle))
}

/// Serves the control plane on `listen` until `shutdown` completes, then
/// lets in-flight requests drain (up to 30 s).
async fn control_plane(
    listen: Listen,
    live: Arc<reload::Live>,
    app: axum::Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let drain = std::time::Duration::from_secs(30);
    match &listen {
        Listen::Tcp(addr) => {
            let l =
                tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("listening on {addr}: {e}"))?;
            match live.tls() {
                Some(_) => {
                    tracing::info!(%addr, "control plane listening (mutual TLS)");
                    let l = listen::TlsListener { tcp: l, live: live.clone() };
                    listen::serve(l, live, app, limits, shutdown, drain).await;
                }
                None => {
                    tracing::info!(%addr, "control plane listening (plaintext TCP)");
                    listen::serve(l, live, app, limits, shutdown, drain).await;
                }
            }
        }
        Listen::Unix(path) => {
            let l = hygiene::bind_socket(path, live.socket_group(), |p| tokio::net::UnixListener::bind(p))?;
            tracing::info!(path = %path.display(), "control plane listening");
            listen::serve(l, live, app, limits, shutdown, drain).await;
            let _ = std::fs::remove_file(path);
        }
    }
    Ok(())
}
