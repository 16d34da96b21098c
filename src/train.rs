//! Data-parallel training of small models with compressed gradient exchange: what a codec
//! does to training, measured end to end.
//!
//! [`Dataset::synthetic`] generates a classification task from a seed; [`train`] runs
//! synchronous data-parallel SGD on it with `W` workers (threads on the in-process
//! transport), each computing the gradient of its own shard of every batch, handing each
//! parameter tensor's gradient (weights and biases of each layer, last layer first) to a
//! [`crate::sync::SyncEngine`] that all-reduces the mean with a codec (with or without
//! error feedback), and applying the same update. The collective's results are
//! bit-identical on every worker, so the replicas never drift (checked at the end).
//!
//! The task: 10 classes in 48 features. Each class is a mixture of 3 Gaussian clusters
//! whose centres are drawn at scale 0.45 (noise 1), so classes overlap and a linear model
//! cannot separate the clusters well; a one-hidden-layer MLP does better. The features
//! have scales `1, 1/2, 1/4, 1/8` (cycling), so gradient entries differ in size by more
//! than an order of magnitude, as in real networks: a code that sends every entry with
//! the same magnitude (sign) misweights them unless error feedback corrects it.
//!
//! `gradpack train` (CLI) prints the comparison and plots the loss curves;
//! `tests/training.rs` asserts what the literature expects on a fixed seed.

use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::{Feedback, ReduceOp, Strategy, Transport, local};
use crate::error::{Error, Result};
use crate::rng::draw;
use crate::sample::{normal, unit};
use crate::sync::{Policy, PowerSgd, SyncEngine, SyncOptions, Tensor};

/// A classification data set: row-major features and labels, split into train and test.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Features per sample.
    pub features: usize,
    /// Number of classes.
    pub classes: usize,
    /// Training features, `train_y.len() x features`.
    pub train_x: Vec<f32>,
    /// Training labels in `0..classes`.
    pub train_y: Vec<u32>,
    /// Test features.
    pub test_x: Vec<f32>,
    /// Test labels.
    pub test_y: Vec<u32>,
}

impl Dataset {
    /// The synthetic task of the module docs: 16384 training and 4096 test samples.
    pub fn synthetic(seed: u64) -> Dataset {
        Dataset::synthetic_sized(seed, 16384, 4096)
    }

    /// The synthetic task with chosen sizes.
    pub fn synthetic_sized(seed: u64, train: usize, test: usize) -> Dataset {
        const D: usize = 48;
        const C: usize = 10;
        const K: usize = 3;
        let s_centre = crate::rng::splitmix64(seed ^ 0xC3A5_C85C_97CB_3127);
        let s_sample = crate::rng::splitmix64(seed ^ 0xB492_B66F_BE98_F273);
        let centres: Vec<f64> = (0..C * K * D)
            .map(|i| 0.6 * normal(s_centre, i as u64, 0))
            .collect();
        let scale = |j: usize| 0.5f64.powi((j % 4) as i32);
        let make = |n: usize, base: u64| {
            let mut x = Vec::with_capacity(n * D);
            let mut y = Vec::with_capacity(n);
            for s in 0..n {
                let id = base + s as u64;
                let class = (draw(s_sample, 1, id) % C as u32) as usize;
                let cluster = (draw(s_sample, 2, id) % K as u32) as usize;
                let centre = &centres[(class * K + cluster) * D..][..D];
                for (j, c) in centre.iter().enumerate() {
                    let noise = normal(s_sample, id * D as u64 + j as u64, 0);
                    x.push(((c + noise) * scale(j)) as f32);
                }
                y.push(class as u32);
            }
            (x, y)
        };
        let (train_x, train_y) = make(train, 0);
        let (test_x, test_y) = make(test, 1 << 40);
        Dataset {
            features: D,
            classes: C,
            train_x,
            train_y,
            test_x,
            test_y,
        }
    }

    /// Training samples.
    pub fn train_len(&self) -> usize {
        self.train_y.len()
    }
}

