#![warn(missing_docs)]
//! `pdstor-client`: everything a writer or a reader links to hand KV cache
//! through a `pdstor serve` daemon, and nothing of the daemon itself — no
//! HTTP server, no async runtime, no eBPF.
//!
//! - the vocabulary both ends share: [`wire`] (every control- and data-plane
//!   body), [`layout`] (the KV layout and a READY publication's manifest),
//!   [`receipt`] (receipts and the digests that bind manifests and restores),
//!   [`code`] (every refusal code with its HTTP and exit status), [`frame`]
//!   (the data plane's framing), [`timeline`] (the causal timeline's lines and
//!   their writer), [`superblock`] (the on-media root a reader host checks);
//! - the client: [`Client`] speaks the HTTP control plane (over the Unix
//!   socket, or mutual TLS with [`tls`]); [`DataConn`] the data plane (buffers
//!   registered once, by fd, and reused); [`Writer`] and [`Reader`] run the
//!   whole of `prepare → store → publish` and `claim → adopt → load → ack`,
//!   verifying every restored chunk's crc32c; [`RemoteReader`] reads a shared
//!   namespace itself, from another host.
#![deny(clippy::unwrap_used)]

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

use pdstor_engine::buffer::BufferKind;
use pdstor_engine::{Buffer, PayloadPath};

pub mod code;
pub mod frame;
pub mod layout;
pub mod many;
pub mod private;
pub mod read;
pub mod receipt;
pub mod superblock;
pub mod timeline;
pub mod tls;
pub mod wire;

mod batch;
mod http1;
mod reader;
mod remote;
mod step_de;
mod verify;
mod writer;

use crate::frame::{read_frame, write_frame};
use crate::layout::{Layout, Manifest};
use crate::receipt::{Receipt, manifest_digest};
use crate::wire::*;

pub use batch::{Outcomes, StoreItem};
pub use reader::{Reader, Restored};
pub use remote::{Judge, RemoteReader};
pub use verify::{LoadChecks, Verify, reported_checksums};
pub use writer::Writer;

/// What a client call failed on.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon refused or failed the step.
    #[error("{0}")]
    Api(ErrorBody),
    /// The daemon could not be reached or answered nonsense.
    #[error("talking to the daemon at {url}: {message} (is `pdstor serve` running?)")]
    Transport {
        /// The URL asked.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The data plane failed (socket, frame, buffer).
    #[error("data plane: {0}")]
    Data(String),
    /// A restored chunk's bytes do not match its checksum.
    #[error("restored chunk {chunk} fails verification: {what}")]
    Verify {
        /// The chunk.
        chunk: u32,
        /// How.
        what: String,
    },
}

/// `manifest` if it is the one a claim receipt names by `digest`.
fn the_one_claimed(manifest: Manifest, digest: &str) -> Result<Manifest, ClientError> {
    if manifest_digest(&manifest) != digest {
        return Err(ClientError::Verify { chunk: 0, what: "the adopted manifest is not the one claimed".into() });
    }
    Ok(manifest)
}

/// The uid serving a connected Unix socket (`SO_PEERCRED`).
pub fn peer_uid(stream: &impl std::os::fd::AsFd) -> std::io::Result<u32> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).map(|c| c.uid()).map_err(std::io::Error::from)
}

/// Refuses a daemon socket served by anyone but root, this user, or
/// `PDSTOR_DAEMON_UID` (`SO_PEERCRED`): a request, a receipt or a buffer is
/// never handed to whoever squats a socket path.
pub(crate) fn trusted_daemon(stream: &UnixStream, path: &Path) -> Result<(), String> {
    let peer = peer_uid(stream).map_err(|e| format!("asking who serves {}: {e}", path.display()))?;
    let me = nix::unistd::geteuid().as_raw();
    let expected: Option<u32> = std::env::var("PDSTOR_DAEMON_UID").ok().and_then(|v| v.parse().ok());
    let trusted = match expected {
        Some(uid) => peer == uid,
        None => peer == 0 || peer == me,
    };
    if trusted {
        return Ok(());
    }
    let want = expected.map_or_else(|| format!("root or you (uid {me})"), |u| format!("uid {u} (PDSTOR_DAEMON_UID)"));
    Err(format!(
        "{} is served by uid {peer}, not {want}: refusing to share buffers or requests with it (another user may be squatting the path); set PDSTOR_DAEMON_UID={peer} if that is your daemon",
        path.display()
    ))
}

/// How the client reaches the control plane.
enum Transport {
    /// `unix:/run/pdstor/control.sock`, its connections kept alive.
    Unix(http1::UnixPool),
    /// `https://host:port`: mutual TLS (or why its files could not be read).
    Tls { host: String, port: u16, config: Result<std::sync::Arc<rustls::ClientConfig>, String> },
    /// `http://host:port` (a daemon run with `--insecure-tcp`).
    Http(ureq::Agent),
}

