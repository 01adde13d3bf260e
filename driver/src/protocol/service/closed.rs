//! Closed reader sessions, remembered so that a closed session stays closed:
//! its claims fenced, and a reader that goes on in its name (a host the
//! operator believes stopped) fenced too.
//!
//! A session that still holds a claim is remembered for as long as it does:
//! forgetting it would unfence the claim. A session that holds nothing is
//! remembered among the last [`REMEMBERED`] closed, then forgotten, oldest
//! first: every failed decode closes a session, and a set that only grew
//! would grow the daemon's heap with its traffic. Readers name a fresh
//! session after a close (the Python client draws one per `Reader`); one
//! that came back in a forgotten name would be a new session to the daemon.

use std::collections::{HashMap, HashSet, VecDeque};

/// A session: (its claimant's principal, its name).
pub(super) type SessionKey = (String, String);

/// Closed sessions holding nothing that are remembered, at most.
pub(super) const REMEMBERED: usize = 16_384;

/// The closed sessions, in the order they were closed.
#[derive(Debug, Default)]
pub(super) struct ClosedSessions {
    /// Session → the sequence number of its last close.
    closed: HashMap<SessionKey, u64>,
    /// (sequence number, session), oldest first; an entry whose number is
    /// not the session's in `closed` was closed again since, and is skipped.
    order: VecDeque<(u64, SessionKey)>,
    next: u64,
}

impl ClosedSessions {
    /// Whether `key` is closed.
    pub(super) fn contains(&self, key: &SessionKey) -> bool {
        self.closed.contains_key(key)
    }

    /// How many sessions are remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.closed.len()
    }

    /// Closes `key`. Past [`REMEMBERED`] (and a quarter more, so the scan is
    /// paid once per many closes), forgets the oldest closed sessions that
    /// hold no claim, down to [`REMEMBERED`]; `holding` answers which
    /// sessions hold one now.
    pub(super) fn close(&mut self, key: SessionKey, holding: impl FnOnce() -> HashSet<SessionKey>) {
        let seq = self.next;
        self.next += 1;
        self.closed.insert(key.clone(), seq);
        self.order.push_back((seq, key));
        // A session closed again leaves its older entry in `order` behind:
        // those are dropped once they are as many as the remembered.
        if self.closed.len() <= REMEMBERED + REMEMBERED / 4 && self.order.len() <= 2 * (REMEMBERED + REMEMBERED / 4) {
            return;
        }
        let holding = holding();
        let mut kept = VecDeque::new();
        while self.closed.len() > REMEMBERED {
            let Some((seq, key)) = self.order.pop_front() else { break };
            if self.closed.get(&key) != Some(&seq) {
                continue;
            }
            if holding.contains(&key) {
                kept.push_back((seq, key));
            } else {
                self.closed.remove(&key);
            }
        }
        // Sessions still holding a claim keep their place at the front.
        while let Some(entry) = kept.pop_back() {
            self.order.push_front(entry);
        }
        self.order.retain(|(seq, key)| self.closed.get(key) == Some(seq));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: usize) -> SessionKey {
        ("reader".to_owned(), format!("session-{i}"))
    }

    #[test]
    fn sessions_holding_nothing_are_forgotten_oldest_first_and_holders_never() {
        let mut s = ClosedSessions::default();
        let holders: HashSet<SessionKey> = [key(0), key(7)].into_iter().collect();
        let total = 3 * REMEMBERED;
        for i in 0..total {
            s.close(key(i), || holders.clone());
            assert!(s.len() <= REMEMBERED + REMEMBERED / 4 + 1, "the set stays bounded: {} after {i}", s.len());
        }
        assert!(s.contains(&key(0)) && s.contains(&key(7)), "a session holding a claim stays closed");
        assert!(!s.contains(&key(1)), "the oldest holding nothing is forgotten");
        assert!(s.contains(&key(total - 1)), "the newest is remembered");
        assert!(s.order.len() == s.len(), "the order holds each remembered session once");
    }

    #[test]
    fn a_session_closed_again_is_remembered_from_its_last_close() {
        let mut s = ClosedSessions::default();
        s.close(key(0), HashSet::new);
        for i in 1..REMEMBERED + REMEMBERED / 4 {
            s.close(key(i), HashSet::new);
        }
        s.close(key(0), HashSet::new);
        s.close(key(usize::MAX), HashSet::new);
        assert!(s.contains(&key(0)), "closed again: as new as its last close");
        assert!(!s.contains(&key(1)), "older than it: forgotten");
        assert_eq!(s.len(), REMEMBERED);
    }

    #[test]
    fn one_session_closed_over_and_over_is_one_entry() {
        let mut s = ClosedSessions::default();
        for _ in 0..10 * REMEMBERED {
            s.close(key(0), HashSet::new);
        }
        assert_eq!(s.len(), 1);
        assert!(s.order.len() <= 2 * (REMEMBERED + REMEMBERED / 4) + 1, "{} entries kept", s.order.len());
    }
}
