//! `pdstor timeline`: check a causal timeline, or draw it.

use std::path::PathBuf;

use clap::Subcommand;
use pdstor::PayloadPath;

use super::common::{PATHS, one_of, print_json};

#[derive(Subcommand)]
pub enum TimelineCmd {
    /// Verify causality, one ack, receipts across nodes, provenance on the required path with
    /// native verdicts, and continuation records. Reports every violation with its line.
    Check {
        /// The JSON-lines timeline (`serve --timeline`, `put/get --timeline`, `qualify`).
        file: PathBuf,
        /// The payload path every store and load must have taken.
        #[arg(long, default_value = "dmabuf_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
        require_path: PayloadPath,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Draw the timeline: a lane per node, transfers as bars by path and verdict, steps as markers.
    Render {
        /// The JSON-lines timeline to draw.
        file: PathBuf,
        /// The SVG file to write.
        #[arg(short, long, default_value = "timeline.svg")]
        output: PathBuf,
    },
}

impl TimelineCmd {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            TimelineCmd::Check { file, require_path, json } => check(&file, require_path, json),
            TimelineCmd::Render { file, output } => render(&file, &output),
        }
    }
}

fn check(file: &std::path::Path, require_path: PayloadPath, json: bool) -> anyhow::Result<()> {
    let lines = pdstor::timeline::read(file)?;
    let report = pdstor::timeline::check::check(&lines, require_path);
    if json {
        print_json(&report)?;
    } else {
        for v in &report.violations {
            println!("{}: {v}", file.display());
        }
        println!(
            "{}: {} lines, {} publications ({} acknowledged), {} payload events, {} continuations: {}",
            file.display(),
            report.lines,
            report.publications,
            report.acked,
            report.payload_events,
            report.continuations,
            if report.ok() {
                format!("ok (every payload on {require_path}, native)")
            } else {
                format!("{} violations", report.violations.len())
            }
        );
    }
    if !report.ok() {
        anyhow::bail!("{} violates the handoff contract ({} violations)", file.display(), report.violations.len());
    }
    Ok(())
}

fn render(file: &std::path::Path, output: &std::path::Path) -> anyhow::Result<()> {
    let lines = pdstor::timeline::read(file)?;
    let bad: Vec<usize> = lines.iter().filter(|(_, e)| e.is_err()).map(|(n, _)| *n).collect();
    if !bad.is_empty() {
        anyhow::bail!("{}: lines {bad:?} are not timeline events (run `pdstor timeline check`)", file.display());
    }
    let events: Vec<_> = lines.into_iter().filter_map(|(_, e)| e.ok()).collect();
    let svg = pdstor::timeline::render::render(&events, &file.display().to_string());
    std::fs::write(output, svg).map_err(|e| anyhow::anyhow!("writing {}: {e}", output.display()))?;
    println!("{}: {} events drawn", output.display(), events.len());
    Ok(())
}
