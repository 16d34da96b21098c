"""The two-level all-reduce against the flat one on an emulated cluster of nodes: ranks
of a node share a fast local switch, and each node reaches the others through one
shaped uplink.

    python bench/hier_bench.py                          # 2 nodes x 4 ranks; 1 and 10 Gbit/s
    python bench/hier_bench.py --nodes 2 --per-node 4 --links 1gbit --mib 16

Topology (as root; iproute2, or pyroute2 where it is missing), ``--inside``:

- ``loopback`` (the default): a network namespace per node, as a host has one network
  stack. Its ranks talk to each other over the node's loopback (unshaped: the kernel
  copies between sockets, as gloo's TCP does between processes of one host), and to
  other nodes through the node's uplink, a veth to a core bridge shaped with ``tc tbf``
  at the link's rate on both ends: full duplex, shared by the node's ranks.
- ``veth``: a namespace per rank with a veth to its node's bridge (in a namespace of
  the node's own; unshaped), the node's bridge reaching the core through the same
  shaped uplink. Traffic inside a node then crosses two veths and a bridge.

The ranks talk over 10.78.0.0/24 in those namespaces only; they are deleted after each
link. Messages between ranks of a node go through shared memory (gradpack's
``shared_memory=``, as the ranks of one host would talk), for the flat all-reduces and
the two-level ones alike; ``--no-shm`` sends them through gloo like the rest.

Per configuration: an all-reduce (mean) of one float32 tensor over gloo
point-to-point messages (``--mib`` MiB), ``--warmup`` runs then ``--runs`` timed ones; the time of a run
is the slowest rank's, and the median is reported, beside the cost model's prediction
(``gradpack.two_level_time`` with the codecs' speeds measured on this machine, one rank
at a time, and the link inside a node measured first: the two-level all-reduce's
float32 phases on one node of ``--per-node`` ranks, unshaped. On a machine with fewer
cores than ranks the ranks' compute is contended). ``fp32 gloo`` is ``torch.distributed``'s own
all-reduce, for reference.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_bench  # noqa: E402

SUBNET = "10.78.0"

# name: (codec, strategy between nodes or of the flat all-reduce, hierarchical, feedback)
CONFIGS = {
    "gloo-fp32": (None, None, False, "none"),
    "flat-fp32": ("identity", "fp32-ring", False, "none"),
    "flat-int8": ("int8", "ring", False, "none"),
    "flat-topk": ("topk:ratio=0.01,values=fp16", "allgather", False, "worker"),
    "hier-fp32": ("identity", "fp32-ring", True, "none"),
    "hier-int8": ("int8", "ring", True, "none"),
    "hier-int8-ef": ("int8", "ring", True, "worker+owner"),
    "hier-topk": ("topk:ratio=0.01,values=fp16", "allgather", True, "worker"),
}


def rank_main(a):
    import numpy as np
    import torch
    import torch.distributed as dist

    import gradpack
    import gradpack.torch as gpt

    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=rank,
                            world_size=world)
    n = int(a.elements)
    x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    out = np.empty_like(x)
    nodes = [r // a.per_node for r in range(world)]
    p2p = gpt._PointToPoint(lambda: dist.group.WORLD)
    # Messages between ranks of a node through shared memory (its ranks share a host),
    # or through gloo like the rest.
    host = [r for r in range(world) if nodes[r] == nodes[rank]]
    shm = dict(shared_memory=f"hb{a.port}", host=host) if a.shm else {}
    res = {"config": a.config}
    codec, strategy, hier, feedback = CONFIGS[a.config]
    if codec is None:
        t = torch.from_numpy(out)

        def run(seed):
            t.copy_(torch.from_numpy(x))
            dist.all_reduce(t)
    else:
        if hier:
            ar = gradpack.Hierarchical(codec, n, rank, world, p2p.send, p2p.recv, nodes,
                                       strategy=strategy, feedback=feedback, **shm)
        else:
            ar = gradpack.AllReduce(codec, n, rank, world, p2p.send, p2p.recv,
                                    strategy=strategy, feedback=feedback, **shm)

        def run(seed):
            ar.run(x, out, seed=seed)
            p2p.wait()
    times = []
    for i in range(a.warmup + a.runs):
        dist.barrier()
        t0 = time.perf_counter()
        run(i + 1)
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        times.append(el.item())
    t = sorted(times[a.warmup:])
    res["ms"] = 1000 * t[len(t) // 2]
    got = torch.from_numpy(out.copy())
    gathered = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(gathered, got)
    res["identical"] = all(torch.equal(gathered[0], g) for g in gathered)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def sh(*cmd):
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


def names(nodes, per_node):
    return (["gpcore"] + [f"gpn{k}" for k in range(nodes)]
            + [f"gpr{r}" for r in range(nodes * per_node)])


def delete(nodes, per_node):
    if ddp_bench.NETLINK["tool"] == "pyroute2":
        from pyroute2 import netns

        for ns in names(nodes, per_node):
            if ns in netns.listnetns():
                netns.remove(ns)
        return
    for ns in names(nodes, per_node):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def make_pyroute2(nodes, per_node, rate, inside):
    """make() through pyroute2's netlink sockets (machines without iproute2)."""
    from pyroute2 import IPRoute, NetNS, netns

    burst = ddp_bench.tbf_burst(rate)

    def bridge(ns):
        netns.create(ns)
        with NetNS(ns) as n:
            n.link("add", ifname="br0", kind="bridge")
            n.link("set", index=n.link_lookup(ifname="br0")[0], state="up")

    def veth(a, ns_a, b, ns_b):
        with IPRoute() as ip:
            ip.link("add", ifname=a, kind="veth", peer=b)
            ip.link("set", index=ip.link_lookup(ifname=a)[0], net_ns_fd=ns_a)
            ip.link("set", index=ip.link_lookup(ifname=b)[0], net_ns_fd=ns_b)

    def port(ns, dev, shaped):
        with NetNS(ns) as n:
            i = n.link_lookup(ifname=dev)[0]
            n.link("set", index=i, master=n.link_lookup(ifname="br0")[0])
            n.link("set", index=i, state="up")
            if shaped:
                n.tc("add", "tbf", i, 0x10000, rate=rate, burst=burst, latency="50ms")

    bridge("gpcore")
    ranks = []
    for k in range(nodes):
        nk = f"gpn{k}"
        if inside == "loopback":
            netns.create(nk)
            veth(f"gpu{k}a", nk, f"gpu{k}b", "gpcore")
            with NetNS(nk) as n:
                i = n.link_lookup(ifname=f"gpu{k}a")[0]
                n.link("set", index=i, ifname="eth0")
                n.addr("add", index=i, address=f"{SUBNET}.{k + 1}", prefixlen=24)
                n.link("set", index=i, state="up")
                n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
                n.tc("add", "tbf", i, 0x10000, rate=rate, burst=burst, latency="50ms")
            port("gpcore", f"gpu{k}b", True)
            ranks += [nk] * per_node
            continue
        bridge(nk)
        veth(f"gpu{k}a", nk, f"gpu{k}b", "gpcore")
        port(nk, f"gpu{k}a", True)
        port("gpcore", f"gpu{k}b", True)
        for l in range(per_node):
            r = k * per_node + l
            ns, va, vb = f"gpr{r}", f"gpv{r}a", f"gpv{r}b"
            netns.create(ns)
            veth(va, ns, vb, nk)
            with NetNS(ns) as n:
                i = n.link_lookup(ifname=va)[0]
                n.link("set", index=i, ifname="eth0")
                n.addr("add", index=i, address=f"{SUBNET}.{r + 1}", prefixlen=24)
                n.link("set", index=i, state="up")
                n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
            port(nk, vb, False)
            ranks.append(ns)
    return ranks


