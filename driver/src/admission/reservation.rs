//! The reservation manager: whole chunk sets reserved against a fixed
//! capacity, with every waiting request known by its id.
//!
//! A request that fits is admitted at once. One that does not joins the
//! waiting queue, and capacity that frees is *granted* to waiters by whoever
//! frees it, under the lock, first-fit in arrival order: the decision never
//! depends on which thread wakes first, so a run is reproducible. A request id
//! is waiting, or holds a reservation, or neither — never two at once: a
//! second admission of the same id is refused and changes nothing of the
//! first's. A waiter leaves the queue granted, timed out, cancelled by its
//! request id ([`ReservationManager::abort`]) or by its own token
//! ([`CancelToken`], set when the client that asked went away).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{AdmissionInvariant, AdmitError, ReqId};

/// The time admission waits are measured in: monotonic, from any origin.
/// The daemon uses the system's; the simulation moves its own.
pub trait WaitClock: Send + Sync + std::fmt::Debug {
    /// Now, since the clock's origin.
    fn now(&self) -> Duration;
}

/// The system's monotonic clock.
#[derive(Debug)]
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl WaitClock for MonotonicClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// Set by whoever gives up on a waiting admission (the HTTP handler of a
/// client that disconnected); the waiter notices at its next wake-up, which
/// [`ReservationManager::wake`] forces.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not cancelled.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Gives up the wait.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether the wait was given up.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Counters since start, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdmissionCounters {
    /// Requests admitted (at once or after a wait).
    pub admitted: u64,
    /// Admissions that found too little capacity and waited.
    pub waits: u64,
    /// Waiters that gave up at their timeout.
    pub timeouts: u64,
    /// Waiters cancelled by request id or by their token.
    pub cancelled: u64,
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
    /// Requests waiting now.
    pub waiting: usize,
    /// Slots the waiting requests ask for, in all.
    pub waiting_slots: u64,
    /// Counters since start.
    pub counters: AdmissionCounters,
}

/// One waiting request.
#[derive(Debug)]
struct Waiter {
    ticket: u64,
    req: ReqId,
    n: u64,
}

/// What happened to a ticket while its waiter slept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    Granted,
    Cancelled,
}

#[derive(Debug, Default)]
struct Reservations {
    capacity: u64,
    reserved: u64,
    held: HashMap<ReqId, u64>,
    /// Requests waiting for capacity, in arrival order.
    queue: VecDeque<Waiter>,
    /// Tickets granted or cancelled while their waiter slept, with the
    /// request they belong to; the waiter takes its entry when it wakes.
    settled: HashMap<u64, (ReqId, Settled)>,
    next_ticket: u64,
    counters: AdmissionCounters,
}

impl Reservations {
    fn check(&self) {
        debug_assert!(self.reserved <= self.capacity, "reserved {} > capacity {}", self.reserved, self.capacity);
        debug_assert_eq!(self.reserved, self.held.values().sum::<u64>(), "reserved total disagrees with holders");
    }

    /// Whether `req` is waiting (queued, or settled but not yet woken).
    fn is_waiting(&self, req: &str) -> bool {
        self.queue.iter().any(|w| w.req == req) || self.settled.values().any(|(r, _)| r == req)
    }

    /// Grants freed capacity to waiters, first-fit in arrival order.
    fn grant(&mut self) -> bool {
        let mut granted = false;
        let mut i = 0;
        while i < self.queue.len() {
            let n = self.queue[i].n;
            if self.capacity - self.reserved >= n {
                if let Some(w) = self.queue.remove(i) {
                    self.reserved += n;
                    self.held.insert(w.req.clone(), n);
                    self.settled.insert(w.ticket, (w.req, Settled::Granted));
                    granted = true;
                }
            } else {
                i += 1;
            }
        }
        self.check();
        granted
    }

    /// Takes `ticket` out of the queue (or its settled entry), undoing a
    /// grant its waiter never saw.
    fn withdraw(&mut self, ticket: u64) {
        self.queue.retain(|w| w.ticket != ticket);
        if let Some((req, Settled::Granted)) = self.settled.remove(&ticket)
            && let Some(n) = self.held.remove(&req)
        {
            self.reserved -= n;
        }
    }
}

/// Reserves whole chunk sets against a fixed capacity.
#[derive(Debug)]
pub struct ReservationManager {
    state: Mutex<Reservations>,
    changed: Condvar,
    clock: Arc<dyn WaitClock>,
}

/// How long a waiter sleeps before it looks at the clock again: the bound on
/// how late a timeout measured by a clock other than the condvar's is seen.
const RECHECK: Duration = Duration::from_millis(50);

