//! `lossless`: every f32 comes back with its bits, a gradient's frame is smaller than
//! identity's, and forged or damaged entropy blocks are errors (never a panic, never a
//! changed output).

mod common;

use common::*;
use gradpack::{Codec, CodecSpec, EncodeCtx, HEADER_LEN, Header};

fn lossless() -> CodecSpec {
    "lossless".parse().unwrap()
}

fn same_bits(x: &[f32], d: &[f32]) {
    assert_eq!(x.len(), d.len());
    for (i, (a, b)) in x.iter().zip(d).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "element {i}: {a:e} became {b:e}");
    }
}

/// A xorshift stream of u32s.
fn words(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 16) as u32
        })
        .collect()
}

#[test]
fn every_exponent_with_random_signs_and_mantissas_comes_back_bit_for_bit() {
    let c = lossless();
    // Every exponent (zeros and subnormals, normals, Inf and NaN payloads), 64 random
    // sign-and-mantissa patterns each, in every mix: alone, beside one other, and all.
    let w = words(7, 256 * 64);
    let of = |e: u32, k: usize| f32::from_bits((w[e as usize * 64 + k] & 0x807F_FFFF) | e << 23);
    let all: Vec<f32> = (0..256)
        .flat_map(|e| (0..64).map(move |k| (e, k)))
        .map(|(e, k)| of(e, k))
        .collect();
    for n in [all.len(), 1000, 145, 3] {
        let frame = c.encode(&all[..n], &EncodeCtx::new(0)).unwrap();
        same_bits(&all[..n], &c.decode(&frame).unwrap());
    }
    for e in 0..256u32 {
        let x: Vec<f32> = (0..64).map(|k| of(e, k)).collect();
        let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
        same_bits(&x, &c.decode(&frame).unwrap());
        let mut two: Vec<f32> = (0..300)
            .map(|k| of(if k % 3 == 0 { e } else { 127 }, k % 64))
            .collect();
        two[299] = -0.0;
        let frame = c.encode(&two, &EncodeCtx::new(0)).unwrap();
        same_bits(&two, &c.decode(&frame).unwrap());
    }
}

#[test]
fn random_bit_patterns_at_many_lengths_come_back_and_add_exactly() {
    let c = lossless();
    for (seed, n) in [
        (1u64, 0usize),
        (2, 1),
        (3, 4),
        (4, 5),
        (5, 21),
        (6, 4097),
        (7, 20_011),
        (8, 70_000),
    ] {
        let x: Vec<f32> = words(seed, n).into_iter().map(f32::from_bits).collect();
        let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
        same_bits(&x, &c.decode(&frame).unwrap());
        // decode_add adds the exact values.
        let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
        let mut acc = base.clone();
        c.decode_add(&frame, &mut acc).unwrap();
        let want: Vec<f32> = base.iter().zip(&x).map(|(a, b)| a + b).collect();
        same_bits(&want, &acc);
    }
}

#[test]
fn a_gradients_frame_is_smaller_than_identitys_and_a_constant_one_is_tiny() {
    let c = lossless();
    let n = 1 << 16;
    let g = gradpack::synthetic::gradient(n, 3);
    let frame = c.encode(&g, &EncodeCtx::new(0)).unwrap();
    same_bits(&g, &c.decode(&frame).unwrap());
    let ratio = (frame.len() - HEADER_LEN) as f64 / (4 * n) as f64;
    // Sign and mantissa are 24 of 32 bits; the exponents of a gradient take about 3.
    assert!(
        ratio > 0.75 && ratio < 0.88,
        "payload {ratio:.3} of identity's"
    );
    let k = vec![0.5f32; n];
    let frame = c.encode(&k, &EncodeCtx::new(0)).unwrap();
    assert_eq!(frame.len() - HEADER_LEN, 2 + 3 * n, "one-symbol mode");
    same_bits(&k, &c.decode(&frame).unwrap());
}

