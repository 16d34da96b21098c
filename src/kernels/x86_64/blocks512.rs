//! AVX-512 kernels of the block codecs on 16 lanes: the loops written once
//! (`loops`: int8's encode, fused error-feedback step and ring hop, qsgd's and ternary's
//! sign-magnitude encode, fp8's decode, the fp8 and fp4 nearest encoders' groups of
//! blocks) instantiated for [`Avx512`], with its [`Quantise`] and [`FloatCodes`] steps
//! and the counter hash drawn in aligned groups of 64 where a block starts at a multiple
//! of 64; and the kernels of this width alone: the fp8 and fp4 stochastic encoders,
//! fp4's decode by table lookups in registers, `dct`'s transpose of sixteen tiles into
//! lanes.
//!
//! A block's tail shorter than one step goes to the AVX2 kernel. Every function equals
//! its scalar oracle to the bit (tests/backends.rs).
//!
//! Callers hold a [`crate::kernels::Backend`] of kind `Avx512`, which exists only after
//! AVX-512 F/BW/CD/DQ/VL and AVX2 were detected; that check is what makes calling these
//! `#[target_feature]` functions sound.

use core::arch::x86_64::*;

use super::blocks::{self, ABS, C1, C2, StepDraws};
use super::lanes::{Avx512, FloatCodes, Lanes, Quantise};
use super::loops;
use crate::kernels::fp8;
use crate::kernels::scalar::{self, Round};
use crate::rng::Draws;

/// `rng::lowbias32` on 16 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn lowbias32x16(x: __m512i) -> __m512i {
    let x = _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x));
    lowbias32_rest(_mm512_mullo_epi32(x, _mm512_set1_epi32(C1 as i32)))
}

/// `rng::lowbias32` on 16 lanes from its first product on.
#[target_feature(enable = "avx512f")]
#[inline]
fn lowbias32_rest(x: __m512i) -> __m512i {
    let x = _mm512_xor_si512(x, _mm512_srli_epi32::<15>(x));
    let x = _mm512_mullo_epi32(x, _mm512_set1_epi32(C2 as i32));
    _mm512_xor_si512(x, _mm512_srli_epi32::<16>(x))
}

/// The draws `lowbias32(i ^ key)` of a block's steps of 64 elements, 16 per vector (`i`
/// the global index mod 2^32, inside one key's window). A block that starts at a multiple
/// of 64 has every step on an aligned group of 64 and needs one vector multiply per 16
/// draws instead of two: with `B = base ^ key` and `Y = B ^ (B >> 16)`, the first product
/// of the hash of `base + j` is `(Y & !63) * C1 + ((Y & 63) ^ j) * C1` (mod 2^32), a
/// scalar term per step plus a table that changes once per 2^16 indices (the AVX2
/// kernels' `GroupDraws`, on 16 lanes).
pub(super) struct Draws16<'a> {
    draws: &'a Draws,
    key: u32,
    grouped: bool,
    /// `B >> 16` the table is for (`u32::MAX`: none yet).
    hi: u32,
    /// Lane `l` of `k[q]` is `((Y & 63) ^ (16 q + l)) * C1`.
    k: [__m512i; 4],
}

impl<'a> Draws16<'a> {
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn new(draws: &'a Draws) -> Draws16<'a> {
        Draws16 {
            draws,
            key: 0,
            grouped: false,
            hi: u32::MAX,
            k: [_mm512_setzero_si512(); 4],
        }
    }

    /// Ready for the block from global index `start` (inside one key's window).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn begin(&mut self, start: u64) {
        let key = self.draws.key_for(start);
        if key != self.key {
            self.key = key;
            self.hi = u32::MAX;
        }
        self.grouped = start.is_multiple_of(64);
    }

    #[target_feature(enable = "avx512f")]
    #[cold]
    #[inline(never)]
    fn refresh(&mut self, hi: u32) {
        self.hi = hi;
        let c = _mm512_set1_epi32(((self.key ^ hi) & 63) as i32);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (q, k) in (0i32..).zip(&mut self.k) {
            let j = _mm512_add_epi32(lanes, _mm512_set1_epi32(16 * q));
            *k = _mm512_mullo_epi32(_mm512_xor_si512(j, c), _mm512_set1_epi32(C1 as i32));
        }
    }

    /// The draws of the 64 indices from `at` (mod 2^32), 16 per vector.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn step(&mut self, at: u32) -> [__m512i; 4] {
        if self.grouped {
            let b = at ^ self.key;
            if b >> 16 != self.hi {
                self.refresh(b >> 16);
            }
            let y = b ^ (b >> 16);
            let a = _mm512_set1_epi32((y & !63).wrapping_mul(C1) as i32);
            let h = |q: usize| lowbias32_rest(_mm512_add_epi32(a, self.k[q]));
            return [h(0), h(1), h(2), h(3)];
        }
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let i0 = _mm512_add_epi32(_mm512_set1_epi32(at as i32), lanes);
        let key = _mm512_set1_epi32(self.key as i32);
        let h = |o: i32| {
            let i = _mm512_add_epi32(i0, _mm512_set1_epi32(o));
            lowbias32x16(_mm512_xor_si512(i, key))
        };
        [h(0), h(16), h(32), h(48)]
    }
}

/// The 64 codes of four vectors of 16 (elements 0..16 in `q[0]`, ...) as 64 bytes in
/// element order: each in `-128..=127` when `SIGNED`, else in `0..=255`. The packs work
/// within 128-bit lanes, leaving lane `k` with elements `4k..4k+4` of each vector in
/// turn; one permute of dwords restores the order. (Four `vpmovdb` down-conversions cost
/// twice as much here.)
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn pack_bytes<const SIGNED: bool>(q: [__m512i; 4]) -> __m512i {
    let ab = _mm512_packs_epi32(q[0], q[1]);
    let cd = _mm512_packs_epi32(q[2], q[3]);
    let p = if SIGNED {
        _mm512_packs_epi16(ab, cd)
    } else {
        _mm512_packus_epi16(ab, cd)
    };
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(order, p)
}

