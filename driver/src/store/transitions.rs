//! The protocol's transitions as state changes (DESIGN §4): release, claim,
//! adopt, ack, fail, reclaim. Each checks the publication's phase, journals
//! one record and commits before it returns — all but the ADOPT of a reader
//! that loads through the daemon, which is durable with the next commit
//! (see [`Store::adopt`]); the ones that free slots keep them quarantined
//! until their record is durable. Who may take a step
//! (receipts, leases, fencing) is the protocol's to check, before it calls here.

use super::error::StoreError;
use super::{Live, Phase, Publication, Record, Store, in_phase};
use pdstor_client::layout::SlotIndex;

/// When a transition's record must be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durable {
    /// Committed (flushed) before the transition returns.
    BeforeReturn,
    /// Queued in the journal; durable with the next commit, whoever makes it.
    WithNextCommit,
}

/// The longest a reclaim or ack waits for loads of its publication to end.
const LOAD_DRAIN: std::time::Duration = std::time::Duration::from_secs(30);

impl Store {
    /// Exact unread release: a READY publication that was never claimed.
    ///
    /// The RELEASE record is committed before this returns, and its slots
    /// stay out of reach of new prepares until then (quarantined): had
    /// another request written payload into them before the record was
    /// durable, a crash would bring the publication back READY over its
    /// bytes (found by the simulation, `driver/tests/sim.rs`). ACK and
    /// RECLAIM free their slots the same way.
    pub fn release(&self, id: u64) -> Result<(), StoreError> {
        let (req, slots) = {
            let mut live = self.lock_live();
            self.release_locked(&mut live, id)?
        };
        self.free_when_durable(&[(&req, &slots)])
    }

    /// Under the lock: journals the RELEASE of the READY publication `id`
    /// (refused in any other phase) and quarantines its slots until the
    /// record is durable ([`free_when_durable`](Self::free_when_durable)).
    /// Answers its request and slots.
    pub(super) fn release_locked(&self, live: &mut Live, id: u64) -> Result<(String, Vec<SlotIndex>), StoreError> {
        let p = in_phase(&live.state, id, &[Phase::Ready], "only a READY, never-claimed publication can be released")?;
        let (req, slots) = (p.req_id.clone(), p.slots.clone());
        let reads = live.reads_of(id);
        if reads > 0 {
            return Err(StoreError::BeingRead { publication: id, reads });
        }
        self.log(live, Record::Release { publication: id })?;
        live.batches.remove(&id);
        live.quarantine.extend(&slots);
        Ok((req, slots))
    }

    /// Commits (sharing the flush with whoever else is committing), then
    /// lets each freed set of slots be prepared again and gives its
    /// request's reservation back.
    /// Inside [`with_one_commit`](Self::with_one_commit), the scope does
    /// this for every set it freed, at its end.
    pub(super) fn free_when_durable(&self, freed: &[(&str, &[SlotIndex])]) -> Result<(), StoreError> {
        if self.defer_free(freed) {
            return Ok(());
        }
        let committed = self.commit();
        let mut live = self.lock_live();
        for s in freed.iter().flat_map(|(_, slots)| slots.iter()) {
            live.quarantine.remove(s);
        }
        drop(live);
        for (req, _) in freed {
            self.admission.release(req);
        }
        committed.map(drop)
    }

    /// Runs one protocol transition: checks the phase, journals `record`,
    /// releases the reservation if the record frees the slots, and commits.
    fn transition(
        &self,
        id: u64,
        allowed: &[Phase],
        what: &'static str,
        record: Record,
    ) -> Result<Publication, StoreError> {
        self.transition_durable(id, allowed, what, record, Durable::BeforeReturn)
    }

    /// [`transition`](Self::transition), committing before it returns or
    /// leaving the record for the next commit.
    fn transition_durable(
        &self,
        id: u64,
        allowed: &[Phase],
        what: &'static str,
        record: Record,
        durable: Durable,
    ) -> Result<Publication, StoreError> {
        let frees = matches!(record, Record::Ack { .. } | Record::Reclaim { .. });
        let before = {
            let mut live = self.lock_live();
            if frees {
                live = self.quiesce_loads(live, id)?;
            }
            let p = in_phase(&live.state, id, allowed, what)?.clone();
            self.log(&mut live, record)?;
            if frees {
                live.batches.remove(&id);
                live.quarantine.extend(&p.slots);
            }
            p
        };
        if frees {
            self.free_when_durable(&[(&before.req_id, &before.slots)])?;
        } else if durable == Durable::BeforeReturn {
            self.commit()?;
        }
        Ok(self.publication(id).unwrap_or(before))
    }

