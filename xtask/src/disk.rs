//! Room on disk, checked before a long run rather than discovered by a
//! linker's bus error half an hour in.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use anyhow::{Context, Result, bail};

const GIB: u64 = 1 << 30;

/// What `cargo xtask ci` needs free where it writes, measured: the
/// workspace's target grows by up to 6 GiB, a Python test run writes up to
/// 4 GiB under /tmp, and guests and kernels stage their images beside them.
pub const CI_NEEDS_GIB: u64 = 12;

/// Fails unless where `cargo xtask ci` writes — the workspace, /tmp,
/// ~/.cache — has [`CI_NEEDS_GIB`] free.
pub fn require_for_ci() -> Result<()> {
    let home_cache = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"));
    let root = crate::project_root();
    let mut places = vec![root.as_path(), Path::new("/tmp")];
    places.extend(home_cache.as_deref());
    require(&places, CI_NEEDS_GIB)
}

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
pub fn available(path: &Path) -> Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .with_context(|| format!("{}: a path with a NUL byte", path.display()))?;
    // SAFETY: `statvfs` is plain old data; all-zero is a valid value for it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st`
    // is a valid, writable statvfs the kernel fills in.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        let err = std::io::Error::last_os_error();
        return Err(err).with_context(|| format!("statvfs {}", path.display()));
    }
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Fails, naming each place and what it has, unless every one of `places`
/// has `need_gib` GiB free.
pub fn require(places: &[&Path], need_gib: u64) -> Result<()> {
    let mut short = Vec::new();
    for place in places.iter().filter(|p| p.exists()) {
        let free = available(place)?;
        println!("disk       {:>6.1} GiB free at {}", free as f64 / GIB as f64, place.display());
        if free < need_gib * GIB {
            short.push(format!("{} ({:.1} GiB free)", place.display(), free as f64 / GIB as f64));
        }
    }
    if !short.is_empty() {
        bail!(
            "not enough disk for this run: it needs {need_gib} GiB free and {} has less. \
             Free some first: a kept `cargo xtask fresh --keep` root under ~/.cache/pdstor/fresh/run-*, \
             old pytest runs under /tmp/pytest-of-*, or `cargo clean`",
            short.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_real_filesystem_has_some_room_and_an_impossible_need_is_refused() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert!(available(here).expect("statvfs") > 0);
        let err = require(&[here], u64::MAX / GIB).expect_err("no disk has 16 EiB free");
        let text = format!("{err:#}");
        assert!(text.contains("not enough disk") && text.contains(&here.display().to_string()), "{text}");
        require(&[here], 0).expect("any disk has 0 GiB free");
    }
}
