//! The payload engine: moves bytes between [`Buffer`]s and a [`Target`] with
//! io_uring, on the path each request declares.
//!
//! - `host`: plain `READ`/`WRITE` (or passthrough without a fixed buffer) from
//!   unregistered memory;
//! - `host_fixed`: `READ_FIXED`/`WRITE_FIXED` (or `URING_CMD` with
//!   `IORING_URING_CMD_FIXED`) from a buffer registered with the ring;
//! - `dmabuf_fixed`: `READ_FIXED`/`WRITE_FIXED` on a raw block device from a
//!   DMA-BUF installed in the buffer table with the rw-dmabuf UAPI
//!   ([`crate::buffer::dmabuf::uapi`]); the SQE's `addr` is an offset into the
//!   DMA-BUF. Probed at start-up ([`Engine::dmabuf_rw`]); without the kernel
//!   series, registering for it fails with an error that names what is missing.
//!
//! The engine never switches paths on its own: a request that its path cannot
//! serve is refused before anything is submitted, with the reason and the path
//! that would accept it. A batch is validated whole before its first byte
//! moves, so a refused batch writes nothing.
//!
//! This module does not know what the bytes mean (chunks, journals): see
//! `store/` for that.

mod bytes;
mod dmabuf_rw;
mod error;
pub mod nvme;
pub mod persistent_reservation;
mod plan;
mod request;
mod ring;
mod sys;
mod target;
mod windows;
mod write_cache;

use std::cell::Cell;
use std::sync::Arc;

use io_uring::{IoUring, squeue, types};

pub use dmabuf_rw::DmabufRw;
pub use error::IoError;
pub use request::{BufferId, BufferOffset, Completion, IoRequest, Op, PayloadPath, TargetOffset, TransferId};
pub use ring::{MAX_TRANSFER_ID, SEGMENT_BITS};
pub use target::{DeviceIds, Geometry, Target, TargetKind, TargetOptions};
pub use write_cache::{Probe as WriteCacheProbe, WriteCache};

use crate::buffer::Buffer;
use plan::{build_nvme, build_std, plan};
use ring::{Completions, Driver, Planned};

pub(super) fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "unknown".into(), |s| s.trim().to_owned())
}

/// Engine tuning.
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    /// Requests in flight at once.
    pub queue_depth: u32,
    /// Size of the registered-buffer table (sparse; filled by `register`).
    pub buffer_slots: u32,
    /// Caps the bytes per command below the target's own limit (tuning, and
    /// exercising the split path on targets that would not need it).
    pub max_transfer: Option<u32>,
    /// Submit every read and write with `RWF_NOWAIT` first: a command the
    /// kernel would have to block for (a hole to allocate, a bio to split, a
    /// DMA-BUF mapping to create) comes back `-EAGAIN` at once instead of
    /// waiting on an io-wq worker, and is resubmitted blocking
    /// ([`EngineStats::resubmitted`] counts them). Files and block devices;
    /// passthrough has no such flag.
    pub nowait_first: bool,
    /// Bytes of a buffer's mapping per registered-buffer table entry, at
    /// most [`FIXED_WINDOW_MAX`] (io_uring's limit per entry): a larger
    /// mapping is registered as several windows, one entry each.
    pub fixed_window: usize,
}

/// The most bytes io_uring registers in one buffer table entry (1 GiB).
pub const FIXED_WINDOW_MAX: usize = 1 << 30;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            queue_depth: 32,
            buffer_slots: 64,
            max_transfer: None,
            nowait_first: false,
            fixed_window: FIXED_WINDOW_MAX,
        }
    }
}

/// Counters of what moved, by path.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct PathCounters {
    /// Requests completed.
    pub requests: u64,
    /// Bytes moved.
    pub bytes: u64,
}

/// What the engine moved, by path, since it was built.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct EngineStats {
    /// On `host`.
    pub host: PathCounters,
    /// On `host_fixed`.
    pub host_fixed: PathCounters,
    /// On `dmabuf_fixed`.
    pub dmabuf_fixed: PathCounters,
    /// Flushes issued.
    pub flushes: u64,
    /// Flushes asked for and not issued: the target has no volatile write cache.
    pub flushes_elided: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Commands the kernel answered `-EAGAIN` (or `-EINTR`) that were
    /// resubmitted, as the rw-dmabuf series asks its users to.
    pub resubmitted: u64,
}

