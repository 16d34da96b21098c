"""What a message costs: gradpack's compressed ring and two-shot through its native
transport (``gradpack.Tcp``) and through the PyTorch hook's gloo point-to-point, against
the crate's model with the codec's measured speeds.

    sudo python bench/transport_bench.py                      # 2 and 4 ranks, 10 Gbit/s
    sudo python bench/transport_bench.py --worlds 2 --link 10gbit --codec int8 --mib 16

Every rank is a node of its own, as in ``ddp_bench.py`` (whose cluster this reuses): a
network namespace per rank with a veth to a bridge, ``tc tbf`` at the link's rate on
both ends, so each rank has a full-duplex port of its own. Per world size:

- ``gradpack.AllReduce`` by each of ``--strategies`` (the ring and the two-shot) on a
  bucket of ``--mib`` MiB of float32, for each number of pieces in ``--pieces``, through
  ``gradpack.Tcp`` (made through torch's store) and through ``gradpack.torch``'s
  point-to-point on a gloo group (every message through Python, as the hook sent them
  before the native transport);
- the model: ``gradpack.ring_time`` (the two-shot: ``gradpack.allreduce_time``) with the
  codec's speeds measured on this machine (``gradpack.calibrate`` on a chunk, on the
  rank's own threads) and the link's rate, for the same pieces; the model's choice is
  marked;
- the floor this emulation allows: the ring's compressed bytes streamed through plain
  sockets, both directions at once, with no codec and no steps (on few cores the veth
  pairs' copies and tc take the same cores as the ranks, which a NIC would not);
- the float32 all-reduce of the bucket: gradpack's fp32 ring through ``gradpack.Tcp``,
  and gloo's.

Each figure is the median of ``--reps`` runs, each started by a barrier. With fewer cores
than ranks the ranks share cores (the header says so): compute is contended and the
model, whose speeds are one rank's alone, is optimistic there.
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
import ddp_bench  # noqa: E402  (the cluster: namespaces, veths, tbf)


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
    g = dist.new_group(backend="gloo")
    n = a.mib * (1 << 20) // 4
    x = np.random.default_rng(rank).standard_normal(n, dtype=np.float32)
    y = x.copy()
    pieces = [int(p) for p in a.pieces.split(",")]
    strategies = a.strategies.split(",")

    def timed(f):
        ts = []
        for _ in range(a.reps):
            y[:] = x
            dist.barrier(group=g)
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return 1e3 * sorted(ts)[len(ts) // 2]

    # The codec's speeds on a chunk, on this rank's threads (every rank at once: each on
    # its share of the cores, as the ring will run).
    prof = gradpack.calibrate(a.codec, elements=-(-n // world), budget_s=0.5)
    lat = a.latency
    def model(strategy, k):
        if strategy == "ring":
            return 1e3 * gradpack.ring_time(prof, world, a.bandwidth, n, lat, k)
        return 1e3 * gradpack.allreduce_time(prof, strategy, world, a.bandwidth, n, lat)

    tcp = gradpack.Tcp.from_store(dist.distributed_c10d._get_default_store(), rank, world,
                                  key=f"bench/{a.port}", interface=a.interface)
    p2p = gpt._PointToPoint(lambda: g)
    rows = []
    for si, strategy in enumerate(strategies):
        for k in pieces:
            tag = 100 * si + k
            native = gradpack.AllReduce(a.codec, n, transport=tcp, strategy=strategy,
                                        pieces=k, tag=tag, checksum=a.checksum)
            gloo = gradpack.AllReduce(a.codec, n, rank, world, p2p.send, p2p.recv,
                                      send_recv=p2p.send_recv, strategy=strategy, pieces=k,
                                      tag=10000 + tag, checksum=a.checksum)

            def run_gloo():
                gloo.run(y, seed=1)
                p2p.wait()

            native.run(y, seed=1)  # warm: buffers made
            run_gloo()
            rows.append({"strategy": strategy, "pieces": k,
                         "native_ms": timed(lambda: native.run(y, seed=1)),
                         "gloo_ms": timed(run_gloo), "model_ms": model(strategy, k)})
    # The float32 ring, gradpack's own through the same transport, and gloo's.
    f32 = gradpack.AllReduce("identity", n, transport=tcp, strategy="fp32-ring", tag=99999)
    f32.run(y, seed=1)
    f32_native = timed(lambda: f32.run(y, seed=1))
    t = torch.from_numpy(y)
    fp32 = timed(lambda: dist.all_reduce(t, group=g))
    wire = stream_floor(a, rank, world, timed, prof.bits_per_element * n / 8)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "fp32_ms": fp32, "fp32_native_ms": f32_native,
                       "stream_ms": wire,
                       "profile": {"encode": prof.encode_bytes_per_s,
                                   "decode": prof.decode_bytes_per_s,
                                   "decode_add": prof.decode_add_bytes_per_s,
                                   "bits": prof.bits_per_element}}, f)
    dist.barrier(group=g)
    dist.destroy_process_group()


def stream_floor(a, rank, world, timed, frame_bytes):
    """The ring's bytes alone, as fast as this emulated port moves them: each rank streams
    ``2 (p - 1) / p`` of the compressed bucket to the next rank in one plain socket
    send while it receives as much from the previous one (full duplex, no framing, no
    codec, no step boundaries). Milliseconds, the median of ``--reps``."""
    import socket
    import threading

    import torch.distributed as dist

    total = int(2 * (world - 1) / world * frame_bytes)
    host = "127.0.0.1" if a.interface == "lo" else f"{ddp_bench.SUBNET}.{rank + 1}"
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(1)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"floor/{a.port}/{rank}", f"{host}:{srv.getsockname()[1]}")
    right = store.get(f"floor/{a.port}/{(rank + 1) % world}").decode()
    out = socket.create_connection((right.split(":")[0], int(right.split(":")[1])))
    out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inc, _ = srv.accept()
    payload = bytearray(total)
    sink = bytearray(total)

    def once():
        th = threading.Thread(target=out.sendall, args=(payload,))
        th.start()
        view, got = memoryview(sink), 0
        while got < total:
            got += inc.recv_into(view[got:])
        th.join()

    ms = timed(once)
    for s in (out, inc, srv):
        s.close()
    return ms


def run_world(a, world, names):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    addr = f"{ddp_bench.SUBNET}.1" if names else "127.0.0.1"
    port = 29400 + (os.getpid() + int(time.time())) % 20000
    threads = max(1, (os.cpu_count() or 1) // world)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0" if names else "lo", OMP_NUM_THREADS="1",
               RAYON_NUM_THREADS=str(threads))
    procs = []
    for r in range(world):
        cmd = [sys.executable, __file__, "--child", "--rank", str(r), "--world", str(world),
               "--addr", addr, "--port", str(port), "--out", out, "--codec", a.codec,
               "--mib", str(a.mib), "--pieces", a.pieces, "--reps", str(a.reps),
               "--strategies", a.strategies,
               "--bandwidth", str(a.bandwidth), "--latency", str(a.latency),
               "--interface", "eth0" if names else "lo"]
        cmd += ["--checksum"] if a.checksum else []
        if names:
            cmd += ["--netns", names[r]]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        p.wait(timeout=900)
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res, threads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--link", default="10gbit", help="tc rate of every port (e.g. 10gbit)")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--mib", type=int, default=16, help="the bucket, MiB of float32")
    ap.add_argument("--pieces", default="1,2,4,8")
    ap.add_argument("--strategies", default="ring,twoshot",
                    help="gradpack strategies to run (ring, twoshot, allgather)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--latency", type=float, default=50e-6,
                    help="the model's latency per message, seconds")
    ap.add_argument("--netlink", default="auto", help="iproute2, pyroute2 or auto")
    ap.add_argument("--checksum", action="store_true",
                    help="seal frames with a payload checksum (the hook's default is off)")
    ap.add_argument("--json", help="write the results here too")
    # A rank (internal).
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--netns", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--interface", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.netns:
            ddp_bench.enter_netns(a.netns)
        rank_main(a)
        return
    a.bandwidth = ddp_bench.parse_rate(a.link)
    ddp_bench.NETLINK["tool"] = ddp_bench.netlink_tool(a.netlink)
    results = []
    for world in [int(w) for w in a.worlds.split(",")]:
        names, why = ddp_bench.make_cluster(world, a.link)
        if names is None:
            print(f"# no emulated cluster ({why}): on the loopback, unshaped")
        try:
            res, threads = run_world(a, world, names)
        finally:
            if names is not None:
                ddp_bench.delete_cluster(world)
        cores = os.cpu_count() or 1
        share = "a core each" if cores >= world else f"{world} ranks sharing {cores} cores"
        best = min(res["rows"], key=lambda r: r["model_ms"])
        p = res["profile"]
        print(f"\n# {world} ranks ({share}, {threads} gradpack thread(s) each), "
              f"{a.codec} on {a.mib} MiB{' sealed' if a.checksum else ''}, ports at "
              f"{a.link}; "
              f"{a.codec} measured: encode {p['encode'] / 1e9:.1f} GB/s, decode "
              f"{p['decode'] / 1e9:.1f}, decode_add {p['decode_add'] / 1e9:.1f}; "
              f"float32: gloo's all-reduce {res['fp32_ms']:.1f} ms, gradpack's fp32 ring "
              f"through gradpack.Tcp {res['fp32_native_ms']:.1f} ms; the ring's bytes "
              f"streamed through plain sockets {res['stream_ms']:.2f} ms")
        print("| strategy | pieces | model ms | gradpack.Tcp ms | x model | "
              "gloo point-to-point ms | x model |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in res["rows"]:
            mark = " (model's choice)" if r is best else ""
            print(f"| {r['strategy']} | {r['pieces']}{mark} | {r['model_ms']:.2f} | "
                  f"{r['native_ms']:.2f} | {r['native_ms'] / r['model_ms']:.2f} | "
                  f"{r['gloo_ms']:.2f} | {r['gloo_ms'] / r['model_ms']:.2f} |")
        results.append({"world": world, "share": share, **res})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"link": a.link, "codec": a.codec, "mib": a.mib, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
