//! The plan: which tensors share a bucket, and each bucket's codec and strategy.

use core::fmt;

use crate::codec::{CodecSpec, EncodeCtx};
use crate::codecs::Identity;
use crate::collective::Strategy;
use crate::cost::{self, CodecProfile};
use crate::error::{Error, Result};
use crate::wire::HEADER_LEN;

pub use super::powersgd::PowerSgd;

/// A parameter tensor of the model: its name and shape. Its gradient is a flat f32
/// slice of `shape.iter().product()` elements (row-major, as the framework stores it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// The parameter's name (`"layer1.0.conv1.weight"`), for plans and errors.
    pub name: String,
    /// Its shape; `[]` is a scalar.
    pub shape: Vec<usize>,
}

/// The ranges of `tensors` laid end to end in a bucket of `len` elements (a framework's
/// own bucket): an error unless they fill it exactly.
pub(crate) fn laid_end_to_end<'a>(
    tensors: impl IntoIterator<Item = &'a Tensor>,
    len: usize,
) -> Result<Vec<core::ops::Range<usize>>> {
    let mut out = Vec::new();
    let mut at = 0usize;
    for t in tensors {
        let end = at
            .checked_add(t.len()?)
            .filter(|&e| e <= len)
            .ok_or_else(|| {
                Error::Collective(format!(
                    "a bucket of {len} elements is shorter than its tensors ({:?} ends past it)",
                    t.name
                ))
            })?;
        out.push(at..end);
        at = end;
    }
    if at != len {
        return Err(Error::Collective(format!(
            "a bucket of {len} elements holds tensors of {at}"
        )));
    }
    Ok(out)
}

impl Tensor {
    /// A tensor named `name` of shape `shape`.
    pub fn new(name: impl Into<String>, shape: &[usize]) -> Tensor {
        Tensor {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    /// Elements, or an error if the shape's product overflows.
    pub fn len(&self) -> Result<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                Error::Collective(format!(
                    "tensor {:?} of shape {:?} has more elements than a usize holds",
                    self.name, self.shape
                ))
            })
    }

    /// True for a tensor of zero elements.
    pub fn is_empty(&self) -> bool {
        self.shape.contains(&0)
    }
}

/// The network the plan is made for: links of this bandwidth and latency between the
/// world's ranks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Network {
    /// Bits per second per link.
    pub bandwidth_bit_s: f64,
    /// Per-message latency, seconds.
    pub latency_s: f64,
}

impl Default for Network {
    /// 10 Gbit/s, 10 us.
    fn default() -> Self {
        Network {
            bandwidth_bit_s: 10e9,
            latency_s: 10e-6,
        }
    }
}

/// Which codec the tensors that are not small get.
#[derive(Debug, Clone, PartialEq)]
pub enum CodecChoice {
    /// This codec for every bucket.
    Fixed(CodecSpec),
    /// Per bucket, the candidate with the smallest modelled all-reduce time on the
    /// engine's [`Network`], from each candidate's speed on this CPU; fp32 (no
    /// compression) when the model says no candidate beats it.
    Auto {
        /// The codecs to choose from.
        candidates: Vec<CodecSpec>,
        /// Their measured speeds, one per candidate in the same order, if known: for
        /// example from `gradpack report --json`, whose codec entries give `spec`,
        /// `bits_per_element`, `encode_gb_s`, `decode_gb_s` and `decode_add_gb_s` (times
        /// 1e9 for the profile's bytes per second). Every rank must pass the same.
        /// `None`: the engine measures each candidate once per process (about 0.05 s;
        /// later engines reuse the figures) and averages them over the ranks, so every
        /// rank makes the same plan.
        profiles: Option<Vec<CodecProfile>>,
    },
}

