//! The lossless codec's float planes: beside each f32's (or bf16's) exponent, which the
//! codec entropy-codes, its sign with the top 7 mantissa bits in one byte and (f32) the
//! low 16 mantissa bits; split off, and joined with the exponents again. One definition,
//! inlined into each backend's build (the loops are plain lane-wise integer work that
//! every instruction set vectorises).

use super::scalar::put;
use super::table::{self, call};

/// The f32 planes of `x`: low halves (u16 LE) into `lo16`, top bytes into `tops`
/// (`lo16.len() == 2 * x.len()`, `tops.len() == x.len()`).
pub fn split_f32(x: &[f32], lo16: &mut [u8], tops: &mut [u8]) {
    call!(split_f32(x, lo16, tops))
}

/// The bf16 plane of `x`: its top bytes (`tops.len() == x.len()`).
pub fn split_bf16(x: &[f32], tops: &mut [u8]) {
    call!(split_bf16(x, tops))
}

/// The f32s of exponents `exps` and planes `lo16`, `tops` into `out` in mode `M`
/// (lengths as [`split_f32`]'s).
pub fn join_f32<const M: u8>(exps: &[u8], lo16: &[u8], tops: &[u8], out: &mut [f32]) {
    call!(join_f32[M as usize](exps, lo16, tops, out))
}

/// The bf16 values (as f32) of exponents `exps` and top bytes `tops` into `out` in mode
/// `M`.
pub fn join_bf16<const M: u8>(exps: &[u8], tops: &[u8], out: &mut [f32]) {
    call!(join_bf16[M as usize](exps, tops, out))
}

/// What [`exponents`] saw: enough to know which symbols occur but for gaps between the
/// least and the greatest of the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExponentStats {
    /// Symbols that are 0 (+0.0, -0.0 and the subnormals).
    pub zero_symbols: u32,
    /// Symbols that are the all-ones field (255, or 31 for binary16's): NaN and Inf.
    pub all_ones: u32,
    /// The least symbol but 0 (255 if there is none).
    pub min: u8,
    /// The greatest symbol but the all-ones one (0 if there is none).
    pub max: u8,
}

/// The exponent symbols of `x` into `exps` (as long): each f32's exponent field, or with
/// `fp16` its binary16 exponent field (31 for the f32 all-ones field; 0 for fields below
/// binary16's normal range). `x` is at most 2^16 long.
pub fn exponents(x: &[f32], fp16: bool, exps: &mut [u8]) -> ExponentStats {
    call!(exponents(x, fp16, exps))
}

simd_op!(exponents_on => Exponents { x: &'a [f32], fp16: bool, exps: &'a mut [u8] }
    -> ExponentStats = exponents_with(x, fp16, exps));
simd_op!(split_f32_on => SplitF32 { x: &'a [f32], lo16: &'a mut [u8], tops: &'a mut [u8] } -> ()
    = split_f32_with(x, lo16, tops));
simd_op!(split_bf16_on => SplitBf16 { x: &'a [f32], tops: &'a mut [u8] } -> ()
    = split_bf16_with(x, tops));
simd_op!(join_f32_on => JoinF32<const M: u8> {
    exps: &'a [u8], lo16: &'a [u8], tops: &'a [u8], out: &'a mut [f32],
} -> () = join_f32_with::<M>(exps, lo16, tops, out));
simd_op!(join_bf16_on => JoinBf16<const M: u8> { exps: &'a [u8], tops: &'a [u8], out: &'a mut [f32] }
    -> () = join_bf16_with::<M>(exps, tops, out));

/// The sign and top 7 mantissa bits of f32 bits `b` in one byte.
#[inline(always)]
pub fn top(b: u32) -> u8 {
    (((b >> 24) & 0x80) | ((b >> 16) & 0x7F)) as u8
}

/// The f32 bits of an exponent, low half and top byte.
#[inline(always)]
pub fn join(e: u8, lo: u16, t: u8) -> u32 {
    ((t as u32 & 0x80) << 24) | ((e as u32) << 23) | ((t as u32 & 0x7F) << 16) | lo as u32
}

/// [`exponents`]'s definition, inlined into each backend's build.
#[inline(always)]
pub(super) fn exponents_with(x: &[f32], fp16: bool, exps: &mut [u8]) -> ExponentStats {
    #[inline(always)]
    fn each(x: &[f32], exps: &mut [u8], exp: impl Fn(u32) -> u8, ones: u8) -> ExponentStats {
        let (mut zero_symbols, mut all_ones) = (0u32, 0u32);
        // The least of `s - 1` (wrapping: 0 is the greatest) and the greatest symbol
        // with the all-ones one taken as 0.
        let (mut least, mut max) = (u8::MAX, 0u8);
        // A piece's symbols made, then looked at as bytes (32 to a vector on AVX2; at
        // most 128 to a count, which fits a byte).
        for (xs, es) in x.chunks(128).zip(exps.chunks_mut(128)) {
            for (e, v) in es.iter_mut().zip(xs) {
                *e = exp(v.to_bits());
            }
            let (mut z, mut o) = (0u8, 0u8);
            for &s in es.iter() {
                z += u8::from(s == 0);
                o += u8::from(s == ones);
                least = least.min(s.wrapping_sub(1));
                max = max.max(if s == ones { 0 } else { s });
            }
            zero_symbols += u32::from(z);
            all_ones += u32::from(o);
        }
        ExponentStats {
            zero_symbols,
            all_ones,
            min: if least == u8::MAX { u8::MAX } else { least + 1 },
            max,
        }
    }
    if fp16 {
        let half = |b: u32| match (b >> 23) as u8 {
            0xFF => 0x1F,
            e => e.saturating_sub(112),
        };
        each(x, exps, half, 0x1F)
    } else {
        each(x, exps, |b| (b >> 23) as u8, 0xFF)
    }
}

/// [`split_f32`]'s definition, inlined into each backend's build.
#[inline(always)]
pub(super) fn split_f32_with(x: &[f32], lo16: &mut [u8], tops: &mut [u8]) {
    for ((l, t), v) in lo16.chunks_exact_mut(2).zip(tops).zip(x) {
        let b = v.to_bits();
        l.copy_from_slice(&(b as u16).to_le_bytes());
        *t = top(b);
    }
}

/// [`split_bf16`]'s definition.
#[inline(always)]
pub(super) fn split_bf16_with(x: &[f32], tops: &mut [u8]) {
    for (t, v) in tops.iter_mut().zip(x) {
        *t = top(v.to_bits());
    }
}

/// [`join_f32`]'s definition.
#[inline(always)]
pub(super) fn join_f32_with<const M: u8>(exps: &[u8], lo16: &[u8], tops: &[u8], out: &mut [f32]) {
    for (((o, &e), l), &t) in out.iter_mut().zip(exps).zip(lo16.chunks_exact(2)).zip(tops) {
        put::<M>(
            o,
            f32::from_bits(join(e, u16::from_le_bytes([l[0], l[1]]), t)),
        );
    }
}

/// [`join_bf16`]'s definition.
#[inline(always)]
pub(super) fn join_bf16_with<const M: u8>(exps: &[u8], tops: &[u8], out: &mut [f32]) {
    for ((o, &e), &t) in out.iter_mut().zip(exps).zip(tops) {
        put::<M>(o, f32::from_bits(join(e, 0, t)));
    }
}
