"""Exceptions of pdstor: one class per refusal code the daemon answers.

Every exception is a :class:`pdstor.Error` carrying ``code`` (the daemon's
stable code, e.g. ``"admission_timeout"``), ``status`` (its HTTP status),
``field`` (the request field at fault) and ``message`` (what failed, on what
input, and what to do). Match on the class::

    try:
        writer.prepare("req-1", layout, total_chunks=64, timeout_ms=2000)
    except pdstor.AdmissionTimeout as e:
        ...  # no capacity freed within 2 s; nothing was reserved

A load that fails — on the device, or because a chunk's bytes do not match
their crc32c — raises :class:`LoadFailed` (or its subclass
:class:`VerifyFailed`), never a silent miss.
"""

from __future__ import annotations


class Error(Exception):
    """Base of every pdstor error."""

    code: str = "error"
    status: int = 0

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None, field: str = ""):
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status

    def __str__(self) -> str:
        where = f" ({self.field})" if self.field else ""
        return f"{self.code}{where}: {self.message}"


class BadRequest(Error, ValueError):
    """The request is malformed or out of range."""

    code = "bad_request"
    status = 400


class NotOwner(Error):
    """The step needs the writer's token of the publication, and this is not it."""

    code = "not_owner"
    status = 403


class Unauthenticated(Error):
    """The caller proved no identity (plaintext TCP, no client certificate)."""

    code = "unauthenticated"
    status = 401


class Forbidden(Error):
    """The caller's identity lacks the role, or its tenant may not do this."""

    code = "forbidden"
    status = 403


class QuotaExceeded(Error):
    """The caller's tenant holds all its quota allows."""

    code = "quota_exceeded"
    status = 429


class UnknownPublication(Error):
    """No live publication has this id."""

    code = "unknown_publication"
    status = 404


class BadSignature(Error):
    """The receipt's signature does not verify under this namespace's key."""

    code = "bad_signature"
    status = 403


class KeyRotated(Error):
    """The receipt was signed with a key the namespace has rotated away from."""

    code = "key_rotated"
    status = 403


class NamespaceMismatch(Error):
    """The receipt or request names another namespace."""

    code = "namespace_mismatch"
    status = 403


class WrongReceipt(Error):
    """The receipt is not the one this step needs (READY vs CLAIMED)."""

    code = "wrong_receipt"
    status = 403


class ReqMismatch(Error):
    """The receipt's request id is not the publication's."""

    code = "req_mismatch"
    status = 409


class DigestMismatch(Error):
    """The receipt's manifest digest is not the publication's."""

    code = "digest_mismatch"
    status = 409


class EpochMismatch(Error):
    """The receipt is from an earlier epoch of the store."""

    code = "epoch_mismatch"
    status = 409


class AlreadyClaimed(Error):
    """Another reader or session already claimed the publication."""

    code = "already_claimed"
    status = 409


class LayoutMismatch(Error):
    """The reader expects another KV layout than the one stored."""

    code = "layout_mismatch"
    status = 409


class LeaseExpired(Error):
    """The claim's lease ran out before this step."""

    code = "lease_expired"
    status = 409


class WrongState(Error):
    """The publication is in a phase this step does not apply to."""

    code = "wrong_state"
    status = 409


class RestoreMismatch(Error):
    """The reader's restore digest is not the manifest's."""

    code = "restore_mismatch"
    status = 409


class NotLoaded(Error):
    """An ack for chunks the daemon never served to this claim through the data
    plane: a reader acknowledges what it loaded, not the manifest."""

    code = "not_loaded"
    status = 409


class NotFenced(Error):
    """The claimed reader is not fenced: its claim cannot be reclaimed yet."""

    code = "not_fenced"
    status = 409


class Fenced(Error):
    """The claim is fenced (its session closed, or made in an earlier epoch): it
    may no longer adopt, load or ack; only a reclaim frees it."""

    code = "fenced"
    status = 409


class NotClaimed(Error):
    """The publication is not claimed."""

    code = "not_claimed"
    status = 409


class ReadEnded(Error):
    """The read this receipt names has ended (read/end, its session closed, or
    the daemon restarted since it began): read again."""

    code = "read_ended"
    status = 409


class NotReady(Error):
    """The publication is not READY yet (409), or the daemon cannot take changes
    now (503, /readyz)."""

    code = "not_ready"
    status = 409


