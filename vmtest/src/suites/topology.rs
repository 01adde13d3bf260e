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
    DiskRole, KILL_ME, NVME_TCP_PORT, Outcome, POWER_CUT_ME, READER_ADDR, REPORT_PORT, SHARED_NQN, SHARED_SERIAL,
    STORAGE_ADDR,
};

pub const SUITE: Suite = Suite {
    name: "topology",
    tests: &[
        Test { name: "shared_namespace_over_nvme_tcp", disk: None, run: shared_namespace },
        Test { name: "the_reader_proves_it_sees_the_owners_namespace", disk: None, run: identity },
        Test { name: "handoff_to_a_reader_host", disk: None, run: handoff },
        Test { name: "a_published_chunk_is_visible_to_the_reader_host_through_no_cache", disk: None, run: visibility },
        Test { name: "ready_is_at_the_target_before_the_writer_host_is_gone", disk: None, run: durability },
        Test { name: "the_owner_restarts_while_a_reader_host_loads", disk: None, run: restarts },
        // The storage guest loses power in it and boots again at it.
        Test { name: POWER_TEST, disk: None, run: power_cut },
        Test { name: "a_fenced_reader_host_is_cut_off_by_its_reservation", disk: None, run: reservation },
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
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let owner_tl = "/tmp/vmtest/topology-owner.jsonl";
    let _ = std::fs::remove_file(owner_tl);
    let daemon = start_owner_with(
        &dev,
        "/tmp/vmtest/topology-serve.log",
        &["--provenance", "--require-native", "--timeline", owner_tl],
    )?;
    let server = format!("http://{CONTROL}");
    let socket = DATA_SOCKET;
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, HANDOFF_CHUNKS).map_err(|e| e.to_string())?;
    let published =
        w.put("topology-1", &kv_layout(), &handoff_payload(), 8, Some(42)).map_err(|e| format!("put: {e}"))?;
    console(&format!("pdstor-vminit: topology writer published {} chunks", HANDOFF_CHUNKS));
    // Hand the reader its READY receipt; wait for its report.
    let receipt = serde_json::to_string(&published.receipt).map_err(|e| e.to_string())?;
    let line = serve_once(HANDOFF_PORT, Some(&receipt))?;
    let Some(reader_lines) = line.trim().strip_prefix("ok ") else {
        return Err(format!("the reader host reported {:?}", line.trim()));
    };
    let left = Client::new(&server).publications(None, false).map_err(|e| e.to_string())?;
    if !left.is_empty() {
        return Err(format!("after the reader host's ack the owner still holds {left:?}"));
    }
    drop(daemon);
    // Both hosts' timelines, merged by the messages between them, checked.
    let reader_lines: Vec<String> = parse("the reader host's timeline", reader_lines)?;
    let reader_tl = "/tmp/vmtest/topology-reader-host.jsonl";
    std::fs::write(reader_tl, reader_lines.join("\n") + "\n").map_err(|e| e.to_string())?;
    let merged = "/tmp/vmtest/topology-merged.jsonl";
    sh("/bin/pdstor", &["timeline", "merge", owner_tl, reader_tl, "-o", merged])?;
    let report = sh("/bin/pdstor", &["timeline", "check", "--require-path", "host_fixed", merged])?;
    let nodes: std::collections::BTreeSet<String> = pdstor::timeline::read(Path::new(merged))
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter_map(|(_, e)| e.ok().map(|e| e.node))
        .collect();
    let want_events = format!("{} payload events", 2 * HANDOFF_CHUNKS);
    if !report.contains(&want_events) || !nodes.iter().any(|n| n.starts_with("remote-")) {
        return Err(format!("the merged timeline of nodes {nodes:?} checked as {report:?}"));
    }
    console(&format!("pdstor-vminit: topology merged timeline of {nodes:?}: {}", report.trim()));
    Ok(())
}

/// Listens on the storage address for the reader guest, sends it `send` (if
/// any), and returns the line it answers (then says `bye`).
fn serve_once(port: u16, send: Option<&str>) -> Result<String, String> {
    let mut peer = Peer::accept(port)?;
    if let Some(send) = send {
        peer.send(send)?;
    }
    let line = peer.recv()?;
    let _ = peer.send("bye");
    Ok(line)
}

