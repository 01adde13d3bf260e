//! The payload verifiers: a pool of threads that checksum completed
//! requests' buffer ranges while the I/O thread submits and reaps the rest
//! of the batch. A large chunk is cut into pieces checksummed on several
//! threads at once and combined (`crc(a ‖ b) = shift(crc(a), |b|) ^ crc(b)`),
//! so one 8 MiB chunk uses every verifier, not one.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};

use pdstor_engine::buffer::Buffer;
use pdstor_engine::crc32c;
use pdstor_engine::io::{BufferOffset, IoError, IoRequest, Op};

/// Per request, the crc32c of its bytes (`None` for memory the daemon cannot
/// map) or its failure.
pub(crate) type PayloadResults = Vec<Result<Option<u32>, IoError>>;

type Crc = Result<Option<u32>, IoError>;

/// Pieces checksummed by one thread in turn: each a request's batch index,
/// the piece's place among the request's pieces, and the piece as a
/// request. One piece of a large request, or several small requests whole.
struct Job {
    buffer: Arc<Buffer>,
    pieces: Vec<(usize, usize, IoRequest)>,
}

/// A piece's checksum, with where it belongs.
struct Done {
    index: usize,
    piece: usize,
    len: u64,
    crc: Crc,
}

/// The verifier threads, started at first use; if none can start, or all
/// die, checksums run on the I/O thread as before.
pub(super) struct Verifier {
    threads: usize,
    running: Option<Pool>,
    failed: bool,
    /// The requests handed out and not yet collected.
    pending: Vec<Pending>,
}

/// A request handed out: its batch index and, per piece, its length and
/// checksum once answered.
struct Pending {
    index: usize,
    pieces: Vec<Option<(u64, Crc)>>,
}

