//! `pdstor.Writer`: the prefill side, a step at a time or a put (of one or many).

use super::*;

/// One chunk to store: where its bytes are.
pub(crate) struct StoreChunk {
    pub(crate) index: u32,
    pub(crate) buffer: BufferRef,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

pub(crate) fn store_chunks(chunks: &Bound<'_, PyAny>) -> PyResult<Vec<StoreChunk>> {
    let mut out = Vec::new();
    for item in chunks.try_iter()? {
        let item = item?;
        let (index, buffer, offset, len): (u32, PyRef<'_, Buffer>, u64, u64) =
            extract_as(&item, "a store chunk is (index: int, buffer: pdstor.Buffer, offset: int, length: int)")?;
        out.push(StoreChunk { index, buffer: BufferRef::from(&*buffer), offset, len });
    }
    Ok(out)
}

/// Stores each `(publication, chunks, last)` in one data-plane frame
/// ([`store_each`]): one store of one publication is a batch of one. A
/// store refused (here, before it was sent, or by the daemon, which rolls
/// its publication back) has its publication aborted, so nothing stays
/// PREPARED behind a forgotten token; should the frame fail as a whole,
/// every publication is, and the error is the outer one.
pub(crate) fn store_all(
    conn: &Conn,
    items: &[(Open, Vec<StoreChunk>, bool)],
) -> Result<Vec<Result<(), ClientError>>, ClientError> {
    let asked: Vec<Storing<'_>> = items
        .iter()
        .map(|(open, chunks, last)| Storing {
            prepared: &open.prepared,
            chunks: chunks.iter().map(|c| (c.index, &c.buffer, c.offset, c.len)).collect(),
            last: *last,
            total: open.total_chunks,
        })
        .collect();
    let abort = |open: &Open| {
        let p = &open.prepared;
        BatchStep::Abort(AbortRequest { publication: p.publication, writer_token: p.writer_token.clone() })
    };
    let answers = match store_each(&conn.data, &asked) {
        Ok(answers) => answers,
        Err(e) => {
            // Best effort: what the daemon rolled back answers unknown_publication.
            let _ = conn.control.batch(items.iter().map(|(open, ..)| abort(open)).collect());
            return Err(e);
        }
    };
    let refused: Vec<BatchStep> =
        items.iter().zip(&answers).filter(|(_, a)| a.is_err()).map(|((open, ..), _)| abort(open)).collect();
    if !refused.is_empty() {
        let _ = conn.control.batch(refused);
    }
    Ok(answers.into_iter().map(|a| a.map(drop)).collect())
}

/// The prefill side of one publication at a time:
/// `prepare` → `store` (one or more batches) → `publish`, or `put` for all three.
#[pyclass(module = "pdstor")]
pub(crate) struct Writer {
    pub(crate) conn: Arc<Conn>,
    pub(crate) writer_id: String,
    /// The publication prepared and not yet published or aborted, with its total.
    pub(crate) current: Option<Open>,
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
        if let Some(Open { prepared: p, .. }) = &self.current {
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
        self.current = Some(Open { prepared: p, total_chunks });
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
        let Some(Open { prepared: p, total_chunks: total }) = self.current.clone() else {
            return Err(to_py(
                py,
                Failure::Usage("store: nothing prepared on this writer: call prepare() first".into()),
            ));
        };
        let c = self.conn.clone();
        let open = Open { prepared: p, total_chunks: total };
        let r = py.detach(move || {
            let answer = store_all(&c, &[(open, chunks, last)])?.pop();
            answer.unwrap_or_else(|| Err(ClientError::Data("store answered no result".into())))
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
        let Some(Open { prepared: p, .. }) = self.current.clone() else {
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
        let Some(Open { prepared: p, .. }) = self.current.take() else { return Ok("none".into()) };
        let c = self.conn.clone();
        let r = py.detach(move || c.control.abort(p.publication, &p.writer_token)).map_err(|e| to_py(py, e.into()))?;
        Ok(r.outcome)
    }

    /// The open publication's number, if one is prepared.
    #[getter]
    fn publication(&self) -> Option<u64> {
        self.current.as_ref().map(|o| o.prepared.publication)
    }

    /// The open publication as a token another process of the same engine
    /// (a serving engine's worker, when this writer is its scheduler) hands
    /// to [`Writer.resume`] to store into it. It carries the writer's secret
    /// token: whoever holds it may store, publish and abort this
    /// publication, so it travels only inside one trust domain, never to a
    /// reader.
    fn handoff(&self, py: Python<'_>) -> PyResult<String> {
        let Some(open) = &self.current else {
            return Err(to_py(
                py,
                Failure::Usage("handoff: nothing prepared on this writer: call prepare() first".into()),
            ));
        };
        Ok(open.token())
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
            .map(|(handoff, token)| Ok((parse_handoff("Writer.publish_many", handoff)?.prepared, *token)))
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

    /// Stores a batch of each of many handed-off publications in one
    /// data-plane frame (a serving engine's step's worth): `items` is a list
    /// of `(handoff, chunks, last)`, `chunks` as [`Writer.store`] takes
    /// them. Answers one entry per item, in order: `None`, or the
    /// `pdstor.Error` that refused its store (that publication rolled back,
    /// as a refused `store` rolls it back); one refusal never raises.
    #[staticmethod]
    fn store_many<'py>(
        py: Python<'py>,
        client: PyRef<'_, Client>,
        items: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut asked = Vec::new();
        for item in items.try_iter()? {
            let item = item?;
            let (handoff, chunks, last): (String, Bound<'py, PyAny>, bool) =
                extract_as(&item, "a Writer.store_many item is (handoff: str, chunks: list, last: bool)")?;
            asked.push((parse_handoff("Writer.store_many", &handoff)?, store_chunks(&chunks)?, last));
        }
        let c = client.conn.clone();
        let done = py.detach(move || store_all(&c, &asked)).map_err(|e| to_py(py, e.into()))?;
        done.into_iter().map(|r| entry(py, r, |()| Ok(py.None().into_bound(py)))).collect()
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
            let (buffer, offset, len): (PyRef<'_, Buffer>, u64, u64) =
                extract_as(&item, "put: a chunk is (buffer: pdstor.Buffer, offset: int, length: int)")?;
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