fn handoff_reader() -> Result<(), String> {
    use pdstor::client::RemoteReader;
    let (mut peer, line) = from_owner(HANDOFF_PORT)?;
    let result = (|| -> Result<String, String> {
        let ready: pdstor::protocol::Receipt =
            serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
        let server = format!("http://{CONTROL}");
        connect()?;
        let dev = fabric_namespace()?;
        let tl = "/tmp/vmtest/topology-reader-host.jsonl";
        let _ = std::fs::remove_file(tl);
        let timeline = pdstor::timeline::Timeline::open(Path::new(tl), "remote-reader-host")
            .map_err(|e| format!("the reader host's timeline: {e}"))?;
        let judge = pdstor::provenance::ProbeJudge::attach()?;
        let mut r = RemoteReader::open(&server, &dev)
            .map_err(|e| e.to_string())?
            .with_judge(Box::new(judge))
            .with_timeline(std::sync::Arc::new(timeline));
        let claim = r.claim(&ready, "decode-remote", "topology", 120_000).map_err(|e| format!("claim: {e}"))?;
        let restored = r.get(&claim, &kv_layout()).map_err(|e| format!("get --direct {}: {e}", dev.display()))?;
        // The reader host's own probes judge its reads from the fabric.
        if r.verdicts().len() != HANDOFF_CHUNKS as usize || r.verdicts().iter().any(|v| v != "native") {
            return Err(format!("the reader host's probes judged its loads {:?}", r.verdicts()));
        }
        let bytes = r.restored_bytes(restored.len).map_err(|e| e.to_string())?;
        if let Some(at) = payload::first_difference(&handoff_payload(), &bytes) {
            return Err(format!("the restored bytes differ from the writer's at byte {at}"));
        }
        r.ack(&claim, &restored).map_err(|e| format!("ack: {e}"))?;
        let lines: Vec<String> =
            std::fs::read_to_string(tl).map_err(|e| format!("reading {tl}: {e}"))?.lines().map(str::to_owned).collect();
        json(&lines)
    })();
    let report = match &result {
        Ok(lines) => format!("ok {lines}"),
        Err(e) => format!("fail {e}"),
    };
    let _ = peer.send(&report);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result.map(drop)
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
fn from_owner(port: u16) -> Result<(Peer, String), String> {
    let mut peer = Peer::dial(port)?;
    let line = peer.recv()?;
    Ok((peer, line))
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

/// Namespace 3: a small file-backed namespace on the ext4 disk, small
/// enough for a writer to fill every free slot of it in seconds.
fn small_namespace(ctx: &Ctx) -> Result<PathBuf, String> {
    Ok(ctx.disk(DiskRole::Ext4)?.mount.as_ref().ok_or("the ext4 disk is not mounted")?.join("topology-small.img"))
}

/// Exports the raw disk (1), the faulty one (2) and the small namespace (3).
fn export_all(ctx: &Ctx, hosts: Option<&[&str]>) -> Result<(), String> {
    let (raw, faulty) = (ctx.disk(DiskRole::Raw)?.block.clone(), ctx.disk(DiskRole::Faulty)?.block.clone());
    export(&[raw.as_path(), faulty.as_path(), small_namespace(ctx)?.as_path()], hosts)
}

/// Exports `devices` as namespaces 1, 2, … of [`SHARED_NQN`] on NVMe/TCP at
/// the storage address: to `hosts` only, or (None) to any host (the network
/// is private to the test). Each namespace has a fixed UUID, which every host
/// that reaches it over the fabric sees.
fn export(devices: &[&Path], hosts: Option<&[&str]>) -> Result<(), String> {
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
    match hosts {
        None => write(&subsys.join("attr_allow_any_host"), "1")?,
        Some(hosts) => {
            for h in hosts {
                allow_host(h)?;
            }
        }
    }
    write(&subsys.join("attr_serial"), SHARED_SERIAL)?;
    for (i, device) in devices.iter().enumerate() {
        let ns = subsys.join(format!("namespaces/{}", i + 1));
        mk(&ns)?;
        write(&ns.join("device_path"), &device.to_string_lossy())?;
        // QEMU's emulated NVMe reports no namespace identifiers to Linux
        // (its controller is quirked NVME_QUIRK_BOGUS_NID), so the target
        // gives each namespace a fixed UUID, as an array names its own.
        write(&ns.join("device_uuid"), &format!("5d5e1000-0000-4000-8000-{:012x}", i + 1))?;
        // Persistent reservations, where this kernel's target has them (set
        // before the namespace is enabled).
        if ns.join("resv_enable").exists() {
            write(&ns.join("resv_enable"), "1")?;
        }
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
    let small = small_namespace(ctx)?;
    std::fs::File::create(&small)
        .and_then(|f| f.set_len(SMALL_NAMESPACE))
        .map_err(|e| format!("creating {}: {e}", small.display()))?;
    export_all(ctx, None)?;
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
    let mut peer = Peer::dial(REPORT_PORT)?;
    peer.send(&report)?;
    let _ = peer.recv();
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
    reclaim_refused(&c, &claim, "before fencing")?;
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
    let (mut peer, line) = from_owner(DEATH_PORT)?;
    let ready: pdstor::protocol::Receipt =
        serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let claim = c.claim(&ready, "decode-doomed", "doomed", 600_000).map_err(|e| format!("claim: {e}"))?;
    let r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
    r.check_namespace(&claim).map_err(|e| e.to_string())?;
    let m =
        c.adopt(&pdstor::api::wire::AdoptRequest::of_claim(&claim, kv_layout())).map_err(|e| format!("adopt: {e}"))?;
    // Mid-load: half the chunks read, nothing reported, no ack.
    for chunk in m.chunks.iter().take(m.chunks.len() / 2) {
        dd_direct(&dev, chunk.offset.0, chunk.len)?;
    }
    let heartbeat = TcpListener::bind((READER_ADDR, HEARTBEAT_PORT)).map_err(|e| format!("heartbeat: {e}"))?;
    std::thread::spawn(move || for _ in heartbeat.incoming() {});
    let claim_json = serde_json::to_string(&claim).map_err(|e| e.to_string())?;
    peer.send(&format!("adopted {claim_json}"))?;
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
    let d = fabric_namespace()?;
    format_namespace(&d)?;
    start_owner(&d, log)
}

fn format_namespace(d: &Path) -> Result<(), String> {
    let d = d.to_string_lossy();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "256K", "--target", &d]).map(drop)
}

/// Serves the formatted namespace `d` (the writer host's fabric view) on the
/// private network; a prepare waits at most 2 s for capacity.
fn start_owner(d: &Path, log: &str) -> Result<super::protocol::Daemon, String> {
    start_owner_with(d, log, &[])
}

fn start_owner_with(d: &Path, log: &str, extra: &[&str]) -> Result<super::protocol::Daemon, String> {
    use pdstor::client::Client;
    let d = d.to_string_lossy().into_owned();
    let socket = DATA_SOCKET;
    let _ = std::fs::remove_file(socket);
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let child = std::process::Command::new("/bin/pdstor")
        .args(["serve", "--listen", CONTROL, "--insecure-tcp", "--data-socket", socket, "--target", &d])
        .args(["--admission-timeout-ms", "2000"])
        .args(extra)
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
    let (mut peer, _serving) = from_owner(IDENTITY_PORT)?;
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
    let _ = peer.send(&report);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// A line-by-line conversation between the owner (storage guest, which
/// listens) and the reader host (which dials), on the private network.
struct Peer {
    stream: TcpStream,
    lines: BufReader<TcpStream>,
}

impl Peer {
    fn accept(port: u16) -> Result<Peer, String> {
        let listener = TcpListener::bind((STORAGE_ADDR, port)).map_err(|e| format!("listening on {port}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(240);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(format!("no reader host connected on port {port} within 240 s: {e}")),
            }
        };
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        Peer::over(stream)
    }

    fn dial(port: u16) -> Result<Peer, String> {
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            match TcpStream::connect((STORAGE_ADDR, port)) {
                Ok(s) => return Peer::over(s),
                Err(e) if Instant::now() > deadline => return Err(format!("the owner never answered on {port}: {e}")),
                Err(_) => std::thread::sleep(Duration::from_millis(300)),
            }
        }
    }

    fn over(stream: TcpStream) -> Result<Peer, String> {
        stream.set_read_timeout(Some(Duration::from_secs(240))).map_err(|e| e.to_string())?;
        let lines = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        Ok(Peer { stream, lines })
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        self.stream.write_all(format!("{line}\n").as_bytes()).map_err(|e| format!("sending {line:?}: {e}"))
    }

    fn recv(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.lines.read_line(&mut line) {
            Ok(0) => Err("the peer closed the conversation".into()),
            Ok(_) => Ok(line.trim_end().to_owned()),
            Err(e) => Err(format!("waiting for the peer: {e}")),
        }
    }

    /// Sends the outcome of this side's work: `ok`, or `fail <why>`.
    fn report(&mut self, r: &Result<(), String>) {
        let _ = self.send(&match r {
            Ok(()) => "ok".to_owned(),
            Err(e) => format!("fail {}", e.replace('\n', " ")),
        });
    }

    /// Waits for the peer's outcome.
    fn outcome(&mut self) -> Result<(), String> {
        match self.recv()?.as_str() {
            "ok" => Ok(()),
            other => Err(format!("the peer reported {other:?}")),
        }
    }
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, String> {
    serde_json::to_string(v).map_err(|e| e.to_string())
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Result<T, String> {
    serde_json::from_str(s).map_err(|e| format!("{what} {s:?}: {e}"))
}

fn api(what: &str) -> impl FnOnce(pdstor::client::ClientError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Reads `len` bytes at `offset` of `dev`, held open, through this host's
/// page cache (no `O_DIRECT`), as a careless reader would. (Held open: the
/// last close of a block device drops its page cache.)
fn read_cached(dev: &std::fs::File, offset: u64, len: u64) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::FileExt;
    let mut out = vec![0u8; len as usize];
    dev.read_exact_at(&mut out, offset).map_err(|e| format!("a cached read of {len} bytes at {offset}: {e}"))?;
    Ok(out)
}

/// The chunks' places on the target, as the owner lists them (`?verbose=1`).
fn extents(c: &pdstor::client::Client, publication: u64) -> Result<Vec<pdstor::api::wire::Extent>, String> {
    let infos = c.publications(None, true).map_err(api("listing the publications"))?;
    let p = infos
        .into_iter()
        .find(|p| p.publication == publication)
        .ok_or_else(|| format!("publication {publication} is not listed"))?;
    p.extents.ok_or_else(|| format!("publication {publication} is listed without its extents"))
}

/// Checks, outside pdstor, that each extent on `dev` holds the writer's chunk.
fn same_bytes(dev: &Path, extents: &[pdstor::api::wire::Extent], want: &[u8], what: &str) -> Result<(), String> {
    for e in extents {
        let len = e.len.unwrap_or(HANDOFF_CHUNK);
        let got = dd_direct(dev, e.offset, len)?;
        let at = e.chunk as usize * HANDOFF_CHUNK as usize;
        if got[..] != want[at..at + len as usize] {
            return Err(format!(
                "{what}: chunk {} at byte {} of {} is not the writer's",
                e.chunk,
                e.offset,
                dev.display()
            ));
        }
    }
    Ok(())
}

/// A block device's completed flush requests (`/sys/block/*/stat`, field 16).
fn flushes(dev: &Path) -> Result<u64, String> {
    let name = dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).map_err(|e| format!("{name} stat: {e}"))?;
    stat.split_whitespace()
        .nth(15)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{name} stat has no flush count: {stat:?}"))
}

/// The size of namespace 3, the small file-backed one.
const SMALL_NAMESPACE: u64 = 12 << 20;

fn seeded(seed: u64, chunks: u32) -> Vec<u8> {
    (0..chunks as u64).flat_map(|i| payload::chunk(seed, i, HANDOFF_CHUNK as usize)).collect()
}

const VISIBLE_PORT: u16 = 7077;
const VISIBLE_CHUNKS: u32 = 8;

/// Visibility without a cache. The reader host reads the whole small
/// namespace through its page cache first, so any stale copy a cache could
/// serve is there. The writer then publishes new bytes: the reader host's
/// cached read still shows the old ones (the hazard is real), and its
/// `O_DIRECT` load shows the new ones, verified and acked. Then the writer
/// stores chunks and never publishes them — stored, never flushed — and its
/// daemon is killed: while stored the publication is PREPARED (no READY
/// receipt exists to claim it), and the restarted daemon rolls it back: an
/// unflushed write never became READY.
fn visibility(_: &Ctx) -> Outcome {
    by_role(visible_owner, visible_reader)
}

fn visible_owner() -> Result<(), String> {
    use pdstor::client::{Client, Writer};
    let dev = fabric_namespace_n(3)?;
    format_namespace(&dev)?;
    let log = "/tmp/vmtest/topology-serve-visible.log";
    let daemon = start_owner(&dev, log)?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let mut peer = Peer::accept(VISIBLE_PORT)?;
    peer.send("serving")?;
    if peer.recv()? != "cached" {
        return Err("the reader host did not read the namespace through its cache".into());
    }
    let mut w =
        Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, VISIBLE_CHUNKS).map_err(|e| e.to_string())?;
    let fresh = w.put("visible", &kv_layout(), &seeded(0x7151, VISIBLE_CHUNKS), 4, Some(42)).map_err(api("put"))?;
    let at = extents(&c, fresh.receipt.publication)?;
    peer.send(&format!("{} {}", json(&fresh.receipt)?, json(&at)?))?;
    peer.outcome()?;
    // Stored, never published (so never flushed by pdstor), then the daemon dies.
    let (p, _data) = store_unpublished(&c, "unflushed", &seeded(0x7152, 4))?;
    let listed = c.publications(None, false).map_err(api("listing"))?;
    let state = listed.iter().find(|i| i.publication == p.publication).map(|i| i.state.clone());
    if state.as_deref() != Some("PREPARED") {
        return Err(format!("stored but unpublished, publication {} is {state:?}, not PREPARED", p.publication));
    }
    peer.send(&format!("stored {}", p.publication))?;
    peer.outcome()?;
    kill9(daemon)?;
    let _daemon = start_owner(&dev, log)?;
    let c = Client::new(&server);
    if let Some(p) =
        c.publications(None, false).map_err(api("listing"))?.iter().find(|i| i.publication == p.publication)
    {
        return Err(format!("after the restart the unflushed publication is {}", p.state));
    }
    peer.send("rolled back")?;
    peer.outcome()
}

fn visible_reader() -> Result<(), String> {
    use pdstor::client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let mut peer = Peer::dial(VISIBLE_PORT)?;
    let result = (|| -> Result<(), String> {
        peer.recv()?;
        // Everything the namespace holds now, into this host's page cache.
        let held = std::fs::File::open(&dev).map_err(|e| format!("opening {}: {e}", dev.display()))?;
        let before = read_cached(&held, 0, SMALL_NAMESPACE)?;
        peer.send("cached")?;
        let line = peer.recv()?;
        let (receipt, at) = line.split_once(' ').ok_or_else(|| format!("the owner sent {line:?}"))?;
        let ready: pdstor::protocol::Receipt = parse("the receipt", receipt)?;
        let at: Vec<pdstor::api::wire::Extent> = parse("the extents", at)?;
        let want = seeded(0x7151, VISIBLE_CHUNKS);
        // Through the cache: the old bytes (the hazard O_DIRECT avoids).
        let stale = at.iter().filter(|e| {
            let cached = read_cached(&held, e.offset, HANDOFF_CHUNK).unwrap_or_default();
            let at = e.chunk as usize * HANDOFF_CHUNK as usize;
            cached[..] == before[e.offset as usize..(e.offset + HANDOFF_CHUNK) as usize]
                && cached[..] != want[at..at + HANDOFF_CHUNK as usize]
        });
        if stale.count() != at.len() {
            return Err("a buffered read already saw the new bytes: this proof needs the cache to be stale".into());
        }
        // Without a cache: the new bytes, verified.
        let server = format!("http://{CONTROL}");
        let claim = Client::new(&server).claim(&ready, "decode-visible", "visible", 120_000).map_err(api("claim"))?;
        let mut r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
        let restored = r.get(&claim, &kv_layout()).map_err(api("get --direct"))?;
        if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
            return Err("the O_DIRECT load did not restore the published bytes".into());
        }
        r.ack(&claim, &restored).map_err(api("ack"))?;
        peer.send("ok")?;
        // A stored, unflushed publication: listed PREPARED, no READY receipt to claim.
        let line = peer.recv()?;
        let n: u64 = line.strip_prefix("stored ").and_then(|n| n.parse().ok()).ok_or(format!("owner: {line:?}"))?;
        let listed = r.client.publications(Some("READY"), false).map_err(api("listing"))?;
        if listed.iter().any(|p| p.publication == n) {
            return Err(format!("the unflushed publication {n} is listed READY"));
        }
        peer.send("ok")?;
        if peer.recv()? != "rolled back" {
            return Err("the owner did not roll the unflushed publication back".into());
        }
        Ok(())
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

const DURABLE_PORT: u16 = 7080;
const DURABLE_CHUNKS: u32 = 16;

/// Durability through the fabric. The writer host publishes; its publish
/// must have sent an NVMe Flush over TCP that reached the target's own
/// device (the flush counts of the writer host's fabric view and of the
/// target's backing NVMe both grow). The moment READY is answered the
/// writer's daemon is killed and the writer host's NVMe/TCP connection
/// dropped; the reader host reads every chunk at once, `O_DIRECT`, and
/// finds the writer's bytes (compared outside pdstor). Then the writer host
/// reconnects, its daemon recovers the READY publication, and the reader
/// host claims, loads and acks it.
fn durability(ctx: &Ctx) -> Outcome {
    by_role(|| durable_owner(ctx), durable_reader)
}

fn durable_owner(ctx: &Ctx) -> Result<(), String> {
    use pdstor::client::Client;
    let backing = ctx.disk(DiskRole::Raw)?.block.clone();
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let log = "/tmp/vmtest/topology-serve-durable.log";
    let daemon = start_owner(&dev, log)?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let mut peer = Peer::accept(DURABLE_PORT)?;
    let payload = seeded(0xd0ab, DURABLE_CHUNKS);
    // Stored (not yet flushed by pdstor); then the publish alone is watched.
    let (p, _data) = store_unpublished(&c, "durable", &payload)?;
    let (fabric_before, target_before) = (flushes(&dev)?, flushes(&backing)?);
    let published = c.publish(p.publication, &p.writer_token, Some(42)).map_err(api("publish"))?;
    let (fabric_after, target_after) = (flushes(&dev)?, flushes(&backing)?);
    let at = extents(&c, published.receipt.publication)?;
    // READY answered: the writer host is gone at once.
    kill9(daemon)?;
    sh("nvme", &["disconnect", "-n", SHARED_NQN])?;
    // The writer host's view is a multipath head whose counters may not
    // count; the target's own device must.
    if target_after <= target_before {
        return Err(format!(
            "the publish sent no flush through the fabric: the writer host's view flushed {} times, the target's device {} times",
            fabric_after - fabric_before,
            target_after - target_before
        ));
    }
    console(&format!(
        "pdstor-vminit: topology publish: {} flush requests reached the target's device ({} counted on the writer host's multipath view)",
        target_after - target_before,
        fabric_after - fabric_before,
    ));
    peer.send(&format!("gone {}", json(&at)?))?;
    peer.outcome()?;
    // Back: the writer host reconnects and its daemon recovers READY.
    connect_as(WRITER_HOSTNQN, WRITER_HOSTID)?;
    let dev = fabric_namespace()?;
    let _daemon = start_owner(&dev, log)?;
    peer.send(&json(&published.receipt)?)?;
    peer.outcome()?;
    let left = Client::new(&server).publications(None, false).map_err(api("listing"))?;
    if !left.is_empty() {
        return Err(format!("after the reader host's ack the owner holds {left:?}"));
    }
    Ok(())
}

fn durable_reader() -> Result<(), String> {
    use pdstor::client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace()?;
    let mut peer = Peer::dial(DURABLE_PORT)?;
    let result = (|| -> Result<(), String> {
        let line = peer.recv()?;
        let at: Vec<pdstor::api::wire::Extent> =
            parse("the extents", line.strip_prefix("gone ").ok_or(format!("the owner sent {line:?}"))?)?;
        let want = seeded(0xd0ab, DURABLE_CHUNKS);
        same_bytes(&dev, &at, &want, "read right after READY with the writer host gone")?;
        peer.send("ok")?;
        let ready: pdstor::protocol::Receipt = parse("the receipt", &peer.recv()?)?;
        let server = format!("http://{CONTROL}");
        let claim = Client::new(&server).claim(&ready, "decode-durable", "durable", 120_000).map_err(api("claim"))?;
        let mut r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
        let restored = r.get(&claim, &kv_layout()).map_err(api("get --direct"))?;
        if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
            return Err("the recovered publication did not restore the published bytes".into());
        }
        r.ack(&claim, &restored).map_err(api("ack"))
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

const RESTART_PORT: u16 = 7079;
const RESTART_CHUNKS: u32 = 16;
/// Where the owner's daemon is killed while the reader host loads.
const POINTS: [&str; 4] = ["claimed", "adopted", "half_read", "reported"];

/// The owner's daemon killed (`kill -9`) while a reader host loads, at four
/// points: after its claim, after its adopt, with half the chunks read, and
/// with every chunk read and reported but not acked. Each time the daemon
/// restarts (a new epoch) and a writer at once takes every slot admission
/// gives it; the reader host then reads every chunk again outside pdstor and
/// through it, and finds the writer's bytes — nothing it may still read was
/// reused — and acks with its old receipt. Claimed but not adopted, it never
/// learned where the chunks are: the restart fences it, its adopt is refused
/// `fenced`, and only then may its slots be reclaimed.
fn restarts(_: &Ctx) -> Outcome {
    by_role(restart_owner, restart_reader)
}

fn restart_payload(i: usize) -> Vec<u8> {
    seeded(0x4e57 + i as u64, RESTART_CHUNKS)
}

fn restart_owner() -> Result<(), String> {
    use pdstor::client::{Client, Writer};
    let dev = fabric_namespace_n(3)?;
    format_namespace(&dev)?;
    let log = "/tmp/vmtest/topology-serve-restart.log";
    let mut daemon = start_owner(&dev, log)?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::accept(RESTART_PORT)?;
    for (i, point) in POINTS.iter().enumerate() {
        let mut w =
            Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, RESTART_CHUNKS).map_err(|e| e.to_string())?;
        let published =
            w.put(&format!("restart-{point}"), &kv_layout(), &restart_payload(i), 8, Some(42)).map_err(api("put"))?;
        peer.send(&format!("{point} {}", json(&published.receipt)?))?;
        let line = peer.recv()?;
        let claim: pdstor::protocol::Receipt =
            parse("the claim", line.strip_prefix(&format!("at {point} ")).ok_or(format!("reader: {line:?}"))?)?;
        kill9(daemon)?;
        daemon = start_owner(&dev, log)?;
        let c = Client::new(&server);
        // An eager operator's reclaim: refused while a direct reader may
        // still read the slots (the restart did not stop that host).
        if *point != "claimed" {
            reclaim_refused(&c, &claim, &format!("killed at {point}, after the restart"))?;
        }
        // A writer takes every slot it can.
        let fillers = fill_free_slots(&server, &format!("fill-{point}"), 0xf111)?;
        let held = c.publications(None, false).map_err(api("listing"))?;
        let state = held.iter().find(|p| p.publication == claim.publication).map(|p| p.state.clone());
        console(&format!(
            "pdstor-vminit: topology owner killed at {point}: restarted, {} fillers took every free slot, the reader's publication is {state:?}",
            fillers.len()
        ));
        peer.send(&format!("restarted {}", fillers.len()))?;
        let outcome = peer.recv()?;
        match (*point, outcome.as_str()) {
            ("claimed", "refused fenced") => c.reclaim(&claim).map_err(api("reclaiming the fenced claim"))?,
            ("claimed", other) => return Err(format!("killed after the claim: the reader host reported {other:?}")),
            (_, "acked") => {}
            (_, other) => return Err(format!("killed at {point}: the reader host reported {other:?}")),
        }
        if let Some(p) =
            c.publications(None, false).map_err(api("listing"))?.iter().find(|p| p.publication == claim.publication)
        {
            return Err(format!("killed at {point}: after the reader's outcome its publication is {}", p.state));
        }
        for f in &fillers {
            c.release(f).map_err(api("releasing a filler"))?;
        }
    }
    peer.send("done")?;
    peer.outcome()
}

fn restart_reader() -> Result<(), String> {
    use pdstor::client::{ClientError, RemoteReader};
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::dial(RESTART_PORT)?;
    let mut reader: Option<RemoteReader> = None;
    let result = (|| -> Result<(), String> {
        loop {
            let line = peer.recv()?;
            if line == "done" {
                return Ok(());
            }
            let (point, receipt) = line.split_once(' ').ok_or(format!("the owner sent {line:?}"))?;
            let i = POINTS.iter().position(|p| *p == point).ok_or(format!("unknown point {point:?}"))?;
            let ready: pdstor::protocol::Receipt = parse("the receipt", receipt)?;
            let r = match &mut reader {
                Some(r) => r,
                None => reader.insert(RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?),
            };
            let want = restart_payload(i);
            let claim =
                r.client.claim(&ready, "decode-remote", &format!("restart-{point}"), 600_000).map_err(api("claim"))?;
            let (mut manifest, mut restored) = (None, None);
            if point != "claimed" {
                let m = r.adopt(&claim, &kv_layout()).map_err(api("adopt"))?;
                if point == "half_read" {
                    let half = manifest_extents(&m, m.chunks.len() / 2);
                    same_bytes(&dev, &half, &want, "half read before the kill")?;
                }
                if point == "reported" {
                    restored = Some(r.load(&claim, m.clone()).map_err(api("load"))?);
                }
                manifest = Some(m);
            }
            peer.send(&format!("at {point} {}", json(&claim)?))?;
            let restarted = peer.recv()?;
            if !restarted.starts_with("restarted ") {
                return Err(format!("the owner sent {restarted:?}"));
            }
            let Some(m) = manifest else {
                match r.adopt(&claim, &kv_layout()) {
                    Err(ClientError::Api(b)) if b.code == "fenced" => peer.send("refused fenced")?,
                    other => return Err(format!("adopting after the restart that fenced the claim: {other:?}")),
                }
                continue;
            };
            // Every chunk again, after the writer filled every slot it was given.
            let all = manifest_extents(&m, m.chunks.len());
            same_bytes(&dev, &all, &want, &format!("read after the owner was killed at {point}"))?;
            let restored = match restored {
                Some(done) => done,
                None => r.load(&claim, m).map_err(api("load after the restart"))?,
            };
            if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
                return Err(format!("killed at {point}: the restored bytes are not the writer's"));
            }
            r.ack(&claim, &restored).map_err(api("ack with the old receipt"))?;
            peer.send("acked")?;
        }
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// The first `n` chunks' places, as the adopted manifest gives them.
fn manifest_extents(m: &pdstor::store::Manifest, n: usize) -> Vec<pdstor::api::wire::Extent> {
    m.chunks
        .iter()
        .take(n)
        .map(|c| pdstor::api::wire::Extent {
            chunk: c.index,
            slot: 0,
            offset: c.offset.0,
            len: Some(c.len),
            crc32c: Some(c.crc32c),
        })
        .collect()
}

/// prepare → store every chunk of `payload` in one batch, not published
/// (so never flushed by pdstor): the publication stays PREPARED.
fn store_unpublished(
    c: &pdstor::client::Client,
    req_id: &str,
    payload: &[u8],
) -> Result<(pdstor::protocol::service::Prepared, pdstor::client::DataConn), String> {
    let n = (payload.len() as u64 / HANDOFF_CHUNK) as u32;
    let p = c.prepare(req_id, &kv_layout(), n, "w-topology").map_err(api("prepare"))?;
    let mut data = pdstor::client::DataConn::connect(Path::new(DATA_SOCKET)).map_err(api("the data plane"))?;
    let buf = pdstor::Buffer::memfd(req_id, payload.len()).map_err(|e| e.to_string())?;
    buf.write_at(0, payload).map_err(|e| e.to_string())?;
    let id = data.register(&buf).map_err(api("registering"))?;
    let chunks = (0..n)
        .map(|i| pdstor::api::wire::DataChunk {
            index: i,
            buffer: id,
            offset: i as u64 * HANDOFF_CHUNK,
            len: HANDOFF_CHUNK,
            crc32c: None,
        })
        .collect();
    data.store(p.publication, &p.writer_token, chunks, true, n).map_err(api("store"))?;
    Ok((p, data))
}

const RESERVE_PORT: u16 = 7081;
const RESERVE_CHUNKS: u32 = 8;
const OWNER_KEY: u64 = 0x5d0e;
const READER_KEY: u64 = 0x5d0f;

/// Whether this kernel's NVMe target does persistent reservations (Debian's
/// 6.12 nvmet does not: it has no `resv_enable`; the series kernel, 7.2, does).
/// Both guests boot the same kernel, so both sides answer alike.
fn nvmet_has_reservations() -> bool {
    std::fs::read_to_string("/proc/kallsyms").is_ok_and(|k| k.contains(" nvmet_parse_pr_cmd"))
}

/// Fencing a direct reader cuts its host off at the target. The owner
/// serves with `--reservation-key`: it holds the namespace's Exclusive
/// Access — Registrants Only reservation. An unregistered reader host can
/// read nothing (the target refuses, and pdstor's reader says to register a
/// key before it tries); a registered one claims, adopts naming its key, and
/// reads half. The owner's reclaim is refused (`not_fenced`); closing the
/// reader's session preempts its key; the reclaim frees the slots and a new
/// publication takes them. The reader host is alive, and can read none of
/// it any more: the target refuses its commands, and its report is refused.
fn reservation(_: &Ctx) -> Outcome {
    if !nvmet_has_reservations() {
        return outcome(Err(
            "SKIP: this kernel's NVMe target has no persistent reservations (Debian's 6.12 nvmet has no resv_enable); the rw-dmabuf series kernel (7.2) runs this test"
                .into(),
        ));
    }
    by_role(reserve_owner, reserve_reader)
}

fn reserve_owner() -> Result<(), String> {
    use pdstor::client::{Client, Writer};
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let key = format!("{OWNER_KEY:#x}");
    let daemon =
        start_owner_with(&dev, "/tmp/vmtest/topology-serve-reserve.log", &["--reservation-key", key.as_str()])?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let result = (|| -> Result<(), String> {
        if !c.namespace().map_err(api("the namespace"))?.reservations {
            return Err("the owner does not say it holds a reservation".into());
        }
        let mut peer = Peer::accept(RESERVE_PORT)?;
        let mut w =
            Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, RESERVE_CHUNKS).map_err(|e| e.to_string())?;
        let published =
            w.put("reserved", &kv_layout(), &seeded(0x5e5, RESERVE_CHUNKS), 4, Some(42)).map_err(api("put"))?;
        peer.send(&json(&published.receipt)?)?;
        let line = peer.recv()?;
        let claim: pdstor::protocol::Receipt =
            parse("the claim", line.strip_prefix("adopted ").ok_or(format!("reader: {line:?}"))?)?;
        reclaim_refused(&c, &claim, "before fencing")?;
        c.close_session(&claim).map_err(api("fencing the reader (its key preempted)"))?;
        c.reclaim(&claim).map_err(api("reclaim after fencing"))?;
        // New bytes where the reader's were.
        w.put("after-fence", &kv_layout(), &seeded(0x5e6, RESERVE_CHUNKS), 4, Some(42)).map_err(api("put"))?;
        peer.send("fenced")?;
        peer.outcome()
    })();
    drop(daemon);
    // The reservation outlives the daemon (it is the host's): clear it for the tests after.
    let cleared = pdstor::io::persistent_reservation::Reservations::open(&dev)
        .and_then(|r| r.clear(OWNER_KEY))
        .map_err(|e| e.to_string());
    result.and(cleared)
}

fn reserve_reader() -> Result<(), String> {
    use pdstor::client::RemoteReader;
    connect()?;
    let dev = fabric_namespace()?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::dial(RESERVE_PORT)?;
    let result = (|| -> Result<(), String> {
        let ready: pdstor::protocol::Receipt = parse("the receipt", &peer.recv()?)?;
        // Unregistered: the target refuses this host, and pdstor says why first.
        if dd_direct(&dev, 0, 4096).is_ok() {
            return Err("an unregistered host read the reserved namespace".into());
        }
        match RemoteReader::open(&server, &dev) {
            Err(e) if e.to_string().contains("reservation key") => {}
            other => return Err(format!("an unregistered reader was not told to register: {:?}", other.err())),
        }
        let mut r = RemoteReader::open_with(&server, &dev, Some(READER_KEY)).map_err(|e| e.to_string())?;
        let claim = r.client.claim(&ready, "decode-reserved", "reserved", 600_000).map_err(api("claim"))?;
        let m = r.adopt(&claim, &kv_layout()).map_err(api("adopt"))?;
        let want = seeded(0x5e5, RESERVE_CHUNKS);
        same_bytes(&dev, &manifest_extents(&m, m.chunks.len() / 2), &want, "half read while registered")?;
        peer.send(&format!("adopted {}", json(&claim)?))?;
        if peer.recv()? != "fenced" {
            return Err("the owner did not fence this reader".into());
        }
        // Alive, and cut off: every read of the namespace is refused by the target.
        let rest = &m.chunks[m.chunks.len() / 2..];
        for c in rest {
            if let Ok(bytes) = dd_direct(&dev, c.offset.0, c.len) {
                return Err(format!(
                    "after the preempt this host still read chunk {} ({} bytes)",
                    c.index,
                    bytes.len()
                ));
            }
        }
        match r.load(&claim, m.clone()) {
            Err(e) => console(&format!("pdstor-vminit: topology fenced reader's load: {e}")),
            Ok(_) => return Err("after the preempt this host's load succeeded".into()),
        }
        Ok(())
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// Lets host `hostnqn` connect to the shared subsystem (exported to named hosts).
fn allow_host(hostnqn: &str) -> Result<(), String> {
    let nvmet = Path::new("/sys/kernel/config/nvmet");
    let host = nvmet.join("hosts").join(hostnqn);
    if !host.exists() {
        std::fs::create_dir_all(&host).map_err(|e| format!("creating {}: {e}", host.display()))?;
    }
    let link = nvmet.join("subsystems").join(SHARED_NQN).join("allowed_hosts").join(hostnqn);
    std::os::unix::fs::symlink(&host, &link).map_err(|e| format!("allowing {hostnqn}: {e}"))
}

const POWER_TEST: &str = "the_writer_host_loses_power_while_a_reader_host_loads";
/// Where the owner hands the reader its receipt before the power cut.
const POWER_PORT: u16 = 7082;
/// Where the owner, booted again, waits for the reader host.
const REBORN_PORT: u16 = 7083;
const POWER_CHUNKS: u32 = 16;

/// The writer host (with the target: it is the storage guest) loses power
/// while a reader host is mid-load: the reader has claimed, adopted and read
/// half, and has a read of the other half in flight (`dd`, outside pdstor)
/// when QEMU is killed. The guest boots again on the same disks; its target
/// comes back exporting to the writer host alone, so the reader host's queued
/// read cannot complete yet; the daemon recovers (a new epoch) with the claim
/// still ADOPTED — a reclaim is refused `not_fenced` — and a writer takes
/// every free slot admission gives it. Only then is the reader host let back
/// in: its in-flight read completes with the writer's bytes, its pdstor load
/// verifies every chunk, and it acks with its old receipt.
fn power_cut(ctx: &Ctx) -> Outcome {
    let booted_again = cmdline("resume").as_deref() == Some(POWER_TEST);
    by_role(|| if booted_again { power_owner_after(ctx) } else { power_owner_before() }, power_reader)
}

fn power_payload() -> Vec<u8> {
    seeded(0x90c0, POWER_CHUNKS)
}

fn power_owner_before() -> Result<(), String> {
    use pdstor::client::Writer;
    let dev = fabric_namespace_n(3)?;
    format_namespace(&dev)?;
    let _daemon = start_owner(&dev, "/tmp/vmtest/topology-serve-power.log")?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::accept(POWER_PORT)?;
    let mut w = Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, POWER_CHUNKS).map_err(|e| e.to_string())?;
    let published = w.put("power", &kv_layout(), &power_payload(), 8, Some(42)).map_err(api("put"))?;
    peer.send(&json(&published.receipt)?)?;
    if peer.recv()? != "reading" {
        return Err("the reader host did not start its load".into());
    }
    // Power off: no shutdown, no flush, no goodbye.
    console(&format!("{POWER_CUT_ME}{POWER_TEST}"));
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn power_owner_after(ctx: &Ctx) -> Result<(), String> {
    use pdstor::client::Client;
    // The target again, to the writer host alone for now.
    export_all(ctx, Some(&[WRITER_HOSTNQN]))?;
    connect_as(WRITER_HOSTNQN, WRITER_HOSTID)?;
    let dev = fabric_namespace_n(3)?;
    let _daemon = start_owner(&dev, "/tmp/vmtest/topology-serve-power-again.log")?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let mut peer = Peer::accept(REBORN_PORT)?;
    let result = (|| -> Result<(), String> {
        let line = peer.recv()?;
        let claim: pdstor::protocol::Receipt =
            parse("the claim", line.strip_prefix("claim ").ok_or(format!("reader: {line:?}"))?)?;
        let held = c.publications(None, false).map_err(api("listing"))?;
        let state = held.iter().find(|p| p.publication == claim.publication).map(|p| p.state.clone());
        if state.as_deref() != Some("ADOPTED") {
            return Err(format!("after the power cut the reader's publication is {state:?}, not ADOPTED"));
        }
        reclaim_refused(&c, &claim, "after the power cut")?;
        let fillers = fill_free_slots(&server, "fill-power", 0xf0f0)?;
        console(&format!(
            "pdstor-vminit: topology owner after its power cut: the reader's publication is ADOPTED, {} fillers took every free slot; letting the reader host back in",
            fillers.len()
        ));
        allow_host(READER_HOSTNQN)?;
        peer.send("allowed")?;
        match peer.recv()?.as_str() {
            "acked" => {}
            other => return Err(format!("the reader host reported {other:?}")),
        }
        if c.publications(None, false).map_err(api("listing"))?.iter().any(|p| p.publication == claim.publication) {
            return Err("the acknowledged publication is still listed".into());
        }
        for f in &fillers {
            c.release(f).map_err(api("releasing a filler"))?;
        }
        Ok(())
    })();
    peer.report(&result);
    result
}

fn power_reader() -> Result<(), String> {
    use pdstor::client::RemoteReader;
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let server = format!("http://{CONTROL}");
    let want = power_payload();
    let mut peer = Peer::dial(POWER_PORT)?;
    let ready: pdstor::protocol::Receipt = parse("the receipt", &peer.recv()?)?;
    let mut r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
    let claim = r.claim(&ready, "decode-power", "power", 900_000).map_err(api("claim"))?;
    let m = r.adopt(&claim, &kv_layout()).map_err(api("adopt"))?;
    let half = m.chunks.len() / 2;
    same_bytes(&dev, &manifest_extents(&m, half), &want, "half read before the power cut")?;
    // The other half in flight when the power goes: one dd per chunk, run by a shell.
    let script: String = m.chunks[half..]
        .iter()
        .map(|c| {
            format!(
                "dd if={} of=/tmp/vmtest/inflight-{} bs=64k iflag=direct,skip_bytes,count_bytes skip={} count={} 2>/dev/null || exit 1; ",
                dev.display(),
                c.index,
                c.offset.0,
                c.len
            )
        })
        .collect();
    let mut inflight = std::process::Command::new("sh")
        .args(["-c", &script])
        .env("PATH", "/sbin:/bin:/usr/sbin:/usr/bin")
        .spawn()
        .map_err(|e| format!("starting the in-flight read: {e}"))?;
    peer.send("reading")?;
    drop(peer);
    // The owner's host is gone; it answers again on another port once it is back.
    let mut peer = Peer::dial(REBORN_PORT)?;
    let result = (|| -> Result<(), String> {
        peer.send(&format!("claim {}", json(&claim)?))?;
        if peer.recv()? != "allowed" {
            return Err("the owner did not let this host back in".into());
        }
        let status = inflight.wait().map_err(|e| format!("the in-flight read: {e}"))?;
        if !status.success() {
            return Err(format!("the read in flight across the power cut failed: {status}"));
        }
        for c in &m.chunks[half..] {
            let got = std::fs::read(format!("/tmp/vmtest/inflight-{}", c.index)).map_err(|e| e.to_string())?;
            let at = c.index as usize * HANDOFF_CHUNK as usize;
            if got[..] != want[at..at + c.len as usize] {
                return Err(format!("chunk {} read across the power cut is not the writer's", c.index));
            }
        }
        // The whole load with pdstor, reported to the recovered daemon, acked with the old receipt.
        let restored = r.load(&claim, m.clone()).map_err(api("load after the power cut"))?;
        if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
            return Err("the load after the power cut did not restore the writer's bytes".into());
        }
        r.ack(&claim, &restored).map_err(api("ack with the old receipt"))?;
        peer.send("acked")?;
        peer.outcome()
    })();
    if result.is_err() {
        let _ = inflight.kill();
        peer.report(&result);
    }
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// Kills the owner's daemon at once (`kill -9`) and reaps it.
fn kill9(mut daemon: super::protocol::Daemon) -> Result<(), String> {
    daemon.0.kill().map_err(|e| format!("kill -9 the owner: {e}"))?;
    let _ = daemon.0.wait();
    // Reaped: its Drop would signal a pid that may be another process's by now.
    std::mem::forget(daemon);
    Ok(())
}

/// A reclaim of `claim` must be refused `not_fenced` (`when`: the moment, for the error).
fn reclaim_refused(c: &pdstor::client::Client, claim: &pdstor::protocol::Receipt, when: &str) -> Result<(), String> {
    match c.reclaim(claim) {
        Err(pdstor::client::ClientError::Api(b)) if b.code == "not_fenced" => Ok(()),
        other => Err(format!("a reclaim {when} was not refused not_fenced: {other:?}")),
    }
}

/// A writer puts 4-chunk publications (`tag-0`, `tag-1`, …, seeded from
/// `seed`) until admission refuses one: every free slot is taken. Returns
/// their READY receipts.
fn fill_free_slots(server: &str, tag: &str, seed: u64) -> Result<Vec<pdstor::protocol::Receipt>, String> {
    use pdstor::client::Writer;
    let mut fillers = Vec::new();
    let mut fill = Writer::new(server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4).map_err(|e| e.to_string())?;
    loop {
        let n = fillers.len() as u64;
        match fill.put(&format!("{tag}-{n}"), &kv_layout(), &seeded(seed + n, 4), 4, Some(42)) {
            Ok(p) => fillers.push(p.receipt),
            Err(e) if e.to_string().contains("admission") => return Ok(fillers),
            Err(e) => return Err(format!("{tag}: filling the free slots: {e}")),
        }
        if fillers.len() > 64 {
            return Err(format!("{tag}: the small namespace took more than 64 fillers"));
        }
    }
}
