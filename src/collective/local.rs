//! An in-process [`Transport`]: one thread per rank, joined by channels. For tests,
//! simulation and benchmarks of the collectives on one machine (world sizes 1 to a few
//! dozen).
//!
//! Every ordered pair of ranks has its own FIFO channel, so messages between two ranks
//! arrive in the order they were sent, as MPI guarantees. Sends never block (the channels
//! are unbounded). A buffer received is handed back to its sender for the next message,
//! so a steady-state collective allocates nothing per message.
//!
//! Faults become errors instead of hangs: a receive fails once the transport's timeout
//! ([`DEFAULT_TIMEOUT`] unless set) has passed with no message sent or received anywhere
//! in the world, and a peer whose transport was dropped (its thread returned or
//! panicked) is reported at once. So a peer that is slow because the machine is busy
//! (its world still moves messages, however slowly) is waited for, and one that has
//! stopped (every other rank ends up waiting) is an error within the timeout.
//!
//! **A link simulator** ([`Link`], [`Local::set_link`]): each directed link from this
//! rank carries one message at a time at the link's bandwidth, and a message is received
//! no earlier than its last byte left plus the latency. The sender does not wait (as
//! with a network card's send queue), so compute overlaps transfers as it would on a
//! real network; the receiver waits until the message has arrived. With it, overlap and
//! pipelining are measured, and the cost model checked, without a network.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use super::{Comm, Transport, check_rank};
use crate::error::{Error, Result};

/// How long a receive waits for a message before it fails, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A simulated link (see the module docs): every directed link between two ranks has
/// this bandwidth and latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bits per second.
    pub bandwidth_bit_s: f64,
    /// One-way latency of a message.
    pub latency: Duration,
}

impl Link {
    /// How long the link is busy with a message of `bytes` bytes.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 * 8.0 / self.bandwidth_bit_s)
    }
}

/// A message and, on a simulated link, when it arrives.
type Msg = (Option<Instant>, Vec<u8>);

/// One rank's end of an in-process world (see the module docs). Build a world with
/// [`Local::world`], or run a closure on every rank with [`run`].
#[derive(Debug)]
pub struct Local {
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    link: Option<Link>,
    /// When each outgoing link finishes sending what it was given.
    busy_until: Vec<Instant>,
    /// `to[q]`: messages to rank q; `back_to[q]`: buffers given back to rank q.
    to: Vec<Sender<Msg>>,
    back_to: Vec<Sender<Vec<u8>>>,
    /// `from[q]`: messages from rank q; `back_from[q]`: buffers rank q gave back.
    from: Vec<Receiver<Msg>>,
    back_from: Vec<Receiver<Vec<u8>>>,
    /// Messages sent and received in the whole world so far: what a receive watches to
    /// tell a slow world from a stuck one.
    moves: Arc<AtomicU64>,
}

impl Local {
    /// The `size` ranks of a new world, in rank order, each with [`DEFAULT_TIMEOUT`].
    /// Move each to its own thread.
    pub fn world(size: usize) -> Vec<Local> {
        let moves = Arc::new(AtomicU64::new(0));
        let mut ranks: Vec<Local> = (0..size)
            .map(|rank| Local {
                rank,
                size,
                timeout: Some(DEFAULT_TIMEOUT),
                link: None,
                busy_until: vec![Instant::now(); size],
                to: Vec::with_capacity(size),
                back_to: Vec::with_capacity(size),
                from: Vec::with_capacity(size),
                back_from: Vec::with_capacity(size),
                moves: moves.clone(),
            })
            .collect();
        // Pushing in (s, d) order fills ranks[s].to[d] and ranks[d].from[s] alike.
        for s in 0..size {
            for d in 0..size {
                let (tx, rx) = mpsc::channel();
                ranks[s].to.push(tx);
                ranks[d].from.push(rx);
                let (btx, brx) = mpsc::channel();
                ranks[d].back_to.push(btx);
                ranks[s].back_from.push(brx);
            }
        }
        ranks
    }

