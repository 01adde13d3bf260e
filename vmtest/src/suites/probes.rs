//! `probes`: the slot the eBPF probes fill. Until they exist it proves that the
//! guest can run them: BTF is present (vmlinux and the nvme module), tracefs
//! names tracepoints, a BPF program attached to `block:block_rq_issue` really
//! counts the requests of a direct read, and bpffs pins it where `bpftool`
//! finds it.
//!
//! The raw `bpf(2)` and `perf_event_open(2)` ABI lives in [`sys`] below.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{Suite, Test, outcome};
use crate::guest::Ctx;
use crate::{DiskRole, Outcome};

pub const SUITE: Suite = Suite {
    name: "probes",
    about: "BTF, tracefs and bpffs work; a tracepoint BPF program counts block requests",
    tests: &[
        Test { name: "btf_present", disk: None, run: btf_present },
        Test { name: "tracepoint_program_counts_requests", disk: Some(DiskRole::Raw), run: tracepoint_counts },
    ],
};

fn btf_present(_: &Ctx) -> Outcome {
    outcome((|| {
        for f in ["/sys/kernel/btf/vmlinux", "/sys/kernel/btf/nvme", "/sys/kernel/btf/nvme_core"] {
            let len = std::fs::metadata(f).map_err(|e| format!("{f}: {e}"))?.len();
            if len == 0 {
                return Err(format!("{f} is empty"));
            }
        }
        Ok(())
    })())
}

