//! The control plane's OpenAPI document, generated, not kept by hand: every
//! schema is derived from the wire type the daemon and the client share
//! (`utoipa::ToSchema` on `pdstor_client::wire`), every route is a row of
//! [`ROUTES`], whose request and answer name those types. The daemon serves
//! it at `/openapi.json`; `driver/openapi.json` is the same document checked
//! in (a test fails while it differs), and `docs/http-reference.md` is
//! rendered from it.

use serde_json::{Map, Value, json};
use utoipa::ToSchema;

pub use super::routes::{Body, Method, Param, ROUTES, Route};
use super::wire::*;

use pdstor_client::layout::ChunkEntry;
use pdstor_client::layout::Layout;
use pdstor_client::layout::Manifest;
use pdstor_client::read::{EndReadRequest, ReadAnswer, ReadRequest};
use pdstor_client::receipt::{Receipt, ReceiptKind};
use pdstor_engine::io::{DeviceIds, WriteCache};

/// The schemas the routes name, each derived from its Rust type.
fn schemas() -> Map<String, Value> {
    let mut out = Map::new();
    macro_rules! add {
        ($($t:ty),* $(,)?) => {$(
            out.insert(<$t as ToSchema>::name().into_owned(), json_of(&<$t as utoipa::PartialSchema>::schema()));
        )*};
    }
    add!(
        ErrorBody,
        Receipt,
        ReceiptKind,
        Layout,
        ChunkEntry,
        Manifest,
        PrepareRequest,
        Prepared,
        PublishRequest,
        Published,
        ClaimRequest,
        ReceiptResponse,
        ReadRequest,
        ReadAnswer,
        EndReadRequest,
        AdoptRequest,
        LoadedRequest,
        LoadedChunk,
        AckRequest,
        ReceiptOnly,
        OperatorReclaimRequest,
        OperatorEndReadsRequest,
        EndedReads,
        LookupRequest,
        LookupResponse,
        AbortRequest,
        AbortResponse,
        CancelRequest,
        CancelOutcome,
        FailRequest,
        BatchStep,
        BatchRequest,
        BatchResult,
        BatchResponse,
        SessionCloseRequest,
        Done,
        PublicationInfo,
        Extent,
        NamespaceInfo,
        TakeoverAnswer,
        DeviceIds,
        WriteCache,
        Readiness,
        ProbesState,
    );
    out
}

fn json_of<T: serde::Serialize>(value: &T) -> Value {
    // The schema types serialize to JSON by construction: a failure here is a
    // bug in utoipa, not a condition to recover from.
    serde_json::to_value(value).unwrap_or_else(|e| json!({ "description": format!("unserializable schema: {e}") }))
}

fn schema_ref(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn json_content(schema: Value) -> Value {
    json!({ "application/json": { "schema": schema } })
}

fn operation(route: &Route) -> Value {
    let mut op = Map::new();
    op.insert("summary".into(), route.summary.into());
    if !route.params.is_empty() {
        let params: Vec<Value> = route
            .params
            .iter()
            .map(|p| {
                json!({"name": p.name, "in": "query", "required": false, "description": p.description,
                       "schema": {"type": "string", "enum": p.values}})
            })
            .collect();
        op.insert("parameters".into(), params.into());
    }
    if let Some(request) = route.request {
        op.insert("requestBody".into(), json!({ "required": true, "content": json_content(schema_ref(&request())) }));
    }
    let (what, body) = route.ok;
    let content = match body {
        Body::Json(name) => json_content(schema_ref(&name())),
        Body::JsonArray(name) => json_content(json!({ "type": "array", "items": schema_ref(&name()) })),
        Body::Text => json!({ "text/plain": { "schema": { "type": "string" } } }),
        Body::Metrics => json!({ "application/openmetrics-text": { "schema": { "type": "string" } } }),
        Body::Document => json_content(json!({ "type": "object" })),
    };
    let mut responses = Map::new();
    responses.insert("200".into(), json!({ "description": what, "content": content }));
    for (status, when) in route.refusals {
        responses.insert(
            status.to_string(),
            json!({ "description": when, "content": json_content(schema_ref(&ErrorBody::name())) }),
        );
    }
    op.insert("responses".into(), responses.into());
    op.into()
}

/// The whole document.
pub fn document() -> Value {
    let mut paths = Map::new();
    for route in ROUTES {
        let item = paths.entry(route.path).or_insert_with(|| json!({}));
        if let Some(item) = item.as_object_mut() {
            item.insert(route.method.as_str().into(), operation(route));
        }
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "pdstor control plane",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The storage-PD handoff protocol (DESIGN §4). Payload bytes never cross this API: they \
                move on the data plane (Unix socket, SCM_RIGHTS). Every request is made by an identity: a Unix \
                peer's uid (SO_PEERCRED), mapped to a tenant and roles by `serve --config`; refusals for who the \
                caller is are 401 unauthenticated, 403 forbidden and 403 not_owner. Generated from the wire types \
                (driver/src/api/openapi.rs).",
        },
        "servers": [{
            "url": "http://localhost",
            "description": "The daemon's Unix socket (default /run/pdstor/control.sock; `pdstor serve --listen \
                unix:PATH`): the caller is identified by SO_PEERCRED. Plaintext TCP (`--listen host:port \
                --insecure-tcp`) identifies no one.",
        }],
        "paths": paths,
        "components": { "schemas": schemas() },
    })
}

/// The document as the daemon serves it and `driver/openapi.json` holds it.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}
