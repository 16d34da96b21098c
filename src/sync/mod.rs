//! Whole-model gradient sync: the tensors of a model, bucketed, each bucket compressed
//! and all-reduced as soon as its last gradient is ready, on a communication thread.
//!
//! A [`SyncEngine`] is built from the model's parameter list (name and shape of each
//! [`Tensor`], in the order their gradients become ready in the backward pass: last
//! layer first), a [`Transport`], and [`SyncOptions`]: a codec [`Policy`] (one codec; or
//! per-tensor rules that send biases and small tensors uncompressed; or `auto`, the
//! fastest codec per bucket by the cost model on a declared [`Network`]), bucket caps
//! (25 MiB, the first 1 MiB, as PyTorch DDP), error feedback and the reduce op (mean by
//! default). It owns the flat bucket buffers, the residuals and the seeds (each bucket
//! and step draws from its own seed, mixed with the rank where the codec needs it), so a
//! caller cannot get them wrong.
//!
//! ```
//! use gradpack::collective::local;
//! use gradpack::sync::{Policy, SyncEngine, SyncOptions, Tensor};
//!
//! let layout = vec![Tensor::new("fc2.bias", &[10]), Tensor::new("fc2.weight", &[10, 64]),
//!                   Tensor::new("fc1.bias", &[64]), Tensor::new("fc1.weight", &[64, 784])];
//! let results = local::run(2, None, |comm| {
//!     let opts = SyncOptions { policy: Policy::with_rules("int8".parse()?), ..Default::default() };
//!     let mut engine = SyncEngine::new(&layout, comm.into_inner(), opts)?;
//!     for _step in 0..3 {
//!         // During the backward pass, as each gradient is ready:
//!         for (i, t) in layout.iter().enumerate() {
//!             let grad = vec![0.5f32; t.len()?];
//!             engine.ready(i, &grad)?; // a full bucket starts its all-reduce at once
//!         }
//!         engine.finish()?; // wait for every bucket
//!         let mean_fc1 = engine.grad(3)?; // the reduced gradient of fc1.weight
//!         assert_eq!(mean_fc1.len(), 64 * 784);
//!     }
//!     Ok(engine.grad(0)?.to_vec())
//! });
//! assert!(results.iter().all(|r| r.is_ok()));
//! # Ok::<(), gradpack::Error>(())
//! ```
//!
//! ## Order and faults
//! Buckets are reduced in plan order on every rank, whatever order the tensors arrive
//! in (a bucket waits for every earlier one to start), so no interleaving of arrivals
//! can deadlock. Each bucket is one call of a [`crate::collective::AllReduce`] on the
//! engine's [`Comm`] (see [`crate::collective`] for what binds messages to their call).
//! When a bucket fails, the step's later buckets are skipped (their call numbers still
//! taken, so ranks stay in step), and [`SyncEngine::finish`] returns the error; a peer
//! that fails or leaves is an error on every other rank within the transport's timeout,
//! never a hang or a panic. To go on: [`SyncEngine::reset_feedback`], then the next
//! step.
//!
//! ## PowerSGD
//! With [`Policy::powersgd`] (or the `powersgd` field of any policy), every matrix
//! that PowerSGD compresses enough goes in buckets of its own, sent as rank-`r` factors
//! (see [`PowerSgd`]): per bucket, one all-reduce of every matrix's `P = M Q` and one of
//! every `Q = M^T P`, so small matrices share their latency. Error feedback and the
//! warm-start `Q` are the engine's state, saved and restored with it. Every rank computes
//! the same result bit for bit on any CPU: what depends on the CPU (the products) only
//! ever feeds an all-reduce. A framework that runs its own collectives uses the same
//! arithmetic through [`PowerSgdBucket`].
//!
//! ## A framework's own buckets
//! A framework that forms its buckets itself (PyTorch DDP, which regroups them after the
//! first step) keeps per-tensor state by name rather than by engine slot:
//! [`ModelSelection`] is one top-k over every compressed tensor of a step's buckets, its
//! error feedback kept by tensor name; [`Momentum`] is momentum correction by tensor
//! name, with the engine's arithmetic. The PyTorch hook runs both. Their state, with
//! [`TensorGather`]'s and [`PowerSgdByName`]'s, saves as one [`NamedState`], which any
//! front end restores.
//!
//! ## 2-D `dct`
//! With [`Policy::dct_2d`] and a fixed `dct` codec of `width=0`, each matrix goes in a
//! bucket of its own whose codec has the matrix's row length as `width`, so the DCT
//! runs in `chunk x chunk` tiles of the matrix (DeMo's chunking along every dimension).
//!
//! ## State
//! [`SyncEngine::save`] writes the step counter, the plan and every residual to one
//! checksummed blob (see [`crate::state`]); [`SyncEngine::restore`] reads it into an
//! engine built with the same layout and options, which then continues bit-identically
//! to one that never stopped. A blob of another layout or plan, or a damaged one, is
//! refused.

mod defaults;
mod gather;
mod lowrank;
mod model;
mod momentum;
mod named;
mod plan;
mod powersgd;
mod reducer;
mod tune;

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub use plan::{
    BucketPlan, CodecChoice, LowRankPlan, Network, Plan, Policy, PowerSgd, SMALL_TENSOR, Tensor,
    calibrate,
};

pub use defaults::{default_strategy, wants_feedback};
pub use gather::TensorGather;
pub use lowrank::{MatrixState, PowerSgdByName, step_seed};
pub use model::{HeldTensor, MODEL_KEY, ModelSelection};
pub use momentum::Momentum;
pub use named::NamedState;
use plan::{Kind, Reduces};
use powersgd::LowRank;
pub use powersgd::PowerSgdBucket;
pub use reducer::{BucketReducer, BucketTurn, Connector, Decision, ReducerOptions, Way};
pub use tune::{BucketConfig, Route, TrialRow, TuneOptions, Tuner, Turn, tensor_codec};

use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::comm::setting;
use crate::collective::{
    AllReduce, AllReduceOptions, Comm, Feedback, Hierarchical, Nodes, ReduceOp, Stats, Strategy,
    StrategyChoice, Transport,
};
use crate::cost::CodecProfile;
use crate::error::{Error, Result};
use crate::feedback::FeedbackOptions;
use crate::state::{BlobReader, BlobWriter};

const ENGINE_MAGIC: [u8; 4] = *b"GPSE";
const NODES_MAGIC: [u8; 4] = *b"GPHA";

