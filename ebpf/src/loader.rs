//! Loads the provenance programs for one process, attaches each one (a
//! program that cannot attach is reported, never hidden), reads the
//! per-transfer signals, and pins maps and links under [`PIN_DIR`] so a probe
//! set outlives its loader and `bpftool` can read it.

use std::mem::MaybeUninit;
use std::path::Path;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, OpenObject};

use crate::facility::{attach_failure, ensure_bpffs, ensure_tracefs, tracepoint_exists};
use crate::hooks::{HOOKS, attach_hook};
use crate::program::skel::{ProvenanceSkel, ProvenanceSkelBuilder};
use crate::program::{ProbeError, ProgramStatus};
use crate::signals::{Attached, Signals};

/// Where `--pin` puts maps and links.
pub const PIN_DIR: &str = "/sys/fs/bpf/pdstor";

/// The iomap program: a tp_btf that older kernels lack (reported, not required).
const IOMAP_TP: &str = "iomap:iomap_dio_rw_begin (tp_btf)";

/// The status line that says how block requests are attributed (not a
/// program: whether the kernel symbols that identify a bio were found).
const BLOCK_IDENTITY: &str = "attribution:block requests by bio identity";

pub struct Probes {
    skel: ProvenanceSkel<'static>,
    links: Vec<(&'static str, Link)>,
    status: Vec<ProgramStatus>,
}

/// Runs the programs skip on purpose, as a 7.x kernel may skip them (see
/// "Runs the kernel skips" in the header of `bpf/provenance.bpf.c`): for
/// tests that prove each verdict stands on its second witness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SkipRuns {
    /// io_uring_submit_req.
    pub submit: bool,
    /// block_bio_queue.
    pub bio_queue: bool,
    /// block_rq_issue.
    pub rq_issue: bool,
    /// The hooks on bio_dmabuf_map_set and io_uring_cmd_import_fixed.
    pub hooks: bool,
    /// block_rq_complete.
    pub rq_complete: bool,
}

impl SkipRuns {
    /// The `test_skip` bits of `bpf/provenance.h`.
    fn bits(self) -> u32 {
        u32::from(self.submit)
            | u32::from(self.bio_queue) << 1
            | u32::from(self.rq_issue) << 2
            | u32::from(self.hooks) << 3
            | u32::from(self.rq_complete) << 4
    }
}

/// Which program variants one load uses.
#[derive(Debug, Clone)]
struct Variants {
    /// The functions whose fentry (fexit) programs are loaded.
    fentry: std::collections::HashSet<&'static str>,
    /// The io_uring tracepoints as tp_btf rather than classic tracepoints.
    io_uring_btf: bool,
    /// ... io_uring_complete's prototype before 6.13 (user_data and res as arguments).
    complete_args: bool,
    /// The page-cache tracepoint as tp_btf.
    filemap_btf: bool,
}

/// libbpf's warnings of the current load (the verifier's log of a program it
/// refused among them), for the error a failed load returns.
static LIBBPF_LOG: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn keep_libbpf_warning(_: libbpf_rs::PrintLevel, line: String) {
    if let Ok(mut log) = LIBBPF_LOG.lock() {
        if log.len() >= 4096 {
            log.drain(..2048);
        }
        log.push(line);
    }
}

/// The end of the last verifier log libbpf printed: the refused program and
/// the verifier's reason ("" when there is none).
fn verifier_reason() -> String {
    let Ok(log) = LIBBPF_LOG.lock() else { return String::new() };
    let text: String = log.concat();
    let Some(end) = text.rfind("-- END PROG LOAD LOG --") else { return String::new() };
    let start = text[..end].rfind("-- BEGIN PROG LOAD LOG --").map_or(0, |at| at + "-- BEGIN PROG LOAD LOG --".len());
    let lines: Vec<&str> = text[start..end].lines().filter(|l| !l.starts_with(';') && !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(12)..];
    let prog = text[..end].rfind("prog '").and_then(|at| text[at + 6..].split('\'').next()).unwrap_or("?");
    format!("; the verifier refused program {prog}:\n    {}", tail.join("\n    "))
}

