//! Storage targets: a preallocated file on a filesystem with direct I/O, a block
//! device, or an NVMe generic character device. Opening one probes its geometry
//! (capacity and the alignment direct I/O needs) and takes it exclusively.
//!
//! This module refuses rather than degrades: a file whose filesystem cannot do
//! direct I/O is an error, never a silent page-cache fallback.

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::IoError;
use super::nvme;
use super::sys::{self, DioSupport};
use super::write_cache::{Probe as WriteCacheProbe, WriteCache};

/// Largest single SQE transfer on files and block devices. `len` in an SQE is a
/// `u32`, and one registered buffer is at most 1 GiB; the kernel splits further.
const MAX_FILE_TRANSFER: u32 = 1 << 30;
/// Alignment pdstor asks of buffers for NVMe passthrough: a page, so the kernel
/// maps the buffer straight into PRPs instead of bouncing it.
const PASSTHROUGH_MEM_ALIGN: u32 = 4096;
/// `CAP.MPSMIN` is not visible from userspace; every controller we know uses 4 KiB.
const ASSUMED_MIN_PAGE: u32 = 4096;

/// What kind of target pdstor drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetKind {
    /// A regular file on a filesystem that supports direct I/O (ext4, XFS, …).
    File,
    /// A block device (`/dev/nvmeXnY`, `/dev/loopN`, `/dev/zramN`, …), O_DIRECT.
    BlockDevice,
    /// An NVMe namespace's generic character device (`/dev/ngXnY`), I/O passthrough.
    NvmeGeneric,
}

/// What the engine needs to know about a target to issue correct direct I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Geometry {
    /// Usable bytes.
    pub capacity: u64,
    /// Logical block size (for NVMe: the LBA size).
    pub logical_block: u32,
    /// Required alignment of target offsets and lengths.
    pub offset_align: u32,
    /// Required alignment of buffer addresses.
    pub mem_align: u32,
    /// Largest transfer one command may carry; larger requests are split.
    pub max_transfer: u32,
    /// NVMe namespace id, for passthrough targets.
    pub nsid: Option<u32>,
}

/// How to open a target.
#[derive(Debug, Clone, Default)]
pub struct TargetOptions {
    /// For files: create the file if missing and preallocate it to this many bytes.
    pub create_len: Option<u64>,
    /// For files: give every byte its blocks (`fallocate` over the holes of a
    /// sparse file), so that space promised to a request cannot turn into
    /// `ENOSPC` when its payload is written. The store asks for it.
    pub allocate: bool,
    /// Open for reading only, unlocked, beside the owner that holds it: a
    /// reader on another host's view of a shared namespace (or beside the
    /// daemon on this one). The engine refuses writes and flushes on it.
    pub read_only: bool,
}

/// An opened target: held exclusively by its owner, or read-only beside it.
#[derive(Debug)]
pub struct Target {
    path: PathBuf,
    file: File,
    kind: TargetKind,
    geometry: Geometry,
    read_only: bool,
    /// A block device that cannot take a command without blocking
    /// (`RWF_NOWAIT` refused): io_uring runs each of its commands on an
    /// io-wq worker, so the engine marks them async up front.
    blocks: bool,
    /// Its write cache (set by `open`).
    write_cache: Option<WriteCacheProbe>,
}

