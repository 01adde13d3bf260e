//! Loads into a staging buffer (`pdstor.Buffer(size, staging=True)`),
//! checked as they are copied out.
//!
//! A reader that stages a load copies the bytes out anyway: into LMCache's
//! memory object, into the paged cache's blocks. The daemon does not
//! checksum loads into a staging buffer (it is registered unchecked);
//! instead each chunk's crc32c is taken by the copy out of it
//! ([`pdstor_engine::Buffer::copy_out_checked`]) and compared with the
//! manifest before the chunk counts as restored: one pass over the bytes
//! where a check in place and then a copy made two. A chunk loaded into
//! staging and never copied out is never acknowledged.

use pdstor_client::ClientError;
use pdstor_client::layout::Manifest;
use pdstor_client::receipt::Receipt as RustReceipt;
use pdstor_client::wire::DataChunk;
use pdstor_engine::buffer::Piece;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{BufferRef, Conn, byte_view, lock};

/// A chunk loaded into a staging buffer, not yet copied out and checked.
pub(crate) struct StagedChunk {
    pub buffer: BufferRef,
    pub offset: u64,
    pub len: u64,
    /// The manifest's crc32c.
    pub want: u32,
}

impl StagedChunk {
    /// Copies `pieces` out of the chunk (offsets within it), checksumming
    /// the whole chunk in the same pass; its crc32c, or the mismatch.
    pub fn copy_out(&self, index: u32, pieces: &mut [Piece<'_>]) -> Result<u32, ClientError> {
        let crc = self
            .buffer
            .inner
            .copy_out_checked(self.offset, self.len as usize, pieces)
            .map_err(|e| ClientError::Data(format!("chunk {index}: {e}")))?;
        if crc != self.want {
            return Err(ClientError::Verify {
                chunk: index,
                what: format!(
                    "this reader computed crc32c {crc:#010x} as it copied the chunk out of staging, the manifest says {:#010x}",
                    self.want
                ),
            });
        }
        Ok(crc)
    }
}

/// Loads `places` (`(index, staging buffer, offset)`) of an adopted claim
/// in one frame, unchecked by the daemon: each chunk to copy out and check.
pub(crate) fn load_staged(
    conn: &Conn,
    claim: &RustReceipt,
    manifest: &Manifest,
    places: Vec<(u32, BufferRef, u64)>,
) -> Result<Vec<(u32, StagedChunk)>, ClientError> {
    let mut data = lock(&conn.data);
    let mut wire = Vec::with_capacity(places.len());
    let mut staged = Vec::with_capacity(places.len());
    for (index, buffer, offset) in places {
        let entry = manifest.chunks.get(index as usize).filter(|c| c.index == index).ok_or_else(|| {
            ClientError::Verify { chunk: index, what: format!("the manifest has {} chunks", manifest.chunks.len()) }
        })?;
        buffer.inner.check_range(offset, entry.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
        wire.push(DataChunk { index, buffer: data.id_of(&buffer)?, offset, len: 0, crc32c: None });
        staged.push((index, StagedChunk { buffer, offset, len: entry.len, want: entry.crc32c }));
    }
    data.with(|d| d.load(claim, wire))?;
    Ok(staged)
}

/// Where a copy out goes: a held, writable, C-contiguous view of a Python
/// object's memory.
pub(crate) struct Dest {
    view: PyBuffer<u8>,
}

impl Dest {
    /// `obj`'s memory (a bytearray, a numpy array, a memoryview of a
    /// tensor), refused unless writable and C-contiguous.
    pub fn of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Dest> {
        let view = byte_view(obj, what)?;
        if view.readonly() || !view.is_c_contiguous() {
            return Err(PyValueError::new_err(format!("{what} must be writable and C-contiguous")));
        }
        Ok(Dest { view })
    }

    pub fn len(&self) -> usize {
        self.view.len_bytes()
    }

    /// The address range it covers.
    pub fn span(&self) -> (usize, usize) {
        let at = self.view.buf_ptr() as usize;
        (at, at + self.len())
    }
}

/// A Python list of pieces, `(at, dest)` each, as destinations.
pub(crate) fn dests(pieces: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<(usize, Dest)>> {
    let mut out = Vec::new();
    for item in pieces.try_iter()? {
        let item = item?;
        let (at, dest): (usize, Bound<'_, PyAny>) = item.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what}: a piece is (at: int, dest: a writable buffer), not {}",
                item.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })?;
        out.push((at, Dest::of(&dest, &format!("{what}: dest"))?));
    }
    Ok(out)
}

/// Refuses pieces out of order, overlapping, or past `len` bytes: the
/// caller's mistake, a `ValueError`, before anything is copied.
pub(crate) fn in_order(dests: &[(usize, Dest)], len: u64, what: &str) -> PyResult<()> {
    let mut end = 0usize;
    for (i, (at, d)) in dests.iter().enumerate() {
        let stop = at.checked_add(d.len());
        if *at < end || stop.is_none_or(|s| s as u64 > len) {
            return Err(PyValueError::new_err(format!(
                "{what}: piece {i} ({} bytes at {at}) overlaps the piece before it or runs past the {len} bytes; \
                 give pieces in ascending order, within the range",
                d.len()
            )));
        }
        end = stop.unwrap_or(usize::MAX);
    }
    Ok(())
}

/// Refuses destinations that overlap each other or a staging buffer's own
/// mapping: each becomes a `&mut` slice while the copy runs, on this thread
/// or another, so no two may share a byte and none may be the source.
pub(crate) fn disjoint(dests: &[&Dest], sources: &[&BufferRef]) -> PyResult<()> {
    let mut spans: Vec<(usize, usize, bool)> = dests.iter().map(|d| d.span()).map(|(a, b)| (a, b, true)).collect();
    for s in sources {
        if let Ok(p) = s.inner.as_mut_ptr() {
            spans.push((p as usize, p as usize + s.inner.len(), false));
        }
    }
    if overlapping(&spans) {
        return Err(PyValueError::new_err(
            "a copy's destinations overlap each other or the staging buffer they are copied from: give each piece memory of its own",
        ));
    }
    Ok(())
}

/// Whether two spans `[start, end)` share a byte where at least one of them
/// is a destination (`true`); sources may overlap each other.
fn overlapping(spans: &[(usize, usize, bool)]) -> bool {
    spans
        .iter()
        .enumerate()
        .any(|(i, a)| spans[i + 1..].iter().any(|b| (a.2 || b.2) && a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1))
}

/// Pieces of a chunk to copy out: `(at, dest)` each.
pub(crate) fn pieces<'a>(dests: &'a [(usize, Dest)]) -> Vec<Piece<'a>> {
    dests
        .iter()
        .map(|(at, d)| {
            // SAFETY: `d.view` is a held, writable PyBuffer exporting
            // `d.len()` bytes at its pointer, alive as long as `dests`
            // (which this borrow outlives no further); `disjoint` refused
            // destinations that share bytes with each other or with the
            // staging mapping they are copied from, so this `&mut` aliases
            // nothing Rust sees while it lives.
            let dst = unsafe { std::slice::from_raw_parts_mut(d.view.buf_ptr().cast::<u8>(), d.len()) };
            Piece { at: *at, dst }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::overlapping;

    #[test]
    fn destinations_may_not_share_a_byte_with_each_other_or_a_source() {
        assert!(!overlapping(&[(0, 10, true), (10, 20, true), (20, 30, false)]), "adjacent is not overlapping");
        assert!(overlapping(&[(0, 10, true), (9, 20, true)]));
        // A source spanning two sources and a destination far inside it.
        assert!(overlapping(&[(0, 100, false), (5, 10, false), (50, 60, true)]));
        assert!(!overlapping(&[(0, 100, false), (5, 10, false)]), "sources may overlap");
        assert!(!overlapping(&[(5, 5, true), (0, 10, true)]), "an empty destination holds no byte");
    }
}
