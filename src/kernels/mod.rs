//! The hot loops, by operation, and the backend that runs them.
//!
//! - `scalar` is the oracle and the fallback (DESIGN rule 1): plain code that defines
//!   every result.
//! - `portable` holds branch-free versions of the same kernels, compiled once per SIMD
//!   backend through pulp's `Arch::dispatch` (AVX2 = x86-64-v3, AVX-512 = x86-64-v4,
//!   NEON), so the compiler vectorises one source for every ISA.
//! - `x86_64` holds what the vectoriser cannot emit (F16C / AVX-512 half conversions).
//!
//! The functions in this module pick the implementation for [`Backend::current`]. Every
//! backend gives byte-identical frames and bit-identical decoded floats (tests/backends.rs,
//! tests/exhaustive.rs). This module tree is the only place `unsafe` may appear, and every
//! such block carries a `// SAFETY:` comment.

#![allow(unsafe_code)]

pub mod backend;
mod portable;
pub mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86_64;

pub use backend::{Backend, BackendKind};

use crate::rng::Draws;
use scalar::Round;

/// Run a portable kernel compiled for backend `b`.
#[inline(always)]
fn simd<Op: pulp::WithSimd>(b: Backend, op: Op) -> Op::Output {
    backend::pulp_arch(b).dispatch(op)
}

/// Defines a `pulp::WithSimd` operation around a portable kernel call. pulp compiles
/// `with_simd::<S>` once per instruction set `S`; the kernel, being `#[inline(always)]`,
/// is inlined into each copy and so vectorised for that ISA. (A closure would not do:
/// it is one function, compiled once for the baseline ISA, that every copy calls.)
macro_rules! simd_op {
    ($Name:ident $(<const $C:ident: bool>)? { $($f:ident: $t:ty),* $(,)? } -> $R:ty = $call:expr) => {
        struct $Name<'a $(, const $C: bool)?> {
            $($f: $t,)*
            _life: core::marker::PhantomData<&'a ()>,
        }

        impl<'a $(, const $C: bool)?> pulp::WithSimd for $Name<'a $(, $C)?> {
            type Output = $R;

            #[inline(always)]
            fn with_simd<S: pulp::Simd>(self, _: S) -> $R {
                let $Name { $($f,)* .. } = self;
                $call
            }
        }
    };
}

const LIFE: core::marker::PhantomData<&()> = core::marker::PhantomData;

simd_op!(EncodeF32 { x: &'a [f32], out: &'a mut [u8] } -> bool = portable::encode_f32(x, out));
simd_op!(DecodeF32<const ADD: bool> { p: &'a [u8], out: &'a mut [f32] } -> ()
    = portable::decode_f32::<ADD>(p, out));
simd_op!(EncodeF16 { x: &'a [f32], out: &'a mut [u8] } -> bool
    = portable::encode_u16(x, out, portable::f32_to_f16));
simd_op!(DecodeF16<const ADD: bool> { p: &'a [u8], out: &'a mut [f32] } -> ()
    = portable::decode_u16::<ADD>(p, out, portable::f16_to_f32));
simd_op!(EncodeBf16 { x: &'a [f32], out: &'a mut [u8] } -> bool
    = portable::encode_u16(x, out, portable::f32_to_bf16));
simd_op!(DecodeBf16<const ADD: bool> { p: &'a [u8], out: &'a mut [f32] } -> ()
    = portable::decode_u16::<ADD>(p, out, scalar::bf16_to_f32));
