//! PowerSGD (Vogels, Karimireddy and Jaggi, 2019): a gradient matrix sent as two thin
//! factors, for the sync engine's low-rank buckets.
//!
//! A tensor of shape `[n, d1, d2, ...]` is the `n x m` matrix `M` with `m = d1 d2 ...`
//! (row-major, as frameworks store it; a convolution's `[out, in, kh, kw]` becomes
//! `out x (in kh kw)`). One step on a bucket of such matrices, on every rank:
//!
//! 1. `M = g + e` (error feedback: `e` is what earlier steps did not send);
//! 2. `P = M Q` (`n x r`), with `Q` (`m x r`) the last step's (warm start) or, at the
//!    first step, drawn from the step's seed (uniform in `[-1, 1)`: the same on every
//!    rank, with no transcendental function whose last bit could differ between CPUs);
//! 3. all-reduce `P` (the bucket's first all-reduce: every matrix's `P` in one buffer);
//! 4. orthonormalise the columns of `P` (Gram-Schmidt);
//! 5. `Q = M^T P`, all-reduce `Q` (the second all-reduce);
//! 6. the result is `P Q^T` and the new residual `e = M - P Q^T`.
//!
//! Steps 3 to 6 see only all-reduced data, and steps 4 and 6 are plain loops in a fixed
//! order (f64 sums in step 4, f32 products and sums without fused multiply-adds in step
//! 6), so every rank computes bit-identical results on any CPU. Up to rank 8 the
//! products of steps 2 and 5 read the gradient where it lies, with no packing: `P = M Q`
//! row by row (step 1's add fused in, each row's dot products in 16 lanes added by
//! halves), `Q = M^T P` in ranges of columns, each element summing over the rows in
//! order. Those orders are stated, so the products too are the same bits on every CPU,
//! backend and thread count. Higher ranks run on `matrixmultiply`'s GEMM, whose last
//! bits may differ between CPUs, which does not matter: each product only feeds an
//! all-reduce. Large matrices run every pass in pieces of rows (or columns) on all
//! threads.
//!
//! A step whose all-reduced factors hold NaN or Inf (a gradient overflowed on some rank)
//! gives a result full of NaN, so that a loss scaler sees it; it keeps the residual as it
//! was before the step and draws a fresh `Q` at the next step, so one bad step does not
//! poison the state. Every rank takes the same decision, from the same all-reduced data.

use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::{AllReduce, AllReduceOptions, Comm, Feedback, Stats, Transport};
use crate::error::{Error, Result};
use crate::kernels::gemm::{THIN_ACC, THIN_MAX_RANK, View, matmul, thin_mq, thin_mtp, thin_pqt};
use crate::parallel::Split;
use crate::state::{BlobReader, BlobWriter};

use super::plan::Tensor;

const LOW_RANK_MAGIC: [u8; 4] = *b"GPLR";

/// PowerSGD settings of a [`super::Policy`]: which matrices are sent as rank-`r`
/// factors, and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgd {
    /// The rank `r` of the approximation (1 to 64; 1 to 4 is usual). A matrix with fewer
    /// rows or columns than `r` uses that many.
    pub rank: usize,
    /// Start each step from the last step's `Q` (default on). Off: a fresh random `Q`
    /// every step, which needs a higher rank for the same error.
    pub warm_start: bool,
    /// Keep what was not sent and add it to the next step's gradient (default on; the
    /// method converges poorly without it).
    pub feedback: bool,
    /// Send a matrix as factors only if `n m / ((n + m) r)` is at least this (default 2):
    /// the others go with the policy's codec.
    pub min_compression: f64,
    /// Steps (counted by the engine) whose low-rank buckets go as plain fp32 all-reduces
    /// before PowerSGD starts (default 0), as PyTorch's hook does to let the early,
    /// quickly changing gradients through exactly.
    pub start_step: u64,
    /// The codec of the two factor all-reduces (default fp32; fp16 or bf16 halve them).
    pub codec: CodecSpec,
}

impl Default for PowerSgd {
    fn default() -> Self {
        PowerSgd {
            rank: 2,
            warm_start: true,
            feedback: true,
            min_compression: 2.0,
            start_step: 0,
            codec: CodecSpec::Identity(Identity),
        }
    }
}

/// The largest rank accepted.
const MAX_RANK: usize = 64;

impl PowerSgd {
    /// PowerSGD at rank `rank`, with the other settings at their defaults.
    pub fn rank(rank: usize) -> PowerSgd {
        PowerSgd {
            rank,
            ..PowerSgd::default()
        }
    }

    /// An error unless the settings are usable.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_RANK).contains(&self.rank) {
            return Err(Error::Collective(format!(
                "PowerSGD rank {} is outside 1 to {MAX_RANK}",
                self.rank
            )));
        }
        if !(self.min_compression.is_finite() && self.min_compression >= 1.0) {
            return Err(Error::Collective(format!(
                "PowerSGD's minimum compression {} must be a finite number of at least 1",
                self.min_compression
            )));
        }
        Ok(())
    }

    /// `t` as the `n x m` matrix PowerSGD sends at rank `r`, `(n, m, r)`, if it has two
    /// or more dimensions and compresses by at least [`PowerSgd::min_compression`].
    pub fn matrix_of(&self, t: &Tensor) -> Option<(usize, usize, usize)> {
        let (&n, rest) = t.shape.split_first()?;
        if rest.is_empty() {
            return None;
        }
        let m = rest.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
        let r = self.rank.min(n).min(m);
        if r == 0 {
            return None;
        }
        let full = n as f64 * m as f64;
        let sent = (n as f64 + m as f64) * r as f64;
        (full >= self.min_compression * sent).then_some((n, m, r))
    }
}

/// One matrix of a low-rank bucket: where it and its factors sit.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Mat {
    /// Offset in the caller's buffer.
    at: usize,
    /// Offset in the residual.
    off: usize,
    n: usize,
    m: usize,
    r: usize,
    /// Offset of its `P` (n x r) in the P buffer.
    p_off: usize,
    /// Offset of its `Q` (m x r) in the Q buffer.
    q_off: usize,
}

impl Mat {
    /// Its elements in the caller's buffer.
    fn elems(&self) -> core::ops::Range<usize> {
        self.at..self.at + self.n * self.m
    }
    /// Its elements in the residual.
    fn res(&self) -> core::ops::Range<usize> {
        self.off..self.off + self.n * self.m
    }
    fn p(&self) -> core::ops::Range<usize> {
        self.p_off..self.p_off + self.n * self.r
    }
    fn q(&self) -> core::ops::Range<usize> {
        self.q_off..self.q_off + self.m * self.r
    }
}