/// The model trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// Softmax (multinomial logistic) regression: `classes x (features + 1)` parameters.
    Softmax,
    /// One hidden layer of `hidden` ReLU units, then softmax.
    Mlp {
        /// Hidden units.
        hidden: usize,
    },
}

impl ModelKind {
    /// Parameters for a data set of `d` features and `c` classes.
    pub fn params(self, d: usize, c: usize) -> usize {
        match self {
            ModelKind::Softmax => c * d + c,
            ModelKind::Mlp { hidden: h } => h * d + h + c * h + c,
        }
    }

    /// The parameter tensors for `d` features and `c` classes, with the element range
    /// each takes in the flat parameter vector, in the order the backward pass produces
    /// their gradients (last layer first).
    pub fn tensors(self, d: usize, c: usize) -> Vec<(Tensor, core::ops::Range<usize>)> {
        let mut flat = Vec::new();
        let mut at = 0;
        let mut push = |name: &str, shape: &[usize]| {
            let n: usize = shape.iter().product();
            flat.push((Tensor::new(name, shape), at..at + n));
            at += n;
        };
        match self {
            ModelKind::Softmax => {
                push("linear.weight", &[c, d]);
                push("linear.bias", &[c]);
            }
            ModelKind::Mlp { hidden: h } => {
                push("fc1.weight", &[h, d]);
                push("fc1.bias", &[h]);
                push("fc2.weight", &[c, h]);
                push("fc2.bias", &[c]);
            }
        }
        flat.reverse();
        flat
    }

    /// Short name (`softmax`, `mlp`).
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::Softmax => "softmax",
            ModelKind::Mlp { .. } => "mlp",
        }
    }

    /// Initial parameters: zeros for softmax; He-scaled normal weights for the MLP.
    pub fn init(self, d: usize, c: usize, seed: u64) -> Vec<f32> {
        let mut p = vec![0f32; self.params(d, c)];
        if let ModelKind::Mlp { hidden: h } = self {
            let s = crate::rng::splitmix64(seed ^ 0x9FB2_1C65_1E98_DF25);
            let (w1, rest) = p.split_at_mut(h * d);
            for (i, w) in w1.iter_mut().enumerate() {
                *w = (normal(s, i as u64, 0) * (2.0 / d as f64).sqrt()) as f32;
            }
            let w2 = &mut rest[h..h + c * h];
            for (i, w) in w2.iter_mut().enumerate() {
                *w = (normal(s, (h * d + i) as u64, 0) * (1.0 / h as f64).sqrt()) as f32;
            }
        }
        p
    }
}

/// Scratch for [`loss_grad`] (hidden activations and logits of one sample).
struct Scratch {
    h: Vec<f32>,
    z: Vec<f32>,
    dh: Vec<f32>,
}

/// Samples: `d` features, `c` classes, row-major features `x` and labels `y`.
#[derive(Clone, Copy)]
struct Samples<'a> {
    d: usize,
    c: usize,
    x: &'a [f32],
    y: &'a [u32],
}

