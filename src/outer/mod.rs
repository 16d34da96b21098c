//! Low-communication training: the outer synchronisation of DiLoCo and its streaming
//! variant, with compressed pseudo-gradients.
//!
//! Each rank trains alone with its inner optimizer. Every `H` inner steps
//! ([`OuterOptions::sync_every`]) an [`OuterSync`] takes the **pseudo-gradient**
//! `delta = outer - local` of every tensor (the outer copy it keeps, in f32, minus the
//! rank's current parameters), all-reduces its mean over the ranks with any codec and
//! error feedback (a [`crate::collective::AllReduce`] over any [`Transport`]), takes one
//! step of the **outer optimizer** on its outer copy, and writes the new outer
//! parameters back into the rank's parameters. With `H = 500`, outer SGD with Nesterov
//! momentum 0.9 and learning rate 0.7, this is DiLoCo (Douillard et al. 2023); with no
//! momentum, learning rate 1 and error feedback on a sparse codec it is SparseLoCo.
//!
//! ## Streaming
//! With `P` [`OuterOptions::fragments`], the tensors are cut into `P` fragments that
//! sync at staggered steps, so each sync moves `1/P` of the model. With a
//! [`OuterOptions::delay`] of `tau` steps, a fragment's pseudo-gradient is formed `tau`
//! steps before its sync point; its all-reduce runs on a communication thread while the
//! rank goes on training, and at the sync point the outer step is taken and the result
//! merged into the parameters with mixing `alpha` ([`OuterOptions::alpha`]):
//! `local = alpha * local + (1 - alpha) * outer` (with `alpha = 0` the outer parameters
//! replace the local ones). With `tau = 1` and one fragment this is the one-step-delayed
//! variant.
//!
//! Fragment `f` of `P` syncs at the inner steps `t` (counted from 1) with
//! `t mod H = floor((f + 1) H / P) mod H`, and its pseudo-gradient is formed at step
//! `t - tau` (a sync whose formation would fall before step 1 is skipped). So with one
//! fragment the syncs are at `H, 2H, ...`; every fragment syncs once per `H` steps and
//! every tensor is in exactly one fragment. `P <= H` and `tau < H` are required.
//! [`OuterSync::due`] says what the next step does, so a caller whose parameters live
//! elsewhere (on a GPU) copies only those tensors.
//!
//! ## Arithmetic
//! In f32, element by element, in this order (`d` the all-reduced mean of the
//! pseudo-gradients, `m` the momentum, `mu`, `lr` and `alpha` from the options):
//!
//! ```text
//! delta = outer - local                       (formed at step t - tau)
//! d     = mean over ranks of delta            (the codec's all-reduce)
//! m     = mu * m + d                          (if mu != 0)
//! u     = d + mu * m  (Nesterov)  or  m       (if mu != 0), else d
//! outer = outer - lr * u
//! local = outer                               (alpha = 0)
//!       = alpha * local + (1 - alpha) * outer (otherwise)
//! ```
//!
//! Each operation is one rounded f32 operation (no fused multiply-adds), so every rank,
//! whatever its CPU or floating-point mode, computes the same bits from the same `d`, and
//! the all-reduce gives every rank the same `d`: **every rank ends each outer step with
//! the same outer parameters, to the bit**, as long as they all started from the same
//! parameters. The momentum update is PyTorch's `SGD(momentum=mu, nesterov=True)`.
//!
//! ## State and faults
//! [`OuterSync::save`] writes the inner step counter, the outer copy, the momentum, the
//! residuals and any all-reduce finished but not yet applied into one checksummed blob
//! (see [`crate::state`]); [`OuterSync::restore`], with the model's parameters restored
//! from the same step, continues bit for bit. A failed all-reduce (a peer that leaves is
//! an error on every other rank within the transport's timeout) leaves the ranks' outer
//! copies possibly different, so the synchroniser refuses every later step until it is
//! re-formed and healed, or a state is restored.
//!
//! ## Members that leave and join
//! Training goes on when members leave or join between outer rounds (elastic DiLoCo):
//! every member of the new membership re-forms its synchroniser over a transport of that
//! membership ([`OuterSync::reform`]; a member that joins builds a new one), then all of
//! them call [`OuterSync::heal`] together. Healing finds the members whose state is the
//! newest (the most inner steps, then the most outer steps applied), sends that state,
//! bit for bit, to every member that holds another, and runs again every sync that
//! failed, among the members that hold its pseudo-gradient. Afterwards every member holds
//! the same outer parameters, to the bit, and training goes on. Nothing is dropped
//! silently: [`Heal`] says who was healed, which syncs were run again and which were
//! dropped because no member held their pseudo-gradient any more.
//!
//! The state goes on the link packed where that pays: its floats (outer copy, momentum,
//! a mean not yet applied) as `lossless` frames, the same bits in about 0.85 of the
//! bytes, when the time those bytes take on the link the all-reduce's strategy is chosen
//! for exceeds packing and unpacking them (a sample of the state is packed to measure
//! both). At DiLoCo's usual links (1 Gbit/s and below) it does. Members whose parameters
//! should start equal can call [`OuterSync::heal`] right after [`OuterSync::new`]: it
//! sends the lowest rank's state to every member whose state differs, and nothing but
//! a status to those that already agree.
//!
//! What happens to error feedback:
//! - A failed all-reduce puts this member's residuals back as they were before it, so
//!   its retry encodes the same pseudo-gradient with the same residual and the same
//!   draws.
//! - A member that stays keeps its residuals; in a new world they are moved to where its
//!   all-reduce keeps them (a ring's residuals are per chunk, and the chunks move with
//!   the world size, so the elements of the chunk this member does not encode in the new
//!   ring lose their residual).
//! - A member that is healed zeroes its residuals: they stood for pseudo-gradients of a
//!   history the state it receives may or may not include.
//! - A member that leaves takes its residuals with it: what its codec had not yet sent
//!   is lost, at most one residual's worth of its pseudo-gradients, and the others go on.
//!
//! ```
//! use gradpack::collective::{Transport, local};
//! use gradpack::outer::{OuterOptions, OuterSync};
//! use gradpack::sync::Tensor;
//!
//! let layout = vec![Tensor::new("w", &[4, 3]), Tensor::new("b", &[4])];
//! let results = local::run(2, None, |comm| {
//!     let rank = comm.rank();
//!     let mut w = vec![0.5f32; 12];
//!     let mut b = vec![0.0f32; 4];
//!     let opts = OuterOptions { sync_every: 3, codec: "int8".parse()?, ..Default::default() };
//!     let mut outer = OuterSync::new(&layout, &[&w, &b], comm.into_inner(), opts)?;
//!     for _step in 0..6 {
//!         // An inner optimizer step (each rank moves its own way) ...
//!         w.iter_mut().for_each(|x| *x -= 0.01 * (rank as f32 + 1.0));
//!         // ... then the synchroniser, which at steps 3 and 6 syncs.
//!         outer.step(&mut [&mut w, &mut b])?;
//!     }
//!     Ok(w)
//! });
//! let w: Vec<Vec<f32>> = results.into_iter().collect::<Result<_, _>>()?;
//! assert_eq!(w[0], w[1]); // the same parameters on every rank after a sync
//! # Ok::<(), gradpack::Error>(())
//! ```

