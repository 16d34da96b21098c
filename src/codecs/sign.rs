//! `sign`: 1-bit SGD / signSGD (Seide et al. 2014; Bernstein et al. 2018), one bit per
//! element with a per-block scale.
//!
//! For each block, `step = mean |x|` (summed in a fixed lane order, docs/wire-format.md);
//! each element is sent as its IEEE sign bit and decodes to `+step` or `-step`.
//!
//! sign(0): the sign *bit* decides, so `+0.0` decodes to `+step` and `-0.0` to `-step`.
//! Biased (use it with error feedback); with `p` a block and `D` its decoding,
//! `||p - D||^2 = ||p||^2 - ||p||_1^2 / n`, the least any ±c code can achieve.
//! A block holding NaN or ±Inf decodes to all NaN.

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{
    EncodeCtx, MAX_BLOCK, Scheme, block_only_codec, block_params, check_block, check_code_padding,
    check_steps, read_block,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels;
use crate::wire::{HEADER_LEN, Header};

block_only_codec!(
    /// One sign bit per element with a per-block mean-|x| scale.
    Sign,
    Sign,
    default_block = 1024
);

impl Scheme for Sign {
    const ID: CodecId = CodecId::Sign;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Sign> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        h.seed_zero()?;
        let c = Sign {
            block,
            entropy: h.entropy(),
        };
        super::stage::expect_payload(h, &c)?;
        Ok(c)
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}

impl FixedRate for Sign {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        block_params(self.block, 0)
    }

    fn seeded(&self) -> bool {
        false
    }

    fn encode_weight(&self) -> usize {
        1
    }

    fn layout(&self) -> Layout {
        Layout {
            block: self.block as usize,
            scale_bytes: 4,
            bits: 1,
        }
    }

    fn encode_sections(
        &self,
        x: &[f32],
        _ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        kernels::encode_sign(x, self.block as usize, scales, codes)
    }

    fn validate(&self, h: &Header, scales: &[u8], codes: &[u8]) -> Result<()> {
        check_steps(h, scales, HEADER_LEN)?;
        check_code_padding(h, scales, codes, 1)
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        by_mode!(m, M => kernels::decode_sign::<M>(scales, codes, self.block as usize, out))
    }
}
