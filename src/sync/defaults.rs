//! What a front end's fixed codec does when its caller names no strategy and no choice
//! of error feedback: one rule for every front end (the PyTorch hook asks these).

use crate::codec::CodecSpec;
use crate::cost::Strategy;

/// Whether a tensor sent with `codec` gets error feedback: never for `identity`
/// (float32 drops nothing); `choice` when given; else exactly for the codecs that drop
/// or flatten so much of each step's gradient that training needs the residual back
/// (`topk`, `chunktopk`, `sign`).
pub fn wants_feedback(codec: &CodecSpec, choice: Option<bool>) -> bool {
    match (codec, choice) {
        (CodecSpec::Identity(_), _) => false,
        (_, Some(on)) => on,
        (CodecSpec::TopK(_) | CodecSpec::ChunkTopK(_) | CodecSpec::Sign(_), None) => true,
        (_, None) => false,
    }
}

/// The strategy a fixed `codec` runs by at `world` ranks when none is named: float32's
/// ring for `identity`; the compressed ring from 3 ranks up for the quantisers (`fp16`,
/// `bf16`, `int8`, `qsgd`, `natural`, `ternary`, `fp8`, `fp4`, `codebook`), whose partial
/// sums re-encode with an error as bounded as the first encode's and which the ring moves
/// in `2 (p - 1) / p` frames per rank where the all-gather moves `p - 1`; else (2 ranks,
/// and the sparse and transform codecs, whose re-encoded sums would select again) the
/// all-gather.
pub fn default_strategy(codec: &CodecSpec, world: usize) -> Strategy {
    match codec {
        CodecSpec::Identity(_) => Strategy::Fp32Ring,
        CodecSpec::Fp16(_)
        | CodecSpec::Bf16(_)
        | CodecSpec::Int8(_)
        | CodecSpec::Qsgd(_)
        | CodecSpec::Natural(_)
        | CodecSpec::Ternary(_)
        | CodecSpec::Fp8(_)
        | CodecSpec::Fp4(_)
        | CodecSpec::Codebook(_)
            if world >= 3 =>
        {
            Strategy::CompressedRing
        }
        _ => Strategy::CompressedAllGather,
    }
}
