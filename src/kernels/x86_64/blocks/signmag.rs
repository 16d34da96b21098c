//! AVX2 kernels of qsgd, ternary and natural compression (encode and decode), sign's
//! decode, random-k's draw filters, bf16 encode and `dct`'s transpose into lanes.

use core::arch::x86_64::*;

use super::*;

/// Sign-magnitude encode of `BITS` (2, 4 or 8) bits with AVX2 (the contract of
/// `scalar::encode_signmag`, every code byte written). Blocks must start on byte
/// boundaries: `block % (8 / BITS) == 0`.
///
/// # Safety
/// The CPU must support AVX2 and FMA (as every CPU the Avx2 backend accepts does).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn encode_signmag_avx2<const BITS: u32>(
    x: &[f32],
    block: usize,
    measure: scalar::Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let mut sd = StepDraws::new(draws);
    scalar::encode_signmag_blocks::<BITS>(
        x,
        block,
        measure,
        draws,
        first,
        steps,
        codes,
        #[inline(always)]
        |xb| l2_squares(xb),
        #[inline(always)]
        |xb, cb, m, start| signmag_block::<BITS>(xb, cb, m, &mut sd, start),
    )
}

/// Sign-magnitude codes of one finite block (inside one index window) with scale `m`: 32
/// a step ([`loops::signmag_steps`]), the rest padded to 32 ([`padded_rest`]); the oracle
/// where the scale is below 2^-100.
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn signmag_block<const BITS: u32>(
    xb: &[f32],
    cb: &mut [u8],
    m: f32,
    sd: &mut StepDraws,
    start: u64,
) {
    let levels = (1u32 << (BITS - 1)) - 1;
    let (pre, inv) = scalar::level_multiplier(m, levels as f32);
    if pre != 1.0 {
        return scalar::quantise_signmag_bytes(xb, cb, m, BITS, sd.draws, start);
    }
    // SAFETY: this function's features are `Avx2`'s.
    let n32 = unsafe { loops::signmag_steps::<Avx2, BITS>((inv, levels), xb, cb, sd, start) };
    if n32 < xb.len() {
        let (rest, at) = (&mut cb[n32 * BITS as usize / 8..], start + n32 as u64);
        padded_rest(
            &xb[n32..],
            rest,
            #[inline(always)]
            |x32, c32| signmag_block::<BITS>(x32, &mut c32[..4 * BITS as usize], m, sd, at),
        );
    }
}

/// Natural-compression encode with AVX2 (the contract of `scalar::encode_natural`).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn encode_natural_avx2(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let mut sd = StepDraws::new(draws);
    scalar::encode_natural_blocks(
        x,
        block,
        draws,
        first,
        refs,
        codes,
        #[inline(always)]
        |xb, cb, r, start| natural_block(xb, cb, r, &mut sd, start),
    )
}

/// `scalar::natural_block` in 32-bit lanes. The oracle decides in f64; the same decisions
/// are exact in integers and f32 (u24 below is the draw's top 24 bits, u = u24 / 2^24, and
/// `kmin = r - 126`, the smallest exponent with a code of its own).
///
/// Every element of a block is below `2^r` (`r = floor(log2 max) + 1`, unless clamped at
/// 127). For `r <= 126`, `s = |x| * 2^-r` is exact and normal for every `|x| >= 2^kmin`,
/// its biased exponent is the code `e - kmin + 1` that rounding down gives, and its
/// fraction bits `F` round up when `u < F / 2^23`, that is `u24 >> 1 < F`; `e < r` holds,
/// so the round up never passes `r`. For `|x|` in `(0, 2^kmin)`, the oracle's code is 1
/// when `u < |x| / 2^kmin` and 0 otherwise; `s` is subnormal there, with exponent bits 0
/// and `F = |x| * 2^(149 - r)`, so the same test decides, provided `s` is exact. It is for
/// `r <= 0` (a scale of at least 1 keeps a multiple of 2^-149 one). For `r >= 1` it may
/// round, so a step of 32 that holds such an element (rare: below the block's max times
/// about 2^-126) takes the general form ([`natural_general8`]), as does every step of a
/// block with `r = 127`. The short form ([`natural_fast8`]) is 18 vector operations per 8
/// elements, 20 with the check. Both give the level `m` with the input's sign, and
/// [`signmag_bytes`] makes the sign-magnitude byte.
#[target_feature(enable = "avx2")]
#[inline]
fn natural_block(xb: &[f32], cb: &mut [u8], r: i32, sd: &mut StepDraws, start: u64) {
    match r {
        ..=0 => natural_steps::<true, false>(xb, cb, r, sd, start),
        1..=126 => natural_steps::<true, true>(xb, cb, r, sd, start),
        _ => natural_steps::<false, false>(xb, cb, r, sd, start),
    }
}

