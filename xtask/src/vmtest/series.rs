//! A guest kernel with a kernel patch series applied (issue 17): Debian's
//! `linux-source-7.2` from trixie-backports (a private apt config, so the
//! host's sources are untouched), the series applied patch by patch, a lean
//! config with everything the guest needs built in (a custom kernel's guest
//! gets no modules) and BTF for the probes, `make bzImage`.
//!
//! The series is third-party kernel code: it is read from the directory it
//! is given and never copied into this repository. The result is cached
//! under `~/.cache/pdstor/kernels/<key>/`, keyed by the source version, every
//! patch's bytes, the config fragments and this recipe, so a second run (or a
//! second clone on the same machine) reuses it.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use xshell::{Shell, cmd};

use super::kernel::Kernel;

/// The Debian source package the rebased series applies to.
pub const DEFAULT_SOURCE: &str = "7.2.12-1~bpo13+1";

/// Bump when the recipe below changes what it builds.
/// 2: `allnoconfig` and `series-base.config` instead of `x86_64_defconfig`
/// (745 options built in instead of 1382).
const RECIPE: u32 = 2;

/// Options set beyond the fragments (`kernel-config/`, forced to `=y`): what
/// the series and NVMe/TCP need, BTF for the probes, and large subsystems a
/// QEMU guest never uses kept off.
const EXTRA: &[&str] = &[
    "CONFIG_DMABUF_TOKEN=y",
    "CONFIG_NVME_FABRICS=y",
    "CONFIG_NVME_TARGET=y",
    "CONFIG_BLK_DEV_NVME=y",
    "CONFIG_DEBUG_INFO=y",
    "CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT=y",
    "CONFIG_DEBUG_INFO_REDUCED=n",
    "CONFIG_DEBUG_INFO_BTF=y",
    "CONFIG_SWIOTLB=y",
    "CONFIG_DRM=n",
    "CONFIG_SOUND=n",
    "CONFIG_WLAN=n",
    "CONFIG_WIRELESS=n",
    "CONFIG_USB_SUPPORT=n",
    "CONFIG_NETFILTER=n",
    "CONFIG_ETHERNET=n",
    "CONFIG_ATA=n",
    "CONFIG_NETWORK_FILESYSTEMS=n",
    "CONFIG_INPUT_JOYSTICK=n",
    "CONFIG_INPUT_TABLET=n",
    "CONFIG_INPUT_TOUCHSCREEN=n",
    "CONFIG_HID=n",
    "CONFIG_AGP=n",
    "CONFIG_FB=n",
    "CONFIG_WATCHDOG=n",
    "CONFIG_HAMRADIO=n",
    "CONFIG_BT=n",
    "CONFIG_CFG80211=n",
    "CONFIG_RFKILL=n",
    "CONFIG_MEDIA_SUPPORT=n",
];

/// What one build was, written beside its image.
#[derive(Debug, Serialize, Deserialize)]
pub struct Built {
    /// `linux-source-7.2` version.
    pub source: String,
    /// The series directory and its patches, in order.
    pub series: PathBuf,
    /// The patch files applied.
    pub patches: Vec<String>,
    /// `make kernelrelease`.
    pub release: String,
    /// Seconds `make bzImage` took.
    pub build_seconds: u64,
    /// The cache key.
    pub key: String,
}

/// The v3 UAPI as the engine encodes it (`engine/src/buffer/dmabuf.rs`,
/// `uapi`): the descriptor's fields in order, the DMA-BUF type's place in its
/// enum, and the update flag.
const DESC_FIELDS: &[&str] = &[
    "__u32 type",
    "__u32 flags",
    "__u64 size",
    "__u64 uaddr",
    "__s32 dmabuf_fd",
    "__s32 target_fd",
    "__u64 __resv[6]",
];
const REGBUF_TYPES: &[&str] = &["IO_REGBUF_TYPE_EMPTY", "IO_REGBUF_TYPE_UADDR", "IO_REGBUF_TYPE_DMABUF"];

