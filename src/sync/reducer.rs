//! [`BucketReducer`]: everything a front end that forms its own buckets (the PyTorch
//! hook; a candle or tch one) decides and runs for a bucket, over the crate's
//! collectives, with its state kept by tensor name.

use std::collections::HashMap;

use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::{
    AllReduce, AllReduceOptions, BucketGather, Comm, Feedback, Hierarchical, Nodes, ReduceOp,
    StrategyChoice, Transport, tensor_seed,
};
use crate::cost::Strategy;
use crate::error::{Error, Result};
use crate::feedback::FeedbackOptions;

use super::TensorGather;
use super::defaults::{default_strategy, wants_feedback};
use super::lowrank::{MatrixState, PowerSgdByName, step_seed};
use super::model::{HeldTensor, ModelSelection};
use super::named::NamedState;
use super::plan::{PowerSgd, Tensor};
use super::tune::{Route, Tuner, tensor_codec};

/// The all-gather's tag of the one top-k over the model (bucket indices are small).
const MODEL_TAG: u32 = u32::MAX;
/// PowerSGD's two float32 all-reduces of a bucket: their tags' high bits.
const P_KIND: u32 = 0x4000_0000;
const Q_KIND: u32 = 0x8000_0000;
const IDENTITY: CodecSpec = CodecSpec::Identity(Identity);

/// How a bucket goes at a step (see [`ReducerOptions::config`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Way {
    /// A float32 all-reduce of the whole bucket (the front end may run its own).
    Fp32,
    /// Each tensor with its codec, all-gathered and summed in rank order.
    AllGather,
    /// The compressed ring on the whole bucket.
    Ring,
    /// The two-shot all-reduce on the whole bucket.
    TwoShot,
    /// The two-level all-reduce on the whole bucket.
    Hierarchical,
    /// signSGD's majority vote on the whole bucket.
    Majority,
    /// The bucket's matrices as PowerSGD factors, the other tensors by the all-gather.
    PowerSgd,
}

impl Way {
    /// Every way.
    pub const ALL: [Way; 7] = [
        Way::Fp32,
        Way::AllGather,
        Way::Ring,
        Way::TwoShot,
        Way::Hierarchical,
        Way::Majority,
        Way::PowerSgd,
    ];

    /// Short name: `fp32`, `allgather`, `ring`, `twoshot`, `hierarchical`, `majority`,
    /// `powersgd`.
    pub fn name(self) -> &'static str {
        match self {
            Way::Fp32 => "fp32",
            Way::AllGather => "allgather",
            Way::Ring => "ring",
            Way::TwoShot => "twoshot",
            Way::Hierarchical => "hierarchical",
            Way::Majority => "majority",
            Way::PowerSgd => "powersgd",
        }
    }

    /// The way whose [`Way::name`] is `name`.
    pub fn from_name(name: &str) -> Option<Way> {
        Way::ALL.into_iter().find(|w| w.name() == name)
    }

    fn of_route(r: Route) -> Way {
        match r {
            Route::Fp32 => Way::Fp32,
            Route::AllGather => Way::AllGather,
            Route::Ring => Way::Ring,
            Route::TwoShot => Way::TwoShot,
            Route::Hierarchical => Way::Hierarchical,
        }
    }

    /// Whether it runs one collective on the whole bucket.
    fn whole(self) -> bool {
        matches!(
            self,
            Way::Ring | Way::TwoShot | Way::Hierarchical | Way::Majority
        )
    }
}

/// A bucket's configuration at a step: its codec (`None`: each tensor with the choice
/// measured `auto` made for it in another bucket), the way, and measured `auto`'s plan
/// number while that plan is measured (record the bucket's time with [`Tuner::note`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketTurn {
    /// The codec of the bucket's tensors that are not small; `None`: mixed.
    pub codec: Option<CodecSpec>,
    /// How the bucket goes.
    pub way: Way,
    /// The plan being measured, if any.
    pub trial: Option<usize>,
}

