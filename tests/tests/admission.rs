//! Admission as a serving engine drives it (issue 15): retries of a request
//! id, cancellation by request, clients that go away while they wait, streams
//! that end short, per-request timeouts. Each against the real daemon over
//! HTTP and the data socket; after each, every reservation is back and the
//! slots reconcile (`free + used + reserved == capacity`).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use pdstor_client::layout::Layout;
use pdstor_client::wire::CancelOutcome;
use pdstor_client::wire::{DataChunk, PrepareRequest};
use pdstor_client::{Client, ClientError, DataConn};
use pdstor_tests::Daemon;

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "admission".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-admission".into(),
    }
}

fn request(req: &str, chunks: u32, timeout_ms: Option<u64>) -> PrepareRequest {
    PrepareRequest {
        req_id: req.into(),
        layout: layout(),
        total_chunks: chunks,
        writer: "w".into(),
        timeout_ms,
        unread_release_ms: None,
        cache: false,
    }
}

/// The (status, code, message) of a refusal.
fn refusal<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (u16, String, String) {
    match r {
        Err(ClientError::Api(e)) => (e.status, e.code, e.message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// One gauge or counter from `/metrics`.
fn metric(c: &Client, name: &str) -> u64 {
    let m = c.metrics().unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{m}"))
}

/// Spins until `f` holds.
fn until(what: &str, f: impl Fn() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
        thread::sleep(Duration::from_millis(5));
    }
}

/// Every slot free again, nothing waiting, and the accounting never broke.
fn all_returned(c: &Client, capacity: u64) {
    assert_eq!(metric(c, "pdstor_slots{kind=\"free\"}"), capacity, "every slot is free again");
    assert_eq!(metric(c, "pdstor_slots{kind=\"reserved\"}"), 0, "nothing reserved");
    assert_eq!(metric(c, "pdstor_slots{kind=\"used\"}"), 0);
    assert_eq!(metric(c, "pdstor_slots_total_reserved"), 0);
    assert_eq!(metric(c, "pdstor_admission_waiting"), 0);
    assert_eq!(metric(c, "pdstor_invariant_violations_total"), 0, "the slots reconciled after every step");
}

/// Path 1: a repeated `req_id` while the first prepare waits used to be
/// admitted beside it and leak its slots for good. Now the repeat is
/// refused and changes nothing; and a repeat of a PREPARED request is
/// answered with the same publication.
#[test]
fn a_repeated_request_id_never_leaks_slots() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 10, SLOT);
    let c = Client::new(&d.server);
    let a = c.prepare("A", &layout(), 8, "w").unwrap();
    let server = d.server.clone();
    let waiter = thread::spawn(move || Client::new(&server).prepare_request(&request("D", 8, Some(2_000))));
    until("D waits", || metric(&c, "pdstor_admission_waiting") == 1);
    let (status, code, message) = refusal(c.prepare("D", &layout(), 2, "w"));
    assert_eq!((status, code.as_str()), (409, "duplicate_request"), "{message}");
    assert!(message.contains("already waiting for admission (8 chunks)"), "{message}");
    assert_eq!(metric(&c, "pdstor_slots{kind=\"free\"}"), 2, "the refused retry took nothing");
    c.abort(a.publication, &a.writer_token).unwrap();
    let d8 = waiter.join().unwrap().expect("the first D is admitted once A is aborted");
    // The other order: a retry of a PREPARED request with the same shape is
    // the same publication; with another shape it is refused.
    let again = c.prepare("D", &layout(), 8, "w").unwrap();
    assert_eq!(again.publication, d8.publication, "a retry is answered with the same publication");
    let (_, code, _) = refusal(c.prepare("D", &layout(), 3, "w"));
    assert_eq!(code, "duplicate_request");
    assert_eq!(metric(&c, "pdstor_slots{kind=\"used\"}"), 8, "retries changed nothing");
    c.abort(d8.publication, &d8.writer_token).unwrap();
    all_returned(&c, 10);
    c.prepare("all", &layout(), 10, "w").expect("the whole store is free again");
}

