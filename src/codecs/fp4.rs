//! `fp4`: 4-bit floats (E2M1, as in OCP MXFP4, or E3M0), two codes per byte, with a
//! scale per block.
//!
//! Spec: `fp4:format=e2m1|e3m0,block=B,scale=e8m0|f32|e4m3,rounding=nearest|stochastic`
//! (defaults `e2m1`, 32, `e8m0`, `nearest`: OCP MXFP4's layout of blocks of 32 with a
//! power-of-two scale; with `scale=e4m3` the default block is 16, NVIDIA's NVFP4
//! layout). `B` is even, so that every block is whole bytes of codes. With `scale=e8m0`,
//! `scale_rule=rceil|ocp` (default `rceil`) chooses the power of two, as in `fp8`.
//!
//! Values: E2M1 (1 mantissa bit, bias 1) holds 0, 0.5, 1, 1.5, 2, 3, 4 and 6 with a sign;
//! E3M0 (bias 3) holds 0 and the powers of two 2^-2 to 2^4 with a sign (Streaming
//! DiLoCo's 4-bit float). Neither has infinities or NaN.
//!
//! For each block of `B` elements with absmax `m` and the format's largest value `FMAX`
//! (6 or 16), each element `x` becomes the code of `clamp(x / s, -FMAX, FMAX)` with the
//! block's scale `s`:
//! - `scale=e8m0`: `s = 2^k`, the smallest power of two (`k` in -127..=127) with
//!   `m / s <= FMAX`, one byte `k + 127` (NVIDIA's rule, torchao's `RCEIL`: it never
//!   clips). With `scale_rule=ocp`, the OCP MX 1.0 rule (torchao's default, `FLOOR`):
//!   `k = max(floor(log2 m) - emax, -127)` (`emax` 2 for E2M1, 4 for E3M0), which clips
//!   the block's largest values to FMAX, by up to 25% of `m` for E2M1 and 50% for E3M0
//!   (that clamp adds to the error bounds below). The header records the rule; frames
//!   decode alike.
//! - `scale=f32`: `s = max(m / FMAX, 2^-126)` in f32 (one step down where `FMAX * s`
//!   would overflow).
//! - `scale=e4m3` (NVFP4-like): the frame carries an f32 scale `g = max(A / (448 FMAX),
//!   2^-126)`, `A` the largest magnitude among the frame's finite elements, and each
//!   block one E4M3 byte `v`, the smallest E4M3 value (from `2^-9` to 448) at least
//!   `m / (FMAX g)`; then `s = v g` (f32). The frame's largest block uses the top of
//!   E4M3's range; a block below about `A / 2^18` gets the smallest byte, so its
//!   elements are coarser than its own scale would make them (as in NVFP4).
//!
//! Rounding is to nearest, ties to even, or stochastic (unbiased, from the crate's
//! counter-based draws). Decoding gives `value(code) * s`. Codes are packed two per byte,
//! the even element in the low nibble; the sign is bit 3.
//!
//! Error bounds (per element, `M` the mantissa bits: 1 for E2M1, 0 for E3M0):
//! - nearest: `|x - x'| <= 2^-(M+1) |x| + s 2^(-bias-M)` plus f32 rounding (a quarter
//!   of `|x|` for E2M1, half for E3M0: 4 bits buy that much);
//! - stochastic: below one spacing, `2^-M |x| + s 2^(1-bias-M)`, and `E[x'] = x`.
//!
//! With `scale=e4m3`, `s` is at most `1.125 m / FMAX + 2^-9 g` (the byte rounds up).
//!
//! A block holding NaN or ±Inf gets a NaN scale (f32 NaN, E8M0 byte `0xFF`, E4M3 byte
//! `0x7F`; the frame scale ignores such elements) and decodes
//! to NaN in every element. With an E8M0 scale, a block whose absmax exceeds half of
//! f32's range can round up past it and decode to ±Inf (the error bound is infinite
//! there); the f32 scale never overflows.

use core::fmt;

use super::fixed::{self, FixedRate, Layout, ResidualMut};
use super::fp8::{ScaleRule, SmallFloat};
use super::{EncodeCtx, MAX_BLOCK, Scheme, check_block, check_code_padding, read_block};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::codecs::int8::Rounding;
use crate::error::{Error, Result};
use crate::kernels::fp8::{self as k8, E2M1, E3M0, Format};
use crate::wire::Header;

/// Which 4-bit float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp4Format {
    /// E2M1 (OCP MXFP4's element): 0 to 6.
    #[default]
    E2m1,
    /// E3M0: 0 and powers of two from 2^-2 to 2^4.
    E3m0,
}

impl Fp4Format {
    fn name(self) -> &'static str {
        match self {
            Fp4Format::E2m1 => "e2m1",
            Fp4Format::E3m0 => "e3m0",
        }
    }

    fn kernel(self) -> Format {
        match self {
            Fp4Format::E2m1 => E2M1,
            Fp4Format::E3m0 => E3M0,
        }
    }

    /// The largest value: 6 or 16.
    pub fn max(self) -> f32 {
        self.kernel().max()
    }

    /// Mantissa bits: 1 or 0.
    pub fn mantissa_bits(self) -> u32 {
        self.kernel().m
    }

    /// Exponent bias: 1 or 3.
    pub fn bias(self) -> i32 {
        self.kernel().bias
    }
}

