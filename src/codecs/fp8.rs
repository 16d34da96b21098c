//! `fp8`: OCP 8-bit floats (E4M3 or E5M2), one byte per element, with a scale per block.
//!
//! Spec: `fp8:format=e4m3|e5m2,block=B,scale=f32|e8m0|none,rounding=nearest|stochastic`
//! (defaults `e4m3`, 128, `f32`, `nearest`), and with `scale=e8m0`,
//! `scale_rule=rceil|ocp` (default `rceil`).
//!
//! For each block of `B` elements with absmax `m`, the elements are divided by the
//! block's scale `s` and each quotient is converted to the format:
//! - `scale=f32`: `s = max(m / FMAX, 2^-126)` in f32 (the next f32 down where
//!   `FMAX * s` would overflow), stored as f32, so the block's largest element maps to the
//!   format's largest finite value `FMAX` (448 for E4M3, 57344 for E5M2);
//! - `scale=e8m0`: `s = 2^k`, the smallest power of two (`k` in -127..=127) with
//!   `m / s <= FMAX`, stored as one byte `k + 127` (OCP MX's scale type, with NVIDIA's
//!   rule, torchao's `RCEIL`: it never clips the block's largest values). With
//!   `scale_rule=ocp`, the OCP MX 1.0 rule (torchao's default, `FLOOR`):
//!   `k = max(floor(log2 m) - emax, -127)` (`emax` 8 for E4M3, 15 for E5M2), one lower
//!   in every block whose largest mantissa exceeds FMAX's, whose largest quotients then
//!   pass FMAX and are clamped to it. The frames decode alike (the byte is the scale);
//!   the header records the rule;
//! - `scale=none`: no scale; each value is converted as it is (`block` is then 1).
//!
//! With a scale, each quotient `x / s` (f32 division) is clamped to `±FMAX` (the rounded
//! scale can leave the largest a hair above it). Conversion rounds to nearest, ties to even, or stochastically (`rounding=stochastic`:
//! to one of the two neighbouring values, unbiased, from the crate's counter-based draws,
//! so frames do not depend on chunking or threads). Decoding gives `value(code) * s`.
//!
//! OCP semantics: E4M3 has no infinities (a finite quotient past 448 saturates to ±448,
//! OCP's saturating conversion; ±Inf becomes NaN, so an overflow stays visible); E5M2
//! keeps them (past 61440 it becomes ±Inf). With `scale=none` and nearest rounding, E5M2
//! equals PyTorch's `tensor.to(torch.float8_e5m2)` for every f32 input (NaN as NaN), and
//! E4M3 equals `tensor.to(torch.float8_e4m3fn)` for every input but ±Inf, which PyTorch
//! saturates to ±448: tested on all 2^32 inputs (PyTorch 2.15).
//!
//! Error bounds (per element, `m` the block's absmax, `M` the mantissa bits: 3 for E4M3,
//! 2 for E5M2):
//! - nearest: `|x - x'| <= 2^-(M+1) |x| + s 2^(-bias-M)` (half an ulp of the quotient, or
//!   half the subnormal spacing), plus f32 rounding; at most `2^-(M+1) m (1 + 2^-10)` for
//!   the f32 scale;
//! - stochastic: below one spacing, `2^-M |x| + s 2^(1-bias-M)`, and `E[x'] = x` up to
//!   `2^-24` of a spacing;
//! - with `scale_rule=ocp`, plus the clamp of the block's largest elements: at most
//!   `(1 - FMAX / 2^(emax+1)) m` (`m / 8` for both formats), and those elements are biased
//!   toward zero whatever the rounding.
//!
//! With an E8M0 scale, a block whose absmax exceeds half of f32's range can round up past
//! it and decode to ±Inf (the error bound is infinite there); the f32 scale never does.
//!
//! Non-finite input: a block holding NaN or ±Inf gets a NaN scale (f32 NaN, or the E8M0
//! byte `0xFF`) and every element of it decodes to NaN. With `scale=none`, NaN stays NaN
//! and ±Inf stays ±Inf in E5M2 and becomes NaN in E4M3.

use core::fmt;

use super::fixed::{self, FixedRate, Layout, by_mode};
use super::{EncodeCtx, MAX_BLOCK, Scheme, block_params, check_block, read_block};
use crate::codec::{Args, CodecId, CodecSpec};
use crate::error::{Error, Result};
use crate::kernels;
use crate::kernels::fp8::{self as k8, E4M3, E5M2, Format};
use crate::rng::{Draws, STREAM_ROUNDING};
use crate::wire::{HEADER_LEN, Header};

pub use crate::codecs::int8::Rounding;

