//! The restore's check where the bytes landed: each chunk's CRC-32C taken
//! in the exporter's memory (a GPU's by the GPU kernel, in place), against
//! the CRC-32C the writer's side took of the same chunk before it was
//! stored (as the manifest holds it); then one byte flipped in that memory
//! must change its chunk's CRC (and is flipped back).

use std::time::Instant;

use anyhow::bail;

use super::Memory;

/// Checks every `chunk`-byte chunk of `memory` against `pattern`'s; what was
/// checked, where, and the check's GiB/s.
pub(super) fn where_landed(memory: &dyn Memory, pattern: &[u8], chunk: u64) -> anyhow::Result<(String, f64)> {
    let stored: Vec<u32> = pattern.chunks(chunk as usize).map(pdstor_engine::crc32c::checksum).collect();
    let mut place = "";
    let t = Instant::now();
    for (i, want) in stored.iter().enumerate() {
        let (got, at) = memory.crc32c(i as u64 * chunk, chunk as usize)?;
        place = at;
        if got != *want {
            bail!("chunk {i}: crc32c {got:#010x} where it landed ({at}), {want:#010x} as it was stored");
        }
    }
    let gib_s = pattern.len() as f64 / t.elapsed().as_secs_f64().max(1e-9) / f64::from(1u32 << 30);
    // A byte in the middle of the last chunk, flipped in the memory itself.
    let last = stored.len() - 1;
    let at = last as u64 * chunk + chunk / 2 + 3;
    memory.fill(at, &[pattern[at as usize] ^ 0x20])?;
    let (seen, _) = memory.crc32c(last as u64 * chunk, chunk as usize)?;
    memory.fill(at, &[pattern[at as usize]])?;
    if seen == stored[last] {
        bail!("a byte flipped at {at} of the restored memory left chunk {last}'s crc32c as stored ({place})");
    }
    let said = format!(
        "{} chunks' crc32c taken {place} match the stored ones; a byte flipped at {at} was caught ({seen:#010x} ≠ {:#010x})",
        stored.len(),
        stored[last]
    );
    Ok((said, gib_s))
}
