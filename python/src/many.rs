//! Many publications at once, in a constant number of round trips whatever
//! their number: a put of many requests is one `prepare` batch, one
//! data-plane `many` frame of stores and one `publish` batch (one commit); a
//! get of many READY receipts is one `claim` batch, one `adopt` batch, one
//! `many` frame of loads (each chunk checked against its manifest as for
//! one get) and one `ack` batch. Each item answers on its own: one refused
//! or failed item leaves the others alone, and what it had taken is given
//! back in the same few round trips (aborted before READY, `fail`ed —
//! RETAINED — once claimed).

use pdstor_client::layout::{Layout, Manifest};
use pdstor_client::read::{End, EndReadRequest, ReadRequest};
use pdstor_client::receipt::{Receipt as RustReceipt, restore_digest};
use pdstor_client::wire::{
    AbortRequest, BatchStep, ClaimRequest, DataChunk, DataResponse, FailRequest, PrepareRequest, Prepared,
};
use pdstor_client::{ClientError, LoadChecks, Outcomes, StoreItem, Verify};
use pdstor_engine::buffer::Piece;

use super::staged::StagedChunk;
use super::{BufferRef, Conn, lock};

/// One request to put: its id and its chunks, `(buffer, offset, length)`
/// each, chunk 0 first.
pub(crate) struct PutItem {
    pub req_id: String,
    pub chunks: Vec<(BufferRef, u64, u64)>,
}

/// What a reader asks of every item of a get.
pub(crate) struct Getter<'a> {
    pub reader: &'a str,
    pub session: &'a str,
    pub layout: &'a Layout,
    pub lease_ms: u64,
}

/// What a put asks of every item.
pub(crate) struct Asked {
    /// The token a reader continues from.
    pub first_token: Option<u32>,
    /// How long a prepare waits for capacity.
    pub timeout_ms: Option<u64>,
    /// Release each item unread after this long with no reader (cache: no read).
    pub unread_release_ms: Option<u64>,
    /// Cache publications (read by many) instead of handoffs.
    pub cache: bool,
}

/// Puts every item: its READY receipt, or why it is not stored (then
/// nothing of it is left prepared).
pub(crate) fn put_many(
    conn: &Conn,
    writer: &str,
    layout: &Layout,
    items: Vec<PutItem>,
    asked: Asked,
) -> Result<Outcomes<RustReceipt>, ClientError> {
    let Asked { first_token, timeout_ms, unread_release_ms, cache } = asked;
    let asks = items
        .iter()
        .map(|i| PrepareRequest {
            req_id: i.req_id.clone(),
            layout: layout.clone(),
            total_chunks: i.chunks.len() as u32,
            writer: writer.into(),
            timeout_ms,
            unread_release_ms,
            cache,
        })
        .collect();
    let mut outcomes: Vec<Result<Option<Prepared>, ClientError>> =
        conn.control.prepare_many(asks)?.into_iter().map(|r| r.map(Some)).collect();

    let stored = store_prepared(conn, &items, &outcomes)?;
    let mut stored = stored.into_iter();
    let mut give_back = Vec::new();
    for outcome in outcomes.iter_mut() {
        let Ok(Some(p)) = outcome else { continue };
        match stored.next() {
            Some(Ok(s)) if s.publishable == Some(true) => {}
            other => {
                give_back.push(BatchStep::Abort(AbortRequest {
                    publication: p.publication,
                    writer_token: p.writer_token.clone(),
                }));
                *outcome = Err(match other {
                    Some(Err(e)) => e,
                    _ => ClientError::Data(format!("publication {}: stored, but not every chunk", p.publication)),
                });
            }
        }
    }

    // Every stored item published in one batch (one commit).
    let ready: Vec<(&Prepared, Option<u32>)> =
        outcomes.iter().filter_map(|o| o.as_ref().ok().and_then(Option::as_ref)).map(|p| (p, first_token)).collect();
    let mut published = if ready.is_empty() { Vec::new() } else { conn.control.publish_many(&ready)? }.into_iter();
    let mut out = Vec::with_capacity(outcomes.len());
    for outcome in outcomes {
        out.push(match outcome {
            Ok(Some(p)) => match published.next() {
                Some(Ok(r)) => Ok(r.receipt),
                Some(Err(e)) => {
                    give_back.push(BatchStep::Abort(AbortRequest {
                        publication: p.publication,
                        writer_token: p.writer_token,
                    }));
                    Err(e)
                }
                None => Err(ClientError::Data("publish answered no result".into())),
            },
            Ok(None) => Err(ClientError::Data("no publication".into())),
            Err(e) => Err(e),
        });
    }
    if !give_back.is_empty() {
        // Best effort: what a refusal already rolled back answers
        // unknown_publication, and the reaper takes what this misses.
        let _ = conn.control.batch(give_back);
    }
    Ok(out)
}

