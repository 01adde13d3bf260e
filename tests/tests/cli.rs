//! The `pdstor` command line against a real daemon: exit codes that tell a
//! usage error, a refusal and a failure apart; the writer's identity; one-call
//! get + ack; a publication's extents.

use std::path::Path;
use std::process::{Command, Output};

use pdstor_tests::{Daemon, pdstor_bin};

const SLOT: u64 = 1 << 20;

fn pdstor(args: &[&str]) -> Output {
    Command::new(pdstor_bin()).args(args).output().expect("running pdstor")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Writes a layout and a payload of `chunks` seeded 1 MiB chunks into `dir`.
fn inputs(dir: &Path, chunks: u64) -> (String, String) {
    let layout = dir.join("layout.json");
    std::fs::write(
        &layout,
        r#"{"model_id":"m","dtype":"bf16","layers":2,"kv_heads":2,"head_dim":64,"chunk_tokens":16,"kv_format":"t"}"#,
    )
    .unwrap();
    let from = dir.join(format!("kv-{chunks}.bin"));
    let bytes: Vec<u8> = (0..chunks).flat_map(|i| pdstor_engine::payload::chunk(7, i, SLOT as usize)).collect();
    std::fs::write(&from, bytes).unwrap();
    (layout.display().to_string(), from.display().to_string())
}

fn put(d: &Daemon, dir: &Path, req: &str, writer: &str, chunks: u64) -> Output {
    let (layout, from) = inputs(dir, chunks);
    let socket = d.data_socket.display().to_string();
    pdstor(&[
        "put",
        "--server",
        &d.server,
        "--data-socket",
        &socket,
        "--req",
        req,
        "--writer",
        writer,
        "--layout",
        &layout,
        "--from",
        &from,
        "--chunk-size",
        "1M",
    ])
}

#[test]
fn a_usage_error_is_not_a_refusal() {
    let out = pdstor(&["publications", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(64), "usage error: EX_USAGE, {}", text(&out.stderr));
    assert!(text(&out.stderr).contains("--no-such-flag"));
    let out = pdstor(&["put", "--req", "r", "--layout", "l", "--from", "f", "--path", "gpu"]);
    assert_eq!(out.status.code(), Some(64), "a value outside the listed ones: {}", text(&out.stderr));
    let out = pdstor(&["put", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    assert!(help.contains("--writer") && help.contains("[possible values: host, host_fixed, dmabuf_fixed]"), "{help}");
    let out = pdstor(&["claim", "--help"]);
    assert!(!text(&out.stdout).contains("--data-socket"), "claim never uses the data plane");
    assert_eq!(pdstor(&["--version"]).status.code(), Some(0));
}

#[test]
fn abort_of_an_unknown_publication_is_a_refusal() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let out = pdstor(&["abort", "--server", &d.server, "--publication", "4242", "--writer-token", "00"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.starts_with("pdstor: refused: 404 unknown_publication (publication): publication 4242"), "{err}");
    assert!(out.stdout.is_empty(), "no outcome printed: {}", text(&out.stdout));
}

/// A 5xx is the daemon failing, not refusing: "failed", exit 3. An admission
/// timeout (the store full of a READY publication) is one.
#[test]
fn a_daemon_failure_is_printed_as_failed() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("t.img");
    let out = pdstor(&[
        "format",
        "--journal",
        "256k",
        "--chunk-slot",
        "1M",
        "--size",
        &(2 * 4096 + 2 * (256 << 10) + 2 * SLOT).to_string(),
        "--target",
        &target.display().to_string(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The test daemon waits 2 s for capacity, then answers 503.
    let d = Daemon::start(&target, dir.path());
    let out = put(&d, dir.path(), "fills", "prefill-0", 2);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = put(&d, dir.path(), "waits", "prefill-1", 1);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.starts_with("pdstor: failed: 503 "), "{err}");
    assert!(!err.contains("refused"), "{err}");
}

#[test]
fn put_names_its_writer_get_acks_and_publications_show_extents() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let out = put(&d, dir.path(), "req-7", "prefill-7", 3);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let ready = dir.path().join("ready.json");
    std::fs::write(&ready, &out.stdout).unwrap();

    let list: serde_json::Value =
        serde_json::from_slice(&pdstor(&["publications", "--server", &d.server]).stdout).unwrap();
    assert_eq!(list[0]["writer"], "prefill-7", "{list}");
    assert!(list[0].get("extents").is_none(), "extents only with --verbose: {list}");

    let out = pdstor(&["publications", "--server", &d.server, "--verbose", "--state", "ready"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let extents = list[0]["extents"].as_array().unwrap_or_else(|| panic!("{list}"));
    assert_eq!(extents.len(), 3);
    let mut offsets = std::collections::BTreeSet::new();
    for (i, e) in extents.iter().enumerate() {
        assert_eq!(e["chunk"], i as u64);
        assert_eq!(e["len"], SLOT);
        // The extent is where the bytes are: read them there, outside pdstor.
        let offset = e["offset"].as_u64().unwrap();
        offsets.insert(offset);
        let on_disk = pdstor_testkit::dd_direct(&d.target, offset, SLOT);
        assert_eq!(on_disk, pdstor_engine::payload::chunk(7, i as u64, SLOT as usize), "chunk {i} at byte {offset}");
        assert_eq!(e["crc32c"], crc32c::crc32c(&on_disk));
    }
    assert_eq!(offsets.len(), 3, "distinct extents");

    let out = pdstor(
        &["claim", "--server", &d.server, "--reader", "decode-1", "--session", "s1", "--receipt"]
            .into_iter()
            .chain([ready.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let claim = dir.path().join("claim.json");
    std::fs::write(&claim, &out.stdout).unwrap();
    let restored = dir.path().join("restored.bin");
    let (layout, from) = inputs(dir.path(), 3);
    let socket = d.data_socket.display().to_string();
    let out = pdstor(&[
        "get",
        "--server",
        &d.server,
        "--data-socket",
        &socket,
        "--claim",
        claim.to_str().unwrap(),
        "--layout",
        &layout,
        "--out",
        restored.to_str().unwrap(),
        "--ack",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["acked"], true);
    assert_eq!(std::fs::read(&restored).unwrap(), std::fs::read(&from).unwrap());
    let list: serde_json::Value =
        serde_json::from_slice(&pdstor(&["publications", "--server", &d.server]).stdout).unwrap();
    assert_eq!(list, serde_json::json!([]), "acknowledged in the same call: nothing left");
}

/// `pdstor bench-store --handoffs`: every publication goes through claim,
/// adopt, load and ack; alone that is three commits each (the publish's,
/// the CLAIM's and the ACK's: the ADOPT of a reader loading through the
/// daemon rides on the ACK's) and one flush (the payload's, before the
/// PUBLISH record; every journal write goes with Force Unit Access), and
/// concurrent threads share commits through group commit.
#[test]
fn bench_store_runs_whole_handoffs_and_readers_share_flushes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("bench-store.img");
    let run = |writers: &str| -> serde_json::Value {
        let out = pdstor(&[
            "bench-store",
            "--json",
            "--handoffs",
            "--target",
            target.to_str().unwrap(),
            "--writers",
            writers,
            "--publications",
            "64",
            "--chunk",
            "64k",
        ]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let alone = run("1");
    assert_eq!(alone["after_publish"], "claim+adopt+load+ack");
    assert_eq!(alone["publications"], 64);
    assert_eq!(alone["flushes_per_publication"].as_f64(), Some(1.0), "{alone}");
    // Three per publication, and whatever the run's own set-up commits.
    let commits = alone["commit_groups_per_publication"].as_f64().unwrap();
    assert!((3.0..3.1).contains(&commits), "{alone}");
    let shared = run("16");
    assert!(shared["commit_groups_per_publication"].as_f64().unwrap() < 3.0, "group commit shares commits: {shared}");
    assert!(shared["flushes_per_publication"].as_f64().unwrap() <= 1.0, "{shared}");
    assert!(!target.exists(), "the scratch target is removed");
}

/// `pdstor bench-handoff --reloads --copy-out`: each reload copied out of the
/// reader's buffer into its own memory, checked in that copy (or, with
/// `--no-verify`, a plain copy); the report says so and times every reload,
/// with the CPU the daemon and the reader spent.
#[test]
fn bench_handoff_copies_reloads_out_checked_or_plain() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let socket = d.data_socket.display().to_string();
    for unverified in [false, true] {
        let mut args = vec!["bench-handoff", "--json", "--server", &d.server, "--data-socket", &socket];
        args.extend(["--bytes", "4M", "--chunk", "1M", "--rounds", "1", "--latency-samples", "0"]);
        args.extend(["--reloads", "2", "--copy-out"]);
        if unverified {
            args.push("--no-verify");
        }
        let out = pdstor(&args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["reload_copy_out"], true, "{r}");
        assert_eq!(r["reload_seconds"].as_array().map(Vec::len), Some(2), "{r}");
        assert!(r["reload_cpu"]["total_s_per_gib"].as_f64().is_some(), "{r}");
    }
}