def make(nodes, per_node, rate, inside="loopback"):
    """The namespaces of the ranks (``inside``: ``loopback``, one per node; ``veth``, one
    per rank), or None and why not."""
    if ddp_bench.NETLINK["tool"] is None:
        return None, "neither iproute2 (ip, tc) nor pyroute2 found"
    delete(nodes, per_node)
    if ddp_bench.NETLINK["tool"] == "pyroute2":
        try:
            return make_pyroute2(nodes, per_node, rate, inside), ""
        except Exception as e:  # reported; the run stops
            delete(nodes, per_node)
            return None, f"pyroute2: {type(e).__name__}: {e}"
    try:
        ex = lambda ns, *c: sh("ip", "netns", "exec", ns, *c)  # noqa: E731
        sh("ip", "netns", "add", "gpcore")
        ex("gpcore", "ip", "link", "add", "br0", "type", "bridge")
        ex("gpcore", "ip", "link", "set", "br0", "up")
        ranks = []
        burst = str(ddp_bench.tbf_burst(rate))
        for k in range(nodes):
            nk = f"gpn{k}"
            sh("ip", "netns", "add", nk)
            if inside == "loopback":
                sh("ip", "link", "add", "eth0", "netns", nk, "type", "veth", "peer", "name",
                   f"gpu{k}b", "netns", "gpcore")
                ex(nk, "ip", "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
                ex(nk, "ip", "link", "set", "eth0", "up")
                ex(nk, "ip", "link", "set", "lo", "up")
                ex("gpcore", "ip", "link", "set", f"gpu{k}b", "master", "br0")
                ex("gpcore", "ip", "link", "set", f"gpu{k}b", "up")
                for where, dev in ((nk, "eth0"), ("gpcore", f"gpu{k}b")):
                    ex(where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", burst, "latency", "50ms")
                ranks += [nk] * per_node
                continue
            ex(nk, "ip", "link", "add", "br0", "type", "bridge")
            ex(nk, "ip", "link", "set", "br0", "up")
            # The uplink: node side u{k}a in the node's namespace, core side u{k}b.
            sh("ip", "link", "add", f"gpu{k}a", "netns", nk, "type", "veth", "peer", "name",
               f"gpu{k}b", "netns", "gpcore")
            ex(nk, "ip", "link", "set", f"gpu{k}a", "master", "br0")
            ex(nk, "ip", "link", "set", f"gpu{k}a", "up")
            ex("gpcore", "ip", "link", "set", f"gpu{k}b", "master", "br0")
            ex("gpcore", "ip", "link", "set", f"gpu{k}b", "up")
            for where, dev in ((nk, f"gpu{k}a"), ("gpcore", f"gpu{k}b")):
                ex(where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", burst, "latency", "50ms")
            for l in range(per_node):
                r = k * per_node + l
                ns, va, vb = f"gpr{r}", f"gpv{r}a", f"gpv{r}b"
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", va, "netns", ns, "type", "veth", "peer", "name", vb,
                   "netns", nk)
                ex(ns, "ip", "link", "set", va, "name", "eth0")
                ex(ns, "ip", "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0")
                ex(ns, "ip", "link", "set", "eth0", "up")
                ex(ns, "ip", "link", "set", "lo", "up")
                ex(nk, "ip", "link", "set", vb, "master", "br0")
                ex(nk, "ip", "link", "set", vb, "up")
                ranks.append(ns)
        return ranks, ""
    except RuntimeError as e:
        delete(nodes, per_node)
        return None, str(e)


def run_one(ns, world, per_node, cfg, elements, warmup, runs, shm, timeout=600):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    port = 29400 + (os.getpid() + int(time.time() * 13)) % 20000
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rank", str(r),
               "--world", str(world), "--per-node", str(per_node), "--addr", f"{SUBNET}.1",
               "--port", str(port), "--config", cfg, "--elements", str(elements),
               "--warmup", str(warmup), "--runs", str(runs), "--out", out, "--netns", ns[r]]
        cmd += ["--shm"] if shm else ["--no-shm"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True, env=env))
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=timeout)[1])
        except subprocess.TimeoutExpired:
            p.kill()
            errs.append("timed out")
    try:
        with open(out) as f:
            return json.load(f)
    except (OSError, ValueError):
        tail = "\n".join(errs).strip().splitlines()[-2:] or ["no output"]
        return {"config": cfg, "error": " | ".join(tail)[:300]}
    finally:
        if os.path.exists(out):
            os.unlink(out)


