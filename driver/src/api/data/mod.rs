//! The data plane: a Unix socket (mode 0600). A client registers a buffer by
//! sending its memfd or DMA-BUF with `SCM_RIGHTS`, naming the path it is for;
//! the daemon maps or imports it, registers it with io_uring for that path and
//! answers a buffer id (or refuses, holding nothing, if the path cannot take
//! it: `dmabuf_fixed` on a kernel without the rw-dmabuf series). Store and load batches then name
//! `(buffer, offset)` per chunk and the daemon moves the bytes itself — no
//! payload byte crosses the socket. A client that disconnects has its
//! unfinished (PREPARED) publications aborted and its buffers unregistered.
//!
//! Frames: `u32` little-endian length, then JSON ([`DataRequest`] /
//! [`DataResponse`]); a `register` frame carries the fd.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use super::data_error::DataError;
use super::metrics::Metrics;
use super::wire::{DataChunk, DataRequest, DataResponse, ErrorBody, SharedKind};
use crate::protocol::identity::{Caller, Role};
use crate::protocol::policy::Resource;
use crate::protocol::service::{ProtocolError, Service};
use crate::store::{BatchOutcome, ChunkDest, ChunkSource, Phase, StoreBatch, StoreError};
use pdstor_client::receipt::Receipt;
use pdstor_engine::buffer::Buffer;
use pdstor_engine::buffer::dmabuf::DmaBuf;
use pdstor_engine::io::{BufferId, BufferOffset, PayloadPath, TransferId};

mod ack;
mod idle;
mod many;
mod notes;
mod place;
mod shares;
use pdstor_client::frame::write_frame;
use pdstor_client::layout::Manifest;

/// Provenance checking for the data plane (`pdstor serve --provenance`).
pub struct Provenance {
    /// Reads the probes' per-transfer signals.
    pub reader: pdstor_probes::SignalReader,
    /// What kind of target the probes judge.
    pub class: pdstor_probes::TargetClass,
    /// A `fallback` verdict fails the transfer.
    pub require_native: bool,
}

