//! 8-bit floats (OCP FP8: E4M3 and E5M2) and their block scales: the scalar definition
//! of the `fp8` codec's arithmetic, which every backend runs (byte-identical frames by
//! construction).
//!
//! A code is `sign << 7 | exponent << m | mantissa` with `m` mantissa bits and an
//! exponent bias (E4M3: 3 and 7; E5M2: 2 and 15). Exponent 0 holds the subnormals
//! `mantissa * 2^(1 - bias - m)`. E4M3 (the "fn" variant) has no infinities: its only
//! special codes are `0x7F` and `0xFF`, NaN, and its largest finite value is 448. E5M2 is
//! IEEE-like: exponent 31 is ±Inf (mantissa 0) or NaN, its largest finite value 57344.

use super::scalar::{BlockScale, INF_BITS, put};
use crate::rng::Draws;

/// One of the two OCP FP8 formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Format {
    /// Mantissa bits.
    pub m: u32,
    /// Exponent bias.
    pub bias: i32,
    /// The code magnitude of the largest finite value.
    pub max_code: u8,
    /// Whether the format has infinities (E5M2).
    pub inf: bool,
}

/// E4M3 ("fn": no infinities, NaN `0x7F`), largest finite 448.
pub const E4M3: Format = Format {
    m: 3,
    bias: 7,
    max_code: 0x7E,
    inf: false,
};

/// E5M2 (IEEE-like), largest finite 57344.
pub const E5M2: Format = Format {
    m: 2,
    bias: 15,
    max_code: 0x7B,
    inf: true,
};

/// E2M1, the element of OCP MXFP4: 1 mantissa bit, bias 1, values 0, 0.5, 1, 1.5, 2, 3,
/// 4 and 6; no infinity or NaN. Used by the `fp4` codec (4-bit codes, sign in bit 3; the
/// functions here take and give the 8-bit layout, sign in bit 7).
pub const E2M1: Format = Format {
    m: 1,
    bias: 1,
    max_code: 7,
    inf: false,
};

/// E3M0: 0 and the powers of two 2^-2 to 2^4 (bias 3); no infinity or NaN.
pub const E3M0: Format = Format {
    m: 0,
    bias: 3,
    max_code: 7,
    inf: false,
};

/// A 4-bit code (sign in bit 3) in the 8-bit layout (sign in bit 7).
#[inline(always)]
pub fn widen4(c: u8) -> u8 {
    ((c & 8) << 4) | (c & 7)
}

/// An 8-bit-layout code of a 4-bit format as its 4-bit code.
#[inline(always)]
pub fn narrow4(c: u8) -> u8 {
    ((c >> 4) & 8) | (c & 7)
}

impl Format {
    /// The code magnitude of NaN: `0x7F` (E4M3), `0x7E` (E5M2, a quiet NaN).
    pub const fn nan(self) -> u8 {
        if self.inf { 0x7E } else { 0x7F }
    }

    /// The largest finite value.
    pub fn max(self) -> f32 {
        value(self, self.max_code)
    }

    /// The exponent of the largest finite value's binade (E4M3: 8, E5M2: 15).
    pub const fn emax(self) -> i32 {
        ((self.max_code >> self.m) as i32) - self.bias
    }
}

/// `2^k` as an f32 for `k` in `-149..=127` (from its bits; subnormal below -126).
#[inline(always)]
pub fn pow2(k: i32) -> f32 {
    debug_assert!((-149..=127).contains(&k));
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1 << (k + 149))
    }
}

/// The f32 value of `code` in format `f` (exact: every FP8 value is an f32).
#[inline(always)]
pub fn value(f: Format, code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let mag = code & 0x7F;
    let e = (mag >> f.m) as i32;
    let mant = (mag & ((1 << f.m) - 1)) as u32;
    let emask: i32 = 0x7F >> f.m;
    if f.inf && e == emask {
        return f32::from_bits(sign | if mant == 0 { INF_BITS } else { 0x7FC0_0000 });
    }
    if !f.inf && mag == 0x7F {
        return f32::from_bits(sign | 0x7FC0_0000);
    }
    let v = if e == 0 {
        // Subnormal: mant * 2^(1 - bias - m), exact in f32.
        mant as f32 * pow2(1 - f.bias - f.m as i32)
    } else {
        f32::from_bits((((e - f.bias + 127) as u32) << 23) | (mant << (23 - f.m)))
    };
    f32::from_bits(sign | v.to_bits())
}

/// What an encoder does with a finite magnitude above the largest finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overflow {
    /// Write the largest finite value (E4M3: OCP's saturating conversion).
    Saturate,
    /// Write ±Inf (E5M2, as IEEE rounding does).
    Infinity,
}

impl Format {
    fn overflow(self) -> Overflow {
        if self.inf {
            Overflow::Infinity
        } else {
            Overflow::Saturate
        }
    }
}

/// The code of `y`, rounded to nearest, ties to even.
///
/// - NaN gives NaN (sign kept); ±Inf gives ±Inf in E5M2 and NaN in E4M3 (which has no
///   infinity: the overflow stays visible).
/// - A finite magnitude that rounds above the largest finite value gives it (E4M3) or
///   ±Inf (E5M2: from 61440 up).
/// - The sign of zero is kept.
#[inline(always)]
pub fn encode_nearest(f: Format, y: f32) -> u8 {
    let bits = y.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7FFF_FFFF;
    if a >= INF_BITS {
        return sign | special(f, a);
    }
    sign | magnitude_nearest(f, a)
}

