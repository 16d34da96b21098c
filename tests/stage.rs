//! The entropy stage (`entropy=on`): decoded values identical to the frame without it on
//! every backend, frames smaller on gradient-like data, and forged or damaged staged
//! frames refused with nothing written.

use gradpack::{Backend, Codec, CodecSpec, EncodeCtx, HEADER_LEN, Header};

// Sums through every strategy: tests/collective.rs (`the_entropy_stage_sums_...`).

fn spec(s: &str) -> CodecSpec {
    s.parse().unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Normal variates from a xorshift stream (Box-Muller), scaled by `s`.
fn normal(n: usize, seed: u64, s: f32) -> Vec<f32> {
    let mut state = seed | 1;
    let mut u = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (a, b) = (u(), u());
            ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32 * s
        })
        .collect()
}

/// Student-t variates with 3 degrees of freedom: a normal over sqrt(chi^2_3 / 3).
fn student3(n: usize, seed: u64) -> Vec<f32> {
    let z = normal(n, seed, 1.0);
    let c = normal(3 * n, seed ^ 0xABCD, 1.0);
    z.iter()
        .enumerate()
        .map(|(i, &z)| {
            let chi: f32 = c[3 * i..3 * i + 3].iter().map(|v| v * v).sum();
            z / (chi / 3.0).sqrt()
        })
        .collect()
}

const STAGED: &[&str] = &[
    "int8",
    "int8:block=32,rounding=stochastic",
    "qsgd:bits=4,block=128",
    "qsgd:bits=8,block=64",
    "sign",
    "ternary",
    "natural",
    "fp8",
    "fp8:format=e5m2,scale=e8m0,block=32",
    "fp8:scale=none",
    "fp4",
    "fp4:scale=f32,block=64,rounding=stochastic",
    "fp4:scale=e4m3",
    // Codebook's default blocks of 65536 are over the stage's 4096 code bytes.
    "codebook:block=4096",
];

#[test]
fn staged_frames_decode_to_the_bits_of_plain_ones_on_every_backend_and_mode() {
    let x = student3(70_001, 11);
    for s in STAGED {
        let plain = spec(s);
        let staged = plain.with_entropy(true).unwrap();
        assert!(staged.entropy() && !plain.entropy());
        assert_eq!(spec(&staged.to_string()), staged, "{staged} parses back");
        for n in [0, 1, 255, 4097, 70_001] {
            let ctx = EncodeCtx::new(5).with_offset(3);
            let x = &x[..n];
            let pf = plain.encode(x, &ctx).unwrap();
            let mut frames = Vec::new();
            for b in Backend::available() {
                let sf = b.run(|| staged.encode(x, &ctx)).unwrap();
                let want = plain.decode(&pf).unwrap();
                let got = b.run(|| staged.decode(&sf)).unwrap();
                assert_eq!(bits(&got), bits(&want), "{staged} n={n} on {b}");
                let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
                let (mut a, mut c) = (base.clone(), base);
                plain.decode_add(&pf, &mut a).unwrap();
                b.run(|| staged.decode_add(&sf, &mut c)).unwrap();
                assert_eq!(bits(&a), bits(&c), "{staged} n={n} add on {b}");
                frames.push(sf);
            }
            assert!(
                frames.windows(2).all(|w| w[0] == w[1]),
                "{staged} n={n}: frames differ between backends"
            );
        }
    }
}

