//! Where a copy out of a staging buffer (`pdstor.Buffer(size,
//! staging=True)`) goes: Python objects' memory, held, checked writable,
//! in order and overlapping nothing. The loads and their checks are the
//! client's (`pdstor_client::many::staged`).

use pdstor_engine::buffer::Piece;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use pdstor_client::many::BufferRef;

use super::{byte_view, extract_as};

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
        let (at, dest): (usize, Bound<'_, PyAny>) =
            extract_as(&item, &format!("{what}: a piece is (at: int, dest: a writable buffer)"))?;
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
