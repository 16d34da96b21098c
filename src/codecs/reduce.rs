//! The fused reduction of many frames of one tensor: `out = f_0 + f_1 + ... + f_{p-1}`,
//! each `f_q` decoded, summed in frame order.
//!
//! A collective's all-gather ends with `p` frames of the same tensor; decoding them one
//! after another (`decode`, then `p - 1` calls of `decode_add`) reads and writes the whole
//! output `p` times. Here consecutive fixed-rate frames are decoded tile by tile instead:
//! for each tile of the output, every frame's codes for that tile are decoded into it in
//! frame order while the tile stays in cache, so the output is written once and each
//! frame's codes read once. Each element still gets the same operations in the same order
//! as the sequential calls (the first frame written, the others added, each by the same
//! per-backend kernel that `decode_add` runs), so the result is bit-identical to them on
//! every backend. Tiles are whole blocks and whole code bytes of every frame, and large
//! tensors split across the thread pool in ranges of whole tiles.
//!
//! Sparse and `dct` frames (whose codes cannot be cut at an arbitrary element) are
//! decoded whole, in their place in the order: a sparse frame adds its kept elements in
//! index order, touching only those.

use super::Scheme;
use super::fixed::{self, FixedRate, Layout, gcd};
use crate::codec::{CodecSpec, each_spec};
use crate::error::{Error, Result};
use crate::kernels::{self, REDUCE_LANES, mode};
use crate::parallel;
use crate::wire::Header;

/// Output elements per tile before rounding to whole blocks: 16 KiB of f32, which stays in
/// L1 while every frame's codes for it are decoded into it.
const REDUCE_TILE: usize = 4096;

/// Largest tile (in elements) the fused loop uses; frames whose blocks would need longer
/// tiles to line up are decoded one after another instead (same result).
const MAX_TILE: usize = 1 << 20;

/// A list of split frames (header, payload) of `n` entries, its allocation checked.
pub(crate) fn frame_list<'a>(n: usize) -> Result<Vec<(Header, &'a [u8])>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| oom::<(Header, &[u8])>(n))?;
    Ok(v)
}

fn oom<T>(n: usize) -> Error {
    Error::OutOfMemory {
        bytes: (n as u64).saturating_mul(core::mem::size_of::<T>() as u64),
        what: "the list of frames to reduce",
    }
}

/// One validated frame of a reduction: a fixed-rate frame cut into its sections, or a
/// frame decoded whole.
enum Part<'a> {
    Dense(Dense<'a>),
    Whole { h: &'a Header, payload: &'a [u8] },
}

/// A fixed-rate frame cut into its sections.
struct Dense<'a> {
    spec: CodecSpec,
    f: &'a dyn FixedRate,
    l: Layout,
    scales: &'a [u8],
    codes: &'a [u8],
}

impl<'a> Part<'a> {
    fn dense(&self) -> Option<&Dense<'a>> {
        match self {
            Part::Dense(d) => Some(d),
            Part::Whole { .. } => None,
        }
    }
}