/// What [`BucketReducer`] is made with.
#[derive(Debug, Clone)]
pub struct ReducerOptions {
    /// The codec, or `None` for measured `auto` (the [`Tuner`] passed to
    /// [`ReducerOptions::config`] decides).
    pub codec: Option<CodecSpec>,
    /// The way of a fixed codec (one of the all-gather, ring, two-shot, two-level and
    /// majority); `None`: [`default_strategy`] at the world's size.
    pub way: Option<Way>,
    /// Error feedback forced on or off; `None`: [`wants_feedback`]'s default.
    pub feedback: Option<bool>,
    /// The base of every seed.
    pub seed: u64,
    /// Seal frames with a CRC-32.
    pub checksum: bool,
    /// Pieces per ring chunk.
    pub pieces: usize,
    /// Tensors under this many elements, and vectors, go as float32.
    pub small_below: usize,
    /// A `dct` codec of `width=0` in 2-D tiles of each matrix.
    pub dct_2d: bool,
    /// Steps before this one go as float32.
    pub start_step: u64,
    /// The two-level all-reduce's codec inside a node.
    pub node_codec: CodecSpec,
    /// PowerSGD's settings and its start step.
    pub powersgd: Option<(PowerSgd, u64)>,
    /// One top-k over the model: the model's tensor names in order.
    pub selection: Option<Vec<String>>,
}

impl Default for ReducerOptions {
    /// int8 by its default strategy, no PowerSGD, the policy's small-tensor rule.
    fn default() -> Self {
        ReducerOptions {
            codec: Some("int8".parse().expect("a codec")),
            way: None,
            feedback: None,
            seed: 0,
            checksum: false,
            pieces: 1,
            small_below: super::SMALL_TENSOR,
            dct_2d: false,
            start_step: 0,
            node_codec: IDENTITY,
            powersgd: None,
            selection: None,
        }
    }
}

impl ReducerOptions {
    /// The (position, (n, m, r)) of the tensors sent as PowerSGD factors at `step`.
    fn low_rank_of(&self, layout: &[Tensor], step: u64) -> Vec<(usize, (usize, usize, usize))> {
        let Some((s, start)) = &self.powersgd else {
            return Vec::new();
        };
        if step < (*start).max(self.start_step) {
            return Vec::new();
        }
        layout
            .iter()
            .enumerate()
            .filter_map(|(i, t)| s.matrix_of(t).map(|m| (i, m)))
            .collect()
    }

    /// The configuration of bucket `index` (its tensors `layout`) at `step` on `world`
    /// ranks: float32 before the start step or alone, else the fixed codec by its way
    /// (or its default strategy), or measured `auto`'s next turn from `tuner`
    /// (`staging`: bytes/s of a copy to the host and back, for a bucket on a device);
    /// [`Way::PowerSgd`] where PowerSGD takes some of its matrices.
    pub fn config(
        &self,
        index: usize,
        step: u64,
        world: usize,
        layout: &[Tensor],
        staging: Option<f64>,
        tuner: Option<&mut Tuner>,
    ) -> Result<BucketTurn> {
        let fp32 = BucketTurn {
            codec: Some(IDENTITY),
            way: Way::Fp32,
            trial: None,
        };
        if world <= 1 || step < self.start_step {
            return Ok(fp32);
        }
        let low = !self.low_rank_of(layout, step).is_empty();
        let mut turn = match self.codec {
            None => {
                let t = tuner.ok_or_else(|| bad("measured auto needs its tuner"))?;
                let got = t.next(index, layout, staging)?;
                BucketTurn {
                    codec: got.config.codec,
                    way: Way::of_route(got.config.route),
                    trial: got.trial,
                }
            }
            Some(c) if c == IDENTITY && !low => return Ok(fp32),
            Some(c) => BucketTurn {
                codec: Some(c),
                way: match self.way {
                    Some(w) => w,
                    None if c == IDENTITY => Way::Fp32,
                    None => match default_strategy(&c, world) {
                        Strategy::CompressedRing => Way::Ring,
                        _ => Way::AllGather,
                    },
                },
                trial: None,
            },
        };
        if low {
            turn.way = Way::PowerSgd;
        }
        Ok(turn)
    }

