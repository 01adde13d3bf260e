//! `topology`: two guests on a private QEMU network (nothing else on it),
//! each its own kernel. The *storage* guest exports its raw NVMe namespace
//! with the kernel's NVMe/TCP target (`nvmet`, configured through configfs);
//! the *reader* guest, which has no NVMe of its own, connects with the
//! kernel's initiator (`nvme connect -t tcp`) and reads the namespace with
//! `O_DIRECT`. `cargo xtask vmtest --suite topology` boots both; a guest
//! booted alone says SKIP.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pdstor::io::{BufferOffset, Engine, EngineOptions, IoRequest, Op, Target, TargetOffset, TargetOptions, TransferId};
use pdstor::{Buffer, PayloadPath, payload};

use super::io::dd_direct;
use super::{Suite, Test, outcome};
use crate::guest::{Ctx, cmdline, console, sh};
use crate::{
    DiskRole, KILL_ME, NVME_TCP_PORT, Outcome, READER_ADDR, REPORT_PORT, SHARED_NQN, SHARED_SERIAL, STORAGE_ADDR,
};

pub const SUITE: Suite = Suite {
    name: "topology",
    tests: &[
        Test { name: "shared_namespace_over_nvme_tcp", disk: None, run: shared_namespace },
        Test { name: "the_reader_proves_it_sees_the_owners_namespace", disk: None, run: identity },
        Test { name: "handoff_to_a_reader_host", disk: None, run: handoff },
        // Last: the reader host does not survive it.
        Test { name: "a_dead_reader_host_is_fenced_then_reclaimed", disk: None, run: reader_death },
    ],
};

/// The owner's control plane on the private network (plaintext: nothing
/// else is on that network; `--insecure-tcp` says so at every start).
const CONTROL: &str = "10.77.0.1:7078";
const HANDOFF_CHUNKS: u32 = 64;
const HANDOFF_CHUNK: u64 = 256 << 10;
const HANDOFF_SEED: u64 = 0x64c4;
/// Where the storage guest hands the reader its READY receipt and waits for its report.
const HANDOFF_PORT: u16 = 7072;

fn kv_layout() -> pdstor::store::Layout {
    pdstor::store::Layout {
        model_id: "vmtest-topology".into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

fn handoff_payload() -> Vec<u8> {
    (0..HANDOFF_CHUNKS as u64).flat_map(|i| payload::chunk(HANDOFF_SEED, i, HANDOFF_CHUNK as usize)).collect()
}

/// The writer host (the storage guest) formats its namespace, serves it with
/// the control plane on the private network, stores 64 chunks and publishes;
/// the reader host claims over HTTP, reads every chunk itself from its
/// NVMe/TCP view of the namespace (`RemoteReader`: its superblock must be the
/// receipt's namespace), reports only checksums, acks, and compares the bytes
/// with the writer's outside pdstor. The owner then holds nothing of it.
fn handoff(_: &Ctx) -> Outcome {
    by_role(handoff_writer, handoff_reader)
}

fn handoff_writer() -> Result<(), String> {
    use pdstor::client::{Client, Writer};
    let _daemon = serve_owner("/tmp/vmtest/topology-serve.log")?;
    let server = format!("http://{CONTROL}");
    let socket = DATA_SOCKET;
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, HANDOFF_CHUNKS).map_err(|e| e.to_string())?;
    let published =
        w.put("topology-1", &kv_layout(), &handoff_payload(), 8, Some(42)).map_err(|e| format!("put: {e}"))?;
    console(&format!("pdstor-vminit: topology writer published {} chunks", HANDOFF_CHUNKS));
    // Hand the reader its READY receipt; wait for its report.
    let receipt = serde_json::to_string(&published.receipt).map_err(|e| e.to_string())?;
    let line = serve_once(HANDOFF_PORT, Some(&receipt))?;
    if line.trim() != "ok" {
        return Err(format!("the reader host reported {:?}", line.trim()));
    }
    let left = Client::new(&server).publications(None, false).map_err(|e| e.to_string())?;
    if !left.is_empty() {
        return Err(format!("after the reader host's ack the owner still holds {left:?}"));
    }
    Ok(())
}

/// Listens on the storage address for the reader guest, sends it `send` (if
/// any), and returns the line it answers (then says `bye`).
fn serve_once(port: u16, send: Option<&str>) -> Result<String, String> {
    let listener = TcpListener::bind((STORAGE_ADDR, port)).map_err(|e| format!("listening on {port}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(240);
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("no reader connected on port {port} within 240 s: {e}")),
        }
    };
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    if let Some(send) = send {
        (&stream).write_all(format!("{send}\n").as_bytes()).map_err(|e| format!("sending to the reader: {e}"))?;
    }
    stream.set_read_timeout(Some(Duration::from_secs(180))).map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("reading the reader's report: {e}"))?;
    let _ = (&stream).write_all(b"bye\n");
    Ok(line)
}

