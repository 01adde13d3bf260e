//! Fresh roots nobody runs any more, given back before a long run checks its
//! room on disk.
//!
//! `cargo xtask fresh` lays a whole Debian root out under
//! `~/.cache/pdstor/fresh/run-<pid>/` (36 GiB at its largest) and removes it
//! when the run ends. A run that is killed instead (a session stopped
//! mid-run, a lost terminal) leaves it behind, and the next `cargo xtask ci`
//! on that disk found 11.7 GiB free and refused to start. Such a root is
//! garbage by construction: its run is gone and nothing else uses it.
//!
//! A run holds an exclusive `flock` on `run-<pid>/lock` for its whole life,
//! inherited by every process it starts (the descriptor is not close-on-exec),
//! so a root is stale when that lock can be taken: its run and all of its
//! children have exited, however they ended — unless process `<pid>` is an
//! xtask still running (a run between creating its lock file and taking it;
//! a root laid out before runs took the lock is judged by that alone). A root kept on
//! purpose (`--keep`, marked `kept`) or with a mount still under it is never
//! touched; the refusal that follows names it.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The lock a fresh run holds on its root until it and every process it
/// started have exited.
pub struct RunLock {
    _file: File,
}

/// Takes `dir/lock` for a run that is starting, shared with the processes it
/// will start.
pub fn lock_run(dir: &Path) -> Result<RunLock> {
    let path = dir.join("lock");
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    if !try_lock(&file) {
        anyhow::bail!("{} is locked by another run: each run lays out its own root", path.display());
    }
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is an open descriptor owned by `file`; F_GETFD/F_SETFD only
    // change its close-on-exec flag.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) == 0
    };
    if !cleared {
        let err = std::io::Error::last_os_error();
        return Err(err).with_context(|| format!("letting the run's processes inherit {}", path.display()));
    }
    Ok(RunLock { _file: file })
}

/// Whether an exclusive `flock` on `file` was taken without waiting.
fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a descriptor `file` owns; LOCK_NB never blocks.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Marks a run's root as kept on purpose: never reclaimed.
pub fn mark_kept(dir: &Path) -> Result<()> {
    let path = dir.join("kept");
    std::fs::write(&path, "kept by `cargo xtask fresh --keep`: remove this directory by hand\n")
        .with_context(|| format!("writing {}", path.display()))
}

/// Why a run's root under `fresh/` is not reclaimed, or `None` if it is stale.
fn kept_because(dir: &Path) -> Option<String> {
    if dir.join("kept").exists() {
        return Some("kept on purpose (--keep)".into());
    }
    let mounts = mounts_under(dir);
    if !mounts.is_empty() {
        return Some(format!("still mounted: {}", mounts.join(", ")));
    }
    if let Ok(lock) = File::options().write(true).open(dir.join("lock"))
        && !try_lock(&lock)
    {
        return Some("its run is still going".into());
    }
    // No lock file, or a free one: stale unless `<pid>` is an xtask still
    // running (a root laid out before runs took the lock, or a run between
    // creating its lock file and taking it).
    let pid = dir.file_name()?.to_str()?.strip_prefix("run-")?;
    let cmdline = std::fs::read(Path::new("/proc").join(pid).join("cmdline")).ok()?;
    let argv0 = cmdline.split(|b| *b == 0).next().unwrap_or_default();
    let name = argv0.rsplit(|b| *b == b'/').next().unwrap_or_default();
    name.starts_with(b"xtask").then(|| format!("process {pid} is an xtask still running"))
}

/// Removes every stale fresh root under `fresh_dir`, saying what it freed and
/// what it left; returns the roots removed.
pub fn stale_fresh_roots(fresh_dir: &Path) -> Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(fresh_dir) else { return Ok(Vec::new()) };
    let mut removed = Vec::new();
    for entry in entries {
        let dir = entry.with_context(|| format!("listing {}", fresh_dir.display()))?.path();
        let is_run = dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("run-"));
        if !is_run || !dir.is_dir() {
            continue;
        }
        if let Some(why) = kept_because(&dir) {
            println!("reclaim    left {}: {why}", dir.display());
            continue;
        }
        std::fs::remove_dir_all(&dir)
            .with_context(|| format!("removing the stale fresh root {} (its run has exited)", dir.display()))?;
        println!("reclaim    removed {}: its run had exited without removing it", dir.display());
        removed.push(dir);
    }
    Ok(removed)
}

