//! Block loops written once over the vector width ([`Lanes`]): the AVX2 and AVX-512
//! kernels of the same operation are these loops instantiated at 8 and 16 lanes, inside
//! each backend's `#[target_feature]` function (`blocks` and `blocks512` hold those
//! wrappers). Every loop equals its scalar definition to the bit (tests/backends.rs,
//! tests/exhaustive.rs, on every backend the CPU has, the AVX-512 one unrouted too).
//!
//! Each loop is an `unsafe fn` with the contract of [`Lanes`]: the CPU must have the
//! instruction set of `V`.

use core::arch::x86_64::*;

use super::blocks;
use super::lanes::{FloatCodes, Lanes, Quantise};
use crate::kernels::fp8::{self, Scale};

/// The half-precision floats of 16 fp8 codes (the bytes of `b`): an E5M2 code is the top
/// byte of the f16 of the same value; an E4M3 code's magnitude shifted left by 7 is the
/// f16 of its value times 2^-8 (the same exponent field and mantissa, f16's bias 8 above
/// E4M3's), its sign moved to bit 15. Exact for every code but E5M2's non-finite ones.
///
/// # Safety
/// The CPU must support AVX2.
#[inline(always)]
pub(super) unsafe fn fp8_halves(b: __m128i, e4m3: bool) -> __m256i {
    // SAFETY: the caller's contract (AVX2).
    unsafe {
        if e4m3 {
            // Sign-extended and shifted left by 7, a negative code also sets bit 14 (the
            // sign lands on bits 14 and 15); clearing it leaves the f16.
            _mm256_and_si256(
                _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)),
                _mm256_set1_epi16(!0x4000),
            )
        } else {
            _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(b))
        }
    }
}

/// How an fp8 block's codes meet its scale `s` after [`fp8_halves`]: `(twice, t)`, each
/// half's f32 times 2^8 first when `twice`, then times `t`. E4M3's halves are its values
/// times 2^-8, so `t = s * 2^8`: exact where it does not overflow, it rounds the same real
/// product as the definition's `value * s`; where it would, 2^8 goes first.
#[inline(always)]
fn fp8_scale(e4m3: bool, s: f32) -> (bool, f32) {
    let big = s * 256.0;
    if !e4m3 {
        (false, s)
    } else if big.is_infinite() && s.is_finite() {
        (true, s)
    } else {
        (false, big)
    }
}

/// The whole blocks of a small-float decode in registers (a scale per block, any mode,
/// `code_bytes` bytes of codes per block): how many blocks `out`, `codes` and `scales`
/// hold, and the bytes of a block's scale.
pub(super) fn float_blocks(
    scale: Scale,
    block: usize,
    code_bytes: usize,
    scales: &[u8],
    codes: &[u8],
    out: &[f32],
) -> (usize, usize) {
    assert!(code_bytes > 0);
    let sb = scale.bytes();
    assert!(sb > 0);
    let blocks = (out.len() / block)
        .min(codes.len() / code_bytes)
        .min(scales.len() / sb);
    (blocks, sb)
}

/// fp8 decode (`fp8::decode` of a scaled frame) of the whole blocks that `out`, `codes`
/// and `scales` hold (blocks a multiple of 16 long), in mode `M` (any: [`Lanes::put`]);
/// returns how many blocks it decoded. Each code becomes a half-precision float by shifts
/// ([`fp8_halves`]), converted to f32 (exact), then multiplied by its block's scale as
/// [`fp8_scale`] says: the same f32 product as the definition's `value_finite(c) * s`.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn decode_fp8<V: Lanes, const M: u8>(
    e4m3: bool,
    scale: Scale,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    assert!(block.is_multiple_of(16));
    let (blocks, sb) = float_blocks(scale, block, block, scales, codes, out);
    let (scales, codes, out) = (
        &scales[..blocks * sb],
        &codes[..blocks * block],
        &mut out[..blocks * block],
    );
    // One loop per scale kind, so that reading a block's scale is not a match per block.
    // SAFETY (the three): the caller's contract.
    unsafe {
        match scale {
            Scale::F32 => fp8_blocks::<V, M>(e4m3, block, sb, (scales, codes, out), |sc| {
                fp8::scale_of(Scale::F32, sc)
            }),
            Scale::E8m0 => fp8_blocks::<V, M>(e4m3, block, sb, (scales, codes, out), |sc| {
                fp8::scale_of(Scale::E8m0, sc)
            }),
            _ => fp8_blocks::<V, M>(e4m3, block, sb, (scales, codes, out), |sc| {
                fp8::scale_of(scale, sc)
            }),
        }
    }
    blocks
}

