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

use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub mod adoptions;
pub mod code;
pub mod frame;
pub mod handoff;
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
mod data;
mod http1;
mod reader;
mod remote;
mod spec;
mod step_de;
mod transport;
mod verify;
mod writer;

use crate::layout::{Layout, Manifest};
use crate::receipt::{Receipt, manifest_digest};
use crate::wire::*;
use transport::{Daemon, Failed, Transport, host_port, not_the_owner};

pub use batch::{Outcomes, StoreItem};
pub use data::{DataConn, Place};
pub use reader::{Reader, Restored};
pub use remote::{Judge, RemoteReader};
pub use spec::{BufferSpec, Exporter};
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

/// The HTTP control plane: one daemon, or the daemons that may own the
/// namespace (see [`Client::new`]).
pub struct Client {
    daemons: Vec<Daemon>,
    /// The daemon that answered as the owner last (with several).
    current: std::sync::atomic::AtomicUsize,
    base: String,
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
