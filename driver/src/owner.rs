//! Owning a shared namespace by its NVMe persistent reservation (DESIGN §11,
//! docs/owners.md): taking it as its owner, taking it over from a dead one,
//! and learning that it was lost.
//!
//! The owner holds an Exclusive Access — All Registrants reservation with its
//! key, and the superblock records that key for the epoch it began. A
//! standby takes the namespace over by preempting (and aborting) exactly that
//! key: from then on the target refuses every command of the old owner's
//! host, so a partitioned or hung old owner cannot write a byte — split brain
//! is stopped at the device, not by a timer. Only one preempt of a key can
//! succeed, so of two standbys racing, one wins and the other stays a
//! standby.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::store::Store;
use pdstor_client::superblock::{SUPERBLOCK_BYTES, Superblock};
use pdstor_engine::io::persistent_reservation::{ReservationFailure, Reservations};
use pdstor_engine::io::{Engine, EngineOptions, Target, TargetOptions};

/// The namespace, held: this host's registration and reservation with `key`.
#[derive(Debug)]
pub struct Held {
    /// The reservation commands on the namespace.
    pub reservations: Reservations,
    /// This owner's key.
    pub key: u64,
    /// The old owner's key this host preempted (a takeover), if any.
    pub preempted: Option<u64>,
    /// The superblock as it was before this owner's epoch began.
    pub before: Superblock,
}

/// Reads the namespace's superblock as a reader host does — read-only,
/// `O_DIRECT`, writing nothing — and picks the copy recovery would (the
/// valid one with the higher generation): a dead owner may have torn copy A
/// mid-update, and a takeover must still see whose the namespace is.
pub fn read_superblock(path: &Path) -> anyhow::Result<Superblock> {
    let target = Target::open(path, &TargetOptions { read_only: true, ..Default::default() })
        .with_context(|| format!("opening {} read-only", path.display()))?;
    let mut engine = Engine::new(target, EngineOptions::default())
        .with_context(|| format!("an engine on {} to read its superblock", path.display()))?;
    let capacity = engine.geometry().capacity;
    let mut read = |offset: u64| {
        engine
            .read_to_vec(offset, SUPERBLOCK_BYTES as u64)
            .with_context(|| format!("reading the superblock of {} at byte {offset}", path.display()))
    };
    let a = Superblock::decode(&read(0)?);
    // Copy B sits after the journal, whose size copy A gives; without A, at
    // any size `format` can choose.
    let offsets: Vec<u64> = match &a {
        Ok(sb) => vec![sb.copy_b_offset()],
        Err(_) => crate::store::JOURNAL_HALF_CHOICES.map(|j| SUPERBLOCK_BYTES as u64 + 2 * j).to_vec(),
    };
    let mut b = Err(pdstor_client::superblock::SuperblockError::NotPdstor { found: "(copy B not found)".into() });
    for offset in offsets.into_iter().filter(|o| o + SUPERBLOCK_BYTES as u64 <= capacity) {
        match Superblock::decode(&read(offset)?) {
            Ok(sb) if sb.copy_b_offset() == offset => {
                b = Ok(sb);
                break;
            }
            Ok(_) => {}
            Err(e) if b.is_err() => b = Err(e),
            Err(_) => {}
        }
    }
    let (sb, _) = pdstor_client::superblock::choose(a, b).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(sb)
}