pub(super) enum Ring {
    /// 64-byte SQEs for files and block devices.
    Std(IoUring),
    /// SQE128/CQE32, as `NVME_URING_CMD_IO` needs.
    Nvme(IoUring<squeue::Entry128, io_uring::cqueue::Entry32>),
}

/// How a held buffer is known to the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Registration {
    /// Held only, for the `host` path.
    None,
    /// Its CPU mapping is registered (`host_fixed`).
    Host,
    /// The DMA-BUF itself is installed (`dmabuf_fixed`).
    DmaBuf,
}

pub(super) struct Slot {
    /// Shared so a checksum can run on another thread while the ring moves
    /// other requests ([`Engine::shared_buffer`]); the mapping lives as long
    /// as the last holder.
    pub(super) buffer: Arc<Buffer>,
    pub(super) registered: Registration,
    /// A registered mapping over one window: the table entries of its
    /// windows after the first (which is the slot's own entry), and the
    /// window's size ([`windows`]).
    pub(super) windows: Vec<u32>,
    pub(super) window: usize,
}

/// The io_uring payload engine over one target.
///
/// An engine stays on the thread that created it: its ring is
/// `IORING_SETUP_SINGLE_ISSUER`, so the kernel refuses submissions from any
/// other thread, and the type is `!Send` to say so at compile time. Build it on
/// the I/O thread that will use it.
pub struct Engine {
    target: Target,
    ring: Ring,
    slots: Vec<Option<Slot>>,
    /// Table entries that hold a window of another slot's buffer.
    window_entries: Vec<bool>,
    fixed_window: usize,
    queue_depth: u32,
    nowait_first: bool,
    stats: EngineStats,
    dmabuf_rw: DmabufRw,
    _one_thread: std::marker::PhantomData<*const ()>,
}

/// Sets up a ring of `entries` SQEs with the task-run flags that suit one
/// submitting thread: `DEFER_TASKRUN` runs completion work only when the engine
/// waits, instead of interrupting it (measured on zram here: 4 KiB random reads
/// go from ~0.6x to ~1.0x of fio, which sets the same flags). Kernels before 6.1
/// lack these flags and get a plain ring.
fn build_ring<S: squeue::EntryMarker, C: io_uring::cqueue::EntryMarker>(
    entries: u32,
) -> Result<IoUring<S, C>, IoError> {
    let tuned =
        IoUring::<S, C>::builder().setup_coop_taskrun().setup_single_issuer().setup_defer_taskrun().build(entries);
    match tuned {
        Ok(r) => Ok(r),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            IoUring::<S, C>::builder().build(entries).map_err(|source| IoError::Ring { op: "setup", source })
        }
        Err(source) => Err(IoError::Ring { op: "setup", source }),
    }
}

/// The target's fd is the only registered file.
pub(super) const TARGET_FILE: types::Fixed = types::Fixed(0);

