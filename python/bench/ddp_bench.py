"""Time per step and final accuracy of PyTorch DDP training with gradpack's hooks against
PyTorch's own, on an emulated cluster: every rank its own node with its own port on a
switch.

    python bench/ddp_bench.py                       # 4 ranks; unthrottled, 10 and 1 Gbit/s
    python bench/ddp_bench.py --worlds 4,8 --links 1gbit,10gbit,25gbit --configs fp32,gp-auto
    python bench/ddp_bench.py --configs fp32,gp-topk-ef,gp-topk-ef-from-25   # float32 before step 25
    python bench/ddp_bench.py --configs fp32,gp-sign-ef-mc   # momentum correction
    python bench/ddp_bench.py --configs fp32,gp-int8,gp-int8-pg  # native TCP vs gloo p2p

The model is an MLP of 12.7 M parameters (64 -> 2500 -> 2500 -> 2500 -> 10: 48 MiB of
float32 gradients) trained with SGD on scikit-learn's digits (shipped inside the
package; nothing is downloaded), batch 64 per rank, one torch thread per rank, gloo.

The cluster: a network namespace per rank, each with a veth pair to a bridge in a switch
namespace, and ``tc tbf`` at the link's rate on both ends of every veth, so each rank has
a full-duplex port of its own, as on a switch (a single shaped loopback shared by all
ranks would divide one link among them and hide what an all-gather costs). The ranks
talk over 10.77.0.0/24 inside those namespaces only; the namespaces are deleted after
each link. ``unthrottled`` uses the same topology without tc. Making namespaces needs
root and either iproute2 (``ip``, ``tc``) or the pure-Python pyroute2 (for machines
without iproute2: ``--netlink pyroute2`` picks it where both exist); where that fails
the script says so and runs on the loopback.

All ranks share this machine's cores: with fewer cores than ranks, compute is contended
and the timings say so in their header. Each rank runs torch on one thread and
gradpack's kernels on its share of the cores (``--rank-threads``; 16 cores and 8 ranks:
two each), as a node of that many cores would: left to itself, every rank's gradpack
would start a thread per core of the whole machine.

Each configuration runs in its own process group (a configuration that fails, as
PyTorch's PowerSGD hook may, is reported and the rest go on). Per run: ``--warmup``
steps, then ``--steps`` timed steps (the median is reported); the accuracy is measured
once per configuration and world size, unthrottled (it does not depend on the link), after
``--train-steps`` steps. Results go to stdout as a markdown table and to ``--out`` as JSON.
"""

import argparse
import importlib.util
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
    "noop": "PyTorch noop_hook: no communication at all (the floor)",
    "torch-fp16": "PyTorch fp16_compress_hook",
    "torch-bf16": "PyTorch bf16_compress_hook",
    "torch-powersgd-r1": "PyTorch PowerSGD, rank 1 (start after 2 steps)",
    "torch-powersgd-r4": "PyTorch PowerSGD, rank 4 (start after 2 steps)",
    "gp-fp16": "gradpack fp16 (the default strategy: all-gather on 2 ranks, ring from 3)",
    "gp-int8": "gradpack int8 (the default strategy: all-gather on 2 ranks, ring from 3)",
    "gp-int8-allgather": "gradpack int8, all-gather",
    "gp-qsgd4": "gradpack qsgd 4-bit",
    "gp-fp16-ring": "gradpack fp16, compressed ring",
    "gp-int8-ring": "gradpack int8, compressed ring",
    "gp-sign-ef": "gradpack sign + error feedback",
    "gp-topk-ef": "gradpack top-k 1% (fp16 values) + error feedback",
    "gp-topk-ef-model": "gradpack top-k 1% + error feedback, one selection over the model",
    "gp-auto": "gradpack auto (cost model on the measured link, then measured; float32, fp16, int8)",
    "gp-auto-sparse": "gradpack auto, top-k 1% + EF and sign + EF among the candidates too",
    "gp-int8-ef-ring": "gradpack int8 + error feedback, compressed ring, 2 pieces",
    "gp-powersgd-r1": "gradpack PowerSGD, rank 1 (start after 2 steps)",
    "gp-powersgd-r2": "gradpack PowerSGD, rank 2 (start after 2 steps)",
    "gp-powersgd-r4": "gradpack PowerSGD, rank 4 (start after 2 steps)",
}

MOMENTUM = 0.9  # SGD's, or the hook's with momentum correction

LINKS = {"unthrottled": None, "25gbit": "25gbit", "10gbit": "10gbit", "1gbit": "1gbit"}
SUBNET = "10.77.0"


