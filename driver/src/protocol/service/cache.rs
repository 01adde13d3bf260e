//! Reads of cache publications (DESIGN §4): a READY cache publication is read
//! by any reader its tenant lets read, each read a lease of its own. `read`
//! begins one (the store counts it, so the publication is neither released
//! nor evicted while it is held) and answers the manifest with the read's
//! restore nonce; the data plane loads it as it loads an adopted claim; it
//! ends by `end_read` — verified (every chunk loaded for this read, the
//! digest bound to its nonce, as an ack is) or abandoned with a reason — or
//! when its session is closed. Reads are in memory only: nothing is
//! journaled (a read changes nothing on the media), and a restart ends them
//! all, since the loads they could make went with the process.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::*;
use pdstor_client::read::ReadRequest;

/// One read in progress.
pub(super) struct ReadLease {
    publication: u64,
    session: String,
    /// The identity that began it: only it loads and ends it.
    reader_owner: Option<Owner>,
    /// Chunk → crc32c as the data plane served it to this read.
    served: BTreeMap<u32, u32>,
}

impl Service {
    /// `read` as asked: of the READY receipt it names, or of the READY
    /// publication named `req_id` this caller may read (found as `lookup`
    /// finds it: a lookup and a read in one step).
    pub fn read_asked(&self, who: &Caller, r: &ReadRequest) -> Result<(Receipt, Manifest), ProtocolError> {
        let (reader, session, layout) = (r.reader_id.as_str(), r.session_id.as_str(), r.layout.as_ref());
        match (&r.receipt, &r.req_id) {
            (Some(ready), None) => self.read(who, ready, reader, session, layout),
            (None, Some(name)) => {
                who.require(Role::Reader, "read")?;
                bounded("req_id", name, MAX_NAME_BYTES)?;
                let found = self.lookup(who, std::slice::from_ref(name))?.into_iter().next().flatten();
                let ready = found.ok_or_else(|| {
                    Refusal::new(
                        RefusalCode::UnknownPublication,
                        "req_id",
                        format!(
                            "no READY publication named {name:?} that this caller may read: never stored, not READY yet, or deleted"
                        ),
                    )
                })?;
                self.read(who, &ready, reader, session, layout)
            }
            (Some(_), Some(name)) => {
                let m =
                    format!("a read names its publication once: it gives both a receipt and req_id {name:?}; send one");
                Err(Refusal::new(RefusalCode::BadRequest, "req_id", m).into())
            }
            (None, None) => {
                let m = "a read names its publication: give its READY receipt (lookup answers it) or its req_id";
                Err(Refusal::new(RefusalCode::BadRequest, "receipt", m).into())
            }
        }
    }

