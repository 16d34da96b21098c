//! `randk`: random sparsification with indices derived from a shared hash, so frames
//! carry values only.
//!
//! Two selections, both functions of the seed and the *global* index only, so ranks that
//! share a seed keep the same indices, a tensor chunked anywhere keeps the same ones, and
//! the decoder recomputes them from the header's seed and offset. Both keep a fraction
//! `p = t / 2^32` of the elements on average, with `t = clamp(round(ratio * 2^32), 1, 2^32)`.
//!
//! - `select=bernoulli` (the default): element `i` (global index `offset + i`) is kept
//!   when `draw(seed, STREAM_SELECT, offset + i) < t`, each independently with
//!   probability `p`. Encoding and decoding cost one hash draw per element, kept or not.
//! - `select=strata`: the global index line is cut into strata of `floor(2^32 / t)` or
//!   `ceil(2^32 / t)` elements (stratum `j` starts at `floor(j * 2^32 / t)`, exact integer
//!   arithmetic), and one element of each stratum is kept, chosen by one draw per stratum
//!   (`STREAM_STRATA`). Encoding and decoding cost one draw per *kept* element (plus,
//!   for a plain decode, zeroing the output and, for encode, the scan for NaN and Inf):
//!   the cost grows with `k`, not `n`. The kept elements are spread evenly (one per
//!   stratum), and a tensor of `n` elements keeps `n p` of them, give or take one.
//!
//! Payload: the kept values in index order, f32 LE, fp16 LE or bf16 LE. With `scale=unbiased` the
//! encoder sends `x / p` (bernoulli: in f32, `x * (2^32 / t)`; strata: `x * s`, `s` the
//! length of the element's stratum, its exact inverse keep probability), making the
//! decoding an unbiased estimate of the input; with `scale=none` (the default, for use
//! with error feedback) it sends `x` and the estimate is biased towards zero by the
//! factor `p`.
//!
//! NaN and ±Inf: an unsent element could hide an overflow, so when the input holds any
//! NaN or ±Inf the frame's NONFINITE flag is set and *every* element decodes to NaN.
//!
//! Frames of ranks that share a seed keep the same elements, so they can be summed value
//! by value, compressed, with [`RandK::add_frame`]: no index is computed or sent.
//!
//! Bernoulli decoding refuses a frame whose selection does not hold exactly as many
//! elements as its payload has values. `decode_add` must leave the accumulator untouched
//! then, so it counts before it adds: it keeps the keep masks of the first
//! [`STORED_MASK_ELEMENTS`](crate::kernels::STORED_MASK_ELEMENTS) elements from the
//! counting pass (32 KiB on the stack) and draws the rest twice. Strata decoding counts
//! its selection from the two boundary strata alone, before it writes anything.

use core::fmt;

use super::values::{ValueReader, ValueWriter};
use super::{EncodeCtx, Encoded, Scheme, ValueType};
use crate::codec::{Args, CodecId, CodecSpec, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::{
    self,
    scalar::{CANONICAL_NAN, put},
};
use crate::parallel::{self, Split};
use crate::rng::{Draws, STREAM_SELECT, STREAM_STRATA};
use crate::wire::{FLAG_NONFINITE, HEADER_LEN, Header};

/// Whether random-k rescales kept values by `1 / p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RandKScale {
    /// Send values as they are (biased; use with error feedback).
    #[default]
    None,
    /// Send `x / p`: the decoding is an unbiased estimate.
    Unbiased,
}

/// How random-k chooses the elements it keeps (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RandKSelect {
    /// Each element independently, by one hash draw per element.
    #[default]
    Bernoulli,
    /// One element per stratum of about `1 / ratio` elements, by one hash draw per stratum:
    /// encode and decode cost grows with the number kept.
    Strata,
}

/// Random-k with hash-derived indices.
///
/// Two random-k codecs are equal when they write the same frames: the same threshold
/// ([`RandK::threshold`], which a frame records, so ratios that round to it are one
/// codec), values, scale and selection.
#[derive(Debug, Clone, Copy)]
pub struct RandK {
    ratio: f64,
    values: ValueType,
    scale: RandKScale,
    select: RandKSelect,
}

impl PartialEq for RandK {
    fn eq(&self, o: &RandK) -> bool {
        self.threshold() == o.threshold()
            && self.values == o.values
            && self.scale == o.scale
            && self.select == o.select
    }
}

