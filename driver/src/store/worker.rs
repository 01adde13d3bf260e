//! The store's I/O thread. It owns the [`Engine`] (which must stay on one
//! thread), the in-memory image of the active journal half, and the device
//! flushes. Group commit: every `Commit` waiting in the queue when the thread
//! gets to one is served by a single "flush payload → write journal tail →
//! flush" sequence, so concurrent publishers share flushes.
//!
//! A [`FaultPlan`] makes the device die after a given number of writes (the
//! crash-consistency harness): later writes and flushes fail, and the first
//! failing write may be torn (half of it reaches the media). A simulated plan
//! ([`FaultPlan::simulated`]) also models the device's volatile write cache:
//! it remembers every write since the last flush, and a power loss
//! ([`FaultPlan::power_loss`]) loses, tears or misdirects any of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::mpsc::{Receiver, Sender};

use crate::buffer::Buffer;
use crate::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoError, IoRequest, Op, PayloadPath, Target, TargetOffset,
    TransferId,
};

use super::error::WorkerError;
use super::superblock::{SUPERBLOCK_BYTES, Superblock};

/// Journal writes are whole 4 KiB blocks (every target here accepts that).
pub const JOURNAL_BLOCK: u64 = 4096;

/// Kills the device after `writes` more writes (payload, journal or superblock).
#[derive(Debug)]
pub struct FaultPlan {
    writes_left: AtomicI64,
    torn: bool,
    dead: AtomicBool,
    /// The simulated volatile write cache, for [`FaultPlan::simulated`].
    cache: Option<std::sync::Mutex<WriteCache>>,
}

/// Writes the device has acknowledged but not yet flushed, oldest first:
/// where, and the bytes there before and after.
#[derive(Debug)]
struct WriteCache {
    file: std::fs::File,
    unflushed: Vec<(u64, Vec<u8>, Vec<u8>)>,
}

/// What a simulated power loss did to the unflushed writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PowerLoss {
    pub unflushed: usize,
    pub lost: usize,
    pub torn: usize,
    /// Writes that landed one block away from where they were aimed: media
    /// corruption, which the store must detect (never serve as good bytes).
    pub misdirected: usize,
}

impl FaultPlan {
    pub fn die_after_writes(writes: u64, torn: bool) -> Arc<FaultPlan> {
        Arc::new(FaultPlan {
            writes_left: AtomicI64::new(writes as i64),
            torn,
            dead: AtomicBool::new(false),
            cache: None,
        })
    }

    /// A device that works until [`kill`](Self::kill), remembering unflushed
    /// writes to `path` (the target file) so that [`power_loss`](Self::power_loss)
    /// can undo, tear or misdirect them.
    pub fn simulated(path: &std::path::Path) -> std::io::Result<Arc<FaultPlan>> {
        let file = std::fs::File::options().read(true).write(true).open(path)?;
        Ok(Arc::new(FaultPlan {
            writes_left: AtomicI64::new(i64::MAX),
            torn: false,
            dead: AtomicBool::new(false),
            cache: Some(std::sync::Mutex::new(WriteCache { file, unflushed: Vec::new() })),
        }))
    }

    /// The power goes: every later write and flush fails.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    fn cache(&self) -> Option<std::sync::MutexGuard<'_, WriteCache>> {
        self.cache.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Before a write: remember what it overwrites.
    fn before_write(&self, offset: u64, len: u64) {
        if let Some(mut c) = self.cache() {
            let before = Self::read_now_file(&c.file, offset, len);
            c.unflushed.push((offset, before, Vec::new()));
        }
    }

    /// After the writes since the last [`before_write`](Self::before_write)s
    /// completed: remember what they wrote.
    fn after_writes(&self) {
        if let Some(mut c) = self.cache() {
            let c = &mut *c;
            for (offset, before, after) in c.unflushed.iter_mut().filter(|w| w.2.is_empty()) {
                *after = Self::read_now_file(&c.file, *offset, before.len() as u64);
            }
        }
    }

