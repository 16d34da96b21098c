//! AVX2 kernels of the block codecs: int8, qsgd and ternary quantisation (nearest and
//! stochastic, with the counter hash on 8 lanes, drawn in aligned groups of 64 where a
//! block starts at a multiple of 32), qsgd's block norm, natural compression (a short form
//! for all but rare steps), the sign-magnitude, sign and natural decoders, the random-k
//! draw filter and bf16 encode; also `dct`'s transpose of sixteen tiles into lanes and
//! fp4's decode by table lookups in registers. The loops shared with AVX-512 (`loops`)
//! run here through this width's [`Lanes`], [`Quantise`] and [`FloatCodes`].
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

mod floats;
mod signmag;
pub use floats::*;
pub use signmag::*;

use super::lanes::{Avx2, FloatCodes, Lanes, Quantise};
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

/// The stochastic levels (in `[0, top]`) of the 8 elements in `v` with level multiplier
/// `inv` (`scalar::level_multiplier`'s, when its pre-multiplier is 1), whose draws are the
/// lanes of `h`: the oracle's `scalar::level`, operation for operation, with the final
/// `fl + 1` and the clamp done on integers (`fl` is integer-valued and small, so the
/// conversion is exact).
#[target_feature(enable = "avx2")]
#[inline]
fn stochastic8(v: __m256, h: __m256i, inv: __m256, top: __m256i) -> __m256i {
    let abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(ABS)));
    let a = _mm256_mul_ps(abs, inv);
    let u = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(h)),
        _mm256_set1_ps(1.0 / 16_777_216.0),
    );
    let fl = _mm256_floor_ps(a);
    let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(u, _mm256_sub_ps(a, fl)));
    // `up` is -1 where the draw rounds up.
    _mm256_min_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(fl), up), top)
}

/// Quantises the 32-element steps of a block, four vectors of 8 at a time: `quant(v, h)`
/// gives the 32-bit codes of the 32 elements in `v`, whose draws are the lanes of `h`
/// (`lowbias32((start + j) ^ key)` for element `j`, from `draws`, when `DRAWS`; zero
/// otherwise); they go to `store(bytes, g)`, narrowed by [`pack_bytes`], for the step at
/// element `g`. Returns the number of elements done.
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
    // SAFETY: this function's features are `Avx2`'s.
    unsafe { Avx2::lanes_max(m) }
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
    // SAFETY: `rb` is valid for reads and writes of its length; this function's features
    // are `Avx2`'s.
    let whole = unsafe {
        loops::int8_steps::<Avx2, true, STOCHASTIC>(
            (inv, step),
            rb.as_mut_ptr(),
            rb.len(),
            cb,
            sd,
            start,
        )
    };
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
    // SAFETY: `xb` is valid for reads of its length, and without `RESIDUAL` nothing is
    // written through the pointer; this function's features are `Avx2`'s.
    let whole = unsafe {
        let x = xb.as_ptr().cast_mut();
        loops::int8_steps::<Avx2, false, STOCHASTIC>((inv, 0.0), x, xb.len(), cb, sd, start)
    };
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

// SAFETY: every method needs AVX2 at most, as `Avx2`'s `Lanes` methods.
unsafe impl Quantise for Avx2 {
    type Draws<'a> = StepDraws<'a>;

    #[inline(always)]
    unsafe fn begin(d: &mut StepDraws<'_>, start: u64) {
        // SAFETY: the caller's contract (AVX2).
        unsafe { d.begin(start) }
    }
    #[inline(always)]
    unsafe fn step(d: &mut StepDraws<'_>, at: u32) -> [__m256i; 4] {
        // SAFETY: the caller's contract (AVX2).
        unsafe { d.step(at) }
    }
    #[inline(always)]
    unsafe fn top(levels: u32) -> __m256i {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_set1_epi32(levels as i32) }
    }
    #[inline(always)]
    unsafe fn signed_level(v: __m256, h: __m256i, inv: __m256, top: __m256i) -> __m256i {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            // The level with the input's sign (psignd: negated for negative bit patterns,
            // -0.0 included; a +0.0 input has level 0).
            _mm256_sign_epi32(stochastic8(v, h, inv, top), _mm256_castps_si256(v))
        }
    }
    #[inline(always)]
    unsafe fn nearest_int8(v: __m256, inv: __m256) -> __m256i {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            let q = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
            _mm256_max_epi32(
                _mm256_min_epi32(q, _mm256_set1_epi32(127)),
                _mm256_set1_epi32(-127),
            )
        }
    }
    #[inline(always)]
    unsafe fn minus_decoded(v: __m256, q: __m256i, step: __m256) -> __m256 {
        // SAFETY: the caller's contract (AVX).
        unsafe { _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(q), step)) }
    }
    #[inline(always)]
    unsafe fn store_codes(p: *mut u8, q: [__m256i; 4]) {
        // SAFETY: the caller's contract (AVX2); `p` is valid for 32 bytes, one unaligned
        // __m256i.
        unsafe { _mm256_storeu_si256(p.cast(), pack_bytes::<true>(q[0], q[1], q[2], q[3])) }
    }
    #[inline(always)]
    unsafe fn store_signmag<const BITS: u32>(p: *mut u8, q: [__m256i; 4]) {
        // SAFETY: the caller's contract (AVX2): `p` is valid for `4 BITS` bytes.
        unsafe {
            let signed = pack_bytes::<true>(q[0], q[1], q[2], q[3]);
            let bytes = signmag_bytes(signed, _mm256_set1_epi8((1u8 << (BITS - 1)) as i8));
            match BITS {
                8 => _mm256_storeu_si256(p.cast(), bytes),
                4 => {
                    // Pairs of 4-bit codes, low nibble first: c0 + 16 c1.
                    let pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
                    let p2 = _mm256_packus_epi16(pairs, pairs);
                    let p2 = _mm256_permute4x64_epi64::<0b00_00_10_00>(p2);
                    _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(p2));
                }
                _ => {
                    // Quads of 2-bit codes: (c0 + 4 c1) + 16 (c2 + 4 c3).
                    let pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401));
                    let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x0010_0001));
                    let p4 = _mm256_packs_epi32(quads, quads);
                    let p4 = _mm256_packus_epi16(p4, p4);
                    let order = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
                    let p4 = _mm256_permutevar8x32_epi32(p4, order);
                    _mm_storel_epi64(p.cast(), _mm256_castsi256_si128(p4));
                }
            }
        }
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