impl Default for RandK {
    fn default() -> Self {
        RandK {
            ratio: 0.01,
            values: ValueType::F32,
            scale: RandKScale::None,
            select: RandKSelect::Bernoulli,
        }
    }
}

impl RandK {
    /// Random-k keeping each element with probability `ratio` (in (0, 1]).
    pub fn new(ratio: f64, values: ValueType, scale: RandKScale) -> Result<RandK> {
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(Error::Param {
                codec: CodecId::RandK,
                name: "ratio",
                reason: format!("{ratio} is not in (0, 1]"),
            });
        }
        Ok(RandK {
            ratio,
            values,
            scale,
            select: RandKSelect::Bernoulli,
        })
    }

    /// The same codec with selection `select`.
    pub fn with_select(self, select: RandKSelect) -> RandK {
        RandK { select, ..self }
    }

    /// How the kept elements are chosen.
    pub fn select(&self) -> RandKSelect {
        self.select
    }

    /// The largest factor `scale=unbiased` multiplies a value by: `2^32 / t` for bernoulli
    /// selection, the longest stratum `ceil(2^32 / t)` for strata.
    pub fn max_scale(&self) -> f64 {
        let t = self.threshold();
        match self.select {
            RandKSelect::Bernoulli => 4_294_967_296.0 / t as f64,
            RandKSelect::Strata => (1u64 << 32).div_ceil(t) as f64,
        }
    }

    /// The keep probability as configured.
    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// How kept values are stored.
    pub fn values(&self) -> ValueType {
        self.values
    }

    /// Whether kept values are rescaled by `1 / p`.
    pub fn scale(&self) -> RandKScale {
        self.scale
    }

    /// The 33-bit selection threshold `t` (an element is kept when its draw is below it).
    pub fn threshold(&self) -> u64 {
        ((self.ratio * 4_294_967_296.0).round() as u64).clamp(1, 1 << 32)
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<RandK, String> {
        let ratio = a.ratio("ratio")?.unwrap_or(0.01);
        let values = ValueType::parse(a)?;
        if values == ValueType::Int8 {
            return Err("`values=int8` is for top-k; random-k takes f32, fp16 or bf16".into());
        }
        let scale = match a.choice("scale", "none", &["none", "unbiased"])? {
            "unbiased" => RandKScale::Unbiased,
            _ => RandKScale::None,
        };
        let select = match a.choice("select", "bernoulli", &["bernoulli", "strata"])? {
            "strata" => RandKSelect::Strata,
            _ => RandKSelect::Bernoulli,
        };
        Ok(RandK {
            ratio,
            values,
            scale,
            select,
        })
    }
}

/// The ratio with the fewest significant digits whose threshold is `t` (a frame records
/// `t = round(ratio * 2^32)`): `0.01` rather than `0.010000000009313226`, so that a
/// frame's spec prints as it was written and parses back to the same threshold. Only
/// `Display` uses it (it formats, so it allocates; decoding stays allocation-free).
fn shortest_ratio(t: u64) -> f64 {
    let exact = t as f64 / 4_294_967_296.0;
    (0..17)
        .filter_map(|digits| format!("{exact:.digits$e}").parse::<f64>().ok())
        .find(|&r| {
            r > 0.0 && r <= 1.0 && ((r * 4_294_967_296.0).round() as u64).clamp(1, 1 << 32) == t
        })
        .unwrap_or(exact)
}

impl fmt::Display for RandK {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scale = match self.scale {
            RandKScale::None => "none",
            RandKScale::Unbiased => "unbiased",
        };
        write!(
            f,
            "randk:ratio={},values={},scale={scale}",
            shortest_ratio(self.threshold()),
            self.values.name()
        )?;
        // The default selection is left out, so the names of bernoulli specs are unchanged.
        match self.select {
            RandKSelect::Bernoulli => Ok(()),
            RandKSelect::Strata => f.write_str(",select=strata"),
        }
    }
}

impl From<RandK> for CodecSpec {
    fn from(c: RandK) -> CodecSpec {
        CodecSpec::RandK(c)
    }
}

/// Call `f(i)` for each kept position `i` of a slice of `n` at global `offset`.
#[inline]
fn for_each_kept(seed: u64, offset: u64, n: usize, t: u64, f: impl FnMut(usize)) {
    let d = Draws::new(seed, STREAM_SELECT, offset);
    let kept = |pos: usize, idx: &mut [u32]| {
        kernels::filter_draw_lt(&d, offset + pos as u64, t, n - pos, idx)
    };
    kernels::for_each_filtered(n, kept, f);
}

