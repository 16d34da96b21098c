//! AVX2 kernels of the block codecs: int8, qsgd and ternary quantisation (nearest and
//! stochastic, with the counter hash on 8 lanes, drawn in aligned groups of 64 where a
//! block starts at a multiple of 32), qsgd's block norm, natural compression (a short form
//! for all but rare steps), the sign-magnitude, sign and natural decoders, the random-k
//! draw filter and bf16 encode; also `dct`'s transpose of sixteen tiles into lanes and
//! fp4's decode by table lookups in registers.
//!
//! The portable kernels compiled for AVX2 spent most of their time narrowing one vector of
//! 8 codes to bytes at a time (a shuffle, an extract and an 8-byte store each); these work
//! on 32 elements per step, narrow with saturating packs, and pack 2- and 4-bit fields with
//! multiply-adds. Every function equals its scalar oracle to the bit (tests/backends.rs).
//! The block layouts they run on (`scalar::encode_int8_blocks`, `encode_signmag_blocks`,
//! `encode_natural_blocks`) send blocks that straddle a 2^32 index window to the oracle;
//! block tails shorter than one step, and blocks whose scale is below 2^-100, go to it
//! from here.
//!
//! Callers hold a [`crate::kernels::Backend`] of kind `Avx2` (or `Avx512`, which implies
//! AVX2); that check is what makes calling these `#[target_feature]` functions sound.

use core::arch::x86_64::*;

use super::lanes::{Avx2, Lanes};
use super::loops;
use crate::kernels::fp8;
use crate::kernels::scalar::{self, BlockScale, INF_BITS, Round};
use crate::rng::{Draws, LOWBIAS32_MUL};

pub(super) const ABS: i32 = 0x7FFF_FFFF;
/// The multipliers of `rng::lowbias32`.
pub(super) const C1: u32 = LOWBIAS32_MUL[0];
pub(super) const C2: u32 = LOWBIAS32_MUL[1];
const SIGN: i32 = i32::MIN;

/// `rng::lowbias32` on 8 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn lowbias32x8(x: __m256i) -> __m256i {
    let x = _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x));
    lowbias32_rest(_mm256_mullo_epi32(x, _mm256_set1_epi32(C1 as i32)))
}

/// `rng::lowbias32` on 8 lanes from its first product on.
#[target_feature(enable = "avx2")]
#[inline]
fn lowbias32_rest(x: __m256i) -> __m256i {
    let x = _mm256_xor_si256(x, _mm256_srli_epi32::<15>(x));
    let x = _mm256_mullo_epi32(x, _mm256_set1_epi32(C2 as i32));
    _mm256_xor_si256(x, _mm256_srli_epi32::<16>(x))
}

/// The draw test of random-k, `lowbias32(i ^ key) < t`, for the 64 indices of a group
/// that starts at a multiple of 64, with one vector multiply per 8 draws instead of two.
///
/// For `i = base + j` (`base` a multiple of 64, `j < 64`) and `B = base ^ key`, the first
/// step of `lowbias32` is `y = x ^ (x >> 16)` with `x = B ^ j`. `j` only touches the low 6
/// bits, so `x >> 16 = B >> 16` and `y = Y ^ j` with `Y = B ^ (B >> 16)`. Splitting `y`
/// into its bits from 6 up and its low 6 bits, which do not overlap,
/// `y * C1 = (Y & !63) * C1 + ((Y & 63) ^ j) * C1` (mod 2^32). The first term is one scalar
/// product per group. The second is a table of 64 constants, which depends on
/// `Y & 63 = (key ^ (B >> 16)) & 63`. That changes only when `B >> 16` does, once per
/// 2^16 indices. The rest of the hash runs on 8 lanes as before.
struct GroupDraws {
    key: u32,
    /// `t` with its top bit flipped: the unsigned compare as a signed one.
    t: __m256i,
    /// `B >> 16` of the group the constants are for (`u32::MAX`: none yet).
    hi: u32,
    /// Lane `l` of `k[q]` is `((Y & 63) ^ (8 q + l)) * C1`.
    k: [__m256i; 8],
}

impl GroupDraws {
    #[target_feature(enable = "avx2")]
    #[inline]
    fn new(key: u32, t: u32) -> GroupDraws {
        GroupDraws {
            key,
            t: _mm256_set1_epi32((t ^ 0x8000_0000) as i32),
            hi: u32::MAX,
            k: [_mm256_setzero_si256(); 8],
        }
    }

    /// The constants for the groups whose `B >> 16` is `hi` (once per 2^16 indices).
    #[target_feature(enable = "avx2")]
    #[cold]
    #[inline(never)]
    fn refresh(&mut self, hi: u32) {
        self.hi = hi;
        let c = (self.key ^ hi) & 63;
        for (q, k) in (0u32..).zip(&mut self.k) {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let j = _mm256_add_epi32(lanes, _mm256_set1_epi32(8 * q as i32));
            let v = _mm256_xor_si256(j, _mm256_set1_epi32(c as i32));
            *k = _mm256_mullo_epi32(v, _mm256_set1_epi32(C1 as i32));
        }
    }

    /// The scalar term `(Y & !63) * C1` of the group from `base` (a multiple of 64), on
    /// every lane, with the table made ready for it.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn term(&mut self, base: u32) -> __m256i {
        debug_assert_eq!(base % 64, 0);
        let b = base ^ self.key;
        if b >> 16 != self.hi {
            self.refresh(b >> 16);
        }
        let y = b ^ (b >> 16);
        _mm256_set1_epi32((y & !63).wrapping_mul(C1) as i32)
    }

    /// Lane masks (-1 where the draw is below `t`) of indices `base + 8 q + l`, for vector
    /// `q` and lane `l`; `base` must be a multiple of 64.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn group(&mut self, base: u32) -> [__m256i; 8] {
        let a = self.term(base);
        self.k.map(|k| {
            let h = lowbias32_rest(_mm256_add_epi32(a, k));
            _mm256_cmpgt_epi32(self.t, _mm256_xor_si256(h, _mm256_set1_epi32(SIGN)))
        })
    }

    /// The keep mask of the 64 indices from `base` (a multiple of 64), bit `j` for
    /// `base + j`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn mask64(&mut self, base: u32) -> u64 {
        let g = self.group(base);
        (0..8).fold(0u64, |m, q| {
            let bits = _mm256_movemask_ps(_mm256_castsi256_ps(g[q])) as u8;
            m | (bits as u64) << (8 * q)
        })
    }
}

