//! Two-level all-reduce: full precision inside a node, compressed between nodes.
//!
//! Links inside a machine (shared memory, NVLink, a local bridge) are 10 to 100 times
//! faster than the network between machines, so compressing what stays inside a node
//! costs compute and error for nothing. [`Hierarchical`] splits the all-reduce by node
//! (Horovod's hierarchical all-reduce, BytePS, ZeRO++'s qgZ):
//!
//! 1. **Inside each node, a reduce-scatter** of the tensor in `S` shards (`S` the size of
//!    the largest node): each rank sends every shard it does not own to its owner, with
//!    the node codec (`identity` by default: f32; or `bf16` / `fp16`), and each owner sums
//!    its shards over the node's ranks in local-rank order. Local rank `l` of a node of
//!    `L` ranks owns the shards `s` with `s mod L = l`.
//! 2. **Between nodes, a compressed all-reduce** of each shard among its owners (one per
//!    node, in node order): an [`AllReduce`] with the codec, strategy, pieces and error
//!    feedback of the options, so the `L` streams of a node run side by side. Error
//!    feedback applies to this leg only.
//! 3. **Inside each node, an all-gather**: each owner sends its reduced shard to the
//!    node's other ranks, encoded with the node codec, and takes the decoded frame itself
//!    too.
//!
//! **Inside a host, in place.** When the transport offers the host's stages
//! ([`Transport::node_memory`]: a [`super::SharedMemory`] made with a stage) and the node
//! codec is `identity`, steps 1 and 3 send no messages: each rank writes its parts of the
//! shards into its stage, and each owner sums them straight from its node's stages (then
//! writes its results there for the others to copy), in rounds of the stage's size with
//! barriers between; the same sums in the same order, so the same bits.
//!
//! Every rank ends with the same bits: each shard's value comes from the all-reduce
//! between nodes (the same on every owner) and reaches the rest of its node as the same
//! frame. Nodes may differ in size. With operation `Mean` the sum is divided by the world
//! size at the end. All messages of a run belong to one call of the [`Comm`], with the
//! tag of the options; section 6.8 of the crate's wire-format document specifies them.

use core::ops::Range;

use super::comm::{Phase, Place};
use super::hold::{self, Point};
use super::{
    AllReduce, AllReduceOptions, Comm, ENVELOPE_LEN, NodeMemory, ReduceOp, Stats, Strategy,
    Transport, chunk_range, peer_error,
};
use crate::codec::{Codec, CodecSpec, EncodeCtx};
use crate::error::{Error, Result};
use crate::rng::splitmix64;
use crate::wire;

/// Which node each rank of a world is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nodes {
    node_of: Vec<usize>,
    members: Vec<Vec<usize>>,
}

impl Nodes {
    /// Rank `r` on node `node_of[r]`; the node numbers must be `0 .. N` with every one
    /// used.
    pub fn new(node_of: Vec<usize>) -> Result<Nodes> {
        if node_of.is_empty() {
            return Err(Error::Collective("a node map of no ranks".into()));
        }
        let n = node_of.iter().max().map_or(0, |m| m + 1);
        let mut members = vec![Vec::new(); n];
        for (r, &k) in node_of.iter().enumerate() {
            members[k].push(r);
        }
        if let Some(k) = members.iter().position(Vec::is_empty) {
            return Err(Error::Collective(format!(
                "node {k} of {n} has no rank: number the nodes 0 .. {n} with none left out"
            )));
        }
        Ok(Nodes { node_of, members })
    }

    /// `world` ranks on nodes of `per_node` consecutive ranks (the last node smaller if
    /// `per_node` does not divide `world`).
    pub fn uniform(world: usize, per_node: usize) -> Result<Nodes> {
        if per_node == 0 {
            return Err(Error::Collective("nodes of 0 ranks".into()));
        }
        Nodes::new((0..world).map(|r| r / per_node).collect())
    }

