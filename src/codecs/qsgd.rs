//! `qsgd`: QSGD (Alistarh et al. 2017), stochastic quantisation to `s` levels of a
//! per-block L2 norm.
//!
//! `bits` is 2, 4 or 8; each code is sign-magnitude with `s = 2^(bits-1) - 1` magnitude
//! levels (1, 7 or 127). For each block, `m = ||x||_2` and `step = m / s`; each element
//! becomes level `l` in `0..=s`, rounded stochastically from `|x| * s / m`, and decodes to
//! `±l * step`. Unbiased: `E[x'] = x` (to within `step * 2^-24`), with variance at most
//! `min(n / s^2, sqrt(n) / s) * ||x||^2` per block of `n` (the paper's bound).
//! Error per element is below one step.
//!
//! The norm is summed in f64 in a fixed lane order (docs/wire-format.md) and saturates at
//! `f32::MAX`; for a block whose norm exceeds `f32::MAX` the estimate is no longer
//! unbiased (it stays finite). A block holding NaN or ±Inf decodes to all NaN.

use core::fmt;

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{
    EncodeCtx, MAX_BLOCK, Scheme, block_params, check_block, check_code_padding, check_steps,
    read_block, signmag_sections,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels::scalar::Measure;
use crate::wire::{HEADER_LEN, Header};

/// QSGD with `bits` per element (2, 4 or 8) and a per-block L2-norm scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qsgd {
    bits: u8,
    block: u32,
    entropy: bool,
}

impl Default for Qsgd {
    fn default() -> Self {
        Qsgd {
            bits: 4,
            block: 512,
            entropy: false,
        }
    }
}

impl Qsgd {
    /// QSGD with `bits` in {2, 4, 8} and blocks of `block` elements (1..=2^24).
    pub fn new(bits: u32, block: usize) -> Result<Qsgd> {
        if !matches!(bits, 2 | 4 | 8) {
            return Err(Error::Param {
                codec: CodecId::Qsgd,
                name: "bits",
                reason: format!("{bits} is not one of 2, 4, 8"),
            });
        }
        Ok(Qsgd {
            bits: bits as u8,
            block: check_block(CodecId::Qsgd, block)?,
            entropy: false,
        })
    }

    /// Bits per element.
    pub fn bits(&self) -> u32 {
        self.bits as u32
    }

    /// Elements per block.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// Magnitude levels `s = 2^(bits-1) - 1`.
    pub fn levels(&self) -> u32 {
        (1 << (self.bits - 1)) - 1
    }

    /// The paper's variance factor `omega = min(n / s^2, sqrt(n) / s)` for a block of
    /// `n = block` elements: `E||Q(v) - v||^2 <= omega ||v||^2`. Below 1 the code is
    /// contractive, which error feedback needs (see [`crate::ErrorFeedback`]).
    pub fn variance_factor(&self) -> f64 {
        let (n, s) = (self.block as f64, self.levels() as f64);
        (n / (s * s)).min(n.sqrt() / s)
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Qsgd, String> {
        let bits = match a.choice("bits", "4", &["2", "4", "8"])? {
            "2" => 2,
            "8" => 8,
            _ => 4,
        };
        let block = a.uint("block", 512, 1..=MAX_BLOCK as u64)? as u32;
        let c = Qsgd {
            bits,
            block,
            entropy: false,
        };
        let entropy = super::stage::from_args(a, CodecId::Qsgd, c.layout())?;
        Ok(Qsgd { entropy, ..c })
    }
}

super::stage::stage_methods!(Qsgd);

impl fmt::Display for Qsgd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "qsgd:bits={},block={}{}",
            self.bits,
            self.block,
            super::stage::suffix(self.entropy)
        )
    }
}

impl From<Qsgd> for CodecSpec {
    fn from(c: Qsgd) -> CodecSpec {
        CodecSpec::Qsgd(c)
    }
}

impl Scheme for Qsgd {
    const ID: CodecId = CodecId::Qsgd;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Qsgd> {
        let block = read_block(h)? as u32;
        let bits = h.params[4];
        if !matches!(bits, 2 | 4 | 8) {
            return Err(Error::BadField {
                codec: h.codec,
                field: "params.bits",
                reason: format!("{bits} is not one of 2, 4, 8"),
            });
        }
        h.params_zero_from(5)?;
        let c = Qsgd {
            bits,
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

impl FixedRate for Qsgd {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        block_params(self.block, self.bits)
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
            scale_bytes: 4,
            bits: self.bits as usize,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        signmag_sections(
            x,
            ctx,
            scales,
            codes,
            self.block,
            self.bits as u32,
            Measure::L2,
        )
    }

    fn validate(&self, h: &Header, scales: &[u8], codes: &[u8]) -> Result<()> {
        check_steps(h, scales, HEADER_LEN)?;
        check_code_padding(h, scales, codes, self.bits as u64)
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => crate::kernels::decode_signmag::<M>(scales, codes, self.block as usize, self.bits as u32, out))
    }
}