/// Mean cross-entropy loss over the samples `idx`, and (if `grad` is given) its gradient
/// with respect to `p`, written to `grad`. Returns (loss, correct count, samples).
fn loss_grad(
    kind: ModelKind,
    p: &[f32],
    data: Samples<'_>,
    idx: &mut dyn Iterator<Item = usize>,
    mut grad: Option<&mut [f32]>,
) -> (f64, usize, usize) {
    let Samples { d, c, x, y } = data;
    let h = match kind {
        ModelKind::Softmax => 0,
        ModelKind::Mlp { hidden } => hidden,
    };
    let mut s = Scratch {
        h: vec![0.0; h],
        z: vec![0.0; c],
        dh: vec![0.0; h],
    };
    if let Some(g) = grad.as_deref_mut() {
        g.fill(0.0);
    }
    let (mut loss, mut correct, mut n) = (0f64, 0usize, 0usize);
    for i in idx {
        let xi = &x[i * d..][..d];
        let yi = y[i] as usize;
        // Forward.
        let (w_out, b_out, input): (&[f32], &[f32], &[f32]) = match kind {
            ModelKind::Softmax => (&p[..c * d], &p[c * d..], xi),
            ModelKind::Mlp { .. } => {
                let (w1, rest) = p.split_at(h * d);
                let (b1, rest) = rest.split_at(h);
                for k in 0..h {
                    let a = dot(&w1[k * d..][..d], xi) + b1[k];
                    s.h[k] = a.max(0.0);
                }
                let (w2, b2) = rest.split_at(c * h);
                (w2, b2, &s.h[..])
            }
        };
        let m = input.len();
        for k in 0..c {
            s.z[k] = dot(&w_out[k * m..][..m], input) + b_out[k];
        }
        let zmax = s.z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0f32;
        for z in s.z.iter_mut() {
            *z = (*z - zmax).exp();
            sum += *z;
        }
        let arg = (0..c)
            .max_by(|&a, &b| s.z[a].total_cmp(&s.z[b]))
            .unwrap_or(0);
        correct += usize::from(arg == yi);
        loss -= ((s.z[yi] / sum) as f64).max(1e-30).ln();
        n += 1;
        let Some(g) = grad.as_deref_mut() else {
            continue;
        };
        // Backward: dz = softmax - onehot.
        for (k, z) in s.z.iter_mut().enumerate() {
            *z = *z / sum - f32::from(k == yi);
        }
        let (g_out, g_rest) = match kind {
            ModelKind::Softmax => g.split_at_mut(c * d),
            ModelKind::Mlp { .. } => g[h * d + h..].split_at_mut(c * h),
        };
        for k in 0..c {
            axpy(s.z[k], input, &mut g_out[k * m..][..m]);
            g_rest[k] += s.z[k];
        }
        if let ModelKind::Mlp { .. } = kind {
            let w2 = &p[h * d + h..][..c * h];
            s.dh.fill(0.0);
            for k in 0..c {
                axpy(s.z[k], &w2[k * h..][..h], &mut s.dh);
            }
            let (g1, gb1) = g[..h * d + h].split_at_mut(h * d);
            for k in 0..h {
                if s.h[k] > 0.0 {
                    axpy(s.dh[k], xi, &mut g1[k * d..][..d]);
                    gb1[k] += s.dh[k];
                }
            }
        }
    }
    if let Some(g) = grad {
        let inv = 1.0 / n.max(1) as f32;
        g.iter_mut().for_each(|v| *v *= inv);
    }
    (loss / n.max(1) as f64, correct, n)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Loss and accuracy of parameters `p` on the test set.
pub fn evaluate(kind: ModelKind, ds: &Dataset, p: &[f32]) -> (f64, f64) {
    let n = ds.test_y.len();
    let data = Samples {
        d: ds.features,
        c: ds.classes,
        x: &ds.test_x,
        y: &ds.test_y,
    };
    let (loss, correct, _) = loss_grad(kind, p, data, &mut (0..n), None);
    (loss, correct as f64 / n.max(1) as f64)
}

/// A training run's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// The model.
    pub model: ModelKind,
    /// Simulated workers (ranks).
    pub workers: usize,
    /// Passes over the training set.
    pub epochs: usize,
    /// Samples per worker per step.
    pub batch: usize,
    /// Learning rate of plain SGD.
    pub lr: f32,
    /// Seed of the initial parameters, the batch order and the codecs' draws.
    pub seed: u64,
    /// The all-reduce strategy.
    pub strategy: Strategy,
    /// Send the weight matrices as PowerSGD factors (the codec then carries the biases,
    /// and the error-feedback switch of [`train`] is PowerSGD's own); `None` (default):
    /// every tensor with the codec.
    pub powersgd: Option<PowerSgd>,
    /// With a `dct` codec, send the weight matrices in 2-D tiles ([`Policy::dct_2d`]);
    /// default off.
    pub dct_2d: bool,
}

