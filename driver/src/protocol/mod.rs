//! The ownership protocol's proofs (DESIGN §4): receipts signed with the
//! namespace's HMAC key, manifest digests, and the checks every step runs on
//! the receipt it is given. The state transitions themselves are journaled by
//! the store (`store::Store::{claim, adopt, ack, fail, reclaim}`).
//!
//! A receipt is verified on every use: signature, namespace, publication,
//! state, manifest digest, and (for claims) reader and session. A mismatch is
//! a [`Refusal`] naming the field; it changes nothing.

pub mod identity;
pub mod policy;
pub mod service;

use pdstor_client::code::RefusalCode;
use pdstor_client::receipt::{Receipt, ReceiptKind};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Why a protocol step was refused: a stable code and the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code} ({field}): {message}")]
pub struct Refusal {
    /// The stable code; its HTTP status and exit status follow from it.
    pub code: RefusalCode,
    /// The request field at fault.
    pub field: &'static str,
    /// What was refused, on what input, and what to do.
    pub message: String,
}

impl Refusal {
    /// A refusal of `code` naming `field`.
    pub fn new(code: RefusalCode, field: &'static str, message: impl Into<String>) -> Refusal {
        Refusal { code, field, message: message.into() }
    }
}

/// The canonical bytes of a receipt: its JSON with the signature emptied.
fn canonical(r: &Receipt) -> Vec<u8> {
    let mut unsigned = r.clone();
    unsigned.signature = String::new();
    serde_json::to_vec(&unsigned).unwrap_or_default()
}

/// Signs receipts and verifies them, with one namespace's key.
#[derive(Clone)]
pub struct Signer {
    key: [u8; 32],
    key_id: u32,
    namespace: String,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// A signer with `key` (id `key_id`) for `namespace`.
    pub fn new(key: [u8; 32], key_id: u32, namespace: String) -> Signer {
        Signer { key, key_id, namespace }
    }

    /// The signer of the namespace `sb` describes: its key, key id and uuid.
    pub fn for_namespace(sb: &pdstor_client::superblock::Superblock) -> Signer {
        Signer::new(sb.hmac_key, sb.hmac_key_id, sb.uuid.to_string())
    }

    /// The namespace it signs for.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn mac(&self, bytes: &[u8]) -> HmacSha256 {
        // HMAC accepts keys of any length; 32 bytes never fails.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
        mac.update(bytes);
        mac
    }

    /// Fills in namespace, key id and signature.
    pub fn sign(&self, mut r: Receipt) -> Receipt {
        r.namespace = self.namespace.clone();
        r.key_id = self.key_id;
        r.signature = hex::encode(self.mac(&canonical(&r)).finalize().into_bytes());
        r
    }

    fn writer_mac(&self, publication: u64, req_id: &str) -> HmacSha256 {
        let mut m = self.mac(b"pdstor writer token\0");
        m.update(self.namespace.as_bytes());
        m.update(&[0]);
        m.update(&publication.to_le_bytes());
        m.update(req_id.as_bytes());
        m
    }

    /// The writer's token for `publication` of `req_id`: the proof, answered
    /// to `prepare` only, that a store, publish or abort comes from its
    /// writer (a publication id alone is not enough: ids are sequential).
    pub fn writer_token(&self, publication: u64, req_id: &str) -> String {
        hex::encode(self.writer_mac(publication, req_id).finalize().into_bytes())
    }

    /// The restore nonce of the claim whose receipt carries `claim_signature`:
    /// derived from the namespace key, so it is the same after a restart and
    /// new for every claim, and only the daemon can make it.
    pub fn restore_nonce(&self, claim_signature: &str) -> String {
        let mut m = self.mac(b"pdstor restore nonce\0");
        m.update(claim_signature.as_bytes());
        hex::encode(&m.finalize().into_bytes()[..16])
    }

    /// Whether `token` is the writer's token of `publication` (constant time).
    pub fn is_writer_token(&self, publication: u64, req_id: &str, token: &str) -> bool {
        hex::decode(token).is_ok_and(|t| self.writer_mac(publication, req_id).verify_slice(&t).is_ok())
    }

    /// Checks the signature (constant time) and the namespace.
    pub fn verify(&self, r: &Receipt) -> Result<(), Refusal> {
        if r.namespace != self.namespace {
            return Err(Refusal::new(
                RefusalCode::NamespaceMismatch,
                "namespace",
                format!("receipt is for namespace {}, this daemon serves {}", r.namespace, self.namespace),
            ));
        }
        if r.key_id != self.key_id {
            return Err(Refusal::new(
                RefusalCode::KeyRotated,
                "key_id",
                format!(
                    "the receipt was signed with key {}; this namespace signs with key {} since `pdstor rotate-key`: the receipt is void",
                    r.key_id, self.key_id
                ),
            ));
        }
        let sig = hex::decode(&r.signature)
            .map_err(|_| Refusal::new(RefusalCode::BadSignature, "signature", "signature is not hex"))?;
        self.mac(&canonical(r)).verify_slice(&sig).map_err(|_| {
            Refusal::new(
                RefusalCode::BadSignature,
                "signature",
                "receipt signature does not verify: forged, altered or truncated",
            )
        })
    }
}

/// The system clock, in ms since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Where the protocol reads the time (claims, leases, receipts): the system
/// clock in the daemon, a simulated one in the simulation.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Now, in ms since the Unix epoch.
    fn now_unix_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> u64 {
        now_unix_ms()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receipt() -> Receipt {
        Receipt {
            kind: ReceiptKind::Claim,
            namespace: String::new(),
            epoch: 3,
            publication: 9,
            req_id: "r".into(),
            manifest_digest: "ab".into(),
            reader: Some("decode-0".into()),
            session: Some("s1".into()),
            lease_ms: Some(1000),
            issued_unix_ms: 1,
            key_id: 0,
            signature: String::new(),
        }
    }

    #[test]
    fn a_signed_receipt_verifies_and_any_change_breaks_it() {
        let s = Signer::new([7; 32], 1, "ns-a".into());
        let r = s.sign(receipt());
        s.verify(&r).unwrap();
        let mut forged = r.clone();
        forged.reader = Some("decode-1".into());
        assert_eq!(s.verify(&forged).unwrap_err().code, "bad_signature");
        let mut truncated = r.clone();
        truncated.signature.truncate(10);
        assert_eq!(s.verify(&truncated).unwrap_err().code, "bad_signature");
        let other = Signer::new([8; 32], 1, "ns-b".into());
        assert_eq!(other.verify(&r).unwrap_err().field, "namespace");
        let same_ns_other_key = Signer::new([8; 32], 1, "ns-a".into());
        assert_eq!(same_ns_other_key.verify(&r).unwrap_err().code, "bad_signature");
    }
}
