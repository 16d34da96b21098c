//! How the sparse codecs (top-k, random-k) store their kept values: f32, fp16 or bf16
//! little-endian, or int8 in blocks of [`INT8_VALUE_BLOCK`] values with an f32 step each
//! (top-k only); and the writer and reader that convert them a batch at a time with the
//! backend's kernels.

use crate::codec::{Args, CodecId};
use crate::error::{Error, Result};
use crate::kernels::{self, scalar};
use crate::wire::Header;

/// How sparse-codec values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ValueType {
    /// f32 LE (exact).
    #[default]
    F32,
    /// IEEE binary16 LE, round to nearest even.
    Fp16,
    /// bfloat16 LE (the high half of the f32), round to nearest even.
    Bf16,
    /// int8 with a block scale (top-k only): the kept values in blocks of
    /// [`INT8_VALUE_BLOCK`], each an f32 step `absmax / 127` and one i8 per value
    /// rounded to nearest even, as the `int8` codec writes a block. A block holding NaN
    /// or ±Inf has a NaN step: all its values decode to NaN.
    Int8,
}

/// Kept values per block scale of [`ValueType::Int8`].
pub const INT8_VALUE_BLOCK: usize = 256;

impl ValueType {
    pub(crate) fn bytes(self) -> u64 {
        match self {
            ValueType::F32 => 4,
            ValueType::Fp16 | ValueType::Bf16 => 2,
            ValueType::Int8 => 1,
        }
    }

    /// Bytes of `k` values: `k * bytes`, plus a 4-byte step per block for int8.
    pub(crate) fn section_len(self, k: u64) -> u64 {
        match self {
            ValueType::Int8 => k.saturating_add(4 * k.div_ceil(INT8_VALUE_BLOCK as u64)),
            _ => k.saturating_mul(self.bytes()),
        }
    }

    /// Bytes of the steps at the start of an int8 section of `k` values.
    fn int8_parts(k: usize) -> usize {
        4 * k.div_ceil(INT8_VALUE_BLOCK)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            ValueType::F32 => "f32",
            ValueType::Fp16 => "fp16",
            ValueType::Bf16 => "bf16",
            ValueType::Int8 => "int8",
        }
    }

    pub(crate) fn parse(a: &mut Args) -> core::result::Result<ValueType, String> {
        Ok(
            match a.choice("values", "f32", &["f32", "fp16", "bf16", "int8"])? {
                "fp16" => ValueType::Fp16,
                "bf16" => ValueType::Bf16,
                "int8" => ValueType::Int8,
                _ => ValueType::F32,
            },
        )
    }

    pub(crate) fn from_byte(h: &Header, b: u8) -> Result<ValueType> {
        match b {
            0 => Ok(ValueType::F32),
            1 => Ok(ValueType::Fp16),
            2 => Ok(ValueType::Bf16),
            3 if h.codec == CodecId::TopK => Ok(ValueType::Int8),
            _ => Err(Error::BadField {
                codec: h.codec,
                field: "params.values",
                reason: if h.codec == CodecId::TopK {
                    format!("{b} is not 0 (f32), 1 (fp16), 2 (bf16) or 3 (int8)")
                } else {
                    format!("{b} is not 0 (f32), 1 (fp16) or 2 (bf16)")
                },
            }),
        }
    }

    /// Write values `j..j + v.len()` of a section of `k` with the backend's conversion
    /// kernels; true if any of `v` is NaN or ±Inf. For int8, `j` is a multiple of
    /// [`INT8_VALUE_BLOCK`].
    #[inline]
    pub(crate) fn put_slice(self, vals: &mut [u8], k: usize, j: usize, v: &[f32]) -> bool {
        self.slab(vals, k).put(j, v)
    }

    /// The section of `k` values in `vals` as one [`ValueSlab`].
    pub(crate) fn slab(self, vals: &mut [u8], k: usize) -> ValueSlab<'_> {
        let steps = match self {
            ValueType::Int8 => Self::int8_parts(k),
            _ => 0,
        };
        let (steps, codes) = vals.split_at_mut(steps);
        ValueSlab {
            t: self,
            steps,
            codes,
        }
    }

    /// Read values `j..j + out.len()` of a section of `k` with the backend's conversion
    /// kernels. For int8, `j` is a multiple of [`INT8_VALUE_BLOCK`].
    #[inline]
    pub(crate) fn get_slice(self, vals: &[u8], k: usize, j: usize, out: &mut [f32]) {
        use kernels::mode::WRITE;
        let m = out.len();
        let span = |b: usize| b * j..b * (j + m);
        match self {
            ValueType::F32 => {
                for (o, s) in out.iter_mut().zip(vals[span(4)].chunks_exact(4)) {
                    *o = f32::from_le_bytes(s.try_into().expect("4 bytes"));
                }
            }
            ValueType::Fp16 => kernels::decode_f16::<WRITE>(&vals[span(2)], out),
            ValueType::Bf16 => kernels::decode_bf16::<WRITE>(&vals[span(2)], out),
            ValueType::Int8 => {
                let (steps, codes) = vals.split_at(Self::int8_parts(k));
                let b = j / INT8_VALUE_BLOCK;
                let nb = out.len().div_ceil(INT8_VALUE_BLOCK);
                let codes = &codes[span(1)];
                kernels::decode_int8::<WRITE>(
                    &steps[4 * b..4 * (b + nb)],
                    codes,
                    INT8_VALUE_BLOCK,
                    out,
                )
            }
        }
    }
}

