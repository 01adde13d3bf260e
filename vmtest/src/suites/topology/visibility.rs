//! A published chunk reaches the reader host through no cache (its page cache
//! still shows the old bytes, its O_DIRECT load the new ones), and stored but
//! unflushed chunks never become READY.

use std::path::Path;

use crate::machine::{Ctx, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

pub(super) const VISIBLE_PORT: u16 = 7077;

pub(super) const VISIBLE_CHUNKS: u32 = 8;

/// Visibility without a cache. The reader host reads the whole small
/// namespace through its page cache first, so any stale copy a cache could
/// serve is there. The writer then publishes new bytes: the reader host's
/// cached read still shows the old ones (the hazard is real), and its
/// `O_DIRECT` load shows the new ones, verified and acked. Then the writer
/// stores chunks and never publishes them — stored, never flushed — and its
/// daemon is killed: while stored the publication is PREPARED (no READY
/// receipt exists to claim it), and the restarted daemon rolls it back: an
/// unflushed write never became READY.
pub(super) fn visibility(_: &Ctx) -> Checked {
    by_role(visible_owner, visible_reader)
}

pub(super) fn visible_owner() -> Checked {
    use pdstor_client::{Client, Writer};
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
        return Err(format!("stored but unpublished, publication {} is {state:?}, not PREPARED", p.publication).into());
    }
    peer.send(&format!("stored {}", p.publication))?;
    peer.outcome()?;
    kill9(daemon)?;
    let _daemon = start_owner(&dev, log)?;
    let c = Client::new(&server);
    if let Some(p) =
        c.publications(None, false).map_err(api("listing"))?.iter().find(|i| i.publication == p.publication)
    {
        return Err(format!("after the restart the unflushed publication is {}", p.state).into());
    }
    peer.send("rolled back")?;
    peer.outcome()
}

pub(super) fn visible_reader() -> Checked {
    use pdstor_client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let mut peer = Peer::dial(VISIBLE_PORT)?;
    let result = (|| -> Checked {
        peer.recv()?;
        // Everything the namespace holds now, into this host's page cache.
        let held = std::fs::File::open(&dev).map_err(|e| format!("opening {}: {e}", dev.display()))?;
        let before = read_cached(&held, 0, SMALL_NAMESPACE)?;
        peer.send("cached")?;
        let line = peer.recv()?;
        let (receipt, at) = line.split_once(' ').ok_or_else(|| format!("the owner sent {line:?}"))?;
        let ready: pdstor_client::receipt::Receipt = parse("the receipt", receipt)?;
        let at: Vec<pdstor_client::wire::Extent> = parse("the extents", at)?;
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
            return Err(format!("the unflushed publication {n} is listed READY").into());
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
