//! Many protocol steps in one round trip (`POST /storage-pd/batch`): a
//! writer prepares or publishes a whole batch of requests, a reader claims,
//! adopts or acknowledges a batch of publications, in one control request
//! each. Every step answers on its own, in order: one refused does not stop
//! the rest, and each outcome is what the step's own route would have said.

use serde::de::DeserializeOwned;

use crate::layout::Manifest;
use crate::wire::{
    AckRequest, AdoptRequest, BatchRequest, BatchResponse, BatchStep, ClaimRequest, Done, MAX_BATCH_STEPS,
    PrepareRequest, Prepared, PublishRequest, Published, ReceiptOnly, ReceiptResponse,
};
use crate::{Client, ClientError, Receipt};

/// One outcome per step of a batch, in order.
pub type Outcomes<T> = Vec<Result<T, ClientError>>;

impl Client {
    /// Takes `steps` in as few round trips as [`MAX_BATCH_STEPS`] allows
    /// (one, up to that many). The outer error is the transport's or a
    /// refusal of a whole batch; each step's own refusal is its outcome.
    pub fn batch(&self, steps: Vec<BatchStep>) -> Result<Outcomes<serde_json::Value>, ClientError> {
        let mut out = Vec::with_capacity(steps.len());
        let mut steps = steps.into_iter().peekable();
        while steps.peek().is_some() {
            let part: Vec<BatchStep> = steps.by_ref().take(MAX_BATCH_STEPS).collect();
            let asked = part.len();
            let answer: BatchResponse = self.post("/storage-pd/batch", &BatchRequest { steps: part })?;
            if answer.results.len() != asked {
                return Err(ClientError::Transport {
                    url: format!("{}/storage-pd/batch", self.base),
                    message: format!("{asked} steps asked, {} results answered", answer.results.len()),
                });
            }
            out.extend(answer.results.into_iter().map(|r| match (r.ok, r.error) {
                (_, Some(e)) => Err(ClientError::Api(e)),
                (Some(v), None) => Ok(v),
                (None, None) => Err(ClientError::Data(format!("a batch step answered {} with no body", r.status))),
            }));
        }
        Ok(out)
    }

    /// [`batch`](Self::batch), each answer read as `T`.
    fn batch_of<T: DeserializeOwned>(&self, steps: Vec<BatchStep>) -> Result<Outcomes<T>, ClientError> {
        Ok(self
            .batch(steps)?
            .into_iter()
            .map(|r| {
                r.and_then(|v| {
                    serde_json::from_value(v).map_err(|e| ClientError::Data(format!("a batch step's answer: {e}")))
                })
            })
            .collect())
    }

    /// `prepare` of each request, in one round trip.
    pub fn prepare_many(&self, requests: Vec<PrepareRequest>) -> Result<Outcomes<Prepared>, ClientError> {
        self.batch_of(requests.into_iter().map(BatchStep::Prepare).collect())
    }

    /// `publish` of each prepared publication (`first_token` for each, if
    /// any), in one round trip and one commit.
    pub fn publish_many(&self, prepared: &[(&Prepared, Option<u32>)]) -> Result<Outcomes<Published>, ClientError> {
        let steps = prepared
            .iter()
            .map(|(p, first_token)| {
                BatchStep::Publish(PublishRequest {
                    publication: p.publication,
                    writer_token: p.writer_token.clone(),
                    first_token: *first_token,
                })
            })
            .collect();
        self.batch_of(steps)
    }

    /// `claim` of each READY receipt (a [`ClaimRequest`] each), in one round
    /// trip and one commit; answers each claim receipt.
    pub fn claim_many(&self, claims: Vec<ClaimRequest>) -> Result<Outcomes<Receipt>, ClientError> {
        let answers: Outcomes<ReceiptResponse> = self.batch_of(claims.into_iter().map(BatchStep::Claim).collect())?;
        Ok(answers.into_iter().map(|r| r.map(|r| r.receipt)).collect())
    }

    /// `adopt` of each claim, in one round trip; answers each manifest,
    /// checked against the one its claim receipt names.
    pub fn adopt_many(&self, adopts: Vec<AdoptRequest>) -> Result<Outcomes<Manifest>, ClientError> {
        let digests: Vec<String> = adopts.iter().map(|a| a.receipt.manifest_digest.clone()).collect();
        let answers: Outcomes<Manifest> = self.batch_of(adopts.into_iter().map(BatchStep::Adopt).collect())?;
        Ok(answers
            .into_iter()
            .zip(digests)
            .map(|(r, digest)| {
                r.and_then(|m| {
                    if crate::receipt::manifest_digest(&m) == digest {
                        Ok(m)
                    } else {
                        Err(ClientError::Verify {
                            chunk: 0,
                            what: "the adopted manifest is not the one claimed".into(),
                        })
                    }
                })
            })
            .collect())
    }

    /// `ack` of each claim with its restore digest, in one round trip and one commit.
    pub fn ack_many(&self, acks: &[(&Receipt, &str)]) -> Result<Outcomes<()>, ClientError> {
        let steps = acks
            .iter()
            .map(|(claim, digest)| {
                BatchStep::Ack(AckRequest { receipt: (*claim).clone(), restore_digest: (*digest).to_owned() })
            })
            .collect();
        let answers: Outcomes<Done> = self.batch_of(steps)?;
        Ok(answers.into_iter().map(|r| r.map(drop)).collect())
    }

    /// `release` of each READY receipt never claimed, in one round trip and one commit.
    pub fn release_many(&self, ready: &[&Receipt]) -> Result<Outcomes<()>, ClientError> {
        let steps = ready.iter().map(|r| BatchStep::Release(ReceiptOnly { receipt: (*r).clone() })).collect();
        let answers: Outcomes<Done> = self.batch_of(steps)?;
        Ok(answers.into_iter().map(|r| r.map(drop)).collect())
    }
}
