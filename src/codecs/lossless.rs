//! `lossless`: floats with their exponents entropy-coded, decoded to the same bits.
//!
//! Spec: `lossless` or `lossless:dtype=f32|bf16|fp16` (header param byte 0, the element
//! type: 0 f32, 1 bf16, 2 fp16).
//!
//! Payload for `n` f32 elements with bits `b`:
//!
//! 1. the exponents `(b >> 23) & 0xFF` as one entropy-coded block of `n` symbols (stored,
//!    one symbol, or four streams of canonical Huffman codes of at most 11 bits: the
//!    crate's entropy block, specified with the wire format);
//! 2. `n` × u16 LE, the low 16 bits of each element, `b & 0xFFFF`;
//! 3. `n` bytes, the sign and the top 7 mantissa bits, `(b >> 24) & 0x80 | (b >> 16) & 0x7F`.
//!
//! With `dtype=bf16` every input must be a bf16 value (its low 16 bits zero): the payload
//! is parts 1 and 3 alone. With `dtype=fp16` every input must be an fp16 value (it comes
//! back from fp16 to the same f32 bits; fp16's signalling NaNs have no such f32): the
//! payload is the 5-bit exponents of the fp16 bits `h` as one entropy block, `n` bytes
//! `(h >> 8) & 0x80 | (h >> 3) & 0x7F`, then the low 3 mantissa bits `h & 7` of each
//! element as a 3-bit stream. An input that is not of the type is an error, never
//! rounded.
//!
//! Every element comes back with its bits: -0, subnormals, ±Inf and NaN payloads included.
//! A gradient's exponents fall in a few binades, so they take about 3 of their 8 bits:
//! an f32 frame is about 0.85 of identity's bytes, a bf16 one about 0.7 of bf16's.

use super::{EncodeCtx, Encoded, Scheme};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::{self, entropy};
use crate::wire::{HEADER_LEN, Header};

/// Elements reassembled per pass of a decode (16 KiB of f32 on the stack).
const CHUNK: usize = 4096;

/// The element type a [`Lossless`] codec sends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FloatType {
    /// IEEE binary32: any f32.
    #[default]
    F32 = 0,
    /// bfloat16: f32 values whose low 16 bits are zero.
    Bf16 = 1,
    /// IEEE binary16: f32 values that fp16 holds exactly.
    Fp16 = 2,
}

impl FloatType {
    fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::Bf16 => "bf16",
            FloatType::Fp16 => "fp16",
        }
    }
}

/// Floats with entropy-coded exponents, exact: about 27 bits per element on f32
/// gradients, 11 on bf16 ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lossless {
    dtype: FloatType,
}

impl Lossless {
    /// The codec for elements of type `dtype`.
    pub fn new(dtype: FloatType) -> Lossless {
        Lossless { dtype }
    }

    /// The element type.
    pub fn dtype(&self) -> FloatType {
        self.dtype
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Lossless, String> {
        let dtype = match a.choice("dtype", "f32", &["f32", "bf16", "fp16"])? {
            "bf16" => FloatType::Bf16,
            "fp16" => FloatType::Fp16,
            _ => FloatType::F32,
        };
        Ok(Lossless { dtype })
    }

    /// Payload bytes past the exponents' block.
    fn planes(&self, n: u64) -> u64 {
        match self.dtype {
            FloatType::F32 => n.saturating_mul(3),
            FloatType::Bf16 => n,
            FloatType::Fp16 => n.saturating_add(n.saturating_mul(3).div_ceil(8)),
        }
    }
}

impl core::fmt::Display for Lossless {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.dtype {
            FloatType::F32 => f.write_str("lossless"),
            t => write!(f, "lossless:dtype={}", t.name()),
        }
    }
}

impl From<Lossless> for CodecSpec {
    fn from(c: Lossless) -> CodecSpec {
        CodecSpec::Lossless(c)
    }
}

/// The exponent field of `v`.
#[inline(always)]
fn exponent(v: f32) -> u8 {
    (v.to_bits() >> 23) as u8
}

/// The byte of sign and top mantissa bits of `b`.
#[inline(always)]
fn top(b: u32) -> u8 {
    (((b >> 24) & 0x80) | ((b >> 16) & 0x7F)) as u8
}

/// The f32 bits of an exponent, low half and top byte.
#[inline(always)]
fn join(e: u8, lo: u16, t: u8) -> u32 {
    ((t as u32 & 0x80) << 24) | ((e as u32) << 23) | ((t as u32 & 0x7F) << 16) | lo as u32
}

/// A `Corrupt` error at `at` bytes into the payload.
fn corrupt((at, reason): entropy::Refused) -> Error {
    Error::Corrupt {
        codec: CodecId::Lossless,
        offset: HEADER_LEN + at,
        reason,
    }
}

impl Scheme for Lossless {
    const ID: CodecId = CodecId::Lossless;

