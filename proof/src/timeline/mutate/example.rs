//! A complete, clean handoff as a timeline: what the checker's own tests and
//! the mutation test start from when no timeline is given.

use crate::timeline::{Event, tokens_digest};

/// A correct handoff of two chunks, as the nodes write it: the oracle's
/// continuation, the daemon's prepare, stores and publish, the writer's echo,
/// the claim, adopt (with its nonce) and loads, the reader's decode and
/// continuation, the daemon's ack (its digest bound to the nonce) and the
/// reader's echo.
pub fn example() -> Vec<Event> {
    let mut ts = 0u64;
    let mut ev = |node: &str, seq: u64, event: &str| {
        ts += 1000;
        Event {
            node: node.into(),
            seq,
            ts_ns: ts,
            event: event.into(),
            req_id: Some("r1".into()),
            publication: Some(7),
            ..Default::default()
        }
    };
    let crcs = [0x1111_1111u32, 0x2222_2222];
    let nonce = "00112233445566778899aabbccddeeff";
    let tokens = vec![9, 5, 6, 7];
    let claimed = |mut e: Event| {
        e.receipt = Some("C".into());
        e.reader = Some("decode-0".into());
        e.session = Some("s-1".into());
        e
    };
    let payload = |mut e: Event, chunk: u32| {
        e.chunk = Some(chunk);
        e.path = Some("host_fixed".into());
        e.verdict = Some("native".into());
        e.bytes = Some(4096);
        e.crc32c = Some(crcs[chunk as usize]);
        e.dur_ns = Some(500);
        e
    };
    let mut oracle = ev("oracle", 1, "oracle");
    oracle.publication = None;
    oracle.tokens = Some(tokens.clone());
    oracle.digest = Some(tokens_digest(&tokens));
    let prepare = ev("daemon-e1", 1, "prepare");
    let s0 = payload(ev("daemon-e1", 2, "store"), 0);
    let s1 = payload(ev("daemon-e1", 3, "store"), 1);
    let mut publish = ev("daemon-e1", 4, "publish");
    publish.chunks = Some(2);
    publish.crcs = Some(crcs.to_vec());
    publish.token = Some(9);
    publish.receipt = Some("R".into());
    let mut echo = ev("writer-1", 1, "publish");
    echo.receipt = Some("R".into());
    let claim = claimed(ev("daemon-e1", 5, "claim"));
    let mut adopt = claimed(ev("daemon-e1", 6, "adopt"));
    adopt.nonce = Some(nonce.into());
    let l0 = claimed(payload(ev("daemon-e1", 7, "load"), 0));
    let l1 = claimed(payload(ev("daemon-e1", 8, "load"), 1));
    let mut decode = claimed(ev("reader-1", 1, "decode_start"));
    decode.token = Some(9);
    let mut cont = claimed(ev("reader-1", 2, "continuation"));
    cont.tokens = Some(tokens.clone());
    cont.digest = Some(tokens_digest(&tokens));
    let digest = pdstor_client::receipt::restore_digest(nonce, &crcs);
    let mut ack = claimed(ev("daemon-e1", 9, "ack"));
    ack.digest = Some(digest.clone());
    let mut ack_echo = claimed(ev("reader-1", 3, "ack"));
    ack_echo.digest = Some(digest);
    vec![oracle, prepare, s0, s1, publish, echo, claim, adopt, l0, l1, decode, cont, ack, ack_echo]
}

/// A cache publication of two chunks read by two readers at once, as the
/// daemon writes it: prepare, stores, publish, two reads (each with its
/// receipt and nonce), their loads interleaved, each read ended done with
/// its digest, then the writer's release once no read is open.
pub fn example_cache() -> Vec<Event> {
    let mut ts = 0u64;
    let mut seq = 0u64;
    let mut ev = |event: &str| {
        ts += 1000;
        seq += 1;
        Event {
            node: "daemon-e1".into(),
            seq,
            ts_ns: ts,
            event: event.into(),
            req_id: Some("k1".into()),
            publication: Some(8),
            ..Default::default()
        }
    };
    let crcs = [0x3333_3333u32, 0x4444_4444];
    let payload = |mut e: Event, chunk: u32| {
        e.chunk = Some(chunk);
        e.path = Some("host_fixed".into());
        e.verdict = Some("native".into());
        e.bytes = Some(4096);
        e.crc32c = Some(crcs[chunk as usize]);
        e.dur_ns = Some(500);
        e
    };
    let reads = [("A", "decode-0", "s-1", "aa00"), ("B", "decode-1", "s-2", "bb11")];
    let of = |mut e: Event, which: usize| {
        let (receipt, reader, session, _) = reads[which];
        e.receipt = Some(receipt.into());
        e.reader = Some(reader.into());
        e.session = Some(session.into());
        e
    };
    let mut out = vec![ev("prepare"), payload(ev("store"), 0), payload(ev("store"), 1)];
    let mut publish = ev("publish");
    publish.chunks = Some(2);
    publish.crcs = Some(crcs.to_vec());
    publish.receipt = Some("R8".into());
    out.push(publish);
    for (which, (_, _, _, nonce)) in reads.iter().enumerate() {
        let mut read = of(ev("read"), which);
        read.nonce = Some((*nonce).into());
        out.push(read);
    }
    out.push(of(payload(ev("load"), 0), 0));
    out.push(of(payload(ev("load"), 0), 1));
    out.push(of(payload(ev("load"), 1), 0));
    let done = |e: Event, which: usize| {
        let mut e = of(e, which);
        e.digest = Some(pdstor_client::receipt::restore_digest(reads[which].3, &crcs));
        e
    };
    out.push(done(ev("read_done"), 0));
    out.push(of(payload(ev("load"), 1), 1));
    out.push(done(ev("read_done"), 1));
    out.push(ev("release"));
    out
}
