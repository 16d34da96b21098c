//! Branch-free kernels written for auto-vectorisation.
//!
//! Each function is `#[inline(always)]` and is compiled once per SIMD backend inside
//! pulp's dispatch, so the same source becomes AVX2, AVX-512 or NEON code. Every one must
//! equal its scalar oracle to the bit; `tests/backends.rs` checks that on every backend
//! this CPU has. Only IEEE operations the oracle also performs are used (Rust never
//! contracts `a * b + c` into an FMA), and sums keep the oracle's 16-lane order.

use super::scalar::{self, INF_BITS, Round, max_abs_bits, put};
use core::mem::MaybeUninit;

use crate::rng::{Draws, lowbias32};

const ABS: u32 = 0x7FFF_FFFF;

/// `scalar::lane_sum16` written for the vectoriser: the 16 lanes as one array updated a
/// chunk at a time (element `j` to lane `j % 16`, the oracle's order and combination).
#[inline(always)]
fn lane_sum16<T>(x: &[f32], f: impl Fn(f32) -> T) -> T
where
    T: Copy + Default + core::ops::Add<Output = T>,
{
    let mut l = [T::default(); 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        let c: &[f32; 16] = c.try_into().expect("chunks of 16");
        l = core::array::from_fn(|k| l[k] + f(c[k]));
    }
    for (k, &v) in tail.iter().enumerate() {
        l[k] = l[k] + f(v);
    }
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            l[j] = l[j] + l[j + w];
        }
    }
    l[0]
}

// ---------------------------------------------------------------- error feedback

#[inline(always)]
pub fn feedback_store_bf16(r: &mut [u16], p: &[f32]) {
    for (r, &p) in r.iter_mut().zip(p) {
        *r = scalar::residual_bf16(p, f32_to_bf16);
    }
}

#[inline(always)]
pub fn feedback_u16(
    r: &mut [f32],
    g: &[f32],
    beta: f32,
    gamma: f32,
    out: &mut [u8],
    to: impl Fn(f32) -> u16,
    from: impl Fn(u16) -> f32,
) -> bool {
    let mut m = [0u32; 16];
    let mut rs = r.chunks_exact_mut(16);
    let mut gs = g.chunks_exact(16);
    let mut os = out.chunks_exact_mut(32);
    for ((rc, gc), oc) in (&mut rs).zip(&mut gs).zip(&mut os) {
        let mut h = [0u16; 16];
        for k in 0..16 {
            let p = beta * rc[k] + gamma * gc[k];
            m[k] = m[k].max(p.to_bits() & ABS);
            h[k] = to(p);
            rc[k] = scalar::residual_of(p, from(h[k]));
            h[k] = h[k].to_le();
        }
        oc.copy_from_slice(bytemuck::cast_slice(&h));
    }
    let tail = scalar::feedback_u16(
        rs.into_remainder(),
        gs.remainder(),
        beta,
        gamma,
        os.into_remainder(),
        to,
        from,
    );
    tail || m.iter().any(|&v| v >= INF_BITS)
}

// ---------------------------------------------------------------- identity

#[inline(always)]
pub fn encode_f32(x: &[f32], out: &mut [u8]) -> bool {
    if cfg!(target_endian = "little") {
        // The wire's little-endian f32 is the in-memory representation: a copy.
        out.copy_from_slice(bytemuck::cast_slice(x));
    } else {
        for (o, v) in out.chunks_exact_mut(4).zip(x) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    max_abs_bits(x) >= INF_BITS
}

#[inline(always)]
pub fn decode_f32<const M: u8>(p: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(p.chunks_exact(4)) {
        put::<M>(o, f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    }
}

// ---------------------------------------------------------------- fp16 / bf16

/// Branch-free f32 to binary16, equal to `scalar::f32_to_f16` for every input
/// (after F. Giesen's `float_to_half_fast3_rtne`, with half's NaN rule).
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let u = x.to_bits();
    let sign = (u >> 16) & 0x8000;
    let a = u & ABS;
    let nan = 0x7E00 | ((a & 0x007F_FFFF) >> 13);
    // Subnormal results: adding 0.5 lets the FPU round to a multiple of 2^-24.
    let sub = (f32::from_bits(a) + 0.5)
        .to_bits()
        .wrapping_sub(0x3F00_0000);
    // Normal results: rebias, round to nearest even; rounding may carry into Inf.
    let odd = (a >> 13) & 1;
    let normal = a.wrapping_add(0xC800_0FFF).wrapping_add(odd) >> 13;
    let r = if a > 0x7F80_0000 {
        nan
    } else if a >= 0x4780_0000 {
        0x7C00
    } else if a < 0x3880_0000 {
        sub
    } else {
        normal
    };
    (r | sign) as u16
}

/// Branch-free binary16 to f32, equal to `scalar::f16_to_f32` for every input.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let e = h & 0x7C00;
    let m = h & 0x03FF;
    let normal = ((h & 0x7FFF) << 13) + ((127 - 15) << 23);
    let infnan = 0x7F80_0000 | (m << 13) | if m != 0 { 0x0040_0000 } else { 0 };
    // Subnormal: m * 2^-24, exact in f32.
    let sub = (m as f32 * (1.0 / 16_777_216.0)).to_bits();
    let r = if e == 0x7C00 {
        infnan
    } else if e == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(r | sign)
}

