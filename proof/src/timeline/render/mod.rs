//! `pdstor timeline render`: one SVG picture of a timeline that a person can
//! read at its default size.
//!
//! - One row per publication (events about none share a last row). In a row:
//!   the protocol steps as markers on one line (shape by node: daemon circle,
//!   writer square, reader diamond), the causal arrows between the daemon's
//!   steps (publish → claim → adopt → ack), then the chunks' stores and loads
//!   stacked one chunk per line, so the chunks of one batch never cover each
//!   other.
//! - The time axis is compressed: a quiet stretch longer than a few typical
//!   gaps (oracle compute, a lease wait) is drawn a fixed width and marked
//!   with its real length, so a handoff is not two pixels wide next to it.
//! - A chunk's fill is its path (`host` orange, `host_fixed` blue,
//!   `dmabuf_fixed` green); a `fallback` verdict fills it red with a thick
//!   outline, an unverifiable one is hatched grey. Every fallback or `host`
//!   chunk is also flagged in the row's margin and by a triangle above its
//!   bar, so it stands out even when the bar is thin.
//! - Refusals and failures are labelled in red on lines of their own, placed
//!   so no two labels overlap; every mark has a plain tooltip.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::Event;
use super::check::is_daemon;

mod row;
use row::draw_row;

const WIDTH: f64 = 1600.0;
const LEFT: f64 = 210.0;
const RIGHT: f64 = 30.0;
/// Height of the title, summary and legend above the rows.
pub const HEADER: f64 = 120.0;
const LABEL_H: f64 = 12.0;
const MARKER_LINE: f64 = 26.0;
/// The width a compressed quiet stretch gets.
const BREAK_W: f64 = 28.0;

/// Colours; the screenshot test looks for the first two.
pub const FALLBACK_RED: &str = "#d62728";
/// `host`: the path with a copy, which must stand out.
pub const HOST_ORANGE: &str = "#f58518";
const HOST_FIXED_BLUE: &str = "#4c78a8";
const DMABUF_GREEN: &str = "#54a24b";
const FAILURE_RED: &str = "#b2182b";

fn path_colour(path: Option<&str>) -> &'static str {
    match path {
        Some("host") => HOST_ORANGE,
        Some("host_fixed") => HOST_FIXED_BLUE,
        Some("dmabuf_fixed") => DMABUF_GREEN,
        _ => "#bbbbbb",
    }
}

fn is_failure(e: &Event) -> bool {
    matches!(e.event.as_str(), "refused" | "load_failed" | "fail" | "store_failed" | "error" | "cancelled" | "orphaned")
}

