//! The codec layer: the [`Codec`] trait, [`EncodeCtx`], [`CodecId`] and [`CodecSpec`].
//!
//! A codec turns an f32 slice into a self-describing frame and back. The trait is object
//! safe (`Box<dyn Codec>` works) and knows nothing about transports. The hot-path methods
//! (`encode_into`, `decode_into`, `decode_add`) allocate nothing; `encode` and `decode`
//! are owning conveniences over them.

use core::fmt;
use core::str::FromStr;

use crate::codecs::{
    Bf16, ChunkTopK, Codebook, Dct, Fp4, Fp8, Fp16, Identity, Int8, Lossless, Natural, Qsgd, RandK,
    Sign, Ternary, TopK,
};
use crate::error::{Error, Result};
use crate::wire::{HEADER_LEN, Header};

pub use crate::codec_id::CodecId;

/// Per-call encoding context: the seed of the random draws and the global index of the
/// slice's first element.
///
/// Stochastic codecs draw the random number for element `i` of the slice from a hash of
/// `(seed, offset + i)`, so a tensor encoded whole or in chunks (each with its own offset)
/// draws the same numbers. Deterministic codecs ignore the seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeCtx {
    /// Seed of the random draws (change it every step to get fresh randomness).
    pub seed: u64,
    /// Global index of the slice's first element within its tensor.
    pub offset: u64,
}

impl EncodeCtx {
    /// A context with `seed` and offset 0.
    pub fn new(seed: u64) -> Self {
        EncodeCtx { seed, offset: 0 }
    }

    /// The same context for a chunk starting at global index `offset`.
    pub fn with_offset(self, offset: u64) -> Self {
        EncodeCtx { offset, ..self }
    }
}

/// The owning decode helpers refuse frames that would allocate more than this many
/// elements per frame byte (at least [`DECODE_MIN_LIMIT`] elements); see [`decode_limit`].
pub const DECODE_ELEMENTS_PER_BYTE: u64 = 4096;
/// Element count the owning decode helpers always accept.
pub const DECODE_MIN_LIMIT: u64 = 1 << 16;

/// The most elements `Codec::decode` and [`crate::decode_to_vec`] allocate for a frame of
/// `frame_len` bytes: `max(2^16, 4096 * frame_len)`, i.e. at most 16 KiB of f32 per frame
/// byte. Fixed-rate codecs never come close (at most 32 elements per byte, for `sign`);
/// only very sparse top-k / random-k frames can exceed it, and
/// [`crate::decode_to_vec_with_limit`] takes an explicit limit for those.
pub fn decode_limit(frame_len: usize) -> u64 {
    (frame_len as u64)
        .saturating_mul(DECODE_ELEMENTS_PER_BYTE)
        .max(DECODE_MIN_LIMIT)
}

/// A gradient codec: encode an f32 slice to a frame, decode a frame back.
///
/// Frames are self-describing (docs/wire-format.md): [`crate::decode`] reads any frame
/// with no configuration. A codec's `decode_into` accepts frames of its own codec id with
/// any valid parameters.
///
/// Every method validates its input and returns an [`Error`] instead of panicking.
/// On error, output slices may have been partly written by `encode_into` and
/// `decode_into`, but `decode_add` never touches the accumulator unless it succeeds.
pub trait Codec: Send + Sync + fmt::Debug {
    /// The codec's id (byte 5 of its frames).
    fn id(&self) -> CodecId;

    /// The spec describing this codec and its parameters.
    fn spec(&self) -> CodecSpec;

    /// The buffer length that always suffices for `encode_into` of `n` elements: an upper
    /// bound on the frame length, plus, for `topk` with a ratio or count, working room
    /// for its one-pass selection (8 bytes per candidate, about `2k`; without the room,
    /// a buffer that fits the frame gives the same frame by a slower, multi-pass route),
    /// and, for a codec with the entropy stage, room for its code section before it is
    /// entropy-coded.
    fn max_encoded_len(&self, n: usize) -> usize;

