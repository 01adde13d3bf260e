//! An owner whose host is cut off from the network — alive, its daemon
//! running — is taken over, and says so itself when it is back (issue 35).
//! Here the roles turn: the owner runs on the reader guest (its own
//! NVMe/TCP view, key 0x5d11), the standby on the storage guest (0x5d12).
//! The owner publishes, then its host drops its network (`ip link set eth0
//! down`) for 20 s. The standby's health checks to it go unanswered; it
//! takes over and serves every acknowledged publication byte for byte with
//! its old receipt. When the owner's network comes back, its own check
//! finds its key preempted: it answers `namespace_lost` everywhere, refuses
//! a put, and the target refuses its host's raw write.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::takeover::{raw_write_refused, spawn_serve};
use super::*;

const PARTITION_PORT: u16 = 7085;

const PARTITIONED_OWNER_KEY: u64 = 0x5d11;

const PARTITION_STANDBY_KEY: u64 = 0x5d12;

/// The partitioned owner's control plane, on the reader guest.
const OWNER_CONTROL: &str = "10.77.0.2:7078";

const OWNER_LOG: &str = "/tmp/vmtest/topology-partitioned-owner.log";

/// How long the owner's host is cut off.
const CUT: Duration = Duration::from_secs(20);

fn payload(i: u64) -> Vec<u8> {
    seeded(0x7c0 + i, 4)
}

pub(super) fn partition(_: &Ctx) -> Checked {
    needs_reservations("")?;
    by_role(partition_standby, partition_owner)
}

/// The storage guest: formats, stands by, takes over, serves the old receipts.
fn partition_standby() -> Checked {
    use pdstor_client::{Client, Reader};
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let mut peer = Peer::accept(PARTITION_PORT)?;
    let mut standby = None;
    let result = (|| -> Checked {
        peer.send("formatted")?;
        if peer.recv()? != "owner-up" {
            return Err("the owner did not come up".into());
        }
        let key = format!("{PARTITION_STANDBY_KEY:#x}");
        let owner = format!("http://{OWNER_CONTROL}");
        let flags = ["--standby", "--owner", owner.as_str(), "--reservation-key", key.as_str()];
        standby = Some(spawn_serve(&dev, &flags, CONTROL, DATA_SOCKET, "/tmp/vmtest/topology-partition-standby.log")?);
        peer.send("standing-by")?;
        let line = peer.recv()?;
        let receipts: Vec<pdstor_client::receipt::Receipt> =
            parse("the receipts", line.strip_prefix("cutting ").ok_or(format!("the owner said {line:?}"))?)?;
        let cut = Instant::now();
        let server = format!("http://{CONTROL}");
        let c = Client::new(&server);
        let info = loop {
            match c.namespace() {
                Ok(info) => break info,
                Err(_) if cut.elapsed() < CUT => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(format!("the standby did not take over while the owner was cut off: {e}").into()),
            }
        };
        let serving = cut.elapsed();
        let took = std::fs::read_to_string("/tmp/vmtest/topology-partition-standby.log").unwrap_or_default();
        let took = took.lines().filter(|l| l.contains("took the namespace over")).collect::<Vec<_>>().join(" ");
        let keys = pdstor_engine::io::persistent_reservation::Reservations::open(&dev).and_then(|r| r.keys());
        console(&format!("pdstor-vminit: partition: the standby: {took}; keys at the target now {keys:?}"));
        if info.epoch <= receipts[0].epoch {
            return Err(
                format!("after the takeover the epoch is {}, the receipts' {}", info.epoch, receipts[0].epoch).into()
            );
        }
        let mut reader = Reader::new(&server, Path::new(DATA_SOCKET)).map_err(|e| e.to_string())?;
        for (i, ready) in receipts.iter().enumerate() {
            let claim = reader.client.claim(ready, "decode-partition", "partition", 600_000).map_err(api("claim"))?;
            let want = payload(i as u64);
            same_bytes(
                &dev,
                &extents(&reader.client, claim.publication)?,
                &want,
                "outside pdstor, after the takeover",
            )?;
            let restored = reader.get(&claim, &kv_layout()).map_err(api("load after the takeover"))?;
            if reader.restored_bytes(restored.len).map_err(|e| e.to_string())? != want {
                return Err(format!("publication {i} restored other bytes after the takeover").into());
            }
            reader.client.ack(&claim, &restored.restore_digest).map_err(api("ack"))?;
        }
        console(&format!(
            "pdstor-vminit: partition: owner host cut off -> standby serves epoch {} in {} ms (its health checks unanswered)",
            info.epoch,
            serving.as_millis()
        ));
        let line = peer.recv()?;
        if !line.starts_with("back") {
            return Err(format!("the partitioned owner reported {line:?}").into());
        }
        // The partitioned owner's step, refused, changed nothing here.
        if !c.publications(None, false).map_err(api("publications"))?.is_empty() {
            return Err("publications remain after every one was acked".into());
        }
        Ok(())
    })();
    drop(standby);
    // The reservation outlives the daemon (it is the host's): cleared first.
    let cleared = pdstor_engine::io::persistent_reservation::Reservations::open(&dev)
        .and_then(|r| r.clear(PARTITION_STANDBY_KEY))
        .map_err(|e| format!("clearing the reservation: {e}").into());
    let result = result.and(cleared);
    let _ = peer.send(if result.is_ok() { "checked" } else { "abandon" });
    result
}

