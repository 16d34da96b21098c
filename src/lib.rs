//! # gradpack
//!
//! Compression of the gradients that data-parallel training exchanges between workers.
//!
//! Each scheme is a [`Codec`]: it encodes an `f32` slice into a self-describing *frame*
//! (a 56-byte header and a payload, specified byte by byte in `docs/wire-format.md`) and
//! decodes it back, or adds it into an accumulator (`decode_add`, the reduce step of an
//! all-reduce). Any frame decodes with no configuration through [`decode`].
//!
//! | codec | bits/element | unbiased | scheme | parameters (default first) |
//! |-------|--------------|----------|--------|------------|
//! | `identity` | 32 | exact | plain f32 | |
//! | `fp16` | 16 | no (RNE) | IEEE binary16 | |
//! | `bf16` | 16 | no (RNE) | bfloat16 | |
//! | `fp8` | 8 + 32/block (f32 scale), 8 + 8/block (E8M0) | stochastic only | OCP FP8 E4M3 / E5M2 with a block scale | `format=e4m3` or `e5m2`; `block=128`; `scale=f32` `e8m0` `none`; `rounding=nearest` `stochastic` |
//! | `fp4` | 4 + 8/block (E8M0), 4 + 32/block (f32) | stochastic only | 4-bit floats: E2M1 (OCP MXFP4) or E3M0, two per byte, with a block scale | `format=e2m1` or `e3m0`; `block=32`; `scale=e8m0` `f32`; `rounding=nearest` `stochastic` |
//! | `codebook` | 8 + 8192/block | no | int8 codes into a per-block codebook of 256 bin means on mean ± 6 sd (INTELLECT-1) | `block=65536` |
//! | `int8` | 8 + 32/block | stochastic only | absmax int8 | `block=256` `rounding=nearest` or `stochastic` |
//! | `qsgd` | bits + 32/block | yes | QSGD (Alistarh et al. 2017) | `bits=2`, `4` or `8`; `block=512` |
//! | `sign` | 1 + 32/block | no | 1-bit SGD / signSGD | `block=1024` |
//! | `ternary` | 2 + 32/block | yes | TernGrad (Wen et al. 2017) | `block=1024` |
//! | `natural` | 8 + 8/block | yes | natural compression (Horváth et al. 2019) | `block=1024` |
//! | `topk` | sparse | no | top-k by magnitude, coded indices | `ratio=0.01` or `k=N` or `threshold=T`; `values=f32` `fp16` `bf16` `int8`; `select=exact` `approx`; `index=auto` `rice` `bitmap` `gaps` |
//! | `chunktopk` | 84 bytes per 4096 at the defaults (0.164) | no | the top k of every chunk, Elias-Fano positions, 2-bit values and a scale per chunk (SparseLoCo) | `chunk=4096`; `k=64` |
//! | `randk` | sparse, values only | `scale=unbiased` | random-k, hash-derived indices | `ratio=0.01`; `values=f32` `fp16` `bf16`; `scale=none` `unbiased`; `select=bernoulli` `strata` |
//! | `dct` | k (position + value) per tile | no | top-k of a chunked DCT-II (DeMo, Peng et al. 2024) | `chunk=64`; `k=4`; `values=f32` `fp16` `sign`; `scale=chunk` `frame`; `width=0` (along one row) or `W` (tiles of a `W`-wide matrix) |
//!
//! A spec is the codec's name, then `:` and comma-separated parameters:
//! `int8:block=128,rounding=stochastic`, `topk:ratio=0.001,values=fp16`.
//!
//! Beside the codecs, the sync engine sends matrices as PowerSGD factors
//! ([`sync::PowerSgd`], Vogels et al. 2019): two thin all-reduces instead of one of the
//! whole matrix ([`sync::PowerSgdBucket`] for a caller that runs the all-reduces itself),
//! and can give each matrix 2-D `dct` tiles ([`sync::Policy::dct_2d`]).
//!
//! ```
//! use gradpack::{Codec, CodecSpec, EncodeCtx};
//!
//! let grad: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * 1e-3).collect();
//! let codec: CodecSpec = "int8:block=256".parse()?;
//! let frame = codec.encode(&grad, &EncodeCtx::new(7))?;
//! assert!(frame.len() < grad.len() * 4 / 3);
//!
//! // Any frame decodes without knowing the codec.
//! let mut out = vec![0.0f32; grad.len()];
//! gradpack::decode(&frame, &mut out)?;
//! // ... or is summed into an accumulator, as an all-reduce does.
//! let mut acc = vec![1.0f32; grad.len()];
//! gradpack::decode_add(&frame, &mut acc)?;
//! # Ok::<(), gradpack::Error>(())
//! ```
//!
//! [`ErrorFeedback`] carries each step's compression error into the next (fused into the
//! encode pass), and [`parallel`] splits large tensors across rayon threads with
//! byte-identical results. [`collective`] all-reduces a tensor across ranks with any codec
//! over any transport (in-process threads, or MPI with feature `mpi`), binding every
//! message to its call so that faults end in errors, never in wrong sums. [`sync`] is the
//! whole-model engine a training loop embeds: the gradients of many tensors, bucketed,
//! compressed per a codec policy and all-reduced on a communication thread while the
//! backward pass goes on, with checkpointable state ([`state`]); [`outer`] is the outer
//! synchronisation of low-communication training. [`train`] runs
//! data-parallel SGD through it to show what each codec does to training.
//!
//! ## Where to start
//! - **Compressing tensors yourself** (your own transport or parameter server): a
//!   [`CodecSpec`] parsed from a string, [`Codec::encode_into`] and [`decode`] /
//!   [`decode_add`], with [`ErrorFeedback`] around the encoder for the biased codecs, and
//!   [`parallel`] for large tensors.
//! - **All-reducing one tensor across ranks**: [`collective::AllReduce`] over a
//!   [`collective::Transport`] (threads in one process with [`collective::local`], MPI
//!   with feature `mpi`, or your own), and [`cost`] to see whether a codec pays on your
//!   network before you run it.
//! - **A training loop**: [`sync::SyncEngine`] takes each tensor's gradient as the
//!   backward pass produces it, buckets, compresses and all-reduces them on a
//!   communication thread, and saves its state with your checkpoints. [`train`] is a
//!   complete small example. PyTorch (a DDP communication hook) and burn have their own
//!   packages in the repository, built on the same engine.
//! - **Low-communication training** (DiLoCo, streaming DiLoCo, SparseLoCo): workers
//!   train alone and [`outer::OuterSync`] all-reduces their compressed pseudo-gradients
//!   every `H` steps, in fragments overlapped with training, with an outer optimizer.
//!
//! ## Rules the crate keeps
//! - Scalar kernels ([`unstable::kernels::scalar`]) are the specification; every other path must
//!   match them to the bit.
//! - Random draws are a hash of `(seed, global element index)` ([`rng`]), so results do
//!   not depend on chunking or threads.
//! - Decoding trusts nothing: any byte string gives `Ok` or an [`Error`] naming the
//!   problem, never a panic; `decode_add` leaves the accumulator untouched on error.
//! - NaN and ±Inf in the input stay visible after decoding (per-codec policy in each
//!   codec's docs and in README.md), and set the header's NONFINITE flag.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod alloc;
pub mod codec;
mod codec_id;
pub mod codecs;
pub mod collective;
pub mod cost;
pub mod error;
pub mod feedback;
mod kernels;
pub mod outer;
pub mod parallel;
pub mod rng;
mod sample;
pub mod state;
pub mod sync;
pub mod synthetic;
pub mod train;
pub mod wire;

