//! HTTP/1.1 to the daemon over its Unix control socket (the daemon's uid
//! checked by `SO_PEERCRED` once per connection, before a byte is sent) or
//! over mutual TLS (the daemon's certificate checked against the CA the
//! client was given). Unix connections are kept alive and reused
//! ([`UnixPool`]): a handoff makes several small requests per key, and a
//! connection per request cost an accept, a credential check and a task on
//! the daemon each time. TLS connections carry one request (`connection:
//! close`).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An answer: the status and the body.
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

/// The largest answer read (the publications listing of a full target fits).
const MAX_ANSWER: u64 = 256 << 20;

/// The most idle connections a pool keeps.
const MAX_IDLE: usize = 8;
/// An idle connection older than this is closed, not reused: well inside the
/// daemon's header timeout (`--header-timeout-ms`, 10 s by default), after
/// which it closes idle connections itself.
const MAX_IDLE_AGE: Duration = Duration::from_secs(4);
/// The longest answer header read.
const MAX_HEAD: usize = 64 << 10;

/// Keep-alive connections to one daemon's Unix control socket.
pub struct UnixPool {
    socket: PathBuf,
    idle: Mutex<Vec<(UnixStream, Instant)>>,
}

/// How an exchange on a connection ended, when it did not answer.
enum Failed {
    /// Nothing came back and the request may never have reached the daemon:
    /// a reused connection the daemon had closed (idle, or it restarted).
    Stale(String),
    /// Anything else.
    Other(String),
}

impl UnixPool {
    /// A pool for the daemon at `socket` (nothing is connected yet).
    pub fn new(socket: PathBuf) -> UnixPool {
        UnixPool { socket, idle: Mutex::new(Vec::new()) }
    }

