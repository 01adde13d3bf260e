//! The device beneath the store, as its I/O thread and `format` drive it: a
//! table of the buffers bytes move between, and the commands that move
//! them. [`Engine`] is the device itself (io_uring over a file, a block
//! device or an NVMe namespace); the in-memory device keeps the bytes in
//! memory (`super::memory`), so that the simulation faults every read and write of
//! the store with no io_uring and no file. What a device fails, and when,
//! is [`Storage`](super::storage::Storage)'s to decide, over either.

use std::sync::Arc;

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{
    BufferId, BufferOffset, Completion, DmabufRw, Engine, IoError, IoRequest, Op, PayloadPath, TargetOffset, TransferId,
};

/// Called as each command of a batch completes: its index in the batch, its
/// completion, its buffer.
pub(crate) type Inspect<'a> = &'a mut dyn FnMut(usize, &Completion, Option<&Buffer>);

/// What the store asks of a device.
pub(crate) trait Device {
    /// Usable bytes.
    fn capacity(&self) -> u64;

    /// The logical block size.
    fn block_size(&self) -> u32;

    /// Holds `buffer` for the `host` path.
    fn add(&mut self, buffer: Buffer) -> Result<BufferId, IoError>;

    /// Holds `buffer` with its memory registered (`host_fixed`).
    fn register(&mut self, buffer: Buffer) -> Result<BufferId, IoError>;

    /// Installs a DMA-BUF (`dmabuf_fixed`).
    fn register_dmabuf(&mut self, buffer: Buffer) -> Result<BufferId, IoError>;

    /// Lets a held buffer go; answers it.
    fn remove(&mut self, id: BufferId) -> Result<Arc<Buffer>, IoError>;

    /// A held buffer.
    fn buffer(&self, id: BufferId) -> Result<&Buffer, IoError>;

    /// A held buffer, shared (for the checksum pool).
    fn shared_buffer(&self, id: BufferId) -> Result<Arc<Buffer>, IoError>;

    /// Runs `commands`: one completion per command, in batch order, with
    /// `inspect` called as each completes; or the error of a batch refused
    /// before anything ran.
    fn execute_inspect(&mut self, commands: &[IoRequest], inspect: Inspect) -> Result<Vec<Completion>, IoError>;

    /// Makes every completed write durable.
    fn flush(&mut self) -> Result<(), IoError>;

    /// Flushes issued, and flushes asked for and not issued (the device has
    /// no volatile write cache).
    fn flushes(&self) -> (u64, u64);

    /// Whether the kernel has the rw-dmabuf io_uring UAPI.
    fn dmabuf_rw(&self) -> DmabufRw;
}

impl Device for Engine {
    fn capacity(&self) -> u64 {
        self.geometry().capacity
    }

    fn block_size(&self) -> u32 {
        self.geometry().logical_block
    }

    fn add(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        Engine::add(self, buffer)
    }

    fn register(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        Engine::register(self, buffer)
    }

    fn register_dmabuf(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        Engine::register_dmabuf(self, buffer)
    }

    fn remove(&mut self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        Engine::remove(self, id)
    }

    fn buffer(&self, id: BufferId) -> Result<&Buffer, IoError> {
        Engine::buffer(self, id)
    }

    fn shared_buffer(&self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        Engine::shared_buffer(self, id)
    }

    fn execute_inspect(&mut self, commands: &[IoRequest], inspect: Inspect) -> Result<Vec<Completion>, IoError> {
        Engine::execute_inspect(self, commands, |i, c, b| inspect(i, c, b))
    }

    fn flush(&mut self) -> Result<(), IoError> {
        Engine::flush(self)
    }

    fn flushes(&self) -> (u64, u64) {
        (self.stats().flushes, self.stats().flushes_elided)
    }

    fn dmabuf_rw(&self) -> DmabufRw {
        Engine::dmabuf_rw(self).clone()
    }
}

/// Runs `commands`; the first that failed fails the call.
pub(crate) fn execute_all(device: &mut dyn Device, commands: &[IoRequest]) -> Result<(), IoError> {
    for c in device.execute_inspect(commands, &mut |_, _, _| {})? {
        c.result?;
    }
    Ok(())
}

/// One command on the host path: how metadata moves.
pub(crate) fn request(op: Op, buffer: BufferId, buffer_offset: u64, target_offset: u64, len: u64) -> IoRequest {
    IoRequest {
        transfer: TransferId(0),
        op,
        path: PayloadPath::HostFixed,
        buffer,
        buffer_offset: BufferOffset(buffer_offset),
        target_offset: TargetOffset(target_offset),
        len,
    }
}

/// Reads `len` bytes at `offset` into a buffer held for the read alone, the
/// read itself done by `read` (the storage's, which may fail it).
pub(crate) fn read_to_vec_by(
    device: &mut dyn Device,
    offset: u64,
    len: u64,
    read: impl FnOnce(&mut dyn Device, IoRequest) -> Result<(), IoError>,
) -> Result<Vec<u8>, IoError> {
    let transfer = TransferId(0);
    let id = device.register(Buffer::host(len as usize).map_err(|what| IoError::Buffer { transfer, what })?)?;
    let result = read(device, request(Op::Read, id, 0, offset, len));
    let buffer = device.remove(id)?;
    result?;
    let mut out = vec![0u8; len as usize];
    buffer.read_at(0, &mut out).map_err(|what| IoError::Buffer { transfer, what })?;
    Ok(out)
}

/// Writes `data` at `offset` through a buffer held for the write alone.
pub(crate) fn write_from_slice(device: &mut dyn Device, offset: u64, data: &[u8]) -> Result<(), IoError> {
    let transfer = TransferId(0);
    let buffer = Buffer::host(data.len()).map_err(|what| IoError::Buffer { transfer, what })?;
    buffer.write_at(0, data).map_err(|what| IoError::Buffer { transfer, what })?;
    let id = device.register(buffer)?;
    let result = execute_all(device, &[request(Op::Write, id, 0, offset, data.len() as u64)]);
    device.remove(id)?;
    result
}
