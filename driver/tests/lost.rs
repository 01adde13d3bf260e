//! An owner whose namespace was taken over (issue 35) stops serving and
//! acknowledges nothing more. The takeover's preempt is played by the
//! store's fault plan in this process ([`FaultPlan::fence`]: from then on
//! the "target" refuses the owner's every command as a reservation
//! conflict, `EBADE`, as an NVMe target refuses a preempted host); the real
//! preempt, on an NVMe/TCP target with reservations, is the topology suite's.
//! The daemon is the real one, over real sockets; the test sends SIGTERM to
//! itself to stop it, so it lives alone in this file.

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_client::{ClientError, Writer};
use pdstor_daemon::store::{FaultPlan, Phase};

mod common;

fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.get(url).call().expect("the daemon answers");
    let mut body = String::new();
    let _ = r.body_mut().as_reader().read_to_string(&mut body);
    (r.status().as_u16(), body)
}

fn code(body: &str) -> String {
    serde_json::from_str::<pdstor_client::wire::ErrorBody>(body).map(|e| e.code).unwrap_or_else(|_| body.to_owned())
}

#[test]
fn an_owner_fenced_by_a_takeover_acknowledges_nothing_more_and_says_so() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let fault = FaultPlan::die_after_writes(1 << 40, false);
    let common::InProcess { target, server, socket, daemon } = common::serve_in_process(dir.path(), fault.clone());
    let layout = Layout {
        model_id: "lost".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "lost".into(),
    };
    let bytes = |seed: u64| pdstor_engine::payload::chunk(seed, 0, 1 << 20);
    // Acknowledged before the takeover: it must survive it.
    let mut w1 = Writer::new(&server, &socket, 1 << 20, 1).unwrap();
    let kept = w1.put("before", &layout, &bytes(1), 1, Some(7)).unwrap();

    fault.fence();
    let mut w = Writer::new(&server, &socket, 1 << 20, 1).unwrap();
    match w.put("after", &layout, &bytes(2), 1, Some(7)) {
        Err(ClientError::Api(e)) => assert!(e.status == 503 || e.status >= 500, "{e}"),
        other => panic!("a put after the preempt was not refused: {other:?}"),
    }
    // Every route says so — health first — but the metrics.
    for path in ["/healthz", "/readyz", "/storage-pd/namespace", "/storage-pd/publications"] {
        let (status, body) = get(&format!("{server}{path}"));
        assert_eq!((status, code(&body)), (503, "namespace_lost".to_owned()), "{path}: {body}");
        assert!(body.contains("another owner preempted"), "{path}: {body}");
    }
    let (status, body) = get(&format!("{server}/metrics"));
    assert_eq!(status, 200, "{body}");
    let e = pdstor_client::Client::new(&server).claim(&kept.receipt, "r", "s", 60_000).unwrap_err();
    assert!(matches!(&e, ClientError::Api(b) if b.code == "namespace_lost"), "{e}");

    drop((w1, w)); // their data connections hold the daemon's store while open
    // SAFETY: kill(2) on this process; the daemon's handler takes SIGTERM.
    unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGTERM) };
    let err = daemon.join().unwrap().expect_err("serve returned Ok after its namespace was lost");
    assert!(err.to_string().contains("taken over"), "{err:#}");

    // The new owner finds what was acknowledged, and nothing after it.
    // (The kernel releases the old owner's descriptor — and its lock — when
    // its io_uring's teardown ends, a moment after the daemon returned.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let seen = loop {
        match pdstor_daemon::store::inspect(&target) {
            Err(e) if e.to_string().contains("lock") && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => break other.unwrap(),
        }
    };
    let ready: Vec<_> = seen.publications.iter().filter(|p| p.phase == Phase::Ready).collect();
    assert_eq!(ready.len(), 1, "{:?}", seen.publications);
    assert_eq!(ready[0].req_id, "before");
    let c = &ready[0].manifest.as_ref().unwrap().chunks[0];
    let mut got = vec![0u8; c.len as usize];
    std::fs::File::open(&target).unwrap().read_exact_at(&mut got, c.offset.0).unwrap();
    assert!(got == bytes(1), "the acknowledged publication's bytes differ on the media");
}
