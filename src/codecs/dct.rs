//! `dct`: the top-k coefficients of a chunked DCT-II (DeMo, Peng et al. 2024, as run by
//! DisTrO / Psyche), as f32, fp16 or 1-bit signs with a scale.
//!
//! The frame's elements are cut into tiles: chunks of `chunk` elements along the one row
//! (`width = 0`), or, with `width = W`, `chunk x chunk` tiles of the `elements / W` rows
//! of `W` (a matrix: the transform runs along both dimensions). Tiles at the right and
//! bottom edges are smaller. Each tile goes through the orthonormal DCT-II and keeps its
//! `k` largest coefficients by magnitude (all of them when it has fewer), sent with their
//! positions in the tile (one byte each when a tile has at most 256 coefficients, else
//! two). Gradients concentrate their energy in few coefficients, so `k` of 64 keeps more
//! of a chunk than `k` of its raw elements would; with error feedback whose `beta` is a
//! momentum decay (0.9 to 0.999), this is DeMo's decoupled momentum.
//!
//! The encoder computes the coefficients by Lee's fast transform (`transform=lee`, the
//! default: along each side whose length is a power of two, halving butterflies with one
//! multiplication each, then merging additions; about 12 operations per element at 64),
//! by the factorised transform (`transform=fast`: butterflies, then sums over half as
//! many terms per level, about 45 operations per element at 64) or by the direct sums
//! (`transform=direct`, 128); each is a fixed sequence of f32 operations (wire format
//! 3.11), so frames are the same bits on every CPU, and the header says which one made a
//! frame. Lee's transform runs on sixteen one-row tiles at once, one per vector lane, and
//! keeps their largest coefficients in one branch-free pass.
//!
//! Decoding is the inverse DCT of the kept coefficients, a fixed sequence of f32
//! operations on an f32 basis specified to the bit, so every CPU decodes alike (a NaN
//! result is written as the quiet NaN `0x7FC00000`, whatever NaN the CPU made). The
//! basis of each tile length is built on first use and kept for the process.
//! Non-finite input: a NaN or Inf coefficient is kept first (its key is the largest) and
//! spreads over its tile on decoding, so the tile decodes with NaN or Inf where the
//! input had them and usually elsewhere too; sign values with a NaN scale decode to NaN.

use core::fmt;

use super::{Encoded, Scheme, expect_payload};
use crate::codec::{Args, CodecId, CodecSpec, EncodeCtx, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::dct::{self, MAX_N};
use crate::kernels::scalar::{CANONICAL_NAN, f16_to_f32, f32_to_f16};
use crate::wire::{HEADER_LEN, Header};

/// How the kept coefficients of a [`Dct`] frame are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DctValues {
    /// f32, exact.
    #[default]
    F32,
    /// IEEE binary16, rounded to nearest even.
    Fp16,
    /// One sign bit each, times the tile's scale (the mean magnitude of its kept
    /// coefficients).
    SignChunk,
    /// One sign bit each, times one scale for the frame (the mean magnitude of every kept
    /// coefficient).
    SignFrame,
}

impl DctValues {
    fn byte(self) -> u8 {
        match self {
            DctValues::F32 => 0,
            DctValues::Fp16 => 1,
            DctValues::SignChunk => 2,
            DctValues::SignFrame => 3,
        }
    }

    fn from_byte(b: u8) -> Option<DctValues> {
        [
            DctValues::F32,
            DctValues::Fp16,
            DctValues::SignChunk,
            DctValues::SignFrame,
        ]
        .get(b as usize)
        .copied()
    }

    /// Bytes of `k` values of a tile (its scale excluded).
    fn value_bytes(self, k: usize) -> usize {
        match self {
            DctValues::F32 => 4 * k,
            DctValues::Fp16 => 2 * k,
            DctValues::SignChunk | DctValues::SignFrame => k.div_ceil(8),
        }
    }

    /// Bytes of `k` values of a tile, its scale included.
    fn tile_bytes(self, k: u64) -> u64 {
        let scale = if self == DctValues::SignChunk { 4 } else { 0 };
        scale + self.value_bytes(k as usize) as u64
    }
}

