//! `ternary`: TernGrad (Wen et al. 2017), each element becomes -1, 0 or +1 times a
//! per-block absmax.
//!
//! For each block, `step = m = max |x|`; an element is sent as `sign(x)` with probability
//! `|x| / m` and as 0 otherwise, so `E[x'] = x` (to within `m * 2^-24`) and the variance
//! is `|x| * (m - |x|) <= m^2 / 4` per element. Codes are 2-bit sign-magnitude
//! (`00` 0, `01` +1, `11` -1; `10` is a negative zero and decodes to 0).
//! A block holding NaN or ±Inf decodes to all NaN.

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{
    EncodeCtx, MAX_BLOCK, Scheme, block_only_codec, block_params, check_block, check_code_padding,
    check_steps, read_block, signmag_sections,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels::scalar::Measure;
use crate::wire::{HEADER_LEN, Header};

block_only_codec!(
    /// TernGrad with a per-block absmax scale.
    Ternary,
    Ternary,
    default_block = 1024
);

impl Scheme for Ternary {
    const ID: CodecId = CodecId::Ternary;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Ternary> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        let c = Ternary {
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

impl FixedRate for Ternary {
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
            scale_bytes: 4,
            bits: 2,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        signmag_sections(x, ctx, scales, codes, self.block, 2, Measure::AbsMax)
    }

    fn validate(&self, h: &Header, scales: &[u8], codes: &[u8]) -> Result<()> {
        check_steps(h, scales, HEADER_LEN)?;
        check_code_padding(h, scales, codes, 2)
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => crate::kernels::decode_signmag::<M>(scales, codes, self.block as usize, 2, out))
    }
}