/// Sign-magnitude encode of `BITS` (2, 4 or 8) bits with AVX-512 (the contract of
/// `scalar::encode_signmag`, every code byte written). Blocks must start on byte
/// boundaries: `block % (8 / BITS) == 0`.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/DQ and AVX2 with FMA (as every CPU the Avx512
/// backend accepts does).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
pub unsafe fn encode_signmag_avx512<const BITS: u32>(
    x: &[f32],
    block: usize,
    measure: scalar::Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let mut d16 = Draws16::new(draws);
    let mut d8 = StepDraws::new(draws);
    scalar::encode_signmag_blocks::<BITS>(
        x,
        block,
        measure,
        draws,
        first,
        steps,
        codes,
        #[inline(always)]
        |xb| blocks::l2_squares(xb),
        #[inline(always)]
        |xb, cb, m, start| signmag_block::<BITS>(xb, cb, m, &mut d16, &mut d8, start),
    )
}

/// Sign-magnitude codes of one finite block (inside one index window) with scale `m`:
/// whole 64-element steps here ([`loops::signmag_steps`]), the rest by the AVX2 kernel.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2,fma")]
#[inline]
fn signmag_block<const BITS: u32>(
    xb: &[f32],
    cb: &mut [u8],
    m: f32,
    d16: &mut Draws16,
    d8: &mut StepDraws,
    start: u64,
) {
    let levels = (1u32 << (BITS - 1)) - 1;
    let (pre, inv) = scalar::level_multiplier(m, levels as f32);
    if pre != 1.0 || xb.len() < 64 {
        // A scale below 2^-100 (the oracle scales by 2^64 first) or a short block.
        return blocks::signmag_block::<BITS>(xb, cb, m, d8, start);
    }
    // SAFETY: this function's features are `Avx512`'s.
    let done = unsafe { loops::signmag_steps::<Avx512, BITS>((inv, levels), xb, cb, d16, start) };
    if done < xb.len() {
        let rest = &mut cb[done * BITS as usize / 8..];
        blocks::signmag_block::<BITS>(&xb[done..], rest, m, d8, start + done as u64);
    }
}

/// The oracle's `scalar::level` of `|v|` on 16 lanes, operation for operation: `a = |v|
/// * inv`, `fl = floor(a)`, one up when `u < a - fl` with `u = (h >> 8) * 2^-24` for the
/// lane's draw `h`, clamped to `top`.
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
fn stochastic_level16(v: __m512, h: __m512i, inv: __m512, top: __m512i) -> __m512i {
    let abs = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(ABS),
    ));
    let a = _mm512_mul_ps(abs, inv);
    let u = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_srli_epi32::<8>(h)),
        _mm512_set1_ps(1.0 / 16_777_216.0),
    );
    // a - floor(a) in one instruction (exact, as the oracle's subtraction), and the floor
    // itself by truncation (a >= 0).
    let frac = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(a);
    let up = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, frac);
    let l = _mm512_cvttps_epi32(a);
    _mm512_min_epi32(_mm512_mask_add_epi32(l, up, l, _mm512_set1_epi32(1)), top)
}

/// Sixteen rows of `w` elements (`w` 16, 32 or 64; row `t` at `rows[t * stride..]`) into
/// lanes: `a[n][t]` = element `n` of row `t`, for `n < w`. Blocks of 16 x 16 transposed
/// in registers: 32-bit and 64-bit interleaves, then two rounds of 128-bit lane shuffles
/// (64 shuffles per block against 256 scalar moves).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn rows_to_lanes16(rows: &[f32], stride: usize, w: usize, a: &mut [[f32; 16]]) {
    assert!(matches!(w, 16 | 32 | 64) && stride >= w && a.len() >= w);
    assert!(rows.len() >= 15 * stride + w);
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    for n0 in (0..w).step_by(16) {
        let mut r = [_mm512_setzero_ps(); 16];
        for (t, r) in r.iter_mut().enumerate() {
            // SAFETY: t * stride + n0 + 16 <= 15 stride + w <= rows.len() (asserted);
            // unaligned load.
            *r = unsafe { _mm512_loadu_ps(rows.as_ptr().add(t * stride + n0)) };
        }
        // Per 128-bit lane L: t[2g] = rows 2g, 2g + 1 at columns 4L, 4L + 1 interleaved,
        // t[2g + 1] the same at 4L + 2, 4L + 3.
        let mut t = [_mm512_setzero_ps(); 16];
        for g in 0..8 {
            t[2 * g] = _mm512_unpacklo_ps(r[2 * g], r[2 * g + 1]);
            t[2 * g + 1] = _mm512_unpackhi_ps(r[2 * g], r[2 * g + 1]);
        }
        // r[4q + c], lane L: rows 4q..4q + 4 at column 4L + c.
        for q in 0..4 {
            let (t0, t1, t2, t3) = (t[4 * q], t[4 * q + 1], t[4 * q + 2], t[4 * q + 3]);
            r[4 * q] = ps(_mm512_unpacklo_pd(pd(t0), pd(t2)));
            r[4 * q + 1] = ps(_mm512_unpackhi_pd(pd(t0), pd(t2)));
            r[4 * q + 2] = ps(_mm512_unpacklo_pd(pd(t1), pd(t3)));
            r[4 * q + 3] = ps(_mm512_unpackhi_pd(pd(t1), pd(t3)));
        }
        // Column 4L + c gathers lane L of r[c], r[4 + c], r[8 + c], r[12 + c].
        for c in 0..4 {
            let u0 = _mm512_shuffle_f32x4::<0x88>(r[c], r[4 + c]);
            let u1 = _mm512_shuffle_f32x4::<0xDD>(r[c], r[4 + c]);
            let u2 = _mm512_shuffle_f32x4::<0x88>(r[8 + c], r[12 + c]);
            let u3 = _mm512_shuffle_f32x4::<0xDD>(r[8 + c], r[12 + c]);
            let cols = [
                (c, _mm512_shuffle_f32x4::<0x88>(u0, u2)),
                (4 + c, _mm512_shuffle_f32x4::<0x88>(u1, u3)),
                (8 + c, _mm512_shuffle_f32x4::<0xDD>(u0, u2)),
                (12 + c, _mm512_shuffle_f32x4::<0xDD>(u1, u3)),
            ];
            for (n, v) in cols {
                // SAFETY: n0 + n < w <= a.len() (asserted); a lane row is 16 f32, one
                // unaligned 64-byte store.
                unsafe { _mm512_storeu_ps(a[n0 + n].as_mut_ptr(), v) };
            }
        }
    }
}