/// How an `fp4` block is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp4Scale {
    /// A power of two per block, in one byte (E8M0, as OCP MX).
    #[default]
    E8m0,
    /// An f32 per block.
    F32,
    /// An E4M3 byte per block times an f32 scale per frame (NVFP4-like: see the module
    /// docs).
    E4m3,
}

impl Fp4Scale {
    fn name(self) -> &'static str {
        match self {
            Fp4Scale::E8m0 => "e8m0",
            Fp4Scale::F32 => "f32",
            Fp4Scale::E4m3 => "e4m3",
        }
    }
}

/// 4-bit floats with a per-block scale (see the module docs).
///
/// Two values are equal when their parameters are: the frame scale of `scale=e4m3`
/// belongs to one frame, not to the codec.
#[derive(Debug, Clone, Copy)]
pub struct Fp4 {
    format: Fp4Format,
    block: u32,
    scale: Fp4Scale,
    rounding: Rounding,
    /// With [`Fp4Scale::E4m3`], the frame scale's bits: taken from the input when
    /// encoding, read from the header when decoding (0 in a codec made from a spec).
    global: u32,
    rule: ScaleRule,
    entropy: bool,
}

impl PartialEq for Fp4 {
    fn eq(&self, o: &Fp4) -> bool {
        (
            self.format,
            self.block,
            self.scale,
            self.rounding,
            self.rule,
            self.entropy,
        ) == (o.format, o.block, o.scale, o.rounding, o.rule, o.entropy)
    }
}

impl Eq for Fp4 {}

impl Default for Fp4 {
    fn default() -> Self {
        Fp4 {
            format: Fp4Format::E2m1,
            block: 32,
            scale: Fp4Scale::E8m0,
            rounding: Rounding::Nearest,
            global: 0,
            rule: ScaleRule::Rceil,
            entropy: false,
        }
    }
}

impl Fp4 {
    /// fp4 in `format` with blocks of `block` elements (even, 2..=2^24: a block is whole
    /// bytes of codes).
    pub fn new(
        format: Fp4Format,
        block: usize,
        scale: Fp4Scale,
        rounding: Rounding,
    ) -> Result<Fp4> {
        let block = check_block(CodecId::Fp4, block)?;
        if !block.is_multiple_of(2) {
            return Err(Error::Param {
                codec: CodecId::Fp4,
                name: "block",
                reason: format!("{block} is odd (a block is whole bytes of 4-bit codes)"),
            });
        }
        Ok(Fp4 {
            format,
            block,
            scale,
            rounding,
            global: 0,
            rule: ScaleRule::Rceil,
            entropy: false,
        })
    }

    /// This codec with E8M0 scales chosen by `rule`; an error unless the scale is
    /// [`Fp4Scale::E8m0`].
    pub fn with_scale_rule(self, rule: ScaleRule) -> Result<Fp4> {
        rule.check(CodecId::Fp4, self.scale == Fp4Scale::E8m0)?;
        Ok(Fp4 { rule, ..self })
    }

    /// How the E8M0 scales are chosen ([`ScaleRule::Rceil`] for other scales).
    pub fn scale_rule(&self) -> ScaleRule {
        self.rule
    }

    /// The format.
    pub fn format(&self) -> Fp4Format {
        self.format
    }

    /// Elements per block.
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// The block scale.
    pub fn scale(&self) -> Fp4Scale {
        self.scale
    }

    /// The rounding mode.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Fp4, String> {
        let format = match a.choice("format", "e2m1", &["e2m1", "e3m0"])? {
            "e3m0" => Fp4Format::E3m0,
            _ => Fp4Format::E2m1,
        };
        let scale = match a.choice("scale", "e8m0", &["e8m0", "f32", "e4m3"])? {
            "f32" => Fp4Scale::F32,
            "e4m3" => Fp4Scale::E4m3,
            _ => Fp4Scale::E8m0,
        };
        let default_block = if scale == Fp4Scale::E4m3 { 16 } else { 32 };
        let block = a.uint("block", default_block, 1..=MAX_BLOCK as u64)? as u32;
        if !block.is_multiple_of(2) {
            return Err(format!(
                "block={block} is odd: a block is whole bytes of 4-bit codes (use an even block)"
            ));
        }
        let rounding = Rounding::from_args(a)?;
        let rule = ScaleRule::from_args(a, scale == Fp4Scale::E8m0)?;
        let c = Fp4 {
            format,
            block,
            scale,
            rounding,
            global: 0,
            rule,
            entropy: false,
        };
        let entropy = super::stage::from_args(a, CodecId::Fp4, c.layout())?;
        Ok(Fp4 { entropy, ..c })
    }

    /// The shared small-float core.
    pub(crate) fn core(&self) -> SmallFloat {
        SmallFloat {
            f: self.format.kernel(),
            scale: match self.scale {
                Fp4Scale::E8m0 => k8::Scale::E8m0,
                Fp4Scale::F32 => k8::Scale::F32,
                Fp4Scale::E4m3 => k8::Scale::E4m3 {
                    global: self.global,
                },
            },
            ocp: self.rule == ScaleRule::Ocp,
            four: true,
            block: self.block,
            rounding: self.rounding,
        }
    }

    /// This codec with the frame scale of an input whose largest finite magnitude is
    /// `absmax` (itself unless `scale=e4m3`): `max(absmax / (448 FMAX), 2^-126)`.
    fn with_frame_absmax(&self, absmax: impl FnOnce() -> f32) -> Fp4 {
        if self.scale != Fp4Scale::E4m3 {
            return *self;
        }
        let g = (absmax() / (448.0 * self.format.max())).max(f32::MIN_POSITIVE);
        Fp4 {
            global: g.to_bits(),
            ..*self
        }
    }

    /// A frame scale `g` a decoder accepts: at least `2^-126`, and `448 g` finite.
    fn global_ok(g: f32) -> bool {
        g >= f32::MIN_POSITIVE && (448.0 * g).is_finite()
    }
}

