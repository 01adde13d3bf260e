//! `pdstor._native`: the protocol as Python objects, mirroring
//! `pdstor_client`. Every call that waits — on the daemon, the data socket or
//! a checksum — releases the GIL. Errors become the exception classes of
//! `pdstor.errors`, one per refusal code, carrying the daemon's code, field
//! and message.
#![deny(clippy::unwrap_used)]

use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard};

use pdstor_client::adoptions::Adoptions;
use pdstor_client::code::RefusalCode;
use pdstor_client::handoff::Open;
use pdstor_client::layout::{Layout, Manifest};
use pdstor_client::many::get::{Finish, Getter, Got, Place as Destination, adopt_many, read_many, restore_many};
use pdstor_client::many::put::{Asked, PutItem, Storing, put_many, store_each};
use pdstor_client::many::staged::load_staged;
use pdstor_client::many::{BufferRef, DataPlane, next_key};
use pdstor_client::receipt::Receipt as RustReceipt;
use pdstor_client::wire::{AbortRequest, BatchStep, ClaimRequest, PrepareRequest, Prepared};
use pdstor_client::{ClientError, Place, Verify};
use pdstor_engine::io::PayloadPath;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

mod buffer;
mod client;
mod reader;
mod restore;
mod staged;
mod timeline;
mod writer;

use buffer::*;
use client::*;
use reader::*;
use restore::*;
use writer::*;

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

/// A [`Writer.handoff`] token: the prepared publication and its total.
fn parse_handoff(what: &str, handoff: &str) -> PyResult<Open> {
    Open::resume(handoff).map_err(|e| {
        PyValueError::new_err(format!(
            "{what}: not a Writer.handoff() token ({}): pass exactly what handoff() returned",
            e.0
        ))
    })
}

/// `item` as `T`, or a `TypeError` saying what was `expected` and what came.
fn extract_as<'a, 'py, T: FromPyObject<'a, 'py>>(item: &'a Bound<'py, PyAny>, expected: &str) -> PyResult<T> {
    item.extract().map_err(|_| {
        PyTypeError::new_err(format!("{expected}, not {}", item.repr().map(|r| r.to_string()).unwrap_or_default()))
    })
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
