//! Formatting a target: the journal halves and both superblock copies of a
//! fresh namespace, after refusing anything recognisable it would overwrite.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::StoreError;
use super::backing::Backing;
use super::device::{Device, read_to_vec_by, write_from_slice};
use super::error::WorkerError;
use super::memory::Memory;
use super::superblock::{self, FORMAT_VERSION, SUPERBLOCK_BYTES, Superblock};
use pdstor_engine::io::{IoError, Target, TargetOptions};

/// Journal half sizes `format` accepts (powers of two, so a reader that lost
/// superblock copy A can still find copy B).
pub const JOURNAL_HALF_CHOICES: [u64; 13] = [
    1 << 18,
    1 << 19,
    1 << 20,
    1 << 21,
    1 << 22,
    1 << 23,
    1 << 24,
    1 << 25,
    1 << 26,
    1 << 27,
    1 << 28,
    1 << 29,
    1 << 30,
];

/// How to format a target.
#[derive(Debug, Clone)]
pub struct FormatOptions {
    /// Bytes per slot: the largest chunk. Multiple of 4 KiB.
    pub slot_size: u64,
    /// Bytes of each journal half (a power of two from 256 KiB to 1 GiB).
    pub journal_half: u64,
    /// Overwrite a target that holds a filesystem or another namespace.
    pub force: bool,
    /// For a file target that does not exist yet: create it this large.
    pub create_len: Option<u64>,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions { slot_size: 8 << 20, journal_half: 16 << 20, force: false, create_len: None }
    }
}

/// What `format` wrote.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FormatReport {
    /// The target formatted.
    pub target: PathBuf,
    /// The new namespace's id.
    pub uuid: String,
    /// Bytes per slot.
    pub slot_size: u64,
    /// Slots in the data area.
    pub slot_count: u64,
    /// Where slot 0 starts.
    pub data_offset: u64,
    /// Bytes of each journal half.
    pub journal_half: u64,
    /// What the target held before, if `--force` overwrote something.
    pub overwrote: Option<String>,
}

