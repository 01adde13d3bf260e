//! `pdstor timeline mutate`: tests the checker by lying to it. Each mutation
//! takes a correct timeline and tells one causal lie about one publication
//! (a deleted publish, swapped times, an ack from a stranger, …); the checker
//! must catch every mutant at the line the lie was told, with the rule it
//! breaks. [`mutants`] makes them from any timeline with a complete handoff;
//! [`example`] is a small correct one.

use std::collections::HashMap;
use std::ops::RangeInclusive;

use serde::Serialize;

use super::check::{CheckReport, Violation, is_daemon};
use super::{Event, tokens_digest};

mod example;
pub use example::example;

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
    let Some(t) = target(events) else { return Vec::new() };
    let mut out = Vec::new();
    let id = t.id;
    let base = events.to_vec();
    let mut push =
        |name: &'static str, what: String, expect: &'static str, line: RangeInclusive<usize>, ev: Vec<Event>| {
            out.push(Mutant { name, what, line, expect, events: renumbered(ev) });
        };
    // Line numbers are 1-based; an index i is line i + 1.
    let ln = |i: usize| i + 1;
    let insert_after = |ev: &mut Vec<Event>, at: usize, mut e: Event| -> usize {
        e.ts_ns = ev[at].ts_ns;
        ev.insert(at + 1, e);
        at + 1
    };

    // The daemon's publish deleted: the writer's echo (or the claim) shows it.
    {
        let mut ev = base.clone();
        ev.remove(t.publish);
        let (kind, at) = match t.echo_publish {
            Some(i) if i > t.publish => ("missing_publish", i - 1),
            _ => ("causality", t.claim - 1),
        };
        push(
            "daemon_publish_deleted",
            format!("publication {id}: the daemon's publish line removed"),
            kind,
            ln(at)..=ln(at),
            ev,
        );
    }
    // Both publishes deleted: the claim comes before any publish.
    {
        let mut ev = base.clone();
        let mut gone = vec![t.publish];
        gone.extend(t.echo_publish);
        gone.sort_unstable();
        for i in gone.iter().rev() {
            ev.remove(*i);
        }
        let at = t.claim - gone.iter().filter(|&&i| i < t.claim).count();
        push(
            "missing_publish",
            format!("publication {id}: every publish line removed"),
            "causality",
            ln(at)..=ln(at),
            ev,
        );
    }
    // A store and the publish with their times swapped.
    {
        let mut ev = base.clone();
        let s = *t.stores.last().unwrap_or(&t.publish);
        let (a, b) = (ev[s].ts_ns, ev[t.publish].ts_ns);
        (ev[s].ts_ns, ev[t.publish].ts_ns) = (b, a);
        push(
            "store_publish_times_swapped",
            format!("publication {id}: the last store and the publish swap ts_ns"),
            "clock",
            ln(s + 1)..=ln(t.publish),
            ev,
        );
    }
    // A load that ends before its chunk's store completed.
    {
        let mut ev = base.clone();
        let l = t.loads[0];
        let chunk = ev[l].chunk;
        if let Some(s) = t.stores.iter().copied().find(|&s| ev[s].chunk == chunk) {
            // The store now completes after the load ended.
            ev[s].ts_ns = ev[l].ts_ns + 1;
            push(
                "load_before_store_completed",
                format!("publication {id}: a chunk's store completes after its load ended"),
                "causality",
                ln(l)..=ln(l),
                ev,
            );
        }
    }
    // An ack echo from a node that never claimed, adopted, loaded or decoded.
    {
        let mut ev = base.clone();
        let at = t.ack_echo.unwrap_or(t.ack);
        let mut e = ev[t.ack].clone();
        e.node = "reader-999999".into();
        e.seq = 1;
        let i = insert_after(&mut ev, at, e);
        push(
            "ack_from_a_stranger",
            format!("publication {id}: reader-999999 acks it"),
            "foreign_ack",
            ln(i)..=ln(i),
            ev,
        );
    }
    // A restarted daemon acks the same publication again.
    {
        let mut ev = base.clone();
        let mut e = ev[t.ack].clone();
        e.node = "daemon-e2".into();
        e.seq = 1;
        let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack), e);
        push(
            "ack_by_a_restarted_daemon",
            format!("publication {id}: daemon-e2 acks it again"),
            "duplicate_ack",
            ln(i)..=ln(i),
            ev,
        );
    }
    // The same daemon acks twice.
    {
        let mut ev = base.clone();
        let e = ev[t.ack].clone();
        let i = insert_after(&mut ev, t.ack, e);
        push(
            "duplicate_daemon_ack",
            format!("publication {id}: the daemon's ack line repeated"),
            "duplicate_ack",
            ln(i)..=ln(i),
            ev,
        );
    }
    // A chunk stored twice with another digest.
    {
        let mut ev = base.clone();
        let mut e = ev[t.stores[0]].clone();
        e.crc32c = Some(e.crc32c.unwrap_or(0) ^ 0x5a5a);
        let i = insert_after(&mut ev, *t.stores.last().unwrap_or(&t.stores[0]), e);
        push(
            "chunk_stored_twice_other_digest",
            format!("publication {id}: chunk {:?} stored again with another crc32c", ev[i].chunk),
            "store_conflict",
            ln(i)..=ln(i),
            ev,
        );
    }
    // A chunk's store dropped.
    {
        let mut ev = base.clone();
        let s = *t.stores.last().unwrap_or(&t.stores[0]);
        ev.remove(s);
        let at = t.publish - 1;
        push(
            "chunk_store_dropped",
            format!("publication {id}: the last store line removed"),
            "missing_store",
            ln(at)..=ln(at),
            ev,
        );
    }
    // A load after the ack.
    {
        let mut ev = base.clone();
        let e = ev[*t.loads.last().unwrap_or(&t.loads[0])].clone();
        let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack).max(t.ack), e);
        push(
            "load_after_ack",
            format!("publication {id}: a load repeated after the ack"),
            "after_end",
            ln(i)..=ln(i),
            ev,
        );
    }
    // A release after the ack.
    {
        let mut ev = base.clone();
        let mut e = ev[t.ack].clone();
        e.event = "release".into();
        e.digest = None;
        let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack).max(t.ack), e);
        push("release_after_ack", format!("publication {id}: released after its ack"), "after_end", ln(i)..=ln(i), ev);
    }
    // A second claim.
    {
        let mut ev = base.clone();
        let e = ev[t.claim].clone();
        let i = insert_after(&mut ev, t.claim, e);
        push(
            "second_claim",
            format!("publication {id}: the daemon's claim line repeated"),
            "duplicate_claim",
            ln(i)..=ln(i),
            ev,
        );
    }
    // Adopt before claim.
    {
        let mut ev = base.clone();
        ev.swap(t.claim, t.adopt);
        let (a, b) = (ev[t.claim].ts_ns, ev[t.adopt].ts_ns);
        (ev[t.claim].ts_ns, ev[t.adopt].ts_ns) = (b, a);
        push(
            "adopt_before_claim",
            format!("publication {id}: the claim and adopt lines swapped"),
            "causality",
            ln(t.claim)..=ln(t.claim),
            ev,
        );
    }
    // Decode from another token.
    if let Some(d) = t.decode {
        let mut ev = base.clone();
        ev[d].token = Some(ev[d].token.unwrap_or(0).wrapping_add(1));
        push(
            "decode_with_another_token",
            format!("publication {id}: decode_start.token changed"),
            "token_mismatch",
            ln(d)..=ln(d),
            ev,
        );
    }
    // A load of a chunk not in the manifest.
    {
        let mut ev = base.clone();
        let l = *t.loads.last().unwrap_or(&t.loads[0]);
        ev[l].chunk = Some(t.chunks);
        push(
            "load_of_an_unknown_chunk",
            format!("publication {id}: a load names chunk {}", t.chunks),
            "unknown_chunk",
            ln(l)..=ln(l),
            ev,
        );
    }
    // The ack before the continuation.
    if let Some(c) = t.continuation.filter(|&c| c < t.ack) {
        let mut ev = base.clone();
        let mut ack = ev.remove(t.ack);
        ack.ts_ns = ev[c].ts_ns.saturating_sub(1).max(ev[c - 1].ts_ns);
        ev.insert(c, ack);
        push(
            "ack_before_continuation",
            format!("publication {id}: the daemon's ack moved before the reader's continuation"),
            "missing_continuation",
            ln(c)..=ln(c),
            ev,
        );
    }
    // A publish declaring fewer chunks than were stored.
    {
        let mut ev = base.clone();
        let p = &mut ev[t.publish];
        p.chunks = Some(t.chunks - 1);
        if let Some(c) = &mut p.crcs {
            c.pop();
        }
        push(
            "publish_declares_fewer_chunks",
            format!("publication {id}: the publish declares {} chunks", t.chunks - 1),
            "publish_mismatch",
            ln(t.publish)..=ln(t.publish),
            ev,
        );
    }
    // The publish's crc32c list altered.
    {
        let mut ev = base.clone();
        if let Some(c) = ev[t.publish].crcs.as_mut().and_then(|c| c.first_mut()) {
            *c ^= 1;
            push(
                "publish_crc_altered",
                format!("publication {id}: chunk 0's crc32c in the publish changed"),
                "publish_mismatch",
                ln(t.publish)..=ln(t.publish),
                ev,
            );
        }
    }
    // A store on another path, a load with a fallback verdict.
    {
        let mut ev = base.clone();
        let s = t.stores[0];
        ev[s].path = Some(if ev[s].path.as_deref() == Some("host") { "host_fixed" } else { "host" }.into());
        push(
            "store_on_another_path",
            format!("publication {id}: a store's path changed"),
            "wrong_path",
            ln(s)..=ln(s),
            ev,
        );
        let mut ev = base.clone();
        let l = t.loads[0];
        ev[l].verdict = Some("fallback(page-cache)".into());
        push(
            "load_fallback_verdict",
            format!("publication {id}: a load judged fallback"),
            "not_native",
            ln(l)..=ln(l),
            ev,
        );
    }
    // A receipt altered where a client names it.
    {
        let mut ev = base.clone();
        let at = t.echo_publish.or(t.claim_echo).or(t.decode).unwrap_or(t.ack);
        ev[at].receipt = Some("f0rged".into());
        push(
            "altered_receipt",
            format!("publication {id}: a client's receipt altered"),
            "receipt_mismatch",
            ln(at)..=ln(at),
            ev,
        );
    }
    // A continuation's tokens changed.
    if let Some(c) = t.continuation {
        let mut ev = base.clone();
        if let Some(tokens) = &mut ev[c].tokens {
            if let Some(last) = tokens.last_mut() {
                *last = last.wrapping_add(1);
            }
            ev[c].digest = Some(tokens_digest(tokens));
            push(
                "continuation_changed",
                format!("publication {id}: the reader's continuation differs from the oracle's"),
                "continuation_mismatch",
                ln(c)..=ln(c),
                ev,
            );
        }
    }
    // An ack without a load: every load line removed.
    {
        let mut ev = base.clone();
        for &l in t.loads.iter().rev() {
            ev.remove(l);
        }
        let at = t.ack - t.loads.len();
        push(
            "ack_without_load",
            format!("publication {id}: every load line removed"),
            "ack_without_load",
            ln(at)..=ln(at),
            ev,
        );
    }
    // A load whose bytes were not the stored ones.
    {
        let mut ev = base.clone();
        let l = t.loads[0];
        if ev[l].crc32c.is_some() {
            ev[l].crc32c = ev[l].crc32c.map(|c| c ^ 1);
            push(
                "load_crc_altered",
                format!("publication {id}: a load's crc32c changed"),
                "load_mismatch",
                ln(l)..=ln(l),
                ev,
            );
        }
    }
    // The ack's digest not the restore's.
    if base[t.ack].digest.is_some() && base[t.adopt].nonce.is_some() {
        let mut ev = base.clone();
        ev[t.ack].digest = Some(pdstor_client::receipt::restore_digest("", &[]));
        push(
            "ack_digest_altered",
            format!("publication {id}: the ack's restore digest changed"),
            "restore_mismatch",
            ln(t.ack)..=ln(t.ack),
            ev,
        );
    }
    // Another reader session on a load.
    if base[t.loads[0]].session.is_some() {
        let mut ev = base.clone();
        let l = t.loads[0];
        ev[l].session = Some("another-session".into());
        push(
            "load_by_another_session",
            format!("publication {id}: a load names another session"),
            "reader_mismatch",
            ln(l)..=ln(l),
            ev,
        );
    }
    // The daemon's clock going backwards.
    {
        let mut ev = base.clone();
        let prev = ev[..t.adopt].iter().rev().find(|e| e.node == ev[t.adopt].node).map_or(0, |e| e.ts_ns);
        ev[t.adopt].ts_ns = prev.saturating_sub(1);
        push(
            "clock_backwards",
            format!("publication {id}: the adopt's time before the daemon's previous line"),
            "clock",
            ln(t.adopt)..=ln(t.adopt),
            ev,
        );
    }
    // A refusal that names nothing.
    {
        let mut ev = base.clone();
        let mut e = Event::new("refused").detail("bad_signature (signature): forged");
        e.node = ev[t.ack].node.clone();
        let i = insert_after(&mut ev, t.ack, e);
        push(
            "anonymous_refusal",
            "a refusal naming no publication or request".into(),
            "anonymous_refusal",
            ln(i)..=ln(i),
            ev,
        );
    }
    // Restored (no model) with a chunk never loaded.
    if let Some(r) = t.restored {
        let mut ev = base.clone();
        let l = *t.loads.last().unwrap_or(&t.loads[0]);
        ev.remove(l);
        let at = r - 1;
        push(
            "restored_without_a_load",
            format!("publication {id}: a load before the restore removed"),
            "causality",
            ln(at)..=ln(at),
            ev,
        );
    }
    out
}
