//! `pdstor timeline mutate`: tests the checker by lying to it. Each mutation
//! takes a correct timeline and tells one causal lie about one publication
//! (a deleted publish, swapped times, an ack from a stranger, …); the checker
//! must catch every mutant at the line the lie was told, with the rule it
//! breaks. [`mutants`] makes them from any timeline with a complete handoff
//! or a cache publication's read; [`example`] and [`example_cache`] are
//! small correct ones.

use std::collections::HashMap;
use std::ops::RangeInclusive;

use serde::Serialize;

use super::check::{CheckReport, Violation, is_daemon};
use super::{Event, tokens_digest};

mod example;
mod lies;
mod reads;
pub use example::{example, example_cache};

/// One lie told to the checker.
#[derive(Debug, Clone, Serialize)]
pub struct Mutant {
    /// The mutation's name.
    pub name: &'static str,
    /// What was changed, in words.
    pub what: String,
    /// Where the checker must report it (lines of the mutated timeline).
    pub line: RangeInclusive<usize>,
    /// The kind of violation it must report there.
    pub expect: &'static str,
    /// The mutated timeline.
    #[serde(skip)]
    pub events: Vec<Event>,
}

impl Mutant {
    /// The violation that catches this mutant, if the report has one.
    pub fn caught_by<'a>(&self, r: &'a CheckReport) -> Option<&'a Violation> {
        r.violations.iter().find(|v| v.kind == self.expect && self.line.contains(&v.line))
    }
}

/// Reassigns each node's `seq` 1, 2, … in file order (and its parents to
/// match), as a node that had really written the mutated file would have.
pub fn renumbered(mut events: Vec<Event>) -> Vec<Event> {
    let mut next: HashMap<String, u64> = HashMap::new();
    let mut map: HashMap<(String, u64), u64> = HashMap::new();
    for e in &mut events {
        let n = next.entry(e.node.clone()).or_insert(0);
        *n += 1;
        map.entry((e.node.clone(), e.seq)).or_insert(*n);
        e.seq = *n;
    }
    for e in &mut events {
        e.parent = e.parent.and_then(|p| map.get(&(e.node.clone(), p)).copied()).filter(|p| *p < e.seq);
    }
    events
}

/// Indices into a timeline of one publication's lines.
struct Target {
    id: u64,
    prepare: usize,
    stores: Vec<usize>,
    publish: usize,
    echo_publish: Option<usize>,
    claim: usize,
    claim_echo: Option<usize>,
    adopt: usize,
    loads: Vec<usize>,
    decode: Option<usize>,
    continuation: Option<usize>,
    restored: Option<usize>,
    ack: usize,
    ack_echo: Option<usize>,
    chunks: u32,
}

/// The first publication with a complete handoff: prepare, stores, the
/// daemon's publish, claim, adopt, loads and the daemon's ack.
fn target(events: &[Event]) -> Option<Target> {
    let ids: Vec<u64> = {
        let mut seen = Vec::new();
        for e in events {
            if let Some(p) = e.publication
                && !seen.contains(&p)
            {
                seen.push(p);
            }
        }
        seen
    };
    ids.into_iter().find_map(|id| {
        let all = |event: &str, daemon: bool| -> Vec<usize> {
            events
                .iter()
                .enumerate()
                .filter(|(_, e)| e.publication == Some(id) && e.event == event && is_daemon(&e.node) == daemon)
                .map(|(i, _)| i)
                .collect()
        };
        let one = |event: &str, daemon: bool| all(event, daemon).first().copied();
        let t = Target {
            id,
            prepare: one("prepare", true)?,
            stores: all("store", true),
            publish: one("publish", true)?,
            echo_publish: one("publish", false),
            claim: one("claim", true)?,
            claim_echo: one("claim", false),
            adopt: one("adopt", true)?,
            loads: all("load", true),
            decode: one("decode_start", false),
            continuation: all("continuation", false).last().copied(),
            restored: one("restored", false),
            ack: one("ack", true)?,
            ack_echo: one("ack", false),
            chunks: events.iter().find(|e| e.publication == Some(id) && e.event == "publish")?.chunks?,
        };
        (t.stores.len() >= 2 && !t.loads.is_empty() && t.chunks >= 2 && t.prepare < t.publish).then_some(t)
    })
}

/// Every mutation of `events` that applies (empty if no publication in it has
/// a complete handoff). Each mutant is renumbered as its nodes would have
/// written it, so only the lie itself is left to catch.
pub fn mutants(events: &[Event]) -> Vec<Mutant> {
    let mutant = |name, lie: lies::Lie| Mutant {
        name,
        what: lie.what,
        line: lie.line,
        expect: lie.expect,
        events: renumbered(lie.events),
    };
    let mut out = Vec::new();
    if let Some(t) = target(events) {
        out.extend(lies::ALL.iter().filter_map(|&(name, tell)| Some(mutant(name, tell(&t, events)?))));
    }
    if let Some(t) = reads::target(events) {
        out.extend(reads::ALL.iter().filter_map(|&(name, tell)| Some(mutant(name, tell(&t, events)?))));
    }
    out
}
