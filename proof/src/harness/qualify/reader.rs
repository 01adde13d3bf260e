//! The reader process of `pdstor qualify` (`pdstor qualify-reader`): a
//! process that never saw the prompt claims, adopts and loads each
//! publication through the daemon, then decodes from the restored KV.

use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::model::{Config, Continuation, Model, kv};
use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;
use pdstor_client::timeline::Event;
use pdstor_client::timeline::Timeline;
use pdstor_client::timeline::tokens_digest;
use pdstor_client::{BufferSpec, Reader};
use pdstor_engine::io::PayloadPath;

/// What the reader process is asked to do with one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReaderMode {
    /// Cold restore, then a warm repeat, then ack.
    Restore,
    /// Adopt, load one chunk, stop: no ack.
    Cancel,
    /// Adopt and load expecting a failure; report it, produce nothing.
    Strict,
}

/// One claim the reader process restores.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReaderRequest {
    /// The request.
    pub req_id: String,
    /// The claim receipt.
    pub claim: Receipt,
    /// The KV layout it expects.
    pub layout: Layout,
    /// Output tokens to decode.
    pub budget: usize,
    /// The stop token, if any.
    pub stop: Option<u32>,
    /// The producer token's log-probability, as the writer computed it.
    pub first_logprob: f32,
    /// What to do with it.
    pub mode: ReaderMode,
}

/// What `pdstor qualify-reader` is given (a JSON file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReaderJob {
    /// The daemon's control plane.
    pub server: String,
    /// The daemon's data socket.
    pub data_socket: PathBuf,
    /// The timeline the reader appends to.
    pub timeline: PathBuf,
    /// The reader's node name on the timeline.
    pub node: String,
    /// The model to decode with.
    pub model: Config,
    /// Tokens per KV chunk.
    pub chunk_tokens: usize,
    /// The path its buffer is registered for.
    pub path: PayloadPath,
    /// The claims to restore.
    pub requests: Vec<ReaderRequest>,
}

/// What the reader process did with one claim.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReaderOutcome {
    /// The request.
    pub req_id: String,
    /// The continuation from the cold restore.
    pub cold: Option<Continuation>,
    /// The continuation from the warm repeat.
    pub warm: Option<Continuation>,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

/// The reader process (`pdstor qualify-reader`): restores each claim into a
/// fresh model and decodes; it never sees a prompt.
pub fn reader_main(job: &ReaderJob) -> anyhow::Result<Vec<ReaderOutcome>> {
    let tl = Timeline::open(&job.timeline, &job.node)?;
    let spec = BufferSpec { exporter: super::exporter_for(job.path), path: job.path };
    let mut reader = Reader::with_buffer(&job.server, &job.data_socket, spec)?;
    let mut out = Vec::new();
    for r in &job.requests {
        let claim = &r.claim;
        let note = |e: Event| tl.emit(e.claim(claim));
        let manifest = reader.adopt(claim, &r.layout)?;
        let first = manifest.first_token.context("the manifest carries no producer token")?;
        match r.mode {
            ReaderMode::Cancel => {
                reader.load_chunks(claim, &manifest, &[0])?;
                note(Event::new("cancelled").detail("reader stopped mid-restore; lease kept, no ack"));
                out.push(ReaderOutcome { req_id: r.req_id.clone(), cold: None, warm: None, error: None });
                continue;
            }
            ReaderMode::Strict => {
                let e = match reader.load(claim, manifest) {
                    Ok(_) => anyhow::bail!("{}: the corrupted chunk loaded without an error", r.req_id),
                    Err(e) => e.to_string(),
                };
                note(Event::new("load_failed").detail(e.clone()));
                reader.client.fail(claim, &format!("strict load failed: {e}"))?;
                out.push(ReaderOutcome { req_id: r.req_id.clone(), cold: None, warm: None, error: Some(e) });
                continue;
            }
            ReaderMode::Restore => {}
        }
        let mut runs = Vec::new();
        let mut digest = String::new();
        for which in ["cold", "warm"] {
            let restored = reader.load(claim, manifest.clone())?;
            digest = restored.restore_digest.clone();
            let bytes = reader.restored_bytes(restored.len)?;
            let pieces: Vec<&[u8]> = {
                let mut at = 0usize;
                manifest
                    .chunks
                    .iter()
                    .map(|c| {
                        let p = &bytes[at..at + c.len as usize];
                        at += c.len as usize;
                        p
                    })
                    .collect()
            };
            let mut cache = kv::decode(&pieces, &job.model, job.chunk_tokens).map_err(|e| anyhow::anyhow!(e))?;
            let fresh = Model::new(job.model);
            let mut e = Event::new("decode_start").detail(which);
            e.token = Some(first);
            note(e);
            let c = fresh.decode(&mut cache, first, r.first_logprob, r.budget, r.stop);
            let mut e = Event::new("continuation").detail(which);
            e.digest = Some(tokens_digest(&c.tokens));
            e.tokens = Some(c.tokens.clone());
            note(e);
            runs.push(c);
        }
        reader.client.ack(claim, &digest)?;
        let mut e = Event::new("ack");
        e.digest = Some(digest);
        note(e);
        let warm = runs.pop();
        out.push(ReaderOutcome { req_id: r.req_id.clone(), cold: runs.pop(), warm, error: None });
    }
    Ok(out)
}
