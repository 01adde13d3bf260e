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

use crate::machine::Ctx;
use pdstor_vmtest_spec::{DiskRole, Failure, Outcome};

/// One test: a name, the disk it exercises, and the function that runs it.
pub struct Test {
    pub name: &'static str,
    pub disk: Option<DiskRole>,
    pub run: fn(&Ctx) -> Checked,
}

/// The KV layout the suites' handoffs store under `model_id`.
pub(crate) fn test_layout(model_id: &str) -> pdstor_client::layout::Layout {
    pdstor_client::layout::Layout {
        model_id: model_id.into(),
        dtype: "bf16".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 32,
        chunk_tokens: 256,
        kv_format: "pdstor-test".into(),
    }
}

/// Why a test did not pass: it cannot run here, or it failed.
#[derive(Debug)]
pub enum Stop {
    /// What it needs that this guest lacks, and what runs it.
    Skip(String),
    /// How it failed.
    Fail(Failure),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stop::Skip(reason) => write!(f, "skipped: {reason}"),
            Stop::Fail(failure) => failure.fmt(f),
        }
    }
}

/// What a test (and a helper that may skip it) answers.
pub type Checked<T = ()> = Result<T, Stop>;

/// The provenance probes, attached for this process (the probes and
/// attribution suites both watch their own transfers).
pub(crate) fn attach_probes() -> Checked<pdstor_probes::Probes> {
    Ok(pdstor_probes::Probes::attach(std::process::id()).map_err(|e| e.to_string())?)
}

/// The test cannot run here: `reason` says what it needs and what runs it.
pub fn skip(reason: impl Into<String>) -> Stop {
    Stop::Skip(reason.into())
}

impl From<Failure> for Stop {
    fn from(f: Failure) -> Stop {
        Stop::Fail(f)
    }
}

/// A check that did not hold, in words.
impl From<String> for Stop {
    fn from(message: String) -> Stop {
        Stop::Fail(Failure::Check { message })
    }
}

impl From<&str> for Stop {
    fn from(message: &str) -> Stop {
        Stop::Fail(Failure::Check { message: message.to_owned() })
    }
}

/// A suite: its name (one of [`pdstor_vmtest_spec::SUITES`], which says what it proves) and its tests.
pub struct Suite {
    pub name: &'static str,
    pub tests: &'static [Test],
}

/// Every suite, in the order `--suite all` runs them: the order and names of
/// [`pdstor_vmtest_spec::SUITES`], which the host reads without building the suites.
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

/// A test's answer as the outcome the host reads.
pub(crate) fn outcome(r: Checked) -> Outcome {
    match r {
        Ok(()) => Outcome::Pass,
        Err(Stop::Skip(reason)) => Outcome::Skip(reason),
        Err(Stop::Fail(f)) => Outcome::Fail(f),
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
    fn a_skip_is_a_skip_and_a_failure_keeps_its_kind() {
        assert_eq!(outcome(Ok(())), Outcome::Pass);
        assert_eq!(outcome(Err(skip("needs the series kernel"))), Outcome::Skip("needs the series kernel".into()));
        // A message that merely starts like a skip is a failure.
        let looks_like_one = ["SKIP", ": not really"].concat();
        let f = outcome(Err(looks_like_one.clone().into()));
        assert_eq!(f, Outcome::Fail(Failure::Check { message: looks_like_one }));
        let c = Failure::Command { command: "mkfs.xfs /dev/nvme0n1".into(), detail: "exited with 1".into() };
        assert_eq!(outcome(Err(c.clone().into())), Outcome::Fail(c));
    }

    /// Skips are `skip(reason)`, never a string that starts with SKIP and a colon.
    #[test]
    fn no_suite_skips_by_a_string_prefix() {
        let mut dirs = vec![std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/src/suites"))];
        let mut files = 0;
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).flatten()
            {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                assert!(!text.contains(&format!("\"{}: ", "SKIP")), "{} skips by a string prefix", path.display());
                files += 1;
            }
        }
        assert!(files > 20, "only {files} suite files were read");
    }

    #[test]
    fn suites_are_the_ones_the_host_names() {
        let here: Vec<&str> = SUITES.iter().map(|s| s.name).collect();
        let host: Vec<&str> = pdstor_vmtest_spec::SUITES.iter().map(|(n, _)| *n).collect();
        assert_eq!(here, host, "vmtest/spec/src/lib.rs SUITES must list these suites in this order");
    }
}
