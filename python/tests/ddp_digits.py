"""Data-parallel training of an MLP on scikit-learn's digits with PyTorch DDP over gloo,
with and without gradpack's hook. Used by test_torch.py; runnable on its own:

    python tests/ddp_digits.py --world 2 --configs fp32,int8,topk-ef --seeds 0,1,2

Each configuration trains a fresh model from a fixed seed and reports test accuracy, the
final loss and whether every rank holds the same parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
import zlib
from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS: Dict[str, Dict[str, Any]] = {
    "fp32": {"codec": None},
    "fp16": {"codec": "fp16"},
    "int8": {"codec": "int8"},
    "qsgd4": {"codec": "qsgd:bits=4,block=64"},
    "topk-ef": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True},
    "sign-ef": {"codec": "sign", "error_feedback": True},
    "int8-ring": {"codec": "int8", "strategy": "ring"},
    "int8-allgather": {"codec": "int8", "strategy": "allgather"},
    # signSGD with majority vote (the crate's "majority"), error feedback on (sign's
    # default), and the same with the ranks' sum for comparison.
    "sign-majority": {"codec": "sign", "strategy": "majority"},
    # The crate's ring with worker + owner error feedback and two pieces per chunk.
    "int8-ef-ring": {"codec": "int8", "strategy": "ring", "error_feedback": True, "pieces": 2},
    # The crate's two-shot, with worker + owner error feedback and two pieces per chunk.
    "int8-ef-twoshot": {"codec": "int8", "strategy": "twoshot", "error_feedback": True,
                        "pieces": 2},
    # The same where /dev/shm seems to hold 1 MiB (the hook makes its rings smaller)
    # and 256 KiB (it warns and goes without).
    "int8-ef-ring-small-shm": {"codec": "int8", "strategy": "ring", "error_feedback": True,
                               "pieces": 2, "shm_free": 1 << 20},
    "int8-ef-ring-tiny-shm": {"codec": "int8", "strategy": "ring", "error_feedback": True,
                              "pieces": 2, "shm_free": 256 << 10},
    # Two-level: float32 inside nodes of ranks {0, 1} and {2, ...}, int8 with error
    # feedback between them (unequal nodes with 3 ranks).
    "int8-hier": {"codec": "int8", "strategy": "hierarchical", "error_feedback": True,
                  "extra": {"nodes": "pairs"}},
    # Every weight matrix as rank-2 factors, biases in float32 (PyTorch's PowerSGD hook).
    "powersgd2": {"powersgd": 2},
    # The 10 x 256 output layer compresses under 6 times at rank 2, so it goes with the
    # codec (dct signs with error feedback), in the same buckets as the factors.
    "powersgd-dct": {"powersgd": {"rank": 2, "min_compression": 6.0},
                     "codec": "dct:k=4,values=sign", "error_feedback": True},
    # 8 x 8 tiles of each weight matrix (DeMo), signs with one scale, error feedback.
    "dct2d-ef": {"codec": "dct:chunk=8,k=4,values=sign,scale=frame", "dct_2d": True,
                 "error_feedback": True},
    # codec='auto' on a slow link: float32 and the cost model's two best of int8 and
    # top-k by all-gather and ring, each measured on the buckets for two steps.
    "auto": {"codec": "auto", "extra": {"bandwidth": "1Gbit/s", "candidates": ["int8", "topk:ratio=0.01,values=fp16"],
                                        "calibrate_elements": 1 << 16, "print_plan": False}},
    # The same, all-gather only: every choice sums per parameter, so a checkpoint
    # resumes bit for bit whichever configuration each bucket chose.
    "auto-allgather": {"codec": "auto", "strategy": "allgather",
                       "extra": {"bandwidth": "1Gbit/s", "candidates": ["int8", "topk:ratio=0.01,values=fp16"],
                                 "calibrate_elements": 1 << 16, "print_plan": False}},
    # codec='auto' with nodes {0, 1} and {2, 3}: the two-level all-reduce (float32 and
    # int8 between nodes) is among the strategies ranked and measured.
    "auto-nodes": {"codec": "auto", "extra": {
        "bandwidth": "1Gbit/s", "candidates": ["int8"], "nodes": "pairs", "trials": 3,
        "calibrate_elements": 1 << 16, "print_plan": False}},
    # DDP options that issue collectives of their own, and a layer that gets no gradient.
    "int8-unused": {"codec": "int8", "ddp": {"find_unused_parameters": True}, "unused": True},
    "int8-unused-all-used": {"codec": "int8", "ddp": {"find_unused_parameters": True}},
    "int8-static": {"codec": "int8", "ddp": {"static_graph": True}},
    "int8-frozen": {"codec": "int8", "frozen": True},
    # Buckets of other float types: the codec works in float32.
    "int8-bf16": {"codec": "int8", "dtype": "bfloat16"},
    "int8-f64": {"codec": "int8", "dtype": "float64"},
    "fp32-f64": {"codec": "identity", "dtype": "float64"},
    # The hook in float32, and top-k with error feedback from step 3 (float32 before).
    "identity": {"codec": "identity"},
    "topk-ef-from-3": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                       "extra": {"start_step": 3}},
    # Momentum correction: the velocity in the hook, the optimizer without momentum.
    "identity-momentum": {"codec": "identity", "extra": {"momentum": 0.9}, "sgd_momentum": 0.0},
    "topk-ef-momentum": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                         "extra": {"momentum": 0.9}, "sgd_momentum": 0.0},
    # One top-k over the whole model (selection='model'), in the default buckets of
    # ~26 k elements and in one bucket of everything: the same parameters.
    "topk-ef-model": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                      "extra": {"selection": "model"}},
    "topk-ef-model-one-bucket": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                                 "extra": {"selection": "model"}, "bucket_cap_mb": 25},
    "topk-ef-model-unused": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                             "extra": {"selection": "model"},
                             "ddp": {"find_unused_parameters": True}, "unused": True},
    "topk-ef-model-static": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                             "extra": {"selection": "model"}, "ddp": {"static_graph": True}},
    "topk-ef-model-momentum": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                               "extra": {"selection": "model", "momentum": 0.9},
                               "sgd_momentum": 0.0},
    "int8-ef-ring-momentum": {"codec": "int8", "strategy": "ring", "error_feedback": True,
                              "pieces": 2, "extra": {"momentum": 0.9}, "sgd_momentum": 0.0},
}


# Workers start from a fork server that has imported torch, gradpack, scikit-learn's
# loader and these modules once. A fresh interpreter per rank (the "spawn" start) imports
# them again: about 7 s of CPU per rank here (torch 3, the loader 2, and the ~900 modules
# DDP's first constructor imports through torch._dynamo 3), which was most of a short
# test's time. The server runs no torch operation before it forks (no thread pool to
# inherit).
PRELOAD = ["ddp_digits", "diloco_digits", "gradpack.torch", "torch._dynamo", "sklearn.datasets"]


def start_method() -> str:
    """The workers' start method: ``forkserver`` with :data:`PRELOAD` (Linux and macOS),
    else ``spawn``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def spawn(fn, args, world: int) -> None:
    """``fn(rank, *args)`` on ``world`` worker processes, joined; a worker's failure raises."""
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method=start_method())


