//! Small chunks go to the device as fewer, larger commands. A per-layer KV
//! layout stores 16–64 KiB chunks; one command each spends more per byte in
//! submission and completion than the device spends moving it. Chunks that
//! lie back to back on the target *and* in one buffer, with the same
//! operation and path, are merged into one request of at most the store's
//! `merge_bytes`; each chunk keeps its own checksum, taken over its own range
//! once the merged request completes, and its own result.
//!
//! Pure: [`coalesce`] only groups; the I/O thread submits the groups.

use std::ops::Range;

use pdstor_engine::io::{IoRequest, PayloadPath};

/// One request as submitted, and the chunks (indexes into the batch) it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Run {
    /// The merged request: the first chunk's transfer id, the run's whole range.
    pub request: IoRequest,
    /// The batch indexes it covers, in order.
    pub parts: Range<usize>,
}

/// Groups `batch` into runs, in order. A request joins the run before it when
/// both are smaller than `merge_bytes`, the run stays within `merge_bytes`,
/// and it continues the run exactly: the same operation, path and buffer, its
/// buffer range and its target range each starting where the run's ends.
/// DMA-BUF requests are never merged (their CPU access is bracketed per
/// request). `merge_bytes` 0 merges nothing.
pub(super) fn coalesce(batch: &[IoRequest], merge_bytes: u64) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::with_capacity(batch.len());
    for (i, r) in batch.iter().enumerate() {
        if let Some(run) = runs.last_mut()
            && continues(&run.request, r, merge_bytes)
        {
            run.request.len += r.len;
            run.parts.end = i + 1;
            continue;
        }
        runs.push(Run { request: *r, parts: i..i + 1 });
    }
    runs
}

fn continues(run: &IoRequest, next: &IoRequest, merge_bytes: u64) -> bool {
    next.len < merge_bytes
        && run.path != PayloadPath::DmabufFixed
        && run.op == next.op
        && run.path == next.path
        && run.buffer == next.buffer
        && run.buffer_offset.0.checked_add(run.len) == Some(next.buffer_offset.0)
        && run.target_offset.0.checked_add(run.len) == Some(next.target_offset.0)
        && run.len.checked_add(next.len).is_some_and(|l| l <= merge_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdstor_engine::io::{BufferId, BufferOffset, Op, TargetOffset, TransferId};

    fn req(i: u32, buffer: u32, buffer_offset: u64, target_offset: u64, len: u64) -> IoRequest {
        IoRequest {
            transfer: TransferId::chunk(7, i),
            op: Op::Read,
            path: PayloadPath::HostFixed,
            buffer: BufferId(buffer),
            buffer_offset: BufferOffset(buffer_offset),
            target_offset: TargetOffset(target_offset),
            len,
        }
    }

    const K16: u64 = 16 << 10;

    #[test]
    fn back_to_back_small_chunks_merge_up_to_the_limit() {
        let batch: Vec<IoRequest> =
            (0..10).map(|i| req(i, 1, i as u64 * K16, (1 << 20) + i as u64 * K16, K16)).collect();
        let runs = coalesce(&batch, 4 * K16);
        assert_eq!(runs.iter().map(|r| r.parts.clone()).collect::<Vec<_>>(), vec![0..4, 4..8, 8..10]);
        assert_eq!(runs[1].request.transfer, TransferId::chunk(7, 4), "a run carries its first chunk's id");
        assert_eq!(runs[1].request.buffer_offset.0, 4 * K16);
        assert_eq!(runs[1].request.target_offset.0, (1 << 20) + 4 * K16);
        assert_eq!(runs[1].request.len, 4 * K16);
        assert_eq!(runs[2].request.len, 2 * K16);
    }

    #[test]
    fn any_break_in_contiguity_or_kind_starts_a_new_run() {
        let base = |i: u32| req(i, 1, i as u64 * K16, i as u64 * K16, K16);
        let mut gap_target = base(1);
        gap_target.target_offset.0 += 4096;
        let mut gap_buffer = base(1);
        gap_buffer.buffer_offset.0 += 4096;
        let mut other_buffer = base(1);
        other_buffer.buffer = BufferId(2);
        let mut write = base(1);
        write.op = Op::Write;
        let mut host = base(1);
        host.path = PayloadPath::Host;
        let mut backwards = base(1);
        backwards.target_offset.0 = 0;
        backwards.buffer_offset.0 = 0;
        for (what, second) in [
            ("a gap on the target", gap_target),
            ("a gap in the buffer", gap_buffer),
            ("another buffer", other_buffer),
            ("another op", write),
            ("another path", host),
            ("the same range again", backwards),
        ] {
            let runs = coalesce(&[base(0), second], 1 << 20);
            assert_eq!(runs.len(), 2, "{what} must not merge: {runs:?}");
        }
        assert_eq!(coalesce(&[base(0), base(1)], 1 << 20).len(), 1, "the control merges");
    }

    #[test]
    fn large_chunks_dmabufs_and_a_zero_limit_stay_alone() {
        let big: Vec<IoRequest> = (0..3).map(|i| req(i, 1, (i as u64) << 20, (i as u64) << 20, 1 << 20)).collect();
        assert_eq!(coalesce(&big, 1 << 20).len(), 3, "a chunk of the limit's size is sent alone");
        let small: Vec<IoRequest> = (0..3).map(|i| req(i, 1, i as u64 * K16, i as u64 * K16, K16)).collect();
        assert_eq!(coalesce(&small, 0).len(), 3);
        let dmabuf: Vec<IoRequest> = small.iter().map(|r| IoRequest { path: PayloadPath::DmabufFixed, ..*r }).collect();
        assert_eq!(coalesce(&dmabuf, 1 << 20).len(), 3);
        assert!(coalesce(&[], 1 << 20).is_empty());
    }
}
