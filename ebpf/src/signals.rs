//! What the probes saw for one transfer, and the rule that judges it.

use crate::Verdict;

/// Mirror of `struct transfer_signals` in `bpf/provenance.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Signals {
    pub submits: u64,
    pub fixed_ops: u64,
    pub plain_ops: u64,
    pub uring_cmds: u64,
    pub completions: u64,
    pub last_res: i64,
    pub dio_bvec: u64,
    pub dio_user: u64,
    pub page_cache_adds: u64,
    pub rq_issued: u64,
    pub rq_bytes: u64,
    pub cmd_fixed_imports: u64,
    pub swiotlb_bounces: u64,
    pub dmabuf_cpu_access: u64,
    pub passthrough_bounces: u64,
    pub nvme_cmds: u64,
    pub nvme_blocks: u64,
    pub rq_completed: u64,
    pub rq_errors: u64,
    pub dmabuf_token_bios: u64,
    pub dmabuf_bounced_bios: u64,
    pub bios: u64,
    pub rq_off_process: u64,
    pub rq_reissued: u64,
    pub rq_shared: u64,
    pub rq_completed_unseen: u64,
    pub dmabuf_token_rqs: u64,
    pub cmd_fixed_rqs: u64,
    pub rq_issue_unseen: u64,
}
const _: () = assert!(std::mem::size_of::<Signals>() == 232, "struct transfer_signals is 29 x 8 bytes");

impl Signals {
    /// Every block request this transfer issued completed, once: seen by the
    /// probes, or proven by its io_uring request's completion where the
    /// kernel did not run the completion program (`rq_completed_unseen`).
    pub fn requests_all_completed(&self) -> bool {
        self.rq_completed + self.rq_completed_unseen == self.rq_issued
    }

    /// A block request carried this transfer's bytes to the device: seen
    /// issued (block_rq_issue), or its NVMe command seen built
    /// (nvme_setup_cmd) — two programs, so a run the kernel skips of one
    /// does not leave the transfer without evidence.
    pub fn requests_seen(&self) -> bool {
        self.rq_issued > 0 || self.nvme_cmds > 0
    }

    /// Decodes a map value (native endianness, as the kernel wrote it).
    pub fn from_bytes(b: &[u8]) -> Option<Signals> {
        if b.len() < std::mem::size_of::<Signals>() {
            return None;
        }
        let w = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        Some(Signals {
            submits: w(0),
            fixed_ops: w(1),
            plain_ops: w(2),
            uring_cmds: w(3),
            completions: w(4),
            last_res: w(5) as i64,
            dio_bvec: w(6),
            dio_user: w(7),
            page_cache_adds: w(8),
            rq_issued: w(9),
            rq_bytes: w(10),
            cmd_fixed_imports: w(11),
            swiotlb_bounces: w(12),
            dmabuf_cpu_access: w(13),
            passthrough_bounces: w(14),
            nvme_cmds: w(15),
            nvme_blocks: w(16),
            rq_completed: w(17),
            rq_errors: w(18),
            dmabuf_token_bios: w(19),
            dmabuf_bounced_bios: w(20),
            bios: w(21),
            rq_off_process: w(22),
            rq_reissued: w(23),
            rq_shared: w(24),
            rq_completed_unseen: w(25),
            dmabuf_token_rqs: w(26),
            cmd_fixed_rqs: w(27),
            rq_issue_unseen: w(28),
        })
    }
}

/// The path a transfer declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declared {
    Host,
    HostFixed,
    DmabufFixed,
}

/// What kind of target the transfer went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetClass {
    File,
    BlockDevice,
    NvmePassthrough,
}

