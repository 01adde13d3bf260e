//! A standby takes a dead owner's namespace over (issue 35). The owner
//! (storage guest, its own NVMe/TCP view of the shared namespace) holds the
//! namespace's reservation with its key; a standby on the reader host
//! (`serve --standby --owner …`) registers a key of its own and watches the
//! owner's health. The owner is killed (`kill -9`); after
//! `--takeover-after-ms` the standby preempts-and-aborts exactly the key the
//! superblock names, recovers the journal into a new epoch and serves. Then:
//! every publication acknowledged READY before the kill loads byte-exact from
//! the new owner with its old receipt (and reads the same outside pdstor),
//! the unpublished one is rolled back, a writer publishes anew; and on the
//! old owner's host the target refuses a raw `O_DIRECT` write and read
//! (reservation conflict), and the old owner's daemon, started again with
//! its key, refuses to serve a namespace that is no longer its own.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::SHARED_NQN;
use crate::guest::{Ctx, console, sh};
use crate::suites::io::dd_direct;
use crate::suites::{Checked, skip};

use super::*;

const TAKEOVER_PORT: u16 = 7083;

/// The standby's key (the owner's is [`OWNER_KEY`]).
const STANDBY_KEY: u64 = 0x5d10;

/// The standby's control plane, on the reader host.
const STANDBY_CONTROL: &str = "10.77.0.2:7078";

const KEPT: u32 = 2;

fn kept_payload(i: u32) -> Vec<u8> {
    seeded(0x7a0 + i as u64, 4)
}

pub(super) fn takeover(_: &Ctx) -> Checked {
    if !nvmet_has_reservations() {
        return Err(skip(
            "this kernel's NVMe target has no persistent reservations (Debian's 6.12 nvmet has no resv_enable), \
             so a standby cannot fence an owner and refuses to start; the rw-dmabuf series kernel (7.2) runs this test",
        ));
    }
    by_role(takeover_owner, takeover_standby)
}

fn takeover_owner() -> Checked {
    use pdstor::client::Writer;
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let key = format!("{OWNER_KEY:#x}");
    let log = "/tmp/vmtest/topology-serve-takeover.log";
    let daemon = start_owner_with(&dev, log, &["--reservation-key", key.as_str()])?;
    let server = format!("http://{CONTROL}");
    let c = pdstor::client::Client::new(&server);
    let mut peer = Peer::accept(TAKEOVER_PORT)?;
    let result = (|| -> Checked {
        let mut w = Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4).map_err(|e| e.to_string())?;
        let mut receipts = Vec::new();
        for i in 0..KEPT {
            let p = w.put(&format!("kept-{i}"), &kv_layout(), &kept_payload(i), 4, Some(42)).map_err(api("put"))?;
            receipts.push(p.receipt);
        }
        // Stored and never published: the takeover rolls it back.
        let (unpublished, _conn) = store_unpublished(&c, "unpublished", &seeded(0x7af, 4))?;
        peer.send(&json(&(receipts, unpublished.publication))?)?;
        if peer.recv()? != "standing-by" {
            return Err("the standby did not stand by".into());
        }
        peer.send("killing")?;
        kill9(daemon)?;
        let line = peer.recv()?;
        if !line.starts_with("took-over") {
            return Err(format!("the standby did not take over: {line}").into());
        }
        // This host was preempted: the target refuses its reads and writes.
        if let Ok(b) = dd_direct(&dev, 0, 4096) {
            return Err(format!("the old owner's host still reads the namespace ({} bytes)", b.len()).into());
        }
        raw_write_refused(&dev, "the old owner's host, after the preempt")?;
        // Its daemon, started again with its key, refuses: not its namespace.
        let out = std::process::Command::new("/bin/pdstor")
            .args(["serve", "--listen", CONTROL, "--insecure-tcp", "--data-socket", DATA_SOCKET])
            .args(["--reservation-key", key.as_str(), "--target"])
            .arg(&dev)
            .output()
            .map_err(|e| format!("starting the old owner again: {e}"))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !stderr.contains("taken over") {
            return Err(format!("the old owner, started again, did not refuse: {stderr}").into());
        }
        peer.send("old-owner-refused")?;
        peer.outcome()
    })();
    if result.is_err() {
        let _ = peer.send("abandon");
    }
    result
}

