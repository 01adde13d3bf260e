//! The data plane's connection: buffers shared once by fd, stores and
//! loads framed over the Unix socket.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use pdstor_engine::buffer::BufferKind;
use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use crate::frame::{read_frame, write_frame};
use crate::layout::Manifest;
use crate::receipt::Receipt;
use crate::wire::*;
use crate::{ClientError, LoadChecks, Verify, trusted_daemon};

/// A data-plane connection.
pub struct DataConn {
    stream: UnixStream,
    /// The socket, to connect again while nothing is registered.
    path: std::path::PathBuf,
    /// Whether a buffer was registered on this connection (the daemon closes
    /// one holding none after `--data-idle-timeout-ms` without a request).
    registered: bool,
}

impl DataConn {
    /// Connects to the daemon's data socket at `path`.
    ///
    /// The daemon must run as root, as this user, or as `PDSTOR_DAEMON_UID`
    /// (`SO_PEERCRED`): a buffer is never handed to whoever squats a socket path.
    pub fn connect(path: &Path) -> Result<DataConn, ClientError> {
        let stream = UnixStream::connect(path).map_err(|e| {
            ClientError::Data(format!("connecting to {}: {e} (is `pdstor serve` running?)", path.display()))
        })?;
        trusted_daemon(&stream, path).map_err(ClientError::Data)?;
        Ok(DataConn { stream, path: path.into(), registered: false })
    }

