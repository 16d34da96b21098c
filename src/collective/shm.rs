//! A [`Transport`] between the ranks of one host through shared memory
//! ([`SharedMemory`]), and [`Routed`], which sends another transport's messages between
//! ranks of one host that way and the rest as before.
//!
//! Ranks of one host that talk over TCP pay the kernel's copies through a socket on
//! every message; through shared memory a message costs two copies (into the ring and
//! out of it). That is what the two-level all-reduce ([`super::Hierarchical`]) assumes
//! of the link inside a node.
//!
//! ## How it works
//! Each rank owns one file, `gradpack-{name}-{rank}` under `/dev/shm` where that exists
//! (else the system's temporary directory, or the directory given), mapped by itself and
//! by the other ranks of its host. It holds a header and one ring per other rank of the
//! host, which that rank writes and the owner reads. A message is its length (8 bytes,
//! little-endian) and its bytes, streamed through the ring: a message longer than the
//! ring goes through in pieces as the reader empties it. Each ring has a write position
//! (published by the writer with a release store) and a read position (published by the
//! reader), each on a cache line of its own.
//!
//! - **Sends never wait for the reader** ([`Transport::send`]'s rule): what does not fit
//!   in the ring is copied to a queue that a thread of the transport writes as the
//!   reader makes room, in order behind anything already queued for that peer.
//!   Dropping the transport waits until that queue is delivered (or its reader has
//!   stalled past the timeout), so a message sent is never lost.
//! - **Receives wait** by spinning briefly, then yielding, then sleeping up to 50 us at a
//!   time, for at most the timeout ([`SharedMemoryOptions::timeout`]); a peer that sends
//!   nothing within it, or leaves a queued message unread that long, is an
//!   [`Error::Transport`] naming it.
//! - **A peer that is gone** is noticed sooner: each rank's thread bumps a heartbeat in
//!   its file every 50 ms while the transport lives, and a peer whose heartbeat stands
//!   still for 3 s (its process died, or dropped its transport) fails a receive from it
//!   or a send queued for it.
//! - **Set-up**: a rank makes its file under a temporary name, fills it (so a full
//!   file system is an error here, not a fault later) and publishes it under its name
//!   only if nothing has that name yet, so a peer never maps a half-made file and a
//!   second job using the same name fails here; then it maps every peer's file (of its
//!   own user and job, [`SharedMemoryOptions::job`]), waiting for each up to the
//!   timeout, and waits for every peer to have mapped its own. Then it removes its file's
//!   name: a made transport leaves nothing in the directory, a failed set-up removes what
//!   it made, and what a rank killed during set-up left is removed by the next set-up in
//!   the directory once that rank's process is gone.
//!
//! With a stage ([`SharedMemoryOptions::stage`]) each file also holds a region of f32
//! values through which the two-level all-reduce reduces inside a node in place
//! ([`Transport::node_memory`]), with barriers on words of the files' headers.
//!
//! The files are readable and writable by the job's user alone (mode 0600). The name
//! must be the same on every rank of the host and new for each set of transports (the PyTorch hook draws one at random on rank 0 and broadcasts it).
//! Memory: each rank maps `capacity` bytes per other rank of its host in its own file,
//! plus its stage. A job with many collectives (one per bucket of a model) shares one
//! transport among them with [`Routed::sharing`], so that this does not grow with the
//! number of buckets (a container's `/dev/shm` is often 64 MiB).

use std::collections::VecDeque;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::hold::{self, Point};
use super::{Transport, check_rank};
use crate::error::{Error, Result};
use crate::kernels::shm::Mapped;

/// "GPSHM" and the layout's version, 2.
const MAGIC: u64 = u64::from_le_bytes(*b"GPSHM\0\0\x02");
/// The header: magic, ring capacity, rings, peers that mapped the file, the owner's
/// heartbeat, the two-level all-reduce's words, the stage's size, the job, the owner's
/// process and when it was last seen alive.
const HEADER: usize = 128;
const OPENED_AT: usize = 24;
const BEAT_AT: usize = 32;
/// The two-level all-reduce's barrier word and failed-turn word, and the stage's size.
const BARRIER_AT: usize = 40;
const FAILED_AT: usize = 48;
const STAGE_AT: usize = 56;
/// The job's identity ([`SharedMemoryOptions::job`]), the owner's process id, and the
/// wall-clock time (milliseconds since the Unix epoch) at which the owner was last
/// alive: a file whose owner is gone and was last alive long ago is swept by the next
/// set-up in its directory.
const JOB_AT: usize = 64;
const PID_AT: usize = 72;
const ALIVE_AT: usize = 80;
/// How long after its owner was last alive the file of a dead process may be swept.
const SWEEP_AFTER: Duration = Duration::from_secs(10);
/// How often a rank's sending thread bumps its heartbeat, and how long a peer's may stand
/// still before a receive or a queued send gives up on it.
const BEAT: Duration = Duration::from_millis(50);
const SILENT: Duration = Duration::from_secs(3);
/// A ring's positions, a cache line each, before its data.
const RING_HEAD: usize = 128;
/// Bytes of the length in front of every message.
const LEN_BYTES: usize = 8;

