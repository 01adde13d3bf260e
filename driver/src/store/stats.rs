//! The store's counters (`/metrics`, `inspect`) and its invariants, checked
//! whole: the allocator's, the reservations', and their agreement.

use std::collections::HashMap;

use super::{Invariant, Store};
use crate::admission::AdmissionCounters;

/// The store's counters, for `/metrics` and `inspect`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct StoreStats {
    /// Slots in the namespace.
    pub slots: u64,
    /// Slots no publication owns.
    pub free_slots: u64,
    /// Slots reserved by admission (owned or about to be).
    pub reserved: u64,
    /// Live publications.
    pub live_publications: usize,
    /// Device flushes so far.
    pub flushes: u64,
    /// Flushes not issued: the device has no volatile write cache.
    pub flushes_elided: u64,
    /// Group commits so far.
    pub commit_groups: u64,
    /// Bytes of the active journal half in use at the last commit.
    pub journal_used: u64,
    /// Admissions that had to wait for capacity.
    pub admission_waits: u64,
    /// Admission's counters (admitted, waits, timeouts, cancels).
    pub admission: AdmissionCounters,
    /// Store batches that broke the protocol.
    pub violations: u64,
    /// PREPARED publications rolled back.
    pub rollbacks: u64,
    /// Unread READY publications evicted under capacity pressure.
    pub evicted: u64,
    /// Unread READY publications released after the unread window.
    pub expired: u64,
    /// Payload chunks stored and loaded.
    pub payload_chunks: u64,
    /// Device commands they went in: fewer than the chunks where small ones were merged (`StoreOptions::merge_bytes`).
    pub payload_commands: u64,
    /// Submissions those commands went in: fewer than the requests where many were run together
    /// (`Store::store_batches`, `Store::load_many`, or jobs of several connections queued at once).
    pub payload_submissions: u64,
}

impl Store {
    /// The store's counters now.
    pub fn stats(&self) -> StoreStats {
        let live = self.lock_live();
        let c = *self.last_commit.lock().unwrap_or_else(|p| p.into_inner());
        let (payload_chunks, payload_commands, payload_submissions) = self.io.payload_counts();
        StoreStats {
            slots: live.state.slot_count(),
            free_slots: live.state.free_slots(),
            reserved: self.admission.stats().reserved,
            live_publications: live.state.pubs.len(),
            flushes: c.flushes,
            flushes_elided: c.flushes_elided,
            commit_groups: c.commit_groups,
            journal_used: c.journal_used,
            admission_waits: self.admission.stats().waits,
            admission: self.admission.stats().counters,
            violations: live.violations,
            rollbacks: live.rollbacks,
            evicted: live.evicted,
            expired: live.expired,
            payload_chunks,
            payload_commands,
            payload_submissions,
        }
    }

    /// Every invariant at once: the allocator's, the reservations', and their
    /// agreement — each live publication's request holds exactly its slots.
    /// A holder with no live publication is a `prepare` between admission and
    /// its PREPARE record; [`Store::check_quiescent`] allows none.
    pub fn check(&self) -> Result<(), Invariant> {
        let live = self.lock_live();
        live.state.check()?;
        self.admission.check().map_err(Invariant::Admission)?;
        let holders: HashMap<String, u64> = self.admission.holders().into_iter().collect();
        for p in live.state.pubs.values() {
            let held = holders.get(&p.req_id).copied().unwrap_or(0);
            if held != p.slots.len() as u64 {
                return Err(Invariant::Reservations { req: p.req_id.clone(), held, slots: p.slots.len() });
            }
        }
        let in_transit: u64 = holders.iter().filter(|(r, _)| live.state.by_req(r).is_none()).map(|(_, n)| n).sum();
        if in_transit > live.state.free_slots() {
            return Err(Invariant::InTransit { in_transit, free: live.state.free_slots() });
        }
        Ok(())
    }

    /// [`Store::check`], with no `prepare` in flight: reservations equal owned slots.
    pub fn check_quiescent(&self) -> Result<(), Invariant> {
        self.check()?;
        let live = self.lock_live();
        let owned: u64 = live.state.pubs.values().map(|p| p.slots.len() as u64).sum();
        let reserved = self.admission.stats().reserved;
        if owned != reserved {
            return Err(Invariant::Unbalanced { owned, reserved });
        }
        Ok(())
    }
}
