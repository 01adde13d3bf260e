//! The writer's half: every item prepared in one batch, its chunks stored
//! in `many` frames (one per round of store batches, every item's batch of
//! the round in the same frame), every item stored published in one batch.

use std::sync::Mutex;

use super::{BufferRef, DataPlane, lock};
use crate::layout::Layout;
use crate::wire::{AbortRequest, BatchStep, DataChunk, DataResponse, PrepareRequest, Prepared, Published};
use crate::{Client, ClientError, Outcomes, StoreItem};

/// One request to put: its id and its chunks, `(buffer, offset, length)`
/// each, chunk 0 first.
pub struct PutItem {
    /// The request id the publication is prepared under.
    pub req_id: String,
    /// Where each chunk's bytes are.
    pub chunks: Vec<(BufferRef, u64, u64)>,
}

/// What a put asks of every item.
#[derive(Debug, Clone, Default)]
pub struct Asked {
    /// The writer recorded with each publication.
    pub writer: String,
    /// The token a reader continues from.
    pub first_token: Option<u32>,
    /// How long a prepare waits for capacity.
    pub timeout_ms: Option<u64>,
    /// Release each item unread after this long with no reader (cache: no read).
    pub unread_release_ms: Option<u64>,
    /// Cache publications (read by many) instead of handoffs.
    pub cache: bool,
    /// At most this many chunks of an item in one store request (an item of
    /// more is stored in several, over as many frames); `None`: all of them.
    pub batch: Option<usize>,
}

/// Puts every item: each answers its READY publication, or why it is not
/// stored (then nothing of it is left prepared). The outer error is a
/// round trip that failed as a whole.
pub fn put_many(
    control: &Client,
    data: &Mutex<DataPlane>,
    layout: &Layout,
    items: Vec<PutItem>,
    asked: &Asked,
) -> Result<Outcomes<Published>, ClientError> {
    let asks = items
        .iter()
        .map(|i| PrepareRequest {
            req_id: i.req_id.clone(),
            layout: layout.clone(),
            total_chunks: i.chunks.len() as u32,
            writer: asked.writer.clone(),
            timeout_ms: asked.timeout_ms,
            unread_release_ms: asked.unread_release_ms,
            cache: asked.cache,
        })
        .collect();
    let mut outcomes: Outcomes<Prepared> = control.prepare_many(asks)?;
    let mut give_back = Vec::new();
    let batch = asked.batch.unwrap_or(usize::MAX).max(1);
    let rounds = items.iter().map(|i| i.chunks.len().div_ceil(batch).max(1)).max().unwrap_or(0);
    for round in 0..rounds {
        let stored = store_round(data, &items, &outcomes, round, batch)?;
        for (i, answer) in stored {
            let Ok(p) = &outcomes[i] else { continue };
            let last = (round + 1) * batch >= items[i].chunks.len();
            let failed = match answer {
                Ok(s) if !last || s.publishable == Some(true) => continue,
                Ok(_) => ClientError::Data(format!("publication {}: stored, but not every chunk", p.publication)),
                Err(e) => e,
            };
            give_back.push(abort(p));
            outcomes[i] = Err(failed);
        }
    }

    // Every stored item published in one batch (one commit).
    let ready: Vec<(&Prepared, Option<u32>)> =
        outcomes.iter().filter_map(|o| o.as_ref().ok()).map(|p| (p, asked.first_token)).collect();
    let mut published = if ready.is_empty() { Vec::new() } else { control.publish_many(&ready)? }.into_iter();
    let mut out = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        out.push(match outcome {
            Ok(p) => match published.next() {
                Some(Ok(r)) => Ok(r),
                Some(Err(e)) => {
                    give_back.push(abort(&p));
                    Err(e)
                }
                None => Err(ClientError::Data("publish answered no result".into())),
            },
            Err(e) => Err(e),
        });
    }
    if !give_back.is_empty() {
        // Best effort: what a refusal already rolled back answers
        // unknown_publication, and the reaper takes what this misses.
        let _ = control.batch(give_back);
    }
    Ok(out)
}

