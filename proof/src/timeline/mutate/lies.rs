//! The lies [`super::mutants`] tells: one function each, taking the
//! publication [`Target`] and the correct timeline, answering the mutated
//! timeline, where the checker must catch it and with which rule (or `None`
//! where the timeline lacks what the lie needs).

use std::ops::RangeInclusive;

use super::{Event, Target, tokens_digest};

/// One lie, before its timeline is renumbered.
pub(crate) struct Lie {
    pub(super) what: String,
    pub(super) expect: &'static str,
    pub(super) line: RangeInclusive<usize>,
    pub(super) events: Vec<Event>,
}

/// A mutation: the lie it tells about `t` in `base`, if it applies.
pub(super) type Tell = fn(t: &Target, base: &[Event]) -> Option<Lie>;

macro_rules! table {
    ($($name:ident),* $(,)?) => {
        /// Every mutation, by name, in the order they are told.
        pub(super) const ALL: &[(&str, Tell)] = &[$((stringify!($name), $name as Tell)),*];
    };
}

table!(
    daemon_publish_deleted,
    missing_publish,
    store_publish_times_swapped,
    load_before_store_completed,
    ack_from_a_stranger,
    ack_by_a_restarted_daemon,
    duplicate_daemon_ack,
    chunk_stored_twice_other_digest,
    chunk_store_dropped,
    load_after_ack,
    release_after_ack,
    second_claim,
    adopt_before_claim,
    decode_with_another_token,
    load_of_an_unknown_chunk,
    ack_before_continuation,
    publish_declares_fewer_chunks,
    publish_crc_altered,
    store_on_another_path,
    load_fallback_verdict,
    altered_receipt,
    continuation_changed,
    ack_without_load,
    load_crc_altered,
    ack_digest_altered,
    load_by_another_session,
    clock_backwards,
    anonymous_refusal,
    restored_without_a_load,
);

fn lie(what: String, expect: &'static str, line: RangeInclusive<usize>, events: Vec<Event>) -> Option<Lie> {
    Some(Lie { what, expect, line, events })
}

/// Line numbers are 1-based; an index i is line i + 1.
fn ln(i: usize) -> usize {
    i + 1
}

/// Inserts `e` after line index `at`, at its time; answers its index.
fn insert_after(ev: &mut Vec<Event>, at: usize, mut e: Event) -> usize {
    e.ts_ns = ev[at].ts_ns;
    ev.insert(at + 1, e);
    at + 1
}

/// The daemon's publish deleted: the writer's echo (or the claim) shows it.
fn daemon_publish_deleted(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    ev.remove(t.publish);
    let (kind, at) = match t.echo_publish {
        Some(i) if i > t.publish => ("missing_publish", i - 1),
        _ => ("causality", t.claim - 1),
    };
    lie(format!("publication {id}: the daemon's publish line removed"), kind, ln(at)..=ln(at), ev)
}

/// Both publishes deleted: the claim comes before any publish.
fn missing_publish(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let mut gone = vec![t.publish];
    gone.extend(t.echo_publish);
    gone.sort_unstable();
    for i in gone.iter().rev() {
        ev.remove(*i);
    }
    let at = t.claim - gone.iter().filter(|&&i| i < t.claim).count();
    lie(format!("publication {id}: every publish line removed"), "causality", ln(at)..=ln(at), ev)
}

/// A store and the publish with their times swapped.
fn store_publish_times_swapped(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let s = *t.stores.last().unwrap_or(&t.publish);
    let (a, b) = (ev[s].ts_ns, ev[t.publish].ts_ns);
    (ev[s].ts_ns, ev[t.publish].ts_ns) = (b, a);
    lie(format!("publication {id}: the last store and the publish swap ts_ns"), "clock", ln(s + 1)..=ln(t.publish), ev)
}

/// A load that ends before its chunk's store completed.
fn load_before_store_completed(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let l = t.loads[0];
    let chunk = ev[l].chunk;
    if let Some(s) = t.stores.iter().copied().find(|&s| ev[s].chunk == chunk) {
        // The store now completes after the load ended.
        ev[s].ts_ns = ev[l].ts_ns + 1;
        return lie(
            format!("publication {id}: a chunk's store completes after its load ended"),
            "causality",
            ln(l)..=ln(l),
            ev,
        );
    }
    None
}

/// An ack echo from a node that never claimed, adopted, loaded or decoded.
fn ack_from_a_stranger(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let at = t.ack_echo.unwrap_or(t.ack);
    let mut e = ev[t.ack].clone();
    e.node = "reader-999999".into();
    e.seq = 1;
    let i = insert_after(&mut ev, at, e);
    lie(format!("publication {id}: reader-999999 acks it"), "foreign_ack", ln(i)..=ln(i), ev)
}

