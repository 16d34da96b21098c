//! Measured `auto`: how each bucket is reduced, ranked by the cost model and then
//! decided by the clock.
//!
//! For a bucket (the tensors of one all-reduce), the cost model ranks every candidate
//! codec by every [`Route`] allowed, from each codec's measured speeds on this CPU. The
//! model only shortlists: a [`Tuner`] keeps a plan per bucket layout (the names and
//! sizes of its tensors) with float32 first and then the `trials` configurations the
//! model ranks fastest, and hands them out in turn, `trial_steps` steps each
//! ([`Tuner::next`]). The front end runs each configuration on the real bucket and
//! hands back its time ([`Tuner::record`]); after the plan's last trial the ranks share
//! their times (one call of their [`Comm`], at the same point of every rank's sequence)
//! and every rank keeps the configuration of the smallest mean of the ranks' best times,
//! float32 on a tie. So a configuration measured slower than float32 is never kept, and
//! every rank keeps the same one.
//!
//! A front end differs only in how it runs a configuration: the sync engine with its own
//! collectives, the PyTorch hook with DDP's all-reduce for float32 and the crate's
//! collectives for the rest. What is tried, in which order, and what is kept is decided
//! here, once. The decided plans and each tensor's choice are part of the saved state
//! ([`Tuner::save`]): a restored run measures nothing again and reduces as before.
//!
//! ```
//! use gradpack::collective::local;
//! use gradpack::cost::CodecProfile;
//! use gradpack::sync::{Route, Tensor, TuneOptions, Tuner};
//!
//! let specs = ["identity", "int8"];
//! let profiles: Vec<CodecProfile> = specs
//!     .iter()
//!     .map(|s| CodecProfile { encode_bytes_per_s: 8e9, decode_bytes_per_s: 8e9,
//!                             decode_add_bytes_per_s: 8e9, ..CodecProfile::nominal(*s, 32.0) })
//!     .collect();
//! let opts = TuneOptions { candidates: vec!["int8".parse()?], trial_steps: 1,
//!                          ..TuneOptions::default() };
//! let bucket = [Tensor::new("fc.weight", &[256, 1024])];
//! let chosen = local::run(2, None, |comm| {
//!     let mut comm = gradpack::collective::Comm::new(comm.into_inner());
//!     let mut tuner = Tuner::new(2, opts.clone(), profiles.clone())?;
//!     loop {
//!         let turn = tuner.next(0, &bucket, None)?;
//!         let Some(trial) = turn.trial else { return Ok(turn.config) };
//!         // Run `turn.config` on the bucket and time it; here int8 is faster.
//!         let seconds = if turn.config.route == Route::Fp32 { 2e-3 } else { 1e-3 };
//!         tuner.record(trial, seconds, &mut comm, 7)?;
//!     }
//! });
//! for c in chosen {
//!     assert_eq!(c?.codec, Some("int8".parse()?));
//! }
//! # Ok::<(), gradpack::Error>(())
//! ```

use core::fmt;
use std::collections::{BTreeMap, HashMap};

use super::plan::{Network, SMALL_TENSOR, Tensor};
use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::{Comm, Nodes, Strategy, Transport};
use crate::cost::{self, CodecProfile};
use crate::error::{Error, Result};
use crate::state::{BlobReader, BlobWriter};

const TUNER_MAGIC: [u8; 4] = *b"GPTU";

/// How a bucket is reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Route {
    /// The float32 all-reduce (a front end's own where it has one, as DDP's).
    Fp32,
    /// Each tensor's frame all-gathered and summed in rank order, every tensor with its
    /// own codec (small tensors in float32).
    AllGather,
    /// The compressed ring over the whole bucket.
    Ring,
    /// The two-shot all-reduce over the whole bucket: each chunk encoded once for its
    /// owner, summed and re-encoded there once, and gathered.
    TwoShot,
    /// The two-level all-reduce: float32 inside a node, the codec's ring between nodes.
    Hierarchical,
}

impl Route {
    /// Every route, in declaration order.
    pub const ALL: [Route; 5] = [
        Route::Fp32,
        Route::AllGather,
        Route::Ring,
        Route::Hierarchical,
        Route::TwoShot,
    ];

    /// Short name: `fp32`, `allgather`, `ring`, `hierarchical`, `twoshot`.
    pub fn name(self) -> &'static str {
        match self {
            Route::Fp32 => "fp32",
            Route::AllGather => "allgather",
            Route::Ring => "ring",
            Route::Hierarchical => "hierarchical",
            Route::TwoShot => "twoshot",
        }
    }

    /// The route whose [`Route::name`] is `name`.
    pub fn from_name(name: &str) -> Option<Route> {
        Route::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// One way to reduce a bucket: a codec and a route.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketConfig {
    /// The codec of the bucket's tensors that are not small (identity for
    /// [`Route::Fp32`]). `None`: each tensor with the configuration chosen for it in
    /// another bucket, by the all-gather (a layout made of tensors already decided, as
    /// when DDP regroups its buckets after the first step).
    pub codec: Option<CodecSpec>,
    /// The route.
    pub route: Route,
}

impl BucketConfig {
    /// The float32 all-reduce.
    pub fn fp32() -> BucketConfig {
        BucketConfig {
            codec: Some(CodecSpec::Identity(Identity)),
            route: Route::Fp32,
        }
    }

    /// The codec as text: its spec, or `mixed`.
    pub fn codec_name(&self) -> String {
        self.codec
            .as_ref()
            .map_or_else(|| "mixed".to_string(), ToString::to_string)
    }
}

impl fmt::Display for BucketConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} by {}", self.codec_name(), self.route.name())
    }
}

