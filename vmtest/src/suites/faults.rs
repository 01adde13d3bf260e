//! `faults`: a device-mapper table over the raw disk whose second half fails
//! every I/O (`error` target; `flakey` with no up interval for a whole-device
//! failure). Reads that fail must come back as errors that name their
//! transfer — never as zeros, never as success — while the healthy transfers of
//! the same batch complete with the right bytes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath, payload};

use super::{Checked, Suite, Test};
use crate::machine::{Ctx, sh};
use pdstor_vmtest_spec::DiskRole;

const CHUNK: u64 = 1 << 20;
/// Sentinel the read buffer holds before a read; a failed read must leave it.
const SENTINEL: u8 = 0xa5;
const DM_NAME: &str = "pdfault";

pub const SUITE: Suite = Suite {
    name: "faults",
    tests: &[
        Test { name: "half_failing_batch", disk: Some(DiskRole::Raw), run: half_failing_batch },
        Test { name: "flakey_device_fails_reads_and_writes", disk: Some(DiskRole::Raw), run: flakey_everything },
        Test { name: "nvme_device_errors_on_every_fixed_path", disk: Some(DiskRole::Faulty), run: nvme_errors },
    ],
};

/// A dm device that removes itself.
struct DmDevice(PathBuf);

impl DmDevice {
    fn create(table: &str) -> Checked<DmDevice> {
        let mut child = Command::new("dmsetup")
            .args(["create", DM_NAME, "--noudevsync"])
            .env("PATH", "/sbin:/bin")
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("running dmsetup: {e}"))?;
        child
            .stdin
            .take()
            .ok_or("dmsetup stdin")?
            .write_all(table.as_bytes())
            .map_err(|e| format!("writing the dm table: {e}"))?;
        let out = child.wait_with_output().map_err(|e| format!("dmsetup: {e}"))?;
        if !out.status.success() {
            return Err(format!("dmsetup create {DM_NAME} failed: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
        sh("dmsetup", &["mknodes", DM_NAME])?;
        Ok(DmDevice(PathBuf::from(format!("/dev/mapper/{DM_NAME}"))))
    }
}

impl Drop for DmDevice {
    fn drop(&mut self) {
        let _ = sh("dmsetup", &["remove", "--noudevsync", DM_NAME]);
    }
}

fn sectors(dev: &Path) -> Checked<u64> {
    let out = sh("blockdev", &["--getsz", &dev.to_string_lossy()])?;
    Ok(out.trim().parse::<u64>().map_err(|e| format!("blockdev --getsz {}: {e}", dev.display()))?)
}

fn engine_on(dev: &Path) -> Checked<Engine> {
    let t = Target::open(dev, &TargetOptions::default()).map_err(|e| e.to_string())?;
    Ok(Engine::new(t, EngineOptions { queue_depth: 8, buffer_slots: 2, ..Default::default() })
        .map_err(|e| e.to_string())?)
}

fn requests(op: Op, id: pdstor_engine::io::BufferId, n: u64) -> Vec<IoRequest> {
    (0..n)
        .map(|i| IoRequest {
            transfer: TransferId(100 + i),
            op,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: pdstor_engine::io::BufferOffset(i * CHUNK),
            target_offset: pdstor_engine::io::TargetOffset(i * CHUNK),
            len: CHUNK,
        })
        .collect()
}

/// Writes 8 seeded chunks straight to the raw disk, then reads them through a
/// table that maps the first 4 MiB linearly and fails the rest.
fn half_failing_batch(ctx: &Ctx) -> Checked {
    let raw = ctx.disk(DiskRole::Raw)?.block.clone();
    let seed = 0xfa17;
    {
        let mut e = engine_on(&raw)?;
        let id = e
            .register(Buffer::memfd("faults", (8 * CHUNK) as usize).map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
        for i in 0..8 {
            e.buffer(id)
                .map_err(|e| e.to_string())?
                .write_at(i * CHUNK, &payload::chunk(seed, i, CHUNK as usize))
                .map_err(|e| e.to_string())?;
        }
        e.execute_all(&requests(Op::Write, id, 8)).map_err(|e| format!("seeding the disk: {e}"))?;
        e.flush().map_err(|e| e.to_string())?;
    }
    let total = sectors(&raw)?;
    let good = 4 * CHUNK / 512;
    let table = format!("0 {good} linear {} 0\n{good} {} error\n", raw.display(), total - good);
    let dm = DmDevice::create(&table)?;
    let mut e = engine_on(&dm.0)?;
    let id = e
        .register(Buffer::memfd("faults-read", (8 * CHUNK) as usize).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    e.buffer(id)
        .map_err(|e| e.to_string())?
        .write_at(0, &vec![SENTINEL; (8 * CHUNK) as usize])
        .map_err(|e| e.to_string())?;
    let done = e.execute(&requests(Op::Read, id, 8)).map_err(|e| e.to_string())?;
    let mut got = vec![0u8; CHUNK as usize];
    for (i, c) in done.iter().enumerate() {
        let i = i as u64;
        e.buffer(id).map_err(|e| e.to_string())?.read_at(i * CHUNK, &mut got).map_err(|e| e.to_string())?;
        match (&c.result, i < 4) {
            (Ok(()), true) => {
                if got != payload::chunk(seed, i, CHUNK as usize) {
                    return Err(format!("healthy transfer {} returned wrong bytes", 100 + i).into());
                }
            }
            (Ok(()), false) => {
                return Err(format!("transfer {} over the error target reported success", 100 + i).into());
            }
            (Err(err), false) => {
                let msg = err.to_string();
                if !msg.contains(&format!("transfer {}", 100 + i)) {
                    return Err(format!("error does not name its transfer: {msg}").into());
                }
                if got.iter().all(|b| *b == 0) {
                    return Err(format!("failed transfer {} left zeros in the buffer", 100 + i).into());
                }
            }
            (Err(err), true) => {
                return Err(format!("healthy transfer {} failed: {err}", 100 + i).into());
            }
        }
    }
    Ok(())
}

/// `flakey` with a zero up interval: every read and write fails.
fn flakey_everything(ctx: &Ctx) -> Checked {
    let raw = ctx.disk(DiskRole::Raw)?.block.clone();
    let table = format!("0 {} flakey {} 0 0 3600\n", sectors(&raw)?, raw.display());
    let dm = DmDevice::create(&table)?;
    let mut e = engine_on(&dm.0)?;
    let id = e
        .register(Buffer::memfd("flakey", (2 * CHUNK) as usize).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    e.buffer(id)
        .map_err(|e| e.to_string())?
        .write_at(0, &vec![SENTINEL; (2 * CHUNK) as usize])
        .map_err(|e| e.to_string())?;
    for op in [Op::Read, Op::Write] {
        for c in e.execute(&requests(op, id, 2)).map_err(|e| e.to_string())? {
            match c.result {
                Ok(()) => {
                    return Err(format!("{op} {} on a failing device reported success", c.transfer).into());
                }
                Err(err) if !err.to_string().contains(&c.transfer.to_string()) => {
                    return Err(format!("error does not name {}: {err}", c.transfer).into());
                }
                Err(_) => {}
            }
        }
    }
    let mut got = vec![0u8; (2 * CHUNK) as usize];
    e.buffer(id).map_err(|e| e.to_string())?.read_at(0, &mut got).map_err(|e| e.to_string())?;
    if got.iter().any(|b| *b != SENTINEL) {
        return Err("a failed read changed the buffer".into());
    }
    Ok(())
}

/// The faulty namespace (QEMU blkdebug under the emulated NVMe: reads fail
/// from 4 MiB on, writes from 48 MiB on, one 4 KiB block per MiB). One batch
/// per path — `host_fixed` from a memfd, and on the series kernel
/// `dmabuf_fixed` from a udmabuf — with healthy and failing transfers side by
/// side: each failure is an error naming its transfer, the healthy ones move
/// the right bytes. (A failed read may still have filled part of its buffer:
/// MDTS splits 1 MiB into two commands, and only the one over the bad block
/// fails; the request as a whole is reported failed.)
fn nvme_errors(ctx: &Ctx) -> Checked {
    let dev = ctx.disk(DiskRole::Faulty)?.block.clone();
    let mut paths = vec![PayloadPath::HostFixed];
    if crate::machine::expects_rw_dmabuf() {
        paths.push(PayloadPath::DmabufFixed);
    }
    for path in paths {
        let mut e = engine_on(&dev)?;
        let len = (4 * CHUNK) as usize;
        let id = match path {
            PayloadPath::DmabufFixed => {
                e.register_dmabuf(Buffer::udmabuf("nvme-errors", len).map_err(|e| e.to_string())?)
            }
            _ => e.register(Buffer::memfd("nvme-errors", len).map_err(|e| e.to_string())?),
        }
        .map_err(|e| format!("{path}: registering: {e}"))?;
        let seed = 0xe10;
        let pattern: Vec<u8> = (0..4).flat_map(|i| payload::chunk(seed, i, CHUNK as usize)).collect();
        e.buffer(id).map_err(|e| e.to_string())?.write_at(0, &pattern).map_err(|e| e.to_string())?;
        // (buffer chunk, target MiB, whether the device fails it)
        let writes = [(0u64, 1u64, false), (1, 50, true), (2, 2, false), (3, 60, true)];
        let reads = [(0u64, 1u64, false), (1, 5, true), (2, 2, false), (3, 40, true)];
        let batch = |op, plan: &[(u64, u64, bool)]| -> Vec<IoRequest> {
            plan.iter()
                .enumerate()
                .map(|(n, &(chunk, mib, _))| IoRequest {
                    transfer: TransferId(0x900 + n as u64),
                    op,
                    path,
                    buffer: id,
                    buffer_offset: pdstor_engine::io::BufferOffset(chunk * CHUNK),
                    target_offset: pdstor_engine::io::TargetOffset(mib << 20),
                    len: CHUNK,
                })
                .collect()
        };
        let check = |what: &str, done: &[pdstor_engine::io::Completion], plan: &[(u64, u64, bool)]| {
            for (c, &(_, mib, fails)) in done.iter().zip(plan) {
                match (&c.result, fails) {
                    (Ok(()), false) => {}
                    (Ok(()), true) => {
                        return Err(format!("{path} {what} {} at {mib} MiB over failing blocks succeeded", c.transfer));
                    }
                    (Err(err), true) if err.to_string().contains(&c.transfer.to_string()) => {}
                    (Err(err), _) => return Err(format!("{path} {what} {} at {mib} MiB: {err}", c.transfer)),
                }
            }
            Ok(())
        };
        let done = e.execute(&batch(Op::Write, &writes)).map_err(|e| e.to_string())?;
        check("write", &done, &writes)?;
        for &(chunk, mib, fails) in &writes {
            let want = &pattern[(chunk * CHUNK) as usize..][..CHUNK as usize];
            if !fails && super::io::dd_direct(&dev, mib << 20, CHUNK)? != want {
                return Err(format!("{path}: the healthy write at {mib} MiB did not land (dd)").into());
            }
        }
        e.buffer(id).map_err(|e| e.to_string())?.write_at(0, &vec![SENTINEL; len]).map_err(|e| e.to_string())?;
        let done = e.execute(&batch(Op::Read, &reads)).map_err(|e| e.to_string())?;
        check("read", &done, &reads)?;
        let mut got = vec![0u8; len];
        e.buffer(id).map_err(|e| e.to_string())?.read_at(0, &mut got).map_err(|e| e.to_string())?;
        for &(chunk, mib, fails) in &reads {
            let got = &got[(chunk * CHUNK) as usize..][..CHUNK as usize];
            if fails {
                continue;
            }
            // What the write batch put at this MiB.
            let written = writes.iter().find(|w| w.1 == mib).map(|w| w.0);
            let want = written.map(|c| &pattern[(c * CHUNK) as usize..][..CHUNK as usize]);
            if want != Some(got) {
                return Err(format!("{path}: the healthy read at {mib} MiB returned other bytes").into());
            }
        }
    }
    Ok(())
}
