"""A PyTorch DDP communication hook that compresses gradient buckets with gradpack.

DDP hands the hook each bucket of gradients (a flat tensor of up to 25 MiB by default)
as soon as backward has produced it, and waits for the returned future before the
optimizer step. The hook stages the bucket on the host and hands it to the crate's
reducer (:class:`gradpack.HookReducer`), which decides everything and runs it with the
GIL released: the step's configuration (the float32 warm-up of ``start_step``, the
codec's strategy, or ``codec="auto"``'s measured choice), each parameter's codec,
error feedback, PowerSGD and the one top-k over the model. Every rank ends with the
same averaged gradient, bit for bit::

    import gradpack.torch as gpt

    model = torch.nn.parallel.DistributedDataParallel(net)
    state = gpt.GradpackState(codec="topk:ratio=0.01,values=fp16", error_feedback=True)
    model.register_comm_hook(state, gpt.gradpack_hook)
    ...                                   # training
    state.close()                         # before dist.destroy_process_group()

The options are :class:`HookOptions` (each documented there; the strategies under
``strategy``). What this module does itself is glue:

- The hook's messages travel on gradpack's native transport (``transport="tcp"``, the
  default: :class:`gradpack.Tcp`, connected once through torch's store, every message
  sent and received in Rust) or, with ``transport="process_group"``, point to point on a
  gloo group of the state's own (or ``comm_group``); between ranks of one host, through
  shared memory either way (one set of rings per state, sized to what ``/dev/shm``
  holds). Never on DDP's group: DDP sends collectives of its own on that group from the
  training thread (``find_unused_parameters``, ``static_graph``), and two threads on one
  group interleave their messages differently on different ranks. Make the state on
  every rank at the same point, after ``init_process_group``. A rank that dies makes
  the others' hooks raise (``timeout`` bounds the wait for one that hangs).
- The work runs on one communication thread per state, in the order DDP hands the
  buckets over, while backward goes on. A bucket the crate sends as a plain float32
  all-reduce goes by DDP's own group (NCCL on GPUs), as without the hook, or by the
  hook's gloo group for float16 and bfloat16 buckets. The codecs work on a float32 copy
  of float64, float16 and bfloat16 buckets (float64 ones sent as float32 sum in float64).
- GPU buckets are copied to a reused pinned host buffer on a side CUDA stream, reduced
  on the host and copied back on that stream; the future completes on the bucket's
  device. ``codec="auto"`` charges the copies, so on a fast fabric it keeps float32.
- ``codec="auto"`` measures float32 and the ``trials`` configurations the cost model
  ranks best in turn on the real bucket, ``trial_steps`` steps each; the hook times each
  bucket (its host copies included), and the crate's :class:`gradpack.Tuner` shares the
  times and keeps the fastest, float32 on a tie (:meth:`GradpackState.plan`).
- ``selection="model"`` holds the step's buckets until the last one, then the crate
  reduces them together; ``momentum`` replaces each bucket's gradients by the crate's
  velocities on the training thread. Seeds of stochastic codecs mix the state's seed,
  the step, the parameter and the rank (random-k: not the rank).

Each parameter's state (error-feedback residual, PowerSGD's warm-start ``Q`` and
residual, velocity) is kept by parameter name, so it follows a parameter when DDP
regroups its buckets after the first step, and :meth:`GradpackState.state_dict` saves it
with the step counter and ``auto``'s plan (make the state with ``model=``): a state
restored into a fresh DDP model continues bit-identically.
"""

import dataclasses
import math
import queue
import sys
import time
import zlib
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

import gradpack
from gradpack import Codec, _native
from gradpack._torch_options import (
    BIASED_NEED_FEEDBACK, DEFAULT_CANDIDATES, RING_BY_DEFAULT, HookOptions,
)
from gradpack._torch_net import _Links, _shared_memories, _spans_nodes, measure_link

__all__ = ["DiLoCo", "GradpackState", "HookOptions", "gradpack_hook", "measure_link",
           "DEFAULT_CANDIDATES", "BIASED_NEED_FEEDBACK", "RING_BY_DEFAULT"]

