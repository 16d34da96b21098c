//! The fixed-rate codecs' shared machinery: a payload of per-block scales followed by
//! per-element codes, cut into independent ranges of whole blocks. Sequential encode and
//! decode, the parallel split (`crate::parallel`) and the fused error-feedback step all
//! run on those ranges, so each codec only says how to encode and decode one range.

use core::sync::atomic::{AtomicU32, Ordering};

use super::{EncodeCtx, Encoded, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::{self, mode};
use crate::parallel::{self, Split};
use crate::wire::Header;

/// Payload layout of a fixed-rate codec: one scale of `scale_bytes` bytes per block of
/// `block` elements, then one code of `bits` bits per element as an LSB-first stream.
/// Element-wise codecs have `scale_bytes == 0` (and `block == 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub block: usize,
    pub scale_bytes: usize,
    pub bits: usize,
}

pub(crate) const fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl Layout {
    /// Bytes of the scale section for `n` elements.
    pub fn scales_len(&self, n: usize) -> usize {
        n.div_ceil(self.block) * self.scale_bytes
    }

    /// Bytes of the code section for `n` elements.
    pub fn codes_len(&self, n: usize) -> usize {
        (n * self.bits).div_ceil(8)
    }

    /// Payload bytes for `n` elements; `None` on overflow.
    pub fn payload_len(&self, n: u64) -> Option<u64> {
        super::block_payload(
            n,
            self.block as u64,
            self.scale_bytes as u64,
            self.bits as u64,
        )
    }

    /// The smallest range that starts every section on a byte boundary: a whole number of
    /// blocks and of code bytes.
    pub fn unit(&self) -> usize {
        let per_byte = 8 / gcd(8, self.bits);
        self.block / gcd(self.block, per_byte) * per_byte
    }

    /// A range length near `target` elements: a multiple of [`Layout::unit`], at least one.
    pub fn range_near(&self, target: usize) -> usize {
        let u = self.unit();
        (target / u).max(1).saturating_mul(u)
    }
}

/// The per-codec part of a fixed-rate codec: how one range of whole blocks is encoded and
/// decoded. Ranges encoded separately (each with its global offset in `ctx`) concatenate
/// to exactly the bytes of a whole encode.
pub trait FixedRate: Sync {
    /// Header params bytes 40..52.
    fn params(&self) -> [u8; 12];
    /// Whether frames record the seed (the codec draws random numbers).
    fn seeded(&self) -> bool;
    /// Encode cost per element in half-decodes (a decode is 2; 2: about memory speed;
    /// 4: int8's rounding; 8: a hash draw per element; 1: sign, whose encode is so fast
    /// that two threads only gain from 2 Mi elements). Scales the parallel threshold.
    fn encode_weight(&self) -> usize {
        2
    }
    /// The payload layout.
    fn layout(&self) -> Layout;
    /// Encode `x`, whose first element has global index `ctx.offset`, into its scales and
    /// codes (exactly `layout().scales_len(x.len())` and `codes_len` bytes); true if `x`
    /// held NaN or ±Inf.
    fn encode_sections(
        &self,
        x: &[f32],
        ctx: &EncodeCtx,
        scales: &mut [u8],
        codes: &mut [u8],
    ) -> bool;
    /// Check everything a decoder must before writing (payload length is already checked).
    /// With the entropy stage, `codes` is empty here: the stage checks the codes itself
    /// (their padding, and [`FixedRate::refuses_code`]).
    fn validate(&self, _h: &Header, _scales: &[u8], _codes: &[u8]) -> Result<()> {
        Ok(())
    }
    /// Whether the code section is entropy-coded (the spec's `entropy=on`).
    fn staged(&self) -> bool {
        false
    }
    /// Whether a code byte is one encoders never write (the stage refuses an entropy
    /// block that has a code for it); only byte-wide codes refuse any.
    fn refuses_code(&self, _c: u8) -> bool {
        false
    }
    /// A fused error-feedback step over one tile with an f32 residual, if the codec has
    /// one: `r` holds the residual and becomes the new one, exactly as forming `p`,
    /// [`FixedRate::encode_sections`] and a residual-mode decode would leave it. `None`
    /// (the default) runs those three passes instead.
    #[allow(clippy::too_many_arguments)]
    fn feedback_fused(
        &self,
        _r: &mut [f32],
        _g: &[f32],
        _beta: f32,
        _gamma: f32,
        _ctx: &EncodeCtx,
        _scales: &mut [u8],
        _codes: &mut [u8],
    ) -> Option<bool> {
        None
    }
    /// A fused ring hop over one tile, if the codec has one: `local` plus the decode of
    /// the received sections `input`, encoded into `scales` and `codes` exactly as a copy,
    /// a `mode::ADD` [`FixedRate::decode_sections`] and [`FixedRate::encode_sections`]
    /// would encode it. `sum` (as long as `local`) is scratch space: what it holds
    /// afterwards is unspecified. `None` (the default) runs those steps instead.
    #[allow(clippy::too_many_arguments)]
    fn hop_fused(
        &self,
        _local: &[f32],
        _input: (&[u8], &[u8]),
        _ctx: &EncodeCtx,
        _sum: &mut [f32],
        _scales: &mut [u8],
        _codes: &mut [u8],
    ) -> Option<bool> {
        None
    }
    /// Decode one range into `out` in mode `m` (see [`kernels::mode`]).
    fn decode_sections(&self, m: u8, scales: &[u8], codes: &[u8], out: &mut [f32]);
}