/// [`natural_block`] with the short form (`FAST`), which checks its steps for elements in
/// `(0, 2^kmin)` when `CHECK`, or with the general form for every step.
#[target_feature(enable = "avx2")]
#[inline]
fn natural_steps<const FAST: bool, const CHECK: bool>(
    xb: &[f32],
    cb: &mut [u8],
    r: i32,
    sd: &mut StepDraws,
    start: u64,
) {
    let general = NaturalConsts::new(r);
    let fast = NaturalFast::new(r.min(126));
    let n32 = steps32x4::<true, true>(
        xb,
        start,
        sd,
        #[inline(always)]
        |v, [h0, h1, h2, h3]| {
            if FAST {
                let (l0, t0) = natural_fast8::<CHECK>(&fast, v[0], h0);
                let (l1, t1) = natural_fast8::<CHECK>(&fast, v[1], h1);
                let (l2, t2) = natural_fast8::<CHECK>(&fast, v[2], h2);
                let (l3, t3) = natural_fast8::<CHECK>(&fast, v[3], h3);
                if !CHECK {
                    return [l0, l1, l2, l3];
                }
                let tiny = _mm256_or_si256(_mm256_or_si256(t0, t1), _mm256_or_si256(t2, t3));
                if _mm256_testz_si256(tiny, tiny) == 1 {
                    return [l0, l1, l2, l3];
                }
            }
            [
                natural_general8(&general, v[0], h0),
                natural_general8(&general, v[1], h1),
                natural_general8(&general, v[2], h2),
                natural_general8(&general, v[3], h3),
            ]
        },
        #[inline(always)]
        |signed, g| {
            let bytes = signmag_bytes(signed, _mm256_set1_epi8(i8::MIN));
            let o = &mut cb[g..g + 32];
            // SAFETY: `o` holds 32 bytes, one unaligned __m256i.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), bytes) };
        },
    );
    if n32 < xb.len() {
        let at = start + n32 as u64;
        padded_rest(
            &xb[n32..],
            &mut cb[n32..xb.len()],
            #[inline(always)]
            |x32, c32| natural_steps::<FAST, CHECK>(x32, c32, r, sd, at),
        );
    }
}

/// Per-block constants of [`natural_fast8`].
struct NaturalFast {
    /// `2^-r`.
    scale: __m256,
    /// `0x8000_0000 - bits(2^kmin)`: `|x|` bits plus this exceed it (as i32) exactly for
    /// `|x|` in `(0, 2^kmin)`.
    tiny: __m256i,
}

impl NaturalFast {
    #[target_feature(enable = "avx2")]
    #[inline]
    fn new(r: i32) -> NaturalFast {
        debug_assert!((scalar::NATURAL_MIN_REF..=126).contains(&r));
        // 2^kmin is at least 2^-149, the least subnormal, as r >= -23.
        let kmin_bits = scalar::pow2_f32(r - 126).to_bits();
        NaturalFast {
            scale: _mm256_set1_ps(pow2(-r)),
            tiny: _mm256_set1_epi32(0x8000_0000u32.wrapping_sub(kmin_bits) as i32),
        }
    }
}