/// The code of a NaN (`a > INF_BITS`) or infinite (`a == INF_BITS`) magnitude.
#[inline(always)]
fn special(f: Format, a: u32) -> u8 {
    if a > INF_BITS || !f.inf {
        f.nan()
    } else {
        f.max_code + 1
    }
}

/// The code magnitude of the finite magnitude with f32 bits `a`, rounded to nearest even.
#[inline(always)]
fn magnitude_nearest(f: Format, a: u32) -> u8 {
    let min_normal = ((1 - f.bias + 127) as u32) << 23;
    let q = if a < min_normal {
        // The subnormal grid, spacing 2^(1 - bias - m): scaling by a power of two is
        // exact, and the rounding is f32's own (ties to even): adding 2^23 rounds to an
        // integer (what round_ties_even gives, without a library call on CPUs that lack
        // a rounding instruction). The result is at most 2^m, the smallest normal's code.
        let v = f32::from_bits(a) * pow2(f.bias - 1 + f.m as i32);
        (v + 8_388_608.0).to_bits() - 0x4B00_0000
    } else {
        // Round the f32 mantissa to m bits (ties to even; a carry moves to the exponent),
        // then rebias the exponent.
        let shift = 23 - f.m;
        let r = a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1);
        (r >> shift) - (((127 - f.bias) as u32) << f.m)
    };
    limit(f, q)
}

/// A rounded code magnitude `q`, with overflow handled.
#[inline(always)]
fn limit(f: Format, q: u32) -> u8 {
    if q > f.max_code as u32 {
        match f.overflow() {
            Overflow::Saturate => f.max_code,
            Overflow::Infinity => f.max_code + 1,
        }
    } else {
        q as u8
    }
}

/// The code of `y` rounded stochastically with the 32-bit draw `h`: the magnitude goes to
/// the representable value below or above it, up with probability equal to its distance
/// from the one below over their spacing (to 24 bits: up when `(h >> 8) / 2^24` is less
/// than that fraction), so the decoded value is an unbiased estimate of `y` while `|y|`
/// stays at most the largest finite value. Non-finite values and overflow as
/// [`encode_nearest`].
#[inline(always)]
pub fn encode_stochastic(f: Format, y: f32, h: u32) -> u8 {
    let bits = y.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7FFF_FFFF;
    if a >= INF_BITS {
        return sign | special(f, a);
    }
    // The spacing of the grid around |y|: 2^(1 - bias - m) below the smallest normal,
    // else 2^(e - m) for |y| in [2^e, 2^(e+1)).
    let e = ((a >> 23) as i32 - 127).max(1 - f.bias);
    let spacing_exp = e - f.m as i32;
    // t = |y| / spacing, exact (a power-of-two scaling of a value with at most 24
    // significant bits; at most 2^(m+1)).
    let t = f32::from_bits(a) * pow2(-spacing_exp);
    // floor(t) for 0 <= t < 2^24 (truncation; no library call).
    let q0 = t as u32;
    let up = super::scalar::unit24(h) < t - q0 as f32;
    let q = q0 + u32::from(up);
    // q spacings is exactly representable on the grid: its code follows from the binade.
    let code = if e == 1 - f.bias {
        // Subnormal binade: the code is q (2^m is the smallest normal).
        q
    } else {
        // q in [2^m, 2^(m+1)]: exponent field e + bias, plus a carry when q = 2^(m+1).
        (((e + f.bias) as u32) << f.m) + (q - (1 << f.m))
    };
    sign | limit(f, code)
}

/// [`encode_nearest`] for a finite `y` with `|y| <= FMAX` (what a scaled block
/// converts), without branches, so that the backends' compilers vectorise it. Equal to
/// `encode_nearest` on that domain (tested on every such f32).
#[inline(always)]
pub fn nearest_in_range(f: Format, y: f32) -> u8 {
    let bits = y.to_bits();
    let a = bits & 0x7FFF_FFFF;
    // The exponent bits of |y|'s binade, at least the smallest normal's (the subnormals
    // share its spacing). Adding `2^(E + 23 - m)`, whose ulp is the spacing `2^(E - m)`
    // of the grid around |y|, rounds |y| to that grid (f32 addition: to nearest, ties to
    // even), and the sum's mantissa bits are then |y| in spacings: an integer in
    // [0, 2^(m+1)] (no float-to-integer cast, which would not vectorise). The code is
    // that count plus `2^m` per binade above the subnormal one (a count of `2^(m+1)` is
    // the next binade's first code, so the carry needs nothing more).
    let emin = ((1 - f.bias + 127) as u32) << 23;
    if f.m == 0 {
        // E3M0: a tie rounds to the even code, which is not the even count here (every
        // value has mantissa 0): round the f32 exponent instead.
        let r = a + ((1 << 22) - 1) + ((a >> 23) & 1);
        let normal = (r >> 23).wrapping_sub((127 - f.bias) as u32);
        // Below 2^(1 - bias), the grid of 0 and the smallest normal (adding 2^23 rounds
        // |y| / 2^(1 - bias) to an integer, ties to even: to 0).
        let v = f32::from_bits(a) * pow2(f.bias - 1);
        let sub = (v + 8_388_608.0).to_bits() - 0x4B00_0000;
        let q = if a < emin { sub } else { normal };
        return ((bits >> 24) & 0x80) as u8 | q as u8;
    }
    let e = (a & 0x7F80_0000).max(emin);
    let magic = e + ((23 - f.m) << 23);
    let count = (f32::from_bits(a) + f32::from_bits(magic)).to_bits() - magic;
    let q = ((e - emin) >> (23 - f.m)) + count;
    ((bits >> 24) & 0x80) as u8 | q as u8
}