/// Which codec each tensor gets.
///
/// Tensors that compression would not pay for, as PyTorch's PowerSGD hook reasons about
/// its uncompressed 1-D tensors and BytePS about its minimum compression size (biases,
/// norm scales, small layers: their frames are mostly header and their share of the
/// bytes is small), go with `small_codec` in buckets of their own kind.
///
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// The codec of the other tensors.
    pub codec: CodecChoice,
    /// Tensors with fewer elements than this are small.
    pub small_below: usize,
    /// Tensors of at most one dimension (biases, norm scales) are small.
    pub vectors_small: bool,
    /// The codec of small tensors (fp32 or fp16, say).
    pub small_codec: CodecSpec,
    /// Send the matrices that are not small and that PowerSGD compresses enough (see
    /// [`PowerSgd::matrix_of`]) as low-rank factors, in buckets of their own (default
    /// none).
    pub powersgd: Option<PowerSgd>,
    /// With a fixed `dct` codec of `width=0`, send each matrix in 2-D tiles (default
    /// off: tiles along the flat tensor). Each tensor of two or more dimensions that is
    /// not small then goes in a bucket of its own with `width` set to its row length
    /// (the product of its dimensions after the first), so its tiles are `chunk x
    /// chunk` squares of the matrix, as DeMo transforms each tensor along every
    /// dimension. Those buckets are all-gathered whatever the engine's strategy (a ring
    /// would cut the matrix into chunks that do not start on a row). Vectors keep tiles
    /// along their one row. A tile then holds `chunk^2` coefficients instead of `chunk`,
    /// so `dct:chunk=8,k=4` in 2-D sends about what `dct:chunk=64,k=4` sends in 1-D.
    pub dct_2d: bool,
}

/// Elements below which [`Policy::with_rules`] sends a tensor uncompressed (64 KiB of
/// f32).
pub const SMALL_TENSOR: usize = 16384;

impl Policy {
    /// `codec` for every tensor.
    pub fn uniform(codec: CodecSpec) -> Policy {
        Policy {
            codec: CodecChoice::Fixed(codec),
            small_below: 0,
            vectors_small: false,
            small_codec: CodecSpec::Identity(Identity),
            powersgd: None,
            dct_2d: false,
        }
    }

    /// `codec` for the tensors it pays for; fp32 for 1-D tensors and tensors under
    /// [`SMALL_TENSOR`] elements.
    pub fn with_rules(codec: CodecSpec) -> Policy {
        Policy {
            small_below: SMALL_TENSOR,
            vectors_small: true,
            ..Policy::uniform(codec)
        }
    }

    /// Per bucket the fastest of `candidates` by the cost model, measured on this CPU at
    /// start; with the small-tensor rules of [`Policy::with_rules`].
    pub fn auto(candidates: Vec<CodecSpec>) -> Policy {
        Policy {
            codec: CodecChoice::Auto {
                candidates,
                profiles: None,
            },
            ..Policy::with_rules(CodecSpec::Identity(Identity))
        }
    }

    /// PowerSGD (`powersgd`) for every matrix it compresses by its minimum compression,
    /// fp32 for vectors (biases, norm scales) and the other tensors, as PyTorch's
    /// PowerSGD hook does.
    pub fn powersgd(powersgd: PowerSgd) -> Policy {
        Policy {
            powersgd: Some(powersgd),
            vectors_small: true,
            ..Policy::uniform(CodecSpec::Identity(Identity))
        }
    }

    /// Whether `t` (of `len` elements) is small.
    pub(crate) fn is_small(&self, t: &Tensor, len: usize) -> bool {
        len < self.small_below || (self.vectors_small && t.shape.len() <= 1)
    }

    /// The kind of bucket `t` (of `len` elements) goes in.
    pub(crate) fn kind(&self, t: &Tensor, len: usize) -> Kind {
        if self.is_small(t, len) {
            Kind::Small
        } else if self.powersgd.is_some_and(|p| p.matrix_of(t).is_some()) {
            Kind::LowRank
        } else if self.tiled(t).is_some() {
            Kind::Tiled
        } else {
            Kind::Codec
        }
    }

