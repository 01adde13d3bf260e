//! `pdstor timeline check`: verifies a timeline without launching anything.
//!
//! Causality per publication, in file order: prepare → every chunk stored →
//! publish → claim → adopt → every chunk loaded → decode start → continuation
//! → ack, with one ack. Provenance: every chunk store and load on the required
//! path with a `native` verdict. Receipts: every node that names a
//! publication's READY or claim receipt names the same one. Continuations:
//! every acknowledged publication has one, and every continuation and oracle
//! record of a request carries the same token digest. Refusals and failures
//! (expected in fault controls) are not violations themselves; what they leave
//! is checked like everything else.

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

#[derive(Default)]
struct Pub {
    chunks: Option<u32>,
    prepared: bool,
    stored: BTreeSet<u32>,
    published: bool,
    ready_receipt: Option<(String, usize)>,
    claim_receipt: Option<(String, usize)>,
    claimed: bool,
    adopted: bool,
    /// Chunks loaded since the adopt or the last decode start.
    loaded: BTreeSet<u32>,
    decoded: bool,
    continued: bool,
    acks: HashMap<String, usize>,
    req_id: Option<String>,
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
    last_seq: HashMap<String, u64>,
    /// req_id → (digest, line) of the first continuation or oracle record.
    digests: HashMap<String, (String, usize)>,
}