/// Options of a [`SharedMemory`] transport. Every rank of a host must use the same
/// capacity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMemoryOptions {
    /// Bytes of each ring (a multiple of 64, from 64 bytes to 1 GiB; default 1 MiB).
    pub capacity: usize,
    /// How long a receive waits for a peer, set-up waits for a peer's file, and a queued
    /// send waits for its reader (default 300 s).
    pub timeout: Duration,
    /// Where the files go (default `/dev/shm` where it exists, else the system's
    /// temporary directory).
    pub dir: Option<PathBuf>,
    /// Bytes of this rank's stage: shared memory in which the two-level all-reduce
    /// ([`super::Hierarchical`]) reduces inside a node in place, in rounds of the stage's
    /// size, instead of sending float32 frames (a multiple of 64; default 0: none).
    pub stage: usize,
    /// The job's identity, the same on every rank of the host and different for every
    /// job that may use the same name at once (draw it at random on one rank and share
    /// it, as the PyTorch hook does). Each file records it, and a peer's file of another
    /// job is refused, so two jobs that chose one name fail at set-up instead of pairing
    /// their ranks. Default 0.
    pub job: u64,
}

impl Default for SharedMemoryOptions {
    fn default() -> Self {
        SharedMemoryOptions {
            capacity: 1 << 20,
            timeout: Duration::from_secs(300),
            dir: None,
            stage: 0,
            job: 0,
        }
    }
}

/// One direction between two ranks: a ring inside the reader's file.
#[derive(Debug, Clone)]
struct Ring {
    map: Arc<Mapped>,
    /// Offset of the ring's positions in the file.
    at: usize,
    capacity: usize,
}

impl Ring {
    fn positions(&self) -> (&std::sync::atomic::AtomicU64, &std::sync::atomic::AtomicU64) {
        (self.map.atomic(self.at), self.map.atomic(self.at + 64))
    }

    /// Write as much of `parts` (concatenated), from byte `done` on, as the ring has room
    /// for; returns the new `done`.
    fn push(&self, parts: [&[u8]; 2], mut done: usize) -> usize {
        let (write, read) = self.positions();
        let w = write.load(Ordering::Relaxed); // written by this side only
        let r = read.load(Ordering::Acquire);
        let used = usize::try_from(w.wrapping_sub(r)).unwrap_or(usize::MAX);
        let mut free = self.capacity.saturating_sub(used);
        let mut pos = w;
        let mut skip = done;
        for part in parts {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            let mut src = &part[skip..];
            skip = 0;
            while !src.is_empty() && free > 0 {
                let at = (pos % self.capacity as u64) as usize;
                let n = src.len().min(free).min(self.capacity - at);
                self.map.write(self.at + RING_HEAD + at, &src[..n]);
                src = &src[n..];
                free -= n;
                pos += n as u64;
                done += n;
            }
            if free == 0 {
                break;
            }
        }
        if pos != w {
            write.store(pos, Ordering::Release);
        }
        done
    }

    /// Read up to `out.len()` bytes that have arrived; returns how many.
    fn pop(&self, out: &mut [u8]) -> usize {
        let (write, read) = self.positions();
        let r = read.load(Ordering::Relaxed); // written by this side only
        let w = write.load(Ordering::Acquire);
        let avail = usize::try_from(w.wrapping_sub(r))
            .unwrap_or(usize::MAX)
            .min(self.capacity);
        let n = avail.min(out.len());
        let mut got = 0;
        let mut pos = r;
        while got < n {
            let at = (pos % self.capacity as u64) as usize;
            let k = (n - got).min(self.capacity - at);
            self.map
                .read(self.at + RING_HEAD + at, &mut out[got..got + k]);
            got += k;
            pos += k as u64;
        }
        if n > 0 {
            read.store(pos, Ordering::Release);
        }
        n
    }
}

/// Messages to one peer that did not fit in its ring yet.
#[derive(Debug)]
struct Outbox {
    ring: Ring,
    /// Whole framed messages (length and bytes), the front one partly written.
    queue: VecDeque<Vec<u8>>,
    /// Bytes of the front message already in the ring.
    front_done: usize,
    /// When the front message last made progress.
    since: Instant,
}

impl Outbox {
    /// Write what fits of the queue; returns whether anything was written.
    fn drain(&mut self) -> bool {
        let mut moved = false;
        while let Some(front) = self.queue.front() {
            let done = self.ring.push([front, &[]], self.front_done);
            if done > self.front_done {
                moved = true;
                self.since = Instant::now();
            }
            if done < front.len() {
                self.front_done = done;
                break;
            }
            self.queue.pop_front();
            self.front_done = 0;
        }
        moved
    }
}

/// What the transport shares with its sending thread.
#[derive(Debug)]
struct Shared {
    /// Per host rank (by position in the host's list); `None` for this rank.
    outboxes: Vec<Option<Mutex<Outbox>>>,
    /// Set when a queue got a message; the thread sleeps until then.
    work: Mutex<bool>,
    wake: Condvar,
    /// Set when the transport is dropped: the thread ends once its queues are empty (or
    /// their readers stalled past the timeout), so no message sent is lost.
    closing: AtomicBool,
    /// The first failure of a queued send: the peer and why.
    failed: Mutex<Option<(usize, String)>>,
    timeout: Duration,
    /// This rank's file, for its heartbeat.
    own: Arc<Mapped>,
}

/// Watches a peer's heartbeat while waiting for it.
#[derive(Debug)]
struct Pulse {
    last: u64,
    since: Instant,
}

impl Pulse {
    fn new(file: &Mapped) -> Pulse {
        Pulse {
            last: file.atomic(BEAT_AT).load(Ordering::Acquire),
            since: Instant::now(),
        }
    }

