//! Golden vectors: one frame per codec and parameter choice, made from a fixed input,
//! pin the wire format. `GRADPACK_BLESS=1 cargo test --test golden` regenerates them
//! (only do that for a deliberate, versioned format change; see tests/vectors/README.md).

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx, Header};

fn bless() -> bool {
    std::env::var_os("GRADPACK_BLESS").is_some_and(|v| v == "1")
}

fn check_or_write(name: &str, bytes: &[u8]) {
    let path = vectors_dir().join(name);
    if bless() {
        std::fs::write(&path, bytes).unwrap();
        return;
    }
    let stored = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run GRADPACK_BLESS=1 cargo test --test golden",
            path.display()
        )
    });
    assert!(
        stored == bytes,
        "{name} differs from what this build produces"
    );
}

#[test]
fn inputs_match_their_documented_generator() {
    check_or_write("input.f32", &f32_bytes(&golden_input()));
    check_or_write("input-nonfinite.f32", &f32_bytes(&golden_input_nonfinite()));
}

#[test]
fn every_vector_encodes_decodes_and_reencodes_identically() {
    for (stem, spec, seed, offset) in GOLDEN {
        let spec: CodecSpec = spec.parse().unwrap();
        for (suffix, x) in [
            ("", golden_input()),
            (".nonfinite", golden_input_nonfinite()),
        ] {
            let ctx = EncodeCtx::new(*seed).with_offset(*offset);
            let frame = spec.encode(&x, &ctx).unwrap();
            check_or_write(&format!("{stem}{suffix}.gpk"), &frame);
            let decoded = decode(&frame, x.len());
            check_or_write(&format!("{stem}{suffix}.out.f32"), &f32_bytes(&decoded));
            if suffix.is_empty() {
                // The same frame sealed with a payload checksum (wire format 1.3).
                let sealed = gradpack::Checksummed(spec).encode(&x, &ctx).unwrap();
                check_or_write(&format!("{stem}.sealed"), &sealed);
            }
            if bless() {
                continue;
            }
            // Decode the stored frame (not ours): it gives the stored output...
            let stored = std::fs::read(vectors_dir().join(format!("{stem}{suffix}.gpk"))).unwrap();
            assert_eq!(
                f32_bytes(&decode(&stored, x.len())),
                f32_bytes(&decoded),
                "{stem}{suffix}"
            );
            // ... and re-encoding the input with only what the frame's header says
            // (codec, parameters, seed, offset) reproduces it byte for byte.
            let (h, from_header) = gradpack::inspect(&stored).unwrap();
            let again = from_header
                .encode(&x, &EncodeCtx::new(*seed).with_offset(h.offset))
                .unwrap();
            assert_eq!(again, stored, "{stem}{suffix}: re-encode from header");
            if h.seed != 0 {
                assert_eq!(h.seed, *seed);
            }
            check_bound(&spec, &x, &decoded, &ctx).unwrap_or_else(|e| {
                assert!(suffix == ".nonfinite", "{e}");
            });
        }
    }
}

/// `lossless` frames of the golden inputs (300 elements) store their exponents as they
/// are (mode 0): `lossless_huffman` (the golden input eight times over, copy k scaled
/// by 2^-k) takes the Huffman mode and `lossless_one` (1000 times 0.375) the
/// one-symbol mode; `lossless_bf16` and `lossless_fp16` are the tiled input rounded to
/// bf16 and fp16 (by those codecs; what overflows set to 0) in `lossless:dtype=bf16` and `dtype=fp16`.
/// The golden input is 10.7% +0.0, short of the eighth that takes the zeros section;
/// `lossless_zeros`, `lossless_bf16_zeros` and `lossless_fp16_zeros` are the tiled inputs
/// with every third value +0.0, which take it. Each decodes to its input's bits.
#[test]
fn lossless_frames_of_each_entropy_mode() {
    let base = golden_input();
    let tiled: Vec<f32> = (0..8)
        .flat_map(|k| base.iter().map(move |v| v * 2f32.powi(-k)))
        .collect();
    // The tiled input as bf16 and fp16 values (the plain codecs' decodes).
    let as_type = |t: &str| {
        let c: CodecSpec = t.parse().unwrap();
        let x = decode(&c.encode(&tiled, &EncodeCtx::new(0)).unwrap(), tiled.len());
        // The values past the type's range (now ±Inf) set to zero: a finite input.
        x.into_iter()
            .map(|v| if v.is_finite() { v } else { 0.0 })
            .collect::<Vec<f32>>()
    };
    let (bf, fp) = (as_type("bf16"), as_type("fp16"));
    // The tiled inputs with every third value +0.0: the zeros section.
    let sparse_of = |x: &[f32]| -> Vec<f32> {
        x.iter()
            .enumerate()
            .map(|(i, &v)| if i % 3 == 0 { 0.0 } else { v })
            .collect()
    };
    let (sparse, sparse_bf, sparse_fp) = (sparse_of(&tiled), sparse_of(&bf), sparse_of(&fp));
    for (stem, spec, x, mode) in [
        ("lossless_huffman", "lossless", tiled, 2u8),
        ("lossless_one", "lossless", vec![0.375f32; 1000], 1),
        ("lossless_bf16", "lossless:dtype=bf16", bf, 2),
        ("lossless_fp16", "lossless:dtype=fp16", fp, 2),
        ("lossless_zeros", "lossless", sparse, 2),
        ("lossless_bf16_zeros", "lossless:dtype=bf16", sparse_bf, 2),
        ("lossless_fp16_zeros", "lossless:dtype=fp16", sparse_fp, 2),
    ] {
        let frame = spec
            .parse::<CodecSpec>()
            .unwrap()
            .encode(&x, &EncodeCtx::new(0))
            .unwrap();
        assert_eq!(frame[gradpack::HEADER_LEN], mode, "{stem}");
        let zeros = Header::parse(&frame).unwrap().params[1];
        assert_eq!(
            zeros == 1,
            stem.ends_with("_zeros"),
            "{stem}: the zeros section"
        );
        check_or_write(&format!("{stem}.gpk"), &frame);
        check_or_write(&format!("{stem}.out.f32"), &f32_bytes(&x));
        assert_eq!(f32_bytes(&decode(&frame, x.len())), f32_bytes(&x), "{stem}");
    }
}

