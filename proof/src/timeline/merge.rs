//! `pdstor timeline merge`: one timeline from several hosts' timelines.
//!
//! Hosts share no clock (each line's `boot` says whose `CLOCK_MONOTONIC` its
//! `ts_ns` is), so lines of different files are never ordered by time. They
//! are ordered by the protocol's messages instead, each of which one host
//! sends and another receives:
//!
//! - a client's echo of a step (`claim`, `adopt`, `publish`, `ack`) follows
//!   the daemon's line for that step of that publication — the client learnt
//!   of the step from the daemon's answer;
//! - a client's own read of a chunk (`load` on a host that reads the shared
//!   namespace itself) follows the daemon's `adopt` — the manifest came in its
//!   answer;
//! - the daemon's `loaded` of a chunk follows that client's `load` of it — the
//!   report carried its checksum; the daemon's `ack` follows the client's
//!   `restored` — the ack carried its digest.
//!
//! Each file keeps its own order. The merge takes, again and again, the first
//! file (in the order given) whose next line has everything it follows from
//! already merged; an edge whose cause appears in no file constrains nothing.
//! If no file can go on, the timelines contradict each other (a host
//! recorded an effect before any host recorded its cause) and the merge says
//! where, rather than invent an order.

use std::collections::HashSet;

use super::Event;
use super::check::is_daemon;

/// What a line is, as a cause: `(daemon?, event, publication, chunk)`.
type Key = (bool, String, u64, Option<u32>);

/// Timelines that cannot be put in one causal order.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A line of an input is not a timeline event.
    #[error("{file} line {line}: not a timeline event ({why}); check it with `pdstor timeline check`")]
    Malformed {
        /// The input.
        file: String,
        /// Its line.
        line: usize,
        /// The parse error.
        why: String,
    },
    /// Every file's next line waits for a line that only follows it.
    #[error("the timelines contradict each other: no file can go on — {stuck}")]
    Cycle {
        /// Each file's next line and what it waits for.
        stuck: String,
    },
}

/// The lines `e` follows from on other hosts (see the module's rules).
fn causes(e: &Event) -> Vec<Key> {
    let Some(p) = e.publication else { return Vec::new() };
    let ev = e.event.as_str();
    if is_daemon(&e.node) {
        match ev {
            "loaded" => vec![(false, "load".into(), p, e.chunk)],
            "ack" => vec![(false, "restored".into(), p, None)],
            _ => Vec::new(),
        }
    } else {
        match ev {
            "claim" | "adopt" | "publish" | "ack" => vec![(true, ev.into(), p, None)],
            "load" => vec![(true, "adopt".into(), p, None)],
            _ => Vec::new(),
        }
    }
}

fn key(e: &Event) -> Option<Key> {
    let p = e.publication?;
    let chunk = if e.event == "load" && !is_daemon(&e.node) { e.chunk } else { None };
    Some((is_daemon(&e.node), e.event.clone(), p, chunk))
}

