//! A client that tries to crash, leak or confuse the daemon: every attempt is
//! refused with a JSON error naming the problem, and the daemon stays up
//! with nothing held on the client's behalf.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use pdstor_client::frame::read_frame;
use pdstor_client::frame::write_frame;
use pdstor_client::layout::Layout;
use pdstor_client::wire::{DataChunk, DataResponse};
use pdstor_client::{Client, ClientError, DataConn, Writer};
use pdstor_tests::Daemon;

const SLOT: u64 = 1 << 20;

fn layout() -> Layout {
    Layout {
        model_id: "hostile".into(),
        dtype: "bf16".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 64,
        chunk_tokens: 16,
        kv_format: "pdstor-hostile".into(),
    }
}

fn raw(d: &Daemon, body: serde_json::Value, fds: &[i32]) -> DataResponse {
    let mut s = UnixStream::connect(&d.data_socket).unwrap();
    write_frame(&mut s, &serde_json::to_vec(&body).unwrap(), fds).unwrap();
    let (resp, _) = read_frame(&mut s).unwrap().expect("an answer, not a hang-up");
    serde_json::from_slice(&resp).unwrap()
}

fn memfd(name: &str, len: u64, seal: bool) -> OwnedFd {
    let flags = if seal { libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING } else { libc::MFD_CLOEXEC };
    let cname = std::ffi::CString::new(name).unwrap();
    // SAFETY: a NUL-terminated name and plain flags.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: memfd_create returned a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate/fcntl on our own descriptor.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        if seal {
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
    }
    fd
}

fn open_fds(d: &Daemon) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", d.pid().unwrap())).unwrap().count()
}

/// Issue 13 item 3: a memfd the client could shrink under the daemon's
/// mapping (SIGBUS on the next checksum), or a plain file, is refused at
/// registration; a sealed memfd cannot be shrunk at all.
#[test]
fn buffers_a_client_could_shrink_are_refused() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let register = serde_json::json!({"op": "register", "len": SLOT});
    let unsealed = memfd("unsealed", SLOT, false);
    let e = raw(&d, register.clone(), &[unsealed.as_raw_fd()]).error.expect("an unsealed memfd was accepted");
    assert_eq!((e.status, e.code.as_str()), (400, "bad_buffer"), "{e}");
    assert!(e.message.contains("F_SEAL_SHRINK"), "{e}");
    let file =
        std::fs::File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("f")).unwrap();
    file.set_len(SLOT).unwrap();
    let e = raw(&d, register.clone(), &[file.as_raw_fd()]).error.expect("a regular file was accepted as a buffer");
    assert!(e.message.contains("not a memfd"), "{e}");

    // A sealed memfd is accepted, and its owner cannot shrink it afterwards.
    let sealed = memfd("sealed", SLOT, true);
    let r = raw(&d, register, &[sealed.as_raw_fd()]);
    assert!(r.ok, "{:?}", r.error);
    // SAFETY: ftruncate on our own descriptor.
    let rc = unsafe { libc::ftruncate(sealed.as_raw_fd(), 0) };
    assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
    // The client's own buffers are sealed: the attack from the issue cannot start.
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let fd = w.buffer().memfd_fd().unwrap().as_raw_fd();
    // SAFETY: ftruncate on a descriptor the writer owns; it must fail.
    assert_eq!(unsafe { libc::ftruncate(fd, 0) }, -1);
    w.put("after", &layout(), &pdstor_engine::payload::chunk(1, 0, SLOT as usize), 1, None).unwrap();
}

/// Issue 13 item 4: frames with more descriptors than a register takes leak
/// nothing: every received descriptor is closed, and the memory behind them
/// is released when the client closes its copies.
#[test]
fn surplus_descriptors_are_closed() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let before = open_fds(&d);
    let fds: Vec<OwnedFd> = (0..10).map(|i| memfd(&format!("many-{i}"), SLOT, true)).collect();
    let raw_fds: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    for _ in 0..100 {
        let e = raw(&d, serde_json::json!({"op": "register", "len": SLOT}), &raw_fds).error.expect("10 fds accepted");
        assert_eq!(e.code, "no_fd", "{e}");
        // Descriptors on a request that takes none are closed too.
        let e = raw(&d, serde_json::json!({"op": "load", "receipt": null, "chunks": []}), &raw_fds[..3]).error;
        assert!(e.is_some());
    }
    // Each refused frame's connection is closed by now; give the daemon a moment to drop them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while open_fds(&d) > before + 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(open_fds(&d) <= before + 2, "the daemon holds {} fds, {before} before 1,300 sent", open_fds(&d));
}

