//! `cargo xtask python`: the Python package (`python/`) in a virtual
//! environment with the real vLLM and LMCache, as their users install them —
//! `pip install vllm==0.33.0 lmcache==0.5.6` (which bring torch from PyPI),
//! then `pip install` of the package's wheel (`cargo xtask python --wheel` builds it: one abi3 wheel for
//! CPython 3.11 and later) — and its tests: the API against a live daemon,
//! the LMCache plugin loaded by LMCache's own configuration, and the vLLM
//! connector driven by vLLM's own scheduler.
//!
//! The environment is several GB (torch pulls CUDA's runtime wheels even on a
//! CPU machine), so it is made once per requirement set and interpreter and
//! kept under `~/.cache/pdstor/python/<key>/venv`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

use crate::project_root;

/// What the environment holds besides pdstor: vLLM (the `pdstor.vllm`
/// connector's tests drive its real scheduler; it pins torch 2.14, which
/// LMCache accepts) and LMCache as their users install them; the native
/// engine of LMCache's raw_block backend (the benchmark's peer: a separate
/// wheel, published only as release candidates); NIXL (the small-chunk
/// benchmark's peer: its POSIX backend runs on the CPU); the test and build
/// tools.
pub const REQUIREMENTS: &str = "vllm==0.33.0\nlmcache==0.5.6\nlmcache-rust-raw-block-io==0.5.7rc2\nnixl-cu12==1.5.1\nnumpy\npytest\nmaturin>=1.9,<2\npatchelf\n";

/// The marker written once the environment is complete: a half-made one
/// (an interrupted pip) is made again, never used.
pub(crate) const COMPLETE: &str = ".pdstor-complete";

#[derive(clap::Args, Debug, Default)]
pub struct PythonArgs {
    /// Only make (or find) the environment and install the package; print its path.
    #[arg(long)]
    pub env_only: bool,
    /// Only build the wheel users install (`pip install pdstor-*.whl`) into target/wheels/ and
    /// print its path.
    #[arg(long, conflicts_with = "env_only")]
    pub wheel: bool,
    /// pytest arguments (default: the whole of python/tests).
    #[arg(trailing_var_arg = true)]
    pub pytest: Vec<String>,
}

