//! `pdstor.Timeline`: a Python process's own lines of the causal timeline
//! (`pdstor_client::timeline`), in the format `pdstor timeline check` reads
//! — so a serving engine's steps (a vLLM connector's claim, its restore, its
//! decode's continuation) sit beside the daemon's.

use std::path::PathBuf;

use pdstor_client::timeline::{Event, Timeline as RustTimeline, tokens_digest};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

use crate::Receipt;

/// One node's writer of timeline lines: appends to `path` (created if
/// missing, `O_APPEND`, so several processes can share one file) as `node`.
#[pyclass(module = "pdstor", frozen)]
pub(crate) struct Timeline {
    inner: RustTimeline,
}

#[pymethods]
impl Timeline {
    #[new]
    fn new(path: PathBuf, node: &str) -> PyResult<Self> {
        let inner = RustTimeline::open(&path, node).map_err(|e| PyOSError::new_err(e.to_string()))?;
        Ok(Timeline { inner })
    }

    /// This node's name.
    #[getter]
    fn node(&self) -> &str {
        self.inner.node()
    }

    /// Appends one line for step `event`; answers its `seq`. `receipt` (a
    /// READY or claim receipt) names the request, the publication, the
    /// receipt's signature and, for a claim, its reader and session;
    /// `tokens` records a continuation (with their digest); `token` the
    /// producer token a decode starts from.
    #[pyo3(signature = (event, *, receipt = None, req_id = None, publication = None, token = None, tokens = None, detail = None))]
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &self,
        event: &str,
        receipt: Option<PyRef<'_, Receipt>>,
        req_id: Option<String>,
        publication: Option<u64>,
        token: Option<u32>,
        tokens: Option<Vec<u32>>,
        detail: Option<String>,
    ) -> u64 {
        let mut e = Event::new(event);
        if let Some(r) = &receipt {
            e = e.claim(&r.inner);
        }
        if req_id.is_some() {
            e.req_id = req_id;
        }
        if publication.is_some() {
            e.publication = publication;
        }
        e.token = token;
        if let Some(t) = tokens {
            e.digest = Some(tokens_digest(&t));
            e.tokens = Some(t);
        }
        e.detail = detail;
        self.inner.emit(e)
    }
}