/// The blocks of [`decode_fp8`], each block's scale (`sb` bytes) read by `scale_of`.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
unsafe fn fp8_blocks<V: Lanes, const M: u8>(
    e4m3: bool,
    block: usize,
    sb: usize,
    (scales, codes, out): (&[u8], &[u8], &mut [f32]),
    scale_of: impl Fn(&[u8]) -> f32,
) {
    for ((sc, c), o) in scales
        .chunks_exact(sb)
        .zip(codes.chunks_exact(block))
        .zip(out.chunks_exact_mut(block))
    {
        // SAFETY: the caller's contract.
        unsafe {
            match fp8_scale(e4m3, scale_of(sc)) {
                (false, t) => fp8_block::<V, M, false>(e4m3, t, c, o),
                (true, t) => fp8_block::<V, M, true>(e4m3, t, c, o),
            }
        }
    }
}

/// One block of [`decode_fp8`]: each code's half converted, times 2^8 if `TWICE`, times
/// `t`, put as mode `M` says.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
unsafe fn fp8_block<V: Lanes, const M: u8, const TWICE: bool>(
    e4m3: bool,
    t: f32,
    c: &[u8],
    o: &mut [f32],
) {
    // SAFETY: the caller's contract.
    let (unit, t) = unsafe { (V::splat(256.0), V::splat(t)) };
    for (c, o) in c.chunks_exact(16).zip(o.chunks_exact_mut(16)) {
        // SAFETY: the caller's contract; `c` holds 16 bytes, one unaligned __m128i; `o`
        // holds 16 f32, which `halves` hands out `N` at a time from offsets 0 to 16 - N.
        unsafe {
            let h = fp8_halves(_mm_loadu_si128(c.as_ptr().cast()), e4m3);
            // Inlined: a closure is a function of its own, compiled without the
            // caller's instruction set unless it is inlined into it.
            V::halves(
                h,
                #[inline(always)]
                |at, v| {
                    let v = if TWICE { V::mul(v, unit) } else { v };
                    V::put::<M>(o.as_mut_ptr().add(at), V::mul(v, t));
                },
            );
        }
    }
}

/// fp8 decode of an unscaled frame (`fp8::decode` with `Scale::None`) of the elements of
/// `out` up to a multiple of 16, in mode `M` (any: [`Lanes::put`]); returns how many it
/// decoded. Each code becomes a half by shifts ([`fp8_halves`]), converted to f32 (exact;
/// E4M3's times 2^8, exact too), and the codes that are NaN become the definition's NaN
/// ([`Lanes::fp8_nans`]). E5M2's infinities convert as they are. The same bits as
/// `fp8::value_any` per code.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn decode_fp8_unscaled<V: Lanes, const M: u8>(
    e4m3: bool,
    codes: &[u8],
    out: &mut [f32],
) -> usize {
    let n = out.len().min(codes.len()) / 16 * 16;
    // SAFETY: the caller's contract.
    let unit = unsafe { V::splat(256.0) };
    for (c, o) in codes[..n]
        .chunks_exact(16)
        .zip(out[..n].chunks_exact_mut(16))
    {
        // SAFETY: as in `fp8_block`.
        unsafe {
            let h = fp8_halves(_mm_loadu_si128(c.as_ptr().cast()), e4m3);
            // Inlined: a closure is a function of its own, compiled without the
            // caller's instruction set unless it is inlined into it.
            V::halves(
                h,
                #[inline(always)]
                |at, v| {
                    let v = if e4m3 { V::mul(v, unit) } else { v };
                    V::put::<M>(o.as_mut_ptr().add(at), V::fp8_nans(v, e4m3));
                },
            );
        }
    }
    n
}

