//! `pdstor ladder`: the qualification ladder's payload rungs (DESIGN §9, step
//! 3) on a scratch target it is given: `host` → `host_fixed` →
//! `dmabuf_fixed`, from memory a DMA-BUF exporter provides (udmabuf on a CPU
//! host, CUDA device memory with `--features cuda`), with the provenance
//! probes attached.
//!
//! Each rung writes a seeded pattern from the exporter's memory to its own
//! region of the target, reads every byte back **independently** (a plain
//! `pread` with `O_DIRECT` that shares no code with the engine), reads it back
//! through pdstor into the exporter's memory and compares again, and judges
//! every transfer from the probes' signals. A rung is qualified only if every
//! byte matches and every verdict is `native`; otherwise the report says why.
//! `host` and `host_fixed` stage through host memory (that is what those paths
//! are); `dmabuf_fixed` moves the exporter's memory itself, or is not
//! qualified with the kernel's reason. `cargo xtask gpu-qual` runs this with
//! the CUDA exporter.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};

mod verify;

use pdstor_engine::buffer::Buffer;
use pdstor_engine::buffer::dmabuf::DmaBuf;
use pdstor_engine::io::{
    BufferOffset, Engine, EngineOptions, IoRequest, Op, PayloadPath, Target, TargetKind, TargetOffset, TargetOptions,
    TransferId,
};

/// Memory an exporter provides: filled and read by the CPU (through the
/// exporter's own copy routines), staged to and from host buffers, compared,
/// exportable as a DMA-BUF.
trait Memory {
    fn fill(&self, offset: u64, src: &[u8]) -> anyhow::Result<()>;
    fn export(&self) -> anyhow::Result<DmaBuf>;
    /// Sets every byte to 0.
    fn clear(&self, len: usize) -> anyhow::Result<()> {
        self.fill(0, &vec![0u8; len])
    }
    /// Copies `len` bytes from the start of this memory into `staging`
    /// (what the host paths move: GPU → registered host buffer).
    fn stage_out(&self, staging: &Buffer, len: usize) -> anyhow::Result<()>;
    /// Copies `len` bytes of `staging` into the start of this memory.
    fn stage_in(&self, staging: &Buffer, len: usize) -> anyhow::Result<()>;
    /// Where the first byte (a GPU compares words: the word's first byte)
    /// differing from `expected` is, and where the compare ran.
    fn first_difference(&self, expected: &[u8]) -> anyhow::Result<(Option<u64>, &'static str)>;
    /// CRC-32C of `len` bytes at `offset`, where the memory is (a GPU's on
    /// the GPU), and where it ran.
    fn crc32c(&self, offset: u64, len: usize) -> anyhow::Result<(u32, &'static str)>;
}

impl Memory for Buffer {
    fn fill(&self, offset: u64, src: &[u8]) -> anyhow::Result<()> {
        Ok(self.write_at(offset, src)?)
    }
    fn export(&self) -> anyhow::Result<DmaBuf> {
        let d = self.dmabuf().context("the buffer is not a DMA-BUF")?;
        Ok(DmaBuf::import(d.try_clone_fd()?)?)
    }
    fn stage_out(&self, staging: &Buffer, len: usize) -> anyhow::Result<()> {
        let mut bytes = vec![0u8; len];
        self.read_at(0, &mut bytes)?;
        Ok(staging.write_at(0, &bytes)?)
    }
    fn stage_in(&self, staging: &Buffer, len: usize) -> anyhow::Result<()> {
        let mut bytes = vec![0u8; len];
        staging.read_at(0, &mut bytes)?;
        Ok(self.write_at(0, &bytes)?)
    }
    fn first_difference(&self, expected: &[u8]) -> anyhow::Result<(Option<u64>, &'static str)> {
        let mut back = vec![0u8; expected.len()];
        self.read_at(0, &mut back)?;
        Ok((pdstor_engine::payload::first_difference(expected, &back).map(|at| at as u64), "on the CPU"))
    }
    fn crc32c(&self, offset: u64, len: usize) -> anyhow::Result<(u32, &'static str)> {
        let mut bytes = vec![0u8; len];
        self.read_at(offset, &mut bytes)?;
        Ok((pdstor_engine::crc32c::checksum(&bytes), "on the CPU"))
    }
}

#[cfg(feature = "cuda")]
impl Memory for pdstor_engine::buffer::cuda::CudaBuffer {
    fn fill(&self, offset: u64, src: &[u8]) -> anyhow::Result<()> {
        Ok(self.copy_from_host(offset, src)?)
    }
    fn export(&self) -> anyhow::Result<DmaBuf> {
        Ok(self.export_dmabuf()?)
    }
    fn clear(&self, _len: usize) -> anyhow::Result<()> {
        Ok(self.fill_bytes(0)?)
    }
    fn stage_out(&self, staging: &Buffer, len: usize) -> anyhow::Result<()> {
        staging.check_range(0, len)?;
        let dst = staging.as_mut_ptr()?;
        // SAFETY: `staging` maps at least `len` bytes at `dst` (checked above),
        // and nothing else touches them: the engine runs no transfer now.
        Ok(unsafe { self.copy_to_host_ptr(0, dst, len) }?)
    }
    fn stage_in(&self, staging: &Buffer, len: usize) -> anyhow::Result<()> {
        staging.check_range(0, len)?;
        let src = staging.as_mut_ptr()?;
        // SAFETY: as in `stage_out`; the bytes are only read.
        Ok(unsafe { self.copy_from_host_ptr(0, src, len) }?)
    }
    fn first_difference(&self, expected: &[u8]) -> anyhow::Result<(Option<u64>, &'static str)> {
        Ok((pdstor_engine::buffer::cuda::CudaBuffer::first_difference(self, 0, expected)?, "on the GPU"))
    }
    fn crc32c(&self, offset: u64, len: usize) -> anyhow::Result<(u32, &'static str)> {
        Ok((pdstor_engine::buffer::cuda::CudaBuffer::crc32c(self, offset, len)?, "on the GPU"))
    }
}

/// Whose memory the ladder moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LadderExporter {
    /// A udmabuf over a memfd (CPU hosts).
    Udmabuf,
    /// CUDA device memory exported as a DMA-BUF (GPU 0; needs `--features cuda`).
    Cuda,
}

impl std::str::FromStr for LadderExporter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "udmabuf" => Ok(LadderExporter::Udmabuf),
            "cuda" => Ok(LadderExporter::Cuda),
            _ => Err(format!("unknown exporter {s:?}: expected udmabuf or cuda")),
        }
    }
}

