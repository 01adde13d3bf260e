//! `pdstor handoff`: the whole writer → reader handoff as an operator would run
//! it, with the writer and the reader as separate `pdstor` processes talking to
//! a running daemon; then the restored bytes are compared with the original.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

/// What `pdstor handoff` was asked to do.
pub struct HandoffArgs {
    pub server: String,
    pub data_socket: PathBuf,
    pub bytes: u64,
    pub chunk_size: u64,
    pub buffer: pdstor::client::BufferSpec,
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

pub fn run(a: &HandoffArgs) -> anyhow::Result<()> {
    let (bytes, chunk_size, buffer) = (a.bytes, a.chunk_size, a.buffer);
    let (exporter, on_path) = (buffer.exporter.to_string(), buffer.path.to_string());
    let buffer_args = ["--buffer", exporter.as_str(), "--path", on_path.as_str()];
    if bytes == 0 || !bytes.is_multiple_of(4096) || !chunk_size.is_multiple_of(4096) {
        bail!("--bytes and --chunk-size must be positive multiples of 4096");
    }
    let dir = std::env::temp_dir().join(format!("pdstor-handoff-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = |name: &str| dir.join(name);
    let payload: Vec<u8> = (0..bytes.div_ceil(chunk_size))
        .flat_map(|i| pdstor::payload::chunk(0x4b56, i, chunk_size as usize))
        .take(bytes as usize)
        .collect();
    std::fs::write(path("kv.bin"), &payload)?;
    let layout = serde_json::json!({
        "model_id": "handoff-demo", "dtype": "bf16", "layers": 32, "kv_heads": 8,
        "head_dim": 128, "chunk_tokens": 256, "kv_format": "pdstor-demo"
    });
    std::fs::write(path("layout.json"), serde_json::to_vec_pretty(&layout)?)?;
    let s = |p: &str| path(p).to_string_lossy().into_owned();
    let req = format!("handoff-{}", std::process::id());
    let cs = chunk_size.to_string();

    let t = Instant::now();
    let (ready, put_log) = pdstor(
        &[
            "put",
            "--req",
            &req,
            "--writer",
            "prefill-0",
            "--layout",
            &s("layout.json"),
            "--from",
            &s("kv.bin"),
            "--chunk-size",
            &cs,
            "--first-token",
            "42",
            buffer_args[0],
            buffer_args[1],
            buffer_args[2],
            buffer_args[3],
        ],
        a,
        true,
    )?;
    let put_s = t.elapsed().as_secs_f64();
    std::fs::write(path("ready.json"), &ready)?;
    let store_s = put_seconds(&put_log).unwrap_or(put_s);
    println!(
        "writer: prepare → {} chunks stored from a {exporter} buffer on {on_path} → published READY in {store_s:.3} s ({:.0} MiB/s; the writer process took {put_s:.3} s with reading its input file)",
        bytes.div_ceil(chunk_size),
        bytes as f64 / 1048576.0 / store_s
    );

    let (claim, _) =
        pdstor(&["claim", "--receipt", &s("ready.json"), "--reader", "decode-0", "--session", &req], a, false)?;
    std::fs::write(path("claim.json"), &claim)?;
    println!("reader: claimed for decode-0 / session {req}");

    let t = Instant::now();
    let (got, _) = pdstor(
        &[
            "get",
            "--claim",
            &s("claim.json"),
            "--layout",
            &s("layout.json"),
            "--out",
            &s("restored.bin"),
            "--ack",
            buffer_args[0],
            buffer_args[1],
            buffer_args[2],
            buffer_args[3],
        ],
        a,
        true,
    )?;
    let get_s = t.elapsed().as_secs_f64();
    let summary: serde_json::Value = serde_json::from_str(&got).context("parsing pdstor get output")?;
    let restore_s = summary["restore_seconds"].as_f64().unwrap_or(get_s);
    println!(
        "reader: adopted, loaded and verified every chunk's crc32c in {restore_s:.3} s ({:.0} MiB/s), acked; first token {} (the reader process took {get_s:.3} s with writing its output file)",
        bytes as f64 / 1048576.0 / restore_s,
        summary["first_token"]
    );

    let restored = std::fs::read(path("restored.bin"))?;
    if let Some(at) = pdstor::payload::first_difference(&payload, &restored) {
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
        buffer: exporter.clone(),
        path: on_path.clone(),
        publication: ready["publication"].as_u64().unwrap_or_default(),
        writer_seconds: store_s,
        writer_mib_per_s: bytes as f64 / 1048576.0 / store_s,
        reader_seconds: restore_s,
        reader_mib_per_s: bytes as f64 / 1048576.0 / restore_s,
        restore_digest: summary["restore_digest"].as_str().unwrap_or_default().to_owned(),
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
