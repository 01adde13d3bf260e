//! One publication's row of the picture: first where everything goes
//! ([`Layout`]), then each kind of mark in turn, in the order the SVG has
//! always drawn them (frame, breaks, chunks, arrows, markers, labels, flags).

use std::fmt::Write;

use super::{
    Axis, BREAK_W, Event, FAILURE_RED, FALLBACK_RED, HOST_ORANGE, LABEL_H, LEFT, Lines, MARKER_LINE, RIGHT, Row, WIDTH,
    esc, human, is_daemon, is_failure, is_payload, path_colour, text_width, tooltip,
};

/// A failure's label: where it points, where it starts, its line, its text
/// and its tooltip.
type FailLabel = (f64, f64, usize, String, String);

/// Where one row's parts go, decided before anything is drawn.
struct Layout<'r> {
    y: f64,
    label_h: f64,
    marker_y: f64,
    stores_y: f64,
    loads_y: f64,
    fails_y: f64,
    stores_label_y: f64,
    loads_label_y: f64,
    flags_y: f64,
    height: f64,
    /// Step labels above the marker line: x, line, text.
    step_labels: Vec<(f64, usize, String)>,
    /// Failure labels below the stacks.
    fail_labels: Vec<FailLabel>,
    /// Every step's marker: x, event, its line in the file.
    markers: Vec<(f64, &'r Event, usize)>,
}

/// Is `e` a payload whose chunk is flagged: a fallback verdict or the host path?
fn flagged_payload(e: &Event) -> bool {
    is_payload(e)
        && (e.verdict.as_deref().is_some_and(|v| v.starts_with("fallback")) || e.path.as_deref() == Some("host"))
}

fn layout<'r>(axis: &Axis, row: &Row<'r>, y: f64) -> Layout<'r> {
    // Labels of steps (above the marker line) and of failures (below the stacks).
    let mut step_lines = Lines(Vec::new());
    let mut fail_lines = Lines(Vec::new());
    let (mut step_labels, mut fail_labels, mut markers) = (Vec::new(), Vec::new(), Vec::new());
    for &(line, e) in row.events.iter().filter(|(_, e)| !is_payload(e)) {
        let x = axis.x(e.ts_ns);
        if is_failure(e) {
            let label = format!("{}: {}", e.event, e.detail.as_deref().unwrap_or(""));
            let label: String = label.chars().take(90).collect();
            // Kept inside the picture: a label that would run off the right
            // edge ends at it instead.
            let lx = x.min(WIDTH - RIGHT - text_width(&label)).max(LEFT);
            let l = fail_lines.place(lx, text_width(&label));
            fail_labels.push((x, lx, l, label, tooltip(e, line)));
        } else {
            let l = step_lines.place(x - text_width(&e.event) / 2.0, text_width(&e.event));
            step_labels.push((x, l, e.event.clone()));
        }
        markers.push((x, e, line));
    }
    let label_h = LABEL_H * step_lines.0.len().max(1) as f64;
    let marker_y = y + 6.0 + label_h + 6.0;
    let stores_y = marker_y + MARKER_LINE;
    let loads_y = stores_y + row.stack_h().max(12.0) + 6.0;
    let fails_y = loads_y + row.stack_h().max(12.0) + 6.0;
    let stores_label_y = (stores_y + 9.0).max(marker_y + 30.0);
    let loads_label_y = (loads_y + 9.0).max(stores_label_y + 12.0);
    // Fallback and host chunks, flagged in the margin (at most 4 lines).
    let flag_count = row.events.iter().filter(|(_, e)| flagged_payload(e)).count().min(4);
    let flags_y = loads_label_y + 14.0;
    let height = ((fails_y - y) + LABEL_H * fail_lines.0.len() as f64 + 10.0)
        .max(loads_label_y - y + 8.0)
        .max(flags_y + 11.0 * flag_count as f64 - y + 4.0);
    Layout {
        y,
        label_h,
        marker_y,
        stores_y,
        loads_y,
        fails_y,
        stores_label_y,
        loads_label_y,
        flags_y,
        height,
        step_labels,
        fail_labels,
        markers,
    }
}

