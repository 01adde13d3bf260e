//! The control plane's accept loop: axum's router served by hyper with the
//! limits `axum::serve` does not have: a cap on open connections (the next
//! one is answered 503 in the JSON error shape and closed) and a timeout on
//! request headers, which also closes a keep-alive connection left idle.
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

/// Anything the loop can accept connections from (TCP or a Unix socket).
pub trait Accept {
    /// The connection.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection and who is on its other end, by `policy`.
    fn accept(&self, policy: &Policy) -> impl Future<Output = std::io::Result<(Self::Io, Caller)>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self, policy: &Policy) -> std::io::Result<(Self::Io, Caller)> {
        let (s, addr) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok((s, policy.plaintext(addr.to_string())))
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self, policy: &Policy) -> std::io::Result<(Self::Io, Caller)> {
        let s = tokio::net::UnixListener::accept(self).await?.0;
        let cred = s.peer_cred()?;
        Ok((s, policy.unix(cred.uid(), cred.gid(), cred.pid().unwrap_or(0))))
    }
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
        let io = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept(&policy) => match accepted {
                Ok(io) => io,
                Err(e) => {
                    // Out of descriptors, or a connection reset before accept:
                    // back off briefly instead of spinning.
                    tracing::warn!(error = %e, "control plane accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    continue;
                }
            },
        };
        let (io, caller) = io;
        let refuse = |answer: Vec<u8>, mut io: L::Io| {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), io.write_all(&answer)).await;
            });
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            refuse(over_capacity(limits.max_http_connections), io);
            continue;
        };
        if let Err(r) = policy.take(&caller, Resource::Connection) {
            refuse(last_word("429 Too Many Requests", &ErrorBody::new(r.code, r.field, r.message)), io);
            continue;
        }
        let quota = ConnectionQuota { policy: policy.clone(), caller: caller.clone() };
        let service = TowerToHyperService::new(app.clone().layer(axum::Extension(caller)));
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop((permit, quota));
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
