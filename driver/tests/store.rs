//! The on-media store and admission control on real files: format refusals,
//! the LMCache admission scenarios re-expressed against pdstor, recovery from
//! torn journals and bad superblock copies, checkpointing, and a seeded
//! schedule explorer that checks every invariant after every step.

mod common;

use common::layout;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use pdstor_client::superblock::Superblock;
use pdstor_daemon::admission::AdmitError;
use pdstor_daemon::store::{
    self, AbortOutcome, ChunkDest, ChunkSource, FaultPlan, FormatOptions, Phase, Store, StoreBatch, StoreError,
    StoreOptions, journal,
};
use pdstor_engine::io::{BufferId, BufferOffset};
use pdstor_engine::{buffer::Buffer, payload};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const SLOT: u64 = 64 * 1024;
const JOURNAL: u64 = 256 * 1024;

fn target_len(slots: u64) -> u64 {
    2 * 4096 + 2 * JOURNAL + slots * SLOT
}

fn format_file(dir: &Path, slots: u64) -> PathBuf {
    let path = dir.join("ns.img");
    store::format(
        &path,
        &FormatOptions { slot_size: SLOT, journal_half: JOURNAL, force: false, create_len: Some(target_len(slots)) },
    )
    .expect("format");
    path
}

fn open(path: &Path) -> (Store, store::RecoveryReport) {
    Store::open(path, StoreOptions { queue_depth: 8, admission_timeout: Duration::from_secs(10), ..Default::default() })
        .expect("open")
}

/// A client's view of a shared buffer: its own mapping, plus the id the store
/// registered for the other mapping of the same memfd.
struct Shared {
    mine: Buffer,
    id: BufferId,
}

fn shared(store: &Store, chunks: u64) -> Shared {
    let mine = Buffer::memfd("client", (chunks * SLOT) as usize).unwrap();
    let theirs =
        Buffer::from_memfd(mine.memfd_fd().unwrap().try_clone_to_owned().unwrap(), (chunks * SLOT) as usize).unwrap();
    let id = store.register_buffer(theirs).unwrap();
    Shared { mine, id }
}

fn fill(b: &Shared, seed: u64, chunks: u32) {
    for i in 0..chunks as u64 {
        b.mine.write_at(i * SLOT, &payload::chunk(seed, i, SLOT as usize)).unwrap();
    }
}

fn batch(publication: u64, b: &Shared, idx: &[u32], last: bool, total: u32) -> StoreBatch {
    StoreBatch {
        publication,
        chunks: idx
            .iter()
            .map(|i| ChunkSource {
                index: *i,
                buffer: b.id,
                buffer_offset: BufferOffset(*i as u64 * SLOT),
                len: SLOT,
                crc32c: None,
            })
            .collect(),
        is_last_batch: last,
        total_chunks: total,
    }
}

/// prepare → one batch → publish, with seeded payload.
fn put(store: &Store, b: &Shared, req: &str, seed: u64, chunks: u32) -> u64 {
    fill(b, seed, chunks);
    let id = store.prepare(req, "writer", &layout(), chunks).unwrap();
    let all: Vec<u32> = (0..chunks).collect();
    let out = store.store_batch(&batch(id, b, &all, true, chunks)).unwrap();
    assert!(out.publishable);
    store.publish(id, Some(7)).unwrap();
    id
}

fn verify(store: &Store, id: u64, b: &Shared, seed: u64, chunks: u32) {
    b.mine.write_at(0, &vec![0u8; (chunks as u64 * SLOT) as usize]).unwrap();
    let dests: Vec<ChunkDest> = (0..chunks)
        .map(|i| ChunkDest { index: i, buffer: b.id, buffer_offset: BufferOffset(i as u64 * SLOT) })
        .collect();
    store.load(id, &dests).unwrap();
    let mut got = vec![0u8; SLOT as usize];
    for i in 0..chunks as u64 {
        b.mine.read_at(i * SLOT, &mut got).unwrap();
        assert_eq!(
            payload::first_difference(&payload::chunk(seed, i, SLOT as usize), &got),
            None,
            "publication {id} chunk {i}"
        );
    }
}

#[test]
fn format_refuses_signatures_unless_forced_and_names_them() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let opts = FormatOptions { slot_size: SLOT, journal_half: JOURNAL, force: false, create_len: None };
    let e = store::format(&path, &opts).unwrap_err();
    assert!(e.to_string().contains("a pdstor namespace") && e.to_string().contains("--force"), "{e}");
    let before = open(&path).0.superblock().uuid;
    let again = store::format(&path, &FormatOptions { force: true, ..opts.clone() }).unwrap();
    assert_eq!(again.overwrote.as_deref(), Some("a pdstor namespace"));
    assert_ne!(open(&path).0.superblock().uuid, before, "a new namespace");

    for (fs, mkfs, args) in [("ext2/3/4", "mkfs.ext4", vec!["-q", "-F"]), ("XFS", "mkfs.xfs", vec!["-q", "-f"])] {
        let img = dir.path().join(format!("{mkfs}.img"));
        std::fs::File::create(&img).unwrap().set_len(320 << 20).unwrap();
        let ok = std::process::Command::new(mkfs).args(&args).arg(&img).status().is_ok_and(|s| s.success());
        if !ok {
            pdstor_testkit::skip("format_refuses_signatures", &format!("{mkfs} unavailable"));
            continue;
        }
        let e = store::format(&img, &opts).unwrap_err();
        assert!(e.to_string().contains(fs), "{e}");
        let head = std::fs::read(&img).unwrap()[..4096].to_vec();
        assert!(matches!(e, StoreError::ForeignSignature { .. }));
        assert_eq!(std::fs::read(&img).unwrap()[..4096], head[..], "a refusal writes nothing");
    }
}

