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
//! 6), so every rank computes bit-identical results on any CPU. The products of steps 2
//! and 5 run on `matrixmultiply`'s GEMM; they may differ in their last bits between
//! CPUs, which does not matter: each only feeds an all-reduce.
//!
//! A step whose all-reduced factors hold NaN or Inf (a gradient overflowed on some rank)
//! gives a result full of NaN, so that a loss scaler sees it; it keeps the residual as it
//! was before the step and draws a fresh `Q` at the next step, so one bad step does not
//! poison the state. Every rank takes the same decision, from the same all-reduced data.

use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::{AllReduce, AllReduceOptions, Comm, Feedback, Stats, Transport};
use crate::error::{Error, Result};
use crate::kernels::gemm::{View, matmul};
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
    pub(crate) fn check(&self) -> Result<()> {
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
    /// Offset in the bucket.
    off: usize,
    n: usize,
    m: usize,
    r: usize,
    /// Offset of its `P` (n x r) in the P buffer.
    p_off: usize,
    /// Offset of its `Q` (m x r) in the Q buffer.
    q_off: usize,
}

/// The state of one low-rank bucket on one rank.
#[derive(Clone)]
pub(crate) struct LowRank {
    opts: PowerSgd,
    mats: Vec<Mat>,
    /// Plain fp32 all-reduce of the whole bucket, for the steps before `start_step`.
    plain: Option<AllReduce>,
    ar_p: AllReduce,
    ar_q: AllReduce,
    /// The warm-start `Q` (all-reduced, so the same on every rank), if `q_ready`.
    q: Vec<f32>,
    q_ready: bool,
    /// `e`, one per bucket element (empty without feedback).
    residual: Vec<f32>,
    /// Scratch: this rank's `P`, the all-reduced `P`, this rank's `Q`, the all-reduced
    /// `Q`, and a transposed `Q` of the largest matrix.
    p_local: Vec<f32>,
    p: Vec<f32>,
    q_local: Vec<f32>,
    q_new: Vec<f32>,
    qt: Vec<f32>,
}

impl core::fmt::Debug for LowRank {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LowRank")
            .field("matrices", &self.mats.len())
            .field("rank", &self.opts.rank)
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
        opts.check()?;
        let too_big = || Error::Collective("a low-rank bucket's size overflows".into());
        let (p_len, q_len) = factor_lens(shapes).ok_or_else(too_big)?;
        let mut mats = Vec::with_capacity(shapes.len());
        let (mut off, mut p_off, mut q_off, mut widest) = (0usize, 0usize, 0usize, 0usize);
        for &(n, m, r) in shapes {
            mats.push(Mat {
                off,
                n,
                m,
                r,
                p_off,
                q_off,
            });
            off = off.checked_add(n * m).ok_or_else(too_big)?;
            p_off += n * r;
            q_off += m * r;
            widest = widest.max(m * r);
        }
        let factor_opts = AllReduceOptions {
            feedback: Feedback::None,
            strategy: crate::collective::StrategyChoice::Forced(strategy),
            ..base
        };
        let plain = if opts.start_step > 0 {
            Some(AllReduce::new(
                CodecSpec::Identity(Identity),
                off,
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
        Ok(LowRank {
            opts,
            mats,
            plain,
            ar_p: AllReduce::new(opts.codec, p_len, comm, factor_opts.clone())?,
            ar_q: AllReduce::new(opts.codec, q_len, comm, factor_opts)?,
            q: buf(q_len, "PowerSGD's Q")?,
            q_ready: false,
            residual: buf(if opts.feedback { off } else { 0 }, "PowerSGD's residual")?,
            p_local: buf(p_len, "PowerSGD's P")?,
            p: buf(p_len, "PowerSGD's P")?,
            q_local: buf(q_len, "PowerSGD's Q")?,
            q_new: buf(q_len, "PowerSGD's Q")?,
            qt: buf(widest, "PowerSGD's Q")?,
        })
    }

    /// Zero the residual and draw a fresh `Q` at the next step.
    pub(crate) fn reset(&mut self) {
        self.residual.fill(0.0);
        self.q_ready = false;
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
            && step < self.opts.start_step
        {
            return plain.run(comm, input, output, seed);
        }
        let len = self.mats.last().map_or(0, |m| m.off + m.n * m.m);
        for (what, got) in [
            ("low-rank bucket input and bucket length", input.len()),
            ("low-rank bucket output and bucket length", output.len()),
        ] {
            if got != len {
                return Err(Error::LengthMismatch {
                    what,
                    left: got,
                    right: len,
                });
            }
        }
        if self.opts.feedback {
            input
                .iter_mut()
                .zip(&self.residual)
                .for_each(|(x, e)| *x += *e);
        }
        if !self.q_ready || !self.opts.warm_start {
            draw_q(&mut self.q, seed);
        }
        for a in &self.mats {
            let m_i = View::rows(&input[a.off..a.off + a.n * a.m], a.n, a.m);
            let q_i = View::rows(&self.q[a.q_off..a.q_off + a.m * a.r], a.m, a.r);
            matmul(m_i, q_i, &mut self.p_local[a.p_off..a.p_off + a.n * a.r]);
        }
        let s1 = self
            .ar_p
            .run(comm, &self.p_local, &mut self.p, seed ^ 0x5053_4744)?;
        for a in &self.mats {
            orthonormalise(&mut self.p[a.p_off..a.p_off + a.n * a.r], a.n, a.r);
        }
        for a in &self.mats {
            let m_i = View::rows(&input[a.off..a.off + a.n * a.m], a.n, a.m);
            let p_i = View::rows(&self.p[a.p_off..a.p_off + a.n * a.r], a.n, a.r);
            matmul(
                m_i.t(),
                p_i,
                &mut self.q_local[a.q_off..a.q_off + a.m * a.r],
            );
        }
        let s2 = self
            .ar_q
            .run(comm, &self.q_local, &mut self.q_new, seed ^ 0x5153_4744)?;
        let finite = self.p.iter().chain(&self.q_new).all(|v| v.is_finite());
        for a in &self.mats {
            let out = &mut output[a.off..a.off + a.n * a.m];
            let (p_i, q_i) = (
                &self.p[a.p_off..a.p_off + a.n * a.r],
                &self.q_new[a.q_off..a.q_off + a.m * a.r],
            );
            if !finite {
                // Visible to a loss scaler, whatever the reconstruction would give.
                out.fill(f32::NAN);
                continue;
            }
            // The new residual M - P Q^T, row by row while the row is in cache.
            let residual = self.opts.feedback.then(|| {
                (
                    &input[a.off..a.off + a.n * a.m],
                    &mut self.residual[a.off..a.off + a.n * a.m],
                )
            });
            reconstruct(p_i, q_i, (a.n, a.m, a.r), &mut self.qt, out, residual);
        }
        if finite {
            core::mem::swap(&mut self.q, &mut self.q_new);
            self.q_ready = true;
        } else {
            self.q_ready = false;
        }
        Ok(Stats {
            strategy: s1.strategy,
            bytes_sent: s1.bytes_sent + s2.bytes_sent,
            messages: s1.messages + s2.messages,
        })
    }

    /// The state that carries across steps: `Q` and whether it is set, and the residual.
    pub(crate) fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(LOW_RANK_MAGIC);
        w.u64(self.opts.rank as u64)
            .u8(u8::from(self.q_ready))
            .f32s(&self.q)
            .f32s(&self.residual);
        w.finish()
    }

    /// Read a blob of [`LowRank::save`] from a bucket built alike.
    pub(crate) fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, LOW_RANK_MAGIC, "PowerSGD bucket")?;
        r.u64_eq("rank", self.opts.rank as u64)?;
        let ready = match r.u8()? {
            0 => false,
            1 => true,
            v => {
                return Err(Error::Checkpoint(format!(
                    "PowerSGD bucket: Q flag {v} is neither 0 nor 1"
                )));
            }
        };
        let mut q = self.q.clone();
        let mut residual = self.residual.clone();
        r.f32s_into(&mut q)?;
        r.f32s_into(&mut residual)?;
        r.end()?;
        self.q = q;
        self.residual = residual;
        self.q_ready = ready;
        Ok(())
    }
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