/// Keep masks of the 64-element groups from `first` on, for any `first`, as a closure
/// `mask(done)` for the group at `first + done` (`done` a multiple of 64, in increasing
/// order). A group that does not start at a multiple of 64 is put together from the two
/// aligned groups it straddles, and the upper one is kept for the next call.
#[target_feature(enable = "avx2")]
#[inline]
fn relative_masks(first: u32, key: u32, t: u32) -> impl FnMut(usize) -> u64 {
    let mut draws = GroupDraws::new(key, t);
    let shift = first % 64;
    // The aligned group that the next group starts in (drawn before `first` too, and
    // shifted out).
    let mut last = if shift == 0 {
        0
    } else {
        draws.mask64(first & !63)
    };
    move |done| {
        let base = first.wrapping_add(done as u32) & !63;
        // Only whole groups inside the caller's range come here, so `base + 64` does not
        // wrap; its indices past the range are shifted out.
        let m = draws.mask64(if shift == 0 { base } else { base + 64 });
        if shift == 0 {
            return m;
        }
        let lo = core::mem::replace(&mut last, m);
        (lo >> shift) | (m << (64 - shift))
    }
}

/// The draws `lowbias32(i ^ key)` of a block's steps of 32 elements (`i` the global index
/// mod 2^32, inside one key's window). A block that starts at a multiple of 32 has every
/// step in one half of an aligned group of 64, and takes the [`GroupDraws`] form: one
/// vector multiply per 8 draws instead of two. One value serves a whole encode call, so
/// that the group table is made once per key and 2^16 indices, not once per block.
pub(super) struct StepDraws<'a> {
    draws: &'a Draws,
    key: __m256i,
    grouped: bool,
    group: GroupDraws,
}

impl<'a> StepDraws<'a> {
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn new(draws: &'a Draws) -> StepDraws<'a> {
        StepDraws {
            draws,
            key: _mm256_setzero_si256(),
            grouped: false,
            group: GroupDraws::new(0, 0),
        }
    }

    /// Ready for the block from global index `start` (inside one key's window).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn begin(&mut self, start: u64) {
        let key = self.draws.key_for(start);
        self.key = _mm256_set1_epi32(key as i32);
        self.grouped = start.is_multiple_of(32);
        if self.group.key != key {
            self.group.key = key;
            self.group.hi = u32::MAX;
        }
    }

    /// The draws of the 32 indices from `at` (mod 2^32), 8 per vector.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn step(&mut self, at: u32) -> [__m256i; 4] {
        if self.grouped {
            let g = &mut self.group;
            let a = g.term(at & !63);
            let k = &g.k[(at as usize & 32) / 8..][..4];
            let h = |q: usize| lowbias32_rest(_mm256_add_epi32(a, k[q]));
            return [h(0), h(1), h(2), h(3)];
        }
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let i0 = _mm256_add_epi32(_mm256_set1_epi32(at as i32), lanes);
        let h = |o: i32| {
            let i = _mm256_add_epi32(i0, _mm256_set1_epi32(o));
            lowbias32x8(_mm256_xor_si256(i, self.key))
        };
        [h(0), h(8), h(16), h(24)]
    }
}

/// The keep mask of the `len < 64` indices from `at`, one draw at a time (the tails).
fn draw_mask_tail(at: u32, key: u32, t: u32, len: usize) -> u64 {
    (0..len).fold(0u64, |m, j| {
        let h = crate::rng::lowbias32(at.wrapping_add(j as u32) ^ key);
        m | ((h < t) as u64) << j
    })
}

/// 32 lanes of small integers (elements 0..8 in `a`, 8..16 in `b`, ...) narrowed to 32
/// bytes in element order: signed saturation when `SIGNED` (int8 codes in [-127, 127]),
/// else unsigned (codes in [0, 255]).
#[target_feature(enable = "avx2")]
#[inline]
fn pack_bytes<const SIGNED: bool>(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    // Each pack works within 128-bit halves, leaving 4-element groups in the order
    // a0 b0 c0 d0 a1 b1 c1 d1; one cross-lane permute restores a0 a1 b0 b1 ...
    let ab = _mm256_packs_epi32(a, b);
    let cd = _mm256_packs_epi32(c, d);
    let p = if SIGNED {
        _mm256_packs_epi16(ab, cd)
    } else {
        _mm256_packus_epi16(ab, cd)
    };
    _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// One block's level quantiser: `a = |x| * inv` with `inv = levels / m`
/// (`scalar::level_multiplier` when its pre-multiplier is 1, that is `m >= 2^-100`; the
/// callers send blocks with a smaller scale to the oracle), rounded to an integer level and
/// clamped to `top`; stochastic rounding draws `lowbias32((start + j) ^ key)` for element
/// `j` ([`StepDraws`]).
struct Levels {
    inv: __m256,
    top: __m256i,
}

impl Levels {
    /// The quantiser of a block with scale `m`, or `None` when `m < 2^-100` (where the
    /// oracle scales by 2^64 first).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn new(m: f32, levels: u32) -> Option<Levels> {
        let (pre, inv) = scalar::level_multiplier(m, levels as f32);
        (pre == 1.0).then(|| Levels::of_inv(inv, levels))
    }

    /// The quantiser of a block whose level multiplier is `inv` (without a pre-scale).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn of_inv(inv: f32, levels: u32) -> Levels {
        Levels {
            inv: _mm256_set1_ps(inv),
            top: _mm256_set1_epi32(levels as i32),
        }
    }

    /// The stochastic levels (in `[0, top]`) of the 8 elements in `v`, whose draws are
    /// the lanes of `h`: the oracle's `scalar::level`, operation for operation, with the
    /// final `fl + 1` and the clamp done on integers (`fl` is integer-valued and small, so
    /// the conversion is exact).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn stochastic8(&self, v: __m256, h: __m256i) -> __m256i {
        let abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(ABS)));
        let a = _mm256_mul_ps(abs, self.inv);
        let u = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(h)),
            _mm256_set1_ps(1.0 / 16_777_216.0),
        );
        let fl = _mm256_floor_ps(a);
        let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(u, _mm256_sub_ps(a, fl)));
        // `up` is -1 where the draw rounds up.
        _mm256_min_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(fl), up), self.top)
    }
}

/// Quantises the 32-element steps of a block: `quant(v, h)` gives the 32-bit codes of the
/// 8 elements in `v`, whose draws are the lanes of `h` (`lowbias32((start + j) ^ key)` for
/// element `j`, from `draws`, when `DRAWS`; zero otherwise); the four results go to
/// `store(bytes, g)`, narrowed by [`pack_bytes`], for the step at element `g`. Returns the
/// number of elements done.
#[target_feature(enable = "avx2")]
#[inline]
fn steps32<const SIGNED: bool, const DRAWS: bool>(
    xb: &[f32],
    start: u64,
    draws: &mut StepDraws,
    mut quant: impl FnMut(__m256, __m256i) -> __m256i,
    store: impl FnMut(__m256i, usize),
) -> usize {
    steps32x4::<SIGNED, DRAWS>(
        xb,
        start,
        draws,
        // Written out: `[T; 4]::map` is not always inlined, and its calls cost 9x here.
        #[inline(always)]
        |v, h| {
            [
                quant(v[0], h[0]),
                quant(v[1], h[1]),
                quant(v[2], h[2]),
                quant(v[3], h[3]),
            ]
        },
        store,
    )
}

