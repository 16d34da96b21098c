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

use super::fixed::{FixedRate, Layout};
use super::{Scheme, decode_split, spec_from_header};
use crate::codec::{CodecSpec, each_spec};
use crate::error::{Error, Result};
use crate::kernels::{self, REDUCE_LANES, mode};
use crate::parallel::{self, Split};
use crate::wire::Header;

/// Output elements per tile before rounding to whole blocks: 16 KiB of f32, which stays in
/// L1 while every frame's codes for it are decoded into it.
pub(crate) const REDUCE_TILE: usize = 4096;

/// Largest tile (in elements) the fused loop uses; frames whose blocks would need longer
/// tiles to line up are decoded one after another instead (same result).
const MAX_TILE: usize = 1 << 20;

/// One validated frame of a reduction.
struct Part<'a> {
    h: Header,
    spec: CodecSpec,
    payload: &'a [u8],
}

/// A fixed-rate frame cut into its sections.
struct Dense<'a> {
    spec: CodecSpec,
    f: &'a dyn FixedRate,
    l: Layout,
    scales: &'a [u8],
    codes: &'a [u8],
}

/// The output as a bundle the parallel splitter can cut.
struct Out<'a>(&'a mut [f32]);

impl Split for Out<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at_mut(at);
        (Out(a), Out(b))
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
    let mut parts = Vec::new();
    parts
        .try_reserve_exact(frames.len())
        .map_err(|_| (0, oom(frames.len())))?;
    for (q, (h, payload)) in frames.iter().enumerate() {
        if h.elements != out.len() as u64 {
            return Err((
                q,
                Error::OutputLength {
                    expected: h.elements,
                    got: out.len(),
                },
            ));
        }
        let spec = spec_from_header(h).map_err(|e| (q, e))?;
        parts.push(Part {
            h: *h,
            spec,
            payload,
        });
    }
    // Cut the fixed-rate frames into sections and validate them, before any write.
    let mut dense: Vec<Option<Dense<'_>>> = Vec::new();
    dense
        .try_reserve_exact(parts.len())
        .map_err(|_| (0, oom(parts.len())))?;
    for (q, p) in parts.iter().enumerate() {
        let d = match fixed_of(&p.spec) {
            Some(f) => {
                let l = f.layout();
                let (scales, codes) = p.payload.split_at(l.scales_len(out.len()));
                f.validate(&p.h, scales, codes).map_err(|e| (q, e))?;
                Some(Dense {
                    spec: p.spec,
                    f,
                    l,
                    scales,
                    codes,
                })
            }
            None => None,
        };
        dense.push(d);
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
        if dense[q].is_none() {
            let p = &parts[q];
            decode_whole(first, &p.h, p.payload, out).map_err(|e| (q, e))?;
            q += 1;
            continue;
        }
        let end = (q..parts.len())
            .find(|&j| dense[j].is_none())
            .unwrap_or(parts.len());
        let run: Vec<&Dense<'_>> = dense[q..end].iter().flatten().collect();
        fused(&run, first, out);
        q = end;
    }
    Ok(())
}

