//! Persistent reservations on a shared namespace, through Linux's generic
//! block `IOC_PR_*` ioctls (`include/uapi/linux/pr.h`; NVMe implements them
//! with Reservation Register / Acquire / Release, over a fabric too).
//!
//! How pdstor fences a host that reads the namespace itself: the owner holds
//! an *Exclusive Access — All Registrants* reservation, so only hosts whose
//! key is registered may read or write; a direct reader registers its own key
//! before it reads; and when the owner fences that reader (its session
//! closed), it preempts the reader's key — from then on the target refuses
//! that host's commands, whether it is dead, partitioned or merely late.
//!
//! Registrations and the reservation are the *host's* (its NVMe host ID),
//! not a process's: they survive the process, which is the point.

use std::fs::File;
use std::mem::size_of;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A reservation operation the target or kernel refused.
#[derive(Debug, thiserror::Error)]
#[error("{op} on {device}: {why}")]
pub struct ReservationError {
    /// What was attempted (`register key 0x…`, `preempt key 0x…`).
    pub op: String,
    /// The shared namespace's device on this host.
    pub device: PathBuf,
    /// What the kernel or the target said, and what to do.
    pub why: String,
    /// Which kind of refusal it was.
    pub kind: ReservationFailure,
}

/// The kinds of [`ReservationError`] a caller decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationFailure {
    /// The target refused: another host holds the reservation, or this
    /// host's key is not (or no longer) registered — it was preempted.
    Conflict,
    /// The device does not do persistent reservations.
    Unsupported,
    /// The path to the target failed: whether the key is still registered
    /// is unknown until the path is back.
    Path,
    /// Anything else (permission, an I/O error, opening the device).
    Other,
}

/// `struct pr_registration`.
#[repr(C)]
struct PrRegistration {
    old_key: u64,
    new_key: u64,
    flags: u32,
    pad: u32,
}

/// `struct pr_reservation`.
#[repr(C)]
struct PrReservation {
    key: u64,
    kind: u32,
    flags: u32,
}

/// `struct pr_preempt`.
#[repr(C)]
struct PrPreempt {
    old_key: u64,
    new_key: u64,
    kind: u32,
    flags: u32,
}

/// `struct pr_clear`.
#[repr(C)]
struct PrClear {
    key: u64,
    flags: u32,
    pad: u32,
}

/// `struct pr_read_keys` (recent kernels; the series 7.2 kernel has it).
#[repr(C)]
struct PrReadKeys {
    generation: u32,
    num_keys: u32,
    keys_ptr: u64,
}

/// `_IOW('p', nr, size)`.
const fn iow(nr: u8, size: usize) -> u32 {
    (1 << 30) | ((size as u32) << 16) | ((b'p' as u32) << 8) | nr as u32
}
/// `_IOWR('p', nr, size)`.
const fn iowr(nr: u8, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | ((b'p' as u32) << 8) | nr as u32
}
const IOC_PR_REGISTER: u32 = iow(200, size_of::<PrRegistration>());
const IOC_PR_RESERVE: u32 = iow(201, size_of::<PrReservation>());
const IOC_PR_PREEMPT_ABORT: u32 = iow(204, size_of::<PrPreempt>());
const IOC_PR_CLEAR: u32 = iow(205, size_of::<PrClear>());
const IOC_PR_READ_KEYS: u32 = iowr(206, size_of::<PrReadKeys>());
/// `PR_FL_IGNORE_KEY`: register (replace) whatever key this host had.
const PR_FL_IGNORE_KEY: u32 = 1;

// What a reservation ioctl answers when the device refused the command
// (`enum pr_status` of linux/pr.h: SCSI's values, whatever the device).
const PR_STS_IOERR: i32 = 0x2;
const PR_STS_RESERVATION_CONFLICT: i32 = 0x18;
const PR_STS_RETRY_PATH_FAILURE: i32 = 0xe0000;
const PR_STS_PATH_FAST_FAILED: i32 = 0xf0000;
const PR_STS_PATH_FAILED: i32 = 0x10000;
/// `PR_EXCLUSIVE_ACCESS_ALL_REGS`: only registrants may read or write, and
/// every registrant holds the reservation — so the owner preempting a
/// reader's key removes that registration (in the Registrants Only type, a
/// holder's preempt of another key leaves it registered on Linux's nvmet).
const PR_EXCLUSIVE_ACCESS_ALL_REGS: u32 = 6;

