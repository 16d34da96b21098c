//! `ternary`: TernGrad (Wen et al. 2017), each element becomes -1, 0 or +1 times a
//! per-block absmax.
//!
//! For each block, `step = m = max |x|`; an element is sent as `sign(x)` with probability
//! `|x| / m` and as 0 otherwise, so `E[x'] = x` (to within `m * 2^-24`) and the variance
//! is `|x| * (m - |x|) <= m^2 / 4` per element. Codes are 2-bit sign-magnitude
//! (`00` 0, `01` +1, `11` -1; `10` is a negative zero and decodes to 0).
//! A block holding NaN or ±Inf decodes to all NaN.

use super::{
    EncodeCtx, Encoded, MAX_BLOCK, Scheme, block_only_codec, block_params, block_payload,
    check_block, decode_signmag, encode_signmag, expect_payload, read_block,
};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels::scalar::Measure;
use crate::wire::Header;

block_only_codec!(
    /// TernGrad with a per-block absmax scale.
    Ternary,
    Ternary,
    default_block = 1024
);

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
