//! The causal timeline (DESIGN §8): every node — the daemon, each writer and
//! reader, the model oracle — appends one JSON line per step to a file it is
//! given (`--timeline PATH`, opened `O_APPEND`, so several processes can share
//! it and the file's line order is the order the steps happened). Each node
//! writes a step's line before it lets anyone act on the step (the daemon
//! before it answers), so a later line never describes a cause of an earlier
//! one. This is the timeline's vocabulary and its writer, shared by the daemon
//! and its clients; `pdstor_proof::timeline` checks, merges, mutates and draws it.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// One line of a timeline. The DESIGN §8 fields are always present (null
/// where they do not apply); the rest appear where they mean something.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Per node, from 1.
    pub seq: u64,
    /// `CLOCK_MONOTONIC`, comparable between processes on one host.
    pub ts_ns: u64,
    /// The process that wrote the line (`daemon-e3`, `writer-123`, …).
    pub node: String,
    /// The step (`prepare`, `store`, `publish`, `claim`, …).
    pub event: String,
    /// The request, where the step has one.
    pub req_id: Option<String>,
    /// The publication, where the step has one.
    pub publication: Option<u64>,
    /// The chunk (payload transfers).
    pub chunk: Option<u32>,
    /// The payload path (payload transfers).
    pub path: Option<String>,
    /// Bytes moved (payload transfers).
    pub bytes: Option<u64>,
    /// The probes' verdict (payload transfers).
    pub verdict: Option<String>,
    /// The receipt this step produced or used: its signature (hex).
    pub receipt: Option<String>,
    /// The `seq` (on this node) of the step this one follows from: by
    /// default this node's previous line about the same publication.
    pub parent: Option<u64>,
    /// How long the step took (payload transfers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur_ns: Option<u64>,
    /// Chunks in the publication (publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<u32>,
    /// The producer token (decode_start) or a stop token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<u32>,
    /// A continuation's tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    /// SHA-256 of a continuation's tokens (hex), to compare across nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// What failed or was refused, or which control a step belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// A chunk's crc32c: as stored (store), as read into the reader's buffer
    /// (load, where the daemon can read that memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<u32>,
    /// Who checked a chunk's crc32c, and where (load, loaded): `daemon, in
    /// place in the reader's buffer, on the CPU (vpclmulqdq-512)`, or that
    /// the daemon could not and the reader checks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked: Option<String>,
    /// Every chunk's crc32c in chunk order (the daemon's publish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crcs: Option<Vec<u32>>,
    /// The claimed reader and its session (claim, adopt, load, ack, and the
    /// reader's own decode lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reader: Option<String>,
    /// The claim's session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The claim's restore nonce (adopt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
    /// The boot whose `CLOCK_MONOTONIC` `ts_ns` was read on (the kernel's
    /// `boot_id`): times of lines from different boots — another host, or
    /// this one after a reboot — are never compared, only their causal order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// Who asked for the step, as the daemon proved it (`uid:1000 (tenant a, writer)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

impl Event {
    /// A line for step `event`; the node, sequence and time are filled in when emitted.
    pub fn new(event: &str) -> Event {
        Event { event: event.into(), ..Default::default() }
    }
    /// With the request id.
    pub fn req(mut self, req_id: &str) -> Self {
        self.req_id = Some(req_id.into());
        self
    }
    /// With the publication.
    pub fn publication(mut self, p: u64) -> Self {
        self.publication = Some(p);
        self
    }
    /// With the chunk.
    pub fn chunk(mut self, c: u32) -> Self {
        self.chunk = Some(c);
        self
    }
    /// With a claim receipt: its request, publication, signature, reader and session.
    pub fn claim(mut self, r: &crate::receipt::Receipt) -> Self {
        self.req_id = Some(r.req_id.clone());
        self.publication = Some(r.publication);
        self.receipt = Some(r.signature.clone());
        self.reader = r.reader.clone();
        self.session = r.session.clone();
        self
    }
    /// With the receipt's signature.
    pub fn receipt(mut self, signature: &str) -> Self {
        self.receipt = Some(signature.into());
        self
    }
    /// With what failed, or which control the step belongs to.
    pub fn detail(mut self, d: impl Into<String>) -> Self {
        self.detail = Some(d.into());
        self
    }
    /// With who asked for the step.
    pub fn by(mut self, who: impl Into<String>) -> Self {
        self.by = Some(who.into());
        self
    }
}

/// The SHA-256 (hex) of a token sequence, as continuation records carry it.
pub fn tokens_digest(tokens: &[u32]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(h.finalize())
}

fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One node's writer of timeline lines.
pub struct Timeline {
    node: String,
    boot: Option<String>,
    out: Mutex<Out>,
}

struct Out {
    file: File,
    seq: u64,
    /// Publication → this node's last line about it (the next one's parent).
    last: std::collections::HashMap<u64, u64>,
}

impl Timeline {
    /// Appends to `path` (created 0600 if missing, narrowed to 0600 if ours) as `node`.
    pub fn open(path: &Path, node: &str) -> std::io::Result<Timeline> {
        // 0600: a timeline holds receipt signatures, request ids and tenants.
        let f = crate::private::open(path, true).map_err(|e| {
            std::io::Error::new(e.kind(), format!("opening timeline {} for appending: {e}", path.display()))
        })?;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|b| b.trim().to_owned());
        Ok(Timeline { node: node.into(), boot, out: Mutex::new(Out { file: f, seq: 0, last: Default::default() }) })
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Stamps `e` with this node, the next `seq`, the time and (unless set)
    /// its parent, and appends it as one line in one write. Returns its `seq`.
    /// A timeline that cannot be written is reported, not fatal: the step it
    /// describes has already happened.
    pub fn emit(&self, mut e: Event) -> u64 {
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        g.seq += 1;
        e.seq = g.seq;
        e.ts_ns = monotonic_ns();
        e.node = self.node.clone();
        e.boot.clone_from(&self.boot);
        if let Some(p) = e.publication {
            let prev = g.last.insert(p, e.seq);
            if e.parent.is_none() {
                e.parent = prev;
            }
        }
        match serde_json::to_vec(&e) {
            Ok(mut line) => {
                line.push(b'\n');
                if let Err(err) = g.file.write_all(&line) {
                    tracing::warn!("timeline: writing {} failed: {err}", e.event);
                }
            }
            Err(err) => tracing::warn!("timeline: encoding {} failed: {err}", e.event),
        }
        g.seq
    }
}

/// Emits on an optional timeline.
pub fn emit(t: &Option<std::sync::Arc<Timeline>>, e: Event) -> Option<u64> {
    t.as_ref().map(|t| t.emit(e))
}

/// A timeline as read: each line's number (from 1) and its event, or why it is not one.
pub type Lines = Vec<(usize, Result<Event, String>)>;

/// Reads a timeline: each line's number (from 1) and event, or the line's
/// parse error.
pub fn read(path: &Path) -> std::io::Result<Lines> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| std::io::Error::new(e.kind(), format!("reading timeline {}: {e}", path.display())))?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, serde_json::from_str::<Event>(l).map_err(|e| e.to_string())))
        .collect())
}
