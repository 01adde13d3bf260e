//! Eviction of unread publications under capacity pressure (DESIGN §5): when
//! a prepare finds too few free slots, READY publications nobody has claimed,
//! of tenants whose operator opted in, are released — oldest first (by
//! publication id, the order of their prepares) — until the prepare and the
//! prepares waiting before it fit. Each is an exact unread release: a RELEASE
//! record, journaled and committed before its slots can be prepared again. A
//! claimed, adopted or failed publication is never touched, nor a cache
//! publication while a reader holds a read of it. The same
//! release ends a READY publication no reader claimed within its unread
//! window (its writer's `unread_release_ms`, the daemon's
//! `--unread-release-ms`, the shorter).

use super::error::StoreError;
use super::{Live, Owner, Phase, Store};
use pdstor_client::layout::SlotIndex;

/// One publication an eviction released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    /// The publication.
    pub publication: u64,
    /// Its request.
    pub req_id: String,
    /// The slots it gave back.
    pub slots: u64,
    /// Who published it.
    pub owner: Option<Owner>,
    /// The unread window it was released after (none: evicted for room).
    pub window: Option<std::time::Duration>,
}

impl Store {
    /// Makes room for a prepare of `needed` slots: if what is free does not
    /// cover it and the slots the waiting prepares ask for, releases READY,
    /// never-claimed publications `evictable` accepts (by owner), oldest
    /// first, until it does or none is left. Answers what it released (none
    /// when nothing was short); the releases are durable when it returns.
    pub fn evict_unread(
        &self,
        needed: u64,
        evictable: &dyn Fn(Option<&Owner>) -> bool,
    ) -> Result<Vec<Evicted>, StoreError> {
        let mut evicted = Vec::new();
        let mut freeing: Vec<(String, Vec<SlotIndex>)> = Vec::new();
        let mut failed = None;
        {
            let mut live = self.lock_live();
            let st = self.admission.stats();
            let free = st.capacity.saturating_sub(st.reserved);
            let mut short = needed.saturating_add(st.waiting_slots).saturating_sub(free);
            if short == 0 {
                return Ok(evicted);
            }
            let oldest_first: Vec<u64> = live
                .state
                .pubs
                .values()
                .filter(|p| p.phase == Phase::Ready && p.claim.is_none() && evictable(p.owner.as_ref()))
                .map(|p| p.id)
                .filter(|id| live.reads_of(*id) == 0)
                .collect();
            for id in oldest_first {
                if short == 0 {
                    break;
                }
                match self.release_unread_locked(&mut live, id, &mut evicted, &mut freeing) {
                    Ok(n) => {
                        live.evicted += 1;
                        short = short.saturating_sub(n);
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        // What was released before a failure still gets its commit.
        self.free_released(&freeing)?;
        failed.map_or(Ok(evicted), Err)
    }

    /// The unread window: releases every READY publication nobody has
    /// claimed within its window since this first found it READY and
    /// unclaimed — the window its writer asked for at prepare, or the one
    /// `window` gives its owner (the daemon's and its tenant's), the shorter
    /// where both are set; a publication with neither is kept. The daemon's reaper calls it every tick, so the
    /// window starts at most a tick after the publish, and a publication
    /// recovered READY at open is given the whole window again. Each is an
    /// exact unread release (a RELEASE record), durable when this returns;
    /// a claimed, adopted or failed publication is never touched, whatever
    /// its age.
    pub fn release_unread_after(
        &self,
        window: impl Fn(Option<&Owner>) -> Option<std::time::Duration>,
    ) -> Result<Vec<Evicted>, StoreError> {
        let now = std::time::Instant::now();
        let mut expired = Vec::new();
        let mut freeing: Vec<(String, Vec<SlotIndex>)> = Vec::new();
        let mut failed = None;
        {
            let mut live = self.lock_live();
            let unread: std::collections::BTreeMap<u64, std::time::Duration> = live
                .state
                .pubs
                .values()
                .filter(|p| p.phase == Phase::Ready && p.claim.is_none() && live.reads_of(p.id) == 0)
                .filter_map(|p| {
                    let own = p.unread_release_ms.map(std::time::Duration::from_millis);
                    let after = window(p.owner.as_ref());
                    own.map_or(after, |o| Some(after.map_or(o, |a| a.min(o)))).map(|w| (p.id, w))
                })
                .collect();
            live.unread_since.retain(|id, _| unread.contains_key(id));
            for (id, window) in unread {
                let since = *live.unread_since.entry(id).or_insert(now);
                if now.duration_since(since) < window {
                    continue;
                }
                if let Err(e) = self.release_unread_locked(&mut live, id, &mut expired, &mut freeing) {
                    failed = Some(e);
                    break;
                }
                if let Some(e) = expired.last_mut() {
                    e.window = Some(window);
                }
                live.unread_since.remove(&id);
                live.expired += 1;
            }
        }
        self.free_released(&freeing)?;
        failed.map_or(Ok(expired), Err)
    }

    /// Whether any publication may have a window of its own: one was
    /// prepared with one since open, or recovered with one.
    pub fn any_unread_window(&self) -> bool {
        self.windowed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Releases unread publication `id` (a RELEASE record, not yet durable),
    /// noted in `out` and its slots in `freeing`; answers how many slots.
    fn release_unread_locked(
        &self,
        live: &mut Live,
        id: u64,
        out: &mut Vec<Evicted>,
        freeing: &mut Vec<(String, Vec<SlotIndex>)>,
    ) -> Result<u64, StoreError> {
        let owner = live.state.pubs.get(&id).and_then(|p| p.owner.clone());
        let (req, slots) = self.release_locked(live, id)?;
        let n = slots.len() as u64;
        out.push(Evicted { publication: id, req_id: req.clone(), slots: n, owner, window: None });
        freeing.push((req, slots));
        Ok(n)
    }

    /// One commit for all the releases; their slots stay quarantined until it is durable.
    fn free_released(&self, freeing: &[(String, Vec<SlotIndex>)]) -> Result<(), StoreError> {
        if freeing.is_empty() {
            return Ok(());
        }
        let freed: Vec<(&str, &[SlotIndex])> = freeing.iter().map(|(r, s)| (r.as_str(), s.as_slice())).collect();
        self.free_when_durable(&freed)
    }
}
