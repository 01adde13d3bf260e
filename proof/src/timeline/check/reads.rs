//! The reads of cache publications, as the checker holds them to the rules:
//! a publication is claimed (a handoff) or read (a cache), never both; a
//! read begins only once the publication is READY; every load under a read
//! comes between its begin and its end (or the restart of the daemon that
//! began it); a verified end (`read_done`) follows
//! a load of every chunk for that read and carries the digest of the read's
//! nonce and what was loaded; and no release, eviction or expiry ends a
//! publication while any read of it is open.

use super::*;

/// One read of a cache publication, open or ended.
pub(super) struct Read {
    /// Its `read` line.
    pub(super) line: usize,
    nonce: Option<String>,
    /// The daemon incarnation that began it: a restart ends it unrecorded.
    node: String,
    /// Chunk → crc32c as the daemon loaded it for this read.
    served: BTreeMap<u32, Option<u32>>,
    /// The line that ended it.
    ended: Option<usize>,
}

/// Whether `e` is about a read of `p` (a load under a read's receipt, or
/// one of the read steps): [`step`] takes it.
pub(super) fn is_read(p: &Pub, e: &Event) -> bool {
    matches!(e.event.as_str(), "read" | "read_done" | "read_end")
        || (e.event == "load" && e.receipt.as_ref().is_some_and(|r| p.reads.contains_key(r)))
}

/// The daemon's line of a read step (or of a load under a read).
pub(super) fn step(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let Some(receipt) = e.receipt.clone() else {
        v.add(line, "receipt_mismatch", format!("{who}: {} names no read receipt", e.event));
        return;
    };
    if e.event == "read" {
        return begin(v, line, who, p, e, receipt);
    }
    let Some(r) = p.reads.get_mut(&receipt) else {
        let m = format!("{who}: {} of a read that never began", e.event);
        return v.add(line, "causality", m);
    };
    if let Some(at) = r.ended {
        let m = format!("{who}: {} under a read that ended at line {at} (begun at line {})", e.event, r.line);
        return v.add(line, "read_ended", m);
    }
    match e.event.as_str() {
        "load" => {
            steps::load_checks(v, line, who, p, e);
            if let Some(r) = p.reads.get_mut(&receipt) {
                r.served.insert(e.chunk.unwrap_or(u32::MAX), e.crc32c);
            }
        }
        "read_done" => {
            done(v, line, who, p, e, &receipt);
            end(p, &receipt, line);
        }
        _ => end(p, &receipt, line),
    }
}

fn begin(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event, receipt: String) {
    if p.publish.is_none() {
        v.add(line, "causality", format!("{who}: read before publish"));
    }
    if let Some(c) = &p.claim {
        let m = format!("{who}: read of a publication claimed at line {} (a handoff, for one reader)", c.line);
        v.add(line, "read_class", m);
    }
    if let Some(first) = p.reads.get(&receipt) {
        let m = format!("{who}: a second read with the receipt of the read at line {}", first.line);
        v.add(line, "receipt_mismatch", m);
        return;
    }
    let node = e.node.clone();
    p.reads.insert(receipt, Read { line, node, nonce: e.nonce.clone(), served: BTreeMap::new(), ended: None });
}

fn end(p: &mut Pub, receipt: &str, line: usize) {
    if let Some(r) = p.reads.get_mut(receipt) {
        r.ended = Some(line);
    }
}

/// A verified end: every chunk loaded for this read, the digest bound to its nonce.
fn done(v: &mut Sink, line: usize, who: &str, p: &Pub, e: &Event, receipt: &str) {
    let Some(r) = p.reads.get(receipt) else { return };
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    let unserved: Vec<u32> = (0..n).filter(|c| !r.served.contains_key(c)).collect();
    if !unserved.is_empty() {
        let m =
            format!("{who}: the read begun at line {} ended done with chunks {unserved:?} never loaded for it", r.line);
        return v.add(line, "read_without_load", m);
    }
    if let (Some(nonce), Some(digest)) = (&r.nonce, &e.digest) {
        let published = p.publish.as_ref().and_then(|x| x.crcs.clone()).unwrap_or_default();
        let crcs: Vec<u32> = (0..n)
            .map(|c| {
                let served = r.served.get(&c).copied().flatten();
                served.or_else(|| published.get(c as usize).copied()).unwrap_or(0)
            })
            .collect();
        if pdstor_client::receipt::restore_digest(nonce, &crcs) != *digest {
            let m = format!("{who}: the read's end digest is not that of its nonce and the chunks loaded for it");
            v.add(line, "restore_mismatch", m);
        }
    }
}

/// Reads of `p` the daemon incarnation `node` began and has not ended:
/// their begin lines. (A restart ends every read of the incarnation before
/// it without a line: its reads were in its memory.)
pub(super) fn open(p: &Pub, node: &str) -> Vec<usize> {
    p.reads.values().filter(|r| r.ended.is_none() && r.node == node).map(|r| r.line).collect()
}
