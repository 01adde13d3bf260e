//! `oracle`: the model-oracle profile (`pdstor qualify --short`) inside the
//! guest on the raw NVMe namespace through passthrough (`/dev/ngXnY`,
//! `host_fixed`): a deterministic model's KV cache stored by the writer,
//! restored by a reader process, continuations identical to the no-cache
//! oracle within the log-probability tolerance, every fault control passing,
//! and the run's timeline passing `pdstor timeline check --require-path
//! host_fixed` with the probes' native verdicts (kprobes attach here).

use std::path::Path;

use super::{Checked, Suite, Test, skip};
use crate::machine::{Ctx, sh};
use pdstor_vmtest_spec::DiskRole;

pub const SUITE: Suite = Suite {
    name: "oracle",
    tests: &[
        Test { name: "qualify_on_nvme_passthrough", disk: Some(DiskRole::Raw), run: qualify },
        Test { name: "qualify_dmabuf_fixed_on_raw_block", disk: Some(DiskRole::Raw), run: qualify_dmabuf_fixed },
    ],
};

/// `pdstor qualify --short --chunk-tokens 8 <args> --out <out>`, run to its
/// end: its report, or why it failed (with its qualify.md).
fn run_qualify(args: &[&str], out: &Path) -> Checked<serde_json::Value> {
    let run = std::process::Command::new("/bin/pdstor")
        .args(["qualify", "--short", "--chunk-tokens", "8"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .map_err(|e| format!("running pdstor qualify: {e}"))?;
    let report: serde_json::Value = std::fs::read(out.join("qualify.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| format!("no qualify.json: {}", String::from_utf8_lossy(&run.stderr)))?;
    if !run.status.success() || report["ok"] != true {
        let md = std::fs::read_to_string(out.join("qualify.md")).unwrap_or_default();
        return Err(format!(
            "pdstor qualify {args:?} failed ({:?}):\n{md}{}",
            run.status.code(),
            violating_lines(&report, &out.join("timeline.jsonl"))
        )
        .into());
    }
    Ok(report)
}

/// The timeline lines the report's violations name (the first ten, with
/// the line before each), so that a failure in CI shows what happened
/// without the guest's files.
fn violating_lines(report: &serde_json::Value, timeline: &Path) -> String {
    let Some(violations) = report["timeline"]["violations"].as_array().filter(|v| !v.is_empty()) else {
        return String::new();
    };
    let text = std::fs::read_to_string(timeline).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let mut shown = std::collections::BTreeSet::new();
    for v in violations.iter().take(10) {
        if let Some(n) = v["line"].as_u64().map(|n| n as usize).filter(|n| *n >= 1) {
            shown.extend([n.saturating_sub(1).max(1), n]);
        }
    }
    let mut s = format!("\ntimeline lines around the first {} violations:\n", violations.len().min(10));
    for n in shown {
        if let Some(l) = lines.get(n - 1) {
            s += &format!("{n}: {l}\n");
        }
    }
    s
}

fn qualify(ctx: &Ctx) -> Checked {
    let disk = ctx.disk(DiskRole::Raw)?;
    let out = Path::new("/tmp/vmtest/qualify");
    let (generic, block) = (disk.generic.to_string_lossy(), disk.block.to_string_lossy());
    let report = run_qualify(&["--target", &generic, "--corrupt-via", &block], out)?;
    let cases = report["cases"].as_array().map_or(0, Vec::len);
    let controls = report["controls"].as_array().map_or(0, Vec::len);
    if cases != 3 || controls != 7 {
        return Err(format!("expected 3 cases and 7 controls, got {cases} and {controls}").into());
    }
    // The checker, run on its own, agrees; and the default requirement
    // (dmabuf_fixed) rejects this host_fixed run.
    let timeline = out.join("timeline.jsonl").to_string_lossy().into_owned();
    sh("/bin/pdstor", &["timeline", "check", &timeline, "--require-path", "host_fixed"])?;
    if sh("/bin/pdstor", &["timeline", "check", &timeline]).is_ok() {
        return Err("the timeline passed the default dmabuf_fixed requirement".into());
    }
    let svg = std::fs::read_to_string(out.join("timeline.svg")).map_err(|e| format!("timeline.svg: {e}"))?;
    if !svg.contains("<svg") || !svg.contains(">daemon-e") {
        return Err("timeline.svg is not a rendered timeline".into());
    }
    Ok(())
}

/// The series kernel: the same profile with every payload on `dmabuf_fixed`
/// (udmabuf buffers on the raw namespace), and its timeline passing the
/// checker's default requirement, `dmabuf_fixed`.
fn qualify_dmabuf_fixed(ctx: &Ctx) -> Checked {
    if !crate::machine::expects_rw_dmabuf() {
        return Err(skip("Debian's kernel has no rw-dmabuf series (vmtest --kernel-series runs this)"));
    }
    let disk = ctx.disk(DiskRole::Raw)?;
    let out = Path::new("/tmp/vmtest/qualify-dmabuf");
    let block = disk.block.to_string_lossy();
    run_qualify(&["--path", "dmabuf_fixed", "--target", &block, "--corrupt-via", &block], out)?;
    let timeline = out.join("timeline.jsonl").to_string_lossy().into_owned();
    // The default requirement is dmabuf_fixed, native.
    sh("/bin/pdstor", &["timeline", "check", &timeline])?;
    if sh("/bin/pdstor", &["timeline", "check", &timeline, "--require-path", "host_fixed"]).is_ok() {
        return Err("a dmabuf_fixed timeline passed --require-path host_fixed".into());
    }
    // Every causal lie told about it is caught.
    sh("/bin/pdstor", &["timeline", "mutate", &timeline])?;
    Ok(())
}