struct Pool {
    jobs: Sender<Job>,
    results: Receiver<Done>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Verifier {
    /// Requests shorter than this are checksummed on the I/O thread.
    pub(super) const MIN_LEN: u64 = 256 << 10;
    /// A request is cut into pieces of about this size, one per thread at
    /// most: big enough that handing one over costs nothing beside its
    /// checksum (about 30 µs of a core), small enough to spread a chunk.
    pub(super) const PIECE: u64 = 1 << 20;

    /// A pool of `threads` verifiers (0: one per CPU this process may run
    /// on), started at first use. Chooses the CRC-32C implementation now
    /// (a measurement of a fraction of a millisecond), not in the first load.
    pub(super) fn new(threads: usize) -> Verifier {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let crc = crc32c::chosen();
        tracing::info!(threads, crc32c = crc.imp.name(), chosen_by = crc.by, "payload verifiers");
        Verifier { threads, running: None, failed: false, pending: Vec::new() }
    }

    /// Hands the completed requests (in `buffer`, the first at batch index
    /// `first`) to the pool, each cut into pieces; false if there is no pool
    /// to take them (the caller checksums them itself).
    pub(super) fn submit(&mut self, first: usize, buffer: Arc<Buffer>, requests: Vec<IoRequest>) -> bool {
        if self.running.is_none() && !self.failed {
            self.running = Pool::start(self.threads);
            self.failed = self.running.is_none();
        }
        let Some(pool) = &self.running else { return false };
        let mut jobs = Vec::new();
        let mut small = Job { buffer: Arc::clone(&buffer), pieces: Vec::new() };
        let mut small_bytes = 0;
        for (index, r) in (first..).zip(requests) {
            let pieces = pieces(&r, self.threads);
            self.pending.push(Pending { index, pieces: (0..pieces.len()).map(|_| None).collect() });
            if let [whole] = pieces[..] {
                // Small requests go together, a piece's worth to a job.
                small_bytes += whole.len;
                small.pieces.push((index, 0, whole));
                if small_bytes >= Self::PIECE {
                    jobs.push(std::mem::replace(&mut small, Job { buffer: Arc::clone(&buffer), pieces: Vec::new() }));
                    small_bytes = 0;
                }
            } else {
                for (piece, range) in pieces.into_iter().enumerate() {
                    jobs.push(Job { buffer: Arc::clone(&buffer), pieces: vec![(index, piece, range)] });
                }
            }
        }
        if !small.pieces.is_empty() {
            jobs.push(small);
        }
        for job in jobs {
            if pool.jobs.send(job).is_err() {
                // Every thread is gone. What was handed out is never
                // answered: `collect` leaves it to the caller.
                self.running = None;
                self.failed = true;
                break;
            }
        }
        true
    }

    /// Every handed-out request's checksum, by batch index, once all its
    /// pieces are answered. Requests a dead pool never answered are left out:
    /// the caller checksums those itself.
    pub(super) fn collect(&mut self) -> Vec<(usize, Crc)> {
        let mut missing: usize = self.pending.iter().map(|p| p.pieces.len()).sum();
        while missing > 0 {
            let Some(done) = self.running.as_ref().and_then(|p| p.results.recv().ok()) else {
                self.running = None;
                self.failed = true;
                break;
            };
            if let Some(p) = self.pending.iter_mut().find(|p| p.index == done.index)
                && let Some(slot) = p.pieces.get_mut(done.piece)
                && slot.is_none()
            {
                *slot = Some((done.len, done.crc));
                missing -= 1;
            }
        }
        std::mem::take(&mut self.pending)
            .into_iter()
            .filter_map(|p| {
                // One unanswered (a dead pool): the caller's.
                let pieces: Option<Vec<(u64, Crc)>> = p.pieces.into_iter().collect();
                pieces.map(|pieces| (p.index, combined(pieces)))
            })
            .collect()
    }
}

/// `r` cut into at most `threads` pieces of at least [`Verifier::PIECE`]
/// bytes, in order (one piece: `r` itself).
fn pieces(r: &IoRequest, threads: usize) -> Vec<IoRequest> {
    let count = (r.len / Verifier::PIECE).clamp(1, threads.max(1) as u64);
    let size = r.len.div_ceil(count);
    (0..count)
        .map(|i| i * size)
        .take_while(|&at| at < r.len || (at == 0 && r.len == 0))
        .map(|at| IoRequest { buffer_offset: BufferOffset(r.buffer_offset.0 + at), len: size.min(r.len - at), ..*r })
        .collect()
}

/// A request's checksum from its pieces' (in order): the first failure, or
/// `None` if any piece's memory is not readable here, else their combination.
fn combined(pieces: Vec<(u64, Crc)>) -> Crc {
    let mut pieces = pieces.into_iter();
    let Some((_, first)) = pieces.next() else { return Ok(None) };
    let Some(mut crc) = first? else { return Ok(None) };
    for (len, piece) in pieces {
        let Some(c) = piece? else { return Ok(None) };
        crc = crc32c::gf2::combine(crc, c, len);
    }
    Ok(Some(crc))
}

impl Pool {
    fn start(threads: usize) -> Option<Pool> {
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let (tx, results) = std::sync::mpsc::channel();
        let handles: Vec<_> = (0..threads.max(1))
            .filter_map(|n| {
                let (rx, tx) = (Arc::clone(&rx), tx.clone());
                std::thread::Builder::new().name(format!("pdstor-verify{n}")).spawn(move || verify(&rx, &tx)).ok()
            })
            .collect();
        (!handles.is_empty()).then_some(Pool { jobs, results, handles })
    }
}

/// A verifier thread: takes jobs until the job channel closes, and answers
/// every piece of each, a panic included (as that piece's failure: a piece
/// never answered would hold the I/O thread for ever).
fn verify(jobs: &Mutex<Receiver<Job>>, results: &Sender<Done>) {
    loop {
        // The lock is held only to take one job, never while checksumming.
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(Job { buffer, pieces }) = job else { return };
        let ranges: Vec<IoRequest> = pieces.iter().map(|(_, _, r)| *r).collect();
        let crcs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let crcs: Vec<Crc> = ranges.iter().map(|r| crc_of(&buffer, r)).collect();
            // Let go of the buffer before answering: the I/O thread may
            // unregister it as soon as the batch is answered.
            drop(buffer);
            crcs
        }));
        let crcs: Vec<Crc> = match crcs {
            Ok(crcs) => crcs,
            Err(_) => pieces.iter().map(|(_, _, r)| Err(panicked(r))).collect(),
        };
        for ((index, piece, range), crc) in pieces.into_iter().zip(crcs) {
            if results.send(Done { index, piece, len: range.len, crc }).is_err() {
                return;
            }
        }
    }
}