/// The environment for pip: the system's CA bundle where there is one (as
/// Debian's own pip uses; a venv's pip otherwise trusts only its vendored
/// certificates), and the package built into the workspace's `target/python`.
pub(crate) fn pip_env(cmd: xshell::Cmd<'_>) -> xshell::Cmd<'_> {
    let bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
    let cmd = cmd
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_PROGRESS_BAR", "off")
        .env("CARGO_TARGET_DIR", project_root().join("target/python"));
    if std::env::var_os("PIP_CERT").is_none() && bundle.exists() { cmd.env("PIP_CERT", bundle) } else { cmd }
}

/// The interpreter the environment is made from: Debian's `/usr/bin/python3`
/// (what `cargo xtask deps` installs), else `python3` on PATH.
pub(crate) fn interpreter(sh: &Shell) -> Result<(String, String)> {
    let python = if Path::new("/usr/bin/python3").exists() { "/usr/bin/python3".to_owned() } else { "python3".into() };
    let version = cmd!(sh, "{python} --version")
        .quiet()
        .read()
        .with_context(|| format!("running {python} --version: install python3 and python3-venv (cargo xtask deps)"))?;
    Ok((python, version.trim().to_owned()))
}

/// The lint tools, pinned so that a new release never fails a run by itself:
/// ruff (lint and format) and mypy (and its stubtest).
pub const LINT_REQUIREMENTS: &str = "ruff==0.17.6\nmypy==2.4.1\n";

/// The cached environment (made if missing or incomplete); returns its directory.
pub fn venv(sh: &Shell) -> Result<PathBuf> {
    let (_, version) = interpreter(sh)?;
    check_interpreter(&version)?;
    cached_venv(sh, "python", REQUIREMENTS)
}

/// A venv with `requirements`, made once per requirement set and interpreter
/// under `~/.cache/pdstor/<kind>/<key>/venv`.
fn cached_venv(sh: &Shell, kind: &str, requirements: &str) -> Result<PathBuf> {
    let (python, version) = interpreter(sh)?;
    // FNV-1a over what decides the environment: the interpreter and the requirements.
    let key = format!("{version}\n{requirements}")
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let key = format!("{key:016x}");
    let home = std::env::var_os("HOME").context("HOME is not set: cannot find ~/.cache/pdstor")?;
    let root = PathBuf::from(home).join(".cache/pdstor").join(kind).join(&key);
    let venv = root.join("venv");
    if venv.join(COMPLETE).exists() {
        println!("python: environment {} ({version}, cached)", venv.display());
        return Ok(venv);
    }
    let started = Instant::now();
    let _ = std::fs::remove_dir_all(&venv);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    println!("python: making {} ({version}): pip install {}", venv.display(), requirements.replace('\n', " "));
    cmd!(sh, "{python} -m venv {venv}")
        .run()
        .with_context(|| format!("{python} -m venv: install python3-venv (cargo xtask deps)"))?;
    let listed = root.join("requirements.txt");
    std::fs::write(&listed, requirements).context("writing requirements.txt")?;
    let pip = venv.join("bin/pip");
    pip_env(cmd!(sh, "{pip} install --quiet -r {listed}"))
        .run()
        .with_context(|| format!("pip install of {} (PyPI must be reachable)", requirements.replace('\n', " ")))?;
    let frozen = cmd!(sh, "{pip} freeze").quiet().read().context("pip freeze")?;
    std::fs::write(root.join("freeze.txt"), frozen).context("writing freeze.txt")?;
    std::fs::write(venv.join(COMPLETE), "").context("marking the environment complete")?;
    println!(
        "python: environment made in {:.0} s (versions in {})",
        started.elapsed().as_secs_f64(),
        root.join("freeze.txt").display()
    );
    Ok(venv)
}

/// Builds the package's wheel with the environment's maturin, in release,
/// into `target/wheels/` (emptied of older pdstor wheels first); answers its path.
pub fn wheel(sh: &Shell, venv: &Path) -> Result<PathBuf> {
    let started = Instant::now();
    let out = project_root().join("target/wheels");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    for old in wheels_in(&out)? {
        std::fs::remove_file(&old).with_context(|| format!("removing the old wheel {}", old.display()))?;
    }
    let (maturin, python) = (venv.join("bin/maturin"), venv.join("bin/python"));
    let manifest = project_root().join("python/Cargo.toml");
    println!("python: building the wheel (maturin, release; the first build takes a few minutes)");
    cmd!(sh, "{maturin} build --release --quiet --manifest-path {manifest} --interpreter {python} --out {out}")
        .env("CARGO_TARGET_DIR", project_root().join("target/python"))
        .run()
        .context("maturin build of python/ failed (its output is above)")?;
    let built = wheels_in(&out)?;
    let [wheel] = built.as_slice() else {
        bail!("maturin build left {} pdstor wheels in {}, not one: {built:?}", built.len(), out.display());
    };
    println!("python: built {} in {:.0} s", wheel.display(), started.elapsed().as_secs_f64());
    Ok(wheel.clone())
}

/// The pdstor wheels in `dir`.
fn wheels_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with("pdstor-") && name.ends_with(".whl") {
            found.push(path);
        }
    }
    Ok(found)
}

/// Builds the wheel and `pip install`s it into `venv`, exactly as a user
/// installs it; answers the wheel.
pub fn install(sh: &Shell, venv: &Path) -> Result<PathBuf> {
    let wheel = wheel(sh, venv)?;
    let pip = venv.join("bin/pip");
    pip_env(cmd!(sh, "{pip} install --quiet --force-reinstall --no-deps {wheel}"))
        .run()
        .with_context(|| format!("pip install {} failed (its output is above)", wheel.display()))?;
    println!("python: pip install {}", wheel.display());
    Ok(wheel)
}

