//! A small pass over every public path, sized for Miri: `.ci/run` runs it (with the
//! library's unit tests and `tests/fuzz_regressions.rs`) under `cargo +nightly miri test`,
//! where backend detection returns scalar, so Miri checks the scalar oracle and all the
//! safe code around it for undefined behaviour. Natively it runs on the best backend.
//!
//! Each case asserts a real property (the documented bound, exact re-encoding, errors
//! that leave outputs untouched), so it is also an ordinary, fast test.

mod common;

use common::*;
use gradpack::collective::{AllReduce, AllReduceOptions, ReduceOp, Strategy, StrategyChoice};
use gradpack::{
    Checksummed, Codec, CodecSpec, EncodeCtx, Error, ErrorFeedback, FeedbackOptions, HEADER_LEN,
};

/// Elements per case: enough for several blocks of 64 plus a tail.
const N: usize = if cfg!(miri) { 70 } else { 700 };

#[test]
fn backend_is_scalar_under_miri() {
    let b = gradpack::Backend::current();
    if cfg!(miri) {
        assert_eq!(b.name(), "scalar");
        assert_eq!(gradpack::Backend::available().len(), 1);
    } else {
        eprintln!("native run: backend {b}");
    }
}

#[test]
fn every_codec_round_trips_within_its_bound() {
    let x = sample(N, 3);
    for spec in specs() {
        let ctx = EncodeCtx::new(9).with_offset(5);
        let max = spec.max_encoded_len(x.len());
        let mut frame = vec![0xA5u8; max + 3];
        let len = spec.encode_into(&x, &ctx, &mut frame).unwrap();
        assert!(len <= max, "{spec}");
        assert!(
            frame[max..].iter().all(|&b| b == 0xA5),
            "{spec}: wrote past max_encoded_len"
        );
        let frame = &frame[..len];
        let d = decode(frame, x.len());
        check_bound(&spec, &x, &d, &ctx).unwrap();
        // decode_add is acc + decode.
        let mut acc = vec![0.25f32; x.len()];
        spec.decode_add(frame, &mut acc).unwrap();
        for i in 0..x.len() {
            assert_eq!(
                acc[i].to_bits(),
                (0.25 + d[i]).to_bits(),
                "{spec} element {i}"
            );
        }
        // Re-encoding from the header alone gives the same bytes.
        let (h, from_header) = gradpack::inspect(frame).unwrap();
        let again = from_header
            .encode(&x, &EncodeCtx::new(h.seed).with_offset(h.offset))
            .unwrap();
        assert_eq!(again, frame, "{spec}");
        // Sealed: the same payload, the same decoding.
        let sealed = Checksummed(spec).encode(&x, &ctx).unwrap();
        assert_eq!(sealed[HEADER_LEN..len], frame[HEADER_LEN..]);
        assert_eq!(f32_bytes(&decode(&sealed, x.len())), f32_bytes(&d));
    }
}

#[test]
fn errors_leave_outputs_untouched() {
    let x = sample(N, 4);
    for spec in specs() {
        let frame = encode(&spec, &x, &EncodeCtx::new(2));
        // Too small a buffer: an error, not a panic or a short frame.
        let mut small = vec![0u8; HEADER_LEN - 1];
        assert!(matches!(
            spec.encode_into(&x, &EncodeCtx::new(2), &mut small),
            Err(Error::BufferTooSmall { .. })
        ));
        // A wrong output length, every truncation and a payload flip of a sealed frame.
        let acc0 = vec![1.5f32; x.len()];
        let mut acc = acc0.clone();
        assert!(gradpack::decode_add(&frame, &mut acc[..x.len() - 1]).is_err());
        let step = if cfg!(miri) { 7 } else { 1 };
        for cut in (0..frame.len()).step_by(step) {
            assert!(
                gradpack::decode_add(&frame[..cut], &mut acc).is_err(),
                "{spec} cut {cut}"
            );
        }
        let mut sealed = Checksummed(spec).encode(&x, &EncodeCtx::new(2)).unwrap();
        let last = sealed.len() - 5;
        sealed[last] ^= 0x20;
        assert!(matches!(
            gradpack::decode_add(&sealed, &mut acc),
            Err(Error::PayloadChecksum { .. })
        ));
        assert_eq!(
            f32_bytes(&acc),
            f32_bytes(&acc0),
            "{spec}: acc touched on error"
        );
    }
}