class ReaderMismatch(Error):
    """Another reader holds the claim."""

    code = "reader_mismatch"
    status = 409


class SessionMismatch(Error):
    """Another session holds the claim."""

    code = "session_mismatch"
    status = 409


class TooLarge(Error):
    """More chunks than the store has slots."""

    code = "too_large"
    status = 413


class AdmissionTimeout(Error, TimeoutError):
    """No capacity freed within the admission timeout."""

    code = "admission_timeout"
    status = 503


class LegacySender(Error):
    """A request of zero chunks, or a sender that does not declare its total."""

    code = "legacy_sender"
    status = 400


class Aborted(Error):
    """The request was aborted while it waited or while a batch was in flight."""

    code = "aborted"
    status = 409


class DuplicateRequest(Error):
    """The request id already has a live or admitted publication."""

    code = "duplicate_request"
    status = 409


class NotPublishable(Error):
    """Not every chunk is stored, or the last batch was not seen."""

    code = "not_publishable"
    status = 409


class ProtocolViolation(Error):
    """A store batch broke the protocol; the whole request was rolled back."""

    code = "protocol_violation"
    status = 422


class BadChunk(Error):
    """A chunk the engine refused before moving anything."""

    code = "bad_chunk"
    status = 422


class BatchFailed(Error):
    """A store batch failed on the device; the request was rolled back."""

    code = "batch_failed"
    status = 500


class LoadFailed(Error):
    """A load failed on the device or its bytes did not match their checksum."""

    code = "load_failed"
    status = 500


class StoreFailed(Error):
    """A commit failed: the store refuses every change until a restart."""

    code = "store_failed"
    status = 503


class RecordTooLarge(Error):
    """A journal record would take more than a quarter of a journal half."""

    code = "record_too_large"
    status = 413


class PathUnavailable(Error):
    """The buffer cannot move on the requested payload path."""

    code = "path_unavailable"
    status = 422


class BufferTableFull(Error):
    """The I/O thread's buffer table has no free place."""

    code = "buffer_table_full"
    status = 503


class IoError(Error):
    """Any other I/O failure."""

    code = "io_error"
    status = 500


class FenceFailed(Error):
    """Fencing a direct reader's host failed: the target refused to preempt its
    reservation key, so its session stays open and its slots taken."""

    code = "fence_failed"
    status = 502


class NotFound(Error):
    """No route at this path."""

    code = "not_found"
    status = 404


class MethodNotAllowed(Error):
    """The route exists but not for this method."""

    code = "method_not_allowed"
    status = 405


class RequestTimeout(Error, TimeoutError):
    """The request timed out."""

    code = "timeout"
    status = 408


class MalformedHttp(Error):
    """The request could not be parsed as HTTP/1.1 (its request line or a
    header, a conflicting or invalid Content-Length or Transfer-Encoding)."""

    code = "malformed_http"
    status = 400


class UriTooLong(Error):
    """The request line is longer than the daemon reads."""

    code = "uri_too_long"
    status = 414


class HeadersTooLarge(Error):
    """The request's headers are more, or larger, than the daemon reads."""

    code = "headers_too_large"
    status = 431


class TargetGone(Error):
    """The target was removed or replaced under the running daemon
    (/healthz, /readyz): put it back at its path, then restart."""

    code = "target_gone"
    status = 503


class Standby(Error):
    """This daemon is a standby (serve --standby): it serves no step until it
    takes the namespace over; ask the owner."""

    code = "standby"
    status = 503


class NamespaceLost(Error):
    """This daemon lost its namespace (a standby preempted its reservation
    key) and acknowledges nothing more: ask the namespace's new owner."""

    code = "namespace_lost"
    status = 503


class TakeoverFailed(Error):
    """A takeover was refused or failed; the standby stays a standby."""

    code = "takeover_failed"
    status = 409


class BodyTooLarge(Error):
    """The request body is over --max-body."""

    code = "body_too_large"
    status = 413


class BodyTimeout(Error):
    """The request body did not arrive within --body-timeout-ms."""

    code = "body_timeout"
    status = 408


class UnsupportedMediaType(Error):
    """The request body is not JSON."""

    code = "unsupported_media_type"
    status = 415


class Internal(Error):
    """A handler failed unexpectedly."""

    code = "internal"
    status = 500


