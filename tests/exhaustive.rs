//! Exhaustive checks of the fp16 and bf16 conversions against the `half` crate: every
//! one of the 2^32 f32 bit patterns must convert to the same bits.
//!
//! The test profile builds with optimisation (Cargo.toml), so plain `cargo test` runs
//! these in a few seconds per conversion on two cores; they are not ignored.
//!
//! Natively (x86-64) every pattern. Under emulation (CI runs aarch64 under qemu, where
//! the whole file took six minutes) the checks of the scalar oracle, which is the same
//! integer code on every architecture, take every 997th pattern, and the NEON kernels
//! every 5th chunk of 2^16 patterns: every exponent, both signs and all 16 low mantissa
//! bits, with a fifth of the top seven mantissa bits' values.

mod common;

use common::every_kernel_set;
use gradpack::unstable::kernels::{self, Backend, BackendKind, scalar};

/// The stride through the patterns of the oracle's checks: 1 natively, 997 under emulation.
const ORACLE_STRIDE: usize = if cfg!(target_arch = "x86_64") { 1 } else { 997 };

/// Run `check(bits)` over all 2^32 patterns (every [`ORACLE_STRIDE`]th) on every core,
/// returning the first mismatch.
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
                    (lo..hi)
                        .step_by(ORACLE_STRIDE)
                        .map(|b| b as u32)
                        .find(|&b| !check(b))
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

/// Run the kernels of every backend on all 2^32 patterns (in 64 Ki chunks) against the
/// scalar oracle; the oracle itself is checked against `half` above.
fn every_backend_encodes_like_the_oracle(
    name: &str,
    kernel: fn(&[f32], &mut [u8]) -> bool,
    oracle: fn(f32) -> u16,
) {
    for kind in BackendKind::ALL {
        let Some(b) = Backend::of(kind) else {
            println!(
                "SKIP {name} on backend {}: not supported on this CPU",
                kind.name()
            );
            continue;
        };
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
        let chunks = (1u64 << 32) / 65536;
        // The scalar backend applies the oracle to each element: every 61st chunk (a
        // spread of exponents, both signs, NaNs) checks its loop, layout and flag. Under
        // emulation (qemu for aarch64: minutes for all of them) the SIMD kernels take
        // every 5th chunk.
        let every = match kind {
            BackendKind::Scalar => 61,
            _ if cfg!(target_arch = "x86_64") => 1,
            _ => 5,
        };
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    let mut x = vec![0f32; 65536];
                    let mut out = vec![0u8; 2 * 65536];
                    for c in (t * every..chunks).step_by((threads * every) as usize) {
                        for (i, v) in x.iter_mut().enumerate() {
                            *v = f32::from_bits((c << 16) as u32 | i as u32);
                        }
                        let nonfinite = b.run(|| kernel(&x, &mut out));
                        let mut any = false;
                        for (i, v) in x.iter().enumerate() {
                            let got = u16::from_le_bytes([out[2 * i], out[2 * i + 1]]);
                            if got != oracle(*v) {
                                panic!(
                                    "{name} on {b}: f32 {:#010x}: {got:#06x}, oracle {:#06x}",
                                    v.to_bits(),
                                    oracle(*v)
                                );
                            }
                            any |= !v.is_finite();
                        }
                        assert_eq!(nonfinite, any, "{name} on {b}: nonfinite flag, chunk {c}");
                    }
                });
            }
        });
    }
}

#[test]
fn fp16_kernels_of_every_backend_match_the_oracle() {
    every_backend_encodes_like_the_oracle("fp16", kernels::encode_f16, scalar::f32_to_f16);
}

#[test]
fn bf16_kernels_of_every_backend_match_the_oracle() {
    every_backend_encodes_like_the_oracle("bf16", kernels::encode_bf16, scalar::f32_to_bf16);
}

