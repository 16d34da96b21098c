//! Communication cost models: what an all-reduce costs on a network, plain and compressed.
//!
//! Three layers (docs/cost-model.md derives each formula):
//!
//! 1. The textbook bandwidth formulas for a ring all-reduce of a gradient of `g` bits over
//!    links of `b` bit/s among `n` nodes: [`ring_ideal`], [`ring_quantised`],
//!    [`ring_with_latency`].
//! 2. The alpha-beta-gamma models of Thakur, Rabenseifner and Gropp (2005), "Optimization
//!    of Collective Communication Operations in MPICH": [`AlphaBetaGamma`] with ring,
//!    binomial tree, recursive doubling and recursive halving-doubling all-reduce and the
//!    ring all-gather.
//! 3. Codec-aware costs: from a [`CodecProfile`] (bits per element and measured encode /
//!    decode / decode_add throughput), the time of each compressed all-reduce
//!    [`Strategy`], the best one, and the break-even link bandwidth below which the codec
//!    beats a plain fp32 ring ([`break_even_bandwidth`]).
//!
//! Units: seconds, bits per second for bandwidths, bytes for message sizes; compute
//! throughput in bytes of f32 input per second.

/// Ideal ring all-reduce time `2(n-1)/n * g/b` (seconds) for a gradient of `g_bits` bits
/// over links of `b_bit_s` bit/s among `nodes` nodes. Zero for a single node.
pub fn ring_ideal(nodes: u32, g_bits: f64, b_bit_s: f64) -> f64 {
    ring_factor(nodes) * g_bits / b_bit_s
}

/// Ring all-reduce of a gradient quantised from 32 to `k` bits per element:
/// `2(n-1)/n * (k/32) * g/b`.
pub fn ring_quantised(nodes: u32, g_bits: f64, b_bit_s: f64, k: f64) -> f64 {
    ring_factor(nodes) * (k / 32.0) * g_bits / b_bit_s
}

/// Ring all-reduce with its latency: `2(n-1) alpha + 2(n-1)/n * g/b` (a ring sends
/// `2(n-1)` messages in sequence, each paying the latency `alpha`).
pub fn ring_with_latency(nodes: u32, g_bits: f64, b_bit_s: f64, alpha_s: f64) -> f64 {
    let n = nodes.max(1) as f64;
    2.0 * (n - 1.0) * alpha_s + ring_factor(nodes) * g_bits / b_bit_s
}

/// `2(n-1)/n`, the fraction of the gradient each node sends in a ring all-reduce.
fn ring_factor(nodes: u32) -> f64 {
    let n = nodes.max(1) as f64;
    2.0 * (n - 1.0) / n
}

/// `ceil(log2 p)` as f64 (0 for p <= 1).
fn lg(p: u32) -> f64 {
    if p <= 1 {
        0.0
    } else {
        (32 - (p - 1).leading_zeros()) as f64
    }
}

/// The alpha-beta-gamma machine model: `alpha` seconds per message, `beta` seconds per
/// byte sent, `gamma` seconds per byte reduced (summed) locally.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlphaBetaGamma {
    /// Latency per message, seconds.
    pub alpha: f64,
    /// Transfer time per byte, seconds (`8 / bandwidth in bit/s`).
    pub beta: f64,
    /// Reduction time per byte, seconds.
    pub gamma: f64,
}

impl AlphaBetaGamma {
    /// The model for a link of `bandwidth_bit_s` bit/s, `latency_s` per message and a local
    /// reduction speed of `reduce_bytes_per_s` (use `f64::INFINITY` to ignore reduction).
    pub fn new(bandwidth_bit_s: f64, latency_s: f64, reduce_bytes_per_s: f64) -> Self {
        AlphaBetaGamma {
            alpha: latency_s,
            beta: 8.0 / bandwidth_bit_s,
            gamma: 1.0 / reduce_bytes_per_s,
        }
    }

    /// Ring all-reduce of `n` bytes on `p` processes (reduce-scatter then all-gather):
    /// `2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma`.
    pub fn ring_allreduce(&self, p: u32, n: f64) -> f64 {
        let p = p.max(1) as f64;
        2.0 * (p - 1.0) * self.alpha
            + 2.0 * (p - 1.0) / p * n * self.beta
            + (p - 1.0) / p * n * self.gamma
    }

    /// Binomial-tree reduce followed by a binomial-tree broadcast:
    /// `2 lg p (alpha + n beta) + lg p n gamma`.
    pub fn binomial_tree_allreduce(&self, p: u32, n: f64) -> f64 {
        let l = lg(p);
        2.0 * l * (self.alpha + n * self.beta) + l * n * self.gamma
    }

    /// Recursive doubling (every step exchanges the whole vector):
    /// `lg p (alpha + n beta + n gamma)`.
    pub fn recursive_doubling_allreduce(&self, p: u32, n: f64) -> f64 {
        lg(p) * (self.alpha + n * self.beta + n * self.gamma)
    }

    /// Rabenseifner's recursive halving (reduce-scatter) then doubling (all-gather):
    /// `2 lg p alpha + 2(p-1)/p n beta + (p-1)/p n gamma` (exact for powers of two).
    pub fn halving_doubling_allreduce(&self, p: u32, n: f64) -> f64 {
        let pf = p.max(1) as f64;
        2.0 * lg(p) * self.alpha
            + 2.0 * (pf - 1.0) / pf * n * self.beta
            + (pf - 1.0) / pf * n * self.gamma
    }

    /// Ring all-gather of `c` bytes from each of `p` processes: `(p-1) alpha + (p-1) c beta`.
    pub fn ring_allgather(&self, p: u32, c: f64) -> f64 {
        let p = p.max(1) as f64;
        (p - 1.0) * self.alpha + (p - 1.0) * c * self.beta
    }
}