/// Most ranges a parallel encode splits a tensor into (their kept counts live on the
/// stack: the hot path allocates nothing). Ranges are [`crate::parallel::CHUNK`]
/// elements, or longer for tensors of more than `MAX_LEAVES` chunks.
const MAX_LEAVES: usize = 1024;

/// A parallel encode's ranges of `x` with their kept counts (one per range) and, once
/// counted, the payload bytes they write (`counts[i]` values of `vb` bytes each).
struct Ranges<'a> {
    counts: &'a mut [usize],
    x: &'a [f32],
    vals: &'a mut [u8],
    vb: usize,
}

impl Split for Ranges<'_> {
    fn split(self, at: usize, pieces: usize) -> (Self, Self) {
        let (c0, c1) = self.counts.split_at_mut(pieces);
        let (x0, x1) = self.x.split_at(at);
        // Before the counts are known `vals` is empty and splits at 0.
        let (v0, v1) = self
            .vals
            .split_at_mut((c0.iter().sum::<usize>() * self.vb).min(self.vals.len()));
        let vb = self.vb;
        (
            Ranges {
                counts: c0,
                x: x0,
                vals: v0,
                vb,
            },
            Ranges {
                counts: c1,
                x: x1,
                vals: v1,
                vb,
            },
        )
    }
}

/// Elements a strata encode scans (or a decode zeroes) ahead of the kept values: 64 KiB.
const STRATA_PIECE: usize = 1 << 14;

/// Kept positions a strata encode or decode handles at a time.
const STRATA_BATCH: usize = 256;

/// The strata of `select=strata` for a threshold `t`: stratum `j` covers the global
/// indices `b(j) .. b(j + 1)`, `b(j) = floor(j * 2^32 / t)`, and keeps the one at
/// `b(j) + floor(draw(seed, STREAM_STRATA, j) * s / 2^32)`, `s = b(j + 1) - b(j)`.
#[derive(Debug, Clone, Copy)]
struct Strata {
    t: u64,
    /// `2^32 / t` and `2^32 % t`: stratum lengths are `q` or `q + 1`.
    q: u64,
    r: u64,
}

/// One stratum: its number, first index and length.
#[derive(Debug, Clone, Copy)]
struct Stratum {
    j: u64,
    start: u128,
    len: u64,
}

impl Strata {
    fn new(t: u64) -> Strata {
        debug_assert!((1..=1u64 << 32).contains(&t));
        Strata {
            t,
            q: (1u64 << 32) / t,
            r: (1u64 << 32) % t,
        }
    }

    /// Stratum `j`, by one exact division.
    fn stratum(&self, j: u64) -> Stratum {
        let t = self.t as u128;
        let b = |j: u128| (j << 32) / t;
        let start = b(j as u128);
        Stratum {
            j,
            start,
            len: (b(j as u128 + 1) - start) as u64,
        }
    }

    /// The number of the stratum holding global index `g`: the largest `j` with
    /// `b(j) <= g`, which is `ceil((g + 1) t / 2^32) - 1`.
    fn holding(&self, g: u64) -> u64 {
        (((g as u128 + 1) * self.t as u128 - 1) >> 32) as u64
    }

    /// The global index stratum `s` keeps.
    #[inline]
    fn pick(d: &Draws, s: &Stratum) -> u128 {
        s.start + ((d.draw(s.j) as u64 as u128 * s.len as u128) >> 32)
    }

    /// How many of the global indices `offset .. offset + n` are kept: every stratum
    /// between the two that hold the ends, and those two if their pick falls inside.
    fn count(&self, d: &Draws, offset: u64, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let (lo, hi) = (offset as u128, offset as u128 + n as u128);
        let inside = |s: &Stratum| (lo..hi).contains(&Self::pick(d, s));
        let first = self.holding(offset);
        let last = self.holding((hi - 1) as u64);
        if first == last {
            return inside(&self.stratum(first)) as usize;
        }
        (last - first - 1) as usize
            + inside(&self.stratum(first)) as usize
            + inside(&self.stratum(last)) as usize
    }

