//! The GPU bundle run where nothing of ours is: a bare Debian root (minbase
//! and Debian's `python3`, no Rust, no cargo cache, no compiler) entered with
//! no network, no GPU, and the Python environment a GPU machine's Python
//! stands for (the cached test environment: torch, no pdstor on the path the
//! bundle uses), mounted read-only. `run.sh` is called exactly as on the GPU
//! machine; its report must hold every rung, the GPU rungs each SKIP with
//! "no CUDA device", and every other rung PASS.

use std::path::Path;

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

/// What the bare root holds beyond minbase: the shell and Python a GPU
/// machine has (minbase brings libstdc++ with apt, which torch needs).
const PACKAGES: &str = "python3";

/// The rungs that need a GPU: in the bare root each must SKIP, saying so.
pub const GPU_RUNGS: &[&str] = &["engine-cuda", "dmabuf-export", "ladder-gpu", "kv-cuda", "throughput"];

/// The rungs that need none: in the bare root each must PASS.
pub const CPU_RUNGS: &[&str] = &["bundle", "facts", "daemon", "kv-cpu"];

pub fn run(sh: &Shell, archive: &Path) -> Result<()> {
    if !crate::deps::is_root(sh) {
        bail!("the bare-root run of the GPU bundle needs root: it builds a Debian root, mounts and chroots into it");
    }
    let tarball = crate::fresh::debian_root(sh, "python3", PACKAGES, false)?;
    let venv = crate::python::venv(sh)?;
    let work = crate::fresh::roots_dir()?.join(format!("gpu-bare-{}", std::process::id()));
    let root = work.join("root");
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    cmd!(sh, "tar -xf {tarball} -C {root}").run().context("laying out the bare root")?;
    for tool in ["cargo", "rustc", "gcc", "cc"] {
        if root.join("usr/bin").join(tool).exists() {
            bail!("the bare root has {tool}: it must hold no toolchain");
        }
    }
    std::fs::copy(archive, root.join("bundle.tar.gz")).context("copying the bundle into the root")?;
    let script = inner_script(&root, &venv);
    let status = std::process::Command::new("unshare")
        .args(["--mount", "--net", "--propagation", "private", "--", "/bin/sh", "-c", &script])
        .status()
        .context("unshare --mount --net: entering a private mount and network namespace")?;
    let report = root.join("root/out/report.json");
    let text = std::fs::read_to_string(&report);
    let left = crate::reclaim::mounts_under(&work);
    if left.is_empty() {
        let _ = std::fs::remove_dir_all(&work);
    } else {
        println!("gpu-bundle: not removing {}: still mounted: {}", work.display(), left.join(", "));
    }
    let text = text.with_context(|| format!("run.sh wrote no {} (exit {status})", report.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text).context("parsing the bare run's report.json")?;
    check_report(&value)?;
    println!("gpu-bundle: the bundle ran in a bare root (no Rust, no network, no GPU): every rung as expected");
    Ok(())
}

/// Mounts what a machine has (proc, sys, dev, a tmpfs /tmp) and the Python
/// environment, then runs `run.sh` as a GPU machine's user would.
fn inner_script(root: &Path, venv: &Path) -> String {
    format!(
        r#"set -eu
R={r}
mount --make-rprivate /
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
mount -t devtmpfs devtmpfs "$R/dev"
mkdir -p "$R/dev/shm" "$R/opt/machine-python"
mount -t tmpfs tmpfs "$R/dev/shm"
mount -t tmpfs tmpfs "$R/tmp"
mount --bind {venv} "$R/opt/machine-python"
mount -o remount,bind,ro "$R/opt/machine-python"
chroot "$R" /usr/bin/env -i HOME=/root TERM=dumb PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHON=/opt/machine-python/bin/python3 \
    /bin/sh -c 'cd /root && tar -xzf /bundle.tar.gz && ./pdstor-gpu-bundle/run.sh /root/out'
"#,
        r = root.display(),
        venv = venv.display(),
    )
}

/// Every rung reported; GPU rungs SKIP with "no CUDA device"; the rest PASS.
pub fn check_report(report: &serde_json::Value) -> Result<()> {
    let rungs = report["rungs"].as_array().context("report.json has no rungs")?;
    let find = |id: &str| rungs.iter().find(|r| r["id"] == id);
    let mut wrong = Vec::new();
    for id in CPU_RUNGS {
        match find(id) {
            Some(r) if r["status"] == "PASS" => {}
            Some(r) => wrong.push(format!("{id}: {} ({})", r["status"], r["reason"])),
            None => wrong.push(format!("{id}: not reported")),
        }
    }
    for id in GPU_RUNGS {
        match find(id) {
            Some(r) if r["status"] == "SKIP" && r["reason"].as_str().is_some_and(|s| s.contains("no CUDA device")) => {}
            Some(r) => wrong.push(format!("{id}: {} ({}), expected SKIP: no CUDA device", r["status"], r["reason"])),
            None => wrong.push(format!("{id}: not reported")),
        }
    }
    let known: Vec<&str> = CPU_RUNGS.iter().chain(GPU_RUNGS).copied().collect();
    for r in rungs {
        if !r["id"].as_str().is_some_and(|id| known.contains(&id)) {
            wrong.push(format!("{}: a rung this check does not know", r["id"]));
        }
    }
    if !wrong.is_empty() {
        bail!("the bundle's bare run reported wrongly:\n  {}", wrong.join("\n  "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(status: &[(&str, &str, &str)]) -> serde_json::Value {
        let rungs: Vec<serde_json::Value> =
            status.iter().map(|(id, s, why)| serde_json::json!({"id": id, "status": s, "reason": why})).collect();
        serde_json::json!({ "rungs": rungs })
    }

    fn expected() -> Vec<(&'static str, &'static str, &'static str)> {
        let mut v: Vec<_> = CPU_RUNGS.iter().map(|id| (*id, "PASS", "")).collect();
        v.extend(GPU_RUNGS.iter().map(|id| (*id, "SKIP", "no CUDA device: libcuda.so is not installed")));
        v
    }

    #[test]
    fn a_bare_report_as_expected_passes() {
        check_report(&report(&expected())).unwrap();
    }

    #[test]
    fn a_missing_failed_or_wrongly_skipped_rung_is_caught() {
        let mut missing = expected();
        missing.retain(|r| r.0 != "kv-cpu");
        assert!(check_report(&report(&missing)).unwrap_err().to_string().contains("kv-cpu: not reported"));
        let mut failed = expected();
        failed[1] = ("facts", "FAIL", "crashed");
        assert!(check_report(&report(&failed)).is_err());
        let mut skipped = expected();
        let last = skipped.len() - 1;
        skipped[last].2 = "out of time";
        assert!(check_report(&report(&skipped)).unwrap_err().to_string().contains("expected SKIP"));
    }
}
