//! A data-plane load that acknowledges its claim (`load` with `ack`) on a
//! real `pdstor serve`: the daemon checks every chunk itself, the acks of a
//! frame share one commit, a load that cannot acknowledge is refused before
//! anything moves, and a chunk not as stored acknowledges nothing.

use std::os::fd::OwnedFd;

use pdstor_client::layout::{Layout, Manifest};
use pdstor_client::receipt::Receipt;
use pdstor_client::wire::DataChunk;
use pdstor_client::{Client, ClientError, DataConn, Writer};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::PayloadPath;
use pdstor_engine::payload;
use pdstor_tests::Daemon;

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "load-ack".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 256,
        kv_format: "pdstor-load-ack".into(),
    }
}

fn kv(seed: u64, chunks: u64) -> Vec<u8> {
    (0..chunks).flat_map(|i| payload::chunk(seed, i, SLOT as usize)).collect()
}

/// Publishes `chunks` chunks of `seed`, then claims and adopts it: the claim
/// and its manifest.
fn adopted(d: &Daemon, c: &Client, req: &str, seed: u64, chunks: u32) -> (Receipt, Manifest) {
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, chunks).unwrap();
    let p = w.put(req, &layout(), &kv(seed, chunks as u64), 2, Some(9)).unwrap();
    let (claim, manifest) = c.claim_and_adopt(&p.receipt, "decode-0", "s-la", 60_000, &layout()).unwrap();
    (claim, manifest.unwrap())
}

fn sample(c: &Client, series: &str) -> u64 {
    let m = c.metrics().unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')))
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

fn state(c: &Client, publication: u64) -> Option<String> {
    let list = c.publications(None, false).unwrap();
    list.into_iter().find(|p| p.publication == publication).map(|p| p.state)
}

fn refusal<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    match r {
        Err(ClientError::Api(e)) => e.code,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// `n` chunks one after another from `offset` of buffer `id`.
fn chunks(id: u32, offset: u64, n: u32) -> Vec<DataChunk> {
    (0..n).map(|i| DataChunk { index: i, buffer: id, offset: offset + i as u64 * SLOT, len: 0, crc32c: None }).collect()
}

#[test]
fn loads_that_ack_restore_byte_for_byte_and_their_acks_share_one_commit() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let c = Client::new(&d.server);
    let got: Vec<_> = (0..3).map(|i| adopted(&d, &c, &format!("la-{i}"), 40 + i, 2)).collect();
    let into = Buffer::memfd("la-reader", (6 * SLOT) as usize).unwrap();
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register_for(&into, PayloadPath::HostFixed).unwrap();

    let (commits0, acks0) = (sample(&c, "pdstor_commit_groups_total"), steps(&c, "ack"));
    let loads = got.iter().enumerate().map(|(k, (claim, _))| (claim, chunks(id, k as u64 * 2 * SLOT, 2))).collect();
    let answers: Vec<_> = data.load_and_ack_many(loads).unwrap().into_iter().map(Result::unwrap).collect();
    assert!(sample(&c, "pdstor_commit_groups_total") - commits0 <= 1, "the frame's acks share one commit");
    assert_eq!(steps(&c, "ack"), acks0, "no ack went through the control plane");
    for (k, ((claim, _), answer)) in got.iter().zip(&answers).enumerate() {
        assert!(answer.acked && answer.unverified.is_empty(), "{answer:?}");
        let mut bytes = vec![0u8; (2 * SLOT) as usize];
        into.read_at(k as u64 * 2 * SLOT, &mut bytes).unwrap();
        assert!(bytes == kv(40 + k as u64, 2), "byte for byte");
        assert_eq!(state(&c, claim.publication), None, "acknowledged: its slots free");
    }
    // An ack with the load is an ack: a second one finds nothing to acknowledge.
    assert!(c.ack(&got[0].0, "digest").is_err());
}

fn steps(c: &Client, step: &str) -> u64 {
    sample(c, &format!("pdstor_step_seconds_count{{step=\"{step}\"}}"))
}

#[test]
fn a_load_that_cannot_ack_is_refused_before_anything_moves() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let c = Client::new(&d.server);
    let (claim, _) = adopted(&d, &c, "la-refused", 50, 2);
    let mut data = DataConn::connect(&d.data_socket).unwrap();

    // Chunk 1 would be left unloaded.
    let into = Buffer::memfd("la-part", (2 * SLOT) as usize).unwrap();
    let id = data.register_for(&into, PayloadPath::HostFixed).unwrap();
    assert_eq!(refusal(data.load_and_ack(&claim, chunks(id, 0, 1))), "not_loaded");
    // Into a buffer whose loads the daemon does not check.
    let staging = Buffer::memfd("la-unchecked", (2 * SLOT) as usize).unwrap();
    let unchecked = data.register_checked(&staging, PayloadPath::HostFixed, false).unwrap();
    assert_eq!(refusal(data.load_and_ack(&claim, chunks(unchecked, 0, 2))), "wrong_state");
    let mut bytes = vec![0u8; (2 * SLOT) as usize];
    into.read_at(0, &mut bytes).unwrap();
    staging.read_at(0, &mut bytes[..SLOT as usize]).unwrap();
    assert!(bytes.iter().all(|&b| b == 0), "nothing was loaded");
    assert_eq!(state(&c, claim.publication).as_deref(), Some("ADOPTED"), "nothing changed");

    // Chunk 0 loaded where the daemon does not check it: only the reader can
    // vouch for it, so no load acknowledges the claim until it is loaded again.
    let unverified = data.load(&claim, chunks(unchecked, 0, 1)).unwrap();
    assert_eq!(unverified.unverified, vec![0]);
    let last = || vec![DataChunk { index: 1, buffer: id, offset: SLOT, len: 0, crc32c: None }];
    assert_eq!(refusal(data.load_and_ack(&claim, last())), "wrong_state");
    // Two loads of the claim in one frame, one with ack: both refused.
    let both = data.load_many_acking(vec![(&claim, chunks(id, 0, 1), false), (&claim, last(), true)]).unwrap();
    assert!(both.into_iter().all(|r| refusal(r) == "bad_request"));
    assert_eq!(state(&c, claim.publication).as_deref(), Some("ADOPTED"), "nothing changed");

    // Chunk 0 loaded again where the daemon checks it; then the load of chunk
    // 1 completes the claim and acknowledges it.
    assert!(!data.load(&claim, chunks(id, 0, 1)).unwrap().acked);
    assert!(data.load_and_ack(&claim, last()).unwrap().acked);
    into.read_at(0, &mut bytes).unwrap();
    assert!(bytes == kv(50, 2), "byte for byte");
    assert_eq!(state(&c, claim.publication), None);
}