/// Which 8-bit float.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Format {
    /// E4M3 (4 exponent bits, 3 mantissa bits, no infinities, largest finite 448).
    #[default]
    E4m3,
    /// E5M2 (5 exponent bits, 2 mantissa bits, IEEE-like, largest finite 57344).
    E5m2,
}

impl Fp8Format {
    fn name(self) -> &'static str {
        match self {
            Fp8Format::E4m3 => "e4m3",
            Fp8Format::E5m2 => "e5m2",
        }
    }

    fn kernel(self) -> Format {
        match self {
            Fp8Format::E4m3 => E4M3,
            Fp8Format::E5m2 => E5M2,
        }
    }

    /// The largest finite value: 448 or 57344.
    pub fn max(self) -> f32 {
        self.kernel().max()
    }

    /// Mantissa bits: 3 or 2.
    pub fn mantissa_bits(self) -> u32 {
        self.kernel().m
    }

    /// Exponent bias: 7 or 15.
    pub fn bias(self) -> i32 {
        self.kernel().bias
    }
}

/// How an `fp8` block is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Scale {
    /// An f32 per block: the block's absmax maps to the format's largest finite value.
    #[default]
    F32,
    /// A power of two per block, in one byte (E8M0).
    E8m0,
    /// No scale: values are converted as they are.
    None,
}

impl Fp8Scale {
    fn name(self) -> &'static str {
        match self {
            Fp8Scale::F32 => "f32",
            Fp8Scale::E8m0 => "e8m0",
            Fp8Scale::None => "none",
        }
    }

    fn kernel(self) -> k8::Scale {
        match self {
            Fp8Scale::F32 => k8::Scale::F32,
            Fp8Scale::E8m0 => k8::Scale::E8m0,
            Fp8Scale::None => k8::Scale::None,
        }
    }
}

/// How an E8M0 block scale is chosen (`scale_rule=`; `fp8` and `fp4` with `scale=e8m0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleRule {
    /// The smallest power of two that maps the block's absmax within FMAX (NVIDIA's rule,
    /// torchao's `RCEIL`): no element is clipped.
    #[default]
    Rceil,
    /// The OCP MX 1.0 rule, `2^(floor(log2 absmax) - emax)` (torchao's `FLOOR`): the bytes
    /// an OCP encoder writes; the block's largest elements can be clipped to FMAX.
    Ocp,
}

impl ScaleRule {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ScaleRule::Rceil => "rceil",
            ScaleRule::Ocp => "ocp",
        }
    }

    /// `scale_rule=` from a spec; given with another scale than E8M0 it is an error.
    pub(crate) fn from_args(a: &mut Args, e8m0: bool) -> core::result::Result<ScaleRule, String> {
        let given = a.has("scale_rule");
        let rule = match a.choice("scale_rule", "rceil", &["rceil", "ocp"])? {
            "ocp" => ScaleRule::Ocp,
            _ => ScaleRule::Rceil,
        };
        if given && !e8m0 {
            return Err("scale_rule applies to scale=e8m0 only".into());
        }
        Ok(rule)
    }

    /// The header byte (`params[11]`): 0 `rceil`, 1 `ocp`; another byte, or `ocp` without
    /// an E8M0 scale, is refused.
    pub(crate) fn read(h: &Header, e8m0: bool) -> Result<ScaleRule> {
        match h.params[11] {
            0 => Ok(ScaleRule::Rceil),
            1 if e8m0 => Ok(ScaleRule::Ocp),
            b => Err(Error::BadField {
                codec: h.codec,
                field: "params.scale_rule",
                reason: if b == 1 {
                    "1 (ocp) without an E8M0 scale".into()
                } else {
                    format!("{b} is not 0 (rceil) or 1 (ocp)")
                },
            }),
        }
    }

    /// Refuse a rule other than the default for a codec whose scale is not E8M0.
    pub(crate) fn check(self, codec: CodecId, e8m0: bool) -> Result<()> {
        if e8m0 || self == ScaleRule::Rceil {
            return Ok(());
        }
        Err(Error::Param {
            codec,
            name: "scale_rule",
            reason: format!("{}: applies to scale=e8m0 only", self.name()),
        })
    }

    /// `,scale_rule=ocp` where it is not the default, for a spec's text.
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            ScaleRule::Rceil => "",
            ScaleRule::Ocp => ",scale_rule=ocp",
        }
    }
}

/// OCP 8-bit floats with a per-block scale (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8 {
    format: Fp8Format,
    block: u32,
    scale: Fp8Scale,
    rounding: Rounding,
    rule: ScaleRule,
    entropy: bool,
}