/// fp4 decode (the layout of `fp8::decode` with two codes per byte, low nibble first) of
/// the whole blocks of 16 or 32 elements that `out`, `codes` and `scales` hold
/// (`blocks::float_blocks`), in mode `M` (write or add); returns how many blocks it decoded.
/// `fours` holds the sixteen codes' values: each block multiplies them by its scale (the
/// same f32 products as `fp8::decode`'s per element), looks its codes up with one permute per 16 of them, and
/// interleaves the low and high nibbles' values back into element order.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn decode_fp4<const M: u8>(
    fours: &[f32; 16],
    scale: crate::kernels::fp8::Scale,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    assert!(matches!(block, 16 | 32));
    let half = block / 2;
    let (blocks, sb) = loops::float_blocks(scale, block, half, scales, codes, out);
    // SAFETY: `fours` is 16 f32, one unaligned __m512.
    let table = unsafe { _mm512_loadu_ps(fours.as_ptr()) };
    // Element 2j is the low nibble of byte j, element 2j + 1 its high nibble.
    let first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for b in 0..blocks {
        let s = crate::kernels::fp8::scale_of(scale, &scales[b * sb..(b + 1) * sb]);
        let ts = _mm512_mul_ps(table, _mm512_set1_ps(s));
        let c = &codes[b * half..(b + 1) * half];
        let o = &mut out[b * block..(b + 1) * block];
        // SAFETY: `c` holds `half` bytes: 16 (one unaligned __m128i) or 8 (the low 8
        // bytes of one, the rest zero).
        let bytes = unsafe {
            if half == 16 {
                _mm_loadu_si128(c.as_ptr().cast())
            } else {
                _mm_loadl_epi64(c.as_ptr().cast())
            }
        };
        let w = _mm512_cvtepu8_epi32(bytes);
        let lo = _mm512_permutexvar_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)), ts);
        let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(w), ts);
        // SAFETY: `o` holds 16 or 32 f32 (the block), one or two unaligned __m512.
        unsafe { Avx512::put::<M>(o.as_mut_ptr(), _mm512_permutex2var_ps(lo, first, hi)) };
        if half == 16 {
            // SAFETY: as above, the second half of a block of 32.
            unsafe {
                Avx512::put::<M>(o[16..].as_mut_ptr(), _mm512_permutex2var_ps(lo, second, hi))
            };
        }
    }
    blocks
}

/// fp8 decode of a scaled frame's whole blocks (a multiple of 16 long) on 16 lanes, in
/// mode `M` ([`loops::decode_fp8`]); returns how many blocks it decoded.
///
/// # Safety
/// The CPU must support AVX-512F and AVX2.
#[target_feature(enable = "avx512f,avx2")]
pub unsafe fn decode_fp8<const M: u8>(
    e4m3: bool,
    scale: crate::kernels::fp8::Scale,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    // SAFETY: this function's features are `Avx512`'s.
    unsafe { loops::decode_fp8::<Avx512, M>(e4m3, scale, block, scales, codes, out) }
}

/// fp8 decode of an unscaled frame on 16 lanes, in mode `M`
/// ([`loops::decode_fp8_unscaled`]); returns how many elements it decoded.
///
/// # Safety
/// The CPU must support AVX-512F and AVX2.
#[target_feature(enable = "avx512f,avx2")]
pub unsafe fn decode_fp8_unscaled<const M: u8>(e4m3: bool, codes: &[u8], out: &mut [f32]) -> usize {
    // SAFETY: this function's features are `Avx512`'s.
    unsafe { loops::decode_fp8_unscaled::<Avx512, M>(e4m3, codes, out) }
}

/// int8 encode (the contract of `scalar::encode_int8`; every code byte written) on 16
/// lanes: each block's maximum (compiled for AVX-512), then its codes 64 a step
/// ([`int8_codes`], the rest of the block by the AVX2 kernel); a block whose scale is
/// below 2^-100 by the oracle.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/DQ and AVX2 (as every CPU the Avx512 backend
/// accepts does).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
pub unsafe fn encode_int8_avx512(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let (mut d16, mut d8) = (Draws16::new(draws), StepDraws::new(draws));
    scalar::encode_int8_blocks(
        x,
        block,
        round,
        draws,
        first,
        steps,
        codes,
        #[inline(always)]
        |xb, cb, m, start| {
            let (pre, inv) = scalar::level_multiplier(m, 127.0);
            let d = (&mut d16, &mut d8);
            match (pre == 1.0, round) {
                (false, _) => scalar::quantise_int8(xb, cb, m, round, draws, start),
                (true, Round::Nearest) => int8_codes::<false>(inv, xb, cb, d, start),
                (true, Round::Stochastic) => int8_codes::<true>(inv, xb, cb, d, start),
            };
        },
    )
}

