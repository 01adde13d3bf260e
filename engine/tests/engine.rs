//! The engine's contract on every target kind this machine offers: seeded
//! payloads through `host` and `host_fixed`, read back through the engine and
//! independently with `dd iflag=direct`, compared byte for byte; and refusals
//! that write nothing.

use std::path::Path;

use pdstor_engine::io::{
    BufferId, Engine, EngineOptions, IoError, IoRequest, Op, Target, TargetKind, TargetOptions, TransferId,
};
use pdstor_engine::{buffer::Buffer, io::PayloadPath, payload};
use pdstor_testkit::{Filesystem, LoopDevice, Zram, dd_direct, skip};

const CHUNK: u64 = 256 * 1024;
const CHUNKS: u64 = 24;

fn open(path: &Path, create: Option<u64>, opts: EngineOptions) -> Engine {
    let t = Target::open(path, &TargetOptions { create_len: create, ..Default::default() })
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    Engine::new(t, opts).expect("engine")
}

fn buffer_for(engine: &mut Engine, path: PayloadPath, len: u64) -> BufferId {
    let b = Buffer::memfd("test", len as usize).unwrap();
    match path {
        PayloadPath::HostFixed => engine.register(b).unwrap(),
        _ => engine.add(b).unwrap(),
    }
}

fn batch(op: Op, path: PayloadPath, buffer: BufferId, base: u64, chunks: u64, chunk: u64) -> Vec<IoRequest> {
    (0..chunks)
        .map(|i| IoRequest {
            transfer: TransferId(i + 1),
            op,
            path,
            buffer,
            buffer_offset: pdstor_engine::io::BufferOffset(i * chunk),
            target_offset: pdstor_engine::io::TargetOffset(base + i * chunk),
            len: chunk,
        })
        .collect()
}

/// Writes seeded chunks on `path`, flushes, reads them back into a cleared
/// buffer, and checks them through the engine and with dd.
fn round_trip(engine: &mut Engine, target_path: &Path, path: PayloadPath, seed: u64, base: u64) {
    let id = buffer_for(engine, path, CHUNK * CHUNKS);
    for i in 0..CHUNKS {
        engine.buffer(id).unwrap().write_at(i * CHUNK, &payload::chunk(seed, i, CHUNK as usize)).unwrap();
    }
    let done = engine.execute(&batch(Op::Write, path, id, base, CHUNKS, CHUNK)).unwrap();
    assert_eq!(done.len() as u64, CHUNKS);
    for c in &done {
        assert!(c.result.is_ok(), "{:?}", c.result);
        assert_eq!(c.bytes, CHUNK);
        assert_eq!(c.path, path, "the completion records the path used");
    }
    engine.flush().unwrap();
    engine.buffer(id).unwrap().write_at(0, &vec![0u8; (CHUNK * CHUNKS) as usize]).unwrap();
    assert_eq!(engine.execute_all(&batch(Op::Read, path, id, base, CHUNKS, CHUNK)).unwrap(), CHUNK * CHUNKS);
    for i in 0..CHUNKS {
        let want = payload::chunk(seed, i, CHUNK as usize);
        let mut got = vec![0u8; CHUNK as usize];
        engine.buffer(id).unwrap().read_at(i * CHUNK, &mut got).unwrap();
        assert_eq!(payload::first_difference(&want, &got), None, "chunk {i} via engine on {path}");
        let independent = dd_direct(target_path, base + i * CHUNK, CHUNK);
        assert_eq!(payload::first_difference(&want, &independent), None, "chunk {i} via dd on {path}");
    }
    engine.remove(id).unwrap();
}

fn both_paths(target: &Path, create: Option<u64>) {
    let mut engine = open(target, create, EngineOptions::default());
    round_trip(&mut engine, target, PayloadPath::Host, 11, 0);
    round_trip(&mut engine, target, PayloadPath::HostFixed, 12, CHUNK * CHUNKS);
    let s = engine.stats();
    assert_eq!(s.host.requests, 2 * CHUNKS);
    assert_eq!(s.host_fixed.requests, 2 * CHUNKS);
    assert_eq!(s.errors, 0);
}

