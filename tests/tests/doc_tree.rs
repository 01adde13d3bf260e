//! The book against the tree it describes: `docs/architecture.md` names every
//! source file in the entry of its folder, every repository file a chapter
//! cites exists, and the opening paragraph of `docs/introduction.md` stands
//! there alone (the README and the design say what they add, not it again).
//!
//! Source files are the code of every crate's `src/`, the eBPF program, the
//! Python package and its scripts, the soak's processes and the GPU rungs; a
//! test tree (`tests/`, `driver/tests/`, `python/tests/`, …) is named as a
//! folder. A file is named when its entry in the architecture's tree — the
//! folder there that is the longest prefix of its path — holds its file name
//! as a word (`owner.rs`); a `mod.rs` below the entry's folder is named by its
//! folder (`check/`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every file under `dir` (relative to the root), recursively, sorted.
fn files_under(dir: &str) -> Vec<String> {
    pdstor_tests::tree_files(&root().join(dir))
        .into_iter()
        .filter_map(|p| Some(p.strip_prefix(root()).ok()?.to_string_lossy().into_owned()))
        .collect()
}

const SOURCE_EXTENSIONS: &[&str] = &["rs", "py", "pyi", "c", "h", "cu", "cpp", "ptx", "sh", "json"];

/// The source files the architecture must name, one by one.
fn named_sources() -> Vec<String> {
    let dirs = [
        "cli/src",
        "client/src",
        "driver/src",
        "engine/src",
        "proof/src",
        "ebpf/src",
        "vmtest/src",
        "vmtest/spec/src",
        "xtask/src",
        "xtask/soak",
        "tests/src",
        "testkit/src",
        "python/src",
        "python/pdstor",
        "python/e2e",
        "python/bench",
        "gpu-qual",
    ];
    let mut out: Vec<String> = dirs.iter().flat_map(|d| files_under(d)).collect();
    out.push("ebpf/build.rs".to_owned());
    out.retain(|f| {
        let ext = Path::new(f).extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        SOURCE_EXTENSIONS.contains(&ext.as_str()) && !f.ends_with("/tests.rs")
    });
    out
}

/// The test trees the architecture names as folders.
const TEST_TREES: &[&str] = &["tests/tests/", "driver/tests/", "engine/tests/", "python/tests/"];

/// One entry of the architecture's tree: a folder (`driver/src/store/`) and
/// the text that describes it, up to the next entry.
#[derive(Debug)]
struct Entry {
    folder: String,
    text: String,
}

/// The entries of the first fenced block of `doc`: a line that starts, at
/// no indentation, with a word ending in `/` opens a top folder (`driver/`);
/// one indented two spaces opens a folder inside it (`  src/store/`).
fn entries(doc: &str) -> Vec<Entry> {
    let block = doc.split("```").nth(1).unwrap_or_default();
    let mut out: Vec<Entry> = Vec::new();
    let mut top = String::new();
    for line in block.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let word = trimmed.split_whitespace().next().unwrap_or_default();
        let opens = word.ends_with('/') && (indent == 0 || (indent == 2 && !top.is_empty()));
        if opens {
            let folder = if indent == 0 { word.to_owned() } else { format!("{top}{word}") };
            if indent == 0 {
                top = word.to_owned();
            }
            out.push(Entry { folder, text: trimmed[word.len()..].to_owned() });
        } else if let Some(last) = out.last_mut() {
            last.text.push('\n');
            last.text.push_str(line);
        }
    }
    out
}

/// Whether `text` holds `word` with no identifier character on either side.
fn holds_word(text: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(|c| is_ident(c) || c == '.')
    })
}

/// The files of `sources` the tree `doc` does not name, each with why.
fn unnamed(doc: &str, sources: &[String]) -> Vec<String> {
    let entries = entries(doc);
    let mut missing = Vec::new();
    for file in sources {
        let Some(entry) = entries.iter().filter(|e| file.starts_with(&e.folder)).max_by_key(|e| e.folder.len()) else {
            missing.push(format!("{file} (no entry for any folder above it)"));
            continue;
        };
        let rest = &file[entry.folder.len()..];
        let (dir, name) = rest.rsplit_once('/').unwrap_or(("", rest));
        let needed = if name == "mod.rs" {
            match dir.rsplit('/').next() {
                Some(sub) if !sub.is_empty() => format!("{sub}/"),
                _ => continue, // the entry's own folder is its mod.rs
            }
        } else {
            name.to_owned()
        };
        if !holds_word(&entry.text, &needed) {
            missing.push(format!("{file} (`{needed}` not in the entry of `{}`)", entry.folder));
        }
    }
    missing
}

