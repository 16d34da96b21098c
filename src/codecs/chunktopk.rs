//! `chunktopk`: the `k` largest elements of every chunk of `chunk` elements, with 2-bit
//! values and a scale per chunk (SparseLoCo's layout: top 64 of every 4096 values).
//!
//! Spec: `chunktopk:chunk=C,k=K` (defaults 4096 and 64). The elements are cut into
//! chunks of `C` (the last may be shorter); each chunk keeps its `kc = min(K, c)`
//! elements of largest magnitude (as `topk` keeps them: NaN above Inf above finite
//! magnitudes, ties to the lower index) and writes a record of a fixed size:
//!
//! - the scale `s = absmax / 3` (f32, the kept elements' largest magnitude divided by 3);
//! - the kept positions in the chunk by Elias-Fano: `L` low bits each, then an upper bit
//!   vector of `kc + ((c - 1) >> L)` bits with bit `(p_i >> L) + i` set for each `i`, where
//!   `L` is the largest `l` with `kc 2^l <= c`; about `2 + log2(c / kc)` bits per kept
//!   element whatever the positions (8 at 64 of 4096, where a plain index takes 12);
//! - a 2-bit code per kept element: the nearest of `-3s, -s, +s, +3s` (thresholds `-2s`,
//!   `0`, `2s`).
//!
//! At the defaults a chunk of 4096 takes 84 bytes (0.164 bits per element): SparseLoCo's
//! 12-bit indices and 2-bit values take 112 for the same elements.
//!
//! Selection per chunk, for `k` up to 64: one pass finds a key that at least `k`
//! elements reach (the least of 16 interleaved groups' `ceil(k / 16)`-th largest), the
//! SIMD filter collects the elements reaching it (about `2 k`), and the `k` largest are
//! taken among those. For larger `k`, or where that bound lets more than `8 k` through (a
//! chunk mostly of zeros), a threshold from a stratified sample of 256 takes its place,
//! and `topk`'s exact engine runs where the sample misjudged. Its candidates live in
//! working room past the frame in the
//! output buffer, which [`crate::Codec::max_encoded_len`] includes (about 8 bytes per
//! chunk element), so encoding allocates nothing; the encoder may write anywhere in that
//! room. Large frames of chunks up to 4096 are encoded on all threads in ranges of whole
//! chunks (each thread's room on its stack): records are independent, so the bytes are
//! the same for any thread count.
//!
//! Error: a kept element is within `s` of its value (`absmax / 3` of its chunk's kept
//! elements, plus the f32 rounding of `s`); a dropped one loses its whole value, which is
//! what error feedback carries to the next step. Biased. A chunk keeping NaN or ±Inf gets
//! the scale `0x7FC00000` and its kept elements decode to NaN. Records are independent,
//! so the frame is the same bits on every CPU and for any chunking that keeps chunk
//! boundaries.

use core::fmt;

use super::topk::{TopCut, for_each_top};
use super::{EncodeCtx, Encoded, Scheme, expect_payload, sparse_prepare};
use crate::codec::{Args, CodecId, CodecSpec, payload_buf};
use crate::error::{Error, Result};
use crate::kernels::LANE_GROUPS as BOUND_GROUPS;
use crate::kernels::scalar::{BitReader, BitWriter, CANONICAL_NAN, INF_BITS, mode, put};
use crate::wire::{HEADER_LEN, Header};

/// Longest chunk.
pub const MAX_CHUNK: u32 = 1 << 16;

/// The 2-bit codes' levels, in units of the scale.
const LEVELS: [f32; 4] = [-3.0, -1.0, 1.0, 3.0];

/// The `chunktopk` codec (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkTopK {
    chunk: u32,
    k: u32,
}

impl Default for ChunkTopK {
    fn default() -> Self {
        ChunkTopK { chunk: 4096, k: 64 }
    }
}

/// The shape of one chunk's record.
#[derive(Debug, Clone, Copy)]
struct Record {
    /// Kept elements.
    kc: usize,
    /// Low bits per position.
    low: u32,
    /// Bits of the upper vector.
    upper: usize,
    /// Bytes of the whole record.
    bytes: usize,
}

impl Record {
    /// The record of a chunk of `c` elements (1 to [`MAX_CHUNK`]) keeping up to `k`.
    fn of(c: usize, k: usize) -> Record {
        let kc = k.min(c);
        let mut low = 0;
        while kc << (low + 1) <= c {
            low += 1;
        }
        let upper = kc + ((c - 1) >> low);
        let bits = kc * low as usize + upper + 2 * kc;
        Record {
            kc,
            low,
            upper,
            bytes: 4 + bits.div_ceil(8),
        }
    }
}

impl ChunkTopK {
    /// Chunks of `chunk` elements (1 to 65536), each keeping its `k` largest (1 to
    /// `chunk`).
    pub fn new(chunk: usize, k: usize) -> Result<ChunkTopK> {
        let bad = |name, reason: String| Error::Param {
            codec: CodecId::ChunkTopK,
            name,
            reason,
        };
        if !(1..=MAX_CHUNK as usize).contains(&chunk) {
            return Err(bad("chunk", format!("{chunk} is outside 1..={MAX_CHUNK}")));
        }
        if !(1..=chunk).contains(&k) {
            return Err(bad("k", format!("{k} is outside 1..={chunk}, the chunk")));
        }
        Ok(ChunkTopK {
            chunk: chunk as u32,
            k: k as u32,
        })
    }