    /// Ranks whose keys (a host name, say) are equal share a node; nodes are numbered in
    /// order of their first rank.
    pub fn from_keys<K: PartialEq>(keys: &[K]) -> Result<Nodes> {
        let mut seen: Vec<&K> = Vec::new();
        let node_of = keys
            .iter()
            .map(|k| match seen.iter().position(|s| *s == k) {
                Some(i) => i,
                None => {
                    seen.push(k);
                    seen.len() - 1
                }
            })
            .collect();
        Nodes::new(node_of)
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.node_of.len()
    }

    /// Number of nodes.
    pub fn count(&self) -> usize {
        self.members.len()
    }

    /// The node of rank `r`.
    pub fn node_of(&self, r: usize) -> usize {
        self.node_of[r]
    }

    /// The ranks of node `k`, in increasing order (local rank `l` is the `l`-th).
    pub fn members(&self, k: usize) -> &[usize] {
        &self.members[k]
    }

    /// The largest node's rank count: the number of shards.
    pub fn max_node(&self) -> usize {
        self.members.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// The messages inside a node: frames of the node codec behind envelopes of this
/// all-reduce's tag, and the buffers they are made and received in.
#[derive(Debug, Clone)]
struct NodeFrames {
    codec: CodecSpec,
    checksum: bool,
    tag: u32,
    enc: Vec<u8>,
    msg: Vec<u8>,
}

impl NodeFrames {
    fn place(&self, call: u64, phase: Phase, hop: usize, chunk: usize) -> Place {
        Place {
            call,
            tag: self.tag,
            phase,
            hop: hop as u32,
            chunk: chunk as u32,
            // The largest shard's sealed frame: the room of the encode buffer.
            max: self.enc.len(),
        }
    }

    /// Encode `x` (a shard starting at element `offset`) after the envelope's room; the
    /// message length.
    fn encode(&mut self, x: &[f32], offset: usize) -> Result<usize> {
        let frame = &mut self.enc[ENVELOPE_LEN..];
        let ctx = EncodeCtx::new(0).with_offset(offset as u64);
        let len = self.codec.encode_into(x, &ctx, frame)?;
        let len = if self.checksum {
            wire::seal(frame, len)?
        } else {
            len
        };
        Ok(ENVELOPE_LEN + len)
    }

    /// Receive the message for `(phase, hop, shard)` from `from` and decode it (`M`:
    /// write or add) into `out`, the shard starting at element `offset`.
    #[allow(clippy::too_many_arguments)]
    fn take<const M: u8, T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        place: Place,
        from: usize,
        offset: usize,
        out: &mut [f32],
    ) -> Result<()> {
        comm.expect(&mut self.msg, from, place)?;
        let ctx = EncodeCtx::new(0).with_offset(offset as u64);
        let bad = |e| peer_error(from, place.phase, from, e);
        let split =
            super::check_origin(&self.codec, &self.msg[ENVELOPE_LEN..], &ctx).map_err(bad)?;
        super::decode_checked::<M>(split, out).map_err(bad)
    }
}

/// The state of a two-level all-reduce of one tensor on one rank (see the module docs).
#[derive(Debug, Clone)]
pub struct Hierarchical {
    nodes: Nodes,
    codec: CodecSpec,
    op: ReduceOp,
    len: usize,
    rank: usize,
    /// This rank's node and its place among the node's ranks.
    node: usize,
    local: usize,
    /// The shards this rank owns, and (with more than one node) each one's all-reduce
    /// between nodes.
    owned: Vec<usize>,
    streams: Vec<AllReduce>,
    strategy: Strategy,
    frames: NodeFrames,
    /// The owned shards' sums over the node, and over every node (a shard's room each).
    acc: Vec<f32>,
    reduced: Vec<f32>,
}

impl Hierarchical {
    /// The state for all-reducing tensors of `len` elements with `codec` between nodes
    /// and `node_codec` inside them (`identity`, `bf16` or `fp16`), on the world of
    /// `transport` grouped by `nodes`. The options' strategy, feedback and pieces apply
    /// to the streams between nodes; `op`, `tag` and `checksum` to the whole.
    pub fn new<T: Transport + ?Sized>(
        codec: impl Into<CodecSpec>,
        node_codec: impl Into<CodecSpec>,
        len: usize,
        transport: &T,
        nodes: Nodes,
        opts: AllReduceOptions,
    ) -> Result<Hierarchical> {
        let (codec, node_codec) = (codec.into(), node_codec.into());
        let (rank, size) = (transport.rank(), transport.size());
        if size != nodes.world() || rank >= size {
            return Err(Error::Collective(format!(
                "transport is rank {rank} of {size}; the node map covers {} ranks",
                nodes.world()
            )));
        }
        if u32::try_from(size).is_err() {
            return Err(Error::Collective(format!(
                "a world of {size} ranks is more than message envelopes can number (2^32 - 1)"
            )));
        }
        if !matches!(
            node_codec,
            CodecSpec::Identity(_) | CodecSpec::Bf16(_) | CodecSpec::Fp16(_)
        ) {
            return Err(Error::Collective(format!(
                "node codec {node_codec}: inside a node use identity, bf16 or fp16"
            )));
        }
        let node = nodes.node_of(rank);
        let local = nodes
            .members(node)
            .iter()
            .position(|&m| m == rank)
            .unwrap_or(0);
        let l = nodes.members(node).len();
        let shards = nodes.max_node();
        let n_nodes = nodes.count();
        let stream_opts = AllReduceOptions {
            op: ReduceOp::Sum,
            ..opts.clone()
        };
        let pieces = opts.pieces;
        if pieces == 0 {
            return Err(Error::Collective(
                "pieces per ring chunk must be at least 1".into(),
            ));
        }
        // Streams of one call that share a pair of ranks: hops apart by the most one
        // stream sends to one peer (the ring's 2 (N - 1) pieces, more than the
        // all-gather's N - 1).
        let per_stream = 2 * n_nodes.saturating_sub(1) * pieces;
        if u32::try_from(
            shards
                .saturating_mul(per_stream.max(1))
                .saturating_add(2 * shards),
        )
        .is_err()
        {
            return Err(Error::Collective(format!(
                "{shards} shards of {pieces} pieces between {n_nodes} nodes: more hops than \
                 envelopes number"
            )));
        }
        let owned: Vec<usize> = (local..shards).step_by(l).collect();
        let mut streams = Vec::new();
        let mut strategy = Strategy::Fp32Ring;
        for &s in owned.iter().filter(|_| n_nodes > 1) {
            let members: Vec<usize> = (0..n_nodes)
                .map(|k| {
                    let m = nodes.members(k);
                    m[s % m.len()]
                })
                .collect();
            let shard_len = chunk_range(len, shards, s).len();
            let ar = AllReduce::in_group(
                codec,
                shard_len,
                &members,
                rank,
                s * per_stream,
                stream_opts.clone(),
            )?;
            strategy = ar.strategy();
            streams.push(ar);
        }
        let max_shard = chunk_range(len, shards, 0).len();
        let owned_n = owned.len().max(1);
        let frame = wire::sealed_len(node_codec.max_encoded_len(max_shard));
        Ok(Hierarchical {
            nodes,
            codec,
            op: opts.op,
            len,
            rank,
            node,
            local,
            owned,
            streams,
            strategy,
            frames: NodeFrames {
                codec: node_codec,
                checksum: opts.checksum,
                tag: opts.tag,
                enc: crate::alloc::filled(
                    frame.saturating_add(ENVELOPE_LEN),
                    0,
                    "the node phase's encode buffer",
                )?,
                msg: Vec::new(),
            },
            // Room for every owned shard (the in-place path keeps them all across its
            // rounds; the frames' path uses the first).
            acc: crate::alloc::filled(owned_n * max_shard, 0.0, "the node's shard sums")?,
            reduced: crate::alloc::filled(owned_n * max_shard, 0.0, "the shards' sums")?,
        })
    }

