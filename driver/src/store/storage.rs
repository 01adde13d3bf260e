//! What the store's I/O thread asks of the device, and may be refused:
//! every payload batch, metadata read and write, and flush goes through a
//! [`Storage`] (recovery's reads of the superblock copies and the journal
//! too), over a [`Device`] — the engine on a target, or memory.
//! [`Media`] is the device itself with nothing added: the production worker
//! has no fault branches. `FaultPlan` is a faulty, simulated device (it dies
//! after a number of writes, tears the write that kills it, fails a
//! recovery read, keeps a volatile write cache that a power loss throws
//! away), used by the simulation and the crash tests through the same seam
//! (`super::fault`).

use pdstor_engine::io::{Completion, IoError, IoRequest};

use super::device::{self, Device, Inspect};
use super::error::WorkerError;

/// What the worker asks of the device.
pub(crate) trait Storage: Send + Sync {
    /// Runs a batch of payload commands on `device`: one completion per
    /// command, in batch order, or the error of a batch that could not run.
    fn payload(
        &self,
        device: &mut dyn Device,
        commands: &[IoRequest],
        inspect: Inspect,
    ) -> Result<Vec<Completion>, IoError>;

    /// One metadata write: journal blocks, a superblock copy.
    fn write(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError>;

    /// One metadata read: a superblock copy or a journal half, at open.
    fn read(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError>;

    /// Makes every completed write durable.
    fn flush(&self, device: &mut dyn Device) -> Result<(), WorkerError>;
}

/// The device itself.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Media;

impl Storage for Media {
    fn payload(
        &self,
        device: &mut dyn Device,
        commands: &[IoRequest],
        inspect: Inspect,
    ) -> Result<Vec<Completion>, IoError> {
        device.execute_inspect(commands, inspect)
    }

    fn write(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError> {
        device::execute_all(device, &[request])
    }

    fn read(&self, device: &mut dyn Device, request: IoRequest) -> Result<(), IoError> {
        device::execute_all(device, &[request])
    }

    fn flush(&self, device: &mut dyn Device) -> Result<(), WorkerError> {
        device.flush().map_err(|source| WorkerError::Flush { source })
    }
}

/// Reads `len` bytes at `offset` through `storage`, into a buffer held for
/// the read alone.
pub(crate) fn read_to_vec(
    storage: &dyn Storage,
    device: &mut dyn Device,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, IoError> {
    device::read_to_vec_by(device, offset, len, |device, request| storage.read(device, request))
}
