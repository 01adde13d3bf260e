//! The writer's and the reader's payload steps (DESIGN §5): store batches,
//! publish, and load. A store batch is validated against its publication
//! (a violation rolls the whole request back), its writes submitted to the
//! I/O thread with the lock released, then settled: each chunk's checksum
//! checked and its ALLOC journaled, or the whole request rolled back.

use std::collections::BTreeSet;
use std::time::Instant;

use super::error::{Invariant, StoreError};
use super::worker::PayloadResults;
use super::{Live, Store, in_phase};
use super::{Phase, Record};
use pdstor_client::layout::ChunkEntry;
use pdstor_client::layout::Manifest;
use pdstor_engine::io::{BufferId, BufferOffset, IoError, IoRequest, Op, PayloadPath, TransferId};

/// Per-request batch accounting (DESIGN §5).
#[derive(Debug, Default)]
pub(super) struct Batches {
    /// A batch was seen (it declared the total).
    pub seen_first: bool,
    /// Chunk indexes some batch has claimed.
    pub claimed: BTreeSet<u32>,
    /// Chunks stored and journaled.
    pub completed: u32,
    /// The batch marked last completed.
    pub last_seen: bool,
    /// The batch marked last was accepted (it may still be in flight).
    pub last_claimed: bool,
    /// Batches submitted and not yet settled.
    pub inflight: u32,
    /// The PUBLISH record was queued (or the publication was recovered READY).
    pub published: bool,
    /// When the request was prepared or last had a store batch begin or end.
    pub touched: Option<Instant>,
    /// When its prepare's answer was found undelivered (the client went
    /// away); cleared by a repeat of the prepare.
    pub orphaned: Option<Instant>,
    /// Its prepare's answer is still being made: a batch of prepares
    /// answers its first ones when its last is done, which may wait for
    /// capacity. Not idle until answered (`Store::answered`).
    pub answering: bool,
}

/// One chunk of a store batch: where its bytes are.
#[derive(Debug, Clone, Copy)]
pub struct ChunkSource {
    /// The chunk's index in its publication.
    pub index: u32,
    /// The held buffer the bytes are in.
    pub buffer: BufferId,
    /// Where in that buffer.
    pub buffer_offset: BufferOffset,
    /// The chunk's length in bytes.
    pub len: u64,
    /// The client's crc32c of the chunk. Checked against the bytes where the
    /// daemon can read them; the only checksum for memory it cannot map.
    pub crc32c: Option<u32>,
}

/// A store batch: the AllocRequest of the source design.
#[derive(Debug, Clone)]
pub struct StoreBatch {
    /// The PREPARED publication the chunks belong to.
    pub publication: u64,
    /// The chunks, any order, each index at most once per request.
    pub chunks: Vec<ChunkSource>,
    /// The writer sends no batch after this one.
    pub is_last_batch: bool,
    /// The request's total, as prepared (0 is a legacy sender, refused).
    pub total_chunks: u32,
}

/// Where a request stands after one of its batches settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Chunks stored so far.
    pub completed: u32,
    /// Chunks declared.
    pub total: u32,
    /// Every chunk stored, the last batch seen, none in flight: publish may follow.
    pub publishable: bool,
    /// Each chunk of this batch's crc32c as stored, in batch order.
    pub crcs: Vec<u32>,
}

/// One chunk to load: where to put it.
#[derive(Debug, Clone, Copy)]
pub struct ChunkDest {
    /// The chunk's index in its publication.
    pub index: u32,
    /// The held buffer to put it in.
    pub buffer: BufferId,
    /// Where in that buffer.
    pub buffer_offset: BufferOffset,
}

/// One load in flight; its end wakes a reclaim or ack waiting for it.
pub(super) struct Loading<'a> {
    store: &'a Store,
    id: u64,
}

impl Drop for Loading<'_> {
    fn drop(&mut self) {
        let mut live = self.store.lock_live();
        if let Some(n) = live.loading.get_mut(&self.id) {
            assert!(*n > 0, "publication {}: a load ended with none in flight", self.id);
            *n -= 1;
            if *n == 0 {
                live.loading.remove(&self.id);
            }
        }
        drop(live);
        self.store.loads_done.notify_all();
    }
}

