//! What a store is opened on — a target, through the engine, or memory —
//! and the [`Device`] each gives the I/O thread and `format`.

use pdstor_engine::io::{Engine, EngineOptions, IoError, Target, TargetKind};

use super::device::Device;
use super::memory::{Memory, MemoryDevice};

/// What a store is opened on: a target, through the engine, or memory.
pub(crate) enum Backing {
    /// A file, block device or NVMe namespace.
    Target(Target),
    /// The simulation's media.
    Memory(Memory),
}

impl Backing {
    /// The kind of target, as the provenance probes class it (memory is
    /// counted as a file).
    pub fn kind(&self) -> TargetKind {
        match self {
            Backing::Target(t) => t.kind(),
            Backing::Memory(_) => TargetKind::File,
        }
    }

    /// The device over it, with `queue_depth` commands in flight and room
    /// for `buffers` held buffers.
    pub fn open(self, queue_depth: u32, buffers: u32) -> Result<Box<dyn Device>, IoError> {
        Ok(match self {
            Backing::Target(t) => {
                Box::new(Engine::new(t, EngineOptions { queue_depth, buffer_slots: buffers, ..Default::default() })?)
            }
            Backing::Memory(m) => Box::new(MemoryDevice::new(m, buffers)),
        })
    }
}