/// Merges `files` (each: its name and its lines as [`super::read`] returns
/// them) into one causal order.
pub fn merge(files: &[(String, super::Lines)]) -> Result<Vec<Event>, MergeError> {
    let mut queues: Vec<(&str, Vec<&Event>)> = Vec::with_capacity(files.len());
    for (name, lines) in files {
        let mut q = Vec::with_capacity(lines.len());
        for (line, parsed) in lines {
            match parsed {
                Ok(e) => q.push(e),
                Err(why) => return Err(MergeError::Malformed { file: name.clone(), line: *line, why: why.clone() }),
            }
        }
        queues.push((name.as_str(), q));
    }
    // Causes some file records; others constrain nothing.
    let recorded: HashSet<Key> = queues.iter().flat_map(|(_, q)| q.iter().filter_map(|e| key(e))).collect();
    let mut merged_keys: HashSet<Key> = HashSet::new();
    let mut next = vec![0usize; queues.len()];
    let total: usize = queues.iter().map(|(_, q)| q.len()).sum();
    let mut out = Vec::with_capacity(total);
    while out.len() < total {
        let ready = |i: usize| -> bool {
            let (_, q) = &queues[i];
            q.get(next[i]).is_some_and(|e| causes(e).iter().all(|c| !recorded.contains(c) || merged_keys.contains(c)))
        };
        let Some(i) = (0..queues.len()).find(|&i| ready(i)) else {
            let stuck = (0..queues.len())
                .filter_map(|i| {
                    let (name, q) = &queues[i];
                    let e = q.get(next[i])?;
                    let waits: Vec<String> = causes(e)
                        .into_iter()
                        .filter(|c| recorded.contains(c) && !merged_keys.contains(c))
                        .map(|(d, ev, p, c)| {
                            let who = if d { "the daemon's" } else { "a client's" };
                            let chunk = c.map(|c| format!(" chunk {c}")).unwrap_or_default();
                            format!("{who} {ev} of publication {p}{chunk}")
                        })
                        .collect();
                    Some(format!("{name}: {} {} (seq {}) waits for {}", e.node, e.event, e.seq, waits.join(", ")))
                })
                .collect::<Vec<_>>()
                .join("; ");
            return Err(MergeError::Cycle { stuck });
        };
        let e = queues[i].1[next[i]];
        next[i] += 1;
        if let Some(k) = key(e) {
            merged_keys.insert(k);
        }
        out.push(e.clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(node: &str, seq: u64, event: &str, chunk: Option<u32>) -> Event {
        Event { seq, node: node.into(), event: event.into(), publication: Some(7), chunk, ..Default::default() }
    }

    fn file(name: &str, events: Vec<Event>) -> (String, crate::timeline::Lines) {
        (name.into(), events.into_iter().enumerate().map(|(i, e)| (i + 1, Ok(e))).collect())
    }

    fn order(events: &[Event]) -> Vec<String> {
        events.iter().map(|e| format!("{}:{}", e.node, e.event)).collect()
    }

    /// The reader host's file first on the command line: still ordered by the messages.
    #[test]
    fn lines_follow_the_messages_that_caused_them() {
        let daemon = file(
            "owner",
            vec![
                line("daemon-e1", 1, "publish", None),
                line("daemon-e1", 2, "claim", None),
                line("daemon-e1", 3, "adopt", None),
                line("daemon-e1", 4, "loaded", Some(0)),
                line("daemon-e1", 5, "ack", None),
            ],
        );
        let reader = file(
            "reader",
            vec![
                line("remote-r", 1, "claim", None),
                line("remote-r", 2, "load", Some(0)),
                line("remote-r", 3, "restored", None),
                line("remote-r", 4, "ack", None),
            ],
        );
        let merged = merge(&[reader, daemon]).unwrap();
        assert_eq!(
            order(&merged),
            [
                "daemon-e1:publish",
                "daemon-e1:claim",
                "remote-r:claim",
                "daemon-e1:adopt",
                "remote-r:load",
                "remote-r:restored",
                "daemon-e1:loaded",
                "daemon-e1:ack",
                "remote-r:ack"
            ]
        );
    }

    /// A reader that says it read a chunk only after the daemon recorded its
    /// report of it: no order can hold both files; the merge says which lines wait.
    #[test]
    fn contradicting_files_are_refused() {
        let daemon = file(
            "owner",
            vec![
                line("daemon-e1", 1, "adopt", None),
                line("daemon-e1", 2, "loaded", Some(0)),
                line("daemon-e1", 3, "ack", None),
            ],
        );
        let reader = file("reader", vec![line("remote-r", 1, "ack", None), line("remote-r", 2, "load", Some(0))]);
        let e = merge(&[daemon, reader]).unwrap_err().to_string();
        assert!(e.contains("contradict") && e.contains("waits for"), "{e}");
    }

    /// A cause no file recorded constrains nothing; a malformed line is refused.
    #[test]
    fn missing_causes_do_not_block_and_malformed_lines_are_named() {
        let reader = file("reader", vec![line("remote-r", 1, "claim", None)]);
        assert_eq!(merge(&[reader]).unwrap().len(), 1);
        let bad = ("x.jsonl".to_owned(), vec![(3, Err("EOF".to_owned()))]);
        let e = merge(&[bad]).unwrap_err().to_string();
        assert!(e.contains("x.jsonl line 3"), "{e}");
    }
}