impl Default for Fp8 {
    fn default() -> Self {
        Fp8 {
            format: Fp8Format::E4m3,
            block: 128,
            scale: Fp8Scale::F32,
            rounding: Rounding::Nearest,
            rule: ScaleRule::Rceil,
            entropy: false,
        }
    }
}

impl Fp8 {
    /// fp8 in `format` with blocks of `block` elements (1..=2^24; 1 with
    /// [`Fp8Scale::None`]).
    pub fn new(
        format: Fp8Format,
        block: usize,
        scale: Fp8Scale,
        rounding: Rounding,
    ) -> Result<Fp8> {
        let block = check_block(CodecId::Fp8, block)?;
        if scale == Fp8Scale::None && block != 1 {
            return Err(Error::Param {
                codec: CodecId::Fp8,
                name: "block",
                reason: format!("{block}: without a scale there are no blocks (use block=1)"),
            });
        }
        Ok(Fp8 {
            format,
            block,
            scale,
            rounding,
            rule: ScaleRule::Rceil,
            entropy: false,
        })
    }

    /// This codec with E8M0 scales chosen by `rule`; an error unless the scale is
    /// [`Fp8Scale::E8m0`].
    pub fn with_scale_rule(self, rule: ScaleRule) -> Result<Fp8> {
        rule.check(CodecId::Fp8, self.scale == Fp8Scale::E8m0)?;
        Ok(Fp8 { rule, ..self })
    }

    /// How the E8M0 scales are chosen ([`ScaleRule::Rceil`] for other scales).
    pub fn scale_rule(&self) -> ScaleRule {
        self.rule
    }

    /// The format.
    pub fn format(&self) -> Fp8Format {
        self.format
    }

    /// Elements per block (1 without a scale).
    pub fn block(&self) -> usize {
        self.block as usize
    }

    /// The block scale.
    pub fn scale(&self) -> Fp8Scale {
        self.scale
    }

    /// The rounding mode.
    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Fp8, String> {
        let format = match a.choice("format", "e4m3", &["e4m3", "e5m2"])? {
            "e5m2" => Fp8Format::E5m2,
            _ => Fp8Format::E4m3,
        };
        let scale = match a.choice("scale", "f32", &["f32", "e8m0", "none"])? {
            "e8m0" => Fp8Scale::E8m0,
            "none" => Fp8Scale::None,
            _ => Fp8Scale::F32,
        };
        let default_block = if scale == Fp8Scale::None { 1 } else { 128 };
        let block = a.uint("block", default_block, 1..=MAX_BLOCK as u64)? as u32;
        if scale == Fp8Scale::None && block != 1 {
            return Err(format!(
                "block={block} with scale=none: without a scale there are no blocks (leave \
                 block out)"
            ));
        }
        let rounding = Rounding::from_args(a)?;
        let rule = ScaleRule::from_args(a, scale == Fp8Scale::E8m0)?;
        let c = Fp8 {
            format,
            block,
            scale,
            rounding,
            rule,
            entropy: false,
        };
        let entropy = super::stage::from_args(a, CodecId::Fp8, c.layout())?;
        Ok(Fp8 { entropy, ..c })
    }

    /// The bits that are all set in a NaN or ±Inf code of the format.
    fn nonfinite_mask(&self) -> u8 {
        match self.format {
            Fp8Format::E4m3 => 0x7F,
            Fp8Format::E5m2 => 0x7C,
        }
    }

    /// The shared small-float core.
    pub(crate) fn core(&self) -> SmallFloat {
        SmallFloat {
            f: self.format.kernel(),
            scale: self.scale.kernel(),
            ocp: self.rule == ScaleRule::Ocp,
            four: false,
            block: self.block,
            rounding: self.rounding,
        }
    }
}

/// What `fp8` and `fp4` share: a small-float format with a block scale (or none), one or
/// two codes per byte, and a rounding.
#[derive(Clone, Copy)]
pub(crate) struct SmallFloat {
    pub f: Format,
    /// The block scale as frames are decoded (E8M0 by either rule).
    pub scale: k8::Scale,
    /// E8M0 scales chosen by the OCP rule when encoding.
    pub ocp: bool,
    /// 4-bit codes, two per byte (`fp4`).
    pub four: bool,
    pub block: u32,
    pub rounding: Rounding,
}

impl SmallFloat {
    fn stochastic(&self) -> bool {
        self.rounding == Rounding::Stochastic
    }

    /// Header params: `block`, then the codec's format and scale bytes, then rounding.
    pub fn params(&self, format: u8, scale: u8) -> [u8; 12] {
        let mut p = block_params(self.block, format);
        p[5] = scale;
        p[6] = self.stochastic() as u8;
        p[11] = self.ocp as u8;
        p
    }

