//! The vector width the x86 block loops are written against, and its two instruction
//! sets: [`Avx2`] (8 lanes of f32) and [`Avx512`] (16). A loop written once over
//! [`Lanes`] (see `loops`) compiles to the same instructions as a hand-written one at
//! each width: every method is `#[inline(always)]`, and the loops are instantiated only
//! inside `#[target_feature]` functions, into which they and the intrinsics they call
//! are inlined.

use core::arch::x86_64::*;

use crate::kernels::scalar::{INF_BITS, mode};

/// `|x|`'s bit mask.
const ABS: i32 = 0x7FFF_FFFF;

/// A vector width of f32 lanes and the operations the block loops need at it.
///
/// Closures in these methods and in the loops are `#[inline(always)]`: a closure is a
/// function of its own, compiled without the caller's instruction set unless it is
/// inlined into it (then every intrinsic in it is a call).
///
/// # Safety
/// Every method needs the instruction set of the implementing type (AVX2 and F16C for
/// [`Avx2`]; AVX-512F and AVX2 for [`Avx512`]): call them only where the CPU has it, as
/// the `#[target_feature]` kernels that instantiate the loops guarantee.
pub(super) unsafe trait Lanes {
    /// f32 lanes per vector.
    const N: usize;
    /// A vector of `N` f32.
    type F: Copy;
    /// A vector of `N` 32-bit integers.
    type I: Copy;

    /// `N` f32 from `p` (unaligned).
    ///
    /// # Safety
    /// The instruction set (see the trait); `p` valid for reads of `N` f32.
    unsafe fn load(p: *const f32) -> Self::F;
    /// `v` to `p` (unaligned).
    ///
    /// # Safety
    /// The instruction set; `p` valid for writes of `N` f32.
    unsafe fn store(p: *mut f32, v: Self::F);
    /// `x` in every lane.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn splat(x: f32) -> Self::F;
    /// `a + b`, lane by lane.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
    /// `a * b`, lane by lane.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
    /// `scalar::residual_of(p, d)`, lane by lane, operation for operation: `p - d` where
    /// that is finite, else `p` where `p` is finite, else 0.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn residual(p: Self::F, d: Self::F) -> Self::F;
    /// Zero in every integer lane.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn zero() -> Self::I;
    /// `max(m, |v|'s bit pattern)`, lane by lane (signed: the patterns are below 2^31).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn max_abs_bits(m: Self::I, v: Self::F) -> Self::I;
    /// The largest of the lanes of `m` (each below 2^31).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn lanes_max(m: Self::I) -> u32;
    /// `N` signed bytes from `p`, as f32.
    ///
    /// # Safety
    /// The instruction set; `p` valid for reads of `N` bytes.
    unsafe fn load_i8(p: *const u8) -> Self::F;
    /// The 16 half-precision floats of `h` converted to f32 (exact), handed to
    /// `f(offset, v)` `N` at a time, `offset` counting elements from the first.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn halves(h: __m256i, f: impl FnMut(usize, Self::F));
    /// The definition's NaN (`0x7FC0_0000` with `v`'s sign) in the lanes of `v` that hold
    /// a NaN code's conversion: with `e4m3`, `±480` (E4M3's `0x7F` and `0xFF` after the
    /// shift to f16 and times 2^8); otherwise, E5M2, a NaN with a payload.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn fp8_nans(v: Self::F, e4m3: bool) -> Self::F;

    /// `v` put at `o` (`N` elements) as mode `M` says: written, added to what is there,
    /// or (the residual mode) what is there, `p`, replaced by its residual against `v`.
    ///
    /// # Safety
    /// The instruction set; `o` valid for reads and writes of `N` f32.
    #[inline(always)]
    unsafe fn put<const M: u8>(o: *mut f32, v: Self::F) {
        // SAFETY: the caller's contract.
        unsafe {
            let v = match M {
                mode::WRITE => v,
                mode::ADD => Self::add(Self::load(o), v),
                _ => Self::residual(Self::load(o), v),
            };
            Self::store(o, v);
        }
    }
}

/// The level quantisers of int8 and of the sign-magnitude codecs (qsgd, ternary) at a
/// width: steps of four vectors (`4 N` elements), with the counter hash's draws for
/// stochastic rounding, the levels and their narrowing to bytes. Implemented beside each
/// width's other kernels (`blocks` for [`Avx2`], `blocks512` for [`Avx512`]).
///
/// # Safety
/// As [`Lanes`]: every method needs the implementing type's instruction set.
pub(super) unsafe trait Quantise: Lanes {
    /// The draws of a block's steps, made once per encode call.
    type Draws<'a>;