#[test]
fn error_feedback_with_the_stage_leaves_the_residual_of_the_plain_codec() {
    use gradpack::{ErrorFeedback, FeedbackOptions, ResidualPrecision};
    let g: Vec<Vec<f32>> = (0..4).map(|k| student3(9_000, 20 + k)).collect();
    for s in ["int8", "fp8", "fp4", "sign", "qsgd:bits=4,block=32"] {
        for precision in [ResidualPrecision::F32, ResidualPrecision::Bf16] {
            let opts = FeedbackOptions {
                precision,
                ..Default::default()
            };
            let plain = spec(s);
            let staged = plain.with_entropy(true).unwrap();
            let mut a = ErrorFeedback::with_options(plain, 9_000, opts).unwrap();
            let mut b = ErrorFeedback::with_options(staged, 9_000, opts).unwrap();
            for (k, g) in g.iter().enumerate() {
                let ctx = EncodeCtx::new(k as u64);
                let fa = a.encode(g, &ctx).unwrap();
                let fb = b.encode(g, &ctx).unwrap();
                assert_eq!(
                    bits(&gradpack::decode_to_vec(&fa).unwrap()),
                    bits(&gradpack::decode_to_vec(&fb).unwrap()),
                    "{s} {precision:?} step {k}"
                );
            }
        }
    }
}

/// Payload bytes of `spec`'s frame of `x`.
fn payload(spec: &CodecSpec, x: &[f32]) -> usize {
    spec.encode(x, &EncodeCtx::new(1)).unwrap().len() - HEADER_LEN
}

#[test]
fn the_stage_shrinks_codes_of_bell_shaped_data_and_costs_at_most_a_byte_on_random_bits() {
    let n = 1 << 18;
    // int8 codes of absmax blocks of 256 carry about 7.4 bits for normal data and about
    // 6.3 for Student-t(3): the stage must take most of that gain (payload ratios below
    // 0.95 and 0.85 with the 4-byte steps), and fp8 / fp4 gain too.
    for (data, x, limits) in [
        ("normal", normal(n, 3, 1e-3), [0.95, 0.97, 0.99]),
        ("student-t(3)", student3(n, 4), [0.85, 0.93, 0.97]),
    ] {
        for (s, limit) in ["int8", "fp8", "fp4"].into_iter().zip(limits) {
            let plain = spec(s);
            let staged = plain.with_entropy(true).unwrap();
            let r = payload(&staged, &x) as f64 / payload(&plain, &x) as f64;
            assert!(r < limit, "{s} on {data}: {r:.3} of the plain payload");
        }
    }
    // Codes of random signs are incompressible: stored, one byte of mode over the plain.
    let x = normal(4096 * 8, 9, 1.0);
    let plain = spec("sign:block=4096");
    let staged = plain.with_entropy(true).unwrap();
    assert_eq!(payload(&staged, &x), payload(&plain, &x) + 1);
}

/// `frame` with its payload replaced and its flags set to `flags`, the header's payload
/// length and CRC fixed up.
fn rewrite(frame: &[u8], flags: Option<u16>, payload: Vec<u8>) -> Vec<u8> {
    let mut h = Header::parse(frame).unwrap();
    h.payload_len = payload.len() as u64;
    if let Some(f) = flags {
        h.flags = f;
    }
    let mut f = vec![0u8; HEADER_LEN];
    h.write(&mut f);
    f.extend(payload);
    f
}

/// Both decoders refuse `frame` naming `why`, and `decode_add` leaves the accumulator as
/// it was (`decode` may write before it finds an error in a stream, as the trait allows).
fn refused(frame: &[u8], n: usize, what: &str, why: &str) {
    let mut out = vec![1.5f32; n];
    let e = gradpack::decode(frame, &mut out).expect_err(what);
    out.fill(1.5);
    let e2 = gradpack::decode_add(frame, &mut out).expect_err(what);
    assert!(
        out.iter().all(|&v| v == 1.5),
        "{what}: accumulator changed ({e2})"
    );
    assert!(e.to_string().contains(why), "{what}: {e}");
}

