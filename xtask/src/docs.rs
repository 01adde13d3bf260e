//! `cargo xtask docs`: the book in `docs/` (an mdBook) built into
//! `target/book/`, with every internal link checked — in the chapters, the
//! README and the changelog — and, with `--write`, the generated references
//! (CLI `--help`, the OpenAPI document) rewritten from the code.
//!
//! mdBook comes from crates.io (`cargo install`, pinned, cached under
//! `~/.cache/pdstor/tools/`); `cargo xtask deps` installs it.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

use crate::project_root;

/// The mdBook release the book is built with.
pub const MDBOOK_VERSION: &str = "0.5.4";

#[derive(clap::Args)]
pub struct DocsArgs {
    /// Rewrite the generated references (docs/cli-reference.md from the binary's --help,
    /// driver/openapi.json and docs/http-reference.md from the
    /// wire types, via driver/src/api/openapi.rs) before building.
    #[arg(long)]
    write: bool,
}

/// Where `cargo install` puts mdBook: keyed by its version, shared by every clone.
fn mdbook_root() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set: cannot place the tool cache")?;
    Ok(PathBuf::from(home).join(format!(".cache/pdstor/tools/mdbook-{MDBOOK_VERSION}")))
}

/// The mdBook binary, installed from crates.io the first time.
pub fn mdbook(sh: &Shell) -> Result<PathBuf> {
    let root = mdbook_root()?;
    let bin = root.join("bin/mdbook");
    if bin.exists() {
        return Ok(bin);
    }
    println!("deps: installing mdbook {MDBOOK_VERSION} from crates.io into {} (once per machine)", root.display());
    let spec = format!("mdbook@{MDBOOK_VERSION}");
    cmd!(sh, "cargo install --locked --quiet --no-default-features {spec} --root {root}")
        .run()
        .with_context(|| format!("cargo install {spec}: is crates.io reachable? (the book needs mdbook)"))?;
    if !bin.exists() {
        bail!("cargo install {spec} finished but {} is missing", bin.display());
    }
    Ok(bin)
}

/// `cargo xtask docs`: regenerate (with `--write`), build, check links.
pub fn run(sh: &Shell, args: &DocsArgs) -> Result<()> {
    if args.write {
        // The CLI reference is the help of the binary the tests find: build it first.
        cmd!(sh, "cargo build --quiet -p pdstor --bin pdstor").run().context("building pdstor")?;
        cmd!(sh, "cargo test --quiet -p pdstor-tests --test docs -- the_cli_reference the_http_reference the_checked_in_openapi_document")
            .env("PDSTOR_BLESS_DOCS", "1")
            .run()
            .context("regenerating the references")?;
    }
    build(sh)
}

/// Builds the book and checks every internal link of it, the README and the changelog.
pub fn build(sh: &Shell) -> Result<()> {
    let root = project_root();
    let problems = check_links(&root)?;
    if !problems.is_empty() {
        bail!("{} broken links:\n{}", problems.len(), problems.join("\n"));
    }
    let mdbook = mdbook(sh)?;
    let docs = root.join("docs");
    let out = cmd!(sh, "{mdbook} build {docs}").ignore_status().output()?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // mdBook warns (and still succeeds) about what it could not render: treat that as an error.
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).collect();
    if !out.status.success() || !warnings.is_empty() {
        bail!("mdbook build docs/ failed:\n{log}");
    }
    println!(
        "docs: the book built into target/book/ ({} chapters), every internal link resolves",
        chapters(&root)?.len()
    );
    Ok(())
}

/// The chapters SUMMARY.md names, relative to `docs/`.
fn chapters(root: &Path) -> Result<Vec<PathBuf>> {
    let summary = std::fs::read_to_string(root.join("docs/SUMMARY.md")).context("reading docs/SUMMARY.md")?;
    Ok(links(&summary).into_iter().map(|(_, target)| PathBuf::from(target)).collect())
}

/// Every link that must resolve: those of each chapter, SUMMARY.md, the README
/// and the changelog. Returns one line per broken link.
pub fn check_links(root: &Path) -> Result<Vec<String>> {
    let docs = root.join("docs");
    let mut files: Vec<PathBuf> = vec![docs.join("SUMMARY.md"), root.join("README.md"), root.join("CHANGELOG.md")];
    let listed: BTreeSet<PathBuf> = chapters(root)?.into_iter().map(|c| docs.join(c)).collect();
    files.extend(listed.iter().cloned());
    let mut problems = Vec::new();
    // A chapter on disk that SUMMARY.md does not list is never rendered.
    for entry in std::fs::read_dir(&docs).context("reading docs/")?.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" && !listed.contains(&path) {
            problems.push(format!("docs/{name}: not in docs/SUMMARY.md, so the book never shows it"));
        }
    }
    for file in &files {
        let shown = file.strip_prefix(root).unwrap_or(file).display().to_string();
        let Ok(text) = std::fs::read_to_string(file) else {
            problems.push(format!("{shown}: missing (docs/SUMMARY.md lists it, or it is a front page)"));
            continue;
        };
        let in_book = file.starts_with(&docs);
        for (line, target) in links(&text) {
            if let Some(why) = broken(root, &docs, file, in_book, &target) {
                problems.push(format!("{shown}:{line}: ({target}): {why}"));
            }
        }
    }
    Ok(problems)
}