#[test]
fn error_feedback_conserves_what_it_does_not_send() {
    // g + old residual = decode(frame) + new residual, to f32 rounding, for every codec.
    // Without the f32::MAX-sized specials, whose sum with the residual overflows.
    let g: Vec<f32> = sample(N, 5)
        .into_iter()
        .map(|v| if v.abs() > 1e4 { 1.0 } else { v })
        .collect();
    let opts = FeedbackOptions {
        allow_non_contractive: true,
        ..FeedbackOptions::default()
    };
    for spec in specs() {
        let mut ef = ErrorFeedback::with_options(spec, g.len(), opts).unwrap();
        for step in 0..2u64 {
            let before = ef.residual_f32();
            let frame = ef.encode(&g, &EncodeCtx::new(step)).unwrap();
            let d = decode(&frame, g.len());
            let after = ef.residual_f32();
            for i in 0..g.len() {
                let p = g[i] as f64 + before[i] as f64;
                if !p.is_finite() || p.abs() > 6e4 {
                    continue;
                }
                let got = d[i] as f64 + after[i] as f64;
                let tol = 1e-6 * (p.abs() + d[i].abs() as f64) + 1e-30;
                assert!(
                    (got - p).abs() <= tol,
                    "{spec} step {step} element {i}: {got} vs {p}"
                );
            }
        }
    }
}

#[test]
fn three_ranks_all_reduce_identically() {
    let n = if cfg!(miri) { 40 } else { 400 };
    for spec in [
        "int8:block=16",
        "topk:ratio=0.2,values=fp16",
        "sign:block=8",
    ] {
        let codec: CodecSpec = spec.parse().unwrap();
        for s in [Strategy::CompressedRing, Strategy::CompressedAllGather] {
            let opts = AllReduceOptions {
                op: ReduceOp::Sum,
                strategy: StrategyChoice::Forced(s),
                checksum: true,
                ..Default::default()
            };
            let outs = gradpack::collective::local::run(3, None, |mut t| {
                let rank = gradpack::collective::Transport::rank(&t);
                let mut ar = AllReduce::new(codec, n, &t, opts.clone())?;
                let x = sample(n, rank as u32 + 10);
                let mut out = vec![0f32; n];
                ar.run(&mut t, &x, &mut out, 1)?;
                Ok(out)
            });
            let outs: Vec<Vec<f32>> = outs.into_iter().map(Result::unwrap).collect();
            for o in &outs[1..] {
                assert_eq!(f32_bytes(o), f32_bytes(&outs[0]), "{spec} {}", s.name());
            }
        }
    }
}

#[test]
fn entropy_coded_frames_round_trip() {
    // Long enough for the Huffman mode: each of the four streams takes its symbols five
    // at a time, and decodes them in the four streams' lockstep loop (at least 16 a
    // stream) and alone; the exponents span a few binades, so codes are short. Under
    // Miri, `lossless` alone (the staged int8's long codes take the safe loop).
    let n = if cfg!(miri) { 400 } else { 1200 };
    let x: Vec<f32> = (0..n)
        .map(|i| {
            let h = gradpack::rng::lowbias32(i as u32);
            f32::from_bits((124 + h % 5) << 23 | (h >> 9))
        })
        .collect();
    let ctx = EncodeCtx::new(0);
    let lossless = CodecSpec::parse("lossless").unwrap();
    let frame = lossless.encode(&x, &ctx).unwrap();
    assert_eq!(frame[HEADER_LEN], 2, "the exponents' block in Huffman mode");
    assert_eq!(f32_bytes(&decode(&frame, n)), f32_bytes(&x));
    let mut frames = vec![frame];
    if !cfg!(miri) {
        let staged = CodecSpec::parse("int8:entropy=on").unwrap();
        let staged = staged.encode(&x, &ctx).unwrap();
        let plain = CodecSpec::parse("int8").unwrap().encode(&x, &ctx).unwrap();
        // The Huffman mode (the stored one would make the frame a byte longer).
        assert!(
            staged.len() < plain.len(),
            "{} of {}",
            staged.len(),
            plain.len()
        );
        let (d, want) = (decode(&staged, n), decode(&plain, n));
        assert_eq!(f32_bytes(&d), f32_bytes(&want));
        frames.push(staged);
    }
    for frame in &frames {
        let d = decode(frame, n);
        let mut acc = vec![0.5f32; n];
        gradpack::decode_add(frame, &mut acc).unwrap();
        for i in 0..n {
            assert_eq!(acc[i].to_bits(), (0.5 + d[i]).to_bits(), "element {i}");
        }
    }
}
