//! The store's memory of who owns which bytes: publications, their phases,
//! and the slot allocator. Every change is a journal [`Record`] applied here,
//! live or during replay, so the state after recovery is exactly the state the
//! records describe. Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use super::error::{Invariant, StateError};
use super::journal::Record;
pub use super::publication::{ClaimInfo, Owner, Phase, Publication};
use pdstor_client::layout::ChunkEntry;
use pdstor_client::layout::Layout;
use pdstor_client::layout::SlotIndex;
use pdstor_engine::io::TargetOffset;

/// Every publication and slot owner the journal describes: rebuilt by replay, changed only by records.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// Bytes per slot.
    pub slot_size: u64,
    /// Where slot 0 starts on the target.
    pub data_offset: u64,
    owner: Vec<Option<u64>>,
    free: BTreeSet<SlotIndex>,
    /// Live publications by number.
    pub pubs: BTreeMap<u64, Publication>,
    /// The number the next prepare takes.
    pub next_publication: u64,
    /// The daemon epoch.
    pub epoch: u64,
}

impl State {
    /// An empty state of `slot_count` slots of `slot_size` bytes from `data_offset`.
    pub fn new(slot_count: u64, slot_size: u64, data_offset: u64) -> State {
        State {
            slot_size,
            data_offset,
            owner: vec![None; slot_count as usize],
            free: (0..slot_count as u32).map(SlotIndex).collect(),
            pubs: BTreeMap::new(),
            next_publication: 1,
            epoch: 0,
        }
    }

    /// Slots in the namespace.
    pub fn slot_count(&self) -> u64 {
        self.owner.len() as u64
    }
    /// Slots no publication owns.
    pub fn free_slots(&self) -> u64 {
        self.free.len() as u64
    }

    /// Where on the target slot `slot` begins: the one place a slot number
    /// becomes a target offset.
    pub fn slot_offset(&self, slot: SlotIndex) -> TargetOffset {
        assert!(u64::from(slot.0) < self.slot_count(), "slot {slot} beyond the {} slots", self.slot_count());
        TargetOffset(self.data_offset + u64::from(slot.0) * self.slot_size)
    }

    /// Picks `n` free slots (lowest first) without taking them.
    pub fn pick_slots(&self, n: u32) -> Option<Vec<SlotIndex>> {
        self.pick_slots_avoiding(n, &BTreeSet::new())
    }

    /// Like [`pick_slots`](Self::pick_slots), passing over the slots in `avoid`.
    pub fn pick_slots_avoiding(&self, n: u32, avoid: &BTreeSet<SlotIndex>) -> Option<Vec<SlotIndex>> {
        let v: Vec<SlotIndex> = self.free.iter().filter(|s| !avoid.contains(s)).take(n as usize).copied().collect();
        (v.len() == n as usize).then_some(v)
    }

    /// The live publication of request `req`, if any.
    pub fn by_req(&self, req: &str) -> Option<&Publication> {
        self.pubs.values().find(|p| p.req_id == req)
    }

    fn take_slots(&mut self, pub_id: u64, slots: &[SlotIndex]) -> Result<(), StateError> {
        for s in slots {
            match self.owner.get(s.0 as usize) {
                Some(None) => {}
                Some(Some(o)) => {
                    return Err(StateError::SlotOwned { slot: *s, owner: *o });
                }
                None => return Err(StateError::NoSuchSlot(*s)),
            }
        }
        for s in slots {
            self.owner[s.0 as usize] = Some(pub_id);
            self.free.remove(s);
        }
        Ok(())
    }

    fn free_pub(&mut self, pub_id: u64) -> Option<Publication> {
        let p = self.pubs.remove(&pub_id)?;
        for s in &p.slots {
            if self.owner[s.0 as usize] == Some(pub_id) {
                self.owner[s.0 as usize] = None;
                self.free.insert(*s);
            }
        }
        Some(p)
    }

    fn get_mut(&mut self, id: u64) -> Result<&mut Publication, StateError> {
        self.pubs.get_mut(&id).ok_or(StateError::NotLive(id))
    }

    /// The live publication `id` for a `what` record, if it is in one of
    /// the `allowed` phases.
    fn for_record(&mut self, id: u64, what: &'static str, allowed: &[Phase]) -> Result<&mut Publication, StateError> {
        let p = self.get_mut(id)?;
        if !allowed.contains(&p.phase) {
            return Err(StateError::Transition { publication: id, what, phase: p.phase });
        }
        Ok(p)
    }

