//! What the vmtest host (`cargo xtask vmtest`) and its guest (`pdstor-vmtest`)
//! agree on: the disks each guest gets, the suite names, the configuration the
//! host hands the guest and the result records the guest reports.
//!
//! This crate is the one place a disk or a suite name is declared. It depends
//! on nothing that needs a system package, so `xtask` builds on a bare machine.
#![deny(clippy::unwrap_used)]

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
    /// A raw namespace whose device fails some blocks (QEMU `blkdebug`).
    Faulty,
}

/// One emulated NVMe disk: its own controller with a serial the guest finds it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DiskSpec {
    pub role: DiskRole,
    /// NVMe serial (at most 20 ASCII characters; sysfs pads it with spaces).
    pub serial: &'static str,
    pub size_mib: u64,
    pub logical_block: u32,
    /// Blocks the device fails (QEMU `blkdebug`), if any.
    pub bad: Option<BadBlocks>,
}

/// Where a disk fails: from a given MiB on (to the last MiB, which stays
/// good), the first 4 KiB of every MiB fails every read, or every write, with
/// EIO inside QEMU's block layer, so the guest's NVMe driver sees a real device
/// error (no device-mapper in between). Any request that touches such a block
/// fails, so every 1 MiB window past the start holds one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BadBlocks {
    pub reads_from_mib: u64,
    pub writes_from_mib: u64,
}

impl DiskSpec {
    /// The failing blocks as (byte offset, QEMU blkdebug event) pairs.
    pub fn bad_blocks(&self) -> Vec<(u64, &'static str)> {
        let Some(bad) = self.bad else {
            return Vec::new();
        };
        let last = self.size_mib.saturating_sub(1);
        let reads = (bad.reads_from_mib..last).map(|m| (m << 20, "read_aio"));
        let writes = (bad.writes_from_mib..last).map(|m| (m << 20, "write_aio"));
        reads.chain(writes).collect()
    }
}

/// The guest's disks. `mkfs.xfs` needs at least 300 MiB.
pub const DISKS: [DiskSpec; 4] = [
    DiskSpec { role: DiskRole::Ext4, serial: "PDEXT4", size_mib: 512, logical_block: 512, bad: None },
    DiskSpec { role: DiskRole::Xfs, serial: "PDXFS", size_mib: 512, logical_block: 512, bad: None },
    DiskSpec { role: DiskRole::Raw, serial: "PDRAW", size_mib: 512, logical_block: 4096, bad: None },
    DiskSpec {
        role: DiskRole::Faulty,
        serial: "PDFAULT",
        size_mib: 64,
        logical_block: 4096,
        bad: Some(BadBlocks { reads_from_mib: 4, writes_from_mib: 48 }),
    },
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
            DiskRole::Faulty => "faulty",
        })
    }
}

/// Every suite, by name, in the order `--suite all` runs them, with what it
/// proves. `pdstor_vmtest::suites::SUITES` implements exactly these (tested).
pub const SUITES: &[(&str, &str)] = &[
    ("io", "engine round trips on ext4, XFS, raw block and NVMe passthrough, read back independently"),
    ("faults", "device-mapper error and flakey targets: failed reads are errors naming the transfer"),
    ("probes", "BTF, tracefs and bpffs work; a tracepoint BPF program counts block requests"),
    ("protocol", "pdstor serve + a writer and a reader process handing KV off on NVMe passthrough and on XFS"),
    (
        "dmabuf",
        "udmabuf buffers through pdstor serve on raw NVMe and XFS; dma-heap and dmabuf_fixed refused with their reasons",
    ),
    ("oracle", "pdstor qualify --short on NVMe passthrough; the timeline checked with --require-path host_fixed"),
    ("swiotlb", "a guest booted with swiotlb=force: probes report the bounce"),
    (
        "topology",
        "two guests on a private network: one exports its raw NVMe namespace with nvmet over TCP, the other reads it through nvme-tcp (`--suite topology` boots both)",
    ),
];

