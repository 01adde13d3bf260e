//! The guest kernel: Debian's `linux-image-6.12.*-amd64-unsigned`, downloaded
//! with `apt-get download`, unpacked into `target/vmtest/kernel/`, its module
//! dependencies indexed with `depmod`, and its config checked against
//! `kernel-config/pd-storage.config`. Cached: a second fetch does nothing.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::{Shell, cmd};

/// A kernel ready to boot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kernel {
    pub package: String,
    pub release: String,
    pub vmlinuz: PathBuf,
    /// Unpacked package root (holds `lib/modules/<release>`), if modules come with it.
    pub root: Option<PathBuf>,
    pub config: Option<PathBuf>,
}

pub fn cache_dir() -> PathBuf {
    crate::project_root().join("target/vmtest/kernel")
}

/// The newest `linux-image-6.12.N+debX-amd64-unsigned` apt knows.
fn newest_package(sh: &Shell) -> Result<Option<String>> {
    let names = cmd!(sh, "apt-cache pkgnames linux-image-6.12.").quiet().ignore_stderr().read().unwrap_or_default();
    let mut candidates: Vec<(Vec<u64>, String)> = names
        .lines()
        .filter(|n| n.ends_with("-amd64-unsigned") && !n.contains("-cloud-") && !n.contains("-rt-"))
        .filter_map(|n| {
            let ver = n.strip_prefix("linux-image-")?.split('+').next()?;
            let key = ver.split('.').map(|p| p.parse().ok()).collect::<Option<Vec<u64>>>()?;
            Some((key, n.to_owned()))
        })
        .collect();
    candidates.sort();
    Ok(candidates.pop().map(|(_, n)| n))
}

pub fn fetch(sh: &Shell) -> Result<Kernel> {
    let dir = cache_dir();
    let manifest = dir.join("kernel.json");
    if let Ok(text) = std::fs::read_to_string(&manifest)
        && let Ok(k) = serde_json::from_str::<Kernel>(&text)
        && k.vmlinuz.exists()
    {
        return Ok(k);
    }
    let package = match newest_package(sh)? {
        Some(p) => p,
        None => {
            cmd!(sh, "apt-get update -qq").run().context("apt-get update")?;
            newest_package(sh)?.context(
                "apt knows no linux-image-6.12.*-amd64-unsigned package: is this Debian 12 with bookworm-backports or security updates in its sources?",
            )?
        }
    };
    let download = dir.join("download");
    let root = dir.join("root");
    let _ = std::fs::remove_dir_all(&download);
    let _ = std::fs::remove_dir_all(&root);
    sh.create_dir(&download)?;
    sh.create_dir(&root)?;
    {
        let _cd = sh.push_dir(&download);
        cmd!(sh, "apt-get download -q -o APT::Sandbox::User=root {package}")
            .quiet()
            .run()
            .with_context(|| format!("apt-get download {package}"))?;
    }
    let deb = std::fs::read_dir(&download)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download {package} left no .deb in {}", download.display()))?;
    cmd!(sh, "dpkg-deb -x {deb} {root}").run().context("unpacking the kernel package")?;
    let release = std::fs::read_dir(root.join("lib/modules"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .context("the kernel package has no lib/modules/<release>")?;
    cmd!(sh, "/usr/sbin/depmod -b {root} {release}").run().context("depmod on the guest modules")?;
    let kernel = Kernel {
        package,
        vmlinuz: root.join(format!("boot/vmlinuz-{release}")),
        config: Some(root.join(format!("boot/config-{release}"))),
        root: Some(root),
        release,
    };
    std::fs::remove_dir_all(&download).ok();
    std::fs::write(&manifest, serde_json::to_string_pretty(&kernel)?)?;
    Ok(kernel)
}

/// Options of `fragment` the kernel config lacks (neither `=y` nor `=m`).
pub fn missing_options(config: &Path, fragment: &Path) -> Result<Vec<String>> {
    let have = std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let want = std::fs::read_to_string(fragment).with_context(|| format!("reading {}", fragment.display()))?;
    Ok(want
        .lines()
        .filter_map(|l| l.trim().split_once('='))
        .filter(|(opt, _)| opt.starts_with("CONFIG_"))
        .filter(|(opt, _)| !have.lines().any(|h| h == format!("{opt}=y") || h == format!("{opt}=m")))
        .map(|(opt, _)| opt.to_owned())
        .collect())
}

pub fn check(kernel: &Kernel, fragment: &Path) -> Result<()> {
    let Some(config) = &kernel.config else {
        println!("kernel check: no config beside {}; skipping", kernel.vmlinuz.display());
        return Ok(());
    };
    let missing = missing_options(config, fragment)?;
    if !missing.is_empty() {
        bail!("kernel {} lacks {}: {}", kernel.release, fragment.display(), missing.join(", "));
    }
    Ok(())
}

/// The module files (in load order) that provide `names`, from `modprobe
/// --show-depends` against the unpacked package. Built-in ones need nothing.
pub fn module_order(sh: &Shell, kernel: &Kernel, names: &[&str]) -> Result<Vec<PathBuf>> {
    let Some(root) = &kernel.root else {
        return Ok(Vec::new());
    };
    let release = &kernel.release;
    let mut order: Vec<PathBuf> = Vec::new();
    for name in names {
        let out = cmd!(sh, "/usr/sbin/modprobe -d {root} -S {release} --show-depends {name}")
            .quiet()
            .read()
            .with_context(|| format!("resolving module {name} in {}", root.display()))?;
        for line in out.lines() {
            if let Some(path) = line.trim().strip_prefix("insmod ") {
                let p = PathBuf::from(path.trim());
                if !order.contains(&p) {
                    order.push(p);
                }
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_options_lists_what_is_neither_y_nor_m() {
        let dir = std::env::temp_dir().join(format!("pdstor-kcheck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("config");
        let frag = dir.join("frag");
        std::fs::write(&config, "CONFIG_A=y\nCONFIG_B=m\n# CONFIG_C is not set\nCONFIG_D=n\n").unwrap();
        std::fs::write(&frag, "# comment\nCONFIG_A=y\nCONFIG_B=y\nCONFIG_C=y\nCONFIG_D=m\n").unwrap();
        assert_eq!(missing_options(&config, &frag).unwrap(), vec!["CONFIG_C", "CONFIG_D"]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
