//! The reader's half: every READY receipt claimed and adopted (or, for
//! cache publications, read) in one batch; every adopted item loaded to its
//! place in one `many` frame, each chunk checked against its manifest; what
//! was restored acknowledged (with its load where the daemon checks the
//! chunks, else in one batch after it), what failed once claimed reported
//! failed (RETAINED).

use std::sync::Mutex;

use pdstor_engine::buffer::Piece;

use super::staged::StagedChunk;
use super::{BufferRef, DataPlane, lock};
use crate::layout::{Layout, Manifest};
use crate::read::{End, EndReadRequest, ReadRequest};
use crate::receipt::{Receipt, restore_digest};
use crate::wire::{BatchStep, ClaimRequest, DataChunk, DataResponse, FailRequest};
use crate::{Client, ClientError, LoadChecks, Outcomes, Verify};

/// What a reader asks of every item of a get.
pub struct Getter<'a> {
    /// Who reads.
    pub reader: &'a str,
    /// The reader's session (closing it fences every claim of it).
    pub session: &'a str,
    /// The layout the reader expects; a publication of another is refused.
    pub layout: &'a Layout,
    /// How long each claim holds before another reader may be granted it.
    pub lease_ms: u64,
}

/// Where one item of a get stands.
pub enum Got {
    /// Refused or failed.
    Failed {
        /// Its claim (or read), if it had been claimed.
        claim: Option<Receipt>,
        /// Why.
        error: ClientError,
    },
    /// Claimed and adopted.
    Adopted {
        /// The claim (or read) receipt.
        claim: Receipt,
        /// The manifest it adopted.
        manifest: Manifest,
    },
    /// Every chunk loaded and verified.
    Restored {
        /// The claim (or read) receipt.
        claim: Receipt,
        /// The manifest restored.
        manifest: Manifest,
        /// The restore digest its ack takes.
        digest: String,
    },
    /// Loaded, checked by the daemon and acknowledged with its load.
    Acked {
        /// The manifest restored.
        manifest: Manifest,
    },
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
        && !place.buffer.unchecked
        && place.buffer.inner.dmabuf().is_none()
}

/// Where an adopted item's chunks go: one after another from `offset` of
/// `buffer`; with `into`, on from there into that memory (`(address,
/// length)`, exactly the item's bytes, held by the caller until the restore
/// returns and shared with no other item), each chunk checked in that copy.
pub struct Place {
    /// The buffer the chunks are loaded into.
    pub buffer: BufferRef,
    /// Where in it the item's first chunk goes.
    pub offset: u64,
    /// Memory the chunks are copied on into, checked in that copy.
    pub into: Option<(usize, usize)>,
}

