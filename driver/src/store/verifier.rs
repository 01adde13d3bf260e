//! The payload verifier: a thread that checksums completed requests' buffer
//! ranges while the I/O thread submits and reaps the rest of the batch.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};

use crate::buffer::Buffer;
use crate::io::{IoError, IoRequest};

/// Per request, the crc32c of its bytes (`None` for memory the daemon cannot
/// map) or its failure.
pub(crate) type PayloadResults = Vec<Result<Option<u32>, IoError>>;

/// A thread that checksums completed requests' buffer ranges while the I/O
/// thread submits and reaps the rest of the batch: on the I/O thread, each
/// checksum would hold back the next submissions and completions instead of
/// overlapping them. Started at first use; if it cannot start, or dies,
/// checksums run on the I/O thread as before.
#[derive(Default)]
pub(super) struct Verifier {
    running: Option<VerifierThread>,
    failed: bool,
}

struct VerifierThread {
    jobs: Sender<(usize, Arc<Buffer>, Vec<IoRequest>)>,
    results: Receiver<(usize, PayloadResults)>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Verifier {
    /// Requests shorter than this are checksummed on the I/O thread.
    pub(super) const MIN_LEN: u64 = 256 << 10;

    /// Hands the chunks of a completed run (in `buffer`, the first at batch
    /// index `first`) to the thread; false if there is no thread to take them.
    pub(super) fn submit(&mut self, first: usize, buffer: Arc<Buffer>, chunks: Vec<IoRequest>) -> bool {
        if self.running.is_none() && !self.failed {
            self.running = VerifierThread::start();
            self.failed = self.running.is_none();
        }
        self.running.as_ref().is_some_and(|t| t.jobs.send((first, buffer, chunks)).is_ok())
    }

    /// The next run's checksums (with its first batch index), in completion
    /// order; `None` if the thread is gone.
    pub(super) fn result(&mut self) -> Option<(usize, PayloadResults)> {
        let got = self.running.as_ref()?.results.recv().ok();
        if got.is_none() {
            self.running = None;
            self.failed = true;
        }
        got
    }
}

impl VerifierThread {
    fn start() -> Option<VerifierThread> {
        let (jobs, rx) = std::sync::mpsc::channel::<(usize, Arc<Buffer>, Vec<IoRequest>)>();
        let (tx, results) = std::sync::mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("pdstor-verify".into())
            .spawn(move || {
                for (first, b, chunks) in rx {
                    let crcs = chunks.iter().map(|r| crc_of(&b, r)).collect();
                    // Let go of the buffer before answering: the I/O thread
                    // may unregister it as soon as the batch is answered.
                    drop(b);
                    if tx.send((first, crcs)).is_err() {
                        return;
                    }
                }
            })
            .ok()?;
        Some(VerifierThread { jobs, results, handle: Some(handle) })
    }
}

impl Drop for VerifierThread {
    fn drop(&mut self) {
        // Closing the job channel ends the thread's loop.
        let (closed, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// crc32c of `r`'s range of `b`, in place in the daemon's mapping of it
/// (see [`Worker::crc`]); `None` for memory the daemon does not read — a
/// DMA-BUF it cannot map, a shm file its owner may shrink — whose
/// checksums come from the client (a store's declared crc32c; a load's
/// chunks answered `unverified`, which the reader checks itself).
pub(super) fn crc_of(b: &Buffer, r: &IoRequest) -> Result<Option<u32>, IoError> {
    if !b.checksummed_in_place() {
        return Ok(None);
    }
    b.crc32c(r.buffer_offset.0, r.len as usize).map(Some).map_err(|what| IoError::Buffer { transfer: r.transfer, what })
}
