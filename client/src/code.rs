//! Every stable code the daemon answers a request with, and the one mapping
//! from a code to its HTTP status and to the CLI's exit status.
//!
//! A code is what a client matches on (`ErrorBody.code` on the wire); the
//! status follows from it, never from a second table elsewhere. Refusals
//! (4xx) change nothing; failures (5xx) say the daemon or the device could
//! not do what was asked.

use std::fmt;

/// Exit status of a CLI verb refused by the daemon (a 4xx).
pub const EXIT_REFUSED: u8 = 2;
/// Exit status of an I/O or daemon failure (a 5xx, or no daemon).
pub const EXIT_FAILED: u8 = 3;
/// Exit status of a CLI verb refused for who its caller is: `unauthenticated`,
/// `forbidden` or `not_owner` (a script tells "not allowed" from "not now").
pub const EXIT_DENIED: u8 = 4;

/// The CLI's exit status for an answer with HTTP `status`.
pub fn exit_code_for_status(status: u16) -> u8 {
    if (400..500).contains(&status) { EXIT_REFUSED } else { EXIT_FAILED }
}

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = $text:literal => $status:literal,)*) => {
        /// A stable error code: what was refused or failed, as a client matches it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum RefusalCode {
            $($(#[$doc])* $variant,)*
        }

        impl RefusalCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [RefusalCode] = &[$(RefusalCode::$variant,)*];

            /// The code as it appears on the wire (`ErrorBody.code`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(RefusalCode::$variant => $text,)*
                }
            }

            /// The HTTP status the daemon answers this code with.
            pub fn status(self) -> u16 {
                match self {
                    $(RefusalCode::$variant => $status,)*
                }
            }
        }
    };
}

codes! {
    // Protocol refusals: the request names the wrong thing or comes at the wrong time.
    /// The request is malformed or out of range.
    BadRequest = "bad_request" => 400,
    /// The step needs the writer's token of the publication, and this is not it.
    NotOwner = "not_owner" => 403,
    /// The caller proved no identity (plaintext TCP, no client certificate).
    Unauthenticated = "unauthenticated" => 401,
    /// The caller's identity lacks the role, or its tenant may not do this.
    Forbidden = "forbidden" => 403,
    /// The caller's tenant holds all its quota allows.
    QuotaExceeded = "quota_exceeded" => 429,
    /// No live publication has this id.
    UnknownPublication = "unknown_publication" => 404,
    /// The receipt's signature does not verify under this namespace's key.
    BadSignature = "bad_signature" => 403,
    /// The receipt was signed with a key the namespace has rotated away from.
    KeyRotated = "key_rotated" => 403,
    /// The receipt or request names another namespace.
    NamespaceMismatch = "namespace_mismatch" => 403,
    /// The receipt is not the one this step needs (READY vs CLAIMED).
    WrongReceipt = "wrong_receipt" => 403,
    /// The receipt's request id is not the publication's.
    ReqMismatch = "req_mismatch" => 409,
    /// The receipt's manifest digest is not the publication's.
    DigestMismatch = "digest_mismatch" => 409,
    /// The receipt is from an earlier epoch of the store.
    EpochMismatch = "epoch_mismatch" => 409,
    /// Another reader or session already claimed the publication.
    AlreadyClaimed = "already_claimed" => 409,
    /// The reader expects another KV layout than the one stored.
    LayoutMismatch = "layout_mismatch" => 409,
    /// The claim's lease ran out before this step.
    LeaseExpired = "lease_expired" => 409,
    /// The publication is in a phase this step does not apply to.
    WrongState = "wrong_state" => 409,
    /// The reader's restore digest is not the manifest's.
    RestoreMismatch = "restore_mismatch" => 409,
    /// An ack for chunks the daemon never served to this claim through the
    /// data plane: a reader acknowledges what it loaded, not the manifest.
    NotLoaded = "not_loaded" => 409,
    /// The claimed reader is not fenced: its claim cannot be reclaimed yet.
    NotFenced = "not_fenced" => 409,
    /// The claim is fenced (its session closed, or made in an earlier
    /// epoch): it may no longer adopt, load or ack; only a reclaim frees it.
    Fenced = "fenced" => 409,
    /// The publication is not claimed.
    NotClaimed = "not_claimed" => 409,
    /// The read this receipt names has ended (`read/end`, its session
    /// closed, or the daemon restarted since it began): read again.
    ReadEnded = "read_ended" => 409,
    /// The publication is not READY yet.
    NotReady = "not_ready" => 409,
    /// Another reader holds the claim.
    ReaderMismatch = "reader_mismatch" => 409,
    /// Another session holds the claim.
    SessionMismatch = "session_mismatch" => 409,

    // Admission and the store.
    /// More chunks than the store has slots.
    TooLarge = "too_large" => 413,
    /// No capacity freed within the admission timeout.
    AdmissionTimeout = "admission_timeout" => 503,
    /// A request of zero chunks, or a sender that does not declare its total.
    LegacySender = "legacy_sender" => 400,
    /// The request was aborted while it waited or while a batch was in flight.
    Aborted = "aborted" => 409,
    /// The request id already has a live or admitted publication.
    DuplicateRequest = "duplicate_request" => 409,
    /// Not every chunk is stored, or the last batch was not seen.
    NotPublishable = "not_publishable" => 409,
    /// A store batch broke the protocol; the whole request was rolled back.
    ProtocolViolation = "protocol_violation" => 422,
    /// A chunk the engine refused before moving anything.
    BadChunk = "bad_chunk" => 422,
    /// A store batch failed on the device; the request was rolled back.
    BatchFailed = "batch_failed" => 500,
    /// A load failed on the device or its bytes did not match their checksum.
    LoadFailed = "load_failed" => 500,
    /// A commit failed: the store refuses every change until a restart.
    StoreFailed = "store_failed" => 503,
    /// A journal record would take more than a quarter of a journal half.
    RecordTooLarge = "record_too_large" => 413,
    /// The buffer cannot move on the requested payload path.
    PathUnavailable = "path_unavailable" => 422,
    /// The I/O thread's buffer table has no free place.
    BufferTableFull = "buffer_table_full" => 503,
    /// Any other I/O failure.
    IoError = "io_error" => 500,
    /// Fencing a direct reader's host failed: the target refused to preempt
    /// its reservation key, so its session stays open and its slots taken.
    FenceFailed = "fence_failed" => 502,

    // The control plane's own limits.
    /// The target was removed or replaced under the running daemon (`/healthz`, `/readyz`).
    TargetGone = "target_gone" => 503,
    /// This daemon is a standby (`serve --standby`): it serves no step until
    /// it takes the namespace over; ask the owner.
    Standby = "standby" => 503,
    /// This daemon lost its namespace: another owner preempted its
    /// reservation key (a standby took over). It acknowledges nothing more;
    /// ask the namespace's new owner.
    NamespaceLost = "namespace_lost" => 503,
    /// A takeover was refused or failed (no owner key to preempt, the
    /// target refused the preempt): the standby stays a standby.
    TakeoverFailed = "takeover_failed" => 409,
    /// The daemon cannot take changes now (`/readyz`).
    DaemonNotReady = "not_ready" => 503,
    /// No route at this path.
    NotFound = "not_found" => 404,
    /// The route exists but not for this method.
    MethodNotAllowed = "method_not_allowed" => 405,
    /// The request timed out.
    Timeout = "timeout" => 408,
    /// The request could not be parsed as HTTP/1.1 (its request line or a
    /// header, a conflicting or invalid Content-Length or Transfer-Encoding).
    MalformedHttp = "malformed_http" => 400,
    /// The request line is longer than the daemon reads.
    UriTooLong = "uri_too_long" => 414,
    /// The request's headers are more, or larger, than the daemon reads.
    HeadersTooLarge = "headers_too_large" => 431,
    /// The request body is over `--max-body`.
    BodyTooLarge = "body_too_large" => 413,
    /// The request body did not arrive within `--body-timeout-ms`.
    BodyTimeout = "body_timeout" => 408,
    /// The request body is not JSON.
    UnsupportedMediaType = "unsupported_media_type" => 415,
    /// A handler failed unexpectedly.
    Internal = "internal" => 500,
    /// `--max-prepares` prepares are already being handled.
    TooManyPrepares = "too_many_prepares" => 503,
    /// `--max-http-connections` or `--max-data-connections` are open.
    TooManyConnections = "too_many_connections" => 503,

    // The data plane.
    /// A frame is over the data plane's frame limit.
    FrameTooLarge = "frame_too_large" => 413,
    /// The chunk names a buffer not registered on this connection.
    UnknownBuffer = "unknown_buffer" => 400,
    /// The buffer sent cannot be used (length, mapping, import).
    BadBuffer = "bad_buffer" => 400,
    /// A register request came without the file descriptors it needs.
    NoFd = "no_fd" => 400,
    /// The connection holds `--max-buffers-per-connection` buffers.
    TooManyBuffers = "too_many_buffers" => 429,
    /// The connection pins `--max-pinned-per-connection` bytes.
    TooManyBytes = "too_many_bytes" => 429,
    /// The probes saw a transfer leave the native path (`require_native`).
    NotNative = "not_native" => 500,
}