#[test]
fn a_chunk_not_as_stored_acknowledges_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let c = Client::new(&d.server);
    let (claim, _) = adopted(&d, &c, "la-bad", 60, 2);
    // Flip one byte of chunk 1 on the media, behind the daemon's back.
    let image = std::fs::read(&d.target).unwrap();
    let needle = &payload::chunk(60, 1, SLOT as usize)[..4096];
    let at = image.windows(needle.len()).position(|w| w == needle).expect("chunk 1 is on the media") + 100;
    let file = std::fs::OpenOptions::new().write(true).open(&d.target).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[image[at] ^ 0x5a], at as u64).unwrap();
    file.sync_all().unwrap();

    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let into = Buffer::memfd("la-bad", (2 * SLOT) as usize).unwrap();
    let id = data.register_for(&into, PayloadPath::HostFixed).unwrap();
    let e = data.load_and_ack(&claim, chunks(id, 0, 2)).unwrap_err().to_string();
    assert!(e.contains("load_failed") && e.contains("chunk 1: checksum mismatch"), "{e}");
    assert_eq!(state(&c, claim.publication).as_deref(), Some("ADOPTED"), "not acknowledged");
    c.fail(&claim, "corrupt chunk").unwrap();
    assert_eq!(state(&c, claim.publication).as_deref(), Some("RETAINED"), "its bytes kept for a look");
}

/// LMCache's pool: a shared-memory file its owner may shrink. The daemon
/// checks loads into it in place (a shrink caught, not fatal), so such a
/// load acknowledges too and no chunk is left to the reader.
#[test]
fn a_load_into_a_shm_file_is_checked_by_the_daemon_and_acks() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 16, SLOT);
    let c = Client::new(&d.server);
    let (claim, _) = adopted(&d, &c, "la-shm", 70, 3);
    let len = (3 * SLOT) as usize;
    // An unsealed memfd: to the kernel what a /dev/shm object is (both tmpfs
    // files), made without needing /dev/shm mounted.
    // SAFETY: a NUL-terminated name and plain flags; the fd is owned below.
    let raw = unsafe { libc::memfd_create(c"la-shm".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(raw >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `raw` is a new fd this test owns.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    std::fs::File::from(fd.try_clone().unwrap()).set_len(len as u64).unwrap();
    let pool = Buffer::from_shm_file(fd, len, true).unwrap();
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register_for(&pool, PayloadPath::HostFixed).unwrap();
    let answer = data.load_and_ack(&claim, chunks(id, 0, 3)).unwrap();
    assert!(answer.acked, "{answer:?}");
    assert!(answer.unverified.is_empty() && answer.crc32c.len() == 3, "checked by the daemon: {answer:?}");
    let mut bytes = vec![0u8; len];
    pool.read_at(0, &mut bytes).unwrap();
    assert!(bytes == kv(70, 3), "byte for byte");
    assert_eq!(state(&c, claim.publication), None);
}
