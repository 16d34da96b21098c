//! The dispatch table: for each backend, one entry per operation, chosen once.
//!
//! A [`Kernels`] value holds, for every operation it covers, the function that runs it on
//! one backend: the scalar definition, a build of the portable source for the backend's
//! instruction set, or a hand-written x86 kernel where the routing table
//! ([`routing::ROWS`]) says that one is faster. The table of a backend is built the
//! first time a thread uses that backend and then kept for the process, so the routing is
//! decided once per backend rather than on every call; the operations in `kernels` call
//! their entry through [`call!`]. Forcing a backend ([`Backend::run`]) picks its table.
//!
//! Entries are `unsafe fn`: a hand-written kernel needs the instructions of its backend.
//! A table is only built for a backend that exists, and a [`Backend`] only exists after
//! its CPU check passed, so every entry of the table in use may run. Where an entry
//! depends on the call (a block size, a mode), the entry itself chooses: the table fixes
//! what depends on the backend and the CPU alone.
//!
//! Adding an operation: a field here, its entry in [`portable_table`] (and
//! [`scalar_table`]), an override in [`x86_table`] where a hand-written kernel exists, and
//! the operation's function in `kernels` calling `call!`.

// The fields are the operations' signatures, each written once.
#![allow(clippy::type_complexity)]

use std::sync::OnceLock;

use super::backend::{self, Backend, BackendKind};
#[cfg(target_arch = "x86_64")]
use super::{
    routing::{self, Call, Op, X86},
    x86_64,
};
use core::mem::MaybeUninit;

use super::scalar::{self, Round};
use super::{entropy, fp8, planes, portable};
use crate::rng::Draws;

/// The portable builds' instruction sets as const parameters ([`on`]): AVX2, AVX-512,
/// NEON.
pub(super) const AVX2: u8 = 1;
/// See [`AVX2`].
pub(super) const AVX512: u8 = 2;
/// The scalar backend's kind as a const parameter (see [`AVX2`]).
pub(super) const SCALAR: u8 = 0;
/// See [`AVX2`].
pub(super) const NEON: u8 = 3;
/// The AVX-512 backend with routing off (`routing::unrouted`): its own code everywhere.
pub(super) const UNROUTED: u8 = 4;

/// The backend kind a const parameter names ([`SCALAR`], [`AVX2`], [`AVX512`], [`NEON`],
/// [`UNROUTED`]).
pub(super) const fn kind<const K: u8>() -> BackendKind {
    match K {
        AVX2 => BackendKind::Avx2,
        AVX512 | UNROUTED => BackendKind::Avx512,
        NEON => BackendKind::Neon,
        _ => BackendKind::Scalar,
    }
}

/// The backend of kind `K`, for an entry that routes within itself.
///
/// # Safety
/// The CPU must support the instruction set of `K` (the entries of a table are only
/// called on a CPU that has its backend).
pub(super) unsafe fn backend<const K: u8>() -> Backend {
    // SAFETY: the caller's contract.
    unsafe { Backend::assume(kind::<K>()) }
}

/// Run portable operation `op` compiled for the instruction set `K` ([`AVX2`],
/// [`AVX512`], [`NEON`]; anything else, or a CPU without it, the baseline build).
#[inline(always)]
pub(super) fn on<const K: u8, O: pulp::WithSimd>(op: O) -> O::Output {
    backend::pulp_arch_of(kind::<K>()).dispatch(op)
}

/// The three entries of an operation generic over its mode (`mode::WRITE`, `ADD`,
/// `RESIDUAL`, in that order: the index is the mode).
macro_rules! modes {
    ($($f:ident)::+ $(, $g:tt)*) => {
        [
            $($f)::+::<$($g,)* { $crate::kernels::mode::WRITE }> as _,
            $($f)::+::<$($g,)* { $crate::kernels::mode::ADD }> as _,
            $($f)::+::<$($g,)* { $crate::kernels::mode::RESIDUAL }> as _,
        ]
    };
}