/// `r = beta r + gamma g` in place over the whole vectors of `r` (two rounded products
/// and a rounded sum, as `scalar::feedback_form`: no fused multiply-add), returning the
/// largest `|p|` bit pattern of those and how many elements they cover.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn form_max_abs<V: Lanes>(
    r: &mut [f32],
    g: &[f32],
    beta: f32,
    gamma: f32,
) -> (u32, usize) {
    assert!(g.len() >= r.len());
    let whole = r.len() / V::N * V::N;
    // SAFETY: the caller's contract; every `i` below has `i + N <= whole <= r.len()`,
    // one unaligned vector of `r` and of `g`.
    unsafe {
        let (bv, gv) = (V::splat(beta), V::splat(gamma));
        let mut m = V::zero();
        for i in (0..whole).step_by(V::N) {
            let p = V::add(
                V::mul(bv, V::load(r.as_ptr().add(i))),
                V::mul(gv, V::load(g.as_ptr().add(i))),
            );
            V::store(r.as_mut_ptr().add(i), p);
            m = V::max_abs_bits(m, p);
        }
        (V::lanes_max(m), whole)
    }
}

/// `sum = local + code * step` over the whole vectors of a block of int8 codes (the
/// operations of a `mode::ADD` decode onto `local`), returning the largest `|sum|` bit
/// pattern of those and how many elements they cover.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn add_max_abs<V: Lanes>(
    sum: &mut [f32],
    local: &[f32],
    codes: &[u8],
    step: f32,
) -> (u32, usize) {
    assert!(local.len() >= sum.len() && codes.len() >= sum.len());
    let whole = sum.len() / V::N * V::N;
    // SAFETY: the caller's contract; every `i` below has `i + N <= whole`, one unaligned
    // vector of `sum` and `local` and `N` bytes of `codes`.
    unsafe {
        let sv = V::splat(step);
        let mut m = V::zero();
        for i in (0..whole).step_by(V::N) {
            let v = V::mul(V::load_i8(codes.as_ptr().add(i)), sv);
            let s = V::add(V::load(local.as_ptr().add(i)), v);
            V::store(sum.as_mut_ptr().add(i), s);
            m = V::max_abs_bits(m, s);
        }
        (V::lanes_max(m), whole)
    }
}

