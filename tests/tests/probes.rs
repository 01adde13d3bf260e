//! The provenance probes on this host's kernel, tracepoints only: positive
//! and negative controls. Needs root (BPF); says SKIP otherwise.

use std::os::fd::AsRawFd;

use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath, payload};
use pdstor_probes::{Declared, Probes, TargetClass, Verdict, judge};

use pdstor_testkit::{is_root, skip};

/// The tests here run one at a time: another test's I/O on the same disk
/// can keep the device queue busy, so the block layer issues our request
/// from kblockd instead of the submitting thread, where the probe does not
/// charge it to the transfer.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// One test, so the controls do not see each other's transfers.
#[test]
fn provenance_controls_on_the_host_kernel() {
    let _serial = serial();
    if !is_root() {
        return skip("provenance_controls_on_the_host_kernel", "BPF needs root");
    }
    // As root the probes must attach (pdstor mounts tracefs itself): an
    // error here is a failure, never a skip.
    let probes = Probes::attach(std::process::id()).unwrap_or_else(|e| panic!("attaching as root: {e}"));
    let a = probes.attached();
    assert!(a.io_uring, "io_uring tracepoints attach here: {:?}", probes.status());
    // The in-kernel decision helper, run with BPF_PROG_TEST_RUN on a raw_tp harness.
    use io_uring::opcode as opc;
    for (code, kind) in [
        (opc::ReadFixed::CODE, 1),
        (opc::WriteFixed::CODE, 1),
        (opc::Read::CODE, 2),
        (opc::Write::CODE, 2),
        (opc::Readv::CODE, 2),
        (opc::UringCmd80::CODE, 3),
        (opc::Fsync::CODE, 0),
        (opc::Nop::CODE, 0),
    ] {
        assert_eq!(probes.test_op_kind(code).unwrap(), kind, "opcode {code}");
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();

    // Positive: host_fixed, O_DIRECT on a file.
    let path = dir.path().join("direct.img");
    let t = Target::open(&path, &TargetOptions { create_len: Some(4 << 20), ..Default::default() }).unwrap();
    let mut engine = Engine::new(t, EngineOptions::default()).unwrap();
    let fixed = engine.register(Buffer::host(1 << 20).unwrap()).unwrap();
    let plain = engine.add(Buffer::host(1 << 20).unwrap()).unwrap();
    engine.buffer(fixed).unwrap().write_at(0, &payload::chunk(1, 0, 1 << 20)).unwrap();
    let req = |transfer, op, path, buffer| IoRequest {
        transfer: TransferId(transfer),
        op,
        path,
        buffer,
        buffer_offset: pdstor_engine::io::BufferOffset(0),
        target_offset: pdstor_engine::io::TargetOffset(0),
        len: 1 << 20,
    };
    engine.execute_all(&[req(1001, Op::Write, PayloadPath::HostFixed, fixed)]).unwrap();
    let s = probes.signals(1001).unwrap().expect("the write was seen");
    assert_eq!(s.fixed_ops, 1, "{s:?}");
    assert!(
        s.rq_issued > 0 && s.requests_all_completed() && s.rq_errors == 0,
        "block requests issued and completed: {s:?}"
    );
    let v = judge(Declared::HostFixed, TargetClass::File, &s, &a);
    if a.iomap_dio {
        assert_eq!(v, Verdict::Native, "{s:?}");
    } else {
        assert!(matches!(v, Verdict::Unverifiable(_)), "{v}");
    }

    // Control: a plain READ into an unregistered buffer is not counted as fixed.
    let before = probes.counters().unwrap();
    engine.execute_all(&[req(1002, Op::Read, PayloadPath::Host, plain)]).unwrap();
    let s = probes.signals(1002).unwrap().expect("the read was seen");
    assert_eq!((s.fixed_ops, s.plain_ops), (0, 1), "{s:?}");
    assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &a), Verdict::Fallback("not-fixed".into()));
    let after = probes.counters().unwrap();
    assert_eq!(after[1], before[1], "the fixed counter did not move");
    assert_eq!(after[0], before[0] + 1, "the plain counter did");
    drop(engine);

    // Negative: the same bytes written without O_DIRECT go through the page cache.
    let buffered = dir.path().join("buffered.img");
    let file = std::fs::File::create(&buffered).unwrap();
    let data = payload::chunk(1, 0, 1 << 20);
    let mut ring = io_uring::IoUring::new(4).unwrap();
    let sqe = io_uring::opcode::Write::new(io_uring::types::Fd(file.as_raw_fd()), data.as_ptr(), data.len() as u32)
        .offset(0)
        .build()
        .user_data(2001 << 16);
    // SAFETY: `data` outlives the submission, which completes before it drops.
    unsafe { ring.submission().push(&sqe).unwrap() };
    ring.submit_and_wait(1).unwrap();
    let cqe = ring.completion().next().unwrap();
    assert_eq!(cqe.result(), data.len() as i32);
    let s = probes.signals(2001).unwrap().expect("the buffered write was seen");
    assert!(s.page_cache_adds > 0, "page-cache insertions are seen: {s:?}");
    assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &a), Verdict::Fallback("page-cache".into()));
    assert_eq!(judge(Declared::Host, TargetClass::File, &s, &a), Verdict::Fallback("page-cache".into()));
}

