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
            ProbeCmd::Detach => {
                let n = pdstor_probes::detach_pinned(pin_dir)?;
                println!("removed {n} pins from {}", pin_dir.display());
                Ok(())
            }
        }
    }
}