/// The TLS files `https://` uses: `PDSTOR_TLS_CA` (the daemon's CA), and
/// `PDSTOR_TLS_CERT` with `PDSTOR_TLS_KEY` (this client's certificate).
fn tls_from_env() -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    let var = |n: &str| std::env::var_os(n).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    let ca = var("PDSTOR_TLS_CA")
        .ok_or("an https:// server needs PDSTOR_TLS_CA, the CA that signed the daemon's certificate")?;
    match (var("PDSTOR_TLS_CERT"), var("PDSTOR_TLS_KEY")) {
        (Some(c), Some(k)) => crate::tls::client_config(&ca, Some((&c, &k))),
        (None, None) => crate::tls::client_config(&ca, None),
        _ => Err("PDSTOR_TLS_CERT and PDSTOR_TLS_KEY go together: give both, or neither".into()),
    }
}

/// `host:port` of an `https://` URL.
fn host_port(rest: &str) -> Result<(String, u16), String> {
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("https://{authority} names no port"))?;
    let port = port.parse().map_err(|_| format!("https://{authority}: {port:?} is not a port"))?;
    Ok((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port))
}

/// The HTTP control plane: one daemon, or the daemons that may own the
/// namespace (see [`Client::new`]).
pub struct Client {
    daemons: Vec<Daemon>,
    /// The daemon that answered as the owner last (with several).
    current: std::sync::atomic::AtomicUsize,
    base: String,
}

/// One daemon's address and how it is reached.
struct Daemon {
    transport: Transport,
    base: String,
}

/// A request that failed: whether it provably never reached the daemon (no
/// connection was made), so it may go to another.
enum Failed {
    NotSent(ClientError),
    Unknown(ClientError),
}

impl Daemon {
    fn new(base: &str, several: bool) -> Daemon {
        let base = base.trim().trim_end_matches('/').to_owned();
        let transport = if let Some(path) = base.strip_prefix("unix:") {
            Transport::Unix(http1::UnixPool::new(path.trim_start_matches("//").into()))
        } else if let Some(rest) = base.strip_prefix("https://") {
            match host_port(rest) {
                Ok((host, port)) => Transport::Tls { host, port, config: tls_from_env() },
                Err(e) => Transport::Tls { host: String::new(), port: 0, config: Err(e) },
            }
        } else {
            // Idle connections are dropped well before the daemon closes them
            // (`--header-timeout-ms`, 10 s by default), so a pooled connection
            // is never one the daemon has already forgotten. Among several
            // owners nothing is pooled: a host that lost its power and booted
            // again within seconds (its standby took over meanwhile) answers
            // a step sent on an old connection with a reset, whose fate the
            // client cannot know, whereas a new connection to it is refused —
            // provably never sent — and the step goes on to the next address.
            // There a silent host's connect gives up after 3 s.
            let (idle, per_host) = if several { (0, 0) } else { (10, 3) };
            let config = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_idle_age(std::time::Duration::from_secs(4))
                .max_idle_connections(idle)
                .max_idle_connections_per_host(per_host)
                .timeout_connect(several.then(|| std::time::Duration::from_secs(3)))
                .build();
            Transport::Http(config.into())
        };
        Daemon { transport, base }
    }

    /// Sends one request; answers the status and body.
    fn exchange(&self, method: &str, path: &str, json: Option<&[u8]>) -> Result<(u16, Vec<u8>), Failed> {
        let url = format!("{}{path}", self.base);
        let transport = |message: String| {
            // Every transport says "connecting to …" when no connection was made.
            let e = ClientError::Transport { url: url.clone(), message: message.clone() };
            if message.starts_with("connecting to") { Failed::NotSent(e) } else { Failed::Unknown(e) }
        };
        match &self.transport {
            Transport::Unix(pool) => {
                let a = pool.request(method, path, json).map_err(transport)?;
                Ok((a.status, a.body))
            }
            Transport::Tls { host, port, config } => {
                let config = config
                    .as_ref()
                    .map_err(|e| Failed::NotSent(ClientError::Transport { url: url.clone(), message: e.clone() }))?;
                let a = http1::tls(config, host, *port, method, path, json).map_err(|f| match f {
                    http1::TlsFailed::Other(message) => transport(message),
                    // Final: the handshake failed before the request was read.
                    http1::TlsFailed::CertificateRefused(why) => Failed::Unknown(ClientError::Api(ErrorBody::new(
                        crate::code::RefusalCode::Unauthenticated,
                        "certificate",
                        format!(
                            "the daemon at {} refused this client's certificate in the TLS handshake: {why}; nothing was done. Ask its operator for a certificate it accepts (PDSTOR_TLS_CERT, PDSTOR_TLS_KEY)",
                            self.base
                        ),
                    ))),
                })?;
                Ok((a.status, a.body))
            }
            Transport::Http(agent) => {
                let resp = match json {
                    Some(body) => agent.post(&url).content_type("application/json").send(body),
                    None => agent.get(&url).call(),
                };
                let mut resp = resp.map_err(|e| {
                    let not_sent = match &e {
                        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => true,
                        ureq::Error::Timeout(t) => matches!(t, ureq::Timeout::Connect | ureq::Timeout::Resolve),
                        ureq::Error::Io(io) => matches!(
                            io.kind(),
                            std::io::ErrorKind::ConnectionRefused
                                | std::io::ErrorKind::HostUnreachable
                                | std::io::ErrorKind::NetworkUnreachable
                        ),
                        _ => false,
                    };
                    match not_sent {
                        true => transport(format!("connecting to {}: {e}", self.base)),
                        false => transport(e.to_string()),
                    }
                })?;
                let status = resp.status().as_u16();
                let body = resp
                    .body_mut()
                    .with_config()
                    .limit(256 << 20)
                    .read_to_vec()
                    .map_err(|e| transport(e.to_string()))?;
                Ok((status, body))
            }
        }
    }
}

