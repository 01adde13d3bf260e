//! `cargo xtask fresh`: README's two commands on a fresh machine, on demand.
//!
//! A developer's machine hides what a new user lacks (packages installed by
//! hand, tracefs mounted, files left in `target/`). This verb builds a bare
//! Debian root of this machine's release with `mmdebstrap --variant=minbase`
//! plus what every machine of this project's kind has before anyone touches it
//! (a C compiler for the linker, git, CA certificates), caches it as a tarball
//! under `~/.cache/pdstor/fresh/`, and lays it out anew for every run. It
//! bind-mounts the host's Rust toolchain read-only (and, where the host has
//! it, the kernel patch series beside the checkout, an input like a kernel
//! package) and nothing else, enters
//! the root in a private mount namespace with fresh `/proc`, `/sys` (so no
//! tracefs, no bpffs) and a devtmpfs `/dev` (loop control, `/dev/kvm` and zram
//! control as on the host), clones `HEAD` into it and runs README's commands
//! exactly as written. It prints each command's wall time and result and
//! fails if either failed.

use crate::reclaim;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

/// Packages a machine of this kind has before the project touches it, on top
/// of `minbase`: rustc needs a linker (`cc`) and libc's static archives, the
/// clone needs git, the registries need the CA bundle (replaced by the host's).
const BASE_PACKAGES: &str = "gcc,libc6-dev,git,ca-certificates";

/// README's two commands, in README's order.
const README_COMMANDS: &[&str] = &["demo", "ci"];

#[derive(clap::Args)]
pub struct FreshArgs {
    /// Which of README's commands to run, comma-separated: demo, ci (default: both, in that order).
    #[arg(long = "run", value_delimiter = ',', value_parser = ["demo", "ci"])]
    run: Vec<String>,
    /// Build the Debian root again instead of using the cached tarball.
    #[arg(long)]
    rebuild_root: bool,
    /// Keep the laid-out root after the run (its path is printed), e.g. to read target/ logs.
    #[arg(long)]
    keep: bool,
}

/// A whole fresh run's root at its largest (the CI in it: target, venvs,
/// kernel build, guest images), measured at 36 GiB on 2026-12-06.
const FRESH_NEEDS_GIB: u64 = 40;

/// This machine's Debian codename, from `/etc/os-release`.
fn codename() -> Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|c| c.trim_matches('"').to_owned())
        .filter(|c| !c.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME: `cargo xtask fresh` needs a Debian host")
}

/// The host's rustup home and cargo bin directory (what is bind-mounted).
fn toolchain() -> Result<(PathBuf, PathBuf)> {
    let home = PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?);
    let rustup = std::env::var_os("RUSTUP_HOME").map_or_else(|| home.join(".rustup"), PathBuf::from);
    let cargo_home = std::env::var_os("CARGO_HOME").map_or_else(|| home.join(".cargo"), PathBuf::from);
    let bin = cargo_home.join("bin");
    if !rustup.join("toolchains").is_dir() || !bin.join("cargo").exists() {
        bail!(
            "no rustup toolchain found at {} with cargo in {}: `cargo xtask fresh` bind-mounts the host's \
             rustup installation (set RUSTUP_HOME / CARGO_HOME if it lives elsewhere)",
            rustup.display(),
            bin.display()
        );
    }
    Ok((rustup, bin))
}

/// Makes sure a host tool is there, installing its Debian package if not.
fn host_tool(sh: &Shell, tool: &str, package: &str) -> Result<()> {
    if cmd!(sh, "which {tool}").quiet().ignore_stdout().ignore_stderr().run().is_ok() {
        return Ok(());
    }
    println!("fresh: installing {package} on the host (for {tool})");
    cmd!(sh, "apt-get install -y -qq --no-install-recommends {package}")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .run()
        .with_context(|| format!("installing {package}: `cargo xtask fresh` needs {tool} on the host"))
}

/// The cached root tarball, built when missing (or when asked to).
fn root_tarball(sh: &Shell, rebuild: bool) -> Result<PathBuf> {
    debian_root(sh, "minbase", BASE_PACKAGES, rebuild)
}

/// A minbase Debian root of this machine's release with `packages`, as a
/// tarball cached under `~/.cache/pdstor/fresh/` by `name` (made with
/// mmdebstrap when missing, or when asked to).
pub(crate) fn debian_root(sh: &Shell, name: &str, packages: &str, rebuild: bool) -> Result<PathBuf> {
    let release = codename()?;
    let dir = reclaim::cache_dir()?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let tarball = dir.join(format!("debian-{release}-{name}.tar"));
    if tarball.exists() && !rebuild {
        println!("fresh: Debian root from the cache: {}", tarball.display());
        return Ok(tarball);
    }
    host_tool(sh, "mmdebstrap", "mmdebstrap")?;
    let partial = dir.join(format!("debian-{release}-{name}.tar.partial"));
    let started = Instant::now();
    println!("fresh: building a minbase {release} root with {packages} (mmdebstrap)");
    cmd!(sh, "mmdebstrap --quiet --format=tar --variant=minbase --include={packages} {release} {partial}")
        .run()
        .with_context(|| format!("mmdebstrap {release}: building the root {name} failed"))?;
    std::fs::rename(&partial, &tarball).with_context(|| format!("moving the root to {}", tarball.display()))?;
    println!("fresh: root built in {:.0} s, cached at {}", started.elapsed().as_secs_f64(), tarball.display());
    Ok(tarball)
}

/// Where the cached roots and their runs live.
pub(crate) fn roots_dir() -> Result<PathBuf> {
    reclaim::cache_dir()
}

