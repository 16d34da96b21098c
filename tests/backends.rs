//! Every backend this CPU has gives byte-identical frames and bit-identical decodings to
//! the scalar oracle: on the boundary lengths, at every start alignment from 0 to 63
//! bytes, on special values and on property-generated inputs, with output buffers
//! pre-filled with a sentinel. A backend the CPU lacks is reported as skipped.

mod common;

use common::*;
use gradpack::rng::{Draws, STREAM_ROUNDING};
use gradpack::unstable::kernels::{Backend, BackendKind};
use gradpack::{Codec, CodecSpec, EncodeCtx};
use proptest::prelude::*;

/// The non-scalar backends, printing the ones this CPU lacks.
fn simd_backends() -> Vec<Backend> {
    let mut v = Vec::new();
    for kind in BackendKind::ALL {
        if kind == BackendKind::Scalar {
            continue;
        }
        match Backend::of(kind) {
            Some(b) => v.push(b),
            None => println!("SKIP backend {}: not supported on this CPU", kind.name()),
        }
    }
    // The AVX-512 backend with its routing off as well: every AVX-512 kernel.
    for b in every_kernel_set() {
        if !v.contains(&b) && b.kind() != BackendKind::Scalar {
            v.push(b);
        }
    }
    v
}

const SENTINEL: u8 = 0xA5;

/// Encode under backend `b` into a buffer offset by `align` bytes and pre-filled with a
/// sentinel; check nothing outside the buffer given is written, nor past the frame inside
/// it (top-k and chunked top-k excepted: they keep candidates there; and the entropy
/// stage, which keeps its codes there); return the frame.
fn encode_with(b: Backend, spec: &CodecSpec, x: &[f32], ctx: &EncodeCtx, align: usize) -> Vec<u8> {
    let max = spec.max_encoded_len(x.len());
    let mut buf = vec![SENTINEL; align + max + 64];
    let len = b
        .run(|| spec.encode_into(x, ctx, &mut buf[align..align + max]))
        .unwrap();
    let untouched = if spec.entropy()
        || matches!(
            spec.id(),
            gradpack::CodecId::TopK | gradpack::CodecId::ChunkTopK | gradpack::CodecId::Lossless
        ) {
        align + max
    } else {
        align + len
    };
    assert!(
        buf[..align]
            .iter()
            .chain(&buf[untouched..])
            .all(|&v| v == SENTINEL),
        "{spec} on {b}: wrote outside the frame"
    );
    buf[align..align + len].to_vec()
}