    /// Calls `f(i, s)` for each kept position `i` of the slice of `n` elements at global
    /// `offset`, in increasing order, `s` the length of its stratum. One draw per stratum;
    /// each length follows from the remainder `rem = j * 2^32 - b(j) t` (`0 <= rem < t`):
    /// stratum `j` has `q + 1` elements when `rem + r >= t`, else `q`.
    #[inline]
    fn for_each(&self, d: &Draws, offset: u64, n: usize, mut f: impl FnMut(usize, u64)) {
        if n == 0 {
            return;
        }
        let (t, q, r) = (self.t, self.q, self.r);
        let mut j = self.holding(offset);
        let first = self.stratum(j).start;
        let mut rem = (((j as u128) << 32) - first * t as u128) as u64;
        // Positions relative to `offset`: the first stratum starts at most 2^32 before
        // it, and the walk stops at `n`, so i64 holds them all.
        let mut start = -((offset as u128 - first) as i64);
        let n_i = n as i64;
        while start < n_i {
            let carry = rem + r >= t;
            let len = q + carry as u64;
            let g = start + ((d.draw(j) as u64 * len) >> 32) as i64;
            if (0..n_i).contains(&g) {
                f(g as usize, len);
            }
            start += len as i64;
            rem = rem + r - if carry { t } else { 0 };
            j = j.wrapping_add(1);
        }
    }

    /// [`Strata::for_each`] in batches of up to [`STRATA_BATCH`] kept positions and their
    /// strata's lengths, so the caller's loads and stores run in tight loops.
    #[inline]
    fn batches(&self, d: &Draws, offset: u64, n: usize, mut f: impl FnMut(&[usize], &[u64])) {
        let mut idx = [0usize; STRATA_BATCH];
        let mut len = [0u64; STRATA_BATCH];
        let mut m = 0;
        self.for_each(d, offset, n, |i, s| {
            idx[m] = i;
            len[m] = s;
            m += 1;
            if m == STRATA_BATCH {
                f(&idx, &len);
                m = 0;
            }
        });
        if m > 0 {
            f(&idx[..m], &len[..m]);
        }
    }
}

impl RandK {
    /// How many of the elements at global indices `offset .. offset + n` are kept.
    fn count(&self, seed: u64, offset: u64, n: usize) -> usize {
        let t = self.threshold();
        match self.select {
            RandKSelect::Bernoulli => {
                kernels::count_draw_lt(&Draws::new(seed, STREAM_SELECT, offset), offset, t, n)
            }
            RandKSelect::Strata => {
                let strata = Strata::new(t);
                let d = Draws::new(seed, STREAM_STRATA, strata.holding(offset));
                strata.count(&d, offset, n)
            }
        }
    }

    /// Writes the kept values of `x` (global offset `offset`), `k` of them, into `vals`
    /// (`k` values long); true if `x` holds NaN or ±Inf.
    fn encode_range(&self, x: &[f32], seed: u64, offset: u64, vals: &mut [u8], k: usize) -> bool {
        let t = self.threshold();
        let unbiased = self.scale == RandKScale::Unbiased;
        match self.select {
            RandKSelect::Bernoulli => {
                let mut values = ValueWriter::new(self.values, vals, k);
                if unbiased {
                    let mul = (4_294_967_296.0 / t as f64) as f32;
                    for_each_kept(seed, offset, x.len(), t, |i| values.push(x[i] * mul));
                } else {
                    // Sent as they are: no multiply by 1, which would quiet a signalling NaN.
                    for_each_kept(seed, offset, x.len(), t, |i| values.push(x[i]));
                }
                values.finish();
                kernels::any_nonfinite(x)
            }
            RandKSelect::Strata => {
                let strata = Strata::new(t);
                let d = Draws::new(seed, STREAM_STRATA, strata.holding(offset));
                // The scan for NaN and Inf runs a piece ahead of the kept values, so each
                // is read while its piece is still in cache.
                let (mut scanned, mut nonfinite, mut j) = (0, false, 0);
                let mut v = [0f32; STRATA_BATCH];
                strata.batches(&d, offset, x.len(), |idx, lens| {
                    let last = idx[idx.len() - 1];
                    while last >= scanned {
                        let end = (scanned + STRATA_PIECE).min(x.len());
                        nonfinite |= kernels::any_nonfinite(&x[scanned..end]);
                        scanned = end;
                    }
                    let v = &mut v[..idx.len()];
                    if unbiased {
                        for ((v, &i), &s) in v.iter_mut().zip(idx).zip(lens) {
                            *v = x[i] * s as f32;
                        }
                    } else {
                        for (v, &i) in v.iter_mut().zip(idx) {
                            *v = x[i];
                        }
                    }
                    self.values.put_slice(vals, k, j, v);
                    j += idx.len();
                });
                nonfinite || kernels::any_nonfinite(&x[scanned..])
            }
        }
    }