/// Which signal sources are attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    pub io_uring: bool,
    pub iomap_dio: bool,
    pub page_cache: bool,
    /// Every block tracepoint program (bio queue, split, complete; request issue, complete).
    pub block: bool,
    /// Block requests attributed by the bios they carry, not by the issuing
    /// task: the kernel symbols that identify a bio were found.
    pub block_identity: bool,
    /// kprobe on io_uring_cmd_import_fixed.
    pub cmd_fixed: bool,
    /// kprobe on swiotlb_tbl_map_single.
    pub swiotlb: bool,
    /// kprobe on blk_rq_map_user_iov.
    pub bounce: bool,
    /// kprobe on dma_buf_begin_cpu_access.
    pub dmabuf_cpu: bool,
    /// kprobe on bio_dmabuf_map_set (the rw-dmabuf series' DMA-token path).
    pub dmabuf_token: bool,
    /// kprobe + kretprobe on nvme_dmabuf_token_map (where the series maps a
    /// DMA-BUF for the device: a bounce there lasts the registration).
    pub dmabuf_map: bool,
}

/// Judges one transfer. A copy seen anywhere is a fallback; `native` needs
/// positive evidence of the declared path; everything else is unverifiable.
pub fn judge(declared: Declared, target: TargetClass, s: &Signals, a: &Attached) -> Verdict {
    if !a.io_uring {
        return Verdict::Unverifiable("io_uring tracepoints".into());
    }
    if s.submits == 0 {
        return Verdict::Unverifiable("no io_uring submission seen for this transfer".into());
    }
    if s.page_cache_adds > 0 {
        return Verdict::Fallback("page-cache".into());
    }
    if s.swiotlb_bounces > 0 {
        return Verdict::Fallback("swiotlb-bounce".into());
    }
    if s.passthrough_bounces > 0 {
        return Verdict::Fallback("bounce".into());
    }
    if s.dmabuf_cpu_access > 0 {
        return Verdict::Fallback("dmabuf-cpu-access".into());
    }
    match declared {
        Declared::DmabufFixed => judge_dmabuf_fixed(target, s, a),
        Declared::HostFixed => judge_host_fixed(target, s, a),
        Declared::Host => {
            if s.fixed_ops > 0 || s.cmd_fixed_imports > 0 {
                return Verdict::Fallback("declared host, submitted fixed".into());
            }
            if s.uring_cmds > 0 {
                return Verdict::Native;
            }
            if s.dio_user > 0 || (target != TargetClass::File && s.requests_seen()) {
                Verdict::Native
            } else {
                Verdict::Unverifiable("no direct-I/O signal for this transfer".into())
            }
        }
    }
}

/// A transfer declared `dmabuf_fixed`: the device must have DMAed into the
/// DMA-BUF: a fixed op, block requests issued, and (where the kprobe
/// attaches) no CPU access.
fn judge_dmabuf_fixed(target: TargetClass, s: &Signals, a: &Attached) -> Verdict {
    if s.fixed_ops == 0 {
        return Verdict::Fallback("not-fixed".into());
    }
    if !a.dmabuf_cpu {
        return Verdict::Unverifiable("the dma_buf_begin_cpu_access hook".into());
    }
    // Positive evidence of the DMA-token path: bios built on the
    // DMA-BUF's own DMA mapping (seen built), or requests seen
    // carrying such bios. Its absence is a fallback only where this
    // transfer's requests were seen: a run the kernel skipped of
    // the one hook is no evidence of pinned pages.
    if !a.dmabuf_token {
        return Verdict::Unverifiable("the bio_dmabuf_map_set hook".into());
    }
    if s.dmabuf_token_bios == 0 && s.dmabuf_token_rqs == 0 {
        return if s.requests_seen() {
            Verdict::Fallback("not-dma-token".into())
        } else if target != TargetClass::BlockDevice {
            Verdict::Fallback("dmabuf_fixed needs a raw block device target".into())
        } else {
            no_request_seen(a)
        };
    }
    // The mapping those bios use may have been bounced when it was
    // made, in an earlier transfer: the device then DMAs to bounce
    // pages, never to the DMA-BUF.
    if s.dmabuf_bounced_bios > 0 {
        return Verdict::Fallback("swiotlb-bounce".into());
    }
    if !a.dmabuf_map || !a.swiotlb {
        return Verdict::Unverifiable("the nvme_dmabuf_token_map/swiotlb_tbl_map_single hooks".into());
    }
    match target {
        TargetClass::BlockDevice if s.requests_seen() => Verdict::Native,
        TargetClass::BlockDevice if !a.block => Verdict::Unverifiable("block_rq_issue".into()),
        TargetClass::BlockDevice => no_request_seen(a),
        _ => Verdict::Fallback("dmabuf_fixed needs a raw block device target".into()),
    }
}

