//! The crash-safe on-media store (DESIGN §3) and the admission control that
//! guards it (§5): superblock, journal, slot allocator, recovery, and the
//! prepare → store batches → publish path with full rollback on any failure.
//!
//! Every state change is a journal record applied to [`state::State`] under
//! one lock and handed, in that order, to the I/O thread (`worker`). Records
//! become durable at the next commit. A READY publication is acknowledged only
//! after its payload was flushed, then its PUBLISH record written and flushed.
//!
//! Where each part lives: `format` (a fresh namespace), `recovery` (replay
//! and the new epoch), `batch` (store batches, publish, load: validate →
//! submit → settle), `transitions` (release, claim, adopt, ack, fail,
//! reclaim), `read` (the read leases of cache publications), `scope` (one commit for a batch of them), `state` and
//! `journal` (the records and what they describe),
//! `io_thread` (the one door to the I/O thread), `worker` (that thread),
//! `fault` (fault injection), `error` (every error, typed).
//!
//! This module does not sign receipts, read the clock, or enforce who may
//! claim: that is the protocol's job (`protocol/`), built on the records
//! defined here. It imports `io`, `buffer` and `admission`, never a layer
//! above it.

mod admit;
mod backing;
mod batch;
mod coalesce;
mod device;
mod error;
mod evict;
mod fault;
mod format;
mod io_thread;
pub mod journal;
mod many;
mod memory;
mod presence;
mod publication;
mod read;
mod recovery;
mod scope;
pub mod state;
use pdstor_client::layout::SlotIndex;
use pdstor_client::superblock::{self, Superblock};
mod stats;
mod storage;
mod transitions;
mod verifier;
mod worker;
#[cfg(test)]
mod worker_tests;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::admission::{MonotonicClock, ReservationManager, WaitClock};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{BufferId, DmabufRw, PayloadPath, Target, TargetKind, TargetOptions, TransferId};

pub use admit::{Accounting, Ask, Prepared, Reaped};
pub use batch::{BatchOutcome, ChunkDest, ChunkSource, StoreBatch};
pub use error::{Invariant, StateError, StoreError, WorkerError};
pub use evict::Evicted;
pub use fault::{FaultPlan, PowerLoss};
pub use format::{FormatOptions, FormatReport, JOURNAL_HALF_CHOICES, format, format_memory, signature_of};
use journal::Record;
pub use memory::Memory;
pub use publication::{ClaimInfo, Owner, Phase, Publication};
pub use recovery::{Inspection, inspect};
pub use stats::StoreStats;
pub use worker::CommitInfo;

use backing::Backing;
use batch::Batches;
use io_thread::IoThread;

/// The name a store on [`Memory`] goes by where a target's path would be.
const MEMORY: &str = "(memory)";

/// The live publication `id`, if it is in one of `allowed` phases; otherwise
/// the refusal that names its phase and `what` would have been allowed.
fn in_phase<'a>(
    state: &'a state::State,
    id: u64,
    allowed: &[Phase],
    what: &'static str,
) -> Result<&'a Publication, StoreError> {
    let p = state.pubs.get(&id).ok_or(StoreError::UnknownPublication(id))?;
    if !allowed.contains(&p.phase) {
        return Err(StoreError::WrongPhase { publication: id, phase: p.phase, what });
    }
    Ok(p)
}

/// [`StoreOptions::merge_bytes`]'s default: 16 KiB per-layer chunks go 64 to
/// a command, 512 KiB ones two, 8 MiB ones alone.
pub const DEFAULT_MERGE_BYTES: u64 = 1 << 20;