    /// How a bucket of `layout` goes by `codec` and `way` at `step`: each tensor's
    /// codec (a mixed bucket's from `tuner`'s choices), PowerSGD's matrices, the whole
    /// bucket's codec, and whether it is a plain float32 all-reduce.
    pub fn decide(
        &self,
        layout: &[Tensor],
        codec: Option<CodecSpec>,
        way: Way,
        step: u64,
        tuner: Option<&Tuner>,
    ) -> Result<Decision> {
        let (small, dct) = (self.small_below, self.dct_2d);
        let mut codecs = Vec::with_capacity(layout.len());
        for t in layout {
            let b = match codec {
                Some(b) => b,
                None => {
                    let tuner = tuner.ok_or_else(|| bad("a mixed bucket needs the tuner"))?;
                    match tuner.choice_of(&t.name) {
                        Some(c) if c.route == Route::Fp32 => IDENTITY,
                        Some(c) => c.codec.ok_or_else(|| bad("a mixed choice"))?,
                        None => return Err(bad(format!("no choice for {:?}", t.name))),
                    }
                }
            };
            codecs.push(tensor_codec(&b, t, small, dct)?);
        }
        let low_rank = if way == Way::PowerSgd {
            self.low_rank_of(layout, step)
        } else {
            Vec::new()
        };
        let ring = if way.whole() {
            let b = codec
                .ok_or_else(|| bad(format!("{} runs one codec on the whole bucket", way.name())))?;
            let n: usize = layout.iter().map(elements).sum();
            Some(tensor_codec(&b, &Tensor::new("", &[n, 1]), small, dct)?)
        } else {
            None
        };
        let plain = low_rank.is_empty()
            && way != Way::Hierarchical
            && (way == Way::Fp32
                || codecs.iter().all(|c| *c == IDENTITY)
                || ring == Some(IDENTITY));
        Ok(Decision {
            codecs,
            low_rank,
            ring,
            plain,
            way,
        })
    }
}

/// How a bucket goes once its tensors' codecs are known (see [`ReducerOptions::decide`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    codecs: Vec<CodecSpec>,
    low_rank: Vec<(usize, (usize, usize, usize))>,
    ring: Option<CodecSpec>,
    plain: bool,
    way: Way,
}

impl Decision {
    /// Whether the bucket is a float32 all-reduce of the whole bucket, which
    /// [`BucketReducer::run`] leaves to the front end (a float64 bucket's may then be
    /// summed in float64).
    pub fn plain(&self) -> bool {
        self.plain
    }
}

/// A new collective's transport: through the shared memory of this host's ranks
/// (`false`), or of this host's ranks in this rank's node (`true`, for the two-level
/// all-reduce).
pub type Connector<T> = Box<dyn FnMut(bool) -> Result<T> + Send>;

struct Gather<T: Transport> {
    inner: BucketGather,
    comm: Comm<T>,
    send: Vec<u8>,
}

enum Whole<T: Transport> {
    Flat(AllReduce, Comm<T>),
    TwoLevel(Hierarchical, Comm<T>),
}

impl<T: Transport> Whole<T> {
    fn save(&self) -> Vec<Vec<u8>> {
        match self {
            Whole::Flat(a, _) => vec![a.save()],
            Whole::TwoLevel(h, _) => h.save(),
        }
    }

    fn codec(&self) -> CodecSpec {
        match self {
            Whole::Flat(a, _) => a.codec(),
            Whole::TwoLevel(h, _) => h.codec(),
        }
    }
}

/// The layout of a whole-bucket collective: its tensors' names, elements, codec, way.
type WholeKey = (String, usize, String, Way);

/// Everything a front end that forms its own buckets decides and runs for a bucket: the
/// step's configuration ([`ReducerOptions::config`]: the float32 warm-up, the codec's
/// default strategy, or measured `auto`'s [`Tuner`]), each tensor's codec
/// ([`tensor_codec`]), which matrices go as PowerSGD factors, and the bucket's reduction
/// by the crate's collectives with their error feedback: the all-gather per tensor
/// ([`TensorGather`], residuals by name), the ring, two-shot, majority vote or
/// two-level all-reduce per bucket layout, PowerSGD's exchange ([`PowerSgdByName`]), or
/// one top-k over the model ([`ModelSelection`]). Its state saves as a [`NamedState`].
///
/// Every rank makes it alike and hands it the same buckets in the same order; each
/// reduced bucket holds its mean over the ranks, the same bits on every rank.
pub struct BucketReducer<T: Transport> {
    opts: ReducerOptions,
    connect: Option<Connector<T>>,
    size: usize,
    nodes: Option<Vec<usize>>,
    gather: TensorGather,
    model: Option<ModelSelection>,
    low_rank: Option<PowerSgdByName>,
    gathers: HashMap<u32, Gather<T>>,
    wholes: HashMap<WholeKey, Whole<T>>,
    /// Bucket index to the key of its whole-bucket collective now.
    now: HashMap<u32, WholeKey>,
    /// Saved whole-bucket collectives by their names, taken up when the layout comes.
    saved: HashMap<String, Vec<Vec<u8>>>,
    /// PowerSGD's float32 all-reduces by (bucket, kind, length).
    factors: HashMap<(u32, u32, usize), (AllReduce, Comm<T>)>,
}

