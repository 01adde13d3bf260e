//! `pdstor.Receipt` and `pdstor.Client`: a connection to one daemon.

use super::*;

/// A signed receipt: READY (from `publish` or `lookup`) or a claim (from
/// `claim`). Hand it to another process as `to_json()` (or pickle it).
#[pyclass(module = "pdstor", frozen)]
#[derive(Clone)]
pub(crate) struct Receipt {
    pub(crate) inner: RustReceipt,
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
pub(crate) struct Conn {
    pub(crate) control: pdstor_client::Client,
    pub(crate) data: Mutex<DataPlane>,
    pub(crate) server: String,
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
pub(crate) struct Client {
    pub(crate) conn: Arc<Conn>,
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