    /// Elements per tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero-length tensors.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The codec between nodes.
    pub fn codec(&self) -> CodecSpec {
        self.codec
    }

    /// The codec inside nodes.
    pub fn node_codec(&self) -> CodecSpec {
        self.frames.codec
    }

    /// The strategy of the streams between nodes.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The node map.
    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// Zero every residual of the streams between nodes.
    pub fn reset_feedback(&mut self) {
        self.streams.iter_mut().for_each(AllReduce::reset_feedback);
    }

    /// The streams' residuals as one saved blob per owned shard (see
    /// [`AllReduce::save`]; none on a world of one node).
    pub fn save(&self) -> Vec<Vec<u8>> {
        self.streams.iter().map(AllReduce::save).collect()
    }

    /// Restore blobs of [`Hierarchical::save`] (all or nothing).
    pub fn restore(&mut self, blobs: &[Vec<u8>]) -> Result<()> {
        crate::state::restore_all(&mut self.streams, blobs, AllReduce::restore)
    }

    /// One all-reduce: `output` gets the reduction over all ranks of their `input` (both
    /// of [`Hierarchical::len`] elements). `seed` must be the same on every rank
    /// (change it every step). One call of `comm`.
    pub fn run<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: &[f32],
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        self.run_in(comm, Some(input), output, seed)
    }

