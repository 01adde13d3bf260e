//! The fault controls of `pdstor qualify`: stop handling, cancellation
//! mid-restore, a failed load of a corrupted chunk, mismatched receipts, a
//! duplicate ACK, an unread release and pressure beyond capacity. Each says
//! what it saw, or why it did not hold.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};

use super::{ControlResult, Prepared, ReaderMode, Run, compare, prompt};
use pdstor_client::Client;
use pdstor_client::receipt::Receipt;

impl Run<'_> {
    pub(super) fn controls(&mut self) -> Vec<ControlResult> {
        let result = |name, r: anyhow::Result<String>| match r {
            Ok(detail) => ControlResult { name, ok: true, detail },
            Err(e) => ControlResult { name, ok: false, detail: format!("{e:#}") },
        };
        vec![
            result("stop_handling", self.stop_handling()),
            result("cancellation", self.cancellation()),
            result("failed_load", self.failed_load()),
            result("mismatched_receipts", self.mismatched_receipts()),
            result("duplicate_ack", self.duplicate_ack()),
            result("unread_release", self.unread_release()),
            result("pressure", self.pressure()),
        ]
    }

    fn stop_handling(&mut self) -> anyhow::Result<String> {
        let budget = 24;
        let len = 2 * self.cfg.chunk_tokens + self.cfg.chunk_tokens / 2;
        let free = self.model.generate(&prompt(len, 900), budget, None);
        let stop = free.tokens[budget / 2];
        let (p, published) = self.one("control-stop", budget, Some(stop))?;
        if p.oracle.tokens.len() >= budget {
            bail!("the stop token {stop} did not end the oracle early");
        }
        let claim = self.claim(&published.receipt, "control-stop")?;
        let o = self.restore(&p, claim, budget, Some(stop), ReaderMode::Restore)?;
        let cold = o.cold.as_ref().context("no continuation")?;
        compare(&p.oracle, cold).map_err(|e| anyhow::anyhow!(e))?;
        Ok(format!(
            "stop token {stop} ended the restored decode after {} of {budget} tokens, as it ended the oracle",
            cold.tokens.len()
        ))
    }

    fn cancellation(&mut self) -> anyhow::Result<String> {
        let (p, published) = self.one("control-cancel", 8, None)?;
        let claim = self.claim(&published.receipt, "control-cancel")?;
        self.restore(&p, claim.clone(), 8, None, ReaderMode::Cancel)?;
        let c = self.client();
        let state =
            c.publications(None, false)?.into_iter().find(|x| x.publication == claim.publication).map(|x| x.state);
        if state.as_deref() != Some("ADOPTED") {
            bail!("after a cancelled restore the publication is {state:?}, not ADOPTED with its lease kept");
        }
        if c.reclaim(&claim).is_ok() {
            bail!("reclaim succeeded while the cancelled reader's session was open");
        }
        c.close_session(&claim)?;
        c.reclaim(&claim)?;
        Ok("lease kept (ADOPTED, no ack) after the reader stopped mid-restore; reclaim refused until its session was closed".into())
    }

    fn failed_load(&mut self) -> anyhow::Result<String> {
        let (p, published) = self.one("control-corrupt", 8, None)?;
        let claim = self.claim(&published.receipt, "control-corrupt")?;
        let c1 = published.manifest.chunks.get(1).context("the publication has fewer than 2 chunks")?;
        let via = self.cfg.corrupt_via.clone().unwrap_or_else(|| self.cfg.target.clone());
        corrupt(&via, c1.offset.0)?;
        let o = self.restore(&p, claim.clone(), 8, None, ReaderMode::Strict)?;
        let err = o.error.clone().context("the strict reader reported no failure")?;
        if o.cold.is_some() || !err.contains("checksum mismatch") {
            bail!("the corrupted chunk gave {err:?} and continuation {:?}", o.cold);
        }
        let c = self.client();
        c.close_session(&claim)?;
        c.reclaim(&claim)?;
        Ok(format!(
            "strict reader failed ({err}); no continuation; the claim failed to RETAINED and was reclaimed once fenced"
        ))
    }

    fn mismatched_receipts(&mut self) -> anyhow::Result<String> {
        let (p, published) = self.one("control-receipts", 8, None)?;
        let c = self.client();
        let mut forged = published.receipt.clone();
        forged.manifest_digest = "00".repeat(32);
        let refused = |r: Result<Receipt, pdstor_client::ClientError>, what: &str| match r {
            Err(pdstor_client::ClientError::Api(e)) => Ok(e.code),
            other => Err(anyhow::anyhow!("{what} was not refused: {other:?}")),
        };
        let a =
            refused(c.claim(&forged, "decode-x", "control-receipts", 60_000), "a claim with a forged manifest digest")?;
        let claim = self.claim(&published.receipt, "control-receipts")?;
        let mut other_reader = claim.clone();
        other_reader.reader = Some("someone-else".into());
        let adopt = pdstor_client::wire::AdoptRequest {
            receipt: other_reader,
            namespace: claim.namespace.clone(),
            epoch: claim.epoch,
            manifest_digest: claim.manifest_digest.clone(),
            layout: self.layout.clone(),
            direct: false,
            reservation_key: None,
        };
        let b = match c.adopt(&adopt) {
            Err(pdstor_client::ClientError::Api(e)) => e.code,
            other => bail!("an adopt with another reader's receipt was not refused: {other:?}"),
        };
        let mut wrong_layout = adopt.clone();
        wrong_layout.receipt = claim.clone();
        wrong_layout.layout.chunk_tokens += 1;
        let d = match c.adopt(&wrong_layout) {
            Err(pdstor_client::ClientError::Api(e)) => e.code,
            other => bail!("an adopt with another layout was not refused: {other:?}"),
        };
        // The genuine claim still restores afterwards: refusals changed nothing.
        let o = self.restore(&p, claim, 8, None, ReaderMode::Restore)?;
        compare(&p.oracle, o.cold.as_ref().context("no continuation")?).map_err(|e| anyhow::anyhow!(e))?;
        Ok(format!(
            "refused: forged digest ({a}), another reader's receipt ({b}), another layout ({d}); the genuine claim then restored exactly"
        ))
    }

    fn duplicate_ack(&mut self) -> anyhow::Result<String> {
        let (p, published) = self.one("control-dup-ack", 8, None)?;
        let claim = self.claim(&published.receipt, "control-dup-ack")?;
        self.restore(&p, claim.clone(), 8, None, ReaderMode::Restore)?;
        // The reader process acked with the claim's nonce; any digest will do
        // for the second ack, which must be refused for the ack already made.
        let digest = pdstor_client::receipt::restore_digest(
            "",
            &published.manifest.chunks.iter().map(|c| c.crc32c).collect::<Vec<_>>(),
        );
        match self.client().ack(&claim, &digest) {
            Err(pdstor_client::ClientError::Api(e)) => Ok(format!("the second ack was refused ({})", e.code)),
            other => bail!("a second ack was not refused: {other:?}"),
        }
    }

    fn unread_release(&mut self) -> anyhow::Result<String> {
        let (_, published) = self.one("control-release", 8, None)?;
        let c = self.client();
        c.release(&published.receipt)?;
        match c.claim(&published.receipt, "decode-late", "control-release", 60_000) {
            Err(pdstor_client::ClientError::Api(e)) => {
                Ok(format!("released unread; a later claim was refused ({})", e.code))
            }
            other => bail!("a claim after release was not refused: {other:?}"),
        }
    }

    /// More concurrent requests than free slots: a filler reservation holds
    /// all but two slots, eight 3-chunk requests wait at admission, the filler
    /// is aborted, every request completes, and no slot is left behind.
    fn pressure(&mut self) -> anyhow::Result<String> {
        let c = self.client();
        let free = |c: &Client| -> anyhow::Result<u64> {
            let m = c.metrics()?;
            m.lines()
                .find_map(|l| l.strip_prefix("pdstor_slots{kind=\"free\"} "))
                .and_then(|v| v.trim().parse().ok())
                .context("no free-slot gauge in /metrics")
        };
        let before = free(&c)?;
        let filler = c.prepare("control-pressure-filler", &self.layout, (before - 2) as u32, "filler")?;
        let len = 2 * self.cfg.chunk_tokens + self.cfg.chunk_tokens / 2;
        let reqs: Vec<Prepared> =
            (0..8).map(|n| self.prepare(format!("control-pressure-{n}"), &prompt(len, 500 + n), 4, None)).collect();
        let server = self.daemon.server.clone();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            Client::new(&server).abort(filler.publication, &filler.writer_token)
        });
        let published = self.publish_all(&reqs)?;
        releaser.join().map_err(|_| anyhow::anyhow!("the releasing thread panicked"))??;
        for p in &published {
            c.release(&p.receipt)?;
        }
        let after = free(&c)?;
        if after != before {
            bail!("{before} slots were free before and {after} after");
        }
        Ok(format!(
            "8 requests of 3 chunks against 2 free slots waited, completed once the filler was aborted; {after} slots free again"
        ))
    }
}

/// Overwrites the first 4 KiB at `offset` of `path` with garbage, with
/// O_DIRECT (the daemon reads with O_DIRECT too: no stale cache between).
fn corrupt(path: &Path, offset: u64) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::File::options()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} to corrupt a chunk", path.display()))?;
    let b = pdstor_engine::buffer::Buffer::host(4096)?;
    b.write_at(0, &[0xa5; 4096])?;
    let addr = b.slice(0, 4096)?.ptr_guard().as_ptr();
    // SAFETY: `b` owns 4096 page-aligned bytes at `addr` for the call.
    let n = unsafe { libc::pwrite(f.as_raw_fd(), addr.cast(), 4096, offset as libc::off_t) };
    if n != 4096 {
        bail!("corrupting {} at {offset}: {}", path.display(), std::io::Error::last_os_error());
    }
    Ok(())
}