#[test]
fn a_target_below_the_minimum_is_refused_with_the_minimum() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("small.img");
    let e = store::format(
        &path,
        &FormatOptions { slot_size: SLOT, journal_half: JOURNAL, force: false, create_len: Some(target_len(0)) },
    )
    .unwrap_err();
    assert!(matches!(e, StoreError::TooSmall { minimum, .. } if minimum == target_len(1)), "{e}");
    let e =
        store::format(&path, &FormatOptions { slot_size: 1000, journal_half: JOURNAL, force: false, create_len: None })
            .unwrap_err();
    assert!(e.to_string().contains("multiple of 4096"));
}

#[test]
fn publications_survive_reopen_and_epochs_advance() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let (id, epoch) = {
        let (s, r) = open(&path);
        assert_eq!(r.epoch, 1);
        let b = shared(&s, 3);
        let id = put(&s, &b, "req-1", 11, 3);
        (id, s.epoch())
    };
    let (s, r) = open(&path);
    assert_eq!(r.epoch, epoch + 1);
    assert_eq!(r.live, 1);
    let p = s.publications().into_iter().find(|p| p.id == id).unwrap();
    assert_eq!(p.phase, Phase::Ready);
    assert_eq!(p.manifest.as_ref().unwrap().first_token, Some(7));
    let b = shared(&s, 3);
    verify(&s, id, &b, 11, 3);
    s.check_quiescent().unwrap();
    s.release(id).unwrap();
    assert!(s.release(id).is_err(), "released once");
    assert_eq!(s.stats().reserved, 0);
}

/// Eviction under pressure (an operator's opt-in): only READY publications
/// nobody claimed, only those the policy accepts, oldest first, only as many
/// as the shortfall needs — and each release is durable.
/// Each epoch's superblock names the reservation key its owner began it
/// with (what a standby preempts, and what a revived old owner finds is not
/// its own), through checkpoints; an owner without one records 0.
#[test]
fn the_superblock_names_the_key_each_epoch_began_with() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let keyed = |key: u64| StoreOptions { queue_depth: 8, owner_key: key, ..Default::default() };
    let (s, r) = Store::open(&path, keyed(0x5d0e)).unwrap();
    assert_eq!(s.superblock().owner_key, 0x5d0e);
    let b = shared(&s, 2);
    put(&s, &b, "kept", 3, 2);
    s.checkpoint().unwrap();
    drop((b, s));
    let seen = store::inspect(&path).unwrap();
    assert_eq!((seen.superblock.owner_key, seen.superblock.epoch), (0x5d0e, r.epoch));
    // The standby's epoch: its key, the publication kept.
    let (s, r2) = Store::open(&path, keyed(0x5d10)).unwrap();
    assert_eq!((s.superblock().owner_key, r2.epoch, r2.live), (0x5d10, r.epoch + 1, 1));
    drop(s);
    let (s, _) = open(&path);
    assert_eq!(s.superblock().owner_key, 0);
}

/// What a standby reads before it takes over: the superblock as recovery
/// would choose it, read-only — also when copy A was torn by the owner's
/// death mid-update (copy B then tells whose the namespace is).
#[test]
fn a_standby_reads_whose_the_namespace_is_even_with_copy_a_torn() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let opened = StoreOptions { queue_depth: 8, owner_key: 0x5d0e, ..Default::default() };
    let (s, _) = Store::open(&path, opened).unwrap();
    let want = s.superblock();
    drop(s);
    let before = std::fs::read(&path).unwrap();
    let sb = pdstor_daemon::owner::read_superblock(&path).unwrap();
    assert_eq!((sb.uuid, sb.epoch, sb.owner_key), (want.uuid, want.epoch, 0x5d0e));
    assert!(std::fs::read(&path).unwrap() == before, "reading the superblock wrote the target");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().write_all_at(&[0xa5; 4096], 0).unwrap();
    let sb = pdstor_daemon::owner::read_superblock(&path).unwrap();
    assert_eq!((sb.uuid, sb.owner_key), (want.uuid, 0x5d0e));
}

#[test]
fn eviction_releases_only_unread_publications_it_may_oldest_first_and_durably() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 6);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    let owner = |tenant: &str| store::Owner { tenant: tenant.into(), principal: format!("uid:{}", tenant.len()) };
    let put_as = |req: &str, tenant: &str| {
        let cancel = pdstor_daemon::admission::CancelToken::new();
        let (o, l) = (owner(tenant), layout());
        let ask = store::Ask { owner: Some(&o), ..store::Ask::new(req, "writer", &l, 1) };
        let p = s.prepare_with(&ask, Duration::from_secs(1), &cancel);
        let id = p.unwrap().publication;
        assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
        s.publish(id, None).unwrap();
        id
    };
    fill(&b, 3, 1);
    let a0 = put_as("a-0", "a");
    let b0 = put_as("b-0", "b");
    let a1 = put_as("a-1", "a");
    let a2 = put_as("a-2", "a");
    let a3 = put_as("a-3", "a");
    s.claim(a2, "r", "s", 60_000, 0, None).unwrap();
    let of_a = |o: Option<&store::Owner>| o.is_some_and(|o| o.tenant == "a");
    let ids = |v: Vec<store::Evicted>| v.into_iter().map(|e| e.publication).collect::<Vec<_>>();

    assert_eq!(ids(s.evict_unread(1, &of_a).unwrap()), Vec::<u64>::new(), "one slot is free: nothing is short");
    assert_eq!(ids(s.evict_unread(2, &of_a).unwrap()), vec![a0], "one short: the oldest of tenant a");
    assert_eq!(ids(s.evict_unread(4, &of_a).unwrap()), vec![a1, a3], "never b's, never the claimed a-2");
    assert_eq!(ids(s.evict_unread(6, &of_a).unwrap()), Vec::<u64>::new(), "nothing left that may go");
    assert_eq!(s.stats().evicted, 3);
    assert_eq!(s.accounting().unwrap().free, 4, "the evicted slots are free for prepares");
    drop(s);

    let (s, _) = open(&path);
    let left: Vec<(u64, Phase)> = s.publications().iter().map(|p| (p.id, p.phase)).collect();
    assert_eq!(left, vec![(b0, Phase::Ready), (a2, Phase::Claimed)], "the releases were durable");
    s.check().unwrap();
}

