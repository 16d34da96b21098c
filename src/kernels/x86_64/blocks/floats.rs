//! AVX2 kernels of fp8 and fp4: the decoders (fp8's through the loops written once,
//! fp4's by table lookups in registers) and the nearest encoders, whose groups of blocks
//! and whole steps are the loops written once (`loops::nearest_group`,
//! `loops::nearest_steps`) over this width's [`FloatCodes`].

use core::arch::x86_64::*;

use super::*;

/// fp8 decode of a scaled frame's whole blocks (a multiple of 16 long) on 8 lanes, in
/// mode `M` ([`loops::decode_fp8`]); returns how many blocks it decoded.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn decode_fp8<const M: u8>(
    e4m3: bool,
    scale: crate::kernels::fp8::Scale,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { loops::decode_fp8::<Avx2, M>(e4m3, scale, block, scales, codes, out) }
}

/// fp8 decode of an unscaled frame on 8 lanes, in mode `M`
/// ([`loops::decode_fp8_unscaled`]); returns how many elements it decoded.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn decode_fp8_unscaled<const M: u8>(e4m3: bool, codes: &[u8], out: &mut [f32]) -> usize {
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { loops::decode_fp8_unscaled::<Avx2, M>(e4m3, codes, out) }
}

/// fp4 decode (the layout of `fp8::decode` with two codes per byte, low nibble first) of
/// the whole blocks of 16 or 32 elements that `out`, `codes` and `scales` hold
/// ([`loops::float_blocks`]), in mode `M` (any: [`put8`]); returns how many blocks it decoded (an
/// even number with blocks of 16, 0 if a value in `fours` is not a bfloat16).
///
/// `fours` holds the sixteen codes' values. Each is a bfloat16 (every 4-bit format's
/// values are 0 or a power of two times 1 or 1.5), so its f32 is two bytes over two zero
/// bytes: 32 codes at a time, a byte shuffle lays out each code's byte twice in element
/// order (two 128-bit lanes of 16), a mask and a shift keep the low nibble in the first
/// copy and the high one in the second, two table lookups (one per byte of the value)
/// and three rounds of interleaving with zeros give the 32 f32 in order. Each is then
/// multiplied by its block's scale: the same f32 product as `fp8::decode`'s per element.
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn decode_fp4<const M: u8>(
    fours: &[f32; 16],
    scale: crate::kernels::fp8::Scale,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    use crate::kernels::fp8::{Scale, scale_of};
    assert!(matches!(block, 16 | 32));
    let Some(t) = fp4_tables(fours) else {
        return 0;
    };
    let (mut blocks, sb) = loops::float_blocks(scale, block, block / 2, scales, codes, out);
    if block == 16 {
        blocks &= !1;
    }
    let (scales, codes, out) = (
        &scales[..blocks * sb],
        &codes[..blocks * block / 2],
        &mut out[..blocks * block],
    );
    // One loop per common scale kind, so that reading a block's scale is not a match per
    // block.
    match scale {
        Scale::F32 => fp4_groups::<M>(t, block, sb, scales, codes, out, |sc| {
            scale_of(Scale::F32, sc)
        }),
        Scale::E8m0 => fp4_groups::<M>(t, block, sb, scales, codes, out, |sc| {
            scale_of(Scale::E8m0, sc)
        }),
        Scale::E4m3 { global } => {
            // The E4M3 scales of up to 256 blocks at a time as f32 (16 at a time in
            // registers), then the f32 loop over them.
            let mut f32s = [0u8; 4 * 256];
            let bytes = block / 2 * 256;
            for ((sc, c), o) in scales
                .chunks(256)
                .zip(codes.chunks(bytes))
                .zip(out.chunks_mut(256 * block))
            {
                let f = &mut f32s[..4 * sc.len()];
                e4m3_scales(sc, f32::from_bits(global), f);
                fp4_groups::<M>(t, block, 4, f, c, o, |sc| scale_of(Scale::F32, sc));
            }
        }
        _ => fp4_groups::<M>(t, block, sb, scales, codes, out, |sc| scale_of(scale, sc)),
    }
    blocks
}

