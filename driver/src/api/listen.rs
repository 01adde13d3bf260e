//! The control plane's accept loop: axum's router served by hyper with the
//! limits `axum::serve` does not have: a cap on open connections (the next
//! one is answered 503 in the JSON error shape and closed), a timeout on
//! request headers, which also closes a keep-alive connection left idle, and
//! hyper's own answers to what it cannot parse in the JSON error shape too
//! (`shaped`).
//!
//! Each connection's transport proves who is on its other end once, when it
//! is accepted: a Unix peer by `SO_PEERCRED`, a TLS client by its
//! certificate (`peer`). Handlers find the caller that proof resolves to as
//! an `Extension<Caller>`, resolved again after a reload; a tenant over its
//! connection quota is answered 429 `quota_exceeded` and closed.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Semaphore, watch};

use super::Limits;
use super::peer::{Peer, Proof};
use super::wire::ErrorBody;
use pdstor_client::code::RefusalCode;

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
    /// Its handshake, if any, and what it proved of its other end. Runs on
    /// the connection's own task, so a slow client holds up no other.
    fn establish(&self, raw: Self::Raw) -> impl Future<Output = std::io::Result<(Self::Io, Proof)>> + Send + 'static;
}

impl Accept for tokio::net::TcpListener {
    type Raw = tokio::net::TcpStream;
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        let (s, _) = tokio::net::TcpListener::accept(self).await?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }
    fn establish(&self, s: Self::Raw) -> impl Future<Output = std::io::Result<(Self::Io, Proof)>> + Send + 'static {
        let proof = s.peer_addr().map(|a| Proof::Plain { addr: a.to_string() });
        std::future::ready(proof.map(|p| (s, p)))
    }
}

impl Accept for tokio::net::UnixListener {
    type Raw = tokio::net::UnixStream;
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        Ok(tokio::net::UnixListener::accept(self).await?.0)
    }
    fn establish(&self, s: Self::Raw) -> impl Future<Output = std::io::Result<(Self::Io, Proof)>> + Send + 'static {
        let proof = s.peer_cred().map(|c| Proof::Unix { uid: c.uid(), gid: c.gid(), pid: c.pid().unwrap_or(0) });
        std::future::ready(proof.map(|p| (s, p)))
    }
}

/// TCP with mutual TLS: the client is who its certificate names.
pub struct TlsListener {
    /// The TCP listener.
    pub tcp: tokio::net::TcpListener,
    /// Where each handshake's configuration is taken from (a reload replaces it).
    pub live: Arc<super::reload::Live>,
}

impl Accept for TlsListener {
    type Raw = tokio::net::TcpStream;
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    const PLAINTEXT: bool = false;
    async fn accept(&self) -> std::io::Result<Self::Raw> {
        Accept::accept(&self.tcp).await
    }
    fn establish(&self, s: Self::Raw) -> impl Future<Output = std::io::Result<(Self::Io, Proof)>> + Send + 'static {
        // The generation first: a reload between the two leaves the handshake
        // on files older than the generation says, and the first request
        // verifies the certificate again (`Peer`).
        let seen = self.live.generation();
        let tls = self.live.tls();
        async move {
            let addr = s.peer_addr()?.to_string();
            let tls = tls.ok_or_else(|| std::io::Error::other("no TLS configuration is loaded"))?;
            let stream = match tokio_rustls::TlsAcceptor::from(tls.config).accept(s).into_fallible().await {
                Ok(stream) => stream,
                Err((e, tcp)) => {
                    HANDSHAKES_REFUSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::debug!(client = %addr, error = %e, "TLS handshake refused");
                    // On a task of its own, so the header timeout cannot cut it short.
                    tokio::spawn(linger(tcp));
                    return Err(e);
                }
            };
            // rustls verified it against the client CA and the CRLs.
            let chain = stream.get_ref().1.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
            Ok((stream, Proof::Tls { addr, chain, seen }))
        }
    }
}

/// Closes a connection whose handshake failed so that its client reads the
/// alert that says why: the alert was written; a FIN follows it, and what
/// the client sent meanwhile (its request, in TLS 1.3) is read and dropped
/// until it closes (2 s at most). Closed with that request unread, the
/// socket would answer a reset, which can overtake the alert.
async fn linger(mut tcp: tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let _ = tcp.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async { while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), drain).await;
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

/// TLS handshakes that failed: a certificate refused (unknown CA, revoked,
/// expired), or a client that gave up (`/metrics`).
static HANDSHAKES_REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Control-plane connections accepted since the daemon started.
pub fn accepted_connections() -> u64 {
    ACCEPTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// TLS handshakes that failed since the daemon started.
pub fn handshakes_refused() -> u64 {
    HANDSHAKES_REFUSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open
/// requests finish (up to `drain` long). Callers are resolved by `live`'s
/// rules, again on the next request after each reload.
pub async fn serve<L: Accept>(
    listener: L,
    live: Arc<super::reload::Live>,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
    drain: std::time::Duration,
) {
    let open = Arc::new(Semaphore::new(limits.max_http_connections));
    let (stopping, stop) = watch::channel(false);
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
        let pending = listener.establish(raw);
        let (live, app, mut stop) = (live.clone(), app.clone(), stop.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let established = tokio::select! {
                r = tokio::time::timeout(limits.header_timeout, pending) => r,
                // Stopping: a handshake not done yet holds up no drain.
                Ok(_) = stop.wait_for(|s| *s) => return,
            };
            let (io, proof) = match established {
                Ok(Ok(established)) => established,
                Ok(Err(e)) => return tracing::debug!(error = %e, "control plane handshake failed"),
                Err(_) => return tracing::debug!("control plane handshake timed out"),
            };
            let peer = match Peer::new(live, proof, limits.body_timeout) {
                Ok(peer) => Arc::new(peer),
                Err(r) => {
                    let answer = last_word("429 Too Many Requests", &ErrorBody::new(r.code, r.field, r.message));
                    return refuse(answer, io);
                }
            };
            let app = app.layer(axum::middleware::from_fn_with_state(peer, super::peer::per_request));
            let service = TowerToHyperService::new(app);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .serve_connection(TokioIo::new(super::shaped::Shaped::new(io)), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                Ok(_) = stop.wait_for(|s| *s) => {}
            }
            // Stopping: its request in flight is answered; then it closes (an idle one at once).
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        });
    }
    let _ = stopping.send(true);
    // Every connection's task holds a permit until it ends.
    let all = u32::try_from(limits.max_http_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(drain, open.acquire_many(all)).await;
}
