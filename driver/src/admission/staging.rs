//! Writer-side staging slots for the host-staged path: flow control only —
//! the reservation ([`super::ReservationManager`]) is the deadlock guard.

use std::collections::HashSet;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::ReqId;

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
    fn staging_allocate_blocks_until_free_and_wakes_on_abort() {
        let p = Arc::new(StagingPool::new(1));
        let s = p.allocate("A", LONG).expect("a free staging slot");
        let p2 = p.clone();
        let w = thread::spawn(move || p2.allocate("A", LONG));
        thread::sleep(Duration::from_millis(50));
        p.free(s);
        assert_eq!(w.join().expect("the waiter thread panicked"), Ok(s));
        let p3 = p.clone();
        let w = thread::spawn(move || p3.allocate("B", LONG));
        thread::sleep(Duration::from_millis(50));
        p.abort("B");
        assert_eq!(w.join().expect("the waiter thread panicked"), Err(StagingError::Aborted { req: "B".into() }));
        assert!(matches!(p.allocate("C", Duration::from_millis(10)), Err(StagingError::Timeout { .. })));
    }
}
