//! What a publication is made of, as its writer declares it and its reader
//! must match it: the KV [`Layout`], and the [`Manifest`] a READY
//! publication offers (every chunk's place on the target and its crc32c).

use serde::{Deserialize, Serialize};

use pdstor_engine::io::TargetOffset;

/// The KV layout a reader must match exactly (DESIGN §1).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// The model's id (e.g. its name and revision).
    pub model_id: String,
    /// Element type of the KV tensors (`bf16`, …).
    pub dtype: String,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Tokens per stored chunk.
    pub chunk_tokens: u32,
    /// How the KV bytes of a chunk are arranged (the serving engine's name for it).
    pub kv_format: String,
}

/// A slot of the data area: the place of one chunk. Kept apart from chunk
/// indexes and publication numbers; serialized as the bare number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SlotIndex(pub u32);

impl std::fmt::Display for SlotIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One stored chunk of a publication.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkEntry {
    /// The chunk's index.
    pub index: u32,
    /// Its slot.
    #[cfg_attr(feature = "openapi", schema(value_type = u32))]
    pub slot: SlotIndex,
    /// Where on the target its bytes start.
    #[cfg_attr(feature = "openapi", schema(value_type = u64))]
    pub offset: TargetOffset,
    /// Its length in bytes.
    pub len: u64,
    /// crc32c of its bytes, as stored.
    pub crc32c: u32,
}

/// What a READY publication offers its reader.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The publication.
    pub publication: u64,
    /// Its request id.
    pub req_id: String,
    /// The KV layout.
    pub layout: Layout,
    /// Every chunk, in order.
    pub chunks: Vec<ChunkEntry>,
    /// The token the reader continues from, if the writer gave one.
    pub first_token: Option<u32>,
    /// The claim's restore nonce, only in the manifest `adopt` answers: the
    /// ack's digest binds it to the chunks loaded for that claim
    /// ([`crate::receipt::restore_digest`]). Never stored, and not
    /// part of the manifest digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_nonce: Option<String>,
}