    /// Bytes at `offset..offset + len` of the target as they are now.
    fn read_now_file(file: &std::fs::File, offset: u64, len: u64) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len as usize];
        let _ = file.read_exact_at(&mut b, offset);
        b
    }

    /// A flush completed: the cache is empty.
    fn flushed(&self) {
        if let Some(mut c) = self.cache() {
            c.unflushed.clear();
        }
    }

    /// The power was lost with writes in the volatile cache. `choose(n)`
    /// picks a number below `n` (the simulator's seeded source): each
    /// unflushed write independently reaches the media whole, is lost, is
    /// torn (a prefix of whole 512-byte sectors), or lands one 4 KiB block
    /// away, at the rates `misdirect_ok` allows. Call after [`kill`](Self::kill)
    /// and after the store is gone.
    pub fn power_loss(&self, choose: &mut dyn FnMut(u64) -> u64, misdirect_ok: bool) -> PowerLoss {
        use std::os::unix::fs::FileExt;
        let Some(mut c) = self.cache() else { return PowerLoss::default() };
        let writes = std::mem::take(&mut c.unflushed);
        let mut report = PowerLoss { unflushed: writes.len(), ..Default::default() };
        // Back to the state before any unflushed write, newest first...
        for (offset, before, _) in writes.iter().rev() {
            let _ = c.file.write_all_at(before, *offset);
        }
        // ...then replay, oldest first, the writes the cache got out.
        let len = c.file.metadata().map_or(0, |m| m.len());
        for (offset, _, after) in &writes {
            match choose(16) {
                0..=7 => {
                    let _ = c.file.write_all_at(after, *offset);
                }
                8..=11 => report.lost += 1,
                12..=14 => {
                    let sectors = after.len() as u64 / 512;
                    let keep = if sectors > 1 { choose(sectors - 1) + 1 } else { 0 } as usize * 512;
                    let _ = c.file.write_all_at(&after[..keep], *offset);
                    report.torn += 1;
                }
                _ if misdirect_ok => {
                    let to = if choose(2) == 0 { offset.checked_sub(4096) } else { Some(offset + 4096) };
                    if let Some(to) = to.filter(|t| t + after.len() as u64 <= len) {
                        let _ = c.file.write_all_at(after, to);
                        report.misdirected += 1;
                    } else {
                        report.lost += 1;
                    }
                }
                _ => report.lost += 1,
            }
        }
        let _ = c.file.sync_all();
        report
    }
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }
    /// Whether the next write may proceed: `Ok(true)` whole, `Ok(false)` torn.
    fn admit_write(&self) -> Result<bool, ()> {
        if self.is_dead() {
            return Err(());
        }
        if self.writes_left.fetch_sub(1, Ordering::SeqCst) > 0 {
            return Ok(true);
        }
        self.dead.store(true, Ordering::SeqCst);
        if self.torn { Ok(false) } else { Err(()) }
    }
}

fn dead_device() -> std::io::Error {
    std::io::Error::other("device failed (fault injection)")
}

/// What every committer of one group commit is told: shared, since one
/// outcome answers them all.
pub(crate) type CommitReply = Result<CommitInfo, Arc<WorkerError>>;

/// Per request, the crc32c of its bytes (`None` for memory the daemon cannot
/// map) or its failure; the outer error is a batch that could not run.
pub(crate) type PayloadReply = Result<Vec<Result<Option<u32>, IoError>>, IoError>;

