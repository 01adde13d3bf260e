//! JSON bodies of the control plane and the data plane, shared by the daemon
//! and the client so the two cannot drift apart.

use serde::{Deserialize, Serialize};

use crate::layout::{Layout, Manifest};
use crate::receipt::Receipt;

mod batch;
mod data;

pub use batch::*;
pub use data::*;

/// `POST /storage-pd/prepare`: reserve a request's chunks.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareRequest {
    /// The serving engine's request id.
    pub req_id: String,
    /// The KV layout the reader must match.
    pub layout: Layout,
    /// Chunks the request will store (all reserved now).
    pub total_chunks: u32,
    /// The writer's identity, recorded with the publication.
    pub writer: String,
    /// The longest this prepare waits for capacity, in ms (at most the
    /// daemon's `--admission-timeout-ms`, which is also the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Released unread if no reader claims it this long (ms) after it is
    /// READY — an exact unread release, an `expire` on the timeline — so a
    /// reader that never comes holds its slots a bounded time. The daemon's
    /// `--unread-release-ms`, where shorter, bounds it; absent: that alone
    /// (none: kept until released). Claimed publications are never freed by
    /// time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unread_release_ms: Option<u64>,
    /// A cache publication: once READY, any reader the namespace lets read
    /// it reads it (`POST /storage-pd/read`), each read a lease of its own
    /// that ends with the read; it is never claimed, and it stays READY
    /// until released or evicted. Absent: a handoff, for one reader.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
}

/// `POST /storage-pd/cancel`: give up a request, waiting or PREPARED.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CancelRequest {
    /// The request to cancel.
    pub req_id: String,
}

/// `POST /storage-pd/publish`: make a fully stored publication READY.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublishRequest {
    /// The PREPARED publication.
    pub publication: u64,
    /// Its writer's token (`prepare` answered it).
    pub writer_token: String,
    /// The token the reader continues from, recorded in the manifest.
    pub first_token: Option<u32>,
}

/// `POST /storage-pd/claim`: bind one reader and session to a READY publication.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClaimRequest {
    /// The READY receipt.
    pub receipt: Receipt,
    /// The reader's identity; only it may adopt.
    pub reader_id: String,
    /// The reader's session; closing it fences the claim.
    pub session_id: String,
    /// How long the claim is leased, in ms (expiry never frees claimed bytes).
    pub lease_ms: u64,
    /// The layout this reader will adopt with. When given, a publication
    /// stored with another layout is refused `layout_mismatch` before it is
    /// claimed, so it stays READY for a reader that can restore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
    /// Adopt the claim too, through the daemon, with `layout` (required):
    /// the answer carries the manifest, as `adopt` would have answered it —
    /// claim and adopt in one round trip. Should the adopt be refused once
    /// the claim is made, the answer carries the receipt and the adopt's
    /// refusal (`adopt_refused`), the claim stands CLAIMED: report it failed
    /// or adopt it again. An exact repeat of a claim that adopted answers the
    /// same receipt and manifest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt: bool,
}

impl ClaimRequest {
    /// A claim of `ready` by `reader` in `session` for `lease_ms`.
    pub fn new(
        ready: &Receipt,
        reader: &str,
        session: &str,
        lease_ms: u64,
        layout: Option<Layout>,
        adopt: bool,
    ) -> ClaimRequest {
        ClaimRequest {
            receipt: ready.clone(),
            reader_id: reader.into(),
            session_id: session.into(),
            lease_ms,
            layout,
            adopt,
        }
    }
}

/// A signed receipt, as `claim` answers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptResponse {
    /// The receipt.
    pub receipt: Receipt,
    /// A claim with `adopt`: the manifest its adopt answered (with the
    /// claim's restore nonce).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Manifest>,
    /// A claim with `adopt` whose adopt was refused once the claim was made:
    /// why (the claim stands, CLAIMED).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adopt_refused: Option<ErrorBody>,
}

/// `POST /storage-pd/ack`: the reader restored every chunk; the slots free.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AckRequest {
    /// The claim receipt.
    pub receipt: Receipt,
    /// SHA-256 over the restored chunks' crc32c, in chunk order.
    pub restore_digest: String,
}

/// `POST /storage-pd/loaded`: a reader that loaded chunks itself, straight
/// from its own view of a shared namespace (another host over NVMe/TCP), says
/// what it read; the daemon checks each crc32c against the stored one and
/// counts the chunks as loaded for the claim. Payload bytes never cross the
/// control plane: only their checksums do.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadedRequest {
    /// The claim receipt.
    pub receipt: Receipt,
    /// Each chunk read, with the crc32c of the bytes the reader read.
    pub chunks: Vec<LoadedChunk>,
}

