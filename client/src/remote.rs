//! A reader on another host: it reaches the owner's daemon only over the
//! control plane, and reads the payload itself, straight from its own view of
//! the shared namespace (NVMe over TCP, say), with its own io_uring engine
//! and registered buffer. Before it trusts that view it proves it is the
//! owner's namespace (the pdstor superblock's UUID, and the NVMe namespace
//! identifiers both sides know) and the one the receipt names; after reading
//! it checks every chunk's crc32c against the manifest, reports what it read
//! (`loaded`: checksums only, never payload), and computes the restore digest
//! its `ack` takes.

use std::path::Path;

use pdstor_engine::io::{
    BufferId, BufferOffset, Engine, EngineOptions, IoRequest, Op, Target, TargetKind, TargetOptions, TransferId,
};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use super::{Client, ClientError, Restored};
use crate::layout::{Layout, Manifest};
use crate::receipt::{Receipt, manifest_digest, restore_digest};
use crate::superblock::{SUPERBLOCK_BYTES, Superblock};
use crate::wire::{AdoptRequest, LoadedChunk};

/// Who judges each chunk's read: the provenance probes, in `pdstor`
/// (`pdstor_daemon::provenance::ProbeJudge`), which this crate does not link.
pub trait Judge {
    /// The verdict on the transfer `transfer` that moved a chunk on `path`
    /// from a target of kind `target` (`native`, `fallback(…)`,
    /// `unverifiable(…)`).
    fn verdict(&self, transfer: TransferId, path: PayloadPath, target: TargetKind) -> String;
}

/// A reader of a shared namespace it opens itself, read-only.
pub struct RemoteReader {
    /// The owner's control plane.
    pub client: Client,
    engine: Engine,
    device: std::path::PathBuf,
    namespace: String,
    buffer: Option<(BufferId, u64)>,
    ids: pdstor_engine::io::DeviceIds,
    /// Who judges each chunk's read, once given ([`RemoteReader::with_judge`]).
    judge: Option<Box<dyn Judge>>,
    verdicts: Vec<String>,
    /// This host's registered reservation key, named at adopt.
    reservation_key: Option<u64>,
    /// This host's own timeline (its claim, every chunk it read, its restore, its ack).
    timeline: Option<std::sync::Arc<crate::timeline::Timeline>>,
}

fn io(what: &str) -> impl FnOnce(pdstor_engine::io::IoError) -> ClientError + '_ {
    move |e| ClientError::Data(format!("{what}: {e}"))
}

impl RemoteReader {
    /// Opens `device` (this host's view of the shared namespace) read-only,
    /// beside the owner, and reads which namespace it holds.
    pub fn open(server: &str, device: &Path) -> Result<RemoteReader, ClientError> {
        RemoteReader::open_with(server, device, None)
    }

    /// [`RemoteReader::open`] on a namespace the owner reserves for
    /// registrants (`serve --reservation-key`): this host first registers
    /// `reservation_key` (needs CAP_SYS_ADMIN), and names it at adopt, so
    /// that the owner can cut this host off when it fences this reader.
    pub fn open_with(server: &str, device: &Path, reservation_key: Option<u64>) -> Result<RemoteReader, ClientError> {
        let client = Client::new(server);
        let owner = client.namespace()?;
        match reservation_key {
            Some(key) => pdstor_engine::io::persistent_reservation::Reservations::open(device)
                .and_then(|r| r.register(key))
                .map_err(|e| ClientError::Data(format!("registering this host's reservation key: {e}")))?,
            None if owner.reservations => {
                return Err(ClientError::Data(format!(
                    "the owner at {server} reserves its namespace for registered hosts: give this reader a reservation key of its own (--reservation-key) so it can read {} and be fenced",
                    device.display()
                )));
            }
            None => {}
        }
        let target = Target::open(device, &TargetOptions { read_only: true, ..Default::default() })
            .map_err(io("opening the shared namespace"))?;
        let mut engine =
            Engine::new(target, EngineOptions::default()).map_err(io("an engine on the shared namespace"))?;
        let sb = engine.read_to_vec(0, SUPERBLOCK_BYTES as u64).map_err(io("reading its superblock"))?;
        let sb = Superblock::decode(&sb).map_err(|e| {
            ClientError::Data(format!(
                "{} holds no pdstor namespace that this reader can read ({e}): is it the namespace the owner formatted?",
                device.display()
            ))
        })?;
        // The proof that this view is the owner's namespace: the pdstor
        // superblock's UUID, and the NVMe namespace identifiers both sides know.
        let namespace = sb.uuid.to_string();
        if owner.namespace != namespace {
            return Err(ClientError::Verify {
                chunk: 0,
                what: format!(
                    "{} holds pdstor namespace {namespace}, the owner at {server} serves {}: not the same namespace; nothing was read",
                    device.display(),
                    owner.namespace
                ),
            });
        }
        let ids = pdstor_engine::io::DeviceIds::of(device);
        if let Some(why) = ids.conflicts_with(&owner.device) {
            return Err(ClientError::Verify {
                chunk: 0,
                what: format!(
                    "{} is another NVMe namespace than the owner's ({why}), though its superblock says {namespace}: a copy, not the shared namespace; nothing was read",
                    device.display()
                ),
            });
        }
        Ok(RemoteReader {
            client,
            engine,
            device: device.into(),
            namespace,
            buffer: None,
            ids,
            judge: None,
            verdicts: Vec::new(),
            reservation_key,
            timeline: None,
        })
    }

