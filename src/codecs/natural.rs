//! `natural`: natural compression (Horváth et al. 2019), stochastic rounding of each
//! element to one of its two neighbouring powers of two.
//!
//! `|x| = 2^e (1 + f)` with `f` in [0, 1) becomes `2^(e+1)` with probability `f` and
//! `2^e` otherwise: unbiased, with variance `|x|^2 f (1 - f) / (1 + f)^2 <= |x|^2 / 8`.
//!
//! Layout: the paper's 9-bit code (sign and 8-bit exponent) is stored in 8 bits by
//! giving each block a reference exponent `r = clamp(floor(log2 max|x|) + 1, -23, 127)`
//! (one byte, `r + 127`) and each element a byte: bit 7 the sign, bits 0..7 `m` with
//! `m = 0` meaning zero and `m >= 1` the magnitude `2^(r - 127 + m)`. The 127 powers
//! below `2^r` cover 126 binades under the block maximum. Within them the scheme is
//! exactly the paper's; an element smaller than `2^(r-126)` is rounded to 0 or
//! `2^(r-126)` (still unbiased, variance up to `|x| * 2^(r-126)`).
//! Elements in the top binade `[2^127, f32::MAX]` round down only (2^128 is not an f32).
//! Probabilities have 24-bit resolution: bias at most `2^-24` of the rounding gap.
//!
//! A block holding NaN or ±Inf is written with reference byte 255 and decodes to all NaN.

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{
    EncodeCtx, MAX_BLOCK, Scheme, block_only_codec, block_params, check_block, read_block,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::{
    self,
    scalar::{NATURAL_MIN_REF, NATURAL_NONFINITE},
};
use crate::rng::{Draws, STREAM_ROUNDING};
use crate::wire::{HEADER_LEN, Header};

block_only_codec!(
    /// Natural compression with a per-block reference exponent.
    Natural,
    Natural,
    default_block = 1024
);

impl Scheme for Natural {
    const ID: CodecId = CodecId::Natural;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Natural> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        let c = Natural {
            block,
            entropy: h.entropy(),
        };
        super::stage::expect_payload(h, &c)?;
        Ok(c)
    }

    fn is_unbiased(&self) -> bool {
        true
    }
}

impl FixedRate for Natural {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        block_params(self.block, 0)
    }

    fn seeded(&self) -> bool {
        true
    }

    fn encode_weight(&self) -> usize {
        8
    }

    fn layout(&self) -> Layout {
        Layout {
            block: self.block as usize,
            scale_bytes: 1,
            bits: 8,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        refs: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        let draws = Draws::new(ctx.seed, STREAM_ROUNDING, ctx.offset);
        kernels::encode_natural(x, self.block as usize, &draws, ctx.offset, refs, codes)
    }

    fn validate(&self, h: &Header, refs: &[u8], _codes: &[u8]) -> Result<()> {
        let min = (NATURAL_MIN_REF + 127) as u8;
        if let Some(b) = refs.iter().position(|&r| r < min && r != NATURAL_NONFINITE) {
            return Err(Error::Corrupt {
                codec: h.codec,
                offset: HEADER_LEN + b,
                reason: format!(
                    "block {b} reference byte {} is below {min} (exponent {} < {NATURAL_MIN_REF})",
                    refs[b],
                    refs[b] as i32 - 127
                ),
            });
        }
        Ok(())
    }

    fn decode_sections(&self, m: u8, refs: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => kernels::decode_natural::<M>(refs, codes, self.block as usize, out))
    }
}
