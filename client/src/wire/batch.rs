//! `POST /storage-pd/batch`: many protocol steps in one round trip, each
//! the body its own route takes.

use serde::{Deserialize, Serialize};

use super::*;

/// The most steps one `POST /storage-pd/batch` may carry.
pub const MAX_BATCH_STEPS: usize = 1024;

/// One step of `POST /storage-pd/batch`: the body its own route takes,
/// tagged with the step's name (`{"step": "claim", "receipt": …}`).
// Read by hand (`step_de`): without buffering when the tag comes first.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum BatchStep {
    /// `prepare`.
    Prepare(PrepareRequest),
    /// `publish`.
    Publish(PublishRequest),
    /// `claim`.
    Claim(ClaimRequest),
    /// `adopt`.
    Adopt(AdoptRequest),
    /// `loaded`.
    Loaded(LoadedRequest),
    /// `ack`.
    Ack(AckRequest),
    /// `fail`.
    Fail(FailRequest),
    /// `release`.
    Release(ReceiptOnly),
    /// `abort`.
    Abort(AbortRequest),
    /// `cancel`.
    Cancel(CancelRequest),
    /// `read`.
    Read(crate::read::ReadRequest),
    /// `read/end`.
    EndRead(crate::read::EndReadRequest),
}

impl BatchStep {
    /// The step's name, as its route and its tag say it.
    pub fn name(&self) -> &'static str {
        match self {
            BatchStep::Prepare(_) => "prepare",
            BatchStep::Publish(_) => "publish",
            BatchStep::Claim(_) => "claim",
            BatchStep::Adopt(_) => "adopt",
            BatchStep::Loaded(_) => "loaded",
            BatchStep::Ack(_) => "ack",
            BatchStep::Fail(_) => "fail",
            BatchStep::Release(_) => "release",
            BatchStep::Abort(_) => "abort",
            BatchStep::Cancel(_) => "cancel",
            BatchStep::Read(_) => "read",
            BatchStep::EndRead(_) => "end_read",
        }
    }
}

/// `POST /storage-pd/batch`: many protocol steps in one round trip.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchRequest {
    /// The steps, run in order, each on its own (one refused does not stop
    /// the rest); at most [`MAX_BATCH_STEPS`].
    pub steps: Vec<BatchStep>,
}

/// What one step of a batch answered: what its own route would have.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchResult {
    /// The HTTP status its own route would have answered.
    pub status: u16,
    /// The step's answer, when it was taken (`status` 200): what its own
    /// route answers.
    // Carried as the daemon wrote it: encoded once, read once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub ok: Option<Box<serde_json::value::RawValue>>,
    /// Why it was refused or failed, when it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// What `batch` answers: one result per step, in order.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchResponse {
    /// The results.
    pub results: Vec<BatchResult>,
}