/// Why a daemon's answer says it is not the namespace's owner now: a
/// standby, an owner that lost the namespace, or a daemon that serves
/// another namespace than the receipt's — each refused before doing
/// anything, so the step may go to the next address.
fn not_the_owner(path: &str, status: u16, body: &[u8]) -> Option<String> {
    if path == "/healthz" && status == 200 && body.starts_with(b"standby") {
        return Some("standby".into());
    }
    let passes = |code: &str| matches!(code, "standby" | "namespace_lost" | "namespace_mismatch");
    if path == "/storage-pd/batch" && status == 200 {
        // A batch every step of which was refused so did nothing either: a
        // batch of one is how a single step goes, and it fails over as the
        // step's own route would.
        let answer: BatchResponse = serde_json::from_slice(body).ok()?;
        let codes: Vec<&str> =
            answer.results.iter().map(|r| r.error.as_ref().map_or("", |e| e.code.as_str())).collect();
        return (!codes.is_empty() && codes.iter().all(|c| passes(c))).then(|| codes[0].to_owned());
    }
    let b: ErrorBody = serde_json::from_slice(body).ok()?;
    passes(&b.code).then_some(b.code)
}

impl Client {
    /// `base` is `unix:/path/to/control.sock` (the default),
    /// `https://host:port` (mutual TLS with the files `PDSTOR_TLS_CA`,
    /// `PDSTOR_TLS_CERT` and `PDSTOR_TLS_KEY` name) or `http://host:port`
    /// (a daemon serving plaintext TCP).
    ///
    /// Or several such addresses, comma-separated: the namespace's owner
    /// and its standbys (docs/owners.md). Each step goes to the daemon that
    /// answered as the owner last; one that answers `standby`,
    /// `namespace_lost` or `namespace_mismatch` (a receipt of another
    /// namespace), or that could not be connected to at all, did nothing,
    /// and the step goes to the next address. A step whose fate is unknown
    /// (the connection broke after it was sent) is never sent elsewhere.
    pub fn new(base: &str) -> Client {
        let addresses: Vec<&str> = base.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
        let several = addresses.len() > 1;
        let daemons = match addresses.is_empty() {
            true => vec![Daemon::new(base, false)],
            false => addresses.iter().map(|a| Daemon::new(a, several)).collect(),
        };
        Client { daemons, current: Default::default(), base: base.trim_end_matches('/').to_owned() }
    }

    /// `https://host:port` with these TLS files instead of the environment's:
    /// `ca` signed the daemon's certificate; `cert` is this client's
    /// certificate and key (without one the daemon answers 401).
    pub fn with_tls(base: &str, ca: &Path, cert: Option<(&Path, &Path)>) -> Client {
        let base = base.trim_end_matches('/').to_owned();
        let rest = base.strip_prefix("https://").unwrap_or(&base);
        let transport = match host_port(rest) {
            Ok((host, port)) => Transport::Tls { host, port, config: crate::tls::client_config(ca, cert) },
            Err(e) => Transport::Tls { host: String::new(), port: 0, config: Err(e) },
        };
        Client { daemons: vec![Daemon { transport, base: base.clone() }], current: Default::default(), base }
    }

