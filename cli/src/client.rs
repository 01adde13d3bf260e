//! The client verbs: each step of the handoff as one command against a
//! running daemon, receipts read from and printed as JSON.

use std::path::PathBuf;
use std::time::Instant;

use pdstor_client::layout::Layout;
use pdstor_client::receipt::Receipt;

use pdstor_client::{Client, Reader, Writer};
use pdstor_daemon::units::parse_size;

use super::common::{BufferArgs, Daemon, STATES, Server, print_json, read_json};
use pdstor_client::timeline::Event;
use pdstor_client::timeline::Timeline;

#[derive(clap::Args)]
pub struct PutArgs {
    #[command(flatten)]
    daemon: Daemon,
    /// The request id this KV cache belongs to (the serving engine's request).
    #[arg(long)]
    req: String,
    /// The writer's identity, recorded with the publication (e.g. the prefill engine's name).
    #[arg(long, env = "PDSTOR_WRITER", default_value = "writer")]
    writer: String,
    /// JSON layout (model_id, dtype, layers, kv_heads, head_dim, chunk_tokens, kv_format).
    #[arg(long)]
    layout: PathBuf,
    /// The KV bytes to store: a file whose size is a non-zero multiple of 4096.
    #[arg(long)]
    from: PathBuf,
    /// Bytes per chunk (at most the namespace's slot size); k, M, G suffixes.
    #[arg(long, default_value = "8M", value_parser = parse_size)]
    chunk_size: u64,
    /// Chunks per store batch.
    #[arg(long, default_value_t = 4)]
    batch: u32,
    /// The first token the reader continues from, recorded in the manifest.
    #[arg(long)]
    first_token: Option<u32>,
    #[command(flatten)]
    buffer: BufferArgs,
    /// Append this node's steps to a JSON-lines timeline (see `pdstor timeline`).
    #[arg(long)]
    timeline: Option<PathBuf>,
}

impl PutArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let layout: Layout = read_json(&self.layout, "layout")?;
        let from = &self.from;
        let payload = std::fs::read(from).map_err(|e| anyhow::anyhow!("reading {}: {e}", from.display()))?;
        if payload.is_empty() || !payload.len().is_multiple_of(4096) {
            anyhow::bail!(
                "{} is {} bytes; a KV payload must be a non-empty multiple of 4096 bytes (direct I/O): pad it",
                from.display(),
                payload.len()
            );
        }
        let chunks = payload.len().div_ceil(self.chunk_size as usize) as u32;
        let d = &self.daemon;
        let mut w = Writer::with_buffer(&d.server, &d.data_socket, self.chunk_size, chunks, self.buffer.spec())?
            .with_writer_id(&self.writer);
        let started = Instant::now();
        let published = w.put(&self.req, &layout, &payload, self.batch, self.first_token)?;
        eprintln!(
            "pdstor put: {} bytes in {chunks} chunks stored and published in {:.3} s",
            payload.len(),
            started.elapsed().as_secs_f64()
        );
        if let Some(t) = self.timeline {
            let r = &published.receipt;
            let mut e = Event::new("publish").req(&self.req).publication(r.publication).receipt(&r.signature);
            e.chunks = Some(chunks);
            Timeline::open(&t, &format!("writer-{}", std::process::id()))?.emit(e);
        }
        print_json(&published.receipt)
    }
}

#[derive(clap::Args)]
pub struct ClaimArgs {
    #[command(flatten)]
    daemon: Server,
    /// The READY receipt `pdstor put` printed (a JSON file).
    #[arg(long)]
    receipt: PathBuf,
    /// The reader's identity (e.g. the decode engine's name); only it may adopt.
    #[arg(long)]
    reader: String,
    /// The reader's session; closing it (`close-session`) fences the claim.
    #[arg(long)]
    session: String,
    /// How long the claim is leased, in ms (expiry never frees claimed bytes).
    #[arg(long, default_value_t = 60_000)]
    lease_ms: u64,
}

impl ClaimArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let ready: Receipt = read_json(&self.receipt, "receipt")?;
        print_json(&Client::new(&self.daemon.server).claim(&ready, &self.reader, &self.session, self.lease_ms)?)
    }
}

