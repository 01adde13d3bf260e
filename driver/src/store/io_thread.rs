//! The store's one door to its I/O thread ([`super::worker`]): every request
//! is a [`Job`] with a reply channel, sent and awaited by [`IoThread::ask`].
//! It also keeps the one record of which payload path each held buffer was
//! registered for, so that every chunk stored from or loaded into a buffer
//! moves on that path.
//!
//! This module decides nothing about the journal or publications: it carries
//! what the store asks and brings back what the thread answers.

use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::backing::Backing;
use super::error::{StoreError, WorkerError};
use super::storage::Storage;
use super::superblock::{self, Superblock};
use super::worker::{CommitReply, Job, PayloadCounters, PayloadResults, Worker};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{BufferId, DmabufRw, IoRequest, PayloadPath, TargetKind};

/// What the I/O thread read while opening the target.
pub(super) struct Opened {
    /// The superblock copy chosen.
    pub superblock: Superblock,
    /// Why the other copy was not (torn, stale), if it was not.
    pub note: Option<String>,
    /// The active journal half, as read.
    pub journal: Vec<u8>,
}

/// The way to the thread: its job channel, and the records appended since
/// the last job was sent. Appends are carried with the next job (a commit,
/// at the latest) as one, instead of waking the thread once per record; the
/// thread sees every job and every record in the order they were asked for.
struct Jobs {
    tx: Sender<Job>,
    appended: Vec<u8>,
}

/// The handle on a running I/O thread.
pub(super) struct IoThread {
    jobs: Mutex<Jobs>,
    handle: Mutex<Option<JoinHandle<()>>>,
    /// The path each held buffer was registered for.
    paths: Mutex<HashMap<BufferId, PayloadPath>>,
    target_kind: TargetKind,
    dmabuf_rw: DmabufRw,
    counters: Arc<PayloadCounters>,
}

