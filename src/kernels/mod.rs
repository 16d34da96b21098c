//! The hot loops, by operation, and the backend that runs them.
//!
//! - `scalar` is the oracle and the fallback: plain code that defines
//!   every result.
//! - `portable` holds branch-free versions of the same kernels, compiled once per SIMD
//!   backend through pulp's `Arch::dispatch` (AVX2 = x86-64-v3, AVX-512 = x86-64-v4,
//!   NEON), so the compiler vectorises one source for every ISA.
//! - `x86_64` holds what the vectoriser cannot emit (F16C / AVX-512 half conversions,
//!   mask-register compare and compress).
//!
//! The functions in this module pick the implementation for [`Backend::current`]. Every
//! backend gives byte-identical frames and bit-identical decoded floats (tests/backends.rs,
//! tests/exhaustive.rs). This module tree is the only place `unsafe` may appear, and every
//! such block carries a `// SAFETY:` comment.

#![allow(unsafe_code)]

pub mod backend;
pub mod codebook;
pub mod dct;
pub mod fp8;
pub mod fpmode;
pub mod gemm;
mod portable;
pub mod routing;
pub mod scalar;
pub(crate) mod shm;
mod table;
#[cfg(target_arch = "x86_64")]
mod x86_64;
pub use select::*;
use shape::*;
use table::call;

pub use backend::{Backend, BackendKind};
pub use fpmode::Standard;
#[cfg(target_arch = "x86_64")]
use routing::X86;
use routing::{Call, Op, route};
pub use scalar::{mode, residual_of};

use core::marker::PhantomData;
use core::mem::MaybeUninit;

use crate::rng::Draws;
use scalar::Round;

/// Ask the cache for the line holding `x[at]` (a hint: nothing on targets without a
/// stable prefetch instruction, or when `at` is past the end).
#[inline(always)]
fn prefetch<T>(x: &[T], at: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if at < x.len() {
        // SAFETY: `at` is inside `x`, so the pointer is in bounds of one allocation; a
        // prefetch reads nothing architecturally and never faults.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                x.as_ptr().add(at).cast::<i8>(),
            )
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = (x, at);
}

/// Defines a `pulp::WithSimd` operation around a portable kernel call. pulp compiles
/// `with_simd::<S>` once per instruction set `S`; the kernel, being `#[inline(always)]`,
/// is inlined into each copy and so vectorised for that ISA. (A closure would not do:
/// it is one function, compiled once for the baseline ISA, that every copy calls.)
///
/// With `entry =>` first, it also defines `entry::<K, ...>`, the operation's portable
/// build for instruction set `K` as a function: the dispatch table's entry
/// (`table::portable_table`).
macro_rules! simd_op {
    ($entry:ident => $Name:ident $(<$(const $C:ident: $CT:ty),+>)? { $($f:ident: $t:ty),* $(,)? } -> $R:ty = $call:expr) => {
        simd_op!($Name $(<$(const $C: $CT),+>)? { $($f: $t),* } -> $R = $call);

        pub(super) fn $entry<'a, const K: u8 $($(, const $C: $CT)+)?>($($f: $t),*) -> $R {
            table::on::<K, _>($Name::<'a $($(, $C)+)?> { $($f),* })
        }
    };
    ($Name:ident $(<$(const $C:ident: $CT:ty),+>)? { $($f:ident: $t:ty),* $(,)? } -> $R:ty = $call:expr) => {
        pub(super) struct $Name<'a $($(, const $C: $CT)+)?> {
            $($f: $t,)*
        }

        impl<'a $($(, const $C: $CT)+)?> pulp::WithSimd for $Name<'a $($(, $C)+)?> {
            type Output = $R;

            #[inline(always)]
            fn with_simd<S: pulp::Simd>(self, _: S) -> $R {
                let $Name { $($f,)* } = self;
                $call
            }
        }
    };
}

// After `simd_op!`, which they use.
pub mod entropy;
pub(crate) mod planes;
mod select;
mod shape;

