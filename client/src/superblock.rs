//! The superblock, the root of the on-media format: the owner's store writes
//! it, and a reader host that reads the namespace itself checks it (the
//! namespace's identity and geometry). 4 KiB written at both ends of the metadata region, each
//! copy checksummed and carrying a generation number. An update writes copy A,
//! flushes, then writes copy B and flushes, so a crash leaves at least one
//! valid copy; open picks the valid copy with the highest generation.
//!
//! Layout of the target:
//!
//! ```text
//! 0            4K               4K+J            4K+2J           4K+2J+4K = data_offset
//! | super A    | journal half 0 | journal half 1 | super B      | slot 0 | slot 1 | …
//! ```

use uuid::Uuid;

use pdstor_engine::io::TargetOffset;

use crate::layout::SlotIndex;

/// The superblock's first eight bytes.
pub const MAGIC: &[u8; 8] = b"PDSTORSB";
/// On-media format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of one superblock copy (one 4 KiB block).
pub const SUPERBLOCK_BYTES: usize = 4096;

/// The superblock's first 160 bytes as they lie on the media, every number
/// little-endian; the rest of the 4 KiB block is zero. Never built: it is the
/// format's one statement of where each field lies. [`Superblock::encode`]
/// and [`Superblock::decode`] take each place from it (`offset_of!`), and the
/// assertions below pin every offset at compile time, so a field moved by
/// accident fails the build instead of every namespace formatted before.
#[repr(C)]
#[allow(dead_code)] // read only by offset_of! and size_of
struct OnMedia {
    magic: [u8; 8],
    version: u32,
    /// CRC-32C of the whole block with this field zero.
    crc: u32,
    generation: u64,
    uuid: [u8; 16],
    epoch: u64,
    block_size: u32,
    _zero0: u32,
    slot_size: u64,
    slot_count: u64,
    data_offset: u64,
    journal_half: u64,
    active_half: u8,
    _zero1: [u8; 7],
    journal_start_seq: u64,
    hmac_key_id: u32,
    _zero2: u32,
    hmac_key: [u8; 32],
    created_unix: u64,
    owner_key: u64,
}

/// Where a field of [`OnMedia`] lies: its byte range in the block.
macro_rules! field {
    ($f:ident) => {{
        const AT: usize = std::mem::offset_of!(OnMedia, $f);
        const fn size<T>(_: fn(&OnMedia) -> &T) -> usize {
            std::mem::size_of::<T>()
        }
        AT..AT + size(|m: &OnMedia| &m.$f)
    }};
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<OnMedia>() == 160 && size_of::<OnMedia>() <= SUPERBLOCK_BYTES);
    assert!(offset_of!(OnMedia, magic) == 0 && offset_of!(OnMedia, version) == 8);
    assert!(offset_of!(OnMedia, crc) == 12 && offset_of!(OnMedia, generation) == 16);
    assert!(offset_of!(OnMedia, uuid) == 24 && offset_of!(OnMedia, epoch) == 40);
    assert!(offset_of!(OnMedia, block_size) == 48 && offset_of!(OnMedia, slot_size) == 56);
    assert!(offset_of!(OnMedia, slot_count) == 64 && offset_of!(OnMedia, data_offset) == 72);
    assert!(offset_of!(OnMedia, journal_half) == 80 && offset_of!(OnMedia, active_half) == 88);
    assert!(offset_of!(OnMedia, journal_start_seq) == 96 && offset_of!(OnMedia, hmac_key_id) == 104);
    assert!(offset_of!(OnMedia, hmac_key) == 112 && offset_of!(OnMedia, created_unix) == 144);
    assert!(offset_of!(OnMedia, owner_key) == 152);
};

/// The namespace's root (DESIGN §3): its geometry, journal, epoch and receipt key. Two copies, A at 0 and B after the journal.
#[derive(Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The on-media format version.
    pub version: u32,
    /// Bumped by every superblock write; the newer valid copy wins.
    pub generation: u64,
    /// The namespace's id (named in every receipt).
    pub uuid: Uuid,
    /// The daemon epoch (bumped at every open).
    pub epoch: u64,
    /// Logical block of the target at format time.
    pub block_size: u32,
    /// Bytes per slot.
    pub slot_size: u64,
    /// Slots in the data area.
    pub slot_count: u64,
    /// Where slot 0 starts.
    pub data_offset: u64,
    /// Bytes of each of the two journal halves.
    pub journal_half: u64,
    /// Which half holds the live journal (0 or 1).
    pub active_half: u8,
    /// Sequence number of the first record in the active half.
    pub journal_start_seq: u64,
    /// Which key signs receipts.
    pub hmac_key_id: u32,
    /// The receipt signing key.
    pub hmac_key: [u8; 32],
    /// When the namespace was formatted (Unix seconds).
    pub created_unix: u64,
    /// The persistent-reservation key of the owner that began this epoch
    /// (`serve --reservation-key`), 0 if it held none: what a standby
    /// preempts to take the namespace over, and what a revived old owner
    /// finds is no longer its own. (Older superblocks have zeros here.)
    pub owner_key: u64,
}

