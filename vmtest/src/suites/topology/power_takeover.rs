//! The owner's host loses power and its standby takes over (issue 35). The
//! roles turn: the owner runs on the reader guest (its own NVMe/TCP view of
//! the small namespace, with its key), the standby on the storage guest
//! beside a direct reader (registered with the standby's key: one
//! registration per host and namespace). The owner publishes three
//! handoffs, and the power goes (QEMU killed at once) with one of them only
//! published, one claimed and never adopted, and one adopted and half read.
//! The standby's health checks go unanswered; it takes over and each
//! handoff is finished as its point allows (see [`finish_caught`]), the
//! unpublished one rolled back. The owner's host boots again: the target
//! refuses its raw read and write, and its daemon, started with its key,
//! refuses to serve.

use std::path::Path;
use std::time::Instant;

use crate::machine::{Ctx, cmdline, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::{POWER_CUT_ME, SHARED_NQN};

use super::takeover::{Caught, catch, cut_off, finish_caught, serving_after, spawn_serve};
use super::*;

pub(super) const POWER_TAKEOVER_TEST: &str = "an_owner_host_loses_power_and_its_standby_takes_over";

/// The conversation before the power cut, and the one with the host booted again.
const BEFORE_PORT: u16 = 7086;
const AFTER_PORT: u16 = 7087;

const DOOMED_KEY: u64 = 0x5d31;
const STANDBY_KEY: u64 = 0x5d32;

/// The doomed owner's control plane, on the reader guest.
const OWNER_CONTROL: &str = "10.77.0.2:7078";

/// Where each handoff is when the power goes.
const POINTS: [&str; 3] = ["published", "claimed", "half_read"];

const CHUNKS: u32 = 8;

fn payload(i: usize) -> Vec<u8> {
    seeded(0x9c00 + i as u64, CHUNKS)
}

/// What the owner hands over before its power goes: one READY receipt per
/// point, and the publication stored but never published.
type Handed = (Vec<pdstor_client::receipt::Receipt>, u64);

pub(super) fn power_takeover(_: &Ctx) -> Checked {
    needs_reservations(", so a standby cannot fence an owner")?;
    let booted_again = cmdline("resume").as_deref() == Some(POWER_TAKEOVER_TEST);
    by_role(power_standby, || if booted_again { revived_owner() } else { doomed_owner() })
}

/// The storage guest: formats, stands by beside a direct reader, takes over
/// when the owner's power goes, finishes every handoff, and hears from the
/// owner's host once it is back.
fn power_standby() -> Checked {
    use pdstor_client::{Client, RemoteReader};
    let dev = fabric_namespace_n(3)?;
    format_namespace(&dev)?;
    let mut peer = Peer::accept(BEFORE_PORT)?;
    let (mut standby, mut revived, mut power_went) = (None, None, false);
    let result = (|| -> Checked {
        peer.send("formatted")?;
        if peer.recv()? != "owner-up" {
            return Err("the owner did not come up".into());
        }
        let (owner, server) = (format!("http://{OWNER_CONTROL}"), format!("http://{CONTROL}"));
        let key = format!("{STANDBY_KEY:#x}");
        let flags = ["--standby", "--owner", owner.as_str(), "--reservation-key", key.as_str()];
        let log = "/tmp/vmtest/topology-power-standby.log";
        standby = Some(spawn_serve(&dev, &flags, CONTROL, DATA_SOCKET, log)?);
        let mut r = RemoteReader::open_with(&format!("{owner},{server}"), &dev, Some(STANDBY_KEY))
            .map_err(api("opening the direct reader"))?;
        peer.send("standing-by")?;
        let (receipts, unpublished): Handed = parse("the receipts", &peer.recv()?)?;
        let caught: Vec<Caught> = POINTS
            .iter()
            .zip(&receipts)
            .enumerate()
            .map(|(i, (point, ready))| catch(&r, ready, point, &dev, &payload(i)))
            .collect::<Checked<_>>()?;
        peer.send("cut")?;
        power_went = true;
        let cut = Instant::now();
        let c = Client::new(&server);
        let info = serving_after(&c, cut, log)?;
        let serving = cut.elapsed();
        if info.epoch <= receipts[0].epoch || info.namespace != receipts[0].namespace {
            return Err(format!(
                "after the takeover the namespace is {info:?}, the receipts' epoch {}",
                receipts[0].epoch
            )
            .into());
        }
        let mut first_step = None;
        for (i, caught) in caught.into_iter().enumerate() {
            let first = finish_caught(&mut r, (&server, &dev), &dev, caught, &payload(i), cut)
                .map_err(|e| format!("the handoff {} when the power went: {e}", POINTS[i]))?;
            first_step.get_or_insert(first);
        }
        if c.publications(None, false).map_err(api("publications"))?.iter().any(|p| p.publication == unpublished) {
            return Err("the unpublished publication survived the takeover".into());
        }
        console(&format!(
            "pdstor-vminit: power takeover: owner host lost power -> standby serves epoch {} in {} ms, first step served in {} ms",
            info.epoch,
            serving.as_millis(),
            first_step.unwrap_or_default().as_millis()
        ));
        // The owner's host, booted again, checks it is cut off.
        let p = revived.insert(Peer::accept(AFTER_PORT)?);
        p.send("taken-over")?;
        match p.recv()?.as_str() {
            "cut-off" => Ok(()),
            other => Err(format!("the owner's host, booted again, reported {other:?}").into()),
        }
    })();
    drop(standby);
    // The reservation outlives the daemon (it is the host's): cleared first.
    let cleared = pdstor_engine::io::persistent_reservation::Reservations::open(&dev)
        .and_then(|r| r.clear(STANDBY_KEY))
        .map_err(|e| format!("clearing the reservation: {e}").into());
    let result = result.and(cleared);
    // To whichever side of the owner's host listens: once its power went,
    // the host booted again (which dials in even when this side failed).
    if power_went && revived.is_none() {
        revived = Peer::accept(AFTER_PORT).ok();
    }
    revived.as_mut().unwrap_or(&mut peer).report(&result);
    result
}

/// The reader guest, first boot: owns the namespace, publishes, hands over
/// three handoffs, and loses its power.
fn doomed_owner() -> Checked {
    use pdstor_client::{Client, Writer};
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let mut peer = Peer::dial(BEFORE_PORT)?;
    if peer.recv()? != "formatted" {
        return Err("the namespace was not formatted".into());
    }
    let key = format!("{DOOMED_KEY:#x}");
    let log = "/tmp/vmtest/topology-doomed-owner.log";
    let _owner = spawn_serve(&dev, &["--reservation-key", key.as_str()], OWNER_CONTROL, DATA_SOCKET, log)?;
    peer.send("owner-up")?;
    if peer.recv()? != "standing-by" {
        return Err("no standby stood by".into());
    }
    let server = format!("http://{OWNER_CONTROL}");
    let mut w = Writer::new(&server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, CHUNKS).map_err(|e| e.to_string())?;
    let receipts = (0..POINTS.len())
        .map(|i| Ok(w.put(&format!("doomed-{i}"), &kv_layout(), &payload(i), 4, Some(42)).map_err(api("put"))?.receipt))
        .collect::<Checked<Vec<_>>>()?;
    let (unpublished, _conn) = store_unpublished(&Client::new(&server), "doomed-unpublished", &seeded(0x9cff, 4))?;
    let handed: Handed = (receipts, unpublished.publication);
    peer.send(&json(&handed)?)?;
    if peer.recv()? != "cut" {
        return Err("the standby did not catch the handoffs".into());
    }
    console(&format!("{POWER_CUT_ME}{POWER_TAKEOVER_TEST}"));
    // The host's power goes here; should it not, the test fails.
    std::thread::sleep(std::time::Duration::from_secs(60));
    Err("the power was not cut".into())
}

/// The reader guest booted again: the old owner's host is cut off.
fn revived_owner() -> Checked {
    connect()?;
    let dev = fabric_namespace_n(3)?;
    let mut peer = Peer::dial(AFTER_PORT)?;
    let result = (|| -> Checked {
        if peer.recv()? != "taken-over" {
            return Err("the standby did not take over".into());
        }
        cut_off(&dev, &format!("{DOOMED_KEY:#x}"), "the owner's host, booted again after its power cut")?;
        peer.send("cut-off")?;
        peer.outcome()
    })();
    if result.is_err() {
        let _ = peer.send("abandon");
    }
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}
