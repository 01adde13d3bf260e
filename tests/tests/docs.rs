//! The docs book (`docs/`) against what it documents: every "DESIGN §N" the
//! code cites names a section of `docs/design.md`; the CLI and HTTP
//! references are what the binary and the OpenAPI document say now; the
//! getting-started chapter's commands run as written; the README stays a
//! front page.
//!
//! The two references are generated: `PDSTOR_BLESS_DOCS=1 cargo test -p
//! pdstor-tests --test docs` (or `cargo xtask docs --write`) rewrites them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use pdstor_testkit::{is_root, skip};
use pdstor_tests::pdstor_bin;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Compares a generated reference with its committed file, or rewrites the
/// file when `PDSTOR_BLESS_DOCS` is set.
fn check_generated(rel: &str, generated: &str) {
    let path = root().join(rel);
    if std::env::var_os("PDSTOR_BLESS_DOCS").is_some() {
        std::fs::write(&path, generated).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed.lines().zip(generated.lines()).position(|(a, b)| a != b);
        panic!(
            "{rel} is not what the code says now (first difference at line {}): \
             run `cargo xtask docs --write` and commit the result",
            first.map_or_else(|| "end".to_owned(), |i| (i + 1).to_string())
        );
    }
}

/// Every source file under the repository's code folders.
fn sources() -> Vec<PathBuf> {
    pdstor_tests::crate_folders(&root())
        .iter()
        .flat_map(|d| pdstor_tests::tree_files(&root().join(d)))
        .filter(|p| p.extension().is_some_and(|e| ["rs", "c", "h", "py"].iter().any(|x| e == *x)))
        .collect()
}

#[test]
fn every_design_section_the_code_cites_is_in_docs_design_md() {
    let design = read("docs/design.md");
    let sections: BTreeSet<u32> = design
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .filter_map(|h| h.split('.').next()?.trim().parse().ok())
        .collect();
    assert!(sections.len() >= 11, "docs/design.md has sections {sections:?}: expected §1 to §11");
    let mut cited = 0;
    let mut missing = Vec::new();
    for file in sources() {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("DESIGN §") {
                rest = &rest[at + "DESIGN §".len()..];
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                if digits.is_empty() {
                    continue; // "DESIGN §N", the pattern itself
                }
                cited += 1;
                match digits.parse::<u32>() {
                    Ok(n) if sections.contains(&n) => {}
                    _ => missing.push(format!("{}:{}: DESIGN §{digits}", file.display(), i + 1)),
                }
            }
        }
    }
    assert!(cited >= 20, "only {cited} citations of DESIGN §N found: is the search looking in the right folders?");
    assert!(missing.is_empty(), "cited sections that docs/design.md does not have:\n{}", missing.join("\n"));
}

#[test]
fn the_readme_is_a_front_page() {
    let readme = read("README.md");
    assert!(
        readme.len() <= 12 * 1024,
        "README.md is {} bytes: keep it at most 12 KiB, move detail to docs/",
        readme.len()
    );
}

/// Runs the binary with a user-independent environment: the default socket
/// paths (which depend on root and `XDG_RUNTIME_DIR`) are replaced by
/// `$RUNTIME_DIR`.
fn help(args: &[&str]) -> String {
    let runtime = "/run/user/pdstor-docs";
    let out = Command::new(pdstor_bin())
        .args(args)
        .arg("--help")
        .env_remove("PDSTOR_SERVER")
        .env_remove("PDSTOR_DATA_SOCKET")
        .env_remove("PDSTOR_WRITER")
        .env_remove("PDSTOR_TLS_CA")
        .env_remove("PDSTOR_TLS_CERT")
        .env_remove("PDSTOR_TLS_KEY")
        .env("XDG_RUNTIME_DIR", runtime)
        .env("COLUMNS", "200")
        .output()
        .expect("running pdstor --help");
    assert!(out.status.success(), "pdstor {} --help failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .expect("help is UTF-8")
        .replace("/run/pdstor", "$RUNTIME_DIR")
        .replace(&format!("{runtime}/pdstor"), "$RUNTIME_DIR")
}

/// The subcommands a help text lists under `Commands:` (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| l.trim() != "Commands:")
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

fn cli_reference() -> String {
    let mut md = String::from(
        "# Every command's --help\n\n\
         <!-- Generated from the pdstor binary by tests/tests/docs.rs: `cargo xtask docs --write` rewrites it, \
         and the test fails while it differs. Do not edit by hand. -->\n\n\
         What `pdstor <command> --help` prints, for every command. `$RUNTIME_DIR` is `/run/pdstor` for root \
         and `$XDG_RUNTIME_DIR/pdstor` for anyone else. The [CLI chapter](cli.md) has the overview and the \
         exit codes.\n",
    );
    let mut queue: Vec<Vec<String>> = vec![Vec::new()];
    while let Some(path) = queue.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        let title = if path.is_empty() { "pdstor".to_owned() } else { format!("pdstor {}", path.join(" ")) };
        md.push_str(&format!("\n## `{title}`\n\n```text\n{}\n```\n", text.trim_end()));
        let mut children: Vec<Vec<String>> = subcommands(&text)
            .into_iter()
            .map(|c| {
                let mut p = path.clone();
                p.push(c);
                p
            })
            .collect();
        children.reverse();
        queue.extend(children);
    }
    md
}