    /// Elements per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk as usize
    }

    /// Elements kept per chunk.
    pub fn k(&self) -> usize {
        self.k as usize
    }

    pub(crate) fn from_args(a: &mut Args) -> core::result::Result<ChunkTopK, String> {
        let chunk = a.uint("chunk", 4096, 1..=u64::from(MAX_CHUNK))? as usize;
        let k = a.uint("k", 64, 1..=u64::from(MAX_CHUNK))? as usize;
        ChunkTopK::new(chunk, k).map_err(|e| match e {
            Error::Param { reason, name, .. } => format!("`{name}`: {reason}"),
            e => e.to_string(),
        })
    }

    /// Bytes of the payload of `n` elements (`None` past `u64`).
    fn payload(&self, n: u64) -> Option<u64> {
        let c = u64::from(self.chunk);
        let full = (n / c).checked_mul(Record::of(self.chunk(), self.k()).bytes as u64)?;
        let rest = match (n % c) as usize {
            0 => 0,
            r => Record::of(r, self.k()).bytes as u64,
        };
        full.checked_add(rest)
    }

    fn params(&self) -> [u8; 12] {
        let mut p = [0u8; 12];
        p[0..4].copy_from_slice(&self.chunk.to_le_bytes());
        p[4..8].copy_from_slice(&self.k.to_le_bytes());
        p
    }

    /// The error bound for inputs of magnitude at most `absmax` (see the module docs): a
    /// dropped element's whole value, or a kept one's distance to its level.
    pub(crate) fn error_bound(&self, absmax: f64) -> f64 {
        absmax * (1.0 + 2f64.powi(-20))
    }
}

impl fmt::Display for ChunkTopK {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chunktopk:chunk={},k={}", self.chunk, self.k)
    }
}

impl From<ChunkTopK> for CodecSpec {
    fn from(c: ChunkTopK) -> CodecSpec {
        CodecSpec::ChunkTopK(c)
    }
}

/// Samples of a chunk that estimate its selection threshold.
const SAMPLES: usize = 256;

/// Working room of a chunk's encoder: candidate positions and their keys, each room for
/// a chunk and the filter's 64 of slack.
struct Scratch<'a> {
    idx: &'a mut [u32],
    keys: &'a mut [u32],
}

/// Bytes of working room for chunks of `c` elements: the part of the output buffer past
/// the frame ([`crate::Codec::max_encoded_len`] includes it), so that encoding allocates
/// nothing.
fn room_bytes(c: usize) -> u64 {
    (2 * (c as u64 + 64)) * 4 + 3
}

/// The positions of the `kc` largest keys of `x` (`bits & 0x7FFFFFFF`, the lower
/// position first among equal keys), ascending, into `s.idx[..kc]`.
///
/// For `kc` up to 64 a first pass finds a bound that at least `kc` keys reach
/// ([`crate::kernels::lane_bound`]: the least of 16 interleaved groups' `ceil(kc / 16)`-th
/// largest keys), the SIMD filter collects the elements reaching it with their keys
/// (about `2 kc` of them on smooth data), and the `kc` largest are taken among those.
/// Larger `kc`, or a bound that lets more than `8 kc` through (a chunk mostly of
/// zeros), go the sampled way ([`sampled`]): a threshold estimated from a stratified
/// sample, then `topk`'s exact engine where the sample misjudged. The same set every way.
fn select(x: &[f32], kc: usize, s: &mut Scratch) {
    let c = x.len();
    if kc == c {
        for (i, o) in s.idx[..c].iter_mut().enumerate() {
            *o = i as u32;
        }
        return;
    }
    if kc <= 4 * BOUND_GROUPS && crate::kernels::lane_bound_pays() && bounded(x, kc, s) {
        return;
    }
    let len = sampled(x, kc, s);
    if len < kc {
        let mut n = 0;
        for_each_top(x, kc, |i| {
            s.idx[n] = i as u32;
            n += 1;
        });
        return;
    }
    keep_top(x, kc, len, s);
}

/// [`select`] by the bound of [`crate::kernels::lane_bound`] (`kc` at most 64): false,
/// with `s` changed but nothing decided, where more than `8 kc` elements reach it.
fn bounded(x: &[f32], kc: usize, s: &mut Scratch) -> bool {
    let t = crate::kernels::lane_bound(x, kc.div_ceil(BOUND_GROUPS));
    let len = crate::kernels::filter_keys(x, t, s.idx, s.keys);
    // At least kc reach the bound (fewer would be a bound's error: the sampled way then
    // decides instead of a selection out of range).
    debug_assert!(len >= kc);
    if len < kc || len > 8 * kc {
        return false;
    }
    keep_top(x, kc, len, s);
    true
}

