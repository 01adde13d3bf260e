//! What must be refused: bad DMA-BUF input on the data plane, and device
//! errors reaching a client through the daemon.

use std::os::fd::AsRawFd;
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

pub(super) fn bad_input(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let daemon = fresh_daemon(&disk.block)?;
    let client = Client::new(SERVER);
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;

    // A buffer smaller than the batch references: refused, nothing stored.
    let small = Buffer::udmabuf("vmtest-small", CHUNK as usize).map_err(e("udmabuf"))?;
    let id = data.register_for(&small, PayloadPath::HostFixed).map_err(e("register"))?;
    let p = client.prepare("bad-1", &layout(), 2, "vmtest").map_err(e("prepare"))?;
    let chunks: Vec<DataChunk> = (0..2)
        .map(|i| DataChunk { index: i, buffer: id, offset: i as u64 * CHUNK, len: CHUNK, crc32c: None })
        .collect();
    match data.store(p.publication, &p.writer_token, chunks, true, 2) {
        Err(ClientError::Api(b)) if b.status == 422 && b.message.contains("outside the") => {}
        other => return Err(format!("a chunk beyond the buffer answered {:?}", other.map(|_| ())).into()),
    }
    if !client.publications(None, false).map_err(e("publications"))?.is_empty() {
        return Err("the refused batch left a publication behind".into());
    }

    // The client closes every fd it has and unmaps the buffer after
    // registering: the daemon holds its own references, so a transfer
    // still completes, and the bytes are right. On the series kernel the
    // same holds for a DMA-BUF installed for dmabuf_fixed. Shrinking the
    // udmabuf's memfd first is refused (it is sealed): nothing moves under
    // the daemon's mapping.
    let mut paths = vec![PayloadPath::HostFixed];
    if expects_rw_dmabuf() {
        paths.push(PayloadPath::DmabufFixed);
    }
    for (n, path) in paths.into_iter().enumerate() {
        let b = Buffer::udmabuf("vmtest-closed", CHUNK as usize).map_err(e("udmabuf"))?;
        let payload = pdstor_engine::payload::chunk(0xc105 + n as u64, 0, CHUNK as usize);
        b.write_at(0, &payload).map_err(e("fill"))?;
        let id = data.register_for(&b, path).map_err(e("register"))?;
        let memfd = b.memfd_fd().ok_or("the udmabuf has no memfd")?.as_raw_fd();
        // SAFETY: ftruncate(2) on the udmabuf's own memfd, which `b` keeps open.
        if unsafe { libc::ftruncate(memfd, 4096) } == 0 {
            return Err(format!("{path}: the udmabuf's memfd could be shrunk while registered").into());
        }
        drop(b);
        let req = format!("closed-{n}");
        let p = client.prepare(&req, &layout(), 1, "vmtest").map_err(e("prepare"))?;
        let chunk = DataChunk { index: 0, buffer: id, offset: 0, len: CHUNK, crc32c: None };
        data.store(p.publication, &p.writer_token, vec![chunk], true, 1)
            .map_err(|err| format!("{path}: store after the client closed its fds: {err}"))?;
        let published = client.publish(p.publication, &p.writer_token, None).map_err(e("publish"))?;
        let c = published.manifest.chunks.first().ok_or("no chunk in the manifest")?;
        if dd_direct(&disk.block, c.offset.0, c.len)? != payload {
            return Err(
                format!("{path}: the chunk stored after the client closed its fds is not the client's bytes").into()
            );
        }
        client.release(&published.receipt).map_err(e("release"))?;
    }
    drop(daemon);
    Ok(())
}