/// Locks `m`, taking the data of a poisoned lock: every value kept behind
/// these locks is whole between statements, so a panic elsewhere leaves it usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl IoThread {
    /// Starts the I/O thread on `backing`: it reads both superblock copies,
    /// chooses one, and reads the active journal half. Appends wait until
    /// [`resume`](Self::resume) says where they continue.
    pub fn start(
        path: &Path,
        backing: Backing,
        queue_depth: u32,
        merge_bytes: u64,
        verify_threads: usize,
        storage: Arc<dyn Storage>,
    ) -> Result<(IoThread, Opened), StoreError> {
        let target_kind = backing.kind();
        let (tx, rx) = channel::<Job>();
        let (otx, orx) = channel::<Result<(Opened, DmabufRw, Arc<PayloadCounters>), StoreError>>();
        let path = path.to_path_buf();
        let handle = std::thread::Builder::new()
            .name("pdstor-store-io".into())
            .spawn(move || {
                let opened = Self::open_on_thread(&path, backing, (queue_depth, merge_bytes, verify_threads), storage);
                let worker = match opened {
                    Ok((worker, opened)) => {
                        let _ = otx.send(Ok((opened, worker.dmabuf_rw(), worker.counters())));
                        worker
                    }
                    Err(e) => {
                        let _ = otx.send(Err(e));
                        return;
                    }
                };
                // After replay the opener says where appends continue; then jobs flow.
                let mut worker = worker;
                if let Ok(Job::Resume { journal_end }) = rx.recv()
                    && worker.set_journal_end(journal_end).is_ok()
                {
                    worker.run(rx);
                }
            })
            .map_err(|e| StoreError::from(WorkerError::Spawn(e)))?;
        let (opened, dmabuf_rw, counters) = orx.recv().map_err(|_| WorkerError::ExitedDuringOpen)??;
        let io = IoThread {
            jobs: Mutex::new(Jobs { tx, appended: Vec::new() }),
            handle: Mutex::new(Some(handle)),
            paths: Mutex::new(HashMap::new()),
            target_kind,
            dmabuf_rw,
            counters,
        };
        Ok((io, opened))
    }

    /// The opening half of the thread's life, on the thread itself.
    fn open_on_thread(
        path: &Path,
        backing: Backing,
        (queue_depth, merge_bytes, verify_threads): (u32, u64, usize),
        storage: Arc<dyn Storage>,
    ) -> Result<(Worker, Opened), StoreError> {
        let (mut worker, a, b) = Worker::open(backing, queue_depth, merge_bytes, verify_threads, storage)?;
        let (superblock, note) = superblock::choose(Superblock::decode(&a), Superblock::decode(&b))
            .map_err(|source| StoreError::Superblock { path: path.into(), source })?;
        let journal = worker.load_journal(&superblock)?;
        Ok((worker, Opened { superblock, note, journal }))
    }

    /// Appends continue at `journal_end` of the active half; jobs flow from now.
    pub fn resume(&self, journal_end: u64) -> Result<(), StoreError> {
        self.send(Job::Resume { journal_end })
    }

    /// Sends `job`, after the records appended since the last one.
    fn send(&self, job: Job) -> Result<(), StoreError> {
        let mut jobs = lock(&self.jobs);
        let gone = |_| StoreError::from(WorkerError::Gone);
        if !jobs.appended.is_empty() {
            let frames = std::mem::take(&mut jobs.appended);
            jobs.tx.send(Job::Append(frames)).map_err(gone)?;
        }
        jobs.tx.send(job).map_err(gone)
    }

    /// Sends the job `make` builds around a reply channel and waits for the
    /// reply: the one request/reply exchange with the thread.
    fn ask<T>(&self, make: impl FnOnce(Sender<T>) -> Job) -> Result<T, StoreError> {
        let (tx, rx) = channel();
        self.send(make(tx))?;
        rx.recv().map_err(|_| StoreError::from(WorkerError::Gone))
    }

    /// Queues an encoded record for the journal image (durable at the next
    /// commit); it reaches the thread with the next job sent.
    pub fn append(&self, frame: &[u8]) {
        lock(&self.jobs).appended.extend_from_slice(frame);
    }

    /// A group commit: the outer error is a thread that is gone, the inner
    /// one a commit that failed (shared by every committer of the group).
    pub fn commit(&self) -> Result<CommitReply, StoreError> {
        self.ask(Job::Commit)
    }

    /// Starts the other journal half with `frame`, then points the superblock at it.
    pub fn checkpoint(&self, frame: Vec<u8>, superblock: Superblock) -> Result<Result<(), WorkerError>, StoreError> {
        self.ask(|reply| Job::Checkpoint { frame, superblock, reply })
    }

    /// Writes both superblock copies, flushing after each.
    pub fn write_superblock(&self, sb: Superblock) -> Result<Result<(), WorkerError>, StoreError> {
        self.ask(|reply| Job::WriteSuperblock(sb, reply))
    }

    /// Hands a buffer to the thread for `path`; refused (nothing held) if
    /// the path cannot take it.
    pub fn register(&self, buffer: Buffer, path: PayloadPath) -> Result<BufferId, StoreError> {
        let id = self.ask(|reply| Job::Register(buffer, path, reply))??;
        lock(&self.paths).insert(id, path);
        Ok(id)
    }

    /// Gives a buffer back.
    pub fn unregister(&self, id: BufferId) -> Result<(), StoreError> {
        self.ask(|reply| Job::Unregister(id, reply))??;
        lock(&self.paths).remove(&id);
        Ok(())
    }

    /// The path a held buffer moves on.
    pub fn buffer_path(&self, id: BufferId) -> Option<PayloadPath> {
        lock(&self.paths).get(&id).copied()
    }

    /// Runs payload requests; per request, the crc32c of the bytes moved
    /// (`None` for memory the daemon cannot map) or its failure.
    pub fn payload(&self, requests: Vec<IoRequest>) -> Result<PayloadResults, StoreError> {
        Ok(self.ask(|reply| Job::Io(requests, reply))??)
    }

    /// Payload chunks moved so far, the device commands they took and the
    /// submissions those went in.
    pub fn payload_counts(&self) -> (u64, u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.counters;
        (c.chunks.load(Relaxed), c.commands.load(Relaxed), c.submissions.load(Relaxed))
    }

    /// What kind of target the thread drives.
    pub fn target_kind(&self) -> TargetKind {
        self.target_kind
    }

    /// Whether the kernel has the rw-dmabuf io_uring UAPI.
    pub fn dmabuf_rw(&self) -> &DmabufRw {
        &self.dmabuf_rw
    }

    /// Commits what is queued (unless `commit` is false: a failed store
    /// commits nothing more), then stops the thread and waits for it.
    pub fn stop(&self, commit: bool) {
        if commit {
            let _ = self.commit();
        }
        let _ = self.send(Job::Stop);
        if let Some(h) = lock(&self.handle).take() {
            let _ = h.join();
        }
    }
}
