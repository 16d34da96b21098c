//! Round trips of every codec within the bound it documents, at the boundary lengths and
//! on property-generated inputs, plus the buffer contracts of the hot-path API.

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx, Error};
use proptest::prelude::*;

fn round_trip(spec: &CodecSpec, x: &[f32], ctx: &EncodeCtx) -> Result<(), String> {
    let frame = spec
        .encode(x, ctx)
        .map_err(|e| format!("{spec}: encode: {e}"))?;
    if frame.len() > spec.max_encoded_len(x.len()) {
        return Err(format!("{spec}: frame longer than max_encoded_len"));
    }
    let d = decode(&frame, x.len());
    check_bound(spec, x, &d, ctx)?;
    // The codec's own decode agrees with the free one, bit for bit.
    let own = spec.decode(&frame).map_err(|e| e.to_string())?;
    if own.iter().zip(&d).any(|(a, b)| a.to_bits() != b.to_bits()) {
        return Err(format!(
            "{spec}: Codec::decode differs from gradpack::decode"
        ));
    }
    // decode_add adds exactly the decoded values.
    let mut acc: Vec<f32> = (0..x.len()).map(|i| i as f32 * 0.25 - 3.0).collect();
    let want: Vec<u32> = acc.iter().zip(&d).map(|(a, b)| (a + b).to_bits()).collect();
    gradpack::decode_add(&frame, &mut acc).map_err(|e| e.to_string())?;
    if acc.iter().map(|v| v.to_bits()).ne(want) {
        return Err(format!("{spec}: decode_add is not acc + decode"));
    }
    // Encoding is a function of (input, ctx).
    if spec.encode(x, ctx).unwrap() != frame {
        return Err(format!("{spec}: encoding twice gave different frames"));
    }
    Ok(())
}

#[test]
fn every_codec_round_trips_at_boundary_lengths() {
    for spec in specs() {
        for n in boundary_lengths(block_of(&spec)) {
            for salt in 0..3 {
                let x = sample(n, salt);
                let ctx = EncodeCtx::new(salt as u64 * 77 + 1).with_offset(salt as u64 * 1000);
                round_trip(&spec, &x, &ctx).unwrap_or_else(|e| panic!("n = {n}: {e}"));
            }
        }
    }
}

#[test]
fn special_values_round_trip() {
    for spec in specs() {
        let x: Vec<f32> = SPECIALS.iter().copied().cycle().take(200).collect();
        round_trip(&spec, &x, &EncodeCtx::new(5)).unwrap();
        // Each special alone, and next to ordinary values.
        for &s in SPECIALS {
            round_trip(&spec, &[s], &EncodeCtx::new(1)).unwrap();
            let mut x = sample(130, 9);
            x[64] = s;
            round_trip(&spec, &x, &EncodeCtx::new(2)).unwrap();
        }
    }
}

#[test]
fn all_zero_blocks_decode_to_exact_zeros() {
    for spec in specs() {
        let x = vec![0.0f32; 300];
        let d = decode(&spec.encode(&x, &EncodeCtx::new(3)).unwrap(), 300);
        assert!(d.iter().all(|v| *v == 0.0), "{spec}");
    }
}

