//! The checker against timelines with one planted violation each.

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

/// A claim answered again (its first answer was lost) is no second claim
/// when it names the first's receipt; naming another, or coming with no
/// claim before it, is reported.
#[test]
fn a_repeated_claim_is_the_same_claim() {
    let t = mutate::example();
    let at = t.iter().position(|e| e.event == "claim" && e.node.starts_with("daemon")).expect("the daemon's claim");
    let again = |receipt: Option<String>| {
        let mut t = t.clone();
        let mut e = t[at].clone();
        e.event = "claim_again".into();
        e.receipt = receipt;
        t.insert(at + 1, e);
        mutate::renumbered(t)
    };
    let r = check(&lines(again(t[at].receipt.clone())), PayloadPath::HostFixed);
    assert!(r.ok(), "{:#?}", r.violations);
    only(again(Some("another".into())), "receipt_mismatch", at + 2);
    let mut lone = again(t[at].receipt.clone());
    lone.remove(at);
    let r = check(&lines(mutate::renumbered(lone)), PayloadPath::HostFixed);
    assert!(r.violations.iter().any(|v| v.kind == "causality" && v.line == at + 1), "{:#?}", r.violations);
}

#[test]
fn a_writers_publish_echo_may_land_after_the_readers_ack_but_must_still_agree() {
    // The writer's thread wrote its echo after the reader had acknowledged
    // (seen with every vLLM server on one core): a late echo, not a step.
    let mut t = mutate::example();
    let echo = t.remove(5);
    t.push(echo);
    let r = check(&lines(t.clone()), PayloadPath::HostFixed);
    assert!(r.ok(), "{:#?}", r.violations);
    // Late or not, it must name the daemon's READY receipt.
    t[13].receipt = Some("forged".into());
    only(t, "receipt_mismatch", 14);
    // Anything else of the writer's after the end is still a violation.
    let mut t = mutate::example();
    let mut store = t[2].clone();
    store.node = "writer-1".into();
    store.seq = 2;
    t.push(store);
    let r = check(&lines(t), PayloadPath::HostFixed);
    assert!(r.violations.iter().any(|v| v.kind == "after_end" && v.line == 15), "{:#?}", r.violations);
}

/// A cache publication read by two readers at once passes; every lie told
/// about one of its reads is caught where it was told, by its rule.
#[test]
fn two_reads_of_a_cache_publication_pass_and_every_lie_about_a_read_is_caught() {
    let r = check(&lines(mutate::example_cache()), PayloadPath::HostFixed);
    assert!(r.ok(), "{:#?}", r.violations);
    assert_eq!((r.publications, r.payload_events), (1, 6));
    let mutants = mutate::mutants(&mutate::example_cache());
    let names: Vec<&str> = mutants.iter().map(|m| m.name).collect();
    assert_eq!(names.len(), 5, "{names:?}");
    for m in &mutants {
        let r = check(&lines(m.events.clone()), PayloadPath::HostFixed);
        assert!(m.caught_by(&r).is_some(), "{}: expected {} at {:?}: {:#?}", m.name, m.expect, m.line, r.violations);
    }
    // Released once both reads ended is no violation; a second read after
    // the release is one.
    let mut t = mutate::example_cache();
    let mut late = t[4].clone();
    late.receipt = Some("C".into());
    late.ts_ns = 100_000;
    t.push(late);
    only(mutate::renumbered(t), "after_end", 14);
}

/// A restart ends the reads the daemon held in memory, with no line: a
/// release by the next incarnation is no release under a read.
#[test]
fn a_release_after_a_restart_does_not_count_the_last_incarnations_reads() {
    let mut t = mutate::example_cache();
    t.truncate(6); // prepare, stores, publish, two reads: none ended
    let mut release = t[5].clone();
    release.event = "release".into();
    (release.receipt, release.reader, release.session, release.nonce) = (None, None, None, None);
    release.node = "daemon-e2".into();
    t.push(release.clone());
    let r = check(&lines(mutate::renumbered(t.clone())), PayloadPath::HostFixed);
    assert!(r.ok(), "{:#?}", r.violations);
    release.node = "daemon-e1".into();
    t[6] = release;
    only(mutate::renumbered(t), "release_while_read", 7);
}