super::stage::stage_methods!(Fp4);

impl fmt::Display for Fp4 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fp4:format={},block={},scale={},rounding={}{}{}",
            self.format.name(),
            self.block,
            self.scale.name(),
            self.rounding.name(),
            self.rule.suffix(),
            super::stage::suffix(self.entropy)
        )
    }
}

impl From<Fp4> for CodecSpec {
    fn from(c: Fp4) -> CodecSpec {
        CodecSpec::Fp4(c)
    }
}

impl Scheme for Fp4 {
    const ID: CodecId = CodecId::Fp4;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn for_input(&self, x: &[f32]) -> Fp4 {
        self.with_frame_absmax(|| fixed::max_finite_abs(x))
    }

    fn reads_whole_input(&self) -> bool {
        self.scale == Fp4Scale::E4m3
    }

    fn for_feedback(&self, r: &ResidualMut<'_>, g: &[f32], beta: f32, gamma: f32) -> Fp4 {
        self.with_frame_absmax(|| fixed::formed_max_finite_abs(r, g, beta, gamma))
    }

    fn read(h: &Header) -> Result<Fp4> {
        let block = read_block(h)? as u32;
        let bad = |field: &'static str, reason: String| Error::BadField {
            codec: h.codec,
            field,
            reason,
        };
        if !block.is_multiple_of(2) {
            return Err(bad("params.block", format!("block size {block} is odd")));
        }
        let format = match h.params[4] {
            0 => Fp4Format::E2m1,
            1 => Fp4Format::E3m0,
            b => {
                return Err(bad(
                    "params.format",
                    format!("{b} is not 0 (e2m1) or 1 (e3m0)"),
                ));
            }
        };
        let scale = match h.params[5] {
            0 => Fp4Scale::E8m0,
            1 => Fp4Scale::F32,
            2 => Fp4Scale::E4m3,
            b => {
                return Err(bad(
                    "params.scale",
                    format!("{b} is not 0 (e8m0), 1 (f32) or 2 (e4m3)"),
                ));
            }
        };
        let rounding = Rounding::read(h, 6)?;
        let mut global = 0;
        if scale == Fp4Scale::E4m3 {
            global = u32::from_le_bytes([h.params[7], h.params[8], h.params[9], h.params[10]]);
            let g = f32::from_bits(global);
            if !Fp4::global_ok(g) {
                return Err(bad(
                    "params.global",
                    format!(
                        "the frame scale is {g:e} (encoders write one of at least 2^-126 \
                         whose product with 448 is finite)"
                    ),
                ));
            }
        } else {
            h.params_zero(7..11)?;
        }
        let rule = ScaleRule::read(h, scale == Fp4Scale::E8m0)?;
        if rounding == Rounding::Nearest {
            h.seed_zero()?;
        }
        let c = Fp4 {
            format,
            block,
            scale,
            rounding,
            global,
            rule,
            entropy: h.entropy(),
        };
        super::stage::expect_payload(h, &c)?;
        Ok(c)
    }

    fn is_unbiased(&self) -> bool {
        // The OCP rule's clamp pulls a block's largest elements toward zero.
        self.rounding == Rounding::Stochastic && self.rule == ScaleRule::Rceil
    }
}

impl FixedRate for Fp4 {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn params(&self) -> [u8; 12] {
        let mut p = self.core().params(self.format as u8, self.scale as u8);
        if self.scale == Fp4Scale::E4m3 {
            p[7..11].copy_from_slice(&self.global.to_le_bytes());
        }
        p
    }

    fn seeded(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }

    fn encode_weight(&self) -> usize {
        self.core().encode_weight()
    }

    fn layout(&self) -> Layout {
        self.core().layout()
    }

    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool {
        self.core().encode(x, ctx, scales, codes)
    }

    fn validate(&self, h: &Header, scales: &[u8], codes: &[u8]) -> Result<()> {
        self.core().check_scales(h, scales)?;
        check_code_padding(h, scales, codes, 4)
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        self.core().decode(m, scales, codes, out)
    }
}
