//! The crash-safe on-media store (DESIGN §3) and the admission control that
//! guards it (§5): superblock, journal, slot allocator, recovery, and the
//! prepare → store batches → publish path with full rollback on any failure.
//!
//! Every state change is a journal record applied to [`state::State`] under
//! one lock and handed, in that order, to the I/O thread ([`worker`]). Records
//! become durable at the next commit. A READY publication is acknowledged only
//! after its payload was flushed, then its PUBLISH record written and flushed.
//!
//! This module does not sign receipts or enforce who may claim: that is the
//! protocol's job (`protocol/`), built on the records defined here.

mod error;
pub mod journal;
pub mod state;
pub mod superblock;
mod worker;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::admission::ReservationManager;
use crate::buffer::Buffer;
use crate::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOptions,
    TransferId,
};

pub use error::{Invariant, StateError, StoreError, WorkerError};
pub use journal::Record;
pub use state::{ChunkEntry, Layout, Manifest, Phase, Publication, SlotIndex};
pub use superblock::Superblock;
pub use worker::{CommitInfo, FaultPlan, PowerLoss};

use superblock::{FORMAT_VERSION, SUPERBLOCK_BYTES};
use worker::{Job, Worker};

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

#[derive(Debug, Clone, serde::Serialize)]
pub struct FormatReport {
    pub target: PathBuf,
    pub uuid: String,
    pub slot_size: u64,
    pub slot_count: u64,
    pub data_offset: u64,
    pub journal_half: u64,
    pub overwrote: Option<String>,
}

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

/// Writes a fresh namespace: empty journal halves, then both superblock copies.
pub fn format(path: &Path, opts: &FormatOptions) -> Result<FormatReport, StoreError> {
    if opts.slot_size == 0 || !opts.slot_size.is_multiple_of(4096) {
        return Err(StoreError::BadOption(format!("slot size {} must be a positive multiple of 4096", opts.slot_size)));
    }
    if !JOURNAL_HALF_CHOICES.contains(&opts.journal_half) {
        return Err(StoreError::BadOption(format!(
            "journal half {} must be a power of two from 256 KiB to 1 GiB",
            opts.journal_half
        )));
    }
    let target = Target::open(path, &TargetOptions { create_len: opts.create_len, allocate: true })?;
    let capacity = target.geometry().capacity;
    let block_size = target.geometry().logical_block;
    let data_offset = 2 * SUPERBLOCK_BYTES as u64 + 2 * opts.journal_half;
    let minimum = data_offset + opts.slot_size;
    if capacity < minimum {
        return Err(StoreError::TooSmall { path: path.into(), capacity, minimum });
    }
    let mut engine = Engine::new(target, EngineOptions { queue_depth: 8, buffer_slots: 4, ..Default::default() })?;
    let head = engine.read_to_vec(0, (68 << 10).min(capacity))?;
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
    };
    // Old superblocks go first, so a crash mid-format leaves no stale namespace.
    engine.write_from_slice(0, &[0u8; SUPERBLOCK_BYTES])?;
    let zeros = vec![0u8; (1 << 20).min(opts.journal_half) as usize];
    for half in 0..2u8 {
        let mut off = 0;
        while off < opts.journal_half {
            engine.write_from_slice(sb.journal_offset(half) + off, &zeros)?;
            off += zeros.len() as u64;
        }
    }
    engine.flush()?;
    engine.write_from_slice(sb.copy_b_offset(), &sb.encode())?;
    engine.flush()?;
    engine.write_from_slice(0, &sb.encode())?;
    engine.flush()?;
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

/// How to run a store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub queue_depth: u32,
    /// The longest `prepare` waits for capacity.
    pub admission_timeout: Duration,
    /// Crash-consistency testing: the device dies after this many writes.
    pub fault: Option<Arc<FaultPlan>>,
    /// The time claims and leases are measured in.
    pub clock: Arc<dyn crate::protocol::Clock>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            queue_depth: 32,
            admission_timeout: Duration::from_secs(30),
            fault: None,
            clock: Arc::new(crate::protocol::SystemClock),
        }
    }
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecoveryReport {
    pub epoch: u64,
    pub records_replayed: usize,
    pub rolled_back: Vec<u64>,
    pub live: usize,
    /// Where the journal stopped early, and why (torn tail, bad checksum).
    pub journal_stop: Option<String>,
    pub superblock_note: Option<String>,
}

