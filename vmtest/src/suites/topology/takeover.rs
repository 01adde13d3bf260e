//! A standby takes a dead owner's namespace over (issue 35), at four points
//! of a handoff to a direct reader host. The owner (storage guest, its own
//! NVMe/TCP view of the small shared namespace) holds the namespace's
//! reservation with its key; a standby on the reader host (`serve --standby
//! --owner …`) registers a key of its own and watches the owner's health,
//! and a direct reader on that host (registered with the same key: a host
//! has one registration per namespace) reads through a client given both
//! addresses. The owner is killed (`kill -9`) after the publish, after the
//! reader's claim, after its adopt, and with half its chunks read; after
//! `--takeover-after-ms` the standby preempts-and-aborts exactly the key the
//! superblock names, recovers the journal into a new epoch and serves. Then:
//!
//! - every publication acknowledged READY before the kill loads byte-exact
//!   from the new owner with its old receipt (and reads the same outside
//!   pdstor), and the unpublished one is rolled back;
//! - a claim never adopted is fenced (its adopt refused `fenced`) and only
//!   then reclaimed; an adopted (direct) claim keeps its slots: a writer
//!   takes every free slot of the new owner, and the reader still reads the
//!   old writer's bytes, loads them, and acks with its old receipt;
//! - on the old owner's host the target refuses a raw `O_DIRECT` write and
//!   read (reservation conflict), and the old owner's daemon, started again
//!   with its key, refuses to serve a namespace that is no longer its own.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use crate::suites::io::dd_direct;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

const TAKEOVER_PORT: u16 = 7083;

/// The standby's key (the owner's is [`OWNER_KEY`]).
const STANDBY_KEY: u64 = 0x5d10;

/// The direct reader's key (its host: [`THIRD_HOSTNQN`] on the reader guest).
const READER_KEY: u64 = 0x5d13;

/// The standby's control plane, on the reader host.
const STANDBY_CONTROL: &str = "10.77.0.2:7078";

/// Where the owner is killed: after the publish, after the reader's claim,
/// after its adopt, with half its chunks read.
const POINTS: [&str; 4] = ["published", "claimed", "adopted", "half_read"];

/// Publications acknowledged before the kill, each of [`CHUNKS`] chunks.
const KEPT: u32 = 2;

const CHUNKS: u32 = 8;

/// The small namespace (3): a writer fills every free slot of it in seconds.
const NAMESPACE: u32 = 3;

fn kept_payload(point: usize, i: u32) -> Vec<u8> {
    seeded(0x7a00 + 0x10 * point as u64 + i as u64, CHUNKS)
}

/// What the owner tells the reader host before the kill: the READY
/// receipts and the one stored but never published.
type Handed = (Vec<pdstor_client::receipt::Receipt>, u64);

pub(super) fn takeover(_: &Ctx) -> Checked {
    needs_reservations(", so a standby cannot fence an owner and refuses to start")?;
    by_role(takeover_owner, takeover_standby)
}

fn takeover_owner() -> Checked {
    let dev = fabric_namespace_n(NAMESPACE)?;
    let mut peer = Peer::accept(TAKEOVER_PORT)?;
    let result = (|| -> Checked {
        for (i, point) in POINTS.iter().enumerate() {
            owner_round(&dev, &mut peer, i, point).map_err(|e| format!("killed {point}: {e}"))?;
        }
        peer.outcome()
    })();
    if result.is_err() {
        let _ = peer.send("abandon");
    }
    result
}

