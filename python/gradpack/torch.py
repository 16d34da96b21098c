"""A PyTorch DDP communication hook that compresses gradient buckets with gradpack.

DDP hands the hook each bucket of gradients (a flat float32 tensor of up to 25 MiB by
default) as soon as backward has produced it, and waits for the returned future before
the optimizer step. The hook encodes the bucket with a gradpack codec, exchanges the
frames over DDP's own process group, decodes and sums them in rank order, and divides
by the world size, so every rank ends with the same averaged gradient, bit for bit::

    import gradpack.torch as gpt

    model = torch.nn.parallel.DistributedDataParallel(net)
    state = gpt.GradpackState(codec="topk:ratio=0.01,values=fp16", error_feedback=True)
    model.register_comm_hook(state, gpt.gradpack_hook)
    ...                                   # training
    state.close()                         # before dist.destroy_process_group()

What it does, per bucket:

- The hook's messages travel on gradpack's native transport (``transport="tcp"``, the
  default: :class:`gradpack.Tcp`, connected once through torch's store, every message
  sent and received in Rust) or, with ``transport="process_group"``, point to point on a
  gloo group of the state's own (or ``comm_group``); between ranks of one host, through
  shared memory either way. Never on DDP's group: DDP sends collectives of its own on
  that group from the training thread (``find_unused_parameters``, ``static_graph``), and
  two threads on one group interleave their messages differently on different ranks.
  Make the state on every rank at the same point, after ``init_process_group``. A rank
  that dies makes the others' hooks raise (``timeout`` bounds the wait for one that
  hangs).

- Each parameter's gradient in the bucket is a tensor of its own: parameters under
  ``min_compress_elements`` elements and one-dimensional ones (biases, norm scales) go
  as float32, the others with the codec. So the result does not depend on how DDP
  groups parameters into buckets (it regroups them once, after the first step).
- ``strategy="allgather"`` (the default at 2 ranks, and for sparse codecs and ``sign``
  at any number): each rank encodes its tensors once (with error
  feedback when on) into one message of back-to-back frames; the crate's
  :class:`gradpack.BucketGather` all-gathers the messages round the ring, point to
  point on the process group, and sums each tensor's frames in rank order in one fused
  pass, so every rank holds the same sum. A bucket with no tensor to compress, and every bucket when
  the codec is ``"identity"``, goes through a plain float32 all-reduce instead.
- ``selection="model"`` (top-k only): one top-k over every compressed parameter of
  the model at once instead of ``ratio`` of each, so a layer whose gradients are large
  (a classifier's, an input layer's) gets the share of the entries its magnitudes earn
  (global top-k; Shi et al., 2019). The hook holds the step's buckets until DDP hands
  over the last one, then encodes them as one frame (one error feedback, its residual
  still kept and saved per parameter), all-gathers it once and completes every bucket's
  future: the same bytes as per-tensor top-k, but no overlap with backward. The
  parameters go in the model's order, so the result does not depend on DDP's buckets.
- ``strategy="ring"``: gradpack's own compressed ring (:class:`gradpack.AllReduce`, the
  algorithm MPI and the sync engine run) on the whole bucket, its messages sent point to
  point on the process group: each of the ``2(p - 1)`` hops moves one ``1/p`` chunk,
  partial sums are re-encoded on the way, and the owners' final frames are forwarded
  unchanged. It moves ``2(p - 1)/p`` frames per rank against the all-gather's ``p - 1``,
  so it pays from 3 ranks up for dense codecs: the default there for the quantisers of
  :data:`RING_BY_DEFAULT` (int8, fp16, ...). Like every strategy on a whole bucket, it
  sends small and one-dimensional parameters with the codec too. With error feedback, each rank keeps a
  residual for what it encodes from its own data and, as a chunk's owner, for the
  chunk's final encode; ``pieces`` pipelines each chunk. Its chunks follow the bucket,
  not the parameters, so its residuals belong to the bucket's layout.
- ``strategy="twoshot"``: gradpack's two-shot all-reduce (:class:`gradpack.AllReduce`'s
  ``"twoshot"``) on the whole bucket: each rank encodes chunk ``c`` of the bucket once
  and sends it straight to rank ``c``, which sums the ranks' frames of its chunk in
  float32 (its own data exact), encodes the sum once and sends it to every rank. The
  ring's bytes per rank in two steps of latency instead of ``2(p - 1)``, and each
  element quantised twice whatever the number of ranks (the ring re-encodes a partial
  sum at every hop). Residuals and ``pieces`` as for the ring.
- ``strategy="hierarchical"``: the two-level all-reduce (:class:`gradpack.Hierarchical`)
  on the whole bucket: a float32 reduce-scatter inside each node, the codec's all-reduce
  of each shard between nodes (error feedback there), and an all-gather inside the node.
  The nodes come from ``nodes=``, torchrun's ``GROUP_RANK`` or the host names; it is the
  default when torchrun's ``LOCAL_WORLD_SIZE`` says the ranks sit on several nodes, and
  ``codec="auto"`` tries it (float32 too, then) beside the flat strategies there.
- ``strategy="majority"``: signSGD with majority vote (:class:`gradpack.AllReduce`'s
  ``"majority"``) on the whole bucket, meant for the ``sign`` codec: every rank's frame
  to every rank, and each element the sign most ranks sent times the ranks' summed
  magnitudes (divided by the ranks: the mean when all agree). Not a sum, so only when
  asked for; with error feedback each rank keeps a residual of what it sent.
- The ring and the two-level all-reduce send messages between ranks of one host through
  shared memory (``shared_memory=True``, the default): ranks that see each other's file
  in ``/dev/shm`` share a host. All of a state's collectives share one set of rings (1
  MiB per other rank of the host, less where ``/dev/shm`` is small, and a 4 MiB stage
  for the two-level all-reduce), so ``/dev/shm`` use does not grow with the number of
  buckets.
- Messages whose length is fixed by the element counts (every codec but random-k, up to
  top-k's 2% slack) travel in buffers of that length; random-k's lengths are
  all-gathered first. On the ring, the fixed-rate codecs' messages are received into
  buffers posted before their lengths arrive (the lengths still travel ahead of them,
  and are checked).
- The work runs on one communication thread per state, in the order DDP hands the
  buckets over, while backward goes on (gradpack's kernels and gloo release the GIL).
- ``codec="auto"`` chooses a codec and a strategy per bucket, and checks the choice by
  measurement. The cost model (the codecs' speeds measured on this CPU when the state
  is made and averaged over the ranks; the ``bandwidth`` and ``latency`` you give; the
  all-gather's p decodes, the ring's re-encodes per hop, and for a GPU bucket the
  copies to the host and back) ranks every candidate codec by every strategy. Float32
  and the ``trials`` best are then run in turn on the real bucket, ``trial_steps``
  steps each, during the first steps; the ranks share their times and keep the fastest,
  float32 on a tie, so a configuration measured slower than float32 is never kept. The
  shortlist, the trials and the choice are the crate's (:class:`gradpack.Tuner`, which
  decides for the sync engine and burn too). :meth:`GradpackState.plan` lists the candidates
  with modelled and measured times; rank 0 prints it once decided (``print_plan``), and
  :meth:`GradpackState.state_dict` saves it, so a restored state runs no trials. At two
  ranks its float32 is an all-gather of float32 frames summed in rank order (the ring's
  bytes, and a sum per parameter, so a plan restored into a fresh model continues bit
  for bit).
- Buckets of float64, float16 and bfloat16 are reduced too: the codecs work on a
  float32 copy (float64 buckets that go as float32 are summed in float64).
- ``powersgd=2`` (a rank, or a dict of settings) sends every matrix that PowerSGD
  compresses enough as rank-``r`` factors (Vogels et al., 2019), the arithmetic done by
  gradpack: per bucket, one float32 all-reduce carries every matrix's ``P = M Q``
  together with the bucket's float32 tensors, a second carries the ``Q = M^T P``, with
  warm start and error feedback. Tensors of any other codec take the all-gather. Every
  rank computes the same result to the bit. Unlike PyTorch's ``powerSGD_hook``, the
  warm-start ``Q`` and the residuals are kept per parameter: they follow a parameter
  when DDP regroups its buckets, and :meth:`GradpackState.state_dict` saves them.
- Seeds of stochastic codecs mix the state's seed, the step, the parameter and the rank
  (random-k: not the rank, so all ranks keep the same indices), so ranks round
  independently and a rerun with the same seed is identical.

Error feedback keeps one residual per parameter. :meth:`GradpackState.state_dict`
saves them, and PowerSGD's state, by parameter name with the step counter (make the
state with ``model=``), so a checkpoint stores them beside the model and optimizer, and a
state restored into a fresh DDP model continues bit-identically.

GPU models (DDP over NCCL): a bucket that goes as float32 is all-reduced by DDP's own
group from the hook, as without it (NCCL, device memory). A compressed one is copied to a
reused pinned host buffer on a side CUDA stream, reduced on the host over the hook's gloo
group, and copied back on that stream; the returned future completes on the bucket's
device. ``codec="auto"`` charges the copies, so on a fast fabric it keeps float32. The
tests run it on a GPU where one is present (NCCL, gloo and a mixed ``cpu:gloo,cuda:nccl``
group); the timed runs are CPU training over gloo.
"""

