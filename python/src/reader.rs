//! `pdstor.Reader`: the decode side, a step at a time or a get (of one or many).

use super::*;

/// The decode side: `claim` → `adopt` → `load` (each chunk's crc32c, taken
/// in place in this process's buffer, checked against the manifest) → `ack`; or `get` for all of it. A failed load is never
/// a silent miss: it raises, and `fail` keeps the publication RETAINED for a
/// retry instead of freeing it.
#[pyclass(module = "pdstor")]
pub(crate) struct Reader {
    pub(crate) conn: Arc<Conn>,
    pub(crate) reader_id: String,
    pub(crate) session: String,
    /// What was adopted and verified of each claim or read (the client's
    /// step-at-a-time state).
    pub(crate) adoptions: Adoptions,
    /// Who checksums what this reader loads.
    pub(crate) verify: Verify,
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
        Ok(Reader {
            conn: client.conn.clone(),
            reader_id: reader_id.into(),
            session,
            adoptions: Adoptions::default(),
            verify,
        })
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
        self.adoptions.adopt(&claim.inner, manifest);
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
            let (index, buffer, offset): (u32, PyRef<'_, Buffer>, u64) =
                extract_as(&item, "a load chunk is (index: int, buffer: pdstor.Buffer, offset: int)")?;
            places.push((index, BufferRef::from(&*buffer), offset));
        }
        let Some(manifest) = self.adoptions.manifest(&claim.inner) else {
            return Err(to_py(
                py,
                Failure::Usage("load: this claim is not adopted by this reader: adopt() it first".into()),
            ));
        };
        let (c, r, m) = (self.conn.clone(), claim.inner.clone(), manifest.clone());
        let verify = self.verify;
        let (to_stage, places): (Vec<_>, Vec<_>) = places.into_iter().partition(|(_, b, _)| b.unchecked);
        let (verified, staged) = py
            .detach(move || -> Result<_, ClientError> {
                let verified = if places.is_empty() { Vec::new() } else { load_verified(&c, &r, &m, &places, verify)? };
                let staged = if to_stage.is_empty() { Vec::new() } else { load_staged(&c.data, &r, &m, to_stage)? };
                Ok((verified, staged))
            })
            .map_err(|e| to_py(py, e.into()))?;
        self.adoptions.loaded(&claim.inner, verified, staged);
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
        let chunk = self.adoptions.staged(&claim.inner, index).map_err(|e| to_py(py, Failure::Usage(e.to_string())))?;
        // The pieces are checked before the chunk is taken: a wrong argument
        // leaves it staged for a corrected call.
        let dests = staged::dests(pieces, "scatter")?;
        staged::in_order(&dests, chunk.len, "scatter")?;
        staged::disjoint(&dests.iter().map(|(_, d)| d).collect::<Vec<_>>(), &[&chunk.buffer])?;
        let copied = py.detach(|| chunk.copy_out(index, &mut staged::pieces(&dests)));
        self.adoptions.copied_out(&claim.inner, index, &copied);
        copied.map(drop).map_err(|e| to_py(py, e.into()))
    }

    /// Acknowledges the restore: every chunk must have been loaded and
    /// verified by this reader; the slots free.
    fn ack(&mut self, py: Python<'_>, claim: PyRef<'_, Receipt>) -> PyResult<()> {
        let digest =
            self.adoptions.restore_digest("ack", &claim.inner).map_err(|e| to_py(py, Failure::Usage(e.to_string())))?;
        let (c, r) = (self.conn.clone(), claim.inner.clone());
        py.detach(move || c.control.ack(&r, &digest)).map_err(|e| to_py(py, e.into()))?;
        self.adoptions.forget(&claim.inner);
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
        self.adoptions.adopt(&answer.receipt, answer.manifest);
        Ok(Receipt { inner: answer.receipt })
    }

    /// Ends the read `read` (from `read`) once every chunk was loaded and
    /// checked here, with its restore digest; the publication stays READY.
    fn end_read(&mut self, py: Python<'_>, read: PyRef<'_, Receipt>) -> PyResult<()> {
        let digest = self
            .adoptions
            .restore_digest("end_read", &read.inner)
            .map_err(|e| to_py(py, Failure::Usage(e.to_string())))?;
        let (c, r) = (self.conn.clone(), read.inner.clone());
        py.detach(move || c.control.end_read(&r, &digest)).map_err(|e| to_py(py, e.into()))?;
        self.adoptions.forget(&read.inner);
        Ok(())
    }

    /// Gives up the read `read` for `reason` (a failed load, say): it ends,
    /// and the publication stays READY for the next reader.
    fn abandon_read(&mut self, py: Python<'_>, read: PyRef<'_, Receipt>, reason: String) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), read.inner.clone());
        py.detach(move || c.control.abandon_read(&r, &reason)).map_err(|e| to_py(py, e.into()))?;
        self.adoptions.forget(&read.inner);
        Ok(())
    }

    /// Reports a failed or uncertain read: the publication is RETAINED (its
    /// bytes kept, never reused) until it is reclaimed.
    fn fail(&mut self, py: Python<'_>, claim: PyRef<'_, Receipt>, reason: String) -> PyResult<()> {
        let (c, r) = (self.conn.clone(), claim.inner.clone());
        py.detach(move || c.control.fail(&r, &reason)).map_err(|e| to_py(py, e.into()))?;
        self.adoptions.forget(&claim.inner);
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
                let ready: PyRef<'_, Receipt> =
                    extract_as(&item, "get_many with place: an item is a pdstor.Receipt (READY)")?;
                readies.push(ready.inner.clone());
                continue;
            }
            let (ready, buffer, offset): (PyRef<'_, Receipt>, PyRef<'_, Buffer>, u64) =
                extract_as(&item, "get_many: an item is (ready: pdstor.Receipt, buffer: pdstor.Buffer, offset: int)")?;
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
                self.adoptions.adopt(&a.receipt, a.manifest);
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
            let manifest = self.adoptions.forget(&read.inner);
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
        match self.adoptions.manifest(&receipt.inner) {
            Some(manifest) => manifest_dict(py, manifest),
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
            self.adoptions.forget(r);
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