def context():
    """A process context of :func:`start_method`, for workers joined one by one."""
    return mp.get_context(start_method())


_DIGITS = None


def data():
    """The digits as training and test tensors, loaded once per process (the fork server's
    copy is every worker's)."""
    global _DIGITS
    if _DIGITS is None:
        _DIGITS = _load_digits()
    return _DIGITS


def _load_digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    rng = np.random.default_rng(1234)
    perm = rng.permutation(len(x))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return (torch.from_numpy(x[:cut]), torch.from_numpy(y[:cut]),
            torch.from_numpy(x[cut:]), torch.from_numpy(y[cut:]))


class WithUnused(torch.nn.Module):
    """The MLP beside a layer that forward never uses (no gradient every step)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.unused = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def model(seed: int, cfg: Dict[str, Any] = {}) -> torch.nn.Module:
    torch.manual_seed(seed)
    net: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    if cfg.get("unused"):
        net = WithUnused(net)
    if cfg.get("frozen"):
        net[0].requires_grad_(False)  # a frozen first layer: DDP leaves it out
    return net.to(getattr(torch, cfg.get("dtype", "float32")))


# A configuration's name with a suffix runs it on one way of moving the hook's messages:
# "@tcp" gradpack's native transport and "@pg" the hook's point-to-point on its gloo
# group, both without shared memory (every message between ranks goes that way), and
# "@shm" the native transport with shared memory between the ranks of this host.
TRANSPORTS: Dict[str, Dict[str, Any]] = {
    "tcp": {"transport": "tcp", "shared_memory": False},
    "pg": {"transport": "process_group", "shared_memory": False},
    "shm": {"transport": "tcp", "shared_memory": True},
}


def config(name: str) -> Dict[str, Any]:
    """The configuration ``name`` of :data:`CONFIGS`, with a transport suffix applied."""
    base, _, way = name.partition("@")
    cfg = dict(CONFIGS[base])
    if way:
        cfg["extra"] = {**cfg.get("extra", {}), **TRANSPORTS[way]}
    return cfg


def make(cfg: Dict[str, Any], seed: int, init: int = -1, device: str = "cpu"):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpack.torch as gpt
    import gradpack._torch_net

    # Several buckets of ~26 k elements.
    net = model(seed if init < 0 else init, cfg).to(device)
    ids = [torch.device(device).index or 0] if device.startswith("cuda") else None
    net = DDP(net, device_ids=ids, bucket_cap_mb=cfg.get("bucket_cap_mb", 0.1), **cfg.get("ddp", {}))
    state = None
    extra = dict(cfg.get("extra", {}))
    if extra.get("nodes") == "pairs":
        extra["nodes"] = [min(r // 2, 1) for r in range(dist.get_world_size())]
    if "shm_free" in cfg:
        gradpack._torch_net._shm_free = lambda: cfg["shm_free"]
    if cfg.get("codec") or cfg.get("powersgd"):
        state = gpt.GradpackState(
            codec=cfg.get("codec"),
            powersgd=cfg.get("powersgd"),
            dct_2d=cfg.get("dct_2d", False),
            error_feedback=cfg.get("error_feedback"),
            strategy=cfg.get("strategy"),
            pieces=cfg.get("pieces", 1),
            min_compress_elements=1024,
            seed=seed,
            model=net,
            **extra,
        )
        net.register_comm_hook(state, gpt.gradpack_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=cfg.get("sgd_momentum", 0.9))
    return net, opt, state


def run_steps(net, opt, xs, ys, rank, world, steps, start, batch=32, times=None):
    """`steps` steps from global step `start`; each rank takes its shard of the batch.
    Returns the losses; each step's seconds are appended to `times` if given."""
    n = len(xs)
    losses = []
    for s in range(start, start + steps):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(s)
        idx = torch.randint(0, n, (batch * world,), generator=g)[rank * batch:(rank + 1) * batch]
        opt.zero_grad()
        p = next(net.parameters())
        out = net(xs[idx].to(p.device, p.dtype)).float()
        loss = torch.nn.functional.cross_entropy(out, ys[idx].to(p.device))
        loss.backward()
        opt.step()
        losses.append(loss.item())  # waits for the step, on a GPU too
        if times is not None:
            times.append(time.perf_counter() - t0)
    return losses