/// The package held to its ecosystem's checks, in a small venv of the lint
/// tools (cached like the main one) with `wheel` installed: `ruff check` and
/// `ruff format --check` over `python/pdstor`, `mypy` over it (the settings
/// are `python/pyproject.toml`'s), and `mypy.stubtest` of the built module
/// against the hand-written `_native.pyi` (its exceptions, each with its
/// reason, in `python/stubtest-allowlist.txt`).
pub fn lint(sh: &Shell, wheel: &Path) -> Result<()> {
    let tools = cached_venv(sh, "pylint", LINT_REQUIREMENTS)?;
    let pip = tools.join("bin/pip");
    pip_env(cmd!(sh, "{pip} install --quiet --force-reinstall --no-deps {wheel}"))
        .run()
        .with_context(|| format!("pip install {} into the lint venv failed", wheel.display()))?;
    let (ruff, mypy, python) = (tools.join("bin/ruff"), tools.join("bin/mypy"), tools.join("bin/python"));
    let package = project_root().join("python");
    let allowlist = package.join("stubtest-allowlist.txt");
    sh.change_dir(&package);
    let checked = (|| -> Result<()> {
        cmd!(sh, "{ruff} check")
            .run()
            .context("ruff found problems in python/pdstor (`ruff check --fix` fixes some)")?;
        cmd!(sh, "{ruff} format --check")
            .run()
            .context("python/pdstor is not formatted: run `ruff format` in python/")?;
        cmd!(sh, "{mypy}").run().context("mypy found type errors in python/pdstor (see above)")?;
        Ok(())
    })();
    // From the workspace root, where no source tree shadows the installed module.
    sh.change_dir(project_root());
    checked?;
    cmd!(sh, "{python} -m mypy.stubtest pdstor._native --allowlist {allowlist}")
        .run()
        .context("python/pdstor/_native.pyi does not match the built module (stubtest, above): fix the stub")?;
    println!("python: ruff, mypy and stubtest found nothing");
    Ok(())
}

/// Lints the binding crate (its own cargo workspace) with the environment's interpreter.
pub fn clippy(sh: &Shell, venv: &Path) -> Result<()> {
    let manifest = project_root().join("python/Cargo.toml");
    cmd!(sh, "cargo fmt --manifest-path {manifest} --check")
        .run()
        .context("python/: formatting differs: run cargo fmt there")?;
    cmd!(sh, "cargo clippy --manifest-path {manifest} --all-targets --quiet -- -D warnings")
        .env("PYO3_PYTHON", venv.join("bin/python"))
        .env("CARGO_TARGET_DIR", project_root().join("target/python"))
        .run()
        .context("clippy found problems in python/")
}

pub fn run(sh: &Shell, args: &PythonArgs) -> Result<()> {
    let venv = venv(sh)?;
    if args.wheel {
        println!("{}", wheel(sh, &venv)?.display());
        return Ok(());
    }
    let wheel = install(sh, &venv)?;
    if args.env_only {
        println!("{}", venv.display());
        return Ok(());
    }
    lint(sh, &wheel)?;
    test(sh, &venv, &args.pytest)
}

/// The package's tests (API and LMCache plugin) against the release daemon.
pub fn test(sh: &Shell, venv: &Path, pytest: &[String]) -> Result<()> {
    let pdstor = crate::build_pdstor(sh)?;
    let python = venv.join("bin/python");
    let tests = project_root().join("python/tests");
    let args: Vec<String> = if pytest.is_empty() {
        vec![tests.display().to_string(), "-q".into(), "-p".into(), "no:cacheprovider".into()]
    } else {
        pytest.to_vec()
    };
    // From the tests' own directory: the installed package is what is
    // imported, not the source tree's python/pdstor (which has no module built).
    sh.change_dir(&tests);
    let ran = cmd!(sh, "{python} -m pytest {args...}").env("PDSTOR_BIN", &pdstor).run();
    sh.change_dir(project_root());
    ran.context("the Python tests failed (see above)")
}

/// Fails unless the interpreter is one LMCache 0.5.6 ships wheels for.
fn check_interpreter(version: &str) -> Result<()> {
    if !version.starts_with("Python 3.11") {
        bail!("{version}: LMCache 0.5.6 publishes wheels for CPython 3.11 only");
    }
    Ok(())
}