/// [`steps32`] with the four vectors of a step quantised together: `quant(v, h)` gives
/// the codes of the 32 elements in `v`, whose draws are the lanes of `h` (when `DRAWS`).
#[target_feature(enable = "avx2")]
#[inline]
fn steps32x4<const SIGNED: bool, const DRAWS: bool>(
    xb: &[f32],
    start: u64,
    draws: &mut StepDraws,
    mut quant: impl FnMut([__m256; 4], [__m256i; 4]) -> [__m256i; 4],
    mut store: impl FnMut(__m256i, usize),
) -> usize {
    if DRAWS {
        draws.begin(start);
    }
    let chunks = xb.chunks_exact(32);
    let done = xb.len() - chunks.remainder().len();
    for (k, c) in chunks.enumerate() {
        // SAFETY: `c` holds 32 f32, four unaligned __m256.
        let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(c.as_ptr().add(o))) };
        let h = if DRAWS {
            draws.step((start as u32).wrapping_add(32 * k as u32))
        } else {
            [_mm256_setzero_si256(); 4]
        };
        let [q0, q1, q2, q3] = quant(v, h);
        store(pack_bytes::<SIGNED>(q0, q1, q2, q3), 32 * k);
    }
    done
}

/// int8 encode with AVX2 (the contract of `scalar::encode_int8`; every code byte written).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn encode_int8_avx2(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let mut sd = StepDraws::new(draws);
    scalar::encode_int8_blocks(
        x,
        block,
        round,
        draws,
        first,
        steps,
        codes,
        #[inline(always)]
        |xb, cb, m, start| match round {
            Round::Nearest => int8_block::<false>(xb, cb, m, &mut sd, start),
            Round::Stochastic => int8_block::<true>(xb, cb, m, &mut sd, start),
        },
    )
}

/// int8's fused error-feedback step, block by block: `p = beta r + gamma g` is formed into
/// `r` (two rounded products and a rounded sum, as `scalar::feedback_form`) while its
/// largest magnitude is taken, the block's step and codes are written as
/// `scalar::encode_int8` writes them (rounding `round`, the draws of `draws` from global
/// index `first`), and `r` becomes
/// `scalar::residual_of(p, code * step)`, as a residual-mode `scalar::decode_int8` of
/// the codes would leave it, in the same pass as the codes. True if any `p` is NaN or
/// ±Inf. `r`, `g` and the codes hold the same number of elements.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn feedback_int8_avx2(
    r: &mut [f32],
    g: &[f32],
    (beta, gamma): (f32, f32),
    block: usize,
    (round, draws, first): (Round, &Draws, u64),
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let mut sd = StepDraws::new(draws);
    feedback_int8_blocks(
        r,
        g,
        block,
        (round, draws, first),
        steps,
        codes,
        #[inline(always)]
        |rb, gb| form_max_abs(rb, gb, beta, gamma),
        #[inline(always)]
        |inv, step, rb, cb, start| match round {
            Round::Nearest => int8_residual_block::<false>(inv, step, &mut sd, start, rb, cb),
            Round::Stochastic => int8_residual_block::<true>(inv, step, &mut sd, start, rb, cb),
        },
    )
}

/// The block loop of int8's fused error-feedback step (the contract of
/// [`feedback_int8_avx2`]), for a kernel's two passes: `form(rb, gb)` forms `p` into the
/// block `rb` and returns its largest `|p|` bit pattern; a finite block whose scale is
/// at least 2^-100 (level multiplier `inv` without a pre-scale) and which lies inside
/// one 2^32 draw window is quantised by `quantise(inv, step, rb, cb, start)`, which
/// leaves the residuals in `rb`; the oracle does the other blocks. Inlined, so that the
/// kernels' closures are compiled for their instruction sets.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn feedback_int8_blocks(
    r: &mut [f32],
    g: &[f32],
    block: usize,
    (round, draws, first): (Round, &Draws, u64),
    steps: &mut [u8],
    codes: &mut [u8],
    mut form: impl FnMut(&mut [f32], &[f32]) -> u32,
    mut quantise: impl FnMut(f32, f32, &mut [f32], &mut [u8], u64),
) -> bool {
    assert!(r.len() == g.len() && codes.len() == r.len() && block > 0);
    let mut nonfinite = false;
    let blocks = r.chunks_mut(block).zip(g.chunks(block));
    for (b, ((rb, gb), cb)) in blocks.zip(codes.chunks_mut(block)).enumerate() {
        let scale = BlockScale::of_max_bits(form(rb, gb));
        let step = scale.step(127);
        nonfinite |= scale == BlockScale::NonFinite;
        scalar::put_step(steps, b, step);
        let BlockScale::Of(m) = scale else {
            // No scale: all codes 0, and the residual that decoding them leaves.
            cb.fill(0);
            for p in rb.iter_mut() {
                *p = scalar::residual_of(*p, 0.0 * step);
            }
            continue;
        };
        let start = first + (b * block) as u64;
        let (pre, inv) = scalar::level_multiplier(m, 127.0);
        if pre == 1.0 && scalar::in_one_window(start, rb.len()) {
            quantise(inv, step, rb, cb, start);
            continue;
        }
        // A scale below 2^-100 or a block across a 2^32 draw window: the oracle.
        scalar::quantise_int8(rb, cb, m, round, draws, start);
        for (p, &c) in rb.iter_mut().zip(cb.iter()) {
            *p = scalar::residual_of(*p, (c as i8) as f32 * step);
        }
    }
    nonfinite
}

/// int8's fused ring hop: `sum = local + decode(in_steps, in_codes)` (as a `mode::ADD`
/// `scalar::decode_int8` onto a copy of `local` leaves it), each block's largest
/// magnitude taken in the same pass, then `sum` encoded into `steps` and `codes` as
/// `scalar::encode_int8` encodes it (from global index `first`). True if any sum is NaN
/// or ±Inf. Every slice but the steps holds `sum.len()` elements or codes.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn hop_int8_avx2(
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
    let mut sd = StepDraws::new(draws);
    hop_int8_blocks(
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
        |inv, sb, cb, start| match round {
            Round::Nearest => int8_codes::<false>(inv, sb, cb, &mut sd, start),
            Round::Stochastic => int8_codes::<true>(inv, sb, cb, &mut sd, start),
        },
    )
}