    /// Sends one request to the owner; answers the status and body.
    fn exchange(&self, method: &str, path: &str, json: Option<Vec<u8>>) -> Result<(u16, Vec<u8>), ClientError> {
        use std::sync::atomic::Ordering;
        if let [one] = &self.daemons[..] {
            return one.exchange(method, path, json.as_deref()).map_err(|(Failed::NotSent(e) | Failed::Unknown(e))| e);
        }
        let n = self.daemons.len();
        let start = self.current.load(Ordering::Relaxed);
        let (mut passed, mut last_refusal) = (Vec::new(), None);
        for k in 0..n {
            let i = (start + k) % n;
            let d = &self.daemons[i];
            match d.exchange(method, path, json.as_deref()) {
                Ok((status, body)) => match not_the_owner(path, status, &body) {
                    Some(why) => {
                        passed.push(format!("{}: {why}", d.base));
                        last_refusal = Some((status, body));
                    }
                    None => {
                        self.current.store(i, Ordering::Relaxed);
                        return Ok((status, body));
                    }
                },
                Err(Failed::NotSent(e)) => passed.push(e.to_string()),
                Err(Failed::Unknown(e)) => return Err(e),
            }
        }
        match last_refusal {
            Some(answer) => Ok(answer),
            None => Err(ClientError::Transport {
                url: format!("{}{path}", self.base),
                message: format!("none of the {n} daemons could be reached: {}", passed.join("; ")),
            }),
        }
    }

    /// The error body of a refused request.
    fn refused(&self, path: &str, status: u16, body: &[u8]) -> ClientError {
        match serde_json::from_slice::<ErrorBody>(body) {
            Ok(b) => ClientError::Api(b),
            Err(e) => ClientError::Transport {
                url: format!("{}{path}", self.base),
                message: format!("HTTP {status} with a body that is not the error shape: {e}"),
            },
        }
    }