/// Options of a [`Tuner`]. Every rank must use the same.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneOptions {
    /// The codecs to choose from (identity among them allows float32 inside the
    /// two-level all-reduce).
    pub candidates: Vec<CodecSpec>,
    /// The routes to try besides float32 (default all-gather and ring;
    /// [`Route::Hierarchical`] needs `nodes`).
    pub routes: Vec<Route>,
    /// The link between ranks (between nodes, with `nodes`).
    pub network: Network,
    /// The link between ranks of one node, with `nodes` (default 40 Gbit/s and 5 us:
    /// shared memory).
    pub node_network: Network,
    /// The node of every rank, for [`Route::Hierarchical`].
    pub nodes: Option<Nodes>,
    /// Tensors with fewer elements go as float32 (default [`SMALL_TENSOR`]); so do
    /// tensors of at most one dimension.
    pub small_below: usize,
    /// A `dct` codec of `width=0` sends each matrix in 2-D tiles of its rows (see
    /// [`super::Policy::dct_2d`]).
    pub dct_2d: bool,
    /// How many of the modelled best configurations are measured against float32
    /// (default 2). 0: the model's pick is kept without measuring.
    pub trials: usize,
    /// Steps each configuration runs while measured; the best of them counts (default 2).
    pub trial_steps: usize,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            candidates: ["identity", "fp16", "int8"]
                .iter()
                .map(|s| s.parse().expect("valid spec"))
                .collect(),
            routes: vec![Route::AllGather, Route::Ring, Route::TwoShot],
            network: Network::default(),
            node_network: Network {
                bandwidth_bit_s: 40e9,
                latency_s: 5e-6,
            },
            nodes: None,
            small_below: SMALL_TENSOR,
            dct_2d: false,
            trials: 2,
            trial_steps: 2,
        }
    }
}

/// What a bucket does this step ([`Tuner::next`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The configuration to reduce it by.
    pub config: BucketConfig,
    /// While its plan is being measured: the plan's number, to hand its time to
    /// [`Tuner::record`] under. `None` once decided.
    pub trial: Option<usize>,
}

/// One row of a [`Tuner`]'s plan: a bucket and one configuration tried for it.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialRow {
    /// The bucket's index.
    pub bucket: usize,
    /// Tensors in the bucket.
    pub tensors: usize,
    /// Elements in the bucket.
    pub elements: usize,
    /// The configuration.
    pub config: BucketConfig,
    /// Its modelled time, seconds (`None` for a plan taken from other buckets'
    /// choices).
    pub modelled_s: Option<f64>,
    /// The mean over the ranks of each rank's best time, once every trial ran.
    pub measured_s: Option<f64>,
    /// Whether it is the configuration kept.
    pub chosen: bool,
}

/// The plan of one bucket layout.
#[derive(Debug, Clone, PartialEq)]
struct Trials {
    names: Vec<String>,
    elements: usize,
    configs: Vec<BucketConfig>,
    modelled: Vec<Option<f64>>,
    /// This rank's best time per configuration.
    times: Vec<f64>,
    /// Configurations handed out, and times recorded, counted in steps.
    runs: usize,
    recorded: usize,
    measured: Option<Vec<f64>>,
    choice: Option<usize>,
}

/// Measured `auto` (see the module docs).
#[derive(Debug, Clone)]
pub struct Tuner {
    opts: TuneOptions,
    world: usize,
    /// Speeds by codec spec: every candidate's and identity's.
    profiles: HashMap<String, CodecProfile>,
    plans: Vec<Trials>,
    /// Layout key -> plan number.
    by_layout: HashMap<String, usize>,
    /// Tensor name -> the configuration decided for it.
    choice: HashMap<String, BucketConfig>,
    /// Bucket index -> the plan it went by last.
    current: BTreeMap<usize, usize>,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Collective(msg.into())
}

/// Whether `route` is weighed for `codec`: as [`cost::candidates`] does, not the two-shot
/// for a sparse codec (its owner would re-select the sum of `p` selections).
fn offered(codec: &CodecSpec, route: Route) -> bool {
    !(route == Route::TwoShot && codec.sparse())
}

fn identity() -> CodecSpec {
    CodecSpec::Identity(Identity)
}

impl Tuner {
    /// A tuner for `world` ranks, with the measured speeds `profiles` of every
    /// candidate and of identity (matched by spec, as each profile's `spec` prints;
    /// every rank must pass the same, as averaged over the ranks).
    pub fn new(world: usize, opts: TuneOptions, profiles: Vec<CodecProfile>) -> Result<Tuner> {
        if world == 0 {
            return Err(bad("a tuner for a world of no ranks"));
        }
        if opts.candidates.is_empty() {
            return Err(bad("auto needs at least one candidate codec"));
        }
        if opts.trial_steps == 0 {
            return Err(bad("trial_steps must be at least 1"));
        }
        if opts.routes.is_empty() || opts.routes.contains(&Route::Fp32) {
            return Err(bad(
                "the routes to try are all-gather, ring, two-shot or hierarchical (float32 is \
                 always tried)",
            ));
        }
        if opts.routes.contains(&Route::Hierarchical) {
            match &opts.nodes {
                Some(n) if n.world() == world => {}
                Some(n) => {
                    return Err(bad(format!(
                        "the node map lists {} ranks; the world has {world}",
                        n.world()
                    )));
                }
                None => return Err(bad("the hierarchical route needs the ranks' nodes")),
            }
        }
        for n in [&opts.network, &opts.node_network] {
            let positive = n.bandwidth_bit_s > 0.0;
            if !positive || !n.latency_s.is_finite() || n.latency_s < 0.0 {
                return Err(bad(format!(
                    "a link of {} bit/s and {} s latency: give a positive bandwidth and a \
                     finite latency >= 0",
                    n.bandwidth_bit_s, n.latency_s
                )));
            }
        }
        // Keyed by the canonical spec, however the profile spells it.
        let profiles: HashMap<String, CodecProfile> = profiles
            .into_iter()
            .map(|p| {
                let key = p
                    .spec
                    .parse::<CodecSpec>()
                    .map_or(p.spec.clone(), |c| c.to_string());
                (key, p)
            })
            .collect();
        for c in opts.candidates.iter().chain([&identity()]) {
            let p = profiles
                .get(&c.to_string())
                .ok_or_else(|| bad(format!("no measured speeds for {c}")))?;
            let speeds = [
                p.encode_bytes_per_s,
                p.decode_bytes_per_s,
                p.decode_add_bytes_per_s,
            ];
            if !speeds.iter().all(|s| *s > 0.0) {
                return Err(bad(format!("the speeds of {c} must be positive")));
            }
        }
        Ok(Tuner {
            opts,
            world,
            profiles,
            plans: Vec::new(),
            by_layout: HashMap::new(),
            choice: HashMap::new(),
            current: BTreeMap::new(),
        })
    }

