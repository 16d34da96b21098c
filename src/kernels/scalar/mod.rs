//! Scalar kernels: the specification every other backend must reproduce to the bit.
//!
//! Each function here is written for clarity first. SIMD backends (a later issue) must
//! give byte-identical frames and bit-identical decoded floats; where an operation has an
//! order (a sum), that order is fixed here and documented in docs/wire-format.md.
//!
//! Conventions:
//! - payload bytes are little-endian;
//! - decoders take a const `M` (see [`mode`]): write the decoded values, add them to the
//!   output (the fused reduce step of a collective), or turn an output holding `p` into
//!   the error-feedback residual `p - decoded`;
//! - encoders return `true` when the input held any NaN or ±Inf (the frame's NONFINITE flag).

use crate::rng::Draws;

/// Largest finite |x| bit pattern plus one: `abs_bits >= INF_BITS` means NaN or ±Inf.
pub const INF_BITS: u32 = 0x7F80_0000;
/// The canonical quiet NaN written as the step of a block that held NaN or ±Inf.
pub const CANONICAL_NAN: f32 = f32::from_bits(0x7FC0_0000);

/// What a decoder does with each decoded value (the const `M` of every decode kernel).
pub mod mode {
    /// `out = decoded`.
    pub const WRITE: u8 = 0;
    /// `out += decoded` (the reduce step of a collective).
    pub const ADD: u8 = 1;
    /// `out = residual_of(out, decoded)`: `out` holds the `p` the frame was encoded from
    /// and becomes the error-feedback residual (see [`super::residual_of`]). Only the
    /// crate's own error-feedback step uses it, on frames it has just made; a kernel may
    /// use that `out` is `p` (the sign kernels read the sign bits from `p`).
    pub const RESIDUAL: u8 = 2;
}

/// The error-feedback residual of an element that was encoded as `p` and decodes to `d`:
/// `p - d` when that is finite; otherwise `p` when `p` is finite (nothing usable was sent,
/// e.g. a block the frame marks non-finite, or an fp16 overflow to ±Inf), else 0. So a
/// residual never holds NaN or ±Inf, and a non-finite gradient element is dropped rather
/// than carried into every later step. Written with bit tests and selects so that it
/// vectorises; every backend computes exactly this.
#[inline(always)]
pub fn residual_of(p: f32, d: f32) -> f32 {
    let e = p - d;
    let e_ok = (e.to_bits() & INF_BITS) != INF_BITS;
    let p_ok = (p.to_bits() & INF_BITS) != INF_BITS;
    let fallback = if p_ok { p } else { 0.0 };
    if e_ok { e } else { fallback }
}

/// Store the decoded value `v` into `o` as mode `M` says.
#[inline(always)]
pub fn put<const M: u8>(o: &mut f32, v: f32) {
    match M {
        mode::WRITE => *o = v,
        mode::ADD => *o += v,
        _ => *o = residual_of(*o, v),
    }
}

#[inline(always)]
fn abs_bits(x: f32) -> u32 {
    x.to_bits() & 0x7FFF_FFFF
}

/// Whether any byte of `codes` has every bit of `mask` set. Per byte position of 64-byte
/// rows, the minimum of `!c & mask`, which is zero only for such a byte: two byte
/// operations per byte that vectorise, without a branch per row (this function is also
/// the SIMD backends' kernel).
#[inline(always)]
pub fn any_all_set(codes: &[u8], mask: u8) -> bool {
    let mut rows = codes.chunks_exact(64);
    let least = (&mut rows).fold([u8::MAX; 64], |mut least, row| {
        for (m, &c) in least.iter_mut().zip(row) {
            *m = (*m).min(!c & mask);
        }
        least
    });
    least.contains(&0) || rows.remainder().iter().any(|&c| c & mask == mask)
}

/// Whether every little-endian f32 in `scales` (whole 4-byte groups; a shorter rest is
/// ignored) is a valid block scale: not negative (sign bit clear, so no -0 or -NaN
/// either) and not +Inf. Branch-free over 16-scale rows, so it vectorises (this function
/// is also the SIMD backends' kernel).
#[inline(always)]
pub fn f32_scales_valid(scales: &[u8]) -> bool {
    const INF: u32 = 0x7F80_0000;
    let bad = |w: &[u8]| {
        let bits = u32::from_le_bytes(w.try_into().unwrap_or([0; 4]));
        (bits >> 31) | (bits == INF) as u32
    };
    let mut rows = scales.chunks_exact(64);
    let any = (&mut rows).fold([0u32; 16], |mut any, row| {
        for (a, w) in any.iter_mut().zip(row.chunks_exact(4)) {
            *a |= bad(w);
        }
        any
    });
    any.iter().all(|&a| a == 0) && rows.remainder().chunks_exact(4).all(|w| bad(w) == 0)
}

/// True when any element is NaN or ±Inf.
pub fn any_nonfinite(x: &[f32]) -> bool {
    x.iter().fold(0u32, |m, &v| m.max(abs_bits(v))) >= INF_BITS
}

// ---------------------------------------------------------------- identity

/// f32 to little-endian bytes. `out.len() == 4 * x.len()`.
pub fn encode_f32(x: &[f32], out: &mut [u8]) -> bool {
    debug_assert_eq!(out.len(), 4 * x.len());
    let mut m = 0u32;
    for (o, &v) in out.chunks_exact_mut(4).zip(x) {
        o.copy_from_slice(&v.to_le_bytes());
        m = m.max(abs_bits(v));
    }
    m >= INF_BITS
}