/// The unread window: a READY publication no reader claimed is released
/// once `after` has passed since the policy first saw it so — durably,
/// counted — and a claimed one never is, however old.
#[test]
fn unread_publications_are_released_after_the_window_and_claimed_ones_never() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    fill(&b, 9, 1);
    let put = |req: &str| {
        let id = s.prepare(req, "writer", &layout(), 1).unwrap();
        assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
        s.publish(id, None).unwrap();
        id
    };
    let (unread, claimed) = (put("unread"), put("claimed"));
    s.claim(claimed, "r", "s", 60_000, 0, None).unwrap();
    let window = Duration::from_millis(40);
    let ids = |v: Vec<store::Evicted>| v.into_iter().map(|e| e.publication).collect::<Vec<_>>();

    // Each call measures from its own start: one first seen in it is 0 old.
    assert_eq!(ids(s.release_unread_after(|_| Some(Duration::from_secs(3600))).unwrap()), Vec::<u64>::new());
    thread::sleep(window + Duration::from_millis(10));
    let late = put("late");
    assert_eq!(
        ids(s.release_unread_after(|_| Some(window)).unwrap()),
        vec![unread],
        "the old unread one: not the claimed, not the new"
    );
    assert_eq!(s.stats().expired, 1);
    assert_eq!(s.accounting().unwrap().free, 2, "its slot is free for prepares");
    drop(s);

    let (s, _) = open(&path);
    let left: Vec<(u64, Phase)> = s.publications().iter().map(|p| (p.id, p.phase)).collect();
    assert_eq!(left, vec![(claimed, Phase::Claimed), (late, Phase::Ready)], "the release was durable");
    assert_eq!(
        ids(s.release_unread_after(|_| Some(window)).unwrap()),
        Vec::<u64>::new(),
        "recovered READY: a whole window again"
    );
    thread::sleep(window + Duration::from_millis(10));
    assert_eq!(ids(s.release_unread_after(|_| Some(window)).unwrap()), vec![late]);
    assert_eq!(
        ids(s.release_unread_after(|_| Some(Duration::ZERO)).unwrap()),
        Vec::<u64>::new(),
        "claimed: never, whatever its age"
    );
    s.check().unwrap();
}

/// A writer's own unread window: released after it with no daemon window,
/// the shorter of the two where both are set, kept where neither is; and
/// journaled with the PREPARE (a reopened store still knows it).
#[test]
fn a_writers_own_unread_window_applies_bounded_by_the_daemons_and_survives_a_reopen() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    fill(&b, 11, 1);
    let (l, short, long) = (layout(), 40u64, 3_600_000u64);
    let put = |req: &str, window: Option<u64>| {
        let ask = store::Ask { unread_release_ms: window, ..store::Ask::new(req, "writer", &l, 1) };
        let id = s.prepare_with(&ask, Duration::from_secs(1), &Default::default()).unwrap().publication;
        assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
        s.publish(id, None).unwrap();
        id
    };
    let (own, none, longer) = (put("own", Some(short)), put("none", None), put("longer", Some(long)));
    // A retried prepare is the same request only with the same window.
    let again = |window| {
        s.prepare_with(
            &store::Ask { unread_release_ms: window, ..store::Ask::new("again", "writer", &l, 1) },
            Duration::ZERO,
            &Default::default(),
        )
    };
    let first = again(Some(5)).unwrap();
    assert_eq!(again(Some(5)).unwrap(), store::Prepared { repeated: true, ..first });
    assert!(matches!(again(None), Err(store::StoreError::DuplicateRequest { .. })));
    assert_eq!(s.abort(first.publication).unwrap(), store::AbortOutcome::Aborted { slots: 1 });
    let ids = |v: Vec<store::Evicted>| v.into_iter().map(|e| (e.publication, e.window)).collect::<Vec<_>>();
    assert_eq!(ids(s.release_unread_after(|_| None).unwrap()), vec![], "each first seen now");
    drop(s);
    let (s, _) = open(&path);
    assert_eq!(ids(s.release_unread_after(|_| None).unwrap()), vec![], "recovered: a whole window again");
    thread::sleep(Duration::from_millis(short + 10));
    let ms = Duration::from_millis;
    assert_eq!(
        ids(s.release_unread_after(|_| None).unwrap()),
        vec![(own, Some(ms(short)))],
        "its own window, journaled"
    );
    let daemons = Some(ms(short));
    assert_eq!(ids(s.release_unread_after(|_| daemons).unwrap()), vec![(longer, daemons)], "the daemon's: the shorter");
    assert_eq!(ids(s.release_unread_after(|_| daemons).unwrap()), vec![], "none of its own: first seen now");
    thread::sleep(Duration::from_millis(short + 10));
    assert_eq!(ids(s.release_unread_after(|_| daemons).unwrap()), vec![(none, daemons)], "the daemon's: the only one");
    s.check().unwrap();
}

