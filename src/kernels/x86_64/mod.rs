//! x86-64 kernels that need instructions the auto-vectoriser does not emit: the F16C and
//! AVX-512 f32 <-> binary16 conversions, and the compare-and-compress filter of top-k
//! (a compare to a lane mask, `movemask` on AVX2 and mask registers on AVX-512, which
//! the vectoriser does not form from the portable flag loop).
//!
//! Callers hold a [`super::Backend`] of kind `Avx2` or `Avx512`, whose constructor checked
//! the CPU; that check is what makes calling these `#[target_feature]` functions sound.
//! Hardware conversions round to nearest even and quiet NaNs exactly as the scalar oracle
//! does; the exhaustive tests (tests/exhaustive.rs) check all 2^32 inputs per backend.

use core::arch::x86_64::*;

pub mod blocks;
pub mod blocks512;
mod lanes;
mod loops;

use super::portable::{LaneFrames, REDUCE_LANES, SignLanes, compress_masks_vals};
use super::scalar::{self, mode};

const ABS: i32 = 0x7FFF_FFFF;

/// f32 to binary16 with F16C, 8 lanes. Returns whether any input was NaN or ±Inf.
/// Writes `2 * min(x.len(), out.len() / 2)` bytes.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn encode_f16_avx2(x: &[f32], out: &mut [u8]) -> bool {
    let n = x.len().min(out.len() / 2);
    let n8 = n - n % 8;
    let mask = _mm256_set1_epi32(ABS);
    let mut mx = _mm256_setzero_si256();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n <= x.len(), and 2 * (i + 8) <= 2 * n <= out.len(); unaligned
        // loads and stores are used.
        unsafe {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(v), mask));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm_storeu_si128(out.as_mut_ptr().add(2 * i).cast::<__m128i>(), h);
        }
        i += 8;
    }
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 bytes, the size of one __m256i; unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), mx) };
    let tail = scalar::encode_u16(&x[n8..n], &mut out[2 * n8..2 * n], scalar::f32_to_f16);
    tail || lanes.iter().any(|&v| v >= scalar::INF_BITS)
}

/// fp16's fused ring hop with F16C, 8 lanes: `out` gets the binary16 codes of
/// `local + decode(input)`, exactly as a `mode::ADD` [`decode_f16_avx2`] onto a copy of
/// `local` and [`encode_f16_avx2`] of it would write them, in one pass; true if any sum
/// is NaN or ±Inf. `input` and `out` hold two bytes per element of `local`.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn hop_f16_avx2(local: &[f32], input: &[u8], out: &mut [u8]) -> bool {
    let n = local.len();
    assert!(input.len() == 2 * n && out.len() == 2 * n);
    let n8 = n - n % 8;
    let mask = _mm256_set1_epi32(ABS);
    let mut mx = _mm256_setzero_si256();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n = local.len(), and 2 * (i + 8) <= input.len() = out.len();
        // unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(input.as_ptr().add(2 * i).cast::<__m128i>());
            let s = _mm256_add_ps(_mm256_loadu_ps(local.as_ptr().add(i)), _mm256_cvtph_ps(h));
            // The rest as `encode_f16_avx2` does it.
            mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(s), mask));
            let c = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(s);
            _mm_storeu_si128(out.as_mut_ptr().add(2 * i).cast::<__m128i>(), c);
        }
        i += 8;
    }
    // The tail (under 8 elements) by the definition.
    let mut t = [0f32; 8];
    let t = &mut t[..n - n8];
    t.copy_from_slice(&local[n8..]);
    scalar::decode_u16::<{ scalar::mode::ADD }>(&input[2 * n8..], t, scalar::f16_to_f32);
    let tail = scalar::encode_u16(t, &mut out[2 * n8..], scalar::f32_to_f16);
    tail || blocks::lanes_max(mx) >= scalar::INF_BITS
}

/// binary16 to f32 with F16C, 8 lanes, stored as mode `M` says (written, added, or as
/// the residual of the `p` in `out`: `blocks::put8`).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn decode_f16_avx2<const M: u8>(p: &[u8], out: &mut [f32]) {
    let n = out.len().min(p.len() / 2);
    let n8 = n - n % 8;
    // The 8 values at `out[$j..]`, for `$j + 8 <= n8`.
    macro_rules! put_eight {
        ($j:expr) => {
            let j = $j;
            // SAFETY: 2 * (j + 8) <= 2 * n8 <= p.len(); unaligned load.
            let h = unsafe { _mm_loadu_si128(p.as_ptr().add(2 * j).cast::<__m128i>()) };
            blocks::put8::<M>(out, j, _mm256_cvtph_ps(h));
        };
    }
    let mut i = 0;
    // 32 values a turn, then 8: the loop's own overhead a quarter of what it was, and its
    // speed less tied to where it falls in the code (decode_add at 64 Ki moved between 43
    // and 51 GB/s on a Zen 3 with the placement of a loop of 8 alone).
    while i + 32 <= n8 {
        for k in [0, 8, 16, 24] {
            put_eight!(i + k);
        }
        i += 32;
    }
    while i < n8 {
        put_eight!(i);
        i += 8;
    }
    scalar::decode_u16::<M>(&p[2 * n8..2 * n], &mut out[n8..n], scalar::f16_to_f32);
}