    fn max_payload(&self, n: u64) -> u64 {
        entropy::max_len(n).saturating_add(self.planes(n))
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        match self.dtype {
            FloatType::F32 => {}
            FloatType::Bf16 => return self.encode_bf16(x, out),
            FloatType::Fp16 => return self.encode_fp16(x, out),
        }
        let n = x.len();
        let out = super::payload_buf(out, self.max_payload(n as u64))?;
        let at = entropy::encode(n, |i| exponent(x[i]), 1, out);
        let (lo, rest) = out[at..].split_at_mut(2 * n);
        let mut nonfinite = false;
        for ((l, t), v) in lo.chunks_exact_mut(2).zip(&mut rest[..n]).zip(x) {
            let b = v.to_bits();
            l.copy_from_slice(&(b as u16).to_le_bytes());
            *t = top(b);
            nonfinite |= exponent(*v) == 0xFF;
        }
        Ok(Encoded {
            payload_len: (at + 3 * n) as u64,
            params: [0; 12],
            nonfinite,
            seed: 0,
            entropy: false,
        })
    }

    fn read(h: &Header) -> Result<Lossless> {
        let dtype = match h.params[0] {
            0 => FloatType::F32,
            1 => FloatType::Bf16,
            2 => FloatType::Fp16,
            t => {
                return Err(Error::BadField {
                    codec: h.codec,
                    field: "params.dtype",
                    reason: format!("{t} is not 0 (f32), 1 (bf16) or 2 (fp16)"),
                });
            }
        };
        h.params_zero_from(1)?;
        h.seed_zero()?;
        let c = Lossless { dtype };
        let n = h.elements;
        // The smallest payload: an entropy block's mode byte and the plane bytes.
        let least = c.planes(n).saturating_add(1);
        if h.payload_len < least || h.payload_len > c.max_payload(n) {
            return Err(corrupt((
                0,
                format!(
                    "a payload of {} bytes for {n} elements (from {least} to {})",
                    h.payload_len,
                    c.max_payload(n)
                ),
            )));
        }
        Ok(c)
    }

    fn decode_payload<const M: u8>(
        &self,
        _h: &Header,
        payload: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        let n = out.len();
        let block = open::<M>(payload, n)?;
        let at = block.bytes();
        let planes = self.planes(n as u64) as usize;
        if payload.len() - at != planes {
            return Err(corrupt((
                at,
                format!(
                    "{} bytes after the exponents for {n} elements (want {planes})",
                    payload.len() - at,
                ),
            )));
        }
        match self.dtype {
            FloatType::F32 => {}
            FloatType::Bf16 => return decode_bf16::<M>(&block, &payload[at..], out),
            FloatType::Fp16 => return decode_fp16::<M>(&block, &payload[at..], at, out),
        }
        let (lo, tops) = payload[at..].split_at(2 * n);
        let mut words = [0u32; CHUNK];
        block
            .for_each_chunk::<CHUNK>(CHUNK, |start, exps| {
                let k = exps.len();
                let (w, lo, tops) = (
                    &mut words[..k],
                    &lo[2 * start..2 * (start + k)],
                    &tops[start..start + k],
                );
                for i in 0..k {
                    let l = lo[2 * i] as u16 | (lo[2 * i + 1] as u16) << 8;
                    w[i] = join(exps[i], l, tops[i]);
                }
                kernels::decode_f32::<M>(bytemuck::cast_slice(w), &mut out[start..start + k]);
            })
            .map_err(corrupt)
    }

    fn expected_payload(&self, n: u64) -> f64 {
        // Normal data's exponents take 2.6 bits (an f32 frame 0.831 of identity's at 1 Mi
        // elements; 0.838 for a Student-t with 3 degrees of freedom); fp16's 5-bit
        // exponents about 2.4.
        let exponents = match self.dtype {
            FloatType::Fp16 => 0.3,
            _ => 0.33,
        };
        n as f64 * exponents + self.planes(n) as f64 + entropy::HUFFMAN_HEADER as f64
    }

    fn is_unbiased(&self) -> bool {
        true
    }
}

impl Lossless {
    /// Encode bf16 values: their exponents, then their sign-and-mantissa bytes.
    fn encode_bf16(&self, x: &[f32], out: &mut [u8]) -> Result<Encoded> {
        if let Some(i) = x.iter().position(|v| v.to_bits() & 0xFFFF != 0) {
            return Err(not_of_type(FloatType::Bf16, i, x[i]));
        }
        let n = x.len();
        let out = super::payload_buf(out, self.max_payload(n as u64))?;
        let at = entropy::encode(n, |i| exponent(x[i]), 1, out);
        let mut nonfinite = false;
        for (t, v) in out[at..at + n].iter_mut().zip(x) {
            *t = top(v.to_bits());
            nonfinite |= exponent(*v) == 0xFF;
        }
        Ok(self.encoded((at + n) as u64, nonfinite))
    }

