//! What the daemon checks before it exposes anything: a target other users
//! cannot read, sockets in a directory of its own with mode 0600, a socket
//! path that does not replace someone else's file, and no plaintext TCP
//! beyond loopback unless asked for by name.
//!
//! This module does not authenticate callers; it keeps the daemon's own
//! files and addresses from being open to users who should not reach them.

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The directory the daemon's sockets live in by default: `/run/pdstor` for
/// root; the user's runtime directory (`$XDG_RUNTIME_DIR/pdstor`) otherwise,
/// or a 0700 directory of the user's own under the temporary directory.
pub fn default_runtime_dir() -> PathBuf {
    let uid = nix::unistd::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/pdstor");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("pdstor"),
        _ => std::env::temp_dir().join(format!("pdstor-{uid}")),
    }
}

/// The data plane's socket when none is given: `data.sock` in
/// [`default_runtime_dir`] — never a shared, world-writable place.
pub fn default_data_socket() -> PathBuf {
    default_runtime_dir().join("data.sock")
}

/// The control plane's socket when none is given: `control.sock` in
/// [`default_runtime_dir`].
pub fn default_control_socket() -> PathBuf {
    default_runtime_dir().join("control.sock")
}

/// The client's default `--server`: `unix:` and [`default_control_socket`].
pub fn default_server() -> String {
    format!("unix:{}", default_control_socket().display())
}

/// Sets up one socket path: its directory (created 0750, or checked), the
/// path itself (a stale socket removed, anything else refused), and after
/// `bind` its mode (0600, or 0660 for `group`, which also gets a directory
/// this daemon created).
pub fn bind_socket<T>(
    path: &Path,
    group: Option<u32>,
    bind: impl FnOnce(&Path) -> std::io::Result<T>,
) -> anyhow::Result<T> {
    let created = socket_dir(path)?;
    claim_socket_path(path)?;
    let bound = bind(path).with_context(|| format!("listening on {}", path.display()))?;
    restrict_socket(path, group)?;
    if let Some(g) = group {
        share_socket_dir(path, g, created)?;
    }
    Ok(bound)
}

/// Creates the directory a socket goes in when it does not exist (mode
/// 0750), and refuses one that whoever else could swap or write into:
/// whoever can write there can replace the socket. The directory itself must
/// not be a symbolic link (it is looked at with `O_NOFOLLOW`: a link another
/// user made in a shared place would send the sockets where they chose); it,
/// and every directory above it, must belong to this user or root and be
/// writable by no one else — group included — unless sticky (`/tmp`: others
/// cannot rename what is ours there). Answers whether it created the
/// directory.
pub fn socket_dir(socket: &Path) -> anyhow::Result<bool> {
    let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) else { return Ok(false) };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty() && p.exists()) {
                safe_ancestors(parent, dir)?;
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(dir)
                .with_context(|| format!("creating the socket directory {}", dir.display()))?;
            // Made by us just now, unless someone raced us to the name: look again.
            socket_dir_itself(dir)?;
            return Ok(true);
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        Ok(_) => {}
    }
    socket_dir_itself(dir)?;
    safe_ancestors(dir, dir)?;
    Ok(false)
}

/// The socket directory, opened with `O_NOFOLLOW`: a real directory of this
/// user or root that no one else may write to.
fn socket_dir_itself(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) || e.raw_os_error() == Some(libc::ENOTDIR) {
                let to = std::fs::read_link(dir).map(|t| format!(" (to {})", t.display())).unwrap_or_default();
                anyhow::anyhow!(
                    "the socket directory {} is a symbolic link{to} or not a directory: whoever made it chooses where the sockets go; give a real directory of this user's",
                    dir.display()
                )
            } else {
                anyhow::Error::new(e).context(format!("opening the socket directory {}", dir.display()))
            }
        })?;
    let md = f.metadata().with_context(|| format!("reading {}", dir.display()))?;
    writable_only_by_us(dir, &md, "socket directory")
}

/// Every directory above `dir` (resolved), and `dir` itself, must be safe
/// from other users: see [`socket_dir`]. `shown` names the socket directory.
fn safe_ancestors(dir: &Path, shown: &Path) -> anyhow::Result<()> {
    let real = std::fs::canonicalize(dir).with_context(|| format!("resolving {}", dir.display()))?;
    for a in real.ancestors() {
        let md = std::fs::metadata(a).with_context(|| format!("reading {}", a.display()))?;
        writable_only_by_us(a, &md, &format!("directory above the socket directory {}", shown.display()))?;
    }
    Ok(())
}