    /// Judges every later load's chunk reads with `judge` — the provenance
    /// probes attached to this process (`pdstor_daemon::provenance::ProbeJudge`) —
    /// as the daemon judges its own ([`RemoteReader::verdicts`]). On a
    /// fabric-attached namespace `native` means what it means on a local one —
    /// a fixed read from the registered buffer, block requests issued for it,
    /// no page cache, no bounce; the transport's own receive copy (NVMe/TCP
    /// fills the request's pages from its socket) is the fabric's, not
    /// pdstor's.
    pub fn with_judge(mut self, judge: Box<dyn Judge>) -> RemoteReader {
        self.judge = Some(judge);
        self
    }

    /// Records this host's side on `timeline` (its own file, node
    /// `remote-…`): its claim, each chunk it read from the shared namespace
    /// (path, verdict, crc32c as read), its restore and its ack. The owner's
    /// daemon records the other side; `pdstor timeline merge` joins the two
    /// by the messages between them, not by clocks the hosts do not share.
    pub fn with_timeline(mut self, timeline: std::sync::Arc<crate::timeline::Timeline>) -> RemoteReader {
        self.timeline = Some(timeline);
        self
    }

    fn note(&self, e: crate::timeline::Event) {
        crate::timeline::emit(&self.timeline, e);
    }

    /// Claims a READY publication for `reader`/`session` at the owner.
    pub fn claim(&self, ready: &Receipt, reader: &str, session: &str, lease_ms: u64) -> Result<Receipt, ClientError> {
        let claim = self.client.claim(ready, reader, session, lease_ms)?;
        self.note(crate::timeline::Event::new("claim").claim(&claim));
        Ok(claim)
    }

    /// The probes' verdict on each chunk of the last load, in manifest order
    /// (empty without probes).
    pub fn verdicts(&self) -> &[String] {
        &self.verdicts
    }

    /// This view's NVMe namespace identifiers (empty for a file).
    pub fn device_ids(&self) -> &pdstor_engine::io::DeviceIds {
        &self.ids
    }

    /// The namespace this host's view holds (its superblock's UUID).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The proof that this view is the namespace the receipt names.
    pub fn check_namespace(&self, claim: &Receipt) -> Result<(), ClientError> {
        if claim.namespace != self.namespace {
            return Err(ClientError::Verify {
                chunk: 0,
                what: format!(
                    "{} holds namespace {}, the receipt names {}: not the same namespace; nothing was read",
                    self.device.display(),
                    self.namespace,
                    claim.namespace
                ),
            });
        }
        Ok(())
    }