/// Collective `index`'s all-gather in `gathers` (made on first use by `connect`).
fn gather_in<'a, T: Transport>(
    gathers: &'a mut HashMap<u32, Gather<T>>,
    connect: &mut Option<Connector<T>>,
    index: u32,
) -> Result<&'a mut Gather<T>> {
    use std::collections::hash_map::Entry as Slot;
    match gathers.entry(index) {
        Slot::Occupied(o) => Ok(o.into_mut()),
        Slot::Vacant(v) => {
            let connect = connect.as_mut().ok_or_else(|| bad("not connected"))?;
            let t = connect(false)?;
            let inner = BucketGather::new(&t, index, ReduceOp::Mean)?;
            Ok(v.insert(Gather {
                inner,
                comm: Comm::new(t),
                send: Vec::new(),
            }))
        }
    }
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Collective(msg.into())
}

fn elements(t: &Tensor) -> usize {
    t.shape.iter().product()
}

impl<T: Transport> BucketReducer<T> {
    /// A reducer with `opts` (checked), not yet connected.
    pub fn new(opts: ReducerOptions) -> Result<BucketReducer<T>> {
        if opts.pieces == 0 {
            return Err(bad("pieces must be at least 1"));
        }
        if matches!(opts.way, Some(Way::Fp32 | Way::PowerSgd)) {
            return Err(bad(
                "a fixed codec's way is a strategy, not fp32 or powersgd",
            ));
        }
        if let Some((s, _)) = &opts.powersgd {
            s.check()?;
        }
        let model = match &opts.selection {
            Some(order) => {
                let c = opts
                    .codec
                    .ok_or_else(|| bad("selection over the model needs a fixed top-k codec"))?;
                let fb = wants_feedback(&c, opts.feedback);
                Some(ModelSelection::new(
                    c,
                    fb,
                    opts.small_below,
                    opts.dct_2d,
                    order,
                )?)
            }
            None => None,
        };
        let low_rank = match &opts.powersgd {
            Some((s, _)) => Some(PowerSgdByName::new(*s)?),
            None => None,
        };
        Ok(BucketReducer {
            gather: TensorGather::new(opts.feedback),
            opts,
            connect: None,
            size: 0,
            nodes: None,
            model,
            low_rank,
            gathers: HashMap::new(),
            wholes: HashMap::new(),
            now: HashMap::new(),
            saved: HashMap::new(),
            factors: HashMap::new(),
        })
    }

    /// The options.
    pub fn options(&self) -> &ReducerOptions {
        &self.opts
    }

    /// Connect to a world of `size` ranks: `connect` makes each new collective's
    /// transport; `nodes` (the node of every rank) is needed by the two-level
    /// all-reduce. Collectives made before are dropped (their state kept).
    pub fn connect(
        &mut self,
        size: usize,
        nodes: Option<Vec<usize>>,
        connect: Connector<T>,
    ) -> Result<()> {
        if size == 0 || nodes.as_ref().is_some_and(|n| n.len() != size) {
            return Err(bad(format!(
                "a world of {size} ranks with nodes for {:?}",
                nodes.as_ref().map(Vec::len)
            )));
        }
        self.disconnect();
        self.size = size;
        self.nodes = nodes;
        self.connect = Some(connect);
        Ok(())
    }

    /// Drop the transport and every collective made on it; their state is kept (a ring
    /// of a layout in use is saved, and taken up when its layout comes again).
    pub fn disconnect(&mut self) {
        for (k, w) in std::mem::take(&mut self.wholes) {
            self.saved.insert(k.0, w.save());
        }
        self.now.clear();
        self.gathers.clear();
        self.factors.clear();
        self.connect = None;
    }

