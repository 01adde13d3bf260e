//! The control plane's routes as data: each a row of [`ROUTES`] naming its
//! method, path, request and answer (wire types shared by the daemon and the
//! client) and its refusals. The router is checked against it
//! (`tests/tests/routes.rs`) and [the OpenAPI document](super::openapi) is
//! generated from it.

use std::borrow::Cow;

use utoipa::ToSchema;

use super::wire::*;
use pdstor_client::layout::Manifest;
use pdstor_client::read::{EndReadRequest, ReadAnswer, ReadRequest};

/// The HTTP method of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// GET: reads.
    Get,
    /// POST: a protocol step, its request a JSON body.
    Post,
}

impl Method {
    /// As OpenAPI spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "get",
            Method::Post => "post",
        }
    }
}

/// What a route answers with 200.
#[derive(Debug, Clone, Copy)]
pub enum Body {
    /// One JSON value of the named schema.
    Json(fn() -> Cow<'static, str>),
    /// A JSON array of the named schema.
    JsonArray(fn() -> Cow<'static, str>),
    /// Plain text.
    Text,
    /// OpenMetrics text (`/metrics`).
    Metrics,
    /// This document.
    Document,
}

/// A query parameter.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    /// Its name.
    pub name: &'static str,
    /// What it selects.
    pub description: &'static str,
    /// The values it takes.
    pub values: &'static [&'static str],
}

/// One route of the control plane.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    /// GET or POST.
    pub method: Method,
    /// Where.
    pub path: &'static str,
    /// What it does, in a line.
    pub summary: &'static str,
    /// Its query parameters.
    pub params: &'static [Param],
    /// The JSON request body's schema, for the routes that take one.
    pub request: Option<fn() -> Cow<'static, str>>,
    /// 200: what it means, and its body.
    pub ok: (&'static str, Body),
    /// Every other status it answers, with an [`ErrorBody`], and when.
    pub refusals: &'static [(u16, &'static str)],
}

const MALFORMED: (u16, &str) = (400, "malformed request");
const UNAUTHENTICATED: (u16, &str) = (401, "unauthenticated: the caller proved no identity");
const FORBIDDEN: (u16, &str) = (403, "forbidden (the caller's role or tenant may not) or not_owner");
const SIGNED: (u16, &str) = (
    403,
    "bad signature; forbidden (the caller's role or tenant may not) or not_owner (another identity's publication, \
     claim or session)",
);
const UNKNOWN: (u16, &str) = (404, "unknown publication");
const BODY_TIMEOUT: (u16, &str) = (408, "the request body did not arrive within --body-timeout-ms (body_timeout)");
const CONFLICT: (u16, &str) = (409, "refused: wrong state or a field that does not match");
const TOO_LARGE: (u16, &str) = (
    413,
    "the request body is over --max-body (body_too_large), or a journal record would be too large \
     (record_too_large)",
);
const QUOTA: (u16, &str) = (429, "quota_exceeded: the caller's tenant holds all its quota allows");
const STORE_FAILED: (u16, &str) = (503, "store failed: restart the daemon");

/// A step on a receipt: every refusal a signed step can meet.
const RECEIPT_STEP: &[(u16, &str)] =
    &[MALFORMED, UNAUTHENTICATED, SIGNED, UNKNOWN, BODY_TIMEOUT, CONFLICT, TOO_LARGE, QUOTA, STORE_FAILED];
/// A step on a receipt that may already be acknowledged.
const ACKED_STEP: &[(u16, &str)] =
    &[MALFORMED, UNAUTHENTICATED, SIGNED, GONE, BODY_TIMEOUT, CONFLICT, TOO_LARGE, QUOTA, STORE_FAILED];
const GONE: (u16, &str) = (404, "already acknowledged or unknown");
/// A read of the daemon's state.
const READ: &[(u16, &str)] = &[UNAUTHENTICATED, FORBIDDEN, QUOTA];