/// The signed natural levels of the 8 elements in `v` (draws `h`), and when
/// `CHECK` the lanes (-1) whose `|x|` lies in `(0, 2^kmin)`, where the levels may be wrong
/// (see [`natural_block`]; zero without the check).
#[target_feature(enable = "avx2")]
#[inline]
fn natural_fast8<const CHECK: bool>(c: &NaturalFast, v: __m256, h: __m256i) -> (__m256i, __m256i) {
    let a = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(ABS));
    let s = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(a), c.scale));
    let down = _mm256_srli_epi32::<23>(s);
    let frac = _mm256_and_si256(s, _mm256_set1_epi32(0x007F_FFFF));
    let u23 = _mm256_srli_epi32::<9>(h);
    // `up` is -1 where the draw rounds up.
    let up = _mm256_cmpgt_epi32(frac, u23);
    let level = _mm256_sign_epi32(_mm256_sub_epi32(down, up), _mm256_castps_si256(v));
    if !CHECK {
        return (level, _mm256_setzero_si256());
    }
    let tiny = _mm256_cmpgt_epi32(_mm256_add_epi32(a, c.tiny), c.tiny);
    (level, tiny)
}

/// Per-block constants of [`natural_general8`].
struct NaturalConsts {
    r: __m256i,
    kmin_1: __m256i,
    /// `2^(-76 - kmin)`.
    lo_scale: __m256,
}

impl NaturalConsts {
    #[target_feature(enable = "avx2")]
    #[inline]
    fn new(r: i32) -> NaturalConsts {
        let kmin = r - 126;
        NaturalConsts {
            r: _mm256_set1_epi32(r),
            kmin_1: _mm256_set1_epi32(kmin - 1),
            lo_scale: _mm256_set1_ps(pow2(-76 - kmin)),
        }
    }
}

/// `2^k` for `k` in the normal range [-126, 127].
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The signed natural levels of the 8 elements in `v`, with draws `h`, for any
/// finite block:
/// - `e = floor(log2 |x|)` and the fraction `F / 2^23 = |x| / 2^e - 1` come from the
///   bits of `|x|`, of `|x| * 2^64` for subnormals (exact, and normal);
/// - at or above `kmin`, `u < F / 2^23` is `u24 < 2 F` (both below 2^25);
/// - below it, `u < |x| / 2^kmin` is `u24 < |x| * 2^(24 - kmin)`, computed as
///   `(|x| * 2^100) * 2^(-76 - kmin)`: both factors are normal powers of two for
///   `kmin` in [-149, 1], and the product lies in [2^-126, 2^24), so it is exact.
#[target_feature(enable = "avx2")]
#[inline]
fn natural_general8(c: &NaturalConsts, v: __m256, h: __m256i) -> __m256i {
    let zero = _mm256_setzero_si256();
    let a = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(ABS));
    let sub = _mm256_cmpeq_epi32(_mm256_srli_epi32::<23>(a), zero);
    let af = _mm256_castsi256_ps(a);
    let scaled = _mm256_mul_ps(af, _mm256_set1_ps(pow2(64)));
    let an = _mm256_castps_si256(_mm256_blendv_ps(af, scaled, _mm256_castsi256_ps(sub)));
    let e = _mm256_sub_epi32(
        _mm256_sub_epi32(_mm256_srli_epi32::<23>(an), _mm256_set1_epi32(127)),
        _mm256_and_si256(sub, _mm256_set1_epi32(64)),
    );
    let f2 = _mm256_slli_epi32::<1>(_mm256_and_si256(an, _mm256_set1_epi32(0x007F_FFFF)));
    let u24 = _mm256_srli_epi32::<8>(h);
    // At or above kmin: round up past e with probability F / 2^23 (never past r).
    let up_hi = _mm256_and_si256(_mm256_cmpgt_epi32(f2, u24), _mm256_cmpgt_epi32(c.r, e));
    let k_hi = _mm256_sub_epi32(e, up_hi);
    // Below kmin: kmin with probability |x| / 2^kmin, else zero (kmin - 1; zero itself
    // lands here and stays zero).
    let t = _mm256_mul_ps(_mm256_mul_ps(af, _mm256_set1_ps(pow2(100))), c.lo_scale);
    let up_lo = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_cvtepi32_ps(u24), t));
    let k_lo = _mm256_sub_epi32(c.kmin_1, up_lo);
    let k = _mm256_blendv_epi8(k_lo, k_hi, _mm256_cmpgt_epi32(e, c.kmin_1));
    _mm256_sign_epi32(_mm256_sub_epi32(k, c.kmin_1), _mm256_castps_si256(v))
}