/// Why a superblock copy cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SuperblockError {
    /// The bytes are not a pdstor superblock.
    #[error("no pdstor superblock (magic {found:?}): the target is not formatted; run `pdstor format`")]
    NotPdstor {
        /// The magic found.
        found: String,
    },
    /// The copy's checksum does not match its bytes.
    #[error("superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        /// The stored checksum.
        stored: u32,
        /// The computed one.
        computed: u32,
    },
    /// A newer format than this pdstor reads.
    #[error(
        "superblock format version {found} is newer than this pdstor understands ({FORMAT_VERSION}): upgrade pdstor"
    )]
    NewerVersion {
        /// Its version.
        found: u32,
    },
    /// The fields disagree with each other (sizes, offsets).
    #[error(
        "superblock geometry is inconsistent: active journal half {active_half} (0 or 1), slot size {slot_size}, \
         journal half {journal_half} (neither may be 0), data at {data_offset} (must be at or after {data_floor}, \
         where copy B ends)"
    )]
    Geometry {
        /// Which journal half it says is active.
        active_half: u8,
        /// Bytes per slot.
        slot_size: u64,
        /// Bytes of each journal half.
        journal_half: u64,
        /// Where it says slot 0 starts.
        data_offset: u64,
        /// Where copy B ends, the earliest slot 0 may start.
        data_floor: u64,
    },
}

/// Every field but the receipt key, which no log or error may carry.
impl std::fmt::Debug for Superblock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Superblock")
            .field("version", &self.version)
            .field("generation", &self.generation)
            .field("uuid", &self.uuid)
            .field("epoch", &self.epoch)
            .field("block_size", &self.block_size)
            .field("slot_size", &self.slot_size)
            .field("slot_count", &self.slot_count)
            .field("data_offset", &self.data_offset)
            .field("journal_half", &self.journal_half)
            .field("active_half", &self.active_half)
            .field("journal_start_seq", &self.journal_start_seq)
            .field("hmac_key_id", &self.hmac_key_id)
            .field("created_unix", &self.created_unix)
            .field("owner_key", &format_args!("{:#x}", self.owner_key))
            .finish_non_exhaustive()
    }
}

impl Superblock {
    /// Where journal half `half` (0 or 1) starts.
    pub fn journal_offset(&self, half: u8) -> u64 {
        SUPERBLOCK_BYTES as u64 + half as u64 * self.journal_half
    }
    /// Offset of copy B.
    pub fn copy_b_offset(&self) -> u64 {
        SUPERBLOCK_BYTES as u64 + 2 * self.journal_half
    }
    /// Where on the target slot `slot` begins.
    pub fn slot_offset(&self, slot: SlotIndex) -> TargetOffset {
        TargetOffset(self.data_offset + u64::from(slot.0) * self.slot_size)
    }

