//! Where the daemon's log lines go: standard error, one write per line —
//! except inside [`gathered`], where a thread's lines are held and written
//! together when it ends. A batch of N steps logs its N audit lines in one
//! write instead of N (a write per line was half of what an audit line
//! cost). The lines are written before the batch is answered.

use std::cell::RefCell;
use std::io::{self, Write};

thread_local! {
    static HELD: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// Log writes that failed (standard error on a full disk, say): the lines
/// are dropped — a log that cannot be written must not fail the step it
/// describes — and counted (`pdstor_log_write_failures_total`).
static FAILED_WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Log writes that failed since the daemon started.
pub fn failed_writes() -> u64 {
    FAILED_WRITES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Writes `lines` to standard error; a failure is counted, never raised.
fn write_out(lines: &[u8]) {
    if io::stderr().write_all(lines).is_err() {
        FAILED_WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Runs `f` with this thread's log lines held, then writes them in one
/// write (also if `f` panics). Inside another `gathered`, the outer one writes.
pub fn gathered<T>(f: impl FnOnce() -> T) -> T {
    if HELD.with(|h| h.borrow().is_some()) {
        return f();
    }
    HELD.with(|h| *h.borrow_mut() = Some(Vec::new()));
    struct WriteHeld;
    impl Drop for WriteHeld {
        fn drop(&mut self) {
            if let Some(lines) = HELD.with(|h| h.borrow_mut().take())
                && !lines.is_empty()
            {
                write_out(&lines);
            }
        }
    }
    let _write = WriteHeld;
    f()
}

/// The log's writer for `tracing_subscriber` (`with_writer(LogWriter)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

/// One line's way out: held by a [`gathered`] thread, else standard error.
#[derive(Debug)]
pub struct LogLine;

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let held = HELD.with(|h| h.borrow_mut().as_mut().map(|lines| lines.extend_from_slice(buf)).is_some());
        if !held {
            write_out(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held() -> Option<Vec<u8>> {
        HELD.with(|h| h.borrow().clone())
    }

    #[test]
    fn lines_are_held_inside_gathered_only_and_given_up_at_its_end_even_on_panic() {
        assert_eq!(held(), None);
        gathered(|| {
            LogLine.write_all(b"one\n").unwrap();
            gathered(|| LogLine.write_all(b"two\n").unwrap());
            assert_eq!(held().as_deref(), Some(&b"one\ntwo\n"[..]), "the outer scope holds both");
        });
        assert_eq!(held(), None, "written and released");
        let r = std::panic::catch_unwind(|| gathered(|| panic!("a step panicked")));
        assert!(r.is_err());
        assert_eq!(held(), None, "a panic leaves the thread writing straight through");
    }
}
