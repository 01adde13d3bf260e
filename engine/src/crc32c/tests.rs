//! Every implementation against the reference, on random contents, lengths
//! and alignments.

use proptest::prelude::*;

use super::*;

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
    let measured: Vec<Impl> = measure(4096, 1).into_iter().map(|(i, _)| i).collect();
    assert_eq!(measured, available());
    assert_eq!(checksum(b"123456789"), 0xe306_9283);
    for imp in Impl::ALL {
        assert_eq!(Impl::from_name(imp.name()), Some(imp));
    }
}