/// Path 2: a waiting prepare is cancelled by its request id (and so is a
/// PREPARED one); cancelling again is a clear no-op.
#[test]
fn cancel_by_request_refuses_a_waiter_and_rolls_back_a_prepared_request() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 10, SLOT);
    let c = Client::new(&d.server);
    c.prepare("hog", &layout(), 10, "w").unwrap();
    let server = d.server.clone();
    let waiter = thread::spawn(move || Client::new(&server).prepare_request(&request("W", 4, Some(2_000))));
    until("W waits", || metric(&c, "pdstor_admission_waiting") == 1);
    let t = Instant::now();
    assert_eq!(c.cancel("W").unwrap(), CancelOutcome::Cancelled);
    let (status, code, message) = refusal(waiter.join().unwrap());
    assert_eq!((status, code.as_str()), (409, "aborted"), "{message}");
    assert!(t.elapsed() < Duration::from_millis(1_000), "the waiter is woken, not timed out");
    assert_eq!(c.cancel("W").unwrap(), CancelOutcome::None, "cancel is idempotent");
    // A PREPARED request, cancelled with the CLI.
    let out = std::process::Command::new(pdstor_tests::pdstor_bin())
        .args(["cancel", "--req", "hog", "--server", &d.server])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed: CancelOutcome = serde_json::from_slice(&out.stdout).unwrap();
    assert!(matches!(printed, CancelOutcome::Aborted { slots: 10, .. }), "{printed:?}");
    assert_eq!(metric(&c, "pdstor_admission_cancels_total"), 1);
    all_returned(&c, 10);
}

/// Path 3: a client that gives up and disconnects while it waits is not
/// admitted later: its wait is cancelled when the connection closes.
#[test]
fn a_waiter_that_disconnects_is_never_admitted() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 10, SLOT);
    let c = Client::new(&d.server);
    let hog = c.prepare("hog", &layout(), 10, "w").unwrap();
    let body = serde_json::to_vec(&request("gone", 4, Some(2_000))).unwrap();
    let mut s = UnixStream::connect(d.control_socket()).unwrap();
    write!(
        s,
        "POST /storage-pd/prepare HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    until("the prepare waits", || metric(&c, "pdstor_admission_waiting") == 1);
    drop(s);
    until("the wait is cancelled", || metric(&c, "pdstor_admission_waiting") == 0);
    assert_eq!(metric(&c, "pdstor_admission_cancels_total"), 1);
    c.abort(hog.publication, &hog.writer_token).unwrap();
    thread::sleep(Duration::from_millis(100));
    let pubs = c.publications(None, false).unwrap();
    assert!(pubs.iter().all(|p| p.req_id != "gone"), "the client that left was not admitted: {pubs:?}");
    all_returned(&c, 10);
}

/// Path 4: a stream that ends short (the batch marked last leaves chunks
/// unsent), or changes its total, rolls the whole request back.
#[test]
fn a_short_or_inconsistent_stream_is_rolled_back() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 10, SLOT);
    let c = Client::new(&d.server);
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let buf = pdstor_engine::buffer::Buffer::memfd("short", 4 * SLOT as usize).unwrap();
    let b = data.register(&buf).unwrap();
    let chunk = |i: u32| DataChunk { index: i, buffer: b, offset: i as u64 * SLOT, len: SLOT, crc32c: None };
    let p = c.prepare("short", &layout(), 4, "w").unwrap();
    let (status, code, message) =
        refusal(data.store(p.publication, &p.writer_token, vec![chunk(0), chunk(1), chunk(2)], true, 4));
    assert_eq!((status, code.as_str()), (422, "protocol_violation"), "{message}");
    assert!(message.contains("leaves 1 of 4 chunks unsent"), "{message}");
    assert!(message.contains("rolled back"), "{message}");
    let p = c.prepare("total", &layout(), 4, "w").unwrap();
    data.store(p.publication, &p.writer_token, vec![chunk(0)], false, 4).unwrap();
    let (status, code, message) = refusal(data.store(p.publication, &p.writer_token, vec![chunk(1)], false, 5));
    assert_eq!((status, code.as_str()), (422, "protocol_violation"), "{message}");
    assert!(message.contains("declares total_chunks 5 but the request was prepared with 4"), "{message}");
    assert!(c.publications(None, false).unwrap().is_empty(), "both requests were rolled back");
    assert_eq!(metric(&c, "pdstor_protocol_violations_total"), 2);
    assert_eq!(metric(&c, "pdstor_rollbacks_total"), 2);
    all_returned(&c, 10);
}

/// A prepare's own timeout bounds its wait (under the daemon's maximum).
#[test]
fn a_prepare_waits_no_longer_than_its_own_timeout() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 4, SLOT);
    let c = Client::new(&d.server);
    let hog = c.prepare("hog", &layout(), 4, "w").unwrap();
    let t = Instant::now();
    let (status, code, message) = refusal(c.prepare_request(&request("late", 1, Some(150))));
    let took = t.elapsed();
    assert_eq!((status, code.as_str()), (503, "admission_timeout"), "{message}");
    assert!(took >= Duration::from_millis(140) && took < Duration::from_millis(1_500), "{took:?}");
    // Asking for more than the daemon allows waits the daemon's maximum (2 s here).
    let t = Instant::now();
    let (_, code, _) = refusal(c.prepare_request(&request("later", 1, Some(60_000))));
    assert_eq!(code, "admission_timeout");
    assert!(t.elapsed() < Duration::from_secs(5), "capped at --admission-timeout-ms");
    assert_eq!(metric(&c, "pdstor_admission_timeouts_total"), 2);
    c.abort(hog.publication, &hog.writer_token).unwrap();
    all_returned(&c, 4);
}