/// f32 to binary16 with AVX-512, 16 lanes. Same contract as [`encode_f16_avx2`].
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub unsafe fn encode_f16_avx512(x: &[f32], out: &mut [u8]) -> bool {
    let n = x.len().min(out.len() / 2);
    let n16 = n - n % 16;
    let mask = _mm512_set1_epi32(ABS);
    let mut mx = _mm512_setzero_si512();
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= n <= x.len(), and 2 * (i + 16) <= out.len(); unaligned accesses.
        unsafe {
            let v = _mm512_loadu_ps(x.as_ptr().add(i));
            mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(v), mask));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_si256(out.as_mut_ptr().add(2 * i).cast::<__m256i>(), h);
        }
        i += 16;
    }
    let big = _mm512_reduce_max_epu32(mx) >= scalar::INF_BITS;
    // SAFETY: the caller guarantees AVX2 and F16C (implied by this function's contract).
    let tail = unsafe { encode_f16_avx2(&x[n16..n], &mut out[2 * n16..2 * n]) };
    big || tail
}

/// binary16 to f32 with AVX-512, 16 lanes; adds into `out` when `M` is
/// [`mode::ADD`], writes for [`mode::WRITE`] (the residual mode is not handled here).
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub unsafe fn decode_f16_avx512<const M: u8>(p: &[u8], out: &mut [f32]) {
    let n = out.len().min(p.len() / 2);
    let n16 = n - n % 16;
    let mut i = 0;
    while i < n16 {
        // SAFETY: 2 * (i + 16) <= p.len() and i + 16 <= out.len(); unaligned accesses.
        unsafe {
            let h = _mm256_loadu_si256(p.as_ptr().add(2 * i).cast::<__m256i>());
            let mut v = _mm512_cvtph_ps(h);
            let o = out.as_mut_ptr().add(i);
            if M == mode::ADD {
                v = _mm512_add_ps(_mm512_loadu_ps(o), v);
            }
            _mm512_storeu_ps(o, v);
        }
        i += 16;
    }
    // SAFETY: the caller guarantees AVX2 and F16C.
    unsafe { decode_f16_avx2::<M>(&p[2 * n16..2 * n], &mut out[n16..n]) };
}

/// The sign group kernel (see `portable::encode_sign_blocks`) with AVX2: 16 elements per
/// step in two 8-lane registers (lanes 0..8 and 8..16 of the oracle's order), sign bits by
/// `movemask`. Returns the number of elements handled, `16 * (xb.len() / 16)`.
///
/// # Safety
/// The CPU must support AVX2; `cb.len() >= xb.len() / 8`.
#[target_feature(enable = "avx2")]
#[inline]
pub unsafe fn sign_groups_avx2(xb: &[f32], cb: &mut [u8], lanes: &mut SignLanes) -> usize {
    let n = xb.len() / 16 * 16;
    assert!(cb.len() >= n / 8);
    let abs = _mm256_set1_epi32(ABS);
    // SAFETY: `sum` and `max` are 16 four-byte values; each half is one unaligned __m256.
    let (mut s0, mut s1, mut m0, mut m1) = unsafe {
        (
            _mm256_loadu_ps(lanes.sum.as_ptr()),
            _mm256_loadu_ps(lanes.sum.as_ptr().add(8)),
            _mm256_loadu_si256(lanes.max.as_ptr().cast()),
            _mm256_loadu_si256(lanes.max.as_ptr().add(8).cast()),
        )
    };
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= xb.len() and i / 8 + 2 <= n / 8 <= cb.len(); unaligned
        // loads, a 2-byte unaligned store.
        unsafe {
            let a = _mm256_loadu_ps(xb.as_ptr().add(i));
            let b = _mm256_loadu_ps(xb.as_ptr().add(i + 8));
            let aa = _mm256_and_si256(_mm256_castps_si256(a), abs);
            let ba = _mm256_and_si256(_mm256_castps_si256(b), abs);
            s0 = _mm256_add_ps(s0, _mm256_castsi256_ps(aa));
            s1 = _mm256_add_ps(s1, _mm256_castsi256_ps(ba));
            m0 = _mm256_max_epu32(m0, aa);
            m1 = _mm256_max_epu32(m1, ba);
            let bits = (_mm256_movemask_ps(a) as u32 | (_mm256_movemask_ps(b) as u32) << 8) as u16;
            cb.as_mut_ptr()
                .add(i / 8)
                .cast::<u16>()
                .write_unaligned(bits.to_le());
        }
        i += 16;
    }
    // SAFETY: as for the loads above.
    unsafe {
        _mm256_storeu_ps(lanes.sum.as_mut_ptr(), s0);
        _mm256_storeu_ps(lanes.sum.as_mut_ptr().add(8), s1);
        _mm256_storeu_si256(lanes.max.as_mut_ptr().cast(), m0);
        _mm256_storeu_si256(lanes.max.as_mut_ptr().add(8).cast(), m1);
    }
    n
}

