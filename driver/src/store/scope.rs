//! One commit for many transitions: a batch of protocol steps
//! (`POST /storage-pd/batch`) runs on one thread inside
//! [`Store::with_one_commit`]. There, a transition that would commit before
//! it returns (publish, claim, ack, release, …) only journals its record, and
//! one that frees slots leaves them quarantined; when the scope ends, one
//! commit makes every record durable, then the freed slots leave quarantine
//! and their reservations are given back — exactly what each transition does
//! alone, with one flush instead of one per step.
//!
//! The scope is per thread, so a step taken on another thread (another
//! connection's request) commits as it always does, and its flush makes this
//! scope's records durable too: the journal is one ordered log. Nothing may
//! wait inside a scope for what the scope holds back (a prepare waiting for
//! slots its own batch freed): the batch runs prepares outside any scope.

use std::cell::RefCell;

use super::Store;
use super::error::StoreError;
use super::worker::CommitInfo;
use pdstor_client::layout::SlotIndex;

/// What a scope has held back until its commit.
#[derive(Debug, Default)]
struct Deferred {
    /// A transition asked for a commit.
    commit: bool,
    /// Each freed set of slots, with its request (for its reservation).
    freed: Vec<(String, Vec<SlotIndex>)>,
}

thread_local! {
    static SCOPE: RefCell<Option<Deferred>> = const { RefCell::new(None) };
}

impl Store {
    /// Runs `f` with this thread's commits deferred to one at its end (see
    /// the module). Answers what `f` did and whether that commit succeeded:
    /// where it failed, nothing `f` did is durable and every step in it
    /// must be reported as failed. A scope inside a scope is the outer one.
    pub fn with_one_commit<T>(&self, f: impl FnOnce() -> T) -> (T, Result<(), StoreError>) {
        let outer = SCOPE.with(|s| s.borrow().is_some());
        if outer {
            return (f(), Ok(()));
        }
        SCOPE.with(|s| *s.borrow_mut() = Some(Deferred::default()));
        // Taken back even if `f` panics, so the thread is not left deferring.
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                SCOPE.with(|s| s.borrow_mut().take());
            }
        }
        let reset = Reset;
        let out = f();
        let deferred = SCOPE.with(|s| s.borrow_mut().take()).unwrap_or_default();
        drop(reset);
        if !deferred.commit && deferred.freed.is_empty() {
            return (out, Ok(()));
        }
        let freed: Vec<(&str, &[SlotIndex])> = deferred.freed.iter().map(|(r, s)| (r.as_str(), s.as_slice())).collect();
        (out, self.free_when_durable(&freed))
    }

    /// Inside a scope: notes that a commit is owed and answers the last
    /// commit's figures; `None` outside one (commit now).
    pub(super) fn defer_commit(&self) -> Option<CommitInfo> {
        let deferred = SCOPE.with(|s| s.borrow_mut().as_mut().map(|d| d.commit = true).is_some());
        deferred.then(|| *self.last_commit.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Inside a scope: keeps `freed` quarantined until the scope's commit
    /// and answers true; false outside one (free them now).
    pub(super) fn defer_free(&self, freed: &[(&str, &[SlotIndex])]) -> bool {
        SCOPE.with(|s| {
            let mut s = s.borrow_mut();
            let Some(d) = s.as_mut() else { return false };
            d.commit = true;
            d.freed.extend(freed.iter().map(|(r, slots)| ((*r).to_owned(), slots.to_vec())));
            true
        })
    }
}