fn is_payload(e: &Event) -> bool {
    matches!(e.event.as_str(), "store" | "load")
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Plain `key: value` lines for a tooltip: no `Some(…)`, nothing absent.
fn tooltip(e: &Event, line: usize) -> String {
    let mut t = format!("{} by {} (line {line}, seq {})", e.event, e.node, e.seq);
    let mut kv = |k: &str, v: String| {
        let _ = write!(t, "\n{k}: {v}");
    };
    if let Some(p) = e.publication {
        kv("publication", p.to_string());
    }
    if let Some(r) = &e.req_id {
        kv("request", r.clone());
    }
    if let Some(c) = e.chunk {
        kv("chunk", c.to_string());
    }
    if let Some(p) = &e.path {
        kv("path", p.clone());
    }
    if let Some(v) = &e.verdict {
        kv("verdict", v.clone());
    }
    if let Some(b) = e.bytes {
        kv("bytes", b.to_string());
    }
    if let Some(d) = e.dur_ns {
        kv("took", format!("{:.3} ms", d as f64 / 1e6));
    }
    if let Some(c) = e.crc32c {
        kv("crc32c", format!("{c:#010x}"));
    }
    if let Some(n) = e.chunks {
        kv("chunks", n.to_string());
    }
    if let Some(t) = e.token {
        kv("token", t.to_string());
    }
    if let (Some(r), Some(s)) = (&e.reader, &e.session) {
        kv("reader", format!("{r} (session {s})"));
    }
    if let Some(d) = &e.detail {
        kv("detail", d.clone());
    }
    if let Some(b) = &e.by {
        kv("by", b.clone());
    }
    esc(&t)
}

/// The compressed time axis: real time within busy stretches, a fixed
/// width for each quiet one.
struct Axis {
    /// (real start, compressed start) of each piece, and whether the piece
    /// before it was a break.
    pieces: Vec<(u64, f64)>,
    breaks: Vec<(f64, u64)>,
    cap: u64,
    scale: f64,
    start: u64,
}

impl Axis {
    fn new<'a>(events: impl IntoIterator<Item = &'a Event>) -> Axis {
        let mut times: Vec<u64> =
            events.into_iter().flat_map(|e| [e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0)), e.ts_ns]).collect();
        times.sort_unstable();
        times.dedup();
        let start = times.first().copied().unwrap_or(0);
        let mut gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort_unstable();
        // A quiet stretch: longer than 8 typical gaps (and than 100 µs).
        let typical = gaps.get(gaps.len() * 3 / 4).copied().unwrap_or(1);
        let cap = (typical * 8).max(100_000);
        let quiet = gaps.iter().filter(|&&g| g > cap).count();
        let busy: u64 = gaps.iter().filter(|&&g| g <= cap).sum();
        let room = WIDTH - LEFT - RIGHT - BREAK_W * quiet as f64;
        let scale = if busy > 0 { room / busy as f64 } else { 1.0 };
        let mut pieces = vec![(start, 0.0)];
        let mut breaks = Vec::new();
        let mut px = 0.0;
        for w in times.windows(2) {
            let gap = w[1] - w[0];
            if gap > cap {
                breaks.push((px, gap));
                px += BREAK_W;
            } else {
                px += gap as f64 * scale;
            }
            pieces.push((w[1], px));
        }
        Axis { pieces, breaks, cap, scale, start }
    }

    /// x of a real time.
    fn x(&self, t: u64) -> f64 {
        let i = self.pieces.partition_point(|&(pt, _)| pt <= t).saturating_sub(1);
        let (pt, px) = self.pieces.get(i).copied().unwrap_or((self.start, 0.0));
        let within = (t.saturating_sub(pt)).min(self.cap) as f64 * self.scale;
        let next = self.pieces.get(i + 1).map_or(f64::MAX, |p| p.1);
        LEFT + (px + within).min(next)
    }
}

/// A publication's row: its events, and what it needs drawn.
struct Row<'a> {
    label: String,
    events: Vec<(usize, &'a Event)>,
    chunks: u32,
}

impl Row<'_> {
    fn chunk_h(&self) -> f64 {
        (96.0 / self.chunks.max(1) as f64).clamp(3.0, 10.0)
    }
    fn stack_h(&self) -> f64 {
        self.chunk_h() * self.chunks as f64
    }
}

/// Greedy label placement: each label goes on the first line where it does
/// not overlap the last label there.
struct Lines(Vec<f64>);

impl Lines {
    fn place(&mut self, x: f64, width: f64) -> usize {
        for (i, end) in self.0.iter_mut().enumerate() {
            if x > *end + 4.0 {
                *end = x + width;
                return i;
            }
        }
        self.0.push(x + width);
        self.0.len() - 1
    }
}

fn text_width(s: &str) -> f64 {
    6.0 * s.chars().count() as f64
}

/// Renders `events` (in file order) as an SVG document.
pub fn render(events: &[Event], title: &str) -> String {
    let mut rows: BTreeMap<u64, Row> = BTreeMap::new();
    let mut other = Row { label: "no publication".into(), events: Vec::new(), chunks: 0 };
    let mut order: Vec<u64> = Vec::new();
    let mut nodes: Vec<&str> = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if !nodes.contains(&e.node.as_str()) {
            nodes.push(&e.node);
        }
        let Some(p) = e.publication else {
            other.events.push((i + 1, e));
            continue;
        };
        let row = rows.entry(p).or_insert_with(|| {
            order.push(p);
            Row { label: format!("publication {p}"), events: Vec::new(), chunks: 0 }
        });
        if row.label == format!("publication {p}")
            && let Some(r) = &e.req_id
        {
            row.label = format!("publication {p} ({r})");
        }
        if let Some(c) = e.chunk.filter(|_| is_payload(e)) {
            row.chunks = row.chunks.max(c + 1);
        }
        if let Some(n) = e.chunks {
            row.chunks = row.chunks.max(n);
        }
        row.events.push((i + 1, e));
    }
    let mut all: Vec<Row> = order.into_iter().filter_map(|p| rows.remove(&p)).collect();
    if !other.events.is_empty() {
        all.push(other);
    }

    let mut body = String::new();
    let mut y = HEADER;
    let mut flagged = 0usize;
    let mut quiet = 0usize;
    let start = events.iter().map(|e| e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0))).min().unwrap_or(0);
    for (n, row) in all.iter().enumerate() {
        let axis = Axis::new(row.events.iter().map(|(_, e)| *e));
        quiet += axis.breaks.len();
        let h = draw_row(&mut body, &axis, row, y, n, start, &mut flagged);
        y += h;
    }
    let height = y + 30.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r##"<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#444"/></marker><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#dddddd"/><line x1="0" y1="0" x2="0" y2="6" stroke="#888" stroke-width="2"/></pattern></defs>"##
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let span = events.iter().map(|e| e.ts_ns).max().unwrap_or(start).saturating_sub(start);
    let _ = writeln!(
        s,
        r##"<text x="10" y="20" font-size="15" font-weight="bold">{}</text><text x="10" y="38" fill="#555">{} events, {} rows, {} in all; each row on its own time axis, {quiet} quiet stretches compressed (each drawn {BREAK_W} px, its length written on it); {flagged} chunks flagged</text>"##,
        esc(title),
        events.len(),
        all.len(),
        human(span),
    );
    legend(&mut s, &nodes);
    s.push_str(&body);
    s.push_str("</svg>\n");
    s
}