/// `GET /storage-pd/namespace`: what the owner serves, so that a reader on
/// another host can prove its own view of the shared namespace is the same
/// one before it reads anything from it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// The pdstor namespace (its superblock's UUID; receipts name it).
    pub namespace: String,
    /// The store's epoch.
    pub epoch: u64,
    /// The slot size and count, as formatted.
    pub slot_size: u64,
    /// Slots in the namespace.
    pub slot_count: u64,
    /// The NVMe namespace identifiers of the owner's target, where it has them.
    pub device: pdstor_engine::io::DeviceIds,
    /// The owner holds an Exclusive Access — All Registrants reservation on
    /// the namespace (`serve --reservation-key`): a direct reader's host must
    /// register a key of its own before it can read, and names it at adopt.
    #[serde(default)]
    pub reservations: bool,
    /// The owner's target's write cache now: whether its commits flush
    /// (`none`: a completed write is durable, no flush is issued).
    #[serde(default)]
    pub write_cache: Option<pdstor_engine::io::WriteCache>,
}

/// One chunk a reader loaded itself.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadedChunk {
    /// The chunk's index in the manifest.
    pub index: u32,
    /// crc32c of the bytes the reader read.
    pub crc32c: u32,
}

/// `POST /storage-pd/lookup`: the READY receipts of requests known by name.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LookupRequest {
    /// The request ids (at most 4096).
    pub req_ids: Vec<String>,
}

/// What `lookup` answers: one entry per request asked, in order — its READY
/// receipt, or `null` where there is none the caller may claim or release.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LookupResponse {
    /// The receipts.
    pub receipts: Vec<Option<Receipt>>,
}

/// A request that carries only a receipt (`release`, `reclaim`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiptOnly {
    /// The receipt.
    pub receipt: Receipt,
}

/// `POST /storage-pd/admin/reclaim`: an operator (admin) frees a claimed or
/// retained publication by number, fencing its claim's session first — the
/// way out for a claim whose receipt nobody holds.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperatorReclaimRequest {
    /// The publication.
    pub publication: u64,
    /// Why, journaled and on the timeline.
    pub reason: String,
}

/// `POST /storage-pd/admin/end-reads`: an operator (admin) ends every read
/// of a cache publication, by number — the way out for reads whose reader
/// died holding them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OperatorEndReadsRequest {
    /// The cache publication.
    pub publication: u64,
    /// Why, on the timeline.
    pub reason: String,
}

/// What `admin/end-reads` did.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndedReads {
    /// How many reads it ended (0: none was open).
    pub ended: u64,
}

/// `POST /storage-pd/admin/takeover` (a standby, admin): what the takeover did.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeoverAnswer {
    /// The namespace now served by this daemon.
    pub namespace: String,
    /// The epoch its takeover began.
    pub epoch: u64,
    /// The old owner's reservation key, preempted (hex), if it held another than this daemon's.
    pub preempted_key: Option<String>,
    /// The epoch the old owner served.
    pub previous_epoch: u64,
    /// Publications that survived (READY or later).
    pub live: u64,
    /// Publications rolled back (never published).
    pub rolled_back: Vec<u64>,
    /// From the decision to the store open, in ms.
    pub took_ms: u64,
}

/// `POST /storage-pd/abort`: roll back a publication that is not READY.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbortRequest {
    /// The publication.
    pub publication: u64,
    /// Its writer's token (`prepare` answered it).
    pub writer_token: String,
}

/// What `abort` did.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AbortResponse {
    /// `aborted`, `pending` (batches in flight) or `not_found`.
    pub outcome: String,
    /// Slots freed now (0 when pending).
    pub slots: u32,
}

/// `POST /storage-pd/fail`: a failed or uncertain claimed read; the publication is RETAINED.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailRequest {
    /// The claim receipt.
    pub receipt: Receipt,
    /// Why the read failed, journaled.
    pub reason: String,
}

/// `POST /storage-pd/session/close`: fence a reader session, proven by a
/// claim receipt of that session.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionCloseRequest {
    /// A claim receipt whose session is the one to fence.
    pub receipt: Receipt,
}

/// A step that answers nothing but success.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Done {
    /// Always `true`.
    pub ok: bool,
}

/// `GET /readyz` while the store accepts changes with journal headroom.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readiness {
    /// Always true here: a daemon that is not ready answers 503 with an error.
    pub ready: bool,
    /// Bytes of the active journal half in use.
    pub journal_used: u64,
    /// Bytes in one journal half (not ready above three quarters of it).
    pub journal_half: u64,
    /// The namespace's epoch: a restart advances it.
    pub epoch: u64,
    /// Whether the eBPF probes are attached (`serve --provenance`).
    pub provenance: ProbesState,
}

