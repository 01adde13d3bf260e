//! How long a data-plane connection may keep a thread waiting: for its next
//! request, without limit while it holds registered buffers, at most
//! `--data-idle-timeout-ms` while it holds none; each request's frame must
//! then arrive whole within `--body-timeout-ms` (see `Conn::serve`).

use std::os::unix::net::UnixStream;

use super::Conn;
use crate::api::wire::ErrorBody;

impl Conn {
    /// Waits for the next request's first byte: for as long as it takes on
    /// a connection holding registered buffers (what a client keeps one
    /// open for), at most `--data-idle-timeout-ms` on one holding none.
    pub(super) fn wait_for_request(&self, stream: &UnixStream) -> Result<(), ErrorBody> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let idle = self.limits.data_idle_timeout;
        let timeout = if self.buffers.is_empty() {
            PollTimeout::try_from(idle).unwrap_or(PollTimeout::MAX)
        } else {
            PollTimeout::NONE
        };
        loop {
            let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) => {
                    return Err(ErrorBody::new(
                        pdstor_client::code::RefusalCode::Timeout,
                        "connection",
                        format!(
                            "no request within {} ms on a data connection holding no buffer (--data-idle-timeout-ms): closed; connect when there is a buffer to register",
                            idle.as_millis()
                        ),
                    ));
                }
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EINTR) => {}
                // The read that follows reports it.
                Err(_) => return Ok(()),
            }
        }
    }
}
