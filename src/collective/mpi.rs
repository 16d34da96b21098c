//! The MPI [`Transport`] (feature `mpi`): the compressed collectives over MPI
//! point-to-point messages, on any MPI library the `mpi` crate builds against (MPICH,
//! Open MPI; see DEVELOPERS.md for the set-up).
//!
//! [`MpiTransport`] duplicates the communicator it is given, so its messages never match
//! the application's own. A send is posted non-blocking and, until it completes, the
//! transport keeps receiving whatever peers send it (into a per-peer inbox, in order),
//! so ranks that all send before they receive cannot deadlock. Receives poll with
//! `MPI_Improbe` (message lengths are not known in advance: sparse frames vary).
//!
//! ## Faults
//! - **A silent peer is an error.** Every send and receive waits at most the transport's
//!   timeout ([`DEFAULT_TIMEOUT`] unless set with [`MpiTransport::set_timeout`]), then
//!   returns an [`Error::Transport`] naming the peer. A send still pending then is
//!   cancelled first; if MPI cannot cancel it within a second (the peer has stopped
//!   taking part in MPI at all), the job is aborted, as that send would otherwise hang
//!   this rank's next MPI call.
//! - **A rank that panics ends the job.** Dropping an `MpiTransport` while its thread
//!   unwinds from a panic calls `MPI_Abort` on its communicator, which ends every rank
//!   (without it, the panicking rank would block in `MPI_Finalize` while its peers wait
//!   for it). A rank that returns early without panicking leaves its peers to time out:
//!   each gets an error within the timeout and can end the job itself.
//! - A failed MPI call aborts the job (MPI's default error handler). A corrupt frame is
//!   an [`Error::Peer`] from the collective.
//! - **A message longer than the collective expects is refused** (an error naming the
//!   peer, the message dropped). MPI reports a message's true length, which its sender
//!   sent in full, so receiving it is bounded by what the sender really sent.
//!
//! ## Threads
//! The transport is used from one thread at a time (it is `Send`, not `Sync`); MPI must
//! then be initialised with at least `Threading::Serialized` if that thread is not the
//! one that initialised MPI (`mpi::initialize_with_threading`), and `Threading::Funneled`
//! (what `mpi::initialize` gives) suffices otherwise.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::point_to_point::{Message, Status};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};

use super::{Transport, check_rank};
use crate::error::{Error, Result};

/// How long a send or receive waits for its peer before it fails, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A [`Transport`] over an MPI communicator (see the module docs).
pub struct MpiTransport {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Option<Duration>,
    mail: Mailbox,
}

/// Messages received from each peer before they were asked for, in order, and buffers
/// to reuse for them.
struct Mailbox {
    inbox: Vec<VecDeque<Vec<u8>>>,
    spare: Vec<Vec<u8>>,
}

impl Mailbox {
    /// Receive one message that a probe found.
    fn take(&mut self, msg: Message, status: Status) -> Result<Vec<u8>> {
        let count = status.count(<u8 as Equivalence>::equivalent_datatype());
        let Ok(count) = usize::try_from(count) else {
            return Err(Error::Transport {
                peer: status.source_rank() as usize,
                reason: format!("MPI reports a message of {count} bytes"),
            });
        };
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(count, 0);
        msg.matched_receive_into(&mut buf[..]);
        Ok(buf)
    }