/// How to run a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Payload requests the I/O thread keeps in flight.
    pub queue_depth: u32,
    /// Chunks smaller than this that lie back to back on the target and in
    /// one buffer go to the device as one command of up to this many bytes,
    /// each still checksummed and answered on its own; 0 sends every chunk
    /// alone (each command then carries its chunk's transfer id, which the
    /// provenance probes' per-chunk verdicts need).
    pub merge_bytes: u64,
    /// Threads that checksum payloads beside the I/O thread (0: one per CPU
    /// this process may run on); a large chunk is spread over all of them.
    pub verify_threads: usize,
    /// The longest `prepare` waits for capacity.
    pub admission_timeout: Duration,
    /// Crash-consistency testing: the device dies after this many writes.
    pub fault: Option<Arc<FaultPlan>>,
    /// The time admission waits are measured in (the simulation moves its own).
    pub wait_clock: Arc<dyn WaitClock>,
    /// The reservation key this owner holds the namespace with (0: none),
    /// recorded in the superblock as the new epoch begins.
    pub owner_key: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            queue_depth: 32,
            merge_bytes: DEFAULT_MERGE_BYTES,
            verify_threads: 0,
            admission_timeout: Duration::from_secs(30),
            fault: None,
            wait_clock: Arc::new(MonotonicClock::default()),
            owner_key: 0,
        }
    }
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecoveryReport {
    /// The epoch this open started.
    pub epoch: u64,
    /// Journal records applied.
    pub records_replayed: usize,
    /// Publications rolled back because they were never published.
    pub rolled_back: Vec<u64>,
    /// Publications that survived (READY or later).
    pub live: usize,
    /// Where the journal stopped early, and why (torn tail, bad checksum).
    pub journal_stop: Option<String>,
    /// Why one superblock copy was passed over, if one was.
    pub superblock_note: Option<String>,
}

struct Live {
    state: state::State,
    /// The sequence number of the next record. Assigned, and the record
    /// queued, under this lock: no two records ever share one.
    next_seq: u64,
    /// Bytes of the active journal half the queued records take (the I/O
    /// thread's append offset, mirrored here so that every record kind is
    /// accounted for when it is queued, committed or not).
    journal_end: u64,
    /// The size of a journal half (fixed at format).
    journal_half: u64,
    /// Slots a RELEASE, ACK or RECLAIM freed whose record is not durable yet:
    /// no prepare may take them until it is, or a crash could bring the
    /// freed publication back over another request's bytes.
    quarantine: BTreeSet<SlotIndex>,
    batches: HashMap<u64, Batches>,
    failed: Option<Arc<WorkerError>>,
    /// Loads in flight, by publication: a reclaim or ack waits for them
    /// before it frees the slots (a fenced reader's last read must not
    /// land in bytes already given to another request).
    loading: HashMap<u64, u32>,
    /// Read leases held, by cache publication (`read.rs`): none is released
    /// while any is held. In memory: a restart ends every read.
    reading: HashMap<u64, u32>,
    /// Store batches that broke the protocol, since open.
    violations: u64,
    /// PREPARED publications rolled back, since open.
    rollbacks: u64,
    /// Unread READY publications evicted under capacity pressure, since open.
    evicted: u64,
    /// READY, unclaimed publications: when the daemon's policy first saw
    /// each so (`Store::release_unread_after`).
    unread_since: HashMap<u64, std::time::Instant>,
    /// Unread READY publications released by that policy, since open.
    expired: u64,
}

/// What `abort` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// Rolled back now; this many slots were freed.
    /// Rolled back now.
    Aborted {
        /// Slots freed.
        slots: u32,
    },
    /// Batches are in flight; the slots free when they finish.
    Pending,
    /// Nothing to abort: unknown or already finished.
    NotFound,
}

/// A formatted target, open: the journal, the state it rebuilt, admission,
/// and the I/O thread that moves payload and journal bytes.
pub struct Store {
    path: PathBuf,
    live: Mutex<Live>,
    admission: ReservationManager,
    io: IoThread,
    sb: Mutex<Superblock>,
    opts: StoreOptions,
    last_commit: Mutex<CommitInfo>,
    /// Signalled when a load ends (see `Live::loading`).
    loads_done: std::sync::Condvar,
    /// The target as opened: still at its path?
    presence: presence::Presence,
    /// Whether a publication with its own unread window was prepared since open, or recovered:
    /// until one is, the unread window has nothing to look at without the daemon's.
    windowed: std::sync::atomic::AtomicBool,
}

