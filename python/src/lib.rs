//! `pdstor._native`: the protocol as Python objects, mirroring
//! `pdstor_client`. Every call that waits — on the daemon, the data socket or
//! a checksum — releases the GIL. Errors become the exception classes of
//! `pdstor.errors`, one per refusal code, carrying the daemon's code, field
//! and message.
#![deny(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard};

use pdstor_client::code::RefusalCode;
use pdstor_client::layout::{Layout, Manifest};
use pdstor_client::many::get::{Finish, Getter, Got, Place as Destination, adopt_many, read_many, restore_many};
use pdstor_client::many::put::{Asked, PutItem, put_many};
use pdstor_client::many::staged::{StagedChunk, load_staged};
use pdstor_client::many::{BufferRef, DataPlane, next_key};
use pdstor_client::receipt::{Receipt as RustReceipt, restore_digest};
use pdstor_client::wire::{ClaimRequest, PrepareRequest, Prepared};
use pdstor_client::{ClientError, Place, Verify};
use pdstor_engine::PayloadPath;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

mod staged;
mod timeline;

/// What a binding call failed on, before it becomes a Python exception.
enum Failure {
    /// The client library's error (daemon refusal, transport, data plane, verification).
    Client(ClientError),
    /// A wrong argument or a step out of order, found here.
    Usage(String),
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::Client(e)
    }
}

/// The exception `pdstor.errors.error_for(code, status, field, message)` builds.
fn raise(py: Python<'_>, code: &str, status: u16, field: &str, message: &str) -> PyErr {
    let built = py
        .import("pdstor.errors")
        .and_then(|m| m.getattr("error_for"))
        .and_then(|f| f.call1((code, status, field, message)));
    match built {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

fn to_py(py: Python<'_>, f: Failure) -> PyErr {
    match f {
        Failure::Usage(m) => raise(py, "usage", 0, "", &m),
        Failure::Client(ClientError::Api(b)) => raise(py, &b.code, b.status, &b.field, &b.message),
        Failure::Client(e @ ClientError::Transport { .. }) => raise(py, "transport", 0, "", &e.to_string()),
        Failure::Client(ClientError::Data(m)) => raise(py, "data_plane", 0, "", &format!("data plane: {m}")),
        Failure::Client(e @ ClientError::Verify { .. }) => raise(py, "verify_failed", 0, "chunks", &e.to_string()),
    }
}

/// JSON text of a Python value (`json.dumps`).
fn dumps(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    obj.py().import("json")?.call_method1("dumps", (obj,))?.extract()
}

/// A Python value from JSON text (`json.loads`).
fn loads<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?.call_method1("loads", (text,))
}

/// A KV layout from a dict with the fields of `pdstor_client::layout::Layout`.
fn layout_from(obj: &Bound<'_, PyAny>) -> PyResult<Layout> {
    if !obj.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(
            "layout must be a dict with model_id, dtype, layers, kv_heads, head_dim, chunk_tokens and kv_format",
        ));
    }
    serde_json::from_str(&dumps(obj)?).map_err(|e| {
        PyValueError::new_err(format!(
            "layout {}: {e} (a layout is a dict with model_id: str, dtype: str, layers, kv_heads, head_dim, \
             chunk_tokens: int, kv_format: str)",
            obj.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A byte view of any C-contiguous buffer-protocol object (a bf16 tensor's
/// memoryview included: it is cast to bytes, not copied).
fn byte_view(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<pyo3::buffer::PyBuffer<u8>> {
    if let Ok(b) = pyo3::buffer::PyBuffer::<u8>::get(obj) {
        return Ok(b);
    }
    let bytes = obj
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .and_then(|m| m.call_method1("cast", ("B",)))
        .map_err(|e| {
            PyTypeError::new_err(format!("{what} must be a C-contiguous buffer (bytes, array, memoryview): {e}"))
        })?;
    pyo3::buffer::PyBuffer::<u8>::get(&bytes).map_err(|e| PyTypeError::new_err(format!("{what}: {e}")))
}

/// Memory the daemon reads stores from and loads into: a memfd, mapped here
/// and shared with the daemon once over the data socket.
///
/// It implements the buffer protocol, so `memoryview(buf)`,
/// `numpy.frombuffer(buf, dtype)` and `torch.frombuffer(buf, dtype=…)` view
/// the very bytes the daemon moves — no copy. Keep a view's owner alive while
/// you use the view.
#[pyclass(module = "pdstor", frozen)]
struct Buffer {
    inner: Arc<pdstor_engine::Buffer>,
    /// Unique for the process's life, so a registration is never mistaken
    /// for one of a freed buffer at the same address.
    id: u64,
    /// Loads into it are checked as they are copied out, not in place.
    staging: bool,
}

#[pymethods]
impl Buffer {
    /// A new buffer of `size` bytes (a multiple of 4096: direct I/O moves
    /// whole pages). With `staging`, loads into it are checked as a reader
    /// copies them out (`Reader.scatter`, `Reader.get_many(..., into=)`),
    /// one pass over the bytes, instead of in place by the daemon and then
    /// copied: for a buffer the bytes only pass through.
    #[new]
    #[pyo3(signature = (size, name = "pdstor", staging = false))]
    fn new(size: usize, name: &str, staging: bool) -> PyResult<Self> {
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(PyValueError::new_err(format!(
                "Buffer({size}): the size must be a positive multiple of 4096 (direct I/O moves whole pages)"
            )));
        }
        let b = pdstor_engine::Buffer::memfd(name, size)
            .map_err(|e| PyValueError::new_err(format!("Buffer({size}): {e}")))?;
        Ok(Buffer { inner: Arc::new(b), id: next_key(), staging })
    }

    /// Whether loads into it are checked as they are copied out (see `Buffer`).
    #[getter]
    fn staging(&self) -> bool {
        self.staging
    }

    /// This process's own shared-memory file (`/dev/shm/<name>`, the pool
    /// LMCache allocates its memory objects from when its config sets
    /// `shm_name`) as a buffer: the first `size` bytes (default: the whole
    /// file), no copy. The daemon then moves payload straight between the
    /// device and that memory. It maps the file for its I/O and reads or
    /// writes it itself only through the file, so shrinking the file fails
    /// a transfer, never the daemon. The file must be on tmpfs.
    #[staticmethod]
    #[pyo3(signature = (path, size = None))]
    fn shared_file(path: std::path::PathBuf, size: Option<usize>) -> PyResult<Self> {
        let what =
            |e: &dyn std::fmt::Display| PyValueError::new_err(format!("Buffer.shared_file({}): {e}", path.display()));
        let file = std::fs::File::options().read(true).write(true).open(&path).map_err(|e| what(&e))?;
        let len = match size {
            Some(n) => n,
            None => usize::try_from(file.metadata().map_err(|e| what(&e))?.len()).map_err(|e| what(&e))?,
        };
        let b = pdstor_engine::Buffer::from_shm_file(file.into(), len, true).map_err(|e| what(&e))?;
        Ok(Buffer { inner: Arc::new(b), id: next_key(), staging: false })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!("pdstor.Buffer({} bytes, {})", self.inner.len(), self.inner.kind())
    }

    /// Copies `data` (any object with the buffer protocol: bytes, a numpy
    /// array, a contiguous tensor's memoryview…) into the buffer at `offset`.
    fn write(&self, py: Python<'_>, offset: u64, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let src = byte_view(data, "write: data")?;
        if !src.is_c_contiguous() {
            return Err(PyValueError::new_err("write: data must be C-contiguous"));
        }
        let len = src.len_bytes();
        self.inner.check_range(offset, len).map_err(|e| PyValueError::new_err(format!("write: {e}")))?;
        let (from, to) = (src.buf_ptr() as usize, self.inner.clone());
        py.detach(move || {
            // SAFETY: `src` (a held PyBuffer, alive until the end of this
            // function) exports `len` readable bytes at `from`.
            let bytes = unsafe { std::slice::from_raw_parts(from as *const u8, len) };
            to.write_at(offset, bytes)
        })
        .map_err(|e| PyValueError::new_err(format!("write: {e}")))?;
        drop(src);
        Ok(())
    }

    /// Copies `len(dest)` bytes at `offset` into `dest` (any writable,
    /// C-contiguous buffer: a bytearray, a numpy array, a tensor's memoryview).
    fn read_into(&self, py: Python<'_>, offset: u64, dest: &Bound<'_, PyAny>) -> PyResult<()> {
        let dst = byte_view(dest, "read_into: dest")?;
        if dst.readonly() || !dst.is_c_contiguous() {
            return Err(PyValueError::new_err("read_into: dest must be writable and C-contiguous"));
        }
        let len = dst.len_bytes();
        self.inner.check_range(offset, len).map_err(|e| PyValueError::new_err(format!("read_into: {e}")))?;
        let (to, from) = (dst.buf_ptr() as usize, self.inner.clone());
        py.detach(move || {
            // SAFETY: `dst` (a held, writable PyBuffer, alive until the end
            // of this function) exports `len` bytes at `to`.
            let bytes = unsafe { std::slice::from_raw_parts_mut(to as *mut u8, len) };
            from.read_at(offset, bytes)
        })
        .map_err(|e| PyValueError::new_err(format!("read_into: {e}")))?;
        drop(dst);
        Ok(())
    }

    /// Copies `len` bytes at `offset` out, as `bytes`.
    fn read(&self, offset: u64, len: usize) -> PyResult<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.inner.read_at(offset, &mut out).map_err(|e| PyValueError::new_err(format!("read: {e}")))?;
        Ok(out)
    }

    /// Copies pieces out of the `len` bytes at `offset` and answers the
    /// crc32c of all `len` bytes, reading each once: `pieces` is a list of
    /// `(at, dest)` — `len(dest)` bytes from `at` within the range into
    /// `dest` (writable, C-contiguous), ascending, not overlapping; the
    /// bytes between pieces are checksummed only. What `Reader.scatter`
    /// does with a staged chunk before it compares the manifest's crc32c.
    fn copy_out(&self, py: Python<'_>, offset: u64, len: usize, pieces: &Bound<'_, PyAny>) -> PyResult<u32> {
        let dests = staged::dests(pieces, "copy_out")?;
        staged::in_order(&dests, len as u64, "copy_out")?;
        staged::disjoint(&dests.iter().map(|(_, d)| d).collect::<Vec<_>>(), &[&BufferRef::from(self)])?;
        let b = self.inner.clone();
        py.detach(|| b.copy_out_checked(offset, len, &mut staged::pieces(&dests)))
            .map_err(|e| PyValueError::new_err(format!("copy_out: {e}")))
    }

    /// crc32c of `len` bytes at `offset`, computed in place (what the daemon and a reader check).
    fn crc32c(&self, py: Python<'_>, offset: u64, len: usize) -> PyResult<u32> {
        let b = self.inner.clone();
        py.detach(move || b.crc32c(offset, len)).map_err(|e| PyValueError::new_err(format!("crc32c: {e}")))
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let this = slf.get();
        let ptr = this.inner.as_mut_ptr().map_err(|e| PyValueError::new_err(e.to_string()))?;
        let len = ffi::Py_ssize_t::try_from(this.inner.len())
            .map_err(|_| PyValueError::new_err("the buffer is larger than Python can index"))?;
        // SAFETY: `view` is the Py_buffer the interpreter passes to
        // bf_getbuffer; `ptr` and `len` describe the writable mapping, which
        // lives as long as `slf` — and FillInfo takes a reference to `slf`
        // that the view holds until it is released.
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast(), len, 0, flags) };
        if rc == -1 { Err(PyErr::fetch(slf.py())) } else { Ok(()) }
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// A signed receipt: READY (from `publish` or `lookup`) or a claim (from
/// `claim`). Hand it to another process as `to_json()` (or pickle it).
#[pyclass(module = "pdstor", frozen)]
#[derive(Clone)]
struct Receipt {
    inner: RustReceipt,
}

#[pymethods]
impl Receipt {
    /// A receipt from the JSON `to_json` (or the daemon's HTTP API) gave.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        serde_json::from_str(text)
            .map(|inner| Receipt { inner })
            .map_err(|e| PyValueError::new_err(format!("Receipt.from_json: not a receipt: {e}")))
    }
    /// The receipt as the daemon's JSON.
    fn to_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.inner).map_err(|e| PyValueError::new_err(e.to_string()))
    }
    /// `"READY"` or `"CLAIM"`.
    #[getter]
    fn kind(&self) -> PyResult<String> {
        Ok(serde_json::to_value(self.inner.kind)
            .map_err(|e| PyValueError::new_err(e.to_string()))?
            .as_str()
            .unwrap_or_default()
            .to_owned())
    }
    /// The publication's number.
    #[getter]
    fn publication(&self) -> u64 {
        self.inner.publication
    }
    /// The request id it was prepared as.
    #[getter]
    fn req_id(&self) -> &str {
        &self.inner.req_id
    }
    /// The daemon epoch that signed it.
    #[getter]
    fn epoch(&self) -> u64 {
        self.inner.epoch
    }
    /// The namespace's uuid.
    #[getter]
    fn namespace(&self) -> &str {
        &self.inner.namespace
    }
    /// SHA-256 of the manifest it vouches for.
    #[getter]
    fn manifest_digest(&self) -> &str {
        &self.inner.manifest_digest
    }
    /// The claimed reader (claim receipts).
    #[getter]
    fn reader(&self) -> Option<&str> {
        self.inner.reader.as_deref()
    }
    /// The claimed session (claim receipts).
    #[getter]
    fn session(&self) -> Option<&str> {
        self.inner.session.as_deref()
    }
    fn __repr__(&self) -> String {
        format!(
            "pdstor.Receipt({} publication {} req_id {:?} epoch {})",
            self.kind().unwrap_or_default(),
            self.inner.publication,
            self.inner.req_id,
            self.inner.epoch
        )
    }
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<Receipt>().is_ok_and(|o| o.get().inner == self.inner)
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (String,))> {
        let ctor = slf.get_type().getattr("from_json")?;
        Ok((ctor, (slf.get().to_json()?,)))
    }
}