/// Per-request batch accounting (DESIGN §5).
#[derive(Debug, Default)]
struct Batches {
    seen_first: bool,
    claimed: BTreeSet<u32>,
    completed: u32,
    last_seen: bool,
    inflight: u32,
    published: bool,
    /// When the request was prepared or last had a store batch begin or end.
    touched: Option<std::time::Instant>,
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
}

/// One chunk of a store batch: where its bytes are.
#[derive(Debug, Clone, Copy)]
pub struct ChunkSource {
    pub index: u32,
    pub buffer: BufferId,
    pub buffer_offset: BufferOffset,
    pub len: u64,
    /// The client's crc32c of the chunk. Checked against the bytes where the
    /// daemon can read them; the only checksum for memory it cannot map.
    pub crc32c: Option<u32>,
}

/// A store batch: the AllocRequest of the source design.
#[derive(Debug, Clone)]
pub struct StoreBatch {
    pub publication: u64,
    pub chunks: Vec<ChunkSource>,
    pub is_last_batch: bool,
    pub total_chunks: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    pub completed: u32,
    pub total: u32,
    pub publishable: bool,
}

/// One chunk to load: where to put it.
#[derive(Debug, Clone, Copy)]
pub struct ChunkDest {
    pub index: u32,
    pub buffer: BufferId,
    pub buffer_offset: BufferOffset,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// Rolled back now; this many slots were freed.
    Aborted { slots: u32 },
    /// Batches are in flight; the slots free when they finish.
    Pending,
    /// Nothing to abort: unknown or already finished.
    NotFound,
}

#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct StoreStats {
    pub slots: u64,
    pub free_slots: u64,
    pub reserved: u64,
    pub live_publications: usize,
    pub flushes: u64,
    pub commit_groups: u64,
    pub journal_used: u64,
    pub admission_waits: u64,
}

pub struct Store {
    path: PathBuf,
    live: Mutex<Live>,
    admission: ReservationManager,
    jobs: Mutex<Sender<Job>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    sb: Mutex<Superblock>,
    opts: StoreOptions,
    last_commit: Mutex<CommitInfo>,
    target_kind: crate::io::TargetKind,
    dmabuf_rw: crate::io::DmabufRw,
    /// The path each held buffer was registered for.
    buffer_paths: Mutex<HashMap<BufferId, PayloadPath>>,
}