/// Where a [`PowerSgdBucket`] is in its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for [`PowerSgdBucket::p_step`].
    Idle,
    /// `P` made; waiting for [`PowerSgdBucket::q_step`].
    P,
    /// `Q` made; waiting for [`PowerSgdBucket::finish`].
    Q,
}

/// PowerSGD's arithmetic and state for one bucket of matrices, for a caller that runs
/// the two all-reduces itself (over its own process group, say).
///
/// The bucket is the matrices `(n, m, r)` given to [`PowerSgdBucket::new`], back to back
/// (`n m` elements each, row-major). One step, on every rank, with the same `seed`:
///
/// ```
/// use gradpack::sync::{PowerSgd, PowerSgdBucket};
///
/// let mut b = PowerSgdBucket::new(PowerSgd::rank(2), &[(64, 32, 2)])?;
/// let mut m: Vec<f32> = (0..64 * 32).map(|i| (i % 7) as f32 - 3.0).collect();
/// let (mut p, mut q) = (vec![0f32; b.p_len()], vec![0f32; b.q_len()]);
/// b.p_step(&mut m, 42, &mut p)?;
/// // ... all-reduce `p` to the mean over ranks ...
/// b.q_step(&m, &mut p, &mut q)?;
/// // ... all-reduce `q` to the mean over ranks ...
/// let mut out = vec![0f32; m.len()];
/// assert!(b.finish(&m, &p, &q, &mut out)?);
/// # Ok::<(), gradpack::Error>(())
/// ```
///
/// Steps 2 and 3 see only the all-reduced factors and run plain loops in a fixed order,
/// so every rank computes the same result to the bit, on any CPU, provided the
/// all-reduce gives every rank the same bits. The state that carries over (each
/// matrix's warm-start `Q`, the residuals) saves with [`PowerSgdBucket::save`], or per
/// matrix with [`PowerSgdBucket::matrix_state`], so it can be kept by parameter name
/// when a framework regroups its buckets.
#[derive(Clone)]
pub struct PowerSgdBucket {
    opts: PowerSgd,
    mats: Vec<Mat>,
    /// Elements of the caller's buffer.
    len: usize,
    /// The warm-start `Q` of each matrix, valid where `q_ready`.
    q: Vec<f32>,
    q_ready: Vec<bool>,
    /// `e`, one per bucket element (empty without feedback).
    residual: Vec<f32>,
    /// Scratch: a transposed `Q` of the widest matrix.
    qt: Vec<f32>,
    /// Scratch of [`PowerSgdBucket::exchange`]: its two all-reduces' buffers, kept
    /// between steps.
    factors: (Vec<f32>, Vec<f32>),
    phase: Phase,
}

impl core::fmt::Debug for PowerSgdBucket {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PowerSgdBucket")
            .field("matrices", &self.mats.len())
            .field("rank", &self.opts.rank)
            .field("elements", &self.len())
            .finish()
    }
}

/// The lengths of the `P` and `Q` buffers of matrices `(n, m, r)`.
pub(crate) fn factor_lens(shapes: &[(usize, usize, usize)]) -> Option<(usize, usize)> {
    shapes
        .iter()
        .try_fold((0usize, 0usize), |(p, q), &(n, m, r)| {
            Some((
                p.checked_add(n.checked_mul(r)?)?,
                q.checked_add(m.checked_mul(r)?)?,
            ))
        })
}

fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            left: got,
            right: want,
        })
    }
}

impl PowerSgdBucket {
    /// The state of a bucket of matrices `(n, m, r)` (rows, columns, rank; in bucket
    /// order), as [`PowerSgd::matrix_of`] gives them, back to back in the bucket. An
    /// error if the settings are not usable, a rank is 0 or above `min(n, m)` or
    /// [`PowerSgd::rank`], or the buffers cannot be allocated.
    pub fn new(settings: PowerSgd, shapes: &[(usize, usize, usize)]) -> Result<PowerSgdBucket> {
        let mut placed = Vec::with_capacity(shapes.len());
        let mut at = 0usize;
        for &(n, m, r) in shapes {
            placed.push((at, (n, m, r)));
            at = n
                .checked_mul(m)
                .and_then(|k| at.checked_add(k))
                .ok_or_else(|| Error::Collective("a low-rank bucket's size overflows".into()))?;
        }
        PowerSgdBucket::at_offsets(settings, &placed, at)
    }