/// Takes the namespace at `path` with `key`: registers it, checks the
/// superblock's owner key, and reserves. Where the superblock names another
/// owner's key, `takeover` preempts (and aborts) it; without `takeover`
/// the namespace is not this host's — it was taken over — and this refuses,
/// unregistered again, having written nothing.
pub fn hold(path: &Path, key: u64, takeover: bool) -> anyhow::Result<Held> {
    let r = Reservations::open(path)?;
    // Where the kernel reads the registered keys, a host whose key is gone
    // while others hold the namespace was preempted: refused before it
    // registers again (which would let it in).
    if !takeover
        && let Some(keys) = r.keys()?
        && !keys.is_empty()
        && !keys.contains(&key)
    {
        let keys: Vec<String> = keys.iter().map(|k| format!("{k:#x}")).collect();
        bail!(
            "the namespace at {} is held by reservation keys [{}], not this daemon's key {key:#x}: it was taken over (this host's key was preempted), so this host is no longer its owner and writes nothing. Run it as the owner's standby (serve --standby --owner URL), or, if that owner is gone for good, take the namespace over (serve --standby, then `pdstor takeover`)",
            path.display(),
            keys.join(", ")
        );
    }
    r.register(key).map_err(|e| {
        anyhow::anyhow!("{e}: serve without --reservation-key, or on a namespace with persistent reservations")
    })?;
    let before =
        read_superblock(path).context("reading the namespace's superblock after registering this host's key")?;
    let owner = before.owner_key;
    let preempted = if owner == 0 || owner == key {
        None
    } else if takeover {
        r.preempt(key, owner).map_err(|e| {
            anyhow::anyhow!(
                "taking namespace {} over: {e}; the old owner's key {owner:#x} (epoch {}) is still registered, or another standby preempted it first: this daemon stays a standby",
                before.uuid,
                before.epoch
            )
        })?;
        Some(owner)
    } else {
        bail!(
            "namespace {} is held by reservation key {owner:#x} since epoch {}, not this daemon's key {key:#x}: it was taken over, so this host is no longer its owner and writes nothing (this host stays registered until that owner fences it or clears the reservation). Run it as that owner's standby (serve --standby --owner URL), or, if the owner with key {owner:#x} is gone for good, take the namespace over (serve --standby, then `pdstor takeover`)",
            before.uuid,
            before.epoch
        );
    };
    match r.reserve(key) {
        Ok(()) => {}
        // Linux's nvmet names one holder even of an All Registrants
        // reservation, and refuses the others' acquire; in that type every
        // registrant has access, so a registered host holds it all the same.
        Err(e) if e.kind == ReservationFailure::Conflict && r.registered(key)? => {
            tracing::info!(
                key = format!("{key:#x}"),
                "the reservation is held by another registrant's acquire; this host is registered, so it has access (exclusive access, all registrants)"
            );
        }
        Err(e) => return Err(e.into()),
    }
    Ok(Held { reservations: r, key, preempted, before })
}

/// Checks every `every` that this owner's key is still registered at the
/// target ([`Reservations::registered`], which changes nothing): once it is
/// not, another owner preempted it, and the store is lost ([`Store::lose`]). A failed path says nothing either way —
/// a partitioned owner learns it was taken over when the path comes back.
/// Stops when the flag returned is set.
pub fn watch(
    store: Arc<Store>,
    path: &Path,
    key: u64,
    every: Duration,
) -> anyhow::Result<(Arc<AtomicBool>, std::thread::JoinHandle<()>)> {
    Reservations::open(path)?;
    let path = path.to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let handle = std::thread::Builder::new().name("pdstor-owner".into()).spawn(move || {
        // The last failure said, and how many checks failed since a good one.
        let (mut failed, mut failures) = (None::<String>, 0u64);
        while !flag.load(Ordering::SeqCst) {
            std::thread::sleep(every);
            // Opened afresh each time: a fabric that reconnects may give the
            // namespace a new device at the same path.
            match Reservations::open(&path).and_then(|r| r.registered(key)) {
                Ok(true) => {
                    if failed.take().is_some() {
                        tracing::info!(key = format!("{key:#x}"), failures, "the path to the target is back; this owner's key is still registered");
                    }
                    failures = 0;
                }
                Ok(false) => {
                    store.lose(format!(
                        "this host's reservation key {key:#x} is no longer registered at the target: another owner preempted it (a standby took the namespace over)"
                    ));
                    return;
                }
                Err(e) => {
                    failures += 1;
                    // Said when the failure changes, not at every check.
                    let why = e.to_string();
                    if failed.as_deref() != Some(why.as_str()) {
                        tracing::warn!(
                            error = %why,
                            failures,
                            "checking this owner's reservation failed; whether the namespace is still this owner's is unknown until the target answers (its writes cannot reach the target either)"
                        );
                        failed = Some(why);
                    }
                }
            }
        }
    })?;
    Ok((stop, handle))
}

