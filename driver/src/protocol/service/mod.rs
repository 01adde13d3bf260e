//! The protocol steps of DESIGN §4 as one service over a [`Store`]: each step
//! verifies the receipt it is given (signature, namespace, publication, state,
//! manifest digest, reader, session), then runs the store transition. The HTTP
//! control plane and the data plane are thin shells around it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use super::identity::{Caller, Role};
use super::policy::{Policy, Resource};
use super::{Clock, Receipt, ReceiptKind, Refusal, RefusalCode, Signer, SystemClock};
use std::time::Duration;

use crate::admission::CancelToken;
use crate::store::{AbortOutcome, Ask, Owner, Phase, Publication, Store, StoreError};
use pdstor_client::layout::Layout;
use pdstor_client::layout::Manifest;
use pdstor_client::receipt::restore_digest;
use pdstor_client::timeline::{Event, Timeline, emit};
use pdstor_client::wire::CancelOutcome;
use pdstor_client::wire::{AdoptRequest, PrepareRequest, Prepared, Published};

mod ack_loaded;
mod cache;
mod closed;
mod reader;
mod writer;

/// A refused or failed protocol step, as the API reports it.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The protocol refused the step (nothing changed).
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// The store refused or failed it.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The ownership protocol (DESIGN §4) over a store: receipts, leases, fencing and who may take each step.
pub struct Service {
    store: Arc<Store>,
    signer: Signer,
    clock: Arc<dyn Clock>,
    timeline: Option<Arc<Timeline>>,
    policy: Arc<Policy>,
    /// Closed sessions, by (claimant principal, session name): a session is
    /// its claimant's, so one principal cannot fence another's.
    closed_sessions: Mutex<closed::ClosedSessions>,
    /// Prepares being handled now: request → the principal that asked.
    preparing: Mutex<HashMap<String, String>>,
    /// Held (shared: publishes still share the journal's flushes) by a
    /// publish from before its publication is READY until its timeline line
    /// is written; a claim or a release passes through it exclusively first,
    /// so no step on a READY publication is recorded before the publish that
    /// made it (a reader polling `lookup` sees READY as soon as the store does).
    publishing: RwLock<()>,
    /// What the data plane served to each adopted claim: publication →
    /// (the claim's signature, chunk → crc32c as served). In memory: after a
    /// restart the reader loads again before it acks.
    served: Mutex<HashMap<u64, Served>>,
    /// The owner's persistent reservation on the namespace and its key
    /// (`serve --reservation-key`): fencing a direct reader preempts its key.
    reservations: Option<(pdstor_engine::io::persistent_reservation::Reservations, u64)>,
    /// Reads of cache publications in progress, by their receipt's signature.
    reads: Mutex<HashMap<String, cache::ReadLease>>,
    /// The last read receipt's issue time (ms): each read's is later.
    read_clock: std::sync::atomic::AtomicU64,
}

/// What the data plane served to one adopted claim: the claim's signature,
/// chunk → crc32c as served, and the chunks among them whose bytes the
/// daemon did not check (loaded where it cannot read them, or read by the
/// reader itself): only the reader's own ack can vouch for those.
type Served = (String, std::collections::BTreeMap<u32, u32>, std::collections::BTreeSet<u32>);

/// The longest id or name a client may give (request, writer, reader,
/// session, layout strings): every one is journaled, so none may be large.
pub const MAX_NAME_BYTES: usize = 256;
/// The most request ids one `lookup` may name.
pub const MAX_LOOKUP: usize = 4096;
/// The longest `fail` reason.
pub const MAX_REASON_BYTES: usize = 1024;
/// The longest lease a claim may ask for: 7 days.
pub const MAX_LEASE_MS: u64 = 7 * 24 * 3600 * 1000;

/// Refuses a client string longer than `max` bytes, naming the field.
fn bounded(field: &'static str, value: &str, max: usize) -> Result<(), Refusal> {
    if value.len() > max {
        return Err(Refusal::new(
            RefusalCode::BadRequest,
            field,
            format!("{field} is {} bytes; at most {max} are accepted", value.len()),
        ));
    }
    Ok(())
}

impl Service {
    /// The protocol over `store`, signing with its namespace's key, on the system clock.
    pub fn new(store: Arc<Store>) -> Service {
        let signer = Signer::for_namespace(&store.superblock());
        Service {
            store,
            signer,
            clock: Arc::new(SystemClock),
            timeline: None,
            policy: Arc::new(Policy::local()),
            closed_sessions: Mutex::new(closed::ClosedSessions::default()),
            preparing: Mutex::new(HashMap::new()),
            publishing: RwLock::new(()),
            served: Mutex::new(HashMap::new()),
            reservations: None,
            reads: Mutex::new(HashMap::new()),
            read_clock: Default::default(),
        }
    }

    /// Fences direct readers by preempting their keys at the target, as
    /// the holder of the namespace's Exclusive Access — All Registrants
    /// reservation with `key` (taken by [`crate::owner::hold`]).
    pub fn with_reservations(
        mut self,
        r: pdstor_engine::io::persistent_reservation::Reservations,
        key: u64,
    ) -> Service {
        self.reservations = Some((r, key));
        self
    }

    /// Whether this owner holds a reservation on its namespace.
    pub fn holds_reservation(&self) -> bool {
        self.reservations.is_some()
    }

    /// Resolves and authorizes callers by `policy` (default: [`Policy::local`]).
    pub fn with_policy(mut self, policy: Arc<Policy>) -> Service {
        self.policy = policy;
        self
    }