/// The daemon's two planes: HTTP control and the data socket.
struct Conn {
    control: pdstor_client::Client,
    data: Mutex<DataPlane>,
    server: String,
}

impl From<&Buffer> for BufferRef {
    fn from(b: &Buffer) -> Self {
        BufferRef { inner: b.inner.clone(), key: b.id, unchecked: b.staging, path: PayloadPath::HostFixed }
    }
}

/// A connection to one `pdstor serve`: its control plane (`server`:
/// `unix:/run/pdstor/control.sock`, `https://host:port` or `http://host:port`)
/// and its data socket (buffers are shared over it once, by fd).
#[pyclass(module = "pdstor", frozen)]
struct Client {
    conn: Arc<Conn>,
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (server = "unix:/run/pdstor/control.sock", data_socket = "/run/pdstor/data.sock"))]
    fn new(server: &str, data_socket: &str) -> Self {
        let data = DataPlane::new(std::path::Path::new(data_socket));
        Client {
            conn: Arc::new(Conn {
                control: pdstor_client::Client::new(server),
                data: Mutex::new(data),
                server: server.into(),
            }),
        }
    }

    fn __repr__(&self) -> String {
        format!("pdstor.Client({:?}, {:?})", self.conn.server, lock(&self.conn.data).socket())
    }

    /// Raises unless the daemon answers and its store has not failed.
    fn healthz(&self, py: Python<'_>) -> PyResult<()> {
        let c = self.conn.clone();
        py.detach(move || c.control.healthz()).map_err(|e| to_py(py, e.into()))
    }

    /// The daemon's `/metrics` (OpenMetrics text; an admin's: the daemon's
    /// own user, or a token with the admin role).
    fn metrics(&self, py: Python<'_>) -> PyResult<String> {
        let c = self.conn.clone();
        py.detach(move || c.control.metrics()).map_err(|e| to_py(py, e.into()))
    }

    /// Shares `buffer` with the daemon now (otherwise the first store or load
    /// into it does). A connection may share a bounded number of buffers
    /// (the daemon's `--max-buffers-per-connection`): use a few large ones.
    fn register(&self, py: Python<'_>, buffer: PyRef<'_, Buffer>) -> PyResult<()> {
        let (c, b) = (self.conn.clone(), BufferRef::from(&*buffer));
        py.detach(move || lock(&c.data).id_of(&b).map(drop)).map_err(|e| to_py(py, e.into()))
    }

    /// The namespace the daemon serves: `namespace`, `epoch`, `slot_size`
    /// (the largest chunk), `slot_count`, `device`, `reservations`.
    fn namespace<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.conn.clone();
        let ns = py.detach(move || c.control.namespace()).map_err(|e| to_py(py, e.into()))?;
        loads(py, &serde_json::to_string(&ns).map_err(|e| PyValueError::new_err(e.to_string()))?)
    }

    /// Live publications (of one `state`, e.g. `"READY"`), as dicts;
    /// `verbose` adds each chunk's `extents` on the target.
    #[pyo3(signature = (state = None, verbose = false))]
    fn publications<'py>(&self, py: Python<'py>, state: Option<String>, verbose: bool) -> PyResult<Bound<'py, PyAny>> {
        let c = self.conn.clone();
        let list =
            py.detach(move || c.control.publications(state.as_deref(), verbose)).map_err(|e| to_py(py, e.into()))?;
        loads(py, &serde_json::to_string(&list).map_err(|e| PyValueError::new_err(e.to_string()))?)
    }

    /// The READY receipt of each request named, or `None` where there is
    /// none this caller may claim or release (unknown, not READY yet, already
    /// claimed, another tenant's).
    fn lookup(&self, py: Python<'_>, req_ids: Vec<String>) -> PyResult<Vec<Option<Receipt>>> {
        let c = self.conn.clone();
        let found = py.detach(move || c.control.lookup(&req_ids)).map_err(|e| to_py(py, e.into()))?;
        Ok(found.into_iter().map(|r| r.map(|inner| Receipt { inner })).collect())
    }

    /// Frees a READY publication no reader claimed (exact unread release).
    fn release(&self, py: Python<'_>, receipt: PyRef<'_, Receipt>) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), receipt.inner.clone());
        py.detach(move || c.control.release(&r)).map_err(|e| to_py(py, e.into()))
    }

    /// Closes the reader session `receipt` (a claim or read receipt of it)
    /// names: its claims become reclaimable, its reads end, and nothing of
    /// it claims or reads again. Its owner or an admin closes it.
    fn close_session(&self, py: Python<'_>, receipt: PyRef<'_, Receipt>) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), receipt.inner.clone());
        py.detach(move || c.control.close_session(&r)).map_err(|e| to_py(py, e.into()))
    }

    /// Frees the slots of a fenced claim (its session closed, or from an
    /// earlier epoch): the claim `receipt`'s holder, or an admin.
    fn reclaim(&self, py: Python<'_>, receipt: PyRef<'_, Receipt>) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), receipt.inner.clone());
        py.detach(move || c.control.reclaim(&r)).map_err(|e| to_py(py, e.into()))
    }

    /// An operator's (admin's) reclaim of publication `publication`, whose
    /// reader is gone and cannot repeat its claim: its session is closed
    /// first, then the claim reclaimed, for `reason` (on the timeline).
    fn reclaim_publication(&self, py: Python<'_>, publication: u64, reason: String) -> PyResult<()> {
        let c = self.conn.clone();
        py.detach(move || c.control.reclaim_publication(publication, &reason)).map_err(|e| to_py(py, e.into()))
    }

    /// An operator's (admin's) end of every read of the cache publication
    /// `publication`, its reader gone, for `reason` (on the timeline);
    /// answers how many reads ended.
    fn end_reads(&self, py: Python<'_>, publication: u64, reason: String) -> PyResult<u64> {
        let c = self.conn.clone();
        py.detach(move || c.control.end_reads_of(publication, &reason)).map_err(|e| to_py(py, e.into()))
    }

    /// Gives up request `req_id` while it waits for capacity or is PREPARED;
    /// answers what happened (`"cancelled"`, `"aborted"`, `"not_found"`, …).
    fn cancel(&self, py: Python<'_>, req_id: String) -> PyResult<String> {
        let c = self.conn.clone();
        let outcome = py.detach(move || c.control.cancel(&req_id)).map_err(|e| to_py(py, e.into()))?;
        let v = serde_json::to_value(outcome).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(v.get("outcome").and_then(|o| o.as_str()).map_or_else(|| v.to_string(), str::to_owned))
    }
}