/// A frame of `x` and the offset of its entropy block's first byte.
fn frame_of(x: &[f32]) -> Vec<u8> {
    lossless().encode(x, &EncodeCtx::new(0)).unwrap()
}

/// `frame` with its payload replaced, the header's payload length and CRC fixed up.
fn with_payload(frame: &[u8], payload: Vec<u8>) -> Vec<u8> {
    let mut h = Header::parse(frame).unwrap();
    h.payload_len = payload.len() as u64;
    let mut f = vec![0u8; HEADER_LEN];
    h.write(&mut f);
    f.extend(payload);
    f
}

/// Every decoder refuses `frame` (see [`refused_by`]).
fn refused(frame: &[u8], n: usize, what: &str, why: &str) {
    refused_by(&lossless(), frame, n, what, why);
}

#[test]
fn forged_and_damaged_entropy_blocks_are_refused_and_change_nothing() {
    let n = 20_000;
    let g = gradpack::synthetic::gradient(n, 5);
    let frame = frame_of(&g);
    let p = frame[HEADER_LEN..].to_vec();
    assert_eq!(p[0], 2, "a gradient's exponents take the Huffman mode");
    let lens: Vec<u8> = (0..256)
        .map(|s| (p[1 + s / 2] >> (4 * (s % 2))) & 15)
        .collect();
    let used: Vec<usize> = (0..256).filter(|&s| lens[s] > 0).collect();
    let size = |j: usize| u32::from_le_bytes(p[129 + 4 * j..133 + 4 * j].try_into().unwrap());

    // A code length over 11.
    let mut q = p.clone();
    let s = used[0];
    q[1 + s / 2] = (q[1 + s / 2] & !(15 << (4 * (s % 2)))) | 12 << (4 * (s % 2));
    refused(&with_payload(&frame, q), n, "length 12", "over 11");
    // Lengths whose sum of 2^-len is not 1: one symbol's code made longer (a gap) or a
    // new symbol added (over-full).
    let mut q = p.clone();
    let s = *used.iter().find(|&&s| lens[s] < 11).unwrap();
    q[1 + s / 2] += 1 << (4 * (s % 2));
    refused(
        &with_payload(&frame, q),
        n,
        "incomplete code",
        "prefix code",
    );
    let mut q = p.clone();
    let s = (0..256).find(|&s| lens[s] == 0).unwrap();
    q[1 + s / 2] |= 1 << (4 * (s % 2));
    refused(&with_payload(&frame, q), n, "over-full code", "prefix code");
    // One symbol alone is not a Huffman code.
    let mut q = p.clone();
    q[1..129].fill(0);
    q[1] = 1;
    refused(&with_payload(&frame, q), n, "one length", "prefix code");
    // Stream lengths beyond the payload, or past the u32 sum.
    let mut q = p.clone();
    q[129..133].copy_from_slice(&u32::MAX.to_le_bytes());
    refused(
        &with_payload(&frame, q),
        n,
        "huge stream",
        "beyond the frame",
    );
    // A stream cut short by a byte (the next stream one longer: the same total).
    let mut q = p.clone();
    q[129..133].copy_from_slice(&(size(0) - 1).to_le_bytes());
    q[133..137].copy_from_slice(&(size(1) + 1).to_le_bytes());
    refused(
        &with_payload(&frame, q),
        n,
        "stream cut short",
        "stream 0: it ends before",
    );
    // The whole payload cut short, or one byte longer.
    refused(
        &with_payload(&frame, p[..p.len() - 1].to_vec()),
        n,
        "payload short",
        "",
    );
    let mut q = p.clone();
    q.push(0);
    refused(
        &with_payload(&frame, q),
        n,
        "payload long",
        "bytes after the exponents",
    );
    // An unknown mode.
    let mut q = p.clone();
    q[0] = 3;
    refused(&with_payload(&frame, q), n, "mode 3", "unknown mode");
    // Nonzero padding bits at the end of stream 0 (found by flipping the last byte's
    // top bits, which are padding unless the stream ends on a byte boundary).
    let mut found = false;
    for bit in (0..8).rev() {
        let mut q = p.clone();
        q[145 + size(0) as usize - 1] ^= 1 << bit;
        let f = with_payload(&frame, q);
        let c = lossless();
        let mut out = vec![0f32; n];
        if let Err(e) = c.decode_into(&f, &mut out)
            && e.to_string().contains("padding")
        {
            refused(&f, n, "padding", "padding");
            found = true;
            break;
        }
    }
    assert!(found || size(0) == 0, "no padding bit to flip");
}

