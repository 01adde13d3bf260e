//! `cargo xtask vmtest`: boots QEMU guests with emulated NVMe (ext4, XFS, raw)
//! and runs the contract suites inside them.
//!
//! Steps: build the static guest `/init` → fetch and check the Debian kernel →
//! assemble the initramfs → create sparse disk images → boot (KVM if it works
//! here, else TCG) → read one JSON result per test from the virtio-serial port
//! → print a table. Any failing test, a guest that did not finish, a panic or a
//! timeout fails the command.

mod initramfs;
mod kernel;
mod matrix;
mod qemu;
pub mod series;
mod topology;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use pdstor_vmtest_spec::{
    DISKS, DiskRole, DiskSpec, FINISHED_TEST, GUEST_CONFIG_PATH, GuestConfig, MULTI_GUEST_SUITES, Outcome, READER_ADDR,
    STORAGE_ADDR, SUITES, TestResult, suite_exists,
};
use xshell::{Shell, cmd};

use qemu::{Accel, Vm};

pub use matrix::{Kernel, run_matrix};

/// Modules the guest needs that Debian builds as modules (sd_mod and
/// scsi_debug: the probes suite's disk of queue depth 1 and injected requeues).
const MODULES: &[&str] = &["nvme", "ext4", "xfs", "dm-mod", "dm-flakey", "sd_mod", "scsi_debug"];
/// And those a topology's guests need: the private network's card, the
/// NVMe/TCP target and initiator.
const TOPOLOGY_MODULES: &[&str] = &["virtio_net", "nvmet", "nvmet-tcp", "nvme-tcp"];

#[derive(clap::Args)]
pub struct VmtestArgs {
    /// Suites to run, comma-separated (default: all but topology, which boots its own two guests):
    /// io, faults, probes, protocol, dmabuf, oracle, swiotlb, topology.
    #[arg(long = "suite", value_delimiter = ',')]
    suites: Vec<String>,
    /// Disk roles whose tests run: ext4, xfs, raw, faulty (default: all).
    #[arg(long, value_delimiter = ',')]
    fs: Vec<String>,
    /// Boot this kernel image instead of the fetched Debian one (its drivers must be built in).
    #[arg(long, conflicts_with = "kernel_series")]
    kernel: Option<PathBuf>,
    /// Boot Debian's linux-source-7.2 with this patch series applied (built once and cached
    /// under ~/.cache/pdstor/kernels/; see `cargo xtask kernel build`).
    #[arg(long)]
    pub kernel_series: Option<PathBuf>,
    /// make -j for a series kernel that is not cached yet.
    #[arg(long, default_value_t = std::thread::available_parallelism().map_or(2, |n| n.get()))]
    jobs: usize,
    /// tcg, kvm or auto (probe KVM, fall back to TCG). Also PDSTOR_VM_ACCEL.
    #[arg(long, env = "PDSTOR_VM_ACCEL", default_value = "auto")]
    accel: String,
    /// Leave the disk images in target/vmtest/run/ (logs are always kept).
    #[arg(long)]
    keep: bool,
    /// Wall-clock limit for the guest, in seconds.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// Extra guest kernel arguments (e.g. swiotlb=force for the swiotlb suite).
    #[arg(long)]
    append: Option<String>,
}