/// One chunk to store: where its bytes are.
struct StoreChunk {
    index: u32,
    buffer: BufferRef,
    offset: u64,
    len: u64,
}

fn store_chunks(chunks: &Bound<'_, PyAny>) -> PyResult<Vec<StoreChunk>> {
    let mut out = Vec::new();
    for item in chunks.try_iter()? {
        let item = item?;
        let (index, buffer, offset, len): (u32, PyRef<'_, Buffer>, u64, u64) = item.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "a store chunk is (index: int, buffer: pdstor.Buffer, offset: int, length: int), not {}",
                item.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        out.push(StoreChunk { index, buffer: BufferRef::from(&*buffer), offset, len });
    }
    Ok(out)
}

/// Stores one batch through the data plane ([`DataConn::store_from`]).
fn store_batch(conn: &Conn, p: &Prepared, chunks: &[StoreChunk], last: bool, total: u32) -> Result<(), ClientError> {
    let mut data = lock(&conn.data);
    let ids = chunks.iter().map(|c| data.id_of(&c.buffer)).collect::<Result<Vec<u32>, ClientError>>()?;
    let places: Vec<Place<'_>> = chunks
        .iter()
        .zip(ids)
        .map(|(c, buffer_id)| Place {
            index: c.index,
            buffer: &c.buffer.inner,
            buffer_id,
            offset: c.offset,
            len: c.len,
        })
        .collect();
    data.with(|d| d.store_from(p, &places, last, total)).map(drop)
}

/// The prefill side of one publication at a time:
/// `prepare` → `store` (one or more batches) → `publish`, or `put` for all three.
#[pyclass(module = "pdstor")]
struct Writer {
    conn: Arc<Conn>,
    writer_id: String,
    /// The publication prepared and not yet published or aborted, with its total.
    current: Option<(Prepared, u32)>,
}

#[pymethods]
impl Writer {
    /// A writer on `client`, recorded with each publication as `writer_id`.
    #[new]
    #[pyo3(signature = (client, writer_id = "python"))]
    fn new(client: PyRef<'_, Client>, writer_id: &str) -> Self {
        Writer { conn: client.conn.clone(), writer_id: writer_id.into(), current: None }
    }

    /// Reserves `total_chunks` slots for request `req_id` (waiting up to
    /// `timeout_ms` for capacity; `pdstor.AdmissionTimeout` after that).
    /// With `unread_release_ms`, the daemon releases the publication unread
    /// if no reader claims it that long after READY (the daemon's
    /// `--unread-release-ms`, where shorter, bounds it). With `cache=True`,
    /// a cache publication: read by many (no claim), kept until released
    /// (or evicted, or past an unread window, where one applies).
    /// Returns the publication's number.
    #[pyo3(signature = (req_id, layout, total_chunks, timeout_ms = None, unread_release_ms = None, cache = false))]
    #[allow(clippy::too_many_arguments)] // a Python method's keyword arguments
    fn prepare(
        &mut self,
        py: Python<'_>,
        req_id: String,
        layout: &Bound<'_, PyAny>,
        total_chunks: u32,
        timeout_ms: Option<u64>,
        unread_release_ms: Option<u64>,
        cache: bool,
    ) -> PyResult<u64> {
        if let Some((p, _)) = &self.current {
            return Err(to_py(
                py,
                Failure::Usage(format!(
                    "prepare: publication {} is still open on this writer: publish() or abort() it first",
                    p.publication
                )),
            ));
        }
        let layout = layout_from(layout)?;
        let (c, writer) = (self.conn.clone(), self.writer_id.clone());
        let r = PrepareRequest { req_id, layout, total_chunks, writer, timeout_ms, unread_release_ms, cache };
        let p = py.detach(move || c.control.prepare_request(&r)).map_err(|e| to_py(py, e.into()))?;
        let id = p.publication;
        self.current = Some((p, total_chunks));
        Ok(id)
    }

    /// Stores one batch: `chunks` is a list of `(index, buffer, offset,
    /// length)`; `last=True` on the final batch. The daemon checks each
    /// chunk's crc32c as it lands. A refused batch rolls the whole
    /// publication back — aborted, its slots free — and the writer is free
    /// again.
    #[pyo3(signature = (chunks, last = false))]
    fn store(&mut self, py: Python<'_>, chunks: &Bound<'_, PyAny>, last: bool) -> PyResult<()> {
        let chunks = store_chunks(chunks)?;
        let Some((p, total)) = self.current.clone() else {
            return Err(to_py(
                py,
                Failure::Usage("store: nothing prepared on this writer: call prepare() first".into()),
            ));
        };
        let c = self.conn.clone();
        let r = py.detach(move || {
            store_batch(&c, &p, &chunks, last, total).inspect_err(|_| {
                // The daemon rolls back a refused batch's publication; a
                // batch refused before it reached the daemon is rolled back
                // here, so nothing stays PREPARED behind a forgotten token.
                let _ = c.control.abort(p.publication, &p.writer_token);
            })
        });
        if let Err(e) = r {
            self.current = None;
            return Err(to_py(py, e.into()));
        }
        Ok(())
    }

    /// Makes the publication READY (its chunks flushed to the device first)
    /// and returns its READY receipt.
    #[pyo3(signature = (first_token = None))]
    fn publish(&mut self, py: Python<'_>, first_token: Option<u32>) -> PyResult<Receipt> {
        let Some((p, _)) = self.current.clone() else {
            return Err(to_py(py, Failure::Usage("publish: nothing prepared on this writer".into())));
        };
        let c = self.conn.clone();
        // A refused publish (not every chunk stored yet) leaves the
        // publication open: store the rest, or abort it.
        let published = py
            .detach(move || c.control.publish(p.publication, &p.writer_token, first_token))
            .map_err(|e| to_py(py, e.into()))?;
        self.current = None;
        Ok(Receipt { inner: published.receipt })
    }

    /// Rolls back the open publication (its slots free); answers
    /// `"aborted"`, `"pending"` or `"none"` when nothing was open.
    fn abort(&mut self, py: Python<'_>) -> PyResult<String> {
        let Some((p, _)) = self.current.take() else { return Ok("none".into()) };
        let c = self.conn.clone();
        let r = py.detach(move || c.control.abort(p.publication, &p.writer_token)).map_err(|e| to_py(py, e.into()))?;
        Ok(r.outcome)
    }

    /// The open publication's number, if one is prepared.
    #[getter]
    fn publication(&self) -> Option<u64> {
        self.current.as_ref().map(|(p, _)| p.publication)
    }

    /// The open publication as a token another process of the same engine
    /// (a serving engine's worker, when this writer is its scheduler) hands
    /// to [`Writer.resume`] to store into it. It carries the writer's secret
    /// token: whoever holds it may store, publish and abort this
    /// publication, so it travels only inside one trust domain, never to a
    /// reader.
    fn handoff(&self, py: Python<'_>) -> PyResult<String> {
        let Some((p, total)) = &self.current else {
            return Err(to_py(
                py,
                Failure::Usage("handoff: nothing prepared on this writer: call prepare() first".into()),
            ));
        };
        let v = serde_json::json!({ "prepared": p, "total_chunks": total });
        Ok(v.to_string())
    }

    /// A writer on `client` holding the publication another writer prepared
    /// and handed off ([`Writer.handoff`]): its stores, publish and abort
    /// carry that publication's token. The daemon still checks the token
    /// and the publication's state on every step.
    #[staticmethod]
    #[pyo3(signature = (client, handoff, writer_id = "python"))]
    fn resume(client: PyRef<'_, Client>, handoff: &str, writer_id: &str) -> PyResult<Self> {
        let current = Some(parse_handoff("Writer.resume", handoff)?);
        Ok(Writer { conn: client.conn.clone(), writer_id: writer_id.into(), current })
    }

    /// Publishes many handed-off publications in one round trip and one
    /// commit (a serving engine's step's worth): `items` is a list of
    /// `(handoff, first_token)`, each handoff what [`Writer.handoff`]
    /// returned. Answers one entry per item, in order: its READY `Receipt`,
    /// or the `pdstor.Error` that refused it (that publication left open, to
    /// store the rest or abort); one refusal never raises.
    #[staticmethod]
    fn publish_many<'py>(
        py: Python<'py>,
        client: PyRef<'_, Client>,
        items: Vec<(String, Option<u32>)>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let prepared = items
            .iter()
            .map(|(handoff, token)| Ok((parse_handoff("Writer.publish_many", handoff)?.0, *token)))
            .collect::<PyResult<Vec<(Prepared, Option<u32>)>>>()?;
        let c = client.conn.clone();
        let done = py
            .detach(move || {
                let asks: Vec<(&Prepared, Option<u32>)> = prepared.iter().map(|(p, t)| (p, *t)).collect();
                c.control.publish_many(&asks)
            })
            .map_err(|e| to_py(py, e.into()))?;
        done.into_iter()
            .map(|r| entry(py, r, |p| Ok(Bound::new(py, Receipt { inner: p.receipt })?.into_any())))
            .collect()
    }

    /// prepare → store (`batch` chunks per request) → publish, in one call:
    /// `chunks` is a list of `(buffer, offset, length)`, chunk 0 first.
    /// Anything refused on the way aborts the publication and raises.
    #[pyo3(signature = (req_id, layout, chunks, batch = 16, first_token = None, timeout_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &mut self,
        py: Python<'_>,
        req_id: String,
        layout: &Bound<'_, PyAny>,
        chunks: &Bound<'_, PyAny>,
        batch: usize,
        first_token: Option<u32>,
        timeout_ms: Option<u64>,
    ) -> PyResult<Receipt> {
        if self.current.is_some() {
            return Err(to_py(py, Failure::Usage("put: a publication is still open on this writer".into())));
        }
        let layout = layout_from(layout)?;
        let mut list = Vec::new();
        for (i, item) in chunks.try_iter()?.enumerate() {
            let item = item?;
            let (buffer, offset, len): (PyRef<'_, Buffer>, u64, u64) = item.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "put: a chunk is (buffer: pdstor.Buffer, offset: int, length: int), not {}",
                    item.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            })?;
            u32::try_from(i).map_err(|_| PyValueError::new_err("put: too many chunks"))?;
            list.push((BufferRef::from(&*buffer), offset, len));
        }
        if list.is_empty() {
            return Err(PyValueError::new_err("put: a publication needs at least one chunk"));
        }
        // A put of one: the same path as put_many's, its chunks stored `batch` per store request.
        let c = self.conn.clone();
        let asked =
            Asked { writer: self.writer_id.clone(), first_token, timeout_ms, batch: Some(batch), ..Asked::default() };
        let r = py.detach(move || {
            put_many(&c.control, &c.data, &layout, vec![PutItem { req_id, chunks: list }], &asked)?
                .into_iter()
                .next()
                .unwrap_or_else(|| Err(ClientError::Data("a put of one answered nothing".into())))
        });
        r.map(|p| Receipt { inner: p.receipt }).map_err(|e| to_py(py, e.into()))
    }

    /// Puts many requests at once: `items` is a list of `(req_id, chunks)`,
    /// `chunks` a list of `(buffer, offset, length)`, chunk 0 first. Three
    /// round trips whatever their number — one `prepare` batch, one
    /// data-plane frame of stores (one device submission), one `publish`
    /// batch (one commit). Answers one entry per item, in order: its READY
    /// `Receipt`, or the `pdstor.Error` it failed with (nothing of it is
    /// left prepared); one item's failure never raises. With `cache=True`,
    /// cache publications (read by many, never claimed). With
    /// `unread_release_ms`, the daemon releases an item no reader claims
    /// (a cache item: reads) for that long.
    #[pyo3(signature = (items, layout, first_token = None, timeout_ms = None, cache = false, unread_release_ms = None))]
    #[allow(clippy::too_many_arguments)] // a Python method's keyword arguments
    fn put_many<'py>(
        &self,
        py: Python<'py>,
        items: &Bound<'py, PyAny>,
        layout: &Bound<'py, PyAny>,
        first_token: Option<u32>,
        timeout_ms: Option<u64>,
        cache: bool,
        unread_release_ms: Option<u64>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        if self.current.is_some() {
            return Err(to_py(py, Failure::Usage("put_many: a publication is still open on this writer".into())));
        }
        let layout = layout_from(layout)?;
        let mut list = Vec::new();
        for item in items.try_iter()? {
            let item = item?;
            let bad = || {
                PyTypeError::new_err(format!(
                    "put_many: an item is (req_id: str, chunks: list of (buffer, offset, length)), not {}",
                    item.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            };
            let (req_id, chunks): (String, Bound<'py, PyAny>) = item.extract().map_err(|_| bad())?;
            let mut places = Vec::new();
            for c in chunks.try_iter()? {
                let (buffer, offset, len): (PyRef<'_, Buffer>, u64, u64) = c?.extract().map_err(|_| bad())?;
                places.push((BufferRef::from(&*buffer), offset, len));
            }
            list.push(PutItem { req_id, chunks: places });
        }
        let c = self.conn.clone();
        let asked =
            Asked { writer: self.writer_id.clone(), first_token, timeout_ms, unread_release_ms, cache, batch: None };
        let done =
            py.detach(move || put_many(&c.control, &c.data, &layout, list, &asked)).map_err(|e| to_py(py, e.into()))?;
        done.into_iter()
            .map(|r| entry(py, r, |p| Ok(Bound::new(py, Receipt { inner: p.receipt })?.into_any())))
            .collect()
    }
}

/// What a reader verified of one adopted claim.
struct Adopted {
    manifest: Manifest,
    /// Chunk index → crc32c of the bytes this process received, checked
    /// against the manifest.
    verified: BTreeMap<u32, u32>,
    /// Chunks loaded into a staging buffer, to check as they are copied out.
    staged: BTreeMap<u32, StagedChunk>,
}

/// The decode side: `claim` → `adopt` → `load` (each chunk's crc32c, taken
/// in place in this process's buffer, checked against the manifest) → `ack`; or `get` for all of it. A failed load is never
/// a silent miss: it raises, and `fail` keeps the publication RETAINED for a
/// retry instead of freeing it.
#[pyclass(module = "pdstor")]
struct Reader {
    conn: Arc<Conn>,
    reader_id: String,
    session: String,
    /// Claim signature → what was adopted and verified.
    adopted: HashMap<String, Adopted>,
    /// Who checksums what this reader loads.
    verify: Verify,
}

impl Reader {
    /// The restore digest of the claim or read `sig` for `step` (ack,
    /// end_read): every chunk loaded and checked here, none left staged.
    fn restored(&self, step: &str, sig: &str) -> Result<String, Failure> {
        let Some(a) = self.adopted.get(sig) else {
            return Err(Failure::Usage(format!("{step}: this receipt is not adopted or read by this reader")));
        };
        if !a.staged.is_empty() {
            let staged: Vec<u32> = a.staged.keys().copied().collect();
            return Err(Failure::Usage(format!(
                "{step}: chunks {staged:?} were loaded into a staging buffer and not copied out: scatter() them (each is checked as it is copied)"
            )));
        }
        let missing: Vec<u32> =
            a.manifest.chunks.iter().map(|c| c.index).filter(|i| !a.verified.contains_key(i)).collect();
        if !missing.is_empty() {
            return Err(Failure::Usage(format!(
                "{step}: chunks {missing:?} were not loaded and verified: load() them first"
            )));
        }
        let crcs: Vec<u32> = a.verified.values().copied().collect();
        Ok(restore_digest(a.manifest.restore_nonce.as_deref().unwrap_or_default(), &crcs))
    }
}

fn manifest_dict<'py>(py: Python<'py>, m: &Manifest) -> PyResult<Bound<'py, PyAny>> {
    loads(py, &serde_json::to_string(m).map_err(|e| PyValueError::new_err(e.to_string()))?)
}

