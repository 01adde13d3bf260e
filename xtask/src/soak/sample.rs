//! What the soak records every interval: the daemon process's resident
//! memory, descriptors and threads (from `/proc`), and from its `/metrics`
//! the bytes moved, each protocol step's latency histogram, the journal's
//! fill and the publications by state.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// One interval's figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t: f64,
    /// The daemon's pid then.
    pub pid: u32,
    /// Resident memory, KiB: all of it, and its anonymous part (the heap;
    /// the rest is mostly the clients' shared buffers the daemon maps).
    pub rss_kib: u64,
    pub rss_anon_kib: u64,
    /// Open descriptors.
    pub fds: u64,
    /// Threads, not counting the kernel's io_uring workers (`iou-wrk-*`,
    /// which come and go with the I/O).
    pub threads: u64,
    /// Payload bytes moved per second over the interval.
    pub mib_per_s: f64,
    /// Per step, and per payload transfer (`store host_fixed`, …): (p50,
    /// p99) in ms over the interval, where it ran.
    pub latency_ms: BTreeMap<String, (f64, f64)>,
    /// Per step and transfer, the interval's histogram: (upper bound in s,
    /// cumulative count). The latency verdict sums a window's; not written
    /// to `soak.json` (the p50/p99 above are).
    #[serde(skip)]
    pub hist: BTreeMap<String, Vec<(f64, f64)>>,
    /// Bytes of the active journal half in use.
    pub journal_bytes: u64,
    /// Publications by state.
    pub publications: BTreeMap<String, u64>,
    /// Slots free, reserved and used.
    pub slots: BTreeMap<String, u64>,
}

/// The counters a sample is a difference of: what the last scrape read.
#[derive(Debug, Default)]
pub struct Counters {
    t: f64,
    pid: u32,
    bytes: f64,
    /// Per step: cumulative count in each bucket, by upper bound.
    buckets: BTreeMap<String, Vec<(f64, f64)>>,
}

/// The daemon `pid`'s figures now, and the interval's since `last`.
pub fn take(pid: u32, control: &Path, t: f64, last: &mut Counters) -> Result<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status (is the daemon running?)"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|comm| !comm.starts_with("iou-"))
                .count() as u64
        })
        .unwrap_or(0);
    let text = metrics(control)?;
    let m = parse(&text);
    let restarted = last.pid != pid;
    let bytes: f64 = m.iter().filter(|(k, _)| k.starts_with("pdstor_payload_bytes_total{")).map(|(_, v)| v).sum();
    let moved = if restarted || bytes < last.bytes { bytes } else { bytes - last.bytes };
    let (mut latency_ms, mut hist) = (BTreeMap::new(), BTreeMap::new());
    let mut buckets: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (k, v) in &m {
        let (step, labels) = if let Some(labels) = k.strip_prefix("pdstor_step_seconds_bucket{") {
            (label(labels, "step"), labels)
        } else if let Some(labels) = k.strip_prefix("pdstor_transfer_seconds_bucket{") {
            (label(labels, "op").zip(label(labels, "path")).map(|(o, p)| format!("{o} {p}")), labels)
        } else {
            continue;
        };
        let (Some(step), Some(le)) = (step, label(labels, "le")) else { continue };
        let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::INFINITY) };
        buckets.entry(step).or_default().push((le, *v));
    }
    for (step, now) in &mut buckets {
        now.sort_by(|a, b| a.0.total_cmp(&b.0));
        let before = if restarted { None } else { last.buckets.get(step) };
        let delta: Vec<(f64, f64)> = now
            .iter()
            .map(|&(le, c)| {
                let was = before.and_then(|b| b.iter().find(|(l, _)| *l == le)).map_or(0.0, |(_, c)| *c);
                (le, if c >= was { c - was } else { c })
            })
            .collect();
        if let (Some(p50), Some(p99)) = (quantile(&delta, 0.50), quantile(&delta, 0.99)) {
            latency_ms.insert(step.clone(), (p50 * 1e3, p99 * 1e3));
            hist.insert(step.clone(), delta);
        }
    }
    let interval = (t - last.t).max(1.0);
    let sample = Sample {
        t,
        pid,
        rss_kib: field("VmRSS:"),
        rss_anon_kib: field("RssAnon:"),
        fds,
        threads,
        mib_per_s: moved / interval / 1048576.0,
        latency_ms,
        hist,
        journal_bytes: m.get("pdstor_journal_bytes").copied().unwrap_or(0.0) as u64,
        publications: labelled(&m, "pdstor_publications{", "state"),
        slots: labelled(&m, "pdstor_slots{", "kind"),
    };
    *last = Counters { t, pid, bytes, buckets };
    Ok(sample)
}