pub(crate) enum Job {
    /// First job after open: appends continue at this offset of the active half.
    Resume {
        journal_end: u64,
    },
    /// Hold a buffer for a path: `host` (held), `host_fixed` (its mapping
    /// registered) or `dmabuf_fixed` (the DMA-BUF installed).
    Register(Buffer, PayloadPath, Sender<Result<BufferId, IoError>>),
    Unregister(BufferId, Sender<Result<(), IoError>>),
    /// Payload I/O; the reply has, per request, the crc32c of the bytes
    /// written or read, or its error.
    Io(Vec<IoRequest>, Sender<PayloadReply>),
    /// Encoded records to append to the journal image (durable at the next commit).
    Append(Vec<u8>),
    Commit(Sender<CommitReply>),
    /// Starts the other half with this frame, then points the superblock at it.
    Checkpoint {
        frame: Vec<u8>,
        superblock: Superblock,
        reply: Sender<Result<(), WorkerError>>,
    },
    WriteSuperblock(Superblock, Sender<Result<(), WorkerError>>),
    Stop,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct CommitInfo {
    pub journal_used: u64,
    pub journal_half: u64,
    pub flushes: u64,
    pub commit_groups: u64,
}

pub(crate) struct Worker {
    engine: Engine,
    sb: Superblock,
    image: BufferId,
    image_len: u64,
    end: u64,
    durable_end: u64,
    payload_dirty: bool,
    fault: Option<Arc<FaultPlan>>,
    scratch: Vec<u8>,
    flushes: u64,
    groups: u64,
}

impl Worker {
    /// Reads both superblock copies and, once the caller has chosen one, the
    /// active journal half.
    pub fn open(
        target: Target,
        queue_depth: u32,
        fault: Option<Arc<FaultPlan>>,
    ) -> Result<(Worker, Vec<u8>, Vec<u8>), WorkerError> {
        let mut engine = Engine::new(target, EngineOptions { queue_depth, buffer_slots: 64, ..Default::default() })?;
        let a = engine.read_to_vec(0, SUPERBLOCK_BYTES as u64)?;
        let capacity = engine.geometry().capacity;
        // Copy B sits after the journal, whose size copy A gives. If A is
        // unreadable, try every size `format` can choose (powers of two).
        let b_offsets: Vec<u64> = match Superblock::decode(&a) {
            Ok(sb) => vec![sb.copy_b_offset()],
            Err(_) => super::JOURNAL_HALF_CHOICES.map(|j| SUPERBLOCK_BYTES as u64 + 2 * j).to_vec(),
        };
        let mut b = Vec::new();
        for off in b_offsets.into_iter().filter(|o| o + SUPERBLOCK_BYTES as u64 <= capacity) {
            let bytes = engine.read_to_vec(off, SUPERBLOCK_BYTES as u64)?;
            if Superblock::decode(&bytes).is_ok_and(|sb| sb.copy_b_offset() == off) || b.is_empty() {
                let found = Superblock::decode(&bytes).is_ok();
                b = bytes;
                if found {
                    break;
                }
            }
        }
        let sb = Superblock::decode(&a).or_else(|_| Superblock::decode(&b)).unwrap_or_else(|_| blank_superblock());
        let image = engine.register(Buffer::host(JOURNAL_BLOCK as usize)?)?;
        Ok((
            Worker {
                engine,
                sb,
                image,
                image_len: JOURNAL_BLOCK,
                end: 0,
                durable_end: 0,
                payload_dirty: false,
                fault,
                scratch: Vec::new(),
                flushes: 0,
                groups: 0,
            },
            a,
            b,
        ))
    }

    /// Loads the active journal half of `sb` into the image and returns its bytes.
    pub fn load_journal(&mut self, sb: &Superblock) -> Result<Vec<u8>, WorkerError> {
        self.sb = sb.clone();
        let old = self.image;
        let buffer = Buffer::host(sb.journal_half as usize)?;
        self.image = self.engine.register(buffer)?;
        self.image_len = sb.journal_half;
        let _ = self.engine.remove(old);
        let off = sb.journal_offset(sb.active_half);
        self.io_one(Op::Read, self.image, 0, off, sb.journal_half)
            .map_err(|source| WorkerError::ReadJournal { source })?;
        let mut bytes = vec![0u8; sb.journal_half as usize];
        self.engine.buffer(self.image)?.read_at(0, &mut bytes)?;
        Ok(bytes)
    }

    /// Appends continue at `end` (the last good record); what follows is zeroed.
    pub fn set_journal_end(&mut self, end: u64) -> Result<(), WorkerError> {
        assert!(end <= self.image_len, "journal end {end} beyond the {}-byte image", self.image_len);
        let zeros = vec![0u8; (self.image_len - end) as usize];
        self.engine.buffer(self.image)?.write_at(end, &zeros)?;
        self.end = end;
        // The block holding `end` must be rewritten whole at the next commit.
        self.durable_end = end - end % JOURNAL_BLOCK;
        Ok(())
    }