/// A cache publication being read is neither released, nor evicted for
/// room, nor expired by a window, and is never claimed; once its reads end
/// each may take it. Its class is journaled (a reopen still knows it) and
/// its reads are not (a reopen holds none).
#[test]
fn a_cache_publication_being_read_is_never_released_evicted_expired_or_claimed() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 2);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    fill(&b, 12, 1);
    let l = layout();
    let ask = store::Ask { cache: true, unread_release_ms: Some(1), ..store::Ask::new("key-1", "writer", &l, 1) };
    let id = s.prepare_with(&ask, Duration::from_secs(1), &Default::default()).unwrap().publication;
    assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
    s.publish(id, None).unwrap();
    drop(s);
    let (s, _) = open(&path);
    assert!(s.publication(id).unwrap().cache, "the class is journaled with the PREPARE");
    s.begin_read(id).unwrap();
    s.begin_read(id).unwrap();
    assert_eq!(s.reads(id), 2);
    assert!(matches!(s.release(id), Err(store::StoreError::BeingRead { reads: 2, .. })));
    assert!(matches!(s.claim(id, "r", "s", 1000, 0, None), Err(store::StoreError::WrongClass { .. })));
    assert!(s.evict_unread(2, &|_| true).unwrap().is_empty(), "held: not evicted for room");
    thread::sleep(Duration::from_millis(5));
    assert!(s.release_unread_after(|_| Some(Duration::from_millis(1))).unwrap().is_empty(), "held: not expired");
    assert_eq!(s.end_read(id).unwrap(), 1);
    assert!(s.evict_unread(2, &|_| true).unwrap().is_empty(), "one read still held");
    assert_eq!(s.end_read(id).unwrap(), 0);
    assert!(s.end_read(id).is_err(), "a read ended twice is a bug, reported");
    let evicted: Vec<u64> = s.evict_unread(2, &|_| true).unwrap().into_iter().map(|e| e.publication).collect();
    assert_eq!(evicted, vec![id], "no read held: evicted for room");
    s.check().unwrap();
}

/// A cache publication's unread window counts from its last read, not its
/// publish: one read more often than its window is never released however
/// long it lives; left unread, it is, a window after its last read.
#[test]
fn a_cache_publications_unread_window_counts_from_its_last_read() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 2);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    fill(&b, 13, 1);
    let l = layout();
    let window = 80u64;
    let ask = store::Ask { cache: true, unread_release_ms: Some(window), ..store::Ask::new("hot", "writer", &l, 1) };
    let id = s.prepare_with(&ask, Duration::from_secs(1), &Default::default()).unwrap().publication;
    assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
    s.publish(id, None).unwrap();
    assert!(s.release_unread_after(|_| None).unwrap().is_empty(), "first seen now");
    let born = std::time::Instant::now();
    while born.elapsed() < Duration::from_millis(4 * window) {
        thread::sleep(Duration::from_millis(window / 4));
        s.begin_read(id).unwrap();
        s.end_read(id).unwrap();
        assert!(s.release_unread_after(|_| None).unwrap().is_empty(), "read within its window: kept");
    }
    thread::sleep(Duration::from_millis(window + 10));
    let expired: Vec<u64> = s.release_unread_after(|_| None).unwrap().into_iter().map(|e| e.publication).collect();
    assert_eq!(expired, vec![id], "a window after its last read: released");
    s.check().unwrap();
}

/// Inside `with_one_commit` (a batch of protocol steps), publishes and
/// releases journal their records and the commit waits for the scope's end:
/// one commit for all, the released slots out of reach of prepares until
/// then, and every record durable after it (a reopen finds them).
#[test]
fn one_commit_for_a_run_of_transitions_and_freed_slots_wait_for_it() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 6);
    let (s, _) = open(&path);
    let b = shared(&s, 1);
    fill(&b, 5, 1);
    let mut ids = Vec::new();
    for i in 0..4 {
        let id = s.prepare(&format!("r-{i}"), "w", &layout(), 1).unwrap();
        assert!(s.store_batch(&batch(id, &b, &[0], true, 1)).unwrap().publishable);
        ids.push(id);
    }
    let commits = |s: &Store| s.stats().commit_groups;
    let before = commits(&s);
    let ((), published) = s.with_one_commit(|| {
        for &id in &ids {
            s.publish(id, None).unwrap();
        }
        assert_eq!(commits(&s), before, "no commit inside the scope");
    });
    published.unwrap();
    assert_eq!(commits(&s) - before, 1, "one commit for four publishes");

    let free = s.accounting().unwrap().free;
    let ((), released) = s.with_one_commit(|| {
        s.release(ids[0]).unwrap();
        s.release(ids[1]).unwrap();
        assert_eq!(s.accounting().unwrap().free, free, "released slots stay quarantined until the commit");
    });
    released.unwrap();
    assert_eq!(s.accounting().unwrap().free, free + 2, "free once durable");
    drop(s);

    let (s, _) = open(&path);
    let left: Vec<(u64, Phase)> = s.publications().iter().map(|p| (p.id, p.phase)).collect();
    assert_eq!(left, vec![(ids[2], Phase::Ready), (ids[3], Phase::Ready)], "every record of both scopes durable");
    s.check().unwrap();
}

#[test]
fn lmcache_two_requests_of_8_in_a_buffer_of_10_do_not_deadlock() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 10);
    let s = Arc::new(open(&path).0);
    let a = s.prepare("A", "w", &layout(), 8).unwrap();
    let s2 = s.clone();
    let waiter = thread::spawn(move || s2.prepare("B", "w", &layout(), 8));
    thread::sleep(Duration::from_millis(100));
    assert_eq!(s.stats().reserved, 8, "B waits for capacity");
    let b = shared(&s, 8);
    fill(&b, 1, 8);
    s.store_batch(&batch(a, &b, &[0, 1, 2, 3, 4], false, 8)).unwrap();
    s.store_batch(&batch(a, &b, &[5, 6, 7], true, 8)).unwrap();
    s.publish(a, None).unwrap();
    s.release(a).unwrap();
    let bid = waiter.join().unwrap().expect("B is admitted after A releases");
    s.store_batch(&batch(bid, &b, &[0, 1, 2, 3, 4, 5, 6, 7], true, 8)).unwrap();
    s.publish(bid, None).unwrap();
    verify(&s, bid, &b, 1, 8);
    s.check_quiescent().unwrap();
}

