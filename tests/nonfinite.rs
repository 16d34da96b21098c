//! NaN and ±Inf policy, per codec: a non-finite input is never silent. Every frame built
//! from such an input has the NONFINITE header flag, and its decoding shows NaN or ±Inf
//! where the policy (README.md, codec docs) says.

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx};

fn cases() -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    for (pos, bad) in [
        (3, f32::NAN),
        (70, f32::INFINITY),
        (199, f32::NEG_INFINITY),
        (0, -f32::NAN),
    ] {
        let mut x = sample(200, 5);
        x[pos] = bad;
        v.push(x);
    }
    let mut x = sample(200, 6);
    x[10] = f32::INFINITY;
    x[11] = f32::NEG_INFINITY;
    x[150] = f32::from_bits(0x7F80_0001); // signalling NaN
    v.push(x);
    v
}

#[test]
fn nonfinite_input_sets_the_flag_and_shows_in_the_decoding() {
    for spec in specs() {
        for x in cases() {
            let frame = spec.encode(&x, &EncodeCtx::new(3)).unwrap();
            let h = gradpack::Header::parse(&frame).unwrap();
            assert!(h.nonfinite(), "{spec}: NONFINITE flag not set");
            let d = decode(&frame, x.len());
            assert!(d.iter().any(|v| !v.is_finite()), "{spec}: overflow hidden");
            let mut acc = vec![0.0f32; x.len()];
            gradpack::decode_add(&frame, &mut acc).unwrap();
            assert!(
                acc.iter().any(|v| !v.is_finite()),
                "{spec}: overflow hidden by decode_add"
            );
            check_policy(&spec, &x, &d);
        }
    }
}

#[test]
fn finite_input_never_sets_the_flag() {
    for spec in specs() {
        let x = sample(300, 1);
        let frame = spec.encode(&x, &EncodeCtx::new(1)).unwrap();
        assert!(
            !gradpack::Header::parse(&frame).unwrap().nonfinite(),
            "{spec}"
        );
    }
}

/// The exact per-codec policy.
fn check_policy(spec: &CodecSpec, x: &[f32], d: &[f32]) {
    let bad: Vec<usize> = (0..x.len()).filter(|&i| !x[i].is_finite()).collect();
    match spec {
        // Element-wise codecs: NaN stays NaN and ±Inf stays ±Inf, in place.
        CodecSpec::Identity(_)
        | CodecSpec::Lossless(_)
        | CodecSpec::Fp16(_)
        | CodecSpec::Bf16(_) => {
            for &i in &bad {
                if x[i].is_nan() {
                    assert!(d[i].is_nan(), "{spec} element {i}");
                } else {
                    assert_eq!(d[i], x[i], "{spec} element {i}");
                }
            }
        }
        // Block codecs: the whole block holding the value decodes to NaN; other blocks
        // are unaffected (finite).
        CodecSpec::Int8(_)
        | CodecSpec::Qsgd(_)
        | CodecSpec::Sign(_)
        | CodecSpec::Ternary(_)
        | CodecSpec::Natural(_) => {
            let b = block_of(spec);
            for (k, (xb, db)) in x.chunks(b).zip(d.chunks(b)).enumerate() {
                if xb.iter().any(|v| !v.is_finite()) {
                    assert!(
                        db.iter().all(|v| v.is_nan()),
                        "{spec} block {k} not all NaN"
                    );
                } else {
                    assert!(
                        db.iter().all(|v| v.is_finite()),
                        "{spec} block {k} not finite"
                    );
                }
            }
        }
        // Top-k: NaN and ±Inf rank above every finite value and are kept as themselves
        // (with int8 values, as NaN: a non-finite value makes its block's step NaN).
        CodecSpec::TopK(c) => {
            let k = c.k_for(x.len() as u64) as usize;
            let int8 = c.values() == gradpack::ValueType::Int8;
            for (j, &i) in bad.iter().enumerate() {
                if j < k {
                    assert!(
                        d[i].is_nan() && (x[i].is_nan() || int8) || d[i] == x[i],
                        "{spec} element {i}"
                    );
                }
            }
        }
        // fp8 without a scale: element-wise; NaN stays NaN, ±Inf stays ±Inf in E5M2 and
        // becomes NaN in E4M3 (which has no infinity); finite values stay finite.
        CodecSpec::Fp8(c) if c.scale() == gradpack::Fp8Scale::None => {
            let e5m2 = c.format() == gradpack::Fp8Format::E5m2;
            for i in 0..x.len() {
                if x[i].is_nan() || (x[i].is_infinite() && !e5m2) {
                    assert!(d[i].is_nan(), "{spec} element {i}");
                } else if x[i].is_infinite() {
                    assert_eq!(d[i], x[i], "{spec} element {i}");
                } else if e5m2 {
                    // Finite values past 61440 overflow to ±Inf, as IEEE rounding does.
                    assert!(!d[i].is_nan(), "{spec} element {i}");
                } else {
                    assert!(d[i].is_finite(), "{spec} element {i}");
                }
            }
        }
        // fp8 with a scale, fp4 and codebook: block codecs.
        CodecSpec::Fp8(_) | CodecSpec::Fp4(_) | CodecSpec::Codebook(_) => {
            let b = block_of(spec);
            for (k, (xb, db)) in x.chunks(b).zip(d.chunks(b)).enumerate() {
                if xb.iter().any(|v| !v.is_finite()) {
                    assert!(
                        db.iter().all(|v| v.is_nan()),
                        "{spec} block {k} not all NaN"
                    );
                } else {
                    let max = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    // E8M0 scales: decoding may overflow past half of f32's range.
                    let e8m0 = matches!(spec, CodecSpec::Fp8(c) if c.scale() == gradpack::Fp8Scale::E8m0)
                        || matches!(spec, CodecSpec::Fp4(c) if c.scale() == gradpack::Fp4Scale::E8m0);
                    assert!(
                        (e8m0 && 2.0 * max > f32::MAX) || db.iter().all(|v| v.is_finite()),
                        "{spec} block {k} not finite"
                    );
                }
            }
        }
        // Chunked top-k: NaN and ±Inf rank above every finite value, so they are kept, and
        // their chunk's scale is NaN: its kept elements decode to NaN, the rest to 0.
        CodecSpec::ChunkTopK(c) => {
            for (q, (xc, dc)) in x.chunks(c.chunk()).zip(d.chunks(c.chunk())).enumerate() {
                let bad_chunk = xc.iter().any(|v| !v.is_finite());
                for (j, (&v, &got)) in xc.iter().zip(dc).enumerate() {
                    if !v.is_finite() {
                        assert!(got.is_nan(), "{spec} chunk {q} element {j}");
                    } else if !bad_chunk {
                        assert!(got.is_finite(), "{spec} chunk {q} element {j}");
                    } else {
                        assert!(got.is_nan() || got == 0.0, "{spec} chunk {q} element {j}");
                    }
                }
            }
        }
        // Random-k: an unsent element could hide it, so everything decodes to NaN.
        CodecSpec::RandK(_) => assert!(d.iter().all(|v| v.is_nan()), "{spec}"),
        // DCT: a non-finite value spreads over its tile's coefficients, all of them kept
        // first, so the whole tile decodes to NaN or ±Inf (the whole frame with one sign
        // scale for the frame); other tiles are finite.
        CodecSpec::Dct(c) => {
            let frame = c.values() == gradpack::DctValues::SignFrame;
            for (first, h, w, len) in dct_tiles(c, x.len()) {
                let at = |i: usize, j: usize| first + i * len + j;
                let cells = || (0..h).flat_map(|i| (0..w).map(move |j| (i, j)));
                let bad_tile = cells().any(|(i, j)| !x[at(i, j)].is_finite());
                if bad_tile || frame {
                    assert!(
                        cells().all(|(i, j)| !d[at(i, j)].is_finite()),
                        "{spec} tile at {first} not all non-finite"
                    );
                } else {
                    // fp16 coefficients overflow past 65504 (at most sqrt(h w) times the
                    // tile's largest magnitude); the transforms' intermediate sums past
                    // f32's range from 2^117 (the documented bound: f32::MAX in a tile
                    // overflows Lee's transform).
                    let max = cells().map(|(i, j)| x[at(i, j)].abs()).fold(0f32, f32::max);
                    let fits = max < 2f32.powi(117)
                        && (c.values() != gradpack::DctValues::Fp16
                            || max * ((h * w) as f32).sqrt() < 65504.0);
                    assert!(
                        !fits || cells().all(|(i, j)| d[at(i, j)].is_finite()),
                        "{spec} tile at {first} not finite"
                    );
                }
            }
        }
        _ => unreachable!(),
    }
}