/// Options of a [`SyncEngine`]. Every rank must use the same: the first bucket checks it
/// (one agreement of the ranks' settings before it), and a rank made with another value
/// fails every step on every rank, with an error naming the option.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncOptions {
    /// Which codec each tensor gets.
    pub policy: Policy,
    /// Bytes of f32 gradient per bucket (default 25 MiB). A sparse codec (top-k) selects
    /// over a whole bucket: with this and `first_bucket_cap_bytes` at `usize::MAX`,
    /// every compressed tensor goes in one bucket, reduced once the last of them is
    /// ready, so the selection (and its error feedback) is over the whole model, as the
    /// PyTorch hook's `selection="model"`.
    pub bucket_cap_bytes: usize,
    /// Bytes of the first bucket (default 1 MiB), so the first all-reduce starts early.
    pub first_bucket_cap_bytes: usize,
    /// Sum or mean (default mean).
    pub op: ReduceOp,
    /// Error feedback (default none).
    pub feedback: Feedback,
    /// Error-feedback weights and residual precision.
    pub feedback_options: FeedbackOptions,
    /// The network plans and strategies are modelled for.
    pub network: Network,
    /// Seal frames with a payload checksum (default on; see
    /// [`AllReduceOptions::checksum`]).
    pub checksum: bool,
    /// Seed of every step's random draws (each bucket and step derives its own).
    pub seed: u64,
    /// Reduce buckets on a communication thread as they fill (default). Off: every
    /// bucket is reduced in [`SyncEngine::finish`], after the backward pass.
    pub overlap: bool,
    /// Pieces per ring chunk (a pipelined ring: [`AllReduceOptions::pieces`]); default
    /// 1. With more, a bucket's encoding and decoding overlap its transfers.
    pub pieces: usize,
    /// The strategy of every bucket whose codec is not fp32 (`None`, the default: the
    /// fastest by the cost model for each bucket).
    pub strategy: Option<Strategy>,
    /// The ranks' nodes: with a map, every bucket that is not PowerSGD's goes by the
    /// two-level all-reduce ([`crate::collective::Hierarchical`]): f32 (or
    /// [`SyncOptions::node_codec`]) inside a node, the bucket's codec and strategy between
    /// nodes, where error feedback applies. `network` is then the link between nodes.
    /// Default `None`: every rank a peer.
    pub nodes: Option<Nodes>,
    /// The codec inside a node with `nodes`: identity (f32, the default), bf16 or fp16.
    pub node_codec: CodecSpec,
    /// The link between ranks of a node, with `nodes`. Given, the planner models every
    /// bucket both ways (the flat all-reduce over `network`, and the two-level one) and
    /// reduces each by the faster ([`BucketPlan::by_node`]); `None` (the default): every
    /// bucket that is not PowerSGD's goes by node.
    pub node_network: Option<Network>,
    /// Momentum correction (deep gradient compression's), in `[0, 1)`; default 0, off.
    /// The engine keeps a velocity per tensor, `u = momentum * u + g` in f32 as each
    /// gradient is given, and all-reduces `u` where it would have all-reduced `g`:
    /// compression and error feedback then act on the update momentum SGD applies, so
    /// what a lossy codec delays is not also missing from the optimizer's momentum. Give
    /// the optimizer no momentum of its own (it would be applied twice): with f32 the
    /// reduced velocities are momentum SGD's (`dampening = 0`, not Nesterov). The
    /// velocities are part of [`SyncEngine::save`]; a failed step's gradients stay in
    /// them.
    pub momentum: f32,
    /// The steps before this one (counted from 0) all-reduce every bucket in f32 (the
    /// float32 ring); compression, error feedback and PowerSGD begin at it (default 0:
    /// from the first step). Error feedback delays early updates, when gradients are
    /// largest and change fastest: deep gradient compression warms up so, and PyTorch's
    /// PowerSGD hook by `start_powerSGD_iter`.
    pub start_step: u64,
    /// Measured `auto`: with [`CodecChoice::Auto`], how many of the configurations
    /// (codec and route) the cost model ranks fastest for each bucket are measured
    /// against float32 on the real bucket, [`SyncOptions::trial_steps`] steps each,
    /// before every rank keeps the fastest, never one measured slower than float32 (see
    /// [`Tuner`], which decides for the PyTorch hook too). Default 0: the model's pick,
    /// unmeasured. The routes tried are the all-gather and the ring (or
    /// [`SyncOptions::strategy`] alone) and, with [`SyncOptions::nodes`], the two-level
    /// all-reduce. The decided plan is part of [`SyncEngine::save`]; [`SyncEngine::plan`]
    /// shows each bucket's decision once made, and [`SyncEngine::trials`] every
    /// configuration tried with its modelled and measured times.
    pub trials: usize,
    /// Steps each configuration runs while measured, the best of them counting
    /// (default 2).
    pub trial_steps: usize,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions {
            policy: Policy::uniform(CodecSpec::Identity(Identity)),
            bucket_cap_bytes: 25 << 20,
            first_bucket_cap_bytes: 1 << 20,
            op: ReduceOp::Mean,
            feedback: Feedback::None,
            feedback_options: FeedbackOptions::default(),
            network: Network::default(),
            checksum: true,
            seed: 0,
            overlap: true,
            pieces: 1,
            strategy: None,
            nodes: None,
            node_codec: CodecSpec::Identity(Identity),
            node_network: None,
            momentum: 0.0,
            start_step: 0,
            trials: 0,
            trial_steps: 2,
        }
    }
}

/// What one step of a [`SyncEngine`] did on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepStats {
    /// Bytes this rank sent (envelopes and frames).
    pub bytes_sent: u64,
    /// Messages this rank sent.
    pub messages: u64,
    /// Buckets reduced.
    pub buckets: usize,
}

/// How one bucket is reduced, with its state.
#[derive(Clone)]
enum Reducer {
    /// One all-reduce of the bucket with its codec.
    Flat(Box<AllReduce>),
    /// One two-level all-reduce of the bucket.
    Nodes(Box<Hierarchical>),
    /// PowerSGD's factors.
    LowRank(Box<LowRank>),
}

impl Reducer {
    fn run<T: Transport>(
        &mut self,
        comm: &mut Comm<T>,
        step: u64,
        input: &mut [f32],
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        match self {
            Reducer::Flat(ar) => ar.run(comm, input, output, seed),
            Reducer::Nodes(h) => h.run(comm, input, output, seed),
            Reducer::LowRank(lr) => lr.run(comm, step, input, output, seed),
        }
    }

    fn reset(&mut self) {
        match self {
            Reducer::Flat(ar) => ar.reset_feedback(),
            Reducer::Nodes(h) => h.reset_feedback(),
            Reducer::LowRank(lr) => lr.reset(),
        }
    }

    fn save(&self) -> Vec<u8> {
        match self {
            Reducer::Flat(ar) => ar.save(),
            Reducer::Nodes(h) => {
                let mut w = BlobWriter::new(NODES_MAGIC);
                let streams = h.save();
                w.u64(streams.len() as u64);
                streams.iter().for_each(|b| {
                    w.bytes(b);
                });
                w.finish()
            }
            Reducer::LowRank(lr) => lr.save(),
        }
    }

    fn restore(&mut self, blob: &[u8]) -> Result<()> {
        match self {
            Reducer::Flat(ar) => ar.restore(blob),
            Reducer::Nodes(h) => {
                let mut r = BlobReader::open(blob, NODES_MAGIC, "two-level all-reduce")?;
                let streams = (0..r.u64()?)
                    .map(|_| r.bytes().map(<[u8]>::to_vec))
                    .collect::<Result<Vec<_>>>()?;
                r.end()?;
                h.restore(&streams)
            }
            Reducer::LowRank(lr) => lr.restore(blob),
        }
    }
}

/// The state on the communication side: the `Comm` and one reducer per bucket.
struct Worker<T: Transport> {
    comm: Comm<T>,
    ars: Vec<Reducer>,
    /// Before [`SyncOptions::start_step`]: per bucket, its f32 all-reduce (made when
    /// first needed, dropped at the start step), and how to make one.
    warm: Vec<Option<AllReduce>>,
    warm_until: u64,
    warm_opts: AllReduceOptions,
    /// The step whose buckets are being skipped after a failure.
    failed_step: Option<u64>,
    /// The settings to agree on before the first bucket (then `None`).
    agree: Option<String>,
    /// Measured auto, with [`SyncOptions::trials`].
    measure: Option<Measure>,
}

/// Measured auto ([`SyncOptions::trials`]) on the communication side: the tuner (shared
/// with the caller's side, which shows its plan), each measured bucket's tensors, and
/// the reducers of the configurations being measured.
struct Measure {
    tuner: Arc<Mutex<Tuner>>,
    /// Per bucket: its tensors, if its configuration is measured.
    tensors: Vec<Option<Vec<Tensor>>>,
    /// Per bucket: the decided configuration its reducer runs, once installed.
    installed: Vec<Option<BucketConfig>>,
    /// The reducers of the configurations being measured, by bucket.
    trying: Vec<(usize, BucketConfig, Reducer)>,
    /// Options of every reducer it makes (strategy, tag and pieces set per reducer).
    base: AllReduceOptions,
    node_codec: CodecSpec,
    nodes: Option<Nodes>,
}