    /// Receive whatever message has arrived from any peer into its inbox. True if one did.
    fn poll(&mut self, comm: &SimpleCommunicator) -> Result<bool> {
        match comm.any_process().immediate_matched_probe() {
            Some((msg, status)) => {
                let src = status.source_rank() as usize;
                let buf = self.take(msg, status)?;
                if let Some(q) = self.inbox.get_mut(src) {
                    q.push_back(buf);
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Move the next message from `from`, if one is here, into `buf`: true if it did, an
    /// error (the message dropped) if it is longer than `max`.
    fn deliver(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<bool> {
        match self.inbox[from].pop_front() {
            Some(m) if m.len() > max => {
                let len = m.len() as u64;
                self.spare.push(m);
                Err(super::too_long(from, len, max))
            }
            Some(m) => {
                let old = core::mem::replace(buf, m);
                self.spare.push(old);
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

impl core::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MpiTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl MpiTransport {
    /// A transport over a duplicate of `comm` (collective: every rank of `comm` must call
    /// it), with [`DEFAULT_TIMEOUT`].
    pub fn new<C: Communicator>(comm: &C) -> MpiTransport {
        let comm = comm.duplicate();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiTransport {
            comm,
            rank,
            size,
            timeout: Some(DEFAULT_TIMEOUT),
            mail: Mailbox {
                inbox: (0..size).map(|_| VecDeque::new()).collect(),
                spare: Vec::new(),
            },
        }
    }

    /// The communicator messages travel on.
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// How long a send or receive waits for its peer (`None`: forever).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Set how long a send or receive waits for its peer (`None`: forever).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// End every rank of the job now (`MPI_Abort` with `code`).
    pub fn abort(&self, code: i32) -> ! {
        self.comm.abort(code)
    }

    fn deadline(&self) -> Option<Instant> {
        self.timeout.and_then(|t| Instant::now().checked_add(t))
    }

    /// Send `msg` to `to` and, if `recv` is given, receive the next message from its
    /// peer, receiving anything else that arrives meanwhile.
    fn exchange(
        &mut self,
        msg: &[u8],
        to: usize,
        mut recv: Option<(&mut Vec<u8>, usize, usize)>,
    ) -> Result<()> {
        let deadline = self.deadline();
        let timeout = self.timeout;
        let (comm, mail) = (&self.comm, &mut self.mail);
        let dest = comm.process_at_rank(to as i32);
        mpi::request::scope(|scope| {
            let mut sreq = Some(dest.immediate_send(scope, msg));
            let mut refused = None;
            loop {
                if let Some((buf, from, max)) = recv.as_mut() {
                    match mail.deliver(buf, *from, *max) {
                        Ok(true) => recv = None,
                        Ok(false) => {}
                        // The message is refused (dropped); the send still completes,
                        // or is withdrawn on the timeout, before the error returns.
                        Err(e) => {
                            refused = Some(e);
                            recv = None;
                        }
                    }
                }
                if let Some(r) = sreq.take() {
                    match r.test() {
                        Ok(_) => {}
                        Err(r) => sreq = Some(r),
                    }
                }
                if sreq.is_none() && recv.is_none() {
                    return refused.map_or(Ok(()), Err);
                }
                let progressed = match mail.poll(comm) {
                    Ok(p) => p,
                    Err(e) => {
                        if let Some(r) = sreq.take() {
                            withdraw(comm, r, to);
                        }
                        return Err(e);
                    }
                };
                if !progressed {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        if let Some(r) = sreq.take() {
                            withdraw(comm, r, to);
                            return Err(timed_out(to, "did not take a message", timeout));
                        }
                        let from = recv.as_ref().map_or(to, |(_, f, _)| *f);
                        return Err(timed_out(from, "sent nothing", timeout));
                    }
                    std::thread::yield_now();
                }
            }
        })
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send(&mut self, msg: &[u8], to: usize) -> Result<()> {
        check_rank(to, self.size)?;
        self.exchange(msg, to, None)
    }

    fn recv(&mut self, buf: &mut Vec<u8>, from: usize, max: usize) -> Result<()> {
        check_rank(from, self.size)?;
        let deadline = self.deadline();
        loop {
            if self.mail.deliver(buf, from, max)? {
                return Ok(());
            }
            if !self.mail.poll(&self.comm)? {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(timed_out(from, "sent nothing", self.timeout));
                }
                std::thread::yield_now();
            }
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
        check_rank(to, self.size)?;
        check_rank(from, self.size)?;
        self.exchange(send, to, Some((recv, from, max)))
    }
}

/// Cancel a send its receiver has not taken. MPI cannot always cancel a send (a peer
/// that has stopped may never answer the cancellation either); if the cancellation has
/// not completed within a second, the job is aborted, since a send that can be neither
/// completed nor withdrawn would hang this rank at its next MPI call.
fn withdraw<'a, S: mpi::request::Scope<'a>>(
    comm: &SimpleCommunicator,
    r: mpi::request::Request<'a, [u8], S>,
    to: usize,
) {
    r.cancel();
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut r = r;
    loop {
        match r.test() {
            Ok(_) => return,
            Err(pending) => r = pending,
        }
        if Instant::now() >= deadline {
            eprintln!(
                "gradpack: rank {}: a message to rank {to} can be neither delivered nor cancelled: aborting the job",
                comm.rank()
            );
            // Not MPI_Abort: with a send that cannot be withdrawn it was seen to spin
            // for ever (MPICH 4); a process that dies ends the job under mpirun.
            std::process::abort();
        }
        std::thread::yield_now();
    }
}

fn timed_out(peer: usize, what: &str, timeout: Option<Duration>) -> Error {
    let t = timeout.unwrap_or_default();
    Error::Transport {
        peer,
        reason: format!("{what} within the {t:?} timeout"),
    }
}

impl Drop for MpiTransport {
    /// Ends the job if the thread is unwinding from a panic (see the module docs).
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "gradpack: rank {} panicked while holding its MPI transport: aborting the job",
                self.rank
            );
            self.comm.abort(134);
        }
    }
}
