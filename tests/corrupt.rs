//! Decoding trusts nothing: truncations, bit flips and random bytes give `Ok` or an
//! `Err` naming the problem, never a panic; `decode_add` never touches the accumulator
//! on error; allocation is bounded by the frame's own length.

mod common;
mod fuzz_checks;

use common::*;
use gradpack::{Codec, CodecId, CodecSpec, EncodeCtx, Error, HEADER_LEN, Header};
use proptest::prelude::*;

/// Decode `frame` every way there is and check the contracts; returns whether it decoded.
fn decode_all_ways(frame: &[u8], n: usize) -> bool {
    fuzz_checks::decode_contract(frame, n)
}

fn elements_of(frame: &[u8]) -> usize {
    Header::parse(frame).map_or(300, |h| h.elements.min(1 << 20) as usize)
}

#[test]
fn golden_frames_decode() {
    for (name, f) in golden_frames() {
        assert!(decode_all_ways(&f, elements_of(&f)), "{name}");
    }
}

#[test]
fn every_truncation_is_an_error() {
    for (name, f) in golden_frames() {
        let n = elements_of(&f);
        for len in 0..f.len() {
            let t = &f[..len];
            assert!(!decode_all_ways(t, n), "{name} cut to {len}");
            let e = gradpack::decode(t, &mut vec![0.0; n]).unwrap_err();
            assert!(
                matches!(e, Error::Truncated { .. }),
                "{name} cut to {len}: {e}"
            );
        }
        // And one byte too many.
        let mut long = f.clone();
        long.push(0);
        assert!(matches!(
            gradpack::decode(&long, &mut vec![0.0; n]),
            Err(Error::TrailingBytes { .. })
        ));
    }
}

#[test]
fn every_single_bit_flip_in_a_header_is_detected() {
    for (name, f) in golden_frames() {
        let n = elements_of(&f);
        for bit in 0..HEADER_LEN * 8 {
            let mut g = f.clone();
            g[bit / 8] ^= 1 << (bit % 8);
            let e = gradpack::decode(&g, &mut vec![0.0; n]).unwrap_err();
            let expected = match bit / 8 {
                0..=3 => matches!(e, Error::BadMagic(_)),
                4 => matches!(e, Error::UnsupportedVersion(_)),
                _ => matches!(e, Error::HeaderChecksum { .. }),
            };
            assert!(expected, "{name} bit {bit}: {e}");
            assert!(!decode_all_ways(&g, n));
        }
    }
}

#[test]
fn every_single_bit_flip_in_a_payload_is_safe() {
    // The frames' bits dealt out to every core (the largest frame alone has 350,000).
    let frames = golden_frames();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for t in 0..threads {
            let frames = &frames;
            s.spawn(move || {
                for (_, f) in frames {
                    let n = elements_of(f);
                    let mut g = f.clone();
                    for bit in (HEADER_LEN * 8 + t..f.len() * 8).step_by(threads) {
                        g[bit / 8] ^= 1 << (bit % 8);
                        let _ = decode_all_ways(&g, n);
                        g[bit / 8] ^= 1 << (bit % 8);
                    }
                }
            });
        }
    });
}