/// The faulty namespace through `pdstor serve --provenance --require-native`
/// (reads fail from 4 MiB on, writes from 48 MiB on; `dmabuf_fixed` on the
/// series kernel, `host_fixed` of the same udmabuf on Debian's). A load over
/// failing blocks is an error, the reader's `fail` retains the publication
/// and its slots stay taken; publications are then stored until one reaches
/// the blocks that fail writes: that store is an error that says the request
/// was rolled back, and the publication is gone — it cannot be published and
/// never appears READY.
pub(super) fn device_errors(ctx: &Ctx) -> Checked {
    let path = if expects_rw_dmabuf() { PayloadPath::DmabufFixed } else { PayloadPath::HostFixed };
    let disk = ctx.disk(DiskRole::Faulty)?;
    let t = disk.block.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "1M", "--target", &t])?;
    let daemon = serve_with(&disk.block, &["--provenance", "--require-native"])?;
    let client = Client::new(SERVER);
    let mut data = DataConn::connect(Path::new(SOCKET)).map_err(e("data plane"))?;
    let room = CHUNK as usize * CHUNKS as usize;
    let wbuf = Buffer::udmabuf("vmtest-faulty-w", room).map_err(e("writer buffer"))?;
    let payload: Vec<u8> =
        (0..CHUNKS as u64).flat_map(|i| pdstor_engine::payload::chunk(0xbad, i, CHUNK as usize)).collect();
    wbuf.write_at(0, &payload).map_err(e("filling the writer buffer"))?;
    let wid = data.register_for(&wbuf, path).map_err(e("registering the writer buffer"))?;
    let chunks = |buffer| -> Vec<DataChunk> {
        (0..CHUNKS)
            .map(|i| DataChunk { index: i, buffer, offset: i as u64 * CHUNK, len: CHUNK, crc32c: None })
            .collect()
    };
    let state_of = |publication: u64| -> Checked<Option<String>> {
        Ok(client
            .publications(None, false)
            .map_err(e("listing publications"))?
            .into_iter()
            .find(|p| p.publication == publication)
            .map(|p| p.state))
    };

    // A publication stored below 48 MiB whose chunks partly lie where reads fail.
    let p = client.prepare("faulty-read", &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
    data.store(p.publication, &p.writer_token, chunks(wid), true, CHUNKS).map_err(e("store below 48 MiB"))?;
    let published = client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
    let claim = client.claim(&published.receipt, "decode-0", "faulty", 60_000).map_err(e("claim"))?;
    let manifest = client.adopt(&pdstor_client::wire::AdoptRequest::of_claim(&claim, layout())).map_err(e("adopt"))?;
    if manifest.chunks.iter().all(|c| c.offset.0 < 4 << 20) {
        return Err("every chunk landed below 4 MiB: the read fault cannot be reached".into());
    }
    let rbuf = Buffer::udmabuf("vmtest-faulty-r", room).map_err(e("reader buffer"))?;
    let rid = data.register_for(&rbuf, path).map_err(e("registering the reader buffer"))?;
    let load = manifest
        .chunks
        .iter()
        .map(|c| DataChunk { index: c.index, buffer: rid, offset: c.index as u64 * CHUNK, len: 0, crc32c: None })
        .collect();
    match data.load(&claim, load) {
        Ok(r) => return Err(format!("a load over blocks that fail reads succeeded: {r:?}").into()),
        Err(err) => eprintln!("device_errors ({path}): load over failing blocks: {err}"),
    }
    client.fail(&claim, "device error on load").map_err(e("fail"))?;
    if state_of(claim.publication)?.as_deref() != Some("RETAINED") {
        return Err(format!("after the failed load: {:?}, expected RETAINED", state_of(claim.publication)?).into());
    }

    // Store publications until one reaches the blocks that fail writes.
    let mut failed = None;
    for n in 0..20 {
        let p = client.prepare(&format!("faulty-write-{n}"), &layout(), CHUNKS, "vmtest").map_err(e("prepare"))?;
        match data.store(p.publication, &p.writer_token, chunks(wid), true, CHUNKS) {
            Ok(_) => {
                client.publish(p.publication, &p.writer_token, Some(7)).map_err(e("publish"))?;
            }
            Err(err) => {
                eprintln!("device_errors ({path}): store over failing blocks: {err}");
                failed = Some((p, err.to_string()));
                break;
            }
        }
    }
    let (p, err) = failed.ok_or("twenty publications stored without reaching the blocks that fail writes")?;
    if !err.contains("rolled back") || !err.contains(&format!("publication {}", p.publication)) {
        return Err(format!("the failed store does not say what became of publication {}: {err}", p.publication).into());
    }
    if client.publish(p.publication, &p.writer_token, Some(7)).is_ok() {
        return Err("a publication whose store failed was published".into());
    }
    if let Some(state) = state_of(p.publication)? {
        return Err(format!("a publication whose store failed and was rolled back is still listed, {state}").into());
    }
    if state_of(claim.publication)?.as_deref() != Some("RETAINED") {
        return Err("the retained publication did not stay retained".into());
    }
    drop(daemon);
    Ok(())
}
