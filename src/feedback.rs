//! Error feedback: the residual state that carries each step's compression error into
//! the next step (Seide et al. 2014; Karimireddy et al. 2019, "Error feedback fixes
//! SignSGD").
//!
//! Each step of an [`ErrorFeedback`] computes `p = beta * residual + gamma * grad`,
//! encodes `p`, and keeps `residual = p - decode(frame)`. So, with `beta = gamma = 1`, the
//! frames sent so far plus the residual add up to the gradients seen so far: nothing is
//! lost, only delayed.
//!
//! ## Fused
//! The step is one pass over memory. For the fixed-rate codecs it runs in tiles of about
//! 2048 elements (whole blocks): the tile's `p` is formed in the residual, encoded, and
//! decoded back onto itself in the decode kernel's residual mode, all while the tile is in
//! L1, on the current SIMD backend. The gradient and residual are read once and the
//! residual written once. Large tensors run their tiles in parallel (`crate::parallel`).
//! For top-k and random-k, `p` is formed over the whole tensor (selection needs all of
//! it), then encoded, and the residual is updated only at the elements that were sent.
//! Every backend and thread count gives byte-identical frames and residuals.
//!
//! ## Non-finite values
//! An element's residual is `p - decoded` when that is finite, else `p` when `p` is
//! finite (nothing usable was sent for it: a block the frame marks non-finite, an fp16
//! overflow to ±Inf), else 0 ([`crate::kernels::residual_of`]). So the frame still shows
//! the NaN or ±Inf (a loss scaler can skip the step), the residual never holds one, and a
//! non-finite gradient element is dropped instead of poisoning every later step. The
//! finite elements of a non-finite block keep their whole `p` in the residual.
//!
//! ## Memory
//! | residual | bytes per element | notes |
//! |----------|-------------------|-------|
//! | [`ResidualPrecision::F32`] | 4 | exact: frames plus residual equal the sum of gradients to f32 rounding |
//! | [`ResidualPrecision::Bf16`] | 2, plus a scratch of about 1/32 of an f32 per element | the residual is rounded to bf16 (8 significant bits) after each step; fixed-rate codecs only |
//!
//! The bf16 scratch is one f32 tile per parallel range: `ceil(n / range) * tile` floats,
//! at most `n` (only with very large or odd block sizes, where a tile is a whole block).

use crate::alloc;
use crate::codec::{Codec, CodecSpec, EncodeCtx, each_spec};
use crate::codecs::{self, fixed::ResidualMut};
use crate::error::{Error, Result};
use crate::kernels::scalar::bf16_to_f32;
use crate::state::{BlobReader, BlobWriter};

const FEEDBACK_MAGIC: [u8; 4] = *b"GPEF";

/// How the residual is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResidualPrecision {
    /// 4 bytes per element; exact.
    #[default]
    F32,
    /// 2 bytes per element: the residual is rounded to bfloat16 (nearest, ties to even,
    /// saturating at the largest finite bf16) after every step. Fixed-rate codecs only.
    Bf16,
}

/// Options of an [`ErrorFeedback`] state.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FeedbackOptions {
    /// Weight of the residual in `p = beta * residual + gamma * grad` (default 1).
    pub beta: f32,
    /// Weight of the gradient (default 1; a learning rate folded in here gives the
    /// "compress the update" form of error feedback).
    pub gamma: f32,
    /// Residual storage.
    pub precision: ResidualPrecision,
    /// Accept codecs that are not contractive (default `false`: refused). Error feedback
    /// converges when `E||p - decode(encode(p))||^2 <= (1 - delta) ||p||^2`; a code whose
    /// error can exceed its input (random-k with `scale=unbiased`, QSGD with
    /// [`crate::Qsgd::variance_factor`] `>= 1`, e.g. the default `bits=4,block=512` and
    /// every `bits=2`) grows its residual step after step. In `gradpack train` such runs
    /// diverged within a few epochs. Set this to study them anyway.
    pub allow_non_contractive: bool,
}