/// What breaks the protocol in `batch`, given what earlier batches claimed:
/// a total other than the prepared one, a chunk out of range, stored twice or
/// of a size no slot holds, more chunks than declared, or a last batch that
/// leaves chunks no batch has claimed (the stream ended short).
fn violation(batch: &StoreBatch, b: &Batches, total: u32, slot_size: u64) -> Option<String> {
    if batch.total_chunks != total {
        return Some(format!(
            "the batch declares total_chunks {} but the request was prepared with {total}",
            batch.total_chunks
        ));
    }
    let mut seen = BTreeSet::new();
    for c in &batch.chunks {
        if c.index >= total {
            return Some(format!("chunk index {} is beyond the declared {total} chunks", c.index));
        } else if b.claimed.contains(&c.index) || !seen.insert(c.index) {
            return Some(format!("chunk {} stored twice", c.index));
        } else if c.len == 0 || c.len > slot_size {
            return Some(format!("chunk {} is {} bytes; a slot holds 1 to {slot_size}", c.index, c.len));
        }
    }
    let cumulative = b.claimed.len() + batch.chunks.len();
    if cumulative > total as usize {
        return Some(format!("{cumulative} chunks sent against {total} declared"));
    }
    if batch.is_last_batch && (b.last_seen || b.last_claimed) {
        return Some("a second batch marked last".into());
    }
    if batch.is_last_batch && cumulative < total as usize {
        let missing: Vec<u32> = (0..total).filter(|i| !b.claimed.contains(i) && !seen.contains(i)).take(8).collect();
        return Some(format!(
            "the batch marked last leaves {} of {total} chunks unsent (first missing: {missing:?}); send every chunk before (or in) the last batch",
            total as usize - cumulative
        ));
    }
    None
}

/// The checksum recorded for a stored chunk: the one read from the bytes,
/// which a client-declared one must match; the declared one alone where the
/// daemon cannot read the memory; an error when there is neither.
fn chunk_checksum(publication: u64, c: &ChunkSource, read: Option<u32>) -> Result<u32, IoError> {
    let transfer = TransferId::chunk(publication, c.index);
    let refuse = |why: String| IoError::Transfer {
        transfer,
        op: Op::Write,
        offset: 0,
        len: c.len,
        source: std::io::Error::other(why),
    };
    match (read, c.crc32c) {
        (Some(r), Some(d)) if r != d => Err(refuse(format!(
            "the client declared crc32c {d:#010x} but the buffer holds {r:#010x}: the bytes changed under the store or the client checksummed other bytes"
        ))),
        (Some(r), _) => Ok(r),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(refuse(
            "the buffer is memory the daemon cannot read (a DMA-BUF it cannot map) and the client gave no crc32c: send each chunk's crc32c with the store batch".into(),
        )),
    }
}

impl Store {
    /// Step 2: one store batch, as a batch of one of
    /// [`store_batches`](Self::store_batches) (the one path). Batches may run
    /// concurrently and complete out of order. A violation or any failure
    /// rolls back the whole request.
    pub fn store_batch(&self, batch: &StoreBatch) -> Result<BatchOutcome, StoreError> {
        let one = self.store_batches(std::slice::from_ref(batch)).pop();
        one.unwrap_or(Err(StoreError::Invariant(super::Invariant::MissingResult(batch.publication))))
    }

    /// Checks `batch` against its publication; claims its chunk indexes and
    /// counts it in flight. Returns the writes to submit. A protocol
    /// violation rolls the request back; any other refusal changes nothing.
    pub(super) fn validate_batch(&self, batch: &StoreBatch) -> Result<Vec<IoRequest>, StoreError> {
        let id = batch.publication;
        let mut guard = self.lock_live();
        let live = &mut *guard;
        let p = in_phase(&live.state, id, &[Phase::Prepared], "store batches go to PREPARED publications only")?;
        let (total, slots, slot_size) = (p.total_chunks, p.slots.clone(), live.state.slot_size);
        let b = live.batches.entry(id).or_default();
        if !b.seen_first && batch.total_chunks == 0 {
            return Err(StoreError::LegacySender { publication: id });
        }
        if b.published {
            return Err(StoreError::WrongPhase { publication: id, phase: Phase::Ready, what: "it is being published" });
        }
        if let Some(what) = violation(batch, b, total, slot_size) {
            live.violations += 1;
            self.rollback_locked(live, id, format!("protocol violation: {what}"))?;
            return Err(StoreError::ProtocolViolation { publication: id, what });
        }
        let b = live.batches.entry(id).or_default();
        b.seen_first = true;
        b.orphaned = None;
        b.claimed.extend(batch.chunks.iter().map(|c| c.index));
        b.last_claimed |= batch.is_last_batch;
        b.inflight += 1;
        b.touched = Some(Instant::now());
        Ok(batch
            .chunks
            .iter()
            .map(|c| IoRequest {
                transfer: TransferId::chunk(id, c.index),
                op: Op::Write,
                path: self.io.buffer_path(c.buffer).unwrap_or(PayloadPath::HostFixed),
                buffer: c.buffer,
                buffer_offset: c.buffer_offset,
                target_offset: live.state.slot_offset(slots[c.index as usize]),
                len: c.len,
            })
            .collect())
    }