    /// Reduce the bucket `x` (its tensors `layout` laid end to end, `key` each seeding
    /// its frames) of `step` into its mean over the ranks, as `d` says. Returns `false`,
    /// and leaves `x` as it is, when the bucket is a plain float32 all-reduce for the
    /// front end to run; `measured_fp32` runs even that one here, as float32 frames
    /// all-gathered and summed in rank order (measured `auto` at two ranks, so that a
    /// plan restored into another grouping continues bit for bit).
    pub fn run(
        &mut self,
        x: &mut [f32],
        index: u32,
        step: u64,
        layout: &[HeldTensor],
        d: &Decision,
        measured_fp32: bool,
    ) -> Result<bool> {
        if self.connect.is_none() {
            return Err(bad("the reducer is not connected"));
        }
        if self.size <= 1 {
            return Ok(true);
        }
        if d.plain && !(measured_fp32 && self.opts.codec.is_none() && self.size == 2) {
            return Ok(false);
        }
        let n: usize = layout.iter().map(|h| elements(&h.tensor)).sum();
        if n != x.len() || d.codecs.len() != layout.len() {
            return Err(bad(format!(
                "the layout holds {n} elements in {} tensors, the bucket {} (decided for {})",
                layout.len(),
                x.len(),
                d.codecs.len()
            )));
        }
        if !d.low_rank.is_empty() {
            self.powersgd(x, index, step, layout, d)?;
        } else if d.plain {
            self.all_gather(x, index, step, layout, &vec![Some(IDENTITY); layout.len()])?;
        } else if let Some(ring) = d.ring {
            self.whole(x, index, step, layout, ring, d.way)?;
        } else {
            let codecs: Vec<_> = d.codecs.iter().map(|c| Some(*c)).collect();
            self.all_gather(x, index, step, layout, &codecs)?;
        }
        Ok(true)
    }

    /// One top-k over the model: a step's `buckets` reduced together (see
    /// [`ModelSelection::reduce`]), by the all-gather of its own tag.
    pub fn reduce_model(
        &mut self,
        buckets: &mut [(&mut [f32], &[HeldTensor])],
        step: u64,
    ) -> Result<()> {
        let (seed, checksum) = (self.opts.seed, self.opts.checksum);
        let g = gather_in(&mut self.gathers, &mut self.connect, MODEL_TAG)?;
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        let sel = self
            .model
            .as_mut()
            .ok_or_else(|| bad("this reducer was made without selection over the model"))?;
        sel.reduce(inner, comm, send, buckets, seed, step, checksum)?;
        Ok(())
    }

    /// The bucket's tensors encoded (each with its codec, seed and residual),
    /// all-gathered and summed in rank order; a tensor whose codec is `None` is left.
    fn all_gather(
        &mut self,
        x: &mut [f32],
        index: u32,
        step: u64,
        layout: &[HeldTensor],
        codecs: &[Option<CodecSpec>],
    ) -> Result<()> {
        let (seed, checksum) = (self.opts.seed, self.opts.checksum);
        let tensors: Vec<(HeldTensor, Option<CodecSpec>)> =
            layout.iter().cloned().zip(codecs.iter().copied()).collect();
        let g = gather_in(&mut self.gathers, &mut self.connect, index)?;
        let (inner, comm, send) = (&mut g.inner, &mut g.comm, &mut g.send);
        self.gather
            .reduce(inner, comm, send, x, &tensors, seed, step, checksum)?;
        Ok(())
    }

