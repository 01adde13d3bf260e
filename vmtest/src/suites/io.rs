//! `io`: the engine's contract on all three targets — ext4 and XFS files, the
//! raw NVMe block device, and NVMe passthrough on `/dev/ngXnY` — through `host`
//! and `host_fixed`. Every payload is read back through the engine and
//! independently (`dd iflag=direct`, or `nvme read` for passthrough) and
//! compared byte for byte; requests are larger than MDTS so passthrough must
//! split them. After the suite, `e2fsck -fn` and `xfs_repair -n` must find the
//! filesystems clean.

use std::path::Path;

use pdstor_engine::io::{Engine, EngineOptions, IoRequest, Op, Target, TargetKind, TargetOptions, TransferId};
use pdstor_engine::{buffer::Buffer, io::PayloadPath, payload};

use super::{Checked, Suite, Test};
use crate::machine::{Ctx, sh};
use pdstor_vmtest_spec::{DiskRole, NVME_MDTS};

/// 1 MiB + 64 KiB: three commands under a 512 KiB MDTS, the last one short.
const CHUNK: u64 = (1 << 20) + (64 << 10);
const CHUNKS: u64 = 4;
const FILE_BYTES: u64 = 64 << 20;

pub const SUITE: Suite = Suite {
    name: "io",
    tests: &[
        Test {
            name: "ext4_file_host",
            disk: Some(DiskRole::Ext4),
            run: |c| fs_file(c, DiskRole::Ext4, PayloadPath::Host),
        },
        Test {
            name: "ext4_file_host_fixed",
            disk: Some(DiskRole::Ext4),
            run: |c| fs_file(c, DiskRole::Ext4, PayloadPath::HostFixed),
        },
        Test {
            name: "xfs_file_host",
            disk: Some(DiskRole::Xfs),
            run: |c| fs_file(c, DiskRole::Xfs, PayloadPath::Host),
        },
        Test {
            name: "xfs_file_host_fixed",
            disk: Some(DiskRole::Xfs),
            run: |c| fs_file(c, DiskRole::Xfs, PayloadPath::HostFixed),
        },
        Test { name: "raw_block_host", disk: Some(DiskRole::Raw), run: |c| raw_block(c, PayloadPath::Host, 0) },
        Test {
            name: "raw_block_host_fixed",
            disk: Some(DiskRole::Raw),
            run: |c| raw_block(c, PayloadPath::HostFixed, 16 << 20),
        },
        Test { name: "passthrough_geometry", disk: Some(DiskRole::Raw), run: passthrough_geometry },
        Test {
            name: "passthrough_host",
            disk: Some(DiskRole::Raw),
            run: |c| passthrough(c, PayloadPath::Host, 32 << 20),
        },
        Test {
            name: "passthrough_host_fixed",
            disk: Some(DiskRole::Raw),
            run: |c| passthrough(c, PayloadPath::HostFixed, 48 << 20),
        },
        Test { name: "ext4_fsck_clean", disk: Some(DiskRole::Ext4), run: |c| fsck(c, DiskRole::Ext4) },
        Test { name: "xfs_repair_clean", disk: Some(DiskRole::Xfs), run: |c| fsck(c, DiskRole::Xfs) },
    ],
};

/// How a test reads the target back without pdstor.
#[derive(Clone, Copy)]
enum Independent {
    Dd,
    NvmeRead { lba: u64, max_bytes: u64 },
}

fn fs_file(ctx: &Ctx, role: DiskRole, path: PayloadPath) -> Checked {
    let mount = ctx.disk(role)?.mount.clone().ok_or("filesystem not mounted")?;
    let file = mount.join(format!("kv-{path}.img"));
    round_trip(&file, Some(FILE_BYTES), path, 0, Independent::Dd, TargetKind::File)
}

fn raw_block(ctx: &Ctx, path: PayloadPath, base: u64) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    round_trip(&disk.block, None, path, base, Independent::Dd, TargetKind::BlockDevice)
}

