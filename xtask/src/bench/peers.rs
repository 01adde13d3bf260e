//! The benchmarks against a peer a user would pick instead, each run by its
//! Python driver in the same run: LMCache's own backends, its raw_block L2
//! adapter, NIXL.

use super::*;

/// pdstor's LMCache plugin against LMCache's own raw_block and local_disk
/// backends (python/bench/lmcache_bench.py), its per-key latency across
/// processes (lmcache_latency.py), and its L2 adapter against raw_block's
/// L2 adapter (l2_bench.py), on each of `--targets`: three
/// zram devices (pdstor's namespace, raw_block's raw device, ext4 for
/// local_disk), or two files and a directory on the root filesystem.
pub(super) fn lmcache(sh: &Shell, pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    let venv = crate::python::venv(sh)?;
    crate::python::install(sh, &venv)?;
    let python = venv.join("bin/python");
    let script = crate::project_root().join("python/bench/lmcache_bench.py");
    let rounds = args.rounds.max(5).to_string();
    let size = &args.size;
    let latency = crate::project_root().join("python/bench/lmcache_latency.py");
    let l2 = crate::project_root().join("python/bench/l2_bench.py");
    for t in &args.targets {
        let json = out_dir.join(format!("lmcache-report-{t}.json"));
        let latency_json = out_dir.join(format!("lmcache-latency-{t}.json"));
        let l2_json = out_dir.join(format!("lmcache-l2-{t}.json"));
        // Throughput against LMCache's own backends, then pdstor's per-key
        // latency between two processes on the same kind of target.
        let run = |a: &Path, b: &Path, disk: &Path| {
            cmd!(
                sh,
                "{python} {script} --pdstor-bin {pdstor} --pdstor-device {a} --raw-block-device {b} --disk-dir {disk} --file-size {size} --label {t} --rounds {rounds} --json {json}"
            )
            .run()
            .context("the LMCache benchmark failed (see above)")?;
            cmd!(
                sh,
                "{python} {latency} --pdstor-bin {pdstor} --pdstor-device {a} --file-size {size} --label {t} --json {latency_json}"
            )
            .run()
            .context("the LMCache cross-process latency benchmark failed (see above)")?;
            cmd!(
                sh,
                "{python} {l2} --pdstor-bin {pdstor} --pdstor-target {a} --raw-block-target {b} --file-size {size} --label {t} --rounds {rounds} --json {l2_json}"
            )
            .run()
            .context("the LMCache L2 adapter benchmark failed (see above)")
        };
        match t.as_str() {
            "file" => {
                let (a, b) = (out_dir.join("lmcache-pdstor.img"), out_dir.join("lmcache-raw-block.img"));
                let disk = out_dir.join("lmcache-file-disk");
                sh.create_dir(&disk)?;
                let ran = run(&a, &b, &disk);
                let _ = std::fs::remove_file(&a);
                let _ = std::fs::remove_file(&b);
                let _ = std::fs::remove_dir_all(&disk);
                ran?;
            }
            "zram" => {
                if !crate::deps::is_root(sh) {
                    println!("SKIP: LMCache on zram: making zram devices and mounting one needs root");
                    continue;
                }
                // local_disk's filesystem holds every round: LMCache 0.5.6's
                // remove() does not give back the space its admission counts
                // (zram allocates lazily).
                let (ours, raw, disk) = (zram(size)?, zram(size)?, zram("8G")?);
                let disk_dev = &disk.path;
                cmd!(sh, "mkfs.ext4 -q -F {disk_dev}").run().context("mkfs.ext4 on the local_disk zram")?;
                let mnt = out_dir.join("lmcache-disk");
                sh.create_dir(&mnt)?;
                cmd!(sh, "mount {disk_dev} {mnt}").run().context("mounting the local_disk zram")?;
                let ran = run(&ours.path, &raw.path, &mnt);
                let _ = cmd!(sh, "umount {mnt}").run();
                drop((ours, raw, disk));
                ran?;
            }
            other => bail!("unknown bench target {other:?}: expected file or zram"),
        }
        println!("\nreports: {} {} {}", json.display(), latency_json.display(), l2_json.display());
    }
    Ok(())
}

