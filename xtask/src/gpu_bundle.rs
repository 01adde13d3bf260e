//! `cargo xtask gpu-bundle`: the GPU qualification as one archive that a
//! bare GPU machine runs — no Rust, no network, no package registry, nothing
//! of ours installed: a shell and that machine's Python (with torch) are all
//! it needs.
//!
//! The archive (`target/gpu-bundle/pdstor-gpu-bundle.tar.gz`, at most
//! [`MAX_ARCHIVE`]) holds `pdstor` built with `--features cuda` (libcuda is
//! loaded at run time), the engine's test binary with the CUDA tests, the
//! abi3 wheel, and the scripts of `gpu-qual/` with `run.sh` as the one entry
//! point. Every binary is checked here before it is packed: it may need no
//! shared library but glibc's own ([`GLIBC_LIBRARIES`]), and no glibc symbol
//! newer than [`GLIBC_CLAIM`], the oldest glibc the bundle claims to run on.
//! `cargo xtask gpu-bundle --bare` then runs it in a bare Debian root with no
//! Rust, no cargo cache and no network (CI does), where every GPU rung must
//! say SKIP with "no CUDA device" and every other rung pass.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

use crate::project_root;

/// The oldest glibc the bundle claims to run on: 2.34 (RHEL 9; Ubuntu 22.04
/// has 2.35). Binaries linked against glibc 2.34 or later need
/// `__libc_start_main@GLIBC_2.34`, so no build of this machine can claim less.
pub const GLIBC_CLAIM: (u32, u32) = (2, 34);

/// The largest archive the bundle may be (a device command carries 64 MiB).
pub const MAX_ARCHIVE: u64 = 48 << 20;

/// The shared libraries a bundled binary may need: glibc's own, and the GCC
/// runtime every glibc system has.
pub const GLIBC_LIBRARIES: &[&str] =
    &["libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libgcc_s.so.1", "ld-linux-x86-64.so.2"];

/// The bundle's directory name inside the archive.
pub const NAME: &str = "pdstor-gpu-bundle";

#[derive(clap::Args, Debug, Default)]
pub struct GpuBundleArgs {
    /// After building, run the bundle in a bare Debian root (no Rust, no cargo cache, no
    /// network, no GPU) and check its report: every rung reports, GPU rungs SKIP, the rest pass.
    #[arg(long)]
    pub bare: bool,
}

pub fn run(sh: &Shell, args: &GpuBundleArgs) -> Result<()> {
    let archive = build(sh)?;
    if args.bare {
        crate::gpu_bare::run(sh, &archive)?;
    }
    Ok(())
}

/// Builds the bundle and its archive; answers the archive's path.
pub fn build(sh: &Shell) -> Result<PathBuf> {
    let out = project_root().join("target/gpu-bundle");
    let dir = out.join(NAME);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bin")).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir_all(dir.join("wheel")).with_context(|| format!("creating {}", dir.display()))?;

    let pdstor = crate::build_pdstor(sh)?;
    let tests = engine_test_binary(sh)?;
    let venv = crate::python::venv(sh)?;
    let wheel = crate::python::wheel(sh, &venv)?;
    for (from, to) in [(&pdstor, "bin/pdstor"), (&tests, "bin/engine-tests")] {
        let dest = dir.join(to);
        // Line tables are for a debugger here, not for the GPU machine.
        cmd!(sh, "strip --strip-debug -o {dest} {from}")
            .run()
            .with_context(|| format!("stripping {}", from.display()))?;
    }
    let wheel_name = wheel.file_name().context("the wheel has no file name")?;
    std::fs::copy(&wheel, dir.join("wheel").join(wheel_name)).context("copying the wheel")?;
    copy_scripts(&dir)?;

    let native = extract_native(sh, &wheel, &out)?;
    let checked = [dir.join("bin/pdstor"), dir.join("bin/engine-tests"), native];
    let mut highest = (0, 0);
    for bin in &checked {
        highest = highest.max(check_binary(sh, bin)?);
    }
    write_manifest(sh, &dir, highest)?;

    let archive = out.join(format!("{NAME}.tar.gz"));
    cmd!(sh, "tar -czf {archive} -C {out} {NAME}").run().context("packing the bundle")?;
    let size = std::fs::metadata(&archive)?.len();
    if size > MAX_ARCHIVE {
        bail!("the bundle is {size} bytes, over the {MAX_ARCHIVE}-byte limit a device command carries");
    }
    println!(
        "gpu-bundle: {} ({:.1} MiB; highest glibc symbol GLIBC_{}.{}, claims glibc >= {}.{})",
        archive.display(),
        size as f64 / 1048576.0,
        highest.0,
        highest.1,
        GLIBC_CLAIM.0,
        GLIBC_CLAIM.1
    );
    Ok(archive)
}

