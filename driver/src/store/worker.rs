//! The store's I/O thread. It owns the [`Device`] (the engine, which must
//! stay on one thread, or memory), the in-memory image of the active
//! journal half, and the device flushes. Group commit: every `Commit`
//! waiting in the queue when the thread gets to one is served by a single
//! "flush payload → write journal tail → flush" sequence, so concurrent
//! publishers share flushes.
//!
//! Every payload batch, metadata write and flush goes through the
//! [`Storage`] it was opened on: the device itself, or a simulated faulty one
//! (`super::storage`).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{BufferId, Completion, IoError, IoRequest, Op, PayloadPath};

use super::backing::Backing;
use super::coalesce::{Run, coalesce};
use super::device::{Device, request};
use super::error::WorkerError;
use super::storage::{Storage, read_to_vec};
use super::superblock::{SUPERBLOCK_BYTES, Superblock};
pub(crate) use super::verifier::PayloadResults;
use super::verifier::{Verifier, crc_of};

/// A chunk's checksum taken as its command completed, if one was.
type EarlyCrc = Option<Result<Option<u32>, IoError>>;

/// Journal writes are whole 4 KiB blocks (every target here accepts that).
pub const JOURNAL_BLOCK: u64 = 4096;

/// Entries in the engine's registered-buffer table, shared by every
/// connection's buffers: one per buffer, one per GiB of a larger one
/// (io_uring allows 16,384; an empty entry costs the kernel a pointer).
const BUFFER_TABLE: u32 = 1024;

/// What every committer of one group commit is told: shared, since one
/// outcome answers them all.
pub(crate) type CommitReply = Result<CommitInfo, Arc<WorkerError>>;

/// [`PayloadResults`], or the error of a batch that could not run.
pub(crate) type PayloadReply = Result<PayloadResults, IoError>;

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

/// Payload chunks the I/O thread moved, the device commands it moved them
/// in (fewer where back-to-back chunks were merged, [`coalesce`]) and the
/// submissions those went in (fewer where jobs queued together were run
/// together). Shared with the store, which reports them.
#[derive(Debug, Default)]
pub(crate) struct PayloadCounters {
    pub chunks: std::sync::atomic::AtomicU64,
    pub commands: std::sync::atomic::AtomicU64,
    pub submissions: std::sync::atomic::AtomicU64,
}

/// What the last commit left: journal use and how often the device was flushed.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitInfo {
    /// Bytes of the active journal half in use.
    pub journal_used: u64,
    /// The half's size.
    pub journal_half: u64,
    /// Device flushes so far.
    pub flushes: u64,
    /// Flushes not issued: the device has no volatile write cache.
    pub flushes_elided: u64,
    /// Group commits so far.
    pub commit_groups: u64,
}

pub(crate) struct Worker {
    device: Box<dyn Device>,
    sb: Superblock,
    image: BufferId,
    image_len: u64,
    end: u64,
    durable_end: u64,
    payload_dirty: bool,
    storage: Arc<dyn Storage>,
    verifier: Verifier,
    /// Back-to-back chunks up to this many bytes are one command ([`coalesce`]).
    merge_bytes: u64,
    counters: Arc<PayloadCounters>,
    groups: u64,
}

