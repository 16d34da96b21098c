//! The properties the fuzz targets check (`fuzz/`), one function per target. Shared
//! with `tests/fuzz_regressions.rs`, which replays every input that ever made a target
//! fail, plus the seed corpora, under plain `cargo test`.
//!
//! Each function takes the raw fuzz input and panics when a property fails.

#![allow(dead_code)]

use gradpack::{
    Backend, Checksummed, Codec, CodecSpec, EncodeCtx, Error, HEADER_LEN, Header, wire,
};

/// Outputs longer than this are not tried (a frame may legally claim up to 2^32 elements
/// for top-k; decoding into 2^16 keeps each execution fast).
pub const MAX_OUT: u64 = 1 << 16;

/// The output length a frame decodes into: its header's element count when that parses
/// and is at most [`MAX_OUT`], else `fallback`.
pub fn out_len(frame: &[u8], fallback: usize) -> usize {
    match Header::parse(frame) {
        Ok(h) if h.elements <= MAX_OUT => h.elements as usize,
        _ => fallback,
    }
}

/// The bit pattern of `v`. Under Miri every NaN maps to one canonical pattern: Rust
/// leaves the sign and payload of a NaN produced by arithmetic unspecified and Miri
/// randomises them, while natively (x86-64, aarch64) they are reproducible and compared.
pub fn bits_of(v: f32) -> u32 {
    if cfg!(miri) && v.is_nan() {
        0x7FC0_0000
    } else {
        v.to_bits()
    }
}

/// The bit patterns of `x` (see [`bits_of`]).
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|&v| bits_of(v)).collect()
}

/// Arbitrary bytes into every decoder with an arbitrary output length: `Ok` or `Err`,
/// never a panic, an abort or an allocation beyond the documented bound.
///
/// Input: byte 0 chooses the output length (even: the header's element count, odd: the
/// byte times 7, usually wrong), the rest is the frame.
pub fn decode_any(data: &[u8]) {
    let Some((&mode, frame)) = data.split_first() else {
        return;
    };
    let n = if mode % 2 == 0 {
        out_len(frame, frame.len() % 257)
    } else {
        mode as usize * 7
    };
    decode_contract(frame, n);
}

/// Decode `frame` into `n` elements every way there is and check the contracts that
/// hold for any input; returns whether it decoded. `tests/corrupt.rs` runs it on
/// truncated, bit-flipped and forged frames.
/// - Two different output sentinels give the same result, and on `Ok` the same bits.
/// - `decode_add` leaves the accumulator untouched on error and equal to
///   `acc + decode` on success.
/// - The codec's own `decode_into` agrees with the free function.
/// - `decode_to_vec` allocates at most `decode_limit(frame length)` elements, gives the
///   same values, and rejects a frame `decode` rejected for any reason but the length.
pub fn decode_contract(frame: &[u8], n: usize) -> bool {
    let mut out = vec![f32::from_bits(0x7FA0_0001); n];
    let r = gradpack::decode(frame, &mut out);
    if let Err(e) = &r {
        assert!(!e.to_string().is_empty());
    }
    let mut other = vec![-1.5e-7f32; n];
    assert_eq!(gradpack::decode(frame, &mut other), r);
    if r.is_ok() {
        assert_eq!(
            bits(&other),
            bits(&out),
            "output depends on its previous contents"
        );
    }

    // decode_add: the accumulator is untouched on error and is acc + decode on success.
    let acc0: Vec<f32> = (0..n).map(|i| i as f32 - 0.5).collect();
    let mut acc = acc0.clone();
    let ra = gradpack::decode_add(frame, &mut acc);
    assert_eq!(r.is_ok(), ra.is_ok(), "decode {r:?} but decode_add {ra:?}");
    if ra.is_ok() {
        for i in 0..n {
            assert_eq!(bits_of(acc[i]), bits_of(acc0[i] + out[i]), "element {i}");
        }
    } else {
        assert_eq!(bits(&acc), bits(&acc0), "decode_add touched acc on error");
    }

    // The codec's own entry points agree with the free functions.
    if let Ok((_, spec)) = gradpack::inspect(frame) {
        let mut o2 = vec![0f32; n];
        let r2 = spec.decode_into(frame, &mut o2);
        assert_eq!(r.is_ok(), r2.is_ok());
        if r.is_ok() {
            assert_eq!(bits(&o2), bits(&out));
        }
    }

    // The owning decoder allocates at most decode_limit(frame length) elements.
    match (gradpack::decode_to_vec(frame), &r) {
        (Ok(v), Ok(())) => {
            assert!(v.len() as u64 <= gradpack::decode_limit(frame.len()));
            assert_eq!(bits(&v), bits(&out));
        }
        (Ok(v), Err(Error::OutputLength { .. })) => {
            // The frame is fine at its own length.
            assert!(v.len() as u64 <= gradpack::decode_limit(frame.len()));
        }
        (Ok(_), Err(e)) => panic!("decode_to_vec accepted a frame decode rejected: {e}"),
        (Err(Error::TooLarge { elements, limit }), _) => assert!(elements > limit),
        (Err(e), Ok(())) => panic!("decode accepted what decode_to_vec refused: {e}"),
        (Err(e), Err(_)) => assert!(!e.to_string().is_empty()),
    }
    r.is_ok()
}