/// `model` with each measured bucket's decision in `tuner`, once made, written into it.
fn decided_plan(model: &Plan, tensors: &[Tensor], tuner: &Tuner) -> Plan {
    let mut plan = model.clone();
    let size = plan.nodes;
    for bp in &mut plan.buckets {
        let Some(first) = bp.tensors.first() else {
            continue;
        };
        let Some(c) = tuner.choice_of(&tensors[*first].name) else {
            continue;
        };
        let Ok(codec) = codec_of(c) else { continue };
        let ts: Vec<Tensor> = bp.tensors.iter().map(|&i| tensors[i].clone()).collect();
        bp.codec = codec;
        bp.strategy = strategy_of(c, &codec);
        bp.by_node = c.route == Route::Hierarchical;
        bp.modelled_s = tuner
            .modelled(&codec, c.route, &ts, None)
            .unwrap_or(bp.modelled_s);
        bp.wire_bytes = plan::bucket_cost(
            &codec,
            bp.strategy,
            None,
            size,
            &model.network,
            Reduces::One(bp.elements),
            model.pieces,
        )
        .1;
    }
    plan
}

/// The envelope tag of the ranks' sharing of measured times.
const TUNE_TAG: u32 = u32::MAX - 1;

/// The tuner, locked (a panic while locked leaves calls that completed or failed whole).
fn lock(t: &Mutex<Tuner>) -> std::sync::MutexGuard<'_, Tuner> {
    t.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The collective strategy of configuration `c` (between nodes, for the two-level
/// route).
fn strategy_of(c: &BucketConfig, codec: &CodecSpec) -> Strategy {
    match c.route {
        Route::Fp32 => Strategy::Fp32Ring,
        Route::AllGather => Strategy::CompressedAllGather,
        Route::Ring | Route::TwoShot | Route::Hierarchical
            if matches!(codec, CodecSpec::Identity(_)) =>
        {
            Strategy::Fp32Ring
        }
        Route::Ring | Route::Hierarchical => Strategy::CompressedRing,
        Route::TwoShot => Strategy::TwoShot,
    }
}

/// The codec of configuration `c` (the engine's buckets never take their tensors'
/// choices from other buckets).
fn codec_of(c: &BucketConfig) -> Result<CodecSpec> {
    c.codec
        .ok_or_else(|| Error::Collective("a measured bucket with no codec of its own".into()))
}

impl Measure {
    /// A reducer of bucket `bucket` (`elements` long) by configuration `c`.
    fn reducer<T: Transport>(
        &self,
        comm: &Comm<T>,
        bucket: usize,
        elements: usize,
        c: &BucketConfig,
    ) -> Result<Reducer> {
        let codec = codec_of(c)?;
        let strategy = strategy_of(c, &codec);
        let opts = AllReduceOptions {
            strategy: StrategyChoice::Forced(strategy),
            tag: bucket as u32,
            pieces: if c.route == Route::AllGather {
                1
            } else {
                self.base.pieces
            },
            feedback: if c.route == Route::Fp32 {
                Feedback::None
            } else {
                self.base.feedback
            },
            ..self.base.clone()
        };
        Ok(match (c.route, &self.nodes) {
            (Route::Hierarchical, Some(nodes)) => Reducer::Nodes(Box::new(Hierarchical::new(
                codec,
                self.node_codec,
                elements,
                comm,
                nodes.clone(),
                opts,
            )?)),
            (Route::Hierarchical, None) => {
                return Err(Error::Collective("the two-level route needs nodes".into()));
            }
            _ => Reducer::Flat(Box::new(AllReduce::new(codec, elements, comm, opts)?)),
        })
    }

    /// Install the decided configuration `c` of bucket `bucket` into `ars`: the reducer
    /// that ran its trials (residuals and all), or a new one.
    fn install<T: Transport>(
        &mut self,
        comm: &Comm<T>,
        ars: &mut [Reducer],
        bucket: usize,
        elements: usize,
        c: BucketConfig,
    ) -> Result<()> {
        if self.installed[bucket].as_ref() == Some(&c) {
            return Ok(());
        }
        let r = match self.trying.iter().position(|t| t.0 == bucket && t.1 == c) {
            Some(i) => self.trying.swap_remove(i).2,
            None => self.reducer(comm, bucket, elements, &c)?,
        };
        ars[bucket] = r;
        self.installed[bucket] = Some(c);
        self.trying.retain(|t| t.0 != bucket);
        Ok(())
    }
}

/// The envelope tag of the engine's agreement on its options (the buckets use their
/// indices).
const AGREE_TAG: u32 = u32::MAX;

/// Every option of `o` the ranks must share, with the layout, as `key=value` words (what
/// the first bucket agrees on). Whether buckets overlap the backward pass is left out:
/// it changes neither the messages nor the bits.
fn shared_settings(o: &SyncOptions, tensors: &[Tensor]) -> String {
    format!(
        "policy={} bucket_cap_bytes={} first_bucket_cap_bytes={} op={:?} feedback={:?} \
         feedback_options={} network={} checksum={} seed={:#x} pieces={} strategy={:?} \
         nodes={} node_codec={} node_network={} momentum={:#x} start_step={} \
         trials={} trial_steps={} layout={:#010x}",
        setting(&o.policy),
        o.bucket_cap_bytes,
        o.first_bucket_cap_bytes,
        o.op,
        o.feedback,
        setting(&o.feedback_options),
        setting(&o.network),
        o.checksum,
        o.seed,
        o.pieces,
        o.strategy,
        setting(&o.nodes),
        o.node_codec,
        setting(&o.node_network),
        o.momentum.to_bits(),
        o.start_step,
        o.trials,
        o.trial_steps,
        layout_hash(tensors),
    )
}

enum Job {
    Reduce {
        bucket: usize,
        step: u64,
        seed: u64,
        input: Vec<f32>,
        output: Vec<f32>,
        skip: bool,
    },
    Reset,
    Save,
    /// The reducers' blobs, and measured auto's plan.
    Restore(Vec<Vec<u8>>, Option<Vec<u8>>),
}

enum Done {
    Reduced {
        bucket: usize,
        input: Vec<f32>,
        output: Vec<f32>,
        res: Result<Stats>,
    },
    Reset,
    Saved(Vec<Vec<u8>>),
    Restored(Result<()>),
}

impl<T: Transport> Worker<T> {
    /// Bucket `bucket` reduced: by its reducer, or with measured auto by the
    /// configuration whose turn it is (timed, and after a plan's last trial the ranks'
    /// times shared and the fastest installed).
    fn run_bucket(
        &mut self,
        bucket: usize,
        step: u64,
        input: &mut [f32],
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        let Worker {
            comm, ars, measure, ..
        } = self;
        let Some(m) = measure.as_mut() else {
            return ars[bucket].run(comm, step, input, output, seed);
        };
        let Some(tensors) = m.tensors[bucket]
            .as_ref()
            .filter(|_| m.installed[bucket].is_none())
        else {
            // Not measured, or decided and installed for good.
            return ars[bucket].run(comm, step, input, output, seed);
        };
        let turn = lock(&m.tuner).next(bucket, tensors, None)?;
        let Some(trial) = turn.trial else {
            m.install(comm, ars, bucket, input.len(), turn.config)?;
            return ars[bucket].run(comm, step, input, output, seed);
        };
        let i = match m
            .trying
            .iter()
            .position(|t| t.0 == bucket && t.1 == turn.config)
        {
            Some(i) => i,
            None => {
                let r = m.reducer(comm, bucket, input.len(), &turn.config)?;
                m.trying.push((bucket, turn.config, r));
                m.trying.len() - 1
            }
        };
        let t0 = std::time::Instant::now();
        let stats = match m.trying[i].2.run(comm, step, input, output, seed) {
            Ok(s) => s,
            Err(e) => {
                // Failed on every rank: the plan is measured again from its start.
                lock(&m.tuner).restart(trial);
                return Err(e);
            }
        };
        let seconds = t0.elapsed().as_secs_f64();
        let noted = lock(&m.tuner).note(trial, seconds)?;
        if let Some(times) = noted {
            // Not locked while the ranks share: the caller's side may read the plan.
            let means = Tuner::share(comm, TUNE_TAG, &times).inspect_err(|_| {
                lock(&m.tuner).restart(trial);
            })?;
            let kept = {
                let mut t = lock(&m.tuner);
                t.decide(trial, &means)?;
                t.choice_of(&tensors[0].name).cloned()
            };
            // Installed at once, so that a save between steps holds the reducer the
            // restored engine makes for the decision.
            if let Some(c) = kept {
                m.install(comm, ars, bucket, input.len(), c)?;
            }
        }
        Ok(stats)
    }

    /// Restore the reducers' `blobs` and, with measured auto, the plan `tuned` (a
    /// [`Tuner::save`]): each decided bucket's reducer made for its configuration first.
    /// All or nothing.
    fn restore(&mut self, blobs: &[Vec<u8>], tuned: Option<&[u8]>) -> Result<()> {
        let mut ars = self.ars.clone();
        let mut staged = None;
        if let (Some(m), Some(blob)) = (&self.measure, tuned) {
            let mut tuner = lock(&m.tuner).clone();
            tuner.restore(blob)?;
            let mut fresh = Measure {
                tuner: Arc::clone(&m.tuner), // not used: `install` makes reducers only
                tensors: m.tensors.clone(),
                installed: vec![None; m.installed.len()],
                trying: Vec::new(),
                base: m.base.clone(),
                node_codec: m.node_codec,
                nodes: m.nodes.clone(),
            };
            for (b, ts) in m.tensors.iter().enumerate() {
                let Some(ts) = ts else { continue };
                if tuner.choice_of(&ts[0].name).is_none() {
                    continue; // still to be measured
                }
                // Its decided configuration (and the bucket in the tuner's plan rows: an
                // installed bucket does not ask again).
                let c = tuner.next(b, ts, None)?.config;
                let n = ts.iter().map(Tensor::len).sum::<Result<usize>>()?;
                fresh.install(&self.comm, &mut ars, b, n, c)?;
            }
            staged = Some((tuner, fresh.installed));
        }
        crate::state::restore_all(&mut ars, blobs, Reducer::restore)?;
        self.ars = ars;
        if let (Some(m), Some((tuner, installed))) = (&mut self.measure, staged) {
            *lock(&m.tuner) = tuner;
            m.installed = installed;
            m.trying.clear();
        }
        Ok(())
    }

    /// Bucket `bucket` all-reduced in f32 (a step before the start step).
    fn warm_run(&mut self, bucket: usize, input: &mut [f32], output: &mut [f32]) -> Result<Stats> {
        if self.warm.is_empty() {
            self.warm = (0..self.ars.len()).map(|_| None).collect();
        }
        if self.warm[bucket].is_none() {
            let opts = AllReduceOptions {
                tag: bucket as u32,
                ..self.warm_opts.clone()
            };
            let identity = CodecSpec::Identity(Identity);
            self.warm[bucket] = Some(AllReduce::new(identity, input.len(), &self.comm, opts)?);
        }
        let ar = self.warm[bucket].as_mut().expect("made above");
        ar.run(&mut self.comm, input, output, 0)
    }

    fn handle(&mut self, job: Job) -> Done {
        let _fp = crate::kernels::Standard::new();
        match job {
            Job::Reduce {
                bucket,
                step,
                seed,
                mut input,
                mut output,
                skip,
            } => {
                // Before the first bucket: the options every rank must share. Until the
                // ranks agree, every step's first bucket tries again and its step fails
                // (on every rank alike), so no step runs on options that differ.
                if let Some(s) = &self.agree {
                    match self.comm.agree(AGREE_TAG, s) {
                        Ok(()) => self.agree = None,
                        Err(e) => {
                            self.failed_step = Some(step);
                            self.comm.skip();
                            return Done::Reduced {
                                bucket,
                                input,
                                output,
                                res: Err(e),
                            };
                        }
                    }
                }
                let res = if skip || self.failed_step == Some(step) {
                    self.comm.skip();
                    Err(Error::Collective(format!(
                        "bucket {bucket} skipped: an earlier bucket of step {step} failed"
                    )))
                } else {
                    let r = if step < self.warm_until {
                        self.warm_run(bucket, &mut input, &mut output)
                    } else {
                        if !self.warm.is_empty() {
                            self.warm = Vec::new();
                        }
                        self.run_bucket(bucket, step, &mut input, &mut output, seed)
                    };
                    if r.is_err() {
                        self.failed_step = Some(step);
                    }
                    r
                };
                Done::Reduced {
                    bucket,
                    input,
                    output,
                    res,
                }
            }
            Job::Reset => {
                self.ars.iter_mut().for_each(Reducer::reset);
                if let Some(m) = &mut self.measure {
                    m.trying.iter_mut().for_each(|t| t.2.reset());
                }
                self.failed_step = None;
                Done::Reset
            }
            Job::Save => Done::Saved(self.ars.iter().map(Reducer::save).collect()),
            Job::Restore(blobs, tuned) => Done::Restored(self.restore(&blobs, tuned.as_deref())),
        }
    }
}

/// Where the worker runs.
enum Runner<T: Transport + Send + 'static> {
    /// On a communication thread.
    Thread {
        jobs: Sender<Job>,
        done: Receiver<Done>,
        handle: Option<JoinHandle<Worker<T>>>,
    },
    /// In this thread, at `finish`.
    Inline(Box<Worker<T>>),
    /// Given back by `into_transport`.
    Gone,
}

