//! Data-plane connection shares. Connections are a thread each and there
//! are `--max-data-connections` of them; without shares one tenant (or a uid
//! the config names nowhere) could hold them all and lock every other
//! tenant out. Each tenant of the config is guaranteed a share: `max /
//! tenants`, at most 8 — a connection is refused when taking it would leave
//! less free than the guarantees of the other tenants not yet met. A tenant
//! alone in the config (the default) may use every connection. A caller of
//! no tenant is its own share key (`uid:N`) with no guarantee.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Who holds how many data-plane connections.
pub(super) struct Shares {
    max: usize,
    guaranteed: usize,
    tenants: BTreeSet<String>,
    open: Mutex<HashMap<String, usize>>,
}

/// One connection held by a share key, given back when dropped.
pub(super) struct Share {
    shares: Arc<Shares>,
    key: String,
}

impl Shares {
    /// `max` connections among the config's `tenants`.
    pub(super) fn new(max: usize, tenants: BTreeSet<String>) -> Arc<Shares> {
        let guaranteed = if tenants.len() < 2 { 0 } else { (max / tenants.len()).clamp(1, 8) };
        Arc::new(Shares { max, guaranteed, tenants, open: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One more connection for `key`, or why not (for the refusal's message).
    pub(super) fn take(self: &Arc<Self>, key: &str) -> Result<Share, String> {
        let mut open = self.lock();
        let total: usize = open.values().sum();
        let kept: usize = self
            .tenants
            .iter()
            .filter(|t| t.as_str() != key)
            .map(|t| self.guaranteed.saturating_sub(open.get(t.as_str()).copied().unwrap_or(0)))
            .sum();
        if total + 1 + kept > self.max {
            let mine = open.get(key).copied().unwrap_or(0);
            return Err(if total >= self.max {
                format!("{total} data-plane connections are open (--max-data-connections {}): retry later", self.max)
            } else {
                format!(
                    "{total} of {} data-plane connections are open, {mine} of them {key}'s, and the other {kept} are kept for the other tenants' guaranteed shares ({} each): close one of yours, or raise --max-data-connections",
                    self.max, self.guaranteed
                )
            });
        }
        *open.entry(key.to_owned()).or_insert(0) += 1;
        Ok(Share { shares: self.clone(), key: key.to_owned() })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut open = self.shares.lock();
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenants(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn no_tenant_takes_the_others_guarantees_and_one_alone_takes_all() {
        let s = Shares::new(24, tenants(&["default", "mallory"]));
        let mallory: Vec<Share> = (0..16).map(|_| s.take("mallory").expect("within its share")).collect();
        let e = s.take("mallory").err().expect("the 17th is refused");
        assert!(e.contains("kept for the other tenants' guaranteed shares (8 each)"), "{e}");
        let mine: Vec<Share> = (0..8).map(|_| s.take("default").expect("the guarantee holds")).collect();
        assert!(s.take("default").err().expect("full").contains("24 data-plane connections are open"));
        drop(mallory);
        drop(mine);
        assert!(s.lock().is_empty(), "every share was given back");
        let alone = Shares::new(4, tenants(&["default"]));
        let all: Vec<Share> = (0..4).map(|_| alone.take("default").expect("all of it")).collect();
        assert!(alone.take("default").is_err());
        drop(all);
        // A uid of no tenant has no guarantee and cannot eat the tenants'.
        let s = Shares::new(20, tenants(&["a", "b"]));
        let _nobody: Vec<Share> = (0..4).map(|_| s.take("uid:4003").expect("what is not kept")).collect();
        assert!(s.take("uid:4003").is_err());
        assert!(s.take("a").is_ok() && s.take("b").is_ok());
    }
}
