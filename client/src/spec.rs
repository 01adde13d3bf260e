//! Where a client's buffer memory comes from, and the path it moves on.

use pdstor_engine::{buffer::Buffer, io::PayloadPath};

use crate::ClientError;

/// Who provides a client's buffer memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Exporter {
    /// A memfd (shared memory).
    #[default]
    Memfd,
    /// A udmabuf made from a sealed memfd (`/dev/udmabuf`).
    Udmabuf,
    /// The system DMA heap (`/dev/dma_heap/system`).
    DmaHeap,
}

impl std::str::FromStr for Exporter {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "memfd" => Ok(Exporter::Memfd),
            "udmabuf" => Ok(Exporter::Udmabuf),
            "dma-heap" => Ok(Exporter::DmaHeap),
            _ => Err(format!("unknown buffer exporter {s:?}: expected memfd, udmabuf or dma-heap")),
        }
    }
}

impl std::fmt::Display for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Exporter::Memfd => "memfd",
            Exporter::Udmabuf => "udmabuf",
            Exporter::DmaHeap => "dma-heap",
        })
    }
}

/// A client buffer: whose memory, and the path the daemon moves it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferSpec {
    /// Whose memory.
    pub exporter: Exporter,
    /// The path the daemon moves it on.
    pub path: PayloadPath,
}

impl Default for BufferSpec {
    fn default() -> Self {
        BufferSpec { exporter: Exporter::Memfd, path: PayloadPath::HostFixed }
    }
}

impl BufferSpec {
    /// Allocates `len` bytes from the exporter.
    pub fn allocate(&self, name: &str, len: usize) -> Result<Buffer, ClientError> {
        let b = match self.exporter {
            Exporter::Memfd => Buffer::memfd(name, len),
            Exporter::Udmabuf => Buffer::udmabuf(name, len),
            Exporter::DmaHeap => Buffer::dma_heap("system", len),
        };
        b.map_err(|e| ClientError::Data(e.to_string()))
    }
}
