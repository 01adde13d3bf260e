//! Admission control (DESIGN §5, after LMCache's reservation design): a
//! request reserves its whole chunk set before any of its chunks is placed, or
//! waits — on a condition, up to a finite timeout — until capacity frees. So N
//! concurrent chunked prefills can never each half-fill the store and deadlock.
//!
//! [`ReservationManager`] counts reserved slots; [`StagingPool`] is the
//! writer-side flow control for the host-staged path. Neither knows where the
//! slots are: `store/` maps reservations to concrete slots.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The key a request is admitted under (the engine's `req_id`).
pub type ReqId = String;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// A request of 0 chunks.
    #[error(
        "request {req}: 0 chunks declared; a request must declare total_chunks > 0 (legacy senders are not supported)"
    )]
    ZeroChunks {
        /// The request.
        req: ReqId,
    },
    /// More chunks than the store has slots: it can never fit.
    #[error(
        "request {req} needs {needed} slots but the store has only {capacity} in all: it can never fit; use fewer or smaller chunks, or a larger target"
    )]
    TooLarge {
        /// The request.
        req: ReqId,
        /// Slots it needs.
        needed: u64,
        /// Slots in all.
        capacity: u64,
    },
    /// The request already holds a reservation.
    #[error("request {req} is already admitted (holding {held} slots)")]
    AlreadyAdmitted {
        /// The request.
        req: ReqId,
        /// Slots it holds.
        held: u64,
    },
    /// No capacity freed within the admission timeout.
    #[error(
        "request {req} waited {waited_ms} ms for {needed} slots; {free} of {capacity} were free (held by {holders} requests): retry later or raise the admission timeout"
    )]
    Timeout {
        /// The request.
        req: ReqId,
        /// Slots it needs.
        needed: u64,
        /// Slots free when it gave up.
        free: u64,
        /// Slots in all.
        capacity: u64,
        /// Requests holding reservations.
        holders: usize,
        /// How long it waited, in ms.
        waited_ms: u64,
    },
    /// The request was aborted while it waited.
    #[error("request {req} was aborted while waiting for admission")]
    Aborted {
        /// The request.
        req: ReqId,
    },
}

#[derive(Debug, Default)]
struct Reservations {
    capacity: u64,
    reserved: u64,
    held: HashMap<ReqId, u64>,
    /// Requests aborted while (possibly) waiting; their waiters give up.
    aborted: HashSet<ReqId>,
    /// Admissions that had to wait for capacity.
    waits: u64,
}

impl Reservations {
    fn check(&self) {
        debug_assert!(self.reserved <= self.capacity, "reserved {} > capacity {}", self.reserved, self.capacity);
        debug_assert_eq!(self.reserved, self.held.values().sum::<u64>(), "reserved total disagrees with holders");
    }
}

/// Reserves whole chunk sets against a fixed capacity.
#[derive(Debug)]
pub struct ReservationManager {
    state: Mutex<Reservations>,
    freed: Condvar,
}

/// A snapshot for tests and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationStats {
    /// Slots in all.
    pub capacity: u64,
    /// Slots reserved.
    pub reserved: u64,
    /// Requests holding reservations.
    pub holders: usize,
    /// Admissions that found too little capacity and waited (or timed out).
    pub waits: u64,
}

