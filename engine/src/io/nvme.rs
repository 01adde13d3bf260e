//! NVMe I/O passthrough on the generic character device (`/dev/ngXnY`): command
//! encoding for `IORING_OP_URING_CMD` with `NVME_URING_CMD_IO`, Identify parsing,
//! and status decoding.
//!
//! The kernel does not split passthrough commands: a command larger than the
//! controller's MDTS fails. The engine splits at [`Geometry::max_transfer`](super::Geometry::max_transfer)
//! before it gets here, so every command built here must already fit.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::sys::NvmeCmd;

/// The `cmd_op` of an I/O passthrough `IORING_OP_URING_CMD`.
pub const URING_CMD_IO: u32 = super::sys::NVME_URING_CMD_IO;

/// NVMe I/O command set opcodes (NVM Command Set spec, figure "Opcodes for NVM Commands"): Flush.
pub const OPC_FLUSH: u8 = 0x00;
/// Write.
pub const OPC_WRITE: u8 = 0x01;
/// Read.
pub const OPC_READ: u8 = 0x02;
/// NLB is a 16-bit 0's based field: one command moves at most 65536 blocks.
pub const MAX_BLOCKS_PER_COMMAND: u64 = 1 << 16;
/// Admin opcode Identify.
pub const ADMIN_IDENTIFY: u8 = 0x06;
/// Identify CNS value: the namespace data structure.
pub const CNS_NAMESPACE: u32 = 0x00;
/// Identify CNS value: the controller data structure.
pub const CNS_CONTROLLER: u32 = 0x01;

/// Builds a Read or Write of `nlb` logical blocks at `slba` into the 80-byte
/// `cmd` area of an SQE128. `addr` is a user virtual address; for a fixed buffer
/// it must lie inside the registered buffer named by the SQE's `buf_index`.
pub fn rw_command(opcode: u8, nsid: u32, slba: u64, nlb: u32, addr: u64, data_len: u32) -> [u8; 80] {
    debug_assert!(opcode == OPC_READ || opcode == OPC_WRITE);
    debug_assert!((1..=1 << 16).contains(&nlb), "NLB is a 16-bit 0's based field");
    encode(&NvmeCmd {
        opcode,
        nsid,
        addr,
        data_len,
        cdw10: slba as u32,
        cdw11: (slba >> 32) as u32,
        // CDW12 bits 15:0: number of logical blocks, 0's based.
        cdw12: nlb - 1,
        ..NvmeCmd::default()
    })
}

/// `cmd` (a Write from [`rw_command`]) with Force Unit Access set (CDW12
/// bit 30): the controller completes it only once the data is on
/// non-volatile media.
pub fn with_fua(mut cmd: [u8; 80]) -> [u8; 80] {
    const CDW12: usize = 48;
    let mut cdw12 = u32::from_le_bytes([cmd[CDW12], cmd[CDW12 + 1], cmd[CDW12 + 2], cmd[CDW12 + 3]]);
    cdw12 |= 1 << 30;
    cmd[CDW12..CDW12 + 4].copy_from_slice(&cdw12.to_le_bytes());
    cmd
}

/// Builds a Flush of the whole namespace.
pub fn flush_command(nsid: u32) -> [u8; 80] {
    encode(&NvmeCmd { opcode: OPC_FLUSH, nsid, ..NvmeCmd::default() })
}