    /// Ends an in-flight batch with what its writes did: journals each
    /// chunk's ALLOC, or rolls the whole request back on any failure (or
    /// finishes an abort that waited for this batch).
    pub(super) fn settle_batch(
        &self,
        batch: &StoreBatch,
        io: Result<PayloadResults, StoreError>,
    ) -> Result<BatchOutcome, StoreError> {
        let id = batch.publication;
        let mut live = self.lock_live();
        if let Some(b) = live.batches.get_mut(&id) {
            assert!(b.inflight > 0, "publication {id}: a batch settled with none in flight");
            b.inflight -= 1;
            b.touched = Some(Instant::now());
        }
        let phase = live.state.pubs.get(&id).map(|p| p.phase);
        if phase.is_none_or(|p| p == Phase::Aborting) {
            if phase == Some(Phase::Aborting) && live.batches.get(&id).is_some_and(|b| b.inflight == 0) {
                self.rollback_locked(&mut live, id, "aborted".into())?;
            }
            return Err(StoreError::AbortedInFlight { publication: id });
        }
        let recorded = match io {
            Ok(results) => self.record_chunks(&mut live, batch, results)?,
            Err(StoreError::Io(e)) => Err(e),
            Err(other) => {
                self.rollback_locked(&mut live, id, format!("store batch failed: {other}"))?;
                return Err(other);
            }
        };
        let crcs = match recorded {
            Ok(crcs) => crcs,
            Err(source) if super::error::reservation_conflict(&source) => {
                let why = format!(
                    "the target refused a store batch of publication {id} as a reservation conflict ({source}): another owner preempted this host's key"
                );
                return Err(self.lose_locked(&mut live, why));
            }
            Err(source) => {
                self.rollback_locked(&mut live, id, format!("store batch failed: {source}"))?;
                return Err(StoreError::BatchFailed { publication: id, source });
            }
        };
        let total = live.state.pubs.get(&id).map_or(0, |p| p.total_chunks);
        let b = live.batches.entry(id).or_default();
        b.completed += batch.chunks.len() as u32;
        b.last_seen |= batch.is_last_batch;
        Ok(BatchOutcome {
            completed: b.completed,
            total,
            publishable: b.completed == total && b.last_seen && b.inflight == 0,
            crcs,
        })
    }

    /// Checks each written chunk's checksum and, if all hold, journals their
    /// ALLOC records and returns the checksums. Returns the first failure
    /// (nothing journaled then).
    fn record_chunks(
        &self,
        live: &mut Live,
        batch: &StoreBatch,
        results: PayloadResults,
    ) -> Result<Result<Vec<u32>, IoError>, StoreError> {
        let id = batch.publication;
        assert_eq!(results.len(), batch.chunks.len(), "publication {id}: one result per chunk written");
        let mut crcs = Vec::with_capacity(batch.chunks.len());
        for (c, r) in batch.chunks.iter().zip(results) {
            match r.and_then(|read| chunk_checksum(id, c, read)) {
                Ok(crc) => crcs.push((c, crc)),
                Err(e) => return Ok(Err(e)),
            }
        }
        let slots = live.state.pubs.get(&id).map(|p| p.slots.clone()).unwrap_or_default();
        for &(c, crc) in &crcs {
            let slot = slots[c.index as usize];
            self.log(live, Record::Alloc { publication: id, chunk: c.index, slot, len: c.len, crc32c: crc })?;
        }
        Ok(Ok(crcs.into_iter().map(|(_, crc)| crc).collect()))
    }