    /// Begins a read of the READY cache publication `ready` names, for
    /// `reader` in `session`: answers the read's receipt and the manifest
    /// with its restore nonce.
    pub fn read(
        &self,
        who: &Caller,
        ready: &Receipt,
        reader: &str,
        session: &str,
        layout: Option<&Layout>,
    ) -> Result<(Receipt, Manifest), ProtocolError> {
        who.require(Role::Reader, "read")?;
        self.after_publishes();
        let p = self.check(ready, ReceiptKind::Ready)?;
        self.readable(who, &p, "read")?;
        if !p.cache {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "publication",
                format!(
                    "publication {} is a handoff, for one reader: claim it (POST /storage-pd/claim); only a publication prepared with cache: true is read by many",
                    p.id
                ),
            )
            .into());
        }
        Self::reader_fits(&p, "read", reader, session, layout)?;
        // The session's check and the read's entry under one lock, which a
        // close of the session takes too: no read begins in a closed session.
        let mut reads = self.lock_reads();
        let principal = who.owner().map(|o| o.principal).unwrap_or_default();
        if self.lock_closed().contains(&(principal, session.to_owned())) {
            let m = format!("session {session} was closed: begin reads in a new session");
            return Err(Refusal::new(RefusalCode::Fenced, "session_id", m).into());
        }
        // The manifest of a READY publication never changes: the one checked
        // above is the one the store now holds against release.
        self.store.begin_read(p.id)?;
        let receipt = self.signer.sign(Receipt {
            kind: ReceiptKind::Read,
            namespace: String::new(),
            epoch: self.store.epoch(),
            publication: p.id,
            req_id: p.req_id.clone(),
            manifest_digest: Self::digest_of(&p)?,
            reader: Some(reader.into()),
            session: Some(session.into()),
            lease_ms: None,
            issued_unix_ms: self.read_issued_at(),
            key_id: 0,
            signature: String::new(),
        });
        let nonce = self.signer.restore_nonce(&receipt.signature);
        let lease = ReadLease {
            publication: p.id,
            session: session.into(),
            reader_owner: who.owner(),
            served: BTreeMap::new(),
        };
        reads.insert(receipt.signature.clone(), lease);
        let held = reads.values().filter(|l| l.publication == p.id).count();
        drop(reads);
        let mut e =
            Event::new("read").claim(&receipt).detail(format!("reader {reader} session {session}; {held} held"));
        e.nonce = Some(nonce.clone());
        self.note(who, e);
        let manifest = p.manifest.ok_or_else(|| Refusal::new(RefusalCode::NotReady, "publication", "no manifest"))?;
        Ok((receipt, Manifest { restore_nonce: Some(nonce), ..manifest }))
    }

    /// When a read receipt is issued: the clock's ms, past the last one
    /// issued, so that no two reads share a receipt (and a lease).
    fn read_issued_at(&self) -> u64 {
        let now = self.now_unix_ms();
        let prev = self.read_clock.fetch_max(now, Ordering::Relaxed);
        if prev < now {
            return now;
        }
        self.read_clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// What a claim and a read both refuse before anything changes: an empty
    /// or oversized reader or session name, or a layout other than `p`'s.
    pub(super) fn reader_fits(
        p: &Publication,
        step: &str,
        reader: &str,
        session: &str,
        layout: Option<&Layout>,
    ) -> Result<(), Refusal> {
        if reader.is_empty() || session.is_empty() {
            let m = "reader_id and session_id must not be empty";
            return Err(Refusal::new(RefusalCode::BadRequest, "reader_id", m));
        }
        if let Some(layout) = layout
            && *layout != p.layout
        {
            let done = if step == "claim" { "claimed" } else { "begun" };
            return Err(Refusal::new(
                RefusalCode::LayoutMismatch,
                "layout",
                format!(
                    "{step}: publication {} was stored with layout {:?}, not this reader's {layout:?}; nothing was {done} and it stays READY for a reader with its layout (configure this reader with the writer's model, dtype and chunking)",
                    p.id, p.layout
                ),
            ));
        }
        bounded("reader_id", reader, MAX_NAME_BYTES)?;
        bounded("session_id", session, MAX_NAME_BYTES)
    }

    /// Refuses `who` reading (claiming or reading) `p` when its tenant may not.
    pub(super) fn readable(&self, who: &Caller, p: &Publication, step: &str) -> Result<(), Refusal> {
        if let (Some(owner), Some(tenant)) = (&p.owner, &who.tenant)
            && !self.may_read(who, owner)
        {
            return Err(Refusal::new(
                RefusalCode::Forbidden,
                "caller",
                format!(
                    "{step}: publication {} belongs to tenant {}, whose config does not let readers of tenant {tenant} read it",
                    p.id, owner.tenant
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn lock_reads(&self) -> std::sync::MutexGuard<'_, HashMap<String, ReadLease>> {
        self.reads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live publication of the read `r` names, if that read is held and
    /// `who` began it.
    fn held_read(&self, who: &Caller, r: &Receipt, step: &str) -> Result<Publication, Refusal> {
        who.require(Role::Reader, step)?;
        let p = self.check(r, ReceiptKind::Read)?;
        let reads = self.lock_reads();
        let Some(lease) = reads.get(&r.signature) else {
            return Err(Refusal::new(
                RefusalCode::ReadEnded,
                "receipt",
                format!(
                    "publication {}: this read has ended (read/end, its session closed, or the daemon restarted since it began): it cannot {step}; read again",
                    p.id
                ),
            ));
        };
        who.require_owner(lease.reader_owner.as_ref(), &format!("the read of publication {}", p.id))?;
        Ok(p)
    }

    /// Checks that the read `r` may load now; answers the manifest.
    pub(super) fn authorize_read_load(&self, who: &Caller, r: &Receipt) -> Result<Manifest, ProtocolError> {
        let p = self.held_read(who, r, "load")?;
        p.manifest.ok_or_else(|| Refusal::new(RefusalCode::NotReady, "publication", "no manifest").into())
    }

    /// Records chunks the data plane loaded for the read `r`.
    pub(super) fn note_read_served(&self, r: &Receipt, chunks: &[(u32, u32)]) {
        if let Some(lease) = self.lock_reads().get_mut(&r.signature) {
            lease.served.extend(chunks.iter().copied());
        }
    }

    /// Ends the read `r`: with `restore`, once every chunk was loaded for it
    /// and the digest is its nonce's and theirs (else refused, the read held
    /// still); without, abandoned for `reason`.
    pub fn end_read(
        &self,
        who: &Caller,
        r: &Receipt,
        restore: Option<&str>,
        reason: Option<&str>,
    ) -> Result<(), ProtocolError> {
        if let Some(reason) = reason {
            bounded("reason", reason, MAX_REASON_BYTES)?;
        }
        let p = self.held_read(who, r, "end")?;
        let mut reads = self.lock_reads();
        let lease = reads.get(&r.signature).ok_or_else(|| {
            Refusal::new(RefusalCode::ReadEnded, "receipt", format!("publication {}: this read has ended", p.id))
        })?;
        let mut e = match (restore, reason) {
            (Some(digest), _) => {
                Self::check_restore(&p, &lease.served, &self.signer.restore_nonce(&r.signature), digest)?;
                let mut e = Event::new("read_done").claim(r);
                e.digest = Some(digest.to_owned());
                e
            }
            (None, Some(reason)) => Event::new("read_end").claim(r).detail(reason),
            (None, None) => {
                let m = "end a read with its restore_digest (done) or a reason (abandoned)";
                return Err(Refusal::new(RefusalCode::BadRequest, "restore_digest", m).into());
            }
        };
        reads.remove(&r.signature);
        let left = reads.values().filter(|l| l.publication == p.id).count();
        drop(reads);
        e.detail = Some(match e.detail.take() {
            Some(d) => format!("{d}; {left} held"),
            None => format!("{left} held"),
        });
        // On the timeline before the store lets it go: a release the end
        // makes possible is recorded after it.
        self.note(who, e);
        self.store.end_read(p.id)?;
        Ok(())
    }

    /// Closes the session a read receipt names — its reader's (the read's
    /// owner, or an admin, closes it), or the caller's own once the read has
    /// ended: every read of it ends, and no read or claim of it begins again.
    pub(super) fn close_read_session(&self, who: &Caller, read: &Receipt) -> Result<(), ProtocolError> {
        let Some(session) = read.session.clone() else {
            return Err(Refusal::new(RefusalCode::BadRequest, "receipt", "the read receipt names no session").into());
        };
        let owner = self.lock_reads().get(&read.signature).map(|l| l.reader_owner.clone());
        let principal = match owner {
            Some(owner) => {
                who.require_owner(owner.as_ref(), &format!("session {session}"))?;
                owner.map(|o| o.principal).unwrap_or_default()
            }
            None => who.owner().map(|o| o.principal).unwrap_or_default(),
        };
        let ended = self.end_session_reads(who, &principal, &session);
        let detail = format!("{session}; {ended} read(s) of it ended");
        self.note(who, Event::new("close_session").req(&read.req_id).publication(read.publication).detail(detail));
        Ok(())
    }

    /// The operator's way out for reads nobody will end (their reader died
    /// holding them, its session unknown): an admin ends every read of the
    /// cache publication `publication`, each on the timeline with `reason`.
    /// Their receipts are refused `read_ended` from then on; a load of one
    /// still in flight finishes (the store keeps the slots until it has).
    /// Answers how many reads ended.
    pub fn end_reads_by_operator(&self, who: &Caller, publication: u64, reason: &str) -> Result<usize, ProtocolError> {
        who.require(Role::Admin, "an operator's end of a publication's reads")?;
        bounded("reason", reason, MAX_REASON_BYTES)?;
        if reason.trim().is_empty() {
            let m = "an operator's end of reads needs a reason: it is on the timeline";
            return Err(Refusal::new(RefusalCode::BadRequest, "reason", m).into());
        }
        let p = self.live(publication)?;
        if !p.cache {
            let m = format!(
                "publication {publication} is a handoff, claimed by one reader, never read: reclaim its claim instead (POST /storage-pd/admin/reclaim)"
            );
            return Err(Refusal::new(RefusalCode::WrongState, "publication", m).into());
        }
        let ended: Vec<String> = {
            let mut reads = self.lock_reads();
            let keys: Vec<String> =
                reads.iter().filter(|(_, l)| l.publication == publication).map(|(k, _)| k.clone()).collect();
            keys.into_iter().filter(|k| reads.remove(k).is_some()).collect()
        };
        let n = ended.len();
        for (i, signature) in ended.iter().enumerate() {
            let e = Event::new("read_end").publication(publication).receipt(signature);
            self.note(who, e.detail(format!("by an operator: {reason}; {} held", n - i - 1)));
            if let Err(err) = self.store.end_read(publication) {
                tracing::error!(publication, %err, "an operator's end of reads: a read the store did not count");
            }
        }
        Ok(n)
    }

    /// Ends every read of `session` begun by `principal` (its session
    /// closed); answers how many.
    fn end_session_reads(&self, who: &Caller, principal: &str, session: &str) -> usize {
        let ended: Vec<(String, u64, usize)> = {
            let mut reads = self.lock_reads();
            self.close_session_key((principal.to_owned(), session.to_owned()));
            let mine = |l: &ReadLease| {
                l.session == session && l.reader_owner.as_ref().map_or("", |o| o.principal.as_str()) == principal
            };
            let keys: Vec<String> = reads.iter().filter(|(_, l)| mine(l)).map(|(k, _)| k.clone()).collect();
            let gone: Vec<(String, u64)> =
                keys.into_iter().filter_map(|k| reads.remove(&k).map(|l| (k, l.publication))).collect();
            let left = |id: u64| reads.values().filter(|l| l.publication == id).count();
            gone.into_iter().map(|(k, id)| (k, id, left(id))).collect()
        };
        for (signature, publication, left) in &ended {
            let e = Event::new("read_end").publication(*publication).receipt(signature);
            self.note(who, e.detail(format!("its session {session} was closed; {left} held")));
            // Each read the store counted ends, whatever became of another's.
            if let Err(err) = self.store.end_read(*publication) {
                tracing::error!(publication, %err, "closing a session: a read the store did not count");
            }
        }
        ended.len()
    }

    /// The restore check an ack and a verified read end share: every chunk
    /// of `p` served, and `digest` that of `nonce` and their crc32c.
    pub(super) fn check_restore(
        p: &Publication,
        served: &BTreeMap<u32, u32>,
        nonce: &str,
        digest: &str,
    ) -> Result<(), Refusal> {
        let n = p.manifest.as_ref().map_or(0, |m| m.chunks.len() as u32);
        let unserved: Vec<u32> = (0..n).filter(|c| !served.contains_key(c)).collect();
        if !unserved.is_empty() {
            return Err(Refusal::new(
                RefusalCode::NotLoaded,
                "restore_digest",
                format!(
                    "publication {}: chunks {unserved:?} were never loaded through the data plane for this {what} (since it began, or since the daemon restarted); load every chunk, then {end}",
                    p.id,
                    what = if p.cache { "read" } else { "claim" },
                    end = if p.cache { "end the read" } else { "ack" },
                ),
            ));
        }
        let crcs: Vec<u32> = served.values().copied().collect();
        if restore_digest(nonce, &crcs) != digest {
            return Err(Refusal::new(
                RefusalCode::RestoreMismatch,
                "restore_digest",
                format!(
                    "not the digest of this {}'s nonce and the chunks it loaded: the restored bytes are not the ones served",
                    if p.cache { "read" } else { "claim" }
                ),
            ));
        }
        Ok(())
    }
}