/// The `Scheme` methods every fixed-rate codec shares: its payload size comes from its
/// [`Layout`], and encode and decode run through this module (in ranges, in parallel for
/// large tensors). Expands inside an `impl Scheme` block.
macro_rules! fixed_scheme {
    () => {
        fn max_payload(&self, n: u64) -> u64 {
            let l = $crate::codecs::fixed::FixedRate::layout(self);
            if $crate::codecs::fixed::FixedRate::staged(self) {
                return $crate::codecs::stage::max_payload(l, n);
            }
            l.payload_len(n).unwrap_or(u64::MAX)
        }

        /// The payload without the stage (with it, the bound: one more byte), since what
        /// the stage saves depends on the data ([`crate::sync::calibrate`] measures it).
        fn expected_payload(&self, n: u64) -> f64 {
            let l = $crate::codecs::fixed::FixedRate::layout(self);
            let plain = l.payload_len(n).unwrap_or(u64::MAX) as f64;
            if $crate::codecs::fixed::FixedRate::staged(self) {
                plain + 1.0
            } else {
                plain
            }
        }

        fn encode_payload(
            &self,
            x: &[f32],
            ctx: &$crate::codec::EncodeCtx,
            out: &mut [u8],
        ) -> $crate::error::Result<$crate::codecs::Encoded> {
            if $crate::codecs::fixed::FixedRate::staged(self) {
                return $crate::codecs::stage::encode(self, x, ctx, out);
            }
            $crate::codecs::fixed::encode_payload(self, x, ctx, out)
        }

        fn decode_payload<const M: u8>(
            &self,
            h: &$crate::wire::Header,
            p: &[u8],
            out: &mut [f32],
        ) -> $crate::error::Result<()> {
            if h.entropy() {
                return $crate::codecs::stage::decode::<Self, M>(self, h, p, out);
            }
            $crate::codecs::fixed::decode::<Self, M>(self, h, p, out)
        }

        /// `None` with the entropy stage: staged frames have no fixed length and are
        /// encoded and decoded whole.
        fn fixed(&self) -> Option<&dyn $crate::codecs::fixed::FixedRate> {
            if $crate::codecs::fixed::FixedRate::staged(self) {
                None
            } else {
                Some(self)
            }
        }

        fn ranges(&self) -> Option<&dyn $crate::codecs::fixed::FixedRate> {
            Some(self)
        }
    };
}
pub(crate) use fixed_scheme;