/// One bucket's buffers on the caller's side.
struct Bucket {
    /// The gradients given for this step (absent while the bucket is being reduced).
    input: Option<Vec<f32>>,
    /// The reduced gradients of the last step (absent while being reduced).
    output: Option<Vec<f32>>,
    /// Tensors of the bucket not yet given this step.
    missing: usize,
    /// The bucket's result this step, once reduced.
    result: Option<Result<Stats>>,
    /// Sent to the worker this step.
    sent: bool,
}

/// The whole-model sync engine (see the module docs).
pub struct SyncEngine<T: Transport + Send + 'static> {
    tensors: Vec<Tensor>,
    lens: Vec<usize>,
    /// Per tensor: its bucket and its offset in the bucket.
    loc: Vec<(usize, usize)>,
    /// Per tensor: given this step.
    given: Vec<bool>,
    plan: Plan,
    opts: SyncOptions,
    buckets: Vec<Bucket>,
    /// The next bucket to send to the worker (buckets go in plan order).
    next: usize,
    step: u64,
    in_step: bool,
    /// Results of the last finished step: Ok, or the step's first error.
    last: Option<Result<StepStats>>,
    runner: Runner<T>,
    /// Per tensor: its velocity, with [`SyncOptions::momentum`] (else empty).
    velocity: Vec<Vec<f32>>,
    /// Measured auto's tuner, shared with the communication side, and the plan as the
    /// model made it (the decisions are shown over it).
    tuner: Option<Arc<Mutex<Tuner>>>,
    model_plan: Plan,
    /// The tuner's decided plans when the plan last showed them.
    shown: usize,
}

impl<T: Transport + Send + 'static> core::fmt::Debug for SyncEngine<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SyncEngine")
            .field("tensors", &self.tensors.len())
            .field("buckets", &self.buckets.len())
            .field("step", &self.step)
            .finish()
    }
}