/// A raw HTTP exchange, for the disconnect test's neighbours: the daemon
/// still answers on a fresh connection after a client vanished mid-wait.
#[test]
fn the_daemon_answers_after_a_client_vanished_mid_wait() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 2, SLOT);
    let c = Client::new(&d.server);
    c.prepare("hog", &layout(), 2, "w").unwrap();
    for i in 0..4 {
        let body = serde_json::to_vec(&request(&format!("v{i}"), 1, Some(2_000))).unwrap();
        let mut s = UnixStream::connect(d.control_socket()).unwrap();
        write!(s, "POST /storage-pd/prepare HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", body.len()).unwrap();
        s.write_all(&body).unwrap();
        until("the prepare waits", || metric(&c, "pdstor_admission_waiting") == 1);
        s.shutdown(std::net::Shutdown::Both).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        until("the vanished waiter is cancelled", || metric(&c, "pdstor_admission_waiting") == 0);
    }
    assert_eq!(metric(&c, "pdstor_admission_cancels_total"), 4);
    assert_eq!(c.cancel("hog").unwrap(), CancelOutcome::Aborted { publication: 1, slots: 2 });
    all_returned(&c, 2);
}

/// Keys nobody reads must not fill the store for good — where the operator
/// opted in (`serve --evict-unread`): a prepare that finds too few free
/// slots releases the oldest READY publications nobody claimed, as many as
/// it needs, each an exact unread release on the timeline and counted. A
/// claimed one is never touched; without the flag nothing is.
#[test]
fn unread_publications_make_room_only_where_the_operator_opted_in() {
    let put = |d: &Daemon, req: &str, seed: u64| {
        let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
        w.put(req, &layout(), &pdstor_engine::payload::chunk(seed, 0, SLOT as usize), 1, None).unwrap()
    };
    let states = |c: &Client| -> Vec<(String, String)> {
        c.publications(None, false).unwrap().into_iter().map(|p| (p.req_id, p.state)).collect()
    };
    let owned = |v: &[(&str, &str)]| v.iter().map(|(r, s)| (r.to_string(), s.to_string())).collect::<Vec<_>>();

    // Not opted in: a full store makes the prepare wait and time out; nothing is evicted.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 2, SLOT);
    let c = Client::new(&d.server);
    put(&d, "keep-0", 1);
    put(&d, "keep-1", 2);
    assert_eq!(refusal(c.prepare_request(&request("new", 1, Some(100)))).1, "admission_timeout");
    assert_eq!(states(&c), owned(&[("keep-0", "READY"), ("keep-1", "READY")]));
    assert_eq!(metric(&c, "pdstor_evicted_total"), 0);

    // Opted in.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 4, SLOT);
    let timeline = dir.path().join("timeline.jsonl");
    let d = Daemon::start_with(&target, dir.path(), &["--evict-unread", "--timeline", timeline.to_str().unwrap()]);
    let c = Client::new(&d.server);
    let read = put(&d, "u-0", 10);
    for (i, req) in ["u-1", "u-2", "u-3"].iter().enumerate() {
        put(&d, req, 11 + i as u64);
    }
    c.claim(&read.receipt, "decode-0", "s", 60_000).unwrap();
    c.prepare_request(&request("n-1", 1, Some(2_000))).unwrap();
    assert_eq!(
        states(&c),
        owned(&[("u-0", "CLAIMED"), ("u-2", "READY"), ("u-3", "READY"), ("n-1", "PREPARED")]),
        "one slot short: the oldest unread went, no more"
    );
    c.prepare_request(&request("n-2", 2, Some(2_000))).unwrap();
    assert_eq!(states(&c), owned(&[("u-0", "CLAIMED"), ("n-1", "PREPARED"), ("n-2", "PREPARED")]));
    // Nothing unread is left: a prepare waits, as without the flag.
    assert_eq!(refusal(c.prepare_request(&request("n-3", 1, Some(100)))).1, "admission_timeout");
    assert_eq!(states(&c)[0], ("u-0".to_string(), "CLAIMED".to_string()), "a claimed publication is never evicted");
    assert_eq!(metric(&c, "pdstor_evicted_total"), 3);
    assert_eq!(metric(&c, "pdstor_invariant_violations_total"), 0);

    // A prepare that came when nothing was READY waits; the next publish
    // gives it room (the pressure is still there when something evictable appears).
    let waiter = {
        let server = d.server.clone();
        thread::spawn(move || Client::new(&server).prepare_request(&request("n-4", 1, Some(10_000))))
    };
    until("n-4 waits", || metric(&c, "pdstor_admission_waiting") == 1);
    // A retry of n-1's prepare answers its publication and writer token again.
    let n1 = c.prepare_request(&request("n-1", 1, None)).unwrap();
    let token = n1.writer_token;
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let buf = pdstor_engine::buffer::Buffer::memfd("evict", SLOT as usize).unwrap();
    let b = data.register(&buf).unwrap();
    let chunk = DataChunk { index: 0, buffer: b, offset: 0, len: SLOT, crc32c: None };
    data.store(n1.publication, &token, vec![chunk], true, 1).unwrap();
    c.publish(n1.publication, &token, None).unwrap();
    waiter.join().unwrap().expect("the publish made room for the waiting prepare");
    assert_eq!(
        states(&c),
        owned(&[("u-0", "CLAIMED"), ("n-2", "PREPARED"), ("n-4", "PREPARED")]),
        "n-1, READY and unread, made room"
    );
    assert_eq!(metric(&c, "pdstor_evicted_total"), 4);

    let lines = pdstor_client::timeline::read(&timeline).unwrap();
    let events: Vec<_> = lines.iter().map(|(_, e)| e.clone().unwrap()).collect();
    let evicted: Vec<&str> =
        events.iter().filter(|e| e.event == "evict").map(|e| e.req_id.as_deref().unwrap_or("?")).collect();
    assert_eq!(evicted, ["u-1", "u-2", "u-3", "n-1"]);
    let report = pdstor_proof::timeline::check::check(&lines, pdstor_engine::io::PayloadPath::HostFixed);
    let evict_lines: Vec<usize> =
        lines.iter().filter(|(_, e)| e.as_ref().is_ok_and(|e| e.event == "evict")).map(|(l, _)| *l).collect();
    assert!(
        report.violations.iter().all(|v| !evict_lines.contains(&v.line)),
        "the checker accepts the evictions: {:#?}",
        report.violations
    );
}