/// Runs `$e` with a const `$M` equal to the runtime mode `$m`.
macro_rules! by_mode {
    ($m:expr, $M:ident => $e:expr) => {
        match $m {
            $crate::kernels::mode::WRITE => {
                const $M: u8 = $crate::kernels::mode::WRITE;
                $e
            }
            $crate::kernels::mode::ADD => {
                const $M: u8 = $crate::kernels::mode::ADD;
                $e
            }
            _ => {
                const $M: u8 = $crate::kernels::mode::RESIDUAL;
                $e
            }
        }
    };
}
pub(crate) use by_mode;

struct Enc<'a> {
    l: Layout,
    x: &'a [f32],
    scales: &'a mut [u8],
    codes: &'a mut [u8],
}

impl Split for Enc<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(at);
        let (s0, s1) = self.scales.split_at_mut(self.l.scales_len(at));
        let (c0, c1) = self.codes.split_at_mut(self.l.codes_len(at));
        let l = self.l;
        (
            Enc {
                l,
                x: x0,
                scales: s0,
                codes: c0,
            },
            Enc {
                l,
                x: x1,
                scales: s1,
                codes: c1,
            },
        )
    }
}

struct Dec<'a> {
    l: Layout,
    scales: &'a [u8],
    codes: &'a [u8],
    out: &'a mut [f32],
}

impl Split for Dec<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (s0, s1) = self.scales.split_at(self.l.scales_len(at));
        let (c0, c1) = self.codes.split_at(self.l.codes_len(at));
        let (o0, o1) = self.out.split_at_mut(at);
        let l = self.l;
        (
            Dec {
                l,
                scales: s0,
                codes: c0,
                out: o0,
            },
            Dec {
                l,
                scales: s1,
                codes: c1,
                out: o1,
            },
        )
    }
}