/// [`encode_stochastic`] for a finite `y` with `|y| <= FMAX`, with the draw's key for the
/// element's 2^32 window and its low 32 index bits, without branches. Equal to
/// `encode_stochastic` on that domain (tested).
#[inline(always)]
pub fn stochastic_in_range(f: Format, y: f32, h: u32) -> u8 {
    let bits = y.to_bits();
    let a = bits & 0x7FFF_FFFF;
    // E + 127, at least that of the subnormal binade.
    let eb = (a >> 23).max((128 - f.bias) as u32);
    // t = |y| * 2^(m - E): the power of two built from its bits (m - E is within f32's
    // normal range for both formats).
    let t = f32::from_bits(a) * f32::from_bits((127 + 127 + f.m - eb) << 23);
    let fl = t.floor();
    let up = super::scalar::unit24(h) < t - fl;
    // floor(t) <= 2^(m+1) as an integer, as in nearest_in_range.
    let q = ((fl + 8_388_608.0).to_bits() - 0x4B00_0000) + u32::from(up);
    let normal = ((eb + f.bias as u32 - 127) << f.m) + q - (1 << f.m);
    let code = if eb == (128 - f.bias) as u32 {
        q
    } else {
        normal
    };
    ((bits >> 24) & 0x80) as u8 | code.min(f.max_code as u32) as u8
}

/// [`decode`] of a code that is not NaN or ±Inf (what a scaled block holds), without
/// branches or a table. Equal to `decode` on those codes (tested on all of them).
#[inline(always)]
pub fn value_finite(f: Format, c: u8) -> f32 {
    let sign = ((c & 0x80) as u32) << 24;
    let mag = (c & 0x7F) as u32;
    let sub = mag as f32 * pow2(1 - f.bias - f.m as i32);
    let normal = f32::from_bits((mag << (23 - f.m)) + (((127 - f.bias) as u32) << 23));
    let v = if mag < (1 << f.m) { sub } else { normal };
    f32::from_bits(v.to_bits() | sign)
}

/// [`value`] of any code, NaN and ±Inf included, without branches or a table: the
/// finite value of [`value_finite`], replaced by the canonical NaN (`0x7FC0_0000` with the
/// code's sign) or ±Inf where the code is one. Equal to `value` on every code (tested on
/// all of them); the loop of an unscaled decode vectorises on it, where a lookup in a
/// table of 256 values is a scalar load per element.
#[inline(always)]
pub fn value_any(f: Format, c: u8) -> f32 {
    let sign = ((c & 0x80) as u32) << 24;
    let mag = (c & 0x7F) as u32;
    let top = 0x7F >> f.m << f.m;
    // E5M2's codes with every exponent bit set, E4M3's 0x7F.
    let special = if f.inf { mag >= top } else { mag == 0x7F };
    let bits = if f.inf && mag == top {
        INF_BITS
    } else {
        0x7FC0_0000
    };
    let v = value_finite(f, c);
    if special {
        f32::from_bits(sign | bits)
    } else {
        v
    }
}

/// The values of a 4-bit format's sixteen codes by [`value_finite`], indexed by code (the
/// same f32 as converting each: scaled frames hold finite codes only).
#[inline(always)]
pub fn four_values(f: Format) -> [f32; 16] {
    core::array::from_fn(|n| value_finite(f, widen4(n as u8)))
}

/// How a block's values are scaled into the format's range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    /// An f32 scale per block: `s = max(m / FMAX, 2^-126)`, `m` the block's absmax (one
    /// step down where `FMAX * s` would overflow).
    F32,
    /// A power-of-two scale per block, one byte `k + 127`: the smallest `2^k`
    /// (`-127 <= k <= 127`) with `m / 2^k <= FMAX`.
    E8m0,
    /// The same byte by the OCP MX rule, for encoding only (it decodes as [`Scale::E8m0`]):
    /// `k = max(floor(log2 m) - emax, -127)`, the block's largest quotients clamped to
    /// `±FMAX` where they pass it.
    E8m0Floor,
    /// An E4M3 byte per block times a frame-wide f32 scale `g` (its bits, `global`):
    /// the block's byte is the smallest E4M3 value `v` (at least `2^-9`, at most 448)
    /// with `v >= m / (FMAX * g)` (f32 product and quotient), its scale `v * g` (f32
    /// product). NVIDIA's NVFP4 layout with blocks of 16.
    E4m3 {
        /// The bits of the frame's f32 scale `g`.
        global: u32,
    },
    /// No scale: each value is converted as it is.
    None,
}

impl Scale {
    /// Bytes of one block's scale.
    pub const fn bytes(self) -> usize {
        match self {
            Scale::F32 => 4,
            Scale::E8m0 | Scale::E8m0Floor | Scale::E4m3 { .. } => 1,
            Scale::None => 0,
        }
    }
}

/// The smallest E4M3 code whose value is at least `t` (finite, `>= 0`), between `2^-9`
/// (code 1) and 448 (code `0x7E`): `t` rounded up on the E4M3 grid.
#[inline(always)]
pub fn e4m3_ceil(t: f32) -> u8 {
    let a = t.to_bits();
    let q = if a < (121 << 23) {
        // Below 2^-6, the subnormal grid of spacing 2^-9: t * 2^9 < 8 is exact and its
        // ceiling is the code.
        (t * 512.0).ceil() as u32
    } else {
        // Round the mantissa up to 3 bits (a carry moves to the exponent), then rebias
        // the exponent from f32's 127 to E4M3's 7.
        ((a + (1 << 20) - 1) >> 20) - (120 << 3)
    };
    q.clamp(1, E4M3.max_code as u32) as u8
}