impl Target {
    /// Opens `path` for direct I/O (exclusively, locked), reading its geometry; creates a file target of `opts.create_len` bytes if missing.
    pub fn open(path: &Path, opts: &TargetOptions) -> Result<Target, IoError> {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && opts.create_len.is_some() => {
                // 0600 whatever the umask: the target holds KV bytes and the
                // namespace's receipt key, for the daemon's user only.
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(path)
                    .map_err(|source| IoError::Open { path: path.into(), source })?;
                std::fs::metadata(path).map_err(|source| IoError::Open { path: path.into(), source })?
            }
            Err(source) => {
                return Err(IoError::Open { path: path.into(), source });
            }
        };
        let ft = meta.file_type();
        if ft.is_dir() {
            return Err(IoError::IsDirectory { path: path.into() });
        }
        let mut target = if ft.is_file() {
            open_file(path, opts)?
        } else if ft.is_block_device() {
            open_block_device(path, meta.rdev(), opts.read_only)?
        } else if ft.is_char_device() {
            open_nvme_generic(path, meta.rdev(), opts.read_only)?
        } else {
            return Err(IoError::UnsupportedKind { path: path.into(), what: "a socket, FIFO or other special file" });
        };
        target.read_only = opts.read_only;
        target.write_cache = Some(WriteCacheProbe::of(&target.file, target.kind));
        Ok(target)
    }

    /// Whether it was opened read-only ([`TargetOptions::read_only`]).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The target's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Its kind.
    pub fn kind(&self) -> TargetKind {
        self.kind
    }
    /// Its geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    /// Whether every command on it runs on an io-wq worker: a block device
    /// that refuses `RWF_NOWAIT` (zram, other bio-based drivers).
    pub fn blocks(&self) -> bool {
        self.blocks
    }
    /// Lowers the per-command limit, keeping it a whole number of logical blocks.
    pub(crate) fn cap_max_transfer(&mut self, cap: u32) {
        let g = &mut self.geometry;
        let cap = cap - cap % g.offset_align;
        g.max_transfer = g.max_transfer.min(cap.max(g.offset_align));
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// How its write cache is read (to read it again later, beside the engine).
    pub fn write_cache_probe(&self) -> Option<WriteCacheProbe> {
        self.write_cache.clone()
    }

    /// Its write cache now (a block device's read again from sysfs): whether
    /// a flush has anything to make durable.
    pub fn write_cache(&self) -> WriteCache {
        self.write_cache.as_ref().map_or_else(
            || WriteCache::Volatile { source: "not probed: assumed volatile".into() },
            WriteCacheProbe::current,
        )
    }
}

fn open_file(path: &Path, opts: &TargetOptions) -> Result<Target, IoError> {
    let fs = filesystem_name(path);
    let align = match sys::statx_dio_align(path).map_err(|source| IoError::Open { path: path.into(), source })? {
        DioSupport::Aligned(a) => a,
        DioSupport::Unsupported => {
            return Err(IoError::NoDirectIo { path: path.into(), fs });
        }
        // Kernels before 6.1 do not report STATX_DIOALIGN; the filesystem block
        // size is what ext4 and XFS require there.
        DioSupport::Unknown => {
            let blk = nix::sys::statvfs::statvfs(path).map(|s| s.block_size() as u32).unwrap_or(4096);
            sys::DioAlign { mem: blk, offset: blk }
        }
    };
    // tmpfs and ramfs accept O_DIRECT but serve it from the page cache: that is
    // a copy through host memory, which pdstor must not hide.
    if matches!(fs.as_str(), "tmpfs" | "ramfs") {
        return Err(IoError::NoDirectIo { path: path.into(), fs });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::EINVAL) => IoError::NoDirectIo { path: path.into(), fs: fs.clone() },
            _ => IoError::Open { path: path.into(), source },
        })?;
    if !opts.read_only {
        lock_exclusive(&file, path)?;
    }
    if let Some(len) = opts.create_len {
        let current = file.metadata().map_err(|source| IoError::Open { path: path.into(), source })?.len();
        if current < len {
            nix::fcntl::fallocate(file.as_fd(), nix::fcntl::FallocateFlags::empty(), 0, len as i64)
                .map_err(|e| IoError::Preallocate { path: path.into(), len, source: e.into() })?;
        }
    }
    if opts.allocate {
        use std::os::unix::fs::MetadataExt;
        let md = file.metadata().map_err(|source| IoError::Open { path: path.into(), source })?;
        if md.blocks() * 512 < md.len() {
            nix::fcntl::fallocate(file.as_fd(), nix::fcntl::FallocateFlags::empty(), 0, md.len() as i64)
                .map_err(|e| IoError::Preallocate { path: path.into(), len: md.len(), source: e.into() })?;
        }
    }
    let capacity = file.metadata().map_err(|source| IoError::Open { path: path.into(), source })?.len();
    let offset_align = align.offset.max(512);
    Ok(Target {
        path: path.into(),
        file,
        read_only: false,
        write_cache: None,
        blocks: false,
        kind: TargetKind::File,
        geometry: Geometry {
            capacity: capacity - capacity % offset_align as u64,
            logical_block: offset_align,
            offset_align,
            mem_align: align.mem.max(1),
            max_transfer: MAX_FILE_TRANSFER,
            nsid: None,
        },
    })
}

