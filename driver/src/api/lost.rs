//! A namespace lost (its reservation preempted: another daemon owns it now)
//! as the control plane answers it.

use std::sync::Arc;

use crate::store::Store;

/// The control plane's guard: once the namespace is lost every route but
/// `/metrics` answers 503 `namespace_lost` (health included).
pub async fn refuse_when_lost(
    axum::extract::State(store): axum::extract::State<Arc<Store>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use pdstor_client::code::RefusalCode;
    let path = req.uri().path().to_owned();
    let lost = store.lost().filter(|_| path != "/metrics");
    let Some(why) = lost else { return next.run(req).await };
    // Read what the client sends before answering: a refusal answered over a
    // body still being sent would cut the client off mid-write (EPIPE)
    // instead of telling it why.
    let _ = axum::body::to_bytes(req.into_body(), 1 << 20).await;
    let refuse = |code: RefusalCode, message: String| {
        use axum::response::IntoResponse;
        let body = pdstor_client::wire::ErrorBody::new(code, "", message);
        let status =
            axum::http::StatusCode::from_u16(body.status).unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        (status, [(axum::http::header::CONTENT_TYPE, "application/json")], bytes).into_response()
    };
    refuse(
        RefusalCode::NamespaceLost,
        format!("{why}: this daemon acknowledges nothing more; ask the namespace's new owner, and stop this one"),
    )
}