#[test]
fn any_damage_is_an_error_or_a_decoding_never_a_panic() {
    let n = 3000;
    let g = gradpack::synthetic::gradient(n, 9);
    let frame = frame_of(&g);
    let c = lossless();
    let w = words(11, 4000);
    let mut out = vec![0f32; n];
    for k in 0..2000 {
        let mut p = frame[HEADER_LEN..].to_vec();
        let at = w[2 * k] as usize % p.len();
        p[at] ^= 1 << (w[2 * k + 1] % 8);
        if k % 7 == 0 {
            p.truncate(at);
        }
        let _ = c.decode_into(&with_payload(&frame, p), &mut out);
    }
}

#[test]
fn ranks_and_backends_see_the_same_frame() {
    // Below and above the length from which the code lengths come from a sample.
    for n in [50_000, 70_001] {
        let g = gradpack::synthetic::gradient(n, 4);
        let want = frame_of(&g);
        for b in every_kernel_set() {
            let f = b.run(|| frame_of(&g));
            assert_eq!(f, want, "{b:?} at {n}");
        }
    }
}

#[test]
fn symbols_the_sample_misses_still_have_codes() {
    // From 65536 elements on, the exponents' code lengths come from every 16th symbol
    // and the spread of the rest: every exponent that occurs only between the sampled
    // elements (the smallest and the largest, one between them, a subnormal, -0.0,
    // +0.0 in a frame with and without the zeros section, Inf and NaN) must come back.
    use gradpack::unstable::kernels::scalar;
    let n = (1 << 17) + 3;
    let bulk = |i: usize| {
        f32::from_bits((120 + (i % 11) as u32) << 23 | (i as u32).wrapping_mul(2654435761) >> 9)
    };
    let rare = [
        1e-30f32,
        3.0e38,
        7.5e-3,
        1e-40,
        -0.0,
        0.0,
        f32::INFINITY,
        f32::NAN,
    ];
    for dtype in ["f32", "bf16", "fp16"] {
        let c = of_type(dtype);
        let fit = |v: f32| match dtype {
            "bf16" => f32::from_bits(v.to_bits() & 0xFFFF_0000),
            "fp16" => scalar::f16_to_f32(scalar::f32_to_f16(v)),
            _ => v,
        };
        for (k, with_nonfinite, zeros) in [(0, true, false), (1, false, false), (2, false, true)] {
            let mut x: Vec<f32> = (0..n).map(|i| fit(bulk(i))).collect();
            if zeros {
                // A quarter +0.0 (at sampled places too): the zeros section.
                x.iter_mut().step_by(4).for_each(|v| *v = 0.0);
            }
            for (j, &v) in rare.iter().enumerate() {
                if fit(v).is_finite() || with_nonfinite {
                    x[16 * (1000 * j + k) + 7] = fit(v);
                }
            }
            let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
            same_bits(&x, &c.decode(&frame).unwrap());
            let h = Header::parse(&frame).unwrap();
            assert_eq!(h.params[1], u8::from(zeros), "{dtype}: the zeros section");
            // The bulk's exponents take 11 symbols: Huffman mode, well under 8 bits each.
            assert_eq!(frame[HEADER_LEN], 2, "{dtype}: Huffman mode");
        }
    }
}

fn of_type(t: &str) -> CodecSpec {
    format!("lossless:dtype={t}").parse().unwrap()
}

