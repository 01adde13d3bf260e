//! `topology`: two guests on a private QEMU network (nothing else on it),
//! each its own kernel. The *storage* guest exports its raw NVMe namespace
//! with the kernel's NVMe/TCP target (`nvmet`, configured through configfs);
//! the *reader* guest, which has no NVMe of its own, connects with the
//! kernel's initiator (`nvme connect -t tcp`) and reads the namespace with
//! `O_DIRECT`. `cargo xtask vmtest --suite topology` boots both; a guest
//! booted alone says SKIP.

use pdstor_engine::payload;

use crate::machine::cmdline;
use crate::suites::{Checked, Suite, Test, skip};
use pdstor_vmtest_spec::Failure;

mod death;
mod durability;
mod fabric;
mod handoff;
mod identity;
mod namespace;
mod owner;
mod owners;
mod partition;
mod peer;
mod power;
mod power_takeover;
mod reservation;
mod restarts;
mod takeover;
mod visibility;

use death::*;
use durability::*;
use fabric::*;
use handoff::*;
use identity::*;
use namespace::*;
use owner::*;
use owners::*;
use partition::*;
use peer::*;
use power::*;
use power_takeover::*;
use reservation::*;
use restarts::*;
use takeover::*;
use visibility::*;

pub const SUITE: Suite = Suite {
    name: "topology",
    tests: &[
        Test { name: "shared_namespace_over_nvme_tcp", disk: None, run: shared_namespace },
        Test { name: "the_reader_proves_it_sees_the_owners_namespace", disk: None, run: identity },
        Test { name: "handoff_to_a_reader_host", disk: None, run: handoff },
        Test { name: "a_published_chunk_is_visible_to_the_reader_host_through_no_cache", disk: None, run: visibility },
        Test { name: "ready_is_at_the_target_before_the_writer_host_is_gone", disk: None, run: durability },
        Test { name: "the_owner_restarts_while_a_reader_host_loads", disk: None, run: restarts },
        // The storage guest loses power in it and boots again at it.
        Test { name: POWER_TEST, disk: None, run: power_cut },
        Test { name: "a_fenced_reader_host_is_cut_off_by_its_reservation", disk: None, run: reservation },
        Test { name: "a_standby_takes_over_a_killed_owner", disk: None, run: takeover },
        // The reader guest (the owner here) loses power in it and boots again at it.
        Test { name: POWER_TAKEOVER_TEST, disk: None, run: power_takeover },
        Test { name: "two_owners_side_by_side", disk: None, run: two_owners },
        Test { name: "a_partitioned_owner_is_taken_over_and_says_so", disk: None, run: partition },
        // Last: the reader host does not survive it.
        Test { name: "a_dead_reader_host_is_fenced_then_reclaimed", disk: None, run: reader_death },
    ],
};

/// The owner's control plane on the private network (plaintext: nothing
/// else is on that network; `--insecure-tcp` says so at every start).
const CONTROL: &str = "10.77.0.1:7078";

fn kv_layout() -> pdstor_client::layout::Layout {
    crate::suites::test_layout("vmtest-topology")
}

/// The writer host's NVMe identity (the storage guest's own connection).
const WRITER_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e1";

const WRITER_HOSTID: &str = "5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e1";

/// The reader host's NVMe identity.
const READER_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e4";

const READER_HOSTID: &str = "5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e4";

/// A third NVMe host on the reader guest: its own host NQN and host ID, so
/// its own controller and its own reservation registration at the target —
/// to the target, a host of its own (a direct reader's, beside a standby).
const THIRD_HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e7";

const THIRD_HOSTID: &str = "5d1e7c2a-4b0f-4e8e-9a51-70b0a1d2c3e7";

/// Runs this guest's side of a topology test: `storage` on the storage
/// (writer) host, `reader` on the reader host; SKIP in a guest booted alone.
fn by_role(storage: impl FnOnce() -> Checked, reader: impl FnOnce() -> Checked) -> Checked {
    match cmdline("role").as_deref() {
        None => Err(skip("not a topology guest (cargo xtask vmtest --suite topology boots two)")),
        Some("storage") => Ok(storage()?),
        Some("reader") => Ok(reader()?),
        Some(other) => Err(Failure::Setup { message: format!("unknown topology role {other:?}") }.into()),
    }
}

/// The owner's data plane, for the writer on the storage guest.
const DATA_SOCKET: &str = "/tmp/vmtest/topology-data.sock";

/// The size of namespace 3, the small file-backed one.
const SMALL_NAMESPACE: u64 = 12 << 20;

fn seeded(seed: u64, chunks: u32) -> Vec<u8> {
    (0..chunks as u64).flat_map(|i| payload::chunk(seed, i, HANDOFF_CHUNK as usize)).collect()
}