/// E4M3 block scales `sc` (one byte each) times the frame's scale `global`, written to
/// `out` as little-endian f32: `fp8::scale_of`'s value for each (NaN for `0x7F` and
/// `0xFF`), 16 at a time through half precision (an E4M3 byte's f16 is its value times
/// 2^-8, exact; times 2^8 is exact again, so the product with `global` is the same f32).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn e4m3_scales(sc: &[u8], global: f32, out: &mut [u8]) {
    let (unit, g) = (_mm256_set1_ps(256.0), _mm256_set1_ps(global));
    let nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0_0000));
    let mut rows = sc.chunks_exact(16);
    let mut outs = out.chunks_exact_mut(64);
    for (c, o) in (&mut rows).zip(&mut outs) {
        // SAFETY: `c` holds 16 bytes, one unaligned __m128i; `o` 64 bytes, two unaligned
        // __m256; `fp8_halves` needs AVX2, which this function has.
        unsafe {
            let bytes = _mm_loadu_si128(c.as_ptr().cast());
            let h = loops::fp8_halves(bytes, true);
            let mag = _mm_and_si128(bytes, _mm_set1_epi8(0x7F));
            let is_nan = _mm_cmpeq_epi8(mag, _mm_set1_epi8(0x7F));
            for (k, (h, n)) in [
                (_mm256_castsi256_si128(h), is_nan),
                (
                    _mm256_extracti128_si256::<1>(h),
                    _mm_srli_si128::<8>(is_nan),
                ),
            ]
            .into_iter()
            .enumerate()
            {
                let v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), unit), g);
                let n = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(n));
                let v = _mm256_blendv_ps(v, nan, n);
                _mm256_storeu_ps(o.as_mut_ptr().add(32 * k).cast(), v);
            }
        }
    }
    let scale = fp8::Scale::E4m3 {
        global: global.to_bits(),
    };
    for (&c, o) in rows
        .remainder()
        .iter()
        .zip(outs.into_remainder().chunks_exact_mut(4))
    {
        o.copy_from_slice(&fp8::scale_of(scale, &[c]).to_le_bytes());
    }
}

/// The groups of 32 elements (one block of 32 or two of 16) of [`decode_fp4`], with the
/// tables `t` of [`fp4_tables`]; each block's scale (`sb` bytes) is read by `scale_of`.
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_groups<const M: u8>(
    t: [__m256i; 2],
    block: usize,
    sb: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
    scale_of: impl Fn(&[u8]) -> f32,
) {
    let per = if block == 32 { 1 } else { 2 };
    for ((sc, c), o) in scales
        .chunks_exact(per * sb)
        .zip(codes.chunks_exact(16))
        .zip(out.chunks_exact_mut(32))
    {
        let first = _mm256_set1_ps(scale_of(&sc[..sb]));
        let second = if per == 1 {
            first
        } else {
            _mm256_set1_ps(scale_of(&sc[sb..]))
        };
        let v = fp4_values32(t, c, first, second);
        for (k, v) in v.into_iter().enumerate() {
            put8::<M>(o, 8 * k, v);
        }
    }
}