/// Checks `lines` (line number, parsed event) requiring `path` for payload.
pub fn check(lines: &[(usize, Result<Event, String>)], path: PayloadPath) -> CheckReport {
    let mut c = Checker {
        path,
        report: CheckReport { lines: lines.len(), ..Default::default() },
        pubs: BTreeMap::new(),
        last_seq: HashMap::new(),
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

impl Checker {
    fn event(&mut self, line: usize, e: &Event) {
        self.order(line, e);
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
        match e.event.as_str() {
            "prepare" => p.prepared = true,
            "store" | "load" => {
                self.report.payload_events += 1;
                payload(&mut v, self.path, line, &who, p, e);
            }
            "publish" => {
                if let Some(n) = e.chunks {
                    p.chunks = Some(n);
                }
                let n = p.chunks.unwrap_or(0);
                if !p.published {
                    let missing: Vec<u32> = (0..n).filter(|c| !p.stored.contains(c)).collect();
                    if !missing.is_empty() {
                        v.add(line, "missing_store", format!("{who} published with chunks {missing:?} never stored"));
                    }
                }
                p.published = true;
                same_receipt(&mut v, line, &who, "READY", &mut p.ready_receipt, e);
            }
            _ => reader_step(&mut v, line, &who, p, e),
        }
    }

    /// Lines of one node in order, and parents earlier than their children.
    fn order(&mut self, line: usize, e: &Event) {
        let mut v = Sink(&mut self.report.violations);
        if let Some(prev) = self.last_seq.insert(e.node.clone(), e.seq)
            && e.seq <= prev
        {
            let m = format!("{} seq {} follows seq {prev}: lines of one node out of order", e.node, e.seq);
            v.add(line, "out_of_order", m);
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

    /// The totals, and every acknowledged publication's continuation.
    fn finish(mut self) -> CheckReport {
        let r = &mut self.report;
        r.publications = self.pubs.len();
        r.continuations = self.digests.len();
        for (id, p) in &self.pubs {
            if let Some((_, line)) = p.acks.iter().min_by_key(|(_, l)| **l) {
                r.acked += 1;
                if !p.continued {
                    r.violations.push(Violation {
                        line: *line,
                        kind: "missing_continuation",
                        message: format!(
                            "publication {id} ({}) was acknowledged with no continuation record",
                            p.req_id.as_deref().unwrap_or("?")
                        ),
                    });
                }
            }
        }
        r.violations.sort_by_key(|x| x.line);
        self.report
    }
}

/// A chunk stored or loaded: on the required path, native, in causal order.
fn payload(v: &mut Sink, path: PayloadPath, line: usize, who: &str, p: &mut Pub, e: &Event) {
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
    if e.event == "store" {
        if !p.prepared {
            v.add(line, "causality", format!("{who}: chunk {chunk} stored before prepare"));
        }
        if p.published {
            v.add(line, "causality", format!("{who}: chunk {chunk} stored after publish"));
        }
        p.stored.insert(chunk);
    } else {
        if !p.adopted {
            v.add(line, "causality", format!("{who}: chunk {chunk} loaded before adopt"));
        }
        p.loaded.insert(chunk);
    }
}

/// The reader's steps: claim → adopt → decode start → continuation → ack.
fn reader_step(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    match e.event.as_str() {
        "claim" => {
            if !p.published {
                v.add(line, "causality", format!("{who}: claim before publish"));
            }
            p.claimed = true;
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        "adopt" => {
            if !p.claimed {
                v.add(line, "causality", format!("{who}: adopt before claim"));
            }
            p.adopted = true;
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        "decode_start" => {
            let n = p.chunks.unwrap_or(0);
            let missing: Vec<u32> = (0..n).filter(|c| !p.loaded.contains(c)).collect();
            if !p.adopted {
                v.add(line, "causality", format!("{who}: decode before adopt"));
            } else if !missing.is_empty() {
                v.add(line, "causality", format!("{who}: decode started with chunks {missing:?} not loaded"));
            }
            p.loaded.clear();
            p.decoded = true;
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        "continuation" => {
            if !p.decoded {
                v.add(line, "causality", format!("{who}: continuation before decode start"));
            }
            p.continued = true;
        }
        "ack" => {
            if !p.decoded {
                v.add(line, "causality", format!("{who}: ack before any decode"));
            }
            if let Some(first) = p.acks.insert(e.node.clone(), line) {
                v.add(line, "duplicate_ack", format!("{who}: second ack by {} (first at line {first})", e.node));
            }
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        _ => {}
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

    /// A correct two-chunk handoff, as the nodes would write it.
    fn good() -> Vec<Event> {
        let ev = |node: &str, seq: u64, event: &str| Event {
            node: node.into(),
            seq,
            event: event.into(),
            req_id: Some("r1".into()),
            publication: Some(7),
            ..Default::default()
        };
        let payload = |mut e: Event, chunk: u32| {
            e.chunk = Some(chunk);
            e.path = Some("host_fixed".into());
            e.verdict = Some("native".into());
            e.bytes = Some(4096);
            e
        };
        let with_receipt = |mut e: Event, r: &str| {
            e.receipt = Some(r.into());
            e
        };
        let tokens = vec![5, 6, 7];
        let cont = |node: &str, seq: u64, event: &str| Event {
            tokens: Some(tokens.clone()),
            digest: Some(tokens_digest(&tokens)),
            ..ev(node, seq, event)
        };
        let mut publish = with_receipt(ev("daemon", 4, "publish"), "R");
        publish.chunks = Some(2);
        vec![
            cont("oracle", 1, "oracle"),
            ev("daemon", 1, "prepare"),
            payload(ev("daemon", 2, "store"), 0),
            payload(ev("daemon", 3, "store"), 1),
            publish,
            with_receipt(ev("writer", 1, "publish"), "R"),
            with_receipt(ev("daemon", 5, "claim"), "C"),
            with_receipt(ev("daemon", 6, "adopt"), "C"),
            payload(ev("daemon", 7, "load"), 0),
            payload(ev("daemon", 8, "load"), 1),
            with_receipt(ev("reader", 1, "decode_start"), "C"),
            cont("reader", 2, "continuation"),
            with_receipt(ev("daemon", 9, "ack"), "C"),
        ]
    }

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
        let r = check(&lines(good()), PayloadPath::HostFixed);
        assert!(r.ok(), "{:#?}", r.violations);
        assert_eq!((r.publications, r.acked, r.payload_events, r.continuations), (1, 1, 4, 1));
    }

    #[test]
    fn adopt_before_claim_is_reported_at_the_adopt() {
        let mut t = good();
        t.swap(6, 7); // adopt now on line 7, claim on line 8, in the daemon's own order
        (t[6].seq, t[7].seq) = (5, 6);
        only(t, "causality", 7);
    }

    #[test]
    fn a_missing_store_is_reported_at_the_publish() {
        let mut t = good();
        t.remove(3); // chunk 1 never stored; publish moves to line 4
        only(t, "missing_store", 4);
    }

    #[test]
    fn a_wrong_path_and_a_fallback_verdict_are_reported_at_their_lines() {
        let mut t = good();
        t[2].path = Some("host".into());
        only(t, "wrong_path", 3);
        let mut t = good();
        t[8].verdict = Some("fallback(page-cache)".into());
        only(t, "not_native", 9);
        let r = check(&lines(good()), PayloadPath::DmabufFixed);
        assert_eq!(r.violations.iter().filter(|v| v.kind == "wrong_path").count(), 4, "default requirement differs");
    }

    #[test]
    fn two_acks_are_reported_at_the_second() {
        let mut t = good();
        let mut again = t[12].clone();
        again.seq = 10;
        t.push(again);
        only(t, "duplicate_ack", 14);
    }

    #[test]
    fn a_mismatched_receipt_is_reported_where_it_appears() {
        let mut t = good();
        t[5].receipt = Some("FORGED".into());
        only(t, "receipt_mismatch", 6);
        let mut t = good();
        t[10].receipt = Some("OTHER-CLAIM".into());
        only(t, "receipt_mismatch", 11);
    }

    #[test]
    fn continuations_must_exist_and_match_the_oracle() {
        let mut t = good();
        t.remove(11);
        only(t, "missing_continuation", 12);
        let mut t = good();
        t[11].tokens = Some(vec![5, 6, 8]);
        t[11].digest = None;
        only(t, "continuation_mismatch", 12);
    }

    #[test]
    fn decode_needs_every_chunk_loaded_and_lines_must_parse() {
        let mut t = good();
        t.remove(9); // chunk 1 never loaded; decode_start moves to line 10
        only(t, "causality", 10);
        let mut l = lines(good());
        l.insert(3, (99, Err("expected value".into())));
        let r = check(&l, PayloadPath::HostFixed);
        assert_eq!(r.violations.iter().map(|v| (v.kind, v.line)).collect::<Vec<_>>(), vec![("malformed", 99)]);
    }
}
