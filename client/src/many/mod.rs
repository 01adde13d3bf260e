//! Many publications at once, in a constant number of round trips whatever
//! their number — and one publication as a batch of one, so a single put or
//! get takes the same path as a thousand. A put is one `prepare` batch, one
//! data-plane `many` frame of stores per round of store batches and one
//! `publish` batch (one commit); a get is one `claim` batch (with `adopt`),
//! one `many` frame of loads (each chunk checked against its manifest) and
//! one `ack` batch, or none where the loads acknowledge their claims
//! themselves. Each item answers on its own: one refused or failed item
//! leaves the others alone, and what it had taken is given back in the same
//! few round trips (aborted before READY, `fail`ed — RETAINED — once
//! claimed).
//!
//! [`Writer`](crate::Writer), [`Reader`](crate::Reader) and the Python
//! binding all go this way; what differs between them is only where their
//! buffers come from ([`BufferRef`]) and how they hold the data connection
//! ([`DataPlane`]).

pub mod get;
pub mod put;
pub mod staged;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::PayloadPath;

use crate::{ClientError, DataConn};

/// A buffer as a batch uses it: the memory, held while registered, and how
/// the data connection knows it.
#[derive(Clone)]
pub struct BufferRef {
    /// The memory.
    pub inner: Arc<Buffer>,
    /// This process's name for it: the data connection registers each key once.
    pub key: u64,
    /// Registered unchecked: the daemon does not checksum what it loads
    /// into it (a staging buffer, checked as its chunks are copied out; or a
    /// reader that verifies nothing, [`Verify::None`](crate::Verify::None)).
    pub unchecked: bool,
    /// The path its payloads move on.
    pub path: PayloadPath,
}

impl BufferRef {
    /// `buffer` under a key no other buffer of this process has.
    pub fn new(buffer: Arc<Buffer>, path: PayloadPath, unchecked: bool) -> BufferRef {
        BufferRef { inner: buffer, key: next_key(), unchecked, path }
    }
}

/// A key for a buffer, unique in this process.
pub fn next_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The data connection a batch goes through, made on first use: each buffer
/// registered the first time a batch names it, and a connection that failed
/// under a call dropped, so the next call connects (and registers) again.
pub struct DataPlane {
    conn: Option<DataConn>,
    socket: PathBuf,
    /// Buffer key → (the buffer, kept alive while registered; its id on this connection).
    registered: HashMap<u64, (Arc<Buffer>, u32)>,
}

impl DataPlane {
    /// A data plane of the daemon's socket at `socket`; nothing connects yet.
    pub fn new(socket: &Path) -> DataPlane {
        DataPlane { conn: None, socket: socket.to_path_buf(), registered: HashMap::new() }
    }

    /// The daemon's data socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The connection, made if there is none.
    pub fn conn(&mut self) -> Result<&mut DataConn, ClientError> {
        if self.conn.is_none() {
            self.conn = Some(DataConn::connect(&self.socket)?);
            self.registered.clear();
        }
        self.conn.as_mut().ok_or_else(|| ClientError::Data("no data connection".into()))
    }

    /// The connection's id of `b`, registering it the first time.
    pub fn id_of(&mut self, b: &BufferRef) -> Result<u32, ClientError> {
        if let Some((_, id)) = self.registered.get(&b.key) {
            return Ok(*id);
        }
        let id = self.conn()?.register_checked(&b.inner, b.path, !b.unchecked)?;
        self.registered.insert(b.key, (b.inner.clone(), id));
        Ok(id)
    }

    /// Runs `f` on the connection; a connection that failed under it is
    /// dropped, so the next call reconnects (and registers again).
    pub fn with<T>(&mut self, f: impl FnOnce(&mut DataConn) -> Result<T, ClientError>) -> Result<T, ClientError> {
        let r = f(self.conn()?);
        if let Err(ClientError::Data(_)) = &r {
            self.conn = None;
            self.registered.clear();
        }
        r
    }
}

/// The lock of a data plane; one that a panicking thread held is taken
/// anyway (the connection it leaves is dropped by the next failed call).
pub fn lock(m: &Mutex<DataPlane>) -> MutexGuard<'_, DataPlane> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