/// The row's background, its name and span, and the stacks' titles.
fn draw_frame(s: &mut String, row: &Row, l: &Layout, n: usize, t0: u64) {
    let (y, marker_y) = (l.y, l.marker_y);
    let _ = writeln!(
        s,
        r##"<rect x="0" y="{y:.1}" width="{WIDTH}" height="{:.1}" fill="{}"/><text x="8" y="{:.1}" font-weight="bold">{}</text><line x1="{LEFT}" y1="{marker_y:.1}" x2="{}" y2="{marker_y:.1}" stroke="#ccc"/>"##,
        l.height,
        if n.is_multiple_of(2) { "#fafafa" } else { "#ffffff" },
        marker_y + 4.0,
        esc(&row.label),
        WIDTH - RIGHT
    );
    let first = row.events.iter().map(|(_, e)| e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0))).min().unwrap_or(t0);
    let last = row.events.iter().map(|(_, e)| e.ts_ns).max().unwrap_or(first);
    let _ = writeln!(
        s,
        r##"<text x="8" y="{:.1}" fill="#555" font-size="10">from +{} for {}</text>"##,
        marker_y + 16.0,
        human(first.saturating_sub(t0)),
        human(last - first)
    );
}

/// The compressed quiet stretches, each with its real length.
fn draw_breaks(s: &mut String, axis: &Axis, l: &Layout) {
    let mut break_labels = Lines(Vec::new());
    for &(px, gap) in &axis.breaks {
        let x = LEFT + px;
        let text = format!("≈{}", human(gap));
        // One line of break labels; one that would overlap its neighbour is
        // left to the tooltip.
        let label = if break_labels.place(x + BREAK_W / 2.0 - text_width(&text) * 0.4, text_width(&text) * 0.8) == 0 {
            format!(
                r##"<text x="{:.1}" y="{:.1}" font-size="9" fill="#666" text-anchor="middle">{}</text>"##,
                x + BREAK_W / 2.0,
                l.marker_y + 18.0,
                esc(&text)
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            r##"<g><rect x="{x:.1}" y="{:.1}" width="{BREAK_W}" height="{:.1}" fill="#eeeeee"/><path d="M{:.1},{:.1} l5,-5 l5,10 l5,-10 l5,10 l5,-5" stroke="#888" fill="none"/>{label}<title>{} with nothing recorded, drawn {BREAK_W} px wide</title></g>"##,
            l.marker_y - 8.0,
            l.height - (l.marker_y - 8.0 - l.y),
            x + 1.5,
            l.marker_y,
            human(gap)
        );
    }
}

/// The chunks' stores and loads, stacked by index; answers the flags for
/// the margin (colour, text).
fn draw_chunks(
    marks: &mut String,
    axis: &Axis,
    row: &Row,
    l: &Layout,
    flagged: &mut usize,
) -> Vec<(&'static str, String)> {
    let ch = row.chunk_h();
    let mut flags = Vec::new();
    for &(line, e) in row.events.iter().filter(|(_, e)| is_payload(e)) {
        let chunk = e.chunk.unwrap_or(0) as f64;
        let base = if e.event == "store" { l.stores_y } else { l.loads_y };
        let top = base + chunk * ch;
        let x1 = axis.x(e.ts_ns.saturating_sub(e.dur_ns.unwrap_or(0)));
        let w = (axis.x(e.ts_ns) - x1).max(3.0);
        let verdict = e.verdict.as_deref().unwrap_or("");
        let fallback = verdict.starts_with("fallback");
        let unverified = !fallback && verdict != "native";
        let host = e.path.as_deref() == Some("host");
        let (fill, stroke, sw) = if fallback {
            (FALLBACK_RED, "#000000", 1.5)
        } else if unverified {
            ("url(#hatch)", "#666666", 0.5)
        } else {
            (path_colour(e.path.as_deref()), "#1b1b1b", 0.3)
        };
        let _ = writeln!(
            marks,
            r#"<rect x="{x1:.1}" y="{top:.1}" width="{w:.1}" height="{:.1}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"><title>{}</title></rect>"#,
            (ch - 0.6).max(2.0),
            tooltip(e, line)
        );
        if fallback || host {
            // A triangle above the bar and a flag in the margin: visible at
            // any bar width.
            let colour = if fallback { FALLBACK_RED } else { HOST_ORANGE };
            let _ = writeln!(
                marks,
                r#"<path d="M{:.1},{:.1} l5,-9 l-10,0 z" fill="{colour}" stroke="{colour}"><title>{}</title></path>"#,
                x1 + w / 2.0 + 5.0,
                base - 1.0,
                tooltip(e, line)
            );
            let what = if fallback { verdict } else { "host (a copy)" };
            flags.push((colour, format!("chunk {} {}: {what}", e.chunk.unwrap_or(0), e.event)));
            *flagged += 1;
        }
    }
    flags
}

/// Causal arrows between the daemon's steps, arcing above the marker line.
fn draw_arrows(marks: &mut String, axis: &Axis, row: &Row, l: &Layout) {
    let chain: Vec<f64> = row
        .events
        .iter()
        .filter(|(_, e)| is_daemon(&e.node) && matches!(e.event.as_str(), "publish" | "claim" | "adopt" | "ack"))
        .map(|(_, e)| axis.x(e.ts_ns))
        .collect();
    let m = l.marker_y;
    for w in chain.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b - a < 6.0 {
            continue;
        }
        let lift = ((b - a) / 4.0).clamp(6.0, l.label_h + 4.0);
        let _ = writeln!(
            marks,
            r##"<path d="M{:.1},{:.1} Q{:.1},{:.1} {:.1},{:.1}" stroke="#444" fill="none" stroke-width="1" marker-end="url(#arrow)"/>"##,
            a + 3.0,
            m - 3.0,
            (a + b) / 2.0,
            m - 3.0 - lift,
            b - 4.0,
            m - 3.0
        );
    }
}