/// A frame with a valid header (checksum recomputed) around arbitrary fields.
fn forge(
    codec: u8,
    flags: u16,
    elements: u64,
    seed: u64,
    offset: u64,
    params: [u8; 12],
    payload: &[u8],
) -> Vec<u8> {
    let mut f = vec![0u8; HEADER_LEN];
    f[0..4].copy_from_slice(b"GPAK");
    f[4] = 1;
    f[5] = codec;
    f[6..8].copy_from_slice(&flags.to_le_bytes());
    f[8..16].copy_from_slice(&elements.to_le_bytes());
    f[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    f[24..32].copy_from_slice(&seed.to_le_bytes());
    f[32..40].copy_from_slice(&offset.to_le_bytes());
    f[40..52].copy_from_slice(&params);
    let crc = crc32fast::hash(&f[0..52]);
    f[52..56].copy_from_slice(&crc.to_le_bytes());
    f.extend_from_slice(payload);
    f
}

#[test]
fn huge_element_counts_are_refused_before_allocating() {
    // 2^40 elements with a tiny payload: every codec refuses without allocating 4 TiB.
    for id in CodecId::ALL {
        for params in [[0u8; 12], {
            let mut p = [0u8; 12];
            p[0] = 64; // block 64 / k 64 / threshold 64
            p
        }] {
            let f = forge(id as u8, 0, 1 << 40, 0, 0, params, &[0u8; 16]);
            let e = gradpack::decode_to_vec(&f).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::TooLarge { .. } | Error::PayloadLength { .. } | Error::BadField { .. }
                ),
                "{id}: {e}"
            );
            let mut small = vec![0.0f32; 16];
            assert!(gradpack::decode(&f, &mut small).is_err());
        }
    }
    // The documented limit: 16 KiB of f32 per frame byte, at least 2^16 elements.
    assert_eq!(gradpack::decode_limit(0), 1 << 16);
    assert_eq!(gradpack::decode_limit(1000), 4096 * 1000);
    let f = forge(
        CodecId::RandK as u8,
        0,
        10_000_000,
        1,
        0,
        {
            let mut p = [0u8; 12];
            p[0] = 1; // threshold 1: almost nothing kept
            p
        },
        &[],
    );
    assert!(matches!(
        gradpack::decode_to_vec(&f),
        Err(Error::TooLarge { .. })
    ));
    let r = gradpack::decode_to_vec_with_limit(&f, 10_000_000);
    assert!(r.is_ok() || matches!(r, Err(Error::Corrupt { .. })));
}

#[test]
fn reserved_fields_are_rejected() {
    let f = forge(CodecId::Fp16 as u8, 0x8000, 1, 0, 0, [0; 12], &[0, 0]);
    assert_eq!(
        gradpack::decode(&f, &mut [0.0]),
        Err(Error::ReservedFlags(0x8000))
    );
    let f = forge(
        CodecId::Fp16 as u8,
        0,
        1,
        0,
        0,
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        &[0, 0],
    );
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0]),
        Err(Error::BadField {
            field: "params",
            ..
        })
    ));
    let f = forge(CodecId::Fp16 as u8, 0, 1, 5, 0, [0; 12], &[0, 0]);
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0]),
        Err(Error::BadField { field: "seed", .. })
    ));
    let f = forge(42, 0, 1, 0, 0, [0; 12], &[0, 0]);
    assert_eq!(
        gradpack::decode(&f, &mut [0.0]),
        Err(Error::UnknownCodec(42))
    );
    let f = forge(CodecId::Fp16 as u8, 0, 2, 0, u64::MAX, [0; 12], &[0; 4]);
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0; 2]),
        Err(Error::BadField {
            field: "offset",
            ..
        })
    ));
    // Non-zero padding bits after the last sign code.
    let mut p = [0u8; 12];
    p[0] = 64;
    let f = forge(
        CodecId::Sign as u8,
        0,
        3,
        0,
        0,
        p,
        &[0, 0, 128, 63, 0b1000_0000],
    );
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0; 3]),
        Err(Error::Corrupt { .. })
    ));
    // A natural-compression reference exponent below the minimum.
    let f = forge(CodecId::Natural as u8, 0, 1, 0, 0, p, &[3, 1]);
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0; 1]),
        Err(Error::Corrupt { .. })
    ));
    // A top-k index past the end.
    let mut p = [0u8; 12];
    p[0] = 1; // k
    p[9] = 4; // width
    let f = forge(CodecId::TopK as u8, 0, 5, 0, 0, p, &[0, 0, 128, 63, 9]);
    assert!(matches!(
        gradpack::decode(&f, &mut [0.0; 5]),
        Err(Error::Corrupt { .. })
    ));
}

#[test]
fn fp4_frame_scales_a_decoder_refuses() {
    let spec: CodecSpec = "fp4:scale=e4m3".parse().unwrap();
    let x: Vec<f32> = (0..40).map(|i| (i as f32 - 17.0) * 0.37).collect();
    let good = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
    let mut out = vec![0f32; x.len()];
    gradpack::decode(&good, &mut out).unwrap();
    // The frame scale (params bytes 7..11, header bytes 47..51): NaN, zero, below 2^-126,
    // negative, and so large that 448 times it overflows; then byte 11 non-zero.
    for g in [f32::NAN, 0.0, 1e-39, -1.0, 1e36, f32::INFINITY] {
        let mut f = good.clone();
        f[47..51].copy_from_slice(&g.to_le_bytes());
        reseal(&mut f);
        assert!(
            matches!(
                gradpack::decode(&f, &mut out),
                Err(Error::BadField {
                    field: "params.global",
                    ..
                })
            ),
            "frame scale {g:e}"
        );
    }
    let mut f = good.clone();
    f[51] = 1;
    reseal(&mut f);
    assert!(matches!(
        gradpack::decode(&f, &mut out),
        Err(Error::BadField { .. })
    ));
    // A block's E4M3 scale byte with its sign bit set (the first payload byte).
    let mut f = good.clone();
    f[56] |= 0x80;
    assert!(matches!(
        gradpack::decode(&f, &mut out),
        Err(Error::Corrupt { .. })
    ));
    // The same through the fused reduction of several frames.
    let frames = [good.as_slice(), f.as_slice()];
    assert!(gradpack::reduce_frames(&frames, &mut out).is_err());
}

