//! The `dmabuf_fixed` path's kernel side: whether this kernel has the
//! io_uring rw-dmabuf series (probed once per engine), and installing a
//! DMA-BUF in the ring's buffer table through `IORING_RSRC_UPDATE_EXTENDED`
//! ([`crate::buffer::dmabuf::uapi`]).

use super::{BufferId, Engine, IoError, Registration, Ring, Slot, TargetKind, kernel_release};
use crate::buffer::{Buffer, dmabuf};

/// Whether the kernel has the rw-dmabuf io_uring UAPI, as probed at start-up.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", content = "detail", rename_all = "snake_case")]
pub enum DmabufRw {
    /// The kernel installs DMA-BUFs in the buffer table.
    Available,
    /// It does not; why (the probe's errno, the kernel release).
    Missing(String),
}

impl Engine {
    /// Asks the kernel to install DMA-BUF fd -1 through the extended update.
    /// A kernel without the series refuses the `flags` word (`EINVAL`) before
    /// looking further; one with it gets as far as the fd (`EBADF`). Nothing is
    /// installed either way.
    pub(super) fn probe_dmabuf_rw(&self) -> DmabufRw {
        use std::os::fd::AsRawFd;
        let Some(last) = self.slots.len().checked_sub(1) else {
            return DmabufRw::Missing("the engine has no buffer slots".into());
        };
        let desc = dmabuf::uapi::IoUringRegbufDesc {
            kind: dmabuf::uapi::IO_REGBUF_TYPE_DMABUF,
            dmabuf_fd: -1,
            target_fd: self.target.file().as_raw_fd(),
            ..Default::default()
        };
        match self.update_extended(last as u32, &desc) {
            Err(e) if e.raw_os_error() == Some(libc::EBADF) => DmabufRw::Available,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => DmabufRw::Missing(format!(
                "this kernel ({}) refuses IORING_RSRC_UPDATE_EXTENDED (EINVAL)",
                kernel_release()
            )),
            Err(e) => DmabufRw::Missing(format!("the capability probe failed unexpectedly: {e}")),
            Ok(()) => {
                // Clears the slot the probe touched.
                let _ = self.clear_entry(last as u32);
                DmabufRw::Missing("the kernel accepted an invalid DMA-BUF fd; not trusting it".into())
            }
        }
    }

    /// `IORING_REGISTER_BUFFERS_UPDATE` with one extended descriptor.
    fn update_extended(&self, index: u32, desc: &dmabuf::uapi::IoUringRegbufDesc) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let up = dmabuf::uapi::IoUringRsrcUpdate2 {
            offset: index,
            flags: dmabuf::uapi::IORING_RSRC_UPDATE_EXTENDED,
            data: desc as *const _ as u64,
            nr: 1,
            ..Default::default()
        };
        let ring_fd = match &self.ring {
            Ring::Std(r) => r.as_raw_fd(),
            Ring::Nvme(r) => r.as_raw_fd(),
        };
        // SAFETY: io_uring_register reads one 32-byte update and, through its
        // `data`, one 80-byte descriptor (sizes asserted in `uapi`); both live
        // on this stack frame for the whole call. A DMA-BUF descriptor makes
        // the kernel take its own reference to the DMA-BUF.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                ring_fd,
                dmabuf::uapi::IORING_REGISTER_BUFFERS_UPDATE,
                &up as *const dmabuf::uapi::IoUringRsrcUpdate2,
                size_of::<dmabuf::uapi::IoUringRsrcUpdate2>(),
            )
        };
        match ret {
            1 => Ok(()),
            r if r < 0 => Err(std::io::Error::last_os_error()),
            r => Err(std::io::Error::other(format!("the kernel updated {r} buffer slots, not 1"))),
        }
    }

    /// Holds a DMA-BUF buffer and installs the DMA-BUF itself in the buffer
    /// table, bound to the target, for the `dmabuf_fixed` path. Refused, with
    /// nothing installed, unless the kernel has the rw-dmabuf series and the
    /// target is a raw block device.
    pub fn register_dmabuf(&mut self, buffer: Buffer) -> Result<BufferId, IoError> {
        use std::os::fd::AsRawFd;
        let Some(dmabuf) = buffer.dmabuf() else {
            return Err(IoError::DmabufUnsupported {
                why: format!("the buffer is {} memory, not a DMA-BUF", buffer.kind()),
            });
        };
        if let DmabufRw::Missing(why) = &self.dmabuf_rw {
            return Err(IoError::DmabufUnsupported { why: why.clone() });
        }
        if self.target.kind() != TargetKind::BlockDevice {
            return Err(IoError::DmabufUnsupported {
                why: format!(
                    "the target is {:?}; DMA-BUF I/O goes to a raw block device opened O_DIRECT (e.g. /dev/nvme0n1)",
                    self.target.kind()
                ),
            });
        }
        if buffer.len() as u64 > dmabuf::uapi::IO_REGBUF_DMABUF_MAX {
            return Err(IoError::DmabufTooLarge { len: buffer.len(), max: dmabuf::uapi::IO_REGBUF_DMABUF_MAX });
        }
        let id = self.free_slot()?;
        let desc = dmabuf::uapi::IoUringRegbufDesc {
            kind: dmabuf::uapi::IO_REGBUF_TYPE_DMABUF,
            dmabuf_fd: dmabuf.fd().as_raw_fd(),
            target_fd: self.target.file().as_raw_fd(),
            ..Default::default()
        };
        self.update_extended(id.0, &desc).map_err(|source| IoError::Register {
            buffer: id,
            len: buffer.len(),
            source,
        })?;
        self.slots[id.0 as usize] = Some(Slot::held(buffer, Registration::DmaBuf));
        Ok(id)
    }
}