/// A batch of prepares answers its first ones only when its last is done,
/// which may wait for capacity: those first publications are not idle
/// meanwhile (the reaper would abort them under their writer's feet); their
/// idle clock starts with the answer. Found by the soak (issue 54).
#[test]
fn a_batchs_first_prepares_are_not_idle_while_its_last_waits_for_room() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = pdstor_tests::format_file(dir.path(), 2, SLOT);
    let d = Daemon::start_with(&target, dir.path(), &["--prepare-idle-timeout-ms", "200"]);
    let c = Client::new(&d.server);
    let mut w = pdstor_client::Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let held = w.put("held", &layout(), &pdstor_engine::payload::chunk(1, 0, SLOT as usize), 1, None).unwrap();
    let batch = {
        let server = d.server.clone();
        thread::spawn(move || {
            Client::new(&server).prepare_many(vec![request("first", 1, Some(5_000)), request("last", 1, Some(5_000))])
        })
    };
    until("the last prepare waits", || metric(&c, "pdstor_admission_waiting") == 1);
    // Five idle timeouts pass while "first" is PREPARED, its answer not sent.
    thread::sleep(Duration::from_millis(1_000));
    c.release(&held.receipt).unwrap();
    let answers = batch.join().unwrap().unwrap();
    let first = answers[0].as_ref().expect("first prepared");
    assert!(answers[1].is_ok(), "last prepared once room was made: {:?}", answers[1]);
    assert_eq!(metric(&c, "pdstor_prepared_reaped_total"), 0, "nothing aborted while the batch was answered");
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let buf = pdstor_engine::buffer::Buffer::memfd("batch", SLOT as usize).unwrap();
    let b = data.register(&buf).unwrap();
    let chunk = DataChunk { index: 0, buffer: b, offset: 0, len: SLOT, crc32c: None };
    data.store(first.publication, &first.writer_token, vec![chunk], true, 1).expect("first is still PREPARED");
    c.publish(first.publication, &first.writer_token, None).expect("and publishes");
    // Answered, the idle clock runs: "last", never stored, is aborted.
    until("last is reaped", || metric(&c, "pdstor_prepared_reaped_total") == 1);
}