/// Stores 8 decoded values `v` at `out[j..j + 8]` as mode `M` says ([`Lanes::put`]).
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn put8<const M: u8>(out: &mut [f32], j: usize, v: __m256) {
    let o = &mut out[j..j + 8];
    // SAFETY: `o` holds 8 f32, one unaligned __m256 for the load and the store; this
    // function's features are `Avx2`'s.
    unsafe { Avx2::put::<M>(o.as_mut_ptr(), v) }
}

/// `scalar::residual_of(p, d)` in 8 lanes ([`Lanes::residual`]).
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn residual8(p: __m256, d: __m256) -> __m256 {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { Avx2::residual(p, d) }
}

/// Sign-magnitude decode with AVX2 (`scalar::decode_signmag`), in any mode ([`put8`]);
/// blocks must start on byte boundaries (`block % (8 / BITS) == 0`).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn decode_signmag_avx2<const M: u8, const BITS: u32>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    let per = (8 / BITS) as usize;
    assert!(
        block.is_multiple_of(per),
        "blocks must start on byte boundaries"
    );
    let mag_mask = _mm256_set1_epi32((1 << (BITS - 1)) - 1);
    let to_sign = _mm_cvtsi32_si128(32 - BITS as i32);
    let field = _mm256_set1_epi32((1 << BITS) - 1);
    let shifts = _mm256_mullo_epi32(
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        _mm256_set1_epi32(BITS as i32),
    );
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = _mm256_set1_ps(scalar::get_step(steps, b));
        let cb = &codes[b * block / per..];
        let n8 = ob.len() / 8 * 8;
        for g in (0..n8).step_by(8) {
            let at = g / per;
            let c = match BITS {
                8 => _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(
                    cb[at..at + 8].try_into().expect("8 bytes"),
                ))),
                // 8 fields of BITS bits in one little-endian word, field k at bit BITS * k.
                4 => _mm256_and_si256(
                    _mm256_srlv_epi32(
                        _mm256_set1_epi32(i32::from_le_bytes(
                            cb[at..at + 4].try_into().expect("4"),
                        )),
                        shifts,
                    ),
                    field,
                ),
                _ => _mm256_and_si256(
                    _mm256_srlv_epi32(
                        _mm256_set1_epi32(u16::from_le_bytes([cb[at], cb[at + 1]]) as i32),
                        shifts,
                    ),
                    field,
                ),
            };
            let mag = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, mag_mask)), s);
            let neg = _mm256_sll_epi32(c, to_sign); // the field's top bit to bit 31
            let v = _mm256_xor_ps(
                mag,
                _mm256_castsi256_ps(_mm256_and_si256(neg, _mm256_set1_epi32(SIGN))),
            );
            put8::<M>(ob, g, v);
        }
        if n8 < ob.len() {
            let rest = ob.len() - n8;
            scalar::decode_signmag::<M>(
                &steps[4 * b..4 * b + 4],
                &cb[n8 / per..],
                rest,
                BITS,
                &mut ob[n8..],
            );
        }
    }
}