/// How a [`Dct`] encoder computes the coefficients (decoding is the same for both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DctTransform {
    /// The factorised transform along every side whose length is a power of two from 2
    /// (butterflies, then each coefficient's sum over half as many terms or fewer: about
    /// a third of the direct transform's multiply-adds at 64), the direct sums along the
    /// other sides.
    Fast,
    /// The direct sums over every element of a row or column (the first encoder).
    Direct,
    /// Lee's fast transform along every side whose length is a power of two from 2:
    /// halving butterflies with one multiplication each, then merging additions, about
    /// `(n / 2) log2 n` multiplications and `(3 n / 2) log2 n` additions for `n` values
    /// (a quarter of the factorised transform's operations at 64); the direct sums along
    /// the other sides. Within a part in a million of the largest exact coefficient.
    /// Finite below `2^117` in magnitude (its intermediate values reach 116 times a side's
    /// largest element: larger finite elements can give ±Inf or NaN coefficients). The
    /// default.
    #[default]
    Lee,
}

impl DctTransform {
    fn byte(self) -> u8 {
        match self {
            DctTransform::Direct => 0,
            DctTransform::Fast => 1,
            DctTransform::Lee => 2,
        }
    }
}

/// The `dct` codec: chunked DCT-II, top-k coefficients per tile (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dct {
    chunk: u8,
    k: u16,
    width: u32,
    values: DctValues,
    transform: DctTransform,
}

impl Default for Dct {
    fn default() -> Self {
        Dct {
            chunk: 64,
            k: 4,
            width: 0,
            values: DctValues::F32,
            transform: DctTransform::Lee,
        }
    }
}

/// The tiles of a frame: rows of `len` elements, tiles `th x chunk`.
#[derive(Debug, Clone, Copy)]
struct Grid {
    rows: u64,
    len: u64,
    /// Tile height: 1 for one row, else the chunk.
    th: u64,
    chunk: u64,
    k: u64,
}

impl Grid {
    /// Tile shapes and how many tiles have each: full, right edge, bottom edge, corner.
    fn classes(&self) -> [(u64, u64, u64); 4] {
        let (fr, hr) = (self.rows / self.th, self.rows % self.th);
        let (fc, wr) = (self.len / self.chunk, self.len % self.chunk);
        [
            (self.th, self.chunk, fr * fc),
            (self.th, wr, if wr > 0 { fr } else { 0 }),
            (hr, self.chunk, if hr > 0 { fc } else { 0 }),
            (hr, wr, u64::from(hr > 0 && wr > 0)),
        ]
    }

    /// Bytes per position: 1 when a full tile has at most 256 coefficients.
    fn index_bytes(&self) -> u64 {
        if self.th * self.chunk <= 256 { 1 } else { 2 }
    }

    /// The payload length, or `None` on overflow.
    fn payload(&self, values: DctValues) -> Option<u64> {
        let ib = self.index_bytes();
        let mut total = if values == DctValues::SignFrame {
            4u64
        } else {
            0
        };
        for (h, w, count) in self.classes() {
            if count == 0 || h == 0 || w == 0 {
                continue;
            }
            let kt = self.k.min(h * w);
            let per = kt * ib + values.tile_bytes(kt);
            total = total.checked_add(per.checked_mul(count)?)?;
        }
        Some(total)
    }

    /// Every tile in order: `(first element, h, w)`.
    fn tiles(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let (rows, len, th, c) = (
            self.rows as usize,
            self.len as usize,
            self.th as usize,
            self.chunk as usize,
        );
        (0..rows.div_ceil(th)).flat_map(move |tr| {
            (0..len.div_ceil(c)).map(move |tc| {
                let (r0, c0) = (tr * th, tc * c);
                (r0 * len + c0, th.min(rows - r0), c.min(len - c0))
            })
        })
    }
}

