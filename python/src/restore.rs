//! The end of a get or read of many as Python asks for it: where each item goes, and the copies out.

use super::*;

pub(crate) fn manifest_dict<'py>(py: Python<'py>, m: &Manifest) -> PyResult<Bound<'py, PyAny>> {
    loads(py, &serde_json::to_string(m).map_err(|e| PyValueError::new_err(e.to_string()))?)
}

/// Loads chunks of an adopted claim to their places, each crc32c checked
/// against the manifest ([`DataConn::load_verified`]).
pub(crate) fn load_verified(
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

/// The end of a get or read of many: with `into`, each item's destination
/// checked (writable, exactly its bytes, overlapping nothing) and held
/// until the copies are done; then every item loaded, checked and ended as
/// `finish` says ([`restore_many`]).
pub(crate) fn restore<'py>(
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
pub(crate) fn dest_of(py: Python<'_>, into: &Bound<'_, PyAny>, got: &Got) -> Result<staged::Dest, ClientError> {
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
pub(crate) fn place_of(py: Python<'_>, place: &Bound<'_, PyAny>, got: &Got) -> Result<Destination, ClientError> {
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
pub(crate) fn places_of(
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