impl ReservationManager {
    /// A manager of `capacity` slots, none reserved, on the system clock.
    pub fn new(capacity: u64) -> Self {
        Self::with_clock(capacity, Arc::new(MonotonicClock::default()))
    }

    /// A manager of `capacity` slots whose waits are measured by `clock`.
    pub fn with_clock(capacity: u64, clock: Arc<dyn WaitClock>) -> Self {
        ReservationManager {
            state: Mutex::new(Reservations { capacity, ..Default::default() }),
            changed: Condvar::new(),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Reservations> {
        // A panic while holding the lock leaves plain counters behind; they stay usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `n` slots for `req`, waiting up to `timeout` for them to free.
    /// A refusal changes nothing.
    pub fn try_admit(&self, req: &str, n: u64, timeout: Duration) -> Result<(), AdmitError> {
        self.admit(req, n, timeout, &CancelToken::new())
    }

    /// [`try_admit`](Self::try_admit) that also gives up when `cancel` is set
    /// (and [`wake`](Self::wake) is called, or the next re-check comes).
    pub fn admit(&self, req: &str, n: u64, timeout: Duration, cancel: &CancelToken) -> Result<(), AdmitError> {
        let started = self.clock.now();
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
        if s.is_waiting(req) {
            let waiting = s.queue.iter().find(|w| w.req == req).map_or(0, |w| w.n);
            return Err(AdmitError::AlreadyWaiting { req: req.into(), waiting });
        }
        // Every capacity change grants to the waiters that fit, so none of
        // them fits what is free now: a newcomer that fits takes it.
        if s.capacity - s.reserved >= n {
            s.reserved += n;
            s.held.insert(req.into(), n);
            s.counters.admitted += 1;
            s.check();
            return Ok(());
        }
        let ticket = s.next_ticket;
        s.next_ticket += 1;
        s.queue.push_back(Waiter { ticket, req: req.into(), n });
        s.counters.waits += 1;
        loop {
            match s.settled.get(&ticket).map(|(_, how)| *how) {
                Some(Settled::Granted) => {
                    s.settled.remove(&ticket);
                    s.counters.admitted += 1;
                    return Ok(());
                }
                Some(Settled::Cancelled) => {
                    s.settled.remove(&ticket);
                    s.counters.cancelled += 1;
                    return Err(AdmitError::Aborted { req: req.into() });
                }
                None => {}
            }
            if cancel.is_cancelled() {
                s.withdraw(ticket);
                s.counters.cancelled += 1;
                drop(s);
                self.changed.notify_all();
                return Err(AdmitError::Cancelled { req: req.into() });
            }
            let waited = self.clock.now().saturating_sub(started);
            if waited >= timeout {
                s.withdraw(ticket);
                s.counters.timeouts += 1;
                return Err(AdmitError::Timeout {
                    req: req.into(),
                    needed: n,
                    free: s.capacity - s.reserved,
                    capacity: s.capacity,
                    holders: s.held.len(),
                    waited_ms: waited.as_millis() as u64,
                });
            }
            let sleep = (timeout - waited).min(RECHECK);
            s = self.changed.wait_timeout(s, sleep).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Wakes every waiter to look at its token and the clock again.
    pub fn wake(&self) {
        let _s = self.lock();
        self.changed.notify_all();
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
        s.grant();
        drop(s);
        if give > 0 {
            self.changed.notify_all();
        }
        give
    }

    /// Releases everything `req` holds and grants what frees to waiters.
    /// Idempotent. Returns the slots released (0 for an unknown or already
    /// released request).
    pub fn release(&self, req: &str) -> u64 {
        let mut s = self.lock();
        let n = s.held.remove(req).unwrap_or(0);
        s.reserved -= n;
        s.grant();
        drop(s);
        self.changed.notify_all();
        n
    }

    /// Aborts `req`: its waiter, if it waits, gives up with
    /// [`AdmitError::Aborted`] (a grant it has not seen is undone), and
    /// anything it holds is released. Returns whether a waiter was cancelled
    /// and the slots released.
    pub fn abort(&self, req: &str) -> (bool, u64) {
        let mut s = self.lock();
        let mut cancelled = false;
        let queued: Vec<u64> = s.queue.iter().filter(|w| w.req == req).map(|w| w.ticket).collect();
        for ticket in queued {
            s.queue.retain(|w| w.ticket != ticket);
            s.settled.insert(ticket, (req.into(), Settled::Cancelled));
            cancelled = true;
        }
        let granted: Vec<u64> =
            s.settled.iter().filter(|(_, (r, how))| r == req && *how == Settled::Granted).map(|(t, _)| *t).collect();
        for ticket in granted {
            s.settled.insert(ticket, (req.into(), Settled::Cancelled));
            cancelled = true;
        }
        let n = s.held.remove(req).unwrap_or(0);
        s.reserved -= n;
        s.grant();
        drop(s);
        self.changed.notify_all();
        (cancelled, n)
    }

    /// Every request holding a reservation, with what it holds.
    pub fn holders(&self) -> Vec<(ReqId, u64)> {
        self.lock().held.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// Slots request `req` holds.
    pub fn held(&self, req: &str) -> u64 {
        self.lock().held.get(req).copied().unwrap_or(0)
    }

    /// Whether `req` is waiting for admission.
    pub fn is_waiting(&self, req: &str) -> bool {
        self.lock().is_waiting(req)
    }

    /// Whether `req` is queued for capacity, nothing granted or cancelled yet
    /// (unlike [`is_waiting`](Self::is_waiting), false once its waiter only
    /// has to wake up to an answer).
    pub fn is_queued(&self, req: &str) -> bool {
        self.lock().queue.iter().any(|w| w.req == req)
    }

    /// Capacity, reservations, waiters and counters now.
    pub fn stats(&self) -> ReservationStats {
        let s = self.lock();
        ReservationStats {
            capacity: s.capacity,
            reserved: s.reserved,
            holders: s.held.len(),
            waits: s.counters.waits,
            waiting: s.queue.len(),
            waiting_slots: s.queue.iter().map(|w| w.n).sum(),
            counters: s.counters,
        }
    }

    /// The invariant, as a checkable result: reserved <= capacity and equal to
    /// the sum of what holders hold; no request both waiting and holding.
    pub fn check(&self) -> Result<(), AdmissionInvariant> {
        let s = self.lock();
        let held: u64 = s.held.values().sum();
        if s.reserved > s.capacity || held != s.reserved {
            return Err(AdmissionInvariant::Reserved { reserved: s.reserved, held, capacity: s.capacity });
        }
        if let Some(w) = s.queue.iter().find(|w| s.held.contains_key(&w.req)) {
            return Err(AdmissionInvariant::WaitsAndHolds { req: w.req.clone() });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::thread;

    const LONG: Duration = Duration::from_secs(10);

    /// Spins until `f` holds (another thread is about to make it hold).
    fn until(f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < LONG, "condition never held");
            thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn buffer_of_10_with_two_requests_of_8_does_not_deadlock() {
        let m = Arc::new(ReservationManager::new(10));
        m.try_admit("A", 8, LONG).expect("A fits the free slots");
        let m2 = m.clone();
        let b = thread::spawn(move || {
            let t = Instant::now();
            m2.try_admit("B", 8, LONG).map(|_| t.elapsed())
        });
        thread::sleep(Duration::from_millis(100));
        assert_eq!(m.held("B"), 0, "B waits while A holds 8 of 10");
        assert!(m.is_waiting("B"));
        assert_eq!(m.release("A"), 8);
        let waited = b.join().expect("the waiter thread panicked").expect("B is admitted once A releases");
        assert!(waited >= Duration::from_millis(90));
        let st = m.stats();
        assert_eq!((st.capacity, st.reserved, st.holders, st.waits, st.waiting), (10, 8, 1, 1, 0));
        assert_eq!(st.counters.admitted, 2);
        m.check().expect("the reservation invariants hold");
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
        m.try_admit("hog", 4, LONG).expect("hog fits the free slots");
        let e = m.try_admit("late", 1, Duration::from_millis(50)).unwrap_err();
        match e {
            AdmitError::Timeout { free: 0, capacity: 4, holders: 1, .. } => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(m.held("late"), 0);
        assert!(!m.is_waiting("late"), "a timed-out waiter leaves the queue");
        assert_eq!(m.stats().counters.timeouts, 1);
    }

    #[test]
    fn abort_wakes_the_waiter_and_release_is_idempotent() {
        let m = Arc::new(ReservationManager::new(2));
        m.try_admit("A", 2, LONG).expect("A fits the free slots");
        let m2 = m.clone();
        let w = thread::spawn(move || m2.try_admit("B", 2, LONG));
        until(|| m.is_waiting("B"));
        assert_eq!(m.abort("B"), (true, 0));
        assert_eq!(w.join().expect("the waiter thread panicked"), Err(AdmitError::Aborted { req: "B".into() }));
        assert_eq!(m.release("A"), 2);
        assert_eq!(m.release("A"), 0, "second release is a no-op");
        assert_eq!(m.abort("unknown"), (false, 0));
        m.try_admit("B", 2, LONG).expect("an aborted request id may be admitted again later");
    }

    #[test]
    fn a_second_admission_of_a_waiting_request_is_refused_and_changes_nothing() {
        let m = Arc::new(ReservationManager::new(10));
        m.try_admit("A", 8, LONG).expect("A fits the free slots");
        let m2 = m.clone();
        let d = thread::spawn(move || m2.try_admit("D", 8, LONG));
        until(|| m.is_waiting("D"));
        // The retry of D is refused, though 2 slots are free: it would leak them.
        assert_eq!(m.try_admit("D", 2, LONG), Err(AdmitError::AlreadyWaiting { req: "D".into(), waiting: 8 }));
        assert_eq!(m.stats().reserved, 8);
        assert_eq!(m.release("A"), 8);
        d.join().expect("the waiter thread panicked").expect("the first D is admitted once A releases");
        assert_eq!(m.held("D"), 8);
        assert_eq!(m.release("D"), 8);
        assert_eq!(m.stats().reserved, 0, "nothing leaked");
        m.check().expect("the reservation invariants hold");
    }

    #[test]
    fn a_cancelled_token_withdraws_the_waiter() {
        let m = Arc::new(ReservationManager::new(1));
        m.try_admit("A", 1, LONG).expect("A fits the free slots");
        let token = CancelToken::new();
        let (m2, t2) = (m.clone(), token.clone());
        let w = thread::spawn(move || m2.admit("B", 1, LONG, &t2));
        until(|| m.is_waiting("B"));
        token.cancel();
        m.wake();
        assert_eq!(w.join().expect("the waiter thread panicked"), Err(AdmitError::Cancelled { req: "B".into() }));
        assert_eq!(m.release("A"), 1);
        assert_eq!(m.stats().reserved, 0, "the withdrawn waiter was granted nothing");
        assert_eq!(m.stats().counters.cancelled, 1);
    }

    #[test]
    fn freed_capacity_goes_first_fit_in_arrival_order() {
        let m = Arc::new(ReservationManager::new(4));
        m.try_admit("A", 4, LONG).expect("A fits the free slots");
        let mut waiters = Vec::new();
        for (req, n) in [("big", 3), ("small", 1), ("other", 1)] {
            let m2 = m.clone();
            waiters.push(thread::spawn(move || m2.try_admit(req, n, LONG)));
            until(|| m.is_waiting(req));
        }
        // Releasing A grants under the lock, in arrival order: big (3), then
        // small (1); other (1) no longer fits and keeps waiting.
        m.release("A");
        assert_eq!((m.held("big"), m.held("small"), m.held("other")), (3, 1, 0));
        assert!(m.is_waiting("other"));
        m.release("small");
        assert_eq!(m.held("other"), 1);
        for w in waiters {
            w.join().expect("the waiter thread panicked").expect("each waiter is admitted in turn");
        }
    }

    #[test]
    fn aborting_a_grant_its_waiter_has_not_seen_undoes_it() {
        let m = ReservationManager::new(2);
        let mut s = m.lock();
        s.queue.push_back(Waiter { ticket: 7, req: "W".into(), n: 2 });
        s.grant();
        assert_eq!(s.reserved, 2);
        drop(s);
        assert_eq!(m.abort("W"), (true, 2));
        let s = m.lock();
        assert_eq!(s.reserved, 0);
        assert_eq!(s.settled.get(&7).map(|e| e.1), Some(Settled::Cancelled), "the waiter will see an abort");
    }

    /// A clock that moves only when told.
    #[derive(Debug, Default)]
    struct Manual(AtomicU64);

    impl WaitClock for Manual {
        fn now(&self) -> Duration {
            Duration::from_millis(self.0.load(Ordering::SeqCst))
        }
    }

    #[test]
    fn timeouts_follow_the_injected_clock() {
        let clock = Arc::new(Manual::default());
        let m = Arc::new(ReservationManager::with_clock(1, clock.clone()));
        m.try_admit("A", 1, LONG).expect("A fits the free slots");
        let m2 = m.clone();
        let w = thread::spawn(move || m2.try_admit("B", 1, Duration::from_millis(500)));
        until(|| m.is_waiting("B"));
        thread::sleep(Duration::from_millis(120));
        assert!(m.is_waiting("B"), "wall time alone does not time it out");
        clock.0.store(500, Ordering::SeqCst);
        m.wake();
        assert!(matches!(
            w.join().expect("the waiter thread panicked"),
            Err(AdmitError::Timeout { waited_ms: 500, .. })
        ));
    }

    #[test]
    fn shrink_gives_back_the_unused_part() {
        let m = ReservationManager::new(10);
        m.try_admit("A", 5, LONG).expect("A fits the free slots");
        assert_eq!(m.shrink("A", 3), 2);
        assert_eq!(m.stats().reserved, 3);
        assert_eq!(m.shrink("A", 7), 0, "shrink never grows");
    }
}
