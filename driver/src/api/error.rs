//! The one place where failures become HTTP statuses, stable codes and CLI
//! exit codes.

use crate::admission::AdmitError;
use crate::protocol::service::ProtocolError;
use crate::store::StoreError;

use super::wire::ErrorBody;

/// Exit status of a CLI verb refused by the protocol (a 4xx).
pub const EXIT_REFUSED: u8 = 2;
/// Exit status of an I/O or daemon failure (a 5xx, or no daemon).
pub const EXIT_FAILED: u8 = 3;

fn body(status: u16, code: &str, field: &str, message: String) -> ErrorBody {
    ErrorBody { status, code: code.into(), field: field.into(), message }
}

pub fn from_protocol(e: &ProtocolError) -> ErrorBody {
    match e {
        ProtocolError::Refused(r) => {
            let status = match r.code {
                "unknown_publication" => 404,
                "bad_signature" | "namespace_mismatch" | "wrong_receipt" => 403,
                "bad_request" => 400,
                _ => 409,
            };
            body(status, r.code, r.field, r.message.clone())
        }
        ProtocolError::Store(s) => from_store(s),
    }
}

pub fn from_store(e: &StoreError) -> ErrorBody {
    let m = e.to_string();
    match e {
        StoreError::Admission(AdmitError::TooLarge { .. }) => body(413, "too_large", "total_chunks", m),
        StoreError::Admission(AdmitError::Timeout { .. }) => body(503, "admission_timeout", "total_chunks", m),
        StoreError::Admission(AdmitError::ZeroChunks { .. }) | StoreError::LegacySender { .. } => {
            body(400, "legacy_sender", "total_chunks", m)
        }
        StoreError::Admission(AdmitError::Aborted { .. }) => body(409, "aborted", "req_id", m),
        StoreError::Admission(AdmitError::AlreadyAdmitted { .. }) | StoreError::DuplicateRequest { .. } => {
            body(409, "duplicate_request", "req_id", m)
        }
        StoreError::UnknownPublication(_) => body(404, "unknown_publication", "publication", m),
        StoreError::WrongPhase { .. } => body(409, "wrong_state", "publication", m),
        StoreError::NotPublishable { .. } => body(409, "not_publishable", "publication", m),
        StoreError::TotalMismatch { .. } => body(400, "total_mismatch", "total_chunks", m),
        StoreError::ProtocolViolation { .. } => body(422, "protocol_violation", "chunks", m),
        StoreError::AbortedInFlight { .. } => body(409, "aborted", "publication", m),
        // A batch the engine refused before submitting anything: the request
        // was wrong, and nothing was written.
        StoreError::BatchFailed { source, .. }
            if source.is_bad_request() || matches!(source, crate::io::IoError::PathUnavailable { .. }) =>
        {
            body(422, "bad_chunk", "chunks", m)
        }
        StoreError::NoSuchChunk { .. } => body(422, "bad_chunk", "chunks", m),
        StoreError::BatchFailed { .. } => body(500, "batch_failed", "chunks", m),
        StoreError::Load { .. } => body(500, "load_failed", "chunks", m),
        StoreError::Failed(_) => body(503, "store_failed", "", m),
        StoreError::RecordTooLarge { .. } => body(413, "record_too_large", "", m),
        StoreError::Io(
            crate::io::IoError::DmabufUnsupported { .. }
            | crate::io::IoError::PathUnavailable { .. }
            | crate::io::IoError::BufferUnusable { .. }
            | crate::io::IoError::DmabufNotPinnable { .. },
        ) => body(422, "path_unavailable", "path", m),
        StoreError::Io(crate::io::IoError::BufferTableFull { .. }) => body(503, "buffer_table_full", "buffer", m),
        StoreError::Io(io) if io.is_bad_request() => body(422, "bad_chunk", "chunks", m),
        _ => body(500, "io_error", "", m),
    }
}

/// CLI exit status for an API error.
pub fn exit_code(e: &ErrorBody) -> u8 {
    if (400..500).contains(&e.status) { EXIT_REFUSED } else { EXIT_FAILED }
}