    /// The bucket's whole-bucket collective of its layout, made on first use (with a
    /// saved state taken up), then run in place.
    fn whole(
        &mut self,
        x: &mut [f32],
        index: u32,
        step: u64,
        layout: &[HeldTensor],
        codec: CodecSpec,
        way: Way,
    ) -> Result<()> {
        let names = layout
            .iter()
            .map(|h| h.tensor.name.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let key: WholeKey = (names.clone(), x.len(), codec.to_string(), way);
        if !self.wholes.contains_key(&key) {
            let opts = AllReduceOptions {
                op: ReduceOp::Mean,
                // The two-level all-reduce's streams between nodes by the cost model's
                // choice on a 10 Gbit/s, 10 us link; the others as named.
                strategy: match way {
                    Way::Hierarchical => StrategyChoice::Auto {
                        bandwidth_bit_s: 10e9,
                        latency_s: 10e-6,
                        profile: None,
                    },
                    Way::TwoShot => StrategyChoice::Forced(Strategy::TwoShot),
                    Way::Majority => StrategyChoice::Forced(Strategy::SignMajority),
                    _ => StrategyChoice::Forced(Strategy::CompressedRing),
                },
                feedback: if wants_feedback(&codec, self.opts.feedback) {
                    Feedback::WorkerAndOwner
                } else {
                    Feedback::None
                },
                feedback_options: FeedbackOptions::default(),
                checksum: self.opts.checksum,
                tag: index,
                pieces: if way == Way::Majority {
                    1
                } else {
                    self.opts.pieces
                },
            };
            let connect = self.connect.as_mut().ok_or_else(|| bad("not connected"))?;
            let mut w = if way == Way::Hierarchical {
                let nodes = self
                    .nodes
                    .clone()
                    .ok_or_else(|| bad("the two-level all-reduce needs nodes (connect)"))?;
                let t = connect(true)?;
                let h = Hierarchical::new(
                    codec,
                    self.opts.node_codec,
                    x.len(),
                    &t,
                    Nodes::new(nodes)?,
                    opts,
                )?;
                Whole::TwoLevel(h, Comm::new(t))
            } else {
                let t = connect(false)?;
                Whole::Flat(AllReduce::new(codec, x.len(), &t, opts)?, Comm::new(t))
            };
            if let Some(saved) = self.saved.remove(&names) {
                match (&mut w, saved.as_slice()) {
                    (Whole::Flat(a, _), [blob]) => a.restore(blob)?,
                    (Whole::TwoLevel(h, _), blobs) => h.restore(blobs)?,
                    (Whole::Flat(..), _) => {
                        return Err(Error::Checkpoint(format!(
                            "the saved all-reduce of {names:?} has {} blobs, not 1",
                            saved.len()
                        )));
                    }
                }
            }
            self.wholes.insert(key.clone(), w);
        }
        if let Some(old) = self.now.insert(index, key.clone())
            && old != key
        {
            self.wholes.remove(&old); // the front end regrouped: that layout is gone
        }
        // The crate mixes the rank into the seed itself: the same base on every rank.
        let seed = tensor_seed(&codec, self.opts.seed, step, u64::from(index), 0);
        match self.wholes.get_mut(&key).expect("made above") {
            Whole::Flat(a, c) => a.run_in_place(c, x, seed)?,
            Whole::TwoLevel(h, c) => h.run_in_place(c, x, seed)?,
        };
        Ok(())
    }

    /// A bucket whose matrices go as PowerSGD factors: the crate's whole step (their `P`
    /// in one float32 all-reduce with the bucket's float32 tensors, their `Q` in a
    /// second), then the tensors of other codecs by the all-gather.
    fn powersgd(
        &mut self,
        x: &mut [f32],
        index: u32,
        step: u64,
        layout: &[HeldTensor],
        d: &Decision,
    ) -> Result<()> {
        let mut starts = Vec::with_capacity(layout.len());
        let mut at = 0usize;
        for h in layout {
            starts.push(at);
            at += elements(&h.tensor);
        }
        let lr: Vec<usize> = d.low_rank.iter().map(|&(i, _)| i).collect();
        let names: Vec<String> = lr.iter().map(|&i| layout[i].tensor.name.clone()).collect();
        let placed: Vec<(usize, (usize, usize, usize))> =
            d.low_rank.iter().map(|&(i, m)| (starts[i], m)).collect();
        let plain: Vec<core::ops::Range<usize>> = (0..layout.len())
            .filter(|&i| !lr.contains(&i) && d.codecs[i] == IDENTITY)
            .map(|i| starts[i]..starts[i] + elements(&layout[i].tensor))
            .collect();
        let p_len: usize = d.low_rank.iter().map(|(_, (n, _, r))| n * r).sum::<usize>()
            + plain.iter().map(|r| r.len()).sum::<usize>();
        let q_len: usize = d.low_rank.iter().map(|(_, (_, m, r))| m * r).sum();
        for (kind, len) in [(P_KIND, p_len), (Q_KIND, q_len)] {
            let key = (index, kind, len);
            if !self.factors.contains_key(&key) {
                let connect = self.connect.as_mut().ok_or_else(|| bad("not connected"))?;
                let t = connect(false)?;
                let opts = AllReduceOptions {
                    op: ReduceOp::Mean,
                    strategy: StrategyChoice::Forced(Strategy::Fp32Ring),
                    feedback: Feedback::None,
                    feedback_options: FeedbackOptions::default(),
                    checksum: self.opts.checksum,
                    tag: kind | (index & 0x3FFF_FFFF),
                    pieces: self.opts.pieces,
                };
                let a = AllReduce::new(IDENTITY, len, &t, opts)?;
                // The bucket's other length of this kind is gone.
                self.factors.retain(|k, _| (k.0, k.1) != (index, kind));
                self.factors.insert(key, (a, Comm::new(t)));
            }
        }
        let seed = step_seed(self.opts.seed, step, &names);
        let len = x.len();
        let mut first = self
            .factors
            .remove(&(index, P_KIND, p_len))
            .expect("made above");
        let second = self
            .factors
            .get_mut(&(index, Q_KIND, q_len))
            .expect("made above");
        let lrs = self
            .low_rank
            .as_mut()
            .ok_or_else(|| bad("a low-rank decision needs PowerSGD"))?;
        let out = lrs.bucket(&names, &placed, len).and_then(|b| {
            b.exchange(
                x,
                seed,
                &plain,
                (&mut first.0, &mut first.1),
                (&mut second.0, &mut second.1),
            )
        });
        self.factors.insert((index, P_KIND, p_len), first);
        out?;
        let rest: Vec<Option<CodecSpec>> = (0..layout.len())
            .map(|i| (!lr.contains(&i) && d.codecs[i] != IDENTITY).then_some(d.codecs[i]))
            .collect();
        if rest.iter().any(Option::is_some) {
            self.all_gather(x, index, step, layout, &rest)?;
        }
        Ok(())
    }

    /// Every tensor's error-feedback residual by name.
    pub fn residuals(&self) -> Vec<(String, Vec<f32>)> {
        let mut all = self.gather.residuals();
        if let Some(m) = &self.model {
            all.extend(m.residuals());
        }
        all
    }

    /// PowerSGD's state by matrix name.
    pub fn low_rank(&self) -> Result<Vec<(String, MatrixState)>> {
        match &self.low_rank {
            Some(l) => l.states(),
            None => Ok(Vec::new()),
        }
    }

    /// The saved whole-bucket collectives by their tensors' names (the layouts in use,
    /// and those restored and not used yet).
    pub fn collectives(&self) -> Vec<(String, Vec<Vec<u8>>)> {
        let mut all: Vec<(String, Vec<Vec<u8>>)> = self
            .saved
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        all.extend(self.wholes.iter().map(|(k, w)| (k.0.clone(), w.save())));
        all
    }

    /// How many whole-bucket collectives are made now (one per layout in use).
    pub fn collectives_made(&self) -> usize {
        self.wholes.len()
    }

    /// Whether there is state to save by tensor name: a residual, a PowerSGD state or a
    /// whole-bucket collective with error feedback.
    pub fn holds_state(&self) -> Result<bool> {
        Ok(!self.low_rank()?.is_empty()
            || self
                .wholes
                .values()
                .any(|w| wants_feedback(&w.codec(), self.opts.feedback))
            || !self.residuals().is_empty())
    }

    /// The reducer's part of a [`NamedState`] (residuals, PowerSGD, collectives).
    pub fn save_into(&self, state: &mut NamedState) -> Result<()> {
        state.residuals = self.residuals();
        state.low_rank = self.low_rank()?;
        state.collectives = self.collectives();
        Ok(())
    }

    /// Take up a [`NamedState`]'s residuals, PowerSGD state and collectives, each used
    /// when its tensor or layout next comes; the collectives made so far are dropped.
    /// PowerSGD state given to a reducer without PowerSGD is refused, changing nothing.
    pub fn restore_from(&mut self, state: &NamedState) -> Result<()> {
        match self.low_rank.as_mut() {
            Some(l) => l.restore(state.low_rank.clone()),
            None if !state.low_rank.is_empty() => {
                return Err(Error::Checkpoint(
                    "PowerSGD state given to a reducer without PowerSGD".into(),
                ));
            }
            None => {}
        }
        match self.model.as_mut() {
            Some(m) => m.restore(state.residuals.clone()),
            None => self.gather.restore(state.residuals.clone()),
        }
        self.wholes.clear();
        self.now.clear();
        self.gathers.clear();
        self.saved = state.collectives.iter().cloned().collect();
        Ok(())
    }
}