impl Dct {
    /// A `dct` codec with tiles of `chunk` (1 to 64) along one row (`width` 0) or
    /// `chunk x chunk` tiles of rows of `width` elements, keeping `k` coefficients per
    /// tile (1 to the coefficients of a full tile), written as `values`.
    pub fn new(chunk: usize, k: usize, width: u32, values: DctValues) -> Result<Dct> {
        let bad = |name, reason: String| Error::Param {
            codec: CodecId::Dct,
            name,
            reason,
        };
        if !(1..=MAX_N).contains(&chunk) {
            return Err(bad("chunk", format!("{chunk} is outside 1..={MAX_N}")));
        }
        let full = if width == 0 { chunk } else { chunk * chunk };
        if !(1..=full).contains(&k) {
            return Err(bad(
                "k",
                format!("{k} is outside 1..={full}, the coefficients of a full tile"),
            ));
        }
        Ok(Dct {
            chunk: chunk as u8,
            k: k as u16,
            width,
            values,
            transform: DctTransform::Lee,
        })
    }

    /// The same codec with its coefficients computed by `transform`.
    pub fn with_transform(self, transform: DctTransform) -> Dct {
        Dct { transform, ..self }
    }

    /// How the encoder computes the coefficients.
    pub fn transform(&self) -> DctTransform {
        self.transform
    }

    /// Elements per tile side.
    pub fn chunk(&self) -> usize {
        self.chunk as usize
    }

    /// Coefficients kept per tile.
    pub fn k(&self) -> usize {
        self.k as usize
    }

    /// Row length of the matrix (0: one row, tiles along it only).
    pub fn width(&self) -> u32 {
        self.width
    }

    /// How the kept coefficients are written.
    pub fn values(&self) -> DctValues {
        self.values
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<Dct, String> {
        let chunk = a.uint("chunk", 64, 1..=MAX_N as u64)? as usize;
        let width = a.uint("width", 0, 0..=u64::from(u32::MAX))? as u32;
        let k = a.uint("k", 4, 1..=(MAX_N * MAX_N) as u64)? as usize;
        let values = a.choice("values", "f32", &["f32", "fp16", "sign"])?;
        let scale = a.choice("scale", "chunk", &["chunk", "frame"])?;
        let values = match (values, scale) {
            ("f32", "chunk") => DctValues::F32,
            ("fp16", "chunk") => DctValues::Fp16,
            ("sign", "chunk") => DctValues::SignChunk,
            ("sign", _) => DctValues::SignFrame,
            _ => return Err("`scale` is for `values=sign` only".into()),
        };
        let transform = match a.choice("transform", "lee", &["lee", "fast", "direct"])? {
            "direct" => DctTransform::Direct,
            "fast" => DctTransform::Fast,
            _ => DctTransform::Lee,
        };
        Dct::new(chunk, k, width, values)
            .map(|d| d.with_transform(transform))
            .map_err(|e| match e {
                Error::Param { reason, name, .. } => format!("`{name}`: {reason}"),
                e => e.to_string(),
            })
    }

    fn grid(&self, n: u64) -> Result<Grid> {
        let (rows, len) = if self.width == 0 {
            (1, n)
        } else {
            let w = u64::from(self.width);
            if !n.is_multiple_of(w) {
                return Err(Error::Param {
                    codec: CodecId::Dct,
                    name: "width",
                    reason: format!("{n} elements are not whole rows of {w}"),
                });
            }
            (n / w, w)
        };
        Ok(Grid {
            rows,
            len,
            th: if self.width == 0 {
                1
            } else {
                u64::from(self.chunk)
            },
            chunk: u64::from(self.chunk),
            k: u64::from(self.k),
        })
    }

    fn params(&self) -> [u8; 12] {
        let mut p = [0u8; 12];
        p[0..4].copy_from_slice(&self.width.to_le_bytes());
        p[4..6].copy_from_slice(&self.k.to_le_bytes());
        p[6] = self.chunk;
        p[7] = self.values.byte();
        p[8] = self.transform.byte();
        p
    }
}

impl fmt::Display for Dct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let values = match self.values {
            DctValues::F32 => "f32",
            DctValues::Fp16 => "fp16",
            DctValues::SignChunk => "sign,scale=chunk",
            DctValues::SignFrame => "sign,scale=frame",
        };
        write!(
            f,
            "dct:chunk={},k={},values={values},width={}",
            self.chunk, self.k, self.width
        )?;
        match self.transform {
            DctTransform::Lee => {}
            DctTransform::Direct => write!(f, ",transform=direct")?,
            DctTransform::Fast => write!(f, ",transform=fast")?,
        }
        Ok(())
    }
}

