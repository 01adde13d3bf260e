//! The kernel addresses the block-attribution programs compare against: the
//! completion functions that say which io_uring request a bio or a request
//! was made for (see the header of `bpf/provenance.bpf.c`). Read from
//! `/proc/kallsyms`, which shows real addresses to root (CAP_SYSLOG) and
//! zeros to everyone else.

use std::collections::HashMap;

/// The symbols, with the file and function that define them.
pub const SYMBOLS: [(&str, &str); 4] = [
    ("iomap_dio_bio_end_io", "fs/iomap/direct-io.c: a file's direct I/O"),
    ("blkdev_bio_end_io", "block/fops.c: a block device's direct I/O in several bios"),
    ("blkdev_bio_end_io_async", "block/fops.c: a block device's direct I/O in one bio"),
    ("nvme_uring_cmd_end_io", "drivers/nvme/host/ioctl.c (nvme-core): an NVMe passthrough command"),
];

/// The addresses found of [`SYMBOLS`]; a missing one is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addresses(HashMap<&'static str, u64>);

impl Addresses {
    /// Reads them from `/proc/kallsyms`.
    pub fn read() -> Result<Addresses, String> {
        let text = std::fs::read_to_string("/proc/kallsyms").map_err(|e| format!("/proc/kallsyms: {e}"))?;
        Ok(Addresses::parse(&text))
    }

    /// Parses kallsyms text (`address type name [module]` per line). A name
    /// defined twice with different addresses (two static functions of one
    /// name) is ambiguous and left out; an address of 0 (kallsyms read
    /// without CAP_SYSLOG) is no address.
    pub fn parse(text: &str) -> Addresses {
        let mut found: HashMap<&'static str, Option<u64>> = HashMap::new();
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let (Some(addr), Some(kind), Some(name)) = (fields.next(), fields.next(), fields.next()) else {
                continue;
            };
            if !matches!(kind, "t" | "T") {
                continue;
            }
            let Some(&(sym, _)) = SYMBOLS.iter().find(|(s, _)| *s == name) else { continue };
            let Ok(addr) = u64::from_str_radix(addr, 16) else { continue };
            if addr == 0 {
                continue;
            }
            found
                .entry(sym)
                .and_modify(|a| {
                    if *a != Some(addr) {
                        *a = None
                    }
                })
                .or_insert(Some(addr));
        }
        Addresses(found.into_iter().filter_map(|(k, v)| v.map(|a| (k, a))).collect())
    }

    /// The address of one of [`SYMBOLS`], or 0.
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// Whether bios can be attributed by identity: the direct-I/O completion
    /// functions of files and of block devices are all known.
    pub fn bio_identity(&self) -> bool {
        SYMBOLS[..3].iter().all(|(s, _)| self.get(s) != 0)
    }

    /// The symbols not found, each with where it comes from.
    pub fn missing(&self) -> Vec<String> {
        SYMBOLS.iter().filter(|(s, _)| self.get(s) == 0).map(|(s, w)| format!("{s} ({w})")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_functions_of_the_kernel_and_of_modules() {
        let text = "ffffffff817686b0 T iomap_dio_bio_end_io\n\
                    ffffffff81aeda00 t blkdev_bio_end_io_async\n\
                    ffffffff81aedaa0 t blkdev_bio_end_io\n\
                    ffffffffc0123450 t nvme_uring_cmd_end_io\t[nvme_core]\n\
                    ffffffff81000000 d iomap_dio_bio_end_io_data\n";
        let a = Addresses::parse(text);
        assert_eq!(a.get("iomap_dio_bio_end_io"), 0xffffffff817686b0);
        assert_eq!(a.get("blkdev_bio_end_io"), 0xffffffff81aedaa0);
        assert_eq!(a.get("nvme_uring_cmd_end_io"), 0xffffffffc0123450);
        assert!(a.bio_identity());
        assert!(a.missing().is_empty());
    }

    #[test]
    fn hidden_ambiguous_or_absent_symbols_are_not_guessed() {
        // Read without CAP_SYSLOG: every address is zero.
        let hidden = "0000000000000000 T iomap_dio_bio_end_io\n0000000000000000 t blkdev_bio_end_io\n";
        assert_eq!(Addresses::parse(hidden), Addresses::default());
        // Two static functions of one name: neither is trusted.
        let twice = "ffffffff81aedaa0 t blkdev_bio_end_io\nffffffff81bbbbbb t blkdev_bio_end_io\n";
        assert_eq!(Addresses::parse(twice).get("blkdev_bio_end_io"), 0);
        // The same symbol listed twice at one address is fine; a data symbol is not a function.
        let a = Addresses::parse("ffffffff81aedaa0 t blkdev_bio_end_io\nffffffff81aedaa0 t blkdev_bio_end_io\n");
        assert_eq!(a.get("blkdev_bio_end_io"), 0xffffffff81aedaa0);
        assert!(!a.bio_identity());
        let missing = a.missing();
        assert!(missing.iter().any(|m| m.starts_with("iomap_dio_bio_end_io (fs/iomap")), "{missing:?}");
        assert_eq!(Addresses::parse("ffffffff81aedaa0 D blkdev_bio_end_io\n").get("blkdev_bio_end_io"), 0);
    }
}
