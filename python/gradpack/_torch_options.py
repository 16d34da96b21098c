"""The PyTorch hook's options as one object, documented once: :class:`HookOptions`.

:class:`gradpack.torch.GradpackState` takes them as keywords or as ``options=``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Union

import gradpack
from gradpack import Codec

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

_POWERSGD_KEYS = ("rank", "warm_start", "feedback", "min_compression", "start_step")
_STRATEGIES = ("allgather", "ring", "twoshot", "hierarchical", "majority")


def _powersgd_settings(p: Union[None, int, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The ``powersgd`` argument as a dict of every setting, checked."""
    if p is None:
        return None
    if isinstance(p, bool) or not isinstance(p, (int, dict)):
        raise TypeError(f"powersgd must be a rank (int) or a dict of settings, not {p!r}")
    d = {"rank": p} if isinstance(p, int) else dict(p)
    unknown = set(d) - set(_POWERSGD_KEYS)
    if unknown or "rank" not in d:
        raise ValueError(
            f"powersgd settings {sorted(unknown)} unknown or rank missing; use {_POWERSGD_KEYS}"
        )
    out = {
        "rank": int(d["rank"]),
        "warm_start": bool(d.get("warm_start", True)),
        "feedback": bool(d.get("feedback", True)),
        "min_compression": float(d.get("min_compression", 2.0)),
        "start_step": int(d.get("start_step", 0)),
    }
    if out["start_step"] < 0:
        raise ValueError("powersgd start_step must be >= 0")
    gradpack.powersgd_matrix((out["rank"], out["rank"]), out["rank"], out["min_compression"])
    return out


def _positive_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, not {v!r}")