/// What the cost model needs to know about a codec: its size on the wire and its speed on
/// this CPU. Throughputs are in bytes of f32 input per second.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecProfile {
    /// The codec's spec (for display).
    pub spec: String,
    /// Bits per element on the wire (frame header included, or the nominal rate).
    pub bits_per_element: f64,
    /// Encode throughput.
    pub encode_bytes_per_s: f64,
    /// Decode throughput.
    pub decode_bytes_per_s: f64,
    /// decode_add (decode and accumulate) throughput.
    pub decode_add_bytes_per_s: f64,
}

impl CodecProfile {
    /// A profile with infinitely fast compute: the pure bandwidth model.
    pub fn nominal(spec: impl Into<String>, bits_per_element: f64) -> Self {
        CodecProfile {
            spec: spec.into(),
            bits_per_element,
            encode_bytes_per_s: f64::INFINITY,
            decode_bytes_per_s: f64::INFINITY,
            decode_add_bytes_per_s: f64::INFINITY,
        }
    }

    /// Compression ratio against fp32.
    pub fn ratio(&self) -> f64 {
        32.0 / self.bits_per_element
    }
}

/// How a compressed all-reduce is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Uncompressed fp32 ring (Thakur et al.'s ring with gamma).
    Fp32Ring,
    /// Ring whose reduce-scatter hops decode_add into the local chunk and re-encode; the
    /// all-gather forwards the owners' frames unchanged and each rank decodes each once.
    CompressedRing,
    /// Every rank's whole frame is all-gathered; each rank decodes and sums all of them.
    CompressedAllGather,
    /// signSGD with majority vote (Bernstein et al. 2018): frames are all-gathered as for
    /// [`Strategy::CompressedAllGather`], and element `i` of the result is
    /// `sign(sum_r sign(d_r[i])) * sum_r |d_r[i]|` over the decoded frames `d_r`: the sign
    /// most ranks sent, with the summed magnitude (so when all ranks agree it equals the
    /// all-gather sum). A tie gives 0; a NaN in any `d_r[i]` gives NaN. With the `sign`
    /// codec this is the vote of signSGD scaled by the ranks' block means of `|x|`. Not a
    /// sum, so never chosen automatically.
    SignMajority,
    /// The two-shot all-reduce: each rank encodes its chunk `c` once and sends it straight
    /// to rank `c` (its owner); the owner sums the `p` contributions of its chunk in f32
    /// (its own input exact, the others' frames decoded, in rank order), encodes the sum
    /// once and sends that frame to every rank, which decodes it. Two steps of latency
    /// instead of the ring's `2(p - 1)`, the same bytes per rank's port as the ring, and
    /// each element quantised twice whatever the world size (the ring re-encodes a
    /// partial sum at each of `p - 1` hops).
    TwoShot,
}

impl Strategy {
    /// Every strategy, in declaration order.
    pub const ALL: [Strategy; 5] = [
        Strategy::Fp32Ring,
        Strategy::CompressedRing,
        Strategy::CompressedAllGather,
        Strategy::SignMajority,
        Strategy::TwoShot,
    ];

    /// The strategy whose [`Strategy::name`] is `name`.
    pub fn from_name(name: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Fp32Ring => "fp32-ring",
            Strategy::CompressedRing => "ring",
            Strategy::CompressedAllGather => "allgather",
            Strategy::SignMajority => "majority",
            Strategy::TwoShot => "twoshot",
        }
    }
}

/// A cluster: `nodes` ranks joined by links of `bandwidth_bit_s` with `latency_s` per
/// message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    /// Number of ranks (>= 1).
    pub nodes: u32,
    /// Link bandwidth, bit/s.
    pub bandwidth_bit_s: f64,
    /// Per-message latency, seconds.
    pub latency_s: f64,
}

/// An all-reduce time split into the part that does not depend on the bandwidth (`fixed`:
/// latency and compute, seconds) and the bytes each rank sends in sequence (`bytes`), so
/// that `time = fixed + bytes * 8 / bandwidth`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cost {
    /// Latency plus compute, seconds.
    pub fixed: f64,
    /// Bytes on the critical path.
    pub bytes: f64,
}

impl Cost {
    /// The time at `bandwidth_bit_s`.
    pub fn time(&self, bandwidth_bit_s: f64) -> f64 {
        self.fixed + self.bytes * 8.0 / bandwidth_bit_s
    }
}