/// Refuses a directory of another user (not root), or one that group or
/// others can write to without the sticky bit.
fn writable_only_by_us(dir: &Path, md: &std::fs::Metadata, what: &str) -> anyhow::Result<()> {
    let me = nix::unistd::geteuid().as_raw();
    if md.uid() != me && md.uid() != 0 {
        bail!(
            "the {what} {} belongs to uid {}, not to this daemon's uid {me} or root: that user could replace the socket; choose a directory of your own",
            dir.display(),
            md.uid()
        );
    }
    let sticky = md.mode() & 0o1000 != 0; // /tmp and the like: others cannot replace our file
    if md.mode() & 0o022 != 0 && !sticky {
        let who = if md.mode() & 0o002 != 0 { "every user".to_owned() } else { format!("group {}", md.gid()) };
        bail!(
            "the {what} {} is writable by {who} (mode {:o}) without the sticky bit: they could replace the socket; `chmod go-w {}`, or use a directory only this user can write",
            dir.display(),
            md.mode() & 0o7777,
            dir.display()
        );
    }
    Ok(())
}

/// Makes `path` free for a new socket: a stale socket is removed; a live
/// one (another daemon answers) or anything that is not a socket is left
/// alone and refused, naming what is there.
pub fn claim_socket_path(path: &Path) -> anyhow::Result<()> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if !md.file_type().is_socket() {
        let what = if md.is_dir() {
            "a directory"
        } else if md.file_type().is_symlink() {
            "a symbolic link"
        } else if md.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        bail!("{} is {what}, not a socket: refusing to replace it; give another socket path", path.display());
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        bail!("{} is served by another process: stop it first, or give another socket path", path.display());
    }
    std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))
}

/// Restricts a socket just bound to its owner (the bind follows the umask),
/// or to its owner and `group` (mode 0660) when the config names one.
pub fn restrict_socket(path: &Path, group: Option<u32>) -> anyhow::Result<()> {
    let Some(gid) = group else {
        return std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("making {} mode 0600", path.display()));
    };
    std::os::unix::fs::chown(path, None, Some(gid))
        .with_context(|| format!("giving {} to group {gid} (the config's socket group)", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("making {} mode 0660", path.display()))
}