@dataclasses.dataclass(frozen=True)
class HookOptions:
    """Every option of the PyTorch hook (:class:`gradpack.torch.GradpackState`), checked
    when made: a bad value raises ``ValueError`` naming the option (``TypeError`` for a
    ``powersgd`` of the wrong type). Give them to ``GradpackState`` as keywords, or make
    one ``HookOptions`` and pass it as ``options=`` (to keep, compare or reuse it):
    ``GradpackState(model=m, options=HookOptions(codec="int8", pieces=2))``.

    Attributes:
        codec: a spec such as ``"int8"`` or ``"topk:ratio=0.01,values=fp16"``, a
            :class:`gradpack.Codec`, ``"identity"`` (plain float32 all-reduce) or
            ``"auto"``; default ``"int8"`` (``"identity"`` with ``powersgd``).
        error_feedback: ``True``, ``False``, or ``None`` for on exactly when the codec
            is one of :data:`BIASED_NEED_FEEDBACK` (top-k, chunked top-k, sign).
        strategy: how a bucket's compressed tensors are summed. Default ``"ring"``
            from 3 ranks up for the codecs of :data:`RING_BY_DEFAULT` (int8, fp16, ...:
            quantisers), else ``"allgather"``; ``"hierarchical"`` when torchrun's
            ``LOCAL_WORLD_SIZE`` says the ranks sit on several nodes of more than one.
            With ``codec="auto"`` the default is to try them all (``"hierarchical"``
            where the ranks sit on several nodes, or ``nodes`` is given).

            - ``"allgather"``: each rank encodes each parameter once (with its error
              feedback) into one message; the crate's :class:`gradpack.BucketGather`
              gathers the messages and sums each parameter's frames in rank order.
              Parameters under ``min_compress_elements`` elements and one-dimensional
              ones (biases, norm scales) go as float32, so the result does not depend
              on how DDP groups parameters into buckets. Moves ``p - 1`` frames per
              rank.
            - ``"ring"``: gradpack's compressed ring (:class:`gradpack.AllReduce`) on
              the whole bucket: each of the ``2(p - 1)`` hops moves one ``1/p`` chunk,
              partial sums are re-encoded on the way. It moves ``2(p - 1)/p`` frames
              per rank, so it pays from 3 ranks up for dense codecs. With error
              feedback each rank keeps a residual for what it encodes from its own data
              and, as a chunk's owner, for the chunk's final encode; ``pieces``
              pipelines each chunk. Its residuals belong to the bucket's layout.
            - ``"twoshot"``: each rank encodes chunk ``c`` once and sends it to rank
              ``c``, which sums the chunk in float32, encodes the sum once and sends it
              to every rank: the ring's bytes in two steps of latency, each element
              quantised twice whatever the number of ranks.
            - ``"hierarchical"``: the two-level all-reduce
              (:class:`gradpack.Hierarchical`): a float32 reduce-scatter inside each
              node, the codec's all-reduce of each shard between nodes (error feedback
              there), an all-gather inside the node. Nodes from ``nodes``, torchrun's
              ``GROUP_RANK`` or the host names.
            - ``"majority"``: signSGD with majority vote, for the ``sign`` codec: each
              element the sign most ranks sent times the ranks' summed magnitudes divided
              by the ranks (the mean when all agree). Not a sum, so only when asked
              for.
        nodes: ``strategy="hierarchical"``: the node of every rank of the process
            group (a list of node numbers, ``0 .. N``). Default: ranks share a node when
            their ``GROUP_RANK`` (set by torchrun: the node's rank) or, without it,
            their host names are equal.
        node_codec: ``strategy="hierarchical"``: the codec inside a node,
            ``"identity"`` (float32, the default), ``"bf16"`` or ``"fp16"``.
        intra_bandwidth, intra_latency: ``codec="auto"`` with nodes: the link between
            ranks of a node that the cost model assumes (default 40 Gbit/s and 5 us,
            shared memory) when it ranks the two-level all-reduce against the flat
            ones; ``bandwidth`` is then the link between nodes. The shortlist is timed
            on the real buckets, so the guess only decides what is tried.
        min_compress_elements: parameters with fewer elements go as float32. With
            top-k, a small last layer (a classifier's) loses most to sparsification:
            sending it as float32 (a threshold just above its size) costs few bytes
            and, in the bundled DDP benchmark's training, halved top-k's accuracy gap
            to float32.
        seed: the base of every stochastic draw.
        checksum: seal frames with a CRC-32 that receivers verify.
        bandwidth, latency: the link, for ``"auto"`` (bit/s or a string such as
            ``"1Gbit/s"``; seconds or a string such as ``"50us"``).
        candidates: the codecs ``"auto"`` chooses from (default
            :data:`DEFAULT_CANDIDATES`).
        calibrate_elements: the tensor size ``"auto"`` measures codec speeds on.
        powersgd: send matrices as PowerSGD factors: a rank (``2``), or a dict with
            ``rank`` and any of ``warm_start`` (True), ``feedback`` (True),
            ``min_compression`` (2.0) and ``start_step`` (0: plain float32 steps
            before PowerSGD starts). The other tensors go with ``codec``, which then
            defaults to ``"identity"`` (float32, as PyTorch's PowerSGD hook sends them).
            Per bucket, one float32 all-reduce carries every matrix's ``P = M Q``
            with the bucket's float32 tensors and a second its ``Q = M^T P``; tensors
            of other codecs take the all-gather. Unlike PyTorch's ``powerSGD_hook``,
            each matrix's warm-start ``Q`` and residual are kept by parameter name.
        dct_2d: with a ``dct`` codec of ``width=0``, send each parameter of two or more
            dimensions in ``chunk x chunk`` tiles of its matrix (``shape[0]`` rows of the
            other dimensions' product), as DeMo does, instead of tiles along the flat
            tensor. A tile then holds ``chunk**2`` coefficients: ``dct:chunk=8,k=4``
            in 2-D sends about what ``dct:chunk=64,k=4`` sends in 1-D.
        pieces: ``strategy="ring"`` and ``"twoshot"``: split each chunk into this many
            frames, so that encoding and decoding overlap the link (a pipelined ring).
        timeout: seconds the hook's group waits for a peer (default: torch's).
        trials: ``codec="auto"``: how many of the modelled best configurations are
            measured against float32.
        trial_steps: ``codec="auto"``: steps each configuration runs while measured
            (the best of them counts).
        print_plan: ``codec="auto"``: rank 0 prints the plan to stderr once decided.
        shared_memory: the ring and ``strategy="hierarchical"`` send their messages
            between ranks of one host through shared memory instead of the hook's
            group (default ``True``; which ranks share a host is found once, by each
            rank leaving a file in ``/dev/shm`` and looking for the others').
        transport: how the hook's messages travel between ranks. ``"tcp"`` (the
            default): gradpack's native transport (:class:`gradpack.Tcp`), connected
            once through torch's store (each rank publishes its listening address
            there); the collectives send and receive from Rust, with no Python call per
            message. ``"process_group"``: point-to-point operations on the hook's group
            (``comm_group``), every message through Python. Ranks of one host use
            shared memory either way where ``shared_memory`` allows, and the results are
            the same to the bit. ``GRADPACK_SOCKET_IFNAME`` (an interface's name or an
            address) names the interface to listen on; by default, the one that reaches
            the store's host.
        start_step: the steps before this one (counted from 0) all-reduce every bucket
            in float32, as DDP does without a hook; compression, error feedback,
            PowerSGD and ``"auto"``'s trials begin at it. Compressed from the first step
            (the default, 0), error feedback delays early updates, when gradients are
            largest and change fastest: deep gradient compression warms up so, and
            PyTorch's PowerSGD hook by ``start_powerSGD_iter``.
        selection: ``"tensor"`` (the default): a sparse codec keeps its ``ratio`` of
            every parameter; ``"model"``: top-k keeps ``ratio`` of all compressed
            parameters together, chosen over the whole model after backward (global
            top-k: a layer with large gradients gets the share its magnitudes earn; the
            step's buckets are held until the last one, so it does not overlap
            backward). Only with a ``topk`` codec and the all-gather. In the
            bundled DDP benchmark's training (4 ranks, 250 steps, top-k 1% with error
            feedback and momentum correction, eleven seeds) it halved the mean gap to
            float32's accuracy, 1.17 to 0.60 points, and its spread across seeds.
        momentum: momentum correction (deep gradient compression's): each rank keeps a
            velocity ``u = momentum * u + g`` per parameter, in float32, and the hook
            all-reduces ``u`` where it would have all-reduced ``g``. The crate keeps
            the velocities by parameter name and updates them as the sync engine's
            ``momentum`` option does, bit for bit; they live on the host, so a CUDA
            bucket makes a round trip to the host for them (two copies of it per
            step). Compression and error feedback then act on the update
            momentum SGD applies rather than on the raw gradient, so what a lossy codec
            delays or drops is not missing from the optimizer's momentum too. **Make the
            optimizer without momentum** (``torch.optim.SGD(..., momentum=0)``): the
            gradients DDP hands it are then the ranks' averaged velocity, and with
            float32 the step is momentum SGD's (``dampening=0``, not Nesterov) up to
            rounding. The hook cannot see the optimizer, and momentum applied there as
            well would be applied twice. Weight decay in the optimizer is added after
            the velocity rather than inside it; a parameter DDP leaves without a
            gradient (``find_unused_parameters``) has a zero gradient here, so its
            velocity decays. Default ``0.0``: off. The velocities are in
            :meth:`state_dict`.

    """

    codec: Union[None, str, Codec] = None
    error_feedback: Optional[bool] = None
    strategy: Optional[str] = None
    min_compress_elements: int = 16384
    seed: int = 0
    checksum: bool = False
    bandwidth: Union[None, float, str] = None
    latency: Union[float, str] = 50e-6
    candidates: Optional[Sequence[str]] = None
    calibrate_elements: int = 1 << 20
    powersgd: Union[None, int, Dict[str, Any]] = None
    dct_2d: bool = False
    pieces: int = 1
    timeout: Optional[float] = None
    trials: int = 2
    trial_steps: int = 2
    print_plan: bool = True
    nodes: Optional[Sequence[int]] = None
    node_codec: str = "identity"
    shared_memory: bool = True
    transport: str = "tcp"
    intra_bandwidth: Union[float, str] = 40e9
    intra_latency: Union[float, str] = 5e-6
    start_step: int = 0
    momentum: float = 0.0
    selection: str = "tensor"

    def __post_init__(self) -> None:
        auto = isinstance(self.codec, str) and self.codec == "auto"
        ps = _powersgd_settings(self.powersgd)
        strategy = self.strategy
        if ps is not None and strategy not in (None, "allgather"):
            raise ValueError("powersgd needs strategy='allgather' (the default)")
        if ps is not None and auto:
            raise ValueError(
                "powersgd with codec='auto' is not supported: give the codec of the tensors "
                "PowerSGD does not take (default float32)"
            )
        if strategy not in (None,) + _STRATEGIES:
            raise ValueError(
                f"strategy {strategy!r}: use 'allgather', 'ring', 'twoshot', 'hierarchical' "
                "or 'majority'"
            )
        if strategy == "majority" and (
            auto or not isinstance(self.codec, (str, Codec))
            or Codec(self.codec) == Codec("identity")
        ):
            raise ValueError(
                "strategy='majority' votes on the signs of a compressed codec's frames "
                "(meant for codec='sign'); give that codec, not 'auto' or float32"
            )
        if self.transport not in ("tcp", "process_group"):
            raise ValueError(f"transport {self.transport!r}: use 'tcp' or 'process_group'")
        _positive_int("trials", self.trials)
        _positive_int("trial_steps", self.trial_steps)
        if self.min_compress_elements < 0:
            raise ValueError("min_compress_elements must be >= 0")
        s = self.start_step
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"start_step must be an int >= 0, not {s!r}")
        m = self.momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), not {m!r}")
        _positive_int("pieces", self.pieces)
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(
                f"timeout must be a positive number of seconds, not {self.timeout!r}"
            )
        if self.selection not in ("tensor", "model"):
            raise ValueError(f"selection {self.selection!r}: use 'tensor' or 'model'")
        if self.selection == "model" and (
            auto or ps is not None or self.dct_2d or strategy not in (None, "allgather")
            or Codec(self.codec or "int8").name != "topk"
        ):
            raise ValueError(
                "selection='model' keeps one top-k over the whole model: it needs a top-k "
                "codec ('topk:...', not 'auto'), the all-gather strategy (the default for "
                "top-k) and no powersgd or dct_2d"
            )
        if auto:
            if self.bandwidth is None:
                raise ValueError(
                    "codec='auto' needs the link: pass bandwidth= (bit/s or e.g. '10Gbit/s')"
                )
            if self.candidates is not None and not list(self.candidates):
                raise ValueError("candidates must name at least one codec")
        elif self.codec is not None:
            Codec(self.codec)  # an unknown codec is an error here

    def powersgd_settings(self) -> Optional[Dict[str, Any]]:
        """``powersgd`` as a dict of every setting (``None`` without PowerSGD)."""
        return _powersgd_settings(self.powersgd)
