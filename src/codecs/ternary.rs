//! `ternary`: TernGrad (Wen et al. 2017), each element becomes -1, 0 or +1 times a
//! per-block absmax.
//!
//! For each block, `step = m = max |x|`; an element is sent as `sign(x)` with probability
//! `|x| / m` and as 0 otherwise, so `E[x'] = x` (to within `m * 2^-24`) and the variance
//! is `|x| * (m - |x|) <= m^2 / 4` per element. Codes are 2-bit sign-magnitude
//! (`00` 0, `01` +1, `11` -1; `10` is a negative zero and decodes to 0).
//! A block holding NaN or ±Inf decodes to all NaN.

use core::fmt;

use super::{
    EncodeCtx, Encoded, MAX_BLOCK, Scheme, block_params, block_payload, check_block,
    decode_signmag, encode_signmag, expect_payload, read_block,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels::scalar::Measure;
use crate::wire::Header;

/// TernGrad with a per-block absmax scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ternary {
    block: u32,
}

impl Default for Ternary {
    fn default() -> Self {
        Ternary { block: 1024 }
    }
}

impl Ternary {
    /// TernGrad with blocks of `block` elements (1..=2^24).
    pub fn new(block: usize) -> Result<Ternary> {
        Ok(Ternary {
            block: check_block(CodecId::Ternary, block)?,
        })
    }

    /// Elements per block.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Ternary, String> {
        let block = a.uint("block", 1024, 1..=MAX_BLOCK as u64)? as u32;
        Ok(Ternary { block })
    }
}

impl fmt::Display for Ternary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ternary:block={}", self.block)
    }
}

impl From<Ternary> for CodecSpec {
    fn from(c: Ternary) -> CodecSpec {
        CodecSpec::Ternary(c)
    }
}

impl Scheme for Ternary {
    const ID: CodecId = CodecId::Ternary;

    fn max_payload(&self, n: u64) -> u64 {
        block_payload(n, self.block as u64, 4, 2).unwrap_or(u64::MAX)
    }

    fn encode_payload(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        let (payload_len, nonfinite) = encode_signmag(x, ctx, out, self.block, 2, Measure::AbsMax)?;
        Ok(Encoded {
            payload_len,
            params: block_params(self.block, 0),
            nonfinite,
            seed: ctx.seed,
        })
    }

    fn read(h: &Header) -> Result<Ternary> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        expect_payload(h, block_payload(h.elements, block as u64, 4, 2))?;
        Ok(Ternary { block })
    }

    fn decode_payload<const ADD: bool>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        decode_signmag::<ADD>(h, p, out, self.block, 2)
    }

    fn is_unbiased(&self) -> bool {
        true
    }
}