/// Gives the socket directory to `group` (mode 0750) so its members can reach
/// the sockets in it: one this daemon created, or a private one of its own
/// user (`/run/pdstor` from an earlier start); a shared directory (sticky,
/// like `/tmp`) or another user's is left as it is.
pub fn share_socket_dir(socket: &Path, group: u32, created: bool) -> anyhow::Result<()> {
    let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) else { return Ok(()) };
    let md = std::fs::metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    let ours = md.uid() == nix::unistd::geteuid().as_raw() && md.mode() & 0o1000 == 0 && md.mode() & 0o007 == 0;
    if !created && !ours {
        return Ok(());
    }
    std::os::unix::fs::chown(dir, None, Some(group))
        .with_context(|| format!("giving the socket directory {} to group {group}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750))
        .with_context(|| format!("making {} mode 0750", dir.display()))
}

/// Refuses a target other users can read or write (its KV bytes and the
/// namespace's receipt key), unless `allow`, which warns. A target its group
/// can reach (a block device's `disk` group, say) is warned about: whoever is
/// in that group can read and rewrite the whole device, the receipt key and
/// the journal included, so the device's own permissions are the boundary.
pub fn check_target(path: &Path, allow: bool) -> anyhow::Result<()> {
    let md = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if md.mode() & 0o006 == 0 {
        if md.mode() & 0o060 != 0 && md.gid() != 0 {
            tracing::warn!(
                target = %path.display(),
                gid = md.gid(),
                mode = format!("{:o}", md.mode() & 0o7777),
                "every member of the target's group can read and rewrite it (its KV bytes, receipt key and journal): keep that group to the daemon's operators"
            );
        }
        return Ok(());
    }
    let why = format!(
        "target {} is {} by every user (mode {:o}): they could read its KV bytes and the receipt key in its superblock, or rewrite them",
        path.display(),
        if md.mode() & 0o004 != 0 { "readable" } else { "writable" },
        md.mode() & 0o7777
    );
    if !allow {
        bail!("{why}; `chmod o-rw {}`, or pass --allow-readable-target to serve it anyway", path.display());
    }
    tracing::warn!("{why} (served anyway: --allow-readable-target)");
    Ok(())
}

/// Refuses plaintext TCP unless `insecure`, which warns at every start: no
/// TCP caller can be told from another without a certificate, on loopback
/// (any local user) or beyond it (any host).
pub fn check_tcp(addr: &std::net::SocketAddr, insecure: bool) -> anyhow::Result<()> {
    if !insecure {
        bail!(
            "--listen {addr} would serve the control plane in plaintext TCP, where no caller can be told from another ({}): use the Unix socket (the default), or pass --insecure-tcp to do it anyway",
            if addr.ip().is_loopback() { "every local user reaches loopback" } else { "every host that reaches it" }
        );
    }
    tracing::warn!(%addr, "serving the control plane in plaintext TCP (--insecure-tcp): whoever reaches this address is taken to be the config's `plaintext` principal (without a config: this daemon's own user, with every role)");
    Ok(())
}

/// The uid, gid and pid on the other end of a connected Unix socket (`SO_PEERCRED`).
pub fn peer_cred(stream: &impl std::os::fd::AsFd) -> std::io::Result<(u32, u32, i32)> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).map(|c| (c.uid(), c.gid(), c.pid())).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_path_holding_something_else_is_left_alone() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = dir.path().join("not-a-socket");
        std::fs::write(&file, b"precious").expect("writing a test file");
        let e = claim_socket_path(&file).unwrap_err().to_string();
        assert!(e.contains("a regular file, not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).expect("reading the test file back"), b"precious");
        let sock = dir.path().join("live.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).expect("binding a test socket");
        assert!(claim_socket_path(&sock).unwrap_err().to_string().contains("served by another process"));
        drop(_l);
        claim_socket_path(&sock).expect("a stale socket is replaced");
        assert!(!sock.exists());
    }

    /// Issue 34, findings 4 and 5: a group-writable socket directory, and
    /// one that is a symbolic link (to a sticky shared directory), are
    /// refused; a directory of ours is created or accepted.
    #[test]
    fn a_socket_directory_others_could_swap_is_refused() {
        let base = tempfile::tempdir().expect("a temporary directory");
        let ok = base.path().join("ours");
        assert!(socket_dir(&ok.join("s.sock")).expect("created"));
        assert!(!socket_dir(&ok.join("s.sock")).expect("accepted"));
        std::fs::set_permissions(&ok, std::fs::Permissions::from_mode(0o770)).expect("chmod");
        let e = format!("{:#}", socket_dir(&ok.join("s.sock")).unwrap_err());
        assert!(e.contains("is writable by group") && e.contains("chmod go-w"), "{e}");
        let shared = base.path().join("shared");
        std::fs::create_dir(&shared).expect("mkdir");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&shared, &link).expect("symlink");
        let e = format!("{:#}", socket_dir(&link.join("s.sock")).unwrap_err());
        assert!(e.contains("is a symbolic link (to "), "{e}");
        // Below a directory others may write to (no sticky bit), even our own is not safe.
        let open = base.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = format!("{:#}", socket_dir(&open.join("mine").join("s.sock")).unwrap_err());
        assert!(e.contains("directory above the socket directory") && e.contains("every user"), "{e}");
        assert!(!open.join("mine").exists(), "a refusal created the directory");
    }

    #[test]
    fn plaintext_tcp_needs_to_be_asked_for() {
        let e = check_tcp(&"127.0.0.1:7077".parse().expect("a socket address"), false).unwrap_err().to_string();
        assert!(e.contains("every local user reaches loopback") && e.contains("--insecure-tcp"), "{e}");
        let e = check_tcp(&"0.0.0.0:7077".parse().expect("a socket address"), false).unwrap_err().to_string();
        assert!(e.contains("--insecure-tcp"), "{e}");
        assert!(check_tcp(&"0.0.0.0:7077".parse().expect("a socket address"), true).is_ok());
    }

    #[test]
    fn a_world_readable_target_is_refused_unless_allowed() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let t = dir.path().join("t.img");
        std::fs::write(&t, b"x").expect("writing a test file");
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o644)).expect("chmod of a test file");
        assert!(check_target(&t, false).unwrap_err().to_string().contains("chmod o-rw"));
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o602)).expect("chmod of a test file");
        assert!(check_target(&t, false).unwrap_err().to_string().contains("writable by every user"));
        assert!(check_target(&t, true).is_ok());
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o600)).expect("chmod of a test file");
        assert!(check_target(&t, false).is_ok());
    }
}