/// Why a link does not resolve, or `None` when it does.
fn broken(root: &Path, docs: &Path, from: &Path, in_book: bool, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(a)),
        None => (target, None),
    };
    let dest = if path.is_empty() { from.to_path_buf() } else { normalise(&from.parent()?.join(path)) };
    if !dest.starts_with(root) {
        return Some("leaves the repository".to_owned());
    }
    if in_book && !dest.starts_with(docs) {
        return Some(
            "a chapter can only link inside docs/ (the book is published alone): name the file in code instead"
                .to_owned(),
        );
    }
    if !dest.exists() {
        return Some(format!("{} does not exist", dest.strip_prefix(root).unwrap_or(&dest).display()));
    }
    let anchor = anchor.filter(|a| !a.is_empty())?;
    if dest.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let text = std::fs::read_to_string(&dest).ok()?;
    let anchors = headings(&text);
    (!anchors.contains(anchor))
        .then(|| format!("no heading #{anchor} in {}", dest.strip_prefix(root).unwrap_or(&dest).display()))
}

/// `a/./b/../c` → `a/c`, without touching the filesystem.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The text of a Markdown file with fenced code blocks blanked and inline
/// code spans removed, line by line (so line numbers still match).
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    text.lines()
        .map(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return String::new();
            }
            if fenced {
                return String::new();
            }
            let mut out = String::new();
            let mut in_code = false;
            for ch in line.chars() {
                if ch == '`' {
                    in_code = !in_code;
                    out.push('`');
                } else if !in_code {
                    out.push(ch);
                }
            }
            out
        })
        .collect()
}

/// Every link target in a Markdown file, with its line: inline links and
/// images `[text](target "title")`, and reference definitions `[x]: target`.
pub fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in prose(text).iter().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some((_, rest)) = trimmed.split_once("]: ")
            && let Some(target) = rest.split_whitespace().next()
        {
            out.push((i + 1, target.trim_matches(['<', '>']).to_owned()));
            continue;
        }
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].split_whitespace().next().unwrap_or("");
            if !target.is_empty() {
                out.push((i + 1, target.trim_matches(['<', '>']).to_owned()));
            }
            rest = &rest[end..];
        }
    }
    out
}

/// The anchors a Markdown file's headings get, as mdBook (and GitHub) make
/// them: lower case, spaces to `-`, only letters, digits, `-` and `_` kept; a
/// repeated one gets `-1`, `-2`, …
pub fn headings(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced {
            continue;
        }
        let Some(title) = line.strip_prefix('#').map(|t| t.trim_start_matches('#')) else { continue };
        if !title.starts_with(' ') {
            continue;
        }
        let base: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect();
        let mut anchor = base.clone();
        let mut n = 1;
        while seen.contains(&anchor) {
            anchor = format!("{base}-{n}");
            n += 1;
        }
        seen.insert(anchor);
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_internal_link_of_this_repository_resolves() {
        let problems = check_links(&project_root()).unwrap();
        assert!(problems.is_empty(), "{} broken links:\n{}", problems.len(), problems.join("\n"));
    }

    #[test]
    fn links_are_found_outside_code_only() {
        let md = "See [the store](store.md#journal) and ![a picture](x.svg \"title\").\n\
                  `[not](a-link.md)` here\n```\n[nor](this.md)\n```\n[ref]: other.md\n";
        let found: Vec<(usize, String)> = links(md);
        assert_eq!(
            found,
            vec![(1, "store.md#journal".to_owned()), (1, "x.svg".to_owned()), (6, "other.md".to_owned())]
        );
    }

    #[test]
    fn heading_anchors_are_mdbooks() {
        let md = "# Design\n## 10. Integrations (where users meet pdstor)\n### `POST /a`\n## DMA-BUF\n## DMA-BUF\n";
        let a = headings(md);
        for want in ["design", "10-integrations-where-users-meet-pdstor", "post-a", "dma-buf", "dma-buf-1"] {
            assert!(a.contains(want), "{want} not in {a:?}");
        }
    }

    #[test]
    fn a_broken_link_is_named_with_its_reason() {
        let dir = std::env::temp_dir().join(format!("pdstor-linkcheck-{}", std::process::id()));
        let docs = dir.join("docs");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(docs.join("SUMMARY.md"), "- [A](a.md)\n- [B](b.md)\n").unwrap();
        std::fs::write(docs.join("a.md"), "# A\n## Here\n[ok](b.md#there) [self](#here) [gone](c.md)\n").unwrap();
        std::fs::write(docs.join("b.md"), "# B\n## There\n[bad anchor](a.md#nowhere) [out](../README.md)\n").unwrap();
        std::fs::write(docs.join("stray.md"), "# not listed\n").unwrap();
        std::fs::write(dir.join("README.md"), "[book](docs/a.md#here) [missing](docs/z.md)\n").unwrap();
        std::fs::write(dir.join("CHANGELOG.md"), "nothing\n").unwrap();
        let problems = check_links(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let all = problems.join("\n");
        assert_eq!(problems.len(), 5, "{all}");
        assert!(all.contains("docs/stray.md: not in docs/SUMMARY.md"), "{all}");
        assert!(all.contains("docs/a.md:3: (c.md): docs/c.md does not exist"), "{all}");
        assert!(all.contains("docs/b.md:3: (a.md#nowhere): no heading #nowhere"), "{all}");
        assert!(all.contains("docs/b.md:3: (../README.md): a chapter can only link inside docs/"), "{all}");
        assert!(all.contains("README.md:1: (docs/z.md): docs/z.md does not exist"), "{all}");
    }
}