    /// Encode `x` into `out`, returning the frame length. Allocates nothing. Bytes of `out`
    /// past the frame are left as they were, except that `topk` and the codecs with the
    /// entropy stage use those past their largest possible frame as working room, and
    /// `lossless` those up to its largest possible frame (it keeps its exponents there
    /// while it codes them).
    ///
    /// Errors if `out` is shorter than the frame needs, or if `ctx.offset + x.len()`
    /// overflows, or a codec-specific limit is exceeded (documented per codec).
    fn encode_into(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<usize>;

    /// Decode `frame` into `out`, which must have exactly the frame's element count.
    fn decode_into(&self, frame: &[u8], out: &mut [f32]) -> Result<()>;

    /// Decode `frame` and add it element-wise to `acc` (the reduce step of a collective).
    /// The frame is fully validated before `acc` is touched.
    fn decode_add(&self, frame: &[u8], acc: &mut [f32]) -> Result<()>;

    /// Check that `encode_into` of `n` elements with `ctx` cannot fail given a buffer of
    /// `max_encoded_len(n)` bytes (the offset does not overflow, codec limits hold).
    fn check_encode(&self, n: usize, ctx: &EncodeCtx) -> Result<()> {
        if ctx.offset.checked_add(n as u64).is_none() {
            return Err(Error::Param {
                codec: self.id(),
                name: "offset",
                reason: format!("offset {} + {n} elements overflows u64", ctx.offset),
            });
        }
        Ok(())
    }

    /// Encode `x` into a new vector (owning convenience over `encode_into`).
    fn encode(&self, x: &[f32], ctx: &EncodeCtx) -> Result<Vec<u8>> {
        self.check_encode(x.len(), ctx)?;
        let mut out = crate::alloc::filled(self.max_encoded_len(x.len()), 0u8, "the frame")?;
        let len = self.encode_into(x, ctx, &mut out)?;
        out.truncate(len);
        Ok(out)
    }

    /// Decode `frame` into a new vector. Refuses frames claiming more than
    /// [`decode_limit`]`(frame.len())` elements.
    fn decode(&self, frame: &[u8]) -> Result<Vec<f32>> {
        let (h, _) = crate::wire::split(frame)?;
        if h.codec != self.id() {
            return Err(Error::WrongCodec {
                expected: self.id(),
                found: h.codec,
            });
        }
        let limit = decode_limit(frame.len());
        if h.elements > limit {
            return Err(Error::TooLarge {
                elements: h.elements,
                limit,
            });
        }
        crate::codecs::spec_from_header(&h)?;
        let n = usize::try_from(h.elements).map_err(|_| Error::TooLarge {
            elements: h.elements,
            limit: usize::MAX as u64,
        })?;
        let mut out = crate::alloc::filled(n, 0f32, "the decoded frame")?;
        self.decode_into(frame, &mut out)?;
        Ok(out)
    }
}

/// A parsed codec description, e.g. `int8:block=256,rounding=stochastic`.
///
/// `CodecSpec` is itself a [`Codec`] (it delegates to the concrete codec), so a spec
/// parsed from a command line or config file can be used directly without boxing.
///
/// Grammar: `name` or `name:key=value[,key=value]...`. Keys not given take their
/// defaults. `Display` prints the canonical form with every parameter, which parses back
/// to an equal spec.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum CodecSpec {
    /// See [`Identity`].
    Identity(Identity),
    /// See [`Fp16`].
    Fp16(Fp16),
    /// See [`Bf16`].
    Bf16(Bf16),
    /// See [`Int8`].
    Int8(Int8),
    /// See [`Qsgd`].
    Qsgd(Qsgd),
    /// See [`Sign`].
    Sign(Sign),
    /// See [`Ternary`].
    Ternary(Ternary),
    /// See [`Natural`].
    Natural(Natural),
    /// See [`TopK`].
    TopK(TopK),
    /// See [`RandK`].
    RandK(RandK),
    /// See [`Dct`].
    Dct(Dct),
    /// See [`Fp8`].
    Fp8(Fp8),
    /// See [`Fp4`].
    Fp4(Fp4),
    /// See [`Codebook`].
    Codebook(Codebook),
    /// See [`ChunkTopK`].
    ChunkTopK(ChunkTopK),
    /// See [`Lossless`].
    Lossless(Lossless),
}