impl Default for FeedbackOptions {
    fn default() -> Self {
        FeedbackOptions {
            beta: 1.0,
            gamma: 1.0,
            precision: ResidualPrecision::F32,
            allow_non_contractive: false,
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    F32(Vec<f32>),
    Bf16 { r: Vec<u16>, scratch: Vec<f32> },
}

/// A read-only view of the residual.
#[derive(Debug, Clone, Copy)]
pub enum Residual<'a> {
    /// An f32 residual.
    F32(&'a [f32]),
    /// A bf16 residual (bit patterns).
    Bf16(&'a [u16]),
}

/// Error-feedback state for one tensor of fixed length, with its codec.
///
/// ```
/// use gradpack::{EncodeCtx, ErrorFeedback};
///
/// let mut ef = ErrorFeedback::new("sign".parse::<gradpack::CodecSpec>()?, 1000)?;
/// let mut frame = vec![0u8; ef.max_encoded_len()];
/// for step in 0..3u64 {
///     let grad: Vec<f32> = (0..1000).map(|i| ((i + step as usize) as f32).sin()).collect();
///     let len = ef.encode_into(&grad, &EncodeCtx::new(step), &mut frame)?;
///     // send &frame[..len]
///     # let _ = len;
/// }
/// # Ok::<(), gradpack::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    codec: CodecSpec,
    opts: FeedbackOptions,
    state: State,
}

impl ErrorFeedback {
    /// A zero residual of `len` elements for `codec`, with the default options (f32
    /// residual, `beta = gamma = 1`).
    pub fn new(codec: impl Into<CodecSpec>, len: usize) -> Result<ErrorFeedback> {
        ErrorFeedback::with_options(codec, len, FeedbackOptions::default())
    }

    /// A zero residual with explicit options. Errors if `beta` or `gamma` is not finite;
    /// if a bf16 residual is asked of a sparse codec (top-k, random-k), which needs all
    /// of `p` in f32 and so would save nothing; and for codecs that are not contractive
    /// (their residual diverges; see [`FeedbackOptions::allow_non_contractive`]).
    pub fn with_options(
        codec: impl Into<CodecSpec>,
        len: usize,
        opts: FeedbackOptions,
    ) -> Result<ErrorFeedback> {
        let codec = codec.into();
        for (name, v) in [("beta", opts.beta), ("gamma", opts.gamma)] {
            if !v.is_finite() {
                return Err(Error::Param {
                    codec: codec.id(),
                    name,
                    reason: format!("error-feedback weight {v} is not finite"),
                });
            }
        }
        if !opts.allow_non_contractive {
            let refuse = match &codec {
                CodecSpec::RandK(rk) if rk.scale() == crate::codecs::RandKScale::Unbiased => {
                    Some((
                        "scale",
                        "random-k with scale=unbiased multiplies the kept values by 1/ratio and \
                     its residual grows without bound (use scale=none)"
                            .to_string(),
                    ))
                }
                CodecSpec::Qsgd(q) if q.variance_factor() >= 1.0 => Some((
                    "bits",
                    format!(
                        "QSGD with bits={}, block={} has variance factor \
                         min(n/s^2, sqrt(n)/s) = {:.2} >= 1, so its error can exceed its \
                         input and the residual diverges (use bits=8, or bits=4 with \
                         block <= 48)",
                        q.bits(),
                        q.block(),
                        q.variance_factor()
                    ),
                )),
                _ => None,
            };
            if let Some((name, why)) = refuse {
                return Err(Error::Param {
                    codec: codec.id(),
                    name,
                    reason: format!(
                        "error feedback needs a contractive codec: {why}; \
                         FeedbackOptions::allow_non_contractive overrides this"
                    ),
                });
            }
        }
        let state = match opts.precision {
            ResidualPrecision::F32 => State::F32(alloc::filled(len, 0.0, "the residual")?),
            ResidualPrecision::Bf16 => {
                let layout = each_spec!(&codec, c => codecs::Scheme::ranges(c).map(|f| f.layout()));
                let Some(layout) = layout else {
                    return Err(Error::Param {
                        codec: codec.id(),
                        name: "residual",
                        reason: format!(
                            "a bf16 residual needs a fixed-rate codec; {codec} codes the \
                             whole tensor at once, which needs an f32 residual"
                        ),
                    });
                };
                let (_, scratch) = codecs::fixed::feedback_scratch(layout, len);
                State::Bf16 {
                    r: alloc::filled(len, 0, "the residual")?,
                    scratch: alloc::filled(scratch, 0.0, "the residual scratch")?,
                }
            }
        };
        Ok(ErrorFeedback { codec, opts, state })
    }

    /// The codec.
    pub fn codec(&self) -> CodecSpec {
        self.codec
    }

    /// The options.
    pub fn options(&self) -> FeedbackOptions {
        self.opts
    }

    /// Elements of the tensor.
    pub fn len(&self) -> usize {
        match &self.state {
            State::F32(r) => r.len(),
            State::Bf16 { r, .. } => r.len(),
        }
    }

    /// True for a zero-length tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of state held (residual plus scratch).
    pub fn memory_bytes(&self) -> usize {
        match &self.state {
            State::F32(r) => 4 * r.len(),
            State::Bf16 { r, scratch } => 2 * r.len() + 4 * scratch.len(),
        }
    }

    /// A buffer this long always holds a step's frame.
    pub fn max_encoded_len(&self) -> usize {
        self.codec.max_encoded_len(self.len())
    }

    /// The residual.
    pub fn residual(&self) -> Residual<'_> {
        match &self.state {
            State::F32(r) => Residual::F32(r),
            State::Bf16 { r, .. } => Residual::Bf16(r),
        }
    }

    /// The residual as f32 values.
    pub fn residual_f32(&self) -> Vec<f32> {
        match &self.state {
            State::F32(r) => r.clone(),
            State::Bf16 { r, .. } => r.iter().map(|&h| bf16_to_f32(h)).collect(),
        }
    }

    /// Zero the residual (e.g. after a model reload).
    pub fn reset(&mut self) {
        match &mut self.state {
            State::F32(r) => r.fill(0.0),
            State::Bf16 { r, .. } => r.fill(0),
        }
    }

    /// Replace the residual with `r` (of [`ErrorFeedback::len`] elements; a bf16 residual
    /// stores it rounded as every step does). For embedders that move residuals between
    /// tensors of a new layout, such as a data-parallel framework that regroups its
    /// gradient buckets. A wrong length is an error and the state is unchanged.
    pub fn set_residual(&mut self, r: &[f32]) -> Result<()> {
        if r.len() != self.len() {
            return Err(Error::LengthMismatch {
                what: "new residual and error-feedback state",
                left: r.len(),
                right: self.len(),
            });
        }
        match &mut self.state {
            State::F32(res) => res.copy_from_slice(r),
            State::Bf16 { r: res, .. } => crate::kernels::feedback_store_bf16(res, r),
        }
        Ok(())
    }

    /// The state as a saved blob (see [`crate::state`]): codec, options, length and the
    /// residual's exact bits. [`ErrorFeedback::restore`] reads it back.
    pub fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(FEEDBACK_MAGIC);
        w.str(&self.codec.to_string())
            .u32(self.opts.beta.to_bits())
            .u32(self.opts.gamma.to_bits())
            .u8(self.opts.precision as u8)
            .u8(u8::from(self.opts.allow_non_contractive));
        match &self.state {
            State::F32(r) => w.f32s(r),
            State::Bf16 { r, .. } => w.u16s(r),
        };
        w.finish()
    }

