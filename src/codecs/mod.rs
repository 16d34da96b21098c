//! One file per compression scheme. A codec file is mostly parameters and layout: the
//! arithmetic lives in the crate's kernels, shared by every codec.
//!
//! Every concrete codec implements the crate-private, sealed `Scheme` trait, and a blanket
//! impl turns each into a [`Codec`]. That keeps header writing, validation order and
//! the decode/decode_add split in one place.

mod bf16;
mod chunktopk;
mod codebook;
mod dct;
pub(crate) mod fixed;
mod fp16;
mod fp4;
mod fp8;
mod identity;
mod int8;
mod lossless;
mod natural;
mod qsgd;
mod randk;
pub(crate) mod reduce;
mod sign;
pub(crate) mod stage;
mod ternary;
mod topk;
mod values;

pub use bf16::Bf16;
pub use chunktopk::ChunkTopK;
pub use codebook::Codebook;
pub use dct::{Dct, DctTransform, DctValues};
pub use fp4::{Fp4, Fp4Format, Fp4Scale};
pub use fp8::{Fp8, Fp8Format, Fp8Scale, ScaleRule};
pub use fp16::Fp16;
pub use identity::Identity;
pub use int8::{Int8, Rounding};
pub use lossless::{FloatType, Lossless};
pub use natural::Natural;
pub use qsgd::Qsgd;
pub use randk::{RandK, RandKScale, RandKSelect};
pub use sign::Sign;
pub use ternary::Ternary;
pub use topk::{DEFAULT_TOLERANCE, IndexCoding, Selection, TopK, TopKSelect};
pub use values::{INT8_VALUE_BLOCK, ValueType};

