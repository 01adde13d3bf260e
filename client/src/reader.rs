//! The decode side as one process holds it: a buffer sized by the first
//! manifest it adopts, registered once, and loads through the one path of
//! many ([`crate::many::get`]), each a batch of one.

use std::path::Path;
use std::sync::{Arc, Mutex};

use pdstor_engine::buffer::Buffer;

use crate::layout::{Layout, Manifest};
use crate::many::get::{Finish, Got, Place, load_all};
use crate::many::{BufferRef, DataPlane, lock};
use crate::receipt::Receipt;
use crate::wire::DataChunk;
use crate::{BufferSpec, Client, ClientError, Verify};

/// The decode side. Its buffer is sized by the first manifest it adopts,
/// registered once, and reused while large enough.
pub struct Reader {
    /// The control-plane client.
    pub client: Client,
    data: Mutex<DataPlane>,
    buffer: Option<BufferRef>,
    spec: BufferSpec,
    verify: Verify,
}

/// What a reader restored: the bytes are in the reader's buffer
/// ([`Reader::restored_bytes`]), verified.
#[derive(Debug)]
pub struct Restored {
    /// The manifest restored.
    pub manifest: Manifest,
    /// Bytes restored.
    pub len: u64,
    /// SHA-256 over the restored chunks' crc32c (what `ack` takes).
    pub restore_digest: String,
}

impl Reader {
    /// A reader with a memfd buffer on `host_fixed`.
    pub fn new(server: &str, data_socket: &Path) -> Result<Reader, ClientError> {
        Self::with_buffer(server, data_socket, BufferSpec::default())
    }

    /// A reader whose buffers come from `spec.exporter` and move on `spec.path`.
    pub fn with_buffer(server: &str, data_socket: &Path, spec: BufferSpec) -> Result<Reader, ClientError> {
        let data = Mutex::new(DataPlane::new(data_socket));
        // Connected now: a daemon that is not there fails here, not at the first load.
        lock(&data).conn()?;
        Ok(Reader { client: Client::new(server), data, buffer: None, spec, verify: Verify::default() })
    }

    /// Who checksums what this reader loads (see [`Verify`]); before its
    /// first load (its buffer is registered then, checked or not).
    pub fn set_verify(&mut self, verify: Verify) {
        self.verify = verify;
    }

    /// The daemon's process id, from the data connection (`SO_PEERCRED`).
    pub fn daemon_pid(&self) -> std::io::Result<i32> {
        lock(&self.data).conn().map_err(|e| std::io::Error::other(e.to_string()))?.daemon_pid()
    }

    /// A registered buffer of at least `len` bytes (page-rounded: DMA-BUF
    /// exporters allocate whole pages).
    fn buffer_for(&mut self, len: u64) -> Result<BufferRef, ClientError> {
        match &self.buffer {
            Some(b) if b.inner.len() as u64 >= len => Ok(b.clone()),
            _ => {
                let b = self.spec.allocate("pdstor-reader", len.max(4096).next_multiple_of(4096) as usize)?;
                let b = BufferRef::new(Arc::new(b), self.spec.path, self.verify == Verify::None);
                lock(&self.data).id_of(&b)?;
                self.buffer = Some(b.clone());
                Ok(b)
            }
        }
    }

    /// adopt (every field from the claim) → load → verify each chunk's
    /// crc32c here, from the bytes this process sees. Strict: any mismatch,
    /// missing chunk or short manifest is an error, never a partial result.
    pub fn get(&mut self, claim: &Receipt, layout: &Layout) -> Result<Restored, ClientError> {
        let manifest = self.adopt(claim, layout)?;
        self.load(claim, manifest)
    }

    /// Adopts a claimed publication; checks the manifest is the one claimed.
    pub fn adopt(&mut self, claim: &Receipt, layout: &Layout) -> Result<Manifest, ClientError> {
        self.client.adopt_claim(claim, layout)
    }

    /// Loads only the chunks `which` (indices into the manifest) of an
    /// adopted publication into this reader's buffer, at their places in
    /// the whole, unchecked: a reader stopped mid-restore (the qualification
    /// profile's cancel). Nothing it loads counts as restored.
    pub fn load_chunks(&mut self, claim: &Receipt, manifest: &Manifest, which: &[u32]) -> Result<(), ClientError> {
        let len: u64 = manifest.chunks.iter().map(|c| c.len).sum();
        let buffer = self.buffer_for(len)?;
        let mut data = lock(&self.data);
        let id = data.id_of(&buffer)?;
        let chunks = which
            .iter()
            .map(|&i| {
                let at: u64 = manifest.chunks.iter().take(i as usize).map(|c| c.len).sum();
                match manifest.chunks.get(i as usize) {
                    Some(_) => Ok(DataChunk { index: i, buffer: id, offset: at, len: 0, crc32c: None }),
                    None => Err(ClientError::Verify {
                        chunk: i,
                        what: format!("the manifest has {} chunks", manifest.chunks.len()),
                    }),
                }
            })
            .collect::<Result<Vec<_>, ClientError>>()?;
        data.with(|d| d.load(claim, chunks)).map(drop)
    }

    /// Loads every chunk of an adopted publication (again, for a warm
    /// repeat) into this reader's buffer, each at its place in the whole,
    /// and checks each one's crc32c against the manifest: a restore of one
    /// ([`load_all`]) that acknowledges nothing (the caller acks with the
    /// digest answered).
    pub fn load(&mut self, claim: &Receipt, manifest: Manifest) -> Result<Restored, ClientError> {
        let len: u64 = manifest.chunks.iter().map(|c| c.len).sum();
        let place = Place { buffer: self.buffer_for(len)?, offset: 0, into: None };
        let mut got = vec![Got::Adopted { claim: claim.clone(), manifest }];
        load_all(&self.data, (self.verify, Finish::Keep), &[Some(place)], &mut got)?;
        match got.pop() {
            Some(Got::Restored { manifest, digest, .. }) => Ok(Restored { manifest, len, restore_digest: digest }),
            Some(Got::Failed { error, .. }) => Err(error),
            _ => Err(ClientError::Data("a restore of one answered nothing restored".into())),
        }
    }

    /// The buffer this reader loads into, once it has one (a benchmark
    /// copies restored chunks out of it).
    pub fn buffer(&self) -> Option<&Buffer> {
        self.buffer.as_ref().map(|b| &*b.inner)
    }

    /// A copy of the first `len` restored bytes.
    pub fn restored_bytes(&self, len: u64) -> Result<Vec<u8>, ClientError> {
        let b = self.buffer.as_ref().ok_or_else(|| ClientError::Data("nothing restored yet".into()))?;
        let mut out = vec![0u8; len as usize];
        b.inner.read_at(0, &mut out).map_err(|e| ClientError::Data(e.to_string()))?;
        Ok(out)
    }
}