/// Whether the daemon's eBPF probes are attached.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProbesState {
    /// `serve --provenance`: every payload's path is judged from the kernel.
    Attached,
    /// No probes: the data plane reports what it asked for.
    Off,
}

/// Every refusal and failure: HTTP status, a stable code, the offending field.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = Error))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The HTTP status, from the code.
    pub status: u16,
    /// The stable code clients match on (`RefusalCode`).
    pub code: String,
    /// The request field at fault, or empty.
    pub field: String,
    /// What failed, on what input, and what to do.
    pub message: String,
}

impl ErrorBody {
    /// The body for `code`: its status follows from the code.
    pub fn new(code: crate::code::RefusalCode, field: &str, message: impl Into<String>) -> ErrorBody {
        ErrorBody { status: code.status(), code: code.as_str().into(), field: field.into(), message: message.into() }
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({}): {}", self.status, self.code, self.field, self.message)
    }
}

impl std::error::Error for ErrorBody {}

/// A publication as listed by `GET /storage-pd/publications`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PublicationInfo {
    /// The publication's number.
    pub publication: u64,
    /// Its request id.
    pub req_id: String,
    /// Its phase (`READY`, `CLAIMED`, …).
    pub state: String,
    /// Its chunks.
    pub chunks: u32,
    /// Its writer.
    pub writer: String,
    /// Its claimed reader, if claimed.
    pub reader: Option<String>,
    /// Its writer's unread window in ms (`prepare`'s `unread_release_ms`), if it asked for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unread_release_ms: Option<u64>,
    /// A cache publication (read by many, never claimed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
    /// Reads of it in progress (cache publications).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reading: u32,
    /// With `?verbose=1`: where each chunk lives on the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extents: Option<Vec<Extent>>,
}

/// One chunk's place on the target: its slot and the bytes there. `len` and
/// `crc32c` are absent until the chunk is stored.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// The chunk's index.
    pub chunk: u32,
    /// The slot it lives in.
    pub slot: u32,
    /// Byte offset of the slot on the target.
    pub offset: u64,
    /// Its stored length, once stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// Its crc32c, once stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
}

/// What `prepare` answers: the publication and the namespace it lives in.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Prepared {
    /// The PREPARED publication.
    pub publication: u64,
    /// The writer's token: store batches, publish and abort of this
    /// publication must carry it (only `prepare` answers it).
    pub writer_token: String,
    /// The namespace.
    pub namespace: String,
    /// The daemon epoch.
    pub epoch: u64,
}

/// `POST /storage-pd/adopt`: the claimed reader confirms what it will read.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdoptRequest {
    /// The claim receipt.
    pub receipt: Receipt,
    /// The namespace the reader expects.
    pub namespace: String,
    /// The epoch the reader expects.
    pub epoch: u64,
    /// The manifest digest the reader expects.
    pub manifest_digest: String,
    /// The KV layout the reader expects.
    pub layout: Layout,
    /// The reader reads the chunks itself from its own view of the shared
    /// namespace (another host, over NVMe/TCP say), not through the daemon:
    /// a daemon restart cannot stop such reads, so it does not fence this
    /// claim — its slots stay taken until it acks or its session is closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub direct: bool,
    /// A direct reader's persistent-reservation key, registered by its host
    /// on the shared namespace: fencing it (closing its session) preempts
    /// this key at the target, so that host can no longer read or write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_key: Option<u64>,
}

impl AdoptRequest {
    /// The adopt of a claim through the daemon, every field taken from the
    /// claim receipt itself: its namespace, epoch and manifest digest, with
    /// the layout the reader expects.
    pub fn of_claim(claim: &Receipt, layout: Layout) -> AdoptRequest {
        AdoptRequest {
            receipt: claim.clone(),
            namespace: claim.namespace.clone(),
            epoch: claim.epoch,
            manifest_digest: claim.manifest_digest.clone(),
            layout,
            direct: false,
            reservation_key: None,
        }
    }
}

/// A READY publication: its signed receipt and its manifest.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Published {
    /// The READY receipt.
    pub receipt: Receipt,
    /// The manifest.
    pub manifest: Manifest,
}

/// What `cancel` did for a request id.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum CancelOutcome {
    /// A prepare was waiting for admission; it is refused.
    Cancelled,
    /// The PREPARED publication was rolled back.
    Aborted {
        /// The publication.
        publication: u64,
        /// Slots freed.
        slots: u32,
    },
    /// Batches are in flight; the publication rolls back when they finish.
    Pending {
        /// The publication.
        publication: u64,
    },
    /// Nothing waits or is PREPARED under this request id.
    None,
}

/// serde's `skip_serializing_if` for a count that is zero.
fn is_zero(n: &u32) -> bool {
    *n == 0
}