/// Encode `x` into the payload area of `out`, in parallel for large tensors. Returns
/// `(payload length, nonfinite)`.
pub(crate) fn encode<F: FixedRate + ?Sized>(
    f: &F,
    x: &[f32],
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<(u64, bool)> {
    let l = f.layout();
    let n = x.len();
    let sl = l.scales_len(n);
    let len = sl + l.codes_len(n);
    let p = payload_buf(out, len as u64)?;
    let (scales, codes) = p.split_at_mut(sl);
    Ok((len as u64, encode_sections_into(f, x, ctx, scales, codes)))
}

/// Encode `x` into its scales and codes (exactly as long as the layout says), in parallel
/// for large tensors; true if `x` held NaN or ±Inf.
pub(crate) fn encode_sections_into<F: FixedRate + ?Sized>(
    f: &F,
    x: &[f32],
    ctx: &EncodeCtx,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let l = f.layout();
    let n = x.len();
    if parallel::worth(n, f.encode_weight()) {
        let b = Enc {
            l,
            x,
            scales,
            codes,
        };
        parallel::for_ranges(b, n, l.range_near(parallel::CHUNK), true, &|b, start| {
            f.encode_sections(
                b.x,
                &ctx.with_offset(ctx.offset + start as u64),
                b.scales,
                b.codes,
            )
        })
    } else {
        f.encode_sections(x, ctx, scales, codes)
    }
}

/// A whole encode: the payload and what the header records.
pub(crate) fn encode_payload<F: FixedRate + ?Sized>(
    f: &F,
    x: &[f32],
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<Encoded> {
    let (payload_len, nonfinite) = encode(f, x, ctx, out)?;
    Ok(encoded(f, payload_len, nonfinite, ctx))
}

/// What the header of a payload of `payload_len` bytes records.
pub(crate) fn encoded<F: FixedRate + ?Sized>(
    f: &F,
    payload_len: u64,
    nonfinite: bool,
    ctx: &EncodeCtx,
) -> Encoded {
    Encoded {
        payload_len,
        params: f.params(),
        nonfinite,
        seed: if f.seeded() { ctx.seed } else { 0 },
        entropy: f.staged(),
    }
}

/// Validate and decode a payload (its length already checked) into `out` in mode `M`, in
/// parallel for large tensors.
pub(crate) fn decode<F: FixedRate + ?Sized, const M: u8>(
    f: &F,
    h: &Header,
    p: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let l = f.layout();
    let n = out.len();
    let (scales, codes) = p.split_at(l.scales_len(n));
    f.validate(h, scales, codes)?;
    decode_validated(f, M, scales, codes, out);
    Ok(())
}

/// Decode sections already validated (`out.len()` elements) in mode `m`, in parallel
/// ranges for large tensors.
pub(crate) fn decode_validated<F: FixedRate + ?Sized>(
    f: &F,
    m: u8,
    scales: &[u8],
    codes: &[u8],
    out: &mut [f32],
) {
    let l = f.layout();
    let n = out.len();
    if parallel::worth(n, 2) {
        let b = Dec {
            l,
            scales,
            codes,
            out,
        };
        parallel::for_ranges(b, n, l.range_near(parallel::CHUNK), true, &|b, _| {
            f.decode_sections(m, b.scales, b.codes, b.out);
            false
        });
    } else {
        f.decode_sections(m, scales, codes, out);
    }
}

/// [`decode`] in write mode with `finish` applied to each range of `out` as soon as it
/// is decoded, while the range is in cache (ranges of about [`parallel::CHUNK`]
/// elements, in parallel for large tensors).
pub(crate) fn decode_then<F: FixedRate + ?Sized>(
    f: &F,
    h: &Header,
    p: &[u8],
    out: &mut [f32],
    finish: &(dyn Fn(&mut [f32]) + Sync),
) -> Result<()> {
    let l = f.layout();
    let n = out.len();
    let (scales, codes) = p.split_at(l.scales_len(n));
    f.validate(h, scales, codes)?;
    let b = Dec {
        l,
        scales,
        codes,
        out,
    };
    let range = l.range_near(parallel::CHUNK);
    parallel::for_ranges(b, n, range, parallel::worth(n, 2), &|b, _| {
        let mut s = 0;
        while s < b.out.len() {
            let e = (s + range).min(b.out.len());
            let (st, ct) = (
                l.scales_len(s)..l.scales_len(e),
                l.codes_len(s)..l.codes_len(e),
            );
            let out = &mut b.out[s..e];
            f.decode_sections(mode::WRITE, &b.scales[st], &b.codes[ct], out);
            finish(out);
            s = e;
        }
        false
    });
    Ok(())
}

// ------------------------------------------------------------------ error feedback

/// Elements per error-feedback tile, before rounding to whole blocks: the tile's `p`,
/// gradient and codes stay in L1 while it is formed, encoded and turned into the residual.
pub(crate) const FEEDBACK_TILE: usize = 2048;

/// The residual state a feedback step updates.
pub enum ResidualMut<'a> {
    /// f32 residual, updated in place (it holds `p` while a tile is encoded).
    F32(&'a mut [f32]),
    /// bf16 residual; `scratch` holds one tile of `p` in f32 per range.
    Bf16 {
        r: &'a mut [u16],
        scratch: &'a mut [f32],
    },
}

struct Fb<'a> {
    l: Layout,
    tile: usize,
    g: &'a [f32],
    r: ResidualMut<'a>,
    scales: &'a mut [u8],
    codes: &'a mut [u8],
}

impl Split for Fb<'_> {
    fn split(self, at: usize, pieces: usize) -> (Self, Self) {
        let (g0, g1) = self.g.split_at(at);
        let (r0, r1) = self.r.split(at, pieces, self.tile);
        let (s0, s1) = self.scales.split_at_mut(self.l.scales_len(at));
        let (c0, c1) = self.codes.split_at_mut(self.l.codes_len(at));
        let (l, tile) = (self.l, self.tile);
        (
            Fb {
                l,
                tile,
                g: g0,
                r: r0,
                scales: s0,
                codes: c0,
            },
            Fb {
                l,
                tile,
                g: g1,
                r: r1,
                scales: s1,
                codes: c1,
            },
        )
    }
}