/// The values of the 32 fp4 codes in the first 16 bytes of `c` (low nibble first) from the
/// tables `t` (the third and fourth bytes of the sixteen values' f32, in both lanes), the
/// first 16 times `first`, the others times `second`, in four vectors of 8 in element
/// order (see [`decode_fp4`]).
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_values32(t: [__m256i; 2], c: &[u8], first: __m256, second: __m256) -> [__m256; 4] {
    // Lane 0 takes the code bytes of elements 0-3, 8-11, 16-19 and 24-27, lane 1 those of
    // 4-7, 12-15, 20-23 and 28-31, each byte twice: after the lookups, the interleaving
    // within lanes then yields elements 0-7, 8-15, 16-23 and 24-31.
    let spread = _mm256_setr_epi8(
        0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13, //
        2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15,
    );
    let c = &c[..16];
    // SAFETY: `c` holds 16 bytes, one unaligned __m128i.
    let c = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(c.as_ptr().cast()) });
    let d = _mm256_shuffle_epi8(c, spread);
    // Per 16-bit pair of copies: the low nibble in the first byte, the high one in the
    // second.
    let n = _mm256_or_si256(
        _mm256_and_si256(d, _mm256_set1_epi16(0x000F)),
        _mm256_and_si256(_mm256_srli_epi16::<4>(d), _mm256_set1_epi16(0x0F00)),
    );
    let (b2, b3) = (_mm256_shuffle_epi8(t[0], n), _mm256_shuffle_epi8(t[1], n));
    let (a, b) = (_mm256_unpacklo_epi8(b2, b3), _mm256_unpackhi_epi8(b2, b3));
    let zero = _mm256_setzero_si256();
    let f32s = |h: __m256i, s: __m256| _mm256_mul_ps(_mm256_castsi256_ps(h), s);
    [
        f32s(_mm256_unpacklo_epi16(zero, a), first),
        f32s(_mm256_unpackhi_epi16(zero, a), first),
        f32s(_mm256_unpacklo_epi16(zero, b), second),
        f32s(_mm256_unpackhi_epi16(zero, b), second),
    ]
}

/// The byte tables of [`fp4_values32`] for the sixteen values `fours`, or None if one is
/// not a bfloat16 (its low 16 bits not zero).
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_tables(fours: &[f32; 16]) -> Option<[__m256i; 2]> {
    // A plain loop, not `map` with closures: those were compiled out of line, without
    // AVX2, and this runs once per call (128 calls in a sum of eight frames of 64 Ki).
    let (mut low, mut third, mut high) = (0u32, [0u8; 16], [0u8; 16]);
    for (i, v) in fours.iter().enumerate() {
        let b = v.to_bits();
        low |= b & 0xFFFF;
        third[i] = (b >> 16) as u8;
        high[i] = (b >> 24) as u8;
    }
    if low != 0 {
        return None;
    }
    // SAFETY: each plane is 16 bytes, one unaligned __m128i.
    let (third, high) = unsafe {
        (
            _mm_loadu_si128(third.as_ptr().cast()),
            _mm_loadu_si128(high.as_ptr().cast()),
        )
    };
    Some([
        _mm256_broadcastsi128_si256(third),
        _mm256_broadcastsi128_si256(high),
    ])
}

/// fp8 encode with nearest rounding (`fp8::encode` without draws) of E4M3 (`e4m3`) or
/// E5M2 codes, one byte each, with an f32 or E8M0 block scale: blocks of a multiple of 8
/// go eight at a time with their maxima and scales formed in one vector
/// ([`loops::nearest_group`]), which saves each block's horizontal maximum and scalar
/// scale; the others, and groups the scales decline, by the definition's block layout
/// ([`fp8::encode_blocks`]) with the scaled elements converted 32 at a time
/// ([`fp8_nearest_block`]). The same bytes as the definition; returns whether `x` held
/// NaN or ±Inf.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn encode_fp8_nearest(
    e4m3: bool,
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    debug_assert!(matches!(scale, fp8::Scale::F32 | fp8::Scale::E8m0));
    let f = if e4m3 { fp8::E4M3 } else { fp8::E5M2 };
    in_groups(
        block.is_multiple_of(8),
        block,
        scale.bytes(),
        1,
        x,
        scales,
        codes,
        #[inline(always)]
        |xg, sg, cg| {
            // SAFETY: this function's features are `Avx2`'s.
            unsafe {
                if e4m3 {
                    loops::nearest_group::<Avx2, 3, false>(f, scale, block, xg, sg, cg)
                } else {
                    loops::nearest_group::<Avx2, 2, false>(f, scale, block, xg, sg, cg)
                }
            }
        },
        #[inline(always)]
        |x, sc, c| encode_fp8_rest(e4m3, scale, block, x, sc, c),
    )
}