fn decode_with<const ADD: bool>(b: Backend, frame: &[u8], n: usize, fill: f32) -> Vec<u32> {
    let mut out = vec![fill; n];
    b.run(|| {
        if ADD {
            gradpack::decode_add(frame, &mut out)
        } else {
            gradpack::decode(frame, &mut out)
        }
    })
    .unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

fn same_everywhere(spec: &CodecSpec, x: &[f32], ctx: &EncodeCtx, backends: &[Backend]) {
    let s = Backend::scalar();
    let want = encode_with(s, spec, x, ctx, 0);
    let want_d = decode_with::<false>(s, &want, x.len(), 0.0);
    let want_a = decode_with::<true>(s, &want, x.len(), 1.5);
    for &b in backends {
        let got = encode_with(b, spec, x, ctx, 3);
        assert!(
            got == want,
            "{spec} on {b}: frame differs from scalar (n = {})",
            x.len()
        );
        assert!(
            decode_with::<false>(b, &want, x.len(), f32::NAN) == want_d,
            "{spec} on {b}: decode differs"
        );
        assert!(
            decode_with::<true>(b, &want, x.len(), 1.5) == want_a,
            "{spec} on {b}: decode_add differs"
        );
    }
}

fn all_specs() -> Vec<CodecSpec> {
    let mut v = specs();
    for s in [
        "int8:block=8",
        "int8:block=100,rounding=stochastic",
        "sign:block=1024",
        "sign:block=8",
        "sign:block=12",
        "sign:block=40",
        "qsgd:bits=2,block=6",
        "qsgd:bits=2,block=512",
        "qsgd:bits=4,block=3",
        "qsgd:bits=8,block=100",
        "ternary:block=1",
        "ternary:block=12",
        "ternary:block=256",
        "natural:block=1",
        "natural:block=1000",
        "topk:ratio=0.5",
        "topk:k=1,values=fp16",
        "randk:ratio=1",
        "randk:ratio=0.01",
        "randk:ratio=1,select=strata",
        "randk:ratio=0.01,values=fp16,select=strata",
        "fp4:block=48,scale=f32",
        "fp4:block=16,format=e2m1",
        "fp4:format=e3m0",
        "fp4:format=e3m0,block=48,scale=f32",
        "fp4:format=e3m0,block=16,scale=e4m3",
        // Blocks off the kernels' steps, whose rests the SIMD encoders pad to a whole
        // step, and blocks either side of the AVX-512 backend's routing limits.
        "int8:block=48",
        "int8:block=20,rounding=stochastic",
        "qsgd:bits=4,block=40",
        "natural:block=40",
        "sign:block=64",
        "sign:block=128",
        "fp8:block=16",
        "fp8:block=48",
        "fp8:block=20,scale=e8m0,format=e5m2",
        "fp8:block=100,scale=e8m0",
        "fp4:block=20",
        "fp4:block=36,scale=f32,format=e3m0",
    ] {
        v.push(s.parse().unwrap());
    }
    v
}

#[test]
fn every_backend_matches_scalar_at_boundary_lengths() {
    let backends = simd_backends();
    for spec in all_specs() {
        for n in boundary_lengths(block_of(&spec)) {
            for salt in 0..2 {
                let x = sample(n, salt + 40);
                same_everywhere(
                    &spec,
                    &x,
                    &EncodeCtx::new(9).with_offset(salt as u64 * 77),
                    &backends,
                );
            }
        }
    }
}

#[test]
fn every_backend_matches_scalar_at_every_alignment() {
    let backends = simd_backends();
    let base = sample(300 + 16, 3);
    for spec in all_specs() {
        // Input slices starting 0..63 bytes into a buffer (f32 granularity: 4 bytes).
        for start in 0..16 {
            let x = &base[start..start + 300];
            same_everywhere(&spec, x, &EncodeCtx::new(start as u64), &backends);
        }
        // Frames starting at every byte offset 0..63 of a decode buffer.
        let x = &base[..300];
        let frame = encode_with(Backend::scalar(), &spec, x, &EncodeCtx::new(1), 0);
        let want = decode_with::<false>(Backend::scalar(), &frame, 300, 0.0);
        for &b in &backends {
            for align in 0..64 {
                let mut buf = vec![0u8; align + frame.len()];
                buf[align..].copy_from_slice(&frame);
                assert!(
                    decode_with::<false>(b, &buf[align..], 300, 0.0) == want,
                    "{spec} on {b} at byte {align}"
                );
            }
        }
    }
}

#[test]
fn every_backend_matches_scalar_on_special_and_nonfinite_values() {
    let backends = simd_backends();
    for spec in all_specs() {
        let x: Vec<f32> = SPECIALS.iter().copied().cycle().take(257).collect();
        same_everywhere(&spec, &x, &EncodeCtx::new(2), &backends);
        for (pos, bad) in [
            (0, f32::NAN),
            (5, f32::INFINITY),
            (100, f32::NEG_INFINITY),
            (256, -f32::NAN),
            // A signalling NaN and a NaN whose payload carries into the exponent when
            // rounded like a number: codecs that quiet NaN must do so on every backend.
            (40, f32::from_bits(0x7F80_0001)),
            (200, f32::from_bits(0xFFBF_FFFF)),
        ] {
            let mut y = sample(257, 11);
            y[pos] = bad;
            same_everywhere(&spec, &y, &EncodeCtx::new(2), &backends);
        }
    }
}

#[test]
fn every_backend_matches_scalar_across_scales() {
    // The sample spans about 2^-16..2^8 (plus specials); scaled by 2^s it reaches tiny
    // blocks (int8/qsgd's 2^64 pre-multiplier below 2^-100, natural's lowest reference
    // and subnormal codes), huge ones (natural's top reference, where most elements
    // round to 0 or the smallest power), and everything between.
    let backends = simd_backends();
    let base = sample(1100, 5);
    for s in [
        -149, -140, -126, -110, -100, -90, -60, -20, 0, 20, 60, 100, 110, 119,
    ] {
        let x: Vec<f32> = base
            .iter()
            .map(|&v| {
                let y = (v as f64 * pow2(s)) as f32;
                if y.is_finite() {
                    y
                } else {
                    f32::MAX.copysign(v)
                }
            })
            .collect();
        for spec in all_specs() {
            same_everywhere(&spec, &x, &EncodeCtx::new(s as u64), &backends);
        }
    }
}

#[test]
fn fp8_and_fp4_groups_of_blocks_match_scalar_whatever_one_block_holds() {
    // The SIMD encoders form the scales of eight whole blocks at once and leave a group
    // holding an unusual block to the definition's path: plant one at every position of
    // a group, in frames of three groups and a tail.
    let backends = simd_backends();
    // Element `i` of the planted block: NaN, +Inf, signed zeros, a subnormal maximum,
    // the smallest normal maximum, f32::MAX, values near it, powers of two, tiny values.
    let unusual: [fn(usize) -> f32; 9] = [
        |_| f32::NAN,
        |i| if i == 3 { f32::INFINITY } else { 1.0 },
        |i| if i % 2 == 0 { 0.0 } else { -0.0 },
        |i| f32::from_bits(1 + i as u32 * 977),
        |i| f32::MIN_POSITIVE * if i == 5 { 1.0 } else { 0.25 },
        |i| if i == 1 { -f32::MAX } else { 3.0 },
        |i| f32::from_bits(0x7F7F_FFFF - 0x30_0000 * (i as u32 % 3)),
        |i| 2f32.powi(i as i32 % 40 - 20),
        |i| 1e-30 * (i as f32 - 7.5),
    ];
    for spec in [
        "fp8",
        "fp8:block=32",
        "fp8:format=e5m2,block=64",
        "fp8:scale=e8m0",
        "fp8:format=e5m2,scale=e8m0,block=32",
        "fp4",
        "fp4:block=64",
        "fp4:format=e3m0",
        "fp4:format=e3m0,block=64",
        "fp4:scale=e4m3",
        "fp4:scale=e4m3,format=e3m0,block=32",
        "fp4:block=48,scale=f32",
        // Blocks of a multiple of 16 that 64 does not divide (AVX-512 groups them, a
        // step of 64 elements crossing blocks), and one of 16.
        "fp8:block=16",
        "fp8:block=48,format=e5m2",
        "fp8:block=80,scale=e8m0",
        "fp4:block=16",
        "fp4:block=80,scale=f32",
        "fp4:block=16,scale=e4m3",
        // Blocks of a multiple of 8 (AVX2 groups them, a step of 32 elements crossing
        // blocks where 32 does not divide the block).
        "fp8:block=8",
        "fp8:block=24,format=e5m2",
        "fp8:block=40,scale=e8m0",
        "fp4:block=8",
        "fp4:block=24,scale=e4m3",
        "fp4:block=56,format=e3m0",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let block = block_of(&spec);
        let n = 3 * 8 * block + block / 2 + 3;
        let base = sample(n, 77);
        for value in unusual {
            for at in 0..8 {
                let mut x = base.clone();
                let b = 8 * block + at * block;
                for (i, v) in x[b..b + block].iter_mut().enumerate() {
                    *v = value(i);
                }
                same_everywhere(&spec, &x, &EncodeCtx::new(at as u64), &backends);
            }
        }
    }
}

#[test]
fn fp8_and_fp4_codes_match_scalar_at_every_rounding_boundary() {
    // Blocks whose maximum is the format's largest value have the scale 1 (f32 and E8M0),
    // so each element is its own quotient. Every value with at most five significant
    // bits is a code's value or the midpoint between two neighbours (in every binade
    // these formats have, subnormal ones included), a tie that must round to the even
    // code; with those values, their neighbours one f32 ulp away, both signs, in blocks of
    // 16 to 128 and groups of eight, every backend must write the definition's bytes.
    let backends = simd_backends();
    let mut sweep = Vec::new();
    for e in -30..=16 {
        for j in 0..32 {
            let v = pow2(e) as f32 * (1.0 + j as f32 / 32.0);
            for w in [v, v.next_up(), v.next_down()] {
                sweep.extend([w, -w]);
            }
        }
    }
    for (spec, fmax) in [
        ("fp8", 448.0),
        ("fp8:scale=e8m0", 448.0),
        ("fp8:format=e5m2,block=64", 57344.0),
        ("fp8:format=e5m2,scale=e8m0,block=16", 57344.0),
        ("fp4:scale=f32", 6.0),
        ("fp4:block=16", 6.0),
        ("fp4:format=e3m0,block=64", 16.0),
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let block = block_of(&spec);
        let values: Vec<f32> = sweep.iter().copied().filter(|v| v.abs() <= fmax).collect();
        let mut x = Vec::new();
        for (b, chunk) in values.chunks(block - 1).enumerate() {
            // The block's maximum first (either sign), then its share of the sweep.
            x.push(if b % 2 == 0 { fmax } else { -fmax });
            x.extend_from_slice(chunk);
            x.resize((b + 1) * block, 0.0);
        }
        same_everywhere(&spec, &x, &EncodeCtx::new(3), &backends);
    }
}

#[test]
fn fp4_e4m3_block_scales_match_scalar_over_every_ratio_to_the_frame() {
    // The SIMD encoders form eight blocks' E4M3 scales at once: each block's maximum over
    // the frame's, swept from 1 down past 2^-24 (the scale bytes' subnormal range below
    // about 2^-15, the clamp to the smallest byte below 2^-17) with mantissas on and off
    // the E4M3 grid, in groups of eight after a block holding the frame's maximum.
    let backends = simd_backends();
    for spec in ["fp4:scale=e4m3", "fp4:scale=e4m3,format=e3m0,block=32"] {
        let spec: CodecSpec = spec.parse().unwrap();
        let block = block_of(&spec);
        let base = sample(8 * 32 * block, 5);
        let peak = base.iter().fold(0f32, |m, v| m.max(v.abs()));
        for top in [1.0f32, 3.0e-7, 6.0e20] {
            let mut x = vec![0f32; block];
            x[block / 2] = -top;
            for (b, xb) in base.chunks_exact(block).enumerate() {
                // 2^-(b / 8) times a mantissa from 1 to about 2, a bit more than the
                // block's own maximum.
                let ratio = 2f32.powi(-((b / 8) as i32)) * (1.0 + (b % 8) as f32 / 7.0);
                x.extend(xb.iter().map(|v| v / peak * ratio * top));
            }
            x.push(0.25 * top);
            same_everywhere(&spec, &x, &EncodeCtx::new(block as u64), &backends);
        }
    }
}

#[test]
fn stochastic_encoders_match_scalar_at_every_draw_alignment() {
    // The AVX2 stochastic encoders draw 32 at a time in aligned groups of 64 when a block
    // starts at a multiple of 32 (AVX-512's sign-magnitude encoder: 64 at a time, at a
    // multiple of 64), from a table that changes every 2^16 indices, and one draw per
    // index otherwise. Offsets on and off those multiples, steps in either half of a
    // group, ranges across a 2^16 boundary and across a 2^32 key window.
    let backends = simd_backends();
    let x = sample(3000, 21);
    let specs = [
        "int8:rounding=stochastic,block=96",
        "qsgd:bits=2,block=160",
        "qsgd:bits=4,block=64",
        "qsgd:bits=8,block=1000",
        "qsgd:bits=2,block=512",
        "ternary:block=96",
        "ternary:block=1024",
        "natural:block=96",
        "natural:block=1024",
        // fp8 and fp4 (AVX-512's kernel, on blocks of at least 64 and 128: 64 draws at a
        // time on blocks from a multiple of 64, 16 by their own hashes otherwise, the
        // definition for a tail and across a window; the portable builds below those).
        "fp8:rounding=stochastic,block=96",
        "fp8:format=e5m2,scale=e8m0,rounding=stochastic,block=200",
        "fp4:rounding=stochastic,block=160",
        "fp4:format=e3m0,scale=f32,rounding=stochastic,block=128",
        "fp4:scale=e4m3,rounding=stochastic,block=144",
        "fp4:rounding=stochastic",
    ];
    for spec in specs {
        let spec: CodecSpec = spec.parse().unwrap();
        for offset in [
            0u64,
            8,
            32,
            77,
            (1 << 16) - 96,
            (1 << 16) - 32,
            (1 << 16) - 128,
            (5 << 16) + 32,
            (7 << 16) - 1024,
            (1 << 32) - 1024,
            (1 << 32) - 32,
            (3 << 32) + 32,
        ] {
            for n in [3000, 2017] {
                let ctx = EncodeCtx::new(offset ^ 5).with_offset(offset);
                same_everywhere(&spec, &x[..n], &ctx, &backends);
            }
        }
    }
}

#[test]
fn natural_matches_scalar_around_its_smallest_code() {
    // The AVX2 natural encoder has a short form for steps of 32 elements that hold no
    // |x| in (0, 2^kmin) (kmin = r - 126, r the block's reference exponent) and the
    // general form for the rest. One such element, each of the values either side of
    // 2^kmin (one of which rounds up to 2^-126 when scaled by 2^-r), at every position of
    // two blocks of 100 (three steps and a tail each), for references from the lowest to
    // the clamped top. The last value is made from the element's own draw, halfway
    // between two multiples of 2^(kmin - 23) next to it: where the short form's scaling
    // rounds (r >= 1), that alone flips the decision for an even draw.
    let backends = simd_backends();
    let spec: CodecSpec = "natural:block=100".parse().unwrap();
    for r in [-23, -22, -10, 0, 1, 20, 100, 125, 126, 127] {
        let kmin = r - 126;
        let at = |k: i32, f: f64| (f * pow2(k)) as f32;
        let near = [
            at(kmin, 1.0),
            at(kmin, 1.0 - pow2(-24)),
            at(kmin, 1.0 - pow2(-23)),
            at(kmin, 1.0 + pow2(-23)),
            at(kmin, 0.75),
            at(kmin - 1, 1.0),
            at(kmin - 1, 1.0 - pow2(-24)),
            at(kmin + 1, 1.5),
            1.0e-45,
            f32::MIN_POSITIVE,
            0.0, // replaced by the draw-made value
        ];
        // Ordinary elements over the 40 binades below the block's top, 1.5 * 2^(r - 1).
        let base: Vec<f32> = sample(200, r as u32)
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let m = if v.is_finite() && v != 0.0 {
                    v.abs().min(1.0)
                } else {
                    0.5
                };
                at(r - 1 - (i % 40) as i32, m as f64).copysign(v)
            })
            .collect();
        for (k, &tiny) in near.iter().enumerate() {
            for pos in (0..200).filter(|p| p % 100 != 99) {
                let mut x = base.clone();
                x[99] = at(r - 1, 1.5);
                x[199] = -at(r - 1, 1.5);
                let tiny = if k + 1 == near.len() {
                    let u23 = Draws::new(k as u64, STREAM_ROUNDING, 0).draw(pos as u64) >> 9;
                    at(kmin - 23, u23 as f64 + 0.5)
                } else {
                    tiny
                };
                x[pos] = if (pos + k) % 2 == 0 { tiny } else { -tiny };
                same_everywhere(&spec, &x, &EncodeCtx::new(k as u64), &backends);
            }
        }
    }
}

