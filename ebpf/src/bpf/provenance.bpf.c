// SPDX-License-Identifier: GPL-2.0
/* pdstor provenance probes. The tracepoints (io_uring submit/complete,
 * filemap, block) are required and attach on every kernel pdstor runs on;
 * the kprobes, tp_btf and raw tracepoints (io-wq punt, iomap direct I/O,
 * fixed-buffer import, user-page mapping, swiotlb bounce, dma-buf CPU access,
 * nvme_setup_cmd) are optional: where one cannot attach, the signals it
 * gives are reported unverifiable, never native. Each event of our process is attributed to the
 * transfer the submitting thread is working on: io_uring_submit_req records
 * it per thread, and the direct-I/O, page-cache and block events that follow
 * on that thread inside the same submission count for it. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "provenance.h"

char LICENSE[] SEC("license") = "GPL";

/* Set by the loader between open and load: only this process is traced. */
const volatile __u32 target_tgid = 0;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct transfer_key);
	__type(value, struct transfer_signals);
} signals SEC(".maps");

/* Thread id -> transfer it is submitting. Key 0 holds the process's most
 * recent transfer: work that io_uring punts to an io-wq worker thread runs on
 * another tid and is attributed to it (approximate under concurrency). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct transfer_key);
} current_transfer SEC(".maps");

/* Block requests our transfers issued, so their completions (in interrupt
 * context, on any task) can be attributed. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct rq_key);
	__type(value, struct transfer_key);
} inflight_rq SEC(".maps");

/* The target files whose page-cache insertions count, when the loader names
 * them (watch_on[0] = 1): then a page of anything else — the binary's own
 * code faulted in, a log, a timeline — is not the payload. Without names,
 * every disk-backed file counts. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, struct file_key);
	__type(value, __u8);
} watched SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} watch_on SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, COUNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} path_counters SEC(".maps");

static __always_inline bool ours(void)
{
	return (bpf_get_current_pid_tgid() >> 32) == target_tgid;
}

static __always_inline struct transfer_signals *signals_for(__u64 transfer)
{
	struct transfer_key key = { .transfer = transfer };
	struct transfer_signals zero = {};
	struct transfer_signals *s = bpf_map_lookup_elem(&signals, &key);

	if (s)
		return s;
	bpf_map_update_elem(&signals, &key, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&signals, &key);
}

#define PF_IO_WORKER 0x00000010

/* The transfer the current thread is submitting, if any. An io-wq worker
 * that no kprobe has told about its request (kernels where kprobes cannot
 * attach) is charged to the process's last submission: a copy it makes must
 * not go unseen. Any other thread with no transfer of its own (the daemon
 * writing its log or timeline, say) is charged nothing. */
static __always_inline struct transfer_signals *current_signals(void)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct transfer_key *k = bpf_map_lookup_elem(&current_transfer, &tid);

	if (!k) {
		struct task_struct *task = (struct task_struct *)bpf_get_current_task();

		if (!(BPF_CORE_READ(task, flags) & PF_IO_WORKER))
			return NULL;
		__u32 process = 0;
		k = bpf_map_lookup_elem(&current_transfer, &process);
	}
	if (!k)
		return NULL;
	return bpf_map_lookup_elem(&signals, k);
}

/* The body of a program whose only job is to count one signal for the
 * transfer the current thread (or process) is submitting. */
#define COUNT_FOR_CURRENT(field)                                        \
	do {                                                            \
		if (!ours())                                            \
			return 0;                                       \
		struct transfer_signals *s = current_signals();         \
		if (s)                                                  \
			__sync_fetch_and_add(&s->field, 1);             \
		return 0;                                               \
	} while (0)

static __always_inline void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&path_counters, &which);

	if (c)
		*c += 1;
}

/* Which kind of payload op an io_uring opcode is: 1 fixed, 2 plain, 3 uring_cmd, 0 other. */
static __always_inline int op_kind(__u8 opcode)
{
	if (opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_READ_FIXED) ||
	    opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_WRITE_FIXED))
		return 1;
	if (opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_READ) ||
	    opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_WRITE) ||
	    opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_READV) ||
	    opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_WRITEV))
		return 2;
	if (opcode == bpf_core_enum_value(enum io_uring_op, IORING_OP_URING_CMD))
		return 3;
	return 0;
}

