//! Top-k's selection engine (the module docs of `topk` describe it): which elements a
//! cut keeps, the threshold estimate from a stratified sample, the approximate pass that
//! tracks `LEVELS` thresholds at once, and the exact refinement by two histogram passes.

use super::{Selection, TopK};
use crate::kernels::{
    self,
    scalar::{self, INF_BITS, mag_key},
};

impl TopK {
    /// Which elements to keep out of `x` (`1 <= k <= n`), by the module docs' engine,
    /// and how many that is.
    pub(super) fn select_cut(&self, x: &[f32], k: usize) -> (Cut, usize) {
        let n = x.len() as u64;
        if let Selection::Approx { tolerance } = self.selection {
            let limit = approx_limit(k as u64, tolerance).min(n) as usize;
            for aim in [1.0 + 0.6 * tolerance, 1.6 + tolerance] {
                let t = sample_threshold(x, aim * k as f64);
                if t >= INF_BITS {
                    break;
                }
                let (levels, count) = level_counts(x, t);
                if count[0] < k {
                    continue;
                }
                // The smallest tracked set that still holds k elements.
                let j = (0..LEVELS).rev().find(|&j| count[j] >= k).unwrap_or(0);
                if count[j] <= limit {
                    return (Cut::all_from(levels[j]), count[j]);
                }
                break;
            }
        }
        for aim in [1.5, 3.0] {
            let t = sample_threshold(x, aim * k as f64);
            if let Some(cut) = refine(x, t, k) {
                return (cut, k);
            }
        }
        (Cut::top(x, k), k)
    }
}

/// Call `f(index)` for each kept element in index order: keys above `t`, then the first
/// `need_eq` keys equal to `t`.
#[inline]
pub(super) fn for_each_kept(x: &[f32], t: u32, mut need_eq: usize, mut f: impl FnMut(usize)) {
    for_each_at_least(x, t, |i, key| {
        if key > t {
            f(i);
        } else if need_eq > 0 {
            need_eq -= 1;
            f(i);
        }
    });
}

/// Which elements a selection keeps: keys above `t`, then the first `need_eq` keys equal
/// to `t` in index order.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cut {
    pub(super) t: u32,
    pub(super) need_eq: usize,
}

impl Cut {
    /// No element (no key exceeds `u32::MAX`).
    pub(super) const NONE: Cut = Cut {
        t: u32::MAX,
        need_eq: 0,
    };

    /// Every element with key `>= t`.
    pub(super) fn all_from(t: u32) -> Cut {
        Cut {
            t,
            need_eq: usize::MAX,
        }
    }

    /// The exact top `k` (1 <= k <= n) by a radix select over all of `x`.
    pub(super) fn top(x: &[f32], k: usize) -> Cut {
        let t = scalar::kth_largest_key(x, k);
        let above = x.iter().filter(|&&v| mag_key(v) > t).count();
        Cut {
            t,
            need_eq: k - above,
        }
    }
}

/// Stratified sample size of the threshold estimate.
pub(super) const SAMPLE: usize = 4096;
/// Thresholds the approximate pass tracks at once, `LEVEL_STEP` apart in relative value.
pub(super) const LEVELS: usize = 24;
pub(super) const LEVEL_STEP: f32 = 0.015;

/// `ceil((1 + tolerance) k)`.
pub(super) fn approx_limit(k: u64, tolerance: f64) -> u64 {
    ((1.0 + tolerance) * k as f64).ceil() as u64
}

