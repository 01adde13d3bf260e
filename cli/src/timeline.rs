//! `pdstor timeline`: check a causal timeline, or draw it.

use std::path::PathBuf;

use clap::Subcommand;
use pdstor_engine::io::PayloadPath;

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
    /// Test the checker on this timeline: tell it every kind of causal lie about one complete
    /// handoff (a deleted publish, swapped times, an ack from a stranger, …) and require each
    /// mutant caught at its line by the rule it breaks. Exits 1 if the timeline itself fails,
    /// if it has no complete handoff to mutate, or if any mutant survives.
    Mutate {
        /// The JSON-lines timeline to mutate (a clean one: `pdstor qualify --short` writes one).
        file: PathBuf,
        /// The payload path the timeline's stores and loads took.
        #[arg(long, default_value = "dmabuf_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
        require_path: PayloadPath,
        /// Write each mutant here as `<name>.jsonl`, beside `mutants.json`.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// One timeline from several hosts' (the owner's daemon, a reader host that read the shared
    /// namespace itself): ordered by the protocol's messages, never by clocks that hosts do not
    /// share; refused if no order can hold them all. Then `pdstor timeline check` the result.
    Merge {
        /// The JSON-lines timelines, one per host.
        #[arg(required = true, num_args = 1..)]
        files: Vec<PathBuf>,
        /// Write the merged timeline here (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Draw the timeline: a row per publication on its own compressed time axis, its steps with
    /// causal arrows, its chunks' stores and loads stacked by chunk (fill by path, red for a
    /// fallback verdict), failures labelled; tooltips on every mark.
    Render {
        /// The JSON-lines timeline to draw.
        file: PathBuf,
        /// The SVG file to write.
        #[arg(short, long, default_value = "timeline.svg")]
        output: PathBuf,
        /// The picture's title (default: the timeline's path).
        #[arg(long)]
        title: Option<String>,
    },
}

impl TimelineCmd {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            TimelineCmd::Check { file, require_path, json } => check(&file, require_path, json),
            TimelineCmd::Mutate { file, require_path, out, json } => mutate(&file, require_path, out.as_deref(), json),
            TimelineCmd::Render { file, output, title } => render(&file, &output, title),
            TimelineCmd::Merge { files, output } => merge(&files, output.as_deref()),
        }
    }
}

fn check(file: &std::path::Path, require_path: PayloadPath, json: bool) -> anyhow::Result<()> {
    let lines = pdstor_client::timeline::read(file)?;
    let report = pdstor_proof::timeline::check::check(&lines, require_path);
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

fn merge(files: &[PathBuf], output: Option<&std::path::Path>) -> anyhow::Result<()> {
    let mut inputs = Vec::with_capacity(files.len());
    for f in files {
        inputs.push((f.display().to_string(), pdstor_client::timeline::read(f)?));
    }
    let merged = pdstor_proof::timeline::merge::merge(&inputs)?;
    let mut text = String::new();
    for e in &merged {
        text.push_str(&serde_json::to_string(e)?);
        text.push('\n');
    }
    match output {
        Some(out) => {
            pdstor_client::private::write(out, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", out.display()))?;
            eprintln!("{}: {} lines from {} timelines", out.display(), merged.len(), files.len());
        }
        None => print!("{text}"),
    }
    Ok(())
}

fn render(file: &std::path::Path, output: &std::path::Path, title: Option<String>) -> anyhow::Result<()> {
    let lines = pdstor_client::timeline::read(file)?;
    let bad: Vec<usize> = lines.iter().filter(|(_, e)| e.is_err()).map(|(n, _)| *n).collect();
    if !bad.is_empty() {
        anyhow::bail!("{}: lines {bad:?} are not timeline events (run `pdstor timeline check`)", file.display());
    }
    let events: Vec<_> = lines.into_iter().filter_map(|(_, e)| e.ok()).collect();
    let title = title.unwrap_or_else(|| file.display().to_string());
    let svg = pdstor_proof::timeline::render::render(&events, &title);
    std::fs::write(output, svg).map_err(|e| anyhow::anyhow!("writing {}: {e}", output.display()))?;
    println!("{}: {} events drawn", output.display(), events.len());
    Ok(())
}

/// One mutant's fate.
#[derive(serde::Serialize)]
struct Fate {
    #[serde(flatten)]
    mutant: pdstor_proof::timeline::mutate::Mutant,
    /// The violation that caught it, if any.
    caught: Option<pdstor_proof::timeline::check::Violation>,
}

fn mutate(
    file: &std::path::Path,
    require_path: PayloadPath,
    out: Option<&std::path::Path>,
    json: bool,
) -> anyhow::Result<()> {
    use pdstor_proof::timeline::{check, mutate};
    let lines = pdstor_client::timeline::read(file)?;
    let clean = check::check(&lines, require_path);
    if !clean.ok() {
        anyhow::bail!(
            "{} itself violates the contract ({} violations; run `pdstor timeline check`): mutate a clean timeline",
            file.display(),
            clean.violations.len()
        );
    }
    let events: Vec<_> = lines.into_iter().filter_map(|(_, e)| e.ok()).collect();
    let mutants = mutate::mutants(&events);
    if mutants.is_empty() {
        anyhow::bail!(
            "{}: no publication with a complete handoff (prepare, two or more stores, publish, claim, adopt, loads, ack) to mutate",
            file.display()
        );
    }
    if let Some(dir) = out {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    }
    let mut fates = Vec::with_capacity(mutants.len());
    for m in mutants {
        let numbered: Vec<_> = m.events.iter().cloned().enumerate().map(|(i, e)| (i + 1, Ok(e))).collect();
        let report = check::check(&numbered, require_path);
        let caught = m.caught_by(&report).cloned();
        if let Some(dir) = out {
            let mut text = String::new();
            for e in &m.events {
                text.push_str(&serde_json::to_string(e)?);
                text.push('\n');
            }
            let path = dir.join(format!("{}.jsonl", m.name));
            pdstor_client::private::write(&path, text)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        }
        fates.push(Fate { mutant: m, caught });
    }
    let survived = fates.iter().filter(|f| f.caught.is_none()).count();
    if let Some(dir) = out {
        let path = dir.join("mutants.json");
        pdstor_client::private::write(&path, serde_json::to_vec_pretty(&fates)?)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    if json {
        print_json(&fates)?;
    } else {
        for f in &fates {
            let m = &f.mutant;
            match &f.caught {
                Some(v) => println!("caught   {:<34} line {:>4}  {}: {}", m.name, v.line, v.kind, v.message),
                None => println!("SURVIVED {:<34} expected {} at lines {:?}: {}", m.name, m.expect, m.line, m.what),
            }
        }
        println!(
            "{}: mutation score {}/{} ({} survived)",
            file.display(),
            fates.len() - survived,
            fates.len(),
            survived
        );
    }
    if survived > 0 {
        anyhow::bail!("{survived} of {} mutants of {} were not caught", fates.len(), file.display());
    }
    Ok(())
}