#[test]
fn every_backend_decodes_arbitrary_codes_like_scalar() {
    // Encoders emit only some codes (natural's few largest powers, qsgd's small levels);
    // decoders must agree on every code a frame can carry. The code section is the end
    // of an unsealed fixed-rate frame: overwrite it with hash bytes.
    let backends = simd_backends();
    let x = sample(1000, 8);
    for (s, bits) in [
        ("int8:block=64", 8),
        ("qsgd:bits=2,block=64", 2),
        ("qsgd:bits=4,block=64", 4),
        ("qsgd:bits=8,block=64", 8),
        ("ternary:block=64", 2),
        ("sign:block=64", 1),
        ("natural:block=64", 8),
        ("natural:block=1000", 8),
    ] {
        let spec: CodecSpec = s.parse().unwrap();
        for (salt, scale) in [(0u32, 1.0f32), (1, 1.0e-30), (2, 1.0e30)] {
            let y: Vec<f32> = x.iter().map(|v| v * scale).collect();
            let mut frame = encode_with(Backend::scalar(), &spec, &y, &EncodeCtx::new(3), 0);
            let code_bytes = (x.len() * bits).div_ceil(8);
            let at = frame.len() - code_bytes;
            for (k, byte) in frame[at..].iter_mut().enumerate() {
                *byte = gradpack::rng::lowbias32(k as u32 ^ salt << 20) as u8;
            }
            let want_d = decode_with::<false>(Backend::scalar(), &frame, x.len(), 0.0);
            let want_a = decode_with::<true>(Backend::scalar(), &frame, x.len(), 1.5);
            for &b in &backends {
                assert!(
                    decode_with::<false>(b, &frame, x.len(), 7.0) == want_d,
                    "{s} on {b}: decode"
                );
                assert!(
                    decode_with::<true>(b, &frame, x.len(), 1.5) == want_a,
                    "{s} on {b}: add"
                );
            }
        }
    }
}

#[test]
fn every_backend_decodes_every_fp8_code_and_scale_like_scalar() {
    // Scaled fp8 frames carry any finite code and any scale their decoders accept: every
    // code in every block, under scales from zero and subnormals to f32's largest (where
    // E4M3's conversion through half precision cannot fold its 2^8 into the scale) and
    // NaN, for block lengths the register kernels take (multiples of 16) and others.
    let backends = simd_backends();
    let f32_scales: Vec<u32> = [0.0f32, 1e-45, 1e-40, f32::MIN_POSITIVE, 0.75, 7.6e35, 1e37]
        .iter()
        .map(|s| s.to_bits())
        .chain([f32::MAX.to_bits(), 0x7FC0_0000])
        .collect();
    let e8m0_scales = [0u8, 1, 100, 127, 200, 247, 248, 254, 0xFF];
    for format in ["e4m3", "e5m2"] {
        let bad = if format == "e4m3" { 0x7F } else { 0x7C };
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & bad != bad).collect();
        for scale in ["f32", "e8m0"] {
            for block in [16usize, 32, 48, 64, 128, 24] {
                let s = format!("fp8:format={format},scale={scale},block={block}");
                let spec: CodecSpec = s.parse().unwrap();
                let sb = if scale == "f32" { 4 } else { 1 };
                let n = 9 * block + block / 2;
                let blocks = n.div_ceil(block);
                let mut frame = encode_with(
                    Backend::scalar(),
                    &spec,
                    &sample(n, 12),
                    &EncodeCtx::new(5),
                    0,
                );
                let at = frame.len() - n;
                for (k, c) in frame[at..].iter_mut().enumerate() {
                    *c = codes[(k * 7 + k / 251) % codes.len()];
                }
                for b in 0..blocks {
                    let sc = &mut frame[at - blocks * sb + b * sb..at - blocks * sb + (b + 1) * sb];
                    if scale == "f32" {
                        sc.copy_from_slice(&f32_scales[b % f32_scales.len()].to_le_bytes());
                    } else {
                        sc[0] = e8m0_scales[b % e8m0_scales.len()];
                    }
                }
                let want_d = decode_with::<false>(Backend::scalar(), &frame, n, 0.0);
                let want_a = decode_with::<true>(Backend::scalar(), &frame, n, -2.5);
                for &b in &backends {
                    assert!(
                        decode_with::<false>(b, &frame, n, 3.0) == want_d,
                        "{s} on {b}: decode"
                    );
                    assert!(
                        decode_with::<true>(b, &frame, n, -2.5) == want_a,
                        "{s} on {b}: add"
                    );
                }
            }
        }
    }
}

