//! The shared namespace itself: the storage guest writes a seeded pattern
//! with pdstor's engine and exports the namespace over NVMe/TCP; the reader
//! host reads it back with `dd iflag=direct` and reports its crc32c.

use pdstor_engine::io::{
    BufferOffset, Engine, EngineOptions, IoRequest, Op, Target, TargetOffset, TargetOptions, TransferId,
};
use pdstor_engine::{buffer::Buffer, io::PayloadPath, payload};

use crate::machine::{Ctx, console, sh};
use crate::suites::Checked;
use crate::suites::io::dd_direct;
use pdstor_vmtest_spec::{DiskRole, NVME_TCP_PORT, READER_ADDR, REPORT_PORT, SHARED_NQN, STORAGE_ADDR};

use super::*;

/// Where on the namespace the storage guest writes what the reader reads.
pub(super) const AT: u64 = 64 << 20;

pub(super) const CHUNK: u64 = 1 << 20;

pub(super) const CHUNKS: u64 = 4;

pub(super) const SEED: u64 = 0x70b0;

pub(super) fn pattern() -> Vec<u8> {
    (0..CHUNKS).flat_map(|i| payload::chunk(SEED, i, CHUNK as usize)).collect()
}

/// The storage guest writes a seeded pattern with pdstor's engine
/// (`host_fixed`, flushed), exports the namespace over NVMe/TCP, and waits
/// for the reader's report; the reader connects, reads the pattern back with
/// `dd iflag=direct` through the fabric and reports its crc32c. Byte-exact
/// across two kernels, or it fails on both sides.
pub(super) fn shared_namespace(ctx: &Ctx) -> Checked {
    by_role(|| storage(ctx), reader)
}

pub(super) fn storage(ctx: &Ctx) -> Checked {
    let device = ctx.disk(DiskRole::Raw)?.block.clone();
    let want = pattern();
    {
        let t = Target::open(&device, &TargetOptions::default()).map_err(|e| e.to_string())?;
        let mut engine = Engine::new(t, EngineOptions::default()).map_err(|e| e.to_string())?;
        let id = engine
            .register(Buffer::memfd("topology", want.len()).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        engine.buffer(id).map_err(|e| e.to_string())?.write_at(0, &want).map_err(|e| e.to_string())?;
        let req = IoRequest {
            transfer: TransferId(0x70b0),
            op: Op::Write,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: BufferOffset(0),
            target_offset: TargetOffset(AT),
            len: want.len() as u64,
        };
        engine.execute_all(&[req]).map_err(|e| format!("writing the pattern: {e}"))?;
        engine.flush().map_err(|e| format!("flushing the pattern: {e}"))?;
    }
    let small = small_namespace(ctx)?;
    std::fs::File::create(&small)
        .and_then(|f| f.set_len(SMALL_NAMESPACE))
        .map_err(|e| format!("creating {}: {e}", small.display()))?;
    export_all(ctx, None)?;
    // The writer host reaches the namespace over the fabric as the reader
    // does: its publishes flush through NVMe/TCP to the target.
    connect_as(WRITER_HOSTNQN, WRITER_HOSTID)?;
    console(&format!("pdstor-vminit: topology storage ready: {SHARED_NQN} on {STORAGE_ADDR}:{NVME_TCP_PORT}"));
    // The reader's report: `ok <crc32c>` or `fail <why>`.
    let line = serve_once(REPORT_PORT, None)?;
    let expected = format!("ok {:08x}", crc32c::crc32c(&want));
    if line.trim() != expected {
        return Err(format!("the reader guest reported {:?}, expected {expected:?}", line.trim()).into());
    }
    Ok(())
}

pub(super) fn reader() -> Checked {
    connect()?;
    let dev = fabric_namespace()?;
    console(&format!("pdstor-vminit: topology reader connected: {}", dev.display()));
    let got = dd_direct(&dev, AT, CHUNK * CHUNKS);
    let report = match &got {
        Ok(bytes) if *bytes == pattern() => format!("ok {:08x}", crc32c::crc32c(bytes)),
        Ok(bytes) => format!(
            "fail the bytes read over nvme-tcp differ from the storage guest's at byte {:?}",
            payload::first_difference(&pattern(), bytes)
        ),
        Err(e) => format!("fail reading {}: {e}", dev.display()),
    };
    let mut peer = Peer::dial(REPORT_PORT)?;
    peer.send(&report)?;
    let _ = peer.recv();
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    console(&format!("pdstor-vminit: topology reader at {READER_ADDR} reported {report:?}"));
    if report.starts_with("ok ") { Ok(()) } else { Err(report.into()) }
}