/// The sign group kernel with AVX-512: one 16-lane register (the oracle's order), sign
/// bits by a signed compare into a mask. See [`sign_groups_avx2`].
///
/// # Safety
/// The CPU must support AVX-512F; `cb.len() >= xb.len() / 8`.
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn sign_groups_avx512(xb: &[f32], cb: &mut [u8], lanes: &mut SignLanes) -> usize {
    let n = xb.len() / 16 * 16;
    assert!(cb.len() >= n / 8);
    let abs = _mm512_set1_epi32(ABS);
    let zero = _mm512_setzero_si512();
    // SAFETY: `sum` and `max` are 16 four-byte values, one unaligned __m512 each.
    let (mut s, mut m) = unsafe {
        (
            _mm512_loadu_ps(lanes.sum.as_ptr()),
            _mm512_loadu_si512(lanes.max.as_ptr().cast()),
        )
    };
    let mut i = 0;
    while i < n {
        // SAFETY: i + 16 <= n <= xb.len() and i / 8 + 2 <= cb.len(); unaligned accesses.
        unsafe {
            let v = _mm512_loadu_si512(xb.as_ptr().add(i).cast());
            let a = _mm512_and_si512(v, abs);
            s = _mm512_add_ps(s, _mm512_castsi512_ps(a));
            m = _mm512_max_epu32(m, a);
            let bits: u16 = _mm512_cmplt_epi32_mask(v, zero);
            cb.as_mut_ptr()
                .add(i / 8)
                .cast::<u16>()
                .write_unaligned(bits.to_le());
        }
        i += 16;
    }
    // SAFETY: as for the loads above.
    unsafe {
        _mm512_storeu_ps(lanes.sum.as_mut_ptr(), s);
        _mm512_storeu_si512(lanes.max.as_mut_ptr().cast(), m);
    }
    n
}

/// A sign block encoder (`portable::encode_sign_blocks` on a group kernel) compiled with
/// the group kernel's instruction set as a whole, so that the per-block work around it
/// (the lane state, its maximum and the ordered lane sum) is vectorised too and stays in
/// registers. Compiled for the baseline target it was a sixth of the time at the default
/// block of 1024 with AVX2, and made the AVX-512 backend 1.3 to 3.2 times slower than the
/// AVX2 one at blocks of 16 to 100. `codes` need not be zeroed.
macro_rules! sign_encoder {
    ($(#[$doc:meta])* $name:ident, $features:literal, $groups:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $name(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
            super::portable::encode_sign_blocks(
                x,
                block,
                steps,
                codes,
                #[inline(always)]
                |xb, cb, l| {
                    // SAFETY: this function's caller guarantees the group kernel's
                    // instruction set; `cb` holds the block's `ceil(xb.len() / 8)` code
                    // bytes.
                    unsafe { $groups(xb, cb, l) }
                },
            )
        }
    };
}

sign_encoder!(
    /// Sign block encode with AVX2 (on [`sign_groups_avx2`]; see `sign_encoder!`).
    encode_sign_avx2,
    "avx2",
    sign_groups_avx2
);
sign_encoder!(
    /// Sign block encode with AVX-512 (on [`sign_groups_avx512`]; see `sign_encoder!`).
    encode_sign_avx512,
    "avx512f,avx2",
    sign_groups_avx512
);

/// f32 to bfloat16 with AVX-512, 32 elements per step: round to nearest even in integer
/// arithmetic, NaN quieted (the oracle's rule, not `vcvtneps2bf16`, which flushes
/// subnormals), the high halves of 32 lanes gathered by one `vpermt2w` (a memory-destination
/// `vpmovdw` is several times slower on this CPU). Returns whether any input was NaN or ±Inf.
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn encode_bf16_avx512(x: &[f32], out: &mut [u8]) -> bool {
    let n = x.len().min(out.len() / 2);
    let n32 = n - n % 32;
    let abs = _mm512_set1_epi32(ABS);
    let inf = _mm512_set1_epi32(scalar::INF_BITS as i32);
    let bias = _mm512_set1_epi32(0x7FFF);
    let one = _mm512_set1_epi32(1);
    let quiet = _mm512_set1_epi32(0x0040_0000);
    // The high 16-bit halves of 32 lanes: words 1, 3, .., 31 of `a`, then of `b` (32 + ..).
    let high = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
        17, 15, 13, 11, 9, 7, 5, 3, 1,
    );
    let mut mx = _mm512_setzero_si512();
    // The bf16 code of each lane, in the lane's high 16 bits.
    let mut bf16 = |u: __m512i| {
        let a = _mm512_and_si512(u, abs);
        mx = _mm512_max_epu32(mx, a);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(u), one);
        let rounded = _mm512_add_epi32(u, _mm512_add_epi32(bias, odd));
        let nan = _mm512_or_si512(u, quiet);
        _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(a, inf), rounded, nan)
    };
    let mut i = 0;
    while i < n32 {
        // SAFETY: i + 32 <= n <= x.len(), and 2 * (i + 32) <= out.len(); unaligned accesses.
        unsafe {
            let lo = bf16(_mm512_loadu_si512(x.as_ptr().add(i).cast()));
            let hi = bf16(_mm512_loadu_si512(x.as_ptr().add(i + 16).cast()));
            let packed = _mm512_permutex2var_epi16(lo, high, hi);
            _mm512_storeu_si512(out.as_mut_ptr().add(2 * i).cast(), packed);
        }
        i += 32;
    }
    let big = _mm512_reduce_max_epu32(mx) >= scalar::INF_BITS;
    let tail = scalar::encode_u16(&x[n32..n], &mut out[2 * n32..2 * n], scalar::f32_to_bf16);
    big || tail
}

