//! What the digits example and the tests share: the data set, the model and one worker's
//! training loop.

#![allow(dead_code)]

use std::io::Read;
use std::sync::Mutex;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, Optimizer, SgdConfig, momentum::MomentumConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use gradpack::collective::Transport;
use gradpack::sync::SyncOptions;
use gradpack_burn::{DiLoCo, GradSync, OuterOptions};

/// The backend: burn's CPU backend with autodiff.
pub type TB = Autodiff<NdArray<f32>>;

/// The 8x8 digits of Alpaydin and Kaynak (UCI), as scikit-learn ships them: 1797 images of
/// 64 pixels in 0..=16 and their labels. 1437 train and 360 test images, split by a fixed
/// permutation.
pub struct Digits {
    pub train_x: Vec<f32>,
    pub train_y: Vec<i64>,
    pub test_x: Vec<f32>,
    pub test_y: Vec<i64>,
}

pub fn digits() -> Digits {
    let gz = include_bytes!("../../data/digits.csv.gz");
    let mut csv = String::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_string(&mut csv)
        .expect("data/digits.csv.gz is a gzipped CSV");
    let mut rows: Vec<(Vec<f32>, i64)> = csv
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Vec<f32> = l.split(',').map(|s| s.trim().parse().unwrap()).collect();
            assert_eq!(v.len(), 65, "64 pixels and a label per row");
            (v[..64].iter().map(|p| p / 16.0).collect(), v[64] as i64)
        })
        .collect();
    assert_eq!(rows.len(), 1797);
    // A fixed permutation (an LCG drives Fisher-Yates) so train and test mix all writers.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    for i in (1..rows.len()).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rows.swap(i, (s >> 33) as usize % (i + 1));
    }
    let (train, test) = rows.split_at(1437);
    let flat = |r: &[(Vec<f32>, i64)]| -> (Vec<f32>, Vec<i64>) {
        (
            r.iter().flat_map(|(x, _)| x.clone()).collect(),
            r.iter().map(|(_, y)| *y).collect(),
        )
    };
    let (train_x, train_y) = flat(train);
    let (test_x, test_y) = flat(test);
    Digits {
        train_x,
        train_y,
        test_x,
        test_y,
    }
}

/// A perceptron with two hidden layers.
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
    fc3: Linear<B>,
    act: Relu,
}

impl<B: Backend> Mlp<B> {
    pub fn new(hidden: usize, device: &B::Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(64, hidden).init(device),
            fc2: LinearConfig::new(hidden, hidden).init(device),
            fc3: LinearConfig::new(hidden, 10).init(device),
            act: Relu::new(),
        }
    }
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.act.forward(self.fc1.forward(x));
        self.fc3.forward(self.act.forward(self.fc2.forward(h)))
    }
}

/// Burn's CPU backend seeds one global generator: workers make their models one at a
/// time from the same seed, so they all start from the same weights.
static INIT: Mutex<()> = Mutex::new(());

pub fn model(hidden: usize, seed: u64) -> Mlp<TB> {
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let device = Default::default();
    TB::seed(&device, seed);
    let m = Mlp::<TB>::new(hidden, &device);
    // Parameters are initialised lazily: touch them all while the seed is ours.
    let _ = gradpack_burn::layout::<TB, _>(&m);
    m
}

/// Every parameter's bits, in visiting order.
pub fn param_bits(m: &Mlp<TB>) -> Vec<u32> {
    let mut out = Vec::new();
    for t in [&m.fc1.weight, &m.fc2.weight, &m.fc3.weight].map(|w| w.val().into_data()) {
        out.extend(t.as_slice::<f32>().unwrap().iter().map(|v| v.to_bits()));
    }
    for b in [&m.fc1.bias, &m.fc2.bias, &m.fc3.bias]
        .into_iter()
        .flatten()
    {
        out.extend(
            b.val()
                .into_data()
                .as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits()),
        );
    }
    out
}

/// Test accuracy of `m`.
pub fn accuracy(m: &Mlp<TB>, d: &Digits) -> f64 {
    let device = Default::default();
    let n = d.test_y.len();
    let x = Tensor::<TB, 2>::from_data(TensorData::new(d.test_x.clone(), [n, 64]), &device);
    let pred = m.forward(x).argmax(1).into_data().convert::<i64>();
    let pred = pred.as_slice::<i64>().unwrap();
    pred.iter().zip(&d.test_y).filter(|(p, y)| p == y).count() as f64 / n as f64
}