SEC("tracepoint/io_uring/io_uring_submit_req")
int on_submit(struct trace_event_raw_io_uring_submit_req *ctx)
{
	if (!ours())
		return 0;
	__u64 transfer = ctx->user_data >> PDSTOR_SEGMENT_BITS;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	int kind = op_kind(ctx->opcode);

	if (transfer == 0 || kind == 0) {
		bpf_map_delete_elem(&current_transfer, &tid);
		return 0;
	}
	struct transfer_signals *s = signals_for(transfer);
	if (!s)
		return 0;
	__sync_fetch_and_add(&s->submits, 1);
	if (kind == 1) {
		__sync_fetch_and_add(&s->fixed_ops, 1);
		count(COUNT_FIXED);
	} else if (kind == 2) {
		__sync_fetch_and_add(&s->plain_ops, 1);
		count(COUNT_PLAIN);
	} else {
		__sync_fetch_and_add(&s->uring_cmds, 1);
		count(COUNT_URING_CMD);
	}
	struct transfer_key key = { .transfer = transfer };
	__u32 process = 0;
	bpf_map_update_elem(&current_transfer, &tid, &key, BPF_ANY);
	bpf_map_update_elem(&current_transfer, &process, &key, BPF_ANY);
	return 0;
}

SEC("tracepoint/io_uring/io_uring_complete")
int on_complete(struct trace_event_raw_io_uring_complete *ctx)
{
	if (!ours())
		return 0;
	__u64 transfer = ctx->user_data >> PDSTOR_SEGMENT_BITS;
	struct transfer_key key = { .transfer = transfer };
	struct transfer_signals *s = bpf_map_lookup_elem(&signals, &key);

	/* The thread is no longer submitting this transfer: what it does next
	 * (checksumming the bytes, say) is not part of the transfer. */
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct transfer_key *cur = bpf_map_lookup_elem(&current_transfer, &tid);

	if (cur && cur->transfer == transfer)
		bpf_map_delete_elem(&current_transfer, &tid);
	if (!s)
		return 0;
	__sync_fetch_and_add(&s->completions, 1);
	s->last_res = ctx->res;
	return 0;
}

/* A request io_uring could not issue without blocking (a full tag set, a
 * filesystem lock, an unwritten extent) is punted to an io-wq worker, a
 * thread of this process that issues it later. That worker's block requests,
 * direct-I/O and page-cache events belong to the punted transfer, not to
 * whatever this process submitted last: name it for the worker's thread. */
SEC("kprobe/io_wq_submit_work")
int BPF_KPROBE(on_iowq_work, struct io_wq_work *work)
{
	if (!ours())
		return 0;
	struct io_kiocb *req = (void *)work - bpf_core_field_offset(struct io_kiocb, work);
	__u64 transfer = BPF_CORE_READ(req, cqe.user_data) >> PDSTOR_SEGMENT_BITS;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	if (transfer == 0) {
		bpf_map_delete_elem(&current_transfer, &tid);
		return 0;
	}
	struct transfer_key key = { .transfer = transfer };

	bpf_map_update_elem(&current_transfer, &tid, &key, BPF_ANY);
	return 0;
}

/* iomap_dio_rw_begin(iocb, iter, dio_flags, done_before): a registered
 * buffer reaches the filesystem as a bvec iterator, user memory as ubuf/iovec.
 * Every direct I/O of this process is io_uring's, whose kiocb is the first
 * member of the request (struct io_rw in io_kiocb's command area, at offset
 * 0): its user_data names the transfer exactly, on whichever thread issues
 * it — an io-wq worker included, where no kprobe tells us (kernels where
 * kprobes cannot attach). A user_data that names no transfer we saw
 * submitted falls back to the thread's. */
SEC("tp_btf/iomap_dio_rw_begin")
int BPF_PROG(on_dio_begin, struct kiocb *iocb, struct iov_iter *iter, unsigned int dio_flags, size_t done_before)
{
	if (!ours())
		return 0;
	struct io_kiocb *req = (void *)iocb;
	struct transfer_key key = { .transfer = BPF_CORE_READ(req, cqe.user_data) >> PDSTOR_SEGMENT_BITS };
	struct transfer_signals *s = key.transfer ? bpf_map_lookup_elem(&signals, &key) : NULL;

	if (!s)
		s = current_signals();

	if (!s)
		return 0;
	__u8 type = BPF_CORE_READ(iter, iter_type);
	if (type == bpf_core_enum_value(enum iter_type, ITER_BVEC))
		__sync_fetch_and_add(&s->dio_bvec, 1);
	else
		__sync_fetch_and_add(&s->dio_user, 1);
	return 0;
}