#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16;
    let nan = (u >> 16) | 0x0040;
    (if u & ABS > 0x7F80_0000 { nan } else { rounded }) as u16
}

#[inline(always)]
pub fn encode_u16(x: &[f32], out: &mut [u8], conv: impl Fn(f32) -> u16) -> bool {
    let mut m = [0u32; 16];
    let xs = x.chunks_exact(16);
    let tail = xs.remainder();
    let mut os = out.chunks_exact_mut(32);
    for (c, o) in xs.zip(&mut os) {
        let mut h = [0u16; 16];
        for k in 0..16 {
            m[k] = m[k].max(c[k].to_bits() & ABS);
            h[k] = conv(c[k]).to_le();
        }
        o.copy_from_slice(bytemuck::cast_slice(&h));
    }
    let rest = os.into_remainder();
    let mut nf = m.iter().any(|&v| v >= INF_BITS);
    for (o, &v) in rest.chunks_exact_mut(2).zip(tail) {
        o.copy_from_slice(&conv(v).to_le_bytes());
        nf |= v.to_bits() & ABS >= INF_BITS;
    }
    nf
}

#[inline(always)]
pub fn decode_u16<const M: u8>(p: &[u8], out: &mut [f32], conv: impl Fn(u16) -> f32) {
    for (o, b) in out.iter_mut().zip(p.chunks_exact(2)) {
        put::<M>(o, conv(u16::from_le_bytes([b[0], b[1]])));
    }
}

// ---------------------------------------------------------------- int8

/// The two's-complement byte of an integer-valued `q` with `|q| < 2^22`: adding
/// `1.5 * 2^23` is exact and leaves `q` in the low mantissa bits, so no (slow, saturating)
/// float-to-int conversion is needed.
#[inline(always)]
fn int_byte(q: f32) -> u8 {
    (q + 12_582_912.0).to_bits() as u8
}

/// Quantise one finite block with a non-zero max to int8 codes (see `scalar::encode_int8`);
/// the block lies inside one 2^32 index window (`scalar::encode_int8_blocks`).
#[inline(always)]
fn int8_block(xb: &[f32], cb: &mut [u8], m: f32, round: Round, draws: &Draws, start: u64) {
    let (pre, inv) = scalar::level_multiplier(m, 127.0);
    match round {
        Round::Nearest => {
            // For 0 <= a < 2^22, (a + 1.5 * 2^23) - 1.5 * 2^23 is a rounded half to even,
            // exactly `a.round_ties_even()`; a is at most 127 (plus rounding) here.
            let level = |v: f32| {
                let a = (v.abs() * pre) * inv;
                ((a + 12_582_912.0) - 12_582_912.0).min(127.0)
            };
            for (o, &v) in cb.iter_mut().zip(xb) {
                *o = int_byte(level(v).copysign(v));
            }
        }
        Round::Stochastic => {
            let key = draws.key_for(start);
            let level = |v: f32, j: u32| {
                let a = (v.abs() * pre) * inv;
                let h = lowbias32((start as u32).wrapping_add(j) ^ key);
                let u = (h >> 8) as f32 * (1.0 / 16_777_216.0);
                let fl = a.floor();
                let up = if u < a - fl { 1.0 } else { 0.0 };
                (fl + up).min(127.0).copysign(v)
            };
            // A u32 counter (not `enumerate`'s usize) keeps the index vector 32-bit.
            for (j, (o, &v)) in (0u32..).zip(cb.iter_mut().zip(xb)) {
                *o = int_byte(level(v, j));
            }
        }
    }
}

#[inline(always)]
pub fn encode_int8(
    x: &[f32],
    block: usize,
    round: Round,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    scalar::encode_int8_blocks(
        x,
        block,
        round,
        draws,
        first,
        steps,
        codes,
        // Without the attribute the closure stays a separate, baseline-ISA function and
        // the int8 encoders run 2.5x (nearest) to 6x (stochastic) slower.
        #[inline(always)]
        |xb, cb, m, start| int8_block(xb, cb, m, round, draws, start),
    )
}

#[inline(always)]
pub fn decode_int8<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        let s = scalar::get_step(steps, b);
        for (o, &c) in ob.iter_mut().zip(cb) {
            put::<M>(o, (c as i8) as f32 * s);
        }
    }
}

// ---------------------------------------------------------------- sign

#[inline(always)]
fn mean_abs(x: &[f32]) -> f32 {
    let s = lane_sum16(x, f32::abs);
    if s.is_finite() {
        s / x.len() as f32
    } else {
        scalar::mean_abs(x)
    }
}

/// Running state of one sign block: the 16 lane sums of |x| and lane maxima of |x| bits.
pub struct SignLanes {
    /// `sum[k]`: sum of |x_j| over the block's `j % 16 == k`, in index order.
    pub sum: [f32; 16],
    /// `max[k]`: largest |x_j| bit pattern over `j % 16 == k`.
    pub max: [u32; 16],
}

/// Sign block encode, equal to `scalar::encode_sign`; `codes` need not be zeroed.
#[inline(always)]
pub fn encode_sign(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
    encode_sign_blocks(x, block, steps, codes, |xb, cb, lanes| {
        sign_groups(xb, cb, lanes)
    })
}

