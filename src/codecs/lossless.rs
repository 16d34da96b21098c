//! `lossless`: f32 with its exponents entropy-coded, decoded to the same bits.
//!
//! Spec: `lossless` (f32 elements; header param byte 0, the element type, is 0).
//!
//! Payload, for `n` elements with bits `b`:
//!
//! 1. the exponents `(b >> 23) & 0xFF` as one entropy-coded block of `n` symbols (stored,
//!    one symbol, or four streams of canonical Huffman codes of at most 11 bits: the
//!    crate's entropy block, specified with the wire format);
//! 2. `n` × u16 LE, the low 16 bits of each element, `b & 0xFFFF`;
//! 3. `n` bytes, the sign and the top 7 mantissa bits, `(b >> 24) & 0x80 | (b >> 16) & 0x7F`.
//!
//! Every f32 comes back with its bits: -0, subnormals, ±Inf and NaN payloads included.
//! A gradient's exponents fall in a few binades, so they take about 3 of their 8 bits
//! and a frame about 0.85 of identity's bytes; the sign and mantissa bits are close to
//! uniform and are sent as they are.

use super::{EncodeCtx, Encoded, Scheme};
use crate::codec::{CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::{self, entropy};
use crate::wire::{HEADER_LEN, Header};

/// Elements reassembled per pass of a decode (16 KiB of f32 on the stack).
const CHUNK: usize = 4096;

/// f32 with entropy-coded exponents: exact, about 27 bits per element on gradients.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lossless;

impl core::fmt::Display for Lossless {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("lossless")
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
        entropy::max_len(n).saturating_add(n.saturating_mul(3))
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
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
        h.params_zero_from(0)?;
        h.seed_zero()?;
        let n = h.elements;
        // The smallest payload: an entropy block's mode byte and the 3 n plane bytes.
        let least = n.saturating_mul(3).saturating_add(1);
        if h.payload_len < least || h.payload_len > Lossless.max_payload(n) {
            return Err(corrupt((
                0,
                format!(
                    "a payload of {} bytes for {n} elements (from {least} to {})",
                    h.payload_len,
                    Lossless.max_payload(n)
                ),
            )));
        }
        Ok(Lossless)
    }

    fn decode_payload<const M: u8>(
        &self,
        _h: &Header,
        payload: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        let n = out.len();
        let block = entropy::Block::open(payload, n, 1).map_err(corrupt)?;
        let at = block.bytes();
        if payload.len() - at != 3 * n {
            return Err(corrupt((
                at,
                format!(
                    "{} bytes after the exponents for {n} elements (want {})",
                    payload.len() - at,
                    3 * n
                ),
            )));
        }
        let (lo, tops) = payload[at..].split_at(2 * n);
        let mut bits = [0u8; 4 * CHUNK];
        block.for_each_chunk::<CHUNK>(CHUNK, |start, exps| {
            let k = exps.len();
            let lo = &lo[2 * start..2 * (start + k)];
            let tops = &tops[start..start + k];
            for (((b, &e), l), &t) in bits[..4 * k]
                .chunks_exact_mut(4)
                .zip(exps)
                .zip(lo.chunks_exact(2))
                .zip(tops)
            {
                b.copy_from_slice(&join(e, u16::from_le_bytes([l[0], l[1]]), t).to_le_bytes());
            }
            kernels::decode_f32::<M>(&bits[..4 * k], &mut out[start..start + k]);
        });
        Ok(())
    }

    fn expected_payload(&self, n: u64) -> f64 {
        // Normal data's exponents take 2.6 bits (a frame 0.831 of identity's at 1 Mi
        // elements; 0.838 for a Student-t with 3 degrees of freedom).
        n as f64 * 3.33 + entropy::HUFFMAN_HEADER as f64
    }

    fn is_unbiased(&self) -> bool {
        true
    }
}