/// The E8M0 exponent `k` of a block with absmax bits `m` (positive, finite): the smallest
/// `k >= -127` with `m <= FMAX * 2^k`.
#[inline(always)]
pub fn e8m0_exponent(f: Format, m: u32) -> i32 {
    // floor(log2 m) and m's 23-bit mantissa, normalising a subnormal m.
    let (e, mant) = if m >= 1 << 23 {
        ((m >> 23) as i32 - 127, m & 0x7F_FFFF)
    } else {
        let lz = m.leading_zeros() as i32 - 8; // m < 2^23: shift to bit 23
        (-126 - lz, (m << lz) & 0x7F_FFFF)
    };
    // m / 2^(e - emax) lies in [2^emax, 2^(emax+1)); it fits when m's mantissa is at most
    // FMAX's.
    let fmax_mant = (f.max_code as u32 & ((1 << f.m) - 1)) << (23 - f.m);
    let k = e - f.emax() + i32::from(mant > fmax_mant);
    k.max(-127)
}

/// The E8M0 exponent `k` of a block with absmax bits `m` (positive, finite) by the OCP MX
/// rule: `max(floor(log2 m) - emax, -127)`. The block's largest elements can then pass
/// `FMAX` (by less than `2^(emax+1) / FMAX`), and are clamped to it.
#[inline(always)]
pub fn e8m0_floor_exponent(f: Format, m: u32) -> i32 {
    let e = if m >= 1 << 23 {
        (m >> 23) as i32 - 127
    } else {
        -126 - (m.leading_zeros() as i32 - 8)
    };
    (e - f.emax()).max(-127)
}

/// A finite block's scale (written to `sc`) and how its elements' quotients are formed.
#[derive(Clone, Copy)]
pub struct Quotient {
    /// The block's scale.
    pub s: f32,
    /// `2^-k` for an E8M0 scale `2^k`: `x * 2^-k` is the same correctly rounded value as
    /// `x / 2^k`, without a division.
    pub inv: Option<f32>,
    /// The format's largest finite value, the bound of the quotients.
    pub fmax: f32,
}

impl Quotient {
    /// The scale of a block with absmax `m` (positive, finite), written to `sc`.
    #[inline(always)]
    fn new(f: Format, scale: Scale, m: f32, sc: &mut [u8]) -> Quotient {
        let fmax = f.max();
        let (s, inv) = match scale {
            Scale::F32 => {
                let mut s = (m / fmax).max(f32::MIN_POSITIVE);
                // Near f32::MAX the rounded scale could make FMAX * s overflow.
                if (fmax * s).is_infinite() {
                    s = s.next_down();
                }
                sc.copy_from_slice(&s.to_le_bytes());
                (s, None)
            }
            Scale::E4m3 { global } => {
                let g = f32::from_bits(global);
                let v = e4m3_ceil(m / (fmax * g));
                sc[0] = v;
                (value_finite(E4M3, v) * g, None)
            }
            Scale::E8m0Floor => {
                let k = e8m0_floor_exponent(f, m.to_bits());
                sc[0] = (k + 127) as u8;
                (pow2(k), Some(pow2(-k)))
            }
            _ => {
                let k = e8m0_exponent(f, m.to_bits());
                sc[0] = (k + 127) as u8;
                (pow2(k), Some(pow2(-k)))
            }
        };
        Quotient { s, inv, fmax }
    }

    /// `x / s`, clamped to ±FMAX: a rounded scale can leave the block's largest element a
    /// hair above it, which must not overflow.
    #[inline(always)]
    pub fn of(self, x: f32) -> f32 {
        match self.inv {
            None => x / self.s,
            Some(inv) => x * inv,
        }
        .clamp(-self.fmax, self.fmax)
    }
}

/// Encode one range of whole blocks: scales (`scale.bytes()` per block), then the codes:
/// one byte per element, or with `four` (a 4-bit format, `f` is [`E2M1`] or [`E3M0`],
/// with a scale and an even `block`) two per byte, element `j` in the low nibble of byte
/// `j / 2` when `j` is even and the high nibble when odd (the range starts on a byte).
/// `first` is the global index of `x[0]` (for the stochastic draws; `None` for nearest).
/// True when `x` held NaN or ±Inf.
///
/// A block holding NaN or ±Inf gets a NaN scale (f32 `0x7FC00000`, E8M0 `0xFF`, E4M3
/// `0x7F`) and zero codes: all its elements decode to NaN. An all-zero block gets scale 0
/// (E8M0: `2^-127`) and zero codes. With [`Scale::None`] every element is converted alone.
///
/// With `FAST` the scaled blocks' elements are converted by the branch-free
/// [`nearest_in_range`] and [`stochastic_in_range`] (the SIMD backends compile it with
/// their instruction sets); the bytes are the same.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode<const FAST: bool>(
    f: Format,
    scale: Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: Option<&Draws>,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    encode_with(
        f,
        scale,
        four,
        block,
        x,
        draws,
        first,
        scales,
        codes,
        #[inline(always)]
        |q, xt, at, out| convert::<FAST>(f, q, xt, draws, at, out),
    )
}