/// The fused error-feedback step of fp16 (see `scalar::feedback_u16`) with F16C, 8 lanes.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn feedback_f16_avx2(
    r: &mut [f32],
    g: &[f32],
    beta: f32,
    gamma: f32,
    out: &mut [u8],
) -> bool {
    let n = r.len().min(g.len()).min(out.len() / 2);
    let n8 = n - n % 8;
    let (vb, vg) = (_mm256_set1_ps(beta), _mm256_set1_ps(gamma));
    let abs = _mm256_set1_epi32(ABS);
    let mut mx = _mm256_setzero_si256();
    let mut i = 0;
    while i < n8 {
        // SAFETY: i + 8 <= n, which bounds r, g and out / 2; unaligned accesses.
        unsafe {
            let ro = r.as_mut_ptr().add(i);
            let p = _mm256_add_ps(
                _mm256_mul_ps(vb, _mm256_loadu_ps(ro)),
                _mm256_mul_ps(vg, _mm256_loadu_ps(g.as_ptr().add(i))),
            );
            let pi = _mm256_castps_si256(p);
            mx = _mm256_max_epu32(mx, _mm256_and_si256(pi, abs));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p);
            _mm_storeu_si128(out.as_mut_ptr().add(2 * i).cast::<__m128i>(), h);
            _mm256_storeu_ps(ro, blocks::residual8(p, _mm256_cvtph_ps(h)));
        }
        i += 8;
    }
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 bytes, the size of one __m256i; unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), mx) };
    let tail = scalar::feedback_u16(
        &mut r[n8..n],
        &g[n8..n],
        beta,
        gamma,
        &mut out[2 * n8..2 * n],
        scalar::f32_to_f16,
        scalar::f16_to_f32,
    );
    tail || lanes.iter().any(|&v| v >= scalar::INF_BITS)
}

/// The fused error-feedback step of fp16 with AVX-512, 16 lanes.
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub unsafe fn feedback_f16_avx512(
    r: &mut [f32],
    g: &[f32],
    beta: f32,
    gamma: f32,
    out: &mut [u8],
) -> bool {
    let n = r.len().min(g.len()).min(out.len() / 2);
    let n16 = n - n % 16;
    let (vb, vg) = (_mm512_set1_ps(beta), _mm512_set1_ps(gamma));
    let abs = _mm512_set1_epi32(ABS);
    let inf = _mm512_set1_epi32(scalar::INF_BITS as i32);
    let mut mx = _mm512_setzero_si512();
    let mut i = 0;
    while i < n16 {
        // SAFETY: i + 16 <= n, which bounds r, g and out / 2; unaligned accesses.
        unsafe {
            let ro = r.as_mut_ptr().add(i);
            let p = _mm512_add_ps(
                _mm512_mul_ps(vb, _mm512_loadu_ps(ro)),
                _mm512_mul_ps(vg, _mm512_loadu_ps(g.as_ptr().add(i))),
            );
            let pi = _mm512_castps_si512(p);
            mx = _mm512_max_epu32(mx, _mm512_and_si512(pi, abs));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(p);
            _mm256_storeu_si256(out.as_mut_ptr().add(2 * i).cast::<__m256i>(), h);
            let e = _mm512_sub_ps(p, _mm512_cvtph_ps(h));
            let e_ok = _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(e), inf), inf);
            let p_ok = _mm512_cmpneq_epi32_mask(_mm512_and_si512(pi, inf), inf);
            let fallback = _mm512_maskz_mov_ps(p_ok, p);
            _mm512_storeu_ps(ro, _mm512_mask_blend_ps(e_ok, fallback, e));
        }
        i += 16;
    }
    let big = _mm512_reduce_max_epu32(mx) >= scalar::INF_BITS;
    // SAFETY: the caller guarantees AVX2 and F16C.
    let tail = unsafe {
        feedback_f16_avx2(
            &mut r[n16..n],
            &g[n16..n],
            beta,
            gamma,
            &mut out[2 * n16..2 * n],
        )
    };
    big || tail
}

/// The keep mask of a short tail `x` (at most 64 elements): bit `j` set when `|x[j]|`
/// bits `>= t`, one element at a time.
#[inline(always)]
fn mag_mask_tail(x: &[f32], t: u32) -> u64 {
    x.iter().enumerate().fold(0u64, |m, (j, v)| {
        m | (((v.to_bits() & ABS as u32) >= t) as u64) << j
    })
}

/// Compare and compress with AVX2, 8 lanes: `super::filter_mag_ge`'s contract
/// (indices of `|x|` bits `>= t`, ascending, 64 elements per step while `idx` has room
/// for 64 more).
///
/// Kept elements of a gradient cluster (by layer, by feature), so the branchy compress
/// loop is predicted well here; [`compress_masks_avx2`] measured 10% slower on synthetic
/// gradients at a keep rate of 1% (and 30% faster at 10%).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn filter_mag_ge_avx2(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    filter_mag_avx2(x, t, idx, None)
}

/// [`filter_mag_ge_avx2`] that also writes the kept elements' bits to `vals`: the
/// contract of `super::filter_mag_ge_vals`.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn filter_mag_ge_vals_avx2(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    vals: &mut [u32],
) -> (usize, usize) {
    filter_mag_avx2(x, t, idx, Some(vals))
}

/// The filter of [`filter_mag_ge_avx2`], writing values too when `vals` is given.
#[target_feature(enable = "avx2")]
#[inline]
fn filter_mag_avx2(x: &[f32], t: u32, idx: &mut [u32], vals: Option<&mut [u32]>) -> (usize, usize) {
    if t > ABS as u32 {
        // No magnitude key exceeds 0x7FFF_FFFF: nothing is kept.
        return (x.len(), 0);
    }
    // Keys are below 2^31, so a signed compare against t - 1 is `key >= t` (t = 0 gives
    // -1, which every key exceeds).
    let below = _mm256_set1_epi32((t as i32).wrapping_sub(1));
    let abs = _mm256_set1_epi32(ABS);
    compress_masks_vals(x.len(), idx, vals.map(|v| (x, v)), |done, len| {
        if len < 64 {
            return mag_mask_tail(&x[done..done + len], t);
        }
        let mut m = 0u64;
        for q in 0..8 {
            // SAFETY: done + 8 q + 8 <= done + 64 <= x.len(); unaligned load.
            let v = unsafe { _mm256_loadu_si256(x.as_ptr().add(done + 8 * q).cast()) };
            let ge = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs), below);
            m |= (_mm256_movemask_ps(_mm256_castsi256_ps(ge)) as u8 as u64) << (8 * q);
        }
        m
    })
}