/// What `pdstor ladder` runs.
#[derive(Debug, Clone)]
pub struct LadderConfig {
    /// The scratch target (overwritten).
    pub target: PathBuf,
    /// Whose memory the rungs move.
    pub exporter: LadderExporter,
    /// The paths to qualify, in ladder order.
    pub paths: Vec<PayloadPath>,
    /// Bytes per rung.
    pub bytes: u64,
    /// Bytes per chunk.
    pub chunk: u64,
    /// Where `ladder.json` and `ladder.md` go.
    pub out: PathBuf,
    /// Overwrite a target that holds a filesystem or a pdstor namespace.
    pub force: bool,
}

/// One rung: one path, qualified or not, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Rung {
    /// The path.
    pub path: PayloadPath,
    /// Every byte read back and every transfer judged native.
    pub qualified: bool,
    /// Why not, when not.
    pub reason: Option<String>,
    /// Bytes moved each way.
    pub bytes: u64,
    /// Write throughput, MiB/s.
    pub write_mib_s: Option<f64>,
    /// Read throughput, MiB/s.
    pub read_mib_s: Option<f64>,
    /// This process's CPU time (user + system) per GiB moved, writes and
    /// reads together, in ms: what the path costs the host's CPUs.
    pub cpu_ms_per_gib: Option<f64>,
    /// Verdict → transfers judged so.
    pub verdicts: BTreeMap<String, u64>,
    /// What the independent readback found.
    pub independent_readback: Option<String>,
    /// How the bytes went between the exporter's memory and the engine.
    pub staging: Option<String>,
    /// Where the bytes read back through pdstor were compared with the pattern.
    pub compared: Option<String>,
    /// `dmabuf_fixed`: the export of the exporter's memory and its import by
    /// pdstor, which happen (or fail) before the kernel is asked to register it.
    pub dmabuf_import: Option<String>,
    /// Each restored chunk's CRC-32C taken where it landed (a GPU's on the
    /// GPU) against the one taken as it was stored, and a flipped byte seen.
    pub verified: Option<String>,
    /// That check's speed, GiB/s (every chunk, one after another).
    pub verify_gib_s: Option<f64>,
}