fn oom(n: usize) -> Error {
    Error::OutOfMemory {
        bytes: (n as u64).saturating_mul(core::mem::size_of::<Part<'_>>() as u64),
        what: "the list of frames to reduce",
    }
}

/// The fixed-rate structure of a codec, if it has one.
fn fixed_of(spec: &CodecSpec) -> Option<&dyn FixedRate> {
    each_spec!(spec, c => Scheme::fixed(c))
}

/// Decode one whole frame (header already read) in mode `m`.
fn decode_whole(m: u8, h: &Header, payload: &[u8], out: &mut [f32]) -> Result<()> {
    if m == mode::WRITE {
        decode_split::<{ mode::WRITE }>(h, payload, out)
    } else {
        decode_split::<{ mode::ADD }>(h, payload, out)
    }
}

const fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Decode a run of validated fixed-rate frames into `out` tile by tile: the first in mode
/// `first`, the others added.
fn fused(run: &[&Dense<'_>], first: u8, out: &mut [f32]) {
    let n = out.len();
    // A tile must start every frame's scales and codes on a byte boundary.
    let mut unit = 1usize;
    for d in run {
        let u = d.l.unit();
        unit = unit / gcd(unit, u) * u;
        if unit > MAX_TILE {
            break;
        }
    }
    if unit > MAX_TILE || run.len() == 1 {
        // One frame (nothing to fuse), or blocks that do not line up in a short tile: the
        // codec's own decode (parallel for large tensors) per frame.
        for (i, d) in run.iter().enumerate() {
            let m = if i == 0 { first } else { mode::ADD };
            decode_sections_whole(d, m, out);
        }
        return;
    }
    let tile = (REDUCE_TILE / unit).max(1) * unit;
    let range = (parallel::CHUNK / tile).max(1) * tile;
    let weight = 2usize.saturating_mul(run.len());
    let kernel = Kernel::of(run);
    parallel::for_ranges(
        Out(out),
        n,
        range,
        parallel::worth(n, weight),
        &|o, start| {
            let o = o.0;
            // The kernel's whole lane groups (int8: whole blocks), then tiles for the rest.
            let done = match kernel {
                Some(k) => k.run(run, first, start, o),
                None => 0,
            };
            tiles(run, first, start + done, &mut o[done..], tile);
            false
        },
    );
}

/// The multi-frame kernel a run of frames has, if any: all identity, all fp16, all bf16,
/// or all int8 of one block size that is a multiple of the kernel's lane group.
#[derive(Clone, Copy)]
enum Kernel {
    Elementwise(kernels::ReduceCodes, usize),
    Int8(usize),
}

impl Kernel {
    fn of(run: &[&Dense<'_>]) -> Option<Kernel> {
        let k = match run.first()?.spec {
            CodecSpec::Identity(_) => Kernel::Elementwise(kernels::ReduceCodes::F32, 4),
            CodecSpec::Fp16(_) => Kernel::Elementwise(kernels::ReduceCodes::F16, 2),
            CodecSpec::Bf16(_) => Kernel::Elementwise(kernels::ReduceCodes::Bf16, 2),
            CodecSpec::Int8(c) if c.block() % REDUCE_LANES == 0 => Kernel::Int8(c.block()),
            _ => return None,
        };
        let first = run[0].spec;
        run.iter().all(|d| d.spec == first).then_some(k)
    }

    /// Reduce the longest prefix of `o` (whose first element is `start`) the kernel
    /// takes; returns its length.
    fn run(self, run: &[&Dense<'_>], first: u8, start: usize, o: &mut [f32]) -> usize {
        match self {
            Kernel::Elementwise(kind, w) => {
                let len = o.len() / REDUCE_LANES * REDUCE_LANES;
                if len == 0 {
                    return 0;
                }
                let codes: Vec<&[u8]> = run
                    .iter()
                    .map(|d| &d.codes[w * start..w * (start + len)])
                    .collect();
                if first == mode::WRITE {
                    kernels::reduce_elementwise::<{ mode::WRITE }>(kind, &codes, &mut o[..len])
                } else {
                    kernels::reduce_elementwise::<{ mode::ADD }>(kind, &codes, &mut o[..len])
                }
                len
            }
            Kernel::Int8(block) => {
                // `start` is a whole number of blocks (ranges and tiles are).
                let len = o.len() / block * block;
                if len == 0 {
                    return 0;
                }
                let (b0, b1) = (start / block, (start + len) / block);
                let parts: Vec<(&[u8], &[u8])> = run
                    .iter()
                    .map(|d| (&d.scales[4 * b0..4 * b1], &d.codes[start..start + len]))
                    .collect();
                if first == mode::WRITE {
                    kernels::reduce_int8::<{ mode::WRITE }>(&parts, block, &mut o[..len])
                } else {
                    kernels::reduce_int8::<{ mode::ADD }>(&parts, block, &mut o[..len])
                }
                len
            }
        }
    }
}

/// Decode a run into `o` (whose first element is `start`, on a tile boundary) tile by
/// tile, every frame's codes for a tile decoded into it while it is in cache.
fn tiles(run: &[&Dense<'_>], first: u8, start: usize, o: &mut [f32], tile: usize) {
    let mut s = 0;
    while s < o.len() {
        let e = (s + tile).min(o.len());
        let (gs, ge) = (start + s, start + e);
        let t = &mut o[s..e];
        for (i, d) in run.iter().enumerate() {
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

/// One fixed-rate frame's whole decode, in parallel ranges for large tensors (as
/// `fixed::decode` does once the frame is validated).
fn decode_sections_whole(d: &Dense<'_>, m: u8, out: &mut [f32]) {
    let n = out.len();
    let l = d.l;
    let range = l.range_near(parallel::CHUNK);
    parallel::for_ranges(Out(out), n, range, parallel::worth(n, 2), &|o, start| {
        let end = start + o.0.len();
        d.f.decode_sections(
            m,
            &d.scales[l.scales_len(start)..l.scales_len(end)],
            &d.codes[l.codes_len(start)..l.codes_len(end)],
            o.0,
        );
        false
    });
}