/// The int8 codes of the whole steps (`4 N` elements) of the `n` elements at `x` (global
/// indices from `start`; inside one 2^32 draw window when `STOCHASTIC`), a finite block
/// whose level multiplier is `inv` (`scalar::level_multiplier` without a pre-scale), as
/// `scalar::quantise_int8` writes them ([`Quantise::level`]). With `RESIDUAL`, each
/// element becomes `x - code * step`, without `scalar::residual_of`'s checks, which cannot
/// fire in a finite block: `x` is finite, `code * step` is finite (`127 step` is, by
/// `scalar::block_step`) and of `x`'s sign or zero, so `|x - d| <= max(|x|, |d|)`.
/// Returns the number of elements done.
///
/// # Safety
/// The CPU must support `V`'s instruction set; `x` must be valid for reads of `n` f32,
/// and for writes with `RESIDUAL`.
#[inline(always)]
pub(super) unsafe fn int8_steps<V: Quantise, const RESIDUAL: bool, const STOCHASTIC: bool>(
    (inv, step): (f32, f32),
    x: *mut f32,
    n: usize,
    cb: &mut [u8],
    d: &mut V::Draws<'_>,
    start: u64,
) -> usize {
    assert!(cb.len() >= n);
    let w = 4 * V::N;
    let whole = n / w * w;
    // SAFETY: the caller's contract; every step below has `at + w <= whole <= n`, four
    // unaligned vectors of `x` and `w` bytes of `cb`.
    unsafe {
        let (iv, s) = (V::splat(inv), V::splat(step));
        if STOCHASTIC {
            V::begin(d, start);
        }
        for at in (0..whole).step_by(w) {
            let h = if STOCHASTIC {
                V::step(d, (start as u32).wrapping_add(at as u32))
            } else {
                [V::zero(); 4]
            };
            let mut q = [V::zero(); 4];
            for (j, q) in q.iter_mut().enumerate() {
                let p = x.add(at + j * V::N);
                let v = V::load(p);
                *q = V::level::<STOCHASTIC>(v, h[j], iv);
                if RESIDUAL {
                    V::store(p, V::minus_decoded(v, *q, s));
                }
            }
            V::store_codes(cb.as_mut_ptr().add(at), q);
        }
    }
    whole
}

/// Sign-magnitude codes of `BITS` (2, 4 or 8) bits for the whole steps (`4 N` elements)
/// of one finite block with level multiplier `inv` (without a pre-scale) and `levels`
/// magnitude levels: the oracle's `scalar::level` of each `|x|` with its index's draw
/// (`start + j` for element `j`), the input's sign where the level is not zero
/// ([`Quantise::signed_level`], [`Quantise::store_signmag`]). Returns the elements done
/// (a multiple of `4 N`); the caller codes the rest.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn signmag_steps<V: Quantise, const BITS: u32>(
    (inv, levels): (f32, u32),
    xb: &[f32],
    cb: &mut [u8],
    d: &mut V::Draws<'_>,
    start: u64,
) -> usize {
    let w = 4 * V::N;
    let whole = xb.len() / w * w;
    let bytes = w * BITS as usize / 8;
    assert!(cb.len() >= whole / w * bytes);
    // SAFETY: the caller's contract; every step below has `at + w <= whole`, four
    // unaligned vectors of `xb` and `bytes` bytes of `cb`.
    unsafe {
        let (iv, top) = (V::splat(inv), V::top(levels));
        V::begin(d, start);
        for k in 0..whole / w {
            let at = k * w;
            let p = xb.as_ptr().add(at);
            let v = [
                V::load(p),
                V::load(p.add(V::N)),
                V::load(p.add(2 * V::N)),
                V::load(p.add(3 * V::N)),
            ];
            let h = V::step(d, (start as u32).wrapping_add(at as u32));
            let q = [
                V::signed_level(v[0], h[0], iv, top),
                V::signed_level(v[1], h[1], iv, top),
                V::signed_level(v[2], h[2], iv, top),
                V::signed_level(v[3], h[3], iv, top),
            ];
            V::store_signmag::<BITS>(cb.as_mut_ptr().add(k * bytes), q);
        }
    }
    whole
}

/// The nearest fp8 or fp4 codes (`V::code`) of the whole steps (`4 N` elements) of one
/// block `xb` whose quotients take the operand `by` (multiplied by it when `MULTIPLY`,
/// else divided), into `cb` ([`FloatCodes::store_float_codes`]). Returns the elements
/// done (a multiple of `4 N`); the caller codes the rest.
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
pub(super) unsafe fn nearest_steps<
    V: FloatCodes,
    const M: u32,
    const MULTIPLY: bool,
    const FOUR: bool,