/// Of the `len` candidates `s.idx[..len]` (ascending positions in `x`) with their keys
/// `s.keys[..len]`, keep in `s.idx[..kc]`, in order, the `kc` with the largest keys, the
/// lower position first among equal keys. `s.keys` changes.
fn keep_top(x: &[f32], kc: usize, len: usize, s: &mut Scratch) {
    if len == kc {
        return;
    }
    // The kc-th largest key t: selected in a copy past the keys where there is room (the
    // keys stay beside their positions), else in place and the keys read again.
    let (keys, spare) = s.keys.split_at_mut(len);
    let t = if spare.len() >= len {
        let copy = &mut spare[..len];
        copy.copy_from_slice(keys);
        *copy.select_nth_unstable_by(kc - 1, |a, b| b.cmp(a)).1
    } else {
        let t = *keys.select_nth_unstable_by(kc - 1, |a, b| b.cmp(a)).1;
        for (k, &i) in keys.iter_mut().zip(&s.idx[..len]) {
            *k = x[i as usize].to_bits() & 0x7FFF_FFFF;
        }
        t
    };
    // The candidates reaching t, in order (the SIMD compaction); where more than kc do,
    // some equal t: of those, the first ones in position order.
    let reach = crate::kernels::retain_mag_ge(&mut s.idx[..len], &mut s.keys[..len], t);
    if reach > kc {
        let above = s.keys[..reach].iter().filter(|&&k| k > t).count();
        let (mut eq_left, mut w) = (kc - above, 0);
        // Branch-free: each candidate is written and kept or overwritten by the next.
        for j in 0..reach {
            let (i, k) = (s.idx[j], s.keys[j]);
            let tie = (k == t) & (eq_left > 0);
            s.idx[w] = i;
            w += ((k > t) | tie) as usize;
            eq_left -= tie as usize;
        }
        debug_assert_eq!(w, kc);
    }
    debug_assert!(reach >= kc);
}

/// The candidates of a threshold from a stratified sample of `x` that about `2 kc`
/// reach, then, if fewer than `kc` did, `6 kc`, with their keys
/// ([`crate::kernels::filter_keys`] into `s`): the count of the last filter.
fn sampled(x: &[f32], kc: usize, s: &mut Scratch) -> usize {
    let c = x.len();
    let key = |v: f32| v.to_bits() & 0x7FFF_FFFF;
    let m = SAMPLES.min(c);
    let mut sample = [0u32; SAMPLES];
    // Every `c / m`-th element (which elements are sampled changes the speed only).
    let stride = c / m;
    for (j, o) in sample[..m].iter_mut().enumerate() {
        *o = key(x[j * stride]);
    }
    let sample = &mut sample[..m];
    let mut len = 0;
    for aim in [2, 6] {
        let rank = (aim * kc * m).div_ceil(c).clamp(1, m);
        let (_, &mut t, _) = sample.select_nth_unstable_by(rank - 1, |a, b| b.cmp(a));
        len = crate::kernels::filter_keys(x, t, s.idx, s.keys);
        if len >= kc {
            break;
        }
    }
    len
}

/// A source of a chunk's kept positions: each call walks them, in order.
trait Kept {
    fn each(&self, f: impl FnMut(u32));
}

/// Positions listed in working room.
struct Listed<'a>(&'a [u32]);

impl Kept for Listed<'_> {
    #[inline(always)]
    fn each(&self, mut f: impl FnMut(u32)) {
        self.0.iter().for_each(|&p| f(p));
    }
}

/// Positions found again on each walk by `topk`'s exact cut of a chunk.
struct Walked<'a>(TopCut, &'a [f32]);

impl Kept for Walked<'_> {
    fn each(&self, mut f: impl FnMut(u32)) {
        self.0.each(self.1, |p| f(p as u32));
    }
}

/// Write one chunk's record into `rec` (its exact size), the kept positions coming, in
/// order, from `kept` (walked once per part of the record); true if a kept value is NaN
/// or ±Inf.
fn write_record(x: &[f32], r: Record, kept: impl Kept, rec: &mut [u8]) -> bool {
    // The largest magnitude by its bits (the order of finite magnitudes, NaN and Inf
    // above them): no chain of float maxima.
    let (mut most, mut last) = (0u32, None);
    kept.each(|i| {
        most = most.max(x[i as usize].to_bits() & 0x7FFF_FFFF);
        last = Some(i);
    });
    let nonfinite = most >= INF_BITS;
    let s = if nonfinite {
        CANONICAL_NAN
    } else {
        f32::from_bits(most) / 3.0
    };
    rec[..4].copy_from_slice(&s.to_le_bytes());
    let body = &mut rec[4..];
    body.fill(0);
    let mut w = BitWriter::new(body);
    kept.each(|p| w.put(p & ((1u32 << r.low) - 1), r.low));
    // The upper vector: for each kept position p_i, bit (p_i >> low) + i.
    if r.upper <= 64 * UPPER_WORDS {
        // Set in words, then written 32 bits at a time. The word being set stays in a
        // register until a position's bit is past it (the bits rise).
        let mut words = [0u64; UPPER_WORDS];
        let (mut i, mut at, mut word) = (0, 0, 0u64);
        kept.each(|p| {
            let b = (p >> r.low) as usize + i;
            while b / 64 > at {
                words[at] = word;
                (at, word) = (at + 1, 0);
            }
            word |= 1 << (b % 64);
            i += 1;
        });
        words[at] = word;
        let mut rest = r.upper;
        for half in words.iter().flat_map(|&v| [v as u32, (v >> 32) as u32]) {
            let n = rest.min(32);
            if n == 0 {
                break;
            }
            w.put(half, n as u32);
            rest -= n;
        }
    } else {
        // (p >> low) zero bits since the last one, then a one.
        let mut high = 0u32;
        kept.each(|p| {
            let h = p >> r.low;
            let mut zeros = h - high;
            while zeros >= 32 {
                w.put(0, 32);
                zeros -= 32;
            }
            w.put(1 << zeros, zeros + 1);
            high = h;
        });
        let written = last.map_or(0, |p| (p >> r.low) as usize + r.kc);
        let mut rest = r.upper - written;
        while rest >= 32 {
            w.put(0, 32);
            rest -= 32;
        }
        w.put(0, rest as u32);
    }
    // The codes, 16 to a put.
    let (mut group, mut n) = (0u32, 0u32);
    kept.each(|p| {
        let code = if nonfinite {
            0
        } else {
            code_of(x[p as usize], s)
        };
        group |= code << (2 * n);
        n += 1;
        if n == 16 {
            w.put(group, 32);
            (group, n) = (0, 0);
        }
    });
    w.put(group, 2 * n);
    w.finish();
    nonfinite
}

