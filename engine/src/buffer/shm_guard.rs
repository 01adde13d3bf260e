//! Checksumming a shared-memory file in place although its owner may shrink it.
//!
//! A shm file received from another process (LMCache's CPU pool) can be
//! truncated by its owner at any moment; a CPU access through a mapping past
//! the new end raises `SIGBUS`. Reading it through the file instead
//! (`pread` into a block, then the checksum) is safe but costs a copy:
//! measured on this project's 2-core EPYC, 5.5 GiB/s through the file
//! against 20 GiB/s in place — four times the CPU of the check itself.
//!
//! So the check reads the mapping in place, as Wayland compositors read
//! their clients' shm pools (libwayland-server's `wl_shm_buffer_begin_access`):
//! the thread marks the mapping it is about to read, and a `SIGBUS` inside
//! it is answered by mapping zero pages over the whole mapping
//! (`MAP_FIXED | MAP_ANONYMOUS`) and noting that it happened; the
//! interrupted load then reads zeros, the check's answer is thrown away and
//! the buffer reaches its bytes through its file from then on (where a
//! truncated range fails with an error, as before). A `SIGBUS` anywhere
//! else goes to the handler that was there before (Rust's own, or the
//! default: the process dies as it would have). Once caught, the buffer
//! takes no transfer again (its mapping is private zero pages now, which a
//! `host`-path transfer would read or write instead of the file).
//!
//! The handler reads a const-initialized thread-local: a plain TLS load in
//! the daemon's binary. In a shared library loaded with `dlopen` (the
//! Python module) such a load may go through `__tls_get_addr`, which is not
//! async-signal-safe on a thread that never touched it — moot there: the
//! module owns its shm files and never takes the guarded path.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// The mapping this thread is reading in place, and the flag a fault in it
/// sets: `(start, len, flag)`, `len` 0 when none. Const-initialized and
/// without a destructor, so reading it is a plain thread-local load, safe
/// in a signal handler.
#[derive(Clone, Copy)]
struct Guarded {
    start: usize,
    len: usize,
    shrunk: *const AtomicBool,
}

thread_local! {
    static GUARDED: Cell<Guarded> = const { Cell::new(Guarded { start: 0, len: 0, shrunk: std::ptr::null() }) };
}

/// The `SIGBUS` disposition found when the handler was installed, to pass
/// every fault outside a guarded read on to.
static PREVIOUS: OnceLock<Previous> = OnceLock::new();

/// A `sigaction` that may be shared between threads: it is written once,
/// before the handler that reads it is installed, and never again.
struct Previous(libc::sigaction);

// SAFETY: the struct holds a handler address, flags and a signal mask —
// plain values, written once (before anything reads them) and only read after.
unsafe impl Sync for Previous {}
// SAFETY: as above: plain values.
unsafe impl Send for Previous {}

/// Runs `check` over `len` bytes at `base` (all within the mapping
/// `mapping_start..mapping_start + mapping_len`) with `SIGBUS` in that
/// mapping caught. Answers `None` if the mapping was found shrunk (`shrunk`
/// set, by this thread or, before or during this check, by another): the
/// caller must not trust the answer and reaches the bytes through the file
/// from then on. `None` also if the handler could not be installed.
pub(super) fn check_in_place<T>(
    mapping: (*const u8, usize),
    shrunk: &AtomicBool,
    check: impl FnOnce() -> T,
) -> Option<T> {
    if shrunk.load(Ordering::SeqCst) || !installed() {
        return None;
    }
    let page = page_size();
    let len = mapping.1.div_ceil(page) * page;
    /// Clears the mark when the check ends, however it ends (a panic too),
    /// so no later fault finds a stale range and a dangling flag.
    struct Unmark;
    impl Drop for Unmark {
        fn drop(&mut self) {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
            GUARDED.with(|g| g.set(Guarded { start: 0, len: 0, shrunk: std::ptr::null() }));
        }
    }
    GUARDED.with(|g| g.set(Guarded { start: mapping.0 as usize, len, shrunk }));
    let unmark = Unmark;
    std::sync::atomic::compiler_fence(Ordering::SeqCst);
    let out = check();
    drop(unmark);
    // A fault in another thread's check of the same mapping replaced it with
    // zeros (the flag is set before the zeros are mapped), which this check
    // may have read: it is as untrustworthy as a fault of its own.
    (!shrunk.load(Ordering::SeqCst)).then_some(out)
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Installs the handler once; whether it is installed.
fn installed() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    *INSTALLED.get_or_init(|| {
        // SAFETY: a zeroed sigaction is a valid out-parameter; querying the
        // current disposition changes nothing.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: `old` is a valid sigaction to write; a null `act` only reads.
        if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) } != 0 {
            return false;
        }
        if PREVIOUS.set(Previous(old)).is_err() {
            return false;
        }
        // SAFETY: as above, zeroed is a valid starting sigaction.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: `act.sa_mask` is a valid sigset to fill.
        unsafe { libc::sigemptyset(&mut act.sa_mask) };
        // SAFETY: `act` is fully initialized and names a handler that stays
        // valid for the life of the process.
        unsafe { libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) == 0 }
    })
}

/// The handler: zero pages over a guarded mapping that faulted; any other
/// fault to the previous disposition. Async-signal-safe: a thread-local
/// load, an atomic store, `mmap` (a system call) and, for other faults,
/// `sigaction` or the previous handler.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for a SA_SIGINFO handler.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    let g = GUARDED.with(|g| g.get());
    // Only an access past the file's end (BUS_ADRERR), not a memory error
    // (BUS_MCEERR_*), is a shrink.
    if code == libc::BUS_ADRERR && g.len != 0 && addr >= g.start && addr - g.start < g.len {
        // SAFETY: errno is this thread's; saved and put back around mmap so
        // the interrupted code sees it unchanged.
        let errno = unsafe { *libc::__errno_location() };
        // Flag first, then the zeros: a thread that reads a zero page of the
        // replaced mapping finds the flag set once its check ends.
        // SAFETY: `shrunk` points at the buffer's flag, which outlives the
        // guarded check that set it (check_in_place borrows it).
        unsafe { (*g.shrunk).store(true, Ordering::SeqCst) };
        // SAFETY: replaces exactly the guarded mapping (page-aligned start,
        // length rounded up to pages), which the buffer owns and unmaps
        // itself on drop; nothing else lives in that range.
        let p = unsafe {
            libc::mmap(
                g.start as *mut libc::c_void,
                g.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = errno };
        if p != libc::MAP_FAILED {
            return;
        }
    }
    pass_on(sig, info, ctx);
}

/// Hands a fault that is not ours to the disposition found at installation.
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let previous = PREVIOUS.get().map(|p| p.0);
    match previous {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: a SA_SIGINFO disposition's handler has this signature.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain disposition's handler takes the signal number.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default: reset and return, so that the access faults again
            // and the process ends as it would have without this handler.
            // SAFETY: zeroed is a valid sigaction (SIG_DFL, no flags, empty mask).
            let dfl: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: `dfl` is a valid disposition; sigaction is async-signal-safe.
            unsafe { libc::sigaction(sig, &dfl, std::ptr::null_mut()) };
        }
    }
}