# ---------------------------------------------------------------------- one rank


def data():
    """scikit-learn's digits, shuffled once: (train x, train y, test x, test y) tensors."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy((d.data / 16.0).astype(np.float32))
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(1234).permutation(len(x)))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def model(seed=0):
    import torch

    torch.manual_seed(seed)
    h = 2500
    return torch.nn.Sequential(
        torch.nn.Linear(64, h), torch.nn.ReLU(),
        torch.nn.Linear(h, h), torch.nn.ReLU(),
        torch.nn.Linear(h, h), torch.nn.ReLU(),
        torch.nn.Linear(h, 10),
    )


def split_start(name):
    """A gradpack configuration's name and its ``start_step``: ``NAME-from-N`` is NAME
    with float32 steps before step N (``GradpackState(start_step=N)``)."""
    head, sep, n = name.rpartition("-from-")
    if sep and head.startswith("gp-") and n.isdigit():
        return head, int(n)
    return name, 0


def split_momentum(name):
    """A gradpack configuration's name and whether ``-mc`` follows it: momentum
    correction, the velocity kept in the hook (``GradpackState(momentum=0.9)``) and the
    optimizer without momentum."""
    if name.startswith("gp-") and name.endswith("-mc"):
        return name[: -len("-mc")], True
    return name, False


def split_transport(name):
    """A gradpack configuration's name and the hook's transport: ``NAME-pg`` is NAME with
    its messages on the hook's gloo point-to-point (``transport="process_group"``, every
    message through Python) instead of gradpack's native TCP transport."""
    if name.startswith("gp-") and name.endswith("-pg"):
        return name[: -len("-pg")], "process_group"
    return name, "tcp"


def base_name(name):
    """A configuration's name without its ``-pg``, ``-mc`` and ``-from-N``."""
    return split_momentum(split_start(split_transport(name)[0])[0])[0]


def hook_for(name, net, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradpack.torch as gpt

    if name == "fp32":
        return None, {}
    if name == "noop":
        from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

        net.register_comm_hook(None, debugging_hooks.noop_hook)
    elif name == "torch-fp16":
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
        base, transport = split_transport(name)
        base, start = split_start(base)
        base, corrected = split_momentum(base)
        kw = {
            "gp-fp16": {"codec": "fp16"},
            "gp-int8": {"codec": "int8"},
            "gp-int8-allgather": {"codec": "int8", "strategy": "allgather"},
            "gp-fp16-ring": {"codec": "fp16", "strategy": "ring"},
            "gp-int8-ring": {"codec": "int8", "strategy": "ring"},
            "gp-int8-ef-ring": {"codec": "int8", "strategy": "ring", "error_feedback": True,
                                "pieces": 2},
            "gp-qsgd4": {"codec": "qsgd:bits=4,block=512"},
            "gp-sign-ef": {"codec": "sign", "error_feedback": True},
            "gp-topk-ef": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True},
            "gp-topk-ef-model": {"codec": "topk:ratio=0.01,values=fp16", "error_feedback": True,
                                 "selection": "model"},
            "gp-powersgd-r1": {"powersgd": {"rank": 1, "start_step": 2}},
            "gp-powersgd-r2": {"powersgd": {"rank": 2, "start_step": 2}},
            "gp-powersgd-r4": {"powersgd": {"rank": 4, "start_step": 2}},
        }.get(base)
        if base in ("gp-auto", "gp-auto-sparse"):
            bw, lat = gpt.measure_link()
            kw = {"codec": "auto", "bandwidth": bw, "latency": lat}
            if base == "gp-auto-sparse":
                kw["candidates"] = list(gpt.DEFAULT_CANDIDATES) + [
                    "topk:ratio=0.01,values=fp16", "sign"]
        if start:
            kw = dict(kw, start_step=start)
        if corrected:
            kw = dict(kw, momentum=MOMENTUM)
        # Each rank stands for a node of its own: its messages must cross its shaped
        # port, not the shared memory that the ranks of this one machine could use.
        st = gpt.GradpackState(model=net, shared_memory=False, transport=transport, **kw)
        net.register_comm_hook(st, gpt.gradpack_hook)
        if base in ("gp-auto", "gp-auto-sparse"):
            return st, {"auto_bandwidth_bit_s": bw, "auto_latency_s": lat}
        return st, {}
    return None, {}


def enter_netns(name):
    """Move this process into the named network namespace (before any thread starts)."""
    path = f"/var/run/netns/{name}"
    if hasattr(os, "setns"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)
    else:
        from pyroute2 import netns

        netns.setns(name, flags=0)


