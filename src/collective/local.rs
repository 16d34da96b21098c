//! An in-process [`Transport`]: one thread per rank, joined by channels. For tests,
//! simulation and benchmarks of the collectives on one machine (world sizes 1 to a few
//! dozen).
//!
//! Every ordered pair of ranks has its own FIFO channel, so messages between two ranks
//! arrive in the order they were sent, as MPI guarantees. Sends never block (the channels
//! are unbounded). A buffer received is handed back to its sender for the next message,
//! so a steady-state collective allocates nothing per message.
//!
//! Faults become errors instead of hangs: a receive waits at most the transport's
//! timeout ([`DEFAULT_TIMEOUT`] unless set), and a peer whose transport was dropped (its
//! thread returned or panicked) is reported at once.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use super::{Comm, Transport, check_rank};
use crate::error::{Error, Result};

/// How long a receive waits for a message before it fails, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// One rank's end of an in-process world (see the module docs). Build a world with
/// [`Local::world`], or run a closure on every rank with [`run`].
#[derive(Debug)]
pub struct Local {
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    /// `to[q]`: messages to rank q; `back_to[q]`: buffers given back to rank q.
    to: Vec<Sender<Vec<u8>>>,
    back_to: Vec<Sender<Vec<u8>>>,
    /// `from[q]`: messages from rank q; `back_from[q]`: buffers rank q gave back.
    from: Vec<Receiver<Vec<u8>>>,
    back_from: Vec<Receiver<Vec<u8>>>,
}

impl Local {
    /// The `size` ranks of a new world, in rank order, each with [`DEFAULT_TIMEOUT`].
    /// Move each to its own thread.
    pub fn world(size: usize) -> Vec<Local> {
        let mut ranks: Vec<Local> = (0..size)
            .map(|rank| Local {
                rank,
                size,
                timeout: Some(DEFAULT_TIMEOUT),
                to: Vec::with_capacity(size),
                back_to: Vec::with_capacity(size),
                from: Vec::with_capacity(size),
                back_from: Vec::with_capacity(size),
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

    /// How long a receive waits before failing (`None`: forever).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Set how long a receive waits before failing (`None`: forever).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
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
        self.to[to].send(buf).map_err(|_| Error::Transport {
            peer: to,
            reason: "has left the world (its transport was dropped) before receiving".into(),
        })
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize) -> Result<()> {
        check_rank(from, self.size)?;
        let got = match self.timeout {
            Some(t) => self.from[from].recv_timeout(t).map_err(|e| match e {
                RecvTimeoutError::Timeout => Error::Transport {
                    peer: from,
                    reason: format!("sent nothing within the {t:?} timeout"),
                },
                RecvTimeoutError::Disconnected => hung_up(from),
            })?,
            None => self.from[from].recv().map_err(|_| hung_up(from))?,
        };
        let old = core::mem::replace(buf, got);
        // The sender may have gone; then the buffer is simply dropped.
        let _ = self.back_to[from].send(old);
        Ok(())
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
