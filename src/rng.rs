//! Counter-based randomness for stochastic rounding and random-k selection.
//!
//! Randomness is a function, not a state: the draw for element `i` of a
//! tensor is a hash of `(seed, stream, i)` where `i` is the element's *global* index
//! (`EncodeCtx::offset` plus its position in the slice). The same seed therefore gives the
//! same frame whatever the chunking, thread count or SIMD width, and ranks that share a
//! seed draw the same random-k indices without sending them.
//!
//! The construction is normative (docs/wire-format.md, "Randomness"):
//!
//! ```text
//! key(seed, stream, hi) = low 32 bits of splitmix64(seed ^ stream ^ (hi * 0x9E3779B97F4A7C15))
//! draw(seed, stream, i) = lowbias32(lo32(i) ^ key(seed, stream, hi32(i)))
//! ```
//!
//! `lowbias32` is Chris Wellons' 32-bit integer hash (bias about 0.17); only 32-bit
//! multiplies touch each element, so it vectorises on AVX2, AVX-512 and NEON alike.

/// Stream constant for stochastic rounding draws.
pub const STREAM_ROUNDING: u64 = 0;
/// Stream constant for random-k selection draws (independent of rounding draws).
pub const STREAM_SELECT: u64 = 0xD1B5_4A32_D192_ED03;
/// Stream constant for random-k's stratified selection (`select=strata`): one draw per
/// stratum, indexed by the stratum's number.
pub const STREAM_STRATA: u64 = 0x6A09_E667_F3BC_C909;

/// The splitmix64 finaliser (Steele, Lea and Flood 2014).
#[inline]
pub const fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The two multipliers of [`lowbias32`], in order.
pub const LOWBIAS32_MUL: [u32; 2] = [0x7FEB_352D, 0x846C_A68B];

/// Chris Wellons' `lowbias32` integer hash: a bijection on `u32` with strong avalanche.
#[inline]
pub const fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(LOWBIAS32_MUL[0]);
    x ^= x >> 15;
    x = x.wrapping_mul(LOWBIAS32_MUL[1]);
    x ^ (x >> 16)
}

/// The per-2^32-element key of a stream.
#[inline]
pub const fn key(seed: u64, stream: u64, hi: u32) -> u32 {
    splitmix64(seed ^ stream ^ (hi as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) as u32
}

/// A keyed draw source for one `(seed, stream)`: caches the key of the current 2^32-element
/// window so that a draw costs one `lowbias32`.
#[derive(Debug, Clone, Copy)]
pub struct Draws {
    seed: u64,
    stream: u64,
    hi: u32,
    key: u32,
}

impl Draws {
    /// Draws for `(seed, stream)`, with the key cached for the window holding `first_index`.
    #[inline]
    pub const fn new(seed: u64, stream: u64, first_index: u64) -> Self {
        let hi = (first_index >> 32) as u32;
        Draws {
            seed,
            stream,
            hi,
            key: key(seed, stream, hi),
        }
    }

    /// The key of the 2^32-element window holding global index `i`:
    /// `draw(i) == lowbias32(i as u32 ^ key_for(i))`.
    #[inline]
    pub fn key_for(&self, i: u64) -> u32 {
        let hi = (i >> 32) as u32;
        if hi == self.hi {
            self.key
        } else {
            key(self.seed, self.stream, hi)
        }
    }

    /// The 32-bit draw for global element index `i`.
    #[inline]
    pub fn draw(&self, i: u64) -> u32 {
        let hi = (i >> 32) as u32;
        let k = if hi == self.hi {
            self.key
        } else {
            key(self.seed, self.stream, hi)
        };
        lowbias32(i as u32 ^ k)
    }
}

/// The draw for global index `i` without a cached key (the definition; `Draws` is the fast path).
#[inline]
pub const fn draw(seed: u64, stream: u64, i: u64) -> u32 {
    lowbias32(i as u32 ^ key(seed, stream, (i >> 32) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_key_matches_definition_across_window_boundary() {
        let base = (1u64 << 32) - 3;
        let d = Draws::new(42, STREAM_ROUNDING, base);
        for i in base..base + 6 {
            assert_eq!(d.draw(i), draw(42, STREAM_ROUNDING, i));
        }
    }

    #[test]
    fn streams_and_seeds_differ() {
        let a: Vec<u32> = (0..64).map(|i| draw(1, STREAM_ROUNDING, i)).collect();
        let b: Vec<u32> = (0..64).map(|i| draw(1, STREAM_SELECT, i)).collect();
        let c: Vec<u32> = (0..64).map(|i| draw(2, STREAM_ROUNDING, i)).collect();
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn top_24_bits_are_roughly_uniform() {
        // 2^16 draws into 16 buckets: chi-square with 15 dof; 99.9% quantile is 37.7.
        let mut buckets = [0u32; 16];
        let n = 1u64 << 16;
        for i in 0..n {
            buckets[(draw(7, STREAM_ROUNDING, i) >> 28) as usize] += 1;
        }
        let e = n as f64 / 16.0;
        let chi2: f64 = buckets.iter().map(|&b| (b as f64 - e).powi(2) / e).sum();
        assert!(chi2 < 37.7, "chi2 = {chi2}");
    }
}