#[derive(clap::Subcommand)]
pub enum KernelCmd {
    /// Download and unpack Debian's 6.12 kernel into target/vmtest/kernel/ (cached), then check it.
    Fetch,
    /// Check a kernel config against a fragment (default kernel-config/pd-storage.config).
    Check {
        /// The kernel's .config (default: the fetched kernel's).
        #[arg(long)]
        kernel_config: Option<PathBuf>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Build Debian's linux-source-7.2 with a patch series applied, everything the guest needs
    /// built in, BTF on (cached under ~/.cache/pdstor/kernels/ by source, series and config).
    Build {
        /// The series: a directory of git format-patch files, applied in name order (default:
        /// PDSTOR_KERNEL_SERIES, the rw-dmabuf series beside the checkout, or its kept copy).
        #[arg(long)]
        series: Option<PathBuf>,
        /// The linux-source-7.2 version (trixie-backports) the series applies to.
        #[arg(long, default_value = series::DEFAULT_SOURCE)]
        source_version: String,
        /// make -j.
        #[arg(long, default_value_t = std::thread::available_parallelism().map_or(2, |n| n.get()))]
        jobs: usize,
    },
    /// Configure a source tree as `kernel build` does: allnoconfig with kernel-config/series-base.config
    /// and every fragment forced built in (a --kernel guest gets no modules), BTF.
    Defconfig {
        #[arg(long)]
        src: PathBuf,
    },
}

fn spinner(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.enable_steady_tick(Duration::from_millis(200));
    pb.set_message(msg.to_owned());
    pb
}

fn fragment(name: &str) -> PathBuf {
    crate::project_root().join("kernel-config").join(name)
}

pub fn kernel_cmd(sh: &Shell, cmd_: &KernelCmd) -> Result<()> {
    match cmd_ {
        KernelCmd::Fetch => {
            let k = kernel::fetch(sh)?;
            kernel::check(&k, &fragment("pd-storage.config"))?;
            println!("kernel {} ({}) at {}: pd-storage.config satisfied", k.release, k.package, k.vmlinuz.display());
        }
        KernelCmd::Check { kernel_config, config } => {
            let cfg = match kernel_config {
                Some(c) => c.clone(),
                None => kernel::fetch(sh)?.config.context("the fetched kernel has no config")?,
            };
            let frag = config.clone().unwrap_or_else(|| fragment("pd-storage.config"));
            let missing = kernel::missing_options(&cfg, &frag)?;
            if missing.is_empty() {
                println!("{}: every option of {} is set", cfg.display(), frag.display());
            } else {
                bail!(
                    "{} lacks {} option(s) of {}: {}",
                    cfg.display(),
                    missing.len(),
                    frag.display(),
                    missing.join(", ")
                );
            }
        }
        KernelCmd::Build { series, source_version, jobs } => {
            let dir = match series {
                Some(d) => d.clone(),
                None => series::ci_series().map_err(anyhow::Error::msg)?,
            };
            let k = series::build(sh, &dir, source_version, *jobs)?;
            println!("kernel {} at {} ({})", k.release, k.vmlinuz.display(), k.package);
        }
        KernelCmd::Defconfig { src } => {
            if !src.join("scripts/kconfig/merge_config.sh").exists() {
                bail!("{} is not a Linux source tree (no scripts/kconfig/merge_config.sh)", src.display());
            }
            series::configure(sh, src)?;
            println!(
                "{}/.config has every pdstor option built in; build with `make -j$(nproc) bzImage`",
                src.display()
            );
        }
    }
    Ok(())
}

pub fn run(sh: &Shell, args: &VmtestArgs) -> Result<()> {
    let started = Instant::now();
    let (suites, topology) = chosen_suites(args)?;
    let roles = chosen_disks(args)?;
    let pb = spinner("building the guest /init (static)");
    let init = build_guest(sh)?;
    pb.set_message("fetching the guest kernel");
    let kernel = guest_kernel(sh, args, &pb)?;
    pb.set_message("assembling the initramfs");
    let dir = crate::project_root().join("target/vmtest/run");
    let _ = std::fs::remove_dir_all(&dir);
    sh.create_dir(&dir)?;
    let initrd = dir.join("initramfs.cpio");
    let size = build_initramfs(sh, &kernel, &init, &suites, &roles, &initrd)?;
    pb.set_message(format!("initramfs {} MiB; creating disks", size >> 20));
    let disks = create_disks(&dir)?;
    if topology {
        pb.finish_and_clear();
        let accel = if args.accel == "kvm" { Accel::Kvm } else { Accel::Tcg };
        let append = args.append.clone().unwrap_or_default();
        return topology::run_topology(
            &kernel.vmlinuz,
            &initrd,
            disks,
            (&dir, append.as_str()),
            Duration::from_secs(args.timeout),
            accel,
            started,
        );
    }
    let vm = Vm {
        nic: None,
        abort: None,
        kill_markers: &[],
        kernel: &kernel.vmlinuz,
        initrd: &initrd,
        disks,
        dir: &dir,
        // The guest's ground truth for which kernel it runs: a series kernel
        // must have dmabuf_fixed, Debian's must refuse it.
        extra_append: [
            args.append.clone().unwrap_or_default(),
            if args.kernel_series.is_some() { "pdstor.rw_dmabuf=1".into() } else { String::new() },
        ]
        .join(" ")
        .trim()
        .to_owned(),
    };
    let run = boot(&vm, args, &pb)?;
    pb.finish_and_clear();
    let verdict = report(&run, started.elapsed());
    if !args.keep {
        for (_, img) in &vm.disks {
            let _ = std::fs::remove_file(img);
        }
    }
    println!(
        "logs: {} (console), {} (results), {}",
        run.console_file.display(),
        run.results_file.display(),
        dir.join("qemu.stderr").display()
    );
    verdict
}

/// The suites asked for (all but the multi-guest ones by default), and
/// whether they are the topology, which boots guests of its own.
fn chosen_suites(args: &VmtestArgs) -> Result<(Vec<String>, bool)> {
    let suites: Vec<String> = if args.suites.is_empty() || args.suites.iter().any(|s| s == "all") {
        SUITES
            .iter()
            .map(|(name, _)| (*name).to_owned())
            .filter(|n| !MULTI_GUEST_SUITES.contains(&n.as_str()))
            .collect()
    } else {
        args.suites.clone()
    };
    let topology = suites.iter().any(|s| MULTI_GUEST_SUITES.contains(&s.as_str()));
    if topology && suites.len() > 1 {
        bail!("--suite topology boots its own guests: run it on its own (cargo xtask vmtest --suite topology)");
    }
    for s in &suites {
        if !suite_exists(s) {
            bail!(
                "unknown suite {s:?}: known suites are {}",
                SUITES.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ")
            );
        }
    }
    Ok((suites, topology))
}

/// The disks' roles asked for with --fs (every one by default).
fn chosen_disks(args: &VmtestArgs) -> Result<Vec<DiskRole>> {
    let roles: Vec<DiskRole> = if args.fs.is_empty() {
        DISKS.iter().map(|d| d.role).collect()
    } else {
        args.fs
            .iter()
            .map(|f| {
                DISKS
                    .iter()
                    .find(|d| d.role.to_string() == *f)
                    .map(|d| d.role)
                    .with_context(|| format!("unknown --fs {f:?}: use ext4, xfs, raw, faulty"))
            })
            .collect::<Result<_>>()?
    };
    Ok(roles)
}

/// The guest's kernel: a given bzImage, the series kernel (built or reused),
/// or Debian's.
fn guest_kernel(sh: &Shell, args: &VmtestArgs, pb: &ProgressBar) -> Result<kernel::Kernel> {
    let kernel = match (&args.kernel, &args.kernel_series) {
        (Some(path), _) => kernel::Kernel {
            package: "(given)".into(),
            release: "custom".into(),
            vmlinuz: path.clone(),
            root: None,
            config: None,
        },
        (None, Some(dir)) => {
            pb.set_message("building (or reusing) the series kernel");
            let k = series::build(sh, dir, series::DEFAULT_SOURCE, args.jobs)?;
            // No modules reach this guest: everything must be built in.
            if let Some(config) = &k.config {
                let missing = series::missing_builtin(config)?;
                if !missing.is_empty() {
                    bail!("series kernel {} lacks built-in {}", k.release, missing.join(", "));
                }
            }
            k
        }
        (None, None) => kernel::fetch(sh)?,
    };
    if args.kernel_series.is_none() {
        kernel::check(&kernel, &fragment("pd-storage.config"))?;
    }
    Ok(kernel)
}

/// One sparse image per disk the guest gets.
fn create_disks(dir: &Path) -> Result<Vec<(DiskSpec, PathBuf)>> {
    let mut disks = Vec::new();
    for spec in DISKS {
        let img = dir.join(format!("{}.img", spec.role));
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(spec.size_mib << 20))
            .with_context(|| format!("creating {}", img.display()))?;
        disks.push((spec, img));
    }
    Ok(disks)
}

