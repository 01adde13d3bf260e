//! Admission as the store runs it (DESIGN §5): prepare (reserve the whole
//! chunk set, then journal the PREPARE), its idempotent retry, cancel by
//! request id, abort by publication, the reaper of idle and orphaned
//! PREPARED publications, and the accounting an operator reconciles.
//!
//! The rules, for a request id:
//!
//! - waiting for admission: a second prepare of it is refused
//!   (`duplicate_request`) and changes nothing of the first's;
//! - PREPARED: a prepare with the same chunks, layout, writer and unread window is a retry
//!   and answered with the same publication; any other is refused;
//! - READY or later: refused;
//! - cancel wakes and refuses a waiter, or rolls back a PREPARED publication;
//!   nothing to cancel is a clear answer, not an error (idempotent).

use std::time::{Duration, Instant};

use super::error::{Invariant, StoreError};
use super::{AbortOutcome, Batches, Live, Owner, Phase, Record, Store, TransferId};
use crate::admission::{AdmitError, CancelToken};
use pdstor_client::layout::Layout;
use pdstor_client::wire::CancelOutcome;

/// What a prepare did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prepared {
    /// The PREPARED publication.
    pub publication: u64,
    /// It existed already: this prepare was a retry of the same request.
    pub repeated: bool,
}

/// What a prepare asks of the store.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The serving engine's request id.
    pub req_id: &'a str,
    /// The writer's identity.
    pub writer: &'a str,
    /// The identity that prepares it (journaled with the PREPARE).
    pub owner: Option<&'a Owner>,
    /// The KV layout the reader must match.
    pub layout: &'a Layout,
    /// Chunks to reserve.
    pub total_chunks: u32,
    /// Its unread window, in ms: released unread when no reader claims it
    /// this long after READY (journaled with the PREPARE).
    pub unread_release_ms: Option<u64>,
    /// A cache publication (journaled with the PREPARE): read by many.
    pub cache: bool,
}

impl<'a> Ask<'a> {
    /// A prepare with no owner and no unread window of its own.
    pub fn new(req_id: &'a str, writer: &'a str, layout: &'a Layout, total_chunks: u32) -> Self {
        Ask { req_id, writer, owner: None, layout, total_chunks, unread_release_ms: None, cache: false }
    }
}

/// Why the reaper aborted a PREPARED publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    /// The publication.
    pub publication: u64,
    /// Its request.
    pub req_id: String,
    /// Whether its prepare's answer never reached the client (else: idle).
    pub orphaned: bool,
}

/// Where every slot is, from the allocator's and admission's points of view.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Accounting {
    /// Slots in all.
    pub capacity: u64,
    /// Slots neither owned nor reserved: what a prepare can take now.
    pub free: u64,
    /// Slots owned by live publications.
    pub used: u64,
    /// Slots reserved but owned by no publication: admitted prepares not yet
    /// journaled, and slots freed by a record not yet durable.
    pub reserved: u64,
    /// Prepares waiting for capacity.
    pub waiting: usize,
}

impl Accounting {
    /// LMCache's `total_reserved`: everything admission holds (used + reserved).
    pub fn total_reserved(&self) -> u64 {
        self.used + self.reserved
    }
}

impl Store {
    /// Step 1: admission. Reserves the whole chunk set (waiting up to the
    /// admission timeout) and records the PREPARE.
    pub fn prepare(&self, req_id: &str, writer: &str, layout: &Layout, total_chunks: u32) -> Result<u64, StoreError> {
        self.prepare_with_timeout(req_id, writer, layout, total_chunks, self.opts.admission_timeout)
    }

    /// [`prepare`](Self::prepare) with its own admission timeout.
    pub fn prepare_with_timeout(
        &self,
        req_id: &str,
        writer: &str,
        layout: &Layout,
        total_chunks: u32,
        timeout: Duration,
    ) -> Result<u64, StoreError> {
        let p = self.prepare_with(&Ask::new(req_id, writer, layout, total_chunks), timeout, &CancelToken::new())?;
        Ok(p.publication)
    }

