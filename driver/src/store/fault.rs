//! Fault injection for the crash-consistency harnesses. A [`FaultPlan`] makes
//! the device die after a given number of writes: later writes and flushes
//! fail, and the first failing write may be torn (half of it reaches the
//! media). A simulated plan ([`FaultPlan::simulated`]) also models the
//! device's volatile write cache: it remembers every write since the last
//! flush, and a power loss ([`FaultPlan::power_loss`]) loses, tears or
//! misdirects any of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use super::device::{self, Device, Inspect};
use super::error::WorkerError;
use super::memory::Memory;
use super::storage::{Media, Storage};
use super::worker::JOURNAL_BLOCK;
use pdstor_engine::io::{Completion, IoError, IoRequest, Op};

/// Kills the device after `writes` more writes (payload, journal or superblock).
#[derive(Debug)]
pub struct FaultPlan {
    writes_left: AtomicI64,
    /// Metadata reads to let through before one fails (negative: none fails).
    reads_before_fault: AtomicI64,
    /// Metadata reads refused by [`FaultPlan::fail_metadata_read`].
    read_faults: AtomicI64,
    torn: bool,
    dead: AtomicBool,
    /// Dead because this host was fenced (its reservation key preempted):
    /// the target refuses every command as a reservation conflict.
    fenced: AtomicBool,
    /// The simulated volatile write cache, for [`FaultPlan::simulated`].
    cache: Option<std::sync::Mutex<WriteCache>>,
}

/// Writes the device has acknowledged but not yet flushed, oldest first:
/// where, and the bytes there before and after; and the media they went to.
#[derive(Debug)]
struct WriteCache {
    media: Medium,
    unflushed: Vec<(u64, Vec<u8>, Vec<u8>)>,
}

/// The media a simulated plan reads what a write overwrote from, and puts
/// back what a power loss undid: the target file, or the memory of an
/// in-memory device.
#[derive(Debug)]
enum Medium {
    File(std::fs::File),
    Memory(Memory),
}

impl Medium {
    /// Bytes at `offset..offset + len` as they are now (zeros past the end).
    fn read_now(&self, offset: u64, len: u64) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; len as usize];
        match self {
            Medium::File(f) => {
                let _ = f.read_exact_at(&mut b, offset);
            }
            Medium::Memory(m) => {
                m.read_at(offset, &mut b);
            }
        }
        b
    }

    fn write_at(&self, data: &[u8], offset: u64) {
        use std::os::unix::fs::FileExt;
        match self {
            Medium::File(f) => {
                let _ = f.write_all_at(data, offset);
            }
            Medium::Memory(m) => m.write_at(offset, data),
        }
    }

    fn len(&self) -> u64 {
        match self {
            Medium::File(f) => f.metadata().map_or(0, |m| m.len()),
            Medium::Memory(m) => m.len(),
        }
    }

    fn sync(&self) {
        if let Medium::File(f) = self {
            let _ = f.sync_all();
        }
    }
}

/// What a simulated power loss did to the unflushed writes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PowerLoss {
    /// Writes in the cache when the power went.
    pub unflushed: usize,
    /// Writes that never reached the media.
    pub lost: usize,
    /// Writes of which only a prefix reached it.
    pub torn: usize,
    /// Writes that landed one block away from where they were aimed: media
    /// corruption, which the store must detect (never serve as good bytes).
    pub misdirected: usize,
}

impl FaultPlan {
    /// A device that dies after `writes` more writes; with `torn`, the last one reaches the media half written.
    pub fn die_after_writes(writes: u64, torn: bool) -> Arc<FaultPlan> {
        Arc::new(FaultPlan {
            writes_left: AtomicI64::new(writes as i64),
            reads_before_fault: AtomicI64::new(-1),
            read_faults: AtomicI64::new(0),
            torn,
            dead: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            cache: None,
        })
    }

    /// A device that works until [`kill`](Self::kill), remembering unflushed
    /// writes to `path` (the target file) so that [`power_loss`](Self::power_loss)
    /// can undo, tear or misdirect them.
    pub fn simulated(path: &std::path::Path) -> std::io::Result<Arc<FaultPlan>> {
        let file = std::fs::File::options().read(true).write(true).open(path)?;
        Ok(Self::simulating(Medium::File(file)))
    }

    /// [`simulated`](Self::simulated) for a store on `memory`
    /// ([`Store::open_memory`](super::Store::open_memory)).
    pub fn simulated_in(memory: &Memory) -> Arc<FaultPlan> {
        Self::simulating(Medium::Memory(memory.clone()))
    }