/// Boots the guest with the accelerator asked for (auto: KVM if it boots,
/// else TCG) and runs its suites.
fn boot(vm: &Vm, args: &VmtestArgs, pb: &ProgressBar) -> Result<qemu::VmRun> {
    let timeout = Duration::from_secs(args.timeout);
    let progress = |s: &str| pb.set_message(format!("guest: {s}"));
    let run = match args.accel.as_str() {
        "tcg" => vm.run(Accel::Tcg, timeout, None, progress)?,
        "kvm" => vm.run(Accel::Kvm, timeout, None, progress)?,
        "auto" => {
            // Under KVM the guest reaches /init in well under a second; a host
            // that cannot run it (a PVM host here) aborts or hangs instead.
            const KVM_BOOT_DEADLINE: Duration = Duration::from_secs(10);
            pb.set_message("probing KVM (boot marker within 10 s)");
            let probe = if Path::new("/dev/kvm").exists() {
                Some(vm.run(Accel::Kvm, timeout, Some(KVM_BOOT_DEADLINE), &progress)?)
            } else {
                None
            };
            match probe {
                Some(r) if r.booted => r,
                probe => {
                    let why = match &probe {
                        None => "no /dev/kvm".to_owned(),
                        Some(r) => format!(
                            "no boot marker within {KVM_BOOT_DEADLINE:?} ({})",
                            r.qemu_stderr.lines().next().unwrap_or("qemu said nothing")
                        ),
                    };
                    pb.println(format!(
                        "vmtest: KVM unusable here ({why}); using TCG. Set PDSTOR_VM_ACCEL=tcg to skip the probe."
                    ));
                    vm.run(Accel::Tcg, timeout, None, &progress)?
                }
            }
        }
        other => bail!("--accel {other:?}: use tcg, kvm or auto"),
    };
    // Nothing of pdstor ran before an early-boot panic: boot once more, and
    // say so; a second panic fails the run.
    let run = if panicked_in_early_boot(&run) {
        pb.println("vmtest: the guest kernel panicked during early boot, before /init ran; booting it once more");
        vm.run(run.accel, timeout, None, &progress)?
    } else {
        run
    };
    Ok(run)
}