    /// Ready for the block from global index `start` (inside one key's window).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn begin(d: &mut Self::Draws<'_>, start: u64);
    /// The draws of the `4 N` indices from `at` (mod 2^32), `N` per vector.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn step(d: &mut Self::Draws<'_>, at: u32) -> [Self::I; 4];
    /// The signed int8 levels of `v` with level multiplier `inv` (in every lane): with
    /// nearest rounding `v * inv` rounded half to even (the conversion's default mode,
    /// which Rust code never changes; sign-symmetric) and clamped to `[-127, 127]`; with
    /// `STOCHASTIC` the oracle's `scalar::level` of `|v|` with draws `h`, operation for
    /// operation, clamped to 127, with `v`'s sign (`-0.0` has level 0).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn level<const STOCHASTIC: bool>(v: Self::F, h: Self::I, inv: Self::F) -> Self::I {
        // SAFETY: the caller's contract.
        unsafe {
            if STOCHASTIC {
                Self::signed_level(v, h, inv, Self::top(127))
            } else {
                Self::nearest_int8(v, inv)
            }
        }
    }
    /// `levels` in every lane, the `top` of [`Quantise::signed_level`].
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn top(levels: u32) -> Self::I;
    /// The oracle's `scalar::level` of `|v|` with multiplier `inv` and draws `h`,
    /// operation for operation, clamped to `top`, with `v`'s sign (`-0.0` has level 0).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn signed_level(v: Self::F, h: Self::I, inv: Self::F, top: Self::I) -> Self::I;
    /// `v * inv` rounded half to even (the conversion's default mode, which Rust code
    /// never changes; sign-symmetric) and clamped to `[-127, 127]`.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn nearest_int8(v: Self::F, inv: Self::F) -> Self::I;
    /// `v - q * step` (`q` converted exactly).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn minus_decoded(v: Self::F, q: Self::I, step: Self::F) -> Self::F;
    /// The `4 N` levels of `q` (in `[-127, 127]`) as bytes at `p`, in element order.
    ///
    /// # Safety
    /// The instruction set; `p` valid for writes of `4 N` bytes.
    unsafe fn store_codes(p: *mut u8, q: [Self::I; 4]);
    /// Stores the `4 N` signed levels of `q` (in `[-127, 127]`) as sign-magnitude codes
    /// of `BITS` (2, 4 or 8) bits at `p`, `N BITS / 2` bytes: the magnitude, with bit
    /// `BITS - 1` set where the level is negative (a zero level has no sign, as in the
    /// oracle), packed low bits first.
    ///
    /// # Safety
    /// The instruction set; `p` valid for `N BITS / 2` bytes.
    unsafe fn store_signmag<const BITS: u32>(p: *mut u8, q: [Self::I; 4]);
}

/// AVX2 with F16C: 8 lanes.
pub(super) struct Avx2;

/// AVX-512F, with AVX2: 16 lanes.
pub(super) struct Avx512;

// SAFETY: every method needs AVX2 and F16C at most, the trait's contract.
unsafe impl Lanes for Avx2 {
    const N: usize = 8;
    type F = __m256;
    type I = __m256i;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn residual(p: __m256, d: __m256) -> __m256 {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            // Written out: no closure (see the trait's docs).
            let inf = _mm256_set1_epi32(INF_BITS as i32);
            let e = _mm256_sub_ps(p, d);
            let (pi, ei) = (_mm256_castps_si256(p), _mm256_castps_si256(e));
            let p_nf = _mm256_cmpeq_epi32(_mm256_and_si256(pi, inf), inf);
            let e_nf = _mm256_cmpeq_epi32(_mm256_and_si256(ei, inf), inf);
            let fallback = _mm256_andnot_ps(_mm256_castsi256_ps(p_nf), p);
            _mm256_blendv_ps(e, fallback, _mm256_castsi256_ps(e_nf))
        }
    }
    #[inline(always)]
    unsafe fn zero() -> __m256i {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    unsafe fn max_abs_bits(m: __m256i, v: __m256) -> __m256i {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            let abs = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(ABS));
            _mm256_max_epi32(m, abs)
        }
    }
    #[inline(always)]
    unsafe fn lanes_max(m: __m256i) -> u32 {
        let mut lanes = [0u32; 8];
        // SAFETY: the caller's contract (AVX); `lanes` is 8 u32, one unaligned __m256i.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), m) };
        lanes.into_iter().max().unwrap_or(0)
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract (AVX2); 8 bytes, the low 64 bits of one __m128i.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn halves(h: __m256i, mut f: impl FnMut(usize, __m256)) {
        // SAFETY: the caller's contract (AVX2, F16C).
        unsafe {
            f(0, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
            f(8, _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)));
        }
    }
    #[inline(always)]
    unsafe fn fp8_nans(v: __m256, e4m3: bool) -> __m256 {
        // SAFETY: the caller's contract (AVX).
        unsafe {
            let sign = _mm256_set1_ps(-0.0);
            let special = if e4m3 {
                let a = _mm256_andnot_ps(sign, v);
                _mm256_cmp_ps::<_CMP_EQ_OQ>(a, _mm256_set1_ps(480.0))
            } else {
                _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)
            };
            let nan = _mm256_set1_ps(f32::from_bits(0x7FC0_0000));
            _mm256_blendv_ps(v, _mm256_or_ps(_mm256_and_ps(v, sign), nan), special)
        }
    }
}

