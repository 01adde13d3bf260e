//! `pdstor handoff`: the whole writer → reader handoff as an operator would run
//! it, with the writer and the reader as separate `pdstor` processes talking to
//! a running daemon; then the restored bytes are compared with the original.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};

/// Runs a client verb; returns its stdout and stderr.
fn pdstor(args: &[&str], server: &str, data_socket: &Path) -> anyhow::Result<(String, String)> {
    let exe = std::env::current_exe().context("locating the pdstor binary")?;
    let out = Command::new(exe)
        .args(args)
        .arg("--server")
        .arg(server)
        .arg("--data-socket")
        .arg(data_socket)
        .output()
        .with_context(|| format!("running pdstor {}", args.first().unwrap_or(&"")))?;
    if !out.status.success() {
        bail!("pdstor {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok((String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// The seconds `pdstor put` reports for storing and publishing, from its stderr.
fn put_seconds(stderr: &str) -> Option<f64> {
    stderr.lines().find_map(|l| l.strip_prefix("pdstor put: ")?.rsplit(" in ").next()?.strip_suffix(" s")?.parse().ok())
}

pub fn run(
    server: &str,
    data_socket: &Path,
    bytes: u64,
    chunk_size: u64,
    buffer: pdstor::client::BufferSpec,
) -> anyhow::Result<()> {
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
        server,
        data_socket,
    )?;
    let put_s = t.elapsed().as_secs_f64();
    std::fs::write(path("ready.json"), &ready)?;
    let store_s = put_seconds(&put_log).unwrap_or(put_s);
    println!(
        "writer: prepare → {} chunks stored from a {exporter} buffer on {on_path} → published READY in {store_s:.3} s ({:.0} MiB/s; the writer process took {put_s:.3} s with reading its input file)",
        bytes.div_ceil(chunk_size),
        bytes as f64 / 1048576.0 / store_s
    );

    let (claim, _) = pdstor(
        &["claim", "--receipt", &s("ready.json"), "--reader", "decode-0", "--session", &req],
        server,
        data_socket,
    )?;
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
        server,
        data_socket,
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