/// The portable group kernel of [`encode_sign_blocks`]: 64 elements at a time, sign bits
/// packed by [`pack_flags`].
#[inline(always)]
fn sign_groups(xb: &[f32], cb: &mut [u8], lanes: &mut SignLanes) -> usize {
    let (mut l, mut m) = (lanes.sum, lanes.max);
    for (c, o) in xb.chunks_exact(64).zip(cb.chunks_exact_mut(8)) {
        let c: &[f32; 64] = c.try_into().expect("chunks of 64");
        let mut flags = [0u8; 64];
        for q in 0..4 {
            let c: &[f32; 16] = c[16 * q..16 * q + 16].try_into().expect("16");
            l = core::array::from_fn(|k| l[k] + c[k].abs());
            m = core::array::from_fn(|k| m[k].max(c[k].to_bits() & ABS));
        }
        for (f, v) in flags.iter_mut().zip(c) {
            *f = (v.to_bits() >> 31) as u8;
        }
        o.copy_from_slice(&pack_flags(&flags).to_le_bytes());
    }
    (lanes.sum, lanes.max) = (l, m);
    xb.len() / 64 * 64
}

/// The sign block layout, shared by every backend. With byte-aligned blocks
/// (`block % 8 == 0`) each block is one fused pass: `groups(xb, cb, lanes)` handles a
/// prefix of the block whose length is a multiple of 16 (it returns that length), adding
/// each element to lane `j % 16` in index order and writing its packed sign bits; the
/// rest is done here. Other block sizes take the two-pass path.
#[inline(always)]
pub fn encode_sign_blocks(
    x: &[f32],
    block: usize,
    steps: &mut [u8],
    codes: &mut [u8],
    mut groups: impl FnMut(&[f32], &mut [u8], &mut SignLanes) -> usize,
) -> bool {
    if !block.is_multiple_of(8) {
        return encode_sign_two_pass(x, block, steps, codes);
    }
    let mut nonfinite = false;
    for (b, (xb, cb)) in x.chunks(block).zip(codes.chunks_mut(block / 8)).enumerate() {
        let mut lanes = SignLanes {
            sum: [0.0; 16],
            max: [0; 16],
        };
        let done = groups(xb, cb, &mut lanes);
        let SignLanes { sum: mut l, max: m } = lanes;
        let mut mx = m.iter().fold(0, |a, &v| a.max(v));
        let rest = &mut cb[done / 8..];
        rest.fill(0);
        for (j, &v) in xb[done..].iter().enumerate() {
            l[j % 16] += v.abs();
            mx = mx.max(v.to_bits() & ABS);
            rest[j / 8] |= ((v.to_bits() >> 31) as u8) << (j % 8);
        }
        for w in [8, 4, 2, 1] {
            for j in 0..w {
                l[j] += l[j + w];
            }
        }
        let step = if mx >= INF_BITS {
            // Elements of a non-finite block send zero bits (the oracle's layout).
            nonfinite = true;
            cb.fill(0);
            scalar::CANONICAL_NAN
        } else if l[0].is_finite() {
            l[0] / xb.len() as f32
        } else {
            scalar::mean_abs(xb)
        };
        steps[4 * b..4 * b + 4].copy_from_slice(&step.to_le_bytes());
    }
    nonfinite
}

/// Sign encode for blocks that do not start on byte boundaries: block steps, then every
/// element's bit in one pass.
#[inline(always)]
fn encode_sign_two_pass(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
    let mut nonfinite = false;
    for (b, xb) in x.chunks(block).enumerate() {
        let step = if max_abs_bits(xb) >= INF_BITS {
            nonfinite = true;
            scalar::CANONICAL_NAN
        } else {
            mean_abs(xb)
        };
        steps[4 * b..4 * b + 4].copy_from_slice(&step.to_le_bytes());
    }
    // The bits depend only on each element, not on its block: pack them in one pass.
    let xs = x.chunks_exact(8);
    let tail = xs.remainder();
    let mut bytes = codes.iter_mut();
    for (c, o) in xs.zip(&mut bytes) {
        let mut byte = 0u32;
        for (k, v) in c.iter().enumerate() {
            byte |= (v.to_bits() >> 31) << k;
        }
        *o = byte as u8;
    }
    if let Some(o) = bytes.next() {
        let mut byte = 0u32;
        for (k, v) in tail.iter().enumerate() {
            byte |= (v.to_bits() >> 31) << k;
        }
        *o = byte as u8;
    }
    // Elements of a non-finite block send zero bits (the oracle's layout).
    if nonfinite {
        for (b, xb) in x.chunks(block).enumerate() {
            if max_abs_bits(xb) >= INF_BITS {
                for j in b * block..b * block + xb.len() {
                    codes[j / 8] &= !(1u8 << (j % 8));
                }
            }
        }
    }
    nonfinite
}