/// Reduce frames already split by [`crate::wire::split`] (header checked, a sealed
/// payload's checksum verified) into `out`: the first written (`FIRST` =
/// [`mode::WRITE`]) or added ([`mode::ADD`]), the rest added, in order. An error carries
/// the position of the frame it concerns.
///
/// Every frame's element count, codec parameters and payload length, and every
/// fixed-rate frame's payload, are checked before `out` is touched; a sparse or `dct`
/// payload is checked as it is decoded, so after such an error `out` holds a partial sum.
pub(crate) fn reduce_split<const FIRST: u8>(
    frames: &[(Header, &[u8])],
    out: &mut [f32],
) -> core::result::Result<(), (usize, Error)> {
    // The codecs first (the fixed-rate structure borrows from them), then the parts.
    let mut specs = Vec::new();
    specs
        .try_reserve_exact(frames.len())
        .map_err(|_| (0, oom::<CodecSpec>(frames.len())))?;
    for (q, (h, _)) in frames.iter().enumerate() {
        if h.elements != out.len() as u64 {
            let e = Error::OutputLength {
                expected: h.elements,
                got: out.len(),
            };
            return Err((q, e));
        }
        // Reads the parameters and checks the payload length (as a decoder does).
        specs.push(super::spec_from_header(h).map_err(|e| (q, e))?);
    }
    let mut parts = Vec::new();
    parts
        .try_reserve_exact(frames.len())
        .map_err(|_| (0, oom::<Part<'_>>(frames.len())))?;
    for (q, ((h, payload), spec)) in frames.iter().zip(&specs).enumerate() {
        parts.push(match each_spec!(spec, c => Scheme::fixed(c)) {
            Some(f) => {
                let l = f.layout();
                let (scales, codes) = payload.split_at(l.scales_len(out.len()));
                f.validate(h, scales, codes).map_err(|e| (q, e))?;
                Part::Dense(Dense {
                    spec: *spec,
                    f,
                    l,
                    scales,
                    codes,
                })
            }
            None => Part::Whole { h, payload },
        });
    }
    if parts.is_empty() {
        if FIRST == mode::WRITE {
            out.fill(0.0);
        }
        return Ok(());
    }
    let mut q = 0;
    while q < parts.len() {
        let first = if q == 0 { FIRST } else { mode::ADD };
        if let Part::Whole { h, payload } = &parts[q] {
            let r = if first == mode::WRITE {
                super::decode_split::<{ mode::WRITE }>(h, payload, out)
            } else {
                super::decode_split::<{ mode::ADD }>(h, payload, out)
            };
            r.map_err(|e| (q, e))?;
            q += 1;
            continue;
        }
        let end = (q..parts.len())
            .find(|&j| parts[j].dense().is_none())
            .unwrap_or(parts.len());
        fused(&parts[q..end], first, out).map_err(|e| (q, e))?;
        q = end;
    }
    Ok(())
}

/// Decode a run of validated fixed-rate frames into `out` tile by tile: the first in mode
/// `first`, the others added.
fn fused(run: &[Part<'_>], first: u8, out: &mut [f32]) -> Result<()> {
    let dense = || run.iter().filter_map(Part::dense);
    let n = out.len();
    // A tile must start every frame's scales and codes on a byte boundary.
    let mut unit = 1usize;
    for d in dense() {
        let u = d.l.unit();
        unit = unit / gcd(unit, u) * u;
        if unit > MAX_TILE {
            break;
        }
    }
    if unit > MAX_TILE || run.len() == 1 {
        // One frame (nothing to fuse), or blocks that do not line up in a short tile: the
        // codec's own decode (parallel for large tensors) per frame.
        for (i, d) in dense().enumerate() {
            let m = if i == 0 { first } else { mode::ADD };
            fixed::decode_validated(d.f, m, d.scales, d.codes, out);
        }
        return Ok(());
    }
    let tile = (REDUCE_TILE / unit).max(1) * unit;
    let range = (parallel::CHUNK / tile).max(1) * tile;
    let kernel = Kernel::of(run)?;
    parallel::for_ranges(
        out,
        n,
        range,
        parallel::worth(n, 2usize.saturating_mul(run.len())),
        &|o, start| {
            // The kernel's whole lane groups (int8: whole blocks), then tiles for the rest.
            let done = kernel.as_ref().map_or(0, |k| k.run(first, start, o));
            tiles(run, first, start + done, &mut o[done..], tile);
            false
        },
    );
    Ok(())
}

/// The multi-frame kernel a run of frames has, with every frame's whole code sections:
/// all identity, all fp16, all bf16, or all int8 of one block size that is a multiple of
/// the kernel's lane group.
enum Kernel<'a> {
    Elementwise(kernels::ReduceCodes, Vec<&'a [u8]>),
    Int8(usize, Vec<(&'a [u8], &'a [u8])>),
}

impl<'a> Kernel<'a> {
    /// The kernel of `run`, if it has one; an error only if its list of sections cannot
    /// be allocated.
    fn of(run: &[Part<'a>]) -> Result<Option<Kernel<'a>>> {
        let Some(Part::Dense(d0)) = run.first() else {
            return Ok(None);
        };
        if !run
            .iter()
            .all(|p| p.dense().is_some_and(|d| d.spec == d0.spec))
        {
            return Ok(None);
        }
        let elementwise = match d0.spec {
            CodecSpec::Identity(_) => kernels::ReduceCodes::F32,
            CodecSpec::Fp16(_) => kernels::ReduceCodes::F16,
            CodecSpec::Bf16(_) => kernels::ReduceCodes::Bf16,
            CodecSpec::Int8(c) if c.block() % REDUCE_LANES == 0 => {
                let mut v = Vec::new();
                v.try_reserve_exact(run.len())
                    .map_err(|_| oom::<(&[u8], &[u8])>(run.len()))?;
                v.extend(
                    run.iter()
                        .filter_map(Part::dense)
                        .map(|d| (d.scales, d.codes)),
                );
                return Ok(Some(Kernel::Int8(c.block(), v)));
            }
            _ => return Ok(None),
        };
        let mut v = Vec::new();
        v.try_reserve_exact(run.len())
            .map_err(|_| oom::<&[u8]>(run.len()))?;
        v.extend(run.iter().filter_map(Part::dense).map(|d| d.codes));
        Ok(Some(Kernel::Elementwise(elementwise, v)))
    }

    /// Reduce the longest prefix of `o` (whose first element is `start`) the kernel
    /// takes; returns its length.
    fn run(&self, first: u8, start: usize, o: &mut [f32]) -> usize {
        let len = match self {
            Kernel::Elementwise(..) => o.len() / REDUCE_LANES * REDUCE_LANES,
            // `start` is a whole number of blocks (ranges and tiles are).
            Kernel::Int8(block, _) => o.len() / block * block,
        };
        let o = &mut o[..len];
        match (self, first == mode::WRITE) {
            (Kernel::Elementwise(kind, f), true) => {
                kernels::reduce_elementwise::<{ mode::WRITE }>(*kind, f, start, o)
            }
            (Kernel::Elementwise(kind, f), false) => {
                kernels::reduce_elementwise::<{ mode::ADD }>(*kind, f, start, o)
            }
            (Kernel::Int8(block, f), true) => {
                kernels::reduce_int8::<{ mode::WRITE }>(f, *block, start, o)
            }
            (Kernel::Int8(block, f), false) => {
                kernels::reduce_int8::<{ mode::ADD }>(f, *block, start, o)
            }
        }
        len
    }
}

/// Decode a run into `o` (whose first element is `start`, on a tile boundary) tile by
/// tile, every frame's codes for a tile decoded into it while it is in cache.
fn tiles(run: &[Part<'_>], first: u8, start: usize, o: &mut [f32], tile: usize) {
    let mut s = 0;
    while s < o.len() {
        let e = (s + tile).min(o.len());
        let (gs, ge) = (start + s, start + e);
        let t = &mut o[s..e];
        for (i, d) in run.iter().filter_map(Part::dense).enumerate() {
            let m = if i == 0 { first } else { mode::ADD };
            let l = d.l;
            d.f.decode_sections(
                m,
                &d.scales[l.scales_len(gs)..l.scales_len(ge)],
                &d.codes[l.codes_len(gs)..l.codes_len(ge)],
                t,
            );
        }
        s = e;
    }
}