impl TrainConfig {
    /// The defaults for `model`: 4 workers, 8 epochs, 32 samples per worker per step,
    /// learning rate 0.1, seed 1, the all-gather strategy (each worker's gradient is
    /// compressed once, as in the papers).
    pub fn new(model: ModelKind) -> TrainConfig {
        TrainConfig {
            model,
            workers: 4,
            epochs: 8,
            batch: 32,
            lr: 0.1,
            seed: 1,
            strategy: Strategy::CompressedAllGather,
            powersgd: None,
            dct_2d: false,
        }
    }
}

/// One point of a loss curve, taken after each epoch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochPoint {
    /// Epochs done (1-based).
    pub epoch: usize,
    /// Mean training loss over the epoch's batches (worker 0's shard).
    pub train_loss: f64,
    /// Test loss.
    pub test_loss: f64,
    /// Test accuracy in [0, 1].
    pub test_accuracy: f64,
}

/// The outcome of one [`train`] run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainResult {
    /// The codec (`identity` for the fp32 baseline).
    pub codec: CodecSpec,
    /// The strategy run.
    pub strategy: Strategy,
    /// Whether error feedback was on.
    pub feedback: bool,
    /// PowerSGD's settings, if the weight matrices went as its factors.
    pub powersgd: Option<PowerSgd>,
    /// Whether the weight matrices went in 2-D `dct` tiles.
    pub dct_2d: bool,
    /// One point per epoch.
    pub curve: Vec<EpochPoint>,
    /// Bytes each worker sent over the whole run (the most any worker sent).
    pub bytes_per_worker: u64,
    /// Optimiser steps taken.
    pub steps: usize,
}

impl TrainResult {
    /// How the gradients went: the codec's spec (with ` 2-D` when the matrices went in
    /// 2-D `dct` tiles), or `powersgd:rank=R` (the biases then went with the codec).
    pub fn method(&self) -> String {
        match &self.powersgd {
            Some(p) => format!("powersgd:rank={}", p.rank),
            None if self.dct_2d => format!("{} 2-D", self.codec),
            None => self.codec.to_string(),
        }
    }

    /// The last epoch's point.
    pub fn last(&self) -> EpochPoint {
        *self.curve.last().expect("at least one epoch")
    }
}