/// Internals exposed for gradpack's own tests, benchmarks and fuzz targets, with no
/// stability promise: they may change in any release. An embedder needs none of them
/// (backends are [`Backend`] and [`BackendKind`] at the crate root).
pub mod unstable {
    /// The hot loops by operation, their scalar oracle (`scalar`, the specification every
    /// backend must match bit for bit) and the backend dispatch.
    pub mod kernels {
        pub use crate::kernels::*;
    }
}

pub use codec::{Checksummed, Codec, CodecId, CodecSpec, EncodeCtx, decode_limit};
pub use codecs::{
    Bf16, ChunkTopK, Codebook, Dct, DctTransform, DctValues, FloatType, Fp4, Fp4Format, Fp4Scale,
    Fp8, Fp8Format, Fp8Scale, Fp16, Identity, IndexCoding, Int8, Lossless, Natural, Qsgd, RandK,
    RandKScale, RandKSelect, Rounding, ScaleRule, Selection, Sign, Ternary, TopK, TopKSelect,
    ValueType,
};
pub use error::{Error, Result};
pub use feedback::{ErrorFeedback, FeedbackOptions, Residual, ResidualPrecision};
pub use kernels::{Backend, BackendKind};
pub use wire::{HEADER_LEN, Header};

/// Decode any frame into `out`, which must hold exactly the frame's element count.
/// Needs no configuration: the header names the codec and its parameters.
pub fn decode(frame: &[u8], out: &mut [f32]) -> Result<()> {
    codecs::decode_frame::<{ kernels::mode::WRITE }>(frame, out)
}

/// Decode any frame and add it element-wise into `acc` (length = the frame's element
/// count). The frame is fully validated first: on error `acc` is unchanged.
pub fn decode_add(frame: &[u8], acc: &mut [f32]) -> Result<()> {
    codecs::decode_frame::<{ kernels::mode::ADD }>(frame, acc)
}