impl From<Dct> for CodecSpec {
    fn from(c: Dct) -> CodecSpec {
        CodecSpec::Dct(c)
    }
}

/// The largest tile.
const TILE: usize = MAX_N * MAX_N;

/// Up to this many kept per tile, the selection is the branch-free kernel.
const SMALL_K: usize = dct::SELECT_MAX;

/// Order of keys for selection: larger magnitude first, then lower position.
#[inline]
fn before(keys: &[u32], a: u16, b: u16) -> core::cmp::Ordering {
    keys[b as usize].cmp(&keys[a as usize]).then(a.cmp(&b))
}

/// Most kept coefficients per tile for which one-row tiles decode in batches.
const BATCH_KEPT: usize = 16;

impl Dct {
    /// Value `j` of a tile whose values start at `vals0`: f32, fp16, or the sign bit
    /// applied to `scale`.
    #[inline(always)]
    fn value(&self, payload: &[u8], vals0: usize, j: usize, scale: f32) -> f32 {
        match self.values {
            DctValues::F32 => f32::from_le_bytes(
                payload[vals0 + 4 * j..vals0 + 4 * j + 4]
                    .try_into()
                    .expect("4 bytes"),
            ),
            DctValues::Fp16 => f16_to_f32(u16::from_le_bytes([
                payload[vals0 + 2 * j],
                payload[vals0 + 2 * j + 1],
            ])),
            _ => {
                if payload[vals0 + j / 8] >> (j % 8) & 1 == 1 {
                    -scale
                } else {
                    scale
                }
            }
        }
    }
}

/// Writes the tiles of a payload in order.
struct TileWriter<'a> {
    values: DctValues,
    ib: usize,
    p: &'a mut [u8],
    at: usize,
    frame_sum: f64,
    frame_kept: u64,
}

impl TileWriter<'_> {
    /// One tile: its scale (sign values with a scale per tile), its kept positions
    /// (increasing) and their values, value `j` being `value(j)`.
    #[inline]
    fn tile(&mut self, chosen: &[u16], value: impl Fn(usize) -> f32) {
        let (p, ib, kt) = (&mut *self.p, self.ib, chosen.len());
        let scale_at = self.at;
        let mut at = self.at;
        if self.values == DctValues::SignChunk {
            at += 4;
        }
        for &pos in chosen {
            p[at..at + ib].copy_from_slice(&pos.to_le_bytes()[..ib]);
            at += ib;
        }
        match self.values {
            DctValues::F32 => {
                for j in 0..kt {
                    p[at..at + 4].copy_from_slice(&value(j).to_le_bytes());
                    at += 4;
                }
            }
            DctValues::Fp16 => {
                for j in 0..kt {
                    p[at..at + 2].copy_from_slice(&f32_to_f16(value(j)).to_le_bytes());
                    at += 2;
                }
            }
            DctValues::SignChunk | DctValues::SignFrame => {
                let bytes = self.values.value_bytes(kt);
                p[at..at + bytes].fill(0);
                let mut sum = 0f64;
                for j in 0..kt {
                    let v = value(j);
                    if v.is_sign_negative() {
                        p[at + j / 8] |= 1 << (j % 8);
                    }
                    sum += f64::from(v.abs());
                }
                at += bytes;
                if self.values == DctValues::SignChunk {
                    let scale = dct::canonical((sum / kt as f64) as f32);
                    p[scale_at..scale_at + 4].copy_from_slice(&scale.to_le_bytes());
                } else {
                    self.frame_sum += sum;
                    self.frame_kept += kt as u64;
                }
            }
        }
        self.at = at;
    }
}

