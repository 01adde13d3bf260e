//! How the client reaches the control plane: one daemon or several, over
//! the Unix socket, TCP or mutual TLS, and which answers pass a step on to
//! the next daemon.

use crate::wire::*;
use crate::{ClientError, http1};

/// How the client reaches the control plane.
pub(crate) enum Transport {
    /// `unix:/run/pdstor/control.sock`, its connections kept alive.
    Unix(http1::UnixPool),
    /// `https://host:port`: mutual TLS (or why its files could not be read).
    Tls { host: String, port: u16, config: Result<std::sync::Arc<rustls::ClientConfig>, String> },
    /// `http://host:port` (a daemon run with `--insecure-tcp`).
    Http(ureq::Agent),
}

/// The TLS files `https://` uses: `PDSTOR_TLS_CA` (the daemon's CA), and
/// `PDSTOR_TLS_CERT` with `PDSTOR_TLS_KEY` (this client's certificate).
pub(crate) fn tls_from_env() -> Result<std::sync::Arc<rustls::ClientConfig>, String> {
    let var = |n: &str| std::env::var_os(n).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    let ca = var("PDSTOR_TLS_CA")
        .ok_or("an https:// server needs PDSTOR_TLS_CA, the CA that signed the daemon's certificate")?;
    match (var("PDSTOR_TLS_CERT"), var("PDSTOR_TLS_KEY")) {
        (Some(c), Some(k)) => crate::tls::client_config(&ca, Some((&c, &k))),
        (None, None) => crate::tls::client_config(&ca, None),
        _ => Err("PDSTOR_TLS_CERT and PDSTOR_TLS_KEY go together: give both, or neither".into()),
    }
}

/// `host:port` of an `https://` URL.
pub(crate) fn host_port(rest: &str) -> Result<(String, u16), String> {
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = authority.rsplit_once(':').ok_or_else(|| format!("https://{authority} names no port"))?;
    let port = port.parse().map_err(|_| format!("https://{authority}: {port:?} is not a port"))?;
    Ok((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port))
}

/// One daemon's address and how it is reached.
pub(crate) struct Daemon {
    pub(crate) transport: Transport,
    pub(crate) base: String,
}

/// A request that failed: whether it provably never reached the daemon (no
/// connection was made), so it may go to another.
pub(crate) enum Failed {
    NotSent(ClientError),
    Unknown(ClientError),
}

impl Daemon {
    pub(crate) fn new(base: &str, several: bool) -> Daemon {
        let base = base.trim().trim_end_matches('/').to_owned();
        let transport = if let Some(path) = base.strip_prefix("unix:") {
            Transport::Unix(http1::UnixPool::new(path.trim_start_matches("//").into()))
        } else if let Some(rest) = base.strip_prefix("https://") {
            match host_port(rest) {
                Ok((host, port)) => Transport::Tls { host, port, config: tls_from_env() },
                Err(e) => Transport::Tls { host: String::new(), port: 0, config: Err(e) },
            }
        } else {
            // Idle connections are dropped well before the daemon closes them
            // (`--header-timeout-ms`, 10 s by default), so a pooled connection
            // is never one the daemon has already forgotten. Among several
            // owners nothing is pooled: a host that lost its power and booted
            // again within seconds (its standby took over meanwhile) answers
            // a step sent on an old connection with a reset, whose fate the
            // client cannot know, whereas a new connection to it is refused —
            // provably never sent — and the step goes on to the next address.
            // There a silent host's connect gives up after 3 s.
            let (idle, per_host) = if several { (0, 0) } else { (10, 3) };
            let config = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_idle_age(std::time::Duration::from_secs(4))
                .max_idle_connections(idle)
                .max_idle_connections_per_host(per_host)
                .timeout_connect(several.then(|| std::time::Duration::from_secs(3)))
                .build();
            Transport::Http(config.into())
        };
        Daemon { transport, base }
    }

