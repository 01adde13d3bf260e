//! A publication as the store keeps it: its phase, its slots and chunks, who
//! prepared it and who holds its claim. Data only: [`super::state::State`]
//! changes them, record by record.

use serde::{Deserialize, Serialize};

use pdstor_client::layout::{ChunkEntry, Layout, Manifest, SlotIndex};

/// Where a publication is in its life (DESIGN §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Phase {
    /// Admitted; batches store its chunks.
    Prepared,
    /// Published: every chunk durable, a reader may claim it.
    Ready,
    /// One reader and session hold it.
    Claimed,
    /// The claimed reader confirmed what it reads.
    Adopted,
    /// A claimed read failed or was uncertain: bytes and slots kept.
    Retained,
    /// Aborted while batches were in flight: slots free when they finish.
    Aborting,
}

/// A live publication: its request, its slots and where it is in its life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Publication {
    /// Its number.
    pub id: u64,
    /// Its request id.
    pub req_id: String,
    /// Its writer.
    pub writer: String,
    /// Its KV layout.
    pub layout: Layout,
    /// Chunks declared.
    pub total_chunks: u32,
    /// Reserved slots; chunk `i` lives in `slots[i]`.
    pub slots: Vec<SlotIndex>,
    /// Stored chunks, by index (`None` until stored).
    pub chunks: Vec<Option<ChunkEntry>>,
    /// Its phase.
    pub phase: Phase,
    /// Its manifest, once READY.
    pub manifest: Option<Manifest>,
    /// Who holds it, once claimed.
    pub claim: Option<ClaimInfo>,
    /// The identity that prepared it (`None` in journals older than identities).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    /// Its own unread window in ms, where its writer asked for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unread_release_ms: Option<u64>,
    /// A cache publication: once READY, read by many (each read a lease the
    /// store counts, `Store::begin_read`), never claimed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cache: bool,
    /// Its manifest's digest, kept beside the manifest in memory only.
    #[serde(skip)]
    pub digest: DigestCache,
}

impl Publication {
    /// The digest of its manifest (which every receipt of it names), once
    /// READY: taken when the manifest was recorded, not per step.
    pub fn manifest_digest(&self) -> Option<String> {
        match (&self.digest.0, &self.manifest) {
            (Some(d), _) => Some(d.clone()),
            (None, m) => m.as_ref().map(pdstor_client::receipt::manifest_digest),
        }
    }

    /// Records `manifest` and its digest.
    pub fn set_manifest(&mut self, manifest: Manifest) {
        self.digest = DigestCache(Some(pdstor_client::receipt::manifest_digest(&manifest)));
        self.manifest = Some(manifest);
    }
}

/// A value derived from the publication's manifest, kept so that it is
/// computed once. It adds nothing to what a publication is: two publications
/// with the same fields are equal whatever their caches hold.
#[derive(Debug, Clone, Default)]
pub struct DigestCache(Option<String>);

impl PartialEq for DigestCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for DigestCache {}

/// The identity a publication or claim is bound to: the tenant and the
/// principal the daemon proved (`uid:1000`, `cert:prefill-0`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// The tenant it belongs to.
    pub tenant: String,
    /// The principal: `uid:<n>` for a Unix peer, `cert:<name>` for a TLS client.
    pub principal: String,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (tenant {})", self.principal, self.tenant)
    }
}

/// Who holds a claim, bound by the CLAIM record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimInfo {
    /// The reader.
    pub reader: String,
    /// The reader's session.
    pub session: String,
    /// The claim's lease, in ms.
    pub lease_ms: u64,
    /// The daemon epoch the claim was made in; a later epoch fences it.
    pub epoch: u64,
    /// When it was claimed, by the protocol's clock.
    pub claimed_unix_ms: u64,
    /// The identity that claimed it: only it adopts, loads and acks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimant: Option<Owner>,
    /// Adopted by a reader that reads the shared namespace itself, from
    /// another host: the daemon's restart does not stop its reads, so it
    /// does not fence it (only closing its session does).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub direct: bool,
    /// A direct reader's host's persistent-reservation key: fencing it
    /// preempts this key at the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_key: Option<u64>,
}