#[test]
fn file_on_root_filesystem() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("target.img");
    both_paths(&target, Some(2 * CHUNK * CHUNKS));
    let engine = open(&target, None, EngineOptions::default());
    assert_eq!(engine.target().kind(), TargetKind::File);
    assert_eq!(engine.geometry().capacity, 2 * CHUNK * CHUNKS, "preallocated to the requested size");
}

#[test]
fn raw_loop_device() {
    let dev = match LoopDevice::scratch(64 << 20, 4096) {
        Ok(d) => d,
        Err(why) => return skip("raw_loop_device", &why),
    };
    both_paths(&dev.path, None);
    let engine = open(&dev.path, None, EngineOptions::default());
    assert_eq!(engine.target().kind(), TargetKind::BlockDevice);
    assert_eq!(engine.geometry().logical_block, 4096);
    assert_eq!(engine.geometry().capacity, 64 << 20);
}

fn on_filesystem(fstype: &'static str) {
    let fs = match Filesystem::new(fstype, 400 << 20) {
        Ok(f) => f,
        Err(why) => return skip(&format!("{fstype}_on_loop_device"), &why),
    };
    let target = fs.mount.join("kv.img");
    both_paths(&target, Some(2 * CHUNK * CHUNKS));
}

/// zram refuses `RWF_NOWAIT`: the engine sees it at open and submits every
/// command `IOSQE_ASYNC`, and the bytes still go and come back exact. A loop
/// device and a file take the flag and are submitted inline.
#[test]
fn a_device_that_refuses_nowait_is_submitted_async() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = open(&dir.path().join("t.img"), Some(16 << 20), EngineOptions::default());
    assert!(!file.target().blocks(), "a file takes RWF_NOWAIT");
    let z = match Zram::new(64 << 20) {
        Ok(z) => z,
        Err(why) => return skip("a_device_that_refuses_nowait_is_submitted_async", &why),
    };
    let mut engine = open(&z.path, None, EngineOptions::default());
    assert_eq!(engine.target().kind(), TargetKind::BlockDevice);
    assert!(engine.target().blocks(), "zram refuses RWF_NOWAIT");
    for path in [PayloadPath::Host, PayloadPath::HostFixed] {
        round_trip(&mut engine, &z.path, path, 21, 0);
    }
    drop(engine);
    if let Ok(dev) = LoopDevice::scratch(16 << 20, 4096) {
        assert!(!open(&dev.path, None, EngineOptions::default()).target().blocks(), "a loop device takes RWF_NOWAIT");
    }
}

#[test]
fn xfs_on_loop_device() {
    on_filesystem("xfs");
}

#[test]
fn ext4_on_loop_device() {
    on_filesystem("ext4");
}

#[test]
fn requests_larger_than_the_command_limit_are_split_and_reassembled() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("split.img");
    let t = Target::open(&target, &TargetOptions { create_len: Some(8 << 20), ..Default::default() }).unwrap();
    let mut engine =
        Engine::new(t, EngineOptions { queue_depth: 3, max_transfer: Some(64 * 1024), ..Default::default() }).unwrap();
    assert_eq!(engine.geometry().max_transfer, 64 * 1024);
    // 5 requests of 1 MiB + 4 KiB each: 17 commands apiece, 3 requests in flight.
    let len = (1 << 20) + 4096;
    let id = buffer_for(&mut engine, PayloadPath::HostFixed, 5 * len);
    for i in 0..5 {
        engine.buffer(id).unwrap().write_at(i * len, &payload::chunk(3, i, len as usize)).unwrap();
    }
    engine.execute_all(&batch(Op::Write, PayloadPath::HostFixed, id, 0, 5, len)).unwrap();
    engine.flush().unwrap();
    for i in 0..5 {
        assert_eq!(dd_direct(&target, i * len, len), payload::chunk(3, i, len as usize), "request {i}");
    }
}

