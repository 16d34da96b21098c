//! Top-k's selection engine (the module docs of `topk` describe it): which elements a
//! cut keeps, the threshold estimate from a stratified sample, the approximate pass that
//! tracks `LEVELS` thresholds at once, and the exact refinement by two histogram passes.

use super::{Selection, TopK};
use crate::kernels::{
    self,
    scalar::{self, mag_key},
};
use crate::parallel::{self, Split};

/// The candidates of a one-pass selection, in working room the caller lends: the
/// indices, ascending, of every element whose key reaches a threshold, and their values'
/// bits (gathered once, so that writing the frame reads them in order).
pub(super) struct Candidates<'a> {
    idx: &'a mut [u32],
    vals: &'a mut [u32],
    len: usize,
}

/// Candidates a one-pass selection of `k` may hold: the sample aims at `1.5 k` (see
/// [`AIMS`]), so more means it misjudged (ties at the threshold, mostly).
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

    /// Keep only the `count` candidates that `cut` keeps, in order: a SIMD compaction of
    /// the keys `>= cut.t` (a branch per candidate, a third of which fall below the cut
    /// at random, was mispredicted often enough to cost a fifth of a 1 Mi encode), then,
    /// where ties at `cut.t` are more than the cut takes, a pass that drops the later ones.
    pub(super) fn retain(&mut self, cut: Cut, count: usize) {
        let n = self.len;
        let kept = kernels::retain_mag_ge(&mut self.idx[..n], &mut self.vals[..n], cut.t);
        if kept > count {
            let (mut w, mut eq_left) = (0, cut.need_eq);
            for j in 0..kept {
                let key = self.vals[j] & 0x7FFF_FFFF;
                let tie = key == cut.t && eq_left > 0;
                if key > cut.t || tie {
                    eq_left -= tie as usize;
                    self.idx[w] = self.idx[j];
                    self.vals[w] = self.vals[j];
                    w += 1;
                }
            }
            self.len = w;
        } else {
            self.len = kept;
        }
        debug_assert_eq!(self.len, count);
    }

    /// Collect the elements of `x` with key `>= t`, at most `cap` of them; false (and
    /// nothing usable) when more reach `t` than fit. Large tensors are collected on all
    /// threads ([`Candidates::collect_par`]); the candidates are the same.
    fn collect(&mut self, x: &[f32], t: u32, cap: usize) -> bool {
        let room = self.idx.len().min(cap.saturating_add(64));
        let len = if collect_in_parallel(x.len()) {
            match parallel::on_pool(|| self.collect_par(Src::Plain(x), t, room, cap)) {
                Some(len) => len,
                None => return false,
            }
        } else {
            let vals = Some(&mut self.vals[..room]);
            let (len, scanned) = fill(x, t, 0, &mut self.idx[..room], vals);
            if scanned < x.len() || len > cap {
                return false;
            }
            len
        };
        self.len = len;
        true
    }

    /// [`Candidates::collect`] of `p = beta r + gamma g`, formed into `r` (in full, even
    /// when the candidates overflow) a tile at a time, each tile filtered while in cache;
    /// large tensors on all threads, each piece forming its own tiles.
    fn collect_formed(
        &mut self,
        r: &mut [f32],
        g: &[f32],
        beta: f32,
        gamma: f32,
        t: u32,
        cap: usize,
    ) -> bool {
        let room = self.idx.len().min(cap.saturating_add(64));
        if collect_in_parallel(r.len()) {
            let src = Src::Formed(r, g, beta, gamma);
            return match parallel::on_pool(|| self.collect_par(src, t, room, cap)) {
                Some(len) => {
                    self.len = len;
                    true
                }
                None => false,
            };
        }
        let (mut len, mut fits) = (0, true);
        for (at, (r, g)) in r.chunks_mut(FORM_TILE).zip(g.chunks(FORM_TILE)).enumerate() {
            kernels::feedback_form(r, g, beta, gamma);
            if fits {
                let base = (at * FORM_TILE) as u32;
                let vals = Some(&mut self.vals[len..room]);
                let (stored, scanned) = fill(r, t, base, &mut self.idx[len..room], vals);
                len += stored;
                fits = scanned == r.len();
            }
        }
        self.len = len;
        fits && len <= cap
    }

    /// [`Candidates::collect`] on the thread pool, into the first `room` entries of each
    /// half. Up to [`MAX_PIECES`] pieces of `x` each fill an equal share of both halves
    /// (indices and values), and a piece whose candidates overflow its share goes on
    /// counting them. The shares then move into one run, in index order; where a piece
    /// overflowed, they move on to their final places, and a second filter over the rest
    /// of each overflowed piece completes it in parallel. Returns the candidate count, or
    /// `None` if more than `cap` reach `t`.
    fn collect_par(&mut self, src: Src, t: u32, room: usize, cap: usize) -> Option<usize> {
        let n = src.len();
        let range = parallel::CHUNK.max(n.div_ceil(MAX_PIECES).next_multiple_of(64));
        let mut res = [Piece::default(); MAX_PIECES];
        let res = &mut res[..n.div_ceil(range)];
        let share = room / res.len();
        let (idx, vals) = (&mut self.idx[..room], &mut self.vals[..room]);
        // The shares are filled from the formed values, which are plain from then on.
        let x: &[f32] = match src {
            Src::Plain(x) => {
                let shares = Pieces::shares(Src::Plain(x), idx, vals, res, share);
                collect_shares(shares, n, range, t, share);
                x
            }
            Src::Formed(r, g, beta, gamma) => {
                let formed = Src::Formed(&mut *r, g, beta, gamma);
                let shares = Pieces::shares(formed, idx, vals, res, share);
                collect_shares(shares, n, range, t, share);
                r
            }
        };
        let len: usize = res.iter().map(|r| r.count).sum();
        if len > cap || len > room {
            return None;
        }
        // Move the shares down into one run, in order (each lies at or after its place
        // in the run)...
        let mut at = 0;
        for (p, r) in res.iter().enumerate() {
            let from = p * share..p * share + r.stored;
            self.idx.copy_within(from.clone(), at);
            self.vals.copy_within(from, at);
            at += r.stored;
        }
        if at == len {
            return Some(len);
        }
        // ... then, from the last piece back, up to their places (each at or after its
        // place in the run), leaving the room that the overflowed pieces complete.
        let mut place = len;
        for r in res.iter().rev() {
            place -= r.count;
            at -= r.stored;
            self.idx.copy_within(at..at + r.stored, place);
            self.vals.copy_within(at..at + r.stored, place);
        }
        let completed = Pieces {
            x: Src::Plain(x),
            idx: &mut self.idx[..len],
            vals: &mut self.vals[..len],
            res,
            share: None,
        };
        parallel::for_ranges(completed, n, range, true, &|c, start| {
            let r = c.res[0];
            if r.count > r.stored {
                let Src::Plain(x) = c.x else {
                    unreachable!("completed from the formed values")
                };
                let (rest, base) = (&x[r.scanned..], (start + r.scanned) as u32);
                let vals = Some(&mut c.vals[r.stored..]);
                fill(rest, t, base, &mut c.idx[r.stored..], vals);
            }
            false
        });
        Some(len)
    }

    /// The candidates' keys.
    fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.vals[..self.len].iter().map(|&b| b & 0x7FFF_FFFF)
    }
}