impl Scheme for Dct {
    const ID: CodecId = CodecId::Dct;

    fn check_elements(&self, n: u64) -> Result<()> {
        self.grid(n)?
            .payload(self.values)
            .map(|_| ())
            .ok_or_else(|| Error::Param {
                codec: CodecId::Dct,
                name: "elements",
                reason: format!("{n} elements imply a payload longer than 2^64 bytes"),
            })
    }

    fn max_payload(&self, n: u64) -> u64 {
        self.grid(n)
            .ok()
            .and_then(|g| g.payload(self.values))
            .unwrap_or(u64::MAX)
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        self.check_elements(x.len() as u64)?;
        let g = self.grid(x.len() as u64)?;
        let len = g.payload(self.values).expect("checked");
        let p = payload_buf(out, len)?;
        let mut w = TileWriter {
            values: self.values,
            ib: g.index_bytes() as usize,
            p,
            at: if self.values == DctValues::SignFrame {
                4
            } else {
                0
            },
            frame_sum: 0.0,
            frame_kept: 0,
        };
        // Whether any input element is NaN or ±Inf: read from the coefficients where the
        // batched path below runs (`checked` elements so far), from the input elsewhere.
        let mut nonfinite = false;
        let mut checked = 0;
        let mut tiles = g.tiles().peekable();
        // Tiles of one row with a factorised length and a few kept: many per kernel call,
        // several transformed at once (the same arithmetic as one at a time).
        let (c, kt) = (g.chunk as usize, (g.k as usize).min(g.chunk as usize));
        if self.transform != DctTransform::Direct
            && g.th == 1
            && g.rows == 1
            && c >= 2
            && c.is_power_of_two()
            && kt <= SMALL_K
            && kt < c
        {
            let full = (g.len / g.chunk) as usize;
            const BATCH: usize = 256;
            let mut pos = [0u16; BATCH * SMALL_K];
            let mut vals = [0f32; BATCH * SMALL_K];
            for b0 in (0..full).step_by(BATCH) {
                let m = (full - b0).min(BATCH);
                let xs = &x[b0 * c..(b0 + m) * c];
                if self.transform == DctTransform::Lee {
                    dct::encode_rows_lee(xs, c, kt, &mut pos, &mut vals);
                } else {
                    dct::encode_rows_fast(xs, c, kt, &mut pos, &mut vals);
                }
                // A tile holding NaN or ±Inf has only non-finite coefficients, and they
                // are kept (their keys are the largest); a finite tile may overflow to
                // ±Inf as well, so then the batch's input decides. This spares a read
                // pass over the input.
                if !nonfinite && vals[..m * kt].iter().any(|v| !v.is_finite()) {
                    nonfinite = crate::kernels::any_nonfinite(xs);
                }
                for t in 0..m {
                    let r = t * kt..(t + 1) * kt;
                    w.tile(&pos[r.clone()], |j| vals[r.start + j]);
                }
            }
            for _ in 0..full {
                tiles.next();
            }
            checked = full * c;
        }
        nonfinite = nonfinite || crate::kernels::any_nonfinite(&x[checked..]);
        let mut y = [0f32; TILE];
        let mut coef = [0f32; TILE];
        let mut keys = [0u32; TILE];
        let mut wide = [0u64; TILE];
        let mut order = [0u16; TILE];
        for (first, h, tw) in tiles {
            let size = h * tw;
            let rows = &x[first..];
            match self.transform {
                DctTransform::Fast => {
                    dct::forward_fast(rows, g.len as usize, h, tw, &mut y, &mut coef)
                }
                DctTransform::Lee => {
                    dct::forward_lee(rows, g.len as usize, h, tw, &mut y, &mut coef)
                }
                DctTransform::Direct => {
                    dct::forward(rows, g.len as usize, h, tw, &mut y, &mut coef)
                }
            }
            let kt = (g.k as usize).min(size);
            let chosen = &mut order[..size];
            if kt <= SMALL_K && kt < size {
                // A few of many: the largest taken kt times, branch-free (NaN coefficients
                // made the quiet NaN 0x7FC00000 first, as below).
                dct::select(&mut coef[..size], kt, &mut wide, chosen);
            } else {
                // Which NaN an invalid operation makes differs between CPUs and
                // compilations: every NaN coefficient is the quiet NaN 0x7FC00000 (its
                // key, value and sign).
                coef[..size]
                    .iter_mut()
                    .filter(|v| v.is_nan())
                    .for_each(|v| *v = CANONICAL_NAN);
                for (i, (key, o)) in keys[..size].iter_mut().zip(chosen.iter_mut()).enumerate() {
                    *key = coef[i].to_bits() & 0x7FFF_FFFF;
                    *o = i as u16;
                }
                if kt < size {
                    chosen.select_nth_unstable_by(kt - 1, |&a, &b| before(&keys, a, b));
                }
                chosen[..kt].sort_unstable();
            }
            let chosen = &chosen[..kt];
            w.tile(chosen, |j| coef[chosen[j] as usize]);
        }
        if self.values == DctValues::SignFrame {
            let scale = if w.frame_kept == 0 {
                0.0
            } else {
                dct::canonical((w.frame_sum / w.frame_kept as f64) as f32)
            };
            w.p[0..4].copy_from_slice(&scale.to_le_bytes());
        }
        debug_assert_eq!(w.at as u64, len);
        Ok(Encoded {
            payload_len: len,
            params: self.params(),
            nonfinite,
            seed: 0,
            entropy: false,
        })
    }