#[test]
fn many_small_requests_through_a_shallow_queue() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("small.img");
    let mut engine = open(&target, Some(4 << 20), EngineOptions { queue_depth: 4, ..Default::default() });
    let id = buffer_for(&mut engine, PayloadPath::HostFixed, 4 << 20);
    engine.buffer(id).unwrap().write_at(0, &payload::chunk(5, 0, 4 << 20)).unwrap();
    let n = (4 << 20) / 4096;
    let done = engine.execute(&batch(Op::Write, PayloadPath::HostFixed, id, 0, n, 4096)).unwrap();
    assert_eq!(done.len() as u64, n);
    for (i, c) in done.iter().enumerate() {
        assert_eq!(c.transfer, TransferId(i as u64 + 1), "completions come back in batch order");
        assert!(c.result.is_ok());
    }
    engine.flush().unwrap();
    assert_eq!(dd_direct(&target, 0, 4 << 20), payload::chunk(5, 0, 4 << 20));
}

/// Runs `bad` against a target holding a known pattern and checks it is refused
/// with an error matching `expect`, and that the target is unchanged.
fn refused(name: &str, bad: impl FnOnce(&mut Engine, BufferId, BufferId) -> IoError, expect: &str) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("refuse.img");
    let mut engine = open(&target, Some(1 << 20), EngineOptions::default());
    let fixed = buffer_for(&mut engine, PayloadPath::HostFixed, 1 << 20);
    let plain = buffer_for(&mut engine, PayloadPath::Host, 1 << 20);
    let before = payload::chunk(9, 0, 1 << 20);
    engine.buffer(fixed).unwrap().write_at(0, &before).unwrap();
    engine.execute_all(&batch(Op::Write, PayloadPath::HostFixed, fixed, 0, 1, 1 << 20)).unwrap();
    engine.flush().unwrap();
    engine.buffer(fixed).unwrap().write_at(0, &payload::chunk(10, 0, 1 << 20)).unwrap();
    engine.buffer(plain).unwrap().write_at(0, &payload::chunk(10, 0, 1 << 20)).unwrap();
    let err = bad(&mut engine, fixed, plain);
    let msg = err.to_string();
    assert!(msg.contains(expect), "{name}: error {msg:?} should mention {expect:?}");
    drop(engine);
    assert_eq!(dd_direct(&target, 0, 1 << 20), before, "{name}: a refused request wrote nothing");
}

fn write_req(buffer: BufferId, path: PayloadPath, buffer_offset: u64, target_offset: u64, len: u64) -> IoRequest {
    IoRequest {
        transfer: TransferId(77),
        op: Op::Write,
        path,
        buffer,
        buffer_offset: pdstor_engine::io::BufferOffset(buffer_offset),
        target_offset: pdstor_engine::io::TargetOffset(target_offset),
        len,
    }
}

