//! A load that acknowledges its claim (`load` with `ack`): the last load of
//! a claim, checked by the daemon chunk by chunk, then the ACK — the acks of
//! a frame's loads sharing one commit, none answered before it is durable.

use super::{Conn, DataError, DataResponse};
use crate::api::wire::{DataChunk, ErrorBody};
use crate::protocol::service::ProtocolError;
use pdstor_client::layout::Manifest;
use pdstor_client::receipt::Receipt;

/// A load that ran and asked to acknowledge its claim: its answer's index
/// among the frame's, its receipt and manifest.
pub(super) struct AckAfter {
    pub at: usize,
    pub receipt: Receipt,
    pub manifest: Manifest,
}

impl Conn {
    /// Before a load with `ack` moves anything: the daemon must be able to
    /// check every chunk of it (not a buffer registered unchecked or a
    /// DMA-BUF it cannot map), and the load must complete its claim.
    pub(super) fn check_ack(
        &self,
        receipt: &Receipt,
        manifest: &Manifest,
        chunks: &[DataChunk],
    ) -> Result<(), DataError> {
        if let Some(c) = chunks.iter().find(|c| self.unverifiable.contains(&c.buffer)) {
            return Err(DataError::Protocol(ProtocolError::from(crate::protocol::Refusal::new(
                pdstor_client::code::RefusalCode::WrongState,
                "ack",
                format!(
                    "chunk {} goes to buffer {}, whose loads the daemon does not check (registered unchecked, or a DMA-BUF it cannot map): load without ack, check the chunks, then ack",
                    c.index, c.buffer
                ),
            ))));
        }
        let indices: Vec<u32> = chunks.iter().map(|c| c.index).collect();
        Ok(self.service.may_ack_after(receipt, manifest, &indices)?)
    }

    /// Acknowledges the claims of `loads` (each of which answered `ok` at
    /// `answers[at]`) in one commit: each answer becomes `acked`, or the
    /// error that kept its claim from being acknowledged (a chunk not as
    /// stored, a lease that ran out, a commit that failed).
    pub(super) fn ack_loads(&self, loads: Vec<AckAfter>, answers: &mut [Result<DataResponse, DataError>]) {
        if loads.is_empty() {
            return;
        }
        let store = self.service.store();
        let (acked, committed): (Vec<Result<(), ProtocolError>>, _) = store.with_one_commit(|| {
            loads.iter().map(|l| self.service.ack_loaded(&self.caller, &l.receipt, &l.manifest)).collect()
        });
        // Nothing the frame's acks recorded is durable if their commit failed.
        let unsaved = committed.err().map(|e| crate::api::error::from_store(&e));
        for (l, outcome) in loads.iter().zip(acked) {
            let outcome = outcome.map_err(DataError::from).and_then(|()| match &unsaved {
                None => Ok(()),
                Some(body) => Err(DataError::Shared(ErrorBody {
                    message: format!(
                        "publication {}: loaded and checked, but the commit of its ack failed ({}): the ack is not durable. The store is failing (see the daemon's log); after the daemon restarts, the claim stands fenced until an operator reclaims it (pdstor reclaim)",
                        l.manifest.publication, body.message
                    ),
                    ..body.clone()
                })),
            });
            match (outcome, answers.get_mut(l.at)) {
                (Ok(()), Some(Ok(answer))) => answer.acked = true,
                (Err(e), Some(slot)) => {
                    self.note_failure("ack_failed", l.manifest.publication, &e);
                    *slot = Err(e);
                }
                _ => {}
            }
        }
    }
}
