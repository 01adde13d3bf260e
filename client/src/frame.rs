//! The data plane's framing: a little-endian u32 length, then that many bytes
//! of JSON, with descriptors (a buffer's memfd or DMA-BUF) riding on the
//! first bytes as `SCM_RIGHTS`. Both ends use these two functions.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

/// Largest frame accepted (a batch of thousands of chunks fits easily).
pub const MAX_FRAME: usize = 16 << 20;

/// Reads one frame, collecting any fds sent with it.
pub fn read_frame(stream: &mut UnixStream) -> std::io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    read_frame_by(stream, None)
}

/// Sets the read timeout to what is left until `deadline`; past it, a
/// `TimedOut` error.
fn time_left(stream: &UnixStream, deadline: Option<std::time::Instant>) -> std::io::Result<()> {
    let Some(d) = deadline else { return Ok(()) };
    let left = d.saturating_duration_since(std::time::Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the frame did not arrive whole in time"));
    }
    stream.set_read_timeout(Some(left))
}

/// [`read_frame`], all of whose bytes must arrive by `deadline` (a read
/// that times out is `WouldBlock` or `TimedOut`): a peer that trickles a
/// frame cannot hold the reader past it.
pub fn read_frame_by(
    stream: &mut UnixStream,
    deadline: Option<std::time::Instant>,
) -> std::io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut header = [0u8; 4];
    let mut got = 0;
    let mut fds = Vec::new();
    while got < 4 {
        time_left(stream, deadline)?;
        // Room for the most descriptors one message can carry (SCM_MAX_FD):
        // a smaller buffer truncates the control data, and the descriptors
        // the kernel did install would then never be seen, or closed.
        let mut space = nix::cmsg_space!([RawFd; 253]);
        let mut iov = [IoSliceMut::new(&mut header[got..])];
        let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(std::io::Error::from)?;
        if msg.bytes == 0 {
            return if got == 0 { Ok(None) } else { Err(std::io::ErrorKind::UnexpectedEof.into()) };
        }
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: SCM_RIGHTS hands us new descriptors that nothing else owns.
                fds.extend(raw.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        got += msg.bytes;
    }
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0u8; len];
    let mut read = 0;
    while read < len {
        time_left(stream, deadline)?;
        match stream.read(&mut body[read..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => read += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some((body, fds)))
}

/// Writes one frame, with `fds` attached when there are any.
pub fn write_frame(stream: &mut UnixStream, body: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    match fds {
        [] => stream.write_all(&frame),
        fds => {
            let cmsg = [ControlMessage::ScmRights(fds)];
            let sent = sendmsg::<()>(stream.as_raw_fd(), &[IoSlice::new(&frame)], &cmsg, MsgFlags::empty(), None)
                .map_err(std::io::Error::from)?;
            stream.write_all(&frame[sent..])
        }
    }
}