/// The cost of all-reducing `elements` f32 values on `p` ranks with `latency_s` per
/// message, by `strategy` with codec `c` (ignored for [`Strategy::Fp32Ring`], which sums
/// at `reduce_bytes_per_s`).
pub fn allreduce_cost(
    strategy: Strategy,
    c: &CodecProfile,
    p: u32,
    latency_s: f64,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> Cost {
    let pf = p.max(1) as f64;
    if p <= 1 {
        return Cost {
            fixed: 0.0,
            bytes: 0.0,
        };
    }
    let input = 4.0 * elements; // f32 bytes
    let wire = elements * c.bits_per_element / 8.0;
    let (enc, dec, add) = (
        1.0 / c.encode_bytes_per_s,
        1.0 / c.decode_bytes_per_s,
        1.0 / c.decode_add_bytes_per_s,
    );
    match strategy {
        Strategy::Fp32Ring => Cost {
            fixed: 2.0 * (pf - 1.0) * latency_s + (pf - 1.0) / pf * input / reduce_bytes_per_s,
            bytes: 2.0 * (pf - 1.0) / pf * input,
        },
        Strategy::CompressedRing => {
            let chunk = input / pf;
            // p-1 reduce-scatter hops (encode, send, decode_add), the owner's final encode,
            // p-1 all-gather hops (forward), and p-1 chunk decodes.
            Cost {
                fixed: 2.0 * (pf - 1.0) * latency_s
                    + (pf - 1.0) * chunk * (enc + add)
                    + chunk * enc
                    + (pf - 1.0) * chunk * dec,
                bytes: 2.0 * (pf - 1.0) * wire / pf,
            }
        }
        Strategy::CompressedAllGather => Cost {
            // Encode once, gather p-1 frames, decode_add all p (own included, so every
            // rank sums the same decoded values).
            fixed: (pf - 1.0) * latency_s + input * enc + pf * input * add,
            bytes: (pf - 1.0) * wire,
        },
        Strategy::SignMajority => Cost {
            // As the all-gather, with a decode and a vote per frame instead of a decode_add.
            fixed: (pf - 1.0) * latency_s + input * enc + pf * input * dec,
            bytes: (pf - 1.0) * wire,
        },
        Strategy::TwoShot => {
            let chunk = input / pf;
            // Two steps, each p - 1 messages sent at once (to p - 1 ports: a switch), so
            // one latency each; the bytes of the ring through this rank's port. The p - 1
            // chunks encoded for their owners, the owner's fused sum of p - 1 frames and
            // its encode of the sum, and the decode of every owner's frame (its own too).
            Cost {
                fixed: 2.0 * latency_s
                    + (pf - 1.0) * chunk * (enc + add)
                    + chunk * enc
                    + pf * chunk * dec,
                bytes: 2.0 * (pf - 1.0) * wire / pf,
            }
        }
    }
}

/// The cost of one PowerSGD step on matrices of `shapes` (rows `n`, columns `m`) at rank
/// `rank` (each matrix uses `min(rank, n, m)`): two all-reduces one after the other
/// (`Q = M^T P` needs the reduced `P`), of `sum n r` and of `sum m r` values, by
/// `strategy` with the factors' codec `c`. So its bytes are those of `(n + m) r` values
/// instead of `n m`, and it pays the latency terms of two all-reduces. The products and
/// the orthogonalisation are not counted (they read each gradient about three times).
pub fn powersgd_cost(
    strategy: Strategy,
    c: &CodecProfile,
    p: u32,
    latency_s: f64,
    shapes: &[(usize, usize)],
    rank: usize,
    reduce_bytes_per_s: f64,
) -> Cost {
    let (mut ps, mut qs) = (0f64, 0f64);
    for &(n, m) in shapes {
        let r = rank.min(n).min(m) as f64;
        ps += n as f64 * r;
        qs += m as f64 * r;
    }
    let a = allreduce_cost(strategy, c, p, latency_s, ps, reduce_bytes_per_s);
    let b = allreduce_cost(strategy, c, p, latency_s, qs, reduce_bytes_per_s);
    Cost {
        fixed: a.fixed + b.fixed,
        bytes: a.bytes + b.bytes,
    }
}

/// The time of a compressed ring all-reduce whose chunks go as `pieces` pieces each (a
/// pipelined ring: piece `j + 1` is encoded while piece `j` is on the link), on links of
/// `bandwidth_bit_s`. Each of the `2(p - 1)` hops moves one chunk: with compute `C`
/// (reduce-scatter: encode and decode_add of a chunk; all-gather: decode) and transfer
/// `X`, a hop takes `max(C, X) + min(C, X) / pieces + latency`: the larger of the two,
/// plus the fill and drain of the pipeline. With one piece that is `C + X + latency`,
/// and the whole is [`allreduce_cost`] for [`Strategy::CompressedRing`].
pub fn pipelined_ring_time(
    c: &CodecProfile,
    p: u32,
    latency_s: f64,
    elements: f64,
    pieces: u32,
    bandwidth_bit_s: f64,
) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let (pf, k) = (p as f64, pieces.max(1) as f64);
    let chunk = 4.0 * elements / pf;
    let x = elements * c.bits_per_element / pf / bandwidth_bit_s;
    let (enc, dec, add) = (
        1.0 / c.encode_bytes_per_s,
        1.0 / c.decode_bytes_per_s,
        1.0 / c.decode_add_bytes_per_s,
    );
    let hop = |comp: f64| comp.max(x) + comp.min(x) / k + latency_s;
    (pf - 1.0) * hop(chunk * (enc + add)) + chunk * enc + (pf - 1.0) * hop(chunk * dec)
}

/// The compressed strategies, in the order [`best_strategy`] breaks ties.
pub const COMPRESSED: [Strategy; 3] = [
    Strategy::CompressedRing,
    Strategy::CompressedAllGather,
    Strategy::TwoShot,
];

/// The compressed strategies the automatic choice weighs for codec `c`: every one of
/// [`COMPRESSED`], but the two-shot not for a sparse codec (see
/// [`crate::CodecSpec::sparse`]; `c`'s spec parsed, one that is not a codec's
/// counted as dense).
pub fn candidates(c: &CodecProfile) -> &'static [Strategy] {
    let sparse = c.spec.parse::<crate::CodecSpec>().is_ok_and(|s| s.sparse());
    if sparse {
        &COMPRESSED[..2]
    } else {
        &COMPRESSED
    }
}

/// The fastest compressed strategy for codec `c` on `cluster` among its
/// [`candidates`], with its time.
pub fn best_strategy(
    c: &CodecProfile,
    cluster: &Cluster,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> (Strategy, f64) {
    candidates(c)
        .iter()
        .map(|&s| {
            let t = allreduce_cost(
                s,
                c,
                cluster.nodes,
                cluster.latency_s,
                elements,
                reduce_bytes_per_s,
            )
            .time(cluster.bandwidth_bit_s);
            (s, t)
        })
        .fold((Strategy::CompressedRing, f64::INFINITY), |a, b| {
            if b.1 < a.1 { b } else { a }
        })
}

/// A cluster of nodes with two kinds of link: between the ranks of a node (shared memory,
/// NVLink, a local switch) and between nodes. Each node reaches the others through one
/// uplink of `inter_bandwidth_bit_s`, which the streams of its ranks share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TwoLevel {
    /// Number of nodes (>= 1).
    pub nodes: u32,
    /// Ranks per node (the largest node's, for nodes of unequal size; >= 1).
    pub per_node: u32,
    /// Bandwidth between two ranks of a node, bit/s.
    pub intra_bandwidth_bit_s: f64,
    /// Latency per message inside a node, seconds.
    pub intra_latency_s: f64,
    /// Bandwidth of a node's uplink, bit/s.
    pub inter_bandwidth_bit_s: f64,
    /// Latency per message between nodes, seconds.
    pub inter_latency_s: f64,
}