/// [`stale_fresh_roots`] under `~/.cache/pdstor/fresh`.
pub fn before_a_long_run() -> Result<()> {
    stale_fresh_roots(&cache_dir()?).map(drop)
}

/// Where `cargo xtask fresh` keeps its Debian root and its runs:
/// `~/.cache/pdstor/fresh`.
pub fn cache_dir() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set: cannot find ~/.cache/pdstor")?;
    Ok(PathBuf::from(home).join(".cache/pdstor/fresh"))
}

/// Mount points under `dir` in this (the host's) mount namespace.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(parent: &Path, name: &str) -> PathBuf {
        let dir = parent.join(name);
        std::fs::create_dir_all(dir.join("root/usr/bin")).expect("mkdir");
        std::fs::write(dir.join("root/usr/bin/tool"), b"payload").expect("write");
        dir
    }

    // One test, not two: a child spawned by a test running beside it would
    // inherit this one's lock descriptors and hold its roots.
    #[test]
    fn only_roots_whose_run_and_children_have_exited_are_removed() {
        roots_of_exited_runs_go_the_others_stay();
        a_child_process_keeps_the_root_of_a_run_whose_parent_is_gone();
    }

    fn roots_of_exited_runs_go_the_others_stay() {
        let fresh = tempfile::tempdir().expect("tempdir");
        // A root whose run holds its lock (this process), one kept on
        // purpose, one of a live xtask without a lock file (this test
        // binary, named xtask-<hash>: hence the pid of `cargo xtask` itself
        // would be kept too), one of an exited run (lock free), one of a pid
        // that cannot exist, one of a live process that is not an xtask.
        let live = root(fresh.path(), "run-live");
        let held = lock_run(&live).expect("lock");
        let kept = root(fresh.path(), "run-kept");
        mark_kept(&kept).expect("mark");
        let old_live = root(fresh.path(), &format!("run-{}", std::process::id()));
        let exited = root(fresh.path(), "run-exited");
        drop(lock_run(&exited).expect("lock"));
        let old_dead = root(fresh.path(), "run-4294967295");
        let not_xtask = root(fresh.path(), "run-1");
        let other = fresh.path().join("root-trixie.tar");
        std::fs::write(&other, b"tarball").expect("write");

        let removed = stale_fresh_roots(fresh.path()).expect("reclaim");
        let mut removed: Vec<_> = removed.iter().map(|p| p.file_name().expect("name").to_owned()).collect();
        removed.sort();
        assert_eq!(removed, ["run-1", "run-4294967295", "run-exited"]);
        assert!(!exited.exists() && !old_dead.exists() && !not_xtask.exists());
        for stays in [&live, &kept, &old_live, &other] {
            assert!(stays.exists(), "{} was removed", stays.display());
        }
        // A second run cannot take a root whose run is going, and once that
        // run ends its root goes too.
        assert!(lock_run(&live).is_err());
        drop(held);
        assert_eq!(stale_fresh_roots(fresh.path()).expect("reclaim"), vec![live.clone()]);
    }

    fn a_child_process_keeps_the_root_of_a_run_whose_parent_is_gone() {
        let fresh = tempfile::tempdir().expect("tempdir");
        let dir = root(fresh.path(), "run-parent");
        let lock = lock_run(&dir).expect("lock");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        drop(lock);
        assert!(stale_fresh_roots(fresh.path()).expect("reclaim").is_empty(), "the child still holds the lock");
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(stale_fresh_roots(fresh.path()).expect("reclaim"), vec![dir]);
    }
}
