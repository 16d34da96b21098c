"""gradpack's compressed all-reduce in a job started by mpirun, on gradpack's native
transport: the ranks find each other with one allgather on the MPI communicator, then
every message of the all-reduce goes over TCP from Rust (none through Python or MPI).

    mpirun -np 3 python python/examples/mpi_allreduce.py

Each rank listens on the address its host's name resolves to; `GRADPACK_SOCKET_IFNAME`
(an interface's name, `eth0`, or an address) names another (`lo` for a job on one host).

Each rank all-reduces a gradient of 1 Mi float32 elements with int8 by the ring, and
checks that the mean is within the codec's error bound of the exact mean (MPI's own
float32 Allreduce) and the same to the bit on every rank.
"""

import time
import zlib

import numpy as np
from mpi4py import MPI

import gradpack

comm = MPI.COMM_WORLD
tcp = gradpack.Tcp.from_mpi(comm)  # one allgather of the listening addresses
grad = np.random.default_rng(comm.rank).standard_normal(1 << 20, dtype=np.float32)
ar = gradpack.AllReduce("int8", grad.size, transport=tcp, strategy="ring")
mean = grad.copy()
t0 = time.perf_counter()
stats = ar.run(mean, seed=1)  # in place: the mean over the ranks
elapsed = time.perf_counter() - t0

exact = np.empty_like(grad)
comm.Allreduce(grad, exact)
exact /= comm.size
# Each of the ring's encodes (p - 1 partial sums and the owner's mean) rounds to the
# nearest of 255 levels of its block's absmax, at most the absmax of p gradients'
# sum: p * max|x| / 254 after the division by p, a loose but certain bound.
bound = comm.size * comm.allreduce(float(np.abs(grad).max()), op=MPI.MAX) / 254
err = float(np.abs(mean - exact).max())
crcs = comm.allgather(zlib.crc32(mean.tobytes()))
if comm.rank == 0:
    print(f"{comm.size} ranks, {grad.size} elements, int8 ring over gradpack.Tcp: "
          f"{elapsed * 1e3:.1f} ms, {stats['bytes_sent']} bytes sent by rank 0, "
          f"max error {err:.2e} (bound {bound:.2e}), same bits on every rank: "
          f"{len(set(crcs)) == 1}")
assert err <= bound, (err, bound)
assert len(set(crcs)) == 1, crcs
