//! The control plane's accept loop: axum's router served by hyper with the
//! limits `axum::serve` does not have: a cap on open connections (the next
//! one is answered 503 in the JSON error shape and closed) and a timeout on
//! request headers, which also closes a keep-alive connection left idle.

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

/// Anything the loop can accept connections from (TCP or a Unix socket).
pub trait Accept {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        let (s, _) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        Ok(tokio::net::UnixListener::accept(self).await?.0)
    }
}

/// The answer to a connection over the cap, written by hand: no request has
/// been read, and none will be.
fn over_capacity(max: usize) -> Vec<u8> {
    let body = serde_json::to_vec(&ErrorBody::new(
        RefusalCode::TooManyConnections,
        "",
        format!("{max} control-plane connections are open (--max-http-connections): retry later"),
    ))
    .unwrap_or_default();
    let mut r = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend(body);
    r
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open
/// requests finish (up to `drain` long).
pub async fn serve<L: Accept>(
    listener: L,
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
            accepted = listener.accept() => match accepted {
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
        let Ok(permit) = open.clone().try_acquire_owned() else {
            let mut io = io;
            let answer = over_capacity(limits.max_http_connections);
            tokio::spawn(async move {
                let _ = tokio::time::timeout(std::time::Duration::from_secs(1), io.write_all(&answer)).await;
            });
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    let _ = tokio::time::timeout(drain, graceful.shutdown()).await;
}