fn tracepoint_counts(ctx: &Ctx) -> Outcome {
    outcome((|| {
        let raw = ctx.disk(DiskRole::Raw)?.block.clone();
        let id_file = "/sys/kernel/tracing/events/block/block_rq_issue/id";
        let tp_id: u64 = std::fs::read_to_string(id_file)
            .map_err(|e| format!("{id_file}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("{id_file}: {e}"))?;
        let map = sys::array_map_u64()?;
        let prog = sys::load_counter(&map)?;
        // A tracepoint's programs hang off the tracepoint itself, so one
        // attachment (through CPU 0's event) sees hits on every CPU; a second
        // attachment of the same program is refused with EEXIST.
        let events = sys::attach_tracepoint(&prog, tp_id, 0)?;
        let before = sys::read_counter(&map)?;
        super::io::dd_direct(&raw, 0, 1 << 20)?;
        let after = sys::read_counter(&map)?;
        drop(events);
        // 1 MiB in 64 KiB direct reads is at least 16 requests.
        if after < before + 16 {
            return Err(format!("block_rq_issue counted {} requests for a 1 MiB direct read", after - before));
        }
        let pin = "/sys/fs/bpf/pdstor-vmtest-counter";
        sys::pin(&prog, pin)?;
        // bpftool, not our own code, must see the pinned program as a tracepoint program.
        let shown = crate::guest::sh("bpftool", &["--json", "prog", "show", "pinned", pin]);
        let _ = std::fs::remove_file(pin);
        let shown: serde_json::Value =
            serde_json::from_str(&shown?).map_err(|e| format!("bpftool --json output: {e}"))?;
        if shown["type"] != "tracepoint" {
            return Err(format!("bpftool shows the pinned program as {}", shown["type"]));
        }
        Ok(())
    })())
}

mod sys {
    //! `bpf(2)` and `perf_event_open(2)`: a one-entry array map, a program that
    //! adds 1 to it, attachment to a tracepoint, and pinning. Attribute unions
    //! are built as zeroed byte arrays with fields at their UAPI offsets.

    use super::*;

    const BPF_MAP_CREATE: i64 = 0;
    const BPF_MAP_LOOKUP_ELEM: i64 = 1;
    const BPF_PROG_LOAD: i64 = 5;
    const BPF_OBJ_PIN: i64 = 6;
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    const BPF_PROG_TYPE_TRACEPOINT: u32 = 5;
    const PERF_TYPE_TRACEPOINT: u32 = 2;
    /// `_IOW('$', 8, __u32)` and `_IO('$', 0)` from `linux/perf_event.h`.
    const PERF_EVENT_IOC_SET_BPF: u64 = 0x4004_2408;
    const PERF_EVENT_IOC_ENABLE: u64 = 0x2400;
    const PERF_FLAG_FD_CLOEXEC: u64 = 1 << 3;

    /// `union bpf_attr` is larger than this; the kernel takes a prefix.
    type Attr = [u8; 128];

    fn put32(a: &mut [u8], at: usize, v: u32) {
        a[at..at + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put64(a: &mut [u8], at: usize, v: u64) {
        a[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }

    fn bpf(cmd: i64, attr: &mut Attr, what: &str) -> Result<i64, String> {
        // SAFETY: `attr` is a writable, zero-initialised prefix of `union
        // bpf_attr` whose pointer fields point at memory alive for the call.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
        if rc < 0 {
            return Err(format!("bpf({what}): {}", std::io::Error::last_os_error()));
        }
        Ok(rc)
    }

    fn fd(raw: i64) -> OwnedFd {
        // SAFETY: `raw` is a new descriptor the kernel just returned to us.
        unsafe { OwnedFd::from_raw_fd(raw as i32) }
    }

    pub fn array_map_u64() -> Result<OwnedFd, String> {
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, BPF_MAP_TYPE_ARRAY);
        put32(&mut a, 4, 4); // key_size
        put32(&mut a, 8, 8); // value_size
        put32(&mut a, 12, 1); // max_entries
        bpf(BPF_MAP_CREATE, &mut a, "MAP_CREATE").map(fd)
    }

    /// `struct bpf_insn`: opcode, dst:4 | src:4, off, imm.
    fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
        let mut i = [0u8; 8];
        i[0] = code;
        i[1] = (src << 4) | (dst & 0xf);
        i[2..4].copy_from_slice(&off.to_ne_bytes());
        i[4..8].copy_from_slice(&imm.to_ne_bytes());
        i
    }

    /// `counter[0] += 1` on every event.
    pub fn load_counter(map: &OwnedFd) -> Result<OwnedFd, String> {
        let prog: Vec<[u8; 8]> = vec![
            insn(0x18, 1, 1, 0, map.as_raw_fd()), // r1 = map (ld_imm64, BPF_PSEUDO_MAP_FD)
            insn(0, 0, 0, 0, 0),
            insn(0x62, 10, 0, -4, 0), // *(u32 *)(r10 - 4) = 0
            insn(0xbf, 2, 10, 0, 0),  // r2 = r10
            insn(0x07, 2, 0, 0, -4),  // r2 += -4
            insn(0x85, 0, 0, 0, 1),   // call bpf_map_lookup_elem
            insn(0x15, 0, 0, 2, 0),   // if r0 == 0 goto +2
            insn(0xb7, 1, 0, 0, 1),   // r1 = 1
            insn(0xdb, 0, 1, 0, 0),   // lock *(u64 *)(r0 + 0) += r1
            insn(0xb7, 0, 0, 0, 0),   // r0 = 0
            insn(0x95, 0, 0, 0, 0),   // exit
        ];
        let bytes: Vec<u8> = prog.concat();
        let license = c"GPL";
        let mut log = vec![0u8; 4096];
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, BPF_PROG_TYPE_TRACEPOINT);
        put32(&mut a, 4, prog.len() as u32);
        put64(&mut a, 8, bytes.as_ptr() as u64);
        put64(&mut a, 16, license.as_ptr() as u64);
        put32(&mut a, 24, 1); // log_level
        put32(&mut a, 28, log.len() as u32);
        put64(&mut a, 32, log.as_mut_ptr() as u64);
        bpf(BPF_PROG_LOAD, &mut a, "PROG_LOAD").map(fd).map_err(|e| {
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            format!("{e}; verifier: {}", String::from_utf8_lossy(&log[..end]))
        })
    }

    pub fn read_counter(map: &OwnedFd) -> Result<u64, String> {
        let key = 0u32;
        let mut value = 0u64;
        let mut a: Attr = [0; 128];
        put32(&mut a, 0, map.as_raw_fd() as u32);
        put64(&mut a, 8, &key as *const u32 as u64);
        put64(&mut a, 16, &mut value as *mut u64 as u64);
        bpf(BPF_MAP_LOOKUP_ELEM, &mut a, "MAP_LOOKUP_ELEM")?;
        Ok(value)
    }

    pub fn attach_tracepoint(prog: &OwnedFd, tp_id: u64, cpu: i32) -> Result<OwnedFd, String> {
        // struct perf_event_attr: type, size, config, sample_period; the rest 0.
        let mut a = [0u8; 128];
        put32(&mut a, 0, PERF_TYPE_TRACEPOINT);
        put32(&mut a, 4, 128);
        put64(&mut a, 8, tp_id);
        put64(&mut a, 16, 1);
        // SAFETY: `a` is a zero-extended `struct perf_event_attr` of the size
        // it declares; pid -1 with a cpu counts every task on that CPU.
        let rc = unsafe { libc::syscall(libc::SYS_perf_event_open, a.as_ptr(), -1, cpu, -1, PERF_FLAG_FD_CLOEXEC) };
        if rc < 0 {
            return Err(format!("perf_event_open(tracepoint {tp_id}, cpu {cpu}): {}", std::io::Error::last_os_error()));
        }
        let ev = fd(rc);
        // SAFETY: both ioctls take an int argument (the program fd, or none).
        let set = unsafe { libc::ioctl(ev.as_raw_fd(), PERF_EVENT_IOC_SET_BPF as _, prog.as_raw_fd()) };
        // SAFETY: as above.
        let on = unsafe { libc::ioctl(ev.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) };
        if set != 0 || on != 0 {
            return Err(format!("attaching the program to tracepoint {tp_id}: {}", std::io::Error::last_os_error()));
        }
        Ok(ev)
    }

    pub fn pin(prog: &OwnedFd, path: &str) -> Result<(), String> {
        let c = std::ffi::CString::new(path).map_err(|e| e.to_string())?;
        let mut a: Attr = [0; 128];
        put64(&mut a, 0, c.as_ptr() as u64);
        put32(&mut a, 8, prog.as_raw_fd() as u32);
        bpf(BPF_OBJ_PIN, &mut a, "OBJ_PIN").map(|_| ())
    }
}