/// Loads chunks of an adopted claim to their places, each crc32c checked
/// against the manifest ([`DataConn::load_verified`]).
fn load_verified(
    conn: &Conn,
    claim: &RustReceipt,
    manifest: &Manifest,
    places: &[(u32, BufferRef, u64)],
    verify: Verify,
) -> Result<Vec<(u32, u32)>, ClientError> {
    let mut data = lock(&conn.data);
    let ids = places.iter().map(|(_, b, _)| data.id_of(b)).collect::<Result<Vec<u32>, ClientError>>()?;
    let places: Vec<Place<'_>> = places
        .iter()
        .zip(ids)
        .map(|((index, b, offset), buffer_id)| Place {
            index: *index,
            buffer: &b.inner,
            buffer_id,
            offset: *offset,
            len: 0,
        })
        .collect();
    data.with(|d| d.load_verified(claim, manifest, &places, verify))
}

#[pymethods]
impl Reader {
    /// A reader on `client`: `reader_id` and `session` are what claims bind
    /// (a new session per process by default). `verify`: `"daemon"` takes
    /// the crc32c the daemon computed in place in this process's buffer as
    /// each chunk landed (checked against the manifest; what it could not
    /// read is checksummed here); `"local"` checksums every chunk here too.
    #[new]
    #[pyo3(signature = (client, reader_id = "python", session = None, verify = "daemon"))]
    fn new(client: PyRef<'_, Client>, reader_id: &str, session: Option<String>, verify: &str) -> PyResult<Self> {
        let verify: Verify = verify.parse().map_err(PyValueError::new_err)?;
        let session = session.unwrap_or_else(|| format!("py-{}-{}", std::process::id(), next_key()));
        Ok(Reader { conn: client.conn.clone(), reader_id: reader_id.into(), session, adopted: HashMap::new(), verify })
    }

