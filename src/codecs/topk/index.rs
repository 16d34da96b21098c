//! How a top-k frame codes its kept indices (wire format 3.9): Rice-coded gaps, a
//! bitmap, or gaps at a fixed width; the sink that writes them as the kept elements are
//! found, and the counting passes some codings need first.

use super::select::{Cut, for_each_kept};
use crate::kernels::scalar::BitWriter;
use crate::wire::{self, Header};

/// How a top-k frame codes the kept indices (wire format 3.9, params byte 10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IndexCoding {
    /// Index gaps bit-packed at one width, that of the largest gap (the first format;
    /// needs a pass to find the largest gap before writing).
    Gaps = 0,
    /// Index gaps Rice-coded with parameter [`wire::rice_param`]`(n, k)`: at most about
    /// `log2(n / k) + 2` bits per index whatever the gaps, written in one pass.
    Rice = 1,
    /// One bit per element (`ceil(n / 8)` bytes): the dense case.
    Bitmap = 2,
}

impl IndexCoding {
    pub(super) fn name(self) -> &'static str {
        match self {
            IndexCoding::Gaps => "gaps",
            IndexCoding::Rice => "rice",
            IndexCoding::Bitmap => "bitmap",
        }
    }

    /// What `auto` picks for `k` of `n` indices: the bitmap when it is no longer than the
    /// most a Rice stream can take, else Rice. (Both bounds depend on `n` and `k` only,
    /// so the choice needs no pass over the data.)
    pub fn auto(n: u64, k: u64) -> IndexCoding {
        if n.div_ceil(8) <= rice_max_bytes(n, k) {
            IndexCoding::Bitmap
        } else {
            IndexCoding::Rice
        }
    }

    /// The coding of a frame whose header `read` accepted (params byte 10).
    pub(super) fn of_frame(h: &Header) -> IndexCoding {
        IndexCoding::from_byte(h.params[10]).unwrap_or(IndexCoding::Gaps)
    }

    /// The coding params byte 10 names, if any.
    pub(super) fn from_byte(b: u8) -> Option<IndexCoding> {
        [IndexCoding::Gaps, IndexCoding::Rice, IndexCoding::Bitmap]
            .into_iter()
            .find(|&c| c as u8 == b)
    }

    /// The most bytes this coding takes for `k` of `n` indices (`k <= n`).
    pub(super) fn max_bytes(self, n: u64, k: u64) -> u64 {
        match self {
            // Saturating: only a k no frame can hold overflows.
            IndexCoding::Gaps => {
                wire::packed_len(k, bit_width(n.saturating_sub(1)) as u64).unwrap_or(u64::MAX)
            }
            IndexCoding::Rice => rice_max_bytes(n, k),
            IndexCoding::Bitmap => n.div_ceil(8),
        }
    }
}

/// The most bytes of a Rice stream of `k` of `n` indices at the encoders' parameter.
fn rice_max_bytes(n: u64, k: u64) -> u64 {
    wire::rice_max_bits(n, k, wire::rice_param(n, k)).div_ceil(8)
}

/// Where the kept indices go as they are found, in index order.
pub(super) enum IndexSink<'a> {
    /// Gaps at a fixed width or Rice-coded (the coding and its byte-9 parameter).
    Stream(BitWriter<'a>, IndexCoding, u32),
    /// Bits of a zeroed bitmap.
    Bitmap(&'a mut [u8]),
}

impl IndexSink<'_> {
    /// Record index `i`, the previous kept index being `next - 1`.
    #[inline]
    pub(super) fn push(&mut self, i: usize, next: usize) {
        match self {
            IndexSink::Stream(w, IndexCoding::Rice, b) => w.put_rice((i - next) as u64, *b),
            IndexSink::Stream(w, _, width) => w.put((i - next) as u32, *width),
            IndexSink::Bitmap(m) => m[i / 8] |= 1 << (i % 8),
        }
    }

    /// Bytes of the index section.
    pub(super) fn finish(self) -> u64 {
        match self {
            IndexSink::Stream(w, ..) => w.finish() as u64,
            IndexSink::Bitmap(m) => m.len() as u64,
        }
    }
}

/// What a counting pass learns about a kept set: its size and widest index gap.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Scan {
    pub(super) count: usize,
    pub(super) max_gap: u64,
}

impl Scan {
    pub(super) fn of(x: &[f32], cut: Cut) -> Scan {
        let mut s = Scan::default();
        let mut next = 0usize;
        for_each_kept(x, cut.t, cut.need_eq, |i| {
            s.max_gap = s.max_gap.max((i - next) as u64);
            s.count += 1;
            next = i + 1;
        });
        s
    }
}

/// Bits of one index gap in a stream of `coding` (gaps or Rice) with its parameter.
#[inline(always)]
pub(super) fn gap_bits(coding: IndexCoding, param: u32, gap: u64) -> u64 {
    match coding {
        IndexCoding::Rice => (gap >> param) + param as u64 + 1,
        _ => param as u64,
    }
}

/// The exact length in bits of the Rice stream (parameter `b`) of the kept set.
pub(super) fn rice_bits(x: &[f32], cut: Cut, b: u32) -> u64 {
    let (mut bits, mut next) = (0u64, 0usize);
    for_each_kept(x, cut.t, cut.need_eq, |i| {
        bits += gap_bits(IndexCoding::Rice, b, (i - next) as u64);
        next = i + 1;
    });
    bits
}

/// Bits needed to hold `v` (0 for 0).
pub(super) fn bit_width(v: u64) -> u32 {
    64 - v.leading_zeros()
}