#[test]
fn nothing_is_written_past_the_frame() {
    for spec in specs() {
        for n in [0, 1, 65, 200] {
            let x = sample(n, 4);
            let ctx = EncodeCtx::new(8);
            let max = spec.max_encoded_len(n);
            let mut buf = vec![0xA5u8; max + 64];
            let len = spec.encode_into(&x, &ctx, &mut buf[..max]).unwrap();
            // Top-k and chunked top-k keep candidates in the buffer past the frame, the
            // entropy stage its codes, lossless its exponents (documented).
            let room = spec.entropy()
                || matches!(
                    spec.id(),
                    gradpack::CodecId::TopK
                        | gradpack::CodecId::ChunkTopK
                        | gradpack::CodecId::Lossless
                );
            let untouched = if room { max } else { len };
            assert!(
                buf[untouched..].iter().all(|&b| b == 0xA5),
                "{spec} n = {n}"
            );
            if spec.entropy() {
                // The stage needs its room: one byte short of it is an error.
                let mut short = vec![0u8; max - 1];
                assert!(
                    matches!(
                        spec.encode_into(&x, &ctx, &mut short),
                        Err(Error::BufferTooSmall { .. })
                    ),
                    "{spec} n = {n}"
                );
                continue;
            }
            // A buffer of exactly the frame length suffices (top-k: with no working room,
            // by its multi-pass engine, to the same bytes); one byte less does not.
            let mut exact = vec![0u8; len];
            assert_eq!(spec.encode_into(&x, &ctx, &mut exact).unwrap(), len);
            assert_eq!(&exact[..], &buf[..len]);
            let mut short = vec![0u8; len - 1];
            assert!(
                matches!(
                    spec.encode_into(&x, &ctx, &mut short),
                    Err(Error::BufferTooSmall { .. })
                ),
                "{spec} n = {n}"
            );
        }
    }
}

#[test]
fn output_of_wrong_length_is_an_error() {
    for spec in specs() {
        let frame = spec.encode(&sample(100, 1), &EncodeCtx::new(1)).unwrap();
        for len in [0, 99, 101] {
            let mut out = vec![7.0f32; len];
            assert_eq!(
                gradpack::decode(&frame, &mut out),
                Err(Error::OutputLength {
                    expected: 100,
                    got: len
                })
            );
            assert_eq!(
                gradpack::decode_add(&frame, &mut out),
                Err(Error::OutputLength {
                    expected: 100,
                    got: len
                })
            );
            assert!(out.iter().all(|&v| v == 7.0));
        }
    }
}

#[test]
fn header_records_codec_count_seed_and_offset() {
    for spec in specs() {
        let ctx = EncodeCtx::new(99).with_offset(12345);
        let frame = spec.encode(&sample(70, 2), &ctx).unwrap();
        let (h, parsed) = gradpack::inspect(&frame).unwrap();
        assert_eq!(h.codec, spec.id());
        assert_eq!(h.elements, 70);
        assert_eq!(h.offset, 12345);
        assert_eq!(h.frame_len(), Some(frame.len() as u64));
        assert_eq!(parsed.id(), spec.id());
        let stochastic = matches!(
            spec,
            CodecSpec::Qsgd(_)
                | CodecSpec::Ternary(_)
                | CodecSpec::Natural(_)
                | CodecSpec::RandK(_)
        ) || spec.to_string().contains("stochastic");
        assert_eq!(h.seed, if stochastic { 99 } else { 0 }, "{spec}");
        // A frame's header spec decodes it through the codec interface too.
        let mut out = vec![0.0; 70];
        parsed.decode_into(&frame, &mut out).unwrap();
    }
}

#[test]
fn a_codec_rejects_frames_of_another_codec() {
    let frame = "fp16"
        .parse::<CodecSpec>()
        .unwrap()
        .encode(&[1.0], &EncodeCtx::new(0))
        .unwrap();
    let int8: CodecSpec = "int8".parse().unwrap();
    let mut out = [0.0f32];
    assert!(matches!(
        int8.decode_into(&frame, &mut out),
        Err(Error::WrongCodec { .. })
    ));
    // ... but a codec accepts its own frames written with other parameters.
    let f64b = "int8:block=64"
        .parse::<CodecSpec>()
        .unwrap()
        .encode(&[1.0], &EncodeCtx::new(0))
        .unwrap();
    int8.decode_into(&f64b, &mut out).unwrap();
    assert_eq!(out[0], 1.0);
}

#[test]
fn deterministic_16_bit_codecs_reencode_their_decoding_identically() {
    for s in ["identity", "fp16", "bf16"] {
        let spec: CodecSpec = s.parse().unwrap();
        // Inputs within fp16's range: an overflow to Inf would (rightly) set NONFINITE.
        let x: Vec<f32> = sample(500, 3).iter().map(|v| v.clamp(-6e4, 6e4)).collect();
        let frame = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
        let d = decode(&frame, 500);
        assert_eq!(spec.encode(&d, &EncodeCtx::new(0)).unwrap(), frame, "{s}");
    }
}