/// Every prepared item's chunks in one data-plane frame: an answer for each
/// prepared item, in order (an item whose chunks are refused here answers its
/// own error where its store would have).
fn store_prepared(
    conn: &Conn,
    items: &[PutItem],
    outcomes: &[Result<Option<Prepared>, ClientError>],
) -> Result<Vec<Result<DataResponse, ClientError>>, ClientError> {
    let mut data = lock(&conn.data);
    let mut asked = Vec::new();
    let mut refused = Vec::new();
    for (i, (item, outcome)) in items.iter().zip(outcomes).enumerate() {
        let Ok(Some(p)) = outcome else { continue };
        let chunks = item
            .chunks
            .iter()
            .enumerate()
            .map(|(index, (b, offset, len))| {
                b.inner.check_range(*offset, *len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
                let buffer = data.id_of(b)?;
                // The daemon checksums every chunk it stores from memory
                // it maps, a shm file its owner may shrink included (in
                // place, a shrink caught), as each write completes and
                // while the others are in flight: the writer declares none.
                Ok(DataChunk { index: index as u32, buffer, offset: *offset, len: *len, crc32c: None })
            })
            .collect::<Result<Vec<_>, ClientError>>();
        match chunks {
            Ok(chunks) => {
                let total_chunks = chunks.len() as u32;
                asked.push(StoreItem { prepared: p, chunks, is_last_batch: true, total_chunks });
            }
            Err(e) => refused.push((i, e)),
        }
    }
    let answers = if asked.is_empty() { Vec::new() } else { data.with(|d| d.store_many(asked))? };
    // An item refused here answers its own error where its store would have.
    let mut answers = answers.into_iter();
    let mut refused = refused.into_iter().peekable();
    let mut stored = Vec::new();
    for (i, outcome) in outcomes.iter().enumerate() {
        if !matches!(outcome, Ok(Some(_))) {
            continue;
        }
        match refused.next_if(|(at, _)| *at == i) {
            Some((_, e)) => stored.push(Err(e)),
            None => {
                stored.push(answers.next().unwrap_or_else(|| Err(ClientError::Data("store answered no result".into()))))
            }
        }
    }
    Ok(stored)
}

/// Where one item of a get stands.
pub(crate) enum Got {
    /// Refused or failed; `claim` if it had been claimed.
    Failed { claim: Option<RustReceipt>, error: ClientError },
    /// Claimed and adopted: its manifest.
    Adopted { claim: RustReceipt, manifest: Manifest },
    /// Every chunk loaded and verified: the digest its ack takes.
    Restored { claim: RustReceipt, manifest: Manifest, digest: String },
    /// Loaded, checked by the daemon and acknowledged with its load.
    Acked { manifest: Manifest },
}

/// Whether an item's load can acknowledge its claim in the same request
/// (`load` with `ack`): a claim (not a cache read), checked by the daemon
/// (not `Local` or no verification), loaded where the daemon checks it (not
/// a staging buffer, whose chunks this reader checks as it copies them out,
/// nor a DMA-BUF the daemon may be unable to map).
fn acks_with_load(verify: Verify, finish: Finish, place: &Place) -> bool {
    finish == Finish::Ack
        && matches!(verify, Verify::Daemon)
        && place.into.is_none()
        && !place.buffer.staging
        && place.buffer.inner.dmabuf().is_none()
}

/// Where an adopted item's chunks go: one after another from `offset` of
/// `buffer`; with `into`, on from there into that memory (`(address,
/// length)`, exactly the item's bytes, held by the caller until the restore
/// returns and shared with no other item), each chunk checked in that copy.
pub(crate) struct Place {
    pub buffer: BufferRef,
    pub offset: u64,
    pub into: Option<(usize, usize)>,
}

/// The first half of a get of many: every READY receipt claimed and
/// adopted (each naming the layout), in one round trip (`claim` with
/// `adopt`) — each item `Adopted` (its manifest says how many bytes it
/// holds, so the caller can place them) or `Failed` — with its claim
/// where the claim was made and the adopt refused (reported failed later,
/// RETAINED, as any item that fails once claimed).
pub(crate) fn adopt_many(conn: &Conn, who: &Getter<'_>, readies: &[RustReceipt]) -> Result<Vec<Got>, ClientError> {
    let claims = readies
        .iter()
        .map(|ready| ClaimRequest::new(ready, who.reader, who.session, who.lease_ms, Some(who.layout.clone()), true))
        .collect();
    Ok(conn
        .control
        .claim_and_adopt_many(claims)?
        .into_iter()
        .map(|c| match c {
            Ok((claim, Ok(manifest))) => Got::Adopted { claim, manifest },
            Ok((claim, Err(error))) => Got::Failed { claim: Some(claim), error },
            Err(error) => Got::Failed { claim: None, error },
        })
        .collect())
}

/// The first half of a read of many cache publications: every READY
/// receipt read (each naming the layout), in one round trip — each item
/// `Adopted` under its read receipt, or `Failed`.
pub(crate) fn read_many(conn: &Conn, who: &Getter<'_>, readies: &[RustReceipt]) -> Result<Vec<Got>, ClientError> {
    let asks = readies
        .iter()
        .map(|ready| ReadRequest {
            receipt: Some(ready.clone()),
            req_id: None,
            reader_id: who.reader.into(),
            session_id: who.session.into(),
            layout: Some(who.layout.clone()),
        })
        .collect();
    Ok(conn
        .control
        .read_many(asks)?
        .into_iter()
        .map(|a| match a {
            Ok(a) => Got::Adopted { claim: a.receipt, manifest: a.manifest },
            Err(error) => Got::Failed { claim: None, error },
        })
        .collect())
}

/// How the items of a restore end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Claims: acknowledged; one that failed reported failed (RETAINED).
    Ack,
    /// Reads of cache publications: ended done; one that failed abandoned
    /// (the publication stays READY for the next reader).
    EndRead,
}