impl TwoLevel {
    /// Ranks in all.
    pub fn ranks(&self) -> u32 {
        self.nodes.saturating_mul(self.per_node)
    }
}

/// The time of a flat all-reduce (every rank a peer of the ring, ranks of a node next to
/// each other) by `strategy` with codec `c` on a [`TwoLevel`] cluster: the ring moves in
/// lock-step hops, and each hop waits for the edges that cross between nodes (one per
/// node and direction, so each on an uplink of its own), so the whole runs at the
/// uplinks' bandwidth and latency. The two-shot all-reduce is no ring: every rank sends
/// to every other, so a node's uplink carries what all of its ranks send off the node.
pub fn flat_time(
    strategy: Strategy,
    c: &CodecProfile,
    two: &TwoLevel,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> f64 {
    let (bw, lat) = if two.nodes > 1 {
        (two.inter_bandwidth_bit_s, two.inter_latency_s)
    } else {
        (two.intra_bandwidth_bit_s, two.intra_latency_s)
    };
    let cost = allreduce_cost(strategy, c, two.ranks(), lat, elements, reduce_bytes_per_s);
    if strategy == Strategy::TwoShot && two.nodes > 1 {
        // Not a ring: every rank of a node sends to every rank of the other nodes, so
        // the uplink carries the share of all the node's ranks that leaves it.
        let (p, l) = (two.ranks() as f64, two.per_node.max(1) as f64);
        let leaving = l * 2.0 * (p - l) * elements * c.bits_per_element / 8.0 / p;
        return cost.fixed + leaving * 8.0 / bw;
    }
    cost.time(bw)
}

/// The time of the two-level all-reduce ([`crate::collective::Hierarchical`]) of
/// `elements` values: a reduce-scatter inside each node in `node_bits` bits per element
/// (32 for f32, 16 for bf16), `per_node` streams between nodes, each an all-reduce of a
/// `1/per_node` shard by `strategy` with codec `c` among the nodes, sharing the node's
/// uplink, then an all-gather inside the node.
pub fn hierarchical_time(
    strategy: Strategy,
    c: &CodecProfile,
    two: &TwoLevel,
    elements: f64,
    node_bits: f64,
    reduce_bytes_per_s: f64,
) -> f64 {
    let l = two.per_node.max(1) as f64;
    let shard = elements / l;
    let node_bytes = shard * node_bits / 8.0;
    // Each rank sends l - 1 shards and receives as many (full duplex), then sums them.
    let inside =
        2.0 * (l - 1.0) * (two.intra_latency_s + node_bytes * 8.0 / two.intra_bandwidth_bit_s)
            + (l - 1.0) * shard * 4.0 / reduce_bytes_per_s;
    let between = if two.nodes > 1 {
        let one = allreduce_cost(
            strategy,
            c,
            two.nodes,
            two.inter_latency_s,
            shard,
            reduce_bytes_per_s,
        );
        one.fixed + l * one.bytes * 8.0 / two.inter_bandwidth_bit_s
    } else {
        0.0
    };
    inside + between
}

/// Whether to go by node: the fastest of the flat all-reduce and the two-level one
/// (node codec f32), each by the fastest of the [`candidates`] for codec `c` (fp32 ring
/// for an fp32 profile of 32 bits per element). Returns `(hierarchical, strategy,
/// seconds)`.
pub fn best_two_level(
    c: &CodecProfile,
    two: &TwoLevel,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> (bool, Strategy, f64) {
    let strategies: &[Strategy] = if c.bits_per_element >= 32.0 {
        &[Strategy::Fp32Ring]
    } else {
        candidates(c)
    };
    let mut best = (false, strategies[0], f64::INFINITY);
    for &s in strategies {
        let flat = flat_time(s, c, two, elements, reduce_bytes_per_s);
        let hier = hierarchical_time(s, c, two, elements, 32.0, reduce_bytes_per_s);
        for (h, t) in [(false, flat), (true, hier)] {
            if t < best.2 {
                best = (h, s, t);
            }
        }
    }
    best
}

/// The break-even link bandwidth (bit/s): below it, codec `c` (best strategy) all-reduces
/// faster than a plain fp32 ring; above it, compression costs more than it saves.
/// `f64::INFINITY` if the codec wins at every bandwidth, `0.0` if it never wins.
pub fn break_even_bandwidth(
    c: &CodecProfile,
    nodes: u32,
    latency_s: f64,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> f64 {
    if nodes <= 1 {
        return 0.0;
    }
    let f = allreduce_cost(
        Strategy::Fp32Ring,
        c,
        nodes,
        latency_s,
        elements,
        reduce_bytes_per_s,
    );
    let mut best: f64 = 0.0;
    for &s in candidates(c) {
        let k = allreduce_cost(s, c, nodes, latency_s, elements, reduce_bytes_per_s);
        // k.fixed + 8 k.bytes / b <= f.fixed + 8 f.bytes / b
        // <=> 8 (f.bytes - k.bytes) / b >= k.fixed - f.fixed.
        let saved_bits = 8.0 * (f.bytes - k.bytes);
        let extra = k.fixed - f.fixed;
        let b = if saved_bits <= 0.0 {
            if extra <= 0.0 && saved_bits == 0.0 {
                f64::INFINITY
            } else {
                0.0
            }
        } else if extra <= 0.0 {
            f64::INFINITY
        } else {
            saved_bits / extra
        };
        best = best.max(b);
    }
    best
}

/// The fastest fp32 all-reduce of `elements` values: the fp32 ring (summing at
/// `reduce_bytes_per_s`) or an all-gather of fp32 frames (`identity`'s profile; fewer
/// latencies, so it wins when latency dominates), with its time.
pub fn best_fp32(
    identity: &CodecProfile,
    cluster: &Cluster,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> (Strategy, f64) {
    FP32.iter()
        .map(|&s| {
            let cost = allreduce_cost(
                s,
                identity,
                cluster.nodes,
                cluster.latency_s,
                elements,
                reduce_bytes_per_s,
            );
            (s, cost.time(cluster.bandwidth_bit_s))
        })
        .fold((Strategy::Fp32Ring, f64::INFINITY), |a, b| {
            if b.1 < a.1 { b } else { a }
        })
}

/// The fp32 all-reduces [`best_fp32`] chooses from (with `identity`'s profile), in the
/// order it breaks ties: the ring, and an all-gather of fp32 frames.
const FP32: [Strategy; 2] = [Strategy::Fp32Ring, Strategy::CompressedAllGather];

/// Where compression pays: the link bandwidths (bit/s) at which codec `c`, with its best
/// compressed strategy, all-reduces faster than the best fp32 all-reduce
/// ([`best_fp32`]). Disjoint open intervals `(low, high)`, in increasing order; `low` may
/// be 0 and `high` infinite. Usually one interval from 0 (the codec pays on links slower
/// than its break-even), but when latency dominates an all-gather of frames can win on
/// fast links too, so the set is computed exactly: every time is `fixed + bytes / b`, a
/// line in `1 / b`, and the lines' crossings cut `1 / b` into pieces of constant sign.
/// Empty when the codec never pays, `[(0, inf)]` when it always does.
pub fn winning_bandwidths(
    c: &CodecProfile,
    identity: &CodecProfile,
    nodes: u32,
    latency_s: f64,
    elements: f64,
    reduce_bytes_per_s: f64,
) -> Vec<(f64, f64)> {
    if nodes <= 1 {
        return Vec::new();
    }
    let cost = |s, p| allreduce_cost(s, p, nodes, latency_s, elements, reduce_bytes_per_s);
    // Lines in u = 1 / b: time = fixed + 8 bytes u.
    let codec: Vec<Cost> = candidates(c).iter().map(|&s| cost(s, c)).collect();
    let fp32 = FP32.map(|s| cost(s, identity));
    let all: Vec<Cost> = codec.iter().chain(&fp32).copied().collect();
    let mut cuts: Vec<f64> = Vec::new();
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            let u = (b.fixed - a.fixed) / (8.0 * (a.bytes - b.bytes));
            if u.is_finite() && u > 0.0 {
                cuts.push(u);
            }
        }
    }
    cuts.sort_by(f64::total_cmp);
    cuts.dedup();
    let wins = |u: f64| {
        let t = |k: &Cost| k.fixed + 8.0 * k.bytes * u;
        let best_codec = codec.iter().map(t).fold(f64::INFINITY, f64::min);
        let best_fp32 = fp32.iter().map(t).fold(f64::INFINITY, f64::min);
        best_codec < best_fp32
    };
    // Pieces of u: (0, cuts[0]), (cuts[0], cuts[1]), ..., (cuts[last], inf).
    let mut bounds = vec![0.0];
    bounds.extend(&cuts);
    bounds.push(f64::INFINITY);
    let mut out: Vec<(f64, f64)> = Vec::new();
    for w in bounds.windows(2) {
        let (lo, hi) = (w[0], w[1]);
        let mid = match (lo == 0.0, hi.is_infinite()) {
            (true, true) => 1e-9,
            (true, false) => hi / 2.0,
            (false, true) => lo * 2.0,
            (false, false) => (lo + hi) / 2.0,
        };
        if wins(mid) {
            // u in (lo, hi) is bandwidth in (1 / hi, 1 / lo).
            let band = (1.0 / hi, if lo == 0.0 { f64::INFINITY } else { 1.0 / lo });
            match out.first_mut() {
                // Pieces come in decreasing bandwidth: join touching ones.
                Some(prev) if prev.0 == band.1 => prev.0 = band.0,
                _ => out.insert(0, band),
            }
        }
    }
    out
}

// ---------------------------------------------------------------- parsing

/// Parse a bandwidth such as `25Gbit/s`, `10Gbps`, `100 Mbit/s`, `1.25GB/s` or `12.5GiB/s`
/// into bit/s. Decimal prefixes k, M, G, T (powers of 1000), binary Ki, Mi, Gi, Ti
/// (powers of 1024); `bit/s`, `b/s` and `bps` are bits, `B/s` and `Bps` bytes.
pub fn parse_bandwidth(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    let (mul, rest) = prefix(unit);
    let per_unit = match rest {
        "bit/s" | "b/s" | "bps" | "bit" => 1.0,
        "B/s" | "Bps" | "byte/s" => 8.0,
        _ => {
            return Err(format!(
                "bandwidth {s:?}: unknown unit {unit:?}; write e.g. 25Gbit/s, 10Gbps, 100Mbit/s or 1.25GB/s"
            ));
        }
    };
    positive(s, "bandwidth", v * mul * per_unit)
}

/// Parse a duration such as `5us`, `1.5ms`, `20ns`, `0.001s` or `0` into seconds.
pub fn parse_duration(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    // Divide (not multiply by 1e-6): 5 / 1e6 rounds to the f64 nearest 5e-6.
    let div = match unit {
        "s" => 1.0,
        "ms" => 1e3,
        "us" | "µs" => 1e6,
        "ns" => 1e9,
        "" if v == 0.0 => 1.0,
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?}; write e.g. 5us, 1ms, 20ns or 0.5s"
            ));
        }
    };
    let t = v / div;
    if !(t >= 0.0 && t.is_finite()) {
        return Err(format!("duration {s:?} must be finite and non-negative"));
    }
    Ok(t)
}