    /// As [`PowerSgdBucket::new`], for matrices that sit at offsets (in ascending
    /// order, not overlapping) in a buffer of `len` elements that holds other tensors
    /// too, as a framework's gradient bucket holds biases between its weights. The
    /// steps then take that whole buffer and touch only the matrices' elements.
    pub fn at_offsets(
        settings: PowerSgd,
        matrices: &[(usize, (usize, usize, usize))],
        len: usize,
    ) -> Result<PowerSgdBucket> {
        settings.check()?;
        // The matrices lie apart inside `len` elements and `r <= min(n, m)`, so the sums
        // of `n m`, `n r` and `m r` below are at most `len`: none overflows.
        let mut mats = Vec::with_capacity(matrices.len());
        let (mut off, mut p_off, mut q_off, mut widest, mut end) = (0usize, 0, 0, 0usize, 0);
        for &(at, (n, m, r)) in matrices {
            if r == 0 || r > n.min(m) || r > settings.rank {
                return Err(Error::Collective(format!(
                    "PowerSGD matrix {n} x {m} at rank {r}: the rank must be 1 to min({n}, {m}) \
                     and at most the settings' {}",
                    settings.rank
                )));
            }
            let stop = n.checked_mul(m).and_then(|k| at.checked_add(k));
            match stop {
                Some(stop) if at >= end && stop <= len => end = stop,
                _ => {
                    return Err(Error::Collective(format!(
                        "PowerSGD matrix {n} x {m} at offset {at} overlaps the one before or \
                         ends past the buffer's {len} elements"
                    )));
                }
            }
            mats.push(Mat {
                at,
                off,
                n,
                m,
                r,
                p_off,
                q_off,
            });
            off += n * m;
            p_off += n * r;
            q_off += m * r;
            widest = widest.max(m * r);
        }
        let buf = |n: usize, what| crate::alloc::filled(n, 0f32, what);
        Ok(PowerSgdBucket {
            opts: settings,
            q: buf(q_off, "PowerSGD's Q")?,
            q_ready: crate::alloc::filled(mats.len(), false, "PowerSGD's Q flags")?,
            residual: buf(
                if settings.feedback { off } else { 0 },
                "PowerSGD's residual",
            )?,
            qt: buf(widest, "PowerSGD's Q")?,
            factors: (Vec::new(), Vec::new()),
            len,
            mats,
            phase: Phase::Idle,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &PowerSgd {
        &self.opts
    }

    /// Elements of the buffer the steps take: the sum of `n m` over the matrices, or
    /// the `len` given to [`PowerSgdBucket::at_offsets`].
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a bucket of no matrix.
    pub fn is_empty(&self) -> bool {
        self.mats.is_empty()
    }

    /// Elements of the first all-reduce (every matrix's `P`: `n r` each).
    pub fn p_len(&self) -> usize {
        self.mats.last().map_or(0, |m| m.p_off + m.n * m.r)
    }

    /// Elements of the second all-reduce (every matrix's `Q`: `m r` each).
    pub fn q_len(&self) -> usize {
        self.mats.last().map_or(0, |m| m.q_off + m.m * m.r)
    }

    fn expect(&self, want: Phase, call: &str, before: &str) -> Result<()> {
        if self.phase == want {
            Ok(())
        } else {
            Err(Error::Collective(format!(
                "PowerSGD: {call} was called before {before} (the steps go p_step, q_step, finish)"
            )))
        }
    }

    /// Step 1: `grad` (this rank's gradients of the bucket) becomes `M = grad + e`, and
    /// `p` gets this rank's `P = M Q` of every matrix. `Q` is each matrix's last one
    /// (warm start) or drawn from `seed`, which must be the same on every rank. All-reduce
    /// `p` to the mean over ranks, then call [`PowerSgdBucket::q_step`] with the same
    /// `M`. Starts a new step whatever the bucket's phase (a step left half done is
    /// dropped).
    pub fn p_step(&mut self, grad: &mut [f32], seed: u64, p: &mut [f32]) -> Result<()> {
        let _fp = crate::kernels::Standard::new();
        check_len(
            "PowerSGD gradient and bucket length",
            grad.len(),
            self.len(),
        )?;
        check_len("PowerSGD P buffer and P length", p.len(), self.p_len())?;
        self.phase = Phase::Idle;
        for (i, a) in self.mats.iter().enumerate() {
            if !self.q_ready[i] || !self.opts.warm_start {
                draw_q(&mut self.q[a.q()], matrix_seed(seed, i));
            }
            let e = self.opts.feedback.then(|| &self.residual[a.res()]);
            if a.r <= THIN_MAX_RANK {
                // One pass over the rows: M = grad + e formed, then its dot products
                // with the columns of Q while the row is in cache.
                let qt = transpose(&self.q[a.q()], a.m, a.r, &mut self.qt);
                thin_p(&mut grad[a.elems()], e, qt, a, &mut p[a.p()]);
                continue;
            }
            if let Some(e) = e {
                grad[a.elems()]
                    .iter_mut()
                    .zip(e)
                    .for_each(|(x, e)| *x += *e);
            }
            let m_i = View::rows(&grad[a.elems()], a.n, a.m);
            let q_i = View::rows(&self.q[a.q()], a.m, a.r);
            matmul(m_i, q_i, &mut p[a.p()]);
        }
        self.phase = Phase::P;
        Ok(())
    }

    /// Step 2: `p` holds the mean over ranks of their [`PowerSgdBucket::p_step`]
    /// outputs; this orthonormalises its columns in place (the same on every rank) and
    /// writes this rank's `Q = M^T P` of every matrix into `q`. All-reduce `q` to the
    /// mean over ranks, then call [`PowerSgdBucket::finish`].
    pub fn q_step(&mut self, m: &[f32], p: &mut [f32], q: &mut [f32]) -> Result<()> {
        let _fp = crate::kernels::Standard::new();
        self.expect(Phase::P, "q_step", "p_step")?;
        check_len("PowerSGD M and bucket length", m.len(), self.len())?;
        check_len("PowerSGD P buffer and P length", p.len(), self.p_len())?;
        check_len("PowerSGD Q buffer and Q length", q.len(), self.q_len())?;
        for a in &self.mats {
            orthonormalise(&mut p[a.p()], a.n, a.r);
            if a.r <= THIN_MAX_RANK {
                thin_q(&m[a.elems()], &p[a.p()], a, &mut q[a.q()]);
                continue;
            }
            let m_i = View::rows(&m[a.elems()], a.n, a.m);
            let p_i = View::rows(&p[a.p()], a.n, a.r);
            matmul(m_i.t(), p_i, &mut q[a.q()]);
        }
        self.phase = Phase::Q;
        Ok(())
    }

    /// Step 3: `q` holds the mean over ranks of their [`PowerSgdBucket::q_step`]
    /// outputs; `out` gets `P Q^T` of every matrix (the bucket's averaged gradient, the
    /// same on every rank), the residuals become `M - P Q^T`, and `Q` is kept for the
    /// next step. Returns `false` if the factors held NaN or Inf (a gradient overflowed
    /// on some rank): then `out` is all NaN, so a loss scaler sees it, the residuals keep
    /// their values from before the step and the next step draws a fresh `Q`.
    pub fn finish(&mut self, m: &[f32], p: &[f32], q: &[f32], out: &mut [f32]) -> Result<bool> {
        let _fp = crate::kernels::Standard::new();
        check_len("PowerSGD M and bucket length", m.len(), self.len())?;
        check_len("PowerSGD output and bucket length", out.len(), self.len())?;
        if !self.finish_begins(p, q)? {
            self.mats.iter().for_each(|a| out[a.elems()].fill(f32::NAN));
            return Ok(false);
        }
        for a in &self.mats {
            let qt = transpose(&q[a.q()], a.m, a.r, &mut self.qt);
            let e = self.opts.feedback.then(|| &mut self.residual[a.res()]);
            let rows = Rows {
                x: Dest::Out(&m[a.elems()], &mut out[a.elems()]),
                e,
                p: &p[a.p()],
                m: a.m,
                r: a.r,
            };
            reconstruct(rows, qt, a);
        }
        self.q.copy_from_slice(q);
        Ok(true)
    }

    /// [`PowerSgdBucket::finish`] with the result written over `m` (the matrices'
    /// elements only), for a caller that reduces its gradient buffer in place.
    pub fn finish_in_place(&mut self, m: &mut [f32], p: &[f32], q: &[f32]) -> Result<bool> {
        let _fp = crate::kernels::Standard::new();
        check_len("PowerSGD M and bucket length", m.len(), self.len())?;
        if !self.finish_begins(p, q)? {
            self.mats.iter().for_each(|a| m[a.elems()].fill(f32::NAN));
            return Ok(false);
        }
        for a in &self.mats {
            let qt = transpose(&q[a.q()], a.m, a.r, &mut self.qt);
            let e = self.opts.feedback.then(|| &mut self.residual[a.res()]);
            let rows = Rows {
                x: Dest::InPlace(&mut m[a.elems()]),
                e,
                p: &p[a.p()],
                m: a.m,
                r: a.r,
            };
            reconstruct(rows, qt, a);
        }
        self.q.copy_from_slice(q);
        Ok(true)
    }

    /// The checks of step 3, and whether the factors are finite. When they are not,
    /// every matrix draws a fresh `Q` at the next step (the residuals stay). Either way,
    /// every `Q` is set once the caller has written the result and copied `q`.
    fn finish_begins(&mut self, p: &[f32], q: &[f32]) -> Result<bool> {
        self.expect(Phase::Q, "finish", "q_step")?;
        check_len("PowerSGD P buffer and P length", p.len(), self.p_len())?;
        check_len("PowerSGD Q buffer and Q length", q.len(), self.q_len())?;
        self.phase = Phase::Idle;
        let finite = p.iter().chain(q).all(|v| v.is_finite());
        self.q_ready.fill(finite);
        Ok(finite)
    }

    /// A whole step over the ranks: the three steps with their two all-reduces
    /// between, run by the caller's collectives. `m` is the bucket (as for
    /// [`PowerSgdBucket::p_step`]); `plain` are ranges of it holding tensors that go as
    /// float32, carried in the first all-reduce after every matrix's `P` (so small
    /// tensors share its latency, as PyTorch's PowerSGD hook sends them), and written
    /// back with the mean. `first` must be a float32 all-reduce (identity codec, mean)
    /// of [`PowerSgdBucket::p_len`] plus the ranges' elements, `second` one of
    /// [`PowerSgdBucket::q_len`] elements, each on its `Comm` (they may share a
    /// transport). Every rank must pass the same ranges and `seed`. Returns
    /// [`PowerSgdBucket::finish_in_place`]'s flag; on an error `m` may hold the
    /// matrices' `M` (gradient plus residual).
    pub fn exchange<A: Transport + ?Sized, B: Transport + ?Sized>(
        &mut self,
        m: &mut [f32],
        seed: u64,
        plain: &[core::ops::Range<usize>],
        first: (&mut AllReduce, &mut Comm<A>),
        second: (&mut AllReduce, &mut Comm<B>),
    ) -> Result<bool> {
        check_len("the bucket", m.len(), self.len)?;
        let mut carried = 0usize;
        for r in plain {
            if r.start > r.end || r.end > m.len() {
                return Err(Error::Collective(format!(
                    "a float32 range {r:?} outside the bucket's {} elements",
                    m.len()
                )));
            }
            carried += r.len();
        }
        let (p_len, q_len) = (self.p_len(), self.q_len());
        for (what, ar, want) in [
            ("first", &*first.0, p_len + carried),
            ("second", &*second.0, q_len),
        ] {
            let f32_mean = matches!(ar.codec(), CodecSpec::Identity(_))
                && ar.options().op == crate::collective::ReduceOp::Mean;
            if !f32_mean || ar.len() != want {
                return Err(Error::Collective(format!(
                    "PowerSGD's {what} all-reduce must be a float32 mean of {want} elements, \
                     not {} of {} elements",
                    ar.codec(),
                    ar.len()
                )));
            }
        }
        // The buffers of the last step, grown (checked) only when a bucket needs more,
        // and kept whatever the step's outcome.
        let (mut p_buf, mut q_buf) = core::mem::take(&mut self.factors);
        let mut step = || -> Result<bool> {
            crate::alloc::lengthen(&mut p_buf, p_len + carried, "PowerSGD's P")?;
            crate::alloc::lengthen(&mut q_buf, q_len, "PowerSGD's Q")?;
            let (p, q) = (&mut p_buf[..p_len + carried], &mut q_buf[..q_len]);
            self.p_step(m, seed, &mut p[..p_len])?;
            let mut at = p_len;
            for r in plain {
                p[at..at + r.len()].copy_from_slice(&m[r.clone()]);
                at += r.len();
            }
            first.0.run_in_place(first.1, p, 0)?;
            let mut at = p_len;
            for r in plain {
                m[r.clone()].copy_from_slice(&p[at..at + r.len()]);
                at += r.len();
            }
            self.q_step(m, &mut p[..p_len], q)?;
            second.0.run_in_place(second.1, q, 0)?;
            self.finish_in_place(m, &p[..p_len], q)
        };
        let res = step();
        self.factors = (p_buf, q_buf);
        res
    }

    /// Zero the residuals and draw a fresh `Q` at the next step.
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
        self.q_ready.fill(false);
        self.phase = Phase::Idle;
    }

    /// Matrix `i`'s state: its warm-start `Q` (`m x r`, row-major) if it has one, and
    /// its residual (`n m` elements; empty without feedback).
    pub fn matrix_state(&self, i: usize) -> Result<(Option<&[f32]>, &[f32])> {
        let a = self.mat(i)?;
        let q = self.q_ready[i].then(|| &self.q[a.q()]);
        let e = if self.opts.feedback {
            &self.residual[a.res()]
        } else {
            &[][..]
        };
        Ok((q, e))
    }

    /// Set matrix `i`'s state, as [`PowerSgdBucket::matrix_state`] gave it: `q` (`None`:
    /// draw a fresh one at the next step) and the residual (empty without feedback).
    pub fn set_matrix_state(
        &mut self,
        i: usize,
        q: Option<&[f32]>,
        residual: &[f32],
    ) -> Result<()> {
        let a = self.mat(i)?;
        let e_len = if self.opts.feedback { a.n * a.m } else { 0 };
        check_len("PowerSGD residual and matrix length", residual.len(), e_len)?;
        if let Some(q) = q {
            check_len("PowerSGD Q and matrix's Q length", q.len(), a.m * a.r)?;
            self.q[a.q()].copy_from_slice(q);
        }
        if self.opts.feedback {
            self.residual[a.res()].copy_from_slice(residual);
        }
        self.q_ready[i] = q.is_some();
        self.phase = Phase::Idle;
        Ok(())
    }

    fn mat(&self, i: usize) -> Result<Mat> {
        self.mats.get(i).copied().ok_or_else(|| {
            Error::Collective(format!(
                "PowerSGD bucket has {} matrices; there is no matrix {i}",
                self.mats.len()
            ))
        })
    }

    /// The state that carries across steps (each matrix's `Q` and whether it is set, and
    /// the residuals) as a checksummed blob.
    pub fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(LOW_RANK_MAGIC);
        w.u64(self.opts.rank as u64);
        // 0: no Q set, 1: all set (the only two a bucket had before flags per matrix),
        // 2: one flag per matrix follows.
        match (
            self.q_ready.iter().all(|&r| r),
            self.q_ready.iter().any(|&r| r),
        ) {
            (_, false) => w.u8(0),
            (true, true) => w.u8(1),
            _ => {
                w.u8(2);
                for &r in &self.q_ready {
                    w.u8(u8::from(r));
                }
                &mut w
            }
        };
        w.f32s(&self.q).f32s(&self.residual);
        w.finish()
    }

    /// Read a blob of [`PowerSgdBucket::save`] from a bucket of the same matrices and
    /// settings; on an error the state is unchanged.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, LOW_RANK_MAGIC, "PowerSGD bucket")?;
        r.u64_eq("rank", self.opts.rank as u64)?;
        let bad = |v: u8| {
            Error::Checkpoint(format!(
                "PowerSGD bucket: Q flag {v} is neither 0 nor 1 (nor 2 for flags per matrix)"
            ))
        };
        let mut ready = self.q_ready.clone();
        match r.u8()? {
            0 => ready.fill(false),
            1 => ready.fill(true),
            2 => {
                for f in ready.iter_mut() {
                    *f = match r.u8()? {
                        0 => false,
                        1 => true,
                        v => return Err(bad(v)),
                    };
                }
            }
            v => return Err(bad(v)),
        }
        let mut q = self.q.clone();
        let mut residual = self.residual.clone();
        r.f32s_into(&mut q)?;
        r.f32s_into(&mut residual)?;
        r.end()?;
        self.q = q;
        self.residual = residual;
        self.q_ready = ready;
        self.phase = Phase::Idle;
        Ok(())
    }
}

