//! `cargo xtask cuda-ptx`: the GPU CRC-32C kernel's PTX
//! (`engine/src/crc32c/gpu/kernel.ptx`) made from its source with nvcc,
//! then checked by ptxas for every GPU generation it claims. The build never
//! needs a CUDA toolkit: the PTX is committed and the driver compiles it at
//! run time. nvcc and ptxas come from the Python venv (`cargo xtask
//! python`'s, where vLLM's CUDA wheels put them); `--check` (CI) fails when
//! the committed PTX is not what the source makes.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

use crate::project_root;

#[derive(clap::Args)]
pub struct CudaPtxArgs {
    /// Compare with the committed PTX instead of writing it.
    #[arg(long)]
    pub check: bool,
}

/// The oldest GPU the PTX targets (the oldest CUDA 13 compiles for), and
/// the generations ptxas checks it for (Turing, Ampere, Hopper).
const ARCH: &str = "compute_75";
const CHECKED: [&str; 3] = ["sm_75", "sm_80", "sm_90"];
/// The PTX ISA the file declares: nvcc writes its own (9.5 for 13.5), which a
/// driver older than that toolkit refuses; nothing in the kernel needs more
/// than 7.0 (CUDA 11.0, drivers R450 on), and ptxas checks that it does not.
const ISA: &str = ".version 7.0";

pub fn run(sh: &Shell, args: &CudaPtxArgs) -> Result<()> {
    let venv = crate::python::venv(sh)?;
    let (nvcc, ptxas) = tools(&venv)?;
    let dir = project_root().join("engine/src/crc32c/gpu");
    let (src, committed) = (dir.join("kernel.cu"), dir.join("kernel.ptx"));
    let made = project_root().join("target/cuda-ptx/kernel.ptx");
    sh.create_dir(project_root().join("target/cuda-ptx"))?;
    cmd!(sh, "{nvcc} -ptx -arch={ARCH} -O3 -o {made} {src}").run().context("nvcc could not compile kernel.cu")?;
    let ptx = lower_isa(&std::fs::read_to_string(&made)?)?;
    std::fs::write(&made, &ptx)?;
    for arch in CHECKED {
        cmd!(sh, "{ptxas} -arch={arch} -O3 -o /dev/null {made}")
            .run()
            .with_context(|| format!("ptxas refuses the kernel's PTX for {arch}"))?;
    }
    if args.check {
        let have = std::fs::read_to_string(&committed).with_context(|| format!("reading {}", committed.display()))?;
        if code(&have) != code(&ptx) {
            bail!(
                "{} is not what nvcc makes of kernel.cu ({} is): run `cargo xtask cuda-ptx` and commit it",
                committed.display(),
                made.display()
            );
        }
        println!("cuda-ptx: {} is current; ptxas accepts it for {}", committed.display(), CHECKED.join(", "));
    } else {
        std::fs::write(&committed, &ptx)?;
        println!("cuda-ptx: wrote {}; ptxas accepts it for {}", committed.display(), CHECKED.join(", "));
    }
    Ok(())
}

/// nvcc and ptxas from the venv's CUDA wheels.
fn tools(venv: &Path) -> Result<(PathBuf, PathBuf)> {
    let lib = venv.join("lib");
    let site = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/nvidia/cu13/bin"))
        .find(|p| p.join("nvcc").exists())
        .with_context(|| {
            format!(
                "no nvcc under {}/python*/site-packages/nvidia/cu13/bin (the CUDA 13 wheels vLLM installs)",
                lib.display()
            )
        })?;
    Ok((site.join("nvcc"), site.join("ptxas")))
}

/// The PTX with its `.version` line replaced by [`ISA`].
fn lower_isa(ptx: &str) -> Result<String> {
    let mut found = false;
    let lines: Vec<&str> = ptx
        .lines()
        .map(|l| {
            if l.starts_with(".version ") && !found {
                found = true;
                ISA
            } else {
                l
            }
        })
        .collect();
    if !found {
        bail!("nvcc's PTX has no .version line");
    }
    Ok(lines.join("\n") + "\n")
}

/// The PTX without comments (which name the nvcc build that made it).
fn code(ptx: &str) -> Vec<&str> {
    ptx.lines().filter(|l| !l.trim_start().starts_with("//")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_isa_line_is_lowered_and_comments_do_not_count() {
        let made = "//\n// Cuda compilation tools, release 13.5\n.version 9.5\n.target sm_75\n";
        let lowered = super::lower_isa(made).unwrap();
        assert_eq!(lowered, "//\n// Cuda compilation tools, release 13.5\n.version 7.0\n.target sm_75\n");
        assert_eq!(super::code(&lowered), super::code(&lowered.replace("13.5", "13.6")));
        assert!(super::lower_isa(".target sm_75\n").is_err());
    }
}