    /// Applies one record. Refuses (changing nothing) a record that does not
    /// fit the current state.
    pub fn apply(&mut self, r: &Record) -> Result<(), StateError> {
        match r {
            Record::Prepare {
                publication,
                req_id,
                writer,
                layout,
                total_chunks,
                slots,
                owner,
                unread_release_ms,
                cache,
            } => {
                self.apply_prepare(*publication, req_id, writer, layout, *total_chunks, slots)?;
                if let Some(p) = self.pubs.get_mut(publication) {
                    p.owner = owner.clone();
                    p.unread_release_ms = *unread_release_ms;
                    p.cache = *cache;
                }
            }
            Record::Alloc { publication, chunk, slot, len, crc32c } => {
                self.apply_alloc(*publication, *chunk, *slot, *len, *crc32c)?;
            }
            Record::Publish { publication, manifest } => {
                let p = self.for_record(*publication, "published", &[Phase::Prepared])?;
                p.phase = Phase::Ready;
                p.set_manifest(manifest.clone());
            }
            Record::Claim { publication, reader, session, lease_ms, epoch, claimed_unix_ms, claimant } => {
                let p = self.for_record(*publication, "claimed", &[Phase::Ready])?;
                p.phase = Phase::Claimed;
                p.claim = Some(ClaimInfo {
                    reader: reader.clone(),
                    session: session.clone(),
                    lease_ms: *lease_ms,
                    epoch: *epoch,
                    claimed_unix_ms: *claimed_unix_ms,
                    claimant: claimant.clone(),
                    direct: false,
                    reservation_key: None,
                });
            }
            Record::Adopt { publication, direct, reservation_key } => {
                let p = self.for_record(*publication, "adopted", &[Phase::Claimed])?;
                p.phase = Phase::Adopted;
                if let Some(c) = &mut p.claim {
                    c.direct = *direct;
                    c.reservation_key = *reservation_key;
                }
            }
            Record::Retain { publication, .. } => {
                let allowed = [Phase::Claimed, Phase::Adopted];
                self.for_record(*publication, "retained", &allowed)?.phase = Phase::Retained;
            }
            Record::Ack { publication, .. } => self.free_record(*publication, "acked", &[Phase::Adopted])?,
            Record::Release { publication } => self.free_record(*publication, "released", &[Phase::Ready])?,
            Record::Reclaim { publication } => {
                let allowed = [Phase::Retained, Phase::Claimed, Phase::Adopted];
                self.free_record(*publication, "reclaimed", &allowed)?;
            }
            Record::Abort { publication, .. } => {
                self.free_record(*publication, "aborted", &[Phase::Prepared, Phase::Aborting])?;
            }
            Record::Epoch { epoch } => self.epoch = *epoch,
            Record::Checkpoint { next_publication, publications } => {
                let mut fresh = State::new(self.slot_count(), self.slot_size, self.data_offset);
                fresh.epoch = self.epoch;
                for p in publications {
                    fresh.take_slots(p.id, &p.slots)?;
                    let mut p = p.clone();
                    if let Some(m) = p.manifest.take() {
                        p.set_manifest(m);
                    }
                    fresh.pubs.insert(p.id, p);
                }
                fresh.next_publication = *next_publication;
                *self = fresh;
            }
        }
        Ok(())
    }

    /// A PREPARE: takes the slots and adds the publication.
    fn apply_prepare(
        &mut self,
        publication: u64,
        req_id: &str,
        writer: &str,
        layout: &Layout,
        total_chunks: u32,
        slots: &[SlotIndex],
    ) -> Result<(), StateError> {
        if self.pubs.contains_key(&publication) {
            return Err(StateError::PreparedTwice(publication));
        }
        if slots.len() != total_chunks as usize {
            return Err(StateError::SlotCount { slots: slots.len(), chunks: total_chunks });
        }
        self.take_slots(publication, slots)?;
        let p = Publication {
            id: publication,
            req_id: req_id.into(),
            writer: writer.into(),
            layout: layout.clone(),
            total_chunks,
            slots: slots.to_vec(),
            chunks: vec![None; total_chunks as usize],
            phase: Phase::Prepared,
            manifest: None,
            claim: None,
            owner: None,
            unread_release_ms: None,
            cache: false,
            digest: Default::default(),
        };
        self.pubs.insert(publication, p);
        self.next_publication = self.next_publication.max(publication + 1);
        Ok(())
    }

    /// An ALLOC: the chunk stored in its reserved slot.
    fn apply_alloc(
        &mut self,
        publication: u64,
        chunk: u32,
        slot: SlotIndex,
        len: u64,
        crc32c: u32,
    ) -> Result<(), StateError> {
        let (data_offset, slot_size) = (self.data_offset, self.slot_size);
        let p = self.get_mut(publication)?;
        if p.phase != Phase::Prepared {
            return Err(StateError::StoredOutOfPhase { publication, phase: p.phase });
        }
        if p.slots.get(chunk as usize) != Some(&slot) || len > slot_size {
            return Err(StateError::WrongSlot { publication, chunk, slot });
        }
        let offset = TargetOffset(data_offset + u64::from(slot.0) * slot_size);
        p.chunks[chunk as usize] = Some(ChunkEntry { index: chunk, slot, offset, len, crc32c });
        Ok(())
    }

