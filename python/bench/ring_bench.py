"""The PyTorch hook's compressed ring alone, without DDP: where an all-reduce's time goes.

    python bench/ring_bench.py --world 8 --elements 6300000 --codecs int8,sign

``--world`` processes on this machine's loopback (gloo; no shaping: this measures the
hook's own costs, not a link) each run, on a bucket of ``--elements`` float32 values:

- gloo's float32 all-reduce of the bucket (what DDP does without a hook);
- per codec, ``gradpack.AllReduce`` by the ring, in place, with its messages sent point
  to point by the hook's transport (``gradpack.torch``'s, as the hook sends them; told
  the lengths of fixed-rate messages, unless ``--untold``);
- the part of that time spent inside the transport's ``send_recv`` (the messages, and
  the wait for the slowest peer);
- the ring's messages alone: the same number of exchanges of the same sizes, no codec;
- the same exchanges with the length known to both sides, the receive posted at once:
  with no length sent at all, and with the length still sent ahead of each message (what
  the hook's transport does when the ring tells it the length).

The time outside the messages is the ring's compute (encodes, decodes, sums and
checksums over the bucket). Each figure is the median of ``--reps`` runs, each started
by a barrier. gradpack's kernels use ``RAYON_NUM_THREADS`` threads per rank (default:
the cores shared out among the ranks).
"""

import argparse
import os
import sys
import time


def worker(rank, world, port, n, codecs, reps, out, untold):
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import gradpack
    import gradpack.torch as gpt

    g = dist.new_group(backend="gloo")
    p2p = gpt._PointToPoint(lambda: g)
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(n).astype(np.float32))
    y = x.clone()

    def timed(f, setup=lambda: None):
        ts = []
        for _ in range(reps):
            setup()
            dist.barrier()
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return 1e3 * sorted(ts)[len(ts) // 2]

    rows = [("float32 all-reduce (gloo)", timed(lambda: dist.all_reduce(y, group=g),
                                                lambda: y.copy_(x)), "", "", "")]
    for spec in codecs:
        inside = [0.0]

        def send_recv(msg, to, frm, size=None):
            t0 = time.perf_counter()
            try:
                return p2p.send_recv(msg, to, frm, size=None if untold else size)
            finally:
                inside[0] += time.perf_counter() - t0

        ar = gradpack.AllReduce(gradpack.Codec(spec), n, rank, world, p2p.send, p2p.recv,
                                send_recv=send_recv, strategy="ring")

        def ring():
            ar.run(y.numpy(), seed=1)
            p2p.wait()

        ar.run(y.numpy(), seed=1)  # warm: buffers made
        p2p.wait()
        inside[0] = 0.0
        t_ring = timed(ring, lambda: y.copy_(x))
        t_inside = 1e3 * inside[0] / reps
        msg = bytearray(gradpack.Codec(spec).max_encoded_len(-(-n // world)))

        def messages():
            for _ in range(2 * (world - 1)):
                p2p.send_recv(msg, (rank + 1) % world, (rank - 1) % world)
            p2p.wait()

        sized = torch.frombuffer(msg, dtype=torch.uint8)
        got = torch.empty(len(msg), dtype=torch.uint8)
        right, left = (rank + 1) % world, (rank - 1) % world

        def known():
            # The same exchanges with the length known to both sides: the receive posted
            # at once, no length sent before the payload.
            for _ in range(2 * (world - 1)):
                w = dist.irecv(got, left, group=g)
                s = dist.isend(sized, right, group=g)
                w.wait()
                s.wait()

        def known_with_lengths():
            # The hook's transport told the length.
            for _ in range(2 * (world - 1)):
                p2p.send_recv(msg, right, left, size=len(msg))
            p2p.wait()

        rows.append((f"{spec}, ring", t_ring, f"{t_inside:.2f}", f"{timed(messages):.2f}",
                     f"{timed(known):.2f} / {timed(known_with_lengths):.2f}"))
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--elements", type=int, default=6_300_000)
    ap.add_argument("--codecs", default="int8,sign", help="specs separated by ';' or ','")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--untold", action="store_true",
                    help="the transport is not told the lengths the ring expects (it waits "
                         "for each message's length before posting the receive)")
    a = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.world)))
    import tempfile

    import torch.multiprocessing as mp

    specs = [s for s in a.codecs.split(";" if ";" in a.codecs else ",") if s]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        port = 29000 + os.getpid() % 2000
        mp.spawn(worker, args=(a.world, port, a.elements, specs, a.reps, out, a.untold),
                 nprocs=a.world)
        import json

        rows = json.load(open(out))
    print(f"# {a.world} ranks on {os.cpu_count()} cores, {a.elements} float32 elements, "
          f"gradpack threads per rank {os.environ['RAYON_NUM_THREADS']}, median of {a.reps} ms")
    print("| all-reduce | ms | of which in send_recv | the messages alone | lengths known "
          "(none sent / sent) |")
    print("|---|---:|---:|---:|---:|")
    for name, t, inside, alone, known in rows:
        print(f"| {name} | {t:.2f} | {inside} | {alone} | {known} |")
    sys.exit(0)


if __name__ == "__main__":
    main()