fn handoff_reader() -> Result<(), String> {
    use pdstor::client::{Client, RemoteReader};
    let (stream, line) = from_owner(HANDOFF_PORT)?;
    let result = (|| -> Result<(), String> {
        let ready: pdstor::protocol::Receipt =
            serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
        let server = format!("http://{CONTROL}");
        connect()?;
        let dev = fabric_namespace()?;
        let claim = Client::new(&server)
            .claim(&ready, "decode-remote", "topology", 120_000)
            .map_err(|e| format!("claim: {e}"))?;
        let mut r = RemoteReader::open(&server, &dev).and_then(RemoteReader::with_probes).map_err(|e| e.to_string())?;
        let restored = r.get(&claim, &kv_layout()).map_err(|e| format!("get --direct {}: {e}", dev.display()))?;
        // The reader host's own probes judge its reads from the fabric.
        if r.verdicts().len() != HANDOFF_CHUNKS as usize || r.verdicts().iter().any(|v| v != "native") {
            return Err(format!("the reader host's probes judged its loads {:?}", r.verdicts()));
        }
        let bytes = r.restored_bytes(restored.len).map_err(|e| e.to_string())?;
        if let Some(at) = payload::first_difference(&handoff_payload(), &bytes) {
            return Err(format!("the restored bytes differ from the writer's at byte {at}"));
        }
        r.client.ack(&claim, &restored.restore_digest).map_err(|e| format!("ack: {e}"))?;
        Ok(())
    })();
    let report = match &result {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("fail {e}"),
    };
    let _ = (&stream).write_all(format!("{report}\n").as_bytes());
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// Where on the namespace the storage guest writes what the reader reads.
const AT: u64 = 64 << 20;
const CHUNK: u64 = 1 << 20;
const CHUNKS: u64 = 4;
const SEED: u64 = 0x70b0;

/// The writer host's NVMe identity (the storage guest's own connection).
const WRITER_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e1";
const WRITER_HOSTID: &str = "5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e1";
/// The reader host's NVMe identity.
const READER_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e4";
const READER_HOSTID: &str = "5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e4";

/// Runs this guest's side of a topology test: `storage` on the storage
/// (writer) host, `reader` on the reader host; SKIP in a guest booted alone.
fn by_role(storage: impl FnOnce() -> Result<(), String>, reader: impl FnOnce() -> Result<(), String>) -> Outcome {
    outcome(match cmdline("role").as_deref() {
        None => Err("SKIP: not a topology guest (cargo xtask vmtest --suite topology boots two)".into()),
        Some("storage") => storage(),
        Some("reader") => reader(),
        Some(other) => Err(format!("unknown topology role {other:?}")),
    })
}

/// The reader host's end of [`serve_once`]: connects to the owner on `port`
/// (retrying while it gets there) and returns the stream and the owner's line.
fn from_owner(port: u16) -> Result<(TcpStream, String), String> {
    let deadline = Instant::now() + Duration::from_secs(240);
    let stream = loop {
        match TcpStream::connect((STORAGE_ADDR, port)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(format!("the owner never answered on port {port}: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(300)),
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(240))).map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("reading the owner's line on {port}: {e}"))?;
    Ok((stream, line))
}

fn pattern() -> Vec<u8> {
    (0..CHUNKS).flat_map(|i| payload::chunk(SEED, i, CHUNK as usize)).collect()
}

/// The storage guest writes a seeded pattern with pdstor's engine
/// (`host_fixed`, flushed), exports the namespace over NVMe/TCP, and waits
/// for the reader's report; the reader connects, reads the pattern back with
/// `dd iflag=direct` through the fabric and reports its crc32c. Byte-exact
/// across two kernels, or it fails on both sides.
fn shared_namespace(ctx: &Ctx) -> Outcome {
    by_role(|| storage(ctx), reader)
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value).map_err(|e| format!("writing {value:?} to {}: {e}", path.display()))
}

/// Exports `devices` as namespaces 1, 2, … of [`SHARED_NQN`] on NVMe/TCP at
/// the storage address, any host allowed (the network is private to the
/// test). Each namespace has a fixed UUID, which every host that reaches it
/// over the fabric sees.
fn export(devices: &[&Path]) -> Result<(), String> {
    let cfs = Path::new("/sys/kernel/config");
    if !cfs.join("nvmet").exists() {
        sh("mount", &["-t", "configfs", "configfs", "/sys/kernel/config"])?;
    }
    let nvmet = cfs.join("nvmet");
    if !nvmet.exists() {
        return Err("no /sys/kernel/config/nvmet: the nvmet module is not loaded".into());
    }
    let subsys = nvmet.join("subsystems").join(SHARED_NQN);
    if subsys.exists() {
        return Ok(());
    }
    let mk = |p: &PathBuf| std::fs::create_dir_all(p).map_err(|e| format!("creating {}: {e}", p.display()));
    mk(&subsys)?;
    write(&subsys.join("attr_allow_any_host"), "1")?;
    write(&subsys.join("attr_serial"), SHARED_SERIAL)?;
    for (i, device) in devices.iter().enumerate() {
        let ns = subsys.join(format!("namespaces/{}", i + 1));
        mk(&ns)?;
        write(&ns.join("device_path"), &device.to_string_lossy())?;
        // QEMU's emulated NVMe reports no namespace identifiers to Linux
        // (its controller is quirked NVME_QUIRK_BOGUS_NID), so the target
        // gives each namespace a fixed UUID, as an array names its own.
        write(&ns.join("device_uuid"), &format!("5d5e1000-0000-4000-8000-{:012x}", i + 1))?;
        write(&ns.join("enable"), "1")?;
    }
    let port = nvmet.join("ports/1");
    mk(&port)?;
    write(&port.join("addr_trtype"), "tcp")?;
    write(&port.join("addr_adrfam"), "ipv4")?;
    write(&port.join("addr_traddr"), STORAGE_ADDR)?;
    write(&port.join("addr_trsvcid"), &NVME_TCP_PORT.to_string())?;
    let link = port.join("subsystems").join(SHARED_NQN);
    std::os::unix::fs::symlink(&subsys, &link).map_err(|e| format!("linking {}: {e}", link.display()))?;
    Ok(())
}

fn storage(ctx: &Ctx) -> Result<(), String> {
    let device = ctx.disk(DiskRole::Raw)?.block.clone();
    let want = pattern();
    {
        let t = Target::open(&device, &TargetOptions::default()).map_err(|e| e.to_string())?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(|e| e.to_string())?;
        let id = engine
            .register(Buffer::memfd("topology", want.len()).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        engine.buffer(id).map_err(|e| e.to_string())?.write_at(0, &want).map_err(|e| e.to_string())?;
        let req = IoRequest {
            transfer: TransferId(0x70b0),
            op: Op::Write,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: BufferOffset(0),
            target_offset: TargetOffset(AT),
            len: want.len() as u64,
        };
        engine.execute_all(&[req]).map_err(|e| format!("writing the pattern: {e}"))?;
        engine.flush().map_err(|e| format!("flushing the pattern: {e}"))?;
    }
    export(&[device.as_path(), ctx.disk(DiskRole::Faulty)?.block.as_path()])?;
    // The writer host reaches the namespace over the fabric as the reader
    // does: its publishes flush through NVMe/TCP to the target.
    connect_as(WRITER_HOSTNQN, WRITER_HOSTID)?;
    console(&format!("pdstor-vminit: topology storage ready: {SHARED_NQN} on {STORAGE_ADDR}:{NVME_TCP_PORT}"));
    // The reader's report: `ok <crc32c>` or `fail <why>`.
    let line = serve_once(REPORT_PORT, None)?;
    let expected = format!("ok {:08x}", crc32c::crc32c(&want));
    if line.trim() != expected {
        return Err(format!("the reader guest reported {:?}, expected {expected:?}", line.trim()));
    }
    Ok(())
}

/// Connects the reader host to the storage guest's target, retrying while it boots.
fn connect() -> Result<(), String> {
    connect_as(READER_HOSTNQN, READER_HOSTID)
}

/// Connects this guest to the shared subsystem as the host `hostnqn`. An
/// explicit host identity: a bare guest has no /etc/nvme/hostnqn, and
/// nvme-cli's made-up NQN and host id disagree.
fn connect_as(hostnqn: &str, hostid: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let port = NVME_TCP_PORT.to_string();
    loop {
        let args = [
            "connect",
            "-t",
            "tcp",
            "-a",
            STORAGE_ADDR,
            "-s",
            &port,
            "-n",
            SHARED_NQN,
            "--hostnqn",
            hostnqn,
            "--hostid",
            hostid,
        ];
        match sh("nvme", &args) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(format!("nvme connect for 180 s: {e}")),
            Err(_) => std::thread::sleep(Duration::from_secs(2)),
        }
    }
}

/// The fabric namespace 1.
fn fabric_namespace() -> Result<PathBuf, String> {
    fabric_namespace_n(1)
}

/// Namespace `n` of the shared subsystem, as this host sees it over the
/// fabric: the block device whose subsystem is [`SHARED_NQN`] and whose NSID
/// is `n` (device names number namespaces in the order they were found, and
/// the storage guest has local NVMe namespaces of NSID 1 too).
fn fabric_namespace_n(n: u32) -> Result<PathBuf, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let blocks: Vec<String> = std::fs::read_dir("/sys/block")
            .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let attr = |b: &String, a: &str| std::fs::read_to_string(format!("/sys/block/{b}/{a}")).ok();
        let found = blocks.iter().find(|b| {
            b.starts_with("nvme")
                && attr(b, "device/subsysnqn").is_some_and(|s| s.trim() == SHARED_NQN)
                && attr(b, "nsid").is_some_and(|s| s.trim() == n.to_string())
        });
        if let Some(b) = found {
            let dev = PathBuf::from("/dev").join(b);
            if dev.exists() {
                return Ok(dev);
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no namespace {n} of {SHARED_NQN} within 20 s (block devices: {blocks:?})"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn reader() -> Result<(), String> {
    connect()?;
    let dev = fabric_namespace()?;
    console(&format!("pdstor-vminit: topology reader connected: {}", dev.display()));
    let got = dd_direct(&dev, AT, CHUNK * CHUNKS);
    let report = match &got {
        Ok(bytes) if *bytes == pattern() => format!("ok {:08x}", crc32c::crc32c(bytes)),
        Ok(bytes) => format!(
            "fail the bytes read over nvme-tcp differ from the storage guest's at byte {:?}",
            payload::first_difference(&pattern(), bytes)
        ),
        Err(e) => format!("fail reading {}: {e}", dev.display()),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut stream = loop {
        match TcpStream::connect((STORAGE_ADDR, REPORT_PORT)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => return Err(format!("reporting to the storage guest: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(300)),
        }
    };
    stream.write_all(format!("{report}\n").as_bytes()).map_err(|e| format!("sending the report: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
    let mut bye = String::new();
    let _ = BufReader::new(&stream).read_line(&mut bye);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    console(&format!("pdstor-vminit: topology reader at {READER_ADDR} reported {report:?}"));
    if report.starts_with("ok ") { Ok(()) } else { Err(report) }
}

/// Where the storage guest hands the doomed reader its receipt.
const DEATH_PORT: u16 = 7073;
/// Where the doomed reader answers while it lives.
const HEARTBEAT_PORT: u16 = 7074;
const DEATH_CHUNKS: u32 = 16;

/// The reader host claims, adopts, reads half the chunks, tells the owner
/// its claim, and dies (QEMU killed: no shutdown, no ack, no goodbye). The
/// owner sees its host gone; the claim is not freed by that (a reclaim is
/// refused: the reader is not fenced), nor by anything but fencing: the
/// owner closes the reader's session, then reclaims, and the slots serve a
/// new publication.
fn reader_death(_: &Ctx) -> Outcome {
    by_role(death_owner, death_reader)
}

fn death_owner() -> Result<(), String> {
    use pdstor::client::{Client, Writer};
    let _daemon = serve_owner("/tmp/vmtest/topology-serve-death.log")?;
    let server = format!("http://{CONTROL}");
    let socket = DATA_SOCKET;
    let c = Client::new(&server);
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, DEATH_CHUNKS).map_err(|e| e.to_string())?;
    let payload: Vec<u8> = handoff_payload()[..(DEATH_CHUNKS as u64 * HANDOFF_CHUNK) as usize].to_vec();
    let published = w.put("topology-doomed", &kv_layout(), &payload, 8, Some(42)).map_err(|e| format!("put: {e}"))?;
    let receipt = serde_json::to_string(&published.receipt).map_err(|e| e.to_string())?;
    let line = serve_once(DEATH_PORT, Some(&receipt))?;
    let claim: pdstor::protocol::Receipt = serde_json::from_str(line.trim().strip_prefix("adopted ").unwrap_or(""))
        .map_err(|e| format!("the reader host's claim {line:?}: {e}"))?;
    // Its host is gone when it stops answering.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut silent = 0;
    while silent < 3 {
        let addr = std::net::SocketAddr::from(([10, 77, 0, 2], HEARTBEAT_PORT));
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(_) => silent = 0,
            Err(_) => silent += 1,
        }
        if Instant::now() > deadline {
            return Err("the reader host was still answering 60 s after it said it would die".into());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    console("pdstor-vminit: topology owner: the reader host is gone");
    let state = |c: &Client| -> Result<Option<String>, String> {
        Ok(c.publications(None, false)
            .map_err(|e| e.to_string())?
            .into_iter()
            .find(|p| p.publication == claim.publication)
            .map(|p| p.state))
    };
    if state(&c)?.as_deref() != Some("ADOPTED") {
        return Err(format!("the dead reader's claim is {:?}, not ADOPTED", state(&c)?));
    }
    match c.reclaim(&claim) {
        Err(pdstor::client::ClientError::Api(b)) if b.code == "not_fenced" => {}
        other => return Err(format!("a reclaim before fencing was not refused not_fenced: {other:?}")),
    }
    if state(&c)?.as_deref() != Some("ADOPTED") {
        return Err("the refused reclaim changed the claim".into());
    }
    c.close_session(&claim).map_err(|e| format!("fencing the dead reader's session: {e}"))?;
    c.reclaim(&claim).map_err(|e| format!("reclaim after fencing: {e}"))?;
    if state(&c)?.is_some() {
        return Err("the fenced, reclaimed publication is still listed".into());
    }
    // Its slots serve a new publication.
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, DEATH_CHUNKS).map_err(|e| e.to_string())?;
    w.put("topology-after", &kv_layout(), &payload, 8, Some(42)).map_err(|e| format!("put after the reclaim: {e}"))?;
    Ok(())
}

fn death_reader() -> Result<(), String> {
    use pdstor::client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace()?;
    let (stream, line) = from_owner(DEATH_PORT)?;
    let ready: pdstor::protocol::Receipt =
        serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let claim = c.claim(&ready, "decode-doomed", "doomed", 600_000).map_err(|e| format!("claim: {e}"))?;
    let r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
    r.check_namespace(&claim).map_err(|e| e.to_string())?;
    let m = c
        .adopt(&pdstor::api::wire::AdoptRequest {
            receipt: claim.clone(),
            namespace: claim.namespace.clone(),
            epoch: claim.epoch,
            manifest_digest: claim.manifest_digest.clone(),
            layout: kv_layout(),
            direct: false,
        })
        .map_err(|e| format!("adopt: {e}"))?;
    // Mid-load: half the chunks read, nothing reported, no ack.
    for chunk in m.chunks.iter().take(m.chunks.len() / 2) {
        dd_direct(&dev, chunk.offset.0, chunk.len)?;
    }
    let heartbeat = TcpListener::bind((READER_ADDR, HEARTBEAT_PORT)).map_err(|e| format!("heartbeat: {e}"))?;
    std::thread::spawn(move || for _ in heartbeat.incoming() {});
    let claim_json = serde_json::to_string(&claim).map_err(|e| e.to_string())?;
    (&stream).write_all(format!("adopted {claim_json}\n").as_bytes()).map_err(|e| format!("telling the owner: {e}"))?;
    // Answer heartbeats for a moment, then die as a host does.
    std::thread::sleep(Duration::from_secs(3));
    console(KILL_ME);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// The owner's data plane, for the writer on the storage guest.
const DATA_SOCKET: &str = "/tmp/vmtest/topology-data.sock";

/// Where the storage guest waits for the identity proof's report.
const IDENTITY_PORT: u16 = 7075;

/// The owner serves its namespace (1 on the fabric); namespace 2 on the same
/// fabric controller is another pdstor namespace. The reader host's view of
/// namespace 1 is accepted — its superblock is the owner's and its NVMe UUID
/// is the one the owner's device reports — and namespace 2 is refused before
/// anything is read.
fn identity(_: &Ctx) -> Outcome {
    by_role(identity_owner, identity_reader)
}

/// Formats the shared namespace, as the writer host sees it over the fabric,
/// and serves it there.
fn serve_owner(log: &str) -> Result<super::protocol::Daemon, String> {
    use pdstor::client::Client;
    let d = fabric_namespace()?.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "256K", "--target", &d])?;
    let socket = DATA_SOCKET;
    let _ = std::fs::remove_file(socket);
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let child = std::process::Command::new("/bin/pdstor")
        .args(["serve", "--listen", CONTROL, "--insecure-tcp", "--data-socket", socket, "--target", &d])
        .stdout(std::process::Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("starting pdstor serve: {e}"))?;
    let daemon = super::protocol::Daemon(child);
    let c = Client::new(&format!("http://{CONTROL}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(socket).exists() || c.healthz().is_err() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("pdstor serve did not come up on {CONTROL}: {log}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(daemon)
}

fn identity_owner() -> Result<(), String> {
    let other = fabric_namespace_n(2)?.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "256K", "--target", &other])?;
    let _daemon = serve_owner("/tmp/vmtest/topology-serve-identity.log")?;
    let line = serve_once(IDENTITY_PORT, Some("serving"))?;
    if line.trim() != "ok" {
        return Err(format!("the reader host reported {:?}", line.trim()));
    }
    Ok(())
}

fn identity_reader() -> Result<(), String> {
    use pdstor::client::{Client, RemoteReader};
    let (stream, _serving) = from_owner(IDENTITY_PORT)?;
    let result = (|| -> Result<(), String> {
        connect()?;
        let (mine, other) = (fabric_namespace_n(1)?, fabric_namespace_n(2)?);
        let server = format!("http://{CONTROL}");
        let owner = Client::new(&server).namespace().map_err(|e| format!("the owner's namespace: {e}"))?;
        let r =
            RemoteReader::open(&server, &mine).map_err(|e| format!("the owner's namespace over the fabric: {e}"))?;
        if owner.device.uuid.is_none() || r.device_ids().uuid != owner.device.uuid {
            return Err(format!(
                "the NVMe identity was not proven: here {:?}, at the owner {:?}",
                r.device_ids(),
                owner.device
            ));
        }
        match RemoteReader::open(&server, &other) {
            Err(e) if e.to_string().contains("not the same namespace") => Ok(()),
            Err(e) => Err(format!("namespace 2 was refused for another reason: {e}")),
            Ok(_) => Err("namespace 2, another pdstor namespace, was accepted as the owner's".into()),
        }
    })();
    let report = match &result {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("fail {e}"),
    };
    let _ = (&stream).write_all(format!("{report}\n").as_bytes());
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}