/// Issue 13 item 5: numbers a client chooses are checked, not trusted.
#[test]
fn client_numbers_are_refused_with_a_reason() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    // A frame claiming 4 GiB: an answer saying why, then the hang-up.
    let mut s = UnixStream::connect(&d.data_socket).unwrap();
    s.write_all(&0xFFFF_FFFFu32.to_le_bytes()).unwrap();
    let (resp, _) = read_frame(&mut s).unwrap().expect("an error frame before the hang-up");
    let r: DataResponse = serde_json::from_slice(&resp).unwrap();
    let e = r.error.unwrap();
    assert_eq!((e.status, e.code.as_str()), (413, "frame_too_large"), "{e}");

    // A lease that would overflow the clock is refused, the publication still READY.
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, 2).unwrap();
    let kv: Vec<u8> = (0..2).flat_map(|i| pdstor_engine::payload::chunk(4, i, SLOT as usize)).collect();
    let ready = w.put("lease", &layout(), &kv, 2, None).unwrap().receipt;
    let c = Client::new(&d.server);
    match c.claim(&ready, "r", "s", u64::MAX) {
        Err(ClientError::Api(e)) => assert_eq!((e.status, e.field.as_str()), (400, "lease_ms"), "{e}"),
        other => panic!("lease_ms u64::MAX: {other:?}"),
    }
    let claim = c.claim(&ready, "r", "s", 60_000).unwrap();

    // A chunk index the manifest does not have, and a buffer offset beyond
    // the buffer: the client's mistakes, 422, not the daemon's 500.
    let mut reader = pdstor_client::Reader::new(&d.server, &d.data_socket).unwrap();
    let manifest = reader.adopt(&claim, &layout()).unwrap();
    let b = pdstor_engine::buffer::Buffer::memfd("dest", SLOT as usize).unwrap();
    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register(&b).unwrap();
    let chunk = |index, offset| DataChunk { index, buffer: id, offset, len: 0, crc32c: None };
    for (chunks, what) in [(vec![chunk(7, 0)], "chunk 7"), (vec![chunk(0, 4 * SLOT)], "outside")] {
        match data.load(&claim, chunks) {
            Err(ClientError::Api(e)) => {
                assert_eq!((e.status, e.code.as_str()), (422, "bad_chunk"), "{e}");
                assert!(e.message.contains(what), "{e}");
            }
            other => panic!("{what}: {other:?}"),
        }
    }
    assert_eq!(manifest.chunks.len(), 2);
    // Still fine afterwards: the real load works.
    let restored = reader.load(&claim, manifest).unwrap();
    assert_eq!(reader.restored_bytes(restored.len).unwrap(), kv);
}

/// A daemon on a fresh 8-slot namespace with extra `serve` limits, on
/// loopback TCP (plaintext, asked for by name) so raw connections can be made.
fn daemon_with(dir: &std::path::Path, extra: &[&str]) -> Daemon {
    let extra: Vec<&str> = extra.iter().copied().chain(["--insecure-tcp"]).collect();
    Daemon::start_with(&pdstor_tests::format_file(dir, 8, SLOT), dir, &extra)
}