    /// [`Hierarchical::run`] in place: `data` is this rank's input and gets the
    /// reduction. The same messages and bits as `run` with a copy of `data` as input,
    /// without that copy (every part of the input is read before its part of the output
    /// is written).
    pub fn run_in_place<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        data: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        self.run_in(comm, None, data, seed)
    }

    /// [`Hierarchical::run`]; `input` None: in place, `output` holding the input.
    fn run_in<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: Option<&[f32]>,
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        let _fp = crate::kernels::Standard::new();
        let call = comm.begin();
        if comm.rank() != self.rank || comm.size() != self.nodes.world() {
            return Err(Error::Collective(format!(
                "transport is rank {} of {}, but this all-reduce was built for rank {} of {}",
                comm.rank(),
                comm.size(),
                self.rank,
                self.nodes.world()
            )));
        }
        let mut stats = Stats {
            strategy: self.strategy,
            bytes_sent: 0,
            messages: 0,
        };
        // Inside a host with stages, in place (float32 only: the same sums, no frames).
        let members = self.nodes.members(self.node);
        let memory = comm
            .transport()
            .node_memory()
            .filter(|m| self.fits(m, members));
        if let Some(m) = memory {
            // The stages' own count of turns numbers their barriers (collectives that
            // share them take turns). The turn is taken before the arguments are checked,
            // so a refused call gives its turn up and the node's other ranks fail it at
            // once instead of pairing this rank's next call with their this one.
            let turn = m.begin();
            let got = super::check_lens(input.unwrap_or(output), output, self.len)
                .and_then(|()| m.enter(members, turn))
                .and_then(|()| {
                    self.run_in_memory(comm, &m, (call, turn), input, output, seed, &mut stats)
                });
            if got.is_err() {
                m.fail(turn);
            }
            got?;
            self.mean(output);
            return Ok(stats);
        }
        super::check_lens(input.unwrap_or(output), output, self.len)?;
        let local = self.local;
        let (l, shards, n_all) = (members.len(), self.nodes.max_node(), self.len);
        let shard = |s: usize| chunk_range(n_all, shards, s);
        let io = &mut self.frames;
        // Hops per (sender, receiver) pair inside the node: the reduce-scatter's k-th
        // shard owned by the receiver is hop k; the all-gather's k-th shard owned by the
        // sender follows the shards the receiver owns.
        let owned_by = |lr: usize| (lr..shards).step_by(l).count();
        let k_of = |s: usize| s / l;
        let others = || (0..shards).filter(|&s| s % l != local);
        // 1. Reduce-scatter inside the node.
        for s in others() {
            let range = shard(s);
            let len = io.encode(src(input, output, range.clone()), range.start)?;
            let place = io.place(call, Phase::NodeReduceScatter, k_of(s), s);
            comm.post(&mut io.enc[..len], members[s % l], place)?;
            stats.bytes_sent += len as u64;
            stats.messages += 1;
        }
        for (i, &s) in self.owned.iter().enumerate() {
            let range = shard(s);
            let n = range.len();
            // In local-rank order: the first contribution written, the others added.
            let acc = &mut self.acc[..n];
            for (lr, &from) in members.iter().enumerate() {
                let own = src(input, output, range.clone());
                let place = io.place(call, Phase::NodeReduceScatter, k_of(s), s);
                match (lr == local, lr == 0) {
                    (true, true) => acc.copy_from_slice(own),
                    (true, false) => acc.iter_mut().zip(own).for_each(|(a, &x)| *a += x),
                    (false, true) => io.take::<WRITE, T>(comm, place, from, range.start, acc)?,
                    (false, false) => io.take::<ADD, T>(comm, place, from, range.start, acc)?,
                }
            }
            // 2. Between nodes.
            let reduced = &mut self.reduced[..n];
            between(
                &mut self.streams,
                i,
                s,
                comm,
                call,
                acc,
                reduced,
                seed,
                &mut stats,
            )?;
            // 3. This shard to the node's other ranks, and as they decode it, here.
            let len = io.encode(reduced, range.start)?;
            for (lr, &to) in members.iter().enumerate().filter(|&(lr, _)| lr != local) {
                let place = io.place(call, Phase::NodeAllGather, owned_by(lr) + k_of(s), s);
                comm.post(&mut io.enc[..len], to, place)?;
                stats.bytes_sent += len as u64;
                stats.messages += 1;
            }
            let split = wire::split_with(&io.enc[ENVELOPE_LEN..len], false)?;
            super::decode_checked::<WRITE>(split, &mut output[range])?;
        }
        // The shards the other ranks of the node own.
        for s in others() {
            let range = shard(s);
            let place = io.place(call, Phase::NodeAllGather, owned_by(local) + k_of(s), s);
            io.take::<WRITE, T>(comm, place, members[s % l], range.start, &mut output[range])?;
        }
        self.mean(output);
        Ok(stats)
    }

    /// Whether the node phases run through the stages of `m`: float32 inside the node,
    /// every rank of the node on the host, room for a value of every shard, and the
    /// run's barriers within what a turn numbers.
    fn fits(&self, m: &NodeMemory, members: &[usize]) -> bool {
        let shards = self.nodes.max_node();
        let c = m.stage_elems() / shards.max(1);
        let rounds = chunk_range(self.len, shards, 0)
            .len()
            .div_ceil(c.max(1))
            .max(1);
        matches!(self.frames.codec, CodecSpec::Identity(_))
            && m.covers(members)
            && c > 0
            && rounds.saturating_mul(4) <= super::shm::MAX_BARRIERS
    }

    /// With operation `Mean`, divide the sum by the world size.
    fn mean(&self, output: &mut [f32]) {
        if self.op == ReduceOp::Mean {
            super::divide_by_ranks(output, self.nodes.world());
        }
    }

    /// [`Hierarchical::run`]'s node phases through the host's stages, in rounds of `c`
    /// elements per shard (`c` the stage's elements over the shards): each rank writes its
    /// part of every shard, a barrier, each owner sums its shards over the node's ranks in
    /// local-rank order, a barrier; then the streams between nodes; then the owners write
    /// their reduced shards, a barrier, every rank copies them, a barrier. The same sums
    /// in the same order as the frames' path, so the same bits. `call` is the call of
    /// `comm`, `turn` that of the stages ([`NodeMemory::begin`]).
    #[allow(clippy::too_many_arguments)]
    fn run_in_memory<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        m: &NodeMemory,
        (call, turn): (u64, u64),
        input: Option<&[f32]>,
        output: &mut [f32],
        seed: u64,
        stats: &mut Stats,
    ) -> Result<()> {
        let members = self.nodes.members(self.node);
        let (shards, n_all) = (self.nodes.max_node(), self.len);
        let shard = |s: usize| chunk_range(n_all, shards, s);
        let c = m.stage_elems() / shards;
        let max_shard = shard(0).len();
        let rounds = max_shard.div_ceil(c).max(1);
        let part = |s: usize, t: usize| {
            let r = shard(s);
            let lo = (t * c).min(r.len());
            let hi = ((t + 1) * c).min(r.len());
            (r.start + lo)..(r.start + hi)
        };
        let (acc, reduced) = (&mut self.acc, &mut self.reduced);
        let me = self.rank;
        let mut b = 0u32;
        let mut barrier = |last: bool| {
            hold::at(me, Point::Barrier, call, u64::from(b));
            let r = m.barrier(members, turn, b, last);
            b += 1;
            r
        };
        // Writes and copies of this call, counted for the hold points.
        let (mut writes, mut reads) = (0u64, 0u64);
        let mut write = |at: usize, x: &[f32]| {
            hold::at(me, Point::StageWrite, call, writes);
            writes += 1;
            m.write(at, x);
        };
        let mut read = |from: usize, at: usize, out: &mut [f32], add: bool| {
            hold::at(me, Point::StageRead, call, reads);
            m.read(from, at, out, add, (call, reads));
            reads += 1;
        };
        for t in 0..rounds {
            for s in 0..shards {
                write(s * c, src(input, output, part(s, t)));
            }
            barrier(false)?;
            for (i, &s) in self.owned.iter().enumerate() {
                let p = part(s, t);
                let off = p.start - shard(s).start;
                let dst = &mut acc[i * max_shard + off..i * max_shard + off + p.len()];
                for (lr, &from) in members.iter().enumerate() {
                    read(from, s * c, dst, lr != 0);
                }
            }
            barrier(false)?;
        }
        for (i, &s) in self.owned.iter().enumerate() {
            let room = i * max_shard..i * max_shard + shard(s).len();
            let (a, r) = (&acc[room.clone()], &mut reduced[room]);
            between(&mut self.streams, i, s, comm, call, a, r, seed, stats)?;
        }
        for t in 0..rounds {
            for (i, &s) in self.owned.iter().enumerate() {
                let p = part(s, t);
                let off = p.start - shard(s).start;
                write(
                    s * c,
                    &reduced[i * max_shard + off..i * max_shard + off + p.len()],
                );
            }
            barrier(false)?;
            for s in 0..shards {
                let owner = members[s % members.len()];
                read(owner, s * c, &mut output[part(s, t)], false);
            }
            barrier(t + 1 == rounds)?;
        }
        Ok(())
    }
}