/// The second half: every adopted item loaded to its place in one
/// data-plane frame (each chunk checked against its manifest), what failed
/// after its claim reported failed (RETAINED, its bytes kept), what was
/// restored acknowledged: with its load where the daemon checks the chunks
/// itself (`load` with `ack`, so the frame of loads is the last round trip),
/// else in one batch after it. `places[i]` is where
/// item `i` goes, or why it has nowhere to go (then it fails, RETAINED).
pub(crate) fn restore_many(
    conn: &Conn,
    verify: Verify,
    places: Vec<Result<Place, ClientError>>,
    mut got: Vec<Got>,
    finish: Finish,
) -> Result<Outcomes<Manifest>, ClientError> {
    let mut placed = Vec::with_capacity(got.len());
    for (g, place) in got.iter_mut().zip(places) {
        match (place, &*g) {
            (Ok(p), _) => placed.push(Some(p)),
            (Err(error), Got::Adopted { claim, .. }) => {
                *g = Got::Failed { claim: Some(claim.clone()), error };
                placed.push(None);
            }
            (Err(_), _) => placed.push(None),
        }
    }
    load_all(conn, (verify, finish), &placed, &mut got)?;

    // What was claimed and then failed is reported failed (RETAINED, its
    // bytes kept for a retry), all in one batch.
    let fails: Vec<BatchStep> = got
        .iter()
        .filter_map(|g| match g {
            Got::Failed { claim: Some(c), error } if finish == Finish::Ack => {
                Some(BatchStep::Fail(FailRequest { receipt: c.clone(), reason: error.to_string() }))
            }
            Got::Failed { claim: Some(c), error } => Some(BatchStep::EndRead(EndReadRequest {
                receipt: c.clone(),
                restore_digest: None,
                reason: Some(error.to_string()),
            })),
            _ => None,
        })
        .collect();
    if !fails.is_empty() {
        conn.control.batch(fails)?;
    }
    // Every restored item acknowledged in one batch (one commit).
    let acks: Vec<(&RustReceipt, &str)> = got
        .iter()
        .filter_map(|g| match g {
            Got::Restored { claim, digest, .. } => Some((claim, digest.as_str())),
            _ => None,
        })
        .collect();
    let mut acked = match finish {
        _ if acks.is_empty() => Vec::new(),
        Finish::Ack => conn.control.ack_many(&acks)?,
        Finish::EndRead => {
            let ends: Vec<(&RustReceipt, End<'_>)> = acks.iter().map(|(r, d)| (*r, End::Done(d))).collect();
            conn.control.end_read_many(&ends)?
        }
    }
    .into_iter();
    Ok(got
        .into_iter()
        .map(|g| match g {
            Got::Acked { manifest } => Ok(manifest),
            Got::Restored { manifest, .. } => match acked.next() {
                Some(Ok(())) => Ok(manifest),
                Some(Err(e)) => Err(e),
                None => Err(ClientError::Data("ack answered no result".into())),
            },
            Got::Failed { error, .. } => Err(error),
            Got::Adopted { .. } => Err(ClientError::Data("adopted but never loaded".into())),
        })
        .collect())
}

/// Loads every adopted item's chunks in one data-plane frame, each checked
/// against its manifest as a single get checks it: an item restored becomes
/// `Restored`, one that failed `Failed`.
fn load_all(
    conn: &Conn,
    (verify, finish): (Verify, Finish),
    places: &[Option<Place>],
    got: &mut [Got],
) -> Result<(), ClientError> {
    let mut data = lock(&conn.data);
    let mut asked: Vec<(usize, Vec<DataChunk>)> = Vec::new();
    for (i, place) in places.iter().enumerate() {
        let (Got::Adopted { claim, manifest }, Some(place)) = (&got[i], place) else { continue };
        let mut at = place.offset;
        let chunks = manifest
            .chunks
            .iter()
            .map(|c| {
                place.buffer.inner.check_range(at, c.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
                let chunk =
                    DataChunk { index: c.index, buffer: data.id_of(&place.buffer)?, offset: at, len: 0, crc32c: None };
                at += c.len;
                Ok(chunk)
            })
            .collect::<Result<Vec<_>, ClientError>>();
        match chunks {
            Ok(chunks) => asked.push((i, chunks)),
            Err(error) => got[i] = Got::Failed { claim: Some(claim.clone()), error },
        }
    }
    if asked.is_empty() {
        return Ok(());
    }
    let ack = |i: usize| places[i].as_ref().is_some_and(|p| acks_with_load(verify, finish, p));
    let loads: Vec<(&RustReceipt, Vec<DataChunk>, bool)> = asked
        .iter()
        .filter_map(|(i, chunks)| match &got[*i] {
            Got::Adopted { claim, .. } => Some((claim, chunks.clone(), ack(*i))),
            _ => None,
        })
        .collect();
    let answers = data.with(|d| d.load_many_acking(loads))?;
    drop(data);
    // Each item's chunks checked against its manifest; where this reader
    // checksums them itself (memory the daemon does not map), on as many
    // threads as the machine has, so a group's loads are not followed by
    // one thread's crc32c of every byte.
    let mut jobs: Vec<(usize, Vec<DataChunk>, DataResponse)> = Vec::with_capacity(asked.len());
    let mut refused: Vec<(usize, Result<Vec<u32>, ClientError>)> = Vec::new();
    for ((i, chunks), answer) in asked.into_iter().zip(answers) {
        match answer {
            Ok(a) => jobs.push((i, chunks, a)),
            Err(error) => refused.push((i, Err(error))),
        }
    }
    let check = |(i, chunks, answer): &(usize, Vec<DataChunk>, DataResponse)| {
        let (Some(place), Got::Adopted { manifest, .. }) = (&places[*i], &got[*i]) else {
            return Err(ClientError::Data("an item loaded was not adopted".into()));
        };
        if let Some(into) = place.into {
            return copy_out(place, into, chunks, manifest);
        }
        let requested: Vec<u32> = chunks.iter().map(|c| c.index).collect();
        let checks = LoadChecks::new(verify, &requested, answer);
        chunks
            .iter()
            .map(|c| {
                let entry = manifest.chunks[c.index as usize];
                checks.check(c.index, &place.buffer.inner, c.offset, entry.len, entry.crc32c)
            })
            .collect::<Result<Vec<u32>, ClientError>>()
    };
    // Threads pay off only for bytes this reader checksums itself.
    let local_bytes: u64 = jobs
        .iter()
        .map(|(i, chunks, a)| match &got[*i] {
            Got::Adopted { manifest, .. } => chunks
                .iter()
                .filter(|c| {
                    matches!(verify, Verify::Local)
                        || a.unverified.contains(&c.index)
                        || places[*i].as_ref().is_some_and(|p| p.into.is_some())
                })
                .map(|c| manifest.chunks.get(c.index as usize).map_or(0, |e| e.len))
                .sum(),
            _ => 0,
        })
        .sum();
    let checked = in_parallel(&jobs, &check, local_bytes >= PARALLEL_CHECK_BYTES);
    let outcomes: Vec<Outcome> = jobs
        .into_iter()
        .map(|(i, _, a)| (i, a.acked))
        .zip(checked)
        .chain(refused.into_iter().map(|(i, r)| ((i, false), r)))
        .collect();
    settle(got, outcomes);
    Ok(())
}

/// An item's load: its index, whether the daemon acknowledged it with the
/// load, and its chunks' crc32c as checked (or why not).
type Outcome = ((usize, bool), Result<Vec<u32>, ClientError>);

/// Each loaded item `Acked`, `Restored` (with the digest its ack takes) or `Failed`.
fn settle(got: &mut [Got], outcomes: Vec<Outcome>) {
    for ((i, acked), checked) in outcomes {
        let Got::Adopted { claim, manifest } =
            std::mem::replace(&mut got[i], Got::Failed { claim: None, error: ClientError::Data("replaced".into()) })
        else {
            continue;
        };
        got[i] = match checked {
            Ok(_) if acked => Got::Acked { manifest },
            Ok(crcs) => {
                let digest = restore_digest(manifest.restore_nonce.as_deref().unwrap_or_default(), &crcs);
                Got::Restored { claim, manifest, digest }
            }
            Err(error) => Got::Failed { claim: Some(claim), error },
        };
    }
}

/// Copies an item's chunks on from where they were loaded into `into`, each
/// checked against its manifest entry in that one pass; their crc32c.
fn copy_out(
    place: &Place,
    into: (usize, usize),
    chunks: &[DataChunk],
    manifest: &Manifest,
) -> Result<Vec<u32>, ClientError> {
    let (base, len) = into;
    // `chunks` were laid out one per manifest entry, in the manifest's order.
    chunks
        .iter()
        .zip(&manifest.chunks)
        .map(|(c, entry)| {
            let at = (c.offset - place.offset) as usize;
            if c.index != entry.index || at.checked_add(entry.len as usize).is_none_or(|end| end > len) {
                return Err(ClientError::Data(format!(
                    "chunk {} ({} bytes at {at}) does not fit into's {len} bytes as the manifest lays it out",
                    c.index, entry.len
                )));
            }
            // SAFETY: `base..base + len` is a writable buffer the caller
            // holds until the restore returns and that no other item's
            // destination or any source buffer overlaps (`staged::disjoint`);
            // this item's chunks are copied by this one call, at disjoint
            // offsets within it (laid one after another), and `at + entry.len`
            // lies within it (checked above).
            let dst = unsafe { std::slice::from_raw_parts_mut((base + at) as *mut u8, entry.len as usize) };
            let chunk =
                StagedChunk { buffer: place.buffer.clone(), offset: c.offset, len: entry.len, want: entry.crc32c };
            chunk.copy_out(c.index, &mut [Piece { at: 0, dst }])
        })
        .collect()
}

/// A group's bytes to checksum here from which its checks are spread over
/// threads (below it, a thread costs more than it saves).
const PARALLEL_CHECK_BYTES: u64 = 8 << 20;

/// `f` of each item, in order: on this thread unless `parallel`, else split
/// in contiguous parts over the machine's threads (at most 8).
fn in_parallel<T: Sync, R: Send>(items: &[T], f: &(impl Fn(&T) -> R + Sync), parallel: bool) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if !parallel || threads < 2 || items.len() < 2 {
        return items.iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> =
            items.chunks(per).map(|part| s.spawn(move || part.iter().map(f).collect::<Vec<R>>())).collect();
        parts.into_iter().flat_map(|p| p.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    })
}
