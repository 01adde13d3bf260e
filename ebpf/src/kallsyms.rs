//! What the programs need to know of the running kernel that CO-RE does not
//! tell them. From `/proc/kallsyms` (which shows real addresses to root,
//! CAP_SYSLOG, and zeros to everyone else): the completion functions that
//! say which io_uring request a bio or a request was made for (see the
//! header of `bpf/provenance.bpf.c`), and which functions an fentry program
//! can hook. From the kernel's BTF ([`KernelBtf`]): the tracepoint
//! prototypes the tp_btf programs read, and the rw-dmabuf series' bio flag.

use std::collections::HashMap;

/// The symbols, with the file and function that define them.
pub const SYMBOLS: [(&str, &str); 5] = [
    ("iomap_dio_bio_end_io", "fs/iomap/direct-io.c: a file's direct I/O"),
    ("blkdev_bio_end_io", "block/fops.c: a block device's direct I/O in several bios"),
    ("blkdev_bio_end_io_async", "block/fops.c: a block device's direct I/O in one bio"),
    ("nvme_uring_cmd_end_io", "drivers/nvme/host/ioctl.c (nvme-core): an NVMe passthrough command"),
    ("bio_chain_endio", "block/bio.c: a bio split off another"),
];

/// The addresses found of [`SYMBOLS`]; a missing one is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Addresses(HashMap<&'static str, u64>);

impl Addresses {
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

/// Which of `names` the kernel (or a loaded module) defines as a function,
/// from kallsyms text: the functions an fentry program can be loaded for.
/// Unlike [`Addresses::parse`] this needs no address (a reader without
/// CAP_SYSLOG sees zeros) and keeps names defined twice.
pub fn functions_defined<'a>(text: &str, names: &[&'a str]) -> std::collections::HashSet<&'a str> {
    let mut found = std::collections::HashSet::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(_), Some(kind), Some(name)) = (fields.next(), fields.next(), fields.next()) else { continue };
        if matches!(kind, "t" | "T")
            && let Some(n) = names.iter().find(|n| **n == name)
        {
            found.insert(*n);
        }
    }
    found
}

/// What the programs need to know of the kernel's BTF beyond CO-RE's reach,
/// read in one pass over its types. No BTF: nothing is known, and the
/// classic tracepoints and no DMA-token flag are used.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelBtf {
    /// io_uring_submit_req takes (req) (6.0 on), and io_uring_complete one
    /// of the two prototypes the tp_btf programs read: (ctx, req, cqe) from
    /// 6.13, (ctx, req, user_data, res, cflags, extra1, extra2) before.
    pub io_uring_btf: bool,
    /// ... io_uring_complete the older of the two.
    pub complete_args: bool,
    /// mm_filemap_add_to_page_cache takes (folio) (5.16 on).
    pub filemap_btf: bool,
    /// The rw-dmabuf series' bio flag BIO_DMABUF_MAP as bit number + 1, 0
    /// where the kernel has none (the enum is anonymous: no CO-RE name).
    pub bio_flag_dmabuf_map: u32,
}

impl KernelBtf {
    pub fn read() -> KernelBtf {
        use libbpf_rs::btf::{Btf, BtfKind, BtfType, types};
        let Ok(btf) = Btf::from_vmlinux() else { return KernelBtf::default() };
        // A tracepoint's `btf_trace_<name>` typedef points at its prototype,
        // whose first argument is the `void *` every one has.
        let args = |name: &str| -> Option<usize> {
            let typedef = btf.type_by_name::<BtfType<'_>>(&format!("btf_trace_{name}"))?;
            let proto = typedef.next_type()?.next_type()?;
            types::FuncProto::try_from(proto).ok().map(|p| p.len().saturating_sub(1))
        };
        let flag = (1..btf.len() as u32)
            .filter_map(|id| btf.type_by_id::<BtfType<'_>>(id.into()))
            .filter(|t| t.kind() == BtfKind::Enum && t.name().is_none())
            .filter_map(|t| types::Enum::try_from(t).ok())
            .find_map(|e| (0..e.len()).filter_map(|i| e.get(i)).find(|m| m.name.is_some_and(|n| n == "BIO_DMABUF_MAP")))
            .and_then(|m| u32::try_from(m.value).ok())
            .filter(|bit| *bit < 16);
        let complete = args("io_uring_complete");
        KernelBtf {
            io_uring_btf: args("io_uring_submit_req") == Some(1) && matches!(complete, Some(3 | 7)),
            complete_args: complete == Some(7),
            filemap_btf: args("mm_filemap_add_to_page_cache") == Some(1),
            bio_flag_dmabuf_map: flag.map_or(0, |bit| bit + 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_found_without_addresses_and_data_is_not_a_function() {
        let text = "0000000000000000 T io_wq_submit_work\n\
                    0000000000000000 t nvme_dmabuf_token_map\t[nvme]\n\
                    0000000000000000 D swiotlb_tbl_map_single\n";
        let found = functions_defined(text, &["io_wq_submit_work", "nvme_dmabuf_token_map", "swiotlb_tbl_map_single"]);
        assert!(found.contains("io_wq_submit_work") && found.contains("nvme_dmabuf_token_map"), "{found:?}");
        assert!(!found.contains("swiotlb_tbl_map_single"), "{found:?}");
    }

    #[test]
    fn finds_functions_of_the_kernel_and_of_modules() {
        let text = "ffffffff817686b0 T iomap_dio_bio_end_io\n\
                    ffffffff81aeda00 t blkdev_bio_end_io_async\n\
                    ffffffff81aedaa0 t blkdev_bio_end_io\n\
                    ffffffffc0123450 t nvme_uring_cmd_end_io\t[nvme_core]\n\
                    ffffffff81af1010 t bio_chain_endio\n\
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