simd_op!(EncodeInt8 {
    x: &'a [f32], block: usize, round: Round, draws: &'a Draws, first: u64,
    steps: &'a mut [u8], codes: &'a mut [u8],
} -> bool = portable::encode_int8(x, block, round, draws, first, steps, codes));
simd_op!(EncodeFloat {
    f: fp8::Format, scale: fp8::Scale, four: bool, block: usize, x: &'a [f32],
    draws: Option<&'a Draws>, first: u64, scales: &'a mut [u8], codes: &'a mut [u8],
} -> bool = fp8::encode::<true>(f, scale, four, block, x, draws, first, scales, codes));
simd_op!(EncodeCodebook {
    x: &'a [f32], block: usize, books: &'a mut [u8], codes: &'a mut [u8],
} -> bool = codebook::encode(x, block, books, codes));
simd_op!(DecodeFloat<const M: u8> {
    f: fp8::Format, scale: fp8::Scale, four: bool, block: usize, scales: &'a [u8],
    codes: &'a [u8], out: &'a mut [f32],
} -> () = fp8::decode::<M>(f, scale, four, block, scales, codes, out));
simd_op!(DecodeInt8<const M: u8> {
    steps: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_int8::<M>(steps, codes, block, out));
simd_op!(ReduceInt8<const M: u8> {
    frames: &'a [(&'a [u8], &'a [u8])], block: usize, start: usize, out: &'a mut [f32],
} -> () = portable::reduce_int8::<M>(frames, block, start, out));
simd_op!(EncodeSign { x: &'a [f32], block: usize, steps: &'a mut [u8], codes: &'a mut [u8] }
    -> bool = portable::encode_sign(x, block, steps, codes));
simd_op!(DecodeSign<const M: u8> {
    steps: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_sign::<M>(steps, codes, block, out));

simd_op!(EncodeSignmag<const BITS: u32> {
    x: &'a [f32], block: usize, measure: scalar::Measure, draws: &'a Draws, first: u64,
    steps: &'a mut [u8], codes: &'a mut [u8],
} -> bool = portable::encode_signmag::<BITS>(x, block, measure, draws, first, steps, codes));
simd_op!(DecodeSignmag<const M: u8, const BITS: u32> {
    steps: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_signmag::<M, BITS>(steps, codes, block, out));
simd_op!(EncodeNatural {
    x: &'a [f32], block: usize, draws: &'a Draws, first: u64,
    refs: &'a mut [u8], codes: &'a mut [u8],
} -> bool = portable::encode_natural(x, block, draws, first, refs, codes));
simd_op!(DecodeNatural<const M: u8> {
    refs: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_natural::<M>(refs, codes, block, out));
/// The dispatch table's portable entries (`table::portable_table`): each operation's
/// portable source, as a function compiled for the instruction set `K`.
mod entry {
    use super::*;

    simd_op!(encode_f32 => EncodeF32 { x: &'a [f32], out: &'a mut [u8] } -> bool = portable::encode_f32(x, out));
    simd_op!(decode_f32 => DecodeF32<const M: u8> { p: &'a [u8], out: &'a mut [f32] } -> ()
        = portable::decode_f32::<M>(p, out));
    simd_op!(encode_f16 => EncodeF16 { x: &'a [f32], out: &'a mut [u8] } -> bool
        = portable::encode_u16(x, out, portable::f32_to_f16));
    simd_op!(decode_f16 => DecodeF16<const M: u8> { p: &'a [u8], out: &'a mut [f32] } -> ()
        = portable::decode_u16::<M>(p, out, portable::f16_to_f32));
    simd_op!(encode_bf16 => EncodeBf16 { x: &'a [f32], out: &'a mut [u8] } -> bool
        = portable::encode_u16(x, out, portable::f32_to_bf16));
    simd_op!(decode_bf16 => DecodeBf16<const M: u8> { p: &'a [u8], out: &'a mut [f32] } -> ()
        = portable::decode_u16::<M>(p, out, scalar::bf16_to_f32));
    simd_op!(reduce_f32 => ReduceF32<const M: u8> { frames: &'a [&'a [u8]], start: usize, out: &'a mut [f32] }
        -> () = portable::reduce_f32::<M>(frames, start, out));
    simd_op!(reduce_f16 => ReduceF16<const M: u8> { frames: &'a [&'a [u8]], start: usize, out: &'a mut [f32] }
        -> () = portable::reduce_u16::<M>(frames, start, out, portable::f16_to_f32));
    simd_op!(reduce_bf16 => ReduceBf16<const M: u8> { frames: &'a [&'a [u8]], start: usize, out: &'a mut [f32] }
        -> () = portable::reduce_u16::<M>(frames, start, out, scalar::bf16_to_f32));
    simd_op!(max_finite_abs_bits => MaxFiniteAbs { x: &'a [f32] } -> u32 = scalar::max_finite_abs_bits(x));
    simd_op!(any_all_set => AnyAllSet { codes: &'a [u8], mask: u8 } -> bool = scalar::any_all_set(codes, mask));
    simd_op!(f32_scales_valid => F32ScalesValid { scales: &'a [u8] } -> bool = scalar::f32_scales_valid(scales));
    simd_op!(any_nonfinite => AnyNonfinite { x: &'a [f32] } -> bool = scalar::max_abs_bits(x) >= scalar::INF_BITS);
    simd_op!(feedback_form => FeedbackForm { r: &'a mut [f32], g: &'a [f32], beta: f32, gamma: f32 } -> ()
        = scalar::feedback_form(r, g, beta, gamma));
    simd_op!(feedback_form_bf16 => FeedbackFormBf16 {
        p: &'a mut [f32], r: &'a [u16], g: &'a [f32], beta: f32, gamma: f32,
    } -> () = scalar::feedback_form_bf16(p, r, g, beta, gamma));
    simd_op!(feedback_store_bf16 => FeedbackStoreBf16 { r: &'a mut [u16], p: &'a [f32] } -> ()
        = portable::feedback_store_bf16(r, p));
    simd_op!(feedback_f16 => FeedbackF16 { r: &'a mut [f32], g: &'a [f32], beta: f32, gamma: f32, out: &'a mut [u8] }
        -> bool = portable::feedback_u16(r, g, beta, gamma, out, portable::f32_to_f16, portable::f16_to_f32));
}

/// Error-feedback input `r = beta * r + gamma * g` in place (see [`scalar::feedback_form`]).
pub fn feedback_form(r: &mut [f32], g: &[f32], beta: f32, gamma: f32) {
    call!(feedback_form(r, g, beta, gamma))
}

/// Error-feedback input from a bf16 residual (see [`scalar::feedback_form_bf16`]).
pub fn feedback_form_bf16(p: &mut [f32], r: &[u16], g: &[f32], beta: f32, gamma: f32) {
    call!(feedback_form_bf16(p, r, g, beta, gamma))
}

/// Store a residual tile as bf16 (see [`scalar::feedback_store_bf16`]).
pub fn feedback_store_bf16(r: &mut [u16], p: &[f32]) {
    call!(feedback_store_bf16(r, p))
}

/// fp16's fused error-feedback step (see [`scalar::feedback_u16`]).
pub fn feedback_f16(r: &mut [f32], g: &[f32], beta: f32, gamma: f32, out: &mut [u8]) -> bool {
    call!(feedback_f16(r, g, beta, gamma, out))
}

/// The longest run of 4-aligned words inside `bytes`: working room carved out of a
/// caller's byte buffer (top-k's one-pass selection keeps its candidates there).
pub fn words_mut(bytes: &mut [u8]) -> &mut [u32] {
    // SAFETY: every bit pattern is a valid u32, and `align_to_mut` only returns a middle
    // slice that is aligned and lies inside `bytes`.
    unsafe { bytes.align_to_mut::<u32>() }.1
}

/// True if any element of `x` is NaN or ±Inf (one read pass, vectorised on every SIMD
/// backend; see [`scalar::any_nonfinite`]).
pub fn any_nonfinite(x: &[f32]) -> bool {
    call!(any_nonfinite(x))
}

/// Whether any byte of `codes` has every bit of `mask` set (see [`scalar::any_all_set`]):
/// a decoder's check for codes a frame must not hold.
pub fn any_all_set(codes: &[u8], mask: u8) -> bool {
    call!(any_all_set(codes, mask))
}

/// Whether every f32 block scale in `scales` is non-negative and not +Inf (see
/// [`scalar::f32_scales_valid`]).
pub fn f32_scales_valid(scales: &[u8]) -> bool {
    call!(f32_scales_valid(scales))
}

/// The largest |x| of the finite elements of `x` as f32 bits (0 if none; see
/// [`scalar::max_finite_abs_bits`]).
pub fn max_finite_abs_bits(x: &[f32]) -> u32 {
    call!(max_finite_abs_bits(x))
}

/// f32 to little-endian bytes (`out.len() == 4 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_f32(x: &[f32], out: &mut [u8]) -> bool {
    call!(encode_f32(x, out))
}

/// Little-endian bytes to f32, written or added (`p.len() == 4 * out.len()`).
pub fn decode_f32<const M: u8>(p: &[u8], out: &mut [f32]) {
    call!(decode_f32[M as usize](p, out))
}

/// f32 to binary16 (`out.len() == 2 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_f16(x: &[f32], out: &mut [u8]) -> bool {
    call!(encode_f16(x, out))
}

/// binary16 to f32, written or added (`p.len() == 2 * out.len()`).
pub fn decode_f16<const M: u8>(p: &[u8], out: &mut [f32]) {
    call!(decode_f16[M as usize](p, out))
}

/// fp16's fused ring hop: `out` gets the codes of `local` plus the decode of `input`
/// (two bytes per element each), exactly as a `mode::ADD` [`decode_f16`] onto a copy of
/// `local` and [`encode_f16`] of it would write them, in one pass. `Some(nonfinite)`
/// where this backend has the fused kernel (the x86 ones), `None`, touching nothing,
/// where the caller must run those steps itself.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn hop_f16(local: &[f32], input: &[u8], out: &mut [u8]) -> Option<bool> {
    let hop = table::current().hop_f16?;
    // SAFETY: the entry is from the table of a backend that exists (so whose CPU check
    // passed), which holds only kernels its CPU runs.
    Some(unsafe { hop(local, input, out) })
}

/// f32 to bfloat16 (`out.len() == 2 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_bf16(x: &[f32], out: &mut [u8]) -> bool {
    call!(encode_bf16(x, out))
}

/// bfloat16 to f32, written or added (`p.len() == 2 * out.len()`).
pub fn decode_bf16<const M: u8>(p: &[u8], out: &mut [f32]) {
    call!(decode_bf16[M as usize](p, out))
}

/// int8's fused error-feedback step over whole blocks of `block` (the last may be
/// shorter): `r = beta r + gamma g` is encoded into `steps` and `codes` as [`encode_int8`]
/// would encode it (rounding `round`, draws from global index `first`), and `r` becomes
/// what a residual-mode [`decode_int8`] of those codes would leave, in one pass per block
/// and a quantising one. `Some(nonfinite)` where this backend has the fused kernel (the
/// x86 ones), `None`, touching nothing, where the caller must run those steps itself.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[allow(clippy::too_many_arguments)]
pub fn feedback_int8(
    r: &mut [f32],
    g: &[f32],
    weights: (f32, f32),
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> Option<bool> {
    call!(feedback_int8(
        r, g, weights, block, round, draws, first, steps, codes
    ))
}

/// The entry of [`feedback_int8`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
#[allow(clippy::too_many_arguments)]
unsafe fn feedback_int8_on<const K: u8>(
    r: &mut [f32],
    g: &[f32],
    weights: (f32, f32),
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> Option<bool> {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match route::<K>(Op::FeedbackInt8, Call::blocks(block)) {
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx2 => Some(unsafe {
            x86_64::blocks::feedback_int8_avx2(
                r,
                g,
                weights,
                block,
                (round, draws, first),
                steps,
                codes,
            )
        }),
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend,
        // which exists only after AVX-512 F/BW/DQ and AVX2 were detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx512 => Some(unsafe {
            x86_64::blocks512::feedback_int8_avx512(
                r,
                g,
                weights,
                block,
                (round, draws, first),
                steps,
                codes,
            )
        }),
        _ => None,
    }
}

/// int8's fused ring hop over whole blocks of `block` (the last may be shorter): `sum`
/// becomes `local` plus the decode of `in_steps` and `in_codes` (what a `mode::ADD`
/// [`decode_int8`] onto a copy of `local` leaves), and is encoded into `steps` and
/// `codes` as [`encode_int8`] encodes it from global index `first`, in one pass per block
/// and a quantising one. `Some(nonfinite)` where this backend has the fused kernel (the
/// x86 ones), `None`, touching nothing, where the caller must run those steps itself.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn hop_int8(
    local: &[f32],
    (in_steps, in_codes): (&[u8], &[u8]),
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    sum: &mut [f32],
    steps: &mut [u8],
    codes: &mut [u8],
) -> Option<bool> {
    call!(hop_int8(
        local,
        (in_steps, in_codes),
        block,
        round,
        draws,
        first,
        sum,
        steps,
        codes
    ))
}

/// The entry of [`hop_int8`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn hop_int8_on<const K: u8>(
    local: &[f32],
    (in_steps, in_codes): (&[u8], &[u8]),
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    sum: &mut [f32],
    steps: &mut [u8],
    codes: &mut [u8],
) -> Option<bool> {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match route::<K>(Op::HopInt8, Call::blocks(block)) {
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx2 => Some(unsafe {
            x86_64::blocks::hop_int8_avx2(
                local, in_steps, in_codes, block, round, draws, first, sum, steps, codes,
            )
        }),
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend,
        // which exists only after AVX-512 F/BW/DQ and AVX2 were detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx512 => Some(unsafe {
            x86_64::blocks512::hop_int8_avx512(
                local, in_steps, in_codes, block, round, draws, first, sum, steps, codes,
            )
        }),
        _ => None,
    }
}

/// int8 block encode (see [`scalar::encode_int8`]).
pub fn encode_int8(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    call!(encode_int8(x, block, round, draws, first, steps, codes))
}

/// The entry of [`encode_int8`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn encode_int8_on<const K: u8>(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => {
            scalar::encode_int8(x, block, round, draws, first, steps, codes)
        }
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::EncodeInt8, Call::blocks(block)) == X86::Avx2 => unsafe {
            x86_64::blocks::encode_int8_avx2(x, block, round, draws, first, steps, codes)
        },
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend,
        // which exists only after AVX-512 F/BW/DQ and AVX2 were detected.
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::EncodeInt8, Call::blocks(block)) == X86::Avx512 => unsafe {
            x86_64::blocks512::encode_int8_avx512(x, block, round, draws, first, steps, codes)
        },
        _ => table::on::<K, _>(EncodeInt8 {
            x,
            block,
            round,
            draws,
            first,
            steps,
            codes,
        }),
    }
}

pub use portable::REDUCE_LANES;

/// The element-wise layouts the multi-frame reduction has a kernel for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceCodes {
    /// 4-byte f32 codes (identity).
    F32,
    /// binary16 codes.
    F16,
    /// bfloat16 codes.
    Bf16,
}