macro_rules! each_spec {
    ($self:expr, $c:ident => $e:expr) => {
        match $self {
            CodecSpec::Identity($c) => $e,
            CodecSpec::Fp16($c) => $e,
            CodecSpec::Bf16($c) => $e,
            CodecSpec::Int8($c) => $e,
            CodecSpec::Qsgd($c) => $e,
            CodecSpec::Sign($c) => $e,
            CodecSpec::Ternary($c) => $e,
            CodecSpec::Natural($c) => $e,
            CodecSpec::TopK($c) => $e,
            CodecSpec::RandK($c) => $e,
            CodecSpec::Dct($c) => $e,
            CodecSpec::Fp8($c) => $e,
            CodecSpec::Fp4($c) => $e,
            CodecSpec::Codebook($c) => $e,
            CodecSpec::ChunkTopK($c) => $e,
            CodecSpec::Lossless($c) => $e,
        }
    };
}
pub(crate) use each_spec;

impl CodecSpec {
    /// Parse a spec string (same as `str::parse`).
    pub fn parse(s: &str) -> Result<CodecSpec> {
        let (name, rest) = match s.split_once(':') {
            Some((n, r)) => (n.trim(), Some(r)),
            None => (s.trim(), None),
        };
        let spec_err = |reason: String| Error::Spec {
            spec: s.to_string(),
            reason,
        };
        let mut args = Args::parse(rest).map_err(&spec_err)?;
        let id = CodecId::ALL
            .iter()
            .copied()
            .find(|id| id.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = CodecId::ALL.iter().map(|c| c.name()).collect();
                spec_err(format!(
                    "unknown codec {name:?}; accepted: {}",
                    names.join(", ")
                ))
            })?;
        let spec = match id {
            CodecId::Identity => CodecSpec::Identity(Identity),
            CodecId::Fp16 => CodecSpec::Fp16(Fp16),
            CodecId::Bf16 => CodecSpec::Bf16(Bf16),
            CodecId::Int8 => CodecSpec::Int8(Int8::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Qsgd => CodecSpec::Qsgd(Qsgd::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Sign => CodecSpec::Sign(Sign::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Ternary => {
                CodecSpec::Ternary(Ternary::from_args(&mut args).map_err(&spec_err)?)
            }
            CodecId::Natural => {
                CodecSpec::Natural(Natural::from_args(&mut args).map_err(&spec_err)?)
            }
            CodecId::TopK => CodecSpec::TopK(TopK::from_args(&mut args).map_err(&spec_err)?),
            CodecId::RandK => CodecSpec::RandK(RandK::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Dct => CodecSpec::Dct(Dct::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Fp8 => CodecSpec::Fp8(Fp8::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Fp4 => CodecSpec::Fp4(Fp4::from_args(&mut args).map_err(&spec_err)?),
            CodecId::Codebook => {
                CodecSpec::Codebook(Codebook::from_args(&mut args).map_err(&spec_err)?)
            }
            CodecId::ChunkTopK => {
                CodecSpec::ChunkTopK(ChunkTopK::from_args(&mut args).map_err(&spec_err)?)
            }
            CodecId::Lossless => {
                CodecSpec::Lossless(Lossless::from_args(&mut args).map_err(&spec_err)?)
            }
        };
        args.finish(name).map_err(&spec_err)?;
        Ok(spec)
    }

    /// The spec that decodes a frame with this header, as far as the header tells it
    /// (top-k frames record `k`, not the ratio that chose it).
    pub fn from_header(h: &Header) -> Result<CodecSpec> {
        crate::codecs::spec_from_header(h)
    }

    /// Whether the spec has the entropy stage (`entropy=on`): its code section is
    /// entropy-coded, so its frames' lengths depend on the data.
    pub fn entropy(&self) -> bool {
        match self {
            CodecSpec::Int8(c) => c.entropy(),
            CodecSpec::Qsgd(c) => c.entropy(),
            CodecSpec::Sign(c) => c.entropy(),
            CodecSpec::Ternary(c) => c.entropy(),
            CodecSpec::Natural(c) => c.entropy(),
            CodecSpec::Fp8(c) => c.entropy(),
            CodecSpec::Fp4(c) => c.entropy(),
            CodecSpec::Codebook(c) => c.entropy(),
            _ => false,
        }
    }

    /// The same spec with the entropy stage on or off; an error for a codec without a
    /// stage (identity, fp16, bf16, the sparse codecs, dct and lossless) when `on`, or a
    /// block too large for it.
    pub fn with_entropy(self, on: bool) -> Result<CodecSpec> {
        Ok(match self {
            CodecSpec::Int8(c) => c.with_entropy(on)?.into(),
            CodecSpec::Qsgd(c) => c.with_entropy(on)?.into(),
            CodecSpec::Sign(c) => c.with_entropy(on)?.into(),
            CodecSpec::Ternary(c) => c.with_entropy(on)?.into(),
            CodecSpec::Natural(c) => c.with_entropy(on)?.into(),
            CodecSpec::Fp8(c) => c.with_entropy(on)?.into(),
            CodecSpec::Fp4(c) => c.with_entropy(on)?.into(),
            CodecSpec::Codebook(c) => c.with_entropy(on)?.into(),
            c if !on => c,
            c => {
                return Err(Error::Param {
                    codec: c.id(),
                    name: "entropy",
                    reason: format!(
                        "{} has no entropy stage (the stage codes the byte codes of int8, \
                         qsgd, sign, ternary, natural, fp8, fp4 and codebook)",
                        c.id().name()
                    ),
                });
            }
        })
    }

    /// The concrete codec as a trait object.
    pub fn as_codec(&self) -> &dyn Codec {
        each_spec!(self, c => c)
    }

    /// Payload bits per element for a tensor of `n` elements (block scales included,
    /// the 56-byte header excluded). Exact for the fixed-rate codecs; for top-k an
    /// estimate (index gaps taken as `log2(n / k) + 1` bits), for random-k the expectation.
    pub fn bits_per_element(&self, n: usize) -> f64 {
        if n == 0 {
            return 0.0;
        }
        use crate::codecs::Scheme;
        each_spec!(self, c => c.expected_payload(n as u64)) * 8.0 / n as f64
    }

    /// An upper bound on `|decode(encode(x))[i] - x[i]|` for every element of any slice
    /// whose values are finite with `|x[i]| <= absmax`, for every seed, from each codec's
    /// own error analysis (its module docs):
    ///
    /// | codec | bound |
    /// |-------|-------|
    /// | identity | 0 |
    /// | fp16 | `2^-11 absmax + 2^-25` (half an ulp; the constant is half the smallest subnormal) |
    /// | bf16 | `2^-8 absmax + 2^-134` (half an ulp; the constant is half the smallest bf16 subnormal) |
    /// | int8 nearest / stochastic | `absmax / 254` / `absmax / 127` (half a step / a step), plus `2^-22 absmax` |
    /// | qsgd | `sqrt(block) absmax / s`: below one step of a block L2 norm, plus `2^-22 absmax` |
    /// | sign | `2 absmax`: `x` and `±mean|x|` differ by at most `|x| + mean|x|` |
    /// | ternary, natural, top-k, random-k (`scale=none`) | `absmax` (a dropped element, or a power-of-two neighbour) |
    /// | random-k (`scale=unbiased`) | `(1 + 2^-11) absmax * s` (`2^-8` with bf16 values), `s` the largest scale ([`crate::RandK::max_scale`]: `2^32 / t`, about `1 / ratio`) |
    /// | dct (f32, fp16 values) | `sqrt(T) absmax (1 + 2^-10)`, `T` the coefficients of a full tile: a tile's error is below its L2 norm |
    /// | dct (sign values) | `(1 + sqrt(k T)) absmax (1 + 2^-10)`: the input plus the decoded tile |
    ///
    /// A relative slack of `2^-20` covers the f32 arithmetic of the scales. int8 and qsgd
    /// add `2^-22 absmax` for the f32 rounding of the step, of `x / step` and of the
    /// decoded `q * step` (each up to `2^-24` of a value below `absmax`, far more than
    /// `2^-20` of a half step), and `2^-142` for steps in the subnormal range (which lose
    /// relative precision). The bound
    /// assumes no overflow: it is infinite when `absmax` exceeds the largest finite value
    /// of the codec's element type (65504 for fp16 and fp16-valued top-k / random-k, the
    /// bf16 maximum for bf16 and bf16-valued ones), and
    /// for unbiased random-k when `absmax * s` does (the scaled value overflows to Inf);
    /// for dct when a coefficient could overflow (`absmax` above `65504 / sqrt(T)` with
    /// fp16 values, else above `f32::MAX / (2 T sqrt(T))`).
    /// [`crate::collective::error_bound`] composes it over an all-reduce.
    pub fn error_bound(&self, absmax: f64) -> f64 {
        use crate::codecs::{RandKScale, Rounding, ValueType};
        const FP16_MAX: f64 = 65504.0;
        const BF16_MAX: f64 = 3.389_531_389_251_535_5e38;
        let a = absmax.abs();
        // The largest finite stored value and the relative rounding of a sparse codec's
        // values (f32 values are exact; 2^-11 covers them).
        let sparse = |v: ValueType, f32_max: f64| match v {
            ValueType::Fp16 => (FP16_MAX, 2f64.powi(-11)),
            ValueType::Bf16 => (BF16_MAX, 2f64.powi(-8)),
            _ => (f32_max, 2f64.powi(-11)),
        };
        let (factor, add, max) = match self {
            // Its own analysis (the module docs of `fp8`), with its f32 roundings.
            CodecSpec::Fp8(c) if a.is_finite() => return c.core().error_bound(a),
            CodecSpec::Fp4(c) if a.is_finite() => return c.core().error_bound(a),
            CodecSpec::Fp8(_) | CodecSpec::Fp4(_) => return f64::INFINITY,
            CodecSpec::Codebook(c) => {
                return if a.is_finite() {
                    c.error_bound(a)
                } else {
                    f64::INFINITY
                };
            }
            CodecSpec::ChunkTopK(c) => {
                return if a.is_finite() {
                    c.error_bound(a)
                } else {
                    f64::INFINITY
                };
            }
            CodecSpec::Identity(_) | CodecSpec::Lossless(_) => (0.0, 0.0, f64::INFINITY),
            CodecSpec::Fp16(_) => (2f64.powi(-11), 2f64.powi(-25), FP16_MAX),
            CodecSpec::Bf16(_) => (2f64.powi(-8), 2f64.powi(-134), BF16_MAX),
            // 2^-142 (about 127 halves of the smallest subnormal): a step absmax / 127 that
            // is subnormal or underflows to zero loses precision in absolute terms.
            CodecSpec::Int8(c) => match c.rounding() {
                Rounding::Nearest => (1.0 / 254.0, 2f64.powi(-142), f64::INFINITY),
                Rounding::Stochastic => (1.0 / 127.0, 2f64.powi(-142), f64::INFINITY),
            },
            CodecSpec::Qsgd(c) => (
                (c.block() as f64).sqrt() / c.levels() as f64,
                2f64.powi(-142),
                f64::INFINITY,
            ),
            CodecSpec::Sign(_) => (2.0, 0.0, f64::INFINITY),
            CodecSpec::Ternary(_) | CodecSpec::Natural(_) => (1.0, 0.0, f64::INFINITY),
            CodecSpec::TopK(c) => (1.0, 2f64.powi(-25), sparse(c.values(), f64::INFINITY).0),
            CodecSpec::RandK(c) => {
                let (max, rel) = sparse(c.values(), f32::MAX as f64);
                match c.scale() {
                    RandKScale::None => (1.0, 2f64.powi(-25), max),
                    // x times the scale (at most `max_scale`: 2^32 / t, or the longest
                    // stratum), then rounded: |x s - x| plus half an ulp of the value
                    // type. x s overflows the value type (to Inf) past max / s; the
                    // margin covers the f32 rounding of the scale.
                    RandKScale::Unbiased => {
                        let s = c.max_scale();
                        (
                            (1.0 + rel) * s,
                            2f64.powi(-25),
                            max / s * (1.0 - 2f64.powi(-20)),
                        )
                    }
                }
            }
            // The transform is orthonormal: dropping coefficients leaves a tile's error
            // below its L2 norm, at most sqrt(T) absmax for T coefficients. Sign values
            // add the decoded tile, at most sqrt(k) times a scale of at most sqrt(T)
            // absmax. fp16 coefficients overflow past 65504; every sum of the transforms
            // stays below 2 T sqrt(T) absmax, so f32 arithmetic cannot overflow below
            // f32::MAX / (2 T sqrt(T)).
            CodecSpec::Dct(c) => {
                use crate::codecs::DctValues;
                let tile = if c.width() == 0 {
                    c.chunk()
                } else {
                    c.chunk() * c.chunk()
                } as f64;
                let f32_max = f32::MAX as f64 / (2.0 * tile * tile.sqrt());
                match c.values() {
                    DctValues::F32 => (tile.sqrt() * (1.0 + 2f64.powi(-10)), 0.0, f32_max),
                    DctValues::Fp16 => (
                        tile.sqrt() * (1.0 + 2f64.powi(-10)),
                        2f64.powi(-20),
                        FP16_MAX / tile.sqrt() * (1.0 - 2f64.powi(-10)),
                    ),
                    _ => (
                        (1.0 + (c.k() as f64 * tile).sqrt()) * (1.0 + 2f64.powi(-10)),
                        0.0,
                        f32_max,
                    ),
                }
            }
        };
        if a > max || !a.is_finite() {
            return f64::INFINITY;
        }
        // The f32 rounding of a quantised value, its step and its level.
        let rounding = match self {
            CodecSpec::Int8(_) | CodecSpec::Qsgd(_) => 2f64.powi(-22) * a,
            _ => 0.0,
        };
        let scaled = factor * a;
        (scaled + add + rounding) * (1.0 + 2f64.powi(-20))
    }

    /// True for the codecs whose frames keep only some of the elements: top-k, random-k
    /// and chunked top-k. An all-reduce that re-encodes a sum of such frames keeps at
    /// most about `1/p` of what the `p` frames carried, so the automatic choice of
    /// strategy does not offer them the two-shot (it keeps its choice between the ring
    /// and the all-gather, which sums every rank's selection as sent); asked for by
    /// name, the two-shot runs them.
    pub fn sparse(&self) -> bool {
        matches!(
            self.id(),
            CodecId::TopK | CodecId::RandK | CodecId::ChunkTopK
        )
    }

    /// True when the decoded value is an unbiased estimate of the input.
    pub fn unbiased(&self) -> bool {
        {
            use crate::codecs::Scheme;
            each_spec!(self, c => c.is_unbiased())
        }
    }
}

impl FromStr for CodecSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<CodecSpec> {
        CodecSpec::parse(s)
    }
}

impl fmt::Display for CodecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        each_spec!(self, c => fmt::Display::fmt(c, f))
    }
}

impl Codec for CodecSpec {
    fn id(&self) -> CodecId {
        self.as_codec().id()
    }
    fn spec(&self) -> CodecSpec {
        *self
    }
    fn max_encoded_len(&self, n: usize) -> usize {
        self.as_codec().max_encoded_len(n)
    }
    fn encode_into(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<usize> {
        self.as_codec().encode_into(x, ctx, out)
    }
    fn decode_into(&self, frame: &[u8], out: &mut [f32]) -> Result<()> {
        self.as_codec().decode_into(frame, out)
    }
    fn decode_add(&self, frame: &[u8], acc: &mut [f32]) -> Result<()> {
        self.as_codec().decode_add(frame, acc)
    }
    fn check_encode(&self, n: usize, ctx: &EncodeCtx) -> Result<()> {
        self.as_codec().check_encode(n, ctx)
    }
}

/// Key-value arguments of a spec, consumed by the codec's `from_args`.
pub(crate) struct Args {
    pairs: Vec<(String, String, bool)>,
    accepted: Vec<&'static str>,
}

impl Args {
    fn parse(rest: Option<&str>) -> core::result::Result<Args, String> {
        let mut pairs: Vec<(String, String, bool)> = Vec::new();
        if let Some(rest) = rest {
            for item in rest.split(',') {
                let item = item.trim();
                let (k, v) = item
                    .split_once('=')
                    .ok_or_else(|| format!("expected key=value, found {item:?}"))?;
                let (k, v) = (k.trim(), v.trim());
                if k.is_empty() || v.is_empty() {
                    return Err(format!("expected key=value, found {item:?}"));
                }
                if pairs.iter().any(|(pk, _, _)| pk == k) {
                    return Err(format!("key `{k}` given twice"));
                }
                pairs.push((k.to_string(), v.to_string(), false));
            }
        }
        Ok(Args {
            pairs,
            accepted: Vec::new(),
        })
    }

    /// The value of `key`, if given (marks it as used).
    pub(crate) fn take(&mut self, key: &'static str) -> Option<String> {
        self.accepted.push(key);
        self.pairs
            .iter_mut()
            .find(|(k, _, _)| k == key)
            .map(|(_, v, used)| {
                *used = true;
                v.clone()
            })
    }

    /// Whether `key` is given (without using it).
    pub(crate) fn has(&self, key: &str) -> bool {
        self.pairs.iter().any(|(k, _, _)| k == key)
    }

    /// An unsigned integer in `range`, or `default`.
    pub(crate) fn uint(
        &mut self,
        key: &'static str,
        default: u64,
        range: core::ops::RangeInclusive<u64>,
    ) -> core::result::Result<u64, String> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => match v.parse::<u64>() {
                Ok(n) if range.contains(&n) => Ok(n),
                _ => Err(format!(
                    "`{key}={v}`: expected an integer in {}..={}",
                    range.start(),
                    range.end()
                )),
            },
        }
    }

    /// One of `choices`, or `default`.
    pub(crate) fn choice(
        &mut self,
        key: &'static str,
        default: &'static str,
        choices: &[&'static str],
    ) -> core::result::Result<&'static str, String> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => {
                choices.iter().copied().find(|c| *c == v).ok_or_else(|| {
                    format!("`{key}={v}`: accepted values are {}", choices.join(", "))
                })
            }
        }
    }

    /// A ratio in (0, 1].
    pub(crate) fn ratio(&mut self, key: &'static str) -> core::result::Result<Option<f64>, String> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => match v.parse::<f64>() {
                Ok(r) if r > 0.0 && r <= 1.0 => Ok(Some(r)),
                _ => Err(format!("`{key}={v}`: expected a number in (0, 1]")),
            },
        }
    }

    fn finish(self, name: &str) -> core::result::Result<(), String> {
        if let Some((k, _, _)) = self.pairs.iter().find(|(_, _, used)| !used) {
            if k == "entropy" {
                return Err(format!(
                    "{name} has no entropy stage: `entropy=` applies to int8, qsgd, sign, \
                     ternary, natural, fp8, fp4 and codebook (for f32 sent exactly, use \
                     lossless)"
                ));
            }
            let acc = if self.accepted.is_empty() {
                format!("{name} takes no parameters")
            } else {
                format!("accepted keys for {name}: {}", self.accepted.join(", "))
            };
            return Err(format!("unknown key `{k}`; {acc}"));
        }
        Ok(())
    }
}