/// `out = P Q^T` (`n x m`) from the row-major `P` (`n x r`) and `Q` (`m x r`): element
/// `(a, b)` is `((P[a,0] Q[b,0] + P[a,1] Q[b,1]) + ...)` in f32, in that order and with
/// no fused multiply-add, so the same on every CPU. `qt` is scratch of at least `m r`.
/// With `residual = (M, e)`, also `e = M - out`, each row as it is made.
pub(crate) fn reconstruct(
    p: &[f32],
    q: &[f32],
    (n, m, r): (usize, usize, usize),
    qt: &mut [f32],
    out: &mut [f32],
    mut residual: Option<(&[f32], &mut [f32])>,
) {
    let qt = &mut qt[..m * r];
    for b in 0..m {
        for k in 0..r {
            qt[k * m + b] = q[b * r + k];
        }
    }
    for (a, row) in out.chunks_exact_mut(m.max(1)).take(n).enumerate() {
        let pa = &p[a * r..a * r + r];
        let q0 = &qt[..m];
        row.iter_mut().zip(q0).for_each(|(o, &q)| *o = pa[0] * q);
        for k in 1..r {
            let qk = &qt[k * m..(k + 1) * m];
            row.iter_mut().zip(qk).for_each(|(o, &q)| *o += pa[k] * q);
        }
        if let Some((x, e)) = residual.as_mut() {
            let (xr, er) = (&x[a * m..(a + 1) * m], &mut e[a * m..(a + 1) * m]);
            er.iter_mut()
                .zip(xr.iter().zip(row.iter()))
                .for_each(|(e, (&x, &y))| *e = x - y);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local;

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
        draw_q(&mut q0, seed(0));
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
    fn reconstruct_is_the_product_in_k_order() {
        let (n, m, r) = (3, 5, 2);
        let p: Vec<f32> = (0..n * r).map(|i| i as f32 * 0.5 - 1.0).collect();
        let q: Vec<f32> = (0..m * r).map(|i| 2.0 - i as f32 * 0.25).collect();
        let mut qt = vec![0f32; m * r];
        let mut out = vec![f32::NAN; n * m];
        reconstruct(&p, &q, (n, m, r), &mut qt, &mut out, None);
        for a in 0..n {
            for b in 0..m {
                let want = p[a * r] * q[b * r] + p[a * r + 1] * q[b * r + 1];
                assert_eq!(out[a * m + b].to_bits(), want.to_bits());
            }
        }
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
