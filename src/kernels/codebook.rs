//! The `codebook` codec's arithmetic (INTELLECT-1's int8 with a codebook of bin means):
//! the definition, run by every backend (a histogram's per-bin sums are sequential).

use super::scalar::{BlockScale, put};

/// Entries of a codebook.
pub const ENTRIES: usize = 256;
/// Bytes of a codebook: 256 little-endian f32.
pub const BOOK_BYTES: usize = 4 * ENTRIES;
/// The bins span the block's mean plus and minus this many standard deviations.
pub const SIGMAS: f64 = 6.0;

/// The bin of `x` (0..=255) for bins of width `w` from `lo`: `floor((x - lo) / w)`,
/// clamped, in f64.
#[inline(always)]
fn bin(x: f32, lo: f64, w: f64) -> usize {
    let t = ((x as f64 - lo) / w).floor();
    t.clamp(0.0, (ENTRIES - 1) as f64) as usize
}

/// Encode one range of whole blocks: per block a codebook of 256 f32, then one code
/// byte per element. True when `x` held NaN or ±Inf.
///
/// Per block of `n` elements:
/// - a block holding NaN or ±Inf: every entry NaN (`0x7FC00000`), codes 0;
/// - else `mu = (sum x) / n` and `sigma = sqrt((sum (x - mu)^2) / n)`, both in f64 with the
///   sums taken in element order; if `sigma = 0` (every element equal), codes 0, entry 0
///   `mu` as f32 and the other entries 0;
/// - else 256 bins of width `w = 12 sigma / 256` from `lo = mu - 6 sigma`: element `x` goes
///   to bin `clamp(floor((x - lo) / w), 0, 255)` (f64), which is its code; entry `k` is
///   the mean of the elements in bin `k` (their f64 sum in element order over their
///   count, rounded to f32), or, for an empty bin, its centre `lo + (k + 1/2) w` clamped
///   to `±f32::MAX`, as f32.
pub fn encode(x: &[f32], block: usize, books: &mut [u8], codes: &mut [u8]) -> bool {
    let mut nonfinite = false;
    for (b, (xb, cb)) in x.chunks(block).zip(codes.chunks_mut(block)).enumerate() {
        let book = &mut books[b * BOOK_BYTES..(b + 1) * BOOK_BYTES];
        let entries = book.chunks_exact_mut(4);
        if BlockScale::abs_max(xb) == BlockScale::NonFinite {
            nonfinite = true;
            entries.for_each(|e| e.copy_from_slice(&0x7FC0_0000u32.to_le_bytes()));
            cb.fill(0);
            continue;
        }
        let n = xb.len() as f64;
        let mu = xb.iter().fold(0f64, |s, &v| s + v as f64) / n;
        // d * d, not powi: powi's precision is unspecified.
        let var = xb.iter().fold(0f64, |s, &v| {
            let d = v as f64 - mu;
            s + d * d
        }) / n;
        let sigma = var.sqrt();
        if sigma == 0.0 {
            book.fill(0);
            book[..4].copy_from_slice(&(mu as f32).to_le_bytes());
            cb.fill(0);
            continue;
        }
        let lo = mu - SIGMAS * sigma;
        let w = 2.0 * SIGMAS * sigma / ENTRIES as f64;
        let mut sum = [0f64; ENTRIES];
        let mut count = [0u32; ENTRIES];
        for (c, &v) in cb.iter_mut().zip(xb) {
            let k = bin(v, lo, w);
            sum[k] += v as f64;
            count[k] += 1;
            *c = k as u8;
        }
        for (k, e) in entries.enumerate() {
            let v = if count[k] > 0 {
                (sum[k] / count[k] as f64) as f32
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
