//! Branch-free kernels written for auto-vectorisation.
//!
//! Each function is `#[inline(always)]` and is compiled once per SIMD backend inside
//! pulp's dispatch, so the same source becomes AVX2, AVX-512 or NEON code. Every one must
//! equal its scalar oracle to the bit; `tests/backends.rs` checks that on every backend
//! this CPU has. Only IEEE operations the oracle also performs are used (Rust never
//! contracts `a * b + c` into an FMA), and sums keep the oracle's 16-lane order.

use super::scalar::{self, INF_BITS, Round, max_abs_bits};
use crate::rng::{Draws, lowbias32};

const ABS: u32 = 0x7FFF_FFFF;

#[inline(always)]
fn put<const ADD: bool>(o: &mut f32, v: f32) {
    if ADD {
        *o += v;
    } else {
        *o = v;
    }
}

/// `lane_sum16` of `|x|` in f32, in the oracle's order (element `j` to lane `j % 16`).
#[inline(always)]
fn lane_sum16_abs(x: &[f32]) -> f32 {
    let mut l = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        let c: &[f32; 16] = c.try_into().expect("chunks of 16");
        l = core::array::from_fn(|k| l[k] + c[k].abs());
    }
    for (k, v) in tail.iter().enumerate() {
        l[k] += v.abs();
    }
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            l[j] += l[j + w];
        }
    }
    l[0]
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
pub fn decode_f32<const ADD: bool>(p: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(p.chunks_exact(4)) {
        put::<ADD>(o, f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
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
pub fn decode_u16<const ADD: bool>(p: &[u8], out: &mut [f32], conv: impl Fn(u16) -> f32) {
    for (o, b) in out.iter_mut().zip(p.chunks_exact(2)) {
        put::<ADD>(o, conv(u16::from_le_bytes([b[0], b[1]])));
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

/// Quantise one finite block with a non-zero max to int8 codes (see `scalar::encode_int8`).
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
            let last = start + xb.len() as u64 - 1;
            if start >> 32 != last >> 32 {
                // The block straddles a 2^32 index window: the oracle handles the key change.
                scalar::quantise_block(xb, m, 127, round, draws, start, |j, neg, q| {
                    let q = q as i8;
                    cb[j] = if neg { -q } else { q } as u8;
                });
                return;
            }
            let key = draws.key_for(start);
            let level = |v: f32, j: u32| {
                let a = (v.abs() * pre) * inv;
                let h = lowbias32((start as u32).wrapping_add(j) ^ key);
                let u = (h >> 8) as f32 * (1.0 / 16_777_216.0);
                let fl = a.floor();
                let up = if u < a - fl { 1.0 } else { 0.0 };
                (fl + up).min(127.0).copysign(v)
            };
            for (j, (o, &v)) in cb.iter_mut().zip(xb).enumerate() {
                *o = int_byte(level(v, j as u32));
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
pub fn decode_int8<const ADD: bool>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        let s = scalar::get_step(steps, b);
        for (o, &c) in ob.iter_mut().zip(cb) {
            put::<ADD>(o, (c as i8) as f32 * s);
        }
    }
}

// ---------------------------------------------------------------- sign

#[inline(always)]
fn mean_abs(x: &[f32]) -> f32 {
    let s = lane_sum16_abs(x);
    if s.is_finite() {
        s / x.len() as f32
    } else {
        scalar::mean_abs(x)
    }
}

#[inline(always)]
pub fn encode_sign(x: &[f32], block: usize, steps: &mut [u8], codes: &mut [u8]) -> bool {
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
pub fn decode_sign<const ADD: bool>(steps: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    if !block.is_multiple_of(8) {
        return scalar::decode_sign::<ADD>(steps, codes, block, out);
    }
    for (b, ob) in out.chunks_mut(block).enumerate() {
        let s = scalar::get_step(steps, b).to_bits();
        let cb = &codes[b * block / 8..];
        let full = ob.len() / 8;
        let tail_len = ob.len() % 8;
        for (o, &byte) in ob.chunks_exact_mut(8).zip(cb) {
            for (k, v) in o.iter_mut().enumerate() {
                put::<ADD>(v, f32::from_bits(s ^ (((byte as u32 >> k) & 1) << 31)));
            }
        }
        if tail_len > 0 {
            let byte = cb[full] as u32;
            for (k, v) in ob[8 * full..].iter_mut().enumerate() {
                put::<ADD>(v, f32::from_bits(s ^ (((byte >> k) & 1) << 31)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free conversions are the NEON path; x86 never dispatches to them, so
    /// check them here on every input (the SIMD tests cover them on NEON itself).
    #[test]
    fn branch_free_conversions_match_the_oracle_for_every_input() {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
        let span = (1u64 << 32).div_ceil(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    for b in t * span..((t + 1) * span).min(1 << 32) {
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
