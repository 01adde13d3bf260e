//! The reference: CRC-32C a byte at a time through a 256-entry table, as
//! RFC 3720 (iSCSI) defines it. Every faster path is tested against this.

use super::gf2::POLY;

const TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            bit += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// The raw register after `data`, from `state`.
pub const fn raw(mut state: u32, data: &[u8]) -> u32 {
    let mut i = 0;
    while i < data.len() {
        state = TABLE[((state ^ data[i] as u32) & 0xff) as usize] ^ (state >> 8);
        i += 1;
    }
    state
}

/// `crc32c(prefix ‖ data)` from `crc32c(prefix)`.
pub const fn append(crc: u32, data: &[u8]) -> u32 {
    !raw(!crc, data)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3720_check_values() {
        // The catalogue's check value, and RFC 3720 B.4's test vectors.
        assert_eq!(super::append(0, b"123456789"), 0xe306_9283);
        assert_eq!(super::append(0, &[0u8; 32]), 0x8a91_36aa);
        assert_eq!(super::append(0, &[0xffu8; 32]), 0x62a8_ab43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(super::append(0, &ascending), 0x46dd_794e);
    }
}