/// Sign decode with AVX2 (`scalar::decode_sign`), in any mode ([`put8`]); blocks must
/// start on byte boundaries (`block % 8 == 0`).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn decode_sign_avx2<const M: u8>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    assert!(
        block.is_multiple_of(8),
        "blocks must start on byte boundaries"
    );
    // Bit k of the byte to bit 31 of lane k.
    let shifts = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
    // Bit 8 q + k of a little-endian word of four code bytes to bit 31 of lane k: the
    // shifts of byte q are 8 q less.
    let by = |q: i32| _mm256_sub_epi32(shifts, _mm256_set1_epi32(8 * q));
    let word_shifts = [by(0), by(1), by(2), by(3)];
    let sign = _mm256_set1_epi32(SIGN);
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = _mm256_set1_ps(scalar::get_step(steps, b));
        // The 8 values at `ob[$g..]` from the codes broadcast in `$word`, each lane's bit
        // moved to the sign by `$sh`.
        macro_rules! put_eight {
            ($word:expr, $sh:expr, $g:expr) => {
                let bits = _mm256_sllv_epi32($word, $sh);
                let v = _mm256_xor_ps(s, _mm256_castsi256_ps(_mm256_and_si256(bits, sign)));
                put8::<M>(ob, $g, v);
            };
        }
        let cb = &codes[b * block / 8..];
        let n8 = ob.len() / 8 * 8;
        let n32 = ob.len() / 32 * 32;
        // 32 values from one word: one load and broadcast for four stores, where a byte
        // per 8 values left the loop bound by its own overhead (and by where it fell in
        // the code: 31 to 40 GB/s at 64 Ki on a Zen 3 by placement alone).
        for (g, w) in (0..n32).step_by(32).zip(cb.as_chunks::<4>().0) {
            let word = _mm256_set1_epi32(i32::from_le_bytes(*w));
            for (q, sh) in word_shifts.iter().enumerate() {
                put_eight!(word, *sh, g + 8 * q);
            }
        }
        for g in (n32..n8).step_by(8) {
            put_eight!(_mm256_set1_epi32(cb[g / 8] as i32), shifts, g);
        }
        if n8 < ob.len() {
            let rest = ob.len() - n8;
            scalar::decode_sign::<M>(&steps[4 * b..4 * b + 4], &cb[n8 / 8..], rest, &mut ob[n8..]);
        }
    }
}

/// Natural-compression decode with AVX2 (`scalar::decode_natural`, reference bytes already
/// validated), in any mode ([`put8`]).
///
/// A code `c` (sign `s`, `m = c & 0x7F`) of a block with reference byte `rb` decodes to
/// `±2^(E - 127)` with `E = m + rb - 127`, or to `±0` for `m = 0`. Where `E >= 1` the value
/// is normal and its top 16 bits are `(s << 8 | E) << 7` (the rest zero), which 16-bit
/// lanes build for 16 codes at once. Codes below that (`1 <= m <= 127 - rb`, subnormal
/// values, rare) exist only in blocks with `rb < 127`, which check each group of 16 and
/// decode a group holding one with the general form ([`natural_decode8`]).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn decode_natural_avx2<const M: u8>(
    refs: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        if refs[b] == scalar::NATURAL_NONFINITE {
            // The oracle writes NaN.
            scalar::decode_natural::<M>(&refs[b..=b], cb, ob.len(), ob);
            continue;
        }
        let off = refs[b] as i32 - 127;
        let n16 = if off >= 0 {
            natural_block16::<M, false>(off, cb, ob)
        } else {
            natural_block16::<M, true>(off, cb, ob)
        };
        let n8 = ob.len() / 8 * 8;
        for g in (n16..n8).step_by(8) {
            let c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(
                cb[g..g + 8].try_into().expect("8 bytes"),
            )));
            put8::<M>(ob, g, natural_decode8(c, off));
        }
        if n8 < ob.len() {
            let rest = ob.len() - n8;
            scalar::decode_natural::<M>(&refs[b..=b], &cb[n8..], rest, &mut ob[n8..]);
        }
    }
}

/// The 16-code steps of one finite natural block (see [`decode_natural_avx2`]); `CHECK`
/// when the block's reference admits subnormal values (`off < 0`). Returns the number of
/// elements done.
#[target_feature(enable = "avx2")]
#[inline]
fn natural_block16<const M: u8, const CHECK: bool>(off: i32, cb: &[u8], ob: &mut [f32]) -> usize {
    let i16x16 = _mm256_set1_epi16;
    let zero = _mm256_setzero_si256();
    let offv = i16x16(off as i16);
    // m in 1..=-off decodes below the normal range.
    let low_end = i16x16((1 - off) as i16);
    let chunks = cb.chunks_exact(16);
    let done = cb.len() - chunks.remainder().len();
    for (k, cc) in chunks.enumerate() {
        // SAFETY: `cc` holds 16 bytes, one unaligned __m128i.
        let c = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(cc.as_ptr().cast()) });
        let m = _mm256_and_si256(c, i16x16(0x7F));
        let z = _mm256_cmpeq_epi16(m, zero);
        if CHECK {
            let sub = _mm256_andnot_si256(z, _mm256_cmpgt_epi16(low_end, m));
            if _mm256_testz_si256(sub, sub) == 0 {
                for h in [0, 8] {
                    let c8 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(i64::from_le_bytes(
                        cc[h..h + 8].try_into().expect("8 bytes"),
                    )));
                    put8::<M>(ob, 16 * k + h, natural_decode8(c8, off));
                }
                continue;
            }
        }
        // c + (c & 0x80) is s << 8 | m; adding off where m != 0 makes it s << 8 | E.
        let se = _mm256_add_epi16(c, _mm256_and_si256(c, i16x16(0x80)));
        let se = _mm256_add_epi16(se, _mm256_andnot_si256(z, offv));
        let top = _mm256_slli_epi16::<7>(se);
        // Words 0-3, 8-11 | 4-7, 12-15, so that the unpacks below give elements in order.
        let top = _mm256_permute4x64_epi64::<0b11_01_10_00>(top);
        let lo = _mm256_unpacklo_epi16(zero, top);
        let hi = _mm256_unpackhi_epi16(zero, top);
        put8::<M>(ob, 16 * k, _mm256_castsi256_ps(lo));
        put8::<M>(ob, 16 * k + 8, _mm256_castsi256_ps(hi));
    }
    done
}