/// Output independence: decoding into outputs pre-filled with two different sentinels
/// gives the same result, and on `Ok` the same bits, on every backend this CPU has (the
/// decoders never read the output and every backend writes the scalar oracle's bits).
///
/// Input: the frame.
pub fn output_independence(frame: &[u8]) {
    let n = out_len(frame, frame.len() % 131);
    let decode_with = |b: Backend, sentinel: f32| {
        let mut out = vec![sentinel; n];
        let r = b.run(|| gradpack::decode(frame, &mut out));
        (r, out)
    };
    let scalar = Backend::scalar();
    let (ra, a) = decode_with(scalar, f32::from_bits(0x7FA0_0001));
    let (rb, b) = decode_with(scalar, -1.5e-7);
    assert_eq!(ra, rb);
    if ra.is_ok() {
        assert_eq!(
            bits(&a),
            bits(&b),
            "output depends on its previous contents"
        );
    }
    for be in Backend::available() {
        let (r, o) = decode_with(be, f32::from_bits(0xFFC0_1234));
        assert_eq!(r, ra, "{be}");
        if r.is_ok() {
            assert_eq!(bits(&o), bits(&a), "{be} differs from scalar");
        }
    }
}

/// `Header::parse` and `inspect` on arbitrary bytes: a parsed header writes back to the
/// same 56 bytes; `inspect` agrees with `parse` and gives a spec whose canonical string
/// parses back to it; sealing a valid frame keeps it valid and decoding to the same bits.
///
/// Input: the frame.
pub fn header(frame: &[u8]) {
    let parsed = Header::parse(frame);
    if let Ok(h) = parsed {
        let mut buf = [0u8; HEADER_LEN];
        h.write(&mut buf);
        assert_eq!(
            buf[..],
            frame[..HEADER_LEN],
            "parse/write is not the identity"
        );
        assert_eq!(Header::parse(&buf), Ok(h));
    }
    match gradpack::inspect(frame) {
        Ok((h, spec)) => {
            assert_eq!(parsed, Ok(h));
            assert_eq!(h.frame_len(), Some(frame.len() as u64));
            let text = spec.to_string();
            let again: CodecSpec = text.parse().expect("canonical spec parses");
            assert_eq!(again, spec, "{text}");
            assert_eq!(gradpack::Codec::id(&spec), h.codec);
            if !h.payload_checksum() && h.elements <= MAX_OUT {
                let mut sealed = frame.to_vec();
                sealed.resize(frame.len() + wire::PAYLOAD_CRC_LEN, 0);
                let len = wire::seal(&mut sealed, frame.len()).expect("seal a valid frame");
                assert_eq!(len, sealed.len());
                let (hs, _) = gradpack::inspect(&sealed).expect("sealed frame is valid");
                assert!(hs.payload_checksum());
                let plain = gradpack::decode_to_vec_with_limit(frame, MAX_OUT);
                let closed = gradpack::decode_to_vec_with_limit(&sealed, MAX_OUT);
                match (plain, closed) {
                    (Ok(a), Ok(b)) => assert_eq!(bits(&a), bits(&b)),
                    (a, b) => assert_eq!(a.is_ok(), b.is_ok(), "{a:?} vs {b:?}"),
                }
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

fn spec_of(c: &[u8; 12], n: usize) -> String {
    let block = u16::from_le_bytes([c[1], c[2]]) as u32 % 4096 + 1;
    let v = c[3];
    let ratio = (c[4] as f64 + 1.0) / 256.0;
    let values = match (v & 8 != 0, c[2] & 4 != 0) {
        (true, _) => "fp16",
        (false, true) => "bf16",
        _ => "f32",
    };
    // int8 values (top-k only) on bit 3 of byte 2.
    let topk_values = if c[2] & 8 != 0 { "int8" } else { values };
    let index = ["", ",index=gaps", ",index=rice", ",index=bitmap"][c[2] as usize & 3];
    let approx = if v & 128 != 0 {
        format!(",select=approx,tolerance={}", (c[1] % 5) as f64 / 4.0)
    } else {
        String::new()
    };
    // The entropy stage on bit 7 of byte 2, for the codecs that take it (every block up
    // to 4096 fits its unit).
    let stage = if c[2] & 128 != 0 && matches!(c[0] % 16, 3..=7 | 11..=13) {
        ",entropy=on"
    } else {
        ""
    };
    let spec: String = match c[0] % 16 {
        0 => "identity".into(),
        15 => "lossless".into(),
        1 => "fp16".into(),
        2 => "bf16".into(),
        3 => format!(
            "int8:block={block},rounding={}",
            if v & 1 != 0 { "stochastic" } else { "nearest" }
        ),
        4 => format!(
            "qsgd:bits={},block={block}",
            [2, 4, 8][(v as usize >> 1) % 3]
        ),
        5 => format!("sign:block={block}"),
        6 => format!("ternary:block={block}"),
        7 => format!("natural:block={block}"),
        8 if v & 64 != 0 => format!(
            "topk:threshold={},values={topk_values}{index}",
            c[4] as f32 / 32.0
        ),
        8 if v & 32 != 0 => format!("topk:k={},values={topk_values}{approx}{index}", c[4]),
        8 => format!("topk:ratio={ratio},values={topk_values}{approx}{index}"),
        9 => format!(
            "randk:ratio={ratio},values={values},scale={}{}",
            if v & 16 != 0 { "unbiased" } else { "none" },
            if v & 32 != 0 { ",select=strata" } else { "" }
        ),
        13 => format!("codebook:block={block}"),
        14 => {
            // k of every chunk (both from 1 to the chunk), chunks up to 4096.
            let chunk = block as usize;
            format!("chunktopk:chunk={chunk},k={}", c[4] as usize % chunk + 1)
        }
        12 => format!(
            "fp4:format={},scale={},rounding={},block={}",
            if v & 2 != 0 { "e3m0" } else { "e2m1" },
            ["e8m0", "f32", "e4m3", "e8m0,scale_rule=ocp"][(v as usize >> 2) % 4],
            if v & 1 != 0 { "stochastic" } else { "nearest" },
            (block + 1) & !1,
        ),
        11 => format!(
            "fp8:format={},scale={},rounding={}{}",
            if v & 2 != 0 { "e5m2" } else { "e4m3" },
            ["f32", "e8m0", "none", "e8m0,scale_rule=ocp"][(v as usize >> 2) % 4],
            if v & 1 != 0 { "stochastic" } else { "nearest" },
            if (v >> 2) % 4 == 2 {
                String::new()
            } else {
                format!(",block={block}")
            }
        ),
        _ => {
            let chunk = c[1] as usize % 64 + 1;
            // A row length that divides the element count, or one row.
            let width = match c[4] % 4 {
                0 => 0,
                w => [1, n.max(1), (c[2] as usize % 64 + 1)][w as usize - 1],
            };
            let width = if width > 0 && !n.is_multiple_of(width) {
                1
            } else {
                width
            };
            let full = if width == 0 { chunk } else { chunk * chunk };
            let k = (u16::from_le_bytes([c[4], c[3]]) as usize) % full + 1;
            let values = ["f32", "fp16", "sign", "sign,scale=frame"][(v as usize >> 1) % 4];
            let transform = ["fast", "direct"][v as usize & 1];
            format!("dct:chunk={chunk},k={k},values={values},width={width},transform={transform}")
        }
    };
    spec + stage
}

/// Round trip of every codec on arbitrary f32 values (all bit patterns) and parameters:
/// encode gives byte-identical frames on every backend; the frame decodes on every
/// backend to the same bits, within the codec's documented error bound
/// (`CodecSpec::error_bound`) when the input is finite, and with NaN or Inf still visible
/// when it is not; re-encoding from nothing but the frame's header reproduces it byte for
/// byte; a sealed frame carries the same payload and decodes the same.
///
/// Input: 12 control bytes, then the values (little-endian f32, any bit patterns).
/// - byte 0: codec (`% 16`, in wire-format id order);
/// - bytes 1..3: block size (`u16 % 4096 + 1`, also chunktopk's chunk, whose `k` is
///   `byte 4 % chunk + 1`); dct: chunk `byte 1 % 64 + 1`; for top-k and random-k, bits 0..2 of
///   byte 2 pick the index coding (automatic, gaps, Rice, bitmap; top-k), bit 2 bf16
///   values (unless byte 3 asks for fp16) and bit 3 int8 values (top-k); bit 7 of byte 2
///   the entropy stage (int8, qsgd, sign, ternary, natural, fp8, fp4, codebook);
/// - byte 3: bit 0 stochastic rounding (int8), bits 1..3 QSGD bits (2, 4, 8), bit 3 fp16
///   values (top-k, random-k), bit 4 unbiased scale (random-k), bit 5 an explicit `k`
///   (top-k) or strata selection (random-k), bit 6 a threshold (top-k), bit 7 approximate selection with tolerance
///   `(byte 1 % 5) / 4` (top-k);
/// - byte 4: ratio `(b + 1) / 256` (top-k, random-k), `k = b` (top-k with bit 5) or
///   threshold `b / 32` (top-k with bit 6); dct: `b % 4` picks one row, rows of 1, one
///   row of all, or rows of `byte 2 % 64 + 1` (1 when that does not divide the count),
///   `k` is `u16(byte 4, byte 3) % T + 1`, values by bits 1..3 of byte 3, the direct
///   transform when bit 0 of byte 3 is set (else the factorised one);
/// - bytes 5..8: offset (u24); bytes 8..12: seed (u32).
pub fn roundtrip(data: &[u8]) {
    if data.len() < 12 {
        return;
    }
    let (control, values) = data.split_at(12);
    let control: &[u8; 12] = control.try_into().unwrap();
    let x: Vec<f32> = values
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let text = spec_of(control, x.len());
    let spec: CodecSpec = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
    let offset = u32::from_le_bytes([control[5], control[6], control[7], 0]) as u64;
    let seed = u32::from_le_bytes(control[8..12].try_into().unwrap()) as u64;
    let ctx = EncodeCtx::new(seed).with_offset(offset);

    // Encode on every backend: the same bytes.
    let frame = spec
        .encode(&x, &ctx)
        .unwrap_or_else(|e| panic!("{text}: {e}"));
    assert!(frame.len() <= spec.max_encoded_len(x.len()));
    for b in Backend::available() {
        let f = b.run(|| spec.encode(&x, &ctx)).unwrap();
        assert!(
            f == frame,
            "{text}: {b} encodes differently from the default backend"
        );
    }

    // Decode on every backend: the same bits, decode_add agrees.
    let d = gradpack::decode_to_vec(&frame).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert_eq!(d.len(), x.len());
    for b in Backend::available() {
        let mut o = vec![f32::NAN; x.len()];
        b.run(|| spec.decode_into(&frame, &mut o)).unwrap();
        assert_eq!(bits(&o), bits(&d), "{text}: {b} decodes differently");
        let mut acc = vec![1.0f32; x.len()];
        b.run(|| spec.decode_add(&frame, &mut acc)).unwrap();
        for i in 0..x.len() {
            assert_eq!(
                bits_of(acc[i]),
                bits_of(1.0 + d[i]),
                "{text}: {b} decode_add"
            );
        }
    }

    // The documented bound on finite input; non-finite input stays visible.
    let (h, from_header) = gradpack::inspect(&frame).unwrap();
    if x.iter().all(|v| v.is_finite()) {
        assert!(!h.nonfinite());
        let absmax = x.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let bound = spec.error_bound(absmax);
        for i in 0..x.len() {
            let e = (x[i] as f64 - d[i] as f64).abs();
            // An infinite bound (a value type's overflow) promises nothing: dct's inverse
            // can turn fp16 coefficients that overflowed into Inf - Inf = NaN.
            assert!(
                bound.is_infinite() || e <= bound,
                "{text}: element {i}: {:e} decoded as {:e}, error {e:e} > bound {bound:e}",
                x[i],
                d[i]
            );
        }
    } else {
        assert!(h.nonfinite(), "{text}: NONFINITE flag missing");
        // Visible in the decoding too, unless the frame keeps no element at all (top-k
        // with k = 0: the flag is then the only trace).
        let keeps_none = matches!(from_header, CodecSpec::TopK(_))
            && u64::from_le_bytes(h.params[..8].try_into().unwrap()) == 0;
        assert!(
            keeps_none || d.iter().any(|v| !v.is_finite()),
            "{text}: NaN/Inf lost in decoding"
        );
    }

    // Re-encode from the header alone: byte-identical.
    let again = from_header
        .encode(&x, &EncodeCtx::new(h.seed).with_offset(h.offset))
        .unwrap();
    assert!(again == frame, "{text}: re-encode from the header differs");

    // Sealed: the same payload plus a checksum, the same decoding.
    let sealed = Checksummed(spec).encode(&x, &ctx).unwrap();
    assert_eq!(sealed.len(), frame.len() + 4);
    assert_eq!(sealed[56..frame.len()], frame[56..]);
    let ds = gradpack::decode_to_vec(&sealed).unwrap();
    assert_eq!(bits(&ds), bits(&d));
}

// ---------------------------------------------------------------- npy

#[path = "../../src/bin/gradpack/npy.rs"]
mod npy;

/// `npy`: any bytes into the CLI's `.npy` reader: `Ok` or `Err`, never a panic, and no
/// allocation past the file's own data (the reader checks the shape's byte count
/// against the bytes present before it allocates). What it accepts holds exactly the
/// file's data bytes, and writing it back and reading again gives the same bits.
pub fn npy(data: &[u8]) {
    let Ok(a) = npy::read(data) else {
        return;
    };
    let x = a.values;
    // At most 2 bytes per value (float16) came from the file.
    assert!(
        x.len() * 2 <= data.len(),
        "{} values from {} bytes",
        x.len(),
        data.len()
    );
    let count: u64 = a.shape.iter().product();
    assert_eq!(count, x.len() as u64, "shape {:?}", a.shape);
    let again = npy::read(&npy::write(&x, Some(&a.shape))).expect("the writer's output reads back");
    assert_eq!(bits(&again.values), bits(&x));
    assert_eq!(again.shape, a.shape);
    assert!(again.converted.is_none());
}

// ---------------------------------------------------------------- collective_recv

use gradpack::collective::{
    AllReduce, AllReduceOptions, BucketGather, Comm, ReduceOp, Strategy, StrategyChoice, Transport,
};

/// A rank whose peers' messages come from a script: every send is taken (and dropped),
/// every receive gets the next scripted message, and an empty script is a peer that
/// left.
pub struct Scripted {
    pub rank: usize,
    pub size: usize,
    pub script: std::collections::VecDeque<Vec<u8>>,
    /// Messages this rank sent, in order (what a seed records).
    pub sent: Vec<(usize, Vec<u8>)>,
}

impl Transport for Scripted {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn send(&mut self, msg: &[u8], to: usize) -> gradpack::Result<()> {
        self.sent.push((to, msg.to_vec()));
        Ok(())
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> gradpack::Result<()> {
        match self.script.pop_front() {
            Some(m) if m.len() > max => Err(Error::Transport {
                peer: from,
                reason: format!("a message of {} bytes where at most {max} fit", m.len()),
            }),
            Some(m) => {
                *buf = m;
                Ok(())
            }
            None => Err(Error::Transport {
                peer: from,
                reason: "the script has ended".into(),
            }),
        }
    }
}

/// The codecs and strategies of [`AllReduce`] the `collective_recv` control bytes choose
/// from (cases 0 to 7).
pub const COLLECTIVE_CASES: [(&str, Strategy); 8] = [
    ("int8:rounding=stochastic", Strategy::CompressedRing),
    ("qsgd:bits=4,block=64", Strategy::CompressedAllGather),
    ("sign:block=32", Strategy::SignMajority),
    ("identity", Strategy::Fp32Ring),
    ("topk:ratio=0.1,values=fp16", Strategy::CompressedRing),
    ("randk:ratio=0.25", Strategy::CompressedAllGather),
    ("int8:rounding=stochastic", Strategy::TwoShot),
    ("topk:ratio=0.1,values=fp16", Strategy::TwoShot),
];

/// The buckets of [`BucketGather`] the `collective_recv` control bytes choose from (cases
/// 8 and 9): each tensor's codec and its share of the elements, in thirds, in order.
pub const BUCKET_CASES: [&[(&str, usize)]; 2] = [
    &[("int8", 2), ("identity", 1)],
    &[
        ("topk:ratio=0.1,values=fp16", 1),
        ("qsgd:bits=4,block=64", 1),
        ("fp16", 1),
    ],
];

/// How many cases the control byte chooses from: [`COLLECTIVE_CASES`], then
/// [`BUCKET_CASES`].
pub const CASES: usize = COLLECTIVE_CASES.len() + BUCKET_CASES.len();

/// One case of `collective_recv`.
#[derive(Clone, Copy)]
enum Case {
    AllReduce(&'static str, Strategy),
    Bucket(&'static [(&'static str, usize)]),
}

/// Case `i` (below [`CASES`]).
fn case_of(i: usize) -> Case {
    match COLLECTIVE_CASES.get(i) {
        Some(&(spec, strategy)) => Case::AllReduce(spec, strategy),
        None => Case::Bucket(BUCKET_CASES[i - COLLECTIVE_CASES.len()]),
    }
}

/// A bucket case's segments of `n` elements (`n` a multiple of 3) and each one's codec.
fn bucket_layout(case: &[(&str, usize)], n: usize) -> Vec<(CodecSpec, core::ops::Range<usize>)> {
    let mut at = 0;
    case.iter()
        .map(|&(spec, thirds)| {
            let len = n / 3 * thirds;
            at += len;
            (spec.parse().expect("bucket case spec"), at - len..at)
        })
        .collect()
}

/// One rank's message for a bucket case: its frames of `input`'s segments, concatenated.
fn bucket_message(
    layout: &[(CodecSpec, core::ops::Range<usize>)],
    input: &[f32],
    seed: u64,
) -> Vec<u8> {
    let mut msg = Vec::new();
    for (i, (codec, seg)) in layout.iter().enumerate() {
        let ctx = EncodeCtx::new(seed * 16 + i as u64);
        msg.extend(
            codec
                .encode(&input[seg.clone()], &ctx)
                .expect("bucket case encode"),
        );
    }
    msg
}

/// The input of `collective_recv`: control bytes, then each message as a u16 LE length
/// and its bytes (a truncated last message is cut short).
pub fn collective_script(control: [u8; 4], messages: &[Vec<u8>]) -> Vec<u8> {
    let mut d = control.to_vec();
    for m in messages {
        d.extend_from_slice(&(m.len().min(u16::MAX as usize) as u16).to_le_bytes());
        d.extend_from_slice(&m[..m.len().min(u16::MAX as usize)]);
    }
    d
}

/// `collective_recv`: one rank of an all-reduce whose every received message is fuzz
/// input (a frame from a peer at any step, place or state), or one rank of a bucket
/// all-gather whose every received message is. Bytes 0..4: world size `2 + b0 % 3`, this
/// rank `b1 % size`, the case `b2 % CASES` ([`COLLECTIVE_CASES`], then [`BUCKET_CASES`]),
/// elements `b3 * 3`; then the messages (see [`collective_script`]). Three calls run on
/// one `Comm`. Each gives `Ok` or `Err`, never a panic; the output keeps its length; a
/// call whose messages were not all consumed cannot have succeeded unless those left
/// belong to later calls.
pub fn collective_recv(data: &[u8]) {
    collective_run(data);
}

/// [`collective_recv`]'s run; returns how many of its calls succeeded.
pub fn collective_run(data: &[u8]) -> usize {
    if data.len() < 4 {
        return 0;
    }
    let size = 2 + usize::from(data[0] % 3);
    let rank = usize::from(data[1]) % size;
    let case = usize::from(data[2]) % CASES;
    let n = usize::from(data[3]) * 3;
    let mut script = std::collections::VecDeque::new();
    let mut rest = &data[4..];
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
        let end = (2 + len).min(rest.len());
        script.push_back(rest[2..end].to_vec());
        rest = &rest[end..];
    }
    let t = Scripted {
        rank,
        size,
        script,
        sent: Vec::new(),
    };
    let input: Vec<f32> = (0..n).map(|i| ((i * 7 + rank) % 13) as f32 - 6.0).collect();
    let (spec, strategy) = match case_of(case) {
        Case::AllReduce(spec, strategy) => (spec, strategy),
        Case::Bucket(bucket) => return bucket_run(t, bucket, &input),
    };
    let codec: CodecSpec = spec.parse().expect("case spec");
    let opts = AllReduceOptions {
        strategy: StrategyChoice::Forced(strategy),
        ..Default::default()
    };
    let mut ar = AllReduce::new(codec, n, &t, opts).expect("all-reduce state");
    let mut comm = Comm::new(t);
    let mut ok = 0;
    for seed in 0..3 {
        let mut out = vec![0f32; n];
        match ar.run(&mut comm, &input, &mut out, seed) {
            Ok(_) => ok += 1,
            Err(_) => ar.reset_feedback(),
        }
        assert_eq!(out.len(), n);
    }
    ok
}

/// [`collective_run`]'s bucket cases: three bucket all-gathers of `input`.
fn bucket_run(t: Scripted, bucket: &[(&str, usize)], input: &[f32]) -> usize {
    let n = input.len();
    let layout = bucket_layout(bucket, n);
    let segments: Vec<_> = layout.iter().map(|(_, s)| s.clone()).collect();
    let mut g = BucketGather::new(&t, 3, ReduceOp::Sum).expect("bucket state");
    let mut comm = Comm::new(t);
    let mut ok = 0;
    for seed in 0..3 {
        let msg = bucket_message(&layout, input, seed);
        let mut out = vec![0f32; n];
        if g.run(&mut comm, &msg, &segments, None, &mut out).is_ok() {
            ok += 1;
        }
        assert_eq!(out.len(), n);
    }
    ok
}

/// Seeds for `collective_recv`: for each case and world size, the messages rank 0
/// receives in three fault-free calls of a real in-process world (so the fuzzer starts
/// from valid envelopes and frames).
pub fn collective_seeds() -> Vec<(String, Vec<u8>)> {
    use gradpack::collective::local;
    let mut seeds = Vec::new();
    for case in 0..CASES {
        for size in 2..5usize {
            let n = 40 * 3;
            let got = local::run(size, None, |t| {
                let r = t.rank();
                let input: Vec<f32> = (0..n).map(|i| ((i * 7 + r) % 13) as f32 - 6.0).collect();
                // Record what rank 0 receives, in the order it receives it (from its left
                // neighbour in the ring and the frame all-gather, from every peer in the
                // two-shot).
                let recorder = |t: gradpack::collective::local::Local| {
                    Comm::new(Recorder {
                        inner: t,
                        got: Vec::new(),
                    })
                };
                let mut out = vec![0f32; n];
                let (spec, strategy) = match case_of(case) {
                    Case::AllReduce(spec, strategy) => (spec, strategy),
                    Case::Bucket(bucket) => {
                        let layout = bucket_layout(bucket, n);
                        let segments: Vec<_> = layout.iter().map(|(_, s)| s.clone()).collect();
                        let mut g = BucketGather::new(&t, 3, ReduceOp::Sum)?;
                        let mut comm = recorder(t.into_inner());
                        for seed in 0..3 {
                            let msg = bucket_message(&layout, &input, seed);
                            g.run(&mut comm, &msg, &segments, None, &mut out)?;
                        }
                        return Ok(comm.into_inner().got);
                    }
                };
                let codec: CodecSpec = spec.parse().expect("case spec");
                let opts = AllReduceOptions {
                    strategy: StrategyChoice::Forced(strategy),
                    ..Default::default()
                };
                let mut ar = AllReduce::new(codec, n, &t, opts)?;
                let mut comm = recorder(t.into_inner());
                for seed in 0..3 {
                    ar.run(&mut comm, &input, &mut out, seed)?;
                }
                Ok(comm.into_inner().got)
            });
            let to_zero: Vec<Vec<u8>> = got[0]
                .as_ref()
                .expect("clean world")
                .iter()
                .map(|(_, m)| m.clone())
                .collect();
            let control = [(size - 2) as u8, 0, case as u8, 40];
            seeds.push((
                format!("{case}-{size}"),
                collective_script(control, &to_zero),
            ));
        }
    }
    seeds
}

/// An in-process transport that records what it receives.
struct Recorder {
    inner: gradpack::collective::local::Local,
    /// What this rank received, and from whom, in order.
    got: Vec<(usize, Vec<u8>)>,
}

impl Transport for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> gradpack::Result<()> {
        self.inner.send(msg, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> gradpack::Result<()> {
        self.inner.recv(buf, from, max)?;
        self.got.push((from, buf.clone()));
        Ok(())
    }
}

/// The CLI's `.npy` writer, for tests that build inputs.
pub fn npy_write_for_tests(x: &[f32]) -> Vec<u8> {
    npy::write(x, None)
}
