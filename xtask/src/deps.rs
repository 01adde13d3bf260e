//! `cargo xtask deps`: the system packages pdstor's build and tests use.
//! Idempotent: packages already installed are not touched, and when all are
//! present it runs no package manager at all.

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

/// Debian packages, each with why pdstor needs it.
pub const PACKAGES: &[(&str, &str)] = &[
    ("fio", "the peer in `cargo xtask bench`"),
    ("xfsprogs", "mkfs.xfs for the XFS engine tests"),
    ("e2fsprogs", "mkfs.ext4 for the ext4 engine tests"),
    ("util-linux", "losetup and mount for loop-device tests"),
    ("coreutils", "dd iflag=direct, the independent reader in tests"),
    ("qemu-system-x86", "the vmtest guests"),
    ("busybox-static", "the vmtest guest's shell tools (dd, blockdev)"),
    ("nvme-cli", "`nvme read`, the independent reader of passthrough payloads in the guest"),
    ("dmsetup", "device-mapper error/flakey targets in the guest's faults suite"),
    ("kmod", "depmod/modprobe to resolve the guest's module load order"),
    ("xz-utils", "decompressing the guest kernel's modules"),
    ("bpftool", "inspecting pinned BPF objects in the guest's probes suite"),
    ("clang", "compiling the eBPF provenance programs (libbpf-cargo)"),
    ("libelf-dev", "libbpf, built from source by libbpf-sys"),
    ("zlib1g-dev", "libbpf, built from source by libbpf-sys"),
    ("pkg-config", "locating libelf and zlib for libbpf-sys"),
];

fn installed(sh: &Shell, pkg: &str) -> bool {
    let format = "-f=${Status}";
    cmd!(sh, "dpkg-query -W {format} {pkg}")
        .quiet()
        .ignore_stderr()
        .read()
        .is_ok_and(|s| s.contains("install ok installed"))
}

pub fn install(sh: &Shell) -> Result<()> {
    if cmd!(sh, "dpkg-query --version").quiet().ignore_stdout().ignore_stderr().run().is_err() {
        bail!(
            "dpkg-query not found: this is not a Debian-like system. Install by hand: {}",
            PACKAGES.iter().map(|p| p.0).collect::<Vec<_>>().join(" ")
        );
    }
    let missing: Vec<&str> = PACKAGES.iter().map(|p| p.0).filter(|p| !installed(sh, p)).collect();
    if missing.is_empty() {
        println!("deps: all {} packages present", PACKAGES.len());
        return Ok(());
    }
    let uid = cmd!(sh, "id -u").quiet().read().unwrap_or_default();
    if uid.trim() != "0" {
        bail!(
            "deps: missing {}; run as root: apt-get update && apt-get install -y {}",
            missing.join(" "),
            missing.join(" ")
        );
    }
    println!("deps: installing {}", missing.join(" "));
    cmd!(sh, "apt-get update -qq").env("DEBIAN_FRONTEND", "noninteractive").run().context("apt-get update")?;
    cmd!(sh, "apt-get install -y -qq --no-install-recommends {missing...}")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .run()
        .context("apt-get install")?;
    Ok(())
}