    /// Who is who.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// Measures claims, leases and receipts by `clock` instead of the
    /// system's (the simulation's clock moves only when it says).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Service {
        self.clock = clock;
        self
    }

    /// The time, by this service's clock.
    pub fn now_unix_ms(&self) -> u64 {
        self.clock.now_unix_ms()
    }

    /// Records every step (and, through the daemon, every refusal) on `t`.
    pub fn with_timeline(mut self, t: Option<Arc<Timeline>>) -> Service {
        self.timeline = t;
        self
    }

    /// The timeline steps are recorded on, if any.
    pub fn timeline(&self) -> &Option<Arc<Timeline>> {
        &self.timeline
    }

    /// Waits for every publish whose publication is READY but whose
    /// timeline line is not yet written (see `publishing`).
    fn after_publishes(&self) {
        drop(self.publishing.write().unwrap_or_else(|e| e.into_inner()));
    }

    /// Records a step `who` took: on the timeline, if there is one (after the
    /// step took effect and before its answer leaves, so line order is causal
    /// order), and in the log.
    fn note(&self, who: &Caller, e: Event) {
        let by = who.audit();
        tracing::info!(step = %e.event, req = e.req_id.as_deref().unwrap_or(""), publication = e.publication.unwrap_or(0), by = %by, "audit");
        emit(&self.timeline, e.by(by));
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The namespace's id (its uuid), named in every receipt.
    pub fn namespace(&self) -> &str {
        self.signer.namespace()
    }

    /// Refuses a writer's step on `publication` by anyone but its owner (or
    /// an admin), or without its writer's token.
    pub fn check_writer(&self, who: &Caller, publication: u64, writer_token: &str) -> Result<(), Refusal> {
        who.require(Role::Writer, "a writer's step")?;
        let p = self.live(publication)?;
        who.require_owner(p.owner.as_ref(), &format!("publication {publication}"))?;
        if !self.signer.is_writer_token(publication, &p.req_id, writer_token) {
            return Err(Refusal::new(
                RefusalCode::NotOwner,
                "writer_token",
                format!(
                    "publication {publication}: this is not its writer's token (the one its prepare answered): only its writer may store into, publish or abort it"
                ),
            ));
        }
        Ok(())
    }

    /// Refuses a step on the claim of `p` by anyone but its claimant (or an admin).
    fn check_claimant(who: &Caller, p: &Publication, step: &str) -> Result<(), Refusal> {
        who.require(Role::Reader, step)?;
        let claimant = p.claim.as_ref().and_then(|c| c.claimant.as_ref());
        who.require_owner(claimant, &format!("the claim on publication {}", p.id))
    }

    fn live(&self, id: u64) -> Result<Publication, Refusal> {
        self.store.publication(id).ok_or_else(|| {
            Refusal::new(RefusalCode::UnknownPublication, "publication", format!("publication {id} is not live"))
        })
    }

    fn digest_of(p: &Publication) -> Result<String, Refusal> {
        p.manifest_digest().ok_or_else(|| {
            Refusal::new(
                RefusalCode::NotReady,
                "publication",
                format!("publication {} has no manifest ({:?})", p.id, p.phase),
            )
        })
    }

    /// Checks a receipt against the live publication it names.
    fn check(&self, r: &Receipt, kind: ReceiptKind) -> Result<Publication, Refusal> {
        self.signer.verify(r)?;
        if r.kind != kind {
            return Err(Refusal::new(
                RefusalCode::WrongReceipt,
                "kind",
                format!("a {kind:?} receipt is needed, got {:?}", r.kind),
            ));
        }
        let p = self.live(r.publication)?;
        if p.req_id != r.req_id {
            return Err(Refusal::new(
                RefusalCode::ReqMismatch,
                "req_id",
                format!("publication {} is request {}", p.id, p.req_id),
            ));
        }
        if Self::digest_of(&p)? != r.manifest_digest {
            return Err(Refusal::new(
                RefusalCode::DigestMismatch,
                "manifest_digest",
                "the receipt's manifest digest is not this publication's",
            ));
        }
        if kind == ReceiptKind::Claim {
            let claim = p
                .claim
                .as_ref()
                .ok_or_else(|| Refusal::new(RefusalCode::NotClaimed, "publication", "no claim is recorded"))?;
            if r.reader.as_deref() != Some(claim.reader.as_str()) {
                return Err(Refusal::new(
                    RefusalCode::ReaderMismatch,
                    "reader",
                    format!("claimed by {}", claim.reader),
                ));
            }
            if r.session.as_deref() != Some(claim.session.as_str()) {
                return Err(Refusal::new(
                    RefusalCode::SessionMismatch,
                    "session",
                    "the claim belongs to another session",
                ));
            }
            if r.epoch != claim.epoch {
                return Err(Refusal::new(
                    RefusalCode::EpochMismatch,
                    "epoch",
                    format!("the claim was made in epoch {}", claim.epoch),
                ));
            }
        }
        Ok(p)
    }

    fn receipt(&self, kind: ReceiptKind, p: &Publication, epoch: u64) -> Result<Receipt, Refusal> {
        let claim = p.claim.as_ref().filter(|_| kind == ReceiptKind::Claim);
        Ok(self.signer.sign(Receipt {
            kind,
            namespace: String::new(),
            epoch,
            publication: p.id,
            req_id: p.req_id.clone(),
            manifest_digest: Self::digest_of(p)?,
            reader: claim.map(|c| c.reader.clone()),
            session: claim.map(|c| c.session.clone()),
            lease_ms: claim.map(|c| c.lease_ms),
            // A claim receipt is the claim's: issued when it was made, so a
            // repeated claim answers the very same receipt.
            issued_unix_ms: claim.map_or_else(|| self.now_unix_ms(), |c| c.claimed_unix_ms),
            key_id: 0,
            signature: String::new(),
        }))
    }
}
