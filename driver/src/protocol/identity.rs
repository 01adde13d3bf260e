//! Who is calling, and what they may do (issue 16).
//!
//! Every request reaches the protocol with a [`Caller`]: the identity the
//! transport proved (a Unix peer's uid by `SO_PEERCRED`, a TLS client's
//! certificate names) resolved by the [`Rules`] to a tenant and its roles.
//! Publications belong to the identity that prepared them ([`Owner`]);
//! claims to the identity that claimed them. The refusals are distinct:
//! `unauthenticated` (no identity could be proven), `forbidden` (the identity
//! lacks the role, or the tenant does not let it read) and `not_owner`
//! (someone else's publication, claim or session).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Refusal, RefusalCode};

/// What a principal may do. `admin` may act on every tenant's publications
/// and sees every listing; it still needs the writer token and the receipts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roles {
    /// May prepare, store into, publish, abort and release its publications.
    pub writer: bool,
    /// May claim, adopt, load, ack and fail the publications its tenant allows.
    pub reader: bool,
    /// May do anything to any tenant's publications, list all, read metrics.
    pub admin: bool,
}

impl Roles {
    /// Every role.
    pub const ALL: Roles = Roles { writer: true, reader: true, admin: true };

    /// Parses role names (`writer`, `reader`, `admin`).
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<Roles, String> {
        let mut r = Roles::default();
        for n in names {
            match n {
                "writer" => r.writer = true,
                "reader" => r.reader = true,
                "admin" => r.admin = true,
                other => return Err(format!("unknown role {other:?}: the roles are writer, reader and admin")),
            }
        }
        Ok(r)
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [(self.writer, "writer"), (self.reader, "reader"), (self.admin, "admin")]
            .into_iter()
            .filter_map(|(on, n)| on.then_some(n))
            .collect();
        if names.is_empty() { f.write_str("no role") } else { f.write_str(&names.join("+")) }
    }
}

/// How a caller reached the daemon, and what that proved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Via {
    /// A Unix socket peer, by `SO_PEERCRED`.
    Unix {
        /// Its effective uid.
        uid: u32,
        /// Its effective gid.
        gid: u32,
        /// Its pid when it connected.
        pid: i32,
    },
    /// A TCP client that presented a certificate the daemon's CA signed.
    Tls {
        /// The certificate's names (subject common name, then DNS names).
        names: Vec<String>,
        /// Where it connected from.
        addr: String,
    },
    /// A TCP client on a plaintext listener (`--insecure-tcp`): unproven.
    Plain {
        /// Where it connected from.
        addr: String,
    },
    /// The daemon itself, or a test driving the service directly.
    InProcess,
}

pub use crate::store::Owner;

/// Someone making a request: how they came, who that proves they are, and
/// (when the policy knows them) their tenant and roles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The proven transport identity.
    pub via: Via,
    /// The principal key (`uid:1000`, `cert:prefill-0`, `tcp:10.0.0.2:5000`).
    pub principal: String,
    /// The tenant, when the policy maps the principal to one.
    pub tenant: Option<String>,
    /// The roles the policy grants.
    pub roles: Roles,
}

impl Caller {
    /// The daemon's own steps and in-process tests: admin of tenant `default`.
    pub fn in_process() -> Caller {
        Caller {
            via: Via::InProcess,
            principal: "daemon".into(),
            tenant: Some(DEFAULT_TENANT.into()),
            roles: Roles::ALL,
        }
    }

    /// Whether the transport proved who this is.
    pub fn authenticated(&self) -> bool {
        !matches!(self.via, Via::Plain { .. })
    }

    /// The identity a publication or claim of this caller is bound to.
    pub fn owner(&self) -> Option<Owner> {
        Some(Owner { tenant: self.tenant.clone()?, principal: self.principal.clone() })
    }

    /// Whether this caller is `o` (or an admin, who may act for anyone).
    pub fn is(&self, o: &Owner) -> bool {
        self.roles.admin || (self.principal == o.principal && self.tenant.as_deref() == Some(o.tenant.as_str()))
    }

