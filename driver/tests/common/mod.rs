//! What the store's integration tests share: the layout they publish with,
//! and a daemon run in the test's own process. What they ask of the machine
//! (a skip, loop devices, zram) is `pdstor-testkit`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The KV layout the store tests publish with.
pub fn layout() -> pdstor_client::layout::Layout {
    pdstor_client::layout::Layout {
        model_id: "test-model".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

/// A real daemon run in this process (`pdstor_daemon::api::serve` on a thread) on a
/// 16 MiB file target of 1 MiB slots, its control plane on plaintext
/// loopback TCP, its device failing as `fault` says. Its tests stop it by
/// sending SIGTERM to their own process, so each lives alone in its file.
pub struct InProcess {
    pub target: PathBuf,
    /// `http://127.0.0.1:PORT`.
    pub server: String,
    pub socket: PathBuf,
    pub daemon: std::thread::JoinHandle<anyhow::Result<()>>,
}

pub fn serve_in_process(dir: &Path, fault: std::sync::Arc<pdstor_daemon::store::FaultPlan>) -> InProcess {
    use std::time::{Duration, Instant};
    let target = dir.join("ns.img");
    pdstor_daemon::store::format(
        &target,
        &pdstor_daemon::store::FormatOptions {
            slot_size: 1 << 20,
            journal_half: 256 << 10,
            force: false,
            create_len: Some(2 * 4096 + 2 * (256 << 10) + (16 << 20)),
        },
    )
    .expect("format");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let socket = dir.join("data.sock");
    let cfg = pdstor_daemon::api::ServeConfig {
        target: target.clone(),
        listen: pdstor_daemon::api::Listen::Tcp(format!("127.0.0.1:{port}").parse().unwrap()),
        data_socket: socket.clone(),
        queue_depth: 8,
        merge_bytes: pdstor_daemon::store::DEFAULT_MERGE_BYTES,
        verify_threads: 0,
        admission_timeout: Duration::from_secs(2),
        provenance: false,
        require_native: false,
        timeline: None,
        reservation_key: None,
        owner_check: Duration::from_millis(250),
        standby: None,
        fault: Some(fault),
        limits: Default::default(),
        allow_readable_target: false,
        // Plaintext TCP, asked for by name: the caller is taken to be this user.
        insecure_tcp: true,
        config: Default::default(),
        reload_check: None,
        tls: None,
    };
    let daemon = std::thread::spawn(move || pdstor_daemon::api::serve(cfg));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !socket.exists() {
        assert!(Instant::now() < deadline, "the daemon did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    InProcess { target, server: format!("http://127.0.0.1:{port}"), socket, daemon }
}
