//! Compressed collectives: all-reduce an f32 tensor across ranks with any codec, over any
//! [`Transport`].
//!
//! A [`Transport`] is the smallest surface an engine must offer: its rank, the world
//! size, and a combined send-to-one / receive-from-another of byte buffers. It knows
//! nothing about codecs. [`local::Local`] runs a world of threads in one process (tests,
//! simulation, benchmarks); `mpi::MpiTransport` (feature `mpi`) runs on MPI;
//! [`SharedMemory`] joins the ranks of one host through shared-memory rings, and
//! [`Routed`] sends another transport's messages between ranks of one host that way;
//! [`Tcp`] joins ranks on any hosts over TCP.
//!
//! [`AllReduce`] holds one tensor's collective state (strategy, error-feedback residuals,
//! buffers) and runs a step with [`AllReduce::run`]. The strategies:
//!
//! - [`Strategy::CompressedRing`]: a reduce-scatter whose `p - 1` hops each decode_add the
//!   incoming frame into the local chunk and re-encode the partial sum, then an all-gather
//!   that forwards each owner's final frame unchanged; every rank decodes each chunk once.
//!   Each rank sends `2 (p - 1) / p` of a whole frame. For the fixed-rate codecs a hop is
//!   fused: tile by tile, the incoming frame is decoded onto the local values and the sum
//!   re-encoded (through the residual, with error feedback) while it is in cache, so no
//!   partial sum is written to memory; the owner's hop also decodes its final frame and
//!   divides it for the mean there. The bits are those of the separate steps. With one
//!   piece per chunk, each all-gather frame is decoded on the thread pool while the
//!   exchange that forwards it is in flight, off the ring's critical path.
//! - [`Strategy::CompressedAllGather`]: every rank's whole frame travels round the ring
//!   (`p - 1` frames sent per rank); each rank decodes and sums all `p` in rank order.
//!   What GRACE and DeepSpeed's 1-bit path do; one encode, no re-quantisation.
//! - [`Strategy::TwoShot`]: each rank encodes every other rank's chunk once and sends it
//!   straight to that rank, its owner; the owner adds the `p - 1` frames to its own input
//!   in rank order (one fused pass), encodes the sum once and sends it to every rank,
//!   which decodes it. The ring's bytes per rank in 2 steps instead of `2 (p - 1)`, and
//!   each element quantised twice whatever `p` is (its error does not grow with the
//!   world, where the ring's does). At 2 ranks it is the ring's arithmetic.
//! - [`Strategy::SignMajority`]: signSGD with majority vote (Bernstein et al. 2018),
//!   described at [`Strategy::SignMajority`] below.
//! - [`Strategy::Fp32Ring`]: the uncompressed baseline, a ring of identity frames (the
//!   codec and error feedback are not used).
//!
//! [`StrategyChoice::Auto`] picks the ring, the two-shot or the all-gather with the cost
//! model ([`crate::cost::best_strategy`]; not the two-shot for sparse codecs,
//! [`CodecSpec::sparse`]); majority vote changes what is computed, so it is only used when
//! forced.
//!
//! ## Semantics
//! - Every rank ends with bit-identical output: each value is decoded from the same frame
//!   bytes, and sums run in the same order on every rank (each backend decodes
//!   bit-identically, so this holds across CPUs too).
//! - The error against an exact f32 all-reduce is bounded by [`error_bound`], which
//!   composes the codec's own bound ([`CodecSpec::error_bound`]) over the re-encodings.
//! - Any length works, including zero and lengths shorter than or not divisible by the
//!   world size: chunk `c` of `n` elements is `[c q + min(c, m), ...)` with `n = p q + m`,
//!   and an empty chunk is a header-only frame.
//! - Random draws: the encode of a chunk uses the step's seed mixed with the encoding
//!   rank ([`rank_seed`]) and the chunk's global offset, so rounding noise is independent
//!   across ranks; random-k uses the step seed alone, so every rank keeps the same
//!   indices and the ring's partial sums stay k-sparse.
//! - All ranks must construct their [`AllReduce`] with the same codec, length and options,
//!   and call `run` with the same seed, in the same order.
//!
//! ## Error feedback
//! [`Feedback::Worker`] keeps a residual for what this rank encodes from its own data:
//! the whole tensor for the all-gather and majority strategies, in the ring the
//! `p - 1` chunks it sends in the reduce-scatter (its own gradient plus the partial sum it
//! received), and in the two-shot the `p - 1` chunks it sends to their owners. [`Feedback::WorkerAndOwner`] adds a residual at each chunk's owner for the
//! final re-quantisation before the all-gather (as DeepSpeed's 1-bit compressed all-reduce
//! does at its "server" chunks). With both, every encode of the ring is compensated, and
//! for `beta = gamma = 1`:
//! `sum over ranks of (input + old residual) = output + sum over ranks of new residual`
//! (to f32 rounding): nothing is lost, only delayed.
//!
//! ## Faults
//! Collectives run on a [`Comm`], which puts an envelope on every message (sender, call
//! number, tag, hop, chunk, phase; see [`comm`]), and every frame received is checked
//! against the rank that encoded it (its offset, its seed for this step and, when sealed,
//! its payload checksum) as it arrives, before it is forwarded or summed. So:
//! - A frame that does not decode, has the wrong codec, length, offset or seed, or a
//!   damaged envelope gives [`Error::Peer`] naming the rank whose frame it was (for a
//!   frame forwarded round the ring, its encoder, and the neighbour it came through in
//!   `forwarded_by`) and the phase.
//! - A peer that stops answering gives the transport's error ([`Error::Transport`]; the
//!   in-process and MPI transports have timeouts). Never a panic, never a hang.
//! - A message left over from a failed call is dropped when it turns up; one a peer sent
//!   for a later call (it gave up on this one) fails this call and is kept for its own.
//!   No frame is ever summed into another call's result.
//!
//! After a fault some ranks may return `Ok` (with the correct result) while others
//! return an error. **Recovery:** on an error, call [`AllReduce::reset_feedback`] (the
//! residuals may hold a partial update; the output is unspecified), then go on with the
//! next step on the same [`Comm`]. As long as every rank makes the same calls, ranks
//! need no message to agree again: the next call every rank completes gives every rank
//! the correct result. (Tested for a failed send or receive, a lost, corrupted or
//! duplicated message and a stall past the timeout, on every strategy.)
//!
//! The envelope's CRC-32C covers the frame behind it, so a frame damaged in transit, or
//! put behind another message's envelope, is an error naming its sender for every codec;
//! payload checksums ([`AllReduceOptions::checksum`], on by default) seal the frames
//! themselves as well.
//!
//! ## The protocol
//! The messages, their order, the arithmetic and the checks are specified in the crate's
//! wire-format document (section 6), completely enough for a second implementation to
//! take part; the repository's Python tests run one, written from that text, among
//! gradpack's own ranks.

pub mod bucket;
pub mod comm;
pub mod hier;
mod hold;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
mod probe;
pub mod shm;
pub mod tcp;

pub use bucket::{BucketGather, Part};
pub use comm::{Comm, ENVELOPE_LEN, ENVELOPE_VERSION, MAX_SETTINGS};
use comm::{Phase, Place};
pub use hier::{Hierarchical, Nodes};
pub use probe::{Link, measure_link, ring_link};
pub use shm::{NodeMemory, Routed, SharedMemory, SharedMemoryOptions};
pub use tcp::{Tcp, TcpOptions, draw_token, interface_address, named_interface};

use core::ops::Range;

use crate::alloc;
use crate::codec::{Codec, CodecId, CodecSpec, EncodeCtx};
use crate::codecs::fixed::HopAcc;
use crate::codecs::{self, Identity};
use crate::cost::{self, CodecProfile};
use crate::error::{Error, Result};
use crate::feedback::{ErrorFeedback, FeedbackOptions};
use crate::parallel;
use crate::state::{BlobReader, BlobWriter};
use crate::wire::{self, HEADER_LEN};

pub use crate::cost::Strategy;

const ALLREDUCE_MAGIC: [u8; 4] = *b"GPAR";

/// What a collective needs from a communication engine.
///
/// Ranks are `0..size()`. Messages between an ordered pair of ranks must arrive in the
/// order they were sent (MPI's non-overtaking rule). The collectives run on a [`Comm`]
/// built over a transport, which adds an envelope to every message (see [`comm`]).
pub trait Transport {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the world.
    fn size(&self) -> usize;

