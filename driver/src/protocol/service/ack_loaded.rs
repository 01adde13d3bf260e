//! Step 7 folded into the last load: the daemon acknowledges a claim whose
//! chunks it loaded and checked itself (a data-plane `load` with `ack`), so
//! a get costs no round trip of its own for the ack. The rules are the
//! ack's, plus the check the reader would have made: every chunk loaded for
//! this claim and checked by the daemon, each as stored.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

impl Service {
    /// Whether a load of `chunks` for `claim` may acknowledge it once done,
    /// asked before anything is loaded (a refusal changes nothing): a claim
    /// (a cache read ends instead), no chunk loaded earlier where the daemon
    /// did not check it (only the reader can vouch for those), and every
    /// chunk of the manifest loaded for it by then.
    pub fn may_ack_after(&self, claim: &Receipt, manifest: &Manifest, chunks: &[u32]) -> Result<(), ProtocolError> {
        if claim.kind != ReceiptKind::Claim {
            let m = "a read of a cache publication is not acknowledged: load without ack, then end the read";
            return Err(Refusal::new(RefusalCode::WrongReceipt, "ack", m).into());
        }
        let (served, unchecked) = self.lock_served_for(claim);
        let vouched: Vec<u32> = unchecked.into_iter().filter(|c| !chunks.contains(c)).collect();
        if !vouched.is_empty() {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "ack",
                format!(
                    "publication {}: chunks {vouched:?} were loaded where the daemon did not check them (a buffer registered unchecked, a DMA-BUF it cannot map, or read by the reader itself): only the reader can vouch for them — load without ack, then ack with its digest",
                    claim.publication
                ),
            )
            .into());
        }
        let left: Vec<u32> =
            (0..manifest.chunks.len() as u32).filter(|c| !served.contains_key(c) && !chunks.contains(c)).collect();
        if !left.is_empty() {
            return Err(Refusal::new(
                RefusalCode::NotLoaded,
                "ack",
                format!(
                    "publication {}: chunks {left:?} would be left unloaded; a load acknowledges its claim only as the last of its loads (ask for ack on the load that completes the claim)",
                    claim.publication
                ),
            )
            .into());
        }
        Ok(())
    }

    /// Acknowledges `claim` after its last load: every chunk served for it
    /// must have been checked by the daemon and be as stored (else refused,
    /// and nothing is recorded: the reader fails the claim), then the ack is
    /// taken with the digest of what was served, as [`Service::ack`] checks
    /// it. Inside a [`Store::with_one_commit`] scope its record shares that
    /// commit.
    pub fn ack_loaded(&self, who: &Caller, claim: &Receipt, manifest: &Manifest) -> Result<(), ProtocolError> {
        let (served, unchecked) = self.lock_served_for(claim);
        if let Some(index) = unchecked.first() {
            return Err(Refusal::new(
                RefusalCode::WrongState,
                "ack",
                format!(
                    "publication {}: chunk {index} was loaded where the daemon did not check it; nothing was acknowledged: ack with the reader's digest instead",
                    claim.publication
                ),
            )
            .into());
        }
        for (&index, &crc) in &served {
            let stored = manifest.chunks.get(index as usize).map(|c| c.crc32c);
            if stored != Some(crc) {
                return Err(Refusal::new(
                    RefusalCode::RestoreMismatch,
                    "chunks",
                    format!(
                        "publication {}: chunk {index} was read as crc32c {crc:#010x}, stored {}; nothing was acknowledged: fail the claim (its bytes are kept) or load again",
                        claim.publication,
                        stored.map_or("no such chunk".into(), |s| format!("{s:#010x}")),
                    ),
                )
                .into());
            }
        }
        let crcs: Vec<u32> = served.values().copied().collect();
        let digest = restore_digest(&self.signer.restore_nonce(&claim.signature), &crcs);
        self.ack(who, claim, &digest)
    }

    /// The chunks served so far for `claim`, and those among them the
    /// daemon did not check (none if it is another claim's record, or none
    /// was).
    fn lock_served_for(&self, claim: &Receipt) -> (BTreeMap<u32, u32>, BTreeSet<u32>) {
        self.served
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&claim.publication)
            .filter(|(sig, _, _)| *sig == claim.signature)
            .map(|(_, c, u)| (c.clone(), u.clone()))
            .unwrap_or_default()
    }
}