fn takeover_standby() -> Checked {
    use pdstor::client::Client;
    connect()?;
    let dev = fabric_namespace()?;
    let mut peer = Peer::dial(TAKEOVER_PORT)?;
    let standby_server = format!("http://{STANDBY_CONTROL}");
    let mut standby = None;
    let result = (|| -> Checked {
        let (receipts, unpublished): (Vec<pdstor::protocol::Receipt>, u64) = parse("the receipts", &peer.recv()?)?;
        let key = format!("{STANDBY_KEY:#x}");
        let owner = format!("http://{CONTROL}");
        let log = "/tmp/vmtest/topology-standby.log";
        let flags = ["--standby", "--owner", owner.as_str(), "--reservation-key", key.as_str()];
        standby = Some(spawn_serve(&dev, &flags, STANDBY_CONTROL, log)?);
        let c = Client::new(&standby_server);
        // Standing by, it serves no step, naming the owner.
        match c.claim(&receipts[0], "decode-takeover", "takeover", 600_000) {
            Err(pdstor::client::ClientError::Api(e)) if e.code == "standby" && e.message.contains(&owner) => {}
            other => return Err(format!("a standby answered a claim: {other:?}").into()),
        }
        peer.send("standing-by")?;
        if peer.recv()? != "killing" {
            return Err("the owner was not killed".into());
        }
        let killed = Instant::now();
        let old_epoch = receipts[0].epoch;
        let info = loop {
            match c.namespace() {
                Ok(info) => break info,
                Err(_) if killed.elapsed() < Duration::from_secs(60) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => {
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(format!("the standby did not take over within 60 s ({e}): {log}").into());
                }
            }
        };
        let serving = killed.elapsed();
        if info.epoch <= old_epoch || info.namespace != receipts[0].namespace || !info.reservations {
            return Err(
                format!("after the takeover the namespace is {info:?}, the old receipt's epoch {old_epoch}").into()
            );
        }
        // Every acknowledged publication, by its old receipt, byte for byte.
        let first_step = restore_by_old_receipts(&standby_server, &dev, &receipts, |i| kept_payload(i as u32), killed)?;
        if c.publications(None, false).map_err(api("publications"))?.iter().any(|p| p.publication == unpublished) {
            return Err("the unpublished publication survived the takeover".into());
        }
        // The new owner takes new work.
        let mut w = pdstor::client::Writer::new(&standby_server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4)
            .map_err(|e| e.to_string())?;
        w.put("after-takeover", &kv_layout(), &seeded(0x7b0, 4), 4, Some(42)).map_err(api("put after the takeover"))?;
        let first = first_step;
        console(&format!(
            "pdstor-vminit: takeover: owner killed -> standby serves epoch {} in {} ms, first step served in {} ms",
            info.epoch,
            serving.as_millis(),
            first.as_millis()
        ));
        peer.send(&format!("took-over {} {} {}", info.epoch, serving.as_millis(), first.as_millis()))?;
        match peer.recv()?.as_str() {
            "old-owner-refused" => Ok(()),
            other => Err(format!("the old owner's side reported {other:?}").into()),
        }
    })();
    drop(standby);
    // The reservation outlives the daemon (it is the host's): cleared before
    // the owner's side hears the outcome, so its next test formats freely.
    let cleared = pdstor::io::persistent_reservation::Reservations::open(&dev)
        .and_then(|r| r.clear(STANDBY_KEY))
        .map_err(|e| format!("clearing the reservation: {e}").into());
    let result = result.and(cleared);
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// Starts `pdstor serve` on `dev` with `flags`, its control plane on
/// `control` (plaintext, the private network) and its data plane on
/// [`DATA_SOCKET`], watching the owner every 250 ms and taking over after
/// 1.5 s where it is a standby; waits until it answers `/healthz`.
pub(super) fn spawn_serve(
    dev: &Path,
    flags: &[&str],
    control: &str,
    log: &str,
) -> Checked<crate::suites::protocol::Daemon> {
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(DATA_SOCKET);
    let child = std::process::Command::new("/bin/pdstor")
        .arg("serve")
        .args(flags)
        .args(["--takeover-after-ms", "1500", "--owner-check-ms", "250"])
        .args(["--listen", control, "--insecure-tcp", "--data-socket", DATA_SOCKET, "--target"])
        .arg(dev)
        .stdout(std::process::Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("starting pdstor serve {flags:?}: {e}"))?;
    let daemon = crate::suites::protocol::Daemon(child);
    let c = pdstor::client::Client::new(&format!("http://{control}"));
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

/// Claims, loads (through the new owner's data plane) and acks every
/// publication by the READY receipt its old owner gave, checking each chunk
/// outside pdstor too; answers when the first step was served, since `t0`.
pub(super) fn restore_by_old_receipts(
    server: &str,
    dev: &Path,
    receipts: &[pdstor::protocol::Receipt],
    payload: impl Fn(usize) -> Vec<u8>,
    t0: Instant,
) -> Checked<Duration> {
    let mut reader = pdstor::client::Reader::new(server, Path::new(DATA_SOCKET)).map_err(|e| e.to_string())?;
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