#[test]
fn chunked_encoding_decodes_to_the_whole_encoding() {
    // Block-aligned chunks with their global offsets draw the same random numbers.
    for spec in specs() {
        if matches!(spec, CodecSpec::TopK(_)) {
            continue; // top-k selects over the whole slice by definition
        }
        if scaled_per_frame(&spec) {
            continue; // a scale taken from the whole frame
        }
        let b = block_of(&spec);
        let n = 5 * b + 17;
        let x = sample(n, 6);
        let ctx = EncodeCtx::new(31).with_offset(1 << 20);
        let whole = decode(&spec.encode(&x, &ctx).unwrap(), n);
        let mut pieces = Vec::new();
        for (c, chunk) in x.chunks(2 * b).enumerate() {
            let cctx = ctx.with_offset(ctx.offset + (c * 2 * b) as u64);
            pieces.extend(decode(&spec.encode(chunk, &cctx).unwrap(), chunk.len()));
        }
        assert!(
            whole
                .iter()
                .zip(&pieces)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{spec}"
        );
    }
}

#[test]
fn random_draws_cross_a_2_pow_32_index_window() {
    for spec in specs() {
        let x = sample(300, 8);
        let ctx = EncodeCtx::new(4).with_offset((1u64 << 32) - 150);
        round_trip(&spec, &x, &ctx).unwrap();
    }
}

#[test]
fn boxed_codecs_work_as_trait_objects() {
    let codecs: Vec<Box<dyn Codec>> = vec![
        Box::new(gradpack::Fp16),
        Box::new(gradpack::Int8::new(128, gradpack::Rounding::Stochastic).unwrap()),
        Box::new(gradpack::Qsgd::new(8, 256).unwrap()),
        Box::new(
            gradpack::TopK::new(gradpack::TopKSelect::Count(3), gradpack::ValueType::Fp16).unwrap(),
        ),
    ];
    let x = sample(300, 1);
    for c in &codecs {
        let f = c.encode(&x, &EncodeCtx::new(1)).unwrap();
        let d = c.decode(&f).unwrap();
        check_bound(&c.spec(), &x, &d, &EncodeCtx::new(1)).unwrap();
    }
}