fn passthrough(ctx: &Ctx, path: PayloadPath, base: u64) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let g = open(&disk.generic, None)?.geometry().to_owned();
    let reader = Independent::NvmeRead { lba: g.logical_block as u64, max_bytes: g.max_transfer as u64 };
    round_trip(&disk.generic, None, path, base, reader, TargetKind::NvmeGeneric)
}

/// The passthrough target reports what QEMU was told: 4 KiB LBAs, nsid 1, and
/// MDTS 7 (512 KiB) as the per-command limit — so CHUNK needs splitting.
fn passthrough_geometry(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let engine = open(&disk.generic, None)?;
    let g = engine.geometry();
    let mdts = 4096u32 << NVME_MDTS;
    if engine.target().kind() != TargetKind::NvmeGeneric {
        return Err(format!("{} opened as {:?}", disk.generic.display(), engine.target().kind()).into());
    }
    if g.logical_block != 4096 || g.nsid != Some(1) || g.max_transfer != mdts {
        return Err(format!("geometry {g:?}: want 4096-byte LBAs, nsid 1, max_transfer {mdts}").into());
    }
    if CHUNK <= g.max_transfer as u64 {
        return Err(
            format!("CHUNK {CHUNK} does not exceed MDTS {}: the split path is not exercised", g.max_transfer).into()
        );
    }
    // The write cache, from Identify Controller's VWC, agrees with what the
    // kernel made of it for the namespace's block device.
    let by_vwc = engine.target().write_cache();
    let by_kernel = open(&disk.block, None)?.target().write_cache();
    if !by_vwc.to_string().contains("VWC") || by_vwc.needs_flush() != by_kernel.needs_flush() {
        return Err(format!("write cache: {by_vwc} by Identify, {by_kernel} by the kernel").into());
    }
    Ok(())
}

fn open(path: &Path, create: Option<u64>) -> Checked<Engine> {
    let t =
        Target::open(path, &TargetOptions { create_len: create, ..Default::default() }).map_err(|e| e.to_string())?;
    Ok(Engine::new(t, EngineOptions { queue_depth: 8, buffer_slots: 4, ..Default::default() })
        .map_err(|e| e.to_string())?)
}

fn round_trip(
    target: &Path,
    create: Option<u64>,
    path: PayloadPath,
    base: u64,
    independent: Independent,
    kind: TargetKind,
) -> Checked {
    let seed = base ^ path as u64 ^ 0x5eed;
    let mut engine = open(target, create)?;
    if engine.target().kind() != kind {
        return Err(format!("{} opened as {:?}, expected {kind:?}", target.display(), engine.target().kind()).into());
    }
    let buffer = Buffer::memfd("vmtest", (CHUNK * CHUNKS) as usize).map_err(|e| e.to_string())?;
    let id = match path {
        PayloadPath::HostFixed => engine.register(buffer),
        _ => engine.add(buffer),
    }
    .map_err(|e| e.to_string())?;
    for i in 0..CHUNKS {
        let bytes = payload::chunk(seed, i, CHUNK as usize);
        engine.buffer(id).map_err(|e| e.to_string())?.write_at(i * CHUNK, &bytes).map_err(|e| e.to_string())?;
    }
    let batch = |op| -> Vec<IoRequest> {
        (0..CHUNKS)
            .map(|i| IoRequest {
                transfer: TransferId(i + 1),
                op,
                path,
                buffer: id,
                buffer_offset: pdstor_engine::io::BufferOffset(i * CHUNK),
                target_offset: pdstor_engine::io::TargetOffset(base + i * CHUNK),
                len: CHUNK,
            })
            .collect()
    };
    engine.execute_all(&batch(Op::Write)).map_err(|e| format!("write: {e}"))?;
    engine.flush().map_err(|e| format!("flush: {e}"))?;
    // Issued where the target keeps a volatile write cache, elided where not.
    let wc = engine.target().write_cache();
    let flushed = (engine.stats().flushes, engine.stats().flushes_elided);
    if flushed != if wc.needs_flush() { (1, 0) } else { (0, 1) } {
        return Err(format!("one flush on a target whose write cache is {wc}: (issued, elided) = {flushed:?}").into());
    }
    let zeros = vec![0u8; (CHUNK * CHUNKS) as usize];
    engine.buffer(id).map_err(|e| e.to_string())?.write_at(0, &zeros).map_err(|e| e.to_string())?;
    engine.execute_all(&batch(Op::Read)).map_err(|e| format!("read: {e}"))?;
    let mut got = vec![0u8; CHUNK as usize];
    for i in 0..CHUNKS {
        engine.buffer(id).map_err(|e| e.to_string())?.read_at(i * CHUNK, &mut got).map_err(|e| e.to_string())?;
        if let Some(at) = payload::first_difference(&payload::chunk(seed, i, CHUNK as usize), &got) {
            return Err(format!("chunk {i} read through the engine differs at byte {at}").into());
        }
    }
    drop(engine);
    for i in 0..CHUNKS {
        let offset = base + i * CHUNK;
        let bytes = match independent {
            Independent::Dd => dd_direct(target, offset, CHUNK)?,
            Independent::NvmeRead { lba, max_bytes } => nvme_read(target, offset, CHUNK, lba, max_bytes)?,
        };
        if let Some(at) = payload::first_difference(&payload::chunk(seed, i, CHUNK as usize), &bytes) {
            return Err(format!("chunk {i} read independently differs at byte {at} (of {})", bytes.len()).into());
        }
    }
    Ok(())
}