/// `pdstor serve --provenance`: every stored and loaded chunk comes back with
/// its observed verdict, and /metrics counts them.
#[test]
fn the_daemon_stamps_each_transfer_with_its_verdict() {
    let _serial = serial();
    if !is_root() {
        return skip("the_daemon_stamps_each_transfer_with_its_verdict", "BPF needs root");
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("ns.img");
    let out = std::process::Command::new(pdstor_tests::pdstor_bin())
        .args(["format", "--size", "64M", "--chunk-slot", "1M", "--journal", "1M", "--target"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(out.status.success());
    let d = pdstor_tests::Daemon::start_with(&target, dir.path(), &["--provenance", "--require-native"]);
    let c = pdstor_client::Client::new(&d.server);
    let layout = pdstor_client::layout::Layout {
        model_id: "p".into(),
        dtype: "bf16".into(),
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
        chunk_tokens: 256,
        kv_format: "p".into(),
    };
    let mut data = pdstor_client::DataConn::connect(&d.data_socket).unwrap();
    let buf = Buffer::memfd("p", 2 << 20).unwrap();
    buf.write_at(0, &payload::chunk(3, 0, 2 << 20)).unwrap();
    let b = data.register(&buf).unwrap();
    let chunk = |i: u32| pdstor_client::wire::DataChunk {
        index: i,
        buffer: b,
        offset: i as u64 * (1 << 20),
        len: 1 << 20,
        crc32c: None,
    };
    let p = c.prepare("prov", &layout, 2, "w").unwrap();
    let stored = data.store(p.publication, &p.writer_token, vec![chunk(0), chunk(1)], true, 2).unwrap();
    assert_eq!(stored.verdicts, vec!["native", "native"], "{stored:?}");
    let published = c.publish(p.publication, &p.writer_token, None).unwrap();
    let claim = c.claim(&published.receipt, "r", "s", 60_000).unwrap();
    let adopt = pdstor_client::wire::AdoptRequest::of_claim(&claim, layout.clone());
    c.adopt(&adopt).unwrap();
    let loaded = data.load(&claim, vec![chunk(0), chunk(1)]).unwrap();
    assert_eq!(loaded.verdicts, vec!["native", "native"], "{loaded:?}");
    let m = c.metrics().unwrap();
    assert!(m.contains("pdstor_verdicts_total{path=\"host_fixed\",verdict=\"native\"} 4"), "{m}");
}

/// Runs `script` with `sh` in a private mount namespace where tracefs,
/// debugfs (whose `tracing` directory would mount tracefs on access) and bpffs
/// are unmounted: a fresh machine's view, whatever this one has mounted.
fn in_bare_namespace(script: &str) -> std::process::Output {
    let prelude = "umount -l /sys/kernel/debug 2>/dev/null; umount -l /sys/kernel/tracing 2>/dev/null; \
                   umount -l /sys/fs/bpf 2>/dev/null; \
                   if [ -d /sys/kernel/tracing/events ]; then echo 'tracefs still mounted' >&2; exit 90; fi; ";
    std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!("{prelude}{script}"))
        .output()
        .expect("running unshare")
}

/// `pdstor probe attach --pin` on a machine without tracefs: as root it mounts
/// tracefs, says so, attaches and pins; as another user it fails naming
/// tracefs and the command that mounts it.
#[test]
fn probe_attach_mounts_tracefs_when_it_is_absent() {
    let _serial = serial();
    const TEST: &str = "probe_attach_mounts_tracefs_when_it_is_absent";
    if !is_root() {
        return skip(TEST, "needs root (mount namespaces, BPF)");
    }
    // A copy every user can run (a clone under /root is not traversable by others).
    let dir = tempfile::Builder::new().prefix("pdstor-tracefs").tempdir_in("/tmp").unwrap();
    let bin = dir.path().join("pdstor");
    std::fs::copy(pdstor_tests::pdstor_bin(), &bin).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let bin = bin.display();

    // The namespace's own bpffs (and the pins in it) goes when the namespace does.
    let out = in_bare_namespace(&format!(
        "{bin} probe attach --pin && test -d /sys/kernel/tracing/events && test -e /sys/fs/bpf/pdstor/signals"
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "probe attach --pin without tracefs, as root: {:?}\n{stderr}", out.status);
    assert_eq!(
        stderr.matches("mounted tracefs at /sys/kernel/tracing").count(),
        1,
        "says once that it mounted tracefs: {stderr}"
    );
    let attached: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for p in attached["programs"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        if !["kprobe:", "kretprobe:", "fentry:", "fexit:", "raw_tp:"].iter().any(|kind| name.starts_with(kind)) {
            assert_eq!(p["attached"], true, "every tracepoint attaches once tracefs is mounted: {p}");
        }
    }

    let out =
        in_bare_namespace(&format!("setpriv --reuid 65534 --regid 65534 --clear-groups {bin} probe attach --pin"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "as uid 65534 without tracefs: {stderr}");
    assert!(
        stderr.contains("tracefs") && stderr.contains("mount -t tracefs tracefs /sys/kernel/tracing"),
        "the error names tracefs and how to mount it: {stderr}"
    );
    assert!(!stderr.contains("failed to attach BPF program"), "{stderr}");
}
