//! `pdstor handoff`: the whole writer → reader handoff as an operator would run
//! it, with the writer and the reader as separate `pdstor` processes talking to
//! a running daemon; then the restored bytes are compared with the original.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

/// What `pdstor handoff` was asked to do.
pub struct HandoffArgs {
    pub server: String,
    pub data_socket: PathBuf,
    pub bytes: u64,
    pub chunk_size: u64,
    pub buffer: pdstor_client::BufferSpec,
    /// The writer's and the reader's steps go to this timeline.
    pub timeline: Option<PathBuf>,
    /// The handoff's figures go to this JSON file.
    pub summary: Option<PathBuf>,
}

/// What one handoff moved, how fast, and how it was verified.
#[derive(Debug, serde::Serialize)]
pub struct HandoffSummary {
    pub bytes: u64,
    pub chunks: u64,
    pub chunk_size: u64,
    pub buffer: String,
    pub path: String,
    pub publication: u64,
    /// The writer's prepare + store + publish.
    pub writer_seconds: f64,
    pub writer_mib_per_s: f64,
    /// The reader's adopt + load + verify.
    pub reader_seconds: f64,
    pub reader_mib_per_s: f64,
    pub restore_digest: String,
    /// Every chunk's crc32c checked by the daemon on load and by the reader from its own mapping.
    pub crc32c_verified_chunks: u64,
    /// The restored file compared with the original by this process, outside the daemon.
    pub bytes_identical: bool,
}