/// Recognisable signatures at the start of a target.
fn signature(head: &[u8]) -> Option<String> {
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    if at(0, superblock::MAGIC) {
        return Some("a pdstor namespace".into());
    }
    if at(0, b"XFSB") {
        return Some("an XFS filesystem".into());
    }
    if at(1080, &[0x53, 0xef]) {
        return Some("an ext2/3/4 filesystem".into());
    }
    if at(0x10040, b"_BHRfS_M") {
        return Some("a btrfs filesystem".into());
    }
    if at(4086, b"SWAPSPACE2") {
        return Some("a swap area".into());
    }
    if at(512, b"LABELONE") || at(536, b"LVM2") {
        return Some("an LVM physical volume".into());
    }
    if at(512, b"EFI PART") {
        return Some("a GPT partition table".into());
    }
    None
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Writes a fresh namespace: empty journal halves, then both superblock
/// copies. A file it created for the purpose (`create_len`) is removed if
/// formatting fails — a full disk, say — so no partial target is left.
pub fn format(path: &Path, opts: &FormatOptions) -> Result<FormatReport, StoreError> {
    let existed = std::fs::symlink_metadata(path).is_ok();
    let formatted = format_in_place(path, opts);
    if formatted.is_err() && !existed && opts.create_len.is_some() {
        match std::fs::remove_file(path) {
            Ok(()) => tracing::info!(target = %path.display(), "removed the partial target the failed format made"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(target = %path.display(), error = %e, "could not remove the partial target the failed format made")
            }
        }
    }
    formatted
}

fn format_in_place(path: &Path, opts: &FormatOptions) -> Result<FormatReport, StoreError> {
    check(opts)?;
    let target = Target::open(path, &TargetOptions { create_len: opts.create_len, allocate: true, read_only: false })?;
    let mut device = Backing::Target(target).open(8, 4)?;
    write_namespace(&mut *device, path, opts)
}

/// Formats `memory` as [`format()`] formats a target (`create_len` has no
/// use: the memory's size is the device's), for a store opened with
/// [`Store::open_memory`](super::Store::open_memory).
pub fn format_memory(memory: &Memory, opts: &FormatOptions) -> Result<FormatReport, StoreError> {
    check(opts)?;
    let mut device = Backing::Memory(memory.clone()).open(8, 4)?;
    write_namespace(&mut *device, Path::new(super::MEMORY), opts)
}

/// The options' own refusals, before anything is opened.
fn check(opts: &FormatOptions) -> Result<(), StoreError> {
    if opts.slot_size == 0 || !opts.slot_size.is_multiple_of(4096) {
        return Err(StoreError::SlotSize { slot_size: opts.slot_size });
    }
    if !JOURNAL_HALF_CHOICES.contains(&opts.journal_half) {
        return Err(StoreError::JournalHalf { journal_half: opts.journal_half });
    }
    Ok(())
}

/// The journal halves and both superblock copies of a fresh namespace on
/// `device` (`path` names it), unless it holds something recognisable and
/// `force` is not set.
fn write_namespace(device: &mut dyn Device, path: &Path, opts: &FormatOptions) -> Result<FormatReport, StoreError> {
    let capacity = device.capacity();
    let block_size = device.block_size();
    let data_offset = 2 * SUPERBLOCK_BYTES as u64 + 2 * opts.journal_half;
    let minimum = data_offset + opts.slot_size;
    if capacity < minimum {
        return Err(StoreError::TooSmall { path: path.into(), capacity, minimum });
    }
    let head = read_to_vec_by(device, 0, (68 << 10).min(capacity), |d, r| super::device::execute_all(d, &[r]))?;
    let found = signature(&head);
    if let Some(sig) = &found
        && !opts.force
    {
        return Err(StoreError::ForeignSignature { path: path.into(), signature: sig.clone() });
    }
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(WorkerError::Random)?;
    let sb = Superblock {
        version: FORMAT_VERSION,
        generation: 1,
        uuid: uuid::Uuid::new_v4(),
        epoch: 0,
        block_size,
        slot_size: opts.slot_size,
        slot_count: (capacity - data_offset) / opts.slot_size,
        data_offset,
        journal_half: opts.journal_half,
        active_half: 0,
        journal_start_seq: 1,
        hmac_key_id: 1,
        hmac_key: key,
        created_unix: now_unix(),
        owner_key: 0,
    };
    // Old superblocks go first, so a crash mid-format leaves no stale namespace.
    write_from_slice(device, 0, &[0u8; SUPERBLOCK_BYTES])?;
    let zeros = vec![0u8; (1 << 20).min(opts.journal_half) as usize];
    for half in 0..2u8 {
        let mut off = 0;
        while off < opts.journal_half {
            write_from_slice(device, sb.journal_offset(half) + off, &zeros)?;
            off += zeros.len() as u64;
        }
    }
    device.flush()?;
    write_from_slice(device, sb.copy_b_offset(), &sb.encode())?;
    device.flush()?;
    write_from_slice(device, 0, &sb.encode())?;
    device.flush()?;
    Ok(FormatReport {
        target: path.into(),
        uuid: sb.uuid.to_string(),
        slot_size: sb.slot_size,
        slot_count: sb.slot_count,
        data_offset,
        journal_half: sb.journal_half,
        overwrote: found,
    })
}

/// What recognisable signature (filesystem, pdstor namespace, partition
/// table, …) the start of `path` holds, if any. Used to refuse destructive
/// commands on a target that holds something.
pub fn signature_of(path: &Path) -> Result<Option<String>, StoreError> {
    use std::io::Read;
    let mut head = Vec::with_capacity(68 << 10);
    std::fs::File::open(path)
        .and_then(|f| f.take(68 << 10).read_to_end(&mut head))
        .map_err(|source| StoreError::Io(IoError::Open { path: path.into(), source }))?;
    Ok(signature(&head))
}