    /// Send `msg` to rank `to` without waiting for a matching receive to start (buffer
    /// it, or keep receiving what peers send while the send completes), so ranks that
    /// all send before they receive cannot deadlock. A failure names the peer
    /// ([`Error::Transport`]).
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()>;

    /// Receive the next message from rank `from` into `buf` (replacing its contents).
    /// A message longer than `max` bytes (the longest the collective expects) is an
    /// error naming the peer, found before any memory is taken for it where the
    /// transport learns a message's length ahead of its bytes, and the message is
    /// dropped. A peer that has left, or sends nothing within the transport's timeout if
    /// it has one, is an [`Error::Transport`] naming it.
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()>;

    /// Send `send` to rank `to` and receive the next message from rank `from` (of at
    /// most `max` bytes, as [`Transport::recv`]) into `recv`: [`Transport::send`] then
    /// [`Transport::recv`] unless the transport overlaps the two.
    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        self.send(send, to)?;
        self.recv(recv, from, max)
    }

    /// [`Transport::send_recv`] where the message from `from` is expected to be `len`
    /// bytes long: the collectives know the lengths of the fixed-rate codecs' messages
    /// before they arrive. A transport that sends each message's length ahead of it can
    /// then post the receive of the bytes at once rather than after the length has
    /// arrived (a round trip less per exchange); the bytes on the wire stay the same, so
    /// its peers need not do the same. A message of another length (at most `max`
    /// bytes) must be received whole or fail the call, never be misread. Default:
    /// [`Transport::send_recv`].
    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> Result<()> {
        let _ = len;
        self.send_recv(send, to, recv, from, max)
    }

    /// The stages in shared memory of this rank's host, if the transport has them
    /// ([`SharedMemory`] made with a stage): the two-level all-reduce then reduces inside
    /// a node through them instead of messages. Default: none.
    fn node_memory(&self) -> Option<NodeMemory> {
        None
    }

    /// Wait until every message this rank has sent has left it, for transports whose
    /// [`Transport::send`] returns before that ([`Tcp`] queues messages for a writing
    /// thread), so that a rank about to end its process (after a failed call, say) does
    /// not take its last messages with it. A peer that has stopped reading is an error
    /// after the transport's timeout. Default: nothing to wait for.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
}

impl<T: Transport + ?Sized> Transport for &mut T {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        (**self).send(msg, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        (**self).recv(buf, from, max)
    }
    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        (**self).send_recv(send, to, recv, from, max)
    }
    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> Result<()> {
        (**self).send_recv_len(send, to, recv, from, len, max)
    }
    fn node_memory(&self) -> Option<NodeMemory> {
        (**self).node_memory()
    }
    fn flush(&mut self) -> Result<()> {
        (**self).flush()
    }
}

/// One rank's transport shared by several collectives of that rank (each holds a clone):
/// one set of connections, for example one [`Tcp`], under every bucket's all-reduce.
/// Every call takes a lock for the one operation, so collectives that share a transport
/// must run one at a time, in the same order on every rank (give each its own tag), as
/// they must on one communicator. A type-erased `Shared<dyn Transport + Send>` comes from
/// an `Arc<Mutex<_>>` of any transport ([`From`]).
pub struct Shared<T: ?Sized>(std::sync::Arc<std::sync::Mutex<T>>);

impl<T> Shared<T> {
    /// `transport`, to be shared by cloning the result.
    pub fn new(transport: T) -> Shared<T> {
        Shared(std::sync::Arc::new(std::sync::Mutex::new(transport)))
    }
}

impl<T: ?Sized> From<std::sync::Arc<std::sync::Mutex<T>>> for Shared<T> {
    fn from(t: std::sync::Arc<std::sync::Mutex<T>>) -> Shared<T> {
        Shared(t)
    }
}

impl<T: ?Sized> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<T: ?Sized> core::fmt::Debug for Shared<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Shared(..)")
    }
}

impl<T: ?Sized> Shared<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, T> {
        // A panic mid-call leaves nothing a later call could misread: every transport
        // queues a message whole and fails a peer's later receives after a broken one.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: Transport + ?Sized> Transport for Shared<T> {
    fn rank(&self) -> usize {
        self.lock().rank()
    }
    fn size(&self) -> usize {
        self.lock().size()
    }
    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        self.lock().send(msg, to)
    }
    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.lock().recv(buf, from, max)
    }
    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        self.lock().send_recv(send, to, recv, from, max)
    }
    fn send_recv_len(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        len: usize,
        max: usize,
    ) -> Result<()> {
        self.lock().send_recv_len(send, to, recv, from, len, max)
    }
    fn node_memory(&self) -> Option<NodeMemory> {
        self.lock().node_memory()
    }
    fn flush(&mut self) -> Result<()> {
        self.lock().flush()
    }
}

/// A peer's message (or its announced length) of `len` bytes where at most `max` fit.
pub(crate) fn too_long(peer: usize, len: u64, max: usize) -> Error {
    Error::MessageTooLong { peer, len, max }
}

/// What the all-reduce computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReduceOp {
    /// The sum over ranks.
    #[default]
    Sum,
    /// The sum divided by the world size (after decoding, on every rank alike).
    Mean,
}

/// Where error feedback is applied (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Feedback {
    /// No residuals: each step's compression error is lost.
    #[default]
    None,
    /// A residual for everything this rank encodes from its own data.
    Worker,
    /// As `Worker`, plus a residual at each ring chunk's owner for its final encode.
    /// The same as `Worker` for the all-gather and majority strategies.
    WorkerAndOwner,
}

/// How the strategy is chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum StrategyChoice {
    /// The fastest of ring, two-shot and all-gather by the cost model
    /// ([`crate::cost::best_strategy`]) on links of this bandwidth and latency, with the
    /// codec's measured `profile` or, if `None`, its size alone (infinitely fast compute).
    Auto {
        /// Link bandwidth, bit/s.
        bandwidth_bit_s: f64,
        /// Per-message latency, seconds.
        latency_s: f64,
        /// The codec's measured speeds, if known.
        profile: Option<CodecProfile>,
    },
    /// This strategy.
    Forced(Strategy),
}

impl Default for StrategyChoice {
    /// Auto on 10 Gbit/s links with 10 us latency, by codec size alone.
    fn default() -> Self {
        StrategyChoice::Auto {
            bandwidth_bit_s: 10e9,
            latency_s: 10e-6,
            profile: None,
        }
    }
}

/// Options of an [`AllReduce`]. Every rank must use the same.
#[derive(Debug, Clone, PartialEq)]
pub struct AllReduceOptions {
    /// Sum or mean.
    pub op: ReduceOp,
    /// Strategy, or how to choose it.
    pub strategy: StrategyChoice,
    /// Where error feedback is applied.
    pub feedback: Feedback,
    /// The error-feedback weights and residual precision.
    pub feedback_options: FeedbackOptions,
    /// Seal every frame with a payload checksum ([`crate::wire::seal`], 4 bytes per
    /// message), so a payload corrupted in transit fails the step with
    /// [`Error::PayloadChecksum`] naming the rank that encoded it, instead of silently
    /// changing the sum. Default on. Headers and envelopes are always checksummed;
    /// without this, a payload corrupted on one link decodes to different values on the
    /// ranks downstream of it, so ranks can end the step with different outputs.
    pub checksum: bool,
    /// Which collective this is among those run on one [`Comm`] (a bucket index, say),
    /// recorded in every message's envelope: a message of another tag where this one's
    /// is expected is an error. Default 0.
    pub tag: u32,
    /// Ring strategies: split each chunk into this many pieces, each its own frame, and
    /// send piece `j + 1` before piece `j` is received, so that encoding and decoding
    /// overlap the link (a pipelined ring). Default 1. Frames (and so results) depend
    /// on it: every rank must use the same.
    pub pieces: usize,
}

impl Default for AllReduceOptions {
    /// Sum, strategy by the cost model, no error feedback, sealed frames, tag 0.
    fn default() -> Self {
        AllReduceOptions {
            op: ReduceOp::default(),
            strategy: StrategyChoice::default(),
            feedback: Feedback::default(),
            feedback_options: FeedbackOptions::default(),
            checksum: true,
            tag: 0,
            pieces: 1,
        }
    }
}

/// What one [`AllReduce::run`] did on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// The strategy run.
    pub strategy: Strategy,
    /// Bytes this rank sent (frames, headers included).
    pub bytes_sent: u64,
    /// Messages this rank sent.
    pub messages: u64,
}

