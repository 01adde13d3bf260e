//! A registered mapping larger than one buffer table entry takes (io_uring
//! registers at most 1 GiB per entry): it is registered as windows of the
//! engine's `fixed_window` bytes, the first in the buffer's own entry, the
//! others in free entries. A fixed command names the window that holds all
//! its bytes; one that crosses from one window into the next runs
//! unregistered on the same mapping (a plain read or write: the same bytes,
//! its pages pinned for the command instead of at registration). LMCache's
//! CPU pool, gigabytes in one shared file, is such a mapping.

use std::sync::Arc;

use super::{BufferId, Engine, IoError, Registration, Slot};
use crate::buffer::Buffer;

/// Why registering windows failed.
pub(super) enum Failed {
    /// The kernel refused an entry.
    Os(std::io::Error),
    /// The engine could not take it (no free entry for a window).
    Engine(IoError),
}

impl Slot {
    /// A buffer held with no windows.
    pub(super) fn held(buffer: Buffer, registered: Registration) -> Slot {
        Slot { buffer: Arc::new(buffer), registered, windows: Vec::new(), window: 0 }
    }

    /// The table entry a fixed command on `len` bytes at `offset` of this
    /// buffer names (`own` is the slot's own entry): the window holding all
    /// of them, or none where they cross into the next window.
    pub(super) fn fixed_index(&self, own: u16, offset: u64, len: u64) -> Option<u16> {
        if self.windows.is_empty() {
            return Some(own);
        }
        let window = self.window as u64;
        let (first, last) = (offset / window, (offset + len.max(1) - 1) / window);
        match first {
            _ if first != last => None,
            0 => Some(own),
            w => self.windows.get(w as usize - 1).and_then(|&e| u16::try_from(e).ok()),
        }
    }
}