SEC("tracepoint/filemap/mm_filemap_add_to_page_cache")
int on_page_cache_add(struct trace_event_raw_mm_filemap_op_page_cache *ctx)
{
	/* Filesystem metadata read through the block device's own page cache
	 * (the "bdev" pseudo-fs, major 0) is not the payload: count only pages
	 * of files on a disk-backed filesystem (major = dev_t >> 20). */
	if ((ctx->s_dev >> 20) == 0)
		return 0;
	__u32 zero = 0;
	__u32 *on = bpf_map_lookup_elem(&watch_on, &zero);

	if (on && *on) {
		struct file_key f = { .dev = ctx->s_dev, .ino = ctx->i_ino };

		if (!bpf_map_lookup_elem(&watched, &f))
			return 0;
	}
	COUNT_FOR_CURRENT(page_cache_adds);
}

/* Optional signals: kprobes attach only where the kernel allows them (not on
 * every host); the loader reports the ones that did not as unverifiable. */
SEC("kprobe/io_uring_cmd_import_fixed")
int on_cmd_import_fixed(struct pt_regs *ctx)
{
	COUNT_FOR_CURRENT(cmd_fixed_imports);
}

/* blk_rq_map_user_iov(q, rq, map_data, iter, gfp) copies through bounce pages
 * (bio_copy_user_iov) when given map_data or when the buffer's address or
 * length is not aligned to the queue's DMA alignment; the same test here. */
SEC("kprobe/blk_rq_map_user_iov")
int BPF_KPROBE(on_map_user_iov, struct request_queue *q, struct request *rq, void *map_data, const struct iov_iter *iter)
{
	if (!ours())
		return 0;
	struct transfer_signals *s = current_signals();

	if (!s)
		return 0;
	__u64 align = BPF_CORE_READ(q, limits.dma_alignment);
	__u8 type = BPF_CORE_READ(iter, iter_type);
	__u64 count = BPF_CORE_READ(iter, count);
	__u64 addr;

	if (type == bpf_core_enum_value(enum iter_type, ITER_UBUF)) {
		addr = (__u64)BPF_CORE_READ(iter, ubuf) + BPF_CORE_READ(iter, iov_offset);
	} else if (type == bpf_core_enum_value(enum iter_type, ITER_BVEC)) {
		const struct bio_vec *bv = BPF_CORE_READ(iter, bvec);
		addr = (__u64)BPF_CORE_READ(bv, bv_offset) + BPF_CORE_READ(iter, iov_offset);
	} else {
		return 0;
	}
	if (map_data || ((addr | count) & align))
		__sync_fetch_and_add(&s->passthrough_bounces, 1);
	return 0;
}

/* nvme_setup_cmd(req, cmd): the NVMe command the driver builds. It lives in
 * the nvme-core module, so it is read as a raw tracepoint at the offsets the
 * NVMe specification fixes (opcode at byte 0, CDW12 at byte 48), not by BTF. */
SEC("raw_tp/nvme_setup_cmd")
int BPF_PROG(on_nvme_setup_cmd, struct request *req, void *cmd)
{
	if (!ours())
		return 0;
	struct transfer_signals *s = current_signals();
	__u8 opcode = 0;
	__u32 cdw12 = 0;

	if (!s)
		return 0;
	bpf_probe_read_kernel(&opcode, sizeof(opcode), cmd);
	bpf_probe_read_kernel(&cdw12, sizeof(cdw12), (char *)cmd + 48);
	__sync_fetch_and_add(&s->nvme_cmds, 1);
	if (opcode == 0x01 || opcode == 0x02)
		__sync_fetch_and_add(&s->nvme_blocks, (cdw12 & 0xffff) + 1);
	return 0;
}

/* The DMA-BUF mappings (io_dmabuf_token *) whose DMA addresses swiotlb
 * bounced when the series made them: the mapping lives as long as the
 * registration, so every later transfer on it moves bytes through bounce
 * pages even though no bounce happens inside that transfer. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u8);
} bounced_tokens SEC(".maps");

/* Thread id -> the DMA-BUF token it is mapping (inside nvme_dmabuf_token_map). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} mapping_token SEC(".maps");

/* The series' types, as far as the probes read them (CO-RE: the offsets come
 * from the running kernel's BTF; the ___pd suffix is dropped when matching). */
struct io_dmabuf_map___pd {
	void *token;
} __attribute__((preserve_access_index));

struct iov_iter___pd {
	struct io_dmabuf_map___pd *dmabuf_map;
} __attribute__((preserve_access_index));

/* nvme-pci makes a DMA-BUF's device mapping here (drivers/nvme/host/pci.c,
 * patch 0007: dma_buf_map_attachment, so the exporter's dma_map_sgtable runs
 * inside), called through the token's ops by io_dmabuf_create_map, lazily, on
 * the first transfer that needs it (in an io-wq worker). */
SEC("kprobe/nvme_dmabuf_token_map")
int on_dmabuf_create_map(struct pt_regs *ctx)
{
	if (!ours())
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 token = (__u64)PT_REGS_PARM1(ctx);

	bpf_map_update_elem(&mapping_token, &tid, &token, BPF_ANY);
	return 0;
}

