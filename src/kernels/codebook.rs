//! The `codebook` codec's arithmetic (INTELLECT-1's int8 with a codebook of bin means):
//! the definition, which every backend compiles for its instruction set.

use super::scalar::put;

/// Entries of a codebook.
pub const ENTRIES: usize = 256;
/// Bytes of a codebook: 256 little-endian f32.
pub const BOOK_BYTES: usize = 4 * ENTRIES;
/// The bins span the block's mean plus and minus this many standard deviations.
pub const SIGMAS: f64 = 6.0;

/// The code of `x` (0..=255) for bins of width `1 / r` from `lo`:
/// `clamp(floor((x - lo) * r), 0, 255)` in f64 (one product instead of a division, and
/// no branch, so that the backends' compilers convert whole vectors).
#[inline(always)]
fn bin(x: f32, lo: f64, r: f64) -> u8 {
    let t = ((x as f64 - lo) * r).floor();
    // max and min rather than clamp (the same value: t is never NaN), and the integer
    // read from the low mantissa bits of the f32 t + 2^23 (exact: t is an integer in
    // 0..=255) rather than a saturating cast, so that the compilers keep both in vectors
    // (and pack 16 codes from four f32 quarters rather than from f64 lanes).
    let t = t.max(0.0).min((ENTRIES - 1) as f64) as f32;
    (t + 8_388_608.0).to_bits() as u8
}

/// The f64 sum of `f(x)` in 16 interleaved lanes (element `j` to lane `j % 16`), the
/// lanes then combined as `l[j] += l[j + 8]`, then `+4`, `+2`, `+1`: the crate's lane
/// order (the sums of qsgd's norms), written as whole rows of 16 so that it vectorises.
#[inline(always)]
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut l = [0f64; 16];
    let (rows, rest) = x.as_chunks::<16>();
    for row in rows {
        // A row's 16 terms, then 16 sums: the form both vector widths keep in registers.
        let t: [f64; 16] = core::array::from_fn(|k| f(row[k]));
        l = core::array::from_fn(|k| l[k] + t[k]);
    }
    for (s, &v) in l.iter_mut().zip(rest) {
        *s += f(v);
    }
    for w in [8, 4, 2, 1] {
        for j in 0..w {
            l[j] += l[j + w];
        }
    }
    l[0]
}

/// A bin of the histogram: the sum of its elements and their count.
#[derive(Clone, Copy)]
#[repr(align(16))]
struct Pair([f64; 2]);

impl Pair {
    #[inline(always)]
    fn add(&mut self, p: Pair) {
        let ([s, n], [v, one]) = (self.0, p.0);
        self.0 = [s + v, n + one];
    }
}

/// Encode one range of whole blocks: per block a codebook of 256 f32, then one code
/// byte per element. True when `x` held NaN or ±Inf.
///
/// Per block of `n` elements:
/// - a block holding NaN or ±Inf: every entry NaN (`0x7FC00000`), codes 0;
/// - else `mu = (sum x) / n` and `sigma = sqrt((sum (x - mu)^2) / n)`, both in f64 with the
///   sums taken in the 16-lane order (`lane_sum`); if `sigma = 0` (every element
///   equal), codes 0, entry 0 `mu` as f32 and the other entries 0;
/// - else 256 bins of width `w = 12 sigma / 256` from `lo = mu - 6 sigma`: element `x` goes
///   to bin `clamp(floor((x - lo) * r), 0, 255)` with `r = 256 / (12 sigma)` (f64), which
///   is its code; entry `k` is the mean of the elements in bin `k`: the f64 sums, in
///   element order, of its elements at block indices `j` with `j % 4 = 0, 1, 2, 3`,
///   added as `(s0 + s1) + (s2 + s3)`, over their count, rounded to f32; for an empty
///   bin, its centre `lo + (k + 1/2) w` clamped to `±f32::MAX`, as f32.
///
/// Every backend compiles this one source (the moments and the codes vectorise; the
/// bins' sums are four interleaved histograms), so the bytes are the same.
#[inline(always)]
pub fn encode(x: &[f32], block: usize, books: &mut [u8], codes: &mut [u8]) -> bool {
    let mut nonfinite = false;
    for (b, (xb, cb)) in x.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
        let book = &mut books[b * BOOK_BYTES..(b + 1) * BOOK_BYTES];
        let entries = book.chunks_exact_mut(4);
        let n = xb.len() as f64;
        let total = lane_sum(xb, |v| v as f64);
        // The f64 sum of f32 cannot overflow (blocks hold at most 2^24 elements), so it
        // is finite exactly when every element is: the block's finiteness check.
        if !total.is_finite() {
            nonfinite = true;
            entries.for_each(|e| e.copy_from_slice(&0x7FC0_0000u32.to_le_bytes()));
            cb.fill(0);
            continue;
        }
        let mu = total / n;
        // d * d, not powi: powi's precision is unspecified.
        let var = lane_sum(xb, |v| {
            let d = v as f64 - mu;
            d * d
        }) / n;
        let sigma = var.sqrt();
        if sigma == 0.0 {
            book.fill(0);
            book[..4].copy_from_slice(&(mu as f32).to_le_bytes());
            cb.fill(0);
            continue;
        }
        let lo = mu - SIGMAS * sigma;
        let span = 2.0 * SIGMAS * sigma;
        let w = span / ENTRIES as f64;
        let r = ENTRIES as f64 / span;
        let hist = histogram(xb, cb, lo, r);
        for (k, e) in entries.enumerate() {
            let [a, b, c, d] = [0, 1, 2, 3].map(|h| hist[h][k].0);
            let n = (a[1] + b[1]) + (c[1] + d[1]);
            let v = if n > 0.0 {
                (((a[0] + b[0]) + (c[0] + d[0])) / n) as f32
            } else {
                // The centre can lie past f32's range (bins span 12 sigma).
                let max = f32::MAX as f64;
                (lo + (k as f64 + 0.5) * w).clamp(-max, max) as f32
            };
            e.copy_from_slice(&v.to_le_bytes());
        }
    }
    nonfinite
}