    pub fn run(mut self, jobs: Receiver<Job>) {
        let mut pending: Vec<Job> = Vec::new();
        loop {
            if pending.is_empty() {
                match jobs.recv() {
                    Ok(j) => pending.push(j),
                    Err(_) => return,
                }
            }
            pending.extend(jobs.try_iter());
            // Group commit: every Commit in this batch of jobs is served by one
            // commit after the batch's other jobs. That is safe: a writer sends
            // its Commit only after its payload I/O and records were queued, so
            // serving it later still covers them (and maybe more).
            let mut commits: Vec<Sender<CommitReply>> = Vec::new();
            for job in std::mem::take(&mut pending) {
                match job {
                    Job::Commit(reply) => commits.push(reply),
                    Job::Stop => {
                        self.finish_commits(&mut commits);
                        return;
                    }
                    job @ (Job::Checkpoint { .. } | Job::WriteSuperblock(..)) => {
                        // These rewrite journal or superblock state: commit first.
                        self.finish_commits(&mut commits);
                        self.handle(job);
                    }
                    other => self.handle(other),
                }
            }
            self.finish_commits(&mut commits);
        }
    }

    fn finish_commits(&mut self, commits: &mut Vec<Sender<CommitReply>>) {
        if commits.is_empty() {
            return;
        }
        // One outcome for every committer of the group: shared, not copied.
        let result = self.commit().map(|_| self.info()).map_err(Arc::new);
        for c in commits.drain(..) {
            let _ = c.send(result.clone());
        }
    }

    fn info(&self) -> CommitInfo {
        CommitInfo {
            journal_used: self.end,
            journal_half: self.image_len,
            flushes: self.flushes,
            commit_groups: self.groups,
        }
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Register(buffer, path, reply) => {
                let _ = reply.send(match path {
                    PayloadPath::Host => self.engine.add(buffer),
                    PayloadPath::HostFixed => self.engine.register(buffer),
                    PayloadPath::DmabufFixed => self.engine.register_dmabuf(buffer),
                });
            }
            Job::Unregister(id, reply) => {
                let _ = reply.send(self.engine.remove(id).map(drop));
            }
            Job::Io(requests, reply) => {
                let _ = reply.send(self.payload(&requests));
            }
            Job::Append(frame) => {
                // Checked: once full (u64::MAX) the journal stays full until a
                // checkpoint; an append never wraps back over live records.
                let end = self.end.checked_add(frame.len() as u64).filter(|e| *e <= self.image_len);
                let written =
                    end.is_some() && self.engine.buffer(self.image).is_ok_and(|b| b.write_at(self.end, &frame).is_ok());
                self.end = match end {
                    Some(e) if written => e,
                    // Reported by the next commit: the journal cannot take it.
                    _ => u64::MAX,
                };
            }
            Job::Checkpoint { frame, superblock, reply } => {
                let _ = reply.send(self.checkpoint(&frame, superblock));
            }
            Job::WriteSuperblock(sb, reply) => {
                let _ = reply.send(self.write_superblock(&sb));
            }
            Job::Commit(_) | Job::Stop | Job::Resume { .. } => {}
        }
    }

    fn flush(&mut self) -> Result<(), WorkerError> {
        if self.fault.as_ref().is_some_and(|f| f.is_dead()) {
            return Err(WorkerError::DeviceDead);
        }
        self.engine.flush().map_err(|source| WorkerError::Flush { source })?;
        if let Some(f) = &self.fault {
            f.flushed();
        }
        self.flushes += 1;
        Ok(())
    }