use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;

use crate::alloc;
use crate::codec::CodecSpec;
use crate::codecs::Identity;
use crate::collective::comm::setting;
use crate::collective::{
    AllReduce, AllReduceOptions, Comm, Feedback, ReduceOp, Stats, StrategyChoice, Transport,
};
use crate::error::{Error, Result};
use crate::feedback::FeedbackOptions;
use crate::rng::splitmix64;
use crate::state::{BlobReader, BlobWriter};
use crate::sync::{Tensor, layout_hash, spawn_worker, thread_gone};

mod heal;
pub use heal::Heal;

const OUTER_MAGIC: [u8; 4] = *b"GPOS";

/// Every option of `o` that ranks must share, with the layout and its fragments, as
/// `key=value` words: what the first sync agrees on and a saved state records.
fn settings(o: &OuterOptions, tensors: &[Tensor], frags: &[Fragment]) -> String {
    let assignment: Vec<String> = frags
        .iter()
        .map(|f| {
            let ids: Vec<String> = f.tensors.iter().map(|(i, _)| i.to_string()).collect();
            ids.join(",")
        })
        .collect();
    format!(
        "H={} P={} tau={} alpha={:#x} lr={:#x} mu={:#x} nesterov={} codec={} seed={:#x} \
         checksum={} feedback={:?} feedback_options={} strategy={} pieces={} \
         layout={:#010x} fragments={}",
        o.sync_every,
        o.fragments,
        o.delay,
        o.alpha.to_bits(),
        o.outer_lr.to_bits(),
        o.outer_momentum.to_bits(),
        o.nesterov,
        o.codec,
        o.seed,
        o.checksum,
        o.feedback,
        setting(&o.feedback_options),
        setting(&o.strategy),
        o.pieces,
        layout_hash(tensors),
        assignment.join("/"),
    )
}

/// The envelope tag of the first sync's agreement on the options (the all-reduces use
/// the fragment indices).
const AGREE_TAG: u32 = u32::MAX;

/// The envelope tag of healing's status exchange and state transfer.
const HEAL_TAG: u32 = u32::MAX - 1;

/// Options of an [`OuterSync`]. Every rank must use the same: the first sync checks it
/// (one agreement of the ranks' settings before the first all-reduce), and a rank made
/// with another value fails it on every rank, with an error naming the option.
#[derive(Debug, Clone, PartialEq)]
pub struct OuterOptions {
    /// Inner steps per outer step, `H` (default 500, DiLoCo's).
    pub sync_every: u64,
    /// Fragments synced at staggered steps, `P` (default 1: the whole model at once).
    /// Tensors are split in layout order into `P` runs of about equal size, each of at
    /// least one tensor, unless [`OuterOptions::assignment`] gives the split.
    pub fragments: usize,
    /// The fragment of every tensor (values in `0..fragments`, each used), in place of
    /// the split by size. `None` by default.
    pub assignment: Option<Vec<usize>>,
    /// Inner steps between forming a fragment's pseudo-gradient and applying its
    /// all-reduced mean, `tau` (default 0: at once). The all-reduce runs meanwhile.
    pub delay: u64,
    /// Mixing of the local parameters into the result, in `[0, 1]` (default 0: the
    /// outer parameters replace the local ones).
    pub alpha: f32,
    /// The outer learning rate (default 0.7, DiLoCo's).
    pub outer_lr: f32,
    /// The outer momentum, `0` for none (default 0.9, DiLoCo's).
    pub outer_momentum: f32,
    /// Nesterov momentum (default true).
    pub nesterov: bool,
    /// The codec of the pseudo-gradients (default fp32, uncompressed).
    pub codec: CodecSpec,
    /// Error feedback on the pseudo-gradients' all-reduce (default none).
    pub feedback: Feedback,
    /// Error-feedback weights and residual precision.
    pub feedback_options: FeedbackOptions,
    /// The all-reduce's strategy, or how to choose it (see
    /// [`crate::collective::AllReduceOptions::strategy`]).
    pub strategy: StrategyChoice,
    /// Pieces per ring chunk (a pipelined ring; default 1).
    pub pieces: usize,
    /// Seal frames with a payload checksum (default on).
    pub checksum: bool,
    /// Seed of the random draws of every sync (each fragment and round derives its own).
    pub seed: u64,
}

