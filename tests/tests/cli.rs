//! The `pdstor` binary as a user runs it: a round trip in one process checked
//! from another (dd), the bench's JSON, and errors that say what went wrong.

use std::process::Command;

use pdstor::payload;
use pdstor_tests::{dd_direct, pdstor_bin};

#[test]
fn roundtrip_bytes_are_what_another_process_reads() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("kv.img");
    let out = Command::new(pdstor_bin())
        .args(["roundtrip", "--chunks", "6", "--chunk-size", "1M", "--seed", "42", "--json", "--target"])
        .arg(&target)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["bytes"], 6 << 20);
    assert_eq!(report["path"], "host_fixed");
    assert_eq!(report["verified_independently"], true);
    for chunk in 0..6u64 {
        let on_disk = dd_direct(&target, chunk << 20, 1 << 20);
        assert_eq!(on_disk, payload::chunk(42, chunk, 1 << 20), "chunk {chunk} as dd reads it");
    }
}

#[test]
fn bench_reports_one_json_object_with_fio_names() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("bench.img");
    for pattern in ["write", "randread"] {
        let out = Command::new(pdstor_bin())
            .args(["bench", "--json", "--bs", "64k", "--qd", "4", "--size", "4M", "--pattern", pattern, "--target"])
            .arg(&target)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["pattern"], pattern);
        assert_eq!(r["ios"], 64);
        assert_eq!(r["bytes"], 4 << 20);
        assert!(r["lat_us"]["p99"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn errors_name_the_input_and_exit_nonzero() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = Command::new(pdstor_bin()).arg("info").arg("--target").arg(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&dir.path().display().to_string()) && err.contains("is a directory"), "{err}");

    let out = Command::new(pdstor_bin()).args(["bench", "--bs", "4q", "--target", "x"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"));
}

#[test]
fn format_inspect_and_refusing_to_overwrite_a_namespace() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("ns.img");
    let run = |args: &[&str]| Command::new(pdstor_bin()).args(args).arg("--target").arg(&target).output().unwrap();
    let out = run(&["format", "--size", "64M", "--chunk-slot", "1M", "--journal", "1M"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let f: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f["slot_size"], 1 << 20);
    assert!(f["slot_count"].as_u64().unwrap() > 50);
    for expected_epoch in [1, 2] {
        let out = run(&["inspect"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let i: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(i["namespace"], f["uuid"]);
        assert_eq!(i["epoch"], expected_epoch, "each open bumps the epoch");
    }
    let out = run(&["format"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("a pdstor namespace"));
    let out = run(&["roundtrip", "--chunks", "1", "--chunk-size", "1M"]);
    assert!(!out.status.success(), "roundtrip would overwrite the namespace");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
}
