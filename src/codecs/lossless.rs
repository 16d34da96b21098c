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
//! With params byte 1 set (the zeros section), +0.0 elements carry no plane bytes: their
//! exponent symbol is the all-ones exponent (255, fp16 31), which no element of such a
//! frame has otherwise (the encoder sets it only when the input is finite, at least an
//! eighth of it is +0.0, and its zeros' plane bits exceed the section's 32 bytes). Four u64 counts follow the exponents' block:
//! the plane entries before each of the block's quarters 1, 2, 3 and in all; the planes
//! then hold those entries only. Dead ReLU units and unused rows make a quarter of an
//! MLP's gradient exactly zero, and its frame 0.7 of identity's instead of 0.85.
//!
//! Every element comes back with its bits: -0, subnormals, ±Inf and NaN payloads included.
//! A gradient's exponents fall in a few binades, so they take about 3 of their 8 bits:
//! an f32 frame is about 0.85 of identity's bytes, a bf16 one about 0.7 of bf16's.
//!
//! From 65536 elements on, the encoder takes the exponents' code lengths from every
//! 16th exponent and their spread (the least and greatest, and whether 0 and the
//! all-ones exponent occur) instead of counting each one, which cost as much as coding
//! it; the frame is then at most about 0.03% larger.

use super::{EncodeCtx, Encoded, Scheme};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::planes::{self, join, top};
use crate::kernels::scalar::BitWriter;
use crate::kernels::{self, entropy};
use crate::wire::{HEADER_LEN, Header};