>(
    n: &V::Nearest,
    by: V::F,
    xb: &[f32],
    cb: &mut [u8],
) -> usize {
    let w = 4 * V::N;
    let (steps, bytes) = (xb.len() / w, if FOUR { w / 2 } else { w });
    assert!(cb.len() >= steps * bytes);
    // SAFETY: the caller's contract; step `k` reads `w` f32 of `xb` from `k w` and writes
    // `bytes` bytes of `cb` from `k bytes`, both within the slices.
    unsafe {
        for (x, o) in xb.chunks_exact(w).zip(cb.chunks_exact_mut(bytes)) {
            nearest_step::<V, M, MULTIPLY, FOUR>(n, [by; 4], x.as_ptr(), o.as_mut_ptr());
        }
    }
    steps * w
}

/// The codes of the `4 N` elements at `x` into `o`: vector `t`'s quotients with the
/// operand `by[t]`.
///
/// # Safety
/// `V`'s instruction set; `x` valid for `4 N` f32, `o` for `4 N` bytes (`2 N` with
/// `FOUR`).
#[inline(always)]
unsafe fn nearest_step<V: FloatCodes, const M: u32, const MULTIPLY: bool, const FOUR: bool>(
    n: &V::Nearest,
    by: [V::F; 4],
    x: *const f32,
    o: *mut u8,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let q = [
            V::code::<M, MULTIPLY, FOUR>(n, V::load(x), by[0]),
            V::code::<M, MULTIPLY, FOUR>(n, V::load(x.add(V::N)), by[1]),
            V::code::<M, MULTIPLY, FOUR>(n, V::load(x.add(2 * V::N)), by[2]),
            V::code::<M, MULTIPLY, FOUR>(n, V::load(x.add(3 * V::N)), by[3]),
        ];
        V::store_float_codes::<FOUR>(o, q);
    }
}

/// The largest magnitude bits of each of eight blocks of `block` (a multiple of `N`)
/// elements of `xg`, in block order (lane `j`: block `j`).
///
/// # Safety
/// The CPU must support `V`'s instruction set.
#[inline(always)]
unsafe fn group_max_bits<V: FloatCodes>(block: usize, xg: &[f32]) -> __m256i {
    assert!(xg.len() >= 8 * block && block >= V::N && block.is_multiple_of(V::N));
    // SAFETY: the caller's contract; `block_max` reads block `j` of `xg`.
    unsafe {
        // Written out, in memory order: the eight maxima stay in registers, and the
        // hardware prefetcher sees one ascending stream (taking the blocks in lockstep
        // instead made fp4's encode of 1 Mi elements 1.13 times slower on AVX-512).
        let (p, per) = (xg.as_ptr(), block / V::N);
        blocks::fold_maxima([
            V::max8(block_max::<V>(p, per)),
            V::max8(block_max::<V>(p.add(block), per)),
            V::max8(block_max::<V>(p.add(2 * block), per)),
            V::max8(block_max::<V>(p.add(3 * block), per)),
            V::max8(block_max::<V>(p.add(4 * block), per)),
            V::max8(block_max::<V>(p.add(5 * block), per)),
            V::max8(block_max::<V>(p.add(6 * block), per)),
            V::max8(block_max::<V>(p.add(7 * block), per)),
        ])
    }
}

/// The lanes' largest magnitude bits over the `per` (at least 1) vectors at `b`.
///
/// # Safety
/// `V`'s instruction set; `b` valid for `per N` f32.
#[inline(always)]
unsafe fn block_max<V: Lanes>(b: *const f32, per: usize) -> V::I {
    // SAFETY: the caller's contract.
    unsafe {
        let mut m = V::max_abs_bits(V::zero(), V::load(b));
        if per > 1 {
            // The second vector outside the loop: blocks of 2 N (fp8's 32 on AVX-512)
            // take no loop at all.
            m = V::max_abs_bits(m, V::load(b.add(V::N)));
            for k in 2..per {
                m = V::max_abs_bits(m, V::load(b.add(k * V::N)));
            }
        }
        m
    }
}