/// Sum element-wise frames (whole code sections, all of layout `kind`) from element
/// `start` into `out` (`out.len()` a multiple of [`portable::REDUCE_LANES`]): per element
/// the first frame's value written (`M` = write) or added, then the others added in
/// order; the same bits as one decode per frame.
pub fn reduce_elementwise<const M: u8>(
    kind: ReduceCodes,
    frames: &[&[u8]],
    start: usize,
    out: &mut [f32],
) {
    match kind {
        ReduceCodes::F32 => call!(reduce_f32[M as usize](frames, start, out)),
        ReduceCodes::F16 => call!(reduce_f16[M as usize](frames, start, out)),
        ReduceCodes::Bf16 => call!(reduce_bf16[M as usize](frames, start, out)),
    }
}

/// Sum int8 frames (whole `(steps, codes)` sections, blocks of `block` elements, a
/// multiple of [`portable::REDUCE_LANES`]) from element `start` (a multiple of `block`)
/// into `out` (whole blocks), as [`reduce_elementwise`].
pub fn reduce_int8<const M: u8>(
    frames: &[(&[u8], &[u8])],
    block: usize,
    start: usize,
    out: &mut [f32],
) {
    call!(reduce_int8[M as usize](frames, block, start, out))
}

/// The entry of [`reduce_int8`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn reduce_int8_on<const K: u8, const M: u8>(
    frames: &[(&[u8], &[u8])],
    block: usize,
    start: usize,
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => {
            portable::reduce_int8::<M>(frames, block, start, out)
        }
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::ReduceInt8, Call::ANY) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(ReduceInt8::<M> {
                frames,
                block,
                start,
                out,
            })
        }
        _ => table::on::<K, _>(ReduceInt8::<M> {
            frames,
            block,
            start,
            out,
        }),
    }
}

