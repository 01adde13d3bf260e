//! The guest's initramfs, assembled in Rust as a newc cpio archive: our static
//! `/init`, busybox-static and its applet links, the host tools the suites use
//! (each with the shared libraries `ldd` names), the decompressed kernel
//! modules in load order, and the guest configuration.

use std::collections::BTreeSet;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

/// Host tools copied into the guest, by the path they get there.
pub const TOOLS: &[(&str, &str)] = &[
    ("/sbin/mkfs.ext4", "mkfs.ext4"),
    ("/sbin/e2fsck", "e2fsck"),
    ("/sbin/mkfs.xfs", "mkfs.xfs"),
    ("/sbin/xfs_repair", "xfs_repair"),
    ("/sbin/nvme", "nvme"),
    ("/sbin/dmsetup", "dmsetup"),
    ("/sbin/bpftool", "bpftool"),
];

#[derive(Default)]
pub struct Archive {
    dirs: BTreeSet<String>,
    entries: Vec<Entry>,
}

enum Entry {
    File { path: String, mode: u32, data: Vec<u8> },
    Symlink { path: String, target: String },
}

impl Archive {
    fn parents(&mut self, path: &str) {
        let mut p = Path::new(path).parent();
        while let Some(dir) = p {
            let s = dir.to_string_lossy().into_owned();
            if s == "/" || s.is_empty() {
                break;
            }
            self.dirs.insert(s);
            p = dir.parent();
        }
    }

    pub fn dir(&mut self, path: &str) {
        self.parents(path);
        self.dirs.insert(path.to_owned());
    }

    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) {
        self.parents(path);
        self.entries
            .retain(|e| !matches!(e, Entry::File { path: p, .. } | Entry::Symlink { path: p, .. } if p == path));
        self.entries.push(Entry::File { path: path.to_owned(), mode, data });
    }

    pub fn host_file(&mut self, path: &str, host: &Path, mode: u32) -> Result<()> {
        let data = std::fs::read(host).with_context(|| format!("reading {} for the initramfs", host.display()))?;
        self.file(path, mode, data);
        Ok(())
    }

    pub fn symlink(&mut self, path: &str, target: &str) {
        self.parents(path);
        if self
            .entries
            .iter()
            .any(|e| matches!(e, Entry::File { path: p, .. } | Entry::Symlink { path: p, .. } if p == path))
        {
            return;
        }
        self.entries.push(Entry::Symlink { path: path.to_owned(), target: target.to_owned() });
    }

    /// Copies a dynamically linked host program and every library `ldd` names.
    pub fn program_with_libs(&mut self, sh: &Shell, path: &str, host: &Path) -> Result<()> {
        self.host_file(path, host, 0o755)?;
        let ldd = cmd!(sh, "ldd {host}").quiet().ignore_status().read().unwrap_or_default();
        for lib in ldd_paths(&ldd) {
            let real =
                std::fs::canonicalize(&lib).with_context(|| format!("resolving {lib} for {}", host.display()))?;
            self.host_file(&lib, &real, 0o755)?;
        }
        Ok(())
    }

    pub fn write(&self, out: &Path) -> Result<u64> {
        let file = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let mut w = BufWriter::new(file);
        let mut ino = 1u32;
        let strip = |p: &str| p.trim_start_matches('/').to_owned();
        for d in &self.dirs {
            let b = cpio::newc::Builder::new(&strip(d)).ino(ino).mode(0o040755).nlink(2);
            b.write(&mut w, 0).finish()?;
            ino += 1;
        }
        for e in &self.entries {
            match e {
                Entry::File { path, mode, data } => {
                    let size = u32::try_from(data.len()).context("initramfs file over 4 GiB")?;
                    let mut fw =
                        cpio::newc::Builder::new(&strip(path)).ino(ino).mode(0o100000 | mode).write(&mut w, size);
                    fw.write_all(data)?;
                    fw.finish()?;
                }
                Entry::Symlink { path, target } => {
                    let mut fw = cpio::newc::Builder::new(&strip(path))
                        .ino(ino)
                        .mode(0o120777)
                        .write(&mut w, target.len() as u32);
                    fw.write_all(target.as_bytes())?;
                    fw.finish()?;
                }
            }
            ino += 1;
        }
        cpio::newc::trailer(&mut w)?;
        w.flush()?;
        Ok(std::fs::metadata(out)?.len())
    }
}

/// Absolute library paths from `ldd` output (`lib => /path (addr)` and the
/// loader's own `/lib64/ld-linux-x86-64.so.2 (addr)` line).
pub fn ldd_paths(ldd: &str) -> Vec<String> {
    ldd.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rhs)) => rhs.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect()
}

/// Adds busybox and a link for each of its applets under `/bin`.
pub fn add_busybox(a: &mut Archive, sh: &Shell) -> Result<()> {
    let busybox = Path::new("/bin/busybox");
    if !busybox.exists() {
        bail!("/bin/busybox is missing: cargo xtask deps installs busybox-static");
    }
    a.host_file("/bin/busybox", busybox, 0o755)?;
    let list = cmd!(sh, "/bin/busybox --list").quiet().read().context("busybox --list")?;
    for applet in list.lines().map(str::trim).filter(|s| !s.is_empty() && *s != "busybox") {
        a.symlink(&format!("/bin/{applet}"), "busybox");
    }
    Ok(())
}

/// Finds a host tool on the usual sbin/bin paths.
pub fn which(tool: &str) -> Result<PathBuf> {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.exists())
        .with_context(|| format!("{tool} is not installed on the host: run cargo xtask deps"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_absolute_paths() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibuuid.so.1 => /lib/x86_64-linux-gnu/libuuid.so.1 (0x7f)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f)\n\t/lib64/ld-linux-x86-64.so.2 (0x7f)\n";
        assert_eq!(
            ldd_paths(out),
            vec![
                "/lib/x86_64-linux-gnu/libuuid.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
    }

    #[test]
    fn archive_round_trips_through_a_cpio_reader() {
        let mut a = Archive::default();
        a.file("/etc/x.json", 0o644, b"{}".to_vec());
        a.symlink("/bin/sh", "busybox");
        let out = std::env::temp_dir().join(format!("pdstor-initramfs-{}.cpio", std::process::id()));
        a.write(&out).unwrap();
        let mut r = std::fs::File::open(&out).unwrap();
        let mut names = Vec::new();
        loop {
            let e = cpio::newc::Reader::new(&mut r).unwrap();
            if e.entry().is_trailer() {
                break;
            }
            names.push((e.entry().name().to_owned(), e.entry().mode() & 0o170000));
            e.finish().unwrap();
        }
        std::fs::remove_file(out).unwrap();
        assert!(names.contains(&("etc".into(), 0o040000)));
        assert!(names.contains(&("etc/x.json".into(), 0o100000)));
        assert!(names.contains(&("bin/sh".into(), 0o120000)));
    }
}
