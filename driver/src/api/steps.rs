//! Every protocol step once its body is parsed: which [`Service`] call it is
//! and what it answers. Each step's own route and `POST /storage-pd/batch`
//! both take steps through [`take`], so a step means the same either way.
//!
//! A batch runs its steps in order on one blocking thread, each on its own:
//! one refused does not stop the rest, and each answers what its own route
//! would have (status, body or error). Consecutive steps of one kind that
//! commit (publish, claim, adopt, ack, fail, release, abort) share one
//! commit ([`Store::with_one_commit`](crate::store::Store::with_one_commit)):
//! none of them is answered before its record is durable, and if that commit
//! fails every step of the run answers the failure. Prepares and cancels run
//! outside any such run: a prepare may wait for slots an earlier step freed;
//! reads and their ends too, since they journal nothing.

use serde::Serialize;

use super::error::{from_protocol, from_store};
use pdstor_client::read::ReadAnswer;

use super::wire::{AbortResponse, BatchResult, BatchStep, CancelOutcome, Done, ErrorBody, Published, ReceiptResponse};
use crate::admission::CancelToken;
use crate::protocol::Refusal;
use crate::protocol::identity::Caller;
use crate::protocol::service::{ProtocolError, Service};
use crate::store::AbortOutcome;
use pdstor_client::code::RefusalCode;
use pdstor_client::layout::Manifest;
use pdstor_client::wire::Prepared;

/// What a step answers, serialized as its own route's body.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Answer {
    /// `prepare`.
    Prepared(Prepared),
    /// `publish`.
    Published(Published),
    /// `claim`.
    Receipt(ReceiptResponse),
    /// `adopt`.
    Manifest(Manifest),
    /// `loaded`, `ack`, `fail`, `release`.
    Done(Done),
    /// `abort`.
    Aborted(AbortResponse),
    /// `cancel`.
    Cancelled(CancelOutcome),
    /// `read`.
    Read(ReadAnswer),
}

const DONE: Answer = Answer::Done(Done { ok: true });

/// Takes one step for `who`. A prepare waits for capacity until its
/// timeout or until `cancel` fires (its client went away).
pub fn take(svc: &Service, who: &Caller, step: &BatchStep, cancel: &CancelToken) -> Result<Answer, ProtocolError> {
    match step {
        BatchStep::Prepare(r) => svc.prepare_request(who, r, cancel).map(Answer::Prepared),
        BatchStep::Publish(r) => svc.publish(who, r.publication, &r.writer_token, r.first_token).map(Answer::Published),
        BatchStep::Claim(r) if r.adopt => svc.claim_and_adopt(who, r).map(|(receipt, adopted)| {
            let (manifest, adopt_refused) = match adopted {
                Ok(m) => (Some(m), None),
                Err(e) => (None, Some(from_protocol(&e))),
            };
            Answer::Receipt(ReceiptResponse { receipt, manifest, adopt_refused })
        }),
        BatchStep::Claim(r) => svc
            .claim(who, &r.receipt, &r.reader_id, &r.session_id, r.lease_ms, r.layout.as_ref())
            .map(|receipt| Answer::Receipt(ReceiptResponse { receipt, manifest: None, adopt_refused: None })),
        BatchStep::Adopt(r) => svc.adopt(who, r).map(Answer::Manifest),
        BatchStep::Loaded(r) => {
            let chunks: Vec<(u32, u32)> = r.chunks.iter().map(|c| (c.index, c.crc32c)).collect();
            svc.loaded(who, &r.receipt, &chunks).map(|()| DONE)
        }
        BatchStep::Ack(r) => svc.ack(who, &r.receipt, &r.restore_digest).map(|()| DONE),
        BatchStep::Fail(r) => svc.fail(who, &r.receipt, &r.reason).map(|()| DONE),
        BatchStep::Release(r) => svc.release(who, &r.receipt).map(|()| DONE),
        BatchStep::Abort(r) => match svc.abort(who, r.publication, &r.writer_token)? {
            AbortOutcome::Aborted { slots } => Ok(Answer::Aborted(AbortResponse { outcome: "aborted".into(), slots })),
            AbortOutcome::Pending => Ok(Answer::Aborted(AbortResponse { outcome: "pending".into(), slots: 0 })),
            // Nothing to abort is a refusal, like any other step on an unknown publication.
            AbortOutcome::NotFound => Err(Refusal::new(
                RefusalCode::UnknownPublication,
                "publication",
                format!(
                    "publication {} does not exist: never prepared, or already acknowledged, released or \
                     aborted (see GET /storage-pd/publications)",
                    r.publication
                ),
            )
            .into()),
        },
        BatchStep::Cancel(r) => svc.cancel(who, &r.req_id).map(Answer::Cancelled),
        BatchStep::Read(r) => {
            svc.read_asked(who, r).map(|(receipt, manifest)| Answer::Read(ReadAnswer { receipt, manifest }))
        }
        BatchStep::EndRead(r) => {
            svc.end_read(who, &r.receipt, r.restore_digest.as_deref(), r.reason.as_deref()).map(|()| DONE)
        }
    }
}