/// Runs a client verb; returns its stdout and stderr. `data` says whether the
/// verb uses the data plane (and so takes `--data-socket`).
fn pdstor(args: &[&str], a: &HandoffArgs, data: bool) -> anyhow::Result<(String, String)> {
    let exe = std::env::current_exe().context("locating the pdstor binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args).arg("--server").arg(&a.server);
    if data {
        cmd.arg("--data-socket").arg(&a.data_socket);
    }
    if let (true, Some(t)) = (data, &a.timeline) {
        cmd.arg("--timeline").arg(t);
    }
    let out = cmd.output().with_context(|| format!("running pdstor {}", args.first().unwrap_or(&"")))?;
    if !out.status.success() {
        bail!("pdstor {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// The seconds `pdstor put` reports for storing and publishing, from its stderr.
fn put_seconds(stderr: &str) -> Option<f64> {
    stderr.lines().find_map(|l| l.strip_prefix("pdstor put: ")?.rsplit(" in ").next()?.strip_suffix(" s")?.parse().ok())
}

/// The `--buffer` and `--path` options the writer and the reader are given.
fn buffer_args(a: &HandoffArgs) -> [String; 4] {
    ["--buffer".into(), a.buffer.exporter.to_string(), "--path".into(), a.buffer.path.to_string()]
}

/// Writes the payload (seeded chunks) and its layout under `dir`; returns the payload.
fn write_inputs(dir: &Path, a: &HandoffArgs) -> anyhow::Result<Vec<u8>> {
    let payload: Vec<u8> = (0..a.bytes.div_ceil(a.chunk_size))
        .flat_map(|i| pdstor_engine::payload::chunk(0x4b56, i, a.chunk_size as usize))
        .take(a.bytes as usize)
        .collect();
    pdstor_client::private::write(&dir.join("kv.bin"), &payload)?;
    let layout = serde_json::json!({
        "model_id": "handoff-demo", "dtype": "bf16", "layers": 32, "kv_heads": 8,
        "head_dim": 128, "chunk_tokens": 256, "kv_format": "pdstor-demo"
    });
    std::fs::write(dir.join("layout.json"), serde_json::to_vec_pretty(&layout)?)?;
    Ok(payload)
}

/// The writer process: `pdstor put`; returns its READY receipt (JSON) and the
/// seconds it took to store and publish.
fn writer(a: &HandoffArgs, dir: &Path, req: &str) -> anyhow::Result<(String, f64)> {
    let s = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let (layout, from, cs) = (s("layout.json"), s("kv.bin"), a.chunk_size.to_string());
    let mut args = vec!["put", "--req", req, "--writer", "prefill-0", "--layout", &layout, "--from", &from];
    args.extend(["--chunk-size", &cs, "--first-token", "42"]);
    let buffer = buffer_args(a);
    args.extend(buffer.iter().map(String::as_str));
    let t = Instant::now();
    let (ready, put_log) = pdstor(&args, a, true)?;
    let put_s = t.elapsed().as_secs_f64();
    pdstor_client::private::write(&dir.join("ready.json"), &ready)?;
    let store_s = put_seconds(&put_log).unwrap_or(put_s);
    println!(
        "writer: prepare → {} chunks stored from a {} buffer on {} → published READY in {store_s:.3} s ({:.0} MiB/s; the writer process took {put_s:.3} s with reading its input file)",
        a.bytes.div_ceil(a.chunk_size),
        a.buffer.exporter,
        a.buffer.path,
        a.bytes as f64 / 1048576.0 / store_s
    );
    Ok((ready, store_s))
}

/// The reader process: `pdstor claim`, then `pdstor get --ack`; returns
/// what `get` printed and the seconds the restore took.
fn reader(a: &HandoffArgs, dir: &Path, req: &str) -> anyhow::Result<(serde_json::Value, f64)> {
    let s = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let (claim, _) =
        pdstor(&["claim", "--receipt", &s("ready.json"), "--reader", "decode-0", "--session", req], a, false)?;
    pdstor_client::private::write(&dir.join("claim.json"), &claim)?;
    println!("reader: claimed for decode-0 / session {req}");
    let (claim, layout, out) = (s("claim.json"), s("layout.json"), s("restored.bin"));
    let mut args = vec!["get", "--claim", &claim, "--layout", &layout, "--out", &out, "--ack"];
    let buffer = buffer_args(a);
    args.extend(buffer.iter().map(String::as_str));
    let t = Instant::now();
    let (got, _) = pdstor(&args, a, true)?;
    let get_s = t.elapsed().as_secs_f64();
    let summary: serde_json::Value = serde_json::from_str(&got).context("parsing pdstor get output")?;
    let restore_s = summary["restore_seconds"].as_f64().unwrap_or(get_s);
    println!(
        "reader: adopted, loaded and verified every chunk's crc32c in {restore_s:.3} s ({:.0} MiB/s), acked; first token {} (the reader process took {get_s:.3} s with writing its output file)",
        a.bytes as f64 / 1048576.0 / restore_s,
        summary["first_token"]
    );
    Ok((summary, restore_s))
}

/// Hands `a.bytes` from a writer process to a reader process through the
/// daemon, then compares the restored file with the original.
pub fn run(a: &HandoffArgs) -> anyhow::Result<()> {
    let (bytes, chunk_size) = (a.bytes, a.chunk_size);
    if bytes == 0 || !bytes.is_multiple_of(4096) || !chunk_size.is_multiple_of(4096) {
        bail!("--bytes and --chunk-size must be positive multiples of 4096");
    }
    let dir = std::env::temp_dir().join(format!("pdstor-handoff-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let payload = write_inputs(&dir, a)?;
    let req = format!("handoff-{}", std::process::id());
    let (ready, store_s) = writer(a, &dir, &req)?;
    let (got, restore_s) = reader(a, &dir, &req)?;

    let restored = std::fs::read(dir.join("restored.bin"))?;
    if let Some(at) = pdstor_engine::payload::first_difference(&payload, &restored) {
        bail!("the restored bytes differ from the stored ones at byte {at}");
    }
    println!("handoff: {} bytes restored byte for byte (compared outside the daemon)", restored.len());
    std::fs::remove_dir_all(&dir).ok();

    let ready: serde_json::Value = serde_json::from_str(&ready).context("parsing pdstor put's receipt")?;
    let chunks = bytes.div_ceil(chunk_size);
    let summary = HandoffSummary {
        bytes,
        chunks,
        chunk_size,
        buffer: a.buffer.exporter.to_string(),
        path: a.buffer.path.to_string(),
        publication: ready["publication"].as_u64().unwrap_or_default(),
        writer_seconds: store_s,
        writer_mib_per_s: bytes as f64 / 1048576.0 / store_s,
        reader_seconds: restore_s,
        reader_mib_per_s: bytes as f64 / 1048576.0 / restore_s,
        restore_digest: got["restore_digest"].as_str().unwrap_or_default().to_owned(),
        crc32c_verified_chunks: chunks,
        bytes_identical: true,
    };
    if let Some(file) = &a.summary {
        std::fs::write(file, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("writing the summary {}", file.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_put_timing_line_is_parsed() {
        let log = "something\npdstor put: 4096 bytes in 1 chunks stored and published in 0.125 s\n";
        assert_eq!(super::put_seconds(log), Some(0.125));
        assert_eq!(super::put_seconds("pdstor: error: nope"), None);
    }
}
