//! The guest side of `cargo xtask vmtest`: the disks each guest gets and the
//! result records its suites report. The QEMU launcher and guest `/init` build
//! on these (see the vmtest issue); the disk table is the one place a disk is
//! declared, so host and guest agree on serials and sizes.

use serde::{Deserialize, Serialize};

/// What a disk holds in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
    DiskSpec {
        role: DiskRole::Ext4,
        serial: "PDEXT4",
        size_mib: 512,
        logical_block: 512,
    },
    DiskSpec {
        role: DiskRole::Xfs,
        serial: "PDXFS",
        size_mib: 512,
        logical_block: 512,
    },
    DiskSpec {
        role: DiskRole::Raw,
        serial: "PDRAW",
        size_mib: 512,
        logical_block: 4096,
    },
];

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
        assert!(
            DISKS
                .iter()
                .any(|d| d.role == DiskRole::Xfs && d.size_mib >= 300)
        );
    }

    #[test]
    fn padded_sysfs_serial_finds_its_disk() {
        assert_eq!(
            disk_by_serial("PDRAW               \n").map(|d| d.role),
            Some(DiskRole::Raw)
        );
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