/// The first half of a get of many: every READY receipt claimed and
/// adopted (each naming the layout), in one round trip (`claim` with
/// `adopt`) — each item `Adopted` (its manifest says how many bytes it
/// holds, so the caller can place them) or `Failed` — with its claim
/// where the claim was made and the adopt refused (reported failed later,
/// RETAINED, as any item that fails once claimed).
pub fn adopt_many(control: &Client, who: &Getter<'_>, readies: &[Receipt]) -> Result<Vec<Got>, ClientError> {
    let claims = readies
        .iter()
        .map(|ready| ClaimRequest::new(ready, who.reader, who.session, who.lease_ms, Some(who.layout.clone()), true))
        .collect();
    Ok(control
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
pub fn read_many(control: &Client, who: &Getter<'_>, readies: &[Receipt]) -> Result<Vec<Got>, ClientError> {
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
    Ok(control
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
pub enum Finish {
    /// Claims: acknowledged; one that failed reported failed (RETAINED).
    Ack,
    /// Reads of cache publications: ended done; one that failed abandoned
    /// (the publication stays READY for the next reader).
    EndRead,
    /// Nothing acknowledged or reported: each item restored answers the
    /// digest its ack takes ([`Got::Restored`]), for a reader that acks
    /// when it is done with the bytes.
    Keep,
}

/// The second half: every adopted item loaded to its place in one
/// data-plane frame (each chunk checked against its manifest), what failed
/// after its claim reported failed (RETAINED, its bytes kept), what was
/// restored acknowledged: with its load where the daemon checks the chunks
/// itself (`load` with `ack`, so the frame of loads is the last round trip),
/// else in one batch after it; with [`Finish::Keep`], neither. `places[i]`
/// is where item `i` goes, or why it has nowhere to go (then it fails,
/// RETAINED).
pub fn restore_many(
    control: &Client,
    data: &Mutex<DataPlane>,
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
    load_all(data, (verify, finish), &placed, &mut got)?;

    // What was claimed and then failed is reported failed (RETAINED, its
    // bytes kept for a retry), all in one batch.
    let fails: Vec<BatchStep> = got
        .iter()
        .filter_map(|g| match g {
            Got::Failed { claim: Some(c), error } => match finish {
                Finish::Ack => Some(BatchStep::Fail(FailRequest { receipt: c.clone(), reason: error.to_string() })),
                Finish::EndRead => Some(BatchStep::EndRead(EndReadRequest {
                    receipt: c.clone(),
                    restore_digest: None,
                    reason: Some(error.to_string()),
                })),
                Finish::Keep => None,
            },
            _ => None,
        })
        .collect();
    if !fails.is_empty() {
        control.batch(fails)?;
    }
    // Every restored item acknowledged in one batch (one commit).
    let acks: Vec<(&Receipt, &str)> = got
        .iter()
        .filter_map(|g| match g {
            Got::Restored { claim, digest, .. } => Some((claim, digest.as_str())),
            _ => None,
        })
        .collect();
    let mut acked = match finish {
        _ if acks.is_empty() => Vec::new(),
        Finish::Keep => Vec::new(),
        Finish::Ack => control.ack_many(&acks)?,
        Finish::EndRead => {
            let ends: Vec<(&Receipt, End<'_>)> = acks.iter().map(|(r, d)| (*r, End::Done(d))).collect();
            control.end_read_many(&ends)?
        }
    }
    .into_iter();
    Ok(got
        .into_iter()
        .map(|g| match g {
            Got::Acked { manifest } => Ok(manifest),
            Got::Restored { manifest, .. } if finish == Finish::Keep => Ok(manifest),
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
pub fn load_all(
    data: &Mutex<DataPlane>,
    (verify, finish): (Verify, Finish),
    places: &[Option<Place>],
    got: &mut [Got],
) -> Result<(), ClientError> {
    let mut data = lock(data);
    let mut asked: Vec<(usize, Vec<DataChunk>)> = Vec::new();
    for (i, place) in places.iter().enumerate() {
        let (Got::Adopted { claim, manifest }, Some(place)) = (&got[i], place) else { continue };
        let chunks = chunks_of(&mut data, place, manifest);
        match chunks {
            Ok(chunks) => asked.push((i, chunks)),
            Err(error) => got[i] = Got::Failed { claim: Some(claim.clone()), error },
        }
    }
    if asked.is_empty() {
        return Ok(());
    }
    let ack = |i: usize| places[i].as_ref().is_some_and(|p| acks_with_load(verify, finish, p));
    let loads: Vec<(&Receipt, Vec<DataChunk>, bool)> = asked
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

/// The chunks of an item's load, laid one after another from its place.
fn chunks_of(data: &mut DataPlane, place: &Place, manifest: &Manifest) -> Result<Vec<DataChunk>, ClientError> {
    let mut at = place.offset;
    manifest
        .chunks
        .iter()
        .enumerate()
        .map(|(k, c)| {
            // Entry k is chunk k: the checks after the load find each chunk's entry by its index.
            if c.index as usize != k {
                return Err(ClientError::Verify {
                    chunk: c.index,
                    what: format!("the manifest lists it as entry {k}: a manifest lists chunk k at entry k"),
                });
            }
            place.buffer.inner.check_range(at, c.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
            let chunk =
                DataChunk { index: c.index, buffer: data.id_of(&place.buffer)?, offset: at, len: 0, crc32c: None };
            at += c.len;
            Ok(chunk)
        })
        .collect::<Result<Vec<_>, ClientError>>()
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