    fn simulating(media: Medium) -> Arc<FaultPlan> {
        Arc::new(FaultPlan {
            writes_left: AtomicI64::new(i64::MAX),
            reads_before_fault: AtomicI64::new(-1),
            read_faults: AtomicI64::new(0),
            torn: false,
            dead: AtomicBool::new(false),
            fenced: AtomicBool::new(false),
            cache: Some(std::sync::Mutex::new(WriteCache { media, unflushed: Vec::new() })),
        })
    }

    /// The power goes: every later write and flush fails.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    /// Another owner preempts this host's key (a takeover): from now on the
    /// target refuses every read, write and flush of this host as a
    /// reservation conflict (`EBADE`). The device itself goes on: what it
    /// acknowledged stays, and the new owner opens it as it is.
    pub fn fence(&self) {
        self.fenced.store(true, Ordering::SeqCst);
        self.dead.store(true, Ordering::SeqCst);
    }

    /// The error of a command the device refused.
    fn refused(&self, r: &IoRequest) -> IoError {
        let source = match self.fenced.load(Ordering::SeqCst) {
            true => std::io::Error::from_raw_os_error(libc::EBADE),
            false => dead_device(),
        };
        IoError::Transfer { transfer: r.transfer, op: r.op, offset: r.target_offset.0, len: r.len, source }
    }

    fn cache(&self) -> Option<std::sync::MutexGuard<'_, WriteCache>> {
        self.cache.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Before a write: remember what it overwrites.
    fn before_write(&self, offset: u64, len: u64) {
        if let Some(mut c) = self.cache() {
            let before = c.media.read_now(offset, len);
            c.unflushed.push((offset, before, Vec::new()));
        }
    }

    /// After the writes since the last [`before_write`](Self::before_write)s
    /// completed: remember what they wrote.
    fn after_writes(&self) {
        if let Some(mut c) = self.cache() {
            let c = &mut *c;
            for (offset, before, after) in c.unflushed.iter_mut().filter(|w| w.2.is_empty()) {
                *after = c.media.read_now(*offset, before.len() as u64);
            }
        }
    }

    /// A write with Force Unit Access completed: its bytes are on the media
    /// whatever a power loss does to the unflushed writes before it, so
    /// undoing or replaying any of them leaves its bytes where they overlap.
    fn written_through(&self, offset: u64, len: u64) {
        if let Some(mut c) = self.cache() {
            let c = &mut *c;
            let now = c.media.read_now(offset, len);
            for (at, before, after) in c.unflushed.iter_mut() {
                let (start, end) = ((*at).max(offset), (*at + before.len() as u64).min(offset + len));
                if start < end {
                    let (mine, theirs) = ((start - *at) as usize, (start - offset) as usize);
                    let n = (end - start) as usize;
                    before[mine..mine + n].copy_from_slice(&now[theirs..theirs + n]);
                    // An `after` not yet taken is read from the media later, FUA bytes and all.
                    if let Some(a) = after.get_mut(mine..mine + n) {
                        a.copy_from_slice(&now[theirs..theirs + n]);
                    }
                }
            }
        }
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
        let Some(mut c) = self.cache() else { return PowerLoss::default() };
        let writes = std::mem::take(&mut c.unflushed);
        let mut report = PowerLoss { unflushed: writes.len(), ..Default::default() };
        // Back to the state before any unflushed write, newest first...
        for (offset, before, _) in writes.iter().rev() {
            c.media.write_at(before, *offset);
        }
        // ...then replay, oldest first, the writes the cache got out.
        let len = c.media.len();
        for (offset, _, after) in &writes {
            match choose(16) {
                0..=7 => {
                    c.media.write_at(after, *offset);
                }
                8..=11 => report.lost += 1,
                12..=14 => {
                    let sectors = after.len() as u64 / 512;
                    let keep = if sectors > 1 { choose(sectors - 1) + 1 } else { 0 } as usize * 512;
                    c.media.write_at(&after[..keep], *offset);
                    report.torn += 1;
                }
                _ if misdirect_ok => {
                    let to = if choose(2) == 0 { offset.checked_sub(4096) } else { Some(offset + 4096) };
                    if let Some(to) = to.filter(|t| t + after.len() as u64 <= len) {
                        c.media.write_at(after, to);
                        report.misdirected += 1;
                    } else {
                        report.lost += 1;
                    }
                }
                _ => report.lost += 1,
            }
        }
        c.media.sync();
        report
    }
    /// The device lets `reads` more metadata reads through (superblock
    /// copies, a journal half: what recovery reads), then fails the next one
    /// with EIO, once: a medium error under recovery.
    pub fn fail_metadata_read(&self, reads: u64) {
        self.reads_before_fault.store(reads as i64, Ordering::SeqCst);
    }

    /// How many metadata reads the device failed ([`fail_metadata_read`](Self::fail_metadata_read)).
    pub fn metadata_read_faults(&self) -> u64 {
        self.read_faults.load(Ordering::SeqCst) as u64
    }

