//! Files that hold what only their owner may read: timelines (receipt
//! signatures, request ids, tenants), receipts, restored KV bytes. Created
//! 0600 whatever the umask; one that already exists, is ours and lets group
//! or others in is narrowed to 0600 before anything is written to it. A
//! symbolic link at the path is not followed (`O_NOFOLLOW`), and a file of
//! another user is refused: planted in a shared directory, either would
//! send what is written to whoever planted it.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Opens `path` to write (appending, or truncating), created 0600.
pub fn open(path: &Path, append: bool) -> std::io::Result<File> {
    let mut o = File::options();
    o.create(true).mode(0o600).custom_flags(libc::O_NOFOLLOW);
    if append {
        o.append(true);
    } else {
        o.write(true).truncate(true);
    }
    let f = o.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            std::io::Error::new(
                e.kind(),
                format!(
                    "{} is a symbolic link: not followed for a file that holds receipts or KV; give the real path",
                    path.display()
                ),
            )
        } else {
            e
        }
    })?;
    let md = f.metadata()?;
    let me = nix::unistd::geteuid().as_raw();
    if md.uid() != me {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "{} belongs to uid {}, not to this process's uid {me}: it would read what is written there; give a path of your own",
                path.display(),
                md.uid()
            ),
        ));
    }
    if md.mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(f)
}

/// Writes `bytes` to `path` (replacing what was there), created 0600.
pub fn write(path: &Path, bytes: impl AsRef<[u8]>) -> std::io::Result<()> {
    open(path, false)?.write_all(bytes.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_created_0600_and_narrowed_when_ours() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = dir.path().join("fresh");
        write(&fresh, b"receipts").unwrap();
        let wide = dir.path().join("wide");
        std::fs::write(&wide, b"x").unwrap();
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o644)).unwrap();
        open(&wide, true).unwrap().write_all(b"y").unwrap();
        for p in [&fresh, &wide] {
            assert_eq!(std::fs::metadata(p).unwrap().mode() & 0o777, 0o600, "{}", p.display());
        }
        assert_eq!(std::fs::read(&wide).unwrap(), b"xy");
        // A link planted at the path is not followed, and what it points to is untouched.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        let e = open(&link, true).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read(&fresh).unwrap(), b"receipts");
    }
}