/// Checks the `io_uring.h` a series build produced against the layout the
/// engine encodes; a mismatch names the field.
pub fn check_uapi(header: &str) -> Result<()> {
    let body = |open: &str| -> Result<Vec<String>> {
        let start = header
            .find(open)
            .with_context(|| format!("io_uring.h has no `{open}`: not the v3 UAPI the engine encodes"))?;
        let rest = &header[start + open.len()..];
        let end = rest.find("};").context("an unterminated definition")?;
        Ok(rest[..end]
            .lines()
            .map(|l| l.split("/*").next().unwrap_or_default().trim().trim_end_matches([';', ',']).trim().to_owned())
            .filter(|l| !l.is_empty())
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect())
    };
    let fields = body("struct io_uring_regbuf_desc {")?;
    if fields != DESC_FIELDS {
        bail!(
            "struct io_uring_regbuf_desc is {fields:?}; the engine encodes {DESC_FIELDS:?} (engine/src/buffer/dmabuf.rs uapi)"
        );
    }
    let types = body("enum io_uring_regbuf_type {")?;
    if !types.iter().map(String::as_str).take(REGBUF_TYPES.len()).eq(REGBUF_TYPES.iter().copied()) {
        bail!("enum io_uring_regbuf_type is {types:?}; the engine takes IO_REGBUF_TYPE_DMABUF = 2");
    }
    let flag = header
        .lines()
        .find(|l| l.trim_start().starts_with("IORING_RSRC_UPDATE_EXTENDED"))
        .context("io_uring.h has no IORING_RSRC_UPDATE_EXTENDED")?;
    if flag.split('=').nth(1).map(|v| v.trim().trim_end_matches(',')) != Some("1U << 1") {
        bail!("{}: the engine sets IORING_RSRC_UPDATE_EXTENDED = 1 << 1", flag.trim());
    }
    Ok(())
}

/// Where CI finds the series: `PDSTOR_KERNEL_SERIES`; else the rebased v3
/// series beside the checkout (`../shared/kernel-series/...`), which is then
/// also kept under `~/.cache/pdstor/kernel-series/` (outside any clone, like
/// the kernels) so another clone on this machine finds it; else that kept
/// copy. Why not, if none is there.
pub fn ci_series() -> Result<PathBuf, String> {
    const NAME: &str = "rw-dmabuf-v3/rebased-debian-7.2.12";
    if let Some(d) = std::env::var_os("PDSTOR_KERNEL_SERIES").filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(d);
        return match patches(&dir) {
            Ok(_) => Ok(dir),
            Err(e) => Err(format!("PDSTOR_KERNEL_SERIES: {e:#}")),
        };
    }
    let beside = crate::project_root().join("../shared/kernel-series").join(NAME);
    let kept = cache_root().map(|c| c.join("kernel-series").join(NAME));
    if let Ok(found) = patches(&beside) {
        if let Ok(kept) = &kept
            && std::fs::create_dir_all(kept).is_ok()
        {
            for p in &found {
                if let Some(name) = p.file_name() {
                    let _ = std::fs::copy(p, kept.join(name));
                }
            }
        }
        return Ok(beside);
    }
    match kept {
        Ok(kept) if patches(&kept).is_ok() => Ok(kept),
        _ => Err(format!(
            "no patch series at {} nor a kept copy under ~/.cache/pdstor/kernel-series/ (set PDSTOR_KERNEL_SERIES to the directory of the rw-dmabuf series rebased on linux-source-7.2)",
            beside.display()
        )),
    }
}

/// The patches of a series directory, in order (a cover letter is skipped).
pub fn patches(series: &Path) -> Result<Vec<PathBuf>> {
    let mut p: Vec<PathBuf> = std::fs::read_dir(series)
        .with_context(|| format!("reading the series directory {}", series.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "patch" || e == "diff"))
        .filter(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().contains("cover-letter")))
        .collect();
    p.sort();
    if p.is_empty() {
        bail!(
            "{} holds no *.patch files: give the directory of a patch series (git format-patch output)",
            series.display()
        );
    }
    Ok(p)
}

fn cache_root() -> Result<PathBuf> {
    let home = std::env::var_os("HOME").context("HOME is not set: cannot find ~/.cache/pdstor")?;
    Ok(PathBuf::from(home).join(".cache/pdstor"))
}

/// The base every series kernel is configured from, before the fragments.
fn base() -> PathBuf {
    super::fragment("series-base.config")
}