/// Call operation `$op` (an entry, or with `[$i]` an entry of an array of them, such as
/// a mode's) of the table of the backend in use on this thread.
macro_rules! call {
    ($op:ident $([$i:expr])* ($($arg:expr),* $(,)?)) => {
        // SAFETY: the table is that of a backend that exists, so whose CPU check passed,
        // and a backend's table holds only kernels its CPU runs (`table::build`).
        unsafe { ($crate::kernels::table::current().$op $([$i])*)($($arg),*) }
    };
}
pub(super) use call;

/// An operation's entries by mode.
type ByMode<F> = [F; 3];

/// The kernels of one backend: an entry per operation (see the module docs).
pub(super) struct Kernels {
    pub(super) encode_f32: unsafe fn(&[f32], &mut [u8]) -> bool,
    pub(super) decode_f32: ByMode<unsafe fn(&[u8], &mut [f32])>,
    pub(super) encode_f16: unsafe fn(&[f32], &mut [u8]) -> bool,
    pub(super) decode_f16: ByMode<unsafe fn(&[u8], &mut [f32])>,
    /// fp16's fused ring hop: `None` where the backend has no fused kernel.
    pub(super) hop_f16: Option<unsafe fn(&[f32], &[u8], &mut [u8]) -> bool>,
    pub(super) encode_bf16: unsafe fn(&[f32], &mut [u8]) -> bool,
    pub(super) decode_bf16: ByMode<unsafe fn(&[u8], &mut [f32])>,
    pub(super) feedback_f16: unsafe fn(&mut [f32], &[f32], f32, f32, &mut [u8]) -> bool,
    pub(super) feedback_form: unsafe fn(&mut [f32], &[f32], f32, f32),
    pub(super) feedback_form_bf16: unsafe fn(&mut [f32], &[u16], &[f32], f32, f32),
    pub(super) feedback_store_bf16: unsafe fn(&mut [u16], &[f32]),
    pub(super) any_nonfinite: unsafe fn(&[f32]) -> bool,
    pub(super) any_all_set: unsafe fn(&[u8], u8) -> bool,
    pub(super) f32_scales_valid: unsafe fn(&[u8]) -> bool,
    pub(super) max_finite_abs_bits: unsafe fn(&[f32]) -> u32,
    pub(super) entropy_encode: unsafe fn(&[u8], usize, Option<&[u64; 256]>, &mut [u8]) -> usize,
    #[allow(clippy::type_complexity)]
    pub(super) entropy_multi4: unsafe fn(
        [&[u8]; 4],
        &mut [u64; 4],
        &[u32; 1 << entropy::MAX_LEN],
        &mut [[u8; entropy::PIECE]; 4],
        [usize; 4],
    ) -> [usize; 4],
    pub(super) exponents: unsafe fn(&[f32], bool, &mut [u8]) -> planes::ExponentStats,
    pub(super) split_f32: unsafe fn(&[f32], &mut [u8], &mut [u8]),
    pub(super) split_bf16: unsafe fn(&[f32], &mut [u8]),
    pub(super) join_f32: ByMode<unsafe fn(&[u8], &[u8], &[u8], &mut [f32])>,
    pub(super) join_bf16: ByMode<unsafe fn(&[u8], &[u8], &mut [f32])>,
    pub(super) reduce_f32: ByMode<unsafe fn(&[&[u8]], usize, &mut [f32])>,
    pub(super) reduce_f16: ByMode<unsafe fn(&[&[u8]], usize, &mut [f32])>,
    pub(super) reduce_bf16: ByMode<unsafe fn(&[&[u8]], usize, &mut [f32])>,
    pub(super) dct_forward: unsafe fn(&[f32], usize, usize, usize, &mut [f32], &mut [f32]),
    pub(super) dct_select: unsafe fn(&mut [f32], usize, &mut [u64], &mut [u16]),
    pub(super) dct_forward_fast: unsafe fn(&[f32], usize, usize, usize, &mut [f32], &mut [f32]),
    pub(super) dct_encode_rows_fast: unsafe fn(&[f32], usize, usize, &mut [u16], &mut [f32]),
    pub(super) dct_encode_rows_lee: unsafe fn(&[f32], usize, usize, &mut [u16], &mut [f32]),
    pub(super) dct_forward_lee: unsafe fn(&[f32], usize, usize, usize, &mut [f32], &mut [f32]),
    pub(super) dct_decode_rows: ByMode<unsafe fn(usize, usize, &[u16], &[f32], &mut [f32])>,
    pub(super) gemm_thin_mq: unsafe fn(&mut [f32], Option<&[f32]>, &[f32], usize, &mut [f32]),
    pub(super) gemm_thin_pqt:
        unsafe fn(Option<&[f32]>, &mut [f32], Option<&mut [f32]>, &[f32], &[f32], usize, bool),
    pub(super) gemm_thin_mtp: unsafe fn(&[f32], usize, usize, &[f32], usize, &mut [f32]),
    pub(super) dct_inverse_rows: unsafe fn(&[f32], &[bool], usize, usize, &mut [f32]),
    pub(super) feedback_int8: unsafe fn(
        &mut [f32],
        &[f32],
        (f32, f32),
        usize,
        Round,
        &Draws,
        u64,
        &mut [u8],
        &mut [u8],
    ) -> Option<bool>,
    pub(super) hop_int8: unsafe fn(
        &[f32],
        (&[u8], &[u8]),
        usize,
        Round,
        &Draws,
        u64,
        &mut [f32],
        &mut [u8],
        &mut [u8],
    ) -> Option<bool>,
    pub(super) encode_int8:
        unsafe fn(&[f32], usize, Round, &Draws, u64, &mut [u8], &mut [u8]) -> bool,
    pub(super) reduce_int8: ByMode<unsafe fn(&[(&[u8], &[u8])], usize, usize, &mut [f32])>,
    pub(super) decode_int8: ByMode<unsafe fn(&[u8], &[u8], usize, &mut [f32])>,
    pub(super) encode_codebook: unsafe fn(&[f32], usize, &mut [u8], &mut [u8]) -> bool,
    pub(super) encode_float: unsafe fn(
        fp8::Format,
        fp8::Scale,
        bool,
        usize,
        &[f32],
        Option<&Draws>,
        u64,
        &mut [u8],
        &mut [u8],
    ) -> bool,
    pub(super) decode_float:
        ByMode<unsafe fn(fp8::Format, fp8::Scale, bool, usize, &[u8], &[u8], &mut [f32])>,
    pub(super) encode_sign: unsafe fn(&[f32], usize, &mut [u8], &mut [u8]) -> bool,
    pub(super) decode_sign: ByMode<unsafe fn(&[u8], &[u8], usize, &mut [f32])>,
    pub(super) encode_signmag:
        unsafe fn(&[f32], usize, u32, scalar::Measure, &Draws, u64, &mut [u8], &mut [u8]) -> bool,
    pub(super) decode_signmag: ByMode<unsafe fn(&[u8], &[u8], usize, u32, &mut [f32])>,
    pub(super) encode_natural: unsafe fn(&[f32], usize, &Draws, u64, &mut [u8], &mut [u8]) -> bool,
    pub(super) decode_natural: ByMode<unsafe fn(&[u8], &[u8], usize, &mut [f32])>,
    pub(super) filter_mag_ge: unsafe fn(&[f32], u32, &mut [u32]) -> (usize, usize),
    pub(super) lane_bound: unsafe fn(&[f32], usize) -> u32,
    pub(super) filter_keys: unsafe fn(&[f32], u32, &mut [u32], &mut [u32]) -> usize,
    pub(super) filter_mag_ge_vals: unsafe fn(&[f32], u32, &mut [u32], &mut [u32]) -> (usize, usize),
    pub(super) retain_mag_ge: unsafe fn(&mut [u32], &mut [u32], u32) -> usize,
    pub(super) filter_draw_lt_zeroing:
        unsafe fn(&Draws, u64, u64, usize, &mut [u32], Option<&mut [f32]>) -> (usize, usize),
    pub(super) count_draw_lt: unsafe fn(&Draws, u64, u64, usize) -> usize,
    pub(super) draw_masks_into:
        unsafe fn(&Draws, u64, u64, usize, &mut [MaybeUninit<u64>]) -> usize,
    pub(super) compress_stored_masks: unsafe fn(&[u64], usize, &mut [u32], bool) -> (usize, usize),
    /// Whether `lane_bound` and `filter_keys` beat a sampled threshold here.
    pub(super) lane_bound_pays: bool,
}