/// The engine's unit-test binary, in release, with the CUDA tests in it.
fn engine_test_binary(sh: &Shell) -> Result<PathBuf> {
    let format = "--message-format=json-render-diagnostics";
    let json = cmd!(sh, "cargo test --release --quiet -p pdstor-engine --features cuda --lib --no-run {format}")
        .read()
        .context("building the engine's test binary with --features cuda")?;
    json.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "pdstor_engine")
        .find_map(|v| v["executable"].as_str().map(PathBuf::from))
        .context("cargo named no test executable for pdstor-engine's library")
}

/// The run's scripts: everything in `gpu-qual/`.
fn copy_scripts(dir: &Path) -> Result<()> {
    let src = project_root().join("gpu-qual");
    for entry in std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let is_script = name.to_str().is_some_and(|n| n.ends_with(".py") || n.ends_with(".sh") || n.ends_with(".md"));
        if entry.file_type()?.is_file() && is_script {
            std::fs::copy(entry.path(), dir.join(&name))
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The wheel's native module, unpacked beside the bundle for the checks.
fn extract_native(sh: &Shell, wheel: &Path, out: &Path) -> Result<PathBuf> {
    let scratch = out.join("wheel-check");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let python = "/usr/bin/python3";
    let code = "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])";
    cmd!(sh, "{python} -c {code} {wheel} {scratch}").run().context("unpacking the wheel")?;
    let dir = scratch.join("pdstor");
    std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("_native") && n.ends_with(".so"))
        })
        .context("the wheel holds no pdstor/_native*.so")
}

/// Checks one binary: no shared library beyond [`GLIBC_LIBRARIES`], no
/// glibc symbol newer than [`GLIBC_CLAIM`]; answers its highest glibc version.
fn check_binary(sh: &Shell, bin: &Path) -> Result<(u32, u32)> {
    let headers =
        cmd!(sh, "objdump -p {bin}").quiet().read().with_context(|| format!("objdump -p {}", bin.display()))?;
    let needed = needed_libraries(&headers);
    let foreign: Vec<&str> = needed.iter().map(String::as_str).filter(|l| !GLIBC_LIBRARIES.contains(l)).collect();
    if !foreign.is_empty() {
        bail!(
            "{} needs {foreign:?}, which a GPU machine may lack: link them in statically (only {GLIBC_LIBRARIES:?} may be needed)",
            bin.display()
        );
    }
    let symbols =
        cmd!(sh, "objdump -T {bin}").quiet().read().with_context(|| format!("objdump -T {}", bin.display()))?;
    let highest = highest_glibc(&symbols);
    if highest > GLIBC_CLAIM {
        let newest: Vec<&str> =
            symbols.lines().filter(|l| l.contains(&format!("GLIBC_{}.{}", highest.0, highest.1))).collect();
        bail!(
            "{} needs GLIBC_{}.{}, newer than the glibc {}.{} the bundle claims: {newest:?}",
            bin.display(),
            highest.0,
            highest.1,
            GLIBC_CLAIM.0,
            GLIBC_CLAIM.1
        );
    }
    println!(
        "gpu-bundle: {}: needs {}; highest glibc symbol GLIBC_{}.{}",
        bin.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
        needed.join(", "),
        highest.0,
        highest.1
    );
    Ok(highest)
}