/// The block layout of the fp8 and fp4 encoders: while `grouped`, eight blocks at a time
/// by `group(x, scales, codes)` (false when it declines, having written nothing), else by
/// `rest`, which also takes the blocks after the last group. `sb` scale bytes per block,
/// `per` elements per code byte (1 or 2). True when `rest` saw NaN or ±Inf.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(in crate::kernels::x86_64) fn in_groups(
    grouped: bool,
    block: usize,
    sb: usize,
    per: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
    mut group: impl FnMut(&[f32], &mut [u8], &mut [u8]) -> bool,
    mut rest: impl FnMut(&[f32], &mut [u8], &mut [u8]) -> bool,
) -> bool {
    let (mut nonfinite, mut done, mut b) = (false, 0, 0);
    while grouped && x.len() - done >= 8 * block {
        let xg = &x[done..done + 8 * block];
        let sg = &mut scales[b * sb..(b + 8) * sb];
        let cg = &mut codes[done / per..(done + 8 * block) / per];
        if !group(xg, sg, cg) {
            nonfinite |= rest(xg, sg, cg);
        }
        done += 8 * block;
        b += 8;
    }
    nonfinite | rest(&x[done..], &mut scales[b * sb..], &mut codes[done / per..])
}

/// [`encode_fp8_nearest`] by the definition's block layout, each block converted 32 at a
/// time.
#[target_feature(enable = "avx2")]
fn encode_fp8_rest(
    e4m3: bool,
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let f = if e4m3 { fp8::E4M3 } else { fp8::E5M2 };
    fp8::encode_blocks(
        f,
        scale,
        false,
        block,
        x,
        None,
        0,
        scales,
        codes,
        #[inline(always)]
        |q, xb, _, out| match (e4m3, q.inv) {
            (true, Some(_)) => fp8_nearest_block::<3, true>(f, q, xb, out),
            (true, None) => fp8_nearest_block::<3, false>(f, q, xb, out),
            (false, Some(_)) => fp8_nearest_block::<2, true>(f, q, xb, out),
            (false, None) => fp8_nearest_block::<2, false>(f, q, xb, out),
        },
    )
}

/// The lanes' maxima of each of eight vectors, in vector order: lane `j` of the result is
/// the largest (signed) lane of `v[j]`.
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn fold_maxima(v: [__m256i; 8]) -> __m256i {
    // Pairs of rows, then quads, interleaved so that lane j ends with block j's maximum.
    let lo = max_quads(max_pairs(v[0], v[1]), max_pairs(v[2], v[3]));
    let hi = max_quads(max_pairs(v[4], v[5]), max_pairs(v[6], v[7]));
    _mm256_max_epi32(
        _mm256_permute2x128_si256::<0x20>(lo, hi),
        _mm256_permute2x128_si256::<0x31>(lo, hi),
    )
}

/// The maxima of `a` and `b`'s lanes 0 and 2 and 1 and 3 of each half, interleaved.
#[target_feature(enable = "avx2")]
#[inline]
fn max_pairs(a: __m256i, b: __m256i) -> __m256i {
    _mm256_max_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
}

/// The maxima of `a` and `b`'s 64-bit halves of each half.
#[target_feature(enable = "avx2")]
#[inline]
fn max_quads(a: __m256i, b: __m256i) -> __m256i {
    _mm256_max_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b))
}

/// Whether every one of eight blocks' maxima bits `m` is finite, normal and not zero: the
/// grouped scales take only those, the definition's layout the others.
#[target_feature(enable = "avx2")]
#[inline]
fn usual_maxima(m: __m256i) -> bool {
    let unusual = _mm256_or_si256(
        _mm256_cmpgt_epi32(m, _mm256_set1_epi32(INF_BITS as i32 - 1)),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << 23), m),
    );
    _mm256_movemask_ps(_mm256_castsi256_ps(unusual)) == 0
}

