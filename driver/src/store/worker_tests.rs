//! The I/O thread's loop on a real file: payload jobs queued together go to
//! the device as one submission, each answered its own results, and one
//! job's refused request fails only that job.

use std::sync::Arc;
use std::sync::mpsc::channel;

use super::backing::Backing;
use super::storage::Media;
use super::worker::{Job, PayloadReply, Worker};
use pdstor_engine::buffer::Buffer;
use pdstor_engine::io::{
    BufferId, BufferOffset, IoError, IoRequest, Op, PayloadPath, Target, TargetOffset, TargetOptions, TransferId,
};

const CHUNK: u64 = 64 << 10;

fn request(op: Op, buffer: BufferId, chunk: u32) -> IoRequest {
    IoRequest {
        transfer: TransferId::chunk(1, chunk),
        op,
        path: PayloadPath::HostFixed,
        buffer,
        buffer_offset: BufferOffset(u64::from(chunk) * CHUNK),
        target_offset: TargetOffset((1 << 20) + u64::from(chunk) * 2 * CHUNK),
        len: CHUNK,
    }
}

/// Queues `jobs` (each answered on its own channel) before the loop starts,
/// so that it finds them all at once, then stops it; answers each reply and
/// the chunks the worker submitted in all.
fn run_queued(jobs: Vec<Vec<IoRequest>>, fill: &[u8]) -> (Vec<PayloadReply>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target.img");
    let target =
        Target::open(&path, &TargetOptions { create_len: Some(4 << 20), allocate: true, read_only: false }).unwrap();
    let (mut worker, _, _) = Worker::open(Backing::Target(target), 8, 0, 0, Arc::new(Media)).unwrap();
    let buffer = Buffer::host(fill.len()).unwrap();
    buffer.write_at(0, fill).unwrap();
    let id = worker.register_for_test(buffer).unwrap();
    assert_eq!(id, BufferId(1), "the buffer the requests name");
    let counters = worker.counters();
    let (tx, rx) = channel();
    let mut replies = Vec::new();
    for requests in jobs {
        let (reply, answer) = channel();
        tx.send(Job::Io(requests, reply)).unwrap();
        replies.push(answer);
    }
    tx.send(Job::Stop).unwrap();
    worker.run(rx);
    let answers = replies.into_iter().map(|r| r.recv().unwrap()).collect();
    (answers, counters.chunks.load(std::sync::atomic::Ordering::Relaxed))
}

#[test]
fn jobs_queued_together_are_one_submission_each_answered_its_own() {
    let fill: Vec<u8> = (0..4 * CHUNK).map(|i| (i % 251) as u8).collect();
    let crc = |chunk: u64| crc32c::crc32c(&fill[(chunk * CHUNK) as usize..((chunk + 1) * CHUNK) as usize]);
    let ok = BufferId(1);
    let (answers, chunks) = run_queued(
        vec![vec![request(Op::Write, ok, 0), request(Op::Write, ok, 1)], vec![request(Op::Write, ok, 3)]],
        &fill,
    );
    let crcs: Vec<Vec<Option<u32>>> =
        answers.into_iter().map(|a| a.unwrap().into_iter().map(Result::unwrap).collect()).collect();
    assert_eq!(crcs, vec![vec![Some(crc(0)), Some(crc(1))], vec![Some(crc(3))]]);
    assert_eq!(chunks, 3, "every chunk submitted once");
}

#[test]
fn a_refused_job_fails_alone_and_the_others_queued_with_it_complete() {
    let fill = vec![0x5a_u8; (4 * CHUNK) as usize];
    let (ok, unknown) = (BufferId(1), BufferId(9));
    let (answers, chunks) = run_queued(
        vec![
            vec![request(Op::Write, ok, 0)],
            vec![request(Op::Write, unknown, 1)],
            vec![request(Op::Write, ok, 2), request(Op::Read, ok, 0)],
        ],
        &fill,
    );
    assert!(matches!(answers[1], Err(IoError::UnknownBuffer(BufferId(9)))), "{:?}", answers[1]);
    for a in [&answers[0], &answers[2]] {
        let a = a.as_ref().expect("the other jobs ran");
        assert!(a.iter().all(|r| r.as_ref().is_ok_and(|c| *c == Some(crc32c::crc32c(&fill[..CHUNK as usize])))));
    }
    // The merged submission was refused as a whole, then each job ran alone.
    assert_eq!(chunks, 4 + 4);
}