/// One training run's configuration.
#[derive(Clone)]
pub struct RunConfig {
    pub hidden: usize,
    pub steps: usize,
    pub batch: usize,
    pub lr: f64,
    pub seed: u64,
    /// Return a [`Checkpoint`] after the last step.
    pub checkpoint: bool,
}

/// What one worker saw.
pub struct WorkerResult {
    pub losses: Vec<f32>,
    /// A hash of the parameters after every step.
    pub param_hashes: Vec<u64>,
    pub accuracy: f64,
    pub step_s: f64,
    pub bytes_sent: u64,
    /// Gradient elements the plan sends through a codec other than fp32, or as PowerSGD
    /// factors.
    pub compressed_elements: usize,
    /// The worker's state after its last step, when the run asked for one.
    pub checkpoint: Option<Checkpoint>,
}

/// Everything a worker needs to continue training where it stopped: the model's and the
/// optimizer's records (burn's bincode recorder) and the sync state ([`GradSync::save`]).
#[derive(Clone)]
pub struct Checkpoint {
    /// The next step to run.
    pub step: usize,
    pub model: Vec<u8>,
    pub optim: Vec<u8>,
    /// `None` leaves the sync state fresh (to show what losing it costs).
    pub sync: Option<Vec<u8>>,
}

type Rec = BinBytesRecorder<FullPrecisionSettings>;

fn record_err(e: burn::record::RecorderError) -> gradpack_burn::Error {
    gradpack_burn::Error::Data(format!("checkpoint: {e}"))
}