/// The state of one low-rank bucket of the sync engine on one rank: the arithmetic, and
/// the all-reduces of its factors.
#[derive(Clone, Debug)]
pub(crate) struct LowRank {
    bucket: PowerSgdBucket,
    /// Plain fp32 all-reduce of the whole bucket, for the steps before `start_step`.
    plain: Option<AllReduce>,
    ar_p: AllReduce,
    ar_q: AllReduce,
    /// Scratch: this rank's `P`, the all-reduced `P`, this rank's `Q`, the all-reduced
    /// `Q`.
    p_local: Vec<f32>,
    p: Vec<f32>,
    q_local: Vec<f32>,
    q: Vec<f32>,
}

impl LowRank {
    /// The state of a bucket of matrices `(n, m, r)` (in bucket order) for the world of
    /// `comm`, with the all-reduce options of the engine's other buckets (`base`).
    pub(crate) fn new<T: Transport>(
        opts: PowerSgd,
        shapes: &[(usize, usize, usize)],
        comm: &Comm<T>,
        base: AllReduceOptions,
        strategy: crate::collective::Strategy,
    ) -> Result<LowRank> {
        let bucket = PowerSgdBucket::new(opts, shapes)?;
        let factor_opts = AllReduceOptions {
            feedback: Feedback::None,
            strategy: crate::collective::StrategyChoice::Forced(strategy),
            ..base
        };
        let plain = if opts.start_step > 0 {
            Some(AllReduce::new(
                CodecSpec::Identity(Identity),
                bucket.len(),
                comm,
                AllReduceOptions {
                    feedback: Feedback::None,
                    strategy: crate::collective::StrategyChoice::Forced(
                        crate::collective::Strategy::Fp32Ring,
                    ),
                    ..base.clone()
                },
            )?)
        } else {
            None
        };
        let buf = |n: usize, what| crate::alloc::filled(n, 0f32, what);
        let (p_len, q_len) = (bucket.p_len(), bucket.q_len());
        Ok(LowRank {
            plain,
            ar_p: AllReduce::new(opts.codec, p_len, comm, factor_opts.clone())?,
            ar_q: AllReduce::new(opts.codec, q_len, comm, factor_opts)?,
            p_local: buf(p_len, "PowerSGD's P")?,
            p: buf(p_len, "PowerSGD's P")?,
            q_local: buf(q_len, "PowerSGD's Q")?,
            q: buf(q_len, "PowerSGD's Q")?,
            bucket,
        })
    }