impl RefusalCode {
    /// The CLI's exit status for this code.
    pub fn exit_code(self) -> u8 {
        if self.is_identity() { EXIT_DENIED } else { exit_code_for_status(self.status()) }
    }

    /// A refusal for who the caller is, not for what it asked.
    pub fn is_identity(self) -> bool {
        matches!(self, RefusalCode::Unauthenticated | RefusalCode::Forbidden | RefusalCode::NotOwner)
    }

    /// The code spelled `s` on the wire (the first, where two share it).
    pub fn parse(s: &str) -> Option<RefusalCode> {
        RefusalCode::ALL.iter().copied().find(|c| c.as_str() == s)
    }
}

impl fmt::Display for RefusalCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for RefusalCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_snake_case_with_an_error_status() {
        for c in RefusalCode::ALL {
            let s = c.as_str();
            assert!(!s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{c:?}: {s:?}");
            assert!((400..600).contains(&c.status()), "{c:?}: {}", c.status());
        }
    }

    #[test]
    fn one_spelling_means_one_status_except_readiness() {
        for a in RefusalCode::ALL {
            for b in RefusalCode::ALL {
                if a != b && a.as_str() == b.as_str() {
                    // A publication not READY (409) and a daemon not ready (503)
                    // share a spelling on the wire for compatibility.
                    let pair = [*a, *b];
                    assert!(pair.contains(&RefusalCode::NotReady) && pair.contains(&RefusalCode::DaemonNotReady));
                }
            }
        }
    }

    #[test]
    fn refusals_and_failures_exit_differently() {
        assert_eq!(RefusalCode::WrongState.exit_code(), EXIT_REFUSED);
        assert_eq!(RefusalCode::TooManyBuffers.exit_code(), EXIT_REFUSED);
        assert_eq!(RefusalCode::StoreFailed.exit_code(), EXIT_FAILED);
        assert_eq!(RefusalCode::BatchFailed.exit_code(), EXIT_FAILED);
        for c in [RefusalCode::Unauthenticated, RefusalCode::Forbidden, RefusalCode::NotOwner] {
            assert_eq!(c.exit_code(), EXIT_DENIED, "{c:?}");
            assert_eq!(RefusalCode::parse(c.as_str()), Some(c));
        }
    }
}
