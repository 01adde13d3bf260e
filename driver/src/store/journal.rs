//! Journal records: append-only, sequence-numbered, each with a crc32c. A
//! record is durable only after the device flush that follows it.
//!
//! Frame: `magic u32 | crc32c u32 | seq u64 | kind u8 | 0 u8 x3 | len u32 |
//! payload (JSON, len bytes)`, then padding to 8 bytes. The crc covers
//! everything after itself, payload included. Replay stops at the first frame
//! that is not a valid next record (zeros: the clean end; anything else is
//! reported with its offset).

use serde::{Deserialize, Serialize};

use super::publication::{Owner, Publication};
use pdstor_client::layout::Layout;
use pdstor_client::layout::Manifest;
use pdstor_client::layout::SlotIndex;

/// The first word of every record frame ("PJDR").
pub const RECORD_MAGIC: u32 = 0x5244_4a50; // "PJDR"
/// Bytes of a frame's header: magic, checksum, sequence number, kind, length.
pub const HEADER_BYTES: usize = std::mem::size_of::<FrameHeader>();

/// A frame's header as it lies on the media, every number little-endian.
/// Never built: it is the format's one statement of where each field lies;
/// [`encode`] and [`replay`] take each place from it, and the assertions
/// below pin every offset at compile time.
#[repr(C)]
#[allow(dead_code)] // read only by offset_of! and size_of
struct FrameHeader {
    magic: u32,
    /// CRC-32C of everything after this field: the rest of the header and the payload.
    crc: u32,
    seq: u64,
    kind: u8,
    _zero: [u8; 3],
    /// Bytes of the JSON payload that follows (then zeros to 8 bytes).
    len: u32,
}

const MAGIC_AT: usize = std::mem::offset_of!(FrameHeader, magic);
const CRC_AT: usize = std::mem::offset_of!(FrameHeader, crc);
const SEQ_AT: usize = std::mem::offset_of!(FrameHeader, seq);
const KIND_AT: usize = std::mem::offset_of!(FrameHeader, kind);
const LEN_AT: usize = std::mem::offset_of!(FrameHeader, len);
const _: () = {
    assert!(HEADER_BYTES == 24);
    assert!(MAGIC_AT == 0 && CRC_AT == 4 && SEQ_AT == 8 && KIND_AT == 16 && LEN_AT == 20);
};

/// One journal record (DESIGN §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Record {
    /// A request admitted: its reserved slots, in chunk order.
    Prepare {
        /// The publication it creates.
        publication: u64,
        /// The serving engine's request id.
        req_id: String,
        /// The writer's identity.
        writer: String,
        /// The KV layout the reader must match.
        layout: Layout,
        /// Chunks declared.
        total_chunks: u32,
        /// The slots reserved, chunk `i` in `slots[i]`.
        slots: Vec<SlotIndex>,
        /// The identity that prepared it (absent in journals older than identities).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        owner: Option<Owner>,
        /// Its own unread window in ms, where its writer asked for one
        /// (absent in older journals and where it did not).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unread_release_ms: Option<u64>,
        /// A cache publication: read by many, never claimed (absent: a
        /// handoff, as in every journal older than cache publications).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cache: bool,
    },
    /// A chunk stored in its slot, with the checksum of the bytes written.
    Alloc {
        /// The publication.
        publication: u64,
        /// The chunk's index.
        chunk: u32,
        /// The slot it was written to.
        slot: SlotIndex,
        /// Its length in bytes.
        len: u64,
        /// crc32c of the bytes written.
        crc32c: u32,
    },
    /// READY: the manifest. Written only after the payload is flushed.
    Publish {
        /// The publication.
        publication: u64,
        /// What the reader will be offered.
        manifest: Manifest,
    },
    /// CLAIMED: one reader and session bound to a READY publication.
    Claim {
        /// The publication.
        publication: u64,
        /// The reader.
        reader: String,
        /// The reader's session.
        session: String,
        /// The claim's lease, in ms.
        lease_ms: u64,
        /// The daemon epoch the claim was made in.
        epoch: u64,
        /// When it was claimed, by the protocol's clock.
        claimed_unix_ms: u64,
        /// The identity that claimed it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        claimant: Option<Owner>,
    },
    /// ADOPTED: the claimed reader confirmed what it reads.
    Adopt {
        /// The publication.
        publication: u64,
        /// The reader reads the shared namespace itself (another host's
        /// view of it): a daemon restart does not fence it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        direct: bool,
        /// The direct reader's host's reservation key, if it registered one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reservation_key: Option<u64>,
    },
    /// Acknowledged: the slots free.
    Ack {
        /// The publication.
        publication: u64,
        /// The reader's restore digest.
        restore_digest: String,
    },
    /// Released unread: the slots free.
    Release {
        /// The publication.
        publication: u64,
    },
    /// Rolled back before READY: the slots free.
    Abort {
        /// The publication.
        publication: u64,
        /// Why (the writer's abort, a violation, recovery).
        reason: String,
    },
    /// RETAINED: a failed or uncertain claimed read; bytes and slots kept.
    Retain {
        /// The publication.
        publication: u64,
        /// The reader's reason.
        reason: String,
    },
    /// Reclaimed from a fenced reader: the slots free.
    Reclaim {
        /// The publication.
        publication: u64,
    },
    /// A new daemon epoch began (every earlier claim is fenced).
    Epoch {
        /// The epoch.
        epoch: u64,
    },
    /// The whole live state, first record of a freshly compacted journal half.
    Checkpoint {
        /// The next publication number.
        next_publication: u64,
        /// Every live publication.
        publications: Vec<Publication>,
    },
}