#[test]
fn forged_and_damaged_staged_frames_are_refused_and_change_nothing() {
    let n = 20_000;
    let x = student3(n, 6);
    let int8 = spec("int8:entropy=on");
    let frame = int8.encode(&x, &EncodeCtx::new(0)).unwrap();
    let sl = 4 * n.div_ceil(256);
    let p = frame[HEADER_LEN..].to_vec();
    assert_eq!(p[sl], 2, "int8 codes of a gradient take the Huffman mode");
    // The codes' entropy block damaged: a code length over 11, a table that is not a
    // complete code, streams cut short, bytes after the block, a block cut short.
    let mut q = p.clone();
    q[sl + 1] = 0xCC;
    refused(&rewrite(&frame, None, q), n, "length 12", "over 11");
    let mut q = p.clone();
    let k = (sl + 1..sl + 129).find(|&k| q[k] & 15 == 0).unwrap();
    q[k] |= 1;
    refused(&rewrite(&frame, None, q), n, "over-full", "prefix code");
    let mut q = p.clone();
    let s0 = u32::from_le_bytes(q[sl + 129..sl + 133].try_into().unwrap());
    q[sl + 129..sl + 133].copy_from_slice(&(s0 - 1).to_le_bytes());
    // (decode_add checks the streams first; decode finds the byte after the block.)
    refused(&rewrite(&frame, None, q), n, "stream cut", "entropy block");
    let mut q = p.clone();
    q.push(0);
    refused(
        &rewrite(&frame, None, q),
        n,
        "a byte after",
        "after the entropy block",
    );
    refused(
        &rewrite(&frame, None, p[..p.len() - 1].to_vec()),
        n,
        "cut short",
        "beyond the frame",
    );
    refused(
        &rewrite(&frame, None, p[..sl].to_vec()),
        n,
        "no block",
        "staged payload",
    );
    // The flag on a codec without a stage, or with a unit over 4096 code bytes.
    let f16 = spec("fp16").encode(&x[..100], &EncodeCtx::new(0)).unwrap();
    let fp = f16[HEADER_LEN..].to_vec();
    refused(
        &rewrite(&f16, Some(4), fp),
        100,
        "fp16 staged",
        "no entropy stage",
    );
    let big = spec("int8:block=8192")
        .encode(&x, &EncodeCtx::new(0))
        .unwrap();
    let bp = big[HEADER_LEN..].to_vec();
    refused(&rewrite(&big, Some(4), bp), n, "unit 8192", "4096");
    // Non-zero padding bits in the last code byte: sign codes of 20 elements end with
    // 4 padding bits, set here in a stored block.
    let sign = spec("sign:block=4,entropy=on");
    let sf = sign.encode(&x[..20], &EncodeCtx::new(0)).unwrap();
    let mut q = sf[HEADER_LEN..].to_vec();
    assert_eq!(q[20], 0, "stored");
    *q.last_mut().unwrap() |= 0x80;
    refused(&rewrite(&sf, None, q), 20, "padding", "padding bits");
    // fp8 with a scale: a table with a code for a NaN code (0x7F) is refused, though no
    // code uses it; without a scale the same code is a value.
    let fp8 = spec("fp8:block=32,entropy=on");
    let ff = fp8.encode(&x, &EncodeCtx::new(0)).unwrap();
    let fsl = 4 * n.div_ceil(32);
    let mut q = ff[HEADER_LEN..].to_vec();
    assert_eq!(q[fsl], 2);
    let lens: Vec<u8> = (0..256)
        .map(|s| (q[fsl + 1 + s / 2] >> (4 * (s % 2))) & 15)
        .collect();
    // Move the code of the longest-coded symbol to 0x7F: the same lengths, so still a
    // complete code, and the streams still decode.
    let from = (0..256)
        .filter(|&s| lens[s] > 0 && s != 0x7F)
        .max_by_key(|&s| lens[s]);
    let from = from.unwrap();
    if lens[0x7F] == 0 {
        let set = |q: &mut Vec<u8>, s: usize, l: u8| {
            let k = fsl + 1 + s / 2;
            q[k] = (q[k] & !(15 << (4 * (s % 2)))) | l << (4 * (s % 2));
        };
        set(&mut q, 0x7F, lens[from]);
        set(&mut q, from, 0);
        refused(&rewrite(&ff, None, q), n, "a NaN code", "never write");
    }
}