/// Re-seal a frame's header checksum after editing bytes 0..52.
fn reseal(f: &mut [u8]) {
    let crc = crc32fast::hash(&f[0..52]);
    f[52..56].copy_from_slice(&crc.to_le_bytes());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn prop_mutated_valid_frames_never_panic(
        spec_i in 0..SPECS.len(),
        n in 0usize..400,
        salt in any::<u32>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        in_header in any::<bool>(),
    ) {
        let spec: gradpack::CodecSpec = SPECS[spec_i].parse().unwrap();
        let mut f = encode(&spec, &sample(n, salt), &gradpack::EncodeCtx::new(salt as u64));
        for (at, byte) in edits {
            let at = if in_header || f.len() == HEADER_LEN {
                8 + at % 44 // elements .. params, then re-sealed
            } else {
                HEADER_LEN + at % (f.len() - HEADER_LEN)
            };
            f[at] = byte;
        }
        reseal(&mut f);
        decode_all_ways(&f, n);
    }

    /// Any 1 to 64 distinct bit flips anywhere in a sealed frame are rejected. Up to 3
    /// flips this is guaranteed (CRC-32 has Hamming distance 4 at these lengths); beyond,
    /// a miss has probability 2^-32 per case, so 2000 cases fail spuriously with
    /// probability below 5e-7.
    #[test]
    fn prop_flips_in_sealed_frames_are_detected(
        spec_i in 0..SPECS.len(),
        n in 0usize..400,
        salt in any::<u32>(),
        positions in proptest::collection::hash_set(any::<usize>(), 1..65),
    ) {
        let spec: gradpack::CodecSpec = SPECS[spec_i].parse().unwrap();
        let f = gradpack::Checksummed(spec)
            .encode(&sample(n, salt), &gradpack::EncodeCtx::new(salt as u64))
            .unwrap();
        let bits: std::collections::HashSet<usize> =
            positions.iter().map(|p| p % (f.len() * 8)).collect();
        let mut g = f.clone();
        for b in &bits {
            g[b / 8] ^= 1 << (b % 8);
        }
        prop_assert!(!decode_all_ways(&g, n), "{} flips accepted", bits.len());
    }

    #[test]
    fn prop_random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        decode_all_ways(&bytes, 16);
    }

    #[test]
    fn prop_forged_headers_never_panic(
        codec in 0u8..11,
        flags in prop_oneof![Just(0u16), Just(1u16), Just(2u16), Just(3u16), any::<u16>()],
        elements in prop_oneof![0u64..600, any::<u64>()],
        seed in any::<u64>(),
        offset in prop_oneof![0u64..1000, any::<u64>()],
        p0 in prop_oneof![Just(64u32), 0u32..300, any::<u32>()],
        p4 in 0u8..10,
        p8 in 0u8..3,
        p9 in 0u8..40,
        payload in proptest::collection::vec(any::<u8>(), 0..700),
    ) {
        let mut params = [0u8; 12];
        params[0..4].copy_from_slice(&p0.to_le_bytes());
        params[4] = p4;
        params[8] = p8;
        params[9] = p9;
        let f = forge(codec, flags, elements, seed, offset, params, &payload);
        let n = (elements as usize).min(600);
        decode_all_ways(&f, n);
    }
}

/// Every golden frame sealed with a payload checksum.
fn sealed_golden_frames() -> Vec<(String, Vec<u8>, Vec<u8>)> {
    golden_frames()
        .into_iter()
        .map(|(name, f)| {
            let mut buf = f.clone();
            buf.resize(f.len() + 4, 0xEE);
            let len = gradpack::wire::seal(&mut buf, f.len()).unwrap();
            assert_eq!(len, buf.len());
            (name, f, buf)
        })
        .collect()
}

