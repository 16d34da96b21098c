"""``gradpack.torch.DiLoCo``: DiLoCo's outer loop on a PyTorch model, its arithmetic and
schedule the crate's (:class:`gradpack.OuterSync`)."""

import datetime
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

import gradpack
from gradpack import Codec
from gradpack._torch_elastic import Elastic
from gradpack._torch_net import _PointToPoint, _job_token, _tcp


class DiLoCo:
    """DiLoCo's outer synchronisation for a PyTorch model (Douillard et al. 2023), and its
    streaming variant: every rank trains ``model`` alone with ``inner_optimizer``, and
    every ``sync_every`` inner steps the ranks all-reduce the mean of their
    pseudo-gradients (outer parameters minus local ones) compressed with ``codec``, take
    a step of the outer optimizer (SGD with ``outer_lr`` and Nesterov ``outer_momentum``;
    ``outer_momentum=0`` for none), and continue from the new outer parameters::

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        diloco = gpt.DiLoCo(model, opt, sync_every=50, codec="int8")
        for x, y in data:                 # no DDP: each rank trains on its own shard
            loss_fn(model(x), y).backward()
            opt.step()                    # DiLoCo runs after every inner step
            opt.zero_grad()
        diloco.close()

    The arithmetic and the schedule are the Rust crate's (:class:`gradpack.OuterSync`);
    the all-reduces are gradpack's own collectives, running on a communication thread of
    their own, their messages on gradpack's native transport (``transport="tcp"``, the
    default: :class:`gradpack.Tcp`, connected through torch's store) or sent point to
    point on a gloo group of ``group``'s ranks made here (``"process_group"``); either
    way a CUDA model on NCCL works too, and the results are the same to the bit. The
    names follow torchft's ``DiLoCo`` where they mean the same:

    - ``fragments``: a number P (the parameters cut in order into P runs of about equal
      size) or a list of modules of ``model`` (torchft's ``model_fragments``), synced at
      staggered steps, each once every ``sync_every`` steps.
    - ``delay`` (torchft's ``fragment_sync_delay``): a fragment's all-reduce starts this
      many inner steps before its sync point and runs while training goes on; ``delay=1``
      with one fragment is the one-step-delayed variant.
    - ``alpha`` (``fragment_update_alpha``): at the sync point,
      ``local = alpha * local + (1 - alpha) * outer``.
    - ``error_feedback``: a residual per rank for what the codec drops (``None``: on
      for every codec but ``"identity"``). With ``outer_momentum=0`` and ``outer_lr=1``
      it takes the place of momentum, as in SparseLoCo (``codec="chunktopk"``);
      ``feedback_beta`` decays the residual before each round's pseudo-gradient is
      added (SparseLoCo's ``beta``, below 1 so that an unsent displacement, sent again
      every round, does not pile up).

    The outer copy, the momentum and the residuals live in host memory (float32). For
    CPU float32 parameters the synchroniser reads and writes the parameters in place;
    for others (CUDA, other float types) it keeps a pinned float32 host copy of each
    and copies only the tensors of the fragments due. The model's parameters are made
    equal on every rank first: the group's first rank sends its state to the ranks whose
    parameters differ (the crate's healing; packed with the ``lossless`` codec where the
    ``bandwidth`` given makes that pay), and ranks that already agree exchange only a
    status. Every rank ends
    each outer step with the same outer parameters, to the bit. ``state_dict`` saves
    the synchroniser's state, to save beside the model and the inner optimizer;
    restored with them, training continues bit for bit.

    **Replicas that leave and join** (``manager``, a torchft ``Manager`` of this replica
    group, ``use_async_quorum=False``): torch.distributed is then not needed. Each
    outer sync runs among the replicas of the manager's quorum: before a sync (at each
    fragment's formation step) the manager starts a quorum, gradpack connects its
    native transport among the quorum's replicas through the quorum's store, and the
    crate heals them (:meth:`gradpack.OuterSync.heal`): the replica with the newest
    state (the most inner steps, then outer steps) sends it, bit for bit, to every
    replica whose state differs (a replica that joins or restarts: its parameters
    become the outer copy, its residuals zero; its inner optimizer keeps its own
    state). A sync that fails because a replica left during it is run again after a
    new quorum, among the replicas that hold its pseudo-gradient (the mean over them),
    never dropped silently; after ``max_failures`` failures in a row :meth:`step`
    raises. Every event is counted and logged (:meth:`elastic_stats`). Residuals of a
    replica that leaves are lost with it (what its codec had not yet sent, at most one
    round's worth); a replica that stays keeps its own. The first quorum (made here)
    makes the replicas' parameters equal, as it does without a manager.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: Optional[torch.optim.Optimizer],
        sync_every: int,
        codec: Union[str, Codec] = "identity",
        *,
        fragments: Union[int, Sequence[torch.nn.Module]] = 1,
        delay: int = 0,
        alpha: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        error_feedback: Optional[bool] = None,
        feedback_beta: float = 1.0,
        strategy: str = "auto",
        bandwidth: Union[float, str] = 10e9,
        latency: Union[float, str] = 10e-6,
        pieces: int = 1,
        group: Any = None,
        seed: int = 0,
        timeout: Optional[float] = None,
        transport: str = "tcp",
        manager: Any = None,
        max_failures: int = 3,
    ) -> None:
        self._elastic = None
        if manager is not None:
            self._elastic = Elastic(manager, max_failures, 60.0 if timeout is None else timeout)
        elif not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DiLoCo needs torch.distributed initialised (init_process_group)")
        if transport not in ("tcp", "process_group"):
            raise ValueError(f"transport {transport!r}: use 'tcp' or 'process_group'")
        codec = Codec(codec) if isinstance(codec, str) else codec
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameter that requires a gradient")
        self._params = [p for _, p in named]
        assignment = None
        if not isinstance(fragments, int):
            mods = list(fragments)
            of = {}
            for f, m in enumerate(mods):
                for p in m.parameters():
                    if id(p) in of:
                        raise ValueError(f"a parameter is in fragments {of[id(p)]} and {f}")
                    of[id(p)] = f
            missing = [n for n, p in named if id(p) not in of]
            if missing:
                raise ValueError(f"parameters in no fragment: {', '.join(missing[:5])}")
            assignment = [of[id(p)] for p in self._params]
            fragments = len(mods)
        self.process_group = group
        self._group = None
        if self._elastic is None:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            kw: Dict[str, Any] = {}
            if timeout is not None:
                kw["timeout"] = datetime.timedelta(seconds=timeout)
            self._group = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None, **kw
            )
        # Host views: CPU float32 parameters in place, a pinned float32 copy otherwise.
        self._host: List[torch.Tensor] = []
        self._mirrored: List[bool] = []
        pin = torch.cuda.is_available()
        with torch.no_grad():
            for p in self._params:
                direct = p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
                h = p.data if direct else torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
                if not direct:
                    h.copy_(p.detach())
                self._host.append(h)
                self._mirrored.append(not direct)
        self._p2p = _PointToPoint(lambda: self._group)
        if self._elastic is not None:
            if transport != "tcp":
                raise ValueError("with a manager the transport is gradpack's native one ('tcp')")
            tcp = self._elastic.quorums.next()
            link: Dict[str, Any] = dict(transport=tcp)
        else:
            rank, world = dist.get_rank(self._group), dist.get_world_size(self._group)
            link = (
                dict(transport=_tcp(rank, world, _job_token(self._group), timeout))
                if transport == "tcp" else self._p2p.link()
            )
        bw = gradpack.parse_bandwidth(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
        lat = gradpack.parse_duration(latency) if isinstance(latency, str) else float(latency)
        if error_feedback is None:
            error_feedback = codec.name != "identity"
        self._sync = gradpack.OuterSync(
            [n for n, _ in named],
            [tuple(p.shape) for p in self._params],
            [h.numpy() for h in self._host],
            **link,
            sync_every=sync_every,
            fragments=fragments,
            assignment=assignment,
            delay=delay,
            alpha=alpha,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            codec=codec,
            feedback="worker" if error_feedback else "none",
            beta=feedback_beta,
            strategy=strategy,
            pieces=pieces,
            seed=seed,
            bandwidth=bw,
            latency=lat,
        )
        self._frags = self._sync.fragments
        #: The inner step before which the last quorum was made (none is made again
        #: for it: a replica that joins makes its first quorum here, for the step the
        #: others are about to sync at).
        self._quorum_for = -1
        if self._elastic is not None:
            self._elastic.heal(self._sync, self._all_host(), reform=False)
            self._quorum_for = self._sync.inner_step + 1
        else:
            self._sync.heal(self._all_host())
        self._host_to_params(range(len(self._params)))
        #: Bytes this rank has sent for outer steps (envelopes and frames).
        self.bytes_sent = 0
        #: Fragment outer steps applied.
        self.syncs = 0
        self._hook = None
        if inner_optimizer is not None:
            self._hook = inner_optimizer.register_step_post_hook(lambda *_: self.step())

    @property
    def inner_step(self) -> int:
        """Inner steps taken."""
        return self._sync.inner_step

    @property
    def fragments(self) -> List[List[int]]:
        """The parameters (indices among those that require a gradient) of every
        fragment."""
        return self._frags

    def step(self) -> None:
        """What follows an inner step (called by the inner optimizer's step hook; call
        it yourself if you gave ``inner_optimizer=None``)."""
        send, apply = self._sync.due()
        if not send and not apply:
            self._sync.step(None)
            return
        touched = sorted({t for f in send + apply for t in self._frags[f]})
        with torch.no_grad():
            for t in touched:
                if self._mirrored[t]:
                    self._host[t].copy_(self._params[t].detach())
            if self._elastic is None:
                stats = self._sync.step([h.numpy() for h in self._host])
                self._host_to_params(t for f in apply for t in self._frags[f])
            else:
                step = self._sync.inner_step + 1
                quorum = bool(send) and self._quorum_for != step
                healed = self._elastic.healed
                stats = self._elastic.step(
                    self._sync, [h.numpy() for h in self._host], self._all_host, quorum)
                self._quorum_for = step if quorum else self._quorum_for
                # Healing may have written every parameter; else the applied fragments.
                self._host_to_params(
                    range(len(self._params)) if self._elastic.healed != healed
                    else (t for f in apply for t in self._frags[f]))
        self.bytes_sent += stats["bytes_sent"]
        self.syncs += stats["applied"]

    def _all_host(self) -> List[Any]:
        """Host views of every parameter, the mirrored ones copied in first."""
        for t, p in enumerate(self._params):
            if self._mirrored[t]:
                self._host[t].copy_(p.detach())
        return [h.numpy() for h in self._host]

    def _host_to_params(self, tensors: Any) -> None:
        with torch.no_grad():
            for t in tensors:
                if self._mirrored[t]:
                    self._params[t].copy_(self._host[t])

    def elastic_stats(self) -> Dict[str, Any]:
        """Under a torchft manager: outer syncs that ``failed`` here, ``retried`` and
        ``dropped`` by healing, times this replica was ``healed``, and ``events`` (one
        record per event: inner step, kind, details). Empty without a manager."""
        return {} if self._elastic is None else self._elastic.stats()

    def outer_parameters(self) -> List[torch.Tensor]:
        """Copies of the outer parameters (CPU float32, shaped as the parameters)."""
        return [
            torch.from_numpy(self._sync.outer(i)).reshape(p.shape)
            for i, p in enumerate(self._params)
        ]

    def state_dict(self) -> Dict[str, Any]:
        """The synchroniser's state (step, outer parameters, momentum, residuals, and an
        all-reduce finished but not yet applied), as plain values. Waits for the
        all-reduces in flight."""
        return {"format": "gradpack.torch.DiLoCo/1", "outer": self._sync.state_dict(),
                "bytes_sent": self.bytes_sent, "syncs": self.syncs}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a synchroniser made with the same arguments
        (restore the model and the inner optimizer of the same step beside it)."""
        if state.get("format") != "gradpack.torch.DiLoCo/1":
            raise ValueError(f"DiLoCo state format {state.get('format')!r}")
        self._sync.load_state_dict(state["outer"])
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.syncs = int(state.get("syncs", 0))

    def close(self) -> None:
        """End the synchroniser's use of the network: remove the optimizer hook, wait for
        the all-reduces in flight and the last sends, meet the other ranks (a barrier on
        the group it made, so that no rank tears its connections down while a peer's
        last messages are on the way: gloo can abort the process then) and destroy that
        group. A collective of the group's ranks, unless a sync failed (a peer may be
        gone): then it only drops what is pending. The outer parameters and the state
        stay readable."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._group is None:
            return
        try:
            # state_dict() waits for the all-reduces in flight (and refuses after a
            # failed sync).
            self._sync.state_dict()
        except Exception:
            self._p2p.drop()
            self._group = None
            return
        self._p2p.wait()
        if dist.is_initialized():
            dist.barrier(group=self._group)
            dist.destroy_process_group(self._group)
        self._group = None

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiLoCo({self._sync!r})"
