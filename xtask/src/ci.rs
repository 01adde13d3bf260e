//! `cargo xtask ci`: every check, in order, as one table. The verb's help is
//! made from the same table, so what `cargo xtask ci --help` lists is what
//! the run does.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use xshell::{Shell, cmd};

use crate::{build_pdstor, cuda_ptx, disk, docs, gpu_bare, gpu_bundle, project_root, python, reclaim, soak, step};
use crate::{vllm, vmtest};

/// What the steps hand on to each other.
#[derive(Default)]
struct Run {
    /// The tests `cargo test` skipped, one `SKIP:` line each.
    skips: String,
    /// The Python venv with vLLM and LMCache (the soak runs in it too).
    venv: Option<PathBuf>,
}

/// One step of the run: the line it prints (and the help lists) and the work.
struct Step {
    title: &'static str,
    run: fn(&Shell, &mut Run) -> Result<()>,
}

/// Every step of `cargo xtask ci`, in the order it runs them.
const STEPS: &[Step] = &[
    Step { title: "room on disk", run: room },
    Step { title: "cargo fmt --check", run: fmt },
    Step { title: "cargo clippy --all-targets -- -D warnings", run: clippy },
    Step {
        title: "cargo clippy -p pdstor-engine -p pdstor-proof -p pdstor --features cuda (builds with no CUDA toolkit: the driver is loaded at run time)",
        run: clippy_cuda,
    },
    Step {
        title: "cargo doc -p pdstor-engine -p pdstor-daemon -p pdstor-proof (every public item documented: missing_docs, links resolve)",
        run: api_docs,
    },
    Step { title: "the book (mdbook build docs/, every internal link checked)", run: |sh, _| docs::build(sh) },
    Step { title: "cargo test --workspace (then the list of tests it skipped, and why)", run: tests },
    Step {
        title: "cargo xtask python (the wheel in a venv with vLLM 0.33 and LMCache 0.5.6 from PyPI; ruff, mypy and stubtest; its tests)",
        run: python,
    },
    Step {
        title: "cargo xtask soak --minutes 5 (the daemon under a serving mix with faults, on a file and on zram at once)",
        run: soak,
    },
    Step {
        title: "cargo xtask soak --plant-leak (the soak fails a debug daemon that leaks a descriptor per request)",
        run: leak,
    },
    Step {
        title: "cargo xtask cuda-ptx --check (the GPU CRC-32C kernel's PTX is what nvcc makes of its source; ptxas accepts it)",
        run: |sh, _| cuda_ptx::run(sh, &cuda_ptx::CudaPtxArgs { check: true }),
    },
    Step {
        title: "cargo xtask gpu-bundle --bare (the GPU bundle built, then run in a bare root: no Rust, no network, no GPU)",
        run: |sh, _| gpu_bare::run(sh, &gpu_bundle::build(sh)?),
    },
    Step {
        title: "cargo xtask vllm (a real model under vllm serve: prefill and decode with pdstor.vllm, the stock proxy, the oracle, the controls)",
        run: |sh, _| vllm::run(sh, &vllm::VllmArgs::ci()),
    },
    Step {
        title: "cargo xtask vmtest: the matrix on Debian's 6.12 (every suite; swiotlb with swiotlb=force; topology, two guests over NVMe/TCP)",
        run: |sh, _| vmtest::run_matrix(sh, vmtest::Kernel::Debian, None),
    },
    Step { title: "the rw-dmabuf series kernel (built once, then cached), and the same matrix on it", run: series },
    Step { title: "demo round trip (small)", run: roundtrip },
    Step {
        title: "model oracle, short profile (pdstor qualify --short on a file; its timeline checked, its mutants caught, drawn)",
        run: oracle,
    },
];

/// The verb's long help: every step, in order.
pub fn help() -> String {
    let mut text = String::from("Every check CI runs, in this order, after `cargo xtask deps`:\n");
    for (i, s) in STEPS.iter().enumerate() {
        text.push_str(&format!("\n{:>2}. {}", i + 1, s.title));
    }
    text.push_str(
        "\n\nAt the end: the seconds each step took. PDSTOR_CI_FORBID_SKIPS=1 fails a run that skipped a test.",
    );
    text
}

/// Runs every step, then says where the time went, passed or failed.
pub fn run(sh: &Shell) -> Result<()> {
    let started = std::time::Instant::now();
    let mut state = Run::default();
    let outcome = STEPS.iter().try_for_each(|s| {
        step(s.title);
        (s.run)(sh, &mut state)
    });
    crate::print_step_times();
    outcome?;
    println!("\nci: all checks passed in {:.0} s", started.elapsed().as_secs_f64());
    let skipped = state.skips.lines().count();
    if skipped > 0 && std::env::var_os("PDSTOR_CI_FORBID_SKIPS").is_some() {
        bail!("PDSTOR_CI_FORBID_SKIPS is set and {skipped} tests were skipped");
    }
    Ok(())
}

fn room(_: &Shell, _: &mut Run) -> Result<()> {
    reclaim::before_a_long_run()?;
    disk::require_for_ci()
}

fn fmt(sh: &Shell, _: &mut Run) -> Result<()> {
    cmd!(sh, "cargo fmt --all --check").run().context("formatting differs: run `cargo fmt --all`")
}