/// Suites that need a topology of several guests, which `--suite all` (one
/// guest) leaves out; `cargo xtask vmtest --suite topology` boots them.
pub const MULTI_GUEST_SUITES: &[&str] = &["topology"];

/// The private network of a topology: the storage guest (which also hosts
/// the writer) and the reader guest, by fixed address; nothing else is on it.
pub const STORAGE_ADDR: &str = "10.77.0.1";
/// The reader guest's address.
pub const READER_ADDR: &str = "10.77.0.2";
/// The NVMe/TCP port the storage guest's nvmet listens on.
pub const NVME_TCP_PORT: u16 = 4420;
/// The NVMe qualified name of the exported subsystem.
pub const SHARED_NQN: &str = "nqn.2026-12.io.pdstor:shared";
/// The serial the exported subsystem reports, by which the reader finds it.
pub const SHARED_SERIAL: &str = "PDFABRIC";
/// Where the storage guest waits for the reader's report.
pub const REPORT_PORT: u16 = 7071;
/// A console line at which a topology guest asks the host to kill it at
/// once, as a host that dies (no shutdown, no flush, no goodbye).
pub const KILL_ME: &str = "pdstor-vminit: kill this host now";
/// A console line (followed by the test's name) at which a topology's
/// storage guest asks to lose power: QEMU is killed at once and the guest
/// booted again on the same disks with `pdstor.resume=<test>`, which resumes
/// its suite at that test.
pub const POWER_CUT_ME: &str = "pdstor-vminit: cut this host's power, then boot it again at ";

/// Whether `name` is a suite in [`SUITES`].
pub fn suite_exists(name: &str) -> bool {
    SUITES.iter().any(|(n, _)| *n == name)
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
    /// Everything it checks held.
    Pass,
    /// It ran, and this is how it failed.
    Fail(Failure),
    /// It cannot run here: what it needs, and what runs it.
    Skip(String),
}

/// How a test failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Failure {
    /// A property the test checks did not hold: what it expected, what it saw.
    Check { message: String },
    /// A program the test runs (pdstor, nvme, mkfs, …) could not start or
    /// exited with an error.
    Command { command: String, detail: String },
    /// The guest could not set up what its tests need (filesystems, modules,
    /// the network, its configuration): no test result can be trusted.
    Setup { message: String },
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Check { message } => f.write_str(message),
            Failure::Command { command, detail } => write!(f, "{command}: {detail}"),
            Failure::Setup { message } => write!(f, "guest setup: {message}"),
        }
    }
}

impl std::error::Error for Failure {}

/// A check's message as a failure (what most failing tests report).
impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure::Check { message }
    }
}

/// A failure as text, for the helpers that still speak in strings.
impl From<Failure> for String {
    fn from(f: Failure) -> String {
        f.to_string()
    }
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
            outcome: Outcome::Fail(Failure::Check { message: "chunk 3 differs at byte 17".into() }),
            millis: 12,
        };
        let line = serde_json::to_string(&r).expect("a result record encodes");
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<TestResult>(&line).expect("a result line decodes"), r);
        assert!(line.contains(r#""outcome":{"status":"fail","detail":{"kind":"check","message""#), "{line}");
        let skip = TestResult { outcome: Outcome::Skip("needs the series kernel".into()), ..r };
        let line = serde_json::to_string(&skip).expect("a result record encodes");
        assert!(line.contains(r#""outcome":{"status":"skip","detail":"needs the series kernel"}"#), "{line}");
    }

    #[test]
    fn a_failure_says_its_kind() {
        let c = Failure::Command { command: "nvme connect".into(), detail: "exited with 1: no route".into() };
        assert_eq!(c.to_string(), "nvme connect: exited with 1: no route");
        assert_eq!(Failure::from("bytes differ".to_owned()), Failure::Check { message: "bytes differ".into() });
        assert!(Failure::Setup { message: "no /proc".into() }.to_string().starts_with("guest setup: "));
    }
}