impl Store {
    /// Opens a formatted target: replays the journal, rolls back PREPARED
    /// publications, keeps READY/CLAIMED/ADOPTED/RETAINED ones with their
    /// slots, bumps and persists the epoch.
    pub fn open(path: &Path, opts: StoreOptions) -> Result<(Store, RecoveryReport), StoreError> {
        let target = Target::open(path, &TargetOptions { create_len: None, allocate: true, read_only: false })?;
        let presence = presence::Presence::at(path, target.write_cache_probe());
        Self::open_on(path, Backing::Target(target), presence, opts)
    }

    /// [`open`](Self::open) on `memory` ([`format_memory`]): no io_uring, no
    /// file. Its every read and write goes through the same seam, so a
    /// [`FaultPlan::simulated_in`] the memory fails, tears and loses them as
    /// it would a target's; the simulation runs on it.
    pub fn open_memory(memory: &Memory, opts: StoreOptions) -> Result<(Store, RecoveryReport), StoreError> {
        Self::open_on(Path::new(MEMORY), Backing::Memory(memory.clone()), presence::Presence::nowhere(), opts)
    }

    fn open_on(
        path: &Path,
        backing: Backing,
        presence: presence::Presence,
        opts: StoreOptions,
    ) -> Result<(Store, RecoveryReport), StoreError> {
        // The device itself, or the faulty one the simulation and crash tests give.
        let storage: Arc<dyn storage::Storage> = match opts.fault.clone() {
            Some(plan) => plan,
            None => Arc::new(storage::Media),
        };
        let (io, opened) =
            IoThread::start(path, backing, opts.queue_depth, opts.merge_bytes, opts.verify_threads, storage)?;
        let replayed = recovery::replay(path, &opened)?;
        io.resume(replayed.journal_end)?;
        let sb = opened.superblock;
        let windowed = replayed.state.pubs.values().any(|p| p.unread_release_ms.is_some());
        let store = Store {
            path: path.into(),
            live: Mutex::new(Live {
                state: replayed.state,
                next_seq: replayed.next_seq,
                journal_end: replayed.journal_end,
                journal_half: sb.journal_half,
                quarantine: BTreeSet::new(),
                batches: HashMap::new(),
                failed: None,
                loading: HashMap::new(),
                reading: HashMap::new(),
                violations: 0,
                rollbacks: 0,
                evicted: 0,
                unread_since: HashMap::new(),
                expired: 0,
            }),
            admission: ReservationManager::with_clock(sb.slot_count, opts.wait_clock.clone()),
            io,
            sb: Mutex::new(sb),
            opts,
            last_commit: Mutex::new(CommitInfo::default()),
            loads_done: std::sync::Condvar::new(),
            presence,
            windowed: windowed.into(),
        };
        let mut report = replayed.report;
        store.begin_epoch(&mut report)?;
        Ok((store, report))
    }