impl Engine {
    /// Builds a ring sized for `queue_depth` and registers the target's fd and a
    /// sparse buffer table with it.
    pub fn new(mut target: Target, opts: EngineOptions) -> Result<Engine, IoError> {
        use std::os::fd::AsRawFd;
        if let Some(cap) = opts.max_transfer {
            target.cap_max_transfer(cap);
        }
        let queue_depth = opts.queue_depth.clamp(1, 1024);
        // Room for split requests beside a full queue; the CQ is twice this.
        let entries = (queue_depth * 2).next_power_of_two().clamp(8, 4096);
        let ring_err = |op| move |source| IoError::Ring { op, source };
        let fd = target.file().as_raw_fd();
        let ring = match target.kind() {
            TargetKind::NvmeGeneric => {
                let r = build_ring::<squeue::Entry128, io_uring::cqueue::Entry32>(entries)?;
                r.submitter().register_files(&[fd]).map_err(ring_err("register_files"))?;
                r.submitter()
                    .register_buffers_sparse(opts.buffer_slots)
                    .map_err(ring_err("register_buffers_sparse"))?;
                Ring::Nvme(r)
            }
            _ => {
                let r = build_ring::<squeue::Entry, io_uring::cqueue::Entry>(entries)?;
                r.submitter().register_files(&[fd]).map_err(ring_err("register_files"))?;
                r.submitter()
                    .register_buffers_sparse(opts.buffer_slots)
                    .map_err(ring_err("register_buffers_sparse"))?;
                Ring::Std(r)
            }
        };
        let mut engine = Engine {
            target,
            ring,
            slots: (0..opts.buffer_slots).map(|_| None).collect(),
            window_entries: vec![false; opts.buffer_slots as usize],
            fixed_window: opts.fixed_window.clamp(4096, FIXED_WINDOW_MAX),
            queue_depth,
            nowait_first: opts.nowait_first,
            stats: EngineStats::default(),
            dmabuf_rw: DmabufRw::Missing("not probed".into()),
            _one_thread: std::marker::PhantomData,
        };
        engine.dmabuf_rw = engine.probe_dmabuf_rw();
        Ok(engine)
    }

    /// Whether this kernel can install a DMA-BUF in the buffer table.
    pub fn dmabuf_rw(&self) -> &DmabufRw {
        &self.dmabuf_rw
    }

    /// The target the engine drives.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The target's geometry (sizes, alignment, limits).
    pub fn geometry(&self) -> &Geometry {
        self.target.geometry()
    }