/// The seed rank `rank` encodes with in a step seeded `seed`: `seed` itself for random-k
/// (all ranks keep the same indices), otherwise a hash of both (independent rounding
/// noise on each rank).
pub fn rank_seed(codec: &CodecSpec, seed: u64, rank: usize) -> u64 {
    if codec.id() == CodecId::RandK {
        seed
    } else {
        crate::rng::splitmix64(seed ^ crate::rng::splitmix64(rank as u64 + 1))
    }
}

/// The seed rank `rank` encodes a tensor with at step `step`: splitmix64 of `base`
/// mixed with the step's and the tensor's `key`'s own splitmix64, then [`rank_seed`].
/// What the PyTorch hook gives each parameter (its key a CRC-32 of its name), so that
/// every tensor and step draws its own stream whatever bucket it is in.
pub fn tensor_seed(codec: &CodecSpec, base: u64, step: u64, key: u64, rank: usize) -> u64 {
    let sm = crate::rng::splitmix64;
    rank_seed(codec, sm(base ^ sm(step) ^ sm(key)), rank)
}

/// The element range of chunk `c` when `n` elements are split into `p` chunks: sizes
/// differ by at most one, larger chunks first. There is no chunk `c >= p` (nor any when
/// `p = 0`): those get the empty range `n..n`.
pub fn chunk_range(n: usize, p: usize, c: usize) -> Range<usize> {
    if c >= p {
        return n..n;
    }
    let (q, m) = (n / p, n % p);
    let start = c * q + c.min(m);
    start..start + q + usize::from(c < m)
}

/// Piece `j` of `k` of ring chunk `c` (of `p`) of `n` elements.
fn piece_range(n: usize, p: usize, k: usize, c: usize, j: usize) -> Range<usize> {
    let chunk = chunk_range(n, p, c);
    let sub = chunk_range(chunk.len(), k, j);
    chunk.start + sub.start..chunk.start + sub.end
}

/// An upper bound on `|output[i] - exact[i]|` for an all-reduce (op `Sum`, no error
/// feedback) of `p` ranks by `strategy` with `codec`, where `sum_absmax` bounds the sum
/// over ranks of each rank's largest `|input|` in the element's chunk (or in the whole
/// tensor). `exact` is the exact real sum; the bound includes f32 summation rounding.
///
/// - All-gather: each rank's frame is off by at most `E(a_r)` ([`CodecSpec::error_bound`]),
///   so the sum is off by at most `sum_r E(a_r) <= E(A)` for `A = sum_r a_r` (E is affine).
/// - Ring: the `p` encodes of a chunk (`p - 1` hops and the owner's) each see a partial sum
///   bounded by `A` plus the error so far, `M_h <= M_{h-1} + E(A + M_{h-1})`.
/// - Majority vote: the output is `±sum_r |d_r|`, within `sum_r (|d_r| + |x_r|)`, at most
///   `A + sum_r (a_r + E(a_r))` of the exact sum.
/// - Two-shot: the ranks' frames of a chunk, off by at most `E(A)` together, then the
///   owner's one encode of their sum, `E(A + E(A))`.
/// - Fp32 ring: f32 summation rounding only.
///
/// The ring's recursion is run once per rank; for worlds of more than 2^20 ranks it is
/// not run and the bound is `f64::INFINITY` (as it is once the recursion overflows).
pub fn error_bound(codec: &CodecSpec, strategy: Strategy, p: usize, sum_absmax: f64) -> f64 {
    let a = sum_absmax.abs();
    let pf = p.max(1) as f64;
    // f32 rounding of p - 1 additions of values bounded by A (plus the decoded errors).
    let rounding = |m: f64| pf * f64::from(f32::EPSILON) * (a + m);
    match strategy {
        Strategy::Fp32Ring => rounding(0.0),
        Strategy::CompressedAllGather => {
            let e = codec.error_bound(a);
            e + rounding(e)
        }
        Strategy::CompressedRing => {
            if p > 1 << 20 {
                return f64::INFINITY;
            }
            let mut m = 0.0;
            for _ in 0..p.max(1) {
                m += codec.error_bound(a + m) + f64::from(f32::EPSILON) * (a + m);
                if !m.is_finite() {
                    return f64::INFINITY;
                }
            }
            m + rounding(m)
        }
        Strategy::SignMajority => {
            let e = codec.error_bound(a);
            2.0 * a + e + rounding(a + e)
        }
        Strategy::TwoShot => {
            // Each rank's frame of the chunk (the owner's own input exact), then the
            // owner's encode of a sum bounded by A plus that error.
            let e = codec.error_bound(a);
            let m = e + codec.error_bound(a + e);
            m + rounding(m)
        }
    }
}

/// The state of one tensor's compressed all-reduce on one rank (see the module docs).
///
/// ```
/// use gradpack::collective::{AllReduce, AllReduceOptions, local};
///
/// let n = 1000;
/// // `local::run` hands each rank a `Comm` over its in-process transport; over MPI,
/// // `Comm::new(MpiTransport::new(&world))`.
/// let results = local::run(4, None, |mut t| {
///     let rank = gradpack::collective::Transport::rank(&t);
///     let grad: Vec<f32> = (0..n).map(|i| ((i + rank) as f32 * 0.1).sin()).collect();
///     let codec = "int8".parse::<gradpack::CodecSpec>()?;
///     let mut ar = AllReduce::new(codec, n, &t, AllReduceOptions::default())?;
///     let mut sum = vec![0.0f32; n];
///     ar.run(&mut t, &grad, &mut sum, 7)?;
///     Ok(sum)
/// });
/// let sums: Vec<Vec<f32>> = results.into_iter().collect::<Result<_, _>>()?;
/// assert!(sums.iter().all(|s| s == &sums[0])); // identical on every rank
/// # Ok::<(), gradpack::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct AllReduce {
    codec: CodecSpec,
    opts: AllReduceOptions,
    strategy: Strategy,
    len: usize,
    /// This rank's position in the ring, and the ring's size.
    rank: usize,
    size: usize,
    /// The global ranks of the ring's members in ring order (`None`: the whole world,
    /// position `q` being rank `q`): a group inside a larger world, as the hierarchical
    /// strategy's streams between nodes are.
    group: Option<Vec<usize>>,
    /// Added to every message's hop (streams of one call that share a pair of ranks keep
    /// their hops apart).
    hop_base: usize,
    /// What [`ReduceOp::Mean`] divides the sum by: the world size, unless fewer ranks
    /// contribute (the outer synchroniser's retry after a member left, where a healed
    /// member sends zeros).
    mean_over: usize,
    /// Ring: one residual per chunk this rank encodes (`None` for unfed ones).
    /// All-gather and majority: one for the whole tensor at index 0.
    residuals: Vec<Option<ErrorFeedback>>,
    /// The longest message this rank encodes (envelope included): the room an encode
    /// into a message buffer needs.
    room: usize,
    /// Ring pieces per chunk ([`AllReduceOptions::pieces`]).
    pieces: usize,
    /// The message buffer.
    a: Vec<u8>,
    /// Ring all-gather: the frames to forward at this hop and those received, per piece.
    fwd: Vec<Vec<u8>>,
    next: Vec<Vec<u8>>,
    /// All-gather and majority: every rank's frame.
    frames: Vec<Vec<u8>>,
    /// Majority: a decoded frame and the votes.
    decoded: Vec<f32>,
    votes: Vec<i32>,
}

impl AllReduce {
    /// The state for all-reducing tensors of `len` elements with `codec` on the world of
    /// `transport`. Errors if the options ask for something the codec cannot do (error
    /// feedback the codec refuses, see [`ErrorFeedback::with_options`]) or the transport's
    /// rank is outside its world.
    pub fn new<T: Transport + ?Sized>(
        codec: impl Into<CodecSpec>,
        len: usize,
        transport: &T,
        opts: AllReduceOptions,
    ) -> Result<AllReduce> {
        let (rank, size) = (transport.rank(), transport.size());
        if size == 0 || rank >= size {
            return Err(Error::Collective(format!(
                "transport reports rank {rank} in a world of {size}"
            )));
        }
        AllReduce::build(codec.into(), len, rank, size, None, opts)
    }

    /// The state for all-reducing among the ranks `members` (global ranks, in ring
    /// order) of a larger world, this rank being `me`; every message's hop is offset by
    /// `hop_base`. Run with [`AllReduce::run_in`] inside a call of the whole world.
    pub(crate) fn in_group(
        codec: CodecSpec,
        len: usize,
        members: &[usize],
        me: usize,
        hop_base: usize,
        opts: AllReduceOptions,
    ) -> Result<AllReduce> {
        let rank = members.iter().position(|&m| m == me).ok_or_else(|| {
            Error::Collective(format!(
                "rank {me} is not a member of the group {members:?}"
            ))
        })?;
        let mut ar = AllReduce::build(
            codec,
            len,
            rank,
            members.len(),
            Some(members.to_vec()),
            opts,
        )?;
        ar.hop_base = hop_base;
        Ok(ar)
    }