/// The 2-bit code of a kept value `v` in a chunk of scale `s`: the nearest of `-3s, -s,
/// +s, +3s` by the thresholds `-2s`, `0`, `2s`.
#[inline(always)]
fn code_of(v: f32, s: f32) -> u32 {
    let t = 2.0 * s;
    (v >= -t) as u32 + (v >= 0.0) as u32 + (v >= t) as u32
}

/// Words of the upper vector set in place by [`write_record`] (up to 256 bits: chunks
/// keeping up to 85 elements); longer ones are written run by run.
const UPPER_WORDS: usize = 4;

/// One chunk's record with working room: the sampled selection, then the record from
/// the kept list.
fn encode_chunk(x: &[f32], r: Record, s: &mut Scratch, rec: &mut [u8]) -> bool {
    select(x, r.kc, s);
    write_record(x, r, Listed(&s.idx[..r.kc]), rec)
}

/// One chunk's record without working room (a buffer that holds only the frame):
/// `topk`'s exact engine finds the cut once, and each pass walks the kept elements again.
/// The same bytes as [`encode_chunk`].
fn encode_chunk_in_place(x: &[f32], r: Record, rec: &mut [u8]) -> bool {
    write_record(x, r, Walked(TopCut::of(x, r.kc), x), rec)
}

/// The records of the chunks of `x` (`chunk` elements each, keeping `k`) into `p`, with
/// working room `s` (by [`encode_chunk`]) or without ([`encode_chunk_in_place`]); true
/// if a kept value is NaN or ±Inf.
fn encode_run(x: &[f32], chunk: usize, k: usize, p: &mut [u8], mut s: Option<Scratch>) -> bool {
    let (mut at, mut nonfinite) = (0, false);
    for xc in x.chunks(chunk) {
        let r = Record::of(xc.len(), k);
        let rec = &mut p[at..at + r.bytes];
        nonfinite |= match &mut s {
            Some(s) => encode_chunk(xc, r, s, rec),
            None => encode_chunk_in_place(xc, r, rec),
        };
        at += r.bytes;
    }
    debug_assert_eq!(at, p.len());
    nonfinite
}

/// The error-feedback step of a run of chunks: each chunk's input `beta r + gamma g`
/// formed into `r`, encoded into `p` while it is in cache (by [`encode_chunk`]), and the
/// kept elements' residuals written over it at once: what decoding the record onto the
/// chunk in residual mode leaves there, but the frame's non-finite pass (see
/// [`ChunkTopK::encode_formed`]). True if a kept value is NaN or ±Inf.
fn feedback_run(
    (r, g): (&mut [f32], &[f32]),
    (beta, gamma): (f32, f32),
    chunk: usize,
    k: usize,
    p: &mut [u8],
    s: &mut Scratch,
) -> bool {
    let (mut at, mut nonfinite) = (0, false);
    for (rc, gc) in r.chunks_mut(chunk).zip(g.chunks(chunk)) {
        crate::kernels::feedback_form(rc, gc, beta, gamma);
        let shape = Record::of(rc.len(), k);
        let rec = &mut p[at..at + shape.bytes];
        let bad = encode_chunk(rc, shape, s, rec);
        // The decoder's values: the scale times the level of each kept element's code
        // (code 0 where the scale is NaN, whose products are NaN and decode as the
        // canonical NaN).
        let scale = f32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
        for &i in &s.idx[..shape.kc] {
            let v = &mut rc[i as usize];
            let code = if bad { 0 } else { code_of(*v, scale) };
            let d = scale * LEVELS[code as usize];
            put::<{ mode::RESIDUAL }>(v, if d.is_nan() { CANONICAL_NAN } else { d });
        }
        nonfinite |= bad;
        at += shape.bytes;
    }
    debug_assert_eq!(at, p.len());
    nonfinite
}

