"""How the PyTorch hook and DiLoCo reach the other ranks: gradpack's native transport set
up through torch's store, point-to-point messages on a gloo group, and which ranks share
a host's shared memory. Plumbing only: what is sent, and when, is the crate's."""

import datetime
import os
import socket
import tempfile
import threading
import warnings
import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

import gradpack


# What the hook's shared memory takes per rank: 1 MiB per ring (the transport's default
# capacity; 64 KiB at the least, where /dev/shm is small) and the two-level all-reduce's
# stage.
_RING = 1 << 20
_MIN_RING = 64 << 10
_STAGE = 4 << 20


def _shm_dir() -> str:
    """Where the crate's shared-memory transport puts its files."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _shm_free() -> int:
    """Bytes free where the shared-memory files go (0 if unknown)."""
    try:
        st = os.statvfs(_shm_dir())
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _hosts_by_probe(group: Any, world: int, rank: int) -> List[int]:
    """The host of every rank of ``group``: ranks that see each other's file in the
    shared-memory directory share one. Ranks whose views disagree (a directory shared
    one way only) get hosts of their own."""
    token = os.urandom(8).hex()
    path = os.path.join(_shm_dir(), f"gradpack-probe-{token}")
    try:
        with open(path, "w"):
            pass
    except OSError:
        path = ""
    tokens: List[Any] = [None] * world
    dist.all_gather_object(tokens, token if path else None, group=group)
    sees = [r for r, t in enumerate(tokens) if t is not None and (
        r == rank or os.path.exists(os.path.join(_shm_dir(), f"gradpack-probe-{t}")))]
    views: List[Any] = [None] * world
    dist.all_gather_object(views, sees, group=group)
    if path:
        os.unlink(path)
    hosts: List[int] = []
    groups: Dict[Tuple[int, ...], int] = {}
    for r in range(world):
        v = tuple(views[r])
        # A host: ranks that all see exactly the same set, which holds them.
        ok = r in v and all(tuple(views[q]) == v for q in v)
        hosts.append(groups.setdefault(v, len(groups)) if ok else len(groups) + world + r)
    return hosts


def _shared_memories(
    group: Any, rank: int, hosts: List[int], nodes: Optional[List[int]], token: str,
    timeout: Optional[float], flat: bool = True,
) -> Tuple[Optional["gradpack.SharedMemory"], Optional["gradpack.SharedMemory"], int]:
    """The shared memory of a state's collectives: between the ranks of this host, and
    (with ``nodes``, for the two-level all-reduce, whose memory gets a stage) between the
    ranks of this host in this rank's node; one :class:`gradpack.SharedMemory` per set of
    ranks, None for a set of one (and for the first without ``flat``: no collective but
    the two-level one). A collective of ``group``, made in the same order on
    every rank. Per rank, a ring per other rank of the host (two sets when the nodes
    split a host) and the stage: 1 MiB rings where ``/dev/shm`` has the room, less (down
    to 64 KiB, the same on every rank) where it has not; if even that does not fit on
    some rank's host, every rank goes without (both None, and a warning says so) rather
    than fail at set-up. Last, the bytes of each ring."""
    world = len(hosts)
    staged = nodes is not None
    mine = tuple(r for r in range(world) if hosts[r] == hosts[rank])
    in_node = tuple(r for r in mine if nodes[r] == nodes[rank]) if staged else mine
    sets = 1 if in_node == mine else 2
    h = len(mine)
    fixed = (_STAGE if staged else 0) + (64 << 10)  # the stage, the file's header
    free = _shm_free()
    ring = _RING
    if h >= 2:
        fits = (free // h - fixed) // ((h - 1) * sets)
        ring = min(_RING, max(0, fits) // _MIN_RING * _MIN_RING)
    agreed = torch.tensor([ring], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if int(agreed.item()) < _MIN_RING:
        if ring < _MIN_RING:
            need = h * ((h - 1) * _MIN_RING * sets + fixed)
            warnings.warn(
                f"gradpack: {_shm_dir()} has {free / 2**20:.0f} MiB free; the hook's "
                f"shared memory needs at least {need / 2**20:.0f} MiB for the {h} ranks "
                "of this host, so messages between them go through the process group "
                "instead (give the container more, e.g. docker run --shm-size=1g, or "
                "pass shared_memory=False to silence this)",
                RuntimeWarning, stacklevel=3,
            )
        return None, None, 0
    made: Dict[Tuple[int, ...], Any] = {}

    def of(host: Tuple[int, ...]) -> Optional["gradpack.SharedMemory"]:
        if len(host) < 2:
            return None
        if host not in made:
            made[host] = gradpack.SharedMemory(
                f"gp{token}-{zlib.crc32(repr(host).encode()):08x}", rank, world, list(host),
                timeout=300.0 if timeout is None else float(timeout),
                stage=_STAGE if staged else 0, capacity=int(agreed.item()), job=int(token, 16),
            )
        return made[host]

    return (of(mine) if flat else None), (of(in_node) if staged else None), int(agreed.item())


def _spans_nodes(group: Any) -> bool:
    """Whether torchrun's environment says the group's ranks sit on several nodes of
    more than one rank each (``LOCAL_WORLD_SIZE`` below the world size)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return False
    if not (dist.is_available() and dist.is_initialized()) or local < 2:
        return False
    return local < dist.get_world_size(group)