/// Whether block requests can be charged by bio identity here, and what is
/// lost where a needed kernel symbol is missing.
fn block_identity(syms: &crate::kallsyms::Addresses) -> ProgramStatus {
    let missing = syms.missing();
    ProgramStatus {
        name: BLOCK_IDENTITY,
        attached: syms.bio_identity(),
        detail: if missing.is_empty() {
            "block requests are charged to the transfers whose bios they carry, whichever task issues them".into()
        } else {
            let mut costs = Vec::new();
            if !syms.bio_identity() {
                costs.push(
                    "bios are charged to the thread that queues them, and a request another task issues \
                     is unverifiable",
                );
            }
            if syms.get("nvme_uring_cmd_end_io") == 0 {
                costs.push("passthrough requests are charged to the thread that issues them");
            }
            if syms.bio_identity() && syms.get("bio_chain_endio") == 0 {
                costs.push("a split bio whose queueing the kernel ran no program for is nobody's");
            }
            format!("not in /proc/kallsyms: {}; {}", missing.join(", "), costs.join("; "))
        },
    }
}

/// Loads the programs, falling back where this kernel cannot load a kind:
/// where fentry programs cannot be loaded (no trampolines, a lockdown that
/// forbids them), the kprobes do the same work; where the tp_btf tracepoint
/// programs cannot, the classic tracepoints do. `variants` ends as loaded.
fn load_with_fallbacks(
    tgid: u32,
    syms: &crate::kallsyms::Addresses,
    bio_flag_dmabuf_map: u32,
    has_iomap: bool,
    variants: &mut Variants,
    skip: SkipRuns,
) -> Result<ProvenanceSkel<'static>, ProbeError> {
    loop {
        match load(tgid, syms, bio_flag_dmabuf_map, has_iomap, variants, skip) {
            Ok(skel) => return Ok(skel),
            Err(_) if !variants.fentry.is_empty() => variants.fentry.clear(),
            Err(_) if variants.io_uring_btf || variants.filemap_btf => {
                variants.io_uring_btf = false;
                variants.filemap_btf = false;
            }
            Err(e) => return Err(ProbeError::Load(format!("{e}{}", verifier_reason()))),
        }
    }
}

/// Opens and loads the programs of `variants` for process `tgid`.
fn load(
    tgid: u32,
    syms: &crate::kallsyms::Addresses,
    bio_flag_dmabuf_map: u32,
    has_iomap: bool,
    variants: &Variants,
    skip: SkipRuns,
) -> libbpf_rs::Result<ProvenanceSkel<'static>> {
    // The skeleton borrows its object for as long as it lives; a probe set
    // lives for the process, so the few bytes are leaked on purpose (once
    // more for each variant tried).
    let object: &'static mut MaybeUninit<OpenObject> = Box::leak(Box::new(MaybeUninit::uninit()));
    let mut open = ProvenanceSkelBuilder::default().open(object)?;
    if let Some(r) = open.maps.rodata_data.as_deref_mut() {
        r.target_tgid = tgid;
        r.ksym_iomap_dio_bio_end_io = syms.get("iomap_dio_bio_end_io");
        r.ksym_blkdev_bio_end_io = syms.get("blkdev_bio_end_io");
        r.ksym_blkdev_bio_end_io_async = syms.get("blkdev_bio_end_io_async");
        r.ksym_nvme_uring_cmd_end_io = syms.get("nvme_uring_cmd_end_io");
        r.ksym_bio_chain_endio = syms.get("bio_chain_endio");
        r.bio_identity = u32::from(syms.bio_identity());
        r.bio_flag_dmabuf_map = bio_flag_dmabuf_map;
        r.test_skip = skip.bits();
    }
    // tp_btf needs the tracepoint's BTF at load time: leave it out.
    open.progs.on_dio_begin.set_autoload(has_iomap);
    let p = &mut open.progs;
    p.on_submit_btf.set_autoload(variants.io_uring_btf);
    p.on_complete_btf.set_autoload(variants.io_uring_btf && !variants.complete_args);
    p.on_complete_args_btf.set_autoload(variants.io_uring_btf && variants.complete_args);
    p.on_submit.set_autoload(!variants.io_uring_btf);
    p.on_complete.set_autoload(!variants.io_uring_btf);
    p.on_page_cache_add_btf.set_autoload(variants.filemap_btf);
    p.on_page_cache_add.set_autoload(!variants.filemap_btf);
    // An fentry program is loaded against its function's BTF: only for a
    // function this kernel has.
    for hook in &HOOKS {
        (hook.fentry)(p).set_autoload(variants.fentry.contains(hook.func));
    }
    open.load()
}