/// int8 block decode (see [`scalar::decode_int8`]).
pub fn decode_int8<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    call!(decode_int8[M as usize](steps, codes, block, out))
}

/// The entry of [`decode_int8`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn decode_int8_on<const K: u8, const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => scalar::decode_int8::<M>(steps, codes, block, out),
        _ => table::on::<K, _>(DecodeInt8::<M> {
            steps,
            codes,
            block,
            out,
        }),
    }
}

/// `codebook` encode of whole blocks (see [`codebook::encode`]): one source, compiled for
/// each backend's instruction set (the same bytes; the AVX-512 backend runs the AVX2
/// build, as its routing table says).
pub fn encode_codebook(x: &[f32], block: usize, books: &mut [u8], codes: &mut [u8]) -> bool {
    call!(encode_codebook(x, block, books, codes))
}

/// The entry of [`encode_codebook`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn encode_codebook_on<const K: u8>(
    x: &[f32],
    block: usize,
    books: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return codebook::encode(x, block, books, codes);
    }
    let op = EncodeCodebook {
        x,
        block,
        books,
        codes,
    };
    #[cfg(target_arch = "x86_64")]
    if route::<K>(Op::EncodeCodebook, Call::ANY) == X86::Avx2 {
        return table::on::<{ table::AVX2 }, _>(op);
    }
    table::on::<K, _>(op)
}