/// Little-endian bytes to f32. `p.len() == 4 * out.len()`.
pub fn decode_f32<const M: u8>(p: &[u8], out: &mut [f32]) {
    debug_assert_eq!(p.len(), 4 * out.len());
    for (o, b) in out.iter_mut().zip(p.chunks_exact(4)) {
        put::<M>(o, f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    }
}

// ---------------------------------------------------------------- fp16 / bf16

/// f32 to IEEE binary16 bits: round to nearest even, overflow to ±Inf, subnormals
/// rounded, NaN kept a quiet NaN with the top payload bits. Identical to
/// `half::f16::from_f32` for all 2^32 inputs.
#[inline]
pub fn f32_to_f16(value: f32) -> u16 {
    let x = value.to_bits();
    let sign = x & 0x8000_0000;
    let exp = x & 0x7F80_0000;
    let man = x & 0x007F_FFFF;
    if exp == 0x7F80_0000 {
        let nan_bit = if man == 0 { 0 } else { 0x0200 };
        return ((sign >> 16) | 0x7C00 | nan_bit | (man >> 13)) as u16;
    }
    let half_sign = sign >> 16;
    let half_exp = ((exp >> 23) as i32) - 127 + 15;
    if half_exp >= 0x1F {
        return (half_sign | 0x7C00) as u16;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return half_sign as u16;
        }
        let man = man | 0x0080_0000;
        let mut half_man = man >> (14 - half_exp);
        let round_bit = 1u32 << (13 - half_exp);
        if (man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0 {
            half_man += 1;
        }
        return (half_sign | half_man) as u16;
    }
    let r = half_sign | ((half_exp as u32) << 10) | (man >> 13);
    let round_bit = 0x0000_1000;
    if (man & round_bit) != 0 && (man & (3 * round_bit - 1)) != 0 {
        (r + 1) as u16
    } else {
        r as u16
    }
}

/// IEEE binary16 bits to f32 (exact; a NaN gets the quiet bit set, as F16C does).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1F;
    let man = h & 0x03FF;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise. m has its top set bit at position p (0..=9).
            let p = 31 - m.leading_zeros();
            let e = p + 127 - 24; // value = m * 2^-24
            sign | (e << 23) | ((m << (23 - p)) & 0x007F_FFFF)
        }
        (0x1F, 0) => sign | 0x7F80_0000,
        (0x1F, m) => sign | 0x7FC0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// f32 to bfloat16 bits: round to nearest even, overflow to ±Inf, NaN kept a quiet NaN.
/// Identical to `half::bf16::from_f32` for all 2^32 inputs.
#[inline]
pub fn f32_to_bf16(value: f32) -> u16 {
    let x = value.to_bits();
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((x >> 16) | 0x0040) as u16;
    }
    let round_bit = 0x0000_8000;
    if (x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0 {
        (x >> 16) as u16 + 1
    } else {
        (x >> 16) as u16
    }
}

/// bfloat16 bits to f32 (exact: the bits shifted into the top half).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Encode with a 16-bit conversion. `out.len() == 2 * x.len()`.
pub fn encode_u16(x: &[f32], out: &mut [u8], conv: impl Fn(f32) -> u16) -> bool {
    debug_assert_eq!(out.len(), 2 * x.len());
    let mut m = 0u32;
    for (o, &v) in out.chunks_exact_mut(2).zip(x) {
        o.copy_from_slice(&conv(v).to_le_bytes());
        m = m.max(abs_bits(v));
    }
    m >= INF_BITS
}

/// Decode 16-bit codes. `p.len() == 2 * out.len()`.
pub fn decode_u16<const M: u8>(p: &[u8], out: &mut [f32], conv: impl Fn(u16) -> f32) {
    debug_assert_eq!(p.len(), 2 * out.len());
    for (o, b) in out.iter_mut().zip(p.chunks_exact(2)) {
        put::<M>(o, conv(u16::from_le_bytes([b[0], b[1]])));
    }
}

// ---------------------------------------------------------------- error feedback

/// The error-feedback input `r = beta * r + gamma * g`, in place: two rounded products and
/// a rounded sum, never fused (with `beta = gamma = 1` this is exactly `r + g`). Also the
/// SIMD backends' kernel: it is inlined into each ISA's copy and vectorised there.
#[inline(always)]
pub fn feedback_form(r: &mut [f32], g: &[f32], beta: f32, gamma: f32) {
    for (r, &g) in r.iter_mut().zip(g) {
        *r = beta * *r + gamma * g;
    }
}

/// [`feedback_form`] from a bf16 residual into the f32 tile `p` (also the SIMD kernel).
#[inline(always)]
pub fn feedback_form_bf16(p: &mut [f32], r: &[u16], g: &[f32], beta: f32, gamma: f32) {
    for ((p, &r), &g) in p.iter_mut().zip(r).zip(g) {
        *p = beta * bf16_to_f32(r) + gamma * g;
    }
}

/// A finite residual rounded to bf16 (nearest, ties to even), saturating at the largest
/// finite bf16 instead of rounding to ±Inf.
#[inline(always)]
pub fn residual_bf16(v: f32, to_bf16: impl Fn(f32) -> u16) -> u16 {
    let h = to_bf16(v);
    if h & 0x7FFF == 0x7F80 { h - 1 } else { h }
}