impl Probes {
    /// Loads the programs with `tgid` as the only traced process and attaches
    /// every one that can attach here. Mounts tracefs first if it is absent
    /// ([`ensure_tracefs`]). The tracepoint programs every verdict depends on
    /// must attach ([`ProbeError::Attach`] names each failure and its errno);
    /// the kprobes are optional and reported in [`status`](Self::status).
    pub fn attach(tgid: u32) -> Result<Probes, ProbeError> {
        Probes::attach_skipping(tgid, SkipRuns::default())
    }

    /// [`attach`](Self::attach), with the programs skipping the runs `skip`
    /// names (tests only).
    pub fn attach_skipping(tgid: u32, skip: SkipRuns) -> Result<Probes, ProbeError> {
        ensure_tracefs()?;
        // Attach failures are reported per program below, not on stderr; a
        // load failure carries the verifier's reason.
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Warn, keep_libbpf_warning)));
        if let Ok(mut log) = LIBBPF_LOG.lock() {
            log.clear();
        }
        // Without the addresses, bios are attributed by the thread that
        // queues them (reported below), as before identity was possible.
        let kallsyms = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let syms = crate::kallsyms::Addresses::parse(&kallsyms);
        let kernel = crate::kallsyms::KernelBtf::read();
        let has_iomap = tracepoint_exists("iomap", "iomap_dio_rw_begin");
        let mut variants = Variants {
            fentry: crate::kallsyms::functions_defined(&kallsyms, &HOOKS.map(|h| h.func)),
            io_uring_btf: kernel.io_uring_btf,
            complete_args: kernel.complete_args,
            filemap_btf: kernel.filemap_btf,
        };
        let skel = load_with_fallbacks(tgid, &syms, kernel.bio_flag_dmabuf_map, has_iomap, &mut variants, skip)?;
        let mut links = Vec::new();
        let mut status = Vec::new();
        let mut try_attach = |name: &'static str, r: libbpf_rs::Result<Link>| match r {
            Ok(l) => {
                status.push(ProgramStatus { name, attached: true, detail: "attached".into() });
                links.push((name, l));
            }
            Err(e) => status.push(ProgramStatus { name, attached: false, detail: attach_failure(name, &e) }),
        };
        if variants.io_uring_btf {
            try_attach("io_uring:io_uring_submit_req (tp_btf)", skel.progs.on_submit_btf.attach());
            let complete =
                if variants.complete_args { &skel.progs.on_complete_args_btf } else { &skel.progs.on_complete_btf };
            try_attach("io_uring:io_uring_complete (tp_btf)", complete.attach());
        } else {
            try_attach("io_uring:io_uring_submit_req", skel.progs.on_submit.attach());
            try_attach("io_uring:io_uring_complete", skel.progs.on_complete.attach());
        }
        if has_iomap {
            try_attach(IOMAP_TP, skel.progs.on_dio_begin.attach());
        }
        if variants.filemap_btf {
            try_attach("filemap:mm_filemap_add_to_page_cache (tp_btf)", skel.progs.on_page_cache_add_btf.attach());
        } else {
            try_attach("filemap:mm_filemap_add_to_page_cache", skel.progs.on_page_cache_add.attach());
        }
        try_attach("block:block_bio_queue (tp_btf)", skel.progs.on_bio_queue.attach());
        try_attach("block:block_split (tp_btf)", skel.progs.on_bio_split.attach());
        try_attach("block:block_bio_complete (tp_btf)", skel.progs.on_bio_complete.attach());
        try_attach("block:block_rq_issue (tp_btf)", skel.progs.on_rq_issue.attach());
        try_attach("block:block_rq_complete (tp_btf)", skel.progs.on_rq_complete.attach());
        if !has_iomap {
            status.push(ProgramStatus {
                name: IOMAP_TP,
                attached: false,
                detail: "this kernel has no iomap_dio_rw_begin tracepoint".into(),
            });
        }
        let required: Vec<String> =
            status.iter().filter(|s| !s.attached && s.name != IOMAP_TP).map(|s| s.detail.clone()).collect();
        if !required.is_empty() {
            return Err(ProbeError::Attach(required));
        }
        status.push(block_identity(&syms));
        let p = &skel.progs;
        let (st, ln) = (&mut status, &mut links);
        for hook in &HOOKS {
            let [fentry, kprobe] = (hook.progs)(p);
            let fentry = variants.fentry.contains(hook.func).then(|| fentry.attach());
            attach_hook(st, ln, hook.names, fentry, || kprobe.attach());
        }
        match p.on_nvme_setup_cmd.attach() {
            Ok(l) => {
                st.push(ProgramStatus { name: "raw_tp:nvme_setup_cmd", attached: true, detail: "attached".into() });
                ln.push(("raw_tp:nvme_setup_cmd", l));
            }
            Err(e) => st.push(ProgramStatus {
                name: "raw_tp:nvme_setup_cmd",
                attached: false,
                detail: format!(
                    "cannot attach here ({}): reported unverifiable",
                    attach_failure("raw_tp:nvme_setup_cmd", &e)
                ),
            }),
        }
        Ok(Probes { skel, links, status })
    }

    /// Runs the in-kernel `op_kind` helper on `opcode` with BPF_PROG_TEST_RUN:
    /// 1 fixed read/write, 2 plain read/write, 3 URING_CMD, 0 anything else.
    pub fn test_op_kind(&self, opcode: u8) -> Result<u32, ProbeError> {
        let mut args = (opcode as u64).to_ne_bytes();
        let input = libbpf_rs::ProgramInput { context_in: Some(&mut args), ..Default::default() };
        let out = self
            .skel
            .progs
            .harness_op_kind
            .test_run(input)
            .map_err(|e| ProbeError::Read(format!("BPF_PROG_TEST_RUN: {e}")))?;
        Ok(out.return_value)
    }

    pub fn status(&self) -> &[ProgramStatus] {
        &self.status
    }

    fn is_attached(&self, prefix: &str) -> bool {
        self.status.iter().any(|s| s.attached && s.name.starts_with(prefix))
    }

    /// Whether function `func` is hooked at its entry (fentry or kprobe) or,
    /// with `exit`, at its return (fexit or kretprobe).
    fn hooked(&self, func: &str, exit: bool) -> bool {
        let kinds: [&str; 2] = if exit { ["fexit", "kretprobe"] } else { ["fentry", "kprobe"] };
        self.status
            .iter()
            .any(|s| s.attached && s.name.split_once(':').is_some_and(|(kind, f)| f == func && kinds.contains(&kind)))
    }

    /// Which signal sources are live, for [`crate::judge`].
    pub fn attached(&self) -> Attached {
        Attached {
            io_uring: self.is_attached("io_uring:io_uring_submit_req")
                && self.is_attached("io_uring:io_uring_complete"),
            iomap_dio: self.is_attached("iomap:"),
            page_cache: self.is_attached("filemap:"),
            block: ["block_bio_queue", "block_split", "block_bio_complete", "block_rq_issue", "block_rq_complete"]
                .iter()
                .all(|tp| self.is_attached(&format!("block:{tp} "))),
            block_identity: self.is_attached(BLOCK_IDENTITY),
            cmd_fixed: self.hooked("io_uring_cmd_import_fixed", false),
            swiotlb: self.hooked("swiotlb_tbl_map_single", false),
            bounce: self.hooked("blk_rq_map_user_iov", false),
            dmabuf_cpu: self.hooked("dma_buf_begin_cpu_access", false),
            dmabuf_token: self.hooked("bio_dmabuf_map_set", false),
            dmabuf_map: self.hooked("nvme_dmabuf_token_map", false) && self.hooked("nvme_dmabuf_token_map", true),
        }
    }

    /// Counts page-cache insertions only for `path` (and any other file named
    /// this way) from now on: pages of the process's own binary, its logs or
    /// its timeline are then not mistaken for the payload's. A block device
    /// or character device target is not a regular file and changes nothing.
    pub fn watch_file(&self, path: &std::path::Path) -> Result<bool, ProbeError> {
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(path).map_err(|e| ProbeError::Read(format!("{}: {e}", path.display())))?;
        if !md.file_type().is_file() {
            return Ok(false);
        }
        // The tracepoint's s_dev is the kernel's dev_t: major << 20 | minor.
        let kdev = (libc::major(md.dev()) as u64) << 20 | libc::minor(md.dev()) as u64;
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&kdev.to_ne_bytes());
        key[8..].copy_from_slice(&md.ino().to_ne_bytes());
        let err = |e: libbpf_rs::Error| ProbeError::Read(format!("watching {}: {e}", path.display()));
        self.skel.maps.watched.update(&key, &[1u8], MapFlags::ANY).map_err(err)?;
        self.skel.maps.watch_on.update(&0u32.to_ne_bytes(), &1u32.to_ne_bytes(), MapFlags::ANY).map_err(err)?;
        Ok(true)
    }

    /// A `Send + Sync` reader of the signals map, for other threads.
    pub fn reader(&self) -> Result<SignalReader, ProbeError> {
        let signals = MapHandle::try_from(&self.skel.maps.signals).map_err(|e| ProbeError::Read(e.to_string()))?;
        Ok(SignalReader { signals, attached: self.attached() })
    }

    /// What was seen for one transfer.
    pub fn signals(&self, transfer: u64) -> Result<Option<Signals>, ProbeError> {
        let v = self
            .skel
            .maps
            .signals
            .lookup(&transfer.to_ne_bytes(), MapFlags::ANY)
            .map_err(|e| ProbeError::Read(e.to_string()))?;
        Ok(v.as_deref().and_then(Signals::from_bytes))
    }

    /// Every transfer seen so far.
    pub fn all_signals(&self) -> Result<Vec<(u64, Signals)>, ProbeError> {
        read_all(&self.skel.maps.signals)
    }

    /// Runs of this probe set's programs the kernel skipped because the same
    /// program was already running on that CPU (its `recursion_misses`): a
    /// program preempted mid-run (7.x runs tracepoint programs preemptibly)
    /// or interrupted by its own event. The events of those runs are not in
    /// the signals.
    pub fn skipped_runs(&self) -> u64 {
        self.skipped_runs_by_program().iter().map(|(_, n)| n).sum()
    }

    /// [`skipped_runs`](Self::skipped_runs) for each program that has any,
    /// by the program's (kernel-truncated) name.
    pub fn skipped_runs_by_program(&self) -> Vec<(String, u64)> {
        use std::os::fd::AsFd;
        let ours: std::collections::HashSet<u32> =
            self.skel.object().progs().filter_map(|p| libbpf_rs::Program::id_from_fd(p.as_fd()).ok()).collect();
        libbpf_rs::query::ProgInfoIter::default()
            .filter(|info| ours.contains(&info.id) && info.recursion_misses > 0)
            .map(|info| (info.name.to_string_lossy().into_owned(), info.recursion_misses))
            .collect()
    }

    /// Payload ops submitted by kind: [plain, fixed, uring_cmd], summed over CPUs.
    pub fn counters(&self) -> Result<[u64; 3], ProbeError> {
        let mut out = [0u64; 3];
        for (i, slot) in out.iter_mut().enumerate() {
            let per_cpu = self
                .skel
                .maps
                .path_counters
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .map_err(|e| ProbeError::Read(e.to_string()))?
                .unwrap_or_default();
            *slot = per_cpu.iter().map(|v| u64::from_ne_bytes(v[..8].try_into().unwrap_or([0; 8]))).sum();
        }
        Ok(out)
    }

    /// Pins the maps and the links under `dir`: the programs stay attached
    /// after this process exits, until [`detach_pinned`].
    pub fn pin(&mut self, dir: &Path) -> Result<(), ProbeError> {
        let err = |what: String| ProbeError::Pin { dir: dir.into(), what };
        ensure_bpffs(dir.parent().unwrap_or(Path::new("/sys/fs/bpf"))).map_err(err)?;
        std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
        self.skel.maps.signals.pin(dir.join("signals")).map_err(|e| err(e.to_string()))?;
        self.skel.maps.path_counters.pin(dir.join("path_counters")).map_err(|e| err(e.to_string()))?;
        for (name, link) in &mut self.links {
            let file: String = name
                .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join("_");
            link.pin(dir.join(format!("link_{file}"))).map_err(|e| err(format!("{name}: {e}")))?;
        }
        Ok(())
    }
}