#[test]
fn nan_steps_decode_to_their_quieted_bits_and_infinite_steps_are_refused() {
    // A decoded NaN is the step's NaN with the quiet bit set by the multiplication (sign
    // copies the step, so only its decode_add quiets it) and its sign flipped where the
    // codec negates (every codec but int8), on every backend: the bits a crafted frame
    // decodes to do not depend on the CPU. An infinite step would decode a zero code as
    // 0 * Inf, whose NaN differs between x86 and Arm, so decoders refuse it.
    let mut backends = simd_backends();
    backends.push(Backend::scalar());
    let x = sample(1000, 9);
    let step_at = |frame: &mut [u8], bits: u32| {
        frame[gradpack::HEADER_LEN + 4..gradpack::HEADER_LEN + 8]
            .copy_from_slice(&bits.to_le_bytes())
    };
    for (s, negates) in [
        ("int8:block=64", false),
        ("int8:block=64,rounding=stochastic", false),
        ("qsgd:bits=2,block=64", true),
        ("qsgd:bits=4,block=64", true),
        ("qsgd:bits=8,block=64", true),
        ("ternary:block=64", true),
        ("sign:block=64", true),
        ("topk:ratio=0.5,values=int8", false),
    ] {
        let spec: CodecSpec = s.parse().unwrap();
        let frame = encode_with(Backend::scalar(), &spec, &x, &EncodeCtx::new(3), 0);
        let plain = decode_with::<false>(Backend::scalar(), &frame, x.len(), 0.0);
        let mut unit = frame.clone();
        step_at(&mut unit, 1.0f32.to_bits());
        let signs = decode_with::<false>(Backend::scalar(), &unit, x.len(), 0.0);
        for nan in [0x7FC0_0000u32, 0x7F80_0001, 0xFFA1_2345, 0x7FFF_FFFF] {
            let mut crafted = frame.clone();
            step_at(&mut crafted, nan);
            let copied = if s.starts_with("sign") {
                nan
            } else {
                nan | 0x0040_0000
            };
            let mut nans = 0;
            for &b in &backends {
                for fill in [0.0f32, 1.5] {
                    let got = if fill == 0.0 {
                        decode_with::<false>(b, &crafted, x.len(), fill)
                    } else {
                        decode_with::<true>(b, &crafted, x.len(), fill)
                    };
                    nans = 0;
                    for (i, &g) in got.iter().enumerate() {
                        let flip = if negates { signs[i] & 0x8000_0000 } else { 0 };
                        let in_block = if s.starts_with("topk") {
                            g & 0x7FFF_FFFF > 0x7F80_0000
                        } else {
                            (64..128).contains(&i)
                        };
                        if in_block {
                            nans += 1;
                            let want = if fill == 0.0 {
                                copied
                            } else {
                                nan | 0x0040_0000
                            };
                            assert_eq!(g, want ^ flip, "{s} on {b}, step {nan:#x}: element {i}");
                        } else if fill == 0.0 {
                            assert_eq!(g, plain[i], "{s} on {b}: element {i} outside the block");
                        }
                    }
                }
            }
            // top-k: its 500 kept values make 2 int8 blocks; the second holds 244.
            assert_eq!(nans, if s.starts_with("topk") { 244 } else { 64 }, "{s}");
        }
        for inf in [f32::INFINITY, f32::NEG_INFINITY] {
            let mut crafted = frame.clone();
            step_at(&mut crafted, inf.to_bits());
            for &b in &backends {
                let mut out = vec![7.0f32; x.len()];
                match b.run(|| gradpack::decode(&crafted, &mut out)) {
                    Err(gradpack::Error::Corrupt { offset, .. }) => {
                        assert_eq!(offset, gradpack::HEADER_LEN + 4, "{s}")
                    }
                    other => panic!("{s} on {b}: step {inf} gave {other:?}"),
                }
                assert!(out.iter().all(|&v| v == 7.0), "{s}: output written");
            }
        }
    }
}

/// Run a compare-and-compress filter to the end of `n` elements with an index buffer of
/// `cap` entries (pre-filled with a sentinel), checking each call's contract (entries
/// past the written ones may change, but none 64 or more past them); returns the
/// absolute indices kept.
fn filter_all(
    n: usize,
    cap: usize,
    mut filter: impl FnMut(usize, &mut [u32]) -> (usize, usize),
) -> Vec<u64> {
    let mut kept = Vec::new();
    let mut pos = 0;
    while pos < n {
        let mut idx = vec![u32::MAX; cap];
        let (used, wrote) = filter(pos, &mut idx);
        assert!(
            used > 0 && pos + used <= n,
            "consumed {used} at {pos} of {n}"
        );
        assert!(wrote <= used && wrote <= cap);
        assert!(
            idx[(wrote + 64).min(cap)..].iter().all(|&v| v == u32::MAX),
            "wrote 64 or more past {wrote}"
        );
        assert!(idx[..wrote].windows(2).all(|w| w[0] < w[1]));
        kept.extend(idx[..wrote].iter().map(|&i| {
            assert!((i as usize) < used);
            (pos + i as usize) as u64
        }));
        pos += used;
    }
    kept
}

/// `filter_mag_ge_vals` on the current backend, checked: each written value holds the
/// bits of the element its index names (NaN payloads included), nothing is written past
/// the reported count, and the scalar oracle writes the same values.
fn vals_of(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    use gradpack::unstable::kernels::{filter_mag_ge_vals, scalar};
    let mut vals = vec![u32::MAX; idx.len() + 7];
    let (used, wrote) = filter_mag_ge_vals(x, t, idx, &mut vals);
    for (j, &i) in idx[..wrote].iter().enumerate() {
        assert_eq!(vals[j], x[i as usize].to_bits(), "value {j} of {wrote}");
    }
    assert!(
        vals[wrote..].iter().all(|&v| v == u32::MAX),
        "value past {wrote}"
    );
    let room = (used + 64).next_multiple_of(64);
    let (mut oi, mut ov) = (vec![0u32; room], vec![0u32; room]);
    let (_, w) = scalar::filter_mag_ge_vals(&x[..used], t, &mut oi, &mut ov);
    assert!(
        w == wrote && oi[..w] == idx[..w] && ov[..w] == vals[..w],
        "oracle values differ"
    );
    (used, wrote)
}

/// A `filter_mag_ge`-shaped kernel.
type MagFilter = fn(&[f32], u32, &mut [u32]) -> (usize, usize);