def flat_params(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in net.parameters()])


def chosen_plan(state) -> List[Any]:
    """codec='auto''s choice per bucket: (bucket, codec, strategy)."""
    return [[r["bucket"], r["codec"], r["strategy"]] for r in state.plan() if r["chosen"]]


def same_on_all_ranks(t: torch.Tensor, world: int) -> bool:
    got = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(got, t)
    return all(torch.equal(got[0], g) for g in got)


def rank_device(backend: str, rank: int, world: int) -> str:
    """The CUDA device of ``rank`` for a world on ``backend`` (made current). With NCCL
    and fewer GPUs than ranks, each rank is made a host of its own to NCCL (its host id):
    NCCL refuses two ranks on one GPU of one host ("Duplicate GPU detected"), and ranks
    of different hosts reach each other over sockets."""
    n = torch.cuda.device_count()
    if "nccl" in backend and n < world:
        os.environ["NCCL_HOSTID"] = f"gradpack-test-rank-{rank}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    device = f"cuda:{rank % n}"
    torch.cuda.set_device(device)
    return device


def worker(rank: int, world: int, port: int, plan: Dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    backend = plan.get("backend", "gloo")
    device = plan.get("device", "cpu")
    if device.startswith("cuda"):
        device = rank_device(backend, rank, world)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, xt, yt = data()
    results: List[Dict[str, Any]] = []
    steps = plan["steps"]
    for name in plan["configs"]:
        cfg = config(name)
        for seed in plan["seeds"]:
            net, opt, state = make(cfg, seed, device=device)
            times: List[float] = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = run_steps(net, opt, xs, ys, rank, world, steps, 0, times=times)
            with torch.no_grad():
                p = next(net.parameters())
                acc = (net(xt.to(p.device, p.dtype)).argmax(1).cpu() == yt).float().mean().item()
            p = flat_params(net)
            chosen, tried, collectives, shared, ring_bytes = None, None, 0, 0, 0
            if state is not None:
                chosen = chosen_plan(state)
                tried = sorted({(r["codec"], r["strategy"]) for r in state.plan()})
                # The crate's collectives the hook made (one per bucket), and the
                # shared-memory sets they share.
                eng = getattr(state, "_eng", None)  # an older build (same_bits.py) has none
                collectives = eng.rings_made if eng else len(state._rings)
                shared = len(state._shms)
                ring_bytes = state._shm_ring
                state.close()
            times = sorted(times[len(times) // 2:])
            results.append({
                "config": name, "seed": seed, "accuracy": acc, "device": device.split(":")[0],
                "backend": backend,
                "ms_per_step": 1000 * times[len(times) // 2],
                "first_loss": float(np.mean(losses[:20])), "last_loss": float(np.mean(losses[-20:])),
                # On a pure NCCL group the comparison's all-gather needs device tensors.
                "identical": same_on_all_ranks(p.to(device) if backend == "nccl" else p, world),
                "params_crc": zlib.crc32(p.double().cpu().numpy().tobytes()),
                "plan": chosen, "tried": tried, "collectives": collectives,
                "shared_memories": shared, "ring_bytes": ring_bytes,
                "warnings": [str(w.message) for w in caught if "gradpack" in str(w.message)],
            })
    for name in filter(None, plan.get("resume", "").split(",")):
        # k steps, a checkpoint, k more steps; then a fresh DDP model, optimizer and hook
        # state restored from the checkpoint, and the same k steps: same parameters.
        k = steps // 2
        net, opt, state = make(config(name), 7)
        run_steps(net, opt, xs, ys, rank, world, k, 0)
        ckpt = os.path.join(out_dir, f"ckpt-{name}-{rank}.pt")
        torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()}, ckpt)
        run_steps(net, opt, xs, ys, rank, world, k, k)
        straight, straight_plan = flat_params(net), chosen_plan(state)
        state.close()
        saved = torch.load(ckpt, weights_only=True)
        net, opt, state = make(config(name), 7, init=99)  # other init: all must come from the file
        net.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if rank % 2:
            # Saved through the hook, read and written again by the crate's NamedState
            # (as another front end of the crate would hand its state over), restored as
            # bytes; rank 0 restores the hook's dict: every rank must continue alike.
            import gradpack
            ns = gradpack.NamedState.load(saved["hook"]["state"].numpy().tobytes())
            state.load_state_dict(gradpack.NamedState(
                ns.settings, ns.step, ns.residuals, ns.velocities, ns.low_rank,
                ns.collectives, ns.plan).save())
        else:
            state.load_state_dict(saved["hook"])
        run_steps(net, opt, xs, ys, rank, world, k, k)
        resumed = flat_params(net)
        results.append({"config": name, "resume": True,
                        "equal": bool(torch.equal(straight, resumed)),
                        "max_diff": float((straight - resumed).abs().max()),
                        "plan_equal": chosen_plan(state) == straight_plan,
                        "plan": straight_plan})
        state.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    leave()


def leave() -> None:
    """End a worker whose results are written: a barrier, the process group torn down,
    then the process ended without the interpreter's finalization.

    gloo can abort the process at exit ("terminate called without an active exception")
    when a rank tears down while a peer's last messages are still in flight (the barrier
    covers that) or when the interpreter's finalization destroys tensors that gloo's
    threads still hold (PyTorch's own exit race, seen about once in a few hundred spawns
    here even after the barrier). Nothing is left to finalize: the results are in their
    file, closed, and the group is destroyed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def model_topk_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One backward through the hook with ``selection="model"`` (top-k 1% with error
    feedback over every compressed parameter at once), against the same step worked out
    by hand: each rank's own gradient of the same model, the compressed parameters laid
    end to end in the model's order and encoded by one ``gradpack.ErrorFeedback``,
    decoded, summed in rank order and divided by the ranks; float32 for the rest."""
    import gradpack
    import gradpack.torch as gpt
    import gradpack._torch_net
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, _, _ = data()
    spec, least, batch = "topk:ratio=0.01,values=fp16", 1024, 32
    net = DDP(model(0), bucket_cap_mb=0.1)
    state = gpt.GradpackState(codec=spec, error_feedback=True, selection="model",
                              min_compress_elements=least, model=net)
    net.register_comm_hook(state, gpt.gradpack_hook)
    idx = torch.randint(0, len(xs), (batch * world,), generator=torch.Generator().manual_seed(0))

    def loss(m: torch.nn.Module, r: int) -> torch.Tensor:
        i = idx[r * batch:(r + 1) * batch]
        return torch.nn.functional.cross_entropy(m(xs[i]), ys[i])

    loss(net, rank).backward()
    got = [p.grad.detach().reshape(-1).clone() for p in net.parameters()]
    state.close()
    plain = model(0)
    params = list(plain.parameters())
    comp = [j for j, p in enumerate(params) if p.dim() > 1 and p.numel() >= least]
    sums: List[torch.Tensor] = []
    for r in range(world):
        plain.zero_grad()
        loss(plain, r).backward()
        g = [p.grad.detach().reshape(-1).clone() for p in params]
        vec = torch.cat([g[j] for j in comp]).numpy()
        sent = torch.from_numpy(gradpack.decode(gradpack.ErrorFeedback(spec, vec.size).encode(vec)).copy())
        at = 0
        for j in comp:
            g[j] = sent[at:at + g[j].numel()]
            at += g[j].numel()
        sums = g if not sums else [a + b for a, b in zip(sums, g)]
    want = [t / world for t in sums]
    result = {
        "equal": all(torch.equal(a, b) for a, b in zip(got, want)),
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(got, want)),
        # The share of each compressed parameter's entries that some rank sent.
        "density": {str(j): float((want[j] != 0).float().mean()) for j in comp},
        "sizes": {str(j): params[j].numel() for j in comp},
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    leave()


def run_model_topk(world: int) -> List[Dict[str, Any]]:
    """:func:`model_topk_worker` on ``world`` processes: each rank's result."""
    with tempfile.TemporaryDirectory() as d:
        spawn(model_topk_worker, (world, free_port(), d), world)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def link_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """``gradpack.torch.measure_link`` on the default (gloo) group: the figures this rank
    got."""
    import gradpack.torch as gpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bw, lat = gpt.measure_link(small=256, large=1 << 16, repeats=2)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"bandwidth": bw, "latency": lat}, f)
    leave()