/// The failure a piece whose checksum panicked answers.
fn panicked(r: &IoRequest) -> IoError {
    IoError::Transfer {
        transfer: r.transfer,
        op: r.op,
        offset: r.target_offset.0,
        len: r.len,
        source: std::io::Error::other(
            "the payload verifier panicked checksumming this range (a pdstor bug: report it)",
        ),
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Closing the job channel ends every thread's loop.
        let (closed, _) = std::sync::mpsc::channel();
        drop(std::mem::replace(&mut self.jobs, closed));
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// crc32c of `r`'s range of `b`, in place in the daemon's mapping of it
/// (see [`Worker::crc`]); `None` where the client's checksum stands instead:
/// a store from a DMA-BUF the daemon cannot map (the store's declared
/// crc32c), a load into one or into a buffer registered unchecked (chunks
/// answered `unverified`, which the reader checks itself). A store from or
/// a load into a shm file is checked in place with a shrink caught
/// ([`Buffer::stores_checksummed_here`], [`Buffer::loads_checksummed_here`]).
pub(super) fn crc_of(b: &Buffer, r: &IoRequest) -> Result<Option<u32>, IoError> {
    if !checked_here(b, r.op) {
        return Ok(None);
    }
    b.crc32c(r.buffer_offset.0, r.len as usize).map(Some).map_err(|what| IoError::Buffer { transfer: r.transfer, what })
}

/// Whether the daemon checksums a transfer of `op` with `b` (see [`crc_of`]).
pub(super) fn checked_here(b: &Buffer, op: Op) -> bool {
    match op {
        Op::Read => b.loads_checksummed_here(),
        _ => b.stores_checksummed_here(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdstor_engine::io::{BufferId, Op, PayloadPath, TargetOffset, TransferId};

    fn request(chunk: u32, offset: u64, len: u64) -> IoRequest {
        IoRequest {
            transfer: TransferId::chunk(7, chunk),
            op: Op::Read,
            path: PayloadPath::HostFixed,
            buffer: BufferId(1),
            buffer_offset: BufferOffset(offset),
            target_offset: TargetOffset(0),
            len,
        }
    }

    #[test]
    fn a_request_is_cut_into_contiguous_pieces_one_per_thread_at_most() {
        let cut = |len: u64, threads: usize| -> Vec<(u64, u64)> {
            pieces(&request(0, 4096, len), threads).iter().map(|p| (p.buffer_offset.0, p.len)).collect()
        };
        assert_eq!(cut(8 << 20, 2), [(4096, 4 << 20), (4096 + (4 << 20), 4 << 20)]);
        assert_eq!(cut(8 << 20, 1), [(4096, 8 << 20)]);
        assert_eq!(cut(3 << 20, 16), [(4096, 1 << 20), (4096 + (1 << 20), 1 << 20), (4096 + (2 << 20), 1 << 20)]);
        assert_eq!(cut(300 << 10, 8), [(4096, 300 << 10)]);
        let odd = cut((8 << 20) + 1, 3);
        assert_eq!(odd.len(), 3);
        assert_eq!(odd.iter().map(|p| p.1).sum::<u64>(), (8 << 20) + 1);
        assert!(odd.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "{odd:?}");
    }

    #[test]
    fn the_pool_answers_every_request_by_its_batch_index_as_one_thread_would() {
        let len = (9 << 20) + 4097;
        let fill: Vec<u8> = (0..len as u64).map(|i| (i.wrapping_mul(0x9e37_79b9) >> 11) as u8).collect();
        let buffer = Arc::new(Buffer::host(len).unwrap());
        buffer.write_at(0, &fill).unwrap();
        let ranges = [(0u64, 8u64 << 20), (8 << 20, (1 << 20) + 4097), (17, 256 << 10), (5, (3 << 20) + 1)];
        let want: Vec<u32> =
            ranges.iter().map(|&(o, l)| crc32c::checksum(&fill[o as usize..(o + l) as usize])).collect();
        // The crc32c crate, independently of the chosen implementation.
        assert_eq!(want[0], ::crc32c::crc32c(&fill[..8 << 20]));
        for threads in [1, 2, 4] {
            let mut v = Verifier::new(threads);
            let requests: Vec<IoRequest> =
                ranges.iter().enumerate().map(|(i, &(o, l))| request(i as u32, o, l)).collect();
            assert!(v.submit(10, Arc::clone(&buffer), requests[..2].to_vec()));
            assert!(v.submit(12, Arc::clone(&buffer), requests[2..].to_vec()));
            let mut got = v.collect();
            got.sort_by_key(|(k, _)| *k);
            let got: Vec<(usize, Option<u32>)> = got.into_iter().map(|(k, c)| (k, c.unwrap())).collect();
            let expected: Vec<(usize, Option<u32>)> = (10..).zip(want.iter().map(|&c| Some(c))).collect();
            assert_eq!(got, expected, "{threads} threads");
            assert!(v.collect().is_empty(), "nothing is answered twice");
        }
    }

    #[test]
    fn a_request_with_a_piece_never_answered_is_left_to_the_caller() {
        let mut v = Verifier::new(2);
        let whole = || Some((4096, Ok(Some(0x1234))));
        v.pending.push(Pending { index: 3, pieces: vec![whole(), None] });
        v.pending.push(Pending { index: 4, pieces: vec![None] });
        v.pending.push(Pending { index: 5, pieces: vec![whole()] });
        // No pool runs: nothing more comes; only the whole answer is kept.
        let got: Vec<(usize, Option<u32>)> = v.collect().into_iter().map(|(k, c)| (k, c.unwrap())).collect();
        assert_eq!(got, [(5, Some(0x1234))]);
    }

    #[test]
    fn an_unchecked_buffer_skips_the_checks_of_loads_only() {
        let mut b = Buffer::host(8192).unwrap();
        b.write_at(0, &[7u8; 8192]).unwrap();
        b.skip_load_checks();
        let mut r = request(0, 0, 8192);
        assert_eq!(crc_of(&b, &r).unwrap(), None, "a load into it: checked by nobody");
        r.op = Op::Write;
        assert_eq!(crc_of(&b, &r).unwrap(), Some(crc32c::checksum(&[7u8; 8192])), "a store from it: checked");
    }
}
