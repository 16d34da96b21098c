//! `bf16`: bfloat16 (the top 16 bits of an f32, rounded), 16 bits per element.
//!
//! Payload: `elements` × u16 LE bfloat16. Encoding rounds to nearest, ties to even,
//! exactly as `half::bf16::from_f32` (tested on all 2^32 inputs); decoding is exact.
//!
//! Error: relative error at most 2^-8 for normal values; the f32 range is kept, so only
//! |x| that rounds above `f32::MAX` overflows (to ±Inf). NaN stays a quiet NaN;
//! ±Inf stays ±Inf.

use super::{EncodeCtx, Scheme, elementwise_codec, expect_payload};
use crate::codec::{CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels;
use crate::wire::Header;

/// bfloat16 with round-to-nearest-even.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bf16;

elementwise_codec!(
    Bf16,
    Bf16,
    2,
    encode = kernels::encode_bf16,
    decode<M> = kernels::decode_bf16::<M>,
    feedback = None,
    hop = None
);
