//! CI's vmtest matrix as data: each cell a kernel, the suites it runs and
//! what goes on the guest's command line.

use super::*;

/// Which kernel a guest of the matrix boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Debian's 6.12 (`cargo xtask kernel fetch`).
    Debian,
    /// Debian's linux-source-7.2 with the rw-dmabuf series (`cargo xtask kernel build`).
    Series,
}

/// One run of CI's vmtest matrix: a kernel, the suites (none: all but
/// `topology`), and what goes on the guest's command line. How many guests
/// boot is the suites' own: `topology` boots two on a private network.
pub struct Cell {
    pub kernel: Kernel,
    pub suites: &'static [&'static str],
    pub append: Option<&'static str>,
    /// Why this cell is in the matrix.
    pub why: &'static str,
}

/// CI's vmtest matrix, kernel by kernel.
pub const MATRIX: &[Cell] = &[
    Cell { kernel: Kernel::Debian, suites: &[], append: None, why: "every suite on every disk" },
    Cell {
        kernel: Kernel::Debian,
        suites: &["swiotlb"],
        append: Some("swiotlb=force"),
        why: "the probes catch every bounce through the software IOTLB",
    },
    Cell {
        kernel: Kernel::Debian,
        suites: &["topology"],
        append: None,
        why: "a storage guest and a reader guest over NVMe/TCP",
    },
    Cell { kernel: Kernel::Series, suites: &[], append: None, why: "every suite, rw-dmabuf native" },
    Cell {
        kernel: Kernel::Series,
        suites: &["swiotlb"],
        append: Some("swiotlb=force"),
        why: "the bounces, with the series",
    },
    Cell { kernel: Kernel::Series, suites: &["topology"], append: None, why: "its nvmet has persistent reservations" },
];

impl Cell {
    /// The `cargo xtask vmtest` line that runs this cell by hand.
    pub fn command(&self) -> String {
        let mut c = String::from("cargo xtask vmtest");
        if self.kernel == Kernel::Series {
            c.push_str(" --kernel-series …");
        }
        if !self.suites.is_empty() {
            c.push_str(&format!(" --suite {}", self.suites.join(",")));
        }
        if let Some(a) = self.append {
            c.push_str(&format!(" --append {a}"));
        }
        c
    }

    /// The run's arguments; `series` is the patch series a Series cell's
    /// kernel is built from.
    pub fn args(&self, series: Option<PathBuf>) -> VmtestArgs {
        VmtestArgs {
            suites: self.suites.iter().map(|s| (*s).to_owned()).collect(),
            fs: Vec::new(),
            kernel: None,
            kernel_series: if self.kernel == Kernel::Series { series } else { None },
            jobs: std::thread::available_parallelism().map_or(2, |n| n.get()),
            accel: std::env::var("PDSTOR_VM_ACCEL").unwrap_or_else(|_| "auto".into()),
            keep: false,
            timeout: 900,
            append: self.append.map(str::to_owned),
        }
    }
}

/// Runs every cell of the matrix on `kernel`, each a step of its own (so CI
/// says where the time went cell by cell).
pub fn run_matrix(sh: &Shell, kernel: Kernel, series: Option<PathBuf>) -> Result<()> {
    for cell in MATRIX.iter().filter(|c| c.kernel == kernel) {
        crate::step(&format!("{} ({})", cell.command(), cell.why));
        run(sh, &cell.args(series.clone()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Kernel, MATRIX};

    /// The series kernel runs the same matrix as Debian's (CI's help says so).
    #[test]
    fn the_series_kernel_runs_the_same_matrix() {
        let cells = |k: Kernel| -> Vec<(Vec<&str>, Option<&str>)> {
            MATRIX.iter().filter(|c| c.kernel == k).map(|c| (c.suites.to_vec(), c.append)).collect()
        };
        assert_eq!(cells(Kernel::Debian), cells(Kernel::Series));
        assert_eq!(MATRIX[1].command(), "cargo xtask vmtest --suite swiotlb --append swiotlb=force");
    }
}
