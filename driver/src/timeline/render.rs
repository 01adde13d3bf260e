//! `pdstor timeline render`: one SVG picture of a timeline. One lane per node;
//! chunk stores and loads as bars (fill by path, outline by verdict);
//! protocol steps as labelled markers; refusals and failures in red.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::Event;

const LANE: f64 = 56.0;
const LEFT: f64 = 150.0;
const WIDTH: f64 = 1400.0;
const TOP: f64 = 60.0;

fn path_colour(path: Option<&str>) -> &'static str {
    match path {
        Some("host") => "#8da0cb",
        Some("host_fixed") => "#66c2a5",
        Some("dmabuf_fixed") => "#fc8d62",
        _ => "#bbbbbb",
    }
}

fn verdict_colour(v: Option<&str>) -> &'static str {
    match v {
        Some("native") => "#1b7837",
        Some(v) if v.starts_with("fallback") => "#d73027",
        _ => "#777777",
    }
}

fn is_failure(e: &Event) -> bool {
    matches!(e.event.as_str(), "refused" | "load_failed" | "fail" | "store_failed" | "error")
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Renders `events` (in file order) as an SVG document.
pub fn render(events: &[Event], title: &str) -> String {
    let mut lanes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for e in events {
        if !lanes.contains_key(e.node.as_str()) {
            lanes.insert(&e.node, order.len());
            order.push(&e.node);
        }
    }
    let start = events.iter().map(|e| e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0))).min().unwrap_or(0);
    let end = events.iter().map(|e| e.ts_ns).max().unwrap_or(start + 1).max(start + 1);
    let span = (end - start) as f64;
    let x = |ts: u64| LEFT + (ts.saturating_sub(start)) as f64 / span * (WIDTH - LEFT - 40.0);
    let height = TOP + LANE * order.len() as f64 + 90.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r##"<text x="10" y="22" font-size="15" font-weight="bold">{}</text><text x="10" y="40" fill="#555">{} events over {:.3} ms</text>"##,
        esc(title),
        events.len(),
        span / 1e6
    );
    for (i, node) in order.iter().enumerate() {
        let y = TOP + LANE * i as f64;
        let _ = writeln!(
            s,
            r##"<rect x="0" y="{y}" width="{WIDTH}" height="{LANE}" fill="{}"/><text x="10" y="{}" font-weight="bold">{}</text><line x1="{LEFT}" y1="{}" x2="{}" y2="{}" stroke="#ccc"/>"##,
            if i % 2 == 0 { "#f7f7f7" } else { "#ffffff" },
            y + LANE / 2.0 + 4.0,
            esc(node),
            y + LANE / 2.0,
            WIDTH - 30.0,
            y + LANE / 2.0
        );
    }
    // Where each lane's last label ended: a label that would overlap it is
    // left to the marker's tooltip (failures are always labelled).
    let mut label_end = vec![f64::MIN; order.len()];
    for e in events {
        let lane = lanes.get(e.node.as_str()).copied().unwrap_or(0);
        let y = TOP + LANE * lane as f64;
        let tip = esc(&format!(
            "{} {} pub {:?} chunk {:?} path {:?} verdict {:?} {}",
            e.node,
            e.event,
            e.publication,
            e.chunk,
            e.path,
            e.verdict,
            e.detail.as_deref().unwrap_or("")
        ));
        if matches!(e.event.as_str(), "store" | "load") {
            let x1 = x(e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0)));
            let w = (x(e.ts_ns) - x1).max(2.0);
            let (y0, h) = if e.event == "store" { (y + 8.0, 16.0) } else { (y + LANE - 24.0, 16.0) };
            let _ = writeln!(
                s,
                r#"<rect x="{x1:.1}" y="{y0}" width="{w:.1}" height="{h}" fill="{}" stroke="{}" stroke-width="1.5"><title>{tip}</title></rect>"#,
                path_colour(e.path.as_deref()),
                verdict_colour(e.verdict.as_deref())
            );
        } else {
            let cx = x(e.ts_ns);
            let cy = y + LANE / 2.0;
            let (fill, r) = if is_failure(e) { ("#d73027", 6.0) } else { ("#2166ac", 4.5) };
            let _ =
                writeln!(s, r#"<circle cx="{cx:.1}" cy="{cy}" r="{r}" fill="{fill}"><title>{tip}</title></circle>"#);
            let half = 2.8 * e.event.len() as f64;
            if cx - half > label_end[lane] || is_failure(e) {
                label_end[lane] = cx + half + 4.0;
                let _ = writeln!(
                    s,
                    r#"<text x="{cx:.1}" y="{}" text-anchor="middle" fill="{fill}" font-size="9">{}</text>"#,
                    cy - 8.0,
                    esc(&e.event)
                );
            }
        }
    }
    legend(&mut s, TOP + LANE * order.len() as f64 + 30.0);
    s.push_str("</svg>\n");
    s
}

/// The colour key and what the marks mean, below the lanes at `ly`.
fn legend(s: &mut String, ly: f64) {
    let legend = [
        ("host", path_colour(Some("host"))),
        ("host_fixed", path_colour(Some("host_fixed"))),
        ("dmabuf_fixed", path_colour(Some("dmabuf_fixed"))),
    ];
    for (i, (name, colour)) in legend.iter().enumerate() {
        let lx = LEFT + 150.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{ly}" width="14" height="10" fill="{colour}"/><text x="{}" y="{}">{name}</text>"#,
            lx + 18.0,
            ly + 9.0
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{}">bars: stores (upper) and loads (lower) by path; outline green = native, red = fallback, grey = unverifiable; red dots: refusals and failures</text>"##,
        ly + 30.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_bars_markers_and_failures_are_drawn() {
        let ev = |node: &str, event: &str, ts: u64| Event {
            node: node.into(),
            event: event.into(),
            ts_ns: ts,
            ..Default::default()
        };
        let mut store = ev("daemon", "store", 2_000);
        store.path = Some("host_fixed".into());
        store.verdict = Some("native".into());
        store.dur_ns = Some(1_000);
        let mut refused = ev("daemon", "refused", 3_000);
        refused.detail = Some("duplicate_ack <&>".into());
        let svg = render(&[ev("daemon", "prepare", 500), store, ev("reader", "adopt", 2_500), refused], "t & t");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(">daemon<") && svg.contains(">reader<"), "one lane per node");
        assert!(svg.contains("fill=\"#66c2a5\" stroke=\"#1b7837\""), "a native host_fixed bar");
        assert!(svg.contains("fill=\"#d73027\""), "the refusal in red");
        assert!(svg.contains("duplicate_ack &lt;&amp;&gt;") && svg.contains("t &amp; t"), "text is escaped");
    }
}