    /// Step 3: READY. Only when every chunk is stored and the last batch was
    /// seen. Returns after the payload and the PUBLISH record are durable.
    pub fn publish(&self, id: u64, first_token: Option<u32>) -> Result<Manifest, StoreError> {
        let manifest = {
            let mut live = self.lock_live();
            let p = in_phase(&live.state, id, &[Phase::Prepared], "only a PREPARED publication can be published")?;
            let b = live.batches.get(&id).ok_or(StoreError::UnknownPublication(id))?;
            if b.completed != p.total_chunks || !b.last_seen || b.inflight > 0 || b.published {
                return Err(StoreError::NotPublishable {
                    publication: id,
                    completed: b.completed,
                    total: p.total_chunks,
                    last: if b.last_seen { "seen" } else { "not seen" },
                    inflight: b.inflight,
                });
            }
            let chunks: Option<Vec<ChunkEntry>> = p.chunks.iter().copied().collect();
            let chunks = chunks.ok_or(Invariant::MissingEntry(id))?;
            let m = Manifest {
                publication: id,
                req_id: p.req_id.clone(),
                layout: p.layout.clone(),
                chunks,
                first_token,
                restore_nonce: None,
            };
            if let Some(b) = live.batches.get_mut(&id) {
                b.published = true;
            }
            self.log(&mut live, Record::Publish { publication: id, manifest: m.clone() })?;
            m
        };
        // The commit flushes the payload before it writes the PUBLISH record.
        self.commit()?;
        Ok(manifest)
    }

    /// Reads chunks of a READY (or later) publication into buffers and checks
    /// each against its recorded checksum. A mismatch is an error, never data.
    /// Returns each chunk's crc32c as read, or `None` where the buffer is
    /// memory this process cannot map (the reader must verify those itself).
    ///
    /// A load of one, through [`load_many`](Self::load_many) (the one path).
    pub fn load(&self, id: u64, dests: &[ChunkDest]) -> Result<Vec<Option<u32>>, StoreError> {
        let one = self.load_many(&[(id, dests)]).pop();
        one.unwrap_or(Err(StoreError::Invariant(super::Invariant::MissingResult(id))))
    }

    /// The first half of a load: the publication's manifest, the count of
    /// loads in flight taken (dropping the guard gives it back), and the
    /// reads to submit.
    pub(super) fn begin_load(
        &self,
        id: u64,
        dests: &[ChunkDest],
    ) -> Result<(Manifest, Loading<'_>, Vec<IoRequest>), StoreError> {
        let manifest = {
            let mut live = self.lock_live();
            let p = live.state.pubs.get(&id).ok_or(StoreError::UnknownPublication(id))?;
            let m = p.manifest.clone().ok_or(StoreError::WrongPhase {
                publication: id,
                phase: p.phase,
                what: "it has no manifest yet (not READY)",
            })?;
            // Counted under the lock that a reclaim takes: a reclaim either
            // removed the publication first (refused above) or waits for this.
            *live.loading.entry(id).or_default() += 1;
            m
        };
        let loading = Loading { store: self, id };
        let mut requests = Vec::with_capacity(dests.len());
        for d in dests {
            let c = manifest.chunks.get(d.index as usize).ok_or(StoreError::NoSuchChunk {
                publication: id,
                chunk: d.index,
                chunks: manifest.chunks.len(),
            })?;
            requests.push(IoRequest {
                transfer: TransferId::chunk(id, d.index),
                op: Op::Read,
                path: self.io.buffer_path(d.buffer).unwrap_or(PayloadPath::HostFixed),
                buffer: d.buffer,
                buffer_offset: d.buffer_offset,
                target_offset: c.offset,
                len: c.len,
            });
        }
        Ok((manifest, loading, requests))
    }
}

/// The second half of a load: each chunk's result checked against the
/// manifest's crc32c.
pub(super) fn finish_load(
    id: u64,
    manifest: &Manifest,
    dests: &[ChunkDest],
    results: PayloadResults,
) -> Result<Vec<Option<u32>>, StoreError> {
    let mut crcs = Vec::with_capacity(dests.len());
    for (d, r) in dests.iter().zip(results) {
        let c = manifest.chunks[d.index as usize];
        let crc = r.map_err(|e| StoreError::Load { publication: id, chunk: d.index, what: e.to_string() })?;
        let Some(crc) = crc else {
            crcs.push(None);
            continue;
        };
        if crc != c.crc32c {
            return Err(StoreError::Load {
                publication: id,
                chunk: d.index,
                what: format!(
                    "checksum mismatch: stored {:#010x}, read {crc:#010x} (read back from the reader's buffer: the media, or something else writing those bytes of the buffer during the load — another load into the same memory, say)",
                    c.crc32c
                ),
            });
        }
        crcs.push(Some(crc));
    }
    Ok(crcs)
}
