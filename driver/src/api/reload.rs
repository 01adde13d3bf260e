//! Reloading without a restart: the config (`--config`) and the TLS files
//! (`--tls-cert`, `--tls-key`, `--tls-client-ca`, `--tls-crl`) are read
//! again on SIGHUP, and once any of them changes (checked every
//! `--reload-check-ms`, a second by default; a changed file must hold still
//! for one check before it is read, so a file being written is not — tools
//! that write a new file and rename it over the old are never seen half
//! done). Every file is read and checked first; only if all of them are good
//! are the new rules and TLS configuration put in place, together. A reload
//! that fails changes nothing: the daemon keeps serving with what it had and
//! logs what failed, on which file.
//!
//! What a reload does not touch: publications, claims, leases and the
//! quota each tenant holds (a lowered quota refuses more, never takes back);
//! requests in flight, which finish under the rules they started with; and
//! open connections, which are never closed by it: the next request on a
//! control-plane connection is judged afresh (`peer`): its certificate
//! checked again against the new CA and CRLs, its identity resolved by the
//! new rules. The data plane's connections keep the identity they connected
//! with: every publication and claim they act on was prepared or claimed on
//! the control plane. The socket group (`[sockets]`) needs a restart: a
//! reload that changes it says so and applies the rest.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};

use super::config::ConfigSource;
use super::tls::{self, ServerTls, TlsFiles};
use crate::protocol::policy::Policy;

/// Reloads applied since start (`/metrics`).
static RELOADS: AtomicU64 = AtomicU64::new(0);
/// Reloads refused since start, every file left as it was (`/metrics`).
static FAILED: AtomicU64 = AtomicU64::new(0);

/// Reloads applied, and refused, since the daemon started.
pub fn reloads() -> (u64, u64) {
    (RELOADS.load(Ordering::Relaxed), FAILED.load(Ordering::Relaxed))
}

/// What the daemon serves with now, and where it came from.
pub struct Live {
    config: ConfigSource,
    tls_files: Option<TlsFiles>,
    policy: Arc<Policy>,
    socket_group: Option<u32>,
    tls: RwLock<Option<ServerTls>>,
    generation: AtomicU64,
}

impl Live {
    /// Reads the config and the TLS files (`tls_files`: a TCP control plane
    /// with mutual TLS) as the daemon starts with them.
    pub fn load(config: ConfigSource, tls_files: Option<TlsFiles>) -> anyhow::Result<Live> {
        let loaded = config.load()?;
        let tls = tls_files.as_ref().map(tls::server_config).transpose()?;
        Ok(Live {
            config,
            tls_files,
            policy: Arc::new(Policy::new(loaded.rules)),
            socket_group: loaded.socket_group,
            tls: RwLock::new(tls),
            generation: AtomicU64::new(0),
        })
    }

    /// Who is who now, and what each tenant holds.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// The group the sockets were given to at start.
    pub fn socket_group(&self) -> Option<u32> {
        self.socket_group
    }

    /// The TLS configuration a new connection's handshake uses, and its
    /// client certificate verifier.
    pub fn tls(&self) -> Option<ServerTls> {
        self.tls.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Counts the reloads applied: a connection resolved before the last one
    /// is resolved again on its next request.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Reads everything again and puts it in place, all of it or nothing.
    pub fn reload(&self) -> anyhow::Result<()> {
        let loaded = self.config.load()?;
        let tls = self.tls_files.as_ref().map(tls::server_config).transpose()?;
        if loaded.socket_group != self.socket_group {
            tracing::warn!(
                was = ?self.socket_group,
                now = ?loaded.socket_group,
                "the config's socket group changed: the sockets keep their group until a restart"
            );
        }
        let (principals, tenants) = (loaded.rules.principals.len(), loaded.rules.tenants.len());
        self.policy.replace(loaded.rules);
        if let Some(t) = tls {
            *self.tls.write().unwrap_or_else(|p| p.into_inner()) = Some(t);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        tracing::info!(principals, tenants, tls = self.tls_files.is_some(), "reloaded the config and TLS files");
        Ok(())
    }

    /// [`Live::reload`], counted and logged; `why` says what asked for it.
    fn reload_logged(&self, why: &str) {
        match self.reload() {
            Ok(()) => {
                RELOADS.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                FAILED.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    "reload on {why} failed, nothing changed (still serving with the previous config and TLS files): {e:#}"
                );
            }
        }
    }

    /// Every file a reload reads.
    fn files(&self) -> Vec<PathBuf> {
        let mut all: Vec<PathBuf> = self.config.path.iter().cloned().collect();
        if let Some(t) = &self.tls_files {
            all.extend(t.paths().into_iter().map(PathBuf::from));
        }
        all
    }

    /// Takes SIGHUP from now on (call it where the runtime is entered, before
    /// the daemon says it is listening): the handler [`Live::watch`] answers.
    pub fn hangups() -> Option<Signal> {
        signal(SignalKind::hangup())
            .inspect_err(|e| tracing::warn!("SIGHUP cannot be caught ({e}): reloads follow file changes only"))
            .ok()
    }

    /// Reloads on each SIGHUP `hangups` delivers, and once a file changed
    /// and held still for one check of `every` (none: SIGHUP only). Runs
    /// until the runtime stops.
    pub async fn watch(self: Arc<Self>, mut hangups: Option<Signal>, every: Option<Duration>) {
        let files = self.files();
        let mut applied = fingerprint(&files);
        let mut seen = applied.clone();
        let mut tick = tokio::time::interval(every.unwrap_or(Duration::from_secs(3600)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some(()) = async { hangups.as_mut()?.recv().await } => {
                    // Before the files are read: one changed after this is seen next.
                    applied = fingerprint(&files);
                    seen = applied.clone();
                    self.reload_logged("SIGHUP");
                }
                _ = tick.tick(), if every.is_some() => {
                    let now = fingerprint(&files);
                    if now != applied && now == seen {
                        let changed: Vec<String> = files
                            .iter()
                            .zip(now.iter().zip(&applied))
                            .filter(|(_, (n, a))| n != a)
                            .map(|(f, _)| f.display().to_string())
                            .collect();
                        self.reload_logged(&format!("a change to {}", changed.join(", ")));
                        applied = now.clone();
                    }
                    seen = now;
                }
            }
        }
    }
}

/// What says a file changed: its device, inode, size, and modification and
/// change times (through symlinks, so a Kubernetes secret's swapped link
/// counts; the change time, so an in-place copy that keeps size and
/// modification time does too), or why it could not be read.
type Stamp = Result<(u64, u64, u64, i64, i64, i64, i64), String>;

/// Each file's [`Stamp`] now.
fn fingerprint(files: &[PathBuf]) -> Vec<Stamp> {
    use std::os::unix::fs::MetadataExt;
    files
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .map(|m| (m.dev(), m.ino(), m.len(), m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()))
                .map_err(|e| e.kind().to_string())
        })
        .collect()
}
