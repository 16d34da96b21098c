//! Top-k's selection engine (the module docs of `topk` describe it): which elements a
//! cut keeps, the threshold estimate from a stratified sample, the approximate pass that
//! tracks `LEVELS` thresholds at once, and the exact refinement by two histogram passes.

use super::{Selection, TopK};
use crate::kernels::{
    self,
    scalar::{self, INF_BITS, mag_key},
};

/// The candidates of a one-pass selection, in working room the caller lends: the
/// indices, ascending, of every element whose key reaches a threshold, and their values'
/// bits (gathered once, so that writing the frame reads them in order).
pub(super) struct Candidates<'a> {
    idx: &'a mut [u32],
    vals: &'a mut [u32],
    len: usize,
}

/// Candidates a one-pass selection of `k` may hold: the sample aims at `1.5 k` (exact) or
/// `1.15 k` (approx), so more means it misjudged (ties at the threshold, mostly).
fn candidate_cap(k: u64) -> u64 {
    k.saturating_mul(2).saturating_add(1024)
}

/// Bytes of working room that let [`TopK::select_candidates`] run for `k` kept elements:
/// an index and a value per candidate, the filter's 64 entries of slack, and alignment.
pub(super) fn candidate_room(k: u64) -> u64 {
    candidate_cap(k)
        .saturating_add(64)
        .saturating_mul(8)
        .saturating_add(3)
}

impl<'a> Candidates<'a> {
    /// Candidates kept in `room`.
    pub(super) fn new(room: &'a mut [u32]) -> Candidates<'a> {
        let half = room.len() / 2;
        let (idx, rest) = room.split_at_mut(half);
        Candidates {
            idx,
            vals: &mut rest[..half],
            len: 0,
        }
    }

    /// The candidates' indices and value bits.
    pub(super) fn kept(&self) -> (&[u32], &[u32]) {
        (&self.idx[..self.len], &self.vals[..self.len])
    }

    /// Collect the elements of `x` with key `>= t`, at most `cap` of them; false (and
    /// nothing usable) when more reach `t` than fit.
    fn collect(&mut self, x: &[f32], t: u32, cap: usize) -> bool {
        let room = self.idx.len().min(cap.saturating_add(64));
        let (mut pos, mut len) = (0, 0);
        while pos < x.len() {
            if room - len < 64 {
                return false;
            }
            let (used, kept) = kernels::filter_mag_ge(&x[pos..], t, &mut self.idx[len..room]);
            for i in &mut self.idx[len..len + kept] {
                *i += pos as u32;
            }
            pos += used;
            len += kept;
        }
        if len > cap {
            return false;
        }
        for (v, &i) in self.vals[..len].iter_mut().zip(&self.idx[..len]) {
            *v = x[i as usize].to_bits();
        }
        self.len = len;
        true
    }

    /// The candidates' keys.
    fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.vals[..self.len].iter().map(|&b| b & 0x7FFF_FFFF)
    }
}

impl TopK {
    /// The one-pass form of [`TopK::select_cut`]: candidates above a sampled threshold are
    /// collected in one filter pass over `x` (into `c`), and the cut is found among them.
    /// Keeps exactly what `select_cut` keeps; `None` when the sample misjudged (too few
    /// candidates, or too many to hold) and the multi-pass engine must run.
    pub(super) fn select_candidates(
        &self,
        x: &[f32],
        k: usize,
        c: &mut Candidates,
    ) -> Option<(Cut, usize)> {
        let n = x.len() as u64;
        let cap = candidate_cap(k as u64) as usize;
        if let Selection::Approx { tolerance } = self.selection {
            // The approximate engine's first estimate and level counts, on the candidates.
            let limit = approx_limit(k as u64, tolerance).min(n) as usize;
            let t = sample_threshold(x, (1.0 + 0.6 * tolerance) * k as f64);
            if t >= INF_BITS || !c.collect(x, t, cap) {
                return None;
            }
            let levels = levels_from(t);
            // How many candidates reach level j: one vectorised count. Counts fall as j
            // rises, so the highest level that k reach is found by bisection, in 6 counts
            // instead of 24.
            let count = |j: usize| {
                let l = levels[j];
                c.keys().map(|key| (key >= l) as u32).sum::<u32>() as usize
            };
            let (mut lo, mut hi) = (0, LEVELS); // count(lo) >= k; levels >= hi untested
            let mut at_lo = count(0);
            if at_lo < k {
                return None;
            }
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                let m = count(mid);
                if m >= k {
                    (lo, at_lo) = (mid, m);
                } else {
                    hi = mid;
                }
            }
            return (at_lo <= limit).then(|| (Cut::all_from(levels[lo]), at_lo));
        }
        let t = sample_threshold(x, 1.5 * k as f64);
        if !c.collect(x, t, cap) {
            return None;
        }
        // The exact engine's two histograms, over the candidates (which hold every key
        // >= t) instead of two passes over `x`.
        refine_by(t, k, c).map(|cut| (cut, k))
    }

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