/// The table of the backend in use on this thread ([`Backend::current`]).
#[inline]
pub(super) fn current() -> &'static Kernels {
    static TABLES: [OnceLock<Kernels>; 5] = [const { OnceLock::new() }; 5];
    let b = Backend::current();
    let slot = match (b.kind(), b.routed()) {
        (BackendKind::Avx2, _) => AVX2,
        (BackendKind::Avx512, true) => AVX512,
        (BackendKind::Avx512, false) => UNROUTED,
        (BackendKind::Neon, _) => NEON,
        _ => SCALAR,
    };
    TABLES[slot as usize].get_or_init(|| build(slot))
}

/// The table of the backend `K` names (a const parameter's value). Only called for a
/// backend that exists.
fn build(k: u8) -> Kernels {
    match k {
        #[cfg(target_arch = "x86_64")]
        AVX2 => x86_table::<AVX2>(portable_table::<AVX2, AVX2>()),
        #[cfg(target_arch = "x86_64")]
        AVX512 => x86_table::<AVX512>(portable_table::<AVX512, AVX512>()),
        // The AVX-512 build of the portable operations (they do not route), with the
        // entries that route taking their unrouted form.
        #[cfg(target_arch = "x86_64")]
        UNROUTED => x86_table::<UNROUTED>(portable_table::<AVX512, UNROUTED>()),
        NEON => portable_table::<NEON, NEON>(),
        _ => scalar_table(),
    }
}