/// Elements formed and filtered at a time by [`Candidates::collect_formed`]: 16 KiB of
/// `r` and of `g`, which stay in L1 between the two.
const FORM_TILE: usize = 4096;

/// Whether collecting the candidates of `n` elements is split across threads: from a
/// quarter of [`parallel::min_len`] (8 Mi elements by default). The filter pass is bound
/// by memory bandwidth, which two threads here raise by a quarter at most, and handing
/// work to the pool costs tens of microseconds: below 8 Mi, two threads were no faster.
pub(super) fn collect_in_parallel(n: usize) -> bool {
    parallel::worth(n / 4, 1)
}

/// What a parallel collect reads: `x`, or the error-feedback input `beta r + gamma g`,
/// formed into `r` tile by tile as it is read.
enum Src<'a> {
    Plain(&'a [f32]),
    Formed(&'a mut [f32], &'a [f32], f32, f32),
}

impl<'a> Src<'a> {
    fn len(&self) -> usize {
        match self {
            Src::Plain(x) => x.len(),
            Src::Formed(r, ..) => r.len(),
        }
    }

    fn split(self, at: usize) -> (Src<'a>, Src<'a>) {
        match self {
            Src::Plain(x) => {
                let (a, b) = x.split_at(at);
                (Src::Plain(a), Src::Plain(b))
            }
            Src::Formed(r, g, beta, gamma) => {
                let (r0, r1) = r.split_at_mut(at);
                let (g0, g1) = g.split_at(at);
                (
                    Src::Formed(r0, g0, beta, gamma),
                    Src::Formed(r1, g1, beta, gamma),
                )
            }
        }
    }
}

