//! `pdstor serve --config pdstor.toml`: who may do what, and how much.
//!
//! ```toml
//! [sockets]
//! group = "pdstor"             # sockets 0660 and their directory 0750, this group
//!
//! [[principal]]                # matched in order; the first naming a caller wins
//! tenant = "team-a"
//! roles = ["writer"]           # writer, reader, admin
//! users = ["prefill"]          # Unix peers by user name or uid ...
//! uids = [1001]
//! groups = ["prefill-pool"]    # ... or by effective group (never root or the daemon's user)
//! cert_names = ["prefill.team-a.example"]   # TLS clients by certificate CN or DNS name
//!
//! [[principal]]
//! tenant = "team-b"
//! roles = ["reader"]
//! uids = [1002]
//!
//! [tenant.team-a]
//! readers_from = ["team-b"]    # other tenants whose readers may claim team-a's publications
//! evict_unread = true          # under capacity pressure, release its READY publications nobody claimed, oldest first
//! unread_release_ms = 600000   # release its READY publications no reader claimed (cache ones: read) for this long
//! [tenant.team-a.quota]
//! slots = 4096
//! pinned_bytes = "16G"
//! buffers = 32
//! connections = 64
//! prepares = 32
//!
//! [plaintext]                  # who a --insecure-tcp client is taken to be (default: nobody)
//! tenant = "team-a"
//! roles = ["reader"]
//! ```
//!
//! Without a config the daemon's own user and root are admins of tenant
//! `default` and nobody else can reach the 0600 sockets.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::protocol::identity::{DEFAULT_TENANT, Principal, Quota, Roles, Rules, Tenant};

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    sockets: Sockets,
    #[serde(default)]
    principal: Vec<PrincipalFile>,
    #[serde(default)]
    tenant: BTreeMap<String, TenantFile>,
    plaintext: Option<PlaintextFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Sockets {
    group: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalFile {
    tenant: String,
    roles: Vec<String>,
    #[serde(default)]
    users: Vec<String>,
    #[serde(default)]
    uids: Vec<u32>,
    #[serde(default)]
    groups: Vec<String>,
    #[serde(default)]
    gids: Vec<u32>,
    #[serde(default)]
    cert_names: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    #[serde(default)]
    readers_from: Vec<String>,
    #[serde(default)]
    evict_unread: bool,
    unread_release_ms: Option<u64>,
    #[serde(default)]
    quota: QuotaFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaFile {
    slots: Option<u64>,
    pinned_bytes: Option<Size>,
    buffers: Option<usize>,
    connections: Option<usize>,
    prepares: Option<usize>,
}

/// A byte count as a number or a size string (`"16G"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlaintextFile {
    tenant: String,
    roles: Vec<String>,
}

/// What the daemon runs with from its config.
#[derive(Debug)]
pub struct Config {
    /// Who is who.
    pub rules: Rules,
    /// The group the sockets (0660) and their directory (0750) are given to.
    pub socket_group: Option<u32>,
}

impl Config {
    /// No config: [`Rules::local`], owner-only sockets.
    pub fn local() -> Config {
        Config { rules: Rules::local(), socket_group: None }
    }

    /// Reads and checks `path`; every mistake names its place.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the config {}", path.display()))?;
        Config::parse(&text).with_context(|| format!("in the config {}", path.display()))
    }

    /// Parses a config's text.
    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let file: File = toml::from_str(text)?;
        let mut rules = Rules { plaintext: None, ..Rules::local() };
        for (name, t) in &file.tenant {
            for r in &t.readers_from {
                if !file.tenant.contains_key(r) && !file.principal.iter().any(|p| &p.tenant == r) {
                    bail!("tenant {name}: readers_from names {r:?}, which no principal or tenant table is");
                }
            }
            let q = &t.quota;
            let pinned_bytes = match &q.pinned_bytes {
                None => None,
                Some(Size::Bytes(b)) => Some(*b),
                Some(Size::Text(s)) => Some(
                    crate::units::parse_size(s)
                        .map_err(|e| anyhow::anyhow!("tenant {name}: quota.pinned_bytes {s:?}: {e}"))?,
                ),
            };
            let quota = Quota {
                slots: q.slots,
                pinned_bytes,
                buffers: q.buffers,
                connections: q.connections,
                prepares: q.prepares,
            };
            if t.unread_release_ms == Some(0) {
                bail!(
                    "tenant {name}: unread_release_ms = 0 would release every publication at once: leave it out to keep them"
                );
            }
            let tenant = Tenant {
                readers_from: t.readers_from.clone(),
                quota,
                evict_unread: t.evict_unread,
                unread_release: t.unread_release_ms.map(std::time::Duration::from_millis),
            };
            rules.tenants.insert(name.clone(), tenant);
        }
        for (i, p) in file.principal.iter().enumerate() {
            let at = format!("principal #{} (tenant {})", i + 1, p.tenant);
            let roles = Roles::parse(p.roles.iter().map(String::as_str)).map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
            if roles == Roles::default() {
                bail!("{at}: roles is empty: give writer, reader or admin");
            }
            let mut uids = p.uids.clone();
            for u in &p.users {
                let user = nix::unistd::User::from_name(u)
                    .with_context(|| format!("{at}: looking up user {u:?}"))?
                    .ok_or_else(|| anyhow::anyhow!("{at}: no user is named {u:?} on this host"))?;
                uids.push(user.uid.as_raw());
            }
            let mut gids = p.gids.clone();
            for g in &p.groups {
                gids.push(group_id(g).with_context(|| at.clone())?);
            }
            if uids.is_empty() && gids.is_empty() && p.cert_names.is_empty() {
                bail!("{at}: names no caller: give users, uids, groups, gids or cert_names");
            }
            rules.principals.push(Principal {
                tenant: p.tenant.clone(),
                roles,
                uids,
                gids,
                names: p.cert_names.clone(),
            });
        }
        if let Some(pt) = &file.plaintext {
            let roles =
                Roles::parse(pt.roles.iter().map(String::as_str)).map_err(|e| anyhow::anyhow!("[plaintext]: {e}"))?;
            rules.plaintext = Some(Principal { tenant: pt.tenant.clone(), roles, ..Default::default() });
        }
        let socket_group = file.sockets.group.as_deref().map(group_id).transpose()?;
        Ok(Config { rules, socket_group })
    }
}

