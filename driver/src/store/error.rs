//! The store's errors, one enum per concern, each variant naming the
//! operation that failed and carrying its source: [`StoreError`] is what the
//! store's callers see; [`WorkerError`] is the I/O thread's (journal,
//! superblock, flush); [`StateError`] is a record that does not fit the
//! state; [`Invariant`] is a broken allocator or reservation invariant.

use std::path::PathBuf;
use std::sync::Arc;

use crate::admission::AdmitError;
use pdstor_engine::buffer::BufferError;
use pdstor_engine::io::IoError;

use super::publication::Phase;
use super::superblock::SuperblockError;
use pdstor_client::layout::SlotIndex;

/// What a store operation refused or failed on.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The engine refused or failed an I/O.
    #[error(transparent)]
    Io(#[from] IoError),
    /// `format` found something it would overwrite.
    #[error("target {path} holds {signature}: refusing to format it; pass --force to overwrite")]
    ForeignSignature {
        /// The target.
        path: PathBuf,
        /// What it holds ("an XFS filesystem", …).
        signature: String,
    },
    /// The target cannot hold a namespace with these options.
    #[error("target {path} is {capacity} bytes; a pdstor namespace with these options needs at least {minimum}")]
    TooSmall {
        /// The target.
        path: PathBuf,
        /// Its capacity in bytes.
        capacity: u64,
        /// The bytes a namespace with these options needs.
        minimum: u64,
    },
    /// A slot size that is not a positive multiple of 4 KiB.
    #[error("bad format option: slot size {slot_size} must be a positive multiple of 4096")]
    SlotSize {
        /// The slot size asked for.
        slot_size: u64,
    },
    /// A journal half size pdstor does not offer.
    #[error("bad format option: journal half {journal_half} must be a power of two from 256 KiB to 1 GiB")]
    JournalHalf {
        /// The journal half size asked for.
        journal_half: u64,
    },
    /// Neither superblock copy is usable.
    #[error("target {path}: {source}")]
    Superblock {
        /// The target.
        path: PathBuf,
        /// Why no copy could be used.
        #[source]
        source: SuperblockError,
    },
    /// A replayed record does not fit the state rebuilt so far.
    #[error("recovering target {path}: record {seq}: {source}")]
    Replay {
        /// The target.
        path: PathBuf,
        /// The record's sequence number.
        seq: u64,
        /// Why it does not fit.
        #[source]
        source: StateError,
    },
    /// The state recovery rebuilt breaks an invariant.
    #[error("recovering target {path}: {source}")]
    Recovered {
        /// The target.
        path: PathBuf,
        /// The invariant broken.
        #[source]
        source: Invariant,
    },
    /// A record the store itself built does not fit its state: a bug, refused
    /// before it reached the journal.
    #[error("target {path}: {source}")]
    Apply {
        /// The target.
        path: PathBuf,
        /// Why the record does not fit.
        #[source]
        source: StateError,
    },
    /// The I/O thread failed an operation.
    #[error("store I/O thread: {0}")]
    Worker(#[from] WorkerError),
    /// A commit failed earlier: memory is ahead of the media.
    #[error("the store failed earlier ({0}) and refuses further changes: restart it to recover from the journal")]
    Failed(Arc<WorkerError>),
    /// Admission refused or gave up.
    #[error(transparent)]
    Admission(#[from] AdmitError),
    /// The request id already has a live publication.
    #[error("request {req}: already has live publication {publication}")]
    DuplicateRequest {
        /// The request id.
        req: String,
        /// Its live publication.
        publication: u64,
    },
    /// No live publication has this id.
    #[error("publication {0} is not live (unknown, or already finished)")]
    UnknownPublication(u64),
    /// The publication is in a phase this step does not apply to.
    #[error("publication {publication} is {phase:?}; {what}")]
    WrongPhase {
        /// The publication.
        publication: u64,
        /// Its phase.
        phase: Phase,
        /// What the step needs.
        what: &'static str,
    },
    /// The first batch does not declare its total.
    #[error(
        "publication {publication}: the first store batch declares total_chunks 0; legacy senders are not supported"
    )]
    LegacySender {
        /// The publication.
        publication: u64,
    },
    /// A batch broke the protocol; the request was rolled back.
    #[error(
        "publication {publication}: protocol violation, {what}; every chunk of the request was rolled back and its reservation released"
    )]
    ProtocolViolation {
        /// The publication.
        publication: u64,
        /// The violation.
        what: String,
    },
    /// A batch failed on the device; the request was rolled back.
    #[error(
        "publication {publication}: a store batch failed ({source}); every chunk of the request was rolled back and its reservation released"
    )]
    BatchFailed {
        /// The publication.
        publication: u64,
        /// The first failure.
        #[source]
        source: IoError,
    },
    /// The publication was aborted while this batch was in flight.
    #[error("publication {publication} was aborted while this batch was in flight")]
    AbortedInFlight {
        /// The publication.
        publication: u64,
    },
    /// Not every chunk is stored, or the last batch was not seen.
    #[error(
        "publication {publication} is not ready to publish: {completed} of {total} chunks stored, last batch {last}, {inflight} batches in flight"
    )]
    NotPublishable {
        /// The publication.
        publication: u64,
        /// Chunks stored.
        completed: u32,
        /// Chunks declared.
        total: u32,
        /// Whether the last batch was seen ("seen" / "not seen").
        last: &'static str,
        /// Batches still in flight.
        inflight: u32,
    },
    /// A chunk could not be loaded, or its bytes did not match.
    #[error("publication {publication}, chunk {chunk}: {what}")]
    Load {
        /// The publication.
        publication: u64,
        /// The chunk.
        chunk: u32,
        /// What went wrong.
        what: String,
    },
    /// A record would take more than a quarter of a journal half.
    #[error(
        "a journal record of {bytes} bytes is larger than a quarter of the {journal_half}-byte journal half: shorten the request's strings"
    )]
    RecordTooLarge {
        /// The record's encoded size.
        bytes: u64,
        /// The journal half's size.
        journal_half: u64,
    },
    /// A record could not be encoded.
    #[error(transparent)]
    Encode(#[from] super::journal::EncodeError),
    /// The manifest has no such chunk.
    #[error("publication {publication} has no chunk {chunk}: its manifest has {chunks} chunks (0..{chunks})")]
    NoSuchChunk {
        /// The publication.
        publication: u64,
        /// The chunk asked for.
        chunk: u32,
        /// Chunks in the manifest.
        chunks: usize,
    },
    /// More chunks than a transfer id can number.
    #[error("{chunks} chunks is more than one request can have ({max}): use larger chunks")]
    TooManyChunks {
        /// Chunks asked for.
        chunks: u32,
        /// The most a request can have.
        max: u32,
    },
    /// The receipt key cannot be rotated while receipts signed with it hold slots.
    #[error(
        "{live} publications are live: rotating the receipt key would void their receipts while they hold slots; ack, release, reclaim or cancel them first"
    )]
    KeyInUse {
        /// Live publications.
        live: usize,
    },
    /// A load of the publication is still in flight: its slots cannot be freed yet.
    #[error(
        "publication {publication}: a load is still in flight after {waited_ms} ms; its slots are not freed under a reader: retry"
    )]
    LoadInFlight {
        /// The publication.
        publication: u64,
        /// How long the free waited.
        waited_ms: u64,
    },
    /// Readers hold read leases on the cache publication: it cannot be released yet.
    #[error(
        "publication {publication}: {reads} read(s) of it are in progress; a cache publication is released only when no reader holds it: retry when they end"
    )]
    BeingRead {
        /// The publication.
        publication: u64,
        /// Read leases held on it (and loads in flight).
        reads: u32,
    },
    /// A step of one publication class asked of the other.
    #[error("publication {publication} is a {class} publication; {what}")]
    WrongClass {
        /// The publication.
        publication: u64,
        /// Its class: `cache` or `handoff`.
        class: &'static str,
        /// What the step needs.
        what: &'static str,
    },
    /// The namespace numbered every publication a transfer id can name.
    #[error(
        "this namespace has numbered {next} publications, the most whose chunks have transfer ids: format a new one"
    )]
    PublicationsExhausted {
        /// The next publication number.
        next: u64,
    },
    /// An invariant the store keeps broke: a bug, reported instead of acted on.
    #[error("store invariant broken: {0}")]
    Invariant(#[from] Invariant),
}

