//! Byte sizes as people and fio write them: `4096`, `4k`, `4K`, `4KiB`, `8M`, `1G`.
//! Suffixes are binary (fio's default for `bs`/`size`).

/// Parses a size with an optional k, M, G or T suffix (powers of 1024): `256k`, `8M`, `1G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let n: u64 = digits.parse().map_err(|_| format!("{s:?} is not a size: expected digits, like 4096, 4k or 8M"))?;
    let shift = match suffix.to_ascii_lowercase().trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => {
            return Err(format!("{s:?} has unknown unit {suffix:?}: use k, M, G or T"));
        }
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?} overflows 64 bits"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_like_fio() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("8M"), Ok(8 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert!(parse_size("4x").unwrap_err().contains("unknown unit"));
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999T").unwrap_err().contains("overflows"));
    }
}