/// A fused error-feedback step of an element-wise 16-bit codec: `p = beta * r + gamma * g`
/// is written to `out` as `to(p)` (little-endian) and `r` becomes `residual_of(p,
/// from(to(p)))`. True if any `p` is NaN or ±Inf. The same as forming `p`, encoding and
/// decoding in residual mode, in one pass.
pub fn feedback_u16(
    r: &mut [f32],
    g: &[f32],
    beta: f32,
    gamma: f32,
    out: &mut [u8],
    to: impl Fn(f32) -> u16,
    from: impl Fn(u16) -> f32,
) -> bool {
    let mut nonfinite = false;
    for ((r, &g), o) in r.iter_mut().zip(g).zip(out.chunks_exact_mut(2)) {
        let p = beta * *r + gamma * g;
        nonfinite |= abs_bits(p) >= INF_BITS;
        let h = to(p);
        o.copy_from_slice(&h.to_le_bytes());
        *r = residual_of(p, from(h));
    }
    nonfinite
}

/// Store the f32 residual tile `p` into the bf16 residual `r` ([`residual_bf16`]).
pub fn feedback_store_bf16(r: &mut [u16], p: &[f32]) {
    for (r, &p) in r.iter_mut().zip(p) {
        *r = residual_bf16(p, f32_to_bf16);
    }
}

// ---------------------------------------------------------------- block statistics

/// The largest |x| bit pattern of a block (order-free, so every backend agrees).
/// A result `>= INF_BITS` means the block holds NaN or ±Inf. Integer max is associative,
/// so backends may reduce in any order (this function is also their kernel).
#[inline(always)]
pub fn max_abs_bits(x: &[f32]) -> u32 {
    x.iter().fold(0u32, |m, &v| m.max(abs_bits(v)))
}

/// The largest |x| bit pattern among the finite elements of `x` (0 if none): NaN and
/// ±Inf count as 0. Order-free, as [`max_abs_bits`].
#[inline(always)]
pub fn max_finite_abs_bits(x: &[f32]) -> u32 {
    // In 16 lanes: as one fold, the compilers turned the skipped elements into a scalar
    // loop of conditional moves.
    let finite = |v: f32| {
        let a = abs_bits(v);
        a & u32::from(a < INF_BITS).wrapping_neg()
    };
    let mut lanes = [0u32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = (*l).max(finite(v));
        }
    }
    let tail = chunks.remainder().iter().fold(0, |m, &v| m.max(finite(v)));
    lanes.iter().fold(tail, |m, &l| m.max(l))
}

/// Sum of `f(x)` in 16 interleaved lanes (element `j` goes to lane `j % 16`), lanes
/// combined as `l[j] += l[j + 8]`, then `+4`, `+2`, `+1`. This order is normative: it is
/// what AVX-512 (one 16-lane register), AVX2 (two 8-lane) and NEON (four 4-lane) all do.
#[inline]
pub fn lane_sum16<T>(x: &[f32], f: impl Fn(f32) -> T) -> T
where
    T: Copy + Default + core::ops::Add<Output = T>,
{
    let mut l = [T::default(); 16];
    for (j, &v) in x.iter().enumerate() {
        l[j % 16] = l[j % 16] + f(v);
    }
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            l[j] = l[j] + l[j + w];
        }
    }
    l[0]
}

/// Mean |x| of a finite block, exactly as the sign codec defines it: the f32 lane sum of
/// |x| divided by the length; if that sum overflows, the same lane sum in f64.
pub fn mean_abs(x: &[f32]) -> f32 {
    let s = lane_sum16(x, f32::abs);
    if s.is_finite() {
        s / x.len() as f32
    } else {
        (lane_sum16(x, |v| (v as f64).abs()) / x.len() as f64) as f32
    }
}

/// The sum of squares behind qsgd's L2 norm: squares are exact in f64, summed in the
/// 16-lane order. The norm is its square root in f64, rounded to f32 and saturated at
/// `f32::MAX` ([`BlockScale::l2`]).
pub fn l2_squares(x: &[f32]) -> f64 {
    lane_sum16(x, |v| (v as f64) * (v as f64))
}

// ---------------------------------------------------------------- level quantisation

/// How a scaled magnitude becomes an integer level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Round half to even (deterministic).
    Nearest,
    /// Round up with probability equal to the fractional part (unbiased).
    Stochastic,
}

/// Multipliers `(pre, inv)` such that `|x| * levels / m` is computed as
/// `(|x| * pre) * inv` without overflow, for `m > 0` finite. `pre` is 1, or 2^64 when
/// `m < 2^-100` (so that `levels / m` cannot overflow); scaling by `pre` is exact.
#[inline]
pub fn level_multiplier(m: f32, levels: f32) -> (f32, f32) {
    const TINY: f32 = 7.888_609e-31; // 2^-100
    const PRE: f32 = 18_446_744_073_709_551_616.0; // 2^64
    if m < TINY {
        (PRE, levels / (m * PRE))
    } else {
        (1.0, levels / m)
    }
}

/// The decode step of a block whose scale measure is `m` (finite, > 0) with `levels`
/// magnitude levels: `m / levels`, lowered by one ulp at a time until
/// `levels * step` is finite, so that no finite input decodes to ±Inf.
#[inline]
pub fn block_step(m: f32, levels: u32) -> f32 {
    let mut step = m / levels as f32;
    while (step * levels as f32).is_infinite() {
        step = f32::from_bits(step.to_bits() - 1);
    }
    step
}