    fn build(
        codec: CodecSpec,
        len: usize,
        rank: usize,
        size: usize,
        group: Option<Vec<usize>>,
        opts: AllReduceOptions,
    ) -> Result<AllReduce> {
        if u32::try_from(size).is_err() {
            return Err(Error::Collective(format!(
                "a world of {size} ranks is more than message envelopes can number (2^32 - 1)"
            )));
        }
        let strategy = match &opts.strategy {
            StrategyChoice::Forced(s) => *s,
            StrategyChoice::Auto {
                bandwidth_bit_s,
                latency_s,
                profile,
            } => {
                let profile = profile.clone().unwrap_or_else(|| {
                    let n = len.max(1);
                    let bits = codec.bits_per_element(n) + (HEADER_LEN * 8) as f64 / n as f64;
                    CodecProfile::nominal(codec.to_string(), bits)
                });
                let cluster = cost::Cluster {
                    nodes: size as u32,
                    bandwidth_bit_s: *bandwidth_bit_s,
                    latency_s: *latency_s,
                };
                if rescales_on_reencode(&codec) {
                    Strategy::CompressedAllGather
                } else {
                    cost::best_strategy(&profile, &cluster, len as f64, f64::INFINITY).0
                }
            }
        };
        if matches!(strategy, Strategy::CompressedRing | Strategy::TwoShot)
            && rescales_on_reencode(&codec)
        {
            return Err(Error::Param {
                codec: codec.id(),
                name: "scale",
                reason: "random-k with scale=unbiased multiplies the kept values by 1/ratio \
                         at every encode, so the sums the ring and the two-shot re-encode \
                         would be scaled again; use scale=none, or the all-gather strategy"
                    .into(),
            });
        }
        let codec = codec_of(codec, strategy);
        let pieces = opts.pieces;
        if pieces == 0 || u32::try_from(size.saturating_mul(pieces).saturating_mul(2)).is_err() {
            return Err(Error::Collective(format!(
                "{pieces} pieces per chunk: need at least 1, and 2 x world size x pieces below 2^32"
            )));
        }
        let feedback = if strategy == Strategy::Fp32Ring {
            Feedback::None
        } else {
            opts.feedback
        };
        let ef = |n: usize| ErrorFeedback::with_options(codec, n, opts.feedback_options);
        let mut residuals = Vec::new();
        let mut max_frame = 0;
        match (strategy, feedback) {
            (Strategy::Fp32Ring | Strategy::CompressedRing | Strategy::TwoShot, _) => {
                for c in 0..size {
                    for j in 0..pieces {
                        let n = piece_range(len, size, pieces, c, j).len();
                        max_frame = max_frame.max(wire::sealed_len(codec.max_encoded_len(n)));
                        let fed = match feedback {
                            Feedback::None => false,
                            Feedback::Worker => c != rank,
                            Feedback::WorkerAndOwner => true,
                        };
                        residuals.push(if fed { Some(ef(n)?) } else { None });
                    }
                }
            }
            (_, fb) => {
                max_frame = wire::sealed_len(codec.max_encoded_len(len));
                if fb != Feedback::None {
                    residuals.push(Some(ef(len)?));
                }
            }
        }
        let gathers = matches!(
            strategy,
            Strategy::CompressedAllGather | Strategy::SignMajority
        );
        let majority = strategy == Strategy::SignMajority;
        // The buffer of this rank's first message (the ring's first piece, the gathers'
        // own frame), made here so that a length the memory cannot hold is refused now.
        let room = max_frame.saturating_add(ENVELOPE_LEN);
        let first = alloc::filled(room, 0, "the all-reduce's message buffer")?;
        let (fwd, frames) = if gathers {
            let mut frames = vec![Vec::new(); size];
            if let Some(own) = frames.get_mut(rank) {
                *own = first;
            }
            (Vec::new(), frames)
        } else if strategy == Strategy::TwoShot {
            // The message being sent, and one received from each peer.
            (vec![first], vec![Vec::new(); size])
        } else {
            (vec![first], Vec::new())
        };
        Ok(AllReduce {
            codec,
            opts,
            strategy,
            len,
            rank,
            size,
            group,
            hop_base: 0,
            mean_over: size,
            residuals,
            room,
            pieces,
            a: Vec::new(),
            fwd,
            next: Vec::new(),
            frames,
            decoded: alloc::filled(if majority { len } else { 0 }, 0.0, "decoded votes")?,
            votes: alloc::filled(if majority { len } else { 0 }, 0, "vote counts")?,
        })
    }

    /// The strategy in use (resolved if it was [`StrategyChoice::Auto`]).
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The codec frames are encoded with (identity for [`Strategy::Fp32Ring`]).
    pub fn codec(&self) -> CodecSpec {
        self.codec
    }

    /// The options.
    pub fn options(&self) -> &AllReduceOptions {
        &self.opts
    }

    /// Elements per tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero-length tensors.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Divide the sum by `n` ranks for [`ReduceOp::Mean`] from the next call on (the
    /// world size by default): the mean over the ranks that contribute, where the others
    /// send zeros. `n` must be in `1..=` the world size.
    pub(crate) fn set_mean_over(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > self.size {
            return Err(Error::Collective(format!(
                "a mean over {n} ranks in a world of {}",
                self.size
            )));
        }
        self.mean_over = n;
        Ok(())
    }

    /// Replace every residual with `r`'s elements at its place (the inverse of
    /// [`AllReduce::residual_f32`]; elements no residual covers are dropped): residuals
    /// carried to another world, whose ring cuts the tensor into other chunks.
    pub(crate) fn set_residual_f32(&mut self, r: &[f32]) -> Result<()> {
        if r.len() != self.len {
            return Err(Error::LengthMismatch {
                what: "residual and all-reduce elements",
                left: r.len(),
                right: self.len,
            });
        }
        for slot in 0..self.residuals.len() {
            let range = self.slot_range(slot);
            if let Some(fb) = &mut self.residuals[slot] {
                fb.set_residual(&r[range])?;
            }
        }
        Ok(())
    }

    /// Zero every residual.
    pub fn reset_feedback(&mut self) {
        self.residuals.iter_mut().flatten().for_each(|r| r.reset());
    }

