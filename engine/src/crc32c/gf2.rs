//! Arithmetic on polynomials over GF(2) modulo CRC-32C's polynomial, in the
//! reflected frame CRC registers use: bit `i` of a `u32` is the coefficient
//! of `x^(31-i)`, so `1 << 31` is 1 and a right shift multiplies by `x`.
//! Everything here is `const`: the folding and shifting constants the fast
//! paths use are computed at compile time from this one definition.

/// CRC-32C's polynomial (Castagnoli, iSCSI), reflected.
pub const POLY: u32 = 0x82f6_3b78;

/// `a · b mod P`.
pub const fn mul(a: u32, mut b: u32) -> u32 {
    let mut product = 0;
    let mut bit = 1u32 << 31;
    while bit != 0 {
        if a & bit != 0 {
            product ^= b;
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
        bit >>= 1;
    }
    product
}

/// `x^n mod P`.
pub const fn xpow(mut n: u64) -> u32 {
    let mut result = 1u32 << 31;
    let mut square = 1u32 << 30;
    while n != 0 {
        if n & 1 != 0 {
            result = mul(result, square);
        }
        square = mul(square, square);
        n >>= 1;
    }
    result
}

/// The CRC register `state` (raw: no pre- or post-inversion) moved past `len`
/// zero bytes: `state · x^(8·len) mod P`. A finished CRC-32C moves the same
/// way, which is how two ranges' checksums combine:
/// `crc(a ‖ b) = shift(crc(a), |b|) ^ crc(b)`.
pub const fn shift(state: u32, len: u64) -> u32 {
    mul(xpow(8 * len), state)
}

/// `crc(a ‖ b)` from `crc(a)`, `crc(b)` and `|b|`, for finished CRC-32Cs.
pub const fn combine(crc_a: u32, crc_b: u32, len_b: u64) -> u32 {
    shift(crc_a, len_b) ^ crc_b
}

/// The pair of 64-bit carry-less multipliers that fold a 128-bit lane
/// `distance` bits forward (see `x86::fold`): for the lane's first 64
/// message bits (the low qword), `x^(distance+63) mod P`; for the next 64,
/// `x^(distance-1) mod P`; each in the top half of its qword, where a
/// reflected 32-bit polynomial sits in a reflected 64-bit frame. (The
/// product of two reflected qwords comes out multiplied by `x`: hence the
/// `-1` in both exponents.)
pub const fn fold_pair(distance: u64) -> (u64, u64) {
    (((xpow(distance + 63) as u64) << 32), ((xpow(distance - 1) as u64) << 32))
}

/// The 32-bit multiplier with which one carry-less multiply and one `crc32`
/// instruction move a register `len` bytes forward: `x^(8·len-33) mod P`
/// (the multiply adds `x`, the instruction `x^32`).
pub const fn shift_multiplier(len: u64) -> u32 {
    xpow(8 * len - 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_is_the_identity_and_x_shifts() {
        let one = 1u32 << 31;
        assert_eq!(mul(one, 0x1234_5678), 0x1234_5678);
        assert_eq!(mul(0x1234_5678, one), 0x1234_5678);
        assert_eq!(mul(1 << 30, one), 1 << 30);
        assert_eq!(xpow(0), one);
        assert_eq!(xpow(1), 1 << 30);
        assert_eq!(xpow(31), 1);
        // x^32 is the polynomial itself without its leading term.
        assert_eq!(xpow(32), POLY);
        assert_eq!(mul(xpow(40), xpow(1000)), xpow(1040));
    }
}