    /// The `dct` codec with 2-D tiles that `t` gets, if [`Policy::dct_2d`] is on, the
    /// policy's codec is a fixed `dct` of `width=0` and `t` is a matrix of rows of 2 to
    /// `u32::MAX` elements.
    pub(crate) fn tiled(&self, t: &Tensor) -> Option<CodecSpec> {
        let CodecChoice::Fixed(CodecSpec::Dct(d)) = &self.codec else {
            return None;
        };
        if !self.dct_2d {
            return None;
        }
        dct_rows(d, t)
    }
}

/// `d` (a `dct` of `width=0`) with `t`'s row length as its width, so it transforms 2-D
/// tiles of the matrix: `None` unless `t` has rows (two or more dimensions) of 2 to
/// `u32::MAX` elements and `d` has no width of its own.
pub(crate) fn dct_rows(d: &crate::codecs::Dct, t: &Tensor) -> Option<CodecSpec> {
    let rest = t
        .shape
        .get(1..)
        .filter(|r| d.width() == 0 && !r.is_empty())?;
    let m = rest.iter().try_fold(1usize, |a, &x| a.checked_mul(x))?;
    let w = u32::try_from(m).ok().filter(|&w| w >= 2)?;
    crate::codecs::Dct::new(d.chunk(), d.k(), w, d.values())
        .ok()
        .map(|c| CodecSpec::Dct(c.with_transform(d.transform())))
}

/// What a bucket holds, and so how it is reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Tensors with the policy's codec.
    Codec,
    /// Small tensors, with the small codec.
    Small,
    /// Matrices sent as PowerSGD factors.
    LowRank,
    /// One matrix with `dct` in 2-D tiles.
    Tiled,
}

/// One bucket of a [`Plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    /// Its tensors (indices into the layout), in the order they sit in the bucket.
    pub tensors: Vec<usize>,
    /// Elements in the bucket.
    pub elements: usize,
    /// The codec its frames use (identity: fp32).
    pub codec: CodecSpec,
    /// The all-reduce strategy.
    pub strategy: Strategy,
    /// Whether it holds the small tensors of the policy.
    pub small: bool,
    /// Its matrices' factors, if they go as PowerSGD factors (then `codec` and
    /// `strategy` are those of the two factor all-reduces).
    pub low_rank: Option<LowRankPlan>,
    /// Bytes each rank sends for it per step, by the cost model (frame headers and
    /// envelopes included).
    pub wire_bytes: f64,
    /// Its modelled all-reduce time on the plan's network, seconds.
    pub modelled_s: f64,
    /// Whether it goes by node: the two-level all-reduce, `codec` and `strategy` being
    /// those between nodes (see [`super::SyncOptions::nodes`]).
    pub by_node: bool,
}

/// The factors of a low-rank bucket of a [`Plan`].
#[derive(Debug, Clone, PartialEq)]
pub struct LowRankPlan {
    /// The settings.
    pub settings: PowerSgd,
    /// Each matrix's rows, columns and rank, in bucket order.
    pub matrices: Vec<(usize, usize, usize)>,
    /// Elements of the first all-reduce (every matrix's `P`: rows times rank).
    pub p_elements: usize,
    /// Elements of the second all-reduce (every matrix's `Q`: columns times rank).
    pub q_elements: usize,
}

/// Buckets of tensors, each with its codec, strategy and modelled time; the same on
/// every rank. `Display` prints it as a table.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The buckets, in the order they are reduced.
    pub buckets: Vec<BucketPlan>,
    /// Tensor names, for display.
    pub(crate) names: Vec<String>,
    /// World size and network the times are modelled for.
    pub nodes: usize,
    /// Pieces per ring chunk (a pipelined ring when above 1).
    pub pieces: usize,
    /// The network (between nodes, for buckets that go by node).
    pub network: Network,
    /// The nodes and the link inside them, for buckets that go by node, with the bits
    /// per element inside a node.
    pub(crate) two: Option<(cost::TwoLevel, f64)>,
}

