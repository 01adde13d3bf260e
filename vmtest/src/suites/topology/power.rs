//! The writer host loses power while a reader host is mid-load: booted
//! again on the same disks, its daemon recovers (a new epoch) with the claim
//! still ADOPTED and gives none of its slots away; the reader host's
//! in-flight read completes with the writer's bytes and it acks with its old
//! receipt.

use std::path::Path;
use std::time::Duration;

use crate::machine::{Ctx, cmdline, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::{POWER_CUT_ME, SHARED_NQN, STORAGE_ADDR};

use super::*;

pub(super) const POWER_TEST: &str = "the_writer_host_loses_power_while_a_reader_host_loads";

/// Where the owner hands the reader its receipt before the power cut.
pub(super) const POWER_PORT: u16 = 7082;

/// Where the owner, booted again, waits for the reader host.
pub(super) const REBORN_PORT: u16 = 7083;

pub(super) const POWER_CHUNKS: u32 = 16;

/// The storage guest's own address for its own connection to its target.
const LOOPBACK: &str = "127.0.0.1";

/// The writer host (with the target: it is the storage guest) loses power
/// while a reader host is mid-load: the reader has claimed, adopted and read
/// half, and has a read of the other half in flight (`dd`, outside pdstor)
/// when QEMU is killed. The guest boots again on the same disks; its target
/// comes back on loopback alone (the writer host's own connection), so the
/// reader host's queued read cannot complete yet; the daemon recovers (a new epoch) with the claim
/// still ADOPTED — a reclaim is refused `not_fenced` — and a writer takes
/// every free slot admission gives it. Only then is the reader host let back
/// in: its in-flight read completes with the writer's bytes, its pdstor load
/// verifies every chunk, and it acks with its old receipt.
pub(super) fn power_cut(ctx: &Ctx) -> Checked {
    let booted_again = cmdline("resume").as_deref() == Some(POWER_TEST);
    by_role(|| if booted_again { power_owner_after(ctx) } else { power_owner_before() }, power_reader)
}

pub(super) fn power_payload() -> Vec<u8> {
    seeded(0x90c0, POWER_CHUNKS)
}

pub(super) fn power_owner_before() -> Checked {
    use pdstor_client::Writer;
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

pub(super) fn power_owner_after(ctx: &Ctx) -> Checked {
    use pdstor_client::Client;
    // The target again, reachable from this host alone for now: its port
    // listens on loopback, so the reader host's reconnects are refused and
    // retried. (Exporting to the writer's host NQN alone raced: a reconnect
    // that came then was rejected for good — "not allowed", DNR — and the
    // reader's kernel failed the queued read.)
    export_all_on(ctx, None, 2, LOOPBACK)?;
    connect_at(WRITER_HOSTNQN, WRITER_HOSTID, LOOPBACK)?;
    let dev = fabric_namespace_n(3)?;
    let _daemon = start_owner(&dev, "/tmp/vmtest/topology-serve-power-again.log")?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let mut peer = Peer::accept(REBORN_PORT)?;
    let result = (|| -> Checked {
        let line = peer.recv()?;
        let claim: pdstor_client::receipt::Receipt =
            parse("the claim", line.strip_prefix("claim ").ok_or(format!("reader: {line:?}"))?)?;
        let held = c.publications(None, false).map_err(api("listing"))?;
        let state = held.iter().find(|p| p.publication == claim.publication).map(|p| p.state.clone());
        if state.as_deref() != Some("ADOPTED") {
            return Err(format!("after the power cut the reader's publication is {state:?}, not ADOPTED").into());
        }
        reclaim_refused(&c, &claim, "after the power cut")?;
        let fillers = fill_free_slots(&server, "fill-power", 0xf0f0)?;
        console(&format!(
            "pdstor-vminit: topology owner after its power cut: the reader's publication is ADOPTED, {} fillers took every free slot; letting the reader host back in",
            fillers.len()
        ));
        open_port(1, STORAGE_ADDR)?;
        peer.send("allowed")?;
        match peer.recv()?.as_str() {
            "acked" => {}
            other => return Err(format!("the reader host reported {other:?}").into()),
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

pub(super) fn power_reader() -> Checked {
    use pdstor_client::RemoteReader;
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let server = format!("http://{CONTROL}");
    let want = power_payload();
    let mut peer = Peer::dial(POWER_PORT)?;
    let ready: pdstor_client::receipt::Receipt = parse("the receipt", &peer.recv()?)?;
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
    let result = (|| -> Checked {
        peer.send(&format!("claim {}", json(&claim)?))?;
        if peer.recv()? != "allowed" {
            return Err("the owner did not let this host back in".into());
        }
        let status = inflight.wait().map_err(|e| format!("the in-flight read: {e}"))?;
        if !status.success() {
            return Err(format!("the read in flight across the power cut failed: {status}").into());
        }
        for c in &m.chunks[half..] {
            let got = std::fs::read(format!("/tmp/vmtest/inflight-{}", c.index)).map_err(|e| e.to_string())?;
            let at = c.index as usize * HANDOFF_CHUNK as usize;
            if got[..] != want[at..at + c.len as usize] {
                return Err(format!("chunk {} read across the power cut is not the writer's", c.index).into());
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