    /// This rank's residuals as one tensor (zero where none is kept): chunk `c` of the
    /// ring's residuals at the chunk's elements.
    pub fn residual_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        for (slot, r) in self.residuals.iter().enumerate() {
            if let Some(r) = r {
                out[self.slot_range(slot)].copy_from_slice(&r.residual_f32());
            }
        }
        out
    }

    /// The elements residual `slot` covers: ring piece `slot` (chunk `slot / pieces`,
    /// piece `slot % pieces`) for the ring and two-shot strategies, the whole tensor
    /// for the others.
    fn slot_range(&self, slot: usize) -> Range<usize> {
        let ring = matches!(
            self.strategy,
            Strategy::CompressedRing | Strategy::Fp32Ring | Strategy::TwoShot
        );
        let k = self.pieces;
        if ring {
            piece_range(self.len, self.size, k, slot / k, slot % k)
        } else {
            0..self.len
        }
    }

    /// The residuals as a saved blob (see [`crate::state`]): codec, strategy, length,
    /// rank, world size and each residual's [`ErrorFeedback::save`].
    pub fn save(&self) -> Vec<u8> {
        let mut w = BlobWriter::new(ALLREDUCE_MAGIC);
        w.str(&self.codec.to_string())
            .str(self.strategy.name())
            .u64(self.len as u64)
            .u64(self.rank as u64)
            .u64(self.size as u64)
            .u64(self.pieces as u64)
            .u64(self.residuals.len() as u64);
        for r in &self.residuals {
            match r {
                Some(ef) => w.u8(1).bytes(&ef.save()),
                None => w.u8(0),
            };
        }
        w.finish()
    }

    /// Restore residuals saved by [`AllReduce::save`] on the same rank of an all-reduce
    /// built the same way; the next step then continues bit-identically. A blob that is
    /// corrupt or from another codec, strategy, length, rank or world is refused with
    /// [`Error::Checkpoint`], and the state is unchanged.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, ALLREDUCE_MAGIC, "all-reduce")?;
        r.str_eq("codec", &self.codec.to_string())?;
        r.str_eq("strategy", self.strategy.name())?;
        r.u64_eq("length", self.len as u64)?;
        r.u64_eq("rank", self.rank as u64)?;
        r.u64_eq("world size", self.size as u64)?;
        r.u64_eq("ring pieces", self.pieces as u64)?;
        r.u64_eq("residual count", self.residuals.len() as u64)?;
        let mut restored = self.residuals.clone();
        for slot in &mut restored {
            r.u8_eq("residual presence", u8::from(slot.is_some()))?;
            if let Some(ef) = slot {
                ef.restore(r.bytes()?)?;
            }
        }
        r.end()?;
        self.residuals = restored;
        Ok(())
    }

    /// Bytes of state held: residuals and buffers.
    pub fn memory_bytes(&self) -> usize {
        let ef: usize = self
            .residuals
            .iter()
            .flatten()
            .map(|r| r.memory_bytes())
            .sum();
        ef + self.a.capacity()
            + self
                .fwd
                .iter()
                .chain(&self.next)
                .map(Vec::capacity)
                .sum::<usize>()
            + self.frames.iter().map(Vec::capacity).sum::<usize>()
            + 4 * (self.decoded.capacity() + self.votes.capacity())
    }

    /// One all-reduce: `output` gets the reduction over all ranks of their `input`
    /// (both of [`AllReduce::len`] elements; `input` is not modified). `seed` seeds the
    /// step's random draws and must be the same on every rank (change it every step).
    ///
    /// Every call takes the next call number of `comm`, even one that fails at once on
    /// a bad argument, so ranks stay in step as long as each makes the same calls.
    pub fn run<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: &[f32],
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        let call = comm.begin();
        self.run_in(comm, call, Some(input), output, seed)
    }

    /// [`AllReduce::run`] in place: `data` is this rank's input and gets the reduction.
    /// The same messages and the same bits as `run` with a copy of `data` as input, with
    /// neither that copy nor the ring's copies of the input into the output.
    pub fn run_in_place<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        data: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        let call = comm.begin();
        self.run_in(comm, call, None, data, seed)
    }

    /// The global rank at ring position `q`.
    fn global(&self, q: usize) -> usize {
        self.group.as_ref().map_or(q, |g| g[q])
    }

    /// [`AllReduce::run`] as part of call `call` (taken by the caller); `input` None: in
    /// place, `output` holding the input.
    pub(crate) fn run_in<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        call: u64,
        input: Option<&[f32]>,
        output: &mut [f32],
        seed: u64,
    ) -> Result<Stats> {
        let _fp = crate::kernels::Standard::new();
        check_lens(input.unwrap_or(output), output, self.len)?;
        let fits = match &self.group {
            None => comm.size() == self.size,
            Some(g) => g.iter().all(|&m| m < comm.size()),
        };
        if comm.rank() != self.global(self.rank) || !fits {
            return Err(Error::Collective(format!(
                "transport is rank {} of {}, but this all-reduce was built for rank {} of {}",
                comm.rank(),
                comm.size(),
                self.global(self.rank),
                self.group
                    .as_ref()
                    .map_or(self.size, |g| g.iter().max().map_or(0, |m| m + 1))
            )));
        }
        let mut step = Step {
            call,
            seed,
            stats: Stats {
                strategy: self.strategy,
                bytes_sent: 0,
                messages: 0,
            },
        };
        match self.strategy {
            // The ring divides each chunk for the mean as it writes it.
            Strategy::Fp32Ring | Strategy::CompressedRing => {
                self.ring(comm, input, output, &mut step)?
            }
            Strategy::CompressedAllGather => {
                self.gather(comm, input.unwrap_or(output), &mut step)?;
                self.sum_frames(output)?;
                self.mean(output);
            }
            Strategy::SignMajority => {
                self.gather(comm, input.unwrap_or(output), &mut step)?;
                self.vote(output)?;
                self.mean(output);
            }
            // Like the ring, it divides each owner's sum for the mean as it decodes it.
            Strategy::TwoShot => self.two_shot(comm, input, output, &mut step)?,
        }
        Ok(step.stats)
    }

    /// Divide `x` by the world size for [`ReduceOp::Mean`].
    fn mean(&self, x: &mut [f32]) {
        mean(self.opts.op, self.mean_over, x);
    }

    /// Encode `x` (slot `slot`'s data) as the message held `at` (lengthened to the room
    /// an encode needs, then cut to the message), through the slot's residual if it has
    /// one, sealed if the options say so.
    fn encode_msg(&mut self, slot: usize, x: &[f32], ctx: EncodeCtx, at: Held) -> Result<()> {
        let buf = match at {
            Held::Fwd(j) => &mut self.fwd[j],
            Held::Frame(q) => &mut self.frames[q],
        };
        let fb = self.residuals.get_mut(slot).and_then(Option::as_mut);
        let len = encode_fed(
            fb,
            &self.codec,
            self.opts.checksum,
            x,
            ctx,
            grow(buf, self.room)?,
        )?;
        buf.truncate(len);
        Ok(())
    }

    /// The place of a message of this collective.
    fn place(&self, call: u64, phase: Phase, hop: usize, chunk: usize) -> Place {
        Place {
            call,
            tag: self.opts.tag,
            phase,
            // World sizes fit in u32 (checked by `new`), and so do hop counts 2 (p - 1);
            // hierarchical streams' bases are checked when they are made.
            hop: (self.hop_base + hop) as u32,
            chunk: chunk as u32,
            // Every rank's longest message is this rank's (the same codec, length and
            // pieces).
            max: self.room,
        }
    }

    /// The ring: reduce-scatter, then all-gather of the owners' frames; `input` None: in
    /// place. With fused hops (the fixed-rate codecs) each chunk of the output is written
    /// once, by its last decode, and divided for the mean there while it is in cache; the
    /// others write a received chunk's partial sum into it first.
    fn ring<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: Option<&[f32]>,
        output: &mut [f32],
        step: &mut Step,
    ) -> Result<()> {
        let (n, p, r, k) = (self.len, self.size, self.rank, self.pieces);
        let (right, left) = ((r + 1) % p, (r + p - 1) % p);
        let (right_g, left_g) = (self.global(right), self.global(left));
        let piece = |c: usize, j: usize| piece_range(n, p, k, c, j);
        let (codec, seed, call, op) = (self.codec, step.seed, step.call, self.opts.op);
        // The divisor of the mean (the world size but in a retry with fewer contributors).
        let d = self.mean_over;
        let ctx_of = |q: usize, c: usize, j: usize| {
            EncodeCtx::new(rank_seed(&codec, seed, q)).with_offset(piece(c, j).start as u64)
        };
        // Reduce-scatter: at step s send chunk r-s-1 and receive chunk r-s-2, so rank r
        // ends owning chunk r. The chunk sent at step s > 0 is the one received at s - 1.
        // Each chunk goes as k pieces; piece j + 1 is encoded and sent before piece j is
        // received, so encoding overlaps the link. With one piece, a step's send and
        // receive go to the transport together (`Transport::send_recv`): some transports
        // move both directions at once only when the receive is posted first (gloo's
        // point-to-point, where two ranks' ring sends and receives share one pair).
        let together = k == 1;
        // The length of a message of `n` elements where the codec fixes it (the same
        // codec and pieces on every rank, so the peer's message has it too).
        let checksum = self.opts.checksum;
        let expect_len =
            |n: usize| codecs::fixed_frame_len(&codec, n, checksum).map(|l| ENVELOPE_LEN + l);
        // Every hop's frames, per piece: step 0 sends the local input, encoded as it is
        // sent; each later step sends the frames made as the step before received its
        // pieces (sum and re-encode, fused tile by tile where the codec allows, see
        // `hop`). The last step's hop makes the owner's frames, which the all-gather
        // forwards.
        self.fwd.resize_with(k, Vec::new);
        self.next.resize_with(k, Vec::new);
        let room = self.room;
        for s in 0..p - 1 {
            let send_c = (r + 2 * p - s - 1) % p;
            let recv_c = (r + 2 * p - s - 2) % p;
            let phase = Phase::ReduceScatter;
            let want = |this: &Self, j: usize| this.place(call, phase, s * k + j, recv_c * k + j);
            let mut post = |this: &mut Self, out: &[f32], comm: &mut Comm<T>, j: usize| {
                if s == 0 {
                    // In place, chunk send_c still holds the input (no chunk has been
                    // received yet).
                    let local = &input.unwrap_or(out)[piece(send_c, j)];
                    let ctx = ctx_of(r, send_c, j);
                    this.encode_msg(send_c * k + j, local, ctx, Held::Fwd(j))?;
                }
                let to = this.place(call, phase, s * k + j, send_c * k + j);
                if together {
                    let (w, len) = (want(this, j), expect_len(piece(recv_c, j).len()));
                    comm.exchange(&mut this.fwd[j], right_g, to, &mut this.a, left_g, w, len)?;
                } else {
                    comm.post(&mut this.fwd[j], right_g, to)?;
                }
                step.sent(this.fwd[j].len());
                Ok::<(), Error>(())
            };
            post(self, output, comm, 0)?;
            for j in 0..k {
                if j + 1 < k {
                    post(self, output, comm, j + 1)?;
                }
                if !together {
                    let w = want(self, j);
                    comm.expect(&mut self.a, left_g, w)?;
                }
                // Piece j was sent above: its buffer takes the next hop's frame.
                let hop = Hop {
                    codec: &codec,
                    checksum: self.opts.checksum,
                    op: self.opts.op,
                    size: d,
                    own: s == p - 2,
                    piece: piece(recv_c, j),
                    ctx: ctx_of(r, recv_c, j),
                    origin: ctx_of(left, recv_c, j),
                };
                let fb = self
                    .residuals
                    .get_mut(recv_c * k + j)
                    .and_then(Option::as_mut);
                let msg = grow(&mut self.fwd[j], room)?;
                let bad = |e| peer_error(left_g, phase, left_g, e);
                let len = hop.run(&self.a[ENVELOPE_LEN..], input, output, fb, msg, bad)?;
                self.fwd[j].truncate(len);
            }
        }
        if p == 1 {
            // A world of one: the owner's frame of the input, decoded here as everywhere.
            for j in 0..k {
                let own = piece(r, j);
                let src = &input.unwrap_or(&*output)[own.clone()];
                self.encode_msg(r * k + j, src, ctx_of(r, r, j), Held::Fwd(j))?;
                let split = wire::split_with(&self.fwd[j][ENVELOPE_LEN..], false)?;
                decode_checked::<WRITE>(split, &mut output[own])?;
            }
        }
        // All-gather: forward frames unchanged; at step s send chunk r-s, receive r-s-1.
        // With one piece, each frame received is decoded while the next step's exchange
        // (which forwards it) is in flight, so decodes are off the ring's critical path;
        // `held` is the chunk whose frame `fwd[0]` holds undecoded.
        let mut held: Option<usize> = None;
        for s in 0..p - 1 {
            let send_c = (r + p - s) % p;
            let recv_c = (r + 2 * p - s - 1) % p;
            let phase = Phase::RingAllGather;
            let hop = |j: usize| (p - 1 + s) * k + j;
            let want = |this: &Self, j: usize| this.place(call, phase, hop(j), recv_c * k + j);
            // Chunk c's final frames were encoded by its owner, rank c.
            let origin = |j: usize| ctx_of(recv_c, recv_c, j);
            if together {
                let (to, w) = (self.place(call, phase, hop(0), send_c), want(self, 0));
                let len = expect_len(piece(recv_c, 0).len());
                comm.stamp(&mut self.fwd[0], to)?;
                let (fwd, next) = (&self.fwd[0], &mut self.next[0]);
                let out = held.map(|c| (c, &mut output[piece(c, 0)]));
                // A short decode is not worth handing to another thread.
                let par = out.as_ref().is_some_and(|o| o.1.len() >= parallel::CHUNK);
                let (decoded, exchanged) = parallel::alongside(
                    par,
                    move || match out {
                        Some((c, out)) => decode_final(fwd, out, op, d).map_err(|e| (c, e)),
                        None => Ok(()),
                    },
                    || comm.exchange_stamped(fwd, right_g, next, left_g, w, len),
                );
                exchanged?;
                decoded.map_err(|(c, e)| peer_error(self.global(c), phase, left_g, e))?;
                step.sent(self.fwd[0].len());
                let bad = |e| peer_error(self.global(recv_c), phase, left_g, e);
                check_origin(&codec, &self.next[0][ENVELOPE_LEN..], &origin(0)).map_err(bad)?;
                held = Some(recv_c);
                core::mem::swap(&mut self.fwd, &mut self.next);
                continue;
            }
            let mut post = |this: &mut Self, comm: &mut Comm<T>, j: usize| {
                let to = this.place(call, phase, hop(j), send_c * k + j);
                comm.post(&mut this.fwd[j], right_g, to)?;
                step.sent(this.fwd[j].len());
                Ok::<(), Error>(())
            };
            post(self, comm, 0)?;
            for j in 0..k {
                if j + 1 < k {
                    post(self, comm, j + 1)?;
                }
                let w = want(self, j);
                comm.expect(&mut self.next[j], left_g, w)?;
                let frame = &self.next[j][ENVELOPE_LEN..];
                let bad = |e| peer_error(self.global(recv_c), phase, left_g, e);
                let (h, payload) = check_origin(&codec, frame, &origin(j)).map_err(bad)?;
                let out = &mut output[piece(recv_c, j)];
                codecs::decode_split_then(&h, payload, out, &|x| mean(op, d, x)).map_err(bad)?;
            }
            core::mem::swap(&mut self.fwd, &mut self.next);
        }
        if let Some(c) = held {
            decode_final(&self.fwd[0], &mut output[piece(c, 0)], op, d)
                .map_err(|e| peer_error(self.global(c), Phase::RingAllGather, left_g, e))?;
        }
        Ok(())
    }

    /// The two-shot all-reduce (wire-format section 6.3): every piece of every other
    /// rank's chunk encoded from the input and sent to that rank, its owner (shot 1);
    /// then per piece of this rank's chunk, its input plus the peers' frames of it
    /// decoded and added in rank order (one fused pass), that sum encoded once (the
    /// owner's residual) and sent to every peer (shot 2), and its decode written to the
    /// output; last, every peer's sums decoded into their places. `input` None: in
    /// place (the chunks of the peers still hold the input until shot 2 overwrites them,
    /// after every shot-1 encode).
    fn two_shot<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: Option<&[f32]>,
        output: &mut [f32],
        step: &mut Step,
    ) -> Result<()> {
        let (n, p, r, k) = (self.len, self.size, self.rank, self.pieces);
        let piece = |c: usize, j: usize| piece_range(n, p, k, c, j);
        let (codec, seed, call, op) = (self.codec, step.seed, step.call, self.opts.op);
        // The divisor of the mean (the world size but in a retry with fewer contributors).
        let d = self.mean_over;
        let ctx_of = |q: usize, c: usize, j: usize| {
            EncodeCtx::new(rank_seed(&codec, seed, q)).with_offset(piece(c, j).start as u64)
        };
        let (scatter, gather) = (Phase::TwoShotScatter, Phase::TwoShotGather);
        let peers = || (0..p).filter(move |&q| q != r);
        // Shot 1: piece j of chunk c to rank c, in the order j, then c = r + 1, r + 2, ..
        for j in 0..k {
            for s in 1..p {
                let c = (r + s) % p;
                let local = &input.unwrap_or(&*output)[piece(c, j)];
                self.encode_msg(c * k + j, local, ctx_of(r, c, j), Held::Fwd(0))?;
                let (to, place) = (self.global(c), self.place(call, scatter, j, c * k + j));
                comm.post(&mut self.fwd[0], to, place)?;
                step.sent(self.fwd[0].len());
            }
        }
        for j in 0..k {
            let mine = piece(r, j);
            for q in peers() {
                let (from, w) = (self.global(q), self.place(call, scatter, j, r * k + j));
                comm.expect(&mut self.frames[q], from, w)?;
                check_origin(&codec, &self.frames[q][ENVELOPE_LEN..], &ctx_of(q, r, j))
                    .map_err(|e| peer_error(from, scatter, from, e))?;
            }
            let acc = &mut output[mine];
            if let Some(x) = input {
                acc.copy_from_slice(&x[piece(r, j)]);
            }
            let mut split = crate::codecs::reduce::frame_list(p - 1)?;
            for q in peers() {
                // Checked as it arrived, and not changed since.
                let frame = &self.frames[q][ENVELOPE_LEN..];
                let got = wire::split_with(frame, false);
                split
                    .push(got.map_err(|e| peer_error(self.global(q), scatter, self.global(q), e))?);
            }
            crate::codecs::reduce::reduce_split::<ADD>(&split, acc).map_err(|(i, e)| {
                let q = self.global(if i < r { i } else { i + 1 });
                peer_error(q, scatter, q, e)
            })?;
            // Shot 2: the owner's frame of the sum to every peer, then decoded here too.
            self.encode_msg(r * k + j, acc, ctx_of(r, r, j), Held::Fwd(0))?;
            for s in 1..p {
                let (to, place) = (
                    self.global((r + s) % p),
                    self.place(call, gather, k + j, r * k + j),
                );
                comm.post(&mut self.fwd[0], to, place)?;
                step.sent(self.fwd[0].len());
            }
            decode_final(&self.fwd[0], acc, op, d)?;
        }
        for j in 0..k {
            for q in peers() {
                let (from, w) = (self.global(q), self.place(call, gather, k + j, q * k + j));
                comm.expect(&mut self.frames[q], from, w)?;
                let bad = |e| peer_error(from, gather, from, e);
                let frame = &self.frames[q][ENVELOPE_LEN..];
                let (h, payload) = check_origin(&codec, frame, &ctx_of(q, q, j)).map_err(bad)?;
                let out = &mut output[piece(q, j)];
                codecs::decode_split_then(&h, payload, out, &|x| mean(op, d, x)).map_err(bad)?;
            }
        }
        Ok(())
    }

    /// Encode the whole input and ring-all-gather every rank's frame into `self.frames`
    /// (messages forwarded unchanged but for their envelope; each is checked against
    /// the rank that encoded it as it arrives, and decoded later).
    fn gather<T: Transport + ?Sized>(
        &mut self,
        comm: &mut Comm<T>,
        input: &[f32],
        step: &mut Step,
    ) -> Result<()> {
        let r = self.rank;
        let (codec, seed) = (self.codec, step.seed);
        let ctx_of = |q: usize| EncodeCtx::new(rank_seed(&codec, seed, q));
        self.encode_msg(0, input, ctx_of(r), Held::Frame(r))?;
        let mut frames = core::mem::take(&mut self.frames);
        let call = step.call;
        let res = ring_gather(
            comm,
            &mut frames,
            r,
            |q| self.global(q),
            |s, q| self.place(call, Phase::FrameAllGather, s, q),
            &mut step.stats,
            |q, frame| check_origin(&codec, frame, &ctx_of(q)).map(drop),
        );
        self.frames = frames;
        res
    }

    /// The error for rank `q`'s gathered frame failing to decode with `e`.
    fn blame(&self, q: usize, e: Error) -> Error {
        let left = (self.rank + self.size - 1) % self.size;
        peer_error(self.global(q), Phase::FrameAllGather, self.global(left), e)
    }

    /// `output = sum of every rank's decoded frame`, in rank order, in one fused pass
    /// ([`crate::reduce_frames`]).
    fn sum_frames(&mut self, output: &mut [f32]) -> Result<()> {
        let mut split = crate::codecs::reduce::frame_list(self.size)?;
        for q in 0..self.size {
            // Checked by `gather` as it arrived (this rank's own frame: as it was made), and
            // not changed since: the payload checksum need not be computed again.
            match wire::split_with(&self.frames[q][ENVELOPE_LEN..], false) {
                Ok(s) => split.push(s),
                Err(e) => return Err(self.blame(q, e)),
            }
        }
        crate::codecs::reduce::reduce_split::<WRITE>(&split, output)
            .map_err(|(q, e)| self.blame(q, e))
    }

    /// Majority vote over every rank's decoded frame (see [`Strategy::SignMajority`]):
    /// `output[i] = sign(votes) * sum_r |d_r[i]|`, 0 on a tie, NaN if any `d_r[i]` is NaN.
    fn vote(&mut self, output: &mut [f32]) -> Result<()> {
        output.fill(0.0);
        self.votes.fill(0);
        for q in 0..self.size {
            // Checked by `gather` as it arrived (see `sum_frames`).
            let res = wire::split_with(&self.frames[q][ENVELOPE_LEN..], false)
                .and_then(|split| decode_checked::<WRITE>(split, &mut self.decoded));
            if let Err(e) = res {
                return Err(self.blame(q, e));
            }
            for ((v, m), &d) in self
                .votes
                .iter_mut()
                .zip(output.iter_mut())
                .zip(&self.decoded)
            {
                *v += i32::from(d > 0.0) - i32::from(d < 0.0);
                *m += d.abs();
            }
        }
        for (m, &v) in output.iter_mut().zip(&self.votes) {
            *m = match v.signum() {
                1 => *m,
                -1 => -*m,
                // A tie keeps a NaN visible (NaN * 0 = NaN) and is 0 otherwise.
                _ => *m * 0.0,
            };
        }
        Ok(())
    }
}

