//! `POST /storage-pd/batch` and the data plane's `many` on a real `pdstor
//! serve`: every step of many publications, a round trip per step kind, each step answering on its own
//! (a refused one changes nothing and stops nothing), and one commit for a
//! run of steps that commit.

use pdstor_client::layout::Layout;
use pdstor_client::receipt::restore_digest;
use pdstor_client::wire::{AdoptRequest, BatchStep, ClaimRequest, DataChunk, PrepareRequest, Prepared};
use pdstor_client::{Client, ClientError, DataConn, StoreItem};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::PayloadPath;
use pdstor_engine::payload;
use pdstor_tests::Daemon;

const SLOT: u64 = 1 << 20;
const N: usize = 8;

fn layout() -> Layout {
    Layout {
        model_id: "batch".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 256,
        kv_format: "pdstor-batch".into(),
    }
}

/// A sample from the daemon's `/metrics`: the line that starts with `series`.
fn sample(c: &Client, series: &str) -> u64 {
    let m = c.metrics().unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

fn steps_of(c: &Client, step: &str) -> u64 {
    sample(c, &format!("pdstor_step_seconds_count{{step=\"{step}\"}}"))
}

fn refusal<T: std::fmt::Debug>(r: &Result<T, ClientError>) -> (u16, &str) {
    match r {
        Err(ClientError::Api(e)) => (e.status, e.code.as_str()),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// One HTTP/1.1 POST over the control socket; the status and the JSON body.
fn exchange(socket: &std::path::Path, path: &str, body: &str) -> (u16, serde_json::Value) {
    let (status, body) = pdstor_tests::http_exchange(socket, "POST", path, Some(body));
    (status, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
}

fn state(c: &Client, publication: u64) -> Option<String> {
    let list = c.publications(None, false).unwrap();
    list.into_iter().find(|p| p.publication == publication).map(|p| p.state)
}

#[test]
fn a_batch_takes_each_step_of_many_publications_in_one_round_trip_and_each_answers_on_its_own() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 32, SLOT);
    let c = Client::new(&d.server);

    // Prepare N requests and, last, one larger than the namespace: N
    // prepared, that one refused, in one round trip.
    let mut asks: Vec<PrepareRequest> = (0..N)
        .map(|i| PrepareRequest {
            req_id: format!("batch-{i}"),
            layout: layout(),
            total_chunks: 1,
            writer: "prefill".into(),
            timeout_ms: None,
            unread_release_ms: None,
            cache: false,
        })
        .collect();
    asks.push(PrepareRequest { req_id: "too-large".into(), total_chunks: 64, ..asks[3].clone() });
    let (batches0, prepares0) = (steps_of(&c, "batch"), steps_of(&c, "prepare"));
    let prepared = c.prepare_many(asks).unwrap();
    assert_eq!(steps_of(&c, "batch") - batches0, 1, "one round trip");
    assert_eq!(steps_of(&c, "prepare"), prepares0, "no prepare went on its own");
    assert_eq!(prepared.len(), N + 1);
    assert_eq!(refusal(&prepared[N]).1, "too_large");
    let prepared: Vec<_> = prepared.into_iter().take(N).map(Result::unwrap).collect();

    // Every publication's chunk in one data-plane frame, from one shared
    // buffer: their writes reach the device as one submission. A store with
    // a wrong writer token among them is refused alone.
    let buffer = Buffer::memfd("batch-writer", (N as u64 * SLOT) as usize).unwrap();
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register_for(&buffer, PayloadPath::HostFixed).unwrap();
    let chunk_at = |i: usize| DataChunk { index: 0, buffer: id, offset: i as u64 * SLOT, len: SLOT, crc32c: None };
    for i in 0..N {
        buffer.write_at(i as u64 * SLOT, &payload::chunk(40 + i as u64, 0, SLOT as usize)).unwrap();
    }
    let forged = Prepared { writer_token: "f".repeat(64), ..prepared[1].clone() };
    let mut items: Vec<StoreItem<'_>> = prepared
        .iter()
        .enumerate()
        .map(|(i, p)| StoreItem { prepared: p, chunks: vec![chunk_at(i)], is_last_batch: true, total_chunks: 1 })
        .collect();
    items.insert(2, StoreItem { prepared: &forged, chunks: vec![chunk_at(1)], is_last_batch: true, total_chunks: 1 });
    let (chunks0, submissions0) =
        (sample(&c, "pdstor_payload_chunks_total"), sample(&c, "pdstor_payload_submissions_total"));
    let stored = data.store_many(items).unwrap();
    assert_eq!(stored.len(), N + 1);
    assert_eq!(refusal(&stored[2]).1, "not_owner", "the forged token");
    for (i, s) in stored.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert_eq!(s.as_ref().unwrap().publishable, Some(true), "store {i}");
    }
    assert_eq!(sample(&c, "pdstor_payload_chunks_total") - chunks0, N as u64, "each chunk written once");
    assert_eq!(sample(&c, "pdstor_payload_submissions_total") - submissions0, 1, "in one submission");

    // Publish all in one round trip; one commit makes them durable together
    // (one flush of their payload, then their records with FUA).
    let (flushes0, commits0) = (sample(&c, "pdstor_flushes_total"), sample(&c, "pdstor_commit_groups_total"));
    let tokens: Vec<_> = prepared.iter().map(|p| (p, Some(7))).collect();
    let published: Vec<_> = c.publish_many(&tokens).unwrap().into_iter().map(Result::unwrap).collect();
    let flushes = sample(&c, "pdstor_flushes_total") - flushes0;
    let commits = sample(&c, "pdstor_commit_groups_total") - commits0;
    assert!(flushes <= 1 && commits <= 1, "{N} publishes in one batch took {flushes} flushes, {commits} commits");
    for p in &published {
        assert_eq!(state(&c, p.receipt.publication).as_deref(), Some("READY"));
    }

    // Claim all, one with another layout: refused before it claims, still READY.
    let mut other = layout();
    other.head_dim = 128;
    let claims: Vec<ClaimRequest> = published
        .iter()
        .enumerate()
        .map(|(i, p)| ClaimRequest {
            receipt: p.receipt.clone(),
            reader_id: "decode-0".into(),
            session_id: "s-batch".into(),
            lease_ms: 60_000,
            layout: Some(if i == 5 { other.clone() } else { layout() }),
            adopt: false,
        })
        .collect();
    let claimed = c.claim_many(claims).unwrap();
    assert_eq!(refusal(&claimed[5]), (409, "layout_mismatch"));
    assert_eq!(state(&c, published[5].receipt.publication).as_deref(), Some("READY"));
    let claimed: Vec<_> = claimed.into_iter().enumerate().filter(|(i, _)| *i != 5).map(|(_, r)| r.unwrap()).collect();

    // Adopt all in one round trip; load each and check it byte for byte.
    let adopts = claimed.iter().map(|cl| AdoptRequest::of_claim(cl, layout())).collect();
    let manifests: Vec<_> = c.adopt_many(adopts).unwrap().into_iter().map(Result::unwrap).collect();
    // Every claim's chunk in one data-plane frame into one buffer, checked
    // byte for byte; the digest each ack takes, from the crc32c served.
    let into = Buffer::memfd("batch-reader", (N as u64 * SLOT) as usize).unwrap();
    let into_id = data.register_for(&into, PayloadPath::HostFixed).unwrap();
    let loads = claimed
        .iter()
        .enumerate()
        .map(|(i, cl)| {
            (cl, vec![DataChunk { index: 0, buffer: into_id, offset: i as u64 * SLOT, len: 0, crc32c: None }])
        })
        .collect();
    let submissions0 = sample(&c, "pdstor_payload_submissions_total");
    let loaded = data.load_many(loads).unwrap();
    assert_eq!(sample(&c, "pdstor_payload_submissions_total") - submissions0, 1, "read in one submission");
    let mut digests = Vec::new();
    for (i, ((cl, m), l)) in claimed.iter().zip(&manifests).zip(loaded).enumerate() {
        assert_eq!(m.first_token, Some(7));
        let l = l.unwrap();
        assert_eq!(l.crc32c, vec![m.chunks[0].crc32c], "the daemon read back what was stored");
        let seed = 40 + published.iter().position(|p| p.receipt.publication == cl.publication).unwrap() as u64;
        let mut got = vec![0u8; SLOT as usize];
        into.read_at(i as u64 * SLOT, &mut got).unwrap();
        assert!(got == payload::chunk(seed, 0, SLOT as usize), "byte for byte");
        digests.push(restore_digest(m.restore_nonce.as_deref().unwrap(), &l.crc32c));
    }

    // Ack all, one with a wrong digest: that one is refused and stays
    // ADOPTED; the others are consumed, their slots free, in one commit.
    digests[2] = "0".repeat(64);
    let acks: Vec<_> = claimed.iter().zip(&digests).map(|(cl, dg)| (cl, dg.as_str())).collect();
    let acked = c.ack_many(&acks).unwrap();
    assert_eq!(refusal(&acked[2]), (409, "restore_mismatch"));
    for (i, (r, cl)) in acked.iter().zip(&claimed).enumerate() {
        if i != 2 {
            assert!(r.is_ok(), "ack {i}: {r:?}");
            assert_eq!(state(&c, cl.publication), None, "acknowledged: gone");
        }
    }
    assert_eq!(state(&c, claimed[2].publication).as_deref(), Some("ADOPTED"));

    // Release the unread one in a batch with a step that names nothing: the
    // release is taken, the other refused.
    let released = c
        .batch(vec![
            BatchStep::Release(pdstor_client::wire::ReceiptOnly { receipt: published[5].receipt.clone() }),
            BatchStep::Cancel(pdstor_client::wire::CancelRequest { req_id: "never-prepared".into() }),
        ])
        .unwrap();
    assert!(released[0].is_ok(), "{:?}", released[0]);
    assert_eq!(released[1].as_ref().unwrap()["outcome"], "none");
    assert_eq!(state(&c, published[5].receipt.publication), None);
}

#[test]
fn a_get_of_many_claims_and_adopts_them_in_one_round_trip_and_one_commit() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let c = Client::new(&d.server);
    let asks = (0..4)
        .map(|i| PrepareRequest {
            req_id: format!("ca-{i}"),
            layout: layout(),
            total_chunks: 1,
            writer: "prefill".into(),
            timeout_ms: None,
            unread_release_ms: None,
            cache: false,
        })
        .collect();
    let prepared: Vec<_> = c.prepare_many(asks).unwrap().into_iter().map(Result::unwrap).collect();
    let buffer = Buffer::memfd("ca-writer", (4 * SLOT) as usize).unwrap();
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register_for(&buffer, PayloadPath::HostFixed).unwrap();
    for i in 0..4u64 {
        buffer.write_at(i * SLOT, &payload::chunk(70 + i, 0, SLOT as usize)).unwrap();
    }
    let items = (0..4)
        .map(|i| StoreItem {
            prepared: &prepared[i],
            chunks: vec![DataChunk { index: 0, buffer: id, offset: i as u64 * SLOT, len: SLOT, crc32c: None }],
            is_last_batch: true,
            total_chunks: 1,
        })
        .collect();
    assert!(data.store_many(items).unwrap().iter().all(Result::is_ok));
    let tokens: Vec<_> = prepared.iter().map(|p| (p, None)).collect();
    let published: Vec<_> = c.publish_many(&tokens).unwrap().into_iter().map(Result::unwrap).collect();

    // One with another layout: refused before it is claimed, still READY.
    let mut other = layout();
    other.head_dim = 128;
    let claims = published
        .iter()
        .enumerate()
        .map(|(i, p)| ClaimRequest {
            receipt: p.receipt.clone(),
            reader_id: "decode-0".into(),
            session_id: "s-ca".into(),
            lease_ms: 60_000,
            layout: Some(if i == 1 { other.clone() } else { layout() }),
            adopt: false, // claim_and_adopt_many sets it
        })
        .collect();
    let (batches0, adopts0, commits0) =
        (steps_of(&c, "batch"), steps_of(&c, "adopt"), sample(&c, "pdstor_commit_groups_total"));
    let got = c.claim_and_adopt_many(claims).unwrap();
    assert_eq!(steps_of(&c, "batch") - batches0, 1, "one round trip");
    assert_eq!(steps_of(&c, "adopt"), adopts0, "no adopt went on its own");
    assert!(sample(&c, "pdstor_commit_groups_total") - commits0 <= 1, "one commit");
    assert_eq!(refusal(&got[1]), (409, "layout_mismatch"));
    assert_eq!(state(&c, published[1].receipt.publication).as_deref(), Some("READY"));

    // The others ADOPTED: loaded in one frame, byte for byte, and acknowledged.
    let into = Buffer::memfd("ca-reader", (4 * SLOT) as usize).unwrap();
    let into_id = data.register_for(&into, PayloadPath::HostFixed).unwrap();
    let adopted: Vec<_> = got
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .map(|(_, g)| g.map(|(claim, m)| (claim, m.unwrap())).unwrap())
        .collect();
    let loads = adopted
        .iter()
        .enumerate()
        .map(|(k, (claim, _))| {
            assert_eq!(state(&c, claim.publication).as_deref(), Some("ADOPTED"));
            (claim, vec![DataChunk { index: 0, buffer: into_id, offset: k as u64 * SLOT, len: 0, crc32c: None }])
        })
        .collect();
    let loaded: Vec<_> = data.load_many(loads).unwrap().into_iter().map(Result::unwrap).collect();
    let mut acks = Vec::new();
    for (k, ((claim, manifest), l)) in adopted.iter().zip(&loaded).enumerate() {
        let i = published.iter().position(|p| p.receipt.publication == claim.publication).unwrap() as u64;
        let mut bytes = vec![0u8; SLOT as usize];
        into.read_at(k as u64 * SLOT, &mut bytes).unwrap();
        assert!(bytes == payload::chunk(70 + i, 0, SLOT as usize), "byte for byte");
        acks.push((claim, restore_digest(manifest.restore_nonce.as_deref().unwrap(), &l.crc32c)));
    }
    let acks: Vec<_> = acks.iter().map(|(cl, dg)| (*cl, dg.as_str())).collect();
    assert!(c.ack_many(&acks).unwrap().iter().all(Result::is_ok));
    for (claim, _) in &adopted {
        assert_eq!(state(&c, claim.publication), None, "acknowledged: gone");
    }
}

#[test]
fn a_batch_over_the_limit_is_refused_whole_and_changes_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let c = Client::new(&d.server);
    let step = |i: usize| {
        BatchStep::Prepare(PrepareRequest {
            req_id: format!("over-{i}"),
            layout: layout(),
            total_chunks: 1,
            writer: "prefill".into(),
            timeout_ms: Some(0),
            unread_release_ms: None,
            cache: false,
        })
    };
    let body = serde_json::json!({ "steps": (0..1025).map(step).collect::<Vec<_>>() }).to_string();
    let (status, answer) = exchange(&d.control_socket(), "/storage-pd/batch", &body);
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["code"], "bad_request");
    assert_eq!(answer["field"], "steps");
    assert!(c.publications(None, false).unwrap().is_empty(), "nothing prepared");
    // The client splits what is over the limit into batches the daemon takes.
    let outcomes = c.batch((0..1025).map(step).collect()).unwrap();
    assert_eq!(outcomes.len(), 1025);
    assert!(outcomes[..8].iter().all(Result::is_ok), "8 slots: the first 8 prepared");
    assert_eq!(refusal(&outcomes[8]).1, "admission_timeout");
}
