//! A new membership: [`OuterSync::reform`] moves a synchroniser onto a transport of the
//! members that remain and join, and [`OuterSync::heal`] makes their states one again
//! (the module docs of [`crate::outer`] give the rules).

use super::{Flight, Job, OuterSync, all_reduce_options, checked_comm, mix};
use crate::codec::{Codec, EncodeCtx};
use crate::codecs::Lossless;
use crate::collective::comm::ENVELOPE_LEN;
use crate::collective::{AllReduce, Feedback, StrategyChoice, Transport};
use crate::error::{Error, Result};
use crate::rng::splitmix64;
use crate::state::{BlobReader, BlobWriter};
use crate::sync::{layout_hash, spawn_worker, thread_gone};

/// The magic of the state one member sends another in healing.
const SHARED_MAGIC: [u8; 4] = *b"GPOH";

/// Bytes of a member's status before its per-fragment flags: inner steps, outer steps
/// applied, the digest of its shared state and that state's length, each a u64.
const STATUS_HEAD: usize = 32;

/// What [`OuterSync::heal`] did. The same on every member but [`Heal::was_healed`] and
/// [`Heal::bytes_sent`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heal {
    /// The member (its rank in this membership) whose state every member now holds:
    /// the lowest rank among those with the most inner steps, then the most outer steps
    /// applied.
    pub source: usize,
    /// The members that received the source's state because theirs differed (a member
    /// that joined, one restarted from an older state, or one that took an outer step
    /// the source did not), in rank order.
    pub healed: Vec<usize>,
    /// Whether this member was one of them: its parameters are then the outer copy and
    /// its residuals zero.
    pub was_healed: bool,
    /// The fragments whose failed all-reduce ran again, in order, each with the number
    /// of members whose pseudo-gradients its mean is over (a healed member sends zeros
    /// and is not counted).
    pub retried: Vec<(usize, usize)>,
    /// The fragments whose failed all-reduce was dropped because no member held its
    /// pseudo-gradient any more (their inner progress since the last sync stays in the
    /// parameters and goes into the next round's pseudo-gradient).
    pub dropped: Vec<usize>,
    /// Fragment outer steps taken here (retried all-reduces whose sync point had
    /// passed).
    pub applied: usize,
    /// Bytes this member sent: its state to the healed members, and its frames of the
    /// retried all-reduces.
    pub bytes_sent: u64,
}

/// One member's status, as healing shares it.
#[derive(Debug)]
struct Status {
    step: u64,
    applied: u64,
    digest: u64,
    shared_len: u64,
    /// Per fragment: whether its `input` is the member's own pseudo-gradient.
    own: Vec<bool>,
}

impl Status {
    fn write(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(STATUS_HEAD + self.own.len());
        for v in [self.step, self.applied, self.digest, self.shared_len] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend(self.own.iter().map(|&o| u8::from(o)));
        b
    }

    fn read(b: &[u8], fragments: usize, from: usize) -> Result<Status> {
        let bad = |why: String| Error::Peer {
            peer: from,
            phase: "healing's status exchange",
            forwarded_by: None,
            source: Box::new(Error::Collective(why)),
        };
        if b.len() != STATUS_HEAD + fragments {
            return Err(bad(format!(
                "a status of {} bytes, expected {} for {fragments} fragments",
                b.len(),
                STATUS_HEAD + fragments
            )));
        }
        let u = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let own = b[STATUS_HEAD..]
            .iter()
            .map(|&o| match o {
                0 => Ok(false),
                1 => Ok(true),
                v => Err(bad(format!("a fragment flag {v}, neither 0 nor 1"))),
            })
            .collect::<Result<_>>()?;
        Ok(Status {
            step: u(0),
            applied: u(1),
            digest: u(2),
            shared_len: u(3),
            own,
        })
    }
}

/// A 64-bit digest of `b` (splitmix64 over its little-endian words, then its length).
fn digest(b: &[u8]) -> u64 {
    let mut words = b.chunks_exact(8);
    let mut h = 0x6770_6F75_7465_7231u64;
    for w in &mut words {
        h = splitmix64(h ^ u64::from_le_bytes(w.try_into().expect("8 bytes")));
    }
    let mut last = [0u8; 8];
    last[..words.remainder().len()].copy_from_slice(words.remainder());
    splitmix64(splitmix64(h ^ u64::from_le_bytes(last)) ^ b.len() as u64)
}