    /// Waits (a bounded while) until no load of publication `id` is in
    /// flight, so that freeing its slots cannot race a reader's last read.
    fn quiesce_loads<'a>(
        &'a self,
        live: std::sync::MutexGuard<'a, Live>,
        id: u64,
    ) -> Result<std::sync::MutexGuard<'a, Live>, StoreError> {
        let busy = |l: &mut Live| l.loading.get(&id).is_some_and(|n| *n > 0);
        let (live, waited) =
            self.loads_done.wait_timeout_while(live, LOAD_DRAIN, busy).unwrap_or_else(|p| p.into_inner());
        if waited.timed_out() {
            return Err(StoreError::LoadInFlight { publication: id, waited_ms: LOAD_DRAIN.as_millis() as u64 });
        }
        Ok(live)
    }

    /// Step 4: binds exactly one reader and session to a READY publication,
    /// claimed at `claimed_unix_ms` (the protocol's clock) for `lease_ms`
    /// by `claimant` (journaled with the CLAIM).
    pub fn claim(
        &self,
        id: u64,
        reader: &str,
        session: &str,
        lease_ms: u64,
        claimed_unix_ms: u64,
        claimant: Option<&super::Owner>,
    ) -> Result<Publication, StoreError> {
        let record = Record::Claim {
            publication: id,
            reader: reader.into(),
            session: session.into(),
            lease_ms,
            epoch: self.epoch(),
            claimed_unix_ms,
            claimant: claimant.cloned(),
        };
        if self.publication(id).is_some_and(|p| p.cache) {
            let what = "it is read (POST /storage-pd/read), never claimed";
            return Err(StoreError::WrongClass { publication: id, class: "cache", what });
        }
        self.transition(id, &[Phase::Ready], "only a READY, unclaimed publication can be claimed", record)
    }

    /// Step 5: the claimed reader adopts the publication (checks are the
    /// caller's); `direct`: it reads the shared namespace itself, its host
    /// registered `reservation_key` (if any).
    ///
    /// A direct ADOPT is durable before this returns: after a restart it is
    /// what keeps the claim of a reader that reads the namespace itself from
    /// being fenced. Any other ADOPT is durable with the next commit (the
    /// ack's at the latest, or another step's shared flush meanwhile), so the
    /// reader's first load starts without waiting for a flush: nothing after
    /// a crash depends on it — a restart fences every claim that is not
    /// direct, ADOPTED or CLAIMED alike, and frees neither without a reclaim
    /// — and journal order keeps it before any record committed after it.
    pub fn adopt(&self, id: u64, direct: bool, reservation_key: Option<u64>) -> Result<Publication, StoreError> {
        self.transition_durable(
            id,
            &[Phase::Claimed],
            "only a CLAIMED publication can be adopted",
            Record::Adopt { publication: id, direct, reservation_key },
            if direct { Durable::BeforeReturn } else { Durable::WithNextCommit },
        )
    }

    /// Step 7: frees the slots. A second ACK finds no live publication.
    pub fn ack(&self, id: u64, restore_digest: &str) -> Result<(), StoreError> {
        let r = Record::Ack { publication: id, restore_digest: restore_digest.into() };
        self.transition(id, &[Phase::Adopted], "only an ADOPTED publication can be acknowledged", r).map(|_| ())
    }

    /// A failed or uncertain claimed read: RETAINED, bytes and slots kept.
    pub fn fail(&self, id: u64, reason: &str) -> Result<(), StoreError> {
        let r = Record::Retain { publication: id, reason: reason.into() };
        self.transition(id, &[Phase::Claimed, Phase::Adopted], "only a claimed publication can fail", r).map(|_| ())
    }

    /// Frees a claimed or retained publication's slots; the caller has checked
    /// that its reader is fenced.
    pub fn reclaim(&self, id: u64) -> Result<(), StoreError> {
        let r = Record::Reclaim { publication: id };
        self.transition(
            id,
            &[Phase::Claimed, Phase::Adopted, Phase::Retained],
            "only a claimed or retained publication can be reclaimed",
            r,
        )
        .map(|_| ())
    }
}