    /// Flush payload (if any was written) → write the journal tail → flush.
    fn commit(&mut self) -> Result<(), WorkerError> {
        if self.end == u64::MAX {
            return Err(WorkerError::JournalFull { half: self.image_len });
        }
        self.groups += 1;
        if self.payload_dirty {
            self.flush()?;
            self.payload_dirty = false;
        }
        if self.durable_end < self.end {
            let start = self.durable_end - self.durable_end % JOURNAL_BLOCK;
            let stop = self.end.div_ceil(JOURNAL_BLOCK) * JOURNAL_BLOCK;
            // The blocks rewritten lie inside the image and the half: a
            // commit never writes into the other half or the data area.
            assert!(start < stop && stop <= self.image_len, "journal blocks {start}..{stop} outside the half");
            assert!(start.is_multiple_of(JOURNAL_BLOCK) && stop.is_multiple_of(JOURNAL_BLOCK));
            let offset = self.sb.journal_offset(self.sb.active_half) + start;
            self.write_guarded(self.image, start, offset, stop - start)
                .map_err(|source| WorkerError::WriteJournal { offset, source })?;
            self.flush()?;
            self.durable_end = self.end;
        }
        Ok(())
    }

    fn checkpoint(&mut self, frame: &[u8], sb: Superblock) -> Result<(), WorkerError> {
        self.commit()?;
        if frame.len() as u64 + JOURNAL_BLOCK > self.image_len {
            return Err(WorkerError::CheckpointTooLarge { bytes: frame.len() as u64, half: self.image_len });
        }
        // Build the new half in the image: the frame, then zeros.
        let b = self.engine.buffer(self.image)?;
        b.write_at(0, frame)?;
        let zeros = vec![0u8; (self.image_len - frame.len() as u64) as usize];
        b.write_at(frame.len() as u64, &zeros)?;
        let len = (frame.len() as u64).div_ceil(JOURNAL_BLOCK) * JOURNAL_BLOCK + JOURNAL_BLOCK;
        let len = len.min(self.image_len);
        let offset = sb.journal_offset(sb.active_half);
        self.write_guarded(self.image, 0, offset, len)
            .map_err(|source| WorkerError::WriteCheckpoint { offset, source })?;
        self.flush()?;
        self.write_superblock(&sb)?;
        self.end = frame.len() as u64;
        self.durable_end = self.end;
        Ok(())
    }

    /// Copy A, flush, copy B, flush: one valid copy survives any crash.
    fn write_superblock(&mut self, sb: &Superblock) -> Result<(), WorkerError> {
        let bytes = sb.encode();
        let tmp = self.engine.register(Buffer::host(SUPERBLOCK_BYTES)?)?;
        let result = (|| {
            self.engine.buffer(tmp)?.write_at(0, &bytes)?;
            for offset in [0, sb.copy_b_offset()] {
                self.write_guarded(tmp, 0, offset, SUPERBLOCK_BYTES as u64)
                    .map_err(|source| WorkerError::WriteSuperblock { offset, source })?;
                self.flush()?;
            }
            Ok(())
        })();
        let _ = self.engine.remove(tmp);
        if result.is_ok() {
            self.sb = sb.clone();
        }
        result
    }

    /// A write that the fault plan may refuse or tear.
    fn write_guarded(
        &mut self,
        buffer: BufferId,
        buffer_offset: u64,
        target_offset: u64,
        len: u64,
    ) -> Result<(), IoError> {
        let mut len = len;
        if let Some(f) = &self.fault {
            match f.admit_write() {
                Ok(true) => {}
                Ok(false) => {
                    // Torn: the first half (whole blocks) reaches the media.
                    let half = (len / 2) - (len / 2) % JOURNAL_BLOCK.min(len);
                    if half > 0 {
                        let _ = self.io_one(Op::Write, buffer, buffer_offset, target_offset, half);
                    }
                    len = 0;
                }
                Err(()) => len = 0,
            }
        }
        if len == 0 {
            return Err(IoError::Transfer {
                transfer: TransferId(0),
                op: Op::Write,
                offset: target_offset,
                len,
                source: dead_device(),
            });
        }
        if let Some(f) = &self.fault {
            f.before_write(target_offset, len);
        }
        let r = self.io_one(Op::Write, buffer, buffer_offset, target_offset, len);
        if let Some(f) = &self.fault {
            f.after_writes();
        }
        r
    }

    fn io_one(
        &mut self,
        op: Op,
        buffer: BufferId,
        buffer_offset: u64,
        target_offset: u64,
        len: u64,
    ) -> Result<(), IoError> {
        let req = IoRequest {
            transfer: TransferId(0),
            op,
            path: PayloadPath::HostFixed,
            buffer,
            buffer_offset: BufferOffset(buffer_offset),
            target_offset: TargetOffset(target_offset),
            len,
        };
        self.engine.execute_all(&[req]).map(|_| ())
    }