def run_link(world: int) -> List[Dict[str, Any]]:
    """:func:`link_worker` on ``world`` processes: each rank's figures."""
    with tempfile.TemporaryDirectory() as d:
        spawn(link_worker, (world, free_port(), d), world)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def killed_worker(rank: int, world: int, port: int, cfg: str, out_dir: str) -> None:
    """Train with the hook; the last rank dies (``os._exit``) at the start of step 5, the
    others record how long after its death their step raised, and what."""
    import time

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, _, _ = data()
    c = config(cfg)
    c["extra"] = dict(c.get("extra", {}), timeout=60)
    net, opt, state = make(c, 0)
    result: Dict[str, Any] = {"raised": None}
    try:
        run_steps(net, opt, xs, ys, rank, world, 5, 0)
        dist.barrier()
        if rank == world - 1:
            os._exit(3)
        t0 = time.perf_counter()
        run_steps(net, opt, xs, ys, rank, world, 3, 5)
    except Exception as e:  # what the test looks at
        result = {"raised": f"{type(e).__name__}: {e}"[:300], "after_s": time.perf_counter() - t0}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: a peer is gone


def mismatch_worker(rank: int, world: int, port: int, option: str, out_dir: str) -> None:
    """Train int8 with the hook, the last rank's state made with another ``option``
    (``seed``, ``codec`` or ``pieces``): every rank's first step must raise, naming it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    xs, ys, _, _ = data()
    c = dict(CONFIGS["int8-ef-ring"])  # pieces=2
    seed = 0
    if rank == world - 1:
        if option == "seed":
            seed = 9
        else:
            c.update({"codec": {"codec": "fp16"}, "pieces": {"pieces": 1}}[option])
    net, opt, state = make(c, seed, init=0)
    result: Dict[str, Any] = {"raised": None}
    try:
        run_steps(net, opt, xs, ys, rank, world, 2, 0)
    except Exception as e:  # what the test looks at
        result = {"raised": f"{type(e).__name__}: {e}"[:400]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: the step failed


def run_mismatch(world: int, option: str) -> List[Dict[str, Any]]:
    """:func:`mismatch_worker` on ``world`` processes: each rank's result."""
    with tempfile.TemporaryDirectory() as d:
        spawn(mismatch_worker, (world, free_port(), option, d), world)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