/// [`encode_blocks`] with `convert8(q, xb, start, out)` writing the 8-bit-layout codes of a
/// scaled block's elements `xb` (the first at global index `start`): into the block's
/// code bytes, or with `four` a tile at a time, packed in pairs by [`packed`]. `convert8`
/// must be inlined (`#[inline(always)]`) to be compiled with the caller's instruction set.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode_with(
    f: Format,
    scale: Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: Option<&Draws>,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
    mut convert8: impl FnMut(Quotient, &[f32], u64, &mut [u8]),
) -> bool {
    encode_blocks(
        f,
        scale,
        four,
        block,
        x,
        draws,
        first,
        scales,
        codes,
        #[inline(always)]
        |q, xb, start, cb| {
            if four {
                // A closure of its own, inlined: passed as `&mut convert8` (or without the
                // attribute) the conversion was compiled for baseline x86-64, and fp4's
                // stochastic encode called the library's `floorf` per element, 10 times
                // slower.
                packed(
                    q,
                    xb,
                    start,
                    cb,
                    #[inline(always)]
                    |q, xt, at, out| convert8(q, xt, at, out),
                )
            } else {
                convert8(q, xb, start, cb)
            }
        },
    )
}

/// A 4-bit format's packed codes of a scaled block's elements `xb` (the first at global
/// index `start`) into `cb`, two per byte (the layout of [`encode`]), from `convert8`,
/// which writes the 8-bit-layout codes of a tile: converted a tile at a time on the
/// stack, then packed in pairs.
#[inline(always)]
pub fn packed(
    q: Quotient,
    xb: &[f32],
    start: u64,
    cb: &mut [u8],
    mut convert8: impl FnMut(Quotient, &[f32], u64, &mut [u8]),
) {
    const TILE: usize = 64;
    let mut tile = [0u8; TILE];
    for (t, (xt, ct)) in xb.chunks(TILE).zip(cb.chunks_mut(TILE / 2)).enumerate() {
        let codes8 = &mut tile[..xt.len()];
        convert8(q, xt, start + (t * TILE) as u64, codes8);
        let pairs = codes8.chunks_exact(2);
        // The last block of a range can be odd: its last code has a zero high nibble.
        if let Some(&last) = pairs.remainder().first() {
            ct[xt.len() / 2] = narrow4(last);
        }
        // narrow4(p[0]) | narrow4(p[1]) << 4 on the pair as one u16 (the form the
        // compilers vectorise): magnitudes from bits 0..3 and 8..11, signs from 7, 15.
        for (c, p) in ct.iter_mut().zip(pairs) {
            let w = u16::from_le_bytes([p[0], p[1]]);
            *c = ((w & 0x07) | ((w >> 4) & 0x78) | ((w >> 8) & 0x80)) as u8;
        }
    }
}

/// The block layout of [`encode`], with `convert(q, xb, start, cb)` writing the codes of
/// a scaled block's elements `xb` (the first at global index `start`) into the block's
/// code bytes `cb` (with `four`, two per byte, as [`packed`] does): [`encode`]'s own
/// conversion, or a SIMD kernel's that gives the same bytes.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn encode_blocks(
    f: Format,
    scale: Scale,
    four: bool,
    block: usize,
    x: &[f32],
    draws: Option<&Draws>,
    first: u64,
    scales: &mut [u8],
    codes: &mut [u8],
    mut convert: impl FnMut(Quotient, &[f32], u64, &mut [u8]),
) -> bool {
    if scale == Scale::None {
        let mut nonfinite = false;
        for (j, (c, &v)) in codes.iter_mut().zip(x).enumerate() {
            nonfinite |= !v.is_finite();
            *c = general(f, draws, v, first + j as u64);
        }
        return nonfinite;
    }
    let sb = scale.bytes();
    let per_block = if four { block / 2 } else { block };
    let mut nonfinite = false;
    for (b, (xb, cb)) in x.chunks(block).zip(codes.chunks_mut(per_block)).enumerate() {
        let sc = &mut scales[b * sb..(b + 1) * sb];
        let start = first + (b * block) as u64;
        let q = match BlockScale::abs_max(xb) {
            BlockScale::NonFinite => {
                nonfinite = true;
                match scale {
                    Scale::F32 => sc.copy_from_slice(&0x7FC0_0000u32.to_le_bytes()),
                    Scale::E4m3 { .. } => sc[0] = 0x7F,
                    _ => sc[0] = 0xFF,
                }
                cb.fill(0);
                continue;
            }
            BlockScale::Zero => {
                sc.fill(0);
                cb.fill(0);
                continue;
            }
            BlockScale::Of(m) => Quotient::new(f, scale, m, sc),
        };
        convert(q, xb, start, cb);
    }
    nonfinite
}

/// The general conversion of `y` (element `i`): [`encode_nearest`], or
/// [`encode_stochastic`] with element `i`'s draw.
#[inline(always)]
fn general(f: Format, draws: Option<&Draws>, y: f32, i: u64) -> u8 {
    match draws {
        None => encode_nearest(f, y),
        Some(d) => encode_stochastic(f, y, d.draw(i)),
    }
}

