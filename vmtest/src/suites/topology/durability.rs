//! READY is at the target before the writer host is gone: a publish sends an
//! NVMe Flush over TCP that reaches the target's device; the writer host is
//! then cut off at once, and the reader host finds every chunk.

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::{DiskRole, SHARED_NQN};

use super::*;

pub(super) const DURABLE_PORT: u16 = 7080;

pub(super) const DURABLE_CHUNKS: u32 = 16;

/// Durability through the fabric. The writer host publishes; its publish
/// must have sent an NVMe Flush over TCP that reached the target's own
/// device (the flush counts of the writer host's fabric view and of the
/// target's backing NVMe both grow). The moment READY is answered the
/// writer's daemon is killed and the writer host's NVMe/TCP connection
/// dropped; the reader host reads every chunk at once, `O_DIRECT`, and
/// finds the writer's bytes (compared outside pdstor). Then the writer host
/// reconnects, its daemon recovers the READY publication, and the reader
/// host claims, loads and acks it.
pub(super) fn durability(ctx: &Ctx) -> Checked {
    by_role(|| durable_owner(ctx), durable_reader)
}

pub(super) fn durable_owner(ctx: &Ctx) -> Checked {
    use pdstor_client::Client;
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
        ).into());
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
        return Err(format!("after the reader host's ack the owner holds {left:?}").into());
    }
    Ok(())
}

pub(super) fn durable_reader() -> Checked {
    use pdstor_client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace()?;
    let mut peer = Peer::dial(DURABLE_PORT)?;
    let result = (|| -> Checked {
        let line = peer.recv()?;
        let at: Vec<pdstor_client::wire::Extent> =
            parse("the extents", line.strip_prefix("gone ").ok_or(format!("the owner sent {line:?}"))?)?;
        let want = seeded(0xd0ab, DURABLE_CHUNKS);
        same_bytes(&dev, &at, &want, "read right after READY with the writer host gone")?;
        peer.send("ok")?;
        let ready: pdstor_client::receipt::Receipt = parse("the receipt", &peer.recv()?)?;
        let server = format!("http://{CONTROL}");
        let claim = Client::new(&server).claim(&ready, "decode-durable", "durable", 120_000).map_err(api("claim"))?;
        let mut r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
        let restored = r.get(&claim, &kv_layout()).map_err(api("get --direct"))?;
        if r.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
            return Err("the recovered publication did not restore the published bytes".into());
        }
        Ok(r.ack(&claim, &restored).map_err(api("ack"))?)
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}
