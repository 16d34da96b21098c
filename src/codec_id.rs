//! [`CodecId`]: the byte that names a frame's codec. It sits below the error type and the
//! wire format, which both name codecs, and depends on nothing in the crate.

use core::fmt;

/// Codec ids as written in byte 5 of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
#[non_exhaustive]
pub enum CodecId {
    /// Plain little-endian f32.
    Identity = 0,
    /// IEEE binary16.
    Fp16 = 1,
    /// bfloat16.
    Bf16 = 2,
    /// int8 with a per-block absmax step.
    Int8 = 3,
    /// QSGD: stochastic levels of a per-block L2 norm.
    Qsgd = 4,
    /// One sign bit per element with a per-block mean-|x| step.
    Sign = 5,
    /// TernGrad: {-1, 0, +1} times a per-block absmax.
    Ternary = 6,
    /// Natural compression: stochastic rounding to powers of two.
    Natural = 7,
    /// Top-k by magnitude with delta-coded indices.
    TopK = 8,
    /// Random-k with hash-derived indices.
    RandK = 9,
    /// Top-k coefficients of a chunked DCT-II.
    Dct = 10,
    /// OCP 8-bit floats (E4M3, E5M2) with a per-block scale.
    Fp8 = 11,
    /// 4-bit floats (E2M1, E3M0) with a per-block scale.
    Fp4 = 12,
    /// int8 codes into a per-block codebook of bin means.
    Codebook = 13,
    /// The top k of every chunk with 2-bit values (SparseLoCo's layout).
    ChunkTopK = 14,
    /// f32 with entropy-coded exponents, exact.
    Lossless = 15,
}

impl CodecId {
    /// Every codec id, in id order.
    pub const ALL: [CodecId; 16] = [
        CodecId::Identity,
        CodecId::Fp16,
        CodecId::Bf16,
        CodecId::Int8,
        CodecId::Qsgd,
        CodecId::Sign,
        CodecId::Ternary,
        CodecId::Natural,
        CodecId::TopK,
        CodecId::RandK,
        CodecId::Dct,
        CodecId::Fp8,
        CodecId::Fp4,
        CodecId::Codebook,
        CodecId::ChunkTopK,
        CodecId::Lossless,
    ];

    /// The id for byte value `b`, if one exists.
    pub fn from_u8(b: u8) -> Option<CodecId> {
        CodecId::ALL.get(b as usize).copied()
    }

    /// The name used in specs (`"int8"`, `"topk"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CodecId::Identity => "identity",
            CodecId::Fp16 => "fp16",
            CodecId::Bf16 => "bf16",
            CodecId::Int8 => "int8",
            CodecId::Qsgd => "qsgd",
            CodecId::Sign => "sign",
            CodecId::Ternary => "ternary",
            CodecId::Natural => "natural",
            CodecId::TopK => "topk",
            CodecId::RandK => "randk",
            CodecId::Dct => "dct",
            CodecId::Fp8 => "fp8",
            CodecId::Fp4 => "fp4",
            CodecId::Codebook => "codebook",
            CodecId::ChunkTopK => "chunktopk",
            CodecId::Lossless => "lossless",
        }
    }
}

impl fmt::Display for CodecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