/// int8's fused error-feedback step ([`blocks::feedback_int8_avx2`]'s contract and bytes)
/// on 16 lanes: `p = beta r + gamma g` formed into `r` with its largest magnitude, then
/// the codes 64 a step with `r` becoming each element's residual `p - code * step`
/// ([`int8_residual`], the rest of a block by the AVX2 kernel); a block whose scale is
/// below 2^-100 and one across a 2^32 draw window by the oracle.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/DQ and AVX2 (as every CPU the Avx512 backend
/// accepts does).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
pub unsafe fn feedback_int8_avx512(
    r: &mut [f32],
    g: &[f32],
    (beta, gamma): (f32, f32),
    block: usize,
    (round, draws, first): (Round, &Draws, u64),
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let (mut d16, mut d8) = (Draws16::new(draws), StepDraws::new(draws));
    blocks::feedback_int8_blocks(
        r,
        g,
        block,
        (round, draws, first),
        steps,
        codes,
        #[inline(always)]
        |rb, gb| form_max_abs(rb, gb, beta, gamma),
        #[inline(always)]
        |inv, step, rb, cb, start| {
            let d = (&mut d16, &mut d8);
            match round {
                Round::Nearest => int8_residual::<false>(inv, step, rb, cb, d, start),
                Round::Stochastic => int8_residual::<true>(inv, step, rb, cb, d, start),
            }
        },
    )
}

/// int8's fused ring hop ([`blocks::hop_int8_avx2`]'s contract and bytes) on 16 lanes:
/// `sum = local + decode` with each block's largest magnitude, then the codes of `sum`
/// 64 a step ([`int8_codes`]), the rest of a block by the AVX2 kernel.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/DQ and AVX2 (as every CPU the Avx512 backend
/// accepts does).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn hop_int8_avx512(
    local: &[f32],
    in_steps: &[u8],
    in_codes: &[u8],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    sum: &mut [f32],
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let (mut d16, mut d8) = (Draws16::new(draws), StepDraws::new(draws));
    blocks::hop_int8_blocks(
        local,
        (in_steps, in_codes),
        block,
        (round, draws, first),
        sum,
        steps,
        codes,
        #[inline(always)]
        |sb, lb, ib, step| add_max_abs(sb, lb, ib, step),
        #[inline(always)]
        |inv, sb, cb, start| {
            let d = (&mut d16, &mut d8);
            match round {
                Round::Nearest => int8_codes::<false>(inv, sb, cb, d, start),
                Round::Stochastic => int8_codes::<true>(inv, sb, cb, d, start),
            }
        },
    )
}

/// The int8 codes of the whole 64s of a finite block `xb` from global index `start`
/// (inside one 2^32 draw window when `STOCHASTIC`), whose level multiplier is `inv`
/// (`scalar::level_multiplier` without a pre-scale), as `scalar::quantise_int8` writes
/// them ([`int8_quantise`]) 64 a step, then 16 a step with nearest rounding (the 16-lane
/// draws come 64 at a time); the rest by the AVX2 kernel (32 a step, then padded).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[inline]
fn int8_codes<const STOCHASTIC: bool>(
    inv: f32,
    xb: &[f32],
    cb: &mut [u8],
    (d16, d8): (&mut Draws16, &mut StepDraws),
    start: u64,
) {
    assert!(cb.len() >= xb.len());
    let x = xb.as_ptr().cast_mut();
    // SAFETY: `xb` is valid for reads of its length, and without `RESIDUAL` nothing is
    // written through the pointer; `cb` is long enough.
    let done = unsafe { int8_quantise::<false, STOCHASTIC>(inv, 0.0, x, xb.len(), cb, d16, start) };
    // The rest by the AVX2 kernel: 32 at a time, then padded.
    let at = start + done as u64;
    blocks::int8_codes::<STOCHASTIC>(inv, &xb[done..], &mut cb[done..], d8, at);
}

/// [`int8_codes`] with `rb` becoming each element's residual `x - code * step`, without
/// `scalar::residual_of`'s checks, which cannot fire in a finite block (see
/// `blocks::int8_residual_block`).
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[inline]
fn int8_residual<const STOCHASTIC: bool>(
    inv: f32,
    step: f32,
    rb: &mut [f32],
    cb: &mut [u8],
    (d16, d8): (&mut Draws16, &mut StepDraws),
    start: u64,
) {
    assert!(cb.len() >= rb.len());
    let x = rb.as_mut_ptr();
    // SAFETY: `rb` is valid for reads and writes of its length; `cb` is long enough.
    let done = unsafe { int8_quantise::<true, STOCHASTIC>(inv, step, x, rb.len(), cb, d16, start) };
    // The rest by the AVX2 kernel: 32 at a time, then padded.
    let (rt, ct) = (&mut rb[done..], &mut cb[done..]);
    let at = start + done as u64;
    blocks::int8_residual_block::<STOCHASTIC>(inv, step, d8, at, rt, ct);
}