/// The fragments every series kernel is configured from.
fn fragments() -> Vec<PathBuf> {
    ["pd-storage.config", "vm.config", "dmabuf-rw.config"].iter().map(|f| super::fragment(f)).collect()
}

/// A stable key over everything that decides the image (FNV-1a, 64 bits, hex).
fn key(source: &str, patches: &[PathBuf]) -> Result<String> {
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for b in bytes {
                self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    (RECIPE, source, EXTRA).hash(&mut h);
    for f in patches.iter().chain(fragments().iter()).chain([base()].iter()) {
        std::fs::read(f).with_context(|| format!("reading {}", f.display()))?.hash(&mut h);
    }
    Ok(format!("{:016x}", h.finish()))
}

/// The options a guest of this kernel needs built in: the fragments, with
/// `=m` read as `=y` (no modules reach a custom kernel's guest), less what
/// only modules use.
pub fn builtin_requirements() -> Result<Vec<String>> {
    let mut out = Vec::new();
    for f in fragments() {
        let text = std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        for (opt, _) in text.lines().filter_map(|l| l.trim().split_once('=')) {
            if opt.starts_with("CONFIG_") && opt != "CONFIG_DEBUG_INFO_BTF_MODULES" && !out.iter().any(|o| o == opt) {
                out.push(opt.to_owned());
            }
        }
    }
    Ok(out)
}

/// The required options a `.config` does not set `=y`.
pub fn missing_builtin(config: &Path) -> Result<Vec<String>> {
    let have = std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    Ok(builtin_requirements()?.into_iter().filter(|o| !have.lines().any(|l| l == format!("{o}=y"))).collect())
}

/// Downloads `linux-source-7.2=<version>` into the cache (once).
fn source_deb(sh: &Shell, version: &str) -> Result<PathBuf> {
    let dir = cache_root()?.join("kernel-src");
    let deb = dir.join(format!("linux-source-7.2_{}_all.deb", version.replace(':', "%3a")));
    if deb.exists() {
        return Ok(deb);
    }
    let apt = cache_root()?.join("apt-trixie-backports");
    for d in ["state/lists/partial", "cache/archives/partial", "etc"] {
        sh.create_dir(apt.join(d))?;
    }
    sh.create_dir(&dir)?;
    let sources = apt.join("etc/sources.list");
    std::fs::write(
        &sources,
        "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie-backports main\n",
    )?;
    let status = apt.join("status");
    std::fs::write(&status, "")?;
    let opts = [
        format!("-oDir::Etc::SourceList={}", sources.display()),
        "-oDir::Etc::SourceParts=/dev/null".to_owned(),
        format!("-oDir::State={}", apt.join("state").display()),
        format!("-oDir::State::Status={}", status.display()),
        format!("-oDir::Cache={}", apt.join("cache").display()),
        "-oAPT::Sandbox::User=root".to_owned(),
    ];
    let o = &opts;
    cmd!(sh, "apt-get {o...} update -qq")
        .run()
        .context("apt-get update for trixie-backports (a private apt config)")?;
    let _cd = sh.push_dir(&dir);
    let pkg = format!("linux-source-7.2={version}");
    cmd!(sh, "apt-get {opts...} download -q {pkg}")
        .run()
        .with_context(|| format!("apt-get download {pkg} from trixie-backports"))?;
    if !deb.exists() {
        bail!("apt-get download {pkg} left no {}", deb.display());
    }
    Ok(deb)
}

/// Applies each patch with `patch -p1`; a failure names the patch and its files.
fn apply(sh: &Shell, src: &Path, patches: &[PathBuf]) -> Result<()> {
    let _cd = sh.push_dir(src);
    for p in patches {
        let out = std::process::Command::new("patch")
            .current_dir(src)
            .args(["-p1", "--batch", "--forward", "--fuzz=0", "-i"])
            .arg(p)
            .output()
            .context("running patch (install the `patch` package)")?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            let failed: Vec<&str> =
                text.lines().filter(|l| l.contains("FAILED") || l.contains("saving rejects")).collect();
            bail!(
                "patch {} does not apply to linux-source-7.2 (the series directory may be for another base):\n{}",
                p.display(),
                if failed.is_empty() { text.trim().to_owned() } else { failed.join("\n") }
            );
        }
    }
    Ok(())
}