/// One round on the owner's host: format, serve with its key, publish, hand
/// the receipts over, be killed where the reader host says, and check that
/// this host can no longer write or serve.
fn owner_round(dev: &Path, peer: &mut Peer, i: usize, point: &str) -> Checked {
    use pdstor_client::Writer;
    format_namespace(dev)?;
    let key = format!("{OWNER_KEY:#x}");
    let log = "/tmp/vmtest/topology-serve-takeover.log";
    let daemon = start_owner_with(dev, log, &["--reservation-key", key.as_str()])?;
    let server = format!("http://{CONTROL}");
    let c = pdstor_client::Client::new(&server);
    let mut w = Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, CHUNKS).map_err(|e| e.to_string())?;
    let mut receipts = Vec::new();
    for k in 0..KEPT {
        let p =
            w.put(&format!("kept-{point}-{k}"), &kv_layout(), &kept_payload(i, k), 4, Some(42)).map_err(api("put"))?;
        receipts.push(p.receipt);
    }
    // Stored and never published: the takeover rolls it back.
    let (unpublished, _conn) = store_unpublished(&c, &format!("unpublished-{point}"), &seeded(0x7aff, 4))?;
    let handed: Handed = (receipts, unpublished.publication);
    peer.send(&format!("{point} {}", json(&handed)?))?;
    let line = peer.recv()?;
    if line != format!("at {point}") {
        return Err(format!("the reader host did not reach {point}: {line}").into());
    }
    kill9(daemon)?;
    peer.send("killed")?;
    let line = peer.recv()?;
    if !line.starts_with("took-over") {
        return Err(format!("the standby did not take over: {line}").into());
    }
    cut_off(dev, &key, &format!("the old owner's host, killed {point}, after the preempt"))?;
    peer.send("old-owner-refused")?;
    // The reader host finishes the round and clears the reservation.
    match peer.recv()?.as_str() {
        "round-done" => Ok(()),
        other => Err(format!("the reader host reported {other:?}").into()),
    }
}