/// The 8-bit-layout codes of a scaled block's elements `xb` (the first at global index
/// `start`) into `out`: the branch-free conversions when `FAST` (and, stochastic, when the
/// elements share one 2^32 window of draws), else the general ones.
#[inline(always)]
fn convert<const FAST: bool>(
    f: Format,
    q: Quotient,
    xb: &[f32],
    draws: Option<&Draws>,
    start: u64,
    out: &mut [u8],
) {
    let one_window = start >> 32 == (start + xb.len() as u64 - 1) >> 32;
    match draws {
        None if FAST => nearest_block(f, q, xb, out),
        Some(d) if FAST && one_window => {
            let key = d.key_for(start);
            for (j, (c, &v)) in out.iter_mut().zip(xb).enumerate() {
                let h = crate::rng::lowbias32((start as u32).wrapping_add(j as u32) ^ key);
                *c = stochastic_in_range(f, q.of(v), h);
            }
        }
        _ => {
            for (j, (c, &v)) in out.iter_mut().zip(xb).enumerate() {
                *c = general(f, draws, q.of(v), start + j as u64);
            }
        }
    }
}

/// [`nearest_in_range`] of every quotient of `xb` into `out`, with the format a constant
/// in each copy of the loop and the quotient's form chosen outside it, so that the
/// compilers keep the constants in registers and convert whole vectors.
#[inline(always)]
fn nearest_block(f: Format, q: Quotient, xb: &[f32], out: &mut [u8]) {
    #[inline(always)]
    fn run(f: Format, q: Quotient, xb: &[f32], out: &mut [u8]) {
        let lo = -q.fmax;
        let hi = q.fmax;
        match q.inv {
            Some(inv) => {
                for (c, &v) in out.iter_mut().zip(xb) {
                    *c = nearest_in_range(f, (v * inv).clamp(lo, hi));
                }
            }
            None => {
                let s = q.s;
                for (c, &v) in out.iter_mut().zip(xb) {
                    *c = nearest_in_range(f, (v / s).clamp(lo, hi));
                }
            }
        }
    }
    if f == E4M3 {
        run(E4M3, q, xb, out)
    } else if f == E5M2 {
        run(E5M2, q, xb, out)
    } else if f == E2M1 {
        run(E2M1, q, xb, out)
    } else if f == E3M0 {
        run(E3M0, q, xb, out)
    } else {
        run(f, q, xb, out)
    }
}

/// A block's scale as an f32: the stored f32, `2^(byte - 127)` (NaN for `0xFF`), or the
/// E4M3 byte's value times the frame's scale (NaN for `0x7F` and `0xFF`).
#[inline(always)]
pub fn scale_of(scale: Scale, sc: &[u8]) -> f32 {
    match scale {
        Scale::F32 => f32::from_le_bytes([sc[0], sc[1], sc[2], sc[3]]),
        Scale::E8m0 | Scale::E8m0Floor if sc[0] == 0xFF => f32::from_bits(0x7FC0_0000),
        Scale::E8m0 | Scale::E8m0Floor => pow2(sc[0] as i32 - 127),
        Scale::E4m3 { .. } if sc[0] & 0x7F == 0x7F => f32::from_bits(0x7FC0_0000),
        Scale::E4m3 { global } => value_finite(E4M3, sc[0]) * f32::from_bits(global),
        Scale::None => 1.0,
    }
}

