//! A handoff to a reader host: the writer host stores and publishes 64 chunks;
//! the reader host claims, reads each chunk itself over NVMe/TCP, reports
//! checksums, acks, and compares the bytes outside pdstor.

use std::path::Path;

use pdstor_engine::payload;

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

pub(super) const HANDOFF_CHUNKS: u32 = 64;

pub(super) const HANDOFF_CHUNK: u64 = 256 << 10;

pub(super) const HANDOFF_SEED: u64 = 0x64c4;

/// Where the storage guest hands the reader its READY receipt and waits for its report.
pub(super) const HANDOFF_PORT: u16 = 7072;

pub(super) fn handoff_payload() -> Vec<u8> {
    (0..HANDOFF_CHUNKS as u64).flat_map(|i| payload::chunk(HANDOFF_SEED, i, HANDOFF_CHUNK as usize)).collect()
}

/// The writer host (the storage guest) formats its namespace, serves it with
/// the control plane on the private network, stores 64 chunks and publishes;
/// the reader host claims over HTTP, reads every chunk itself from its
/// NVMe/TCP view of the namespace (`RemoteReader`: its superblock must be the
/// receipt's namespace), reports only checksums, acks, and compares the bytes
/// with the writer's outside pdstor. The owner then holds nothing of it.
pub(super) fn handoff(_: &Ctx) -> Checked {
    by_role(handoff_writer, handoff_reader)
}

pub(super) fn handoff_writer() -> Checked {
    use pdstor_client::{Client, Writer};
    let dev = fabric_namespace()?;
    format_namespace(&dev)?;
    let owner_tl = "/tmp/vmtest/topology-owner.jsonl";
    let _ = std::fs::remove_file(owner_tl);
    let daemon = start_owner_with(
        &dev,
        "/tmp/vmtest/topology-serve.log",
        &["--provenance", "--require-native", "--timeline", owner_tl],
    )?;
    let server = format!("http://{CONTROL}");
    let socket = DATA_SOCKET;
    let mut w = Writer::new(&server, Path::new(socket), HANDOFF_CHUNK, HANDOFF_CHUNKS).map_err(|e| e.to_string())?;
    let published =
        w.put("topology-1", &kv_layout(), &handoff_payload(), 8, Some(42)).map_err(|e| format!("put: {e}"))?;
    console(&format!("pdstor-vminit: topology writer published {} chunks", HANDOFF_CHUNKS));
    // Hand the reader its READY receipt; wait for its report.
    let receipt = serde_json::to_string(&published.receipt).map_err(|e| e.to_string())?;
    let line = serve_once(HANDOFF_PORT, Some(&receipt))?;
    let Some(reader_lines) = line.trim().strip_prefix("ok ") else {
        return Err(format!("the reader host reported {:?}", line.trim()).into());
    };
    let left = Client::new(&server).publications(None, false).map_err(|e| e.to_string())?;
    if !left.is_empty() {
        return Err(format!("after the reader host's ack the owner still holds {left:?}").into());
    }
    drop(daemon);
    // Both hosts' timelines, merged by the messages between them, checked.
    let reader_lines: Vec<String> = parse("the reader host's timeline", reader_lines)?;
    let reader_tl = "/tmp/vmtest/topology-reader-host.jsonl";
    std::fs::write(reader_tl, reader_lines.join("\n") + "\n").map_err(|e| e.to_string())?;
    let merged = "/tmp/vmtest/topology-merged.jsonl";
    sh("/bin/pdstor", &["timeline", "merge", owner_tl, reader_tl, "-o", merged])?;
    let report = sh("/bin/pdstor", &["timeline", "check", "--require-path", "host_fixed", merged])?;
    let nodes: std::collections::BTreeSet<String> = pdstor_client::timeline::read(Path::new(merged))
        .map_err(|e| e.to_string())?
        .into_iter()
        .filter_map(|(_, e)| e.ok().map(|e| e.node))
        .collect();
    let want_events = format!("{} payload events", 2 * HANDOFF_CHUNKS);
    if !report.contains(&want_events) || !nodes.iter().any(|n| n.starts_with("remote-")) {
        return Err(format!("the merged timeline of nodes {nodes:?} checked as {report:?}").into());
    }
    console(&format!("pdstor-vminit: topology merged timeline of {nodes:?}: {}", report.trim()));
    Ok(())
}

pub(super) fn handoff_reader() -> Checked {
    use pdstor_client::RemoteReader;
    let (mut peer, line) = from_owner(HANDOFF_PORT)?;
    let result = (|| -> Checked<String> {
        let ready: pdstor_client::receipt::Receipt =
            serde_json::from_str(line.trim()).map_err(|e| format!("the receipt {line:?}: {e}"))?;
        let server = format!("http://{CONTROL}");
        connect()?;
        let dev = fabric_namespace()?;
        let tl = "/tmp/vmtest/topology-reader-host.jsonl";
        let _ = std::fs::remove_file(tl);
        let timeline = pdstor_client::timeline::Timeline::open(Path::new(tl), "remote-reader-host")
            .map_err(|e| format!("the reader host's timeline: {e}"))?;
        let judge = pdstor_daemon::provenance::ProbeJudge::attach()?;
        let mut r = RemoteReader::open(&server, &dev)
            .map_err(|e| e.to_string())?
            .with_judge(Box::new(judge))
            .with_timeline(std::sync::Arc::new(timeline));
        let claim = r.claim(&ready, "decode-remote", "topology", 120_000).map_err(|e| format!("claim: {e}"))?;
        let restored = r.get(&claim, &kv_layout()).map_err(|e| format!("get --direct {}: {e}", dev.display()))?;
        // The reader host's own probes judge its reads from the fabric.
        if r.verdicts().len() != HANDOFF_CHUNKS as usize || r.verdicts().iter().any(|v| v != "native") {
            return Err(format!("the reader host's probes judged its loads {:?}", r.verdicts()).into());
        }
        let bytes = r.restored_bytes(restored.len).map_err(|e| e.to_string())?;
        if let Some(at) = payload::first_difference(&handoff_payload(), &bytes) {
            return Err(format!("the restored bytes differ from the writer's at byte {at}").into());
        }
        r.ack(&claim, &restored).map_err(|e| format!("ack: {e}"))?;
        let lines: Vec<String> =
            std::fs::read_to_string(tl).map_err(|e| format!("reading {tl}: {e}"))?.lines().map(str::to_owned).collect();
        json(&lines)
    })();
    let report = match &result {
        Ok(lines) => format!("ok {lines}"),
        Err(e) => format!("fail {e}"),
    };
    let _ = peer.send(&report);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result.map(drop)
}