#[test]
fn sealed_frames_decode_to_the_same_bits() {
    for (name, plain, sealed) in sealed_golden_frames() {
        let (h, _) = gradpack::inspect(&sealed).unwrap();
        assert!(h.payload_checksum(), "{name}");
        assert_eq!(h.frame_len(), Some(sealed.len() as u64));
        assert_eq!(
            f32_bytes(&gradpack::decode_to_vec(&sealed).unwrap()),
            f32_bytes(&gradpack::decode_to_vec(&plain).unwrap()),
            "{name}"
        );
        assert!(decode_all_ways(&sealed, elements_of(&sealed)));
        // Sealing twice, or into a buffer without room, is an error and changes nothing.
        let mut again = sealed.clone();
        again.extend_from_slice(&[0; 4]);
        let before = again.clone();
        assert!(gradpack::wire::seal(&mut again, sealed.len()).is_err());
        assert_eq!(again, before);
        let mut tight = plain.clone();
        assert!(matches!(
            gradpack::wire::seal(&mut tight, plain.len()),
            Err(Error::BufferTooSmall { .. })
        ));
        assert_eq!(tight, plain);
    }
}

#[test]
fn every_single_bit_flip_in_a_sealed_frame_is_detected() {
    for (name, _, f) in sealed_golden_frames() {
        let n = elements_of(&f);
        for bit in 0..f.len() * 8 {
            let mut g = f.clone();
            g[bit / 8] ^= 1 << (bit % 8);
            let e = gradpack::decode(&g, &mut vec![0.0; n]).unwrap_err();
            if bit >= HEADER_LEN * 8 {
                assert!(
                    matches!(e, Error::PayloadChecksum { .. }),
                    "{name} bit {bit}: {e}"
                );
            }
            assert!(!decode_all_ways(&g, n));
        }
    }
}

#[test]
fn checksummed_codec_round_trips_and_rejects_flips() {
    use gradpack::{Checksummed, EncodeCtx};
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
    for spec in gradpack::codec::REPRESENTATIVE_SPECS {
        let inner: gradpack::CodecSpec = spec.parse().unwrap();
        let c = Checksummed(inner);
        let ctx = EncodeCtx::new(7);
        let plain = inner.encode(&x, &ctx).unwrap();
        let sealed = c.encode(&x, &ctx).unwrap();
        assert_eq!(sealed.len(), plain.len() + 4, "{spec}");
        assert!(sealed.len() <= c.max_encoded_len(x.len()));
        assert_eq!(
            sealed[HEADER_LEN..sealed.len() - 4],
            plain[HEADER_LEN..],
            "{spec}"
        );
        assert_eq!(
            f32_bytes(&c.decode(&sealed).unwrap()),
            f32_bytes(&inner.decode(&plain).unwrap())
        );
        // A buffer one byte short is refused with the sealed length.
        let mut short = vec![0u8; sealed.len() - 1];
        match c.encode_into(&x, &ctx, &mut short) {
            Err(Error::BufferTooSmall { needed, .. }) => assert!(needed >= sealed.len()),
            other => panic!("{spec}: {other:?}"),
        }
        let mut g = sealed.clone();
        g[HEADER_LEN] ^= 1;
        assert!(matches!(c.decode(&g), Err(Error::PayloadChecksum { .. })));
    }
}

#[test]
fn payload_lengths_near_u64_max_are_refused() {
    // 56 (+ 4 when sealed) + payload_len overflows u64: a clean error, not an overflow.
    for flags in [0u16, 2, 3] {
        for payload_len in [u64::MAX, u64::MAX - 3, u64::MAX - 56, u64::MAX - 60] {
            let mut f = forge(CodecId::Fp16 as u8, flags, 4, 0, 0, [0; 12], &[0; 8]);
            f[16..24].copy_from_slice(&payload_len.to_le_bytes());
            reseal(&mut f);
            assert!(!decode_all_ways(&f, 4));
            assert!(gradpack::inspect(&f).is_err());
        }
    }
}