/// Elements reassembled per pass of a decode (16 KiB of f32 on the stack).
const CHUNK: usize = 4096;
/// From this many elements on, the exponents' code lengths come from a sample of them:
/// counting every symbol would cost as much as coding it.
const SAMPLED_FROM: usize = 1 << 16;
/// The sample's step: at least 4096 symbols counted.
const SAMPLE_STEP: usize = 16;

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
        let (at, zeros, nonfinite) = self.exponents(x, false, out);
        let Some(z) = zeros else {
            let (lo16, tops) = out[at..].split_at_mut(2 * n);
            put_f32(lo16, tops, 0, x);
            return Ok(self.encoded((at + 3 * n) as u64, nonfinite, false));
        };
        let m = n - z;
        let (section, planes) = out[at..].split_at_mut(ZEROS_SECTION);
        let (lo16, tops) = planes.split_at_mut(2 * m);
        let counts = compact(x, |mut k, g, kept| {
            if kept {
                put_f32(lo16, tops, k, g);
                return k + g.len();
            }
            for v in g {
                let b = v.to_bits();
                lo16[2 * k] = b as u8;
                lo16[2 * k + 1] = (b >> 8) as u8;
                tops[k] = top(b);
                k += usize::from(b != 0);
            }
            k
        });
        write_counts(section, counts);
        Ok(self.encoded((at + ZEROS_SECTION + 3 * m) as u64, false, true))
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
        let zeros = match h.params[1] {
            0 => false,
            1 => true,
            z => {
                return Err(Error::BadField {
                    codec: h.codec,
                    field: "params.zeros",
                    reason: format!("{z} is not 0 or 1"),
                });
            }
        };
        h.params_zero_from(2)?;
        h.seed_zero()?;
        let c = Lossless { dtype };
        let n = h.elements;
        // The smallest payload: an entropy block's mode byte and the plane bytes (with
        // the zeros section, that section and no plane byte at all).
        let least = match zeros {
            false => c.planes(n).saturating_add(1),
            true => 1 + ZEROS_SECTION as u64,
        };
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
        h: &Header,
        payload: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        let n = out.len();
        if h.params[1] == 1 {
            // Add mode checks the block in the pass that counts its symbols.
            let block = entropy::Block::parse(payload, n, 1).map_err(corrupt)?;
            let at = block.bytes();
            return self.decode_zeros::<M>(&block, &payload[at..], at, out);
        }
        let block = entropy::Block::for_mode::<M>(payload, n, 1).map_err(corrupt)?;
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
        let p = Planes::open(self.dtype, &payload[at..], n, &block, HEADER_LEN + at)?;
        decode_all::<M>(&block, out, |g, k, o| p.span::<M>(g, k, o))
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
        let (at, zeros, nonfinite) = self.exponents(x, false, out);
        let Some(z) = zeros else {
            put_bf16(&mut out[at..], 0, x);
            return Ok(self.encoded((at + n) as u64, nonfinite, false));
        };
        let m = n - z;
        let (section, tops) = out[at..].split_at_mut(ZEROS_SECTION);
        let counts = compact(x, |mut k, g, kept| {
            if kept {
                put_bf16(tops, k, g);
                return k + g.len();
            }
            for v in g {
                let b = v.to_bits();
                tops[k] = top(b);
                k += usize::from(b != 0);
            }
            k
        });
        write_counts(section, counts);
        Ok(self.encoded((at + ZEROS_SECTION + m) as u64, false, true))
    }

    /// Encode fp16 values: their 5-bit exponents, their sign and top 7 mantissa bits,
    /// then the low 3 mantissa bits as a 3-bit stream.
    fn encode_fp16(&self, x: &[f32], out: &mut [u8]) -> Result<Encoded> {
        // Each piece to binary16 and back through the backend's conversions (the same
        // bits as the scalar ones): a value of the type comes back as it went.
        let mut halves = [0u8; 2 * CHUNK];
        let mut back = [0f32; CHUNK];
        for (c, xs) in x.chunks(CHUNK).enumerate() {
            let (h, b) = (&mut halves[..2 * xs.len()], &mut back[..xs.len()]);
            kernels::encode_f16(xs, h);
            kernels::decode_f16::<{ kernels::mode::WRITE }>(h, b);
            if let Some(i) = xs
                .iter()
                .zip(&*b)
                .position(|(v, b)| v.to_bits() != b.to_bits())
            {
                return Err(not_of_type(FloatType::Fp16, c * CHUNK + i, xs[i]));
            }
        }
        let n = x.len();
        let out = super::payload_buf(out, self.max_payload(n as u64))?;
        // A value of the type has its f32 exponent field 255 (31), 113 to 142 (that less
        // 112) or at most 112 (a subnormal or zero: 0).
        let (at, zeros, nonfinite) = self.exponents(x, true, out);
        let (section, planes) = match zeros {
            Some(_) => out[at..].split_at_mut(ZEROS_SECTION),
            None => out[at..].split_at_mut(0),
        };
        let m = n - zeros.unwrap_or(0);
        let (tops, lows) = planes.split_at_mut(m);
        let lows = &mut lows[..(3 * m).div_ceil(8)];
        lows.fill(0);
        let payload = (at + section.len() + m + lows.len()) as u64;
        let top16 = |h: u16| (((h >> 8) & 0x80) | ((h >> 3) & 0x7F)) as u8;
        if zeros.is_none() {
            let mut low3 = BitWriter::new(lows);
            for (c, xs) in x.chunks(CHUNK).enumerate() {
                let h = &mut halves[..2 * xs.len()];
                kernels::encode_f16(xs, h);
                let k = c * CHUNK;
                for (t, h) in tops[k..k + xs.len()].iter_mut().zip(h.chunks_exact(2)) {
                    *t = top16(u16::from_le_bytes([h[0], h[1]]));
                    low3.put(h[0] as u32 & 7, 3);
                }
            }
            low3.finish();
            return Ok(self.encoded(payload, nonfinite, false));
        }
        let half = |v: f32| kernels::scalar::f32_to_f16(v);
        // A zero's 3-bit field is 0: or-ed in, it leaves the next element's as it is.
        let counts = compact(x, |mut k, g, _| {
            for v in g {
                let h = half(*v);
                tops[k] = top16(h);
                put3(lows, k, (h & 7) as u8);
                k += usize::from(v.to_bits() != 0);
            }
            k
        });
        write_counts(section, counts);
        Ok(self.encoded(payload, false, true))
    }

    /// Plane bits an element carries: the f32's 24 bits of sign and mantissa, bf16's 8,
    /// fp16's 11.
    fn plane_bits(&self) -> usize {
        match self.dtype {
            FloatType::F32 => 24,
            FloatType::Bf16 => 8,
            FloatType::Fp16 => 11,
        }
    }

    /// The symbol of a +0.0 element in a frame with the zeros section: the exponent
    /// field of all ones (f32 and bf16 255, fp16 31), which no element of such a frame has.
    fn zero_symbol(&self) -> u8 {
        match self.dtype {
            FloatType::Fp16 => 0x1F,
            _ => 0xFF,
        }
    }

    /// The exponents' block of `x` at the start of `out` (the payload's whole room,
    /// whose last `x.len()` bytes hold the exponents while they are coded): the exponent of
    /// each element (binary16's with `fp16`), or the zero symbol for +0.0 where the zeros section pays:
    /// the input holds no non-finite value, at least an eighth of it is +0.0 (the
    /// section's decode is slower: each element's entry depends on the zeros before it)
    /// and its zeros' plane bits exceed the section's 256. Returns the block's length,
    /// `Some` of the zeros' count if they go as the zero symbol, and whether `x` holds a
    /// non-finite value.
    fn exponents(&self, x: &[f32], fp16: bool, out: &mut [u8]) -> (usize, Option<usize>, bool) {
        let n = x.len();
        // The room holds the block's bound (n + 1) and the planes (at least n bytes).
        let (head, exps) = out.split_at_mut(out.len() - n);
        // The zero symbol is the all-ones exponent field: that of NaN and Inf.
        let ones = self.zero_symbol();
        let (mut zero_symbols, mut nonfinite) = (0usize, false);
        let (mut min, mut max) = (u8::MAX, 0u8);
        for (xs, es) in x.chunks(1 << 16).zip(exps.chunks_mut(1 << 16)) {
            let st = planes::exponents(xs, fp16, es);
            zero_symbols += st.zero_symbols as usize;
            nonfinite |= st.all_ones > 0;
            (min, max) = (min.min(st.min), max.max(st.max));
        }
        // +0.0's symbol is 0: its count is needed only where that symbol is common.
        let zeros = match !nonfinite && zero_symbols.saturating_mul(8) >= n {
            true => x.iter().filter(|v| v.to_bits() == 0).count(),
            false => 0,
        };
        let skip = !nonfinite
            && zeros.saturating_mul(8) >= n
            && zeros.saturating_mul(self.plane_bits()) > 8 * ZEROS_SECTION;
        if skip {
            for (e, v) in exps.iter_mut().zip(x) {
                if v.to_bits() == 0 {
                    *e = ones;
                }
            }
        }
        if n < SAMPLED_FROM {
            let at = entropy::encode(exps, 1, head);
            return (at, skip.then_some(zeros), nonfinite);
        }
        // Enough symbols that a sample of them gives the code lengths: every
        // `SAMPLE_STEP`th counted; and every symbol that may occur given a count: 0 and
        // the all-ones symbol where they occur, and every one between the least and the
        // greatest of the others (the exponents of finite nonzero values, which seldom
        // leave gaps).
        let mut estimate = [0u64; 256];
        for &e in exps.iter().step_by(SAMPLE_STEP) {
            estimate[e as usize] += 1;
        }
        if min <= max {
            for c in &mut estimate[min as usize..=max as usize] {
                *c += 1;
            }
        }
        estimate[0] += u64::from(zero_symbols > 0);
        estimate[ones as usize] += u64::from(skip || nonfinite);
        let at = entropy::encode_estimated(exps, 1, &estimate, head);
        (at, skip.then_some(zeros), nonfinite)
    }

    fn encoded(&self, payload_len: u64, nonfinite: bool, zeros: bool) -> Encoded {
        let mut params = [0u8; 12];
        params[0] = self.dtype as u8;
        params[1] = u8::from(zeros);
        Encoded {
            payload_len,
            params,
            nonfinite,
            seed: 0,
            entropy: false,
        }
    }
}