impl Engine {
    /// Registers the mapping `[addr, addr + len)`: its first window in
    /// `id`'s entry, every further one in a free entry (answered, in order).
    /// A refusal leaves the table as it was.
    pub(super) fn register_windows(&mut self, id: BufferId, addr: u64, len: usize) -> Result<Vec<u32>, Failed> {
        let window = self.fixed_window;
        let count = len.div_ceil(window).max(1);
        let extra: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&e| e != id.0 && self.slots[e as usize].is_none() && !self.window_entries[e as usize])
            .take(count - 1)
            .collect();
        if extra.len() < count - 1 {
            return Err(Failed::Engine(IoError::BufferTableFull { slots: self.slots.len() as u32 }));
        }
        let entries: Vec<u32> = std::iter::once(id.0).chain(extra.iter().copied()).collect();
        for (k, &entry) in entries.iter().enumerate() {
            let at = k * window;
            let iov =
                libc::iovec { iov_base: (addr as usize + at) as *mut libc::c_void, iov_len: window.min(len - at) };
            // SAFETY: the iovec describes part of the buffer's mapping, which
            // the engine holds in `slots` from here until `remove` clears these
            // entries (or the ring is dropped first, as `ring` is declared
            // before `slots`); on failure the entries set so far are cleared
            // before the buffer goes back to the caller.
            if let Err(e) = unsafe { self.update_buffer_table(entry, &[iov]) } {
                for &set in &entries[..k] {
                    let _ = self.clear_entry(set);
                }
                return Err(Failed::Os(e));
            }
        }
        for &e in &extra {
            self.window_entries[e as usize] = true;
        }
        Ok(extra)
    }

    /// Clears the entries of a removed buffer's further windows. An entry
    /// the kernel fails to clear keeps its pages pinned until the ring goes;
    /// it is still free for the next registration, which replaces it.
    pub(super) fn clear_windows(&mut self, windows: &[u32]) {
        for &e in windows {
            let _ = self.clear_entry(e);
            self.window_entries[e as usize] = false;
        }
    }

    /// Empties table entry `entry`: the kernel lets go of what it held.
    pub(super) fn clear_entry(&self, entry: u32) -> std::io::Result<()> {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        // SAFETY: an empty iovec describes no memory; no I/O is in flight
        // (`execute` completes everything before returning).
        unsafe { self.update_buffer_table(entry, &[empty]) }
    }

    /// The table entries a held buffer's mapping is registered in, first
    /// window first (empty if it is not registered for `host_fixed`).
    pub fn fixed_entries(&self, id: BufferId) -> Vec<u32> {
        match self.slots.get(id.0 as usize).and_then(Option::as_ref) {
            Some(s) if s.registered == Registration::Host => {
                std::iter::once(id.0).chain(s.windows.iter().copied()).collect()
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{BufferOffset, EngineOptions, IoRequest, Op, PayloadPath, Target, TargetOffset, TransferId};
    use super::*;

    const WINDOW: usize = 64 << 10;

    fn engine(dir: &tempfile::TempDir, slots: u32) -> Engine {
        let path = dir.path().join("target");
        std::fs::File::create(&path).unwrap().set_len(4 << 20).unwrap();
        let target = Target::open(&path, &Default::default()).unwrap();
        let opts = EngineOptions { buffer_slots: slots, fixed_window: WINDOW, ..Default::default() };
        Engine::new(target, opts).unwrap()
    }

    fn io(op: Op, id: BufferId, at: u64, target: u64, len: u64) -> IoRequest {
        IoRequest {
            transfer: TransferId(1),
            op,
            path: PayloadPath::HostFixed,
            buffer: id,
            buffer_offset: BufferOffset(at),
            target_offset: TargetOffset(target),
            len,
        }
    }

    #[test]
    fn a_mapping_over_one_window_moves_bytes_through_each_window_and_across_their_edges() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(&dir, 8);
        let len = 3 * WINDOW - 4096; // three windows, the last one short
        let buf = Buffer::memfd("windows", len).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        buf.write_at(0, &bytes).unwrap();
        let id = e.register(buf).unwrap();
        let entries = e.fixed_entries(id);
        assert_eq!(entries.len(), 3, "{entries:?}");
        assert_eq!(entries[0], id.0);
        // Which entry each command names: its window's, none across an edge.
        let s = e.slot(id).unwrap();
        let own = id.0 as u16;
        assert_eq!(s.fixed_index(own, 0, WINDOW as u64), Some(own));
        assert_eq!(s.fixed_index(own, WINDOW as u64, 4096), Some(entries[1] as u16));
        assert_eq!(s.fixed_index(own, 2 * WINDOW as u64 + 4096, 4096), Some(entries[2] as u16));
        assert_eq!(s.fixed_index(own, WINDOW as u64 - 4096, 8192), None);
        // Every byte out (one command per window, and one across an edge) and back in.
        let writes = [
            io(Op::Write, id, 0, 0, WINDOW as u64),
            io(Op::Write, id, WINDOW as u64, WINDOW as u64, WINDOW as u64 - 8192),
            io(Op::Write, id, 2 * WINDOW as u64 - 8192, 2 * WINDOW as u64 - 8192, WINDOW as u64 + 4096),
        ];
        assert_eq!(e.execute_all(&writes).unwrap(), len as u64);
        let back = Buffer::memfd("back", len).unwrap();
        let back_id = e.register(back).unwrap();
        let reads = [io(Op::Read, back_id, 0, 0, 8192), io(Op::Read, back_id, 8192, 8192, len as u64 - 8192)];
        assert_eq!(e.execute_all(&reads).unwrap(), len as u64);
        let mut got = vec![0u8; len];
        e.buffer(back_id).unwrap().read_at(0, &mut got).unwrap();
        assert!(got == bytes, "the bytes came back");
        // Into the windowed buffer, at an offset in its last window.
        e.buffer(back_id).unwrap().write_at(0, &[0xa5; 4096]).unwrap();
        e.execute_all(&[io(Op::Write, back_id, 0, 1 << 20, 4096)]).unwrap();
        e.execute_all(&[io(Op::Read, id, 2 * WINDOW as u64 + 4096, 1 << 20, 4096)]).unwrap();
        let mut page = vec![0u8; 4096];
        e.buffer(id).unwrap().read_at(2 * WINDOW as u64 + 4096, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == 0xa5));
        // Removed: its entries are free again for the next buffer's windows.
        e.remove(id).unwrap();
        let again = e.register(Buffer::memfd("again", 3 * WINDOW).unwrap()).unwrap();
        assert_eq!(e.fixed_entries(again).len(), 3);
    }

    #[test]
    fn windows_that_do_not_fit_the_table_are_refused_and_leave_it_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(&dir, 3);
        let small = e.register(Buffer::memfd("small", 4096).unwrap()).unwrap();
        let err = e.register(Buffer::memfd("big", 3 * WINDOW).unwrap()).unwrap_err();
        assert!(matches!(err, IoError::BufferTableFull { slots: 3 }), "{err}");
        // The two free entries are still free: a two-window buffer fits.
        let two = e.register(Buffer::memfd("two", 2 * WINDOW).unwrap()).unwrap();
        assert_eq!(e.fixed_entries(two).len(), 2);
        assert_eq!(e.fixed_entries(small), vec![small.0]);
        assert!(matches!(e.add(Buffer::memfd("more", 4096).unwrap()), Err(IoError::BufferTableFull { .. })));
    }
}
