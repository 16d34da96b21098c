"""gradpack.torch.DiLoCo under torchft: three replica processes on CPU, the lighthouse
on 127.0.0.1, one replica killed (between syncs, during an outer all-reduce, or during
the healing before it) and restarted, or started late. The other two never stop (a sync
that failed runs again among them), the restarted one is healed at the next quorum, and
every replica ends with the same parameters, to the bit. And gradpack's float32 DiLoCo
under a manager follows torchft's own DiLoCo within float rounding."""

import multiprocessing as mp
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchft", reason="torchft is not installed (pip install gradpack[ft])")

# The replica groups' managers are the example's (python/examples/elastic_diloco.py).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from elastic_diloco import replica_manager  # noqa: E402

# 0.1 s per inner step, so that the restarted process (a second or more to start) joins
# well before the others finish.
STEPS, SYNC_EVERY, STEP_S = 120, 5, 0.1
# Killed between syncs at inner step 12, during the all-reduce of the sync at 15, or
# during the healing before it (connected to the quorum, gone before the status); or
# started 3 s late (it joins after the first sync, at 5).
KILL = {"inner": 12, "sync": 15, "heal": 15, "late": 5}


def replica(rid, lighthouse, out_dir, restarted, kill):
    """Train a small MLP on this replica's own data to inner step STEPS under a torchft
    manager; replica 2 (first start) exits as ``kill`` says. Saves the parameters,
    outer copy and events."""
    import gradpack.torch as gpt

    torch.manual_seed(100 + rid + (10 if restarted else 0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    manager, _store = replica_manager(rid, lighthouse, 30.0)
    diloco = gpt.DiLoCo(model, opt, SYNC_EVERY, "int8", manager=manager, timeout=20.0)
    loss_fn = torch.nn.CrossEntropyLoss()
    dies = rid == 2 and not restarted and kill != "late"
    if dies and kill in ("sync", "heal"):
        heal = diloco._elastic.heal

        def heal_then_die(sync, params, reform=True):
            if kill == "heal" and sync.inner_step + 1 == KILL["heal"]:
                sync.reform(transport=diloco._elastic.quorums.next())
                os._exit(3)  # connected to the quorum, gone before healing
            h = heal(sync, params, reform)
            if sync.inner_step + 1 == KILL["sync"]:
                os._exit(3)  # in the quorum of the sync, gone before its all-reduce
            return h

        diloco._elastic.heal = heal_then_die
    while diloco.inner_step < STEPS:
        if dies and kill == "inner" and diloco.inner_step == KILL["inner"]:
            os._exit(3)  # killed between syncs
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()  # DiLoCo's step runs in the optimizer's hook
        opt.zero_grad()
        time.sleep(STEP_S)
    params = [p.detach().clone() for p in model.parameters()]
    torch.save(dict(params=params, outer=diloco.outer_parameters(),
                    stats=diloco.elastic_stats(), loss=float(loss.detach())),
               os.path.join(out_dir, f"replica{rid}.pt"))
    diloco.close()
    manager.shutdown(wait=False)


@pytest.mark.parametrize("kill", ["inner", "sync", "heal", "late"])
def test_a_replica_killed_and_restarted_is_healed_and_every_replica_ends_identical(
        tmp_path, kill):
    """``late``: replica 2 is not killed; it starts 3 s (about 30 inner steps) after the
    others."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    try:
        procs = [ctx.Process(target=replica, args=(r, lighthouse.address(), str(tmp_path), False, kill))
                 for r in range(3 if kill != "late" else 2)]
        for p in procs:
            p.start()
        if kill == "late":
            time.sleep(3.0)
        else:
            procs[2].join(120)
            assert procs[2].exitcode == 3, "replica 2 was killed"
        again = ctx.Process(target=replica, args=(2, lighthouse.address(), str(tmp_path), True, kill))
        again.start()
        for p in procs[:2] + [again]:
            p.join(180)
        assert [p.exitcode for p in procs[:2] + [again]] == [0, 0, 0]
    finally:
        for p in procs + ([again] if "again" in locals() else []):
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    ends = [torch.load(tmp_path / f"replica{r}.pt") for r in range(3)]
    for r in (1, 2):
        for a, b in zip(ends[0]["params"] + ends[0]["outer"], ends[r]["params"] + ends[r]["outer"]):
            assert torch.equal(a, b), f"replica {r} differs"
    # A replica that started late joined a later quorum and received the state then
    # (once at most, before the kill); the restarted one received it once, mid-run.
    for r in range(3):
        healed = [e["step"] for e in ends[r]["stats"]["events"] if e["event"] == "healed"]
        if r < 2:
            assert len(healed) <= 1 and all(t < KILL[kill] for t in healed), (r, healed)
        else:
            assert len(healed) == 1, healed
    joined = [e for e in ends[2]["stats"]["events"] if e["event"] == "healed"][0]["step"]
    assert joined > KILL[kill], joined
    for r in (0, 1):
        s = ends[r]["stats"]
        failed = [e for e in s["events"] if e["event"] == "sync failed"]
        if kill in ("inner", "late"):
            # Gone before the next quorum (or not there yet): no sync failed.
            assert s["failed"] == 0 and s["retried"] == 0, s
        elif kill == "heal":
            # The heal before the sync at 15 failed; a new quorum of two healed, then
            # the sync ran: nothing to run again.
            heals = [e["step"] for e in s["events"] if e["event"] == "quorum or heal failed"]
            assert heals == [KILL["heal"] - 1] and not failed and s["retried"] == 0, s
        else:
            # The sync at 15 failed on both and ran again between the two of them.
            assert [e["step"] for e in failed] == [KILL["sync"]], s
            retried = [e for e in s["events"] if e["event"] == "retried"]
            assert [(e["fragment"], e["replicas"]) for e in retried] == [(0, 2)], s
        assert s["dropped"] == 0, s
    assert ends[0]["loss"] < 1.1


FOLLOW_SYNCS, FOLLOW_H = 4, 5


def follow_replica(rid, lighthouse, out_dir, which, progress):
    """Replica ``rid`` of two: an MLP trained with SGD (momentum 0.9) on its own data for
    FOLLOW_SYNCS outer rounds of FOLLOW_H inner steps, by ``which`` ("torchft": torchft's
    DiLoCo; "gradpack": gradpack's, float32), outer Nesterov SGD (lr 0.7, momentum 0.9),
    the managers with ``init_sync=False``. Saves the parameters after every sync."""
    import gradpack.torch as gpt
    from elastic_diloco import started

    torch.manual_seed(5)  # the same model on both replicas
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rid)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    manager, _store = replica_manager(rid, lighthouse, 30.0, init_sync=False)
    started(rid, progress, False)
    if which == "torchft":
        from torchft.local_sgd import DiLoCo

        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = DiLoCo(manager, [model], opt, outer, sync_every=FOLLOW_H).__enter__()
    else:
        diloco = gpt.DiLoCo(model, opt, FOLLOW_H, "identity", manager=manager, timeout=20.0,
                            outer_lr=0.7, outer_momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    after = []
    for step in range(1, FOLLOW_SYNCS * FOLLOW_H + 1):
        loss_fn(model(x), y).backward()
        opt.step()  # both libraries sync in the optimizer's step hook
        opt.zero_grad()
        if step % FOLLOW_H == 0:
            after.append([p.detach().clone() for p in model.parameters()])
    torch.save(after, os.path.join(out_dir, f"{which}{rid}.pt"))
    if which == "gradpack":
        diloco.close()
    manager.shutdown(wait=False)


def test_gradpack_float32_under_a_manager_follows_torchfts_diloco(tmp_path):
    from torchft._torchft import LighthouseServer

    ctx = mp.get_context("spawn")
    for which in ("torchft", "gradpack"):
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                      heartbeat_timeout_ms=1000)
        progress = ctx.Array("i", [-1, -1])
        procs = [ctx.Process(target=follow_replica,
                             args=(r, lighthouse.address(), str(tmp_path), which, progress))
                 for r in range(2)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(120)
            assert [p.exitcode for p in procs] == [0, 0], which
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            lighthouse.shutdown()
    ft = [torch.load(tmp_path / f"torchft{r}.pt") for r in range(2)]
    gp = [torch.load(tmp_path / f"gradpack{r}.pt") for r in range(2)]
    torch.manual_seed(5)
    start = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    for k in range(FOLLOW_SYNCS):
        for r in range(2):
            for a, b, c in zip(ft[r][k], gp[r][k], ft[1 - r][k]):
                # Both libraries leave the replicas equal after a sync ...
                assert torch.equal(a, c), (k, r)
                # ... and equal to each other within float rounding (a few ulps of
                # float32 per sync, grown by the inner steps between).
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (
                    k, r, float((a - b).abs().max()))
    # The outer steps moved the parameters well beyond that tolerance.
    moved = max(float((a - b.detach()).abs().max())
                for a, b in zip(ft[0][-1], start.parameters()))
    assert moved > 1e-2, moved


class _StandInManager:
    """What ``DiLoCo(manager=)`` uses of a torchft Manager, for one replica alone: each
    quorum configures the process group with a store on 127.0.0.1, world 1."""

    class _PG:
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None):
            pass

    def __init__(self):
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._pg = self._PG()
        self.quorum = 0

    def start_quorum(self):
        self.quorum += 1
        self._pg.configure(f"127.0.0.1:{self.store.port}/q{self.quorum}", "r0", 0, 1,
                           quorum_id=self.quorum)

    def wait_quorum(self):
        pass

    def errored(self):
        return None


def test_a_failing_transport_is_counted_every_time_and_raises_past_the_limit():
    import gradpack
    import gradpack.torch as gpt

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = _StandInManager()
    diloco = gpt.DiLoCo(model, opt, 2, "int8", manager=manager, timeout=5.0, max_failures=3)
    x = torch.randn(8, 4)
    for _ in range(4):  # two syncs in a quorum of one
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    assert diloco.elastic_stats()["failed"] == 0
    # From now on every quorum's transport fails: a world of two whose other member
    # never connects.
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", manager.store.port, is_master=False,
                          timeout=datetime.timedelta(seconds=0.5))

    def failing():
        return gradpack.Tcp.from_store(store, 0, 2, key=f"never/{manager.quorum}", timeout=0.5)

    diloco._elastic.quorums.next = failing
    model(x).sum().backward()
    opt.step()  # inner step 5: no sync
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="3 outer syncs or heals failed in a row"):
        opt.step()  # inner step 6: its quorum fails three times, then it raises
    stats = diloco.elastic_stats()
    assert stats["failed"] == 3, stats
    kinds = [e["event"] for e in stats["events"]]
    assert kinds == ["quorum or heal failed"] * 3, kinds
    assert [e["in_a_row"] for e in stats["events"]] == [1, 2, 3]
    assert diloco.inner_step == 5, "the failed sync's step did not count"
    diloco.close()
