//! The code's layers, checked from its source: in every crate, each folder
//! imports only the folders of the layers declared below it ([`LAYERS`]), no
//! file imports a sibling that imports it back, and each crate depends only
//! on the crates below it ([`CRATES`]); and the size rules (no source file
//! of any crate over 600 lines, no function outside tests over 100 in any
//! crate's `src`).
//!
//! A reference is any `crate::a::…` path (in a `use` or inline) and, inside a
//! folder, any `super::b::…` or `use super::{b, …}`; doc comments and tests
//! (`#[cfg(test)] mod tests`, or a `tests.rs` file) are left out, since
//! neither is a dependency of the code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Who references whom: a node and the nodes it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    pdstor_tests::tree_files(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "rs")).collect()
}

/// The code of a file without comments and without its unit tests.
fn code(text: &str) -> String {
    // An inline test module ends the code; `#[cfg(test)] mod tests;` (its
    // own file) does not.
    let body = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => text,
    };
    body.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The identifiers that follow `prefix` in `code` (`crate::` → `store`, …),
/// including each name of a braced group (`super::{a, b::C}` → `a`, `b`).
fn names_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `pdstor_client::crate::` never happens; `foo::super::` is not ours
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                let name = ident(part.trim());
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// A cycle in `graph`, if there is one (a path that comes back to its start).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn walk(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            found.push(cycle);
            return;
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            walk(next, graph, path, done, found);
        }
        path.pop();
        done.insert(node.to_owned());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        walk(node, graph, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// The module a file is: `store/state.rs` → (`store`, `state`); `store/mod.rs`
/// → (`store`, `mod`); `units.rs` → (`units`, `mod`).
fn module_of(src: &Path, file: &Path) -> (String, String) {
    let rel = file.strip_prefix(src).expect("a file under src");
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned()).collect();
    match parts.as_slice() {
        [single] => (single.clone(), "mod".to_owned()),
        [folder, file, ..] => (folder.clone(), file.clone()),
        [] => unreachable!("a file has a name"),
    }
}

/// The folder graph and the per-folder file graphs of one crate's `src`.
fn graphs(src: &Path) -> (Graph, BTreeMap<String, Graph>) {
    let mut folders: Graph = BTreeMap::new();
    let mut files: BTreeMap<String, Graph> = BTreeMap::new();
    let top: BTreeSet<String> = rust_files(src).iter().map(|f| module_of(src, f).0).collect();
    for file in rust_files(src) {
        let (folder, name) = module_of(src, &file);
        if folder == "lib" || folder == "main" {
            continue; // the crate root declares and re-exports every module
        }
        if file.file_name().is_some_and(|n| n == "tests.rs") {
            continue; // a module's unit tests, in a file of their own
        }
        let text = code(&std::fs::read_to_string(&file).expect("reading a source file"));
        let used = names_after(&text, "crate::");
        let edges = folders.entry(folder.clone()).or_default();
        for m in used.iter().filter(|m| top.contains(*m) && **m != folder) {
            edges.insert(m.clone());
        }
        if name == "mod" {
            continue; // a folder's mod.rs declares its files and may re-export them
        }
        let siblings: BTreeSet<String> = names_after(&text, "super::")
            .into_iter()
            .chain(names_after(&text, &format!("crate::{folder}::")))
            .filter(|s| *s != name)
            .collect();
        files.entry(folder).or_default().entry(name).or_default().extend(siblings);
    }
    // A sibling reference names a file only if that file exists.
    for graph in files.values_mut() {
        let known: BTreeSet<String> = graph.keys().cloned().collect();
        for edges in graph.values_mut() {
            edges.retain(|e| known.contains(e));
        }
    }
    (folders, files)
}

