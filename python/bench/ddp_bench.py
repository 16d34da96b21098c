"""Time per step and final accuracy of PyTorch DDP training with gradpack's hooks against
PyTorch's own, over a throttled loopback.

    python bench/ddp_bench.py                      # 2 and 4 ranks, unthrottled, 10 and 1 Gbit/s
    python bench/ddp_bench.py --worlds 2 --links 1gbit --configs fp32,gp-topk-ef

The model is an MLP of 12.7 M parameters (64 -> 2500 -> 2500 -> 2500 -> 10: 48 MiB of
float32 gradients) trained with SGD on scikit-learn's digits (shipped inside the
package; nothing is downloaded), batch 64 per rank, one torch thread per rank, gloo.

A link is a network namespace whose loopback goes through ``tc tbf`` at the given rate:
every rank of a run talks over that one loopback, so the ranks share its bandwidth (as on
a shared switch uplink). Making namespaces needs root and iproute2; where that fails the
script says so and runs the ranks unthrottled.

Each configuration runs in its own process group (a configuration that fails, as
PyTorch's PowerSGD hook may, is reported and the rest go on). Per run: ``--warmup``
steps, then ``--steps`` timed steps (the median is reported); the accuracy is measured
once per configuration and world size, unthrottled (it does not depend on the link), after
``--train-steps`` steps. Results go to stdout as a markdown table and to ``--out`` as JSON.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = {
    "fp32": "no hook: DDP's float32 all-reduce",
    "torch-fp16": "PyTorch fp16_compress_hook",
    "torch-bf16": "PyTorch bf16_compress_hook",
    "torch-powersgd-r1": "PyTorch PowerSGD, rank 1 (start after 2 steps)",
    "torch-powersgd-r4": "PyTorch PowerSGD, rank 4 (start after 2 steps)",
    "gp-fp16": "gradpack fp16",
    "gp-int8": "gradpack int8",
    "gp-qsgd4": "gradpack qsgd 4-bit",
    "gp-fp16-ring": "gradpack fp16, compressed ring",
    "gp-int8-ring": "gradpack int8, compressed ring",
    "gp-sign-ef": "gradpack sign + error feedback",
    "gp-topk-ef": "gradpack top-k 1% (fp16 values) + error feedback",
    "gp-auto": "gradpack auto (cost model on the measured link)",
    "gp-powersgd-r1": "gradpack PowerSGD, rank 1 (start after 2 steps)",
    "gp-powersgd-r4": "gradpack PowerSGD, rank 4 (start after 2 steps)",
}

LINKS = {"unthrottled": None, "10gbit": "10gbit", "1gbit": "1gbit"}


# ---------------------------------------------------------------------- one rank


def model():
    import torch

    torch.manual_seed(0)
    h = 2500
    return torch.nn.Sequential(
        torch.nn.Linear(64, h), torch.nn.ReLU(),
        torch.nn.Linear(h, h), torch.nn.ReLU(),
        torch.nn.Linear(h, h), torch.nn.ReLU(),
        torch.nn.Linear(h, 10),
    )


def hook_for(name, net, world):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradpack.torch as gpt

    if name == "fp32":
        return None
    if name == "torch-fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "torch-bf16":
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name.startswith("torch-powersgd"):
        rank = int(name.rsplit("r", 1)[1])
        st = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        net.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
    else:
        kw = {
            "gp-fp16": {"codec": "fp16"},
            "gp-int8": {"codec": "int8"},
            "gp-fp16-ring": {"codec": "fp16", "strategy": "ring"},
            "gp-int8-ring": {"codec": "int8", "strategy": "ring"},
            "gp-qsgd4": {"codec": "qsgd:bits=4,block=512"},
            "gp-sign-ef": {"codec": "sign", "error_feedback": True},
            "gp-topk-ef": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True},
            "gp-powersgd-r1": {"powersgd": {"rank": 1, "start_step": 2}},
            "gp-powersgd-r4": {"powersgd": {"rank": 4, "start_step": 2}},
        }.get(name)
        if name == "gp-auto":
            bw, lat = gpt.measure_link()
            kw = {"codec": "auto", "bandwidth": bw, "latency": lat}
        st = gpt.GradpackState(model=net, **kw)
        net.register_comm_hook(st, gpt.gradpack_hook)
        if name == "gp-auto":
            big = max(p.numel() for p in net.parameters())
            return {"auto_bandwidth_bit_s": bw, "auto_latency_s": lat,
                    "auto_choice_largest": st.codec_for(big).spec}
    return None


def rank_main(rank, world, port, cfg, steps, warmup, train_steps, out):
    import numpy as np
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32))
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(1234).permutation(len(x)))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    xs, ys, xt, yt = x[:cut], y[:cut], x[cut:], y[cut:]
    net = DDP(model())
    info = {}
    result = {"config": cfg, "world": world}
    try:
        info = hook_for(cfg, net, world) or {}
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        batch = 64
        times = []
        total = train_steps if train_steps else warmup + steps
        for s in range(total):
            g = torch.Generator().manual_seed(s)
            idx = torch.randint(0, cut, (batch * world,), generator=g)[rank * batch:(rank + 1) * batch]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        if train_steps:
            with torch.no_grad():
                result["accuracy"] = (net(xt).argmax(1) == yt).float().mean().item()
            result["final_loss"] = loss.item()
        else:
            t = sorted(times[warmup:])
            result["step_ms_median"] = 1000 * t[len(t) // 2]
            result["step_ms_mean"] = 1000 * sum(t) / len(t)
        p = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
        got = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(got, p)
        result["identical"] = all(torch.equal(got[0], g) for g in got)
        result.update(info)
    except Exception as e:  # reported, not fatal to the other configurations
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def child(args):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.world, port, args.config, args.steps, args.warmup,
                              args.train_steps, args.out), nprocs=args.world, join=True)


# ---------------------------------------------------------------------- the driver


def make_netns(name, rate):
    """A namespace whose loopback is limited to ``rate``; None if not permitted."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return None, "ip or tc not found (apt-get install iproute2)"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    burst = {"1gbit": "256kb", "10gbit": "2mb"}.get(rate, "256kb")
    for cmd in (["ip", "netns", "add", name],
                ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                 "rate", rate, "burst", burst, "latency", "50ms"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            return None, f"{' '.join(cmd[:4])}: {r.stderr.strip() or r.returncode}"
    return name, ""


def run_one(ns, world, cfg, steps, warmup, train_steps, timeout=240):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--world", str(world),
           "--config", cfg, "--steps", str(steps), "--warmup", str(warmup),
           "--train-steps", str(train_steps), "--out", out]
    if ns:
        cmd = ["ip", "netns", "exec", ns] + cmd
    t0 = time.time()
    # A session of its own, so that a hung run is killed with every rank it spawned.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        if os.path.exists(out):
            os.unlink(out)
        return {"config": cfg, "world": world, "error": f"hung: killed after {timeout} s",
                "wall_s": round(time.time() - t0, 1)}
    try:
        with open(out) as f:
            res = json.load(f)
    except (OSError, ValueError):
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        res = {"config": cfg, "world": world, "error": f"exit {p.returncode}: {tail[0][:200]}"}
    finally:
        if os.path.exists(out):
            os.unlink(out)
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def driver(args):
    import gradpack
    import torch

    worlds = [int(w) for w in args.worlds.split(",")]
    configs = args.configs.split(",")
    links = [l for l in args.links.split(",") if l and l != "none"]
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; one of {', '.join(CONFIGS)}")
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__, "gradpack_backend": gradpack.backend(),
            "python": platform.python_version(), "steps": args.steps, "warmup": args.warmup,
            "train_steps": args.train_steps}
    print(f"# DDP benchmark, {meta['date']}: {meta['cpu']}, {meta['cores']} cores, torch "
          f"{meta['torch']}, gradpack backend {meta['gradpack_backend']}", flush=True)
    results = []
    for link in links:
        ns = None
        if LINKS.get(link, link) is not None:
            ns, why = make_netns(f"gpbench_{link}", LINKS.get(link, link))
            if ns is None:
                print(f"SKIP throttling for {link}: {why}; running unthrottled", flush=True)
        try:
            for world in worlds:
                for cfg in configs:
                    r = run_one(ns, world, cfg, args.steps, args.warmup, 0)
                    r["link"] = link if ns or LINKS.get(link, link) is None else "unthrottled"
                    results.append(r)
                    print(json.dumps(r), flush=True)
        finally:
            if ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if args.train_steps:
        for world in worlds:
            for cfg in configs:
                r = run_one(None, world, cfg, 0, 0, args.train_steps)
                r["link"] = "accuracy"
                results.append(r)
                print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(table(results, worlds, configs, links))


def table(results, worlds, configs, links):
    def get(cfg, world, link, key):
        for r in results:
            if r["config"] == cfg and r["world"] == world and r["link"] == link:
                if "error" in r:
                    return "failed"
                v = r.get(key)
                return "" if v is None else v
        return ""

    head = "| hook | ranks | " + " | ".join(f"{l} ms/step" for l in links) + " | accuracy |"
    lines = [head, "|" + "---|" * (3 + len(links))]
    for world in worlds:
        for cfg in configs:
            cells = []
            for link in links:
                v = get(cfg, world, link, "step_ms_median")
                cells.append(f"{v:.0f}" if isinstance(v, float) else str(v))
            a = get(cfg, world, "accuracy", "accuracy")
            cells.append(f"{100 * a:.1f}%" if isinstance(a, float) else str(a))
            lines.append(f"| {cfg} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--links", default="unthrottled,10gbit,1gbit",
                    help="comma-separated: unthrottled, 10gbit, 1gbit or any tc rate; none: accuracy only")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=150,
                    help="steps of the accuracy run (0: skip it)")
    ap.add_argument("--out", default="ddp_bench.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