fn build_guest(sh: &Shell) -> Result<PathBuf> {
    let target_dir = crate::project_root().join("target/vmtest/cargo");
    cmd!(
        sh,
        "cargo build --release --quiet -p pdstor-vmtest -p pdstor --bin pdstor-vminit --bin pdstor --target x86_64-unknown-linux-gnu --target-dir {target_dir}"
    )
        // Static so the initramfs needs no libc for it; no debug info, to keep it small.
        .env("RUSTFLAGS", "-C target-feature=+crt-static -C strip=debuginfo")
        .run()
        .context("building the static guest init")?;
    Ok(target_dir.join("x86_64-unknown-linux-gnu/release/pdstor-vminit"))
}

fn build_initramfs(
    sh: &Shell,
    kernel: &kernel::Kernel,
    init: &Path,
    suites: &[String],
    roles: &[DiskRole],
    out: &Path,
) -> Result<u64> {
    let mut a = initramfs::Archive::default();
    for d in ["/dev", "/proc", "/sys", "/tmp", "/run", "/mnt", "/etc", "/bin", "/sbin"] {
        a.dir(d);
    }
    a.host_file("/init", init, 0o755)?;
    // The static pdstor binary, for suites that run the daemon and its clients.
    let pdstor = init.with_file_name("pdstor");
    a.host_file("/bin/pdstor", &pdstor, 0o755)?;
    initramfs::add_busybox(&mut a, sh)?;
    for (guest_path, tool) in initramfs::TOOLS {
        a.program_with_libs(sh, guest_path, &initramfs::which(tool)?)?;
    }
    if Path::new("/etc/mke2fs.conf").exists() {
        a.host_file("/etc/mke2fs.conf", Path::new("/etc/mke2fs.conf"), 0o644)?;
    }
    let mut modules = Vec::new();
    let mut wanted = MODULES.to_vec();
    if suites.iter().any(|s| MULTI_GUEST_SUITES.contains(&s.as_str())) {
        wanted.extend_from_slice(TOPOLOGY_MODULES);
    }
    for ko in kernel::module_order(sh, kernel, &wanted)? {
        let name =
            ko.file_name().map(|n| n.to_string_lossy().trim_end_matches(".xz").to_owned()).context("module path")?;
        let data = if ko.extension().is_some_and(|e| e == "xz") {
            let out = std::process::Command::new("xz").arg("-dc").arg(&ko).output().context("running xz")?;
            if !out.status.success() {
                bail!("xz -dc {} failed: {}", ko.display(), String::from_utf8_lossy(&out.stderr));
            }
            out.stdout
        } else {
            std::fs::read(&ko)?
        };
        let guest = format!("/lib/modules/{}/{name}", kernel.release);
        a.file(&guest, 0o644, data);
        modules.push(guest);
    }
    let cfg =
        GuestConfig { suites: suites.to_vec(), modules, kernel_release: kernel.release.clone(), disks: roles.to_vec() };
    a.file(GUEST_CONFIG_PATH, 0o644, serde_json::to_vec_pretty(&cfg)?);
    a.write(out)
}

/// A panic before /init printed its boot marker: the kernel's own early boot
/// under emulation (seen under TCG with swiotlb=force and on a loaded host,
/// in an initcall), before anything of pdstor ran.
fn panicked_in_early_boot(r: &qemu::VmRun) -> bool {
    !r.booted && std::fs::read_to_string(&r.console_file).is_ok_and(|c| c.contains("Kernel panic"))
}

