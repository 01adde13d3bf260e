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
//! | `after_end` | nothing about a publication after its ack, release, abort, reclaim or rolled-back store (refusals aside) | `publication 7: load after its ack (line 13)` |
//! | `anonymous_refusal` | a refusal names the publication or request it refused | `a refusal that names no publication or request` |

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use super::{Event, tokens_digest};
use crate::io::PayloadPath;

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
const ENDS: [&str; 5] = ["ack", "release", "abort", "reclaim", "store_failed"];

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
            if !echo && !again {
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

/// A chunk stored or loaded: on the required path, native.
fn payload(v: &mut Sink, path: PayloadPath, line: usize, who: &str, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match e.path.as_deref() {
        Some(p) if p == path.as_str() => {}
        other => v.add(
            line,
            "wrong_path",
            format!("{who} chunk {chunk} {} on {}, required {path}", e.event, other.unwrap_or("no path")),
        ),
    }
    match e.verdict.as_deref() {
        Some("native") => {}
        other => v.add(
            line,
            "not_native",
            format!("{who} chunk {chunk} {}: verdict {}", e.event, other.unwrap_or("none recorded")),
        ),
    }
}

/// When a transfer started: its line's time less its duration.
fn started(e: &Event) -> u64 {
    e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0))
}

fn hex32(c: Option<u32>) -> String {
    c.map_or_else(|| "none".into(), |c| format!("{c:#010x}"))
}

/// A chunk stored: after the prepare, before the publish, once.
fn store(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match &p.prepared {
        None => v.add(line, "causality", format!("{who}: chunk {chunk} stored before prepare")),
        Some((t, boot)) if same_clock(boot, &e.boot) && started(e) < *t => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk}'s store started at {} before its prepare at {t}", started(e)),
        ),
        Some(_) => {}
    }
    if p.publish.is_some() {
        v.add(line, "causality", format!("{who}: chunk {chunk} stored after publish"));
    }
    match p.stored.get(&chunk) {
        Some(first) if first.crc != e.crc32c => v.add(
            line,
            "store_conflict",
            format!(
                "{who}: chunk {chunk} stored again with crc32c {}, first {} at line {}",
                hex32(e.crc32c),
                hex32(first.crc),
                first.line
            ),
        ),
        Some(first) => v.add(
            line,
            "duplicate_store",
            format!("{who}: chunk {chunk} stored a second time (first at line {})", first.line),
        ),
        None => {
            p.stored.insert(chunk, Stored { crc: e.crc32c, ts: e.ts_ns, boot: e.boot.clone(), line });
        }
    }
}

/// The daemon's publish: complete, the chunks exactly as stored, once.
fn publish(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    if let Some(first) = &p.publish {
        let m = format!("{who}: second publish by {} (first at line {})", e.node, first.line);
        v.add(line, "duplicate_publish", m);
        return;
    }
    let Some(n) = e.chunks else {
        v.add(line, "publish_incomplete", format!("{who}: the daemon's publish carries no chunk count"));
        p.publish = Some(Publish { line, chunks: 0, crcs: None, token: e.token });
        return;
    };
    match &e.crcs {
        None => v.add(line, "publish_incomplete", format!("{who}: the daemon's publish carries no chunk crc32c list")),
        Some(c) if c.len() != n as usize => {
            v.add(line, "publish_mismatch", format!("{who}: publish declares {n} chunks but lists {} crc32c", c.len()))
        }
        Some(_) => {}
    }
    if let Some(&beyond) = p.stored.keys().find(|&&c| c >= n) {
        v.add(line, "publish_mismatch", format!("{who}: publish declares {n} chunks but chunk {beyond} was stored"));
    }
    let missing: Vec<u32> = (0..n).filter(|c| !p.stored.contains_key(c)).collect();
    if !missing.is_empty() {
        v.add(line, "missing_store", format!("{who} published with chunks {missing:?} never stored"));
    }
    if let Some(crcs) = &e.crcs {
        for (i, crc) in crcs.iter().enumerate() {
            if let Some(s) = p.stored.get(&(i as u32))
                && s.crc.is_some_and(|c| c != *crc)
            {
                let m = format!(
                    "{who}: publish lists crc32c {crc:#010x} for chunk {i}, stored {} at line {}",
                    hex32(s.crc),
                    s.line
                );
                v.add(line, "publish_mismatch", m);
            }
        }
    }
    p.publish = Some(Publish { line, chunks: n, crcs: e.crcs.clone(), token: e.token });
    same_receipt(v, line, who, "READY", &mut p.ready_receipt, e);
}