    /// This reader's session id.
    #[getter]
    fn session(&self) -> &str {
        &self.session
    }

    /// Binds this reader and session to a READY publication for `lease_ms`;
    /// returns the claim receipt. With `layout` (the one this reader will
    /// adopt with), a publication stored with another layout is refused
    /// (`pdstor.LayoutMismatch`) before it is claimed and stays READY for a
    /// reader that can restore it.
    #[pyo3(signature = (ready, lease_ms = 60_000, layout = None))]
    fn claim(
        &self,
        py: Python<'_>,
        ready: PyRef<'_, Receipt>,
        lease_ms: u64,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Receipt> {
        let layout = layout.map(layout_from).transpose()?;
        let (c, r) = (self.conn.clone(), ready.inner.clone());
        let (reader, session) = (self.reader_id.clone(), self.session.clone());
        let claim = py
            .detach(move || match &layout {
                Some(layout) => c.control.claim_for(&r, &reader, &session, lease_ms, layout),
                None => c.control.claim(&r, &reader, &session, lease_ms),
            })
            .map_err(|e| to_py(py, e.into()))?;
        Ok(Receipt { inner: claim })
    }

    /// Claims many READY publications for this reader and session in one
    /// round trip and one commit (`lease_ms` and `layout` as for `claim`).
    /// Answers one entry per receipt, in order: its claim `Receipt`, or the
    /// `pdstor.Error` that refused it; one refusal never raises.
    #[pyo3(signature = (readies, lease_ms = 60_000, layout = None))]
    fn claim_many<'py>(
        &self,
        py: Python<'py>,
        readies: Vec<PyRef<'py, Receipt>>,
        lease_ms: u64,
        layout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let layout = layout.map(layout_from).transpose()?;
        let asks: Vec<ClaimRequest> = readies
            .iter()
            .map(|r| ClaimRequest {
                receipt: r.inner.clone(),
                reader_id: self.reader_id.clone(),
                session_id: self.session.clone(),
                lease_ms,
                layout: layout.clone(),
                adopt: false,
            })
            .collect();
        let c = self.conn.clone();
        let done = py.detach(move || c.control.claim_many(asks)).map_err(|e| to_py(py, e.into()))?;
        done.into_iter()
            .map(|r| entry(py, r, |claim| Ok(Bound::new(py, Receipt { inner: claim })?.into_any())))
            .collect()
    }