/// The block loop of int8's fused ring hop (the contract of [`hop_int8_avx2`]), for a
/// kernel's two passes: `add(sb, lb, ib, step)` writes `local + code * step` into the
/// block `sb` and returns its largest `|sum|` bit pattern; a finite block whose scale is
/// at least 2^-100 (level multiplier `inv`) and which lies inside one 2^32 draw window
/// has its codes written by `quantise(inv, sb, cb, start)`; the oracle does the other
/// blocks. Inlined, as [`feedback_int8_blocks`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn hop_int8_blocks(
    local: &[f32],
    (in_steps, in_codes): (&[u8], &[u8]),
    block: usize,
    (round, draws, first): (Round, &Draws, u64),
    sum: &mut [f32],
    steps: &mut [u8],
    codes: &mut [u8],
    mut add: impl FnMut(&mut [f32], &[f32], &[u8], f32) -> u32,
    mut quantise: impl FnMut(f32, &[f32], &mut [u8], u64),
) -> bool {
    let n = sum.len();
    assert!(local.len() == n && in_codes.len() == n && codes.len() == n && block > 0);
    let mut nonfinite = false;
    let blocks = sum.chunks_mut(block).zip(local.chunks(block));
    for (b, ((sb, lb), (ib, cb))) in blocks
        .zip(in_codes.chunks(block).zip(codes.chunks_mut(block)))
        .enumerate()
    {
        let scale = BlockScale::of_max_bits(add(sb, lb, ib, scalar::get_step(in_steps, b)));
        nonfinite |= scale == BlockScale::NonFinite;
        scalar::put_step(steps, b, scale.step(127));
        let BlockScale::Of(m) = scale else {
            cb.fill(0);
            continue;
        };
        let start = first + (b * block) as u64;
        let (pre, inv) = scalar::level_multiplier(m, 127.0);
        if pre == 1.0 && scalar::in_one_window(start, sb.len()) {
            quantise(inv, sb, cb, start);
        } else {
            scalar::quantise_int8(sb, cb, m, round, draws, start);
        }
    }
    nonfinite
}

/// `sum = local + code * step` for one block of int8 codes (the operations of a
/// `mode::ADD` decode onto `local`), returning the largest `|sum|` bit pattern.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn add_max_abs(sum: &mut [f32], local: &[f32], codes: &[u8], step: f32) -> u32 {
    // SAFETY: this function's features are `Avx2`'s.
    let (mut most, whole) = unsafe { loops::add_max_abs::<Avx2>(sum, local, codes, step) };
    let rest = sum[whole..].iter_mut().zip(&local[whole..]);
    for ((s, &l), &c) in rest.zip(&codes[whole..]) {
        *s = l + (c as i8) as f32 * step;
        most = most.max(s.to_bits() & ABS as u32);
    }
    most
}

/// `r = beta r + gamma g` in place (the operations of `scalar::feedback_form`), returning
/// the largest `|p|` bit pattern (`scalar::max_abs_bits` of the formed block).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn form_max_abs(r: &mut [f32], g: &[f32], beta: f32, gamma: f32) -> u32 {
    // SAFETY: this function's features are `Avx2`'s.
    let (mut most, whole) = unsafe { loops::form_max_abs::<Avx2>(r, g, beta, gamma) };
    for (r, &g) in r[whole..].iter_mut().zip(&g[whole..]) {
        *r = beta * *r + gamma * g;
        most = most.max(r.to_bits() & ABS as u32);
    }
    most
}

/// The largest of the 8 unsigned 32-bit lanes of `m`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn lanes_max(m: __m256i) -> u32 {
    let mut lanes = [0u32; 8];
    // SAFETY: `lanes` is 8 u32, one unaligned __m256i.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), m) };
    lanes.into_iter().max().unwrap_or(0)
}

/// The codes of a finite formed block `rb` whose level multiplier is `inv` and whose
/// step is `step`, as [`int8_codes`] writes them, with `rb` becoming the residual of
/// each element against its decode `d = code * step`: 32 a step, the rest padded to 32
/// ([`padded_rest`]). The AVX-512 kernels call it for the rest of a block.
/// The residual is `p - d` without `scalar::residual_of`'s checks, which cannot fire
/// here: `p` is finite, `d` is finite (`127 step` is, by `scalar::block_step`) and of
/// `p`'s sign or zero (the code is `p`'s level, rounded either way), so `|p - d| <=
/// max(|p|, |d|)`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn int8_residual_block<const STOCHASTIC: bool>(
    inv: f32,
    step: f32,
    sd: &mut StepDraws,
    start: u64,
    rb: &mut [f32],
    cb: &mut [u8],
) {
    let l = &Levels::of_inv(inv, 127);
    let s = _mm256_set1_ps(step);
    if STOCHASTIC {
        sd.begin(start);
    }
    let whole = rb.len() / 32 * 32;
    let steps = rb[..whole]
        .chunks_exact_mut(32)
        .zip(cb.chunks_exact_mut(32));
    for (k, (p32, c32)) in steps.enumerate() {
        let h = if STOCHASTIC {
            sd.step((start as u32).wrapping_add(32 * k as u32))
        } else {
            [_mm256_setzero_si256(); 4]
        };
        let mut q = [_mm256_setzero_si256(); 4];
        for (j, q) in q.iter_mut().enumerate() {
            let o = &mut p32[8 * j..8 * j + 8];
            // SAFETY: `o` holds 8 f32, one unaligned __m256 for the load and the store.
            unsafe {
                let p = _mm256_loadu_ps(o.as_ptr());
                *q = int8x8::<STOCHASTIC>(l, p, h[j]);
                let d = _mm256_mul_ps(_mm256_cvtepi32_ps(*q), s);
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(p, d));
            }
        }
        let bytes = pack_bytes::<true>(q[0], q[1], q[2], q[3]);
        // SAFETY: `c32` holds 32 bytes, one unaligned __m256i.
        unsafe { _mm256_storeu_si256(c32.as_mut_ptr().cast(), bytes) };
    }
    if whole < rb.len() {
        let at = start + whole as u64;
        let (rt, ct) = (&mut rb[whole..], &mut cb[whole..]);
        let residuals = padded_rest(
            rt,
            ct,
            #[inline(always)]
            |p32, c32| int8_residual_block::<STOCHASTIC>(inv, step, sd, at, p32, c32),
        );
        rt.copy_from_slice(&residuals[..rt.len()]);
    }
}

/// The rest of a block after its whole 32s (fewer than 32 elements `rest`) through a
/// kernel of whole 32s: padded with zeros to 32, `run(x32, c32)` quantises the 32 into
/// `c32` (it may rewrite `x32`, as the error-feedback kernels leave their residuals
/// there), and the first `codes.len()` code bytes are kept. Returns the 32 elements as
/// `run` left them.
///
/// Every quantiser here codes an element alone, from its value, its block's scale and
/// its global index's draw, and a zero codes to zero bits, so the real elements get the
/// oracle's codes and a partly filled last byte of packed codes the zeros the oracle
/// leaves there. The padding's draws (indices past the block, mod 2^32) are computed and
/// dropped. One step of 32 in registers costs less than the oracle's loop on even a few
/// elements (int8 at blocks of 48 ran 2.8 GB/s with the oracle, against 14 at blocks of
/// 32).
#[inline(always)]
pub(super) fn padded_rest(
    rest: &[f32],
    codes: &mut [u8],
    run: impl FnOnce(&mut [f32], &mut [u8]),
) -> [f32; 32] {
    assert!(rest.len() < 32 && codes.len() <= 32);
    let (mut x, mut c) = ([0f32; 32], [0u8; 32]);
    x[..rest.len()].copy_from_slice(rest);
    run(&mut x, &mut c);
    codes.copy_from_slice(&c[..codes.len()]);
    x
}

