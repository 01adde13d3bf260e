//! Turning a request into SQEs: [`plan`] checks it against the target and the
//! buffer table (pure: a refusal changes nothing); the builders write the
//! entry for a standard or an NVMe passthrough ring.

use io_uring::{opcode, squeue, types};

use super::ring::{Planned, Segment};
use super::{Geometry, IoError, IoRequest, MAX_TRANSFER_ID, Op, PayloadPath, Registration, Slot, TARGET_FILE, Target};
use super::{nvme, sys};

/// Checks one request against the target and the buffer table and resolves it
/// to addresses. Pure: refusing changes nothing.
pub(super) fn plan(target: &Target, slots: &[Option<Slot>], r: &IoRequest) -> Result<Planned, IoError> {
    let t = r.transfer;
    if t.0 > MAX_TRANSFER_ID {
        return Err(IoError::TransferIdTooLarge { transfer: t });
    }
    if target.read_only() && r.op != Op::Read {
        return Err(IoError::ReadOnlyTarget { transfer: t, op: r.op, path: target.path().into() });
    }
    if r.op == Op::Flush {
        return Err(IoError::PathUnavailable {
            transfer: t,
            path: r.path,
            why: "a flush moves no payload",
            hint: "call Engine::flush instead",
        });
    }
    if r.len == 0 {
        return Err(IoError::EmptyRequest { transfer: t });
    }
    let slot = slots.get(r.buffer.0 as usize).and_then(Option::as_ref).ok_or(IoError::UnknownBuffer(r.buffer))?;
    let len = usize::try_from(r.len).map_err(|_| IoError::EmptyRequest { transfer: t })?;
    slot.buffer.check_range(r.buffer_offset.0, len).map_err(|what| IoError::Buffer { transfer: t, what })?;
    let mapped =
        || slot.buffer.addr().map(|a| a + r.buffer_offset.0).map_err(|what| IoError::Buffer { transfer: t, what });
    let index = r.buffer.0 as u16;
    let (buf_index, addr) = match (r.path, slot.registered) {
        (PayloadPath::Host, _) => (None, mapped()?),
        (PayloadPath::HostFixed, Registration::Host) => (slot.fixed_index(index, r.buffer_offset.0, r.len), mapped()?),
        (PayloadPath::HostFixed, _) => {
            return Err(IoError::PathUnavailable {
                transfer: t,
                path: r.path,
                why: "the buffer's memory is not registered with io_uring",
                hint: "register it with Engine::register, or declare path host",
            });
        }
        // The rw-dmabuf UAPI takes an offset into the DMA-BUF as the address.
        (PayloadPath::DmabufFixed, Registration::DmaBuf) => (Some(index), r.buffer_offset.0),
        (PayloadPath::DmabufFixed, _) => {
            return Err(IoError::PathUnavailable {
                transfer: t,
                path: r.path,
                why: "the buffer is not a DMA-BUF installed in the buffer table",
                hint: "register it with Engine::register_dmabuf, or declare the path it was registered for",
            });
        }
    };
    let g = target.geometry();
    let checks: [(&'static str, u64, u32); 3] = [
        ("buffer address", addr, g.mem_align),
        ("target offset", r.target_offset.0, g.offset_align),
        ("length", r.len, g.offset_align),
    ];
    for (field, value, align) in checks {
        if value % align as u64 != 0 {
            return Err(IoError::Unaligned { transfer: t, field, value, align });
        }
    }
    if r.target_offset.0.checked_add(r.len).is_none_or(|end| end > g.capacity) {
        return Err(IoError::BeyondTarget { transfer: t, offset: r.target_offset.0, len: r.len, capacity: g.capacity });
    }
    Ok(Planned { transfer: t, op: r.op, addr, buf_index, offset: r.target_offset.0, len: r.len })
}

/// `RWF_DSYNC` for a write that must be durable when it completes.
fn dsync(op: Op) -> i32 {
    if op == Op::WriteFua { libc::RWF_DSYNC } else { 0 }
}

pub(super) fn build_std(seg: &Segment, user_data: u64) -> squeue::Entry {
    let flags = if seg.nowait { libc::RWF_NOWAIT } else { 0 };
    let sqe = match (seg.op, seg.buf_index) {
        (Op::Read, Some(idx)) => opcode::ReadFixed::new(TARGET_FILE, seg.addr as *mut u8, seg.len, idx)
            .offset(seg.offset)
            .rw_flags(flags)
            .build(),
        (Op::Read, None) => {
            opcode::Read::new(TARGET_FILE, seg.addr as *mut u8, seg.len).offset(seg.offset).rw_flags(flags).build()
        }
        (Op::Write | Op::WriteFua, Some(idx)) => {
            opcode::WriteFixed::new(TARGET_FILE, seg.addr as *const u8, seg.len, idx)
                .offset(seg.offset)
                .rw_flags(flags | dsync(seg.op))
                .build()
        }
        (Op::Write | Op::WriteFua, None) => opcode::Write::new(TARGET_FILE, seg.addr as *const u8, seg.len)
            .offset(seg.offset)
            .rw_flags(flags | dsync(seg.op))
            .build(),
        (Op::Flush, _) => opcode::Fsync::new(TARGET_FILE).flags(types::FsyncFlags::DATASYNC).build(),
    };
    let sqe = if seg.punt { sqe.flags(squeue::Flags::ASYNC) } else { sqe };
    sqe.user_data(user_data)
}

pub(super) fn build_nvme(g: &Geometry, seg: &Segment, user_data: u64) -> squeue::Entry128 {
    let nsid = g.nsid.unwrap_or(1);
    let cmd = match seg.op {
        Op::Flush => nvme::flush_command(nsid),
        Op::Read | Op::Write | Op::WriteFua => {
            let opc = if seg.op == Op::Read { nvme::OPC_READ } else { nvme::OPC_WRITE };
            let lba = g.logical_block as u64;
            let cmd = nvme::rw_command(opc, nsid, seg.offset / lba, (seg.len as u64 / lba) as u32, seg.addr, seg.len);
            if seg.op == Op::WriteFua { nvme::with_fua(cmd) } else { cmd }
        }
    };
    let mut sqe = opcode::UringCmd80::new(TARGET_FILE, sys::NVME_URING_CMD_IO).cmd(cmd);
    if let Some(idx) = seg.buf_index {
        sqe = sqe.buf_index(Some(idx));
    }
    sqe.build().user_data(user_data)
}