/// Parse a size such as `25MiB`, `100MB`, `4096` (bytes) or `1.5GiB` into bytes.
pub fn parse_size(s: &str) -> Result<f64, String> {
    let (v, unit) = split_number(s)?;
    let (mul, rest) = prefix(unit);
    if !matches!(rest, "B" | "") || (rest.is_empty() && mul != 1.0) {
        return Err(format!(
            "size {s:?}: unknown unit {unit:?}; write e.g. 25MiB, 100MB or 4096"
        ));
    }
    positive(s, "size", v * mul)
}

fn split_number(s: &str) -> Result<(f64, &str), String> {
    let t = s.trim();
    let end = t
        .char_indices()
        .find(|&(i, c)| {
            !(c.is_ascii_digit()
                || c == '.'
                || ((c == 'e' || c == 'E')
                    && t[i + 1..]
                        .starts_with(|d: char| d.is_ascii_digit() || d == '-' || d == '+'))
                || ((c == '-' || c == '+') && i > 0 && matches!(&t[i - 1..i], "e" | "E")))
        })
        .map_or(t.len(), |(i, _)| i);
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative"));
    }
    let v: f64 = t[..end]
        .parse()
        .map_err(|_| format!("{s:?} does not start with a number"))?;
    Ok((v, t[end..].trim_start()))
}