    /// The copy as written to the media (checksummed).
    pub fn encode(&self) -> [u8; SUPERBLOCK_BYTES] {
        let mut b = [0u8; SUPERBLOCK_BYTES];
        b[field!(magic)].copy_from_slice(MAGIC);
        b[field!(version)].copy_from_slice(&self.version.to_le_bytes());
        b[field!(generation)].copy_from_slice(&self.generation.to_le_bytes());
        b[field!(uuid)].copy_from_slice(self.uuid.as_bytes());
        b[field!(epoch)].copy_from_slice(&self.epoch.to_le_bytes());
        b[field!(block_size)].copy_from_slice(&self.block_size.to_le_bytes());
        b[field!(slot_size)].copy_from_slice(&self.slot_size.to_le_bytes());
        b[field!(slot_count)].copy_from_slice(&self.slot_count.to_le_bytes());
        b[field!(data_offset)].copy_from_slice(&self.data_offset.to_le_bytes());
        b[field!(journal_half)].copy_from_slice(&self.journal_half.to_le_bytes());
        b[field!(active_half)].copy_from_slice(&[self.active_half]);
        b[field!(journal_start_seq)].copy_from_slice(&self.journal_start_seq.to_le_bytes());
        b[field!(hmac_key_id)].copy_from_slice(&self.hmac_key_id.to_le_bytes());
        b[field!(hmac_key)].copy_from_slice(&self.hmac_key);
        b[field!(created_unix)].copy_from_slice(&self.created_unix.to_le_bytes());
        b[field!(owner_key)].copy_from_slice(&self.owner_key.to_le_bytes());
        // The checksum covers the block with its own field zero.
        let crc = crc32c::crc32c(&b);
        b[field!(crc)].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Reads a copy, checking magic, checksum, version and geometry.
    pub fn decode(b: &[u8]) -> Result<Superblock, SuperblockError> {
        if b.len() < SUPERBLOCK_BYTES || b[field!(magic)] != MAGIC[..] {
            let found = String::from_utf8_lossy(&b[..8.min(b.len())]).escape_debug().to_string();
            return Err(SuperblockError::NotPdstor { found });
        }
        let u32_of = |r: std::ops::Range<usize>| {
            let mut x = [0u8; 4];
            x.copy_from_slice(&b[r]);
            u32::from_le_bytes(x)
        };
        let u64_of = |r: std::ops::Range<usize>| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[r]);
            u64::from_le_bytes(x)
        };
        let stored = u32_of(field!(crc));
        let mut copy = [0u8; SUPERBLOCK_BYTES];
        copy.copy_from_slice(&b[..SUPERBLOCK_BYTES]);
        copy[field!(crc)].fill(0);
        let computed = crc32c::crc32c(&copy);
        if stored != computed {
            return Err(SuperblockError::Checksum { stored, computed });
        }
        let version = u32_of(field!(version));
        if version > FORMAT_VERSION {
            return Err(SuperblockError::NewerVersion { found: version });
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[field!(uuid)]);
        let mut hmac_key = [0u8; 32];
        hmac_key.copy_from_slice(&b[field!(hmac_key)]);
        let sb = Superblock {
            version,
            generation: u64_of(field!(generation)),
            uuid: Uuid::from_bytes(uuid),
            epoch: u64_of(field!(epoch)),
            block_size: u32_of(field!(block_size)),
            slot_size: u64_of(field!(slot_size)),
            slot_count: u64_of(field!(slot_count)),
            data_offset: u64_of(field!(data_offset)),
            journal_half: u64_of(field!(journal_half)),
            active_half: b[field!(active_half).start],
            journal_start_seq: u64_of(field!(journal_start_seq)),
            hmac_key_id: u32_of(field!(hmac_key_id)),
            hmac_key,
            created_unix: u64_of(field!(created_unix)),
            owner_key: u64_of(field!(owner_key)),
        };
        if sb.active_half > 1
            || sb.slot_size == 0
            || sb.journal_half == 0
            || sb.data_offset < sb.copy_b_offset() + SUPERBLOCK_BYTES as u64
        {
            // Never the superblock's Debug: it holds the receipt key.
            return Err(SuperblockError::Geometry {
                active_half: sb.active_half,
                slot_size: sb.slot_size,
                journal_half: sb.journal_half,
                data_offset: sb.data_offset,
                data_floor: sb.copy_b_offset() + SUPERBLOCK_BYTES as u64,
            });
        }
        Ok(sb)
    }
}