/// The `NEEDED` entries of `objdump -p`.
pub fn needed_libraries(headers: &str) -> Vec<String> {
    headers.lines().filter_map(|l| l.trim().strip_prefix("NEEDED")).map(|l| l.trim().to_owned()).collect()
}

/// The highest `GLIBC_x.y` version any symbol of `objdump -T` names.
pub fn highest_glibc(symbols: &str) -> (u32, u32) {
    symbols
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.');
            let major = parts.next()?.parse().ok()?;
            let minor = parts.next().map_or(Some(0), |m| m.parse().ok())?;
            Some((major, minor))
        })
        .max()
        .unwrap_or((0, 0))
}

/// `MANIFEST.json`: what was built from what, and each file's SHA-256.
fn write_manifest(sh: &Shell, dir: &Path, highest: (u32, u32)) -> Result<()> {
    let root = project_root();
    let commit = cmd!(sh, "git -C {root} rev-parse HEAD").quiet().read().unwrap_or_else(|_| "unknown".into());
    let dirty = !cmd!(sh, "git -C {root} status --porcelain").quiet().read().unwrap_or_default().trim().is_empty();
    let rustc = cmd!(sh, "rustc --version").quiet().read().unwrap_or_default();
    let mut names = Vec::new();
    files_under(dir, Path::new(""), &mut names)?;
    sh.change_dir(dir);
    let sums = cmd!(sh, "sha256sum {names...}").quiet().read();
    sh.change_dir(&root);
    let files: serde_json::Map<String, serde_json::Value> = sums
        .context("sha256sum of the bundle's files")?
        .lines()
        .filter_map(|l| l.split_once("  "))
        .map(|(sum, path)| (path.to_owned(), serde_json::Value::from(sum)))
        .collect();
    let manifest = serde_json::json!({
        "commit": commit,
        "dirty": dirty,
        "built_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "rustc": rustc,
        "glibc_claim": format!("{}.{}", GLIBC_CLAIM.0, GLIBC_CLAIM.1),
        "glibc_highest_symbol": format!("{}.{}", highest.0, highest.1),
        "libraries_allowed": GLIBC_LIBRARIES,
        "files": files,
    });
    std::fs::write(dir.join("MANIFEST.json"), serde_json::to_vec_pretty(&manifest)?).context("writing MANIFEST.json")
}

/// Every file under `dir/rel`, as paths relative to `dir`, sorted.
fn files_under(dir: &Path, rel: &Path, out: &mut Vec<String>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir.join(rel))
        .with_context(|| format!("reading {}", dir.join(rel).display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = rel.join(e.file_name());
        if e.file_type()?.is_dir() {
            files_under(dir, &path, out)?;
        } else {
            out.push(path.display().to_string());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_glibc_version_is_read_from_objdump() {
        let t = "0000 DF *UND* 0000 (GLIBC_2.2.5) memcpy\n0000 DF *UND* 0000 (GLIBC_2.34) __libc_start_main\n\
                 0000 DF *UND* 0000 GLIBC_2.28 fcntl64\n0000 DF *UND* 0000 (GLIBC_PRIVATE) _dl_x";
        assert_eq!(highest_glibc(t), (2, 34));
        assert_eq!(highest_glibc("nothing"), (0, 0));
    }

    #[test]
    fn needed_libraries_are_read_from_objdump() {
        let h =
            "Dynamic Section:\n  NEEDED               libgcc_s.so.1\n  NEEDED               libelf.so.1\n  RUNPATH x";
        assert_eq!(needed_libraries(h), vec!["libgcc_s.so.1".to_owned(), "libelf.so.1".to_owned()]);
    }
}