#[test]
fn every_bf16_and_fp16_value_comes_back_bit_for_bit() {
    // Every bf16 bit pattern (NaN payloads, signalling ones too, -0, subnormals, ±Inf).
    let bf: Vec<f32> = (0..=u16::MAX)
        .map(|h| f32::from_bits((h as u32) << 16))
        .collect();
    // Every fp16 bit pattern as the f32 it converts to (a signalling NaN converts to
    // the quiet one with its payload, which is an fp16 value too).
    let fp: Vec<f32> = (0..=u16::MAX)
        .map(gradpack::unstable::kernels::scalar::f16_to_f32)
        .collect();
    for (t, x) in [("bf16", bf), ("fp16", fp)] {
        let c = of_type(t);
        assert_eq!(c.to_string(), format!("lossless:dtype={t}"));
        for n in [x.len(), 4097, 300, 100, 1, 0] {
            let frame = c.encode(&x[..n], &EncodeCtx::new(0)).unwrap();
            same_bits(&x[..n], &c.decode(&frame).unwrap());
            let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            let mut acc = base.clone();
            c.decode_add(&frame, &mut acc).unwrap();
            let want: Vec<f32> = base.iter().zip(&x[..n]).map(|(a, b)| a + b).collect();
            same_bits(&want, &acc);
        }
    }
}

#[test]
fn values_not_of_the_type_are_refused_never_rounded() {
    let bf = of_type("bf16");
    let e = bf
        .encode(&[1.0, 1.0 + f32::EPSILON], &EncodeCtx::new(0))
        .unwrap_err();
    assert!(
        e.to_string().contains("element 1") && e.to_string().contains("bf16"),
        "{e}"
    );
    let fp = of_type("fp16");
    for bad in [
        1e-10f32,
        65520.0,
        1.0 + f32::EPSILON,
        f32::from_bits(0x7F80_0001),
    ] {
        let e = fp.encode(&[0.5, bad], &EncodeCtx::new(0)).unwrap_err();
        assert!(e.to_string().contains("element 1"), "{bad:e}: {e}");
    }
}

#[test]
fn bf16_and_fp16_frames_of_a_gradient_are_smaller_than_their_codecs() {
    let n = 1 << 16;
    let g = gradpack::synthetic::gradient(n, 3);
    for (t, plain) in [("bf16", "bf16"), ("fp16", "fp16")] {
        let p: CodecSpec = plain.parse().unwrap();
        // The gradient as that type's values: the plain codec's decode.
        let x = p
            .decode(&p.encode(&g, &EncodeCtx::new(0)).unwrap())
            .unwrap();
        let c = of_type(t);
        let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
        same_bits(&x, &c.decode(&frame).unwrap());
        let ratio = (frame.len() - HEADER_LEN) as f64 / (2 * n) as f64;
        // 8 (bf16) or 11 (fp16) raw bits of 16, and an exponent of about 3 bits.
        let most = if t == "bf16" { 0.75 } else { 0.92 };
        assert!(ratio < most, "{t}: {ratio:.3} of {plain}'s payload");
    }
}

#[test]
fn forged_fp16_frames_are_refused_and_change_nothing() {
    let c = of_type("fp16");
    let x: Vec<f32> = (0..21).map(|i| i as f32 * 0.125).collect();
    let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
    let p = frame[HEADER_LEN..].to_vec();
    assert_eq!(p[0], 0, "21 exponents are stored");
    // An exponent above fp16's 31.
    let mut q = p.clone();
    q[1] = 32;
    refused_by(
        &c,
        &with_payload(&frame, q),
        21,
        "exponent",
        "above fp16's 31",
    );
    // Non-zero padding after the 63 bits of 3-bit codes.
    let mut q = p.clone();
    *q.last_mut().unwrap() |= 0x80;
    refused_by(&c, &with_payload(&frame, q), 21, "padding", "padding bits");
    // A dtype byte out of range.
    let mut h = Header::parse(&frame).unwrap();
    h.params[0] = 3;
    let mut f = vec![0u8; HEADER_LEN];
    h.write(&mut f);
    f.extend(&p);
    let e = c.decode(&f).unwrap_err();
    assert!(e.to_string().contains("dtype"), "{e}");
}