/// A transfer declared `host_fixed`: a registered buffer, by a fixed op or a
/// passthrough command that imported it, and direct I/O on a file.
fn judge_host_fixed(target: TargetClass, s: &Signals, a: &Attached) -> Verdict {
    if target == TargetClass::NvmePassthrough || s.uring_cmds > 0 {
        // The tracepoint does not carry uring_cmd_flags: the kprobe tells.
        // Seen importing the registered buffer, or seen as a
        // request whose command asked for it (two programs).
        if s.cmd_fixed_imports > 0 || s.cmd_fixed_rqs > 0 {
            return Verdict::Native;
        }
        if !a.cmd_fixed {
            return Verdict::Unverifiable("the io_uring_cmd_import_fixed hook".into());
        }
        return if s.requests_seen() { Verdict::Fallback("not-fixed".into()) } else { no_request_seen(a) };
    }
    if s.fixed_ops == 0 {
        return Verdict::Fallback("not-fixed".into());
    }
    match target {
        TargetClass::File if s.dio_user > 0 => Verdict::Fallback("user-buffer".into()),
        TargetClass::File if s.dio_bvec > 0 => Verdict::Native,
        TargetClass::File if !a.iomap_dio => Verdict::Unverifiable("iomap_dio_rw_begin".into()),
        // Its bios were made by iomap direct I/O (bio identity), but
        // the kernel ran no iomap_dio_rw_begin program for it.
        TargetClass::File if s.bios > 0 => {
            Verdict::Unverifiable("direct-I/O bios seen, but not their iterator (iomap_dio_rw_begin)".into())
        }
        TargetClass::File => Verdict::Fallback("no-direct-io".into()),
        _ if s.requests_seen() => Verdict::Native,
        _ if !a.block => Verdict::Unverifiable("block_rq_issue".into()),
        _ => no_request_seen(a),
    }
}