/// The fused reduction of many frames of one tensor: `out` becomes the sum, in list
/// order, of every frame decoded, bit-identical to [`decode`] of the first frame
/// followed by [`decode_add`] of each of the others (on every backend), but in one pass
/// over `out` instead of one per frame.
///
/// The frames may be of any codecs, all of `out.len()` elements. Runs of fixed-rate
/// frames (identity, fp16, bf16, int8, qsgd, sign, ternary, natural) are decoded tile by
/// tile, every frame's codes for a tile added into it while it is in cache, on all of
/// the pool's threads for large tensors; sparse and `dct` frames are added whole in
/// their place in the order (a sparse frame touches only its kept elements, in index
/// order). With no frames, `out` is zeroed.
///
/// # Errors
/// [`Error::InFrame`] naming the frame's position. Every frame's header (and sealed
/// payload checksum), codec parameters, payload length and element count, and every
/// fixed-rate payload, are checked before `out` is written, so those errors leave it
/// unchanged; a sparse or `dct` payload is checked as it is decoded, and an error there
/// leaves `out` holding the sum of the frames before it.
///
/// ```
/// use gradpack::{Codec, CodecSpec, EncodeCtx};
///
/// let codec: CodecSpec = "int8".parse()?;
/// let frames: Vec<Vec<u8>> = (0..4)
///     .map(|r| {
///         let g: Vec<f32> = (0..1000).map(|i| ((i * (r + 1)) as f32).sin()).collect();
///         codec.encode(&g, &EncodeCtx::new(r as u64))
///     })
///     .collect::<Result<_, _>>()?;
/// let mut sum = vec![0.0f32; 1000];
/// gradpack::reduce_frames(&frames, &mut sum)?;
///
/// let mut one_by_one = vec![0.0f32; 1000];
/// gradpack::decode(&frames[0], &mut one_by_one)?;
/// for f in &frames[1..] {
///     gradpack::decode_add(f, &mut one_by_one)?;
/// }
/// assert_eq!(sum, one_by_one); // to the bit
/// # Ok::<(), gradpack::Error>(())
/// ```
pub fn reduce_frames<F: AsRef<[u8]>>(frames: &[F], out: &mut [f32]) -> Result<()> {
    reduce_any::<{ kernels::mode::WRITE }, F>(frames, out)
}

/// As [`reduce_frames`], but every frame is added into `acc` (bit-identical to
/// [`decode_add`] of each frame in order).
pub fn reduce_frames_add<F: AsRef<[u8]>>(frames: &[F], acc: &mut [f32]) -> Result<()> {
    reduce_any::<{ kernels::mode::ADD }, F>(frames, acc)
}

fn reduce_any<const M: u8, F: AsRef<[u8]>>(frames: &[F], out: &mut [f32]) -> Result<()> {
    kernels::Standard::run(|| reduce_any_standard::<M, F>(frames, out))
}

fn reduce_any_standard<const M: u8, F: AsRef<[u8]>>(frames: &[F], out: &mut [f32]) -> Result<()> {
    let in_frame = |index: usize, e: Error| Error::InFrame {
        index,
        source: Box::new(e),
    };
    let mut split = codecs::reduce::frame_list(frames.len())?;
    for (q, f) in frames.iter().enumerate() {
        split.push(wire::split(f.as_ref()).map_err(|e| in_frame(q, e))?);
    }
    codecs::reduce::reduce_split::<M>(&split, out).map_err(|(q, e)| in_frame(q, e))
}

/// Decode any frame into a new vector, allocating at most [`decode_limit`]`(frame.len())`
/// elements: 16 KiB of output per frame byte, at least 256 KiB (a frame claiming more
/// is refused before any allocation).
///
/// That bound is what a valid frame of a sparse codec can need, so it is loose for an
/// untrusted frame: a valid 192 KiB `dct` frame decodes to 1 GiB. A caller decoding
/// single frames from an untrusted source should pass its own limit to
/// [`decode_to_vec_with_limit`] (the element count it expects), and frames of very
/// sparse codecs (`chunktopk` with one value per chunk of 28,673 or more, `topk` and
/// `randk` keeping very few) need a limit above the default.
pub fn decode_to_vec(frame: &[u8]) -> Result<Vec<f32>> {
    decode_to_vec_with_limit(frame, decode_limit(frame.len()))
}

/// Decode any frame into a new vector of at most `max_elements` elements.
///
/// The whole header and the payload length its codec implies are checked first, so a
/// frame claiming more elements than its bytes can hold is refused before any memory is
/// asked for, and memory that cannot be had is an [`Error::OutOfMemory`], not an abort.
pub fn decode_to_vec_with_limit(frame: &[u8], max_elements: u64) -> Result<Vec<f32>> {
    let (h, _) = wire::split(frame)?;
    if h.elements > max_elements {
        return Err(Error::TooLarge {
            elements: h.elements,
            limit: max_elements,
        });
    }
    codecs::spec_from_header(&h)?;
    let n = usize::try_from(h.elements).map_err(|_| Error::TooLarge {
        elements: h.elements,
        limit: usize::MAX as u64,
    })?;
    let mut out = alloc::filled(n, 0f32, "the decoded frame")?;
    decode(frame, &mut out)?;
    Ok(out)
}

/// Parse and fully validate a frame's header, returning it with the codec spec it
/// describes (as far as a header can: top-k records `k`, not the ratio that chose it).
pub fn inspect(frame: &[u8]) -> Result<(Header, CodecSpec)> {
    let (h, _) = wire::split(frame)?;
    let spec = CodecSpec::from_header(&h)?;
    Ok((h, spec))
}

/// The README's code blocks are compiled as doctests, so its example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