_MASK = (1 << 64) - 1
_IDENTITY = Codec("identity")
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
        self.options = o = options
        codec = o.codec
        if codec is None:
            codec = "identity" if o.powersgd is not None else "int8"
        self._auto = isinstance(codec, str) and codec == "auto"
        self._ps = o.powersgd_settings()
        self.dct_2d = bool(o.dct_2d)
        self.shared_memory = bool(o.shared_memory)
        self.transport = o.transport
        # This host's shared memory (by id) and the bytes of each ring, once connected.
        self._shms: Dict[int, Any] = {}
        self._shm_ring = 0
        self.node_codec = str(o.node_codec)
        self.trials, self.trial_steps = o.trials, o.trial_steps
        self.print_plan = bool(o.print_plan)
        # codec='auto': the crate's measured choice (gradpack.Tuner), made at the first
        # bucket, and a saved plan loaded before it.
        self._tuner: Optional[gradpack.Tuner] = None
        self._tuner_saved: Optional[bytes] = None
        self._plan_printed = False
        # An error of the communication thread outside a bucket (sharing a float32 trial's
        # time), raised through the next bucket's future.
        self._late_error: Optional[BaseException] = None
        self._h2d: Optional[float] = None
        self._streams: Dict[Any, Any] = {}
        self.start_step = o.start_step
        self.momentum = float(o.momentum)
        # momentum: the crate's velocities, by parameter name.
        self._mom = _native.Momentum(self.momentum) if self.momentum else None
        self.pieces = o.pieces
        self.process_group = process_group
        self.timeout = o.timeout
        # The hook's group, its native transport and the maps of hosts and nodes.
        self._net = _Links(process_group, comm_group, o.timeout, o.transport,
                           None if o.nodes is None else [int(k) for k in o.nodes])
        self._closed = False
        strategy = o.strategy
        spans = o.nodes is not None or _spans_nodes(process_group)
        if strategy is None and not self._auto and self._ps is None and spans:
            # torchrun on several nodes: full precision inside a node, the codec between.
            strategy = "hierarchical"
        if self._auto and strategy is None:
            self.strategies: Tuple[str, ...] = ("allgather", "ring", "twoshot") + (
                ("hierarchical",) if spans else ())
        else:
            self.strategies = (strategy or "allgather",)
        self.strategy = self.strategies[0]
        self.min_compress_elements = int(o.min_compress_elements)
        self.seed = int(o.seed) & _MASK
        self.checksum = bool(o.checksum)
        self._ef_choice = o.error_feedback
        self.step = 0
        self._model = model
        self._names: Optional[Dict[int, str]] = None
        self._buffers: Dict[Any, Any] = {}
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._worker: Optional[threading.Thread] = None
        self._profiles: Dict[str, gradpack.CodecProfile] = {}
        if self._auto:
            self.bandwidth = _seconds_or(gradpack.parse_bandwidth, o.bandwidth)
            self.latency = _seconds_or(gradpack.parse_duration, o.latency)
            self.intra_bandwidth = _seconds_or(gradpack.parse_bandwidth, o.intra_bandwidth)
            self.intra_latency = _seconds_or(gradpack.parse_duration, o.intra_latency)
            self.candidates = [Codec(c) for c in (o.candidates or DEFAULT_CANDIDATES)]
            self.codec: Optional[Codec] = None
            self._calibrate(o.calibrate_elements)
            self._choice: Dict[int, Codec] = {}
        else:
            self.codec = Codec(codec)
            self.candidates = [self.codec]
        if o.selection == "model" and self.strategies != ("allgather",):
            raise ValueError(f"selection='model' needs the all-gather, not {self.strategy!r}")
        self.selection = o.selection
        # selection='model': the step's buckets held (on the host) until its last one.
        self._pending: List[Any] = []
        ps = self._ps
        # Everything decided and run per bucket, and the state by parameter name: the
        # crate's. strategy left at None: the crate's default for the codec and world.
        default_route = o.strategy is None and self.strategy == "allgather" and ps is None
        self._eng = _native.HookReducer(
            None if self._auto else self.codec,
            strategy=None if default_route else self.strategy,
            feedback=self._ef_choice, seed=self.seed, checksum=self.checksum,
            pieces=self.pieces, small_below=self.min_compress_elements, dct_2d=self.dct_2d,
            start_step=self.start_step, node_codec=self.node_codec,
            powersgd=None if ps is None else tuple(ps[k] for k in _PS_KEYS),
            selection=list(dict.fromkeys(self._names_of().values()))
            if o.selection == "model" else None,
        )
        self._connected = False
        # Every option the ranks must share, compared across them before the first
        # bucket (a rank with another seed or codec would otherwise diverge with no
        # error, or fail later with a less clear one): as this state reads them.
        mine = dict(codec="auto" if self._auto else str(self.codec), seed=self.seed,
                    strategy=self.strategies, candidates=[str(c) for c in self.candidates],
                    bandwidth=getattr(self, "bandwidth", None), nodes=self._net.nodes,
                    latency=getattr(self, "latency", None), powersgd=ps, momentum=self.momentum,
                    min_compress_elements=self.min_compress_elements)
        self._settings = {f.name: repr(mine.get(f.name, getattr(o, f.name)))
                          for f in dataclasses.fields(o) if f.name not in _RANK_OWN}
        self._agreed = False
        if dist.is_available() and dist.is_initialized():
            self._net.group()
            if "hierarchical" in self.strategies:
                self.node_map()

    # ------------------------------------------------------------------ plumbing

    def _engine(self) -> Any:
        """The crate's reducer, connected (on first use, on the communication thread,
        at the same bucket on every rank: collectives of the hook's group) to the hook's
        transport and this host's shared memory."""
        if not self._connected:
            kw = self._net.link()
            hier = "hierarchical" in self.strategies
            if hier:
                kw["nodes"] = self.node_map()
            if self.shared_memory:
                host, node, self._shm_ring = _shared_memories(
                    self._net.group(), self._rank(), self.host_map(),
                    self.node_map() if hier else None, self._net.job_token(), self.timeout,
                    flat=self.strategies != ("hierarchical",),
                )
                kw.update(shared_memory=host, node_memory=node)
                self._shms = {id(s): s for s in (host, node) if s is not None}
            self._eng.connect(**kw)
            self._connected = True
        return self._eng

    def _world(self) -> int:
        return self._net.world()

    def _rank(self) -> int:
        return self._net.rank()

    def node_map(self) -> List[int]:
        """The node of every rank of the process group, for ``strategy="hierarchical"``
        (the ``nodes`` given, or found once: a collective of the group)."""
        return self._net.node_map()

    def host_map(self) -> List[int]:
        """The host of every rank of the process group (``0 ..``): ranks that share
        ``/dev/shm`` (found once, a collective of the group: each rank leaves a file
        there and looks for the others')."""
        return self._net.host_map()

    def _agree(self) -> None:
        """Compare the options every rank must share (the crate's agreement, on the
        hook's own messages, before its first bucket): a rank made with another one
        raises on every rank, naming the option."""
        if self._world() > 1:
            self._net.call(gradpack.agree, self._settings, **self._net.link())
        self._agreed = True

    # ------------------------------------------------------------------ auto

    def _calibrate(self, elements: int) -> None:
        """The candidates' speeds on this CPU, averaged over the ranks by the crate (so
        every rank's model ranks alike)."""
        calibrated = list(dict.fromkeys(self.candidates + [_IDENTITY]))
        profiles = [gradpack.calibrate(c, elements, 0.1) for c in calibrated]
        fields = ("encode_bytes_per_s", "decode_bytes_per_s", "decode_add_bytes_per_s")
        if dist.is_initialized() and self._world() > 1:
            speeds = [getattr(p, f) for p in profiles for f in fields]
            mean = self._net.call(_native.mean_over_ranks, speeds, **self._net.link())
            for i, p in enumerate(profiles):
                for j, f in enumerate(fields):
                    setattr(p, f, mean[3 * i + j])
        self._profiles = {c.spec: p for c, p in zip(calibrated, profiles)}

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
            self._world() if live else 2, list(self._profiles.values()),
            [c.spec for c in self.candidates], routes=list(self.strategies),
            bandwidth=self.bandwidth, latency=self.latency,
            intra_bandwidth=self.intra_bandwidth, intra_latency=self.intra_latency,
            nodes=nodes, small_below=self.min_compress_elements, dct_2d=self.dct_2d,
            trials=self.trials, trial_steps=self.trial_steps,
        )

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
        ``shape``, for ``dct_2d``) is sent with: the crate's per-tensor policy (float32
        for small ones and vectors, ``dct_2d``'s tiles). With ``codec="auto"``: the
        cost model's pick for a tensor of that size before any measurement (the hook
        goes by :meth:`plan`, per bucket)."""
        if shape is None:
            shape = (elements,) if ndim <= 1 else (elements, 1)
        if self._auto:
            c = self._choice.get(elements)
            if c is None:
                c = self._choice[elements] = Codec(self._auto_model().modelled_best(elements))
        else:
            assert self.codec is not None
            c = self.codec
        spec = gradpack.tensor_codec(c.spec, list(shape), self.min_compress_elements, self.dct_2d)
        return c if spec == c.spec else Codec(spec)

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
        self._net.call(tuner.record, trial, elapsed, **self._net.link())
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

    # ------------------------------------------------------------------ state

    def _saved_as(self) -> List[Tuple[str, str]]:
        """The options a saved state must share with this one, as it saves them."""
        ps = self._ps
        return [("codec", "auto" if self._auto else str(self.codec)), ("seed", str(self.seed)),
                ("powersgd", repr(sorted(ps.items())) if ps else "None"),
                ("momentum", repr(self.momentum))]

    def state_dict(self) -> Dict[str, Any]:
        """The hook's state as the crate's :class:`gradpack.NamedState` (the step
        counter; each parameter's error-feedback residual, velocity and PowerSGD state
        by name; the rings of the bucket layouts in use; ``auto``'s plan): one blob with
        a checksum, in a uint8 tensor under ``"state"``, so ``torch.save`` and
        ``torch.load(weights_only=True)`` take it and any front end of the crate reads
        its bytes. Needs ``model=`` when there is per-parameter state. Waits for buckets
        still in flight."""
        self.wait()
        if self._model is None and (
            self._eng.holds_state() or (self._mom and self._mom.velocities())
        ):
            raise ValueError(
                "GradpackState.state_dict needs the model: make the state with "
                "model=ddp_model so residuals and velocities are saved by parameter name"
            )
        plan = self._tuner.save() if self._tuner is not None else self._tuner_saved
        blob = self._eng.save_state(
            self._saved_as(), self.step, {} if self._mom is None else self._mom.velocities(),
            None if plan is None else bytes(plan),
        )
        return {"format": _FORMAT, "state": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}

    def load_state_dict(self, state: Union[Dict[str, Any], bytes]) -> None:
        """Restore a :meth:`state_dict` (one of an older gradpack too), or the bytes of a
        :class:`gradpack.NamedState` saved by any front end of the crate: the step
        counter, and each parameter's state (used when its gradient comes next). The
        codec, seed, PowerSGD settings and momentum must match this state's."""
        ns = _named_state(state)
        ns.check(self._saved_as())
        auto = ns.plan
        if auto is not None and self._auto:  # checked here, before anything changes
            self._new_tuner(dist.is_available() and dist.is_initialized()).restore(auto)
        self.wait()
        self._eng.restore_state(ns)
        self.step = ns.step
        self._pending = []
        if self._auto:
            self._tuner = None  # made again at the next bucket, from the plan loaded
            self._tuner_saved = auto
            self._plan_printed = auto is not None
        if self._mom is not None:
            self._mom.restore(ns.velocities)

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
        self._net.close()
        self._eng.disconnect()  # the connections close with the collectives made on them
        self._connected = False

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

    def _layout(self, bucket: dist.GradBucket) -> List[Tuple[str, List[int], int]]:
        """(key, shape, seed key) of each parameter of the bucket, in order."""
        names = self._names_of()
        out = []
        for pos, p in enumerate(bucket.parameters()):
            name = names.get(id(p))
            if name is not None:
                out.append((name, list(p.shape), zlib.crc32(name.encode())))
            else:
                out.append((f"id:{id(p)}", list(p.shape), (bucket.index() << 20) + pos))
        return out

    def _momentum(self, buf: torch.Tensor, layout: List[Any]) -> None:
        """``momentum``: the bucket's gradients replaced by their parameters' velocities,
        ``u = momentum * u + g``, by the crate (float32, by parameter name, on the host).
        Runs on the training thread, in DDP's stream order."""
        assert self._mom is not None
        tensors = [(e[0], e[1]) for e in layout]
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
        if key not in self._buffers:
            self._buffers[key] = make()
        return self._buffers[key]

    def _submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        buf = bucket.buffer()
        if buf.dtype not in _DTYPES:
            raise TypeError(
                f"gradpack's hook reduces float32, float64, float16 and bfloat16 buckets, "
                f"not {buf.dtype}"
            )
        if self._closed:
            raise RuntimeError("this GradpackState was closed; make a new one to train on")
        self._net.group()  # a state made before the process group: made now
        if not self._agreed:
            self._agree()
        index, step, layout = bucket.index(), self.step, self._layout(bucket)
        last = bucket.is_last()
        if last:
            self.step += 1
        n = buf.numel()
        if sum(math.prod(e[1]) for e in layout) != n:  # not seen; one tensor then
            layout = [(f"bucket:{index}", [n, 1], index)]
        if self.momentum:
            self._momentum(buf, layout)
        world = self._world()
        # The crate decides: float32 before start_step, the codec's strategy, or auto's
        # measured plan (trial: its plan number while measured).
        tuner = self._auto_model() if self._auto and world > 1 else None
        codec, route, trial = self._eng.config(
            index, step, world, [e[:2] for e in layout],
            self._copy_speed() if buf.is_cuda and tuner is not None else None, tuner,
        )
        # Float32: DDP's own all-reduce on its own group, issued here in DDP's order, as
        # DDP's default hook does: on a GPU its backend (NCCL) moves device memory with
        # no host copies; on the CPU it skips the hand-over to the comm thread (8 ranks
        # at 10 Gbit/s: 1.18x the step without the hook through the thread). float16
        # and bfloat16 CPU buckets go the thread's way, summed in float32; auto at two
        # ranks too, where float32 is an all-gather summed per parameter.
        direct = buf.is_cuda or (
            buf.dtype in (torch.float32, torch.float64) and not (self._auto and world == 2)
        )
        if direct and world > 1 and route == "fp32":
            t0 = time.perf_counter()
            work = dist.all_reduce(buf, group=self.process_group, async_op=True)

            def done(f: Any) -> torch.Tensor:
                if trial is not None:  # the front end's own transport: timed here
                    self._queue.put(("time", trial, time.perf_counter() - t0))
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
        self._queue.put(("reduce", buf, index, step, layout, (codec, route), trial, ready, fut,
                         last))
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
                if self.selection == "model" and cfg[1] != "fp32" and self._world() > 1:
                    self._collect(buf, index, step, layout, ready, fut, last)
                    continue
                try:
                    late, self._late_error = self._late_error, None
                    if late is not None:
                        raise RuntimeError(f"sharing auto's trial times failed: {late}") from late
                    t0 = time.perf_counter()  # a trial's time: the bucket's, copies included
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
        self, buf: torch.Tensor, index: int, step: int, layout: List[Any], ready: Any,
        fut: Any, last: bool,
    ) -> None:
        """``selection="model"``: the bucket on the host and its future held; at the
        step's last bucket, every held bucket reduced at once by the crate (one top-k
        over the model, one all-gather) and every future completed."""
        pending = self._pending
        if pending and pending[0][2] != step:  # a step whose backward failed
            gone = RuntimeError(f"gradpack hook: step {pending[0][2]} ended before its last bucket")
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
            parts = [(h.view(-1).numpy(), lay) for _, h, _, lay, _ in pending]
            self._net.call(self._engine().reduce_model, parts, step)
            for b, h, _, _, _ in pending:
                self._from_host(b, h)
        except BaseException as e:  # every held future carries it to DDP
            err = _hook_error(f"step {step} (selection='model')", e)
            for *_, f in pending:
                f.set_exception(err)
            return
        for b, _, _, _, f in pending:
            self._complete(f, b)

    def _stream(self, device: Any) -> Any:
        """The side CUDA stream of ``device`` that the hook's host copies run on."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

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
        self, buf: torch.Tensor, index: int, step: int, layout: List[Any],
        cfg: Tuple[str, str], ready: Any,
    ) -> torch.Tensor:
        """The bucket staged on the host and reduced by the crate, which decides every
        tensor's codec and runs the strategy with its error feedback; a bucket it leaves
        as a float32 all-reduce goes by the hook's group."""
        world = self._world()
        if world == 1:
            return buf
        eng = self._engine()
        # Only a float64 bucket stages differently when it goes as plain float32.
        exact = buf.dtype == torch.float64 and eng.plain(layout, cfg[0], cfg[1], step, self._tuner)
        host = self._to_host(buf, index, ready, exact=exact)
        flat = host.view(-1)
        if not self._net.call(
            eng.reduce, flat.numpy(), index, step, layout, cfg[0], cfg[1], self._tuner
        ):
            dist.all_reduce(flat, group=self._net.group())
            flat.div_(world)
        self._from_host(buf, host)
        return buf