/// The kernel patch series CI builds its second guest kernel from is an input
/// beside the checkout, like a downloaded kernel package, not part of the
/// repository: when the host has it, it appears read-only at the same place
/// beside the fresh clone (`/root/shared/kernel-series`).
fn series_mount() -> String {
    let host = crate::project_root().join("../shared/kernel-series");
    match host.canonicalize() {
        Ok(dir) if dir.is_dir() => format!(
            "mkdir -p \"$R/root/shared/kernel-series\"\nmount --bind {d} \"$R/root/shared/kernel-series\"\nmount -o remount,bind,ro \"$R/root/shared/kernel-series\"\n",
            d = dir.display()
        ),
        _ => String::new(),
    }
}

/// What runs inside the private mount namespace: mount the pseudo-filesystems
/// and the toolchain, then chroot and run README's commands, timing each.
fn inner_script(root: &Path, rustup: &Path, cargo_bin: &Path, commands: &[String]) -> String {
    let r = root.display();
    let mut s = format!(
        r#"set -eu
R={r}
mount --make-rprivate /
# The root is a mount point, as / is on a real machine (unshare and mount
# --make-private inside need one).
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t devtmpfs devtmpfs "$R/dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$R/dev/pts"
mount -t tmpfs tmpfs "$R/dev/shm"
mount -t tmpfs tmpfs "$R/run"
mkdir -p "$R/opt/rust/rustup" "$R/opt/rust/bin"
mount --bind {rustup} "$R/opt/rust/rustup"
mount -o remount,bind,ro "$R/opt/rust/rustup"
mount --bind {bin} "$R/opt/rust/bin"
mount -o remount,bind,ro "$R/opt/rust/bin"
{series}status=0
"#,
        rustup = rustup.display(),
        bin = cargo_bin.display(),
        series = series_mount(),
    );
    for c in commands {
        s += &format!(
            r#"start=$(date +%s)
echo "fresh: ==> cargo xtask {c}"
if chroot "$R" /usr/bin/env -i HOME=/root TERM=dumb RUSTUP_HOME=/opt/rust/rustup \
    PATH=/opt/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c 'cd /root/pdstor && cargo xtask {c}'; then rc=0; else rc=$?; fi
echo "fresh: RESULT cargo xtask {c}: rc=$rc wall=$(( $(date +%s) - start ))s"
[ "$rc" -eq 0 ] || status=1
"#
        );
    }
    s += "exit $status\n";
    s
}

pub fn run(sh: &Shell, args: &FreshArgs) -> Result<()> {
    if !crate::deps::is_root(sh) {
        bail!("`cargo xtask fresh` needs root: it builds a Debian root, mounts and chroots into it");
    }
    let commands: Vec<String> =
        if args.run.is_empty() { README_COMMANDS.iter().map(|c| (*c).to_owned()).collect() } else { args.run.clone() };
    let (rustup, cargo_bin) = toolchain()?;
    std::fs::create_dir_all(reclaim::cache_dir()?).context("creating ~/.cache/pdstor/fresh")?;
    reclaim::before_a_long_run()?;
    crate::disk::require(&[&reclaim::cache_dir()?], FRESH_NEEDS_GIB)?;
    let tarball = root_tarball(sh, args.rebuild_root)?;

    let work = reclaim::cache_dir()?.join(format!("run-{}", std::process::id()));
    let root = work.join("root");
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let _lock = reclaim::lock_run(&work)?;
    if args.keep {
        reclaim::mark_kept(&work)?;
    }
    let laid = Instant::now();
    cmd!(sh, "tar -xf {tarball} -C {root}").run().context("laying out the fresh root")?;
    // What makes the registries answer here: the host's resolver and CA bundle.
    std::fs::copy("/etc/resolv.conf", root.join("etc/resolv.conf")).context("copying /etc/resolv.conf")?;
    std::fs::copy("/etc/ssl/certs/ca-certificates.crt", root.join("etc/ssl/certs/ca-certificates.crt"))
        .context("copying the host's CA bundle")?;
    let clone = root.join("root/pdstor");
    let project = crate::project_root();
    cmd!(sh, "git clone --quiet --no-hardlinks {project} {clone}").run().context("cloning HEAD into the root")?;
    let format = "--format=%h %s";
    let head = cmd!(sh, "git -C {clone} log -1 {format}").quiet().read().unwrap_or_default();
    println!("fresh: root laid out in {:.1} s; clone of HEAD: {head}", laid.elapsed().as_secs_f64());

    let script = inner_script(&root, &rustup, &cargo_bin, &commands);
    let started = Instant::now();
    let mut child = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "/bin/sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("unshare --mount: entering a private mount namespace")?;
    // Stream the run and keep the result lines for the summary.
    let mut results = Vec::new();
    if let Some(out) = child.stdout.take() {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines() {
            let line = line.context("reading the fresh run's output")?;
            println!("{line}");
            if let Some(r) = line.strip_prefix("fresh: RESULT ") {
                results.push(r.to_owned());
            }
        }
    }
    let status = child.wait().context("waiting for the fresh run")?;
    let total = started.elapsed().as_secs_f64();

    let left = reclaim::mounts_under(&work);
    if args.keep || !left.is_empty() {
        if !left.is_empty() {
            println!("fresh: not removing {}: still mounted here: {}", work.display(), left.join(", "));
        }
        println!("fresh: the root is kept at {}", root.display());
    } else {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }

    println!("\nfresh: README's commands on a bare {} root with only the Rust toolchain:", codename()?);
    for r in &results {
        println!("  {r}");
    }
    println!("  total {total:.0} s");
    if !status.success() || results.len() != commands.len() {
        bail!("fresh: a README command failed on a fresh machine (see above)");
    }
    Ok(())
}
