//! What each line of a timeline must agree with: the checks of one event
//! against what its publication has seen so far (stores, the publish, loads,
//! the reader's steps, the daemon's ack).

use super::*;

/// A chunk stored or loaded: on the required path, native.
pub(super) fn payload(v: &mut Sink, path: PayloadPath, line: usize, who: &str, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match e.path.as_deref() {
        Some(p) if p == path.as_str() => {}
        other => v.add(
            line,
            "wrong_path",
            format!("{who} chunk {chunk} {} on {}, required {path}", e.event, other.unwrap_or("no path")),
        ),
    }
    match e.verdict.as_deref() {
        Some("native") => {}
        other => v.add(
            line,
            "not_native",
            format!("{who} chunk {chunk} {}: verdict {}", e.event, other.unwrap_or("none recorded")),
        ),
    }
}

/// When a transfer started: its line's time less its duration.
fn started(e: &Event) -> u64 {
    e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0))
}

fn hex32(c: Option<u32>) -> String {
    c.map_or_else(|| "none".into(), |c| format!("{c:#010x}"))
}

/// A chunk stored: after the prepare, before the publish, once.
pub(super) fn store(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match &p.prepared {
        None => v.add(line, "causality", format!("{who}: chunk {chunk} stored before prepare")),
        Some((t, boot)) if same_clock(boot, &e.boot) && started(e) < *t => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk}'s store started at {} before its prepare at {t}", started(e)),
        ),
        Some(_) => {}
    }
    if p.publish.is_some() {
        v.add(line, "causality", format!("{who}: chunk {chunk} stored after publish"));
    }
    match p.stored.get(&chunk) {
        Some(first) if first.crc != e.crc32c => v.add(
            line,
            "store_conflict",
            format!(
                "{who}: chunk {chunk} stored again with crc32c {}, first {} at line {}",
                hex32(e.crc32c),
                hex32(first.crc),
                first.line
            ),
        ),
        Some(first) => v.add(
            line,
            "duplicate_store",
            format!("{who}: chunk {chunk} stored a second time (first at line {})", first.line),
        ),
        None => {
            p.stored.insert(chunk, Stored { crc: e.crc32c, ts: e.ts_ns, boot: e.boot.clone(), line });
        }
    }
}

/// The daemon's publish: complete, the chunks exactly as stored, once.
pub(super) fn publish(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    if let Some(first) = &p.publish {
        let m = format!("{who}: second publish by {} (first at line {})", e.node, first.line);
        v.add(line, "duplicate_publish", m);
        return;
    }
    let Some(n) = e.chunks else {
        v.add(line, "publish_incomplete", format!("{who}: the daemon's publish carries no chunk count"));
        p.publish = Some(Publish { line, chunks: 0, crcs: None, token: e.token });
        return;
    };
    match &e.crcs {
        None => v.add(line, "publish_incomplete", format!("{who}: the daemon's publish carries no chunk crc32c list")),
        Some(c) if c.len() != n as usize => {
            v.add(line, "publish_mismatch", format!("{who}: publish declares {n} chunks but lists {} crc32c", c.len()))
        }
        Some(_) => {}
    }
    if let Some(&beyond) = p.stored.keys().find(|&&c| c >= n) {
        v.add(line, "publish_mismatch", format!("{who}: publish declares {n} chunks but chunk {beyond} was stored"));
    }
    let missing: Vec<u32> = (0..n).filter(|c| !p.stored.contains_key(c)).collect();
    if !missing.is_empty() {
        v.add(line, "missing_store", format!("{who} published with chunks {missing:?} never stored"));
    }
    if let Some(crcs) = &e.crcs {
        for (i, crc) in crcs.iter().enumerate() {
            if let Some(s) = p.stored.get(&(i as u32))
                && s.crc.is_some_and(|c| c != *crc)
            {
                let m = format!(
                    "{who}: publish lists crc32c {crc:#010x} for chunk {i}, stored {} at line {}",
                    hex32(s.crc),
                    s.line
                );
                v.add(line, "publish_mismatch", m);
            }
        }
    }
    p.publish = Some(Publish { line, chunks: n, crcs: e.crcs.clone(), token: e.token });
    same_receipt(v, line, who, "READY", &mut p.ready_receipt, e);
}

/// A chunk loaded: of the manifest, after the adopt and the chunk's store,
/// by the claimed reader, with the stored bytes.
pub(super) fn load(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    match &p.adopt {
        None => v.add(line, "causality", format!("{who}: chunk {chunk} loaded before adopt")),
        Some(a) if same_clock(&a.boot, &e.boot) && started(e) < a.ts => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk}'s load started at {} before its adopt at {}", started(e), a.ts),
        ),
        Some(_) => {}
    }
    load_checks(v, line, who, p, e);
    same_reader(v, line, who, p, e);
    p.loaded.insert(chunk);
    p.served.insert(chunk, e.crc32c);
}