impl BucketPlan {
    /// The element counts of its all-reduces: the bucket's, or its two factors'.
    pub(crate) fn factor_or_elements(&self) -> Reduces {
        Reduces::of(self.elements, self.low_rank.as_ref())
    }

    /// How its tensors go: the codec (`int8:block=256`), or PowerSGD's rank and the
    /// codec of its factors (`powersgd:rank=2+identity`).
    pub fn method(&self) -> String {
        match &self.low_rank {
            Some(l) => format!("powersgd:rank={}+{}", l.settings.rank, self.codec),
            None => self.codec.to_string(),
        }
    }
}

/// The all-reduces a bucket makes per step, by their element counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduces {
    /// One of the whole bucket.
    One(usize),
    /// PowerSGD's two, of `P` and of `Q`.
    Two(usize, usize),
}

impl Reduces {
    /// The all-reduces of a bucket of `elements`, sent as `low_rank`'s factors if given.
    pub(crate) fn of(elements: usize, low_rank: Option<&LowRankPlan>) -> Reduces {
        match low_rank {
            Some(l) => Reduces::Two(l.p_elements, l.q_elements),
            None => Reduces::One(elements),
        }
    }
}

impl Plan {
    /// The modelled communication time of a step without overlap: the sum over buckets.
    pub fn modelled_s(&self) -> f64 {
        self.buckets.iter().map(|b| b.modelled_s).sum()
    }

    /// Model every bucket's time again with measured codec speeds (a profile applies to
    /// the buckets whose codec prints as its `spec`; an `identity` profile's decode_add
    /// speed is the fp32 ring's summing speed). Buckets without a profile keep
    /// infinitely fast compute. The buckets, codecs and strategies do not change.
    pub fn remodel(&mut self, profiles: &[CodecProfile]) {
        let find = |c: &CodecSpec| profiles.iter().find(|p| p.spec == c.to_string());
        for b in &mut self.buckets {
            let (t, bytes) = match (&self.two, b.by_node) {
                (Some((two, bits)), true) => node_cost(
                    &b.codec,
                    b.strategy,
                    find(&b.codec),
                    two,
                    *bits,
                    b.factor_or_elements(),
                ),
                _ => bucket_cost(
                    &b.codec,
                    b.strategy,
                    find(&b.codec),
                    self.nodes,
                    &self.network,
                    b.factor_or_elements(),
                    self.pieces,
                ),
            };
            b.modelled_s = t;
            b.wire_bytes = bytes;
        }
    }

    /// The modelled time of a step whose backward pass takes `backward_s` seconds and
    /// hands tensor `i` over at `backward_s * ready[i]` (`ready` rising from 0 to 1),
    /// with each bucket reduced on the communication thread once its last tensor is
    /// ready and every earlier bucket is done: the end of the last bucket.
    pub fn modelled_overlap_s(&self, backward_s: f64, ready: &[f64]) -> f64 {
        let mut free = 0f64;
        for b in &self.buckets {
            let at = b
                .tensors
                .iter()
                .map(|&t| ready.get(t).copied().unwrap_or(1.0))
                .fold(0f64, f64::max)
                * backward_s;
            free = free.max(at) + b.modelled_s;
        }
        free.max(backward_s)
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "sync plan: {} buckets, {} ranks, {:.2} Gbit/s, {:.1} us; modelled {:.3} ms per step without overlap",
            self.buckets.len(),
            self.nodes,
            self.network.bandwidth_bit_s / 1e9,
            self.network.latency_s * 1e6,
            self.modelled_s() * 1e3
        )?;
        for (i, b) in self.buckets.iter().enumerate() {
            let names: Vec<&str> = b.tensors.iter().map(|&t| self.names[t].as_str()).collect();
            let shown = if names.len() > 4 {
                format!(
                    "{}, {}, ... {} ({} tensors)",
                    names[0],
                    names[1],
                    names[names.len() - 1],
                    names.len()
                )
            } else {
                names.join(", ")
            };
            writeln!(
                f,
                "  bucket {i:>3}: {:>9} elements ({:>8.3} MiB) {} {}{} -> {:.3} MiB/rank sent, modelled {:.3} ms: {shown}",
                b.elements,
                b.elements as f64 * 4.0 / 1048576.0,
                b.method(),
                b.strategy.name(),
                if b.by_node { " by node" } else { "" },
                b.wire_bytes / 1048576.0,
                b.modelled_s * 1e3
            )?;
        }
        Ok(())
    }
}