/// [`for_each_kept`] over candidates (ascending indices that include every key `>= t`,
/// and their values' bits) instead of all of `x`: `f(index, value)`.
#[inline]
pub(super) fn for_each_kept_of(
    (idx, vals): (&[u32], &[u32]),
    t: u32,
    mut need_eq: usize,
    mut f: impl FnMut(usize, f32),
) {
    for (&i, &bits) in idx.iter().zip(vals) {
        let (key, v) = (bits & 0x7FFF_FFFF, f32::from_bits(bits));
        if key > t {
            f(i as usize, v);
        } else if key == t && need_eq > 0 {
            need_eq -= 1;
            f(i as usize, v);
        }
    }
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
    if s == n {
        for (key, &v) in keys.iter_mut().zip(x) {
            *key = mag_key(v);
        }
    } else {
        // Stratum j is [j n / s, (j + 1) n / s) with s = SAMPLE, a power of two: shifts,
        // and the position inside it by a multiply-high, not a division (three divisions
        // per sample took a tenth of a 1 Mi encode).
        for (j, key) in keys.iter_mut().enumerate() {
            let (j, n) = (j as u64, n as u64);
            let lo = (j * n) >> SAMPLE.trailing_zeros();
            let len = (((j + 1) * n) >> SAMPLE.trailing_zeros()) - lo;
            let h = crate::rng::lowbias32(j as u32 ^ 0x5851_F42D) as u64;
            *key = mag_key(x[(lo + ((h * len) >> 32)) as usize]);
        }
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

/// `LEVELS` thresholds from `t` up in steps of `LEVEL_STEP` (relative), ascending.
fn levels_from(t: u32) -> [u32; LEVELS] {
    let base = f32::from_bits(t);
    let mut levels = [t; LEVELS];
    for (j, l) in levels.iter_mut().enumerate().skip(1) {
        *l = mag_key(base * (1.0 + LEVEL_STEP * j as f32)).max(t);
    }
    levels
}

/// One pass: `LEVELS` thresholds from `t` up in steps of `LEVEL_STEP` (relative), and
/// how many elements reach each.
pub(super) fn level_counts(x: &[f32], t: u32) -> ([u32; LEVELS], [usize; LEVELS]) {
    let levels = levels_from(t);
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
    refine_by(t, k, &Above { x, t })
}

/// A source of keys for [`refine_by`]: every key `>= t`, each once per call, in any order.
trait Keys {
    fn each(&self, f: impl FnMut(u32));
}

/// The keys of `x` that reach `t`, by the SIMD filter.
struct Above<'a> {
    x: &'a [f32],
    t: u32,
}

impl Keys for Above<'_> {
    #[inline]
    fn each(&self, mut f: impl FnMut(u32)) {
        for_each_at_least(self.x, self.t, |_, key| f(key));
    }
}

impl Keys for Candidates<'_> {
    #[inline]
    fn each(&self, f: impl FnMut(u32)) {
        self.keys().for_each(f);
    }
}

/// [`refine`] over the keys `>= t` of `keys`.
fn refine_by(t: u32, k: usize, keys: &impl Keys) -> Option<Cut> {
    let base = t >> 12;
    let mut hist = [0u32; 4096];
    let mut c = 0usize;
    keys.each(|key| {
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
    keys.each(|key| {
        if (lo..hi).contains(&key) {
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