#[test]
fn sixteen_bit_decode_kernels_of_every_backend_match_the_oracle() {
    let codes: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
    let want16: Vec<u32> = (0..=u16::MAX)
        .map(|h| scalar::f16_to_f32(h).to_bits())
        .collect();
    let wantb: Vec<u32> = (0..=u16::MAX)
        .map(|h| scalar::bf16_to_f32(h).to_bits())
        .collect();
    for b in every_kernel_set() {
        let mut out = vec![0f32; 65536];
        b.run(|| kernels::decode_f16::<{ kernels::mode::WRITE }>(&codes, &mut out));
        assert!(
            out.iter().map(|v| v.to_bits()).eq(want16.iter().copied()),
            "f16 decode on {b}"
        );
        b.run(|| kernels::decode_bf16::<{ kernels::mode::WRITE }>(&codes, &mut out));
        assert!(
            out.iter().map(|v| v.to_bits()).eq(wantb.iter().copied()),
            "bf16 decode on {b}"
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

/// The fp8 and fp4 conversions the SIMD backends run on scaled blocks (branch-free, for
/// quotients in `[-FMAX, FMAX]`) equal the definitions on every f32 of that range, for all
/// four formats and both roundings (a draw derived from each pattern). Natively every
/// pattern; under emulation (qemu for aarch64, where it would take many minutes) every
/// 997th, the NEON frames being compared with the scalar ones in tests/backends.rs.
#[test]
fn fp8_in_range_conversions_match_the_definition_for_every_f32_in_range() {
    use kernels::fp8::{
        E2M1, E3M0, E4M3, E5M2, encode_nearest, encode_stochastic, nearest_in_range,
        stochastic_in_range,
    };
    let stride: u32 = if cfg!(target_arch = "x86_64") { 1 } else { 997 };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    for f in [E4M3, E5M2, E2M1, E3M0] {
        let fmax = f.max().to_bits();
        let check = |a: u32| {
            [a, a | 0x8000_0000].into_iter().all(|b| {
                let y = f32::from_bits(b);
                let h = gradpack::rng::lowbias32(b ^ 0x5bd1_e995);
                nearest_in_range(f, y) == encode_nearest(f, y)
                    && stochastic_in_range(f, y, h) == encode_stochastic(f, y, h)
            })
        };
        let bad = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let check = &check;
                    s.spawn(move || {
                        (t * stride..=fmax)
                            .step_by((threads * stride) as usize)
                            .find(|&a| !check(a))
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().expect("worker panicked"))
                .min()
        });
        if let Some(a) = bad {
            panic!(
                "{f:?}: ±{:e} ({a:#010x}) converts differently",
                f32::from_bits(a)
            );
        }
    }
}

/// fp8's and fp4's nearest encodes on every SIMD backend (on x86, kernels of their own
/// for E4M3, E5M2, E2M1 and E3M0) equal the definition on every f32 of magnitude at most
/// FMAX, both signs: blocks (of 128, and of 32 for fp4's two codes per byte) led by FMAX get
/// the E8M0 scale 2^0, so every other element's quotient is the element itself. Under
/// emulation every 997th pattern.
#[test]
fn fp8_and_fp4_nearest_encodes_match_the_definition_on_every_backend_in_range() {
    use kernels::fp8::{E2M1, E3M0, E4M3, E5M2, Scale, encode_nearest, narrow4};
    const BLOCKS: usize = 4096;
    let stride: u32 = if cfg!(target_arch = "x86_64") { 1 } else { 997 };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    let backends: Vec<Backend> = every_kernel_set()
        .into_iter()
        .filter(|b| b.kind() != BackendKind::Scalar)
        .collect();
    for b in backends {
        for (f, four, block) in [
            (E4M3, false, 128),
            (E5M2, false, 128),
            (E2M1, true, 32),
            (E3M0, true, 32),
        ] {
            let fmax = f.max();
            let last = fmax.to_bits();
            // Thread t checks the patterns t, t + threads, ... (times the stride), in
            // batches of BLOCKS blocks; the first bad pattern found, if any.
            let bad = std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads)
                    .map(|t| {
                        s.spawn(move || {
                            let mut patterns = (t * stride..=last)
                                .step_by((threads * stride) as usize)
                                .peekable();
                            let mut x = vec![0f32; block * BLOCKS];
                            let mut want = vec![0u8; block * BLOCKS];
                            let mut scales = vec![0u8; BLOCKS];
                            let mut codes = vec![0u8; block * BLOCKS / (1 + four as usize)];
                            // Each pattern twice in a row: positive, then negative.
                            let (mut k, mut a) = (0u64, 0u32);
                            loop {
                                for (xb, wb) in x.chunks_mut(block).zip(want.chunks_mut(block)) {
                                    xb[0] = fmax;
                                    wb[0] = f.max_code;
                                    for (v, w) in xb[1..].iter_mut().zip(&mut wb[1..]) {
                                        let bits = if k % 2 == 0 {
                                            a = patterns.next().unwrap_or(0);
                                            a
                                        } else {
                                            a | 0x8000_0000
                                        };
                                        k += 1;
                                        *v = f32::from_bits(bits);
                                        *w = encode_nearest(f, *v);
                                    }
                                }
                                b.run(|| {
                                    kernels::encode_float(
                                        f,
                                        Scale::E8m0,
                                        four,
                                        block,
                                        &x,
                                        None,
                                        0,
                                        &mut scales,
                                        &mut codes,
                                    )
                                });
                                assert!(scales.iter().all(|&s| s == 127), "{f:?} on {b}: scale");
                                // The element pair of a byte (fp4) or the element.
                                let wanted = |i: usize| {
                                    if four {
                                        narrow4(want[2 * i]) | narrow4(want[2 * i + 1]) << 4
                                    } else {
                                        want[i]
                                    }
                                };
                                if let Some(i) = (0..codes.len()).find(|&i| codes[i] != wanted(i)) {
                                    return Some(x[if four { 2 * i } else { i }].to_bits());
                                }
                                // Every pattern checked: none encodes differently.
                                patterns.peek()?;
                            }
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .filter_map(|h| h.join().expect("worker panicked"))
                    .min()
            });
            if let Some(bits) = bad {
                panic!(
                    "{f:?} on {b}: {:e} ({bits:#010x}) encodes differently",
                    f32::from_bits(bits)
                );
            }
        }
    }
}

/// fp8's decode of unscaled frames on every backend (on x86, kernels through half
/// precision with the NaN codes fixed up) equals the definition on every code of both
/// formats, in every mode, at lengths around the kernels' step of 16 and a long one; the
/// added and residual modes onto values that include ±Inf and zeros of both signs (and
/// NaN, for the residual mode).
#[test]
fn unscaled_fp8_decodes_match_the_definition_on_every_code_and_backend() {
    use kernels::fp8::{self, E4M3, E5M2, Scale};
    use kernels::mode::{ADD, RESIDUAL, WRITE};
    fn check<const M: u8>(b: Backend, f: fp8::Format, n: usize) {
        let codes: Vec<u8> = (0..n).map(|i| (i * 7 + n) as u8).collect();
        let start: Vec<f32> = (0..n)
            .map(|i| match i % 9 {
                // The sum of two NaNs has either one's sign and payload (IEEE 754 leaves
                // it open): NaN only as a residual mode's starting value.
                0 if M == RESIDUAL => f32::NAN,
                1 => f32::INFINITY,
                2 => -0.0,
                3 => f32::NEG_INFINITY,
                k => (k as f32 - 6.5) * 3.0e3,
            })
            .collect();
        let mut want = start.clone();
        fp8::decode::<M>(f, Scale::None, false, 1, &[], &codes, &mut want);
        let mut got = start;
        b.run(|| kernels::decode_float::<M>(f, Scale::None, false, 1, &[], &codes, &mut got));
        for i in 0..n {
            assert_eq!(
                got[i].to_bits(),
                want[i].to_bits(),
                "{} {f:?} mode {M} length {n} element {i} code {:#x}",
                b.name(),
                codes[i]
            );
        }
    }
    for kind in BackendKind::ALL {
        if Backend::of(kind).is_none() {
            println!("SKIP {}: this CPU lacks it", kind.name());
        }
    }
    for b in every_kernel_set() {
        for f in [E4M3, E5M2] {
            for n in (0..=49).chain([255, 256, 257, 4099]) {
                check::<WRITE>(b, f, n);
                check::<ADD>(b, f, n);
                check::<RESIDUAL>(b, f, n);
            }
        }
    }
}