/// Uniform draw in [0, 1) with 24-bit resolution from a 32-bit hash.
#[inline(always)]
pub(crate) fn unit24(h: u32) -> f32 {
    (h >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Magnitude level of `a = |x| * levels / m` (a >= 0), clamped to `levels`.
///
/// `a` is at most `levels` (127 at most) and a few rounding errors, far below 2^22, so
/// both roundings are written without `round_ties_even` and `floor`, which are library
/// calls on x86-64's baseline target (no SSE4.1), which this definition is compiled for:
/// adding 2^23 rounds `a` to an integer, ties to even (f32 addition rounds so, and 2^23
/// is even), and the subtraction is exact; truncation toward zero is `floor` for `a >= 0`.
#[inline(always)]
fn level(a: f32, levels: u32, round: Round, h: u32) -> u32 {
    debug_assert!((0.0..4_194_304.0).contains(&a));
    let q = match round {
        Round::Nearest => (a + 8_388_608.0) - 8_388_608.0,
        Round::Stochastic => {
            let fl = a as u32 as f32;
            // a - fl is exact (Sterbenz for a >= 1, trivially for a < 1). The draw's
            // comparison is added, not branched on: it is a coin toss.
            fl + f32::from(u8::from(unit24(h) < a - fl))
        }
    };
    (q as u32).min(levels)
}

/// Quantise one finite, non-zero-max block to signed levels in `[-levels, levels]`, calling
/// `emit(j, negative, magnitude)` for each element. `m` is the block's scale measure
/// (absmax or norm, `m >= max |x|`, `m > 0`), `first` the global index of the first element.
#[inline]
pub fn quantise_block(
    x: &[f32],
    m: f32,
    levels: u32,
    round: Round,
    draws: &Draws,
    first: u64,
    mut emit: impl FnMut(usize, bool, u32),
) {
    let (pre, inv) = level_multiplier(m, levels as f32);
    for (j, &v) in x.iter().enumerate() {
        let h = if round == Round::Stochastic {
            draws.draw(first + j as u64)
        } else {
            0
        };
        let q = level((v.abs() * pre) * inv, levels, round, h);
        emit(j, v.is_sign_negative(), q);
    }
}

// ---------------------------------------------------------------- bit packing

mod bits;
pub use bits::*;

// ---------------------------------------------------------------- block codecs

/// Write block `b`'s step into the steps section (f32 LE, one per block; the codes follow
/// it: the layout of every block codec).
#[inline]
pub fn put_step(steps: &mut [u8], b: usize, step: f32) {
    steps[4 * b..4 * b + 4].copy_from_slice(&step.to_le_bytes());
}

/// Step of block `b`.
#[inline]
pub fn get_step(steps: &[u8], b: usize) -> f32 {
    let s = &steps[4 * b..4 * b + 4];
    f32::from_le_bytes([s[0], s[1], s[2], s[3]])
}

/// How a block's scale measure `m` is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// `m = max |x|`.
    AbsMax,
    /// `m = ||x||_2` (see [`l2_squares`] and [`BlockScale::l2`]).
    L2,
}

impl Measure {
    /// The kind and scale of block `xb`; `squares` is [`l2_squares`] or a SIMD equal.
    #[inline(always)]
    pub fn of(self, xb: &[f32], squares: impl Fn(&[f32]) -> f64) -> BlockScale {
        match self {
            Measure::AbsMax => BlockScale::abs_max(xb),
            Measure::L2 => BlockScale::l2(squares(xb)),
        }
    }
}

/// Encode int8 blocks: steps then one i8 per element. `steps.len() == 4 * nblocks`,
/// `codes.len() == x.len()`.
pub fn encode_int8(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    encode_int8_blocks(
        x,
        block,
        round,
        draws,
        first,
        steps,
        codes,
        |xb, cb, m, start| quantise_int8(xb, cb, m, round, draws, start),
    )
}

/// The int8 codes of one finite block with scale `m` (first global index `start`).
pub fn quantise_int8(xb: &[f32], cb: &mut [u8], m: f32, round: Round, d: &Draws, start: u64) {
    quantise_block(xb, m, 127, round, d, start, |j, neg, q| {
        let q = q as i8;
        cb[j] = if neg { -q } else { q } as u8;
    });
}

/// True when global indices `start..start + len` (len >= 1) share one 2^32 window, so one
/// hash key serves them all. The block layouts below send blocks that straddle a window
/// to the oracle, so a SIMD caller's block kernel sees only blocks with one key.
#[inline(always)]
pub fn in_one_window(start: u64, len: usize) -> bool {
    start >> 32 == (start + len as u64 - 1) >> 32
}

/// The kind of a block of the step codecs, with its scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BlockScale {
    /// The block holds NaN or ±Inf.
    NonFinite,
    /// Every element is ±0.
    Zero,
    /// Any other block: its scale `m` (positive and finite).
    Of(f32),
}

impl BlockScale {
    /// The kind of a block and its scale `m = max |x|`.
    #[inline(always)]
    pub fn abs_max(xb: &[f32]) -> BlockScale {
        BlockScale::of_max_bits(max_abs_bits(xb))
    }

    /// The kind of a block whose largest `|x|` bit pattern is `mb`, and its scale
    /// `f32::from_bits(mb)` ([`BlockScale::abs_max`] of a maximum already taken).
    #[inline(always)]
    pub fn of_max_bits(mb: u32) -> BlockScale {
        if mb >= INF_BITS {
            BlockScale::NonFinite
        } else if mb == 0 {
            BlockScale::Zero
        } else {
            BlockScale::Of(f32::from_bits(mb))
        }
    }