#[inline(always)]
pub fn decode_sign<const M: u8>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    if M == scalar::mode::RESIDUAL {
        // `out` holds the p these codes were made from, and a code is p's sign bit: the
        // decoded value is ±step with p's sign, no bit unpacking needed.
        for (b, ob) in out.chunks_mut(block).enumerate() {
            let s = scalar::get_step(steps, b).to_bits();
            for v in ob {
                let d = f32::from_bits(s ^ (v.to_bits() & !ABS));
                *v = scalar::residual_of(*v, d);
            }
        }
        return;
    }
    if !block.is_multiple_of(8) {
        return scalar::decode_sign::<M>(steps, codes, block, out);
    }
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = scalar::get_step(steps, b).to_bits();
        let cb = &codes[b * block / 8..];
        let full = ob.len() / 8;
        let tail_len = ob.len() % 8;
        for (o, &byte) in ob.chunks_exact_mut(8).zip(cb) {
            for (k, v) in o.iter_mut().enumerate() {
                put::<M>(v, f32::from_bits(s ^ (((byte as u32 >> k) & 1) << 31)));
            }
        }
        if tail_len > 0 {
            let byte = cb[full] as u32;
            for (k, v) in ob[8 * full..].iter_mut().enumerate() {
                put::<M>(v, f32::from_bits(s ^ (((byte >> k) & 1) << 31)));
            }
        }
    }
}

// ---------------------------------------------------------------- qsgd / ternary

/// `l2_squares` of the oracle: f64 squares in its 16-lane order.
#[inline(always)]
fn l2_squares(x: &[f32]) -> f64 {
    lane_sum16(x, |v| (v as f64) * (v as f64))
}

/// Quantise the finite, non-zero-max block `xb` (first global index `start`, which the
/// caller has checked does not straddle a 2^32 window, `key` that window's key) to
/// `BITS`-bit sign-magnitude codes, packed LSB first into `cb` (every byte written).
#[inline(always)]
fn signmag_block<const BITS: u32>(xb: &[f32], cb: &mut [u8], m: f32, key: u32, start: u64) {
    let levels = (1u32 << (BITS - 1)) - 1;
    let sign_bit = 1u8 << (BITS - 1);
    let per = (8 / BITS) as usize;
    let (pre, inv) = scalar::level_multiplier(m, levels as f32);
    let code = |v: f32, j: u32| {
        let a = (v.abs() * pre) * inv;
        let h = lowbias32((start as u32).wrapping_add(j) ^ key);
        let u = (h >> 8) as f32 * (1.0 / 16_777_216.0);
        let fl = a.floor();
        let up = if u < a - fl { 1.0 } else { 0.0 };
        let q = int_byte((fl + up).min(levels as f32));
        q | if v.is_sign_negative() && q != 0 {
            sign_bit
        } else {
            0
        }
    };
    // Codes of up to 1024 elements at a time (a plain loop the vectoriser takes), then
    // packed `per` to a byte.
    const CHUNK: usize = 1024;
    for (g, (xg, og)) in xb.chunks(CHUNK).zip(cb.chunks_mut(CHUNK / per)).enumerate() {
        let mut c = [0u8; CHUNK];
        let base = (CHUNK * g) as u32;
        for (j, (o, &v)) in (base..).zip(c.iter_mut().zip(xg)) {
            *o = code(v, j);
        }
        if per == 1 {
            og.copy_from_slice(&c[..og.len()]);
            continue;
        }
        for (o, cs) in og.iter_mut().zip(c.chunks_exact(per)) {
            let mut byte = 0u8;
            for (k, &v) in cs.iter().enumerate() {
                byte |= v << (k as u32 * BITS);
            }
            *o = byte;
        }
    }
}

/// Sign-magnitude block encode (qsgd, ternary), equal to `scalar::encode_signmag`; unlike
/// the oracle it writes every code byte, so `codes` need not be zeroed.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode_signmag<const BITS: u32>(
    x: &[f32],
    block: usize,
    measure: scalar::Measure,
    draws: &Draws,
    first: u64,
    steps: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let per = (8 / BITS) as usize;
    if !block.is_multiple_of(per) {
        // Blocks do not start on byte boundaries: the oracle's bit-at-a-time layout.
        codes.fill(0);
        return scalar::encode_signmag(x, block, BITS, measure, draws, first, steps, codes);
    }
    scalar::encode_signmag_blocks::<BITS>(
        x,
        block,
        measure,
        draws,
        first,
        steps,
        codes,
        l2_squares,
        #[inline(always)]
        |xb, cb, m, start| signmag_block::<BITS>(xb, cb, m, draws.key_for(start), start),
    )
}

/// Sign-magnitude block decode, equal to `scalar::decode_signmag`.
#[inline(always)]
pub fn decode_signmag<const M: u8, const BITS: u32>(
    steps: &[u8],
    codes: &[u8],
    block: usize,
    out: &mut [f32],
) {
    let per = (8 / BITS) as usize;
    if !block.is_multiple_of(per) {
        return scalar::decode_signmag::<M>(steps, codes, block, BITS, out);
    }
    let mask = ((1u32 << BITS) - 1) as u8;
    let value = |c: u8, s: f32| {
        let c = c & mask;
        let mag = (c & (mask >> 1)) as f32 * s;
        f32::from_bits(mag.to_bits() ^ (((c >> (BITS - 1)) as u32) << 31))
    };
    for (b, (ob, cb)) in out
        .chunks_mut(block)
        .zip(codes.chunks(block / per))
        .enumerate()
    {
        let s = scalar::get_step(steps, b);
        let full = ob.len() / per;
        let mut os = ob.chunks_exact_mut(per);
        for (o, &byte) in (&mut os).zip(cb) {
            for (k, v) in o.iter_mut().enumerate() {
                put::<M>(v, value(byte >> (k as u32 * BITS), s));
            }
        }
        let rest = os.into_remainder();
        if let Some(&byte) = cb.get(full) {
            for (k, v) in rest.iter_mut().enumerate() {
                put::<M>(v, value(byte >> (k as u32 * BITS), s));
            }
        }
    }
}

