//! Many protocol steps in one round trip (`POST /storage-pd/batch`): a
//! writer prepares or publishes a whole batch of requests, a reader claims,
//! adopts or acknowledges a batch of publications, in one control request
//! each. Every step answers on its own, in order: one refused does not stop
//! the rest, and each outcome is what the step's own route would have said.

use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

use crate::layout::Manifest;
use crate::read::{End, EndReadRequest, ReadAnswer, ReadRequest};
use crate::receipt::ReceiptKind;
use crate::wire::{
    AckRequest, AdoptRequest, BatchRequest, BatchResponse, BatchStep, ClaimRequest, Done, MAX_BATCH_STEPS,
    PrepareRequest, Prepared, PublishRequest, Published, ReceiptOnly, ReceiptResponse,
};
use crate::wire::{DataChunk, DataRequest, DataResponse, MAX_DATA_MANY};
use crate::{Client, ClientError, DataConn, Receipt};

/// One outcome per step of a batch, in order.
pub type Outcomes<T> = Vec<Result<T, ClientError>>;

impl Client {
    /// Takes `steps` in as few round trips as [`MAX_BATCH_STEPS`] allows
    /// (one, up to that many). The outer error is the transport's or a
    /// refusal of a whole batch; each step's own refusal is its outcome.
    pub fn batch(&self, steps: Vec<BatchStep>) -> Result<Outcomes<serde_json::Value>, ClientError> {
        self.batch_of(steps)
    }