    /// Sum two random-k frames value by value, in place: `acc` becomes the frame of the
    /// element-wise sum, without computing a single index or hash draw.
    ///
    /// Frames from ranks that share a seed (and element count, offset, threshold, value type
    /// and scale) keep the same elements (the selection is a function of the seed and the
    /// global index), so their payloads line up value by
    /// value: a reducing collective can add compressed frames and decode once. Each value of
    /// `acc` becomes the f32 sum of the two values, rounded to the value type (exact in f32
    /// arithmetic for `values=f32`; for fp16 and bf16 it is rounded to nearest even once per
    /// addition, as decoding, adding and re-encoding would). The NONFINITE flags are OR-ed (a
    /// frame with it set decodes to NaN everywhere). A sealed `acc` is resealed; a sealed
    /// `frame` is verified.
    ///
    /// `decode(acc after) == round(decode(acc before) + decode(frame))` element by element.
    ///
    /// Errors, leaving `acc` unchanged: either frame is invalid or not random-k, or they
    /// differ in elements, offset, seed, threshold, value type, scale or payload length.
    /// Allocates nothing.
    pub fn add_frame(acc: &mut [u8], frame: &[u8]) -> Result<()> {
        let (ha, _) = crate::wire::split(acc)?;
        let (hb, pb) = crate::wire::split(frame)?;
        let mut values = ValueType::F32;
        for h in [&ha, &hb] {
            if h.codec != CodecId::RandK {
                return Err(Error::WrongCodec {
                    expected: CodecId::RandK,
                    found: h.codec,
                });
            }
            values = RandK::read(h)?.values;
        }
        let differ = |field, a: &dyn fmt::Debug, b: &dyn fmt::Debug| Error::BadField {
            codec: CodecId::RandK,
            field,
            reason: format!(
                "{a:?} in one frame, {b:?} in the other: random-k frames add value by value \
                 only when they keep the same elements (same seed, offset, element count, \
                 threshold, value type and scale)"
            ),
        };
        if ha.elements != hb.elements {
            return Err(differ("elements", &ha.elements, &hb.elements));
        }
        if ha.offset != hb.offset {
            return Err(differ("offset", &ha.offset, &hb.offset));
        }
        if ha.seed != hb.seed {
            return Err(differ("seed", &ha.seed, &hb.seed));
        }
        if ha.params != hb.params {
            return Err(differ("params", &ha.params, &hb.params));
        }
        if ha.payload_len != hb.payload_len {
            return Err(differ("payload_len", &ha.payload_len, &hb.payload_len));
        }
        let len = HEADER_LEN + ha.payload_len as usize;
        let pa = &mut acc[HEADER_LEN..len];
        let k = pa.len() / values.bytes() as usize;
        let (mut a, mut b) = ([0f32; 256], [0f32; 256]);
        let mut j = 0;
        while j < k {
            let m = (k - j).min(a.len());
            values.get_slice(pa, k, j, &mut a[..m]);
            values.get_slice(pb, k, j, &mut b[..m]);
            for (x, y) in a[..m].iter_mut().zip(&b[..m]) {
                *x += *y;
            }
            values.put_slice(pa, k, j, &a[..m]);
            j += m;
        }
        // The header unsealed, then sealed again over the new payload.
        let mut h = ha;
        h.flags |= hb.flags & FLAG_NONFINITE;
        h.flags &= !crate::wire::FLAG_PAYLOAD_CRC;
        h.write(acc);
        if ha.payload_checksum() {
            crate::wire::seal(acc, len)?;
        }
        Ok(())
    }
}

impl Scheme for RandK {
    const ID: CodecId = CodecId::RandK;

    fn max_payload(&self, n: u64) -> u64 {
        n.saturating_mul(self.values.bytes())
    }