    /// Confirms what this reader reads — the claim, its manifest digest and
    /// the layout it expects (`pdstor.LayoutMismatch` if the writer stored
    /// another) — and returns the manifest as a dict (`chunks`: each chunk's
    /// `index`, `len`, `crc32c`).
    fn adopt<'py>(
        &mut self,
        py: Python<'py>,
        claim: PyRef<'_, Receipt>,
        layout: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layout = layout_from(layout)?;
        let (c, r) = (self.conn.clone(), claim.inner.clone());
        let manifest = py.detach(move || c.control.adopt_claim(&r, &layout)).map_err(|e| to_py(py, e.into()))?;
        let dict = manifest_dict(py, &manifest)?;
        self.adopted.insert(
            claim.inner.signature.clone(),
            Adopted { manifest, verified: BTreeMap::new(), staged: BTreeMap::new() },
        );
        Ok(dict)
    }

    /// Loads chunks of an adopted claim: `chunks` is a list of `(index,
    /// buffer, offset)`; each lands at its offset and its crc32c — taken in
    /// place in this buffer by the daemon, or here too with
    /// `verify="local"` — is checked against the manifest
    /// (`pdstor.VerifyFailed`). A chunk loaded into a staging buffer
    /// (`Buffer(..., staging=True)`) is checked as `scatter` copies it out.
    fn load(&mut self, py: Python<'_>, claim: PyRef<'_, Receipt>, chunks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut places = Vec::new();
        for item in chunks.try_iter()? {
            let item = item?;
            let (index, buffer, offset): (u32, PyRef<'_, Buffer>, u64) = item.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "a load chunk is (index: int, buffer: pdstor.Buffer, offset: int), not {}",
                    item.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            })?;
            places.push((index, BufferRef::from(&*buffer), offset));
        }
        let sig = claim.inner.signature.clone();
        let Some(adopted) = self.adopted.get(&sig) else {
            return Err(to_py(
                py,
                Failure::Usage("load: this claim is not adopted by this reader: adopt() it first".into()),
            ));
        };
        let (c, r, m) = (self.conn.clone(), claim.inner.clone(), adopted.manifest.clone());
        let verify = self.verify;
        let (to_stage, places): (Vec<_>, Vec<_>) = places.into_iter().partition(|(_, b, _)| b.unchecked);
        let (verified, staged) = py
            .detach(move || -> Result<_, ClientError> {
                let verified = if places.is_empty() { Vec::new() } else { load_verified(&c, &r, &m, &places, verify)? };
                let staged = if to_stage.is_empty() { Vec::new() } else { load_staged(&c.data, &r, &m, to_stage)? };
                Ok((verified, staged))
            })
            .map_err(|e| to_py(py, e.into()))?;
        if let Some(a) = self.adopted.get_mut(&sig) {
            for (index, _) in &verified {
                a.staged.remove(index);
            }
            a.verified.extend(verified);
            for (index, chunk) in staged {
                a.verified.remove(&index);
                a.staged.insert(index, chunk);
            }
        }
        Ok(())
    }

    /// Copies chunk `index`, loaded into a staging buffer, out: `pieces` is
    /// a list of `(at, dest)` — `len(dest)` bytes from `at` within the chunk
    /// into `dest` (writable and C-contiguous: a bytearray, a numpy array),
    /// in ascending order, not overlapping. The whole chunk's crc32c is
    /// taken in the same pass and checked against the manifest
    /// (`pdstor.VerifyFailed`; the chunk is then not restored); an empty
    /// list checks it only.
    fn scatter(
        &mut self,
        py: Python<'_>,
        claim: PyRef<'_, Receipt>,
        index: u32,
        pieces: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let Some(a) = self.adopted.get_mut(&claim.inner.signature) else {
            return Err(to_py(py, Failure::Usage("scatter: this claim is not adopted by this reader".into())));
        };
        let Some(chunk) = a.staged.get(&index) else {
            return Err(to_py(
                py,
                Failure::Usage(format!(
                    "scatter: chunk {index} was not loaded into a staging buffer (or was copied out already): load() it into a Buffer(..., staging=True) first"
                )),
            ));
        };
        // The pieces are checked before the chunk is taken: a wrong argument
        // leaves it staged for a corrected call.
        let dests = staged::dests(pieces, "scatter")?;
        staged::in_order(&dests, chunk.len, "scatter")?;
        staged::disjoint(&dests.iter().map(|(_, d)| d).collect::<Vec<_>>(), &[&chunk.buffer])?;
        match py.detach(|| chunk.copy_out(index, &mut staged::pieces(&dests))) {
            Ok(crc) => {
                a.staged.remove(&index);
                a.verified.insert(index, crc);
                Ok(())
            }
            // Its bytes do not match the manifest: never restored.
            Err(e @ ClientError::Verify { .. }) => {
                a.staged.remove(&index);
                Err(to_py(py, e.into()))
            }
            Err(e) => Err(to_py(py, e.into())),
        }
    }

    /// Acknowledges the restore: every chunk must have been loaded and
    /// verified by this reader; the slots free.
    fn ack(&mut self, py: Python<'_>, claim: PyRef<'_, Receipt>) -> PyResult<()> {
        let sig = claim.inner.signature.clone();
        let digest = self.restored("ack", &sig).map_err(|e| to_py(py, e))?;
        let (c, r) = (self.conn.clone(), claim.inner.clone());
        py.detach(move || c.control.ack(&r, &digest)).map_err(|e| to_py(py, e.into()))?;
        self.adopted.remove(&sig);
        Ok(())
    }

    /// Begins a read of the READY cache publication `ready` (one of many
    /// readers; no claim, no adopt) for this reader and session; returns
    /// the read's receipt, which `load` and `scatter` take as they take a
    /// claim. `end_read` ends it once every chunk is loaded and checked;
    /// `abandon_read` gives it up. While it is open the publication is
    /// neither released nor evicted.
    #[pyo3(signature = (ready, layout = None))]
    fn read(
        &mut self,
        py: Python<'_>,
        ready: PyRef<'_, Receipt>,
        layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Receipt> {
        let layout = layout.map(layout_from).transpose()?;
        let (c, r) = (self.conn.clone(), ready.inner.clone());
        let (reader, session) = (self.reader_id.clone(), self.session.clone());
        let answer = py
            .detach(move || c.control.read(&r, &reader, &session, layout.as_ref()))
            .map_err(|e| to_py(py, e.into()))?;
        let adopted = Adopted { manifest: answer.manifest, verified: BTreeMap::new(), staged: BTreeMap::new() };
        self.adopted.insert(answer.receipt.signature.clone(), adopted);
        Ok(Receipt { inner: answer.receipt })
    }

    /// Ends the read `read` (from `read`) once every chunk was loaded and
    /// checked here, with its restore digest; the publication stays READY.
    fn end_read(&mut self, py: Python<'_>, read: PyRef<'_, Receipt>) -> PyResult<()> {
        let sig = read.inner.signature.clone();
        let digest = self.restored("end_read", &sig).map_err(|e| to_py(py, e))?;
        let (c, r) = (self.conn.clone(), read.inner.clone());
        py.detach(move || c.control.end_read(&r, &digest)).map_err(|e| to_py(py, e.into()))?;
        self.adopted.remove(&sig);
        Ok(())
    }

    /// Gives up the read `read` for `reason` (a failed load, say): it ends,
    /// and the publication stays READY for the next reader.
    fn abandon_read(&mut self, py: Python<'_>, read: PyRef<'_, Receipt>, reason: String) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), read.inner.clone());
        py.detach(move || c.control.abandon_read(&r, &reason)).map_err(|e| to_py(py, e.into()))?;
        self.adopted.remove(&read.inner.signature);
        Ok(())
    }

    /// Reports a failed or uncertain read: the publication is RETAINED (its
    /// bytes kept, never reused) until it is reclaimed.
    fn fail(&mut self, py: Python<'_>, claim: PyRef<'_, Receipt>, reason: String) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), claim.inner.clone());
        py.detach(move || c.control.fail(&r, &reason)).map_err(|e| to_py(py, e.into()))?;
        self.adopted.remove(&claim.inner.signature);
        Ok(())
    }

    /// claim → adopt → load every chunk into `buffer` from `offset`, one
    /// after another → verify → ack, in one call; returns the manifest. The
    /// claim names `layout`: a publication stored with another is refused
    /// (`pdstor.LayoutMismatch`) and stays READY. Once claimed, any failure — adopt refused, a load or verification failed —
    /// reports `fail` (the publication stays RETAINED) and raises: never a
    /// partial or silent result.
    #[pyo3(signature = (ready, layout, buffer, offset = 0, lease_ms = 60_000))]
    fn get<'py>(
        &mut self,
        py: Python<'py>,
        ready: PyRef<'_, Receipt>,
        layout: &Bound<'py, PyAny>,
        buffer: PyRef<'_, Buffer>,
        offset: u64,
        lease_ms: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layout = layout_from(layout)?;
        let (c, r) = (self.conn.clone(), ready.inner.clone());
        let (reader, session, b) = (self.reader_id.clone(), self.session.clone(), BufferRef::from(&*buffer));
        let verify = self.verify;
        // A get of one: the same path as get_many's (claim with adopt, one
        // load, the ack with it or after it; a failure reported, RETAINED).
        let manifest = py
            .detach(move || -> Result<Manifest, ClientError> {
                let who = Getter { reader: &reader, session: &session, layout: &layout, lease_ms };
                let got = adopt_many(&c.control, &who, std::slice::from_ref(&r))?;
                let place = Ok(Destination { buffer: b, offset, into: None });
                restore_many(&c.control, &c.data, verify, vec![place], got, Finish::Ack)?
                    .into_iter()
                    .next()
                    .unwrap_or_else(|| Err(ClientError::Data("a get of one answered nothing".into())))
            })
            .map_err(|e| to_py(py, e.into()))?;
        manifest_dict(py, &manifest)
    }

    /// Gets many READY publications at once: `items` is a list of
    /// `(ready, buffer, offset)`, each publication's chunks landing one after
    /// another from `offset`. Three round trips whatever their number — one
    /// `claim` batch (each naming `layout` and adopting through the daemon), one
    /// data-plane frame of loads (one device submission; every chunk checked
    /// against its manifest as `get` checks it), one `ack` batch. Answers
    /// one entry per item, in order: its manifest (a dict), or the
    /// `pdstor.Error` it failed with — a publication claimed and then failed
    /// is reported failed (RETAINED, its bytes kept); one item's failure
    /// never raises.
    ///
    /// With `place`, `items` is a list of READY receipts, and where each
    /// goes is decided once its manifest is known (its size, say):
    /// `place(manifest)` answers `(buffer, offset)`, called after the claim
    /// batch for every adopted item; one that raises fails that item only
    /// (RETAINED, nothing loaded).
    ///
    /// With `place_many` instead, `items` is a list of READY receipts too,
    /// and the places are decided for all at once — an allocator's batched
    /// allocation, one call instead of one per item: `place_many(manifests)`
    /// gets one entry per item, its manifest or `None` where the item was
    /// not adopted, and answers a list of as many entries, each `(buffer,
    /// offset)`, or `None` or an exception for an item it gives no place
    /// (that item fails, RETAINED).
    ///
    /// With `into`, each item's bytes are copied on out of where they were
    /// loaded (a staging buffer, `Buffer(..., staging=True)`) into
    /// `into(manifest)` — a writable, C-contiguous buffer of exactly the
    /// publication's bytes (LMCache's memory object, say), called after the
    /// claim batch — and each chunk is checked against its manifest in that
    /// copy, before the ack: one pass over the bytes. One that raises or
    /// gives the wrong size fails that item only (RETAINED).
    ///
    /// With `cache=True` the receipts are of cache publications: each is
    /// read (not claimed) and its read ended once restored; one that fails
    /// is abandoned, and the publication stays READY.
    #[pyo3(signature = (items, layout, lease_ms = 60_000, place = None, into = None, cache = false, place_many = None))]
    #[allow(clippy::too_many_arguments)] // a Python method's keyword arguments
    fn get_many<'py>(
        &self,
        py: Python<'py>,
        items: &Bound<'py, PyAny>,
        layout: &Bound<'py, PyAny>,
        lease_ms: u64,
        place: Option<&Bound<'py, PyAny>>,
        into: Option<&Bound<'py, PyAny>>,
        cache: bool,
        place_many: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let layout = layout_from(layout)?;
        if place.is_some() && place_many.is_some() {
            return Err(PyValueError::new_err("get_many: give place or place_many, not both"));
        }
        let mut readies = Vec::new();
        let mut places = Vec::new();
        for item in items.try_iter()? {
            let item = item?;
            if place.is_some() || place_many.is_some() {
                let ready: PyRef<'_, Receipt> = item.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "get_many with place: an item is a pdstor.Receipt (READY), not {}",
                        item.repr().map(|r| r.to_string()).unwrap_or_default()
                    ))
                })?;
                readies.push(ready.inner.clone());
                continue;
            }
            let (ready, buffer, offset): (PyRef<'_, Receipt>, PyRef<'_, Buffer>, u64) =
                item.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "get_many: an item is (ready: pdstor.Receipt, buffer: pdstor.Buffer, offset: int), not {}",
                        item.repr().map(|r| r.to_string()).unwrap_or_default()
                    ))
                })?;
            readies.push(ready.inner.clone());
            places.push(Ok(Destination { buffer: BufferRef::from(&*buffer), offset, into: None }));
        }
        let (c, reader, session, verify) =
            (self.conn.clone(), self.reader_id.clone(), self.session.clone(), self.verify);
        let who = Getter { reader: &reader, session: &session, layout: &layout, lease_ms };
        let (got, finish) = if cache {
            (py.detach(|| read_many(&c.control, &who, &readies)), Finish::EndRead)
        } else {
            (py.detach(|| adopt_many(&c.control, &who, &readies)), Finish::Ack)
        };
        let got = got.map_err(|e| to_py(py, e.into()))?;
        let mut interrupted = None;
        if let Some(place) = place {
            places = got.iter().map(|g| place_of(py, place, g)).collect();
        } else if let Some(place_many) = place_many {
            places = match places_of(py, place_many, &got) {
                Ok(places) => places,
                Err(e) => {
                    // Nothing is placed: every item fails, its claim or read
                    // reported (RETAINED, or the read given up); an interrupt
                    // (not an Exception) is raised again once they are.
                    let why = format!("get_many: place_many(manifests) failed: {e}");
                    if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
                        interrupted = Some(e);
                    }
                    got.iter().map(|_| Err(ClientError::Data(why.clone()))).collect()
                }
            };
        }
        let answers = restore(py, &c, verify, got, places, into, finish)?;
        match interrupted {
            Some(e) => Err(e),
            None => Ok(answers),
        }
    }

    /// Reads many READY cache publications, holding each read (no load):
    /// one round trip. Each item is a READY `Receipt`, or the name
    /// (`req_id`) a publication was prepared with — found READY by the
    /// daemon as `lookup` finds it, in the same step (a name with none
    /// answers `UnknownPublication`). Answers one entry per item, in order:
    /// its read `Receipt` — for `finish_reads` or `abandon_reads` — or the
    /// `pdstor.Error` that refused it.
    #[pyo3(signature = (readies, layout = None))]
    fn read_many<'py>(
        &mut self,
        py: Python<'py>,
        readies: Vec<Bound<'py, PyAny>>,
        layout: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let layout = layout.map(layout_from).transpose()?;
        let mut asks = Vec::with_capacity(readies.len());
        for (i, item) in readies.iter().enumerate() {
            let (receipt, req_id) = match item.cast::<Receipt>() {
                Ok(r) => (Some(r.get().inner.clone()), None),
                Err(_) => (
                    None,
                    Some(item.extract::<String>().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "read_many: item {i} is neither a READY pdstor.Receipt nor a publication's name (str)"
                        ))
                    })?),
                ),
            };
            asks.push(pdstor_client::read::ReadRequest {
                receipt,
                req_id,
                reader_id: self.reader_id.clone(),
                session_id: self.session.clone(),
                layout: layout.clone(),
            });
        }
        let c = self.conn.clone();
        let done = py.detach(move || c.control.read_many(asks)).map_err(|e| to_py(py, e.into()))?;
        let mut out = Vec::with_capacity(done.len());
        for r in done {
            out.push(entry(py, r, |a| {
                let adopted = Adopted { manifest: a.manifest, verified: BTreeMap::new(), staged: BTreeMap::new() };
                self.adopted.insert(a.receipt.signature.clone(), adopted);
                Ok(Bound::new(py, Receipt { inner: a.receipt })?.into_any())
            })?);
        }
        Ok(out)
    }

    /// Restores many reads `read_many` holds — items `(read, buffer,
    /// offset)`, each loaded there; with `into`, copied on into
    /// `into(manifest)` and checked in that copy — and ends each: done once
    /// restored, abandoned if not (the publication stays READY). In two
    /// round trips whatever their number.
    #[pyo3(signature = (items, into = None))]
    fn finish_reads<'py>(
        &mut self,
        py: Python<'py>,
        items: Vec<(PyRef<'py, Receipt>, PyRef<'py, Buffer>, u64)>,
        into: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut got = Vec::with_capacity(items.len());
        let mut places = Vec::with_capacity(items.len());
        for (read, buffer, offset) in &items {
            let manifest = self.adopted.remove(&read.inner.signature).map(|a| a.manifest);
            got.push(match manifest {
                Some(manifest) => Got::Adopted { claim: read.inner.clone(), manifest },
                None => Got::Failed {
                    claim: None,
                    error: ClientError::Data("finish_reads: a receipt this reader's read_many did not answer".into()),
                },
            });
            places.push(Ok(Destination { buffer: BufferRef::from(&**buffer), offset: *offset, into: None }));
        }
        restore(py, &self.conn.clone(), self.verify, got, places, into, Finish::EndRead)
    }

    /// The manifest of a claim this reader adopted, or of a read it holds.
    fn manifest<'py>(&self, py: Python<'py>, receipt: PyRef<'_, Receipt>) -> PyResult<Bound<'py, PyAny>> {
        match self.adopted.get(&receipt.inner.signature) {
            Some(a) => manifest_dict(py, &a.manifest),
            None => {
                Err(to_py(py, Failure::Usage("manifest: this receipt is not adopted or read by this reader".into())))
            }
        }
    }

    /// Gives up many reads (from `read` or `read_many`) for `reason`, in one
    /// round trip; answers `None` or the `pdstor.Error` of each, in order.
    fn abandon_reads<'py>(
        &mut self,
        py: Python<'py>,
        reads: Vec<PyRef<'py, Receipt>>,
        reason: String,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let owned: Vec<RustReceipt> = reads.iter().map(|r| r.inner.clone()).collect();
        for r in &owned {
            self.adopted.remove(&r.signature);
        }
        let c = self.conn.clone();
        let done = py
            .detach(move || {
                let ends: Vec<(&RustReceipt, pdstor_client::read::End<'_>)> =
                    owned.iter().map(|r| (r, pdstor_client::read::End::Abandoned(reason.as_str()))).collect();
                c.control.end_read_many(&ends)
            })
            .map_err(|e| to_py(py, e.into()))?;
        done.into_iter().map(|r| entry(py, r, |()| Ok(py.None().into_bound(py)))).collect()
    }
}