// ---------------------------------------------------------------- natural

/// `2^k` in f64 for `k` in `[-1022, 1023]`.
#[inline(always)]
fn pow2_f64(k: i32) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Natural-compression block encode, equal to `scalar::encode_natural` (which see), with
/// the oracle's branches as selects: the f64 arithmetic is the same and exact.
#[inline(always)]
pub fn encode_natural(
    x: &[f32],
    block: usize,
    draws: &Draws,
    first: u64,
    refs: &mut [u8],
    codes: &mut [u8],
) -> bool {
    scalar::encode_natural_blocks(
        x,
        block,
        draws,
        first,
        refs,
        codes,
        #[inline(always)]
        |xb, cb, r, start| natural_block(xb, cb, r, draws.key_for(start), start),
    )
}

/// `scalar::natural_block` for a block inside one 2^32 index window (`key` its key).
#[inline(always)]
fn natural_block(xb: &[f32], cb: &mut [u8], r: i32, key: u32, start: u64) {
    let kmin = r - 126;
    let scale_lo = pow2_f64(-kmin);
    let code = |v: f32, j: u32| {
        let a = v.abs() as f64;
        // floor(log2 a), exact for every f32 (subnormals are normal in f64); -1023 for 0.
        let e = ((a.to_bits() >> 52) as i32) - 1023;
        let h = lowbias32((start as u32).wrapping_add(j) ^ key);
        let u = (h >> 8) as f64 / 16_777_216.0;
        let f_hi = a * pow2_f64(-e) - 1.0;
        let f_lo = a * scale_lo;
        let k = if e >= kmin {
            e + (u < f_hi && e < r) as i32
        } else {
            kmin - 1 + (u < f_lo) as i32
        };
        let m = k - kmin + 1;
        let sign = ((v.to_bits() >> 24) & 0x80) as u8;
        if a == 0.0 || m == 0 {
            0
        } else {
            sign | m as u8
        }
    };
    for (j, (o, &v)) in (0u32..).zip(cb.iter_mut().zip(xb)) {
        *o = code(v, j);
    }
}

/// Natural-compression block decode, equal to `scalar::decode_natural`.
#[inline(always)]
pub fn decode_natural<const M: u8>(refs: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        if refs[b] == scalar::NATURAL_NONFINITE {
            for o in ob {
                put::<M>(o, scalar::CANONICAL_NAN);
            }
            continue;
        }
        let r = refs[b] as i32 - 127;
        for (o, &c) in ob.iter_mut().zip(cb) {
            let m = (c & 0x7F) as i32;
            let k = r - 127 + m; // in [-149, 127] for m >= 1 and a valid reference
            let normal = ((k + 127).max(0) as u32) << 23;
            let sub = 1u32 << ((k + 149).clamp(0, 31) as u32);
            let bits = if m == 0 {
                0
            } else if k >= -126 {
                normal
            } else {
                sub
            };
            put::<M>(o, f32::from_bits(bits ^ (((c >> 7) as u32) << 31)));
        }
    }
}

// ---------------------------------------------------------------- selection bounds

pub use super::scalar::BOUND_GROUPS;

/// The least, over the [`BOUND_GROUPS`] groups of `x` (element `i` in group `i % 16`),
/// of each group's `D`-th largest magnitude key (`bits & 0x7FFFFFFF`; 0 for a group of
/// fewer than `D` elements): so at least `min(16 D, x.len())` elements have a key at or
/// above it (see `super::lane_bound`). One pass, each group's `D` largest keys kept
/// sorted in a lane of `D` vectors; two such sets take alternate rows of 16 (two
/// independent chains of minima and maxima), merged at the end.
#[inline(always)]
pub fn lane_bound<const D: usize>(x: &[f32]) -> u32 {
    let mut sets = [[[0u32; BOUND_GROUPS]; D]; 2];
    let pairs = x.chunks_exact(2 * BOUND_GROUPS);
    let rest = pairs.remainder();
    for pair in pairs {
        for (m, row) in sets.iter_mut().zip(pair.chunks_exact(BOUND_GROUPS)) {
            let row: &[f32; BOUND_GROUPS] = row.try_into().expect("a row of 16");
            insert_row(m, row.map(|v| v.to_bits() & ABS));
        }
    }
    let [mut m, other] = sets;
    for row in other {
        insert_row(&mut m, row);
    }
    for (i, v) in rest.iter().enumerate() {
        insert_key(&mut m, i % BOUND_GROUPS, v.to_bits() & ABS);
    }
    m[D - 1].iter().fold(u32::MAX, |a, &b| a.min(b))
}