/// What any load must be: of a chunk of the manifest, after its store,
/// with the stored bytes.
pub(super) fn load_checks(v: &mut Sink, line: usize, who: &str, p: &Pub, e: &Event) {
    let chunk = e.chunk.unwrap_or(u32::MAX);
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    if chunk >= n {
        v.add(line, "unknown_chunk", format!("{who}: chunk {chunk} loaded, the manifest has chunks 0..{n}"));
    }
    match p.stored.get(&chunk) {
        Some(s) if same_clock(&s.boot, &e.boot) && e.ts_ns < s.ts => v.add(
            line,
            "causality",
            format!("{who}: chunk {chunk} loaded (ended at {}) before its store completed (at {})", e.ts_ns, s.ts),
        ),
        Some(s) if e.crc32c.is_some() && s.crc.is_some() && e.crc32c != s.crc => v.add(
            line,
            "load_mismatch",
            format!("{who}: chunk {chunk} loaded with crc32c {}, stored {}", hex32(e.crc32c), hex32(s.crc)),
        ),
        Some(_) => {}
        None if chunk < n => v.add(line, "causality", format!("{who}: chunk {chunk} loaded, never stored")),
        None => {}
    }
}

/// A step names the claimed reader and session, where it names one.
fn same_reader(v: &mut Sink, line: usize, who: &str, p: &Pub, e: &Event) {
    let Some(c) = &p.claim else { return };
    let differs =
        |mine: &Option<String>, claimed: &Option<String>| mine.is_some() && claimed.is_some() && mine != claimed;
    if differs(&e.reader, &c.reader) || differs(&e.session, &c.session) {
        let m = format!(
            "{who}: {} by reader {} session {}, the claim (line {}) is {} session {}",
            e.event,
            e.reader.as_deref().unwrap_or("?"),
            e.session.as_deref().unwrap_or("?"),
            c.line,
            c.reader.as_deref().unwrap_or("?"),
            c.session.as_deref().unwrap_or("?"),
        );
        v.add(line, "reader_mismatch", m);
    }
}