/// Entries of the local index buffer of [`compress_masks_avx2`]; a call stops when it has
/// no room for 64 more.
const COMPRESS_CAP: usize = 1024;

/// For each 8-bit keep mask, the positions of its set bits in ascending order, one per
/// byte from the lowest (the rest 0).
const COMPRESS8: [u64; 256] = {
    let mut table = [0u64; 256];
    let mut m = 0;
    while m < 256 {
        let (mut k, mut bit) = (0, 0);
        while bit < 8 {
            if (m >> bit) & 1 == 1 {
                table[m] |= (bit as u64) << (8 * k);
                k += 1;
            }
            bit += 1;
        }
        m += 1;
    }
    table
};

/// `portable::compress_masks` (its contract, and so the filters') without a branch on the
/// mask bits, for the random-k draw filter, whose kept elements are independent draws: the
/// loop over set bits there is mispredicted about once per group of 64 at keep rates of
/// 1%, which cost a third of the filter's time. Masks with at
/// most two bits get two unconditional writes; denser ones store 8 lanes per byte of the
/// mask from [`COMPRESS8`]. Both write past the kept entries, so they write to a local
/// buffer that is copied out at the end: nothing in `idx` past the reported length is
/// touched. `rare` (a hint: most masks are empty) skips empty masks with a branch.
#[target_feature(enable = "avx2,popcnt,bmi1")]
#[inline]
pub(super) fn compress_masks_avx2(
    n: usize,
    idx: &mut [u32],
    rare: bool,
    mut mask: impl FnMut(usize, usize) -> u64,
) -> (usize, usize) {
    let mut local = [0u32; COMPRESS_CAP];
    let cap = idx.len().min(COMPRESS_CAP);
    let (mut done, mut count) = (0, 0);
    while done < n && cap - count >= 64 {
        let len = (n - done).min(64);
        let m = mask(done, len);
        // Indices fit in u32: n <= 2^32 (the filters' contract).
        let base = done as u32;
        done += len;
        if rare && m == 0 {
            continue;
        }
        let kept = m.count_ones() as usize;
        let out: &mut [u32; 64] = (&mut local[count..count + 64])
            .try_into()
            .expect("64 entries");
        if kept <= 2 {
            // An empty mask's trailing-zero count is 64; such an entry lies at or past
            // `count + kept`, so it is overwritten or never copied out.
            out[0] = base.wrapping_add(m.trailing_zeros());
            out[1] = base.wrapping_add((m & m.wrapping_sub(1)).trailing_zeros());
        } else {
            let mut c = 0;
            for q in 0..8 {
                let bits = (m >> (8 * q)) as u8;
                let pos = _mm_cvtsi64_si128(COMPRESS8[bits as usize] as i64);
                let at = _mm256_set1_epi32(base.wrapping_add(8 * q) as i32);
                let v = _mm256_add_epi32(at, _mm256_cvtepu8_epi32(pos));
                let lanes = &mut out[c..c + 8];
                // SAFETY: `lanes` is 8 u32, one unaligned __m256i.
                unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), v) };
                c += bits.count_ones() as usize;
            }
        }
        count += kept;
    }
    idx[..count].copy_from_slice(&local[..count]);
    (done, count)
}

/// The indices of the set bits of stored keep masks (bit `i % 64` of `masks[i / 64]`
/// for element `i < n`), written to `idx` as the filters write theirs; returns
/// `(consumed, written)`. `rare` as for [`compress_masks_avx2`].
///
/// # Safety
/// The CPU must support AVX2, POPCNT and BMI1 (the x86-64-v3 level that the `Avx2`
/// backend detects).
#[target_feature(enable = "avx2,popcnt,bmi1")]
pub unsafe fn compress_stored_masks_avx2(
    masks: &[u64],
    n: usize,
    idx: &mut [u32],
    rare: bool,
) -> (usize, usize) {
    compress_masks_avx2(n, idx, rare, |done, _| masks[done / 64])
}