/// Little-endian encoding of `struct nvme_uring_cmd` into the SQE128 command area.
fn encode(cmd: &NvmeCmd) -> [u8; 80] {
    let mut out = [0u8; 80];
    out[0] = cmd.opcode;
    out[1] = cmd.flags;
    out[2..4].copy_from_slice(&cmd.rsvd1.to_le_bytes());
    let words32: [(usize, u32); 4] = [(4, cmd.nsid), (8, cmd.cdw2), (12, cmd.cdw3), (32, cmd.metadata_len)];
    for (at, v) in words32 {
        out[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    out[16..24].copy_from_slice(&cmd.metadata.to_le_bytes());
    out[24..32].copy_from_slice(&cmd.addr.to_le_bytes());
    out[36..40].copy_from_slice(&cmd.data_len.to_le_bytes());
    let tail = [cmd.cdw10, cmd.cdw11, cmd.cdw12, cmd.cdw13, cmd.cdw14, cmd.cdw15, cmd.timeout_ms, cmd.result_or_rsvd2];
    for (i, v) in tail.iter().enumerate() {
        out[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    out
}

/// Namespace facts from Identify Namespace (CNS 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceInfo {
    /// Namespace size in logical blocks (NSZE).
    pub blocks: u64,
    /// Logical block size in bytes of the formatted LBA format.
    pub lba_size: u32,
    /// Metadata bytes per block of the formatted LBA format (pdstor requires 0).
    pub metadata_size: u16,
}

/// Parses an Identify Namespace data structure (4096 bytes).
pub fn parse_identify_namespace(data: &[u8]) -> Result<NamespaceInfo, String> {
    if data.len() < 4096 {
        return Err(format!("Identify Namespace data is {} bytes, expected 4096", data.len()));
    }
    let blocks = u64::from_le_bytes(data[0..8].try_into().map_err(|_| "NSZE")?);
    let nlbaf = data[25] as usize + 1;
    let flbas = data[26];
    // FLBAS bits 3:0 are the low index; bits 6:5 the high bits when NLBAF > 16.
    let index = (flbas & 0x0f) as usize | (((flbas >> 5) & 0x03) as usize) << 4;
    if index >= nlbaf.max(1) || index >= 64 {
        return Err(format!("FLBAS selects LBA format {index} but NLBAF says {nlbaf} formats"));
    }
    let lbaf = &data[128 + 4 * index..132 + 4 * index];
    let metadata_size = u16::from_le_bytes([lbaf[0], lbaf[1]]);
    let lbads = lbaf[2];
    if !(9..=16).contains(&lbads) {
        return Err(format!("LBA format {index} has LBADS {lbads}; expected 9 (512 B) to 16 (64 KiB)"));
    }
    if blocks == 0 {
        return Err("namespace size (NSZE) is 0: the namespace is not usable".into());
    }
    Ok(NamespaceInfo { blocks, lba_size: 1 << lbads, metadata_size })
}

/// Maximum data transfer size from Identify Controller (CNS 1) byte 77, in bytes,
/// given the controller's minimum memory page size (CAP.MPSMIN, usually 4 KiB).
/// `None` means the controller reports no limit.
pub fn parse_mdts(identify_controller: &[u8], min_page_size: u32) -> Result<Option<u32>, String> {
    let mdts = *identify_controller.get(77).ok_or("Identify Controller data too short for MDTS (byte 77)")?;
    if mdts == 0 {
        return Ok(None);
    }
    (min_page_size as u64)
        .checked_shl(mdts as u32)
        .filter(|v| *v <= u32::MAX as u64)
        .map(|v| Some(v as u32))
        .ok_or_else(|| format!("MDTS {mdts} overflows"))
}

/// An NVMe completion status as the kernel hands it back in a passthrough CQE's
/// `res` (a positive value: the 15-bit Status Field without the phase bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    /// Status Code (SC).
    pub fn code(self) -> u8 {
        (self.0 & 0xff) as u8
    }
    /// Status Code Type (SCT).
    pub fn code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    /// Do Not Retry.
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }
    fn describe(self) -> &'static str {
        match (self.code_type(), self.code()) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x05) => "Commands Aborted due to Power Loss Notification",
            (0, 0x06) => "Internal Error",
            (0, 0x07) => "Command Abort Requested",
            (0, 0x0b) => "Invalid Namespace or Format",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (1, _) => "Command Specific Status",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            (2, 0x82) => "End-to-end Guard Check Error",
            (2, 0x85) => "Compare Failure",
            (2, 0x86) => "Access Denied",
            (2, 0x87) => "Deallocated or Unwritten Logical Block",
            (2, _) => "Media and Data Integrity Error",
            (3, _) => "Path Related Status",
            _ => "unknown status",
        }
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (SCT {:#x}, SC {:#04x}{})",
            self.describe(),
            self.code_type(),
            self.code(),
            if self.dnr() { ", do not retry" } else { "" }
        )
    }
}

/// Name of an I/O opcode, for errors.
pub fn opcode_name(opcode: u8) -> &'static str {
    match opcode {
        OPC_FLUSH => "Flush",
        OPC_WRITE => "Write",
        OPC_READ => "Read",
        _ => "command",
    }
}