fn open_block_device(path: &Path, rdev: u64, read_only: bool) -> Result<Target, IoError> {
    // A process that just exited may hold the device for a moment: the kernel
    // tears down an io_uring (and its registered files) asynchronously. A
    // mounted device never frees itself, so that is refused at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let file = loop {
        // The owner holds the device exclusively; a reader opens it beside.
        let excl = if read_only { 0 } else { libc::O_EXCL };
        let opened = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_DIRECT | excl | libc::O_CLOEXEC)
            .open(path);
        match opened {
            Ok(f) => break f,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                let mount = mount_point_of(rdev);
                if mount.is_some() || std::time::Instant::now() >= deadline {
                    return Err(IoError::Busy { path: path.into(), mount });
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(source) => return Err(IoError::Open { path: path.into(), source }),
        }
    };
    let probe = |what: &'static str| move |source| IoError::Geometry { path: path.into(), what, source };
    let logical_block = sys::block_logical_size(file.as_fd()).map_err(probe("logical block size (BLKSSZGET)"))?;
    let capacity = sys::block_size_bytes(file.as_fd()).map_err(probe("size (BLKGETSIZE64)"))?;
    let mem_align = match sys::statx_dio_align(path) {
        Ok(DioSupport::Aligned(a)) => a.mem,
        _ => logical_block,
    };
    // Probed once with one direct read of the first logical block; a probe
    // that fails for another reason changes nothing.
    let blocks = {
        // One direct-I/O-aligned block out of a slightly larger allocation.
        let block = logical_block.max(4096) as usize;
        let mut room = vec![0u8; 2 * block];
        let at = room.as_ptr().align_offset(block);
        matches!(sys::takes_nowait(file.as_fd(), &mut room[at..at + block]), Ok(false))
    };
    let max_transfer = sysfs_queue_u64(&format!("/sys/dev/block/{}:{}", major(rdev), minor(rdev)), "max_hw_sectors_kb")
        .map(|kb| (kb * 1024).min(MAX_FILE_TRANSFER as u64) as u32)
        .unwrap_or(MAX_FILE_TRANSFER);
    Ok(Target {
        path: path.into(),
        file,
        read_only: false,
        write_cache: None,
        blocks,
        kind: TargetKind::BlockDevice,
        geometry: Geometry {
            capacity: capacity - capacity % logical_block as u64,
            logical_block,
            offset_align: logical_block,
            mem_align,
            // The block layer splits bios above max_hw_sectors itself; this only
            // bounds the SQE length.
            max_transfer: MAX_FILE_TRANSFER.max(max_transfer),
            nsid: None,
        },
    })
}

