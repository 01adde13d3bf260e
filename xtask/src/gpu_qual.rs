//! `cargo xtask gpu-qual`: the GPU qualification on a GPU machine that has a
//! checkout, cargo and a network (a user's own): it checks the NVIDIA driver
//! and the kernel, builds the GPU bundle (`cargo xtask gpu-bundle`) and runs
//! the bundle's own `run.sh` on it — the very rungs a bare GPU machine runs
//! from the archive, so there is one GPU qualification to keep true, not
//! two. Without an NVIDIA GPU it stops at once: CPU results never qualify
//! GPU paths (the bundle's bare-root run in CI shows the GPU rungs SKIP).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

#[derive(clap::Args)]
pub struct GpuQualArgs {
    /// A scratch NVMe namespace (/dev/nvmeXnY) the ladder and the throughput rungs overwrite,
    /// instead of files in the bundle's scratch directory. Never guessed.
    #[arg(long)]
    target: Option<PathBuf>,
    /// Overwrite a --target that holds a filesystem or a pdstor namespace.
    #[arg(long)]
    force: bool,
    /// Report directory (default target/gpu-qual/<unix time>).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// What the host says about its NVIDIA stack, before anything runs.
#[derive(serde::Serialize)]
struct Preflight {
    driver: String,
    open_kernel_modules: Option<bool>,
    gpus: Vec<String>,
    kernel: String,
    kernel_dma_shared_buffer: Option<bool>,
}

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// `Err` with the reason when this machine has no NVIDIA GPU.
fn preflight(sh: &Shell) -> Result<Preflight> {
    let driver = read("/proc/driver/nvidia/version");
    let has_dev = Path::new("/dev/nvidia0").exists();
    let Some(driver) = driver.filter(|_| has_dev) else {
        bail!(
            "no NVIDIA GPU on this machine (no /proc/driver/nvidia/version or /dev/nvidia0): gpu-qual runs only on GPU hardware, and CPU results never qualify GPU paths (the CPU ladder is `pdstor ladder --exporter udmabuf`, run by `cargo xtask vmtest --suite dmabuf`)"
        );
    };
    let license = cmd!(sh, "modinfo -F license nvidia").quiet().ignore_stderr().read().ok();
    let gpus = cmd!(sh, "nvidia-smi --query-gpu=name,pci.bus_id,memory.total --format=csv,noheader")
        .quiet()
        .ignore_stderr()
        .read()
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_default();
    let kernel = read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let config = read(&format!("/boot/config-{kernel}"));
    Ok(Preflight {
        open_kernel_modules: license
            .map(|l| l.contains("Dual MIT/GPL"))
            .or_else(|| Some(driver.contains("Open Kernel Module"))),
        driver,
        gpus,
        kernel_dma_shared_buffer: config.map(|c| c.lines().any(|l| l == "CONFIG_DMA_SHARED_BUFFER=y")),
        kernel,
    })
}

pub fn run(sh: &Shell, args: &GpuQualArgs) -> Result<()> {
    let pre = match preflight(sh) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("gpu-qual: {e}");
            std::process::exit(2);
        }
    };
    println!("gpu-qual: driver: {}", pre.driver.lines().next().unwrap_or(""));
    println!("gpu-qual: GPUs: {:?}", pre.gpus);
    println!("gpu-qual: open kernel modules: {:?}; kernel {}", pre.open_kernel_modules, pre.kernel);
    if pre.open_kernel_modules == Some(false) {
        println!(
            "gpu-qual: warning: the proprietary NVIDIA kernel modules cannot export DMA-BUFs; dmabuf_fixed will not qualify"
        );
    }
    let out = args.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        crate::project_root().join(format!("target/gpu-qual/{t}"))
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    std::fs::write(out.join("preflight.json"), serde_json::to_vec_pretty(&pre)?)?;
    crate::deps::install(sh, false)?;
    crate::gpu_bundle::build(sh)?;
    let run_sh = crate::project_root().join("target/gpu-bundle").join(crate::gpu_bundle::NAME).join("run.sh");
    let mut extra: Vec<String> = Vec::new();
    if let Some(t) = &args.target {
        extra.extend(["--target".into(), t.display().to_string()]);
    }
    if args.force {
        extra.push("--force".into());
    }
    let ran = cmd!(sh, "{run_sh} {out} {extra...}").run();
    println!("gpu-qual: report in {} (preflight.json, report.json, report.md)", out.display());
    ran.context("gpu-qual: a rung FAILed (report.md says which and why)")
}