    /// A registered buffer of at least `len` bytes.
    fn buffer_for(&mut self, len: u64) -> Result<BufferId, ClientError> {
        if let Some((id, have)) = self.buffer
            && have >= len
        {
            return Ok(id);
        }
        if let Some((id, _)) = self.buffer.take() {
            self.engine.remove(id).map_err(io("releasing the old buffer"))?;
        }
        let len = len.max(4096).next_multiple_of(4096);
        let b = Buffer::memfd("pdstor-remote-reader", len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
        let id = self.engine.register(b).map_err(io("registering the reader's buffer"))?;
        self.buffer = Some((id, len));
        Ok(id)
    }

    /// claim's namespace checked → adopt → read every chunk from the shared
    /// namespace → verify each crc32c → report them (`loaded`) → the restore.
    /// Strict: any mismatch is an error, never a partial result.
    pub fn get(&mut self, claim: &Receipt, layout: &Layout) -> Result<Restored, ClientError> {
        let manifest = self.adopt(claim, layout)?;
        self.load(claim, manifest)
    }

    /// Adopts `claim` as a *direct* reader (it reads the shared namespace
    /// itself, so the owner's restart does not fence it: its slots stay
    /// taken until it acks or its session is closed) and returns the
    /// manifest, checked against the claimed digest.
    pub fn adopt(&self, claim: &Receipt, layout: &Layout) -> Result<Manifest, ClientError> {
        self.check_namespace(claim)?;
        let manifest = self.client.adopt(&AdoptRequest {
            receipt: claim.clone(),
            namespace: claim.namespace.clone(),
            epoch: claim.epoch,
            manifest_digest: claim.manifest_digest.clone(),
            layout: layout.clone(),
            direct: true,
            reservation_key: self.reservation_key,
        })?;
        if manifest_digest(&manifest) != claim.manifest_digest {
            return Err(ClientError::Verify { chunk: 0, what: "the adopted manifest is not the one claimed".into() });
        }
        Ok(manifest)
    }

    /// Acknowledges a restore. An owner that restarted since the chunks were
    /// reported has forgotten the report (it answers `not_loaded`): the
    /// reader reports the same verified checksums once more, then acks — the
    /// same old receipt, no byte read again.
    pub fn ack(&self, claim: &Receipt, restored: &Restored) -> Result<(), ClientError> {
        self.ack_once(claim, restored)?;
        self.note(crate::timeline::Event::new("ack").claim(claim));
        Ok(())
    }

    fn ack_once(&self, claim: &Receipt, restored: &Restored) -> Result<(), ClientError> {
        match self.client.ack(claim, &restored.restore_digest) {
            Err(ClientError::Api(b)) if b.code == "not_loaded" => {
                let report: Vec<LoadedChunk> =
                    restored.manifest.chunks.iter().map(|c| LoadedChunk { index: c.index, crc32c: c.crc32c }).collect();
                self.client.loaded(claim, &report)?;
                self.client.ack(claim, &restored.restore_digest)
            }
            other => other,
        }
    }

    /// Reads every chunk of an adopted publication into this reader's buffer
    /// (at their places in the whole), verifies them, and reports them.
    pub fn load(&mut self, claim: &Receipt, manifest: Manifest) -> Result<Restored, ClientError> {
        let total: u64 = manifest.chunks.iter().map(|c| c.len).sum();
        let id = self.buffer_for(total)?;
        let mut requests = Vec::with_capacity(manifest.chunks.len());
        let mut at = 0u64;
        for c in &manifest.chunks {
            requests.push(IoRequest {
                transfer: TransferId::chunk(manifest.publication, c.index),
                op: Op::Read,
                path: PayloadPath::HostFixed,
                buffer: id,
                buffer_offset: BufferOffset(at),
                target_offset: c.offset,
                len: c.len,
            });
            at += c.len;
        }
        let started = std::time::Instant::now();
        self.engine.execute_all(&requests).map_err(io("reading the chunks from the shared namespace"))?;
        let took = started.elapsed().as_nanos() as u64;
        self.verdicts = match &self.judge {
            Some(judge) => {
                let kind = self.engine.target().kind();
                requests.iter().map(|r| judge.verdict(r.transfer, r.path, kind)).collect()
            }
            None => Vec::new(),
        };
        let buffer = self.engine.buffer(id).map_err(io("the reader's buffer"))?;
        let mut crcs = Vec::with_capacity(manifest.chunks.len());
        let mut at = 0u64;
        for c in &manifest.chunks {
            // In place in the buffer the device read into: no copy first.
            let crc = buffer.crc32c(at, c.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
            if crc != c.crc32c {
                return Err(ClientError::Verify {
                    chunk: c.index,
                    what: format!(
                        "read from {} with crc32c {crc:#010x}, the manifest says {:#010x}",
                        self.device.display(),
                        c.crc32c
                    ),
                });
            }
            crcs.push(crc);
            at += c.len;
        }
        // Built only for a timeline: nothing per chunk otherwise.
        let chunks = if self.timeline.is_some() { manifest.chunks.as_slice() } else { &[] };
        for (i, (c, &crc)) in chunks.iter().zip(&crcs).enumerate() {
            let mut e = crate::timeline::Event::new("load").claim(claim).chunk(c.index);
            e.path = Some(PayloadPath::HostFixed.as_str().into());
            e.bytes = Some(c.len);
            e.verdict = Some(self.verdicts.get(i).cloned().unwrap_or_else(|| "unverified (no probes)".into()));
            e.crc32c = Some(crc);
            e.checked = Some(format!(
                "this reader, in place in its buffer, on the CPU ({})",
                pdstor_engine::crc32c::chosen().imp.name()
            ));
            e.dur_ns = Some(took);
            self.note(e.detail(format!("read by this host from {}", self.device.display())));
        }
        let report: Vec<LoadedChunk> =
            manifest.chunks.iter().zip(&crcs).map(|(c, &crc32c)| LoadedChunk { index: c.index, crc32c }).collect();
        self.client.loaded(claim, &report)?;
        self.note(crate::timeline::Event::new("restored").claim(claim));
        let nonce = manifest.restore_nonce.clone().unwrap_or_default();
        Ok(Restored { restore_digest: restore_digest(&nonce, &crcs), manifest, len: total })
    }

    /// The first `len` restored bytes, for comparison outside pdstor.
    pub fn restored_bytes(&self, len: u64) -> Result<Vec<u8>, ClientError> {
        let (id, _) = self.buffer.ok_or_else(|| ClientError::Data("nothing restored yet".into()))?;
        let mut out = vec![0u8; len as usize];
        self.engine
            .buffer(id)
            .map_err(io("the reader's buffer"))?
            .read_at(0, &mut out)
            .map_err(|e| ClientError::Data(e.to_string()))?;
        Ok(out)
    }
}