/// What the I/O thread failed to do.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The namespace is no longer this owner's: another owner preempted its
    /// reservation key ([`Store::lose`](super::Store::lose)).
    #[error("the namespace was taken over: {why}")]
    NamespaceLost {
        /// Who took it and how it was seen.
        why: String,
    },
    /// The engine could not be set up, or a setup read failed.
    #[error(transparent)]
    Engine(#[from] IoError),
    /// A staging buffer could not be made or accessed.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Reading the active journal half failed.
    #[error("reading the journal: {source}")]
    ReadJournal {
        /// The engine's error.
        #[source]
        source: IoError,
    },
    /// Writing the journal tail failed.
    #[error("writing the journal: {source}")]
    WriteJournal {
        /// Where on the target.
        offset: u64,
        /// The engine's error.
        #[source]
        source: IoError,
    },
    /// Writing a checkpoint into the other half failed.
    #[error("writing the checkpoint: {source}")]
    WriteCheckpoint {
        /// Where on the target.
        offset: u64,
        /// The engine's error.
        #[source]
        source: IoError,
    },
    /// Writing a superblock copy failed.
    #[error("writing the superblock at {offset}: {source}")]
    WriteSuperblock {
        /// Where on the target.
        offset: u64,
        /// The engine's error.
        #[source]
        source: IoError,
    },
    /// A device flush failed.
    #[error("flush: {source}")]
    Flush {
        /// The engine's error.
        #[source]
        source: IoError,
    },
    /// The fault plan killed the device.
    #[error("device failed (fault injection)")]
    DeviceDead,
    /// The fault plan fenced this host, as a takeover's preempt does.
    #[error("reservation conflict: the target refused the flush (fault injection: this host's key was preempted)")]
    Fenced,
    /// The active journal half cannot take what was appended.
    #[error("the journal half ({half} bytes) is full: format with a larger --journal")]
    JournalFull {
        /// The half's size.
        half: u64,
    },
    /// A checkpoint does not fit a journal half.
    #[error("a checkpoint of {bytes} bytes does not fit the {half}-byte journal half: format with a larger --journal")]
    CheckpointTooLarge {
        /// The checkpoint's size.
        bytes: u64,
        /// The half's size.
        half: u64,
    },
    /// The I/O thread could not be started.
    #[error("spawning the I/O thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The I/O thread stopped while a request was outstanding.
    #[error("the I/O thread is gone")]
    Gone,
    /// The I/O thread stopped before it finished opening the target.
    #[error("the I/O thread exited during open")]
    ExitedDuringOpen,
    /// No randomness for a new namespace key.
    #[error("getrandom: {0}")]
    Random(getrandom::Error),
}