/// A read by name that found no READY publication: what `lookup` answers
/// `null` for, a cache's miss (frequent while a cache warms), not a refusal
/// worth a count and a timeline line — the step's own answer still says it.
pub fn is_lookup_miss(step: &BatchStep, e: &ErrorBody) -> bool {
    matches!(step, BatchStep::Read(r) if r.receipt.is_none()) && e.code == RefusalCode::UnknownPublication.as_str()
}

/// What a step was about, for the timeline's `refused` event: its
/// publication and request, where its body names them.
pub fn names(step: &BatchStep) -> (Option<u64>, Option<String>) {
    let of = |r: &pdstor_client::receipt::Receipt| (Some(r.publication), Some(r.req_id.clone()));
    match step {
        BatchStep::Prepare(r) => (None, Some(r.req_id.clone())),
        BatchStep::Cancel(r) => (None, Some(r.req_id.clone())),
        BatchStep::Publish(r) => (Some(r.publication), None),
        BatchStep::Abort(r) => (Some(r.publication), None),
        BatchStep::Claim(r) => of(&r.receipt),
        BatchStep::Adopt(r) => of(&r.receipt),
        BatchStep::Loaded(r) => of(&r.receipt),
        BatchStep::Ack(r) => of(&r.receipt),
        BatchStep::Fail(r) => of(&r.receipt),
        BatchStep::Release(r) => of(&r.receipt),
        BatchStep::Read(r) => match (&r.receipt, &r.req_id) {
            (Some(ready), _) => of(ready),
            (None, name) => (None, name.clone()),
        },
        BatchStep::EndRead(r) => of(&r.receipt),
    }
}

/// What a batch tells its caller as its steps are taken.
pub struct Told<'a> {
    /// Each publication a prepare made, as it is made (so a client that
    /// went away has it orphaned).
    pub prepared: &'a dyn Fn(&str, &Prepared),
    /// Each refusal.
    pub refused: &'a dyn Fn(&BatchStep, &ErrorBody),
    /// Each step's latency, under its route's name ([`route_of`]): a step
    /// that shares a commit, from its run's start to the commit; else its own.
    pub took: &'a dyn Fn(&str, std::time::Duration),
}

/// The name of a step's own route (`/storage-pd/read/end` → `read/end`),
/// which a step taken in a batch is timed under too.
pub fn route_of(step: &BatchStep) -> &'static str {
    match step {
        BatchStep::EndRead(_) => "read/end",
        other => other.name(),
    }
}

/// Runs a batch's steps (see the module): one result per step, in order,
/// each told to `told` as it is taken.
pub fn run_batch(
    svc: &Service,
    who: &Caller,
    steps: Vec<BatchStep>,
    cancel: &CancelToken,
    told: &Told<'_>,
) -> Vec<BatchResult> {
    let Told { prepared, refused, took } = *told;
    let one = |step: &BatchStep| -> BatchResult {
        let answer = take(svc, who, step, cancel);
        if let (BatchStep::Prepare(r), Ok(Answer::Prepared(p))) = (step, &answer) {
            prepared(&r.req_id, p);
        }
        match answer {
            Ok(a) => match serde_json::value::to_raw_value(&a) {
                Ok(v) => BatchResult { status: 200, ok: Some(v), error: None },
                Err(e) => failed(ErrorBody::new(RefusalCode::Internal, "", format!("encoding the answer: {e}"))),
            },
            Err(e) => {
                let body = from_protocol(&e);
                refused(step, &body);
                failed(body)
            }
        }
    };
    let mut results = Vec::with_capacity(steps.len());
    let mut steps = steps.into_iter().peekable();
    while let Some(first) = steps.next() {
        let kind = std::mem::discriminant(&first);
        let mut run = vec![first];
        while let Some(next) = steps.next_if(|s| std::mem::discriminant(s) == kind) {
            run.push(next);
        }
        // Reads journal nothing: no commit to share.
        if matches!(run[0], BatchStep::Prepare(_) | BatchStep::Cancel(_) | BatchStep::Read(_) | BatchStep::EndRead(_)) {
            results.extend(run.iter().map(|step| {
                let started = std::time::Instant::now();
                let answer = one(step);
                took(route_of(step), started.elapsed());
                answer
            }));
            continue;
        }
        let started = std::time::Instant::now();
        let (mut taken, committed): (Vec<BatchResult>, _) =
            svc.store().with_one_commit(|| run.iter().map(one).collect());
        let elapsed = started.elapsed();
        run.iter().for_each(|step| took(route_of(step), elapsed));
        if let Err(e) = committed {
            // Nothing the run did is durable: every step of it failed.
            let body = from_store(&e);
            for (r, step) in taken.iter_mut().zip(&run).filter(|(r, _)| r.error.is_none()) {
                refused(step, &body);
                *r = failed(body.clone());
            }
        }
        results.append(&mut taken);
    }
    results
}

fn failed(body: ErrorBody) -> BatchResult {
    BatchResult { status: body.status, ok: None, error: Some(body) }
}