impl Store {
    /// Opens a formatted target: replays the journal, rolls back PREPARED
    /// publications, keeps READY/CLAIMED/ADOPTED/RETAINED ones with their
    /// slots, bumps and persists the epoch.
    pub fn open(path: &Path, opts: StoreOptions) -> Result<(Store, RecoveryReport), StoreError> {
        let target = Target::open(path, &TargetOptions { create_len: None, allocate: true })?;
        let target_kind = target.kind();
        let (tx, rx) = channel::<Job>();
        type Opened = (Superblock, Option<String>, Vec<u8>, crate::io::DmabufRw);
        let (otx, orx) = channel::<Result<Opened, StoreError>>();
        let qd = opts.queue_depth;
        let fault = opts.fault.clone();
        let p = path.to_path_buf();
        let handle = std::thread::Builder::new()
            .name("pdstor-store-io".into())
            .spawn(move || {
                let opened = Worker::open(target, qd, fault).map_err(StoreError::from);
                let (mut worker, a, b) = match opened {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = otx.send(Err(e));
                        return;
                    }
                };
                let chosen = superblock::choose(Superblock::decode(&a), Superblock::decode(&b))
                    .map_err(|source| StoreError::Superblock { path: p.clone(), source });
                let (sb, note) = match chosen {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = otx.send(Err(e));
                        return;
                    }
                };
                match worker.load_journal(&sb) {
                    Ok(j) => {
                        let _ = otx.send(Ok((sb, note, j, worker.dmabuf_rw())));
                    }
                    Err(e) => {
                        let _ = otx.send(Err(StoreError::from(e)));
                        return;
                    }
                }
                // After replay the opener says where appends continue; then jobs flow.
                match rx.recv() {
                    Ok(Job::Resume { journal_end }) if worker.set_journal_end(journal_end).is_ok() => worker.run(rx),
                    _ => {}
                }
            })
            .map_err(|e| StoreError::from(WorkerError::Spawn(e)))?;
        let (sb, note, journal, dmabuf_rw) = orx.recv().map_err(|_| WorkerError::ExitedDuringOpen)??;

        let mut state = state::State::new(sb.slot_count, sb.slot_size, sb.data_offset);
        state.epoch = sb.epoch;
        let (records, end, stop) = journal::replay(&journal, sb.journal_start_seq);
        let mut report = RecoveryReport {
            journal_stop: stop.map(|s| {
                format!("journal stops at byte {} (record {}): {}; later records ignored", s.offset, s.seq, s.reason)
            }),
            superblock_note: note,
            records_replayed: records.len(),
            ..Default::default()
        };
        for (seq, r) in &records {
            state.apply(r).map_err(|source| StoreError::Replay { path: path.into(), seq: *seq, source })?;
        }
        let next_seq = records.last().map_or(sb.journal_start_seq, |(s, _)| s + 1);
        let _ = tx.send(Job::Resume { journal_end: end as u64 });

        let admission = ReservationManager::new(sb.slot_count);
        let store = Store {
            path: path.into(),
            live: Mutex::new(Live {
                state,
                next_seq,
                journal_end: end as u64,
                journal_half: sb.journal_half,
                quarantine: BTreeSet::new(),
                batches: HashMap::new(),
                failed: None,
            }),
            admission,
            jobs: Mutex::new(tx),
            worker: Mutex::new(Some(handle)),
            sb: Mutex::new(sb.clone()),
            opts,
            last_commit: Mutex::new(CommitInfo::default()),
            target_kind,
            dmabuf_rw,
            buffer_paths: Mutex::new(HashMap::new()),
        };
        // New epoch: superblock first (its write is the durable bump).
        let mut next_sb = sb.clone();
        next_sb.epoch += 1;
        next_sb.generation += 1;
        store.write_superblock(next_sb.clone())?;
        *store.lock_sb() = next_sb.clone();
        {
            let mut live = store.lock_live();
            let prepared: Vec<u64> = live
                .state
                .pubs
                .values()
                .filter(|p| matches!(p.phase, Phase::Prepared | Phase::Aborting))
                .map(|p| p.id)
                .collect();
            for id in prepared {
                store.log(
                    &mut live,
                    Record::Abort { publication: id, reason: "rolled back at recovery: never published".into() },
                )?;
                report.rolled_back.push(id);
            }
            store.log(&mut live, Record::Epoch { epoch: next_sb.epoch })?;
            let held: Vec<(u64, String, u64)> =
                live.state.pubs.values().map(|p| (p.id, p.req_id.clone(), p.slots.len() as u64)).collect();
            for (id, req, n) in held {
                store.admission.restore(&req, n)?;
                live.batches.insert(id, Batches { seen_first: true, published: true, ..Default::default() });
            }
            report.live = live.state.pubs.len();
            report.epoch = next_sb.epoch;
            live.state.check().map_err(|source| StoreError::Recovered { path: path.into(), source })?;
        }
        store.commit()?;
        Ok((store, report))
    }

    fn lock_live(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn lock_sb(&self) -> MutexGuard<'_, Superblock> {
        self.sb.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn send(&self, job: Job) -> Result<(), StoreError> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).send(job).map_err(|_| StoreError::from(WorkerError::Gone))
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
        self.send(Job::Append(frame))
    }

    /// Makes every queued record durable (group commit), and checkpoints the
    /// journal when its half is over half full.
    pub fn commit(&self) -> Result<CommitInfo, StoreError> {
        let (tx, rx) = channel();
        self.send(Job::Commit(tx))?;
        let info = rx.recv().map_err(|_| WorkerError::Gone)?.map_err(|e| self.mark_failed(e))?;
        *self.last_commit.lock().unwrap_or_else(|p| p.into_inner()) = info;
        if info.journal_used > info.journal_half / 2 {
            self.checkpoint()?;
        }
        Ok(info)
    }

    /// A commit that failed leaves memory ahead of the media: refuse changes.
    fn mark_failed(&self, why: Arc<WorkerError>) -> StoreError {
        let mut live = self.lock_live();
        StoreError::Failed(live.failed.get_or_insert(why).clone())
    }

    fn write_superblock(&self, sb: Superblock) -> Result<(), StoreError> {
        let (tx, rx) = channel();
        self.send(Job::WriteSuperblock(sb, tx))?;
        rx.recv().map_err(|_| WorkerError::Gone)?.map_err(|e| self.mark_failed(Arc::new(e)))
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
        let (tx, rx) = channel();
        self.send(Job::Checkpoint { frame, superblock: sb.clone(), reply: tx })?;
        let r = rx.recv().map_err(|_| WorkerError::Gone)?;
        match r {
            Ok(()) => {
                live.next_seq = seq + 1;
                live.journal_end = frame_len;
                *self.lock_sb() = sb;
                Ok(())
            }
            Err(e) => Err(StoreError::Failed(live.failed.get_or_insert(Arc::new(e)).clone())),
        }
    }

    pub fn target_kind(&self) -> crate::io::TargetKind {
        self.target_kind
    }

    /// The time, by the store's clock ([`StoreOptions::clock`]).
    pub fn now_unix_ms(&self) -> u64 {
        self.opts.clock.now_unix_ms()
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

    pub fn superblock(&self) -> Superblock {
        self.lock_sb().clone()
    }

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
        let (tx, rx) = channel();
        self.send(Job::Register(buffer, path, tx))?;
        let id = rx.recv().map_err(|_| WorkerError::Gone)??;
        self.lock_paths().insert(id, path);
        Ok(id)
    }

    /// The path a held buffer moves on.
    pub fn buffer_path(&self, id: BufferId) -> Option<PayloadPath> {
        self.lock_paths().get(&id).copied()
    }

    /// Whether this kernel has the rw-dmabuf io_uring UAPI (`dmabuf_fixed`).
    pub fn dmabuf_rw(&self) -> &crate::io::DmabufRw {
        &self.dmabuf_rw
    }

    fn lock_paths(&self) -> std::sync::MutexGuard<'_, HashMap<BufferId, PayloadPath>> {
        self.buffer_paths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives a buffer back (a data-plane client went away).
    pub fn unregister_buffer(&self, id: BufferId) -> Result<(), StoreError> {
        let (tx, rx) = channel();
        self.send(Job::Unregister(id, tx))?;
        rx.recv().map_err(|_| WorkerError::Gone)?.map_err(StoreError::from)?;
        self.lock_paths().remove(&id);
        Ok(())
    }

    /// Step 1: admission. Reserves the whole chunk set (waiting up to the
    /// admission timeout) and records the PREPARE.
    pub fn prepare(&self, req_id: &str, writer: &str, layout: &Layout, total_chunks: u32) -> Result<u64, StoreError> {
        self.prepare_with_timeout(req_id, writer, layout, total_chunks, self.opts.admission_timeout)
    }

    pub fn prepare_with_timeout(
        &self,
        req_id: &str,
        writer: &str,
        layout: &Layout,
        total_chunks: u32,
        timeout: Duration,
    ) -> Result<u64, StoreError> {
        if total_chunks > TransferId::MAX_CHUNKS {
            return Err(StoreError::TooManyChunks { chunks: total_chunks, max: TransferId::MAX_CHUNKS });
        }
        if let Some(p) = self.lock_live().state.by_req(req_id) {
            return Err(StoreError::DuplicateRequest { req: req_id.into(), publication: p.id });
        }
        self.admission.try_admit(req_id, total_chunks as u64, timeout)?;
        let mut live = self.lock_live();
        let prepared = (|| {
            if let Some(p) = live.state.by_req(req_id) {
                return Err(StoreError::DuplicateRequest { req: req_id.into(), publication: p.id });
            }
            let slots = live
                .state
                .pick_slots_avoiding(total_chunks, &live.quarantine)
                .ok_or(Invariant::AllocatorShort { granted: total_chunks, free: live.state.free_slots() })?;
            let id = live.state.next_publication;
            if id > TransferId::MAX_PUBLICATION {
                return Err(StoreError::PublicationsExhausted { next: id });
            }
            self.log(
                &mut live,
                Record::Prepare {
                    publication: id,
                    req_id: req_id.into(),
                    writer: writer.into(),
                    layout: layout.clone(),
                    total_chunks,
                    slots,
                },
            )?;
            live.batches.insert(id, Batches { touched: Some(std::time::Instant::now()), ..Default::default() });
            Ok(id)
        })();
        if prepared.is_err() {
            self.admission.release(req_id);
        }
        prepared
    }

    /// Rolls a PREPARED publication back under the lock (slots and reservation).
    fn rollback_locked(&self, live: &mut Live, id: u64, reason: String) -> Result<u32, StoreError> {
        let Some(p) = live.state.pubs.get(&id) else {
            return Ok(0);
        };
        let (req, n) = (p.req_id.clone(), p.slots.len() as u32);
        let inflight = live.batches.get(&id).map_or(0, |b| b.inflight);
        if inflight > 0 {
            live.state.mark_aborting(id);
            return Ok(0);
        }
        self.log(live, Record::Abort { publication: id, reason })?;
        live.batches.remove(&id);
        self.admission.release(&req);
        Ok(n)
    }

    /// Step 2: one store batch. Batches may run concurrently and complete out
    /// of order. A violation or any failure rolls back the whole request.
    pub fn store_batch(&self, batch: &StoreBatch) -> Result<BatchOutcome, StoreError> {
        let id = batch.publication;
        let requests = {
            let mut live = self.lock_live();
            let p = in_phase(&live.state, id, &[Phase::Prepared], "store batches go to PREPARED publications only")?;
            let (total, slots, slot_size) = (p.total_chunks, p.slots.clone(), live.state.slot_size);
            let b = live.batches.entry(id).or_default();
            if !b.seen_first && batch.total_chunks == 0 {
                return Err(StoreError::LegacySender { publication: id });
            }
            if batch.total_chunks != total {
                return Err(StoreError::TotalMismatch {
                    publication: id,
                    declared: batch.total_chunks,
                    prepared: total,
                });
            }
            if b.published {
                return Err(StoreError::WrongPhase {
                    publication: id,
                    phase: Phase::Ready,
                    what: "it is being published",
                });
            }
            let mut violation = None;
            let mut seen = BTreeSet::new();
            for c in &batch.chunks {
                if c.index >= total {
                    violation = Some(format!("chunk index {} is beyond the declared {total} chunks", c.index));
                } else if b.claimed.contains(&c.index) || !seen.insert(c.index) {
                    violation = Some(format!("chunk {} stored twice", c.index));
                } else if c.len == 0 || c.len > slot_size {
                    violation = Some(format!("chunk {} is {} bytes; a slot holds 1 to {slot_size}", c.index, c.len));
                }
                if violation.is_some() {
                    break;
                }
            }
            let cumulative = b.claimed.len() + batch.chunks.len();
            if violation.is_none() && cumulative > total as usize {
                violation = Some(format!("{cumulative} chunks sent against {total} declared"));
            }
            if let Some(what) = violation {
                self.rollback_locked(&mut live, id, format!("protocol violation: {what}"))?;
                return Err(StoreError::ProtocolViolation { publication: id, what });
            }
            let b = live.batches.entry(id).or_default();
            b.seen_first = true;
            b.claimed.extend(batch.chunks.iter().map(|c| c.index));
            b.inflight += 1;
            b.touched = Some(std::time::Instant::now());
            let paths = self.lock_paths();
            batch
                .chunks
                .iter()
                .map(|c| IoRequest {
                    transfer: TransferId::chunk(id, c.index),
                    op: Op::Write,
                    path: paths.get(&c.buffer).copied().unwrap_or(PayloadPath::HostFixed),
                    buffer: c.buffer,
                    buffer_offset: c.buffer_offset,
                    target_offset: live.state.slot_offset(slots[c.index as usize]),
                    len: c.len,
                })
                .collect::<Vec<_>>()
        };
        let io = if requests.is_empty() { Ok(Vec::new()) } else { self.payload(requests.clone()) };
        let mut live = self.lock_live();
        if let Some(b) = live.batches.get_mut(&id) {
            b.inflight -= 1;
            b.touched = Some(std::time::Instant::now());
        }
        let aborting = live.state.pubs.get(&id).is_none_or(|p| p.phase == Phase::Aborting);
        if aborting {
            if live.state.pubs.get(&id).is_some_and(|p| p.phase == Phase::Aborting)
                && live.batches.get(&id).is_some_and(|b| b.inflight == 0)
            {
                self.rollback_locked(&mut live, id, "aborted".into())?;
            }
            return Err(StoreError::AbortedInFlight { publication: id });
        }
        let failure = match io {
            Err(e) => Some(e),
            Ok(results) => {
                let mut first_err = None;
                let mut crcs = Vec::new();
                for (c, r) in batch.chunks.iter().zip(results) {
                    match r.and_then(|read| chunk_checksum(id, c, read)) {
                        Ok(crc) => crcs.push((c, crc)),
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                if first_err.is_none() {
                    let slots = live.state.pubs.get(&id).map(|p| p.slots.clone()).unwrap_or_default();
                    for (c, crc) in crcs {
                        self.log(
                            &mut live,
                            Record::Alloc {
                                publication: id,
                                chunk: c.index,
                                slot: slots[c.index as usize],
                                len: c.len,
                                crc32c: crc,
                            },
                        )?;
                    }
                }
                first_err
            }
        };
        if let Some(source) = failure {
            self.rollback_locked(&mut live, id, format!("store batch failed: {source}"))?;
            return Err(StoreError::BatchFailed { publication: id, source });
        }
        let total = live.state.pubs.get(&id).map_or(0, |p| p.total_chunks);
        let b = live.batches.entry(id).or_default();
        b.completed += batch.chunks.len() as u32;
        b.last_seen |= batch.is_last_batch;
        Ok(BatchOutcome {
            completed: b.completed,
            total,
            publishable: b.completed == total && b.last_seen && b.inflight == 0,
        })
    }

    fn payload(&self, requests: Vec<IoRequest>) -> worker::PayloadReply {
        let (tx, rx) = channel();
        self.send(Job::Io(requests, tx))
            .map_err(|e| IoError::Ring { op: "store I/O thread", source: std::io::Error::other(e.to_string()) })?;
        rx.recv().map_err(|_| IoError::Ring { op: "store I/O thread", source: std::io::Error::other("gone") })?
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
            let m =
                Manifest { publication: id, req_id: p.req_id.clone(), layout: p.layout.clone(), chunks, first_token };
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

    /// Rolls back a publication that is not yet READY (slots and reservation).
    /// Aborting an unknown or finished publication is a clear no-op.
    /// Aborts every PREPARED publication with no store batch in flight that
    /// has seen none begin or end for `idle` (a writer that went quiet without
    /// closing its connection): its reservation would otherwise be held until
    /// a restart. Returns the publications aborted.
    pub fn reap_idle(&self, idle: Duration) -> Vec<(u64, String)> {
        let now = std::time::Instant::now();
        let quiet: Vec<(u64, String)> = {
            let live = self.lock_live();
            live.state
                .pubs
                .values()
                .filter(|p| p.phase == Phase::Prepared)
                .filter(|p| {
                    live.batches.get(&p.id).is_none_or(|b| {
                        b.inflight == 0 && !b.published && b.touched.is_none_or(|t| now.duration_since(t) >= idle)
                    })
                })
                .map(|p| (p.id, p.req_id.clone()))
                .collect()
        };
        quiet.into_iter().filter(|(id, _)| matches!(self.abort(*id), Ok(AbortOutcome::Aborted { .. }))).collect()
    }

    pub fn abort(&self, id: u64) -> Result<AbortOutcome, StoreError> {
        let mut live = self.lock_live();
        let Some(p) = live.state.pubs.get(&id) else {
            return Ok(AbortOutcome::NotFound);
        };
        if !matches!(p.phase, Phase::Prepared | Phase::Aborting) || live.batches.get(&id).is_some_and(|b| b.published) {
            return Err(StoreError::WrongPhase {
                publication: id,
                phase: p.phase,
                what: "abort applies before READY only; use release",
            });
        }
        if live.batches.get(&id).is_some_and(|b| b.inflight > 0) {
            live.state.mark_aborting(id);
            return Ok(AbortOutcome::Pending);
        }
        let n = self.rollback_locked(&mut live, id, "aborted by the writer".into())?;
        Ok(AbortOutcome::Aborted { slots: n })
    }

    /// Aborts by request id: also wakes a `prepare` of it still waiting.
    pub fn abort_request(&self, req_id: &str) -> Result<AbortOutcome, StoreError> {
        let id = self.lock_live().state.by_req(req_id).map(|p| p.id);
        match id {
            Some(id) => self.abort(id),
            None => {
                self.admission.abort(req_id);
                Ok(AbortOutcome::NotFound)
            }
        }
    }

    /// Exact unread release: a READY publication that was never claimed.
    ///
    /// The RELEASE record is committed before this returns, and its slots
    /// stay out of reach of new prepares until then (quarantined): had
    /// another request written payload into them before the record was
    /// durable, a crash would bring the publication back READY over its
    /// bytes (found by the simulation, `driver/tests/sim.rs`). ACK and
    /// RECLAIM free their slots the same way.
    pub fn release(&self, id: u64) -> Result<(), StoreError> {
        let (req, slots) = {
            let mut live = self.lock_live();
            let p =
                in_phase(&live.state, id, &[Phase::Ready], "only a READY, never-claimed publication can be released")?;
            let (req, slots) = (p.req_id.clone(), p.slots.clone());
            self.log(&mut live, Record::Release { publication: id })?;
            live.batches.remove(&id);
            live.quarantine.extend(&slots);
            (req, slots)
        };
        self.free_when_durable(&req, &slots)
    }

    /// Commits (sharing the flush with whoever else is committing), then
    /// lets `slots` be prepared again and gives `req`'s reservation back.
    fn free_when_durable(&self, req: &str, slots: &[SlotIndex]) -> Result<(), StoreError> {
        let committed = self.commit();
        let mut live = self.lock_live();
        for s in slots {
            live.quarantine.remove(s);
        }
        drop(live);
        self.admission.release(req);
        committed.map(drop)
    }

    /// Runs one protocol transition: checks the phase, journals `record`,
    /// releases the reservation if the record frees the slots, and commits.
    fn transition(
        &self,
        id: u64,
        allowed: &[Phase],
        what: &'static str,
        record: Record,
    ) -> Result<Publication, StoreError> {
        let frees = matches!(record, Record::Ack { .. } | Record::Reclaim { .. });
        let before = {
            let mut live = self.lock_live();
            let p = in_phase(&live.state, id, allowed, what)?.clone();
            self.log(&mut live, record)?;
            if frees {
                live.batches.remove(&id);
                live.quarantine.extend(&p.slots);
            }
            p
        };
        if frees {
            self.free_when_durable(&before.req_id, &before.slots)?;
        } else {
            self.commit()?;
        }
        Ok(self.publication(id).unwrap_or(before))
    }

    /// Step 4: binds exactly one reader and session to a READY publication.
    pub fn claim(&self, id: u64, reader: &str, session: &str, lease_ms: u64) -> Result<Publication, StoreError> {
        let record = Record::Claim {
            publication: id,
            reader: reader.into(),
            session: session.into(),
            lease_ms,
            epoch: self.epoch(),
            claimed_unix_ms: self.now_unix_ms(),
        };
        self.transition(id, &[Phase::Ready], "only a READY, unclaimed publication can be claimed", record)
    }

    /// Step 5: the claimed reader adopts the publication (checks are the caller's).
    pub fn adopt(&self, id: u64) -> Result<Publication, StoreError> {
        self.transition(
            id,
            &[Phase::Claimed],
            "only a CLAIMED publication can be adopted",
            Record::Adopt { publication: id },
        )
    }

    /// Step 7: frees the slots. A second ACK finds no live publication.
    pub fn ack(&self, id: u64, restore_digest: &str) -> Result<(), StoreError> {
        let r = Record::Ack { publication: id, restore_digest: restore_digest.into() };
        self.transition(id, &[Phase::Adopted], "only an ADOPTED publication can be acknowledged", r).map(|_| ())
    }

    /// A failed or uncertain claimed read: RETAINED, bytes and slots kept.
    pub fn fail(&self, id: u64, reason: &str) -> Result<(), StoreError> {
        let r = Record::Retain { publication: id, reason: reason.into() };
        self.transition(id, &[Phase::Claimed, Phase::Adopted], "only a claimed publication can fail", r).map(|_| ())
    }

    /// Frees a claimed or retained publication's slots; the caller has checked
    /// that its reader is fenced.
    pub fn reclaim(&self, id: u64) -> Result<(), StoreError> {
        let r = Record::Reclaim { publication: id };
        self.transition(
            id,
            &[Phase::Claimed, Phase::Adopted, Phase::Retained],
            "only a claimed or retained publication can be reclaimed",
            r,
        )
        .map(|_| ())
    }

    pub fn publication(&self, id: u64) -> Option<Publication> {
        self.lock_live().state.pubs.get(&id).cloned()
    }

    /// The receipt signer of this namespace.
    pub fn signer(&self) -> crate::protocol::Signer {
        let sb = self.lock_sb();
        crate::protocol::Signer::new(sb.hmac_key, sb.hmac_key_id, sb.uuid.to_string())
    }

    /// Reads chunks of a READY (or later) publication into buffers and checks
    /// each against its recorded checksum. A mismatch is an error, never data.
    /// Returns each chunk's crc32c as read, or `None` where the buffer is
    /// memory this process cannot map (the reader must verify those itself).
    pub fn load(&self, id: u64, dests: &[ChunkDest]) -> Result<Vec<Option<u32>>, StoreError> {
        let manifest = {
            let live = self.lock_live();
            let p = live.state.pubs.get(&id).ok_or(StoreError::UnknownPublication(id))?;
            p.manifest.clone().ok_or(StoreError::WrongPhase {
                publication: id,
                phase: p.phase,
                what: "it has no manifest yet (not READY)",
            })?
        };
        let mut requests = Vec::with_capacity(dests.len());
        let paths = self.lock_paths();
        for d in dests {
            let c = manifest.chunks.get(d.index as usize).ok_or(StoreError::NoSuchChunk {
                publication: id,
                chunk: d.index,
                chunks: manifest.chunks.len(),
            })?;
            requests.push(IoRequest {
                transfer: TransferId::chunk(id, d.index),
                op: Op::Read,
                path: paths.get(&d.buffer).copied().unwrap_or(PayloadPath::HostFixed),
                buffer: d.buffer,
                buffer_offset: d.buffer_offset,
                target_offset: c.offset,
                len: c.len,
            });
        }
        drop(paths);
        // The I/O thread computes each read chunk's crc32c from the bytes it landed.
        let results = self.payload(requests)?;
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
                    what: format!("checksum mismatch: stored {:#010x}, read {crc:#010x}", c.crc32c),
                });
            }
            crcs.push(Some(crc));
        }
        Ok(crcs)
    }

    pub fn publications(&self) -> Vec<Publication> {
        self.lock_live().state.pubs.values().cloned().collect()
    }

    pub fn stats(&self) -> StoreStats {
        let live = self.lock_live();
        let c = *self.last_commit.lock().unwrap_or_else(|p| p.into_inner());
        StoreStats {
            slots: live.state.slot_count(),
            free_slots: live.state.free_slots(),
            reserved: self.admission.stats().reserved,
            live_publications: live.state.pubs.len(),
            flushes: c.flushes,
            commit_groups: c.commit_groups,
            journal_used: c.journal_used,
            admission_waits: self.admission.stats().waits,
        }
    }

    /// Every invariant at once: the allocator's, the reservations', and their
    /// agreement — each live publication's request holds exactly its slots.
    /// A holder with no live publication is a `prepare` between admission and
    /// its PREPARE record; [`Store::check_quiescent`] allows none.
    pub fn check(&self) -> Result<(), Invariant> {
        let live = self.lock_live();
        live.state.check()?;
        self.admission.check().map_err(Invariant::Admission)?;
        let holders: HashMap<String, u64> = self.admission.holders().into_iter().collect();
        for p in live.state.pubs.values() {
            let held = holders.get(&p.req_id).copied().unwrap_or(0);
            if held != p.slots.len() as u64 {
                return Err(Invariant::Reservations { req: p.req_id.clone(), held, slots: p.slots.len() });
            }
        }
        let in_transit: u64 = holders.iter().filter(|(r, _)| live.state.by_req(r).is_none()).map(|(_, n)| n).sum();
        if in_transit > live.state.free_slots() {
            return Err(Invariant::InTransit { in_transit, free: live.state.free_slots() });
        }
        Ok(())
    }

    /// [`Store::check`], with no `prepare` in flight: reservations equal owned slots.
    pub fn check_quiescent(&self) -> Result<(), Invariant> {
        self.check()?;
        let live = self.lock_live();
        let owned: u64 = live.state.pubs.values().map(|p| p.slots.len() as u64).sum();
        let reserved = self.admission.stats().reserved;
        if owned != reserved {
            return Err(Invariant::Unbalanced { owned, reserved });
        }
        Ok(())
    }
}

