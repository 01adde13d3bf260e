//! Where a load's chunks land in the reader's buffers.

use super::DataError;
use crate::api::wire::DataChunk;
use pdstor_client::layout::Manifest;

/// Refuses a load whose chunks would land on overlapping bytes of one
/// buffer (each chunk's length is the manifest's): the last to finish would
/// win, and the others would fail their checksums as if the media were bad.
pub(super) fn overlap(chunks: &[DataChunk], manifest: &Manifest) -> Result<(), DataError> {
    let len = |c: &DataChunk| manifest.chunks.get(c.index as usize).map_or(0, |m| m.len);
    let mut places: Vec<&DataChunk> = chunks.iter().filter(|c| len(c) > 0).collect();
    places.sort_by_key(|c| (c.buffer, c.offset));
    for w in places.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.buffer == b.buffer && a.offset.saturating_add(len(a)) > b.offset {
            return Err(DataError::LoadOverlap { first: a.index, second: b.index, buffer: b.buffer, at: b.offset });
        }
    }
    Ok(())
}
