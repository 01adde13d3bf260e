//! The owner's daemon killed (`kill -9`) at four points of a reader host's
//! load (claimed, adopted, half read, reported): restarted, it reuses nothing
//! the reader may still read, and the reader acks with its old receipt.

use std::path::Path;

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

pub(super) const RESTART_PORT: u16 = 7079;

pub(super) const RESTART_CHUNKS: u32 = 16;

/// Where the owner's daemon is killed while the reader host loads.
pub(super) const POINTS: [&str; 4] = ["claimed", "adopted", "half_read", "reported"];

/// The owner's daemon killed (`kill -9`) while a reader host loads, at four
/// points: after its claim, after its adopt, with half the chunks read, and
/// with every chunk read and reported but not acked. Each time the daemon
/// restarts (a new epoch) and a writer at once takes every slot admission
/// gives it; the reader host then reads every chunk again outside pdstor and
/// through it, and finds the writer's bytes — nothing it may still read was
/// reused — and acks with its old receipt. Claimed but not adopted, it never
/// learned where the chunks are: the restart fences it, its adopt is refused
/// `fenced`, and only then may its slots be reclaimed.
pub(super) fn restarts(_: &Ctx) -> Checked {
    by_role(restart_owner, restart_reader)
}

pub(super) fn restart_payload(i: usize) -> Vec<u8> {
    seeded(0x4e57 + i as u64, RESTART_CHUNKS)
}

pub(super) fn restart_owner() -> Checked {
    use pdstor_client::{Client, Writer};
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
        let claim: pdstor_client::receipt::Receipt =
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
            ("claimed", other) => {
                return Err(format!("killed after the claim: the reader host reported {other:?}").into());
            }
            (_, "acked") => {}
            (_, other) => return Err(format!("killed at {point}: the reader host reported {other:?}").into()),
        }
        if let Some(p) =
            c.publications(None, false).map_err(api("listing"))?.iter().find(|p| p.publication == claim.publication)
        {
            return Err(format!("killed at {point}: after the reader's outcome its publication is {}", p.state).into());
        }
        for f in &fillers {
            c.release(f).map_err(api("releasing a filler"))?;
        }
    }
    peer.send("done")?;
    peer.outcome()
}

pub(super) fn restart_reader() -> Checked {
    use pdstor_client::{ClientError, RemoteReader};
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let server = format!("http://{CONTROL}");
    let mut peer = Peer::dial(RESTART_PORT)?;
    let mut reader: Option<RemoteReader> = None;
    let result = (|| -> Checked {
        loop {
            let line = peer.recv()?;
            if line == "done" {
                return Ok(());
            }
            let (point, receipt) = line.split_once(' ').ok_or(format!("the owner sent {line:?}"))?;
            let i = POINTS.iter().position(|p| *p == point).ok_or(format!("unknown point {point:?}"))?;
            let ready: pdstor_client::receipt::Receipt = parse("the receipt", receipt)?;
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
                return Err(format!("the owner sent {restarted:?}").into());
            }
            let Some(m) = manifest else {
                match r.adopt(&claim, &kv_layout()) {
                    Err(ClientError::Api(b)) if b.code == "fenced" => peer.send("refused fenced")?,
                    other => return Err(format!("adopting after the restart that fenced the claim: {other:?}").into()),
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
                return Err(format!("killed at {point}: the restored bytes are not the writer's").into());
            }
            r.ack(&claim, &restored).map_err(api("ack with the old receipt"))?;
            peer.send("acked")?;
        }
    })();
    peer.report(&result);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}
