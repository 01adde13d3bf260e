//! Admission control (DESIGN §5, after LMCache's reservation design): a
//! request reserves its whole chunk set before any of its chunks is placed, or
//! waits — on a condition, up to a finite timeout — until capacity frees. So N
//! concurrent chunked prefills can never each half-fill the store and deadlock.
//!
//! [`ReservationManager`] counts reserved slots; [`StagingPool`] is the
//! writer-side flow control for the host-staged path. Neither knows where the
//! slots are: `store/` maps reservations to concrete slots.

mod reservation;
mod staging;

pub use reservation::{
    AdmissionCounters, CancelToken, MonotonicClock, ReservationManager, ReservationStats, WaitClock,
};
pub use staging::{StagingError, StagingPool};

/// The key a request is admitted under (the engine's `req_id`).
pub type ReqId = String;

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// A request of 0 chunks.
    #[error(
        "request {req}: 0 chunks declared; a request must declare total_chunks > 0 (legacy senders are not supported)"
    )]
    ZeroChunks {
        /// The request.
        req: ReqId,
    },
    /// More chunks than the store has slots: it can never fit.
    #[error(
        "request {req} needs {needed} slots but the store has only {capacity} in all: it can never fit; use fewer or smaller chunks, or a larger target"
    )]
    TooLarge {
        /// The request.
        req: ReqId,
        /// Slots it needs.
        needed: u64,
        /// Slots in all.
        capacity: u64,
    },
    /// The request already holds a reservation.
    #[error("request {req} is already admitted (holding {held} slots)")]
    AlreadyAdmitted {
        /// The request.
        req: ReqId,
        /// Slots it holds.
        held: u64,
    },
    /// No capacity freed within the admission timeout.
    #[error(
        "request {req} waited {waited_ms} ms for {needed} slots; {free} of {capacity} were free (held by {holders} requests): retry later or raise the admission timeout"
    )]
    Timeout {
        /// The request.
        req: ReqId,
        /// Slots it needs.
        needed: u64,
        /// Slots free when it gave up.
        free: u64,
        /// Slots in all.
        capacity: u64,
        /// Requests holding reservations.
        holders: usize,
        /// How long it waited, in ms.
        waited_ms: u64,
    },
    /// The request was aborted while it waited.
    #[error("request {req} was aborted while waiting for admission")]
    Aborted {
        /// The request.
        req: ReqId,
    },
    /// The request is already waiting for admission: a second prepare of it
    /// would change nothing of the first's, so it is refused.
    #[error(
        "request {req} is already waiting for admission ({waiting} chunks): wait for that prepare's answer, or cancel it (POST /storage-pd/cancel)"
    )]
    AlreadyWaiting {
        /// The request.
        req: ReqId,
        /// Chunks the waiting prepare asked for.
        waiting: u64,
    },
    /// The client that asked gave up (disconnected) while it waited.
    #[error("request {req} gave up waiting for admission (its client went away)")]
    Cancelled {
        /// The request.
        req: ReqId,
    },
}

/// What [`ReservationManager::check`] found broken: a bug in admission, never
/// a caller's mistake.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionInvariant {
    /// More is reserved than there is, or the holders do not add up to it.
    #[error("reserved {reserved} (holders sum {held}) vs capacity {capacity}")]
    Reserved {
        /// Slots reserved.
        reserved: u64,
        /// The sum of every holder's reservation.
        held: u64,
        /// Slots there are.
        capacity: u64,
    },
    /// A request is both in the waiting queue and a holder.
    #[error("request {req} both waits and holds a reservation")]
    WaitsAndHolds {
        /// The request.
        req: String,
    },
}