/// Split the tensors into buckets: in the order their gradients become ready, tensors of
/// each kind apart, each bucket up to `cap` bytes of f32 (the first one up to
/// `first_cap`; a tensor larger than the cap gets a bucket of its own). Buckets are
/// ordered by when their last tensor becomes ready. Returns `(tensors, kind)` per bucket.
pub(crate) fn buckets(
    lens: &[usize],
    kinds: &[Kind],
    cap: usize,
    first_cap: usize,
) -> Vec<(Vec<usize>, Kind)> {
    const KINDS: [Kind; 3] = [Kind::Codec, Kind::Small, Kind::LowRank];
    // Per kind, the open bucket and its bytes.
    let mut open: [Option<(Vec<usize>, usize)>; 3] = [None, None, None];
    let mut closed: Vec<(Vec<usize>, Kind, usize)> = Vec::new(); // tensors, kind, last
    let mut first_done = false;
    let limit = |first_done: bool| if first_done { cap } else { first_cap };
    for (i, (&len, &kind)) in lens.iter().zip(kinds).enumerate() {
        if kind == Kind::Tiled {
            closed.push((vec![i], kind, i));
            continue;
        }
        let k = KINDS.iter().position(|&x| x == kind).expect("a known kind");
        let bytes = len.saturating_mul(4);
        if let Some((ts, b)) = &open[k]
            && !ts.is_empty()
            && b.saturating_add(bytes) > limit(first_done)
        {
            let last = *ts.last().expect("not empty");
            closed.push((ts.clone(), kind, last));
            open[k] = None;
            first_done = true;
        }
        let (ts, b) = open[k].get_or_insert_with(|| (Vec::new(), 0));
        ts.push(i);
        *b = b.saturating_add(bytes);
    }
    for (k, o) in open.into_iter().enumerate() {
        if let Some((ts, _)) = o {
            let last = *ts.last().expect("an open bucket has a tensor");
            closed.push((ts, KINDS[k], last));
        }
    }
    closed.sort_by_key(|&(_, _, last)| last);
    closed.into_iter().map(|(ts, k, _)| (ts, k)).collect()
}

/// The strategy for `codec` on a bucket of `elements` (random-k with `scale=unbiased`
/// cannot run the ring; fp32 runs the fp32 ring).
pub(crate) fn strategy_for(
    codec: &CodecSpec,
    profile: &CodecProfile,
    nodes: usize,
    net: &Network,
    elements: usize,
) -> Strategy {
    if matches!(codec, CodecSpec::Identity(_)) {
        return Strategy::Fp32Ring;
    }
    if matches!(codec, CodecSpec::RandK(rk) if rk.scale() == crate::codecs::RandKScale::Unbiased) {
        return Strategy::CompressedAllGather;
    }
    let cluster = cost::Cluster {
        nodes: nodes as u32,
        bandwidth_bit_s: net.bandwidth_bit_s,
        latency_s: net.latency_s,
    };
    cost::best_strategy(profile, &cluster, elements as f64, f64::INFINITY).0
}

