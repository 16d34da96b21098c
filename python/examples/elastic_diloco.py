"""Elastic DiLoCo on CPU: three replicas under torchft, one killed mid-run and restarted.

    python examples/elastic_diloco.py                       # int8 pseudo-gradients
    python examples/elastic_diloco.py --codec fp4 --away 100

Each replica is a process of its own (a torchft replica group of one) training an MLP on
its shard of scikit-learn's digits with ``gradpack.torch.DiLoCo(..., manager=...)``; the
lighthouse runs in this process on 127.0.0.1. Replica 2 kills itself at inner step
``--kill-at`` (``os._exit``, as a crash would) and is started again once the other two
are ``--away`` inner steps further; it is healed at the next quorum (it receives the
newest state, bit for bit) and trains on. The other two never stop. Then the same
training runs with nobody killed, and the script prints both held-out losses, the
events each replica logged and whether every replica ended with the same parameters.
Needs ``pip install gradpack[ft] scikit-learn``.
"""

import argparse
import multiprocessing as mp
import os
import tempfile
import time


def replica_manager(rid, lighthouse, timeout_s, **kwargs):
    """The torchft ``Manager`` of replica group ``rid`` (one process) on 127.0.0.1, with
    the group's store (keep it alive as long as the manager): at least 2 replicas per
    quorum, synchronous quorums (what ``DiLoCo(..., manager=)`` needs), no state of its
    own to heal (gradpack heals DiLoCo's); ``kwargs`` go to the ``Manager``."""
    import datetime

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    t = datetime.timedelta(seconds=timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t), min_replica_size=2, load_state_dict=lambda s: None,
        state_dict=lambda: {}, replica_id=f"replica{rid}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, use_async_quorum=False,
        lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=t, quorum_timeout=t,
        connect_timeout=t, **kwargs,
    )
    return manager, store


def started(rid, progress, restarted):
    """Say that replica ``rid`` has its manager (it heartbeats); on a first start, wait
    until every replica has one, so that the first quorum holds them all (a replica that
    starts late would join a later quorum, and be healed)."""
    progress[rid] = 0
    while not restarted and min(progress) < 0:
        time.sleep(0.01)


def replica(rid, lighthouse, args, out_dir, restarted, progress, kill_at):
    import torch
    from sklearn.datasets import load_digits

    import gradpack.torch as gpt

    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    train, test = slice(0, 1500), slice(1500, None)
    shard = torch.arange(1500)[rid::3]
    torch.manual_seed(7)  # the same starting model everywhere (healing would equalise it anyway)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager, _store = replica_manager(rid, lighthouse, 60.0)
    started(rid, progress, restarted)
    diloco = gpt.DiLoCo(model, opt, args.sync_every, args.codec, manager=manager, timeout=30.0)
    g = torch.Generator().manual_seed(rid)
    loss_fn = torch.nn.CrossEntropyLoss()
    while diloco.inner_step < args.steps:
        if rid == 2 and not restarted and diloco.inner_step == kill_at:
            os._exit(3)  # a crash
        batch = shard[torch.randint(len(shard), (32,), generator=g)]
        loss_fn(model(x[train][batch]), y[train][batch]).backward()
        opt.step()  # DiLoCo's step runs in the optimizer's hook
        opt.zero_grad()
        progress[rid] = diloco.inner_step
        time.sleep(args.step_s)
    with torch.no_grad():
        logits = model(x[test])
        held_out = float(loss_fn(logits, y[test]))
        accuracy = float((logits.argmax(1) == y[test]).float().mean())
    torch.save(dict(params=[p.detach().clone() for p in model.parameters()], loss=held_out,
                    accuracy=accuracy,
                    stats=diloco.elastic_stats(), bytes=diloco.bytes_sent),
               os.path.join(out_dir, f"replica{rid}.pt"))
    diloco.close()
    manager.shutdown(wait=False)


def run(args, kill, target=None, world=3):
    """One training of ``world`` replicas, each ``target`` (by default this example's
    ``replica``) in a process of its own; with ``kill``, the last replica dies at
    ``args.kill_at`` and comes back once the others are ``args.away`` inner steps
    further. Returns what each replica saved, and whether their parameters are equal."""
    target = target or replica
    import torch
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    progress = ctx.Array("i", [-1] * world)
    kill_at = args.kill_at if kill else -1
    out = tempfile.mkdtemp(prefix="elastic-diloco-")
    procs = [ctx.Process(target=target, args=(r, lighthouse.address(), args, out, False,
                                               progress, kill_at)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        if kill:
            last = world - 1
            procs[last].join()
            while min(progress[:last]) < args.kill_at + args.away:
                time.sleep(0.05)
            print(f"replica {last} died at inner step {args.kill_at}; restarting it with the "
                  f"others at {min(progress[:last])}", flush=True)
            procs[last] = ctx.Process(target=target, args=(last, lighthouse.address(), args,
                                                           out, True, progress, kill_at))
            procs[last].start()
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    ends = [torch.load(os.path.join(out, f"replica{r}.pt")) for r in range(world)]
    same = all(torch.equal(a, b) for e in ends[1:] for a, b in zip(ends[0]["params"], e["params"]))
    return ends, same


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=110)
    ap.add_argument("--away", type=int, default=100)
    ap.add_argument("--step-s", type=float, default=0.05,
                    help="sleep per inner step, so that a restart takes fewer steps than --away")
    ap.add_argument("--only-uninterrupted", action="store_true")
    args = ap.parse_args()
    results = {}
    for kill in (False,) if args.only_uninterrupted else (True, False):
        ends, same = run(args, kill)
        name = "killed and restarted" if kill else "uninterrupted"
        results[name] = ends[0]["loss"]
        print(f"\n{name}: held-out loss {ends[0]['loss']:.4f}, accuracy "
              f"{ends[0]['accuracy']:.3f}, every replica the same "
              f"parameters: {same}, bytes sent by replica 0: {ends[0]['bytes']}")
        for r, e in enumerate(ends):
            events = [(ev["step"], ev["event"]) for ev in e["stats"]["events"]]
            print(f"  replica {r}: {events}")
    if args.only_uninterrupted:
        return
    a, b = results["killed and restarted"], results["uninterrupted"]
    print(f"\nfinal held-out loss, killed and restarted over uninterrupted: {a / b:.4f}")


if __name__ == "__main__":
    main()
