//! Stores and loads, one path for one or many: a `store` or `load` frame is
//! a run of one, and a `many` frame carries the requests of many
//! publications. Consecutive stores run as one [`Store::store_batches`] and
//! consecutive loads as one [`Store::load_many`], so their I/O reaches the
//! device as one submission; each request is checked, judged and answered on
//! its own, in order, and one refused stops none of the others.
//!
//! [`Store::store_batches`]: crate::store::Store::store_batches
//! [`Store::load_many`]: crate::store::Store::load_many

use super::ack::AckAfter;
use super::{Conn, DataError, DataResponse, about_of};
use crate::api::wire::{DataChunk, DataRequest, MAX_DATA_MANY};
use pdstor_client::receipt::Receipt;

impl Conn {
    /// A `store` or `load` frame: a run of one.
    pub(super) fn one(&mut self, request: DataRequest) -> Result<DataResponse, DataError> {
        let answered = match &request {
            DataRequest::Store { .. } => self.stores(vec![request]),
            _ => self.loads(vec![request]),
        };
        answered.into_iter().next().unwrap_or_else(|| Err(DataError::BadMany("a request answered nothing".into())))
    }

    pub(super) fn many(&mut self, requests: Vec<DataRequest>) -> Result<DataResponse, DataError> {
        if requests.len() > MAX_DATA_MANY {
            return Err(DataError::BadMany(format!(
                "a many frame carries {} requests; at most {MAX_DATA_MANY}: send the rest in another",
                requests.len()
            )));
        }
        let mut answers = Vec::with_capacity(requests.len());
        let mut requests = requests.into_iter().peekable();
        while let Some(first) = requests.next() {
            let kind = std::mem::discriminant(&first);
            let mut run = vec![first];
            while let Some(next) = requests.next_if(|r| std::mem::discriminant(r) == kind) {
                run.push(next);
            }
            let abouts: Vec<Option<u64>> = run.iter().map(about_of).collect();
            let results = match &run[0] {
                DataRequest::Store { .. } => self.stores(run),
                DataRequest::Load { .. } => self.loads(run),
                _ => run
                    .iter()
                    .map(|_| {
                        Err(DataError::BadMany(
                            "a many frame carries store and load requests only: register (with its fds) or nest \
                             many in a frame of its own"
                                .into(),
                        ))
                    })
                    .collect(),
            };
            answers.extend(results.into_iter().zip(abouts).map(|(r, about)| self.answer(r, about)));
        }
        Ok(DataResponse { ok: true, many: answers, ..Default::default() })
    }

    /// Store batches of many publications, their writes submitted together.
    fn stores(&mut self, run: Vec<DataRequest>) -> Vec<Result<DataResponse, DataError>> {
        let mut begun = Vec::with_capacity(run.len());
        let mut chunks_of: Vec<(u64, Vec<DataChunk>)> = Vec::with_capacity(run.len());
        for r in run {
            match r {
                DataRequest::Store { publication, writer_token, chunks, is_last_batch, total_chunks } => {
                    begun.push(self.store_begin(publication, &writer_token, &chunks, is_last_batch, total_chunks));
                    chunks_of.push((publication, chunks));
                }
                _ => {
                    begun.push(Err(DataError::BadMany("not a store among stores".into())));
                    chunks_of.push((0, Vec::new()));
                }
            }
        }
        let batches: Vec<_> = begun.iter().filter_map(|b| b.as_ref().ok().cloned()).collect();
        let started = std::time::Instant::now();
        let mut outcomes = self.service.store().store_batches(&batches).into_iter();
        let took = started.elapsed();
        begun
            .into_iter()
            .zip(chunks_of)
            .map(|(b, (publication, chunks))| {
                b?;
                let out = outcomes.next().ok_or_else(|| DataError::BadMany("a store answered nothing".into()))?;
                self.store_end(publication, &chunks, out, took)
            })
            .collect()
    }

    /// Loads of many claims, their reads submitted together.
    fn loads(&mut self, run: Vec<DataRequest>) -> Vec<Result<DataResponse, DataError>> {
        let mut begun = Vec::with_capacity(run.len());
        let mut asked: Vec<(Option<Receipt>, Vec<DataChunk>, bool)> = Vec::with_capacity(run.len());
        let twice = loaded_twice_with_ack(&run);
        for r in run {
            match r {
                DataRequest::Load { receipt, chunks, ack } if twice.contains(&receipt.publication) => {
                    begun.push(Err(DataError::BadMany(format!(
                        "publication {} is loaded by more than one request of this frame, one of them with ack: load its chunks in one request, or ask for the ack in a later frame",
                        receipt.publication
                    ))));
                    asked.push((Some(receipt), chunks, ack));
                }
                DataRequest::Load { receipt, chunks, ack } => {
                    begun.push(self.load_begin(&receipt, &chunks, ack));
                    asked.push((Some(receipt), chunks, ack));
                }
                _ => {
                    begun.push(Err(DataError::BadMany("not a load among loads".into())));
                    asked.push((None, Vec::new(), false));
                }
            }
        }
        let loads: Vec<_> =
            begun.iter().filter_map(|b| b.as_ref().ok().map(|(m, dests)| (m.publication, dests.as_slice()))).collect();
        let started = std::time::Instant::now();
        let mut read = self.service.store().load_many(&loads).into_iter();
        let took = started.elapsed();
        let mut acks = Vec::new();
        let mut answers: Vec<_> = begun
            .into_iter()
            .zip(asked)
            .enumerate()
            .map(|(at, (b, (receipt, chunks, ack)))| {
                let (manifest, _) = b?;
                let receipt = receipt.ok_or_else(|| DataError::BadMany("a load without its receipt".into()))?;
                let crcs = read.next().ok_or_else(|| DataError::BadMany("a load answered nothing".into()))?;
                let answer = self.load_end(&receipt, &manifest, &chunks, crcs, took)?;
                if ack {
                    acks.push(AckAfter { at, receipt, manifest });
                }
                Ok(answer)
            })
            .collect();
        // The acks of the frame's loads share one commit.
        self.ack_loads(acks, &mut answers);
        answers
    }
}

/// Publications loaded by more than one request of `run` where one of them
/// asks for the ack: each is checked before any of the frame's loads runs,
/// so neither could see the other's chunks served; all are refused.
fn loaded_twice_with_ack(run: &[DataRequest]) -> std::collections::HashSet<u64> {
    let mut count: std::collections::HashMap<u64, (usize, bool)> = std::collections::HashMap::new();
    for r in run {
        if let DataRequest::Load { receipt, ack, .. } = r {
            let e = count.entry(receipt.publication).or_default();
            e.0 += 1;
            e.1 |= *ack;
        }
    }
    count.into_iter().filter(|(_, (n, ack))| *n > 1 && *ack).map(|(p, _)| p).collect()
}