/// The quotients' operands of eight blocks whose maxima bits are `m`, with their scales
/// written to `sg` (E8M0 bytes when `E8M0`, else f32), as `fp8::Quotient::new` forms
/// them: with `E8M0`, `2^-k` (the elements are multiplied by it), else the scale `s`
/// (they are divided by it). `None`, writing nothing, unless every block is finite with
/// a normal non-zero maximum: the definition's layout takes those.
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn group_scales<const E8M0: bool>(
    f: fp8::Format,
    m: __m256i,
    sg: &mut [u8],
) -> Option<__m256> {
    let i32x8 = _mm256_set1_epi32;
    if !usual_maxima(m) {
        return None;
    }
    if E8M0 {
        // fp8::e8m0_exponent of a normal m: floor(log2 m) - emax, one more where m's
        // mantissa exceeds FMAX's.
        let fmax_mant = (f.max_code as i32 & ((1 << f.m) - 1)) << (23 - f.m);
        let e = _mm256_sub_epi32(_mm256_srli_epi32::<23>(m), i32x8(127 + f.emax()));
        let over = _mm256_cmpgt_epi32(_mm256_and_si256(m, i32x8(0x7F_FFFF)), i32x8(fmax_mant));
        // k <= 127 - emax + 1 <= 126 (every format here has emax >= 2).
        debug_assert!(f.emax() >= 2);
        let k = _mm256_max_epi32(_mm256_sub_epi32(e, over), i32x8(-127));
        let mut ks = [0i32; 8];
        // SAFETY: `ks` is 8 i32, one unaligned __m256i.
        unsafe { _mm256_storeu_si256(ks.as_mut_ptr().cast(), k) };
        for (o, k) in sg.iter_mut().zip(ks) {
            *o = (k + 127) as u8;
        }
        // 2^-k from its bits: 127 - k lies in 1..=254.
        Some(_mm256_castsi256_ps(_mm256_slli_epi32::<23>(
            _mm256_sub_epi32(i32x8(127), k),
        )))
    } else {
        // s = max(m / FMAX, 2^-126), one step down where FMAX * s overflows.
        let fmax = _mm256_set1_ps(f.max());
        let s = _mm256_max_ps(
            _mm256_div_ps(_mm256_castsi256_ps(m), fmax),
            _mm256_set1_ps(f32::MIN_POSITIVE),
        );
        let inf =
            _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_mul_ps(fmax, s), _mm256_set1_ps(f32::INFINITY));
        let down = _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_castps_si256(s), i32x8(1)));
        let s = _mm256_blendv_ps(s, down, inf);
        assert!(sg.len() >= 32);
        // SAFETY: `sg` holds 32 bytes, one unaligned __m256 (little-endian f32s).
        unsafe { _mm256_storeu_ps(sg.as_mut_ptr().cast(), s) };
        Some(s)
    }
}

/// fp4 encode with nearest rounding (`fp8::encode` with `four`, without draws) of E2M1
/// codes, or with `e3m0` of E3M0 codes, two per byte, with any block scale: blocks of a
/// multiple of 8 eight at a time as fp8's ([`loops::nearest_group`]); the others by the
/// definition's block layout with the scaled elements converted 32 (then 16) at a time
/// and packed by a multiply-add ([`fp4_nearest_block`]). The same bytes as the
/// definition; returns whether `x` held NaN or ±Inf.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn encode_fp4_nearest(
    e3m0: bool,
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    debug_assert!(scale != fp8::Scale::None && block.is_multiple_of(2));
    if e3m0 {
        fp4_in_groups::<0>(scale, block, x, scales, codes)
    } else {
        fp4_in_groups::<1>(scale, block, x, scales, codes)
    }
}

/// [`encode_fp4_nearest`] in a format of `M` mantissa bits ([`fp4_format`]).
#[target_feature(enable = "avx2")]
fn fp4_in_groups<const M: u32>(
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    in_groups(
        groups_take(fp4_format::<M>(), scale) && block.is_multiple_of(8),
        block,
        scale.bytes(),
        2,
        x,
        scales,
        codes,
        #[inline(always)]
        |xg, sg, cg| {
            // SAFETY: this function's features are `Avx2`'s.
            unsafe {
                loops::nearest_group::<Avx2, M, true>(fp4_format::<M>(), scale, block, xg, sg, cg)
            }
        },
        #[inline(always)]
        |x, sc, c| encode_fp4_rest::<M>(scale, block, x, sc, c),
    )
}

