//! `pdstor timeline check`: verifies a timeline without launching anything.
//!
//! A timeline is the evidence an operator signs off on, so the checker takes
//! nothing on trust: every rule below is enforced, and each violation names
//! its line. The daemon's own lines (node `daemon-…`, one per incarnation)
//! are authoritative for the protocol steps; a writer's or reader's line
//! about the same step is its echo, and must agree with the daemon's.
//! Refusals and failures (expected in fault controls) are not violations
//! themselves; what they leave is checked like everything else.
//!
//! | kind | rule | example violation → message |
//! |---|---|---|
//! | `malformed` | every line is a timeline event | `{"seq":` → `not a timeline event: EOF while parsing` |
//! | `out_of_order` | per node, `seq` increases, and a `parent` is an earlier line | `daemon-e1 seq 5 follows seq 7` |
//! | `clock` | per node, `ts_ns` never goes backwards | `daemon-e1 ts_ns 900 is before its previous line's 1000` |
//! | `causality` | prepare → store → publish → claim → adopt → load → decode start → continuation → ack, by time as well as by line: a transfer starts (`ts − dur`) after the step that caused it, and a load ends after its chunk's store completed — times compared only between lines of one boot (`boot`: the kernel's boot_id; another host's clock, or this one's after a reboot, is ordered by causality alone) | `publication 7: chunk 1 loaded (ended at 880) before its store completed (at 900)` |
//! | `missing_publish` | one authoritative publish per publication, from the daemon, before any echo of it or any claim | `publication 7: writer-1 echoes a publish the daemon never recorded` |
//! | `publish_incomplete` | the daemon's publish carries the chunk count and every chunk's crc32c | `publication 7: the daemon's publish carries no chunk crc32c list` |
//! | `publish_mismatch` | the publish declares exactly the chunks stored, with their stored crc32c | `publication 7: publish declares 1 chunks but chunk 1 was stored` |
//! | `duplicate_publish` | one authoritative publish | `publication 7: second publish by daemon-e1 (first at line 5)` |
//! | `missing_store` | every declared chunk was stored before the publish | `publication 7 published with chunks [1] never stored` |
//! | `duplicate_store` / `store_conflict` | every chunk is stored exactly once (a second store with another crc32c is a conflict) | `publication 7: chunk 0 stored again with crc32c 0x2, first 0x1 at line 3` |
//! | `wrong_path` / `not_native` | every store and load on the required path, judged `native` | `publication 7 chunk 0 store on host, required host_fixed` |
//! | `unknown_chunk` | loads (and `loaded` reports of chunks a reader read itself from the shared namespace) only of chunks in the published manifest | `publication 7: chunk 2 loaded, the manifest has chunks 0..2` |
//! | `load_mismatch` | a load's crc32c (as the daemon read it) is the chunk's stored one | `publication 7: chunk 0 loaded with crc32c 0x9, stored 0x1` |
//! | `duplicate_claim` | exactly one claim | `publication 7: second claim (first at line 7)` |
//! | `reader_mismatch` | adopt, load, decode and ack come from the claimed reader and session | `publication 7: adopt by reader decode-1 session s, the claim is decode-0 session s` |
//! | `receipt_mismatch` | every node names the same READY and claim receipt | `publication 7: publish by writer names a READY receipt other than the one at line 5` |
//! | `token_mismatch` | `decode_start.token` is the published producer token | `publication 7: decode starts from token 8, the publication's is 9` |
//! | `missing_continuation` | a decoding reader records its continuation before the ack | `publication 7 (r1) was acknowledged with no continuation record` |
//! | `continuation` / `continuation_mismatch` | a continuation's digest is its tokens', the same for every record of a request | `r1: continuation by reader differs from the record at line 1` |
//! | `ack_without_load` | the ack acknowledges chunks loaded for this claim through the data plane | `publication 7: acknowledged with chunks [0, 1] never loaded for this claim` |
//! | `restore_mismatch` | the ack's digest is SHA-256 of the adopt's nonce and the loaded chunks' crc32c | `publication 7: the ack's restore digest is not that of the claim's nonce and the loaded chunks` |
//! | `duplicate_ack` | exactly one ack, across daemon restarts | `publication 7: second ack by daemon-e2 (first at line 13)` |
//! | `foreign_ack` | a reader's ack echo comes from the node that decoded or restored | `publication 7: ack by reader-9, which never decoded or restored it` |
//! | `unrecorded_step` | a client's echo of publish, claim or ack follows the daemon's line for it | `publication 7: reader echoes an ack the daemon never recorded` |
//! | `after_end` | nothing about a publication after its ack, release, abort, reclaim or rolled-back store (refusals, and a writer's echo of the publish the daemon recorded before, aside) | `publication 7: load after its ack (line 13)` |
//! | `read_class` | a publication is claimed (a handoff) or read (a cache), never both | `publication 8: read of a publication claimed at line 7 (a handoff, for one reader)` |
//! | `read_ended` | a load or end under a read comes between its `read` and its end | `publication 8: load under a read that ended at line 12 (begun at line 9)` |
//! | `read_without_load` | a read ends done only after every chunk was loaded for it, its digest that of its nonce and those chunks (`restore_mismatch`) | `publication 8: the read begun at line 9 ended done with chunks [1] never loaded for it` |
//! | `release_while_read` | no release, eviction or expiry while a read of the publication is open | `publication 8: release while the reads begun at lines [9] are open` |
//! | `anonymous_refusal` | a refusal names the publication or request it refused | `a refusal that names no publication or request` |

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use super::{Event, tokens_digest};
use pdstor_engine::io::PayloadPath;