/// Each lane `l` of `v` into lane `l` of the sorted rows `m` (largest first), the least
/// of each lane dropped.
#[inline(always)]
fn insert_row<const D: usize>(m: &mut [[u32; BOUND_GROUPS]; D], mut v: [u32; BOUND_GROUPS]) {
    for r in m.iter_mut() {
        for l in 0..BOUND_GROUPS {
            let hi = r[l].max(v[l]);
            v[l] = r[l].min(v[l]);
            r[l] = hi;
        }
    }
}

/// Key `v` into lane `l` of the sorted rows `m` (largest first), the least one dropped.
#[inline(always)]
pub(super) fn insert_key<const D: usize>(m: &mut [[u32; BOUND_GROUPS]; D], l: usize, mut v: u32) {
    for r in m.iter_mut() {
        let hi = r[l].max(v);
        v = r[l].min(v);
        r[l] = hi;
    }
}

// ---------------------------------------------------------------- compare and compress

/// Bit `i` of the result is `flags[i] != 0` (flags are 0 or 1).
#[inline(always)]
fn pack_flags(flags: &[u8; 64]) -> u64 {
    let mut m = 0u64;
    for (k, w) in flags.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        // Byte i of w (0 or 1) lands on bit 56 + i of the product; no two partial
        // products share a bit, so nothing carries.
        m |= (w.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * k);
    }
    m
}

/// The compress loop of every filter (this module's and the x86 mask-register ones):
/// `mask(start, len)` gives the keep mask of elements `start..start + len` (`len <= 64`,
/// 64 but at the end), whose indices are written in order while `idx` has room for 64
/// more. Returns `(consumed, written)`; see `super::filter_mag_ge`.
#[inline(always)]
pub(super) fn compress_masks(
    n: usize,
    idx: &mut [u32],
    mask: impl FnMut(usize, usize) -> u64,
) -> (usize, usize) {
    compress_masks_vals(n, idx, None, mask)
}

/// [`compress_masks`] that, given `vals = Some((x, out))`, also writes each kept
/// element's bits `x[i]` to `out` beside its index (while both have room for 64 more).
#[inline(always)]
pub(super) fn compress_masks_vals(
    n: usize,
    idx: &mut [u32],
    mut vals: Option<(&[f32], &mut [u32])>,
    mut mask: impl FnMut(usize, usize) -> u64,
) -> (usize, usize) {
    let room = match &vals {
        Some((_, out)) => idx.len().min(out.len()),
        None => idx.len(),
    };
    let mut count = 0;
    let mut done = 0;
    while done < n && room - count >= 64 {
        let len = (n - done).min(64);
        let mut m = mask(done, len);
        if vals.is_none() {
            // The first four kept indices are written whether or not they exist (an
            // empty mask's trailing-zero count is 64; such an entry lies at or past
            // `count + kept`, so it is overwritten or never read), without a branch per
            // kept element: at a few kept per 64 that branch is mispredicted about once
            // a step. The rest, rare below one kept in 16, one by one.
            let kept = m.count_ones() as usize;
            let out: &mut [u32; 4] = (&mut idx[count..count + 4]).try_into().expect("room");
            for o in out {
                *o = (done as u32).wrapping_add(m.trailing_zeros());
                m &= m.wrapping_sub(1);
            }
            let mut at = count + 4;
            while m != 0 {
                idx[at] = (done as u32).wrapping_add(m.trailing_zeros());
                m &= m - 1;
                at += 1;
            }
            count += kept;
            done += len;
            continue;
        }
        while m != 0 {
            let i = done + m.trailing_zeros() as usize;
            idx[count] = i as u32;
            if let Some((x, out)) = &mut vals {
                out[count] = x[i].to_bits();
            }
            count += 1;
            m &= m - 1;
        }
        done += len;
    }
    (done, count)
}

/// The mask of `len <= 64` per-element flags `flag(j)`, packed branch-free.
#[inline(always)]
fn flag_mask(len: usize, flag: impl Fn(usize) -> bool) -> u64 {
    let mut flags = [0u8; 64];
    for (j, f) in flags[..len].iter_mut().enumerate() {
        *f = flag(j) as u8;
    }
    pack_flags(&flags)
}

/// [`compress_masks`] on per-element flags `flag(i)`.
#[inline(always)]
fn compress(n: usize, idx: &mut [u32], flag: impl Fn(usize) -> bool) -> (usize, usize) {
    compress_masks(n, idx, |done, len| flag_mask(len, |j| flag(done + j)))
}

/// Indices of the elements with `|x|` bit pattern `>= t` (see `super::filter_mag_ge`).
#[inline(always)]
pub fn filter_mag_ge(x: &[f32], t: u32, idx: &mut [u32]) -> (usize, usize) {
    compress(x.len(), idx, |i| x[i].to_bits() & ABS >= t)
}

/// [`filter_mag_ge`] that also writes the kept elements' bits to `vals` (see
/// `super::filter_mag_ge_vals`).
#[inline(always)]
pub fn filter_mag_ge_vals(x: &[f32], t: u32, idx: &mut [u32], vals: &mut [u32]) -> (usize, usize) {
    let flag = |i: usize| x[i].to_bits() & ABS >= t;
    compress_masks_vals(x.len(), idx, Some((x, vals)), |done, len| {
        flag_mask(len, |j| flag(done + j))
    })
}

