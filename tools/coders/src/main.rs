//! gradpack's entropy coding measured against a well-kept entropy coder crate
//! (constriction's rANS coder) and a general-purpose compressor (zstd), on the same
//! gradients, one thread.
//!
//! For each gradient (a synthetic one, the same with a quarter of it +0.0, and the
//! first 1 Mi elements of each .npy file named on the command line) it prints, per
//! pipeline, the bytes as a share of the f32 input's and the encode and decode speed in
//! GB/s of f32 input (the median of several runs), after checking that every pipeline
//! decodes to the input's bits:
//!
//! - floats, lossless: gradpack's `lossless` codec; the same planes (exponent bytes
//!   coded, sign and mantissa bits kept) with the exponents coded by constriction's
//!   rANS coder (its "small" preset: 16-bit words, 12-bit probabilities, a lookup
//!   table to decode, the fastest it offers); zstd at level 1 and 3 on the f32 bytes;
//! - int8 codes: `int8:entropy=on`; the plain int8 frame's bytes coded by the rANS
//!   coder; zstd at level 1 on the plain int8 frame.
//!
//!     cd tools/coders && cargo run --release -- ../../target/grads/mlp-step1.npy

use std::hint::black_box;
use std::time::Instant;

use constriction::stream::Decode;
use constriction::stream::model::{
    SmallContiguousCategoricalEntropyModel, SmallContiguousLookupDecoderModel,
};
use constriction::stream::stack::SmallAnsCoder;
use gradpack::{Codec, CodecSpec, EncodeCtx};

/// Elements per gradient.
const N: usize = 1 << 20;
/// Timed runs per measurement (the median is kept).
const RUNS: usize = 15;

/// The first `N` f32 values of a little-endian float32 .npy file.
fn read_npy(path: &str) -> Vec<f32> {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(b.starts_with(b"\x93NUMPY"), "{path}: not a .npy file");
    let (head, at) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
    };
    let header = String::from_utf8_lossy(&b[at..at + head]);
    assert!(
        header.contains("'<f4'"),
        "{path}: not little-endian float32"
    );
    assert!(
        header.contains("'fortran_order': False"),
        "{path}: not C order"
    );
    b[at + head..]
        .chunks_exact(4)
        .take(N)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The median seconds of `RUNS` calls of `f`.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..RUNS)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[RUNS / 2]
}

/// A pipeline's bytes and speeds.
struct Row {
    name: &'static str,
    bytes: usize,
    encode_s: f64,
    decode_s: f64,
}