/// The reader's steps: claim → adopt → decode start → continuation → ack.
pub(super) fn reader_step(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event, daemon: bool) {
    match (e.event.as_str(), daemon) {
        ("claim", true) => {
            if let Some(first) = p.reads.values().map(|r| r.line).min() {
                let m = format!(
                    "{who}: claim of a cache publication, read since line {first} (read by many, never claimed)"
                );
                v.add(line, "read_class", m);
            }
            if p.publish.is_none() {
                v.add(line, "causality", format!("{who}: claim before publish"));
            }
            if let Some(first) = &p.claim {
                v.add(line, "duplicate_claim", format!("{who}: second claim (first at line {})", first.line));
                return;
            }
            p.claim = Some(Claim { line, reader: e.reader.clone(), session: e.session.clone() });
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("claim_again", true) => {
            if p.claim.is_none() {
                v.add(line, "causality", format!("{who}: a repeated claim answered, no claim recorded before it"));
            }
            same_reader(v, line, who, p, e);
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("claim", false) => {
            if p.claim.is_none() {
                v.add(line, "unrecorded_step", format!("{who}: {} echoes a claim the daemon never recorded", e.node));
            }
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("adopt", true) => {
            if p.claim.is_none() {
                v.add(line, "causality", format!("{who}: adopt before claim"));
            }
            same_reader(v, line, who, p, e);
            p.adopt = Some(Adopt { ts: e.ts_ns, boot: e.boot.clone(), nonce: e.nonce.clone() });
            p.served.clear();
            p.loaded.clear();
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("decode_start", _) => decode_start(v, line, who, p, e),
        ("restored", _) => {
            let n = p.publish.as_ref().map_or(0, |x| x.chunks);
            let missing: Vec<u32> = (0..n).filter(|c| !p.served.contains_key(c)).collect();
            if p.adopt.is_none() || !missing.is_empty() {
                v.add(line, "causality", format!("{who}: restored with chunks {missing:?} not loaded"));
            }
            p.restored = true;
            p.decoders.insert(e.node.clone());
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("continuation", _) => {
            if !p.decoded {
                v.add(line, "causality", format!("{who}: continuation before decode start"));
            }
            p.continued = true;
        }
        ("loaded", true) => reported_loaded(v, line, who, p, e),
        ("ack", true) => daemon_ack(v, line, who, p, e),
        ("ack", false) => {
            if p.ack.is_none() {
                v.add(line, "unrecorded_step", format!("{who}: {} echoes an ack the daemon never recorded", e.node));
            }
            if !p.decoders.contains(&e.node) {
                v.add(line, "foreign_ack", format!("{who}: ack by {}, which never decoded or restored it", e.node));
            }
            same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
        }
        ("release" | "evict" | "expire", true) if !super::reads::open(p, &e.node).is_empty() => {
            let open = super::reads::open(p, &e.node);
            v.add(
                line,
                "release_while_read",
                format!("{who}: {} while the reads begun at lines {open:?} are open", e.event),
            );
        }
        ("release" | "evict" | "expire", true) if p.claim.is_some() => {
            let claim = p.claim.as_ref().map(|c| c.line);
            v.add(line, "causality", format!("{who}: {} after its claim (line {claim:?})", e.event));
        }
        _ => {}
    }
}

/// A decode starts: after adopt, with every chunk loaded, from the
/// publication's first token; the next continuation belongs to it.
fn decode_start(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    let missing: Vec<u32> = (0..n).filter(|c| !p.loaded.contains(c)).collect();
    if p.adopt.is_none() {
        v.add(line, "causality", format!("{who}: decode before adopt"));
    } else if !missing.is_empty() {
        v.add(line, "causality", format!("{who}: decode started with chunks {missing:?} not loaded"));
    }
    let published = p.publish.as_ref().and_then(|x| x.token);
    if e.token.is_some() && published.is_some() && e.token != published {
        let m = format!(
            "{who}: decode starts from token {}, the publication's is {}",
            e.token.map_or_else(|| "none".into(), |t| t.to_string()),
            published.map_or_else(|| "none".into(), |t| t.to_string())
        );
        v.add(line, "token_mismatch", m);
    }
    same_reader(v, line, who, p, e);
    p.loaded.clear();
    p.decoded = true;
    // Each decode records its own continuation before the ack.
    p.continued = false;
    p.decoders.insert(e.node.clone());
    same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
}

/// The daemon recorded a chunk a reader read itself from the shared
/// namespace (it checked its crc32c): it counts as loaded.
fn reported_loaded(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    // A reader that read the chunk itself, from the shared namespace:
    // the daemon checked its crc32c; it counts as loaded.
    let chunk = e.chunk.unwrap_or(u32::MAX);
    if p.adopt.is_none() {
        v.add(line, "causality", format!("{who}: chunk {chunk} reported loaded before adopt"));
    }
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    if chunk >= n {
        v.add(line, "unknown_chunk", format!("{who}: chunk {chunk} reported loaded, the manifest has chunks 0..{n}"));
    }
    if let Some(s) = p.stored.get(&chunk)
        && e.crc32c.is_some()
        && s.crc.is_some()
        && e.crc32c != s.crc
    {
        let m =
            format!("{who}: chunk {chunk} reported loaded with crc32c {}, stored {}", hex32(e.crc32c), hex32(s.crc));
        v.add(line, "load_mismatch", m);
    }
    same_reader(v, line, who, p, e);
    p.loaded.insert(chunk);
    p.served.insert(chunk, e.crc32c);
}

/// The daemon's ack: once, after the reader restored every chunk it loaded
/// for this claim, bound to the adopt's nonce.
fn daemon_ack(v: &mut Sink, line: usize, who: &str, p: &mut Pub, e: &Event) {
    if let Some(first) = p.ack {
        v.add(line, "duplicate_ack", format!("{who}: second ack by {} (first at line {first})", e.node));
        return;
    }
    p.ack = Some(line);
    same_receipt(v, line, who, "claim", &mut p.claim_receipt, e);
    same_reader(v, line, who, p, e);
    let Some(Adopt { nonce, .. }) = &p.adopt else {
        v.add(line, "causality", format!("{who}: ack before adopt"));
        return;
    };
    let n = p.publish.as_ref().map_or(0, |x| x.chunks);
    let unserved: Vec<u32> = (0..n).filter(|c| !p.served.contains_key(c)).collect();
    if !unserved.is_empty() {
        let m = format!("{who}: acknowledged with chunks {unserved:?} never loaded for this claim");
        v.add(line, "ack_without_load", m);
        return;
    }
    if !p.decoded && !p.restored {
        v.add(line, "causality", format!("{who}: ack before the reader decoded or restored it"));
    } else if p.decoded && !p.continued {
        let m = format!("{who} ({}) was acknowledged with no continuation record", p.req_id.as_deref().unwrap_or("?"));
        v.add(line, "missing_continuation", m);
    }
    // The chain: what was stored, as loaded, into the ack's digest.
    if let (Some(nonce), Some(digest)) = (nonce, &e.digest) {
        let published = p.publish.as_ref().and_then(|x| x.crcs.clone()).unwrap_or_default();
        let crcs: Vec<u32> = (0..n)
            .map(|c| {
                let served = p.served.get(&c).copied().flatten();
                let stored = p.stored.get(&c).and_then(|s| s.crc);
                served.or(stored).or_else(|| published.get(c as usize).copied()).unwrap_or(0)
            })
            .collect();
        if pdstor_client::receipt::restore_digest(nonce, &crcs) != *digest {
            let m = format!("{who}: the ack's restore digest is not that of the claim's nonce and the loaded chunks");
            v.add(line, "restore_mismatch", m);
        }
    }
}

/// Every node names the same `which` receipt for a publication.
pub(super) fn same_receipt(
    v: &mut Sink,
    line: usize,
    who: &str,
    which: &str,
    first: &mut Option<(String, usize)>,
    e: &Event,
) {
    let Some(r) = &e.receipt else { return };
    match first {
        Some((seen, at)) if seen != r => v.add(
            line,
            "receipt_mismatch",
            format!("{who}: {} by {} names a {which} receipt other than the one at line {at}", e.event, e.node),
        ),
        Some(_) => {}
        None => *first = Some((r.clone(), line)),
    }
}
