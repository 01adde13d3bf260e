//! `pdstor serve`: the daemon.

use std::path::PathBuf;
use std::time::Duration;

use pdstor_daemon::units::parse_size;

// What one client may hold or take (see `pdstor_daemon::api::Limits`).
#[derive(clap::Args, Clone, Copy)]
pub struct LimitArgs {
    /// Largest control-plane request body; a larger one is 413.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    max_body: u64,
    /// Longest wait for a request body once its headers arrived, in ms (then 408).
    #[arg(long, default_value_t = 10_000)]
    body_timeout_ms: u64,
    /// Longest wait for a request's headers, and for the next request on an idle connection, in ms.
    #[arg(long, default_value_t = 10_000)]
    header_timeout_ms: u64,
    /// Control-plane connections open at once; the next is answered 503 and closed.
    #[arg(long, default_value_t = 512)]
    max_http_connections: usize,
    /// Prepares handled or waiting for capacity at once; the next is 503 too_many_prepares.
    #[arg(long, default_value_t = 64)]
    max_prepares: usize,
    /// Data-plane connections open at once; the next is answered 503 and closed.
    #[arg(long, default_value_t = 256)]
    max_data_connections: usize,
    /// A data-plane connection holding no registered buffer is closed after this long (ms)
    /// without a request (one holding buffers may stay idle: tenants' shares bound those).
    #[arg(long, default_value_t = 10_000)]
    data_idle_timeout_ms: u64,
    /// Buffers one data-plane connection may register.
    #[arg(long, default_value_t = 16)]
    max_buffers_per_connection: usize,
    /// Buffer bytes one data-plane connection may have the daemon map.
    #[arg(long, default_value = "16G", value_parser = parse_size)]
    max_pinned_per_connection: u64,
    /// A PREPARED publication that sees no store batch for this long (ms) is aborted.
    #[arg(long, default_value_t = 120_000)]
    prepare_idle_timeout_ms: u64,
    /// A PREPARED publication whose prepare's answer never reached its client (it went away
    /// while waiting) is aborted after this long (ms) unless a store batch comes.
    #[arg(long, default_value_t = 5_000)]
    prepare_orphan_grace_ms: u64,
    /// A READY publication no reader claims for this long (ms) is released unread (an exact
    /// unread release, an `expire` on the timeline); claimed ones are never freed by time.
    /// A writer may ask for its own window at prepare (`unread_release_ms`; the vLLM connector
    /// and the LMCache storage plugin ask for 480000, vLLM's own bound on a prefill's blocks no
    /// decode reads), and the config may give a tenant one (`unread_release_ms`): the shortest
    /// applies. 0 (the default): only those windows, every other publication kept until its
    /// writer or an operator releases it, as the LMCache L2 adapter's cache keys are.
    #[arg(long, default_value_t = 0)]
    unread_release_ms: u64,
}