    /// The daemon's process id (`SO_PEERCRED`), e.g. to read its CPU time.
    pub fn daemon_pid(&self) -> std::io::Result<i32> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        getsockopt(&self.stream, PeerCredentials).map(|c| c.pid()).map_err(std::io::Error::from)
    }

    /// Whether the daemon hung up on this idle connection: with no request
    /// outstanding, anything to read (its last word, or the end) says so.
    fn hung_up(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let mut fds = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
        poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    pub(crate) fn call(&mut self, req: &DataRequest, fds: &[i32]) -> Result<DataResponse, ClientError> {
        // Nothing registered, nothing lost: a connection the daemon closed as
        // idle is replaced before the request goes out.
        if !self.registered && self.hung_up() {
            *self = DataConn::connect(&self.path)?;
        }
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Data(e.to_string()))?;
        if let Err(e) = write_frame(&mut self.stream, &body, fds) {
            // A daemon that hung up (over a limit, or this connection idle
            // too long) says why first: that answer, if it came, is the error.
            let _ = self.stream.set_read_timeout(Some(std::time::Duration::from_secs(1)));
            let said = read_frame(&mut self.stream).ok().flatten();
            let why = said.and_then(|(b, _)| serde_json::from_slice::<DataResponse>(&b).ok()).and_then(|r| r.error);
            let _ = self.stream.set_read_timeout(None);
            return Err(why.map_or_else(|| ClientError::Data(format!("sending: {e}")), ClientError::Api));
        }
        let (resp, _) = read_frame(&mut self.stream)
            .map_err(|e| ClientError::Data(format!("receiving: {e}")))?
            .ok_or_else(|| ClientError::Data("the daemon closed the data socket".into()))?;
        let resp: DataResponse = serde_json::from_slice(&resp).map_err(|e| ClientError::Data(e.to_string()))?;
        match resp.error {
            Some(e) => Err(ClientError::Api(e)),
            None => Ok(resp),
        }
    }

    /// Shares a buffer with the daemon for `host_fixed`; returns its id on
    /// this connection. One over 1 GiB (a whole LMCache pool, say) is
    /// registered in 1 GiB windows, each a table entry of the daemon's.
    pub fn register(&mut self, buffer: &Buffer) -> Result<u32, ClientError> {
        self.register_for(buffer, PayloadPath::HostFixed)
    }

    /// Shares a buffer with the daemon for `path`: a memfd buffer sends its
    /// memfd, a shm file buffer its file; a DMA-BUF sends the DMA-BUF and, for a udmabuf, the memfd behind
    /// it (so host paths can map it). The daemon refuses, holding nothing, if
    /// the path cannot take the buffer.
    pub fn register_for(&mut self, buffer: &Buffer, path: PayloadPath) -> Result<u32, ClientError> {
        self.register_checked(buffer, path, true)
    }

    /// [`DataConn::register_for`]; with `checked` false, the daemon does not
    /// checksum loads into it (it answers their chunks `unverified`): a
    /// staging buffer whose reader checks each chunk as it copies it out
    /// ([`Buffer::copy_out_checked`]: one pass over the bytes, not two), or
    /// a benchmark's [`Verify::None`]. Stores from it are checked as ever.
    pub fn register_checked(&mut self, buffer: &Buffer, path: PayloadPath, checked: bool) -> Result<u32, ClientError> {
        let (kind, fds) = match (buffer.dmabuf(), buffer.memfd_fd()) {
            (None, Some(m)) if buffer.kind() == BufferKind::ShmFile => (SharedKind::Shm, vec![m.as_raw_fd()]),
            (Some(d), backing) => {
                let mut fds = vec![d.fd().as_raw_fd()];
                fds.extend(backing.map(|m| m.as_raw_fd()));
                (SharedKind::Dmabuf, fds)
            }
            (None, Some(m)) => (SharedKind::Memfd, vec![m.as_raw_fd()]),
            (None, None) => {
                return Err(ClientError::Data(
                    "a private host buffer cannot be shared: use a memfd or a DMA-BUF buffer".into(),
                ));
            }
        };
        let r = self.call(
            &DataRequest::Register { len: buffer.len() as u64, kind, path: Some(path), unchecked: !checked },
            &fds,
        )?;
        let id = r.buffer.ok_or_else(|| ClientError::Data("register answered no buffer id".into()))?;
        self.registered = true;
        Ok(id)
    }

    /// One store batch from registered buffers, with the writer's token
    /// the publication's `prepare` answered.
    pub fn store(
        &mut self,
        publication: u64,
        writer_token: &str,
        chunks: Vec<DataChunk>,
        is_last_batch: bool,
        total_chunks: u32,
    ) -> Result<DataResponse, ClientError> {
        let writer_token = writer_token.into();
        self.call(&DataRequest::Store { publication, writer_token, chunks, is_last_batch, total_chunks }, &[])
    }

    /// Loads chunks of an adopted publication into registered buffers.
    pub fn load(&mut self, claim: &Receipt, chunks: Vec<DataChunk>) -> Result<DataResponse, ClientError> {
        self.call(&DataRequest::Load { receipt: claim.clone(), chunks, ack: false }, &[])
    }

    /// Loads the last chunks of an adopted claim and acknowledges it in the
    /// same request ([`DataConn::load_and_ack_many`] for one claim).
    pub fn load_and_ack(&mut self, claim: &Receipt, chunks: Vec<DataChunk>) -> Result<DataResponse, ClientError> {
        self.call(&DataRequest::Load { receipt: claim.clone(), chunks, ack: true }, &[])
    }

    /// Loads chunks of an adopted claim to their places and checks each
    /// one's crc32c against `manifest` ([`LoadChecks`]: as the daemon read it
    /// in place in the buffer, or computed here for what the daemon could not
    /// read and for every chunk with [`Verify::Local`]). A place's `len` is
    /// taken from the manifest. Returns each chunk's crc32c, in `places`
    /// order; any mismatch or unknown chunk is an error, never a partial
    /// result.
    pub fn load_verified(
        &mut self,
        claim: &Receipt,
        manifest: &Manifest,
        places: &[Place<'_>],
        verify: Verify,
    ) -> Result<Vec<(u32, u32)>, ClientError> {
        let mut wire = Vec::with_capacity(places.len());
        let mut lens = Vec::with_capacity(places.len());
        for p in places {
            let entry = manifest.chunks.get(p.index as usize).filter(|c| c.index == p.index).ok_or_else(|| {
                ClientError::Verify {
                    chunk: p.index,
                    what: format!("the manifest has {} chunks", manifest.chunks.len()),
                }
            })?;
            p.buffer.check_range(p.offset, entry.len as usize).map_err(|e| ClientError::Data(e.to_string()))?;
            wire.push(DataChunk { index: p.index, buffer: p.buffer_id, offset: p.offset, len: 0, crc32c: None });
            lens.push((entry.len, entry.crc32c));
        }
        let requested: Vec<u32> = wire.iter().map(|c| c.index).collect();
        let answer = self.load(claim, wire)?;
        let checks = LoadChecks::new(verify, &requested, &answer);
        places
            .iter()
            .zip(lens)
            .map(|(p, (len, want))| Ok((p.index, checks.check(p.index, p.buffer, p.offset, len, want)?)))
            .collect()
    }
}

/// One chunk's place in a registered buffer: where a store takes its bytes
/// from, or a load puts them.
pub struct Place<'a> {
    /// The chunk's index in its publication.
    pub index: u32,
    /// The buffer, as this process maps it (for range checks and checksums).
    pub buffer: &'a Buffer,
    /// The id the data connection registered it under.
    pub buffer_id: u32,
    /// Where in the buffer the chunk starts.
    pub offset: u64,
    /// Its length in bytes (a store's; a load takes the manifest's).
    pub len: u64,
}