impl Default for OuterOptions {
    fn default() -> Self {
        OuterOptions {
            sync_every: 500,
            fragments: 1,
            assignment: None,
            delay: 0,
            alpha: 0.0,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            nesterov: true,
            codec: CodecSpec::Identity(Identity),
            feedback: Feedback::None,
            feedback_options: FeedbackOptions::default(),
            strategy: StrategyChoice::default(),
            pieces: 1,
            checksum: true,
            seed: 0,
        }
    }
}

/// What the next [`OuterSync::step`] does.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Due {
    /// Fragments whose pseudo-gradient it forms and starts to all-reduce.
    pub send: Vec<usize>,
    /// Fragments whose all-reduced mean it applies (writing their tensors).
    pub apply: Vec<usize>,
}

impl Due {
    /// True if the step neither reads nor writes any parameter.
    pub fn is_empty(&self) -> bool {
        self.send.is_empty() && self.apply.is_empty()
    }
}

/// What one [`OuterSync::step`] did on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OuterStats {
    /// Fragments whose all-reduce was started.
    pub sent: usize,
    /// Fragments whose outer step was applied.
    pub applied: usize,
    /// Bytes this rank sent for the applied fragments (envelopes and frames).
    pub bytes_sent: u64,
    /// Messages this rank sent for the applied fragments.
    pub messages: u64,
}

/// Where a fragment's all-reduce stands.
#[derive(Debug, Clone)]
enum Flight {
    /// Nothing started.
    Idle,
    /// At the communication thread.
    Sent,
    /// Reduced: the mean is in the fragment's `output`, waiting for its sync point; the
    /// bytes and messages this rank sent for it.
    Done(u64, u64),
    /// The all-reduce failed: the pseudo-gradient is still in the fragment's `input`, and
    /// this member's residuals are as they were before the attempt, for
    /// [`OuterSync::heal`] to run it again.
    Failed,
}

/// One fragment on the caller's side.
struct Fragment {
    /// Its tensors, in layout order, and each one's offset in the flat buffers.
    tensors: Vec<(usize, usize)>,
    len: usize,
    /// Sync points: inner steps `t` with `t % H == phase`.
    phase: u64,
    outer: Vec<f32>,
    momentum: Vec<f32>,
    /// The pseudo-gradient and the all-reduced mean (absent while at the worker).
    input: Option<Vec<f32>>,
    output: Option<Vec<f32>>,
    flight: Flight,
    /// The sync point (inner step) of the all-reduce in flight, done or failed.
    due: u64,
    /// Whether `input` holds this member's own pseudo-gradient (a healed member holds
    /// zeros in place of the one it lost, and is not counted in the mean).
    own: bool,
}

impl Fragment {
    /// Its outer copy and momentum as a saved or sent state holds them.
    fn read_state(&self, r: &mut BlobReader<'_>) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut outer = alloc::filled(self.len, 0.0, "a restored outer copy")?;
        r.f32s_into(&mut outer)?;
        let mut momentum = alloc::filled(self.momentum.len(), 0.0, "a restored momentum")?;
        r.f32s_into(&mut momentum)?;
        Ok((outer, momentum))
    }

    /// An all-reduced mean not yet applied, as a state holds it: the bytes and messages
    /// sent for it, and the mean.
    fn read_done(&self, r: &mut BlobReader<'_>) -> Result<(u64, u64, Vec<f32>)> {
        let (bytes, messages) = (r.u64()?, r.u64()?);
        let mut mean = alloc::filled(self.len, 0.0, "a restored mean")?;
        r.f32s_into(&mut mean)?;
        Ok((bytes, messages, mean))
    }
}

/// The communication side: the `Comm` and one all-reduce per fragment.
struct Worker<T: Transport> {
    comm: Comm<T>,
    ars: Vec<AllReduce>,
    /// The settings to agree on before the first all-reduce (then `None`).
    agree: Option<String>,
    /// Whether the all-reduces keep residuals (to put back after a failed attempt).
    feedback: bool,
}

enum Job {
    Reduce {
        fragment: usize,
        seed: u64,
        /// The members whose pseudo-gradients the mean is over.
        mean_over: usize,
        input: Vec<f32>,
        output: Vec<f32>,
    },
    Save,
    Restore(Vec<Vec<u8>>),
    Reset,
    /// Every fragment's residuals as one tensor each.
    Residuals,
    /// Healing's exchange of every member's status.
    Gather(Vec<u8>),
    /// Healing's state transfer from `root` to the members of `to`.
    Transfer {
        root: usize,
        to: Vec<usize>,
        body: Vec<u8>,
        max: usize,
    },
}

enum Done {
    Reduced {
        fragment: usize,
        input: Vec<f32>,
        output: Vec<f32>,
        res: Result<Stats>,
    },
    Saved(Vec<Vec<u8>>),
    Restored(Result<()>),
    Reset,
    Residuals(Vec<Vec<f32>>),
    Gathered(Result<Vec<Vec<u8>>>),
    Transferred(Result<Option<Vec<u8>>>),
}