/// Elements `r` of the input: of `input`, or of `output` in place.
fn src<'a>(input: Option<&'a [f32]>, output: &'a [f32], r: Range<usize>) -> &'a [f32] {
    &input.unwrap_or(output)[r]
}

/// Step 2 for owned shard `s` (the `i`-th): its node sum `acc` all-reduced among its
/// owners in every node into `reduced` (a world of one node: the node sum is the result).
#[allow(clippy::too_many_arguments)]
fn between<T: Transport + ?Sized>(
    streams: &mut [AllReduce],
    i: usize,
    s: usize,
    comm: &mut Comm<T>,
    call: u64,
    acc: &[f32],
    reduced: &mut [f32],
    seed: u64,
    stats: &mut Stats,
) -> Result<()> {
    match streams.get_mut(i) {
        Some(ar) => {
            let stream_seed = splitmix64(seed ^ splitmix64(!(s as u64)));
            let st = ar.run_in(comm, call, Some(acc), reduced, stream_seed)?;
            stats.bytes_sent += st.bytes_sent;
            stats.messages += st.messages;
        }
        None => reduced.copy_from_slice(acc),
    }
    Ok(())
}

const WRITE: u8 = crate::kernels::mode::WRITE;
const ADD: u8 = crate::kernels::mode::ADD;