#[test]
fn refusals_name_the_problem_and_write_nothing() {
    let good = |b| write_req(b, PayloadPath::HostFixed, 0, 0, 4096);
    refused(
        "unaligned target offset",
        |e, f, _| e.execute(&[good(f), write_req(f, PayloadPath::HostFixed, 0, 100, 4096)]).unwrap_err(),
        "target offset 100 is not a multiple of",
    );
    refused(
        "unaligned buffer",
        |e, f, _| e.execute(&[good(f), write_req(f, PayloadPath::HostFixed, 1, 0, 4096)]).unwrap_err(),
        "buffer address",
    );
    refused(
        "unaligned length",
        |e, f, _| e.execute(&[write_req(f, PayloadPath::HostFixed, 0, 0, 1000)]).unwrap_err(),
        "length 1000",
    );
    refused(
        "beyond the target",
        |e, f, _| e.execute(&[good(f), write_req(f, PayloadPath::HostFixed, 0, (1 << 20) - 4096, 8192)]).unwrap_err(),
        "beyond the target's 1048576 bytes",
    );
    refused(
        "beyond the buffer",
        |e, f, _| e.execute(&[good(f), write_req(f, PayloadPath::HostFixed, 1 << 20, 0, 4096)]).unwrap_err(),
        "outside the 1048576-byte buffer",
    );
    refused(
        "host_fixed on an unregistered buffer",
        |e, _, p| e.execute(&[write_req(p, PayloadPath::HostFixed, 0, 0, 4096)]).unwrap_err(),
        "not registered with io_uring",
    );
    refused(
        "dmabuf_fixed without import",
        |e, f, _| e.execute(&[write_req(f, PayloadPath::DmabufFixed, 0, 0, 4096)]).unwrap_err(),
        "path dmabuf_fixed is not available",
    );
    refused(
        "dmabuf_fixed registration of host memory",
        |e, _, _| e.register_dmabuf(Buffer::memfd("not-a-dmabuf", 4096).unwrap()).unwrap_err(),
        "not a DMA-BUF",
    );
    refused(
        "empty request",
        |e, f, _| e.execute(&[good(f), write_req(f, PayloadPath::HostFixed, 0, 0, 0)]).unwrap_err(),
        "0 bytes",
    );
    refused(
        "unknown buffer",
        |e, _, _| e.execute(&[write_req(BufferId(63), PayloadPath::Host, 0, 0, 4096)]).unwrap_err(),
        "buffer 63 is not held",
    );
    refused(
        "transfer id too large",
        |e, f, _| {
            let mut r = good(f);
            r.transfer = TransferId(u64::MAX);
            e.execute(&[r]).unwrap_err()
        },
        "fits in user_data",
    );
}

#[test]
fn a_directory_is_not_a_target() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let err = Target::open(dir.path(), &TargetOptions::default()).unwrap_err();
    assert!(matches!(err, IoError::IsDirectory { .. }), "{err}");
    assert!(err.to_string().contains("is a directory"));
}

#[test]
fn tmpfs_is_refused_for_lack_of_direct_io() {
    let Some(dir) = ["/dev/shm", "/run"]
        .into_iter()
        .find(|d| nix::sys::statfs::statfs(*d).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC))
    else {
        return skip("tmpfs_is_refused_for_lack_of_direct_io", "no tmpfs mounted at /dev/shm or /run");
    };
    let dir = tempfile::tempdir_in(dir).unwrap();
    let path = dir.path().join("kv.img");
    std::fs::write(&path, b"untouched").unwrap();
    let err = Target::open(&path, &TargetOptions { create_len: Some(1 << 20), ..Default::default() }).unwrap_err();
    assert!(matches!(err, IoError::NoDirectIo { .. }), "{err}");
    assert!(err.to_string().contains("tmpfs"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"untouched", "a refused open changes nothing");
}

#[test]
fn a_block_device_with_a_mounted_filesystem_is_refused() {
    let fs = match Filesystem::new("ext4", 64 << 20) {
        Ok(f) => f,
        Err(why) => return skip("a_block_device_with_a_mounted_filesystem_is_refused", &why),
    };
    let before = dd_direct(&fs.dev.path, 0, 1 << 20);
    let err = Target::open(&fs.dev.path, &TargetOptions::default()).unwrap_err();
    assert!(matches!(err, IoError::Busy { .. }), "{err}");
    assert!(err.to_string().contains(&fs.mount.display().to_string()), "names the mount point: {err}");
    assert_eq!(dd_direct(&fs.dev.path, 0, 1 << 20), before);
}

#[test]
fn a_second_opener_of_the_same_file_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("locked.img");
    let first = open(&path, Some(1 << 20), EngineOptions::default());
    let err = Target::open(&path, &TargetOptions::default()).unwrap_err();
    assert!(matches!(err, IoError::Locked { .. }), "{err}");
    drop(first);
    Target::open(&path, &TargetOptions::default()).expect("free again once the first engine is gone");
}

