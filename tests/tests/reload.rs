//! Reloading the config without a restart (issue 54), on a real daemon over
//! its Unix control socket, where clients keep their connections alive.
//! A reload under load — on SIGHUP and on the file's change, many times —
//! loses no step: every handoff running meanwhile restores byte for byte.
//! A kept-alive connection's next request is judged by the new rules (no new
//! connection needed), and with `--reload-check-ms 0` only SIGHUP reloads.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_client::{Client, ClientError, Reader, Writer};
use pdstor_engine::payload;
use pdstor_tests::Daemon;

const SLOT: u64 = 256 << 10;

fn layout() -> Layout {
    Layout {
        model_id: "reload".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 64,
        kv_format: "pdstor-reload".into(),
    }
}

/// This user as tenant `team-a` with `roles`, its quota `slots`.
fn config(roles: &str, slots: u64) -> String {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    format!(
        "[[principal]]\ntenant = \"team-a\"\nroles = [{roles}]\nuids = [{me}]\n\n[tenant.team-a.quota]\nslots = {slots}\n"
    )
}

fn sample(c: &Client, series: &str) -> u64 {
    let m = c.metrics().expect("the metrics");
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .map_or(0, |v| v.parse::<f64>().expect("a number") as u64)
}

/// One handoff of `chunks` chunks: put, claim, get, compare, ack.
fn handoff(c: &Client, server: &str, data: &Path, req: &str, seed: u64, chunks: u32) -> Result<(), ClientError> {
    let kv: Vec<u8> = (0..chunks as u64).flat_map(|i| payload::chunk(seed, i, SLOT as usize)).collect();
    let mut w = Writer::new(server, data, SLOT, chunks)?;
    let p = w.put(req, &layout(), &kv, 2, None)?;
    let claim = c.claim(&p.receipt, "decode-0", &format!("s-{req}"), 60_000)?;
    let mut r = Reader::new(server, data)?;
    let restored = r.get(&claim, &layout())?;
    assert_eq!(r.restored_bytes(restored.len)?, kv, "{req} restored byte for byte");
    c.ack(&claim, &restored.restore_digest)
}

fn await_applied(d: &Daemon, c: &Client, n: u64) {
    d.eventually("the reloads applied", || (sample(c, "pdstor_reloads_total{result=\"applied\"}") >= n).then_some(()));
}

#[test]
fn a_reload_under_load_loses_no_step_and_the_next_request_is_judged_by_the_new_rules() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let d = dir.path();
    let cfg = d.join("pdstor.toml");
    let all = "\"writer\", \"reader\", \"admin\"";
    std::fs::write(&cfg, config(all, 48)).expect("the config");
    let target = pdstor_tests::format_file(d, 64, SLOT);
    let daemon = Daemon::start_with(&target, d, &["--config", cfg.to_str().expect("a UTF-8 path")]);
    let c = Client::new(&daemon.server);

    let done = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|w| {
            let (server, data, done) = (daemon.server.clone(), daemon.data_socket.clone(), done.clone());
            std::thread::spawn(move || {
                let c = Client::new(&server);
                let mut n = 0;
                while !done.load(Ordering::Relaxed) || n < 6 {
                    let req = format!("w{w}-{n}");
                    handoff(&c, &server, &data, &req, w * 1000 + n, 1 + (n % 4) as u32)
                        .unwrap_or_else(|e| panic!("{req} failed while the daemon reloaded: {e}"));
                    n += 1;
                }
                n
            })
        })
        .collect();
    // Reloads all through: the quota's slots change on the file alone, then on SIGHUP.
    let (mut changes, started) = (0u64, Instant::now());
    while started.elapsed() < Duration::from_secs(6) {
        changes += 1;
        std::fs::write(&cfg, config(all, 48 + changes % 2)).expect("a new config");
        if changes % 2 == 0 {
            daemon.hangup();
        }
        std::thread::sleep(Duration::from_millis(if changes % 2 == 0 { 150 } else { 1_300 }));
    }
    await_applied(&daemon, &c, 3);
    done.store(true, Ordering::Relaxed);
    let handoffs: u64 = workers.into_iter().map(|w| w.join().expect("no step was lost")).sum();
    assert!(handoffs >= 18, "{handoffs} handoffs");
    assert_eq!(sample(&c, "pdstor_reloads_total{result=\"failed\"}"), 0);
    assert!(c.publications(None, false).expect("the listing").is_empty(), "every handoff was acknowledged");

    drop(daemon);

    // With --reload-check-ms 0 only SIGHUP reloads: this user is left a
    // reader only, and its kept-alive connection's next request is refused
    // by the new rules — on that same connection, as every request after it
    // (no new connection is made).
    let d = &d.join("sighup-only");
    std::fs::create_dir(d).expect("a directory");
    let target = pdstor_tests::format_file(d, 4, SLOT);
    std::fs::write(&cfg, config(all, 48)).expect("the config");
    let daemon =
        Daemon::start_with(&target, d, &["--config", cfg.to_str().expect("a UTF-8 path"), "--reload-check-ms", "0"]);
    let c = Client::new(&daemon.server);
    let accepted = sample(&c, "pdstor_control_connections_total");
    std::fs::write(&cfg, config("\"reader\"", 48)).expect("the demoted config");
    std::thread::sleep(Duration::from_millis(2_500));
    assert_eq!(sample(&c, "pdstor_reloads_total{result=\"applied\"}"), 0, "no SIGHUP, no reload");
    daemon.hangup();
    daemon.eventually("the reload to take effect", || {
        (matches!(c.cancel("nothing"), Err(ClientError::Api(e)) if e.code == "forbidden")).then_some(())
    });
    match c.prepare("demoted", &layout(), 1, "w") {
        Err(ClientError::Api(e)) => {
            assert_eq!((e.status, e.code.as_str()), (403, "forbidden"), "{e}");
            assert!(e.message.contains("has reader and prepare needs the writer role"), "{e}");
        }
        other => panic!("a writer the reload demoted prepared: {other:?}"),
    }
    std::fs::write(&cfg, config(all, 48)).expect("the config again");
    daemon.hangup();
    daemon.eventually("the reload to take effect", || (c.metrics().is_ok()).then_some(()));
    assert_eq!(sample(&c, "pdstor_control_connections_total"), accepted, "every request came on the kept connection");
}