/// random-k with `scale=none` sends a kept value's bits as they are (f32 values), a
/// signalling NaN included (the spec says so; a multiply by 1 would quiet it).
#[test]
fn random_k_without_scaling_sends_bits_as_they_are() {
    use gradpack::{Codec, CodecSpec, EncodeCtx};
    let snan = f32::from_bits(0x7F80_0001);
    let x = vec![snan; 64];
    for spec in ["randk:ratio=1", "randk:ratio=1,select=strata"] {
        let spec: CodecSpec = spec.parse().unwrap();
        let frame = spec.encode(&x, &EncodeCtx::new(3)).unwrap();
        let payload = &frame[gradpack::HEADER_LEN..];
        assert_eq!(payload.len(), 4 * 64);
        for v in payload.chunks_exact(4) {
            assert_eq!(
                u32::from_le_bytes(v.try_into().unwrap()),
                0x7F80_0001,
                "{spec}"
            );
        }
    }
}

#[test]
fn dct_tiles_whose_transform_overflows_do_not_set_the_flag() {
    // Large finite values whose sums overflow: coefficients of ±Inf (and NaN, from Inf -
    // Inf) from a finite input. The encoder reads the flag from the coefficients of its
    // batched tiles and must then look at the input itself.
    for spec in [
        "dct:k=4",
        "dct:chunk=16,k=2,values=sign",
        "dct:chunk=8,k=4,width=16",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        for n in [64, 1008, 4096 + 16] {
            let x: Vec<f32> = (0..n)
                .map(|i| if i % 3 == 0 { -3.0e38 } else { 3.0e38 })
                .collect();
            let frame = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
            let d = decode(&frame, n);
            assert!(
                d.iter().any(|v| !v.is_finite()),
                "{spec} {n}: no overflow made"
            );
            assert!(
                !gradpack::Header::parse(&frame).unwrap().nonfinite(),
                "{spec} {n}: a finite input flagged"
            );
            // One NaN in the last full tile, then in the tail: flagged.
            for at in [n - n % 64 - 1, n - 1] {
                let mut y = x.clone();
                y[at] = f32::NAN;
                let frame = spec.encode(&y, &EncodeCtx::new(0)).unwrap();
                assert!(
                    gradpack::Header::parse(&frame).unwrap().nonfinite(),
                    "{spec} {n} {at}"
                );
            }
        }
    }
}
