//! `int8`: one signed byte per element with a per-block absmax step.
//!
//! For each block of `block` elements, `m = max |x|` and `step = m / 127` (f32). Each
//! element becomes `q = round(|x| * 127 / m)` with its sign, `q` in `-127..=127`;
//! decoding gives `q * step`.
//!
//! Error bounds (per element, `m` the block's absmax):
//! - nearest: `|x - x'| <= m * (1/254 + 2^-22) + 2^-142` (half a step, plus rounding);
//! - stochastic: `|x - x'| < m * (1/127 + 2^-22) + 2^-142` (below one step) and
//!   `E[x'] = x` up to a bias of at most `step * 2^-24`.
//!
//! An all-zero block decodes to exact zeros. A block holding any NaN or ±Inf is written
//! with a NaN step, and every element of that block decodes to NaN (the frame's
//! NONFINITE flag is also set), so a loss scaler sees the overflow.

use core::fmt;

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{EncodeCtx, MAX_BLOCK, Scheme, block_params, check_block, check_steps, read_block};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::{self, scalar::Round};
use crate::rng::{Draws, STREAM_ROUNDING};
use crate::wire::{HEADER_LEN, Header};

/// How a scaled value is rounded to an integer level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Round half to even: deterministic, error at most half a step.
    #[default]
    Nearest,
    /// Round up with probability equal to the fraction: unbiased, error below one step.
    Stochastic,
}

impl Rounding {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Rounding::Nearest => "nearest",
            Rounding::Stochastic => "stochastic",
        }
    }

    fn kernel(self) -> Round {
        match self {
            Rounding::Nearest => Round::Nearest,
            Rounding::Stochastic => Round::Stochastic,
        }
    }

    /// The spec's `rounding=` (default nearest).
    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Rounding, String> {
        Ok(
            match a.choice("rounding", "nearest", &["nearest", "stochastic"])? {
                "stochastic" => Rounding::Stochastic,
                _ => Rounding::Nearest,
            },
        )
    }

    /// The rounding in params byte `at` of a header: 0 nearest, 1 stochastic.
    pub(crate) fn read(h: &Header, at: usize) -> Result<Rounding> {
        match h.params[at] {
            0 => Ok(Rounding::Nearest),
            1 => Ok(Rounding::Stochastic),
            r => Err(Error::BadField {
                codec: h.codec,
                field: "params.rounding",
                reason: format!("{r} is not 0 (nearest) or 1 (stochastic)"),
            }),
        }
    }
}

/// int8 with a per-block absmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int8 {
    block: u32,
    rounding: Rounding,
    entropy: bool,
}

impl Default for Int8 {
    fn default() -> Self {
        Int8 {
            block: 256,
            rounding: Rounding::Nearest,
            entropy: false,
        }
    }
}

impl Int8 {
    /// int8 with blocks of `block` elements (1..=2^24).
    pub fn new(block: usize, rounding: Rounding) -> Result<Int8> {
        Ok(Int8 {
            block: check_block(CodecId::Int8, block)?,
            rounding,
            entropy: false,
        })
    }

    /// Elements per block.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// The rounding mode.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Int8, String> {
        let block = a.uint("block", 256, 1..=MAX_BLOCK as u64)? as u32;
        let rounding = Rounding::from_args(a)?;
        let c = Int8 {
            block,
            rounding,
            entropy: false,
        };
        let entropy = super::stage::from_args(a, CodecId::Int8, c.layout())?;
        Ok(Int8 { entropy, ..c })
    }
}

super::stage::stage_methods!(Int8);

impl fmt::Display for Int8 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "int8:block={},rounding={}{}",
            self.block,
            self.rounding.name(),
            super::stage::suffix(self.entropy)
        )
    }
}

impl From<Int8> for CodecSpec {
    fn from(c: Int8) -> CodecSpec {
        CodecSpec::Int8(c)
    }
}

impl Scheme for Int8 {
    const ID: CodecId = CodecId::Int8;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Int8> {
        let block = read_block(h)? as u32;
        let rounding = Rounding::read(h, 4)?;
        h.params_zero_from(5)?;
        if rounding == Rounding::Nearest {
            h.seed_zero()?;
        }
        let c = Int8 {
            block,
            rounding,
            entropy: h.entropy(),
        };
        super::stage::expect_payload(h, &c)?;
        Ok(c)
    }

    fn is_unbiased(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }
}

impl FixedRate for Int8 {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        block_params(self.block, (self.rounding == Rounding::Stochastic) as u8)
    }

    fn seeded(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }

    fn encode_weight(&self) -> usize {
        if self.rounding == Rounding::Stochastic {
            8
        } else {
            4
        }
    }

    fn layout(&self) -> Layout {
        Layout {
            block: self.block as usize,
            scale_bytes: 4,
            bits: 8,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        let draws = Draws::new(ctx.seed, STREAM_ROUNDING, ctx.offset);
        let (block, round) = (self.block as usize, self.rounding.kernel());
        kernels::encode_int8(x, block, round, &draws, ctx.offset, scales, codes)
    }

    fn validate(&self, h: &Header, scales: &[u8], _codes: &[u8]) -> Result<()> {
        check_steps(h, scales, HEADER_LEN)
    }

    fn feedback_fused(
        &self,
        r: &mut [f32],
        g: &[f32],
        beta: f32,
        gamma: f32,
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> Option<bool> {
        let draws = Draws::new(ctx.seed, STREAM_ROUNDING, ctx.offset);
        let (block, round) = (self.block as usize, self.rounding.kernel());
        kernels::feedback_int8(
            r,
            g,
            (beta, gamma),
            block,
            round,
            &draws,
            ctx.offset,
            scales,
            codes,
        )
    }

    fn hop_fused(
        &self,
        local: &[f32],
        input: (&[u8], &[u8]),
        ctx: &EncodeCtx,
        sum: &mut [f32],
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> Option<bool> {
        let draws = Draws::new(ctx.seed, STREAM_ROUNDING, ctx.offset);
        let (block, round) = (self.block as usize, self.rounding.kernel());
        kernels::hop_int8(
            local, input, block, round, &draws, ctx.offset, sum, scales, codes,
        )
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => kernels::decode_int8::<M>(scales, codes, self.block as usize, out))
    }
}
