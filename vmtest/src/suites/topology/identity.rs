//! The reader host proves the namespace it reads is the owner's (its
//! superblock and NVMe identifiers) before it reads anything.

use crate::machine::{Ctx, sh};
use crate::suites::Checked;
use pdstor_vmtest_spec::SHARED_NQN;

use super::*;

/// Where the storage guest waits for the identity proof's report.
pub(super) const IDENTITY_PORT: u16 = 7075;

/// The owner serves its namespace (1 on the fabric); namespace 2 on the same
/// fabric controller is another pdstor namespace. The reader host's view of
/// namespace 1 is accepted — its superblock is the owner's and its NVMe UUID
/// is the one the owner's device reports — and namespace 2 is refused before
/// anything is read.
pub(super) fn identity(_: &Ctx) -> Checked {
    by_role(identity_owner, identity_reader)
}

pub(super) fn identity_owner() -> Checked {
    let other = fabric_namespace_n(2)?.to_string_lossy().into_owned();
    sh("/bin/pdstor", &["format", "--force", "--journal", "1M", "--chunk-slot", "256K", "--target", &other])?;
    let _daemon = serve_owner("/tmp/vmtest/topology-serve-identity.log")?;
    let line = serve_once(IDENTITY_PORT, Some("serving"))?;
    if line.trim() != "ok" {
        return Err(format!("the reader host reported {:?}", line.trim()).into());
    }
    Ok(())
}

pub(super) fn identity_reader() -> Checked {
    use pdstor_client::{Client, RemoteReader};
    let (mut peer, _serving) = from_owner(IDENTITY_PORT)?;
    let result = (|| -> Checked {
        connect()?;
        let (mine, other) = (fabric_namespace_n(1)?, fabric_namespace_n(2)?);
        let server = format!("http://{CONTROL}");
        let owner = Client::new(&server).namespace().map_err(|e| format!("the owner's namespace: {e}"))?;
        let r =
            RemoteReader::open(&server, &mine).map_err(|e| format!("the owner's namespace over the fabric: {e}"))?;
        if owner.device.uuid.is_none() || r.device_ids().uuid != owner.device.uuid {
            return Err(format!(
                "the NVMe identity was not proven: here {:?}, at the owner {:?}",
                r.device_ids(),
                owner.device
            )
            .into());
        }
        match RemoteReader::open(&server, &other) {
            Err(e) if e.to_string().contains("not the same namespace") => Ok(()),
            Err(e) => Err(format!("namespace 2 was refused for another reason: {e}").into()),
            Ok(_) => Err("namespace 2, another pdstor namespace, was accepted as the owner's".into()),
        }
    })();
    let report = match &result {
        Ok(()) => "ok".to_owned(),
        Err(e) => format!("fail {e}"),
    };
    let _ = peer.send(&report);
    let _ = sh("nvme", &["disconnect", "-n", SHARED_NQN]);
    result
}