/// Runs an admin command that reads `data.len()` bytes (Identify) on an NVMe fd.
pub fn admin_read(fd: BorrowedFd<'_>, mut cmd: NvmeCmd, data: &mut [u8]) -> io::Result<()> {
    cmd.addr = data.as_mut_ptr() as u64;
    cmd.data_len = u32::try_from(data.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "admin buffer over 4 GiB"))?;
    // SAFETY: `cmd` is a valid `struct nvme_admin_cmd`; `addr`/`data_len` describe
    // `data`, which is writable and outlives the synchronous ioctl.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), super::sys::NVME_IOCTL_ADMIN_CMD as _, &mut cmd) };
    match rc {
        0 => Ok(()),
        r if r < 0 => Err(io::Error::last_os_error()),
        status => Err(io::Error::other(format!(
            "NVMe admin opcode {:#04x} failed: {}",
            cmd.opcode,
            NvmeStatus(status as u16)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn read_command_encodes_slba_nlb_and_buffer() {
        let slba = 0x1_2345_6789u64;
        let c = rw_command(OPC_READ, 1, slba, 128, 0xdead_b000, 128 * 4096);
        assert_eq!(c[0], 0x02);
        assert_eq!(le32(&c, 4), 1, "nsid");
        assert_eq!(u64::from_le_bytes(c[24..32].try_into().unwrap()), 0xdead_b000);
        assert_eq!(le32(&c, 36), 128 * 4096, "data_len");
        assert_eq!(le32(&c, 40), 0x2345_6789, "cdw10 = SLBA low");
        assert_eq!(le32(&c, 44), 0x1, "cdw11 = SLBA high");
        assert_eq!(le32(&c, 48), 127, "cdw12 = NLB, 0's based");
        assert!(c[72..].iter().all(|b| *b == 0), "bytes past the 72-byte struct stay zero");
    }

    #[test]
    fn write_and_flush_opcodes() {
        assert_eq!(rw_command(OPC_WRITE, 3, 0, 1, 0, 512)[0], 0x01);
        let fua = with_fua(rw_command(OPC_WRITE, 3, 0, 8, 0, 8 * 512));
        assert_eq!(u32::from_le_bytes(fua[48..52].try_into().unwrap()), 7 | 1 << 30, "NLB kept, FUA (bit 30) set");
        let f = flush_command(3);
        assert_eq!(f[0], 0x00);
        assert_eq!(le32(&f, 4), 3);
        assert!(f[8..].iter().all(|b| *b == 0));
    }

    fn identify_ns(nsze: u64, flbas: u8, formats: &[(u16, u8)]) -> Vec<u8> {
        let mut d = vec![0u8; 4096];
        d[0..8].copy_from_slice(&nsze.to_le_bytes());
        d[25] = (formats.len() - 1) as u8;
        d[26] = flbas;
        for (i, (ms, lbads)) in formats.iter().enumerate() {
            d[128 + 4 * i..130 + 4 * i].copy_from_slice(&ms.to_le_bytes());
            d[130 + 4 * i] = *lbads;
        }
        d
    }

    #[test]
    fn identify_namespace_picks_the_formatted_lba_format() {
        let d = identify_ns(1 << 20, 1, &[(0, 9), (0, 12), (8, 12)]);
        let ns = parse_identify_namespace(&d).unwrap();
        assert_eq!(ns, NamespaceInfo { blocks: 1 << 20, lba_size: 4096, metadata_size: 0 });
        let d = identify_ns(10, 2, &[(0, 9), (0, 12), (8, 12)]);
        assert_eq!(parse_identify_namespace(&d).unwrap().metadata_size, 8);
    }

    #[test]
    fn identify_namespace_rejects_nonsense() {
        assert!(parse_identify_namespace(&[0u8; 100]).is_err());
        let d = identify_ns(10, 5, &[(0, 9)]);
        assert!(parse_identify_namespace(&d).unwrap_err().contains("FLBAS"));
        let d = identify_ns(10, 0, &[(0, 3)]);
        assert!(parse_identify_namespace(&d).unwrap_err().contains("LBADS"));
        let d = identify_ns(0, 0, &[(0, 9)]);
        assert!(parse_identify_namespace(&d).unwrap_err().contains("NSZE"));
    }

    #[test]
    fn mdts_is_a_power_of_two_of_the_min_page() {
        let mut d = vec![0u8; 4096];
        d[77] = 7;
        assert_eq!(parse_mdts(&d, 4096).unwrap(), Some(512 * 1024));
        d[77] = 0;
        assert_eq!(parse_mdts(&d, 4096).unwrap(), None);
        d[77] = 40;
        assert!(parse_mdts(&d, 4096).is_err());
    }

    #[test]
    fn status_decoding_names_the_error() {
        let s = NvmeStatus(0x0281);
        assert_eq!(s.code_type(), 2);
        assert_eq!(s.code(), 0x81);
        assert!(s.to_string().contains("Unrecovered Read Error"));
        let s = NvmeStatus(0x4080);
        assert!(s.dnr());
        assert!(s.to_string().contains("LBA Out of Range"));
        assert!(s.to_string().contains("do not retry"));
    }
}