/// Every crate's `src`, with its folders in layers, top first: a folder
/// may import only folders of the layers below its own (not its own layer's,
/// not above). A folder left out of its crate's list is an error too: say
/// where a new one stands.
const LAYERS: &[(&str, &[&[&str]])] = &[
    ("driver/src", &[&["api"], &["protocol", "owner"], &["provenance"], &["store"], &["admission"], &["units"]]),
    (
        "cli/src",
        &[
            &["main"],
            &["serve", "client", "target", "harness", "bench_crc", "probe", "timeline"],
            &["process_handoff"],
            &["common"],
        ],
    ),
    ("proof/src", &[&["harness"], &["timeline", "model"]]),
    ("engine/src", &[&["io"], &["buffer"], &["crc32c", "payload"]]),
    (
        "client/src",
        &[
            &["writer", "reader", "adoptions"],
            &["many"],
            &["remote", "batch"],
            &["step_de", "verify", "data", "spec", "transport", "handoff"],
            &["wire"],
            &["read"],
            &["timeline"],
            &["receipt", "superblock"],
            &["layout", "private", "code", "frame", "tls", "http1"],
        ],
    ),
    ("ebpf/src", &[&["loader"], &["hooks"], &["facility", "kallsyms", "signals"], &["program"]]),
    ("vmtest/src", &[&["bin"], &["guest"], &["suites"], &["machine"]]),
    ("vmtest/spec/src", &[]),
    (
        "xtask/src",
        &[
            &["ci"],
            &["bench", "gpu_qual", "soak", "vmtest"],
            &["gpu_bundle"],
            &["gpu_bare"],
            &["fresh", "vllm", "cuda_ptx"],
            &["deps", "reclaim", "disk", "python"],
            &["docs"],
        ],
    ),
    ("testkit/src", &[]),
    ("tests/src", &[&["mallory"]]),
    ("python/src", &[&["writer", "reader"], &["restore"], &["client"], &["buffer", "staged", "timeline"]]),
];

/// The crates, top first: a crate may depend (normally, for its build or its
/// tests) only on crates of the layers below its own.
const CRATES: &[&[&str]] = &[
    &["xtask"],
    &["pdstor-tests", "pdstor-vmtest"],
    &["pdstor"],
    &["pdstor-proof"],
    &["pdstor-daemon"],
    &["pdstor-probes", "pdstor-python"],
    &["pdstor-client"],
    &["pdstor-engine"],
    &["pdstor-vmtest-spec", "pdstor-testkit"],
];

/// The imports of `graph` that go to the same layer or up, and the nodes no
/// layer names, as sentences.
fn upward(graph: &Graph, layers: &[&[&str]], what: &str) -> Vec<String> {
    let level = |n: &str| layers.iter().position(|l| l.contains(&n));
    let mut out = Vec::new();
    for (from, to) in graph {
        let Some(a) = level(from) else {
            out.push(format!("{what}: `{from}` is in no layer: add it to its crate's list in tests/tests/layers.rs"));
            continue;
        };
        for t in to {
            match level(t) {
                None => out.push(format!("{what}: `{t}` is in no layer: add it to its crate's list")),
                Some(b) if b <= a => out.push(format!("{what}: `{from}` imports `{t}`, which is not below it")),
                Some(_) => {}
            }
        }
    }
    out
}

#[test]
fn every_crate_imports_only_the_layers_below_and_no_loop() {
    let mut problems = Vec::new();
    for (dir, layers) in LAYERS {
        let (mut folders, files) = graphs(&root().join(dir));
        for c in cycles(&folders) {
            problems.push(format!("{dir} folders: a loop {}", c.join(" → ")));
        }
        for (folder, graph) in &files {
            for c in cycles(graph) {
                problems.push(format!("{dir}/{folder}: a loop {}", c.join(" → ")));
            }
        }
        // Every folder and file of the crate stands in a layer, imports or not.
        for f in rust_files(&root().join(dir)) {
            let (folder, _) = module_of(&root().join(dir), &f);
            if !matches!(folder.as_str(), "lib" | "main") {
                folders.entry(folder).or_default();
            }
        }
        problems.extend(upward(&folders, layers, dir));
    }
    assert!(problems.is_empty(), "layers broken:\n{}", problems.join("\n"));
}