    fn encode_payload(&self, x: &[f32], ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        let t = self.threshold();
        let vb = self.values.bytes() as usize;
        // Bernoulli selection hashes every element (weight 8, as the stochastic
        // encoders); strata run at about memory speed.
        let weight = match self.select {
            RandKSelect::Bernoulli => 8,
            RandKSelect::Strata => 2,
        };
        let (k, nonfinite) = if parallel::worth(x.len(), weight) {
            // Ranges of the tensor counted in parallel, then encoded in parallel, each
            // into its own part of the payload: the same bytes as one pass.
            let leaf = parallel::CHUNK.max(x.len().div_ceil(MAX_LEAVES).next_multiple_of(64));
            let mut counts = [0usize; MAX_LEAVES];
            let counts = &mut counts[..x.len().div_ceil(leaf)];
            let (n, seed, offset) = (x.len(), ctx.seed, ctx.offset);
            let unwritten = Ranges {
                counts: &mut *counts,
                x,
                vals: &mut [],
                vb,
            };
            parallel::for_ranges(unwritten, n, leaf, true, &|r, start| {
                r.counts[0] = self.count(seed, offset + start as u64, r.x.len());
                false
            });
            let k: usize = counts.iter().sum();
            let p = payload_buf(out, (k * vb) as u64)?;
            let counted = Ranges {
                counts,
                x,
                vals: p,
                vb,
            };
            let nonfinite = parallel::for_ranges(counted, n, leaf, true, &|r, start| {
                self.encode_range(r.x, seed, offset + start as u64, r.vals, r.counts[0])
            });
            (k, nonfinite)
        } else {
            let k = self.count(ctx.seed, ctx.offset, x.len());
            let p = payload_buf(out, (k * vb) as u64)?;
            (k, self.encode_range(x, ctx.seed, ctx.offset, p, k))
        };
        let mut params = [0u8; 12];
        params[0..8].copy_from_slice(&t.to_le_bytes());
        params[8] = self.values as u8;
        params[9] = self.scale as u8;
        params[10] = self.select as u8;
        Ok(Encoded {
            payload_len: k as u64 * self.values.bytes(),
            params,
            nonfinite,
            seed: ctx.seed,
            entropy: false,
        })
    }

    fn read(h: &Header) -> Result<RandK> {
        let bad = |field, reason: String| Error::BadField {
            codec: h.codec,
            field,
            reason,
        };
        let t = h.param_u64(0);
        if !(1..=1u64 << 32).contains(&t) {
            return Err(bad("params.threshold", format!("{t} is not in 1..=2^32")));
        }
        let values = ValueType::from_byte(h, h.params[8])?;
        let scale = match h.params[9] {
            0 => RandKScale::None,
            1 => RandKScale::Unbiased,
            s => {
                return Err(bad(
                    "params.scale",
                    format!("{s} is not 0 (none) or 1 (unbiased)"),
                ));
            }
        };
        let select = match h.params[10] {
            0 => RandKSelect::Bernoulli,
            1 => RandKSelect::Strata,
            s => {
                return Err(bad(
                    "params.select",
                    format!("{s} is not 0 (bernoulli) or 1 (strata)"),
                ));
            }
        };
        h.params_zero_from(11)?;
        let vb = values.bytes();
        if !h.payload_len.is_multiple_of(vb) || h.payload_len / vb > h.elements {
            return Err(bad(
                "payload_len",
                format!(
                    "{} bytes is not a whole number of at most {} {}-byte values",
                    h.payload_len, h.elements, vb
                ),
            ));
        }
        Ok(RandK {
            ratio: t as f64 / 4_294_967_296.0,
            values,
            scale,
            select,
        })
    }