/// A chunk loaded: of the manifest, after the adopt and the chunk's store,
/// by the claimed reader, with the stored bytes.
fn load(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match &p.adopt {
        None => v.add(line, "causality", format!("{who}: chunk {chunk} loaded before adopt")),
        Some(a) if same_clock(&a.boot, &e.boot) && started(e) < a.ts => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk}'s load started at {} before its adopt at {}", started(e), a.ts),
        ),
        Some(_) => {}
    }
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    if chunk >= n {
        v.add(line, "unknown_chunk", format!("{who}: chunk {chunk} loaded, the manifest has chunks 0..{n}"));
    }
    match p.stored.get(&chunk) {
        Some(s) if same_clock(&s.boot, &e.boot) && e.ts_ns < s.ts => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk} loaded (ended at {}) before its store completed (at {})", e.ts_ns, s.ts),
        ),
        Some(s) if e.crc32c.is_some() && s.crc.is_some() && e.crc32c != s.crc => v.add(
            line,
            "load_mismatch",
            format!("{who}: chunk {chunk} loaded with crc32c {}, stored {}", hex32(e.crc32c), hex32(s.crc)),
        ),
        Some(_) => {}
        None if chunk < n => v.add(line, "causality", format!("{who}: chunk {chunk} loaded, never stored")),
        None => {}
    }
    same_reader(v, line, who, p, e);
    p.loaded.insert(chunk);
    p.served.insert(chunk, e.crc32c);
}

/// A step names the claimed reader and session, where it names one.
fn same_reader(v: &mut Sink, line: usize, who: &str, p: &Pub, e: &Event) {
    let Some(c) = &p.claim else { return };
    let differs =
        |mine: &Option<String>, claimed: &Option<String>| mine.is_some() && claimed.is_some() && mine != claimed;
    if differs(&e.reader, &c.reader) || differs(&e.session, &c.session) {
        let m = format!(
            "{who}: {} by reader {} session {}, the claim (line {}) is {} session {}",
            e.event,
            e.reader.as_deref().unwrap_or("?"),
            e.session.as_deref().unwrap_or("?"),
            c.line,
            c.reader.as_deref().unwrap_or("?"),
            c.session.as_deref().unwrap_or("?"),
        );
        v.add(line, "reader_mismatch", m);
    }
}