/// `c` refuses `frame` in both decoders, for a reason that names `why`, and `decode_add` leaves
/// the accumulator as it was (`decode_into` may have written before it found the error,
/// as the trait allows).
fn refused_by(c: &CodecSpec, frame: &[u8], n: usize, what: &str, why: &str) {
    let mut out = vec![1.5f32; n];
    let e = c.decode_into(frame, &mut out).expect_err(what);
    out.fill(1.5);
    let e2 = c.decode_add(frame, &mut out).expect_err(what);
    assert!(
        out.iter().all(|&v| v == 1.5),
        "{what}: accumulator changed ({e2})"
    );
    assert!(matches!(e, gradpack::Error::Corrupt { .. }), "{what}: {e}");
    assert!(e.to_string().contains(why), "{what}: {e}");
}

/// A gradient with runs and scattered +0.0 (dead units), as `dtype`'s values.
fn with_zeros(n: usize, dtype: &str) -> Vec<f32> {
    let g = gradpack::synthetic::gradient(n, 11);
    let x: Vec<f32> = g
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            // Runs of zeros, long runs of values, and scattered zeros in some stretches.
            if (i / 37) % 4 == 1 || ((i / 300) % 3 == 0 && i % 7 == 3) {
                0.0
            } else {
                v
            }
        })
        .collect();
    if dtype == "f32" {
        return x;
    }
    let p: CodecSpec = dtype.parse().unwrap();
    p.decode(&p.encode(&x, &EncodeCtx::new(0)).unwrap())
        .unwrap()
}

/// The zeros section's four counts of a frame that has one (params byte 1 is 1).
fn zeros_section(frame: &[u8], n: usize) -> (usize, [u64; 4]) {
    let h = Header::parse(frame).unwrap();
    assert_eq!(h.params[1], 1, "the frame has a zeros section");
    let p = &frame[HEADER_LEN..];
    let block = gradpack::unstable::kernels::entropy::Block::parse(p, n, 1)
        .unwrap()
        .bytes();
    let c = std::array::from_fn(|j| {
        u64::from_le_bytes(p[block + 8 * j..block + 8 * j + 8].try_into().unwrap())
    });
    (block, c)
}

