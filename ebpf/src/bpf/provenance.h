/* Shared between the BPF programs and the Rust loader: the per-transfer
 * signals the kernel was seen producing. Keys and values are BTF-typed, so
 * `bpftool map dump pinned /sys/fs/bpf/pdstor/signals` prints named fields. */
#ifndef PDSTOR_PROVENANCE_H
#define PDSTOR_PROVENANCE_H

/* user_data = transfer_id << SEGMENT_BITS | segment slot (engine/src/io/ring.rs). */
#define PDSTOR_SEGMENT_BITS 16

/* A file pages may be cached for: the kernel dev_t (major << 20 | minor)
 * of its filesystem and its inode number. */
struct file_key {
	__u64 dev;
	__u64 ino;
};

struct transfer_key {
	__u64 transfer;
};

struct transfer_signals {
	__u64 submits;          /* io_uring_submit_req of this transfer */
	__u64 fixed_ops;        /* ... with READ_FIXED / WRITE_FIXED */
	__u64 plain_ops;        /* ... with READ / WRITE / READV / WRITEV */
	__u64 uring_cmds;       /* ... with URING_CMD (passthrough) */
	__u64 completions;      /* io_uring_complete */
	__s64 last_res;         /* res of the last completion */
	__u64 dio_bvec;         /* iomap direct I/O on a bvec iterator: a registered buffer */
	__u64 dio_user;         /* iomap direct I/O on a user-memory iterator */
	__u64 page_cache_adds;  /* page-cache insertions while this transfer was current */
	__u64 rq_issued;        /* block requests that carried this transfer's bios, each counted once
	                         * however often blk-mq dispatched it (see rq_reissued) */
	__u64 rq_bytes;         /* ... this transfer's bytes in them (a shared request: only its own) */
	__u64 cmd_fixed_imports;/* io_uring_cmd_import_fixed: passthrough on a registered buffer (kprobe) */
	__u64 swiotlb_bounces;  /* swiotlb_tbl_map_single: a DMA bounce through swiotlb (kprobe) */
	__u64 dmabuf_cpu_access;/* dma_buf_begin_cpu_access: the CPU touched a DMA-BUF (kprobe) */
	__u64 passthrough_bounces;/* blk_rq_map_user_iov on a buffer the queue must copy (kprobe) */
	__u64 nvme_cmds;        /* nvme:nvme_setup_cmd issued while this transfer was current */
	__u64 nvme_blocks;      /* logical blocks those Read/Write commands moved (NLB + 1) */
	__u64 rq_completed;     /* block requests of this transfer completed (any context, once each) */
	__u64 rq_errors;        /* ... that completed with an error */
	__u64 dmabuf_token_bios;/* bio_dmabuf_map_set: a bio built on a DMA-BUF's DMA mapping, the
	                         * rw-dmabuf series' DMA-token path (kprobe; that kernel only) */
	__u64 dmabuf_bounced_bios;/* ... of those, bios on a DMA-BUF mapping that swiotlb bounced when the
	                         * mapping was made (nvme_dmabuf_token_map; possibly in an earlier
	                         * transfer): the device moves bytes to and from bounce pages */
	__u64 bios;             /* bios attributed to this transfer where the block layer took them in
	                         * (block_bio_queue, by the bio's own completion context) or split them */
	__u64 rq_off_process;   /* requests of this transfer issued by a task outside the traced
	                         * process: a kworker running the queue, another task's plug */
	__u64 rq_reissued;      /* dispatches of a request already issued (a requeue after the driver
	                         * or device was busy): not counted again in rq_issued */
	__u64 rq_shared;        /* requests that carried other bios too (another transfer's, or I/O
	                         * no transfer made) beside this transfer's */
	__u64 rq_completed_unseen;/* requests of this transfer that completed (their io_uring request
	                         * did, which needs every bio ended) while no program saw
	                         * block_rq_complete: the kernel does not run BPF programs in an
	                         * interrupt that lands on a CPU where BPF is busy (see the header) */
	__u64 dmabuf_token_rqs; /* requests seen (at issue, at their NVMe command: up to two sightings
	                         * each) carrying this transfer's bios on a DMA-BUF's DMA mapping
	                         * (BIO_DMABUF_MAP): the DMA-token path's second witness */
	__u64 cmd_fixed_rqs;    /* passthrough requests seen (likewise) whose io_uring_cmd asked for
	                         * the registered buffer (IORING_URING_CMD_FIXED): the fixed
	                         * passthrough's second witness */
	__u64 rq_issue_unseen;  /* requests of this transfer first seen completing: neither block_rq_issue
	                         * nor nvme_setup_cmd ran a program for their issue (counted in
	                         * rq_issued and rq_bytes then) */
};

/* Who made a bio: the transfer, and the io_uring request (io_kiocb) whose
 * completion proves the bio ended. */
struct bio_tag {
	__u64 transfer;
	__u64 req;
};

/* A request seen at issue, so that its completion counts once and a
 * dispatch of the same request again (a requeue) is told from a new one. */
struct rq_state {
	__u64 bio;       /* its first bio and start sector at issue: a request */
	__u64 sector;    /* reused for other I/O has another pair */
	__u64 transfer;  /* a passthrough request's transfer (it has no queued bio); 0 otherwise */
	__u64 req;       /* ... and its io_uring request */
	__u64 evidence;  /* what the request itself shows (EVIDENCE_*) */
};

/* What a request shows of the path its transfer took. */
#define EVIDENCE_DMABUF_TOKEN 1 /* a bio on a DMA-BUF's DMA mapping */
#define EVIDENCE_CMD_FIXED 2    /* a passthrough command on a registered buffer */

/* test_skip: the runs a test makes the programs skip (Probes::attach_skipping). */
#define SKIP_SUBMIT 1    /* io_uring_submit_req */
#define SKIP_BIO_QUEUE 2 /* block_bio_queue */
#define SKIP_RQ_ISSUE 4  /* block_rq_issue */
#define SKIP_HOOKS 8     /* bio_dmabuf_map_set, io_uring_cmd_import_fixed */
#define SKIP_RQ_COMPLETE 16 /* block_rq_complete */

/* Per-CPU counters of submitted payload ops, by kind. */
enum path_counter {
	COUNT_PLAIN = 0,
	COUNT_FIXED = 1,
	COUNT_URING_CMD = 2,
	COUNT_MAX = 3,
};

#endif
