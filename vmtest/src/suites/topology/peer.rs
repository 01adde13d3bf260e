//! The two guests' conversation: a line-based TCP exchange on the private
//! network (receipts out, reports back), and JSON and client-error helpers.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::suites::Checked;
use pdstor_vmtest_spec::STORAGE_ADDR;

/// Listens on the storage address for the reader guest, sends it `send` (if
/// any), and returns the line it answers (then says `bye`).
pub(super) fn serve_once(port: u16, send: Option<&str>) -> Checked<String> {
    let mut peer = Peer::accept(port)?;
    if let Some(send) = send {
        peer.send(send)?;
    }
    let line = peer.recv()?;
    let _ = peer.send("bye");
    Ok(line)
}

/// The reader host's end of [`serve_once`]: connects to the owner on `port`
/// (retrying while it gets there) and returns the stream and the owner's line.
pub(super) fn from_owner(port: u16) -> Checked<(Peer, String)> {
    let mut peer = Peer::dial(port)?;
    let line = peer.recv()?;
    Ok((peer, line))
}

/// A line-by-line conversation between the owner (storage guest, which
/// listens) and the reader host (which dials), on the private network.
pub(super) struct Peer {
    stream: TcpStream,
    lines: BufReader<TcpStream>,
}

impl Peer {
    pub(super) fn accept(port: u16) -> Checked<Peer> {
        let listener = TcpListener::bind((STORAGE_ADDR, port)).map_err(|e| format!("listening on {port}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(240);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(format!("no reader host connected on port {port} within 240 s: {e}").into()),
            }
        };
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        Peer::over(stream)
    }

    pub(super) fn dial(port: u16) -> Checked<Peer> {
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            match TcpStream::connect((STORAGE_ADDR, port)) {
                Ok(s) => return Peer::over(s),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("the owner never answered on {port}: {e}").into());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(300)),
            }
        }
    }

    fn over(stream: TcpStream) -> Checked<Peer> {
        stream.set_read_timeout(Some(Duration::from_secs(240))).map_err(|e| e.to_string())?;
        let lines = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
        Ok(Peer { stream, lines })
    }

    pub(super) fn send(&mut self, line: &str) -> Checked {
        Ok(self.stream.write_all(format!("{line}\n").as_bytes()).map_err(|e| format!("sending {line:?}: {e}"))?)
    }

    pub(super) fn recv(&mut self) -> Checked<String> {
        let mut line = String::new();
        match self.lines.read_line(&mut line) {
            Ok(0) => Err("the peer closed the conversation".into()),
            Ok(_) => Ok(line.trim_end().to_owned()),
            Err(e) => Err(format!("waiting for the peer: {e}").into()),
        }
    }

    /// Sends the outcome of this side's work: `ok`, or `fail <why>`.
    pub(super) fn report(&mut self, r: &Checked) {
        let _ = self.send(&match r {
            Ok(()) => "ok".to_owned(),
            Err(e) => format!("fail {}", e.to_string().replace('\n', " ")),
        });
    }

    /// Waits for the peer's outcome.
    pub(super) fn outcome(&mut self) -> Checked {
        match self.recv()?.as_str() {
            "ok" => Ok(()),
            other => Err(format!("the peer reported {other:?}").into()),
        }
    }
}

pub(super) fn json<T: serde::Serialize>(v: &T) -> Checked<String> {
    Ok(serde_json::to_string(v).map_err(|e| e.to_string())?)
}

pub(super) fn parse<T: serde::de::DeserializeOwned>(what: &str, s: &str) -> Checked<T> {
    Ok(serde_json::from_str(s).map_err(|e| format!("{what} {s:?}: {e}"))?)
}

pub(super) fn api(what: &str) -> impl FnOnce(pdstor_client::ClientError) -> String + '_ {
    move |e| format!("{what}: {e}")
}