#[derive(clap::Args)]
pub struct GetArgs {
    #[command(flatten)]
    daemon: Daemon,
    /// The claim receipt `pdstor claim` printed (a JSON file).
    #[arg(long)]
    claim: PathBuf,
    /// The JSON layout the reader expects; adopt refuses a publication with another.
    #[arg(long)]
    layout: PathBuf,
    /// Where to write the restored bytes.
    #[arg(long)]
    out: PathBuf,
    /// Acknowledge right after a verified restore (no digest to copy by hand).
    #[arg(long)]
    ack: bool,
    #[command(flatten)]
    buffer: BufferArgs,
    /// Append this node's steps to a JSON-lines timeline (see `pdstor timeline`).
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Read the chunks straight from this host's view of the shared namespace (a block device
    /// or file, opened read-only beside the owner; e.g. the NVMe/TCP namespace on another host)
    /// instead of through the daemon's data plane: the receipt's namespace is checked against
    /// its superblock first, and only checksums go back to the daemon (`loaded`).
    #[arg(long, value_name = "DEVICE")]
    direct: Option<PathBuf>,
    /// With --direct, on a namespace its owner reserves (`serve --reservation-key`): register this
    /// key for this host first, and name it at adopt so that the owner can cut this host off when
    /// it fences this reader (hex 0x… or decimal; root).
    #[arg(long, requires = "direct", value_parser = super::serve::parse_key)]
    reservation_key: Option<u64>,
}

/// Who restored: the daemon's data plane, or this host itself from the shared namespace.
enum Restorer {
    Daemon(Client),
    Direct(Box<pdstor_client::RemoteReader>),
}

impl GetArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let claim: Receipt = read_json(&self.claim, "claim receipt")?;
        let layout: Layout = read_json(&self.layout, "layout")?;
        let tl = match &self.timeline {
            Some(t) => Some(std::sync::Arc::new(Timeline::open(t, &format!("reader-{}", std::process::id()))?)),
            None => None,
        };
        let started = Instant::now();
        let (restored, bytes, restorer) = match &self.direct {
            Some(device) => {
                // A direct reader records its own reads, restore and ack on the timeline.
                let mut r = pdstor_client::RemoteReader::open_with(&self.daemon.server, device, self.reservation_key)?;
                if let Some(tl) = &tl {
                    r = r.with_timeline(tl.clone());
                }
                let restored = r.get(&claim, &layout)?;
                let bytes = r.restored_bytes(restored.len)?;
                (restored, bytes, Restorer::Direct(Box::new(r)))
            }
            None => {
                let mut r = Reader::with_buffer(&self.daemon.server, &self.daemon.data_socket, self.buffer.spec())?;
                let restored = r.get(&claim, &layout)?;
                let bytes = r.restored_bytes(restored.len)?;
                (restored, bytes, Restorer::Daemon(r.client))
            }
        };
        let restore_seconds = started.elapsed().as_secs_f64();
        let out = &self.out;
        pdstor_client::private::write(out, &bytes).map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
        let note = |event: &str| {
            if let Some(tl) = &tl {
                tl.emit(Event::new(event).claim(&claim));
            }
        };
        match (&restorer, self.ack) {
            (Restorer::Direct(r), true) => r.ack(&claim, &restored)?,
            (Restorer::Direct(_), false) => {}
            (Restorer::Daemon(client), ack) => {
                note("restored");
                if ack {
                    client.ack(&claim, &restored.restore_digest)?;
                    note("ack");
                }
            }
        }
        print_json(&serde_json::json!({
            "publication": restored.manifest.publication,
            "chunks": restored.manifest.chunks.len(),
            "bytes": restored.len,
            "first_token": restored.manifest.first_token,
            "restore_digest": restored.restore_digest,
            "acked": self.ack,
            "restore_seconds": restore_seconds,
        }))
    }
}

#[derive(clap::Args)]
pub struct AckArgs {
    #[command(flatten)]
    daemon: Server,
    /// The claim receipt (a JSON file).
    #[arg(long)]
    claim: PathBuf,
    /// The restore digest `pdstor get` printed (without `--ack`): SHA-256 of the claim's restore nonce and the
    /// chunks' crc32c. The daemon acknowledges only chunks it served to this claim.
    #[arg(long)]
    restore_digest: String,
}

impl AckArgs {
    pub fn run(self) -> anyhow::Result<()> {
        Ok(Client::new(&self.daemon.server).ack(&read_json(&self.claim, "claim receipt")?, &self.restore_digest)?)
    }
}

#[derive(clap::Args)]
pub struct ReleaseArgs {
    #[command(flatten)]
    daemon: Server,
    /// The READY receipt (a JSON file).
    #[arg(long)]
    receipt: PathBuf,
}

impl ReleaseArgs {
    pub fn run(self) -> anyhow::Result<()> {
        Ok(Client::new(&self.daemon.server).release(&read_json(&self.receipt, "receipt")?)?)
    }
}

