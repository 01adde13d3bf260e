//! What a target's write cache makes of a commit's flushes, on real devices:
//! none issued where the device keeps no volatile cache (zram; a loop device
//! switched to `write through`), each one where it does (the same loop
//! device switched back under the open store, read again) and on a file (its
//! filesystem's `fdatasync`). What was published survives a reopen either
//! way, byte for byte.

mod common;

use std::path::Path;
use std::time::Duration;

use common::layout;
use pdstor_daemon::store::{self, ChunkDest, ChunkSource, FormatOptions, Store, StoreBatch, StoreOptions};
use pdstor_engine::io::{BufferOffset, WriteCache};
use pdstor_engine::{buffer::Buffer, payload};

const SLOT: u64 = 64 * 1024;
const JOURNAL: u64 = 256 * 1024;
const LEN: u64 = 2 * 4096 + 2 * JOURNAL + 32 * SLOT;

fn open(path: &Path) -> Store {
    let opts = StoreOptions { queue_depth: 8, admission_timeout: Duration::from_secs(10), ..Default::default() };
    Store::open(path, opts).expect("open").0
}

fn format(path: &Path, create_len: Option<u64>) {
    let opts = FormatOptions { slot_size: SLOT, journal_half: JOURNAL, force: true, create_len };
    store::format(path, &opts).expect("format");
}

/// Publishes one two-chunk publication of `seed`'s bytes; answers the
/// flushes (issued, elided) it took.
fn put(s: &Store, b: &(Buffer, pdstor_engine::io::BufferId), req: &str, seed: u64) -> (u64, u64) {
    let before = s.stats();
    for i in 0..2 {
        b.0.write_at(i * SLOT, &payload::chunk(seed, i, SLOT as usize)).unwrap();
    }
    let id = s.prepare(req, "writer", &layout(), 2).unwrap();
    let chunks = (0..2u32)
        .map(|i| ChunkSource {
            index: i,
            buffer: b.1,
            buffer_offset: BufferOffset(i as u64 * SLOT),
            len: SLOT,
            crc32c: None,
        })
        .collect();
    s.store_batch(&StoreBatch { publication: id, chunks, is_last_batch: true, total_chunks: 2 }).unwrap();
    s.publish(id, Some(1)).unwrap();
    let after = s.stats();
    (after.flushes - before.flushes, after.flushes_elided - before.flushes_elided)
}

fn shared(s: &Store) -> (Buffer, pdstor_engine::io::BufferId) {
    let mine = Buffer::memfd("client", 2 * SLOT as usize).unwrap();
    let fd = mine.memfd_fd().unwrap().try_clone_to_owned().unwrap();
    let id = s.register_buffer(Buffer::from_memfd(fd, 2 * SLOT as usize).unwrap()).unwrap();
    (mine, id)
}

/// Every publication of `seeds` READY after a reopen, its bytes as stored.
fn reopened_holds(path: &Path, seeds: &[u64]) {
    let s = open(path);
    let b = shared(&s);
    let mut got = vec![0u8; SLOT as usize];
    let pubs = s.publications();
    assert_eq!(pubs.len(), seeds.len(), "{pubs:?}");
    for (p, seed) in pubs.iter().zip(seeds) {
        let dests =
            (0..2u32).map(|i| ChunkDest { index: i, buffer: b.1, buffer_offset: BufferOffset(i as u64 * SLOT) });
        s.load(p.id, &dests.collect::<Vec<_>>()).unwrap();
        for i in 0..2 {
            b.0.read_at(i * SLOT, &mut got).unwrap();
            assert_eq!(payload::first_difference(&payload::chunk(*seed, i, SLOT as usize), &got), None, "{p:?} {i}");
        }
    }
}

#[test]
fn zram_keeps_no_write_cache_so_no_flush_is_issued() {
    let z = match pdstor_testkit::Zram::new(LEN) {
        Ok(z) => z,
        Err(why) => return pdstor_testkit::skip("zram_keeps_no_write_cache_so_no_flush_is_issued", &why),
    };
    format(&z.path, None);
    let s = open(&z.path);
    assert!(matches!(s.write_cache(), WriteCache::None { .. }), "{:?}", s.write_cache());
    assert!(s.write_cache().to_string().contains("write through"), "{}", s.write_cache());
    let b = shared(&s);
    let (issued, elided) = put(&s, &b, "req-zram", 1);
    assert_eq!(issued, 0, "zram has no write cache: nothing to flush");
    assert!(elided == 1, "the payload's flush, counted elided: {elided}");
    drop(s);
    reopened_holds(&z.path, &[1]);
}

#[test]
fn a_loop_devices_write_cache_is_read_again_when_switched_under_the_store() {
    let name = "a_loop_devices_write_cache_is_read_again_when_switched_under_the_store";
    let dev = match pdstor_testkit::LoopDevice::scratch(LEN, 4096) {
        Ok(d) => d,
        Err(why) => return pdstor_testkit::skip(name, &why),
    };
    let loop_name = dev.path.file_name().unwrap().to_string_lossy().into_owned();
    let attr = format!("/sys/block/{loop_name}/queue/write_cache");
    let switch = |to: &str| std::fs::write(&attr, to).unwrap_or_else(|e| panic!("writing {to:?} to {attr}: {e}"));
    switch("write back");
    format(&dev.path, None);
    let s = open(&dev.path);
    let b = shared(&s);
    assert!(matches!(s.write_cache(), WriteCache::Volatile { .. }), "{:?}", s.write_cache());
    let (issued, elided) = put(&s, &b, "req-back", 1);
    assert!(issued == 1 && elided == 0, "a volatile cache is flushed: {issued} issued, {elided} elided");
    switch("write through");
    let (issued, elided) = put(&s, &b, "req-through", 2);
    assert!(issued == 0 && elided == 1, "write through: {issued} issued, {elided} elided");
    switch("write back");
    let (issued, elided) = put(&s, &b, "req-back-again", 3);
    assert!(issued == 1 && elided == 0, "switched back, flushed again: {issued} issued, {elided} elided");
    drop(s);
    reopened_holds(&dev.path, &[1, 2, 3]);
}

#[test]
fn a_file_is_flushed_by_its_filesystem_whatever_the_device_under_it() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("ns.img");
    format(&path, Some(LEN));
    let s = open(&path);
    let wc = s.write_cache();
    assert!(matches!(wc, WriteCache::Filesystem { .. }), "{wc:?}");
    assert!(wc.to_string().contains("fdatasync"), "{wc}");
    let b = shared(&s);
    let (issued, elided) = put(&s, &b, "req-file", 9);
    assert!(issued == 1 && elided == 0, "{issued} issued, {elided} elided");
    drop(s);
    reopened_holds(&path, &[9]);
}
