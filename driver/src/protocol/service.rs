//! The protocol steps of DESIGN §4 as one service over a [`Store`]: each step
//! verifies the receipt it is given (signature, namespace, publication, state,
//! manifest digest, reader, session), then runs the store transition. The HTTP
//! control plane and the data plane are thin shells around it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::identity::{Caller, Policy, Resource, Role};
use super::{Clock, Receipt, ReceiptKind, Refusal, RefusalCode, Signer, SystemClock, manifest_digest};
use std::time::Duration;

use crate::admission::CancelToken;
use crate::store::{AbortOutcome, CancelOutcome, Layout, Manifest, Owner, Phase, Publication, Store, StoreError};
use crate::timeline::Event;
pub use pdstor_client::receipt::restore_digest;
pub use pdstor_client::wire::{AdoptRequest, Prepared, Published};

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
    timeline: Option<Arc<crate::timeline::Timeline>>,
    policy: Arc<Policy>,
    /// Closed sessions, by (claimant principal, session name): a session is
    /// its claimant's, so one principal cannot fence another's.
    closed_sessions: Mutex<HashSet<(String, String)>>,
    /// Prepares being handled now: request → the principal that asked.
    preparing: Mutex<HashMap<String, String>>,
    /// What the data plane served to each adopted claim: publication →
    /// (the claim's signature, chunk → crc32c as served). In memory: after a
    /// restart the reader loads again before it acks.
    served: Mutex<HashMap<u64, Served>>,
    /// The owner's persistent reservation on the namespace and its key
    /// (`serve --reservation-key`): fencing a direct reader preempts its key.
    reservations: Option<(crate::io::persistent_reservation::Reservations, u64)>,
}