/// Everything the ladder found (`ladder.json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LadderReport {
    /// When it ran (Unix seconds).
    pub unix_time: u64,
    /// The kernel release.
    pub kernel: String,
    /// The target.
    pub target: PathBuf,
    /// Its kind.
    pub target_kind: TargetKind,
    /// Whose memory.
    pub exporter: LadderExporter,
    /// What the exporter says of it.
    pub exporter_detail: serde_json::Value,
    /// Whether the kernel has the rw-dmabuf UAPI.
    pub dmabuf_rw: pdstor_engine::io::DmabufRw,
    /// The probes that attached.
    pub probes: Vec<String>,
    /// Every rung, in ladder order.
    pub rungs: Vec<Rung>,
}

impl LadderReport {
    /// Every rung asked for qualified.
    pub fn qualified(&self) -> bool {
        self.rungs.iter().all(|r| r.qualified)
    }

    /// The report as Markdown (`ladder.md`).
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "# pdstor ladder\n\n- kernel: {}\n- target: {} ({:?})\n- exporter: {:?} {}\n- rw-dmabuf UAPI: {}\n- probes: {}\n\n| path | qualified | write MiB/s | read MiB/s | CPU ms/GiB | verdicts | independent readback | read back through pdstor | reason |\n|---|---|---|---|---|---|---|---|---|\n",
            self.kernel,
            self.target.display(),
            self.target_kind,
            self.exporter,
            self.exporter_detail,
            serde_json::to_string(&self.dmabuf_rw).unwrap_or_default(),
            self.probes.join(", "),
        );
        let f = |v: Option<f64>| v.map_or("-".into(), |x| format!("{x:.0}"));
        for r in &self.rungs {
            let verdicts: Vec<String> = r.verdicts.iter().map(|(v, n)| format!("{v} ×{n}")).collect();
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                r.path,
                if r.qualified { "yes" } else { "**no**" },
                f(r.write_mib_s),
                f(r.read_mib_s),
                f(r.cpu_ms_per_gib),
                verdicts.join(", "),
                r.independent_readback.as_deref().unwrap_or("-"),
                r.compared.as_deref().unwrap_or("-"),
                r.reason.as_deref().unwrap_or(""),
            );
        }
        for r in self.rungs.iter().filter(|r| r.verified.is_some()) {
            let said = r.verified.as_deref().unwrap_or_default();
            s += &format!(
                "\n- {} restore verified where it landed: {said} ({:.1} GiB/s)",
                r.path,
                r.verify_gib_s.unwrap_or(0.0)
            );
        }
        s
    }
}