/// The scalar backend's table: the definitions (the operations that route within their
/// entry take the entry for `SCALAR`, whose first arm is the definition).
fn scalar_table() -> Kernels {
    Kernels {
        encode_f32: scalar::encode_f32,
        decode_f32: modes!(scalar::decode_f32),
        encode_f16: |x, out| scalar::encode_u16(x, out, scalar::f32_to_f16),
        decode_f16: [
            |p, out| scalar::decode_u16::<{ super::mode::WRITE }>(p, out, scalar::f16_to_f32),
            |p, out| scalar::decode_u16::<{ super::mode::ADD }>(p, out, scalar::f16_to_f32),
            |p, out| scalar::decode_u16::<{ super::mode::RESIDUAL }>(p, out, scalar::f16_to_f32),
        ],
        hop_f16: None,
        encode_bf16: |x, out| scalar::encode_u16(x, out, scalar::f32_to_bf16),
        decode_bf16: [
            |p, out| scalar::decode_u16::<{ super::mode::WRITE }>(p, out, scalar::bf16_to_f32),
            |p, out| scalar::decode_u16::<{ super::mode::ADD }>(p, out, scalar::bf16_to_f32),
            |p, out| scalar::decode_u16::<{ super::mode::RESIDUAL }>(p, out, scalar::bf16_to_f32),
        ],
        feedback_f16: |r, g, beta, gamma, out| {
            scalar::feedback_u16(
                r,
                g,
                beta,
                gamma,
                out,
                scalar::f32_to_f16,
                scalar::f16_to_f32,
            )
        },
        feedback_form: scalar::feedback_form,
        feedback_form_bf16: scalar::feedback_form_bf16,
        feedback_store_bf16: scalar::feedback_store_bf16,
        any_nonfinite: scalar::any_nonfinite,
        any_all_set: scalar::any_all_set,
        f32_scales_valid: scalar::f32_scales_valid,
        max_finite_abs_bits: scalar::max_finite_abs_bits,
        entropy_encode: entropy::encode_with,
        entropy_multi4: entropy::multi4_with,
        exponents: planes::exponents_with,
        split_f32: planes::split_f32_with,
        split_bf16: planes::split_bf16_with,
        join_f32: modes!(planes::join_f32_with),
        join_bf16: modes!(planes::join_bf16_with),
        reduce_f32: modes!(portable::reduce_f32),
        reduce_f16: [
            |f, s, out| {
                portable::reduce_u16::<{ super::mode::WRITE }>(f, s, out, scalar::f16_to_f32)
            },
            |f, s, out| portable::reduce_u16::<{ super::mode::ADD }>(f, s, out, scalar::f16_to_f32),
            |f, s, out| {
                portable::reduce_u16::<{ super::mode::RESIDUAL }>(f, s, out, scalar::f16_to_f32)
            },
        ],
        reduce_bf16: [
            |f, s, out| {
                portable::reduce_u16::<{ super::mode::WRITE }>(f, s, out, scalar::bf16_to_f32)
            },
            |f, s, out| {
                portable::reduce_u16::<{ super::mode::ADD }>(f, s, out, scalar::bf16_to_f32)
            },
            |f, s, out| {
                portable::reduce_u16::<{ super::mode::RESIDUAL }>(f, s, out, scalar::bf16_to_f32)
            },
        ],
        lane_bound_pays: false,
        // The operations that route within their entry: their scalar arm.
        ..portable_table::<SCALAR, SCALAR>()
    }
}

