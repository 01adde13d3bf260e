//! Receipts — daemon-signed statements of a publication's state — and the
//! digests that bind a manifest and a restore to them. The daemon signs and
//! verifies receipts (`pdstor_daemon::protocol::Signer`); everyone reads them.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::layout::Manifest;

/// What a receipt attests.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReceiptKind {
    /// The publication is READY: payload and manifest are durable.
    Ready,
    /// The publication is claimed by exactly this reader and session.
    Claim,
    /// A read of a cache publication, by this reader and session, in progress.
    Read,
}

/// A daemon-signed statement about a publication. Field order is the
/// canonical encoding that the signature covers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// READY or claim.
    pub kind: ReceiptKind,
    /// The namespace (its uuid).
    pub namespace: String,
    /// The daemon epoch that issued it.
    pub epoch: u64,
    /// The publication.
    pub publication: u64,
    /// Its request id.
    pub req_id: String,
    /// SHA-256 of the manifest's canonical JSON.
    pub manifest_digest: String,
    /// The claimed reader (claim receipts).
    pub reader: Option<String>,
    /// The claimed session (claim receipts).
    pub session: Option<String>,
    /// The claim's lease, in ms (claim receipts).
    pub lease_ms: Option<u64>,
    /// When it was issued, by the protocol's clock.
    pub issued_unix_ms: u64,
    /// Which key signed it.
    pub key_id: u32,
    /// Hex HMAC-SHA256 over the canonical encoding of every field above.
    pub signature: String,
}

/// The digest that names a manifest: SHA-256 of its canonical JSON.
pub fn manifest_digest(m: &Manifest) -> String {
    if m.restore_nonce.is_some() {
        let stored = Manifest { restore_nonce: None, ..m.clone() };
        return hex::encode(Sha256::digest(serde_json::to_vec(&stored).unwrap_or_default()));
    }
    hex::encode(Sha256::digest(serde_json::to_vec(m).unwrap_or_default()))
}

/// The digest a reader acknowledges with: SHA-256 over the claim's restore
/// nonce (from `adopt`) and the little-endian crc32c of each chunk it
/// restored, in chunk order. The reader computes it from the bytes it loaded;
/// the daemon from the chunks it served to that claim, and it refuses an ack
/// while any chunk was never served (`not_loaded`).
pub fn restore_digest(nonce: &str, chunk_crcs: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update(b"pdstor restore v2\0");
    h.update(nonce.as_bytes());
    h.update([0]);
    for c in chunk_crcs {
        h.update(c.to_le_bytes());
    }
    hex::encode(h.finalize())
}