/// The positions and magnitude keys of the elements of `x` whose key is at least `t`, by
/// a compress of 16 lanes at a time (no branch per element): the contract of
/// `super::filter_keys` (`idx` and `keys` hold at least `x.len() + 16`).
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512DQ and POPCNT (the AVX-512 backend's detection
/// checks all three).
#[target_feature(enable = "avx512f,avx512dq,popcnt")]
pub unsafe fn filter_keys_avx512(x: &[f32], t: u32, idx: &mut [u32], keys: &mut [u32]) -> usize {
    let n = x.len();
    assert!(idx.len() >= n + 16 && keys.len() >= n + 16 && n <= u32::MAX as usize);
    // key >= t where (t - 1) - key, in wrapping i32, is negative: keys are below 2^31,
    // so t is taken to at most 2^31 (which no key reaches: 2^31 - 1 - key >= 0), and t =
    // 0 gives -1 - key. A subtraction and a sign-bit move, off the port that the
    // compress and an unsigned compare would share.
    let t1 = t.min(1 << 31).wrapping_sub(1) as i32;
    let (t1, abs) = (_mm512_set1_epi32(t1), _mm512_set1_epi32(ABS));
    let step = _mm512_set1_epi32(16);
    let mut at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let mut count = 0;
    // Four vectors a step: their masks and counts first, so that the running count (the
    // stores' address) takes one addition a step, not a mask move, a population count
    // and an addition per vector. Only the positions are compressed; the keys are read
    // again after (a second compress would double the work of the compress port).
    for q in x.chunks_exact(64) {
        let mut m = [0u16; 4];
        for (j, m) in m.iter_mut().enumerate() {
            // SAFETY: `q` holds 64 f32, four unaligned __m512i.
            let k = _mm512_and_si512(
                unsafe { _mm512_loadu_si512(q.as_ptr().add(16 * j).cast()) },
                abs,
            );
            *m = _mm512_movepi32_mask(_mm512_sub_epi32(t1, k));
        }
        let c = m.map(|m| m.count_ones() as usize);
        let starts = [
            count,
            count + c[0],
            count + c[0] + c[1],
            count + c[0] + c[1] + c[2],
        ];
        for (m, start) in m.into_iter().zip(starts) {
            // SAFETY: `start` <= the elements before this vector, so `start + 16 <= n +
            // 16` entries of `idx` exist: an unaligned __m512i store, the lanes past the
            // kept ones written with zeros.
            unsafe {
                _mm512_storeu_si512(
                    idx.as_mut_ptr().add(start).cast(),
                    _mm512_maskz_compress_epi32(m, at),
                );
            }
            at = _mm512_add_epi32(at, step);
        }
        count = starts[3] + c[3];
    }
    for (k, &i) in keys[..count].iter_mut().zip(&idx[..count]) {
        *k = x[i as usize].to_bits() & ABS as u32;
    }
    let done = n - n % 64;
    // The rest (under 64) one by one, each written and kept or overwritten by the next.
    for (i, v) in x.iter().enumerate().skip(done) {
        let k = v.to_bits() & ABS as u32;
        idx[count] = i as u32;
        keys[count] = k;
        count += (k >= t) as usize;
    }
    count
}

/// `super::lane_bound` with AVX-512: each group's `D` largest keys kept by float minima
/// and maxima (two ports on Intel's cores, where the 512-bit integer ones take one),
/// which order non-negative floats as their bits do, NaN aside (a NaN, seen by an
/// integer maximum of the keys, sends the slice to the portable kernel), and subnormals
/// too in the crate's floating-point mode (the codecs hold it). Four sets of 16 lanes
/// take every fourth row of 16, merged at the end. The same value as
/// [`scalar::lane_bound`].
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn lane_bound_avx512<const D: usize>(x: &[f32]) -> u32 {
    let abs = _mm512_set1_epi32(ABS);
    let mut sets = [[_mm512_setzero_ps(); D]; 4];
    let mut most = _mm512_setzero_si512();
    let quads = x.chunks_exact(64);
    let rest = quads.remainder();
    for quad in quads {
        for (m, row) in sets.iter_mut().zip(quad.chunks_exact(16)) {
            // SAFETY: `row` holds 16 f32, one unaligned __m512i.
            let k = _mm512_and_si512(unsafe { _mm512_loadu_si512(row.as_ptr().cast()) }, abs);
            most = _mm512_max_epu32(most, k);
            let mut v = _mm512_castsi512_ps(k);
            for r in m.iter_mut() {
                let hi = _mm512_max_ps(*r, v);
                v = _mm512_min_ps(*r, v);
                *r = hi;
            }
        }
    }
    if _mm512_reduce_max_epu32(most) > scalar::INF_BITS {
        // NaN: the integer minima and maxima of the portable kernel.
        return super::portable::lane_bound::<D>(x);
    }
    // The other sets' rows inserted into the first, in registers; then its lanes as keys
    // (the float bits are the keys), the rest inserted one by one.
    let [mut first, others @ ..] = sets;
    for m in others {
        for row in m {
            let mut v = row;
            for r in first.iter_mut() {
                let hi = _mm512_max_ps(*r, v);
                v = _mm512_min_ps(*r, v);
                *r = hi;
            }
        }
    }
    let mut lanes = [[0u32; 16]; D];
    for (o, r) in lanes.iter_mut().zip(&first) {
        // SAFETY: `o` is 16 u32, one unaligned __m512.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().cast(), *r) };
    }
    for (i, v) in rest.iter().enumerate() {
        super::portable::insert_key(&mut lanes, i % 16, v.to_bits() & ABS as u32);
    }
    lanes[D - 1].iter().fold(u32::MAX, |a, &b| a.min(b))
}

/// Compare and compress with AVX-512, 16 lanes and mask registers; the contract of
/// [`filter_mag_ge_avx2`].
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn filter_mag_ge_avx512(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    filter_mag_avx512(x, t, idx, None)
}

/// [`filter_mag_ge_avx512`] that also writes the kept elements' bits to `vals`: the
/// contract of `super::filter_mag_ge_vals`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn filter_mag_ge_vals_avx512(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    vals: &mut [u32],
) -> (usize, usize) {
    filter_mag_avx512(x, t, idx, Some(vals))
}

/// The filter of [`filter_mag_ge_avx512`], writing values too when `vals` is given.
#[target_feature(enable = "avx512f")]
#[inline]
fn filter_mag_avx512(
    x: &[f32],
    t: u32,
    idx: &mut [u32],
    vals: Option<&mut [u32]>,
) -> (usize, usize) {
    let tv = _mm512_set1_epi32(t as i32);
    let abs = _mm512_set1_epi32(ABS);
    compress_masks_vals(x.len(), idx, vals.map(|v| (x, v)), |done, len| {
        if len < 64 {
            return mag_mask_tail(&x[done..done + len], t);
        }
        let mut m = 0u64;
        for q in 0..4 {
            // SAFETY: done + 16 q + 16 <= done + 64 <= x.len(); unaligned load.
            let v = unsafe { _mm512_loadu_si512(x.as_ptr().add(done + 16 * q).cast()) };
            m |= (_mm512_cmpge_epu32_mask(_mm512_and_si512(v, abs), tv) as u64) << (16 * q);
        }
        m
    })
}