    /// Refuses a caller who may not `step` without `role` (`admin` passes).
    pub fn require(&self, role: Role, step: &str) -> Result<(), Refusal> {
        if !self.authenticated() && self.tenant.is_none() {
            return Err(Refusal::new(
                RefusalCode::Unauthenticated,
                "caller",
                format!(
                    "{step}: {self} proved no identity: connect over the daemon's Unix socket, or over TCP with a client certificate its CA signed"
                ),
            ));
        }
        let Some(tenant) = &self.tenant else {
            return Err(Refusal::new(
                RefusalCode::Forbidden,
                "caller",
                format!(
                    "{step}: {self} belongs to no tenant in the daemon's config (serve --config): ask its operator to add it"
                ),
            ));
        };
        let ok = self.roles.admin
            || match role {
                Role::Writer => self.roles.writer,
                Role::Reader => self.roles.reader,
                Role::Admin => false,
                Role::Any => self.roles.writer || self.roles.reader,
            };
        if !ok {
            return Err(Refusal::new(
                RefusalCode::Forbidden,
                "caller",
                format!("{step}: {self} of tenant {tenant} has {} and {step} needs {role}", self.roles),
            ));
        }
        Ok(())
    }

    /// Refuses a caller who is not `owner` (nor an admin): `what` names the thing.
    pub fn require_owner(&self, owner: Option<&Owner>, what: &str) -> Result<(), Refusal> {
        match owner {
            // Made before identities existed (an old journal): only its token or receipt proves anything.
            None => Ok(()),
            Some(o) if self.is(o) => Ok(()),
            Some(o) => Err(Refusal::new(
                RefusalCode::NotOwner,
                "caller",
                format!("{what} belongs to {}; {self} is not it (nor an admin)", o.principal),
            )),
        }
    }

    /// A short description for logs and the timeline: `uid:1000 (tenant a, writer)`.
    pub fn audit(&self) -> String {
        match &self.tenant {
            Some(t) => format!("{} (tenant {t}, {})", self.principal, self.roles),
            None => format!("{} (no tenant)", self.principal),
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.via {
            Via::Unix { uid, pid, .. } => write!(f, "uid {uid} (pid {pid})"),
            Via::Tls { names, addr } => write!(f, "certificate {:?} from {addr}", names.first().map_or("", |n| n)),
            Via::Plain { addr } => write!(f, "plaintext TCP client {addr}"),
            Via::InProcess => f.write_str("the daemon"),
        }
    }
}

/// A role a step needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// prepare, store, publish, abort, release, cancel.
    Writer,
    /// claim, adopt, load, ack, fail, close-session.
    Reader,
    /// metrics, other tenants' listings.
    Admin,
    /// Either writer or reader (registering a buffer).
    Any,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Writer => "the writer role",
            Role::Reader => "the reader role",
            Role::Admin => "the admin role",
            Role::Any => "the writer or reader role",
        })
    }
}

/// The tenant the daemon's own user and root belong to when the config names
/// no other.
pub const DEFAULT_TENANT: &str = "default";

/// What one tenant may hold at once; `None` is no limit beyond the daemon's own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Slots reserved by its live publications.
    pub slots: Option<u64>,
    /// Bytes of buffer memory its data-plane connections have the daemon map.
    pub pinned_bytes: Option<u64>,
    /// Buffers its data-plane connections have registered.
    pub buffers: Option<usize>,
    /// Connections open at once, both planes together.
    pub connections: Option<usize>,
    /// Prepares outstanding: waiting for capacity or PREPARED.
    pub prepares: Option<usize>,
}

/// A rule mapping transport identities to a tenant and roles.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Principal {
    /// The tenant it belongs to.
    pub tenant: String,
    /// What it may do.
    pub roles: Roles,
    /// Unix peers with one of these uids.
    pub uids: Vec<u32>,
    /// Unix peers whose effective gid is one of these.
    pub gids: Vec<u32>,
    /// TLS clients whose certificate carries one of these names (CN or DNS SAN).
    pub names: Vec<String>,
}

/// One tenant: who else may read its publications, and its quota.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tenant {
    /// Other tenants whose readers may claim this tenant's publications
    /// (its own readers always may).
    pub readers_from: Vec<String>,
    /// What it may hold.
    pub quota: Quota,
    /// Its READY publications nobody has claimed may be released, oldest
    /// first, when a prepare finds too few free slots (the operator opts in).
    pub evict_unread: bool,
    /// Its READY publications no reader claims (or, cache ones, reads) for
    /// this long are released unread; the shorter of this, the writer's own
    /// window and `--unread-release-ms` applies.
    pub unread_release: Option<std::time::Duration>,
}

