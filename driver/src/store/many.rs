//! The payload of publications, one or many in one submission: the store
//! batches of PREPARED publications ([`Store::store_batches`]) and the loads
//! of READY ones ([`Store::load_many`]); a single store batch or load is a
//! batch of one of these. Each is validated and settled on its own
//! (`batch`); their I/O is one job for the I/O thread, so the device sees
//! them together. Should that job fail as a whole (one request refused
//! before anything ran), each of several runs again alone, so one bad
//! request fails only its own publication.

use super::Store;
use super::batch::{BatchOutcome, ChunkDest, StoreBatch, finish_load};
use super::error::StoreError;
use super::worker::PayloadResults;
use pdstor_client::layout::Manifest;
use pdstor_engine::io::IoRequest;

/// What each item's requests answered, run together (in item order).
fn together(store: &Store, items: &[&[IoRequest]]) -> Vec<Result<PayloadResults, StoreError>> {
    let all: Vec<IoRequest> = items.iter().flat_map(|r| r.iter().copied()).collect();
    if all.is_empty() {
        return items.iter().map(|_| Ok(Vec::new())).collect();
    }
    match store.io.payload(all) {
        // The I/O thread computes each read chunk's crc32c from the bytes it landed.
        Ok(results) => {
            let mut results = results.into_iter();
            items.iter().map(|r| Ok(results.by_ref().take(r.len()).collect())).collect()
        }
        Err(e) if items.len() == 1 => vec![Err(e)],
        Err(_) => items.iter().map(|r| store.io.payload(r.to_vec())).collect(),
    }
}

impl Store {
    /// One store batch of each of many publications, their writes submitted
    /// together; each answers what [`store_batch`](Self::store_batch) would.
    pub fn store_batches(&self, batches: &[StoreBatch]) -> Vec<Result<BatchOutcome, StoreError>> {
        let validated: Vec<Result<Vec<IoRequest>, StoreError>> =
            batches.iter().map(|b| self.validate_batch(b)).collect();
        let items: Vec<&[IoRequest]> = validated.iter().filter_map(|v| v.as_deref().ok()).collect();
        let mut io = together(self, &items).into_iter();
        batches
            .iter()
            .zip(validated)
            .map(|(batch, validated)| {
                validated?;
                let done =
                    io.next().ok_or(StoreError::Invariant(super::Invariant::MissingResult(batch.publication)))?;
                self.settle_batch(batch, done)
            })
            .collect()
    }

    /// Loads of many publications (`(publication, destinations)` each), their
    /// reads submitted together; each answers what [`load`](Self::load) would.
    pub fn load_many(&self, loads: &[(u64, &[ChunkDest])]) -> Vec<Result<Vec<Option<u32>>, StoreError>> {
        let begun: Vec<_> = loads.iter().map(|(id, dests)| self.begin_load(*id, dests)).collect();
        let items: Vec<&[IoRequest]> =
            begun.iter().filter_map(|b| b.as_ref().ok().map(|(_, _, r)| r.as_slice())).collect();
        let mut io = together(self, &items).into_iter();
        loads
            .iter()
            .zip(begun)
            .map(|((id, dests), begun)| {
                let (manifest, _loading, _): (Manifest, _, _) = begun?;
                let done = io.next().ok_or(StoreError::Invariant(super::Invariant::MissingResult(*id)))??;
                finish_load(*id, &manifest, dests, done)
            })
            .collect()
    }
}
