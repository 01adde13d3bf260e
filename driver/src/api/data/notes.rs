//! What a data connection writes on the timeline: each chunk's transfer
//! (its path, bytes, verdict, crc32c, and for a load who checked it and
//! where), and each failed store or load.

use super::Conn;
use crate::api::data_error::DataError;
use crate::api::wire::DataChunk;
use pdstor_client::receipt::Receipt;

impl Conn {
    /// One timeline line per chunk moved, with its path, bytes and verdict
    /// (`unverifiable(no probes)` when the daemon runs without them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn note_transfers(
        &self,
        event: &str,
        claim: Option<&Receipt>,
        publication: u64,
        chunks: &[DataChunk],
        verdicts: &[String],
        took: std::time::Duration,
        crcs: &[Option<u32>],
        bytes: impl Fn(&DataChunk) -> u64,
    ) {
        if let Some(first) = chunks.first() {
            self.metrics.transfer(event, &self.path_of(first).to_string(), took);
        }
        let Some(t) = self.service.timeline() else { return };
        for (i, c) in chunks.iter().enumerate() {
            let e = pdstor_client::timeline::Event::new(event);
            let e = match claim {
                Some(r) => e.claim(r),
                None => e.publication(publication),
            };
            let mut e = e.chunk(c.index).by(self.caller.audit());
            e.crc32c = crcs.get(i).copied().flatten();
            if event == "load" {
                e.checked = Some(match e.crc32c {
                    Some(_) => format!(
                        "daemon, in place in the reader's buffer, on the CPU ({})",
                        pdstor_engine::crc32c::chosen().imp.name()
                    ),
                    None if self.unchecked.contains(&c.buffer) => {
                        "not by the daemon: the reader registered its buffer unchecked (staging it checks as it copies each chunk out, or a benchmark's unchecked baseline)".into()
                    }
                    None => "not by the daemon (memory it cannot map): the reader checks it".into(),
                });
            }
            e.path = Some(self.path_of(c).to_string());
            e.bytes = Some(bytes(c));
            e.verdict = Some(verdicts.get(i).cloned().unwrap_or_else(|| "unverifiable(no probes)".into()));
            e.dur_ns = Some(took.as_nanos() as u64);
            t.emit(e);
        }
    }

    pub(super) fn note_failure(&self, event: &str, publication: u64, e: &DataError) {
        let body = e.body();
        pdstor_client::timeline::emit(
            self.service.timeline(),
            pdstor_client::timeline::Event::new(event)
                .publication(publication)
                .detail(format!("{} ({}): {}", body.code, body.field, body.message))
                .by(self.caller.audit()),
        );
    }
}