    fn lock_live(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn lock_sb(&self) -> MutexGuard<'_, Superblock> {
        self.sb.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a record to the state and queues it for the journal, in order.
    ///
    /// Every record takes journal space when it is queued, whether or not a
    /// commit follows: when it would take the active half past half full,
    /// a CHECKPOINT of the state (which already holds this record) is
    /// written to the other half instead, so the journal never wraps over
    /// live records. A record too large for a quarter of a half is refused
    /// before it changes anything.
    fn log(&self, live: &mut Live, r: Record) -> Result<(), StoreError> {
        if let Some(f) = &live.failed {
            return Err(StoreError::Failed(f.clone()));
        }
        let frame = journal::encode(live.next_seq, &r)?;
        let half = live.journal_half;
        if frame.len() as u64 > half / 4 {
            return Err(StoreError::RecordTooLarge { bytes: frame.len() as u64, journal_half: half });
        }
        live.state.apply(&r).map_err(|source| StoreError::Apply { path: self.path.clone(), source })?;
        debug_assert!(live.state.check().is_ok(), "allocator invariant broken by {r:?}: {:?}", live.state.check());
        if live.journal_end + frame.len() as u64 > half / 2 {
            return self.checkpoint_locked(live);
        }
        live.next_seq += 1;
        live.journal_end += frame.len() as u64;
        self.io.append(&frame);
        Ok(())
    }

    /// Makes every queued record durable (group commit), and checkpoints the
    /// journal when its half is over half full.
    /// Inside [`with_one_commit`](Self::with_one_commit), only noted: the
    /// scope commits once at its end.
    pub fn commit(&self) -> Result<CommitInfo, StoreError> {
        if let Some(last) = self.defer_commit() {
            return Ok(last);
        }
        let info = self.io.commit()?.map_err(|e| self.mark_failed(e))?;
        *self.last_commit.lock().unwrap_or_else(|p| p.into_inner()) = info;
        if info.journal_used > info.journal_half / 2 {
            self.checkpoint()?;
        }
        Ok(info)
    }

    /// A commit that failed leaves memory ahead of the media: refuse changes.
    fn mark_failed(&self, why: Arc<WorkerError>) -> StoreError {
        let mut live = self.lock_live();
        self.failed_locked(&mut live, why)
    }

    /// Records the store's first failure — said once, at ERROR, when it
    /// happens, not only when the daemon exits — and answers it.
    fn failed_locked(&self, live: &mut Live, why: Arc<WorkerError>) -> StoreError {
        // Refused as a reservation conflict: another owner took the namespace.
        let why = match why.is_reservation_conflict() && !matches!(*why, WorkerError::NamespaceLost { .. }) {
            true => {
                let lost = format!(
                    "the target refused this host as a reservation conflict ({why}): another owner preempted its key"
                );
                self.presence.lose(&self.path, &lost);
                Arc::new(WorkerError::NamespaceLost { why: lost })
            }
            false => why,
        };
        let first = live.failed.get_or_insert_with(|| {
            if matches!(*why, WorkerError::NamespaceLost { .. }) {
                return why; // said once, by `Presence::lose`
            }
            tracing::error!(
                target = %self.path.display(),
                error = %why,
                "the store failed: what was acknowledged is durable, but memory is now ahead of the media, so every change is refused until the daemon restarts (recovery replays the journal); fix the cause first"
            );
            why
        });
        StoreError::Failed(first.clone())
    }

    fn write_superblock(&self, sb: Superblock) -> Result<(), StoreError> {
        self.io.write_superblock(sb)?.map_err(|e| self.mark_failed(Arc::new(e)))
    }

    /// Compacts the journal into the other half: one CHECKPOINT record of the
    /// live state, then the superblock points at it.
    pub fn checkpoint(&self) -> Result<(), StoreError> {
        let mut live = self.lock_live();
        if let Some(f) = &live.failed {
            return Err(StoreError::Failed(f.clone()));
        }
        self.checkpoint_locked(&mut live)
    }

    /// [`checkpoint`](Self::checkpoint) with the live lock held: the
    /// checkpoint's sequence number, the next one and the superblock change
    /// together, so no record can be queued between them with a sequence
    /// number the checkpoint already took.
    fn checkpoint_locked(&self, live: &mut Live) -> Result<(), StoreError> {
        let seq = live.next_seq;
        let rec = Record::Checkpoint {
            next_publication: live.state.next_publication,
            publications: live.state.pubs.values().cloned().collect(),
        };
        let frame = journal::encode(seq, &rec)?;
        let frame_len = frame.len() as u64;
        let mut sb = self.lock_sb().clone();
        sb.active_half = 1 - sb.active_half;
        sb.journal_start_seq = seq;
        sb.generation += 1;
        match self.io.checkpoint(frame, sb.clone())? {
            Ok(()) => {
                live.next_seq = seq + 1;
                live.journal_end = frame_len;
                *self.lock_sb() = sb;
                Ok(())
            }
            Err(e) => Err(self.failed_locked(live, Arc::new(e))),
        }
    }

    /// Replaces the namespace's receipt key with a fresh random one (the key
    /// id goes up by one), so that every receipt signed before is void.
    /// Refused while publications are live: their receipts would be void
    /// with them still holding slots. Returns the new key id.
    pub fn rotate_key(&self) -> Result<u32, StoreError> {
        let live = self.lock_live().state.pubs.len();
        if live > 0 {
            return Err(StoreError::KeyInUse { live });
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(WorkerError::Random)?;
        let mut sb = self.superblock();
        sb.hmac_key = key;
        sb.hmac_key_id += 1;
        sb.generation += 1;
        self.write_superblock(sb.clone())?;
        let id = sb.hmac_key_id;
        *self.lock_sb() = sb;
        Ok(id)
    }

    /// The target's path, as the daemon opened it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The target's kind.
    pub fn target_kind(&self) -> TargetKind {
        self.io.target_kind()
    }

    /// Why the target at the store's path is no longer the one it opened
    /// (removed, or replaced by another file), if it is not.
    pub fn target_gone(&self) -> Option<String> {
        self.presence.gone(&self.path)
    }

    /// Why the store refuses changes, if a commit failed (restart recovers).
    pub fn failed(&self) -> Option<String> {
        self.lock_live().failed.as_ref().map(|e| e.to_string())
    }

    /// Bytes the queued records take in the active journal half, and the
    /// half's size. A checkpoint keeps the first at most about half the second.
    pub fn journal_usage(&self) -> (u64, u64) {
        let live = self.lock_live();
        (live.journal_end, live.journal_half)
    }

    /// The superblock as last written.
    pub fn superblock(&self) -> Superblock {
        self.lock_sb().clone()
    }

    /// The epoch this open started (claims from earlier epochs are fenced).
    pub fn epoch(&self) -> u64 {
        self.lock_sb().epoch
    }

    /// Hands a buffer to the I/O thread (registered for `host_fixed`).
    pub fn register_buffer(&self, buffer: Buffer) -> Result<BufferId, StoreError> {
        self.register_buffer_for(buffer, PayloadPath::HostFixed)
    }

    /// Hands a buffer to the I/O thread for `path`: held for `host`, its
    /// mapping registered for `host_fixed`, the DMA-BUF itself installed for
    /// `dmabuf_fixed`. Every chunk stored from or loaded into it moves on that
    /// path. Refused (nothing held) if the path cannot take it.
    pub fn register_buffer_for(&self, buffer: Buffer, path: PayloadPath) -> Result<BufferId, StoreError> {
        self.io.register(buffer, path)
    }

    /// The path a held buffer moves on.
    pub fn buffer_path(&self, id: BufferId) -> Option<PayloadPath> {
        self.io.buffer_path(id)
    }

    /// Whether this kernel has the rw-dmabuf io_uring UAPI (`dmabuf_fixed`).
    pub fn dmabuf_rw(&self) -> &DmabufRw {
        self.io.dmabuf_rw()
    }

    /// Gives a buffer back (a data-plane client went away).
    pub fn unregister_buffer(&self, id: BufferId) -> Result<(), StoreError> {
        self.io.unregister(id)
    }

    /// The live publication `id`, if any.
    pub fn publication(&self, id: u64) -> Option<Publication> {
        self.lock_live().state.pubs.get(&id).cloned()
    }

    /// The live publication of request `req`, if any (the state's own index).
    pub fn publication_of(&self, req: &str) -> Option<Publication> {
        self.lock_live().state.by_req(req).cloned()
    }

    /// Every live publication.
    pub fn publications(&self) -> Vec<Publication> {
        self.lock_live().state.pubs.values().cloned().collect()
    }

    /// The sessions holding a claim now: (claimant principal, session).
    pub fn claim_sessions(&self) -> std::collections::HashSet<(String, String)> {
        let live = self.lock_live();
        let claims = live.state.pubs.values().filter_map(|p| p.claim.as_ref());
        claims
            .map(|c| (c.claimant.as_ref().map(|o| o.principal.clone()).unwrap_or_default(), c.session.clone()))
            .collect()
    }
}

impl Drop for Store {
    /// Closing commits what is queued (a lazy RELEASE, say), then stops the
    /// I/O thread. A store that failed commits nothing more.
    fn drop(&mut self) {
        let healthy = self.lock_live().failed.is_none();
        self.io.stop(healthy);
    }
}