/// `dd iflag=direct` (busybox), a reader that shares no code with pdstor.
pub(crate) fn dd_direct(path: &Path, offset: u64, len: u64) -> Checked<Vec<u8>> {
    let out = "/tmp/vmtest/dd.out";
    sh(
        "dd",
        &[
            &format!("if={}", path.display()),
            &format!("of={out}"),
            "bs=64k",
            "iflag=direct,skip_bytes,count_bytes",
            &format!("skip={offset}"),
            &format!("count={len}"),
        ],
    )?;
    Ok(std::fs::read(out).map_err(|e| format!("reading {out}: {e}"))?)
}

/// `nvme read` on the generic device, in pieces no larger than MDTS.
pub(crate) fn nvme_read(dev: &Path, offset: u64, len: u64, lba: u64, max_bytes: u64) -> Checked<Vec<u8>> {
    let mut all = Vec::with_capacity(len as usize);
    let piece_file = "/tmp/vmtest/nvme.out";
    let mut done = 0;
    while done < len {
        let n = (len - done).min(max_bytes);
        sh(
            "nvme",
            &[
                "read",
                &dev.to_string_lossy(),
                &format!("--start-block={}", (offset + done) / lba),
                &format!("--block-count={}", n / lba - 1),
                &format!("--data-size={n}"),
                &format!("--data={piece_file}"),
            ],
        )?;
        let piece = std::fs::read(piece_file).map_err(|e| format!("reading {piece_file}: {e}"))?;
        all.extend_from_slice(&piece[..(n as usize).min(piece.len())]);
        done += n;
    }
    Ok(all)
}

fn fsck(ctx: &Ctx, role: DiskRole) -> Checked {
    let disk = ctx.disk(role)?;
    let mount = disk.mount.clone().ok_or("filesystem not mounted")?;
    nix::mount::umount(mount.as_path()).map_err(|e| format!("unmounting {}: {e}", mount.display()))?;
    let dev = disk.block.to_string_lossy().into_owned();
    let checked = match role {
        DiskRole::Xfs => sh("xfs_repair", &["-n", &dev]),
        _ => sh("e2fsck", &["-fn", &dev]),
    };
    let fstype = if role == DiskRole::Xfs { "xfs" } else { "ext4" };
    nix::mount::mount(
        Some(disk.block.as_path()),
        mount.as_path(),
        Some(fstype),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| format!("remounting {dev}: {e}"))?;
    Ok(checked.map(|_| ())?)
}
