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
pub mod scalar;
pub(crate) mod shm;
mod table;
#[cfg(target_arch = "x86_64")]
mod x86_64;
use table::call;

#[cfg(target_arch = "x86_64")]
use backend::X86;
pub use backend::{Backend, BackendKind};
use backend::{Op, x86_route};
pub use fpmode::Standard;
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
/// ([`table::portable_table`]).
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
simd_op!(LaneBound<const D: usize> { x: &'a [f32] } -> u32 = portable::lane_bound::<D>(x));
simd_op!(FilterMagGe { x: &'a [f32], t: u32, idx: &'a mut [u32] } -> (usize, usize)
    = portable::filter_mag_ge(x, t, idx));
simd_op!(FilterMagGeVals { x: &'a [f32], t: u32, idx: &'a mut [u32], vals: &'a mut [u32] }
    -> (usize, usize) = portable::filter_mag_ge_vals(x, t, idx, vals));
simd_op!(FilterDrawLt { first: u32, key: u32, t: u32, n: usize, idx: &'a mut [u32] }
    -> (usize, usize) = portable::filter_draw_lt(first, key, t, n, idx));
simd_op!(DrawMasks { first: u32, key: u32, t: u32, n: usize, masks: &'a mut [MaybeUninit<u64>] }
    -> usize = portable::draw_masks(first, key, t, n, masks));
simd_op!(CountDrawLt { first: u32, key: u32, t: u32, n: usize, _l: PhantomData<&'a ()> }
    -> usize = portable::count_draw_lt(first, key, t, n));

simd_op!(DctForward {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
} -> () = dct::forward_impl(x, stride, h, w, y, out));

/// The dispatch table's portable entries ([`table::portable_table`]): each operation's
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

/// The forward DCT of a tile (see [`dct::forward`]), compiled for the current backend
/// (for AVX2 on the AVX-512 backend: [`x86_route`]).
fn dct_forward(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    call!(dct_forward(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_forward_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::forward_impl(x, stride, h, w, y, out),
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::DctForward, b.kind()) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctForward {
                x,
                stride,
                h,
                w,
                y,
                out,
            })
        }
        _ => table::on::<K, _>(DctForward {
            x,
            stride,
            h,
            w,
            y,
            out,
        }),
    }
}

simd_op!(DctSelect { coef: &'a mut [f32], kt: usize, keys: &'a mut [u64], chosen: &'a mut [u16] }
    -> () = dct::select_impl(coef, kt, keys, chosen));

/// The small selection of the `dct` encoder (see [`dct::select`]), compiled for the
/// current backend.
fn dct_select(coef: &mut [f32], kt: usize, keys: &mut [u64], chosen: &mut [u16]) {
    call!(dct_select(coef, kt, keys, chosen))
}

/// The entry of [`dct_select`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_select_on<const K: u8>(
    coef: &mut [f32],
    kt: usize,
    keys: &mut [u64],
    chosen: &mut [u16],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::select_impl(coef, kt, keys, chosen),
        _ => table::on::<K, _>(DctSelect {
            coef,
            kt,
            keys,
            chosen,
        }),
    }
}

simd_op!(DctForwardFast {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
} -> () = dct::forward_fast_impl(x, stride, h, w, y, out));

/// The factorised forward DCT of a tile (see [`dct::forward_fast`]), compiled for the
/// current backend.
fn dct_forward_fast(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    call!(dct_forward_fast(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward_fast`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_forward_fast_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::forward_fast_impl(x, stride, h, w, y, out),
        _ => table::on::<K, _>(DctForwardFast {
            x,
            stride,
            h,
            w,
            y,
            out,
        }),
    }
}

simd_op!(DctEncodeRowsFast {
    x: &'a [f32], w: usize, kt: usize, pos: &'a mut [u16], vals: &'a mut [f32],
} -> () = dct::encode_rows_fast_impl(x, w, kt, pos, vals));

/// The `dct` encoder's work for tiles of one row (see [`dct::encode_rows_fast`]),
/// compiled for the current backend (for AVX2 on the AVX-512 backend at 16 and 32:
/// [`x86_route`]).
fn dct_encode_rows_fast(x: &[f32], w: usize, kt: usize, pos: &mut [u16], vals: &mut [f32]) {
    call!(dct_encode_rows_fast(x, w, kt, pos, vals))
}

/// The entry of [`dct_encode_rows_fast`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_encode_rows_fast_on<const K: u8>(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::encode_rows_fast_impl(x, w, kt, pos, vals),
        #[cfg(target_arch = "x86_64")]
        b if matches!(w, 16 | 32) && x86_route(Op::DctFastRows16Or32, b.kind()) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctEncodeRowsFast {
                x,
                w,
                kt,
                pos,
                vals,
            })
        }
        _ => table::on::<K, _>(DctEncodeRowsFast {
            x,
            w,
            kt,
            pos,
            vals,
        }),
    }
}

simd_op!(DctEncodeRowsLee {
    x: &'a [f32], w: usize, kt: usize, pos: &'a mut [u16], vals: &'a mut [f32],
    load: dct::LoadLanes<'a>,
} -> () = dct::encode_rows_lee_impl(x, w, kt, pos, vals, load));

/// The `dct` encoder's work for tiles of one row by Lee's transform (see
/// [`dct::encode_rows_lee`]), compiled for the current backend; the AVX-512 backend puts
/// sixteen tiles of 16, 32 or 64 into lanes by in-register transposes of 16 x 16 blocks, the
/// AVX2 build (and the AVX-512 backend at 8) tiles of 8 to 64 by 8 x 8 blocks.
fn dct_encode_rows_lee(x: &[f32], w: usize, kt: usize, pos: &mut [u16], vals: &mut [f32]) {
    call!(dct_encode_rows_lee(x, w, kt, pos, vals))
}

/// The entry of [`dct_encode_rows_lee`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_encode_rows_lee_on<const K: u8>(
    x: &[f32],
    w: usize,
    kt: usize,
    pos: &mut [u16],
    vals: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    let load = lanes_for(b.kind());
    if b.kind() == BackendKind::Scalar {
        return dct::encode_rows_lee_impl(x, w, kt, pos, vals, load);
    }
    let op = DctEncodeRowsLee {
        x,
        w,
        kt,
        pos,
        vals,
        load,
    };
    table::on::<K, _>(op)
}

/// How a backend's build puts sixteen rows into lanes (see [`dct::LoadLanes`]).
fn lanes_for(kind: BackendKind) -> dct::LoadLanes<'static> {
    match kind {
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx512 => AVX512_LANES,
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx2 => AVX2_LANES,
        _ => PLAIN_LANES,
    }
}

/// The plain loop puts rows into lanes (see [`dct::LoadLanes`]).
const PLAIN_LANES: dct::LoadLanes = &|_, _, _, _| false;

/// The AVX-512 backend puts sixteen rows of 16, 32 or 64 into lanes by in-register
/// transposes of 16 x 16 blocks, and rows of 8 as the AVX2 build does (see
/// [`dct::LoadLanes`]); only for that backend.
#[cfg(target_arch = "x86_64")]
const AVX512_LANES: dct::LoadLanes = &|rows, stride, w, a| {
    if matches!(w, 16 | 32 | 64) && stride >= w && rows.len() >= 15 * stride + w {
        // SAFETY: AVX512_LANES is passed only with the AVX-512 backend, which exists only
        // after AVX-512F was detected; the arguments are the ones the kernel asserts.
        unsafe { x86_64::blocks512::rows_to_lanes16(rows, stride, w, a) };
        return true;
    }
    AVX2_LANES(rows, stride, w, a)
};

/// The AVX2 build puts sixteen rows of 8 to 64 into lanes by in-register transposes of
/// 8 x 8 blocks (see [`dct::LoadLanes`]); for the AVX2 and AVX-512 backends.
#[cfg(target_arch = "x86_64")]
const AVX2_LANES: dct::LoadLanes = &|rows, stride, w, a| {
    let fits = matches!(w, 8 | 16 | 32 | 64) && stride >= w && rows.len() >= 15 * stride + w;
    if fits {
        // SAFETY: AVX2_LANES is passed only with the AVX2 and AVX-512 backends, which
        // exist only after AVX2 was detected; the arguments are the ones the kernel
        // asserts.
        unsafe { x86_64::blocks::rows_to_lanes16(rows, stride, w, a) };
    }
    fits
};

simd_op!(DctForwardLee {
    x: &'a [f32], stride: usize, h: usize, w: usize, y: &'a mut [f32], out: &'a mut [f32],
    load: dct::LoadLanes<'a>,
} -> () = dct::forward_lee_impl(x, stride, h, w, y, out, load));

/// Lee's forward DCT of a tile (see [`dct::forward_lee`]), compiled for the current
/// backend (for AVX2 on the AVX-512 backend for 64 x 64 tiles: [`x86_route`]); the
/// AVX2 and AVX-512 builds put sixteen rows at a time into lanes by in-register transposes.
fn dct_forward_lee(x: &[f32], stride: usize, h: usize, w: usize, y: &mut [f32], out: &mut [f32]) {
    call!(dct_forward_lee(x, stride, h, w, y, out))
}

/// The entry of [`dct_forward_lee`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_forward_lee_on<const K: u8>(
    x: &[f32],
    stride: usize,
    h: usize,
    w: usize,
    y: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    #[cfg(target_arch = "x86_64")]
    let to_avx2 = h * w == 4096 && x86_route(Op::DctLee64x64, b.kind()) == X86::Avx2;
    #[cfg(target_arch = "x86_64")]
    let load = lanes_for(if to_avx2 { BackendKind::Avx2 } else { b.kind() });
    #[cfg(not(target_arch = "x86_64"))]
    let load = lanes_for(b.kind());
    let op = DctForwardLee {
        x,
        stride,
        h,
        w,
        y,
        out,
        load,
    };
    match b.kind() {
        BackendKind::Scalar => dct::forward_lee_impl(x, stride, h, w, op.y, op.out, load),
        #[cfg(target_arch = "x86_64")]
        _ if to_avx2 => table::on::<{ table::AVX2 }, _>(op),
        _ => table::on::<K, _>(op),
    }
}

simd_op!(DctDecodeRows<const M: u8> {
    w: usize, kt: usize, pos: &'a [u16], vals: &'a [f32], out: &'a mut [f32],
} -> () = dct::decode_rows_impl::<M>(w, kt, pos, vals, out));

/// The `dct` decoder's work for tiles of one row (see [`dct::decode_rows`]), compiled for
/// the current backend (for AVX2 on the AVX-512 backend: [`x86_route`], as the inverse).
fn dct_decode_rows<const M: u8>(w: usize, kt: usize, pos: &[u16], vals: &[f32], out: &mut [f32]) {
    call!(dct_decode_rows[M as usize](w, kt, pos, vals, out))
}

/// The entry of [`dct_decode_rows`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_decode_rows_on<const K: u8, const M: u8>(
    w: usize,
    kt: usize,
    pos: &[u16],
    vals: &[f32],
    out: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::decode_rows_impl::<M>(w, kt, pos, vals, out),
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::DctInverse, b.kind()) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctDecodeRows::<M> {
                w,
                kt,
                pos,
                vals,
                out,
            })
        }
        _ => table::on::<K, _>(DctDecodeRows::<M> {
            w,
            kt,
            pos,
            vals,
            out,
        }),
    }
}

simd_op!(ThinMq {
    x: &'a mut [f32], e: Option<&'a [f32]>, qt: &'a [f32], cols: usize, p: &'a mut [f32],
} -> () = gemm::thin_mq_rows(x, e, qt, cols, p));

/// PowerSGD's rows of `M Q` (see [`gemm::thin_mq`]), compiled for the current backend.
fn gemm_thin_mq(x: &mut [f32], e: Option<&[f32]>, qt: &[f32], cols: usize, p: &mut [f32]) {
    call!(gemm_thin_mq(x, e, qt, cols, p))
}

/// The entry of [`gemm_thin_mq`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn gemm_thin_mq_on<const K: u8>(
    x: &mut [f32],
    e: Option<&[f32]>,
    qt: &[f32],
    cols: usize,
    p: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => gemm::thin_mq_rows(x, e, qt, cols, p),
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::ThinMq, b.kind()) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(ThinMq { x, e, qt, cols, p })
        }
        _ => table::on::<K, _>(ThinMq { x, e, qt, cols, p }),
    }
}

simd_op!(ThinPqt {
    x: Option<&'a [f32]>, out: &'a mut [f32], e: Option<&'a mut [f32]>, p: &'a [f32],
    qt: &'a [f32], cols: usize,
} -> () = gemm::thin_pqt_rows(x, out, e, p, qt, cols));

/// PowerSGD's rows of `P Q^T` and residuals (see [`gemm::thin_pqt`]), compiled for the
/// current backend; with `stream`, the x86 kernels with non-temporal stores.
fn gemm_thin_pqt(
    x: Option<&[f32]>,
    out: &mut [f32],
    e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
    stream: bool,
) {
    call!(gemm_thin_pqt(x, out, e, p, qt, cols, stream))
}

/// The entry of [`gemm_thin_pqt`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn gemm_thin_pqt_on<const K: u8>(
    x: Option<&[f32]>,
    out: &mut [f32],
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))] mut e: Option<&mut [f32]>,
    p: &[f32],
    qt: &[f32],
    cols: usize,
    stream: bool,
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    #[cfg(target_arch = "x86_64")]
    if stream && !out.is_empty() {
        use x86_64::{PQT_FROM_OUT, PQT_FROM_X, PQT_OUT};
        let r = p.len() / (out.len() / cols.max(1)).max(1);
        let mode = match (x.is_some(), e.is_some()) {
            (_, false) => PQT_OUT,
            (true, true) => PQT_FROM_X,
            (false, true) => PQT_FROM_OUT,
        };
        let (xs, es) = (x.unwrap_or(&[]), e.as_deref_mut().unwrap_or_default());
        // True when a streaming kernel took the rows (ranks 1 to THIN_MAX_RANK).
        macro_rules! go {
            ($f:ident) => {
                gemm::by_rank!(r, R => {
                    match mode {
                        PQT_OUT => x86_64::$f::<R, PQT_OUT>(xs, out, es, p, qt, cols),
                        PQT_FROM_X => x86_64::$f::<R, PQT_FROM_X>(xs, out, es, p, qt, cols),
                        _ => x86_64::$f::<R, PQT_FROM_OUT>(xs, out, es, p, qt, cols),
                    }
                    true
                }, _ => false)
            };
        }
        let done = match x86_route(Op::StreamPqt, b.kind()) {
            // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists
            // only after AVX-512F was detected.
            X86::Avx512 => unsafe { go!(pqt_stream_avx512) },
            // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which
            // exist only after AVX2 was detected.
            X86::Avx2 => unsafe { go!(pqt_stream_avx2) },
            X86::None => false,
        };
        if done {
            return;
        }
    }
    let _ = stream;
    match b.kind() {
        BackendKind::Scalar => gemm::thin_pqt_rows(x, out, e, p, qt, cols),
        _ => table::on::<K, _>(ThinPqt {
            x,
            out,
            e,
            p,
            qt,
            cols,
        }),
    }
}

simd_op!(ThinMtp {
    m: &'a [f32], cols: usize, j0: usize, p: &'a [f32], r: usize, acc: &'a mut [f32],
} -> () = gemm::thin_mtp_cols(m, cols, j0, p, r, acc));

/// PowerSGD's columns of `M^T P` (see [`gemm::thin_mtp`]), compiled for the current
/// backend.
fn gemm_thin_mtp(m: &[f32], cols: usize, j0: usize, p: &[f32], r: usize, acc: &mut [f32]) {
    call!(gemm_thin_mtp(m, cols, j0, p, r, acc))
}

/// The entry of [`gemm_thin_mtp`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn gemm_thin_mtp_on<const K: u8>(
    m: &[f32],
    cols: usize,
    j0: usize,
    p: &[f32],
    r: usize,
    acc: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => gemm::thin_mtp_cols(m, cols, j0, p, r, acc),
        _ => table::on::<K, _>(ThinMtp {
            m,
            cols,
            j0,
            p,
            r,
            acc,
        }),
    }
}

simd_op!(DctInverseRows {
    t: &'a [f32], cols: &'a [bool], h: usize, w: usize, x: &'a mut [f32],
} -> () = dct::inverse_rows_impl(t, cols, h, w, x));

/// The second pass of the inverse DCT of a tile (see [`dct::inverse`]), compiled for
/// the current backend (for AVX2 on the AVX-512 backend: [`x86_route`]).
fn dct_inverse_rows(t: &[f32], cols: &[bool], h: usize, w: usize, x: &mut [f32]) {
    call!(dct_inverse_rows(t, cols, h, w, x))
}

/// The entry of [`dct_inverse_rows`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn dct_inverse_rows_on<const K: u8>(
    t: &[f32],
    cols: &[bool],
    h: usize,
    w: usize,
    x: &mut [f32],
) {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    match unsafe { table::backend::<K>() } {
        b if b.kind() == BackendKind::Scalar => dct::inverse_rows_impl(t, cols, h, w, x),
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::DctInverse, b.kind()) == X86::Avx2 => {
            table::on::<{ table::AVX2 }, _>(DctInverseRows { t, cols, h, w, x })
        }
        _ => table::on::<K, _>(DctInverseRows { t, cols, h, w, x }),
    }
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
    match block_route(
        Op::FeedbackInt8,
        unsafe { table::backend::<K>() }.kind(),
        block,
    ) {
        // SAFETY: x86_route (so block_route) gives Avx2 only to the AVX2 and AVX-512
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
        // SAFETY: x86_route (so block_route) gives Avx512 only to the AVX-512 backend,
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

/// The x86 kernel family of a block codec's operation `op` on a backend of `kind` for
/// blocks of `block` elements: the routing table's, except where AVX-512's kernels lose
/// on some blocks (measured on a 2-core Intel Xeon, 2026-11-29, `backend_race`):
/// - int8's encode, fused error-feedback step and ring hop take AVX-512's kernels only
///   for blocks of a multiple of 64, their step. Blocks of 32 and 40 ran 1.1 to 1.3
///   times slower there, where a block's tail and its per-block work weigh most; with
///   the tails padded, 32 and 100 still did while 48 and 96 were faster: no simpler
///   rule fits.
/// - qsgd's and ternary's encode (sign-magnitude codes) likewise: blocks of 96, 100 and
///   160 ran 1.15 to 1.27 times slower on AVX-512 with qsgd (its 64s there, the rest on
///   AVX2's 32s), 64 faster; ternary gained at 160 and 200, given up for one rule.
/// - sign's encode takes AVX-512's only for blocks of at least 128: its per-block work
///   (the sixteen lanes' sum and maximum) made blocks of 16 to 64 1.3 to 1.7 times
///   slower there; 128 is level, 192 and more faster.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn block_route(op: Op, kind: BackendKind, block: usize) -> backend::X86 {
    match (x86_route(op, kind), op) {
        (
            backend::X86::Avx512,
            Op::EncodeInt8 | Op::FeedbackInt8 | Op::HopInt8 | Op::EncodeSignmag,
        ) if !block.is_multiple_of(64) => backend::X86::Avx2,
        (backend::X86::Avx512, Op::EncodeSign) if block < 128 => backend::X86::Avx2,
        (route, _) => route,
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
    match block_route(Op::HopInt8, unsafe { table::backend::<K>() }.kind(), block) {
        // SAFETY: x86_route (so block_route) gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx2 => Some(unsafe {
            x86_64::blocks::hop_int8_avx2(
                local, in_steps, in_codes, block, round, draws, first, sum, steps, codes,
            )
        }),
        // SAFETY: x86_route (so block_route) gives Avx512 only to the AVX-512 backend,
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
        // SAFETY: x86_route (so block_route) gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        b if block_route(Op::EncodeInt8, b.kind(), block) == X86::Avx2 => unsafe {
            x86_64::blocks::encode_int8_avx2(x, block, round, draws, first, steps, codes)
        },
        // SAFETY: x86_route (so block_route) gives Avx512 only to the AVX-512 backend,
        // which exists only after AVX-512 F/BW/DQ and AVX2 were detected.
        #[cfg(target_arch = "x86_64")]
        b if block_route(Op::EncodeInt8, b.kind(), block) == X86::Avx512 => unsafe {
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
        b if x86_route(Op::ReduceInt8, b.kind()) == X86::Avx2 => {
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
    if x86_route(Op::EncodeCodebook, b.kind()) == X86::Avx2 {
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
        match x86_route(op, b.kind()) {
            // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
            // after AVX-512 F/BW and AVX2 were detected.
            X86::Avx512 if fits => unsafe {
                return x86_64::blocks512::encode_nearest(f, four, scale, block, x, scales, codes);
            },
            // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which
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
    // Stochastic rounding with a scale on Intel's cores: the AVX-512 kernel.
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = draws
        && stochastic_takes_avx512(b.kind(), four, scale, block)
    {
        // SAFETY: only the AVX-512 backend passes, which exists only after AVX-512
        // F/BW/DQ and AVX2 were detected.
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
    if x86_route(if four { Op::EncodeFp4 } else { Op::EncodeFp8 }, b.kind()) == X86::Avx2
        || (b.kind() == BackendKind::Avx512 && stochastic_blocks_take_avx2(draws, block))
    {
        return table::on::<{ table::AVX2 }, _>(op);
    }
    table::on::<K, _>(op)
}

/// Whether a backend of `kind` encodes fp8 (or, with `four`, fp4) with stochastic
/// rounding, `scale` and blocks of `block` by the hand-written AVX-512 kernel
/// (`blocks512::encode_float_stochastic`) instead of the portable build: the AVX-512
/// backend on Intel's cores, with a block scale, on blocks of at least 64 (fp8) or 128
/// (fp4). Measured on a 2-core Intel Xeon (2026-11-29, 64 Ki elements, one thread,
/// alternating with the portable AVX-512 build, two runs): fp8 at blocks of 64 1.08 times
/// as fast, 96 level, 128 (the default) 1.15, 1024 1.21; fp4 at 128 1.03, 1024 1.15. On
/// smaller blocks its per-block work lost: fp8 at 12 to 24 0.7 to 0.96 times, fp4 at 16
/// to 48 0.6 to 0.92 (MXFP4's blocks of 32: 0.75). AMD's cores are not measured: they
/// keep the portable AVX-512 build.
#[cfg(target_arch = "x86_64")]
fn stochastic_takes_avx512(kind: BackendKind, four: bool, scale: fp8::Scale, block: usize) -> bool {
    kind == BackendKind::Avx512
        && backend::Cpu::this() == backend::Cpu::Intel
        && !matches!(scale, fp8::Scale::None | fp8::Scale::E8m0Floor)
        && block >= if four { 128 } else { 64 }
}

/// Whether the AVX-512 backend's fp8 and fp4 encoders hand blocks of `block` elements to
/// the AVX2 build: with stochastic rounding (`draws`), blocks of 2 and 3 and of 8 to 11
/// ran 1.1 to 1.5 times as fast there on a 2-core Intel Xeon (2026-11-29, `backend_race`
/// at 64 Ki elements, two runs: one 8-lane step and a short tail against a 16-lane
/// build's tail alone), where blocks of 4 to 7 and from 12 on ran 1.1 to 2.2 times as
/// fast on AVX-512's portable build. Intel's cores only; AMD's are not measured.
#[cfg(target_arch = "x86_64")]
fn stochastic_blocks_take_avx2(draws: Option<&Draws>, block: usize) -> bool {
    draws.is_some()
        && backend::Cpu::this() == backend::Cpu::Intel
        && (block < 4 || (8..12).contains(&block))
}

/// Whether the AVX-512 backend decodes fp8 (or, with `four`, fp4) frames of format `f`,
/// scale `scale` and blocks of `block` in mode `m` with its own kernels, where the
/// routing table gives it the row; the AVX2 build takes the others. Measured with
/// `backend_race` (a 2-core Intel Xeon, 2026-11-29, 64 Ki elements, three runs):
/// - the residual mode (error feedback's): only the AVX2 build has it;
/// - fp8 blocks under 64: the AVX2 build 1.15 to 1.7 times as fast (one or two 16-lane
///   steps a block, and the block's scale, dominate); from 64 on AVX-512 is level
///   (plain decode) or 1.15 to 1.2 times as fast (adding);
/// - E5M2's plain decode (one shift per code): 0 to 20% faster on the AVX2 build in
///   seven runs;
/// - fp4: AVX-512 only adds blocks of 32 with a power-of-two or f32 scale (1.05 to 1.15
///   times as fast); its plain decode there is 1.09 to 1.16 times slower, and blocks of
///   16, or E4M3 scales, 1.12 to 1.9 times slower.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn float_decode_takes_avx512(
    four: bool,
    f: fp8::Format,
    scale: fp8::Scale,
    block: usize,
    m: u8,
) -> bool {
    if four {
        return m == mode::ADD && block == 32 && !matches!(scale, fp8::Scale::E4m3 { .. });
    }
    m != mode::RESIDUAL && block >= 64 && (f == fp8::E4M3 || m == mode::ADD)
}

/// Whether the AVX-512 backend decodes an unscaled fp8 frame of `n` elements in mode `m`
/// with its own kernel rather than the AVX2 one. Measured with `backend_race` on a
/// 2-core Zen 5 (2026-12-03, two to three runs): adding, AVX-512's 1.3 to 1.7 times as
/// fast at 64 Ki and 1 Mi elements; writing, 1.7 times (E4M3) and 1.2 to 1.5 times
/// (E5M2) as fast at 64 Ki and 128 Ki, but once the output outgrows the core's L2
/// AVX2's 256-bit stores win: E5M2 at 512 Ki 1.1 times as fast on AVX2, E4M3 level to
/// 1.05 at 1 Mi (AVX-512 still 1.15 times as fast at 512 Ki). In the residual mode
/// (error feedback's) AVX-512's kernel made the step 1.1 times as fast at 64 Ki and 1 Mi.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn unscaled_takes_avx512(e4m3: bool, m: u8, n: usize) -> bool {
    m != mode::WRITE || n < if e4m3 { 1 << 20 } else { 1 << 19 }
}

/// The shortest fp8 block (with a scale, not a multiple of 16) whose decode the AVX-512
/// backend runs in its own build rather than the AVX2 one (see [`decode_float`]).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const FP8_REST_AVX512_FROM: usize = 24;

/// The build that runs the part of an fp8 (or, with `four`, fp4) decode that the
/// hand-written kernels do not take, on a backend of `kind`: the table's, except that
/// fp4 and fp8 with a scale in blocks under [`FP8_REST_AVX512_FROM`] take the AVX2 build
/// (the measurements are at [`decode_float`]).
#[cfg(target_arch = "x86_64")]
fn float_rest_route(kind: BackendKind, four: bool, scale: fp8::Scale, block: usize) -> X86 {
    let route = x86_route(if four { Op::DecodeFp4 } else { Op::DecodeFp8 }, kind);
    let avx2 = four || (scale != fp8::Scale::None && block < FP8_REST_AVX512_FROM);
    if route == X86::Avx512 && avx2 {
        X86::Avx2
    } else {
        route
    }
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
    #[cfg(target_arch = "x86_64")]
    let route = x86_route(if four { Op::DecodeFp4 } else { Op::DecodeFp8 }, b.kind());
    // The AVX-512 backend's own kernels where they were measured faster, else the AVX2
    // ones (the portable build below still follows the table).
    #[cfg(target_arch = "x86_64")]
    let avx512 = route == X86::Avx512 && float_decode_takes_avx512(four, f, scale, block, M);
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
        let done = if route == X86::Avx512 && unscaled_takes_avx512(e4m3, M, out.len()) {
            // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists
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
            Some(if avx512 {
                // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists
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
            Some(if avx512 {
                // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists
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
    // The rest of fp4 (other block lengths) runs the AVX2 build on both x86 backends: its
    // scalar nibble loop ran 1.2 times as fast as the AVX-512 one. So does the rest of
    // fp8 with a scale (blocks that are not a multiple of 16) in blocks of fewer than 24:
    // on a 2-core Zen 5 (2026-12-02, `backend_race` at 64 Ki elements) the AVX-512 build
    // of blocks of 10 decoded 10%, summed 12% and ran the error-feedback step 15% slower,
    // level at 24, and 1.13 to 1.15 times as fast at 40 (E8M0 and f32 scales alike).
    #[cfg(target_arch = "x86_64")]
    if float_rest_route(b.kind(), four, scale, block) == X86::Avx2 {
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
    match (b.kind(), block_route(Op::EncodeSign, b.kind(), block)) {
        (BackendKind::Scalar, _) => {
            codes.fill(0);
            scalar::encode_sign(x, block, steps, codes)
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: x86_route (so block_route) gives Avx2 only to the AVX2 and AVX-512
        // backends, which exist only after AVX2 was detected.
        (_, X86::Avx2) => unsafe { x86_64::encode_sign_avx2(x, block, steps, codes) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: x86_route (so block_route) gives Avx512 only to the AVX-512 backend,
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
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected; the block size is the kernel's precondition.
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::DecodeSign, b.kind()) == X86::Avx2
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
                // SAFETY: x86_route (so block_route) gives Avx2 only to the AVX2 and AVX-512
                // backends, which exist only after AVX2 and FMA (pulp's V3) were detected,
                // and Avx512 only to the AVX-512 backend (pulp's V4 as well); blocks start
                // on byte boundaries (checked above).
                unsafe { $kernel::<$bits>(x, block, measure, draws, first, steps, codes) }
            };
        }
        use x86_64::blocks::encode_signmag_avx2 as avx2;
        use x86_64::blocks512::encode_signmag_avx512 as avx512;
        match (block_route(Op::EncodeSignmag, b.kind(), block), bits) {
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
    if x86_route(Op::DecodeSignmag, b.kind()) == X86::Avx2
        && block.is_multiple_of((8 / bits) as usize)
    {
        macro_rules! avx2 {
            ($bits:literal) => {
                // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which
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
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::EncodeNatural, b.kind()) == X86::Avx2 => unsafe {
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
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        b if x86_route(Op::DecodeNatural, b.kind()) == X86::Avx2 => unsafe {
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

/// Compare and compress: the indices (relative to `x`, ascending) of the elements whose
/// magnitude key `|x|` bits (see [`scalar::mag_key`]) is `>= t`, written to `idx`.
/// Returns `(consumed, written)`: it scans from the start of `x` while `idx` has room, and
/// consumes at least one element unless `x` is empty; call again on the rest (indices are
/// relative to each call's start). `idx.len() >= 64` and `x.len() <= 2^32` are required.
/// How far one call gets differs between backends; the indices found do not. Entries of
/// `idx` past the written ones may change (fewer than 64 past them).
pub fn filter_mag_ge(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    call!(filter_mag_ge(x, t, idx))
}

/// The entry of [`filter_mag_ge`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn filter_mag_ge_on<const K: u8>(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), x86_route(Op::FilterMagGe, b.kind())) {
        (BackendKind::Scalar, _) => scalar::filter_mag_ge(x, t, idx),
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => unsafe { x86_64::filter_mag_ge_avx2(x, t, idx) },
        // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_mag_ge_avx512(x, t, idx) },
        _ => table::on::<K, _>(FilterMagGe { x, t, idx }),
    }
}

/// The groups of [`lane_bound`]: element `i` of a slice is in group `i % LANE_GROUPS`.
pub const LANE_GROUPS: usize = scalar::BOUND_GROUPS;

/// A lower bound of the `16 d`-th largest magnitude key of `x` (`bits & 0x7FFFFFFF`;
/// `d` 1 to 4) in one pass: the elements dealt into 16 groups (element `i` into group
/// `i % 16`), the least of the groups' `d`-th largest keys (0 where a group has fewer
/// than `d` elements). At least `min(16 d, x.len())` elements have a key at or above
/// it. The same value on every backend (see [`scalar::lane_bound`]).
pub fn lane_bound(x: &[f32], d: usize) -> u32 {
    call!(lane_bound(x, d))
}

/// The entry of [`lane_bound`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn lane_bound_on<const K: u8>(x: &[f32], d: usize) -> u32 {
    assert!((1..=4).contains(&d), "lane_bound depth {d} outside 1..=4");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), x86_route(Op::LaneBound, b.kind())) {
        // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe {
            match d {
                1 => x86_64::lane_bound_avx512::<1>(x),
                2 => x86_64::lane_bound_avx512::<2>(x),
                3 => x86_64::lane_bound_avx512::<3>(x),
                _ => x86_64::lane_bound_avx512::<4>(x),
            }
        },
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => match d {
            1 => table::on::<{ table::AVX2 }, _>(LaneBound::<1> { x }),
            2 => table::on::<{ table::AVX2 }, _>(LaneBound::<2> { x }),
            3 => table::on::<{ table::AVX2 }, _>(LaneBound::<3> { x }),
            _ => table::on::<{ table::AVX2 }, _>(LaneBound::<4> { x }),
        },
        _ => match d {
            1 => table::on::<K, _>(LaneBound::<1> { x }),
            2 => table::on::<K, _>(LaneBound::<2> { x }),
            3 => table::on::<K, _>(LaneBound::<3> { x }),
            _ => table::on::<K, _>(LaneBound::<4> { x }),
        },
    }
}

/// Whether [`lane_bound`] and [`filter_keys`] are the faster way to a chunk's candidates
/// on the current backend than a sampled threshold: on the SIMD backends, not on the
/// scalar one, whose bound pass on x86-64's baseline (no unsigned 32-bit minima and
/// maxima) took 4.2 us a chunk of 4096 where the sampled way took 6.4 us for the whole
/// encode (a 2-core Intel Xeon, 2026-11-29).
pub fn lane_bound_pays() -> bool {
    table::current().lane_bound_pays
}

/// The positions (ascending) and magnitude keys (`bits & 0x7FFFFFFF`) of the elements of
/// `x` whose key is at least `t`, into `idx` and `keys`, which must hold `x.len() + 64`
/// entries (`x.len() < 2^32`): their count. Entries past the count may change. The same
/// entries on every backend (see [`scalar::filter_keys`]); AVX-512 compresses 16 lanes
/// at a time without a branch per element, the others run [`filter_mag_ge`] and read
/// each key again.
pub fn filter_keys(x: &[f32], t: u32, idx: &mut [u32], keys: &mut [u32]) -> usize {
    call!(filter_keys(x, t, idx, keys))
}

/// The entry of [`filter_keys`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn filter_keys_on<const K: u8>(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    keys: &mut [u32],
) -> usize {
    assert!(
        idx.len() >= x.len() + 64 && keys.len() >= x.len() + 64 && x.len() <= u32::MAX as usize,
        "filter_keys: room for {} entries, not {} and {}",
        x.len() + 64,
        idx.len(),
        keys.len()
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), x86_route(Op::FilterKeys, b.kind())) {
        (BackendKind::Scalar, _) => scalar::filter_keys(x, t, idx, keys),
        // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F and DQ (pulp's x86-64-v4 set) and AVX2 with POPCNT (its v3
        // set) were detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_keys_avx512(x, t, idx, keys) },
        // The index filter (mask registers or movemask), then each key read again.
        _ => {
            let (mut pos, mut len) = (0, 0);
            while pos < x.len() {
                let (used, kept) = filter_mag_ge(&x[pos..], t, &mut idx[len..]);
                for i in &mut idx[len..len + kept] {
                    *i += pos as u32;
                }
                pos += used;
                len += kept;
            }
            for (k, &i) in keys[..len].iter_mut().zip(&idx[..len]) {
                *k = x[i as usize].to_bits() & 0x7FFF_FFFF;
            }
            len
        }
    }
}

/// [`filter_mag_ge`] that also writes each kept element's bits beside its index:
/// `vals[j] = x[idx[j]].to_bits()` for the `written` entries, so that a caller collecting
/// candidates reads `x` once (a gather afterwards missed the cache on large tensors).
/// `idx.len() >= 64` and `vals.len() >= idx.len()` are required.
pub fn filter_mag_ge_vals(x: &[f32], t: u32, idx: &mut [u32], vals: &mut [u32]) -> (usize, usize) {
    call!(filter_mag_ge_vals(x, t, idx, vals))
}

/// The entry of [`filter_mag_ge_vals`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn filter_mag_ge_vals_on<const K: u8>(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    vals: &mut [u32],
) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    assert!(
        vals.len() >= idx.len(),
        "filter value buffer shorter than its index buffer"
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), x86_route(Op::FilterMagGe, b.kind())) {
        (BackendKind::Scalar, _) => scalar::filter_mag_ge_vals(x, t, idx, vals),
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => unsafe { x86_64::filter_mag_ge_vals_avx2(x, t, idx, vals) },
        // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx512) => unsafe { x86_64::filter_mag_ge_vals_avx512(x, t, idx, vals) },
        _ => table::on::<K, _>(FilterMagGeVals { x, t, idx, vals }),
    }
}

/// Keep, in place and in order, the entries `j` of `idx` and `vals` whose value bits
/// `vals[j]` have a magnitude key (see [`scalar::mag_key`]) `>= t`; returns how many were
/// kept (entries past it are unspecified). Both slices are taken to the shorter one's
/// length. Routed with [`filter_mag_ge`], of which it is the in-place form.
pub fn retain_mag_ge(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    call!(retain_mag_ge(idx, vals, t))
}

/// The entry of [`retain_mag_ge`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn retain_mag_ge_on<const K: u8>(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    match (b.kind(), x86_route(Op::FilterMagGe, b.kind())) {
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after AVX2 was detected.
        #[cfg(target_arch = "x86_64")]
        (BackendKind::Avx2 | BackendKind::Avx512, X86::Avx2) => unsafe {
            x86_64::retain_mag_ge_avx2(idx, vals, t)
        },
        // SAFETY: x86_route gives Avx512 only to the AVX-512 backend, which exists only
        // after AVX-512F was detected.
        #[cfg(target_arch = "x86_64")]
        (BackendKind::Avx512, X86::Avx512) => unsafe { x86_64::retain_mag_ge_avx512(idx, vals, t) },
        _ => scalar::retain_mag_ge(idx, vals, t),
    }
}

/// Calls `f(i)` for each index, ascending, that a compare-and-compress filter keeps out of
/// `n` elements: `filter(pos, idx)` scans from element `pos` and returns
/// `(consumed, written)` with indices relative to `pos`, as [`filter_mag_ge`] and
/// [`filter_draw_lt`] do. The index buffer lives on the stack.
pub fn for_each_filtered(
    n: usize,
    mut filter: impl FnMut(usize, &mut [u32]) -> (usize, usize),
    mut f: impl FnMut(usize),
) {
    for_each_filtered_in(&mut (), n, |_, pos, idx| filter(pos, idx), |_, i| f(i));
}

/// [`for_each_filtered`] with a context `ctx` that both `filter` and `f` may change (the
/// output that random-k's decode zeroes in its filter and writes in `f`).
fn for_each_filtered_in<C: ?Sized>(
    ctx: &mut C,
    n: usize,
    mut filter: impl FnMut(&mut C, usize, &mut [u32]) -> (usize, usize),
    mut f: impl FnMut(&mut C, usize),
) {
    let mut idx = [0u32; 1024];
    let mut pos = 0;
    while pos < n {
        let (used, kept) = filter(ctx, pos, &mut idx);
        for &i in &idx[..kept] {
            f(ctx, pos + i as usize);
        }
        pos += used;
    }
}

/// Compare and compress on hash draws: the indices `i < n` (ascending) with
/// `draws.draw(first + i) < t` (`t <= 2^32`), written to `idx`; returns
/// `(consumed, written)` as [`filter_mag_ge`] does. `idx.len() >= 64` is required.
pub fn filter_draw_lt(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
) -> (usize, usize) {
    filter_draw_lt_zeroing(draws, first, t, n, idx, None)
}

/// [`filter_draw_lt`], also setting `zero[..consumed]` to 0.0 when `zero` is given.
fn filter_draw_lt_zeroing(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
    zero: Option<&mut [f32]>,
) -> (usize, usize) {
    call!(filter_draw_lt_zeroing(draws, first, t, n, idx, zero))
}

/// The entry of [`filter_draw_lt_zeroing`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn filter_draw_lt_zeroing_on<const K: u8>(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    idx: &mut [u32],
    zero: Option<&mut [f32]>,
) -> (usize, usize) {
    assert!(idx.len() >= 64, "filter index buffer shorter than 64");
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    // Keep each call inside one 2^32 index window (one key).
    let n = in_window(first, n);
    let (used, kept) = match (b.kind(), x86_route(Op::FilterDrawLt, b.kind())) {
        (BackendKind::Scalar, _) => scalar::filter_draw_lt(draws, first, t, n, idx),
        _ if t > u32::MAX as u64 => {
            // Every draw is below 2^32.
            let m = n.min(idx.len() & !63);
            for (i, o) in idx[..m].iter_mut().enumerate() {
                *o = i as u32;
            }
            (m, m)
        }
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, BMI1, ...) was detected.
        #[cfg(target_arch = "x86_64")]
        (_, X86::Avx2) => {
            let key = draws.key_for(first);
            let (first, t) = (first as u32, t as u32);
            return unsafe { x86_64::blocks::filter_draw_lt_avx2(first, key, t, n, idx, zero) };
        }
        _ => table::on::<K, _>(FilterDrawLt {
            first: first as u32,
            key: draws.key_for(first),
            t: t as u32,
            n,
            idx,
        }),
    };
    if let Some(z) = zero {
        z[..used].fill(0.0);
    }
    (used, kept)
}

/// Sets every element of `out` to 0.0 and calls `f(out, i)` for each `i < out.len()`,
/// ascending, with `draws.draw(first + i) < t` (`t <= 2^32`): random-k's `decode_into`,
/// with the zeroing done in the pass of hash draws. `f` is called once `out[i]` is zero
/// and may write it; it should write nothing else. `first + out.len()` must not overflow
/// u64.
pub fn for_each_draw_lt_zeroing(
    draws: &Draws,
    first: u64,
    t: u64,
    out: &mut [f32],
    f: impl FnMut(&mut [f32], usize),
) {
    let n = out.len();
    let filter = |out: &mut [f32], pos: usize, idx: &mut [u32]| {
        let zero = Some(&mut out[pos..]);
        filter_draw_lt_zeroing(draws, first + pos as u64, t, n - pos, idx, zero)
    };
    for_each_filtered_in(out, n, filter, f);
}

/// How many `i < n` have `draws.draw(first + i) < t` (`t <= 2^32`): the size of
/// [`filter_draw_lt`]'s selection without its indices (random-k's check that a frame's
/// selection matches its payload, before `decode_add` touches the accumulator).
/// `first + n` must not overflow u64.
pub fn count_draw_lt(draws: &Draws, first: u64, t: u64, n: usize) -> usize {
    call!(count_draw_lt(draws, first, t, n))
}

/// The entry of [`count_draw_lt`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn count_draw_lt_on<const K: u8>(draws: &Draws, first: u64, t: u64, n: usize) -> usize {
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    if b.kind() == BackendKind::Scalar {
        return scalar::count_draw_lt(draws, first, t, n);
    }
    if t > u32::MAX as u64 {
        // Every draw is below 2^32.
        return n;
    }
    let (mut count, mut done) = (0, 0);
    while done < n {
        // One 2^32 index window (one key) at a time.
        let at = first + done as u64;
        let m = in_window(at, n - done);
        let key = draws.key_for(at);
        count += match x86_route(Op::CountDrawLt, b.kind()) {
            // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which
            // exist only after AVX2 was detected.
            #[cfg(target_arch = "x86_64")]
            X86::Avx2 => unsafe { x86_64::blocks::count_draw_lt_avx2(at as u32, key, t as u32, m) },
            _ => table::on::<K, _>(CountDrawLt {
                first: at as u32,
                key,
                t: t as u32,
                n: m,
                _l: PhantomData,
            }),
        };
        done += m;
    }
    count
}

/// Keep masks of hash draws: writes the first `n.div_ceil(64)` entries of `masks`, bit
/// `i % 64` of entry `i / 64` set when `draws.draw(first + i) < t` (`t <= 2^32`), for
/// `i < n` (the bits past `n` are 0). Returns how many bits are set, the count of
/// [`count_draw_lt`]. `first + n` must not overflow u64.
///
/// # Panics
/// If `masks` is shorter than `n.div_ceil(64)`.
pub fn draw_masks(draws: &Draws, first: u64, t: u64, n: usize, masks: &mut [u64]) -> usize {
    // SAFETY: `MaybeUninit<u64>` has the layout of `u64`, and `draw_masks_into` only
    // writes initialised values through it, so `masks` stays initialised.
    let masks = unsafe { &mut *(core::ptr::from_mut(masks) as *mut [MaybeUninit<u64>]) };
    draw_masks_into(draws, first, t, n, masks)
}

/// [`draw_masks`] into storage that need not be initialised; the entries it covers are
/// written.
fn draw_masks_into(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    masks: &mut [MaybeUninit<u64>],
) -> usize {
    call!(draw_masks_into(draws, first, t, n, masks))
}

/// The entry of [`draw_masks_into`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn draw_masks_into_on<const K: u8>(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    masks: &mut [MaybeUninit<u64>],
) -> usize {
    assert!(
        masks.len() >= n.div_ceil(64),
        "{} mask entries for {n} elements",
        masks.len()
    );
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    let b = unsafe { table::backend::<K>() };
    // The oracle also takes a range across a 2^32 index window (two keys), which happens
    // once in 2^32 elements.
    if b.kind() == BackendKind::Scalar || in_window(first, n) < n {
        return scalar::draw_masks(draws, first, t, n, masks);
    }
    if t > u32::MAX as u64 {
        // Every draw is below 2^32.
        for (w, slot) in masks[..n.div_ceil(64)].iter_mut().enumerate() {
            slot.write(u64::MAX >> (64 - (n - 64 * w).min(64)));
        }
        return n;
    }
    let (first, key, t) = (first as u32, draws.key_for(first), t as u32);
    match x86_route(Op::DrawMasks, b.kind()) {
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, ...) was detected.
        #[cfg(target_arch = "x86_64")]
        X86::Avx2 => unsafe { x86_64::blocks::draw_masks_avx2(first, key, t, n, masks) },
        _ => table::on::<K, _>(DrawMasks {
            first,
            key,
            t,
            n,
            masks,
        }),
    }
}

/// Elements whose keep masks [`for_each_draw_lt_exactly`] keeps on the stack (32 KiB of
/// masks); past them it draws twice.
pub const STORED_MASK_ELEMENTS: usize = 1 << 18;

/// Calls `f(i)` for each `i < n`, ascending, with `draws.draw(first + i) < t`
/// (`t <= 2^32`), but only once it has checked that there are exactly `expect` of them;
/// otherwise returns `Err(count)` without calling `f`. `first + n` must not overflow u64.
///
/// This is random-k's `decode_add`: the accumulator may change only once the frame's
/// selection is known to match its payload. The keep masks of the first
/// [`STORED_MASK_ELEMENTS`] elements are kept on the stack from the counting pass, so those
/// are hashed once; the rest are hashed twice (counted, then filtered).
pub fn for_each_draw_lt_exactly(
    draws: &Draws,
    first: u64,
    t: u64,
    n: usize,
    expect: usize,
    mut f: impl FnMut(usize),
) -> Result<(), usize> {
    let mut stored = [MaybeUninit::<u64>::uninit(); STORED_MASK_ELEMENTS / 64];
    let pre = n.min(STORED_MASK_ELEMENTS);
    let words = pre.div_ceil(64);
    let mut count = draw_masks_into(draws, first, t, pre, &mut stored[..words]);
    count += count_draw_lt(draws, first + pre as u64, t, n - pre);
    if count != expect {
        return Err(count);
    }
    // SAFETY: `draw_masks_into` wrote the first `words` entries, and `MaybeUninit<u64>`
    // has the layout of `u64`.
    let masks = unsafe { &*(core::ptr::from_ref(&stored[..words]) as *const [u64]) };
    let rare = rare_keep(t);
    for_each_filtered(
        pre,
        |pos, idx| compress_stored_masks(&masks[pos / 64..], pre - pos, idx, rare),
        &mut f,
    );
    let rest = |pos: usize, idx: &mut [u32]| {
        filter_draw_lt(draws, first + (pre + pos) as u64, t, n - pre - pos, idx)
    };
    for_each_filtered(n - pre, rest, |i| f(pre + i));
    Ok(())
}

/// The indices of the set bits of `masks` (bit `i % 64` of entry `i / 64`, for `i < n`),
/// written to `idx` as a filter writes its own: returns `(consumed, written)`, consuming
/// whole entries but at the end. `rare` says most entries are 0.
fn compress_stored_masks(masks: &[u64], n: usize, idx: &mut [u32], rare: bool) -> (usize, usize) {
    call!(compress_stored_masks(masks, n, idx, rare))
}

/// The entry of [`compress_stored_masks`] for the backend of kind `K` (`table::kind`).
///
/// # Safety
/// The CPU must support the instruction set of `K`.
unsafe fn compress_stored_masks_on<const K: u8>(
    masks: &[u64],
    n: usize,
    idx: &mut [u32],
    rare: bool,
) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: this entry's contract: the CPU supports the instruction set of `K`.
    if x86_route(Op::CompressMasks, unsafe { table::backend::<K>() }.kind()) == X86::Avx2 {
        // SAFETY: x86_route gives Avx2 only to the AVX2 and AVX-512 backends, which exist
        // only after x86-64-v3 (AVX2, POPCNT, BMI1, ...) was detected.
        return unsafe { x86_64::compress_stored_masks_avx2(masks, n, idx, rare) };
    }
    let _ = rare;
    portable::compress_masks(n, idx, |done, _| masks[done / 64])
}

/// Whether a draw threshold `t` keeps so few elements (below 2^-9) that most groups of 64
/// keep nothing, and a branch that skips them is predicted right.
pub(crate) fn rare_keep(t: u64) -> bool {
    t < 1 << 23
}

/// How many of the `n` indices from `first` lie in `first`'s 2^32 index window (they share
/// one hash key).
fn in_window(first: u64, n: usize) -> usize {
    let to_window_end = (1u64 << 32) - (first & 0xFFFF_FFFF);
    (n as u64).min(to_window_end) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use backend::{Cpu, X86};

    /// AVX-512's int8 and sign-magnitude kernels take blocks of a multiple of 64 only, its
    /// sign encoder blocks of at least 128; the others, and every block on the other
    /// backends, follow the routing table.
    #[test]
    fn blocks_that_avx512_loses_on_take_the_avx2_kernels() {
        let int8 = [Op::EncodeInt8, Op::FeedbackInt8, Op::HopInt8];
        for op in int8.into_iter().chain([Op::EncodeSignmag, Op::EncodeSign]) {
            for kind in BackendKind::ALL {
                for block in [1, 16, 32, 40, 48, 64, 96, 127, 128, 256, 4096] {
                    let (table, got) = (x86_route(op, kind), block_route(op, kind, block));
                    let avx2 = if op == Op::EncodeSign {
                        block < 128
                    } else {
                        block % 64 != 0
                    };
                    if table == X86::Avx512 && avx2 {
                        assert_eq!(got, X86::Avx2, "{op:?} {kind:?} {block}");
                    } else {
                        assert_eq!(got, table, "{op:?} {kind:?} {block}");
                    }
                }
            }
        }
        // Where the table gives AVX-512 (Intel's cores for int8, every AVX-512 CPU for
        // sign and sign-magnitude), blocks of 256 take it.
        for op in [Op::EncodeSign, Op::EncodeSignmag] {
            assert_eq!(
                block_route(op, BackendKind::Avx512, 256),
                x86_route(op, BackendKind::Avx512)
            );
        }
        if Cpu::this() == Cpu::Intel {
            for op in int8 {
                assert_eq!(block_route(op, BackendKind::Avx512, 256), X86::Avx512);
            }
        }
    }

    /// The rest of an fp8 decode (blocks off 16) takes the AVX2 build on the AVX-512
    /// backend below blocks of 24 when scaled, and fp4's rest always; fp8 without a scale,
    /// and scaled blocks from 24, take the table's route; the other backends the table's.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn short_fp8_blocks_and_fp4_take_the_avx2_build_for_the_rest_of_a_decode() {
        let e8 = fp8::Scale::E8m0;
        for kind in BackendKind::ALL {
            let table8 = x86_route(Op::DecodeFp8, kind);
            let table4 = x86_route(Op::DecodeFp4, kind);
            let avx = |t: X86| if t == X86::Avx512 { X86::Avx2 } else { t };
            for block in [1, 10, 20, 23] {
                assert_eq!(float_rest_route(kind, false, e8, block), avx(table8));
                assert_eq!(
                    float_rest_route(kind, false, fp8::Scale::F32, block),
                    avx(table8)
                );
                assert_eq!(
                    float_rest_route(kind, false, fp8::Scale::None, block),
                    table8
                );
            }
            for block in [24, 28, 40, 100] {
                assert_eq!(float_rest_route(kind, false, e8, block), table8);
            }
            for block in [2, 10, 40, 100] {
                assert_eq!(float_rest_route(kind, true, e8, block), avx(table4));
            }
        }
        assert_eq!(
            float_rest_route(BackendKind::Avx512, false, e8, 40),
            X86::Avx512
        );
    }

    /// The AVX-512 backend's stochastic fp8 and fp4 encoders give the blocks they lost on
    /// (2, 3 and 8 to 11) to the AVX2 build on Intel's cores, and nothing else.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn stochastic_float_blocks_that_avx512_loses_on_take_avx2() {
        let d = Draws::new(7, 0, 0);
        let intel = Cpu::this() == Cpu::Intel;
        for block in 1..=64 {
            let lost = matches!(block, 1..=3 | 8..=11);
            assert_eq!(
                stochastic_blocks_take_avx2(Some(&d), block),
                intel && lost,
                "{block}"
            );
            assert!(!stochastic_blocks_take_avx2(None, block), "{block}");
        }
        for block in [4, 7, 12, 32, 128, 4096] {
            assert!(!stochastic_blocks_take_avx2(Some(&d), block), "{block}");
        }
    }

    /// fp8 and fp4 with stochastic rounding take the hand-written AVX-512 kernel only on
    /// the AVX-512 backend of Intel's cores, with a block scale, on blocks of at least 64
    /// (fp8) or 128 (fp4); never where the smaller blocks go to the AVX2 build.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn stochastic_floats_take_the_avx512_kernel_only_where_measured() {
        let d = Draws::new(7, 0, 0);
        let intel = Cpu::this() == Cpu::Intel;
        for kind in BackendKind::ALL {
            for scale in [fp8::Scale::F32, fp8::Scale::E8m0, fp8::Scale::None] {
                for (four, least) in [(false, 64), (true, 128)] {
                    for block in 1..=300 {
                        let got = stochastic_takes_avx512(kind, four, scale, block);
                        let want = intel
                            && kind == BackendKind::Avx512
                            && scale != fp8::Scale::None
                            && block >= least;
                        assert_eq!(got, want, "{kind:?} {four} {block}");
                        assert!(!(got && stochastic_blocks_take_avx2(Some(&d), block)));
                    }
                }
            }
        }
    }

    /// The AVX-512 backend's float decoders take only what they were measured faster on:
    /// each row of the measurements, as a case.
    #[test]
    fn float_decodes_take_avx512_where_it_was_faster() {
        use fp8::{E2M1, E3M0, E4M3, E5M2, Scale};
        use mode::{ADD, RESIDUAL, WRITE};
        let e4m3 = Scale::E4m3 {
            global: 1.0f32.to_bits(),
        };
        let cases = [
            // fp8: blocks of 64 and more, E5M2's plain decode and the residual mode not.
            (false, E4M3, Scale::F32, 16, WRITE, false),
            (false, E4M3, Scale::F32, 48, ADD, false),
            (false, E4M3, Scale::F32, 64, WRITE, true),
            (false, E4M3, Scale::E8m0, 128, ADD, true),
            (false, E4M3, Scale::F32, 128, RESIDUAL, false),
            (false, E5M2, Scale::F32, 128, WRITE, false),
            (false, E5M2, Scale::F32, 128, ADD, true),
            (false, E5M2, Scale::F32, 32, ADD, false),
            // fp4: adding blocks of 32 with an f32 or E8M0 scale only.
            (true, E2M1, Scale::E8m0, 32, ADD, true),
            (true, E3M0, Scale::F32, 32, ADD, true),
            (true, E2M1, Scale::E8m0, 32, WRITE, false),
            (true, E2M1, Scale::E8m0, 16, ADD, false),
            (true, E2M1, e4m3, 32, ADD, false),
            (true, E2M1, e4m3, 16, ADD, false),
            (true, E2M1, Scale::E8m0, 32, RESIDUAL, false),
        ];
        // Unscaled fp8: adding and the residual mode always, writing while the output
        // fits the core's L2.
        assert!(unscaled_takes_avx512(true, ADD, 1 << 24));
        assert!(unscaled_takes_avx512(false, WRITE, (1 << 19) - 1));
        assert!(!unscaled_takes_avx512(false, WRITE, 1 << 19));
        assert!(unscaled_takes_avx512(true, WRITE, (1 << 20) - 1));
        assert!(!unscaled_takes_avx512(true, WRITE, 1 << 20));
        assert!(unscaled_takes_avx512(false, RESIDUAL, 1 << 24));
        for (four, f, scale, block, m, want) in cases {
            let got = float_decode_takes_avx512(four, f, scale, block, m);
            assert_eq!(
                got, want,
                "four {four} {f:?} {scale:?} block {block} mode {m}"
            );
        }
    }
}