/// Runs the ladder and writes `ladder.json` and `ladder.md` under `cfg.out`.
/// Errors are problems before any rung (a refused target, no exporter); a rung
/// that fails is reported, not an error.
pub fn run(cfg: &LadderConfig) -> anyhow::Result<LadderReport> {
    let target = open_checked(cfg)?;
    let kind = target.kind();
    let class = pdstor_daemon::provenance::target_class(kind);
    let (memory, exporter_detail) = ladder_memory(cfg)?;
    let probes = pdstor_probes::Probes::attach(std::process::id());
    if let Ok(p) = &probes {
        p.watch_file(&cfg.target)?;
    }
    let probe_status: Vec<String> = match &probes {
        Ok(p) => p.status().iter().filter(|s| s.attached).map(|s| s.name.to_string()).collect(),
        Err(e) => vec![format!("not attached: {e}")],
    };
    let reader = probes.as_ref().ok().and_then(|p| p.reader().ok());
    let mut engine = Engine::new(target, EngineOptions::default())?;
    let independent = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&cfg.target)
        .with_context(|| format!("opening {} for the independent readback", cfg.target.display()))?;
    let mut report = LadderReport {
        unix_time: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned(),
        target: cfg.target.clone(),
        target_kind: kind,
        exporter: cfg.exporter,
        exporter_detail,
        dmabuf_rw: engine.dmabuf_rw().clone(),
        probes: probe_status,
        rungs: Vec::new(),
    };
    for (n, path) in PayloadPath::ALL.into_iter().enumerate() {
        if !cfg.paths.contains(&path) {
            continue;
        }
        let rung = Rung {
            path,
            qualified: false,
            reason: None,
            bytes: cfg.bytes,
            write_mib_s: None,
            read_mib_s: None,
            cpu_ms_per_gib: None,
            verdicts: BTreeMap::new(),
            independent_readback: None,
            staging: None,
            compared: None,
            dmabuf_import: None,
            verified: None,
            verify_gib_s: None,
        };
        let mut ctx = RungCtx {
            cfg,
            engine: &mut engine,
            memory: memory.as_ref(),
            reader: reader.as_ref(),
            class,
            independent: &independent,
            base: n as u64 * cfg.bytes,
            seed: 0x1add_e400 + n as u64,
            transfer_base: (n as u64 + 1) << 24,
            rung,
        };
        let outcome = ctx.run();
        let mut rung = ctx.rung;
        match outcome {
            Ok(()) => {
                let not_native: Vec<&String> = rung.verdicts.keys().filter(|v| *v != "native").collect();
                if not_native.is_empty() {
                    rung.qualified = true;
                } else {
                    rung.reason = Some(format!("verdicts other than native: {not_native:?}"));
                }
            }
            Err(e) => rung.reason = Some(format!("{e:#}")),
        }
        report.rungs.push(rung);
    }
    std::fs::create_dir_all(&cfg.out).with_context(|| format!("creating {}", cfg.out.display()))?;
    std::fs::write(cfg.out.join("ladder.json"), serde_json::to_vec_pretty(&report)?)?;
    std::fs::write(cfg.out.join("ladder.md"), report.markdown())?;
    Ok(report)
}

/// Checks the request and opens the target: a scratch target the ladder may
/// overwrite, read back with `pread(O_DIRECT)`, large enough for every rung.
fn open_checked(cfg: &LadderConfig) -> anyhow::Result<Target> {
    if cfg.paths.is_empty() {
        bail!("no paths requested: give --paths host,host_fixed,dmabuf_fixed or a subset");
    }
    if cfg.chunk == 0 || !cfg.chunk.is_multiple_of(4096) || !cfg.bytes.is_multiple_of(cfg.chunk) || cfg.bytes == 0 {
        bail!("--bytes must be a positive multiple of --chunk, and --chunk a multiple of 4096");
    }
    if !cfg.force
        && let Some(sig) = pdstor_daemon::store::signature_of(&cfg.target)?
    {
        bail!(
            "{} holds {sig}: the ladder overwrites its target; give a scratch target, or --force to overwrite it",
            cfg.target.display()
        );
    }
    let target = Target::open(&cfg.target, &TargetOptions::default())?;
    if target.kind() == TargetKind::NvmeGeneric {
        bail!(
            "{} is an NVMe generic device; the ladder reads back with pread(O_DIRECT): give the namespace's block device (/dev/nvmeXnY)",
            cfg.target.display()
        );
    }
    let need = cfg.bytes * PayloadPath::ALL.len() as u64;
    if target.geometry().capacity < need {
        bail!("{} holds {} bytes; the ladder needs {need}", cfg.target.display(), target.geometry().capacity);
    }
    Ok(target)
}