/// The `q` quantile of a histogram's (upper bound, cumulative count) pairs,
/// interpolated linearly within the bucket it falls in (as Prometheus's
/// `histogram_quantile`): buckets that double would otherwise make a
/// quantile jump by 2× on one request.
pub fn quantile(cumulative: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = cumulative.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = cumulative.iter().position(|(_, c)| *c >= rank)?;
    let (le, count) = cumulative[i];
    let (below, below_count) = if i == 0 { (0.0, 0.0) } else { cumulative[i - 1] };
    if !le.is_finite() {
        // Past the last finite bound: say that bound, not infinity.
        return Some(below);
    }
    let inside = count - below_count;
    Some(if inside > 0.0 { below + (le - below) * (rank - below_count) / inside } else { le })
}

fn label(labels: &str, name: &str) -> Option<String> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let end = labels[start..].find('"')?;
    Some(labels[start..start + end].to_owned())
}

fn labelled(m: &BTreeMap<String, f64>, prefix: &str, name: &str) -> BTreeMap<String, u64> {
    m.iter().filter_map(|(k, v)| Some((label(k.strip_prefix(prefix)?, name)?, *v as u64))).collect()
}

/// The exposition as series → value (comments skipped).
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// `GET /metrics` over the daemon's Unix control socket.
pub fn metrics(control: &Path) -> Result<String> {
    let mut s = std::os::unix::net::UnixStream::connect(control)
        .with_context(|| format!("connecting to {}", control.display()))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: pdstor\r\nconnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).with_context(|| format!("reading /metrics from {}", control.display()))?;
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else { bail!("no HTTP answer from {}", control.display()) };
    if !head.starts_with("HTTP/1.1 200") {
        bail!("/metrics answered {}", head.lines().next().unwrap_or_default());
    }
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return Ok(body.to_owned());
    }
    let (mut rest, mut out) = (body, String::new());
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).with_context(|| format!("a chunk size {size:?} in /metrics"))?;
        if n == 0 {
            break;
        }
        out.push_str(after.get(..n).context("/metrics ended inside a chunk")?);
        rest = after.get(n + 2..).unwrap_or_default();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_the_bucket_bounds_they_fall_in() {
        let h = [(0.001, 50.0), (0.002, 98.0), (0.004, 100.0), (f64::INFINITY, 100.0)];
        assert_eq!(quantile(&h, 0.5), Some(0.001), "the 50th of 50 in the first bucket: its bound");
        assert_eq!(quantile(&h, 0.25), Some(0.0005), "halfway into the first bucket");
        let p99 = quantile(&h, 0.99).unwrap();
        assert!((p99 - 0.003).abs() < 1e-12, "the 99th: halfway through the 2 ms to 4 ms bucket, {p99}");
        assert_eq!(quantile(&[(0.001, 0.0), (f64::INFINITY, 0.0)], 0.5), None, "nothing ran");
        let over = [(0.001, 0.0), (f64::INFINITY, 3.0)];
        assert_eq!(quantile(&over, 0.99), Some(0.001), "past the last bound: that bound");
    }

    #[test]
    fn the_exposition_parses_into_series() {
        let m = parse("# HELP x y\npdstor_slots{kind=\"free\"} 12\npdstor_journal_bytes 4096\n");
        assert_eq!(labelled(&m, "pdstor_slots{", "kind").get("free"), Some(&12));
        assert_eq!(m.get("pdstor_journal_bytes"), Some(&4096.0));
    }
}