use crate::codec::{Codec, CodecId, CodecSpec, EncodeCtx, each_spec, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::{Standard, mode, scalar::put};
use crate::wire::{self, HEADER_LEN, Header};
pub(crate) use scheme::{Encoded, Scheme};

/// Largest block size any block codec accepts (2^24, so a block length is exact in f32).
pub const MAX_BLOCK: u32 = 1 << 24;

pub(crate) mod scheme {
    use super::*;

    /// What a scheme's encoder reports besides the payload bytes.
    #[derive(Debug, Clone, Copy)]
    pub struct Encoded {
        /// Payload bytes written.
        pub payload_len: u64,
        /// Codec parameters for header bytes 40..52.
        pub params: [u8; 12],
        /// The input held NaN or ±Inf.
        pub nonfinite: bool,
        /// Seed to record (0 for codecs that draw nothing).
        pub seed: u64,
        /// The code section is entropy-coded (the frame's ENTROPY flag).
        pub entropy: bool,
    }

    /// The per-codec part of a codec (sealed: not nameable outside the crate).
    pub trait Scheme:
        Copy + core::fmt::Debug + core::fmt::Display + Send + Sync + Into<CodecSpec>
    {
        /// Byte 5 of this codec's frames.
        const ID: CodecId;
        /// Whether the codec takes the entropy stage (its frames may carry the ENTROPY
        /// flag).
        const STAGE: bool = false;
        /// Codec-specific limits on the element count an encoder accepts.
        fn check_elements(&self, _n: u64) -> Result<()> {
            Ok(())
        }
        /// Upper bound on payload bytes for `n` elements (saturating).
        fn max_payload(&self, n: u64) -> u64;
        /// Encode `x` into the payload area `out[HEADER_LEN..]` (use `payload_buf`).
        fn encode_payload(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded>;
        /// Form the error-feedback input `r = beta r + gamma g` in place and encode it, as
        /// `encode_payload` would encode the formed `r`. A codec may fuse the two passes,
        /// and may also leave in `r` the residual that decoding the frame onto it in
        /// residual mode would: it then returns true, and the frame is not decoded.
        fn encode_formed(
            &self,
            r: &mut [f32],
            (g, beta, gamma): (&[f32], f32, f32),
            ctx: &EncodeCtx,
            out: &mut [u8],
        ) -> Result<(Encoded, bool)> {
            crate::parallel::feedback_form(r, g, beta, gamma);
            Ok((self.encode_payload(r, ctx, out)?, false))
        }
        /// The codec described by a header: validates params, seed and payload length.
        fn read(h: &Header) -> Result<Self>;
        /// Decode a payload already checked by `read` into `out` (`out.len() == elements`).
        /// Must validate anything left before writing to `out`.
        fn decode_payload<const M: u8>(
            &self,
            h: &Header,
            payload: &[u8],
            out: &mut [f32],
        ) -> Result<()>;
        /// Expected payload bytes for `n` elements (exact for fixed-rate codecs).
        fn expected_payload(&self, n: u64) -> f64 {
            self.max_payload(n) as f64
        }
        /// Whether the decoded value is an unbiased estimate of the input.
        fn is_unbiased(&self) -> bool;
        /// The fixed-rate structure (ranges of whole blocks encode and decode
        /// independently), if the codec has one; `None` for the sparse codecs.
        fn fixed(&self) -> Option<&dyn super::fixed::FixedRate> {
            None
        }
        /// The fixed-rate structure, with or without the entropy stage (whose error
        /// feedback runs the same tiles, then codes the code section).
        fn ranges(&self) -> Option<&dyn super::fixed::FixedRate> {
            None
        }
        /// The codec that encodes `x`: itself, except for a codec whose frames carry a
        /// value taken from the whole input (fp4's E4M3 block scales are relative to the
        /// frame's largest magnitude), which takes it from `x` here.
        fn for_input(&self, _x: &[f32]) -> Self {
            *self
        }
        /// Whether [`Scheme::for_input`] reads the whole input (so that the codec cannot
        /// encode a tensor range by range as its sum is formed).
        fn reads_whole_input(&self) -> bool {
            false
        }
        /// [`Scheme::for_input`] for an error-feedback step, whose input is
        /// `beta r + gamma g` (formed here without changing `r`).
        fn for_feedback(
            &self,
            _r: &super::fixed::ResidualMut<'_>,
            _g: &[f32],
            _beta: f32,
            _gamma: f32,
        ) -> Self {
            *self
        }
    }
}

impl<S: Scheme> Codec for S {
    fn id(&self) -> CodecId {
        S::ID
    }

    fn spec(&self) -> CodecSpec {
        (*self).into()
    }

    fn max_encoded_len(&self, n: usize) -> usize {
        let len = (HEADER_LEN as u64).saturating_add(self.max_payload(n as u64));
        usize::try_from(len).unwrap_or(usize::MAX)
    }

    fn check_encode(&self, n: usize, ctx: &EncodeCtx) -> Result<()> {
        if ctx.offset.checked_add(n as u64).is_none() {
            return Err(Error::Param {
                codec: S::ID,
                name: "offset",
                reason: format!("offset {} + {n} elements overflows u64", ctx.offset),
            });
        }
        self.check_elements(n as u64)
    }

    fn encode_into(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<usize> {
        self.check_encode(x.len(), ctx)?;
        let e = Standard::run(|| self.for_input(x).encode_payload(x, ctx, out))?;
        write_header::<S>(&e, x.len(), ctx, out);
        Ok(HEADER_LEN + e.payload_len as usize)
    }

    fn decode_into(&self, frame: &[u8], out: &mut [f32]) -> Result<()> {
        let (h, p) = own_frame::<S>(frame)?;
        decode_as::<S, { mode::WRITE }>(&h, p, out)
    }

    fn decode_add(&self, frame: &[u8], acc: &mut [f32]) -> Result<()> {
        let (h, p) = own_frame::<S>(frame)?;
        decode_as::<S, { mode::ADD }>(&h, p, acc)
    }
}

/// Write the header of a frame whose payload `e` describes, and return it.
fn write_header<S: Scheme>(e: &Encoded, n: usize, ctx: &EncodeCtx, out: &mut [u8]) -> Header {
    let h = Header {
        codec: S::ID,
        flags: if e.nonfinite { wire::FLAG_NONFINITE } else { 0 }
            | if e.entropy { wire::FLAG_ENTROPY } else { 0 },
        elements: n as u64,
        payload_len: e.payload_len,
        seed: e.seed,
        offset: ctx.offset,
        params: e.params,
    };
    h.write(out);
    h
}

/// One error-feedback step of codec `c` (arguments already validated: lengths equal,
/// `out` holds `max_encoded_len`, `check_encode` passed). Fixed-rate codecs run the fused
/// tile loop of [`fixed::feedback`]; the sparse codecs form `p` in the residual and encode
/// it whole, and decode the frame onto it in residual mode, which touches only the sent
/// elements (top-k forms `p` tile by tile inside its filter pass, and updates the residual
/// from its kept candidates instead of parsing its indices again).
pub(crate) fn feedback_step<S: Scheme>(
    c: &S,
    g: &[f32],
    r: fixed::ResidualMut<'_>,
    beta: f32,
    gamma: f32,
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<usize> {
    let c = &c.for_feedback(&r, g, beta, gamma);
    if let Some(f) = c.ranges() {
        let e = if f.staged() {
            stage::feedback(f, g, r, (beta, gamma), ctx, out)?
        } else {
            fixed::feedback(f, g, r, beta, gamma, ctx, out)?
        };
        write_header::<S>(&e, g.len(), ctx, out);
        return Ok(HEADER_LEN + e.payload_len as usize);
    }
    let fixed::ResidualMut::F32(r) = r else {
        return Err(Error::Param {
            codec: S::ID,
            name: "residual",
            reason: "a bf16 residual needs a fixed-rate codec".into(),
        });
    };
    let (e, residual_done) = c.encode_formed(r, (g, beta, gamma), ctx, out)?;
    let h = write_header::<S>(&e, g.len(), ctx, out);
    let len = HEADER_LEN + e.payload_len as usize;
    if !residual_done {
        c.decode_payload::<{ mode::RESIDUAL }>(&h, &out[HEADER_LEN..len], r)?;
    }
    Ok(len)
}

fn own_frame<S: Scheme>(frame: &[u8]) -> Result<(Header, &[u8])> {
    let (h, p) = wire::split(frame)?;
    if h.codec != S::ID {
        return Err(Error::WrongCodec {
            expected: S::ID,
            found: h.codec,
        });
    }
    Ok((h, p))
}

fn decode_as<S: Scheme, const M: u8>(h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
    if out.len() as u64 != h.elements {
        return Err(Error::OutputLength {
            expected: h.elements,
            got: out.len(),
        });
    }
    let c = read::<S>(h)?;
    Standard::run(|| c.decode_payload::<M>(h, p, out))
}

macro_rules! by_id {
    ($id:expr, $S:ident => $e:expr) => {
        match $id {
            CodecId::Identity => {
                type $S = Identity;
                $e
            }
            CodecId::Fp16 => {
                type $S = Fp16;
                $e
            }
            CodecId::Bf16 => {
                type $S = Bf16;
                $e
            }
            CodecId::Int8 => {
                type $S = Int8;
                $e
            }
            CodecId::Qsgd => {
                type $S = Qsgd;
                $e
            }
            CodecId::Sign => {
                type $S = Sign;
                $e
            }
            CodecId::Ternary => {
                type $S = Ternary;
                $e
            }
            CodecId::Natural => {
                type $S = Natural;
                $e
            }
            CodecId::TopK => {
                type $S = TopK;
                $e
            }
            CodecId::RandK => {
                type $S = RandK;
                $e
            }
            CodecId::Dct => {
                type $S = Dct;
                $e
            }
            CodecId::Fp8 => {
                type $S = Fp8;
                $e
            }
            CodecId::Fp4 => {
                type $S = Fp4;
                $e
            }
            CodecId::Codebook => {
                type $S = Codebook;
                $e
            }
            CodecId::ChunkTopK => {
                type $S = ChunkTopK;
                $e
            }
            CodecId::Lossless => {
                type $S = Lossless;
                $e
            }
        }
    };
}

/// Decode any frame by its header (the free `decode` / `decode_add`).
pub(crate) fn decode_frame<const M: u8>(frame: &[u8], out: &mut [f32]) -> Result<()> {
    let (h, p) = wire::split(frame)?;
    by_id!(h.codec, S => decode_as::<S, M>(&h, p, out))
}

/// Decode a frame already split by [`wire::split`] (header checked, payload checksum
/// verified if sealed) without checking either again.
pub(crate) fn decode_split<const M: u8>(h: &Header, payload: &[u8], out: &mut [f32]) -> Result<()> {
    by_id!(h.codec, S => decode_as::<S, M>(h, payload, out))
}

/// The length of every frame of `n` elements that `codec` encodes (sealed with a payload
/// checksum when `checksum`), where the codec fixes it: the fixed-rate codecs, whose
/// frames' lengths follow from the element count alone. `None` for the others.
pub(crate) fn fixed_frame_len(codec: &CodecSpec, n: usize, checksum: bool) -> Option<usize> {
    let seal = if checksum { wire::PAYLOAD_CRC_LEN } else { 0 };
    each_spec!(codec, c => c.fixed().map(|_| c.max_encoded_len(n).saturating_add(seal)))
}

/// The sections of a received frame (`h`, `payload`, of `n` elements) that a fused ring
/// hop of `codec` reads (see [`fixed::hop`]), after every check a decoder makes before it
/// writes. `None` where the hop cannot be fused: a codec without fixed-rate ranges, one
/// that reads its whole input before it encodes, a tile too large for the stack, or a
/// frame of other parameters (all of which the caller decodes and encodes in turn).
pub(crate) fn hop_sections<'f>(
    codec: &CodecSpec,
    h: &Header,
    payload: &'f [u8],
    n: usize,
) -> Result<Option<(&'f [u8], &'f [u8])>> {
    each_spec!(codec, c => hop_sections_as(c, h, payload, n))
}

fn hop_sections_as<'f, S: Scheme>(
    c: &S,
    h: &Header,
    payload: &'f [u8],
    n: usize,
) -> Result<Option<(&'f [u8], &'f [u8])>> {
    let Some(f) = fusable(c).filter(|_| h.codec == S::ID) else {
        return Ok(None);
    };
    if n as u64 != h.elements {
        return Err(Error::OutputLength {
            expected: h.elements,
            got: n,
        });
    }
    if read::<S>(h)?.into() != Into::<CodecSpec>::into(*c) {
        return Ok(None);
    }
    let (scales, codes) = payload.split_at(f.layout().scales_len(n));
    Standard::run(|| f.validate(h, scales, codes))?;
    Ok(Some((scales, codes)))
}

/// The fixed-rate ranges of a codec whose ring hop can be fused: it encodes range by
/// range (it does not read the whole input first), in tiles that fit the stack.
fn fusable<S: Scheme>(c: &S) -> Option<&dyn fixed::FixedRate> {
    c.fixed()
        .filter(|f| !c.reads_whole_input() && fixed::hop_tile(f.layout()).is_some())
}

/// A fused ring hop of `codec` (see [`fixed::hop`]) on a frame's sections from
/// [`hop_sections`]: the whole frame of the sum (header included) goes to `out`, whose
/// length is returned.
pub(crate) fn ring_hop(
    codec: &CodecSpec,
    frame: (&[u8], &[u8]),
    acc: fixed::HopAcc<'_>,
    fb: Option<(fixed::ResidualMut<'_>, f32, f32)>,
    finish: &(dyn Fn(&mut [f32]) + Sync),
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<usize> {
    each_spec!(codec, c => ring_hop_as(c, frame, acc, fb, finish, ctx, out))
}

fn ring_hop_as<S: Scheme>(
    c: &S,
    frame: (&[u8], &[u8]),
    acc: fixed::HopAcc<'_>,
    fb: Option<(fixed::ResidualMut<'_>, f32, f32)>,
    finish: &(dyn Fn(&mut [f32]) + Sync),
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<usize> {
    let n = acc.len();
    let Some(f) = fusable(c) else {
        return Err(Error::Collective(format!("{c} cannot fuse a ring hop")));
    };
    c.check_encode(n, ctx)?;
    let e = Standard::run(|| fixed::hop(f, frame, acc, fb, finish, ctx, out))?;
    write_header::<S>(&e, n, ctx, out);
    Ok(HEADER_LEN + e.payload_len as usize)
}

/// [`decode_split`] in write mode, then `finish` on the output: range by range as the
/// ranges are decoded (while they are in cache) for the fixed-rate codecs, at the end for
/// the others.
pub(crate) fn decode_split_then(
    h: &Header,
    payload: &[u8],
    out: &mut [f32],
    finish: &(dyn Fn(&mut [f32]) + Sync),
) -> Result<()> {
    by_id!(h.codec, S => decode_then_as::<S>(h, payload, out, finish))
}

fn decode_then_as<S: Scheme>(
    h: &Header,
    p: &[u8],
    out: &mut [f32],
    finish: &(dyn Fn(&mut [f32]) + Sync),
) -> Result<()> {
    if out.len() as u64 != h.elements {
        return Err(Error::OutputLength {
            expected: h.elements,
            got: out.len(),
        });
    }
    let c = read::<S>(h)?;
    if let Some(f) = c.fixed() {
        return Standard::run(|| fixed::decode_then(f, h, p, out, finish));
    }
    decode_as::<S, { mode::WRITE }>(h, p, out)?;
    Standard::run(|| finish(out));
    Ok(())
}

/// The spec a header describes (validated as a decoder would).
pub(crate) fn spec_from_header(h: &Header) -> Result<CodecSpec> {
    by_id!(h.codec, S => read::<S>(h).map(Into::into))
}

/// The codec `S` a header describes: the ENTROPY flag refused where `S` has no stage,
/// then `S`'s own checks.
fn read<S: Scheme>(h: &Header) -> Result<S> {
    if h.entropy() && !S::STAGE {
        return Err(Error::BadField {
            codec: h.codec,
            field: "flags",
            reason: format!(
                "the ENTROPY flag is set, and {} has no entropy stage",
                h.codec.name()
            ),
        });
    }
    S::read(h)
}

// ------------------------------------------------------------------ shared layout helpers

/// Validate a block size given in code or a spec.
pub(crate) fn check_block(codec: CodecId, block: usize) -> Result<u32> {
    if block == 0 || block > MAX_BLOCK as usize {
        return Err(Error::Param {
            codec,
            name: "block",
            reason: format!("{block} is outside 1..={MAX_BLOCK}"),
        });
    }
    Ok(block as u32)
}

/// Payload bytes of a block codec: one scale of `scale_bytes` per block, then `n` codes
/// of `bits` bits as an LSB-first stream. `None` on overflow.
pub(crate) fn block_payload(n: u64, block: u64, scale_bytes: u64, bits: u64) -> Option<u64> {
    wire::mul_add(n.div_ceil(block), scale_bytes, wire::packed_len(n, bits)?)
}

/// The block size in params bytes 0..4 of a header, validated.
pub(crate) fn read_block(h: &Header) -> Result<usize> {
    let b = h.param_u32(0);
    if b == 0 || b > MAX_BLOCK {
        return Err(Error::BadField {
            codec: h.codec,
            field: "params.block",
            reason: format!("block size {b} is outside 1..={MAX_BLOCK}"),
        });
    }
    Ok(b as usize)
}

/// Error unless the declared payload length equals `expected` (`None`: overflow).
pub(crate) fn expect_payload(h: &Header, expected: Option<u64>) -> Result<()> {
    match expected {
        Some(e) if e == h.payload_len => Ok(()),
        Some(e) => Err(Error::PayloadLength {
            codec: h.codec,
            expected: e,
            declared: h.payload_len,
        }),
        None => Err(Error::BadField {
            codec: h.codec,
            field: "elements",
            reason: format!(
                "{} elements imply a payload longer than 2^64 bytes",
                h.elements
            ),
        }),
    }
}

/// Prepare the output of a sparse decode for the kept elements' `put::<M>`: zero it
/// (write mode), leave it (add mode), or, in residual mode, where `out` holds `p`, apply
/// the residual rule to the elements that were not sent (decoded value 0). That rule
/// changes only non-finite values, so it runs only when the frame says it saw one.
/// `nonfinite`: the frame's NONFINITE flag.
pub(crate) fn sparse_prepare<const M: u8>(nonfinite: bool, out: &mut [f32]) {
    match M {
        mode::WRITE => out.fill(0.0),
        mode::ADD => {}
        _ => {
            if nonfinite {
                for o in out.iter_mut() {
                    put::<M>(o, 0.0);
                }
            }
        }
    }
}

/// Params with a block size in bytes 0..4 and an optional byte at 4.
pub(crate) fn block_params(block: u32, byte4: u8) -> [u8; 12] {
    let mut p = [0u8; 12];
    p[0..4].copy_from_slice(&block.to_le_bytes());
    p[4] = byte4;
    p
}

/// `Display`, `From<T> for CodecSpec`, `Scheme` and `FixedRate` for an element-wise codec
/// with no parameters: `$bytes` payload bytes per element, no seed, no block scales;
/// `feedback` is its one-pass error-feedback kernel, if it has one (measured faster than
/// the tiled three passes only for fp16, docs/benchmarks.md).
macro_rules! elementwise_codec {
    (
        $T:ident,
        $id:ident,
        $bytes:expr,
        encode = $enc:expr,
        decode<$M:ident> = $dec:expr,
        feedback = $fb:expr,
        hop = $hop:expr
    ) => {
        impl core::fmt::Display for $T {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(CodecId::$id.name())
            }
        }

        impl From<$T> for CodecSpec {
            fn from(c: $T) -> CodecSpec {
                CodecSpec::$id(c)
            }
        }

        impl $crate::codecs::fixed::FixedRate for $T {
            fn params(&self) -> [u8; 12] {
                [0; 12]
            }

            fn seeded(&self) -> bool {
                false
            }

            fn layout(&self) -> $crate::codecs::fixed::Layout {
                $crate::codecs::fixed::Layout {
                    block: 1,
                    scale_bytes: 0,
                    bits: 8 * $bytes,
                }
            }

            fn encode_sections(
                &self,
                x: &[f32],
                _ctx: &EncodeCtx,
                _scales: &mut [u8],
                codes: &mut [u8],
            ) -> bool {
                ($enc)(x, codes)
            }

            fn decode_sections(&self, m: u8, _scales: &[u8], codes: &[u8], out: &mut [f32]) {
                $crate::codecs::fixed::by_mode!(m, $M => ($dec)(codes, out))
            }

            fn feedback_fused(
                &self,
                r: &mut [f32],
                g: &[f32],
                beta: f32,
                gamma: f32,
                _ctx: &EncodeCtx,
                _scales: &mut [u8],
                codes: &mut [u8],
            ) -> Option<bool> {
                let fused: Option<fn(&mut [f32], &[f32], f32, f32, &mut [u8]) -> bool> = $fb;
                fused.map(|f| f(r, g, beta, gamma, codes))
            }

            fn hop_fused(
                &self,
                local: &[f32],
                (_, input): (&[u8], &[u8]),
                _ctx: &EncodeCtx,
                _sum: &mut [f32],
                _scales: &mut [u8],
                codes: &mut [u8],
            ) -> Option<bool> {
                let fused: Option<fn(&[f32], &[u8], &mut [u8]) -> Option<bool>> = $hop;
                fused.and_then(|f| f(local, input, codes))
            }
        }

        impl Scheme for $T {
            const ID: CodecId = CodecId::$id;
            $crate::codecs::fixed::fixed_scheme!();

            fn read(h: &Header) -> Result<Self> {
                h.seed_zero()?;
                h.params_zero_from(0)?;
                expect_payload(h, $crate::codecs::fixed::FixedRate::layout(&$T).payload_len(h.elements))?;
                Ok($T)
            }

            fn is_unbiased(&self) -> bool {
                // Identity is exact; fp16 and bf16 round to the nearest value, which is
                // biased (a value between two neighbours always goes to the nearer).
                matches!(CodecId::$id, CodecId::Identity)
            }
        }
    };
}
pub(crate) use elementwise_codec;

/// Shared range encode of the sign-magnitude block codecs (qsgd, ternary): steps then a
/// `bits`-wide code stream.
pub(crate) fn signmag_sections(
    x: &[f32],
    ctx: &EncodeCtx,
    scales: &mut [u8],
    codes: &mut [u8],
    block: u32,
    bits: u32,
    measure: crate::kernels::scalar::Measure,
) -> bool {
    let draws = crate::rng::Draws::new(ctx.seed, crate::rng::STREAM_ROUNDING, ctx.offset);
    crate::kernels::encode_signmag(
        x,
        block as usize,
        bits,
        measure,
        &draws,
        ctx.offset,
        scales,
        codes,
    )
}

/// Reject a step of ±Inf among the f32 `steps` that start at frame offset `at`. Encoders
/// write a finite step or NaN; an infinite one would decode a zero code as `0 * Inf`,
/// whose NaN bits differ between x86 and Arm.
pub(crate) fn check_steps(h: &Header, steps: &[u8], at: usize) -> Result<()> {
    check_finite_f32s(h, steps, at, "the step of block")
}

/// Refuse ±Inf in a section of little-endian f32 at frame offset `at` (block steps,
/// codebook entries: encoders write finite values or NaN); `what` names the `b`-th value
/// in the error (`the step of block`).
pub(crate) fn check_finite_f32s(h: &Header, values: &[u8], at: usize, what: &str) -> Result<()> {
    let infinite =
        |s: &[u8]| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) & 0x7FFF_FFFF == 0x7F80_0000;
    if !values
        .chunks_exact(4)
        .fold(false, |any, s| any | infinite(s))
    {
        return Ok(());
    }
    let b = values.chunks_exact(4).position(infinite).unwrap_or(0);
    Err(Error::Corrupt {
        codec: h.codec,
        offset: at + 4 * b,
        reason: format!("{what} {b} is ±Inf (encoders write finite values or NaN)"),
    })
}

/// Check the padding bits of a block codec's code stream of `bits` per element.
pub(crate) fn check_code_padding(h: &Header, scales: &[u8], codes: &[u8], bits: u64) -> Result<()> {
    if codes.is_empty() {
        return Ok(());
    }
    wire::check_padding(h.codec, codes, HEADER_LEN + scales.len(), h.elements, bits)
}

/// The struct, `Default`, `new`, `block`, `with_entropy`, `entropy`, `from_args`,
/// `Display` and `From<_> for CodecSpec` of a codec whose only parameters are its block
/// size and the entropy stage.
macro_rules! block_only_codec {
    ($(#[$doc:meta])* $T:ident, $id:ident, default_block = $default:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $T {
            block: u32,
            entropy: bool,
        }

        impl Default for $T {
            fn default() -> Self {
                $T {
                    block: $default,
                    entropy: false,
                }
            }
        }

        impl $T {
            /// The codec with blocks of `block` elements (1..=2^24).
            pub fn new(block: usize) -> Result<$T> {
                Ok($T {
                    block: check_block(CodecId::$id, block)?,
                    entropy: false,
                })
            }

            /// Elements per block.
            pub fn block(&self) -> usize {
                self.block as usize
            }

            pub(crate) fn from_args(a: &mut Args) -> core::result::Result<$T, String> {
                let block = a.uint("block", $default, 1..=MAX_BLOCK as u64)? as u32;
                let c = $T {
                    block,
                    entropy: false,
                };
                let entropy = $crate::codecs::stage::from_args(a, CodecId::$id, c.layout())?;
                Ok($T { entropy, ..c })
            }
        }

        $crate::codecs::stage::stage_methods!($T);

        impl core::fmt::Display for $T {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(
                    f,
                    "{}:block={}{}",
                    CodecId::$id.name(),
                    self.block,
                    $crate::codecs::stage::suffix(self.entropy)
                )
            }
        }

        impl From<$T> for CodecSpec {
            fn from(c: $T) -> CodecSpec {
                CodecSpec::$id(c)
            }
        }
    };
}
pub(crate) use block_only_codec;

#[cfg(test)]
mod hop_tests {
    use super::*;

    fn sections_of(codec: &str, frame_of: &str, n: usize) -> bool {
        let c: CodecSpec = codec.parse().unwrap();
        let f: CodecSpec = frame_of.parse().unwrap();
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let frame = f.encode(&x, &EncodeCtx::new(5)).unwrap();
        let (h, p) = wire::split(&frame).unwrap();
        hop_sections(&c, &h, p, n).unwrap().is_some()
    }

    /// The ring's hop is fused for every fixed-rate codec whose encode reads ranges alone,
    /// and falls back (to decode, then encode) for the others and for frames of other
    /// parameters.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "safe code on the scalar backend (Miri's only one); natively on every backend"
    )]
    fn fixed_rate_hops_fuse_and_the_others_fall_back() {
        for spec in [
            "identity",
            "fp16",
            "bf16",
            "int8",
            "int8:block=64,rounding=stochastic",
            "int8:block=4096",
            "qsgd:bits=4,block=7",
            "sign:block=3",
            "ternary",
            "natural",
            "fp8:format=e4m3,block=32,scale=e8m0",
            "fp8:format=e5m2,scale=none,rounding=stochastic",
            "fp4",
            "fp4:format=e3m0,block=6",
            "codebook:block=7",
        ] {
            assert!(sections_of(spec, spec, 1000), "{spec} should fuse");
        }
        for spec in [
            "topk:ratio=0.1,values=f32",
            "randk:ratio=0.3,values=f32",
            "dct:chunk=64,k=4",
            "chunktopk:chunk=64,k=5",
            "fp4:scale=e4m3",
            "int8:block=8192",
        ] {
            assert!(!sections_of(spec, spec, 1000), "{spec} should not fuse");
        }
        assert!(!sections_of("int8:block=64", "int8:block=128", 1000));
        assert!(!sections_of("int8", "fp16", 1000));
        let c: CodecSpec = "int8".parse().unwrap();
        let frame = c.encode(&[1.0; 10], &EncodeCtx::new(0)).unwrap();
        let (h, p) = wire::split(&frame).unwrap();
        assert!(matches!(
            hop_sections(&c, &h, p, 11),
            Err(Error::OutputLength { .. })
        ));
    }
}