simd_op!(EncodeInt8 {
    x: &'a [f32], block: usize, round: Round, draws: &'a Draws, first: u64,
    steps: &'a mut [u8], codes: &'a mut [u8],
} -> bool = portable::encode_int8(x, block, round, draws, first, steps, codes));
simd_op!(DecodeInt8<const ADD: bool> {
    steps: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_int8::<ADD>(steps, codes, block, out));
simd_op!(EncodeSign { x: &'a [f32], block: usize, steps: &'a mut [u8], codes: &'a mut [u8] }
    -> bool = portable::encode_sign(x, block, steps, codes));
simd_op!(DecodeSign<const ADD: bool> {
    steps: &'a [u8], codes: &'a [u8], block: usize, out: &'a mut [f32],
} -> () = portable::decode_sign::<ADD>(steps, codes, block, out));

/// f32 to little-endian bytes (`out.len() == 4 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_f32(x: &[f32], out: &mut [u8]) -> bool {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => scalar::encode_f32(x, out),
        b => simd(
            b,
            EncodeF32 {
                x,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// Little-endian bytes to f32, written or added (`p.len() == 4 * out.len()`).
pub fn decode_f32<const ADD: bool>(p: &[u8], out: &mut [f32]) {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => scalar::decode_f32::<ADD>(p, out),
        b => simd(
            b,
            DecodeF32::<ADD> {
                p,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// f32 to binary16 (`out.len() == 2 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_f16(x: &[f32], out: &mut [u8]) -> bool {
    let b = Backend::current();
    match b.kind() {
        BackendKind::Scalar => scalar::encode_u16(x, out, scalar::f32_to_f16),
        // SAFETY: a Backend of kind Avx2 exists only after AVX2 and F16C were detected.
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx2 => unsafe { x86_64::encode_f16_avx2(x, out) },
        // SAFETY: a Backend of kind Avx512 exists only after AVX-512F and F16C were detected.
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx512 => unsafe { x86_64::encode_f16_avx512(x, out) },
        _ => simd(
            b,
            EncodeF16 {
                x,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// binary16 to f32, written or added (`p.len() == 2 * out.len()`).
pub fn decode_f16<const ADD: bool>(p: &[u8], out: &mut [f32]) {
    let b = Backend::current();
    match b.kind() {
        BackendKind::Scalar => scalar::decode_u16::<ADD>(p, out, scalar::f16_to_f32),
        // SAFETY: a Backend of kind Avx2 exists only after AVX2 and F16C were detected.
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx2 => unsafe { x86_64::decode_f16_avx2::<ADD>(p, out) },
        // SAFETY: a Backend of kind Avx512 exists only after AVX-512F and F16C were detected.
        #[cfg(target_arch = "x86_64")]
        BackendKind::Avx512 => unsafe { x86_64::decode_f16_avx512::<ADD>(p, out) },
        _ => simd(
            b,
            DecodeF16::<ADD> {
                p,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// f32 to bfloat16 (`out.len() == 2 * x.len()`); true if any input is NaN/±Inf.
pub fn encode_bf16(x: &[f32], out: &mut [u8]) -> bool {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => scalar::encode_u16(x, out, scalar::f32_to_bf16),
        b => simd(
            b,
            EncodeBf16 {
                x,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// bfloat16 to f32, written or added (`p.len() == 2 * out.len()`).
pub fn decode_bf16<const ADD: bool>(p: &[u8], out: &mut [f32]) {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => {
            scalar::decode_u16::<ADD>(p, out, scalar::bf16_to_f32)
        }
        b => simd(
            b,
            DecodeBf16::<ADD> {
                p,
                out,
                _life: LIFE,
            },
        ),
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
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => {
            scalar::encode_int8(x, block, round, draws, first, steps, codes)
        }
        b => simd(
            b,
            EncodeInt8 {
                x,
                block,
                round,
                draws,
                first,
                steps,
                codes,
                _life: LIFE,
            },
        ),
    }
}

/// int8 block decode (see [`scalar::decode_int8`]).
pub fn decode_int8<const ADD: bool>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => {
            scalar::decode_int8::<ADD>(steps, codes, block, out)
        }
        b => simd(
            b,
            DecodeInt8::<ADD> {
                steps,
                codes,
                block,
                out,
                _life: LIFE,
            },
        ),
    }
}

/// Sign block encode (see [`scalar::encode_sign`]); `codes` need not be zeroed.
pub fn encode_sign(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => {
            codes.fill(0);
            scalar::encode_sign(x, block, steps, codes)
        }
        b => simd(
            b,
            EncodeSign {
                x,
                block,
                steps,
                codes,
                _life: LIFE,
            },
        ),
    }
}

/// Sign block decode (see [`scalar::decode_sign`]).
pub fn decode_sign<const ADD: bool>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    match Backend::current() {
        b if b.kind() == BackendKind::Scalar => {
            scalar::decode_sign::<ADD>(steps, codes, block, out)
        }
        b => simd(
            b,
            DecodeSign::<ADD> {
                steps,
                codes,
                block,
                out,
                _life: LIFE,
            },
        ),
    }
}