def run_killed(world: int, cfg: str, timeout: float = 120) -> List[Dict[str, Any]]:
    """:func:`killed_worker` on ``world`` processes; the survivors' results (a survivor
    that never finishes is reported as hung)."""
    ctx = context()
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        procs = [ctx.Process(target=killed_worker, args=(r, world, port, cfg, d)) for r in range(world)]
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, configs: List[str], seeds: List[int], steps: int, resume: str = "",
        device: str = "cpu", backend: str = "gloo") -> List[List[Dict[str, Any]]]:
    """Train every configuration on ``world`` processes, the default process group on
    ``backend`` (gloo, nccl or a mixed ``cpu:gloo,cuda:nccl``), the models on ``device``
    (``cuda``: rank r on GPU r, or all on the first where there are fewer GPUs)."""
    with tempfile.TemporaryDirectory() as d:
        plan = {"configs": configs, "seeds": seeds, "steps": steps, "resume": resume,
                "device": device, "backend": backend}
        spawn(worker, (world, free_port(), plan, d), world)
        return [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--configs", default="fp32,fp16,int8,topk-ef")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--resume", default="")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (rank r on GPU r, or all on one)")
    ap.add_argument("--backend", default="gloo", help="gloo, nccl or cpu:gloo,cuda:nccl")
    a = ap.parse_args()
    res = run(a.world, a.configs.split(","), [int(s) for s in a.seeds.split(",")], a.steps, a.resume,
              a.device, a.backend)
    for r in res[0]:
        print(json.dumps(r))
    sys.exit(0)