    /// Sends `method path` with an optional JSON body: on an idle connection
    /// when there is one, else (or when that one turns out to have been
    /// closed by the daemon before it answered a byte) on a new connection.
    pub fn request(&self, method: &str, path: &str, json: Option<&[u8]>) -> Result<Answer, String> {
        if let Some(s) = self.take() {
            match exchange(&s, method, path, json) {
                Ok((answer, reusable)) => {
                    self.give_back(s, reusable);
                    return Ok(answer);
                }
                Err(Failed::Stale(_)) => {}
                Err(Failed::Other(e)) => return Err(e),
            }
        }
        let s =
            UnixStream::connect(&self.socket).map_err(|e| format!("connecting to {}: {e}", self.socket.display()))?;
        super::trusted_daemon(&s, &self.socket)?;
        match exchange(&s, method, path, json) {
            Ok((answer, reusable)) => {
                self.give_back(s, reusable);
                Ok(answer)
            }
            Err(Failed::Stale(e) | Failed::Other(e)) => Err(e),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(UnixStream, Instant)>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most recently used idle connection young enough to reuse.
    fn take(&self) -> Option<UnixStream> {
        let mut idle = self.lock();
        idle.retain(|(_, since)| since.elapsed() < MAX_IDLE_AGE);
        idle.pop().map(|(s, _)| s)
    }

    fn give_back(&self, s: UnixStream, reusable: bool) {
        let mut idle = self.lock();
        if reusable && idle.len() < MAX_IDLE {
            idle.push((s, Instant::now()));
        }
    }
}

/// One request and its whole answer on a kept-alive connection; answers
/// whether the connection may carry the next request.
fn exchange(mut s: &UnixStream, method: &str, path: &str, json: Option<&[u8]>) -> Result<(Answer, bool), Failed> {
    let body = json.unwrap_or_default();
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: pdstor\r\naccept: application/json\r\n");
    if json.is_some() {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let sent = send_all(s, head.as_bytes()).and_then(|()| send_all(s, body));
    if let Err(e) = sent {
        // The daemon closed it: the request did not go.
        return Err(Failed::Stale(format!("sending: {e}")));
    }
    let mut raw = Vec::with_capacity(4096);
    let mut buf = [0u8; 16 << 10];
    loop {
        if let Some(done) = complete(&raw)? {
            return Ok(done);
        }
        match s.read(&mut buf) {
            Ok(0) if raw.is_empty() => return Err(Failed::Stale("the daemon closed the connection".into())),
            Ok(0) => {
                // No length given: the answer ran to the close.
                let answer = parse(&raw).map_err(Failed::Other)?;
                return Ok((answer, false));
            }
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if raw.is_empty() && e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Err(Failed::Stale(format!("receiving: {e}")));
            }
            Err(e) => return Err(Failed::Other(format!("receiving: {e}"))),
        }
        if raw.len() as u64 > MAX_ANSWER {
            return Err(Failed::Other(format!("the answer is over {MAX_ANSWER} bytes")));
        }
    }
}

/// Writes all of `bytes` with `MSG_NOSIGNAL`: a connection the daemon closed
/// is an error to handle here, not a SIGPIPE that kills a process which did
/// not ignore it (the Python package runs in other people's processes).
fn send_all(s: &UnixStream, mut bytes: &[u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    while !bytes.is_empty() {
        match nix::sys::socket::send(s.as_raw_fd(), bytes, nix::sys::socket::MsgFlags::MSG_NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// The answer in `raw` once all of it has come (by its length, or its last
/// chunk), and whether the connection stays open after it.
fn complete(raw: &[u8]) -> Result<Option<(Answer, bool)>, Failed> {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        if raw.len() > MAX_HEAD {
            return Err(Failed::Other(format!("the answer's header is over {MAX_HEAD} bytes")));
        }
        return Ok(None);
    };
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| Failed::Other("the answer's header is not text".into()))?;
    let fields = head.split("\r\n").skip(1).filter_map(|l| l.split_once(':'));
    let (mut chunked, mut length, mut close) = (false, None, false);
    for (name, value) in fields {
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        match name.as_str() {
            "transfer-encoding" => chunked = value.eq_ignore_ascii_case("chunked"),
            "content-length" => length = value.parse::<usize>().ok(),
            "connection" => close = value.eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let rest = &raw[end + 4..];
    let whole = match (chunked, length) {
        (true, _) => chunks_end(rest).is_some(),
        (false, Some(n)) => rest.len() >= n,
        // Neither: the body runs to the close.
        (false, None) => false,
    };
    if !whole {
        return Ok(None);
    }
    let answer = parse(raw).map_err(Failed::Other)?;
    Ok(Some((answer, !close)))
}

/// Where a chunked body ends (after its last, empty chunk), if it has.
fn chunks_end(mut b: &[u8]) -> Option<()> {
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&b[..nl]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or_default().trim(), 16).ok()?;
        b = &b[nl + 2..];
        if size == 0 {
            return b.starts_with(b"\r\n").then_some(());
        }
        b = b.get(size + 2..)?;
    }
}

/// How a request over TLS failed.
pub enum TlsFailed {
    /// The daemon refused this client's certificate in the handshake, for
    /// this reason (the TLS alert it sent, in words): nothing was done.
    CertificateRefused(&'static str),
    /// Anything else.
    Other(String),
}

impl From<String> for TlsFailed {
    fn from(s: String) -> TlsFailed {
        TlsFailed::Other(s)
    }
}

/// Sends the request over TLS to `host:port`, verifying the daemon as `host`.
pub fn tls(
    config: &Arc<rustls::ClientConfig>,
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    json: Option<&[u8]>,
) -> Result<Answer, TlsFailed> {
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{host:?} is not a server name: {e}"))?;
    let conn = rustls::ClientConnection::new(config.clone(), name).map_err(|e| e.to_string())?;
    let tcp = std::net::TcpStream::connect((host, port)).map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    request(rustls::StreamOwned::new(conn, tcp), method, path, json)
}

/// Why the daemon refused this client's certificate, from the fatal TLS
/// alert `e` carries; `None` when `e` is no such refusal.
fn certificate_refused(e: &std::io::Error) -> Option<&'static str> {
    use rustls::AlertDescription as A;
    let Some(rustls::Error::AlertReceived(alert)) = e.get_ref()?.downcast_ref::<rustls::Error>() else { return None };
    Some(match alert {
        A::CertificateRevoked => "it is revoked: a CRL the daemon reads lists it",
        A::CertificateExpired => "it has expired, or is not valid yet",
        A::UnknownCA => {
            "the daemon's client CA did not sign it, or no CRL the daemon reads gives its revocation status"
        }
        A::BadCertificate | A::UnsupportedCertificate | A::CertificateUnknown => {
            "the daemon cannot use it (its encoding, extensions or key usage: a client certificate needs clientAuth)"
        }
        A::CertificateRequired | A::AccessDenied => "the daemon requires a certificate it accepts",
        _ => return None,
    })
}

/// Sends one request on `s` and reads the whole answer.
fn request(mut s: impl Read + Write, method: &str, path: &str, json: Option<&[u8]>) -> Result<Answer, TlsFailed> {
    let failed = |what: &str, e: std::io::Error| match certificate_refused(&e) {
        Some(why) => TlsFailed::CertificateRefused(why),
        None => TlsFailed::Other(format!("{what}: {e}")),
    };
    let body = json.unwrap_or_default();
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nhost: pdstor\r\nconnection: close\r\naccept: application/json\r\n");
    if json.is_some() {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    let sent = s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).and_then(|()| s.flush());
    if let Err(e) = sent {
        // The daemon may have refused the handshake and closed: its alert,
        // if it came, says why better than the write's error.
        let mut byte = [0u8; 1];
        return Err(match s.read(&mut byte).map_err(|r| certificate_refused(&r)) {
            Err(Some(why)) => TlsFailed::CertificateRefused(why),
            _ => failed("sending", e),
        });
    }
    let mut raw = Vec::new();
    match s.take(MAX_ANSWER).read_to_end(&mut raw) {
        Ok(_) => {}
        // A TLS peer that closes without close_notify after a whole answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(failed("receiving", e)),
    }
    Ok(parse(&raw)?)
}

/// Parses a whole `connection: close` response.
fn parse(raw: &[u8]) -> Result<Answer, String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("the daemon's answer has no complete header ({} bytes)", raw.len()))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "the answer's header is not text".to_owned())?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP status line: {status_line:?}"))?;
    let mut chunked = false;
    let mut length = None;
    for l in lines {
        let Some((name, value)) = l.split_once(':') else { continue };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name == "content-length" {
            length = value.parse::<usize>().ok();
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        match length {
            Some(n) if n > rest.len() => return Err(format!("the answer ended after {} of {n} bytes", rest.len())),
            Some(n) => rest[..n].to_vec(),
            None => rest.to_vec(),
        }
    };
    Ok(Answer { status, body })
}

/// Decodes a chunked body.
fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").ok_or("a chunk size line is cut off")?;
        let size_text = std::str::from_utf8(&b[..nl]).map_err(|_| "a chunk size is not text")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or_default().trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size + 2 {
            return Err("a chunk is cut off".into());
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_with_a_length_or_in_chunks() {
        let a = parse(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 2\r\n\r\n{}").expect("parses");
        assert_eq!((a.status, a.body.as_slice()), (403, &b"{}"[..]));
        let a = parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            .expect("parses");
        assert_eq!(a.body, b"abcde");
        assert!(parse(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nabc").is_err(), "a short body is an error");
        assert!(parse(b"garbage").is_err());
    }

    /// A kept-alive connection's answer is read to its end and no further:
    /// by its length or its last chunk; `connection: close` ends the reuse.
    #[test]
    fn an_answer_is_complete_by_its_length_or_its_last_chunk() {
        let done = |raw: &[u8]| match complete(raw) {
            Ok(Some((a, reusable))) => Some((a.status, a.body, reusable)),
            Ok(None) => None,
            Err(Failed::Stale(e) | Failed::Other(e)) => panic!("{e}"),
        };
        assert_eq!(done(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"), None, "the header is not over");
        assert_eq!(done(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{"), None, "one byte of two");
        assert_eq!(done(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"), Some((200, b"{}".to_vec(), true)));
        let closing = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(done(closing), Some((400, b"{}".to_vec(), false)));
        let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n";
        assert_eq!(done(chunked), None, "the last chunk's line is not over");
        let mut whole = chunked.to_vec();
        whole.extend_from_slice(b"\r\n");
        assert_eq!(done(&whole), Some((200, b"abc".to_vec(), true)));
        assert_eq!(done(b"HTTP/1.1 200 OK\r\n\r\nto the close"), None, "no length: read to the close");
    }
}