#[test]
fn lmcache_overflow_rolls_back_everything_and_others_still_succeed() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 16);
    let s = open(&path).0;
    let b = shared(&s, 16);
    fill(&b, 2, 16);
    // Declared 5, batches 5 + 5 + 1: the second batch is the violation.
    let x = s.prepare("X", "w", &layout(), 5).unwrap();
    s.store_batch(&batch(x, &b, &[0, 1, 2, 3, 4], false, 5)).unwrap();
    let e = s.store_batch(&batch(x, &b, &[5, 6, 7, 8, 9], false, 5)).unwrap_err();
    assert!(matches!(&e, StoreError::ProtocolViolation { .. }), "{e}");
    assert!(
        e.to_string().contains("beyond the declared 5") || e.to_string().contains("10 chunks sent against 5"),
        "{e}"
    );
    assert!(
        matches!(s.store_batch(&batch(x, &b, &[0], true, 5)), Err(StoreError::UnknownPublication(_))),
        "rolled back: gone"
    );
    // Declared 4, batches 3 + 2.
    let y = s.prepare("Y", "w", &layout(), 4).unwrap();
    s.store_batch(&batch(y, &b, &[0, 1, 2], false, 4)).unwrap();
    let e = s.store_batch(&batch(y, &b, &[3, 0], true, 4)).unwrap_err();
    assert!(e.to_string().contains("stored twice") || e.to_string().contains("5 chunks sent against 4"), "{e}");
    assert_eq!(s.stats().reserved, 0, "reservations released");
    assert_eq!(s.stats().free_slots, 16, "slots released");
    let z = put(&s, &b, "Z", 2, 4);
    verify(&s, z, &b, 2, 4);
    s.check_quiescent().unwrap();
}

#[test]
fn a_failed_batch_rolls_back_earlier_batches() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let s = open(&path).0;
    let b = shared(&s, 8);
    let id = s.prepare("F", "w", &layout(), 4).unwrap();
    s.store_batch(&batch(id, &b, &[0, 1], false, 4)).unwrap();
    let mut bad = batch(id, &b, &[2, 3], true, 4);
    bad.chunks[1].buffer = BufferId(60); // not registered: the batch's I/O fails
    let e = s.store_batch(&bad).unwrap_err();
    assert!(matches!(e, StoreError::BatchFailed { .. }), "{e}");
    assert_eq!((s.stats().reserved, s.stats().free_slots), (0, 8));
    assert!(s.publications().is_empty());
    s.check_quiescent().unwrap();
}

#[test]
fn abort_releases_slots_and_reservation_and_unknown_is_a_no_op() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 6);
    let s = open(&path).0;
    let b = shared(&s, 6);
    let id = s.prepare("A", "w", &layout(), 6).unwrap();
    s.store_batch(&batch(id, &b, &[0, 1, 2], false, 6)).unwrap();
    assert_eq!(s.abort(id).unwrap(), AbortOutcome::Aborted { slots: 6 });
    assert_eq!((s.stats().reserved, s.stats().free_slots), (0, 6));
    assert_eq!(s.abort(id).unwrap(), AbortOutcome::NotFound);
    assert_eq!(s.abort_request("never-seen").unwrap(), AbortOutcome::NotFound);
    let r = put(&s, &b, "R", 3, 2);
    assert!(
        matches!(s.abort(r), Err(StoreError::WrongPhase { phase: Phase::Ready, .. })),
        "READY is released, not aborted"
    );
    s.check_quiescent().unwrap();
}

#[test]
fn abort_wakes_a_waiting_prepare() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 2);
    let s = Arc::new(open(&path).0);
    s.prepare("hog", "w", &layout(), 2).unwrap();
    let s2 = s.clone();
    let w = thread::spawn(move || s2.prepare("late", "w", &layout(), 1));
    thread::sleep(Duration::from_millis(100));
    s.abort_request("late").unwrap();
    let e = w.join().unwrap().unwrap_err();
    assert!(matches!(e, StoreError::Admission(AdmitError::Aborted { .. })), "{e}");
}

#[test]
fn last_batch_with_no_chunks_completes_and_release_frees_all() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let s = open(&path).0;
    let b = shared(&s, 3);
    fill(&b, 4, 3);
    let id = s.prepare("E", "w", &layout(), 3).unwrap();
    assert!(!s.store_batch(&batch(id, &b, &[0, 1, 2], false, 3)).unwrap().publishable);
    assert!(s.store_batch(&batch(id, &b, &[], true, 3)).unwrap().publishable);
    s.publish(id, None).unwrap();
    s.release(id).unwrap();
    assert_eq!(s.stats().reserved, 0);
    let e = s.prepare("Z", "w", &layout(), 0).unwrap_err();
    assert!(e.to_string().contains("legacy senders are not supported"), "{e}");
    let id = s.prepare("L", "w", &layout(), 2).unwrap();
    let e = s.store_batch(&batch(id, &b, &[0], false, 0)).unwrap_err();
    assert!(e.to_string().contains("legacy senders are not supported"), "{e}");
}

#[test]
fn admission_times_out_when_one_request_holds_the_whole_store() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let s = open(&path).0;
    s.prepare("hog", "w", &layout(), 4).unwrap();
    let e = s.prepare_with_timeout("late", "w", &layout(), 1, Duration::from_millis(100)).unwrap_err();
    assert!(e.to_string().contains("waited") && e.to_string().contains("0 of 4"), "{e}");
    let e = s.prepare("huge", "w", &layout(), 5).unwrap_err();
    assert!(matches!(e, StoreError::Admission(AdmitError::TooLarge { .. })), "{e}");
}

#[test]
fn concurrent_batches_publish_exactly_once_after_the_last() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 12);
    let s = Arc::new(open(&path).0);
    let b = Arc::new(shared(&s, 12));
    fill(&b, 5, 12);
    let id = s.prepare("O", "w", &layout(), 12).unwrap();
    // Batches stored concurrently complete in any order; none is marked
    // last, since none is known to be sent after all the others.
    let handles: Vec<_> = (0..12u32)
        .collect::<Vec<_>>()
        .chunks(3)
        .map(|c| {
            let (s, b, c) = (s.clone(), b.clone(), c.to_vec());
            thread::spawn(move || s.store_batch(&batch(id, &b, &c, false, 12)).unwrap())
        })
        .collect();
    let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(outcomes.iter().all(|o| !o.publishable), "nothing is publishable before the last batch");
    assert!(matches!(s.publish(id, None), Err(StoreError::NotPublishable { completed: 12, total: 12, .. })));
    // Then the end of the stream: an empty batch marked last.
    assert!(s.store_batch(&batch(id, &b, &[], true, 12)).unwrap().publishable);
    s.publish(id, None).unwrap();
    assert!(matches!(s.publish(id, None), Err(StoreError::WrongPhase { .. })), "published once");
    verify(&s, id, &b, 5, 12);
}