/// Eight blocks of `block` (a multiple of `N`) elements `xg` with nearest rounding in the
/// format `f` of `M` mantissa bits (fp8 codes, one per byte; with `FOUR` fp4 codes, two
/// per byte) and block scale `scale` (not `None`): the eight maxima, then the scales
/// formed together in one vector (`blocks::group_scales`, or `group_e4m3_scales` for
/// E4M3 scales) and written to `sg`, then the codes of the whole group ([`group_codes`]).
/// False, writing nothing, where the scales decline (a NaN, infinite, zero or subnormal
/// maximum: the definition's layout takes those). Scales other than E8M0 divide, as the
/// definition does.
///
/// # Safety
/// The CPU must support `V`'s instruction set (which includes AVX2).
#[inline(always)]
pub(super) unsafe fn nearest_group<V: FloatCodes, const M: u32, const FOUR: bool>(
    f: fp8::Format,
    scale: Scale,
    block: usize,
    xg: &[f32],
    sg: &mut [u8],
    cg: &mut [u8],
) -> bool {
    // SAFETY: the caller's contract; `V`'s instruction set includes AVX2, which the
    // scales' kernels need.
    unsafe {
        let m = group_max_bits::<V>(block, xg);
        let by = match scale {
            Scale::E8m0 => blocks::group_scales::<true>(f, m, sg),
            Scale::E4m3 { global } => blocks::group_e4m3_scales(f, global, m, sg),
            _ => blocks::group_scales::<false>(f, m, sg),
        };
        let Some(by) = by else {
            return false;
        };
        if scale == Scale::E8m0 {
            group_codes::<V, M, true, FOUR>(f, block, by, xg, cg);
        } else {
            group_codes::<V, M, false, FOUR>(f, block, by, xg, cg);
        }
        true
    }
}

/// The codes of a group of eight blocks of `block` (a multiple of `N`) elements `xg`,
/// block `j`'s quotients formed with lane `j` of `by` (multiplied by it when `MULTIPLY`,
/// else divided), `4 N` elements a step: where a block is whole steps its operand is
/// broadcast once per block, else each vector of the step takes its own block's.
///
/// # Safety
/// The CPU must support `V`'s instruction set (which includes AVX).
#[inline(always)]
unsafe fn group_codes<V: FloatCodes, const M: u32, const MULTIPLY: bool, const FOUR: bool>(
    f: fp8::Format,
    block: usize,
    by: __m256,
    xg: &[f32],
    cg: &mut [u8],
) {
    let w = 4 * V::N;
    let bytes = if FOUR { w / 2 } else { w };
    let steps = xg.len() / w;
    assert!(xg.len() == 8 * block && block.is_multiple_of(V::N) && steps * w == xg.len());
    assert!(cg.len() == steps * bytes);
    // SAFETY: the caller's contract; step `k` reads `w` f32 of `xg` from `k w` and writes
    // `bytes` bytes of `cg` from `k bytes`.
    unsafe {
        let mut bys = [0f32; 8];
        _mm256_storeu_ps(bys.as_mut_ptr(), by);
        let n = V::nearest::<FOUR>(f);
        if block.is_multiple_of(w) {
            for (j, &b) in bys.iter().enumerate() {
                let (x, c) = (
                    &xg[j * block..(j + 1) * block],
                    &mut cg[j * block / w * bytes..],
                );
                nearest_steps::<V, M, MULTIPLY, FOUR>(&n, V::splat(b), x, c);
            }
        } else {
            // The block of the next vector, and how many of its elements are left.
            let (mut j, mut left) = (0, block);
            for (x, o) in xg.chunks_exact(w).zip(cg.chunks_exact_mut(bytes)) {
                let mut ops = [V::splat(0.0); 4];
                for op in &mut ops {
                    *op = V::splat(bys[j]);
                    left -= V::N;
                    if left == 0 {
                        (j, left) = (j + 1, block);
                    }
                }
                nearest_step::<V, M, MULTIPLY, FOUR>(&n, ops, x.as_ptr(), o.as_mut_ptr());
            }
        }
    }
}
