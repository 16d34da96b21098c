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

use super::{
    EncodeCtx, Encoded, MAX_BLOCK, Scheme, block_only_codec, block_params, block_payload,
    check_block, expect_payload, read_block,
};
use crate::codec::{Args, CodecId, CodecSpec, payload_buf};
use crate::error::Result;
use crate::kernels;
use crate::wire::{self, HEADER_LEN, Header};

block_only_codec!(
    /// One sign bit per element with a per-block mean-|x| scale.
    Sign,
    Sign,
    default_block = 1024
);

impl Scheme for Sign {
    const ID: CodecId = CodecId::Sign;

    fn max_payload(&self, n: u64) -> u64 {
        block_payload(n, self.block as u64, 4, 1).unwrap_or(u64::MAX)
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        let len = self.max_payload(x.len() as u64);
        let p = payload_buf(out, len)?;
        let nb = x.len().div_ceil(self.block as usize);
        let (steps, codes) = p.split_at_mut(4 * nb);
        let nonfinite = kernels::encode_sign(x, self.block as usize, steps, codes);
        Ok(Encoded {
            payload_len: len,
            params: block_params(self.block, 0),
            nonfinite,
            seed: 0,
        })
    }

    fn read(h: &Header) -> Result<Sign> {
        let block = read_block(h)? as u32;
        h.params_zero_from(4)?;
        h.seed_zero()?;
        expect_payload(h, block_payload(h.elements, block as u64, 4, 1))?;
        Ok(Sign { block })
    }

    fn decode_payload<const ADD: bool>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        let nb = out.len().div_ceil(self.block as usize);
        let (steps, codes) = p.split_at(4 * nb);
        if !codes.is_empty() {
            wire::check_padding(h.codec, codes, HEADER_LEN + 4 * nb, h.elements, 1)?;
        }
        kernels::decode_sign::<ADD>(steps, codes, self.block as usize, out);
        Ok(())
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}