/// int8 codes of one finite block with a non-zero max `m`, inside one 2^32 index window,
/// by [`int8_codes`] (the oracle where the scale is below 2^-100).
#[target_feature(enable = "avx2")]
#[inline]
fn int8_block<const STOCHASTIC: bool>(
    xb: &[f32],
    cb: &mut [u8],
    m: f32,
    sd: &mut StepDraws,
    start: u64,
) {
    let round = if STOCHASTIC {
        Round::Stochastic
    } else {
        Round::Nearest
    };
    let d = sd.draws;
    let (pre, inv) = scalar::level_multiplier(m, 127.0);
    if pre != 1.0 {
        return scalar::quantise_int8(xb, cb, m, round, d, start);
    }
    int8_codes::<STOCHASTIC>(inv, xb, cb, sd, start);
}

/// The int8 codes of a finite block `xb` whose level multiplier is `inv`
/// (`scalar::level_multiplier` without a pre-scale; stochastic rounding when
/// `STOCHASTIC`, from the draws of global index `start` on, inside one 2^32 window), as
/// `scalar::quantise_int8` writes them: 32 a step, the rest padded to 32
/// ([`padded_rest`]). The AVX-512 kernels call it for the rest of a block.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn int8_codes<const STOCHASTIC: bool>(
    inv: f32,
    xb: &[f32],
    cb: &mut [u8],
    sd: &mut StepDraws,
    start: u64,
) {
    let l = &Levels::of_inv(inv, 127);
    let whole = steps32::<true, STOCHASTIC>(
        xb,
        start,
        sd,
        #[inline(always)]
        |v, h| int8x8::<STOCHASTIC>(l, v, h),
        #[inline(always)]
        |bytes, g| {
            let o = &mut cb[g..g + 32];
            // SAFETY: `o` holds 32 bytes, one unaligned __m256i.
            unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), bytes) };
        },
    );
    if whole < xb.len() {
        let at = start + whole as u64;
        padded_rest(
            &xb[whole..],
            &mut cb[whole..xb.len()],
            #[inline(always)]
            |x32, c32| int8_codes::<STOCHASTIC>(inv, x32, c32, sd, at),
        );
    }
}

/// The int8 codes (in 32-bit lanes) of the 8 elements in `v`, with draws `h` (when
/// `STOCHASTIC`).
#[target_feature(enable = "avx2")]
#[inline]
fn int8x8<const STOCHASTIC: bool>(l: &Levels, v: __m256, h: __m256i) -> __m256i {
    if STOCHASTIC {
        // The level with the input's sign (psignd: negated for negative bit patterns,
        // -0.0 included; a +0.0 input has level 0).
        _mm256_sign_epi32(l.stochastic8(v, h), _mm256_castps_si256(v))
    } else {
        // Round half to even is sign-symmetric, and it is what the conversion does (the
        // default MXCSR mode, which Rust code never changes): round the signed value and
        // clamp to [-127, 127].
        let q = _mm256_cvtps_epi32(_mm256_mul_ps(v, l.inv));
        _mm256_max_epi32(_mm256_min_epi32(q, l.top), _mm256_set1_epi32(-127))
    }
}

/// Sign-magnitude codes from 32 signed levels narrowed to bytes (in `[-levels, levels]`,
/// `levels < sign_bit`): the magnitude, with `sign_bit` (in every byte of `sign_bit8`) set
/// where the level is negative. A zero level has no sign, as in the oracle.
#[target_feature(enable = "avx2")]
#[inline]
fn signmag_bytes(signed: __m256i, sign_bit8: __m256i) -> __m256i {
    // min(b & 0x80, sign_bit) is sign_bit for negative bytes and 0 for the rest.
    let sign = _mm256_min_epu8(
        _mm256_and_si256(signed, _mm256_set1_epi8(i8::MIN)),
        sign_bit8,
    );
    _mm256_or_si256(_mm256_abs_epi8(signed), sign)
}