    fn payload(&mut self, requests: &[IoRequest]) -> PayloadReply {
        let mut allowed = Vec::with_capacity(requests.len());
        let mut refused = vec![false; requests.len()];
        for (i, r) in requests.iter().enumerate() {
            let ok = match (&self.fault, r.op) {
                (Some(f), Op::Write) => f.admit_write() == Ok(true),
                (Some(f), _) => !f.is_dead(),
                (None, _) => true,
            };
            if ok {
                allowed.push(*r);
            } else {
                refused[i] = true;
            }
        }
        // Checksums of host memory are taken as each request completes, while
        // the rest of the batch is in flight. A DMA-BUF's wait for the end:
        // its SYNC-bracketed CPU access must not fall inside another transfer.
        if let Some(f) = &self.fault {
            for r in allowed.iter().filter(|r| r.op == Op::Write) {
                f.before_write(r.target_offset.0, r.len);
            }
        }
        let mut early: Vec<Option<Result<Option<u32>, IoError>>> = (0..allowed.len()).map(|_| None).collect();
        let Worker { engine, scratch, .. } = self;
        let done = engine.execute_inspect(&allowed, |i, c, buffer| {
            if let (Ok(()), Some(b)) = (&c.result, buffer)
                && b.dmabuf().is_none()
            {
                early[i] = Some(crc_of(b, &allowed[i], scratch));
            }
        })?;
        if let Some(f) = &self.fault {
            f.after_writes();
        }
        let mut done = done.into_iter().zip(early);
        if requests.iter().any(|r| r.op == Op::Write) {
            self.payload_dirty = true;
        }
        let mut out = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            if refused[i] {
                out.push(Err(IoError::Transfer {
                    transfer: r.transfer,
                    op: r.op,
                    offset: r.target_offset.0,
                    len: r.len,
                    source: dead_device(),
                }));
                continue;
            }
            let Some((c, early)) = done.next() else {
                out.push(Err(IoError::ShortTransfer {
                    transfer: r.transfer,
                    op: r.op,
                    offset: r.target_offset.0,
                    expected: r.len,
                }));
                continue;
            };
            out.push(c.result.and_then(|_| match early {
                Some(crc) => crc,
                None => self.crc(r),
            }));
        }
        Ok(out)
    }

    /// crc32c of the request's buffer range, read with volatile copies (the
    /// memory may be shared with another process; a DMA-BUF's access is
    /// bracketed with DMA_BUF_IOCTL_SYNC). `None` for memory this process
    /// cannot map (device memory): the client's checksum has to do.
    fn crc(&mut self, r: &IoRequest) -> Result<Option<u32>, IoError> {
        let b = self.engine.buffer(r.buffer)?;
        crc_of(b, r, &mut self.scratch)
    }

    pub(super) fn dmabuf_rw(&self) -> crate::io::DmabufRw {
        self.engine.dmabuf_rw().clone()
    }
}

/// crc32c of `r`'s range of `b`, through `scratch` (see [`Worker::crc`]).
fn crc_of(b: &Buffer, r: &IoRequest, scratch: &mut Vec<u8>) -> Result<Option<u32>, IoError> {
    if !b.is_mapped() {
        return Ok(None);
    }
    scratch.resize(r.len as usize, 0);
    b.read_at(r.buffer_offset.0, scratch).map_err(|what| IoError::Buffer { transfer: r.transfer, what })?;
    Ok(Some(crc32c::crc32c(scratch)))
}

fn blank_superblock() -> Superblock {
    Superblock {
        version: 0,
        generation: 0,
        uuid: uuid::Uuid::nil(),
        epoch: 0,
        block_size: 4096,
        slot_size: 1,
        slot_count: 0,
        data_offset: 0,
        journal_half: 1,
        active_half: 0,
        journal_start_seq: 0,
        hmac_key_id: 0,
        hmac_key: [0; 32],
        created_unix: 0,
    }
}