/// The table of the portable source compiled for instruction set `K` (see [`on`]), with
/// the entries that route within themselves taken for backend `R` (`K`, or [`UNROUTED`]
/// for `K` = [`AVX512`]).
fn portable_table<const K: u8, const R: u8>() -> Kernels {
    use super::entry as e;
    Kernels {
        encode_f32: e::encode_f32::<K>,
        decode_f32: modes!(e::decode_f32, K),
        encode_f16: e::encode_f16::<K>,
        decode_f16: modes!(e::decode_f16, K),
        hop_f16: None,
        encode_bf16: e::encode_bf16::<K>,
        decode_bf16: modes!(e::decode_bf16, K),
        feedback_f16: e::feedback_f16::<K>,
        feedback_form: e::feedback_form::<K>,
        feedback_form_bf16: e::feedback_form_bf16::<K>,
        feedback_store_bf16: e::feedback_store_bf16::<K>,
        any_nonfinite: e::any_nonfinite::<K>,
        any_all_set: e::any_all_set::<K>,
        f32_scales_valid: e::f32_scales_valid::<K>,
        max_finite_abs_bits: e::max_finite_abs_bits::<K>,
        entropy_encode: entropy::encode_on::<K>,
        entropy_multi4: entropy::multi4_on::<K>,
        exponents: planes::exponents_on::<K>,
        split_f32: planes::split_f32_on::<K>,
        split_bf16: planes::split_bf16_on::<K>,
        join_f32: modes!(planes::join_f32_on, K),
        join_bf16: modes!(planes::join_bf16_on, K),
        reduce_f32: modes!(e::reduce_f32, K),
        reduce_f16: modes!(e::reduce_f16, K),
        reduce_bf16: modes!(e::reduce_bf16, K),
        dct_forward: super::dct_forward_on::<R>,
        dct_select: super::dct_select_on::<R>,
        dct_forward_fast: super::dct_forward_fast_on::<R>,
        dct_encode_rows_fast: super::dct_encode_rows_fast_on::<R>,
        dct_encode_rows_lee: super::dct_encode_rows_lee_on::<R>,
        dct_forward_lee: super::dct_forward_lee_on::<R>,
        dct_decode_rows: modes!(super::dct_decode_rows_on, R),
        gemm_thin_mq: super::gemm_thin_mq_on::<R>,
        gemm_thin_pqt: super::gemm_thin_pqt_on::<R>,
        gemm_thin_mtp: super::gemm_thin_mtp_on::<R>,
        dct_inverse_rows: super::dct_inverse_rows_on::<R>,
        feedback_int8: super::feedback_int8_on::<R>,
        hop_int8: super::hop_int8_on::<R>,
        encode_int8: super::encode_int8_on::<R>,
        reduce_int8: modes!(super::reduce_int8_on, R),
        decode_int8: modes!(super::decode_int8_on, R),
        encode_codebook: super::encode_codebook_on::<R>,
        encode_float: super::encode_float_on::<R>,
        decode_float: modes!(super::decode_float_on, R),
        encode_sign: super::encode_sign_on::<R>,
        decode_sign: modes!(super::decode_sign_on, R),
        encode_signmag: super::encode_signmag_on::<R>,
        decode_signmag: modes!(super::decode_signmag_on, R),
        encode_natural: super::encode_natural_on::<R>,
        decode_natural: modes!(super::decode_natural_on, R),
        filter_mag_ge: super::filter_mag_ge_on::<R>,
        lane_bound: super::lane_bound_on::<R>,
        filter_keys: super::filter_keys_on::<R>,
        filter_mag_ge_vals: super::filter_mag_ge_vals_on::<R>,
        retain_mag_ge: super::retain_mag_ge_on::<R>,
        filter_draw_lt_zeroing: super::filter_draw_lt_zeroing_on::<R>,
        count_draw_lt: super::count_draw_lt_on::<R>,
        draw_masks_into: super::draw_masks_into_on::<R>,
        compress_stored_masks: super::compress_stored_masks_on::<R>,
        lane_bound_pays: true,
    }
}