    /// The options.
    pub fn options(&self) -> &TuneOptions {
        &self.opts
    }

    /// The codec a tensor `t` is sent with when its bucket goes by `codec` on the
    /// all-gather ([`tensor_codec`] with this tuner's options).
    pub fn tensor_codec(&self, codec: &CodecSpec, t: &Tensor) -> Result<CodecSpec> {
        tensor_codec(codec, t, self.opts.small_below, self.opts.dct_2d)
    }

    /// `codec`'s speeds, with its bits per element at `elements`.
    fn profile(&self, codec: &CodecSpec, elements: usize) -> Result<CodecProfile> {
        let spec = codec.to_string();
        let p = self.profiles.get(&spec).ok_or_else(|| {
            bad(format!(
                "{spec} was not measured (not among the candidates)"
            ))
        })?;
        Ok(CodecProfile {
            spec,
            bits_per_element: codec.bits_per_element(elements.max(1)),
            ..p.clone()
        })
    }

    /// The cost model's time (s) of an all-reduce of `elements` elements with `codec` by
    /// `route`, on this tuner's world and links (identity by [`Route::Fp32`]: the
    /// float32 ring, summing at identity's measured add speed).
    pub fn time(&self, codec: &CodecSpec, route: Route, elements: usize) -> Result<f64> {
        self.time_at(codec, route, elements, self.opts.network.latency_s)
    }

    fn time_at(&self, codec: &CodecSpec, route: Route, elements: usize, lat: f64) -> Result<f64> {
        let p = self.profile(codec, elements)?;
        let net = &self.opts.network;
        let n = elements as f64;
        let world = u32::try_from(self.world).map_err(|_| bad("a world above u32::MAX ranks"))?;
        let flat = |s: Strategy, reduce: f64| {
            cost::allreduce_cost(s, &p, world, lat, n, reduce).time(net.bandwidth_bit_s)
        };
        Ok(match route {
            Route::Fp32 => flat(Strategy::Fp32Ring, p.decode_add_bytes_per_s),
            Route::AllGather => flat(Strategy::CompressedAllGather, f64::INFINITY),
            Route::Ring => flat(Strategy::CompressedRing, f64::INFINITY),
            Route::TwoShot => flat(Strategy::TwoShot, f64::INFINITY),
            Route::Hierarchical => {
                let nodes = self
                    .opts
                    .nodes
                    .as_ref()
                    .ok_or_else(|| bad("the hierarchical route needs the ranks' nodes"))?;
                let per_node = (0..nodes.count())
                    .map(|k| nodes.members(k).len())
                    .max()
                    .unwrap_or(1);
                let two = cost::TwoLevel {
                    nodes: nodes.count() as u32,
                    per_node: per_node as u32,
                    intra_bandwidth_bit_s: self.opts.node_network.bandwidth_bit_s,
                    intra_latency_s: self.opts.node_network.latency_s,
                    inter_bandwidth_bit_s: net.bandwidth_bit_s,
                    inter_latency_s: lat,
                };
                let s = if *codec == identity() {
                    Strategy::Fp32Ring
                } else {
                    Strategy::CompressedRing
                };
                let fp32 = self.profile(&identity(), elements)?;
                cost::hierarchical_time(s, &p, &two, n, 32.0, fp32.decode_add_bytes_per_s)
            }
        })
    }

    /// The modelled time (s) of a bucket of `tensors` by `route` with `codec`: the cost
    /// model's all-reduce (by the all-gather, the tensors that go as float32 apart) plus,
    /// with `staging` (bytes/s of a copy to the host and back), the two copies of a bucket
    /// that lives on a device.
    pub fn modelled(
        &self,
        codec: &CodecSpec,
        route: Route,
        tensors: &[Tensor],
        staging: Option<f64>,
    ) -> Result<f64> {
        let n = total(tensors)?;
        let lat = self.opts.network.latency_s;
        if route == Route::Fp32 {
            return self.time_at(&identity(), Route::Fp32, n, lat);
        }
        let staged = staging.map_or(0.0, |s| 2.0 * 4.0 * n as f64 / s);
        if route != Route::AllGather {
            return Ok(staged + self.time_at(codec, route, n, lat)?);
        }
        let mut packed = 0usize;
        for t in tensors {
            if self.tensor_codec(codec, t)? != identity() {
                packed += t.len()?;
            }
        }
        let mut time = staged;
        if packed > 0 {
            time += self.time_at(codec, Route::AllGather, packed, lat)?;
        }
        if n > packed {
            let lat = if packed > 0 { 0.0 } else { lat };
            time += self.time_at(&identity(), Route::AllGather, n - packed, lat)?;
        }
        Ok(time)
    }

