//! The control plane's accept loop: axum's router served by hyper with the
//! limits `axum::serve` does not have: a cap on open connections (the next
//! one is answered 503 in the JSON error shape and closed), a timeout on
//! request headers, which also closes a keep-alive connection left idle, and
//! hyper's own answers to what it cannot parse in the JSON error shape too
//! (`shaped`).
//!
//! Each connection's caller is resolved once, when it is accepted: a Unix
//! peer by `SO_PEERCRED`, a TCP client by what its transport proved. Handlers
//! find it as an `Extension<Caller>`; a tenant over its connection quota is
//! answered 429 `quota_exceeded` and closed.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;

use super::Limits;
use super::wire::ErrorBody;
use crate::protocol::RefusalCode;
use crate::protocol::identity::{Caller, Policy, Resource};

/// Anything the loop can accept connections from (a Unix socket, plaintext
/// TCP, or TCP with mutual TLS).
pub trait Accept {
    /// A connection as accepted, before any handshake.
    type Raw: AsyncWrite + Unpin + Send + 'static;
    /// The connection HTTP runs over.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Whether a refusal can be written on a raw connection as plain HTTP.
    const PLAINTEXT: bool = true;
    /// The next connection.
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Raw>> + Send;
    /// Its handshake, if any, and who is on its other end, by `policy`.
    /// Runs on the connection's own task, so a slow client holds up no other.
    fn establish(
        &self,
        raw: Self::Raw,
        policy: Arc<Policy>,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Caller)>> + Send + 'static;
}

impl Accept for tokio::net::TcpListener {
    type Raw = tokio::net::TcpStream;
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        let (s, _) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
    fn establish(
        &self,
        s: Self::Raw,
        policy: Arc<Policy>,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Caller)>> + Send + 'static {
        let caller = s.peer_addr().map(|a| policy.plaintext(a.to_string()));
        std::future::ready(caller.map(|c| (s, c)))
    }
}

impl Accept for tokio::net::UnixListener {
    type Raw = tokio::net::UnixStream;
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        Ok(tokio::net::UnixListener::accept(self).await?.0)
    }
    fn establish(
        &self,
        s: Self::Raw,
        policy: Arc<Policy>,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Caller)>> + Send + 'static {
        let caller = s.peer_cred().map(|c| policy.unix(c.uid(), c.gid(), c.pid().unwrap_or(0)));
        std::future::ready(caller.map(|c| (s, c)))
    }
}

/// TCP with mutual TLS: the client is who its certificate names.
pub struct TlsListener {
    /// The TCP listener.
    pub tcp: tokio::net::TcpListener,
    /// The handshake.
    pub acceptor: tokio_rustls::TlsAcceptor,
}

impl Accept for TlsListener {
    type Raw = tokio::net::TcpStream;
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    const PLAINTEXT: bool = false;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        Accept::accept(&self.tcp).await
    }
    fn establish(
        &self,
        s: Self::Raw,
        policy: Arc<Policy>,
    ) -> impl Future<Output = std::io::Result<(Self::Io, Caller)>> + Send + 'static {
        let acceptor = self.acceptor.clone();
        async move {
            let addr = s.peer_addr()?.to_string();
            let tls = acceptor.accept(s).await?;
            let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first().cloned());
            let caller = match cert {
                // rustls verified it against the client CA.
                Some(c) => policy.certificate(super::tls::names(&c), addr),
                None => policy.anonymous_tls(addr),
            };
            Ok((tls, caller))
        }
    }
}

/// Writes `answer` and closes, on a task of its own (at most a second).
fn refuse<W: AsyncWrite + Unpin + Send + 'static>(answer: Vec<u8>, mut io: W) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), io.write_all(&answer)).await;
    });
}

/// An answer written by hand to a connection that will carry no request.
fn last_word(status: &str, body: &ErrorBody) -> Vec<u8> {
    let body = serde_json::to_vec(body).unwrap_or_default();
    let mut r = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend(body);
    r
}

/// The answer to a connection over the cap.
fn over_capacity(max: usize) -> Vec<u8> {
    let body = ErrorBody::new(
        RefusalCode::TooManyConnections,
        "",
        format!("{max} control-plane connections are open (--max-http-connections): retry later"),
    );
    last_word("503 Service Unavailable", &body)
}

/// Control-plane connections accepted since start (`/metrics`): with clients
/// that keep their connections alive, far fewer than the requests.
static ACCEPTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Control-plane connections accepted since the daemon started.
pub fn accepted_connections() -> u64 {
    ACCEPTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open
/// requests finish (up to `drain` long).
pub async fn serve<L: Accept>(
    listener: L,
    policy: Arc<Policy>,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
    drain: std::time::Duration,
) {
    let open = Arc::new(Semaphore::new(limits.max_http_connections));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let raw = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(raw) => raw,
                Err(e) => {
                    // Out of descriptors, or a connection reset before accept:
                    // back off briefly instead of spinning.
                    tracing::warn!(error = %e, "control plane accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            if L::PLAINTEXT {
                refuse(over_capacity(limits.max_http_connections), raw);
            }
            continue;
        };
        ACCEPTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pending = listener.establish(raw, policy.clone());
        let (policy, app, watcher) = (policy.clone(), app.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _permit = permit;
            let (io, caller) = match tokio::time::timeout(limits.header_timeout, pending).await {
                Ok(Ok(established)) => established,
                Ok(Err(e)) => return tracing::debug!(error = %e, "control plane handshake failed"),
                Err(_) => return tracing::debug!("control plane handshake timed out"),
            };
            if let Err(r) = policy.take(&caller, Resource::Connection) {
                let answer = last_word("429 Too Many Requests", &ErrorBody::new(r.code, r.field, r.message));
                return refuse(answer, io);
            }
            let _quota = ConnectionQuota { policy, caller: caller.clone() };
            let service = TowerToHyperService::new(app.layer(axum::Extension(caller)));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(super::shaped::Shaped::new(io)), service);
            let _ = watcher.watch(conn).await;
        });
    }
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
}

/// A connection counted against its tenant's quota until dropped.
struct ConnectionQuota {
    policy: Arc<Policy>,
    caller: Caller,
}

impl Drop for ConnectionQuota {
    fn drop(&mut self) {
        self.policy.give(&self.caller, Resource::Connection);
    }
}