/// A shared namespace's reservations, as this host sees them.
#[derive(Debug)]
pub struct Reservations {
    device: PathBuf,
    file: File,
}

impl Reservations {
    /// Opens `device` for reservation commands (read-only: the kernel allows
    /// them to CAP_SYS_ADMIN on such a descriptor).
    pub fn open(device: &Path) -> Result<Reservations, ReservationError> {
        let file = File::open(device).map_err(|e| ReservationError {
            op: "opening for reservations".into(),
            device: device.into(),
            why: e.to_string(),
            kind: ReservationFailure::Other,
        })?;
        Ok(Reservations { device: device.into(), file })
    }

    /// Registers `key` as this host's (replacing any key it had).
    pub fn register(&self, key: u64) -> Result<(), ReservationError> {
        let mut arg = PrRegistration { old_key: 0, new_key: key, flags: PR_FL_IGNORE_KEY, pad: 0 };
        self.call(&format!("register key {key:#x}"), IOC_PR_REGISTER, &mut arg)
    }

    /// Whether this host is registered with `key` — asked without changing
    /// anything: a Register–Replace of `key` by itself, which the target
    /// refuses as a conflict when this host holds no registration of `key`
    /// (it was preempted). Works whoever holds the reservation.
    pub fn registered(&self, key: u64) -> Result<bool, ReservationError> {
        let mut arg = PrRegistration { old_key: key, new_key: key, flags: 0, pad: 0 };
        match self.call(&format!("check that this host is registered with key {key:#x}"), IOC_PR_REGISTER, &mut arg) {
            Ok(()) => Ok(true),
            Err(e) if e.kind == ReservationFailure::Conflict => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The keys registered on the namespace, read without registering
    /// (`IOC_PR_READ_KEYS`); `None` where the kernel cannot read them
    /// (older kernels answer ENOTTY) or the device does not say.
    pub fn keys(&self) -> Result<Option<Vec<u64>>, ReservationError> {
        let mut keys = vec![0u64; 64];
        loop {
            let mut arg = PrReadKeys { generation: 0, num_keys: keys.len() as u32, keys_ptr: keys.as_mut_ptr() as u64 };
            match self.call("read the registered keys", IOC_PR_READ_KEYS, &mut arg) {
                Ok(()) if arg.num_keys as usize > keys.len() && keys.len() < 1 << 16 => {
                    keys = vec![0u64; (arg.num_keys as usize).min(1 << 16)];
                }
                Ok(()) => {
                    keys.truncate(arg.num_keys as usize);
                    return Ok(Some(keys));
                }
                Err(e) if e.kind == ReservationFailure::Unsupported => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes (or, as the holder, keeps) the Exclusive Access — Registrants
    /// Only reservation with this host's registered `key`.
    pub fn reserve(&self, key: u64) -> Result<(), ReservationError> {
        let mut arg = PrReservation { key, kind: PR_EXCLUSIVE_ACCESS_ALL_REGS, flags: 0 };
        self.call(&format!("reserve (exclusive access, all registrants) with key {key:#x}"), IOC_PR_RESERVE, &mut arg)
    }

    /// Removes `victim`'s registration (and aborts its commands in flight) as
    /// the holder `own`: the victim's host can no longer read or write.
    pub fn preempt(&self, own: u64, victim: u64) -> Result<(), ReservationError> {
        let mut arg = PrPreempt { old_key: own, new_key: victim, kind: PR_EXCLUSIVE_ACCESS_ALL_REGS, flags: 0 };
        self.call(&format!("preempt key {victim:#x} as key {own:#x}"), IOC_PR_PREEMPT_ABORT, &mut arg)
    }

    /// Drops the reservation and every registration (with this host's `key`).
    pub fn clear(&self, key: u64) -> Result<(), ReservationError> {
        let mut arg = PrClear { key, flags: 0, pad: 0 };
        self.call(&format!("clear the reservations with key {key:#x}"), IOC_PR_CLEAR, &mut arg)
    }

    fn call<T>(&self, op: &str, request: u32, arg: &mut T) -> Result<(), ReservationError> {
        // SAFETY: every IOC_PR_* request here is an _IOW (or, READ_KEYS, an
        // _IOWR) whose size is that of the `#[repr(C)]` struct `arg` points
        // at (laid out as in pr.h), valid for this synchronous call; READ_KEYS
        // also writes at most `num_keys` u64s at `keys_ptr`, which `keys()`
        // points at a live Vec of exactly that many.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), request as _, arg as *mut T) };
        let (kind, why) = match rc {
            0 => return Ok(()),
            rc if rc < 0 => {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) => (
                        ReservationFailure::Unsupported,
                        format!(
                            "{e}: this device does not do persistent reservations (an NVMe namespace does when its controller supports them; a Linux nvmet target with the namespace's resv_enable set; Debian's 6.12 nvmet has no reservations)"
                        ),
                    ),
                    Some(libc::EPERM) | Some(libc::EACCES) => {
                        (ReservationFailure::Other, format!("{e}: reservations need CAP_SYS_ADMIN"))
                    }
                    // The block layer's BLK_STS_RESV_CONFLICT.
                    Some(libc::EBADE) => (
                        ReservationFailure::Conflict,
                        format!(
                            "{e}: reservation conflict: another host holds the reservation, or this key is not registered"
                        ),
                    ),
                    Some(libc::ENOLINK) | Some(libc::ETIMEDOUT) | Some(libc::ENOTCONN) | Some(libc::EAGAIN) => (
                        ReservationFailure::Path,
                        format!("{e}: the path to the target failed: check the fabric connection"),
                    ),
                    _ => (ReservationFailure::Other, e.to_string()),
                }
            }
            rc => refused(rc),
        };
        Err(ReservationError { op: op.into(), device: self.device.clone(), why, kind })
    }
}

/// What a positive answer `rc` of a reservation ioctl means: the device
/// refused the command with that `pr_status`.
fn refused(rc: i32) -> (ReservationFailure, String) {
    match rc {
        PR_STS_IOERR => (ReservationFailure::Other, "the target answered an I/O error".into()),
        PR_STS_RESERVATION_CONFLICT => (
            ReservationFailure::Conflict,
            "reservation conflict: another host holds the reservation, or this key is not registered".into(),
        ),
        PR_STS_RETRY_PATH_FAILURE | PR_STS_PATH_FAST_FAILED | PR_STS_PATH_FAILED => (
            ReservationFailure::Path,
            format!("the path to the target failed (PR status {rc:#x}): check the fabric connection"),
        ),
        rc => (ReservationFailure::Other, format!("the target answered PR status {rc:#x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers are pr.h's.
    #[test]
    fn request_numbers_match_linux() {
        assert_eq!(IOC_PR_REGISTER, 0x401870c8);
        assert_eq!(IOC_PR_RESERVE, 0x401070c9);
        assert_eq!(IOC_PR_PREEMPT_ABORT, 0x401870cc);
        assert_eq!(IOC_PR_CLEAR, 0x401070cd);
        assert_eq!(IOC_PR_READ_KEYS, 0xc01070ce);
    }

    /// The device's refusals read as pr.h numbers them (SCSI's values): a
    /// conflict is 0x18 and a failed path 0x10000, not their places in the enum.
    #[test]
    fn refusals_read_as_linux_numbers_them() {
        assert_eq!(refused(0x18).0, ReservationFailure::Conflict);
        for path in [0x10000, 0xe0000, 0xf0000] {
            assert_eq!(refused(path).0, ReservationFailure::Path, "{path:#x}");
        }
        assert_eq!(refused(0x2).0, ReservationFailure::Other);
        for unknown in [1, 3, 5] {
            let (kind, why) = refused(unknown);
            assert_eq!(kind, ReservationFailure::Other);
            assert!(why.contains(&format!("{unknown:#x}")), "{why}");
        }
    }

    /// A file has no reservations: refused, saying so.
    #[test]
    fn a_file_has_no_reservations() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let e = Reservations::open(&f).unwrap().register(7).unwrap_err();
        assert!(e.to_string().contains("register key 0x7"), "{e}");
    }
}