/// A key that about `aim` elements of `x` reach: the `ceil(aim * s / n)`-th largest key
/// of a stratified sample of `s = min(n, SAMPLE)` elements (one at a hashed position in
/// each of `s` equal strata). With `s = n` it is exact.
pub(super) fn sample_threshold(x: &[f32], aim: f64) -> u32 {
    let n = x.len();
    let s = n.min(SAMPLE);
    let mut keys = [0u32; SAMPLE];
    for (j, key) in keys[..s].iter_mut().enumerate() {
        let (lo, hi) = (j * n / s, (j + 1) * n / s);
        let i = lo + crate::rng::lowbias32(j as u32 ^ 0x5851_F42D) as usize % (hi - lo);
        *key = mag_key(x[i]);
    }
    let r = ((aim * s as f64 / n as f64).ceil() as usize).clamp(1, s);
    *keys[..s].select_nth_unstable_by(r - 1, |a, b| b.cmp(a)).1
}

/// Call `f(i, key)` for every element with key `>= t`, in index order (SIMD filter).
#[inline]
pub(super) fn for_each_at_least(x: &[f32], t: u32, mut f: impl FnMut(usize, u32)) {
    let candidates = |pos: usize, idx: &mut [u32]| kernels::filter_mag_ge(&x[pos..], t, idx);
    kernels::for_each_filtered(x.len(), candidates, |i| f(i, mag_key(x[i])));
}

/// One pass: `LEVELS` thresholds from `t` up in steps of `LEVEL_STEP` (relative), and
/// how many elements reach each.
pub(super) fn level_counts(x: &[f32], t: u32) -> ([u32; LEVELS], [usize; LEVELS]) {
    let base = f32::from_bits(t);
    let mut levels = [t; LEVELS];
    for (j, l) in levels.iter_mut().enumerate().skip(1) {
        *l = mag_key(base * (1.0 + LEVEL_STEP * j as f32)).max(t);
    }
    // hist[j]: elements reaching levels 0..=j and no higher (levels ascend, keys and
    // levels are below 2^31, so the signed compare is exact and vectorises).
    let mut hist = [0usize; LEVELS];
    let signed = levels.map(|l| l as i32);
    for_each_at_least(x, t, |_, key| {
        let reached: usize = signed.iter().map(|&l| (key as i32 >= l) as usize).sum();
        hist[reached - 1] += 1;
    });
    let mut count = [0usize; LEVELS];
    let mut above = 0;
    for j in (0..LEVELS).rev() {
        above += hist[j];
        count[j] = above;
    }
    (levels, count)
}

/// The exact top-`k` cut from a threshold `t` that at least `k` elements reach: a
/// histogram of the candidates' keys (exponent and 11 mantissa bits), then one of the low
/// 12 bits inside the bucket holding the k-th key. `None` if fewer than `k` reach `t` or
/// the k-th key lies more than 4095 buckets above `t`.
pub(super) fn refine(x: &[f32], t: u32, k: usize) -> Option<Cut> {
    let base = t >> 12;
    let mut hist = [0u32; 4096];
    let mut c = 0usize;
    for_each_at_least(x, t, |_, key| {
        hist[((key >> 12) - base).min(4095) as usize] += 1;
        c += 1;
    });
    if c < k {
        return None;
    }
    let (b, above) = walk_down(&hist, 0, k);
    if b == 4095 {
        return None;
    }
    let lo = (base + b as u32) << 12;
    let hi = lo + (1 << 12);
    let mut low = [0u32; 4096];
    for_each_at_least(x, lo, |_, key| {
        if key < hi {
            low[(key & 4095) as usize] += 1;
        }
    });
    let (d, above) = walk_down(&low, above, k);
    Some(Cut {
        t: lo | d as u32,
        need_eq: k - above,
    })
}

/// Walk a histogram from its top bucket down, starting with `above` elements already
/// counted above it, to the bucket holding the `k`-th largest; returns that bucket and the
/// count above it. The histogram (with `above`) must hold at least `k` elements.
pub(super) fn walk_down(hist: &[u32; 4096], mut above: usize, k: usize) -> (usize, usize) {
    let mut b = hist.len() - 1;
    while above + (hist[b] as usize) < k {
        above += hist[b] as usize;
        b -= 1;
    }
    (b, above)
}