    fn post<Req: Serialize, Resp: DeserializeOwned>(&self, path: &str, req: &Req) -> Result<Resp, ClientError> {
        let json = serde_json::to_vec(req).map_err(|e| ClientError::Data(e.to_string()))?;
        let (status, body) = self.exchange("POST", path, Some(json))?;
        if status != 200 {
            return Err(self.refused(path, status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Transport {
            url: format!("{}{path}", self.base),
            message: format!("the answer is not the expected JSON: {e}"),
        })
    }

    fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let (status, body) = self.exchange("GET", path, None)?;
        if status != 200 {
            return Err(self.refused(path, status, &body));
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `GET /healthz`: `Ok` while the daemon answers and its store has not failed.
    pub fn healthz(&self) -> Result<(), ClientError> {
        self.get_text("/healthz").map(|_| ())
    }

    /// `prepare`: reserves `total_chunks` for `req_id`.
    pub fn prepare(
        &self,
        req_id: &str,
        layout: &Layout,
        total_chunks: u32,
        writer: &str,
    ) -> Result<Prepared, ClientError> {
        self.prepare_request(&PrepareRequest {
            req_id: req_id.into(),
            layout: layout.clone(),
            total_chunks,
            writer: writer.into(),
            timeout_ms: None,
            unread_release_ms: None,
            cache: false,
        })
    }

    /// `prepare` as the wire carries it (with its own `timeout_ms`, say).
    pub fn prepare_request(&self, r: &PrepareRequest) -> Result<Prepared, ClientError> {
        self.post("/storage-pd/prepare", r)
    }

    /// `cancel`: gives up request `req_id`, waiting or PREPARED. Idempotent.
    pub fn cancel(&self, req_id: &str) -> Result<CancelOutcome, ClientError> {
        self.post("/storage-pd/cancel", &CancelRequest { req_id: req_id.into() })
    }
    /// `publish`: the publication becomes READY; returns its receipt and
    /// manifest. `writer_token` is the one its `prepare` answered.
    pub fn publish(
        &self,
        publication: u64,
        writer_token: &str,
        first_token: Option<u32>,
    ) -> Result<Published, ClientError> {
        let r = PublishRequest { publication, writer_token: writer_token.into(), first_token };
        self.post("/storage-pd/publish", &r)
    }
    /// `claim`: binds `reader` and `session` to a READY publication; returns the claim receipt.
    pub fn claim(&self, ready: &Receipt, reader: &str, session: &str, lease_ms: u64) -> Result<Receipt, ClientError> {
        self.claim_request(ready, reader, session, lease_ms, None)
    }
    /// `claim` naming the layout this reader will adopt with: a publication
    /// stored with another layout is refused `layout_mismatch` and stays
    /// READY for a reader that can restore it (a plain `claim` would take it
    /// and leave it RETAINED when `adopt` refuses the layout).
    pub fn claim_for(
        &self,
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
        layout: &Layout,
    ) -> Result<Receipt, ClientError> {
        self.claim_request(ready, reader, session, lease_ms, Some(layout.clone()))
    }
    fn claim_request(
        &self,
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
        layout: Option<Layout>,
    ) -> Result<Receipt, ClientError> {
        let r = ClaimRequest::new(ready, reader, session, lease_ms, layout, false);
        self.post::<_, ReceiptResponse>("/storage-pd/claim", &r).map(|r| r.receipt)
    }

    /// `claim` with `adopt`: claims `ready` and adopts it through the daemon
    /// with `layout` in one round trip; the claim receipt and the adopt's
    /// outcome — its manifest, checked to be the one claimed, or why not
    /// (then the claim stands: report it failed, or adopt it again).
    pub fn claim_and_adopt(
        &self,
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
        layout: &Layout,
    ) -> Result<(Receipt, Result<Manifest, ClientError>), ClientError> {
        let r = ClaimRequest::new(ready, reader, session, lease_ms, Some(layout.clone()), true);
        let answer = self.post::<_, ReceiptResponse>("/storage-pd/claim", &r)?;
        Ok(self.adopted_by_claim(answer, layout))
    }

    /// What a claim with `adopt` answered: its receipt and the adopt's
    /// outcome. A daemon from before `adopt` answers the receipt only: it is
    /// adopted here then, with a round trip of its own.
    pub(crate) fn adopted_by_claim(
        &self,
        answer: ReceiptResponse,
        layout: &Layout,
    ) -> (Receipt, Result<Manifest, ClientError>) {
        let adopted = match (answer.manifest, answer.adopt_refused) {
            (Some(m), _) => the_one_claimed(m, &answer.receipt.manifest_digest),
            (None, Some(refused)) => Err(ClientError::Api(refused)),
            (None, None) => self.adopt_claim(&answer.receipt, layout),
        };
        (answer.receipt, adopted)
    }
    /// `adopt`: the claimed reader confirms what it reads; returns the manifest.
    pub fn adopt(&self, req: &AdoptRequest) -> Result<Manifest, ClientError> {
        self.post("/storage-pd/adopt", req)
    }

    /// `adopt` of a claim with every field taken from the claim receipt
    /// ([`AdoptRequest::of_claim`]), then the check that the manifest
    /// answered is the one claimed.
    pub fn adopt_claim(&self, claim: &Receipt, layout: &Layout) -> Result<Manifest, ClientError> {
        let manifest = self.adopt(&AdoptRequest::of_claim(claim, layout.clone()))?;
        the_one_claimed(manifest, &claim.manifest_digest)
    }

    /// `ack`: the restore is done; the slots free.
    pub fn ack(&self, claim: &Receipt, restore: &str) -> Result<(), ClientError> {
        self.post::<_, Done>("/storage-pd/ack", &AckRequest { receipt: claim.clone(), restore_digest: restore.into() })
            .map(drop)
    }
    /// `GET namespace`: the namespace the owner serves and its device's NVMe identifiers.
    pub fn namespace(&self) -> Result<crate::wire::NamespaceInfo, ClientError> {
        serde_json::from_str(&self.get_text("/storage-pd/namespace")?)
            .map_err(|e| ClientError::Data(format!("namespace: {e}")))
    }
    /// `loaded`: the chunks this reader read itself from the shared
    /// namespace, with the crc32c of what it read; the daemon checks them
    /// against the stored ones and lets the claim's ack count them.
    pub fn loaded(&self, claim: &Receipt, chunks: &[crate::wire::LoadedChunk]) -> Result<(), ClientError> {
        let req = crate::wire::LoadedRequest { receipt: claim.clone(), chunks: chunks.to_vec() };
        self.post::<_, Done>("/storage-pd/loaded", &req).map(drop)
    }
    /// `release`: a READY publication never claimed is freed.
    pub fn release(&self, ready: &Receipt) -> Result<(), ClientError> {
        self.post::<_, Done>("/storage-pd/release", &ReceiptOnly { receipt: ready.clone() }).map(drop)
    }
    /// `lookup`: the READY receipt of each request named, or `None` where
    /// there is none this caller may claim or release.
    pub fn lookup(&self, req_ids: &[String]) -> Result<Vec<Option<Receipt>>, ClientError> {
        let r = LookupRequest { req_ids: req_ids.to_vec() };
        self.post::<_, LookupResponse>("/storage-pd/lookup", &r).map(|r| r.receipts)
    }
    /// `abort`: rolls back a publication that is not READY (with the
    /// writer's token its `prepare` answered).
    pub fn abort(&self, publication: u64, writer_token: &str) -> Result<AbortResponse, ClientError> {
        self.post("/storage-pd/abort", &AbortRequest { publication, writer_token: writer_token.into() })
    }
    /// `fail`: a failed or uncertain read; the publication is RETAINED.
    pub fn fail(&self, claim: &Receipt, reason: &str) -> Result<(), ClientError> {
        self.post::<_, Done>("/storage-pd/fail", &FailRequest { receipt: claim.clone(), reason: reason.into() })
            .map(drop)
    }
    /// `reclaim`: frees a fenced reader's claim.
    pub fn reclaim(&self, claim: &Receipt) -> Result<(), ClientError> {
        self.post::<_, Done>("/storage-pd/reclaim", &ReceiptOnly { receipt: claim.clone() }).map(drop)
    }

    /// `admin/reclaim`: an admin frees a claimed or retained publication by
    /// number, fencing its claim's session first (no claim receipt needed).
    pub fn reclaim_publication(&self, publication: u64, reason: &str) -> Result<(), ClientError> {
        let body = OperatorReclaimRequest { publication, reason: reason.into() };
        self.post::<_, Done>("/storage-pd/admin/reclaim", &body).map(drop)
    }
    /// `admin/takeover`, to a standby (`serve --standby`): it preempts the
    /// namespace's owner and serves it as its owner from a new epoch.
    pub fn takeover(&self) -> Result<crate::wire::TakeoverAnswer, ClientError> {
        self.post("/storage-pd/admin/takeover", &serde_json::json!({}))
    }
    /// `admin/end-reads`: an admin ends every read of the cache publication
    /// `publication` (their reader gone), for `reason`; answers how many.
    pub fn end_reads_of(&self, publication: u64, reason: &str) -> Result<u64, ClientError> {
        let body = crate::wire::OperatorEndReadsRequest { publication, reason: reason.into() };
        self.post::<_, crate::wire::EndedReads>("/storage-pd/admin/end-reads", &body).map(|e| e.ended)
    }

    /// `session/close`: fences a reader session.
    pub fn close_session(&self, claim: &Receipt) -> Result<(), ClientError> {
        self.post::<_, Done>("/storage-pd/session/close", &SessionCloseRequest { receipt: claim.clone() }).map(drop)
    }
    /// Live publications, of one state if given; `verbose` adds each
    /// chunk's extent on the target.
    pub fn publications(&self, state: Option<&str>, verbose: bool) -> Result<Vec<PublicationInfo>, ClientError> {
        let mut query: Vec<String> = state.map(|s| format!("state={s}")).into_iter().collect();
        if verbose {
            query.push("verbose=1".into());
        }
        let path = if query.is_empty() {
            "/storage-pd/publications".to_owned()
        } else {
            format!("/storage-pd/publications?{}", query.join("&"))
        };
        serde_json::from_str(&self.get_text(&path)?).map_err(|e| ClientError::Data(format!("publications: {e}")))
    }
    /// `/metrics`, as Prometheus text.
    pub fn metrics(&self) -> Result<String, ClientError> {
        self.get_text("/metrics")
    }
}

/// A data-plane connection.
pub struct DataConn {
    stream: UnixStream,
    /// The socket, to connect again while nothing is registered.
    path: std::path::PathBuf,
    /// Whether a buffer was registered on this connection (the daemon closes
    /// one holding none after `--data-idle-timeout-ms` without a request).
    registered: bool,
}

impl DataConn {
    /// Connects to the daemon's data socket at `path`.
    ///
    /// The daemon must run as root, as this user, or as `PDSTOR_DAEMON_UID`
    /// (`SO_PEERCRED`): a buffer is never handed to whoever squats a socket path.
    pub fn connect(path: &Path) -> Result<DataConn, ClientError> {
        let stream = UnixStream::connect(path).map_err(|e| {
            ClientError::Data(format!("connecting to {}: {e} (is `pdstor serve` running?)", path.display()))
        })?;
        trusted_daemon(&stream, path).map_err(ClientError::Data)?;
        Ok(DataConn { stream, path: path.into(), registered: false })
    }

    /// The daemon's process id (`SO_PEERCRED`), e.g. to read its CPU time.
    pub fn daemon_pid(&self) -> std::io::Result<i32> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        getsockopt(&self.stream, PeerCredentials).map(|c| c.pid()).map_err(std::io::Error::from)
    }

    /// Whether the daemon hung up on this idle connection: with no request
    /// outstanding, anything to read (its last word, or the end) says so.
    fn hung_up(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    fn call(&mut self, req: &DataRequest, fds: &[i32]) -> Result<DataResponse, ClientError> {
        // Nothing registered, nothing lost: a connection the daemon closed as
        // idle is replaced before the request goes out.
        if !self.registered && self.hung_up() {
            *self = DataConn::connect(&self.path)?;
        }
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Data(e.to_string()))?;
        if let Err(e) = write_frame(&mut self.stream, &body, fds) {
            // A daemon that hung up (over a limit, or this connection idle
            // too long) says why first: that answer, if it came, is the error.
            let _ = self.stream.set_read_timeout(Some(std::time::Duration::from_secs(1)));
            let said = read_frame(&mut self.stream).ok().flatten();
            let why = said.and_then(|(b, _)| serde_json::from_slice::<DataResponse>(&b).ok()).and_then(|r| r.error);
            let _ = self.stream.set_read_timeout(None);
            return Err(why.map_or_else(|| ClientError::Data(format!("sending: {e}")), ClientError::Api));
        }
        let (resp, _) = read_frame(&mut self.stream)
            .map_err(|e| ClientError::Data(format!("receiving: {e}")))?
            .ok_or_else(|| ClientError::Data("the daemon closed the data socket".into()))?;
        let resp: DataResponse = serde_json::from_slice(&resp).map_err(|e| ClientError::Data(e.to_string()))?;
        match resp.error {
            Some(e) => Err(ClientError::Api(e)),
            None => Ok(resp),
        }
    }

    /// Shares a buffer with the daemon for `host_fixed`; returns its id on
    /// this connection. One over 1 GiB (a whole LMCache pool, say) is
    /// registered in 1 GiB windows, each a table entry of the daemon's.
    pub fn register(&mut self, buffer: &Buffer) -> Result<u32, ClientError> {
        self.register_for(buffer, PayloadPath::HostFixed)
    }

    /// Shares a buffer with the daemon for `path`: a memfd buffer sends its
    /// memfd, a shm file buffer its file; a DMA-BUF sends the DMA-BUF and, for a udmabuf, the memfd behind
    /// it (so host paths can map it). The daemon refuses, holding nothing, if
    /// the path cannot take the buffer.
    pub fn register_for(&mut self, buffer: &Buffer, path: PayloadPath) -> Result<u32, ClientError> {
        self.register_checked(buffer, path, true)
    }

    /// [`DataConn::register_for`]; with `checked` false, the daemon does not
    /// checksum loads into it (it answers their chunks `unverified`): a
    /// staging buffer whose reader checks each chunk as it copies it out
    /// ([`Buffer::copy_out_checked`]: one pass over the bytes, not two), or
    /// a benchmark's [`Verify::None`]. Stores from it are checked as ever.
    pub fn register_checked(&mut self, buffer: &Buffer, path: PayloadPath, checked: bool) -> Result<u32, ClientError> {
        let (kind, fds) = match (buffer.dmabuf(), buffer.memfd_fd()) {
            (None, Some(m)) if buffer.kind() == BufferKind::ShmFile => (SharedKind::Shm, vec![m.as_raw_fd()]),
            (Some(d), backing) => {
                let mut fds = vec![d.fd().as_raw_fd()];
                fds.extend(backing.map(|m| m.as_raw_fd()));
                (SharedKind::Dmabuf, fds)
            }
            (None, Some(m)) => (SharedKind::Memfd, vec![m.as_raw_fd()]),
            (None, None) => {
                return Err(ClientError::Data(
                    "a private host buffer cannot be shared: use a memfd or a DMA-BUF buffer".into(),
                ));
            }
        };
        let r = self.call(
            &DataRequest::Register { len: buffer.len() as u64, kind, path: Some(path), unchecked: !checked },
            &fds,
        )?;
        let id = r.buffer.ok_or_else(|| ClientError::Data("register answered no buffer id".into()))?;
        self.registered = true;
        Ok(id)
    }

    /// One store batch from registered buffers, with the writer's token
    /// the publication's `prepare` answered.
    pub fn store(
        &mut self,
        publication: u64,
        writer_token: &str,
        chunks: Vec<DataChunk>,
        is_last_batch: bool,
        total_chunks: u32,
    ) -> Result<DataResponse, ClientError> {
        let writer_token = writer_token.into();
        self.call(&DataRequest::Store { publication, writer_token, chunks, is_last_batch, total_chunks }, &[])
    }

    /// Loads chunks of an adopted publication into registered buffers.
    pub fn load(&mut self, claim: &Receipt, chunks: Vec<DataChunk>) -> Result<DataResponse, ClientError> {
        self.call(&DataRequest::Load { receipt: claim.clone(), chunks, ack: false }, &[])
    }

    /// Loads the last chunks of an adopted claim and acknowledges it in the
    /// same request ([`DataConn::load_and_ack_many`] for one claim).
    pub fn load_and_ack(&mut self, claim: &Receipt, chunks: Vec<DataChunk>) -> Result<DataResponse, ClientError> {
        self.call(&DataRequest::Load { receipt: claim.clone(), chunks, ack: true }, &[])
    }

    /// Stores `chunks` of a prepared publication as one batch, each from its
    /// place in a registered buffer (checked to lie inside that buffer
    /// before anything is sent).
    pub fn store_from(
        &mut self,
        prepared: &Prepared,
        chunks: &[Place<'_>],
        is_last_batch: bool,
        total_chunks: u32,
    ) -> Result<DataResponse, ClientError> {
        let mut wire = Vec::with_capacity(chunks.len());
        for c in chunks {
            c.buffer.check_range(c.offset, c.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
            wire.push(DataChunk { index: c.index, buffer: c.buffer_id, offset: c.offset, len: c.len, crc32c: None });
        }
        self.store(prepared.publication, &prepared.writer_token, wire, is_last_batch, total_chunks)
    }

    /// Loads chunks of an adopted claim to their places and checks each
    /// one's crc32c against `manifest` ([`LoadChecks`]: as the daemon read it
    /// in place in the buffer, or computed here for what the daemon could not
    /// read and for every chunk with [`Verify::Local`]). A place's `len` is
    /// taken from the manifest. Returns each chunk's crc32c, in `places`
    /// order; any mismatch or unknown chunk is an error, never a partial
    /// result.
    pub fn load_verified(
        &mut self,
        claim: &Receipt,
        manifest: &Manifest,
        places: &[Place<'_>],
        verify: Verify,
    ) -> Result<Vec<(u32, u32)>, ClientError> {
        let mut wire = Vec::with_capacity(places.len());
        let mut lens = Vec::with_capacity(places.len());
        for p in places {
            let entry = manifest.chunks.get(p.index as usize).filter(|c| c.index == p.index).ok_or_else(|| {
                ClientError::Verify {
                    chunk: p.index,
                    what: format!("the manifest has {} chunks", manifest.chunks.len()),
                }
            })?;
            p.buffer.check_range(p.offset, entry.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
            wire.push(DataChunk { index: p.index, buffer: p.buffer_id, offset: p.offset, len: 0, crc32c: None });
            lens.push((entry.len, entry.crc32c));
        }
        let requested: Vec<u32> = wire.iter().map(|c| c.index).collect();
        let answer = self.load(claim, wire)?;
        let checks = LoadChecks::new(verify, &requested, &answer);
        places
            .iter()
            .zip(lens)
            .map(|(p, (len, want))| Ok((p.index, checks.check(p.index, p.buffer, p.offset, len, want)?)))
            .collect()
    }
}

/// One chunk's place in a registered buffer: where a store takes its bytes
/// from, or a load puts them.
pub struct Place<'a> {
    /// The chunk's index in its publication.
    pub index: u32,
    /// The buffer, as this process maps it (for range checks and checksums).
    pub buffer: &'a Buffer,
    /// The id the data connection registered it under.
    pub buffer_id: u32,
    /// Where in the buffer the chunk starts.
    pub offset: u64,
    /// Its length in bytes (a store's; a load takes the manifest's).
    pub len: u64,
}

/// Who provides a client's buffer memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Exporter {
    /// A memfd (shared memory).
    #[default]
    Memfd,
    /// A udmabuf made from a sealed memfd (`/dev/udmabuf`).
    Udmabuf,
    /// The system DMA heap (`/dev/dma_heap/system`).
    DmaHeap,
}

impl std::str::FromStr for Exporter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memfd" => Ok(Exporter::Memfd),
            "udmabuf" => Ok(Exporter::Udmabuf),
            "dma-heap" => Ok(Exporter::DmaHeap),
            _ => Err(format!("unknown buffer exporter {s:?}: expected memfd, udmabuf or dma-heap")),
        }
    }
}

impl std::fmt::Display for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Exporter::Memfd => "memfd",
            Exporter::Udmabuf => "udmabuf",
            Exporter::DmaHeap => "dma-heap",
        })
    }
}