/// The modelled time (seconds) and bytes sent per rank of a bucket's all-reduces (one of
/// its elements, or PowerSGD's two of its factors) with `codec` by `strategy`, with its measured speeds if known (else infinitely fast
/// compute). Ring strategies (the fp32 ring too: it runs the same ring of identity
/// frames) are modelled with their pieces ([`cost::pipelined_ring_time`]).
pub(crate) fn bucket_cost(
    codec: &CodecSpec,
    strategy: Strategy,
    measured: Option<&CodecProfile>,
    nodes: usize,
    net: &Network,
    reduces: Reduces,
    pieces: usize,
) -> (f64, f64) {
    match reduces {
        Reduces::One(n) => one_cost(codec, strategy, measured, nodes, net, n, pieces),
        Reduces::Two(p, q) => {
            // One after the other (Q needs the reduced P): two latency terms.
            let a = one_cost(codec, strategy, measured, nodes, net, p, pieces);
            let b = one_cost(codec, strategy, measured, nodes, net, q, pieces);
            (a.0 + b.0, a.1 + b.1)
        }
    }
}

/// The modelled time (seconds) and bytes sent per rank of a bucket's all-reduces by
/// node ([`cost::hierarchical_time`]: `node_bits` per element inside a node, `codec` by
/// `strategy` between nodes on each rank's shard), with its measured speeds if known.
pub(crate) fn node_cost(
    codec: &CodecSpec,
    strategy: Strategy,
    measured: Option<&CodecProfile>,
    two: &cost::TwoLevel,
    node_bits: f64,
    reduces: Reduces,
) -> (f64, f64) {
    let one = |n: usize| {
        let l = two.per_node.max(1) as usize;
        let shard = n.div_ceil(l);
        let prof = profile_for(codec, measured, shard, two.nodes as usize);
        let reduce = measured.map_or(f64::INFINITY, |p| p.decode_add_bytes_per_s);
        let t = cost::hierarchical_time(strategy, &prof, two, n as f64, node_bits, reduce);
        let inside = 2.0 * (l - 1) as f64 / l as f64 * n as f64 * node_bits / 8.0;
        let between = cost::allreduce_cost(
            strategy,
            &prof,
            two.nodes,
            two.inter_latency_s,
            shard as f64,
            f64::INFINITY,
        )
        .bytes;
        (t, inside + between)
    };
    match reduces {
        Reduces::One(n) => one(n),
        Reduces::Two(p, q) => {
            let (a, b) = (one(p), one(q));
            (a.0 + b.0, a.1 + b.1)
        }
    }
}

/// [`bucket_cost`] of one all-reduce of `elements`.
fn one_cost(
    codec: &CodecSpec,
    strategy: Strategy,
    measured: Option<&CodecProfile>,
    nodes: usize,
    net: &Network,
    elements: usize,
    pieces: usize,
) -> (f64, f64) {
    let ring = matches!(strategy, Strategy::CompressedRing | Strategy::Fp32Ring);
    let chunked = ring || strategy == Strategy::TwoShot;
    let frames = if chunked { nodes * pieces.max(1) } else { 1 };
    let prof = profile_for(codec, measured, elements, frames);
    let c = cost::allreduce_cost(
        if ring {
            Strategy::CompressedRing
        } else {
            strategy
        },
        &prof,
        nodes as u32,
        net.latency_s,
        elements as f64,
        f64::INFINITY,
    );
    let t = if ring {
        cost::pipelined_ring_time(
            &prof,
            nodes as u32,
            net.latency_s,
            elements as f64,
            pieces.max(1) as u32,
            net.bandwidth_bit_s,
        )
    } else {
        c.time(net.bandwidth_bit_s)
    };
    (t, c.bytes)
}

/// Bits per element of `codec` on a bucket of `elements` split into `chunks` frames
/// (headers, checksums and envelopes included).
pub(crate) fn wire_bits(codec: &CodecSpec, elements: usize, chunks: usize) -> f64 {
    let n = elements.max(1);
    let per = n.div_ceil(chunks.max(1));
    let overhead = (HEADER_LEN + 4 + crate::collective::ENVELOPE_LEN) as f64 * 8.0;
    codec.bits_per_element(per) + overhead / per as f64
}

