//! `randk`: random sparsification with indices derived from a shared hash, so frames
//! carry values only.
//!
//! Element `i` (global index `offset + i`) is kept when
//! `draw(seed, STREAM_SELECT, offset + i) < t`, with `t = clamp(round(ratio * 2^32), 1, 2^32)`:
//! each element is kept independently with probability `p = t / 2^32` (Bernoulli
//! sampling), so about `ratio * n` are kept and the choice depends only on the seed and
//! the global index. Ranks that share a seed keep the same indices, a tensor chunked
//! anywhere keeps the same ones, and the decoder recomputes them from the header's seed
//! and offset.
//!
//! Payload: the kept values in index order, f32 LE, fp16 LE or bf16 LE. With `scale=unbiased` the
//! encoder sends `x / p` (in f32, `x * (2^32 / t)`), making the decoding an unbiased
//! estimate of the input; with `scale=none` (the default, for use with error feedback)
//! it sends `x` and the estimate is biased towards zero by the factor `p`.
//!
//! NaN and ±Inf: an unsent element could hide an overflow, so when the input holds any
//! NaN or ±Inf the frame's NONFINITE flag is set and *every* element decodes to NaN.
//!
//! Frames of ranks that share a seed keep the same elements, so they can be summed value
//! by value, compressed, with [`RandK::add_frame`]: no index is computed or sent.
//!
//! Decoding costs one hash draw per element of the frame, kept or not, and refuses a
//! frame whose selection does not hold exactly as many elements as its payload has
//! values. `decode_add` must leave the accumulator untouched then, so it counts before it
//! adds: it keeps the keep masks of the first
//! [`STORED_MASK_ELEMENTS`](crate::kernels::STORED_MASK_ELEMENTS) elements from the
//! counting pass (32 KiB on the stack) and draws the rest twice.

use core::fmt;

use super::topk::{ValueReader, ValueWriter};
use super::{EncodeCtx, Encoded, Scheme, ValueType};
use crate::codec::{Args, CodecId, CodecSpec, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::{
    self,
    scalar::{self, CANONICAL_NAN, put},
};
use crate::rng::{Draws, STREAM_SELECT};
use crate::wire::{FLAG_NONFINITE, HEADER_LEN, Header};

/// Whether random-k rescales kept values by `1 / p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RandKScale {
    /// Send values as they are (biased; use with error feedback).
    #[default]
    None,
    /// Send `x / p`: the decoding is an unbiased estimate.
    Unbiased,
}

/// Random-k with hash-derived indices.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandK {
    ratio: f64,
    values: ValueType,
    scale: RandKScale,
}

impl Default for RandK {
    fn default() -> Self {
        RandK {
            ratio: 0.01,
            values: ValueType::F32,
            scale: RandKScale::None,
        }
    }
}

impl RandK {
    /// Random-k keeping each element with probability `ratio` (in (0, 1]).
    pub fn new(ratio: f64, values: ValueType, scale: RandKScale) -> Result<RandK> {
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(Error::Param {
                codec: CodecId::RandK,
                name: "ratio",
                reason: format!("{ratio} is not in (0, 1]"),
            });
        }
        Ok(RandK {
            ratio,
            values,
            scale,
        })
    }

    /// The keep probability as configured.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// How kept values are stored.
    pub fn values(&self) -> ValueType {
        self.values
    }

    /// Whether kept values are rescaled by `1 / p`.
    pub fn scale(&self) -> RandKScale {
        self.scale
    }

    /// The 33-bit selection threshold `t` (an element is kept when its draw is below it).
    pub fn threshold(&self) -> u64 {
        ((self.ratio * 4_294_967_296.0).round() as u64).clamp(1, 1 << 32)
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<RandK, String> {
        let ratio = a.ratio("ratio")?.unwrap_or(0.01);
        let values = ValueType::parse(a)?;
        if values == ValueType::Int8 {
            return Err("`values=int8` is for top-k; random-k takes f32, fp16 or bf16".into());
        }
        let scale = match a.choice("scale", "none", &["none", "unbiased"])? {
            "unbiased" => RandKScale::Unbiased,
            _ => RandKScale::None,
        };
        Ok(RandK {
            ratio,
            values,
            scale,
        })
    }
}

impl fmt::Display for RandK {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scale = match self.scale {
            RandKScale::None => "none",
            RandKScale::Unbiased => "unbiased",
        };
        write!(
            f,
            "randk:ratio={},values={},scale={scale}",
            self.ratio,
            self.values.name()
        )
    }
}

impl From<RandK> for CodecSpec {
    fn from(c: RandK) -> CodecSpec {
        CodecSpec::RandK(c)
    }
}