/// [`loops::int8_steps`] on 16 lanes (64 elements a step), then, with nearest rounding,
/// the block's other whole 16s (the 16-lane draws come 64 at a time). Returns the number
/// of elements done.
///
/// # Safety
/// `x` must be valid for reads of `n` f32, and for writes with `RESIDUAL`; `cb` must hold
/// at least `n` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[inline]
unsafe fn int8_quantise<const RESIDUAL: bool, const STOCHASTIC: bool>(
    inv: f32,
    step: f32,
    x: *mut f32,
    n: usize,
    cb: &mut [u8],
    d16: &mut Draws16,
    start: u64,
) -> usize {
    // SAFETY: the caller's contract; this function's features are `Avx512`'s.
    let mut done = unsafe {
        loops::int8_steps::<Avx512, RESIDUAL, STOCHASTIC>((inv, step), x, n, cb, d16, start)
    };
    if STOCHASTIC {
        return done;
    }
    let (iv, s) = (_mm512_set1_ps(inv), _mm512_set1_ps(step));
    while n - done >= 16 {
        // SAFETY: `x + done` is in the caller's range, read as one unaligned __m512 and,
        // with `RESIDUAL`, written as one; `cb[done..done + 16]` holds 16 bytes, one
        // unaligned __m128i; this function's features are `Avx512`'s.
        unsafe {
            let v = _mm512_loadu_ps(x.add(done));
            let q = Avx512::level::<false>(v, _mm512_setzero_si512(), iv);
            if RESIDUAL {
                _mm512_storeu_ps(x.add(done), Avx512::minus_decoded(v, q, s));
            }
            let o = cb[done..done + 16].as_mut_ptr().cast();
            _mm_storeu_si128(o, _mm512_cvtepi32_epi8(q));
        }
        done += 16;
    }
    done
}

// SAFETY: every method needs AVX-512 F/BW/DQ at most, which the AVX-512 backend's CPU
// check includes.
unsafe impl Quantise for Avx512 {
    type Draws<'a> = Draws16<'a>;

    #[inline(always)]
    unsafe fn begin(d: &mut Draws16<'_>, start: u64) {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { d.begin(start) }
    }
    #[inline(always)]
    unsafe fn step(d: &mut Draws16<'_>, at: u32) -> [__m512i; 4] {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { d.step(at) }
    }
    #[inline(always)]
    unsafe fn top(levels: u32) -> __m512i {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_set1_epi32(levels as i32) }
    }
    #[inline(always)]
    unsafe fn signed_level(v: __m512, h: __m512i, inv: __m512, top: __m512i) -> __m512i {
        // SAFETY: the caller's contract (AVX-512 F/DQ).
        unsafe {
            let l = stochastic_level16(v, h, inv, top);
            // Negated where `v`'s sign bit is set (-0.0 has level 0).
            let neg = _mm512_movepi32_mask(_mm512_castps_si512(v));
            _mm512_mask_sub_epi32(l, neg, _mm512_setzero_si512(), l)
        }
    }
    #[inline(always)]
    unsafe fn nearest_int8(v: __m512, inv: __m512) -> __m512i {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe {
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
            _mm512_max_epi32(
                _mm512_min_epi32(q, _mm512_set1_epi32(127)),
                _mm512_set1_epi32(-127),
            )
        }
    }
    #[inline(always)]
    unsafe fn minus_decoded(v: __m512, q: __m512i, step: __m512) -> __m512 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { _mm512_sub_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(q), step)) }
    }
    #[inline(always)]
    unsafe fn store_codes(p: *mut u8, q: [__m512i; 4]) {
        // SAFETY: the caller's contract (AVX-512 F/BW); `p` is valid for 64 bytes, one
        // unaligned __m512i.
        unsafe { _mm512_storeu_si512(p.cast(), pack_bytes::<true>(q)) }
    }
    #[inline(always)]
    unsafe fn store_signmag<const BITS: u32>(p: *mut u8, q: [__m512i; 4]) {
        // SAFETY: the caller's contract (AVX-512 F/BW): `p` is valid for `8 BITS` bytes.
        unsafe {
            let signed = pack_bytes::<true>(q);
            // min(b & 0x80, sign bit) is the sign bit for negative bytes and 0 for the
            // rest; the magnitude is the byte's absolute value.
            let sign = _mm512_min_epu8(
                _mm512_and_si512(signed, _mm512_set1_epi8(i8::MIN)),
                _mm512_set1_epi8((1u8 << (BITS - 1)) as i8),
            );
            let bytes = _mm512_or_si512(_mm512_abs_epi8(signed), sign);
            match BITS {
                8 => _mm512_storeu_si512(p.cast(), bytes),
                4 => {
                    // Pairs of 4-bit codes, low nibble first: c0 + 16 c1.
                    let pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));
                    _mm256_storeu_si256(p.cast(), _mm512_cvtepi16_epi8(pairs));
                }
                _ => {
                    // Quads of 2-bit codes: (c0 + 4 c1) + 16 (c2 + 4 c3).
                    let pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x0401));
                    let quads = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x0010_0001));
                    _mm_storeu_si128(p.cast(), _mm512_cvtepi32_epi8(quads));
                }
            }
        }
    }
}

/// `r = beta r + gamma g` in place (two rounded products and a rounded sum, as
/// `scalar::feedback_form`: no fused multiply-add), returning the largest `|p|` bit
/// pattern: 16 lanes, the rest by the AVX2 kernel.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn form_max_abs(r: &mut [f32], g: &[f32], beta: f32, gamma: f32) -> u32 {
    // SAFETY: this function's features are `Avx512`'s.
    let (most, whole) = unsafe { loops::form_max_abs::<Avx512>(r, g, beta, gamma) };
    most.max(blocks::form_max_abs(
        &mut r[whole..],
        &g[whole..],
        beta,
        gamma,
    ))
}

/// `sum = local + code * step` for one block of int8 codes (the operations of a
/// `mode::ADD` decode onto `local`), returning the largest `|sum|` bit pattern: 16 lanes,
/// the rest by the AVX2 kernel.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn add_max_abs(sum: &mut [f32], local: &[f32], codes: &[u8], step: f32) -> u32 {
    // SAFETY: this function's features are `Avx512`'s.
    let (most, whole) = unsafe { loops::add_max_abs::<Avx512>(sum, local, codes, step) };
    let rest = (&mut sum[whole..], &local[whole..], &codes[whole..]);
    most.max(blocks::add_max_abs(rest.0, rest.1, rest.2, step))
}