#[test]
fn zeros_take_no_plane_bytes_and_come_back_in_every_type() {
    for (t, spec, bits) in [
        ("f32", "lossless", 24),
        ("bf16", "lossless:dtype=bf16", 8),
        ("fp16", "lossless:dtype=fp16", 11),
    ] {
        let c: CodecSpec = spec.parse().unwrap();
        for n in [1 << 16, 4099, 1000, 37] {
            let x = with_zeros(n, t);
            let zeros = x.iter().filter(|v| v.to_bits() == 0).count();
            let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
            same_bits(&x, &c.decode(&frame).unwrap());
            // Nothing past the frame is written (every zero at the end is one), but in the
            // last n bytes of the room, where the encoder keeps the exponents (documented).
            let mut tail_zeros = x.clone();
            let cut = n - n / 5;
            tail_zeros[cut..].fill(0.0);
            let mut buf = vec![0xA5u8; c.max_encoded_len(n)];
            let len = c
                .encode_into(&tail_zeros, &EncodeCtx::new(0), &mut buf)
                .unwrap();
            assert!(
                buf.get(len..buf.len() - n)
                    .unwrap_or_default()
                    .iter()
                    .all(|&b| b == 0xA5),
                "{t} n={n}: wrote past the frame"
            );
            same_bits(&tail_zeros, &c.decode(&buf[..len]).unwrap());
            let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let mut acc = base.clone();
            c.decode_add(&frame, &mut acc).unwrap();
            let want: Vec<f32> = base.iter().zip(&x).map(|(a, b)| a + b).collect();
            same_bits(&want, &acc);
            // The section is taken where an eighth of the values are +0.0 and their plane
            // bits exceed its 32 bytes.
            let h = Header::parse(&frame).unwrap();
            let pays = 8 * zeros >= n && zeros * bits > 256;
            assert_eq!(h.params[1] == 1, pays, "{t} n={n}: {zeros} zeros");
            if h.params[1] == 1 {
                let (_, counts) = zeros_section(&frame, n);
                assert_eq!(counts[3] as usize, n - zeros, "{t} n={n}");
            }
            // Without the zeros (each +0.0 made -0.0, which keeps its planes) the frame is
            // longer by about the zeros' plane bits.
            let signed: Vec<f32> = x
                .iter()
                .map(|&v| if v.to_bits() == 0 { -0.0 } else { v })
                .collect();
            let plain = c.encode(&signed, &EncodeCtx::new(0)).unwrap();
            same_bits(&signed, &c.decode(&plain).unwrap());
            if zeros * bits > 4096 {
                let saved = plain.len() as f64 - frame.len() as f64;
                let planes = (zeros * bits) as f64 / 8.0;
                assert!(
                    saved > 0.75 * planes,
                    "{t} n={n}: {saved} bytes saved of {planes}"
                );
            }
        }
        // A non-finite value turns the section off: the all-ones exponent is its own.
        let mut x = with_zeros(5000, t);
        x[17] = f32::INFINITY;
        let frame = c.encode(&x, &EncodeCtx::new(0)).unwrap();
        assert_eq!(Header::parse(&frame).unwrap().params[1], 0, "{t}");
        same_bits(&x, &c.decode(&frame).unwrap());
        // All zeros: the one-symbol block and no plane byte.
        let z = vec![0f32; 3000];
        let frame = c.encode(&z, &EncodeCtx::new(0)).unwrap();
        assert_eq!(frame.len(), HEADER_LEN + 2 + 32, "{t}");
        same_bits(&z, &c.decode(&frame).unwrap());
    }
}

#[test]
fn forged_zeros_sections_are_refused_and_change_nothing() {
    let n = 20_000;
    let x = with_zeros(n, "f32");
    let frame = frame_of(&x);
    let (block, counts) = zeros_section(&frame, n);
    let p = frame[HEADER_LEN..].to_vec();
    let set = |j: usize, v: u64| {
        let mut q = p.clone();
        q[block + 8 * j..block + 8 * j + 8].copy_from_slice(&v.to_le_bytes());
        with_payload(&frame, q)
    };
    // Counts out of order, or more entries than a quarter's elements.
    refused(
        &set(0, counts[1] + 1),
        n,
        "count 1 above count 2",
        "plane entries before quarter",
    );
    refused(
        &set(0, 5001),
        n,
        "quarter 0 over its elements",
        "plane entries before quarter",
    );
    // A total the plane bytes do not hold.
    refused(
        &set(3, counts[3] - 1),
        n,
        "total one short",
        "bytes after the exponents",
    );
    // Entries moved between quarters (the same total): the quarters' symbols disagree.
    refused(
        &set(1, counts[1] + 1),
        n,
        "entries moved",
        "differ in number",
    );
    refused(
        &set(1, counts[1] - 1),
        n,
        "entries moved back",
        "differ in number",
    );
    // A zeros flag of 2, and the section cut off.
    let mut h = Header::parse(&frame).unwrap();
    h.params[1] = 2;
    let mut f = vec![0u8; HEADER_LEN];
    h.write(&mut f);
    f.extend(&p);
    let e = lossless().decode(&f).unwrap_err();
    assert!(e.to_string().contains("zeros"), "{e}");
    refused(
        &with_payload(&frame, p[..block + 20].to_vec()),
        n,
        "section cut",
        "",
    );
}