    pub fn encode_weight(&self) -> usize {
        if self.stochastic() { 8 } else { 4 }
    }

    pub fn layout(&self) -> Layout {
        Layout {
            block: self.block as usize,
            scale_bytes: self.scale.bytes(),
            bits: if self.four { 4 } else { 8 },
        }
    }

    pub fn encode(&self, x: &[f32], ctx: &EncodeCtx, scales: &mut [u8], codes: &mut [u8]) -> bool {
        let draws = Draws::new(ctx.seed, STREAM_ROUNDING, ctx.offset);
        let draws = self.stochastic().then_some(&draws);
        let (f, four, block) = (self.f, self.four, self.block as usize);
        let scale = if self.ocp {
            k8::Scale::E8m0Floor
        } else {
            self.scale
        };
        crate::kernels::encode_float(f, scale, four, block, x, draws, ctx.offset, scales, codes)
    }

    pub fn decode(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        let (f, scale, four, block) = (self.f, self.scale, self.four, self.block as usize);
        by_mode!(m, M => crate::kernels::decode_float::<M>(f, scale, four, block, scales, codes, out))
    }

    /// The error bound for a block absmax `absmax`: half an ulp (nearest) or one spacing
    /// (stochastic) of the quotient, plus half or one subnormal spacing, in units of the
    /// block scale, plus the f32 roundings of the quotient and the product; infinite
    /// without a scale past `FMAX`, and with an E8M0 scale past half of f32's range
    /// (where rounding up can overflow).
    pub fn error_bound(&self, absmax: f64) -> f64 {
        let f = self.f;
        let fmax = f64::from(f.max());
        let m = f.m as i32;
        let (rel, sub) = match self.rounding {
            Rounding::Nearest => (2f64.powi(-(m + 1)), 2f64.powi(-f.bias - m)),
            Rounding::Stochastic => (2f64.powi(-m), 2f64.powi(1 - f.bias - m)),
        };
        let s = match self.scale {
            k8::Scale::None if absmax > fmax => return f64::INFINITY,
            k8::Scale::None => 1.0,
            // f32: at most absmax / FMAX rounded up, or 2^-126; E8M0: below 2 absmax /
            // FMAX, or 2^-127.
            k8::Scale::F32 => (absmax / fmax * (1.0 + 2f64.powi(-23))).max(2f64.powi(-126)),
            // OCP's rule: at most absmax / 2^emax, or 2^-127; never past f32's range.
            k8::Scale::E8m0 | k8::Scale::E8m0Floor if self.ocp => {
                (absmax / 2f64.powi(f.emax())).max(2f64.powi(-127))
            }
            k8::Scale::E8m0 | k8::Scale::E8m0Floor if 2.0 * absmax > f64::from(f32::MAX) => {
                return f64::INFINITY;
            }
            k8::Scale::E8m0 | k8::Scale::E8m0Floor => (2.0 * absmax / fmax).max(2f64.powi(-127)),
            // E4M3 times the frame scale `g <= max(absmax / (448 FMAX), 2^-126)`: the
            // byte rounds `m / (FMAX g)` up by at most 2^-3 of it, or by 2^-9.
            k8::Scale::E4m3 { .. } => {
                let g = (absmax / (fmax * 448.0)).max(2f64.powi(-126)) * (1.0 + 2f64.powi(-22));
                1.125 * absmax / fmax + 2f64.powi(-9) * g
            }
        };
        // 2^-145: a subnormal product `v g` can lose up to 2^-150 of the scale, which the
        // clamp of the block's largest quotient turns into at most FMAX 2^-150.
        // E4M3: the roundings of `g`, `FMAX g` and the quotient can leave `m / (FMAX g)`
        // up to 3 2^-24 above 448, clamped to it.
        // OCP's rule: the largest quotients, below 2^(emax+1), clamped to FMAX.
        let clamp = match self.scale {
            k8::Scale::E4m3 { .. } => 2f64.powi(-21) * absmax,
            _ if self.ocp => (1.0 - fmax / 2f64.powi(f.emax() + 1)) * absmax,
            _ => 0.0,
        };
        (rel * absmax + s * sub + 2f64.powi(-23) * absmax + clamp) * (1.0 + 2f64.powi(-20))
            + 2f64.powi(-145)
    }

