//! The verbs that work on a target directly, with no daemon: `info`,
//! `format`, `inspect`.

use std::path::PathBuf;

use pdstor_daemon::store::{self, FormatOptions};
use pdstor_daemon::units::parse_size;
use pdstor_engine::io::{Engine, EngineOptions, Target, TargetOptions};

use super::common::print_json;

#[derive(clap::Args)]
pub struct InfoArgs {
    /// A file, block device or /dev/ngXnY.
    #[arg(long)]
    target: PathBuf,
}

impl InfoArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let t = Target::open(&self.target, &TargetOptions::default())?;
        let engine = Engine::new(t, EngineOptions { queue_depth: 1, buffer_slots: 1, ..Default::default() })?;
        print_json(&serde_json::json!({
            "target": self.target,
            "kind": engine.target().kind(),
            "geometry": engine.geometry(),
            "dmabuf_rw": engine.dmabuf_rw(),
            "dmabuf_exporters": pdstor_engine::buffer::dmabuf::exporters(),
            "cuda": cuda_facts(),
        }))
    }
}

/// GPU 0 as the CUDA driver describes it (DMA-BUF export among it), or why
/// there is none to describe.
#[cfg(feature = "cuda")]
fn cuda_facts() -> serde_json::Value {
    match pdstor_engine::buffer::cuda::device_info(0) {
        Ok(info) => serde_json::json!({ "device": info }),
        Err(e) => serde_json::json!({ "unavailable": e.to_string() }),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_facts() -> serde_json::Value {
    serde_json::json!({ "unavailable": "this pdstor was built without CUDA (cargo feature cuda)" })
}

#[derive(clap::Args)]
pub struct FormatArgs {
    /// A file (created with --size if missing), block device or /dev/ngXnY.
    #[arg(long)]
    target: PathBuf,
    /// Bytes per slot: the largest chunk.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    chunk_slot: u64,
    /// Bytes of each of the two journal halves (power of two, 256k to 1G).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    journal: u64,
    /// For a file target that does not exist yet: create it this large.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Overwrite a target that holds a filesystem or another namespace.
    #[arg(long)]
    force: bool,
}

impl FormatArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let opts = FormatOptions {
            slot_size: self.chunk_slot,
            journal_half: self.journal,
            force: self.force,
            create_len: self.size,
        };
        print_json(&store::format(&self.target, &opts)?)
    }
}

#[derive(clap::Args)]
pub struct RotateKeyArgs {
    /// A formatted target not served by a running daemon, with no live publication.
    #[arg(long)]
    target: PathBuf,
}

impl RotateKeyArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let (s, _) = store::Store::open(&self.target, store::StoreOptions::default())?;
        let key_id = s.rotate_key()?;
        print_json(&serde_json::json!({
            "namespace": s.superblock().uuid.to_string(),
            "key_id": key_id,
            "note": "every receipt signed with an earlier key is void (403 key_rotated)",
        }))
    }
}

#[derive(clap::Args)]
pub struct InspectArgs {
    /// A formatted target not served by a running daemon. Read only: the epoch is not
    /// bumped and nothing is written, so outstanding claims are not fenced by it.
    #[arg(long)]
    target: PathBuf,
}

impl InspectArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let i = store::inspect(&self.target)?;
        let sb = &i.superblock;
        let pubs: Vec<_> = i
            .publications
            .iter()
            .map(|p| serde_json::json!({"publication": p.id, "req_id": p.req_id, "phase": p.phase, "chunks": p.total_chunks, "slots": p.slots}))
            .collect();
        print_json(&serde_json::json!({
            "namespace": sb.uuid.to_string(),
            "epoch": sb.epoch,
            "slot_size": sb.slot_size,
            "slots": sb.slot_count,
            "free_slots": i.free_slots,
            "recovery": i.report,
            "publications": pubs,
        }))
    }
}