fn human(ns: u64) -> String {
    match ns {
        n if n >= 1_000_000_000 => format!("{:.2} s", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} ms", n as f64 / 1e6),
        n => format!("{:.0} µs", n as f64 / 1e3),
    }
}

/// Draws a legend swatch at (x, y).
type Swatch = fn(f64, f64) -> String;

/// The key: paths, verdicts, markers, arrows, breaks, and the nodes.
fn legend(s: &mut String, nodes: &[&str]) {
    let y = 52.0;
    let swatches: [(&str, Swatch); 10] = [
        ("host (copy)", |x, y| format!(r#"<rect x="{x:.1}" y="{y}" width="14" height="10" fill="{HOST_ORANGE}"/>"#)),
        ("host_fixed", |x, y| format!(r#"<rect x="{x:.1}" y="{y}" width="14" height="10" fill="{HOST_FIXED_BLUE}"/>"#)),
        ("dmabuf_fixed", |x, y| format!(r#"<rect x="{x:.1}" y="{y}" width="14" height="10" fill="{DMABUF_GREEN}"/>"#)),
        ("fallback verdict", |x, y| {
            format!(
                r#"<rect x="{x:.1}" y="{y}" width="14" height="10" fill="{FALLBACK_RED}" stroke="black" stroke-width="1.5"/>"#
            )
        }),
        ("unverifiable", |x, y| format!(r#"<rect x="{x:.1}" y="{y}" width="14" height="10" fill="url(#hatch)"/>"#)),
        ("daemon step", |x, y| format!(r##"<circle cx="{:.1}" cy="{}" r="4.5" fill="#2166ac"/>"##, x + 7.0, y + 5.0)),
        ("writer", |x, y| {
            format!(r##"<rect x="{:.1}" y="{}" width="8" height="8" fill="#7b3294"/>"##, x + 3.0, y + 1.0)
        }),
        ("reader", |x, y| format!(r##"<path d="M{:.1},{y} l5,5 l-5,5 l-5,-5 z" fill="#7b3294"/>"##, x + 7.0)),
        ("refusal / failure", |x, y| {
            format!(r#"<circle cx="{:.1}" cy="{}" r="4.5" fill="{FAILURE_RED}"/>"#, x + 7.0, y + 5.0)
        }),
        ("publish → claim → adopt → ack", |x, y| {
            format!(r##"<path d="M{x:.1},{} l14,0" stroke="#444" marker-end="url(#arrow)"/>"##, y + 5.0)
        }),
    ];
    let mut x = 10.0;
    for (text, swatch) in swatches {
        let _ = writeln!(s, r#"{}<text x="{:.1}" y="{:.1}">{}</text>"#, swatch(x, y), x + 18.0, y + 9.0, esc(text));
        x += 28.0 + text_width(text);
    }
    let _ = writeln!(
        s,
        r##"<text x="10" y="{:.0}" fill="#555">Rows: one per publication; in each, steps on the line, then the chunks' stores and loads, one chunk per line. Hover for values. Nodes:</text>"##,
        y + 32.0
    );
    let mut nx = 10.0;
    for node in nodes {
        let _ =
            writeln!(s, r##"<text x="{nx:.1}" y="{:.0}" fill="#333" font-size="10">{}</text>"##, y + 48.0, esc(node));
        nx += text_width(node) + 14.0;
        if nx > WIDTH - 100.0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests;
