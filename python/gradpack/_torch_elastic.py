"""``gradpack.torch.DiLoCo`` under a torchft ``Manager``: each outer sync among the
replicas of the manager's current quorum, on gradpack's native transport set up through
the quorum's store, with the crate's re-forming and healing
(:meth:`gradpack.OuterSync.reform` and :meth:`gradpack.OuterSync.heal`)."""

import datetime
import logging
from typing import Any, Callable, Dict, List

import gradpack

log = logging.getLogger("gradpack.torch")


class _Quorums:
    """A torchft manager's quorums as gradpack transports.

    torchft tells a quorum's replicas where its store is only through the ``configure``
    call of the manager's process group, so this wraps that method of ``manager._pg``
    to note the store's address, the replica's rank and the quorum's size and id. Each
    :meth:`next` starts the manager's next quorum and connects a new
    :class:`gradpack.Tcp` among its replicas, under a key that every replica of the
    quorum forms alike: the quorum's id and how many transports this quorum has made."""

    def __init__(self, manager: Any, timeout: float) -> None:
        pg = getattr(manager, "_pg", None)
        if pg is None or not hasattr(pg, "configure"):
            raise TypeError("manager: a torchft Manager (with a process group) is needed")
        self.manager = manager
        self.timeout = timeout
        self._seen: Dict[str, Any] = {}
        self._made: Dict[Any, int] = {}
        original = pg.configure

        def configure(store_addr: str, replica_id: str, rank: int, world_size: int,
                      *args: Any, **kw: Any) -> Any:
            quorum = args[0] if args else kw.get("quorum_id")
            self._seen = dict(addr=store_addr, rank=rank, world=world_size, quorum=quorum)
            return original(store_addr, replica_id, rank, world_size, *args, **kw)

        pg.configure = configure

    def next(self) -> "gradpack.Tcp":
        """Start the manager's next quorum (it blocks until the quorum forms) and
        connect a transport among its replicas."""
        from torchft.process_group import create_store_client

        self.manager.start_quorum()
        self.manager.wait_quorum()
        err = self.manager.errored()
        if err is not None:
            raise RuntimeError(f"torchft quorum failed: {err.original_exception}")
        s = self._seen
        if not s:
            raise RuntimeError("the torchft quorum did not configure the process group")
        made = self._made.get(s["quorum"], 0)
        self._made = {s["quorum"]: made + 1}
        store = create_store_client(s["addr"], timeout=datetime.timedelta(seconds=self.timeout))
        return gradpack.Tcp.from_store(
            store, s["rank"], s["world"], key=f"gradpack/outer/{s['quorum']}/{made}",
            timeout=self.timeout,
        )


class Elastic:
    """The outer syncs of one replica under a torchft manager: a quorum, a transport of
    its replicas and a heal before each sync, and after a failed sync (a replica left
    during it) new quorums until the sync has run again, at most ``max_failures`` in a
    row. Every event is counted and logged."""

    def __init__(self, manager: Any, max_failures: int, timeout: float) -> None:
        if max_failures < 1:
            raise ValueError(f"max_failures {max_failures}: need at least 1")
        self.quorums = _Quorums(manager, timeout)
        self.max_failures = max_failures
        #: Outer syncs, or quorums and heals before them, that failed here (each sync
        #: then ran again after a new quorum).
        self.failed = 0
        #: Failed syncs run again by healing, and those dropped because no replica held
        #: their pseudo-gradient any more.
        self.retried = 0
        self.dropped = 0
        #: Times this replica received another's state.
        self.healed = 0
        #: One record per event: the inner step, the kind and the details.
        self.events: List[Dict[str, Any]] = []

    def note(self, step: int, kind: str, **details: Any) -> None:
        self.events.append(dict(step=step, event=kind, **details))
        log.info("gradpack DiLoCo at inner step %d: %s %s", step, kind, details)

    def heal(self, sync: "gradpack.OuterSync", params: List[Any],
             reform: bool = True) -> Dict[str, Any]:
        """A new quorum, ``sync`` re-formed over it (unless ``reform`` is false: a
        synchroniser just made on the quorum's transport) and healed (``params``: host
        views of every parameter, written where healing changes them)."""
        if reform:
            sync.reform(transport=self.quorums.next())
        h = sync.heal(params)
        if h["was_healed"]:
            self.healed += 1
            self.note(sync.inner_step, "healed", source=h["source"])
        self.retried += len(h["retried"])
        self.dropped += len(h["dropped"])
        for f, over in h["retried"]:
            self.note(sync.inner_step, "retried", fragment=f, replicas=over)
        for f in h["dropped"]:
            self.note(sync.inner_step, "dropped", fragment=f)
        return h

    def step(self, sync: "gradpack.OuterSync", params: List[Any],
             all_params: Callable[[], List[Any]], quorum: bool) -> Dict[str, Any]:
        """``sync.step(params)``, after a quorum and a heal if ``quorum`` (a step that
        starts a sync). A failure, of the sync or of the quorum and heal before it, is
        followed by a new quorum and heal (which runs a failed sync again), and the
        step's own sync if it has not run, until all succeed: ``max_failures`` in a row
        at most. Returns the step's stats, the outer steps healing applied added in."""
        applied = sent = failures = 0
        stepped = False
        while True:
            try:
                if quorum or failures:
                    h = self.heal(sync, all_params())
                    applied += h["applied"]
                    sent += h["bytes_sent"]
                if stepped:
                    return {"sent": 0, "applied": applied, "bytes_sent": sent, "messages": 0}
                stepped = True
                stats = sync.step(params)
                stats["applied"] += applied
                stats["bytes_sent"] += sent
                return stats
            except (gradpack.Error, RuntimeError) as e:
                failures += 1
                self.failed += 1
                kind = "sync failed" if stepped else "quorum or heal failed"
                self.note(sync.inner_step, kind, reason=str(e), in_a_row=failures)
                if failures >= self.max_failures:
                    raise RuntimeError(
                        f"gradpack DiLoCo: {failures} outer syncs or heals failed in a row "
                        f"(the last: {e})"
                    ) from e

    def stats(self) -> Dict[str, Any]:
        return dict(failed=self.failed, retried=self.retried, dropped=self.dropped,
                    healed=self.healed, events=list(self.events))