/// A hash of the layout (names and shapes), to refuse a checkpoint of another model.
pub(crate) fn layout_hash(tensors: &[Tensor]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for t in tensors {
        h.update(&(t.name.len() as u64).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(&(t.shape.len() as u64).to_le_bytes());
        t.shape
            .iter()
            .for_each(|&d| h.update(&(d as u64).to_le_bytes()));
    }
    h.finalize()
}

impl<T: Transport + Send + 'static> SyncEngine<T> {
    /// An engine for the tensors of `layout` (in the order their gradients become
    /// ready), over `transport`. Every rank must build it with the same layout and
    /// options. With [`CodecChoice::Auto`] and no profiles, this measures the
    /// candidates and averages the figures over the ranks (one fp32 all-reduce of a few
    /// numbers), so it is collective: every rank must call it.
    pub fn new(layout: &[Tensor], transport: T, opts: SyncOptions) -> Result<SyncEngine<T>> {
        let mut comm = Comm::new(transport);
        let (rank, size) = (comm.rank(), comm.size());
        if size == 0 || rank >= size {
            return Err(Error::Collective(format!(
                "transport reports rank {rank} in a world of {size}"
            )));
        }
        if !(0.0..1.0).contains(&opts.momentum) {
            return Err(Error::Collective(format!(
                "momentum must be in [0, 1), not {}",
                opts.momentum
            )));
        }
        if opts.pieces == 0 {
            return Err(Error::Collective(
                "pieces per ring chunk must be at least 1".into(),
            ));
        }
        if opts.trial_steps == 0 {
            return Err(Error::Collective("trial_steps must be at least 1".into()));
        }
        if opts.trials > 0 && !matches!(opts.policy.codec, CodecChoice::Auto { .. }) {
            return Err(Error::Collective(
                "trials measure auto's candidates: give an auto policy (Policy::auto), or \
                 trials = 0"
                    .into(),
            ));
        }
        if opts.trials > 0
            && matches!(
                opts.strategy,
                Some(Strategy::SignMajority | Strategy::Fp32Ring)
            )
        {
            return Err(Error::Collective(
                "trials choose among the ring, the two-shot and the all-gather: give no \
                 strategy, or one of those"
                    .into(),
            ));
        }
        if opts.bucket_cap_bytes == 0 || opts.first_bucket_cap_bytes == 0 {
            return Err(Error::Collective(
                "bucket caps must be at least 1 byte".into(),
            ));
        }
        let net = opts.network;
        if !(net.bandwidth_bit_s > 0.0 && net.latency_s >= 0.0 && net.latency_s.is_finite()) {
            return Err(Error::Collective(format!(
                "network of {} bit/s and {} s latency: need a positive bandwidth and a finite, non-negative latency",
                net.bandwidth_bit_s, net.latency_s
            )));
        }
        let lens: Vec<usize> = layout.iter().map(Tensor::len).collect::<Result<_>>()?;
        let policy = &opts.policy;
        if let Some(p) = &policy.powersgd {
            p.check()?;
        }
        let kinds: Vec<Kind> = layout
            .iter()
            .zip(&lens)
            .map(|(t, &n)| policy.kind(t, n))
            .collect();
        let groups = plan::buckets(
            &lens,
            &kinds,
            opts.bucket_cap_bytes,
            opts.first_bucket_cap_bytes,
        );
        // Speeds for auto: given, or measured here and averaged over the ranks.
        let profiles: Option<Vec<CodecProfile>> = match &policy.codec {
            CodecChoice::Auto {
                candidates,
                profiles: Some(p),
            } => {
                if p.len() != candidates.len() {
                    return Err(Error::Collective(format!(
                        "{} profiles for {} candidates",
                        p.len(),
                        candidates.len()
                    )));
                }
                Some(p.clone())
            }
            CodecChoice::Auto {
                candidates,
                profiles: None,
            } => Some(shared_profiles(candidates, &mut comm)?),
            CodecChoice::Fixed(_) => None,
        };
        // The nodes and the link inside them, when the planner weighs going by node.
        let two = match (&opts.nodes, &opts.node_network) {
            (Some(nd), Some(inside)) => Some((
                crate::cost::TwoLevel {
                    nodes: nd.count() as u32,
                    per_node: nd.max_node() as u32,
                    intra_bandwidth_bit_s: inside.bandwidth_bit_s,
                    intra_latency_s: inside.latency_s,
                    inter_bandwidth_bit_s: net.bandwidth_bit_s,
                    inter_latency_s: net.latency_s,
                },
                opts.node_codec.bits_per_element(1 << 20),
            )),
            _ => None,
        };
        let mut buckets_plan = Vec::with_capacity(groups.len());
        for (tensors, kind) in groups {
            let elements = tensors
                .iter()
                .try_fold(0usize, |a, &t| a.checked_add(lens[t]))
                .ok_or_else(|| Error::Collective("a bucket's size overflows".into()))?;
            let low_rank = match (kind, policy.powersgd) {
                (Kind::LowRank, Some(settings)) => {
                    let matrices: Vec<(usize, usize, usize)> = tensors
                        .iter()
                        .map(|&t| settings.matrix_of(&layout[t]).expect("a low-rank matrix"))
                        .collect();
                    let (p_elements, q_elements) = powersgd::factor_lens(&matrices)
                        .ok_or_else(|| Error::Collective("a bucket's size overflows".into()))?;
                    Some(LowRankPlan {
                        settings,
                        matrices,
                        p_elements,
                        q_elements,
                    })
                }
                _ => None,
            };
            let reduces = Reduces::of(elements, low_rank.as_ref());
            // The strategy is chosen for the larger of the bucket's all-reduces.
            let largest = match reduces {
                Reduces::One(n) => n,
                Reduces::Two(p, q) => p.max(q),
            };
            // By node, the strategy is the one of the streams between nodes: a shard of
            // the bucket (one per rank of the largest node) among the nodes.
            let nodes = opts.nodes.as_ref().filter(|_| kind != Kind::LowRank);
            let strategy_of =
                |codec: &CodecSpec, prof: Option<&CodecProfile>, peers: usize, part: usize| {
                    match opts.strategy {
                        Some(s) if !matches!(codec, CodecSpec::Identity(_)) => s,
                        _ => {
                            let p = plan::profile_for(codec, prof, part, peers);
                            plan::strategy_for(codec, &p, peers, &net, part)
                        }
                    }
                };
            // (strategy, modelled s, bytes per rank, by node) of `codec`; `fixed`: its
            // strategy whichever way.
            let choose =
                |codec: &CodecSpec, prof: Option<&CodecProfile>, fixed: Option<Strategy>| {
                    let flat = fixed.unwrap_or_else(|| strategy_of(codec, prof, size, largest));
                    let (t, bytes) =
                        plan::bucket_cost(codec, flat, prof, size, &net, reduces, opts.pieces);
                    let Some(nd) = nodes else {
                        return (flat, t, bytes, false);
                    };
                    let (peers, part) = (nd.count(), largest / nd.max_node());
                    let s = fixed.unwrap_or_else(|| strategy_of(codec, prof, peers, part));
                    match &two {
                        // No link inside nodes given: by node.
                        None => {
                            let (t, bytes) =
                                plan::bucket_cost(codec, s, prof, size, &net, reduces, opts.pieces);
                            (s, t, bytes, true)
                        }
                        Some((two, bits)) => {
                            let (th, bh) = plan::node_cost(codec, s, prof, two, *bits, reduces);
                            if th < t {
                                (s, th, bh, true)
                            } else {
                                (flat, t, bytes, false)
                            }
                        }
                    }
                };
            let (codec, (strategy, t, bytes, by_node)) = match kind {
                Kind::Small => (policy.small_codec, choose(&policy.small_codec, None, None)),
                Kind::Tiled => {
                    let c = policy
                        .tiled(&layout[tensors[0]])
                        .expect("a tiled bucket's tensor has its codec");
                    (c, choose(&c, None, Some(Strategy::CompressedAllGather)))
                }
                Kind::LowRank => {
                    let c = low_rank.as_ref().expect("a low-rank plan").settings.codec;
                    (c, choose(&c, None, None))
                }
                Kind::Codec => match &policy.codec {
                    CodecChoice::Fixed(c) => (*c, choose(c, None, None)),
                    CodecChoice::Auto { candidates, .. } => {
                        let profiles = profiles.as_ref().expect("auto has profiles");
                        let fp32 = CodecSpec::Identity(Identity);
                        let mut best = (fp32, choose(&fp32, None, None));
                        for (c, p) in candidates.iter().zip(profiles) {
                            let r = choose(c, Some(p), None);
                            if r.1 < best.1.1 {
                                best = (*c, r);
                            }
                        }
                        best
                    }
                },
            };
            buckets_plan.push(BucketPlan {
                tensors,
                elements,
                codec,
                strategy,
                small: kind == Kind::Small,
                low_rank,
                wire_bytes: bytes,
                modelled_s: t,
                by_node,
            });
        }
        let plan = Plan {
            buckets: buckets_plan,
            names: layout.iter().map(|t| t.name.clone()).collect(),
            nodes: size,
            pieces: opts.pieces,
            network: net,
            two,
        };
        let mut loc = vec![(0, 0); layout.len()];
        let mut buckets = Vec::with_capacity(plan.buckets.len());
        let mut ars = Vec::with_capacity(plan.buckets.len());
        for (b, bp) in plan.buckets.iter().enumerate() {
            let mut off = 0;
            for &t in &bp.tensors {
                loc[t] = (b, off);
                off += lens[t];
            }
            let ar_opts = AllReduceOptions {
                op: opts.op,
                strategy: StrategyChoice::Forced(bp.strategy),
                feedback: opts.feedback,
                feedback_options: opts.feedback_options,
                checksum: opts.checksum,
                tag: b as u32,
                pieces: if bp.strategy == Strategy::CompressedAllGather {
                    1
                } else {
                    opts.pieces
                },
            };
            ars.push(match &bp.low_rank {
                Some(l) => Reducer::LowRank(Box::new(LowRank::new(
                    l.settings,
                    &l.matrices,
                    &comm,
                    ar_opts,
                    bp.strategy,
                )?)),
                None => match opts.nodes.as_ref().filter(|_| bp.by_node) {
                    Some(nodes) => Reducer::Nodes(Box::new(Hierarchical::new(
                        bp.codec,
                        opts.node_codec,
                        bp.elements,
                        &comm,
                        nodes.clone(),
                        ar_opts,
                    )?)),
                    None => Reducer::Flat(Box::new(AllReduce::new(
                        bp.codec,
                        bp.elements,
                        &comm,
                        ar_opts,
                    )?)),
                },
            });
            buckets.push(Bucket {
                input: Some(crate::alloc::filled(bp.elements, 0.0, "a bucket buffer")?),
                output: Some(crate::alloc::filled(bp.elements, 0.0, "a bucket buffer")?),
                missing: bp.tensors.len(),
                result: None,
                sent: false,
            });
        }
        // Measured auto: a tuner for the buckets of the policy's codec.
        let measure = match (&policy.codec, &profiles) {
            (CodecChoice::Auto { candidates, .. }, Some(measured)) if opts.trials > 0 => {
                let identity = CodecSpec::Identity(Identity);
                let mut speeds = measured.clone();
                if !candidates.contains(&identity) {
                    speeds.push(match &policy.codec {
                        CodecChoice::Auto { profiles: None, .. } => {
                            shared_profiles(&[identity], &mut comm)?.remove(0)
                        }
                        // Speeds given without float32's: float32 is measured in every
                        // plan, and its model only ranks the two-level route.
                        _ => CodecProfile::nominal("identity", 32.0),
                    });
                }
                let mut routes = match opts.strategy {
                    Some(Strategy::CompressedRing) => vec![Route::Ring],
                    Some(Strategy::TwoShot) => vec![Route::TwoShot],
                    Some(_) => vec![Route::AllGather],
                    None => vec![Route::AllGather, Route::Ring, Route::TwoShot],
                };
                if opts.nodes.is_some() {
                    routes.push(Route::Hierarchical);
                }
                let tune = TuneOptions {
                    candidates: candidates.clone(),
                    routes,
                    network: net,
                    node_network: opts
                        .node_network
                        .unwrap_or(TuneOptions::default().node_network),
                    nodes: opts.nodes.clone(),
                    small_below: policy.small_below,
                    dct_2d: false,
                    trials: opts.trials,
                    trial_steps: opts.trial_steps,
                };
                let tensors = plan
                    .buckets
                    .iter()
                    .map(|bp| {
                        let codec = bp.low_rank.is_none()
                            && bp.tensors.first().is_some_and(|&t| kinds[t] == Kind::Codec);
                        codec.then(|| bp.tensors.iter().map(|&t| layout[t].clone()).collect())
                    })
                    .collect::<Vec<Option<Vec<Tensor>>>>();
                Some(Measure {
                    tuner: Arc::new(Mutex::new(Tuner::new(size, tune, speeds)?)),
                    installed: vec![None; tensors.len()],
                    tensors,
                    trying: Vec::new(),
                    base: AllReduceOptions {
                        op: opts.op,
                        feedback: opts.feedback,
                        feedback_options: opts.feedback_options,
                        checksum: opts.checksum,
                        pieces: opts.pieces,
                        ..Default::default()
                    },
                    node_codec: opts.node_codec,
                    nodes: opts.nodes.clone(),
                })
            }
            _ => None,
        };
        let tuner = measure.as_ref().map(|m| Arc::clone(&m.tuner));
        let worker = Worker {
            measure,
            warm: Vec::new(),
            warm_until: opts.start_step,
            warm_opts: AllReduceOptions {
                op: opts.op,
                strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
                feedback: Feedback::None,
                checksum: opts.checksum,
                pieces: opts.pieces,
                ..Default::default()
            },
            comm,
            ars,
            failed_step: None,
            agree: Some(shared_settings(&opts, layout)),
        };
        let runner = if opts.overlap {
            let (jobs, done, handle) =
                spawn_worker(format!("gradpack-sync-{rank}"), worker, Worker::handle)?;
            Runner::Thread {
                jobs,
                done,
                handle: Some(handle),
            }
        } else {
            Runner::Inline(Box::new(worker))
        };
        let mut velocity = Vec::new();
        if opts.momentum != 0.0 {
            for &n in &lens {
                velocity.push(crate::alloc::filled(n, 0.0, "a tensor's velocity")?);
            }
        }
        Ok(SyncEngine {
            tuner,
            model_plan: plan.clone(),
            shown: 0,
            velocity,
            given: vec![false; layout.len()],
            tensors: layout.to_vec(),
            lens,
            loc,
            plan,
            opts,
            buckets,
            next: 0,
            step: 0,
            in_step: false,
            last: None,
            runner,
        })
    }

    /// The plan: buckets, their tensors, codecs, strategies and modelled times. With
    /// measured auto ([`SyncOptions::trials`]), a bucket still being measured shows the
    /// model's pick, and a decided one its decision.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// With measured auto ([`SyncOptions::trials`]): per measured bucket, every
    /// configuration tried, with its modelled and (once every trial ran) measured time and
    /// the one kept ([`Tuner::plan`]; `bucket` is the plan's bucket index). Empty
    /// without.
    pub fn trials(&self) -> Vec<TrialRow> {
        self.tuner
            .as_ref()
            .map_or_else(Vec::new, |t| lock(t).plan())
    }

    /// [`SyncEngine::trials`] as a text table, the kept rows marked with `*`.
    pub fn trials_table(&self) -> String {
        self.tuner
            .as_ref()
            .map_or_else(String::new, |t| lock(t).table())
    }

    /// Write each measured bucket's decision, once made, into the plan.
    fn show_decisions(&mut self) {
        if let Some(t) = &self.tuner {
            let t = lock(t);
            // Only when a plan was decided since: not a copy of the plan every step.
            if t.decided_plans() != self.shown {
                self.shown = t.decided_plans();
                self.plan = decided_plan(&self.model_plan, &self.tensors, &t);
            }
        }
    }

    /// Steps finished (successful or not) since the engine was built or restored from.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The layout.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The index of the tensor named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    fn check_tensor(&self, i: usize) -> Result<()> {
        if i >= self.tensors.len() {
            return Err(Error::Collective(format!(
                "tensor {i} is outside the layout of {} tensors",
                self.tensors.len()
            )));
        }
        if self.in_step && self.given[i] {
            return Err(Error::Collective(format!(
                "tensor {i} ({}) was already given this step",
                self.tensors[i].name
            )));
        }
        Ok(())
    }

    fn begin_step(&mut self) {
        if !self.in_step {
            self.in_step = true;
            self.last = None;
            self.next = 0;
            for (b, bp) in self.buckets.iter_mut().zip(&self.plan.buckets) {
                b.missing = bp.tensors.len();
                b.result = None;
                b.sent = false;
            }
            self.given.iter_mut().for_each(|g| *g = false);
        }
    }

    /// The slot of tensor `i` in its bucket, to write its gradient into in place; then
    /// call [`SyncEngine::mark_ready`]. Errors if `i` is not in the layout or was
    /// already given this step.
    pub fn slot_mut(&mut self, i: usize) -> Result<&mut [f32]> {
        self.check_tensor(i)?;
        self.begin_step();
        self.slot(i)
    }

    /// Tensor `i`'s gradient is in its slot: when this completes its bucket, the bucket
    /// (and any complete buckets after it) start their all-reduce.
    pub fn mark_ready(&mut self, i: usize) -> Result<()> {
        self.check_tensor(i)?;
        self.begin_step();
        self.mark(i)
    }

    /// Tensor `i`'s gradient is ready: copy it into its bucket (see
    /// [`SyncEngine::mark_ready`]). Errors, changing nothing, if `grad` does not have
    /// the tensor's element count.
    pub fn ready(&mut self, i: usize, grad: &[f32]) -> Result<()> {
        self.check_tensor(i)?;
        if grad.len() != self.lens[i] {
            return Err(Error::LengthMismatch {
                what: "gradient and tensor elements",
                left: grad.len(),
                right: self.lens[i],
            });
        }
        self.begin_step();
        self.slot(i)?.copy_from_slice(grad);
        self.mark(i)
    }

    /// Tensor `i`'s slot (checked by the caller, in a step).
    fn slot(&mut self, i: usize) -> Result<&mut [f32]> {
        let (b, off) = self.loc[i];
        let n = self.lens[i];
        let input = self.buckets[b]
            .input
            .as_mut()
            .ok_or_else(|| Error::Collective(format!("bucket {b} is being reduced")))?;
        Ok(&mut input[off..off + n])
    }

    /// Count tensor `i` as given (checked by the caller, in a step) and launch what is
    /// complete.
    fn mark(&mut self, i: usize) -> Result<()> {
        if self.opts.momentum != 0.0 {
            // u = m u + g, and the slot gets u (the velocity is set aside while the slot
            // is borrowed, and put back whatever happens).
            let m = self.opts.momentum;
            let mut u = core::mem::take(&mut self.velocity[i]);
            let r = self.slot(i).map(|g| momentum::momentum_step(m, &mut u, g));
            self.velocity[i] = u;
            r?;
        }
        self.given[i] = true;
        let b = self.loc[i].0;
        self.buckets[b].missing -= 1;
        if self.opts.overlap {
            self.launch()?;
        }
        Ok(())
    }

    /// The seed bucket `bucket` is all-reduced with at step `step` (before the
    /// collective mixes in each rank where the codec draws independently per rank):
    /// derived from [`SyncOptions::seed`], so every rank agrees.
    pub fn bucket_seed(&self, step: u64, bucket: usize) -> u64 {
        use crate::rng::splitmix64;
        splitmix64(self.opts.seed ^ splitmix64(step) ^ splitmix64(!(bucket as u64)))
    }

    fn seed(&self, b: usize) -> u64 {
        self.bucket_seed(self.step, b)
    }

    /// Send complete buckets to the worker, in plan order.
    fn launch(&mut self) -> Result<()> {
        while self.next < self.buckets.len() && self.buckets[self.next].missing == 0 {
            self.send(self.next, false)?;
            self.next += 1;
        }
        Ok(())
    }

    fn send(&mut self, b: usize, skip: bool) -> Result<()> {
        let seed = self.seed(b);
        let bucket = &mut self.buckets[b];
        let (Some(input), Some(output)) = (bucket.input.take(), bucket.output.take()) else {
            return Err(Error::Collective(format!(
                "bucket {b} is already being reduced"
            )));
        };
        bucket.sent = true;
        let job = Job::Reduce {
            bucket: b,
            step: self.step,
            seed,
            input,
            output,
            skip,
        };
        match &mut self.runner {
            Runner::Thread { jobs, .. } => jobs.send(job).map_err(|_| thread_gone()),
            Runner::Inline(w) => {
                let done = w.handle(job);
                self.take(done);
                Ok(())
            }
            Runner::Gone => Err(thread_gone()),
        }
    }

    fn take(&mut self, done: Done) {
        if let Done::Reduced {
            bucket,
            input,
            output,
            res,
        } = done
        {
            let b = &mut self.buckets[bucket];
            b.input = Some(input);
            b.output = Some(output);
            b.result = Some(res);
        }
    }

    /// Wait for the worker's answer to a job other than a reduction.
    fn call(&mut self, job: Job) -> Result<Done> {
        match &mut self.runner {
            Runner::Thread { jobs, done, .. } => {
                // Only called between steps, when no reduction is outstanding.
                jobs.send(job).map_err(|_| thread_gone())?;
                done.recv().map_err(|_| thread_gone())
            }
            Runner::Inline(w) => Ok(w.handle(job)),
            Runner::Gone => Err(thread_gone()),
        }
    }

    /// Wait for every bucket of this step and return what this rank sent, or the first
    /// failed bucket's error. Tensors not given this step are an error too (their
    /// buckets are skipped, so the ranks stay in step). After an error, the reduced
    /// gradients are not available; call [`SyncEngine::reset_feedback`] and go on.
    pub fn finish(&mut self) -> Result<StepStats> {
        let _fp = crate::kernels::Standard::new();
        if !self.in_step {
            return Err(Error::Collective(
                "finish() without any gradient given this step".into(),
            ));
        }
        let missing: Vec<&str> = self
            .given
            .iter()
            .zip(&self.tensors)
            .filter(|(g, _)| !**g)
            .map(|(_, t)| t.name.as_str())
            .collect();
        let missing_err = (!missing.is_empty()).then(|| {
            Error::Collective(format!(
                "{} tensors were not given this step: {}{}",
                missing.len(),
                missing[..missing.len().min(5)].join(", "),
                if missing.len() > 5 { ", ..." } else { "" }
            ))
        });
        // Every bucket not yet sent goes now: complete ones are reduced, incomplete ones
        // skipped.
        for b in self.next..self.buckets.len() {
            let skip = self.buckets[b].missing > 0;
            self.send(b, skip)?;
        }
        self.next = self.buckets.len();
        if let Runner::Thread { done, .. } = &self.runner {
            let mut pending: Vec<Done> = Vec::new();
            let outstanding = self.buckets.iter().filter(|b| b.result.is_none()).count();
            for _ in 0..outstanding {
                pending.push(done.recv().map_err(|_| thread_gone())?);
            }
            pending.into_iter().for_each(|d| self.take(d));
        }
        self.in_step = false;
        self.step += 1;
        self.show_decisions();
        let mut stats = StepStats::default();
        let mut first_err = missing_err;
        for b in &self.buckets {
            match b.result.as_ref().expect("every bucket answered") {
                Ok(s) => {
                    stats.bytes_sent += s.bytes_sent;
                    stats.messages += s.messages;
                    stats.buckets += 1;
                }
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e.clone());
                    }
                }
            }
        }
        let res = match first_err {
            Some(e) => Err(e),
            None => Ok(stats),
        };
        self.last = Some(res.clone());
        res
    }

    /// The reduced gradient of tensor `i` from the last step, which must have finished
    /// without error.
    pub fn grad(&self, i: usize) -> Result<&[f32]> {
        if i >= self.tensors.len() {
            return Err(Error::Collective(format!(
                "tensor {i} is outside the layout of {} tensors",
                self.tensors.len()
            )));
        }
        match &self.last {
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                return Err(Error::Collective(format!(
                    "the last step failed ({e}): no reduced gradients"
                )));
            }
            None => {
                return Err(Error::Collective(
                    "no finished step: reduced gradients come from finish()".into(),
                ));
            }
        }
        let (b, off) = self.loc[i];
        let out = self.buckets[b]
            .output
            .as_ref()
            .ok_or_else(|| Error::Collective(format!("bucket {b} is being reduced")))?;
        Ok(&out[off..off + self.lens[i]])
    }

    fn idle(&self, what: &str) -> Result<()> {
        if self.in_step {
            return Err(Error::Collective(format!(
                "{what} in the middle of a step: call finish() first"
            )));
        }
        Ok(())
    }

    /// Zero every residual (after a failed step, or a model reload).
    pub fn reset_feedback(&mut self) -> Result<()> {
        self.idle("reset_feedback")?;
        self.call(Job::Reset).map(|_| ())
    }

    /// The engine's state as one saved blob: the step counter, the layout's hash, the
    /// plan and every bucket's residuals (see the module docs). Between steps only.
    pub fn save(&mut self) -> Result<Vec<u8>> {
        self.idle("save")?;
        let Done::Saved(blobs) = self.call(Job::Save)? else {
            return Err(thread_gone());
        };
        let mut w = BlobWriter::new(ENGINE_MAGIC);
        w.u32(layout_hash(&self.tensors))
            .u64(self.tensors.len() as u64)
            .u64(self.step);
        // With measured auto, its plan (the buckets' codecs below are its decisions).
        if let Some(t) = &self.tuner {
            w.bytes(&lock(t).save());
        }
        w.u64(self.plan.buckets.len() as u64);
        for (bp, blob) in self.plan.buckets.iter().zip(&blobs) {
            w.str(&bp.method())
                .str(bp.strategy.name())
                .u64(bp.tensors.len() as u64);
            bp.tensors.iter().for_each(|&t| {
                w.u64(t as u64);
            });
            w.bytes(blob);
        }
        // With momentum correction, the velocities (a blob without them is another
        // engine's: its options differ).
        for u in &self.velocity {
            w.f32s(u);
        }
        Ok(w.finish())
    }

    /// Restore a blob from [`SyncEngine::save`] on the same rank of an engine built with
    /// the same layout and options; the engine then continues bit-identically. Refused
    /// with [`Error::Checkpoint`], changing nothing, if it is damaged or from another
    /// layout, plan or world. Between steps only.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        self.idle("restore")?;
        let mut r = BlobReader::open(blob, ENGINE_MAGIC, "sync engine")?;
        r.u32_eq("layout hash (names and shapes)", layout_hash(&self.tensors))?;
        r.u64_eq("tensor count", self.tensors.len() as u64)?;
        let step = r.u64()?;
        // With measured auto: its plan, and the buckets as that plan has them.
        let (tuned, shown, decided) = match &self.tuner {
            Some(t) => {
                let blob = r.bytes()?.to_vec();
                let mut theirs = lock(t).clone();
                theirs.restore(&blob)?;
                let shown = decided_plan(&self.model_plan, &self.tensors, &theirs);
                (Some(blob), shown, theirs.decided_plans())
            }
            None => (None, self.plan.clone(), 0),
        };
        r.u64_eq("bucket count", shown.buckets.len() as u64)?;
        let mut blobs = Vec::with_capacity(shown.buckets.len());
        for bp in &shown.buckets {
            r.str_eq("bucket codec", &bp.method())?;
            r.str_eq("bucket strategy", bp.strategy.name())?;
            r.u64_eq("bucket tensor count", bp.tensors.len() as u64)?;
            for &t in &bp.tensors {
                r.u64_eq("bucket tensor", t as u64)?;
            }
            blobs.push(r.bytes()?.to_vec());
        }
        let mut velocity = Vec::new();
        for u in &self.velocity {
            let mut v = crate::alloc::filled(u.len(), 0.0, "a tensor's velocity")?;
            r.f32s_into(&mut v)?;
            velocity.push(v);
        }
        r.end()?;
        match self.call(Job::Restore(blobs, tuned))? {
            Done::Restored(res) => res?,
            _ => return Err(thread_gone()),
        }
        self.step = step;
        self.last = None;
        self.velocity = velocity;
        self.plan = shown;
        self.shown = decided;
        Ok(())
    }
}