/// Reads per-transfer signals from any thread while the [`Probes`] that
/// created it stay attached.
#[derive(Debug)]
pub struct SignalReader {
    signals: MapHandle,
    attached: Attached,
}

impl SignalReader {
    pub fn attached(&self) -> Attached {
        self.attached
    }

    pub fn signals(&self, transfer: u64) -> Result<Option<Signals>, ProbeError> {
        let v =
            self.signals.lookup(&transfer.to_ne_bytes(), MapFlags::ANY).map_err(|e| ProbeError::Read(e.to_string()))?;
        Ok(v.as_deref().and_then(Signals::from_bytes))
    }

    /// Judges a transfer from its signals, consuming them ([`take`](Self::take)):
    /// no signal, or a map that cannot be read, is `unverifiable`.
    pub fn verdict(&self, transfer: u64, declared: crate::Declared, class: crate::TargetClass) -> crate::Verdict {
        match self.take(transfer) {
            Ok(Some(s)) => crate::judge(declared, class, &s, &self.attached),
            Ok(None) => crate::Verdict::Unverifiable("no signal recorded for this transfer".into()),
            Err(e) => crate::Verdict::Unverifiable(format!("reading the probes: {e}")),
        }
    }

    /// Reads a transfer's signals and removes them, so a later transfer with
    /// the same id (the load of a chunk that was stored) starts from nothing
    /// and a long-running daemon does not fill the map.
    pub fn take(&self, transfer: u64) -> Result<Option<Signals>, ProbeError> {
        let v = self.signals.lookup_and_delete(&transfer.to_ne_bytes()).map_err(|e| ProbeError::Read(e.to_string()))?;
        Ok(v.as_deref().and_then(Signals::from_bytes))
    }
}