    /// Whether the heartbeat in `file` has stood still for [`SILENT`].
    fn silent(&mut self, file: &Mapped) -> bool {
        let now = file.atomic(BEAT_AT).load(Ordering::Acquire);
        if now != self.last {
            self.last = now;
            self.since = Instant::now();
        }
        self.since.elapsed() > SILENT
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave an outbox half-changed in a way that
    // matters more than the panic itself; keep going with the data.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// The sending thread: write queued messages as readers make room.
    fn run(&self, host: &[usize]) {
        let mut wait = Backoff::default();
        let mut beat = Instant::now();
        let mut pulses: Vec<Option<Pulse>> = self.outboxes.iter().map(|_| None).collect();
        loop {
            if beat.elapsed() >= BEAT {
                self.own.atomic(BEAT_AT).fetch_add(1, Ordering::AcqRel);
                alive(&self.own);
                beat = Instant::now();
            }
            let mut pending = false;
            let mut moved = false;
            for (i, ob) in self.outboxes.iter().enumerate() {
                let Some(ob) = ob else { continue };
                let mut ob = lock(ob);
                let progressed = ob.drain();
                moved |= progressed;
                if ob.queue.is_empty() || progressed {
                    pulses[i] = None;
                    continue;
                }
                pending = true;
                let map = ob.ring.map.clone();
                let gone = pulses[i]
                    .get_or_insert_with(|| Pulse::new(&map))
                    .silent(&map);
                if gone || ob.since.elapsed() > self.timeout {
                    let why = if gone {
                        format!("stopped (no heartbeat for {SILENT:?}) with a message unread")
                    } else {
                        format!(
                            "did not read a message through shared memory within {:?}",
                            self.timeout
                        )
                    };
                    lock(&self.failed).get_or_insert((host[i], why));
                    ob.queue.clear();
                    ob.front_done = 0;
                    pulses[i] = None;
                }
            }
            if moved {
                wait = Backoff::default();
            } else if !pending && self.closing.load(Ordering::Acquire) {
                return;
            } else if pending {
                wait.snooze();
            } else {
                let mut work = lock(&self.work);
                while !*work && !self.closing.load(Ordering::Acquire) {
                    if beat.elapsed() >= BEAT {
                        break;
                    }
                    work = self
                        .wake
                        .wait_timeout(work, BEAT)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                *work = false;
                wait = Backoff::default();
            }
        }
    }
}

/// Waiting for a peer: a short spin, then yields, then sleeps of up to 50 us.
#[derive(Debug, Default)]
struct Backoff(u32);

impl Backoff {
    fn snooze(&mut self) {
        if self.0 < 64 {
            for _ in 0..(1u32 << (self.0 / 8)) {
                std::hint::spin_loop();
            }
        } else if self.0 < 96 {
            std::thread::yield_now();
        } else {
            let us = (self.0 - 95).min(50) as u64;
            std::thread::sleep(Duration::from_micros(us));
        }
        self.0 = self.0.saturating_add(1);
    }
}

/// Waiting on one peer: backs off, and gives up after the timeout or once the peer's
/// heartbeat has stood still for [`SILENT`].
struct Waiter<'a> {
    file: &'a Mapped,
    peer: usize,
    timeout: Duration,
    backoff: Backoff,
    since: Option<(Instant, Pulse)>,
}

impl<'a> Waiter<'a> {
    fn new(file: &'a Mapped, peer: usize, timeout: Duration) -> Waiter<'a> {
        Waiter {
            file,
            peer,
            timeout,
            backoff: Backoff::default(),
            since: None,
        }
    }

    /// The peer made progress: wait afresh.
    fn progressed(&mut self) {
        self.backoff = Backoff::default();
        self.since = None;
    }

    /// Nothing yet: back off once, or fail naming the peer (`what` it did not do within
    /// the timeout).
    fn idle(&mut self, what: &str) -> Result<()> {
        let (t0, pulse) = self
            .since
            .get_or_insert_with(|| (Instant::now(), Pulse::new(self.file)));
        let reason = if t0.elapsed() > self.timeout {
            format!("{what} through shared memory within {:?}", self.timeout)
        } else if self.backoff.0 > 200 && pulse.silent(self.file) {
            format!("stopped: no heartbeat through shared memory for {SILENT:?}")
        } else {
            self.backoff.snooze();
            return Ok(());
        };
        Err(Error::Transport {
            peer: self.peer,
            reason,
        })
    }
}

/// The stages of a host's ranks: what the two-level all-reduce reduces through inside a
/// node when its transport offers it ([`Transport::node_memory`]). It has no public
/// methods; [`SharedMemory::node_memory`] hands it out.
#[derive(Debug, Clone)]
pub struct NodeMemory {
    host: Arc<[usize]>,
    me: usize,
    /// Every host rank's file, this one's included, by place in `host`.
    files: Arc<[Arc<Mapped>]>,
    /// Offset and bytes of the stage in each file.
    at: usize,
    len: usize,
    timeout: Duration,
    /// Turns of the stages taken so far, on this rank (every user of one
    /// [`SharedMemory`] draws from it, so that two-level all-reduces sharing it number
    /// their barriers as one sequence).
    calls: Arc<AtomicU64>,
    /// One more than the turn this rank last gave up on while peers may still read its
    /// stage for it; 0 when none ([`NodeMemory::enter`] settles it).
    unsettled: Arc<AtomicU64>,
}

/// Bits of a barrier word below the turn: the barrier's index plus one, or all ones for
/// a turn given up.
const INDEX_BITS: u32 = 24;
const GAVE_UP: u64 = (1 << INDEX_BITS) - 1;

/// Barriers one turn of the stages may hold (their words stay below a turn's
/// given-up word).
pub(crate) const MAX_BARRIERS: usize = (1 << INDEX_BITS) - 3;

/// The barrier word of barrier `i` of turn `turn`: above zero, rising through a turn and
/// from one turn to the next.
fn generation(turn: u64, i: u32) -> u64 {
    ((turn + 1) << INDEX_BITS) + u64::from(i) + 1
}

/// The barrier word of a rank that gave up on turn `turn`: above every barrier of that
/// turn, below the next turn's first.
fn gave_up(turn: u64) -> u64 {
    ((turn + 1) << INDEX_BITS) + GAVE_UP
}

impl NodeMemory {
    /// The number of this turn of the stages: 0, 1, ... on every rank of the node, which
    /// take their turns in the same order (a call refused for a bad argument takes its
    /// turn too, and gives it up).
    pub(crate) fn begin(&self) -> u64 {
        self.calls.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether every one of `ranks` is on this host.
    pub(crate) fn covers(&self, ranks: &[usize]) -> bool {
        ranks.iter().all(|r| self.host.binary_search(r).is_ok())
    }

    /// f32 values a stage holds.
    pub(crate) fn stage_elems(&self) -> usize {
        self.len / 4
    }

    /// This rank's global rank.
    pub(crate) fn rank(&self) -> usize {
        self.host[self.me]
    }

    fn file(&self, rank: usize) -> &Mapped {
        let j = self
            .host
            .binary_search(&rank)
            .expect("a rank of the host (checked by covers)");
        &self.files[j]
    }

    /// Write `x` into this rank's stage at element `at`.
    pub(crate) fn write(&self, at: usize, x: &[f32]) {
        assert!((at + x.len()) * 4 <= self.len, "inside the stage");
        self.files[self.me].write(self.at + 4 * at, bytemuck::cast_slice(x));
    }

    /// Copy (or add, with `add`) the values at element `at` of `rank`'s stage into `out`;
    /// `held`: the call and index for the `stage-copy` hold point (fault-injection tests),
    /// which splits the copy in two.
    pub(crate) fn read(
        &self,
        rank: usize,
        at: usize,
        out: &mut [f32],
        add: bool,
        held: (u64, u64),
    ) {
        assert!((at + out.len()) * 4 <= self.len, "inside the stage");
        let file = self.file(rank);
        if hold::any() {
            let half = out.len() / 2;
            let (a, b) = out.split_at_mut(half);
            file.read_f32(self.at + 4 * at, a, add);
            hold::at(self.rank(), Point::StageCopy, held.0, held.1);
            file.read_f32(self.at + 4 * (at + half), b, add);
        } else {
            file.read_f32(self.at + 4 * at, out, add);
        }
    }

    /// Record that this rank gave up on turn `turn`: its failed-turn word rises to
    /// `turn + 1`, and its barrier word becomes the turn's given-up word, unless an
    /// earlier turn it gave up on is still unsettled (peers may still read that turn's
    /// stage, and must see that it gave up on it).
    pub(crate) fn fail(&self, turn: u64) {
        let own = &self.files[self.me];
        own.atomic(FAILED_AT).fetch_max(turn + 1, Ordering::AcqRel);
        if self.unsettled.load(Ordering::Acquire) == 0 {
            own.atomic(BARRIER_AT)
                .fetch_max(gave_up(turn), Ordering::AcqRel);
            self.unsettled.store(turn + 1, Ordering::Release);
        }
    }

    /// Start turn `turn` among `ranks` (this one among them), before this rank writes its
    /// stage. After a turn this rank gave up on, wait until every peer has left that turn
    /// (given it up too, or gone on to a later one), so that nothing this rank writes now
    /// can reach a peer still copying from the turn it gave up; fails like a barrier.
    pub(crate) fn enter(&self, ranks: &[usize], turn: u64) -> Result<()> {
        let u = self.unsettled.load(Ordering::Acquire);
        if u == 0 {
            return Ok(());
        }
        let left = gave_up(u - 1);
        let me = self.rank();
        for &r in ranks.iter().filter(|&&r| r != me) {
            let f = self.file(r);
            let mut wait = Waiter::new(f, r, self.timeout);
            while f.atomic(BARRIER_AT).load(Ordering::Acquire) < left
                && f.atomic(FAILED_AT).load(Ordering::Acquire) < u
            {
                wait.idle(&format!(
                    "did not leave turn {} of the node's stages (before turn {turn})",
                    u - 1
                ))?;
            }
        }
        self.unsettled.store(0, Ordering::Release);
        Ok(())
    }

    /// Barrier `i` of turn `turn` among the ranks `ranks` of the node (this one among
    /// them); `last`: the turn's last. Stores this rank's word, then waits for every peer
    /// to reach it. A peer seen at this barrier or the next (after the last one: in any
    /// later turn) is through; one seen past it otherwise (it gave up on the turn), or
    /// short of it with its failed-turn word at `turn + 1` or above, is an error naming
    /// it; so is one whose heartbeat stops, or that does not come within the timeout.
    pub(crate) fn barrier(&self, ranks: &[usize], turn: u64, i: u32, last: bool) -> Result<()> {
        let g = generation(turn, i);
        let own = &self.files[self.me];
        own.atomic(BARRIER_AT).store(g, Ordering::Release);
        let me = self.rank();
        for &r in ranks.iter().filter(|&&r| r != me) {
            let f = self.file(r);
            let mut wait = Waiter::new(f, r, self.timeout);
            loop {
                let w = f.atomic(BARRIER_AT).load(Ordering::Acquire);
                if w >= g {
                    let through = w == g || w == g + 1 || (last && w >= generation(turn + 1, 0));
                    if !through {
                        return Err(gave_up_on(r, turn));
                    }
                    break;
                }
                if f.atomic(FAILED_AT).load(Ordering::Acquire) > turn {
                    return Err(gave_up_on(r, turn));
                }
                wait.idle("did not reach the node's barrier")?;
            }
        }
        Ok(())
    }
}

fn gave_up_on(peer: usize, turn: u64) -> Error {
    Error::Transport {
        peer,
        reason: format!(
            "gave up on turn {turn} of the two-level all-reduce's stages inside the node"
        ),
    }
}

/// A [`Transport`] between ranks of one host through shared memory (see the module
/// docs). It serves the ranks of its host only: a message to any other rank is an
/// error; [`Routed`] combines it with a transport for the rest.
#[derive(Debug)]
pub struct SharedMemory {
    rank: usize,
    size: usize,
    /// The ranks of this host, ascending, this one among them.
    host: Vec<usize>,
    me: usize,
    inbox: Vec<Option<Ring>>,
    /// Every other host rank's file, for its heartbeat.
    peers: Vec<Option<Arc<Mapped>>>,
    /// The stages, when the options give one.
    memory: Option<NodeMemory>,
    /// Per host rank: bytes of a refused message from it still to pass over.
    skip: Vec<AtomicU64>,
    shared: Arc<Shared>,
    sender: Option<JoinHandle<()>>,
}

impl SharedMemory {
    /// Rank `rank` of a world of `size`, sharing memory with the ranks `host` (this
    /// host's ranks, this one among them) through files called `name` (letters, digits,
    /// `-` and `_`; the same on every rank of the host, and new for each set of
    /// transports). Waits up to the timeout for every peer's file.
    pub fn open(
        name: &str,
        rank: usize,
        size: usize,
        host: &[usize],
        options: SharedMemoryOptions,
    ) -> Result<SharedMemory> {
        let bad = |why: String| Err(Error::Collective(format!("shared memory: {why}")));
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return bad(format!(
                "name {name:?}: 1 to 64 letters, digits, '-' or '_'"
            ));
        }
        check_rank(rank, size)?;
        let mut ranks = host.to_vec();
        ranks.sort_unstable();
        ranks.dedup();
        if ranks.len() != host.len() {
            return bad("the host's ranks repeat a rank".into());
        }
        for &r in &ranks {
            check_rank(r, size)?;
        }
        let Some(me) = ranks.iter().position(|&r| r == rank) else {
            return bad(format!(
                "rank {rank} is not among the host's ranks {ranks:?}"
            ));
        };
        let cap = options.capacity;
        if !(64..=1 << 30).contains(&cap) || !cap.is_multiple_of(64) {
            return bad(format!(
                "capacity {cap}: a multiple of 64 bytes from 64 bytes to 1 GiB"
            ));
        }
        let stage = options.stage;
        if stage as u64 > 1 << 34 || !stage.is_multiple_of(64) {
            return bad(format!(
                "stage {stage}: a multiple of 64 bytes up to 16 GiB"
            ));
        }
        let dir = match &options.dir {
            Some(d) => d.clone(),
            None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
            None => std::env::temp_dir(),
        };
        let file_of = |r: usize| dir.join(format!("gradpack-{name}-{r}"));
        let rings = ranks.len() - 1;
        let stage_at = HEADER + rings * (RING_HEAD + cap);
        let len = stage_at + stage;
        let path = file_of(rank);
        let own = Arc::new(create(&path, len, [cap, rings, stage], options.job)?);
        let uid = owner(&path);
        // The ring from host rank j sits at slot j, less one past this rank.
        let slot = |reader: usize, writer: usize| {
            HEADER + (writer - usize::from(writer > reader)) * (RING_HEAD + cap)
        };
        let inbox = (0..ranks.len())
            .map(|j| {
                (j != me).then(|| Ring {
                    map: own.clone(),
                    at: slot(me, j),
                    capacity: cap,
                })
            })
            .collect();
        let mut outboxes = Vec::with_capacity(ranks.len());
        let mut peers = Vec::with_capacity(ranks.len());
        for (j, &r) in ranks.iter().enumerate() {
            if j == me {
                outboxes.push(None);
                peers.push(None);
                continue;
            }
            let want = [cap, rings, stage];
            let expect = Expect {
                len,
                fields: want,
                job: options.job,
                uid,
            };
            let map = match open_peer(&file_of(r), r, &expect, &own, options.timeout) {
                Ok(m) => Arc::new(m),
                Err(e) => {
                    let _ = fs::remove_file(&path);
                    return Err(e);
                }
            };
            map.atomic(OPENED_AT).fetch_add(1, Ordering::AcqRel);
            peers.push(Some(map.clone()));
            outboxes.push(Some(Mutex::new(Outbox {
                ring: Ring {
                    map,
                    at: slot(j, me),
                    capacity: cap,
                },
                queue: VecDeque::new(),
                front_done: 0,
                since: Instant::now(),
            })));
        }
        // Every peer maps this file before any rank goes on, so a rank that leaves at
        // once cannot take its file's name away from a peer still looking for it; then
        // the name goes.
        let start = Instant::now();
        let mut wait = Backoff(96);
        while own.atomic(OPENED_AT).load(Ordering::Acquire) < rings as u64 {
            alive(&own);
            if start.elapsed() > options.timeout {
                let _ = fs::remove_file(&path);
                return bad(format!(
                    "the host's other ranks did not all map this rank's file within {:?}",
                    options.timeout
                ));
            }
            wait.snooze();
        }
        let _ = fs::remove_file(&path);
        let shared = Arc::new(Shared {
            outboxes,
            work: Mutex::new(false),
            wake: Condvar::new(),
            closing: AtomicBool::new(false),
            failed: Mutex::new(None),
            timeout: options.timeout,
            own: own.clone(),
        });
        let sender = if rings > 0 {
            let (s, h) = (shared.clone(), ranks.clone());
            Some(
                std::thread::Builder::new()
                    .name(format!("gradpack-shm-{rank}"))
                    .spawn(move || s.run(&h))
                    .map_err(|e| {
                        let _ = fs::remove_file(&path);
                        Error::Collective(format!("shared memory: no sending thread: {e}"))
                    })?,
            )
        } else {
            None
        };
        let memory = (stage > 0).then(|| NodeMemory {
            host: ranks.clone().into(),
            me,
            files: peers
                .iter()
                .map(|p| p.clone().unwrap_or_else(|| own.clone()))
                .collect(),
            at: stage_at,
            len: stage,
            timeout: options.timeout,
            calls: Arc::new(AtomicU64::new(0)),
            unsettled: Arc::new(AtomicU64::new(0)),
        });
        Ok(SharedMemory {
            rank,
            size,
            skip: ranks.iter().map(|_| AtomicU64::new(0)).collect(),
            host: ranks,
            me,
            inbox,
            peers,
            memory,
            shared,
            sender,
        })
    }