    /// The step written for a block of this kind with `levels` magnitude levels: NaN for
    /// a block holding NaN or ±Inf, 0 for an all-zero block, else `block_step(m, levels)`.
    #[inline(always)]
    pub fn step(self, levels: u32) -> f32 {
        match self {
            BlockScale::NonFinite => CANONICAL_NAN,
            BlockScale::Zero => 0.0,
            BlockScale::Of(m) => block_step(m, levels),
        }
    }

    /// The kind of a block and its L2 norm, from its sum of squares `ss` ([`l2_squares`]
    /// or a SIMD equal). One pass decides the kind as well as a max would: a NaN or ±Inf
    /// square makes `ss` NaN or +Inf, finite squares cannot overflow f64 (each is below
    /// 2^256), and the f64 square of a non-zero f32 is non-zero (at least 2^-298).
    #[inline(always)]
    pub fn l2(ss: f64) -> BlockScale {
        if !ss.is_finite() {
            BlockScale::NonFinite
        } else if ss == 0.0 {
            BlockScale::Zero
        } else {
            BlockScale::Of((ss.sqrt() as f32).min(f32::MAX))
        }
    }
}

/// The block layout of the step codecs (int8, qsgd, ternary), shared by every backend.
/// Per block, by its `measure(xb)`: a block holding NaN or ±Inf gets a NaN step, an
/// all-zero block a zero step, and any other block the step `block_step(m, levels)` of
/// its scale `m`. `codes(b, xb, m, start)` then writes block `b`'s codes: `m` is `None`
/// for the first two kinds (their codes are all zero), and `start` is the global index of
/// the block's first element.
#[inline(always)]
pub fn encode_step_blocks(
    x: &[f32],
    block: usize,
    levels: u32,
    first: u64,
    steps: &mut [u8],
    measure: impl Fn(&[f32]) -> BlockScale,
    mut codes: impl FnMut(usize, &[f32], Option<f32>, u64),
) -> bool {
    let mut nonfinite = false;
    for (b, xb) in x.chunks(block).enumerate() {
        let start = first + (b * block) as u64;
        let scale = measure(xb);
        nonfinite |= scale == BlockScale::NonFinite;
        put_step(steps, b, scale.step(levels));
        match scale {
            BlockScale::Of(m) => codes(b, xb, Some(m), start),
            _ => codes(b, xb, None, start),
        }
    }
    nonfinite
}

/// The int8 layout on [`encode_step_blocks`]: one code byte per element, all zero in a
/// block without a scale, else written by `quantise(xb, cb, m, global start)` for a block
/// inside one 2^32 index window and by [`quantise_int8`] for the rare other.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode_int8_blocks(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
    mut quantise: impl FnMut(&[f32], &mut [u8], f32, u64),
) -> bool {
    // The closures are inlined so that a SIMD caller's `quantise` is compiled for its ISA.
    encode_step_blocks(
        x,
        block,
        127,
        first,
        steps,
        BlockScale::abs_max,
        #[inline(always)]
        |b, xb, m, start| {
            let cb = &mut codes[b * block..b * block + xb.len()];
            match m {
                Some(m) if in_one_window(start, xb.len()) => quantise(xb, cb, m, start),
                Some(m) => quantise_int8(xb, cb, m, round, draws, start),
                None => cb.fill(0),
            }
        },
    )
}

/// Decode int8 blocks: `x = code * step`.
pub fn decode_int8<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        let s = get_step(steps, b);
        for (o, &c) in ob.iter_mut().zip(cb) {
            put::<M>(o, (c as i8) as f32 * s);
        }
    }
}

/// The byte-aligned sign-magnitude layout of the SIMD backends on [`encode_step_blocks`]
/// (blocks start on byte boundaries, `block % (8 / BITS) == 0`): the same bit stream as
/// [`encode_signmag`], but every code byte is written, so `codes` need not be zeroed. A
/// block without a scale gets zero bytes; any other is written by `quantise(xb, cb, m,
/// global start)` when it lies inside one 2^32 index window, else by
/// [`quantise_signmag_bytes`]. `squares` is the sum of squares of the L2 measure
/// ([`l2_squares`] or a SIMD equal).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode_signmag_blocks<const BITS: u32>(
    x: &[f32],
    block: usize,
    measure: Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
    squares: impl Fn(&[f32]) -> f64,
    mut quantise: impl FnMut(&[f32], &mut [u8], f32, u64),
) -> bool {
    let per = (8 / BITS) as usize;
    assert!(
        block.is_multiple_of(per),
        "blocks must start on byte boundaries"
    );
    encode_step_blocks(
        x,
        block,
        (1u32 << (BITS - 1)) - 1,
        first,
        steps,
        #[inline(always)]
        |xb: &[f32]| measure.of(xb, &squares),
        #[inline(always)]
        |b, xb, m, start| {
            let cb = &mut codes[b * block / per..][..xb.len().div_ceil(per)];
            match m {
                Some(m) if in_one_window(start, xb.len()) => quantise(xb, cb, m, start),
                Some(m) => quantise_signmag_bytes(xb, cb, m, BITS, draws, start),
                None => cb.fill(0),
            }
        },
    )
}

/// The sign-magnitude codes of one block with scale `m` as whole bytes: `cb` (the
/// block's `ceil(xb.len() * bits / 8)` bytes, any contents) is zeroed and written.
pub fn quantise_signmag_bytes(
    xb: &[f32],
    cb: &mut [u8],
    m: f32,
    bits: u32,
    draws: &Draws,
    start: u64,
) {
    cb.fill(0);
    quantise_signmag(xb, m, bits, draws, start, cb, 0);
}