/// The f32 values of 8 natural codes (in 32-bit lanes of `c`) of a block whose reference
/// byte is `off + 127`, subnormal results included.
#[target_feature(enable = "avx2")]
#[inline]
fn natural_decode8(c: __m256i, off: i32) -> __m256 {
    let i32x8 = _mm256_set1_epi32;
    let zero = _mm256_setzero_si256();
    let rk = i32x8(off - 127);
    let m = _mm256_and_si256(c, i32x8(0x7F));
    let k = _mm256_add_epi32(rk, m); // the power of two, in [-149, 127]
    let normal = _mm256_slli_epi32::<23>(_mm256_max_epi32(_mm256_add_epi32(k, i32x8(127)), zero));
    let count = _mm256_min_epi32(
        _mm256_max_epi32(_mm256_add_epi32(k, i32x8(149)), zero),
        i32x8(31),
    );
    let sub = _mm256_sllv_epi32(i32x8(1), count);
    let bits = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(k, i32x8(-127)));
    let bits = _mm256_andnot_si256(_mm256_cmpeq_epi32(m, zero), bits);
    let bits = _mm256_xor_si256(
        bits,
        _mm256_slli_epi32::<24>(_mm256_and_si256(c, i32x8(0x80))),
    );
    _mm256_castsi256_ps(bits)
}

/// Compare and compress on hash draws with AVX2: `portable::filter_draw_lt`'s contract
/// (indices `i < n` with `lowbias32(first + i ^ key) < t`, ascending), drawing 64 at a
/// time with [`GroupDraws`]. With `zero`, it also sets `zero[..consumed]` to 0.0 as it
/// goes (random-k's `decode_into`, whose output is zero but at the kept elements): the
/// stores overlap the hashing, where a separate fill first took a sixth of the decode.
///
/// # Safety
/// The CPU must support AVX2, POPCNT and BMI1 (the x86-64-v3 level that the `Avx2`
/// backend detects).
///
/// # Panics
/// If `zero` is shorter than `n`.
#[target_feature(enable = "avx2,popcnt,bmi1")]
pub unsafe fn filter_draw_lt_avx2(
    first: u32,
    key: u32,
    t: u32,
    n: usize,
    idx: &mut [u32],
    mut zero: Option<&mut [f32]>,
) -> (usize, usize) {
    if let Some(z) = &zero {
        assert!(z.len() >= n, "{} elements to zero of {n}", z.len());
    }
    let mut mask64 = relative_masks(first, key, t);
    crate::kernels::x86_64::compress_masks_avx2(
        n,
        idx,
        crate::kernels::rare_keep(t.into()),
        |done, len| {
            if len < 64 {
                if let Some(z) = zero.as_deref_mut() {
                    z[done..done + len].fill(0.0);
                }
                return draw_mask_tail(first.wrapping_add(done as u32), key, t, len);
            }
            if let Some(z) = zero.as_deref_mut() {
                let z: &mut [f32; 64] = (&mut z[done..done + 64]).try_into().expect("64");
                *z = [0.0; 64];
            }
            mask64(done)
        },
    )
}

