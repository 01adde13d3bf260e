//! Who is on the other end of a control-plane connection, request by
//! request. The transport proves an identity once, when the connection is
//! accepted ([`Proof`]: a Unix peer's credentials, a TLS client's
//! certificate chain); the rules resolve it to a [`Caller`]. After a reload
//! (`reload`) the next request on the connection is judged again: the
//! certificate against the client CA and CRLs now in force (a revoked one is
//! answered 401 and the connection closed), the identity by the rules now in
//! force (its connection counted against its new tenant's quota). A reload
//! closes no connection and loses no request. A handshake under way when a
//! reload lands is judged again on its first request.

use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rustls::pki_types::{CertificateDer, UnixTime};

use super::reload::Live;
use super::wire::ErrorBody;
use crate::protocol::Refusal;
use crate::protocol::identity::Caller;
use crate::protocol::policy::Resource;
use pdstor_client::code::RefusalCode;

/// What a connection's transport proved about its other end.
pub enum Proof {
    /// A Unix socket peer, by `SO_PEERCRED`.
    Unix {
        /// Its effective uid.
        uid: u32,
        /// Its effective gid.
        gid: u32,
        /// Its pid when it connected.
        pid: i32,
    },
    /// A plaintext TCP client (`--insecure-tcp`): nothing proven.
    Plain {
        /// Its address.
        addr: String,
    },
    /// A TLS client: the chain it presented (empty: none), which the
    /// handshake verified.
    Tls {
        /// Its address.
        addr: String,
        /// Its certificate, then the intermediates it sent.
        chain: Vec<CertificateDer<'static>>,
        /// The reload generation read before the handshake took its TLS
        /// files: a later one means the chain is verified again.
        seen: u64,
    },
}

/// One connection's other end: its proof, and who the rules of which reload
/// made it.
pub struct Peer {
    live: Arc<Live>,
    proof: Proof,
    now: Mutex<(u64, Caller)>,
    body_timeout: std::time::Duration,
}

impl Peer {
    /// Resolves `proof` by the rules in force, and counts the connection
    /// against its tenant's quota (refused: over it). A refusal's request
    /// body is read for at most `body_timeout`.
    pub fn new(live: Arc<Live>, proof: Proof, body_timeout: std::time::Duration) -> Result<Peer, Refusal> {
        let generation = match &proof {
            // As of its handshake: a reload since, and the first request verifies again.
            Proof::Tls { seen, .. } => *seen,
            _ => live.generation(),
        };
        let caller = resolve(&live, &proof, false)?;
        live.policy().take(&caller, Resource::Connection)?;
        Ok(Peer { live, proof, now: Mutex::new((generation, caller)), body_timeout })
    }

    /// Who the connection's next request comes from: as resolved, or
    /// resolved again when the daemon reloaded since (the connection moving
    /// to the new tenant's quota); refused when its certificate is no longer
    /// accepted or the new tenant has no connection to spare.
    pub fn caller(&self) -> Result<Caller, Refusal> {
        let generation = self.live.generation();
        let mut now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if now.0 == generation {
            return Ok(now.1.clone());
        }
        let caller = resolve(&self.live, &self.proof, true)?;
        if caller.tenant != now.1.tenant {
            let policy = self.live.policy();
            policy.take(&caller, Resource::Connection)?;
            policy.give(&now.1, Resource::Connection);
        }
        *now = (generation, caller.clone());
        Ok(caller)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        self.live.policy().give(&now.1, Resource::Connection);
    }
}

/// Who `proof` is by the rules in force; `again`: the handshake was under
/// earlier TLS files, so its certificate is verified against these first.
fn resolve(live: &Live, proof: &Proof, again: bool) -> Result<Caller, Refusal> {
    let rules = live.policy().rules();
    Ok(match proof {
        Proof::Unix { uid, gid, pid } => rules.unix(*uid, *gid, *pid),
        Proof::Plain { addr } => rules.plaintext(addr.clone()),
        Proof::Tls { addr, chain, .. } => match chain.split_first() {
            None => rules.anonymous_tls(addr.clone()),
            Some((cert, intermediates)) => {
                if again {
                    still_accepted(live, cert, intermediates)?;
                }
                rules.certificate(super::tls::names(cert), addr.clone())
            }
        },
    })
}

/// Refuses a certificate the client CA and CRLs now in force do not accept.
fn still_accepted(live: &Live, cert: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> Result<(), Refusal> {
    let Some(tls) = live.tls() else { return Ok(()) };
    match tls.verifier.verify_client_cert(cert, intermediates, UnixTime::now()) {
        Ok(_) => Ok(()),
        Err(e) => Err(Refusal::new(
            RefusalCode::Unauthenticated,
            "certificate",
            format!(
                "this connection's client certificate is no longer accepted by the client CA and CRLs in force: {e}; nothing was done. Ask the daemon's operator for a certificate it accepts"
            ),
        )),
    }
}

/// Middleware: puts the request's [`Caller`] in its extensions, or answers
/// the refusal and closes the connection.
pub async fn per_request(State(peer): State<Arc<Peer>>, mut req: Request, next: Next) -> Response {
    #[cfg(debug_assertions)]
    planted_leak();
    match peer.caller() {
        Ok(caller) => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Err(r) => {
            // Read what the client sends first: answering over a body still
            // being sent would cut it off mid-write instead of telling it why.
            let _ = tokio::time::timeout(peer.body_timeout, axum::body::to_bytes(req.into_body(), 1 << 20)).await;
            let body = ErrorBody::new(r.code, r.field, r.message);
            let status =
                axum::http::StatusCode::from_u16(body.status).unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
            let headers =
                [(axum::http::header::CONTENT_TYPE, "application/json"), (axum::http::header::CONNECTION, "close")];
            (status, headers, serde_json::to_vec(&body).unwrap_or_default()).into_response()
        }
    }
}

/// A fault for `cargo xtask soak --plant-leak`, which checks that the soak
/// catches a leak: with `PDSTOR_DEBUG_LEAK_FD_PER_REQUEST` set, a debug
/// build leaks one descriptor per control-plane request. Release builds
/// have no such code.
#[cfg(debug_assertions)]
fn planted_leak() {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("PDSTOR_DEBUG_LEAK_FD_PER_REQUEST").is_some())
        && let Ok(f) = std::fs::File::open("/dev/null")
    {
        std::mem::forget(f);
    }
}
