//! Two owners side by side (issue 35): owner A on the storage guest serves
//! namespace 1 of the shared subsystem, owner B on the reader host serves
//! namespace 3, each with its own reservation key; a reader on the reader
//! host reads both through one client given every address (A, A's standby,
//! B). A receipt of one owner is refused by the other (`namespace_mismatch`:
//! the namespace identity is signed into it), and the client finds each
//! receipt's owner. Then A is killed (`kill -9`) and its standby, beside B
//! on the reader host, takes namespace 1 over: B's epoch, its reservation
//! and its publications are untouched, A's acknowledged publication loads
//! byte-exact from the standby by its old receipt, and the old owner's host
//! can no longer write namespace 1.

use std::path::Path;
use std::time::Instant;

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

const OWNERS_PORT: u16 = 7084;

/// Owner A's key on namespace 1 (storage guest).
const A_KEY: u64 = 0x5d20;

/// The reader host's key on namespace 1: its direct reader's, then its
/// standby's (a host has one registration per namespace).
const READER_KEY_1: u64 = 0x5d22;

/// Owner B's key on namespace 3 (reader host).
const B_KEY: u64 = 0x5d21;

/// Owner B's control plane, on the reader host (its data plane is [`DATA_SOCKET`] there).
const B_CONTROL: &str = "10.77.0.2:7078";

/// A's standby, on the reader host beside B.
const STANDBY_CONTROL: &str = "10.77.0.2:7079";

const STANDBY_DATA: &str = "/tmp/vmtest/topology-standby-data.sock";

const CHUNKS: u32 = 8;

fn payload(owner: char, i: usize) -> Vec<u8> {
    seeded(0x0a00 + ((owner as u64) << 4) + i as u64, CHUNKS)
}

pub(super) fn two_owners(_: &Ctx) -> Checked {
    needs_reservations(": owners side by side run there, but no owner can be taken over")?;
    by_role(owner_a, owner_b_and_reader)
}

/// Publishes `n` publications of `owner`'s payload through the owner at
/// `server` (its data plane on this host's [`DATA_SOCKET`]).
fn publish(server: &str, owner: char, n: usize) -> Checked<Vec<pdstor_client::receipt::Receipt>> {
    let mut w =
        pdstor_client::Writer::new(server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, CHUNKS).map_err(|e| e.to_string())?;
    (0..n)
        .map(|i| {
            let req = format!("owner-{owner}-{i}");
            Ok(w.put(&req, &kv_layout(), &payload(owner, i), 4, Some(42)).map_err(api("put"))?.receipt)
        })
        .collect()
}

fn owner_a() -> Checked {
    let dev = fabric_namespace_n(1)?;
    format_namespace(&dev)?;
    let key = format!("{A_KEY:#x}");
    let daemon = start_owner_with(&dev, "/tmp/vmtest/topology-owner-a.log", &["--reservation-key", key.as_str()])?;
    let mut peer = Peer::accept(OWNERS_PORT)?;
    let result = (|| -> Checked {
        peer.send(&json(&publish(&format!("http://{CONTROL}"), 'a', 2)?)?)?;
        if peer.recv()? != "kill-a" {
            return Err("the reader host did not ask for owner A's kill".into());
        }
        kill9(daemon)?;
        peer.send("killed")?;
        if peer.recv()? != "took-over" {
            return Err("A's standby did not take over".into());
        }
        raw_write_refused(&dev, "owner A's host, after its standby took namespace 1 over")?;
        peer.send("refused")?;
        peer.outcome()
    })();
    if result.is_err() {
        let _ = peer.send("abandon");
    }
    result
}