def _job_token(group: Any) -> str:
    """A random token, the same on every rank of ``group`` (drawn by its first rank and
    broadcast: a collective)."""
    token = [os.urandom(6).hex() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    return str(token[0])


def _tcp(rank: int, world: int, token: str, timeout: Optional[float]) -> "gradpack.Tcp":
    """gradpack's native transport among ``world`` ranks, connected through torch's
    default store under a key of the job's ``token`` (a collective)."""
    return gradpack.Tcp.from_store(
        dist.distributed_c10d._get_default_store(), rank, world, key=f"gradpack/tcp/{token}",
        timeout=300.0 if timeout is None else float(timeout),
    )


def measure_link(
    process_group: Optional[Any] = None, small: int = 1 << 10, large: int = 4 << 20, repeats: int = 5
) -> Tuple[float, float]:
    """Estimate the group's link as ``(bandwidth bit/s, latency s)``: the crate's
    :func:`gradpack.measure_link` (float32 ring all-reduces of ``small`` and ``large``
    elements, the best of ``repeats``, the ring model solved for both) on gradpack's
    native transport, the hook's default, connected through torch's store for the call.
    A collective: every rank must call it. The times are averaged over the ranks, so
    they all return the same figures; pass them to :class:`GradpackState` for
    ``codec="auto"``."""
    world = dist.get_world_size(process_group)
    if world < 2:
        raise ValueError("measure_link needs at least 2 ranks")
    group = dist.group.WORLD if process_group is None else process_group
    tcp = _tcp(dist.get_rank(group), world, _job_token(group), None)
    return gradpack.measure_link(transport=tcp, small=small, large=large, repeats=repeats)


def _check_limit(frm: int, length: int, limit: Optional[int]) -> None:
    """Refuse an announced length above what the collective expects (or below zero)
    before anything is allocated for it."""
    if length < 0 or (limit is not None and length > limit):
        raise RuntimeError(
            f"rank {frm} announced a message of {length} bytes where at most {limit} are "
            "expected: refused"
        )


class _PointToPoint:
    """The message callables of a :class:`gradpack.AllReduce` or
    :class:`gradpack.OuterSync` over point-to-point operations on a process group
    (``group()`` gives it; ranks are the group's). A message is its length, then its
    bytes; sends do not wait (the tensors stay alive in ``pending`` until waited for, or
    seen complete by a later send)."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._pending: List[Any] = []
        self._lock = threading.Lock()
        # send_recv's receive buffers of known sizes, by (peer, size): the caller copies
        # what it returns before the next call.
        self._recv_bufs: Dict[Tuple[int, int], torch.Tensor] = {}
        # Receives of known sizes are posted early only until a call fails: after one,
        # messages of a failed call may still be on their way (gloo aborts the process
        # when a message is longer than the receive posted for it), so the lengths are
        # waited for again and such messages dropped as stale.
        self._sized = True

    def link(self) -> Dict[str, Any]:
        """The transport arguments of a collective over these callables."""
        g = self._group()
        return dict(rank=dist.get_rank(g), world=dist.get_world_size(g), send=self.send,
                    recv=self.recv, send_recv=self.send_recv)

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self._group(), r)

    def send(self, msg: bytearray, to: int) -> None:
        dst = self._peer(to)
        length = torch.tensor([len(msg)], dtype=torch.int64)
        payload = torch.frombuffer(msg, dtype=torch.uint8)
        g = self._group()
        self._keep((dist.isend(length, dst, group=g), dist.isend(payload, dst, group=g)),
                   length, payload)

    def _keep(self, works: Tuple[Any, Any], length: torch.Tensor, payload: torch.Tensor) -> None:
        """Keep a send's tensors alive until it completes (dropping those done)."""
        with self._lock:
            self._pending = [p for p in self._pending if not all(w.is_completed() for w in p[0])]
            self._pending.append((works, length, payload))

    def recv(self, frm: int, limit: Optional[int] = None) -> np.ndarray:
        src = self._peer(frm)
        length = torch.empty(1, dtype=torch.int64)
        g = self._group()
        dist.recv(length, src, group=g)
        _check_limit(frm, int(length), limit)
        buf = torch.empty(int(length), dtype=torch.uint8)
        dist.recv(buf, src, group=g)
        return buf.numpy()

    def send_recv(self, msg: bytearray, to: int, frm: int, size: Optional[int] = None,
                  limit: Optional[int] = None) -> np.ndarray:
        """``send(msg, to)`` and ``recv(frm)`` at once, the same messages on the wire: the
        lengths are exchanged first, then the payload's receive is posted before its
        send. gloo moves the two directions of a step at once only when the receive is
        posted first (posted after, as ``send`` then ``recv`` do, one 12 MB exchange
        between two ranks took 200 ms on a 1 Gbit/s port instead of 107). With ``size``
        (the length the ring knows the message from ``frm`` has) both receives are
        posted at once, into a buffer kept for that peer and size, and the lengths are
        checked after: no wait for the length before the payload moves (4 ranks on one
        loopback, an int8 ring of 6.3 M elements: its messages 10.6 ms instead of 22.8).
        Every rank's collectives are made alike (DDP's buckets are the same on every
        rank), so before any failure the next message from a peer is the one expected;
        after one (:meth:`drop`), or a message of another length (an error), ``size`` is
        ignored."""
        dst, src = self._peer(to), self._peer(frm)
        g = self._group()
        got = torch.empty(1, dtype=torch.int64)
        length = torch.tensor([len(msg)], dtype=torch.int64)
        w_got = dist.irecv(got, src, group=g)
        key, w_buf = None, None
        if size is not None and self._sized:
            key = (src, int(size))
            buf = self._recv_bufs.get(key)
            if buf is None:
                if len(self._recv_bufs) >= 64:
                    self._recv_bufs.clear()
                buf = self._recv_bufs[key] = torch.empty(int(size), dtype=torch.uint8)
            w_buf = dist.irecv(buf, src, group=g)
        w_len = dist.isend(length, dst, group=g)
        if w_buf is None:
            w_got.wait()
            _check_limit(frm, int(got), limit)
            buf = torch.empty(int(got), dtype=torch.uint8)
            w_buf = dist.irecv(buf, src, group=g)
        payload = torch.frombuffer(msg, dtype=torch.uint8)
        self._keep((w_len, dist.isend(payload, dst, group=g)), length, payload)
        if key is not None:
            w_got.wait()
            if int(got) != size:
                del self._recv_bufs[key]  # its receive may still be posted
                self._sized = False
                raise RuntimeError(
                    f"rank {frm} sent a message of {int(got)} bytes where {size} were expected"
                )
        w_buf.wait()
        return buf.numpy()

    def wait(self) -> None:
        """Wait for every send made so far."""
        with self._lock:
            pending, self._pending = self._pending, []
        for works, _, _ in pending:
            for w in works:
                w.wait()

    def drop(self) -> None:
        """Forget the sends made so far (after a failure), and post no receive of a known
        size from now on."""
        with self._lock:
            self._pending = []
            self._sized = False


class _Links:
    """The hook's ways to the other ranks of ``process_group``: its own gloo group (made
    once, or ``comm_group`` checked against the ranks), the job's token, the native
    transport (connected on first use through torch's store), the point-to-point
    callables on the group, and the maps of hosts and nodes. Each is found once, by a
    collective of the group."""

    def __init__(self, process_group: Any, comm_group: Any, timeout: Optional[float],
                 transport: str, nodes: Optional[List[int]]) -> None:
        self.process_group = process_group
        self.comm, self.own = comm_group, comm_group is None
        self.checked = False  # made here, or the given one checked against the ranks
        self.timeout, self.transport, self.nodes = timeout, transport, nodes
        self.tcp: Optional[gradpack.Tcp] = None
        self.token: Optional[str] = None
        self.hosts: Optional[List[int]] = None
        self.p2p = _PointToPoint(self.group)

    def world(self) -> int:
        return dist.get_world_size(self.process_group)

    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def group(self) -> Any:
        """The group the hook's own messages travel on: the one given, or a gloo group of
        the process group's ranks made once (a collective of those ranks). Never DDP's
        group: DDP issues its own collectives on that one from the training thread, and
        two threads on one group interleave their messages differently on different
        ranks."""
        if self.comm is None:
            g = self.process_group
            ranks = None if g is None else dist.get_process_group_ranks(g)
            kw: Dict[str, Any] = {}
            if self.timeout is not None:
                kw["timeout"] = datetime.timedelta(seconds=self.timeout)
            self.comm = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None, **kw
            )
            self.checked = True
        elif not self.checked:
            c = self.comm
            if (dist.get_world_size(c), dist.get_rank(c)) != (self.world(), self.rank()):
                raise ValueError(
                    "comm_group must hold the process group's ranks in the same order "
                    f"(its rank {dist.get_rank(c)} of {dist.get_world_size(c)}, the process "
                    f"group's {self.rank()} of {self.world()})"
                )
            self.checked = True
        return self.comm

    def job_token(self) -> str:
        """A random token of this state's, the same on every rank (drawn the first time:
        a collective of the hook's group)."""
        if self.token is None:
            self.token = _job_token(self.group())
        return self.token

    def link(self) -> Dict[str, Any]:
        """The transport arguments of a crate call: the :class:`gradpack.Tcp` (connected
        on first use, through torch's store: a collective), or the point-to-point
        callables on the hook's group."""
        if self.transport == "tcp":
            if self.tcp is None:
                self.tcp = _tcp(self.rank(), self.world(), self.job_token(), self.timeout)
            return dict(transport=self.tcp)
        return self.p2p.link()

    def call(self, f: Any, *args: Any, **kw: Any) -> Any:
        """``f(*args, **kw)``, a call of the crate that sends on :meth:`link`: with the
        point-to-point callables, this rank's sends are waited for after it (and
        forgotten after a failure)."""
        try:
            out = f(*args, **kw)
        except BaseException:
            self.p2p.drop()
            raise
        self.p2p.wait()
        return out

    def node_map(self) -> List[int]:
        """The node of every rank (the ``nodes`` given, or found once: ranks share a
        node when their ``GROUP_RANK``, or else their host names, are equal)."""
        if self.nodes is None:
            key = os.environ.get("GROUP_RANK") or socket.gethostname()
            keys: List[Any] = [None] * self.world()
            dist.all_gather_object(keys, key, group=self.group())
            order: Dict[Any, int] = {}
            self.nodes = [order.setdefault(k, len(order)) for k in keys]
        if len(self.nodes) != self.world():
            raise ValueError(f"nodes lists {len(self.nodes)} ranks; the group has {self.world()}")
        return self.nodes

    def host_map(self) -> List[int]:
        """The host of every rank: ranks that share ``/dev/shm`` (found once)."""
        if self.hosts is None:
            self.hosts = _hosts_by_probe(self.group(), self.world(), self.rank())
        return self.hosts

    def close(self) -> None:
        """Meet the other ranks (a barrier on the hook's group, so no rank tears its
        connections down while a peer's last messages are on the way: gloo can abort
        the process then) and destroy the group if it was made here."""
        if self.comm is not None and dist.is_initialized():
            dist.barrier(group=self.comm)
            if self.own:
                dist.destroy_process_group(self.comm)
        self.comm = None
        self.tcp = None