import datetime
import os
import queue
import socket
import sys
import time
import zlib
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

import gradpack
from gradpack import Codec, _native
from gradpack._torch_options import HookOptions
from gradpack._torch_net import (
    _MIN_RING,
    _RING,
    _STAGE,
    _PointToPoint,
    _hosts_by_probe,
    _job_token,
    _shm_dir,
    _shm_free,
    _spans_nodes,
    _tcp,
)

__all__ = ["DiLoCo", "GradpackState", "HookOptions", "gradpack_hook", "measure_link",
           "DEFAULT_CANDIDATES", "BIASED_NEED_FEEDBACK", "RING_BY_DEFAULT"]

DEFAULT_CANDIDATES = ("identity", "fp16", "int8")
"""The codecs ``codec="auto"`` chooses among unless told otherwise: those that train as
float32 does from the first step. Top-k and sign with error feedback send far less but
trail float32 early on (4.4 and 2.0 points after 250 steps in the cluster benchmark,
within a point after 600); add them to ``candidates`` to let ``auto`` trade that for
speed."""

BIASED_NEED_FEEDBACK = ("topk", "chunktopk", "sign")
"""Codecs that get error feedback when ``error_feedback`` is left at ``None``: they drop
or flatten so much of each step's gradient that training needs the residual back."""

RING_BY_DEFAULT = ("fp16", "bf16", "int8", "qsgd", "natural", "ternary", "fp8", "fp4", "codebook")
"""Codecs that go by the compressed ring from 3 ranks up when ``strategy`` is left at
``None``: quantisers, whose partial sums re-encode with an error as bounded as the first
encode's. The ring moves ``2 (p - 1) / p`` frames per rank where the all-gather moves
``p - 1``: at 8 ranks the all-gather of int8 frames moves more bytes than float32's
ring. Sparse codecs (top-k, random-k, ``dct``) and ``sign`` stay on the all-gather,
which sums each rank's own frames once."""

_MASK = (1 << 64) - 1
_IDENTITY = Codec("identity")
_FP32 = ("identity", "fp32")  # the float32 all-reduce, as a configuration
_MIXED = "mixed"  # each parameter with the codec chosen for it in another bucket
# selection='model': the all-gather's tag (bucket indices are small).
_MODEL_TAG = 0xFFFFFFFF
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)



def _hook_error(where: str, e: BaseException) -> RuntimeError:
    """The error a bucket's future carries to DDP: where in the hook, and what."""
    return RuntimeError(f"gradpack hook, {where}: {type(e).__name__}: {e}")