#[test]
fn buffers_are_registered_removed_and_their_slots_reused() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("slots.img");
    let mut engine = open(&path, Some(1 << 20), EngineOptions { buffer_slots: 2, ..Default::default() });
    let a = buffer_for(&mut engine, PayloadPath::HostFixed, 4096);
    let b = buffer_for(&mut engine, PayloadPath::HostFixed, 4096);
    let err = engine.register(Buffer::host(4096).unwrap()).unwrap_err();
    assert!(err.to_string().contains("all 2 buffer slots are in use"), "{err}");
    engine.remove(a).unwrap();
    assert!(engine.remove(a).is_err(), "removing twice is an error, not a double free");
    let c = engine.register(Buffer::host(4096).unwrap()).unwrap();
    assert_eq!(c, a, "the freed slot is reused");
    engine
        .execute_all(&[
            write_req(c, PayloadPath::HostFixed, 0, 0, 4096),
            write_req(b, PayloadPath::HostFixed, 0, 4096, 4096),
        ])
        .unwrap();
}

/// The rw-dmabuf capability probe answers on every ring, changes nothing, and
/// on a kernel without the series says why; the engine stays usable after it.
#[test]
fn the_rw_dmabuf_probe_reports_and_leaves_the_buffer_table_alone() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let target = dir.path().join("probe.img");
    let mut engine = open(&target, Some(CHUNK * CHUNKS), EngineOptions { buffer_slots: 2, ..Default::default() });
    match engine.dmabuf_rw() {
        pdstor_engine::io::DmabufRw::Missing(why) => {
            assert!(why.contains("EINVAL") || why.contains("probe"), "{why}");
            skip(
                "the_rw_dmabuf_probe_reports_and_leaves_the_buffer_table_alone (dmabuf_fixed half)",
                &format!("this kernel lacks the rw-dmabuf series: {why}"),
            );
        }
        pdstor_engine::io::DmabufRw::Available => {}
    }
    // Both slots, including the last one the probe used, still take buffers.
    let a = buffer_for(&mut engine, PayloadPath::HostFixed, 1 << 20);
    let b = buffer_for(&mut engine, PayloadPath::HostFixed, 1 << 20);
    assert_eq!((a.0, b.0), (0, 1));
    engine.remove(a).unwrap();
    engine.remove(b).unwrap();
    round_trip(&mut engine, &target, PayloadPath::HostFixed, 21, 0);
}

/// `nowait_first`: every command goes with `RWF_NOWAIT` first. Into the holes
/// of a sparse file on ext4 or XFS a direct write needs a block allocation,
/// which the filesystem refuses to do without blocking: the kernel answers
/// `-EAGAIN`, the engine resubmits without the flag (counted), and the bytes
/// are exact. Without the option nothing is resubmitted.
#[test]
fn nowait_first_resubmits_what_would_block() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // SAFETY: statfs fills the zeroed struct from a NUL-terminated path.
    let fs_type = unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        let p = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(libc::statfs(p.as_ptr(), &mut st), 0);
        st.f_type
    };
    const EXT4: libc::c_long = 0xef53;
    const XFS: libc::c_long = 0x5846_5342;
    if fs_type != EXT4 && fs_type != XFS {
        return skip(
            "nowait_first_resubmits_what_would_block",
            &format!("{} is not ext4 or XFS (f_type {fs_type:#x})", dir.path().display()),
        );
    }
    for nowait_first in [true, false] {
        let target = dir.path().join(format!("holes-{nowait_first}.img"));
        std::fs::File::create(&target).unwrap().set_len(CHUNK * CHUNKS).unwrap();
        let mut engine = open(&target, None, EngineOptions { nowait_first, ..Default::default() });
        round_trip(&mut engine, &target, PayloadPath::HostFixed, 21, 0);
        let s = engine.stats();
        assert_eq!(s.errors, 0);
        if nowait_first {
            assert!(s.resubmitted >= CHUNKS, "every write into a hole came back -EAGAIN: {s:?}");
        } else {
            assert_eq!(s.resubmitted, 0, "{s:?}");
        }
    }
}