/// Indices `i < n` with `lowbias32(first as u32 + i ^ key) < t` (see
/// `super::filter_draw_lt`; the caller keeps the range inside one 2^32 window).
#[inline(always)]
pub fn filter_draw_lt(first: u32, key: u32, t: u32, n: usize, idx: &mut [u32]) -> (usize, usize) {
    compress(n, idx, |i| {
        lowbias32(first.wrapping_add(i as u32) ^ key) < t
    })
}

/// How many `i < n` have `lowbias32(first as u32 + i ^ key) < t` (see
/// `super::count_draw_lt`; the caller keeps the range inside one 2^32 window). A loop
/// without branches, which the vectoriser turns into lane counters.
#[inline(always)]
pub fn count_draw_lt(first: u32, key: u32, t: u32, n: usize) -> usize {
    (0..n)
        .map(|i| (lowbias32(first.wrapping_add(i as u32) ^ key) < t) as usize)
        .sum()
}

/// Keep masks of `lowbias32(first as u32 + i ^ key) < t` for `i < n` (see
/// `super::draw_masks`; the caller keeps the range inside one 2^32 window).
#[inline(always)]
pub fn draw_masks(first: u32, key: u32, t: u32, n: usize, masks: &mut [MaybeUninit<u64>]) -> usize {
    let mut count = 0;
    for (w, slot) in masks[..n.div_ceil(64)].iter_mut().enumerate() {
        let at = first.wrapping_add(64 * w as u32);
        let m = flag_mask((n - 64 * w).min(64), |j| {
            lowbias32(at.wrapping_add(j as u32) ^ key) < t
        });
        count += m.count_ones() as usize;
        slot.write(m);
    }
    count
}

// ---------------------------------------------------------------- multi-frame reduction

/// Elements the multi-frame reduction keeps in registers while it adds every frame's
/// values into them.
pub const REDUCE_LANES: usize = 64;

/// The first frame's value into the running sum: written (`M` = write) or added to the
/// output's value (`M` = add).
#[inline(always)]
fn reduce_first<const M: u8>(o: f32, v: f32) -> f32 {
    if M == super::mode::WRITE { v } else { o + v }
}

/// Frames whose values can be decoded [`REDUCE_LANES`] at a time: a trait rather than a
/// closure so that the decode is inlined into each backend's compiled copy of the loop.
pub trait LaneFrames {
    /// Frames in the list.
    fn len(&self) -> usize;
    /// Lane groups that share one scale (a block), so that the scale is read once per
    /// block; 1 for codes without scales.
    #[inline(always)]
    fn per_block(&self) -> usize {
        1
    }
    /// Frame `q`'s values of lane group `c` (from the start of the frame), which lies in
    /// block `b`.
    fn lanes(&self, q: usize, b: usize, c: usize) -> [f32; REDUCE_LANES];
}

/// Sum every frame of `frames` into `out`, the frames' elements from `start` on (a
/// whole number of blocks), [`REDUCE_LANES`] elements at a time, the running sums held in
/// registers: per element, `first(out, d_0) + d_1 + ... + d_{p-1}` in frame order. The
/// same operations in the same order as decoding the first frame and adding the others
/// one after another, so the same bits. The tail (`out.len() % REDUCE_LANES` elements)
/// is left to the caller.
#[inline(always)]
pub fn reduce_groups<const M: u8>(out: &mut [f32], frames: &impl LaneFrames, start: usize) {
    let p = frames.len();
    let per_block = frames.per_block();
    let mut c = start / REDUCE_LANES;
    let b0 = c / per_block;
    for (b, block) in out.chunks_mut(per_block * REDUCE_LANES).enumerate() {
        for ob in block.chunks_exact_mut(REDUCE_LANES) {
            let ob: &mut [f32; REDUCE_LANES] = ob.try_into().expect("chunks of 64");
            let v = frames.lanes(0, b0 + b, c);
            let mut acc = [0f32; REDUCE_LANES];
            for j in 0..REDUCE_LANES {
                acc[j] = reduce_first::<M>(ob[j], v[j]);
            }
            for q in 1..p {
                let v = frames.lanes(q, b0 + b, c);
                for j in 0..REDUCE_LANES {
                    acc[j] += v[j];
                }
            }
            *ob = acc;
            c += 1;
        }
    }
}

/// Bytes ahead of the lane group being decoded that the reduction asks the cache to
/// fetch, in every frame's codes: with eight or more streams read at once the hardware
/// prefetchers alone left the loop waiting on memory.
const PREFETCH_AHEAD: usize = 1024;

/// The lane group `c` of a code section of `W` bytes per element, after asking for the
/// cache lines [`PREFETCH_AHEAD`] bytes further on.
#[inline(always)]
pub fn group_bytes<const W: usize>(codes: &[u8], c: usize) -> &[u8] {
    let at = c * W * REDUCE_LANES;
    let mut ahead = at + PREFETCH_AHEAD;
    while ahead < (at + PREFETCH_AHEAD + W * REDUCE_LANES).min(codes.len()) {
        super::prefetch(codes, ahead);
        ahead += 64;
    }
    &codes[at..][..W * REDUCE_LANES]
}