/// The 4-bit format of `M` mantissa bits: E2M1 (1) or E3M0 (0).
const fn fp4_format<const M: u32>() -> fp8::Format {
    if M == 0 { fp8::E3M0 } else { fp8::E2M1 }
}

/// Whether the grouped encoders take frames with `scale` in format `f`: with E4M3 block
/// scales, only a frame scale the definition's arithmetic keeps finite and normal (the
/// codec's always is); every other scale.
#[inline]
pub(in crate::kernels::x86_64) fn groups_take(f: fp8::Format, scale: fp8::Scale) -> bool {
    match scale {
        fp8::Scale::E4m3 { global } => {
            let g = f32::from_bits(global);
            g >= f32::MIN_POSITIVE && (f.max() * g).is_finite()
        }
        _ => true,
    }
}

/// [`group_scales`] for E4M3 block scales over the frame scale with bits `global` (at
/// least `2^-126`, `FMAX g` finite): each block's byte `fp8::e4m3_ceil(m / (FMAX g))`
/// and its scale `v g` (`v` the byte's value), as `fp8::Quotient::new` forms them, lane
/// by lane; the elements are divided by the scales returned.
#[target_feature(enable = "avx2")]
#[inline]
pub(in crate::kernels::x86_64) fn group_e4m3_scales(
    f: fp8::Format,
    global: u32,
    m: __m256i,
    sg: &mut [u8],
) -> Option<__m256> {
    let i32x8 = _mm256_set1_epi32;
    if !usual_maxima(m) {
        return None;
    }
    let g = f32::from_bits(global);
    let t = _mm256_div_ps(_mm256_castsi256_ps(m), _mm256_set1_ps(f.max() * g));
    let a = _mm256_castps_si256(t);
    // e4m3_ceil: below 2^-6 the ceiling of t 2^9 (exact, under 8), else the mantissa
    // rounded up to 3 bits and the exponent rebiased; then at least 1, at most 0x7E.
    let sub = _mm256_cvtps_epi32(_mm256_ceil_ps(_mm256_mul_ps(t, _mm256_set1_ps(512.0))));
    let normal = _mm256_sub_epi32(
        _mm256_srli_epi32::<20>(_mm256_add_epi32(a, i32x8((1 << 20) - 1))),
        i32x8(120 << 3),
    );
    let v = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(i32x8(121 << 23), a));
    let v = _mm256_min_epi32(
        _mm256_max_epi32(v, i32x8(1)),
        i32x8(fp8::E4M3.max_code as i32),
    );
    let mut vs = [0i32; 8];
    // SAFETY: `vs` is 8 i32, one unaligned __m256i.
    unsafe { _mm256_storeu_si256(vs.as_mut_ptr().cast(), v) };
    for (o, v) in sg.iter_mut().zip(vs) {
        *o = v as u8;
    }
    // value_finite(E4M3, v): v 2^-9 below code 8, else the bits of 2^(v >> 3 - 7) with
    // the low three bits as mantissa.
    let small = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(fp8::pow2(-9)));
    let large = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_slli_epi32::<20>(v),
        i32x8(120 << 23),
    ));
    let value = _mm256_blendv_ps(
        large,
        small,
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(i32x8(8), v)),
    );
    Some(_mm256_mul_ps(value, _mm256_set1_ps(g)))
}

/// [`encode_fp4_nearest`] by the definition's block layout, each block converted 32 at a
/// time.
#[target_feature(enable = "avx2")]
fn encode_fp4_rest<const M: u32>(
    scale: fp8::Scale,
    block: usize,
    x: &[f32],
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let f = fp4_format::<M>();
    fp8::encode_blocks(
        f,
        scale,
        true,
        block,
        x,
        None,
        0,
        scales,
        codes,
        #[inline(always)]
        |q, xb, _, cb| match q.inv {
            Some(_) => fp4_nearest_block::<M, true>(q, xb, cb),
            None => fp4_nearest_block::<M, false>(q, xb, cb),
        },
    )
}