    /// Zero the residual and draw a fresh `Q` at the next step.
    pub(crate) fn reset(&mut self) {
        self.bucket.reset();
    }

    /// One step: `output` gets the all-reduced low-rank approximation of `input`, which
    /// this overwrites with `M` (its gradient plus the residual). `seed` is the step's
    /// seed of this bucket, the same on every rank.
    pub(crate) fn run<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        step: u64,
        input: &mut [f32],
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        if let Some(plain) = &mut self.plain
            && step < self.bucket.opts.start_step
        {
            return plain.run(comm, input, output, seed);
        }
        check_len(
            "low-rank bucket output and bucket length",
            output.len(),
            self.bucket.len(),
        )?;
        self.bucket.p_step(input, seed, &mut self.p_local)?;
        let s1 = self
            .ar_p
            .run(comm, &self.p_local, &mut self.p, seed ^ 0x5053_4744)?;
        self.bucket.q_step(input, &mut self.p, &mut self.q_local)?;
        let s2 = self
            .ar_q
            .run(comm, &self.q_local, &mut self.q, seed ^ 0x5153_4744)?;
        self.bucket.finish(input, &self.p, &self.q, output)?;
        Ok(Stats {
            strategy: s1.strategy,
            bytes_sent: s1.bytes_sent + s2.bytes_sent,
            messages: s1.messages + s2.messages,
        })
    }

    /// See [`PowerSgdBucket::save`].
    pub(crate) fn save(&self) -> Vec<u8> {
        self.bucket.save()
    }

    /// See [`PowerSgdBucket::restore`].
    pub(crate) fn restore(&mut self, blob: &[u8]) -> Result<()> {
        self.bucket.restore(blob)
    }
}

