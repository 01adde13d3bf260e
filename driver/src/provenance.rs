//! Where pdstor's payload vocabulary meets the provenance probes'
//! (`pdstor_probes`): the engine (`io`) knows nothing of its observer, and
//! the probes know nothing of the engine; the daemon and the ladder compose
//! the two through this module.

use pdstor_engine::io::{PayloadPath, SEGMENT_BITS, TargetKind};
use pdstor_probes::{Declared, TargetClass};

// The BPF programs recover a transfer id from `user_data` by shifting out
// the segment bits; the engine packs them. Both must use the same count.
const _: () = assert!(SEGMENT_BITS == pdstor_probes::SEGMENT_BITS, "io::SEGMENT_BITS differs from the probes'");

/// The path as the provenance probes judge it.
pub fn declared(path: PayloadPath) -> Declared {
    match path {
        PayloadPath::Host => Declared::Host,
        PayloadPath::HostFixed => Declared::HostFixed,
        PayloadPath::DmabufFixed => Declared::DmabufFixed,
    }
}

/// The target as the provenance probes judge it.
pub fn target_class(kind: TargetKind) -> TargetClass {
    match kind {
        TargetKind::File => TargetClass::File,
        TargetKind::BlockDevice => TargetClass::BlockDevice,
        TargetKind::NvmeGeneric => TargetClass::NvmePassthrough,
    }
}

/// The provenance probes attached to this process, judging a reader host's
/// own reads for [`pdstor_client::RemoteReader::with_judge`].
pub struct ProbeJudge {
    /// Kept alive: dropping it detaches the programs.
    _probes: pdstor_probes::Probes,
    reader: pdstor_probes::SignalReader,
}

impl ProbeJudge {
    /// Attaches the probes to this process (root, or CAP_BPF + CAP_PERFMON).
    pub fn attach() -> Result<ProbeJudge, String> {
        let probes = pdstor_probes::Probes::attach(std::process::id())
            .map_err(|e| format!("attaching the provenance probes: {e}"))?;
        let reader = probes.reader().map_err(|e| format!("reading the probes: {e}"))?;
        Ok(ProbeJudge { _probes: probes, reader })
    }
}

impl pdstor_client::Judge for ProbeJudge {
    fn verdict(&self, transfer: pdstor_engine::io::TransferId, path: PayloadPath, target: TargetKind) -> String {
        self.reader.verdict(transfer.0, declared(path), target_class(target)).to_string()
    }
}
