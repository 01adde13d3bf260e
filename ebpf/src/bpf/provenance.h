/* Shared between the BPF programs and the Rust loader: the per-transfer
 * signals the kernel was seen producing. Keys and values are BTF-typed, so
 * `bpftool map dump pinned /sys/fs/bpf/pdstor/signals` prints named fields. */
#ifndef PDSTOR_PROVENANCE_H
#define PDSTOR_PROVENANCE_H

/* user_data = transfer_id << SEGMENT_BITS | segment slot (driver/src/io/ring.rs). */
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
	__u64 rq_issued;        /* block requests issued while this transfer was current */
	__u64 rq_bytes;
	__u64 cmd_fixed_imports;/* io_uring_cmd_import_fixed: passthrough on a registered buffer (kprobe) */
	__u64 swiotlb_bounces;  /* swiotlb_tbl_map_single: a DMA bounce through swiotlb (kprobe) */
	__u64 dmabuf_cpu_access;/* dma_buf_begin_cpu_access: the CPU touched a DMA-BUF (kprobe) */
	__u64 passthrough_bounces;/* blk_rq_map_user_iov on a buffer the queue must copy (kprobe) */
	__u64 nvme_cmds;        /* nvme:nvme_setup_cmd issued while this transfer was current */
	__u64 nvme_blocks;      /* logical blocks those Read/Write commands moved (NLB + 1) */
	__u64 rq_completed;     /* block requests of this transfer completed (any context) */
	__u64 rq_errors;        /* ... that completed with an error */
	__u64 dmabuf_token_bios;/* bio_dmabuf_map_set: a bio built on a DMA-BUF's DMA mapping, the
	                         * rw-dmabuf series' DMA-token path (kprobe; that kernel only) */
	__u64 dmabuf_bounced_bios;/* ... of those, bios on a DMA-BUF mapping that swiotlb bounced when the
	                         * mapping was made (nvme_dmabuf_token_map; possibly in an earlier
	                         * transfer): the device moves bytes to and from bounce pages */
};

/* A block request in flight, as the block tracepoints name it. */
struct rq_key {
	__u32 dev;
	__u32 pad;
	__u64 sector;
};

/* Per-CPU counters of submitted payload ops, by kind. */
enum path_counter {
	COUNT_PLAIN = 0,
	COUNT_FIXED = 1,
	COUNT_URING_CMD = 2,
	COUNT_MAX = 3,
};

#endif