fn prefix(unit: &str) -> (f64, &str) {
    for (p, m) in [
        ("Ki", 1024f64),
        // Exact powers of two (`powi`'s precision is unspecified).
        ("Mi", (1u64 << 20) as f64),
        ("Gi", (1u64 << 30) as f64),
        ("Ti", (1u64 << 40) as f64),
        ("k", 1e3),
        ("K", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ] {
        if let Some(rest) = unit.strip_prefix(p) {
            // "B" alone is bytes, not a prefix; a prefix needs a unit after it.
            if !rest.is_empty() {
                return (m, rest);
            }
        }
    }
    (1.0, unit)
}

fn positive(s: &str, what: &str, v: f64) -> Result<f64, String> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(format!("{what} {s:?} must be positive and finite"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two(nodes: u32, per_node: u32, inter: f64) -> TwoLevel {
        TwoLevel {
            nodes,
            per_node,
            intra_bandwidth_bit_s: f64::INFINITY,
            intra_latency_s: 0.0,
            inter_bandwidth_bit_s: inter,
            inter_latency_s: 0.0,
        }
    }

    #[test]
    fn two_level_with_one_rank_per_node_is_the_flat_all_reduce() {
        let int8 = CodecProfile::nominal("int8", 8.125);
        for s in [Strategy::CompressedRing, Strategy::CompressedAllGather] {
            let t = two(6, 1, 1e9);
            let (flat, hier) = (
                flat_time(s, &int8, &t, 1e6, 1e30),
                hierarchical_time(s, &int8, &t, 1e6, 32.0, 1e30),
            );
            assert!(
                (flat - hier).abs() <= 1e-12 * flat,
                "{s:?}: {flat} vs {hier}"
            );
        }
    }

    #[test]
    fn two_level_moves_fewer_bytes_over_the_uplinks() {
        // fp32, 2 nodes of 4, free links inside: the flat ring sends 2 (8 - 1) / 8 of the
        // tensor over each uplink, the two-level one 4 shards of 2 (2 - 1) / 2 of a
        // quarter: 1.75x fewer bytes; int8 between nodes 32 / 8.125 times fewer again.
        let fp32 = CodecProfile::nominal("identity", 32.0);
        let t = two(2, 4, 1e9);
        let g = 4.0 * 1024.0 * 1024.0;
        let flat = flat_time(Strategy::Fp32Ring, &fp32, &t, g, f64::INFINITY);
        let hier = hierarchical_time(Strategy::Fp32Ring, &fp32, &t, g, 32.0, f64::INFINITY);
        assert!((flat / hier - 1.75).abs() < 1e-9, "{}", flat / hier);
        let int8 = CodecProfile::nominal("int8", 8.0);
        let h8 = hierarchical_time(Strategy::CompressedRing, &int8, &t, g, 32.0, f64::INFINITY);
        assert!((hier / h8 - 4.0).abs() < 1e-9, "{}", hier / h8);
        let (by_node, s, _) = best_two_level(&int8, &t, g, f64::INFINITY);
        assert!(by_node && s != Strategy::Fp32Ring);
        // One node: no uplink in the way; the reduce-scatter and all-gather inside it
        // move the flat ring's bytes.
        let one = TwoLevel {
            intra_bandwidth_bit_s: 100e9,
            ..two(1, 8, 1e9)
        };
        let (f1, h1) = (
            flat_time(Strategy::Fp32Ring, &fp32, &one, g, f64::INFINITY),
            hierarchical_time(Strategy::Fp32Ring, &fp32, &one, g, 32.0, f64::INFINITY),
        );
        assert!((f1 - h1).abs() <= 1e-9 * f1, "{f1} vs {h1}");
    }

    #[test]
    fn powersgd_sends_the_factors_with_two_latency_terms() {
        let fp32 = CodecProfile::nominal("identity", 32.0);
        let (p, lat) = (8, 1e-4);
        let full = allreduce_cost(Strategy::Fp32Ring, &fp32, p, lat, 4096.0 * 1024.0, 1e30);
        let c = powersgd_cost(Strategy::Fp32Ring, &fp32, p, lat, &[(4096, 1024)], 4, 1e30);
        // Bytes: (4096 + 1024) 4 values instead of 4096 x 1024.
        let ratio = c.bytes / full.bytes;
        assert!(
            (ratio - 5120.0 * 4.0 / (4096.0 * 1024.0)).abs() < 1e-12,
            "{ratio}"
        );
        // Two rings of 2 (p - 1) latency terms each.
        assert!(
            (c.fixed - 2.0 * 2.0 * 7.0 * lat).abs() < 1e-9,
            "{}",
            c.fixed
        );
        // A rank above the matrix's smaller side is capped: 100 x 2 at rank 2 sends
        // (100 + 2) 2 values.
        let thin = powersgd_cost(Strategy::Fp32Ring, &fp32, p, lat, &[(100, 2)], 4, 1e30);
        let exact = allreduce_cost(Strategy::Fp32Ring, &fp32, p, lat, 204.0, 1e30);
        assert!((thin.bytes - exact.bytes).abs() < 1e-9, "{}", thin.bytes);
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-300)
    }

    #[test]
    fn pipelined_ring_matches_the_ring_and_approaches_the_larger_term() {
        let c = CodecProfile {
            spec: "int8".into(),
            bits_per_element: 8.25,
            encode_bytes_per_s: 10e9,
            decode_bytes_per_s: 20e9,
            decode_add_bytes_per_s: 15e9,
        };
        let (p, lat, n, bw) = (8, 5e-6, 25e6, 10e9);
        let ring = allreduce_cost(Strategy::CompressedRing, &c, p, lat, n, f64::INFINITY).time(bw);
        let one = pipelined_ring_time(&c, p, lat, n, 1, bw);
        assert!(close(one, ring), "{one} vs {ring}");
        let many = pipelined_ring_time(&c, p, lat, n, 1 << 20, bw);
        assert!(many < pipelined_ring_time(&c, p, lat, n, 4, bw));
        assert!(many < one);
        // Never below the larger of compute and transfer per hop.
        let chunk = 4.0 * n / p as f64;
        let x = n * c.bits_per_element / p as f64 / bw;
        let rs = chunk * (1.0 / 10e9 + 1.0 / 15e9);
        assert!(many >= (p - 1) as f64 * (rs.max(x) + x.max(chunk / 20e9)));
        assert_eq!(pipelined_ring_time(&c, 1, lat, n, 4, bw), 0.0);
    }

    /// The worked example of docs/cost-model.md: 8 nodes, a gradient of 1024*1024*32 bits (4 MiB of
    /// fp32), 10 * 1024^3 bit/s links, 1 ms latency.
    #[test]
    fn worked_example() {
        let (n, g, b, a) = (8, 1024.0 * 1024.0 * 32.0, 10.0 * 1024f64.powi(3), 1e-3);
        // 2 * 7/8 * 2^25 / (10 * 2^30) = 1.75 * 2^-5 / 10 = 5.46875 ms.
        assert!(close(ring_ideal(n, g, b), 0.005_468_75));
        assert!(close(ring_quantised(n, g, b, 32.0), 0.005_468_75));
        assert!(close(ring_quantised(n, g, b, 16.0), 0.002_734_375));
        assert!(close(ring_quantised(n, g, b, 8.0), 0.001_367_187_5));
        // 14 messages in sequence, 1 ms each: 14 ms + 5.46875 ms.
        // (the pipelined ring's one-piece form is the compressed ring's cost: see
        // pipelined_ring_matches_the_ring_and_approaches_the_larger_term)
        assert!(close(ring_with_latency(n, g, b, a), 0.019_468_75));
        assert_eq!(ring_with_latency(1, g, b, a), 0.0);
        assert_eq!(ring_ideal(1, g, b), 0.0);
    }

    #[test]
    fn thakur_models() {
        let m = AlphaBetaGamma {
            alpha: 1e-6,
            beta: 1e-9,
            gamma: 1e-10,
        };
        let n = 1e6;
        // p = 8: lg p = 3.
        assert!(close(m.ring_allreduce(8, n), 14e-6 + 1.75e-3 + 0.875e-4));
        assert!(close(
            m.binomial_tree_allreduce(8, n),
            6.0 * (1e-6 + 1e-3) + 3e-4
        ));
        assert!(close(
            m.recursive_doubling_allreduce(8, n),
            3.0 * (1e-6 + 1e-3 + 1e-4)
        ));
        assert!(close(
            m.halving_doubling_allreduce(8, n),
            6e-6 + 1.75e-3 + 0.875e-4
        ));
        assert!(close(m.ring_allgather(8, n), 7e-6 + 7e-3));
        // Non-powers of two round lg p up.
        assert!(close(
            m.binomial_tree_allreduce(5, n),
            2.0 * 3.0 * (1e-6 + 1e-3) + 3e-4
        ));
        // The alpha-beta ring agrees with the latency-free formula.
        let ab = AlphaBetaGamma::new(10e9, 0.0, f64::INFINITY);
        assert!(close(ab.ring_allreduce(8, 4e6), ring_ideal(8, 32e6, 10e9)));
    }

    #[test]
    fn nominal_codec_matches_the_quantised_formula() {
        // With free compute and no latency, the compressed ring is the k-bit formula.
        let c = CodecProfile::nominal("int8", 8.0);
        let cost = allreduce_cost(Strategy::CompressedRing, &c, 8, 0.0, 1e6, f64::INFINITY);
        assert!(close(cost.time(10e9), ring_quantised(8, 32e6, 10e9, 8.0)));
        let fp32 = allreduce_cost(Strategy::Fp32Ring, &c, 8, 0.0, 1e6, f64::INFINITY);
        assert!(close(fp32.time(10e9), ring_ideal(8, 32e6, 10e9)));
        // Free compression always pays.
        assert_eq!(
            break_even_bandwidth(&c, 8, 1e-6, 1e6, f64::INFINITY),
            f64::INFINITY
        );
    }

    #[test]
    fn break_even_is_where_the_times_cross() {
        let c = CodecProfile {
            spec: "int8".into(),
            bits_per_element: 8.0,
            encode_bytes_per_s: 20e9,
            decode_bytes_per_s: 40e9,
            decode_add_bytes_per_s: 30e9,
        };
        let (p, lat, n, red) = (8, 5e-6, 4e6, 50e9);
        let b = break_even_bandwidth(&c, p, lat, n, red);
        assert!(b > 0.0 && b.is_finite(), "{b}");
        let fp32 = |bw| allreduce_cost(Strategy::Fp32Ring, &c, p, lat, n, red).time(bw);
        let best = |bw| {
            best_strategy(
                &c,
                &Cluster {
                    nodes: p,
                    bandwidth_bit_s: bw,
                    latency_s: lat,
                },
                n,
                red,
            )
            .1
        };
        assert!(close(best(b), fp32(b)) || (best(b) - fp32(b)).abs() < 1e-9 * fp32(b));
        assert!(best(b * 0.5) < fp32(b * 0.5));
        assert!(best(b * 2.0) > fp32(b * 2.0));
        // A single node never communicates.
        assert_eq!(break_even_bandwidth(&c, 1, lat, n, red), 0.0);
    }

    #[test]
    fn parses_units_and_rejects_nonsense() {
        assert_eq!(parse_bandwidth("25Gbit/s").unwrap(), 25e9);
        assert_eq!(parse_bandwidth("10Gbps").unwrap(), 10e9);
        assert_eq!(parse_bandwidth("100 Mbit/s").unwrap(), 100e6);
        assert_eq!(parse_bandwidth("1.25GB/s").unwrap(), 10e9);
        assert_eq!(
            parse_bandwidth("1GiB/s").unwrap(),
            8.0 * (1u64 << 30) as f64
        );
        assert_eq!(parse_duration("5us").unwrap(), 5e-6);
        assert_eq!(parse_duration("1ms").unwrap(), 1e-3);
        assert_eq!(parse_duration("0").unwrap(), 0.0);
        assert_eq!(parse_size("25MiB").unwrap(), 25.0 * 1024.0 * 1024.0);
        assert_eq!(parse_size("100MB").unwrap(), 100e6);
        assert_eq!(parse_size("4096").unwrap(), 4096.0);
        assert_eq!(parse_size("1e6B").unwrap(), 1e6);
        for bad in [
            "10Gpbs", "Gbit/s", "10 G", "-1Gbit/s", "0bps", "10Gbit/h", "",
        ] {
            assert!(parse_bandwidth(bad).is_err(), "{bad}");
        }
        for bad in ["5", "5 lightyears", "-1ms", "ms"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        for bad in ["25MiBs", "0", "x", "10Gbit/s"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    fn prof(bits: f64, enc: f64, dec: f64, add: f64) -> CodecProfile {
        CodecProfile {
            spec: "test".into(),
            bits_per_element: bits,
            encode_bytes_per_s: enc,
            decode_bytes_per_s: dec,
            decode_add_bytes_per_s: add,
        }
    }

    /// The winning set agrees with the times at every bandwidth of a fine grid (away
    /// from its own ends), for latency- and bandwidth-bound sizes.
    #[test]
    #[cfg_attr(miri, ignore = "arithmetic only, no unsafe code to check")]
    fn winning_bandwidths_agree_with_the_times_they_summarise() {
        let identity = prof(32.1, 40e9, 40e9, 35e9);
        let codecs = [
            prof(8.6, 18e9, 33e9, 31e9),
            prof(0.85, 0.5e9, 21e9, 27e9),
            prof(1.03, 80e9, 80e9, 70e9),
            prof(16.0, 60e9, 60e9, 55e9),
        ];
        let mut shapes = std::collections::BTreeSet::new();
        for elements in [1e3, 1e5, 4e6, 1e8] {
            for (nodes, lat) in [(8, 5e-6), (2, 5e-6), (64, 50e-6), (4, 0.0)] {
                for c in &codecs {
                    let region = winning_bandwidths(c, &identity, nodes, lat, elements, 35e9);
                    shapes.insert(
                        region.len() * 2
                            + region.last().is_some_and(|r| r.1.is_infinite()) as usize,
                    );
                    for w in region.windows(2) {
                        assert!(w[0].1 < w[1].0, "{region:?}");
                    }
                    let cluster = |b| Cluster {
                        nodes,
                        bandwidth_bit_s: b,
                        latency_s: lat,
                    };
                    // Miri interprets every step: a coarser grid.
                    let steps = if cfg!(miri) { 24 } else { 400 };
                    for i in 0..steps {
                        let b = 10f64.powf(6.0 + i as f64 * 8.0 / steps as f64);
                        let near_end = region.iter().any(|&(lo, hi)| {
                            (lo > 0.0 && (b / lo - 1.0).abs() < 1e-6)
                                || (hi.is_finite() && (b / hi - 1.0).abs() < 1e-6)
                        });
                        if near_end {
                            continue;
                        }
                        let inside = region.iter().any(|&(lo, hi)| lo < b && b < hi);
                        let t = best_strategy(c, &cluster(b), elements, 35e9).1;
                        let f = best_fp32(&identity, &cluster(b), elements, 35e9).1;
                        assert_eq!(
                            inside,
                            t < f,
                            "{elements} el, {nodes} nodes, {b} bit/s: {region:?}"
                        );
                    }
                }
            }
        }
        // Both shapes occur: a break-even below which the codec pays, and a region that
        // reaches infinity (latency-bound all-gathers).
        assert!(shapes.contains(&2), "{shapes:?}");
        assert!(shapes.contains(&3), "{shapes:?}");
    }
}