mod reads;
mod steps;
use steps::{load, payload, publish, reader_step, same_receipt, store};

/// One thing the timeline gets wrong, with its line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The line (1-based).
    pub line: usize,
    /// What kind (`causality`, `wrong_path`, `not_native`, `duplicate_ack`, …).
    pub kind: &'static str,
    /// What exactly.
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}: {}", self.line, self.kind, self.message)
    }
}

/// What `pdstor timeline check` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    /// Lines read.
    pub lines: usize,
    /// Publications seen.
    pub publications: usize,
    /// Publications acknowledged.
    pub acked: usize,
    /// Chunk stores and loads.
    pub payload_events: usize,
    /// Requests with continuation records.
    pub continuations: usize,
    /// Every violation, by line.
    pub violations: Vec<Violation>,
}

impl CheckReport {
    /// No violations.
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Whether a line is the daemon's own (authoritative for protocol steps).
pub fn is_daemon(node: &str) -> bool {
    node.starts_with("daemon")
}

/// A chunk as the daemon stored it.
#[derive(Clone)]
struct Stored {
    crc: Option<u32>,
    ts: u64,
    boot: Option<String>,
    line: usize,
}

/// The daemon's publish.
struct Publish {
    line: usize,
    chunks: u32,
    crcs: Option<Vec<u32>>,
    token: Option<u32>,
}

/// The daemon's adopt.
struct Adopt {
    ts: u64,
    boot: Option<String>,
    nonce: Option<String>,
}

/// Whether two lines' times can be compared: read on one boot's
/// `CLOCK_MONOTONIC` (lines from before boots were recorded count as one).
fn same_clock(a: &Option<String>, b: &Option<String>) -> bool {
    a == b
}

/// The daemon's claim.
struct Claim {
    line: usize,
    reader: Option<String>,
    session: Option<String>,
}

#[derive(Default)]
struct Pub {
    req_id: Option<String>,
    /// The prepare's time and the boot its clock belongs to.
    prepared: Option<(u64, Option<String>)>,
    stored: BTreeMap<u32, Stored>,
    publish: Option<Publish>,
    ready_receipt: Option<(String, usize)>,
    claim_receipt: Option<(String, usize)>,
    claim: Option<Claim>,
    /// The daemon's adopt: line, time, restore nonce.
    adopt: Option<Adopt>,
    /// Chunks loaded since the adopt or the last decode start.
    loaded: BTreeSet<u32>,
    /// Every chunk the daemon loaded for the claim since the adopt, with the
    /// crc32c it read (if it could).
    served: BTreeMap<u32, Option<u32>>,
    /// Reader nodes that decoded (or, without a model, restored) it.
    decoders: BTreeSet<String>,
    decoded: bool,
    restored: bool,
    continued: bool,
    /// The daemon's ack line.
    ack: Option<usize>,
    /// The step that ended it, and its line.
    ended: Option<(String, usize)>,
    /// Reads of it (a cache publication), by receipt.
    reads: BTreeMap<String, reads::Read>,
}

/// Where violations go.
struct Sink<'a>(&'a mut Vec<Violation>);

impl Sink<'_> {
    fn add(&mut self, line: usize, kind: &'static str, message: String) {
        self.0.push(Violation { line, kind, message });
    }
}

/// The checker's memory as it reads the file.
struct Checker {
    path: PayloadPath,
    report: CheckReport,
    pubs: BTreeMap<u64, Pub>,
    /// node → (seq, ts_ns) of its last line.
    last: HashMap<String, (u64, u64)>,
    /// req_id → (digest, line) of the first continuation or oracle record.
    digests: HashMap<String, (String, usize)>,
}

/// Checks `lines` (line number, parsed event) requiring `path` for payload.
pub fn check(lines: &[(usize, Result<Event, String>)], path: PayloadPath) -> CheckReport {
    let mut c = Checker {
        path,
        report: CheckReport { lines: lines.len(), ..Default::default() },
        pubs: BTreeMap::new(),
        last: HashMap::new(),
        digests: HashMap::new(),
    };
    for (line, parsed) in lines {
        match parsed {
            Ok(e) => c.event(*line, e),
            Err(err) => Sink(&mut c.report.violations).add(*line, "malformed", format!("not a timeline event: {err}")),
        }
    }
    c.finish()
}

/// Events that end a publication when the daemon records them.
const ENDS: [&str; 7] = ["ack", "release", "evict", "expire", "abort", "reclaim", "store_failed"];