def _seconds_or(parse: Any, v: Union[str, float]) -> float:
    """A bandwidth or a duration: parsed from a string such as ``"10Gbit/s"``, or taken
    as a number."""
    return parse(v) if isinstance(v, str) else float(v)


def _named_state(state: Any) -> "gradpack.NamedState":
    """A saved hook state as the crate's named state: its bytes, a state dict of this
    format, or one of the format before it (its fields as tensors by name)."""
    if isinstance(state, (bytes, bytearray, memoryview)):
        return _native.NamedState.load(bytes(state))
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt == _FORMAT:
        blob = state.get("state")
        if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
            raise ValueError("a GradpackState state_dict's 'state' must be a uint8 tensor")
        return _native.NamedState.load(blob.cpu().numpy().tobytes())
    if fmt == _FORMAT_1 and state.get("plans"):
        raise ValueError(
            "this state_dict holds an auto plan in the format of an older gradpack "
            f"({_FORMAT_1}); make the state again (the plan is measured anew)"
        )
    if fmt not in (_FORMAT_1, _FORMAT_2):
        raise ValueError(f"not a GradpackState state_dict (no format {_FORMAT!r})")
    ps, auto = state.get("powersgd"), state.get("auto")
    if auto is not None and (not isinstance(auto, torch.Tensor) or auto.dtype != torch.uint8):
        raise ValueError("state_dict's auto plan must be a uint8 tensor")
    return _native.NamedState(
        [("codec", state["codec"]), ("seed", str(int(state["seed"]))),
         ("powersgd", repr(sorted(ps.items())) if ps else "None"),
         ("momentum", repr(float(state.get("momentum", 0.0))))],
        int(state["step"]),
        {k: _f32(k, v) for k, v in state["residuals"].items()},
        {k: _f32(k, v) for k, v in state.get("velocities", {}).items()},
        {k: (None if v["q"] is None else _f32(k, v["q"]), _f32(k, v["residual"]))
         for k, v in state.get("low_rank", {}).items()},
        {k: [v["blob"]] if "blob" in v else list(v["streams"])
         for k, v in state.get("rings", {}).items()},
        None if auto is None else auto.cpu().numpy().tobytes(),
    )


def _f32(k: str, v: Any) -> np.ndarray:
    """A saved float32 tensor (or array) of ``k`` as a flat numpy copy."""
    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    if t.dtype != torch.float32:
        raise ValueError(f"state of {k!r} has dtype {t.dtype}, expected float32")
    return t.detach().cpu().contiguous().numpy().reshape(-1).copy()


_PS_KEYS = ("rank", "warm_start", "feedback", "min_compression", "start_step")
# Options each rank may set as it likes: the others are compared across the ranks.
_RANK_OWN = ("timeout", "print_plan")


_FORMAT = "gradpack.torch.GradpackState/3"  # the crate's NamedState blob
_FORMAT_2 = "gradpack.torch.GradpackState/2"  # its fields as tensors by name
_FORMAT_1 = "gradpack.torch.GradpackState/1"  # auto's plan as Python values


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

DiLoCo.__module__ = measure_link.__module__ = __name__