/// The seed of matrix `i`'s first `Q` in a bucket whose step seed is `seed`.
fn matrix_seed(seed: u64, i: usize) -> u64 {
    crate::rng::splitmix64(seed ^ crate::rng::splitmix64(i as u64 ^ 0x4d41_5452_4958))
}

/// Fill `q` with draws uniform in `[-1, 1)` from `seed` (exact arithmetic on the hash's
/// bits, so the same on every CPU).
fn draw_q(q: &mut [f32], seed: u64) {
    let stream = crate::rng::splitmix64(seed ^ 0x5157_5354_4152_5400);
    for (i, v) in q.iter_mut().enumerate() {
        let bits = crate::rng::splitmix64(stream ^ crate::rng::splitmix64(i as u64));
        // 24 random bits -> k / 2^23 - 1 with k < 2^24: exact in f32.
        *v = (bits >> 40) as f32 * (1.0 / 8_388_608.0) - 1.0;
    }
}

/// Orthonormalise the `r` columns of the row-major `n x r` matrix `p` in place by
/// modified Gram-Schmidt: column `j` loses its projections on columns `0..j`, then is
/// divided by its norm. Dot products and norms are f64 sums in row order, so the result
/// is the same on every CPU. A column of norm zero stays zero (a zero gradient); a
/// non-finite one is left as it is.
pub(crate) fn orthonormalise(p: &mut [f32], n: usize, r: usize) {
    debug_assert_eq!(p.len(), n * r);
    for j in 0..r {
        for i in 0..j {
            let d: f64 = (0..n)
                .map(|a| f64::from(p[a * r + j]) * f64::from(p[a * r + i]))
                .sum();
            let d = d as f32;
            for a in 0..n {
                p[a * r + j] -= d * p[a * r + i];
            }
        }
        let norm = (0..n)
            .map(|a| f64::from(p[a * r + j]) * f64::from(p[a * r + j]))
            .sum::<f64>()
            .sqrt();
        if norm > 0.0 && norm.is_finite() {
            for a in 0..n {
                p[a * r + j] = (f64::from(p[a * r + j]) / norm) as f32;
            }
        }
    }
}

/// `Q` (`m x r`, row-major) transposed into `qt` (at least `m r`): the `r` columns of
/// `Q`, each `m` long, back to back.
fn transpose<'a>(q: &[f32], m: usize, r: usize, qt: &'a mut [f32]) -> &'a [f32] {
    let qt = &mut qt[..m * r];
    for b in 0..m {
        for k in 0..r {
            qt[k * m + b] = q[b * r + k];
        }
    }
    qt
}

/// Elements of a matrix per parallel piece of rows (or of columns, for `Q`).
const PIECE: usize = crate::parallel::CHUNK;

/// Elements of a matrix from which its reconstruction is written by non-temporal stores
/// where the last-level cache's size cannot be read (8 MiB of f32: more than the caches of
/// a core keep).
const STREAM_FROM: usize = 1 << 21;

/// Elements of a matrix from which its reconstruction is written by non-temporal stores:
/// from half the last-level cache on (the step's other matrix-sized stream, the residual,
/// takes the other half), else [`STREAM_FROM`]. A matrix the cache holds is better
/// written through it: the next pass over it (the next step's `M Q`, or the caller's
/// copy out) then reads the cache. Measured on 4096 x 2304 (36 MiB), rank 2, no error
/// feedback: on a Zen 5 with 32 MiB of L3 per core complex, streaming took the step from
/// 8.7 to 3.2 ms with the other kernels of that change (the reconstruction 2.13 -> 0.92
/// ms); on an Intel Xeon that reports 480 MiB of L3, streaming took it from 4.98 to 7.85
/// ms (two threads 2.77 -> 4.05).
fn stream_from() -> usize {
    static FROM: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| {
        if cfg!(miri) {
            return STREAM_FROM; // no host files under the interpreter
        }
        last_level_cache(std::path::Path::new("/sys/devices/system/cpu/cpu0/cache"))
            .map_or(STREAM_FROM, |bytes| bytes / 2 / 4)
    })
}

/// The size in bytes of the highest-level data or unified cache that Linux lists under
/// `dir` (`index*/level`, `type`, `size` such as `491520K`), or `None` where it lists none
/// (another system, or a sandbox without `/sys`).
fn last_level_cache(dir: &std::path::Path) -> Option<usize> {
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    let mut best: Option<(u32, usize)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let d = entry.path();
        if !d.file_name()?.to_str()?.starts_with("index") {
            continue;
        }
        let (Some(level), Some(kind), Some(size)) = (
            read(d.join("level")),
            read(d.join("type")),
            read(d.join("size")),
        ) else {
            continue;
        };
        if kind.trim() == "Instruction" {
            continue;
        }
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (digits, unit) = match size.char_indices().last() {
            Some((i, 'K')) => (&size[..i], 1usize << 10),
            Some((i, 'M')) => (&size[..i], 1 << 20),
            Some((i, 'G')) => (&size[..i], 1 << 30),
            _ => (size, 1),
        };
        let Some(bytes) = digits
            .parse::<usize>()
            .ok()
            .and_then(|v| v.checked_mul(unit))
        else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, bytes));
        }
    }
    best.map(|(_, bytes)| bytes).filter(|&b| b > 0)
}

/// Whether the products and reconstruction of an `n x m` matrix run on all threads.
fn par(a: &Mat) -> bool {
    crate::parallel::worth(a.n * a.m, 2)
}

/// Rows of `M`, with their residual rows (if any) and `P` rows.
struct MqRows<'a> {
    x: &'a mut [f32],
    e: Option<&'a [f32]>,
    p: &'a mut [f32],
    m: usize,
    r: usize,
}

impl Split for MqRows<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (x0, x1) = self.x.split_at_mut(at * self.m);
        let (p0, p1) = self.p.split_at_mut(at * self.r);
        let (e0, e1) = match self.e {
            Some(e) => {
                let (a, b) = e.split_at(at * self.m);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let (m, r) = (self.m, self.r);
        (
            MqRows {
                x: x0,
                e: e0,
                p: p0,
                m,
                r,
            },
            MqRows {
                x: x1,
                e: e1,
                p: p1,
                m,
                r,
            },
        )
    }
}