/// Every route the daemon serves (`api::http::router` builds the same list;
/// a test checks the two agree and that each answers).
pub const ROUTES: &[Route] = &[
    Route {
        method: Method::Post,
        path: "/storage-pd/prepare",
        summary: "Step 1: admission; reserves every chunk slot or waits (bounded)",
        params: &[],
        request: Some(PrepareRequest::name),
        ok: ("done", Body::Json(Prepared::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            FORBIDDEN,
            BODY_TIMEOUT,
            CONFLICT,
            (413, "larger than the whole store"),
            QUOTA,
            (503, "admission timeout; too_many_prepares: --max-prepares prepares are already handled or waiting"),
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/publish",
        summary: "Step 3: READY after the payload and the PUBLISH record are durable",
        params: &[],
        request: Some(PublishRequest::name),
        ok: ("done", Body::Json(Published::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            FORBIDDEN,
            UNKNOWN,
            BODY_TIMEOUT,
            CONFLICT,
            TOO_LARGE,
            QUOTA,
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/claim",
        summary: "Step 4: bind exactly one reader and session",
        params: &[],
        request: Some(ClaimRequest::name),
        ok: ("done", Body::Json(ReceiptResponse::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            (
                403,
                "bad signature or other namespace; forbidden (the caller's role or tenant may not) or not_owner \
                 (another identity's publication, claim or session)",
            ),
            UNKNOWN,
            BODY_TIMEOUT,
            CONFLICT,
            TOO_LARGE,
            QUOTA,
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/adopt",
        summary: "Step 5: every field must match; returns the manifest",
        params: &[],
        request: Some(AdoptRequest::name),
        ok: ("done", Body::Json(Manifest::name)),
        refusals: RECEIPT_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/loaded",
        summary: "A reader that read chunks itself from its own view of the shared namespace reports their crc32c \
                  (never payload); each must match the stored one (else restore_mismatch, nothing recorded), then \
                  they count as loaded for the claim's ack",
        params: &[],
        request: Some(LoadedRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: ACKED_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/ack",
        summary: "Step 7: frees the slots once every chunk was loaded for this claim and the digest binds its nonce; \
                  a second ACK is refused",
        params: &[],
        request: Some(AckRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: ACKED_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/read",
        summary: "Begin one of many reads of a READY cache publication: its receipt and the manifest with its \
                  nonce; the publication is neither released nor evicted until the read ends",
        params: &[],
        request: Some(ReadRequest::name),
        ok: ("done", Body::Json(ReadAnswer::name)),
        refusals: RECEIPT_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/read/end",
        summary: "End a read: with the restore digest (checked as an ack's), or abandoned with a reason",
        params: &[],
        request: Some(EndReadRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: ACKED_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/release",
        summary: "Exact unread release of a READY, never-claimed publication",
        params: &[],
        request: Some(ReceiptOnly::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: RECEIPT_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/lookup",
        summary: "The READY receipts of requests known by name (null where none this caller may claim or release)",
        params: &[],
        request: Some(LookupRequest::name),
        ok: ("one receipt or null per request, in order", Body::Json(LookupResponse::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            (403, "forbidden: the caller has no role"),
            BODY_TIMEOUT,
            CONFLICT,
            TOO_LARGE,
            QUOTA,
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/abort",
        summary: "Roll back a publication before READY",
        params: &[],
        request: Some(AbortRequest::name),
        ok: ("done", Body::Json(AbortResponse::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            FORBIDDEN,
            (404, "refused: no such publication (never prepared, or already acknowledged, released or aborted)"),
            BODY_TIMEOUT,
            CONFLICT,
            TOO_LARGE,
            QUOTA,
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/batch",
        summary: "Many steps (prepare, publish, claim, adopt, loaded, ack, fail, release, abort, cancel, read, \
                  end_read) in one round trip, run in order, each answering what its own route would (status, \
                  then body or error): one refused does not stop the rest; consecutive steps of one kind that \
                  commit share one commit",
        params: &[],
        request: Some(BatchRequest::name),
        ok: ("one result per step, in order", Body::Json(BatchResponse::name)),
        refusals: &[
            (400, "malformed body, or more than 1024 steps"),
            UNAUTHENTICATED,
            BODY_TIMEOUT,
            TOO_LARGE,
            (429, "too_many_prepares: the batch prepares and every prepare place is taken"),
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/cancel",
        summary: "Give up a request by its id: refuse its waiting prepare, or roll back its PREPARED publication \
                  (idempotent)",
        params: &[],
        request: Some(CancelRequest::name),
        ok: ("done", Body::Json(CancelOutcome::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            FORBIDDEN,
            (409, "the request is READY or later: release it instead"),
            TOO_LARGE,
            QUOTA,
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/fail",
        summary: "A failed or uncertain read: RETAINED, bytes kept",
        params: &[],
        request: Some(FailRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: RECEIPT_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/reclaim",
        summary: "Free a claimed/retained publication once its reader is fenced",
        params: &[],
        request: Some(ReceiptOnly::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: RECEIPT_STEP,
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/admin/end-reads",
        summary: "An operator (admin) ends every read of a cache publication by number, its reader gone: \
                  their receipts are refused read_ended from then on, and the publication can be released",
        params: &[],
        request: Some(OperatorEndReadsRequest::name),
        ok: ("how many reads ended", Body::Json(EndedReads::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            (403, "forbidden: only an admin ends a publication's reads"),
            UNKNOWN,
            (409, "wrong_state: the publication is a handoff, never read"),
            BODY_TIMEOUT,
            TOO_LARGE,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/admin/reclaim",
        summary: "An operator (admin) frees a claimed or retained publication by number, fencing its claim's \
                  session first: the way out for a claim whose receipt nobody holds",
        params: &[],
        request: Some(OperatorReclaimRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: &[
            MALFORMED,
            UNAUTHENTICATED,
            (403, "forbidden: only an admin reclaims by publication"),
            UNKNOWN,
            (409, "not_claimed: the publication is not claimed or retained"),
            BODY_TIMEOUT,
            TOO_LARGE,
            QUOTA,
            (502, "fence_failed: a direct reader's host could not be cut off at the target (nothing changed)"),
            STORE_FAILED,
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/admin/takeover",
        summary: "A standby (serve --standby; admin) takes its namespace over now: preempts the owner's \
                  reservation key, recovers the journal into a new epoch and serves (docs/owners.md); an \
                  owner refuses it",
        params: &[],
        request: None,
        ok: ("taken over: this daemon serves the namespace now", Body::Json(TakeoverAnswer::name)),
        refusals: &[
            UNAUTHENTICATED,
            (403, "forbidden: only an admin takes a namespace over"),
            (
                409,
                "takeover_failed: this daemon owns the namespace already, or the preempt failed (the standby stays \
                 a standby)",
            ),
            (503, "standby: the standby stopped before the takeover was decided"),
        ],
    },
    Route {
        method: Method::Post,
        path: "/storage-pd/session/close",
        summary: "Fence a reader session",
        params: &[],
        request: Some(SessionCloseRequest::name),
        ok: ("done", Body::Json(Done::name)),
        refusals: &[MALFORMED, UNAUTHENTICATED, FORBIDDEN, BODY_TIMEOUT, TOO_LARGE, QUOTA],
    },
    Route {
        method: Method::Get,
        path: "/storage-pd/publications",
        summary: "Live publications",
        params: &[
            Param {
                name: "state",
                description: "only publications in this state",
                values: &["PREPARED", "READY", "CLAIMED", "ADOPTED", "RETAINED", "ABORTING"],
            },
            Param {
                name: "verbose",
                description: "1 or true: list each chunk's extent on the target",
                values: &["1", "true"],
            },
        ],
        request: None,
        ok: ("list", Body::JsonArray(PublicationInfo::name)),
        refusals: READ,
    },
    Route {
        method: Method::Get,
        path: "/storage-pd/namespace",
        summary: "The namespace the owner serves (its superblock's UUID, epoch, slots) and its device's NVMe namespace \
                  identifiers (uuid, nguid, eui64, where it has them): what a reader on another host checks its own \
                  view of the shared namespace against before it reads",
        params: &[],
        request: None,
        ok: ("the namespace", Body::Json(NamespaceInfo::name)),
        refusals: READ,
    },
    Route {
        method: Method::Get,
        path: "/healthz",
        summary: "Liveness: 200 while the daemon can do its job; 503 once the store has failed (a restart replays the \
                  journal)",
        params: &[],
        request: None,
        ok: ("ok", Body::Text),
        refusals: &[(
            503,
            "the store failed and refuses every change (code store_failed), or its target was removed or replaced \
             under the daemon (code target_gone)",
        )],
    },
    Route {
        method: Method::Get,
        path: "/readyz",
        summary: "Readiness: the store accepts changes and the journal has headroom",
        params: &[],
        request: None,
        ok: ("ready", Body::Json(Readiness::name)),
        refusals: &[(
            503,
            "not ready, and why (code not_ready); the target was removed or replaced (code target_gone)",
        )],
    },
    Route {
        method: Method::Get,
        path: "/metrics",
        summary: "Prometheus metrics, OpenMetrics text: gauges, counters, and latency histograms of each step and transfer (an admin's: they span every tenant)",
        params: &[],
        request: None,
        ok: ("OpenMetrics text exposition", Body::Metrics),
        refusals: READ,
    },
    Route {
        method: Method::Get,
        path: "/openapi.json",
        summary: "This document",
        params: &[],
        request: None,
        ok: ("the OpenAPI 3.1 document", Body::Document),
        refusals: &[],
    },
];