/// What the data plane served to one adopted claim: the claim's signature,
/// and chunk → crc32c as served.
type Served = (String, std::collections::BTreeMap<u32, u32>);

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
            closed_sessions: Mutex::new(HashSet::new()),
            preparing: Mutex::new(HashMap::new()),
            served: Mutex::new(HashMap::new()),
            reservations: None,
        }
    }

    /// Holds the namespace's Exclusive Access — All Registrants reservation
    /// with `key` (registering it for this host first): only registered
    /// hosts read or write it, and fencing a direct reader preempts its key.
    pub fn with_reservation_key(
        mut self,
        key: u64,
    ) -> Result<Service, crate::io::persistent_reservation::ReservationError> {
        let r = crate::io::persistent_reservation::Reservations::open(self.store.path())?;
        r.register(key)?;
        r.reserve(key)?;
        self.reservations = Some((r, key));
        Ok(self)
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
    pub fn with_timeline(mut self, t: Option<Arc<crate::timeline::Timeline>>) -> Service {
        self.timeline = t;
        self
    }

    /// The timeline steps are recorded on, if any.
    pub fn timeline(&self) -> &Option<Arc<crate::timeline::Timeline>> {
        &self.timeline
    }

    /// Records a step `who` took: on the timeline, if there is one (after the
    /// step took effect and before its answer leaves, so line order is causal
    /// order), and in the log.
    fn note(&self, who: &Caller, e: crate::timeline::Event) {
        let by = who.audit();
        tracing::info!(step = %e.event, req = e.req_id.as_deref().unwrap_or(""), publication = e.publication.unwrap_or(0), by = %by, "audit");
        crate::timeline::emit(&self.timeline, e.by(by));
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
        p.manifest.as_ref().map(manifest_digest).ok_or_else(|| {
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
            issued_unix_ms: self.now_unix_ms(),
            key_id: 0,
            signature: String::new(),
        }))
    }

    /// Step 1: admits a request and records its PREPARE (waits for capacity up to the admission timeout).
    pub fn prepare(
        &self,
        who: &Caller,
        req_id: &str,
        layout: &Layout,
        total_chunks: u32,
        writer: &str,
    ) -> Result<Prepared, ProtocolError> {
        self.prepare_with(who, req_id, layout, total_chunks, writer, None, &CancelToken::new())
    }

    /// [`prepare`](Self::prepare) waiting at most `timeout` (bounded by the
    /// daemon's admission timeout), giving up when `cancel` is set. A repeat
    /// of a PREPARED request (same chunks, layout, writer, owner) answers the same.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_with(
        &self,
        who: &Caller,
        req_id: &str,
        layout: &Layout,
        total_chunks: u32,
        writer: &str,
        timeout: Option<Duration>,
        cancel: &CancelToken,
    ) -> Result<Prepared, ProtocolError> {
        bounded("req_id", req_id, MAX_NAME_BYTES)?;
        bounded("writer_id", writer, MAX_NAME_BYTES)?;
        for (field, value) in [
            ("layout.model_id", &layout.model_id),
            ("layout.dtype", &layout.dtype),
            ("layout.kv_format", &layout.kv_format),
        ] {
            bounded(field, value, MAX_NAME_BYTES)?;
        }
        who.require(Role::Writer, "prepare")?;
        let owner = who.owner();
        let quota = self.quota_for_prepare(who, total_chunks);
        self.policy.take(who, quota)?;
        let timeout = timeout.unwrap_or(Duration::MAX);
        self.lock_preparing().insert(req_id.to_owned(), who.principal.clone());
        let prepared = self.store.prepare_with(req_id, writer, owner.as_ref(), layout, total_chunks, timeout, cancel);
        self.lock_preparing().remove(req_id);
        self.policy.give(who, quota);
        let p = prepared?;
        let detail = if p.repeated {
            format!("writer {writer}; a repeat of the same request: the same publication")
        } else {
            format!("writer {writer}")
        };
        self.note(who, Event::new("prepare").req(req_id).publication(p.publication).detail(detail));
        let writer_token = self.signer.writer_token(p.publication, req_id);
        Ok(Prepared {
            publication: p.publication,
            writer_token,
            namespace: self.namespace().into(),
            epoch: self.store.epoch(),
        })
    }

    fn lock_preparing(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.preparing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What a prepare of `chunks` by `who` takes from its tenant's quota: the
    /// tenant's live holdings are counted only when it has a quota to compare.
    fn quota_for_prepare(&self, who: &Caller, chunks: u32) -> Resource {
        let q = who.tenant.as_deref().map(|t| self.policy.quota(t)).unwrap_or_default();
        let (mut held, mut outstanding) = (0, 0);
        if q.slots.is_some() || q.prepares.is_some() {
            for p in self.store.publications() {
                if p.owner.as_ref().is_some_and(|o| Some(o.tenant.as_str()) == who.tenant.as_deref()) {
                    held += p.slots.len() as u64;
                    outstanding += usize::from(p.phase == Phase::Prepared);
                }
            }
        }
        Resource::Prepare { slots: chunks as u64, held, outstanding }
    }

    /// Step 3: READY; returns the signed receipt and the manifest.
    pub fn publish(
        &self,
        who: &Caller,
        publication: u64,
        writer_token: &str,
        first_token: Option<u32>,
    ) -> Result<Published, ProtocolError> {
        self.check_writer(who, publication, writer_token)?;
        let manifest = self.store.publish(publication, first_token)?;
        let p = self.live(publication)?;
        let receipt = self.receipt(ReceiptKind::Ready, &p, self.store.epoch())?;
        let mut e = Event::new("publish").req(&receipt.req_id).publication(publication).receipt(&receipt.signature);
        e.chunks = Some(manifest.chunks.len() as u32);
        e.crcs = Some(manifest.chunks.iter().map(|c| c.crc32c).collect());
        e.token = manifest.first_token;
        self.note(who, e);
        Ok(Published { receipt, manifest })
    }

    /// Whether `who` may read (claim) a publication `owner` made: an admin,
    /// or a caller of a tenant the owner's tenant lets read. The one rule
    /// `claim` enforces and `lookup` answers by.
    fn may_read(&self, who: &Caller, owner: &Owner) -> bool {
        who.roles.admin || who.tenant.as_deref().is_some_and(|t| self.policy.may_read(&owner.tenant, t))
    }

    /// Step 4: binds one reader and session to a READY publication; returns the claim receipt.
    pub fn claim(
        &self,
        who: &Caller,
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
    ) -> Result<Receipt, ProtocolError> {
        who.require(Role::Reader, "claim")?;
        let p = self.check(ready, ReceiptKind::Ready)?;
        if let (Some(owner), Some(tenant)) = (&p.owner, &who.tenant)
            && !self.may_read(who, owner)
        {
            return Err(Refusal::new(
                RefusalCode::Forbidden,
                "caller",
                format!(
                    "claim: publication {} belongs to tenant {}, whose config does not let readers of tenant {tenant} claim it",
                    p.id, owner.tenant
                ),
            )
            .into());
        }
        if p.phase != Phase::Ready {
            return Err(Refusal::new(
                RefusalCode::AlreadyClaimed,
                "publication",
                format!("publication {} is {:?}", p.id, p.phase),
            )
            .into());
        }
        if reader.is_empty() || session.is_empty() {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "reader_id",
                "reader_id and session_id must not be empty",
            )
            .into());
        }
        bounded("reader_id", reader, MAX_NAME_BYTES)?;
        bounded("session_id", session, MAX_NAME_BYTES)?;
        if !(1..=MAX_LEASE_MS).contains(&lease_ms) {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "lease_ms",
                format!("lease_ms {lease_ms} is outside 1..={MAX_LEASE_MS} (7 days)"),
            )
            .into());
        }
        let claimant = who.owner();
        let p = self.store.claim(p.id, reader, session, lease_ms, self.now_unix_ms(), claimant.as_ref())?;
        let epoch = p.claim.as_ref().map_or(self.store.epoch(), |c| c.epoch);
        let receipt = self.receipt(ReceiptKind::Claim, &p, epoch)?;
        self.note(who, Event::new("claim").claim(&receipt).detail(format!("reader {reader} session {session}")));
        Ok(receipt)
    }

    /// Every field must match exactly; the manifest comes back.
    pub fn adopt(&self, who: &Caller, r: &AdoptRequest) -> Result<Manifest, ProtocolError> {
        let (claim, namespace, epoch, digest, layout) =
            (&r.receipt, &r.namespace, r.epoch, &r.manifest_digest, &r.layout);
        let p = self.check(claim, ReceiptKind::Claim)?;
        Self::check_claimant(who, &p, "adopt")?;
        self.unfenced(&p, "adopt")?;
        if namespace != self.namespace() {
            return Err(Refusal::new(
                RefusalCode::NamespaceMismatch,
                "namespace",
                format!("this namespace is {}", self.namespace()),
            )
            .into());
        }
        if epoch != claim.epoch {
            return Err(Refusal::new(
                RefusalCode::EpochMismatch,
                "epoch",
                format!("the claim was made in epoch {}", claim.epoch),
            )
            .into());
        }
        if *digest != claim.manifest_digest {
            return Err(Refusal::new(RefusalCode::DigestMismatch, "manifest_digest", "not the claimed manifest").into());
        }
        if *layout != p.layout {
            return Err(Refusal::new(
                RefusalCode::LayoutMismatch,
                "layout",
                format!("the publication's layout is {:?}", p.layout),
            )
            .into());
        }
        if p.phase != Phase::Claimed {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "publication",
                format!("publication {} is {:?}", p.id, p.phase),
            )
            .into());
        }
        if let Some(c) = &p.claim
            && self.now_unix_ms() > c.claimed_unix_ms.saturating_add(c.lease_ms)
        {
            return Err(Refusal::new(
                RefusalCode::LeaseExpired,
                "lease_ms",
                "the lease expired; the bytes stay retained until reclaimed",
            )
            .into());
        }
        if let Some(key) = r.reservation_key {
            let own = self.reservations.as_ref().map(|(_, k)| *k);
            if !r.direct || key == 0 || Some(key) == own {
                return Err(Refusal::new(
                    RefusalCode::BadRequest,
                    "reservation_key",
                    format!(
                        "reservation_key {key:#x}: only a direct reader names one, it is not 0, and not the owner's own key"
                    ),
                )
                .into());
            }
        }
        let p = self.store.adopt(p.id, r.direct, r.reservation_key)?;
        let nonce = self.signer.restore_nonce(&claim.signature);
        self.lock_served().insert(p.id, (claim.signature.clone(), Default::default()));
        let mut e = Event::new("adopt").claim(claim);
        if r.direct {
            e = e.detail("direct: the reader reads the shared namespace itself; a restart does not fence it");
        }
        e.nonce = Some(nonce.clone());
        self.note(who, e);
        let manifest = p.manifest.ok_or_else(|| Refusal::new(RefusalCode::NotReady, "publication", "no manifest"))?;
        Ok(Manifest { restore_nonce: Some(nonce), ..manifest })
    }

    fn lock_served(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Served>> {
        self.served.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records chunks the data plane loaded for `claim` (chunk, crc32c as
    /// served): what its ack may acknowledge.
    pub fn note_served(&self, claim: &Receipt, chunks: &[(u32, u32)]) {
        let mut served = self.lock_served();
        let entry = served.entry(claim.publication).or_insert_with(|| (claim.signature.clone(), Default::default()));
        if entry.0 != claim.signature {
            *entry = (claim.signature.clone(), Default::default());
        }
        entry.1.extend(chunks.iter().copied());
    }

    /// Checks that `claim` may load now: adopted, lease running.
    pub fn authorize_load(&self, who: &Caller, claim: &Receipt) -> Result<Manifest, ProtocolError> {
        let p = self.check(claim, ReceiptKind::Claim)?;
        Self::check_claimant(who, &p, "load")?;
        self.unfenced(&p, "load")?;
        if p.phase != Phase::Adopted {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "publication",
                format!("load needs an ADOPTED publication; it is {:?}", p.phase),
            )
            .into());
        }
        if let Some(c) = &p.claim
            && self.now_unix_ms() > c.claimed_unix_ms.saturating_add(c.lease_ms)
        {
            return Err(Refusal::new(RefusalCode::LeaseExpired, "lease_ms", "the lease expired").into());
        }
        p.manifest.ok_or_else(|| Refusal::new(RefusalCode::NotReady, "publication", "no manifest").into())
    }

    /// A reader that read chunks itself from its own view of the shared
    /// namespace reports them: each must be a chunk of the manifest read with
    /// its stored crc32c (else `restore_mismatch`, and nothing is recorded);
    /// then they count as loaded for this claim's ack.
    pub fn loaded(&self, who: &Caller, claim: &Receipt, chunks: &[(u32, u32)]) -> Result<(), ProtocolError> {
        let manifest = self.authorize_load(who, claim)?;
        if chunks.is_empty() {
            return Err(Refusal::new(RefusalCode::BadRequest, "chunks", "no chunks reported").into());
        }
        for &(index, crc) in chunks {
            let Some(m) = manifest.chunks.get(index as usize) else {
                return Err(Refusal::new(
                    RefusalCode::BadRequest,
                    "chunks",
                    format!("publication {} has chunks 0..{}, not {index}", claim.publication, manifest.chunks.len()),
                )
                .into());
            };
            if crc != m.crc32c {
                return Err(Refusal::new(
                    RefusalCode::RestoreMismatch,
                    "chunks",
                    format!(
                        "chunk {index} was read as crc32c {crc:#010x}, stored {:#010x}: the reader's view of the namespace is not the stored bytes (another namespace, a stale cache, or a bad read); nothing was recorded",
                        m.crc32c
                    ),
                )
                .into());
            }
        }
        self.note_served(claim, chunks);
        for &(index, crc) in chunks {
            let mut e = Event::new("loaded").claim(claim).chunk(index).detail("read by the reader itself");
            e.crc32c = Some(crc);
            self.note(who, e);
        }
        Ok(())
    }

    /// Step 7: the reader restored every chunk (its digest must match); the slots free.
    pub fn ack(&self, who: &Caller, claim: &Receipt, restore: &str) -> Result<(), ProtocolError> {
        let p = self.check(claim, ReceiptKind::Claim)?;
        Self::check_claimant(who, &p, "ack")?;
        self.unfenced(&p, "ack")?;
        if p.phase != Phase::Adopted {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "publication",
                format!("ack needs an ADOPTED publication; it is {:?}", p.phase),
            )
            .into());
        }
        let manifest =
            p.manifest.as_ref().ok_or_else(|| Refusal::new(RefusalCode::NotReady, "publication", "no manifest"))?;
        let served = self.lock_served().get(&p.id).filter(|(sig, _)| *sig == claim.signature).map(|(_, c)| c.clone());
        let served = served.unwrap_or_default();
        let unserved: Vec<u32> = (0..manifest.chunks.len() as u32).filter(|c| !served.contains_key(c)).collect();
        if !unserved.is_empty() {
            return Err(Refusal::new(
                RefusalCode::NotLoaded,
                "restore_digest",
                format!(
                    "publication {}: chunks {unserved:?} were never loaded through the data plane for this claim (since it was adopted, or since the daemon restarted); load every chunk, then ack",
                    p.id
                ),
            )
            .into());
        }
        let crcs: Vec<u32> = served.values().copied().collect();
        let expected = restore_digest(&self.signer.restore_nonce(&claim.signature), &crcs);
        if restore != expected {
            return Err(Refusal::new(
                RefusalCode::RestoreMismatch,
                "restore_digest",
                "not the digest of this claim's nonce and the chunks it loaded: the restored bytes are not the ones served",
            )
            .into());
        }
        self.store.ack(p.id, restore)?;
        self.lock_served().remove(&p.id);
        let mut e = Event::new("ack").claim(claim);
        e.digest = Some(restore.to_owned());
        self.note(who, e);
        Ok(())
    }

    /// Frees a READY publication that was never claimed.
    pub fn release(&self, who: &Caller, ready: &Receipt) -> Result<(), ProtocolError> {
        who.require(Role::Writer, "release")?;
        let p = self.check(ready, ReceiptKind::Ready)?;
        who.require_owner(p.owner.as_ref(), &format!("publication {}", p.id))?;
        if p.phase != Phase::Ready {
            return Err(Refusal::new(
                RefusalCode::AlreadyClaimed,
                "publication",
                format!("publication {} is {:?}: only unread READY can be released", p.id, p.phase),
            )
            .into());
        }
        self.store.release(p.id)?;
        self.note(who, Event::new("release").req(&ready.req_id).publication(p.id).receipt(&ready.signature));
        Ok(())
    }

    /// The READY receipt of each request in `req_ids`, freshly signed, or
    /// `None` where there is none the caller may use: no live publication of
    /// that request, not READY (still being written, or already claimed), or
    /// one the caller may neither claim (a reader of a tenant its owner lets
    /// read) nor release (its owner). A reader that knows only the request's
    /// name — an LMCache key — finds the receipt to claim with; it learns
    /// nothing `publications` would not show it.
    pub fn lookup(&self, who: &Caller, req_ids: &[String]) -> Result<Vec<Option<Receipt>>, ProtocolError> {
        who.require(Role::Any, "lookup")?;
        if req_ids.len() > MAX_LOOKUP {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "req_ids",
                format!("lookup names {} requests; at most {MAX_LOOKUP} at a time", req_ids.len()),
            )
            .into());
        }
        for r in req_ids {
            bounded("req_ids", r, MAX_NAME_BYTES)?;
        }
        let usable = |p: &Publication| {
            let Some(owner) = &p.owner else { return true };
            who.roles.admin || (who.roles.writer && who.is(owner)) || (who.roles.reader && self.may_read(who, owner))
        };
        let epoch = self.store.epoch();
        req_ids
            .iter()
            .map(|r| match self.store.publication_of(r) {
                Some(p) if p.phase == Phase::Ready && usable(&p) => {
                    self.receipt(ReceiptKind::Ready, &p, epoch).map(Some).map_err(Into::into)
                }
                _ => Ok(None),
            })
            .collect()
    }

    /// Rolls back a publication that is not READY yet.
    pub fn abort(&self, who: &Caller, publication: u64, writer_token: &str) -> Result<AbortOutcome, ProtocolError> {
        who.require(Role::Writer, "abort")?;
        if self.store.publication(publication).is_none() {
            return Ok(AbortOutcome::NotFound);
        }
        self.check_writer(who, publication, writer_token)?;
        let outcome = self.store.abort(publication)?;
        self.note(who, Event::new("abort").publication(publication).detail(format!("{outcome:?}")));
        Ok(outcome)
    }

    /// Aborts PREPARED publications idle for `idle`, or orphaned for
    /// `orphan_grace` ([`Store::reap_idle`]), each recorded on the timeline;
    /// returns how many.
    pub fn reap_idle(&self, idle: Duration, orphan_grace: Duration) -> usize {
        let reaped = self.store.reap_idle(idle, orphan_grace);
        for r in &reaped {
            let why = if r.orphaned {
                format!(
                    "orphaned: its prepare's answer never reached the client, and no store batch came within {} ms",
                    orphan_grace.as_millis()
                )
            } else {
                format!("idle: no store batch for {} ms", idle.as_millis())
            };
            self.note(&Caller::in_process(), Event::new("abort").req(&r.req_id).publication(r.publication).detail(why));
        }
        reaped.len()
    }

    /// Cancels request `req_id` ([`Store::cancel_request`]): a waiting
    /// prepare is refused, a PREPARED publication rolled back. Idempotent.
    pub fn cancel(&self, who: &Caller, req_id: &str) -> Result<CancelOutcome, ProtocolError> {
        who.require(Role::Writer, "cancel")?;
        bounded("req_id", req_id, MAX_NAME_BYTES)?;
        // Only whoever asked for the request (or an admin) gives it up.
        if let Some(p) = self.store.publication_of(req_id) {
            who.require_owner(p.owner.as_ref(), &format!("request {req_id}"))?;
        } else if let Some(principal) = self.lock_preparing().get(req_id)
            && *principal != who.principal
            && !who.roles.admin
        {
            return Err(Refusal::new(
                RefusalCode::NotOwner,
                "caller",
                format!("request {req_id} is being prepared by {principal}; {who} is not it (nor an admin)"),
            )
            .into());
        }
        let outcome = self.store.cancel_request(req_id)?;
        let mut e = Event::new("cancel").req(req_id).detail(format!("{outcome:?}"));
        if let CancelOutcome::Aborted { publication, .. } | CancelOutcome::Pending { publication } = outcome {
            e = e.publication(publication);
        }
        self.note(who, e);
        Ok(outcome)
    }

    /// A PREPARED publication whose prepare's answer never reached its client:
    /// rolled back after the orphan grace unless a store batch comes.
    pub fn orphan(&self, publication: u64, req_id: &str) {
        self.store.orphan(publication);
        self.note(
            &Caller::in_process(),
            Event::new("orphaned")
                .req(req_id)
                .publication(publication)
                .detail("the client went away before the prepare's answer reached it"),
        );
    }

    /// A failed or uncertain claimed read: the publication is RETAINED with its bytes.
    pub fn fail(&self, who: &Caller, claim: &Receipt, reason: &str) -> Result<(), ProtocolError> {
        bounded("reason", reason, MAX_REASON_BYTES)?;
        let p = self.check(claim, ReceiptKind::Claim)?;
        Self::check_claimant(who, &p, "fail")?;
        self.store.fail(p.id, reason)?;
        self.lock_served().remove(&p.id);
        self.note(who, Event::new("fail").claim(claim).detail(reason));
        Ok(())
    }

    /// Why the claim on `p` is fenced, if it is: its session was closed, or
    /// it was made in an earlier epoch (the daemon restarted since) and its
    /// reader loads through the daemon. A *direct* reader — one that adopted
    /// to read the shared namespace itself, from another host — is not
    /// stopped by this daemon's restart: it may still be reading the slots,
    /// so only closing its session fences it (the operator's word that its
    /// host is stopped or cut off from the namespace).
    fn fenced(&self, p: &Publication) -> Option<String> {
        let c = p.claim.as_ref()?;
        let key = (c.claimant.as_ref().map(|o| o.principal.clone()).unwrap_or_default(), c.session.clone());
        if self.closed_sessions.lock().unwrap_or_else(|e| e.into_inner()).contains(&key) {
            return Some(format!("its session {} was closed", c.session));
        }
        let epoch = self.store.epoch();
        (c.epoch < epoch && !c.direct)
            .then(|| format!("it was made in epoch {}, and the daemon is in epoch {epoch} now", c.epoch))
    }

    /// Refuses a step of a fenced claim.
    fn unfenced(&self, p: &Publication, step: &str) -> Result<(), Refusal> {
        match self.fenced(p) {
            Some(why) => Err(Refusal::new(
                RefusalCode::Fenced,
                "session",
                format!(
                    "publication {}: the claim is fenced ({why}): it cannot {step}; only a reclaim frees the publication",
                    p.id
                ),
            )),
            None => Ok(()),
        }
    }

    /// Frees a claimed/retained publication only once its reader is fenced:
    /// its session closed, or its claim made in an earlier daemon epoch.
    /// Its claimant, its owner or an admin may reclaim.
    pub fn reclaim(&self, who: &Caller, claim: &Receipt) -> Result<(), ProtocolError> {
        let p = self.check(claim, ReceiptKind::Claim)?;
        let c = p.claim.as_ref().ok_or_else(|| Refusal::new(RefusalCode::NotClaimed, "publication", "no claim"))?;
        if Self::check_claimant(who, &p, "reclaim").is_err() {
            who.require_owner(p.owner.as_ref(), &format!("publication {}", p.id)).map_err(|_| {
                Refusal::new(
                    RefusalCode::NotOwner,
                    "caller",
                    format!(
                        "reclaim: the claim on publication {} is {}'s and the publication {}'s; {who} is neither (nor an admin)",
                        p.id,
                        c.claimant.as_ref().map_or("nobody's", |o| o.principal.as_str()),
                        p.owner.as_ref().map_or("nobody", |o| o.principal.as_str()),
                    ),
                )
            })?;
        }
        if self.fenced(&p).is_none() {
            let why = if c.direct {
                format!(
                    "the reader of publication {} reads the shared namespace itself (adopted direct), so a daemon restart does not fence it: stop its host or cut it off from the namespace, then close its session (POST /storage-pd/session/close)",
                    p.id
                )
            } else {
                "the reader is not fenced: close its session (POST /storage-pd/session/close) or restart the daemon first"
                    .to_owned()
            };
            return Err(Refusal::new(RefusalCode::NotFenced, "session", why).into());
        }
        self.store.reclaim(p.id)?;
        self.lock_served().remove(&p.id);
        self.note(who, Event::new("reclaim").claim(claim));
        Ok(())
    }

    /// Fences the reader session of `claim`, a claim receipt proving the
    /// caller holds a claim of that session: every claim of the session
    /// becomes reclaimable and may no longer read.
    /// Only the session's claimant (or an admin) closes it.
    pub fn close_session(&self, who: &Caller, claim: &Receipt) -> Result<(), ProtocolError> {
        who.require(Role::Reader, "close-session")?;
        self.signer.verify(claim)?;
        if claim.kind != ReceiptKind::Claim {
            return Err(Refusal::new(
                RefusalCode::WrongReceipt,
                "receipt",
                "closing a session takes a claim receipt of that session, not a READY receipt",
            )
            .into());
        }
        let Some(session) = claim.session.clone() else {
            return Err(Refusal::new(RefusalCode::BadRequest, "receipt", "the claim receipt names no session").into());
        };
        // The session is its claimant's: the live claim says whose; a claim
        // already gone leaves only the caller's own session of that name.
        let live = self.store.publication(claim.publication).and_then(|p| p.claim);
        let claimant = live.as_ref().filter(|c| c.session == session).and_then(|c| c.claimant.clone());
        if let Some(o) = &claimant {
            who.require_owner(Some(o), &format!("session {session}"))?;
        }
        let principal = claimant.map_or_else(|| who.principal.clone(), |o| o.principal);
        // A direct reader's host is cut off at the target before its session
        // counts as closed: if the preempt fails, nothing is fenced.
        let key = live.as_ref().filter(|c| c.session == session && c.direct).and_then(|c| c.reservation_key);
        let detail = match (key, &self.reservations) {
            (Some(key), Some((r, own))) => {
                r.preempt(*own, key).map_err(|e| {
                    Refusal::new(
                        RefusalCode::FenceFailed,
                        "session",
                        format!(
                            "session {session} stays open: its host's reservation key could not be preempted ({e}); its slots stay taken"
                        ),
                    )
                })?;
                format!("{session}; its host's reservation key {key:#x} preempted at the target")
            }
            (Some(key), None) => format!(
                "{session}; its host registered key {key:#x}, but this owner holds no reservation (serve --reservation-key): the host is not cut off by the target"
            ),
            (None, _) => session.clone(),
        };
        self.closed_sessions.lock().unwrap_or_else(|e| e.into_inner()).insert((principal, session));
        self.note(who, Event::new("close_session").req(&claim.req_id).publication(claim.publication).detail(detail));
        Ok(())
    }
}