/// The end of a get or read of many: with `into`, each item's destination
/// checked (writable, exactly its bytes, overlapping nothing) and held
/// until the copies are done; then every item loaded, checked and ended as
/// `finish` says ([`restore_many`]).
fn restore<'py>(
    py: Python<'py>,
    c: &Arc<Conn>,
    verify: Verify,
    got: Vec<Got>,
    mut places: Vec<Result<Destination, ClientError>>,
    into: Option<&Bound<'py, PyAny>>,
    finish: Finish,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    // Held until the copies are done: each item's destination.
    let mut dests: Vec<staged::Dest> = Vec::new();
    if let Some(into) = into {
        let sources: Vec<BufferRef> = places.iter().filter_map(|p| p.as_ref().ok()).map(|p| p.buffer.clone()).collect();
        let sources: Vec<&BufferRef> = sources.iter().collect();
        for (g, p) in got.iter().zip(places.iter_mut()) {
            let Ok(at) = p else { continue };
            // One whose memory overlaps another's, or a staging buffer's,
            // fails alone (RETAINED), as a bad size does.
            let checked = dest_of(py, into, g).and_then(|d| {
                let mut all: Vec<&staged::Dest> = dests.iter().collect();
                all.push(&d);
                staged::disjoint(&all, &sources)
                    .map(|()| d)
                    .map_err(|e| ClientError::Data(format!("get_many: into(manifest): {e}")))
            });
            match checked {
                Ok(d) => {
                    at.into = Some((d.span().0, d.len()));
                    dests.push(d);
                }
                Err(e) => *p = Err(e),
            }
        }
    }
    // Reads a failed call leaves are given up, not left held (one it had
    // already ended answers read_ended, harmlessly).
    let reads: Vec<RustReceipt> = match finish {
        Finish::EndRead => got
            .iter()
            .filter_map(|g| match g {
                Got::Adopted { claim, .. } => Some(claim.clone()),
                _ => None,
            })
            .collect(),
        Finish::Ack | Finish::Keep => Vec::new(),
    };
    let c = c.clone();
    let done = py
        .detach(move || {
            restore_many(&c.control, &c.data, verify, places, got, finish).inspect_err(|e| {
                let why = format!("the restore failed: {e}");
                let ends: Vec<_> =
                    reads.iter().map(|r| (r, pdstor_client::read::End::Abandoned(why.as_str()))).collect();
                let _ = c.control.end_read_many(&ends);
            })
        })
        .map_err(|e| to_py(py, e.into()))?;
    drop(dests);
    done.into_iter().map(|r| entry(py, r, |m| manifest_dict(py, &m))).collect()
}