    /// Sends one request; answers the status and body.
    pub(crate) fn exchange(&self, method: &str, path: &str, json: Option<&[u8]>) -> Result<(u16, Vec<u8>), Failed> {
        let url = format!("{}{path}", self.base);
        let transport = |message: String| {
            // Every transport says "connecting to …" when no connection was made.
            let e = ClientError::Transport { url: url.clone(), message: message.clone() };
            if message.starts_with("connecting to") { Failed::NotSent(e) } else { Failed::Unknown(e) }
        };
        match &self.transport {
            Transport::Unix(pool) => {
                let a = pool.request(method, path, json).map_err(transport)?;
                Ok((a.status, a.body))
            }
            Transport::Tls { host, port, config } => {
                let config = config
                    .as_ref()
                    .map_err(|e| Failed::NotSent(ClientError::Transport { url: url.clone(), message: e.clone() }))?;
                let a = http1::tls(config, host, *port, method, path, json).map_err(|f| match f {
                    http1::TlsFailed::Other(message) => transport(message),
                    // Final: the handshake failed before the request was read.
                    http1::TlsFailed::CertificateRefused(why) => Failed::Unknown(ClientError::Api(ErrorBody::new(
                        crate::code::RefusalCode::Unauthenticated,
                        "certificate",
                        format!(
                            "the daemon at {} refused this client's certificate in the TLS handshake: {why}; nothing was done. Ask its operator for a certificate it accepts (PDSTOR_TLS_CERT, PDSTOR_TLS_KEY)",
                            self.base
                        ),
                    ))),
                })?;
                Ok((a.status, a.body))
            }
            Transport::Http(agent) => {
                let resp = match json {
                    Some(body) => agent.post(&url).content_type("application/json").send(body),
                    None => agent.get(&url).call(),
                };
                let mut resp = resp.map_err(|e| {
                    let not_sent = match &e {
                        ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => true,
                        ureq::Error::Timeout(t) => matches!(t, ureq::Timeout::Connect | ureq::Timeout::Resolve),
                        ureq::Error::Io(io) => matches!(
                            io.kind(),
                            std::io::ErrorKind::ConnectionRefused
                                | std::io::ErrorKind::HostUnreachable
                                | std::io::ErrorKind::NetworkUnreachable
                        ),
                        _ => false,
                    };
                    match not_sent {
                        true => transport(format!("connecting to {}: {e}", self.base)),
                        false => transport(e.to_string()),
                    }
                })?;
                let status = resp.status().as_u16();
                let body = resp
                    .body_mut()
                    .with_config()
                    .limit(256 << 20)
                    .read_to_vec()
                    .map_err(|e| transport(e.to_string()))?;
                Ok((status, body))
            }
        }
    }
}

/// Why a daemon's answer says it is not the namespace's owner now: a
/// standby, an owner that lost the namespace, or a daemon that serves
/// another namespace than the receipt's — each refused before doing
/// anything, so the step may go to the next address.
pub(crate) fn not_the_owner(path: &str, status: u16, body: &[u8]) -> Option<String> {
    if path == "/healthz" && status == 200 && body.starts_with(b"standby") {
        return Some("standby".into());
    }
    let passes = |code: &str| matches!(code, "standby" | "namespace_lost" | "namespace_mismatch");
    if path == "/storage-pd/batch" && status == 200 {
        // A batch every step of which was refused so did nothing either: a
        // batch of one is how a single step goes, and it fails over as the
        // step's own route would.
        let answer: BatchResponse = serde_json::from_slice(body).ok()?;
        let codes: Vec<&str> =
            answer.results.iter().map(|r| r.error.as_ref().map_or("", |e| e.code.as_str())).collect();
        return (!codes.is_empty() && codes.iter().all(|c| passes(c))).then(|| codes[0].to_owned());
    }
    let b: ErrorBody = serde_json::from_slice(body).ok()?;
    passes(&b.code).then_some(b.code)
}