/// Call `f(i)` for each kept position `i` of a slice of `n` at global `offset`.
#[inline]
fn for_each_kept(seed: u64, offset: u64, n: usize, t: u64, f: impl FnMut(usize)) {
    let d = Draws::new(seed, STREAM_SELECT, offset);
    let kept = |pos: usize, idx: &mut [u32]| {
        kernels::filter_draw_lt(&d, offset + pos as u64, t, n - pos, idx)
    };
    kernels::for_each_filtered(n, kept, f);
}

impl RandK {
    /// Sum two random-k frames value by value, in place: `acc` becomes the frame of the
    /// element-wise sum, without computing a single index or hash draw.
    ///
    /// Frames from ranks that share a seed (and element count, offset, threshold, value type
    /// and scale) keep the same elements (DESIGN rule 5), so their payloads line up value by
    /// value: a reducing collective can add compressed frames and decode once. Each value of
    /// `acc` becomes the f32 sum of the two values, rounded to the value type (exact in f32
    /// arithmetic for `values=f32`; for fp16 and bf16 it is rounded to nearest even once per
    /// addition, as decoding, adding and re-encoding would). The NONFINITE flags are OR-ed (a
    /// frame with it set decodes to NaN everywhere). A sealed `acc` is resealed; a sealed
    /// `frame` is verified.
    ///
    /// `decode(acc after) == round(decode(acc before) + decode(frame))` element by element.
    ///
    /// Errors, leaving `acc` unchanged: either frame is invalid or not random-k, or they
    /// differ in elements, offset, seed, threshold, value type, scale or payload length.
    /// Allocates nothing.
    pub fn add_frame(acc: &mut [u8], frame: &[u8]) -> Result<()> {
        let (ha, _) = crate::wire::split(acc)?;
        let (hb, pb) = crate::wire::split(frame)?;
        let mut values = ValueType::F32;
        for h in [&ha, &hb] {
            if h.codec != CodecId::RandK {
                return Err(Error::WrongCodec {
                    expected: CodecId::RandK,
                    found: h.codec,
                });
            }
            values = RandK::read(h)?.values;
        }
        let differ = |field, a: &dyn fmt::Debug, b: &dyn fmt::Debug| Error::BadField {
            codec: CodecId::RandK,
            field,
            reason: format!(
                "{a:?} in one frame, {b:?} in the other: random-k frames add value by value \
                 only when they keep the same elements (same seed, offset, element count, \
                 threshold, value type and scale)"
            ),
        };
        if ha.elements != hb.elements {
            return Err(differ("elements", &ha.elements, &hb.elements));
        }
        if ha.offset != hb.offset {
            return Err(differ("offset", &ha.offset, &hb.offset));
        }
        if ha.seed != hb.seed {
            return Err(differ("seed", &ha.seed, &hb.seed));
        }
        if ha.params != hb.params {
            return Err(differ("params", &ha.params, &hb.params));
        }
        if ha.payload_len != hb.payload_len {
            return Err(differ("payload_len", &ha.payload_len, &hb.payload_len));
        }
        let len = HEADER_LEN + ha.payload_len as usize;
        let pa = &mut acc[HEADER_LEN..len];
        let k = pa.len() / values.bytes() as usize;
        let (mut a, mut b) = ([0f32; 256], [0f32; 256]);
        let mut j = 0;
        while j < k {
            let m = (k - j).min(a.len());
            values.get_slice(pa, k, j, &mut a[..m]);
            values.get_slice(pb, k, j, &mut b[..m]);
            for (x, y) in a[..m].iter_mut().zip(&b[..m]) {
                *x += *y;
            }
            values.put_slice(pa, k, j, &a[..m]);
            j += m;
        }
        // The header unsealed, then sealed again over the new payload.
        let mut h = ha;
        h.flags |= hb.flags & FLAG_NONFINITE;
        h.flags &= !crate::wire::FLAG_PAYLOAD_CRC;
        h.write(acc);
        if ha.payload_checksum() {
            crate::wire::seal(acc, len)?;
        }
        Ok(())
    }
}

impl Scheme for RandK {
    const ID: CodecId = CodecId::RandK;

    fn max_payload(&self, n: u64) -> u64 {
        n.saturating_mul(self.values.bytes())
    }