impl WorkerError {
    /// Whether the target refused this host as a reservation conflict
    /// (`EBADE`, the block layer's `BLK_STS_RESV_CONFLICT`): its key is no
    /// longer registered — another owner preempted it — so the namespace is
    /// no longer this owner's.
    pub fn is_reservation_conflict(&self) -> bool {
        if matches!(self, WorkerError::Fenced | WorkerError::NamespaceLost { .. }) {
            return true;
        }
        reservation_conflict(self)
    }
}

/// Whether `e`, or an error under it, is the block layer's reservation
/// conflict (`EBADE`): the target refused this host, whose key is not (or
/// no longer) registered.
pub(crate) fn reservation_conflict(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>().and_then(std::io::Error::raw_os_error) == Some(libc::EBADE) {
            return true;
        }
        next = e.source();
    }
    false
}

/// A journal record that does not fit the state it is applied to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A slot the record takes is already owned.
    #[error("slot {slot} is already owned by publication {owner}")]
    SlotOwned {
        /// The slot.
        slot: SlotIndex,
        /// Its owner.
        owner: u64,
    },
    /// A slot the record takes is beyond the namespace.
    #[error("slot {0} does not exist")]
    NoSuchSlot(SlotIndex),
    /// The record names a publication that is not live.
    #[error("publication {0} is not live")]
    NotLive(u64),
    /// A second PREPARE of the same publication.
    #[error("publication {0} prepared twice")]
    PreparedTwice(u64),
    /// A PREPARE whose slots do not match its chunks.
    #[error("{slots} slots for {chunks} chunks")]
    SlotCount {
        /// Slots listed.
        slots: usize,
        /// Chunks declared.
        chunks: u32,
    },
    /// An ALLOC for a publication that is not PREPARED.
    #[error("chunk stored into publication {publication} in phase {phase:?}")]
    StoredOutOfPhase {
        /// The publication.
        publication: u64,
        /// Its phase.
        phase: Phase,
    },
    /// An ALLOC naming a slot that is not the chunk's.
    #[error("chunk {chunk} of publication {publication} does not belong in slot {slot}")]
    WrongSlot {
        /// The publication.
        publication: u64,
        /// The chunk.
        chunk: u32,
        /// The slot named.
        slot: SlotIndex,
    },
    /// A transition record for a publication in the wrong phase.
    #[error("publication {publication} {what} in phase {phase:?}")]
    Transition {
        /// The publication.
        publication: u64,
        /// The transition ("published", "claimed", …).
        what: &'static str,
        /// Its phase.
        phase: Phase,
    },
}