    /// What moved so far.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Holds `buffer` for the `host` path only (not registered). A DMA-BUF
    /// mapped through its own `mmap` is refused if that mapping cannot be
    /// pinned (direct I/O pins user memory the same way registration does):
    /// it would fail at the first transfer instead.
    pub fn add(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        let id = self.free_slot()?;
        if let (Some(d), None) = (buffer.dmabuf(), buffer.memfd_fd()) {
            let addr = buffer.addr().map_err(|what| IoError::BufferUnusable { buffer: id, what })?;
            let iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buffer.len() };
            // SAFETY: a trial registration of `buffer`'s live mapping, cleared
            // right after; no I/O uses the slot in between.
            let trial = unsafe { self.update_buffer_table(id.0, &[iov]) };
            let _ = self.clear_entry(id.0);
            trial.map_err(|source| IoError::DmabufNotPinnable { exporter: d.exporter().to_owned(), source })?;
        }
        self.slots[id.0 as usize] = Some(Slot::held(buffer, Registration::None));
        Ok(id)
    }

    /// Holds `buffer` and registers it with io_uring, for the `host_fixed` path
    /// (it remains usable on `host` too). A mapping over the engine's
    /// window (1 GiB by default) takes one table entry per window.
    pub fn register(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        let id = self.free_slot()?;
        let addr = buffer.addr().map_err(|what| IoError::BufferUnusable { buffer: id, what })?;
        let windows = self.register_windows(id, addr, buffer.len()).map_err(|e| match (e, buffer.dmabuf()) {
            (windows::Failed::Os(source), Some(d)) if buffer.memfd_fd().is_none() => {
                IoError::DmabufNotPinnable { exporter: d.exporter().to_owned(), source }
            }
            (windows::Failed::Os(source), _) => IoError::Register { buffer: id, len: buffer.len(), source },
            (windows::Failed::Engine(e), _) => e,
        })?;
        let window = self.fixed_window;
        self.slots[id.0 as usize] =
            Some(Slot { buffer: Arc::new(buffer), registered: Registration::Host, windows, window });
        Ok(id)
    }

    /// Releases a buffer (unregistering it first) and hands it back.
    pub fn remove(&mut self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        let slot = self.slots.get_mut(id.0 as usize).and_then(Option::take).ok_or(IoError::UnknownBuffer(id))?;
        if slot.registered != Registration::None {
            if let Err(source) = self.clear_entry(id.0) {
                let len = slot.buffer.len();
                self.slots[id.0 as usize] = Some(slot);
                return Err(IoError::Register { buffer: id, len, source });
            }
            self.clear_windows(&slot.windows);
        }
        Ok(slot.buffer)
    }

    /// The held buffer `id`.
    pub fn buffer(&self, id: BufferId) -> Result<&Buffer, IoError> {
        self.slot(id).map(|s| &*s.buffer)
    }

    /// The held buffer `id`, shared: for work on its bytes on another thread
    /// (a checksum) while this engine moves other requests.
    pub fn shared_buffer(&self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        self.slot(id).map(|s| Arc::clone(&s.buffer))
    }

    /// Whether the buffer's CPU mapping is registered (`host_fixed`).
    pub fn is_registered(&self, id: BufferId) -> bool {
        self.slot(id).is_ok_and(|s| s.registered == Registration::Host)
    }

    /// The fixed path a held buffer serves, if any.
    pub fn fixed_path(&self, id: BufferId) -> Option<PayloadPath> {
        match self.slot(id).ok()?.registered {
            Registration::None => None,
            Registration::Host => Some(PayloadPath::HostFixed),
            Registration::DmaBuf => Some(PayloadPath::DmabufFixed),
        }
    }

    /// Runs a batch to completion. Validation covers the whole batch first: if
    /// any request is refused, the error names it and nothing is submitted.
    /// I/O failures are per request, in each [`Completion`]'s `result`, in the
    /// order of the batch.
    pub fn execute(&mut self, batch: &[IoRequest]) -> Result<Vec<Completion>, IoError> {
        self.execute_inspect(batch, |_, _, _| {})
    }

    /// Like [`execute`](Self::execute), and calls `inspect` with each
    /// completion (its index in the batch) and the request's buffer as soon as
    /// it completes, while the rest of the batch is still in flight: work on
    /// the bytes (a checksum) overlaps the I/O instead of following it.
    pub fn execute_inspect(
        &mut self,
        batch: &[IoRequest],
        mut inspect: impl FnMut(usize, &Completion, Option<&Buffer>),
    ) -> Result<Vec<Completion>, IoError> {
        for r in batch {
            plan(&self.target, &self.slots, r)?;
        }
        let mut completions: Vec<Option<Completion>> = (0..batch.len()).map(|_| None).collect();
        let slot_to_index: Vec<Cell<usize>> = vec![Cell::new(0); self.queue_depth as usize];
        let mut cursor = 0usize;
        self.stream_inner(
            &mut |slot| {
                let r = batch.get(cursor).copied()?;
                slot_to_index[slot].set(cursor);
                cursor += 1;
                Some(r)
            },
            &mut |slot, c, buffer| {
                let index = slot_to_index[slot].get();
                inspect(index, &c, buffer);
                completions[index] = Some(c);
            },
        )?;
        let out: Vec<Completion> = completions.into_iter().flatten().collect();
        debug_assert_eq!(out.len(), batch.len(), "every request completes exactly once");
        Ok(out)
    }

    /// Like [`execute`](Self::execute), but the first failed request fails the
    /// call. Returns the bytes moved.
    pub fn execute_all(&mut self, batch: &[IoRequest]) -> Result<u64, IoError> {
        let mut bytes = 0;
        for c in self.execute(batch)? {
            c.result?;
            bytes += c.bytes;
        }
        Ok(bytes)
    }

    /// Streams requests from `next`, which is given the queue slot
    /// (0..queue_depth) the request will occupy so a caller can give each slot
    /// its own buffer range; `done` gets each completion with its slot. Each
    /// request is validated as it is pulled; a refused one ends the stream once
    /// the requests in flight finish, and is returned as the error.
    pub fn stream(
        &mut self,
        mut next: impl FnMut(usize) -> Option<IoRequest>,
        mut done: impl FnMut(usize, Completion),
    ) -> Result<(), IoError> {
        self.stream_inner(&mut next, &mut |slot, c, _| done(slot, c))
    }

    /// [`stream`](Self::stream), giving `done` the completed request's buffer.
    fn stream_inner(
        &mut self,
        next: &mut dyn FnMut(usize) -> Option<IoRequest>,
        done: &mut dyn FnMut(usize, Completion, Option<&Buffer>),
    ) -> Result<(), IoError> {
        let Engine { target, ring, slots, queue_depth, nowait_first, stats, .. } = self;
        let punt = target.blocks();
        let slots: &[Option<Slot>] = slots;
        let mut refused = None;
        let requests: Vec<Cell<Option<IoRequest>>> = vec![Cell::new(None); *queue_depth as usize];
        let planned_next = |slot: usize| {
            if refused.is_some() {
                return None;
            }
            let req = next(slot)?;
            match plan(target, slots, &req) {
                Ok(p) => {
                    requests[slot].set(Some(req));
                    Some(p)
                }
                Err(e) => {
                    refused = Some(e);
                    None
                }
            }
        };
        let on_done = |slot: usize, outcome: ring::Outcome| {
            let Some(req) = requests[slot].get() else {
                return;
            };
            stats.record(req.op, req.path, outcome.bytes, outcome.result.is_ok());
            stats.resubmitted += u64::from(outcome.resubmitted);
            let buffer = slots.get(req.buffer.0 as usize).and_then(Option::as_ref).map(|s| &*s.buffer);
            done(
                slot,
                Completion {
                    transfer: outcome.transfer,
                    op: req.op,
                    path: req.path,
                    bytes: outcome.bytes,
                    latency: outcome.latency,
                    result: outcome.result,
                },
                buffer,
            );
        };
        let driver = Driver {
            queue_depth: *queue_depth as usize,
            max_transfer: target.geometry().max_transfer,
            nowait_first: *nowait_first,
            punt,
            completions: match ring {
                Ring::Std(_) => Completions::Bytes,
                Ring::Nvme(_) => Completions::NvmeStatus,
            },
        };
        let geometry = *target.geometry();
        match ring {
            Ring::Std(r) => driver.run(r, planned_next, on_done, build_std),
            Ring::Nvme(r) => driver.run(r, planned_next, on_done, |seg, ud| build_nvme(&geometry, seg, ud)),
        }?;
        refused.map_or(Ok(()), Err)
    }

    fn free_slot(&self) -> Result<BufferId, IoError> {
        self.slots
            .iter()
            .zip(&self.window_entries)
            .position(|(slot, window)| slot.is_none() && !window)
            .map(|i| BufferId(i as u32))
            .ok_or(IoError::BufferTableFull { slots: self.slots.len() as u32 })
    }

    fn slot(&self, id: BufferId) -> Result<&Slot, IoError> {
        self.slots.get(id.0 as usize).and_then(Option::as_ref).ok_or(IoError::UnknownBuffer(id))
    }

    /// # Safety
    /// Each non-empty iovec must describe memory that stays mapped until its
    /// table entry is replaced or the ring is dropped.
    unsafe fn update_buffer_table(&self, index: u32, iovs: &[libc::iovec]) -> std::io::Result<()> {
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            match &self.ring {
                Ring::Std(r) => r.submitter().register_buffers_update(index, iovs, None),
                Ring::Nvme(r) => r.submitter().register_buffers_update(index, iovs, None),
            }
        }
    }
}

impl Drop for Engine {
    /// Drops the ring's references to the target and the buffers now: ring
    /// teardown in the kernel is asynchronous, and a registered file would keep
    /// the target (and its lock) open after the process exits.
    fn drop(&mut self) {
        let _ = match &self.ring {
            Ring::Std(r) => r.submitter().unregister_files().and(r.submitter().unregister_buffers()),
            Ring::Nvme(r) => r.submitter().unregister_files().and(r.submitter().unregister_buffers()),
        };
    }
}

impl EngineStats {
    fn record(&mut self, op: Op, path: PayloadPath, bytes: u64, ok: bool) {
        if op == Op::Flush {
            self.flushes += 1;
        }
        let c = match path {
            PayloadPath::HostFixed => &mut self.host_fixed,
            PayloadPath::DmabufFixed => &mut self.dmabuf_fixed,
            PayloadPath::Host => &mut self.host,
        };
        c.requests += 1;
        c.bytes += bytes;
        self.errors += u64::from(!ok);
    }
}
