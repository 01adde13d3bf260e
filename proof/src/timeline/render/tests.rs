//! The picture of a clean handoff and of planted fallbacks, as SVG text.

use super::*;
use crate::timeline::mutate;

#[test]
fn rows_bars_markers_arrows_and_failures_are_drawn() {
    let mut t = mutate::example();
    let mut refused = Event::new("refused").detail("duplicate_ack <&>");
    refused.node = "daemon-e1".into();
    refused.publication = Some(7);
    refused.ts_ns = 100_000;
    t.push(refused);
    let svg = render(&t, "t & t");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains(">publication 7 (r1)<"), "one row per publication");
    assert!(svg.contains(">daemon-e1<") && svg.contains(">reader-1<"), "the nodes are named");
    assert_eq!(svg.matches(&format!("fill=\"{HOST_FIXED_BLUE}\" stroke=")).count(), 4, "four native host_fixed bars");
    assert_eq!(
        svg.matches("marker-end=\"url(#arrow)\"").count(),
        3 + 1,
        "publish → claim → adopt → ack, and the legend's"
    );
    assert!(svg.contains("duplicate_ack &lt;&amp;&gt;") && svg.contains("t &amp; t"), "text is escaped");
    assert!(!svg.contains("Some("), "tooltips carry plain values");
    assert!(svg.contains("verdict: native") && svg.contains("crc32c: 0x11111111"));
}

#[test]
fn a_fallback_and_a_host_chunk_are_flagged() {
    let mut t = mutate::example();
    t[2].verdict = Some("fallback(page-cache)".into());
    t[9].path = Some("host".into());
    let svg = render(&t, "planted");
    assert!(svg.contains(&format!("fill=\"{FALLBACK_RED}\" stroke=\"#000000\"")), "the fallback bar is red");
    assert!(svg.contains("⚠ chunk 0 store: fallback(page-cache)"));
    assert!(svg.contains("⚠ chunk 1 load: host (a copy)"));
    assert!(svg.contains("2 chunks flagged"));
}

#[test]
fn a_long_quiet_stretch_is_compressed_and_marked() {
    let mut t = mutate::example();
    for e in t.iter_mut().skip(6) {
        e.ts_ns += 5_000_000_000; // five seconds between publish and claim
    }
    let svg = render(&t, "gap");
    assert!(svg.contains("1 quiet stretches compressed"), "{svg}");
    assert!(svg.contains(" for 5.00 s<"), "the row says when it starts and how long it lasts");
    assert!(svg.contains("≈5.00 s"));
    let axis = Axis::new(&t);
    assert_eq!(axis.breaks.len(), 1);
    // The handoff's own steps keep their width: the claim is not crushed
    // against the publish, nor the ack against the adopt.
    assert!(axis.x(t[7].ts_ns) - axis.x(t[6].ts_ns) > 20.0);
    assert!(axis.x(t[6].ts_ns) - axis.x(t[4].ts_ns) < BREAK_W + 200.0);
}