    fn read(h: &Header) -> Result<Dct> {
        let field = |field, reason: String| Error::BadField {
            codec: CodecId::Dct,
            field,
            reason,
        };
        let width = h.param_u32(0);
        let k = u16::from_le_bytes([h.params[4], h.params[5]]);
        let chunk = h.params[6];
        let values = DctValues::from_byte(h.params[7]).ok_or_else(|| {
            field(
                "params.values",
                format!("{} is not 0 (f32), 1 (fp16), 2 or 3 (sign)", h.params[7]),
            )
        })?;
        let transform = match h.params[8] {
            0 => DctTransform::Direct,
            1 => DctTransform::Fast,
            2 => DctTransform::Lee,
            b => {
                return Err(field(
                    "params.transform",
                    format!("{b} is not 0 (direct), 1 (factorised) or 2 (Lee)"),
                ));
            }
        };
        h.params_zero_from(9)?;
        h.seed_zero()?;
        if !(1..=MAX_N as u8).contains(&chunk) {
            return Err(field(
                "params.chunk",
                format!("{chunk} is outside 1..={MAX_N}"),
            ));
        }
        let full = if width == 0 {
            u32::from(chunk)
        } else {
            u32::from(chunk) * u32::from(chunk)
        };
        if k == 0 || u32::from(k) > full {
            return Err(field(
                "params.k",
                format!("{k} is outside 1..={full}, the coefficients of a full tile"),
            ));
        }
        if width != 0 && !h.elements.is_multiple_of(u64::from(width)) {
            return Err(field(
                "elements",
                format!("{} elements are not whole rows of {width}", h.elements),
            ));
        }
        let c = Dct {
            chunk,
            k,
            width,
            values,
            transform,
        };
        expect_payload(h, c.grid(h.elements)?.payload(values))?;
        Ok(c)
    }

