//! `pdstor bench-crc`: CRC-32C implementations against a plain read.

use pdstor_daemon::units::parse_size;
use pdstor_proof::harness::bench::crc::{self, CrcBenchConfig};

use super::common::print_report;

#[derive(clap::Args)]
pub struct BenchCrcArgs {
    /// Buffer sizes, each measured on its own; k, M, G suffixes. The defaults live in the
    /// L2 cache, in the L3, and in DRAM.
    #[arg(long, value_delimiter = ',', default_value = "256k,8M,1G", value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Passes over each buffer per implementation; the median is reported.
    #[arg(long, default_value_t = 9)]
    passes: u32,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

impl BenchCrcArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let sizes = self
            .sizes
            .iter()
            .map(|&s| usize::try_from(s).map_err(|_| anyhow::anyhow!("--sizes: {s} bytes do not fit in memory here")))
            .collect::<anyhow::Result<Vec<usize>>>()?;
        let r = crc::run(&CrcBenchConfig { sizes, passes: self.passes });
        print_report(self.json, &r, |r| {
            println!("crc32c in use: {} ({}); crc-fast takes {}", r.chosen, r.chosen_by, r.crc_fast_path);
            for size in &r.sizes {
                println!("{} bytes, one core:", size.bytes);
                for c in &size.cases {
                    println!("  {:<18} {:>7.2} GiB/s  {:>5.2}x the plain read", c.name, c.gib_per_s, c.of_plain_read);
                }
                for c in &size.copies {
                    println!("  {:<18} {:>7.2} GiB/s  {:>5.2}x the copy's time", c.name, c.gib_per_s, c.of_plain_read);
                }
            }
        })
    }
}