/// Where the daemon's config comes from: read at start, and again at every
/// reload.
#[derive(Debug, Clone, Default)]
pub struct ConfigSource {
    /// `--config` (none: [`Config::local`]).
    pub path: Option<PathBuf>,
    /// `--evict-unread`: tenant `default` evicts unread publications under
    /// pressure, whatever the file says.
    pub evict_unread: bool,
}

impl ConfigSource {
    /// Reads the config as the daemon runs with it.
    pub fn load(&self) -> anyhow::Result<Config> {
        let mut config = match &self.path {
            Some(path) => Config::load(path)?,
            None => Config::local(),
        };
        if self.evict_unread {
            config.rules.tenants.entry(DEFAULT_TENANT.to_owned()).or_default().evict_unread = true;
        }
        Ok(config)
    }
}

/// A group by name or number.
fn group_id(g: &str) -> anyhow::Result<u32> {
    if let Ok(n) = g.parse() {
        return Ok(n);
    }
    let group = nix::unistd::Group::from_name(g)
        .with_context(|| format!("looking up group {g:?}"))?
        .ok_or_else(|| anyhow::anyhow!("no group is named {g:?} on this host"))?;
    Ok(group.gid.as_raw())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_parses() {
        let doc = include_str!("config.rs");
        let example: String = doc
            .lines()
            .skip_while(|l| !l.starts_with("//! ```toml"))
            .skip(1)
            .take_while(|l| !l.starts_with("//! ```"))
            .map(|l| l.trim_start_matches("//!").trim_start_matches(' '))
            .collect::<Vec<_>>()
            .join("\n")
            // The example names a user and group this host may lack.
            .replace("users = [\"prefill\"]", "users = [\"root\"]")
            .replace("groups = [\"prefill-pool\"]", "groups = [\"0\"]")
            .replace("group = \"pdstor\"", "group = \"0\"");
        let c = Config::parse(&example).expect("the example in the module's documentation parses");
        assert_eq!(c.socket_group, Some(0));
        let p = &c.rules.principals[0];
        assert_eq!((p.tenant.as_str(), p.roles.writer, p.uids.as_slice()), ("team-a", true, &[1001, 0][..]));
        let q = c.rules.quota("team-a");
        assert_eq!((q.slots, q.pinned_bytes, q.prepares), (Some(4096), Some(16 << 30), Some(32)));
        assert!(c.rules.may_read("team-a", "team-b"));
        assert!(c.rules.evicts_unread(Some("team-a")) && c.rules.any_evicts());
        assert!(!c.rules.evicts_unread(Some("team-b")) && !c.rules.evicts_unread(None), "opted in per tenant");
        assert_eq!(c.rules.unread_release(Some("team-a")), Some(std::time::Duration::from_secs(600)));
        assert_eq!(c.rules.unread_release(Some("team-b")), None, "none unless the tenant sets one");
        assert_eq!(c.rules.plaintext.as_ref().map(|p| p.roles.reader), Some(true));
    }

    #[test]
    fn mistakes_name_their_place() {
        let e = format!(
            "{:#}",
            Config::parse("[[principal]]\ntenant = \"a\"\nroles = [\"owner\"]\nuids = [1]").unwrap_err()
        );
        assert!(e.contains("principal #1 (tenant a)") && e.contains("unknown role \"owner\""), "{e}");
        let e = format!("{:#}", Config::parse("[[principal]]\ntenant = \"a\"\nroles = [\"reader\"]").unwrap_err());
        assert!(e.contains("names no caller"), "{e}");
        let e = format!("{:#}", Config::parse("[tenant.a]\nreaders_from = [\"zz\"]").unwrap_err());
        assert!(e.contains("readers_from names \"zz\""), "{e}");
        assert!(Config::parse("[sockets]\nmode = 7").is_err(), "unknown keys are refused");
    }
}