fn hash(bits: &[u32]) -> u64 {
    bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// A fresh model and optimizer of `cfg`, or those of `resume`: SGD with momentum 0.9,
/// or without momentum where the sync engine keeps it (`corrected`: its momentum
/// correction, which must not be applied twice).
fn start(
    cfg: &RunConfig,
    resume: Option<&Checkpoint>,
    corrected: bool,
) -> gradpack_burn::Result<(Mlp<TB>, impl Optimizer<Mlp<TB>, TB>)> {
    let device = Default::default();
    let mut model = model(cfg.hidden, cfg.seed);
    let momentum = (!corrected).then(|| MomentumConfig::new().with_momentum(0.9));
    let mut optim = SgdConfig::new()
        .with_momentum(momentum)
        .init::<TB, Mlp<TB>>();
    if let Some(c) = resume {
        model = model.load_record(
            Rec::default()
                .load(c.model.clone(), &device)
                .map_err(record_err)?,
        );
        optim = optim.load_record(
            Rec::default()
                .load(c.optim.clone(), &device)
                .map_err(record_err)?,
        );
    }
    Ok((model, optim))
}

/// The checkpoint after step `cfg.steps`: the model's and optimizer's records and the
/// sync state.
fn checkpoint(
    cfg: &RunConfig,
    model: &Mlp<TB>,
    optim: &impl Optimizer<Mlp<TB>, TB>,
    sync: Vec<u8>,
) -> gradpack_burn::Result<Checkpoint> {
    Ok(Checkpoint {
        step: cfg.steps,
        model: Rec::default()
            .record(model.clone().into_record(), ())
            .map_err(record_err)?,
        optim: Rec::default()
            .record(optim.to_record(), ())
            .map_err(record_err)?,
        sync: Some(sync),
    })
}

/// A trained model, its losses, parameter hashes and seconds per step.
type Trained = (Mlp<TB>, Vec<f32>, Vec<u64>, f64);

/// Train on `rank`'s share of every batch from the checkpoint's step (or 0) to
/// `cfg.steps`, `update` turning each step's gradients into the next model; the model,
/// the losses, a hash of the parameters after every step, and seconds per step.
#[allow(clippy::too_many_arguments)]
fn train_loop<O: Optimizer<Mlp<TB>, TB>>(
    mut model: Mlp<TB>,
    optim: &mut O,
    d: &Digits,
    cfg: &RunConfig,
    rank: usize,
    world: usize,
    resume: Option<&Checkpoint>,
    mut update: impl FnMut(Mlp<TB>, GradientsParams, &mut O) -> gradpack_burn::Result<Mlp<TB>>,
) -> gradpack_burn::Result<Trained> {
    let device = Default::default();
    let first = resume.map_or(0, |c| c.step);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let (mut losses, mut hashes) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for step in first..cfg.steps {
        let (x, y) = batch(d, step, rank, world, cfg.batch);
        let loss = loss_fn.forward(model.forward(x), y);
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = update(model, grads, optim)?;
        hashes.push(hash(&param_bits(&model)));
    }
    let step_s = start.elapsed().as_secs_f64() / cfg.steps.saturating_sub(first).max(1) as f64;
    Ok((model, losses, hashes, step_s))
}

/// Step `step`'s global batch, from a hash of the step: `rank`'s share of it.
fn batch(
    d: &Digits,
    step: usize,
    rank: usize,
    world: usize,
    batch: usize,
) -> (Tensor<TB, 2>, Tensor<TB, 1, Int>) {
    let device = Default::default();
    let n = d.train_y.len();
    let idx: Vec<usize> = (0..batch * world)
        .map(|j| {
            let h = (step as u64 * 0x9e37_79b9_7f4a_7c15 + j as u64)
                .wrapping_mul(0xbf58_476d_1ce4_e5b9);
            ((h ^ (h >> 31)) % n as u64) as usize
        })
        .skip(rank * batch)
        .take(batch)
        .collect();
    let xs: Vec<f32> = idx
        .iter()
        .flat_map(|&i| d.train_x[64 * i..64 * i + 64].iter().copied())
        .collect();
    let ys: Vec<i64> = idx.iter().map(|&i| d.train_y[i]).collect();
    (
        Tensor::<TB, 2>::from_data(TensorData::new(xs, [batch, 64]), &device),
        Tensor::<TB, 1, Int>::from_data(TensorData::new(ys, [batch]), &device),
    )
}

/// Train on `rank`'s share of every batch up to step `cfg.steps`, syncing gradients over
/// `transport`; from step 0, or from `resume`.
pub fn worker<T: Transport + Send + 'static>(
    transport: T,
    rank: usize,
    world: usize,
    d: &Digits,
    cfg: &RunConfig,
    opts: SyncOptions,
    resume: Option<&Checkpoint>,
) -> gradpack_burn::Result<WorkerResult> {
    let (model, mut optim) = start(cfg, resume, opts.momentum != 0.0)?;
    let mut sync = GradSync::new(&model, transport, opts)?;
    if let Some(blob) = resume.and_then(|c| c.sync.as_ref()) {
        sync.restore(blob)?;
    }
    let mut bytes = 0;
    let (model, losses, hashes, step_s) = train_loop(
        model,
        &mut optim,
        d,
        cfg,
        rank,
        world,
        resume,
        |model, grads, optim| {
            let grads = sync.sync(&model, grads)?;
            bytes += sync.last_stats().map_or(0, |s| s.bytes_sent);
            Ok(optim.step(cfg.lr, model, grads))
        },
    )?;
    let checkpoint = if cfg.checkpoint {
        Some(checkpoint(cfg, &model, &optim, sync.save()?)?)
    } else {
        None
    };
    Ok(WorkerResult {
        losses,
        param_hashes: hashes,
        accuracy: accuracy(&model, d),
        step_s,
        bytes_sent: bytes,
        compressed_elements: sync
            .plan()
            .buckets
            .iter()
            .filter(|b| {
                b.low_rank.is_some() || !matches!(b.codec, gradpack::CodecSpec::Identity(_))
            })
            .map(|b| b.elements)
            .sum(),
        checkpoint,
    })
}

/// As [`worker`], with no gradient sync: each worker trains alone and [`DiLoCo`] syncs
/// the outer parameters by `opts`. The result's `compressed_elements` is 0.
pub fn diloco_worker<T: Transport + Send + 'static>(
    transport: T,
    rank: usize,
    world: usize,
    d: &Digits,
    cfg: &RunConfig,
    opts: OuterOptions,
    resume: Option<&Checkpoint>,
) -> gradpack_burn::Result<WorkerResult> {
    let (model, mut optim) = start(cfg, resume, false)?;
    let mut diloco = DiLoCo::new(&model, transport, opts)?;
    if let Some(blob) = resume.and_then(|c| c.sync.as_ref()) {
        diloco.restore(blob)?;
    }
    let (model, losses, hashes, step_s) = train_loop(
        model,
        &mut optim,
        d,
        cfg,
        rank,
        world,
        resume,
        |model, grads, optim| {
            let model = optim.step(cfg.lr, model, grads);
            diloco.step(model)
        },
    )?;
    let checkpoint = if cfg.checkpoint {
        Some(checkpoint(cfg, &model, &optim, diloco.save()?)?)
    } else {
        None
    };
    Ok(WorkerResult {
        losses,
        param_hashes: hashes,
        accuracy: accuracy(&model, d),
        step_s,
        bytes_sent: diloco.bytes_sent(),
        compressed_elements: 0,
        checkpoint,
    })
}