#[test]
fn a_stream_that_ends_short_or_changes_its_total_is_rolled_back() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let s = open(&path).0;
    let b = shared(&s, 4);
    fill(&b, 6, 4);
    // Declared 4, the batch marked last carries 0..3: chunk 3 was never sent.
    let id = s.prepare("short", "w", &layout(), 4).unwrap();
    let e = s.store_batch(&batch(id, &b, &[0, 1, 2], true, 4)).unwrap_err();
    assert!(matches!(&e, StoreError::ProtocolViolation { .. }), "{e}");
    assert!(e.to_string().contains("leaves 1 of 4 chunks unsent"), "{e}");
    assert!(s.publication(id).is_none(), "the whole request was rolled back");
    // A batch whose total disagrees with the prepared one.
    let id = s.prepare("total", "w", &layout(), 4).unwrap();
    s.store_batch(&batch(id, &b, &[0], false, 4)).unwrap();
    let e = s.store_batch(&batch(id, &b, &[1], false, 5)).unwrap_err();
    assert!(e.to_string().contains("declares total_chunks 5 but the request was prepared with 4"), "{e}");
    assert!(s.publication(id).is_none());
    s.check_quiescent().unwrap();
    assert_eq!(s.stats().reserved, 0, "every reservation released");
    assert_eq!(s.stats().violations, 2);
}

#[test]
fn two_writers_that_fit_run_concurrently() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 20);
    let s = Arc::new(open(&path).0);
    let a = s.prepare("P1", "w1", &layout(), 10).unwrap();
    // P2 is admitted at once while P1 holds its reservation.
    let b = s.prepare_with_timeout("P2", "w2", &layout(), 10, Duration::ZERO).expect("fits beside P1");
    assert_ne!(a, b);
    assert_eq!(s.stats().reserved, 20);
}

#[test]
fn a_bad_checksum_mid_journal_stops_replay_there_and_says_where() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 8);
    let sb = {
        let s = open(&path).0;
        let b = shared(&s, 2);
        put(&s, &b, "one", 1, 2);
        put(&s, &b, "two", 2, 2);
        s.superblock()
    };
    let mut img = std::fs::read(&path).unwrap();
    let off = sb.journal_offset(sb.active_half) as usize;
    let half = &img[off..off + sb.journal_half as usize];
    let (records, _, _) = journal::replay(half, sb.journal_start_seq);
    assert!(records.len() > 4);
    // Damage the 3rd record: find its frame offset by re-encoding the first two.
    let mut at = 0;
    for (seq, r) in &records[..2] {
        at += journal::encode(*seq, r).unwrap().len();
    }
    img[off + at + journal::HEADER_BYTES + 2] ^= 0x20;
    std::fs::write(&path, &img).unwrap();
    let (s, report) = open(&path);
    let stop = report.journal_stop.expect("the damage is reported");
    assert!(stop.contains(&format!("byte {at}")) && stop.contains("checksum"), "{stop}");
    assert_eq!(report.records_replayed, 2);
    s.check_quiescent().unwrap();
}

#[test]
fn a_superblock_of_a_newer_version_is_refused_by_number() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 2);
    let mut img = std::fs::read(&path).unwrap();
    let mut sb = Superblock::decode(&img[..4096]).unwrap();
    sb.version = 99;
    let b_off = sb.copy_b_offset() as usize;
    img[..4096].copy_from_slice(&sb.encode());
    img[b_off..b_off + 4096].copy_from_slice(&sb.encode());
    std::fs::write(&path, &img).unwrap();
    let e = Store::open(&path, StoreOptions::default()).err().expect("refused");
    assert!(e.to_string().contains("version 99"), "{e}");
}

#[test]
fn a_corrupted_superblock_copy_is_survived_either_way() {
    for copy in ["A", "B"] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let path = format_file(dir.path(), 4);
        let id = {
            let s = open(&path).0;
            let b = shared(&s, 2);
            put(&s, &b, "keep", 9, 2)
        };
        let mut img = std::fs::read(&path).unwrap();
        let sb = Superblock::decode(&img[..4096]).unwrap();
        let at = if copy == "A" { 100 } else { sb.copy_b_offset() as usize + 100 };
        img[at] ^= 0xff;
        std::fs::write(&path, &img).unwrap();
        let (s, report) = open(&path);
        assert!(report.superblock_note.as_deref().unwrap_or("").contains(&format!("copy {copy}")), "{report:?}");
        let b = shared(&s, 2);
        verify(&s, id, &b, 9, 2);
        drop(s);
        // The reopen rewrote both copies.
        let (_, report) = open(&path);
        assert_eq!(report.superblock_note, None);
    }
}

#[test]
fn checkpoints_keep_the_journal_bounded_across_reopen() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let kept;
    {
        let s = open(&path).0;
        let b = shared(&s, 2);
        let half = s.superblock().active_half;
        kept = put(&s, &b, "kept", 3, 1);
        for i in 0..300 {
            let id = put(&s, &b, &format!("r{i}"), 4, 1);
            s.release(id).unwrap();
        }
        assert_ne!(s.superblock().active_half, half, "the journal was compacted into the other half");
        assert!(s.stats().journal_used < JOURNAL);
        s.check_quiescent().unwrap();
    }
    let (s, report) = open(&path);
    assert_eq!(report.live, 1);
    assert_eq!(report.journal_stop, None);
    let b = shared(&s, 2);
    verify(&s, kept, &b, 3, 1);
}