fn owner_b_and_reader() -> Checked {
    connect()?;
    let (dev1, dev3) = (fabric_namespace_n(1)?, fabric_namespace_n(3)?);
    format_namespace(&dev3)?;
    let key = format!("{B_KEY:#x}");
    let b = spawn_serve(
        &dev3,
        &["--reservation-key", key.as_str()],
        B_CONTROL,
        DATA_SOCKET,
        "/tmp/vmtest/topology-owner-b.log",
    );
    let mut peer = Peer::dial(OWNERS_PORT)?;
    let result = b.and_then(|_b| side_by_side(&dev1, &dev3, &mut peer));
    // The reservations outlive the daemons (they are the host's): cleared,
    // so that the next test formats freely.
    let clear = |dev: &Path, key: u64| {
        pdstor_engine::io::persistent_reservation::Reservations::open(dev)
            .and_then(|r| r.clear(key))
            .map_err(|e| format!("clearing the reservation of {}: {e}", dev.display()).into())
    };
    let result = result.and(clear(&dev1, READER_KEY_1)).and(clear(&dev3, B_KEY));
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

fn side_by_side(dev1: &Path, dev3: &Path, peer: &mut Peer) -> Checked {
    use pdstor_client::{Client, ClientError, RemoteReader};
    let (a, b, standby) =
        (format!("http://{CONTROL}"), format!("http://{B_CONTROL}"), format!("http://{STANDBY_CONTROL}"));
    let a_receipts: Vec<pdstor_client::receipt::Receipt> = parse("owner A's receipts", &peer.recv()?)?;
    let b_receipts = publish(&b, 'b', 2)?;
    let b_before = Client::new(&b).namespace().map_err(api("B's namespace"))?;
    // Each owner refuses the other's receipt, changing nothing.
    let mismatch = |server: &str, r: &pdstor_client::receipt::Receipt| -> Checked {
        match Client::new(server).claim(r, "decode-owners", "mismatch", 600_000) {
            Err(ClientError::Api(e)) if e.code == "namespace_mismatch" => Ok(()),
            other => Err(format!("{server} answered a claim of another owner's receipt: {other:?}").into()),
        }
    };
    mismatch(&a, &b_receipts[0])?;
    mismatch(&b, &a_receipts[0])?;
    // A's standby, beside B on this host, watching A.
    let key = format!("{READER_KEY_1:#x}");
    let flags = ["--standby", "--owner", a.as_str(), "--reservation-key", key.as_str()];
    let log = "/tmp/vmtest/topology-standby-a.log";
    let _standby = spawn_serve(dev1, &flags, STANDBY_CONTROL, STANDBY_DATA, log)?;
    // One client given every address finds each receipt's owner.
    let every = format!("{a},{standby},{b}");
    let mut direct = RemoteReader::open_with(&every, dev1, Some(READER_KEY_1)).map_err(api("A's direct reader"))?;
    load_direct(&mut direct, dev1, &a_receipts[0], &payload('a', 0), "A's first, from A")?;
    restore_by_old_receipts(&every, DATA_SOCKET, dev3, &b_receipts[..1], |i| payload('b', i), Instant::now())?;
    // A dies; its standby takes namespace 1 over; B notices nothing.
    peer.send("kill-a")?;
    if peer.recv()? != "killed" {
        return Err("owner A was not killed".into());
    }
    let killed = Instant::now();
    let info = serving_after(&Client::new(&standby), killed, log)?;
    let serving = killed.elapsed();
    if info.namespace != a_receipts[0].namespace || info.epoch <= a_receipts[0].epoch {
        return Err(format!("A's standby serves {info:?} after the takeover").into());
    }
    peer.send("took-over")?;
    if peer.recv()? != "refused" {
        return Err("owner A's host did not report the refused write".into());
    }
    let b_after = Client::new(&b).namespace().map_err(api("B's namespace after A's takeover"))?;
    if b_after.epoch != b_before.epoch || b_after.namespace != b_before.namespace {
        return Err(format!("B changed when A was taken over: {b_before:?} -> {b_after:?}").into());
    }
    let registered =
        pdstor_engine::io::persistent_reservation::Reservations::open(dev3).and_then(|r| r.registered(B_KEY));
    if !matches!(registered, Ok(true)) {
        return Err(format!("B's reservation key on namespace 3 after A's takeover: {registered:?}").into());
    }
    // A's acknowledged publication from its standby, B's from B, by the
    // receipts given before, through the same client.
    // (Through the standby's data plane: this host is now namespace 1's
    // owner, and a direct reader never names its owner's own key.)
    restore_by_old_receipts(&every, STANDBY_DATA, dev1, &a_receipts[1..], |i| payload('a', i + 1), Instant::now())?;
    restore_by_old_receipts(&every, DATA_SOCKET, dev3, &b_receipts[1..], |i| payload('b', i + 1), Instant::now())?;
    console(&format!(
        "pdstor-vminit: two owners: A killed -> its standby serves namespace 1 epoch {} in {} ms; B (epoch {}) untouched",
        info.epoch,
        serving.as_millis(),
        b_after.epoch
    ));
    Ok(())
}

/// Claims `ready` through `r`'s client, adopts, checks every chunk outside
/// pdstor, loads, compares and acks.
fn load_direct(
    r: &mut pdstor_client::RemoteReader,
    dev: &Path,
    ready: &pdstor_client::receipt::Receipt,
    want: &[u8],
    what: &str,
) -> Checked {
    let claim =
        r.claim(ready, "decode-owners", &format!("owners-{}", ready.publication), 600_000).map_err(api("claim"))?;
    let m = r.adopt(&claim, &kv_layout()).map_err(api("adopt"))?;
    same_bytes(dev, &manifest_extents(&m, m.chunks.len()), want, what)?;
    let restored = r.load(&claim, m).map_err(api("load"))?;
    if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
        return Err(format!("{what}: the restored bytes are not the writer's").into());
    }
    r.ack(&claim, &restored).map_err(api("ack"))?;
    Ok(())
}
