//! The guest side of `cargo xtask vmtest`: the disks each guest gets, the
//! configuration the host hands the guest, the guest `/init` ([`guest`]), the
//! contract suites ([`suites::SUITES`]) and the result records they report.
//!
//! The disk table and the suite table are the one place a disk or a suite is
//! declared, so host and guest agree on serials, sizes and names. The QEMU
//! launcher and the initramfs builder live in `xtask/src/vmtest/`.

pub mod guest;
pub mod suites;

use serde::{Deserialize, Serialize};

/// Where the host puts the guest configuration inside the initramfs.
pub const GUEST_CONFIG_PATH: &str = "/etc/pdstor-vmtest.json";
/// Name of the virtio-serial port the guest writes results to.
pub const RESULT_PORT_NAME: &str = "vmtest.result";
/// Printed on the console by the guest `/init` as soon as it runs: the host's
/// proof that the kernel booted (used to probe whether an accelerator works).
pub const BOOT_MARKER: &str = "PDSTOR-VMINIT-START";
/// The last result line of a guest that ran to its end.
pub const FINISHED_TEST: &str = "guest-finished";

/// What the host tells the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestConfig {
    /// Suites to run, by name, in order.
    pub suites: Vec<String>,
    /// Kernel modules (paths inside the initramfs) in load order.
    pub modules: Vec<String>,
    /// Kernel release the modules belong to.
    pub kernel_release: String,
    /// Disks whose tests run; tests of the others are skipped (`--fs`).
    pub disks: Vec<DiskRole>,
}

/// What a disk holds in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskRole {
    Ext4,
    Xfs,
    Raw,
}

/// One emulated NVMe disk: its own controller with a serial the guest finds it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiskSpec {
    pub role: DiskRole,
    /// NVMe serial (at most 20 ASCII characters; sysfs pads it with spaces).
    pub serial: &'static str,
    pub size_mib: u64,
    pub logical_block: u32,
}

/// The guest's disks. `mkfs.xfs` needs at least 300 MiB.
pub const DISKS: [DiskSpec; 3] = [
    DiskSpec { role: DiskRole::Ext4, serial: "PDEXT4", size_mib: 512, logical_block: 512 },
    DiskSpec { role: DiskRole::Xfs, serial: "PDXFS", size_mib: 512, logical_block: 512 },
    DiskSpec { role: DiskRole::Raw, serial: "PDRAW", size_mib: 512, logical_block: 4096 },
];

/// QEMU's NVMe MDTS for every disk, as a power of two of 4 KiB pages: 7 means
/// 512 KiB, so 1 MiB requests must be split by the engine.
pub const NVME_MDTS: u32 = 7;

impl std::fmt::Display for DiskRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DiskRole::Ext4 => "ext4",
            DiskRole::Xfs => "xfs",
            DiskRole::Raw => "raw",
        })
    }
}

/// Finds a disk by the serial sysfs reports (space-padded to 20 bytes).
pub fn disk_by_serial(sysfs_serial: &str) -> Option<&'static DiskSpec> {
    let s = sysfs_serial.trim();
    DISKS.iter().find(|d| d.serial == s)
}

/// How one test in the guest ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "status", content = "detail")]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

/// One line of `vmtest.result`: a JSON object per test.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestResult {
    pub suite: String,
    pub test: String,
    pub disk: Option<DiskRole>,
    pub outcome: Outcome,
    pub millis: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_fit_nvme_and_are_unique() {
        for d in DISKS {
            assert!(d.serial.len() <= 20 && d.serial.is_ascii());
            assert_eq!(DISKS.iter().filter(|o| o.serial == d.serial).count(), 1);
        }
        assert!(DISKS.iter().any(|d| d.role == DiskRole::Xfs && d.size_mib >= 300));
    }

    #[test]
    fn padded_sysfs_serial_finds_its_disk() {
        assert_eq!(disk_by_serial("PDRAW               \n").map(|d| d.role), Some(DiskRole::Raw));
        assert_eq!(disk_by_serial("PDRAWX"), None);
    }

    #[test]
    fn results_are_one_json_object_per_line() {
        let r = TestResult {
            suite: "io".into(),
            test: "host_fixed_xfs".into(),
            disk: Some(DiskRole::Xfs),
            outcome: Outcome::Fail("chunk 3 differs at byte 17".into()),
            millis: 12,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<TestResult>(&line).unwrap(), r);
    }
}