/// The profile of `codec` at `elements`: measured speeds if given, else infinitely fast
/// compute, with the bucket's own bits per element.
pub(crate) fn profile_for(
    codec: &CodecSpec,
    measured: Option<&CodecProfile>,
    elements: usize,
    chunks: usize,
) -> CodecProfile {
    let mut bits = wire_bits(codec, elements, chunks);
    match measured {
        Some(p) => {
            if codec.entropy() {
                // The stage's measured saving on the calibration sample, in place of
                // its bound.
                bits += p.bits_per_element - codec.bits_per_element(CALIBRATION);
            }
            CodecProfile {
                bits_per_element: bits,
                ..p.clone()
            }
        }
        None => CodecProfile::nominal(codec.to_string(), bits),
    }
}

/// Elements of the sample that [`calibrate`] measures for measured `auto`.
pub(crate) const CALIBRATION: usize = 1 << 18;

/// Measure `codec`'s encode, decode and decode_add speed on this CPU, on a gradient-like
/// sample of `elements` elements (that of [`crate::synthetic::gradient`]), taking the best
/// of repetitions for about `budget_s`. Bits per element are the codec's expected ones,
/// except for a codec with the entropy stage, whose frame of the sample is measured.
pub fn calibrate(codec: &CodecSpec, elements: usize, budget_s: f64) -> Result<CodecProfile> {
    use crate::codec::Codec;
    use std::time::Instant;
    let n = elements.max(1024);
    let mut x = crate::alloc::filled(n, 0f32, "calibration sample")?;
    crate::sample::gradient_into(&mut x, 7);
    let mut frame = crate::alloc::filled(codec.max_encoded_len(n), 0u8, "calibration frame")?;
    let mut out = crate::alloc::filled(n, 0f32, "calibration output")?;
    let deadline = Instant::now() + std::time::Duration::from_secs_f64(budget_s.max(0.0));
    let (mut enc, mut dec, mut add) = (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    let mut rounds = 0;
    while rounds < 3 || Instant::now() < deadline {
        let t = Instant::now();
        let len = codec.encode_into(&x, &EncodeCtx::new(rounds), &mut frame)?;
        enc = enc.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        codec.decode_into(&frame[..len], &mut out)?;
        dec = dec.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        codec.decode_add(&frame[..len], &mut out)?;
        add = add.min(t.elapsed().as_secs_f64());
        rounds += 1;
        if rounds >= 1000 {
            break;
        }
    }
    let bytes = 4.0 * n as f64;
    let speed = |t: f64| bytes / t.max(1e-9);
    let bits = if codec.entropy() {
        let len = codec.encode_into(&x, &EncodeCtx::new(0), &mut frame)?;
        (len - crate::wire::HEADER_LEN) as f64 * 8.0 / n as f64
    } else {
        codec.bits_per_element(n)
    };
    Ok(CodecProfile {
        spec: codec.to_string(),
        bits_per_element: bits,
        encode_bytes_per_s: speed(enc),
        decode_bytes_per_s: speed(dec),
        decode_add_bytes_per_s: speed(add),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_tile_the_tensors_in_ready_order() {
        let lens = [
            10, 300_000, 5, 600_000, 700_000, 1, 0, 8_000_000, 90_000, 20, 30,
        ];
        let (c, s, l, t) = (Kind::Codec, Kind::Small, Kind::LowRank, Kind::Tiled);
        let small = [s, c, s, l, c, s, s, c, l, t, t];
        let b = buckets(&lens, &small, 4 << 20, 1 << 20);
        let mut seen: Vec<usize> = b.iter().flat_map(|(t, _)| t.clone()).collect();
        seen.sort();
        assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
        for (ts, sm) in &b {
            assert!(ts.iter().all(|&t| small[t] == *sm));
            assert!(ts.windows(2).all(|w| w[0] < w[1]));
        }
        // The first bucket closes at 1 MiB; the 8 M-element tensor is alone, and so is
        // each tiled tensor, however small.
        assert!(b.iter().any(|(t, _)| t == &[7]));
        assert!(b.iter().any(|(t, _)| t == &[9]) && b.iter().any(|(t, _)| t == &[10]));
    }
}