/// fp8 (or, with `four`, fp4) encode of whole blocks (see [`fp8::encode`]): the scalar
/// backend runs the definition, the SIMD backends the same source with branch-free
/// conversions, compiled for their instruction set (the same bytes).
#[allow(clippy::too_many_arguments)]
pub fn encode_float(
    f: fp8::Format,
    scale: fp8::Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: Option<&Draws>,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    call!(encode_float(
        f, scale, four, block, x, draws, first, scales, codes
    ))
}

/// The entry of [`encode_float`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
#[allow(clippy::too_many_arguments)]
unsafe fn encode_float_on<const K: u8>(
    f: fp8::Format,
    scale: fp8::Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: Option<&Draws>,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return fp8::encode::<false>(f, scale, four, block, x, draws, first, scales, codes);
    }
    // Nearest rounding with a scale has hand-written x86 kernels (AVX2's and, where the
    // routing table says so, AVX-512's): fp8's 8-bit codes with an f32 or E8M0 scale
    // (fp8's default), and fp4's E2M1 (its default) or E3M0 codes with any scale.
    #[cfg(target_arch = "x86_64")]
    if draws.is_none() {
        let (op, fits, flag) = if four {
            // The OCP rule's E8M0 scales (whose largest quotients are clamped) take the
            // portable build: the hand-written kernels assume quotients within FMAX.
            let fits = !matches!(scale, fp8::Scale::None | fp8::Scale::E8m0Floor)
                && (f == fp8::E2M1 || f == fp8::E3M0);
            (Op::EncodeFp4Nearest, fits, f == fp8::E3M0)
        } else {
            let fits = matches!(scale, fp8::Scale::F32 | fp8::Scale::E8m0)
                && (f == fp8::E4M3 || f == fp8::E5M2);
            (Op::EncodeFp8Nearest, fits, f == fp8::E4M3)
        };
        match route::<K>(op, Call::blocks(block)) {
            // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists only
            // after AVX-512 F/BW and AVX2 were detected.
            X86::Avx512 if fits => unsafe {
                return x86_64::blocks512::encode_nearest(f, four, scale, block, x, scales, codes);
            },
            // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which
            // exist only after AVX2 was detected.
            X86::Avx2 if fits => unsafe {
                return if four {
                    x86_64::blocks::encode_fp4_nearest(flag, scale, block, x, scales, codes)
                } else {
                    x86_64::blocks::encode_fp8_nearest(flag, scale, block, x, scales, codes)
                };
            },
            _ => {}
        }
    }
    // Stochastic rounding: the AVX-512 kernel (which takes block scales only), the
    // backend's own build or the AVX2 build, as the table says.
    #[cfg(target_arch = "x86_64")]
    let stochastic = draws.map(|d| {
        let op = if four {
            Op::EncodeFp4Stochastic
        } else {
            Op::EncodeFp8Stochastic
        };
        (d, route::<K>(op, Call::blocks(block)))
    });
    #[cfg(target_arch = "x86_64")]
    if let Some((d, X86::Avx512)) = stochastic
        && !matches!(scale, fp8::Scale::None | fp8::Scale::E8m0Floor)
    {
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists
        // only after AVX-512 F/BW/DQ and AVX2 were detected.
        return unsafe {
            x86_64::blocks512::encode_float_stochastic(
                f, scale, four, block, x, d, first, scales, codes,
            )
        };
    }
    let op = EncodeFloat {
        f,
        scale,
        four,
        block,
        x,
        draws,
        first,
        scales,
        codes,
    };
    #[cfg(target_arch = "x86_64")]
    let build = match stochastic {
        Some((_, r)) => r,
        None => route::<K>(if four { Op::EncodeFp4 } else { Op::EncodeFp8 }, Call::ANY),
    };
    #[cfg(target_arch = "x86_64")]
    if build == X86::Avx2 {
        return table::on::<{ table::AVX2 }, _>(op);
    }
    table::on::<K, _>(op)
}