/// Which patches touch `file` (for naming a build failure's origin).
fn patches_touching<'a>(patches: &'a [PathBuf], file: &str) -> Vec<&'a Path> {
    patches
        .iter()
        .filter(|p| {
            std::fs::read_to_string(p)
                .map(|t| t.lines().any(|l| l.strip_prefix("+++ b/").is_some_and(|f| f.trim() == file)))
                .unwrap_or(false)
        })
        .map(PathBuf::as_path)
        .collect()
}

/// The cached kernel for `series`, built first if it is not cached.
pub fn build(sh: &Shell, series: &Path, source: &str, jobs: usize) -> Result<Kernel> {
    let patches = patches(series)?;
    let key = key(source, &patches)?;
    let out = cache_root()?.join("kernels").join(&key);
    let image = out.join("bzImage");
    let manifest = out.join("build.json");
    if image.exists()
        && let Ok(text) = std::fs::read_to_string(&manifest)
        && let Ok(b) = serde_json::from_str::<Built>(&text)
    {
        check_uapi(&std::fs::read_to_string(out.join("io_uring.h")).context("the cached io_uring.h")?)?;
        println!("series kernel {} (cached, key {key}; built in {} s)", b.release, b.build_seconds);
        return Ok(Kernel {
            package: format!("linux-source-7.2 {} + {}", b.source, series.display()),
            release: b.release,
            vmlinuz: image,
            root: None,
            config: Some(out.join("config")),
        });
    }
    let deb = source_deb(sh, source)?;
    let work = cache_root()?.join("kernel-build").join(&key);
    let _ = std::fs::remove_dir_all(&work);
    sh.create_dir(&work)?;
    println!("unpacking linux-source-7.2 {source} into {}", work.display());
    let unpacked = work.join("deb");
    cmd!(sh, "dpkg-deb -x {deb} {unpacked}").run().context("unpacking the source package")?;
    let tarball = unpacked.join("usr/src/linux-source-7.2.tar.xz");
    cmd!(sh, "tar -xJf {tarball} -C {work}").run().context("unpacking the kernel source")?;
    std::fs::remove_dir_all(&unpacked).ok();
    let src = work.join("linux-source-7.2");
    println!("applying {} patches from {}", patches.len(), series.display());
    apply(sh, &src, &patches)?;
    configure(sh, &src)?;
    let release = {
        let _cd = sh.push_dir(&src);
        cmd!(sh, "make -s kernelrelease").quiet().read()?.trim().to_owned()
    };
    println!("building {release} (make -j{jobs} bzImage; 20–30 minutes on 2 cores)");
    let started = Instant::now();
    let log = work.join("build.log");
    let status = std::process::Command::new("make")
        .current_dir(&src)
        .arg(format!("-j{jobs}"))
        .arg("bzImage")
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::options().append(true).open(&log)?)
        .status()
        .context("running make")?;
    let build_seconds = started.elapsed().as_secs();
    if !status.success() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains(": error:")).take(10).collect();
        let mut blame = Vec::new();
        for e in &errors {
            let file = e.split(':').next().unwrap_or_default();
            for p in patches_touching(&patches, file) {
                blame.push(format!("{file}: touched by {}", p.display()));
            }
        }
        bail!(
            "make bzImage failed after {build_seconds} s (log: {}):\n{}\n{}",
            log.display(),
            errors.join("\n"),
            if blame.is_empty() { "(no error is in a file the series touches)".to_owned() } else { blame.join("\n") }
        );
    }
    sh.create_dir(&out)?;
    std::fs::copy(src.join("arch/x86/boot/bzImage"), &image)?;
    std::fs::copy(src.join(".config"), out.join("config"))?;
    // The header the build produced: the engine's encoding is checked against it.
    let header = src.join("include/uapi/linux/io_uring.h");
    check_uapi(&std::fs::read_to_string(&header).context("reading the built io_uring.h")?)?;
    std::fs::copy(&header, out.join("io_uring.h"))?;
    let built = Built {
        source: source.to_owned(),
        series: series.to_path_buf(),
        patches: patches.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect(),
        release: release.clone(),
        build_seconds,
        key: key.clone(),
    };
    std::fs::write(&manifest, serde_json::to_string_pretty(&built)?)?;
    println!("built {release} in {build_seconds} s; cached in {}", out.display());
    std::fs::remove_dir_all(&work).ok();
    Ok(Kernel {
        package: format!("linux-source-7.2 {source} + {}", series.display()),
        release,
        vmlinuz: image,
        root: None,
        config: Some(out.join("config")),
    })
}