#[test]
fn the_cli_reference_is_the_binarys_help() {
    let md = cli_reference();
    for verb in ["serve", "put", "get", "probe load", "timeline check", "qualify"] {
        assert!(md.contains(&format!("## `pdstor {verb}`")), "the CLI reference has no section for `pdstor {verb}`");
    }
    check_generated("docs/cli-reference.md", &md);
}

fn schema_name(v: &Value) -> Option<String> {
    let r = v.pointer("/content/application~1json/schema/$ref")?.as_str()?;
    Some(r.rsplit('/').next()?.to_owned())
}

fn type_of(prop: &Value) -> String {
    if let Some(r) = prop.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("[{name}](#{})", name.to_lowercase());
    }
    if let Some(variants) = prop.get("oneOf").or_else(|| prop.get("anyOf")).and_then(Value::as_array) {
        return variants.iter().map(type_of).collect::<Vec<_>>().join(" or ");
    }
    let t = match prop.get("type") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(" or "),
        _ => "any".to_owned(),
    };
    match prop.get("items") {
        Some(items) if t.contains("array") => t.replacen("array", &format!("array of {}", type_of(items)), 1),
        _ => match prop.get("enum").and_then(Value::as_array) {
            Some(values) => {
                let v: Vec<String> = values.iter().map(|v| format!("`{}`", v.as_str().unwrap_or("?"))).collect();
                format!("{t}: {}", v.join(", "))
            }
            None => t,
        },
    }
}