/// The reader's steps: claim → adopt → decode start → continuation → ack.
fn reader_step(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event, daemon: bool) {
    match (e.event.as_str(), daemon) {
        ("claim", true) => {
            if p.publish.is_none() {
                v.add(line, "causality", format!("{who}: claim before publish"));
            }
            if let Some(first) = &p.claim {
                v.add(line, "duplicate_claim", format!("{who}: second claim (first at line {})", first.line));
                return;
            }
            p.claim = Some(Claim { line, reader: e.reader.clone(), session: e.session.clone() });
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("claim", false) => {
            if p.claim.is_none() {
                v.add(line, "unrecorded_step", format!("{who}: {} echoes a claim the daemon never recorded", e.node));
            }
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("adopt", true) => {
            if p.claim.is_none() {
                v.add(line, "causality", format!("{who}: adopt before claim"));
            }
            same_reader(v, line, who, p, e);
            p.adopt = Some(Adopt { ts: e.ts_ns, boot: e.boot.clone(), nonce: e.nonce.clone() });
            p.served.clear();
            p.loaded.clear();
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("decode_start", _) => {
            let n = p.publish.as_ref().map_or(0, |x| x.chunks);
            let missing: Vec<u32> = (0..n).filter(|c| !p.loaded.contains(c)).collect();
            if p.adopt.is_none() {
                v.add(line, "causality", format!("{who}: decode before adopt"));
            } else if !missing.is_empty() {
                v.add(line, "causality", format!("{who}: decode started with chunks {missing:?} not loaded"));
            }
            let published = p.publish.as_ref().and_then(|x| x.token);
            if e.token.is_some() && published.is_some() && e.token != published {
                let m = format!(
                    "{who}: decode starts from token {}, the publication's is {}",
                    e.token.map_or_else(|| "none".into(), |t| t.to_string()),
                    published.map_or_else(|| "none".into(), |t| t.to_string())
                );
                v.add(line, "token_mismatch", m);
            }
            same_reader(v, line, who, p, e);
            p.loaded.clear();
            p.decoded = true;
            // Each decode records its own continuation before the ack.
            p.continued = false;
            p.decoders.insert(e.node.clone());
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("restored", _) => {
            let n = p.publish.as_ref().map_or(0, |x| x.chunks);
            let missing: Vec<u32> = (0..n).filter(|c| !p.served.contains_key(c)).collect();
            if p.adopt.is_none() || !missing.is_empty() {
                v.add(line, "causality", format!("{who}: restored with chunks {missing:?} not loaded"));
            }
            p.restored = true;
            p.decoders.insert(e.node.clone());
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("continuation", _) => {
            if !p.decoded {
                v.add(line, "causality", format!("{who}: continuation before decode start"));
            }
            p.continued = true;
        }
        ("loaded", true) => {
            // A reader that read the chunk itself, from the shared namespace:
            // the daemon checked its crc32c; it counts as loaded.
            let chunk = e.chunk.unwrap_or(u32::MAX);
            if p.adopt.is_none() {
                v.add(line, "causality", format!("{who}: chunk {chunk} reported loaded before adopt"));
            }
            let n = p.publish.as_ref().map_or(0, |x| x.chunks);
            if chunk >= n {
                v.add(
                    line,
                    "unknown_chunk",
                    format!("{who}: chunk {chunk} reported loaded, the manifest has chunks 0..{n}"),
                );
            }
            if let Some(s) = p.stored.get(&chunk)
                && e.crc32c.is_some()
                && s.crc.is_some()
                && e.crc32c != s.crc
            {
                let m = format!(
                    "{who}: chunk {chunk} reported loaded with crc32c {}, stored {}",
                    hex32(e.crc32c),
                    hex32(s.crc)
                );
                v.add(line, "load_mismatch", m);
            }
            same_reader(v, line, who, p, e);
            p.loaded.insert(chunk);
            p.served.insert(chunk, e.crc32c);
        }
        ("ack", true) => daemon_ack(v, line, who, p, e),
        ("ack", false) => {
            if p.ack.is_none() {
                v.add(line, "unrecorded_step", format!("{who}: {} echoes an ack the daemon never recorded", e.node));
            }
            if !p.decoders.contains(&e.node) {
                v.add(line, "foreign_ack", format!("{who}: ack by {}, which never decoded or restored it", e.node));
            }
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("release", true) if p.claim.is_some() => {
            v.add(
                line,
                "causality",
                format!("{who}: released after its claim (line {:?})", p.claim.as_ref().map(|c| c.line)),
            );
        }
        _ => {}
    }
}

/// The daemon's ack: once, after the reader restored every chunk it loaded
/// for this claim, bound to the adopt's nonce.
fn daemon_ack(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    if let Some(first) = p.ack {
        v.add(line, "duplicate_ack", format!("{who}: second ack by {} (first at line {first})", e.node));
        return;
    }
    p.ack = Some(line);
    same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
    same_reader(v, line, who, p, e);
    let Some(Adopt { nonce, .. }) = &p.adopt else {
        v.add(line, "causality", format!("{who}: ack before adopt"));
        return;
    };
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    let unserved: Vec<u32> = (0..n).filter(|c| !p.served.contains_key(c)).collect();
    if !unserved.is_empty() {
        let m = format!("{who}: acknowledged with chunks {unserved:?} never loaded for this claim");
        v.add(line, "ack_without_load", m);
        return;
    }
    if !p.decoded && !p.restored {
        v.add(line, "causality", format!("{who}: ack before the reader decoded or restored it"));
    } else if p.decoded && !p.continued {
        let m = format!("{who} ({}) was acknowledged with no continuation record", p.req_id.as_deref().unwrap_or("?"));
        v.add(line, "missing_continuation", m);
    }
    // The chain: what was stored, as loaded, into the ack's digest.
    if let (Some(nonce), Some(digest)) = (nonce, &e.digest) {
        let published = p.publish.as_ref().and_then(|x| x.crcs.clone()).unwrap_or_default();
        let crcs: Vec<u32> = (0..n)
            .map(|c| {
                let served = p.served.get(&c).copied().flatten();
                let stored = p.stored.get(&c).and_then(|s| s.crc);
                served.or(stored).or_else(|| published.get(c as usize).copied()).unwrap_or(0)
            })
            .collect();
        if crate::protocol::service::restore_digest(nonce, &crcs) != *digest {
            let m = format!("{who}: the ack's restore digest is not that of the claim's nonce and the loaded chunks");
            v.add(line, "restore_mismatch", m);
        }
    }
}

/// Every node names the same `which` receipt for a publication.
fn same_receipt(v: &mut Sink, line: usize, who: &str, which: &str, first: &mut Option<(String, usize)>, e: &Event) {
    let Some(r) = &e.receipt else { return };
    match first {
        Some((seen, at)) if seen != r => v.add(
            line,
            "receipt_mismatch",
            format!("{who}: {} by {} names a {which} receipt other than the one at line {at}", e.event, e.node),
        ),
        Some(_) => {}
        None => *first = Some((r.clone(), line)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::mutate;

    fn lines(events: Vec<Event>) -> Vec<(usize, Result<Event, String>)> {
        events.into_iter().enumerate().map(|(i, e)| (i + 1, Ok(e))).collect()
    }

    fn only(events: Vec<Event>, kind: &str, line: usize) {
        let r = check(&lines(events), PayloadPath::HostFixed);
        assert_eq!(
            r.violations.iter().map(|v| (v.kind, v.line)).collect::<Vec<_>>(),
            vec![(kind, line)],
            "{:#?}",
            r.violations
        );
    }

    #[test]
    fn a_correct_handoff_passes() {
        let r = check(&lines(mutate::example()), PayloadPath::HostFixed);
        assert!(r.ok(), "{:#?}", r.violations);
        assert_eq!((r.publications, r.acked, r.payload_events, r.continuations), (1, 1, 4, 1));
    }

    #[test]
    fn a_missing_store_is_reported_at_the_publish() {
        let mut t = mutate::example();
        t.remove(3); // chunk 1 never stored; publish moves to line 4
        let t = mutate::renumbered(t);
        let r = check(&lines(t), PayloadPath::HostFixed);
        assert!(r.violations.iter().any(|v| v.kind == "missing_store" && v.line == 4), "{:#?}", r.violations);
    }

    #[test]
    fn a_wrong_path_and_a_fallback_verdict_are_reported_at_their_lines() {
        let mut t = mutate::example();
        t[2].path = Some("host".into());
        only(t, "wrong_path", 3);
        let mut t = mutate::example();
        t[8].verdict = Some("fallback(page-cache)".into());
        only(t, "not_native", 9);
        let r = check(&lines(mutate::example()), PayloadPath::DmabufFixed);
        assert_eq!(r.violations.iter().filter(|v| v.kind == "wrong_path").count(), 4, "default requirement differs");
    }

    #[test]
    fn refusals_must_name_what_they_refused_and_lines_must_parse() {
        let mut t = mutate::example();
        let mut refused = Event::new("refused").detail("bad_signature (signature): forged");
        refused.node = "daemon-e1".into();
        refused.seq = 100;
        refused.ts_ns = 100_000;
        t.push(refused);
        only(t, "anonymous_refusal", 15);
        let mut l = lines(mutate::example());
        l.insert(3, (99, Err("expected value".into())));
        let r = check(&l, PayloadPath::HostFixed);
        assert_eq!(r.violations.iter().map(|v| (v.kind, v.line)).collect::<Vec<_>>(), vec![("malformed", 99)]);
    }

    /// A reader on another host records its own loads on its own clock, which
    /// reads far earlier than the owner's: times of different boots are never
    /// compared, only causal order; on one boot the same lines are a lie.
    #[test]
    fn times_compare_only_within_one_boot() {
        let remote = |boot: &str| {
            let mut t = mutate::example();
            for e in t.iter_mut() {
                e.boot = Some("owner-boot".into());
            }
            for (i, at) in [(8, 10u64), (9, 20)] {
                t[i].node = "reader-host-1".into();
                t[i].seq = i as u64;
                t[i].ts_ns = at;
                t[i].dur_ns = Some(5);
                t[i].boot = Some(boot.into());
            }
            t
        };
        let r = check(&lines(remote("reader-boot")), PayloadPath::HostFixed);
        assert!(r.ok(), "{:#?}", r.violations);
        let r = check(&lines(remote("owner-boot")), PayloadPath::HostFixed);
        let mut at: Vec<usize> = r.violations.iter().filter(|v| v.kind == "causality").map(|v| v.line).collect();
        at.dedup();
        assert_eq!(at, [9, 10], "{:#?}", r.violations);
    }

    /// Every mutation the generator makes of the example is caught, at its
    /// line, by the rule it breaks.
    #[test]
    fn every_mutation_of_the_example_is_caught_where_it_was_made() {
        let mutants = mutate::mutants(&mutate::example());
        assert!(mutants.len() >= 20, "{} mutants", mutants.len());
        for m in &mutants {
            let r = check(&lines(m.events.clone()), PayloadPath::HostFixed);
            assert!(
                m.caught_by(&r).is_some(),
                "{}: expected {} near lines {:?}: {:#?}",
                m.name,
                m.expect,
                m.line,
                r.violations
            );
        }
    }
}