#[test]
fn every_backend_finds_nonfinite_values_like_the_oracle() {
    use gradpack::unstable::kernels::{any_nonfinite, scalar};
    let backends = simd_backends();
    let finite = [f32::MAX, -f32::MAX, 1e-45, -0.0, 3.5];
    for n in 0..80 {
        let x: Vec<f32> = (0..n).map(|i| finite[i % finite.len()]).collect();
        for b in &backends {
            assert!(!b.run(|| any_nonfinite(&x)), "{b}: finite input, n {n}");
        }
        for pos in 0..n {
            for v in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut y = x.clone();
                y[pos] = v;
                assert!(scalar::any_nonfinite(&y));
                for b in &backends {
                    assert!(b.run(|| any_nonfinite(&y)), "{b}: {v} at {pos} of {n}");
                }
            }
        }
    }
}

/// Magnitude thresholds for the filter and compaction kernels: none kept, all kept,
/// sparse and dense cuts, and the special keys.
fn mag_thresholds() -> [u32; 10] {
    use gradpack::unstable::kernels::scalar;
    [
        0,
        1,
        scalar::mag_key(0.5),
        scalar::mag_key(30.0),
        scalar::mag_key(99.0),
        scalar::INF_BITS,
        scalar::INF_BITS + 1,
        0x7FFF_FFFF,
        0x8000_0000,
        u32::MAX,
    ]
}