impl<T: Transport> Worker<T> {
    fn handle(&mut self, job: Job) -> Done {
        let _fp = crate::kernels::Standard::new();
        match job {
            Job::Reduce {
                fragment,
                seed,
                mean_over,
                input,
                mut output,
            } => {
                let agreed = self.agreed();
                // The residuals as they are, to put back if the all-reduce fails: a retry
                // then encodes what this attempt did.
                let before = (self.feedback && agreed.is_ok()).then(|| self.ars[fragment].save());
                let res = agreed
                    .and_then(|()| self.ars[fragment].set_mean_over(mean_over))
                    .and_then(|()| {
                        self.ars[fragment].run(&mut self.comm, &input, &mut output, seed)
                    });
                let res = match (res, before) {
                    (Err(e), Some(b)) => match self.ars[fragment].restore(&b) {
                        Ok(()) => Err(e),
                        Err(r) => Err(Error::Collective(format!(
                            "{e}; and its residuals could not be put back: {r}"
                        ))),
                    },
                    (res, _) => res,
                };
                Done::Reduced {
                    fragment,
                    input,
                    output,
                    res,
                }
            }
            Job::Save => Done::Saved(self.ars.iter().map(AllReduce::save).collect()),
            Job::Restore(blobs) => Done::Restored(crate::state::restore_all(
                &mut self.ars,
                &blobs,
                AllReduce::restore,
            )),
            Job::Reset => {
                self.ars.iter_mut().for_each(AllReduce::reset_feedback);
                Done::Reset
            }
            Job::Residuals => {
                Done::Residuals(self.ars.iter().map(AllReduce::residual_f32).collect())
            }
            Job::Gather(status) => Done::Gathered(
                self.agreed()
                    .and_then(|()| self.comm.gather_bytes(HEAL_TAG, &status, status.len())),
            ),
            Job::Transfer {
                root,
                to,
                body,
                max,
            } => Done::Transferred(self.comm.transfer(HEAL_TAG, root, &to, &body, max)),
        }
    }

    /// The agreement on the settings, if it has not run on this membership yet.
    fn agreed(&mut self) -> Result<()> {
        match self.agree.take() {
            Some(s) => self.comm.agree(AGREE_TAG, &s),
            None => Ok(()),
        }
    }
}

/// The outer synchroniser of one rank (see the module docs).
pub struct OuterSync<T: Transport + Send + 'static> {
    tensors: Vec<Tensor>,
    lens: Vec<usize>,
    /// Per tensor: its fragment and offset there.
    loc: Vec<(usize, usize)>,
    frags: Vec<Fragment>,
    opts: OuterOptions,
    rank: usize,
    size: usize,
    /// Inner steps taken.
    step: u64,
    /// Fragment outer steps applied.
    applied: u64,
    /// Why steps are refused, after a failed sync.
    failed: Option<Error>,
    /// Re-formed and not yet healed: steps are refused.
    must_heal: bool,
    /// Jobs sent and not yet answered, in order.
    queue: VecDeque<usize>,
    jobs: Sender<Job>,
    done: Receiver<Done>,
    handle: Option<JoinHandle<Worker<T>>>,
}

impl<T: Transport + Send + 'static> core::fmt::Debug for OuterSync<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("OuterSync")
            .field("tensors", &self.tensors.len())
            .field("fragments", &self.frags.len())
            .field("step", &self.step)
            .finish()
    }
}

/// The options of fragment `f`'s all-reduce.
fn all_reduce_options(opts: &OuterOptions, f: usize) -> AllReduceOptions {
    AllReduceOptions {
        op: ReduceOp::Mean,
        strategy: opts.strategy.clone(),
        feedback: opts.feedback,
        feedback_options: opts.feedback_options,
        checksum: opts.checksum,
        tag: f as u32,
        pieces: opts.pieces,
    }
}

/// Split tensors of `lens` into `p` runs in order, each of at least one tensor, with
/// boundaries as near as they can be to equal shares of the elements.
fn split(lens: &[usize], p: usize) -> Vec<usize> {
    let total: u128 = lens.iter().map(|&n| n as u128).sum();
    let n = lens.len();
    let mut cum = Vec::with_capacity(n + 1);
    cum.push(0u128);
    for &l in lens {
        cum.push(cum.last().copied().unwrap_or(0) + l as u128);
    }
    let mut out = vec![0; n];
    let mut start = 0;
    for f in 0..p {
        // Fragment f is tensors start..end; end leaves one tensor for each later one.
        let end = if f + 1 == p {
            n
        } else {
            let goal = total * (f as u128 + 1) / p as u128;
            let (lo, hi) = (start + 1, n - (p - f - 1));
            (lo..=hi)
                .min_by_key(|&e| cum[e].abs_diff(goal))
                .unwrap_or(lo)
        };
        out[start..end].iter_mut().for_each(|x| *x = f);
        start = end;
    }
    out
}