/// Encode sign-magnitude blocks of `bits` (2, 4 or 8) with stochastic rounding to
/// `levels = 2^(bits-1) - 1` magnitude levels: qsgd (`Measure::L2`) and ternary
/// (`Measure::AbsMax`, bits 2). `codes` is a zeroed bit stream of `bits * x.len()` bits.
#[allow(clippy::too_many_arguments)]
pub fn encode_signmag(
    x: &[f32],
    block: usize,
    bits: u32,
    measure: Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let scale = |xb: &[f32]| measure.of(xb, l2_squares);
    let levels = (1u32 << (bits - 1)) - 1;
    encode_step_blocks(x, block, levels, first, steps, scale, |b, xb, m, start| {
        if let Some(m) = m {
            quantise_signmag(xb, m, bits, draws, start, codes, b * block);
        }
    })
}

/// The sign-magnitude codes of one block with scale `m` (first global index `start`),
/// or-ed into the zeroed bit stream `codes` as elements `base..base + xb.len()`.
pub fn quantise_signmag(
    xb: &[f32],
    m: f32,
    bits: u32,
    draws: &Draws,
    start: u64,
    codes: &mut [u8],
    base: usize,
) {
    let levels = (1u32 << (bits - 1)) - 1;
    quantise_block(
        xb,
        m,
        levels,
        Round::Stochastic,
        draws,
        start,
        |j, neg, q| {
            // A zero level has no sign bit; or-ing its zero code is harmless, and cheaper
            // than a branch on a coin toss.
            let code = q | u32::from(neg && q != 0) << (bits - 1);
            put_bits(codes, base + j, bits, code as u8);
        },
    );
}

/// Decode sign-magnitude blocks: `x = ±magnitude * step`.
pub fn decode_signmag<const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    bits: u32,
    out: &mut [f32],
) {
    let sign_bit = 1u8 << (bits - 1);
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = get_step(steps, b);
        let base = b * block;
        for (j, o) in ob.iter_mut().enumerate() {
            let c = get_bits(codes, base + j, bits);
            let v = (c & !sign_bit) as f32 * s;
            put::<M>(o, if c & sign_bit != 0 { -v } else { v });
        }
    }
}

/// Encode sign blocks: step = mean |x|, one bit per element (1 = sign bit set).
/// `codes` is a zeroed bit stream of `x.len()` bits.
pub fn encode_sign(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
    let mut nonfinite = false;
    for (b, xb) in x.chunks(block).enumerate() {
        if max_abs_bits(xb) >= INF_BITS {
            nonfinite = true;
            put_step(steps, b, CANONICAL_NAN);
            continue;
        }
        put_step(steps, b, mean_abs(xb));
        let base = b * block;
        for (j, &v) in xb.iter().enumerate() {
            put_bits(codes, base + j, 1, v.is_sign_negative() as u8);
        }
    }
    nonfinite
}

/// Decode sign blocks: `x = ±step`.
pub fn decode_sign<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = get_step(steps, b).to_bits();
        let base = b * block;
        for (j, o) in ob.iter_mut().enumerate() {
            // The bit is the sign: negation is an exclusive or of the sign bit, written
            // so rather than as a branch on a coin toss (0.7 GB/s adding, where the SIMD
            // backends run this for blocks that do not start on byte boundaries).
            let bit = u32::from(get_bits(codes, base + j, 1));
            put::<M>(o, f32::from_bits(s ^ (bit << 31)));
        }
    }
}

// ---------------------------------------------------------------- natural compression

/// Smallest block reference exponent: keeps every code's power of two >= 2^-149.
pub const NATURAL_MIN_REF: i32 = -23;
/// Reference byte marking a block that held NaN or ±Inf.
pub const NATURAL_NONFINITE: u8 = 255;

/// `floor(log2(a))` for finite `a > 0`, including subnormals.
#[inline]
fn ilog2_f32(a: f32) -> i32 {
    let bits = a.to_bits();
    let e = (bits >> 23) as i32;
    if e != 0 {
        e - 127
    } else {
        -149 + (31 - (bits & 0x007F_FFFF).leading_zeros() as i32)
    }
}

/// `2^k` as f32 for `k` in `[-149, 127]` (exact, subnormal below -126).
#[inline]
pub fn pow2_f32(k: i32) -> f32 {
    debug_assert!((-149..=127).contains(&k));
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// Reference exponent of a finite block with `max |x|` bits `mb`:
/// `clamp(floor(log2 max) + 1, -23, 127)`.
#[inline]
pub fn natural_ref(mb: u32) -> i32 {
    if mb == 0 {
        NATURAL_MIN_REF
    } else {
        (ilog2_f32(f32::from_bits(mb)) + 1).clamp(NATURAL_MIN_REF, 127)
    }
}

/// Encode natural-compression blocks: one reference byte per block (`r + 127`), then one
/// code byte per element (bit 7 sign, bits 0..7 `m`: `m = 0` is zero, else the magnitude
/// `2^(r - 127 + m)`). `refs.len() == nblocks`, `codes.len() == x.len()`.
pub fn encode_natural(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
) -> bool {
    encode_natural_blocks(x, block, draws, first, refs, codes, |xb, cb, r, start| {
        natural_block(xb, cb, r, draws, start)
    })
}

/// The natural-compression layout, shared by every backend: a block holding NaN or ±Inf
/// gets reference byte 255 and zero codes; any other block the reference `r` (byte
/// `r + 127`) and the codes `quantise(xb, cb, r, global start)` writes when it lies inside
/// one 2^32 index window, else [`natural_block`].
#[inline(always)]
pub fn encode_natural_blocks(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
    mut quantise: impl FnMut(&[f32], &mut [u8], i32, u64),
) -> bool {
    let mut nonfinite = false;
    for (b, (xb, cb)) in x.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
        let mb = max_abs_bits(xb);
        if mb >= INF_BITS {
            nonfinite = true;
            refs[b] = NATURAL_NONFINITE;
            cb.fill(0);
            continue;
        }
        let r = natural_ref(mb);
        refs[b] = (r + 127) as u8;
        let start = first + (b * block) as u64;
        if in_one_window(start, xb.len()) {
            quantise(xb, cb, r, start);
        } else {
            natural_block(xb, cb, r, draws, start);
        }
    }
    nonfinite
}