    /// Restore a residual saved by [`ErrorFeedback::save`] from a state of the same
    /// codec, options and length; the next step then continues bit-identically to one
    /// that never stopped. A blob that is corrupt or from another codec, options or
    /// length is refused with [`Error::Checkpoint`], and the state is unchanged.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, FEEDBACK_MAGIC, "error feedback")?;
        r.str_eq("codec", &self.codec.to_string())?;
        r.u32_eq("beta (bits)", self.opts.beta.to_bits())?;
        r.u32_eq("gamma (bits)", self.opts.gamma.to_bits())?;
        r.u8_eq("residual precision", self.opts.precision as u8)?;
        r.u8_eq(
            "allow_non_contractive",
            u8::from(self.opts.allow_non_contractive),
        )?;
        match &mut self.state {
            State::F32(res) => {
                let mut new = alloc::filled(res.len(), 0.0, "the restored residual")?;
                r.f32s_into(&mut new)?;
                r.end()?;
                *res = new;
            }
            State::Bf16 { r: res, .. } => {
                let mut new = alloc::filled(res.len(), 0, "the restored residual")?;
                r.u16s_into(&mut new)?;
                r.end()?;
                *res = new;
            }
        }
        Ok(())
    }

    /// One step: encode `p = beta * residual + gamma * grad` into `out` and keep the
    /// residual `p - decode(frame)`. Returns the frame length.
    ///
    /// Everything is checked before the state is touched: `grad.len()` must equal
    /// [`ErrorFeedback::len`] (a different length is an error, never a resize), `out`
    /// must hold [`ErrorFeedback::max_encoded_len`] bytes, and `ctx` must pass the codec's
    /// `check_encode`. On error the residual is unchanged.
    pub fn encode_into(&mut self, grad: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<usize> {
        if grad.len() != self.len() {
            return Err(Error::LengthMismatch {
                what: "gradient and error-feedback state",
                left: grad.len(),
                right: self.len(),
            });
        }
        let need = self.max_encoded_len();
        if out.len() < need {
            return Err(Error::BufferTooSmall {
                needed: need,
                got: out.len(),
            });
        }
        self.codec.check_encode(grad.len(), ctx)?;
        let codec = self.codec;
        let (r, beta, gamma) = self.parts();
        crate::kernels::Standard::run(
            || each_spec!(&codec, c => codecs::feedback_step(c, grad, r, beta, gamma, ctx, out)),
        )
    }

    /// The residual and the weights (for a step here or fused into a ring hop).
    pub(crate) fn parts(&mut self) -> (ResidualMut<'_>, f32, f32) {
        let r = match &mut self.state {
            State::F32(r) => ResidualMut::F32(r),
            State::Bf16 { r, scratch } => ResidualMut::Bf16 { r, scratch },
        };
        (r, self.opts.beta, self.opts.gamma)
    }

    /// [`ErrorFeedback::encode_into`] into a new vector.
    pub fn encode(&mut self, grad: &[f32], ctx: &EncodeCtx) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.max_encoded_len()];
        let len = self.encode_into(grad, ctx, &mut out)?;
        out.truncate(len);
        Ok(out)
    }
}
