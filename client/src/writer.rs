//! The prefill side as one process holds it: a shared buffer, registered
//! once, and puts through the one path of many ([`crate::many::put`]), each
//! a batch of one.

use std::path::Path;
use std::sync::{Arc, Mutex};

use pdstor_engine::buffer::Buffer;

use crate::layout::Layout;
use crate::many::put::{Asked, PutItem, put_many};
use crate::many::{BufferRef, DataPlane, lock};
use crate::wire::Published;
use crate::{BufferSpec, Client, ClientError};

/// The prefill side: one shared buffer, registered once.
pub struct Writer {
    /// The control-plane client.
    pub client: Client,
    data: Mutex<DataPlane>,
    buffer: BufferRef,
    chunk_size: u64,
    /// Who this writer is, recorded with each publication it prepares.
    writer_id: String,
    /// Whether it publishes cache publications (read by many).
    cache: bool,
}

impl Writer {
    /// A writer with a memfd buffer of `chunks` × `chunk_size` bytes on `host_fixed`.
    pub fn new(server: &str, data_socket: &Path, chunk_size: u64, chunks: u32) -> Result<Writer, ClientError> {
        Self::with_buffer(server, data_socket, chunk_size, chunks, BufferSpec::default())
    }

    /// A writer whose buffer comes from `spec.exporter` and moves on `spec.path`.
    pub fn with_buffer(
        server: &str,
        data_socket: &Path,
        chunk_size: u64,
        chunks: u32,
        spec: BufferSpec,
    ) -> Result<Writer, ClientError> {
        let client = Client::new(server);
        let data = Mutex::new(DataPlane::new(data_socket));
        let buffer = spec.allocate("pdstor-writer", (chunk_size * chunks as u64) as usize)?;
        let buffer = BufferRef::new(Arc::new(buffer), spec.path, false);
        // Registered now: a buffer the daemon cannot take fails here, not at the first put.
        lock(&data).id_of(&buffer)?;
        Ok(Writer { client, data, buffer, chunk_size, writer_id: "writer".into(), cache: false })
    }

    /// Names this writer (default `writer`): the identity recorded with every
    /// publication it prepares, shown by `publications`.
    pub fn with_writer_id(mut self, id: &str) -> Writer {
        self.writer_id = id.into();
        self
    }

    /// Publishes cache publications from now on: each READY for any
    /// reader of the namespace ([`crate::Reader::get_cached`]) until released.
    pub fn publishing_cache(mut self) -> Writer {
        self.cache = true;
        self
    }

    /// The writer's shared buffer.
    pub fn buffer(&self) -> &Buffer {
        &self.buffer.inner
    }

    /// prepare → store in `batch` chunks per batch → publish. `payload` is the
    /// whole KV set; the last chunk may be short (padded to 4 KiB on media).
    pub fn put(
        &mut self,
        req_id: &str,
        layout: &Layout,
        payload: &[u8],
        batch: u32,
        first_token: Option<u32>,
    ) -> Result<Published, ClientError> {
        let cs = self.chunk_size as usize;
        let total = payload.len().div_ceil(cs) as u32;
        if total as usize * cs > self.buffer.inner.len() {
            return Err(ClientError::Data(format!(
                "{} bytes do not fit the {}-byte writer buffer",
                payload.len(),
                self.buffer.inner.len()
            )));
        }
        if !payload.len().is_multiple_of(4096) {
            return Err(ClientError::Data(format!("{} bytes is not a multiple of 4096 (direct I/O)", payload.len())));
        }
        self.buffer.inner.write_at(0, payload).map_err(|e| ClientError::Data(e.to_string()))?;
        self.put_in_place(req_id, layout, payload.len() as u64, batch, first_token)
    }

    /// Like [`Writer::put`] for `len` bytes already in the writer's buffer
    /// (where the engine wrote its KV cache): a put of one
    /// ([`put_many`]), its chunks stored `batch` per store request.
    pub fn put_in_place(
        &mut self,
        req_id: &str,
        layout: &Layout,
        len: u64,
        batch: u32,
        first_token: Option<u32>,
    ) -> Result<Published, ClientError> {
        let chunks = (0..len.div_ceil(self.chunk_size))
            .map(|i| {
                let off = i * self.chunk_size;
                (self.buffer.clone(), off, (len - off).min(self.chunk_size))
            })
            .collect();
        let asked = Asked {
            writer: self.writer_id.clone(),
            first_token,
            cache: self.cache,
            batch: Some(batch.max(1) as usize),
            ..Asked::default()
        };
        let item = PutItem { req_id: req_id.into(), chunks };
        put_many(&self.client, &self.data, layout, vec![item], &asked)?
            .into_iter()
            .next()
            .unwrap_or_else(|| Err(ClientError::Data("a put of one answered nothing".into())))
    }
}
