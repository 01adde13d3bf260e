//! The owner (writer) host's daemon on the shared namespace, and the checks
//! the owner-side tests share: extents, bytes compared outside pdstor,
//! flush counts, refused reclaims, a store filled to its last slot.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::machine::sh;
use crate::suites::Checked;
use crate::suites::io::dd_direct;

use super::*;

/// Formats the shared namespace, as the writer host sees it over the fabric,
/// and serves it there.
pub(super) fn serve_owner(log: &str) -> Checked<crate::suites::protocol::Daemon> {
    let d = fabric_namespace()?;
    format_namespace(&d)?;
    start_owner(&d, log)
}

pub(super) fn format_namespace(d: &Path) -> Checked {
    let d = d.to_string_lossy();
    Ok(sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "256K", "--target", &d])
        .map(drop)
        .map_err(String::from)?)
}

/// Serves the formatted namespace `d` (the writer host's fabric view) on the
/// private network; a prepare waits at most 2 s for capacity.
pub(super) fn start_owner(d: &Path, log: &str) -> Checked<crate::suites::protocol::Daemon> {
    start_owner_with(d, log, &[])
}

pub(super) fn start_owner_with(d: &Path, log: &str, extra: &[&str]) -> Checked<crate::suites::protocol::Daemon> {
    use pdstor_client::Client;
    let d = d.to_string_lossy().into_owned();
    let socket = DATA_SOCKET;
    let _ = std::fs::remove_file(socket);
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let child = std::process::Command::new("/bin/pdstor")
        .args(["serve", "--listen", CONTROL, "--insecure-tcp", "--data-socket", socket, "--target", &d])
        .args(["--admission-timeout-ms", "2000"])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("starting pdstor serve: {e}"))?;
    let daemon = crate::suites::protocol::Daemon(child);
    let c = Client::new(&format!("http://{CONTROL}"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(socket).exists() || c.healthz().is_err() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            return Err(format!("pdstor serve did not come up on {CONTROL}: {log}").into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(daemon)
}

/// Reads `len` bytes at `offset` of `dev`, held open, through this host's
/// page cache (no `O_DIRECT`), as a careless reader would. (Held open: the
/// last close of a block device drops its page cache.)
pub(super) fn read_cached(dev: &std::fs::File, offset: u64, len: u64) -> Checked<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut out = vec![0u8; len as usize];
    dev.read_exact_at(&mut out, offset).map_err(|e| format!("a cached read of {len} bytes at {offset}: {e}"))?;
    Ok(out)
}

/// The chunks' places on the target, as the owner lists them (`?verbose=1`).
pub(super) fn extents(c: &pdstor_client::Client, publication: u64) -> Checked<Vec<pdstor_client::wire::Extent>> {
    let infos = c.publications(None, true).map_err(api("listing the publications"))?;
    let p = infos
        .into_iter()
        .find(|p| p.publication == publication)
        .ok_or_else(|| format!("publication {publication} is not listed"))?;
    Ok(p.extents.ok_or_else(|| format!("publication {publication} is listed without its extents"))?)
}

/// Checks, outside pdstor, that each extent on `dev` holds the writer's chunk.
pub(super) fn same_bytes(dev: &Path, extents: &[pdstor_client::wire::Extent], want: &[u8], what: &str) -> Checked {
    for e in extents {
        let len = e.len.unwrap_or(HANDOFF_CHUNK);
        let got = dd_direct(dev, e.offset, len)?;
        let at = e.chunk as usize * HANDOFF_CHUNK as usize;
        if got[..] != want[at..at + len as usize] {
            return Err(format!(
                "{what}: chunk {} at byte {} of {} is not the writer's",
                e.chunk,
                e.offset,
                dev.display()
            )
            .into());
        }
    }
    Ok(())
}

/// A block device's completed flush requests (`/sys/block/*/stat`, field 16).
pub(super) fn flushes(dev: &Path) -> Checked<u64> {
    let name = dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).map_err(|e| format!("{name} stat: {e}"))?;
    Ok(stat
        .split_whitespace()
        .nth(15)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{name} stat has no flush count: {stat:?}"))?)
}

/// The first `n` chunks' places, as the adopted manifest gives them.
pub(super) fn manifest_extents(m: &pdstor_client::layout::Manifest, n: usize) -> Vec<pdstor_client::wire::Extent> {
    m.chunks
        .iter()
        .take(n)
        .map(|c| pdstor_client::wire::Extent {
            chunk: c.index,
            slot: 0,
            offset: c.offset.0,
            len: Some(c.len),
            crc32c: Some(c.crc32c),
        })
        .collect()
}

/// prepare → store every chunk of `payload` in one batch, not published
/// (so never flushed by pdstor): the publication stays PREPARED.
pub(super) fn store_unpublished(
    c: &pdstor_client::Client,
    req_id: &str,
    payload: &[u8],
) -> Checked<(pdstor_client::wire::Prepared, pdstor_client::DataConn)> {
    let n = (payload.len() as u64 / HANDOFF_CHUNK) as u32;
    let p = c.prepare(req_id, &kv_layout(), n, "w-topology").map_err(api("prepare"))?;
    let mut data = pdstor_client::DataConn::connect(Path::new(DATA_SOCKET)).map_err(api("the data plane"))?;
    let buf = pdstor_engine::buffer::Buffer::memfd(req_id, payload.len()).map_err(|e| e.to_string())?;
    buf.write_at(0, payload).map_err(|e| e.to_string())?;
    let id = data.register(&buf).map_err(api("registering"))?;
    let chunks = (0..n)
        .map(|i| pdstor_client::wire::DataChunk {
            index: i,
            buffer: id,
            offset: i as u64 * HANDOFF_CHUNK,
            len: HANDOFF_CHUNK,
            crc32c: None,
        })
        .collect();
    data.store(p.publication, &p.writer_token, chunks, true, n).map_err(api("store"))?;
    Ok((p, data))
}

/// Kills the owner's daemon at once (`kill -9`) and reaps it.
pub(super) fn kill9(mut daemon: crate::suites::protocol::Daemon) -> Checked {
    daemon.0.kill().map_err(|e| format!("kill -9 the owner: {e}"))?;
    let _ = daemon.0.wait();
    // Reaped: its Drop would signal a pid that may be another process's by now.
    std::mem::forget(daemon);
    Ok(())
}

/// A reclaim of `claim` must be refused `not_fenced` (`when`: the moment, for the error).
pub(super) fn reclaim_refused(
    c: &pdstor_client::Client,
    claim: &pdstor_client::receipt::Receipt,
    when: &str,
) -> Checked {
    match c.reclaim(claim) {
        Err(pdstor_client::ClientError::Api(b)) if b.code == "not_fenced" => Ok(()),
        other => Err(format!("a reclaim {when} was not refused not_fenced: {other:?}").into()),
    }
}

/// A writer puts 4-chunk publications (`tag-0`, `tag-1`, …, seeded from
/// `seed`) until admission refuses one: every free slot is taken. Returns
/// their READY receipts.
pub(super) fn fill_free_slots(server: &str, tag: &str, seed: u64) -> Checked<Vec<pdstor_client::receipt::Receipt>> {
    use pdstor_client::Writer;
    let mut fillers = Vec::new();
    let mut fill = Writer::new(server, Path::new(DATA_SOCKET), HANDOFF_CHUNK, 4).map_err(|e| e.to_string())?;
    loop {
        let n = fillers.len() as u64;
        match fill.put(&format!("{tag}-{n}"), &kv_layout(), &seeded(seed + n, 4), 4, Some(42)) {
            Ok(p) => fillers.push(p.receipt),
            Err(e) if e.to_string().contains("admission") => return Ok(fillers),
            Err(e) => return Err(format!("{tag}: filling the free slots: {e}").into()),
        }
        if fillers.len() > 64 {
            return Err(format!("{tag}: the small namespace took more than 64 fillers").into());
        }
    }
}