/// The packed 4-bit codes of `xb`'s whole 16s into `cb`: 32 a step
/// ([`loops::nearest_steps`]), then 16 more (all of an NVFP4-like block of 16) by the
/// same steps on two vectors, the other two zero, keeping the first 8 bytes. How many
/// elements that was.
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_whole16s<const M: u32, const MULTIPLY: bool>(
    n: &Nearest8,
    by: __m256,
    xb: &[f32],
    cb: &mut [u8],
) -> usize {
    // SAFETY: this function's features are `Avx2`'s.
    let done = unsafe { loops::nearest_steps::<Avx2, M, MULTIPLY, true>(n, by, xb, cb) };
    if xb.len() - done < 16 {
        return done;
    }
    let mut o = [0u8; 16];
    // SAFETY: `xb[done..]` holds at least 16 f32, two unaligned __m256; `o` is 16 bytes,
    // what `store_float_codes` writes at 8 lanes with `FOUR`; the features are `Avx2`'s.
    unsafe {
        let p = xb.as_ptr().add(done);
        let zero = _mm256_setzero_si256();
        let c0 = Avx2::code::<M, MULTIPLY, true>(n, _mm256_loadu_ps(p), by);
        let c1 = Avx2::code::<M, MULTIPLY, true>(n, _mm256_loadu_ps(p.add(8)), by);
        Avx2::store_float_codes::<true>(o.as_mut_ptr(), [c0, c1, zero, zero]);
    }
    cb[done / 2..done / 2 + 8].copy_from_slice(&o[..8]);
    done + 16
}

/// The constants of [`Avx2`]'s [`FloatCodes::code`].
pub(in crate::kernels::x86_64) struct Nearest8 {
    emin: __m256i,
    exponent: __m256i,
    ulp: __m256i,
    top: __m256i,
    abs: __m256i,
    /// E3M0 only: `127 - bias`, the f32 exponent field of code 0's binade.
    rebias: __m256i,
}

// SAFETY: every method needs AVX2, as `Lanes for Avx2` says.
unsafe impl FloatCodes for Avx2 {
    type Nearest = Nearest8;

    #[inline(always)]
    unsafe fn nearest<const FOUR: bool>(f: fp8::Format) -> Nearest8 {
        // SAFETY: the caller's contract (AVX).
        unsafe {
            Nearest8 {
                emin: _mm256_set1_epi32((1 - f.bias + 127) << 23),
                exponent: _mm256_set1_epi32(0x7F80_0000),
                ulp: _mm256_set1_epi32((23 - f.m as i32) << 23),
                top: _mm256_set1_epi32(f.max_code as i32),
                abs: _mm256_set1_epi32(ABS),
                rebias: _mm256_set1_epi32(127 - f.bias),
            }
        }
    }