fn finite_f32() -> impl Strategy<Value = f32> {
    use proptest::num::f32 as pf;
    prop_oneof![
        8 => -10.0f32..10.0,
        2 => pf::NORMAL | pf::SUBNORMAL | pf::ZERO | pf::POSITIVE | pf::NEGATIVE,
        1 => proptest::sample::select(SPECIALS.to_vec()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn prop_every_codec_round_trips(
        x in proptest::collection::vec(finite_f32(), 0..700),
        seed in any::<u64>(),
        offset in 0u64..(1 << 40),
    ) {
        let ctx = EncodeCtx::new(seed).with_offset(offset);
        for spec in specs() {
            if let Err(e) = round_trip(&spec, &x, &ctx) {
                prop_assert!(false, "{}", e);
            }
        }
    }

    #[test]
    fn prop_block_codecs_with_any_block_size(
        x in proptest::collection::vec(finite_f32(), 0..400),
        block in 1usize..300,
        seed in any::<u64>(),
    ) {
        let ctx = EncodeCtx::new(seed);
        for s in ["int8", "int8:rounding=stochastic", "qsgd:bits=2", "qsgd:bits=8", "sign", "ternary", "natural"] {
            let spec: CodecSpec = format!("{s}{}block={block}", if s.contains(':') { "," } else { ":" }).parse().unwrap();
            if let Err(e) = round_trip(&spec, &x, &ctx) {
                prop_assert!(false, "{}", e);
            }
        }
    }

    #[test]
    fn prop_topk_any_k(
        x in proptest::collection::vec(finite_f32(), 0..400),
        k in 0u64..450,
    ) {
        for values in ["f32", "fp16"] {
            let spec: CodecSpec = format!("topk:k={k},values={values}").parse().unwrap();
            if let Err(e) = round_trip(&spec, &x, &EncodeCtx::new(0)) {
                prop_assert!(false, "{}", e);
            }
        }
    }
}

#[test]
fn randk_frames_of_ranks_sharing_a_seed_add_value_by_value() {
    use gradpack::RandK;
    for spec in [
        "randk:ratio=0.1",
        "randk:ratio=0.3,values=fp16",
        "randk:ratio=0.05,values=bf16,scale=unbiased",
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        for (n, offset) in [(0, 0), (1, 3), (1000, 0), (5000, (1u64 << 32) - 2000)] {
            let ctx = EncodeCtx::new(77).with_offset(offset);
            let ranks: Vec<Vec<f32>> = (0..4).map(|r| sample(n, 90 + r)).collect();
            let mut acc = spec.encode(&ranks[0], &ctx).unwrap();
            let mut want = decode(&acc, n);
            for x in &ranks[1..] {
                let f = spec.encode(x, &ctx).unwrap();
                let d = decode(&f, n);
                RandK::add_frame(&mut acc, &f).unwrap();
                for (w, v) in want.iter_mut().zip(&d) {
                    // One rounding to the value type per addition.
                    let s = *w + v;
                    *w = match spec {
                        CodecSpec::RandK(c) => match c.values() {
                            gradpack::ValueType::Fp16 => half::f16::from_f32(s).to_f32(),
                            gradpack::ValueType::Bf16 => half::bf16::from_f32(s).to_f32(),
                            _ => s,
                        },
                        _ => unreachable!(),
                    };
                }
                let got = decode(&acc, n);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(g, w)| g.to_bits() == w.to_bits()),
                    "{spec} n={n}: the summed frame decodes differently"
                );
            }
            // A sealed accumulator stays sealed and valid.
            let f = spec.encode(&ranks[1], &ctx).unwrap();
            let mut sealed = gradpack::Checksummed(spec).encode(&ranks[0], &ctx).unwrap();
            RandK::add_frame(&mut sealed, &f).unwrap();
            let plain = {
                let mut a = spec.encode(&ranks[0], &ctx).unwrap();
                RandK::add_frame(&mut a, &f).unwrap();
                a
            };
            let bits = |f: &[u8]| decode(f, n).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&sealed) == bits(&plain),
                "{spec} n={n}: sealed sum differs"
            );
            assert!(gradpack::inspect(&sealed).unwrap().0.payload_checksum());
        }
    }
}

#[test]
fn randk_frames_that_keep_different_elements_do_not_add() {
    use gradpack::RandK;
    let spec: CodecSpec = "randk:ratio=0.1".parse().unwrap();
    let x = sample(1000, 5);
    let base = spec.encode(&x, &EncodeCtx::new(1)).unwrap();
    let other_spec: CodecSpec = "randk:ratio=0.1,values=fp16".parse().unwrap();
    let bad = [
        spec.encode(&x, &EncodeCtx::new(2)).unwrap(), // seed
        spec.encode(&x, &EncodeCtx::new(1).with_offset(5)).unwrap(), // offset
        spec.encode(&x[..999], &EncodeCtx::new(1)).unwrap(), // elements
        other_spec.encode(&x, &EncodeCtx::new(1)).unwrap(), // value type
        "randk:ratio=0.2"
            .parse::<CodecSpec>()
            .unwrap()
            .encode(&x, &EncodeCtx::new(1))
            .unwrap(),
        "topk:ratio=0.1"
            .parse::<CodecSpec>()
            .unwrap()
            .encode(&x, &EncodeCtx::new(1))
            .unwrap(),
        base[..base.len() - 1].to_vec(), // truncated
    ];
    for (i, f) in bad.iter().enumerate() {
        let mut acc = base.clone();
        let e = RandK::add_frame(&mut acc, f).unwrap_err();
        assert!(!e.to_string().is_empty());
        assert_eq!(acc, base, "case {i}: acc changed on error");
        let mut acc = f.clone();
        assert!(
            RandK::add_frame(&mut acc, &base).is_err(),
            "case {i} reversed"
        );
        assert_eq!(&acc, f);
    }
}
