//! A reader host dies holding an adopted claim: the owner fences its
//! session, then reclaims the publication; nothing is freed before.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::machine::{Ctx, console};
use crate::suites::Checked;
use crate::suites::io::dd_direct;
use pdstor_vmtest_spec::{KILL_ME, READER_ADDR};

use super::*;

/// Where the storage guest hands the doomed reader its receipt.
pub(super) const DEATH_PORT: u16 = 7073;

/// Where the doomed reader answers while it lives.
pub(super) const HEARTBEAT_PORT: u16 = 7074;

pub(super) const DEATH_CHUNKS: u32 = 16;

/// The reader host claims, adopts, reads half the chunks, tells the owner
/// its claim, and dies (QEMU killed: no shutdown, no ack, no goodbye). The
/// owner sees its host gone; the claim is not freed by that (a reclaim is
/// refused: the reader is not fenced), nor by anything but fencing: the
/// owner closes the reader's session, then reclaims, and the slots serve a
/// new publication.
pub(super) fn reader_death(_: &Ctx) -> Checked {
    by_role(death_owner, death_reader)
}

pub(super) fn death_owner() -> Checked {
    use pdstor_client::{Client, Writer};
    let _daemon = serve_owner("/tmp/vmtest/topology-serve-death.log")?;
    let server = format!("http://{CONTROL}");
    let socket = DATA_SOCKET;
    let c = Client::new(&server);
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, DEATH_CHUNKS).map_err(|e| e.to_string())?;
    let payload: Vec<u8> = handoff_payload()[..(DEATH_CHUNKS as u64 * HANDOFF_CHUNK) as usize].to_vec();
    let published = w.put("topology-doomed", &kv_layout(), &payload, 8, Some(42)).map_err(|e| format!("put: {e}"))?;
    let receipt = serde_json::to_string(&published.receipt).map_err(|e| e.to_string())?;
    let line = serve_once(DEATH_PORT, Some(&receipt))?;
    let claim: pdstor_client::receipt::Receipt =
        serde_json::from_str(line.trim().strip_prefix("adopted ").unwrap_or(""))
            .map_err(|e| format!("the reader host's claim {line:?}: {e}"))?;
    // Its host is gone when it stops answering.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut silent = 0;
    while silent < 3 {
        let addr = std::net::SocketAddr::from(([10, 77, 0, 2], HEARTBEAT_PORT));
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Ok(_) => silent = 0,
            Err(_) => silent += 1,
        }
        if Instant::now() > deadline {
            return Err("the reader host was still answering 60 s after it said it would die".into());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    console("pdstor-vminit: topology owner: the reader host is gone");
    let state = |c: &Client| -> Checked<Option<String>> {
        Ok(c.publications(None, false)
            .map_err(|e| e.to_string())?
            .into_iter()
            .find(|p| p.publication == claim.publication)
            .map(|p| p.state))
    };
    if state(&c)?.as_deref() != Some("ADOPTED") {
        return Err(format!("the dead reader's claim is {:?}, not ADOPTED", state(&c)?).into());
    }
    reclaim_refused(&c, &claim, "before fencing")?;
    if state(&c)?.as_deref() != Some("ADOPTED") {
        return Err("the refused reclaim changed the claim".into());
    }
    c.close_session(&claim).map_err(|e| format!("fencing the dead reader's session: {e}"))?;
    c.reclaim(&claim).map_err(|e| format!("reclaim after fencing: {e}"))?;
    if state(&c)?.is_some() {
        return Err("the fenced, reclaimed publication is still listed".into());
    }
    // Its slots serve a new publication.
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, DEATH_CHUNKS).map_err(|e| e.to_string())?;
    w.put("topology-after", &kv_layout(), &payload, 8, Some(42)).map_err(|e| format!("put after the reclaim: {e}"))?;
    Ok(())
}

pub(super) fn death_reader() -> Checked {
    use pdstor_client::{Client, RemoteReader};
    connect()?;
    let dev = fabric_namespace()?;
    let (mut peer, line) = from_owner(DEATH_PORT)?;
    let ready: pdstor_client::receipt::Receipt =
        serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
    let server = format!("http://{CONTROL}");
    let c = Client::new(&server);
    let claim = c.claim(&ready, "decode-doomed", "doomed", 600_000).map_err(|e| format!("claim: {e}"))?;
    let r = RemoteReader::open(&server, &dev).map_err(|e| e.to_string())?;
    r.check_namespace(&claim).map_err(|e| e.to_string())?;
    let m = c
        .adopt(&pdstor_client::wire::AdoptRequest::of_claim(&claim, kv_layout()))
        .map_err(|e| format!("adopt: {e}"))?;
    // Mid-load: half the chunks read, nothing reported, no ack.
    for chunk in m.chunks.iter().take(m.chunks.len() / 2) {
        dd_direct(&dev, chunk.offset.0, chunk.len)?;
    }
    let heartbeat = TcpListener::bind((READER_ADDR, HEARTBEAT_PORT)).map_err(|e| format!("heartbeat: {e}"))?;
    std::thread::spawn(move || for _ in heartbeat.incoming() {});
    let claim_json = serde_json::to_string(&claim).map_err(|e| e.to_string())?;
    peer.send(&format!("adopted {claim_json}"))?;
    // Answer heartbeats for a moment, then die as a host does.
    std::thread::sleep(Duration::from_secs(3));
    console(KILL_ME);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