impl LimitArgs {
    fn limits(self) -> pdstor_daemon::api::Limits {
        pdstor_daemon::api::Limits {
            max_body_bytes: self.max_body as usize,
            body_timeout: Duration::from_millis(self.body_timeout_ms),
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            max_http_connections: self.max_http_connections,
            max_prepares: self.max_prepares,
            max_data_connections: self.max_data_connections,
            data_idle_timeout: Duration::from_millis(self.data_idle_timeout_ms),
            max_buffers_per_connection: self.max_buffers_per_connection,
            max_pinned_bytes_per_connection: self.max_pinned_per_connection,
            prepare_idle_timeout: Duration::from_millis(self.prepare_idle_timeout_ms),
            orphan_grace: Duration::from_millis(self.prepare_orphan_grace_ms),
            unread_release: (self.unread_release_ms > 0).then(|| Duration::from_millis(self.unread_release_ms)),
        }
    }
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The formatted target to serve (`pdstor format`): a file, block device or /dev/ngXnY.
    #[arg(long)]
    target: PathBuf,
    /// Control plane: `unix:/path` (mode 0600, or 0660 for the config's socket group; a file
    /// there that is not a stale socket is refused, never replaced) or `host:port` (plaintext
    /// TCP: only with --insecure-tcp).
    #[arg(long, default_value_t = pdstor_daemon::api::Listen::Unix(pdstor_daemon::api::hygiene::default_control_socket()), conflicts_with = "listen_unix")]
    listen: pdstor_daemon::api::Listen,
    /// Serve the control plane in plaintext TCP (warned at every start): whoever reaches the
    /// address is taken to be the config's `plaintext` principal (without a config: this
    /// daemon's own user).
    #[arg(long)]
    insecure_tcp: bool,
    /// With a TCP --listen: serve mutual TLS with this certificate chain (PEM); clients must
    /// present a certificate --tls-client-ca signed, whose names the config maps to a tenant.
    #[arg(long, requires_all = ["tls_key", "tls_client_ca"])]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The CA (PEM) that signs client certificates.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// A certificate revocation list (PEM or DER) of a CA that signs clients; repeat it for
    /// each such CA. A revoked client is refused in the handshake, and so is one whose
    /// revocation status no list gives. Every TLS file and --config is read again on SIGHUP and
    /// when it changes: a new CRL shuts a stolen certificate out without a restart.
    #[arg(long, requires = "tls_cert")]
    tls_crl: Vec<PathBuf>,
    /// How often (ms) --config and the TLS files are checked for a change, which reloads them
    /// once the changed file has held still for one check; 0: only SIGHUP reloads them.
    #[arg(long, default_value_t = 1_000)]
    reload_check_ms: u64,
    /// The same as --listen unix:PATH.
    #[arg(long)]
    listen_unix: Option<PathBuf>,
    /// Who may do what: tenants, roles, quotas and the socket group (TOML; see docs/security.md).
    /// Without it, only this daemon's user and root are anyone.
    #[arg(long, env = "PDSTOR_CONFIG")]
    config: Option<PathBuf>,
    /// The data-plane Unix socket clients share their buffers over (mode 0600, or 0660 for the
    /// config's socket group, in a directory no other user can write; created 0750 if missing).
    #[arg(long, env = "PDSTOR_DATA_SOCKET", default_value_os_t = pdstor_daemon::api::hygiene::default_data_socket())]
    data_socket: PathBuf,
    /// Serve a target other users can read (its KV bytes and receipt key), warned at start.
    #[arg(long)]
    allow_readable_target: bool,
    /// io_uring queue depth of the store's I/O thread.
    #[arg(long, default_value_t = 32)]
    qd: u32,
    /// Chunks smaller than this that lie back to back on the target and in the client's buffer
    /// (16-64 KiB per-layer layouts) go to the device as one command of up to this many bytes,
    /// each still checksummed on its own; 0 sends every chunk alone. Off with --provenance
    /// (verdicts are per chunk).
    #[arg(long, default_value = "1M", value_parser = pdstor_daemon::units::parse_size)]
    merge: u64,
    /// Threads that checksum payloads beside the I/O thread; 0 (the default): one per CPU the
    /// daemon may run on. A large chunk is spread over all of them.
    #[arg(long, default_value_t = 0)]
    verify_threads: usize,
    /// Under capacity pressure, release the oldest READY publications nobody has claimed (exact
    /// unread releases, journaled, counted, on the timeline) of tenant `default` — without a
    /// config, everyone's. A config opts in other tenants (`evict_unread = true`).
    #[arg(long)]
    evict_unread: bool,
    /// Longest a prepare waits for capacity, in ms (a prepare's own timeout_ms is capped at it);
    /// then it is refused with 503.
    #[arg(long, default_value_t = 30_000)]
    admission_timeout_ms: u64,
    /// Attach the eBPF provenance probes and stamp every payload transfer with a verdict (root).
    #[arg(long)]
    provenance: bool,
    /// With --provenance: a fallback verdict on a host_fixed transfer fails it.
    #[arg(long, requires = "provenance")]
    require_native: bool,
    /// Append every protocol step, chunk transfer and refusal to this JSON-lines timeline.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Hold the namespace's persistent reservation (Exclusive Access, All Registrants) with this
    /// key (hex 0x… or decimal): only hosts that registered a key read or write it, and closing a
    /// direct reader's session preempts its host's key at the target (NVMe, incl. NVMe/TCP; root).
    #[arg(long, value_parser = parse_key)]
    reservation_key: Option<u64>,
    /// With --reservation-key: how often (ms) the owner checks that its key is still registered at
    /// the target; once a standby preempted it, the namespace is lost and every step is refused
    /// 503 namespace_lost.
    #[arg(long, default_value_t = 250)]
    owner_check_ms: u64,
    /// Stand by for the namespace's owner on another host (needs --reservation-key, a key of its
    /// own): write nothing and answer 503 standby until it takes over — on `pdstor takeover`, or
    /// once --owner has failed its health checks for --takeover-after-ms — by preempting the
    /// owner's key and recovering into a new epoch, as a restart does.
    #[arg(long, requires = "reservation_key")]
    standby: bool,
    /// With --standby: the owner's control plane, whose /healthz it watches (without it, only an
    /// operator's `pdstor takeover`).
    #[arg(long, requires = "standby")]
    owner: Option<String>,
    /// With --standby --owner: take over once the owner's health checks have failed for this
    /// long (ms).
    #[arg(long, default_value_t = 1_500)]
    takeover_after_ms: u64,
    #[command(flatten)]
    limits: LimitArgs,
}