    /// [`batch`](Self::batch), each answer as the daemon wrote it.
    fn batch_raw(&self, steps: Vec<BatchStep>) -> Result<Outcomes<Box<RawValue>>, ClientError> {
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
    pub(crate) fn batch_of<T: DeserializeOwned>(&self, steps: Vec<BatchStep>) -> Result<Outcomes<T>, ClientError> {
        Ok(self
            .batch_raw(steps)?
            .into_iter()
            .map(|r| {
                r.and_then(|v| {
                    serde_json::from_str(v.get()).map_err(|e| ClientError::Data(format!("a batch step's answer: {e}")))
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

    /// `claim` with `adopt` of each READY receipt (every request's `adopt`
    /// set, and its `layout` given), in one round trip and one commit:
    /// answers each claim receipt with its adopt's outcome: the manifest,
    /// checked to be the one claimed, or why not (the claim stands).
    #[allow(clippy::type_complexity)] // each claim, then its adopt: two outcomes
    pub fn claim_and_adopt_many(
        &self,
        claims: Vec<ClaimRequest>,
    ) -> Result<Outcomes<(Receipt, Result<Manifest, ClientError>)>, ClientError> {
        let mut layouts = Vec::with_capacity(claims.len());
        let mut steps = Vec::with_capacity(claims.len());
        for mut c in claims {
            let Some(layout) = c.layout.clone() else {
                return Err(ClientError::Data(
                    "claim_and_adopt_many: every claim names the layout it adopts with".into(),
                ));
            };
            c.adopt = true;
            layouts.push(layout);
            steps.push(BatchStep::Claim(c));
        }
        let answers: Outcomes<ReceiptResponse> = self.batch_of(steps)?;
        Ok(answers.into_iter().zip(layouts).map(|(r, layout)| r.map(|r| self.adopted_by_claim(r, &layout))).collect())
    }

    /// `adopt` of each claim, in one round trip; answers each manifest,
    /// checked against the one its claim receipt names.
    pub fn adopt_many(&self, adopts: Vec<AdoptRequest>) -> Result<Outcomes<Manifest>, ClientError> {
        let digests: Vec<String> = adopts.iter().map(|a| a.receipt.manifest_digest.clone()).collect();
        let answers: Outcomes<Manifest> = self.batch_of(adopts.into_iter().map(BatchStep::Adopt).collect())?;
        Ok(answers
            .into_iter()
            .zip(digests)
            .map(|(r, digest)| r.and_then(|m| crate::the_one_claimed(m, &digest)))
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

impl Client {
    /// `read` of each READY cache publication (by its receipt, or by name),
    /// in one round trip; answers each read. Read by its receipt, the
    /// manifest answered is checked against the one that receipt names; read
    /// by name there is no earlier word to check it against, so the answer
    /// is checked to be a read of that name whose manifest its own read
    /// receipt names (a consistency check). A read that fails its check is
    /// given up and answered an error.
    pub fn read_many(&self, reads: Vec<ReadRequest>) -> Result<Outcomes<ReadAnswer>, ClientError> {
        let asked: Vec<(Option<String>, Option<String>)> = reads
            .iter()
            .map(|r| (r.receipt.as_ref().map(|ready| ready.manifest_digest.clone()), r.req_id.clone()))
            .collect();
        let answers: Outcomes<ReadAnswer> = self.batch_of(reads.into_iter().map(BatchStep::Read).collect())?;
        let mut wrong = Vec::new();
        let out = answers
            .into_iter()
            .zip(asked)
            .map(|(a, (digest, name))| {
                let a = a?;
                if let Some(name) = name.filter(|n| a.receipt.req_id != *n || a.receipt.kind != ReceiptKind::Read) {
                    let got = format!("{:?} receipt of {:?}", a.receipt.kind, a.receipt.req_id);
                    wrong.push(a.receipt);
                    return Err(ClientError::Data(format!("a read of {name:?} was answered with a {got}")));
                }
                let digest = digest.unwrap_or_else(|| a.receipt.manifest_digest.clone());
                match crate::the_one_claimed(a.manifest, &digest) {
                    Ok(manifest) => Ok(ReadAnswer { manifest, ..a }),
                    Err(e) => {
                        wrong.push(a.receipt);
                        Err(e)
                    }
                }
            })
            .collect();
        if !wrong.is_empty() {
            let why = "the manifest answered is not the one the receipt names";
            let _ = self.end_read_many(&wrong.iter().map(|r| (r, End::Abandoned(why))).collect::<Vec<_>>());
        }
        Ok(out)
    }

    /// `read/end` of each read, in one round trip.
    pub fn end_read_many(&self, ends: &[(&Receipt, End<'_>)]) -> Result<Outcomes<()>, ClientError> {
        let steps = ends
            .iter()
            .map(|(read, end)| {
                let (restore_digest, reason) = match end {
                    End::Done(digest) => (Some((*digest).to_owned()), None),
                    End::Abandoned(why) => (None, Some((*why).to_owned())),
                };
                BatchStep::EndRead(EndReadRequest { receipt: (*read).clone(), restore_digest, reason })
            })
            .collect();
        let answers: Outcomes<serde::de::IgnoredAny> = self.batch_of(steps)?;
        Ok(answers.into_iter().map(|r| r.map(drop)).collect())
    }
}

/// One store batch of a prepared publication, for [`DataConn::store_many`].
#[derive(Debug, Clone)]
pub struct StoreItem<'a> {
    /// The prepared publication (its writer's token goes with the batch).
    pub prepared: &'a Prepared,
    /// The chunks and where their bytes are.
    pub chunks: Vec<DataChunk>,
    /// The writer sends no batch of this publication after this one.
    pub is_last_batch: bool,
    /// The publication's total, as prepared.
    pub total_chunks: u32,
}

impl DataConn {
    /// Sends `requests` (stores and loads) in as few `many` frames as
    /// [`MAX_DATA_MANY`] allows; one outcome per request, in order. The outer
    /// error is the socket's or a refusal of a whole frame.
    pub fn many(&mut self, requests: Vec<DataRequest>) -> Result<Outcomes<DataResponse>, ClientError> {
        let mut out = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter().peekable();
        while requests.peek().is_some() {
            let part: Vec<DataRequest> = requests.by_ref().take(MAX_DATA_MANY).collect();
            let asked = part.len();
            let answer = self.call(&DataRequest::Many { requests: part }, &[])?;
            if answer.many.len() != asked {
                return Err(ClientError::Data(format!(
                    "{asked} requests sent in a many frame, {} answered",
                    answer.many.len()
                )));
            }
            out.extend(answer.many.into_iter().map(|r| match r.error {
                Some(e) => Err(ClientError::Api(e)),
                None => Ok(r),
            }));
        }
        Ok(out)
    }

    /// A store batch of each of many prepared publications in one frame:
    /// their writes reach the device together.
    pub fn store_many(&mut self, items: Vec<StoreItem<'_>>) -> Result<Outcomes<DataResponse>, ClientError> {
        let requests = items
            .into_iter()
            .map(|i| DataRequest::Store {
                publication: i.prepared.publication,
                writer_token: i.prepared.writer_token.clone(),
                chunks: i.chunks,
                is_last_batch: i.is_last_batch,
                total_chunks: i.total_chunks,
            })
            .collect();
        self.many(requests)
    }

    /// Loads of each of many adopted claims in one frame: their reads reach
    /// the device together.
    pub fn load_many(&mut self, loads: Vec<(&Receipt, Vec<DataChunk>)>) -> Result<Outcomes<DataResponse>, ClientError> {
        self.load_many_acking(loads.into_iter().map(|(r, c)| (r, c, false)).collect())
    }

    /// Loads of each of many adopted claims in one frame, each the last of
    /// its claim, and their acks in the same request: the daemon checks
    /// every chunk against the manifest and commits the acks together
    /// before it answers (each answer `acked`, or why not: then fail that
    /// claim). Refused, loading nothing, where the daemon cannot check a
    /// chunk (a buffer registered unchecked, a DMA-BUF it cannot map).
    pub fn load_and_ack_many(
        &mut self,
        loads: Vec<(&Receipt, Vec<DataChunk>)>,
    ) -> Result<Outcomes<DataResponse>, ClientError> {
        self.load_many_acking(loads.into_iter().map(|(r, c)| (r, c, true)).collect())
    }

    /// Loads of many adopted claims in one frame, those marked `true`
    /// acknowledging their claims as [`DataConn::load_and_ack_many`]'s do.
    pub fn load_many_acking(
        &mut self,
        loads: Vec<(&Receipt, Vec<DataChunk>, bool)>,
    ) -> Result<Outcomes<DataResponse>, ClientError> {
        let requests =
            loads.into_iter().map(|(r, chunks, ack)| DataRequest::Load { receipt: r.clone(), chunks, ack }).collect();
        self.many(requests)
    }
}