/// fp8 (or, with `four`, fp4) decode of whole blocks in mode `M` (see [`fp8::decode`]).
pub fn decode_float<const M: u8>(
    f: fp8::Format,
    scale: fp8::Scale,
    four: bool,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) {
    call!(decode_float[M as usize](
        f, scale, four, block, scales, codes, out
    ))
}

/// The entry of [`decode_float`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn decode_float_on<const K: u8, const M: u8>(
    f: fp8::Format,
    scale: fp8::Scale,
    four: bool,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return fp8::decode::<M>(f, scale, four, block, scales, codes, out);
    }
    // The AVX-512 backend's own kernels where the table says so, else the AVX2 ones.
    #[cfg(target_arch = "x86_64")]
    let call = Call {
        block,
        elements: out.len(),
        mode: M,
    };
    // Whole blocks in registers, in any mode: fp4 blocks of 16 and 32 by table lookups,
    // fp8 blocks of a multiple of 16 through half precision. A last, shorter block then
    // runs the definition (a few elements). The residual mode (error feedback's) runs
    // the AVX2 build on both x86 backends: only it has that mode.
    // fp8 without a scale: 16 codes at a time through half precision (on the AVX-512
    // backend its own kernel but for long plain decodes), the last few by the definition.
    #[cfg(target_arch = "x86_64")]
    if scale == fp8::Scale::None && !four {
        let e4m3 = f == fp8::E4M3;
        debug_assert!(e4m3 || f == fp8::E5M2);
        let op = if e4m3 {
            Op::DecodeE4m3Unscaled
        } else {
            Op::DecodeE5m2Unscaled
        };
        let done = if route::<K>(op, call) == X86::Avx512 {
            // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists
            // only after AVX-512F and AVX2 were detected.
            unsafe { x86_64::blocks512::decode_fp8_unscaled::<M>(e4m3, codes, out) }
        } else {
            // SAFETY: the backend is AVX2 or AVX-512 (not scalar, on x86-64), which
            // exist only after AVX2 and F16C were detected.
            unsafe { x86_64::blocks::decode_fp8_unscaled::<M>(e4m3, codes, out) }
        };
        fp8::decode::<M>(
            f,
            scale,
            four,
            block,
            scales,
            &codes[done..],
            &mut out[done..],
        );
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if scale != fp8::Scale::None {
        let done = if four && matches!(block, 16 | 32) {
            let fours = fp8::four_values(f);
            let op = if matches!(scale, fp8::Scale::E4m3 { .. }) {
                Op::DecodeFp4E4m3Blocks
            } else {
                Op::DecodeFp4Blocks
            };
            Some(if route::<K>(op, call) == X86::Avx512 {
                // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists
                // only after AVX-512F was detected.
                unsafe {
                    x86_64::blocks512::decode_fp4::<M>(&fours, scale, block, scales, codes, out)
                }
            } else {
                // SAFETY: the backend is AVX2 or AVX-512 (not scalar, on x86-64), which
                // exist only after AVX2 and F16C were detected.
                unsafe { x86_64::blocks::decode_fp4::<M>(&fours, scale, block, scales, codes, out) }
            })
        } else if !four && block.is_multiple_of(16) {
            let e4m3 = f == fp8::E4M3;
            debug_assert!(e4m3 || f == fp8::E5M2);
            let op = if e4m3 {
                Op::DecodeE4m3Blocks
            } else {
                Op::DecodeE5m2Blocks
            };
            Some(if route::<K>(op, call) == X86::Avx512 {
                // SAFETY: the routing table gives Avx512 only to the AVX-512 backend, which exists
                // only after AVX-512F and AVX2 were detected.
                unsafe {
                    x86_64::blocks512::decode_fp8::<M>(e4m3, scale, block, scales, codes, out)
                }
            } else {
                // SAFETY: the backend is AVX2 or AVX-512 (not scalar, on x86-64), which
                // exist only after AVX2 and F16C were detected.
                unsafe { x86_64::blocks::decode_fp8::<M>(e4m3, scale, block, scales, codes, out) }
            })
        } else {
            None
        };
        if let Some(done) = done {
            let at = done * block;
            if at < out.len() {
                let code_at = if four { at / 2 } else { at };
                fp8::decode::<M>(
                    f,
                    scale,
                    four,
                    block,
                    &scales[done * scale.bytes()..],
                    &codes[code_at..],
                    &mut out[at..],
                );
            }
            return;
        }
    }
    let op = DecodeFloat::<M> {
        f,
        scale,
        four,
        block,
        scales,
        codes,
        out,
    };
    // The rest (fp8 blocks not a multiple of 16, fp4's other blocks): the AVX2 build or
    // the backend's own, as the table says.
    #[cfg(target_arch = "x86_64")]
    if route::<K>(
        if four {
            Op::DecodeFp4Rest
        } else {
            Op::DecodeFp8Rest
        },
        call,
    ) == X86::Avx2
    {
        return table::on::<{ table::AVX2 }, _>(op);
    }
    table::on::<K, _>(op)
}

