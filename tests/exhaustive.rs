//! Exhaustive checks of the fp16 and bf16 conversions against the `half` crate: every
//! one of the 2^32 f32 bit patterns must convert to the same bits.
//!
//! The test profile builds with optimisation (Cargo.toml), so plain `cargo test` runs
//! these in a few seconds per conversion on two cores; they are not ignored.

use gradpack::kernels::scalar;

/// Run `check(bits)` over all 2^32 patterns on every core, returning the first mismatch.
fn all_patterns(check: impl Fn(u32) -> bool + Sync) -> Option<u32> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let span = (1u64 << 32).div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let check = &check;
                s.spawn(move || {
                    let lo = t * span;
                    let hi = ((t + 1) * span).min(1 << 32);
                    (lo..hi).map(|b| b as u32).find(|&b| !check(b))
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().expect("worker panicked"))
            .min()
    })
}

#[test]
fn fp16_encode_matches_half_for_every_f32() {
    let bad = all_patterns(|b| {
        let x = f32::from_bits(b);
        scalar::f32_to_f16(x) == half::f16::from_f32(x).to_bits()
    });
    if let Some(b) = bad {
        let x = f32::from_bits(b);
        panic!(
            "f32 {b:#010x} ({x:e}): ours {:#06x}, half {:#06x}",
            scalar::f32_to_f16(x),
            half::f16::from_f32(x).to_bits()
        );
    }
}

#[test]
fn bf16_encode_matches_half_for_every_f32() {
    let bad = all_patterns(|b| {
        let x = f32::from_bits(b);
        scalar::f32_to_bf16(x) == half::bf16::from_f32(x).to_bits()
    });
    if let Some(b) = bad {
        let x = f32::from_bits(b);
        panic!(
            "f32 {b:#010x} ({x:e}): ours {:#06x}, half {:#06x}",
            scalar::f32_to_bf16(x),
            half::bf16::from_f32(x).to_bits()
        );
    }
}

#[test]
fn sixteen_bit_decodes_are_exact_for_every_code() {
    for h in 0..=u16::MAX {
        assert_eq!(
            scalar::f16_to_f32(h).to_bits(),
            half::f16::from_bits(h).to_f32().to_bits(),
            "f16 {h:#06x}"
        );
        // bf16 decode is the bits in the top half; half quiets signalling NaNs, we keep
        // the payload exactly (encoders only ever write quiet NaNs).
        let ours = scalar::bf16_to_f32(h);
        assert_eq!(ours.to_bits(), (h as u32) << 16);
        if !ours.is_nan() {
            assert_eq!(ours.to_bits(), half::bf16::from_bits(h).to_f32().to_bits());
        }
    }
}
