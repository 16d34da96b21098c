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
//! Every rank ends with the same bits: each shard's value comes from the all-reduce
//! between nodes (the same on every owner) and reaches the rest of its node as the same
//! frame. Nodes may differ in size. With operation `Mean` the sum is divided by the world
//! size at the end. All messages of a run belong to one call of the [`Comm`], with the
//! tag of the options; section 6.8 of the crate's wire-format document specifies them.

use core::ops::Range;

use super::comm::{Phase, Place};
use super::{
    AllReduce, AllReduceOptions, Comm, ENVELOPE_LEN, ReduceOp, Stats, Strategy, Transport,
    chunk_range, peer_error,
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

/// One stream between nodes: the shard it reduces and its all-reduce.
#[derive(Debug, Clone)]
struct Stream {
    shard: usize,
    ar: AllReduce,
}

/// The state of a two-level all-reduce of one tensor on one rank (see the module docs).
#[derive(Debug, Clone)]
pub struct Hierarchical {
    nodes: Nodes,
    codec: CodecSpec,
    node_codec: CodecSpec,
    op: ReduceOp,
    tag: u32,
    checksum: bool,
    len: usize,
    rank: usize,
    /// This rank's node, its members and this rank's place among them.
    node: usize,
    local: usize,
    /// The shards this rank owns, each with its stream between nodes (or `None` on a
    /// one-node world).
    owned: Vec<(usize, Option<Stream>)>,
    strategy: Strategy,
    /// Message buffers and the owned shards' sums.
    enc: Vec<u8>,
    msg: Vec<u8>,
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
        let pieces = opts.pieces.max(1);
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
        let mut owned = Vec::new();
        let mut strategy = Strategy::Fp32Ring;
        for s in (local..shards).step_by(l) {
            let stream = if n_nodes > 1 {
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
                Some(Stream { shard: s, ar })
            } else {
                None
            };
            owned.push((s, stream));
        }
        if n_nodes > 1 && owned.is_empty() {
            // Every rank owns at least shard `local` (< L <= S), so this cannot happen.
            return Err(Error::Collective("a rank owns no shard".into()));
        }
        let max_shard = chunk_range(len, shards, 0).len();
        let frame = wire::sealed_len(node_codec.max_encoded_len(max_shard));
        Ok(Hierarchical {
            nodes,
            codec,
            node_codec,
            op: opts.op,
            tag: opts.tag,
            checksum: opts.checksum,
            len,
            rank,
            node,
            local,
            owned,
            strategy: if n_nodes > 1 {
                strategy
            } else {
                Strategy::Fp32Ring
            },
            enc: crate::alloc::filled(
                frame.saturating_add(ENVELOPE_LEN),
                0,
                "the node phase's encode buffer",
            )?,
            msg: Vec::new(),
            acc: crate::alloc::filled(max_shard, 0.0, "a shard's sum")?,
            reduced: crate::alloc::filled(max_shard, 0.0, "a shard's sum")?,
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
        self.node_codec
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
        self.owned
            .iter_mut()
            .filter_map(|(_, s)| s.as_mut())
            .for_each(|s| s.ar.reset_feedback());
    }

    /// The streams' residuals as one saved blob per owned shard (see
    /// [`AllReduce::save`]).
    pub fn save(&self) -> Vec<Vec<u8>> {
        self.owned
            .iter()
            .filter_map(|(_, s)| s.as_ref().map(|s| s.ar.save()))
            .collect()
    }

    /// Restore blobs of [`Hierarchical::save`] (all or nothing).
    pub fn restore(&mut self, blobs: &[Vec<u8>]) -> Result<()> {
        let mut copy = self.owned.clone();
        let streams: Vec<&mut Stream> = copy.iter_mut().filter_map(|(_, s)| s.as_mut()).collect();
        if streams.len() != blobs.len() {
            return Err(Error::Checkpoint(format!(
                "hierarchical all-reduce: {} saved streams, this rank has {}",
                blobs.len(),
                streams.len()
            )));
        }
        for (s, b) in streams.into_iter().zip(blobs) {
            s.ar.restore(b)?;
        }
        self.owned = copy;
        Ok(())
    }

    fn shard(&self, s: usize) -> Range<usize> {
        chunk_range(self.len, self.nodes.max_node(), s)
    }

    fn place(&self, call: u64, phase: Phase, hop: usize, chunk: usize) -> Place {
        Place {
            call,
            tag: self.tag,
            phase,
            hop: hop as u32,
            chunk: chunk as u32,
        }
    }

    /// Encode `x` (shard starting at `offset`) with the node codec after the envelope's
    /// room; the message length.
    fn encode(&mut self, x: &[f32], offset: usize) -> Result<usize> {
        let frame = &mut self.enc[ENVELOPE_LEN..];
        let ctx = EncodeCtx::new(0).with_offset(offset as u64);
        let len = self.node_codec.encode_into(x, &ctx, frame)?;
        let len = if self.checksum {
            wire::seal(frame, len)?
        } else {
            len
        };
        Ok(ENVELOPE_LEN + len)
    }

    /// Check a frame received from `from` in `phase` for shard `s` and decode it (`M`:
    /// write or add) into `out`.
    fn take<const M: u8>(
        &self,
        from: usize,
        phase: Phase,
        s: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let frame = &self.msg[ENVELOPE_LEN..];
        let ctx = EncodeCtx::new(0).with_offset(self.shard(s).start as u64);
        let bad = |e| peer_error(from, phase, from, e);
        let split = super::check_origin(&self.node_codec, frame, &ctx).map_err(bad)?;
        super::decode_checked::<M>(split, out).map_err(bad)
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
        let _fp = crate::kernels::Standard::new();
        let call = comm.begin();
        for (what, got) in [
            ("input and all-reduce length", input.len()),
            ("output and all-reduce length", output.len()),
        ] {
            if got != self.len {
                return Err(Error::LengthMismatch {
                    what,
                    left: got,
                    right: self.len,
                });
            }
        }
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
        let members = self.nodes.members(self.node).to_vec();
        let l = members.len();
        let shards = self.nodes.max_node();
        // Hops per (sender, receiver) pair inside the node: the reduce-scatter's k-th
        // shard owned by the receiver is hop k; the all-gather's k-th shard owned by the
        // sender follows the shards the receiver owns.
        let owned_by = |lr: usize| (lr..shards).step_by(l).count();
        let k_of = |s: usize| s / l;
        // 1. Reduce-scatter inside the node.
        for s in 0..shards {
            let o = s % l;
            if o == self.local {
                continue;
            }
            let range = self.shard(s);
            let len = self.encode(&input[range.clone()], range.start)?;
            let place = self.place(call, Phase::NodeReduceScatter, k_of(s), s);
            comm.post(&mut self.enc[..len], members[o], place)?;
            stats.bytes_sent += len as u64;
            stats.messages += 1;
        }
        for i in 0..self.owned.len() {
            let s = self.owned[i].0;
            let range = self.shard(s);
            let n = range.len();
            let mut acc = core::mem::take(&mut self.acc);
            // In local-rank order: the first contribution written, the others added.
            for (lr, &from) in members.iter().enumerate() {
                let dst = &mut acc[..n];
                if lr == self.local {
                    if lr == 0 {
                        dst.copy_from_slice(&input[range.clone()]);
                    } else {
                        dst.iter_mut()
                            .zip(&input[range.clone()])
                            .for_each(|(a, &x)| *a += x);
                    }
                    continue;
                }
                let want = self.place(call, Phase::NodeReduceScatter, k_of(s), s);
                let res = comm.expect(&mut self.msg, from, want).and_then(|_| {
                    if lr == 0 {
                        self.take::<WRITE>(from, Phase::NodeReduceScatter, s, dst)
                    } else {
                        self.take::<ADD>(from, Phase::NodeReduceScatter, s, dst)
                    }
                });
                if let Err(e) = res {
                    self.acc = acc;
                    return Err(e);
                }
            }
            // 2. Between nodes (a world of one node: the node's sum is the result).
            let mut reduced = core::mem::take(&mut self.reduced);
            let res = match &mut self.owned[i].1 {
                Some(stream) => {
                    let stream_seed = splitmix64(seed ^ splitmix64(!(stream.shard as u64)));
                    stream
                        .ar
                        .run_in(comm, call, &acc[..n], &mut reduced[..n], stream_seed)
                        .map(|st| {
                            stats.bytes_sent += st.bytes_sent;
                            stats.messages += st.messages;
                        })
                }
                None => {
                    reduced[..n].copy_from_slice(&acc[..n]);
                    Ok(())
                }
            };
            self.acc = acc;
            if let Err(e) = res {
                self.reduced = reduced;
                return Err(e);
            }
            // 3. This shard to the node's other ranks, and as they decode it, here.
            let len = self.encode(&reduced[..n], range.start);
            self.reduced = reduced;
            let len = len?;
            for (lr, &to) in members.iter().enumerate() {
                if lr == self.local {
                    continue;
                }
                let hop = owned_by(lr) + k_of(s);
                let place = self.place(call, Phase::NodeAllGather, hop, s);
                comm.post(&mut self.enc[..len], to, place)?;
                stats.bytes_sent += len as u64;
                stats.messages += 1;
            }
            let split = wire::split_with(&self.enc[ENVELOPE_LEN..len], false)?;
            super::decode_checked::<WRITE>(split, &mut output[range])?;
        }
        // The shards the other ranks of the node own.
        for s in 0..shards {
            let o = s % l;
            if o == self.local {
                continue;
            }
            let hop = owned_by(self.local) + k_of(s);
            let want = self.place(call, Phase::NodeAllGather, hop, s);
            comm.expect(&mut self.msg, members[o], want)?;
            let range = self.shard(s);
            self.take::<WRITE>(members[o], Phase::NodeAllGather, s, &mut output[range])?;
        }
        if self.op == ReduceOp::Mean && self.nodes.world() > 1 {
            let p = self.nodes.world() as f32;
            output.iter_mut().for_each(|x| *x /= p);
        }
        Ok(stats)
    }
}

const WRITE: u8 = crate::kernels::mode::WRITE;
const ADD: u8 = crate::kernels::mode::ADD;