/// The natural-compression codes of one finite block with reference exponent `r`.
pub fn natural_block(xb: &[f32], cb: &mut [u8], r: i32, draws: &Draws, start: u64) {
    let kmin = r - 126;
    for (j, (&v, c)) in xb.iter().zip(cb.iter_mut()).enumerate() {
        let a = v.abs();
        let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
        if a == 0.0 {
            *c = 0;
            continue;
        }
        let u = (draws.draw(start + j as u64) >> 8) as f64 / 16_777_216.0;
        let e = ilog2_f32(a);
        // f is exact in f64: scaling an f32 by a power of two (built from its bits, as
        // `powi`'s precision is unspecified).
        let k = if e >= kmin {
            let f = a as f64 / pow2_f32(e) as f64 - 1.0;
            let up = u < f && e < r;
            e + up as i32
        } else {
            let f = a as f64 / pow2_f32(kmin) as f64;
            if u < f { kmin } else { kmin - 1 }
        };
        let m = k - kmin + 1; // 0 when rounded to zero
        *c = if m == 0 { 0 } else { sign | m as u8 };
    }
}

/// Decode natural-compression blocks (reference bytes already validated).
pub fn decode_natural<const M: u8>(refs: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        if refs[b] == NATURAL_NONFINITE {
            for o in ob {
                put::<M>(o, CANONICAL_NAN);
            }
            continue;
        }
        let r = refs[b] as i32 - 127;
        for (o, &c) in ob.iter_mut().zip(cb) {
            let m = (c & 0x7F) as i32;
            let v = if m == 0 { 0.0 } else { pow2_f32(r - 127 + m) };
            put::<M>(o, if c & 0x80 != 0 { -v } else { v });
        }
    }
}

// ---------------------------------------------------------------- top-k selection

/// Magnitude key of an element: its |x| bit pattern. Keys order as magnitudes do for
/// finite values, and put ±Inf above every finite value and NaN above ±Inf.
#[inline(always)]
pub fn mag_key(v: f32) -> u32 {
    abs_bits(v)
}

/// The k-th largest magnitude key (`1 <= k <= x.len()`) by three radix-histogram passes
/// over the 31-bit keys (11, 11 and 9 bits). No allocation.
pub fn kth_largest_key(x: &[f32], k: usize) -> u32 {
    debug_assert!(k >= 1 && k <= x.len());
    let mut prefix = 0u32; // bits fixed so far
    let mut mask = 0u32; // which bits are fixed
    let mut rank = k; // rank of the wanted key among those matching the prefix
    for (shift, width) in [(20u32, 11u32), (9, 11), (0, 9)] {
        let mut hist = [0u32; 2048];
        let digit_mask = (1u32 << width) - 1;
        for &v in x {
            let key = mag_key(v);
            if key & mask == prefix {
                hist[((key >> shift) & digit_mask) as usize] += 1;
            }
        }
        let mut d = digit_mask as usize;
        loop {
            let c = hist[d] as usize;
            if c >= rank {
                break;
            }
            rank -= c;
            d -= 1;
        }
        prefix |= (d as u32) << shift;
        mask |= digit_mask << shift;
    }
    prefix
}

/// The groups of [`lane_bound`]: element `i` of a slice is in group `i % BOUND_GROUPS`.
pub const BOUND_GROUPS: usize = 16;

/// The oracle of `kernels::lane_bound`: group by group (element `i` in group `i % 16`),
/// its `d` (1 to 4) largest keys kept by insertion, the `d`-th of them (0 for a group of
/// fewer), the least over the groups.
pub fn lane_bound(x: &[f32], d: usize) -> u32 {
    assert!((1..=4).contains(&d), "lane_bound depth {d} outside 1..=4");
    let groups = BOUND_GROUPS;
    (0..groups)
        .map(|l| {
            let mut top = [0u32; 4];
            for &v in x.iter().skip(l).step_by(groups) {
                let k = mag_key(v);
                if let Some(p) = top[..d].iter().position(|&t| k > t) {
                    top[p..d].rotate_right(1);
                    top[p] = k;
                }
            }
            top[d - 1]
        })
        .min()
        .unwrap_or(0)
}

/// The oracle of `kernels::filter_keys`: one element at a time, each written and kept
/// or overwritten by the next (no branch on the data).
pub fn filter_keys(x: &[f32], t: u32, idx: &mut [u32], keys: &mut [u32]) -> usize {
    let mut count = 0;
    for (i, &v) in x.iter().enumerate() {
        let k = mag_key(v);
        idx[count] = i as u32;
        keys[count] = k;
        count += (k >= t) as usize;
    }
    count
}