    fn decode_payload<const M: u8>(
        &self,
        h: &Header,
        payload: &[u8],
        out: &mut [f32],
    ) -> Result<()> {
        let g = self.grid(h.elements)?;
        let ib = g.index_bytes() as usize;
        let corrupt = |at: usize, reason: String| Error::Corrupt {
            codec: CodecId::Dct,
            offset: HEADER_LEN + at,
            reason,
        };
        let pos_at = |at: usize| -> usize {
            if ib == 1 {
                payload[at] as usize
            } else {
                u16::from_le_bytes([payload[at], payload[at + 1]]) as usize
            }
        };
        // Check every tile's positions and sign padding before writing anything.
        let start = if self.values == DctValues::SignFrame {
            4
        } else {
            0
        };
        let mut at = start;
        for (_, th, tw) in g.tiles() {
            let size = th * tw;
            let kt = (g.k as usize).min(size);
            if self.values == DctValues::SignChunk {
                at += 4;
            }
            let mut last = None;
            for j in 0..kt {
                let pos = pos_at(at + j * ib);
                if pos >= size || last.is_some_and(|l| pos <= l) {
                    return Err(corrupt(
                        at + j * ib,
                        format!(
                            "position {pos} in a tile of {size} coefficients does not follow {}",
                            last.map_or("the tile's start".to_string(), |l| l.to_string())
                        ),
                    ));
                }
                last = Some(pos);
            }
            at += kt * ib;
            at += match self.values {
                DctValues::F32 | DctValues::Fp16 => self.values.value_bytes(kt),
                _ => {
                    let bytes = self.values.value_bytes(kt);
                    if kt % 8 != 0 && payload[at + bytes - 1] >> (kt % 8) != 0 {
                        return Err(corrupt(
                            at + bytes - 1,
                            "sign bits past the tile's last coefficient are not zero".into(),
                        ));
                    }
                    bytes
                }
            };
        }
        let frame_scale = if self.values == DctValues::SignFrame {
            f32::from_le_bytes(payload[0..4].try_into().expect("4 bytes"))
        } else {
            0.0
        };
        let mut at = start;
        let len = g.len as usize;
        let mut tiles = g.tiles().peekable();
        // Tiles of one row: their positions and values gathered for many tiles, then
        // decoded in one kernel call (the same arithmetic as one tile at a time).
        let kt1 = (g.k as usize).min(g.chunk as usize);
        if g.th == 1 && g.rows == 1 && kt1 <= BATCH_KEPT {
            const BATCH: usize = 256;
            let c = g.chunk as usize;
            let full = (g.len / g.chunk) as usize;
            let mut pos = [0u16; BATCH * BATCH_KEPT];
            let mut vals = [0f32; BATCH * BATCH_KEPT];
            for b0 in (0..full).step_by(BATCH) {
                let m = (full - b0).min(BATCH);
                for t in 0..m {
                    let scale = match self.values {
                        DctValues::SignChunk => {
                            let s = f32::from_le_bytes(
                                payload[at..at + 4].try_into().expect("4 bytes"),
                            );
                            at += 4;
                            s
                        }
                        _ => frame_scale,
                    };
                    let vals0 = at + kt1 * ib;
                    for j in 0..kt1 {
                        pos[t * kt1 + j] = pos_at(at + j * ib) as u16;
                        vals[t * kt1 + j] = self.value(payload, vals0, j, scale);
                    }
                    at = vals0 + self.values.value_bytes(kt1);
                }
                let o = &mut out[b0 * c..(b0 + m) * c];
                dct::decode_rows::<M>(c, kt1, &pos[..m * kt1], &vals[..m * kt1], o);
            }
            for _ in 0..full {
                tiles.next();
            }
        }
        let mut t = [0f32; TILE];
        let mut cols = [false; MAX_N];
        let mut tile = [0f32; TILE];
        for (first, th, tw) in tiles {
            let kt = (g.k as usize).min(th * tw);
            let scale = match self.values {
                DctValues::SignChunk => {
                    let s = f32::from_le_bytes(payload[at..at + 4].try_into().expect("4 bytes"));
                    at += 4;
                    s
                }
                _ => frame_scale,
            };
            let pos0 = at;
            let vals0 = at + kt * ib;
            let kept =
                (0..kt).map(|j| (pos_at(pos0 + j * ib), self.value(payload, vals0, j, scale)));
            dct::inverse(kept, th, tw, &mut t, &mut cols, &mut tile, |i, r| {
                let o = &mut out[first + i * len..first + i * len + tw];
                // A NaN decodes as the quiet NaN 0x7FC00000: which NaN an invalid
                // operation makes differs between CPUs.
                o.iter_mut()
                    .zip(r)
                    .for_each(|(o, &v)| dct::store::<M>(o, v));
            });
            at = vals0 + self.values.value_bytes(kt);
        }
        Ok(())
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}
