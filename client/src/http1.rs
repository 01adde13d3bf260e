//! HTTP/1.1 to the daemon over its Unix control socket (the daemon's uid
//! checked by `SO_PEERCRED` before a byte is sent) or over mutual TLS (the
//! daemon's certificate checked against the CA the client was given): one
//! connection per request (`connection: close`). The control plane is small
//! JSON; this needs no pooling.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

/// An answer: the status and the body.
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

/// The largest answer read (the publications listing of a full target fits).
const MAX_ANSWER: u64 = 256 << 20;

/// Sends `method path` with an optional JSON body to the daemon at `socket`.
pub fn unix(socket: &Path, method: &str, path: &str, json: Option<&[u8]>) -> Result<Answer, String> {
    let s = UnixStream::connect(socket).map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
    super::trusted_daemon(&s, socket)?;
    request(s, method, path, json)
}

/// Sends the request over TLS to `host:port`, verifying the daemon as `host`.
pub fn tls(
    config: &Arc<rustls::ClientConfig>,
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    json: Option<&[u8]>,
) -> Result<Answer, String> {
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{host:?} is not a server name: {e}"))?;
    let conn = rustls::ClientConnection::new(config.clone(), name).map_err(|e| e.to_string())?;
    let tcp = std::net::TcpStream::connect((host, port)).map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    request(rustls::StreamOwned::new(conn, tcp), method, path, json)
}

/// Sends one request on `s` and reads the whole answer.
fn request(mut s: impl Read + Write, method: &str, path: &str, json: Option<&[u8]>) -> Result<Answer, String> {
    let body = json.unwrap_or_default();
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nhost: pdstor\r\nconnection: close\r\naccept: application/json\r\n");
    if json.is_some() {
        head.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).and_then(|()| s.write_all(body)).map_err(|e| format!("sending: {e}"))?;
    s.flush().map_err(|e| format!("sending: {e}"))?;
    let mut raw = Vec::new();
    match s.take(MAX_ANSWER).read_to_end(&mut raw) {
        Ok(_) => {}
        // A TLS peer that closes without close_notify after a whole answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(format!("receiving: {e}")),
    }
    parse(&raw)
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
}