/// Keep, in place and in order, the entries `j` of `idx` and `vals` with `vals[j]`'s
/// magnitude bits `>= t`, 8 at a time (a compare, then a permute from [`COMPRESS8`]);
/// returns how many were kept: `super::retain_mag_ge`'s contract.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn retain_mag_ge_avx2(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    let n = idx.len().min(vals.len());
    if t > ABS as u32 {
        return 0;
    }
    // Signed compare against t - 1, as in `filter_mag_avx2`.
    let below = _mm256_set1_epi32((t as i32).wrapping_sub(1));
    let abs = _mm256_set1_epi32(ABS);
    let (mut r, mut w) = (0, 0);
    while r + 8 <= n {
        // SAFETY: r + 8 <= n, so both loads read inside the slices; both stores write
        // entries w..w + 8 with w <= r, inside the slices, and only entries before r + 8,
        // which are already loaded.
        unsafe {
            let v = _mm256_loadu_si256(vals.as_ptr().add(r).cast());
            let i = _mm256_loadu_si256(idx.as_ptr().add(r).cast());
            let ge = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs), below);
            let m = _mm256_movemask_ps(_mm256_castsi256_ps(ge)) as usize;
            let pos = _mm_cvtsi64_si128(COMPRESS8[m] as i64);
            let perm = _mm256_cvtepu8_epi32(pos);
            _mm256_storeu_si256(
                vals.as_mut_ptr().add(w).cast(),
                _mm256_permutevar8x32_epi32(v, perm),
            );
            _mm256_storeu_si256(
                idx.as_mut_ptr().add(w).cast(),
                _mm256_permutevar8x32_epi32(i, perm),
            );
            w += m.count_ones() as usize;
        }
        r += 8;
    }
    w + scalar::retain_mag_ge_from(idx, vals, t, r, w)
}

/// [`retain_mag_ge_avx2`] with AVX-512, 16 at a time (a compare into a mask register,
/// then `vpcompressd`).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn retain_mag_ge_avx512(idx: &mut [u32], vals: &mut [u32], t: u32) -> usize {
    let n = idx.len().min(vals.len());
    let tv = _mm512_set1_epi32(t as i32);
    let abs = _mm512_set1_epi32(ABS);
    let (mut r, mut w) = (0, 0);
    while r + 16 <= n {
        // SAFETY: r + 16 <= n, so both loads read inside the slices; both stores write
        // entries w..w + 16 with w <= r, inside the slices, and only entries before
        // r + 16, which are already loaded.
        unsafe {
            let v = _mm512_loadu_si512(vals.as_ptr().add(r).cast());
            let i = _mm512_loadu_si512(idx.as_ptr().add(r).cast());
            let m = _mm512_cmpge_epu32_mask(_mm512_and_si512(v, abs), tv);
            _mm512_storeu_si512(
                vals.as_mut_ptr().add(w).cast(),
                _mm512_maskz_compress_epi32(m, v),
            );
            _mm512_storeu_si512(
                idx.as_mut_ptr().add(w).cast(),
                _mm512_maskz_compress_epi32(m, i),
            );
            w += m.count_ones() as usize;
        }
        r += 16;
    }
    w + scalar::retain_mag_ge_from(idx, vals, t, r, w)
}

/// fp16 frames of the multi-frame reduction, widened with F16C 8 lanes at a time.
struct F16cLanes<'a>(&'a [&'a [u8]]);

impl LaneFrames for F16cLanes<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn lanes(&self, q: usize, _: usize, c: usize) -> [f32; REDUCE_LANES] {
        let b = super::portable::group_bytes::<2>(self.0[q], c);
        let mut v = [0f32; REDUCE_LANES];
        for k in 0..REDUCE_LANES / 8 {
            // SAFETY: `b` holds 2 * REDUCE_LANES bytes, so the 16 at 16 k are inside it, and
            // `v` the 8 floats at 8 k; unaligned accesses. This is only inlined into
            // `reduce_f16_avx2` and `reduce_f16_avx512`, whose callers guarantee F16C.
            unsafe {
                let h = _mm_loadu_si128(b.as_ptr().add(16 * k).cast::<__m128i>());
                _mm256_storeu_ps(v.as_mut_ptr().add(8 * k), _mm256_cvtph_ps(h));
            }
        }
        v
    }
}

/// The multi-frame reduction of fp16 frames (see `portable::reduce_groups`: the same
/// operations in the same order as the scalar decode and decode_add), widened with F16C
/// and summed in AVX2 registers.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn reduce_f16_avx2<const M: u8>(frames: &[&[u8]], start: usize, out: &mut [f32]) {
    super::portable::reduce_groups::<M>(out, &F16cLanes(frames), start);
}

/// As [`reduce_f16_avx2`], summed in AVX-512 registers.
///
/// # Safety
/// The CPU must support AVX-512F and F16C.
#[target_feature(enable = "avx512f,avx2,f16c")]
pub unsafe fn reduce_f16_avx512<const M: u8>(frames: &[&[u8]], start: usize, out: &mut [f32]) {
    super::portable::reduce_groups::<M>(out, &F16cLanes(frames), start);
}

