//! Issue 34: what an outside campaign against the identity daemon found, and
//! what a hostile local user, a second tenant and a flaky machine try next.
//! The attacker is uid 4002 of tenant `mallory` (`pdstor_tests::mallory`);
//! the victim is root, the daemon's user. Every attack must be refused with
//! nothing changed, and the victim then finishes undisturbed.
//!
//! Needs root and `setpriv` (util-linux); says SKIP otherwise.

use std::time::{Duration, Instant};

use pdstor::client::Client;
use pdstor_tests::mallory::{Attack, Lab, as_mallory, layout, refused, unavailable};

/// The attacker's side: does nothing unless this binary was re-run with an attack.
#[test]
fn attacker() {
    pdstor_tests::mallory::attacker();
}

/// Polls `what` every 20 ms until it holds, for at most 20 s.
#[track_caller]
fn until(why: &str, mut what: impl FnMut() -> bool) {
    let t = Instant::now();
    while !what() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {why}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of an unlabelled metric in the daemon's exposition.
fn metric(c: &Client, name: &str) -> u64 {
    let text = c.metrics().expect("the metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the metrics"))
}

/// Finding 1: another tenant's refused prepare of the id a victim's prepare
/// is waiting with, then its cancel of that id. Before the fix the refused
/// prepare replaced the record of who was preparing the id and removed it
/// on its way out, so the cancel went through and the victim's prepare
/// failed `aborted`.
#[test]
fn a_refused_prepare_cannot_make_another_tenants_waiting_prepare_its_own() {
    if let Some(why) = unavailable() {
        return pdstor_tests::skip("a_refused_prepare_cannot_make_another_tenants_waiting_prepare_its_own", &why);
    }
    let lab = Lab::with(4, "slots = 2");
    let d = lab.daemon(&["--admission-timeout-ms", "60000"]);
    let server = d.server.clone();
    let c = Client::new(&server);
    let filler = c.prepare("filler", &layout(), 4, "w").expect("the filler takes every slot");
    let waiting = {
        let server = server.clone();
        std::thread::spawn(move || Client::new(&server).prepare("a-wait", &layout(), 1, "w"))
    };
    until("the victim's prepare waits for capacity", || metric(&c, "pdstor_admission_waiting") == 1);

    refused(
        as_mallory(&Attack::Prepare { server: server.clone(), req: "a-wait".into(), chunks: 1 }),
        "duplicate_request",
    );
    refused(as_mallory(&Attack::Cancel { server: server.clone(), req: "a-wait".into() }), "not_owner");
    assert_eq!(metric(&c, "pdstor_admission_waiting"), 1, "the victim's prepare stopped waiting");

    c.abort(filler.publication, &filler.writer_token).expect("the victim frees the slots");
    let p = waiting.join().expect("the waiting prepare").expect("the victim's prepare is admitted");
    let live = c.publications(None, false).expect("listing");
    let mine = live.iter().find(|l| l.publication == p.publication).expect("the victim's publication");
    assert_eq!((mine.req_id.as_str(), mine.state.as_str()), ("a-wait", "PREPARED"));
}
