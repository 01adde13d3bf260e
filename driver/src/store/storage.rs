//! The device beneath the store's I/O thread, as the worker sees it: every
//! payload batch, metadata read and write, and flush goes through a
//! [`Storage`] (recovery's reads of the superblock copies and the journal
//! too).
//! [`Media`] is the device itself, the engine with nothing added: the
//! production worker has no fault branches. `FaultPlan` is a faulty,
//! simulated device (it dies after a number of writes, tears the write that
//! kills it, keeps a volatile write cache that a power loss throws away),
//! used by the simulation and the crash tests through the same seam
//! (`super::fault`).

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{Completion, Engine, IoError, IoRequest};

use super::error::WorkerError;

/// Called as each command of a batch completes: its index in the batch, its
/// completion, its buffer.
pub(crate) type Inspect<'a> = &'a mut dyn FnMut(usize, &Completion, Option<&Buffer>);

/// What the worker asks of the device.
pub(crate) trait Storage: Send + Sync {
    /// Runs a batch of payload commands on `engine`: one completion per
    /// command, in batch order, or the error of a batch that could not run.
    fn payload(
        &self,
        engine: &mut Engine,
        commands: &[IoRequest],
        inspect: Inspect,
    ) -> Result<Vec<Completion>, IoError>;

    /// One metadata write: journal blocks, a superblock copy.
    fn write(&self, engine: &mut Engine, request: IoRequest) -> Result<(), IoError>;

    /// One metadata read: a superblock copy or a journal half, at open.
    fn read(&self, engine: &mut Engine, request: IoRequest) -> Result<(), IoError>;

    /// Makes every completed write durable.
    fn flush(&self, engine: &mut Engine) -> Result<(), WorkerError>;
}

/// The device itself.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Media;

impl Storage for Media {
    fn payload(
        &self,
        engine: &mut Engine,
        commands: &[IoRequest],
        inspect: Inspect,
    ) -> Result<Vec<Completion>, IoError> {
        engine.execute_inspect(commands, inspect)
    }

    fn write(&self, engine: &mut Engine, request: IoRequest) -> Result<(), IoError> {
        engine.execute_all(&[request]).map(drop)
    }

    fn read(&self, engine: &mut Engine, request: IoRequest) -> Result<(), IoError> {
        engine.execute_all(&[request]).map(drop)
    }

    fn flush(&self, engine: &mut Engine) -> Result<(), WorkerError> {
        engine.flush().map_err(|source| WorkerError::Flush { source })
    }
}

/// Reads `len` bytes at `offset` through `storage`, into a buffer registered
/// for the read alone.
pub(crate) fn read_to_vec(
    storage: &dyn Storage,
    engine: &mut Engine,
    offset: u64,
    len: u64,
) -> Result<Vec<u8>, IoError> {
    engine.read_to_vec_by(offset, len, |engine, request| storage.read(engine, request))
}
