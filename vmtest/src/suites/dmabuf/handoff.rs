//! Handoffs through `pdstor serve` with DMA-BUF buffers: every writer and
//! reader path combination on the raw NVMe device and on a file on XFS,
//! read back outside pdstor, and the path ladder on raw block.

use std::path::Path;

use pdstor_client::wire::DataChunk;
use pdstor_client::{Client, ClientError, DataConn};
use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use crate::machine::{Ctx, expects_rw_dmabuf, sh};
use crate::suites::Checked;
use crate::suites::io::dd_direct;
use crate::suites::protocol::{SERVER, SOCKET, serve_with};
use pdstor_vmtest_spec::DiskRole;

use super::*;

/// One writer buffer (exporter, path) and one reader buffer (exporter, path):
/// prepare, store, publish, claim, adopt, load, then check the daemon's
/// verdicts, the reader's bytes, and every chunk on the target with `dd`.
pub(super) fn handoff(target: &Path, writer: (&str, PayloadPath), reader: (&str, PayloadPath), req: &str) -> Checked {
    handoff_at(target, writer, reader, req, 0)
}

/// [`handoff`] with every chunk `base` bytes into both buffers (the reader's
/// cleared first), so transfers start inside the DMA-BUF, not at its start.
pub(super) fn handoff_at(
    target: &Path,
    writer: (&str, PayloadPath),
    reader: (&str, PayloadPath),
    req: &str,
    base: u64,
) -> Checked {
    let client = Client::new(SERVER);
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
    let alloc = |exporter: &str, len: usize| match exporter {
        "udmabuf" => Buffer::udmabuf(req, len),
        _ => Buffer::dma_heap("system", len),
    };
    let total = CHUNK * CHUNKS as u64;
    let room = (total + base).next_multiple_of(CHUNK) as usize;
    let wbuf = alloc(writer.0, room).map_err(e("writer buffer"))?;
    let payload: Vec<u8> =
        (0..CHUNKS as u64).flat_map(|i| pdstor_engine::payload::chunk(0xd3a, i, CHUNK as usize)).collect();
    wbuf.write_at(base, &payload).map_err(e("filling the writer buffer"))?;
    let wid = data.register_for(&wbuf, writer.1).map_err(e("registering the writer buffer"))?;
    let p = client.prepare(req, &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
    let chunks: Vec<DataChunk> = (0..CHUNKS)
        .map(|i| DataChunk { index: i, buffer: wid, offset: base + i as u64 * CHUNK, len: CHUNK, crc32c: None })
        .collect();
    let stored = data.store(p.publication, &p.writer_token, chunks, true, CHUNKS).map_err(e("store"))?;
    check_chunks("store", &stored.paths, &stored.verdicts, writer.1)?;
    let published = client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
    let claim = client.claim(&published.receipt, "decode-0", req, 60_000).map_err(e("claim"))?;
    let manifest = client.adopt(&pdstor_client::wire::AdoptRequest::of_claim(&claim, layout())).map_err(e("adopt"))?;
    // Independent: every chunk as it lies on the target, read by busybox dd.
    for c in &manifest.chunks {
        let on_disk = dd_direct(target, c.offset.0, c.len)?;
        let want = &payload[(c.index as u64 * CHUNK) as usize..][..c.len as usize];
        if let Some(at) = pdstor_engine::payload::first_difference(want, &on_disk) {
            return Err(format!("chunk {} on the target differs from the writer's bytes at byte {at}", c.index).into());
        }
    }
    let rbuf = alloc(reader.0, room).map_err(e("reader buffer"))?;
    rbuf.write_at(0, &vec![0u8; room]).map_err(e("clearing the reader buffer"))?;
    let rid = data.register_for(&rbuf, reader.1).map_err(e("registering the reader buffer"))?;
    let chunks: Vec<DataChunk> = manifest
        .chunks
        .iter()
        .map(|c| DataChunk { index: c.index, buffer: rid, offset: base + c.index as u64 * CHUNK, len: 0, crc32c: None })
        .collect();
    let loaded = data.load(&claim, chunks).map_err(e("load"))?;
    check_chunks("load", &loaded.paths, &loaded.verdicts, reader.1)?;
    let mut back = vec![0u8; total as usize];
    rbuf.read_at(base, &mut back).map_err(e("reading the reader buffer"))?;
    if let Some(at) = pdstor_engine::payload::first_difference(&payload, &back) {
        return Err(format!("the reader's {} buffer differs from the writer's at byte {at}", reader.0).into());
    }
    // The bytes were just compared with the writer's: their crcs are the manifest's.
    let crcs: Vec<u32> = manifest.chunks.iter().map(|c| c.crc32c).collect();
    let digest = pdstor_client::receipt::restore_digest(manifest.restore_nonce.as_deref().unwrap_or(""), &crcs);
    client.ack(&claim, &digest).map_err(e("ack"))?;
    Ok(())
}

pub(super) fn check_chunks(step: &str, paths: &[String], verdicts: &[String], path: PayloadPath) -> Checked {
    if paths.len() != CHUNKS as usize || paths.iter().any(|p| p != path.as_str()) {
        return Err(format!("{step}: the daemon reports paths {paths:?}, expected {path} for every chunk").into());
    }
    if verdicts.len() != CHUNKS as usize || verdicts.iter().any(|v| v != "native") {
        return Err(format!("{step} on {path}: verdicts {verdicts:?}, expected native for every chunk").into());
    }
    Ok(())
}

/// A client buffer: its exporter and the path it is registered for.
pub(super) type Side = (&'static str, PayloadPath);

/// The udmabuf paths a stock kernel supports, writer → reader.
pub(super) const COMBOS: &[(Side, Side)] = &[
    (("udmabuf", PayloadPath::HostFixed), ("udmabuf", PayloadPath::HostFixed)),
    (("udmabuf", PayloadPath::Host), ("udmabuf", PayloadPath::HostFixed)),
    (("udmabuf", PayloadPath::HostFixed), ("udmabuf", PayloadPath::Host)),
];

pub(super) fn run_combos(target: &Path, format_args: &[&str]) -> Checked {
    let t = target.to_string_lossy().into_owned();
    let mut args = vec!["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t];
    args.extend_from_slice(format_args);
    sh("/bin/pdstor", &args)?;
    let daemon = serve_with(target, &["--provenance", "--require-native"])?;
    for (n, (w, r)) in COMBOS.iter().enumerate() {
        handoff(target, *w, *r, &format!("dmabuf-{n}")).map_err(|err| format!("writer {w:?} → reader {r:?}: {err}"))?;
    }
    // The system heap maps its pages as raw page frames: no host path can pin
    // them. Without the rw-dmabuf series dmabuf_fixed is missing too: every
    // path refuses, up front, with its reason; none copies. With the series,
    // dmabuf_fixed takes it (the dmabuf_fixed tests move bytes through it).
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
    let heap = Buffer::dma_heap("system", CHUNK as usize).map_err(e("dma-heap buffer"))?;
    for (path, says) in [
        (PayloadPath::Host, "cannot be pinned for direct I/O"),
        (PayloadPath::HostFixed, "cannot be pinned for direct I/O"),
        (PayloadPath::DmabufFixed, "rw-dmabuf"),
    ] {
        match data.register_for(&heap, path) {
            Ok(_) if path == PayloadPath::DmabufFixed && expects_rw_dmabuf() => {}
            Err(ClientError::Api(b)) if b.status == 422 && b.message.contains(says) => {}
            other => return Err(format!("a system-heap DMA-BUF on {path} answered {:?}", other.map(|_| ())).into()),
        }
    }
    let metrics = Client::new(SERVER).metrics().map_err(e("metrics"))?;
    let touched = metrics
        .lines()
        .find_map(|l| l.strip_prefix("pdstor_dmabuf_cpu_accesses_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or("no pdstor_dmabuf_cpu_accesses_total in /metrics")?;
    if touched == 0 {
        return Err("the daemon checksummed DMA-BUF chunks without counting the CPU accesses".into());
    }
    drop(daemon);
    Ok(())
}

pub(super) fn raw_block(ctx: &Ctx) -> Checked {
    run_combos(&ctx.disk(DiskRole::Raw)?.block, &[])
}

pub(super) fn xfs(ctx: &Ctx) -> Checked {
    let mount = ctx.disk(DiskRole::Xfs)?.mount.clone().ok_or("XFS not mounted")?;
    let img = mount.join("pdstor-dmabuf.img");
    let r = run_combos(&img, &["--size", "64M"]);
    let _ = std::fs::remove_file(&img);
    r
}

/// `pdstor ladder` with the udmabuf exporter: `host` and `host_fixed` are
/// qualified (every byte read back independently, every verdict native);
/// `dmabuf_fixed` is not, with the kernel's reason, and the command says so
/// with a non-zero exit. Each qualified rung's restore is checked where it
/// landed (each chunk's crc32c in the udmabuf, a flipped byte caught).
pub(super) fn ladder(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let out = Path::new("/tmp/vmtest/ladder");
    // On the series kernel the ladder also measures the rungs against
    // each other (throughput ratio, CPU per GiB): more bytes.
    let (bytes, len) = if expects_rw_dmabuf() { ("32M", 32u64 << 20) } else { ("8M", 8 << 20) };
    let run = std::process::Command::new("/bin/pdstor")
        .args(["ladder", "--force", "--bytes", bytes, "--chunk", "1M", "--exporter", "udmabuf", "--target"])
        .arg(&disk.block)
        .arg("--out")
        .arg(out)
        .output()
        .map_err(e("running pdstor ladder"))?;
    let stderr = String::from_utf8_lossy(&run.stderr);
    let series = expects_rw_dmabuf();
    let expected = if series { Some(0) } else { Some(1) };
    if run.status.code() != expected || (!series && !stderr.contains("not qualified: dmabuf_fixed")) {
        return Err(format!("pdstor ladder exited {:?}: {stderr}", run.status.code()).into());
    }
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("ladder.json")).map_err(e("ladder.json"))?)
            .map_err(e("parsing ladder.json"))?;
    let rungs = report["rungs"].as_array().ok_or("no rungs in ladder.json")?;
    for (rung, path) in rungs.iter().zip(["host", "host_fixed", "dmabuf_fixed"]) {
        if rung["path"] != path {
            return Err(format!("rungs out of ladder order: {rungs:?}").into());
        }
        let verdicts = rung["verdicts"].as_object().map(|v| v.keys().cloned().collect::<Vec<_>>());
        // A qualified rung's restore is checked where it landed, and a flipped byte is seen.
        let verified = rung["verified"].as_str().unwrap_or_default();
        if rung["qualified"] == true
            && !(verified.contains("taken on the CPU match") && verified.contains("was caught"))
        {
            return Err(format!("{path}: the restore was not verified where it landed: {rung}").into());
        }
        match path {
            "dmabuf_fixed" if series => {
                if rung["qualified"] != true || verdicts != Some(vec!["native".to_string()]) {
                    return Err(format!("dmabuf_fixed on the series kernel was not qualified native: {rung}").into());
                }
            }
            "dmabuf_fixed" => {
                if rung["qualified"] != false || !rung["reason"].as_str().is_some_and(|r| r.contains("rw-dmabuf")) {
                    return Err(format!("dmabuf_fixed on a stock kernel: {rung}").into());
                }
            }
            _ => {
                if rung["qualified"] != true || verdicts != Some(vec!["native".to_string()]) {
                    return Err(format!("{path} was not qualified with native verdicts: {rung}").into());
                }
                if !rung["independent_readback"].as_str().is_some_and(|r| r.contains(&format!("{len} bytes match"))) {
                    return Err(format!("{path}: no independent readback: {rung}").into());
                }
            }
        }
    }
    let md = std::fs::read_to_string(out.join("ladder.md")).map_err(e("ladder.md"))?;
    // The figures, for the host's console.log.
    for line in md.lines().filter(|l| l.starts_with('|') || l.starts_with("- kernel")) {
        crate::machine::console(&format!("ladder: {line}"));
    }
    let dmabuf_row = if series { "| dmabuf_fixed | yes |" } else { "| dmabuf_fixed | **no** |" };
    if !md.contains("| host_fixed | yes |") || !md.contains(dmabuf_row) {
        return Err(format!("ladder.md does not match ladder.json:\n{md}").into());
    }
    Ok(())
}