/// Sign block encode (see [`scalar::encode_sign`]); `codes` need not be zeroed.
pub fn encode_sign(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
    call!(encode_sign(x, block, steps, codes))
}

/// The entry of [`encode_sign`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn encode_sign_on<const K: u8>(
    x: &[f32],
    block: usize,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), route::<K>(Op::EncodeSign, Call::blocks(block))) {
        (BackendKind::Scalar, _) => {
            codes.fill(0);
            scalar::encode_sign(x, block, steps, codes)
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        (_, X86::Avx2) => unsafe { x86_64::encode_sign_avx2(x, block, steps, codes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the routing table gives Avx512 only to the AVX-512 backend,
        // which exists only after AVX-512F and AVX2 were detected.
        (_, X86::Avx512) => unsafe { x86_64::encode_sign_avx512(x, block, steps, codes) },
        _ => table::on::<K, _>(EncodeSign {
            x,
            block,
            steps,
            codes,
        }),
    }
}

/// Sign block decode (see [`scalar::decode_sign`]).
pub fn decode_sign<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    call!(decode_sign[M as usize](steps, codes, block, out))
}

/// The entry of [`decode_sign`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn decode_sign_on<const K: u8, const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => scalar::decode_sign::<M>(steps, codes, block, out),
        // The residual mode stays portable: error feedback's sign step ran at 13.4 GB/s
        // with it and 10.9 with this kernel's residual (a Zen 3, 64 Ki elements).
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected; the block size is the kernel's precondition.
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DecodeSign, Call::ANY) == X86::Avx2
            && M != mode::RESIDUAL
            && block.is_multiple_of(8) =>
        unsafe { x86_64::blocks::decode_sign_avx2::<M>(steps, codes, block, out) },
        _ => table::on::<K, _>(DecodeSign::<M> {
            steps,
            codes,
            block,
            out,
        }),
    }
}

/// Sign-magnitude block encode of `BITS` (2, 4 or 8) bits (see
/// [`scalar::encode_signmag`]); `codes` need not be zeroed.
#[allow(clippy::too_many_arguments)]
pub fn encode_signmag(
    x: &[f32],
    block: usize,
    bits: u32,
    measure: scalar::Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    call!(encode_signmag(
        x, block, bits, measure, draws, first, steps, codes
    ))
}