/// One call's bookkeeping.
struct Step {
    call: u64,
    seed: u64,
    stats: Stats,
}

impl Step {
    fn sent(&mut self, bytes: usize) {
        self.stats.sent(bytes);
    }
}

impl Stats {
    /// One more message of `bytes` sent.
    fn sent(&mut self, bytes: usize) {
        self.bytes_sent += bytes as u64;
        self.messages += 1;
    }
}

/// The frame all-gather's ring (the crate's wire-format section 6.3): `msgs[q]` holds ring
/// position `q`'s message, envelope room first, this position `r`'s own already in place.
/// At step `s` the message of position `r - s` (this rank's own at `s = 0`, then the one
/// received at `s - 1`, byte for byte under a new envelope at `place(s, q)`) goes right
/// and position `r - s - 1`'s comes from the left, checked by `check(q, frame)` as it
/// arrives, before it is forwarded; a failure names position `q`'s rank (`global(q)`) and
/// the neighbour it came through.
pub(crate) fn ring_gather<T: Transport + ?Sized>(
    comm: &mut Comm<T>,
    msgs: &mut [Vec<u8>],
    r: usize,
    global: impl Fn(usize) -> usize,
    place: impl Fn(usize, usize) -> Place,
    stats: &mut Stats,
    mut check: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let p = msgs.len();
    let (right, left) = (global((r + 1) % p), global((r + p - 1) % p));
    for s in 0..p - 1 {
        let (send_q, recv_q) = ((r + p - s) % p, (r + 2 * p - s - 1) % p);
        let mut got = core::mem::take(&mut msgs[recv_q]);
        let mut out = core::mem::take(&mut msgs[send_q]);
        let res = comm.exchange(
            &mut out,
            right,
            place(s, send_q),
            &mut got,
            left,
            place(s, recv_q),
            None,
        );
        stats.sent(out.len());
        msgs[send_q] = out;
        msgs[recv_q] = got;
        res?;
        check(recv_q, &msgs[recv_q][ENVELOPE_LEN..])
            .map_err(|e| peer_error(global(recv_q), Phase::FrameAllGather, left, e))?;
    }
    Ok(())
}

