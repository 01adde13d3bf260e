//! The one place where failures become stable codes; each code's HTTP status
//! and CLI exit status come from [`RefusalCode`](pdstor_client::code::RefusalCode), never from a table here.

use crate::admission::AdmitError;
use crate::protocol::service::ProtocolError;
use crate::store::StoreError;
use pdstor_client::code::RefusalCode as Code;
use pdstor_engine::io::IoError;

use super::wire::ErrorBody;

/// The wire body of a protocol error.
pub fn from_protocol(e: &ProtocolError) -> ErrorBody {
    match e {
        ProtocolError::Refused(r) => ErrorBody::new(r.code, r.field, r.message.clone()),
        ProtocolError::Store(s) => from_store(s),
    }
}

/// The code and offending field of a store error.
pub fn store_code(e: &StoreError) -> (Code, &'static str) {
    match e {
        StoreError::Admission(AdmitError::TooLarge { .. }) | StoreError::TooManyChunks { .. } => {
            (Code::TooLarge, "total_chunks")
        }
        StoreError::Admission(AdmitError::Timeout { .. }) => (Code::AdmissionTimeout, "total_chunks"),
        StoreError::Admission(AdmitError::ZeroChunks { .. }) | StoreError::LegacySender { .. } => {
            (Code::LegacySender, "total_chunks")
        }
        StoreError::Admission(AdmitError::Aborted { .. }) => (Code::Aborted, "req_id"),
        StoreError::Admission(AdmitError::AlreadyAdmitted { .. } | AdmitError::AlreadyWaiting { .. })
        | StoreError::DuplicateRequest { .. } => (Code::DuplicateRequest, "req_id"),
        StoreError::Admission(AdmitError::Cancelled { .. }) => (Code::Aborted, "req_id"),
        StoreError::UnknownPublication(_) => (Code::UnknownPublication, "publication"),
        StoreError::WrongPhase { .. }
        | StoreError::LoadInFlight { .. }
        | StoreError::KeyInUse { .. }
        | StoreError::BeingRead { .. }
        | StoreError::WrongClass { .. } => (Code::WrongState, "publication"),
        StoreError::NotPublishable { .. } => (Code::NotPublishable, "publication"),
        StoreError::ProtocolViolation { .. } => (Code::ProtocolViolation, "chunks"),
        StoreError::AbortedInFlight { .. } => (Code::Aborted, "publication"),
        // A batch the engine refused before submitting anything: the request
        // was wrong, and nothing was written.
        StoreError::BatchFailed { source, .. }
            if source.is_bad_request() || matches!(source, IoError::PathUnavailable { .. }) =>
        {
            (Code::BadChunk, "chunks")
        }
        StoreError::NoSuchChunk { .. } => (Code::BadChunk, "chunks"),
        StoreError::BatchFailed { .. } => (Code::BatchFailed, "chunks"),
        StoreError::Load { .. } => (Code::LoadFailed, "chunks"),
        StoreError::Failed(why) if matches!(**why, crate::store::WorkerError::NamespaceLost { .. }) => {
            (Code::NamespaceLost, "")
        }
        StoreError::Failed(_) => (Code::StoreFailed, ""),
        StoreError::RecordTooLarge { .. } => (Code::RecordTooLarge, ""),
        StoreError::Io(
            IoError::DmabufUnsupported { .. }
            | IoError::PathUnavailable { .. }
            | IoError::BufferUnusable { .. }
            | IoError::DmabufNotPinnable { .. },
        ) => (Code::PathUnavailable, "path"),
        StoreError::Io(IoError::BufferTableFull { .. }) => (Code::BufferTableFull, "buffer"),
        StoreError::Io(io) if io.is_bad_request() => (Code::BadChunk, "chunks"),
        _ => (Code::IoError, ""),
    }
}

/// The wire body of a store error.
pub fn from_store(e: &StoreError) -> ErrorBody {
    let (code, field) = store_code(e);
    ErrorBody::new(code, field, e.to_string())
}

/// CLI exit status for an error body a daemon answered.
pub fn exit_code(e: &ErrorBody) -> u8 {
    match Code::parse(&e.code) {
        Some(c) if c.is_identity() => c.exit_code(),
        _ => pdstor_client::code::exit_code_for_status(e.status),
    }
}