/// Bins of each histogram in memory: 4 more than [`ENTRIES`], so that the same bin of two
/// histograms is not 4 KiB apart (a load would wait on the other's store: the CPU compares
/// the low 12 bits of addresses).
const PADDED: usize = ENTRIES + 4;

/// Elements per step of [`histogram`]: its buffers stay in the first-level cache.
const STEP: usize = 256;

/// Write the codes of `xb` (bins of width `1 / r` from `lo`) to `cb` and return the four
/// histograms of their bins: element `j` adds `(x as f64, 1)` to bin `code` of histogram
/// `j % 4`, in element order.
///
/// Consecutive elements in one bin (common near the mean) then update different memory,
/// not one chain. A bin holds its sum and its count as one pair of f64 (the count is
/// exact: blocks are far below 2^53), and each step first converts its elements to such
/// pairs in whole vectors, so that an element's update is one 16-byte load, add and
/// store.
#[inline(always)]
fn histogram(xb: &[f32], cb: &mut [u8], lo: f64, r: f64) -> [[Pair; PADDED]; 4] {
    let mut hist = [[Pair([0.0; 2]); PADDED]; 4];
    let mut pairs = [Pair([0.0; 2]); STEP];
    for (xs, cs) in xb.chunks(STEP).zip(cb.chunks_mut(STEP)) {
        for ((c, p), &v) in cs.iter_mut().zip(&mut pairs).zip(xs) {
            *c = bin(v, lo, r);
            *p = Pair([v as f64, 1.0]);
        }
        let (mut c4, mut p4) = (cs.chunks_exact(4), pairs[..xs.len()].chunks_exact(4));
        for (c, p) in (&mut c4).zip(&mut p4) {
            for h in 0..4 {
                hist[h][c[h] as usize].add(p[h]);
            }
        }
        // A step is a multiple of 4, so only a block's last step has a remainder.
        for (h, (&c, &p)) in c4.remainder().iter().zip(p4.remainder()).enumerate() {
            hist[h][c as usize].add(p);
        }
    }
    hist
}

/// Decode one range of whole blocks in mode `M`: element = its block's entry `code`.
pub fn decode<const M: u8>(books: &[u8], codes: &[u8], block: usize, out: &mut [f32]) {
    for (b, (ob, cb)) in out.chunks_mut(block).zip(codes.chunks(block)).enumerate() {
        let book = &books[b * BOOK_BYTES..(b + 1) * BOOK_BYTES];
        let table: [f32; ENTRIES] = core::array::from_fn(|k| {
            f32::from_le_bytes([
                book[4 * k],
                book[4 * k + 1],
                book[4 * k + 2],
                book[4 * k + 3],
            ])
        });
        for (o, &c) in ob.iter_mut().zip(cb) {
            put::<M>(o, table[c as usize]);
        }
    }
}
