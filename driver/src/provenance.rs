//! Where pdstor's payload vocabulary meets the provenance probes'
//! (`pdstor_probes`): the engine (`io`) knows nothing of its observer, and
//! the probes know nothing of the engine; the daemon and the ladder compose
//! the two through this module.

use crate::io::{PayloadPath, SEGMENT_BITS, TargetKind};
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