/// fp8 and fp4 encode with nearest rounding, as the AVX2 kernels
/// [`blocks::encode_fp8_nearest`] (8-bit codes of `f`, E4M3 or E5M2, with an f32 or E8M0
/// scale) and, with `four`, [`blocks::encode_fp4_nearest`] (E2M1 or E3M0 codes, two per
/// byte, with any scale) on 16 lanes: blocks of a multiple of 16 eight at a time
/// ([`loops::nearest_group`]); a group with an unusual maximum, the blocks after the last
/// group and other block lengths go to the AVX2 kernel. The same bytes as the definition;
/// returns whether `x` held NaN or ±Inf.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX2.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
pub unsafe fn encode_nearest(
    f: fp8::Format,
    four: bool,
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    debug_assert!(if four {
        scale != fp8::Scale::None && (f == fp8::E2M1 || f == fp8::E3M0)
    } else {
        matches!(scale, fp8::Scale::F32 | fp8::Scale::E8m0) && (f == fp8::E4M3 || f == fp8::E5M2)
    });
    match f.m {
        3 => nearest_in_groups::<3, false>(f, scale, block, x, scales, codes),
        2 => nearest_in_groups::<2, false>(f, scale, block, x, scales, codes),
        1 => nearest_in_groups::<1, true>(f, scale, block, x, scales, codes),
        _ => nearest_in_groups::<0, true>(f, scale, block, x, scales, codes),
    }
}

/// [`encode_nearest`] in a format of `M` mantissa bits, with 4-bit codes when `FOUR`.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
fn nearest_in_groups<const M: u32, const FOUR: bool>(
    f: fp8::Format,
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    blocks::in_groups(
        blocks::groups_take(f, scale) && block.is_multiple_of(16),
        block,
        scale.bytes(),
        if FOUR { 2 } else { 1 },
        x,
        scales,
        codes,
        #[inline(always)]
        |xg, sg, cg| group::<M, FOUR>(f, scale, block, xg, sg, cg),
        #[inline(always)]
        |x, sc, c| {
            // The AVX2 kernels, which group blocks of a multiple of 8 themselves.
            // SAFETY: this function's CPU has AVX2.
            unsafe {
                if FOUR {
                    blocks::encode_fp4_nearest(M == 0, scale, block, x, sc, c)
                } else {
                    blocks::encode_fp8_nearest(M == 3, scale, block, x, sc, c)
                }
            }
        },
    )
}

/// The constants of [`Avx512`]'s [`FloatCodes::code`].
pub(in crate::kernels::x86_64) struct Nearest16 {
    /// E3M0 only: `127 - bias`, the f32 exponent field of code 0's binade.
    rebias: __m512i,
    emin: __m512i,
    exponent: __m512i,
    ulp: __m512i,
    top: __m512i,
    abs: __m512i,
    sign: __m512i,
}

impl Nearest16 {
    /// The constants for format `f` (a mantissa of 0 to 3 bits), the sign in bit 7, or in
    /// bit 3 with `FOUR`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn new<const FOUR: bool>(f: fp8::Format) -> Nearest16 {
        Nearest16 {
            rebias: _mm512_set1_epi32(127 - f.bias),
            emin: _mm512_set1_epi32((1 - f.bias + 127) << 23),
            exponent: _mm512_set1_epi32(0x7F80_0000),
            ulp: _mm512_set1_epi32((23 - f.m as i32) << 23),
            top: _mm512_set1_epi32(f.max_code as i32),
            abs: _mm512_set1_epi32(ABS),
            sign: _mm512_set1_epi32(if FOUR { 0x08 } else { 0x80 }),
        }
    }

    /// [`FloatCodes::code`] on 16 lanes, operation for operation as AVX2's, with the sign
    /// (the element's, which is the quotient's) joined by one ternary logic operation.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn code<const M: u32, const MULTIPLY: bool, const FOUR: bool>(
        &self,
        v: __m512,
        by: __m512,
    ) -> __m512i {
        let y = if MULTIPLY {
            _mm512_mul_ps(v, by)
        } else {
            _mm512_div_ps(v, by)
        };
        let bits = _mm512_castps_si512(y);
        let a = _mm512_and_si512(bits, self.abs);
        let q = if M == 0 {
            // a + (2^22 - 1) + (the exponent's parity), the exponent field less the bias:
            // the code of a normal quotient (the exponent's parity is the code's).
            let parity = _mm512_and_si512(_mm512_srli_epi32::<23>(a), _mm512_set1_epi32(1));
            let r = _mm512_add_epi32(
                _mm512_add_epi32(a, _mm512_set1_epi32((1 << 22) - 1)),
                parity,
            );
            let normal = _mm512_sub_epi32(_mm512_srli_epi32::<23>(r), self.rebias);
            // Below the smallest normal the grid is 0 and it: code 1 above half of it, 0 up
            // to half (the tie goes to the even code 0).
            let half = _mm512_sub_epi32(self.emin, _mm512_set1_epi32(1 << 23));
            let sub =
                _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(a, half), _mm512_set1_epi32(1));
            _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(self.emin, a), normal, sub)
        } else {
            self.count::<M>(bits, a)
        };
        let q = _mm512_min_epi32(q, self.top);
        // q | (the sign bit moved to bit 7, or 3, & its mask): A | (B & C) is 0xF8.
        let high = if FOUR {
            _mm512_srli_epi32::<28>(_mm512_castps_si512(v))
        } else {
            _mm512_srli_epi32::<24>(_mm512_castps_si512(v))
        };
        _mm512_ternarylogic_epi32::<0xF8>(q, high, self.sign)
    }

    /// The unclamped code magnitude of a quotient with bits `bits` and magnitude bits `a`
    /// in a format of `M` (1 to 3) mantissa bits: the grid spacings it rounds to within
    /// its binade, plus `2^M` per binade above the subnormal one.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn count<const M: u32>(&self, bits: __m512i, a: __m512i) -> __m512i {
        let e = _mm512_max_epi32(_mm512_and_si512(bits, self.exponent), self.emin);
        let magic = _mm512_add_epi32(e, self.ulp);
        let sum = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(magic));
        let count = _mm512_sub_epi32(_mm512_castps_si512(sum), magic);
        let binades = _mm512_sub_epi32(e, self.emin);
        let binades = match M {
            3 => _mm512_srli_epi32::<20>(binades),
            2 => _mm512_srli_epi32::<21>(binades),
            _ => _mm512_srli_epi32::<22>(binades),
        };
        _mm512_add_epi32(binades, count)
    }
}