/// Longest chunk encoded on all threads (each thread's room is on its stack: 33 KiB).
const PAR_CHUNK: usize = 4096;

/// Elements that cut at a chunk boundary: an input, or a residual and its gradient.
trait Elements: Sized + Send {
    fn split_at(self, at: usize) -> (Self, Self);
}

impl Elements for &[f32] {
    fn split_at(self, at: usize) -> (Self, Self) {
        <[f32]>::split_at(self, at.min(self.len()))
    }
}

impl Elements for (&mut [f32], &[f32]) {
    fn split_at(self, at: usize) -> (Self, Self) {
        let at = at.min(self.0.len());
        let ((r0, r1), (g0, g1)) = (self.0.split_at_mut(at), self.1.split_at(at));
        ((r0, g0), (r1, g1))
    }
}

/// Whole chunks of the elements and their records (all of one size but the last's).
struct Parts<'a, X> {
    x: X,
    p: &'a mut [u8],
    chunk: usize,
    record: usize,
}

impl<X: Elements> crate::parallel::Split for Parts<'_, X> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at(at * self.chunk);
        let (p0, p1) = self.p.split_at_mut((at * self.record).min(self.p.len()));
        let (chunk, record) = (self.chunk, self.record);
        (
            Parts {
                x: x0,
                p: p0,
                chunk,
                record,
            },
            Parts {
                x: x1,
                p: p1,
                chunk,
                record,
            },
        )
    }
}