    /// The candidate whose best route the model says is fastest for a tensor of
    /// `elements` elements, before anything is measured.
    pub fn modelled_best(&self, elements: usize) -> Result<CodecSpec> {
        let mut best: Option<(f64, CodecSpec)> = None;
        for c in &self.opts.candidates {
            let mut t = f64::INFINITY;
            for &r in &self.opts.routes {
                if !offered(c, r) {
                    continue;
                }
                let r = if *c == identity() && r != Route::Hierarchical {
                    Route::Fp32
                } else {
                    r
                };
                t = t.min(self.time(c, r, elements)?);
            }
            if best.as_ref().is_none_or(|b| t < b.0) {
                best = Some((t, *c));
            }
        }
        Ok(best.expect("at least one candidate").1)
    }

    /// The configuration bucket `bucket` (the front end's index of it) of `tensors`
    /// goes by this step: its plan's decision, or while that plan is measured the
    /// configuration whose turn it is, with the plan's number to [`Tuner::record`] its
    /// time under. A layout seen for the first time gets a plan: the configuration its
    /// tensors were given in other buckets, where every one of them was decided, else
    /// float32 and the model's `trials` fastest. `staging` as for [`Tuner::modelled`].
    pub fn next(
        &mut self,
        bucket: usize,
        tensors: &[Tensor],
        staging: Option<f64>,
    ) -> Result<Turn> {
        let n = total(tensors)?;
        let key = layout_key(tensors, n);
        let id = match self.by_layout.get(&key) {
            Some(&id) => id,
            None => {
                let plan = match self.derived(tensors, n)? {
                    Some(p) => p,
                    None => self.shortlist(tensors, n, staging)?,
                };
                self.plans.push(plan);
                let id = self.plans.len() - 1;
                self.by_layout.insert(key, id);
                id
            }
        };
        self.current.insert(bucket, id);
        let steps = self.opts.trial_steps;
        let p = &mut self.plans[id];
        if let Some(c) = p.choice {
            return Ok(Turn {
                config: p.configs[c].clone(),
                trial: None,
            });
        }
        let j = (p.runs / steps).min(p.configs.len() - 1);
        p.runs += 1;
        Ok(Turn {
            config: p.configs[j].clone(),
            trial: Some(id),
        })
    }

    /// A plan from the choices of the layout's tensors in other buckets, if every one
    /// was decided: their choice when they agree; each its own by the all-gather when
    /// none goes by a ring; else the choice that covers most elements.
    fn derived(&self, tensors: &[Tensor], n: usize) -> Result<Option<Trials>> {
        let mut got = Vec::with_capacity(tensors.len());
        for t in tensors {
            match self.choice.get(&t.name) {
                Some(c) => got.push((c.clone(), t.len()?)),
                None => return Ok(None),
            }
        }
        let mut kinds: Vec<(BucketConfig, usize)> = Vec::new();
        for (c, m) in got {
            match kinds.iter_mut().find(|k| k.0 == c) {
                Some(k) => k.1 += m,
                None => kinds.push((c, m)),
            }
        }
        let choice = if kinds.len() == 1 {
            kinds.swap_remove(0).0
        } else if kinds
            .iter()
            .all(|k| matches!(k.0.route, Route::Fp32 | Route::AllGather))
        {
            BucketConfig {
                codec: None,
                route: Route::AllGather,
            }
        } else {
            // The first of the heaviest.
            let mut best = 0;
            for (i, k) in kinds.iter().enumerate() {
                if k.1 > kinds[best].1 {
                    best = i;
                }
            }
            kinds.swap_remove(best).0
        };
        Ok(Some(Trials {
            names: tensors.iter().map(|t| t.name.clone()).collect(),
            elements: n,
            configs: vec![choice],
            modelled: vec![None],
            times: vec![f64::INFINITY],
            runs: 0,
            recorded: 0,
            measured: None,
            choice: Some(0),
        }))
    }

    /// A new plan: float32, then the `trials` configurations the model ranks fastest.
    fn shortlist(&self, tensors: &[Tensor], n: usize, staging: Option<f64>) -> Result<Trials> {
        let mut codecs: Vec<CodecSpec> = Vec::new();
        for c in self.opts.candidates.iter().copied().chain([identity()]) {
            if !codecs.contains(&c) {
                codecs.push(c);
            }
        }
        let mut ranked = Vec::new();
        for c in codecs {
            for &route in &self.opts.routes {
                if c == identity() && route != Route::Hierarchical {
                    continue; // float32 is always measured, by the front end's all-reduce
                }
                if !offered(&c, route) {
                    continue;
                }
                let t = self.modelled(&c, route, tensors, staging)?;
                ranked.push((
                    t,
                    BucketConfig {
                        codec: Some(c),
                        route,
                    },
                ));
            }
        }
        ranked.sort_by(|a, b| a.0.total_cmp(&b.0)); // stable: ties keep their order
        let fp32 = self.modelled(&identity(), Route::Fp32, tensors, staging)?;
        let mut configs = vec![BucketConfig::fp32()];
        let mut modelled = vec![Some(fp32)];
        let mut choice = None;
        if self.opts.trials == 0 {
            // No trials: the model's pick, unmeasured (float32 where nothing beats it).
            choice = Some(0);
            if let Some((t, c)) = ranked.into_iter().next() {
                modelled.push(Some(t));
                configs.push(c);
                if t < fp32 {
                    choice = Some(1);
                }
            }
        } else {
            ranked.truncate(self.opts.trials);
            for (t, c) in ranked {
                modelled.push(Some(t));
                configs.push(c);
            }
            if configs.len() == 1 {
                choice = Some(0); // nothing to try against float32
            }
        }
        let k = configs.len();
        Ok(Trials {
            names: tensors.iter().map(|t| t.name.clone()).collect(),
            elements: n,
            configs,
            modelled,
            times: vec![f64::INFINITY; k],
            runs: 0,
            recorded: 0,
            measured: None,
            choice,
        })
    }

