//! Reading cache publications: the wire bodies of `read` and `read/end`, and
//! the client's calls. A cache publication (prepared with `cache: true`)
//! stays READY for every reader its tenant lets read. Each read is a lease of
//! its own: `read` begins it and answers the manifest with the read's restore
//! nonce (no claim, no adopt); the data plane loads it as it loads a claim;
//! `read/end` ends it, with the restore digest (checked as an ack's is) or
//! with a reason. While any read of it is held, a publication is neither
//! released nor evicted; nothing is journaled, so a read costs no flush.

use serde::{Deserialize, Serialize};

use crate::layout::{Layout, Manifest};
use crate::receipt::Receipt;
use crate::{Client, ClientError, Reader, Restored};

/// `POST /storage-pd/read`: begin a read of a READY cache publication, named
/// exactly once: by its READY receipt or by its `req_id` (both, or neither,
/// is refused `bad_request` before anything is looked at). A daemon from
/// before `req_id` requires the receipt.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "ReadRequestWire")]
pub struct ReadRequest {
    /// The READY receipt (`lookup` answers it); or, instead, `req_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<Receipt>,
    /// Instead of a receipt, the name the publication was prepared with: the
    /// daemon finds it READY as `lookup` would and reads it — a lookup and a
    /// read in one step. Refused `unknown_publication` where there is no
    /// READY publication of that name this caller may read (in a batch, a
    /// miss as `lookup`'s `null` is: not counted as an error, not on the
    /// timeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub req_id: Option<String>,
    /// The reader's identity.
    pub reader_id: String,
    /// The reader's session; closing it ends its reads.
    pub session_id: String,
    /// The layout this reader restores with: a publication stored with
    /// another is refused `layout_mismatch`, and nothing is begun.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<Layout>,
}

/// [`ReadRequest`] as it arrives, before the rule that it names its
/// publication exactly once is checked.
#[derive(Deserialize)]
struct ReadRequestWire {
    #[serde(default)]
    receipt: Option<Receipt>,
    #[serde(default)]
    req_id: Option<String>,
    reader_id: String,
    session_id: String,
    #[serde(default)]
    layout: Option<Layout>,
}

impl TryFrom<ReadRequestWire> for ReadRequest {
    type Error = String;
    fn try_from(w: ReadRequestWire) -> Result<Self, String> {
        match (&w.receipt, &w.req_id) {
            (Some(_), Some(name)) => {
                Err(format!("a read names its publication once: it gives both a receipt and req_id {name:?}; send one"))
            }
            (None, None) => {
                Err("a read names its publication: give its READY receipt (lookup answers it) or its req_id".to_owned())
            }
            _ => Ok(ReadRequest {
                receipt: w.receipt,
                req_id: w.req_id,
                reader_id: w.reader_id,
                session_id: w.session_id,
                layout: w.layout,
            }),
        }
    }
}

/// What `read` answers.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadAnswer {
    /// The read's receipt (kind `READ`): what its loads and its end name.
    pub receipt: Receipt,
    /// The manifest, with the read's restore nonce.
    pub manifest: Manifest,
}

/// `POST /storage-pd/read/end`: end a read. With `restore_digest` it is a
/// verified end: every chunk loaded for this read, the digest that of the
/// read's nonce and their crc32c (else refused, and the read goes on); with
/// `reason` alone, an abandoned one (a failed load, a reader giving up).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndReadRequest {
    /// The read's receipt.
    pub receipt: Receipt,
    /// SHA-256 over the read's nonce and the loaded chunks' crc32c, in chunk order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_digest: Option<String>,
    /// Why the read ends without a digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Client {
    /// `read`: begins a read of the READY cache publication `ready`; checks
    /// that the manifest answered is the one the receipt names.
    pub fn read(
        &self,
        ready: &Receipt,
        reader: &str,
        session: &str,
        layout: Option<&Layout>,
    ) -> Result<ReadAnswer, ClientError> {
        let r = ReadRequest {
            receipt: Some(ready.clone()),
            req_id: None,
            reader_id: reader.into(),
            session_id: session.into(),
            layout: layout.cloned(),
        };
        let answer: ReadAnswer = self.post("/storage-pd/read", &r)?;
        match crate::the_one_claimed(answer.manifest, &ready.manifest_digest) {
            Ok(manifest) => Ok(ReadAnswer { manifest, ..answer }),
            Err(e) => {
                // Not the manifest the receipt names: the read is given up, not left held.
                let _ = self.abandon_read(&answer.receipt, "the manifest answered is not the one the receipt names");
                Err(e)
            }
        }
    }

    /// `read/end` with the restore digest: the read is done.
    pub fn end_read(&self, read: &Receipt, restore: &str) -> Result<(), ClientError> {
        let r = EndReadRequest { receipt: read.clone(), restore_digest: Some(restore.into()), reason: None };
        self.post::<_, serde::de::IgnoredAny>("/storage-pd/read/end", &r).map(drop)
    }

    /// `read/end` without a digest: the read is abandoned, for `reason`.
    pub fn abandon_read(&self, read: &Receipt, reason: &str) -> Result<(), ClientError> {
        let r = EndReadRequest { receipt: read.clone(), restore_digest: None, reason: Some(reason.into()) };
        self.post::<_, serde::de::IgnoredAny>("/storage-pd/read/end", &r).map(drop)
    }
}

impl Reader {
    /// read → load every chunk into this reader's buffer → verify each
    /// crc32c → end the read with the restore digest. A load that fails
    /// abandons the read (the publication stays READY for the next reader)
    /// and is the error answered.
    pub fn get_cached(
        &mut self,
        ready: &Receipt,
        reader: &str,
        session: &str,
        layout: &Layout,
    ) -> Result<Restored, ClientError> {
        let ReadAnswer { receipt, manifest } = self.client.read(ready, reader, session, Some(layout))?;
        match self.load(&receipt, manifest) {
            Ok(restored) => {
                self.client.end_read(&receipt, &restored.restore_digest)?;
                Ok(restored)
            }
            Err(e) => {
                // The load's error is the answer; the read ends either way.
                let _ = self.client.abandon_read(&receipt, &format!("the load failed: {e}"));
                Err(e)
            }
        }
    }
}

/// How a read ends.
#[derive(Debug, Clone, Copy)]
pub enum End<'a> {
    /// Every chunk loaded and checked: the restore digest.
    Done(&'a str),
    /// Given up, for this reason.
    Abandoned(&'a str),
}
