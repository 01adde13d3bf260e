//! `pdstor probe`: the eBPF provenance probes by hand.

use std::path::Path;

use clap::Subcommand;

use super::common::print_json;

#[derive(Subcommand)]
pub enum ProbeCmd {
    /// Load and attach the probes for a process (default: this one); with
    /// --pin they stay attached under /sys/fs/bpf/pdstor after this exits.
    /// Mounts tracefs (and bpffs for --pin) when absent; needs root.
    Attach {
        /// The process to trace (default: this one).
        #[arg(long)]
        tgid: Option<u32>,
        /// Pin maps and links under /sys/fs/bpf/pdstor so they outlive this command.
        #[arg(long)]
        pin: bool,
    },
    /// Which programs attach on this kernel, and which signals are unverifiable here and why.
    Status,
    /// The per-transfer signals of the pinned probe set, as JSON.
    Dump,
    /// Remove the pinned probe set.
    Detach,
    /// The probes under load: `--threads` submitters at `--depth` each write then read
    /// `--transfers` host_fixed chunks on TARGET (its bytes are overwritten), a CPU hog
    /// beside them; every transfer must be judged as at queue depth 1, with each request
    /// it issued completed once and exactly its own bytes. Prints the report as JSON;
    /// exits 1 if any transfer was not. Needs root.
    Load {
        /// A scratch block device or file (overwritten from --offset on).
        #[arg(long)]
        target: std::path::PathBuf,
        /// Where on TARGET the transfers start (a multiple of 4 KiB).
        #[arg(long, default_value = "0", value_parser = pdstor_daemon::units::parse_size)]
        offset: u64,
        /// Submitter threads, each with its own io_uring.
        #[arg(long, default_value_t = 8)]
        threads: u64,
        /// Writes in all (each read back as well), split evenly over the threads.
        #[arg(long, default_value_t = 1000)]
        transfers: u64,
        /// Requests each thread keeps in flight.
        #[arg(long, default_value_t = 64)]
        depth: u32,
        /// Bytes per transfer (a multiple of 4 KiB).
        #[arg(long, default_value = "128K", value_parser = pdstor_daemon::units::parse_size)]
        chunk: u64,
        /// No CPU hog beside the submitters.
        #[arg(long)]
        no_hog: bool,
    },
}

impl ProbeCmd {
    pub fn run(self) -> anyhow::Result<()> {
        let pin_dir = Path::new(pdstor_probes::PIN_DIR);
        match self {
            ProbeCmd::Attach { tgid, pin } => {
                let mut p = pdstor_probes::Probes::attach(tgid.unwrap_or_else(std::process::id))?;
                if pin {
                    p.pin(pin_dir)?;
                }
                print_json(&serde_json::json!({"pinned": pin.then_some(pin_dir), "programs": p.status()}))
            }
            ProbeCmd::Status => {
                let p = pdstor_probes::Probes::attach(std::process::id())?;
                let pinned = pin_dir.join("signals").exists();
                print_json(&serde_json::json!({"programs": p.status(), "pinned_set": pinned}))
            }
            ProbeCmd::Dump => {
                let all = pdstor_probes::read_pinned(pin_dir)?;
                let rows: Vec<_> = all.iter().map(|(t, s)| serde_json::json!({"transfer": t, "signals": s})).collect();
                print_json(&rows)
            }
            ProbeCmd::Load { target, offset, threads, transfers, depth, chunk, no_hog } => {
                anyhow::ensure!(threads > 0 && transfers >= threads, "--transfers must be at least --threads (>= 1)");
                let len = u32::try_from(chunk).map_err(|_| anyhow::anyhow!("--chunk {chunk} is over 4 GiB"))?;
                let p = pdstor_probes::Probes::attach(std::process::id())?;
                let opts = pdstor_proof::harness::probe_load::LoadOptions {
                    target,
                    offset,
                    threads,
                    per_thread: transfers / threads,
                    depth,
                    len,
                    hog: !no_hog,
                    first_id: 1,
                };
                let report = pdstor_proof::harness::probe_load::run(&p, &opts).map_err(anyhow::Error::msg)?;
                print_json(&report)?;
                anyhow::ensure!(report.clean(), "transfers misjudged under load (see the report above)");
                Ok(())
            }
            ProbeCmd::Detach => {
                let n = pdstor_probes::detach_pinned(pin_dir)?;
                println!("removed {n} pins from {}", pin_dir.display());
                Ok(())
            }
        }
    }
}