/// The reader guest: owns, publishes, is cut off, comes back lost.
fn partition_owner() -> Checked {
    use pdstor_client::{ClientError, Writer};
    connect()?;
    let dev = fabric_namespace()?;
    let mut peer = Peer::dial(PARTITION_PORT)?;
    let mut owner = None;
    let result = (|| -> Checked {
        if peer.recv()? != "formatted" {
            return Err("the namespace was not formatted".into());
        }
        let key = format!("{PARTITIONED_OWNER_KEY:#x}");
        owner = Some(spawn_serve(&dev, &["--reservation-key", key.as_str()], OWNER_CONTROL, DATA_SOCKET, OWNER_LOG)?);
        peer.send("owner-up")?;
        if peer.recv()? != "standing-by" {
            return Err("no standby stood by".into());
        }
        let server = format!("http://{OWNER_CONTROL}");
        let mut w = Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4).map_err(|e| e.to_string())?;
        let mut receipts = Vec::new();
        for i in 0..2 {
            receipts.push(
                w.put(&format!("partitioned-{i}"), &kv_layout(), &payload(i), 4, Some(42)).map_err(api("put"))?.receipt,
            );
        }
        peer.send(&format!("cutting {}", json(&receipts)?))?;
        sh("ip", &["link", "set", "eth0", "down"])?;
        std::thread::sleep(CUT);
        sh("ip", &["link", "set", "eth0", "up"])?;
        let back = Instant::now();
        let probe = |when: &str| {
            let r = pdstor_engine::io::persistent_reservation::Reservations::open(&dev);
            let keys = r.as_ref().map_err(|e| e.to_string()).and_then(|r| r.keys().map_err(|e| e.to_string()));
            let registered = r
                .as_ref()
                .map_err(|e| e.to_string())
                .and_then(|r| r.registered(PARTITIONED_OWNER_KEY).map_err(|e| e.to_string()));
            console(&format!(
                "pdstor-vminit: partition: the old owner's host {when}: keys {keys:?}, registered {registered:?}"
            ));
        };
        let c = pdstor_client::Client::new(&server);
        // Its own check finds its key preempted once the target answers again.
        let lost_after = loop {
            match c.healthz() {
                Err(ClientError::Api(e)) if e.code == "namespace_lost" => break back.elapsed(),
                _ if back.elapsed() < Duration::from_secs(90) => std::thread::sleep(Duration::from_millis(50)),
                other => {
                    probe("90 s after its network came back");
                    return Err(format!(
                        "90 s after its network came back the old owner says {other:?}; {}",
                        diagnose(owner.as_ref())
                    )
                    .into());
                }
            }
        };
        match w.put("after-the-cut", &kv_layout(), &payload(9), 4, Some(42)) {
            Err(ClientError::Api(e)) if e.code == "namespace_lost" => {}
            other => return Err(format!("the lost owner took a put: {other:?}").into()),
        }
        raw_write_refused(&dev, "the partitioned owner's host, after the takeover")?;
        console(&format!(
            "pdstor-vminit: partition: the old owner said namespace_lost {} ms after its network came back",
            lost_after.as_millis()
        ));
        peer.send(&format!("back {}", lost_after.as_millis()))?;
        match peer.recv()?.as_str() {
            "checked" => Ok(()),
            other => Err(format!("the standby side reported {other:?}").into()),
        }
    })();
    drop(owner);
    let _ = sh("ip", &["link", "set", "eth0", "up"]);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}

/// What the old owner's host shows when it did not say it lost the
/// namespace: the NVMe controllers' states, the namespace devices, where
/// each of the daemon's threads waits, and its log.
fn diagnose(owner: Option<&crate::suites::protocol::Daemon>) -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_else(|e| format!("({e})"));
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/class/nvme").into_iter().flatten().flatten() {
        let d = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        out.push(format!(
            "{name}: state {} transport {} subsys {}",
            read(&format!("{}/state", d.display())),
            read(&format!("{}/transport", d.display())),
            read(&format!("{}/subsysnqn", d.display()))
        ));
    }
    let blocks: Vec<String> = std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|b| b.starts_with("nvme"))
        .collect();
    out.push(format!("block devices: {blocks:?}"));
    if let Some(d) = owner {
        let pid = d.0.id();
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let t = t.path();
            out.push(format!(
                "thread {}: wchan {} stack {}",
                read(&format!("{}/comm", t.display())),
                read(&format!("{}/wchan", t.display())),
                read(&format!("{}/stack", t.display())).replace('\n', " | ")
            ));
        }
    }
    out.push(format!("log: {}", read(OWNER_LOG)));
    out.join("; ")
}
