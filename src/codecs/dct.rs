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
use crate::kernels::scalar::{CANONICAL_NAN, f16_to_f32, f32_to_f16, put};
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

/// The `dct` codec: chunked DCT-II, top-k coefficients per tile (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dct {
    chunk: u8,
    k: u16,
    width: u32,
    values: DctValues,
}

impl Default for Dct {
    fn default() -> Self {
        Dct {
            chunk: 64,
            k: 4,
            width: 0,
            values: DctValues::F32,
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
        })
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
        Dct::new(chunk, k, width, values).map_err(|e| match e {
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
        )
    }
}

impl From<Dct> for CodecSpec {
    fn from(c: Dct) -> CodecSpec {
        CodecSpec::Dct(c)
    }
}

/// The largest tile.
const TILE: usize = MAX_N * MAX_N;

/// Up to this many kept per tile, the selection is one insertion pass.
const SMALL_K: usize = 16;

/// `v`, or the quiet NaN 0x7FC00000 if it is a NaN.
#[inline]
fn canonical(v: f32) -> f32 {
    if v.is_nan() { CANONICAL_NAN } else { v }
}

/// Order of keys for selection: larger magnitude first, then lower position.
#[inline]
fn before(keys: &[u32], a: u16, b: u16) -> core::cmp::Ordering {
    keys[b as usize].cmp(&keys[a as usize]).then(a.cmp(&b))
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
        let ib = g.index_bytes() as usize;
        let mut y = [0f32; TILE];
        let mut coef = [0f32; TILE];
        let mut keys = [0u32; TILE];
        let mut order = [0u16; TILE];
        let mut at = if self.values == DctValues::SignFrame {
            4
        } else {
            0
        };
        let (mut frame_sum, mut frame_kept) = (0f64, 0u64);
        let nonfinite = crate::kernels::any_nonfinite(x);
        for (first, h, w) in g.tiles() {
            let size = h * w;
            let rows = &x[first..];
            dct::forward(rows, g.len as usize, h, w, &mut y, &mut coef);
            // Which NaN an invalid operation makes differs between CPUs and compilations:
            // every NaN coefficient is the quiet NaN 0x7FC00000 (its key, value and sign).
            coef[..size]
                .iter_mut()
                .filter(|v| v.is_nan())
                .for_each(|v| *v = CANONICAL_NAN);
            let kt = (g.k as usize).min(size);
            let chosen = &mut order[..size];
            if kt <= SMALL_K && kt < size {
                // A few of many: one pass keeping the best kt, each as one u64 that orders
                // like the selection (the key, then the lower position first).
                let mut top = [0u64; SMALL_K];
                let mut filled = 0;
                for (i, c) in coef[..size].iter().enumerate() {
                    let v = (u64::from(c.to_bits() & 0x7FFF_FFFF) << 16) | (0xFFFF - i as u64);
                    if filled == kt && v <= top[kt - 1] {
                        continue;
                    }
                    let mut j = filled.min(kt - 1);
                    while j > 0 && top[j - 1] < v {
                        top[j] = top[j - 1];
                        j -= 1;
                    }
                    top[j] = v;
                    filled = (filled + 1).min(kt);
                }
                for (o, &v) in chosen.iter_mut().zip(&top[..kt]) {
                    *o = 0xFFFF - (v & 0xFFFF) as u16;
                }
            } else {
                for (i, (key, o)) in keys[..size].iter_mut().zip(chosen.iter_mut()).enumerate() {
                    *key = coef[i].to_bits() & 0x7FFF_FFFF;
                    *o = i as u16;
                }
                if kt < size {
                    chosen.select_nth_unstable_by(kt - 1, |&a, &b| before(&keys, a, b));
                }
            }
            let chosen = &mut chosen[..kt];
            chosen.sort_unstable();
            let scale_at = at;
            if self.values == DctValues::SignChunk {
                at += 4;
            }
            for &pos in chosen.iter() {
                p[at..at + ib].copy_from_slice(&pos.to_le_bytes()[..ib]);
                at += ib;
            }
            match self.values {
                DctValues::F32 => {
                    for &pos in chosen.iter() {
                        p[at..at + 4].copy_from_slice(&coef[pos as usize].to_le_bytes());
                        at += 4;
                    }
                }
                DctValues::Fp16 => {
                    for &pos in chosen.iter() {
                        let hv = f32_to_f16(coef[pos as usize]);
                        p[at..at + 2].copy_from_slice(&hv.to_le_bytes());
                        at += 2;
                    }
                }
                DctValues::SignChunk | DctValues::SignFrame => {
                    let bytes = self.values.value_bytes(kt);
                    p[at..at + bytes].fill(0);
                    let mut sum = 0f64;
                    for (j, &pos) in chosen.iter().enumerate() {
                        let v = coef[pos as usize];
                        if v.is_sign_negative() {
                            p[at + j / 8] |= 1 << (j % 8);
                        }
                        sum += f64::from(v.abs());
                    }
                    at += bytes;
                    if self.values == DctValues::SignChunk {
                        let scale = canonical((sum / kt as f64) as f32);
                        p[scale_at..scale_at + 4].copy_from_slice(&scale.to_le_bytes());
                    } else {
                        frame_sum += sum;
                        frame_kept += kt as u64;
                    }
                }
            }
        }
        if self.values == DctValues::SignFrame {
            let scale = if frame_kept == 0 {
                0.0
            } else {
                canonical((frame_sum / frame_kept as f64) as f32)
            };
            p[0..4].copy_from_slice(&scale.to_le_bytes());
        }
        debug_assert_eq!(at as u64, len);
        Ok(Encoded {
            payload_len: len,
            params: self.params(),
            nonfinite,
            seed: 0,
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
        h.params_zero_from(8)?;
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
        let mut t = [0f32; TILE];
        let mut cols = [false; MAX_N];
        let mut tile = [0f32; TILE];
        let mut at = start;
        let len = g.len as usize;
        for (first, th, tw) in g.tiles() {
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
            let values = self.values;
            let kept = (0..kt).map(|j| {
                let pos = pos_at(pos0 + j * ib);
                let v = match values {
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
                };
                (pos, v)
            });
            dct::inverse(kept, th, tw, &mut t, &mut cols, &mut tile, |i, r| {
                let o = &mut out[first + i * len..first + i * len + tw];
                // A NaN decodes as the quiet NaN 0x7FC00000: which NaN an invalid
                // operation makes differs between CPUs.
                o.iter_mut()
                    .zip(r)
                    .for_each(|(o, &v)| put::<M>(o, canonical(v)));
            });
            at = vals0 + self.values.value_bytes(kt);
        }
        Ok(())
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}