/// `P = M Q` of matrix `a` without packing `M` (after forming `M = grad + e` in place,
/// with `e`), in pieces of rows on all threads when large: every row's values are the
/// same for any split ([`thin_mq`]).
fn thin_p(x: &mut [f32], e: Option<&[f32]>, qt: &[f32], a: &Mat, p: &mut [f32]) {
    let rows = MqRows {
        x,
        e,
        p,
        m: a.m,
        r: a.r,
    };
    let range = (PIECE / a.m.max(1)).max(1);
    crate::parallel::for_ranges(rows, a.n, range, par(a), &|b, _| {
        thin_mq(b.x, b.e, qt, b.m, b.p);
        false
    });
}

/// `Q = M^T P` of matrix `a` (`q` row-major, `m x r`) without packing `M`: columns in
/// ranges as wide as their accumulators allow ([`THIN_ACC`]), so each row's part of a
/// range is one long contiguous read, and at least one range per thread when large. Each
/// element sums over the rows in order ([`thin_mtp`]), so any split gives the same bits.
fn thin_q(mat: &[f32], p: &[f32], a: &Mat, q: &mut [f32]) {
    let (m, r) = (a.m, a.r);
    let parallel = par(a);
    let widest = THIN_ACC / r / 16 * 16;
    let threads = if parallel {
        crate::parallel::threads()
    } else {
        1
    };
    // A range per thread at least, none wider than the accumulators, all about as wide.
    let pieces = threads.max(m.div_ceil(widest));
    let range = m.div_ceil(pieces).next_multiple_of(16).clamp(16, widest);
    let cols = QCols { q, r };
    crate::parallel::for_ranges(cols, m, range, parallel, &|c, j0| {
        let w = c.q.len() / r;
        let mut acc = [0f32; THIN_ACC];
        let acc = &mut acc[..r * w];
        thin_mtp(mat, m, j0, p, r, acc);
        for (c_, row) in c.q.chunks_exact_mut(r).enumerate() {
            for (k, v) in row.iter_mut().enumerate() {
                *v = acc[k * w + c_];
            }
        }
        false
    });
}

/// Rows of `Q` (`r` values each), cut at whole rows.
struct QCols<'a> {
    q: &'a mut [f32],
    r: usize,
}

impl Split for QCols<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (a, b) = self.q.split_at_mut(at * self.r);
        (QCols { q: a, r: self.r }, QCols { q: b, r: self.r })
    }
}

/// Where the reconstruction `P Q^T` goes: an output beside `M`, or over `M`.
enum Dest<'a> {
    Out(&'a [f32], &'a mut [f32]),
    InPlace(&'a mut [f32]),
}

/// Rows of a matrix being reconstructed, with their residual and `P` rows.
struct Rows<'a> {
    x: Dest<'a>,
    e: Option<&'a mut [f32]>,
    p: &'a [f32],
    m: usize,
    r: usize,
}