/// The entry of [`encode_signmag`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
#[allow(clippy::too_many_arguments)]
unsafe fn encode_signmag_on<const K: u8>(
    x: &[f32],
    block: usize,
    bits: u32,
    measure: scalar::Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        codes.fill(0);
        return scalar::encode_signmag(x, block, bits, measure, draws, first, steps, codes);
    }
    #[cfg(target_arch = "x86_64")]
    if block.is_multiple_of((8 / bits) as usize) {
        macro_rules! x86 {
            ($kernel:ident, $bits:literal) => {
                // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512
                // backends, which exist only after AVX2 and FMA (pulp's V3) were detected,
                // and Avx512 only to the AVX-512 backend (pulp's V4 as well); blocks start
                // on byte boundaries (checked above).
                unsafe { $kernel::<$bits>(x, block, measure, draws, first, steps, codes) }
            };
        }
        use x86_64::blocks::encode_signmag_avx2 as avx2;
        use x86_64::blocks512::encode_signmag_avx512 as avx512;
        match (route::<K>(Op::EncodeSignmag, Call::blocks(block)), bits) {
            (X86::Avx2, 2) => return x86!(avx2, 2),
            (X86::Avx2, 4) => return x86!(avx2, 4),
            (X86::Avx2, 8) => return x86!(avx2, 8),
            (X86::Avx512, 2) => return x86!(avx512, 2),
            (X86::Avx512, 4) => return x86!(avx512, 4),
            (X86::Avx512, 8) => return x86!(avx512, 8),
            _ => {}
        }
    }
    macro_rules! go {
        ($bits:literal) => {
            table::on::<K, _>(EncodeSignmag::<$bits> {
                x,
                block,
                measure,
                draws,
                first,
                steps,
                codes,
            })
        };
    }
    match bits {
        2 => go!(2),
        4 => go!(4),
        8 => go!(8),
        _ => unreachable!("sign-magnitude codes are 2, 4 or 8 bits"),
    }
}

/// Sign-magnitude block decode (see [`scalar::decode_signmag`]).
pub fn decode_signmag<const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    bits: u32,
    out: &mut [f32],
) {
    call!(decode_signmag[M as usize](steps, codes, block, bits, out))
}

/// The entry of [`decode_signmag`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn decode_signmag_on<const K: u8, const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    bits: u32,
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return scalar::decode_signmag::<M>(steps, codes, block, bits, out);
    }
    #[cfg(target_arch = "x86_64")]
    if route::<K>(Op::DecodeSignmag, Call::ANY) == X86::Avx2
        && block.is_multiple_of((8 / bits) as usize)
    {
        macro_rules! avx2 {
            ($bits:literal) => {
                // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which
                // exist only after AVX2 was detected; the block size is the kernel's
                // precondition (checked above).
                unsafe { x86_64::blocks::decode_signmag_avx2::<M, $bits>(steps, codes, block, out) }
            };
        }
        return match bits {
            2 => avx2!(2),
            4 => avx2!(4),
            8 => avx2!(8),
            _ => unreachable!("sign-magnitude codes are 2, 4 or 8 bits"),
        };
    }
    macro_rules! go {
        ($bits:literal) => {
            table::on::<K, _>(DecodeSignmag::<M, $bits> {
                steps,
                codes,
                block,
                out,
            })
        };
    }
    match bits {
        2 => go!(2),
        4 => go!(4),
        8 => go!(8),
        _ => unreachable!("sign-magnitude codes are 2, 4 or 8 bits"),
    }
}

/// Natural-compression encode (see [`scalar::encode_natural`]).
pub fn encode_natural(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
) -> bool {
    call!(encode_natural(x, block, draws, first, refs, codes))
}

/// The entry of [`encode_natural`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn encode_natural_on<const K: u8>(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
) -> bool {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => {
            scalar::encode_natural(x, block, draws, first, refs, codes)
        }
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::EncodeNatural, Call::ANY) == X86::Avx2 => unsafe {
            x86_64::blocks::encode_natural_avx2(x, block, draws, first, refs, codes)
        },
        _ => table::on::<K, _>(EncodeNatural {
            x,
            block,
            draws,
            first,
            refs,
            codes,
        }),
    }
}

/// Natural-compression decode (see [`scalar::decode_natural`]).
pub fn decode_natural<const M: u8>(refs: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    call!(decode_natural[M as usize](refs, codes, block, out))
}

/// The entry of [`decode_natural`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn decode_natural_on<const K: u8, const M: u8>(
    refs: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => {
            scalar::decode_natural::<M>(refs, codes, block, out)
        }
        // SAFETY: the routing table gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        _ if route::<K>(Op::DecodeNatural, Call::ANY) == X86::Avx2 => unsafe {
            x86_64::blocks::decode_natural_avx2::<M>(refs, codes, block, out)
        },
        _ => table::on::<K, _>(DecodeNatural::<M> {
            refs,
            codes,
            block,
            out,
        }),
    }
}