    /// A record that ends a publication in one of `allowed` phases and frees its slots.
    fn free_record(&mut self, publication: u64, what: &'static str, allowed: &[Phase]) -> Result<(), StateError> {
        self.for_record(publication, what, allowed)?;
        self.free_pub(publication);
        Ok(())
    }

    /// Marks a publication whose abort must wait for in-flight batches.
    pub fn mark_aborting(&mut self, id: u64) {
        if let Some(p) = self.pubs.get_mut(&id) {
            p.phase = Phase::Aborting;
        }
    }

    /// The allocator invariants: no slot owned twice, every owned slot belongs
    /// to a live publication that lists it, the free set is exactly the
    /// unowned slots, and every stored chunk sits in its reserved slot.
    pub fn check(&self) -> Result<(), Invariant> {
        let mut seen = BTreeMap::new();
        for p in self.pubs.values() {
            if p.slots.len() != p.total_chunks as usize || p.chunks.len() != p.total_chunks as usize {
                return Err(Invariant::SlotCount { publication: p.id, slots: p.slots.len(), chunks: p.total_chunks });
            }
            for (i, s) in p.slots.iter().enumerate() {
                if let Some(other) = seen.insert(*s, p.id) {
                    return Err(Invariant::OwnedTwice { slot: *s, first: other, second: p.id });
                }
                if self.owner.get(s.0 as usize) != Some(&Some(p.id)) {
                    return Err(Invariant::NotMarked { slot: *s, publication: p.id });
                }
                if let Some(c) = &p.chunks[i]
                    && c.slot != *s
                {
                    return Err(Invariant::ChunkMisplaced {
                        chunk: i,
                        publication: p.id,
                        actual: c.slot,
                        reserved: *s,
                    });
                }
            }
        }
        for (s, o) in self.owner.iter().enumerate() {
            let s = SlotIndex(s as u32);
            match o {
                Some(id) if seen.get(&s) != Some(id) => {
                    return Err(Invariant::Unlisted { slot: s, publication: *id });
                }
                None if !self.free.contains(&s) => {
                    return Err(Invariant::Lost(s));
                }
                Some(_) if self.free.contains(&s) => {
                    return Err(Invariant::OwnedAndFree(s));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) fn test_layout() -> Layout {
    Layout {
        model_id: "test".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdstor_client::layout::Manifest;

    fn prepare(id: u64, slots: Vec<u32>) -> Record {
        Record::Prepare {
            publication: id,
            req_id: format!("r{id}"),
            writer: "w".into(),
            layout: test_layout(),
            total_chunks: slots.len() as u32,
            slots: slots.into_iter().map(SlotIndex).collect(),
            owner: None,
            unread_release_ms: None,
            cache: false,
        }
    }

    #[test]
    fn a_slot_is_never_owned_twice() {
        let mut s = State::new(4, 4096, 0);
        s.apply(&prepare(1, vec![0, 1])).unwrap();
        let e = s.apply(&prepare(2, vec![1, 2])).unwrap_err().to_string();
        assert!(e.contains("slot 1 is already owned by publication 1"));
        assert!(!s.pubs.contains_key(&2), "a refused record changes nothing");
        s.check().unwrap();
        assert_eq!(s.free_slots(), 2);
    }

    #[test]
    fn lifecycle_frees_slots_exactly_once() {
        let mut s = State::new(4, 4096, 0);
        s.apply(&prepare(1, vec![2, 3])).unwrap();
        let m = Manifest {
            publication: 1,
            req_id: "r1".into(),
            layout: test_layout(),
            chunks: vec![],
            first_token: None,
            restore_nonce: None,
        };
        s.apply(&Record::Publish { publication: 1, manifest: m }).unwrap();
        let claim = Record::Claim {
            publication: 1,
            reader: "d".into(),
            session: "s".into(),
            lease_ms: 10,
            epoch: 1,
            claimed_unix_ms: 0,
            claimant: None,
        };
        s.apply(&claim).unwrap();
        let ack = Record::Ack { publication: 1, restore_digest: "x".into() };
        assert!(s.apply(&ack).is_err(), "ack before adopt");
        s.apply(&Record::Adopt { publication: 1, direct: false, reservation_key: None }).unwrap();
        s.apply(&ack).unwrap();
        assert!(s.apply(&ack).is_err(), "a second ack is refused, never a double free");
        assert_eq!(s.free_slots(), 4);
        s.check().unwrap();
    }

    #[test]
    fn checkpoint_rebuilds_the_same_state() {
        let mut s = State::new(8, 4096, 0);
        s.apply(&prepare(3, vec![5])).unwrap();
        s.apply(&prepare(4, vec![1, 2])).unwrap();
        let cp = Record::Checkpoint {
            next_publication: s.next_publication,
            publications: s.pubs.values().cloned().collect(),
        };
        let mut t = State::new(8, 4096, 0);
        t.apply(&cp).unwrap();
        assert_eq!(t.pubs, s.pubs);
        assert_eq!(t.free_slots(), 5);
        t.check().unwrap();
    }
}
