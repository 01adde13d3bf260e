//! What a reader checks of the chunks it loads, and who checksums them.

use pdstor_engine::buffer::Buffer;

use crate::ClientError;
use crate::wire::DataResponse;

/// Who checksums the chunks a reader loads.
///
/// The daemon checksums every chunk it loads in place in the reader's own
/// buffer, through its mapping of that memory, once the chunk's transfer has
/// completed, and fails the load on a mismatch with the crc32c journaled at
/// store: that is the end-to-end check (the bytes the reader will use against
/// the bytes the writer stored). The reader checks those reported checksums
/// against its manifest (the one its claim signed), and checksums itself only
/// what the daemon could not (memory it cannot map, listed as `unverified`).
/// A second pass in the reader over the same bytes, against the same stored
/// crc32c, would check the same thing twice: [`Verify::Local`] does it
/// anyway, for a reader that wants a check independent of the daemon's code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// The daemon's in-place check (one checksum per byte).
    #[default]
    Daemon,
    /// Every chunk checksummed again in this process.
    Local,
    /// Nothing checked, by anyone: the reader's buffer is registered
    /// `unchecked` (the daemon answers its chunks `unverified`) and this
    /// reader takes the manifest's crc32c for what it read. Only to measure
    /// what verification costs (`pdstor bench-handoff --no-verify`); no
    /// name parses to it.
    None,
}

impl std::str::FromStr for Verify {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "daemon" => Ok(Verify::Daemon),
            "local" => Ok(Verify::Local),
            _ => Err(format!("unknown verification {s:?}: expected daemon or local")),
        }
    }
}

/// The crc32c the daemon reported for each chunk of a load (`requested`, in
/// request order), by chunk index: what it read in place in the reader's
/// buffer. Chunks it listed as `unverified` are absent, and so is every chunk
/// if the answer's counts do not add up: the reader checksums those itself.
pub fn reported_checksums(requested: &[u32], answer: &DataResponse) -> std::collections::HashMap<u32, u32> {
    let checked: Vec<u32> = requested.iter().copied().filter(|i| !answer.unverified.contains(i)).collect();
    if checked.len() != answer.crc32c.len() {
        return Default::default();
    }
    checked.into_iter().zip(answer.crc32c.iter().copied()).collect()
}

/// The checks of one load's chunks against the manifest: each chunk's
/// crc32c as the daemon reported it, or, where it did not (or with
/// [`Verify::Local`]), computed here in place in the buffer.
pub struct LoadChecks {
    reported: std::collections::HashMap<u32, u32>,
    /// [`Verify::None`]: the manifest's word is taken.
    trusted: bool,
}

impl LoadChecks {
    /// For a load of `requested` (in request order) that the daemon answered.
    pub fn new(verify: Verify, requested: &[u32], answer: &DataResponse) -> LoadChecks {
        let reported = match verify {
            Verify::Daemon => reported_checksums(requested, answer),
            Verify::Local | Verify::None => Default::default(),
        };
        LoadChecks { reported, trusted: verify == Verify::None }
    }

    /// Chunk `index` (`len` bytes at `offset` of `buffer`) against the
    /// manifest's `want`; its crc32c, or the mismatch as a `Verify` error.
    pub fn check(&self, index: u32, buffer: &Buffer, offset: u64, len: u64, want: u32) -> Result<u32, ClientError> {
        if self.trusted {
            return Ok(want);
        }
        let (crc, by) = match self.reported.get(&index) {
            Some(&crc) => (crc, "the daemon read"),
            None => (
                buffer.crc32c(offset, len as usize).map_err(|e| ClientError::Data(e.to_string()))?,
                "this reader computed",
            ),
        };
        if crc != want {
            return Err(ClientError::Verify {
                chunk: index,
                what: format!("{by} crc32c {crc:#010x}, the manifest says {want:#010x}"),
            });
        }
        Ok(crc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::DataResponse;

    #[test]
    fn reported_checksums_skip_unverified_chunks_and_distrust_a_short_answer() {
        let answer = DataResponse { crc32c: vec![0xa, 0xc], unverified: vec![5], ..Default::default() };
        let got = reported_checksums(&[4, 5, 6], &answer);
        assert_eq!(got, [(4, 0xa), (6, 0xc)].into_iter().collect());
        let short = DataResponse { crc32c: vec![0xa], ..Default::default() };
        assert!(reported_checksums(&[4, 5], &short).is_empty(), "a count that does not add up: check everything here");
        assert_eq!("local".parse::<Verify>(), Ok(Verify::Local));
        assert!("maybe".parse::<Verify>().is_err());
    }
}