impl<'a> ResidualMut<'a> {
    /// The residual of elements `..at` and `at..`, where `at` starts range `pieces` of
    /// ranges of `tile`-element scratch each (the bf16 scratch holds one tile per range).
    fn split(self, at: usize, pieces: usize, tile: usize) -> (Self, Self) {
        match self {
            ResidualMut::F32(r) => {
                let (a, b) = r.split_at_mut(at);
                (ResidualMut::F32(a), ResidualMut::F32(b))
            }
            ResidualMut::Bf16 { r, scratch } => {
                let (a, b) = r.split_at_mut(at);
                let (sa, sb) = scratch.split_at_mut((pieces * tile).min(scratch.len()));
                (
                    ResidualMut::Bf16 { r: a, scratch: sa },
                    ResidualMut::Bf16 { r: b, scratch: sb },
                )
            }
        }
    }
}

/// Tile length and bf16 scratch length (in f32) a feedback state of `n` elements needs.
pub(crate) fn feedback_scratch(l: Layout, n: usize) -> (usize, usize) {
    let tile = l.range_near(FEEDBACK_TILE);
    let range = l.range_near(parallel::CHUNK).max(tile);
    let ranges = n.div_ceil(range);
    (tile, ranges.saturating_mul(tile).min(n))
}

/// One fused error-feedback step of a fixed-rate codec: per tile, `p = beta * r + gamma *
/// g` is formed, encoded into the payload area of `out`, and turned into the residual
/// `residual_of(p, decoded)` (the decode kernel's residual mode) while the tile is in
/// cache. The gradient and the residual are read once and the residual written once.
#[allow(clippy::too_many_arguments)]
pub(crate) fn feedback<F: FixedRate + ?Sized>(
    f: &F,
    g: &[f32],
    r: ResidualMut<'_>,
    beta: f32,
    gamma: f32,
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<Encoded> {
    let l = f.layout();
    let n = g.len();
    let sl = l.scales_len(n);
    let len = sl + l.codes_len(n);
    let p = payload_buf(out, len as u64)?;
    let (scales, codes) = p.split_at_mut(sl);
    let nonfinite = feedback_sections(f, g, r, (beta, gamma), ctx, scales, codes);
    Ok(encoded(f, len as u64, nonfinite, ctx))
}

/// [`feedback`] into the scales and codes of the layout (exactly as long as it says);
/// true if the formed input held NaN or ±Inf.
pub(crate) fn feedback_sections<F: FixedRate + ?Sized>(
    f: &F,
    g: &[f32],
    r: ResidualMut<'_>,
    (beta, gamma): (f32, f32),
    ctx: &EncodeCtx,
    scales: &mut [u8],
    codes: &mut [u8],
) -> bool {
    let l = f.layout();
    let n = g.len();
    let (tile, _) = feedback_scratch(l, n);
    let range = l.range_near(parallel::CHUNK).max(tile);
    let b = Fb {
        l,
        tile,
        g,
        r,
        scales,
        codes,
    };
    parallel::for_ranges(
        b,
        n,
        range,
        parallel::worth(n, 2 * f.encode_weight()),
        &|b, start| {
            feedback_range(
                f,
                b,
                beta,
                gamma,
                &ctx.with_offset(ctx.offset + start as u64),
            )
        },
    )
}

/// The tiles of one range, in order; `ctx.offset` is the range's first global index.
fn feedback_range<F: FixedRate + ?Sized>(
    f: &F,
    b: Fb<'_>,
    beta: f32,
    gamma: f32,
    ctx: &EncodeCtx,
) -> bool {
    let Fb {
        l,
        tile,
        g,
        mut r,
        scales,
        codes,
    } = b;
    let n = g.len();
    let mut nonfinite = false;
    let mut s = 0;
    while s < n {
        let e = (s + tile).min(n);
        let tctx = ctx.with_offset(ctx.offset + s as u64);
        let sc = &mut scales[l.scales_len(s)..l.scales_len(e)];
        let co = &mut codes[l.codes_len(s)..l.codes_len(e)];
        nonfinite |= feedback_tile(f, &mut r, s..e, &g[s..e], (beta, gamma), &tctx, sc, co);
        s = e;
    }
    nonfinite
}

/// One tile's error-feedback step: elements `t` of the residual `r` and the tile's
/// gradient `g` (`t.len()` elements), encoded into the tile's scales and codes; true if
/// the formed tile held NaN or ±Inf.
#[allow(clippy::too_many_arguments)]
fn feedback_tile<F: FixedRate + ?Sized>(
    f: &F,
    r: &mut ResidualMut<'_>,
    t: core::ops::Range<usize>,
    g: &[f32],
    (beta, gamma): (f32, f32),
    ctx: &EncodeCtx,
    sc: &mut [u8],
    co: &mut [u8],
) -> bool {
    match r {
        ResidualMut::F32(r) => {
            let r = &mut r[t];
            if let Some(nf) = f.feedback_fused(r, g, beta, gamma, ctx, sc, co) {
                return nf;
            }
            kernels::feedback_form(r, g, beta, gamma);
            let nf = f.encode_sections(r, ctx, sc, co);
            f.decode_sections(mode::RESIDUAL, sc, co, r);
            nf
        }
        ResidualMut::Bf16 { r, scratch } => {
            let (p, r) = (&mut scratch[..t.len()], &mut r[t]);
            kernels::feedback_form_bf16(p, r, g, beta, gamma);
            let nf = f.encode_sections(p, ctx, sc, co);
            f.decode_sections(mode::RESIDUAL, sc, co, p);
            kernels::feedback_store_bf16(r, p);
            nf
        }
    }
}

// ------------------------------------------------------------------ fused ring hop

/// The most elements a fused ring hop's tile may hold: its sum lives on the stack.
const HOP_TILE_MAX: usize = 4096;

/// The tile of a fused ring hop with layout `l` (that of error feedback, so that a bf16
/// residual's scratch splits the same way), if it fits [`HOP_TILE_MAX`].
pub(crate) fn hop_tile(l: Layout) -> Option<usize> {
    Some(l.range_near(FEEDBACK_TILE)).filter(|&t| t <= HOP_TILE_MAX)
}

/// The local side of a fused ring hop (see [`hop`]).
pub(crate) enum HopAcc<'a> {
    /// A partial sum on its way: `acc + decode(frame)` is encoded and not kept.
    Forward(&'a [f32]),
    /// The owner's hop: the sum is encoded, and `dst` gets the decode of that frame,
    /// then the hop's `finish`. `src` holds the local values (`None`: `dst` holds them).
    Own {
        src: Option<&'a [f32]>,
        dst: &'a mut [f32],
    },
}

impl HopAcc<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            HopAcc::Forward(a) => a.len(),
            HopAcc::Own { dst, .. } => dst.len(),
        }
    }

    /// The local values of elements `t`.
    fn local(&self, t: core::ops::Range<usize>) -> &[f32] {
        match self {
            HopAcc::Forward(a) | HopAcc::Own { src: Some(a), .. } => &a[t],
            HopAcc::Own { src: None, dst } => &dst[t],
        }
    }
}