class TooManyPrepares(Error):
    """--max-prepares prepares are already being handled."""

    code = "too_many_prepares"
    status = 503


class TooManyConnections(Error):
    """--max-http-connections or --max-data-connections are open."""

    code = "too_many_connections"
    status = 503


class FrameTooLarge(Error):
    """A frame is over the data plane's frame limit."""

    code = "frame_too_large"
    status = 413


class UnknownBuffer(Error):
    """The chunk names a buffer not registered on this connection."""

    code = "unknown_buffer"
    status = 400


class BadBuffer(Error):
    """The buffer sent cannot be used (length, mapping, import)."""

    code = "bad_buffer"
    status = 400


class NoFd(Error):
    """A register request came without the file descriptors it needs."""

    code = "no_fd"
    status = 400


class TooManyBuffers(Error):
    """The connection holds --max-buffers-per-connection buffers."""

    code = "too_many_buffers"
    status = 429


class TooManyBytes(Error):
    """The connection pins --max-pinned-per-connection bytes."""

    code = "too_many_bytes"
    status = 429


class NotNative(Error):
    """The probes saw a transfer leave the native path (require_native)."""

    code = "not_native"
    status = 500


class VerifyFailed(LoadFailed):
    """A restored chunk's crc32c — taken in place in this process's buffer,
    by the daemon or (``verify="local"``) here — is not the one the manifest
    gives."""

    code = "verify_failed"
    status = 0


class TransportError(Error, ConnectionError):
    """The daemon could not be reached, or answered something that is not
    its protocol (is ``pdstor serve`` running? is the socket path right?)."""

    code = "transport"


class DataPlaneError(Error):
    """The data socket failed: connecting, sharing a buffer, or a frame."""

    code = "data_plane"


class UsageError(Error, ValueError):
    """A step out of order on this object (store before prepare, ack before
    every chunk was loaded …): nothing was sent to the daemon."""

    code = "usage"


_BY_CODE: dict[str, type[Error]] = {
    cls.code: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Error) and cls is not Error
}


def error_for(code: str, status: int, field: str, message: str) -> Error:
    """The exception for a refusal ``code`` (:class:`Error` itself for a code
    this version does not know)."""
    cls = _BY_CODE.get(code, Error)
    return cls(message, code=code, status=status or None, field=field)


# Written out, so that type checkers see what `from pdstor.errors import *`
# brings (tests/test_api.py checks it names every class here).
__all__ = [
    "Aborted",
    "AdmissionTimeout",
    "AlreadyClaimed",
    "BadBuffer",
    "BadChunk",
    "BadRequest",
    "BadSignature",
    "BatchFailed",
    "BodyTimeout",
    "BodyTooLarge",
    "BufferTableFull",
    "DataPlaneError",
    "DigestMismatch",
    "DuplicateRequest",
    "EpochMismatch",
    "Error",
    "FenceFailed",
    "Fenced",
    "Forbidden",
    "FrameTooLarge",
    "HeadersTooLarge",
    "Internal",
    "IoError",
    "KeyRotated",
    "LayoutMismatch",
    "LeaseExpired",
    "LegacySender",
    "LoadFailed",
    "MalformedHttp",
    "MethodNotAllowed",
    "NamespaceLost",
    "NamespaceMismatch",
    "NoFd",
    "NotClaimed",
    "NotFenced",
    "NotFound",
    "NotLoaded",
    "NotNative",
    "NotOwner",
    "NotPublishable",
    "NotReady",
    "PathUnavailable",
    "ProtocolViolation",
    "QuotaExceeded",
    "ReadEnded",
    "ReaderMismatch",
    "RecordTooLarge",
    "ReqMismatch",
    "RequestTimeout",
    "RestoreMismatch",
    "SessionMismatch",
    "Standby",
    "StoreFailed",
    "TakeoverFailed",
    "TargetGone",
    "TooLarge",
    "TooManyBuffers",
    "TooManyBytes",
    "TooManyConnections",
    "TooManyPrepares",
    "TransportError",
    "Unauthenticated",
    "UnknownBuffer",
    "UnknownPublication",
    "UnsupportedMediaType",
    "UriTooLong",
    "UsageError",
    "VerifyFailed",
    "WrongReceipt",
    "WrongState",
]