def rank_main(rank, world, addr, port, cfg, steps, warmup, train_steps, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    xs, ys, xt, yt = data()
    cut = len(xs)
    net = DDP(model())
    info = {}
    state = None
    result = {"config": cfg, "world": world}
    try:
        state, info = hook_for(cfg, net, world)
        # With momentum correction the hook keeps the velocity: the optimizer has none.
        corrected = split_momentum(split_start(split_transport(cfg)[0])[0])[1]
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.0 if corrected else MOMENTUM)
        batch = 64
        times, phases = [], []
        busy = {}
        if state is not None and hasattr(state, "_reduce"):
            # The hook thread's time per bucket reduction (host copies, encode, exchange,
            # sum), to set beside the step's backward: a diagnostic, this rank only.
            reduce = state._reduce

            def timed(buf, index, *a, **k):
                t = time.perf_counter()
                try:
                    return reduce(buf, index, *a, **k)
                finally:
                    busy.setdefault(index, []).append(time.perf_counter() - t)

            state._reduce = timed
        if state is not None and cfg.startswith("gp-auto"):
            # auto's measured trials (float32 and the `trials` best, `trial_steps` each)
            # come first: the timed steps are the steady state after them.
            warmup += state.trial_steps * (1 + state.trials)
            info["auto_trial_steps"] = state.trial_steps * (1 + state.trials)
        total = train_steps if train_steps else warmup + steps
        for s in range(total):
            if s == warmup:
                busy.clear()  # the timed steps' reductions only (not auto's trials)
            g = torch.Generator().manual_seed(s)
            idx = torch.randint(0, cut, (batch * world,), generator=g)[rank * batch:(rank + 1) * batch]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            t1 = time.perf_counter()
            loss.backward()  # waits for the buckets' reductions at its end
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            times.append(t3 - t0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        if train_steps:
            with torch.no_grad():
                result["accuracy"] = (net(xt).argmax(1) == yt).float().mean().item()
            result["final_loss"] = loss.item()
        else:
            t = sorted(times[warmup:])
            result["step_ms_median"] = 1000 * t[len(t) // 2]
            result["step_ms_mean"] = 1000 * sum(t) / len(t)
            # Where a step goes: forward, backward with the wait for the reductions, the
            # optimizer (medians of the timed steps, this rank).
            for k, name in enumerate(("forward", "backward", "optimizer")):
                v = sorted(p[k] for p in phases[warmup:])
                result[f"{name}_ms_median"] = round(1000 * v[len(v) // 2], 2)
            for index, ts in sorted(busy.items()):
                v = sorted(ts)
                result[f"hook_bucket{index}_ms_median"] = round(1000 * v[len(v) // 2], 2)
        p = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
        got = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(got, p)
        result["identical"] = all(torch.equal(got[0], g) for g in got)
        if state is not None and cfg.startswith("gp-auto"):
            info["auto_plan"] = [f"{r['codec']} by {r['strategy']}"
                                 for r in state.plan() if r["chosen"]]
            # Every configuration tried, modelled and measured (ms), for the record.
            info["auto_trials"] = [
                [r["bucket"], r["codec"], r["strategy"], r["modelled_ms"] and round(r["modelled_ms"], 2),
                 r["measured_ms"] and round(r["measured_ms"], 2), r["chosen"]]
                for r in state.plan()]
        result.update(info)
        if state is not None:
            state.close()
        dist.barrier()
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
    if args.netns:
        enter_netns(args.netns)
    rank_main(args.rank, args.world, args.addr, args.port, args.config, args.steps,
              args.warmup, args.train_steps, args.out)


# ---------------------------------------------------------------------- the driver


def sh(*cmd):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


NETLINK = {"tool": None}


def netlink_tool(want):
    """``iproute2`` or ``pyroute2`` (``want``, or whichever this machine has), or None."""
    has_ip = shutil.which("ip") is not None and shutil.which("tc") is not None
    has_pr = importlib.util.find_spec("pyroute2") is not None
    if want == "pyroute2":
        return "pyroute2" if has_pr else None
    if want == "iproute2":
        return "iproute2" if has_ip else None
    return "iproute2" if has_ip else "pyroute2" if has_pr else None


def delete_cluster(world):
    names = ["gpsw"] + [f"gpr{r}" for r in range(world)]
    if NETLINK["tool"] == "pyroute2":
        from pyroute2 import netns

        for ns in names:
            if ns in netns.listnetns():
                netns.remove(ns)
        return
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def tbf_burst(rate):
    """The tbf burst in bytes: 1 ms at the rate, at least 64 KiB."""
    return max(int(parse_rate(rate) / 8 / 1000), 64 * 1024)


def make_cluster_pyroute2(world, rate):
    """make_cluster through pyroute2's netlink sockets: the same namespaces, links,
    addresses and tbf qdiscs."""
    from pyroute2 import IPRoute, NetNS, netns

    netns.create("gpsw")
    with NetNS("gpsw") as sw:
        sw.link("add", ifname="br0", kind="bridge")
        sw.link("set", index=sw.link_lookup(ifname="br0")[0], state="up")
    names = []
    for r in range(world):
        ns, a, b = f"gpr{r}", f"gpv{r}a", f"gpv{r}b"
        netns.create(ns)
        with IPRoute() as ip:
            ip.link("add", ifname=a, kind="veth", peer=b)
            ip.link("set", index=ip.link_lookup(ifname=a)[0], net_ns_fd=ns)
            ip.link("set", index=ip.link_lookup(ifname=b)[0], net_ns_fd="gpsw")
        with NetNS(ns) as n:
            i = n.link_lookup(ifname=a)[0]
            n.link("set", index=i, ifname="eth0")
            n.addr("add", index=i, address=f"{SUBNET}.{r + 1}", prefixlen=24)
            n.link("set", index=i, state="up")
            n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
            if rate:
                n.tc("add", "tbf", i, 0x10000, rate=rate, burst=tbf_burst(rate),
                     latency="50ms")
        with NetNS("gpsw") as sw:
            j = sw.link_lookup(ifname=b)[0]
            sw.link("set", index=j, master=sw.link_lookup(ifname="br0")[0])
            sw.link("set", index=j, state="up")
            if rate:
                sw.tc("add", "tbf", j, 0x10000, rate=rate, burst=tbf_burst(rate),
                      latency="50ms")
        names.append(ns)
    return names


def make_cluster(world, rate):
    """Namespaces gpr0..gpr{world-1}, each with eth0 (10.77.0.(r+1)) on a veth to the
    bridge of namespace gpsw, both ends shaped to ``rate`` (None: unshaped). Returns the
    namespaces, or None and why not."""
    if NETLINK["tool"] is None:
        return None, "neither iproute2 (apt-get install iproute2) nor pyroute2 found"
    delete_cluster(world)
    if NETLINK["tool"] == "pyroute2":
        try:
            return make_cluster_pyroute2(world, rate), ""
        except Exception as e:  # reported: the run goes on, on the loopback
            delete_cluster(world)
            return None, f"pyroute2: {type(e).__name__}: {e}"
    try:
        sh("ip", "netns", "add", "gpsw")
        sh("ip", "netns", "exec", "gpsw", "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", "gpsw", "ip", "link", "set", "br0", "up")
        names = []
        for r in range(world):
            ns, a, b = f"gpr{r}", f"gpv{r}a", f"gpv{r}b"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", a, "netns", ns, "type", "veth", "peer", "name", b, "netns", "gpsw")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", a, "name", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", "gpsw", "ip", "link", "set", b, "master", "br0")
            sh("ip", "netns", "exec", "gpsw", "ip", "link", "set", b, "up")
            if rate:
                # The port's rate both ways: tbf on the rank's side shapes what it sends,
                # on the switch's side what it receives. Burst: 1 ms at the rate.
                burst = str(tbf_burst(rate))
                for where, dev in ((ns, "eth0"), ("gpsw", b)):
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                       "tbf", "rate", rate, "burst", burst, "latency", "50ms")
            names.append(ns)
        return names, ""
    except RuntimeError as e:
        delete_cluster(world)
        return None, str(e)


def parse_rate(rate):
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    return float(rate)


def rank_threads(world, asked=0):
    """gradpack's threads per rank: ``asked``, or this machine's cores shared out among the
    ranks (a node of ``cores / world`` cores each), at least one."""
    return asked if asked > 0 else max(1, (os.cpu_count() or 1) // world)


def run_one(names, world, cfg, steps, warmup, train_steps, timeout=300, threads=0):
    """One configuration on ``world`` ranks, rank r in namespace ``names[r]`` (None: all on
    the loopback), gradpack's kernels on ``rank_threads(world, threads)`` threads per rank
    (torch's on one)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    addr = f"{SUBNET}.1" if names else "127.0.0.1"
    port = 29400 + (os.getpid() + int(time.time())) % 20000
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0" if names else "lo", OMP_NUM_THREADS="1",
               RAYON_NUM_THREADS=str(rank_threads(world, threads)))
    t0 = time.time()
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rank", str(r),
               "--world", str(world), "--addr", addr, "--port", str(port), "--config", cfg,
               "--steps", str(steps), "--warmup", str(warmup),
               "--train-steps", str(train_steps), "--out", out]
        if names:
            # The rank moves itself into its namespace (no iproute2 needed).
            cmd += ["--netns", names[r]]
        # A session of its own, so that a hung run is killed with everything it started.
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True, env=env))
    errs = []
    hung = False
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
            errs.append(err)
        except subprocess.TimeoutExpired:
            hung = True
    if hung:
        for p in procs:
            if p.poll() is None:
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
        tail = "\n".join(errs).strip().splitlines()[-1:] or ["no output"]
        res = {"config": cfg, "world": world,
               "error": f"exit {[p.returncode for p in procs]}: {tail[0][:200]}"}
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

    NETLINK["tool"] = netlink_tool(args.netlink)
    worlds = [int(w) for w in args.worlds.split(",")]
    configs = args.configs.split(",")
    links = [l for l in args.links.split(",") if l and l != "none"]
    for c in configs:
        if base_name(c) not in CONFIGS:
            sys.exit(f"unknown config {c!r}; one of {', '.join(CONFIGS)}, a gradpack one "
                     "as NAME-from-N to start compressing at step N, NAME-mc with momentum "
                     "correction (NAME-mc-from-N both)")
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
            "torch": torch.__version__, "gradpack_backend": gradpack.backend(),
            "python": platform.python_version(), "steps": args.steps, "warmup": args.warmup,
            "train_steps": args.train_steps, "netlink": NETLINK["tool"],
            "rank_threads": {w: rank_threads(w, args.rank_threads) for w in worlds}}
    print(f"# DDP benchmark, {meta['date']}: {meta['cpu']}, {meta['cores']} cores, torch "
          f"{meta['torch']}, gradpack backend {meta['gradpack_backend']}, gradpack threads "
          f"per rank {meta['rank_threads']}", flush=True)
    if max(worlds) > (os.cpu_count() or 1):
        print(f"NOTE: {max(worlds)} ranks on {os.cpu_count()} cores: the ranks' compute is "
              "contended, so steps are slower than on a cluster of that many nodes", flush=True)
    results = []
    for link in links:
        for world in worlds:
            rate = LINKS.get(link, link)
            names, why = make_cluster(world, rate)
            if names is None:
                print(f"SKIP the emulated cluster for {link}: {why}; running on the loopback"
                      + (", unthrottled" if rate else ""), flush=True)
            try:
                for cfg in configs:
                    r = run_one(names, world, cfg, args.steps, args.warmup, 0,
                                threads=args.rank_threads)
                    r["link"] = link if names or rate is None else "unthrottled"
                    results.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                if names:
                    delete_cluster(world)
    if args.train_steps:
        for world in worlds:
            names, _ = make_cluster(world, None)
            try:
                for cfg in configs:
                    r = run_one(names, world, cfg, 0, 0, args.train_steps,
                                threads=args.rank_threads)
                    r["link"] = "accuracy"
                    results.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                if names:
                    delete_cluster(world)
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

    head = ("| hook | ranks | " + " | ".join(f"{l} ms/step | x fp32" for l in links)
            + " | accuracy |")
    lines = [head, "|---|---|" + "---:|---:|" * len(links) + "---:|"]
    for world in worlds:
        for cfg in configs:
            cells = []
            for link in links:
                v = get(cfg, world, link, "step_ms_median")
                base = get("fp32", world, link, "step_ms_median")
                cells.append(f"{v:.0f}" if isinstance(v, float) else str(v))
                ok = isinstance(v, float) and isinstance(base, float)
                cells.append(f"{v / base:.2f}" if ok else "")
            a = get(cfg, world, "accuracy", "accuracy")
            cells.append(f"{100 * a:.1f}%" if isinstance(a, float) else str(a))
            lines.append(f"| {cfg} | {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="4")
    ap.add_argument("--links", default="unthrottled,10gbit,1gbit",
                    help="comma-separated: unthrottled, 10gbit, 1gbit or any tc rate; none: accuracy only")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=12, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=250,
                    help="steps of the accuracy run (0: skip it)")
    ap.add_argument("--out", default="ddp_bench.json")
    ap.add_argument("--rank-threads", type=int, default=0,
                    help="gradpack's threads per rank (0: the cores shared out among the ranks)")
    ap.add_argument("--netlink", choices=["auto", "iproute2", "pyroute2"], default="auto",
                    help="how the namespaces are made (auto: iproute2 where it is installed)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--netns", default="", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="fp32", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
