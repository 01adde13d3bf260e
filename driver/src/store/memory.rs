//! A device whose media is memory: the simulation's. It moves bytes between
//! the buffers it holds and a [`Memory`] — shared with the fault plan, which
//! remembers what unflushed writes overwrote, and with the simulation,
//! which reads the media back — and checks each command as the engine
//! checks one for a direct-I/O target of 4 KiB blocks (a transfer id that
//! fits, a held buffer registered for the path asked, a range inside it and
//! inside the media, a length, every address, offset and length aligned)
//! before any of a batch runs. No io_uring, no file: a store
//! opened on it ([`Store::open_memory`](super::Store::open_memory)) runs its
//! journal, recovery and payloads exactly as on a target, through the same
//! [`Storage`](super::storage::Storage) seam.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{BufferId, Completion, DmabufRw, IoError, IoRequest, MAX_TRANSFER_ID, Op, PayloadPath};

use super::device::{Device, Inspect};

/// The bytes of a simulated device. Clones share them.
#[derive(Debug, Clone)]
pub struct Memory(Arc<Mutex<Vec<u8>>>);

impl Memory {
    /// `len` bytes of zeros.
    pub fn zeroed(len: u64) -> Memory {
        Memory(Arc::new(Mutex::new(vec![0u8; len as usize])))
    }

    fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Its size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `out` from `offset`; what lies past the end is left as it
    /// was. Whether all of it lay inside.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> bool {
        let bytes = self.bytes();
        let start = (offset as usize).min(bytes.len());
        let n = out.len().min(bytes.len() - start);
        out[..n].copy_from_slice(&bytes[start..start + n]);
        n == out.len()
    }

    /// Writes `data` at `offset`; what would lie past the end is dropped.
    pub fn write_at(&self, offset: u64, data: &[u8]) {
        let mut bytes = self.bytes();
        let start = (offset as usize).min(bytes.len());
        let n = data.len().min(bytes.len() - start);
        bytes[start..start + n].copy_from_slice(&data[..n]);
    }

    /// A copy of every byte.
    pub fn to_vec(&self) -> Vec<u8> {
        self.bytes().clone()
    }
}

/// The alignment the device asks of buffer addresses, target offsets and
/// lengths: a 4 KiB-block target's, which the store keeps on every target.
const ALIGN: u64 = 4096;

/// A buffer the device holds: registered (`host_fixed`), or not (`host`).
struct Held {
    buffer: Arc<Buffer>,
    registered: bool,
}

/// The device over a [`Memory`]: its buffer table and its flush count.
pub(crate) struct MemoryDevice {
    memory: Memory,
    table: Vec<Option<Held>>,
    flushes: u64,
}

impl MemoryDevice {
    /// A device over `memory` with room for `buffers` held buffers.
    pub fn new(memory: Memory, buffers: u32) -> MemoryDevice {
        MemoryDevice { memory, table: (0..buffers).map(|_| None).collect(), flushes: 0 }
    }

    fn hold(&mut self, buffer: Buffer, registered: bool) -> Result<BufferId, IoError> {
        let free = self.table.iter().position(Option::is_none);
        let slot = free.ok_or(IoError::BufferTableFull { slots: self.table.len() as u32 })?;
        self.table[slot] = Some(Held { buffer: Arc::new(buffer), registered });
        Ok(BufferId(slot as u32))
    }

    fn held(&self, id: BufferId) -> Result<&Held, IoError> {
        self.table.get(id.0 as usize).and_then(Option::as_ref).ok_or(IoError::UnknownBuffer(id))
    }