/// A restarted daemon acks the same publication again.
fn ack_by_a_restarted_daemon(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let mut e = ev[t.ack].clone();
    e.node = "daemon-e2".into();
    e.seq = 1;
    let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack), e);
    lie(format!("publication {id}: daemon-e2 acks it again"), "duplicate_ack", ln(i)..=ln(i), ev)
}

/// The same daemon acks twice.
fn duplicate_daemon_ack(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let e = ev[t.ack].clone();
    let i = insert_after(&mut ev, t.ack, e);
    lie(format!("publication {id}: the daemon's ack line repeated"), "duplicate_ack", ln(i)..=ln(i), ev)
}

/// A chunk stored twice with another digest.
fn chunk_stored_twice_other_digest(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let mut e = ev[t.stores[0]].clone();
    e.crc32c = Some(e.crc32c.unwrap_or(0) ^ 0x5a5a);
    let i = insert_after(&mut ev, *t.stores.last().unwrap_or(&t.stores[0]), e);
    lie(
        format!("publication {id}: chunk {:?} stored again with another crc32c", ev[i].chunk),
        "store_conflict",
        ln(i)..=ln(i),
        ev,
    )
}

/// A chunk's store dropped.
fn chunk_store_dropped(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let s = *t.stores.last().unwrap_or(&t.stores[0]);
    ev.remove(s);
    let at = t.publish - 1;
    lie(format!("publication {id}: the last store line removed"), "missing_store", ln(at)..=ln(at), ev)
}

/// A load after the ack.
fn load_after_ack(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let e = ev[*t.loads.last().unwrap_or(&t.loads[0])].clone();
    let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack).max(t.ack), e);
    lie(format!("publication {id}: a load repeated after the ack"), "after_end", ln(i)..=ln(i), ev)
}

/// A release after the ack.
fn release_after_ack(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let mut e = ev[t.ack].clone();
    e.event = "release".into();
    e.digest = None;
    let i = insert_after(&mut ev, t.ack_echo.unwrap_or(t.ack).max(t.ack), e);
    lie(format!("publication {id}: released after its ack"), "after_end", ln(i)..=ln(i), ev)
}

/// A second claim.
fn second_claim(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let e = ev[t.claim].clone();
    let i = insert_after(&mut ev, t.claim, e);
    lie(format!("publication {id}: the daemon's claim line repeated"), "duplicate_claim", ln(i)..=ln(i), ev)
}

/// Adopt before claim.
fn adopt_before_claim(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    ev.swap(t.claim, t.adopt);
    let (a, b) = (ev[t.claim].ts_ns, ev[t.adopt].ts_ns);
    (ev[t.claim].ts_ns, ev[t.adopt].ts_ns) = (b, a);
    lie(format!("publication {id}: the claim and adopt lines swapped"), "causality", ln(t.claim)..=ln(t.claim), ev)
}

/// Decode from another token.
fn decode_with_another_token(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let d = t.decode?;
    let mut ev = base.to_vec();
    ev[d].token = Some(ev[d].token.unwrap_or(0).wrapping_add(1));
    lie(format!("publication {id}: decode_start.token changed"), "token_mismatch", ln(d)..=ln(d), ev)
}

/// A load of a chunk not in the manifest.
fn load_of_an_unknown_chunk(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let l = *t.loads.last().unwrap_or(&t.loads[0]);
    ev[l].chunk = Some(t.chunks);
    lie(format!("publication {id}: a load names chunk {}", t.chunks), "unknown_chunk", ln(l)..=ln(l), ev)
}

/// The ack before the continuation.
fn ack_before_continuation(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let c = t.continuation.filter(|&c| c < t.ack)?;
    let mut ev = base.to_vec();
    let mut ack = ev.remove(t.ack);
    ack.ts_ns = ev[c].ts_ns.saturating_sub(1).max(ev[c - 1].ts_ns);
    ev.insert(c, ack);
    lie(
        format!("publication {id}: the daemon's ack moved before the reader's continuation"),
        "missing_continuation",
        ln(c)..=ln(c),
        ev,
    )
}

/// A publish declaring fewer chunks than were stored.
fn publish_declares_fewer_chunks(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let p = &mut ev[t.publish];
    p.chunks = Some(t.chunks - 1);
    if let Some(c) = &mut p.crcs {
        c.pop();
    }
    lie(
        format!("publication {id}: the publish declares {} chunks", t.chunks - 1),
        "publish_mismatch",
        ln(t.publish)..=ln(t.publish),
        ev,
    )
}

