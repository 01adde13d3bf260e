//! The control plane's OpenAPI document and the router agree: every route
//! the daemon serves is in the document, and every route the document names
//! is served, by the real daemon over its real Unix socket.

use std::collections::BTreeSet;
use std::path::Path;

use pdstor_daemon::api::openapi::{ROUTES, document_text};
use pdstor_tests::Daemon;

/// One HTTP/1.1 exchange; the status and the body.
fn exchange(socket: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    pdstor_tests::http_exchange(socket, method, path, body)
}

/// `(method, path)` of every `.route("…", get(…)|post(…))` in the router's source.
fn routed() -> BTreeSet<(String, String)> {
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../driver/src/api/http.rs")).unwrap();
    let mut out = BTreeSet::new();
    for piece in src.split(".route(").skip(1) {
        let piece = piece.trim_start();
        let Some(rest) = piece.strip_prefix('"') else { panic!("a route whose path is not a literal: {piece:.80}") };
        let (path, rest) = rest.split_once('"').unwrap();
        let rest = rest.trim_start().trim_start_matches(',').trim_start();
        let method = ["get", "post"]
            .into_iter()
            .find(|m| rest.starts_with(&format!("{m}(")))
            .unwrap_or_else(|| panic!("route {path}: a method other than get( or post(: {rest:.60}"));
        out.insert((method.to_owned(), path.to_owned()));
    }
    out
}

#[test]
fn every_route_the_router_builds_is_in_the_document() {
    let routed = routed();
    let documented: BTreeSet<(String, String)> =
        ROUTES.iter().map(|r| (r.method.as_str().to_owned(), r.path.to_owned())).collect();
    assert!(routed.len() >= 18, "the router's routes were not found: {routed:?}");
    assert_eq!(routed, documented, "the router (left) and openapi::ROUTES (right) differ");
}

#[test]
fn every_documented_route_is_served_and_no_other() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let d = Daemon::format_and_start(dir.path(), 8, 1 << 20);
    let socket = d.control_socket();
    let (status, served) = exchange(&socket, "GET", "/openapi.json", None);
    assert_eq!(status, 200);
    assert_eq!(served, document_text(), "the daemon serves the generated document");
    let doc: serde_json::Value = serde_json::from_str(&served).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let mut operations = 0;
    for (path, item) in paths {
        for method in item.as_object().unwrap().keys() {
            operations += 1;
            let (status, body) = match method.as_str() {
                // An empty body is malformed for every step: refused before it
                // reaches the protocol, so the probe changes nothing.
                "post" => exchange(&socket, "POST", path, Some("{}")),
                "get" => exchange(&socket, "GET", path, None),
                other => panic!("{path}: method {other} is neither get nor post"),
            };
            // A takeover is a standby's: an owner refuses it whatever it is sent.
            let expected = match (method.as_str(), path.as_str()) {
                ("post", "/storage-pd/admin/takeover") => 409,
                ("post", _) => 400,
                _ => 200,
            };
            assert_eq!(status, expected, "{} {path} answered {status}: {body}", method.to_uppercase());
            let documented = item[method]["responses"].as_object().unwrap();
            assert!(documented.contains_key(&status.to_string()), "{path} answered {status}, not in its document");
            // The other method is not served.
            let wrong = if method == "post" { "GET" } else { "POST" };
            if !item.as_object().unwrap().contains_key(&wrong.to_lowercase()) {
                let (status, _) = exchange(&socket, wrong, path, None);
                assert_eq!(status, 405, "{wrong} {path}");
            }
        }
    }
    assert_eq!(operations, ROUTES.len());
    for path in ["/storage-pd/claims", "/storage-pd", "/admin", "/openapi.yaml"] {
        assert_eq!(exchange(&socket, "GET", path, None).0, 404, "{path} is served but not documented");
    }
}