/// Keep masks of hash draws with AVX2: `portable::draw_masks`'s contract (bit `i % 64` of
/// entry `i / 64` set when `lowbias32(first + i ^ key) < t`, for `i < n`), 64 elements
/// per entry. Returns how many bits are set.
///
/// # Safety
/// The CPU must support AVX2 and POPCNT (the x86-64-v3 level that the `Avx2` backend
/// detects).
#[target_feature(enable = "avx2,popcnt")]
pub unsafe fn draw_masks_avx2(
    first: u32,
    key: u32,
    t: u32,
    n: usize,
    masks: &mut [core::mem::MaybeUninit<u64>],
) -> usize {
    let mut mask64 = relative_masks(first, key, t);
    let mut count = 0;
    let (full, tail) = masks[..n.div_ceil(64)].split_at_mut(n / 64);
    for (w, slot) in full.iter_mut().enumerate() {
        let m = mask64(64 * w);
        count += m.count_ones() as usize;
        slot.write(m);
    }
    if let [slot] = tail {
        let m = draw_mask_tail(first.wrapping_add((n & !63) as u32), key, t, n % 64);
        count += m.count_ones() as usize;
        slot.write(m);
    }
    count
}

/// Counts the draws below `t` with AVX2: `portable::count_draw_lt`'s contract (how many
/// `i < n` have `lowbias32(first + i ^ key) < t`). The indices up to the first multiple of
/// 64 and the last partial group go to the portable count; the groups between use
/// [`GroupDraws`], in two lane counters.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn count_draw_lt_avx2(first: u32, key: u32, t: u32, n: usize) -> usize {
    use crate::kernels::portable::count_draw_lt as portable_count;
    let head = n.min(((64 - first % 64) % 64) as usize);
    let groups = (n - head) / 64;
    let start = first.wrapping_add(head as u32);
    let mut draws = GroupDraws::new(key, t);
    let (mut c0, mut c1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    // A lane counter gains at most 4 per group, and n <= 2^32 (one index window), so it
    // stays below 2^31.
    for g in 0..groups {
        let m = draws.group(start.wrapping_add(64 * g as u32));
        for pair in m.chunks_exact(2) {
            // A kept lane compares to -1.
            c0 = _mm256_sub_epi32(c0, pair[0]);
            c1 = _mm256_sub_epi32(c1, pair[1]);
        }
    }
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 bytes, one unaligned __m256i.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), _mm256_add_epi32(c0, c1)) };
    let done = head + 64 * groups;
    portable_count(first, key, t, head)
        + lanes.iter().map(|&c| c as usize).sum::<usize>()
        + portable_count(first.wrapping_add(done as u32), key, t, n - done)
}

/// f32 to bfloat16 with AVX2 (`scalar::f32_to_bf16`: round to nearest even, NaN quieted),
/// 16 elements per step. Returns whether any input was NaN or ±Inf. Writes
/// `2 * min(x.len(), out.len() / 2)` bytes.
///
/// The rounding add is right for every input but NaN (it can carry a NaN's payload into
/// the exponent, or leave it signalling), so the first pass leaves NaN out, and finds
/// from the running maximum of `|x|`'s bits whether there was one; only then does a second
/// pass convert with NaN quieted.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn encode_bf16_avx2(x: &[f32], out: &mut [u8]) -> bool {
    let n = x.len().min(out.len() / 2);
    let (x, out) = (&x[..n], &mut out[..2 * n]);
    let mx = bf16_pass::<false>(x, out);
    if mx > INF_BITS {
        bf16_pass::<true>(x, out);
    }
    mx >= INF_BITS
}