/// The checksum recorded for a stored chunk: the one read from the bytes,
/// which a client-declared one must match; the declared one alone where the
/// daemon cannot read the memory; an error when there is neither.
fn chunk_checksum(publication: u64, c: &ChunkSource, read: Option<u32>) -> Result<u32, IoError> {
    let transfer = TransferId::chunk(publication, c.index);
    match (read, c.crc32c) {
        (Some(r), Some(d)) if r != d => Err(IoError::Transfer {
            transfer,
            op: Op::Write,
            offset: 0,
            len: c.len,
            source: std::io::Error::other(format!(
                "the client declared crc32c {d:#010x} but the buffer holds {r:#010x}: the bytes changed under the store or the client checksummed other bytes"
            )),
        }),
        (Some(r), _) => Ok(r),
        (None, Some(d)) => Ok(d),
        (None, None) => Err(IoError::Transfer {
            transfer,
            op: Op::Write,
            offset: 0,
            len: c.len,
            source: std::io::Error::other(
                "the buffer is memory the daemon cannot map and the client gave no crc32c: send each chunk's crc32c with the store batch",
            ),
        }),
    }
}

impl Drop for Store {
    /// Closing commits what is queued (a lazy RELEASE, say), then stops the
    /// I/O thread. A store that failed commits nothing more.
    fn drop(&mut self) {
        if self.lock_live().failed.is_none() {
            let (tx, rx) = channel();
            if self.send(Job::Commit(tx)).is_ok() {
                let _ = rx.recv();
            }
        }
        let _ = self.send(Job::Stop);
        if let Some(h) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
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