impl Record {
    /// The kind's byte in the frame header.
    pub fn kind_byte(&self) -> u8 {
        match self {
            Record::Prepare { .. } => 1,
            Record::Alloc { .. } => 2,
            Record::Publish { .. } => 3,
            Record::Claim { .. } => 4,
            Record::Adopt { .. } => 5,
            Record::Ack { .. } => 6,
            Record::Release { .. } => 7,
            Record::Abort { .. } => 8,
            Record::Retain { .. } => 9,
            Record::Reclaim { .. } => 10,
            Record::Epoch { .. } => 11,
            Record::Checkpoint { .. } => 12,
        }
    }
}

/// A record that cannot be framed.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// serde could not encode it.
    #[error("encoding journal record {seq}: {source}")]
    Json {
        /// The record's sequence number.
        seq: u64,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
    /// Its encoding is over the frame's 4 GiB length field.
    #[error("journal record {seq} is {bytes} bytes: over the 4 GiB a frame can hold")]
    TooLong {
        /// The record's sequence number.
        seq: u64,
        /// Its encoded size.
        bytes: usize,
    },
}

/// Encodes one record as a frame.
pub fn encode(seq: u64, record: &Record) -> Result<Vec<u8>, EncodeError> {
    let payload = serde_json::to_vec(record).map_err(|source| EncodeError::Json { seq, source })?;
    let len = u32::try_from(payload.len()).map_err(|_| EncodeError::TooLong { seq, bytes: payload.len() })?;
    let mut f = vec![0u8; HEADER_BYTES];
    f[MAGIC_AT..MAGIC_AT + 4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    f[SEQ_AT..SEQ_AT + 8].copy_from_slice(&seq.to_le_bytes());
    f[KIND_AT] = record.kind_byte();
    f[LEN_AT..LEN_AT + 4].copy_from_slice(&len.to_le_bytes());
    f.extend_from_slice(&payload);
    while !f.len().is_multiple_of(8) {
        f.push(0);
    }
    let crc = crc32c::crc32c(&f[CRC_AT + 4..HEADER_BYTES + payload.len()]);
    f[CRC_AT..CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
    Ok(f)
}

/// Where and why replay stopped before the end of the written journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stop {
    /// Byte offset of the record where replay stopped.
    pub offset: u64,
    /// The sequence number expected there.
    pub seq: u64,
    /// Why it stopped (torn, bad checksum, out of sequence).
    pub reason: String,
}

/// Decodes consecutive records from `bytes` (a journal half), expecting the
/// first to have `start_seq`. Returns the records, the byte offset just past
/// the last good one, and why it stopped if not at a clean (zeroed) end.
pub fn replay(bytes: &[u8], start_seq: u64) -> (Vec<(u64, Record)>, usize, Option<Stop>) {
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut seq = start_seq;
    let stop = |at: usize, seq: u64, reason: String| Some(Stop { offset: at as u64, seq, reason });
    loop {
        if at + HEADER_BYTES > bytes.len() {
            return (out, at, None);
        }
        let h = &bytes[at..at + HEADER_BYTES];
        let u32_at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let magic = u32_at(MAGIC_AT);
        if magic == 0 && h.iter().all(|b| *b == 0) {
            return (out, at, None);
        }
        if magic != RECORD_MAGIC {
            return (out, at, stop(at, seq, format!("no record header (magic {magic:#010x})")));
        }
        let mut s8 = [0u8; 8];
        s8.copy_from_slice(&h[SEQ_AT..SEQ_AT + 8]);
        let rec_seq = u64::from_le_bytes(s8);
        let len = u32_at(LEN_AT) as usize;
        let end = at + HEADER_BYTES + len;
        if end > bytes.len() {
            return (out, at, stop(at, seq, format!("record of {len} bytes runs past the journal (torn write)")));
        }
        let crc = crc32c::crc32c(&bytes[at + CRC_AT + 4..end]);
        if crc != u32_at(CRC_AT) {
            return (
                out,
                at,
                stop(at, seq, format!("checksum mismatch (stored {:#010x}, computed {crc:#010x})", u32_at(CRC_AT))),
            );
        }
        if rec_seq < start_seq {
            // A record from an earlier pass over this half (every one of
            // those precedes the checkpoint this pass starts with): the clean end.
            return (out, at, None);
        }
        if rec_seq < seq {
            // A sequence number this pass already used: two records were given
            // one number. Not a clean end: say so, loudly.
            return (
                out,
                at,
                stop(
                    at,
                    seq,
                    format!("sequence {rec_seq} repeats (expected {seq}): two records share a sequence number"),
                ),
            );
        }
        if rec_seq != seq {
            return (out, at, stop(at, seq, format!("sequence {rec_seq} where {seq} was expected (records missing)")));
        }
        let record: Record = match serde_json::from_slice(&bytes[at + HEADER_BYTES..end]) {
            Ok(r) => r,
            Err(e) => return (out, at, stop(at, seq, format!("undecodable payload: {e}"))),
        };
        if record.kind_byte() != h[KIND_AT] {
            return (out, at, stop(at, seq, format!("kind byte {} disagrees with the payload", h[KIND_AT])));
        }
        out.push((seq, record));
        seq += 1;
        at = (end + 7) & !7;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame's bytes where the format has always put them (written out by
    /// hand, apart from the layout the code takes its places from).
    #[test]
    fn a_frame_lies_where_the_format_puts_it() {
        let record = Record::Epoch { epoch: 9 };
        let f = encode(0x0102_0304_0506_0708, &record).expect("an epoch record encodes");
        let payload = serde_json::to_vec(&record).expect("an epoch record is JSON");
        assert_eq!(f[0..4], 0x5244_4a50u32.to_le_bytes());
        assert_eq!(f[8..16], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(f[16], record.kind_byte());
        assert_eq!(f[17..20], [0, 0, 0]);
        assert_eq!(f[20..24], (payload.len() as u32).to_le_bytes());
        assert_eq!(f[24..24 + payload.len()], payload[..]);
        assert_eq!(f.len() % 8, 0);
        assert_eq!(f[4..8], crc32c::crc32c(&f[8..24 + payload.len()]).to_le_bytes());
    }

    fn epoch(e: u64) -> Record {
        Record::Epoch { epoch: e }
    }

    fn journal(records: &[Record], start: u64) -> Vec<u8> {
        let mut j = Vec::new();
        for (i, r) in records.iter().enumerate() {
            j.extend(encode(start + i as u64, r).unwrap());
        }
        j.resize(j.len() + 4096, 0);
        j
    }

    #[test]
    fn records_replay_in_order_to_a_clean_end() {
        let j = journal(&[epoch(1), epoch(2), Record::Release { publication: 9 }], 10);
        let (recs, end, stop) = replay(&j, 10);
        assert_eq!(recs.iter().map(|r| r.0).collect::<Vec<_>>(), vec![10, 11, 12]);
        assert_eq!(recs[2].1, Record::Release { publication: 9 });
        assert_eq!(stop, None);
        assert!(end > 0 && end % 8 == 0);
    }

    #[test]
    fn a_torn_tail_is_discarded_and_located() {
        let mut j = journal(&[epoch(1), epoch(2)], 0);
        let second = encode(0, &epoch(1)).unwrap().len();
        j[second + HEADER_BYTES + 3] ^= 0xff; // damage the second record's payload
        let (recs, end, stop) = replay(&j, 0);
        assert_eq!(recs.len(), 1);
        assert_eq!(end, second);
        let stop = stop.unwrap();
        assert_eq!((stop.offset, stop.seq), (second as u64, 1));
        assert!(stop.reason.contains("checksum"));
    }

    #[test]
    fn a_bad_checksum_mid_stream_stops_at_the_last_good_record() {
        let mut j = journal(&[epoch(1), epoch(2), epoch(3), epoch(4)], 0);
        let one = encode(0, &epoch(1)).unwrap().len();
        j[one + 5] ^= 1; // the stored crc of record 2
        let (recs, _, stop) = replay(&j, 0);
        assert_eq!(recs.len(), 1, "records after the bad one are not trusted");
        assert_eq!(stop.unwrap().seq, 1);
    }

    #[test]
    fn stale_records_from_an_older_pass_end_the_journal_cleanly() {
        let mut j = journal(&[epoch(1)], 9);
        let stale = journal(&[epoch(2)], 5);
        let first = encode(9, &epoch(1)).unwrap().len();
        j[first..first + stale.len() - 4096].copy_from_slice(&stale[..stale.len() - 4096]);
        let (recs, end, stop) = replay(&j, 9);
        assert_eq!((recs.len(), end, stop), (1, first, None));
        let (recs, _, stop) = replay(&journal(&[epoch(1)], 12), 9);
        assert!(recs.is_empty());
        assert!(stop.unwrap().reason.contains("records missing"));
    }

    /// A checkpoint followed by a record with the checkpoint's own sequence
    /// number (two records given one number) is not a clean end.
    #[test]
    fn a_repeated_sequence_number_is_reported_not_taken_for_the_end() {
        let mut j = Vec::new();
        j.extend(encode(9653, &epoch(1)).expect("encoding a record"));
        let second = j.len();
        j.extend(encode(9653, &epoch(2)).expect("encoding a record"));
        j.extend(encode(9654, &epoch(3)).expect("encoding a record"));
        j.resize(j.len() + 4096, 0);
        let (recs, end, stop) = replay(&j, 9653);
        assert_eq!((recs.len(), end), (1, second));
        let stop = stop.expect("a repeated sequence number stops replay with a reason");
        assert_eq!(stop.offset, second as u64);
        assert!(stop.reason.contains("sequence 9653 repeats"), "{}", stop.reason);
    }
}