/// A broken invariant of the allocator, the reservations, or their agreement.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invariant {
    /// A read of a publication ended that no one had begun.
    #[error("publication {publication}: a read ended that was never begun (or ended twice)")]
    ReadNotHeld {
        /// The publication.
        publication: u64,
    },
    /// A publication's slots, chunks and total disagree.
    #[error("publication {publication} has {slots} slots for {chunks} chunks")]
    SlotCount {
        /// The publication.
        publication: u64,
        /// Its slots.
        slots: usize,
        /// Its declared chunks.
        chunks: u32,
    },
    /// Two publications list the same slot.
    #[error("slot {slot} owned by publications {first} and {second}")]
    OwnedTwice {
        /// The slot.
        slot: SlotIndex,
        /// One owner.
        first: u64,
        /// The other.
        second: u64,
    },
    /// A publication lists a slot the owner table gives to no one or another.
    #[error("slot {slot} of publication {publication} is not marked as its own")]
    NotMarked {
        /// The slot.
        slot: SlotIndex,
        /// The publication.
        publication: u64,
    },
    /// A stored chunk sits outside its reserved slot.
    #[error("chunk {chunk} of publication {publication} is in slot {actual} not {reserved}")]
    ChunkMisplaced {
        /// The chunk.
        chunk: usize,
        /// The publication.
        publication: u64,
        /// Where it is.
        actual: SlotIndex,
        /// Where it belongs.
        reserved: SlotIndex,
    },
    /// The owner table names a publication that does not list the slot.
    #[error("slot {slot} marked for publication {publication}, which does not list it")]
    Unlisted {
        /// The slot.
        slot: SlotIndex,
        /// The publication named.
        publication: u64,
    },
    /// A slot is neither owned nor free.
    #[error("slot {0} is neither owned nor free")]
    Lost(SlotIndex),
    /// A slot is both owned and free.
    #[error("slot {0} is both owned and free")]
    OwnedAndFree(SlotIndex),
    /// The reservation manager's own invariants.
    #[error("{0}")]
    Admission(crate::admission::AdmissionInvariant),
    /// A live publication's request holds another number of reservations.
    #[error("request {req} holds {held} reservations for {slots} slots")]
    Reservations {
        /// The request.
        req: String,
        /// Reservations held.
        held: u64,
        /// Slots owned.
        slots: usize,
    },
    /// More slots reserved for prepares in flight than are free.
    #[error("{in_transit} slots reserved in transit but only {free} free")]
    InTransit {
        /// Reserved by requests with no publication yet.
        in_transit: u64,
        /// Free slots.
        free: u64,
    },
    /// With no prepare in flight, reservations differ from owned slots.
    #[error("publications own {owned} slots but {reserved} are reserved")]
    Unbalanced {
        /// Slots owned.
        owned: u64,
        /// Slots reserved.
        reserved: u64,
    },
    /// The allocator's and admission's counts of where the slots are disagree.
    #[error(
        "slots do not reconcile: {capacity} in all, the allocator has {allocator_free} free and publications own {used}, admission reserves {reserved}"
    )]
    Unreconciled {
        /// Slots in all.
        capacity: u64,
        /// Slots the allocator has free.
        allocator_free: u64,
        /// Slots owned by publications.
        used: u64,
        /// Slots admission reserves.
        reserved: u64,
    },
    /// Admission granted slots the allocator does not have.
    #[error("admission granted {granted} slots but the allocator has {free}")]
    AllocatorShort {
        /// Slots granted.
        granted: u32,
        /// Slots free.
        free: u64,
    },
    /// A publication counts every chunk stored but lacks an entry.
    #[error("publication {0} counts all chunks but lacks an entry")]
    MissingEntry(u64),
    /// The I/O of many publications run together answered none for this one.
    #[error("the I/O submitted together for many publications answered none for publication {0}")]
    MissingResult(u64),
}