impl Lossless {
    /// Decode a frame with the zeros section (`rest`: what follows the exponents' block,
    /// `at` bytes into the payload) into `out` in mode `M`. In add mode every count is
    /// checked before anything is added.
    fn decode_zeros<const M: u8>(
        &self,
        block: &entropy::Block<'_>,
        rest: &[u8],
        at: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let n = out.len();
        if rest.len() < ZEROS_SECTION {
            return Err(corrupt((
                at,
                format!("{} bytes for the zeros section", rest.len()),
            )));
        }
        let (section, planes) = rest.split_at(ZEROS_SECTION);
        let counts: [u64; 4] = std::array::from_fn(|j| {
            u64::from_le_bytes(section[8 * j..8 * j + 8].try_into().expect("8 bytes"))
        });
        let quarters = entropy::quarters(n, 1);
        let mut first = [0usize; 4];
        for (j, &(lo, hi)) in quarters.iter().enumerate() {
            let before = if j == 0 { 0 } else { counts[j - 1] };
            if before > counts[j] || counts[j] - before > (hi - lo) as u64 {
                return Err(corrupt((
                    at + 8 * j,
                    format!(
                        "{} plane entries before quarter {j} and {} after it, which holds {} elements",
                        before,
                        counts[j],
                        hi - lo
                    ),
                )));
            }
            first[j] = before as usize;
        }
        let m = counts[3] as usize;
        let want = self.planes(m as u64) as usize;
        if planes.len() != want {
            return Err(corrupt((
                at + ZEROS_SECTION,
                format!(
                    "{} bytes after the exponents and the zeros section for {m} plane entries (want {want})",
                    planes.len()
                ),
            )));
        }
        let p = Planes::open(
            self.dtype,
            planes,
            m,
            block,
            HEADER_LEN + at + ZEROS_SECTION,
        )?;
        let lim = counts.map(|c| c as usize);
        let counts = Counts {
            first,
            lim,
            zero: self.zero_symbol(),
        };
        if m == 0 {
            // Every element is +0.0 (the counts say so; they are checked as for any frame).
            return counts.decode::<M>(block, at, out, |_, _| 0, |_, _, w| w.fill(0));
        }
        let words = |g: &[u8], k: usize, w: &mut [u32]| {
            p.span::<{ kernels::mode::WRITE }>(g, k, bytemuck::cast_slice_mut(w))
        };
        match self.dtype {
            FloatType::F32 => counts.decode::<M>(block, at, out, |e, k| p.f32(e, k), words),
            FloatType::Bf16 => counts.decode::<M>(block, at, out, |e, k| p.bf16(e, k), words),
            FloatType::Fp16 => counts.decode::<M>(block, at, out, |e, k| p.fp16(e, k), words),
        }
    }
}