impl ReservationManager {
    /// A manager of `capacity` slots, none reserved.
    pub fn new(capacity: u64) -> Self {
        ReservationManager { state: Mutex::new(Reservations { capacity, ..Default::default() }), freed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Reservations> {
        // A panic while holding the lock leaves plain counters behind; they stay usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `n` slots for `req`, waiting up to `timeout` for them to free.
    /// A refusal changes nothing.
    pub fn try_admit(&self, req: &str, n: u64, timeout: Duration) -> Result<(), AdmitError> {
        let started = Instant::now();
        let mut s = self.lock();
        if n == 0 {
            return Err(AdmitError::ZeroChunks { req: req.into() });
        }
        if n > s.capacity {
            return Err(AdmitError::TooLarge { req: req.into(), needed: n, capacity: s.capacity });
        }
        if let Some(&held) = s.held.get(req) {
            return Err(AdmitError::AlreadyAdmitted { req: req.into(), held });
        }
        s.aborted.remove(req);
        let mut counted = false;
        loop {
            if s.aborted.remove(req) {
                return Err(AdmitError::Aborted { req: req.into() });
            }
            if s.capacity - s.reserved >= n {
                s.reserved += n;
                s.held.insert(req.into(), n);
                s.check();
                return Ok(());
            }
            let waited = started.elapsed();
            if !counted {
                s.waits += 1;
                counted = true;
            }
            if waited >= timeout {
                return Err(AdmitError::Timeout {
                    req: req.into(),
                    needed: n,
                    free: s.capacity - s.reserved,
                    capacity: s.capacity,
                    holders: s.held.len(),
                    waited_ms: waited.as_millis() as u64,
                });
            }
            s = self.freed.wait_timeout(s, timeout - waited).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Records a reservation that already exists on media (recovery): no wait.
    pub fn restore(&self, req: &str, n: u64) -> Result<(), AdmitError> {
        let mut s = self.lock();
        if s.held.contains_key(req) {
            return Err(AdmitError::AlreadyAdmitted { req: req.into(), held: s.held[req] });
        }
        if s.capacity - s.reserved < n {
            return Err(AdmitError::TooLarge { req: req.into(), needed: n, capacity: s.capacity - s.reserved });
        }
        s.reserved += n;
        s.held.insert(req.into(), n);
        s.check();
        Ok(())
    }

    /// Lowers `req`'s reservation to `to` slots (the last batch placed fewer
    /// chunks than reserved). Returns the slots given back.
    pub fn shrink(&self, req: &str, to: u64) -> u64 {
        let mut s = self.lock();
        let Some(held) = s.held.get_mut(req) else {
            return 0;
        };
        let give = held.saturating_sub(to);
        *held -= give;
        s.reserved -= give;
        s.check();
        drop(s);
        if give > 0 {
            self.freed.notify_all();
        }
        give
    }

    /// Releases everything `req` holds. Idempotent; wakes waiters. Returns the
    /// slots released (0 for an unknown or already released request).
    pub fn release(&self, req: &str) -> u64 {
        let mut s = self.lock();
        let n = s.held.remove(req).unwrap_or(0);
        s.reserved -= n;
        s.check();
        drop(s);
        self.freed.notify_all();
        n
    }

    /// Aborts `req`: a waiter for it gives up with [`AdmitError::Aborted`], and
    /// anything it holds is released. Returns the slots released.
    pub fn abort(&self, req: &str) -> u64 {
        let mut s = self.lock();
        let n = s.held.remove(req).unwrap_or(0);
        s.reserved -= n;
        if n == 0 {
            // Only a request not yet admitted can be waiting; mark it.
            s.aborted.insert(req.into());
        }
        s.check();
        drop(s);
        self.freed.notify_all();
        n
    }

    /// Every request holding a reservation, with what it holds.
    pub fn holders(&self) -> Vec<(ReqId, u64)> {
        self.lock().held.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Slots request `req` holds.
    pub fn held(&self, req: &str) -> u64 {
        self.lock().held.get(req).copied().unwrap_or(0)
    }

    /// Capacity, reservations and waits now.
    pub fn stats(&self) -> ReservationStats {
        let s = self.lock();
        ReservationStats { capacity: s.capacity, reserved: s.reserved, holders: s.held.len(), waits: s.waits }
    }

    /// The invariant, as a checkable result for tests: reserved <= capacity and
    /// equal to the sum of what holders hold.
    pub fn check(&self) -> Result<(), String> {
        let s = self.lock();
        let sum: u64 = s.held.values().sum();
        if s.reserved > s.capacity || sum != s.reserved {
            return Err(format!("reserved {} (holders sum {sum}) vs capacity {}", s.reserved, s.capacity));
        }
        Ok(())
    }
}

/// Why no staging slot was allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StagingError {
    /// The request was aborted while it waited.
    #[error("request {req} was aborted while waiting for a staging slot")]
    Aborted {
        /// The request.
        req: ReqId,
    },
    /// No staging slot freed in time.
    #[error("no staging slot freed within {waited_ms} ms ({slots} slots, all busy)")]
    Timeout {
        /// Slots in the pool.
        slots: usize,
        /// How long it waited, in ms.
        waited_ms: u64,
    },
}

/// Writer-side staging slots for the host-staged path: `allocate` blocks until
/// a slot frees after its write completes, and wakes on abort. Flow control
/// only — the reservation is the deadlock guard.
#[derive(Debug)]
pub struct StagingPool {
    state: Mutex<Staging>,
    freed: Condvar,
}

#[derive(Debug)]
struct Staging {
    free: Vec<usize>,
    slots: usize,
    aborted: HashSet<ReqId>,
}

impl StagingPool {
    /// A pool of `slots` staging slots, all free.
    pub fn new(slots: usize) -> Self {
        StagingPool {
            state: Mutex::new(Staging { free: (0..slots).rev().collect(), slots, aborted: HashSet::new() }),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Staging> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a free staging slot for `req`, waiting up to `timeout`.
    pub fn allocate(&self, req: &str, timeout: Duration) -> Result<usize, StagingError> {
        let started = Instant::now();
        let mut s = self.lock();
        loop {
            if s.aborted.contains(req) {
                return Err(StagingError::Aborted { req: req.into() });
            }
            if let Some(slot) = s.free.pop() {
                return Ok(slot);
            }
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(StagingError::Timeout { slots: s.slots, waited_ms: waited.as_millis() as u64 });
            }
            s = self.freed.wait_timeout(s, timeout - waited).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Returns a slot after its write completed.
    pub fn free(&self, slot: usize) {
        let mut s = self.lock();
        debug_assert!(slot < s.slots && !s.free.contains(&slot), "staging slot {slot} freed twice");
        if slot < s.slots && !s.free.contains(&slot) {
            s.free.push(slot);
        }
        drop(s);
        self.freed.notify_all();
    }

    /// Wakes `req`'s waiters with an abort; later allocations for it fail too
    /// until [`StagingPool::forget`].
    pub fn abort(&self, req: &str) {
        self.lock().aborted.insert(req.into());
        self.freed.notify_all();
    }

    /// Lets `req` allocate again after an abort.
    pub fn forget(&self, req: &str) {
        self.lock().aborted.remove(req);
    }

    /// Staging slots free now.
    pub fn free_slots(&self) -> usize {
        self.lock().free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn buffer_of_10_with_two_requests_of_8_does_not_deadlock() {
        let m = Arc::new(ReservationManager::new(10));
        m.try_admit("A", 8, LONG).unwrap();
        let m2 = m.clone();
        let b = thread::spawn(move || {
            let t = Instant::now();
            m2.try_admit("B", 8, LONG).map(|_| t.elapsed())
        });
        thread::sleep(Duration::from_millis(100));
        assert_eq!(m.held("B"), 0, "B waits while A holds 8 of 10");
        assert_eq!(m.release("A"), 8);
        let waited = b.join().unwrap().expect("B is admitted once A releases");
        assert!(waited >= Duration::from_millis(90));
        assert_eq!(m.stats(), ReservationStats { capacity: 10, reserved: 8, holders: 1, waits: 1 });
        m.check().unwrap();
    }

    #[test]
    fn too_large_fails_at_once_and_zero_is_refused() {
        let m = ReservationManager::new(10);
        let t = Instant::now();
        assert!(matches!(m.try_admit("big", 11, LONG), Err(AdmitError::TooLarge { needed: 11, capacity: 10, .. })));
        assert!(t.elapsed() < Duration::from_secs(1), "never waits for the impossible");
        let e = m.try_admit("legacy", 0, LONG).unwrap_err();
        assert!(e.to_string().contains("legacy senders are not supported"));
        assert_eq!(m.stats().reserved, 0, "refusals change nothing");
    }

    #[test]
    fn admission_times_out_when_one_request_holds_everything() {
        let m = ReservationManager::new(4);
        m.try_admit("hog", 4, LONG).unwrap();
        let e = m.try_admit("late", 1, Duration::from_millis(50)).unwrap_err();
        match e {
            AdmitError::Timeout { free: 0, capacity: 4, holders: 1, .. } => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(m.held("late"), 0);
    }

    #[test]
    fn abort_wakes_the_waiter_and_release_is_idempotent() {
        let m = Arc::new(ReservationManager::new(2));
        m.try_admit("A", 2, LONG).unwrap();
        let m2 = m.clone();
        let w = thread::spawn(move || m2.try_admit("B", 2, LONG));
        thread::sleep(Duration::from_millis(50));
        m.abort("B");
        assert_eq!(w.join().unwrap(), Err(AdmitError::Aborted { req: "B".into() }));
        assert_eq!(m.release("A"), 2);
        assert_eq!(m.release("A"), 0, "second release is a no-op");
        assert_eq!(m.abort("unknown"), 0);
        m.try_admit("B", 2, LONG).expect("an aborted request id may be admitted again later");
    }

    #[test]
    fn shrink_gives_back_the_unused_part() {
        let m = ReservationManager::new(10);
        m.try_admit("A", 5, LONG).unwrap();
        assert_eq!(m.shrink("A", 3), 2);
        assert_eq!(m.stats().reserved, 3);
        assert_eq!(m.shrink("A", 7), 0, "shrink never grows");
    }

    #[test]
    fn staging_allocate_blocks_until_free_and_wakes_on_abort() {
        let p = Arc::new(StagingPool::new(1));
        let s = p.allocate("A", LONG).unwrap();
        let p2 = p.clone();
        let w = thread::spawn(move || p2.allocate("A", LONG));
        thread::sleep(Duration::from_millis(50));
        p.free(s);
        assert_eq!(w.join().unwrap(), Ok(s));
        let p3 = p.clone();
        let w = thread::spawn(move || p3.allocate("B", LONG));
        thread::sleep(Duration::from_millis(50));
        p.abort("B");
        assert_eq!(w.join().unwrap(), Err(StagingError::Aborted { req: "B".into() }));
        assert!(matches!(p.allocate("C", Duration::from_millis(10)), Err(StagingError::Timeout { .. })));
    }
}