/// A standby's start: registers its key (a registrant may read), reads
/// whose the namespace is, and refuses what a takeover could not make safe —
/// a target without persistent reservations, an owner that holds none.
/// Answers the superblock it read.
pub fn stand_by(path: &Path, key: u64) -> anyhow::Result<Superblock> {
    let r = Reservations::open(path)?;
    r.register(key).map_err(|e| {
        anyhow::anyhow!(
            "--standby: {e}: a standby takes a namespace over by preempting its owner's reservation, which this target cannot do"
        )
    })?;
    let sb = read_superblock(path)?;
    match sb.owner_key {
        0 => bail!(
            "--standby: namespace {} (epoch {}) has an owner that holds no reservation, so a standby could not fence it: serve the owner with --reservation-key",
            sb.uuid,
            sb.epoch
        ),
        k if k == key => tracing::warn!(
            key = format!("{key:#x}"),
            "the namespace's last owner held this standby's own key (this host owned it before): a takeover preempts nothing"
        ),
        _ => {}
    }
    Ok(sb)
}

/// A standby's judgement of its owner's health checks: a run of failures as
/// long as `takeover_after` means the owner is gone, and it is time to take
/// the namespace over.
#[derive(Debug)]
pub struct OwnerHealth {
    takeover_after: Duration,
    failing_since: Option<Instant>,
}

impl OwnerHealth {
    /// No check failed yet.
    pub fn new(takeover_after: Duration) -> OwnerHealth {
        OwnerHealth { takeover_after, failing_since: None }
    }

    /// One check of the owner at `owner` answered `health`: why to take
    /// over now, if the failures have run long enough.
    pub fn checked(&mut self, owner: &str, health: Result<(), String>) -> Option<String> {
        let why = match health {
            Ok(()) => {
                if self.failing_since.take().is_some() {
                    tracing::info!(owner = %owner, "the owner answers again");
                }
                return None;
            }
            Err(why) => why,
        };
        let since = *self.failing_since.get_or_insert_with(|| {
            tracing::warn!(owner = %owner, error = %why, "the owner's health check failed");
            Instant::now()
        });
        (since.elapsed() >= self.takeover_after).then(|| {
            format!("the owner at {owner} failed its health checks for {} ms ({why})", since.elapsed().as_millis())
        })
    }

    /// A takeover was tried and failed: the owner's failures count from now.
    pub fn takeover_failed(&mut self) {
        self.failing_since = Some(Instant::now());
    }
}

/// `POST /storage-pd/admin/takeover` asked of the owner itself: refused
/// 409 `takeover_failed`, naming its namespace and epoch (a takeover is a
/// standby's).
pub fn takeover_asked_of_owner(store: &Store) -> pdstor_client::wire::ErrorBody {
    let sb = store.superblock();
    pdstor_client::wire::ErrorBody::new(
        pdstor_client::code::RefusalCode::TakeoverFailed,
        "",
        format!(
            "this daemon owns namespace {} already (epoch {}): a takeover is asked of a standby",
            sb.uuid, sb.epoch
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_taken_over_only_after_a_whole_run_of_failed_checks() {
        let mut patient = OwnerHealth::new(Duration::from_secs(3600));
        assert_eq!(patient.checked("o", Err("refused".into())), None, "one failure is not a run");
        assert_eq!(patient.checked("o", Ok(())), None);
        assert!(patient.failing_since.is_none(), "an answer ends the run");
        let mut eager = OwnerHealth::new(Duration::ZERO);
        assert_eq!(eager.checked("o", Ok(())), None, "a healthy owner is never taken over");
        let why = eager.checked("http://owner:1", Err("connection refused".into())).expect("the run is long enough");
        assert!(why.contains("http://owner:1") && why.contains("connection refused"), "{why}");
        eager.takeover_failed();
        assert!(eager.failing_since.is_some(), "a failed takeover keeps counting the owner's failures");
    }
}