class GradpackState:
    """The hook's configuration and the state it carries across steps.

    Args:
        process_group: the group DDP reduces over (default: the default group).
        model: the model (DDP-wrapped or not), so that residuals are kept and saved by
            parameter name; :meth:`state_dict` needs it when error feedback or
            PowerSGD is on.
        comm_group: the group the hook's messages travel on: it must carry CPU tensors
            (gloo) and hold the process group's ranks in the same order. Default: a
            gloo group the state makes (DDP's own group is never used for them).
        options: the hook's options (:class:`HookOptions`, where each is documented),
            or give them as keywords (``codec`` may also come second, positionally):
            ``GradpackState(model=m, codec="int8", pieces=2)``. Not both. Kept as
            :attr:`options`.

    With ``codec="auto"``, ``strategy`` limits the strategies tried (default all).

    Making a state runs collectives on the group (the hook's own group is made, and
    ``codec="auto"`` averages the measured speeds), so every rank must make it at the
    same point. Call :meth:`close` when training ends.
    """

    def __init__(
        self,
        process_group: Optional[Any] = None,
        codec: Union[None, str, Codec] = None,
        *,
        model: Optional[torch.nn.Module] = None,
        comm_group: Optional[Any] = None,
        options: Optional[HookOptions] = None,
        **keywords: Any,
    ) -> None:
        if options is None:
            options = HookOptions(codec=codec, **keywords)  # checks every option
        elif codec is not None or keywords:
            raise ValueError("give the hook's options as options= or as keywords, not both")
        self.options = options
        o = options
        codec = o.codec
        error_feedback = o.error_feedback
        strategy = o.strategy
        min_compress_elements = o.min_compress_elements
        seed = o.seed
        checksum = o.checksum
        bandwidth = o.bandwidth
        latency = o.latency
        candidates = o.candidates
        calibrate_elements = o.calibrate_elements
        powersgd = o.powersgd
        dct_2d = o.dct_2d
        pieces = o.pieces
        timeout = o.timeout
        trials = o.trials
        trial_steps = o.trial_steps
        print_plan = o.print_plan
        nodes = o.nodes
        node_codec = o.node_codec
        shared_memory = o.shared_memory
        transport = o.transport
        intra_bandwidth = o.intra_bandwidth
        intra_latency = o.intra_latency
        start_step = o.start_step
        momentum = o.momentum
        selection = o.selection
        if codec is None:
            codec = "identity" if powersgd is not None else "int8"
        self._auto = isinstance(codec, str) and codec == "auto"
        self._ps = o.powersgd_settings()
        self.dct_2d = bool(dct_2d)
        self._nodes = None if nodes is None else [int(k) for k in nodes]
        self.shared_memory = bool(shared_memory)
        self.transport = transport
        self._tcp: Optional[gradpack.Tcp] = None
        self._hosts: Optional[List[int]] = None
        self._shm_token: Optional[str] = None
        # host's ranks -> gradpack.SharedMemory: one set of rings (and one stage) for all
        # of this state's collectives, whatever the number of buckets.
        self._shms: Dict[Tuple[int, ...], gradpack.SharedMemory] = {}
        self._shm_ring = _RING  # bytes per ring, as /dev/shm allows
        self._shm_ring_sized = False
        self.node_codec = str(node_codec)
        self.trials = trials
        self.trial_steps = trial_steps
        self.print_plan = bool(print_plan)
        # codec='auto': the crate's measured choice (gradpack.Tuner: the plans per bucket
        # layout and the choice per parameter), made at the first bucket, and a saved
        # plan loaded before it.
        self._tensor_codecs: Dict[Tuple[str, Tuple[int, ...]], Codec] = {}
        self._tuner: Optional[gradpack.Tuner] = None
        self._tuner_saved: Optional[bytes] = None
        self._plan_printed = False
        # An error of the communication thread outside a bucket (sharing a float32 trial's
        # time), raised through the next bucket's future.
        self._late_error: Optional[BaseException] = None
        self._h2d: Optional[float] = None
        self._streams: Dict[Any, Any] = {}
        self.start_step = start_step
        self.momentum = float(momentum)
        # momentum: the crate's velocities, by parameter name.
        self._mom = _native.Momentum(self.momentum) if self.momentum else None
        self.pieces = pieces
        self._rings: Dict[Any, Any] = {}  # (names, elements, codec) -> gradpack.AllReduce
        self._rings_now: Dict[int, Any] = {}  # bucket index -> key of its ring now
        self._ring_restored: Dict[str, Dict[str, Any]] = {}
        self._gathers: Dict[int, Any] = {}  # bucket index -> gradpack.BucketGather
        self._p2p = _PointToPoint(self._comm_group)
        self.process_group = process_group
        self._comm = comm_group
        self._own_comm = comm_group is None
        self._comm_checked = False  # made here, or the given one checked against the ranks
        self._closed = False
        self.timeout = timeout
        spans = nodes is not None or _spans_nodes(process_group)
        if strategy is None and not self._auto and self._ps is None and spans:
            # torchrun on several nodes: full precision inside a node, the codec between.
            strategy = "hierarchical"
        if self._auto and strategy is None:
            self.strategies: Tuple[str, ...] = ("allgather", "ring", "twoshot") + (
                ("hierarchical",) if spans else ())
        else:
            self.strategies = (strategy or "allgather",)
        self.strategy = self.strategies[0]
        self.min_compress_elements = int(min_compress_elements)
        self.seed = int(seed) & _MASK
        self.checksum = bool(checksum)
        self._ef_choice = None if error_feedback is None else bool(error_feedback)
        self.step = 0
        # The all-gather's residuals, by parameter name (the crate's).
        self._tensor_gather = _native.TensorGather(self._ef_choice)
        # PowerSGD: the crate's buckets of matrices, each matrix's state by name.
        self._lr = None if self._ps is None else _native.PowerSgdByName(
            rank=self._ps["rank"], warm_start=self._ps["warm_start"],
            feedback=self._ps["feedback"], min_compression=self._ps["min_compression"],
        )
        self._lr_shapes: Dict[Tuple[int, ...], Optional[Tuple[int, int, int]]] = {}
        # (bucket index, P or Q, length) -> the crate's float32 all-reduce of PowerSGD's
        # factors.
        self._lr_rings: Dict[Tuple[int, int, int], Any] = {}
        self._model = model
        self._names: Optional[Dict[int, str]] = None
        self._buffers: Dict[Any, Any] = {}
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._profiles: Dict[str, gradpack.CodecProfile] = {}
        if self._auto:
            self.bandwidth = (
                gradpack.parse_bandwidth(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
            )
            self.latency = (
                gradpack.parse_duration(latency) if isinstance(latency, str) else float(latency)
            )
            self.intra_bandwidth = (
                gradpack.parse_bandwidth(intra_bandwidth) if isinstance(intra_bandwidth, str)
                else float(intra_bandwidth)
            )
            self.intra_latency = (
                gradpack.parse_duration(intra_latency) if isinstance(intra_latency, str)
                else float(intra_latency)
            )
            self.candidates = [Codec(c) for c in (candidates or DEFAULT_CANDIDATES)]
            if not self.candidates:
                raise ValueError("candidates must name at least one codec")
            self.codec: Optional[Codec] = None
            self._calibrate(calibrate_elements)
            self._choice: Dict[int, Codec] = {}
        else:
            self.codec = Codec(codec)
            self.candidates = [self.codec]
        # strategy left at None: the crate's default for the codec and the world (known
        # at the first bucket).
        self._default_route = strategy is None and self.strategy == "allgather" and (
            self._ps is None and self.codec is not None
        )
        if selection == "model" and (
            self.codec is None or self.codec.name != "topk" or self._ps is not None
            or self.dct_2d or self.strategies != ("allgather",)
        ):
            raise ValueError(
                "selection='model' keeps one top-k over the whole model: it needs a top-k "
                "codec ('topk:...', not 'auto'), the all-gather strategy (the default for "
                "top-k) and no powersgd"
            )
        self.selection = selection
        # selection='model': the step's buckets held (on the host) until its last one,
        # and the crate's one top-k over the model (its residual by parameter name).
        self._pending: List[Any] = []
        self._model_sel: Optional[_native.ModelSelection] = None
        if selection == "model":
            self._model_sel = _native.ModelSelection(
                self.codec.spec, list(dict.fromkeys(self._names_of().values())),
                feedback=self._wants_ef(self.codec), small_below=self.min_compress_elements,
                dct_2d=self.dct_2d,
            )
        # Every option the ranks must share, compared across them before the first
        # bucket (a rank with another seed or codec would otherwise diverge with no
        # error, or fail later with a less clear one).
        self._settings: Dict[str, str] = {
            "codec": "auto" if self._auto else str(self.codec),
            "error_feedback": repr(error_feedback),
            "strategy": ",".join(self.strategies),
            "min_compress_elements": str(self.min_compress_elements),
            "seed": str(self.seed),
            "checksum": str(self.checksum),
            "candidates": ",".join(str(c) for c in self.candidates),
            "bandwidth": repr(getattr(self, "bandwidth", None)),
            "latency": repr(getattr(self, "latency", None)),
            "calibrate_elements": str(calibrate_elements),
            "powersgd": repr(sorted(self._ps.items()) if self._ps else None),
            "dct_2d": str(self.dct_2d),
            "pieces": str(self.pieces),
            "trials": str(self.trials),
            "trial_steps": str(self.trial_steps),
            "nodes": repr(self._nodes),
            "node_codec": self.node_codec,
            "start_step": str(self.start_step),
            "momentum": repr(self.momentum),
            "selection": self.selection,
            "transport": self.transport,
        }
        self._agreed = False
        if dist.is_available() and dist.is_initialized():
            self._comm_group()
            if "hierarchical" in self.strategies:
                self.node_map()

    # ------------------------------------------------------------------ policy

    def _comm_group(self) -> Any:
        """The group the hook's own messages travel on: the one given, or a gloo group of
        the process group's ranks made once (a collective of those ranks). Never DDP's
        group: DDP issues its own collectives on that one from the training thread, and
        two threads on one group interleave their messages differently on different
        ranks."""
        if self._comm is None:
            g = self.process_group
            ranks = None if g is None else dist.get_process_group_ranks(g)
            kw: Dict[str, Any] = {}
            if self.timeout is not None:
                kw["timeout"] = datetime.timedelta(seconds=self.timeout)
            self._comm = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None, **kw
            )
            self._comm_checked = True
        elif not self._comm_checked:
            c = self._comm
            if (dist.get_world_size(c), dist.get_rank(c)) != (self._world(), self._rank()):
                raise ValueError(
                    "comm_group must hold the process group's ranks in the same order "
                    f"(its rank {dist.get_rank(c)} of {dist.get_world_size(c)}, the process "
                    f"group's {self._rank()} of {self._world()})"
                )
            self._comm_checked = True
        return self._comm

    def _agree(self) -> None:
        """Compare the options every rank must share (the crate's agreement, on the
        hook's own messages, before its first bucket): a rank made with another one
        raises on every rank, naming the option."""
        world = self._world()
        if world > 1:
            try:
                gradpack.agree(self._settings, **self._link())
            finally:
                self._p2p.wait()  # this rank's settings reach every peer, agreed or not
        self._agreed = True

    def _job_token(self) -> str:
        """A random token of this state's, the same on every rank (drawn the first time:
        a collective of the hook's group)."""
        if self._shm_token is None:
            self._shm_token = _job_token(self._comm_group())
        return self._shm_token

    def _link(self) -> Dict[str, Any]:
        """The transport arguments of a new collective: the state's :class:`gradpack.Tcp`
        (connected on first use, through torch's store: a collective), or the hook's
        point-to-point callables on its group."""
        if self.transport == "tcp":
            if self._tcp is None:
                self._tcp = _tcp(self._rank(), self._world(), self._job_token(), self.timeout)
            return dict(transport=self._tcp)
        return self._p2p.link()

    def _wants_ef(self, codec: Codec) -> bool:
        return _native.wants_feedback(codec._c, self._ef_choice)

    def _world(self) -> int:
        return dist.get_world_size(self.process_group)

    def _rank(self) -> int:
        return dist.get_rank(self.process_group)

    def _calibrate(self, elements: int) -> None:
        speeds = []
        calibrated = list(dict.fromkeys(self.candidates + [_IDENTITY]))
        for c in calibrated:
            p = gradpack.calibrate(c, elements, 0.1)
            self._profiles[c.spec] = p
            speeds += [p.encode_bytes_per_s, p.decode_bytes_per_s, p.decode_add_bytes_per_s]
        if dist.is_initialized() and self._world() > 1:
            t = torch.tensor(speeds, dtype=torch.float64)
            dist.all_reduce(t, group=self.process_group)
            t /= self._world()
            speeds = t.tolist()
        for i, c in enumerate(calibrated):
            p = self._profiles[c.spec]
            p.encode_bytes_per_s, p.decode_bytes_per_s, p.decode_add_bytes_per_s = speeds[
                3 * i : 3 * i + 3
            ]

    def _auto_model(self) -> "gradpack.Tuner":
        """The crate's tuner with this state's options: the one the hook decides with
        (with the plan loaded by :meth:`load_state_dict`), once the process group exists;
        before, a model of 2 ranks (not kept)."""
        if self._tuner is not None:
            return self._tuner
        live = dist.is_available() and dist.is_initialized()
        t = self._new_tuner(live)
        if live:
            if self._tuner_saved is not None:
                t.restore(self._tuner_saved)
                self._tuner_saved = None
            self._tuner = t
        return t

    def _new_tuner(self, live: bool) -> "gradpack.Tuner":
        nodes = None
        if "hierarchical" in self.strategies:
            nodes = self.node_map() if live else [0, 1]
        return gradpack.Tuner(
            self._world() if live else 2,
            list(self._profiles.values()),
            [c.spec for c in self.candidates],
            routes=list(self.strategies),
            bandwidth=self.bandwidth,
            latency=self.latency,
            intra_bandwidth=self.intra_bandwidth,
            intra_latency=self.intra_latency,
            nodes=nodes,
            small_below=self.min_compress_elements,
            dct_2d=self.dct_2d,
            trials=self.trials,
            trial_steps=self.trial_steps,
        )

    def _auto_blob(self) -> Optional[torch.Tensor]:
        """The crate's blob of auto's plan, as a uint8 tensor (None without one)."""
        blob = self._tuner.save() if self._tuner is not None else self._tuner_saved
        return None if blob is None else torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    def modelled_time(
        self, codec: Union[str, Codec], elements: int, strategy: Optional[str] = None
    ) -> float:
        """The cost model's all-reduce time (s) of ``elements`` elements with ``codec``
        by ``strategy`` (``"allgather"``, ``"ring"``, ``"twoshot"`` or ``"hierarchical"``; default the
        first this state tries) on this state's link and world (``"auto"`` states only;
        before the process group exists it models 2 ranks). ``"identity"`` is the float32
        ring."""
        c = Codec(codec)
        strategy = strategy or self.strategy
        if strategy not in ("allgather", "ring", "twoshot", "hierarchical"):
            raise ValueError(
                f"strategy {strategy!r}: use 'allgather', 'ring', 'twoshot' or 'hierarchical'"
            )
        if c.spec not in self._profiles:
            raise ValueError(f"{c.spec} was not calibrated (not among the candidates)")
        if c == _IDENTITY and strategy != "hierarchical":
            strategy = "fp32"
        return self._auto_model().time(c.spec, strategy, elements)

    def codec_for(
        self, elements: int, ndim: int = 2, shape: Optional[Tuple[int, ...]] = None
    ) -> Codec:
        """The codec a parameter of ``elements`` elements and ``ndim`` dimensions (and
        ``shape``, for ``dct_2d``) is sent with. With ``codec="auto"``: the cost model's
        pick for a tensor of that size before any measurement (the hook goes by
        :meth:`plan`, per bucket)."""
        if shape is None:
            shape = (elements,) if ndim <= 1 else (elements, 1)
        return self._param_codec(self._codec_for(elements), tuple(shape))

    def _param_codec(self, c: Codec, shape: Tuple[int, ...]) -> Codec:
        """``c`` as sent for a parameter of ``shape``: the crate's per-tensor policy
        (float32 for small ones and vectors, and ``dct_2d``'s tiles)."""
        key = (c.spec, shape)
        got = self._tensor_codecs.get(key)
        if got is None:  # once per codec and shape, not per parameter and step
            spec = gradpack.tensor_codec(c.spec, list(shape), self.min_compress_elements, self.dct_2d)
            got = self._tensor_codecs[key] = c if spec == c.spec else Codec(spec)
        return got

    def _codec_for(self, elements: int) -> Codec:
        if not self._auto:
            assert self.codec is not None
            return self.codec
        c = self._choice.get(elements)
        if c is None:
            c = Codec(self._auto_model().modelled_best(elements))
            self._choice[elements] = c
        return c

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        """The step counter, the error-feedback residuals and PowerSGD's warm-start ``Q``
        and residuals by parameter name, as plain values and float32 tensors
        (``torch.save`` and ``torch.load(weights_only=True)`` take it). Needs ``model=``
        when there is such state. Waits for buckets still in flight."""
        self.wait()
        ring_ef = any(self._wants_ef(ar.codec) for ar in self._rings.values())
        if self._model is None and (
            (self._lr and self._lr.states()) or ring_ef or (self._mom and self._mom.velocities())
            or any(s.residuals() for s in self._residual_states())
        ):
            raise ValueError(
                "GradpackState.state_dict needs the model: make the state with "
                "model=ddp_model so residuals and velocities are saved by parameter name"
            )
        residuals = {
            k: torch.from_numpy(r) for s in self._residual_states() for k, r in s.residuals().items()
        }
        low_rank = {
            name: {"q": None if q is None else torch.from_numpy(q), "residual": torch.from_numpy(e)}
            for name, (q, e) in (self._lr.states() if self._lr else {}).items()
        }
        return {
            "format": _FORMAT,
            "step": self.step,
            "seed": self.seed,
            "codec": "auto" if self._auto else str(self.codec),
            "powersgd": None if self._ps is None else dict(self._ps),
            "residuals": residuals,
            "low_rank": low_rank,
            # The rings of the layouts in use now (not those DDP has since regrouped).
            "rings": dict(
                self._ring_restored,
                **{k[0]: ar.state_dict() for k, ar in self._rings.items()},
            ),
            # codec='auto': the plans decided and the choice per parameter (the crate's
            # blob).
            "auto": self._auto_blob(),
            "momentum": self.momentum,
            "velocities": {} if self._mom is None else {
                k: torch.from_numpy(v) for k, v in self._mom.velocities().items()
            },
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the step counter, and each parameter's residual
        and PowerSGD state (used when that parameter's gradient comes next). The codec,
        seed and PowerSGD settings must match this state's."""
        fmt = state.get("format") if isinstance(state, dict) else None
        if fmt == _FORMAT_1 and not state.get("plans"):
            fmt = _FORMAT  # the same fields, and no auto plan to read
        if fmt == _FORMAT_1:
            raise ValueError(
                "this state_dict holds an auto plan in the format of an older gradpack "
                f"({_FORMAT_1}); make the state again (the plan is measured anew)"
            )
        if fmt != _FORMAT:
            raise ValueError(f"not a GradpackState state_dict (no format {_FORMAT!r})")
        mine = "auto" if self._auto else str(self.codec)
        if state["codec"] != mine or int(state["seed"]) != self.seed:
            raise ValueError(
                f"state_dict is for codec {state['codec']!r} seed {state['seed']}; "
                f"this state has {mine!r} seed {self.seed}"
            )
        theirs = state.get("powersgd")
        if theirs != (None if self._ps is None else dict(self._ps)):
            raise ValueError(
                f"state_dict is for PowerSGD settings {theirs!r}; this state has {self._ps!r}"
            )

        def f32(k: str, v: Any) -> np.ndarray:
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
            if t.dtype != torch.float32:
                raise ValueError(f"state of {k!r} has dtype {t.dtype}, expected float32")
            return t.detach().cpu().contiguous().numpy().reshape(-1).copy()

        if float(state.get("momentum", 0.0)) != self.momentum:
            raise ValueError(
                f"state_dict is for momentum {state.get('momentum', 0.0)!r}; this state has "
                f"{self.momentum!r}"
            )
        residuals = {k: f32(k, v) for k, v in state["residuals"].items()}
        velocities = {k: f32(k, v) for k, v in state.get("velocities", {}).items()}
        auto = state.get("auto")
        if auto is not None:
            if not isinstance(auto, torch.Tensor) or auto.dtype != torch.uint8:
                raise ValueError("state_dict's auto plan must be a uint8 tensor")
            auto = auto.cpu().numpy().tobytes()
            if self._auto:  # checked here, before anything changes
                self._new_tuner(dist.is_available() and dist.is_initialized()).restore(auto)
        low_rank = {
            k: (None if v["q"] is None else f32(k, v["q"]), f32(k, v["residual"]))
            for k, v in state.get("low_rank", {}).items()
        }
        self.wait()
        self.step = int(state["step"])
        self._pending = []
        (self._model_sel or self._tensor_gather).restore(residuals)
        if self._lr is not None:
            self._lr.restore(low_rank)
        self._rings.clear()
        self._rings_now.clear()
        self._gathers.clear()
        self._ring_restored = dict(state.get("rings", {}))
        if self._auto:
            self._tuner = None  # made again at the next bucket, from the plan loaded
            self._tuner_saved = auto
            self._plan_printed = auto is not None
        if self._mom is not None:
            self._mom.restore(velocities)

    def wait(self) -> None:
        """Block until every submitted bucket has been reduced."""
        if self._worker is not None:
            self._queue.join()

    def close(self) -> None:
        """End the hook's use of the network, before ``destroy_process_group()``: wait
        for buckets in flight, meet the other ranks (a barrier on the hook's group, so no
        rank tears its connections down while a peer's last messages are on the way: gloo
        can abort the process then), and destroy the group the state made. A collective
        of the group's ranks. The state keeps its residuals and plan (``state_dict``
        still works) but reduces no more buckets."""
        self.wait()
        if self._closed:
            return
        self._closed = True
        if self._comm is not None and dist.is_initialized():
            dist.barrier(group=self._comm)
            if self._own_comm:
                dist.destroy_process_group(self._comm)
        self._comm = None
        # The connections close once the collectives made with them are gone too.
        self._tcp = None

    # ------------------------------------------------------------------ the work

    def _names_of(self) -> Dict[int, str]:
        if self._names is None:
            self._names = {}
            if self._model is not None:
                for name, q in self._model.named_parameters():
                    if name.startswith("module."):
                        name = name[len("module.") :]
                    self._names[id(q)] = name
        return self._names

    def _layout(self, bucket: dist.GradBucket) -> List[Tuple[str, int, int, int, Tuple[int, ...]]]:
        """(key, elements, ndim, seed key, shape) of each parameter of the bucket, in
        order."""
        names = self._names_of()
        out = []
        for pos, p in enumerate(bucket.parameters()):
            name = names.get(id(p))
            shape = tuple(p.shape)
            if name is not None:
                out.append((name, p.numel(), p.dim(), zlib.crc32(name.encode()), shape))
            else:
                out.append(
                    (f"id:{id(p)}", p.numel(), p.dim(), (bucket.index() << 20) + pos, shape)
                )
        return out

    def _momentum(self, buf: torch.Tensor, layout: List[Any]) -> None:
        """``momentum``: the bucket's gradients replaced by their parameters' velocities,
        ``u = momentum * u + g``, by the crate (float32, by parameter name, on the host).
        Runs on the training thread, in DDP's stream order."""
        assert self._mom is not None
        tensors = [(e[0], list(e[4])) for e in layout]
        flat = buf.view(-1)
        if flat.dtype == torch.float32 and not flat.is_cuda:
            self._mom.apply(flat.numpy(), tensors)
            return
        host = self._buffer(  # reused: no allocation per step
            ("momentum", flat.numel()),
            lambda: torch.empty(flat.numel(), dtype=torch.float32, pin_memory=flat.is_cuda),
        )
        host.copy_(flat)  # waits for the gradients on DDP's stream
        self._mom.apply(host.numpy(), tensors)
        flat.copy_(host)

    def _buffer(self, key: Any, make) -> Any:
        b = self._buffers.get(key)
        if b is None:
            b = make()
            self._buffers[key] = b
        return b

    def _submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        buf = bucket.buffer()
        if buf.dtype not in _DTYPES:
            raise TypeError(
                f"gradpack's hook reduces float32, float64, float16 and bfloat16 buckets, "
                f"not {buf.dtype}"
            )
        if self._closed:
            raise RuntimeError("this GradpackState was closed; make a new one to train on")
        if not self._comm_checked:
            self._comm_group()  # a state made before the process group: made now
        if not self._agreed:
            self._agree()
        index, step, layout = bucket.index(), self.step, self._layout(bucket)
        last = bucket.is_last()
        if last:
            self.step += 1
        n = buf.numel()
        if sum(e[1] for e in layout) != n:  # not seen; one tensor then
            layout = [(f"bucket:{index}", n, 2, index, (n, 1))]
        if self.momentum:
            self._momentum(buf, layout)
        world = self._world()
        if world > 1 and step >= self.start_step:
            cfg, plan = self._config(index, layout, n, buf.is_cuda)
        else:
            cfg, plan = _FP32, None
        # Float32: DDP's own all-reduce on its own group, issued here in DDP's order, as
        # DDP's default hook does: on a GPU its backend (NCCL) moves device memory with
        # no host copies; on the CPU it skips the hand-over to the comm thread (8 ranks
        # at 10 Gbit/s: 1.18x the step without the hook through the thread). float16
        # and bfloat16 CPU buckets go the thread's way, summed in float32; auto at two
        # ranks too, where float32 is an all-gather summed per parameter.
        direct = buf.is_cuda or (
            buf.dtype in (torch.float32, torch.float64) and not (self._auto and world == 2)
        )
        if direct and world > 1 and cfg == _FP32 and not self._low_rank_of(layout, step):
            t0 = time.perf_counter()
            work = dist.all_reduce(buf, group=self.process_group, async_op=True)

            def done(f: Any) -> torch.Tensor:
                if plan is not None:
                    self._queue.put(("time", plan, time.perf_counter() - t0))
                return f.value()[0].div_(world)

            return work.get_future().then(done)
        if buf.is_cuda:
            fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future(devices=[buf.device])
            ready: Any = torch.cuda.Event()
            ready.record()  # the gradients are ready on DDP's stream at this point
        else:
            fut = torch.futures.Future()
            ready = None
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="gradpack-comm", daemon=True)
            self._worker.start()
        self._queue.put(("reduce", buf, index, step, layout, cfg, plan, ready, fut, last))
        return fut

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job[0] == "time":  # a float32 trial on DDP's group finished
                    try:
                        self._record(job[1], job[2])
                    except BaseException as e:  # the next bucket's future carries it
                        self._late_error = e
                    continue
                _, buf, index, step, layout, cfg, plan, ready, fut, last = job
                if self.selection == "model" and cfg != _FP32 and self._world() > 1:
                    self._collect(buf, index, step, layout, ready, fut, last)
                    continue
                try:
                    late, self._late_error = self._late_error, None
                    if late is not None:
                        raise RuntimeError(f"sharing auto's trial times failed: {late}") from late
                    t0 = time.perf_counter()
                    out = self._reduce(buf, index, step, layout, cfg, ready)
                    if plan is not None:
                        self._record(plan, time.perf_counter() - t0)
                    self._complete(fut, out)
                except BaseException as e:  # the future carries it to DDP
                    if plan is not None and self._tuner is not None:
                        # A trial failed (on every rank): its plan is measured again.
                        self._tuner.restart(plan)
                    fut.set_exception(_hook_error(f"bucket {index} of step {step}", e))
            finally:
                self._queue.task_done()

    def _complete(self, fut: Any, out: torch.Tensor) -> None:
        """``fut`` completed with the reduced bucket ``out``, on its side stream for a
        CUDA bucket (so that DDP's stream waits for the copy back)."""
        if out.is_cuda:
            with torch.cuda.stream(self._stream(out.device)):
                fut.set_result(out)
        else:
            fut.set_result(out)

    def _collect(
        self,
        buf: torch.Tensor,
        index: int,
        step: int,
        layout: List[Any],
        ready: Any,
        fut: Any,
        last: bool,
    ) -> None:
        """``selection="model"``: the bucket copied to the host (where it is not there
        already) and its future held; at the step's last bucket, every held bucket
        reduced at once (:meth:`_model_reduce`) and every future completed."""
        pending = self._pending
        if pending and pending[0][2] != step:
            # A step that never handed over its last bucket (its backward failed).
            gone = RuntimeError(
                f"gradpack hook: step {pending[0][2]} ended before its last bucket arrived"
            )
            for held in pending:
                held[4].set_exception(gone)
            pending.clear()
        try:
            host = self._to_host(buf, index, ready, exact=False)
        except BaseException as e:
            fut.set_exception(_hook_error(f"bucket {index} of step {step}", e))
            return
        pending.append((buf, host, step, layout, fut))
        if not last:
            return
        self._pending = []
        try:
            self._model_reduce([(h, lay) for _, h, _, lay, _ in pending], step)
            for b, h, _, _, _ in pending:
                self._from_host(b, h)
        except BaseException as e:  # every held future carries it to DDP
            err = _hook_error(f"step {step} (selection='model')", e)
            for *_, f in pending:
                f.set_exception(err)
            return
        for b, _, _, _, f in pending:
            self._complete(f, b)

    def _model_reduce(self, parts: List[Tuple[torch.Tensor, List[Any]]], step: int) -> None:
        """``selection="model"``: the step's buckets (``(host copy, layout)`` each)
        reduced together by the crate's :class:`gradpack.ModelSelection` (one top-k over
        every compressed parameter in the model's order, with its error feedback; the
        others as float32 frames; one all-gather), the means written into the copies."""
        sel = self._model_sel
        assert sel is not None
        buckets = [
            (flat.view(-1).numpy(), [(key, list(shape), skey) for key, _, _, skey, shape in lay])
            for flat, lay in parts
        ]
        g = self._gather_of(_MODEL_TAG)
        try:
            sel.reduce(g._g, buckets, seed=self.seed, step=step, checksum=self.checksum)
        except BaseException:
            self._p2p.drop()
            raise
        self._p2p.wait()

    def _stream(self, device: Any) -> Any:
        """The side CUDA stream of ``device`` that the hook's host copies run on."""
        st = self._streams.get(device)
        if st is None:
            st = self._streams[device] = torch.cuda.Stream(device=device)
        return st

    def _to_host(self, buf: torch.Tensor, index: int, ready: Any, exact: bool) -> torch.Tensor:
        """The bucket as a flat host tensor the codecs read: ``buf`` itself when it is a
        CPU float32 (or, with ``exact``, float64) tensor, else a copy in a reused
        (pinned, for a GPU) buffer."""
        want = torch.float64 if exact and buf.dtype == torch.float64 else torch.float32
        if not buf.is_cuda and buf.dtype == want:
            return buf.view(-1)
        host = self._buffer(
            ("host", index, buf.numel(), want),
            lambda: torch.empty(buf.numel(), dtype=want, pin_memory=buf.is_cuda),
        )
        if buf.is_cuda:
            st = self._stream(buf.device)
            st.wait_event(ready)
            with torch.cuda.stream(st):
                host.copy_(buf.view(-1), non_blocking=True)
            st.synchronize()
        else:
            host.copy_(buf.view(-1))
        return host

    def _from_host(self, buf: torch.Tensor, host: torch.Tensor) -> None:
        if host.data_ptr() == buf.data_ptr():
            return
        if buf.is_cuda:
            st = self._stream(buf.device)
            with torch.cuda.stream(st):
                buf.view(-1).copy_(host, non_blocking=True)
            st.synchronize()
        else:
            buf.view(-1).copy_(host)

    def _reduce(
        self,
        buf: torch.Tensor,
        index: int,
        step: int,
        layout: List[Any],
        cfg: Tuple[str, str],
        ready: Any,
    ) -> torch.Tensor:
        world = self._world()
        if world == 1:
            return buf
        base = Codec(cfg[0]) if cfg[0] != _MIXED else None
        codecs = [self._layout_codec(base, e) for e in layout]
        low_rank = self._low_rank_of(layout, step)
        ring = None
        if cfg[1] in ("ring", "twoshot", "hierarchical", "majority"):
            assert base is not None
            ring = self._param_codec(base, (buf.numel(), 1))  # the whole bucket's codec
        plain = not low_rank and cfg[1] != "hierarchical" and (
            cfg[1] == "fp32" or all(c == _IDENTITY for c in codecs) or ring == _IDENTITY
        )
        host = self._to_host(buf, index, ready, exact=plain)
        flat = host.view(-1)
        if low_rank:
            self._powersgd(flat, layout, codecs, low_rank, index, step, world)
        elif plain and self._auto and world == 2 and flat.dtype == torch.float32:
            # Two ranks: float32 frames all-gathered and summed in rank order move the
            # ring's bytes, and give a sum per parameter that does not depend on how DDP
            # groups them (so a plan restored into a fresh model continues bit for bit).
            self._allgather(flat, layout, [_IDENTITY] * len(layout), index, step, world)
        elif plain:
            dist.all_reduce(flat, group=self._comm_group())
            flat.div_(world)
        elif ring is not None:
            self._ring(flat, layout, ring, index, step, world, cfg[1])
        else:
            self._allgather(flat, layout, codecs, index, step, world)
        self._from_host(buf, host)
        return buf

    def _layout_codec(self, base: Optional[Codec], e: Tuple[str, int, int, int, Any]) -> Codec:
        """The codec of the layout entry ``e`` under a configuration whose codec is
        ``base`` (``None``: each parameter's own choice, for a layout of parameters
        decided in other buckets)."""
        name, _, _, _, shape = e
        if base is None:
            assert self._tuner is not None
            spec, strategy = self._tuner.choice_of(name)
            base = _IDENTITY if strategy == "fp32" else Codec(spec)
        return self._param_codec(base, shape)

    # ------------------------------------------------------------------ auto

    def _config(
        self, index: int, layout: List[Any], n: int, cuda: bool
    ) -> Tuple[Tuple[str, str], Optional[int]]:
        """The configuration (codec spec, strategy) a bucket goes by this time, and with
        ``codec="auto"`` the crate's plan number while that plan is still being measured
        (else ``None``)."""
        if not self._auto:
            assert self.codec is not None
            if self.codec == _IDENTITY:
                return _FP32, None
            if self._default_route:
                route = _native.default_strategy(self.codec._c, self._world())
                return (self.codec.spec, route), None
            return (self.codec.spec, self.strategy), None
        staging = self._copy_speed() if cuda else None
        spec, route, trial = self._auto_model().next(
            index, [(e[0], list(e[4])) for e in layout], staging
        )
        return (spec, route), trial

    def _copy_speed(self) -> float:
        """Bytes/s of a host-device round of copies through pinned memory, measured once."""
        if self._h2d is None:
            n = 16 << 20
            dev = torch.empty(n // 4, device="cuda")
            host = torch.empty(n // 4, pin_memory=True)
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                host.copy_(dev, non_blocking=True)
                dev.copy_(host, non_blocking=True)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            self._h2d = 2 * n / best
        return self._h2d

    def _record(self, trial: int, elapsed: float) -> None:
        """Hand a trial's time to the crate's tuner; after the plan's last, the ranks
        share their times (on the hook's transport, at the same point of every rank's
        sequence) and keep the fastest configuration, float32 on a tie."""
        tuner = self._tuner
        assert tuner is not None
        try:
            tuner.record(trial, elapsed, **self._link())
        except BaseException:
            self._p2p.drop()
            raise
        self._p2p.wait()
        if self.print_plan and self._rank() == 0 and not self._plan_printed and tuner.decided():
            self._plan_printed = True
            print(tuner.table(), file=sys.stderr, flush=True)

    def plan(self) -> List[Dict[str, Any]]:
        """``codec="auto"``'s plan for the buckets of the last step: one row per bucket and
        configuration tried, with ``bucket`` (DDP's bucket index), ``tensors``, ``elements``,
        ``codec``, ``strategy``, ``modelled_ms`` and ``measured_ms`` (the mean over the
        ranks of each rank's best trial; ``None`` until measured), and ``chosen``."""
        return [] if self._tuner is None else self._tuner.plan()

    def plan_table(self) -> str:
        """:meth:`plan` as a text table, the chosen rows marked with ``*``."""
        return self._auto_model().table()

    def _allgather(
        self,
        flat: torch.Tensor,
        layout: List[Any],
        codecs: List[Optional[Codec]],
        index: int,
        step: int,
        world: int,
    ) -> None:
        """The bucket's tensors encoded (each with its codec, seed and residual), all-gathered
        and summed by the crate's :class:`gradpack._native.TensorGather` over collective
        ``index``'s :class:`gradpack.BucketGather` (each tensor's frames summed in rank
        order, the same sum on every rank, in one fused pass); those whose codec is
        ``None`` are left as they are (PowerSGD reduces them)."""
        tensors = [
            (key, list(shape), skey, None if c is None else c._c)
            for c, (key, _, _, skey, shape) in zip(codecs, layout)
        ]
        g = self._gather_of(index)
        try:
            self._tensor_gather.reduce(
                g._g, flat.numpy(), tensors, seed=self.seed, step=step, checksum=self.checksum
            )
        except BaseException:
            self._p2p.drop()
            raise
        self._p2p.wait()

    def _residual_states(self) -> List[Any]:
        """The crate's objects holding residuals by parameter name."""
        return [self._tensor_gather] + ([self._model_sel] if self._model_sel else [])

    def _gather_of(self, index: int) -> "gradpack.BucketGather":
        """Collective ``index``'s :class:`gradpack.BucketGather` (made on first use)."""
        g = self._gathers.get(index)
        if g is None:
            g = gradpack.BucketGather(
                op="mean", tag=index & 0xFFFFFFFF, **self._link(),
                **self._shared_memory(list(range(self._world())), stage=False),
            )
            self._gathers[index] = g
        return g

    def _low_rank_of(self, layout: List[Any], step: int) -> List[Tuple[int, Tuple[int, int, int]]]:
        """(position, (n, m, r)) of the bucket's tensors sent as PowerSGD factors at
        ``step`` (none before its start step)."""
        ps = self._ps
        if ps is None or step < max(ps["start_step"], self.start_step):
            return []
        out = []
        for i, e in enumerate(layout):
            shape = e[4]
            if shape not in self._lr_shapes:
                self._lr_shapes[shape] = gradpack.powersgd_matrix(
                    shape, ps["rank"], ps["min_compression"]
                )
            mat = self._lr_shapes[shape]
            if mat is not None:
                out.append((i, mat))
        return out

    def _powersgd(
        self,
        flat: torch.Tensor,
        layout: List[Any],
        codecs: List[Codec],
        low_rank: List[Tuple[int, Tuple[int, int, int]]],
        index: int,
        step: int,
        world: int,
    ) -> None:
        """Reduce a bucket whose matrices ``low_rank`` go as PowerSGD factors: the crate's
        whole step (``PowerSgdByName.exchange``: their ``P`` in one float32
        all-reduce with the bucket's float32 tensors, their ``Q`` in a second), then the
        tensors of other codecs by the all-gather."""
        x = flat.numpy()
        starts = [int(v) for v in np.cumsum([0] + [e[1] for e in layout])]
        lr_pos = [i for i, _ in low_rank]
        lr_set = set(lr_pos)
        names = tuple(layout[i][0] for i in lr_pos)
        mats = [mat for _, mat in low_rank]
        plain = [
            (starts[i], layout[i][1])
            for i, c in enumerate(codecs) if i not in lr_set and c == _IDENTITY
        ]
        # P is n x r and Q is m x r per matrix.
        p_len, q_len = sum(n * r for n, _, r in mats), sum(m * r for _, m, r in mats)
        first = self._f32_ring(index, 0x40000000, p_len + sum(k for _, k in plain))
        second = self._f32_ring(index, 0x80000000, q_len)
        assert self._lr is not None
        try:
            # The matrices stay in the bucket: the steps read and write them in place;
            # their state is the crate's, by name.
            self._lr.exchange(
                list(names), mats, [starts[i] for i in lr_pos], x, self.seed, step & _MASK,
                plain, first._ar, second._ar,
            )
        except BaseException:
            self._p2p.drop()
            raise
        self._p2p.wait()
        rest = [
            None if i in lr_set or c == _IDENTITY else c for i, c in enumerate(codecs)
        ]
        if any(c is not None for c in rest):
            self._allgather(flat, layout, rest, index, step, world)

    def _f32_ring(self, index: int, kind: int, n: int) -> "gradpack.AllReduce":
        """The crate's float32 ring of ``n`` elements (a mean) on the hook's transport, one
        per bucket, kind and length (PowerSGD's factors; ``kind`` tells its two
        all-reduces of a bucket apart)."""
        key = (index, kind, n)
        ar = self._lr_rings.get(key)
        if ar is None:
            ar = gradpack.AllReduce(
                "identity", n, strategy="fp32-ring", op="mean",
                checksum=self.checksum, pieces=self.pieces,
                tag=kind | (index & 0x3FFFFFFF), **self._link(),
                **self._shared_memory(list(range(self._world())), stage=False),
            )
            for k in [k for k in self._lr_rings if k[:2] == key[:2]]:
                del self._lr_rings[k]  # the bucket's other length is gone
            self._lr_rings[key] = ar
        return ar

    def node_map(self) -> List[int]:
        """The node of every rank of the process group, for ``strategy="hierarchical"``
        (the ``nodes`` given, or found once: a collective of the group)."""
        if self._nodes is None:
            key = os.environ.get("GROUP_RANK") or socket.gethostname()
            keys: List[Any] = [None] * self._world()
            dist.all_gather_object(keys, key, group=self._comm_group())
            order: Dict[Any, int] = {}
            self._nodes = [order.setdefault(k, len(order)) for k in keys]
        if len(self._nodes) != self._world():
            raise ValueError(f"nodes lists {len(self._nodes)} ranks; the group has {self._world()}")
        return self._nodes

    def host_map(self) -> List[int]:
        """The host of every rank of the process group (``0 ..``): ranks that share
        ``/dev/shm`` (found once, a collective of the group: each rank leaves a file
        there and looks for the others')."""
        if self._hosts is None:
            self._hosts = _hosts_by_probe(self._comm_group(), self._world(), self._rank())
        return self._hosts

    def _shared_memory(self, members: List[int], stage: bool) -> Dict[str, Any]:
        """The shared-memory argument of a new collective whose messages between the
        ranks ``members`` may go through shared memory: those of them on this rank's
        host. Every collective of the state with the same host ranks shares one
        :class:`gradpack.SharedMemory` (with a stage when the state may run the
        two-level all-reduce), made on first use (in the same order on every rank: the
        buckets' order). None when ``/dev/shm`` lacks the room (found once, together)."""
        if not self.shared_memory:
            return {}
        hosts, me = self.host_map(), self._rank()
        staged = "hierarchical" in self.strategies
        if not self._shm_ring_sized:
            # A collective: every rank comes here the first time, whatever its host.
            self._job_token()
            self._shm_room(hosts, staged)
            self._shm_ring_sized = True
        if not self.shared_memory:
            return {}
        host = tuple(r for r in members if hosts[r] == hosts[me])
        if len(host) < 2:
            return {}
        shm = self._shms.get(host)
        if shm is None:
            name = f"gp{self._job_token()}-{zlib.crc32(repr(host).encode()):08x}"
            shm = gradpack.SharedMemory(
                name, me, self._world(), list(host),
                timeout=300.0 if self.timeout is None else float(self.timeout),
                stage=_STAGE if staged else 0, capacity=self._shm_ring,
                job=int(self._job_token(), 16),
            )
            self._shms[host] = shm
        return dict(shared_memory=shm)

    def _shm_room(self, hosts: List[int], staged: bool) -> None:
        """Size the state's shared memory to what ``/dev/shm`` holds, on every rank
        together (a collective): per rank, a ring per other rank of the host (two sets
        when the two-level all-reduce's nodes split a host) and the stage. The rings get
        1 MiB each where there is room, less (down to 64 KiB; the same on every rank)
        where there is not; if even that does not fit on some rank's host, every rank
        goes without shared memory (a warning says so) rather than fail at set-up."""
        me = self._rank()
        mine = [r for r in range(len(hosts)) if hosts[r] == hosts[me]]
        sets = 1
        if staged:
            nodes = self.node_map()
            if [r for r in mine if nodes[r] == nodes[me]] != mine:
                sets = 2
        h = len(mine)
        fixed = (_STAGE if staged else 0) + (64 << 10)  # the stage, the file's header
        free = _shm_free()
        ring = _RING
        if h >= 2:
            fits = (free // h - fixed) // ((h - 1) * sets)
            ring = min(_RING, max(0, fits) // _MIN_RING * _MIN_RING)
        agreed = torch.tensor([ring], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._comm_group())
        self._shm_ring = int(agreed.item())
        if self._shm_ring < _MIN_RING:
            self.shared_memory = False
            if ring < _MIN_RING:
                need = h * ((h - 1) * _MIN_RING * sets + fixed)
                warnings.warn(
                    f"gradpack: {_shm_dir()} has {free / 2**20:.0f} MiB free; the hook's "
                    f"shared memory needs at least {need / 2**20:.0f} MiB for the {h} ranks "
                    "of this host, so messages between them go through the process group "
                    "instead (give the container more, e.g. docker run --shm-size=1g, or "
                    "pass shared_memory=False to silence this)",
                    RuntimeWarning, stacklevel=2,
                )

    def _ring(
        self, flat: torch.Tensor, layout: List[Any], codec: Codec, index: int, step: int,
        world: int, strategy: str = "ring",
    ) -> None:
        """The crate's compressed ring or majority vote (:class:`gradpack.AllReduce`), or
        its two-level all-reduce (:class:`gradpack.Hierarchical`), on the whole bucket,
        its messages sent point to point on the process group. One all-reduce, with its
        residuals, per bucket layout (DDP regroups its buckets once, after the first
        step: the residuals of the first layout are then dropped)."""
        names = ",".join(e[0] for e in layout)
        key = (names, flat.numel(), str(codec), strategy)
        ar = self._rings.get(key)
        if ar is None:
            common = dict(
                **self._link(),
                feedback="worker+owner" if self._wants_ef(codec) else "none",
                pieces=self.pieces if strategy != "majority" else 1,
                checksum=self.checksum,
                tag=index & 0xFFFFFFFF,
            )
            if strategy == "hierarchical":
                nodes = self.node_map()
                mine = [r for r in range(world) if nodes[r] == nodes[self._rank()]]
                ar = gradpack.Hierarchical(
                    codec, flat.numel(), nodes=nodes, node_codec=self.node_codec, **common,
                    **self._shared_memory(mine, stage=True),
                )
            else:
                ar = gradpack.AllReduce(
                    codec, flat.numel(), strategy=strategy, **common,
                    **self._shared_memory(list(range(world)), stage=False),
                )
            saved = self._ring_restored.pop(names, None)
            if saved is not None:
                ar.load_state_dict(saved)
            self._rings[key] = ar
        old = self._rings_now.get(index)
        if old is not None and old != key:
            del self._rings[old]  # DDP regrouped its buckets: that layout is gone
        self._rings_now[index] = key
        try:
            # The crate mixes the rank into the seed itself (rank 0 here: the same
            # seed on every rank).
            ar.run(flat.numpy(), seed=_native.tensor_seed(codec._c, self.seed, step, index, 0))
        except BaseException:
            self._p2p.drop()
            raise
        self._p2p.wait()


_FORMAT = "gradpack.torch.GradpackState/2"
_FORMAT_1 = "gradpack.torch.GradpackState/1"  # auto's plan as Python values


def measure_link(
    process_group: Optional[Any] = None, small: int = 1 << 10, large: int = 4 << 20, repeats: int = 5
) -> Tuple[float, float]:
    """Estimate the group's link as ``(bandwidth bit/s, latency s)`` by timing float32
    all-reduces of ``small`` and ``large`` elements (best of ``repeats``) and solving the
    ring model ``2(p - 1) latency + 2(p - 1)/p bytes * 8 / bandwidth`` for both. A
    collective: every rank must call it. The estimate averages over the ranks, so they all
    return the same figures; pass them to :class:`GradpackState` for ``codec="auto"``.
    """
    import time

    world = dist.get_world_size(process_group)
    if world < 2:
        raise ValueError("measure_link needs at least 2 ranks")
    times = []
    for n in (small, large):
        t = torch.ones(n)
        dist.all_reduce(t, group=process_group)  # warm the connection
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=process_group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=process_group)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    est = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(est, group=process_group)
    t_small, t_large = (est / world).tolist()
    hops = 2.0 * (world - 1)
    bits = lambda n: hops / world * 4.0 * n * 8.0
    per_bit = max((t_large - t_small) / (bits(large) - bits(small)), 1e-15)
    latency = max((t_small - bits(small) * per_bit) / hops, 0.0)
    return 1.0 / per_bit, latency


def gradpack_hook(
    state: GradpackState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, gradpack_hook)``.

    Returns a future of the bucket's gradients averaged over the ranks; the reduction
    runs on the state's communication thread.
    """
    return state._submit(bucket)


# DiLoCo lives in a module of its own (gradpack.torch.DiLoCo is its public name).
from gradpack._torch_diloco import DiLoCo  # noqa: E402

DiLoCo.__module__ = __name__
