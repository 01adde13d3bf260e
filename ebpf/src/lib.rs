//! Provenance verdicts for pdstor payload transfers (DESIGN §7).
//!
//! A verdict says what the kernel was seen doing for one transfer: `native`
//! (the declared path, no copy), `fallback(<why>)` (seen taking a slower or
//! copying path) or `unverifiable(<what>)` (a probe that would tell could not
//! attach, or saw nothing). The BPF programs (`src/bpf/provenance.bpf.c`)
//! gather per-transfer [`Signals`]; [`Probes`] loads and attaches them;
//! [`judge`] turns signals into a verdict. Nothing here claims `native`
//! without a signal that says so.
#![deny(clippy::unwrap_used)]

mod facility;
mod hooks;
mod kallsyms;
mod loader;
mod program;
mod signals;

pub use facility::{TRACEFS, ensure_tracefs};
pub use loader::{PIN_DIR, Probes, SignalReader, SkipRuns, detach_pinned, read_pinned};
pub use program::{ProbeError, ProgramStatus};
pub use signals::{Attached, Declared, Signals, TargetClass, judge};

use std::fmt;
use std::str::FromStr;

/// How many low bits of an io_uring `user_data` name the segment within a
/// transfer: `user_data = transfer_id << SEGMENT_BITS | segment`. The BPF
/// programs shift by the same count (`PDSTOR_SEGMENT_BITS` in
/// `src/bpf/provenance.h`; a test keeps the two equal), and the engine that
/// builds `user_data` must agree (the daemon asserts it where it composes both).
pub const SEGMENT_BITS: u32 = 16;

/// What the probes concluded about one transfer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Verdict {
    Native,
    Fallback(String),
    Unverifiable(String),
}

impl Verdict {
    /// Combines per-signal verdicts: any fallback wins (it is evidence of a
    /// copy); otherwise anything unverifiable makes the whole unverifiable;
    /// only unanimous `native` is `native`. No signals at all is unverifiable.
    pub fn combine<I: IntoIterator<Item = Verdict>>(signals: I) -> Verdict {
        let mut unverifiable: Vec<String> = Vec::new();
        let mut fallbacks: Vec<String> = Vec::new();
        let mut any = false;
        for v in signals {
            any = true;
            match v {
                Verdict::Native => {}
                Verdict::Fallback(why) => fallbacks.push(why),
                Verdict::Unverifiable(what) => unverifiable.push(what),
            }
        }
        if !fallbacks.is_empty() {
            Verdict::Fallback(fallbacks.join(","))
        } else if !unverifiable.is_empty() {
            Verdict::Unverifiable(unverifiable.join(","))
        } else if any {
            Verdict::Native
        } else {
            Verdict::Unverifiable("no probe signal".into())
        }
    }

    pub fn is_native(&self) -> bool {
        matches!(self, Verdict::Native)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Native => f.write_str("native"),
            Verdict::Fallback(why) => write!(f, "fallback({why})"),
            Verdict::Unverifiable(what) => write!(f, "unverifiable({what})"),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not a verdict: expected native, fallback(<why>) or unverifiable(<what>)")]
pub struct ParseVerdictError(String);

impl FromStr for Verdict {
    type Err = ParseVerdictError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let inner = |prefix: &str| s.strip_prefix(prefix).and_then(|r| r.strip_suffix(')')).filter(|r| !r.is_empty());
        if s == "native" {
            Ok(Verdict::Native)
        } else if let Some(why) = inner("fallback(") {
            Ok(Verdict::Fallback(why.into()))
        } else if let Some(what) = inner("unverifiable(") {
            Ok(Verdict::Unverifiable(what.into()))
        } else {
            Err(ParseVerdictError(s.into()))
        }
    }
}

impl serde::Serialize for Verdict {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Verdict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::Verdict::{self, *};

    #[test]
    fn the_segment_bits_agree_with_the_bpf_header() {
        let header = include_str!("bpf/provenance.h");
        let defined = header
            .lines()
            .find_map(|l| l.strip_prefix("#define PDSTOR_SEGMENT_BITS "))
            .and_then(|v| v.trim().parse::<u32>().ok());
        assert_eq!(defined, Some(super::SEGMENT_BITS), "provenance.h and SEGMENT_BITS disagree");
    }

    #[test]
    fn verdicts_round_trip_through_text() {
        for v in [Native, Fallback("page-cache".into()), Unverifiable("kprobe".into())] {
            assert_eq!(v.to_string().parse::<Verdict>(), Ok(v));
        }
        assert!("fallback()".parse::<Verdict>().is_err());
        assert!("nativ".parse::<Verdict>().is_err());
    }

    #[test]
    fn a_fallback_beats_native_and_silence_is_not_native() {
        assert_eq!(Verdict::combine([Native, Native]), Native);
        assert_eq!(
            Verdict::combine([Native, Fallback("bounce".into()), Unverifiable("x".into())]),
            Fallback("bounce".into())
        );
        assert_eq!(Verdict::combine([Native, Unverifiable("fentry".into())]), Unverifiable("fentry".into()));
        assert!(!Verdict::combine([]).is_native());
    }
}