/// The publish's crc32c list altered.
fn publish_crc_altered(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    if let Some(c) = ev[t.publish].crcs.as_mut().and_then(|c| c.first_mut()) {
        *c ^= 1;
        return lie(
            format!("publication {id}: chunk 0's crc32c in the publish changed"),
            "publish_mismatch",
            ln(t.publish)..=ln(t.publish),
            ev,
        );
    }
    None
}

/// A store on another path.
fn store_on_another_path(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let s = t.stores[0];
    ev[s].path = Some(if ev[s].path.as_deref() == Some("host") { "host_fixed" } else { "host" }.into());
    lie(format!("publication {id}: a store's path changed"), "wrong_path", ln(s)..=ln(s), ev)
}

/// A load judged fallback.
fn load_fallback_verdict(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let l = t.loads[0];
    ev[l].verdict = Some("fallback(page-cache)".into());
    lie(format!("publication {id}: a load judged fallback"), "not_native", ln(l)..=ln(l), ev)
}

/// A receipt altered where a client names it.
fn altered_receipt(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let at = t.echo_publish.or(t.claim_echo).or(t.decode).unwrap_or(t.ack);
    ev[at].receipt = Some("f0rged".into());
    lie(format!("publication {id}: a client's receipt altered"), "receipt_mismatch", ln(at)..=ln(at), ev)
}

/// A continuation's tokens changed.
fn continuation_changed(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let c = t.continuation?;
    let mut ev = base.to_vec();
    if let Some(tokens) = &mut ev[c].tokens {
        if let Some(last) = tokens.last_mut() {
            *last = last.wrapping_add(1);
        }
        ev[c].digest = Some(tokens_digest(tokens));
        return lie(
            format!("publication {id}: the reader's continuation differs from the oracle's"),
            "continuation_mismatch",
            ln(c)..=ln(c),
            ev,
        );
    }
    None
}

/// An ack without a load: every load line removed.
fn ack_without_load(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    for &l in t.loads.iter().rev() {
        ev.remove(l);
    }
    let at = t.ack - t.loads.len();
    lie(format!("publication {id}: every load line removed"), "ack_without_load", ln(at)..=ln(at), ev)
}

/// A load whose bytes were not the stored ones.
fn load_crc_altered(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let l = t.loads[0];
    if ev[l].crc32c.is_some() {
        ev[l].crc32c = ev[l].crc32c.map(|c| c ^ 1);
        return lie(format!("publication {id}: a load's crc32c changed"), "load_mismatch", ln(l)..=ln(l), ev);
    }
    None
}

/// The ack's digest not the restore's.
fn ack_digest_altered(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    if base[t.ack].digest.is_none() || base[t.adopt].nonce.is_none() {
        return None;
    }
    let mut ev = base.to_vec();
    ev[t.ack].digest = Some(pdstor_client::receipt::restore_digest("", &[]));
    lie(format!("publication {id}: the ack's restore digest changed"), "restore_mismatch", ln(t.ack)..=ln(t.ack), ev)
}

/// Another reader session on a load.
fn load_by_another_session(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    // Only a timeline whose loads name their session.
    base[t.loads[0]].session.as_ref()?;
    let mut ev = base.to_vec();
    let l = t.loads[0];
    ev[l].session = Some("another-session".into());
    lie(format!("publication {id}: a load names another session"), "reader_mismatch", ln(l)..=ln(l), ev)
}

/// The daemon's clock going backwards.
fn clock_backwards(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let mut ev = base.to_vec();
    let prev = ev[..t.adopt].iter().rev().find(|e| e.node == ev[t.adopt].node).map_or(0, |e| e.ts_ns);
    ev[t.adopt].ts_ns = prev.saturating_sub(1);
    lie(
        format!("publication {id}: the adopt's time before the daemon's previous line"),
        "clock",
        ln(t.adopt)..=ln(t.adopt),
        ev,
    )
}

/// A refusal that names nothing.
fn anonymous_refusal(t: &Target, base: &[Event]) -> Option<Lie> {
    let mut ev = base.to_vec();
    let mut e = Event::new("refused").detail("bad_signature (signature): forged");
    e.node = ev[t.ack].node.clone();
    let i = insert_after(&mut ev, t.ack, e);
    lie("a refusal naming no publication or request".into(), "anonymous_refusal", ln(i)..=ln(i), ev)
}

/// Restored (no model) with a chunk never loaded.
fn restored_without_a_load(t: &Target, base: &[Event]) -> Option<Lie> {
    let id = t.id;
    let r = t.restored?;
    let mut ev = base.to_vec();
    let l = *t.loads.last().unwrap_or(&t.loads[0]);
    ev.remove(l);
    let at = r - 1;
    lie(format!("publication {id}: a load before the restore removed"), "causality", ln(at)..=ln(at), ev)
}
