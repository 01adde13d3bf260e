//! The lies told about a cache publication's reads: a release while a read
//! is open, a claim of a publication read by many, a load after its read
//! ended, a read ended done without a load of every chunk, and an end whose
//! digest is not the read's.

use super::lies::Lie;
use super::{Event, is_daemon};

/// Indices into a timeline of one cache publication's lines: its first
/// read, that read's loads and its verified end.
pub(super) struct ReadTarget {
    id: u64,
    read: usize,
    loads: Vec<usize>,
    done: usize,
}

/// The first publication with a read that loaded and ended done.
pub(super) fn target(events: &[Event]) -> Option<ReadTarget> {
    events.iter().enumerate().find_map(|(read, e)| {
        if e.event != "read" || !is_daemon(&e.node) {
            return None;
        }
        let (id, receipt) = (e.publication?, e.receipt.clone()?);
        let of = |x: &Event, what: &str| {
            x.publication == Some(id) && x.event == what && x.receipt.as_ref() == Some(&receipt) && is_daemon(&x.node)
        };
        let loads: Vec<usize> = (read..events.len()).filter(|&i| of(&events[i], "load")).collect();
        let done = (read..events.len()).find(|&i| of(&events[i], "read_done"))?;
        (!loads.is_empty() && loads.iter().all(|&l| l < done)).then_some(ReadTarget { id, read, loads, done })
    })
}

/// A mutation of a read: the lie it tells about `t` in `base`, if it applies.
pub(super) type Tell = fn(t: &ReadTarget, base: &[Event]) -> Option<Lie>;

/// Every mutation of a read, by name.
pub(super) const ALL: &[(&str, Tell)] = &[
    ("release_while_read", release_while_read),
    ("claim_of_a_cache_publication", claim_of_a_cache_publication),
    ("load_after_read_done", load_after_read_done),
    ("read_done_without_load", read_done_without_load),
    ("read_done_digest_altered", read_done_digest_altered),
];

fn lie(what: String, expect: &'static str, line: usize, events: Vec<Event>) -> Option<Lie> {
    Some(Lie { what, expect, line: line..=line, events })
}

/// `e` inserted after index `at`, at its time; answers its line (1-based).
fn insert_after(ev: &mut Vec<Event>, at: usize, mut e: Event) -> usize {
    e.ts_ns = ev[at].ts_ns;
    ev.insert(at + 1, e);
    at + 2
}

/// The writer's release, between the read and its end.
fn release_while_read(t: &ReadTarget, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    let mut e = ev[t.read].clone();
    e.event = "release".into();
    (e.receipt, e.reader, e.session, e.nonce) = (None, None, None, None);
    let line = insert_after(&mut ev, t.read, e);
    lie(format!("publication {}: released while a read of it is open", t.id), "release_while_read", line, ev)
}

/// A claim of the publication once a read began.
fn claim_of_a_cache_publication(t: &ReadTarget, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    let mut e = ev[t.read].clone();
    e.event = "claim".into();
    e.receipt = Some("claim-of-a-cache".into());
    e.nonce = None;
    let line = insert_after(&mut ev, t.read, e);
    lie(format!("publication {}: claimed, though it is read by many", t.id), "read_class", line, ev)
}

/// One of the read's loads repeated after its end.
fn load_after_read_done(t: &ReadTarget, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    let e = ev[t.loads[0]].clone();
    let line = insert_after(&mut ev, t.done, e);
    lie(format!("publication {}: a load under a read after the read ended", t.id), "read_ended", line, ev)
}

/// The read's loads deleted: it ends done having loaded nothing.
fn read_done_without_load(t: &ReadTarget, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    for &l in t.loads.iter().rev() {
        ev.remove(l);
    }
    let line = t.done - t.loads.len() + 1;
    lie(format!("publication {}: a read ends done with no chunk loaded for it", t.id), "read_without_load", line, ev)
}

/// The read's end names another digest.
fn read_done_digest_altered(t: &ReadTarget, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    ev[t.done].digest = Some("0".repeat(64));
    lie(format!("publication {}: a read's end digest altered", t.id), "restore_mismatch", t.done + 1, ev)
}