fn clippy(sh: &Shell, _: &mut Run) -> Result<()> {
    cmd!(sh, "cargo clippy --workspace --all-targets --quiet -- -D warnings").run().context("clippy found problems")
}

fn clippy_cuda(sh: &Shell, _: &mut Run) -> Result<()> {
    cmd!(
        sh,
        "cargo clippy -p pdstor-engine -p pdstor-proof -p pdstor --features cuda --all-targets --quiet -- -D warnings"
    )
    .run()
    .context("clippy found problems in the cuda feature")
}

fn api_docs(sh: &Shell, _: &mut Run) -> Result<()> {
    cmd!(sh, "cargo doc -p pdstor-engine -p pdstor-daemon -p pdstor-proof --no-deps --features cuda --quiet")
        .env("RUSTDOCFLAGS", "-D warnings")
        .run()
        .context("the pdstor API docs have warnings: document every public item (see the output above)")
}

fn tests(sh: &Shell, run: &mut Run) -> Result<()> {
    let skip_log = project_root().join("target/ci-skips.log");
    let _ = std::fs::remove_file(&skip_log);
    let tested = cmd!(sh, "cargo test --workspace").env("PDSTOR_SKIP_LOG", &skip_log).run().and_then(|()| {
        cmd!(sh, "cargo test -p pdstor-engine --features cuda --lib buffer::cuda")
            .env("PDSTOR_SKIP_LOG", &skip_log)
            .run()
    });
    run.skips = std::fs::read_to_string(&skip_log).unwrap_or_default();
    println!("\nskipped tests:");
    if run.skips.trim().is_empty() {
        println!("none");
    } else {
        print!("{}", run.skips);
    }
    tested.context("tests failed")
}

fn python(sh: &Shell, run: &mut Run) -> Result<()> {
    let venv = python::venv(sh)?;
    python::clippy(sh, &venv)?;
    let wheel = python::install(sh, &venv)?;
    python::lint(sh, &wheel)?;
    python::test(sh, &venv, &[])?;
    run.venv = Some(venv);
    Ok(())
}

fn soak_args(minutes: f64, target: &str, plant_leak: bool) -> soak::SoakArgs {
    soak::SoakArgs { minutes, target: target.into(), seed: 1, plant_leak }
}

fn soak(sh: &Shell, run: &mut Run) -> Result<()> {
    let venv = run.venv.clone().context("the soak runs in the Python step's venv, and that step did not run")?;
    soak::soak(sh, &venv, &soak_args(5.0, "both", false))
}

fn leak(sh: &Shell, run: &mut Run) -> Result<()> {
    let venv = run.venv.clone().context("the soak runs in the Python step's venv, and that step did not run")?;
    soak::soak(sh, &venv, &soak_args(1.5, "file", true))
}

fn series(sh: &Shell, _: &mut Run) -> Result<()> {
    let dir = match vmtest::series::ci_series() {
        Ok(dir) => dir,
        Err(why) => {
            println!("SKIP: vmtest on the rw-dmabuf series kernel: {why}");
            return Ok(());
        }
    };
    println!("cargo xtask kernel build (Debian linux-source-7.2 + the rw-dmabuf series; built once, then cached)");
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    vmtest::series::build(sh, &dir, vmtest::series::DEFAULT_SOURCE, jobs)?;
    vmtest::run_matrix(sh, vmtest::Kernel::Series, Some(dir))
}

fn ci_dir() -> PathBuf {
    project_root().join("target/ci-demo")
}

fn roundtrip(sh: &Shell, _: &mut Run) -> Result<()> {
    let pdstor = build_pdstor(sh)?;
    let dir = ci_dir();
    sh.create_dir(&dir)?;
    let target = dir.join("kv.img");
    let _ = std::fs::remove_file(&target);
    cmd!(sh, "{pdstor} roundtrip --target {target} --chunks 8 --chunk-size 8M").run()?;
    Ok(())
}

fn oracle(sh: &Shell, _: &mut Run) -> Result<()> {
    let pdstor = build_pdstor(sh)?;
    let dir = ci_dir();
    sh.create_dir(&dir)?;
    let out = dir.join("qualify");
    let target = dir.join("qualify.img");
    let _ = std::fs::remove_file(&target);
    cmd!(sh, "{pdstor} qualify --short --target {target} --size 64M --out {out}").run()?;
    let timeline = out.join("timeline.jsonl");
    cmd!(sh, "{pdstor} timeline check {timeline} --require-path host_fixed").run()?;
    println!("the checker's mutation test (pdstor timeline mutate: every causal lie about that timeline caught)");
    let mutants = out.join("mutants");
    cmd!(sh, "{pdstor} timeline mutate {timeline} --require-path host_fixed --out {mutants}").run()?;
    let svg = out.join("timeline.svg");
    cmd!(sh, "{pdstor} timeline render {timeline} -o {svg}").run()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// The help `cargo xtask ci --help` prints lists every step the run
    /// takes, in its order.
    #[test]
    fn the_ci_help_lists_every_step_it_runs() {
        let cli = crate::Cli::command();
        let ci = cli.find_subcommand("ci").expect("a ci verb");
        let help = ci.get_long_about().expect("ci has a long help").to_string();
        let mut from = 0;
        for s in super::STEPS {
            let at =
                help[from..].find(s.title).unwrap_or_else(|| panic!("the ci help leaves out `{}`:\n{help}", s.title));
            from += at + s.title.len();
        }
    }
}