/// A frame from a peer must be whole (header, length and, if sealed, payload checksum),
/// of this collective's codec, and the one its encoder made for this place: the chunk's
/// global offset, and the encoder's seed for this step (codecs that draw nothing record
/// seed 0). Catches a frame of the right shape that belongs to another chunk or rank.
/// Checked as the frame arrives, before it is forwarded; returns the frame split, so
/// that [`decode_checked`] need not check it again.
fn check_origin<'f>(
    codec: &CodecSpec,
    frame: &'f [u8],
    ctx: &EncodeCtx,
) -> Result<(wire::Header, &'f [u8])> {
    let (h, payload) = wire::split(frame)?;
    if h.codec != codec.id() {
        return Err(Error::WrongCodec {
            expected: codec.id(),
            found: h.codec,
        });
    }
    if h.offset != ctx.offset {
        return Err(Error::Misplaced(format!(
            "the frame starts at element {} but this chunk starts at {}",
            h.offset, ctx.offset
        )));
    }
    if h.seed != 0 && h.seed != ctx.seed {
        return Err(Error::Misplaced(format!(
            "the frame was drawn with seed {:#018x}, not this step's seed for its encoder ({:#018x})",
            h.seed, ctx.seed
        )));
    }
    Ok((h, payload))
}

/// Encode `x` into the message buffer `msg` after the envelope's room, through the
/// residual `fb` if given, sealed if `checksum`. Returns the message length (envelope
/// included).
fn encode_fed(
    fb: Option<&mut ErrorFeedback>,
    codec: &CodecSpec,
    checksum: bool,
    x: &[f32],
    ctx: EncodeCtx,
    msg: &mut [u8],
) -> Result<usize> {
    let frame = &mut msg[ENVELOPE_LEN..];
    let len = match fb {
        Some(ef) => ef.encode_into(x, &ctx, frame),
        None => codec.encode_into(x, &ctx, frame),
    }?;
    let len = if checksum {
        wire::seal(frame, len)?
    } else {
        len
    };
    Ok(ENVELOPE_LEN + len)
}