    /// The error that refuses `r` before anything of its batch runs, if any.
    fn refuse(&self, r: &IoRequest) -> Result<(), IoError> {
        let transfer = r.transfer;
        if transfer.0 > MAX_TRANSFER_ID {
            return Err(IoError::TransferIdTooLarge { transfer });
        }
        if r.op == Op::Flush {
            let why = "a flush moves no payload";
            return Err(IoError::PathUnavailable { transfer, path: r.path, why, hint: "call flush instead" });
        }
        if r.path == PayloadPath::DmabufFixed {
            let why = "the in-memory device holds no DMA-BUF";
            return Err(IoError::PathUnavailable { transfer, path: r.path, why, hint: "use host_fixed" });
        }
        if r.len == 0 {
            return Err(IoError::EmptyRequest { transfer });
        }
        let held = self.held(r.buffer)?;
        held.buffer
            .check_range(r.buffer_offset.0, r.len as usize)
            .map_err(|what| IoError::Buffer { transfer, what })?;
        if r.path == PayloadPath::HostFixed && !held.registered {
            let why = "the buffer's memory is not registered";
            return Err(IoError::PathUnavailable {
                transfer,
                path: r.path,
                why,
                hint: "register it, or declare path host",
            });
        }
        let addr = held.buffer.addr().map_err(|what| IoError::Buffer { transfer, what })? + r.buffer_offset.0;
        for (field, value) in [("buffer address", addr), ("target offset", r.target_offset.0), ("length", r.len)] {
            if !value.is_multiple_of(ALIGN) {
                return Err(IoError::Unaligned { transfer, field, value, align: ALIGN as u32 });
            }
        }
        let capacity = self.memory.len();
        if r.target_offset.0.checked_add(r.len).is_none_or(|end| end > capacity) {
            return Err(IoError::BeyondTarget { transfer, offset: r.target_offset.0, len: r.len, capacity });
        }
        Ok(())
    }

    /// Moves `r`'s bytes (checked by [`refuse`](Self::refuse)).
    fn run(&self, r: &IoRequest, buffer: &Buffer) -> Result<(), IoError> {
        let transfer = r.transfer;
        let mut bytes = vec![0u8; r.len as usize];
        if r.op.writes() {
            buffer.read_at(r.buffer_offset.0, &mut bytes).map_err(|what| IoError::Buffer { transfer, what })?;
            self.memory.write_at(r.target_offset.0, &bytes);
        } else {
            self.memory.read_at(r.target_offset.0, &mut bytes);
            buffer.write_at(r.buffer_offset.0, &bytes).map_err(|what| IoError::Buffer { transfer, what })?;
        }
        Ok(())
    }
}

impl Device for MemoryDevice {
    fn capacity(&self) -> u64 {
        self.memory.len()
    }

    fn block_size(&self) -> u32 {
        4096
    }

    fn add(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        self.hold(buffer, false)
    }

    fn register(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        self.hold(buffer, true)
    }

    fn register_dmabuf(&mut self, _buffer: Buffer) -> Result<BufferId, IoError> {
        Err(IoError::DmabufUnsupported {
            why: "the in-memory device holds no DMA-BUF: register it with host_fixed".into(),
        })
    }

    fn remove(&mut self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        self.table.get_mut(id.0 as usize).and_then(Option::take).map(|h| h.buffer).ok_or(IoError::UnknownBuffer(id))
    }

    fn buffer(&self, id: BufferId) -> Result<&Buffer, IoError> {
        self.held(id).map(|h| &*h.buffer)
    }

    fn shared_buffer(&self, id: BufferId) -> Result<Arc<Buffer>, IoError> {
        self.held(id).map(|h| Arc::clone(&h.buffer))
    }

    fn execute_inspect(&mut self, commands: &[IoRequest], inspect: Inspect) -> Result<Vec<Completion>, IoError> {
        for r in commands {
            self.refuse(r)?;
        }
        let mut out = Vec::with_capacity(commands.len());
        for (i, r) in commands.iter().enumerate() {
            let buffer = self.shared_buffer(r.buffer)?;
            let result = self.run(r, &buffer);
            let bytes = if result.is_ok() { r.len } else { 0 };
            let c = Completion { transfer: r.transfer, op: r.op, path: r.path, bytes, latency: Duration::ZERO, result };
            inspect(i, &c, Some(&buffer));
            out.push(c);
        }
        Ok(out)
    }

    fn flush(&mut self) -> Result<(), IoError> {
        self.flushes += 1;
        Ok(())
    }