fn read_all<M: MapCore>(map: &M) -> Result<Vec<(u64, Signals)>, ProbeError> {
    let mut out = Vec::new();
    for key in map.keys() {
        let Some(v) = map.lookup(&key, MapFlags::ANY).map_err(|e| ProbeError::Read(e.to_string()))? else { continue };
        let transfer = u64::from_ne_bytes(key[..8].try_into().unwrap_or([0; 8]));
        if let Some(s) = Signals::from_bytes(&v) {
            out.push((transfer, s));
        }
    }
    out.sort_by_key(|(t, _)| *t);
    Ok(out)
}

/// Reads the signals of a pinned probe set.
pub fn read_pinned(dir: &Path) -> Result<Vec<(u64, Signals)>, ProbeError> {
    let map = MapHandle::from_pinned_path(dir.join("signals"))
        .map_err(|e| ProbeError::Read(format!("{}: {e}", dir.display())))?;
    read_all(&map)
}

/// Removes a pinned probe set (its links detach when their last pin goes).
/// Returns how many pins were removed.
pub fn detach_pinned(dir: &Path) -> Result<usize, ProbeError> {
    let mut n = 0;
    let Ok(entries) = std::fs::read_dir(dir) else { return Ok(0) };
    for e in entries.flatten() {
        std::fs::remove_file(e.path()).map_err(|err| ProbeError::Pin { dir: dir.into(), what: err.to_string() })?;
        n += 1;
    }
    let _ = std::fs::remove_dir(dir);
    Ok(n)
}