    /// Whether the device has died.
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

/// A dead device's faults: once it has died, every write, read and flush
/// fails; the write that kills it may be torn (metadata) or refused whole
/// (payload); its writes and flushes feed the simulated write cache.
impl Storage for FaultPlan {
    fn payload(
        &self,
        device: &mut dyn Device,
        commands: &[IoRequest],
        inspect: Inspect,
    ) -> Result<Vec<Completion>, IoError> {
        let admitted: Vec<bool> = commands
            .iter()
            .map(|c| if c.op.writes() { self.admit_write() == Ok(true) } else { !self.is_dead() })
            .collect();
        let index: Vec<usize> = (0..commands.len()).filter(|&i| admitted[i]).collect();
        let run: Vec<IoRequest> = index.iter().map(|&i| commands[i]).collect();
        for w in run.iter().filter(|r| r.op.writes()) {
            self.before_write(w.target_offset.0, w.len);
        }
        let done = Media.payload(device, &run, &mut |i, c, b| inspect(index[i], c, b));
        self.after_writes();
        let mut done = done?.into_iter();
        let out = commands
            .iter()
            .zip(&admitted)
            .map(|(c, &ok)| {
                match ok {
                    true => done.next(),
                    false => None,
                }
                .unwrap_or_else(|| Completion {
                    transfer: c.transfer,
                    op: c.op,
                    path: c.path,
                    bytes: 0,
                    latency: std::time::Duration::ZERO,
                    result: Err(self.refused(c)),
                })
            })
            .collect();
        Ok(out)
    }

    fn write(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError> {
        match self.admit_write() {
            Ok(true) => {}
            Ok(false) => {
                // Torn: the first half (whole blocks) reaches the media.
                let len = request.len;
                let half = (len / 2) - (len / 2) % JOURNAL_BLOCK.min(len);
                if half > 0 {
                    let _ = device::execute_all(device, &[IoRequest { len: half, ..request }]);
                }
                return Err(self.refused(&IoRequest { len: 0, ..request }));
            }
            Err(()) => return Err(self.refused(&IoRequest { len: 0, ..request })),
        }
        if request.op == Op::WriteFua {
            let r = Media.write(device, request);
            if r.is_ok() {
                self.written_through(request.target_offset.0, request.len);
            }
            return r;
        }
        self.before_write(request.target_offset.0, request.len);
        let r = Media.write(device, request);
        self.after_writes();
        r
    }

    fn read(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError> {
        if self.is_dead() {
            return Err(self.refused(&request));
        }
        if self.reads_before_fault.fetch_sub(1, Ordering::SeqCst) == 0 {
            self.read_faults.fetch_add(1, Ordering::SeqCst);
            let source = std::io::Error::from_raw_os_error(libc::EIO);
            let r = request;
            return Err(IoError::Transfer {
                transfer: r.transfer,
                op: r.op,
                offset: r.target_offset.0,
                len: r.len,
                source,
            });
        }
        Media.read(device, request)
    }

    fn flush(&self, device: &mut dyn Device) -> Result<(), WorkerError> {
        if self.fenced.load(Ordering::SeqCst) {
            return Err(WorkerError::Fenced);
        }
        if self.is_dead() {
            return Err(WorkerError::DeviceDead);
        }
        Media.flush(device)?;
        self.flushed();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    /// An unflushed write the power loss drops, under a later FUA write
    /// that overlaps half of it: the FUA write's bytes stay where they
    /// overlap, the rest of the dropped write goes back to what was there.
    #[test]
    fn a_fua_write_survives_the_loss_of_an_unflushed_write_under_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("media");
        let file = std::fs::File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.write_all_at(&[0u8; 8192], 0).unwrap();
        let plan = FaultPlan::simulated(&path).unwrap();
        // An unflushed write of 1s over 0..8192.
        plan.before_write(0, 8192);
        file.write_all_at(&[1u8; 8192], 0).unwrap();
        plan.after_writes();
        // A FUA write of 2s over 4096..8192.
        file.write_all_at(&[2u8; 4096], 4096).unwrap();
        plan.written_through(4096, 4096);
        plan.kill();
        // Every unflushed write is lost (choose answers 8: "lost").
        let loss = plan.power_loss(&mut |_| 8, false);
        assert_eq!((loss.unflushed, loss.lost), (1, 1), "{loss:?}");
        let mut got = vec![0u8; 8192];
        file.read_exact_at(&mut got, 0).unwrap();
        assert!(got[..4096].iter().all(|&b| b == 0), "the lost write undone where nothing else wrote");
        assert!(got[4096..].iter().all(|&b| b == 2), "the FUA write's bytes survive");
    }
}