/// The memory the rungs move, and what the exporter says of it.
fn ladder_memory(cfg: &LadderConfig) -> anyhow::Result<(Box<dyn Memory>, serde_json::Value)> {
    Ok(match cfg.exporter {
        LadderExporter::Udmabuf => {
            let b = Buffer::udmabuf("pdstor-ladder", cfg.bytes as usize)?;
            let exp = pdstor_engine::buffer::dmabuf::exporters();
            (Box::new(b), serde_json::json!({ "udmabuf_limit_mb": exp.udmabuf_limit_mb }))
        }
        #[cfg(feature = "cuda")]
        LadderExporter::Cuda => {
            let b = pdstor_engine::buffer::cuda::CudaBuffer::alloc(0, cfg.bytes as usize)?;
            let info = serde_json::to_value(b.info())?;
            (Box::new(b), info)
        }
        #[cfg(not(feature = "cuda"))]
        LadderExporter::Cuda => {
            bail!("this pdstor was built without CUDA: rebuild with `--features cuda` (cargo xtask gpu-qual does)")
        }
    })
}

struct RungCtx<'a> {
    cfg: &'a LadderConfig,
    engine: &'a mut Engine,
    memory: &'a dyn Memory,
    reader: Option<&'a pdstor_probes::SignalReader>,
    class: pdstor_probes::TargetClass,
    independent: &'a std::fs::File,
    base: u64,
    seed: u64,
    transfer_base: u64,
    rung: Rung,
}