/// Check that `out` holds `need` bytes (header included).
pub(crate) fn need_bytes(out: &[u8], need: u64) -> Result<()> {
    if (out.len() as u64) < need {
        return Err(Error::BufferTooSmall {
            needed: usize::try_from(need).unwrap_or(usize::MAX),
            got: out.len(),
        });
    }
    Ok(())
}

/// Split an encode buffer into header and payload, checking it holds `payload` bytes.
pub(crate) fn payload_buf(out: &mut [u8], payload: u64) -> Result<&mut [u8]> {
    need_bytes(out, HEADER_LEN as u64 + payload)?;
    Ok(&mut out[HEADER_LEN..HEADER_LEN + payload as usize])
}

/// One representative spec per codec family (and the common variants): what
/// `gradpack report` and the trade-off benchmark measure by default.
pub const REPRESENTATIVE_SPECS: &[&str] = &[
    "fp16",
    "bf16",
    "fp8",
    "fp4",
    "fp4:scale=e4m3",
    "fp4:entropy=on",
    "codebook",
    "int8",
    "int8:entropy=on",
    "int8:rounding=stochastic",
    "qsgd:bits=8",
    "qsgd:bits=4",
    "qsgd:bits=2",
    "natural",
    "ternary",
    "sign",
    "topk:ratio=0.01,values=fp16",
    "chunktopk",
    "randk:ratio=0.01",
    "randk:ratio=0.01,select=strata",
    "dct:k=4,values=sign",
    "lossless",
];

