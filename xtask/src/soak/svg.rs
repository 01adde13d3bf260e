//! The soak's picture: one panel per figure over time — throughput, step
//! latency (p50 and p99 of the slowest steps), the daemon's memory,
//! descriptors and threads, the journal's fill, publications by state — with
//! every fault marked where it fell.

use std::fmt::Write as _;

use super::sample::Sample;

/// A fault, for its marker: when (s) and what.
pub struct Mark<'a> {
    pub t: f64,
    pub what: &'a str,
}

const WIDTH: f64 = 960.0;
const PANEL: f64 = 150.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const COLOURS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];

/// One line of a panel: its name and (t, value) points.
type Line = (String, Vec<(f64, f64)>);

/// The picture of `samples` with `marks`, titled `title`.
pub fn render(title: &str, samples: &[Sample], marks: &[Mark<'_>]) -> String {
    let panels = panels(samples);
    // Room below the panels for the faults' labels, slanted.
    let height = 40.0 + PANEL * panels.len() as f64 + 130.0;
    let end = samples.last().map_or(1.0, |s| s.t).max(1.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{LEFT}\" y=\"22\" font-size=\"14\">{}</text>\n",
        escape(title)
    );
    for (i, (name, unit, lines)) in panels.iter().enumerate() {
        let top = 40.0 + PANEL * i as f64;
        panel(&mut svg, top, end, name, unit, lines);
    }
    let bottom = 40.0 + PANEL * panels.len() as f64;
    for m in marks {
        let x = LEFT + (m.t / end) * (WIDTH - LEFT - RIGHT);
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.1}\" y1=\"40\" x2=\"{x:.1}\" y2=\"{bottom}\" stroke=\"#999\" stroke-dasharray=\"3,3\"/><text x=\"{x:.1}\" y=\"{:.1}\" transform=\"rotate(45 {x:.1} {:.1})\" fill=\"#555\">{}</text>",
            bottom + 10.0,
            bottom + 10.0,
            escape(m.what)
        );
    }
    let _ = writeln!(svg, "<text x=\"{:.1}\" y=\"{:.1}\">minutes</text>", WIDTH - RIGHT, bottom + 4.0);
    svg.push_str("</svg>\n");
    svg
}

fn panels(samples: &[Sample]) -> Vec<(&'static str, &'static str, Vec<Line>)> {
    let series = |f: &dyn Fn(&Sample) -> Option<f64>| -> Vec<(f64, f64)> {
        samples.iter().filter_map(|s| f(s).map(|v| (s.t, v))).collect()
    };
    // The three steps with the highest p99 anywhere, each p50 and p99.
    let mut worst: Vec<(String, f64)> = Vec::new();
    for s in samples {
        for (step, (_, p99)) in &s.latency_ms {
            match worst.iter_mut().find(|(n, _)| n == step) {
                Some(w) => w.1 = w.1.max(*p99),
                None => worst.push((step.clone(), *p99)),
            }
        }
    }
    worst.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut latency = Vec::new();
    for (step, _) in worst.iter().take(3) {
        latency.push((format!("{step} p99"), series(&|s| s.latency_ms.get(step).map(|l| l.1))));
        latency.push((format!("{step} p50"), series(&|s| s.latency_ms.get(step).map(|l| l.0))));
    }
    let states: std::collections::BTreeSet<&String> = samples.iter().flat_map(|s| s.publications.keys()).collect();
    let by_state = states
        .into_iter()
        .map(|st| (st.clone(), series(&|s| Some(s.publications.get(st).copied().unwrap_or(0) as f64))))
        .collect();
    vec![
        ("throughput", "MiB/s", vec![("payload".into(), series(&|s| Some(s.mib_per_s)))]),
        ("step latency", "ms", latency),
        (
            "daemon memory",
            "MiB",
            vec![
                ("resident".into(), series(&|s| Some(s.rss_kib as f64 / 1024.0))),
                ("anonymous".into(), series(&|s| Some(s.rss_anon_kib as f64 / 1024.0))),
            ],
        ),
        (
            "descriptors and threads",
            "",
            vec![
                ("fds".into(), series(&|s| Some(s.fds as f64))),
                ("threads".into(), series(&|s| Some(s.threads as f64))),
            ],
        ),
        ("journal", "KiB", vec![("in use".into(), series(&|s| Some(s.journal_bytes as f64 / 1024.0)))]),
        ("publications by state", "", by_state),
        (
            "slots",
            "",
            ["used", "reserved", "free"]
                .iter()
                .map(|k| ((*k).to_owned(), series(&|s| Some(s.slots.get(*k).copied().unwrap_or(0) as f64))))
                .collect(),
        ),
    ]
}

fn panel(svg: &mut String, top: f64, end: f64, name: &str, unit: &str, lines: &[Line]) {
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, PANEL - 40.0);
    let max = lines.iter().flat_map(|(_, p)| p.iter().map(|(_, v)| *v)).fold(0.0_f64, f64::max).max(1e-9);
    let y0 = top + 20.0;
    let _ = writeln!(
        svg,
        "<text x=\"{LEFT}\" y=\"{:.1}\" font-weight=\"bold\">{} {}</text><rect x=\"{LEFT}\" y=\"{y0:.1}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#ccc\"/>",
        top + 14.0,
        escape(name),
        if unit.is_empty() { String::new() } else { format!("({unit})") }
    );
    let _ =
        writeln!(svg, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>", LEFT - 4.0, y0 + 8.0, round(max));
    let _ = writeln!(svg, "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">0</text>", LEFT - 4.0, y0 + plot_h);
    // A label a minute up to 20 minutes, every 5 beyond: they stay apart.
    let every = if end > 1200.0 { 5 } else { 1 };
    for minute in (0..=((end / 60.0) as u64)).step_by(every) {
        let x = LEFT + (minute as f64 * 60.0 / end) * plot_w;
        let _ = writeln!(
            svg,
            "<text x=\"{x:.1}\" y=\"{:.1}\" fill=\"#777\" font-size=\"9\">{minute}</text>",
            y0 + plot_h + 10.0
        );
    }
    for (i, (label, points)) in lines.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|(t, v)| format!("{:.1},{:.1}", LEFT + (t / end) * plot_w, y0 + plot_h - (v / max) * plot_h))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.3\" points=\"{}\"/>",
            path.join(" ")
        );
        let ly = y0 + 10.0 + 13.0 * i as f64;
        let _ = writeln!(
            svg,
            "<text x=\"{:.1}\" y=\"{ly:.1}\" fill=\"{colour}\">{}</text>",
            LEFT + plot_w + 8.0,
            escape(label)
        );
    }
}

fn round(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_panel_and_mark_is_drawn() {
        let samples: Vec<Sample> = (0..6)
            .map(|i| Sample {
                t: i as f64 * 10.0,
                rss_kib: 1000 + i,
                fds: 20,
                threads: 9,
                mib_per_s: 100.0,
                latency_ms: [("claim".to_owned(), (0.2, 1.5))].into_iter().collect(),
                ..Default::default()
            })
            .collect();
        let svg = render("soak <file>", &samples, &[Mark { t: 25.0, what: "daemon kill -9" }]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 1 + 2 + 2 + 2 + 1 + 3, "{svg}");
        assert!(svg.contains("daemon kill -9") && svg.contains("soak &lt;file&gt;"));
    }
}