/// Consecutive values of a section as byte slices of their own (for int8, the steps of
/// their blocks and their codes), which [`ValueSlab::split_at`] cuts, so that the parts of
/// one section can be written on several threads.
pub(crate) struct ValueSlab<'a> {
    t: ValueType,
    steps: &'a mut [u8],
    codes: &'a mut [u8],
}

impl<'a> ValueSlab<'a> {
    /// The first `j` values and the rest (for int8, `j` is a multiple of
    /// [`INT8_VALUE_BLOCK`]).
    pub(crate) fn split_at(self, j: usize) -> (ValueSlab<'a>, ValueSlab<'a>) {
        let (c0, c1) = self.codes.split_at_mut(j * self.t.bytes() as usize);
        let s = match self.t {
            ValueType::Int8 => (4 * j.div_ceil(INT8_VALUE_BLOCK)).min(self.steps.len()),
            _ => 0,
        };
        let (s0, s1) = self.steps.split_at_mut(s);
        let part = |steps, codes| ValueSlab {
            t: self.t,
            steps,
            codes,
        };
        (part(s0, c0), part(s1, c1))
    }

    /// Write values `j..j + v.len()` of the slab with the backend's conversion kernels;
    /// true if any of `v` is NaN or ±Inf. For int8, `j` is a multiple of
    /// [`INT8_VALUE_BLOCK`].
    #[inline]
    pub(crate) fn put(&mut self, j: usize, v: &[f32]) -> bool {
        let span = |b: usize| b * j..b * (j + v.len());
        match self.t {
            ValueType::F32 => {
                for (o, x) in self.codes[span(4)].chunks_exact_mut(4).zip(v) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
                v.iter().any(|x| !x.is_finite())
            }
            ValueType::Fp16 => kernels::encode_f16(v, &mut self.codes[span(2)]),
            ValueType::Bf16 => kernels::encode_bf16(v, &mut self.codes[span(2)]),
            ValueType::Int8 => {
                let b = j / INT8_VALUE_BLOCK;
                let nb = v.len().div_ceil(INT8_VALUE_BLOCK);
                let draws = crate::rng::Draws::new(0, 0, 0); // nearest rounding draws none
                kernels::encode_int8(
                    v,
                    INT8_VALUE_BLOCK,
                    scalar::Round::Nearest,
                    &draws,
                    0,
                    &mut self.steps[4 * b..4 * (b + nb)],
                    &mut self.codes[span(1)],
                )
            }
        }
    }
}

/// Writes a value section (`k` values) in order, converting batches of
/// [`INT8_VALUE_BLOCK`] with the backend's kernels (the batch is an int8 block).
pub(crate) struct ValueWriter<'a> {
    t: ValueType,
    vals: &'a mut [u8],
    k: usize,
    batch: [f32; INT8_VALUE_BLOCK],
    m: usize,
    j: usize,
    nonfinite: bool,
}

impl<'a> ValueWriter<'a> {
    pub(crate) fn new(t: ValueType, vals: &'a mut [u8], k: usize) -> Self {
        ValueWriter {
            t,
            vals,
            k,
            batch: [0.0; INT8_VALUE_BLOCK],
            m: 0,
            j: 0,
            nonfinite: false,
        }
    }

    /// Append the next value (inlined, the batch's conversion out of line: see
    /// [`ValueReader::next_value`]).
    #[inline(always)]
    pub(crate) fn push(&mut self, v: f32) {
        self.batch[self.m] = v;
        self.m += 1;
        if self.m == INT8_VALUE_BLOCK {
            self.flush();
        }
    }

    #[inline(never)]
    fn flush(&mut self) {
        let v = &self.batch[..self.m];
        self.nonfinite |= self.t.put_slice(self.vals, self.k, self.j, v);
        self.j += self.m;
        self.m = 0;
    }

    /// Write what is left; true if any value was NaN or ±Inf.
    pub(crate) fn finish(mut self) -> bool {
        self.flush();
        debug_assert_eq!(self.j, self.k);
        self.nonfinite
    }
}

/// Reads a value section (`k` values) in order, a batch of [`INT8_VALUE_BLOCK`] at a
/// time.
pub(crate) struct ValueReader<'a> {
    t: ValueType,
    vals: &'a [u8],
    k: usize,
    batch: [f32; INT8_VALUE_BLOCK],
    j: usize,
}

impl<'a> ValueReader<'a> {
    pub(crate) fn new(t: ValueType, vals: &'a [u8], k: usize) -> Self {
        ValueReader {
            t,
            vals,
            k,
            batch: [0.0; INT8_VALUE_BLOCK],
            j: 0,
        }
    }

    /// The next value (at most `k` calls). Inlined into the decoders' loops, with the
    /// batch's conversion out of line: a call per value cost top-k's decode 10 to 18%
    /// (an Intel Xeon, 2026-12-03, once the conversion became a dispatch-table call).
    #[inline(always)]
    pub(crate) fn next_value(&mut self) -> f32 {
        let at = self.j % INT8_VALUE_BLOCK;
        if at == 0 {
            self.refill();
        }
        self.j += 1;
        self.batch[at]
    }

    /// The next batch, from value `j` on.
    #[inline(never)]
    fn refill(&mut self) {
        let m = (self.k - self.j).min(INT8_VALUE_BLOCK);
        self.t
            .get_slice(self.vals, self.k, self.j, &mut self.batch[..m]);
    }
}