    /// Whether messages to `rank` go through shared memory (a rank of this host other
    /// than this one).
    pub fn serves(&self, rank: usize) -> bool {
        rank != self.rank && self.host.binary_search(&rank).is_ok()
    }

    /// The ranks of this host, ascending.
    pub fn host(&self) -> &[usize] {
        &self.host
    }

    /// The stages of the host's ranks, when made with one
    /// ([`SharedMemoryOptions::stage`]).
    pub fn node_memory(&self) -> Option<NodeMemory> {
        self.memory.clone()
    }

    fn index(&self, peer: usize) -> Result<usize> {
        check_rank(peer, self.size)?;
        match self.host.binary_search(&peer) {
            Ok(j) if j != self.me => Ok(j),
            _ => Err(Error::Transport {
                peer,
                reason: format!(
                    "not a peer through shared memory (this host's ranks: {:?}, this one {})",
                    self.host, self.rank
                ),
            }),
        }
    }

    fn check_failed(&self) -> Result<()> {
        match lock(&self.shared.failed).as_ref() {
            Some((peer, reason)) => Err(Error::Transport {
                peer: *peer,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// The ring from host rank `j` and that rank's file (for its heartbeat).
    fn channel(&self, j: usize) -> (&Ring, &Mapped) {
        let ring = self.inbox[j]
            .as_ref()
            .expect("a ring from every other host rank");
        let file = self.peers[j]
            .as_ref()
            .expect("the file of every other host rank");
        (ring, file)
    }

    /// Fill `out` from the ring from host rank `j` (global rank `peer`).
    fn read_exact(&self, j: usize, peer: usize, out: &mut [u8]) -> Result<()> {
        let (ring, file) = self.channel(j);
        let mut got = 0;
        let mut wait = Waiter::new(file, peer, self.shared.timeout);
        while got < out.len() {
            let n = ring.pop(&mut out[got..]);
            got += n;
            if n > 0 {
                wait.progressed();
            } else {
                wait.idle("sent nothing")?;
            }
        }
        Ok(())
    }
}

impl Transport for SharedMemory {
    fn rank(&self) -> usize {
        self.rank
    }

    fn node_memory(&self) -> Option<NodeMemory> {
        self.memory.clone()
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        self.deliver(msg, to)
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        self.take(buf, from, max)
    }
}

impl SharedMemory {
    /// [`Transport::send`] through a shared reference.
    fn deliver(&self, msg: &[u8], to: usize) -> Result<()> {
        let j = self.index(to)?;
        self.check_failed()?;
        let head = (msg.len() as u64).to_le_bytes();
        let total = LEN_BYTES + msg.len();
        let ob = self.shared.outboxes[j]
            .as_ref()
            .expect("an outbox to every other host rank");
        let mut ob = lock(ob);
        let done = if ob.queue.is_empty() {
            ob.ring.push([&head, msg], 0)
        } else {
            0
        };
        if done == total {
            return Ok(());
        }
        let mut rest = Vec::new();
        rest.try_reserve_exact(total - done)
            .map_err(|_| Error::OutOfMemory {
                bytes: (total - done) as u64,
                what: "a message queued for shared memory",
            })?;
        rest.extend_from_slice(&head[done.min(LEN_BYTES)..]);
        rest.extend_from_slice(&msg[done.saturating_sub(LEN_BYTES)..]);
        if ob.queue.is_empty() {
            ob.front_done = 0;
            ob.since = Instant::now();
        }
        ob.queue.push_back(rest);
        drop(ob);
        *lock(&self.shared.work) = true;
        self.shared.wake.notify_one();
        Ok(())
    }

    /// [`Transport::recv`] through a shared reference. A length above `max` is refused
    /// before anything is allocated for it; the message's bytes are passed over before
    /// the next message from that peer.
    fn take(&self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        let j = self.index(from)?;
        self.pass_over(j, from)?;
        let mut head = [0u8; LEN_BYTES];
        self.read_exact(j, from, &mut head)?;
        let claim = u64::from_le_bytes(head);
        if claim > max as u64 {
            self.skip[j].store(claim, Ordering::Relaxed);
            return Err(super::too_long(from, claim, max));
        }
        let len = claim as usize;
        if buf.len() < len {
            crate::alloc::lengthen(buf, len, "a message received through shared memory")?;
        } else {
            buf.truncate(len);
        }
        self.read_exact(j, from, buf)
    }

    /// Read and drop what is left of a refused message from host rank `j` (global rank
    /// `peer`), waiting for it as a receive would.
    fn pass_over(&self, j: usize, peer: usize) -> Result<()> {
        let left = &self.skip[j];
        if left.load(Ordering::Relaxed) == 0 {
            return Ok(());
        }
        let (ring, file) = self.channel(j);
        let mut scratch = [0u8; 4096];
        let mut wait = Waiter::new(file, peer, self.shared.timeout);
        loop {
            let n = left.load(Ordering::Relaxed);
            if n == 0 {
                return Ok(());
            }
            let got = ring.pop(&mut scratch[..n.min(4096) as usize]);
            if got > 0 {
                left.store(n - got as u64, Ordering::Relaxed);
                wait.progressed();
            } else {
                wait.idle("did not send the rest of a refused message")?;
            }
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // Deliver what is queued first (a send has completed for its caller).
        self.shared.closing.store(true, Ordering::Release);
        *lock(&self.shared.work) = true;
        self.shared.wake.notify_one();
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
    }
}

/// Make this rank's file: under a temporary name of this process, filled, its header
/// written, then published under `path` only if nothing has that name (a hard link,
/// which fails on an existing name, where a rename would replace it).
fn create(path: &Path, len: usize, fields: [usize; 3], job: u64) -> Result<Mapped> {
    let io = |what: &str, e: std::io::Error| {
        Error::Collective(format!("shared memory: {what} {}: {e}", path.display()))
    };
    let tmp = path.with_extension(format!("making-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create_new(true);
    // Gradients are the job's own: readable and writable by its user alone.
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(&tmp).map_err(|e| io("cannot create", e))?;
    // Write every byte, so a full file system is an error now, not a fault later.
    let zeros = vec![0u8; 1 << 16];
    let mut left = len;
    while left > 0 {
        let n = left.min(zeros.len());
        if let Err(e) = f.write_all(&zeros[..n]) {
            let _ = fs::remove_file(&tmp);
            return Err(io(&format!("cannot fill {len} bytes of"), e));
        }
        left -= n;
    }
    let map = match Mapped::new(&f) {
        Ok(m) => m,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(io("cannot map", e));
        }
    };
    let [cap, rings, stage] = fields;
    map.atomic(8).store(cap as u64, Ordering::Relaxed);
    map.atomic(16).store(rings as u64, Ordering::Relaxed);
    map.atomic(STAGE_AT).store(stage as u64, Ordering::Relaxed);
    map.atomic(JOB_AT).store(job, Ordering::Relaxed);
    map.atomic(PID_AT)
        .store(u64::from(std::process::id()), Ordering::Relaxed);
    alive(&map);
    map.atomic(0).store(MAGIC, Ordering::Release);
    // Files that dead set-ups left in the directory go first (one of them may hold this
    // very name).
    if let Some(dir) = path.parent() {
        sweep(dir, owner(&tmp));
    }
    let published = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match published {
        Ok(()) => Ok(map),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(Error::Collective(format!(
            "shared memory: {} exists already: another job on this host uses the same name \
             (give every job a name of its own), or one still setting up",
            path.display()
        ))),
        Err(e) => Err(io("cannot publish", e)),
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Record in `file` that its owner is alive now.
fn alive(file: &Mapped) {
    file.atomic(ALIVE_AT).store(now_ms(), Ordering::Relaxed);
}

/// Whether process `pid` of this host is gone: `/proc/PID` is missing while `/proc`
/// itself is there (elsewhere nothing is taken to be gone).
fn process_gone(pid: u64) -> bool {
    Path::new("/proc/self").exists() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Remove the files in `dir` that set-ups of dead processes left behind (a rank killed
/// while it set up): the `gradpack-*` files of user `uid` whose owner's process is gone
/// and was last alive more than [`SWEEP_AFTER`] ago, and temporary files of processes
/// that are gone. Files of the earlier layout, or that cannot be read, are left alone.
fn sweep(dir: &Path, uid: Option<u32>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("gradpack-") {
            continue;
        }
        let path = e.path();
        if let Some((_, pid)) = name.rsplit_once(".making-") {
            if pid.parse().is_ok_and(process_gone) {
                let _ = fs::remove_file(&path);
            }
            continue;
        }
        if owner(&path) == uid && stale(&path) {
            let _ = fs::remove_file(&path);
        }
    }
}

/// Whether the owner of the shared-memory file at `path` is gone.
fn stale(path: &Path) -> bool {
    use std::io::Read;
    let Ok(mut f) = fs::File::open(path) else {
        return false;
    };
    let mut head = [0u8; HEADER];
    if f.read_exact(&mut head).is_err() {
        return false;
    }
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    if word(0) != MAGIC {
        return false;
    }
    process_gone(word(PID_AT))
        && now_ms().saturating_sub(word(ALIVE_AT)) > SWEEP_AFTER.as_millis() as u64
}

/// The user that owns the file at `path` (`None` where the platform has no such notion).
fn owner(path: &Path) -> Option<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(path).ok().map(|m| m.uid())
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// What a peer's file must be: its length, its capacity, rings and stage, its job, and
/// its owner (this rank's user).
struct Expect {
    len: usize,
    fields: [usize; 3],
    job: u64,
    uid: Option<u32>,
}

/// Map a peer's file, waiting up to `timeout` for it to appear (`own`, this rank's
/// file, records meanwhile that its owner is alive).
fn open_peer(
    path: &Path,
    peer: usize,
    want: &Expect,
    own: &Mapped,
    timeout: Duration,
) -> Result<Mapped> {
    let [cap, rings, stage] = want.fields;
    let refuse = |reason: String| Err(Error::Transport { peer, reason });
    let start = Instant::now();
    let mut wait = Backoff(96);
    loop {
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => {
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                if size != want.len as u64 {
                    return refuse(format!(
                        "its shared-memory file {} has {size} bytes, expected {} (another \
                         capacity or host size?)",
                        path.display(),
                        want.len
                    ));
                }
                if owner(path) != want.uid {
                    return refuse(format!(
                        "its shared-memory file {} belongs to another user",
                        path.display()
                    ));
                }
                let map = Mapped::new(&f).map_err(|e| Error::Transport {
                    peer,
                    reason: format!("cannot map {}: {e}", path.display()),
                })?;
                let got = [
                    map.atomic(0).load(Ordering::Acquire),
                    map.atomic(8).load(Ordering::Relaxed),
                    map.atomic(16).load(Ordering::Relaxed),
                    map.atomic(STAGE_AT).load(Ordering::Relaxed),
                ];
                if got != [MAGIC, cap as u64, rings as u64, stage as u64] {
                    return refuse(format!(
                        "its shared-memory file {} is not a ring file of capacity {cap} with \
                         {rings} rings and a stage of {stage} bytes",
                        path.display()
                    ));
                }
                let job = map.atomic(JOB_AT).load(Ordering::Relaxed);
                if job != want.job {
                    return refuse(format!(
                        "its shared-memory file {} belongs to job {job:#x}, this rank's is \
                         {:#x}: two jobs use the same name",
                        path.display(),
                        want.job
                    ));
                }
                return Ok(map);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                alive(own);
                if start.elapsed() > timeout {
                    return refuse(format!(
                        "made no shared-memory file {} within {timeout:?}",
                        path.display()
                    ));
                }
                wait.snooze();
                if wait.0 > 1000 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Err(e) => {
                return refuse(format!("cannot open {}: {e}", path.display()));
            }
        }
    }
}

/// A transport whose messages between ranks of one host go through [`SharedMemory`],
/// and all others through `T`. Without shared memory it is `T` itself.
///
/// Several `Routed` transports may share one [`SharedMemory`] ([`Routed::sharing`]), so
/// that a job's many collectives (one per bucket of a model) map one set of rings and
/// one stage instead of one each. They must then run one at a time, in the same order on
/// every rank of the host: a collective takes its messages from the shared rings in the
/// order they come.
#[derive(Debug)]
pub struct Routed<T> {
    base: T,
    host: Option<Arc<SharedMemory>>,
}

impl<T: Transport> Routed<T> {
    /// `base`, with `host`'s ranks reached through shared memory. Both must be the same
    /// rank of worlds of the same size.
    pub fn new(base: T, host: Option<SharedMemory>) -> Result<Routed<T>> {
        Routed::sharing(base, host.map(Arc::new))
    }

    /// [`Routed::new`] with shared memory that other transports may use too (one at a
    /// time: see the type's docs).
    pub fn sharing(base: T, host: Option<Arc<SharedMemory>>) -> Result<Routed<T>> {
        if let Some(h) = &host
            && (h.rank() != base.rank() || h.size() != base.size())
        {
            return Err(Error::Collective(format!(
                "shared memory is rank {} of {}, the transport rank {} of {}",
                h.rank(),
                h.size(),
                base.rank(),
                base.size()
            )));
        }
        Ok(Routed { base, host })
    }

    /// The transport for the ranks outside the host.
    pub fn base(&self) -> &T {
        &self.base
    }

    /// The shared memory between the ranks of this host, if any.
    pub fn host(&self) -> Option<&SharedMemory> {
        self.host.as_deref()
    }

    /// Whether neither `a` nor `b` is reached through this host's shared memory (an
    /// exchange with them goes to the base transport whole).
    fn remote(&self, a: usize, b: usize) -> bool {
        let local = |r| self.host.as_ref().is_some_and(|h| h.serves(r));
        !local(a) && !local(b)
    }
}

impl<T: Transport> Transport for Routed<T> {
    fn rank(&self) -> usize {
        self.base.rank()
    }

    fn node_memory(&self) -> Option<NodeMemory> {
        self.host.as_deref().and_then(SharedMemory::node_memory)
    }

    fn flush(&mut self) -> Result<()> {
        self.base.flush()
    }

    fn size(&self) -> usize {
        self.base.size()
    }

    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        match &self.host {
            Some(h) if h.serves(to) => h.deliver(msg, to),
            _ => self.base.send(msg, to),
        }
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        match &self.host {
            Some(h) if h.serves(from) => h.take(buf, from, max),
            _ => self.base.recv(buf, from, max),
        }
    }

    fn send_recv(
        &mut self,
        send: &[u8],
        to: usize,
        recv: &mut Vec<u8>,
        from: usize,
        max: usize,
    ) -> Result<()> {
        if self.remote(to, from) {
            return self.base.send_recv(send, to, recv, from, max);
        }
        self.send(send, to)?;
        self.recv(recv, from, max)
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
        if self.remote(to, from) {
            return self.base.send_recv_len(send, to, recv, from, len, max);
        }
        self.send_recv(send, to, recv, from, max)
    }
}