/// f32 frames (identity codes, 4 bytes per element).
struct F32Lanes<'a>(&'a [&'a [u8]]);

impl LaneFrames for F32Lanes<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn lanes(&self, q: usize, _: usize, c: usize) -> [f32; REDUCE_LANES] {
        let b = group_bytes::<4>(self.0[q], c);
        let mut v = [0f32; REDUCE_LANES];
        for (j, o) in v.iter_mut().enumerate() {
            *o = f32::from_le_bytes([b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3]]);
        }
        v
    }
}

/// 16-bit frames, widened by `C`.
struct U16Lanes<'a, C>(&'a [&'a [u8]], C);

impl<C: Fn(u16) -> f32> LaneFrames for U16Lanes<'_, C> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn lanes(&self, q: usize, _: usize, c: usize) -> [f32; REDUCE_LANES] {
        let b = group_bytes::<2>(self.0[q], c);
        let mut v = [0f32; REDUCE_LANES];
        for (j, o) in v.iter_mut().enumerate() {
            *o = (self.1)(u16::from_le_bytes([b[2 * j], b[2 * j + 1]]));
        }
        v
    }
}

/// int8 frames (`(steps, codes)`), `per_block` lane groups to a block.
struct Int8Lanes<'a> {
    frames: &'a [(&'a [u8], &'a [u8])],
    per_block: usize,
}

impl LaneFrames for Int8Lanes<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.frames.len()
    }

    #[inline(always)]
    fn per_block(&self) -> usize {
        self.per_block
    }

    #[inline(always)]
    fn lanes(&self, q: usize, b: usize, c: usize) -> [f32; REDUCE_LANES] {
        let (steps, codes) = self.frames[q];
        let s = scalar::get_step(steps, b);
        let b = group_bytes::<1>(codes, c);
        let mut v = [0f32; REDUCE_LANES];
        for (j, o) in v.iter_mut().enumerate() {
            *o = (b[j] as i8) as f32 * s;
        }
        v
    }
}

/// [`reduce_groups`] over f32 frames (whole code sections) from element `start`; the
/// tail is the caller's.
#[inline(always)]
pub fn reduce_f32<const M: u8>(frames: &[&[u8]], start: usize, out: &mut [f32]) {
    reduce_groups::<M>(out, &F32Lanes(frames), start);
}

/// [`reduce_groups`] over 16-bit frames (fp16 or bf16 by `conv`); as [`reduce_f32`].
#[inline(always)]
pub fn reduce_u16<const M: u8>(
    frames: &[&[u8]],
    start: usize,
    out: &mut [f32],
    conv: impl Fn(u16) -> f32,
) {
    reduce_groups::<M>(out, &U16Lanes(frames, conv), start);
}

/// [`reduce_groups`] over int8 frames (`frames[q]` = whole (steps, codes) sections) of
/// blocks of `block` elements, a multiple of [`REDUCE_LANES`], from element `start`, a
/// multiple of `block`; `out` is whole blocks but for a tail the caller handles.
#[inline(always)]
pub fn reduce_int8<const M: u8>(
    frames: &[(&[u8], &[u8])],
    block: usize,
    start: usize,
    out: &mut [f32],
) {
    let per_block = block / REDUCE_LANES;
    reduce_groups::<M>(out, &Int8Lanes { frames, per_block }, start);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free conversions are the NEON path; x86 never dispatches to them, so
    /// check them here on every input (the SIMD tests cover them on NEON itself).
    #[test]
    fn pack_flags_matches_a_bit_loop() {
        for seed in 0..200u32 {
            let flags: [u8; 64] =
                core::array::from_fn(|i| (lowbias32(seed * 64 + i as u32) >> 31) as u8);
            let want = flags
                .iter()
                .enumerate()
                .fold(0u64, |m, (i, &f)| m | (f as u64) << i);
            assert_eq!(pack_flags(&flags), want);
        }
        assert_eq!(pack_flags(&[1; 64]), u64::MAX);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "integer code with no unsafe; natively over every input"
    )]
    fn branch_free_conversions_match_the_oracle_for_every_input() {
        // Under Miri, one thread and every 65,537th pattern (65,536 inputs); under
        // emulation (qemu for aarch64, where all of them took a minute) every 997th. The
        // code is integer arithmetic, and every pattern runs natively on x86-64.
        let (threads, stride) = if cfg!(miri) {
            (1, 65_537)
        } else {
            let t = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
            (t, if cfg!(target_arch = "x86_64") { 1 } else { 997 })
        };
        let span = (1u64 << 32).div_ceil(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    for b in (t * span..((t + 1) * span).min(1 << 32)).step_by(stride) {
                        let x = f32::from_bits(b as u32);
                        assert_eq!(f32_to_f16(x), scalar::f32_to_f16(x), "f16 {b:#010x}");
                        assert_eq!(f32_to_bf16(x), scalar::f32_to_bf16(x), "bf16 {b:#010x}");
                    }
                });
            }
        });
        for h in 0..=u16::MAX {
            assert_eq!(
                f16_to_f32(h).to_bits(),
                scalar::f16_to_f32(h).to_bits(),
                "{h:#06x}"
            );
        }
    }
}
