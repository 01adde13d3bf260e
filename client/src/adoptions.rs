//! What a reader that takes the steps one at a time (`adopt` or `read`,
//! `load`, a staged chunk's copy out, `ack` or `read/end`) holds of each
//! publication it adopted: the manifest, each chunk's crc32c as checked, and
//! the chunks loaded into staging that are still to be copied out. The
//! restore digest an ack takes comes from here, and only once every chunk
//! is loaded and checked, none left staged. The Python binding's `Reader`
//! keeps one; the batch path ([`crate::many`]) needs none.

use std::collections::{BTreeMap, HashMap};

use crate::ClientError;
use crate::layout::Manifest;
use crate::many::staged::StagedChunk;
use crate::receipt::{Receipt, restore_digest};

/// What a reader verified of one adopted claim (or read).
struct Adopted {
    manifest: Manifest,
    /// Chunk index → crc32c of the bytes this process received, checked
    /// against the manifest.
    verified: BTreeMap<u32, u32>,
    /// Chunks loaded into a staging buffer, to check as they are copied out.
    staged: BTreeMap<u32, StagedChunk>,
}

/// A misuse of the steps, refused before anything is asked of the daemon:
/// what the caller must do first.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Misuse(String);

/// Every publication a reader adopted or reads, by its receipt's signature.
#[derive(Default)]
pub struct Adoptions {
    by_signature: HashMap<String, Adopted>,
}

impl Adoptions {
    /// `receipt` (a claim or a read) adopted with `manifest`: nothing of it
    /// loaded yet.
    pub fn adopt(&mut self, receipt: &Receipt, manifest: Manifest) {
        let adopted = Adopted { manifest, verified: BTreeMap::new(), staged: BTreeMap::new() };
        self.by_signature.insert(receipt.signature.clone(), adopted);
    }

    /// The manifest `receipt` was adopted with, if it was (by this reader).
    pub fn manifest(&self, receipt: &Receipt) -> Option<&Manifest> {
        self.by_signature.get(&receipt.signature).map(|a| &a.manifest)
    }

    /// Chunks of `receipt` loaded: `verified` (index, crc32c as checked) and
    /// `staged` (to check as they are copied out). A chunk loaded again is
    /// what its last load made it.
    pub fn loaded(&mut self, receipt: &Receipt, verified: Vec<(u32, u32)>, staged: Vec<(u32, StagedChunk)>) {
        let Some(a) = self.by_signature.get_mut(&receipt.signature) else { return };
        for (index, crc) in verified {
            a.staged.remove(&index);
            a.verified.insert(index, crc);
        }
        for (index, chunk) in staged {
            a.verified.remove(&index);
            a.staged.insert(index, chunk);
        }
    }

    /// Chunk `index` of `receipt`, loaded into staging and not yet copied out.
    pub fn staged(&self, receipt: &Receipt, index: u32) -> Result<&StagedChunk, Misuse> {
        let a = self
            .by_signature
            .get(&receipt.signature)
            .ok_or_else(|| Misuse("scatter: this claim is not adopted by this reader".into()))?;
        a.staged.get(&index).ok_or_else(|| {
            Misuse(format!(
                "scatter: chunk {index} was not loaded into a staging buffer (or was copied out already): load() \
                 it into a Buffer(..., staging=True) first"
            ))
        })
    }

    /// Chunk `index` of `receipt` copied out of staging: checked (its
    /// crc32c), or found not to match its manifest (never restored: it must
    /// be loaded again). Any other failure leaves it staged, for another try.
    pub fn copied_out(&mut self, receipt: &Receipt, index: u32, copied: &Result<u32, ClientError>) {
        let Some(a) = self.by_signature.get_mut(&receipt.signature) else { return };
        match copied {
            Ok(crc) => {
                a.staged.remove(&index);
                a.verified.insert(index, *crc);
            }
            Err(ClientError::Verify { .. }) => {
                a.staged.remove(&index);
            }
            Err(_) => {}
        }
    }

    /// The restore digest of `receipt` for `step` (`ack`, `end_read`):
    /// every chunk loaded and checked here, none left staged.
    pub fn restore_digest(&self, step: &str, receipt: &Receipt) -> Result<String, Misuse> {
        let a = self
            .by_signature
            .get(&receipt.signature)
            .ok_or_else(|| Misuse(format!("{step}: this receipt is not adopted or read by this reader")))?;
        if !a.staged.is_empty() {
            let staged: Vec<u32> = a.staged.keys().copied().collect();
            return Err(Misuse(format!(
                "{step}: chunks {staged:?} were loaded into a staging buffer and not copied out: scatter() them \
                 (each is checked as it is copied)"
            )));
        }
        let missing: Vec<u32> =
            a.manifest.chunks.iter().map(|c| c.index).filter(|i| !a.verified.contains_key(i)).collect();
        if !missing.is_empty() {
            return Err(Misuse(format!("{step}: chunks {missing:?} were not loaded and verified: load() them first")));
        }
        let crcs: Vec<u32> = a.verified.values().copied().collect();
        Ok(restore_digest(a.manifest.restore_nonce.as_deref().unwrap_or_default(), &crcs))
    }

    /// Forgets `receipt` (acknowledged, ended, failed or abandoned); its
    /// manifest, if it was adopted.
    pub fn forget(&mut self, receipt: &Receipt) -> Option<Manifest> {
        self.by_signature.remove(&receipt.signature).map(|a| a.manifest)
    }
}