/// The first step of a parallel collect: each piece of `range` elements fills its
/// `share` of both halves with the candidates reaching `t` (forming its tiles first, for
/// a formed source) and counts on past a full share.
fn collect_shares(shares: Pieces, n: usize, range: usize, t: u32, share: usize) {
    parallel::for_ranges(shares, n, range, true, &|f, start| {
        let (idx, vals) = (&mut f.idx[..share], &mut f.vals[..share]);
        f.res[0] = match f.x {
            Src::Plain(x) => {
                let (stored, scanned) = fill(x, t, start as u32, idx, Some(vals));
                Piece {
                    stored,
                    scanned,
                    count: stored + count_at_least(&x[scanned..], t),
                }
            }
            Src::Formed(r, g, beta, gamma) => {
                let len = r.len();
                let (mut stored, mut scanned, mut more) = (0, len, 0);
                let tiles = r.chunks_mut(FORM_TILE).zip(g.chunks(FORM_TILE));
                for (at, (r, g)) in tiles.enumerate() {
                    kernels::feedback_form(r, g, beta, gamma);
                    let at = at * FORM_TILE;
                    if scanned < len {
                        more += count_at_least(r, t);
                        continue;
                    }
                    let base = (start + at) as u32;
                    let v = Some(&mut vals[stored..]);
                    let (s, sc) = fill(r, t, base, &mut idx[stored..], v);
                    stored += s;
                    if sc < r.len() {
                        scanned = at + sc;
                        more += count_at_least(&r[sc..], t);
                    }
                }
                Piece {
                    stored,
                    scanned,
                    count: stored + more,
                }
            }
        };
        false
    });
}

/// Most pieces a parallel collect splits a tensor into (their counts live on the stack).
const MAX_PIECES: usize = 64;

/// What a piece of a parallel collect found: `stored` candidates in its share, every
/// element before `scanned` (relative to the piece) looked at, `count` candidates in all.
#[derive(Debug, Default, Clone, Copy)]
struct Piece {
    stored: usize,
    scanned: usize,
    count: usize,
}

/// The pieces of `x`, their parts of both halves and their results. A piece's part is
/// `share` entries where that is set (its share while collecting), else its `count`
/// (its place among the candidates, once counted).
struct Pieces<'a> {
    x: Src<'a>,
    idx: &'a mut [u32],
    vals: &'a mut [u32],
    res: &'a mut [Piece],
    share: Option<usize>,
}

impl<'a> Pieces<'a> {
    /// The pieces while collecting: each fills `share` entries of both halves.
    fn shares(
        x: Src<'a>,
        idx: &'a mut [u32],
        vals: &'a mut [u32],
        res: &'a mut [Piece],
        share: usize,
    ) -> Pieces<'a> {
        Pieces {
            x,
            idx,
            vals,
            res,
            share: Some(share),
        }
    }
}

impl Split for Pieces<'_> {
    fn split(self, at: usize, pieces: usize) -> (Self, Self) {
        let part = match self.share {
            Some(share) => pieces * share,
            None => self.res[..pieces].iter().map(|r| r.count).sum(),
        };
        let (x0, x1) = self.x.split(at);
        let (i0, i1) = self.idx.split_at_mut(part);
        let (v0, v1) = self.vals.split_at_mut(part);
        let (r0, r1) = self.res.split_at_mut(pieces);
        let share = self.share;
        (
            Pieces {
                x: x0,
                idx: i0,
                vals: v0,
                res: r0,
                share,
            },
            Pieces {
                x: x1,
                idx: i1,
                vals: v1,
                res: r1,
                share,
            },
        )
    }
}