/// Crash consistency: the device dies after each possible number of writes of
/// prepare → store → publish (twice) → prepare → store, sometimes tearing the
/// last write. After reopening: recovery succeeds, invariants hold, nothing is
/// PREPARED, every READY payload matches its checksums and bytes, and every
/// publish that returned success is READY.
#[test]
fn recovery_after_a_crash_at_every_write() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for torn in [false, true] {
        let mut writes = 0u64;
        loop {
            let _ = std::fs::remove_file(dir.path().join("ns.img"));
            let path = format_file(dir.path(), 8);
            let fault = FaultPlan::die_after_writes(writes, torn);
            let acked = {
                let opened = Store::open(
                    &path,
                    StoreOptions {
                        queue_depth: 8,
                        admission_timeout: Duration::from_secs(1),
                        fault: Some(fault.clone()),
                        ..Default::default()
                    },
                );
                // The open itself writes (epoch bump, journal): it may be the crash.
                let Ok((s, _)) = opened else {
                    assert!(fault.is_dead(), "open failed without a crash: {:?}", opened.err());
                    let (s, _) = open(&path);
                    s.check_quiescent().unwrap();
                    assert!(s.publications().is_empty());
                    writes += 1;
                    continue;
                };
                let b = shared(&s, 3);
                let mut acked = Vec::new();
                let mut run = || -> Result<(), StoreError> {
                    for (req, seed) in [("a", 21u64), ("b", 22)] {
                        fill(&b, seed, 3);
                        let id = s.prepare(req, "w", &layout(), 3)?;
                        s.store_batch(&batch(id, &b, &[0, 1], false, 3))?;
                        s.store_batch(&batch(id, &b, &[2], true, 3))?;
                        s.publish(id, None)?;
                        acked.push((id, seed));
                    }
                    let id = s.prepare("c", "w", &layout(), 2)?;
                    s.store_batch(&batch(id, &b, &[0], false, 2))?;
                    s.commit()?;
                    Ok(())
                };
                let finished = run().is_ok() && !fault.is_dead();
                if finished {
                    break;
                }
                acked
            };
            let (s, report) = open(&path);
            s.check().unwrap_or_else(|e| panic!("after {writes} writes: {e}"));
            let pubs = s.publications();
            assert!(pubs.iter().all(|p| p.phase == Phase::Ready), "after {writes} writes: {pubs:?} ({report:?})");
            for (id, _) in &acked {
                assert!(
                    pubs.iter().any(|p| p.id == *id),
                    "after {writes} writes: acknowledged publication {id} is gone"
                );
            }
            let b = shared(&s, 3);
            for p in &pubs {
                let seed = if p.req_id == "a" { 21 } else { 22 };
                verify(&s, p.id, &b, seed, 3);
            }
            writes += 1;
            assert!(writes < 200, "the scenario should finish within 200 writes");
        }
        assert!(writes > 10, "the crash points covered the whole scenario ({writes})");
    }
}

