//! Data-plane connection shares. Connections are a thread each and there
//! are `--max-data-connections` of them; without shares one tenant (or a uid
//! the config names nowhere) could hold them all and lock every other
//! tenant out. Each tenant of the config is guaranteed a share: `max /
//! tenants`, at most 8 — a connection is refused when taking it would leave
//! less free than the guarantees of the other tenants not yet met. A tenant
//! alone in the config (the default) may use every connection. A caller of
//! no tenant is its own share key (`uid:N`) with no guarantee. The tenants
//! are the config's at each connection, so a reload that adds one gives it
//! its guarantee from then on.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Who holds how many data-plane connections.
pub(super) struct Shares {
    max: usize,
    open: Mutex<HashMap<String, usize>>,
}

/// One connection held by a share key, given back when dropped.
pub(super) struct Share {
    shares: Arc<Shares>,
    key: String,
}

impl Shares {
    /// `max` connections.
    pub(super) fn new(max: usize) -> Arc<Shares> {
        Arc::new(Shares { max, open: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One more connection for `key` among the config's `tenants`, or why
    /// not (for the refusal's message).
    pub(super) fn take(self: &Arc<Self>, key: &str, tenants: &BTreeSet<String>) -> Result<Share, String> {
        let guaranteed = if tenants.len() < 2 { 0 } else { (self.max / tenants.len()).clamp(1, 8) };
        let mut open = self.lock();
        let total: usize = open.values().sum();
        let kept: usize = tenants
            .iter()
            .filter(|t| t.as_str() != key)
            .map(|t| guaranteed.saturating_sub(open.get(t.as_str()).copied().unwrap_or(0)))
            .sum();
        if total + 1 + kept > self.max {
            let mine = open.get(key).copied().unwrap_or(0);
            return Err(if total >= self.max {
                format!("{total} data-plane connections are open (--max-data-connections {}): retry later", self.max)
            } else {
                format!(
                    "{total} of {} data-plane connections are open, {mine} of them {key}'s, and the other {kept} are kept for the other tenants' guaranteed shares ({} each): close one of yours, or raise --max-data-connections",
                    self.max, guaranteed
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
        let two = tenants(&["default", "mallory"]);
        let s = Shares::new(24);
        let mallory: Vec<Share> = (0..16).map(|_| s.take("mallory", &two).expect("within its share")).collect();
        let e = s.take("mallory", &two).err().expect("the 17th is refused");
        assert!(e.contains("kept for the other tenants' guaranteed shares (8 each)"), "{e}");
        let mine: Vec<Share> = (0..8).map(|_| s.take("default", &two).expect("the guarantee holds")).collect();
        assert!(s.take("default", &two).err().expect("full").contains("24 data-plane connections are open"));
        drop(mallory);
        drop(mine);
        assert!(s.lock().is_empty(), "every share was given back");
        let one = tenants(&["default"]);
        let alone = Shares::new(4);
        let all: Vec<Share> = (0..4).map(|_| alone.take("default", &one).expect("all of it")).collect();
        assert!(alone.take("default", &one).is_err());
        drop(all);
        // A uid of no tenant has no guarantee and cannot eat the tenants'.
        let (ab, s) = (tenants(&["a", "b"]), Shares::new(20));
        let _nobody: Vec<Share> = (0..4).map(|_| s.take("uid:4003", &ab).expect("what is not kept")).collect();
        assert!(s.take("uid:4003", &ab).is_err());
        assert!(s.take("a", &ab).is_ok() && s.take("b", &ab).is_ok());
    }

    #[test]
    fn a_tenant_a_reload_adds_is_guaranteed_its_share_from_then_on() {
        let s = Shares::new(16);
        let before = tenants(&["default"]);
        let held: Vec<Share> = (0..12).map(|_| s.take("default", &before).expect("alone, all of it")).collect();
        let after = tenants(&["default", "team-b"]);
        let e = s.take("default", &after).err().expect("team-b's 8 are kept");
        assert!(e.contains("kept for the other tenants' guaranteed shares (8 each)"), "{e}");
        let b: Vec<Share> = (0..4).map(|_| s.take("team-b", &after).expect("what is left")).collect();
        drop((held, b));
    }
}