    fn encode_payload(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        let t = self.threshold();
        let d = Draws::new(ctx.seed, STREAM_SELECT, ctx.offset);
        let k = kernels::count_draw_lt(&d, ctx.offset, t, x.len()) as u64;
        let len = k * self.values.bytes();
        let p = payload_buf(out, len)?;
        let mul = match self.scale {
            RandKScale::None => 1.0,
            RandKScale::Unbiased => (4_294_967_296.0 / t as f64) as f32,
        };
        let mut values = ValueWriter::new(self.values, p, k as usize);
        for_each_kept(ctx.seed, ctx.offset, x.len(), t, |i| {
            values.push(x[i] * mul)
        });
        values.finish();
        let mut params = [0u8; 12];
        params[0..8].copy_from_slice(&t.to_le_bytes());
        params[8] = self.values as u8;
        params[9] = self.scale as u8;
        Ok(Encoded {
            payload_len: len,
            params,
            nonfinite: scalar::any_nonfinite(x),
            seed: ctx.seed,
        })
    }

    fn read(h: &Header) -> Result<RandK> {
        let bad = |field, reason: String| Error::BadField {
            codec: h.codec,
            field,
            reason,
        };
        let t = h.param_u64(0);
        if !(1..=1u64 << 32).contains(&t) {
            return Err(bad("params.threshold", format!("{t} is not in 1..=2^32")));
        }
        let values = ValueType::from_byte(h, h.params[8])?;
        let scale = match h.params[9] {
            0 => RandKScale::None,
            1 => RandKScale::Unbiased,
            s => {
                return Err(bad(
                    "params.scale",
                    format!("{s} is not 0 (none) or 1 (unbiased)"),
                ));
            }
        };
        h.params_zero_from(10)?;
        let vb = values.bytes();
        if !h.payload_len.is_multiple_of(vb) || h.payload_len / vb > h.elements {
            return Err(bad(
                "payload_len",
                format!(
                    "{} bytes is not a whole number of at most {} {}-byte values",
                    h.payload_len, h.elements, vb
                ),
            ));
        }
        Ok(RandK {
            ratio: t as f64 / 4_294_967_296.0,
            values,
            scale,
        })
    }

    fn decode_payload<const M: u8>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        let t = h.param_u64(0);
        let k = (h.payload_len / self.values.bytes()) as usize;
        let mismatch = |count: usize| Error::Corrupt {
            codec: h.codec,
            offset: crate::wire::HEADER_LEN,
            reason: format!(
                "seed, offset and threshold select {count} elements but the payload holds {k} values"
            ),
        };
        let nonfinite = h.flags & FLAG_NONFINITE != 0;
        let d = Draws::new(h.seed, STREAM_SELECT, h.offset);
        // The selection must hold exactly `k` elements. Writing counts it in the same pass
        // of hash draws and checks at the end (`decode_into` may leave `out` partly written
        // on error). `decode_add` may not touch `out` on error, and a non-finite frame
        // writes no values, so both count first; `for_each_draw_lt_exactly` keeps the
        // keep masks of its counting pass for the adds. Residual mode decodes a frame this
        // crate has just made from `out` (the error-feedback step): its count is right by
        // construction.
        if M == kernels::mode::ADD && !nonfinite {
            let n = out.len();
            let mut values = ValueReader::new(self.values, p, k);
            let add = |i: usize| put::<M>(&mut out[i], values.next_value());
            return kernels::for_each_draw_lt_exactly(&d, h.offset, t, n, k, add).map_err(mismatch);
        }
        if nonfinite {
            if M != kernels::mode::RESIDUAL {
                let count = kernels::count_draw_lt(&d, h.offset, t, out.len());
                if count != k {
                    return Err(mismatch(count));
                }
            }
            for o in out.iter_mut() {
                put::<M>(o, CANONICAL_NAN);
            }
            return Ok(());
        }
        let mut values = ValueReader::new(self.values, p, k);
        let mut count = 0;
        let mut put_next = |o: &mut f32| {
            if count < k {
                put::<M>(o, values.next_value());
            }
            count += 1;
        };
        if M == kernels::mode::WRITE {
            // Zero but at the kept elements, zeroed in the pass of hash draws.
            kernels::for_each_draw_lt_zeroing(&d, h.offset, t, out, |out, i| put_next(&mut out[i]));
        } else {
            // Residual mode: `out` holds the encoded input, and each element not kept
            // keeps it as its residual.
            for_each_kept(h.seed, h.offset, out.len(), t, |i| put_next(&mut out[i]));
        }
        if count != k {
            return Err(mismatch(count));
        }
        Ok(())
    }

    fn expected_payload(&self, n: u64) -> f64 {
        n as f64 * self.threshold() as f64 / 4_294_967_296.0 * self.values.bytes() as f64
    }

    fn is_unbiased(&self) -> bool {
        self.scale == RandKScale::Unbiased
    }
}