/// Decode a frame without the zeros section into `out` in mode `M`: `span(exponents,
/// k, out)` decodes each piece of elements from entry `k` into its part of `out`.
fn decode_all<const M: u8>(
    block: &entropy::Block<'_>,
    out: &mut [f32],
    span: impl Fn(&[u8], usize, &mut [f32]),
) -> Result<()> {
    block
        .for_each_chunk(CHUNK, |start, exps| {
            span(exps, start, &mut out[start..start + exps.len()]);
        })
        .map_err(corrupt)
}

/// A frame's planes split by type: the entries of its elements (with the zeros section,
/// of those that are not +0.0), `m` of them.
struct Planes<'a> {
    dtype: FloatType,
    /// f32: the low halves, u16 LE.
    lo16: &'a [u8],
    /// The sign-and-mantissa bytes.
    tops: &'a [u8],
    /// fp16: the 3-bit fields.
    lows: &'a [u8],
}

impl<'a> Planes<'a> {
    /// `planes`, exactly the bytes of `m` entries, `offset` bytes into the frame; for
    /// fp16, after checking that the exponents' block has no symbol above 31 and that
    /// the 3-bit stream's padding is zero.
    fn open(
        dtype: FloatType,
        planes: &'a [u8],
        m: usize,
        block: &entropy::Block<'_>,
        offset: usize,
    ) -> Result<Planes<'a>> {
        let none = &planes[..0];
        Ok(match dtype {
            FloatType::F32 => {
                let (lo16, tops) = planes.split_at(2 * m);
                Planes {
                    dtype,
                    lo16,
                    tops,
                    lows: none,
                }
            }
            FloatType::Bf16 => Planes {
                dtype,
                lo16: none,
                tops: planes,
                lows: none,
            },
            FloatType::Fp16 => {
                let alphabet = block.alphabet();
                if let Some(e) = (32..256).find(|&e| alphabet[e]) {
                    return Err(corrupt((
                        1,
                        format!("the exponents' block holds {e}, above fp16's 31"),
                    )));
                }
                let (tops, lows) = planes.split_at(m);
                if !lows.is_empty() {
                    crate::wire::check_padding(CodecId::Lossless, lows, offset + m, m as u64, 3)?;
                }
                Planes {
                    dtype,
                    lo16: none,
                    tops,
                    lows,
                }
            }
        })
    }

    /// The f32 bits of an f32 element of exponent `e` at entry `k`.
    #[inline(always)]
    fn f32(&self, e: u8, k: usize) -> u32 {
        join(
            e,
            u16::from_le_bytes([self.lo16[2 * k], self.lo16[2 * k + 1]]),
            self.tops[k],
        )
    }

    /// The f32 bits of a bf16 element.
    #[inline(always)]
    fn bf16(&self, e: u8, k: usize) -> u32 {
        join(e, 0, self.tops[k])
    }

    /// The binary16 bits of an fp16 element of 5-bit exponent `e`.
    #[inline(always)]
    fn half(&self, e: u8, k: usize) -> u16 {
        let t = self.tops[k] as u16;
        let low = get3(self.lows, k) as u16;
        ((t & 0x80) << 8) | ((e as u16) << 10) | ((t & 0x7F) << 3) | low
    }

    /// The f32 bits of an fp16 element of 5-bit exponent `e`.
    #[inline(always)]
    fn fp16(&self, e: u8, k: usize) -> u32 {
        kernels::scalar::f16_to_f32(self.half(e, k)).to_bits()
    }

    /// The elements of exponents `exps` at entries `k..` into `out` in mode `M`.
    fn span<const M: u8>(&self, exps: &[u8], k: usize, out: &mut [f32]) {
        let end = k + exps.len();
        match self.dtype {
            FloatType::F32 => {
                planes::join_f32::<M>(exps, &self.lo16[2 * k..2 * end], &self.tops[k..end], out)
            }
            FloatType::Bf16 => planes::join_bf16::<M>(exps, &self.tops[k..end], out),
            FloatType::Fp16 => {
                // The binary16 bits of the piece, then the backend's conversion.
                let mut halves = [0u8; 2 * CHUNK];
                for (c, (piece, out)) in exps.chunks(CHUNK).zip(out.chunks_mut(CHUNK)).enumerate() {
                    let h = &mut halves[..2 * piece.len()];
                    let k = k + c * CHUNK;
                    for (i, (h, &e)) in h.chunks_exact_mut(2).zip(piece).enumerate() {
                        h.copy_from_slice(&self.half(e, k + i).to_le_bytes());
                    }
                    kernels::decode_f16::<M>(h, out);
                }
            }
        }
    }
}