struct Hop<'a> {
    l: Layout,
    tile: usize,
    in_scales: &'a [u8],
    in_codes: &'a [u8],
    acc: HopAcc<'a>,
    r: Option<ResidualMut<'a>>,
    scales: &'a mut [u8],
    codes: &'a mut [u8],
}

impl Split for Hop<'_> {
    fn split(self, at: usize, pieces: usize) -> (Self, Self) {
        let (l, tile) = (self.l, self.tile);
        let (is0, is1) = self.in_scales.split_at(l.scales_len(at));
        let (ic0, ic1) = self.in_codes.split_at(l.codes_len(at));
        let (a0, a1) = match self.acc {
            HopAcc::Forward(a) => {
                let (a0, a1) = a.split_at(at);
                (HopAcc::Forward(a0), HopAcc::Forward(a1))
            }
            HopAcc::Own { src, dst } => {
                let (s0, s1) = src.map(|x| x.split_at(at)).unzip();
                let (d0, d1) = dst.split_at_mut(at);
                (
                    HopAcc::Own { src: s0, dst: d0 },
                    HopAcc::Own { src: s1, dst: d1 },
                )
            }
        };
        let (r0, r1) = self.r.map(|r| r.split(at, pieces, tile)).unzip();
        let (s0, s1) = self.scales.split_at_mut(l.scales_len(at));
        let (c0, c1) = self.codes.split_at_mut(l.codes_len(at));
        (
            Hop {
                l,
                tile,
                in_scales: is0,
                in_codes: ic0,
                acc: a0,
                r: r0,
                scales: s0,
                codes: c0,
            },
            Hop {
                l,
                tile,
                in_scales: is1,
                in_codes: ic1,
                acc: a1,
                r: r1,
                scales: s1,
                codes: c1,
            },
        )
    }
}

