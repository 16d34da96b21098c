"""DiLoCo training of an MLP on scikit-learn's digits: each gloo process trains alone on
its own shard, and ``gradpack.torch.DiLoCo`` syncs the outer parameters. Used by
test_diloco.py; runnable on its own:

    python tests/diloco_digits.py --world 2 --configs fp32,int8,stream --steps 300

Each configuration trains a fresh model from a fixed seed and reports test accuracy,
bytes sent and whether every rank holds the same outer parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import ddp_digits  # noqa: E402

CONFIGS: Dict[str, Dict[str, Any]] = {
    # DDP-free local training synced every 10 steps with DiLoCo's outer Nesterov.
    "fp32": {"codec": "identity"},
    "int8": {"codec": "int8"},
    "fp4": {"codec": "fp4"},
    # SparseLoCo: top 64 of every 4096 with 2-bit values, error feedback in place of
    # outer momentum.
    "sparseloco": {"codec": "chunktopk", "outer_lr": 1.0, "outer_momentum": 0.0},
    # Streaming: 2 fragments, each all-reduced while one more inner step runs.
    "stream": {"codec": "int8", "fragments": 2, "delay": 1, "alpha": 0.5},
    # Fragments given as modules (torchft's model_fragments), float64 parameters (the
    # pinned host copy path that CUDA parameters take).
    "modules-f64": {"codec": "int8", "fragments": "modules", "dtype": "float64", "delay": 1},
}

# The model on the first GPU (every rank on it): parameters reach the outer step through
# pinned host copies. Run by test_torch_cuda.py where torch sees a CUDA device.
CUDA_CONFIGS: Dict[str, Dict[str, Any]] = {
    "cuda-int8": {"codec": "int8", "device": "cuda"},
    "cuda-stream": {"codec": "int8", "fragments": 2, "delay": 1, "alpha": 0.5, "device": "cuda"},
}
CONFIGS_ALL = {**CONFIGS, **CUDA_CONFIGS}


def make(cfg: Dict[str, Any], seed: int, sync_every: int, init: int = -1):
    import gradpack.torch as gpt

    net = ddp_digits.model(seed if init < 0 else init, {"dtype": cfg.get("dtype", "float32")})
    net = net.to(cfg.get("device", "cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    frags = cfg.get("fragments", 1)
    if frags == "modules":
        frags = [net[0], net[2], net[4]]
    diloco = gpt.DiLoCo(
        net, opt, sync_every=sync_every, codec=cfg["codec"], fragments=frags,
        delay=cfg.get("delay", 0), alpha=cfg.get("alpha", 0.0),
        outer_lr=cfg.get("outer_lr", 0.7), outer_momentum=cfg.get("outer_momentum", 0.9),
        seed=seed,
    )
    return net, opt, diloco


def run_steps(net, opt, xs, ys, rank, world, steps, start, batch=32):
    """As DDP's run, without DDP: each rank its own shard of every step's batch."""
    return ddp_digits.run_steps(net, opt, xs, ys, rank, world, steps, start, batch)


def outer_flat(diloco) -> torch.Tensor:
    return torch.cat([p.reshape(-1).double().cpu() for p in diloco.outer_parameters()])


def worker(rank: int, world: int, port: int, plan: Dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, xt, yt = ddp_digits.data()
    h, steps = plan["sync_every"], plan["steps"]
    results: List[Dict[str, Any]] = []
    for name in plan["configs"]:
        cfg = CONFIGS_ALL[name]
        # Every rank but the first starts from parameters of its own: DiLoCo makes them
        # the first rank's (by healing), so the run is the one from seed 0 everywhere.
        net, opt, diloco = make(cfg, 0, h, init=0 if rank == 0 else 50 + rank)
        t0 = time.perf_counter()
        losses = run_steps(net, opt, xs, ys, rank, world, steps, 0)
        secs = time.perf_counter() - t0
        with torch.no_grad():
            p = next(net.parameters())
            acc = (net(xt.to(p.device, p.dtype)).argmax(1).cpu() == yt).float().mean().item()
        outer = outer_flat(diloco)
        results.append({
            "config": name, "device": str(p.device.type), "accuracy": acc, "bytes_sent": diloco.bytes_sent,
            "syncs": diloco.syncs, "inner_steps": diloco.inner_step,
            "params": sum(p.numel() for p in net.parameters()), "seconds": secs,
            "first_loss": sum(losses[:20]) / 20, "last_loss": sum(losses[-20:]) / 20,
            "identical": ddp_digits.same_on_all_ranks(outer, world),
            "local_is_outer": bool(torch.equal(ddp_digits.flat_params(net), outer)),
        })
        diloco.close()
    for name in filter(None, plan.get("resume", "").split(",")):
        # Checkpoint mid-round (with delay 1, an all-reduce in flight), go on; then a
        # fresh model, optimizer and DiLoCo from the checkpoint: the same parameters.
        k = steps // 2 + 1
        net, opt, diloco = make(CONFIGS_ALL[name], 7, h)
        run_steps(net, opt, xs, ys, rank, world, k, 0)
        ckpt = os.path.join(out_dir, f"ckpt-{name}-{rank}.pt")
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                    "diloco": diloco.state_dict()}, ckpt)
        run_steps(net, opt, xs, ys, rank, world, k, k)
        straight, straight_outer = ddp_digits.flat_params(net), outer_flat(diloco)
        diloco.close()
        saved = torch.load(ckpt, weights_only=True, map_location="cpu")
        net, opt, diloco = make(CONFIGS_ALL[name], 7, h, init=99)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        diloco.load_state_dict(saved["diloco"])
        run_steps(net, opt, xs, ys, rank, world, k, k)
        results.append({"config": name, "resume": True,
                        "equal": bool(torch.equal(straight, ddp_digits.flat_params(net))),
                        "outer_equal": bool(torch.equal(straight_outer, outer_flat(diloco)))})
        diloco.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    ddp_digits.leave()


def killed_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """DiLoCo every 4 steps; the last rank dies after step 5, the others record how long
    their next sync took to raise, and what."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, _, _ = ddp_digits.data()
    net, opt, diloco = make(CONFIGS["int8"], 0, 4)
    result: Dict[str, Any] = {"raised": None}
    run_steps(net, opt, xs, ys, rank, world, 5, 0)
    dist.barrier()
    if rank == world - 1:
        os._exit(3)
    t0 = time.perf_counter()
    try:
        run_steps(net, opt, xs, ys, rank, world, 4, 5)
    except Exception as e:  # what the test looks at
        result = {"raised": f"{type(e).__name__}: {e}"[:300], "after_s": time.perf_counter() - t0}
    try:
        run_steps(net, opt, xs, ys, rank, world, 1, 9)
        result["refused_after"] = False
    except Exception:
        result["refused_after"] = True
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def run_killed(world: int, timeout: float = 120) -> List[Dict[str, Any]]:
    """:func:`killed_worker` on ``world`` processes; the survivors' results."""
    ctx = ddp_digits.context()
    with tempfile.TemporaryDirectory() as d:
        port = ddp_digits.free_port()
        procs = [ctx.Process(target=killed_worker, args=(r, world, port, d)) for r in range(world)]
        for p in procs:
            p.start()
        out = []
        for r, p in enumerate(procs[:-1]):
            p.join(timeout)
            if p.is_alive():
                p.kill()
                out.append({"hung": True})
            else:
                out.append(json.load(open(os.path.join(d, f"rank{r}.json"))))
        procs[-1].join(10)
        return out


def run(world: int, configs: List[str], steps: int, sync_every: int = 10,
        resume: str = "") -> List[List[Dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as d:
        plan = {"configs": configs, "steps": steps, "sync_every": sync_every, "resume": resume}
        ddp_digits.spawn(worker, (world, ddp_digits.free_port(), plan, d), world)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--resume", default="")
    a = ap.parse_args()
    for r in run(a.world, a.configs.split(","), a.steps, a.sync_every, a.resume)[0]:
        print(json.dumps(r))