    /// [`prepare`](Self::prepare) of `ask` with its own timeout (at most
    /// the store's admission timeout) and a token that gives up the wait.
    pub fn prepare_with(&self, ask: &Ask<'_>, timeout: Duration, cancel: &CancelToken) -> Result<Prepared, StoreError> {
        let Ask { req_id, total_chunks, .. } = *ask;
        if total_chunks > TransferId::MAX_CHUNKS {
            return Err(StoreError::TooManyChunks { chunks: total_chunks, max: TransferId::MAX_CHUNKS });
        }
        if let Some(id) = self.repeat_of(ask)? {
            return Ok(Prepared { publication: id, repeated: true });
        }
        let timeout = timeout.min(self.opts.admission_timeout);
        self.admission.admit(req_id, total_chunks as u64, timeout, cancel)?;
        let mut live = self.lock_live();
        // A cancel between admission and here released the reservation.
        if self.admission.held(req_id) != total_chunks as u64 {
            return Err(AdmitError::Aborted { req: req_id.into() }.into());
        }
        let prepared = self.journal_prepare(&mut live, ask);
        if prepared.is_err() {
            self.admission.release(req_id);
        }
        prepared.map(|publication| Prepared { publication, repeated: false })
    }

    /// The PREPARED publication of `req_id`, if this prepare repeats it
    /// exactly (by the same owner); a refusal if `req_id` is live in any other way.
    fn repeat_of(&self, ask: &Ask<'_>) -> Result<Option<u64>, StoreError> {
        let Ask { req_id, writer, owner, layout, total_chunks: total, unread_release_ms, cache } = *ask;
        let mut live = self.lock_live();
        let Some(p) = live.state.by_req(req_id) else { return Ok(None) };
        let id = p.id;
        let same = p.total_chunks == total
            && p.layout == *layout
            && p.writer == writer
            && p.owner.as_ref() == owner
            && p.unread_release_ms == unread_release_ms
            && p.cache == cache;
        if p.phase == Phase::Prepared && same && live.batches.get(&id).is_none_or(|b| !b.published) {
            if let Some(b) = live.batches.get_mut(&id) {
                b.touched = Some(Instant::now());
                b.orphaned = None;
            }
            return Ok(Some(id));
        }
        Err(StoreError::DuplicateRequest { req: req_id.into(), publication: id })
    }

