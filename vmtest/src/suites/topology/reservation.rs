//! A fenced reader host is cut off by its NVMe persistent reservation: the
//! target refuses its commands once the owner preempts its key.

use std::path::Path;

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use crate::suites::io::dd_direct;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

pub(super) const RESERVE_PORT: u16 = 7081;

pub(super) const RESERVE_CHUNKS: u32 = 8;

pub(super) const OWNER_KEY: u64 = 0x5d0e;

pub(super) const READER_KEY: u64 = 0x5d0f;

/// Fencing a direct reader cuts its host off at the target. The owner
/// serves with `--reservation-key`: it holds the namespace's Exclusive
/// Access — Registrants Only reservation. An unregistered reader host can
/// read nothing (the target refuses, and pdstor's reader says to register a
/// key before it tries); a registered one claims, adopts naming its key, and
/// reads half. The owner's reclaim is refused (`not_fenced`); closing the
/// reader's session preempts its key; the reclaim frees the slots and a new
/// publication takes them. The reader host is alive, and can read none of
/// it any more: the target refuses its commands, and its report is refused.
pub(super) fn reservation(_: &Ctx) -> Checked {
    needs_reservations("")?;
    by_role(reserve_owner, reserve_reader)
}

pub(super) fn reserve_owner() -> Checked {
    use pdstor_client::{Client, Writer};
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let key = format!("{OWNER_KEY:#x}");
    let daemon =
        start_owner_with(&dev, "/tmp/vmtest/topology-serve-reserve.log", &["--reservation-key", key.as_str()])?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let result = (|| -> Checked {
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
        let claim: pdstor_client::receipt::Receipt =
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
    let cleared = pdstor_engine::io::persistent_reservation::Reservations::open(&dev)
        .and_then(|r| r.clear(OWNER_KEY))
        .map_err(|e| e.to_string());
    result.and(Ok(cleared?))
}

pub(super) fn reserve_reader() -> Checked {
    use pdstor_client::RemoteReader;
    connect()?;
    let dev = fabric_namespace()?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::dial(RESERVE_PORT)?;
    let result = (|| -> Checked {
        let ready: pdstor_client::receipt::Receipt = parse("the receipt", &peer.recv()?)?;
        // Unregistered: the target refuses this host, and pdstor says why first.
        if dd_direct(&dev, 0, 4096).is_ok() {
            return Err("an unregistered host read the reserved namespace".into());
        }
        match RemoteReader::open(&server, &dev) {
            Err(e) if e.to_string().contains("reservation key") => {}
            other => return Err(format!("an unregistered reader was not told to register: {:?}", other.err()).into()),
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
                )
                .into());
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