/// Who is who: principals, tenants and their quotas. Built from
/// `serve --config` ([`Rules::local`] without one), and replaced whole when
/// the daemon reloads it ([`super::policy::Policy`] holds the current ones).
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// Matched in order; the first rule naming the identity wins.
    pub principals: Vec<Principal>,
    /// By name.
    pub tenants: BTreeMap<String, Tenant>,
    /// The daemon's own uid: admin of [`DEFAULT_TENANT`] unless a rule names it.
    pub daemon_uid: u32,
    /// Who a plaintext TCP client (`--insecure-tcp`) is taken to be, unproven;
    /// `None`: nobody (every step refused `unauthenticated`).
    pub plaintext: Option<Principal>,
}

impl Rules {
    /// No config: the daemon's own uid and root are admins of tenant
    /// `default`; nobody else is anyone (and cannot reach the 0600 sockets).
    /// A plaintext TCP client, which only `--insecure-tcp` lets in, is taken
    /// to be the daemon's user: that is what the flag's warning says.
    pub fn local() -> Rules {
        let plaintext = Principal { tenant: DEFAULT_TENANT.into(), roles: Roles::ALL, ..Default::default() };
        Rules { daemon_uid: nix::unistd::geteuid().as_raw(), plaintext: Some(plaintext), ..Default::default() }
    }

    /// The caller a Unix peer is.
    pub fn unix(&self, uid: u32, gid: u32, pid: i32) -> Caller {
        let via = Via::Unix { uid, gid, pid };
        let principal = format!("uid:{uid}");
        let rule = self.principals.iter().find(|p| p.uids.contains(&uid)).or_else(|| {
            // A gid rule never captures root or the daemon's own user.
            (uid != 0 && uid != self.daemon_uid).then(|| self.principals.iter().find(|p| p.gids.contains(&gid)))?
        });
        match rule {
            Some(p) => Caller { via, principal, tenant: Some(p.tenant.clone()), roles: p.roles },
            None if uid == 0 || uid == self.daemon_uid => {
                Caller { via, principal, tenant: Some(DEFAULT_TENANT.into()), roles: Roles::ALL }
            }
            None => Caller { via, principal, tenant: None, roles: Roles::default() },
        }
    }

    /// The caller a TLS client with a verified certificate naming `names` is.
    pub fn certificate(&self, names: Vec<String>, addr: String) -> Caller {
        let rule = self.principals.iter().find(|p| names.iter().any(|n| p.names.contains(n)));
        let principal = format!("cert:{}", names.first().map_or("", |n| n));
        let (tenant, roles) = rule.map_or((None, Roles::default()), |p| (Some(p.tenant.clone()), p.roles));
        Caller { via: Via::Tls { names, addr }, principal, tenant, roles }
    }

    /// A plaintext TCP client (`--insecure-tcp`): unproven, so whoever the
    /// policy's `plaintext` rule says, or nobody.
    pub fn plaintext(&self, addr: String) -> Caller {
        let (tenant, roles) =
            self.plaintext.as_ref().map_or((None, Roles::default()), |p| (Some(p.tenant.clone()), p.roles));
        let principal = if tenant.is_some() { "tcp".to_owned() } else { format!("tcp:{addr}") };
        Caller { principal, via: Via::Plain { addr }, tenant, roles }
    }

    /// A TLS client that presented no certificate: nobody.
    pub fn anonymous_tls(&self, addr: String) -> Caller {
        Caller { principal: format!("tls:{addr}"), via: Via::Plain { addr }, tenant: None, roles: Roles::default() }
    }

    /// Whether readers of `reader_tenant` may claim publications of `owner_tenant`.
    pub fn may_read(&self, owner_tenant: &str, reader_tenant: &str) -> bool {
        owner_tenant == reader_tenant
            || self.tenants.get(owner_tenant).is_some_and(|t| t.readers_from.iter().any(|r| r == reader_tenant))
    }

    /// Whether `tenant`'s unread publications may be evicted under capacity
    /// pressure (a publication with no owner counts as [`DEFAULT_TENANT`]'s).
    pub fn evicts_unread(&self, tenant: Option<&str>) -> bool {
        self.tenants.get(tenant.unwrap_or(DEFAULT_TENANT)).is_some_and(|t| t.evict_unread)
    }