impl Split for Rows<'_> {
    fn split(self, at: usize, _: usize) -> (Self, Self) {
        let (m, r) = (self.m, self.r);
        let (x0, x1) = match self.x {
            Dest::Out(x, out) => {
                let (a, b) = x.split_at(at * m);
                let (c, d) = out.split_at_mut(at * m);
                (Dest::Out(a, c), Dest::Out(b, d))
            }
            Dest::InPlace(x) => {
                let (a, b) = x.split_at_mut(at * m);
                (Dest::InPlace(a), Dest::InPlace(b))
            }
        };
        let (e0, e1) = match self.e {
            Some(e) => {
                let (a, b) = e.split_at_mut(at * m);
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        let (p0, p1) = self.p.split_at(at * r);
        (
            Rows {
                x: x0,
                e: e0,
                p: p0,
                m,
                r,
            },
            Rows {
                x: x1,
                e: e1,
                p: p1,
                m,
                r,
            },
        )
    }
}

/// `P Q^T` of matrix `a` row by row ([`thin_pqt`]), written to the output or over `M`,
/// and with a residual, the new residual `M - P Q^T` in the same pass; in pieces of rows
/// on all threads when large (rows are independent).
fn reconstruct(rows: Rows, qt: &[f32], a: &Mat) {
    let range = (PIECE / a.m.max(1)).max(1);
    let stream = a.n * a.m >= stream_from();
    crate::parallel::for_ranges(rows, a.n, range, par(a), &|b, _| {
        match b.x {
            Dest::Out(x, out) => thin_pqt(Some(x), out, b.e, b.p, qt, b.m, stream),
            Dest::InPlace(x) => thin_pqt(None, x, b.e, b.p, qt, b.m, stream),
        }
        false
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local;

    #[test]
    #[cfg_attr(miri, ignore)] // reads files
    fn the_last_level_cache_is_the_highest_data_or_unified_level_listed() {
        let dir = std::env::temp_dir().join(format!("gradpack-llc-{}", std::process::id()));
        let write = |i: usize, level: &str, kind: &str, size: &str| {
            let d = dir.join(format!("index{i}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("level"), format!("{level}\n")).unwrap();
            std::fs::write(d.join("type"), format!("{kind}\n")).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        };
        assert_eq!(last_level_cache(&dir), None, "no such directory");
        write(0, "1", "Data", "48K");
        write(1, "1", "Instruction", "64K");
        assert_eq!(last_level_cache(&dir), Some(48 << 10));
        write(2, "2", "Unified", "2048K");
        assert_eq!(last_level_cache(&dir), Some(2 << 20));
        write(3, "3", "Unified", "491520K");
        assert_eq!(last_level_cache(&dir), Some(480 << 20));
        // An instruction cache at a higher level and unreadable sizes are passed over.
        write(4, "4", "Instruction", "1G");
        write(5, "4", "Unified", "lots");
        write(6, "4", "Unified", "99999999999999999999K");
        assert_eq!(last_level_cache(&dir), Some(480 << 20));
        write(7, "4", "Unified", "1M");
        assert_eq!(last_level_cache(&dir), Some(1 << 20));
        std::fs::remove_dir_all(&dir).unwrap();
        // Whatever this machine lists, the threshold is a positive element count.
        assert!(stream_from() > 0);
    }

    /// PowerSGD by its definition, in f64 (the sums over ranks exact in the order
    /// written), for every rank's `n x m` gradient per step, from the first `Q` `q`:
    /// per step, the result.
    fn reference(
        grads: &[Vec<Vec<f32>>],
        n: usize,
        m: usize,
        r: usize,
        q: &[f32],
    ) -> Vec<Vec<f64>> {
        let ranks = grads[0].len();
        let mut e = vec![vec![0f64; n * m]; ranks];
        let mut q: Vec<f64> = q.iter().map(|&v| f64::from(v)).collect();
        let mut outs = Vec::new();
        for g in grads {
            let ms: Vec<Vec<f64>> = (0..ranks)
                .map(|w| (0..n * m).map(|i| f64::from(g[w][i]) + e[w][i]).collect())
                .collect();
            let mut p = vec![0f64; n * r];
            for x in &ms {
                for a in 0..n {
                    for k in 0..r {
                        p[a * r + k] += (0..m).map(|b| x[a * m + b] * q[b * r + k]).sum::<f64>();
                    }
                }
            }
            for j in 0..r {
                for i in 0..j {
                    let d: f64 = (0..n).map(|a| p[a * r + j] * p[a * r + i]).sum();
                    (0..n).for_each(|a| p[a * r + j] -= d * p[a * r + i]);
                }
                let norm = (0..n).map(|a| p[a * r + j].powi(2)).sum::<f64>().sqrt();
                (0..n).for_each(|a| p[a * r + j] /= norm);
            }
            q = vec![0f64; m * r];
            for x in &ms {
                for b in 0..m {
                    for k in 0..r {
                        q[b * r + k] +=
                            (0..n).map(|a| x[a * m + b] * p[a * r + k]).sum::<f64>() / ranks as f64;
                    }
                }
            }
            let out: Vec<f64> = (0..n * m)
                .map(|i| {
                    (0..r)
                        .map(|k| p[(i / m) * r + k] * q[(i % m) * r + k])
                        .sum()
                })
                .collect();
            for (w, x) in ms.iter().enumerate() {
                e[w] = x.iter().zip(&out).map(|(a, b)| a - b).collect();
            }
            outs.push(out);
        }
        outs
    }

    #[test]
    #[cfg_attr(miri, ignore = "threads and matrix products: minutes under Miri")]
    fn results_follow_the_definition_with_feedback_and_warm_start() {
        // Gradients that change slowly from step to step, as in training: a fixed matrix
        // scaled per rank, plus fresh noise. The f32 results stay within 1e-4 of the f64
        // definition over 6 steps.
        let (n, m, r, ranks, steps) = (40, 24, 2, 3, 6);
        let base = crate::synthetic::gradient(n * m, 31);
        let grads: Vec<Vec<Vec<f32>>> = (0..steps as u64)
            .map(|s| {
                (0..ranks)
                    .map(|w| {
                        let z = crate::synthetic::gradient(n * m, 1000 + 10 * s + w as u64);
                        let k = 0.2 * (1.0 + 0.2 * w as f32);
                        base.iter()
                            .zip(&z)
                            .map(|(&x, &z)| x * k + 0.05 * z)
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let seed = |s: u64| 77 + s;
        let res = local::run(ranks, None, |comm| {
            let rank = comm.rank();
            let mut lr = LowRank::new(
                PowerSgd::rank(r),
                &[(n, m, r)],
                &comm,
                AllReduceOptions {
                    op: crate::collective::ReduceOp::Mean,
                    ..Default::default()
                },
                crate::collective::Strategy::Fp32Ring,
            )?;
            let mut comm = comm;
            let mut outs = Vec::new();
            for (s, g) in grads.iter().enumerate() {
                let mut input = g[rank].clone();
                let mut out = vec![0f32; n * m];
                lr.run(&mut comm, s as u64, &mut input, &mut out, seed(s as u64))?;
                outs.push(out);
            }
            Ok(outs)
        });
        let got = res.into_iter().next().unwrap().unwrap();
        let mut q0 = vec![0f32; m * r];
        draw_q(&mut q0, matrix_seed(seed(0), 0));
        let want = reference(&grads, n, m, r, &q0);
        for s in 0..steps {
            let w2: f64 = want[s].iter().map(|v| v * v).sum();
            let d2: f64 = got[s]
                .iter()
                .zip(&want[s])
                .map(|(&a, &b)| (f64::from(a) - b).powi(2))
                .sum();
            let rel = (d2 / w2).sqrt();
            assert!(rel < 1e-4, "step {s}: relative difference {rel}");
        }
    }

    #[test]
    fn orthonormal_columns() {
        let (n, r) = (50, 4);
        let mut p: Vec<f32> = (0..n * r)
            .map(|i| ((i * 7919 % 113) as f32 - 56.0) / 10.0)
            .collect();
        orthonormalise(&mut p, n, r);
        for i in 0..r {
            for j in 0..r {
                let d: f64 = (0..n)
                    .map(|a| f64::from(p[a * r + i]) * f64::from(p[a * r + j]))
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "column {i} . column {j} = {d}");
            }
        }
    }

    #[test]
    fn zero_columns_stay_zero() {
        let mut p = vec![0f32; 12];
        orthonormalise(&mut p, 4, 3);
        assert!(p.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn draws_are_uniform_in_minus_one_to_one() {
        let mut q = vec![0f32; 4096];
        draw_q(&mut q, 9);
        assert!(q.iter().all(|&v| (-1.0..1.0).contains(&v)));
        let mean = q.iter().map(|&v| f64::from(v)).sum::<f64>() / q.len() as f64;
        // Uniform on [-1, 1): sd 0.577, so the mean of 4096 has sd 0.009; 5 sd.
        assert!(mean.abs() < 0.045, "{mean}");
        let mut again = vec![0f32; 4096];
        draw_q(&mut again, 9);
        assert_eq!(q, again);
    }

    #[test]
    fn matrices_and_their_ranks() {
        let p = PowerSgd::rank(4);
        assert_eq!(
            p.matrix_of(&Tensor::new("w", &[256, 128])),
            Some((256, 128, 4))
        );
        assert_eq!(
            p.matrix_of(&Tensor::new("conv", &[64, 32, 3, 3])),
            Some((64, 288, 4))
        );
        assert_eq!(p.matrix_of(&Tensor::new("b", &[256])), None);
        assert_eq!(p.matrix_of(&Tensor::new("thin", &[1000, 4])), None);
        assert_eq!(p.matrix_of(&Tensor::new("empty", &[0, 3])), None);
        // 10 x 10 at rank 4: 100 / 80 < 2.
        assert_eq!(p.matrix_of(&Tensor::new("small", &[10, 10])), None);
        assert!(PowerSgd::rank(0).check().is_err());
        assert!(PowerSgd::rank(65).check().is_err());
        let bad = PowerSgd {
            min_compression: f64::NAN,
            ..PowerSgd::default()
        };
        assert!(bad.check().is_err());
    }
}