#[test]
fn random_k_count_mismatch_is_an_error_on_every_backend() {
    // A frame whose seed, offset and threshold select a different number of elements than
    // its payload holds values: `decode_into` counts while it writes (one pass of draws)
    // and must still refuse it, and `decode_add` must leave the accumulator alone. Run on
    // every backend, since the AVX2 filter writes its indices in a different way.
    let n = 5000;
    let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let c: gradpack::CodecSpec = "randk:ratio=0.05,values=f32".parse().unwrap();
    let ctx = gradpack::EncodeCtx::new(9).with_offset(3);
    let good = c.encode(&x, &ctx).unwrap();
    let h = Header::parse(&good).unwrap();
    let payload = &good[HEADER_LEN..HEADER_LEN + h.payload_len as usize];
    let k = payload.len() / 4;
    let extra: Vec<u8> = payload.iter().chain(&[0, 0, 128, 63]).copied().collect();
    let frames = [
        (
            "one value short",
            payload[..payload.len() - 4].to_vec(),
            h.seed,
        ),
        ("one value over", extra, h.seed),
        ("no values", Vec::new(), h.seed),
        ("another seed", payload.to_vec(), h.seed ^ 1),
    ];
    for b in gradpack::unstable::kernels::Backend::available() {
        b.run(|| {
            assert!(decode_all_ways(&good, n));
            for (what, p, seed) in &frames {
                let f = forge(
                    CodecId::RandK as u8,
                    h.flags & !gradpack::wire::FLAG_PAYLOAD_CRC, // no payload checksum to fix
                    n as u64,
                    *seed,
                    h.offset,
                    h.params,
                    p,
                );
                let mut out = vec![0.0f32; n];
                match gradpack::decode(&f, &mut out) {
                    Err(Error::Corrupt { reason, .. }) => {
                        assert!(reason.contains("select"), "{b} {what}: {reason}")
                    }
                    other if *what == "another seed" && other.is_ok() => {
                        // Another seed may select exactly k elements by chance; then the
                        // frame is valid and decodes.
                        let kept = out.iter().filter(|v| **v != 0.0).count();
                        assert!(kept <= k, "{b} {what}");
                    }
                    other => panic!("{b} {what}: {other:?}"),
                }
                assert!(
                    !decode_all_ways(&f, n) || *what == "another seed",
                    "{b} {what}"
                );
            }
        });
    }
}

/// fp8 frames with a scale refuse a NaN or ±Inf code and a negative or infinite block
/// scale wherever it lies (the checks scan 64-byte rows, then a shorter rest), naming
/// its byte, on every backend, and `decode_add` leaves the accumulator as it was.
#[test]
fn fp8_codes_and_scales_a_decoder_refuses_wherever_they_are() {
    use gradpack::unstable::kernels::Backend;
    // 21 blocks of 64 (the last of 20): 84 bytes of scales (one row of 16, five more)
    // and 1300 codes (20 rows, 20 more).
    let n: usize = 1300;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
        .collect();
    let scales = 4 * n.div_ceil(64);
    let codes_at = HEADER_LEN + scales;
    let refused = |f: &[u8], offset: usize, what: &str| {
        for b in Backend::available() {
            let mut acc: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let before = acc.clone();
            let e = b.run(|| gradpack::decode_add(f, &mut acc)).unwrap_err();
            assert!(
                matches!(e, Error::Corrupt { offset: o, .. } if o == offset),
                "{b}: {what}: {e}"
            );
            assert_eq!(acc, before, "{b}: {what}: the accumulator changed");
        }
    };
    for (spec, bad) in [
        ("fp8:block=64", [0x7Fu8, 0xFF]),
        ("fp8:format=e5m2,block=64", [0x7C, 0xFE]),
    ] {
        let spec: CodecSpec = spec.parse().unwrap();
        let good = spec.encode(&x, &EncodeCtx::new(0)).unwrap();
        for i in [0, 1, 63, 64, 700, 1279, 1280, 1299] {
            for c in bad {
                let mut f = good.clone();
                f[codes_at + i] = c;
                refused(&f, codes_at + i, &format!("{spec}: code {i} = {c:#04x}"));
            }
        }
        for blk in [0, 5, 15, 16, 20] {
            for s in [-1.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
                let mut f = good.clone();
                let at = HEADER_LEN + 4 * blk;
                f[at..at + 4].copy_from_slice(&s.to_le_bytes());
                refused(&f, at, &format!("{spec}: scale of block {blk} = {s:e}"));
            }
        }
    }
}
