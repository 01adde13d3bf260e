//! Whether the target the store opened is still the one at its path. The
//! daemon holds it open, so a target removed (or replaced by another file)
//! under it goes on working — until the daemon exits, when what it stored
//! is gone with the descriptor, or a restart opens the other file. The
//! health endpoints ask; the first time it is seen it is said at ERROR.
//!
//! And whether the namespace is still this owner's: on a shared namespace a
//! standby that takes over preempts this owner's reservation key, and from
//! then on the target refuses its commands. Once the daemon learns it (its
//! own check, or a write refused), the store is *lost*: every change is
//! refused and the health endpoints say so, for good.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::Store;
use super::error::WorkerError;
use pdstor_engine::io::{WriteCache, WriteCacheProbe};

/// The device and inode the store opened at its path.
#[derive(Debug)]
pub(super) struct Presence {
    opened: Option<(u64, u64)>,
    said: AtomicBool,
    /// Why the namespace is no longer this owner's, once it is not.
    lost: Mutex<Option<String>>,
    /// How the target's write cache is read.
    write_cache: Option<WriteCacheProbe>,
}

impl Presence {
    /// What is at `path` now, just after the store opened it.
    pub(super) fn at(path: &Path, write_cache: Option<WriteCacheProbe>) -> Presence {
        Presence {
            opened: std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino())),
            said: AtomicBool::new(false),
            lost: Mutex::new(None),
            write_cache,
        }
    }

    /// A store on memory: at no path, never gone, its write cache not probed.
    pub(super) fn nowhere() -> Presence {
        Presence { opened: None, said: AtomicBool::new(false), lost: Mutex::new(None), write_cache: None }
    }

    /// Why the target at `path` is not the one opened, if it is not.
    pub(super) fn gone(&self, path: &Path) -> Option<String> {
        let (dev, ino) = self.opened?;
        let why = match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "was removed",
            Err(_) => return None,
            Ok(m) if (m.dev(), m.ino()) != (dev, ino) => "was replaced by another file",
            Ok(_) => return None,
        };
        let message = format!(
            "the target {} {why} while the daemon serves it: what it stores lives only in the descriptor it holds until it exits, and a restart would not find it (or would open the other file); send no new work, put the target back at its path, then restart",
            path.display()
        );
        if !self.said.swap(true, Ordering::Relaxed) {
            tracing::error!("{message}");
        }
        Some(message)
    }
}

impl Presence {
    /// Records that the namespace is no longer this owner's (said at ERROR
    /// the first time).
    pub(super) fn lose(&self, path: &Path, why: &str) {
        let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        if lost.is_none() {
            tracing::error!(
                target = %path.display(),
                "the namespace is lost: {why}; this daemon acknowledges nothing more (every route answers 503 namespace_lost); its new owner serves it"
            );
            *lost = Some(why.to_owned());
        }
    }
}

impl Store {
    /// The namespace is no longer this owner's (`why`: who took it, how it
    /// was seen): every change is refused from now on, said at ERROR once.
    /// Nothing is written — the target would refuse it anyway.
    pub fn lose(&self, why: String) {
        let mut live = self.lock_live();
        let _ = self.lose_locked(&mut live, why);
    }

    /// [`lose`](Self::lose) under the state lock; answers the refusal.
    pub(super) fn lose_locked(&self, live: &mut super::Live, why: String) -> super::StoreError {
        self.presence.lose(&self.path, &why);
        self.failed_locked(live, Arc::new(WorkerError::NamespaceLost { why }))
    }

    /// Why the namespace is no longer this owner's, if it is not.
    pub fn lost(&self) -> Option<String> {
        self.presence.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The target's write cache now: whether a commit's flushes are issued
    /// ([`pdstor_engine::io::WriteCache`]).
    pub fn write_cache(&self) -> WriteCache {
        self.presence.write_cache.as_ref().map_or_else(
            || WriteCache::Volatile { source: "not probed: assumed volatile".into() },
            WriteCacheProbe::current,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_or_replaced_target_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("t.img");
        std::fs::write(&t, b"x").unwrap();
        // Held open, as the daemon holds its target: its inode is not reused.
        let _held = std::fs::File::open(&t).unwrap();
        let p = Presence::at(&t, None);
        assert_eq!(p.gone(&t), None);
        std::fs::remove_file(&t).unwrap();
        assert!(p.gone(&t).unwrap().contains("was removed"));
        std::fs::write(&t, b"y").unwrap();
        assert!(p.gone(&t).unwrap().contains("was replaced by another file"));
    }
}
