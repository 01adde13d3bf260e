//! Whether a target keeps completed writes in a volatile cache, and so
//! whether a flush has anything to do.
//!
//! A flush makes completed writes durable. Where the device has no volatile
//! write cache, a completed write is durable already: an NVMe controller
//! that reports none (Identify Controller `VWC` bit 0 clear) has nothing to
//! write back, and the kernel drops a block device's flush where its queue
//! says `write through` (zram, a disk whose cache is off, a loop device set
//! so). pdstor then issues none, and counts each flush it did not issue, so
//! that its accounting says what happened. A block device's setting can be
//! changed under the daemon (`echo "write back" > queue/write_cache`): it is
//! read again before every flush that would be skipped.
//!
//! A file is always flushed (`fdatasync`): its filesystem decides what that
//! takes — the file's metadata where a write allocated or converted an
//! extent, and a flush of the device under it where that has a cache.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::PathBuf;

use super::nvme;
use super::sys;

/// What a target does with completed writes until a flush.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WriteCache {
    /// A volatile write cache: completed writes are durable once flushed.
    Volatile {
        /// Where that was read.
        source: String,
    },
    /// None: a completed write is durable; a flush would do nothing.
    None {
        /// Where that was read.
        source: String,
    },
    /// A file: its filesystem decides (always flushed, `fdatasync`).
    Filesystem {
        /// The device under the filesystem, and its write cache.
        device: String,
    },
}

impl WriteCache {
    /// Whether a flush has anything to make durable.
    pub fn needs_flush(&self) -> bool {
        !matches!(self, WriteCache::None { .. })
    }

    /// `volatile`, `none` or `filesystem`.
    pub fn name(&self) -> &'static str {
        match self {
            WriteCache::Volatile { .. } => "volatile",
            WriteCache::None { .. } => "none",
            WriteCache::Filesystem { .. } => "filesystem",
        }
    }
}

impl std::fmt::Display for WriteCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteCache::Volatile { source } => write!(f, "volatile, flushed at every commit ({source})"),
            WriteCache::None { source } => write!(f, "none, never flushed: a completed write is durable ({source})"),
            WriteCache::Filesystem { device } => write!(f, "a file: fdatasync at every commit (on {device})"),
        }
    }
}

/// A target's write cache as found at open, and the sysfs attribute to
/// read again before a flush is skipped.
#[derive(Debug, Clone)]
pub struct Probe {
    found: WriteCache,
    attribute: Option<PathBuf>,
}

impl Probe {
    /// The write cache of `file`, a target of `kind` just opened.
    pub(crate) fn of(file: &File, kind: super::TargetKind) -> Probe {
        let Ok(meta) = file.metadata() else {
            return Probe {
                found: volatile("the target's metadata could not be read: assumed volatile"),
                attribute: None,
            };
        };
        match kind {
            super::TargetKind::File => {
                Probe { found: WriteCache::Filesystem { device: device_of(meta.dev()) }, attribute: None }
            }
            super::TargetKind::BlockDevice => match queue_attribute(meta.rdev()) {
                Some(path) => Probe { found: read(&path), attribute: Some(path) },
                None => Probe { found: volatile("no queue/write_cache in sysfs: assumed volatile"), attribute: None },
            },
            super::TargetKind::NvmeGeneric if meta.file_type().is_char_device() => {
                Probe { found: identify_vwc(file), attribute: None }
            }
            super::TargetKind::NvmeGeneric => Probe { found: volatile("not a character device"), attribute: None },
        }
    }

    /// The write cache now: read again where sysfs says it.
    pub fn current(&self) -> WriteCache {
        match &self.attribute {
            Some(path) => read(path),
            None => self.found.clone(),
        }
    }
}

fn volatile(source: &str) -> WriteCache {
    WriteCache::Volatile { source: source.into() }
}

/// `queue/write_cache` of the block device `rdev` (a partition's is its disk's).
fn queue_attribute(rdev: u64) -> Option<PathBuf> {
    let dir = PathBuf::from(format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev)));
    [dir.join("queue/write_cache"), dir.join("../queue/write_cache")].into_iter().find(|p| p.exists())
}

/// A sysfs `write_cache` attribute: `write back` or `write through`.
fn read(path: &std::path::Path) -> WriteCache {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(text.trim(), &path.display().to_string()),
        Err(e) => volatile(&format!("{}: {e}: assumed volatile", path.display())),
    }
}

/// A `write_cache` attribute's value read at `source`.
fn parse(value: &str, source: &str) -> WriteCache {
    let source = format!("{source}: {value}");
    match value {
        "write through" => WriteCache::None { source },
        "write back" => WriteCache::Volatile { source },
        _ => WriteCache::Volatile { source: format!("{source} (not understood: assumed volatile)") },
    }
}

/// The filesystem's device `dev` and its write cache, in words.
fn device_of(dev: u64) -> String {
    let name = format!("{}:{}", libc::major(dev), libc::minor(dev));
    if libc::major(dev) == 0 {
        return format!("no block device ({name}: tmpfs, overlay or a network filesystem)");
    }
    match queue_attribute(dev) {
        Some(path) => format!("block device {name}, write cache {}", read(&path).name()),
        None => format!("block device {name}, write cache unknown"),
    }
}

/// Identify Controller's `VWC` (byte 525, bit 0: a volatile write cache is present).
fn identify_vwc(file: &File) -> WriteCache {
    let mut data = vec![0u8; 4096];
    let cmd = sys::NvmeCmd { opcode: nvme::ADMIN_IDENTIFY, nsid: 0, cdw10: nvme::CNS_CONTROLLER, ..Default::default() };
    match nvme::admin_read(file.as_fd(), cmd, &mut data) {
        Ok(()) => vwc(&data),
        Err(e) => volatile(&format!("Identify Controller failed ({e}): assumed volatile")),
    }
}

/// The write cache Identify Controller data reports.
fn vwc(identify_controller: &[u8]) -> WriteCache {
    match identify_controller.get(525) {
        Some(b) if b & 1 == 0 => WriteCache::None { source: format!("NVMe Identify Controller VWC = {b:#04x}") },
        Some(b) => WriteCache::Volatile { source: format!("NVMe Identify Controller VWC = {b:#04x}") },
        None => volatile("Identify Controller data too short for VWC (byte 525): assumed volatile"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_values_are_read_and_anything_else_is_volatile() {
        assert!(!parse("write through", "zram0").needs_flush());
        assert!(parse("write back", "sda").needs_flush());
        let odd = parse("writeback", "x");
        assert!(odd.needs_flush() && odd.to_string().contains("not understood"), "{odd}");
    }

    #[test]
    fn nvme_vwc_bit_zero_decides() {
        let mut id = vec![0u8; 4096];
        assert!(!vwc(&id).needs_flush());
        id[525] = 0x07;
        assert!(vwc(&id).needs_flush());
        assert!(vwc(&id[..100]).needs_flush(), "short data: assumed volatile");
    }

    #[test]
    fn a_file_is_its_filesystems_and_always_flushed() {
        let f = tempfile::tempfile().unwrap();
        let p = Probe::of(&f, super::super::TargetKind::File);
        assert_eq!(p.current().name(), "filesystem");
        assert!(p.current().needs_flush());
    }
}