    /// Every tenant the config names (by a principal or a tenant table),
    /// and [`DEFAULT_TENANT`], the daemon's own.
    pub fn tenant_names(&self) -> std::collections::BTreeSet<String> {
        let mut names: std::collections::BTreeSet<String> = self.tenants.keys().cloned().collect();
        names.extend(self.principals.iter().map(|p| p.tenant.clone()));
        names.extend(self.plaintext.iter().map(|p| p.tenant.clone()));
        names.insert(DEFAULT_TENANT.to_owned());
        names
    }

    /// `tenant`'s unread window, if its table sets one (a publication with
    /// no owner counts as [`DEFAULT_TENANT`]'s).
    pub fn unread_release(&self, tenant: Option<&str>) -> Option<std::time::Duration> {
        self.tenants.get(tenant.unwrap_or(DEFAULT_TENANT)).and_then(|t| t.unread_release)
    }

    /// Whether any tenant has an unread window.
    pub fn any_unread_release(&self) -> bool {
        self.tenants.values().any(|t| t.unread_release.is_some())
    }

    /// Whether any tenant opted into eviction.
    pub fn any_evicts(&self) -> bool {
        self.tenants.values().any(|t| t.evict_unread)
    }

    /// `tenant`'s quota (no limits for a tenant the config does not list).
    pub fn quota(&self, tenant: &str) -> Quota {
        self.tenants.get(tenant).map(|t| t.quota).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        let mut p = Rules { daemon_uid: 4242, ..Default::default() };
        p.principals.push(Principal {
            tenant: "a".into(),
            roles: Roles { writer: true, ..Default::default() },
            uids: vec![1000],
            gids: vec![],
            names: vec!["a-writer".into()],
        });
        p.principals.push(Principal {
            tenant: "b".into(),
            roles: Roles { reader: true, ..Default::default() },
            uids: vec![],
            gids: vec![2000],
            names: vec![],
        });
        p.tenants.insert(
            "a".into(),
            Tenant {
                readers_from: vec!["b".into()],
                quota: Quota { connections: Some(1), ..Default::default() },
                evict_unread: false,
                unread_release: None,
            },
        );
        p
    }

    #[test]
    fn peers_resolve_by_uid_then_gid_and_the_daemon_user_is_admin() {
        let p = rules();
        let a = p.unix(1000, 5, 1);
        assert_eq!((a.tenant.as_deref(), a.roles.writer, a.roles.reader), (Some("a"), true, false));
        let b = p.unix(1001, 2000, 1);
        assert_eq!((b.tenant.as_deref(), b.roles.reader), (Some("b"), true));
        assert_eq!(p.unix(4242, 2000, 1).roles, Roles::ALL, "a gid rule never captures the daemon's user");
        assert_eq!(p.unix(0, 0, 1).roles, Roles::ALL);
        let nobody = p.unix(65534, 65534, 1);
        assert_eq!(nobody.tenant, None);
        assert_eq!(nobody.require(Role::Writer, "prepare").unwrap_err().code, RefusalCode::Forbidden);
        let plain = p.plaintext("10.0.0.1:1".into());
        assert_eq!(plain.require(Role::Reader, "claim").unwrap_err().code, RefusalCode::Unauthenticated);
        assert_eq!(b.require(Role::Writer, "prepare").unwrap_err().code, RefusalCode::Forbidden);
        assert!(a.require(Role::Writer, "prepare").is_ok());
        let cert = p.certificate(vec!["a-writer".into()], "10.0.0.1:1".into());
        assert_eq!((cert.tenant.as_deref(), cert.principal.as_str()), (Some("a"), "cert:a-writer"));
    }

    #[test]
    fn owners_and_readers() {
        let p = rules();
        let (a, b) = (p.unix(1000, 5, 1), p.unix(1001, 2000, 1));
        let owner = a.owner().expect("a has a tenant");
        assert!(a.require_owner(Some(&owner), "publication 1").is_ok());
        assert_eq!(b.require_owner(Some(&owner), "publication 1").unwrap_err().code, RefusalCode::NotOwner);
        assert!(p.unix(0, 0, 1).require_owner(Some(&owner), "publication 1").is_ok(), "admin acts for anyone");
        assert!(p.may_read("a", "b") && p.may_read("b", "b") && !p.may_read("b", "a"));
    }
}