#[derive(clap::Args)]
pub struct AbortArgs {
    #[command(flatten)]
    daemon: Server,
    /// The publication id (`pdstor publications`).
    #[arg(long)]
    publication: u64,
    /// Its writer's token, as its prepare answered it (an operator without it cancels the
    /// request instead: `pdstor cancel --req`).
    #[arg(long)]
    writer_token: String,
}

impl AbortArgs {
    pub fn run(self) -> anyhow::Result<()> {
        println!(
            "{}",
            serde_json::to_string(&Client::new(&self.daemon.server).abort(self.publication, &self.writer_token)?)?
        );
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    daemon: Server,
    /// The request to give up: a prepare of it still waiting is refused, its PREPARED
    /// publication rolled back. Nothing to cancel is not an error.
    #[arg(long)]
    req: String,
}

impl CancelArgs {
    pub fn run(self) -> anyhow::Result<()> {
        println!("{}", serde_json::to_string(&Client::new(&self.daemon.server).cancel(&self.req)?)?);
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct FailArgs {
    #[command(flatten)]
    daemon: Server,
    /// The claim receipt (a JSON file).
    #[arg(long)]
    claim: PathBuf,
    /// Why the read failed, recorded in the journal.
    #[arg(long)]
    reason: String,
}

impl FailArgs {
    pub fn run(self) -> anyhow::Result<()> {
        Ok(Client::new(&self.daemon.server).fail(&read_json(&self.claim, "claim receipt")?, &self.reason)?)
    }
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["claim", "publication"])))]
pub struct ReclaimArgs {
    #[command(flatten)]
    daemon: Server,
    /// The claim receipt (a JSON file): its claimant, or the publication's owner, reclaims once
    /// the reader is fenced.
    #[arg(long)]
    claim: Option<PathBuf>,
    /// An admin reclaims by publication number, without the claim receipt (its answer was lost):
    /// the claim's session is closed first (a direct reader's host cut off), then it is freed.
    #[arg(long, requires = "reason")]
    publication: Option<u64>,
    /// With --publication: why, journaled and on the timeline.
    #[arg(long, requires = "publication")]
    reason: Option<String>,
}

impl ReclaimArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let c = Client::new(&self.daemon.server);
        match (&self.claim, self.publication, &self.reason) {
            (Some(claim), _, _) => Ok(c.reclaim(&read_json(claim, "claim receipt")?)?),
            (None, Some(publication), Some(reason)) => Ok(c.reclaim_publication(publication, reason)?),
            _ => anyhow::bail!("pdstor reclaim: give --claim RECEIPT, or --publication N --reason WHY (an admin)"),
        }
    }
}

#[derive(clap::Args)]
pub struct EndReadsArgs {
    #[command(flatten)]
    daemon: Server,
    /// The cache publication whose reads end (an admin): each held read's receipt is refused
    /// read_ended from then on, and a release of the publication is no longer refused for them.
    #[arg(long)]
    publication: u64,
    /// Why, on the timeline.
    #[arg(long)]
    reason: String,
}

impl EndReadsArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let n = Client::new(&self.daemon.server).end_reads_of(self.publication, &self.reason)?;
        println!("{n} read(s) of publication {} ended", self.publication);
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct TakeoverArgs {
    /// The standby's control plane (an admin's call).
    #[command(flatten)]
    daemon: Server,
}

impl TakeoverArgs {
    pub fn run(self) -> anyhow::Result<()> {
        println!("{}", serde_json::to_string(&Client::new(&self.daemon.server).takeover()?)?);
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct CloseSessionArgs {
    #[command(flatten)]
    daemon: Server,
    /// A claim receipt of the session to close (a JSON file): the proof that the caller holds it.
    #[arg(long)]
    claim: PathBuf,
}

impl CloseSessionArgs {
    pub fn run(self) -> anyhow::Result<()> {
        Ok(Client::new(&self.daemon.server).close_session(&read_json(&self.claim, "claim receipt")?)?)
    }
}

#[derive(clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    daemon: Server,
}

impl StatusArgs {
    pub fn run(self) -> anyhow::Result<()> {
        print!("{}", Client::new(&self.daemon.server).metrics()?);
        Ok(())
    }
}

#[derive(clap::Args)]
pub struct PublicationsArgs {
    #[command(flatten)]
    daemon: Server,
    /// Only publications in this state.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(STATES), ignore_case = true)]
    state: Option<String>,
    /// List each chunk's slot, byte offset, length and crc32c on the target.
    #[arg(long, short)]
    verbose: bool,
}

impl PublicationsArgs {
    pub fn run(self) -> anyhow::Result<()> {
        print_json(&Client::new(&self.daemon.server).publications(self.state.as_deref(), self.verbose)?)
    }
}