/// The data plane: a Unix socket where clients share buffers (`SCM_RIGHTS`) and move chunks; one thread per connection.
pub struct DataPlane {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The listening socket, to wake the accept loop at shutdown (its path
    /// may be gone: a cleaner emptied the directory).
    waker: UnixListener,
}

impl DataPlane {
    /// Listens on `path` (mode 0600, in a directory no other user can write)
    /// and serves until dropped. A stale socket there is replaced; a live one,
    /// or anything that is not a socket, is refused and left alone.
    pub fn start(
        path: &Path,
        group: Option<u32>,
        service: Arc<Service>,
        metrics: Arc<Metrics>,
        provenance: Option<Arc<Provenance>>,
        limits: super::Limits,
    ) -> anyhow::Result<DataPlane> {
        let listener = super::hygiene::bind_socket(path, group, |p| UnixListener::bind(p))?;
        let waker = listener.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        // One thread per connection, at most `max_data_connections` of them,
        // shared among the config's tenants (`shares`).
        let shares = shares::Shares::new(limits.max_data_connections);
        let thread = std::thread::Builder::new().name("pdstor-data".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                // Who is on the other end, proven by the kernel.
                let Ok((uid, gid, pid)) = super::hygiene::peer_cred(&conn) else { continue };
                let rules = service.policy().rules();
                let caller = rules.unix(uid, gid, pid);
                let refuse = |conn: &mut UnixStream, e: ErrorBody| {
                    metrics.error(&e.code);
                    let _ = conn.set_write_timeout(Some(std::time::Duration::from_secs(1)));
                    last_word(conn, e);
                };
                let key = caller.tenant.clone().unwrap_or_else(|| caller.principal.clone());
                let share = match shares.take(&key, &rules.tenant_names()) {
                    Ok(share) => share,
                    Err(why) => {
                        refuse(
                            &mut conn,
                            ErrorBody::new(pdstor_client::code::RefusalCode::TooManyConnections, "", why),
                        );
                        continue;
                    }
                };
                // A tenant over its connection quota is told so and hung up on.
                if let Err(r) = service.policy().take(&caller, Resource::Connection) {
                    refuse(&mut conn, ErrorBody::new(r.code, r.field, r.message));
                    continue;
                }
                let (service, metrics, provenance) = (service.clone(), metrics.clone(), provenance.clone());
                let spawned = std::thread::Builder::new().name("pdstor-data-conn".into()).spawn(move || {
                    let _share = share;
                    let mut c = Conn {
                        caller,
                        service,
                        metrics,
                        provenance,
                        limits,
                        buffers: HashMap::new(),
                        next: 1,
                        stored_into: HashSet::new(),
                        unchecked: HashSet::new(),
                        unverifiable: HashSet::new(),
                    };
                    c.serve(conn);
                    c.cleanup();
                    c.service.policy().give(&c.caller, Resource::Connection);
                });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "data plane: no thread for a new connection");
                }
            }
        })?;
        Ok(DataPlane { path: path.into(), stop, thread: Some(thread), waker })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // shutdown(2) wakes a blocked accept(2) with an error, whether or not
        // the socket's path still exists; the loop then sees `stop`.
        let _ = nix::sys::socket::shutdown(self.waker.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

struct Conn {
    /// Who is on the other end (`SO_PEERCRED`).
    caller: Caller,
    service: Arc<Service>,
    metrics: Arc<Metrics>,
    provenance: Option<Arc<Provenance>>,
    limits: super::Limits,
    /// Client buffer id → (store buffer, length). The path each moves on is
    /// the store's to know ([`crate::store::Store::buffer_path`]).
    buffers: HashMap<u32, (BufferId, u64)>,
    next: u32,
    stored_into: HashSet<u64>,
    /// Client buffers registered `unchecked`: a reader's staging, whose
    /// loads it checks as it copies them out, or a benchmark's baseline. The
    /// daemon does not checksum loads into them, and the timeline says so.
    unchecked: HashSet<u32>,
    /// Client buffers whose loads the daemon does not check (registered
    /// unchecked, or a DMA-BUF it cannot map): a load into them cannot
    /// acknowledge its claim.
    unverifiable: HashSet<u32>,
}

/// The publication a request is about, for a refusal's timeline event.
fn about_of(req: &DataRequest) -> Option<u64> {
    match req {
        DataRequest::Store { publication, .. } => Some(*publication),
        DataRequest::Load { receipt, .. } => Some(receipt.publication),
        _ => None,
    }
}

/// Answers `e` on a connection about to be closed, best effort: the client
/// learns why it is being hung up on.
fn last_word(stream: &mut UnixStream, e: ErrorBody) {
    let resp = DataResponse { ok: false, error: Some(e), ..Default::default() };
    if let Ok(bytes) = serde_json::to_vec(&resp) {
        let _ = write_frame(stream, &bytes, &[]);
    }
}

impl Conn {
    fn serve(&mut self, mut stream: UnixStream) {
        // A client that does not read its answers holds no thread for long.
        let _ = stream.set_write_timeout(Some(self.limits.body_timeout));
        loop {
            if let Err(e) = self.wait_for_request(&stream) {
                self.metrics.error(&e.code);
                last_word(&mut stream, e);
                return;
            }
            let deadline = std::time::Instant::now() + self.limits.body_timeout;
            let (body, fds) = match pdstor_client::frame::read_frame_by(&mut stream, Some(deadline)) {
                Ok(Some(f)) => f,
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    // Say why before hanging up: the stream cannot be resynchronised.
                    let e = DataError::FrameTooLarge { what: e }.body();
                    self.metrics.error(&e.code);
                    last_word(&mut stream, e);
                    return;
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    let ms = self.limits.body_timeout.as_millis();
                    let e = ErrorBody::new(
                        pdstor_client::code::RefusalCode::BodyTimeout,
                        "frame",
                        format!("a request frame did not arrive whole within {ms} ms (--body-timeout-ms): closed"),
                    );
                    self.metrics.error(&e.code);
                    last_word(&mut stream, e);
                    return;
                }
                _ => return,
            };
            let mut about = None;
            let resp = match serde_json::from_slice::<DataRequest>(&body) {
                Ok(req) => {
                    about = about_of(&req);
                    self.handle(req, fds)
                }
                Err(e) => Err(DataError::BadFrame(e)),
            };
            self.metrics.reconcile(self.service.store());
            let resp = self.answer(resp, about);
            let Ok(bytes) = serde_json::to_vec(&resp) else { return };
            if write_frame(&mut stream, &bytes, &[]).is_err() {
                return;
            }
        }
    }

    /// A request's answer; a failure counted, and one for who the caller is
    /// logged and put on the timeline with the publication it was about.
    fn answer(&self, resp: Result<DataResponse, DataError>, about: Option<u64>) -> DataResponse {
        resp.unwrap_or_else(|e| {
            let e = e.body();
            self.metrics.error(&e.code);
            if pdstor_client::code::RefusalCode::parse(&e.code).is_some_and(|c| c.is_identity()) {
                let by = self.caller.audit();
                tracing::warn!(by = %by, code = %e.code, message = %e.message, "refused for who the caller is");
                let mut refused = pdstor_client::timeline::Event::new("refused")
                    .detail(format!("{} ({}): {}", e.code, e.field, e.message))
                    .by(by);
                refused.publication = about;
                pdstor_client::timeline::emit(self.service.timeline(), refused);
            }
            DataResponse { ok: false, error: Some(e), ..Default::default() }
        })
    }

    fn buffer(&self, c: &DataChunk) -> Result<BufferId, DataError> {
        self.buffers.get(&c.buffer).map(|b| b.0).ok_or(DataError::UnknownBuffer { buffer: c.buffer })
    }

    fn path_of(&self, c: &DataChunk) -> PayloadPath {
        self.buffers
            .get(&c.buffer)
            .and_then(|b| self.service.store().buffer_path(b.0))
            .unwrap_or(PayloadPath::HostFixed)
    }

    fn count_bytes(&self, path: PayloadPath, bytes: u64) {
        let counter = match path {
            PayloadPath::Host => &self.metrics.bytes_host,
            PayloadPath::HostFixed => &self.metrics.bytes_host_fixed,
            PayloadPath::DmabufFixed => &self.metrics.bytes_dmabuf_fixed,
        };
        counter.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Maps or imports the fds of a `register` frame into a buffer.
    fn receive_buffer(kind: SharedKind, len: u64, mut fds: Vec<OwnedFd>) -> Result<Buffer, DataError> {
        if len == 0 {
            return Err(DataError::ZeroLength);
        }
        let expected = match kind {
            SharedKind::Memfd => "1 fd (the memfd)",
            SharedKind::Dmabuf => "1 or 2 fds (the DMA-BUF, then optionally its backing memfd)",
            SharedKind::Shm => "1 fd (the shared-memory file)",
        };
        let bad_fds = |got: usize| DataError::Fds { kind, expected, got };
        match kind {
            SharedKind::Memfd => {
                if fds.len() != 1 {
                    return Err(bad_fds(fds.len()));
                }
                let fd = fds.remove(0);
                Buffer::from_memfd(fd, len as usize).map_err(DataError::MapMemfd)
            }
            SharedKind::Shm => {
                if fds.len() != 1 {
                    return Err(bad_fds(fds.len()));
                }
                // Its owner may shrink it: reached through the file only.
                Buffer::from_shm_file(fds.remove(0), len as usize, false).map_err(DataError::MapMemfd)
            }
            SharedKind::Dmabuf => {
                if fds.is_empty() || fds.len() > 2 {
                    return Err(bad_fds(fds.len()));
                }
                let backing = if fds.len() == 2 { fds.pop() } else { None };
                let dmabuf = DmaBuf::import(fds.remove(0)).map_err(DataError::ImportDmabuf)?;
                if dmabuf.size() != len {
                    return Err(DataError::DmabufSize { actual: dmabuf.size(), declared: len });
                }
                Buffer::from_dmabuf(dmabuf, backing).map_err(DataError::MapBacking)
            }
        }
    }

    fn handle(&mut self, req: DataRequest, fds: Vec<OwnedFd>) -> Result<DataResponse, DataError> {
        match req {
            DataRequest::Register { len, kind, path, unchecked } => self.register(len, (kind, unchecked), path, fds),
            DataRequest::Store { .. } | DataRequest::Load { .. } => self.one(req),
            DataRequest::Many { requests } if fds.is_empty() => self.many(requests),
            DataRequest::Many { .. } => Err(DataError::BadMany(format!(
                "a many frame carries no fds ({} came): register each buffer with its own frame",
                fds.len()
            ))),
        }
    }

    /// Registers a client buffer, within this connection's caps.
    fn register(
        &mut self,
        len: u64,
        (kind, unchecked): (SharedKind, bool),
        path: Option<PayloadPath>,
        fds: Vec<OwnedFd>,
    ) -> Result<DataResponse, DataError> {
        self.caller.require(Role::Any, "register a buffer").map_err(ProtocolError::from)?;
        let path = path.unwrap_or(PayloadPath::HostFixed);
        let (max, pinned_max) = (self.limits.max_buffers_per_connection, self.limits.max_pinned_bytes_per_connection);
        if self.buffers.len() >= max {
            return Err(DataError::TooManyBuffers { max });
        }
        let pinned: u64 = self.buffers.values().map(|b| b.1).sum();
        if pinned.saturating_add(len) > pinned_max {
            return Err(DataError::TooManyBytes { pinned, len, max: pinned_max });
        }
        self.service.policy().take(&self.caller, Resource::Buffer(len)).map_err(ProtocolError::from)?;
        let registered = Self::receive_buffer(kind, len, fds).and_then(|mut buffer| {
            if unchecked {
                buffer.skip_load_checks();
            }
            let exporter = buffer.dmabuf().map(|d| d.exporter().to_owned());
            let checked = buffer.loads_checksummed_here();
            Ok((self.service.store().register_buffer_for(buffer, path)?, exporter, checked))
        });
        let (id, exporter, checked) =
            registered.inspect_err(|_| self.service.policy().give(&self.caller, Resource::Buffer(len)))?;
        if !checked {
            self.unverifiable.insert(self.next);
        }
        let client = self.next;
        self.next += 1;
        self.buffers.insert(client, (id, len));
        if unchecked {
            self.unchecked.insert(client);
        }
        Ok(DataResponse {
            ok: true,
            buffer: Some(client),
            paths: vec![path.to_string()],
            exporter,
            ..Default::default()
        })
    }

    /// A store batch checked and made ready to run: only its writer stores
    /// into a publication, and only then does this connection's going away
    /// abort it.
    fn store_begin(
        &mut self,
        publication: u64,
        writer_token: &str,
        chunks: &[DataChunk],
        is_last_batch: bool,
        total_chunks: u32,
    ) -> Result<StoreBatch, DataError> {
        self.service.check_writer(&self.caller, publication, writer_token).map_err(ProtocolError::from)?;
        let mut sources = Vec::with_capacity(chunks.len());
        for c in chunks {
            sources.push(ChunkSource {
                index: c.index,
                buffer: self.buffer(c)?,
                buffer_offset: BufferOffset(c.offset),
                len: c.len,
                crc32c: c.crc32c,
            });
        }
        self.stored_into.insert(publication);
        Ok(StoreBatch { publication, chunks: sources, is_last_batch, total_chunks })
    }

    /// What a store batch that ran answers: its bytes counted, its verdicts
    /// judged (a required native path not taken aborts the publication), its
    /// transfers on the timeline.
    fn store_end(
        &self,
        publication: u64,
        chunks: &[DataChunk],
        out: Result<BatchOutcome, StoreError>,
        took: std::time::Duration,
    ) -> Result<DataResponse, DataError> {
        let out = out.map_err(|e| {
            let e = DataError::from(e);
            self.note_failure("store_failed", publication, &e);
            e
        })?;
        for c in chunks {
            self.count_bytes(self.path_of(c), c.len);
        }
        let verdicts = match self.verdicts(publication, chunks) {
            Ok(v) => v,
            Err(e) => {
                let _ = self.service.store().abort(publication);
                self.note_failure("store_failed", publication, &e);
                return Err(e);
            }
        };
        let crcs: Vec<Option<u32>> = out.crcs.iter().copied().map(Some).collect();
        self.note_transfers("store", None, publication, chunks, &verdicts, took, &crcs, |c| c.len);
        Ok(DataResponse {
            ok: true,
            verdicts,
            completed: Some(out.completed),
            total: Some(out.total),
            publishable: Some(out.publishable),
            paths: chunks.iter().map(|c| self.path_of(c).to_string()).collect(),
            ..Default::default()
        })
    }

    /// A load authorized (the claim adopted, its reader this caller, not
    /// fenced; with `ack`, one that may acknowledge it) and its destinations
    /// resolved.
    fn load_begin(
        &self,
        receipt: &Receipt,
        chunks: &[DataChunk],
        ack: bool,
    ) -> Result<(Manifest, Vec<ChunkDest>), DataError> {
        let manifest = self.service.authorize_load(&self.caller, receipt)?;
        place::overlap(chunks, &manifest)?;
        if ack {
            self.check_ack(receipt, &manifest, chunks)?;
        }
        let mut dests = Vec::with_capacity(chunks.len());
        for c in chunks {
            dests.push(ChunkDest { index: c.index, buffer: self.buffer(c)?, buffer_offset: BufferOffset(c.offset) });
        }
        Ok((manifest, dests))
    }

    /// What a load that ran answers; what it served is what its claim may
    /// acknowledge.
    fn load_end(
        &self,
        receipt: &Receipt,
        manifest: &Manifest,
        chunks: &[DataChunk],
        crcs: Result<Vec<Option<u32>>, StoreError>,
        took: std::time::Duration,
    ) -> Result<DataResponse, DataError> {
        let crcs = crcs.map_err(|e| {
            let e = DataError::from(e);
            self.note_failure("load_failed", manifest.publication, &e);
            e
        })?;
        for c in chunks {
            if let Some(m) = manifest.chunks.get(c.index as usize) {
                self.count_bytes(self.path_of(c), m.len);
            }
        }
        let verdicts = self.verdicts(manifest.publication, chunks).inspect_err(|e| {
            self.note_failure("load_failed", manifest.publication, e);
        })?;
        self.note_transfers("load", Some(receipt), manifest.publication, chunks, &verdicts, took, &crcs, |c| {
            manifest.chunks.get(c.index as usize).map_or(0, |m| m.len)
        });
        // What this claim may acknowledge: each chunk as read (or, where the
        // daemon cannot read the reader's memory, as stored: the reader
        // verifies those itself).
        let served: Vec<(u32, u32)> = chunks
            .iter()
            .zip(&crcs)
            .filter_map(|(c, crc)| {
                let stored = manifest.chunks.get(c.index as usize)?.crc32c;
                Some((c.index, crc.unwrap_or(stored)))
            })
            .collect();
        let unverified: Vec<u32> =
            chunks.iter().zip(&crcs).filter(|(_, r)| r.is_none()).map(|(c, _)| c.index).collect();
        self.service.note_served(receipt, &served, &unverified);
        Ok(DataResponse {
            ok: true,
            crc32c: crcs.into_iter().flatten().collect(),
            unverified,
            verdicts,
            paths: chunks.iter().map(|c| self.path_of(c).to_string()).collect(),
            ..Default::default()
        })
    }

    /// The observed verdict of each chunk's transfer ([`TransferId::chunk`]).
    /// Empty without probes.
    fn verdicts(&self, publication: u64, chunks: &[DataChunk]) -> Result<Vec<String>, DataError> {
        let Some(p) = &self.provenance else { return Ok(Vec::new()) };
        let mut out = Vec::with_capacity(chunks.len());
        for c in chunks {
            let Some(transfer) = TransferId::try_chunk(publication, c.index).map(|t| t.0) else { continue };
            let path = self.path_of(c);
            let v = p.reader.verdict(transfer, crate::provenance::declared(path), p.class);
            self.metrics.verdict(path.as_str(), &v);
            if p.require_native && matches!(v, pdstor_probes::Verdict::Fallback(_)) {
                return Err(DataError::NotNative { publication, chunk: c.index, verdict: v.to_string(), path });
            }
            out.push(v.to_string());
        }
        Ok(out)
    }

    /// The client went away: abort what it left unpublished, drop its buffers.
    fn cleanup(&mut self) {
        let store = self.service.store().clone();
        for id in self.stored_into.drain() {
            if store.publication(id).is_some_and(|p| p.phase == Phase::Prepared) {
                let _ = store.abort(id);
            }
        }
        for (_, (id, len)) in self.buffers.drain() {
            let _ = store.unregister_buffer(id);
            self.service.policy().give(&self.caller, Resource::Buffer(len));
        }
    }
}