impl RungCtx<'_> {
    fn chunks(&self) -> u64 {
        self.cfg.bytes / self.cfg.chunk
    }

    fn pattern(&self) -> Vec<u8> {
        (0..self.chunks()).flat_map(|i| pdstor_engine::payload::chunk(self.seed, i, self.cfg.chunk as usize)).collect()
    }

    fn run(&mut self) -> anyhow::Result<()> {
        let path = self.rung.path;
        let pattern = self.pattern();
        self.memory.fill(0, &pattern).context("filling the exporter's memory")?;
        // Host paths stage through a host buffer (inside the timed span: the
        // exporter's memory → host buffer → target and back); dmabuf_fixed
        // installs the exporter's memory itself.
        let id = match path {
            PayloadPath::DmabufFixed => {
                let exported = self.memory.export().context("exporting the memory as a DMA-BUF")?;
                let size = exported.size();
                let buf = Buffer::from_dmabuf(exported, None).context("importing the DMA-BUF into pdstor")?;
                self.rung.dmabuf_import = Some(format!("exported as a DMA-BUF of {size} bytes and imported by pdstor"));
                self.engine.register_dmabuf(buf).context("registering the DMA-BUF with io_uring")?
            }
            _ => {
                let staging = Buffer::host(self.cfg.bytes as usize)?;
                let kind = if path == PayloadPath::HostFixed { "a registered host buffer" } else { "a host buffer" };
                self.rung.staging = Some(format!("the exporter's memory → {kind} → target, and back (timed)"));
                if path == PayloadPath::HostFixed {
                    self.engine.register(staging)?
                } else {
                    self.engine.add(staging)?
                }
            }
        };
        let result = self.transfers(id, &pattern);
        self.engine.remove(id)?;
        result
    }

    fn requests(&self, id: pdstor_engine::io::BufferId, op: Op) -> Vec<IoRequest> {
        let dir = if op == Op::Write { 0 } else { 1 << 20 };
        (0..self.chunks())
            .map(|i| IoRequest {
                transfer: TransferId(self.transfer_base | dir | i),
                op,
                path: self.rung.path,
                buffer: id,
                buffer_offset: BufferOffset(i * self.cfg.chunk),
                target_offset: TargetOffset(self.base + i * self.cfg.chunk),
                len: self.cfg.chunk,
            })
            .collect()
    }

    fn judge(&mut self, requests: &[IoRequest]) {
        for r in requests {
            let v = match self.reader {
                None => pdstor_probes::Verdict::Unverifiable("probes not attached".into()),
                Some(reader) => {
                    reader.verdict(r.transfer.0, pdstor_daemon::provenance::declared(self.rung.path), self.class)
                }
            };
            *self.rung.verdicts.entry(v.to_string()).or_default() += 1;
        }
    }

    fn transfers(&mut self, id: pdstor_engine::io::BufferId, pattern: &[u8]) -> anyhow::Result<()> {
        let (bytes, mib) = (self.cfg.bytes as usize, self.cfg.bytes as f64 / 1048576.0);
        let staged = self.rung.path != PayloadPath::DmabufFixed;
        let writes = self.requests(id, Op::Write);
        let cpu = cpu_time();
        let t = Instant::now();
        if staged {
            self.memory.stage_out(self.engine.buffer(id)?, bytes).context("staging out of the exporter's memory")?;
        }
        self.engine.execute_all(&writes)?;
        self.engine.flush()?;
        self.rung.write_mib_s = Some(mib / t.elapsed().as_secs_f64());
        let write_cpu = cpu_time().saturating_sub(cpu);
        self.judge(&writes);

        self.independent_readback(pattern)?;

        // Read back through pdstor into cleared memory.
        self.memory.clear(bytes)?;
        if staged {
            self.engine.buffer(id)?.write_at(0, &vec![0u8; bytes])?;
        }
        let reads = self.requests(id, Op::Read);
        let cpu = cpu_time();
        let t = Instant::now();
        self.engine.execute_all(&reads)?;
        if staged {
            self.memory.stage_in(self.engine.buffer(id)?, bytes).context("staging into the exporter's memory")?;
        }
        self.rung.read_mib_s = Some(mib / t.elapsed().as_secs_f64());
        // Both ways; the independent readback and the clearing between are not counted.
        let spent = write_cpu + cpu_time().saturating_sub(cpu);
        let gib = 2.0 * self.cfg.bytes as f64 / (1u64 << 30) as f64;
        self.rung.cpu_ms_per_gib = Some(spent.as_secs_f64() * 1000.0 / gib);
        self.judge(&reads);
        let (diff, place) = self.memory.first_difference(pattern)?;
        self.rung.compared = Some(format!("{bytes} bytes against the pattern, {place}"));
        if let Some(at) = diff {
            bail!(
                "the bytes read back through pdstor into the exporter's memory differ at byte {at} (compared {place})"
            );
        }
        let (said, gib_s) = verify::where_landed(self.memory, pattern, self.cfg.chunk)?;
        (self.rung.verified, self.rung.verify_gib_s) = (Some(said), Some(gib_s));
        Ok(())
    }

    /// Every byte of the rung's region, read with `pread(O_DIRECT)` on a
    /// separate descriptor: no pdstor code between the media and the compare.
    fn independent_readback(&mut self, pattern: &[u8]) -> anyhow::Result<()> {
        let aligned = Buffer::host(self.cfg.chunk as usize)?;
        let addr = aligned.addr()?;
        let mut got = vec![0u8; self.cfg.chunk as usize];
        for i in 0..self.chunks() {
            let off = self.base + i * self.cfg.chunk;
            // SAFETY: `aligned` owns `chunk` bytes at `addr`, page-aligned as
            // O_DIRECT needs, and outlives the call.
            let n = unsafe {
                libc::pread(self.independent.as_raw_fd(), addr as *mut libc::c_void, got.len(), off as libc::off_t)
            };
            if n != got.len() as isize {
                bail!(
                    "independent pread of {} bytes at {off} returned {n}: {}",
                    got.len(),
                    std::io::Error::last_os_error()
                );
            }
            aligned.read_at(0, &mut got)?;
            let want = &pattern[(i * self.cfg.chunk) as usize..][..got.len()];
            if let Some(at) = pdstor_engine::payload::first_difference(want, &got) {
                bail!("independent readback: the target differs from the written bytes at byte {}", off + at as u64);
            }
        }
        self.rung.independent_readback =
            Some(format!("{} bytes match (pread O_DIRECT, outside the engine)", self.cfg.bytes));
        Ok(())
    }
}

/// This process's CPU time so far, user and system (`getrusage`).
fn cpu_time() -> std::time::Duration {
    // SAFETY: getrusage(2) fills the struct it is given and touches nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF cannot fail with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| std::time::Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}