/// A codec whose frames carry a payload checksum: `Checksummed(codec)` encodes as `codec`
/// and then [`crate::wire::seal`]s the frame (4 more bytes). Decoding verifies the
/// checksum, so a payload corrupted in transit is rejected with
/// [`Error::PayloadChecksum`] instead of decoding to a silently different gradient.
///
/// Any decoder accepts sealed frames (the checksum is checked whenever the header's
/// `PAYLOAD_CRC` flag is set); this wrapper's decoders also accept unsealed ones. The
/// header itself is always covered by its own CRC-32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Checksummed<C>(pub C);

impl<C: Codec> Codec for Checksummed<C> {
    fn id(&self) -> CodecId {
        self.0.id()
    }
    fn spec(&self) -> CodecSpec {
        self.0.spec()
    }
    fn max_encoded_len(&self, n: usize) -> usize {
        crate::wire::sealed_len(self.0.max_encoded_len(n))
    }
    fn encode_into(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<usize> {
        let limit = out.len().saturating_sub(crate::wire::PAYLOAD_CRC_LEN);
        let len = match self.0.encode_into(x, ctx, &mut out[..limit]) {
            Err(Error::BufferTooSmall { needed, .. }) => {
                return Err(Error::BufferTooSmall {
                    needed: crate::wire::sealed_len(needed),
                    got: out.len(),
                });
            }
            r => r?,
        };
        crate::wire::seal(out, len)
    }
    fn decode_into(&self, frame: &[u8], out: &mut [f32]) -> Result<()> {
        self.0.decode_into(frame, out)
    }
    fn decode_add(&self, frame: &[u8], acc: &mut [f32]) -> Result<()> {
        self.0.decode_add(frame, acc)
    }
    fn check_encode(&self, n: usize, ctx: &EncodeCtx) -> Result<()> {
        self.0.check_encode(n, ctx)
    }
}