/// Decode one range of whole blocks in mode `M` (the layout of [`encode`]): element `i`
/// is `value(code) * s` for its block's scale `s` (the code's value alone with
/// [`Scale::None`]).
///
/// Scaled frames hold finite codes only (decoders refuse the others), which the
/// branch-free [`value_finite`] converts; without a scale, [`value_any`]. The
/// result is the same bits on every backend.
#[inline(always)]
pub fn decode<const M: u8>(
    f: Format,
    scale: Scale,
    four: bool,
    block: usize,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) {
    if scale == Scale::None {
        // The format as a constant in each loop, so that its shifts and powers fold.
        #[inline(always)]
        fn run<const M: u8>(f: Format, codes: &[u8], out: &mut [f32]) {
            for (o, &c) in out.iter_mut().zip(codes) {
                put::<M>(o, value_any(f, c));
            }
        }
        match f {
            E4M3 => run::<M>(E4M3, codes, out),
            E5M2 => run::<M>(E5M2, codes, out),
            _ => run::<M>(f, codes, out),
        }
        return;
    }
    let sb = scale.bytes();
    let per_block = if four { block / 2 } else { block };
    // A 4-bit code's value from a table of the sixteen, two codes per byte.
    let fours = four_values(f);
    for (b, (ob, cb)) in out
        .chunks_mut(block)
        .zip(codes.chunks(per_block))
        .enumerate()
    {
        let s = scale_of(scale, &scales[b * sb..(b + 1) * sb]);
        if !four {
            for (o, &c) in ob.iter_mut().zip(cb) {
                put::<M>(o, value_finite(f, c) * s);
            }
            continue;
        }
        // A last block of odd length ends on a low nibble.
        let last = cb.get((ob.len().max(1) - 1) / 2).copied().unwrap_or(0);
        let mut pairs = ob.chunks_exact_mut(2);
        for (p, &c) in (&mut pairs).zip(cb) {
            put::<M>(&mut p[0], fours[usize::from(c & 0xF)] * s);
            put::<M>(&mut p[1], fours[usize::from(c >> 4)] * s);
        }
        if let Some(o) = pairs.into_remainder().first_mut() {
            put::<M>(o, fours[usize::from(last & 0xF)] * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Powers of two are built from their bits (`powi`'s precision is unspecified, and
    // Miri perturbs it).

    /// The nearest encoder against a brute-force search over all 256 codes: the finite
    /// value nearest to `y` (ties to the even code), saturating or overflowing as the
    /// format says.
    fn nearest_by_search(f: Format, y: f32) -> u8 {
        if y.is_nan() {
            return (y.to_bits() >> 24) as u8 & 0x80 | f.nan();
        }
        let sign = (y.to_bits() >> 24) as u8 & 0x80;
        let a = y.abs() as f64;
        if y.is_infinite() {
            return sign | if f.inf { f.max_code + 1 } else { f.nan() };
        }
        let mut best = 0u8;
        for c in 0..=f.max_code {
            let v = value(f, c) as f64;
            let bv = value(f, best) as f64;
            if (v - a).abs() < (bv - a).abs()
                || ((v - a).abs() == (bv - a).abs() && c % 2 == 0 && best % 2 == 1)
            {
                best = c;
            }
        }
        // Past the largest finite value: the midpoint to the next binade value decides.
        let max = f.max() as f64;
        let next = max + (max - value(f, f.max_code - 1) as f64);
        if a > max && (a > (max + next) / 2.0 || (a == (max + next) / 2.0 && f.max_code % 2 == 1)) {
            return sign
                | match f.overflow() {
                    Overflow::Saturate => f.max_code,
                    Overflow::Infinity => f.max_code + 1,
                };
        }
        sign | best
    }

    #[test]
    fn the_two_formats_decode_as_specified() {
        assert_eq!(E4M3.max(), 448.0);
        assert_eq!(E5M2.max(), 57344.0);
        assert_eq!(value(E4M3, 0x01), pow2(-9));
        assert_eq!(value(E5M2, 0x01), pow2(-16));
        assert_eq!(value(E4M3, 0x08), pow2(-6));
        assert_eq!(value(E4M3, 0x38), 1.0);
        assert_eq!(value(E5M2, 0x3C), 1.0);
        assert!(value(E4M3, 0x7F).is_nan() && value(E4M3, 0xFF).is_nan());
        assert_eq!(value(E5M2, 0x7C), f32::INFINITY);
        assert_eq!(value(E5M2, 0xFC), f32::NEG_INFINITY);
        assert!(value(E5M2, 0x7D).is_nan());
        assert_eq!(value(E4M3, 0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!((E4M3.emax(), E5M2.emax()), (8, 15));
        // Every finite code round-trips through the nearest encoder.
        for f in [E4M3, E5M2] {
            for c in 0..=255u8 {
                let v = value(f, c);
                if v.is_finite() {
                    assert_eq!(encode_nearest(f, v), c, "{f:?} {c:#x}");
                    // An exact value is its own stochastic rounding, for any draw.
                    for h in [0, 1 << 31, u32::MAX] {
                        assert_eq!(encode_stochastic(f, v, h), c, "{f:?} {c:#x}");
                    }
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "millions of conversions: minutes under Miri")]
    fn nearest_equals_a_search_over_every_code() {
        // Every f32 whose low 13 bits follow a pattern, through both formats: all
        // exponents, the mantissa bits that decide rounding (ties and near-ties), signs.
        // Natively every high part; under emulation (qemu for aarch64, where this took a
        // minute) every 17th, a spread over all exponents and both signs.
        let stride = if cfg!(target_arch = "x86_64") { 1 } else { 17 };
        for f in [E4M3, E5M2] {
            for hi in (0..(1u32 << 19)).step_by(stride) {
                for lo in [0u32, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF] {
                    let y = f32::from_bits(hi << 13 | lo);
                    assert_eq!(
                        encode_nearest(f, y),
                        nearest_by_search(f, y),
                        "{f:?} {y:e} ({:#x})",
                        y.to_bits()
                    );
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "tens of thousands of draws: slow under Miri")]
    fn stochastic_rounds_to_a_neighbour_with_the_right_odds() {
        for f in [E4M3, E5M2] {
            for y in [0.3f32, 1.1, -5.7, 300.0, 2e-3, 1e-5, 447.0] {
                let lo_hi: Vec<f32> = (0..4096u32)
                    .map(|i| value(f, encode_stochastic(f, y, i.wrapping_mul(0x9E37_79B9))))
                    .collect();
                let mut vals = lo_hi.clone();
                vals.sort_by(f32::total_cmp);
                vals.dedup();
                assert!(vals.len() <= 2, "{f:?} {y}: {vals:?}");
                assert!(
                    vals[0] <= y && y <= *vals.last().unwrap(),
                    "{f:?} {y}: {vals:?}"
                );
                let mean = lo_hi.iter().map(|&v| v as f64).sum::<f64>() / 4096.0;
                let spacing = (vals.last().unwrap() - vals[0]) as f64;
                // 4096 draws of a two-point distribution: the mean within 5 standard
                // deviations (at most spacing / (2 sqrt(4096))).
                assert!(
                    (mean - y as f64).abs() <= 5.0 * spacing / 128.0 + 1e-12,
                    "{f:?} {y}: mean {mean}"
                );
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "millions of conversions: minutes under Miri")]
    fn the_branch_free_conversions_equal_the_general_ones() {
        for f in [E4M3, E5M2] {
            for c in 0..=255u8 {
                let v = value(f, c);
                if v.is_finite() {
                    assert_eq!(value_finite(f, c).to_bits(), v.to_bits(), "{f:?} {c:#x}");
                }
                assert_eq!(value_any(f, c).to_bits(), v.to_bits(), "{f:?} {c:#x}");
            }
            // A sample of the in-range domain here; tests/exhaustive.rs runs all of it.
            let fmax = f.max().to_bits();
            for a in (0..=fmax).step_by(97).chain([fmax, fmax - 1, 0, 1]) {
                for y in [f32::from_bits(a), -f32::from_bits(a)] {
                    assert_eq!(nearest_in_range(f, y), encode_nearest(f, y), "{f:?} {y:e}");
                    for h in [0u32, 0x8000_0000, u32::MAX, a.wrapping_mul(0x9E37_79B9)] {
                        assert_eq!(
                            stochastic_in_range(f, y, h),
                            encode_stochastic(f, y, h),
                            "{f:?} {y:e} {h:#x}"
                        );
                    }
                }
            }
        }
    }

    /// The 4-bit formats, on finite values up to twice their largest (what a scaled block
    /// converts, and beyond it the saturation): nearest equals a search over the codes,
    /// the branch-free forms equal the definitions, and the values are as specified.
    #[test]
    #[cfg_attr(miri, ignore = "millions of conversions: minutes under Miri")]
    fn the_4_bit_formats_round_to_their_values() {
        let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        let e3m0 = [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0];
        for (f, values) in [(E2M1, e2m1), (E3M0, e3m0)] {
            for (c, &v) in values.iter().enumerate() {
                assert_eq!(value(f, c as u8), v as f32);
                assert_eq!(value_finite(f, c as u8), v as f32);
                assert_eq!(
                    value_finite(f, widen4(8 | c as u8)).to_bits(),
                    (-v as f32).to_bits()
                );
                assert_eq!(narrow4(widen4(8 | c as u8)), 8 | c as u8);
            }
            // Every tie (midpoint of two neighbours) and its f32 neighbours.
            for w in values.windows(2) {
                let mid = ((w[0] + w[1]) / 2.0) as f32;
                for y in [mid, mid.next_up(), mid.next_down(), -mid] {
                    assert_eq!(encode_nearest(f, y), nearest_by_search(f, y), "{f:?} {y:e}");
                    assert_eq!(
                        nearest_in_range(f, y),
                        nearest_by_search(f, y),
                        "{f:?} {y:e}"
                    );
                }
            }
            let fmax = f.max();
            let limit = (2.0 * fmax).to_bits();
            for a in (0..=limit).step_by(997).chain([fmax.to_bits(), limit]) {
                for y in [f32::from_bits(a), -f32::from_bits(a)] {
                    let got = encode_nearest(f, y);
                    assert_eq!(got, nearest_by_search(f, y), "{f:?} {y:e}");
                    if y.abs() <= fmax {
                        assert_eq!(nearest_in_range(f, y), got, "{f:?} {y:e}");
                        let h = a.wrapping_mul(0x9E37_79B9);
                        assert_eq!(
                            stochastic_in_range(f, y, h),
                            encode_stochastic(f, y, h),
                            "{f:?} {y:e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "a million searches: slow under Miri")]
    fn e4m3_ceil_is_the_smallest_value_at_or_above() {
        let search = |t: f32| {
            (1..=E4M3.max_code)
                .find(|&c| value(E4M3, c) >= t)
                .unwrap_or(E4M3.max_code)
        };
        // Every f32 from 0 to 1024 with a pattern of low bits, and the values themselves.
        for hi in 0..=(1024f32.to_bits() >> 12) {
            for lo in [0u32, 1, 0x7FF, 0x800, 0xFFF] {
                let t = f32::from_bits(hi << 12 | lo);
                assert_eq!(e4m3_ceil(t), search(t), "{t:e}");
            }
        }
        for c in 1..=E4M3.max_code {
            assert_eq!(e4m3_ceil(value(E4M3, c)), c);
        }
        assert_eq!(e4m3_ceil(0.0), 1);
        assert_eq!(e4m3_ceil(f32::INFINITY), E4M3.max_code);
    }

    #[test]
    fn e8m0_takes_the_smallest_power_of_two_that_fits() {
        for f in [E4M3, E5M2, E2M1, E3M0] {
            for m in [
                1.0f32,
                447.0,
                448.0,
                449.0,
                1e-30,
                3.0e38,
                1e-40,
                f32::MAX,
                5.0e-45,
            ] {
                let k = e8m0_exponent(f, m.to_bits());
                let fits = |k: i32| {
                    (m as f64) <= f.max() as f64 * f64::from_bits(((k + 1023) as u64) << 52)
                };
                assert!(fits(k), "{f:?} {m:e}: k {k}");
                assert!(
                    k == -127 || !fits(k - 1),
                    "{f:?} {m:e}: k {k} not the smallest"
                );
            }
        }
    }

    #[test]
    fn the_ocp_e8m0_rule_is_floor_log2_minus_emax_and_at_most_one_below() {
        // Every exponent and both sides of FMAX's mantissa: k = floor(log2 m) - emax (at
        // least -127), equal to the default rule's or one below it exactly where m's
        // mantissa exceeds FMAX's.
        let step = if cfg!(miri) { 0x7F_0001 } else { 0x2_0001 };
        for f in [E4M3, E5M2, E2M1, E3M0] {
            for bits in (1u32..0x7F80_0000).step_by(step) {
                let m = f32::from_bits(bits);
                // floor(log2 m) by comparison, not libm's log2 (which Miri perturbs by
                // an ulp on purpose, and which may be off at a power of two).
                let p2 = |k: i32| f64::from_bits(((k + 1023) as u64) << 52);
                let mut e = -149;
                while p2(e + 1) <= m as f64 {
                    e += 1;
                }
                let want = (e - f.emax()).max(-127);
                let k = e8m0_floor_exponent(f, bits);
                assert_eq!(k, want, "{f:?} {m:e}");
                let r = e8m0_exponent(f, bits);
                assert!(
                    r == k || (r == k + 1 && m > f.max() * pow2(k)),
                    "{f:?} {m:e}"
                );
            }
        }
    }
}