/// A field's description: its own, or (an optional reference, `oneOf` null
/// or the type) the one its variant carries.
fn description(prop: &Value) -> &str {
    let variants = prop.get("oneOf").and_then(Value::as_array).into_iter().flatten();
    std::iter::once(prop).chain(variants).find_map(|p| p.get("description").and_then(Value::as_str)).unwrap_or("")
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// A schema's fields as a table (or its type, for one that has none).
fn fields(md: &mut String, schema: &Value) {
    let required: BTreeSet<&str> =
        schema.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    match schema.get("properties").and_then(Value::as_object) {
        Some(props) => {
            md.push_str("| field | type | required | meaning |\n|---|---|---|---|\n");
            for (field, prop) in props {
                let meaning = description(prop);
                let req = if required.contains(field.as_str()) { "yes" } else { "" };
                md.push_str(&format!("| `{field}` | {} | {req} | {} |\n", cell(&type_of(prop)), cell(meaning)));
            }
        }
        None => md.push_str(&format!("{}\n", type_of(schema))),
    }
}

fn http_reference(doc: &Value) -> String {
    let mut md = String::from(
        "# HTTP API\n\n\
         <!-- Generated from the OpenAPI document (driver/src/api/openapi.rs) by tests/tests/docs.rs: `cargo xtask docs --write` rewrites it, \
         and the test fails while it differs. Do not edit by hand. -->\n\n\
         The daemon serves this OpenAPI document at `/openapi.json`. Every refusal is an [Error](#error) \
         (`{status, code, field, message}`) and changes nothing; the [protocol chapter](protocol.md) says \
         what each step means and [Who may do what](security.md) who may take it.\n\n## Routes\n",
    );
    let paths = doc["paths"].as_object().expect("openapi.json has paths");
    for (path, methods) in paths {
        for (method, op) in methods.as_object().expect("a path's methods") {
            let summary = op["summary"].as_str().unwrap_or("");
            md.push_str(&format!("\n### `{} {path}`\n\n{summary}\n\n", method.to_uppercase()));
            if let Some(body) = op.get("requestBody").and_then(schema_name) {
                md.push_str(&format!("- request: [{body}](#{})\n", body.to_lowercase()));
            }
            if let Some(responses) = op["responses"].as_object() {
                for (status, response) in responses {
                    let what = response["description"].as_str().unwrap_or("");
                    let body =
                        schema_name(response).map(|s| format!(" ([{s}](#{}))", s.to_lowercase())).unwrap_or_default();
                    md.push_str(&format!("- {status}: {}{body}\n", cell(what)));
                }
            }
        }
    }
    md.push_str("\n## Schemas\n");
    let schemas = doc["components"]["schemas"].as_object().expect("openapi.json has schemas");
    for (name, schema) in schemas {
        md.push_str(&format!("\n### {name}\n\n"));
        if let Some(d) = schema.get("description").and_then(Value::as_str) {
            md.push_str(&format!("{d}\n\n"));
        }
        match schema.get("oneOf").and_then(Value::as_array) {
            Some(variants) if schema.get("properties").is_none() => {
                md.push_str("One of:\n");
                for variant in variants {
                    let what = variant.get("description").and_then(Value::as_str).unwrap_or("");
                    md.push_str(&format!("\n{what}\n\n"));
                    fields(&mut md, variant);
                }
            }
            _ => fields(&mut md, schema),
        }
    }
    md
}

#[test]
fn the_checked_in_openapi_document_is_the_generated_one() {
    check_generated("driver/openapi.json", &pdstor_daemon::api::openapi::document_text());
}

#[test]
fn the_http_reference_is_the_openapi_document() {
    let doc = pdstor_daemon::api::openapi::document();
    let md = http_reference(&doc);
    for route in ["/storage-pd/prepare", "/storage-pd/ack", "/storage-pd/lookup", "/healthz"] {
        assert!(md.contains(route), "the HTTP reference has no {route}");
    }
    check_generated("docs/http-reference.md", &md);
}

/// The code blocks of a chapter that follow a `<!-- tests/tests/docs.rs runs
/// the next block … -->` marker.
fn tested_blocks(chapter: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = chapter.lines();
    while let Some(line) = lines.next() {
        if !line.starts_with("<!-- tests/tests/docs.rs runs the next block") {
            continue;
        }
        let fence = lines.next().expect("a code block after the marker");
        assert!(fence.starts_with("```"), "the marker is followed by {fence:?}, not a code block");
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        blocks.push(body.join("\n"));
    }
    blocks
}

#[test]
fn getting_started_runs_as_written() {
    let chapter = read("docs/getting-started.md");
    let blocks = tested_blocks(&chapter);
    assert_eq!(blocks.len(), 1, "docs/getting-started.md should mark its first handoff for this test");
    if !is_root() {
        skip("getting_started_runs_as_written", "the chapter runs as root (serve --provenance attaches the probes)");
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a scratch directory");
    let bin_dir = pdstor_bin().parent().expect("the binary's folder").to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    // However the block ends, the daemon it started in the background goes
    // with it (it would hold the output pipes open).
    let script = format!("set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{}\n", blocks[0]);
    let out = Command::new("timeout")
        .args(["120", "bash", "-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        .env_remove("PDSTOR_SERVER")
        .env_remove("PDSTOR_DATA_SOCKET")
        .output()
        .expect("running bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(dir.path().join("first-handoff/serve.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "the getting-started block failed ({}):\n{stdout}\n{stderr}\nserve.log:\n{log}",
        out.status
    );
    assert!(stdout.contains("restored byte for byte"), "no byte-for-byte restore: {stdout}");
    assert!(
        stdout.contains("ok (every payload on host_fixed, native)"),
        "the timeline check did not say what the chapter says it prints: {stdout}"
    );
    assert!(dir.path().join("first-handoff/timeline.svg").exists(), "no timeline.svg drawn");
}