fn http_error(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> pdstor_client::wire::ErrorBody {
    let mut r = r.expect("an HTTP answer");
    assert!(r.status().as_u16() >= 400, "expected an error status, got {}", r.status());
    let ct = r.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    assert!(ct.starts_with("application/json"), "content-type {ct}");
    serde_json::from_str(&r.body_mut().read_to_string().unwrap()).expect("the JSON error shape")
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// Issue 13 item 6: the control plane bounds what one client can hold:
/// connections, idle time, body size, waiting prepares; and every error it
/// makes itself comes in the JSON shape.
#[test]
fn the_control_plane_bounds_connections_bodies_and_waiting_prepares() {
    use std::io::Read;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = daemon_with(
        dir.path(),
        &["--max-http-connections", "4", "--header-timeout-ms", "1500", "--max-body", "64k", "--max-prepares", "2"],
    );
    // The harness's readiness check was a connection too: let the daemon see it close.
    std::thread::sleep(std::time::Duration::from_millis(500));
    // Four idle connections take every place; a fifth is answered 503 in JSON.
    let idle: Vec<std::net::TcpStream> = (0..4).map(|_| std::net::TcpStream::connect(&d.addr).unwrap()).collect();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut fifth = std::net::TcpStream::connect(&d.addr).unwrap();
    let mut answer = String::new();
    fifth.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 503") && answer.contains("\"too_many_connections\""), "{answer}");
    // Idle connections are closed after the header timeout, and places come back.
    std::thread::sleep(std::time::Duration::from_millis(2000));
    for mut s in idle {
        let mut buf = [0u8; 1];
        s.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("an idle connection was left open: {other:?}"),
        }
    }
    let a = agent();
    assert_eq!(a.get(format!("{}/healthz", d.server)).call().unwrap().status().as_u16(), 200);

    // Bodies over --max-body, and routes or methods that do not exist: JSON errors.
    // Just over the limit: the whole body fits the socket buffers, so the client
    // reads the answer rather than a reset from a daemon that stopped reading.
    let big = vec![b'x'; 70 << 10];
    let e = http_error(a.post(format!("{}/storage-pd/prepare", d.server)).send(&big[..]));
    assert_eq!((e.status, e.code.as_str()), (413, "body_too_large"), "{e}");
    let e = http_error(a.get(format!("{}/no/such/route", d.server)).call());
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"), "{e}");
    let e = http_error(a.get(format!("{}/storage-pd/prepare", d.server)).call());
    assert_eq!((e.status, e.code.as_str()), (405, "method_not_allowed"), "{e}");

    // Two prepares wait for capacity (a READY publication holds every slot);
    // a third is refused at once instead of taking another blocking thread.
    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, 8).unwrap();
    let kv: Vec<u8> = (0..8).flat_map(|i| pdstor_engine::payload::chunk(9, i, SLOT as usize)).collect();
    w.put("holds-all", &layout(), &kv, 4, None).unwrap();
    // Their pooled keep-alive connections would count against the cap of 4.
    drop((w, a));
    std::thread::sleep(std::time::Duration::from_millis(200));
    let waiters: Vec<_> = (0..2)
        .map(|i| {
            let server = d.server.clone();
            std::thread::spawn(move || Client::new(&server).prepare(&format!("waits-{i}"), &layout(), 1, "w"))
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let started = std::time::Instant::now();
    match Client::new(&d.server).prepare("third", &layout(), 1, "w") {
        Err(ClientError::Api(e)) => assert_eq!((e.status, e.code.as_str()), (503, "too_many_prepares"), "{e}"),
        other => panic!("a third waiting prepare: {other:?}"),
    }
    assert!(started.elapsed() < std::time::Duration::from_millis(500), "refused at once");
    for t in waiters {
        assert!(t.join().unwrap().is_err(), "the waiters time out: the store is full");
    }
}

/// Issue 13 item 6: the data plane bounds connections, buffers and mapped
/// bytes per connection; a writer that goes quiet after prepare gives its
/// reservation back.
#[test]
fn the_data_plane_bounds_connections_buffers_and_idle_prepares() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = daemon_with(
        dir.path(),
        &[
            "--max-data-connections",
            "2",
            "--max-buffers-per-connection",
            "2",
            "--max-pinned-per-connection",
            "3M",
            "--prepare-idle-timeout-ms",
            "300",
        ],
    );
    let register = serde_json::json!({"op": "register", "len": SLOT});
    let mut first = UnixStream::connect(&d.data_socket).unwrap();
    let send = |s: &mut UnixStream, fd: &OwnedFd| {
        write_frame(s, &serde_json::to_vec(&register).unwrap(), &[fd.as_raw_fd()]).unwrap();
        let (resp, _) = read_frame(s).unwrap().unwrap();
        serde_json::from_slice::<DataResponse>(&resp).unwrap()
    };
    let fds: Vec<OwnedFd> = (0..3).map(|i| memfd(&format!("b{i}"), 2 * SLOT, true)).collect();
    assert!(send(&mut first, &fds[0]).ok);
    assert!(send(&mut first, &fds[1]).ok);
    let e = send(&mut first, &fds[2]).error.expect("a third buffer on one connection");
    assert_eq!((e.status, e.code.as_str()), (429, "too_many_buffers"), "{e}");
    let mut second = UnixStream::connect(&d.data_socket).unwrap();
    let big = memfd("big", 4 * SLOT, true);
    write_frame(
        &mut second,
        &serde_json::to_vec(&serde_json::json!({"op": "register", "len": 4 * SLOT})).unwrap(),
        &[big.as_raw_fd()],
    )
    .unwrap();
    let (resp, _) = read_frame(&mut second).unwrap().unwrap();
    let e = serde_json::from_slice::<DataResponse>(&resp).unwrap().error.expect("4 MiB over a 3 MiB cap");
    assert_eq!((e.status, e.code.as_str()), (429, "too_many_bytes"), "{e}");
    // A third connection while two are open: answered, then closed.
    let mut third = UnixStream::connect(&d.data_socket).unwrap();
    let (resp, _) = read_frame(&mut third).unwrap().expect("an answer before the hang-up");
    let e = serde_json::from_slice::<DataResponse>(&resp).unwrap().error.unwrap();
    assert_eq!((e.status, e.code.as_str()), (503, "too_many_connections"), "{e}");
    drop((first, second));

    // A prepare that never sees a store batch is aborted after the idle timeout.
    let c = Client::new(&d.server);
    let p = c.prepare("quiet", &layout(), 3, "w").unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !c.publications(None, false).unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "publication {} was never reaped", p.publication);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(c.metrics().unwrap().contains("pdstor_prepared_reaped_total 1"));
    // Its reservation came back: all 8 slots can be prepared again.
    c.prepare("all", &layout(), 8, "w").unwrap();
}

