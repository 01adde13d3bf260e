//! Opening a store after any stop, clean or not (DESIGN §3): replay the
//! active journal half onto an empty state, then start a new epoch — roll
//! back every publication that was never published, give each surviving
//! one its reservation back, and make all of it durable before the first
//! request is served.

use std::path::Path;
use std::sync::Arc;

use super::backing::Backing;
use super::batch::Batches;
use super::error::StoreError;
use super::io_thread::Opened;
use super::state::State;
use super::{Phase, Record, RecoveryReport, Store, journal};

/// What replaying the journal rebuilt.
pub(super) struct Replayed {
    /// The state the records describe.
    pub state: State,
    /// The sequence number the next record takes.
    pub next_seq: u64,
    /// Where in the active half appends continue.
    pub journal_end: u64,
    /// What replay found, so far.
    pub report: RecoveryReport,
}

/// Applies every good record of the active journal half, in order.
pub(super) fn replay(path: &Path, opened: &Opened) -> Result<Replayed, StoreError> {
    let sb = &opened.superblock;
    let mut state = State::new(sb.slot_count, sb.slot_size, sb.data_offset);
    state.epoch = sb.epoch;
    let (records, end, stop) = journal::replay(&opened.journal, sb.journal_start_seq);
    let report = RecoveryReport {
        journal_stop: stop.map(|s| {
            format!("journal stops at byte {} (record {}): {}; later records ignored", s.offset, s.seq, s.reason)
        }),
        superblock_note: opened.note.clone(),
        records_replayed: records.len(),
        ..Default::default()
    };
    for (seq, r) in &records {
        state.apply(r).map_err(|source| StoreError::Replay { path: path.into(), seq: *seq, source })?;
    }
    let next_seq = records.last().map_or(sb.journal_start_seq, |(s, _)| s + 1);
    Ok(Replayed { state, next_seq, journal_end: end as u64, report })
}

impl Store {
    /// Starts a new epoch on a replayed store: the superblock first (its
    /// write is the durable bump), then an ABORT for every publication never
    /// published, the EPOCH record, and the reservations of the survivors;
    /// all committed before this returns.
    pub(super) fn begin_epoch(&self, report: &mut RecoveryReport) -> Result<(), StoreError> {
        let mut next_sb = self.superblock();
        next_sb.epoch += 1;
        next_sb.generation += 1;
        next_sb.owner_key = self.opts.owner_key;
        self.write_superblock(next_sb.clone())?;
        *self.lock_sb() = next_sb.clone();
        {
            let mut live = self.lock_live();
            let prepared: Vec<u64> = live
                .state
                .pubs
                .values()
                .filter(|p| matches!(p.phase, Phase::Prepared | Phase::Aborting))
                .map(|p| p.id)
                .collect();
            for id in prepared {
                self.log(
                    &mut live,
                    Record::Abort { publication: id, reason: "rolled back at recovery: never published".into() },
                )?;
                report.rolled_back.push(id);
            }
            self.log(&mut live, Record::Epoch { epoch: next_sb.epoch })?;
            let held: Vec<(u64, String, u64)> =
                live.state.pubs.values().map(|p| (p.id, p.req_id.clone(), p.slots.len() as u64)).collect();
            for (id, req, n) in held {
                self.admission.restore(&req, n)?;
                live.batches.insert(id, Batches { seen_first: true, published: true, ..Default::default() });
            }
            report.live = live.state.pubs.len();
            report.epoch = next_sb.epoch;
            live.state.check().map_err(|source| StoreError::Recovered { path: self.path.clone(), source })?;
        }
        self.commit()?;
        Ok(())
    }
}

/// What a target holds, read without changing a byte of it.
#[derive(Debug, Clone)]
pub struct Inspection {
    /// The superblock copy recovery would choose.
    pub superblock: pdstor_client::superblock::Superblock,
    /// What replay found; `epoch` is the current one (not bumped), and
    /// `rolled_back` lists what the next open would roll back.
    pub report: RecoveryReport,
    /// Every publication the journal describes.
    pub publications: Vec<super::Publication>,
    /// Slots no publication owns.
    pub free_slots: u64,
}

/// Replays the journal of `path` read-only: no epoch bump, no record, no
/// rollback written — outstanding claims stay exactly as fenced as they were.
pub fn inspect(path: &Path) -> Result<Inspection, StoreError> {
    use pdstor_engine::io::{Target, TargetOptions};
    let target = Target::open(path, &TargetOptions { create_len: None, allocate: false, read_only: false })?;
    let (io, opened) =
        super::io_thread::IoThread::start(path, Backing::Target(target), 8, 0, 1, Arc::new(super::storage::Media))?;
    // The thread waits for a resume it will never get: stopping it writes nothing.
    io.stop(false);
    let replayed = replay(path, &opened)?;
    let mut report = replayed.report;
    let state = replayed.state;
    report.epoch = state.epoch;
    report.rolled_back =
        state.pubs.values().filter(|p| matches!(p.phase, Phase::Prepared | Phase::Aborting)).map(|p| p.id).collect();
    report.live = state.pubs.len() - report.rolled_back.len();
    Ok(Inspection {
        superblock: opened.superblock,
        report,
        publications: state.pubs.values().cloned().collect(),
        free_slots: state.free_slots(),
    })
}