/// Staged `int8` frames in each entropy mode: the golden input eight times over (copy k
/// scaled by 2^-k) in blocks of 16 takes the Huffman mode with streams aligned to 16 code
/// bytes, 1000 times 0.375 the one-symbol mode (every code 127), and the first 100
/// elements of the golden input the stored mode (fewer codes than a Huffman header). Each decodes to the
/// same bits as the frame without the stage.
#[test]
fn staged_frames_of_each_entropy_mode() {
    let base = golden_input();
    let tiled: Vec<f32> = (0..8)
        .flat_map(|k| base.iter().map(move |v| v * 2f32.powi(-k)))
        .collect();
    for (stem, spec, x, mode) in [
        ("int8_b16_entropy_huffman", "int8:block=16", tiled, 2u8),
        ("int8_entropy_one", "int8", vec![0.375f32; 1000], 1),
        ("int8_entropy_stored", "int8", base[..100].to_vec(), 0),
    ] {
        let plain: CodecSpec = spec.parse().unwrap();
        let staged = plain.with_entropy(true).unwrap();
        let frame = staged.encode(&x, &EncodeCtx::new(0)).unwrap();
        let scales = 4 * x.len().div_ceil(block_of(&plain));
        assert_eq!(frame[gradpack::HEADER_LEN + scales], mode, "{stem}");
        let want = decode(&plain.encode(&x, &EncodeCtx::new(0)).unwrap(), x.len());
        check_or_write(&format!("{stem}.gpk"), &frame);
        check_or_write(&format!("{stem}.out.f32"), &f32_bytes(&want));
        assert_eq!(
            f32_bytes(&decode(&frame, x.len())),
            f32_bytes(&want),
            "{stem}"
        );
    }
}

/// Frames no encoder writes, whose decoding the wire format still fixes bit for bit: the
/// golden frames of the step codecs with their first steps overwritten by NaNs (signalling
/// and quiet, both signs, with payloads). `NAME.nan_steps.gpk` decodes to
/// `NAME.nan_steps.out.f32`; the spec decoder checks both, and that the same frame with
/// an infinite step is refused.
#[test]
fn crafted_nan_steps_decode_to_the_stored_bits() {
    const NANS: [u32; 4] = [0x7F80_0001, 0xFFA1_2345, 0x7FC0_0000, 0xFFFF_FFFF];
    for stem in [
        "int8_b64",
        "qsgd4_b64",
        "qsgd2_b64",
        "sign_b64",
        "ternary_b64",
        "topk_r09_int8",
    ] {
        let (_, spec, seed, offset) = GOLDEN.iter().find(|g| g.0 == stem).unwrap();
        let spec: CodecSpec = spec.parse().unwrap();
        let x = golden_input();
        let mut frame = spec
            .encode(&x, &EncodeCtx::new(*seed).with_offset(*offset))
            .unwrap();
        // top-k int8 has 2 value blocks; the block codecs have 5 of 64 elements.
        for (b, nan) in NANS
            .iter()
            .enumerate()
            .take(if stem.starts_with("topk") { 2 } else { 4 })
        {
            let at = gradpack::HEADER_LEN + 4 * b;
            frame[at..at + 4].copy_from_slice(&nan.to_le_bytes());
        }
        let decoded = decode(&frame, x.len());
        let nans = decoded.iter().filter(|v| v.is_nan()).count();
        assert!(nans >= 100, "{stem}: {nans} NaNs");
        check_or_write(&format!("{stem}.nan_steps.gpk"), &frame);
        check_or_write(&format!("{stem}.nan_steps.out.f32"), &f32_bytes(&decoded));
    }
}