impl<T: Transport + Send + 'static> OuterSync<T> {
    /// A synchroniser for the tensors of `layout`, whose outer copy starts as `params`
    /// (one slice per tensor; every rank must give the same values), over `transport`.
    /// Every rank must build it with the same layout and options. Errors on options out
    /// of range, a split that leaves a fragment empty, or `params` that do not match
    /// the layout.
    pub fn new(
        layout: &[Tensor],
        params: &[&[f32]],
        transport: T,
        opts: OuterOptions,
    ) -> Result<OuterSync<T>> {
        let comm = checked_comm(transport)?;
        let (rank, size) = (comm.rank(), comm.size());
        let bad = |reason: String| Err(Error::Collective(format!("outer sync: {reason}")));
        let (h, p) = (opts.sync_every, opts.fragments);
        if h == 0 {
            return bad("sync_every must be at least 1".into());
        }
        if p == 0 || p as u64 > h {
            return bad(format!(
                "{p} fragments with sync_every {h}: need 1 <= fragments <= sync_every"
            ));
        }
        if opts.delay >= h {
            return bad(format!(
                "a delay of {} steps with sync_every {h}: the delay must be shorter",
                opts.delay
            ));
        }
        if !(0.0..=1.0).contains(&opts.alpha) {
            return bad(format!("alpha {} is outside [0, 1]", opts.alpha));
        }
        for (name, v) in [
            ("outer_lr", opts.outer_lr),
            ("outer_momentum", opts.outer_momentum),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return bad(format!("{name} {v}: need a finite value >= 0"));
            }
        }
        if opts.pieces == 0 {
            return bad("pieces per ring chunk must be at least 1".into());
        }
        if params.len() != layout.len() {
            return Err(Error::LengthMismatch {
                what: "parameters and layout tensors",
                left: params.len(),
                right: layout.len(),
            });
        }
        let lens: Vec<usize> = layout.iter().map(Tensor::len).collect::<Result<_>>()?;
        for (i, (&n, x)) in lens.iter().zip(params).enumerate() {
            if x.len() != n {
                return bad(format!(
                    "tensor {i} ({:?}) has {} elements, its shape {:?} says {n}",
                    layout[i].name,
                    x.len(),
                    layout[i].shape
                ));
            }
        }
        if layout.len() < p {
            return bad(format!(
                "{p} fragments of {} tensors: each fragment needs a tensor",
                layout.len()
            ));
        }
        let assignment = match &opts.assignment {
            Some(a) => {
                if a.len() != layout.len() {
                    return Err(Error::LengthMismatch {
                        what: "fragment assignment and layout tensors",
                        left: a.len(),
                        right: layout.len(),
                    });
                }
                let mut used = vec![false; p];
                for (i, &f) in a.iter().enumerate() {
                    if f >= p {
                        return bad(format!("tensor {i} is assigned fragment {f} of {p}"));
                    }
                    used[f] = true;
                }
                if let Some(f) = used.iter().position(|u| !u) {
                    return bad(format!("no tensor is assigned fragment {f}"));
                }
                a.clone()
            }
            None => split(&lens, p),
        };
        let momentum = opts.outer_momentum != 0.0;
        let mut loc = vec![(0, 0); layout.len()];
        let mut frags = Vec::with_capacity(p);
        let mut ars = Vec::with_capacity(p);
        for f in 0..p {
            let mut tensors = Vec::new();
            let mut len = 0usize;
            for (i, _) in assignment.iter().enumerate().filter(|(_, a)| **a == f) {
                loc[i] = (f, tensors.len());
                tensors.push((i, len));
                len = len
                    .checked_add(lens[i])
                    .ok_or_else(|| Error::Collective("a fragment's size overflows".into()))?;
            }
            let mut outer = alloc::filled(len, 0.0, "the outer parameters")?;
            for &(i, off) in &tensors {
                outer[off..off + lens[i]].copy_from_slice(params[i]);
            }
            ars.push(AllReduce::new(
                opts.codec,
                len,
                &comm,
                all_reduce_options(&opts, f),
            )?);
            frags.push(Fragment {
                tensors,
                len,
                phase: ((f as u64 + 1) * h / p as u64) % h,
                outer,
                momentum: alloc::filled(if momentum { len } else { 0 }, 0.0, "the outer momentum")?,
                input: Some(alloc::filled(len, 0.0, "a pseudo-gradient buffer")?),
                output: Some(alloc::filled(len, 0.0, "a pseudo-gradient buffer")?),
                flight: Flight::Idle,
                due: 0,
                own: true,
            });
        }
        let agree = Some(settings(&opts, layout, &frags));
        let feedback = opts.feedback != Feedback::None;
        let worker = Worker {
            comm,
            ars,
            agree,
            feedback,
        };
        let (jobs, done, handle) =
            spawn_worker(format!("gradpack-outer-{rank}"), worker, Worker::handle)?;
        Ok(OuterSync {
            tensors: layout.to_vec(),
            lens,
            loc,
            frags,
            opts,
            rank,
            size,
            step: 0,
            applied: 0,
            failed: None,
            must_heal: false,
            queue: VecDeque::new(),
            jobs,
            done,
            handle: Some(handle),
        })
    }

    /// Inner steps taken so far.
    pub fn inner_step(&self) -> u64 {
        self.step
    }

    /// The options.
    pub fn options(&self) -> &OuterOptions {
        &self.opts
    }

    /// The tensors of every fragment, in layout order.
    pub fn fragments(&self) -> Vec<Vec<usize>> {
        self.frags
            .iter()
            .map(|f| f.tensors.iter().map(|&(i, _)| i).collect())
            .collect()
    }

    /// The outer copy of tensor `i`.
    pub fn outer(&self, i: usize) -> Result<&[f32]> {
        let (f, k) = *self.loc.get(i).ok_or_else(|| {
            Error::Collective(format!(
                "tensor {i} is outside the layout of {} tensors",
                self.tensors.len()
            ))
        })?;
        let off = self.frags[f].tensors[k].1;
        Ok(&self.frags[f].outer[off..off + self.lens[i]])
    }

    /// Bytes of state held: outer copy, momentum and buffers (residuals not counted).
    pub fn memory_bytes(&self) -> usize {
        self.frags
            .iter()
            .map(|f| 4 * (f.outer.capacity() + f.momentum.capacity() + 2 * f.len))
            .sum()
    }

    fn sends_at(&self, t: u64) -> Vec<usize> {
        let (h, tau) = (self.opts.sync_every, self.opts.delay);
        (0..self.frags.len())
            .filter(|&f| t >= 1 && (t + tau) % h == self.frags[f].phase)
            .collect()
    }

    fn applies_at(&self, t: u64) -> Vec<usize> {
        let (h, tau) = (self.opts.sync_every, self.opts.delay);
        (0..self.frags.len())
            .filter(|&f| t > tau && t % h == self.frags[f].phase)
            .collect()
    }

    /// The seed of fragment `f`'s all-reduce with its sync point at inner step `due`.
    fn seed(&self, f: usize, due: u64) -> u64 {
        let round = due / self.opts.sync_every;
        splitmix64(self.opts.seed ^ splitmix64(round) ^ splitmix64(!(f as u64)))
    }

    /// Fragment outer steps the schedule applies in inner steps `1..=step`.
    fn applies_through(&self, step: u64) -> u64 {
        let h = self.opts.sync_every;
        // Steps t in 1..=s with t mod H = o.
        let count = |s: u64, o: u64| match o {
            0 => s / h,
            _ if s >= o => (s - o) / h + 1,
            _ => 0,
        };
        let tau = self.opts.delay.min(step);
        self.frags
            .iter()
            .map(|f| count(step, f.phase) - count(tau, f.phase))
            .sum()
    }

    /// What the next [`OuterSync::step`] does: which fragments' tensors it reads (to
    /// form their pseudo-gradients) and which it writes (those of `apply`, which it also
    /// reads when `alpha > 0`). Tensors of no fragment listed are left alone.
    pub fn due(&self) -> Due {
        let t = self.step + 1;
        Due {
            send: self.sends_at(t),
            apply: self.applies_at(t),
        }
    }

    /// Call after every inner optimizer step, with the rank's parameters (one slice per
    /// tensor of the layout). At a fragment's formation step this forms its
    /// pseudo-gradient and starts the all-reduce; at its sync point it waits for the
    /// all-reduce, takes the outer step and writes the fragment's parameters. Only the
    /// tensors of the fragments in [`OuterSync::due`] are read or written; when nothing
    /// is due, `params` may be empty.
    ///
    /// On an error the step still counts, and every later step is refused until
    /// [`OuterSync::restore`] (the ranks' outer copies may differ after a failed sync).
    pub fn step(&mut self, params: &mut [&mut [f32]]) -> Result<OuterStats> {
        if let Some(e) = &self.failed {
            return Err(Error::Collective(format!(
                "outer sync failed earlier ({e}); re-form it and heal, or restore a saved \
                 state, to go on"
            )));
        }
        if self.must_heal {
            return Err(Error::Collective(
                "outer sync re-formed for a new membership: heal it before the next step".into(),
            ));
        }
        let t = self.step + 1;
        let due = self.due();
        if params.len() != self.tensors.len() && !(params.is_empty() && due.is_empty()) {
            return Err(Error::LengthMismatch {
                what: "parameters and layout tensors",
                left: params.len(),
                right: self.tensors.len(),
            });
        }
        for &f in due.send.iter().chain(&due.apply) {
            for &(i, _) in &self.frags[f].tensors {
                if params[i].len() != self.lens[i] {
                    return Err(Error::LengthMismatch {
                        what: "parameter and its tensor's elements",
                        left: params[i].len(),
                        right: self.lens[i],
                    });
                }
            }
        }
        let _fp = crate::kernels::Standard::new();
        self.step = t;
        let res = self.run(t, &due, params);
        if let Err(e) = &res {
            self.failed = Some(e.clone());
        }
        res
    }

    fn run(&mut self, t: u64, due: &Due, params: &mut [&mut [f32]]) -> Result<OuterStats> {
        let mut stats = OuterStats::default();
        for &f in &due.send {
            let frag = &mut self.frags[f];
            let Some(input) = frag.input.as_mut() else {
                return Err(already_reduced(f));
            };
            for &(i, off) in &frag.tensors {
                let (o, d) = (&frag.outer[off..], &mut input[off..off + params[i].len()]);
                d.iter_mut()
                    .zip(o.iter().zip(params[i].iter()))
                    .for_each(|(d, (&o, &x))| *d = o - x);
            }
            frag.due = t + self.opts.delay;
            frag.own = true;
            self.send(f, self.size)?;
            stats.sent += 1;
        }
        for &f in &due.apply {
            self.wait_for(f)?;
            let (bytes, messages) = self.apply(f, params)?;
            stats.applied += 1;
            stats.bytes_sent += bytes;
            stats.messages += messages;
        }
        Ok(stats)
    }

    /// Start fragment `f`'s all-reduce of its `input` (the pseudo-gradient for its sync
    /// point `due`) on the communication thread, the mean over `mean_over` members.
    fn send(&mut self, f: usize, mean_over: usize) -> Result<()> {
        let seed = self.seed(f, self.frags[f].due);
        let frag = &mut self.frags[f];
        let (Some(input), Some(output)) = (frag.input.take(), frag.output.take()) else {
            return Err(already_reduced(f));
        };
        frag.flight = Flight::Sent;
        self.jobs
            .send(Job::Reduce {
                fragment: f,
                seed,
                mean_over,
                input,
                output,
            })
            .map_err(|_| thread_gone())?;
        self.queue.push_back(f);
        Ok(())
    }

    /// Take fragment `f`'s outer step with its all-reduced mean and write its tensors of
    /// `params`: the bytes and messages this rank sent for the mean.
    fn apply(&mut self, f: usize, params: &mut [&mut [f32]]) -> Result<(u64, u64)> {
        let frag = &mut self.frags[f];
        let Flight::Done(bytes, messages) = core::mem::replace(&mut frag.flight, Flight::Idle)
        else {
            return Err(Error::Collective(format!(
                "fragment {f} has no all-reduced pseudo-gradient to apply"
            )));
        };
        let mean = frag.output.as_deref().ok_or_else(thread_gone)?;
        outer_step(
            &mut frag.outer,
            &mut frag.momentum,
            mean,
            self.opts.outer_lr,
            self.opts.outer_momentum,
            self.opts.nesterov,
        );
        for &(i, off) in &frag.tensors {
            mix(
                params[i],
                &frag.outer[off..off + self.lens[i]],
                self.opts.alpha,
            );
        }
        self.applied += 1;
        Ok((bytes, messages))
    }

    /// Receive answers until fragment `f`'s reduction is back (it is if not sent).
    fn wait_for(&mut self, f: usize) -> Result<()> {
        while matches!(self.frags[f].flight, Flight::Sent) {
            self.receive_one()?;
        }
        Ok(())
    }

    fn receive_one(&mut self) -> Result<()> {
        let done = self.done.recv().map_err(|_| thread_gone())?;
        let Done::Reduced {
            fragment,
            input,
            output,
            res,
        } = done
        else {
            return Err(Error::Collective(
                "the communication thread answered out of turn".into(),
            ));
        };
        self.queue.pop_front();
        let frag = &mut self.frags[fragment];
        frag.input = Some(input);
        frag.output = Some(output);
        match res {
            Ok(s) => {
                frag.flight = Flight::Done(s.bytes_sent, s.messages);
                Ok(())
            }
            Err(e) => {
                frag.flight = Flight::Failed;
                Err(e)
            }
        }
    }

    /// Wait for every all-reduce in flight, keeping the results for their sync points.
    fn drain(&mut self) -> Result<()> {
        let mut first = Ok(());
        while !self.queue.is_empty() {
            if let (Err(e), true) = (self.receive_one(), first.is_ok()) {
                first = Err(e);
            }
        }
        first
    }

    fn call(&mut self, job: Job) -> Result<Done> {
        self.jobs.send(job).map_err(|_| thread_gone())?;
        self.done.recv().map_err(|_| thread_gone())
    }

    /// The state as one saved blob: the inner step, the outer copy and momentum, the
    /// residuals, and every all-reduce finished and not yet applied (this waits for
    /// those in flight). Refused after a failed sync.
    pub fn save(&mut self) -> Result<Vec<u8>> {
        if let Some(e) = &self.failed {
            return Err(Error::Collective(format!(
                "outer sync failed earlier ({e}): its state is not consistent across ranks"
            )));
        }
        if self.must_heal {
            return Err(Error::Collective(
                "outer sync re-formed and not yet healed: its state is not consistent across \
                 ranks"
                    .into(),
            ));
        }
        if let Err(e) = self.drain() {
            self.failed = Some(e.clone());
            return Err(e);
        }
        let Done::Saved(blobs) = self.call(Job::Save)? else {
            return Err(thread_gone());
        };
        let mut w = BlobWriter::new(OUTER_MAGIC);
        w.u32(layout_hash(&self.tensors))
            .str(&self.settings())
            .u64(self.rank as u64)
            .u64(self.size as u64)
            .u64(self.step)
            .u64(self.frags.len() as u64);
        for (frag, blob) in self.frags.iter().zip(&blobs) {
            w.u64(frag.tensors.len() as u64);
            frag.tensors.iter().for_each(|&(i, _)| {
                w.u64(i as u64);
            });
            w.f32s(&frag.outer).f32s(&frag.momentum).bytes(blob);
            match &frag.flight {
                Flight::Done(bytes, messages) => {
                    w.u8(1)
                        .u64(*bytes)
                        .u64(*messages)
                        .f32s(frag.output.as_deref().unwrap_or(&[]));
                }
                _ => {
                    w.u8(0);
                }
            }
        }
        Ok(w.finish())
    }

    /// Every option that changes the arithmetic, the schedule or the draws, as text.
    fn settings(&self) -> String {
        settings(&self.opts, &self.tensors, &self.frags)
    }

    /// Restore a blob from [`OuterSync::save`] on the same rank of a synchroniser built
    /// with the same layout and options (any all-reduce in flight is waited for and
    /// dropped). With the model's parameters of the same step, training then continues
    /// bit for bit. Refused with [`Error::Checkpoint`], changing nothing, if the blob is
    /// damaged or from another layout, options or world.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        let mut r = BlobReader::open(blob, OUTER_MAGIC, "outer sync")?;
        r.u32_eq("layout hash (names and shapes)", layout_hash(&self.tensors))?;
        r.str_eq("settings", &self.settings())?;
        r.u64_eq("rank", self.rank as u64)?;
        r.u64_eq("world size", self.size as u64)?;
        let step = r.u64()?;
        r.u64_eq("fragment count", self.frags.len() as u64)?;
        struct Loaded {
            outer: Vec<f32>,
            momentum: Vec<f32>,
            blob: Vec<u8>,
            done: Option<(u64, u64, Vec<f32>)>,
        }
        let mut loaded = Vec::with_capacity(self.frags.len());
        for frag in &self.frags {
            r.u64_eq("fragment tensor count", frag.tensors.len() as u64)?;
            for &(i, _) in &frag.tensors {
                r.u64_eq("fragment tensor", i as u64)?;
            }
            let (outer, momentum) = frag.read_state(&mut r)?;
            let blob = r.bytes()?.to_vec();
            let done = match r.u8()? {
                0 => None,
                1 => Some(frag.read_done(&mut r)?),
                v => {
                    return Err(Error::Checkpoint(format!(
                        "outer sync: pending flag {v} is neither 0 nor 1"
                    )));
                }
            };
            loaded.push(Loaded {
                outer,
                momentum,
                blob,
                done,
            });
        }
        r.end()?;
        // Whatever is in flight belongs to the state being replaced.
        let _ = self.drain();
        let blobs = loaded.iter().map(|l| l.blob.clone()).collect();
        match self.call(Job::Restore(blobs))? {
            Done::Restored(res) => res?,
            _ => return Err(thread_gone()),
        }
        for (frag, l) in self.frags.iter_mut().zip(loaded) {
            frag.outer = l.outer;
            frag.momentum = l.momentum;
            frag.own = true;
            frag.flight = match l.done {
                Some((bytes, messages, mean)) => {
                    frag.output = Some(mean);
                    Flight::Done(bytes, messages)
                }
                None => Flight::Idle,
            };
        }
        self.step = step;
        self.applied = self.applies_through(step);
        self.failed = None;
        self.must_heal = false;
        Ok(())
    }

    /// Zero every residual of the pseudo-gradients' error feedback.
    pub fn reset_feedback(&mut self) -> Result<()> {
        self.drain()?;
        match self.call(Job::Reset)? {
            Done::Reset => Ok(()),
            _ => Err(thread_gone()),
        }
    }

    /// The transport, giving up the synchroniser (after waiting for what is in flight).
    pub fn into_transport(mut self) -> Result<T> {
        let _ = self.drain();
        let (dead, _) = mpsc::channel();
        drop(core::mem::replace(&mut self.jobs, dead));
        let worker = self
            .handle
            .take()
            .and_then(|h| h.join().ok())
            .ok_or_else(thread_gone)?;
        Ok(worker.comm.into_inner())
    }
}

