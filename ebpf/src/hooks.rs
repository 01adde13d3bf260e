//! The optional function hooks, each an fentry (fexit) program where the
//! kernel loads and attaches it and a kprobe (kretprobe) where it does not.

use libbpf_rs::Link;

use crate::facility::attach_failure;
use crate::program::{ProgramStatus, skel};

/// One optional function hook: the function, the status names of its two
/// kinds, and its programs. Each is an fentry (fexit) program where the
/// kernel loads and attaches it, else a kprobe (kretprobe): a kprobe program
/// is skipped while any process on its CPU is inside a bpf() map syscall, an
/// fentry program only while itself runs there (see "Runs the kernel skips"
/// in the header of `bpf/provenance.bpf.c`).
pub(crate) struct Hook {
    pub(crate) func: &'static str,
    pub(crate) names: (&'static str, &'static str),
    pub(crate) fentry:
        for<'a> fn(&'a mut skel::OpenProvenanceProgs<'static>) -> &'a mut libbpf_rs::OpenProgramMut<'static>,
    /// The fentry (fexit) program and the kprobe (kretprobe) program.
    pub(crate) progs: for<'a> fn(&'a skel::ProvenanceProgs<'static>) -> [&'a libbpf_rs::ProgramMut<'static>; 2],
}

pub(crate) const HOOKS: [Hook; 8] = [
    Hook {
        func: "io_uring_cmd_import_fixed",
        names: ("fentry:io_uring_cmd_import_fixed", "kprobe:io_uring_cmd_import_fixed"),
        fentry: |p| &mut p.fe_cmd_import_fixed,
        progs: |p| [&p.fe_cmd_import_fixed, &p.on_cmd_import_fixed],
    },
    Hook {
        func: "swiotlb_tbl_map_single",
        names: ("fentry:swiotlb_tbl_map_single", "kprobe:swiotlb_tbl_map_single"),
        fentry: |p| &mut p.fe_swiotlb_map,
        progs: |p| [&p.fe_swiotlb_map, &p.on_swiotlb_map],
    },
    Hook {
        func: "dma_buf_begin_cpu_access",
        names: ("fentry:dma_buf_begin_cpu_access", "kprobe:dma_buf_begin_cpu_access"),
        fentry: |p| &mut p.fe_dmabuf_cpu_access,
        progs: |p| [&p.fe_dmabuf_cpu_access, &p.on_dmabuf_cpu_access],
    },
    Hook {
        func: "blk_rq_map_user_iov",
        names: ("fentry:blk_rq_map_user_iov", "kprobe:blk_rq_map_user_iov"),
        fentry: |p| &mut p.fe_map_user_iov,
        progs: |p| [&p.fe_map_user_iov, &p.on_map_user_iov],
    },
    Hook {
        func: "bio_dmabuf_map_set",
        names: ("fentry:bio_dmabuf_map_set", "kprobe:bio_dmabuf_map_set"),
        fentry: |p| &mut p.fe_dmabuf_token_bio,
        progs: |p| [&p.fe_dmabuf_token_bio, &p.on_dmabuf_token_bio],
    },
    Hook {
        func: "nvme_dmabuf_token_map",
        names: ("fentry:nvme_dmabuf_token_map", "kprobe:nvme_dmabuf_token_map"),
        fentry: |p| &mut p.fe_dmabuf_create_map,
        progs: |p| [&p.fe_dmabuf_create_map, &p.on_dmabuf_create_map],
    },
    Hook {
        func: "nvme_dmabuf_token_map",
        names: ("fexit:nvme_dmabuf_token_map", "kretprobe:nvme_dmabuf_token_map"),
        fentry: |p| &mut p.fx_dmabuf_create_map,
        progs: |p| [&p.fx_dmabuf_create_map, &p.on_dmabuf_create_map_ret],
    },
    Hook {
        func: "io_wq_submit_work",
        names: ("fentry:io_wq_submit_work", "kprobe:io_wq_submit_work"),
        fentry: |p| &mut p.fe_iowq_work,
        progs: |p| [&p.fe_iowq_work, &p.on_iowq_work],
    },
];

/// Attaches an optional function hook: its fentry (or fexit) program when it
/// was loaded and attaches, else its kprobe (or kretprobe). Failure of both
/// is a status line, not an error.
pub(crate) fn attach_hook(
    status: &mut Vec<ProgramStatus>,
    links: &mut Vec<(&'static str, Link)>,
    (fentry_name, kprobe_name): (&'static str, &'static str),
    fentry: Option<libbpf_rs::Result<Link>>,
    kprobe: impl FnOnce() -> libbpf_rs::Result<Link>,
) {
    let why_not_fentry = match fentry {
        Some(Ok(l)) => {
            status.push(ProgramStatus { name: fentry_name, attached: true, detail: "attached".into() });
            links.push((fentry_name, l));
            return;
        }
        Some(Err(e)) => attach_failure(fentry_name, &e),
        None => format!("{fentry_name}: not loadable here"),
    };
    match kprobe() {
        Ok(l) => {
            status.push(ProgramStatus {
                name: kprobe_name,
                attached: true,
                detail: format!("attached (instead of fentry: {why_not_fentry})"),
            });
            links.push((kprobe_name, l));
        }
        Err(e) => status.push(ProgramStatus {
            name: kprobe_name,
            attached: false,
            detail: format!(
                "cannot attach here ({}; {why_not_fentry}): reported unverifiable",
                attach_failure(kprobe_name, &e)
            ),
        }),
    }
}