/// Where `into` copies an adopted item's bytes (`into(manifest) -> dest`):
/// writable, C-contiguous, exactly the publication's bytes.
fn dest_of(py: Python<'_>, into: &Bound<'_, PyAny>, got: &Got) -> Result<staged::Dest, ClientError> {
    let Got::Adopted { manifest, .. } = got else {
        return Err(ClientError::Data("not adopted".into()));
    };
    let bytes: u64 = manifest.chunks.iter().map(|c| c.len).sum();
    let dest = manifest_dict(py, manifest)
        .and_then(|m| into.call1((m,)))
        .and_then(|d| staged::Dest::of(&d, "get_many: into(manifest)"))
        .map_err(|e| ClientError::Data(format!("get_many: into(manifest) gave no destination: {e}")))?;
    if dest.len() as u64 != bytes {
        return Err(ClientError::Data(format!(
            "get_many: into(manifest) gave {} bytes; publication {} holds {bytes}: give a destination of exactly its bytes",
            dest.len(),
            manifest.publication
        )));
    }
    Ok(dest)
}

/// Where `place` puts an adopted item (`place(manifest) -> (buffer,
/// offset)`); an item not adopted goes nowhere.
fn place_of(py: Python<'_>, place: &Bound<'_, PyAny>, got: &Got) -> Result<Destination, ClientError> {
    let Got::Adopted { manifest, .. } = got else {
        return Err(ClientError::Data("not adopted".into()));
    };
    let answer = manifest_dict(py, manifest)
        .and_then(|m| place.call1((m,)))
        .and_then(|a| a.extract::<(PyRef<'_, Buffer>, u64)>().map(|(b, offset)| (BufferRef::from(&*b), offset)));
    match answer {
        Ok((buffer, offset)) => Ok(Destination { buffer, offset, into: None }),
        Err(e) => Err(ClientError::Data(format!("get_many: place(manifest) gave no (buffer, offset): {e}"))),
    }
}

/// `place_many(manifests)`: one call for every item of a get, each adopted
/// item's manifest (`None` for the others); one place per item, or why it
/// has none. An answer of the wrong shape is an error for the whole call.
fn places_of(
    py: Python<'_>,
    place_many: &Bound<'_, PyAny>,
    got: &[Got],
) -> PyResult<Vec<Result<Destination, ClientError>>> {
    let manifests = got
        .iter()
        .map(|g| match g {
            Got::Adopted { manifest, .. } => manifest_dict(py, manifest),
            _ => Ok(py.None().into_bound(py)),
        })
        .collect::<PyResult<Vec<_>>>()?;
    let answer = place_many.call1((manifests,))?;
    let answers: Vec<Bound<'_, PyAny>> = answer.try_iter()?.collect::<PyResult<_>>()?;
    if answers.len() != got.len() {
        return Err(PyValueError::new_err(format!(
            "it answered {} places for {} items: answer one entry per manifest, in order",
            answers.len(),
            got.len()
        )));
    }
    Ok(answers
        .into_iter()
        .zip(got)
        .map(|(a, g)| {
            if !matches!(g, Got::Adopted { .. }) {
                return Err(ClientError::Data("not adopted".into()));
            }
            if a.is_none() || a.is_instance_of::<pyo3::exceptions::PyBaseException>() {
                let why = if a.is_none() { "no place given".to_string() } else { a.to_string() };
                return Err(ClientError::Data(format!("get_many: place_many gave this item no place: {why}")));
            }
            a.extract::<(PyRef<'_, Buffer>, u64)>()
                .map(|(b, offset)| Destination { buffer: BufferRef::from(&*b), offset, into: None })
                .map_err(|e| ClientError::Data(format!("get_many: place_many gave no (buffer, offset): {e}")))
        })
        .collect())
}

/// A [`Writer.handoff`] token: the prepared publication and its total.
fn parse_handoff(what: &str, handoff: &str) -> PyResult<(Prepared, u32)> {
    let bad = |e: String| {
        PyValueError::new_err(format!(
            "{what}: not a Writer.handoff() token ({e}): pass exactly what handoff() returned"
        ))
    };
    let mut v: serde_json::Value = serde_json::from_str(handoff).map_err(|e| bad(e.to_string()))?;
    let total = v.get("total_chunks").and_then(serde_json::Value::as_u64).and_then(|t| u32::try_from(t).ok());
    let total = total.ok_or_else(|| bad("no total_chunks".into()))?;
    let prepared: Prepared = serde_json::from_value(v["prepared"].take()).map_err(|e| bad(format!("prepared: {e}")))?;
    Ok((prepared, total))
}

/// One entry of a `*_many` answer: the value, or the exception it failed with.
fn entry<'py, T>(
    py: Python<'py>,
    r: Result<T, ClientError>,
    ok: impl FnOnce(T) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyAny>> {
    match r {
        Ok(v) => ok(v),
        Err(e) => Ok(to_py(py, e.into()).into_value(py).into_bound(py).into_any()),
    }
}

/// Every refusal code the daemon answers: `(code, http_status)`.
#[pyfunction]
fn refusal_codes() -> Vec<(&'static str, u16)> {
    RefusalCode::ALL.iter().map(|c| (c.as_str(), c.status())).collect()
}

/// The version of the pdstor crate this module was built from.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Buffer>()?;
    m.add_class::<Receipt>()?;
    m.add_class::<Client>()?;
    m.add_class::<Writer>()?;
    m.add_class::<Reader>()?;
    m.add_class::<timeline::Timeline>()?;
    m.add_function(wrap_pyfunction!(refusal_codes, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    Ok(())
}
