//! The policy the daemon runs with now: the [`Rules`] of its config, which a
//! reload replaces whole (`serve --config`, on SIGHUP or the file's change),
//! and what each tenant holds against its quota, which a reload keeps.
//!
//! A control-plane caller is resolved when its connection is accepted, and
//! again on its next request after each reload (`api::peer`); a check
//! (who may read, quotas, eviction, unread windows) reads the rules in force
//! when it runs.
//! Quota use is counted by tenant name: a tenant whose quota a reload lowers
//! below what it holds keeps what it holds and is refused more until it
//! gives some back.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use super::identity::{Caller, Rules};
use super::{Refusal, RefusalCode};

/// The current rules and the quota accounting.
#[derive(Debug, Default)]
pub struct Policy {
    rules: RwLock<Arc<Rules>>,
    usage: Mutex<BTreeMap<String, Usage>>,
}

/// What one tenant holds now, counted where it is taken and given back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Open connections, both planes.
    pub connections: usize,
    /// Registered buffers.
    pub buffers: usize,
    /// Bytes of registered buffers.
    pub pinned_bytes: u64,
    /// Prepares being handled (waiting or running).
    pub prepares: usize,
    /// Slots asked for by prepares being handled.
    pub pending_slots: u64,
}

/// A quota resource, for [`Policy::take`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// One connection.
    Connection,
    /// One buffer of this many bytes.
    Buffer(u64),
    /// One prepare of this many slots, of which `held` are the tenant's live
    /// publications' now and `outstanding` its PREPARED publications.
    Prepare {
        /// Slots asked for.
        slots: u64,
        /// Slots its live publications hold.
        held: u64,
        /// Its PREPARED publications.
        outstanding: usize,
    },
}

impl Policy {
    /// A policy of `rules`, nothing held yet.
    pub fn new(rules: Rules) -> Policy {
        Policy { rules: RwLock::new(Arc::new(rules)), usage: Mutex::default() }
    }

    /// No config: [`Rules::local`].
    pub fn local() -> Policy {
        Policy::new(Rules::local())
    }

    /// The rules now (a reload does not change the ones answered).
    pub fn rules(&self) -> Arc<Rules> {
        self.rules.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Puts `rules` in place of the current ones; what tenants hold is kept.
    pub fn replace(&self, rules: Rules) {
        *self.rules.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(rules);
    }

    /// Takes `r` from `caller`'s tenant's quota, or refuses `quota_exceeded`
    /// naming the limit; given back by [`Policy::give`]. Callers without a
    /// tenant are not counted (they are refused before they hold anything).
    pub fn take(&self, caller: &Caller, r: Resource) -> Result<(), Refusal> {
        let Some(tenant) = &caller.tenant else { return Ok(()) };
        let q = self.rules().quota(tenant);
        let mut all = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        let u = all.entry(tenant.clone()).or_default();
        let over = |what: &str, have: String, max: String| {
            Err(Refusal::new(
                RefusalCode::QuotaExceeded,
                "tenant",
                format!(
                    "tenant {tenant} holds {have} of its quota of {max} {what}: release some first, or raise the quota in the config"
                ),
            ))
        };
        match r {
            Resource::Connection => {
                if let Some(max) = q.connections.filter(|&m| u.connections >= m) {
                    return over("connections", u.connections.to_string(), max.to_string());
                }
                u.connections += 1;
            }
            Resource::Buffer(len) => {
                if let Some(max) = q.buffers.filter(|&m| u.buffers >= m) {
                    return over("buffers", u.buffers.to_string(), max.to_string());
                }
                if let Some(max) = q.pinned_bytes.filter(|&m| u.pinned_bytes.saturating_add(len) > m) {
                    return over("pinned bytes", format!("{} (+{len})", u.pinned_bytes), max.to_string());
                }
                u.buffers += 1;
                u.pinned_bytes += len;
            }
            Resource::Prepare { slots, held, outstanding } => {
                if let Some(max) = q.prepares.filter(|&m| u.prepares + outstanding >= m) {
                    return over("outstanding prepares", (u.prepares + outstanding).to_string(), max.to_string());
                }
                let have = held + u.pending_slots;
                if let Some(max) = q.slots.filter(|&m| have.saturating_add(slots) > m) {
                    return over("slots", format!("{have} (+{slots})"), max.to_string());
                }
                u.prepares += 1;
                u.pending_slots += slots;
            }
        }
        Ok(())
    }

    /// Gives back what [`Policy::take`] took.
    pub fn give(&self, caller: &Caller, r: Resource) {
        let Some(tenant) = &caller.tenant else { return };
        let mut all = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        let u = all.entry(tenant.clone()).or_default();
        match r {
            Resource::Connection => u.connections = u.connections.saturating_sub(1),
            Resource::Buffer(len) => {
                u.buffers = u.buffers.saturating_sub(1);
                u.pinned_bytes = u.pinned_bytes.saturating_sub(len);
            }
            Resource::Prepare { slots, .. } => {
                u.prepares = u.prepares.saturating_sub(1);
                u.pending_slots = u.pending_slots.saturating_sub(slots);
            }
        }
    }

    /// What `tenant` holds now.
    pub fn usage(&self, tenant: &str) -> Usage {
        self.usage.lock().unwrap_or_else(|p| p.into_inner()).get(tenant).copied().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::identity::{Principal, Quota, Roles, Tenant};

    fn rules(connections: usize) -> Rules {
        let mut r = Rules { daemon_uid: 4242, ..Default::default() };
        r.principals.push(Principal {
            tenant: "a".into(),
            roles: Roles { writer: true, ..Default::default() },
            uids: vec![1000],
            ..Default::default()
        });
        let quota = Quota { connections: Some(connections), ..Default::default() };
        r.tenants.insert("a".into(), Tenant { quota, ..Default::default() });
        r
    }

    #[test]
    fn quotas_refuse_past_the_limit_and_give_back() {
        let p = Policy::new(rules(1));
        let a = p.rules().unix(1000, 5, 1);
        p.take(&a, Resource::Connection).expect("the first connection");
        let e = p.take(&a, Resource::Connection).unwrap_err();
        assert_eq!(e.code, RefusalCode::QuotaExceeded);
        assert!(e.message.contains("tenant a holds 1 of its quota of 1 connections"), "{}", e.message);
        p.give(&a, Resource::Connection);
        p.take(&a, Resource::Connection).expect("given back, taken again");
        assert_eq!(p.usage("a").connections, 1);
    }

    #[test]
    fn a_replacement_keeps_what_tenants_hold_and_applies_its_quotas() {
        let p = Policy::new(rules(3));
        let a = p.rules().unix(1000, 5, 1);
        for _ in 0..2 {
            p.take(&a, Resource::Connection).expect("within the quota of 3");
        }
        let before = p.rules();
        p.replace(rules(2));
        assert_eq!(before.quota("a").connections, Some(3), "rules already handed out do not change");
        assert_eq!(p.usage("a").connections, 2, "what the tenant holds survives the reload");
        let e = p.take(&a, Resource::Connection).unwrap_err();
        assert!(e.message.contains("holds 2 of its quota of 2 connections"), "the new quota applies: {}", e.message);
        p.give(&a, Resource::Connection);
        p.take(&a, Resource::Connection).expect("back under the new quota");
        p.replace(Rules::default());
        assert_eq!(p.rules().unix(1000, 5, 1).tenant, None, "a principal the new rules drop is nobody");
    }
}