/// Each workspace crate's name and the crates of this repository it depends
/// on (normal, build and dev dependencies), from its `Cargo.toml`.
fn crate_graph() -> Graph {
    let mut graph = Graph::new();
    for manifest in pdstor_tests::crate_folders(&root()) {
        let text = std::fs::read_to_string(root().join(&manifest).join("Cargo.toml")).expect("reading a Cargo.toml");
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("a package name")
            .to_owned();
        let deps = text
            .lines()
            .filter(|l| l.contains("path = \""))
            .filter_map(|l| l.split_once(" = {").map(|(n, _)| n.trim().to_owned()));
        graph.entry(name).or_default().extend(deps);
    }
    graph
}

#[test]
fn every_crate_depends_only_on_the_crates_below() {
    let graph = crate_graph();
    assert!(graph.len() >= 10, "found the crates {:?}", graph.keys());
    let problems = upward(&graph, CRATES, "crates");
    assert!(problems.is_empty(), "crate layers broken:\n{}", problems.join("\n"));
}

/// The `pub use`s of `code` that give another crate of this repository's
/// items a second path (`pub use pdstor_client::wire;`).
fn second_names(code: &str) -> Vec<String> {
    code.lines()
        .map(str::trim)
        .filter(|l| {
            l.strip_prefix("pub use ")
                .and_then(|path| path.split("::").next())
                .is_some_and(|krate| krate == "pdstor" || krate.starts_with("pdstor_"))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn no_crate_gives_another_crates_items_a_second_path() {
    let mut found = Vec::new();
    for (dir, _) in LAYERS {
        for f in rust_files(&root().join(dir)) {
            let text = code(&std::fs::read_to_string(&f).expect("reading a source file"));
            for line in second_names(&text) {
                found.push(format!("{}: {line}", f.strip_prefix(root()).unwrap_or(&f).display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "re-exports of another crate's items: name them where they are defined\n{}",
        found.join("\n")
    );
    assert_eq!(
        second_names("pub use pdstor_client::wire;\npub use store::Layout;\nuse pdstor_engine::io;"),
        ["pub use pdstor_client::wire;"]
    );
}

/// The `pub use`s of `code` that give an item of one of its own public
/// modules a second path (`pub mod io;` with `pub use io::Engine;` names it
/// both `io::Engine` and `Engine`). A `pub use` out of a private module is
/// the item's one path.
fn own_second_names(code: &str) -> Vec<String> {
    let public: Vec<&str> = code.lines().filter_map(|l| l.trim().strip_prefix("pub mod ")?.strip_suffix(';')).collect();
    code.lines()
        .map(str::trim)
        .filter(|l| {
            l.strip_prefix("pub use ")
                .map(|path| path.trim_start_matches("self::"))
                .and_then(|path| path.split("::").next())
                .is_some_and(|module| public.contains(&module))
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn no_module_gives_its_public_modules_items_a_second_path() {
    let mut found = Vec::new();
    for (dir, _) in LAYERS {
        for f in rust_files(&root().join(dir)) {
            let text = code(&std::fs::read_to_string(&f).expect("reading a source file"));
            for line in own_second_names(&text) {
                found.push(format!("{}: {line}", f.strip_prefix(root()).unwrap_or(&f).display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "re-exports of a public module's items: name them by their module, or make the module private\n{}",
        found.join("\n")
    );
    assert_eq!(
        own_second_names("pub mod io;\nmod ring;\npub use io::Engine;\npub use ring::Ring;"),
        ["pub use io::Engine;"]
    );
}

#[test]
fn the_layer_check_finds_an_upward_import() {
    let layers: &[&[&str]] = &[&["api"], &["protocol", "timeline"], &["store"]];
    let graph: Graph = [
        ("api".to_owned(), ["store".to_owned()].into()),
        ("store".to_owned(), ["api".to_owned()].into()),
        ("protocol".to_owned(), ["timeline".to_owned()].into()),
        ("model".to_owned(), BTreeSet::new()),
    ]
    .into();
    assert_eq!(
        upward(&graph, layers, "x"),
        [
            "x: `model` is in no layer: add it to its crate's list in tests/tests/layers.rs",
            "x: `protocol` imports `timeline`, which is not below it",
            "x: `store` imports `api`, which is not below it",
        ]
    );
}

#[test]
fn the_loop_finder_finds_a_loop() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("api".to_owned(), ["protocol".to_owned()].into()),
        ("protocol".to_owned(), ["timeline".to_owned()].into()),
        ("timeline".to_owned(), ["protocol".to_owned()].into()),
    ]
    .into();
    assert_eq!(cycles(&graph), vec![vec!["protocol".to_owned(), "timeline".to_owned(), "protocol".to_owned()]]);
    let used = names_after("use super::{error::X, state};\nlet a = crate::store::Store::new();", "super::");
    assert_eq!(used, ["error".to_owned(), "state".to_owned()].into());
}

#[test]
fn no_source_file_of_any_crate_is_over_600_lines() {
    let long: Vec<String> = LAYERS
        .iter()
        .flat_map(|(dir, _)| rust_files(&root().join(dir)))
        .filter_map(|f| {
            let lines = std::fs::read_to_string(&f).ok()?.lines().count();
            (lines > 600).then(|| format!("{} ({lines} lines)", f.strip_prefix(root()).unwrap_or(&f).display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 600 lines: {}", long.join(", "));
}

/// Functions longer than `limit` lines in `text` (unit tests left out): a
/// function runs from its `fn` line to the first line that closes it at its
/// own indentation. Answers (name, first line, lines).
fn long_functions(text: &str, limit: usize) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code_lines(text);
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let Some(at) = trimmed.find("fn ") else { continue };
        // Only a definition: `fn`, after nothing but qualifiers.
        let head = &trimmed[..at];
        if !head
            .split_whitespace()
            .all(|w| matches!(w, "pub" | "pub(crate)" | "pub(super)" | "const" | "async" | "unsafe"))
        {
            continue;
        }
        let name: String = trimmed[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        // A declaration without a body (a trait's) ends at its `;`.
        let Some(open) = lines[i..].iter().position(|l| l.trim_end().ends_with('{') || l.trim_end().ends_with(';'))
        else {
            continue;
        };
        if lines[i + open].trim_end().ends_with(';') {
            continue;
        }
        // A one-line function.
        if trimmed.contains('{') && trimmed.matches('{').count() == trimmed.matches('}').count() {
            continue;
        }
        let close = format!("{indent}}}");
        let Some(len) = lines[i + open..].iter().position(|l| l.trim_end() == close) else { continue };
        let total = open + len + 1;
        if total > limit {
            out.push((name, i + 1, total));
        }
    }
    out
}

/// A file's lines up to its unit tests (`#[cfg(test)] mod …`).
fn code_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].starts_with("#[cfg(test)]") && w[1].trim_start().starts_with("mod ") && w[1].ends_with('{'))
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

#[test]
fn no_function_outside_tests_is_over_100_lines() {
    let mut long = Vec::new();
    for (dir, _) in LAYERS {
        for f in rust_files(&root().join(dir)) {
            if f.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&f).expect("reading a source file");
            for (name, line, lines) in long_functions(&text, 100) {
                long.push(format!("{}:{line} {name} ({lines} lines)", f.strip_prefix(root()).unwrap_or(&f).display()));
            }
        }
    }
    assert!(long.is_empty(), "functions over 100 lines: {}", long.join(", "));
}

#[test]
fn the_length_check_measures_a_function() {
    let mut text = String::from("impl A {\n    pub fn long(&self) -> u32 {\n");
    for _ in 0..100 {
        text.push_str("        let _x = 1;\n");
    }
    text.push_str("        0\n    }\n\n    fn short() {}\n    fn decl();\n}\n");
    assert_eq!(long_functions(&text, 100), [("long".to_owned(), 2, 103)]);
    assert!(long_functions(&text, 103).is_empty());
    let tests = format!("fn a() {{}}\n#[cfg(test)]\nmod tests {{\n{text}}}\n");
    assert!(long_functions(&tests, 100).is_empty(), "unit tests are left out");
}