/// The console from the first line of the kernel's report (what died and
/// how: `Oops: int3`, `BUG: ...`, a WARN's "cut here") through the panic,
/// at most 80 lines: a tail alone cuts off the header that names the fault.
fn oops(console: &str) -> String {
    const STARTS: [&str; 5] = ["------------[ cut here ]", "Oops:", "BUG:", "general protection fault", "Kernel panic"];
    let lines: Vec<&str> = console.lines().collect();
    let first = lines.iter().position(|l| STARTS.iter().any(|m| l.contains(m))).unwrap_or(0);
    lines[first..].iter().take(80).copied().collect::<Vec<_>>().join("\n")
}

fn report(run: &qemu::VmRun, elapsed: Duration) -> Result<()> {
    let text = std::fs::read_to_string(&run.results_file).unwrap_or_default();
    let mut results: Vec<TestResult> = Vec::new();
    let mut garbled = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str(line) {
            Ok(r) => results.push(r),
            Err(_) => garbled += 1,
        }
    }
    let console = std::fs::read_to_string(&run.console_file).unwrap_or_default();
    println!("\n{:<8} {:<40} {:<5} {:>7}  result", "suite", "test", "disk", "ms");
    let (mut pass, mut fail, mut skip) = (0, 0, 0);
    let mut finished = false;
    for r in &results {
        if r.test == FINISHED_TEST {
            finished = matches!(r.outcome, Outcome::Pass);
            if let Outcome::Fail(e) = &r.outcome {
                println!("{:<8} {:<40} {:<5} {:>7}  FAIL: {e}", r.suite, r.test, "-", r.millis);
                fail += 1;
            }
            continue;
        }
        let disk = r.disk.map(|d| d.to_string()).unwrap_or_else(|| "-".into());
        let verdict = match &r.outcome {
            Outcome::Pass => {
                pass += 1;
                "ok".to_owned()
            }
            Outcome::Fail(e) => {
                fail += 1;
                format!("FAIL: {e}")
            }
            Outcome::Skip(why) => {
                skip += 1;
                format!("SKIP: {why}")
            }
        };
        println!("{:<8} {:<40} {:<5} {:>7}  {verdict}", r.suite, r.test, disk, r.millis);
    }
    println!(
        "\nvmtest: {pass} passed, {fail} failed, {skip} skipped ({}, {:.0} s)",
        run.accel.name(),
        elapsed.as_secs_f64()
    );
    let tail =
        |n: usize| console.lines().rev().take(n).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    if console.contains("Kernel panic") {
        bail!("the guest kernel panicked:\n{}", oops(&console));
    }
    if run.timed_out {
        bail!("the guest did not finish within the timeout; console tail:\n{}", tail(40));
    }
    if !run.booted {
        bail!(
            "the guest never booted ({:?}); qemu said: {}\nconsole tail:\n{}",
            run.status,
            run.qemu_stderr.trim(),
            tail(40)
        );
    }
    if !finished && run.killed_on_request {
        println!(
            "(the guest was killed when it asked to be, as a host that dies: its last test reports on its peer, or after the guest boots again)"
        );
    } else if !finished {
        bail!(
            "the guest stopped before finishing its suites ({garbled} garbled result lines); console tail:\n{}",
            tail(40)
        );
    }
    if fail > 0 {
        bail!("{fail} vmtest test(s) failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::oops;

    #[test]
    fn oops_starts_at_the_report_header_not_a_tail() {
        let mut console = String::from("[    0.1] booting\n[    1.9] PDSTOR-VMINIT-START\n");
        console.push_str("[    2.0] Oops: int3: 0000 [#1] SMP NOPTI\n[    2.0] CPU: 0 UID: 0 PID: 0 Comm: swapper/0\n");
        for i in 0..60 {
            console.push_str(&format!("[    2.0] R{i}: 0\n"));
        }
        console.push_str("[    2.1] Kernel panic - not syncing: Fatal exception in interrupt\n");
        let excerpt = oops(&console);
        assert!(excerpt.starts_with("[    2.0] Oops: int3"), "{excerpt}");
        assert!(excerpt.contains("Kernel panic"), "{excerpt}");
        assert!(!excerpt.contains("booting"));
        assert_eq!(oops("no report at all\n"), "no report at all");
    }
}
