//! The reader's steps: claim, adopt, the loads the data plane serves (or a
//! direct reader reports), ack, fail; and fencing — a claim's session
//! closed, or its epoch past — with the reclaim only a fenced claim allows.

use super::*;
use pdstor_client::wire::ClaimRequest;

/// A claim with adopt's answer: the claim receipt, and the adopt's outcome.
pub type ClaimAdopted = (Receipt, Result<Manifest, ProtocolError>);

impl Service {
    /// Whether `who` may read (claim) a publication `owner` made: an admin,
    /// or a caller of a tenant the owner's tenant lets read. The one rule
    /// `claim` enforces and `lookup` answers by.
    pub(super) fn may_read(&self, who: &Caller, owner: &Owner) -> bool {
        who.roles.admin || who.tenant.as_deref().is_some_and(|t| self.policy.rules().may_read(&owner.tenant, t))
    }

    /// Step 4: binds one reader and session to a READY publication; returns the claim receipt.
    pub fn claim(
        &self,
        who: &Caller,
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
        layout: Option<&Layout>,
    ) -> Result<Receipt, ProtocolError> {
        who.require(Role::Reader, "claim")?;
        self.after_publishes();
        let p = self.check(ready, ReceiptKind::Ready)?;
        self.readable(who, &p, "claim")?;
        if p.phase == Phase::Claimed
            && let Some(receipt) = self.repeated_claim(who, &p, reader, session, lease_ms)?
        {
            return Ok(receipt);
        }
        if p.phase != Phase::Ready {
            let by = p.claim.as_ref().map_or_else(String::new, |c| {
                format!(" by reader {} session {} with a {} ms lease", c.reader, c.session, c.lease_ms)
            });
            return Err(Refusal::new(
                RefusalCode::AlreadyClaimed,
                "publication",
                format!(
                    "publication {} is {:?}{by}: only an exact repeat of that claim (the same identity, reader, session and lease) is answered again",
                    p.id, p.phase
                ),
            )
            .into());
        }
        Self::reader_fits(&p, "claim", reader, session, layout)?;
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

    /// `claim` with `adopt`: the claim, then its adopt through the daemon
    /// with the claim's own namespace, epoch and manifest digest and the
    /// layout the claim named — one round trip. Answers the claim receipt
    /// and the adopt's outcome: should the adopt be refused once the claim
    /// is made (its lease ran out in between, say), the claim stands,
    /// CLAIMED, and its holder has the receipt to report it failed or to
    /// adopt again. An exact repeat of a claim that adopted (its answer was
    /// lost) answers the same receipt and manifest and changes nothing.
    pub fn claim_and_adopt(&self, who: &Caller, r: &ClaimRequest) -> Result<ClaimAdopted, ProtocolError> {
        let Some(layout) = &r.layout else {
            let m = "a claim with adopt names the layout it adopts with: give layout, or claim and adopt apart";
            return Err(Refusal::new(RefusalCode::BadRequest, "layout", m).into());
        };
        let receipt = match self.claim(who, &r.receipt, &r.reader_id, &r.session_id, r.lease_ms, Some(layout)) {
            Ok(receipt) => receipt,
            // Taken already: by this very claim with adopt, its answer lost?
            Err(ProtocolError::Refused(f)) if f.code == RefusalCode::AlreadyClaimed => {
                return self.adopted_again(who, r, layout)?.ok_or_else(|| f.into());
            }
            Err(e) => return Err(e),
        };
        let adopted = match self.adopt(who, &AdoptRequest::of_claim(&receipt, layout.clone())) {
            // A repeat of this very request adopted it meanwhile: its answer.
            Err(ProtocolError::Refused(refusal)) => match self.adopted_again(who, r, layout)? {
                Some((_, manifest)) => manifest,
                None => Err(refusal.into()),
            },
            other => other,
        };
        Ok((receipt, adopted))
    }

    /// The answer a claim with adopt had when `r` repeats it exactly and
    /// the publication is ADOPTED by it (the same claimant, reader, session,
    /// lease and layout, adopted through the daemon): the same receipt and
    /// the manifest with the same nonce. `None` for anything else.
    fn adopted_again(
        &self,
        who: &Caller,
        r: &ClaimRequest,
        layout: &Layout,
    ) -> Result<Option<ClaimAdopted>, ProtocolError> {
        let p = self.check(&r.receipt, ReceiptKind::Ready)?;
        let Some(c) = p.claim.as_ref().filter(|_| p.phase == Phase::Adopted) else { return Ok(None) };
        if c.direct
            || c.reader != r.reader_id
            || c.session != r.session_id
            || c.lease_ms != r.lease_ms
            || c.claimant != who.owner()
            || p.layout != *layout
        {
            return Ok(None);
        }
        let receipt = self.receipt(ReceiptKind::Claim, &p, c.epoch)?;
        let Some(manifest) = p.manifest.clone() else { return Ok(None) };
        let nonce = self.signer.restore_nonce(&receipt.signature);
        let detail = format!(
            "reader {} session {}; a repeat of the same claim with adopt: the same receipt and manifest",
            c.reader, c.session
        );
        self.note(who, Event::new("claim_again").claim(&receipt).detail(detail));
        Ok(Some((receipt, Ok(Manifest { restore_nonce: Some(nonce), ..manifest }))))
    }

    /// A claim that repeats the live, not yet adopted claim on `p` exactly
    /// (the same claimant, reader, session and lease): its answer was lost
    /// (the connection dropped, or the daemon was killed, after the CLAIM
    /// committed), so it gets the same claim receipt — as a repeated prepare
    /// gets its publication — and changes nothing. A fenced claim's receipt
    /// comes back too: adopt refuses it, and its holder may reclaim.
    fn repeated_claim(
        &self,
        who: &Caller,
        p: &Publication,
        reader: &str,
        session: &str,
        lease_ms: u64,
    ) -> Result<Option<Receipt>, ProtocolError> {
        let Some(c) = &p.claim else { return Ok(None) };
        let claimant = who.owner();
        if c.reader != reader || c.session != session || c.lease_ms != lease_ms || c.claimant != claimant {
            return Ok(None);
        }
        let receipt = self.receipt(ReceiptKind::Claim, p, c.epoch)?;
        let detail = format!("reader {reader} session {session}; a repeat of the same claim: the same claim receipt");
        self.note(who, Event::new("claim_again").claim(&receipt).detail(detail));
        Ok(Some(receipt))
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
        self.lock_served().insert(p.id, (claim.signature.clone(), Default::default(), Default::default()));
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
    /// served), `unchecked` those among them whose bytes the daemon did not
    /// check: what its ack may acknowledge.
    pub fn note_served(&self, claim: &Receipt, chunks: &[(u32, u32)], unchecked: &[u32]) {
        if claim.kind == ReceiptKind::Read {
            return self.note_read_served(claim, chunks);
        }
        let mut served = self.lock_served();
        let fresh = || (claim.signature.clone(), Default::default(), Default::default());
        let entry = served.entry(claim.publication).or_insert_with(fresh);
        if entry.0 != claim.signature {
            *entry = fresh();
        }
        for &(index, crc) in chunks {
            entry.1.insert(index, crc);
            if unchecked.contains(&index) {
                entry.2.insert(index);
            } else {
                entry.2.remove(&index);
            }
        }
    }

    /// Checks that `claim` may load now: adopted, lease running.
    pub fn authorize_load(&self, who: &Caller, claim: &Receipt) -> Result<Manifest, ProtocolError> {
        if claim.kind == ReceiptKind::Read {
            return self.authorize_read_load(who, claim);
        }
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
        if claim.kind != ReceiptKind::Claim {
            let m = "only a claimed reader reports chunks it read itself; a read of a cache publication loads through the daemon";
            return Err(Refusal::new(RefusalCode::WrongReceipt, "receipt", m).into());
        }
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
        let indices: Vec<u32> = chunks.iter().map(|c| c.0).collect();
        self.note_served(claim, chunks, &indices);
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
        Self::digest_of(&p)?;
        let served =
            self.lock_served().get(&p.id).filter(|(sig, _, _)| *sig == claim.signature).map(|(_, c, _)| c.clone());
        let served = served.unwrap_or_default();
        Self::check_restore(&p, &served, &self.signer.restore_nonce(&claim.signature), restore)?;
        self.store.ack(p.id, restore)?;
        self.lock_served().remove(&p.id);
        let mut e = Event::new("ack").claim(claim);
        e.digest = Some(restore.to_owned());
        self.note(who, e);
        Ok(())
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
        if self.lock_closed().contains(&key) {
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
        if claim.kind == ReceiptKind::Read {
            return self.close_read_session(who, claim);
        }
        if claim.kind != ReceiptKind::Claim {
            return Err(Refusal::new(
                RefusalCode::WrongReceipt,
                "receipt",
                "closing a session takes a claim or read receipt of that session, not a READY receipt",
            )
            .into());
        }
        let Some(session) = claim.session.clone() else {
            return Err(Refusal::new(RefusalCode::BadRequest, "receipt", "the claim receipt names no session").into());
        };
        // The session is its claimant's: the live claim says whose; a claim
        // already gone leaves only the caller's own session of that name.
        let live = self.store.publication(claim.publication).and_then(|p| p.claim);
        let live = live.filter(|c| c.session == session);
        if let Some(o) = live.as_ref().and_then(|c| c.claimant.as_ref()) {
            who.require_owner(Some(o), &format!("session {session}"))?;
        }
        let detail = match &live {
            Some(c) => self.fence_session(c)?,
            None => {
                self.close_session_key((who.principal.clone(), session.clone()));
                session
            }
        };
        self.note(who, Event::new("close_session").req(&claim.req_id).publication(claim.publication).detail(detail));
        Ok(())
    }

    /// Closes the session of claim `c` (its claimant's): a direct reader's
    /// host is cut off at the target first — if that fails, nothing is
    /// fenced. Returns what was done, for the timeline.
    fn fence_session(&self, c: &crate::store::ClaimInfo) -> Result<String, Refusal> {
        let session = &c.session;
        let detail = match (c.reservation_key.filter(|_| c.direct), &self.reservations) {
            // A host has one registration per namespace: a direct reader on
            // this owner's own host (its standby's host, before a takeover)
            // registered this owner's key, and preempting it would cut the
            // owner off too.
            (Some(key), Some((_, own))) if key == *own => {
                return Err(Refusal::new(
                    RefusalCode::FenceFailed,
                    "session",
                    format!(
                        "session {session} stays open: its host registered this owner's own reservation key {key:#x} (the reader runs on the owner's host), and cutting that host off at the target would cut off the owner too; stop the reader's process and ack or release its claim, or restart the owner on another host; its slots stay taken"
                    ),
                ));
            }
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
        let principal = c.claimant.as_ref().map(|o| o.principal.clone()).unwrap_or_default();
        self.close_session_key((principal, session.clone()));
        Ok(detail)
    }

    pub(super) fn lock_closed(&self) -> std::sync::MutexGuard<'_, super::closed::ClosedSessions> {
        self.closed_sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes a session: (its claimant's principal, its name).
    pub(super) fn close_session_key(&self, key: super::closed::SessionKey) {
        self.lock_closed().close(key, || self.store.claim_sessions());
    }

    /// The operator's way out for a claim nobody holds a receipt for (the
    /// claim committed, its answer was lost with the client or the daemon):
    /// an admin fences the claim's session (unless the claim can no longer
    /// act) and reclaims `publication`, by number. Journaled as a reclaim and on the timeline with `reason`.
    pub fn reclaim_by_operator(&self, who: &Caller, publication: u64, reason: &str) -> Result<(), ProtocolError> {
        who.require(Role::Admin, "an operator's reclaim by publication")?;
        bounded("reason", reason, MAX_REASON_BYTES)?;
        if reason.trim().is_empty() {
            return Err(Refusal::new(
                RefusalCode::BadRequest,
                "reason",
                "an operator's reclaim needs a reason: it is journaled and on the timeline",
            )
            .into());
        }
        let p = self.live(publication)?;
        let Some(c) = p.claim.as_ref().filter(|_| matches!(p.phase, Phase::Claimed | Phase::Adopted | Phase::Retained))
        else {
            return Err(Refusal::new(
                RefusalCode::NotClaimed,
                "publication",
                format!(
                    "publication {publication} is {:?}: only a claimed or retained publication is reclaimed (release an unread READY one, abort or cancel a PREPARED one)",
                    p.phase
                ),
            )
            .into());
        };
        // A claim that can no longer act leaves its session open: fenced
        // already (a restart's epoch, its session closed), or RETAINED and
        // read through the daemon (its reader failed it: nothing loads from
        // it again). Closing the session would fence every later claim of a
        // reader that carries on in it, as a serving engine does.
        // A direct claim is fenced here all the same: its host is cut off at
        // the target, which no earlier close of its session need have done.
        let closed = match self.fenced(&p) {
            Some(why) if !c.direct => format!("its claim fenced already ({why})"),
            None if p.phase == Phase::Retained && !c.direct => "its claim failed, its session left open".to_owned(),
            _ => format!("session {} closed", self.fence_session(c)?),
        };
        self.store.reclaim(p.id)?;
        self.lock_served().remove(&p.id);
        let detail = format!("by an operator, without the claim receipt; {closed}; {reason}");
        self.note(who, Event::new("reclaim").req(&p.req_id).publication(p.id).detail(detail));
        Ok(())
    }
}