/// Store into `idx`, until it is full, the indices (plus `base`) of the elements of `x`
/// with key `>= t`, ascending, and their bits into `vals` if given (as long as `idx`);
/// returns how many were stored and how many elements were looked at (all of `x`, unless
/// `idx` filled up: then up to the first one not stored).
fn fill(
    x: &[f32],
    t: u32,
    base: u32,
    idx: &mut [u32],
    mut vals: Option<&mut [u32]>,
) -> (usize, usize) {
    let (mut pos, mut len) = (0, 0);
    while pos < x.len() {
        if idx.len() - len >= 64 {
            let (used, kept) = match &mut vals {
                Some(v) => {
                    kernels::filter_mag_ge_vals(&x[pos..], t, &mut idx[len..], &mut v[len..])
                }
                None => kernels::filter_mag_ge(&x[pos..], t, &mut idx[len..]),
            };
            for i in &mut idx[len..len + kept] {
                *i += base + pos as u32;
            }
            pos += used;
            len += kept;
        } else {
            // Near the end of `idx`: filter into the stack, keep what fits.
            let mut buf = [0u32; 64];
            let (used, kept) = kernels::filter_mag_ge(&x[pos..], t, &mut buf);
            let fit = kept.min(idx.len() - len);
            for (j, &i) in buf[..fit].iter().enumerate() {
                idx[len + j] = i + base + pos as u32;
                if let Some(v) = &mut vals {
                    v[len + j] = x[pos + i as usize].to_bits();
                }
            }
            len += fit;
            if fit < kept {
                return (len, pos + buf[fit] as usize);
            }
            pos += used;
        }
    }
    (len, pos)
}