    /// Record `seconds`, the time of a trial of plan `trial` ([`Turn::trial`]), in the
    /// order the turns were handed out, and after the plan's last trial share the times
    /// and decide: [`Tuner::note`], [`Tuner::share`] and [`Tuner::decide`] in one. The
    /// sharing is a call of `comm` on every rank (at the same point of each rank's
    /// sequence, as every bucket's reductions are). Returns whether the plan is decided
    /// now. `tag` goes into the envelopes.
    pub fn record<T: Transport + ?Sized>(
        &mut self,
        trial: usize,
        seconds: f64,
        comm: &mut Comm<T>,
        tag: u32,
    ) -> Result<bool> {
        match self.note(trial, seconds)? {
            None => Ok(false),
            Some(times) => match Tuner::share(comm, tag, &times) {
                Ok(means) => {
                    self.decide(trial, &means)?;
                    Ok(true)
                }
                Err(e) => {
                    self.restart(trial);
                    Err(e)
                }
            },
        }
    }

    /// Measure plan `trial` again from its first configuration, forgetting its times:
    /// what a front end calls on every rank when a trial's reduction or the sharing of
    /// the times failed (a failed collective fails on every rank), so that the ranks'
    /// plans stay in step and the next steps measure again instead of failing. A decided
    /// plan, or an unknown number, is left as it is.
    pub fn restart(&mut self, trial: usize) {
        if let Some(p) = self.plans.get_mut(trial).filter(|p| p.choice.is_none()) {
            p.runs = 0;
            p.recorded = 0;
            p.times.iter_mut().for_each(|t| *t = f64::INFINITY);
        }
    }

    /// Note `seconds`, the time of a trial of plan `trial`. Returns, after the plan's
    /// last trial, this rank's best time per configuration, for [`Tuner::share`].
    pub fn note(&mut self, trial: usize, seconds: f64) -> Result<Option<Vec<f64>>> {
        let steps = self.opts.trial_steps;
        let p = self
            .plans
            .get_mut(trial)
            .ok_or_else(|| bad(format!("no plan {trial} to record a trial of")))?;
        if p.choice.is_some() || p.recorded >= p.configs.len() * steps {
            return Err(bad(format!("plan {trial} has no trial left to record")));
        }
        if seconds.is_nan() || seconds < 0.0 {
            return Err(bad(format!("a trial time of {seconds} s")));
        }
        let j = p.recorded / steps;
        p.recorded += 1;
        p.times[j] = p.times[j].min(seconds);
        Ok((p.recorded == p.configs.len() * steps).then(|| p.times.clone()))
    }

    /// The mean over the ranks of each rank's `times` (every rank passes as many): one
    /// call of `comm` on every rank, each rank's times sent to every other (the crate's
    /// wire format, section 6.11), summed in rank order, so every rank gets the same
    /// bits. `tag` goes into the envelopes.
    pub fn share<T: Transport + ?Sized>(
        comm: &mut Comm<T>,
        tag: u32,
        times: &[f64],
    ) -> Result<Vec<f64>> {
        let p = comm.transport().size();
        if p <= 1 {
            return Ok(times.to_vec());
        }
        let all = comm.gather_f64(tag, times)?;
        Ok((0..times.len())
            .map(|i| all.iter().map(|r| r[i]).sum::<f64>() / p as f64)
            .collect())
    }

    /// Decide plan `trial` by `means` (one per configuration, as [`Tuner::share`] gives
    /// them): the smallest, float32 (the first) on a tie. Its tensors' choice is noted
    /// for layouts made of them later.
    pub fn decide(&mut self, trial: usize, means: &[f64]) -> Result<()> {
        let steps = self.opts.trial_steps;
        let p = self
            .plans
            .get_mut(trial)
            .ok_or_else(|| bad(format!("no plan {trial} to decide")))?;
        if p.choice.is_some() || p.recorded < p.configs.len() * steps {
            return Err(bad(format!("plan {trial} is not waiting for its times")));
        }
        if means.len() != p.configs.len() || means.iter().any(|t| t.is_nan()) {
            return Err(bad(format!(
                "plan {trial} has {} configurations; {} times given (or a NaN)",
                p.configs.len(),
                means.len()
            )));
        }
        let mut best = 0;
        for (i, &t) in means.iter().enumerate() {
            if t < means[best] {
                best = i;
            }
        }
        p.measured = Some(means.to_vec());
        p.choice = Some(best);
        let config = p.configs[best].clone();
        for name in p.names.clone() {
            self.choice.insert(name, config.clone());
        }
        Ok(())
    }

    /// Whether every bucket's plan (as of each bucket's last [`Tuner::next`]) is decided.
    pub fn decided(&self) -> bool {
        self.current
            .values()
            .all(|&id| self.plans[id].choice.is_some())
    }

    /// How many plans are decided.
    pub(crate) fn decided_plans(&self) -> usize {
        self.plans.iter().filter(|p| p.choice.is_some()).count()
    }

    /// The configuration decided for the tensor `name`, if any.
    pub fn choice_of(&self, name: &str) -> Option<&BucketConfig> {
        self.choice.get(name)
    }

