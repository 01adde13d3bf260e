//! hyper's own answers in the JSON error shape. hyper answers a request it
//! cannot parse by itself, before any handler runs — 400 (a bad request line
//! or header, two Content-Lengths, an unusable Transfer-Encoding), 414 (a
//! request line too long), 431 (too many or too large headers) — with an
//! empty body, and closes. [`Shaped`] sits between hyper and the connection
//! and writes, in place of such an answer, the same status with the
//! `{status, code, field, message}` body every other refusal has.
//!
//! It recognises hyper's automatic answers by their form: a response head
//! with one of those statuses and `content-length: 0`, written alone (the
//! first write of an answer, which on a connection hyper is about to close
//! is the whole head). The daemon's own routes never answer a 4xx without a
//! JSON body, so nothing else has that form.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::wire::ErrorBody;
use pdstor_client::code::RefusalCode;

/// A connection whose writes pass through, except hyper's automatic error
/// answers, which are replaced (see the module's documentation).
pub struct Shaped<T> {
    io: T,
    /// A replacement answer not yet written out.
    pending: Vec<u8>,
    written: usize,
}

impl<T> Shaped<T> {
    /// Wraps `io`.
    pub fn new(io: T) -> Shaped<T> {
        Shaped { io, pending: Vec::new(), written: 0 }
    }
}

/// The JSON answer for hyper's automatic answer `head`, if it is one.
fn replacement(head: &[u8]) -> Option<Vec<u8>> {
    let (code, message) = match head.get(..13)? {
        b"HTTP/1.1 400 " => (
            RefusalCode::MalformedHttp,
            "the request could not be parsed as HTTP/1.1 (a malformed request line or header, two or an invalid \
             Content-Length, or a Transfer-Encoding other than chunked): nothing was done; the connection is closed",
        ),
        b"HTTP/1.1 414 " => (
            RefusalCode::UriTooLong,
            "the request line is longer than the daemon reads: nothing was done; the connection is closed",
        ),
        b"HTTP/1.1 431 " => (
            RefusalCode::HeadersTooLarge,
            "the request's headers are more (at most 100), or larger, than the daemon reads: nothing was done; the \
             connection is closed",
        ),
        _ => return None,
    };
    let text = std::str::from_utf8(head).ok()?;
    let empty = text.to_ascii_lowercase().contains("\r\ncontent-length: 0\r\n");
    if !empty || !text.ends_with("\r\n\r\n") {
        return None;
    }
    let status = &text[9..12];
    let reason = text.get(13..)?.split("\r\n").next()?;
    let body = serde_json::to_vec(&ErrorBody::new(code, "", message.to_owned())).ok()?;
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend(body);
    Some(out)
}

impl<T: AsyncWrite + Unpin> Shaped<T> {
    /// Writes out what is pending; ready when nothing is.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Shaped<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Shaped<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        ready!(self.drain(cx))?;
        if let Some(answer) = replacement(buf) {
            // hyper's head counts as written; the answer goes out in its place.
            self.pending = answer;
            if let Poll::Ready(Err(e)) = self.drain(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        // Never vectored (see `is_write_vectored`): one buffer at a time.
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &**b);
        self.poll_write(cx, first)
    }

    fn is_write_vectored(&self) -> bool {
        // hyper then flattens each answer into one buffer: a head is seen whole.
        false
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_empty_error_heads_are_replaced() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(replacement(head).expect("replaced")).expect("text");
        assert!(out.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"));
        let body: ErrorBody = serde_json::from_str(out.split_once("\r\n\r\n").expect("a body").1).expect("JSON");
        assert_eq!((body.status, body.code.as_str()), (431, "headers_too_large"));
        // The daemon's own refusals carry a body; other statuses pass.
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 57\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n").is_none());
    }
}