impl Worker {
    /// Reads both superblock copies and, once the caller has chosen one, the
    /// active journal half.
    pub fn open(
        backing: Backing,
        queue_depth: u32,
        merge_bytes: u64,
        verify_threads: usize,
        storage: Arc<dyn Storage>,
    ) -> Result<(Worker, Vec<u8>, Vec<u8>), WorkerError> {
        let mut device = backing.open(queue_depth, BUFFER_TABLE)?;
        let a = read_to_vec(&*storage, &mut *device, 0, SUPERBLOCK_BYTES as u64)?;
        let capacity = device.capacity();
        // Copy B sits after the journal, whose size copy A gives. If A is
        // unreadable, try every size `format` can choose (powers of two).
        let b_offsets: Vec<u64> = match Superblock::decode(&a) {
            Ok(sb) => vec![sb.copy_b_offset()],
            Err(_) => super::JOURNAL_HALF_CHOICES.map(|j| SUPERBLOCK_BYTES as u64 + 2 * j).to_vec(),
        };
        let mut b = Vec::new();
        for off in b_offsets.into_iter().filter(|o| o + SUPERBLOCK_BYTES as u64 <= capacity) {
            let bytes = read_to_vec(&*storage, &mut *device, off, SUPERBLOCK_BYTES as u64)?;
            if Superblock::decode(&bytes).is_ok_and(|sb| sb.copy_b_offset() == off) || b.is_empty() {
                let found = Superblock::decode(&bytes).is_ok();
                b = bytes;
                if found {
                    break;
                }
            }
        }
        let sb = Superblock::decode(&a).or_else(|_| Superblock::decode(&b)).unwrap_or_else(|_| blank_superblock());
        let image = device.register(Buffer::host(JOURNAL_BLOCK as usize)?)?;
        Ok((
            Worker {
                device,
                sb,
                image,
                image_len: JOURNAL_BLOCK,
                end: 0,
                durable_end: 0,
                payload_dirty: false,
                storage,
                verifier: Verifier::new(verify_threads),
                merge_bytes,
                counters: Arc::default(),
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
        self.image = self.device.register(buffer)?;
        self.image_len = sb.journal_half;
        let _ = self.device.remove(old);
        let off = sb.journal_offset(sb.active_half);
        let read = request(Op::Read, self.image, 0, off, sb.journal_half);
        self.storage.read(&mut *self.device, read).map_err(|source| WorkerError::ReadJournal { source })?;
        let mut bytes = vec![0u8; sb.journal_half as usize];
        self.device.buffer(self.image)?.read_at(0, &mut bytes)?;
        Ok(bytes)
    }

    /// Appends continue at `end` (the last good record); what follows is zeroed.
    pub fn set_journal_end(&mut self, end: u64) -> Result<(), WorkerError> {
        assert!(end <= self.image_len, "journal end {end} beyond the {}-byte image", self.image_len);
        let zeros = vec![0u8; (self.image_len - end) as usize];
        self.device.buffer(self.image)?.write_at(end, &zeros)?;
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
            // Payload jobs queued back to back (stores and loads of several
            // connections at once) go to the device as one submission.
            let mut io: Vec<(Vec<IoRequest>, Sender<PayloadReply>)> = Vec::new();
            for job in std::mem::take(&mut pending) {
                if let Job::Io(requests, reply) = job {
                    io.push((requests, reply));
                    continue;
                }
                self.payload_together(std::mem::take(&mut io));
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
            self.payload_together(io);
            self.finish_commits(&mut commits);
        }
    }

    /// Runs the payload jobs as one submission and answers each its own
    /// results. Should that submission fail as a whole (one job's request
    /// refused before anything ran, say), each job runs again alone, so one
    /// client's bad request fails only its own job: a write or read done
    /// twice moves the same bytes to the same place.
    fn payload_together(&mut self, jobs: Vec<(Vec<IoRequest>, Sender<PayloadReply>)>) {
        if jobs.len() < 2 {
            for (requests, reply) in jobs {
                let _ = reply.send(self.payload(&requests));
            }
            return;
        }
        let all: Vec<IoRequest> = jobs.iter().flat_map(|(r, _)| r.iter().copied()).collect();
        match self.payload(&all) {
            Ok(results) => {
                let mut results = results.into_iter();
                for (requests, reply) in jobs {
                    let _ = reply.send(Ok(results.by_ref().take(requests.len()).collect()));
                }
            }
            Err(_) => {
                for (requests, reply) in jobs {
                    let _ = reply.send(self.payload(&requests));
                }
            }
        }
    }

    /// Holds `buffer` for `host_fixed`, as a `Register` job does.
    #[cfg(test)]
    pub(super) fn register_for_test(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        self.device.register(buffer)
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
            flushes: self.device.flushes().0,
            flushes_elided: self.device.flushes().1,
            commit_groups: self.groups,
        }
    }

    fn handle(&mut self, job: Job) {
        match job {
            Job::Register(buffer, path, reply) => {
                let _ = reply.send(match path {
                    PayloadPath::Host => self.device.add(buffer),
                    PayloadPath::HostFixed => self.device.register(buffer),
                    PayloadPath::DmabufFixed => self.device.register_dmabuf(buffer),
                });
            }
            Job::Unregister(id, reply) => {
                let _ = reply.send(self.device.remove(id).map(drop));
            }
            Job::Io(requests, reply) => {
                let _ = reply.send(self.payload(&requests));
            }
            Job::Append(frame) => {
                // Checked: once full (u64::MAX) the journal stays full until a
                // checkpoint; an append never wraps back over live records.
                let end = self.end.checked_add(frame.len() as u64).filter(|e| *e <= self.image_len);
                let written =
                    end.is_some() && self.device.buffer(self.image).is_ok_and(|b| b.write_at(self.end, &frame).is_ok());
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
        self.storage.flush(&mut *self.device)
    }

    /// Flush payload (if any was written) → write the journal tail with
    /// Force Unit Access: one flush per group commit, none for a commit that
    /// wrote no payload.
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
            self.write_guarded(Op::WriteFua, self.image, start, offset, stop - start)
                .map_err(|source| WorkerError::WriteJournal { offset, source })?;
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
        let b = self.device.buffer(self.image)?;
        b.write_at(0, frame)?;
        let zeros = vec![0u8; (self.image_len - frame.len() as u64) as usize];
        b.write_at(frame.len() as u64, &zeros)?;
        let len = (frame.len() as u64).div_ceil(JOURNAL_BLOCK) * JOURNAL_BLOCK + JOURNAL_BLOCK;
        let len = len.min(self.image_len);
        let offset = sb.journal_offset(sb.active_half);
        self.write_guarded(Op::Write, self.image, 0, offset, len)
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
        let tmp = self.device.register(Buffer::host(SUPERBLOCK_BYTES)?)?;
        let result = (|| {
            self.device.buffer(tmp)?.write_at(0, &bytes)?;
            for offset in [0, sb.copy_b_offset()] {
                self.write_guarded(Op::Write, tmp, 0, offset, SUPERBLOCK_BYTES as u64)
                    .map_err(|source| WorkerError::WriteSuperblock { offset, source })?;
                self.flush()?;
            }
            Ok(())
        })();
        let _ = self.device.remove(tmp);
        if result.is_ok() {
            self.sb = sb.clone();
        }
        result
    }

    /// A metadata write, through the storage.
    fn write_guarded(
        &mut self,
        op: Op,
        buffer: BufferId,
        buffer_offset: u64,
        target_offset: u64,
        len: u64,
    ) -> Result<(), IoError> {
        self.storage.write(&mut *self.device, request(op, buffer, buffer_offset, target_offset, len))
    }

    fn payload(&mut self, requests: &[IoRequest]) -> PayloadReply {
        // Back-to-back small chunks go to the device as one command each run
        // (`coalesce`); each chunk keeps its own checksum and result.
        let runs = coalesce(requests, self.merge_bytes);
        let submitted: Vec<IoRequest> = runs.iter().map(|run| run.request).collect();
        self.counters.chunks.fetch_add(requests.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.counters.commands.fetch_add(submitted.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.counters.submissions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (done, early) = self.execute_checksummed(requests, &runs, &submitted);
        let done = done?;
        if requests.iter().any(|r| r.op.writes()) {
            self.payload_dirty = true;
        }
        let mut done = split_runs(&runs, requests, done).into_iter().zip(early);
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            let Some((Some(result), early)) = done.next() else {
                out.push(Err(IoError::ShortTransfer {
                    transfer: r.transfer,
                    op: r.op,
                    offset: r.target_offset.0,
                    expected: r.len,
                }));
                continue;
            };
            out.push(result.and_then(|_| match early {
                Some(crc) => crc,
                None => self.crc(r),
            }));
        }
        Ok(out)
    }

    /// Runs the commands, checksumming each chunk as its command completes:
    /// host memory while the rest of the batch is in flight (a DMA-BUF waits
    /// for the end: its SYNC-bracketed CPU access must not fall inside
    /// another transfer). Answers the completions and, per chunk, its early
    /// checksum where one was taken.
    fn execute_checksummed(
        &mut self,
        requests: &[IoRequest],
        runs: &[Run],
        submitted: &[IoRequest],
    ) -> (Result<Vec<Completion>, IoError>, Vec<EarlyCrc>) {
        let mut early: Vec<EarlyCrc> = (0..requests.len()).map(|_| None).collect();
        // The large requests of a batch are checksummed on the verifier
        // pool, on other cores, while this thread keeps the ring full (and a
        // lone large one, cut into pieces checksummed at once); the rest
        // here, where a hand-off costs more than the checksum.
        let shared: Vec<Option<Arc<Buffer>>> = submitted
            .iter()
            .map(|r| {
                // A lone command only when it is large enough to spread.
                (r.len >= Verifier::MIN_LEN && (submitted.len() > 1 || r.len >= 2 * Verifier::PIECE))
                    .then(|| self.device.shared_buffer(r.buffer).ok())
                    .flatten()
                    .filter(|b| super::verifier::checked_here(b, r.op) && b.dmabuf().is_none())
            })
            .collect();
        let Worker { device, verifier, storage, .. } = self;
        let mut handed = 0usize;
        let done = storage.payload(&mut **device, submitted, &mut |i, c, buffer| {
            if let (Ok(()), Some(b)) = (&c.result, buffer)
                && b.dmabuf().is_none()
            {
                let parts = runs[i].parts.clone();
                match &shared[i] {
                    Some(b) if verifier.submit(parts.start, Arc::clone(b), requests[parts.clone()].to_vec()) => {
                        handed += 1
                    }
                    _ => {
                        for k in parts {
                            early[k] = Some(crc_of(b, &requests[k]));
                        }
                    }
                }
            }
        });
        // Every hand-off is collected before anything returns, so no result
        // is left for a later batch. One the pool never answered (its
        // threads died) is checksummed by the caller.
        if handed > 0 {
            for (k, crc) in verifier.collect() {
                early[k] = Some(crc);
            }
        }
        (done, early)
    }

    /// crc32c of the request's buffer range, in place in the mapping (a
    /// client's memory, shared; a DMA-BUF's access is bracketed with
    /// DMA_BUF_IOCTL_SYNC) once its transfer has completed. `None` for memory
    /// this process cannot map (device memory): the client's checksum has to
    /// do.
    fn crc(&mut self, r: &IoRequest) -> Result<Option<u32>, IoError> {
        let b = self.device.buffer(r.buffer)?;
        crc_of(b, r)
    }

    pub(super) fn counters(&self) -> Arc<PayloadCounters> {
        Arc::clone(&self.counters)
    }

    pub(super) fn dmabuf_rw(&self) -> pdstor_engine::io::DmabufRw {
        self.device.dmabuf_rw()
    }
}

/// Each chunk's outcome from its run's completion, in batch order: the run's
/// own for every chunk of a run that moved; for a run that failed, its error
/// for the first chunk and one naming the run for each chunk after it.
/// `None` for a chunk whose run never completed.
fn split_runs(runs: &[Run], batch: &[IoRequest], done: Vec<Completion>) -> Vec<Option<Result<(), IoError>>> {
    let mut out: Vec<Option<Result<(), IoError>>> = (0..batch.len()).map(|_| None).collect();
    for (run, c) in runs.iter().zip(done) {
        match c.result {
            Ok(()) => run.parts.clone().for_each(|k| out[k] = Some(Ok(()))),
            Err(e) => {
                let why = format!(
                    "it went to the device in one command with {} other chunk(s) (from {}, {} bytes at target offset {}), which failed: {e}",
                    run.parts.len() - 1,
                    run.request.transfer,
                    run.request.len,
                    run.request.target_offset.0
                );
                for k in run.parts.clone().skip(1) {
                    let r = &batch[k];
                    out[k] = Some(Err(IoError::Transfer {
                        transfer: r.transfer,
                        op: r.op,
                        offset: r.target_offset.0,
                        len: r.len,
                        source: std::io::Error::other(why.clone()),
                    }));
                }
                out[run.parts.start] = Some(Err(e));
            }
        }
    }
    out
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
        owner_key: 0,
    }
}