    /// Picks the slots and journals the PREPARE of an admitted request.
    fn journal_prepare(&self, live: &mut Live, ask: &Ask<'_>) -> Result<u64, StoreError> {
        let Ask { req_id, writer, owner, layout, total_chunks, unread_release_ms, cache } = *ask;
        if let Some(p) = live.state.by_req(req_id) {
            return Err(StoreError::DuplicateRequest { req: req_id.into(), publication: p.id });
        }
        let slots = live
            .state
            .pick_slots_avoiding(total_chunks, &live.quarantine)
            .ok_or(Invariant::AllocatorShort { granted: total_chunks, free: live.state.free_slots() })?;
        let id = live.state.next_publication;
        if id > TransferId::MAX_PUBLICATION {
            return Err(StoreError::PublicationsExhausted { next: id });
        }
        let record = Record::Prepare {
            publication: id,
            req_id: req_id.into(),
            writer: writer.into(),
            layout: layout.clone(),
            total_chunks,
            slots,
            owner: owner.cloned(),
            unread_release_ms,
            cache,
        };
        self.log(live, record)?;
        if unread_release_ms.is_some() {
            self.windowed.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        live.batches.insert(id, Batches { touched: Some(Instant::now()), ..Default::default() });
        Ok(id)
    }

    /// Rolls a PREPARED publication back under the lock (slots and reservation).
    pub(super) fn rollback_locked(&self, live: &mut Live, id: u64, reason: String) -> Result<u32, StoreError> {
        let Some(p) = live.state.pubs.get(&id) else {
            return Ok(0);
        };
        let (req, n) = (p.req_id.clone(), p.slots.len() as u32);
        let inflight = live.batches.get(&id).map_or(0, |b| b.inflight);
        if inflight > 0 {
            live.state.mark_aborting(id);
            return Ok(0);
        }
        self.log(live, Record::Abort { publication: id, reason })?;
        live.batches.remove(&id);
        live.rollbacks += 1;
        self.admission.release(&req);
        Ok(n)
    }

    /// Marks a PREPARED publication whose prepare's answer never reached its
    /// client (it went away first): unless a store batch for it arrives, the
    /// reaper rolls it back after the orphan grace.
    pub fn orphan(&self, id: u64) {
        let mut live = self.lock_live();
        if let Some(b) = live.batches.get_mut(&id) {
            b.answering = false;
            if b.claimed.is_empty() {
                b.orphaned = Some(Instant::now());
            }
        }
    }

    /// Holds the idle clock of PREPARED publication `id` until
    /// [`answered`](Self::answered) or [`orphan`](Self::orphan): its
    /// prepare's answer waits for the rest of its batch.
    pub fn answering(&self, id: u64) {
        if let Some(b) = self.lock_live().batches.get_mut(&id) {
            b.answering = true;
        }
    }

    /// The answer of PREPARED publication `id`'s prepare is on its way to
    /// its writer: its idle clock starts now.
    pub fn answered(&self, id: u64) {
        if let Some(b) = self.lock_live().batches.get_mut(&id) {
            b.answering = false;
            b.touched = Some(Instant::now());
        }
    }

    /// Aborts every PREPARED publication with no store batch in flight that
    /// has seen none begin or end for `idle` (a writer that went quiet without
    /// closing its connection), or that was orphaned `orphan_grace` ago with
    /// no batch since: its reservation would otherwise be held until a
    /// restart. Returns the publications aborted.
    pub fn reap_idle(&self, idle: Duration, orphan_grace: Duration) -> Vec<Reaped> {
        let now = Instant::now();
        let quiet: Vec<Reaped> = {
            let live = self.lock_live();
            let due = |id: u64| -> Option<bool> {
                let Some(b) = live.batches.get(&id) else { return Some(false) };
                if b.inflight > 0 || b.published || b.answering {
                    return None;
                }
                let orphaned = b.orphaned.is_some_and(|t| now.duration_since(t) >= orphan_grace);
                let idle = b.touched.is_none_or(|t| now.duration_since(t) >= idle);
                (orphaned || idle).then_some(orphaned)
            };
            live.state
                .pubs
                .values()
                .filter(|p| p.phase == Phase::Prepared)
                .filter_map(|p| {
                    due(p.id).map(|orphaned| Reaped { publication: p.id, req_id: p.req_id.clone(), orphaned })
                })
                .collect()
        };
        quiet.into_iter().filter(|r| matches!(self.abort(r.publication), Ok(AbortOutcome::Aborted { .. }))).collect()
    }

    /// Rolls back a publication that is not yet READY (slots and reservation).
    /// Aborting an unknown or finished publication is a clear no-op.
    pub fn abort(&self, id: u64) -> Result<AbortOutcome, StoreError> {
        let mut live = self.lock_live();
        self.abort_locked(&mut live, id)
    }

    fn abort_locked(&self, live: &mut Live, id: u64) -> Result<AbortOutcome, StoreError> {
        let Some(p) = live.state.pubs.get(&id) else {
            return Ok(AbortOutcome::NotFound);
        };
        if !matches!(p.phase, Phase::Prepared | Phase::Aborting) || live.batches.get(&id).is_some_and(|b| b.published) {
            return Err(StoreError::WrongPhase {
                publication: id,
                phase: p.phase,
                what: "abort applies before READY only; use release",
            });
        }
        if live.batches.get(&id).is_some_and(|b| b.inflight > 0) {
            live.state.mark_aborting(id);
            return Ok(AbortOutcome::Pending);
        }
        let n = self.rollback_locked(live, id, "aborted by the writer".into())?;
        Ok(AbortOutcome::Aborted { slots: n })
    }

    /// Cancels request `req_id`: a waiting prepare is woken and refused, a
    /// PREPARED publication rolled back (everything released); a READY or
    /// later one is refused (release it instead). Idempotent.
    pub fn cancel_request(&self, req_id: &str) -> Result<CancelOutcome, StoreError> {
        // Under the live lock, so that a prepare between admission and its
        // PREPARE record sees the cancel (its reservation gone) or is seen
        // by it (its publication rolled back): never half of each.
        let mut live = self.lock_live();
        if let Some(id) = live.state.by_req(req_id).map(|p| p.id) {
            return Ok(match self.abort_locked(&mut live, id)? {
                AbortOutcome::Aborted { slots } => CancelOutcome::Aborted { publication: id, slots },
                AbortOutcome::Pending => CancelOutcome::Pending { publication: id },
                AbortOutcome::NotFound => CancelOutcome::None,
            });
        }
        let (waiter, held) = self.admission.abort(req_id);
        Ok(if waiter || held > 0 { CancelOutcome::Cancelled } else { CancelOutcome::None })
    }

    /// Aborts by request id: also wakes a `prepare` of it still waiting.
    pub fn abort_request(&self, req_id: &str) -> Result<AbortOutcome, StoreError> {
        Ok(match self.cancel_request(req_id)? {
            CancelOutcome::Aborted { slots, .. } => AbortOutcome::Aborted { slots },
            CancelOutcome::Pending { .. } => AbortOutcome::Pending,
            CancelOutcome::Cancelled | CancelOutcome::None => AbortOutcome::NotFound,
        })
    }

    /// Whether a prepare of `req_id` is waiting for capacity.
    pub fn admission_waiting(&self, req_id: &str) -> bool {
        self.admission.is_waiting(req_id)
    }

    /// Whether a prepare of `req_id` is queued with no answer yet.
    pub fn admission_queued(&self, req_id: &str) -> bool {
        self.admission.is_queued(req_id)
    }

    /// Wakes every waiting prepare to look at its cancel token and clock.
    pub fn wake_waiters(&self) {
        self.admission.wake();
    }

    /// Where every slot is, after checking every invariant ([`Store::check`])
    /// and that `free + used + reserved == capacity` holds from both the
    /// allocator's and admission's counts.
    pub fn accounting(&self) -> Result<Accounting, Invariant> {
        self.check()?;
        self.reconcile()
    }

    /// The counts of [`accounting`](Self::accounting), cross-checked between
    /// the allocator and admission only — O(publications), not O(slots), so
    /// the daemon can afford it after every request.
    pub fn reconcile(&self) -> Result<Accounting, Invariant> {
        let live = self.lock_live();
        let st = self.admission.stats();
        let used: u64 = live.state.pubs.values().map(|p| p.slots.len() as u64).sum();
        let capacity = live.state.slot_count();
        if live.state.free_slots() + used != capacity || st.reserved < used || st.capacity != capacity {
            return Err(Invariant::Unreconciled {
                capacity,
                allocator_free: live.state.free_slots(),
                used,
                reserved: st.reserved,
            });
        }
        Ok(Accounting {
            capacity,
            free: capacity - st.reserved,
            used,
            reserved: st.reserved - used,
            waiting: st.waiting,
        })
    }

    /// The same counts with no check, for display when they do not reconcile.
    pub fn accounting_unchecked(&self) -> Accounting {
        let live = self.lock_live();
        let st = self.admission.stats();
        let used: u64 = live.state.pubs.values().map(|p| p.slots.len() as u64).sum();
        Accounting {
            capacity: st.capacity,
            free: st.capacity.saturating_sub(st.reserved),
            used,
            reserved: st.reserved.saturating_sub(used),
            waiting: st.waiting,
        }
    }
}