/// pdstor's handoff against LMCache's raw_block core
/// (python/bench/raw_block_bench.py): 512 MiB per round in 8 MiB and 512 KiB
/// chunks, rounds alternating, each side on a target of its own — two zram
/// devices, or two files on the root filesystem. Prints pdstor/raw_block
/// (throughput) for store vs put and load vs get, and against raw_block at
/// pdstor's guarantees (its put then an fdatasync, its get then a crc32c of
/// every chunk); JSON per target in target/bench/raw-block-<target>.json.
pub(super) fn raw_block(sh: &Shell, pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    println!(
        "\nhandoff vs LMCache raw_block (RawBlockCore, io_uring QD 256, O_DIRECT, registered pool), 512 MiB per round"
    );
    let venv = crate::python::venv(sh)?;
    crate::python::install(sh, &venv)?;
    let python = venv.join("bin/python");
    let script = crate::project_root().join("python/bench/raw_block_bench.py");
    let rounds = args.rounds.max(5).to_string();
    for t in &args.targets {
        let json = out_dir.join(format!("raw-block-{t}.json"));
        let run = |a: &Path, b: &Path| {
            cmd!(
                sh,
                "{python} {script} --pdstor-bin {pdstor} --pdstor-target {a} --peer-target {b} --label {t} --rounds {rounds} --json {json}"
            )
            .run()
            .context("the raw_block benchmark failed (see above)")
        };
        match t.as_str() {
            "file" => {
                let (a, b) = (out_dir.join("rawbench-pdstor.img"), out_dir.join("rawbench-raw-block.img"));
                let ran = run(&a, &b);
                let _ = std::fs::remove_file(&a);
                let _ = std::fs::remove_file(&b);
                ran?;
            }
            "zram" => match (zram("2G"), zram("2G")) {
                (Ok(a), Ok(b)) => run(&a.path, &b.path)?,
                (Err(why), _) | (_, Err(why)) => println!("SKIP: raw_block on zram: {why:#}"),
            },
            other => bail!("unknown bench target {other:?}: expected file or zram"),
        }
        println!("  report: {}", json.display());
    }
    Ok(())
}

/// pdstor's engine against NIXL's POSIX backend (python/bench/nixl_bench.py):
/// 256 MiB in 16 KiB and 64 KiB commands, write then read (pdstor at QD
/// 128; NIXL with its default queue, which does not bound it the same way),
/// rounds alternating, on each of --targets in turn (a zram device,
/// a file on the root filesystem). Prints pdstor/NIXL; JSON per target in
/// target/bench/nixl-<target>.json.
pub(super) fn nixl(sh: &Shell, pdstor: &Path, out_dir: &Path, args: &BenchArgs) -> Result<()> {
    println!("\nengine (QD 128) vs NIXL 1.5.1 POSIX backend (io_uring), small chunks, 256 MiB per run");
    let venv = crate::python::venv(sh)?;
    let python = venv.join("bin/python");
    let script = crate::project_root().join("python/bench/nixl_bench.py");
    let rounds = args.rounds.max(5).to_string();
    for t in &args.targets {
        let json = out_dir.join(format!("nixl-{t}.json"));
        let run = |target: &Path| {
            cmd!(
                sh,
                "{python} {script} --pdstor-bin {pdstor} --target {target} --label {t} --rounds {rounds} --json {json}"
            )
            .env("NIXL_LOG_LEVEL", "WARN")
            .run()
            .context("the NIXL benchmark failed (see above)")
        };
        match t.as_str() {
            "file" => {
                let file = out_dir.join("nixl-bench.img");
                let ran = run(&file);
                let _ = std::fs::remove_file(&file);
                ran?;
            }
            "zram" => match zram("512M") {
                Ok(z) => run(&z.path)?,
                Err(why) => println!("SKIP: NIXL on zram: {why:#}"),
            },
            other => bail!("unknown bench target {other:?}: expected file or zram"),
        }
        println!("  report: {}", json.display());
    }
    Ok(())
}