/// One hop of a compressed ring's reduce-scatter, fused: per tile, the received frame's
/// sections (`frame`, validated, this codec's layout) are decoded onto the local values,
/// and that sum is encoded into the payload area of `out`, through the residual of `fb`
/// (with its weights) if given, while the tile is in cache. For the owner's hop `dst` then
/// gets the decode of the tile just encoded, and `finish` (the mean). The same bytes,
/// residual and values as `decode_add` into the local values, an encode (or error-feedback
/// step) of the sum and a decode of that frame, without writing or reading the sum in
/// memory. Errors if the codec's tile does not fit the stack ([`hop_tile`]).
pub(crate) fn hop<F: FixedRate + ?Sized>(
    f: &F,
    frame: (&[u8], &[u8]),
    acc: HopAcc<'_>,
    fb: Option<(ResidualMut<'_>, f32, f32)>,
    finish: &(dyn Fn(&mut [f32]) + Sync),
    ctx: &EncodeCtx,
    out: &mut [u8],
) -> Result<Encoded> {
    let l = f.layout();
    let n = acc.len();
    let Some(tile) = hop_tile(l) else {
        return Err(Error::Collective(format!(
            "ranges of {} elements are too long for a fused ring hop",
            l.unit()
        )));
    };
    let sl = l.scales_len(n);
    let len = sl + l.codes_len(n);
    let p = payload_buf(out, len as u64)?;
    let (scales, codes) = p.split_at_mut(sl);
    let (weights, r) = match fb {
        Some((r, beta, gamma)) => ((beta, gamma), Some(r)),
        None => ((1.0, 1.0), None),
    };
    let range = l.range_near(parallel::CHUNK).max(tile);
    let b = Hop {
        l,
        tile,
        in_scales: frame.0,
        in_codes: frame.1,
        acc,
        r,
        scales,
        codes,
    };
    let weight = 2 + f.encode_weight();
    let nonfinite = parallel::for_ranges(b, n, range, parallel::worth(n, weight), &|b, start| {
        hop_range(
            f,
            b,
            weights,
            finish,
            &ctx.with_offset(ctx.offset + start as u64),
        )
    });
    Ok(encoded(f, len as u64, nonfinite, ctx))
}

/// The tiles of one range of a fused hop, in order; `ctx.offset` is the range's first
/// global index.
fn hop_range<F: FixedRate + ?Sized>(
    f: &F,
    b: Hop<'_>,
    weights: (f32, f32),
    finish: &(dyn Fn(&mut [f32]) + Sync),
    ctx: &EncodeCtx,
) -> bool {
    let Hop {
        l,
        tile,
        in_scales,
        in_codes,
        mut acc,
        mut r,
        scales,
        codes,
    } = b;
    let mut sum = [0f32; HOP_TILE_MAX];
    let n = acc.len();
    let mut nonfinite = false;
    let mut s = 0;
    while s < n {
        let e = (s + tile).min(n);
        let (st, ct) = (
            l.scales_len(s)..l.scales_len(e),
            l.codes_len(s)..l.codes_len(e),
        );
        let t = &mut sum[..e - s];
        let input = (&in_scales[st.clone()], &in_codes[ct.clone()]);
        let tctx = ctx.with_offset(ctx.offset + s as u64);
        let (sc, co) = (&mut scales[st], &mut codes[ct]);
        let fused = match r {
            None => f.hop_fused(acc.local(s..e), input, &tctx, t, sc, co),
            Some(_) => None,
        };
        nonfinite |= match (fused, &mut r) {
            (Some(nf), _) => nf,
            (None, r) => {
                t.copy_from_slice(acc.local(s..e));
                f.decode_sections(mode::ADD, input.0, input.1, t);
                match r {
                    None => f.encode_sections(t, &tctx, sc, co),
                    Some(r) => feedback_tile(f, r, s..e, t, weights, &tctx, sc, co),
                }
            }
        };
        if let HopAcc::Own { dst, .. } = &mut acc {
            let d = &mut dst[s..e];
            f.decode_sections(mode::WRITE, sc, co, d);
            finish(d);
        }
        s = e;
    }
    nonfinite
}

// ------------------------------------------------------------------ frame-wide scales

/// The largest |x| among the finite elements of `x` (0 if none), on all threads for
/// large tensors (a maximum, so the same for any split).
pub(crate) fn max_finite_abs(x: &[f32]) -> f32 {
    let m = AtomicU32::new(0);
    let n = x.len();
    parallel::for_ranges(x, n, parallel::CHUNK, parallel::worth(n, 1), &|x, _| {
        m.fetch_max(kernels::max_finite_abs_bits(x), Ordering::Relaxed);
        false
    });
    f32::from_bits(m.into_inner())
}

/// [`max_finite_abs`] of the error-feedback input `p = beta r + gamma g`, formed tile by
/// tile exactly as [`feedback`] forms it, without changing `r`.
pub(crate) fn formed_max_finite_abs(r: &ResidualMut<'_>, g: &[f32], beta: f32, gamma: f32) -> f32 {
    let m = AtomicU32::new(0);
    let n = g.len();
    let par = parallel::worth(n, 2);
    // One range's largest, `form` writing the formed tile of elements `s..e` into `p`.
    let range_max = |n: usize, form: &dyn Fn(&mut [f32], usize, usize)| {
        let mut p = [0f32; FEEDBACK_TILE];
        let mut best = 0;
        for s in (0..n).step_by(FEEDBACK_TILE) {
            let e = (s + FEEDBACK_TILE).min(n);
            form(&mut p[..e - s], s, e);
            best = best.max(kernels::max_finite_abs_bits(&p[..e - s]));
        }
        m.fetch_max(best, Ordering::Relaxed);
        false
    };
    match r {
        ResidualMut::F32(r) => {
            parallel::for_ranges((&r[..], g), n, parallel::CHUNK, par, &|(r, g), _| {
                range_max(g.len(), &|p, s, e| {
                    p.copy_from_slice(&r[s..e]);
                    kernels::feedback_form(p, &g[s..e], beta, gamma);
                })
            });
        }
        ResidualMut::Bf16 { r, .. } => {
            parallel::for_ranges((&r[..], g), n, parallel::CHUNK, par, &|(r, g), _| {
                range_max(g.len(), &|p, s, e| {
                    kernels::feedback_form_bf16(p, &r[s..e], &g[s..e], beta, gamma);
                })
            });
        }
    }
    f32::from_bits(m.into_inner())
}
