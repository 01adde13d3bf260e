//! Orphans by policy (issue 54): a tenant of the config with an unread
//! window (`[tenant.X] unread_release_ms`) has its READY publications no
//! reader claims released after it, on a real daemon; a claimed one is
//! never released, whatever its age; the timeline says whose window it was;
//! and a reload that takes the window away keeps the next orphan.

use std::path::Path;
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_client::{Client, Writer};
use pdstor_tests::Daemon;

const SLOT: u64 = 256 << 10;

fn layout() -> Layout {
    Layout {
        model_id: "orphans".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        chunk_tokens: 64,
        kv_format: "pdstor-orphans".into(),
    }
}

/// This user as an admin of tenant `team-a`, whose table is `table`.
fn config(table: &str) -> String {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    format!("[[principal]]\ntenant = \"team-a\"\nroles = [\"admin\"]\nuids = [{me}]\n\n[tenant.team-a]\n{table}\n")
}

fn put(d: &Daemon, req: &str, seed: u64) -> pdstor_client::receipt::Receipt {
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, 1).expect("a writer");
    w.put(req, &layout(), &pdstor_engine::payload::chunk(seed, 0, SLOT as usize), 1, None).expect("a put").receipt
}

fn state(c: &Client, req: &str) -> Option<String> {
    c.publications(None, false).expect("the listing").into_iter().find(|p| p.req_id == req).map(|p| p.state)
}

#[test]
fn a_tenants_unread_window_releases_its_orphans_and_never_a_claimed_one() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let cfg = d.join("pdstor.toml");
    std::fs::write(&cfg, config("unread_release_ms = 400")).expect("the config");
    let timeline = d.join("timeline.jsonl");
    let target = pdstor_tests::format_file(d, 8, SLOT);
    let path = |p: &Path| p.to_str().expect("a UTF-8 path").to_owned();
    let daemon = Daemon::start_with(&target, d, &["--config", &path(&cfg), "--timeline", &path(&timeline)]);
    let c = Client::new(&daemon.server);

    let claimed = put(&daemon, "claimed", 1);
    c.claim(&claimed, "decode-0", "s-0", 600_000).expect("a claim");
    put(&daemon, "orphan", 2);
    let published = Instant::now();
    daemon.eventually("the orphan is released", || state(&c, "orphan").is_none().then_some(()));
    assert!(published.elapsed() >= Duration::from_millis(400), "not before its window");
    std::thread::sleep(Duration::from_millis(1_200));
    assert_eq!(state(&c, "claimed").as_deref(), Some("CLAIMED"), "a claimed publication is never released by time");

    let lines = pdstor_client::timeline::read(&timeline).expect("the timeline");
    let expired: Vec<(String, String)> = lines
        .iter()
        .filter_map(|(_, e)| e.as_ref().ok().filter(|e| e.event == "expire"))
        .map(|e| (e.req_id.clone().unwrap_or_default(), e.detail.clone().unwrap_or_default()))
        .collect();
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!(expired[0].0, "orphan");
    assert!(expired[0].1.contains("unread for 400 ms (its tenant's unread_release_ms)"), "{expired:?}");

    // The operator takes the window away; SIGHUP: the next orphan is kept.
    std::fs::write(&cfg, config("evict_unread = false")).expect("the config without a window");
    daemon.hangup();
    daemon.eventually("the reload", || {
        std::fs::read_to_string(&daemon.log).is_ok_and(|l| l.contains("reloaded the config")).then_some(())
    });
    put(&daemon, "kept", 3);
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(state(&c, "kept").as_deref(), Some("READY"), "no window: kept until its writer or an operator acts");
}
