//! The rendered timeline, looked at in a real browser: a planted fallback
//! chunk and a planted `host` chunk must be visible at the picture's default
//! size (Chromium, headless, screenshot at the SVG's own width), and a clean
//! handoff must show neither colour below the legend.

use std::path::Path;
use std::process::Command;

use pdstor_proof::timeline::mutate;
use pdstor_proof::timeline::render::{FALLBACK_RED, HEADER, HOST_ORANGE, render};
use pdstor_testkit::skip;

fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|b| Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()))
}

fn rgb(hex: &str) -> [u8; 3] {
    let v = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

/// Screenshots `svg` at its own size; returns (width, height, RGB pixels).
fn screenshot(browser: &str, dir: &Path, name: &str, svg: &str) -> (u32, u32, Vec<u8>) {
    let height: u32 = svg.split("height=\"").nth(1).unwrap().split('"').next().unwrap().parse().unwrap();
    let file = dir.join(format!("{name}.svg"));
    std::fs::write(&file, svg).unwrap();
    let png = dir.join(format!("{name}.png"));
    let out = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1"])
        .arg(format!("--user-data-dir={}", dir.join(format!("{name}-profile")).display()))
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("--window-size=1600,{height}"))
        .arg(format!("file://{}", file.display()))
        .output()
        .unwrap();
    assert!(png.exists(), "{browser} wrote no screenshot: {}", String::from_utf8_lossy(&out.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&png).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("a screenshot in {other:?}, not RGB(A)"),
    };
    buf.truncate(info.buffer_size());
    // As RGB, whatever the browser wrote.
    let rgb: Vec<u8> = buf.chunks(channels).flat_map(|p| [p[0], p[1], p[2]]).collect();
    (info.width, info.height, rgb)
}

/// Pixels of `colour` (within a small tolerance) below the legend.
fn count(shot: &(u32, u32, Vec<u8>), colour: &str) -> usize {
    let (w, h, px) = shot;
    let want = rgb(colour);
    let near = |p: &[u8]| p.iter().zip(want).all(|(a, b)| a.abs_diff(b) <= 12);
    (HEADER as u32..*h)
        .flat_map(|y| (0..*w).map(move |x| ((y * w + x) * 3) as usize))
        .filter(|&i| near(&px[i..i + 3]))
        .count()
}

#[test]
fn a_planted_fallback_and_host_chunk_are_visible_in_the_browser() {
    let Some(browser) = chromium() else {
        return skip(
            "a_planted_fallback_and_host_chunk_are_visible_in_the_browser",
            "no Chromium here (cargo xtask deps installs Debian's chromium)",
        );
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let clean = screenshot(browser, dir.path(), "clean", &render(&mutate::example(), "clean"));
    let mut planted = mutate::example();
    planted[2].verdict = Some("fallback(page-cache)".into()); // chunk 0's store
    planted[9].path = Some("host".into()); // chunk 1's load
    let planted = screenshot(browser, dir.path(), "planted", &render(&planted, "planted"));
    assert_eq!(clean.0, 1600, "drawn at the SVG's own width");
    assert_eq!(count(&clean, FALLBACK_RED), 0, "a clean handoff shows no fallback red");
    assert_eq!(count(&clean, HOST_ORANGE), 0, "a clean handoff shows no host orange");
    let (red, orange) = (count(&planted, FALLBACK_RED), count(&planted, HOST_ORANGE));
    eprintln!("planted: {red} red px, {orange} orange px below the legend");
    assert!(red >= 60, "the planted fallback chunk is visible in red at default size ({red} px)");
    assert!(orange >= 60, "the planted host chunk is visible in orange at default size ({orange} px)");
}