impl ServeArgs {
    pub fn run(self) -> anyhow::Result<()> {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .with_writer(pdstor_daemon::api::log::LogWriter)
            // Colours for a terminal only: a log file (journald, a test's
            // serve.log) gets plain lines, and the daemon skips their escapes.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
        pdstor_daemon::api::serve(pdstor_daemon::api::ServeConfig {
            target: self.target,
            listen: match self.listen_unix {
                Some(p) => pdstor_daemon::api::Listen::Unix(p),
                None => self.listen,
            },
            data_socket: self.data_socket,
            queue_depth: self.qd,
            merge_bytes: self.merge,
            verify_threads: self.verify_threads,
            admission_timeout: Duration::from_millis(self.admission_timeout_ms),
            provenance: self.provenance,
            require_native: self.require_native,
            timeline: self.timeline,
            reservation_key: self.reservation_key,
            owner_check: Duration::from_millis(self.owner_check_ms.max(10)),
            standby: self.standby.then(|| pdstor_daemon::api::standby::StandbyConfig {
                owner: self.owner.clone(),
                takeover_after: Duration::from_millis(self.takeover_after_ms),
                check_every: Duration::from_millis(self.owner_check_ms.max(10)),
            }),
            fault: None,
            limits: self.limits.limits(),
            allow_readable_target: self.allow_readable_target,
            insecure_tcp: self.insecure_tcp,
            config: pdstor_daemon::api::config::ConfigSource { path: self.config, evict_unread: self.evict_unread },
            reload_check: (self.reload_check_ms > 0).then(|| Duration::from_millis(self.reload_check_ms)),
            tls: match (self.tls_cert, self.tls_key, self.tls_client_ca) {
                (Some(cert), Some(key), Some(client_ca)) => {
                    Some(pdstor_daemon::api::tls::TlsFiles { cert, key, client_ca, crls: self.tls_crl })
                }
                _ => None,
            },
        })
    }
}

/// A reservation key: `0x…` hex or decimal, not 0 (NVMe's "no key").
pub fn parse_key(s: &str) -> Result<u64, String> {
    let v = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("{s:?} is not a 64-bit key (0x… or decimal): {e}"))?;
    if v == 0 {
        return Err("a reservation key is not 0".into());
    }
    Ok(v)
}