/// A shared-memory file its owner can still shrink (LMCache's CPU pool in
/// /dev/shm, here an unsealed memfd: both are tmpfs files) is taken as a
/// `shm` buffer: the daemon moves payload to and from it and checksums what
/// it stores from and loads into it in place, a truncation's `SIGBUS`
/// caught — so the writer declares no crc32c (one it declares must match),
/// and when the owner shrinks the file, transfers fail and the daemon stays
/// up. A file that is not on tmpfs is refused.
#[test]
fn a_shm_file_its_owner_shrinks_fails_transfers_not_the_daemon() {
    use pdstor_client::wire::AdoptRequest;
    use pdstor_engine::{buffer::Buffer, io::PayloadPath};

    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, SLOT);
    let shm = memfd("pool", 4 * SLOT, false);
    let pool = Buffer::from_shm_file(shm.try_clone().unwrap(), (4 * SLOT) as usize, true).unwrap();
    let kv = pdstor_engine::payload::chunk(9, 0, SLOT as usize);
    pool.write_at(0, &kv).unwrap();

    let mut data = DataConn::connect(&d.data_socket).unwrap();
    let id = data.register(&pool).expect("a shm file is a buffer");
    let c = Client::new(&d.server);
    let store = |data: &mut DataConn, req: &str, crc32c| {
        let p = c.prepare(req, &layout(), 1, "w").unwrap();
        let chunk = DataChunk { index: 0, buffer: id, offset: 0, len: SLOT, crc32c };
        data.store(p.publication, &p.writer_token, vec![chunk], true, 1).map(|r| (p, r))
    };
    // The daemon checks a store from it in place: a declared checksum that
    // disagrees with the bytes is refused, none at all is not needed.
    let crc = pool.crc32c(0, SLOT as usize).unwrap();
    match store(&mut data, "wrong-crc", Some(crc ^ 1)) {
        Err(ClientError::Api(e)) => assert!(e.message.contains("declared crc32c"), "{e}"),
        other => panic!("a store from a shm file with a wrong crc32c: {other:?}"),
    }
    let (p, stored) = store(&mut data, "shm", None).unwrap();
    assert_eq!(stored.publishable, Some(true));
    let ready = c.publish(p.publication, &p.writer_token, None).unwrap().receipt;
    let claim = c.claim(&ready, "r", "s", 60_000).unwrap();
    let manifest = c.adopt(&AdoptRequest::of_claim(&claim, layout())).unwrap();
    assert_eq!(manifest.chunks[0].crc32c, crc, "the daemon's checksum of the stored bytes");
    let loaded =
        data.load(&claim, vec![DataChunk { index: 0, buffer: id, offset: SLOT, len: 0, crc32c: None }]).unwrap();
    assert!(loaded.unverified.is_empty(), "the daemon checks a load into it in place: {loaded:?}");
    assert_eq!(loaded.crc32c, vec![crc], "as stored");
    let mut back = vec![0u8; SLOT as usize];
    pool.read_at(SLOT, &mut back).unwrap();
    assert!(back == kv, "the restored bytes differ from the stored ones");

    // The owner shrinks the file under a host-path registration (no pinned
    // pages): the next transfers fail, the daemon answers and serves others.
    let host = data.register_for(&pool, PayloadPath::Host).unwrap();
    std::fs::File::from(shm).set_len(0).unwrap();
    let p = c.prepare("shrunk", &layout(), 1, "w").unwrap();
    let chunk = DataChunk { index: 0, buffer: host, offset: 0, len: SLOT, crc32c: Some(crc) };
    let r = data.store(p.publication, &p.writer_token, vec![chunk], true, 1);
    assert!(r.is_err(), "a store from a shrunk shm file: {r:?}");
    c.healthz().expect("the daemon is up");

    let mut w = Writer::new(&d.server, &d.data_socket, SLOT, 1).unwrap();
    let after = w.put("after", &layout(), &kv, 1, None).unwrap();
    // A load into the shrunk file (its pages pinned by the host_fixed
    // registration, so the read lands): the daemon's in-place check faults,
    // the fault is caught, and the load fails — the daemon does not.
    let claim = c.claim(&after.receipt, "r", "s2", 60_000).unwrap();
    c.adopt(&AdoptRequest::of_claim(&claim, layout())).unwrap();
    let r = data.load(&claim, vec![DataChunk { index: 0, buffer: id, offset: SLOT, len: 0, crc32c: None }]);
    assert!(r.as_ref().is_err_and(|e| e.to_string().contains("shrink")), "a load into a shrunk shm file: {r:?}");
    c.healthz().expect("the daemon is up after the fault");
    // The same for a store from another pool, shrunk under its host_fixed
    // registration (the write lands): the store's in-place check faults.
    let shm2 = memfd("pool2", SLOT, false);
    let pool2 = Buffer::from_shm_file(shm2.try_clone().unwrap(), SLOT as usize, true).unwrap();
    pool2.write_at(0, &kv).unwrap();
    let id2 = data.register(&pool2).unwrap();
    std::fs::File::from(shm2).set_len(0).unwrap();
    let p = c.prepare("shrunk-fixed", &layout(), 1, "w").unwrap();
    let chunk = DataChunk { index: 0, buffer: id2, offset: 0, len: SLOT, crc32c: None };
    let r = data.store(p.publication, &p.writer_token, vec![chunk], true, 1);
    assert!(r.as_ref().is_err_and(|e| e.to_string().contains("shrink")), "a store from a shrunk shm file: {r:?}");
    c.healthz().expect("the daemon is up after the fault");
    c.healthz().expect("the daemon is up after the fault");

    // Only tmpfs files are shm files.
    let file =
        std::fs::File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("f")).unwrap();
    file.set_len(SLOT).unwrap();
    let e = raw(&d, serde_json::json!({"op": "register", "len": SLOT, "kind": "shm"}), &[file.as_raw_fd()])
        .error
        .expect("a file on disk was accepted as a shm buffer");
    assert!(e.message.contains("not tmpfs"), "{e}");
}