/// A group of eight blocks by [`loops::nearest_group`] on 16 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
fn group<const M: u32, const FOUR: bool>(
    f: fp8::Format,
    scale: fp8::Scale,
    block: usize,
    xg: &[f32],
    sg: &mut [u8],
    cg: &mut [u8],
) -> bool {
    // SAFETY: this function's features are `Avx512`'s.
    unsafe { loops::nearest_group::<Avx512, M, FOUR>(f, scale, block, xg, sg, cg) }
}

// SAFETY: every method needs AVX-512 F/BW and AVX2, as `Lanes for Avx512` says.
unsafe impl FloatCodes for Avx512 {
    type Nearest = Nearest16;

    #[inline(always)]
    unsafe fn nearest<const FOUR: bool>(f: fp8::Format) -> Nearest16 {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { Nearest16::new::<FOUR>(f) }
    }

    #[inline(always)]
    unsafe fn code<const M: u32, const MULTIPLY: bool, const FOUR: bool>(
        n: &Nearest16,
        v: __m512,
        by: __m512,
    ) -> __m512i {
        // SAFETY: the caller's contract (AVX-512F).
        unsafe { n.code::<M, MULTIPLY, FOUR>(v, by) }
    }

    #[inline(always)]
    unsafe fn store_float_codes<const FOUR: bool>(p: *mut u8, q: [__m512i; 4]) {
        // SAFETY: the caller's contract (AVX-512 F/BW): `p` is valid for 64 bytes, or 32
        // with `FOUR`.
        unsafe {
            let bytes = pack_bytes::<false>(q);
            if FOUR {
                // Each pair joined by a multiply-add (`lo + 16 hi`), then narrowed.
                let pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));
                _mm256_storeu_si256(p.cast(), _mm512_cvtepi16_epi8(pairs));
            } else {
                _mm512_storeu_si512(p.cast(), bytes);
            }
        }
    }

    #[inline(always)]
    unsafe fn max8(m: __m512i) -> __m256i {
        // SAFETY: the caller's contract (AVX-512F, AVX2).
        unsafe { _mm256_max_epi32(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64::<1>(m)) }
    }
}

/// fp8 and fp4 encode with stochastic rounding and a scale (`fp8::encode` with draws):
/// the definition's block layout, each scaled block's codes 16 lanes at a time
/// ([`Stochastic16`]) with its draws 64 at a time ([`Draws16`]); with `four` the 8-bit
/// layout's codes are packed in pairs by `fp8::packed`. A block whose indices cross a
/// 2^32 draw window, and each block's last elements short of 16, are converted by the
/// definition. The same bytes as the definition; returns whether `x` held NaN or ±Inf.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/DQ and AVX2.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
pub unsafe fn encode_float_stochastic(
    f: fp8::Format,
    scale: fp8::Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: &Draws,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    debug_assert!(scale != fp8::Scale::None);
    let mut d16 = Draws16::new(draws);
    fp8::encode_with(
        f,
        scale,
        four,
        block,
        x,
        Some(draws),
        first,
        scales,
        codes,
        #[inline(always)]
        |q, xt, at, out| stochastic_codes(f, q, xt, at, &mut d16, out),
    )
}

/// The 8-bit-layout codes (sign in bit 7) of a scaled block's elements `xb` (the first at
/// global index `start`) with stochastic rounding: `fp8::stochastic_in_range` of each
/// quotient with its draw.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[inline]
fn stochastic_codes(
    f: fp8::Format,
    q: fp8::Quotient,
    xb: &[f32],
    start: u64,
    d16: &mut Draws16,
    out: &mut [u8],
) {
    let n = xb.len();
    if n == 0 {
        return;
    }
    if start >> 32 != (start + n as u64 - 1) >> 32 {
        // Across a window: each element's own key.
        for (j, (c, &v)) in out.iter_mut().zip(xb).enumerate() {
            *c = fp8::stochastic_in_range(f, q.of(v), d16.draws.draw(start + j as u64));
        }
        return;
    }
    d16.begin(start);
    match f.m {
        3 => stochastic_run::<3>(f, q, xb, start as u32, d16, out),
        2 => stochastic_run::<2>(f, q, xb, start as u32, d16, out),
        1 => stochastic_run::<1>(f, q, xb, start as u32, d16, out),
        _ => stochastic_run::<0>(f, q, xb, start as u32, d16, out),
    }
}