/// The table of the AVX2 or AVX-512 backend: the portable build for its instruction set,
/// with the routing table's choices over it (a hand-written kernel, or the AVX2 build on
/// the AVX-512 backend), one line per operation.
#[cfg(target_arch = "x86_64")]
fn x86_table<const K: u8>(mut k: Kernels) -> Kernels {
    use super::mode::{ADD, RESIDUAL, WRITE};
    let two = portable_table::<AVX2, AVX2>();
    let route = |op| routing::route::<K>(op, Call::ANY);
    // The portable source's AVX2 build where the table says AVX2 is faster.
    macro_rules! avx2_build {
        ($($op:ident: $row:expr),* $(,)?) => {
            $(if route($row) == X86::Avx2 {
                k.$op = two.$op;
            })*
        };
    }
    avx2_build!(
        decode_f32: Op::DecodeF32,
        decode_bf16: Op::DecodeBf16,
        feedback_form: Op::FeedbackForm,
        reduce_f32: Op::ReduceF32,
        reduce_bf16: Op::ReduceBf16,
    );
    k.encode_f16 = match route(Op::EncodeF16) {
        X86::Avx512 => x86_64::encode_f16_avx512,
        _ => x86_64::encode_f16_avx2,
    };
    // Writing and the residual mode follow `DecodeF16`'s row, adding `AddF16`'s; the
    // AVX-512 kernel has no residual mode (its backend's portable build runs it).
    for (m, row) in [
        (WRITE, Op::DecodeF16),
        (ADD, Op::AddF16),
        (RESIDUAL, Op::DecodeF16),
    ] {
        let m = m as usize;
        k.decode_f16[m] = match route(row) {
            X86::Avx512 if m != RESIDUAL as usize => modes!(x86_64::decode_f16_avx512)[m],
            X86::Avx512 => k.decode_f16[m],
            _ => modes!(x86_64::decode_f16_avx2)[m],
        };
    }
    k.hop_f16 = (route(Op::HopF16) == X86::Avx2).then_some(x86_64::hop_f16_avx2 as _);
    k.encode_bf16 = match route(Op::EncodeBf16) {
        X86::Avx512 => x86_64::encode_bf16_avx512,
        _ => x86_64::blocks::encode_bf16_avx2,
    };
    k.feedback_f16 = match route(Op::FeedbackF16) {
        X86::Avx512 => x86_64::feedback_f16_avx512,
        _ => x86_64::feedback_f16_avx2,
    };
    k.reduce_f16 = match route(Op::ReduceF16) {
        X86::Avx512 => modes!(x86_64::reduce_f16_avx512),
        _ => modes!(x86_64::reduce_f16_avx2),
    };
    k
}