impl<T: Transport + Send + 'static> SyncEngine<T> {
    /// Stop the communication thread and hand its worker back.
    fn stop(&mut self) -> Option<Worker<T>> {
        match &mut self.runner {
            Runner::Thread { jobs, handle, .. } => {
                // Closing the job channel ends the thread's loop.
                let (dead, _) = mpsc::channel();
                drop(core::mem::replace(jobs, dead));
                handle.take().and_then(|h| h.join().ok())
            }
            Runner::Inline(_) | Runner::Gone => None,
        }
    }

    /// The transport, giving up the engine (between steps; its residuals are dropped:
    /// [`SyncEngine::save`] them first to keep them). The transport's messages of
    /// earlier calls carry envelopes, so a new engine over it starts clean once every
    /// rank has made the same switch.
    pub fn into_transport(mut self) -> Result<T> {
        self.idle("into_transport")?;
        let worker = match self.stop() {
            Some(w) => w,
            None => match core::mem::replace(&mut self.runner, Runner::Gone) {
                Runner::Inline(w) => *w,
                _ => return Err(thread_gone()),
            },
        };
        Ok(worker.comm.into_inner())
    }
}

impl<T: Transport + Send + 'static> Drop for SyncEngine<T> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start a communication thread named `name` that owns `worker` and answers each job
/// sent on the returned sender with `handle(worker, job)` on the returned receiver, in
/// order, until the sender is dropped; joining it gives the worker back.
pub(crate) fn spawn_worker<W, J, D>(
    name: String,
    worker: W,
    handle: fn(&mut W, J) -> D,
) -> Result<(Sender<J>, Receiver<D>, JoinHandle<W>)>
where
    W: Send + 'static,
    J: Send + 'static,
    D: Send + 'static,
{
    let (jobs, jobs_rx) = mpsc::channel::<J>();
    let (done_tx, done) = mpsc::channel::<D>();
    let thread = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            let mut w = worker;
            for job in jobs_rx {
                if done_tx.send(handle(&mut w, job)).is_err() {
                    break;
                }
            }
            w
        })
        .map_err(|e| Error::Collective(format!("could not start the communication thread: {e}")))?;
    Ok((jobs, done, thread))
}