SEC("kretprobe/nvme_dmabuf_token_map")
int on_dmabuf_create_map_ret(struct pt_regs *ctx)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&mapping_token, &tid);
	return 0;
}

/* The rw-dmabuf series builds a bio on the DMA-BUF's premapped DMA
 * addresses here (block/bio.c, patch 0004), and only for a DMA-BUF buffer:
 * the positive evidence that a dmabuf_fixed transfer took the DMA-token path
 * (no pages, no pinning, no CPU). The symbol exists only on that kernel.
 * A bio on a mapping swiotlb bounced is counted as such. */
SEC("kprobe/bio_dmabuf_map_set")
int on_dmabuf_token_bio(struct pt_regs *ctx)
{
	if (!ours())
		return 0;
	struct transfer_signals *s = current_signals();

	if (!s)
		return 0;
	__sync_fetch_and_add(&s->dmabuf_token_bios, 1);
	if (bpf_core_field_exists(struct iov_iter___pd, dmabuf_map)) {
		struct iov_iter___pd *iter = (struct iov_iter___pd *)PT_REGS_PARM2(ctx);
		__u64 token = (__u64)BPF_CORE_READ(iter, dmabuf_map, token);

		if (bpf_map_lookup_elem(&bounced_tokens, &token))
			__sync_fetch_and_add(&s->dmabuf_bounced_bios, 1);
	}
	return 0;
}

/* A bounce while a DMA-BUF mapping is being made marks that mapping. */
SEC("kprobe/swiotlb_tbl_map_single")
int on_swiotlb_map(struct pt_regs *ctx)
{
	if (!ours())
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 *token = bpf_map_lookup_elem(&mapping_token, &tid);

	if (token) {
		__u8 one = 1;

		bpf_map_update_elem(&bounced_tokens, token, &one, BPF_ANY);
	}
	struct transfer_signals *s = current_signals();

	if (s)
		__sync_fetch_and_add(&s->swiotlb_bounces, 1);
	return 0;
}

/* A CPU access to a DMA-BUF is always a syscall (DMA_BUF_IOCTL_SYNC) by the
 * accessing thread itself, never io-wq work: only the thread's own current
 * transfer is charged, not the process-wide fallback. */
SEC("kprobe/dma_buf_begin_cpu_access")
int on_dmabuf_cpu_access(struct pt_regs *ctx)
{
	if (!ours())
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct transfer_key *k = bpf_map_lookup_elem(&current_transfer, &tid);
	struct transfer_signals *s = k ? bpf_map_lookup_elem(&signals, k) : NULL;

	if (s)
		__sync_fetch_and_add(&s->dmabuf_cpu_access, 1);
	return 0;
}

SEC("tracepoint/block/block_rq_issue")
int on_rq_issue(struct trace_event_raw_block_rq *ctx)
{
	if (!ours())
		return 0;
	struct transfer_signals *s = current_signals();

	if (!s)
		return 0;
	__sync_fetch_and_add(&s->rq_issued, 1);
	__sync_fetch_and_add(&s->rq_bytes, ctx->bytes);
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct transfer_key *k = bpf_map_lookup_elem(&current_transfer, &tid);
	if (!k) {
		__u32 process = 0;
		k = bpf_map_lookup_elem(&current_transfer, &process);
	}
	if (k) {
		struct rq_key rk = { .dev = ctx->dev, .sector = ctx->sector };
		struct transfer_key v = *k;
		bpf_map_update_elem(&inflight_rq, &rk, &v, BPF_ANY);
	}
	return 0;
}

SEC("tracepoint/block/block_rq_complete")
int on_rq_complete(struct trace_event_raw_block_rq_completion *ctx)
{
	struct rq_key rk = { .dev = ctx->dev, .sector = ctx->sector };
	struct transfer_key *k = bpf_map_lookup_elem(&inflight_rq, &rk);

	if (!k)
		return 0;
	struct transfer_signals *s = bpf_map_lookup_elem(&signals, k);
	if (s) {
		__sync_fetch_and_add(&s->rq_completed, 1);
		if (ctx->error)
			__sync_fetch_and_add(&s->rq_errors, 1);
	}
	bpf_map_delete_elem(&inflight_rq, &rk);
	return 0;
}

/* Test harness: runs the op_kind decision helper on an opcode given as the
 * first argument (BPF_PROG_TEST_RUN); never attached. */
SEC("raw_tp")
int harness_op_kind(struct bpf_raw_tracepoint_args *ctx)
{
	return op_kind((__u8)ctx->args[0]);
}