fn abort(p: &Prepared) -> BatchStep {
    BatchStep::Abort(AbortRequest { publication: p.publication, writer_token: p.writer_token.clone() })
}

/// A store request's answer, or why the item was not asked.
pub type Stored = Result<DataResponse, ClientError>;

/// One store request of a prepared publication: its chunks, `(index,
/// buffer, offset, length)` each.
pub struct Storing<'a> {
    /// The publication, as prepared (its writer's token goes with the request).
    pub prepared: &'a Prepared,
    /// The chunks and where their bytes are.
    pub chunks: Vec<(u32, &'a BufferRef, u64, u64)>,
    /// The writer sends no store of this publication after this one.
    pub last: bool,
    /// The publication's total, as prepared.
    pub total: u32,
}

/// Stores every item in one data-plane frame, whatever the publications:
/// a put's round, a serving engine's step (several requests' chunks), or
/// one store of one publication (a batch of one). Answers each item's
/// store, in order; an item whose chunks are refused here (a range outside
/// its buffer) answers its own error without being sent, and its
/// publication is left as it was. The outer error is a frame that failed as
/// a whole.
pub fn store_each(data: &Mutex<DataPlane>, items: &[Storing<'_>]) -> Result<Vec<Stored>, ClientError> {
    let mut data = lock(data);
    let mut asked = Vec::new();
    let mut answers: Vec<Option<Stored>> = Vec::with_capacity(items.len());
    for item in items {
        let chunks = item
            .chunks
            .iter()
            .map(|&(index, b, offset, len)| {
                b.inner.check_range(offset, len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
                // The daemon checksums every chunk it stores from memory
                // it maps, a shm file its owner may shrink included (in
                // place, a shrink caught), as each write completes and
                // while the others are in flight: the writer declares none.
                Ok(DataChunk { index, buffer: data.id_of(b)?, offset, len, crc32c: None })
            })
            .collect::<Result<Vec<_>, ClientError>>();
        match chunks {
            Ok(chunks) => {
                let (prepared, is_last_batch, total_chunks) = (item.prepared, item.last, item.total);
                asked.push(StoreItem { prepared, chunks, is_last_batch, total_chunks });
                answers.push(None);
            }
            Err(e) => answers.push(Some(Err(e))),
        }
    }
    let mut stored = if asked.is_empty() { Vec::new() } else { data.with(|d| d.store_many(asked))? }.into_iter();
    Ok(answers
        .into_iter()
        .map(|refused| {
            refused.unwrap_or_else(|| {
                stored.next().unwrap_or_else(|| Err(ClientError::Data("store answered no result".into())))
            })
        })
        .collect())
}

/// Round `round` of the stores: batch `round` of every item prepared and
/// not failed that has one, in one data-plane frame ([`store_each`]).
/// Answers `(item, its store's answer)`.
fn store_round(
    data: &Mutex<DataPlane>,
    items: &[PutItem],
    outcomes: &Outcomes<Prepared>,
    round: usize,
    batch: usize,
) -> Result<Vec<(usize, Stored)>, ClientError> {
    let mut which = Vec::new();
    let mut asked = Vec::new();
    for (i, (item, outcome)) in items.iter().zip(outcomes).enumerate() {
        let Ok(prepared) = outcome else { continue };
        let n = item.chunks.len();
        let start = round.saturating_mul(batch);
        if start >= n && !(round == 0 && n == 0) {
            continue;
        }
        let end = start.saturating_add(batch).min(n);
        let chunks = (start..end).map(|k| (k as u32, &item.chunks[k].0, item.chunks[k].1, item.chunks[k].2)).collect();
        asked.push(Storing { prepared, chunks, last: end == n, total: n as u32 });
        which.push(i);
    }
    Ok(which.into_iter().zip(store_each(data, &asked)?).collect())
}