fn takeover_standby() -> Checked {
    connect()?;
    connect_as(THIRD_HOSTNQN, THIRD_HOSTID)?;
    let dev = fabric_namespace_n(NAMESPACE)?;
    let mut peer = Peer::dial(TAKEOVER_PORT)?;
    let result = (|| -> Checked {
        for (i, point) in POINTS.iter().enumerate() {
            standby_round(&dev, &mut peer, i, point).map_err(|e| format!("killed {point}: {e}"))?;
        }
        Ok(())
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// One round on the reader host: stand by, take the handoff to `point`,
/// and after the owner's kill, wait for the takeover and finish the handoff
/// with the new owner. The reservation is cleared at the end whatever
/// happened (it outlives the daemon: it is the host's), so the owner's
/// host can format for the next round.
fn standby_round(dev: &Path, peer: &mut Peer, i: usize, point: &str) -> Checked {
    let line = peer.recv()?;
    let handed = line.strip_prefix(&format!("{point} ")).ok_or(format!("the owner sent {line:?}"))?;
    let handed: Handed = parse("the receipts", handed)?;
    let key = format!("{STANDBY_KEY:#x}");
    let owner = format!("http://{CONTROL}");
    let log = "/tmp/vmtest/topology-standby.log";
    let flags = ["--standby", "--owner", owner.as_str(), "--reservation-key", key.as_str()];
    let standby = spawn_serve(dev, &flags, STANDBY_CONTROL, DATA_SOCKET, log);
    let result = standby.and_then(|_standby| handoff_across(dev, peer, i, point, &handed, log));
    let cleared = pdstor_engine::io::persistent_reservation::Reservations::open(dev)
        .and_then(|r| r.clear(STANDBY_KEY))
        .map_err(|e| format!("clearing the reservation: {e}").into());
    let result = result.and(cleared);
    if result.is_ok() {
        peer.send("round-done")?;
    }
    result
}

/// The reader host's side of a round, the standby serving beside it: takes
/// the handoff to `point`, lets the owner be killed, waits for the
/// takeover, and finishes the handoff with the new owner.
fn handoff_across(dev: &Path, peer: &mut Peer, i: usize, point: &str, handed: &Handed, log: &str) -> Checked {
    use pdstor_client::{Client, ClientError, RemoteReader};
    let (receipts, unpublished) = handed;
    let (owner, standby_server) = (format!("http://{CONTROL}"), format!("http://{STANDBY_CONTROL}"));
    let c = Client::new(&standby_server);
    // Standing by, it serves no step, naming the owner.
    match c.claim(&receipts[0], "decode-takeover", "takeover", 600_000) {
        Err(ClientError::Api(e)) if e.code == "standby" && e.message.contains(&owner) => {}
        other => return Err(format!("a standby answered a claim: {other:?}").into()),
    }
    // The direct reader, a host of its own to the target (its own NVMe
    // identity and key), is given both daemons and follows the owner.
    let both = format!("{owner},{standby_server}");
    let third = fabric_namespace_as(NAMESPACE, Some(THIRD_HOSTNQN))?;
    let mut r = RemoteReader::open_with(&both, &third, Some(READER_KEY)).map_err(api("opening the direct reader"))?;
    let want = kept_payload(i, 0);
    let caught = catch(&r, &receipts[0], point, &third, &want)?;
    peer.send(&format!("at {point}"))?;
    if peer.recv()? != "killed" {
        return Err("the owner was not killed".into());
    }
    let killed = Instant::now();
    let info = serving_after(&c, killed, log)?;
    let serving = killed.elapsed();
    let old_epoch = receipts[0].epoch;
    if info.epoch <= old_epoch || info.namespace != receipts[0].namespace || !info.reservations {
        return Err(format!("after the takeover the namespace is {info:?}, the old receipt's epoch {old_epoch}").into());
    }
    peer.send(&format!("took-over {} {}", info.epoch, serving.as_millis()))?;
    if peer.recv()? != "old-owner-refused" {
        return Err("the old owner's host did not report its refusals".into());
    }
    let first_step = finish_caught(&mut r, (&standby_server, dev), &third, caught, &want, killed)?;
    // The other acknowledged publications, by their old receipts.
    restore_by_old_receipts(
        &standby_server,
        DATA_SOCKET,
        dev,
        &receipts[1..],
        |k| kept_payload(i, k as u32 + 1),
        killed,
    )?;
    if c.publications(None, false).map_err(api("publications"))?.iter().any(|p| p.publication == *unpublished) {
        return Err("the unpublished publication survived the takeover".into());
    }
    // The new owner takes new work.
    let mut w = pdstor_client::Writer::new(&standby_server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4)
        .map_err(|e| e.to_string())?;
    w.put(&format!("after-takeover-{point}"), &kv_layout(), &seeded(0x7b0, 4), 4, Some(42))
        .map_err(api("put after the takeover"))?;
    console(&format!(
        "pdstor-vminit: takeover: owner killed {point} -> standby serves epoch {} in {} ms, first step served in {} ms",
        info.epoch,
        serving.as_millis(),
        first_step.as_millis()
    ));
    Ok(())
}

/// A handoff where the owner died: published, claimed (never adopted), or
/// adopted by a direct reader (which may have read some of it).
pub(super) enum Caught {
    Published(pdstor_client::receipt::Receipt),
    Claimed(pdstor_client::receipt::Receipt),
    Adopted(pdstor_client::receipt::Receipt, pdstor_client::layout::Manifest),
}

/// Takes the handoff of `ready` to `point` with the direct reader `r`:
/// `published` (nothing), `claimed`, `adopted`, or `half_read` (adopted,
/// and half its chunks read and checked against `want`).
pub(super) fn catch(
    r: &pdstor_client::RemoteReader,
    ready: &pdstor_client::receipt::Receipt,
    point: &str,
    dev: &Path,
    want: &[u8],
) -> Checked<Caught> {
    if point == "published" {
        return Ok(Caught::Published(ready.clone()));
    }
    let claim = r.claim(ready, "decode-remote", &format!("caught-{point}"), 600_000).map_err(api("claim"))?;
    if point == "claimed" {
        return Ok(Caught::Claimed(claim));
    }
    let m = r.adopt(&claim, &kv_layout()).map_err(api("adopt"))?;
    if point == "half_read" {
        same_bytes(dev, &manifest_extents(&m, m.chunks.len() / 2), want, "half read before the owner died")?;
    }
    Ok(Caught::Adopted(claim, m))
}

/// Finishes a handoff the owner's death caught, with the new owner at
/// `server` (its data plane on this host's [`DATA_SOCKET`]), and answers
/// when its first step was served, since `t0`:
///
/// - published: claimed, loaded byte-exact and acked by its old receipt;
/// - claimed, never adopted: the reader never learned where the chunks are,
///   so the new epoch fenced it — its adopt is refused `fenced`, and only
///   then is it reclaimed;
/// - adopted: a direct reader may still read its slots, so a reclaim is
///   refused, and a writer that takes every free slot of the new owner gets
///   none of them: the reader still reads the old writer's bytes, loads
///   them and acks with its old receipt.
pub(super) fn finish_caught(
    r: &mut pdstor_client::RemoteReader,
    (server, dev): (&str, &Path),
    reader_dev: &Path,
    caught: Caught,
    want: &[u8],
    t0: Instant,
) -> Checked<Duration> {
    use pdstor_client::ClientError;
    let c = pdstor_client::Client::new(server);
    match caught {
        Caught::Published(ready) => restore_by_old_receipts(server, DATA_SOCKET, dev, &[ready], |_| want.to_vec(), t0),
        Caught::Claimed(claim) => {
            match r.adopt(&claim, &kv_layout()) {
                Err(ClientError::Api(b)) if b.code == "fenced" => {}
                other => return Err(format!("adopting a claim the takeover fenced: {other:?}").into()),
            }
            let first = t0.elapsed();
            c.reclaim(&claim).map_err(api("reclaiming the fenced claim"))?;
            Ok(first)
        }
        Caught::Adopted(claim, m) => {
            reclaim_refused(&c, &claim, "after the takeover")?;
            let first = t0.elapsed();
            // A reader on the new owner's own host registered the owner's
            // key (a host has one registration per namespace): closing its
            // session cannot cut it off without cutting off the owner, and
            // says so.
            if reader_dev == dev {
                match c.close_session(&claim) {
                    Err(ClientError::Api(b))
                        if b.code == "fence_failed" && b.message.contains("own reservation key") => {}
                    other => {
                        return Err(
                            format!("closing the session of a reader on the owner's own host: {other:?}").into()
                        );
                    }
                }
            }
            let fillers = fill_free_slots(server, &format!("fill-{}", claim.publication), 0xf200)?;
            let every = manifest_extents(&m, m.chunks.len());
            same_bytes(reader_dev, &every, want, "read after the takeover, every free slot taken by a writer")?;
            let restored = r.load(&claim, m).map_err(api("load after the takeover"))?;
            if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
                return Err("the direct reader restored other bytes than the writer's after the takeover".into());
            }
            r.ack(&claim, &restored).map_err(api("ack with the old receipt"))?;
            for f in &fillers {
                c.release(f).map_err(api("releasing a filler"))?;
            }
            Ok(first)
        }
    }
}

/// Waits (60 s at most) until the standby at `c` serves the namespace as its owner.
pub(super) fn serving_after(
    c: &pdstor_client::Client,
    killed: Instant,
    log: &str,
) -> Checked<pdstor_client::wire::NamespaceInfo> {
    loop {
        match c.namespace() {
            Ok(info) => return Ok(info),
            Err(_) if killed.elapsed() < Duration::from_secs(60) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                return Err(format!("the standby did not take over within 60 s ({e}): {log}").into());
            }
        }
    }
}

/// Starts `pdstor serve` on `dev` with `flags`, its control plane on
/// `control` (plaintext, the private network) and its data plane on the
/// Unix socket `data`, watching the owner every 250 ms and taking over after
/// 1.5 s where it is a standby; waits until it answers `/healthz`.
pub(super) fn spawn_serve(
    dev: &Path,
    flags: &[&str],
    control: &str,
    data: &str,
    log: &str,
) -> Checked<crate::suites::protocol::Daemon> {
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(data);
    let child = std::process::Command::new("/bin/pdstor")
        .arg("serve")
        .args(flags)
        .args(["--takeover-after-ms", "1500", "--owner-check-ms", "250"])
        .args(["--listen", control, "--insecure-tcp", "--data-socket", data, "--target"])
        .arg(dev)
        .stdout(std::process::Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("starting pdstor serve {flags:?}: {e}"))?;
    let daemon = crate::suites::protocol::Daemon(child);
    let c = pdstor_client::Client::new(&format!("http://{control}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.healthz().is_err() {
        if Instant::now() > deadline {
            return Err(format!(
                "pdstor serve {flags:?} never answered: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(daemon)
}

/// On the old owner's host (`who`), after the preempt: the target refuses
/// its raw `O_DIRECT` read and write, and its daemon, started again with its
/// key `key`, refuses to serve: the namespace is not its own.
pub(super) fn cut_off(dev: &Path, key: &str, who: &str) -> Checked {
    if let Ok(b) = dd_direct(dev, 0, 4096) {
        return Err(format!("{who}: the host still reads the namespace ({} bytes)", b.len()).into());
    }
    raw_write_refused(dev, who)?;
    let out = std::process::Command::new("/bin/pdstor")
        .args(["serve", "--listen", CONTROL, "--insecure-tcp", "--data-socket", DATA_SOCKET])
        .args(["--reservation-key", key, "--target"])
        .arg(dev)
        .output()
        .map_err(|e| format!("{who}: starting the old owner again: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !stderr.contains("taken over") {
        return Err(format!("{who}: the old owner, started again, did not refuse: {stderr}").into());
    }
    Ok(())
}

/// A raw `O_DIRECT` write of one block (busybox `dd`, no pdstor) to `dev`
/// must be refused by the target: this host's key was preempted.
pub(super) fn raw_write_refused(dev: &Path, who: &str) -> Checked {
    let of = format!("of={}", dev.display());
    let wrote = sh("dd", &["if=/dev/zero", &of, "bs=4096", "count=1", "seek=64", "oflag=direct", "conv=notrunc"]);
    match wrote {
        Ok(_) => Err(format!("{who} wrote the namespace: the target did not refuse it").into()),
        Err(e) => {
            console(&format!("pdstor-vminit: {who}: a raw write refused: {e}"));
            Ok(())
        }
    }
}

/// Claims, loads (through the data plane at `data`, the new owner's) and acks every
/// publication by the READY receipt its old owner gave, checking each chunk
/// outside pdstor too; answers when the first step was served, since `t0`.
pub(super) fn restore_by_old_receipts(
    server: &str,
    data: &str,
    dev: &Path,
    receipts: &[pdstor_client::receipt::Receipt],
    payload: impl Fn(usize) -> Vec<u8>,
    t0: Instant,
) -> Checked<Duration> {
    let mut reader = pdstor_client::Reader::new(server, Path::new(data)).map_err(|e| e.to_string())?;
    let mut first_step = None;
    for (i, ready) in receipts.iter().enumerate() {
        let claim = reader.client.claim(ready, "decode-takeover", "takeover", 600_000).map_err(api("claim"))?;
        first_step.get_or_insert_with(|| t0.elapsed());
        let want = payload(i);
        let places = extents(&reader.client, claim.publication)?;
        same_bytes(dev, &places, &want, "outside pdstor, after the takeover")?;
        let restored = reader.get(&claim, &kv_layout()).map_err(api("load after the takeover"))?;
        if reader.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
            return Err(format!("publication {i} ({}) restored other bytes after the takeover", ready.req_id).into());
        }
        reader.client.ack(&claim, &restored.restore_digest).map_err(api("ack"))?;
    }
    Ok(first_step.unwrap_or_else(|| t0.elapsed()))
}