    fn decode_payload<const M: u8>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        let t = h.param_u64(0);
        let k = (h.payload_len / self.values.bytes()) as usize;
        let mismatch = |count: usize| Error::Corrupt {
            codec: h.codec,
            offset: crate::wire::HEADER_LEN,
            reason: format!(
                "seed, offset and threshold select {count} elements but the payload holds {k} values"
            ),
        };
        if h.flags & FLAG_NONFINITE != 0 {
            // Every element decodes to NaN, but the selection must still hold `k`
            // elements. Residual mode decodes a frame this crate has just made from `out`
            // (the error-feedback step): its count is right by construction.
            if M != kernels::mode::RESIDUAL {
                let count = self.count(h.seed, h.offset, out.len());
                if count != k {
                    return Err(mismatch(count));
                }
            }
            for o in out.iter_mut() {
                put::<M>(o, CANONICAL_NAN);
            }
            return Ok(());
        }
        if self.select == RandKSelect::Strata {
            // The count needs two draws: check it before anything is written.
            let strata = Strata::new(t);
            let d = Draws::new(h.seed, STREAM_STRATA, strata.holding(h.offset));
            let count = strata.count(&d, h.offset, out.len());
            if count != k {
                return Err(mismatch(count));
            }
            let (mut vals, mut j, mut zeroed) = ([0f32; STRATA_BATCH], 0, 0);
            strata.batches(&d, h.offset, out.len(), |idx, _| {
                if M == kernels::mode::WRITE {
                    // Zeroed a piece ahead of the kept values, which land in cache.
                    while idx[idx.len() - 1] >= zeroed {
                        let end = (zeroed + STRATA_PIECE).min(out.len());
                        out[zeroed..end].fill(0.0);
                        zeroed = end;
                    }
                }
                let v = &mut vals[..idx.len()];
                self.values.get_slice(p, k, j, v);
                for (&i, &v) in idx.iter().zip(v.iter()) {
                    put::<M>(&mut out[i], v);
                }
                j += idx.len();
            });
            if M == kernels::mode::WRITE {
                out[zeroed..].fill(0.0);
            }
            return Ok(());
        }
        let d = Draws::new(h.seed, STREAM_SELECT, h.offset);
        // The selection must hold exactly `k` elements. Writing counts it in the same pass
        // of hash draws and checks at the end (`decode_into` may leave `out` partly written
        // on error). `decode_add` may not touch `out` on error, so it counts first;
        // `for_each_draw_lt_exactly` keeps the keep masks of its counting pass for the
        // adds. Residual mode's count is right by construction (above).
        if M == kernels::mode::ADD {
            let n = out.len();
            let mut values = ValueReader::new(self.values, p, k);
            let add = |i: usize| put::<M>(&mut out[i], values.next_value());
            return kernels::for_each_draw_lt_exactly(&d, h.offset, t, n, k, add).map_err(mismatch);
        }
        let mut values = ValueReader::new(self.values, p, k);
        let mut count = 0;
        let mut put_next = |o: &mut f32| {
            if count < k {
                put::<M>(o, values.next_value());
            }
            count += 1;
        };
        if M == kernels::mode::WRITE {
            // Zero but at the kept elements, zeroed in the pass of hash draws.
            kernels::for_each_draw_lt_zeroing(&d, h.offset, t, out, |out, i| put_next(&mut out[i]));
        } else {
            // Residual mode: `out` holds the encoded input, and each element not kept
            // keeps it as its residual.
            for_each_kept(h.seed, h.offset, out.len(), t, |i| put_next(&mut out[i]));
        }
        if count != k {
            return Err(mismatch(count));
        }
        Ok(())
    }

    fn expected_payload(&self, n: u64) -> f64 {
        n as f64 * self.threshold() as f64 / 4_294_967_296.0 * self.values.bytes() as f64
    }

    fn is_unbiased(&self) -> bool {
        self.scale == RandKScale::Unbiased
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Codec;
    use crate::rng::draw;

    /// A frame's spec shows the ratio as written (`0.01`, not `0.010000000009313226`) and
    /// keeps the threshold, for short ratios and for every kind of threshold.
    #[test]
    fn a_frames_ratio_reads_as_written_and_keeps_its_threshold() {
        for r in [0.01, 0.3, 1e-5, 0.5, 1.0, 0.125, 0.123456789] {
            let c = RandK::new(r, ValueType::F32, RandKScale::None).unwrap();
            assert_eq!(shortest_ratio(c.threshold()), r, "{r}");
        }
        let mut t = 1u64;
        while t <= 1 << 32 {
            for t in [
                t,
                t + 1,
                t.saturating_sub(1).max(1),
                (t * 3 / 2).min(1 << 32),
            ] {
                let r = shortest_ratio(t);
                let c = RandK::new(r, ValueType::F32, RandKScale::None).unwrap();
                assert_eq!(c.threshold(), t, "t {t} -> ratio {r}");
            }
            t = t * 5 / 2 + 1;
        }
        let spec: CodecSpec = "randk:ratio=0.01".parse().unwrap();
        let frame = spec
            .encode(&[1.0; 1000], &crate::EncodeCtx::new(1))
            .unwrap();
        let (_, back) = crate::inspect(&frame).unwrap();
        assert_eq!(back, spec, "the frame's codec equals the one that wrote it");
        assert_eq!(back.to_string(), "randk:ratio=0.01,values=f32,scale=none");
    }

    /// The definition, one division per stratum: the kept global indices of
    /// `offset .. offset + n`.
    fn kept_by_definition(seed: u64, t: u64, offset: u64, n: usize) -> Vec<(u64, u64)> {
        let b = |j: u128| ((j << 32) / t as u128) as u64;
        let mut out = Vec::new();
        let mut j = 0u64;
        // The first stratum holding `offset` by search from below (small offsets), or by
        // the closed form checked against its defining inequality.
        if offset > 0 {
            j = Strata::new(t).holding(offset);
            assert!(b(j as u128) <= offset && b(j as u128 + 1) > offset);
        }
        let end = offset as u128 + n as u128;
        while (b(j as u128) as u128) < end {
            let (start, len) = (b(j as u128), b(j as u128 + 1) - b(j as u128));
            let g = start + ((draw(seed, STREAM_STRATA, j) as u64 * len) >> 32);
            if g >= offset && (g as u128) < end {
                out.push((g - offset, len));
            }
            j += 1;
        }
        out
    }

    fn kept(seed: u64, t: u64, offset: u64, n: usize) -> Vec<(u64, u64)> {
        let s = Strata::new(t);
        let d = Draws::new(seed, STREAM_STRATA, s.holding(offset));
        let mut out = Vec::new();
        s.for_each(&d, offset, n, |i, len| out.push((i as u64, len)));
        assert_eq!(
            s.count(&d, offset, n),
            out.len(),
            "t {t} offset {offset} n {n}"
        );
        out
    }

    #[test]
    fn strata_walk_matches_the_definition_and_counts_from_the_ends() {
        let ts = [
            1u64 << 32,
            (1 << 32) - 1,
            1 << 31,
            3 << 30,
            1_288_490_189, // 0.3
            42_949_673,    // 0.01
            4_294_967,     // 0.001
            7,
            1,
        ];
        let offsets = [0u64, 1, 99, 1000, 5_000_000_000, (1 << 40) + 17];
        for &t in &ts {
            for &offset in &offsets {
                // Miri runs the short lengths only (it interprets every draw).
                let ns: &[usize] = if cfg!(miri) {
                    &[0, 1, 2, 3, 101]
                } else {
                    &[0, 1, 2, 3, 64, 100, 101, 1000, 4097]
                };
                for &n in ns {
                    assert_eq!(kept(5, t, offset, n), kept_by_definition(5, t, offset, n));
                }
            }
        }
    }

    #[test]
    fn strata_keep_the_same_elements_however_the_tensor_is_chunked() {
        let t = 1_288_490_189; // ratio 0.3: strata of 3 and 4 elements
        let whole: Vec<u64> = kept(9, t, 1000, 5000).into_iter().map(|k| k.0).collect();
        let mut pieces = Vec::new();
        let mut at = 0;
        for len in [1usize, 2, 3, 5, 7, 11, 13, 100, 1000, 3858] {
            pieces.extend(
                kept(9, t, 1000 + at as u64, len)
                    .into_iter()
                    .map(|k| k.0 + at as u64),
            );
            at += len;
        }
        assert_eq!(at, 5000);
        assert_eq!(pieces, whole);
    }

    #[test]
    fn strata_cross_the_key_window_of_their_draws_and_the_end_of_the_index_space() {
        // Stratum numbers cross 2^32 (a new draw key) inside the tensor.
        let t = 1_288_490_189u64;
        let offset = (((1u128 << 64) / t as u128) as u64).saturating_sub(150);
        assert_eq!(
            kept(3, t, offset, 300),
            kept_by_definition(3, t, offset, 300)
        );
        // The last elements of the u64 index space.
        for t in [1u64 << 32, 1_288_490_189, 1] {
            let n = 257;
            let offset = u64::MAX - n as u64 + 1;
            let k = kept(3, t, offset, n);
            assert!(k.iter().all(|&(i, _)| (i as usize) < n));
            if t == 1 << 32 {
                assert_eq!(k.len(), n);
            }
        }
    }

    #[test]
    fn every_stratum_keeps_one_element_and_lengths_are_q_or_q_plus_one() {
        let t = 42_949_673u64; // ratio 0.01: strata of 99 or 100 (2^32 / t = 99.99999...)
        let n = if cfg!(miri) { 20_000 } else { 1_000_000 };
        let k = kept(1, t, 0, n);
        let n_strata = Strata::new(t).holding(n as u64 - 1) + 1;
        // Every stratum starting inside keeps its pick; the last may keep it past the end.
        assert!((n_strata - 1..=n_strata).contains(&(k.len() as u64)));
        assert!(k.iter().all(|&(_, len)| len == 99 || len == 100));
        // The pick lies in its stratum: consecutive picks are less than two strata apart.
        assert!(k.iter().all(|&(i, _)| i < n as u64));
        assert!(k.windows(2).all(|w| w[1].0 - w[0].0 < 200));
    }
}
