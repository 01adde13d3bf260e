//! What several verbs share: the daemon's addresses, a client's buffer, the
//! parsers for fixed value sets, and reading the JSON files verbs take.

use std::path::{Path, PathBuf};

use pdstor_engine::io::PayloadPath;

/// The payload paths, as `--path` takes them.
pub const PATHS: &[&str] = &["host", "host_fixed", "dmabuf_fixed"];
/// Publication states, as `--state` takes them.
pub const STATES: &[&str] = &["PREPARED", "READY", "CLAIMED", "ADOPTED", "RETAINED", "ABORTING"];

/// A parser that accepts exactly `values` (listed in `--help` and in the
/// error for anything else) and turns the one given into a `T`.
pub fn one_of<T>(values: &'static [&'static str]) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(values).try_map(|s| s.parse::<T>())
}

// The control plane, for verbs that only talk to it.
#[derive(clap::Args, Clone)]
pub struct Server {
    /// The daemon's control plane (`pdstor serve --listen`): `unix:/path/control.sock`, or
    /// `http://host:port` for a daemon serving plaintext TCP.
    #[arg(long, env = "PDSTOR_SERVER", default_value_t = pdstor_daemon::api::hygiene::default_server())]
    pub server: String,
}

// Both planes, for verbs that move payload.
#[derive(clap::Args, Clone)]
pub struct Daemon {
    /// The daemon's control plane (`pdstor serve --listen`): `unix:/path/control.sock`, or
    /// `http://host:port` for a daemon serving plaintext TCP.
    #[arg(long, env = "PDSTOR_SERVER", default_value_t = pdstor_daemon::api::hygiene::default_server())]
    pub server: String,
    /// The daemon's data-plane Unix socket (`pdstor serve --data-socket`): buffers are shared over
    /// it, only with a daemon running as root or as this user (or as PDSTOR_DAEMON_UID).
    #[arg(long, env = "PDSTOR_DATA_SOCKET", default_value_os_t = pdstor_daemon::api::hygiene::default_data_socket())]
    pub data_socket: PathBuf,
}

// A client's buffer: whose memory, and the path the daemon moves it on.
#[derive(clap::Args, Clone, Copy)]
pub struct BufferArgs {
    /// Buffer memory: memfd, udmabuf (a DMA-BUF from /dev/udmabuf) or dma-heap (/dev/dma_heap/system).
    #[arg(long = "buffer", default_value = "memfd", value_parser = one_of::<pdstor_client::Exporter>(&["memfd", "udmabuf", "dma-heap"]))]
    pub exporter: pdstor_client::Exporter,
    /// Payload path: dmabuf_fixed needs a DMA-BUF buffer, a raw block device target and a kernel
    /// with the rw-dmabuf series.
    #[arg(long, default_value = "host_fixed", value_parser = one_of::<PayloadPath>(PATHS))]
    pub path: PayloadPath,
}

impl BufferArgs {
    /// The buffer the client library makes for these options.
    pub fn spec(self) -> pdstor_client::BufferSpec {
        pdstor_client::BufferSpec { exporter: self.exporter, path: self.path }
    }
}

/// Reads `path` as the JSON of a `T`, naming `what` it should be on failure.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> anyhow::Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {what} {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{what} {} is not valid: {e}", path.display()))
}

/// Refuses to let a raw-writing command destroy a filesystem or namespace.
pub fn refuse_signature(target: &Path, force: bool) -> anyhow::Result<()> {
    if force || !target.exists() {
        return Ok(());
    }
    if let Some(sig) = pdstor_daemon::store::signature_of(target)? {
        anyhow::bail!(
            "target {} holds {sig}; this command overwrites it: pass --force if that is what you want",
            target.display()
        );
    }
    Ok(())
}

/// Prints `v` as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(v: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// Prints `r` as one JSON line with `--json`, else as `human` writes it.
pub fn print_report<T: serde::Serialize>(json: bool, r: &T, human: impl FnOnce(&T)) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        human(r);
    }
    Ok(())
}
