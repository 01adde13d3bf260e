//! The contract suites the guest runs. Adding a suite is one entry in
//! [`SUITES`]; adding a test is one entry in its suite's table.

mod attribution;
mod dmabuf;
mod faults;
mod io;
mod oracle;
mod probes;
mod protocol;
mod swiotlb;
mod topology;

use crate::guest::Ctx;
use crate::{DiskRole, Outcome};

/// One test: a name, the disk it exercises, and the function that runs it.
pub struct Test {
    pub name: &'static str,
    pub disk: Option<DiskRole>,
    pub run: fn(&Ctx) -> Outcome,
}

/// A suite: its name (one of [`crate::SUITES`], which says what it proves) and its tests.
pub struct Suite {
    pub name: &'static str,
    pub tests: &'static [Test],
}

/// Every suite, in the order `--suite all` runs them: the order and names of
/// [`crate::SUITES`], which the host reads without building the suites.
pub const SUITES: &[Suite] = &[
    io::SUITE,
    faults::SUITE,
    probes::SUITE,
    protocol::SUITE,
    dmabuf::SUITE,
    oracle::SUITE,
    swiotlb::SUITE,
    topology::SUITE,
];

pub fn find(name: &str) -> Option<&'static Suite> {
    SUITES.iter().find(|s| s.name == name)
}

/// Turns a test body's `Result` into an outcome.
pub(crate) fn outcome(r: Result<(), String>) -> Outcome {
    match r {
        Ok(()) => Outcome::Pass,
        Err(e) if e.starts_with("SKIP: ") => Outcome::Skip(e.trim_start_matches("SKIP: ").into()),
        Err(e) => Outcome::Fail(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suite_and_test_names_are_unique() {
        for (i, s) in SUITES.iter().enumerate() {
            assert!(SUITES[i + 1..].iter().all(|o| o.name != s.name), "suite {} twice", s.name);
            for (j, t) in s.tests.iter().enumerate() {
                assert!(s.tests[j + 1..].iter().all(|o| o.name != t.name), "{}/{} twice", s.name, t.name);
            }
        }
        assert!(find("io").is_some() && find("nope").is_none());
    }

    #[test]
    fn suites_are_the_ones_the_host_names() {
        let here: Vec<&str> = SUITES.iter().map(|s| s.name).collect();
        let host: Vec<&str> = crate::SUITES.iter().map(|(n, _)| *n).collect();
        assert_eq!(here, host, "vmtest/spec/src/lib.rs SUITES must list these suites in this order");
    }
}