/// [`stochastic_codes`] inside one draw window (`d16` begun at `start`), in a format of `M`
/// mantissa bits: 64 elements a step, then 16, then the definition.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx2")]
#[inline]
fn stochastic_run<const M: u32>(
    f: fp8::Format,
    q: fp8::Quotient,
    xb: &[f32],
    start: u32,
    d16: &mut Draws16,
    out: &mut [u8],
) {
    let c = Stochastic16::new(f, q);
    let n = xb.len();
    let mut j = 0;
    while j + 64 <= n {
        let h = d16.step(start.wrapping_add(j as u32));
        // SAFETY: j + 64 <= n: four unaligned __m512 of `xb` from j, 64 bytes of `out`.
        unsafe {
            let p = xb.as_ptr().add(j);
            let codes = [
                c.code::<M>(_mm512_loadu_ps(p), h[0]),
                c.code::<M>(_mm512_loadu_ps(p.add(16)), h[1]),
                c.code::<M>(_mm512_loadu_ps(p.add(32)), h[2]),
                c.code::<M>(_mm512_loadu_ps(p.add(48)), h[3]),
            ];
            _mm512_storeu_si512(out.as_mut_ptr().add(j).cast(), pack_bytes::<false>(codes));
        }
        j += 64;
    }
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let key = _mm512_set1_epi32(d16.key as i32);
    while j + 16 <= n {
        let i = _mm512_add_epi32(
            _mm512_set1_epi32(start.wrapping_add(j as u32) as i32),
            lanes,
        );
        let h = lowbias32x16(_mm512_xor_si512(i, key));
        // SAFETY: j + 16 <= n: one unaligned __m512 of `xb` from j, 16 bytes of `out`.
        unsafe {
            let code = c.code::<M>(_mm512_loadu_ps(xb.as_ptr().add(j)), h);
            _mm_storeu_si128(out.as_mut_ptr().add(j).cast(), _mm512_cvtepi32_epi8(code));
        }
        j += 16;
    }
    for (k, (o, &v)) in out[j..n].iter_mut().zip(&xb[j..]).enumerate() {
        let h = crate::rng::lowbias32(start.wrapping_add((j + k) as u32) ^ d16.key);
        *o = fp8::stochastic_in_range(f, q.of(v), h);
    }
}

/// The constants of [`Stochastic16::code`]: a block's quotient and `fp8::stochastic_in_range`
/// on 16 lanes.
struct Stochastic16 {
    by: __m512,
    multiply: bool,
    fmax: __m512,
    abs: __m512i,
    /// `128 - bias`: the f32 exponent field of the format's subnormal binade.
    low: __m512i,
    /// `254 + m`: `t`'s multiplier `2^(m - E)` has exponent field `low_m - eb`.
    low_m: __m512i,
    /// `((127 - bias) << m) + 2^m`, taken from `eb << m` for a normal code.
    rebias: __m512i,
    top: __m512i,
}

impl Stochastic16 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn new(f: fp8::Format, q: fp8::Quotient) -> Stochastic16 {
        Stochastic16 {
            by: _mm512_set1_ps(q.inv.unwrap_or(q.s)),
            multiply: q.inv.is_some(),
            fmax: _mm512_set1_ps(q.fmax),
            abs: _mm512_set1_epi32(ABS),
            low: _mm512_set1_epi32(128 - f.bias),
            low_m: _mm512_set1_epi32(254 + f.m as i32),
            rebias: _mm512_set1_epi32(((127 - f.bias) << f.m) + (1 << f.m)),
            top: _mm512_set1_epi32(f.max_code as i32),
        }
    }

    /// The 8-bit-layout codes of the 16 elements `v` with draws `h`: `q.of(v)` (the
    /// quotient, clamped to ±FMAX), then `fp8::stochastic_in_range` operation for
    /// operation: `t = |y| 2^(M - E)` (`E` at least the subnormal binade's), one up from
    /// `floor(t)` when the draw's top 24 bits, as a fraction, are below `t - floor(t)`, and
    /// `2^M` per binade above the subnormal one.
    #[target_feature(enable = "avx512f,avx512dq")]
    #[inline]
    fn code<const M: u32>(&self, v: __m512, h: __m512i) -> __m512i {
        let y = if self.multiply {
            _mm512_mul_ps(v, self.by)
        } else {
            _mm512_div_ps(v, self.by)
        };
        // `clamp(-FMAX, FMAX)` of a quotient that is never NaN (a finite element over a
        // positive finite scale).
        let y = _mm512_max_ps(
            _mm512_min_ps(y, self.fmax),
            _mm512_sub_ps(_mm512_setzero_ps(), self.fmax),
        );
        let bits = _mm512_castps_si512(y);
        let a = _mm512_and_si512(bits, self.abs);
        let eb = _mm512_max_epi32(_mm512_srli_epi32::<23>(a), self.low);
        let scale = _mm512_slli_epi32::<23>(_mm512_sub_epi32(self.low_m, eb));
        let t = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(scale));
        let fl = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let u = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_srli_epi32::<8>(h)),
            _mm512_set1_ps(1.0 / 16_777_216.0),
        );
        let up = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(u, _mm512_sub_ps(t, fl));
        let q = _mm512_sub_epi32(
            _mm512_castps_si512(_mm512_add_ps(fl, _mm512_set1_ps(8_388_608.0))),
            _mm512_set1_epi32(0x4B00_0000),
        );
        let q = _mm512_mask_add_epi32(q, up, q, _mm512_set1_epi32(1));
        let normal = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32::<M>(eb), q), self.rebias);
        let code = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(eb, self.low), normal, q);
        let code = _mm512_min_epi32(code, self.top);
        // code | (y's sign bit moved to bit 7): A | (B & C) is 0xF8.
        _mm512_ternarylogic_epi32::<0xF8>(
            code,
            _mm512_srli_epi32::<24>(bits),
            _mm512_set1_epi32(0x80),
        )
    }
}