/// A zeros section, checked against the block's size: each quarter's first plane entry,
/// the entries before the next quarter, and the zero symbol.
struct Counts {
    first: [usize; 4],
    lim: [usize; 4],
    zero: u8,
}

impl Counts {
    /// Decode the elements in mode `M`: +0.0 for the zero symbol, else `bits(symbol, k)`
    /// of the quarter's next plane entry `k` (called with any entry below the last
    /// quarter's limit, whose planes hold); `span(symbols, k, words)` does the same for
    /// symbols none of which is zero, from entry `k`. `at`: the section's payload offset.
    fn decode<const M: u8>(
        &self,
        block: &entropy::Block<'_>,
        at: usize,
        out: &mut [f32],
        bits: impl Fn(u8, usize) -> u32,
        span: impl Fn(&[u8], usize, &mut [u32]),
    ) -> Result<()> {
        let Counts { first, lim, zero } = *self;
        let n = out.len();
        let quarters = entropy::quarters(n, 1);
        // The quarter of element `s`.
        let q = n.div_ceil(4).max(1);
        let quarter = |s: usize| (s / q).min(3);
        let short = |j: usize| {
            corrupt((
                at + 8 * j,
                format!(
                    "quarter {j}: its elements that are not +0.0 and its plane entries differ in number"
                ),
            ))
        };
        if M != kernels::mode::WRITE {
            // Add mode: the block (every stream to its end) and the counts checked first.
            let mut seen = first;
            block
                .for_each_chunk(CHUNK, |start, exps| {
                    for (i, &e) in exps.iter().enumerate() {
                        seen[quarter(start + i)] += usize::from(e != zero);
                    }
                })
                .map_err(corrupt)?;
            if let Some(j) = (0..4).find(|&j| seen[j] != lim[j]) {
                return Err(short(j));
            }
        }
        let mut k = first;
        let last = lim[3].saturating_sub(1);
        let mut bad = None;
        let mut words = [0u32; CHUNK];
        block
            .for_each_chunk(CHUNK, |start, exps| {
                let mut s = start;
                let mut rest = exps;
                while !rest.is_empty() && bad.is_none() {
                    let j = quarter(s);
                    let (run, next) = rest.split_at((quarters[j].1 - s).min(rest.len()));
                    let kj = join_run(run, zero, k[j], last, &bits, &span, &mut words);
                    k[j] = kj;
                    if kj > lim[j] {
                        // More entries than the section gives the quarter (write mode
                        // only: add mode checked the counts first).
                        bad = Some(j);
                        return;
                    }
                    let w = &words[..run.len()];
                    kernels::decode_f32::<M>(bytemuck::cast_slice(w), &mut out[s..s + run.len()]);
                    s += run.len();
                    rest = next;
                }
            })
            .map_err(corrupt)?;
        match bad.or_else(|| (0..4).find(|&j| k[j] != lim[j])) {
            Some(j) => Err(short(j)),
            None => Ok(()),
        }
    }
}

