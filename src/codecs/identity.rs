//! `identity`: little-endian f32, the uncompressed baseline.
//!
//! Payload: `elements` × f32 LE. Lossless, bit for bit (NaN payloads included).
//! NaN and ±Inf pass through unchanged.

use super::{EncodeCtx, Scheme, elementwise_codec, expect_payload};
use crate::codec::{CodecId, CodecSpec};
use crate::error::Result;
use crate::kernels;
use crate::wire::Header;

/// The uncompressed baseline: 32 bits per element, exact.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Identity;

elementwise_codec!(
    Identity,
    Identity,
    4,
    encode = kernels::encode_f32,
    decode<M> = kernels::decode_f32::<M>,
    feedback = None,
    hop = None
);