/// PowerSGD's reconstruction rows (`P Q^T`, and the residual `M - P Q^T`) with the
/// product written by non-temporal stores: for matrices larger than the caches, whose
/// rows would otherwise be read into the cache before being overwritten and then evicted
/// dirty during the next pass. The arithmetic is `gemm::thin_pqt_rows`' (a rounded
/// product, then a rounded sum, `k` in order; never fused), so the bits are the same.
/// `MODE` is [`PQT_OUT`] (the product only), [`PQT_FROM_X`] (the residual from `x`) or
/// [`PQT_FROM_OUT`] (the residual from `out` before it is overwritten).
macro_rules! pqt_stream {
    ($name:ident, $feature:literal, $V:ty, $lanes:literal, $set1:ident, $loadu:ident,
     $mul:ident, $add:ident, $sub:ident, $storeu:ident, $stream:ident) => {
        /// See [`pqt_stream!`]: `out` holds whole rows of `cols`, `p` has `R` values per
        /// row, `qt` holds `R` rows of `cols` (`Q^T`), `x` and `e` are as long as `out`.
        ///
        /// # Safety
        /// The CPU must support the target feature this function is compiled for.
        ///
        /// # Panics
        /// If the lengths disagree (the callers size every buffer from the same shapes).
        #[target_feature(enable = $feature)]
        pub unsafe fn $name<const R: usize, const MODE: u8>(
            x: &[f32],
            out: &mut [f32],
            e: &mut [f32],
            p: &[f32],
            qt: &[f32],
            cols: usize,
        ) {
            let rows = out.len() / cols.max(1);
            assert!(
                cols > 0
                    && rows * cols == out.len()
                    && p.len() == rows * R
                    && qt.len() >= R * cols
                    && (MODE != PQT_FROM_X || x.len() == out.len())
                    && (MODE == PQT_OUT || e.len() == out.len()),
                "pqt_stream: lengths"
            );
            let q: [&[f32]; R] = core::array::from_fn(|k| &qt[k * cols..(k + 1) * cols]);
            for (i, pa) in p.chunks_exact(R).enumerate() {
                let pa: &[f32; R] = pa.try_into().expect("R values per row");
                let at = i * cols;
                // Elements before the row's first aligned vector go through plain stores.
                let misalign = (out[at..].as_ptr() as usize) % (4 * $lanes) / 4;
                let head = (($lanes - misalign) % $lanes).min(cols);
                let e_aligned =
                    MODE != PQT_OUT && (e[at..].as_ptr() as usize + 4 * head) % (4 * $lanes) == 0;
                let edge = |j: usize, out: &mut [f32], e: &mut [f32]| {
                    let v = super::gemm::pqt_one(pa, &q, j);
                    match MODE {
                        PQT_FROM_X => e[at + j] = x[at + j] - v,
                        PQT_FROM_OUT => e[at + j] = out[at + j] - v,
                        _ => {}
                    }
                    out[at + j] = v;
                };
                for j in 0..head {
                    edge(j, out, e);
                }
                // Taken after the head's stores, which borrowed `out` again.
                let o = out[at..at + cols].as_mut_ptr();
                let pv: [$V; R] = core::array::from_fn(|k| $set1(pa[k]));
                let mut j = head;
                while j + $lanes <= cols {
                    // SAFETY: j + lanes <= cols, so every access below is inside row i
                    // of its buffer (checked lengths above), and qt's k-th row
                    // (k < R, R cols <= qt.len()); `o + j` is aligned to the vector
                    // (head above), as the streaming store needs; the residual's store
                    // streams only where it is aligned too.
                    unsafe {
                        let mut v = $mul(pv[0], $loadu(qt.as_ptr().add(j)));
                        for k in 1..R {
                            let q = $loadu(qt.as_ptr().add(k * cols + j));
                            v = $add(v, $mul(pv[k], q));
                        }
                        if MODE != PQT_OUT {
                            let m = if MODE == PQT_FROM_X {
                                $loadu(x.as_ptr().add(at + j))
                            } else {
                                $loadu(o.add(j))
                            };
                            let d = $sub(m, v);
                            let ep = e.as_mut_ptr().add(at + j);
                            if e_aligned {
                                $stream(ep, d);
                            } else {
                                $storeu(ep, d);
                            }
                        }
                        $stream(o.add(j), v);
                    }
                    j += $lanes;
                }
                for j in j..cols {
                    edge(j, out, e);
                }
            }
            // The streaming stores are weakly ordered: fence them before the results
            // are handed to another thread.
            _mm_sfence();
        }
    };
}

/// [`pqt_stream!`]'s mode: the product only.
pub const PQT_OUT: u8 = 0;
/// [`pqt_stream!`]'s mode: the residual `x - P Q^T` too.
pub const PQT_FROM_X: u8 = 1;
/// [`pqt_stream!`]'s mode: the residual `out - P Q^T` too, `out` read before it is
/// overwritten.
pub const PQT_FROM_OUT: u8 = 2;

pqt_stream!(
    pqt_stream_avx2,
    "avx2",
    __m256,
    8,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    _mm256_mul_ps,
    _mm256_add_ps,
    _mm256_sub_ps,
    _mm256_storeu_ps,
    _mm256_stream_ps
);
pqt_stream!(
    pqt_stream_avx512,
    "avx512f",
    __m512,
    16,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_mul_ps,
    _mm512_add_ps,
    _mm512_sub_ps,
    _mm512_storeu_ps,
    _mm512_stream_ps
);