#[test]
fn the_architecture_names_every_source_file() {
    let doc = read("docs/architecture.md");
    let mut missing = unnamed(&doc, &named_sources());
    let folders: BTreeSet<String> = entries(&doc).into_iter().map(|e| e.folder).collect();
    missing.extend(TEST_TREES.iter().filter(|t| !folders.contains(**t)).map(|t| format!("{t} (a test tree)")));
    assert!(
        missing.is_empty(),
        "docs/architecture.md does not name {} source files: say in its tree what each is\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_tree_check_finds_a_file_left_out() {
    let doc =
        "```\ndriver/   the daemon\n  src/store/  journal.rs (records), check/ (the checker)\n  src/     lib.rs\n```\n";
    let sources: Vec<String> = [
        "driver/src/store/journal.rs",
        "driver/src/store/mod.rs",
        "driver/src/store/check/mod.rs",
        "driver/src/store/evict.rs",
        "driver/src/lib.rs",
        "driver/src/units.rs",
        "xtask/src/main.rs",
    ]
    .map(str::to_owned)
    .into();
    assert_eq!(
        unnamed(doc, &sources),
        [
            "driver/src/store/evict.rs (`evict.rs` not in the entry of `driver/src/store/`)",
            "driver/src/units.rs (`units.rs` not in the entry of `driver/src/`)",
            "xtask/src/main.rs (no entry for any folder above it)",
        ]
    );
    assert!(!holds_word("worker_tests.rs", "tests.rs") && !holds_word("arrow.rs", "row.rs"));
}

/// The repository paths `text` cites in backticks: a file with a source
/// extension (`api/owner.rs`, `driver/src/lib.rs:40`) or a folder under a
/// top folder of the repository (`driver/src/timeline/`). Outputs
/// (`target/…`), system headers (`io_uring.h`) and paths outside the
/// repository are not citations of it.
fn citations(text: &str, tops: &BTreeSet<String>) -> Vec<String> {
    let mut out = Vec::new();
    for (i, quoted) in text.split('`').enumerate() {
        if i % 2 == 0 || quoted.contains(char::is_whitespace) {
            continue;
        }
        let path = quoted.split(':').next().unwrap_or_default();
        if path.is_empty() || !path.chars().all(|c| c.is_alphanumeric() || "._-/".contains(c)) {
            continue;
        }
        let ext = path.rsplit_once('.').map(|(_, e)| e).unwrap_or_default();
        let first = path.split('/').next().unwrap_or_default();
        let file = ["rs", "py", "pyi", "c", "cu", "cpp", "sh", "ptx", "toml"].contains(&ext)
            || (["h", "md"].contains(&ext) && path.contains('/'));
        let folder = path.ends_with('/') && tops.contains(first);
        if (file || folder) && first != "target" && !path.starts_with('.') {
            out.push(path.to_owned());
        }
    }
    out
}

#[test]
fn every_file_a_chapter_cites_exists() {
    let all = files_under(".");
    let tops: BTreeSet<String> = all.iter().filter_map(|f| Some(f.split_once('/')?.0.to_owned())).collect();
    let exists = |cited: &str| {
        let cited = cited.trim_start_matches("./");
        all.iter().any(|f| {
            f == cited
                || f.ends_with(&format!("/{cited}"))
                || (cited.ends_with('/') && (f.starts_with(cited) || f.contains(&format!("/{cited}"))))
        })
    };
    let mut chapters: Vec<String> = files_under("docs").into_iter().filter(|f| f.ends_with(".md")).collect();
    chapters.extend(["README.md".to_owned(), "CONTRIBUTING.md".to_owned()]);
    let mut stale = Vec::new();
    for chapter in &chapters {
        for (n, line) in read(chapter).lines().enumerate() {
            for cited in citations(line, &tops) {
                if !exists(&cited) {
                    stale.push(format!("{chapter}:{}: `{cited}`", n + 1));
                }
            }
        }
    }
    assert!(stale.is_empty(), "chapters cite files that are not in the repository (moved?):\n{}", stale.join("\n"));
}

#[test]
fn the_citation_finder_reads_paths_not_words() {
    let tops: BTreeSet<String> = ["driver".to_owned()].into();
    let line = "see `driver/src/lib.rs:40`, `api/owner.rs`, `driver/src/timeline/`, `target/book/`, \
                `io_uring.h`, `cargo xtask ci`, `Store::new` and `pdstor-gpu-bundle/scratch/`";
    assert_eq!(citations(line, &tops), ["driver/src/lib.rs", "api/owner.rs", "driver/src/timeline/"]);
}

/// The words of `text` in order, lowercase, outside code blocks.
fn words(text: &str) -> Vec<String> {
    let prose: String = text.split("```").step_by(2).collect::<Vec<_>>().join(" ");
    prose.split(|c: char| !c.is_alphanumeric()).filter(|w| !w.is_empty()).map(str::to_lowercase).collect()
}

/// The first paragraph of a chapter after its title.
fn opening(doc: &str) -> String {
    doc.split("\n\n").map(str::trim).find(|p| !p.is_empty() && !p.starts_with('#')).unwrap_or_default().to_owned()
}

/// The runs of `n` words `a` and `b` have in common.
fn shared_runs(a: &[String], b: &[String], n: usize) -> BTreeSet<String> {
    let runs = |w: &[String]| w.windows(n).map(|r| r.join(" ")).collect::<BTreeSet<_>>();
    runs(a).intersection(&runs(b)).cloned().collect()
}

#[test]
fn the_introduction_stands_once() {
    let intro = words(&opening(&read("docs/introduction.md")));
    assert!(intro.len() > 40, "docs/introduction.md opens with a paragraph that says what pdstor is");
    let mut chapters: Vec<String> = files_under("docs").into_iter().filter(|f| f.ends_with(".md")).collect();
    chapters.retain(|c| c != "docs/introduction.md");
    chapters.extend(["README.md".to_owned(), "CONTRIBUTING.md".to_owned()]);
    let mut repeated = Vec::new();
    for chapter in &chapters {
        let shared = shared_runs(&intro, &words(&read(chapter)), 8);
        if let Some(run) = shared.first() {
            repeated.push(format!("{chapter} ({} runs of 8 words, e.g. \"{run}\")", shared.len()));
        }
    }
    assert!(
        repeated.is_empty(),
        "the introduction's opening paragraph is said again: link to docs/introduction.md instead\n{}",
        repeated.join("\n")
    );
}