/// Picks the copy to trust: the valid one with the highest generation. Returns
/// it and, for the report, why the other was not used.
pub fn choose(
    a: Result<Superblock, SuperblockError>,
    b: Result<Superblock, SuperblockError>,
) -> Result<(Superblock, Option<String>), SuperblockError> {
    match (a, b) {
        (Ok(a), Ok(b)) if b.generation > a.generation => Ok((b, None)),
        (Ok(a), Ok(_)) => Ok((a, None)),
        (Ok(a), Err(e)) => Ok((a, Some(format!("superblock copy B unusable: {e}")))),
        (Err(e), Ok(b)) => Ok((b, Some(format!("superblock copy A unusable: {e}")))),
        (Err(e), Err(_)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> Superblock {
        Superblock {
            version: FORMAT_VERSION,
            generation: 3,
            uuid: Uuid::from_u128(0x1234),
            epoch: 7,
            block_size: 4096,
            slot_size: 1 << 20,
            slot_count: 10,
            data_offset: 4096 * 2 + 2 * 65536,
            journal_half: 65536,
            active_half: 1,
            journal_start_seq: 42,
            hmac_key_id: 1,
            hmac_key: [9; 32],
            created_unix: 1,
            owner_key: 0x5d0e,
        }
    }

    /// The bytes version 1 puts where (written out by hand, apart from the
    /// layout the code takes its places from): the format is unchanged.
    #[test]
    fn every_field_lies_where_version_1_put_it() {
        let sb = sample();
        let b = sb.encode();
        assert_eq!(&b[0..8], MAGIC);
        assert_eq!(b[8..12], 1u32.to_le_bytes());
        assert_eq!(b[16..24], 3u64.to_le_bytes());
        assert_eq!(b[24..40], *Uuid::from_u128(0x1234).as_bytes());
        assert_eq!(b[40..48], 7u64.to_le_bytes());
        assert_eq!(b[48..52], 4096u32.to_le_bytes());
        assert_eq!(b[56..64], (1u64 << 20).to_le_bytes());
        assert_eq!(b[64..72], 10u64.to_le_bytes());
        assert_eq!(b[72..80], sb.data_offset.to_le_bytes());
        assert_eq!(b[80..88], 65536u64.to_le_bytes());
        assert_eq!(b[88], 1);
        assert_eq!(b[96..104], 42u64.to_le_bytes());
        assert_eq!(b[104..108], 1u32.to_le_bytes());
        assert_eq!(b[112..144], [9; 32]);
        assert_eq!(b[144..152], 1u64.to_le_bytes());
        assert_eq!(b[152..160], 0x5d0eu64.to_le_bytes());
        let mut zeroed = b;
        zeroed[12..16].fill(0);
        assert_eq!(b[12..16], crc32c::crc32c(&zeroed).to_le_bytes());
        let padding = [52..56, 89..96, 108..112, 160..SUPERBLOCK_BYTES];
        assert!(padding.into_iter().all(|r| b[r].iter().all(|x| *x == 0)), "padding is zero");
    }

    #[test]
    fn round_trips_and_detects_corruption() {
        let sb = sample();
        let mut b = sb.encode();
        assert_eq!(Superblock::decode(&b).unwrap(), sb);
        b[200] ^= 1;
        assert!(matches!(Superblock::decode(&b), Err(SuperblockError::Checksum { .. })));
        assert!(matches!(Superblock::decode(&[0u8; 4096]), Err(SuperblockError::NotPdstor { .. })));
    }

    /// A superblock written before the owner's key was recorded reads as
    /// "no key": its bytes there were zero.
    #[test]
    fn a_superblock_from_before_owner_keys_names_none() {
        let mut b = sample().encode();
        b[152..160].fill(0);
        b[12..16].fill(0);
        let crc = crc32c::crc32c(&b);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Superblock::decode(&b).unwrap().owner_key, 0);
    }

    #[test]
    fn newer_version_is_refused_by_number() {
        let mut sb = sample();
        sb.version = FORMAT_VERSION + 1;
        let e = Superblock::decode(&sb.encode()).unwrap_err();
        assert!(e.to_string().contains(&format!("version {}", FORMAT_VERSION + 1)), "{e}");
    }

    #[test]
    fn inconsistent_geometry_is_named_field_by_field_and_never_shows_the_key() {
        let mut sb = sample();
        sb.data_offset = 4096; // inside the journal
        let e = Superblock::decode(&sb.encode()).unwrap_err();
        assert!(
            matches!(e, SuperblockError::Geometry { data_offset: 4096, data_floor, .. } if data_floor == 2 * 4096 + 2 * 65536),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.contains("data at 4096 (must be at or after 139264"), "{text}");
        assert!(!text.contains("hmac_key") && !text.contains("9, 9, 9"), "the receipt key leaked: {text}");
        let debug = format!("{sb:?}");
        assert!(debug.contains("data_offset: 4096") && !debug.contains("9, 9, 9"), "the receipt key leaked: {debug}");
    }

    #[test]
    fn the_newest_valid_copy_wins() {
        let a = sample();
        let mut b = sample();
        b.generation = 4;
        assert_eq!(choose(Ok(a.clone()), Ok(b.clone())).unwrap().0.generation, 4);
        let (sb, note) = choose(Ok(a), Err(SuperblockError::Checksum { stored: 1, computed: 2 })).unwrap();
        assert_eq!(sb.generation, 3);
        assert!(note.unwrap().contains("copy B"));
    }
}