/// The sum of squares of qsgd's block norm (`scalar::l2_squares`): f64 squares in the
/// oracle's 16 lanes, four registers of 4, reduced in the oracle's order. The square of
/// an f32 is exact in f64 (48 significant bits), so only the add rounds, as in the oracle.
/// A multiply and an add, not a fused multiply-add: the lanes' adds form the loop's
/// dependency chains, and an add's latency is shorter (3 cycles against 4 on Zen 3).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn l2_squares(x: &[f32]) -> f64 {
    let mut acc = [_mm256_setzero_pd(); 4];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` holds 16 f32, four unaligned __m128.
        let d = unsafe { [0, 4, 8, 12].map(|o| _mm256_cvtps_pd(_mm_loadu_ps(c.as_ptr().add(o)))) };
        for k in 0..4 {
            acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d[k], d[k]));
        }
    }
    let mut l = [0f64; 16];
    for (k, a) in acc.iter().enumerate() {
        let o = &mut l[4 * k..4 * k + 4];
        // SAFETY: `o` holds 4 f64, one unaligned __m256d.
        unsafe { _mm256_storeu_pd(o.as_mut_ptr(), *a) };
    }
    for (k, &v) in rest.iter().enumerate() {
        l[k] += (v as f64) * (v as f64);
    }
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            l[j] += l[j + w];
        }
    }
    l[0]
}

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
/// a step, the rest padded to 32 ([`padded_rest`]).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn signmag_block<const BITS: u32>(
    xb: &[f32],
    cb: &mut [u8],
    m: f32,
    sd: &mut StepDraws,
    start: u64,
) {
    let d = sd.draws;
    let levels = (1u32 << (BITS - 1)) - 1;
    let Some(l) = Levels::new(m, levels) else {
        return scalar::quantise_signmag_bytes(xb, cb, m, BITS, d, start);
    };
    let sign_bit8 = _mm256_set1_epi8((1u8 << (BITS - 1)) as i8);
    let n32 = steps32::<true, true>(
        xb,
        start,
        sd,
        // The level with the input's sign (psignd: negated for negative bit patterns).
        #[inline(always)]
        |v, h| _mm256_sign_epi32(l.stochastic8(v, h), _mm256_castps_si256(v)),
        #[inline(always)]
        |signed, g| {
            let bytes = signmag_bytes(signed, sign_bit8);
            let o = &mut cb[g * BITS as usize / 8..(g + 32) * BITS as usize / 8];
            match BITS {
                // SAFETY: `o` holds 32 bytes, one unaligned __m256i.
                8 => unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), bytes) },
                4 => {
                    // Pairs of 4-bit codes, low nibble first: c0 + 16 c1.
                    let pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
                    let p = _mm256_packus_epi16(pairs, pairs);
                    let p = _mm256_permute4x64_epi64::<0b00_00_10_00>(p);
                    // SAFETY: `o` holds 16 bytes, one unaligned __m128i.
                    unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(p)) };
                }
                _ => {
                    // Quads of 2-bit codes: (c0 + 4 c1) + 16 (c2 + 4 c3).
                    let pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401));
                    let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x0010_0001));
                    let p = _mm256_packs_epi32(quads, quads);
                    let p = _mm256_packus_epi16(p, p);
                    let p =
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
                    // SAFETY: `o` holds 8 bytes, the low half of one __m128i.
                    unsafe { _mm_storel_epi64(o.as_mut_ptr().cast(), _mm256_castsi256_si128(p)) };
                }
            }
        },
    );
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
pub(super) fn put8<const M: u8>(out: &mut [f32], j: usize, v: __m256) {
    let o = &mut out[j..j + 8];
    // SAFETY: `o` holds 8 f32, one unaligned __m256 for the load and the store; this
    // function's features are `Avx2`'s.
    unsafe { Avx2::put::<M>(o.as_mut_ptr(), v) }
}

/// `scalar::residual_of(p, d)` in 8 lanes ([`Lanes::residual`]).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn residual8(p: __m256, d: __m256) -> __m256 {
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
    let sign = _mm256_set1_epi32(SIGN);
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = _mm256_set1_ps(scalar::get_step(steps, b));
        let cb = &codes[b * block / 8..];
        let n8 = ob.len() / 8 * 8;
        for g in (0..n8).step_by(8) {
            let bits = _mm256_sllv_epi32(_mm256_set1_epi32(cb[g / 8] as i32), shifts);
            let v = _mm256_xor_ps(s, _mm256_castsi256_ps(_mm256_and_si256(bits, sign)));
            put8::<M>(ob, g, v);
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
    super::compress_masks_avx2(n, idx, crate::kernels::rare_keep(t.into()), |done, len| {
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
    })
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
    use super::super::portable::count_draw_lt as portable_count;
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
/// ([`float_blocks`]), in mode `M` (any: [`put8`]); returns how many blocks it decoded (an
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
    let bits = fours.map(f32::to_bits);
    if bits.iter().any(|b| b & 0xFFFF != 0) {
        return None;
    }
    let planes = [bits.map(|b| (b >> 16) as u8), bits.map(|b| (b >> 24) as u8)];
    // SAFETY: each plane is 16 bytes, one unaligned __m128i.
    Some(planes.map(|p| _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p.as_ptr().cast()) })))
}

/// fp8 encode with nearest rounding (`fp8::encode` without draws) of E4M3 (`e4m3`) or
/// E5M2 codes, one byte each, with an f32 or E8M0 block scale: the definition's block
/// layout ([`fp8::encode_blocks`]) with the scaled elements converted 32 at a time
/// ([`fp8_nearest_block`]); blocks of whole 32s go eight at a time with their maxima and
/// scales formed in one vector ([`fp8_group`]), which saves each block's horizontal
/// maximum and scalar scale. The same bytes as the definition; returns whether `x` held
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
        block.is_multiple_of(32),
        block,
        scale.bytes(),
        1,
        x,
        scales,
        codes,
        #[inline(always)]
        |xg, sg, cg| match (e4m3, scale) {
            (true, fp8::Scale::E8m0) => fp8_group::<3, true>(f, block, xg, sg, cg),
            (true, _) => fp8_group::<3, false>(f, block, xg, sg, cg),
            (false, fp8::Scale::E8m0) => fp8_group::<2, true>(f, block, xg, sg, cg),
            (false, _) => fp8_group::<2, false>(f, block, xg, sg, cg),
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
pub(super) fn in_groups(
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
pub(super) fn encode_fp8_rest(
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

/// The largest magnitude bits of each of eight blocks of `block` (a multiple of 8)
/// elements of `xg`, in block order.
#[target_feature(enable = "avx2")]
#[inline]
fn group_max_bits(block: usize, xg: &[f32]) -> __m256i {
    assert!(xg.len() >= 8 * block && block.is_multiple_of(8));
    let abs = _mm256_set1_epi32(ABS);
    let mut v = [_mm256_setzero_si256(); 8];
    for (m, xb) in v.iter_mut().zip(xg.chunks_exact(block)) {
        for c in xb.chunks_exact(8) {
            // SAFETY: `c` holds 8 f32, one unaligned __m256i.
            let e = unsafe { _mm256_loadu_si256(c.as_ptr().cast()) };
            // Magnitude bits are below 2^31: a signed maximum orders them.
            *m = _mm256_max_epi32(*m, _mm256_and_si256(e, abs));
        }
    }
    fold_maxima(v)
}

/// The lanes' maxima of each of eight vectors, in vector order: lane `j` of the result is
/// the largest (signed) lane of `v[j]`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn fold_maxima(v: [__m256i; 8]) -> __m256i {
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
pub(super) fn group_scales<const E8M0: bool>(
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

/// Eight blocks of `block` (a multiple of 32) elements `xg` of fp8 in the format of `M`
/// mantissa bits: the scales formed together ([`group_scales`]), then each block's codes
/// 32 at a time. False, writing nothing, where [`group_scales`] declines.
#[target_feature(enable = "avx2")]
#[inline]
fn fp8_group<const M: u32, const E8M0: bool>(
    f: fp8::Format,
    block: usize,
    xg: &[f32],
    sg: &mut [u8],
    cg: &mut [u8],
) -> bool {
    let Some(by) = group_scales::<E8M0>(f, group_max_bits(block, xg), sg) else {
        return false;
    };
    for (j, (xb, cb)) in xg
        .chunks_exact(block)
        .zip(cg.chunks_exact_mut(block))
        .enumerate()
    {
        let n = Nearest::with_by(f, _mm256_permutevar8x32_ps(by, _mm256_set1_epi32(j as i32)));
        fp8_whole32s::<M, E8M0>(&n, xb, cb);
    }
    true
}

/// fp4 encode with nearest rounding (`fp8::encode` with `four`, without draws) of E2M1
/// codes, or with `e3m0` of E3M0 codes, two per byte, with any block scale: the
/// definition's block layout with the scaled elements converted 32 (then 16) at a time
/// and packed by a multiply-add ([`fp4_nearest_block`]); blocks of a multiple of 16 go
/// eight at a time as fp8's do ([`fp4_group`]). The same bytes as the definition; returns whether `x` held NaN or
/// ±Inf.
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
        groups_take(fp4_format::<M>(), scale) && block.is_multiple_of(16),
        block,
        scale.bytes(),
        2,
        x,
        scales,
        codes,
        #[inline(always)]
        |xg, sg, cg| fp4_group::<M>(scale, block, xg, sg, cg),
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
pub(super) fn groups_take(f: fp8::Format, scale: fp8::Scale) -> bool {
    match scale {
        fp8::Scale::E4m3 { global } => {
            let g = f32::from_bits(global);
            g >= f32::MIN_POSITIVE && (f.max() * g).is_finite()
        }
        _ => true,
    }
}

/// Eight blocks of `block` (a multiple of 16) elements `xg` of 4-bit codes with `scale`
/// (not `None`): [`fp8_group`]'s plan ([`group_scales`], or [`group_e4m3_scales`] for
/// E4M3 scales) with [`fp4_whole16s`]'s packing. False, writing nothing, where the
/// scales decline.
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_group<const M: u32>(
    scale: fp8::Scale,
    block: usize,
    xg: &[f32],
    sg: &mut [u8],
    cg: &mut [u8],
) -> bool {
    let f = fp4_format::<M>();
    let m = group_max_bits(block, xg);
    let by = match scale {
        fp8::Scale::E8m0 => group_scales::<true>(f, m, sg),
        fp8::Scale::E4m3 { global } => group_e4m3_scales(f, global, m, sg),
        _ => group_scales::<false>(f, m, sg),
    };
    let Some(by) = by else {
        return false;
    };
    if scale == fp8::Scale::E8m0 {
        fp4_group_codes::<M, true>(block, by, xg, cg);
    } else {
        fp4_group_codes::<M, false>(block, by, xg, cg);
    }
    true
}

/// The codes of [`fp4_group`]'s eight blocks, block `j`'s quotients formed with lane `j`
/// of `by` (multiplied by it when `MULTIPLY`, else divided).
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_group_codes<const M: u32, const MULTIPLY: bool>(
    block: usize,
    by: __m256,
    xg: &[f32],
    cg: &mut [u8],
) {
    let f = fp4_format::<M>();
    for (j, (xb, cb)) in xg
        .chunks_exact(block)
        .zip(cg.chunks_exact_mut(block / 2))
        .enumerate()
    {
        let n = Nearest::with_by(f, _mm256_permutevar8x32_ps(by, _mm256_set1_epi32(j as i32)));
        fp4_whole16s::<M, MULTIPLY>(&n, xb, cb);
    }
}

/// [`group_scales`] for E4M3 block scales over the frame scale with bits `global` (at
/// least `2^-126`, `FMAX g` finite): each block's byte `fp8::e4m3_ceil(m / (FMAX g))`
/// and its scale `v g` (`v` the byte's value), as `fp8::Quotient::new` forms them, lane
/// by lane; the elements are divided by the scales returned.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn group_e4m3_scales(
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

/// The packed 4-bit codes of `xb`'s whole 16s into `cb`: [`fp4_whole32s`], then 16 more
/// (all of an NVFP4-like block of 16) by the same steps on two vectors, the other two
/// zero, keeping the first 8 bytes. How many elements that was.
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_whole16s<const M: u32, const MULTIPLY: bool>(
    n: &Nearest,
    xb: &[f32],
    cb: &mut [u8],
) -> usize {
    let done = fp4_whole32s::<M, MULTIPLY>(n, xb, cb);
    if xb.len() - done < 16 {
        return done;
    }
    // SAFETY: `xb[done..]` holds at least 16 f32, two unaligned __m256.
    let (v0, v1) = unsafe {
        let p = xb.as_ptr().add(done);
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    };
    let (c0, c1) = (
        n.code::<M, MULTIPLY, true>(v0),
        n.code::<M, MULTIPLY, true>(v1),
    );
    let zero = _mm256_setzero_si256();
    let pair = _mm256_set1_epi16(0x1001);
    let pairs = _mm256_maddubs_epi16(pack_bytes::<false>(c0, c1, zero, zero), pair);
    let bytes = _mm256_packus_epi16(pairs, pairs);
    let o = &mut cb[done / 2..done / 2 + 8];
    // SAFETY: `o` holds 8 bytes, the low 64 bits of one __m128i.
    unsafe { _mm_storel_epi64(o.as_mut_ptr().cast(), _mm256_castsi256_si128(bytes)) };
    done + 16
}

/// The packed 4-bit codes of `xb`'s whole 32s into `cb` (two per byte, the even element in
/// the low nibble): their 4-bit codes ([`Nearest::code`]) narrowed to bytes, each pair
/// joined by a multiply-add (`lo + 16 hi`) and narrowed again. How many elements that was.
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_whole32s<const M: u32, const MULTIPLY: bool>(
    n: &Nearest,
    xb: &[f32],
    cb: &mut [u8],
) -> usize {
    let pair = _mm256_set1_epi16(0x1001);
    for (c, o) in xb.chunks_exact(32).zip(cb.chunks_exact_mut(16)) {
        let [c0, c1, c2, c3] = n.codes32::<M, MULTIPLY, true>(c);
        let pairs = _mm256_maddubs_epi16(pack_bytes::<false>(c0, c1, c2, c3), pair);
        // Each half's 8 bytes, then the second half's moved next to the first.
        let bytes = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi16(pairs, pairs));
        // SAFETY: `o` holds 16 bytes, one unaligned __m128i.
        unsafe { _mm_storeu_si128(o.as_mut_ptr().cast(), _mm256_castsi256_si128(bytes)) };
    }
    xb.len() / 32 * 32
}

/// The constants of [`Nearest::code`].
struct Nearest {
    by: __m256,
    emin: __m256i,
    exponent: __m256i,
    ulp: __m256i,
    top: __m256i,
    abs: __m256i,
    /// E3M0 only: `127 - bias`, the f32 exponent field of code 0's binade.
    rebias: __m256i,
}

impl Nearest {
    #[target_feature(enable = "avx2")]
    #[inline]
    /// The constants for format `f` and a block's quotient `q` (its `inv` when it has
    /// one, else its scale `s`).
    fn new(f: fp8::Format, q: fp8::Quotient) -> Nearest {
        Nearest::with_by(f, _mm256_set1_ps(q.inv.unwrap_or(q.s)))
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    /// The constants for format `f` with the block's operand `by` in every lane.
    fn with_by(f: fp8::Format, by: __m256) -> Nearest {
        Nearest {
            by,
            emin: _mm256_set1_epi32((1 - f.bias + 127) << 23),
            exponent: _mm256_set1_epi32(0x7F80_0000),
            ulp: _mm256_set1_epi32((23 - f.m as i32) << 23),
            top: _mm256_set1_epi32(f.max_code as i32),
            abs: _mm256_set1_epi32(ABS),
            rebias: _mm256_set1_epi32(127 - f.bias),
        }
    }

    /// `fp8::nearest_in_range` of the quotients of the 8 elements in `v` (`v * by` when
    /// `MULTIPLY`, else `v / by`) in a format of `M` mantissa bits (0 to 3), in 32-bit
    /// lanes, operation for operation: the count of grid spacings by adding a power of
    /// two whose ulp is the spacing, plus `2^M` per binade; for E3M0 (`M` 0, where a tie
    /// goes to the even code, not the even count) the f32 exponent rounded by integer
    /// addition, and below the smallest normal the count of it. The sign goes to bit 7,
    /// or with `FOUR` to bit 3. The quotient's clamp to ±FMAX is a minimum of the code
    /// magnitude instead: the conversion is monotonic and FMAX is on the grid, so a
    /// quotient above FMAX (never NaN: a finite element over a positive finite scale)
    /// gives FMAX's code either way.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn code<const M: u32, const MULTIPLY: bool, const FOUR: bool>(&self, v: __m256) -> __m256i {
        let y = if MULTIPLY {
            _mm256_mul_ps(v, self.by)
        } else {
            _mm256_div_ps(v, self.by)
        };
        let bits = _mm256_castps_si256(y);
        let a = _mm256_and_si256(bits, self.abs);
        let sign = if FOUR {
            _mm256_and_si256(_mm256_srli_epi32::<28>(bits), _mm256_set1_epi32(8))
        } else {
            _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80))
        };
        if M == 0 {
            // a + (2^22 - 1) + (the exponent's parity), the exponent field less the bias:
            // the code of a normal quotient (the exponent's parity is the code's).
            let parity = _mm256_and_si256(_mm256_srli_epi32::<23>(a), _mm256_set1_epi32(1));
            let r = _mm256_add_epi32(
                _mm256_add_epi32(a, _mm256_set1_epi32((1 << 22) - 1)),
                parity,
            );
            let normal = _mm256_sub_epi32(_mm256_srli_epi32::<23>(r), self.rebias);
            // Below the smallest normal the grid is 0 and it: code 1 above half of it, 0
            // up to half (the tie goes to the even code 0), as the definition's rounding
            // of |y| 2^(bias - 1) to an integer gives.
            let half = _mm256_sub_epi32(self.emin, _mm256_set1_epi32(1 << 23));
            let sub = _mm256_srli_epi32::<31>(_mm256_cmpgt_epi32(a, half));
            let q = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(self.emin, a));
            return _mm256_or_si256(_mm256_min_epi32(q, self.top), sign);
        }
        let e = _mm256_max_epi32(_mm256_and_si256(a, self.exponent), self.emin);
        let magic = _mm256_add_epi32(e, self.ulp);
        let sum = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic));
        let count = _mm256_sub_epi32(_mm256_castps_si256(sum), magic);
        let binades = _mm256_sub_epi32(e, self.emin);
        let binades = match M {
            3 => _mm256_srli_epi32::<20>(binades),
            2 => _mm256_srli_epi32::<21>(binades),
            _ => _mm256_srli_epi32::<22>(binades),
        };
        let q = _mm256_min_epi32(_mm256_add_epi32(binades, count), self.top);
        _mm256_or_si256(q, sign)
    }

    /// [`Nearest::code`] of the 32 elements of `c`, in four vectors of 8.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn codes32<const M: u32, const MULTIPLY: bool, const FOUR: bool>(
        &self,
        c: &[f32],
    ) -> [__m256i; 4] {
        assert!(c.len() >= 32);
        // SAFETY: `c` holds at least 32 f32, four unaligned __m256 (no closures: they
        // would be compiled without AVX2 and might not be inlined).
        let v = unsafe {
            let p = c.as_ptr();
            [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ]
        };
        [
            self.code::<M, MULTIPLY, FOUR>(v[0]),
            self.code::<M, MULTIPLY, FOUR>(v[1]),
            self.code::<M, MULTIPLY, FOUR>(v[2]),
            self.code::<M, MULTIPLY, FOUR>(v[3]),
        ]
    }
}

/// The codes of a scaled block's elements `xb` into `out` ([`Nearest::code`] of each;
/// `MULTIPLY` when `q` has an `inv`), narrowed with saturating packs 32 at
/// a time. A tail shorter than 32 runs the definition.
#[target_feature(enable = "avx2")]
#[inline]
fn fp8_nearest_block<const M: u32, const MULTIPLY: bool>(
    f: fp8::Format,
    q: fp8::Quotient,
    xb: &[f32],
    out: &mut [u8],
) {
    let done = fp8_whole32s::<M, MULTIPLY>(&Nearest::new(f, q), xb, out);
    // The branch-free definition, which this build vectorises: padding the tail to 32
    // (`padded_rest`) was 8 to 12% slower at blocks of 100.
    for (o, &v) in out[done..].iter_mut().zip(&xb[done..]) {
        *o = fp8::nearest_in_range(f, q.of(v));
    }
}

/// The codes of `xb`'s whole 32s into `out` ([`Nearest::code`] of each, narrowed with
/// saturating packs): how many elements that was.
#[target_feature(enable = "avx2")]
#[inline]
fn fp8_whole32s<const M: u32, const MULTIPLY: bool>(
    n: &Nearest,
    xb: &[f32],
    out: &mut [u8],
) -> usize {
    for (c, o) in xb.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        let [c0, c1, c2, c3] = n.codes32::<M, MULTIPLY, false>(c);
        // SAFETY: `o` holds 32 bytes, one unaligned __m256i.
        unsafe { _mm256_storeu_si256(o.as_mut_ptr().cast(), pack_bytes::<false>(c0, c1, c2, c3)) };
    }
    xb.len() / 32 * 32
}

/// The packed 4-bit codes of a scaled block's elements `xb` into `cb` (two per byte, the
/// even element in the low nibble): 32 elements a step ([`fp4_whole32s`]), then 16 the
/// same way, then a tail shorter than 16 padded to 32 ([`padded_rest`]).
#[target_feature(enable = "avx2")]
#[inline]
fn fp4_nearest_block<const M: u32, const MULTIPLY: bool>(
    q: fp8::Quotient,
    xb: &[f32],
    cb: &mut [u8],
) {
    let n = Nearest::new(fp4_format::<M>(), q);
    let done = fp4_whole16s::<M, MULTIPLY>(&n, xb, cb);
    if done < xb.len() {
        // A zero's code is 0: a last block of odd length gets the oracle's zero nibble.
        padded_rest(
            &xb[done..],
            &mut cb[done / 2..xb.len().div_ceil(2)],
            #[inline(always)]
            |x32, c32| _ = fp4_whole16s::<M, MULTIPLY>(&n, x32, c32),
        );
    }
}