impl<T: Transport + Send + 'static> OuterSync<T> {
    /// Move this member onto `transport`, a transport of the new membership (the
    /// members that remain and those that join, in any order of ranks), keeping its
    /// state: inner steps, outer copy, momentum, all-reduces finished and not yet
    /// applied, the pseudo-gradients of those that failed, and the residuals (moved to
    /// where the new world's all-reduce keeps them). Returns the former transport.
    ///
    /// Every member of the new membership then calls [`OuterSync::heal`] (a member
    /// that joins builds a synchroniser with [`OuterSync::new`] and calls it too); steps
    /// are refused until then. Waits for the all-reduces in flight first: one that fails
    /// is kept for healing to run again. On an error (a transport that reports a rank
    /// outside its world, memory that cannot be had) nothing changes.
    pub fn reform(&mut self, transport: T) -> Result<T> {
        // A failure here marks its fragment failed, for healing to retry.
        let _ = self.drain();
        let comm = checked_comm(transport)?;
        let (rank, size) = (comm.rank(), comm.size());
        let residuals = if self.opts.feedback == Feedback::None {
            None
        } else {
            match self.call(Job::Residuals)? {
                super::Done::Residuals(r) => Some(r),
                _ => return Err(thread_gone()),
            }
        };
        let mut ars = Vec::with_capacity(self.frags.len());
        for (f, frag) in self.frags.iter().enumerate() {
            let mut ar = AllReduce::new(
                self.opts.codec,
                frag.len,
                &comm,
                all_reduce_options(&self.opts, f),
            )?;
            if let Some(r) = &residuals {
                ar.set_residual_f32(&r[f])?;
            }
            ars.push(ar);
        }
        let worker = super::Worker {
            comm,
            ars,
            agree: Some(self.settings()),
            feedback: residuals.is_some(),
        };
        let (jobs, done, handle) = spawn_worker(
            format!("gradpack-outer-{rank}"),
            worker,
            super::Worker::handle,
        )?;
        // The former worker stops once its queue is dropped; what it holds goes with it.
        drop(core::mem::replace(&mut self.jobs, jobs));
        self.done = done;
        let old = self
            .handle
            .replace(handle)
            .and_then(|h| h.join().ok())
            .ok_or_else(thread_gone)?;
        self.queue.clear();
        self.rank = rank;
        self.size = size;
        self.failed = None;
        self.must_heal = true;
        Ok(old.comm.into_inner())
    }

    /// Make every member's state one again, after [`OuterSync::reform`] on every member
    /// of a new membership (and [`OuterSync::new`] on those that join): a collective
    /// call every member makes with its parameters (every tensor of the layout).
    ///
    /// 1. The members agree on their settings, then share their status: inner steps,
    ///    outer steps applied, and a digest of their state (outer copy, momentum, the
    ///    all-reduces done but not applied and those that failed).
    /// 2. The source is the lowest rank among those with the most inner steps, then the
    ///    most outer steps applied. Every member whose status differs from the source's
    ///    receives the source's state, bit for bit: its parameters become the outer
    ///    copy, its residuals zero, its inner step the source's.
    /// 3. Every all-reduce that failed runs again, in fragment order, with the same
    ///    seed, each member sending the pseudo-gradient it formed (its residuals as they
    ///    were before the failed attempt); a healed member sends zeros, and the mean is
    ///    over the members that sent their own. One that no member can send is dropped.
    ///    Where its sync point has passed, its outer step is taken and `params` written.
    ///
    /// On an error (a member that leaves during healing) the synchroniser refuses steps
    /// until it is re-formed and healed again.
    pub fn heal(&mut self, params: &mut [&mut [f32]]) -> Result<Heal> {
        if let Some(e) = &self.failed {
            return Err(Error::Collective(format!(
                "outer sync failed earlier ({e}): re-form it over a working transport first"
            )));
        }
        if params.len() != self.tensors.len() {
            return Err(Error::LengthMismatch {
                what: "parameters and layout tensors",
                left: params.len(),
                right: self.tensors.len(),
            });
        }
        for (x, &n) in params.iter().zip(&self.lens) {
            if x.len() != n {
                return Err(Error::LengthMismatch {
                    what: "parameter and its tensor's elements",
                    left: x.len(),
                    right: n,
                });
            }
        }
        let _fp = crate::kernels::Standard::new();
        let res = self.heal_members(params);
        match &res {
            Ok(_) => self.must_heal = false,
            Err(e) => self.failed = Some(e.clone()),
        }
        res
    }

    fn heal_members(&mut self, params: &mut [&mut [f32]]) -> Result<Heal> {
        self.drain()?;
        let shared = self.shared_state()?;
        let mine = Status {
            step: self.step,
            applied: self.applied,
            digest: digest(&shared),
            shared_len: shared.len() as u64,
            own: self.frags.iter().map(|f| f.own).collect(),
        };
        let all = match self.call(Job::Gather(mine.write()))? {
            super::Done::Gathered(r) => r?,
            _ => return Err(thread_gone()),
        };
        let p = self.frags.len();
        let statuses: Vec<Status> = all
            .iter()
            .enumerate()
            .map(|(from, b)| Status::read(b, p, from))
            .collect::<Result<_>>()?;
        // The newest state, the lowest rank on a tie.
        let source = (0..statuses.len())
            .max_by_key(|&q| (statuses[q].step, statuses[q].applied, core::cmp::Reverse(q)))
            .ok_or_else(|| Error::Collective("healing with no members".into()))?;
        let s = &statuses[source];
        let healed: Vec<usize> = (0..statuses.len())
            .filter(|&q| {
                let t = &statuses[q];
                (t.step, t.applied, t.digest) != (s.step, s.applied, s.digest)
            })
            .collect();
        let mut heal = Heal {
            source,
            was_healed: healed.contains(&self.rank),
            ..Heal::default()
        };
        if !healed.is_empty() {
            let max = usize::try_from(s.shared_len).map_err(|_| {
                Error::Collective(format!("a state of {} bytes to receive", s.shared_len))
            })?;
            let body = if self.rank == source {
                self.body_to_send(shared)?
            } else {
                Vec::new()
            };
            if self.rank == source {
                heal.bytes_sent += healed.len() as u64 * (body.len() + ENVELOPE_LEN) as u64;
            }
            let got = match self.call(Job::Transfer {
                root: source,
                to: healed.clone(),
                body,
                max,
            })? {
                super::Done::Transferred(r) => r?,
                _ => return Err(thread_gone()),
            };
            if let Some(state) = got {
                self.take_shared_state(&state, params)?;
            }
        }
        heal.healed = healed;
        // Every member now holds the source's flights: run again the failed ones.
        for f in 0..p {
            if !matches!(self.frags[f].flight, Flight::Failed) {
                continue;
            }
            let over = (0..statuses.len())
                .filter(|q| !heal.healed.contains(q) && statuses[*q].own[f])
                .count();
            if over == 0 {
                self.frags[f].flight = Flight::Idle;
                heal.dropped.push(f);
                continue;
            }
            let due = self.frags[f].due;
            self.send(f, over)?;
            self.wait_for(f)?;
            heal.retried.push((f, over));
            if due <= self.step {
                let (bytes, _) = self.apply(f, params)?;
                heal.bytes_sent += bytes;
                heal.applied += 1;
            } else if let Flight::Done(bytes, _) = self.frags[f].flight {
                heal.bytes_sent += bytes;
            }
        }
        Ok(heal)
    }

    /// The source's state as it goes on the link: `shared`, or the same state packed
    /// (its floats as `lossless` frames, the same bits) where that is fewer bytes and
    /// [`OuterSync::packing_pays`].
    fn body_to_send(&self, shared: Vec<u8>) -> Result<Vec<u8>> {
        if !self.packing_pays(shared.len()) {
            return Ok(shared);
        }
        let packed = self.shared_state_as(BlobWriter::packed(SHARED_MAGIC))?;
        Ok(if packed.len() < shared.len() {
            packed
        } else {
            shared
        })
    }

    /// Whether packing a state of `bytes` bytes saves more time on the link than packing
    /// and unpacking it take: the link is the one the all-reduce's strategy is chosen
    /// for (10 Gbit/s when the strategy is forced), the packing's speed and size those
    /// of the first fragment's outer copy's first 64 Ki values, unpacking taken to cost
    /// what packing does.
    fn packing_pays(&self, bytes: usize) -> bool {
        let bandwidth = match &self.opts.strategy {
            StrategyChoice::Auto {
                bandwidth_bit_s, ..
            } => *bandwidth_bit_s,
            StrategyChoice::Forced(_) => 10e9,
        };
        let Some(frag) = self.frags.first() else {
            return false;
        };
        let sample = &frag.outer[..frag.outer.len().min(1 << 16)];
        if sample.is_empty() || bandwidth.is_nan() || bandwidth <= 0.0 {
            return false;
        }
        let codec = Lossless::default();
        let mut frame = Vec::new();
        let mut seconds = f64::INFINITY;
        for _ in 0..2 {
            let t = std::time::Instant::now();
            match codec.encode(sample, &EncodeCtx::new(0)) {
                Ok(f) => frame = f,
                Err(_) => return false,
            }
            seconds = seconds.min(t.elapsed().as_secs_f64());
        }
        let scale = bytes as f64 / (4 * sample.len()) as f64;
        let saved = (4 * sample.len()) as f64 - frame.len() as f64;
        saved * scale * 8.0 / bandwidth > 2.0 * seconds * scale
    }

    /// What healing sends a member whose state differs: the inner and outer steps taken
    /// and, per fragment, the outer copy, the momentum and its all-reduce's standing (a
    /// mean not yet applied, or a failed one's sync point).
    fn shared_state(&self) -> Result<Vec<u8>> {
        self.shared_state_as(BlobWriter::new(SHARED_MAGIC))
    }

    /// [`OuterSync::shared_state`] written by `w` (plain or packed).
    fn shared_state_as(&self, mut w: BlobWriter) -> Result<Vec<u8>> {
        w.u32(layout_hash(&self.tensors))
            .str(&self.settings())
            .u64(self.step)
            .u64(self.applied)
            .u64(self.frags.len() as u64);
        for frag in &self.frags {
            w.f32s(&frag.outer).f32s(&frag.momentum);
            match &frag.flight {
                Flight::Idle => {
                    w.u8(0);
                }
                Flight::Done(bytes, messages) => {
                    let mean = frag.output.as_deref().ok_or_else(thread_gone)?;
                    w.u8(1).u64(*bytes).u64(*messages).f32s(mean);
                }
                Flight::Failed => {
                    w.u8(2).u64(frag.due);
                }
                Flight::Sent => {
                    return Err(Error::Collective(
                        "an all-reduce is in flight while healing".into(),
                    ));
                }
            }
        }
        w.try_finish()
    }

    /// Take the source's `state` from [`OuterSync::shared_state`] (checked whole before
    /// anything changes): the parameters become the outer copy, the residuals zero, and
    /// a failed all-reduce's pseudo-gradient zeros, sent without counting in the mean.
    fn take_shared_state(&mut self, state: &[u8], params: &mut [&mut [f32]]) -> Result<()> {
        let mut r = BlobReader::open(state, SHARED_MAGIC, "healing's state")?;
        r.u32_eq("layout hash (names and shapes)", layout_hash(&self.tensors))?;
        r.str_eq("settings", &self.settings())?;
        let (step, applied) = (r.u64()?, r.u64()?);
        r.u64_eq("fragment count", self.frags.len() as u64)?;
        struct Loaded {
            outer: Vec<f32>,
            momentum: Vec<f32>,
            flight: Flight,
            due: u64,
            mean: Option<Vec<f32>>,
        }
        let mut loaded = Vec::with_capacity(self.frags.len());
        for frag in &self.frags {
            let (outer, momentum) = frag.read_state(&mut r)?;
            let (flight, due, mean) = match r.u8()? {
                0 => (Flight::Idle, 0, None),
                1 => {
                    let (bytes, messages, mean) = frag.read_done(&mut r)?;
                    (Flight::Done(bytes, messages), 0, Some(mean))
                }
                2 => (Flight::Failed, r.u64()?, None),
                v => {
                    return Err(Error::Checkpoint(format!(
                        "healing's state: an all-reduce standing {v}, not 0, 1 or 2"
                    )));
                }
            };
            loaded.push(Loaded {
                outer,
                momentum,
                flight,
                due,
                mean,
            });
        }
        r.end()?;
        self.reset_feedback()?;
        for (frag, l) in self.frags.iter_mut().zip(loaded) {
            frag.outer = l.outer;
            frag.momentum = l.momentum;
            frag.flight = l.flight;
            frag.due = l.due;
            if let Some(mean) = l.mean {
                frag.output = Some(mean);
            }
            frag.own = !matches!(frag.flight, Flight::Failed);
            if !frag.own {
                frag.input.as_mut().ok_or_else(thread_gone)?.fill(0.0);
            }
            for &(i, off) in &frag.tensors {
                mix(&mut *params[i], &frag.outer[off..off + self.lens[i]], 0.0);
            }
        }
        self.step = step;
        self.applied = applied;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_reads_back_and_a_bad_one_names_its_sender() {
        let s = Status {
            step: 7,
            applied: 3,
            digest: 0xDEAD_BEEF,
            shared_len: 99,
            own: vec![true, false],
        };
        let b = s.write();
        let t = Status::read(&b, 2, 1).unwrap();
        assert_eq!(
            (t.step, t.applied, t.digest, t.shared_len),
            (7, 3, 0xDEAD_BEEF, 99)
        );
        assert_eq!(t.own, vec![true, false]);
        let e = Status::read(&b, 3, 1).unwrap_err().to_string();
        assert!(e.contains("rank 1") || e.contains("peer 1"), "{e}");
        let mut bad = b.clone();
        bad[STATUS_HEAD] = 2;
        assert!(Status::read(&bad, 2, 0).is_err());
    }

    #[test]
    fn the_digest_sees_every_byte_and_the_length() {
        let a = vec![5u8; 19];
        let d = digest(&a);
        for i in 0..a.len() {
            let mut b = a.clone();
            b[i] ^= 1;
            assert_ne!(digest(&b), d, "byte {i}");
        }
        assert_ne!(digest(&a[..18]), d);
        let mut longer = a.clone();
        longer.push(0);
        assert_ne!(digest(&longer), d);
    }
}