/// `make allnoconfig` with [`base`], the fragments forced to `=y` and
/// [`EXTRA`] as its `KCONFIG_ALLCONFIG`: only what a guest uses is built.
/// Refuses a result that does not set every one of those options as asked
/// (a dependency missing from the base), naming them.
pub fn configure(sh: &Shell, src: &Path) -> Result<()> {
    let _cd = sh.push_dir(src);
    let base = base();
    let mut wanted: Vec<String> = std::fs::read_to_string(&base)
        .with_context(|| format!("reading {}", base.display()))?
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("CONFIG_"))
        .map(str::to_owned)
        .collect();
    wanted.extend(builtin_requirements()?.into_iter().map(|opt| format!("{opt}=y")));
    wanted.extend(EXTRA.iter().map(|e| (*e).to_owned()));
    let path = src.join("pdstor.config");
    std::fs::write(&path, wanted.iter().map(|w| format!("{w}\n")).collect::<String>())?;
    let allconfig = format!("KCONFIG_ALLCONFIG={}", path.display());
    cmd!(sh, "make -s {allconfig} allnoconfig").quiet().ignore_stderr().run().context("make allnoconfig")?;
    let config = src.join(".config");
    let have = std::fs::read_to_string(&config).with_context(|| format!("reading {}", config.display()))?;
    let unmet = unmet(&wanted, &have);
    if !unmet.is_empty() {
        bail!(
            "the configured kernel does not set {} as {} asks: an option it depends on is off (add it there)",
            unmet.join(", "),
            base.display()
        );
    }
    Ok(())
}

/// The wanted options (`CONFIG_X=y` or `=n`) a `.config` does not set so.
fn unmet(wanted: &[String], config: &str) -> Vec<String> {
    wanted
        .iter()
        .filter(|w| match w.strip_suffix("=n") {
            Some(opt) => config.lines().any(|l| l.strip_prefix(opt).is_some_and(|v| v.starts_with('=') && v != "=n")),
            None => !config.lines().any(|l| l == w.as_str()),
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const V3: &str = "enum io_uring_rsrc_update_flags {\n\tIORING_RSRC_UPDATE_EXTENDED\t\t= 1U << 1,\n};\n\
        enum io_uring_regbuf_type {\n\tIO_REGBUF_TYPE_EMPTY,\n\tIO_REGBUF_TYPE_UADDR,\n\tIO_REGBUF_TYPE_DMABUF,\n\n\t__IO_REGBUF_TYPE_MAX,\n};\n\
        struct io_uring_regbuf_desc {\n\t__u32 type; /* enum io_uring_regbuf_type */\n\t__u32 flags;\n\t__u64 size;\n\t__u64 uaddr;\n\n\
        \t__s32 dmabuf_fd;\n\t__s32 target_fd;\n\t__u64 __resv[6];\n};\n";

    #[test]
    fn the_v3_header_matches_and_a_moved_field_is_named() {
        check_uapi(V3).expect("the v3 UAPI");
        let swapped = V3.replace("__s32 dmabuf_fd;\n\t__s32 target_fd;", "__s32 target_fd;\n\t__s32 dmabuf_fd;");
        let e = check_uapi(&swapped).unwrap_err().to_string();
        assert!(e.contains("io_uring_regbuf_desc") && e.contains("target_fd"), "{e}");
        let e = check_uapi(&V3.replace("1U << 1", "1U << 2")).unwrap_err().to_string();
        assert!(e.contains("IORING_RSRC_UPDATE_EXTENDED"), "{e}");
        assert!(check_uapi("nothing here").is_err());
    }

    #[test]
    fn unmet_names_an_option_left_off_and_one_left_on() {
        let wanted: Vec<String> = ["CONFIG_A=y", "CONFIG_B=y", "CONFIG_C=n", "CONFIG_D=n"].map(String::from).to_vec();
        let config = "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=y\nCONFIG_DD=y\n";
        assert_eq!(unmet(&wanted, config), ["CONFIG_B=y", "CONFIG_C=n"]);
    }
}