/// A client buffer: whose memory, and the path the daemon moves it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferSpec {
    /// Whose memory.
    pub exporter: Exporter,
    /// The path the daemon moves it on.
    pub path: PayloadPath,
}

impl Default for BufferSpec {
    fn default() -> Self {
        BufferSpec { exporter: Exporter::Memfd, path: PayloadPath::HostFixed }
    }
}

impl BufferSpec {
    /// Allocates `len` bytes from the exporter.
    pub fn allocate(&self, name: &str, len: usize) -> Result<Buffer, ClientError> {
        let b = match self.exporter {
            Exporter::Memfd => Buffer::memfd(name, len),
            Exporter::Udmabuf => Buffer::udmabuf(name, len),
            Exporter::DmaHeap => Buffer::dma_heap("system", len),
        };
        b.map_err(|e| ClientError::Data(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reported_checksums_skip_unverified_chunks_and_distrust_a_short_answer() {
        let answer = DataResponse { crc32c: vec![0xa, 0xc], unverified: vec![5], ..Default::default() };
        let got = reported_checksums(&[4, 5, 6], &answer);
        assert_eq!(got, [(4, 0xa), (6, 0xc)].into_iter().collect());
        let short = DataResponse { crc32c: vec![0xa], ..Default::default() };
        assert!(reported_checksums(&[4, 5], &short).is_empty(), "a count that does not add up: check everything here");
        assert_eq!("local".parse::<Verify>(), Ok(Verify::Local));
        assert!("maybe".parse::<Verify>().is_err());
    }
}