    fn flushes(&self) -> (u64, u64) {
        (self.flushes, 0)
    }

    fn dmabuf_rw(&self) -> DmabufRw {
        DmabufRw::Missing("the in-memory device has no io_uring".into())
    }
}

#[cfg(test)]
mod tests {
    use pdstor_engine::io::{BufferOffset, TargetOffset, TransferId};

    use super::*;
    use crate::store::device::{execute_all, read_to_vec_by, write_from_slice};

    fn command(op: Op, buffer: BufferId, target: u64, len: u64) -> IoRequest {
        IoRequest {
            transfer: TransferId(7),
            op,
            path: PayloadPath::HostFixed,
            buffer,
            buffer_offset: BufferOffset(0),
            target_offset: TargetOffset(target),
            len,
        }
    }

    #[test]
    fn writes_reach_the_shared_memory_and_reads_come_back_from_it() {
        let memory = Memory::zeroed(64 << 10);
        let mut device = MemoryDevice::new(memory.clone(), 4);
        write_from_slice(&mut device, 8192, &[b"pdstor".as_slice(), &[0u8; 4090]].concat()).unwrap();
        let mut seen = [0u8; 6];
        memory.read_at(8192, &mut seen);
        assert_eq!(&seen, b"pdstor", "the write is in the memory the simulation reads");
        memory.write_at(12288, b"media");
        let got = read_to_vec_by(&mut device, 12288, 4096, |d, r| execute_all(d, &[r])).unwrap();
        assert_eq!(&got[..5], b"media");
        assert!(!memory.read_at((64 << 10) - 2, &mut seen), "a read past the end says so");
        assert!(device.table.iter().all(Option::is_none), "the buffers held for the I/O are let go");
        device.flush().unwrap();
        assert_eq!(device.flushes(), (1, 0));
    }

    #[test]
    fn a_batch_with_one_bad_command_is_refused_before_any_of_it_runs() {
        let memory = Memory::zeroed(16 << 10);
        let mut device = MemoryDevice::new(memory.clone(), 3);
        let buffer = Buffer::host(4096).unwrap();
        buffer.write_at(0, &[9u8; 4096]).unwrap();
        let id = device.register(buffer).unwrap();
        let unregistered = device.add(Buffer::host(4096).unwrap()).unwrap();
        let good = command(Op::Write, id, 0, 4096);
        for (bad, want) in [
            (command(Op::Write, id, 16 << 10, 4096), "beyond the target"),
            (command(Op::Write, BufferId(2), 0, 4096), "not held"),
            (command(Op::Write, id, 0, 0), "0 bytes"),
            (command(Op::Write, id, 0, 8192), "buffer"),
            (command(Op::Write, id, 512, 4096), "not a multiple of 4096"),
            (command(Op::Write, id, 0, 512), "not a multiple of 4096"),
            (command(Op::Write, unregistered, 0, 4096), "not registered"),
            (IoRequest { transfer: TransferId(MAX_TRANSFER_ID + 1), ..good }, "id is above"),
            (IoRequest { path: PayloadPath::DmabufFixed, ..good }, "DMA-BUF"),
            (command(Op::Flush, id, 0, 4096), "flush"),
        ] {
            let e = device.execute_inspect(&[good, bad], &mut |_, _, _| {}).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(memory.to_vec().iter().all(|&b| b == 0), "nothing of the batch ran ({want})");
        }
        let done = device.execute_inspect(&[good], &mut |_, _, _| {}).unwrap();
        assert!(done[0].result.is_ok() && done[0].bytes == 4096);
        assert!(memory.to_vec()[..4096].iter().all(|&b| b == 9));
        assert!(device.register_dmabuf(Buffer::host(4096).unwrap()).is_err());
        assert!(device.register(Buffer::host(4096).unwrap()).is_ok());
        let full = device.register(Buffer::host(4096).unwrap()).unwrap_err();
        assert!(matches!(full, IoError::BufferTableFull { slots: 3 }), "{full}");
    }
}