pub(crate) fn thread_gone() -> Error {
    Error::Collective("the communication thread has stopped (it panicked)".into())
}

/// This process's measured profiles, so that engines built later reuse them.
static PROFILES: std::sync::Mutex<Vec<CodecProfile>> = std::sync::Mutex::new(Vec::new());

/// `codec`'s profile on this CPU: measured once per process (about 0.05 s), then cached.
fn calibrated(codec: &CodecSpec) -> Result<CodecProfile> {
    let key = codec.to_string();
    let cached = PROFILES
        .lock()
        .map_err(|_| Error::Collective("the profile cache is poisoned".into()))?
        .iter()
        .find(|p| p.spec == key)
        .cloned();
    if let Some(p) = cached {
        return Ok(p);
    }
    let p = calibrate(codec, plan::CALIBRATION, 0.05)?;
    if let Ok(mut cache) = PROFILES.lock() {
        cache.push(p.clone());
    }
    Ok(p)
}

/// Measure each candidate on this CPU and average the figures over the ranks with an
/// fp32 all-reduce (bit-identical on every rank), so that every rank plans alike.
fn shared_profiles<T: Transport>(
    candidates: &[CodecSpec],
    comm: &mut Comm<T>,
) -> Result<Vec<CodecProfile>> {
    let mut mine = Vec::with_capacity(candidates.len() * 3);
    let mut profiles = Vec::with_capacity(candidates.len());
    for c in candidates {
        let p = calibrated(c)?;
        // Seconds per byte: their mean is the mean time, the figure to model with.
        mine.extend([
            (1.0 / p.encode_bytes_per_s) as f32,
            (1.0 / p.decode_bytes_per_s) as f32,
            (1.0 / p.decode_add_bytes_per_s) as f32,
        ]);
        profiles.push(p);
    }
    let opts = AllReduceOptions {
        op: ReduceOp::Mean,
        strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
        tag: u32::MAX,
        ..Default::default()
    };
    let mut ar = AllReduce::new(CodecSpec::Identity(Identity), mine.len(), comm, opts)?;
    let mut mean = vec![0f32; mine.len()];
    ar.run(comm, &mine, &mut mean, 0)?;
    for (p, t) in profiles.iter_mut().zip(mean.chunks_exact(3)) {
        p.encode_bytes_per_s = 1.0 / f64::from(t[0]);
        p.decode_bytes_per_s = 1.0 / f64::from(t[1]);
        p.decode_add_bytes_per_s = 1.0 / f64::from(t[2]);
    }
    Ok(profiles)
}