#[test]
fn every_backend_retains_candidates_like_the_oracle() {
    use gradpack::unstable::kernels::{retain_mag_ge, scalar};
    let backends = simd_backends();
    let mut pool: Vec<f32> = sample(1000, 23);
    pool.extend(SPECIALS.iter().copied());
    pool.extend([f32::NAN, -f32::NAN, f32::INFINITY, 0.0, -0.0]);
    let keys = mag_thresholds();
    for n in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, pool.len()] {
        for start in [0, 5] {
            let vals: Vec<u32> = pool[start..][..n.min(pool.len() - start)]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let idx: Vec<u32> = (0..vals.len() as u32).map(|i| 3 * i + 1).collect();
            for &t in &keys {
                let (mut wi, mut wv) = (idx.clone(), vals.clone());
                let want = scalar::retain_mag_ge(&mut wi, &mut wv, t);
                let by_hand: Vec<u32> = (0..vals.len())
                    .filter(|&j| scalar::mag_key(f32::from_bits(vals[j])) >= t)
                    .map(|j| idx[j])
                    .collect();
                assert_eq!(wi[..want], by_hand[..], "oracle, n {n} t {t:#x}");
                for b in &backends {
                    let (mut gi, mut gv) = (idx.clone(), vals.clone());
                    let got = b.run(|| retain_mag_ge(&mut gi, &mut gv, t));
                    assert!(
                        got == want && gi[..got] == wi[..want] && gv[..got] == wv[..want],
                        "retain_mag_ge on {b}: n {n} t {t:#x}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_backend_filters_like_the_oracle() {
    use gradpack::unstable::kernels::{filter_draw_lt, filter_mag_ge, scalar};
    let backends = simd_backends();
    let base = sample(5000 + 16, 21);
    let mut specials: Vec<f32> = SPECIALS.iter().copied().cycle().take(700).collect();
    specials.extend([f32::NAN, -f32::NAN, f32::INFINITY, 0.0, -0.0]);
    let keys = mag_thresholds();
    for &b in &backends {
        for cap in [64, 65, 127, 200, 1024] {
            for start in [0, 1, 3, 15] {
                for n in [0, 1, 63, 64, 65, 127, 128, 129, 1000, 5000] {
                    let x = &base[start..start + n];
                    for &t in &keys {
                        let f =
                            |run: MagFilter| filter_all(n, cap, |pos, idx| run(&x[pos..], t, idx));
                        let want = f(scalar::filter_mag_ge);
                        let got = b.run(|| f(filter_mag_ge));
                        assert!(
                            got == want,
                            "filter_mag_ge on {b}: n {n} t {t:#x} cap {cap}"
                        );
                        let with_vals =
                            b.run(|| filter_all(n, cap, |pos, idx| vals_of(&x[pos..], t, idx)));
                        assert!(
                            with_vals == want,
                            "filter_mag_ge_vals on {b}: n {n} t {t:#x} cap {cap}"
                        );
                        let by_hand: Vec<u64> = (0..n as u64)
                            .filter(|&i| scalar::mag_key(x[i as usize]) >= t)
                            .collect();
                        assert_eq!(want, by_hand);
                    }
                }
            }
            let y = &specials;
            for &t in &keys {
                let want = filter_all(y.len(), cap, |p, i| scalar::filter_mag_ge(&y[p..], t, i));
                let got = b.run(|| filter_all(y.len(), cap, |p, i| filter_mag_ge(&y[p..], t, i)));
                assert!(got == want, "filter_mag_ge on {b}: specials, t {t:#x}");
                let got = b.run(|| filter_all(y.len(), cap, |p, i| vals_of(&y[p..], t, i)));
                assert!(got == want, "filter_mag_ge_vals on {b}: specials, t {t:#x}");
            }
            let draws = gradpack::rng::Draws::new(17, 3, 0);
            for first in [0u64, 5, (1 << 16) - 37, (1 << 32) - 100] {
                for t in [0u64, 1, 1 << 25, 1 << 31, u32::MAX as u64, 1 << 32] {
                    let n = 1000;
                    let want = filter_all(n, cap, |p, i| {
                        gradpack::unstable::kernels::scalar::filter_draw_lt(
                            &draws,
                            first + p as u64,
                            t,
                            n - p,
                            i,
                        )
                    });
                    let got = b.run(|| {
                        filter_all(n, cap, |p, i| {
                            filter_draw_lt(&draws, first + p as u64, t, n - p, i)
                        })
                    });
                    assert!(got == want, "filter_draw_lt on {b}: first {first} t {t:#x}");
                    let count =
                        b.run(|| gradpack::unstable::kernels::count_draw_lt(&draws, first, t, n));
                    assert_eq!(count, want.len(), "count_draw_lt on {b}: first {first}");
                    // Every tail length of the 16-lane steps, and past the lane counters'
                    // reduction at 2^16 steps.
                    for n in (0..40).chain([(1 << 20) + 37]) {
                        assert_eq!(
                            b.run(|| gradpack::unstable::kernels::count_draw_lt(
                                &draws, first, t, n
                            )),
                            scalar::count_draw_lt(&draws, first, t, n),
                            "count_draw_lt on {b}: first {first} t {t:#x} n {n}"
                        );
                    }
                }
            }
        }
    }
}

/// `draw_masks`, `for_each_draw_lt_exactly` (random-k's `decode_add`) and
/// `for_each_draw_lt_zeroing` (its `decode_into`) against the oracle on every backend:
/// every tail length of the 64-element entries, starts off and on a multiple of 64, ranges
/// across a 2^16 and a 2^32 index boundary, and selections longer than the stored masks.
#[test]
fn draw_masks_and_checked_selection_match_the_oracle() {
    use gradpack::unstable::kernels::{
        STORED_MASK_ELEMENTS, draw_masks, for_each_draw_lt_exactly, for_each_draw_lt_zeroing,
    };
    const SENTINEL: u64 = 0xA5A5_A5A5_A5A5_A5A5;
    let draws = gradpack::rng::Draws::new(99, 5, 0);
    let masks_on = |b: Backend, first: u64, t: u64, n: usize| {
        let mut m = vec![SENTINEL; n.div_ceil(64) + 2];
        let count = b.run(|| draw_masks(&draws, first, t, n, &mut m));
        (m, count)
    };
    let mut backends = simd_backends();
    backends.push(Backend::scalar());
    for &b in &backends {
        let firsts = [
            0u64,
            7,
            64,
            (1 << 16) - 37,
            (1 << 16) - 64,
            (1 << 32) - 100,
            (1 << 32) - 64,
        ];
        for first in firsts {
            for t in [0u64, 1, 1 << 22, 1 << 25, 1 << 31, u32::MAX as u64, 1 << 32] {
                for n in (0..140).chain([1000, 4099, 70_001]) {
                    let (got, count) = masks_on(b, first, t, n);
                    let words = n.div_ceil(64);
                    let want: Vec<u64> = (0..words)
                        .map(|w| {
                            (0..(n - 64 * w).min(64)).fold(0u64, |m, j| {
                                let i = first + (64 * w + j) as u64;
                                m | (((draws.draw(i) as u64) < t) as u64) << j
                            })
                        })
                        .collect();
                    let ctx = format!("draw_masks on {b}: first {first} t {t:#x} n {n}");
                    assert_eq!(got[..words], want[..], "{ctx}");
                    assert_eq!(got[words..], [SENTINEL; 2], "{ctx}: wrote past the masks");
                    let ones: usize = want.iter().map(|m| m.count_ones() as usize).sum();
                    assert_eq!(count, ones, "{ctx}");
                }
            }
        }
        // random-k's decode_into: zero everywhere, the callback at each kept element.
        for first in [0u64, 7, (1 << 16) - 37, (1 << 32) - 100] {
            for t in [0u64, 1 << 25, 1 << 31, 1 << 32] {
                for n in (0..140).chain([1000, 70_001]) {
                    let want = filter_all(n, 1024, |p, i| {
                        gradpack::unstable::kernels::scalar::filter_draw_lt(
                            &draws,
                            first + p as u64,
                            t,
                            n - p,
                            i,
                        )
                    });
                    let mut out = vec![f32::NAN; n + 3];
                    let mut got = Vec::new();
                    b.run(|| {
                        for_each_draw_lt_zeroing(&draws, first, t, &mut out[..n], |o, i| {
                            assert_eq!(o[i].to_bits(), 0, "called before zeroing {i}");
                            o[i] = 1.0;
                            got.push(i as u64);
                        })
                    });
                    let ctx =
                        format!("for_each_draw_lt_zeroing on {b}: first {first} t {t:#x} n {n}");
                    assert!(got == want, "{ctx}");
                    let ones: Vec<u64> =
                        (0..n as u64).filter(|&i| out[i as usize] == 1.0).collect();
                    assert!(ones == want, "{ctx}: not zero but at the kept elements");
                    assert!(out[..n].iter().all(|&v| v == 0.0 || v == 1.0), "{ctx}");
                    assert!(out[n..].iter().all(|v| v.is_nan()), "{ctx}: wrote past n");
                }
            }
        }
        // Past the stored masks, in a window that ends inside the selection.
        for (first, t) in [(3u64, 1u64 << 25), ((1 << 32) - 70_000, 1 << 28)] {
            let n = STORED_MASK_ELEMENTS + 4099;
            let want = filter_all(n, 1024, |p, i| {
                gradpack::unstable::kernels::scalar::filter_draw_lt(
                    &draws,
                    first + p as u64,
                    t,
                    n - p,
                    i,
                )
            });
            let mut got = Vec::new();
            let ok = b.run(|| {
                for_each_draw_lt_exactly(&draws, first, t, n, want.len(), |i| got.push(i as u64))
            });
            assert_eq!(ok, Ok(()), "for_each_draw_lt_exactly on {b}: first {first}");
            assert!(
                got == want,
                "for_each_draw_lt_exactly on {b}: first {first}"
            );
            for wrong in [want.len() - 1, want.len() + 1, 0] {
                let mut called = false;
                let r = b.run(|| {
                    for_each_draw_lt_exactly(&draws, first, t, n, wrong, |_| called = true)
                });
                assert_eq!(r, Err(want.len()), "on {b}: expecting {wrong}");
                assert!(!called, "on {b}: called with a count of {wrong}");
            }
        }
    }
}

#[test]
fn default_backend_is_the_best_unless_overridden() {
    if std::env::var_os("GRADPACK_BACKEND").is_none() {
        assert_eq!(Backend::default_backend(), Backend::best());
    }
    println!(
        "backends on this CPU: {:?}",
        Backend::available()
            .iter()
            .map(|b| b.name())
            .collect::<Vec<_>>()
    );
    let tested = simd_backends(); // prints a SKIP line for each backend the CPU lacks
    let unrouted = usize::from(Backend::avx512().is_some());
    assert_eq!(tested.len() + 1, Backend::available().len() + unrouted);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn prop_every_backend_matches_scalar(
        x in proptest::collection::vec(
            prop_oneof![8 => -100.0f32..100.0, 1 => any::<f32>(), 1 => proptest::sample::select(SPECIALS.to_vec())],
            0..600),
        seed in any::<u64>(),
        offset in prop_oneof![0u64..1000, (1u64 << 32) - 700..(1u64 << 32) + 10],
    ) {
        let backends = simd_backends();
        for spec in all_specs() {
            same_everywhere(&spec, &x, &EncodeCtx::new(seed).with_offset(offset), &backends);
        }
    }
}

/// The `codebook` encoding of `x` in blocks of `block` by its documented definition (wire
/// format, section `codebook`), computed here independently and plainly: a separate
/// finiteness scan, one histogram of sums and one of counts per residue `j % 4`, the bins'
/// sums in element order. Every block's codebook (256 little-endian f32), then every
/// element's code.
fn codebook_definition(x: &[f32], block: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut books, mut codes) = (Vec::new(), Vec::new());
    for xb in x.chunks(block) {
        if xb.iter().any(|v| !v.is_finite()) {
            for _ in 0..256 {
                books.extend(0x7FC0_0000u32.to_le_bytes());
            }
            codes.extend(std::iter::repeat_n(0u8, xb.len()));
            continue;
        }
        let lane_sum = |f: &dyn Fn(f32) -> f64| {
            let mut l = [0f64; 16];
            for (j, &v) in xb.iter().enumerate() {
                l[j % 16] += f(v);
            }
            for w in [8, 4, 2, 1] {
                for j in 0..w {
                    l[j] += l[j + w];
                }
            }
            l[0]
        };
        let n = xb.len() as f64;
        let mu = lane_sum(&|v| v as f64) / n;
        let sigma = (lane_sum(&|v| (v as f64 - mu) * (v as f64 - mu)) / n).sqrt();
        if sigma == 0.0 {
            books.extend((mu as f32).to_le_bytes());
            books.extend([0u8; 255 * 4]);
            codes.extend(std::iter::repeat_n(0u8, xb.len()));
            continue;
        }
        let (lo, span) = (mu - 6.0 * sigma, 2.0 * 6.0 * sigma);
        let (w, r) = (span / 256.0, 256.0 / span);
        let (mut sum, mut count) = ([[0f64; 4]; 256], [0u64; 256]);
        for (j, &v) in xb.iter().enumerate() {
            let k = ((v as f64 - lo) * r).floor().clamp(0.0, 255.0) as usize;
            codes.push(k as u8);
            sum[k][j % 4] += v as f64;
            count[k] += 1;
        }
        for k in 0..256 {
            let s = sum[k];
            let e = if count[k] > 0 {
                (((s[0] + s[1]) + (s[2] + s[3])) / count[k] as f64) as f32
            } else {
                let m = f32::MAX as f64;
                (lo + (k as f64 + 0.5) * w).clamp(-m, m) as f32
            };
            books.extend(e.to_le_bytes());
        }
    }
    (books, codes)
}

/// `spec` (a codebook) encodes `x` to the bytes of [`codebook_definition`] on every
/// backend the CPU has, the scalar one and the unrouted AVX-512 one included.
fn codebook_follows_definition(block: usize, x: &[f32], what: &str) {
    let (books, codes) = codebook_definition(x, block);
    let spec: CodecSpec = format!("codebook:block={block}").parse().unwrap();
    let mut backends = simd_backends();
    backends.push(Backend::scalar());
    for b in backends {
        let frame = encode_with(b, &spec, x, &EncodeCtx::new(1), 0);
        let payload = &frame[gradpack::HEADER_LEN..];
        assert_eq!(payload.len(), books.len() + codes.len(), "{b}, {what}");
        assert!(
            payload[..books.len()] == books[..],
            "{b}, {what}: codebooks differ"
        );
        assert!(
            payload[books.len()..] == codes[..],
            "{b}, {what}: codes differ"
        );
    }
}

/// The `codebook` encoder's bytes follow its documented definition on every backend:
/// blocks whose elements span many binades (so that the order of the f64 sums matters),
/// a block with a tail, one with all elements equal and one holding NaN.
#[test]
fn codebook_frames_follow_the_documented_definition_on_every_backend() {
    let block = 1000;
    let mut x = gradpack::synthetic::gradient(4 * block + 337, 11);
    for (j, v) in x.iter_mut().enumerate() {
        // Magnitudes from 2^-40 to 2^40: f64 sums of these round.
        *v *= 2f32.powi((j * 7919 % 81) as i32 - 40);
    }
    x[block..2 * block].fill(0.375);
    x[2 * block + 5] = f32::NAN;
    // Block 3: zeros, two outliers (end bins) that put the mean at about -65, and in the
    // bin from the mean up, 64 and -64 around two values of 2^-48, which 64 absorbs: in
    // element order that bin sums to 0, with its four interleaved sums to 2^-47.
    let b3 = &mut x[3 * block..4 * block];
    b3.fill(0.0);
    b3[0] = 1_048_576.0;
    b3[1] = -1_114_112.0;
    b3[2] = 64.0;
    b3[4] = 2f32.powi(-48);
    b3[5] = 2f32.powi(-48);
    b3[6] = -64.0;
    // The data tells the four sums from one in element order: elements 2, 4, 5 and 6 of
    // block 3 share a bin, which sums to 0 in element order and to 2^-47 as four sums.
    let (_, codes) = codebook_definition(&x, block);
    let c3 = &codes[3 * block..];
    assert!(c3[2] == c3[4] && c3[4] == c3[5] && c3[5] == c3[6]);
    let b3 = &x[3 * block..4 * block];
    let v = |j: usize| b3[j] as f64;
    let plain = ((v(2) + v(4)) + v(5)) + v(6);
    // Element j to sum j % 4: 4 to the first, 5 to the second, 2 and 6 to the third.
    let four = (v(4) + v(5)) + ((v(2) + v(6)) + 0.0);
    assert_eq!((plain, four), (0.0, 2f64.powi(-47)));
    codebook_follows_definition(block, &x, "mixed binades");
}

/// The same at block lengths around the encoder's internal steps (its histogram runs in
/// steps of 256 elements, four interleaved sums) and frame lengths around the blocks, on
/// inputs that fill a few bins (consecutive elements in one bin), constant runs, and
/// non-finite values in some blocks.
#[test]
fn codebook_frames_follow_the_documented_definition_around_its_steps() {
    for block in [1, 3, 64, 255, 256, 257, 300, 1023, 4096, 65536] {
        for n in [0, 1, 4, 5, 255, 256, 257, 1000, 3 * block + 7, 70_001] {
            let mixed = sample(n, block as u32);
            let narrow: Vec<f32> = mixed
                .iter()
                .enumerate()
                .map(|(i, v)| if i % 97 == 0 { 1e3 * v } else { 1.0 + v * 1e-3 })
                .collect();
            let runs: Vec<f32> = (0..n).map(|i| ((i / 37) % 5) as f32 - 2.0).collect();
            let mut specials = mixed.clone();
            for (i, v) in specials.iter_mut().enumerate() {
                if i % 1000 == 999 {
                    *v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][i / 1000 % 3];
                }
            }
            for (what, x) in [
                ("mixed", mixed),
                ("narrow", narrow),
                ("runs", runs),
                ("specials", specials),
            ] {
                codebook_follows_definition(block, &x, &format!("block {block}, n {n}, {what}"));
            }
        }
    }
}
/// Values for the fused int8 kernels: the common sample, then blocks of the tensor made
/// all zero, all below 2^-100 (where the quantiser scales first), and NaN, ±Inf and the
/// largest finite values at a few elements.
fn int8_fused_input(n: usize, salt: u32) -> Vec<f32> {
    let mut x = sample(n, salt);
    for (i, v) in x.iter_mut().enumerate() {
        match (i / 64) % 7 {
            2 => *v = 0.0,
            4 => *v *= 1.0e-33,
            _ => {}
        }
        match (i as u32).wrapping_mul(2_654_435_761) ^ salt {
            h if h % 211 == 0 => *v = f32::NAN,
            h if h % 223 == 0 => *v = f32::NEG_INFINITY,
            h if h % 227 == 0 => *v = f32::MAX,
            _ => {}
        }
    }
    x
}

/// `hop_int8` and `feedback_int8` where a backend has them (returning `None` is allowed
/// elsewhere): the same steps, codes, sums and residuals as the unfused definition on the
/// scalar backend (a decode added onto a copy and an encode; the error-feedback step
/// formed, encoded and decoded in residual mode), with received codes of every byte value,
/// either rounding, blocks not a multiple of 8 or 32, and draws from an index where a
/// block straddles a 2^32 window.
#[test]
fn fused_int8_hop_and_feedback_match_their_definition() {
    use gradpack::unstable::kernels::{
        self as k, mode, residual_of,
        scalar::{CANONICAL_NAN, Round},
    };
    let bits = |x: &[f32]| -> Vec<u32> {
        x.iter()
            .map(|v| {
                if v.is_nan() {
                    CANONICAL_NAN.to_bits()
                } else {
                    v.to_bits()
                }
            })
            .collect()
    };
    for block in [1usize, 3, 8, 20, 40, 48, 64, 100, 256] {
        for n in [0usize, 1, 31, 33, 100, 1000, 4099] {
            let blocks = n.div_ceil(block);
            let local = int8_fused_input(n, 5);
            let other = int8_fused_input(n, 6);
            let (mut in_steps, mut in_codes) = (vec![0u8; 4 * blocks], vec![0u8; n]);
            let d0 = Draws::new(3, STREAM_ROUNDING, 0);
            Backend::scalar().run(|| {
                k::encode_int8(
                    &other,
                    block,
                    Round::Nearest,
                    &d0,
                    0,
                    &mut in_steps,
                    &mut in_codes,
                )
            });
            for (i, c) in in_codes.iter_mut().enumerate() {
                if i % 5 == 0 {
                    *c = (i * 37) as u8; // every byte value, -128 included
                }
            }
            let input = (in_steps.as_slice(), in_codes.as_slice());
            for round in [Round::Nearest, Round::Stochastic] {
                for first in [0u64, 5, (1 << 32) - 37] {
                    let draws = Draws::new(9, STREAM_ROUNDING, first);
                    let (mut ws, mut wc, mut wsum) =
                        (vec![0u8; 4 * blocks], vec![0u8; n], local.clone());
                    let want_nf = Backend::scalar().run(|| {
                        k::decode_int8::<{ mode::ADD }>(&in_steps, &in_codes, block, &mut wsum);
                        k::encode_int8(&wsum, block, round, &draws, first, &mut ws, &mut wc)
                    });
                    for b in Backend::available() {
                        let (mut s, mut c, mut sum) =
                            (vec![0u8; 4 * blocks], vec![0u8; n], vec![1.5f32; n]);
                        let got = b.run(|| {
                            k::hop_int8(
                                &local, input, block, round, &draws, first, &mut sum, &mut s,
                                &mut c,
                            )
                        });
                        let Some(nf) = got else { continue };
                        let what =
                            format!("hop on {b}, block {block}, n {n}, {round:?}, first {first}");
                        assert_eq!(nf, want_nf, "{what}: non-finite flag");
                        assert!(s == ws && c == wc, "{what}: frame differs");
                        assert!(bits(&sum) == bits(&wsum), "{what}: sum differs");
                    }
                }
            }
            let cases = [
                (1.0f32, 1.0f32, 0u64),
                (0.9, -0.37, 5),
                (1.0, 1.0, (1 << 32) - 37),
            ];
            for ((beta, gamma, first), round) in cases
                .into_iter()
                .flat_map(|c| [(c, Round::Nearest), (c, Round::Stochastic)])
            {
                let draws = Draws::new(9, STREAM_ROUNDING, first);
                let (mut ws, mut wc) = (vec![0u8; 4 * blocks], vec![0u8; n]);
                let p: Vec<f32> = local
                    .iter()
                    .zip(&other)
                    .map(|(&r, &g)| beta * r + gamma * g)
                    .collect();
                let mut d = p.clone();
                let want_nf = Backend::scalar().run(|| {
                    let nf = k::encode_int8(&p, block, round, &draws, first, &mut ws, &mut wc);
                    k::decode_int8::<{ mode::WRITE }>(&ws, &wc, block, &mut d);
                    nf
                });
                let want_r: Vec<f32> = p.iter().zip(&d).map(|(&p, &d)| residual_of(p, d)).collect();
                for b in Backend::available() {
                    let (mut s, mut c, mut r) =
                        (vec![0u8; 4 * blocks], vec![0u8; n], local.clone());
                    let got = b.run(|| {
                        k::feedback_int8(
                            &mut r,
                            &other,
                            (beta, gamma),
                            block,
                            round,
                            &draws,
                            first,
                            &mut s,
                            &mut c,
                        )
                    });
                    let Some(nf) = got else { continue };
                    let what = format!(
                        "feedback on {b}, block {block}, n {n}, beta {beta}, {round:?}, first {first}"
                    );
                    assert_eq!(nf, want_nf, "{what}: non-finite flag");
                    assert!(s == ws && c == wc, "{what}: frame differs");
                    assert!(
                        r.iter()
                            .map(|v| v.to_bits())
                            .eq(want_r.iter().map(|v| v.to_bits())),
                        "{what}: residual differs"
                    );
                }
            }
        }
    }
}

/// `hop_f16` where a backend has it: the same codes and flag as a `mode::ADD` decode onto
/// a copy of the local values and an encode on the scalar backend, with received codes
/// spread over all 65536 values (NaN and ±Inf among them) and sums that overflow binary16.
#[test]
fn fused_fp16_hop_matches_its_definition() {
    use gradpack::unstable::kernels::{self as k, mode};
    for n in [0usize, 1, 7, 8, 9, 100, 4099, 70_000] {
        let local = int8_fused_input(n, 8);
        let input: Vec<u8> = (0..n)
            .flat_map(|i| ((i as u32).wrapping_mul(7919) as u16).to_le_bytes())
            .collect();
        let mut sum = local.clone();
        let mut want = vec![0u8; 2 * n];
        let want_nf = Backend::scalar().run(|| {
            k::decode_f16::<{ mode::ADD }>(&input, &mut sum);
            k::encode_f16(&sum, &mut want)
        });
        for b in Backend::available() {
            let mut got = vec![SENTINEL; 2 * n];
            let Some(nf) = b.run(|| k::hop_f16(&local, &input, &mut got)) else {
                continue;
            };
            assert_eq!(nf, want_nf, "{b}, n {n}: non-finite flag");
            assert!(got == want, "{b}, n {n}: codes differ");
        }
    }
}

/// Inputs for `lane_bound` and `filter_keys`: a mixed sample, subnormals and specials
/// (floats' order and bits' order agree only without NaN), NaN and ±Inf at the start,
/// in the middle and in the part past the last whole step, all equal, and all zero.
fn bound_inputs() -> Vec<(String, Vec<f32>)> {
    let mut v = Vec::new();
    for n in [
        0, 1, 15, 16, 17, 31, 33, 63, 64, 65, 100, 255, 256, 1000, 4096, 4101,
    ] {
        let x = sample(n, 41 + n as u32);
        v.push((format!("sample {n}"), x.clone()));
        for (at, bad) in [
            (0, f32::NAN),
            (n / 2, f32::INFINITY),
            (n.saturating_sub(3), -f32::NAN),
        ] {
            if at < n {
                let mut y = x.clone();
                y[at] = bad;
                v.push((format!("{bad} at {at} of {n}"), y));
            }
        }
        v.push((
            format!("subnormal {n}"),
            (0..n)
                .map(|i| f32::from_bits((i as u32 * 7919) % 0x0080_0000))
                .collect(),
        ));
        v.push((format!("equal {n}"), vec![-2.5; n]));
        v.push((format!("zero {n}"), vec![0.0; n]));
    }
    v
}

#[test]
fn every_backend_bounds_candidates_like_the_oracle() {
    use gradpack::unstable::kernels::{lane_bound, scalar};
    let mut backends = simd_backends();
    backends.push(Backend::scalar());
    for (name, x) in bound_inputs() {
        let keys: Vec<u32> = x.iter().map(|&v| scalar::mag_key(v)).collect();
        for d in 1..=4 {
            let want = scalar::lane_bound(&x, d);
            // The bound's promise: at least min(16 d, n) keys reach it.
            let reach = keys.iter().filter(|&&k| k >= want).count();
            assert!(
                reach >= (16 * d).min(x.len()),
                "{name}, depth {d}: {reach} reach {want:#x}"
            );
            for b in &backends {
                assert_eq!(
                    b.run(|| lane_bound(&x, d)),
                    want,
                    "{name}, depth {d} on {b}"
                );
            }
        }
    }
}

#[test]
fn every_backend_filters_keys_like_the_oracle() {
    use gradpack::unstable::kernels::{filter_keys, scalar};
    let mut backends = simd_backends();
    backends.push(Backend::scalar());
    for (name, x) in bound_inputs() {
        let n = x.len();
        let mut thresholds = mag_thresholds().to_vec();
        thresholds.push(scalar::lane_bound(&x, 4));
        for t in thresholds {
            let (mut oi, mut ok) = (vec![0u32; n + 64], vec![0u32; n + 64]);
            let want = scalar::filter_keys(&x, t, &mut oi, &mut ok);
            let expect: Vec<u32> = (0..n as u32)
                .filter(|&i| scalar::mag_key(x[i as usize]) >= t)
                .collect();
            assert_eq!(oi[..want], expect[..], "{name}, t {t:#x}: oracle");
            for b in &backends {
                // Room for n + 64 entries, then a guard that must stay untouched.
                let (mut idx, mut keys) = (vec![u32::MAX; n + 72], vec![u32::MAX; n + 72]);
                let got = b.run(|| filter_keys(&x, t, &mut idx[..n + 64], &mut keys[..n + 64]));
                assert_eq!(got, want, "{name}, t {t:#x} on {b}: count");
                assert_eq!(idx[..got], oi[..want], "{name}, t {t:#x} on {b}: positions");
                assert_eq!(keys[..got], ok[..want], "{name}, t {t:#x} on {b}: keys");
                assert!(
                    idx[n + 64..]
                        .iter()
                        .chain(&keys[n + 64..])
                        .all(|&v| v == u32::MAX),
                    "{name}, t {t:#x} on {b}: wrote past the room"
                );
            }
        }
    }
}