// ---------------------------------------------------------------- compare and compress

/// The oracle of `kernels::filter_mag_ge`: one element at a time, stopping at the same
/// 64-element group boundary.
pub fn filter_mag_ge(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    filter(x.len(), idx, |i| mag_key(x[i]) >= t)
}

/// The oracle of `kernels::filter_mag_ge_vals`: [`filter_mag_ge`], then the kept
/// elements' bits.
pub fn filter_mag_ge_vals(x: &[f32], t: u32, idx: &mut [u32], vals: &mut [u32]) -> (usize, usize) {
    let (done, count) = filter_mag_ge(x, t, idx);
    for (v, &i) in vals[..count].iter_mut().zip(&idx[..count]) {
        *v = x[i as usize].to_bits();
    }
    (done, count)
}

/// The oracle of `kernels::retain_mag_ge`: one entry at a time.
pub fn retain_mag_ge(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    retain_mag_ge_from(idx, vals, t, 0, 0)
}

/// [`retain_mag_ge`] from entry `r` on, the first `w <= r` entries already kept; returns
/// how many more it keeps (the SIMD kernels' tail).
pub fn retain_mag_ge_from(idx: &mut [u32], vals: &mut [u32], t: u32, r: usize, w: usize) -> usize {
    let n = idx.len().min(vals.len());
    let mut at = w;
    // Each entry is moved and kept or overwritten by the next kept one (at <= j): no
    // branch on the data.
    for j in r..n {
        let keep = mag_key(f32::from_bits(vals[j])) >= t;
        idx[at] = idx[j];
        vals[at] = vals[j];
        at += keep as usize;
    }
    at - w
}

/// The oracle of `kernels::filter_draw_lt`.
pub fn filter_draw_lt(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
) -> (usize, usize) {
    filter(n, idx, |i| (draws.draw(first + i as u64) as u64) < t)
}

/// The oracle of `kernels::count_draw_lt`: how many `i < n` have
/// `draws.draw(first + i) < t`.
pub fn count_draw_lt(draws: &Draws, first: u64, t: u64, n: usize) -> usize {
    (0..n as u64)
        .filter(|&i| (draws.draw(first + i) as u64) < t)
        .count()
}

/// The oracle of `kernels::draw_masks`: writes the first `n.div_ceil(64)` entries of
/// `masks`, bit `b` of entry `w` set when element `i = 64 w + b < n` has
/// `draws.draw(first + i) < t`; returns how many bits are set.
pub fn draw_masks(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    masks: &mut [core::mem::MaybeUninit<u64>],
) -> usize {
    let mut count = 0;
    for (w, slot) in masks[..n.div_ceil(64)].iter_mut().enumerate() {
        let at = 64 * w;
        let m = (0..(n - at).min(64))
            .filter(|&b| (draws.draw(first + (at + b) as u64) as u64) < t)
            .fold(0u64, |m, b| m | 1 << b);
        count += m.count_ones() as usize;
        slot.write(m);
    }
    count
}

#[inline]
fn filter(n: usize, idx: &mut [u32], keep: impl Fn(usize) -> bool) -> (usize, usize) {
    let groups = idx.len() / 64;
    let done = n.min(64 * groups);
    let mut count = 0;
    for i in 0..done {
        if keep(i) {
            idx[count] = i as u32;
            count += 1;
        }
    }
    (done, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "safe scalar code; natively over every code")]
    fn f16_decode_matches_half_for_all_codes() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h).to_bits();
            let theirs = half::f16::from_bits(h).to_f32().to_bits();
            assert_eq!(ours, theirs, "f16 {h:#06x}");
        }
    }

    #[test]
    fn kth_largest_key_matches_sort() {
        let x: Vec<f32> = (0..1000u32)
            .map(|i| crate::rng::draw(3, 0, i as u64) as f32 - 2.0e9)
            .chain([f32::NAN, f32::INFINITY, -0.0, 0.0, 1.0, 1.0, 1.0])
            .collect();
        let mut keys: Vec<u32> = x.iter().map(|&v| mag_key(v)).collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        for k in [1, 2, 3, 17, 500, 1000, x.len()] {
            assert_eq!(kth_largest_key(&x, k), keys[k - 1], "k = {k}");
        }
    }

    #[test]
    fn bit_stream_round_trips_every_width() {
        for width in 0..=32u32 {
            let vals: Vec<u32> = (0..37u32)
                .map(|i| {
                    let v = crate::rng::lowbias32(i * 7 + width);
                    if width == 32 {
                        v
                    } else {
                        v & ((1u32 << width) - 1)
                    }
                })
                .collect();
            let mut buf = vec![0u8; (37 * width as usize).div_ceil(8)];
            let mut w = BitWriter::new(&mut buf);
            for &v in &vals {
                w.put(v, width);
            }
            assert_eq!(w.finish(), buf.len());
            let mut r = BitReader::new(&buf);
            for &v in &vals {
                assert_eq!(r.get(width), v, "width {width}");
            }
        }
    }

    #[test]
    fn pow2_and_ilog2_agree() {
        for k in -149..=127 {
            let p = pow2_f32(k);
            assert_eq!(ilog2_f32(p), k);
            // 2^k from f64 bits: exact, unlike `powi` (whose precision is unspecified).
            assert_eq!(p as f64, f64::from_bits(((k + 1023) as u64) << 52));
        }
    }
}