/// Each step's marker, shaped by its node: daemon circle, reader diamond,
/// writer square; failures red.
fn draw_markers(marks: &mut String, l: &Layout) {
    let marker_y = l.marker_y;
    for (x, e, line) in &l.markers {
        let fill = if is_failure(e) {
            FAILURE_RED
        } else if is_daemon(&e.node) {
            "#2166ac"
        } else {
            "#7b3294"
        };
        let (shape, close) = if is_daemon(&e.node) {
            (format!(r#"<circle cx="{x:.1}" cy="{marker_y:.1}" r="4.5" fill="{fill}">"#), "</circle>")
        } else if e.node.starts_with("reader") {
            (format!(r#"<path d="M{x:.1},{:.1} l5,5 l-5,5 l-5,-5 z" fill="{fill}">"#, marker_y - 5.0), "</path>")
        } else {
            (
                format!(r#"<rect x="{:.1}" y="{:.1}" width="8" height="8" fill="{fill}">"#, x - 4.0, marker_y - 4.0),
                "</rect>",
            )
        };
        let _ = writeln!(marks, "{shape}<title>{}</title>{close}", tooltip(e, *line));
    }
}

/// The steps' and failures' labels, and the margin's flags.
fn draw_labels(marks: &mut String, l: Layout, flags: &[(&str, String)]) {
    for (x, line, label) in l.step_labels {
        let _ = writeln!(
            marks,
            r##"<text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="#333" font-size="10">{}</text>"##,
            l.y + 6.0 + LABEL_H * (line as f64 + 1.0) - 2.0,
            esc(&label)
        );
    }
    let marker_y = l.marker_y;
    for (x, lx, line, label, tip) in l.fail_labels {
        let _ = writeln!(
            marks,
            r##"<text x="{lx:.1}" y="{:.1}" fill="{FAILURE_RED}" font-size="10">{}<title>{tip}</title></text><line x1="{x:.1}" y1="{marker_y:.1}" x2="{x:.1}" y2="{:.1}" stroke="{FAILURE_RED}" stroke-dasharray="2,2"/>"##,
            l.fails_y + LABEL_H * (line as f64 + 1.0) - 2.0,
            esc(&label),
            l.fails_y + LABEL_H * line as f64
        );
    }
    for (i, (colour, text)) in flags.iter().enumerate().take(4) {
        let _ = writeln!(
            marks,
            r#"<text x="8" y="{:.1}" fill="{colour}" font-size="10" font-weight="bold">⚠ {}</text>"#,
            l.flags_y + 11.0 * i as f64,
            esc(text)
        );
    }
}

/// Draws one row at `y`; returns its height.
pub(super) fn draw_row(s: &mut String, axis: &Axis, row: &Row, y: f64, n: usize, t0: u64, flagged: &mut usize) -> f64 {
    let l = layout(axis, row, y);
    draw_frame(s, row, &l, n, t0);
    draw_breaks(s, axis, &l);
    if row.chunks > 0 {
        let _ = writeln!(
            s,
            r##"<text x="8" y="{:.1}" fill="#555" font-size="10">stores ({} chunks)</text><text x="8" y="{:.1}" fill="#555" font-size="10">loads</text>"##,
            l.stores_label_y, row.chunks, l.loads_label_y
        );
    }
    let mut marks = String::new();
    let flags = draw_chunks(&mut marks, axis, row, &l, flagged);
    draw_arrows(&mut marks, axis, row, &l);
    draw_markers(&mut marks, &l);
    let height = l.height;
    draw_labels(&mut marks, l, &flags);
    s.push_str(&marks);
    height
}