/// Decode a final (owner's) frame of the ring, checked on arrival, from its message
/// `msg` into `out`, divided for the mean as it goes.
fn decode_final(msg: &[u8], out: &mut [f32], op: ReduceOp, p: usize) -> Result<()> {
    // Its checksum was verified as it arrived (`check_origin`), and it has not changed.
    let (h, payload) = wire::split_with(&msg[ENVELOPE_LEN..], false)?;
    codecs::decode_split_then(&h, payload, out, &|x| mean(op, p, x))
}

/// `buf` lengthened to at least `len` bytes (its memory reserved first), as a slice.
fn grow(buf: &mut Vec<u8>, len: usize) -> Result<&mut [u8]> {
    alloc::lengthen(buf, len, "a ring message")?;
    Ok(buf)
}

/// A message buffer of an [`AllReduce`]: the ring's frame of piece `j` to send next, or
/// the all-gather's frame of rank `q`.
enum Held {
    Fwd(usize),
    Frame(usize),
}

/// One received piece of the ring's reduce-scatter, and the frame this rank makes of it.
struct Hop<'c> {
    codec: &'c CodecSpec,
    checksum: bool,
    op: ReduceOp,
    /// What the mean divides by (the world size but in a retry with fewer contributors).
    size: usize,
    /// The owner's hop (the last step: the piece is this rank's to finish).
    own: bool,
    piece: Range<usize>,
    /// This rank's encode context for the piece, and the sender's.
    ctx: EncodeCtx,
    origin: EncodeCtx,
}

impl Hop<'_> {
    /// Sum the received `frame` onto the local piece (of `input`, or of `output` in place)
    /// and encode the sum into the message buffer `msg` after the envelope's room,
    /// through `fb` if given. The owner's hop also writes the decode of its frame (the
    /// reduced piece) to `output`, divided for the mean. Fused tile by tile where the
    /// codec allows (the partial sum is then never written to memory); otherwise
    /// `decode_add` into `output`, an encode and, for the owner, a decode: the same bits
    /// either way. Errors in the received frame go through `bad`. Returns the message
    /// length (envelope included).
    fn run(
        &self,
        frame: &[u8],
        input: Option<&[f32]>,
        output: &mut [f32],
        fb: Option<&mut ErrorFeedback>,
        msg: &mut [u8],
        bad: impl Fn(Error) -> Error,
    ) -> Result<usize> {
        let (h, payload) = check_origin(self.codec, frame, &self.origin).map_err(&bad)?;
        let t = self.piece.clone();
        let finish = |x: &mut [f32]| mean(self.op, self.size, x);
        match codecs::hop_sections(self.codec, &h, payload, t.len()).map_err(&bad)? {
            Some(sections) => {
                let acc = if self.own {
                    HopAcc::Own {
                        src: input.map(|x| &x[t.clone()]),
                        dst: &mut output[t],
                    }
                } else {
                    HopAcc::Forward(&input.unwrap_or(&*output)[t])
                };
                let fb = fb.map(ErrorFeedback::parts);
                let out = &mut msg[ENVELOPE_LEN..];
                let len = codecs::ring_hop(self.codec, sections, acc, fb, &finish, &self.ctx, out)?;
                let len = if self.checksum {
                    wire::seal(out, len)?
                } else {
                    len
                };
                Ok(ENVELOPE_LEN + len)
            }
            None => {
                let acc = &mut output[t.clone()];
                if let Some(x) = input {
                    acc.copy_from_slice(&x[t]);
                }
                decode_checked::<ADD>((h, payload), acc).map_err(&bad)?;
                let len = encode_fed(fb, self.codec, self.checksum, acc, self.ctx, msg)?;
                if self.own {
                    // This rank's own frame, sealed a moment ago: no checksum to verify.
                    let (h, payload) = wire::split_with(&msg[ENVELOPE_LEN..len], false)?;
                    codecs::decode_split_then(&h, payload, acc, &finish)?;
                }
                Ok(len)
            }
        }
    }
}

/// Decode (`M` = write or add) a frame that [`check_origin`] has split and checked.
fn decode_checked<const M: u8>(split: (wire::Header, &[u8]), out: &mut [f32]) -> Result<()> {
    crate::codecs::decode_split::<M>(&split.0, split.1, out)
}

const WRITE: u8 = crate::kernels::mode::WRITE;
const ADD: u8 = crate::kernels::mode::ADD;

/// Random-k with `scale=unbiased`: re-encoding a decoded frame rescales it again.
fn rescales_on_reencode(codec: &CodecSpec) -> bool {
    matches!(codec, CodecSpec::RandK(rk) if rk.scale() == crate::codecs::RandKScale::Unbiased)
}

/// The codec frames are encoded with: identity for the fp32 ring.
fn codec_of(codec: CodecSpec, strategy: Strategy) -> CodecSpec {
    if strategy == Strategy::Fp32Ring {
        CodecSpec::Identity(Identity)
    } else {
        codec
    }
}

/// `x` divided by the `p` ranks where `op` is [`ReduceOp::Mean`].
fn mean(op: ReduceOp, p: usize, x: &mut [f32]) {
    if op == ReduceOp::Mean {
        divide_by_ranks(x, p);
    }
}

/// An error unless a collective's `input` and `output` both hold `len` elements.
/// `x[i] / p` for every element: the mean of a sum over `p` ranks (a sum of one rank
/// stays as it is). Where `p` is a power of two the division is a multiplication by its
/// exact inverse, which rounds the same real number and so gives the same bits (NaN,
/// infinities, zeros and subnormals included), at the speed of a memory pass.
fn divide_by_ranks(x: &mut [f32], p: usize) {
    if p <= 1 {
        return;
    }
    let pf = p as f32;
    if p.is_power_of_two() {
        let inv = 1.0 / pf;
        x.iter_mut().for_each(|v| *v *= inv);
    } else {
        x.iter_mut().for_each(|v| *v /= pf);
    }
}

fn check_lens(input: &[f32], output: &[f32], len: usize) -> Result<()> {
    for (what, got) in [
        ("input and all-reduce length", input.len()),
        ("output and all-reduce length", output.len()),
    ] {
        if got != len {
            return Err(Error::LengthMismatch {
                what,
                left: got,
                right: len,
            });
        }
    }
    Ok(())
}

/// An error unless `peer` is a rank of a world of `size` (for transports' `send_recv`).
pub(crate) fn check_rank(peer: usize, size: usize) -> Result<()> {
    if peer >= size {
        return Err(Error::Collective(format!(
            "rank {peer} is outside a world of {size} ranks"
        )));
    }
    Ok(())
}

fn peer_error(peer: usize, phase: Phase, via: usize, e: Error) -> Error {
    Error::Peer {
        peer,
        phase: phase.name(),
        forwarded_by: (via != peer).then_some(via),
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::divide_by_ranks;

    #[test]
    fn a_mean_over_a_power_of_two_of_ranks_has_the_bits_of_the_division() {
        let mut xs = vec![
            0.0,
            -0.0,
            1.0,
            -3.5,
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE * 0.75,
            f32::from_bits(1),
            f32::from_bits(0x8000_0003),
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7fc1_2345),
        ];
        // Arbitrary bit patterns besides: every exponent, subnormals and NaNs included.
        let mut h = 0x9e37_79b9_u32;
        for _ in 0..if cfg!(miri) { 1 << 10 } else { 1 << 14 } {
            h ^= h << 13;
            h ^= h >> 17;
            h ^= h << 5;
            xs.push(f32::from_bits(h));
        }
        for p in [1usize, 2, 3, 4, 5, 8, 16, 1024, 1 << 20] {
            let mut got = xs.clone();
            divide_by_ranks(&mut got, p);
            for (x, y) in xs.iter().zip(&got) {
                let want = if p == 1 { *x } else { x / p as f32 };
                // Miri draws a NaN result's payload at random (Rust leaves it open);
                // hardware propagates the operand's, the same for both operations.
                if cfg!(miri) && want.is_nan() {
                    assert!(y.is_nan(), "{x:e} / {p}");
                    continue;
                }
                assert_eq!(want.to_bits(), y.to_bits(), "{x:e} / {p}");
            }
        }
    }
}
