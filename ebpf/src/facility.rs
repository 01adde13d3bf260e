//! The kernel facilities the probes stand on — tracefs, bpffs, tracepoints —
//! and the words for why a program could not attach.

use std::path::Path;

use crate::program::ProbeError;

/// Where the tracepoint programs find their ids.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// Whether the tracepoint event directories are reachable (tracefs, or the
/// legacy debugfs view of it).
pub(crate) fn tracefs_ready() -> bool {
    Path::new(TRACEFS).join("events").is_dir() || Path::new("/sys/kernel/debug/tracing/events").is_dir()
}

/// Mounts tracefs at [`TRACEFS`] when it is absent, as bpffs is mounted for
/// pinning: a fresh machine without systemd has neither, and a tracepoint
/// program cannot attach without its id from tracefs. Says so once on stderr.
/// Not root, or a kernel without tracefs, is an error naming the facility and
/// the command that sets it up.
pub fn ensure_tracefs() -> Result<(), ProbeError> {
    static MOUNTED: std::sync::Once = std::sync::Once::new();
    if tracefs_ready() {
        return Ok(());
    }
    let hint = format!(
        "the tracepoint probes need tracefs, which is not mounted at {TRACEFS}; \
         mount it as root (`mount -t tracefs tracefs {TRACEFS}`) or run pdstor as root, which mounts it itself"
    );
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if uid != 0 {
        return Err(ProbeError::Facility(format!("{hint} (running as uid {uid})")));
    }
    let (src, dir) = (c"tracefs", c"/sys/kernel/tracing");
    // SAFETY: every pointer is a NUL-terminated string alive for the call.
    let rc = unsafe { libc::mount(src.as_ptr(), dir.as_ptr(), src.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(ProbeError::Facility(format!(
            "{hint}: mounting it failed: {}: {e}",
            errno_name(e.raw_os_error().unwrap_or(0))
        )));
    }
    MOUNTED.call_once(|| eprintln!("pdstor: mounted tracefs at {TRACEFS} (the tracepoint probes need it)"));
    Ok(())
}

/// The symbolic name of the errnos an attach or mount can return.
pub(crate) fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::ENOENT => "ENOENT",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::EINVAL => "EINVAL",
        libc::ENODEV => "ENODEV",
        libc::EBUSY => "EBUSY",
        libc::ENOTSUP => "EOPNOTSUPP",
        libc::ESRCH => "ESRCH",
        libc::E2BIG => "E2BIG",
        libc::ENOMEM => "ENOMEM",
        libc::EEXIST => "EEXIST",
        _ => "errno",
    }
}

/// The OS error under a libbpf error, if there is one. libbpf-rs keeps the
/// `io::Error` inside its own context chain, where `source()` does not reach
/// it, so the errno is read from the chain's text (`... (os error 2)`).
pub(crate) fn os_error(e: &libbpf_rs::Error) -> Option<i32> {
    let text = format!("{e:#}");
    let at = text.rfind("(os error ")?;
    text[at + "(os error ".len()..].split(')').next()?.parse().ok()
}

/// Why one program did not attach, as a user can act on it: the errno, what
/// was missing and where to look (never libbpf's bare "failed to attach").
pub(crate) fn attach_failure(name: &str, e: &libbpf_rs::Error) -> String {
    let errno = os_error(e);
    let code = errno.map_or("error", errno_name);
    let os = errno.map_or_else(|| format!("{e:#}"), |c| std::io::Error::from_raw_os_error(c).to_string());
    let (kind, what) = name.split_once(':').unwrap_or(("", name));
    match (kind, errno) {
        ("kprobe" | "kretprobe", Some(libc::ENOENT)) => {
            format!("{code}: {kind} {what}: no such kernel function here, or kprobes are not available ({os})")
        }
        ("kprobe" | "kretprobe" | "raw_tp", _) => format!("{code}: {name}: {os}"),
        (_, Some(libc::ENOENT)) => {
            format!("{code}: tracepoint {name} not found — is tracefs mounted at {TRACEFS}? ({os})")
        }
        (_, Some(libc::EACCES | libc::EPERM)) => {
            format!("{code}: {name}: not permitted ({os}); the probes need root or CAP_BPF + CAP_PERFMON")
        }
        _ => format!("{code}: {name}: {os}"),
    }
}

/// Whether the kernel has a tracepoint, from tracefs (or debugfs).
pub(crate) fn tracepoint_exists(group: &str, name: &str) -> bool {
    ["/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"]
        .iter()
        .any(|root| Path::new(root).join(group).join(name).exists())
}

/// Mounts bpffs at `root` if something else (or nothing) is there, as
/// systemd does at boot; hosts without systemd often lack it.
pub(crate) fn ensure_bpffs(root: &Path) -> Result<(), String> {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let c = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `statfs` is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is writable for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    let fstype = c"bpf";
    // SAFETY: every pointer is a NUL-terminated string alive for the call.
    let rc = unsafe { libc::mount(fstype.as_ptr(), c.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(format!(
            "{} is not bpffs and mounting it failed: {}",
            root.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_attach_names_its_errno_and_what_to_do() {
        let e = libbpf_rs::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(os_error(&e), Some(libc::ENOENT));
        let tp = attach_failure("io_uring:io_uring_submit_req", &e);
        assert!(
            tp.starts_with(
                "ENOENT: tracepoint io_uring:io_uring_submit_req not found — is tracefs mounted at /sys/kernel/tracing?"
            ),
            "{tp}"
        );
        let kp = attach_failure("kprobe:io_wq_submit_work", &e);
        assert!(kp.starts_with("ENOENT: kprobe io_wq_submit_work: no such kernel function"), "{kp}");
        let perm = attach_failure("block:block_rq_issue", &libbpf_rs::Error::from_raw_os_error(libc::EPERM));
        assert!(perm.starts_with("EPERM: block:block_rq_issue: not permitted") && perm.contains("CAP_BPF"), "{perm}");
        for msg in [tp, kp, perm] {
            assert!(!msg.contains("failed to attach BPF program"), "{msg}");
        }
    }
}