/// Run `f` over the `n` elements of `parts` with working room: for large frames of
/// chunks up to [`PAR_CHUNK`], on all threads in ranges of whole chunks, each thread's
/// room on its stack (records are independent, so the bytes are the same); else with
/// the room past the frame (`room`, of chunks up to `c` elements), or none where the
/// output holds only the frame. True if any call returned true.
fn in_ranges<X: Elements>(
    parts: Parts<'_, X>,
    n: usize,
    c: usize,
    room: Option<&mut [u8]>,
    f: &(impl Fn(Parts<'_, X>, Option<Scratch>) -> bool + Sync),
) -> bool {
    let chunks = n.div_ceil(parts.chunk.max(1));
    if parts.chunk <= PAR_CHUNK && chunks > 1 && crate::parallel::worth(n, 8) {
        let per = chunks.div_ceil(64).max(1);
        crate::parallel::for_ranges(parts, chunks, per, true, &|b, _| {
            let (mut idx, mut keys) = ([0u32; PAR_CHUNK + 64], [0u32; PAR_CHUNK + 64]);
            let s = Scratch {
                idx: &mut idx,
                keys: &mut keys,
            };
            f(b, Some(s))
        })
    } else if let Some(room) = room {
        let words = crate::kernels::words_mut(room);
        let (idx, keys) = words.split_at_mut(c + 64);
        let s = Scratch {
            idx,
            keys: &mut keys[..c + 64],
        };
        f(parts, Some(s))
    } else {
        f(parts, None)
    }
}

impl Scheme for ChunkTopK {
    const ID: CodecId = CodecId::ChunkTopK;

    fn check_elements(&self, n: u64) -> Result<()> {
        self.payload(n).map(|_| ()).ok_or_else(|| Error::Param {
            codec: CodecId::ChunkTopK,
            name: "elements",
            reason: format!("{n} elements imply a payload longer than 2^64 bytes"),
        })
    }

    /// The frame's payload and working room for one chunk's candidates.
    fn max_payload(&self, n: u64) -> u64 {
        let c = (self.chunk() as u64).min(n) as usize;
        self.payload(n)
            .and_then(|p| p.checked_add(room_bytes(c)))
            .unwrap_or(u64::MAX)
    }

    fn encode_payload(&self, x: &[f32], _ctx: &EncodeCtx, out: &mut [u8]) -> Result<Encoded> {
        self.check_elements(x.len() as u64)?;
        let len = self.payload(x.len() as u64).expect("checked");
        let c = self.chunk().min(x.len());
        let with_room = HEADER_LEN as u64 + len + room_bytes(c) <= out.len() as u64;
        payload_buf(out, len)?;
        let (p, room) = out[HEADER_LEN..].split_at_mut(len as usize);
        let (chunk, k) = (self.chunk(), self.k());
        let parts = Parts {
            x,
            p,
            chunk,
            record: Record::of(chunk, k).bytes,
        };
        let room = with_room.then_some(room);
        let nonfinite = in_ranges(parts, x.len(), c, room, &|b, s| {
            encode_run(b.x, chunk, k, b.p, s)
        });
        Ok(Encoded {
            payload_len: len,
            params: self.params(),
            nonfinite,
            seed: 0,
            entropy: false,
        })
    }

    /// One pass: each chunk's input formed, encoded and its kept elements' residuals
    /// written while it is in cache ([`feedback_run`]), on all threads for large tensors
    /// as the encoder runs; the dropped elements keep their input, which is their
    /// residual. Where a kept value is NaN or ±Inf, every element then takes the
    /// residual of a decoded 0 (`residual_of(r, 0)`), as the decoder's first pass gives
    /// it: for each element the two orders give the same value. Without working room in
    /// `out`, the unfused steps.
    fn encode_formed(
        &self,
        r: &mut [f32],
        (g, beta, gamma): (&[f32], f32, f32),
        ctx: &EncodeCtx,
        out: &mut [u8],
    ) -> Result<(Encoded, bool)> {
        self.check_elements(r.len() as u64)?;
        let len = self.payload(r.len() as u64).expect("checked");
        let c = self.chunk().min(r.len());
        if (HEADER_LEN as u64 + len + room_bytes(c)) > out.len() as u64 {
            crate::parallel::feedback_form(r, g, beta, gamma);
            return Ok((self.encode_payload(r, ctx, out)?, false));
        }
        payload_buf(out, len)?;
        let (p, room) = out[HEADER_LEN..].split_at_mut(len as usize);
        let (chunk, k) = (self.chunk(), self.k());
        let n = r.len();
        let parts = Parts {
            x: (&mut *r, g),
            p,
            chunk,
            record: Record::of(chunk, k).bytes,
        };
        let nonfinite = in_ranges(parts, n, c, Some(room), &|b, s| {
            let mut s = s.expect("working room");
            feedback_run(b.x, (beta, gamma), chunk, k, b.p, &mut s)
        });
        sparse_prepare::<{ mode::RESIDUAL }>(nonfinite, r);
        Ok((
            Encoded {
                payload_len: len,
                params: self.params(),
                nonfinite,
                seed: 0,
                entropy: false,
            },
            true,
        ))
    }

    fn read(h: &Header) -> Result<ChunkTopK> {
        let field = |field, reason: String| Error::BadField {
            codec: CodecId::ChunkTopK,
            field,
            reason,
        };
        let (chunk, k) = (h.param_u32(0), h.param_u32(4));
        h.params_zero_from(8)?;
        h.seed_zero()?;
        if !(1..=MAX_CHUNK).contains(&chunk) {
            return Err(field(
                "params.chunk",
                format!("{chunk} is outside 1..={MAX_CHUNK}"),
            ));
        }
        if !(1..=chunk).contains(&k) {
            return Err(field(
                "params.k",
                format!("{k} is outside 1..={chunk}, the chunk"),
            ));
        }
        let c = ChunkTopK { chunk, k };
        expect_payload(h, c.payload(h.elements))?;
        Ok(c)
    }

    fn decode_payload<const M: u8>(&self, h: &Header, p: &[u8], out: &mut [f32]) -> Result<()> {
        let c = self.chunk();
        // Check every record before writing anything: exactly kc ones in the upper
        // vector, positions increasing and inside the chunk, zero padding.
        let mut at = 0;
        for (q, chunk) in out.chunks(c).enumerate() {
            let r = Record::of(chunk.len(), self.k());
            let rec = &p[at..at + r.bytes];
            positions(rec, r, chunk.len(), |_, _| ()).map_err(|(off, reason)| Error::Corrupt {
                codec: CodecId::ChunkTopK,
                offset: HEADER_LEN + at + off,
                reason: format!("chunk {q}: {reason}"),
            })?;
            at += r.bytes;
        }
        sparse_prepare::<M>(h.flags & crate::wire::FLAG_NONFINITE != 0, out);
        let mut at = 0;
        for chunk in out.chunks_mut(c) {
            let r = Record::of(chunk.len(), self.k());
            let rec = &p[at..at + r.bytes];
            let s = f32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
            positions(rec, r, chunk.len(), |i, code| {
                let v = s * LEVELS[code as usize];
                put::<M>(&mut chunk[i], if v.is_nan() { CANONICAL_NAN } else { v });
            })
            .expect("checked above");
            at += r.bytes;
        }
        Ok(())
    }

    fn expected_payload(&self, n: u64) -> f64 {
        self.payload(n).map_or(f64::INFINITY, |p| p as f64)
    }

    fn is_unbiased(&self) -> bool {
        false
    }
}

/// Read one record's kept positions (in a chunk of `c`) and codes, calling `f(position,
/// code)` in order; on a malformed record, the byte offset in it and why. The upper
/// vector is read 64 bits at a time, each one bit found by its trailing-zero count.
fn positions(
    rec: &[u8],
    r: Record,
    c: usize,
    mut f: impl FnMut(usize, u32),
) -> core::result::Result<(), (usize, String)> {
    let body = &rec[4..];
    let mut low = BitReader::new(body);
    // The codes follow the low bits and the upper vector: a reader of their own,
    // positioned by skipping.
    let start = r.kc * r.low as usize;
    let mut codes = BitReader::new(body);
    skip(&mut codes, start + r.upper);
    let (mut ones, mut prev) = (0usize, None::<usize>);
    let mut base = 0;
    while base < r.upper {
        let width = (r.upper - base).min(64);
        let mut word = bits_at(body, start + base, width);
        while word != 0 {
            // The `ones`-th one bit is bit `seen` of the vector: `seen - ones` zeros
            // before it, the position's high part.
            let seen = base + word.trailing_zeros() as usize;
            word &= word - 1;
            if ones == r.kc {
                return Err((4, format!("the upper vector holds more than {} ones", r.kc)));
            }
            let p = ((seen - ones) << r.low) | low.get(r.low) as usize;
            if p >= c || prev.is_some_and(|q| p <= q) {
                return Err((
                    4,
                    format!("position {p} does not follow {prev:?} in a chunk of {c}"),
                ));
            }
            prev = Some(p);
            f(p, codes.get(2));
            ones += 1;
        }
        base += width;
    }
    if ones < r.kc {
        return Err((4, format!("the upper vector holds {ones} of {} ones", r.kc)));
    }
    // The padding must be zeros.
    let used = start + r.upper + 2 * r.kc;
    if !used.is_multiple_of(8) && body[used / 8] >> (used % 8) != 0 {
        return Err((4 + used / 8, "padding bits are not zero".into()));
    }
    Ok(())
}

/// The `width` (1 to 64) bits of `body` from bit `at` on (least significant first), in
/// the low bits of a word; `body` holds them.
fn bits_at(body: &[u8], at: usize, width: usize) -> u64 {
    debug_assert!((1..=64).contains(&width) && at + width <= 8 * body.len());
    let first = at / 8;
    let mut buf = [0u8; 16];
    let n = (body.len() - first).min(16);
    buf[..n].copy_from_slice(&body[first..first + n]);
    let word = (u128::from_le_bytes(buf) >> (at % 8)) as u64;
    if width == 64 {
        word
    } else {
        word & ((1u64 << width) - 1)
    }
}

fn skip(r: &mut BitReader, mut bits: usize) {
    while bits >= 32 {
        r.get(32);
        bits -= 32;
    }
    r.get(bits as u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kept positions by definition: sort by key (descending), then position.
    fn oracle(x: &[f32], kc: usize) -> Vec<u32> {
        let key = |v: f32| v.to_bits() & 0x7FFF_FFFF;
        let mut order: Vec<u32> = (0..x.len() as u32).collect();
        order.sort_by(|&a, &b| key(x[b as usize]).cmp(&key(x[a as usize])).then(a.cmp(&b)));
        let mut kept = order[..kc].to_vec();
        kept.sort_unstable();
        kept
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "its unsafe code (words_mut) is reached by tests/miri.rs; natively on every route"
    )]
    fn selection_keeps_the_largest_on_every_route() {
        use crate::kernels::{Backend, BackendKind};
        // Miri runs a short chunk (every element is then in the sample), on its one
        // backend.
        let c = if cfg!(miri) { 256 } else { 4096 };
        let mut inputs: Vec<(&str, Vec<f32>)> = Vec::new();
        inputs.push((
            "smooth",
            (0..c).map(|i| ((i * 7919) % 1013) as f32 - 506.0).collect(),
        ));
        // Only the sampled elements are large: the sample's threshold lets too few
        // through twice, and the exact engine runs.
        inputs.push((
            "sample-only",
            (0..c)
                .map(|i| {
                    if i % 16 == 0 {
                        1000.0 + i as f32
                    } else {
                        1e-3 * (i % 7) as f32
                    }
                })
                .collect(),
        ));
        inputs.push(("all equal", vec![0.5; c]));
        inputs.push(("ties", (0..c).map(|i| (i % 3) as f32).collect()));
        let mut nonfinite: Vec<f32> = (0..c).map(|i| (i % 101) as f32).collect();
        nonfinite[3] = f32::NAN;
        nonfinite[c - 96] = f32::NEG_INFINITY;
        inputs.push(("non-finite", nonfinite));
        inputs.push((
            "zeros and signs",
            (0..c)
                .map(|i| if i % 2 == 0 { -0.0 } else { 0.0 })
                .collect(),
        ));
        // Mostly zeros: some of the bound's groups hold fewer large elements than its
        // depth, so it is 0, lets everything through, and the sampled way runs.
        inputs.push((
            "mostly zeros",
            (0..c)
                .map(|i| {
                    if i % 97 == 0 {
                        (i % 13) as f32 - 6.0
                    } else {
                        0.0
                    }
                })
                .collect(),
        ));
        // The large elements all in one of the bound's groups (every 16th position).
        inputs.push((
            "one group",
            (0..c)
                .map(|i| {
                    if i % 16 == 5 {
                        100.0 + i as f32
                    } else {
                        (i % 11) as f32
                    }
                })
                .collect(),
        ));
        // A heavy-tailed mixture of scales, and NaN and Inf among many candidates.
        let mut heavy: Vec<f32> = (0..c)
            .map(|i| {
                let u = ((i as u64 * 2654435761) % 1_000_003) as f32 / 1_000_003.0;
                (u - 0.5) / (0.01 + u * u * u) * if i % 3 == 0 { 1e-3 } else { 1.0 }
            })
            .collect();
        inputs.push(("heavy", heavy.clone()));
        heavy[17] = f32::NAN;
        heavy[c / 2] = f32::INFINITY;
        heavy[c - 1] = -f32::NAN;
        inputs.push(("heavy, non-finite", heavy));
        let backends: Vec<Backend> = BackendKind::ALL
            .into_iter()
            .filter_map(Backend::of)
            .collect();
        // Chunks shorter than the input, and not multiples of the kernels' steps; every
        // depth of the bound and the sizes around it (fewer under Miri).
        let (sizes, ks): (&[usize], &[usize]) = if cfg!(miri) {
            (&[c], &[1, 7, 64, 200, c - 1, c])
        } else {
            (
                &[c, c - 5, c / 4 + 3, 100, 33],
                &[1, 7, 16, 17, 33, 48, 64, 65, 200, c - 1, c],
            )
        };
        for (name, x) in &inputs {
            for &c in sizes {
                let x = &x[..c];
                for &kc in ks {
                    if kc == 0 || kc > c {
                        continue;
                    }
                    let want = oracle(x, kc);
                    for b in &backends {
                        let (mut idx, mut keys) = (vec![0; c + 64], vec![0; c + 64]);
                        let mut s = Scratch {
                            idx: &mut idx,
                            keys: &mut keys,
                        };
                        b.run(|| select(x, kc, &mut s));
                        assert_eq!(s.idx[..kc], want[..], "{name} c={c} k={kc} on {b}");
                    }
                }
            }
        }
    }

    /// [`positions`] as first written: the upper vector one bit at a time.
    fn positions_bitwise(
        rec: &[u8],
        r: Record,
        c: usize,
    ) -> core::result::Result<Vec<(usize, u32)>, (usize, String)> {
        let body = &rec[4..];
        let mut low = BitReader::new(body);
        let mut upper = BitReader::new(body);
        skip(&mut upper, r.kc * r.low as usize);
        let mut codes = BitReader::new(body);
        skip(&mut codes, r.kc * r.low as usize + r.upper);
        let (mut seen, mut ones, mut prev, mut got) = (0usize, 0usize, None::<usize>, vec![]);
        while ones < r.kc {
            if seen == r.upper {
                return Err((4, format!("the upper vector holds {ones} of {} ones", r.kc)));
            }
            let bit = upper.get(1);
            seen += 1;
            if bit == 0 {
                continue;
            }
            let p = ((seen - 1 - ones) << r.low) | low.get(r.low) as usize;
            if p >= c || prev.is_some_and(|q| p <= q) {
                return Err((
                    4,
                    format!("position {p} does not follow {prev:?} in a chunk of {c}"),
                ));
            }
            prev = Some(p);
            got.push((p, codes.get(2)));
            ones += 1;
        }
        while seen < r.upper {
            if upper.get(1) != 0 {
                return Err((4, format!("the upper vector holds more than {} ones", r.kc)));
            }
            seen += 1;
        }
        let used = r.kc * r.low as usize + r.upper + 2 * r.kc;
        if !used.is_multiple_of(8) && body[used / 8] >> (used % 8) != 0 {
            return Err((4 + used / 8, "padding bits are not zero".into()));
        }
        Ok(got)
    }

    #[test]
    fn records_read_word_by_word_as_bit_by_bit() {
        // Every single-bit change of records of several shapes (and pairs of changes in
        // the upper vector): the same positions and codes, or the same error.
        let shapes: &[(usize, usize)] = if cfg!(miri) {
            &[(100, 7), (5, 64)]
        } else {
            &[
                (4096, 64),
                (100, 7),
                (5, 64),
                (1, 1),
                (1000, 999),
                (70, 3),
                (300, 1),
            ]
        };
        for &(c, k) in shapes {
            let x: Vec<f32> = (0..c).map(|i| ((i * 7919) % 997) as f32 - 498.0).collect();
            let r = Record::of(c, k);
            let (mut idx, mut keys) = (vec![0; c + 64], vec![0; c + 64]);
            let mut s = Scratch {
                idx: &mut idx,
                keys: &mut keys,
            };
            let mut rec = vec![0u8; r.bytes];
            encode_chunk(&x, r, &mut s, &mut rec);
            let read = |rec: &[u8]| {
                let mut got = vec![];
                positions(rec, r, c, |p, code| got.push((p, code))).map(|()| got)
            };
            assert_eq!(read(&rec), positions_bitwise(&rec, r, c), "c {c} k {k}");
            assert!(read(&rec).is_ok());
            let bits = 8 * (r.bytes - 4);
            let start = r.kc * r.low as usize;
            for b in 0..bits {
                let mut bad = rec.clone();
                bad[4 + b / 8] ^= 1 << (b % 8);
                assert_eq!(
                    read(&bad),
                    positions_bitwise(&bad, r, c),
                    "c {c} k {k} bit {b}"
                );
                if (start..start + r.upper).contains(&b) {
                    for b2 in (b + 1..start + r.upper).step_by(7.max(r.upper / 16)) {
                        let mut worse = bad.clone();
                        worse[4 + b2 / 8] ^= 1 << (b2 % 8);
                        assert_eq!(
                            read(&worse),
                            positions_bitwise(&worse, r, c),
                            "c {c} k {k} bits {b} {b2}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn records_have_the_stated_sizes() {
        // 64 of 4096: L = 6, 64 * 6 + 127 + 128 = 639 bits, 80 bytes, 84 with the scale.
        let r = Record::of(4096, 64);
        assert_eq!((r.kc, r.low, r.upper, r.bytes), (64, 6, 127, 84));
        // Everything kept: L = 0, positions 0..c as a run of ones.
        let r = Record::of(5, 64);
        assert_eq!((r.kc, r.low, r.upper), (5, 0, 9));
        assert_eq!(Record::of(1, 1).upper, 1);
    }
}
