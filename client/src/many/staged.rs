//! Loads into a staging buffer (a buffer registered unchecked), checked as
//! they are copied out.
//!
//! A reader that stages a load copies the bytes out anyway: into LMCache's
//! memory object, into the paged cache's blocks. The daemon does not
//! checksum loads into a staging buffer; instead each chunk's crc32c is
//! taken by the copy out of it ([`pdstor_engine::buffer::Buffer::copy_out_checked`])
//! and compared with the manifest before the chunk counts as restored: one
//! pass over the bytes where a check in place and then a copy made two. A
//! chunk loaded into staging and never copied out is never acknowledged.

use std::sync::Mutex;

use pdstor_engine::buffer::Piece;

use super::{BufferRef, DataPlane, lock};
use crate::ClientError;
use crate::layout::Manifest;
use crate::receipt::Receipt;
use crate::wire::DataChunk;

/// A chunk loaded into a staging buffer, not yet copied out and checked.
pub struct StagedChunk {
    /// The staging buffer.
    pub buffer: BufferRef,
    /// Where the chunk is in it.
    pub offset: u64,
    /// The chunk's length.
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
pub fn load_staged(
    data: &Mutex<DataPlane>,
    claim: &Receipt,
    manifest: &Manifest,
    places: Vec<(u32, BufferRef, u64)>,
) -> Result<Vec<(u32, StagedChunk)>, ClientError> {
    let mut data = lock(data);
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