    /// The plan of the buckets as of their last [`Tuner::next`]: a row per bucket and
    /// configuration tried.
    pub fn plan(&self) -> Vec<TrialRow> {
        let mut rows = Vec::new();
        for (&bucket, &id) in &self.current {
            let p = &self.plans[id];
            for (j, c) in p.configs.iter().enumerate() {
                rows.push(TrialRow {
                    bucket,
                    tensors: p.names.len(),
                    elements: p.elements,
                    config: c.clone(),
                    modelled_s: p.modelled[j],
                    measured_s: p.measured.as_ref().map(|m| m[j]),
                    chosen: p.choice == Some(j),
                });
            }
        }
        rows
    }

    /// [`Tuner::plan`] as a text table, the chosen rows marked with `*`.
    pub fn table(&self) -> String {
        let rows = self.plan();
        let name = |r: &TrialRow| match r.config.route {
            Route::Fp32 => "float32".to_string(),
            _ => r.config.codec_name(),
        };
        // The codec column as wide as its longest spec: nothing is cut.
        let w = rows.iter().map(|r| name(r).len()).max().unwrap_or(0).max(5);
        let mut out = String::from(
            "gradpack auto plan (per bucket: float32 and the modelled best, measured)\n",
        );
        out += &format!(
            "  {:>6} {:>7} {:>10}  {:<w$} {:<12} {:>9} {:>9}",
            "bucket", "tensors", "elements", "codec", "strategy", "model ms", "measured"
        );
        let ms = |v: Option<f64>| v.map_or(String::new(), |s| format!("{:.2}", 1e3 * s));
        for r in &rows {
            let codec = name(r);
            let strategy = match r.config.route {
                Route::Fp32 => "all-reduce",
                other => other.name(),
            };
            out += &format!(
                "\n{} {:>6} {:>7} {:>10}  {:<w$} {:<12} {:>9} {:>9}",
                if r.chosen { '*' } else { ' ' },
                r.bucket,
                r.tensors,
                r.elements,
                codec,
                strategy,
                ms(r.modelled_s),
                ms(r.measured_s)
            );
        }
        out
    }

    /// The decided plans and each tensor's choice, as a versioned, checksummed blob
    /// (plans still being measured are left out: a restored tuner measures them anew).
    pub fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(TUNER_MAGIC);
        let config = |w: &mut BlobWriter, c: &BucketConfig| {
            w.str(&c.codec_name()).str(c.route.name());
        };
        let decided: Vec<&Trials> = self.plans.iter().filter(|p| p.choice.is_some()).collect();
        w.u64(decided.len() as u64);
        for p in decided {
            w.u64(p.names.len() as u64);
            p.names.iter().for_each(|n| {
                w.str(n);
            });
            w.u64(p.elements as u64);
            w.u64(p.configs.len() as u64);
            for (j, c) in p.configs.iter().enumerate() {
                config(&mut w, c);
                w.u64(p.modelled[j].map_or(u64::MAX, f64::to_bits));
                w.u64(p.measured.as_ref().map_or(u64::MAX, |m| m[j].to_bits()));
            }
            w.u64(p.choice.expect("decided") as u64);
        }
        let mut names: Vec<(&String, &BucketConfig)> = self.choice.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        w.u64(names.len() as u64);
        for (n, c) in names {
            w.str(n);
            config(&mut w, c);
        }
        w.finish()
    }

    /// Restore a [`Tuner::save`]: its decided plans and choices replace this tuner's.
    /// A damaged blob, or one naming a codec that does not parse, is refused and leaves
    /// this tuner as it was.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, TUNER_MAGIC, "auto plan")?;
        let config = |r: &mut BlobReader<'_>| -> Result<BucketConfig> {
            let codec = r.str()?;
            let route = r.str()?;
            let route = Route::from_name(route)
                .ok_or_else(|| bad(format!("auto plan: unknown route {route:?}")))?;
            let codec = match codec {
                "mixed" if route == Route::AllGather => None,
                s => Some(s.parse::<CodecSpec>()?),
            };
            Ok(BucketConfig { codec, route })
        };
        let count = |r: &mut BlobReader<'_>| -> Result<usize> {
            let n = r.u64()?;
            usize::try_from(n)
                .ok()
                .filter(|&n| n <= blob.len())
                .ok_or_else(|| {
                    bad(format!(
                        "auto plan: a count of {n} in a blob of {} bytes",
                        blob.len()
                    ))
                })
        };
        let opt = |v: u64| (v != u64::MAX).then(|| f64::from_bits(v));
        let mut plans = Vec::new();
        let mut by_layout = HashMap::new();
        for id in 0..count(&mut r)? {
            let names = (0..count(&mut r)?)
                .map(|_| r.str().map(str::to_string))
                .collect::<Result<Vec<_>>>()?;
            let elements = count_usize(r.u64()?)?;
            let k = count(&mut r)?;
            let (mut configs, mut modelled, mut measured) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..k {
                configs.push(config(&mut r)?);
                modelled.push(opt(r.u64()?));
                measured.push(opt(r.u64()?));
            }
            let choice = count_usize(r.u64()?)?;
            if choice >= k {
                return Err(bad(format!(
                    "auto plan: choice {choice} of {k} configurations"
                )));
            }
            let measured: Option<Vec<f64>> = measured.into_iter().collect();
            let key = format!("{}#{elements}", names.join(","));
            by_layout.insert(key, id);
            plans.push(Trials {
                names,
                elements,
                configs,
                modelled,
                times: vec![f64::INFINITY; k],
                runs: 0,
                recorded: 0,
                measured,
                choice: Some(choice),
            });
        }
        let mut choice = HashMap::new();
        for _ in 0..count(&mut r)? {
            let name = r.str()?.to_string();
            choice.insert(name, config(&mut r)?);
        }
        r.end()?;
        self.plans = plans;
        self.by_layout = by_layout;
        self.choice = choice;
        self.current.clear();
        Ok(())
    }
}