fn open_nvme_generic(path: &Path, rdev: u64, read_only: bool) -> Result<Target, IoError> {
    let sys_dir = format!("/sys/dev/char/{}:{}", major(rdev), minor(rdev));
    let subsystem = std::fs::read_link(format!("{sys_dir}/subsystem")).ok();
    if !subsystem.as_deref().is_some_and(|s| s.ends_with("nvme-generic")) {
        return Err(IoError::UnsupportedKind {
            path: path.into(),
            what: "a character device that is not an NVMe generic device (/dev/ngXnY)",
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| IoError::Open { path: path.into(), source })?;
    if !read_only {
        lock_exclusive(&file, path)?;
    }
    let probe = |what: &'static str| move |source| IoError::Geometry { path: path.into(), what, source };
    let nsid = sys::nvme_namespace_id(file.as_fd()).map_err(probe("namespace id (NVME_IOCTL_ID)"))?;
    let mut data = vec![0u8; 4096];
    let identify =
        |cns: u32, nsid: u32| sys::NvmeCmd { opcode: nvme::ADMIN_IDENTIFY, nsid, cdw10: cns, ..Default::default() };
    nvme::admin_read(file.as_fd(), identify(nvme::CNS_NAMESPACE, nsid), &mut data)
        .map_err(probe("Identify Namespace"))?;
    let ns = nvme::parse_identify_namespace(&data).map_err(|msg| IoError::Geometry {
        path: path.into(),
        what: "Identify Namespace",
        source: std::io::Error::other(msg),
    })?;
    if ns.metadata_size != 0 {
        return Err(IoError::UnsupportedKind {
            path: path.into(),
            what: "a namespace formatted with per-block metadata (choose an LBA format with 0 metadata bytes)",
        });
    }
    // The kernel's own limit for this namespace's queue already folds in MDTS;
    // fall back to Identify Controller when the sibling block device is hidden.
    let sibling = nvme_sibling_disk(&sys_dir, nsid);
    if let Some((_, dev)) = &sibling
        && let Some(mount) = mount_point_of(*dev)
    {
        return Err(IoError::Busy { path: path.into(), mount: Some(mount) });
    }
    let max_transfer = match sibling.as_ref().and_then(|(dir, _)| sysfs_queue_u64(dir, "max_hw_sectors_kb")) {
        Some(kb) => (kb * 1024).min(u32::MAX as u64) as u32,
        None => {
            nvme::admin_read(file.as_fd(), identify(nvme::CNS_CONTROLLER, 0), &mut data)
                .map_err(probe("Identify Controller"))?;
            nvme::parse_mdts(&data, ASSUMED_MIN_PAGE)
                .map_err(|msg| IoError::Geometry {
                    path: path.into(),
                    what: "MDTS",
                    source: std::io::Error::other(msg),
                })?
                .unwrap_or(1 << 20)
        }
    };
    let max_transfer = (max_transfer as u64).min(nvme::MAX_BLOCKS_PER_COMMAND * ns.lba_size as u64) as u32;
    let max_transfer = max_transfer - max_transfer % ns.lba_size;
    Ok(Target {
        path: path.into(),
        file,
        read_only: false,
        write_cache: None,
        blocks: false,
        kind: TargetKind::NvmeGeneric,
        geometry: Geometry {
            capacity: ns.blocks * ns.lba_size as u64,
            logical_block: ns.lba_size,
            offset_align: ns.lba_size,
            mem_align: PASSTHROUGH_MEM_ALIGN,
            max_transfer,
            nsid: Some(nsid),
        },
    })
}

/// The block disk of the same namespace under the controller of an `ngXnY`
/// device (`nvmeXnY`, or the hidden multipath `nvmeXcYnZ`): its sysfs dir and dev_t.
fn nvme_sibling_disk(ng_sys_dir: &str, nsid: u32) -> Option<(String, u64)> {
    let ctrl = std::fs::canonicalize(format!("{ng_sys_dir}/device")).ok()?;
    for entry in std::fs::read_dir(&ctrl).ok()?.flatten() {
        let dir = entry.path();
        let ns_of = std::fs::read_to_string(dir.join("nsid")).ok();
        if ns_of.as_deref().map(str::trim) != Some(&nsid.to_string()) {
            continue;
        }
        let dev = std::fs::read_to_string(dir.join("dev")).ok()?;
        let (maj, min) = dev.trim().split_once(':')?;
        let dev = libc::makedev(maj.parse().ok()?, min.parse().ok()?);
        return Some((dir.to_string_lossy().into_owned(), dev));
    }
    None
}

fn lock_exclusive(file: &File, path: &Path) -> Result<(), IoError> {
    use std::os::fd::AsRawFd;
    // A process that just exited may still hold the lock for a moment: the
    // kernel tears down an io_uring (and the files it holds) asynchronously.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        // SAFETY: flock(2) on a descriptor we own; no memory is passed. The lock
        // belongs to the open file description and is released when `file`
        // (the target's only descriptor) closes.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EWOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Some(libc::EWOULDBLOCK) => return Err(IoError::Locked { path: path.into() }),
            _ => {
                return Err(IoError::Open { path: path.into(), source: err });
            }
        }
    }
}

