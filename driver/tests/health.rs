//! Health that tells the truth (issue 13 item 7): `/healthz` and `/readyz`
//! answer 200 while the store accepts changes and 503, in the JSON error
//! shape, once it has failed; the daemon then exits non-zero on SIGTERM.
//! The device is failed by the store's fault plan, in this process: the
//! test sends SIGTERM to itself, which the daemon's handler takes.

use pdstor_client::layout::Layout;
use pdstor_client::{ClientError, Writer};
use pdstor_daemon::store::FaultPlan;

mod common;

fn get(url: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let mut r = agent.get(url).call().expect("the daemon answers");
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap_or_default())
}

#[test]
fn health_turns_503_when_the_store_fails_and_the_exit_status_says_so() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Opening takes a handful of writes (the epoch bump); the device dies a
    // few puts later.
    let fault = FaultPlan::die_after_writes(16, false);
    let common::InProcess { server, socket, daemon, .. } = common::serve_in_process(dir.path(), fault.clone());
    assert_eq!(get(&format!("{server}/healthz")).0, 200);
    let (status, body) = get(&format!("{server}/readyz"));
    assert_eq!(status, 200, "{body}");
    let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((ready["ready"].as_bool(), ready["provenance"].as_str()), (Some(true), Some("off")), "{body}");

    let layout = Layout {
        model_id: "h".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "h".into(),
    };
    let mut failure = None;
    for i in 0..200 {
        let mut w = Writer::new(&server, &socket, 1 << 20, 1).unwrap();
        match w.put(&format!("r{i}"), &layout, &pdstor_engine::payload::chunk(i, 0, 1 << 20), 1, None) {
            Ok(_) => continue,
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    assert!(fault.is_dead(), "the device never failed: {failure:?}");
    assert!(matches!(&failure, Some(ClientError::Api(e)) if e.status >= 500), "{failure:?}");
    // Every later change is refused, and both probes say so in JSON.
    let (status, body) = get(&format!("{server}/healthz"));
    assert_eq!(status, 503, "{body}");
    let e: pdstor_client::wire::ErrorBody = serde_json::from_str(&body).unwrap();
    assert_eq!(e.code, "store_failed", "{body}");
    let (status, body) = get(&format!("{server}/readyz"));
    assert_eq!(status, 503, "{body}");
    let e: pdstor_client::wire::ErrorBody = serde_json::from_str(&body).unwrap();
    assert!(e.code == "not_ready" && e.message.contains("failed"), "{body}");

    // SIGTERM: a clean stop, but not a successful one.
    // SAFETY: kill(2) on this process; the daemon's handler takes SIGTERM.
    unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGTERM) };
    let result = daemon.join().unwrap();
    let err = result.expect_err("serve returned Ok after the store failed");
    assert!(err.to_string().contains("the store failed during this run"), "{err:#}");
}