impl Checker {
    fn event(&mut self, line: usize, e: &Event) {
        self.order(line, e);
        if e.event == "refused" {
            if e.publication.is_none() && e.req_id.is_none() {
                Sink(&mut self.report.violations).add(
                    line,
                    "anonymous_refusal",
                    format!("{}: a refusal that names no publication or request", e.node),
                );
            }
            return;
        }
        if matches!(e.event.as_str(), "continuation" | "oracle") && (!self.continuation(line, e) || e.event == "oracle")
        {
            return;
        }
        let Some(id) = e.publication else { return };
        let p = self.pubs.entry(id).or_default();
        if p.req_id.is_none() {
            p.req_id = e.req_id.clone();
        }
        let who = format!("publication {id}");
        let mut v = Sink(&mut self.report.violations);
        let daemon = is_daemon(&e.node);
        if let Some((step, at)) = &p.ended {
            // A client's echo of the ending step follows it; a second ack is
            // its own violation (duplicate_ack), reported below.
            let echo = !daemon && e.event == *step;
            let again = daemon && e.event == "ack" && p.ack.is_some();
            // A writer echoes its publish when the daemon's answer reaches
            // it; a reader that saw the READY may have claimed, restored and
            // acknowledged by then. The echo is of a step the daemon recorded
            // before the end, and is checked below as any echo is.
            let late_publish = !daemon && e.event == "publish" && p.publish.is_some();
            if !echo && !again && !late_publish {
                let m = format!("{who}: {} by {} after its {step} (line {at})", e.event, e.node);
                v.add(line, "after_end", m);
                return;
            }
        }
        match e.event.as_str() {
            "prepare" => p.prepared = Some((e.ts_ns, e.boot.clone())),
            "store" => {
                self.report.payload_events += 1;
                payload(&mut v, self.path, line, &who, e);
                store(&mut v, line, &who, p, e);
            }
            _ if daemon && reads::is_read(p, e) => {
                if e.event == "load" {
                    self.report.payload_events += 1;
                    payload(&mut v, self.path, line, &who, e);
                }
                reads::step(&mut v, line, &who, p, e);
            }
            "load" => {
                self.report.payload_events += 1;
                payload(&mut v, self.path, line, &who, e);
                load(&mut v, line, &who, p, e);
            }
            "publish" if daemon => publish(&mut v, line, &who, p, e),
            "publish" => {
                if p.publish.is_none() {
                    let m = format!("{who}: {} echoes a publish the daemon never recorded", e.node);
                    v.add(line, "missing_publish", m);
                }
                same_receipt(&mut v, line, &who, "READY", &mut p.ready_receipt, e);
            }
            _ => reader_step(&mut v, line, &who, p, e, daemon),
        }
        if daemon && ENDS.contains(&e.event.as_str()) {
            p.ended = Some((e.event.clone(), line));
        }
    }

    /// Lines of one node in order and in time, and parents earlier than their children.
    fn order(&mut self, line: usize, e: &Event) {
        let mut v = Sink(&mut self.report.violations);
        if let Some((seq, ts)) = self.last.insert(e.node.clone(), (e.seq, e.ts_ns)) {
            if e.seq <= seq {
                let m = format!("{} seq {} follows seq {seq}: lines of one node out of order", e.node, e.seq);
                v.add(line, "out_of_order", m);
            }
            if e.ts_ns < ts {
                let m = format!(
                    "{} ts_ns {} is before its previous line's {ts}: its clock went backwards",
                    e.node, e.ts_ns
                );
                v.add(line, "clock", m);
            }
        }
        if e.parent.is_some_and(|p| p >= e.seq) {
            let m = format!("{} seq {} names parent {:?}, not an earlier line", e.node, e.seq, e.parent);
            v.add(line, "out_of_order", m);
        }
    }

    /// A continuation or oracle record: its digest is its tokens', and every
    /// record of a request carries the same. `false` if it cannot be read.
    fn continuation(&mut self, line: usize, e: &Event) -> bool {
        let mut v = Sink(&mut self.report.violations);
        let (Some(req), Some(tokens)) = (&e.req_id, &e.tokens) else {
            v.add(line, "continuation", format!("{} record without req_id or tokens", e.event));
            return false;
        };
        let d = tokens_digest(tokens);
        if e.digest.as_deref().is_some_and(|x| x != d) {
            v.add(line, "continuation", format!("{req}: digest {:?} is not the digest of its tokens", e.digest));
        }
        match self.digests.get(req) {
            Some((first, at)) if *first != d => v.add(
                line,
                "continuation_mismatch",
                format!("{req}: {} by {} differs from the record at line {at}", e.event, e.node),
            ),
            Some(_) => {}
            None => {
                self.digests.insert(req.clone(), (d, line));
            }
        }
        true
    }

    /// The totals.
    fn finish(mut self) -> CheckReport {
        let r = &mut self.report;
        r.publications = self.pubs.len();
        r.continuations = self.digests.len();
        r.acked = self.pubs.values().filter(|p| p.ack.is_some()).count();
        r.violations.sort_by_key(|x| x.line);
        self.report
    }
}

#[cfg(test)]
mod tests;
