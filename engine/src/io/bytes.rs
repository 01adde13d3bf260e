//! Plain bytes out of the target, through a temporary registered buffer
//! (metadata-sized I/O: a superblock), and the flush that makes completed
//! writes durable.

use super::*;

impl Engine {
    /// Reads `len` bytes at `offset` through a temporary registered buffer
    /// (metadata-sized I/O: superblocks, signatures, journals).
    pub fn read_to_vec(&mut self, offset: u64, len: u64) -> Result<Vec<u8>, IoError> {
        let transfer = TransferId(0);
        let buffer = Buffer::host(len as usize).map_err(|what| IoError::Buffer { transfer, what })?;
        let id = self.register(buffer)?;
        let req = IoRequest {
            transfer,
            op: Op::Read,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: BufferOffset(0),
            target_offset: TargetOffset(offset),
            len,
        };
        let result = self.execute_all(&[req]);
        let buffer = self.remove(id)?;
        result?;
        let mut out = vec![0u8; len as usize];
        buffer.read_at(0, &mut out).map_err(|what| IoError::Buffer { transfer, what })?;
        Ok(out)
    }

    /// Makes everything written so far durable: NVMe Flush, else `fdatasync` (through
    /// the ring); nothing, counted elided, where the target has no volatile write cache.
    pub fn flush(&mut self) -> Result<(), IoError> {
        let transfer = TransferId(0);
        if self.target.read_only() {
            return Err(IoError::ReadOnlyTarget { transfer, op: Op::Flush, path: self.target.path().into() });
        }
        if !self.target.write_cache().needs_flush() {
            self.stats.flushes_elided += 1;
            return Ok(());
        }
        let Engine { ring, stats, .. } = self;
        let flush = Planned { transfer, op: Op::Flush, addr: 0, buf_index: None, offset: 0, len: 1 };
        let mut pending = Some(flush);
        let mut result = Ok(());
        let driver = Driver {
            queue_depth: 1,
            max_transfer: u32::MAX,
            nowait_first: false,
            punt: false,
            completions: match ring {
                Ring::Std(_) => Completions::Bytes,
                Ring::Nvme(_) => Completions::NvmeStatus,
            },
        };
        let geometry = *self.target.geometry();
        let on_done = |_: usize, o: ring::Outcome| result = o.result;
        match ring {
            Ring::Std(r) => driver.run(r, |_| pending.take(), on_done, build_std),
            Ring::Nvme(r) => driver.run(r, |_| pending.take(), on_done, |seg, ud| build_nvme(&geometry, seg, ud)),
        }?;
        stats.flushes += 1;
        result
    }
}