    /// How long a receive waits with no message moving in the world before failing
    /// (`None`: forever).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Set how long a receive waits with no message moving in the world before failing
    /// (`None`: forever).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// The simulated link this rank sends over (`None`: memory speed).
    pub fn link(&self) -> Option<Link> {
        self.link
    }

    /// Simulate `link` on every link this rank sends over (`None`: memory speed). Give
    /// every rank the same, or a direction gets a different network.
    pub fn set_link(&mut self, link: Option<Link>) {
        self.link = link;
    }
}

/// Wait until `t`: sleep while far from it, then spin (sleeps overshoot by tens of
/// microseconds, which would add to every simulated latency).
fn wait_until(t: Instant) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        let left = t - now;
        if left > Duration::from_micros(300) {
            std::thread::sleep(left - Duration::from_micros(200));
        } else {
            std::hint::spin_loop();
        }
    }
}

impl Transport for Local {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        check_rank(to, self.size)?;
        // Reuse a buffer the receiver gave back, if there is one.
        let mut buf = self.back_from[to].try_recv().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(msg);
        let arrival = self.link.map(|link| {
            let start = self.busy_until[to].max(Instant::now());
            let done = start + link.transfer_time(msg.len());
            self.busy_until[to] = done;
            done + link.latency
        });
        self.moves.fetch_add(1, Ordering::Relaxed);
        self.to[to]
            .send((arrival, buf))
            .map_err(|_| Error::Transport {
                peer: to,
                reason: "has left the world (its transport was dropped) before receiving".into(),
            })
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        check_rank(from, self.size)?;
        let got = match self.timeout {
            Some(t) => self.wait(from, t)?,
            None => self.from[from].recv().map_err(|_| hung_up(from))?,
        };
        self.moves.fetch_add(1, Ordering::Relaxed);
        let (arrival, got) = got;
        if let Some(t) = arrival {
            wait_until(t);
        }
        if got.len() > max {
            return Err(super::too_long(from, got.len() as u64, max));
        }
        let old = core::mem::replace(buf, got);
        // The sender may have gone; then the buffer is simply dropped.
        let _ = self.back_to[from].send(old);
        Ok(())
    }
}

impl Local {
    /// The next message from `from`, waiting while the world moves messages and for at
    /// most `t` after the last one moved.
    fn wait(&self, from: usize, t: Duration) -> Result<Msg> {
        let mut seen = self.moves.load(Ordering::Relaxed);
        let mut since = Instant::now();
        loop {
            let left = t.saturating_sub(since.elapsed());
            match self.from[from].recv_timeout(left.min(Duration::from_millis(20))) {
                Ok(m) => return Ok(m),
                Err(RecvTimeoutError::Disconnected) => return Err(hung_up(from)),
                Err(RecvTimeoutError::Timeout) => {
                    let now = self.moves.load(Ordering::Relaxed);
                    if now != seen {
                        (seen, since) = (now, Instant::now());
                    } else if since.elapsed() >= t {
                        return Err(Error::Transport {
                            peer: from,
                            reason: format!(
                                "sent nothing, and no message moved between any ranks, within \
                                 the {t:?} timeout"
                            ),
                        });
                    }
                }
            }
        }
    }
}

fn hung_up(peer: usize) -> Error {
    Error::Transport {
        peer,
        reason: "has left the world (its transport was dropped) without sending".into(),
    }
}

/// Run `f` on every rank of a new in-process world of `size` ranks, one scoped thread
/// each, with receive timeout `timeout` and a [`Comm`] over the rank's transport;
/// returns the results in rank order. A rank that panics is reported as an
/// [`Error::Transport`] for that rank (its peers see it leave).
pub fn run<R, F>(size: usize, timeout: Option<Duration>, f: F) -> Vec<Result<R>>
where
    R: Send,
    F: Fn(Comm<Local>) -> Result<R> + Sync,
{
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = Local::world(size)
            .into_iter()
            .map(|mut t| {
                t.set_timeout(timeout);
                s.spawn(move || f(Comm::new(t)))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Transport {
                        peer: rank,
                        reason: "panicked".into(),
                    })
                })
            })
            .collect()
    })
}
