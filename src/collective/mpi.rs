//! The MPI [`Transport`] (feature `mpi`): the compressed collectives over MPI
//! point-to-point messages, on any MPI library the `mpi` crate builds against (MPICH,
//! Open MPI; see DEVELOPERS.md for the set-up).
//!
//! [`MpiTransport`] duplicates the communicator it is given, so its messages never match
//! the application's own. Each `send_recv` posts a non-blocking send, then probes for the
//! next message from the source (its length is not known in advance: sparse frames vary),
//! receives it, and waits for the send. MPI delivers messages between two ranks in
//! order.
//!
//! Faults follow MPI: with the default error handler a failed call aborts the job, and a
//! peer that stops answering is not detected (MPI has no timeouts; `mpirun` ends the job
//! when a rank dies). A corrupt frame is still an [`Error::Peer`] from the collective.

use mpi::datatype::Equivalence;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};

use super::{Transport, check_rank};
use crate::error::{Error, Result};

/// A [`Transport`] over an MPI communicator (see the module docs).
pub struct MpiTransport {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
}

impl core::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MpiTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiTransport {
    /// A transport over a duplicate of `comm` (collective: every rank of `comm` must call
    /// it).
    pub fn new<C: Communicator>(comm: &C) -> MpiTransport {
        let comm = comm.duplicate();
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        MpiTransport { comm, rank, size }
    }

    /// The communicator messages travel on.
    pub fn communicator(&self) -> &SimpleCommunicator {
        &self.comm
    }

    fn process(&self, peer: usize) -> Result<mpi::topology::Process<'_>> {
        check_rank(peer, self.size)?;
        Ok(self.comm.process_at_rank(peer as i32))
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn send_recv(&mut self, send: &[u8], to: usize, recv: &mut Vec<u8>, from: usize) -> Result<()> {
        let (dest, src) = (self.process(to)?, self.process(from)?);
        mpi::request::scope(|scope| {
            let sreq = dest.immediate_send(scope, send);
            let (msg, status) = src.matched_probe();
            let count = status.count(<u8 as Equivalence>::equivalent_datatype());
            // MPI_Get_count is MPI_UNDEFINED (negative) only for a count that is not a
            // whole number of bytes, which cannot happen for a byte message.
            recv.resize(usize::try_from(count).unwrap_or(0), 0);
            msg.matched_receive_into(&mut recv[..]);
            sreq.wait();
            if count < 0 {
                return Err(Error::Transport {
                    peer: from,
                    reason: format!("MPI reports a message of {count} bytes"),
                });
            }
            Ok(())
        })
    }
}