impl<T: Transport + Send + 'static> Drop for OuterSync<T> {
    fn drop(&mut self) {
        let (dead, _) = mpsc::channel();
        drop(core::mem::replace(&mut self.jobs, dead));
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// A `Comm` over `transport`, or an error if it reports a rank outside its world.
fn checked_comm<T: Transport>(transport: T) -> Result<Comm<T>> {
    let comm = Comm::new(transport);
    let (rank, size) = (comm.rank(), comm.size());
    if size == 0 || rank >= size {
        return Err(Error::Collective(format!(
            "transport reports rank {rank} in a world of {size}"
        )));
    }
    Ok(comm)
}

fn already_reduced(f: usize) -> Error {
    Error::Collective(format!("fragment {f} is already being reduced"))
}

/// The outer optimizer's step on one fragment (see the module docs for the order of
/// operations).
fn outer_step(outer: &mut [f32], m: &mut [f32], d: &[f32], lr: f32, mu: f32, nesterov: bool) {
    if mu == 0.0 {
        outer.iter_mut().zip(d).for_each(|(o, &d)| *o -= lr * d);
    } else if nesterov {
        outer
            .iter_mut()
            .zip(m.iter_mut().zip(d))
            .for_each(|(o, (m, &d))| {
                *m = mu * *m + d;
                *o -= lr * (d + mu * *m);
            });
    } else {
        outer
            .iter_mut()
            .zip(m.iter_mut().zip(d))
            .for_each(|(o, (m, &d))| {
                *m = mu * *m + d;
                *o -= lr * *m;
            });
    }
}

/// `local = alpha * local + (1 - alpha) * outer`, or a copy for `alpha = 0`.
fn mix(local: &mut [f32], outer: &[f32], alpha: f32) {
    if alpha == 0.0 {
        local.copy_from_slice(outer);
    } else {
        let beta = 1.0 - alpha;
        local
            .iter_mut()
            .zip(outer)
            .for_each(|(l, &o)| *l = alpha * *l + beta * o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_in_order_with_no_empty_fragment() {
        assert_eq!(split(&[10, 10, 10, 10], 2), vec![0, 0, 1, 1]);
        assert_eq!(split(&[1000, 1, 1, 1], 3), vec![0, 1, 2, 2]);
        assert_eq!(split(&[1, 1, 1, 1000], 3), vec![0, 0, 1, 2]);
        assert_eq!(split(&[5], 1), vec![0]);
        for p in 1..=6 {
            let a = split(&[3, 0, 7, 1, 1, 9, 2], p);
            assert!(a.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1));
            assert_eq!((a[0], *a.last().unwrap()), (0, p - 1));
        }
    }

    #[test]
    fn outer_step_is_torch_sgd() {
        // PyTorch SGD(lr=0.5, momentum=0.9, nesterov=True), two steps from zero
        // momentum on grads 1 then 2: buf 1, p -= 0.5 (1 + 0.9); buf 2.9, p -= 0.5 (2 + 2.61).
        let (mut o, mut m) = (vec![10.0f32], vec![0.0f32]);
        outer_step(&mut o, &mut m, &[1.0], 0.5, 0.9, true);
        assert_eq!(o[0], 10.0 - 0.5 * (1.0 + 0.9 * 1.0));
        outer_step(&mut o, &mut m, &[2.0], 0.5, 0.9, true);
        let buf = 0.9f32 * 1.0 + 2.0;
        assert_eq!(m[0], buf);
        assert_eq!(o[0], (10.0 - 0.5 * 1.9f32) - 0.5 * (2.0 + 0.9 * buf));
    }
}