/// A transfer to a block device that no block request was seen carrying.
fn no_request_seen(a: &Attached) -> Verdict {
    Verdict::Unverifiable(if a.block_identity {
        "no block request carried this transfer's bios".into()
    } else {
        "no block request issued on the submitting thread (bio identity unavailable: see the probe status)".into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Attached = Attached {
        io_uring: true,
        iomap_dio: true,
        page_cache: true,
        block: true,
        block_identity: true,
        cmd_fixed: true,
        swiotlb: true,
        bounce: true,
        dmabuf_cpu: true,
        dmabuf_token: true,
        dmabuf_map: true,
    };

    fn fixed_file() -> Signals {
        Signals { submits: 1, fixed_ops: 1, completions: 1, dio_bvec: 1, rq_issued: 1, ..Default::default() }
    }

    #[test]
    fn a_registered_buffer_through_iomap_is_native() {
        assert_eq!(judge(Declared::HostFixed, TargetClass::File, &fixed_file(), &ALL), Verdict::Native);
    }

    #[test]
    fn page_cache_and_plain_ops_are_fallbacks() {
        let s = Signals { page_cache_adds: 3, ..fixed_file() };
        assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &ALL), Verdict::Fallback("page-cache".into()));
        let s = Signals { fixed_ops: 0, plain_ops: 1, ..fixed_file() };
        assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &ALL), Verdict::Fallback("not-fixed".into()));
        let s = Signals { dio_bvec: 0, dio_user: 1, ..fixed_file() };
        assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &ALL), Verdict::Fallback("user-buffer".into()));
    }

    #[test]
    fn missing_probes_and_silence_are_never_native() {
        let no_iomap = Attached { iomap_dio: false, ..ALL };
        let s = Signals { dio_bvec: 0, ..fixed_file() };
        assert!(matches!(judge(Declared::HostFixed, TargetClass::File, &s, &no_iomap), Verdict::Unverifiable(_)));
        assert!(matches!(
            judge(Declared::HostFixed, TargetClass::File, &Signals::default(), &ALL),
            Verdict::Unverifiable(_)
        ));
        let pt = Signals { uring_cmds: 1, fixed_ops: 0, ..fixed_file() };
        let no_kprobe = Attached { cmd_fixed: false, ..ALL };
        assert!(matches!(
            judge(Declared::HostFixed, TargetClass::NvmePassthrough, &pt, &no_kprobe),
            Verdict::Unverifiable(_)
        ));
        let none = Attached { io_uring: false, ..ALL };
        assert!(matches!(
            judge(Declared::HostFixed, TargetClass::File, &fixed_file(), &none),
            Verdict::Unverifiable(_)
        ));
    }

    #[test]
    fn a_file_transfer_without_its_iterator_seen_is_a_fallback_only_without_direct_io_bios() {
        let bare = Signals { dio_bvec: 0, dio_user: 0, ..fixed_file() };
        assert_eq!(
            judge(Declared::HostFixed, TargetClass::File, &bare, &ALL),
            Verdict::Fallback("no-direct-io".into())
        );
        let dio_bios = Signals { bios: 4, ..bare };
        assert!(matches!(
            judge(Declared::HostFixed, TargetClass::File, &dio_bios, &ALL),
            Verdict::Unverifiable(w) if w.contains("iomap_dio_rw_begin")
        ));
    }

    #[test]
    fn a_plain_read_on_the_host_path_is_not_counted_as_fixed() {
        let s = Signals { submits: 1, plain_ops: 1, dio_user: 1, ..Default::default() };
        assert_eq!(judge(Declared::Host, TargetClass::File, &s, &ALL), Verdict::Native);
        assert_eq!(judge(Declared::HostFixed, TargetClass::File, &s, &ALL), Verdict::Fallback("not-fixed".into()));
    }

    #[test]
    fn passthrough_is_judged_by_the_fixed_import_or_its_requests() {
        let pt = Signals { submits: 1, uring_cmds: 1, completions: 1, rq_issued: 1, ..Default::default() };
        assert_eq!(
            judge(Declared::HostFixed, TargetClass::NvmePassthrough, &pt, &ALL),
            Verdict::Fallback("not-fixed".into())
        );
        // Its request unseen too: no evidence either way.
        let unseen = Signals { rq_issued: 0, ..pt };
        assert!(matches!(
            judge(Declared::HostFixed, TargetClass::NvmePassthrough, &unseen, &ALL),
            Verdict::Unverifiable(_)
        ));
        let fixed = Signals { cmd_fixed_imports: 1, ..pt };
        assert_eq!(judge(Declared::HostFixed, TargetClass::NvmePassthrough, &fixed, &ALL), Verdict::Native);
        // Either witness is enough: the command that asked for the
        // registered buffer, seen as a request, when the hook was skipped.
        let asked = Signals { cmd_fixed_rqs: 1, ..pt };
        assert_eq!(judge(Declared::HostFixed, TargetClass::NvmePassthrough, &asked, &ALL), Verdict::Native);
        assert_eq!(judge(Declared::Host, TargetClass::NvmePassthrough, &pt, &ALL), Verdict::Native);
        let copied = Signals { passthrough_bounces: 1, ..fixed };
        assert_eq!(
            judge(Declared::HostFixed, TargetClass::NvmePassthrough, &copied, &ALL),
            Verdict::Fallback("bounce".into())
        );
        let bounced = Signals { swiotlb_bounces: 2, ..fixed };
        assert_eq!(
            judge(Declared::HostFixed, TargetClass::NvmePassthrough, &bounced, &ALL),
            Verdict::Fallback("swiotlb-bounce".into())
        );
    }

    #[test]
    fn dmabuf_fixed_needs_a_fixed_op_block_requests_and_no_cpu_access() {
        let dma = Signals {
            submits: 1,
            fixed_ops: 1,
            completions: 1,
            rq_issued: 2,
            dmabuf_token_bios: 2,
            ..Default::default()
        };
        assert_eq!(judge(Declared::DmabufFixed, TargetClass::BlockDevice, &dma, &ALL), Verdict::Native);
        // A fixed op on pinned pages (no DMA-token bio) is not dmabuf_fixed.
        let pages = Signals { dmabuf_token_bios: 0, ..dma };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &pages, &ALL),
            Verdict::Fallback("not-dma-token".into())
        );
        let no_token_probe = Attached { dmabuf_token: false, ..ALL };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &dma, &no_token_probe),
            Verdict::Unverifiable("the bio_dmabuf_map_set hook".into())
        );
        // The second witness: requests seen carrying DMA-token bios, where
        // the kernel skipped the hook's runs.
        let rqs_only = Signals { dmabuf_token_bios: 0, dmabuf_token_rqs: 2, ..dma };
        assert_eq!(judge(Declared::DmabufFixed, TargetClass::BlockDevice, &rqs_only, &ALL), Verdict::Native);
        // Nothing seen of the transfer's requests or bios: no evidence of
        // pinned pages either.
        let unseen = Signals { dmabuf_token_bios: 0, rq_issued: 0, ..dma };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &unseen, &ALL),
            Verdict::Unverifiable("no block request carried this transfer's bios".into())
        );
        // Bios on a mapping swiotlb bounced when it was made (in an earlier
        // transfer: no bounce inside this one) are not native.
        let bounced_map = Signals { dmabuf_bounced_bios: 2, ..dma };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &bounced_map, &ALL),
            Verdict::Fallback("swiotlb-bounce".into())
        );
        let no_map_probe = Attached { dmabuf_map: false, ..ALL };
        assert!(matches!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &dma, &no_map_probe),
            Verdict::Unverifiable(w) if w.contains("nvme_dmabuf_token_map")
        ));
        let touched = Signals { dmabuf_cpu_access: 1, ..dma };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &touched, &ALL),
            Verdict::Fallback("dmabuf-cpu-access".into())
        );
        assert_eq!(
            judge(Declared::HostFixed, TargetClass::BlockDevice, &touched, &ALL),
            Verdict::Fallback("dmabuf-cpu-access".into()),
            "a CPU touch of a DMA-BUF during any transfer is a copy"
        );
        let plain = Signals { fixed_ops: 0, plain_ops: 1, ..dma };
        assert_eq!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &plain, &ALL),
            Verdict::Fallback("not-fixed".into())
        );
        let no_kprobe = Attached { dmabuf_cpu: false, ..ALL };
        assert!(matches!(
            judge(Declared::DmabufFixed, TargetClass::BlockDevice, &dma, &no_kprobe),
            Verdict::Unverifiable(_)
        ));
        assert!(matches!(
            judge(Declared::DmabufFixed, TargetClass::File, &dma, &ALL),
            Verdict::Fallback(w) if w.contains("raw block device")
        ));
    }

    #[test]
    fn map_values_decode_field_by_field() {
        let mut b = vec![0u8; 232];
        b[8..16].copy_from_slice(&7u64.to_ne_bytes());
        b[40..48].copy_from_slice(&(-5i64).to_ne_bytes());
        let s = Signals::from_bytes(&b).unwrap();
        assert_eq!((s.fixed_ops, s.last_res), (7, -5));
        b[152..160].copy_from_slice(&3u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| s.dmabuf_token_bios), Some(3));
        b[160..168].copy_from_slice(&2u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| s.dmabuf_bounced_bios), Some(2));
        b[184..192].copy_from_slice(&4u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| s.rq_reissued), Some(4));
        b[200..208].copy_from_slice(&5u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| s.rq_completed_unseen), Some(5));
        b[208..216].copy_from_slice(&6u64.to_ne_bytes());
        b[216..224].copy_from_slice(&8u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| (s.dmabuf_token_rqs, s.cmd_fixed_rqs)), Some((6, 8)));
        b[224..232].copy_from_slice(&9u64.to_ne_bytes());
        assert_eq!(Signals::from_bytes(&b).map(|s| s.rq_issue_unseen), Some(9));
        assert_eq!(Signals::from_bytes(&b[..224]), None, "a short value is not decoded");
        assert!(Signals::from_bytes(&b[..200]).is_none());
    }
}