/// The bits of `run`'s elements into `words`: 0 for the `zero` symbol, else `bits` of
/// the next plane entry from `k` (read at most at `last`, with no branch on the symbol);
/// returns the entry after the run's last. Spans of groups of 16 that are all zeros, or
/// none of them zero (a gradient's zeros come in runs: dead units, unused rows), go
/// without the running entry, through `span` for the latter.
#[inline(never)]
fn join_run(
    run: &[u8],
    zero: u8,
    mut k: usize,
    last: usize,
    bits: &impl Fn(u8, usize) -> u32,
    span: &impl Fn(&[u8], usize, &mut [u32]),
    words: &mut [u32; CHUNK],
) -> usize {
    const G: usize = 16;
    let words = &mut words[..run.len()];
    let kept = |g: &[u8]| g.iter().filter(|&&e| e != zero).count();
    let mut i = 0;
    while i + G <= run.len() {
        let c = kept(&run[i..i + G]);
        // How far the groups like this one go.
        let mut end = i + G;
        while end + G <= run.len() && (c == 0 || c == G) && kept(&run[end..end + G]) == c {
            end += G;
        }
        if c == 0 {
            words[i..end].fill(0);
        } else if c == G && k + (end - i) <= last + 1 {
            span(&run[i..end], k, &mut words[i..end]);
            k += end - i;
        } else {
            k = join_mixed(&run[i..end], zero, k, last, bits, &mut words[i..end]);
        }
        i = end;
    }
    join_mixed(&run[i..], zero, k, last, bits, &mut words[i..])
}

/// [`join_run`]'s loop, element by element.
#[inline(always)]
fn join_mixed(
    run: &[u8],
    zero: u8,
    mut k: usize,
    last: usize,
    bits: &impl Fn(u8, usize) -> u32,
    words: &mut [u32],
) -> usize {
    for (w, &e) in words.iter_mut().zip(run) {
        let v = bits(e, k.min(last));
        let keep = e != zero;
        *w = if keep { v } else { 0 };
        k += usize::from(keep);
    }
    k
}

/// Bytes of the zeros section: the plane entries before each of the exponents' block's
/// quarters 1, 2 and 3, then in all, each a u64 LE.
const ZEROS_SECTION: usize = 32;

/// The planes of the elements of `x` that are not +0.0, by `write(k, group, kept)`:
/// each quarter of the exponents' block up to the last such element, in groups of 16;
/// groups of zeros are skipped, the others written from plane entry `k` (`kept`: none
/// of the group is zero; else a zero's entry is written, then overwritten by the next
/// element's, never past the last entry), `write` returning the entry after them.
/// Returns the entries before quarters 1, 2, 3 and in all.
fn compact(x: &[f32], mut write: impl FnMut(usize, &[f32], bool) -> usize) -> [u64; 4] {
    let tail = last_nonzero(x);
    let mut k = 0;
    let mut counts = [0u64; 4];
    for (j, (lo, hi)) in entropy::quarters(x.len(), 1).into_iter().enumerate() {
        if j > 0 {
            counts[j - 1] = k as u64;
        }
        for g in x[lo.min(tail)..hi.min(tail)].chunks(16) {
            let kept = g.iter().filter(|v| v.to_bits() != 0).count();
            if kept > 0 {
                k = write(k, g, kept == g.len());
            }
        }
    }
    counts[3] = k as u64;
    counts
}

/// The f32 planes of `x` at entries `k..`: low halves into `lo16`, top bytes into `tops`.
fn put_f32(lo16: &mut [u8], tops: &mut [u8], k: usize, x: &[f32]) {
    let end = k + x.len();
    planes::split_f32(x, &mut lo16[2 * k..2 * end], &mut tops[k..end]);
}

/// The bf16 plane of `x` (its top bytes) at entries `k..` of `tops`.
fn put_bf16(tops: &mut [u8], k: usize, x: &[f32]) {
    planes::split_bf16(x, &mut tops[k..k + x.len()]);
}

/// One past the last element of `x` that is not +0.0 (0 if none is).
fn last_nonzero(x: &[f32]) -> usize {
    x.iter()
        .rposition(|v| v.to_bits() != 0)
        .map_or(0, |i| i + 1)
}

/// The zeros section of `counts` into `out`.
fn write_counts(out: &mut [u8], counts: [u64; 4]) {
    for (o, c) in out.chunks_exact_mut(8).zip(counts) {
        o.copy_from_slice(&c.to_le_bytes());
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