fn count_usize(v: u64) -> Result<usize> {
    usize::try_from(v).map_err(|_| bad(format!("auto plan: {v} does not fit a usize")))
}

/// Elements of a bucket of `tensors`.
fn total(tensors: &[Tensor]) -> Result<usize> {
    tensors.iter().try_fold(0usize, |a, t| {
        a.checked_add(t.len()?)
            .ok_or_else(|| bad("a bucket of more elements than a usize holds"))
    })
}

/// The key of a bucket layout: its tensors' names and its size.
fn layout_key(tensors: &[Tensor], n: usize) -> String {
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    format!("{}#{n}", names.join(","))
}

/// The codec a tensor `t` is sent with when its bucket's codec is `codec`: identity
/// (float32) for tensors of fewer than `small_below` elements and for tensors of at most
/// one dimension (biases, norm scales); with `dct_2d`, a `dct` codec of `width=0` gets
/// `t`'s row length (the product of its dimensions after the first, 2 to `u32::MAX`) as
/// its width, so it transforms 2-D tiles of the matrix, as [`super::Policy::dct_2d`]
/// does for the sync engine. The PyTorch hook's per-tensor policy.
pub fn tensor_codec(
    codec: &CodecSpec,
    t: &Tensor,
    small_below: usize,
    dct_2d: bool,
) -> Result<CodecSpec> {
    let n = t.len()?;
    if n < small_below || t.shape.len() <= 1 {
        return Ok(identity());
    }
    match (dct_2d, codec) {
        (true, CodecSpec::Dct(d)) => Ok(super::plan::dct_rows(d, t).unwrap_or(*codec)),
        _ => Ok(*codec),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local;

    fn profiles(specs: &[&str]) -> Vec<CodecProfile> {
        specs
            .iter()
            .map(|s| CodecProfile {
                encode_bytes_per_s: 4e9,
                decode_bytes_per_s: 6e9,
                decode_add_bytes_per_s: 5e9,
                ..CodecProfile::nominal(*s, 32.0)
            })
            .collect()
    }

    fn tuner(trials: usize) -> Tuner {
        let opts = TuneOptions {
            candidates: vec!["int8".parse().unwrap(), "fp16".parse().unwrap()],
            network: Network {
                bandwidth_bit_s: 1e9,
                latency_s: 50e-6,
            },
            trials,
            trial_steps: 1,
            ..TuneOptions::default()
        };
        Tuner::new(2, opts, profiles(&["int8", "fp16", "identity"])).unwrap()
    }

    fn bucket(names: &[&str]) -> Vec<Tensor> {
        names.iter().map(|n| Tensor::new(*n, &[512, 512])).collect()
    }

    /// Run plan `trial` to its decision with `means`.
    fn decide(t: &mut Tuner, b: usize, ts: &[Tensor], means: &[f64]) -> usize {
        let mut id = None;
        for _ in means {
            let turn = t.next(b, ts, None).unwrap();
            id = turn.trial;
            let _ = t.note(id.unwrap(), 1.0).unwrap();
        }
        t.decide(id.unwrap(), means).unwrap();
        id.unwrap()
    }

    #[test]
    fn float32_first_then_the_modelled_best_and_ties_keep_float32() {
        let mut t = tuner(2);
        let ts = bucket(&["a", "b"]);
        let first = t.next(0, &ts, None).unwrap();
        assert_eq!(first.config, BucketConfig::fp32());
        // The shortlist is the model's order.
        let rows = t.plan();
        assert_eq!(rows.len(), 3);
        assert!(rows[1].modelled_s.unwrap() <= rows[2].modelled_s.unwrap());
        let mut t = tuner(2);
        decide(&mut t, 0, &ts, &[1.0, 1.0, 1.0]);
        assert_eq!(t.choice_of("a"), Some(&BucketConfig::fp32()));
        let mut t = tuner(2);
        decide(&mut t, 0, &ts, &[1.0, 2.0, 0.5]);
        assert_eq!(t.choice_of("b"), Some(&t.plan()[2].config));
        // The table names every codec in full.
        let table = t.table();
        for r in t.plan().iter().skip(1) {
            assert!(table.contains(&r.config.codec_name()), "{table}");
        }
        // Decided: no more trials, and a layout of decided tensors takes their choice.
        assert_eq!(t.next(0, &ts, None).unwrap().trial, None);
        let turn = t.next(1, &bucket(&["b"]), None).unwrap();
        assert_eq!((turn.trial, &turn.config), (None, &t.plan()[2].config));
    }

    #[test]
    fn layouts_of_tensors_decided_apart_mix_or_follow_the_heaviest() {
        for route in [Route::AllGather, Route::Ring] {
            let mut t = tuner(1);
            t.opts.routes = vec![route];
            decide(&mut t, 0, &bucket(&["a"]), &[1.0, 2.0]); // float32
            decide(&mut t, 1, &[Tensor::new("b", &[512, 1024])], &[2.0, 1.0]);
            let b = t.choice_of("b").unwrap().clone();
            assert_eq!(b.route, route);
            let turn = t.next(
                2,
                &[Tensor::new("b", &[512, 1024]), bucket(&["a"]).remove(0)],
                None,
            );
            let turn = turn.unwrap();
            assert_eq!(turn.trial, None);
            if route == Route::AllGather {
                // Each its own codec, by the all-gather.
                assert_eq!(
                    turn.config,
                    BucketConfig {
                        codec: None,
                        route: Route::AllGather
                    }
                );
            } else {
                // A ring among them: the choice of the most elements (b's).
                assert_eq!(turn.config, b);
            }
        }
    }

    #[test]
    fn no_trials_keeps_the_model_pick_unmeasured() {
        let mut t = tuner(0);
        let ts = bucket(&["a"]);
        let turn = t.next(0, &ts, None).unwrap();
        assert_eq!(turn.trial, None);
        let rows = t.plan();
        let kept = rows.iter().find(|r| r.chosen).unwrap();
        let best = rows
            .iter()
            .map(|r| r.modelled_s.unwrap())
            .fold(f64::INFINITY, f64::min);
        assert_eq!(kept.modelled_s.unwrap(), best);
    }

    #[test]
    fn saved_plans_restore_and_damage_is_refused() {
        let mut t = tuner(2);
        let ts = bucket(&["a", "b"]);
        decide(&mut t, 0, &ts, &[2.0, 1.0, 3.0]);
        let _ = t.next(1, &bucket(&["c"]), None).unwrap(); // still measured: not saved
        let blob = t.save();
        let mut u = tuner(2);
        u.restore(&blob).unwrap();
        assert_eq!(u.choice_of("a"), t.choice_of("a"));
        let turn = u.next(0, &ts, None).unwrap();
        assert_eq!(turn.trial, None);
        assert_eq!(u.plan(), t.plan()[..3].to_vec());
        assert_eq!(
            u.next(1, &bucket(&["c"]), None).unwrap().config,
            BucketConfig::fp32()
        );
        for at in [0, blob.len() / 2, blob.len() - 1] {
            let mut bad = blob.clone();
            bad[at] ^= 0x40;
            let before = u.save();
            assert!(u.restore(&bad).is_err(), "byte {at}");
            assert_eq!(u.save(), before);
        }
    }

    #[test]
    fn a_restarted_plan_measures_again_from_float32() {
        let mut t = tuner(2);
        let ts = bucket(&["a"]);
        let id = t.next(0, &ts, None).unwrap().trial.unwrap();
        let _ = t.note(id, 1.0).unwrap();
        let second = t.next(0, &ts, None).unwrap().config;
        t.restart(id); // the second trial's reduction failed
        assert_eq!(t.next(0, &ts, None).unwrap().config, BucketConfig::fp32());
        let _ = t.note(id, 5.0).unwrap();
        assert_eq!(t.next(0, &ts, None).unwrap().config, second);
        // A decided plan is not restarted.
        let _ = t.note(id, 1.0).unwrap();
        let third = t.next(0, &ts, None).unwrap();
        let times = t
            .note(third.trial.unwrap(), 2.0)
            .unwrap()
            .expect("the last trial");
        assert_eq!(
            times,
            vec![5.0, 1.0, 2.0],
            "the times before the restart are gone"
        );
        t.decide(id, &times).unwrap();
        t.restart(id);
        assert_eq!(t.next(0, &ts, None).unwrap().trial, None);
    }

    #[test]
    fn bad_input_is_an_error() {
        let opts = TuneOptions::default();
        assert!(Tuner::new(0, opts.clone(), profiles(&["identity", "fp16", "int8"])).is_err());
        assert!(Tuner::new(2, opts.clone(), profiles(&["fp16", "int8"])).is_err());
        let hier = TuneOptions {
            routes: vec![Route::Hierarchical],
            ..opts.clone()
        };
        assert!(Tuner::new(2, hier, profiles(&["identity", "fp16", "int8"])).is_err());
        let mut t = tuner(2);
        let ts = bucket(&["a"]);
        let id = t.next(0, &ts, None).unwrap().trial.unwrap();
        assert!(t.note(id, f64::NAN).is_err());
        assert!(t.note(id + 7, 1.0).is_err());
        assert!(t.decide(id, &[1.0, 2.0, 3.0]).is_err(), "trials left");
        let _ = t.note(id, 1.0).unwrap();
        for _ in 0..2 {
            let turn = t.next(0, &ts, None).unwrap();
            let _ = t.note(turn.trial.unwrap(), 1.0).unwrap();
        }
        assert!(t.decide(id, &[1.0]).is_err());
        assert!(t.note(id, 1.0).is_err(), "no trial left");
    }

    #[test]
    fn ranks_share_their_times_and_decide_alike() {
        let res = local::run(3, None, |comm| {
            let rank = comm.rank();
            let mut comm = Comm::new(comm.into_inner());
            let mut t = Tuner {
                world: 3,
                ..tuner(2)
            };
            let ts = bucket(&["a"]);
            loop {
                let turn = t.next(0, &ts, None)?;
                let Some(id) = turn.trial else {
                    return Ok((turn.config, t.plan()));
                };
                // Rank 2 finds the second trial fastest by far; the mean decides.
                let secs = match (rank, turn.config.route) {
                    (_, Route::Fp32) => 1.0,
                    (2, _) if t.plan()[1].config == turn.config => 0.1,
                    _ => 0.9,
                };
                t.record(id, secs, &mut comm, 9)?;
            }
        });
        let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
        for r in &res {
            assert_eq!(r, &res[0]);
        }
        let measured: Vec<f64> = res[0].1.iter().map(|r| r.measured_s.unwrap()).collect();
        assert_eq!(measured[0], 1.0);
        assert!((measured[1] - (0.9 + 0.9 + 0.1) / 3.0).abs() < 1e-12);
        assert_eq!(res[0].0, res[0].1[1].config);
    }
}