/// Many writers, random batch splits, random aborts and injected batch
/// failures, interleaved by a seeded scheduler; every invariant is checked
/// after every step, and every schedule must end with no slot leaked.
#[test]
fn seeded_schedules_keep_every_invariant() {
    let schedules: u64 = std::env::var("PDSTOR_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 10);
    let s = open(&path).0;
    let b = shared(&s, 10);
    fill(&b, 8, 10);

    #[derive(Debug)]
    enum W {
        Waiting { need: u32, tries: u32 },
        Storing { id: u64, next: u32, total: u32 },
        Done,
    }
    for seed in 0..schedules {
        let mut rng = SmallRng::seed_from_u64(seed);
        let writers = rng.random_range(2..6);
        let mut ws: Vec<W> = (0..writers).map(|_| W::Waiting { need: rng.random_range(1..=8), tries: 0 }).collect();
        let mut steps = 0;
        while ws.iter().any(|w| !matches!(w, W::Done)) {
            steps += 1;
            assert!(steps < 2000, "schedule {seed} did not finish: {ws:?}");
            let i = rng.random_range(0..ws.len());
            let req = format!("s{seed}w{i}");
            ws[i] = match std::mem::replace(&mut ws[i], W::Done) {
                W::Waiting { need, tries } => {
                    match s.prepare_with_timeout(&req, "w", &layout(), need, Duration::ZERO) {
                        Ok(id) => W::Storing { id, next: 0, total: need },
                        Err(StoreError::Admission(AdmitError::Timeout { .. })) if tries < 200 => {
                            W::Waiting { need, tries: tries + 1 }
                        }
                        Err(StoreError::Admission(AdmitError::Timeout { .. })) => W::Done, // gave up: timed out
                        Err(e) => panic!("schedule {seed}: {e}"),
                    }
                }
                W::Storing { id, next, total } => {
                    let roll = rng.random_range(0..100);
                    if roll < 5 {
                        assert!(matches!(s.abort(id).unwrap(), AbortOutcome::Aborted { .. }));
                        W::Done
                    } else if next == total {
                        s.publish(id, None).unwrap();
                        if roll < 50 {
                            let dests: Vec<ChunkDest> = (0..total)
                                .map(|c| ChunkDest {
                                    index: c,
                                    buffer: b.id,
                                    buffer_offset: BufferOffset(c as u64 * SLOT),
                                })
                                .collect();
                            s.load(id, &dests).unwrap();
                        }
                        s.release(id).unwrap();
                        W::Done
                    } else {
                        let n = rng.random_range(1..=total - next);
                        let idx: Vec<u32> = (next..next + n).collect();
                        let mut bt = batch(id, &b, &idx, next + n == total, total);
                        if roll < 10 {
                            bt.chunks[0].buffer = BufferId(63); // injected I/O failure
                            assert!(matches!(s.store_batch(&bt), Err(StoreError::BatchFailed { .. })));
                            W::Done
                        } else if roll < 13 {
                            bt.chunks.push(ChunkSource {
                                index: 0,
                                buffer: b.id,
                                buffer_offset: BufferOffset(0),
                                len: SLOT,
                                crc32c: None,
                            }); // duplicate
                            assert!(matches!(s.store_batch(&bt), Err(StoreError::ProtocolViolation { .. })));
                            W::Done
                        } else {
                            s.store_batch(&bt).unwrap();
                            W::Storing { id, next: next + n, total }
                        }
                    }
                }
                W::Done => W::Done,
            };
            s.check().unwrap_or_else(|e| panic!("schedule {seed}, step {steps}: {e}"));
        }
        let st = s.stats();
        assert_eq!((st.reserved, st.free_slots, st.live_publications), (0, 10, 0), "schedule {seed} leaked");
    }
}

/// Real threads under pressure: more concurrent writers than capacity, with
/// blocking admission, random splits and aborts. No deadlock (every thread
/// finishes), no leaked slot, invariants hold throughout.
#[test]
fn concurrent_writers_under_pressure_finish_and_leak_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 10);
    let s = Arc::new(open(&path).0);
    let b = Arc::new(shared(&s, 10));
    fill(&b, 6, 10);
    let handles: Vec<_> = (0..8u64)
        .map(|w| {
            let (s, b) = (s.clone(), b.clone());
            thread::spawn(move || {
                let mut rng = SmallRng::seed_from_u64(w);
                for i in 0..15 {
                    let total = rng.random_range(1..=6u32);
                    let id =
                        s.prepare(&format!("t{w}-{i}"), "w", &layout(), total).expect("admitted within the timeout");
                    let mut next = 0;
                    while next < total {
                        let n = rng.random_range(1..=total - next);
                        let idx: Vec<u32> = (next..next + n).collect();
                        s.store_batch(&batch(id, &b, &idx, next + n == total, total)).unwrap();
                        next += n;
                    }
                    if rng.random_range(0..4) == 0 {
                        // An abort after all batches is refused only once READY; here it is not yet.
                        assert!(matches!(s.abort(id).unwrap(), AbortOutcome::Aborted { .. }));
                    } else {
                        s.publish(id, None).unwrap();
                        s.release(id).unwrap();
                    }
                    s.check().unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("writer finished");
    }
    let st = s.stats();
    assert_eq!((st.reserved, st.free_slots, st.live_publications), (0, 10, 0));
    s.check().unwrap();
}

#[test]
fn a_corrupted_chunk_fails_its_load_instead_of_returning_bytes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let (id, offset) = {
        let s = open(&path).0;
        let b = shared(&s, 2);
        let id = put(&s, &b, "c", 12, 2);
        let p = s.publications().into_iter().find(|p| p.id == id).unwrap();
        (id, p.manifest.unwrap().chunks[1].offset.0)
    };
    let mut img = std::fs::read(&path).unwrap();
    img[offset as usize + 1000] ^= 0x01;
    std::fs::write(&path, &img).unwrap();
    let s = open(&path).0;
    let b = shared(&s, 2);
    let dests = [
        ChunkDest { index: 0, buffer: b.id, buffer_offset: BufferOffset(0) },
        ChunkDest { index: 1, buffer: b.id, buffer_offset: BufferOffset(SLOT) },
    ];
    let e = s.load(id, &dests).unwrap_err();
    assert!(matches!(e, StoreError::Load { chunk: 1, .. }) && e.to_string().contains("checksum mismatch"), "{e}");
    // A chunk the manifest does not have is the caller's mistake, typed as such.
    let e = s.load(id, &[ChunkDest { index: 5, buffer: b.id, buffer_offset: BufferOffset(0) }]).unwrap_err();
    assert!(matches!(e, StoreError::NoSuchChunk { chunk: 5, chunks: 2, .. }), "{e}");
}

/// Issue 13 item 7: a sparse pre-existing file would let admission promise
/// space the filesystem may not have; format and open give every byte its
/// blocks first.
#[test]
fn a_sparse_target_file_is_allocated_before_it_is_used() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("sparse.img");
    let len = 2 * 4096 + 2 * (256 << 10) + 32 * SLOT;
    std::fs::File::create(&path).unwrap().set_len(len).unwrap();
    assert!(std::fs::metadata(&path).unwrap().blocks() * 512 < len, "the file starts sparse");
    pdstor_daemon::store::format(
        &path,
        &FormatOptions { slot_size: SLOT, journal_half: 256 << 10, ..Default::default() },
    )
    .unwrap();
    let md = std::fs::metadata(&path).unwrap();
    assert!(md.blocks() * 512 >= md.len(), "every byte has its blocks: {} of {}", md.blocks() * 512, md.len());
    // Holes punched later (by someone else) are filled again when the store opens.
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let punch = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
    nix::fcntl::fallocate(&f, punch, (len - 8 * SLOT) as i64, (4 * SLOT) as i64).unwrap();
    drop(f);
    assert!(std::fs::metadata(&path).unwrap().blocks() * 512 < len);
    drop(open(&path));
    assert!(std::fs::metadata(&path).unwrap().blocks() * 512 >= len, "open refilled the hole");
}

#[test]
fn an_orphaned_prepare_is_reaped_after_its_grace_unless_a_batch_comes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = format_file(dir.path(), 4);
    let s = open(&path).0;
    let b = shared(&s, 2);
    fill(&b, 9, 2);
    let hour = Duration::from_secs(3600);
    let lost = s.prepare("lost", "w", &layout(), 2).unwrap();
    let kept = s.prepare("kept", "w", &layout(), 2).unwrap();
    s.orphan(lost);
    s.orphan(kept);
    // A batch for an orphan shows its client is there after all.
    s.store_batch(&batch(kept, &b, &[0], false, 2)).unwrap();
    let reaped = s.reap_idle(hour, Duration::ZERO);
    assert_eq!(reaped.len(), 1, "{reaped:?}");
    assert_eq!((reaped[0].publication, reaped[0].orphaned), (lost, true));
    assert!(s.publication(lost).is_none() && s.publication(kept).is_some());
    assert!(s.reap_idle(hour, Duration::ZERO).is_empty(), "nothing idle for an hour");
    s.check_quiescent().unwrap();
    assert_eq!(s.stats().reserved, 2, "only the live request holds slots");
}