/// Train `cfg.model` on `ds` with `cfg.workers` data-parallel workers exchanging
/// gradients with `codec` (use [`Strategy::Fp32Ring`] in `cfg.strategy` for the exact
/// baseline) and, if `feedback`, error feedback at worker and owner.
///
/// Every step: each worker takes the next `cfg.batch` samples of its shard of a shuffled
/// epoch, computes its mean gradient, the workers all-reduce the mean with the codec,
/// and each applies `params -= lr * mean`. Errors if the codec refuses error feedback, a
/// worker fails, or the replicas' parameters differ at the end.
pub fn train(
    ds: &Dataset,
    cfg: &TrainConfig,
    codec: CodecSpec,
    feedback: bool,
) -> Result<TrainResult> {
    let (d, c, w, b) = (
        ds.features,
        ds.classes,
        cfg.workers.max(1),
        cfg.batch.max(1),
    );
    if cfg.model == (ModelKind::Mlp { hidden: 0 }) {
        return Err(Error::Collective(
            "an MLP needs at least one hidden unit (with none it is a model of biases only)".into(),
        ));
    }
    let n_params = cfg.model.params(d, c);
    let steps_per_epoch = ds.train_len() / (w * b);
    if steps_per_epoch == 0 {
        return Err(Error::Collective(format!(
            "{} training samples cannot fill one step of {w} workers x {b}",
            ds.train_len()
        )));
    }
    let tensors = cfg.model.tensors(d, c);
    let layout: Vec<Tensor> = tensors.iter().map(|(t, _)| t.clone()).collect();
    let powersgd = cfg.powersgd.map(|p| PowerSgd { feedback, ..p });
    let codec_feedback =
        feedback && !(powersgd.is_some() && codec == CodecSpec::Identity(Identity));
    let opts = SyncOptions {
        // Every tensor with the codec (these layers are far below the size where a
        // real model would send them uncompressed: compare codecs, not policies), or
        // the matrices as PowerSGD factors.
        policy: Policy {
            powersgd,
            dct_2d: cfg.dct_2d,
            ..Policy::uniform(codec)
        },
        op: ReduceOp::Mean,
        strategy: Some(cfg.strategy),
        feedback: if codec_feedback {
            Feedback::WorkerAndOwner
        } else {
            Feedback::None
        },
        seed: cfg.seed,
        ..Default::default()
    };
    let results = local::run(w, Some(core::time::Duration::from_secs(600)), |comm| {
        let rank = comm.rank();
        let mut sync = SyncEngine::new(&layout, comm.into_inner(), opts.clone())?;
        let strategy = sync
            .plan()
            .buckets
            .first()
            .map_or(cfg.strategy, |b| b.strategy);
        let mut params = cfg.model.init(d, c, cfg.seed);
        let mut grad = vec![0f32; n_params];
        let mut order: Vec<usize> = (0..ds.train_len()).collect();
        let mut curve = Vec::with_capacity(cfg.epochs);
        let mut sent = 0u64;
        for epoch in 0..cfg.epochs {
            shuffle(
                &mut order,
                cfg.seed ^ (epoch as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
            );
            let mut train_loss = 0f64;
            for s in 0..steps_per_epoch {
                let start = s * w * b + rank * b;
                let data = Samples {
                    d,
                    c,
                    x: &ds.train_x,
                    y: &ds.train_y,
                };
                let batch = &mut order[start..start + b].iter().copied();
                let (loss, _, _) = loss_grad(cfg.model, &params, data, batch, Some(&mut grad));
                train_loss += loss;
                for (i, (_, range)) in tensors.iter().enumerate() {
                    sync.ready(i, &grad[range.clone()])?;
                }
                sent += sync.finish()?.bytes_sent;
                for (i, (_, range)) in tensors.iter().enumerate() {
                    let mean = sync.grad(i)?;
                    for (p, g) in params[range.clone()].iter_mut().zip(mean) {
                        *p -= cfg.lr * g;
                    }
                }
            }
            let (test_loss, test_accuracy) = if rank == 0 {
                evaluate(cfg.model, ds, &params)
            } else {
                (0.0, 0.0)
            };
            curve.push(EpochPoint {
                epoch: epoch + 1,
                train_loss: train_loss / steps_per_epoch as f64,
                test_loss,
                test_accuracy,
            });
        }
        Ok((curve, sent, params, strategy))
    });
    let mut out: Option<TrainResult> = None;
    let mut first_params: Option<Vec<f32>> = None;
    let mut bytes = 0u64;
    for (rank, r) in results.into_iter().enumerate() {
        let (curve, sent, params, strategy) = r?;
        bytes = bytes.max(sent);
        match &first_params {
            None => first_params = Some(params),
            Some(p0) => {
                if p0
                    .iter()
                    .zip(&params)
                    .any(|(a, b)| a.to_bits() != b.to_bits())
                {
                    return Err(Error::Collective(format!(
                        "worker {rank}'s parameters differ from worker 0's after training"
                    )));
                }
            }
        }
        if rank == 0 {
            out = Some(TrainResult {
                codec: if strategy == Strategy::Fp32Ring {
                    "identity".parse().expect("identity spec")
                } else {
                    codec
                },
                strategy,
                feedback,
                powersgd,
                dct_2d: cfg.dct_2d && matches!(codec, CodecSpec::Dct(d) if d.width() == 0),
                curve,
                bytes_per_worker: 0,
                steps: steps_per_epoch * cfg.epochs,
            });
        }
    }
    let mut out = out.expect("rank 0 ran");
    out.bytes_per_worker = bytes;
    Ok(out)
}

/// Fisher-Yates shuffle from the crate's hash.
fn shuffle(v: &mut [usize], seed: u64) {
    for i in (1..v.len()).rev() {
        let j = (unit(seed, i as u64, 0) * (i + 1) as f64) as usize;
        v.swap(i, j.min(i));
    }
}