// SAFETY: every method needs AVX-512F at most, the trait's contract.
unsafe impl Lanes for Avx512 {
    const N: usize = 16;
    type F = __m512;
    type I = __m512i;

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn residual(p: __m512, d: __m512) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe {
            // Written out: no closure (see the trait's docs).
            let inf = _mm512_set1_epi32(INF_BITS as i32);
            let e = _mm512_sub_ps(p, d);
            let (pi, ei) = (_mm512_castps_si512(p), _mm512_castps_si512(e));
            let p_finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(pi, inf), inf);
            let e_finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(ei, inf), inf);
            let fallback = _mm512_maskz_mov_ps(p_finite, p);
            _mm512_mask_mov_ps(fallback, e_finite, e)
        }
    }
    #[inline(always)]
    unsafe fn zero() -> __m512i {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn max_abs_bits(m: __m512i, v: __m512) -> __m512i {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe {
            let abs = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(ABS));
            _mm512_max_epi32(m, abs)
        }
    }
    #[inline(always)]
    unsafe fn lanes_max(m: __m512i) -> u32 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_reduce_max_epi32(m) as u32 }
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const u8) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F); 16 bytes, one unaligned __m128i.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))) }
    }
    #[inline(always)]
    unsafe fn halves(h: __m256i, mut f: impl FnMut(usize, __m512)) {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { f(0, _mm512_cvtph_ps(h)) }
    }
    #[inline(always)]
    unsafe fn fp8_nans(v: __m512, e4m3: bool) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe {
            let special = if e4m3 {
                _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(v), _mm512_set1_ps(480.0))
            } else {
                _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v)
            };
            let bits = _mm512_castps_si512(v);
            let sign = _mm512_set1_epi32(i32::MIN);
            let nans =
                _mm512_or_si512(_mm512_and_si512(bits, sign), _mm512_set1_epi32(0x7FC0_0000));
            _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, special, nans))
        }
    }
}

/// The nearest-rounding fp8 and fp4 quantiser at a width (`fp8::nearest_in_range` in
/// 32-bit lanes) and its narrowing to code bytes. Implemented beside each width's other
/// kernels (`blocks` for [`Avx2`], `blocks512` for [`Avx512`]).
///
/// # Safety
/// As [`Lanes`]: every method needs the implementing type's instruction set.
pub(super) unsafe trait FloatCodes: Lanes {
    /// A format's constants in registers.
    type Nearest;

    /// The constants of format `f` (a mantissa of 0 to 3 bits), the code's sign in bit 7,
    /// or in bit 3 with `FOUR`.
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn nearest<const FOUR: bool>(f: crate::kernels::fp8::Format) -> Self::Nearest;
    /// `fp8::nearest_in_range` of the quotients of `v` (`v * by` when `MULTIPLY`, else
    /// `v / by`; `by` positive and finite) in the format of `n` with `M` mantissa bits,
    /// operation for operation: the count of grid spacings by adding a power of two whose
    /// ulp is the spacing, plus `2^M` per binade above the subnormal one; for E3M0 (`M`
    /// 0, where a tie goes to the even code, not the even count) the f32 exponent rounded
    /// by integer addition, and below the smallest normal the count of it. The clamp of
    /// the quotient to ±FMAX is a minimum of the code magnitude instead (the conversion is
    /// monotonic and FMAX is on the grid); the sign is the element's (the quotient's).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn code<const M: u32, const MULTIPLY: bool, const FOUR: bool>(
        n: &Self::Nearest,
        v: Self::F,
        by: Self::F,
    ) -> Self::I;
    /// Stores the `4 N` codes of `q` (each in `0..=255`, or `0..=15` with `FOUR`) at `p`
    /// in element order: one byte each, or with `FOUR` two per byte, the even element in
    /// the low nibble (`2 N` bytes).
    ///
    /// # Safety
    /// The instruction set; `p` valid for `4 N` bytes (`2 N` with `FOUR`).
    unsafe fn store_float_codes<const FOUR: bool>(p: *mut u8, q: [Self::I; 4]);
    /// The largest lane of each 8-lane group of `m`'s pairs of 8: `m` itself at 8 lanes,
    /// the maximum of its halves at 16 (signed 32-bit lanes).
    ///
    /// # Safety
    /// The instruction set.
    unsafe fn max8(m: Self::I) -> __m256i;
}