def model(cfg, nodes, per_node, rate, elements, profiles, intra_bw):
    import gradpack

    codec, strategy, hier, _ = CONFIGS[cfg]
    if codec is None:
        codec, strategy = "identity", "fp32-ring"
    prof = profiles[codec]
    return 1000 * gradpack.two_level_time(
        prof, strategy, hier, nodes, per_node, intra_bw, ddp_bench.parse_rate(rate), elements,
        intra_latency=20e-6, inter_latency=50e-6, reduce_bytes_per_s=4e9)


def intra_bandwidth(per_node, elements, runs, inside, shm):
    """The link inside a node as this machine emulates it: one node of ``per_node`` ranks
    (unshaped), the two-level all-reduce's float32 phases inside it (a reduce-scatter and
    an all-gather); bandwidth = a ring's bytes per rank over their time."""
    ns, why = make(1, per_node, "30gbit", inside)  # a lone node's uplink carries nothing
    if ns is None:
        return None, why
    try:
        r = run_one(ns, per_node, per_node, "hier-fp32", elements, 1, runs, shm)
    finally:
        delete(1, per_node)
    if "ms" not in r:
        return None, r.get("error", "failed")
    ring_bytes = 2 * (per_node - 1) / per_node * 4 * elements
    return ring_bytes * 8 / (r["ms"] / 1000), ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--links", default="1gbit,10gbit")
    ap.add_argument("--mib", type=float, default=16.0, help="the tensor, MiB of float32")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default="hier_bench.json")
    ap.add_argument("--inside", choices=["loopback", "veth"], default="loopback",
                    help="ranks of a node: one namespace, over its loopback (default), or "
                         "a namespace each, through veths to the node's bridge")
    ap.add_argument("--no-shm", dest="shm", action="store_false",
                    help="messages between ranks of a node through gloo, not shared memory")
    ap.add_argument("--shm", dest="shm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--netlink", choices=["auto", "iproute2", "pyroute2"], default="auto",
                    help="how to make the namespaces (pyroute2 where iproute2 is missing)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--netns", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="", help=argparse.SUPPRESS)
    ap.add_argument("--elements", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        ddp_bench.enter_netns(a.netns)
        rank_main(a)
        return
    import gradpack

    ddp_bench.NETLINK["tool"] = ddp_bench.netlink_tool(a.netlink)
    elements = int(a.mib * (1 << 20)) // 4
    world = a.nodes * a.per_node
    configs = a.configs.split(",")
    profiles = {}
    for cfg in configs:
        codec = CONFIGS[cfg][0] or "identity"
        if codec not in profiles:
            profiles[codec] = gradpack.calibrate(codec, 1 << 20)
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": ddp_bench.cpu_name(),
            "cores": os.cpu_count(), "nodes": a.nodes, "per_node": a.per_node,
            "elements": elements, "runs": a.runs, "inside": a.inside, "shm": a.shm}
    print(f"# two-level all-reduce, {meta['date']}: {meta['cpu']}, {meta['cores']} cores; "
          f"{a.nodes} nodes x {a.per_node} ranks ({'shared memory' if a.shm else a.inside} "
          "inside a node), "
          f"{elements * 4 / 2**20:.0f} MiB float32",
          flush=True)
    intra_bw, why = intra_bandwidth(a.per_node, elements, a.runs, a.inside, a.shm)
    if intra_bw is None:
        print(f"SKIP: no emulated cluster ({why})", flush=True)
        return
    meta["intra_bandwidth_bit_s"] = intra_bw
    print(f"the link inside a node, measured: {intra_bw / 1e9:.2f} Gbit/s per rank "
          f"(the float32 phases inside one node of {a.per_node} ranks)", flush=True)
    results = []
    for link in a.links.split(","):
        ns, why = make(a.nodes, a.per_node, link, a.inside)
        if ns is None:
            print(f"SKIP {link}: no emulated cluster ({why})", flush=True)
            continue
        try:
            for cfg in configs:
                r = run_one(ns, world, a.per_node, cfg, elements, a.warmup, a.runs, a.shm)
                r["link"] = link
                r["model_ms"] = model(cfg, a.nodes, a.per_node, link, elements, profiles,
                                      intra_bw)
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            delete(a.nodes, a.per_node)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    links = a.links.split(",")
    print("| configuration | " + " | ".join(f"{l} ms | model" for l in links) + " |")
    print("|---|" + "---:|---:|" * len(links))
    for cfg in configs:
        cells = []
        for l in links:
            r = next((x for x in results if x["config"] == cfg and x["link"] == l), {})
            cells.append(f"{r['ms']:.1f} | {r['model_ms']:.1f}" if "ms" in r else f"{r.get('error', '-')[:40]} | -")
        print(f"| {cfg} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