/// A gradpack codec, encoded and decoded through its public API.
fn gradpack_row(name: &'static str, spec: &str, x: &[f32]) -> Row {
    let codec: CodecSpec = spec.parse().unwrap();
    let ctx = EncodeCtx::new(1);
    let mut frame = vec![0u8; codec.max_encoded_len(x.len())];
    let mut len = 0;
    let encode_s = time(|| len = codec.encode_into(black_box(x), &ctx, &mut frame).unwrap());
    let mut out = vec![0f32; x.len()];
    let decode_s = time(|| {
        codec
            .decode_into(black_box(&frame[..len]), &mut out)
            .unwrap()
    });
    if spec == "lossless" {
        assert!(out.iter().zip(x).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    Row {
        name,
        bytes: len,
        encode_s,
        decode_s,
    }
}

/// Byte symbols coded by constriction's rANS coder with the stream's own histogram;
/// returns the compressed words and the table's bytes (256 u16 counts, as a frame would
/// carry them).
struct Rans {
    encoder: SmallContiguousCategoricalEntropyModel,
    decoder: SmallContiguousLookupDecoderModel,
}

impl Rans {
    /// The models of `sym`'s histogram (built as part of every encode: a frame's table).
    fn new(sym: &[u8]) -> Rans {
        let mut count = [0f64; 256];
        sym.iter().for_each(|&s| count[s as usize] += 1.0);
        Rans {
            encoder:
                SmallContiguousCategoricalEntropyModel::from_floating_point_probabilities_fast(
                    &count, None,
                )
                .unwrap(),
            decoder: SmallContiguousLookupDecoderModel::from_floating_point_probabilities_fast(
                &count, None,
            )
            .unwrap(),
        }
    }

    fn encode(&self, sym: &[u8]) -> Vec<u16> {
        let mut coder = SmallAnsCoder::new();
        coder
            .encode_iid_symbols_reverse(sym.iter().map(|&s| s as usize), &self.encoder)
            .unwrap();
        coder.into_compressed().unwrap()
    }

    fn decode(&self, words: &[u16], out: &mut [u8]) {
        let mut coder =
            constriction::stream::stack::AnsCoder::<u16, u32, _>::from_compressed_slice(words)
                .unwrap();
        let n = out.len();
        for (o, s) in out
            .iter_mut()
            .zip(coder.decode_iid_symbols(n, &self.decoder))
        {
            *o = s.unwrap() as u8;
        }
        assert!(coder.is_empty());
    }
}

/// Table bytes a frame of the rANS pipelines carries: 256 u16 counts.
const RANS_TABLE: usize = 512;

/// `lossless`'s planes with the exponents coded by rANS.
fn rans_floats(x: &[f32]) -> Row {
    let n = x.len();
    let (mut exps, mut lo, mut top) = (vec![0u8; n], vec![0u16; n], vec![0u8; n]);
    let mut words = Vec::new();
    let mut rans = None;
    let encode_s = time(|| {
        for (i, v) in black_box(x).iter().enumerate() {
            let b = v.to_bits();
            exps[i] = (b >> 23) as u8;
            lo[i] = b as u16;
            top[i] = (((b >> 24) & 0x80) | ((b >> 16) & 0x7F)) as u8;
        }
        let r = Rans::new(&exps);
        words = r.encode(&exps);
        rans = Some(r);
    });
    let rans = rans.unwrap();
    let bytes = 2 * words.len() + RANS_TABLE + 3 * n;
    let mut out = vec![0f32; n];
    let mut got = vec![0u8; n];
    let decode_s = time(|| {
        rans.decode(&words, &mut got);
        for (i, o) in out.iter_mut().enumerate() {
            let (t, e) = (top[i] as u32, got[i] as u32);
            *o = f32::from_bits((t & 0x80) << 24 | e << 23 | (t & 0x7F) << 16 | lo[i] as u32);
        }
    });
    assert!(out.iter().zip(x).all(|(a, b)| a.to_bits() == b.to_bits()));
    Row {
        name: "exponents by constriction rANS",
        bytes,
        encode_s,
        decode_s,
    }
}

/// zstd at `level` on `bytes`; the decode time includes `then` on the bytes decoded.
fn zstd_row(
    name: &'static str,
    level: i32,
    encode_first: impl Fn() -> Vec<u8>,
    then: impl Fn(&[u8]),
) -> Row {
    let mut packed = Vec::new();
    let encode_s = time(|| packed = zstd::bulk::compress(&encode_first(), level).unwrap());
    let raw = encode_first().len();
    let decode_s = time(|| then(&zstd::bulk::decompress(black_box(&packed), raw).unwrap()));
    Row {
        name,
        bytes: packed.len(),
        encode_s,
        decode_s,
    }
}

/// The plain int8 frame's bytes coded by rANS (its header and scales among them).
fn rans_int8(x: &[f32]) -> Row {
    let int8: CodecSpec = "int8".parse().unwrap();
    let ctx = EncodeCtx::new(1);
    let mut frame = vec![0u8; int8.max_encoded_len(x.len())];
    let mut words = Vec::new();
    let mut rans = None;
    let mut len = 0;
    let encode_s = time(|| {
        len = int8.encode_into(black_box(x), &ctx, &mut frame).unwrap();
        let r = Rans::new(&frame[..len]);
        words = r.encode(&frame[..len]);
        rans = Some(r);
    });
    let rans = rans.unwrap();
    let bytes = 2 * words.len() + RANS_TABLE;
    let mut got = vec![0u8; len];
    let mut out = vec![0f32; x.len()];
    let decode_s = time(|| {
        rans.decode(&words, &mut got);
        int8.decode_into(&got, &mut out).unwrap();
    });
    assert_eq!(got, frame[..len]);
    Row {
        name: "int8 frame by constriction rANS",
        bytes,
        encode_s,
        decode_s,
    }
}

fn main() {
    let synthetic = gradpack::synthetic::gradient(N, 7);
    // A quarter of it +0.0 in runs of 2500 (dead units of a 2500-wide layer).
    let dead: Vec<f32> = synthetic
        .iter()
        .enumerate()
        .map(|(i, &v)| if (i / 2500) % 4 == 1 { 0.0 } else { v })
        .collect();
    let mut inputs: Vec<(String, Vec<f32>)> = vec![
        ("synthetic".into(), synthetic),
        ("synthetic, a quarter +0.0 in runs".into(), dead),
    ];
    for path in std::env::args().skip(1) {
        let x = read_npy(&path);
        inputs.push((path, x));
    }
    for (name, x) in &inputs {
        let raw = 4 * x.len();
        let f32_bytes = || bytemuck_bytes(x);
        let int8: CodecSpec = "int8".parse().unwrap();
        let int8_frame = || int8.encode(x, &EncodeCtx::new(1)).unwrap();
        let rows = [
            gradpack_row("gradpack lossless", "lossless", x),
            rans_floats(x),
            zstd_row("zstd -1 on the f32 bytes", 1, f32_bytes, |_| ()),
            zstd_row("zstd -3 on the f32 bytes", 3, f32_bytes, |_| ()),
            gradpack_row("int8 (plain)", "int8", x),
            gradpack_row("gradpack int8:entropy=on", "int8:entropy=on", x),
            rans_int8(x),
            zstd_row("zstd -1 on the int8 frame", 1, int8_frame, |b| {
                let mut out = vec![0f32; x.len()];
                int8.decode_into(b, &mut out).unwrap();
            }),
        ];
        let mut copy = vec![0f32; x.len()];
        let memcpy_s = time(|| copy.copy_from_slice(black_box(x)));
        println!(
            "\n{name}: {} elements (memcpy {:.1} GB/s)",
            x.len(),
            raw as f64 / memcpy_s / 1e9
        );
        println!(
            "{:34} {:>7} {:>9} {:>9}",
            "pipeline", "bytes", "enc GB/s", "dec GB/s"
        );
        for r in rows {
            println!(
                "{:34} {:>7.3} {:>9.2} {:>9.2}",
                r.name,
                r.bytes as f64 / raw as f64,
                raw as f64 / r.encode_s / 1e9,
                raw as f64 / r.decode_s / 1e9
            );
        }
    }
}

/// The little-endian bytes of `x`.
fn bytemuck_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
