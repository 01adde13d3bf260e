//! Every implementation against the reference, on random contents, lengths
//! and alignments.

use proptest::prelude::*;

use super::*;

/// A checksumming copy into the slice it is given.
type Copy<'a> = dyn Fn(&mut [u8]) -> u32 + 'a;

fn every_available() -> Vec<(Impl, AppendFn)> {
    Impl::ALL.into_iter().filter_map(|i| i.function().map(|f| (i, f))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// A buffer of up to 20 KiB (past every path's round and block sizes),
    /// checked from a random offset, appended to a random prior CRC.
    #[test]
    fn every_implementation_is_the_reference(
        data in proptest::collection::vec(any::<u8>(), 0..20_000),
        skip in 0usize..64,
        prior in any::<u32>(),
    ) {
        let data = &data[skip.min(data.len())..];
        let want = table::append(prior, data);
        for (imp, f) in every_available() {
            prop_assert_eq!(f(prior, data), want, "{} on {} bytes", imp.name(), data.len());
        }
    }

    /// Split anywhere, appended piecewise or combined, it is the same CRC.
    #[test]
    fn appending_and_combining_agree(data in proptest::collection::vec(any::<u8>(), 0..4096), cut in any::<usize>()) {
        let cut = cut % (data.len() + 1);
        let (a, b) = data.split_at(cut);
        let whole = table::append(0, &data);
        prop_assert_eq!(checksum(&data), whole);
        prop_assert_eq!(append(checksum(a), b), whole);
        prop_assert_eq!(combine(checksum(a), checksum(b), b.len() as u64), whole);
    }
}

proptest! {
    // Each case copies up to 200 KiB and checks it with the (slow) reference.
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// A copy that checksums as it goes lands every byte and answers the
    /// source's CRC, whatever its length and alignment.
    #[test]
    fn a_checksumming_copy_copies_and_is_the_reference(
        data in proptest::collection::vec(any::<u8>(), 0..(3 * COPY_BLOCK + 100)),
        skip in 0usize..64,
        prior in any::<u32>(),
    ) {
        let src = &data[skip.min(data.len())..];
        let want = table::append(prior, src);
        // Whichever the CPU takes, and each on its own: the fused fold, the
        // blocked copy.
        let mut copies: Vec<(&str, Box<Copy<'_>>)> = vec![
            ("copy_append", Box::new(|d: &mut [u8]| copy_append(prior, d, src))),
            ("blocked", Box::new(|d: &mut [u8]| copy_blocked(Impl::Crc32cCrate.function().unwrap(), prior, d, src))),
        ];
        #[cfg(target_arch = "x86_64")]
        if Impl::Fold512.function().is_some() {
            // SAFETY: every feature fold_512_copying names is there (Fold512 is).
            copies.push(("fold_512_copying", Box::new(|d: &mut [u8]| !unsafe { x86::fold_512_copying(!prior, src, Some(d)) })));
        }
        for (name, copy) in copies {
            let mut dst = vec![0u8; src.len() + 7];
            let crc = copy(&mut dst[7..]);
            prop_assert_eq!(&dst[7..], src, "{}", name);
            prop_assert_eq!(crc, want, "{}", name);
        }
    }
}

#[test]
fn every_length_up_to_past_the_widest_round_and_a_large_buffer() {
    let data: Vec<u8> = (0..(3 << 20) + 17).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let paths = every_available();
    for len in 0..=1100 {
        let want = table::append(0, &data[..len]);
        for (imp, f) in &paths {
            assert_eq!(f(0, &data[..len]), want, "{} at {len} bytes", imp.name());
        }
    }
    let want = table::append(0, &data);
    for (imp, f) in &paths {
        assert_eq!(f(0, &data), want, "{} at {} bytes", imp.name(), data.len());
    }
}

#[test]
fn the_choice_is_one_this_cpu_runs_and_the_measurement_names_every_available() {
    let choice = chosen();
    assert!(available().contains(&choice.imp), "{choice:?}");
    let measured: Vec<Impl> = measure(4096, 1, &Impl::ALL).into_iter().map(|(i, _)| i).collect();
    assert_eq!(measured, available());
    assert_ne!(choice.imp, Impl::Table, "the reference is never chosen where anything else runs");
    assert_eq!(checksum(b"123456789"), 0xe306_9283);
    for imp in Impl::ALL {
        assert_eq!(Impl::from_name(imp.name()), Some(imp));
    }
}
