//! `fp16`: IEEE 754 binary16, 16 bits per element.
//!
//! Payload: `elements` × u16 LE binary16. Encoding rounds to nearest, ties to even,
//! exactly as `half::f16::from_f32` (tested on all 2^32 inputs).
//!
//! Error: relative error at most 2^-11 for |x| in the normal range [2^-14, 65504];
//! absolute error at most 2^-25 below it (subnormals, flushed to ±0 under 2^-25).
//! Overflow: |x| that rounds above 65504 becomes ±Inf (a loss scaler sees it).
//! NaN stays a quiet NaN (top payload bits kept); ±Inf stays ±Inf.

use super::{EncodeCtx, Scheme, elementwise_codec, expect_payload};
use crate::codec::{CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels;
use crate::wire::Header;

/// IEEE binary16 with round-to-nearest-even.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fp16;

elementwise_codec!(
    Fp16,
    Fp16,
    2,
    encode = kernels::encode_f16,
    decode<M> = kernels::decode_f16::<M>,
    feedback = Some(kernels::feedback_f16),
    hop = Some(kernels::hop_f16)
);