/// `queue/<attr>` of a block device's sysfs dir; for a partition, of its parent.
fn sysfs_queue_u64(dev_dir: &str, attr: &str) -> Option<u64> {
    [format!("{dev_dir}/queue/{attr}"), format!("{dev_dir}/../queue/{attr}")]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// Where a block device is mounted, from `/proc/self/mountinfo`.
fn mount_point_of(rdev: u64) -> Option<String> {
    let want = format!("{}:{}", major(rdev), minor(rdev));
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let mut f = line.split(' ');
        let dev = f.nth(2)?;
        let mount = f.nth(1)?;
        (dev == want).then(|| mount.to_owned())
    })
}

/// The filesystem type a path lives on, by name where we know the magic.
fn filesystem_name(path: &Path) -> String {
    use nix::sys::statfs::{EXT4_SUPER_MAGIC, FsType, TMPFS_MAGIC, XFS_SUPER_MAGIC, statfs};
    // Not exported by nix; `include/uapi/linux/magic.h`.
    const RAMFS_MAGIC: FsType = FsType(0x8584_58f6);
    let dir = if path.exists() { path } else { path.parent().unwrap_or(Path::new(".")) };
    match statfs(dir).map(|s| s.filesystem_type()) {
        Ok(t) if t == EXT4_SUPER_MAGIC => "ext4".into(),
        Ok(t) if t == XFS_SUPER_MAGIC => "xfs".into(),
        Ok(t) if t == TMPFS_MAGIC => "tmpfs".into(),
        Ok(t) if t == RAMFS_MAGIC => "ramfs".into(),
        Ok(t) => format!("filesystem magic {:#x}", t.0),
        Err(_) => "unknown filesystem".into(),
    }
}

fn major(dev: u64) -> u32 {
    libc::major(dev)
}
fn minor(dev: u64) -> u32 {
    libc::minor(dev)
}

/// What the NVMe namespace behind a path calls itself (sysfs `uuid`, `nguid`,
/// `eui`), where it says: how a reader on another host proves that its view
/// of a shared namespace is the owner's. Identifiers that are all zeros (not
/// assigned) are left out; files have none.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceIds {
    /// The namespace UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The namespace NGUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nguid: Option<String>,
    /// The namespace EUI-64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eui64: Option<String>,
}

impl DeviceIds {
    /// The identifiers of the namespace at `path` (a block device `/dev/nvmeXnY`
    /// or its generic `/dev/ngXnY`); empty for anything else.
    pub fn of(path: &Path) -> DeviceIds {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let Ok(meta) = std::fs::metadata(path) else { return DeviceIds::default() };
        let dir = if meta.file_type().is_block_device() {
            format!("/sys/dev/block/{}:{}", major(meta.rdev()), minor(meta.rdev()))
        } else if meta.file_type().is_char_device() {
            // ngXnY's namespace attributes live on its block sibling nvmeXnY.
            let name = path.file_name().map(|n| n.to_string_lossy().replacen("ng", "nvme", 1)).unwrap_or_default();
            format!("/sys/class/block/{name}")
        } else {
            return DeviceIds::default();
        };
        let read = |attr: &str| {
            std::fs::read_to_string(format!("{dir}/{attr}"))
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty() && v.chars().any(|c| c.is_ascii_hexdigit() && c != '0'))
        };
        DeviceIds { uuid: read("uuid"), nguid: read("nguid"), eui64: read("eui") }
    }

    /// Whether `self` and `other` name different namespaces: some identifier
    /// both know differs. (Two views with no identifier in common cannot be
    /// told apart this way; the pdstor superblock still can.)
    pub fn conflicts_with(&self, other: &DeviceIds) -> Option<String> {
        let pairs = [
            ("uuid", &self.uuid, &other.uuid),
            ("nguid", &self.nguid, &other.nguid),
            ("eui64", &self.eui64, &other.eui64),
        ];
        pairs.into_iter().find_map(|(name, a, b)| match (a, b) {
            (Some(a), Some(b)) if !a.eq_ignore_ascii_case(b) => Some(format!("{name} {a} here, {b} at the owner")),
            _ => None,
        })
    }
}
