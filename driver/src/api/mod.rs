//! The daemon's two planes (DESIGN §2): the HTTP control plane ([`http`]) and
//! the buffer-passing data plane ([`data`]), their wire types ([`wire`]) and
//! the one place errors become statuses and exit codes ([`error`]).

pub mod data;
pub mod error;
pub mod http;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::service::Service;
use crate::store::{Store, StoreOptions};

/// Where the control plane listens.
#[derive(Debug, Clone)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub target: PathBuf,
    pub listen: Listen,
    pub data_socket: PathBuf,
    pub queue_depth: u32,
    pub admission_timeout: Duration,
    /// Attach the provenance probes and stamp every payload transfer.
    pub provenance: bool,
    /// With `provenance`: a `fallback` verdict fails the transfer.
    pub require_native: bool,
    /// Append every step to this timeline (as node `daemon-e<epoch>`).
    pub timeline: Option<PathBuf>,
    /// Fault injection for tests: the device "dies" as this plan says.
    pub fault: Option<Arc<crate::store::FaultPlan>>,
}

/// Runs the daemon until SIGTERM or SIGINT, then stops accepting, lets
/// in-flight requests finish, and closes the store (which commits).
pub fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    let (store, report) = Store::open(
        &cfg.target,
        StoreOptions {
            queue_depth: cfg.queue_depth,
            admission_timeout: cfg.admission_timeout,
            fault: cfg.fault.clone(),
        },
    )?;
    tracing::info!(
        target = %cfg.target.display(),
        epoch = report.epoch,
        live = report.live,
        rolled_back = report.rolled_back.len(),
        journal_stop = ?report.journal_stop,
        "store opened"
    );
    let store = Arc::new(store);
    let timeline = match &cfg.timeline {
        // One node per daemon incarnation: a restarted daemon appending to the
        // same file starts its line numbers afresh under its own name.
        Some(p) => Some(Arc::new(crate::timeline::Timeline::open(p, &format!("daemon-e{}", store.epoch()))?)),
        None => None,
    };
    let service = Arc::new(Service::new(store.clone()).with_timeline(timeline));
    let metrics = Arc::new(http::Metrics::default());
    // The probes stay attached for as long as `probes` lives: this function.
    let probes = if cfg.provenance { Some(pdstor_probes::Probes::attach(std::process::id())?) } else { None };
    let provenance = match &probes {
        Some(p) => {
            p.watch_file(&cfg.target)?;
            for s in p.status() {
                tracing::info!(program = s.name, attached = s.attached, detail = %s.detail, "provenance probe");
            }
            let class = store.target_kind().probe_class();
            Some(Arc::new(data::Provenance { reader: p.reader()?, class, require_native: cfg.require_native }))
        }
        None => None,
    };
    let data = data::DataPlane::start(&cfg.data_socket, service.clone(), metrics.clone(), provenance)
        .map_err(|e| anyhow::anyhow!("data socket {}: {e}", cfg.data_socket.display()))?;
    tracing::info!(data_socket = %data.path().display(), "data plane listening");
    let app = http::router(Arc::new(http::AppState { service, metrics, provenance: probes.is_some() }));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let shutdown = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {},
            }
            tracing::info!("shutting down");
        };
        match &cfg.listen {
            Listen::Tcp(addr) => {
                let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("listening on {addr}: {e}"))?;
                tracing::info!(%addr, "control plane listening");
                axum::serve(l, app).with_graceful_shutdown(shutdown).await?;
            }
            Listen::Unix(path) => {
                let _ = std::fs::remove_file(path);
                let l = tokio::net::UnixListener::bind(path).map_err(|e| anyhow::anyhow!("listening on {}: {e}", path.display()))?;
                tracing::info!(path = %path.display(), "control plane listening");
                axum::serve(l, app).with_graceful_shutdown(shutdown).await?;
                let _ = std::fs::remove_file(path);
            }
        }
        anyhow::Ok(())
    })?;
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