    /// Check the block scales: an f32 scale must be `>= 0` or NaN (its sign bit clear, not
    /// `+Inf`), an E4M3 byte must have its sign bit clear; every E8M0 byte is valid.
    pub fn check_scales(&self, h: &Header, scales: &[u8]) -> Result<()> {
        if let k8::Scale::E4m3 { .. } = self.scale {
            if let Some(b) = scales.iter().position(|&v| v & 0x80 != 0) {
                return Err(Error::Corrupt {
                    codec: h.codec,
                    offset: HEADER_LEN + b,
                    reason: format!(
                        "the E4M3 scale of block {b} is {:#04x}, negative (encoders write a \
                         scale >= 0 or NaN 0x7f)",
                        scales[b]
                    ),
                });
            }
            return Ok(());
        }
        if self.scale != k8::Scale::F32 {
            return Ok(());
        }
        if kernels::f32_scales_valid(scales) {
            return Ok(());
        }
        for (b, sc) in scales.chunks_exact(4).enumerate() {
            let s = k8::scale_of(self.scale, sc);
            if s.is_infinite() || s.is_sign_negative() {
                return Err(Error::Corrupt {
                    codec: h.codec,
                    offset: HEADER_LEN + 4 * b,
                    reason: format!(
                        "the scale of block {b} is {s} (encoders write a finite scale >= 0 or NaN)"
                    ),
                });
            }
        }
        Ok(())
    }
}

super::stage::stage_methods!(Fp8);

impl fmt::Display for Fp8 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fp8:format={},block={},scale={},rounding={}{}{}",
            self.format.name(),
            self.block,
            self.scale.name(),
            self.rounding.name(),
            self.rule.suffix(),
            super::stage::suffix(self.entropy)
        )
    }
}

impl From<Fp8> for CodecSpec {
    fn from(c: Fp8) -> CodecSpec {
        CodecSpec::Fp8(c)
    }
}

impl Scheme for Fp8 {
    const ID: CodecId = CodecId::Fp8;
    const STAGE: bool = true;
    fixed::fixed_scheme!();

    fn read(h: &Header) -> Result<Fp8> {
        let block = read_block(h)? as u32;
        let bad = |field: &'static str, reason: String| Error::BadField {
            codec: h.codec,
            field,
            reason,
        };
        let format = match h.params[4] {
            0 => Fp8Format::E4m3,
            1 => Fp8Format::E5m2,
            b => {
                return Err(bad(
                    "params.format",
                    format!("{b} is not 0 (e4m3) or 1 (e5m2)"),
                ));
            }
        };
        let scale = match h.params[5] {
            0 => Fp8Scale::F32,
            1 => Fp8Scale::E8m0,
            2 => Fp8Scale::None,
            b => {
                return Err(bad(
                    "params.scale",
                    format!("{b} is not 0 (f32), 1 (e8m0) or 2 (none)"),
                ));
            }
        };
        if scale == Fp8Scale::None && block != 1 {
            return Err(bad(
                "params.block",
                format!("block size {block} with no scale (must be 1)"),
            ));
        }
        let rounding = Rounding::read(h, 6)?;
        h.params_zero(7..11)?;
        if rounding == Rounding::Nearest {
            h.seed_zero()?;
        }
        let rule = ScaleRule::read(h, scale == Fp8Scale::E8m0)?;
        let c = Fp8 {
            format,
            block,
            scale,
            rounding,
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

impl FixedRate for Fp8 {
    fn staged(&self) -> bool {
        self.entropy
    }

    fn refuses_code(&self, c: u8) -> bool {
        // With a scale, encoders write finite codes (see `validate`).
        let mask = self.nonfinite_mask();
        self.scale != Fp8Scale::None && c & mask == mask
    }

    fn params(&self) -> [u8; 12] {
        let scale = match self.scale {
            Fp8Scale::F32 => 0,
            Fp8Scale::E8m0 => 1,
            Fp8Scale::None => 2,
        };
        self.core().params(self.format as u8, scale)
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
        // With a scale, encoders clamp every quotient to ±FMAX: a NaN or ±Inf code is
        // refused (its product with a zero or NaN scale would depend on the CPU). One
        // branch-free pass finds whether there is one; a second, only then, where.
        if self.scale != Fp8Scale::None && kernels::any_all_set(codes, self.nonfinite_mask()) {
            let i = codes
                .iter()
                .position(|&c| self.refuses_code(c))
                .unwrap_or(0);
            return Err(Error::Corrupt {
                codec: h.codec,
                offset: HEADER_LEN + scales.len() + i,
                reason: format!(
                    "code {i} is {:#04x}, NaN or ±Inf, in a scaled frame (encoders write \
                     finite codes)",
                    codes[i]
                ),
            });
        }
        Ok(())
    }

    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]) {
        self.core().decode(m, scales, codes, out)
    }
}
