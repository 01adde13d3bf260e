//! The reads of cache publications (DESIGN §4): a READY cache publication is
//! read by any number of readers at once, each read counted here from its
//! start to its end, and none is released or evicted while a read of it is
//! counted or a load of it is in flight. The counts live in memory only: a
//! restart ends every read (the process that served them is gone, and every
//! load it had in flight with it), and recovery finds the publication READY.
//! Who may read, and the lease each read is, are the protocol's.

use super::error::StoreError;
use super::{Live, Phase, Store, in_phase};

impl Live {
    /// Reads of `id` in progress: read leases held and loads in flight.
    pub(super) fn reads_of(&self, id: u64) -> u32 {
        let held = self.reading.get(&id).copied().unwrap_or(0);
        held.saturating_add(self.loading.get(&id).copied().unwrap_or(0))
    }
}

impl Store {
    /// Starts a read of the READY cache publication `id`: until
    /// [`end_read`](Self::end_read), it is neither released nor evicted. A
    /// handoff publication is refused (it is claimed, by one reader), as is
    /// one in any phase but READY.
    pub fn begin_read(&self, id: u64) -> Result<(), StoreError> {
        let mut live = self.lock_live();
        let p = in_phase(&live.state, id, &[Phase::Ready], "only a READY publication can be read")?;
        if !p.cache {
            let what = "it is claimed by one reader (POST /storage-pd/claim), not read by many";
            return Err(StoreError::WrongClass { publication: id, class: "handoff", what });
        }
        let held = live.reading.entry(id).or_default();
        *held = held.checked_add(1).ok_or(StoreError::BeingRead { publication: id, reads: u32::MAX })?;
        // A read restarts its unread window (`release_unread_after`): the
        // window counts from the last read, however short, not the publish.
        live.unread_since.remove(&id);
        Ok(())
    }

    /// Ends one read of `id` that [`begin_read`](Self::begin_read) started;
    /// answers the reads still held. Ending a read not held is a bug, and
    /// answered as an invariant broken.
    pub fn end_read(&self, id: u64) -> Result<u32, StoreError> {
        let mut live = self.lock_live();
        let Some(held) = live.reading.get_mut(&id) else {
            return Err(super::Invariant::ReadNotHeld { publication: id }.into());
        };
        *held -= 1;
        let left = *held;
        if left == 0 {
            live.reading.remove(&id);
        }
        Ok(left)
    }

    /// Reads of publication `id` held now.
    pub fn reads(&self, id: u64) -> u32 {
        self.lock_live().reading.get(&id).copied().unwrap_or(0)
    }
}