/// How many elements of `x` have key `>= t`.
fn count_at_least(x: &[f32], t: u32) -> usize {
    let mut count = 0;
    for_each_at_least(x, t, |_, _| count += 1);
    count
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
        let t = sample_threshold(x, AIMS[0] * k as f64);
        let collected = c.collect(x, t, candidate_cap(k as u64) as usize);
        self.cut_among(collected, t, x.len(), k, c)
    }

    /// [`TopK::select_candidates`] of the error-feedback input `p = beta r + gamma g`,
    /// formed into `r` tile by tile and filtered while each tile is in cache: one pass
    /// over memory instead of two. `r` is formed in full whatever the outcome.
    pub(super) fn select_candidates_formed(
        &self,
        (r, g, beta, gamma): (&mut [f32], &[f32], f32, f32),
        k: usize,
        c: &mut Candidates,
    ) -> Option<(Cut, usize)> {
        // The sample's values are formed as the kernel forms them: two rounded products
        // and a rounded sum.
        let formed = |i: usize| beta * r[i] + gamma * g[i];
        let t = sample_threshold_by(r.len(), formed, AIMS[0] * k as f64);
        let collected = c.collect_formed(r, g, beta, gamma, t, candidate_cap(k as u64) as usize);
        self.cut_among(collected, t, r.len(), k, c)
    }

    /// The cut among candidates collected at `t` (if `collected`) of `n` elements.
    fn cut_among(
        &self,
        collected: bool,
        t: u32,
        n: usize,
        k: usize,
        c: &Candidates,
    ) -> Option<(Cut, usize)> {
        if !collected {
            return None;
        }
        // The engine's histograms over the candidates (which hold every key >= t)
        // instead of passes over `x`.
        if let Selection::Approx { tolerance } = self.selection {
            let limit = approx_limit(k as u64, tolerance).min(n as u64) as usize;
            return approx_by(t, k, limit, c);
        }
        refine_by(t, k, c).map(|cut| (cut, k))
    }

    /// Which elements to keep out of `x` (`1 <= k <= n`), by the module docs' engine,
    /// and how many that is.
    pub(super) fn select_cut(&self, x: &[f32], k: usize) -> (Cut, usize) {
        let n = x.len() as u64;
        if let Selection::Approx { tolerance } = self.selection {
            let limit = approx_limit(k as u64, tolerance).min(n) as usize;
            for aim in AIMS {
                let t = sample_threshold(x, aim * k as f64);
                if let Some(found) = approx_by(t, k, limit, &Above { x, t }) {
                    return found;
                }
            }
        }
        for aim in AIMS {
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

/// How many elements the sampled threshold aims to let through, in multiples of `k`: the
/// first try, and the second where the first let fewer than `k` through (or, for
/// `select=approx`, no tracked level held between `k` and the limit). A 1% threshold from
/// 4096 samples rests on about 41 of them, so the count it lets through has a relative
/// spread of about 15%: aiming at 1.5 k lets fewer than `k` through about once in 200
/// tensors (aiming at 1.15 k, as approx once did, failed one time in six).
pub(super) const AIMS: [f64; 2] = [1.5, 3.0];

/// Stratified sample size of the threshold estimate.
pub(super) const SAMPLE: usize = 4096;
/// `ceil((1 + tolerance) k)`.
pub(super) fn approx_limit(k: u64, tolerance: f64) -> u64 {
    ((1.0 + tolerance) * k as f64).ceil() as u64
}

/// A key that about `aim` elements of `x` reach: the `ceil(aim * s / n)`-th largest key
/// of a stratified sample of `s = min(n, SAMPLE)` elements (one at a hashed position in
/// each of `s` equal strata). With `s = n` it is exact.
pub(super) fn sample_threshold(x: &[f32], aim: f64) -> u32 {
    sample_threshold_by(x.len(), |i| x[i], aim)
}

/// [`sample_threshold`] of the `n` values `value(i)`.
#[inline]
fn sample_threshold_by(n: usize, value: impl Fn(usize) -> f32, aim: f64) -> u32 {
    let s = n.min(SAMPLE);
    let mut keys = [0u32; SAMPLE];
    if s == n {
        for (i, key) in keys[..n].iter_mut().enumerate() {
            *key = mag_key(value(i));
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
            *key = mag_key(value((lo + ((h * len) >> 32)) as usize));
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

/// The first histogram of the engine: the keys `>= t` of `keys` by exponent and high
/// mantissa bits (`key >> 12`), in 4096 buckets from `t`'s up (the last also holds every
/// key beyond), and how many there are.
fn coarse_histogram(t: u32, keys: &impl Keys) -> ([u32; 4096], usize) {
    let base = t >> 12;
    let mut hist = [0u32; 4096];
    let mut c = 0usize;
    keys.each(|key| {
        hist[((key >> 12) - base).min(4095) as usize] += 1;
        c += 1;
    });
    (hist, c)
}

/// [`refine`] over the keys `>= t` of `keys`.
fn refine_by(t: u32, k: usize, keys: &impl Keys) -> Option<Cut> {
    let (hist, c) = coarse_histogram(t, keys);
    if c < k {
        return None;
    }
    let (b, above) = walk_down(&hist, 0, k);
    if b == 4095 {
        return None;
    }
    let lo = ((t >> 12) + b as u32) << 12;
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

/// The approximate cut from a threshold `t`, and how many it keeps: every key from the
/// lower edge of the coarse bucket (2^-11 relative wide) that holds the k-th largest
/// key, which keeps the top `k` and the rest of that bucket. `None` if fewer than `k` keys
/// reach `t`, the k-th lies beyond the histogram's reach, or the cut would keep more than
/// `limit` (ties, mostly).
fn approx_by(t: u32, k: usize, limit: usize, keys: &impl Keys) -> Option<(Cut, usize)> {
    let (hist, c) = coarse_histogram(t, keys);
    if c < k {
        return None;
    }
    let (b, above) = walk_down(&hist, 0, k);
    let count = above + hist[b] as usize;
    // Bucket 0 holds only keys >= t, so its cut starts at t, not at its lower edge.
    let edge = (((t >> 12) + b as u32) << 12).max(t);
    (b < 4095 && count <= limit).then(|| (Cut::all_from(edge), count))
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