    #[inline(always)]
    unsafe fn code<const M: u32, const MULTIPLY: bool, const FOUR: bool>(
        n: &Nearest8,
        v: __m256,
        by: __m256,
    ) -> __m256i {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            let y = if MULTIPLY {
                _mm256_mul_ps(v, by)
            } else {
                _mm256_div_ps(v, by)
            };
            let bits = _mm256_castps_si256(y);
            let a = _mm256_and_si256(bits, n.abs);
            let sign = if FOUR {
                _mm256_and_si256(_mm256_srli_epi32::<28>(bits), _mm256_set1_epi32(8))
            } else {
                _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80))
            };
            if M == 0 {
                // a + (2^22 - 1) + (the exponent's parity), the exponent field less the
                // bias: the code of a normal quotient (the exponent's parity is the code's).
                let parity = _mm256_and_si256(_mm256_srli_epi32::<23>(a), _mm256_set1_epi32(1));
                let r = _mm256_add_epi32(
                    _mm256_add_epi32(a, _mm256_set1_epi32((1 << 22) - 1)),
                    parity,
                );
                let normal = _mm256_sub_epi32(_mm256_srli_epi32::<23>(r), n.rebias);
                // Below the smallest normal the grid is 0 and it: code 1 above half of it,
                // 0 up to half (the tie goes to the even code 0), as the definition's
                // rounding of |y| 2^(bias - 1) to an integer gives.
                let half = _mm256_sub_epi32(n.emin, _mm256_set1_epi32(1 << 23));
                let sub = _mm256_srli_epi32::<31>(_mm256_cmpgt_epi32(a, half));
                let q = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(n.emin, a));
                return _mm256_or_si256(_mm256_min_epi32(q, n.top), sign);
            }
            let e = _mm256_max_epi32(_mm256_and_si256(a, n.exponent), n.emin);
            let magic = _mm256_add_epi32(e, n.ulp);
            let sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic));
            let count = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
            let binades = _mm256_sub_epi32(e, n.emin);
            let binades = match M {
                3 => _mm256_srli_epi32::<20>(binades),
                2 => _mm256_srli_epi32::<21>(binades),
                _ => _mm256_srli_epi32::<22>(binades),
            };
            let q = _mm256_min_epi32(_mm256_add_epi32(binades, count), n.top);
            _mm256_or_si256(q, sign)
        }
    }

    #[inline(always)]
    unsafe fn store_float_codes<const FOUR: bool>(p: *mut u8, q: [__m256i; 4]) {
        // SAFETY: the caller's contract (AVX2): `p` is valid for 32 bytes, or 16 with
        // `FOUR`.
        unsafe {
            let bytes = pack_bytes::<false>(q[0], q[1], q[2], q[3]);
            if FOUR {
                // Each pair joined by a multiply-add (`lo + 16 hi`), each half's 8 bytes
                // narrowed, then the second half's moved next to the first.
                let pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
                let b = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi16(pairs, pairs));
                _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(b));
            } else {
                _mm256_storeu_si256(p.cast(), bytes);
            }
        }
    }

    #[inline(always)]
    unsafe fn max8(m: __m256i) -> __m256i {
        m
    }
}

/// A block's quotient operand in every lane: its `inv` when it has one, else its scale.
#[target_feature(enable = "avx")]
#[inline]
fn operand(q: fp8::Quotient) -> __m256 {
    _mm256_set1_ps(q.inv.unwrap_or(q.s))
}

/// The codes of a scaled block's elements `xb` into `out` ([`FloatCodes::code`] of each;
/// `MULTIPLY` when `q` has an `inv`), 32 a step ([`loops::nearest_steps`]). A tail
/// shorter than 32 runs the definition.
#[target_feature(enable = "avx2")]
#[inline]
fn fp8_nearest_block<const M: u32, const MULTIPLY: bool>(
    f: fp8::Format,
    q: fp8::Quotient,
    xb: &[f32],
    out: &mut [u8],
) {
    // SAFETY: this function's features are `Avx2`'s.
    let done = unsafe {
        let n = Avx2::nearest::<false>(f);
        loops::nearest_steps::<Avx2, M, MULTIPLY, false>(&n, operand(q), xb, out)
    };
    // The branch-free definition, which this build vectorises: padding the tail to 32
    // (`padded_rest`) was 8 to 12% slower at blocks of 100.
    for (o, &v) in out[done..].iter_mut().zip(&xb[done..]) {
        *o = fp8::nearest_in_range(f, q.of(v));
    }
}

/// The packed 4-bit codes of a scaled block's elements `xb` into `cb` (two per byte, the
/// even element in the low nibble): 32 elements a step, then 16 the same way
/// ([`fp4_whole16s`]), then a tail shorter than 16 padded to 32 ([`padded_rest`]).
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_nearest_block<const M: u32, const MULTIPLY: bool>(
    q: fp8::Quotient,
    xb: &[f32],
    cb: &mut [u8],
) {
    // SAFETY: this function's features are `Avx2`'s.
    let n = unsafe { Avx2::nearest::<true>(fp4_format::<M>()) };
    let by = operand(q);
    let done = fp4_whole16s::<M, MULTIPLY>(&n, by, xb, cb);
    if done < xb.len() {
        // A zero's code is 0: a last block of odd length gets the oracle's zero nibble.
        padded_rest(
            &xb[done..],
            &mut cb[done / 2..xb.len().div_ceil(2)],
            #[inline(always)]
            |x32, c32| _ = fp4_whole16s::<M, MULTIPLY>(&n, by, x32, c32),
        );
    }
}