/// One bf16 conversion pass over `x` into `out` (`2 * x.len()` bytes), quieting NaN when
/// `NAN`; returns the largest `|x|` bit pattern.
#[target_feature(enable = "avx2")]
#[inline]
fn bf16_pass<const NAN: bool>(x: &[f32], out: &mut [u8]) -> u32 {
    let i32x8 = _mm256_set1_epi32;
    let mut mx = _mm256_setzero_si256();
    let mut conv = |v: __m256| {
        let u = _mm256_castps_si256(v);
        let a = _mm256_and_si256(u, i32x8(ABS));
        mx = _mm256_max_epu32(mx, a);
        let hi = _mm256_srli_epi32::<16>(u);
        let odd = _mm256_and_si256(hi, i32x8(1));
        let rounded =
            _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(u, i32x8(0x7FFF)), odd));
        if NAN {
            let nan = _mm256_or_si256(hi, i32x8(0x40));
            _mm256_blendv_epi8(rounded, nan, _mm256_cmpgt_epi32(a, i32x8(INF_BITS as i32)))
        } else {
            rounded
        }
    };
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for (c, o) in chunks.zip(out.chunks_exact_mut(32)) {
        // SAFETY: `c` holds 16 f32, two unaligned __m256.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(c.as_ptr()),
                _mm256_loadu_ps(c.as_ptr().add(8)),
            )
        };
        // Both hold values below 2^16, so the unsigned-saturating pack is exact.
        let p = _mm256_packus_epi32(conv(lo), conv(hi));
        let p = _mm256_permute4x64_epi64::<0b11_01_10_00>(p);
        // SAFETY: `o` holds 32 bytes, one unaligned __m256i.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), p) };
    }
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 32 bytes, the size of one __m256i; unaligned store.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), mx) };
    let done = x.len() - tail.len();
    scalar::encode_u16(tail, &mut out[2 * done..], scalar::f32_to_bf16);
    let tail_max = tail
        .iter()
        .map(|v| v.to_bits() & ABS as u32)
        .max()
        .unwrap_or(0);
    lanes.into_iter().fold(tail_max, u32::max)
}

/// Sixteen rows of `w` elements (`w` 8, 16, 32 or 64; row `t` at `rows[t * stride..]`)
/// into lanes: `a[n][t]` = element `n` of row `t`, for `n < w`. Blocks of 8 x 8: each
/// vector pairs four columns of row `t` with the same four of row `t + 4` (a load and an
/// insert, no shuffle), and a 4 x 4 transpose in each 128-bit half (8 shuffles per four
/// columns) leaves column `n` of eight rows in one vector: 16 shuffles per 64 values
/// against 64 scalar moves.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn rows_to_lanes16(rows: &[f32], stride: usize, w: usize, a: &mut [[f32; 16]]) {
    assert!(matches!(w, 8 | 16 | 32 | 64) && stride >= w && a.len() >= w);
    assert!(rows.len() >= 15 * stride + w);
    for n0 in (0..w).step_by(4) {
        for t0 in [0, 8] {
            // Row t0 + i's columns n0..n0 + 4 beside row t0 + i + 4's.
            let pair = |i: usize| {
                let at = (t0 + i) * stride + n0;
                // SAFETY: at + 4 * stride + 4 <= 15 stride + n0 + 4 <= 15 stride + w <=
                // rows.len() (asserted, t0 + i + 4 <= 15, n0 + 4 <= w); unaligned loads.
                let (lo, hi) = unsafe {
                    (
                        _mm_loadu_ps(rows.as_ptr().add(at)),
                        _mm_loadu_ps(rows.as_ptr().add(at + 4 * stride)),
                    )
                };
                _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi)
            };
            let (r0, r1, r2, r3) = (pair(0), pair(1), pair(2), pair(3));
            let t0_ = _mm256_unpacklo_ps(r0, r1);
            let t1_ = _mm256_unpackhi_ps(r0, r1);
            let t2_ = _mm256_unpacklo_ps(r2, r3);
            let t3_ = _mm256_unpackhi_ps(r2, r3);
            let cols = [
                _mm256_shuffle_ps::<0x44>(t0_, t2_),
                _mm256_shuffle_ps::<0xEE>(t0_, t2_),
                _mm256_shuffle_ps::<0x44>(t1_, t3_),
                _mm256_shuffle_ps::<0xEE>(t1_, t3_),
            ];
            for (c, v) in cols.into_iter().enumerate() {
                // SAFETY: n0 + c < w <= a.len() (asserted); t0 + 8 <= 16, one unaligned
                // 32-byte store into the lane row.
                unsafe { _mm256_storeu_ps(a[n0 + c].as_mut_ptr().add(t0), v) };
            }
        }
    }
}
