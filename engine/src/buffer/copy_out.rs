//! Copying a loaded range out of a buffer and checking it in the same pass.
//!
//! A reader that stages a load (LMCache's staging region, the vLLM
//! connector's CPU staging slots) copies the bytes out anyway, into a memory
//! object or a paged cache's blocks. Checking the chunk in place first and
//! then copying it reads every byte twice; [`Buffer::copy_out_checked`]
//! reads it once: each piece is copied and folded into the chunk's crc32c as
//! it passes ([`crate::crc32c::copy_append`]), and the bytes between pieces
//! (a header, padding) are folded without a copy. The answer is the crc32c
//! of the whole range, what the manifest's entry is compared with.

use super::{Buffer, BufferError, dmabuf};
use crate::crc32c;

/// One piece of a range copied out: `dst` takes `dst.len()` bytes from `at`
/// (counted from the range's start).
pub struct Piece<'a> {
    /// Where in the range the piece starts.
    pub at: usize,
    /// Where it goes.
    pub dst: &'a mut [u8],
}

impl Buffer {
    /// Copies each of `pieces` out of the `count` bytes at `offset`, and
    /// answers the crc32c of all `count` bytes (the pieces and whatever lies
    /// between them), reading each byte once. Pieces are in ascending order,
    /// do not overlap and lie within the range; an empty list checks the
    /// range only. Call it once the load that wrote the range has completed
    /// (as for [`Buffer::crc32c`]).
    pub fn copy_out_checked(&self, offset: u64, count: usize, pieces: &mut [Piece<'_>]) -> Result<u32, BufferError> {
        self.check_range(offset, count)?;
        check_pieces(offset, count, pieces)?;
        if let Some(file) = self.through_file() {
            return copy_out_of_file(file, offset, count, pieces);
        }
        let base = self.as_mut_ptr()?;
        let _access = self.dmabuf.as_ref().map(|d| d.begin_cpu_access(dmabuf::Access::Read)).transpose()?;
        // SAFETY: `offset..offset + count` lies within the mapping
        // (check_range), which lives as long as `self`; every byte pattern is
        // a valid u8. The load that wrote the range has completed (the
        // caller's contract); the only other writer is the buffer's owner,
        // this process's caller, whose concurrent writes would change the
        // checksum's value (and so fail the check) and nothing else. The
        // destinations are the caller's own `&mut` slices, so they cannot
        // alias this shared mapping through safe code.
        let src = unsafe { std::slice::from_raw_parts(base.add(offset as usize).cast_const(), count) };
        let mut crc = 0u32;
        let mut pos = 0usize;
        for p in pieces.iter_mut() {
            let end = p.at + p.dst.len();
            crc = crc32c::append(crc, &src[pos..p.at]);
            crc = crc32c::copy_append(crc, p.dst, &src[p.at..end]);
            pos = end;
        }
        Ok(crc32c::append(crc, &src[pos..]))
    }
}

/// Refuses pieces out of order, overlapping, or outside the range.
fn check_pieces(offset: u64, count: usize, pieces: &[Piece<'_>]) -> Result<(), BufferError> {
    let mut pos = 0usize;
    for (i, p) in pieces.iter().enumerate() {
        let end = p.at.checked_add(p.dst.len());
        let why = if p.at < pos {
            Some(format!("piece {i} starts at {} inside or before the piece before it (which ends at {pos})", p.at))
        } else if end.is_none_or(|e| e > count) {
            Some(format!("piece {i} ({} bytes at {}) runs past the range's {count} bytes", p.dst.len(), p.at))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(BufferError::Pieces { offset, count, why });
        }
        pos = p.at + p.dst.len();
    }
    Ok(())
}

/// [`Buffer::copy_out_checked`] through a shm file's reads: each piece read
/// straight into its destination and checksummed from the cache there; the
/// bytes between pieces through a small block.
fn copy_out_of_file(
    file: &std::fs::File,
    offset: u64,
    count: usize,
    pieces: &mut [Piece<'_>],
) -> Result<u32, BufferError> {
    use std::os::unix::fs::FileExt;
    let read = |dst: &mut [u8], at: usize| {
        let at = offset + at as u64;
        file.read_exact_at(dst, at).map_err(|source| BufferError::ShmFileIo {
            op: "reading",
            offset: at,
            count: dst.len(),
            source,
        })
    };
    let mut block = Vec::new();
    let mut gap = |crc: u32, from: usize, to: usize| -> Result<u32, BufferError> {
        let mut crc = crc;
        let mut at = from;
        while at < to {
            let n = (to - at).min(crc32c::COPY_BLOCK);
            block.resize(n, 0);
            read(&mut block, at)?;
            crc = crc32c::append(crc, &block);
            at += n;
        }
        Ok(crc)
    };
    let (mut crc, mut pos) = (0u32, 0usize);
    for p in pieces.iter_mut() {
        crc = gap(crc, pos, p.at)?;
        read(p.dst, p.at)?;
        crc = crc32c::append(crc, p.dst);
        pos = p.at + p.dst.len();
    }
    gap(crc, pos, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(b: &Buffer) -> Vec<u8> {
        let bytes: Vec<u8> = (0..b.len()).map(|i| (i * 31 % 251) as u8).collect();
        b.write_at(0, &bytes).unwrap();
        bytes
    }

    #[test]
    fn pieces_are_copied_and_the_whole_range_is_checked() {
        let b = Buffer::memfd("copy-out", 1 << 20).unwrap();
        let bytes = filled(&b);
        let (offset, count) = (4096usize, 300_000usize);
        let (mut x, mut y) = (vec![0u8; 1000], vec![0u8; 200_000]);
        let mut pieces = [Piece { at: 7, dst: &mut x }, Piece { at: 50_000, dst: &mut y }];
        let crc = b.copy_out_checked(offset as u64, count, &mut pieces).unwrap();
        assert_eq!(crc, crc32c::checksum(&bytes[offset..offset + count]));
        assert_eq!(x, bytes[offset + 7..offset + 1007]);
        assert_eq!(y, bytes[offset + 50_000..offset + 250_000]);
        // No pieces: the range is checked only.
        assert_eq!(b.copy_out_checked(offset as u64, count, &mut []).unwrap(), crc);
    }

    #[test]
    fn a_shm_file_reached_through_its_file_copies_and_checks_the_same() {
        let owner = Buffer::memfd("copy-out-shm", 256 << 10).unwrap();
        let bytes = filled(&owner);
        let fd = owner.memfd_fd().unwrap().try_clone_to_owned().unwrap();
        let b = Buffer::from_shm_file(fd, 256 << 10, false).unwrap();
        let mut x = vec![0u8; 100_000];
        let mut pieces = [Piece { at: 70_000, dst: &mut x }];
        let crc = b.copy_out_checked(10, 250_000, &mut pieces).unwrap();
        assert_eq!(crc, crc32c::checksum(&bytes[10..250_010]));
        assert_eq!(x, bytes[70_010..170_010]);
    }

    #[test]
    fn pieces_out_of_order_overlapping_or_outside_are_refused_untouched() {
        let b = Buffer::memfd("copy-out-bad", 64 << 10).unwrap();
        filled(&b);
        let (mut x, mut y) = (vec![0u8; 100], vec![0u8; 100]);
        let mut overlapping = [Piece { at: 0, dst: &mut x }, Piece { at: 50, dst: &mut y }];
        let e = b.copy_out_checked(0, 4096, &mut overlapping).unwrap_err().to_string();
        assert!(e.contains("piece 1 starts at 50"), "{e}");
        assert!(x.iter().all(|&v| v == 0), "a refusal copies nothing");
        let mut past = [Piece { at: 4000, dst: &mut x }];
        let e = b.copy_out_checked(0, 4096, &mut past).unwrap_err().to_string();
        assert!(e.contains("runs past the range's 4096 bytes"), "{e}");
        assert!(b.copy_out_checked(60 << 10, 8 << 10, &mut []).is_err(), "a range past the buffer");
    }
}
