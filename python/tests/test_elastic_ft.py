"""gradpack.torch.DiLoCo under torchft: three replica processes on CPU, the lighthouse
on 127.0.0.1, one replica killed (between syncs, during an outer all-reduce, or during
the healing before it) and restarted. The other two never stop (a sync that failed runs again among them), the
restarted one is healed at the next quorum, and every replica ends with the same
parameters, to the bit."""

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
# during the healing before it (connected to the quorum, gone before the status).
KILL = {"inner": 12, "sync": 15, "heal": 15}


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
    dies = rid == 2 and not restarted
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


@pytest.mark.parametrize("kill", ["inner", "sync", "heal"])
def test_a_replica_killed_and_restarted_is_healed_and_every_replica_ends_identical(
        tmp_path, kill):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    try:
        procs = [ctx.Process(target=replica, args=(r, lighthouse.address(), str(tmp_path), False, kill))
                 for r in range(3)]
        for p in procs:
            p.start()
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
        if kill == "inner":
            # Gone before the next quorum: no sync failed.
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