    /// Encode fp16 values: their 5-bit exponents, their sign and top 7 mantissa bits,
    /// then the low 3 mantissa bits as a 3-bit stream.
    fn encode_fp16(&self, x: &[f32], out: &mut [u8]) -> Result<Encoded> {
        let half = |v: f32| kernels::scalar::f32_to_f16(v);
        let exact = |v: &f32| kernels::scalar::f16_to_f32(half(*v)).to_bits() == v.to_bits();
        if let Some(i) = x.iter().position(|v| !exact(v)) {
            return Err(not_of_type(FloatType::Fp16, i, x[i]));
        }
        let n = x.len();
        let out = super::payload_buf(out, self.max_payload(n as u64))?;
        let at = entropy::encode(n, |i| ((half(x[i]) >> 10) & 0x1F) as u8, 1, out);
        let (tops, lows) = out[at..].split_at_mut(n);
        let lows = &mut lows[..(3 * n).div_ceil(8)];
        lows.fill(0);
        let mut nonfinite = false;
        for (i, (t, v)) in tops.iter_mut().zip(x).enumerate() {
            let h = half(*v);
            *t = (((h >> 8) & 0x80) | ((h >> 3) & 0x7F)) as u8;
            put3(lows, i, (h & 7) as u8);
            nonfinite |= h & 0x7C00 == 0x7C00;
        }
        Ok(self.encoded((at + n + lows.len()) as u64, nonfinite))
    }

    fn encoded(&self, payload_len: u64, nonfinite: bool) -> Encoded {
        let mut params = [0u8; 12];
        params[0] = self.dtype as u8;
        Encoded {
            payload_len,
            params,
            nonfinite,
            seed: 0,
            entropy: false,
        }
    }
}

/// Write the 3-bit `code` as element `i` of a zeroed LSB-first stream.
fn put3(out: &mut [u8], i: usize, code: u8) {
    let (byte, shift) = (3 * i / 8, 3 * i % 8);
    out[byte] |= code << shift;
    if shift > 5 {
        out[byte + 1] |= code >> (8 - shift);
    }
}

/// Element `i` of an LSB-first stream of 3-bit codes.
fn get3(p: &[u8], i: usize) -> u8 {
    let (byte, shift) = (3 * i / 8, 3 * i % 8);
    let two = p[byte] as u16 | (p.get(byte + 1).copied().unwrap_or(0) as u16) << 8;
    (two >> shift) as u8 & 7
}

/// The error for element `i`, `v`, not being a value of `t`.
fn not_of_type(t: FloatType, i: usize, v: f32) -> Error {
    Error::Param {
        codec: CodecId::Lossless,
        name: "dtype",
        reason: format!(
            "element {i} ({v:e}, bits {:#010x}) is not a {} value: lossless sends values of \
             its type exactly and never rounds them (use dtype=f32)",
            v.to_bits(),
            t.name()
        ),
    }
}

/// The exponents' block at the start of `payload`: checked whole before anything is
/// written, except in write mode, where its streams are checked as they are decoded
/// (`decode_into` may write before an error).
fn open<const M: u8>(payload: &[u8], n: usize) -> Result<entropy::Block<'_>> {
    if M == kernels::mode::WRITE {
        entropy::Block::parse(payload, n, 1).map_err(corrupt)
    } else {
        entropy::Block::open(payload, n, 1).map_err(corrupt)
    }
}

/// Decode bf16 planes into `out` in mode `M`.
fn decode_bf16<const M: u8>(
    block: &entropy::Block<'_>,
    tops: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let mut bits = [0u8; 4 * CHUNK];
    block
        .for_each_chunk::<CHUNK>(CHUNK, |start, exps| {
            let k = exps.len();
            for ((b, &e), &t) in bits[..4 * k]
                .chunks_exact_mut(4)
                .zip(exps)
                .zip(&tops[start..start + k])
            {
                b.copy_from_slice(&join(e, 0, t).to_le_bytes());
            }
            kernels::decode_f32::<M>(&bits[..4 * k], &mut out[start..start + k]);
        })
        .map_err(corrupt)
}

/// Decode fp16 planes into `out` in mode `M`, after checking the exponents and the 3-bit
/// stream's padding.
fn decode_fp16<const M: u8>(
    block: &entropy::Block<'_>,
    planes: &[u8],
    at: usize,
    out: &mut [f32],
) -> Result<()> {
    let n = out.len();
    let (tops, lows) = planes.split_at(n);
    let alphabet = block.alphabet();
    if let Some(e) = (32..256).find(|&e| alphabet[e]) {
        return Err(corrupt((
            1,
            format!("the exponents' block holds {e}, above fp16's 31"),
        )));
    }
    if !lows.is_empty() {
        crate::wire::check_padding(CodecId::Lossless, lows, HEADER_LEN + at + n, n as u64, 3)?;
    }
    let mut bits = [0u8; 4 * CHUNK];
    block
        .for_each_chunk::<CHUNK>(CHUNK, |start, exps| {
            let k = exps.len();
            for (j, (b, &e)) in bits[..4 * k].chunks_exact_mut(4).zip(exps).enumerate() {
                let (t, i) = (tops[start + j] as u16, start + j);
                let low = get3(lows, i) as u16;
                let h = ((t & 0x80) << 8) | ((e as u16) << 10) | ((t & 0x7F) << 3) | low;
                b.copy_from_slice(&kernels::scalar::f16_to_f32(h).to_bits().to_le_bytes());
            }
            kernels::decode_f32::<M>(&bits[..4 * k], &mut out[start..start + k]);
        })
        .map_err(corrupt)
}
