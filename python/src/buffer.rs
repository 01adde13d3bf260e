//! The `pdstor.Buffer` class: memory shared with the daemon by fd.

use super::*;

/// Memory the daemon reads stores from and loads into: a memfd, mapped here
/// and shared with the daemon once over the data socket.
///
/// It implements the buffer protocol, so `memoryview(buf)`,
/// `numpy.frombuffer(buf, dtype)` and `torch.frombuffer(buf, dtype=…)` view
/// the very bytes the daemon moves — no copy. Keep a view's owner alive while
/// you use the view.
#[pyclass(module = "pdstor", frozen)]
pub(crate) struct Buffer {
    pub(crate) inner: Arc<pdstor_engine::buffer::Buffer>,
    /// Unique for the process's life, so a registration is never mistaken
    /// for one of a freed buffer at the same address.
    pub(crate) id: u64,
    /// Loads into it are checked as they are copied out, not in place.
    pub(crate) staging: bool,
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
        let b = pdstor_engine::buffer::Buffer::memfd(name, size)
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
        let b = pdstor_engine::buffer::Buffer::from_shm_file(file.into(), len, true).map_err(|e| what(&e))?;
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
