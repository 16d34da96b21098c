"""Low-communication training on an emulated cluster: PyTorch DDP against
``gradpack.torch.DiLoCo`` with compressed pseudo-gradients, on a small character-level
transformer language model.

    python bench/diloco_bench.py                               # 2 ranks; 100 Mbit/s and 1 Gbit/s
    python bench/diloco_bench.py --world 4 --configs ddp,h50-int8,stream-h50-fp4

The task: next-byte prediction on the text of CPython's documentation topics
(``pydoc_data.topics``, shipped with every CPython: about 0.7 MB of English technical
prose under the Python Software Foundation License; nothing is downloaded), the first
90% for training and the rest for the held-out loss. The model: a 2-layer causal
transformer (width 128, 4 heads, context 64, byte vocabulary; 0.43 M parameters), AdamW
(lr 2e-3) as the inner optimizer, batch 16 windows per rank, one torch thread per rank.

Per configuration, two kinds of runs:

- a **training run** on an unshaped link: ``--steps`` inner steps, the held-out loss
  (mean cross-entropy in nats per byte over 64 fixed windows) every ``--eval-every``
  steps, and the bytes rank 0 has sent by then (DiLoCo: counted by gradpack, envelopes
  and frames; DDP: the ring's 2 (p - 1) / p of the float32 gradients per step, what
  gloo's ring all-reduce sends);
- a **timing run** per link (``--links``): ``--time-steps`` inner steps with no
  evaluation, wall time per inner step (mean, so the syncs count).

The cluster is the one of ``ddp_bench.py``: a network namespace per rank, each with its
own full-duplex port to a switch, shaped with ``tc tbf`` both ways. ``none`` trains with
no communication at all (each rank alone: the floor of the step time).

Outputs: a markdown table on stdout, ``--out`` (JSON) and ``--plot`` (an SVG of held-out
loss against bytes sent, one curve per configuration).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ddp_bench  # noqa: E402  (the emulated cluster)

CONTEXT, WIDTH, LAYERS, HEADS, BATCH, LR = 64, 128, 2, 4, 16, 2e-3
# The outer optimizer of every configuration that does not set its own (None: DiLoCo's
# 0.7 and 0.9).
OUTER = {"lr": None, "momentum": None}

# name: (description, DiLoCo arguments or None for DDP / no communication)
CONFIGS = {
    "none": ("no communication: every rank trains alone (the floor)", None),
    "ddp": ("DDP, float32 all-reduce every step (H = 1)", None),
    "h10-fp32": ("DiLoCo H = 10, float32", {"sync_every": 10}),
    "h10-int8": ("DiLoCo H = 10, int8", {"sync_every": 10, "codec": "int8"}),
    "h20-fp4": ("DiLoCo H = 20, 4-bit float E3M0",
                {"sync_every": 20, "codec": "fp4:format=e3m0"}),
    "stream-h20-fp4": ("Streaming DiLoCo H = 20, 4 fragments, delay 1, alpha 0.5, fp4 E3M0",
                       {"sync_every": 20, "codec": "fp4:format=e3m0", "fragments": 4,
                        "delay": 1, "alpha": 0.5}),
    "h50-fp32": ("DiLoCo H = 50, float32", {"sync_every": 50}),
    "h50-int8": ("DiLoCo H = 50, int8", {"sync_every": 50, "codec": "int8"}),
    "h50-fp4": ("DiLoCo H = 50, 4-bit float E3M0 (Streaming DiLoCo's)",
                {"sync_every": 50, "codec": "fp4:format=e3m0"}),
    "h50-sparseloco": ("DiLoCo H = 50, SparseLoCo: top 64 of 4096, 2-bit values, error "
                       "feedback (beta 0.95) in place of outer momentum",
                       {"sync_every": 50, "codec": "chunktopk", "outer_lr": 1.0,
                        "outer_momentum": 0.0, "feedback_beta": 0.95}),
    "h50-dct": ("DiLoCo H = 50, dct (DeMo's chunked DCT top-k)",
                {"sync_every": 50, "codec": "dct"}),
    "stream-h50-fp4": ("Streaming DiLoCo H = 50, 4 fragments, delay 1, alpha 0.5, fp4 E3M0",
                       {"sync_every": 50, "codec": "fp4:format=e3m0", "fragments": 4,
                        "delay": 1, "alpha": 0.5}),
    "stream-h50-int8": ("Streaming DiLoCo H = 50, 4 fragments, delay 1, alpha 0.5, int8",
                        {"sync_every": 50, "codec": "int8", "fragments": 4, "delay": 1,
                         "alpha": 0.5}),
}


# ---------------------------------------------------------------------- one rank


def corpus():
    """The bytes of CPython's documentation topics, in a fixed order."""
    import pydoc_data.topics as t

    text = "\n\n".join(t.topics[k] for k in sorted(t.topics))
    return text.encode("utf-8")


def make_model():
    import torch

    class CharLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, WIDTH)
            self.pos = torch.nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
            layer = torch.nn.TransformerEncoderLayer(
                WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.head = torch.nn.Linear(WIDTH, 256)
            self.register_buffer(
                "mask", torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT))

        def forward(self, x):
            h = self.emb(x) + self.pos[: x.shape[1]]
            h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return CharLM()


def rank_main(a):
    import numpy as np
    import torch
    import torch.distributed as dist

    import gradpack.torch as gpt

    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    dist.init_process_group("gloo", init_method=f"tcp://{a.addr}:{a.port}", rank=rank,
                            world_size=world)
    data = torch.from_numpy(np.frombuffer(corpus(), dtype=np.uint8).astype(np.int64))
    cut = int(0.9 * len(data))
    train, held = data[:cut], data[cut:]
    g = torch.Generator().manual_seed(99)
    starts = torch.randint(0, len(held) - CONTEXT - 1, (64,), generator=g)
    ex = torch.stack([held[s:s + CONTEXT] for s in starts])
    ey = torch.stack([held[s + 1:s + CONTEXT + 1] for s in starts])
    net = make_model()
    params = sum(p.numel() for p in net.parameters())
    desc, diloco_args = CONFIGS[a.config]
    model = net
    if a.config == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    diloco = None
    if diloco_args is not None:
        args = dict(diloco_args)
        if a.outer_lr is not None and "outer_lr" not in args:
            args["outer_lr"] = a.outer_lr
        if a.outer_momentum is not None and "outer_momentum" not in args:
            args["outer_momentum"] = a.outer_momentum
        diloco = gpt.DiLoCo(net, opt, **args)

    def sent():
        if diloco is not None:
            return diloco.bytes_sent
        return 0

    ddp_bytes_per_step = 2 * (world - 1) / world * 4 * params if a.config == "ddp" else 0

    def held_loss():
        with torch.no_grad():
            out = net(ex)
            return torch.nn.functional.cross_entropy(out.reshape(-1, 256), ey.reshape(-1)).item()

    curve = []
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(a.steps):
        if a.eval_every and s % a.eval_every == 0:
            curve.append([s, held_loss(), sent() + ddp_bytes_per_step * s])
        gen = torch.Generator().manual_seed(s * world + rank)
        st = torch.randint(0, len(train) - CONTEXT - 1, (BATCH,), generator=gen)
        x = torch.stack([train[i:i + CONTEXT] for i in st])
        y = torch.stack([train[i + 1:i + CONTEXT + 1] for i in st])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()  # DiLoCo's hook runs after it
    elapsed = time.perf_counter() - t0
    if a.eval_every:
        curve.append([a.steps, held_loss(), sent() + ddp_bytes_per_step * a.steps])
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    if diloco is not None:
        flat = torch.cat([p.reshape(-1) for p in diloco.outer_parameters()])
        diloco.close()
    got = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(got, flat)
    identical = all(torch.equal(got[0], t) for t in got)
    dist.barrier()
    if rank == 0:
        res = {"config": a.config, "world": world, "params": params, "steps": a.steps,
               "ms_per_step": 1000 * elapsed / a.steps,
               "bytes_sent": sent() + ddp_bytes_per_step * a.steps,
               "identical_outer": identical, "curve": curve}
        with open(a.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the driver


def run_one(names, world, cfg, steps, eval_every, timeout=900):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    addr = f"{ddp_bench.SUBNET}.1" if names else "127.0.0.1"
    port = 29400 + (os.getpid() + int(time.time() * 7)) % 20000
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0" if names else "lo", OMP_NUM_THREADS="1")
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rank", str(r),
               "--world", str(world), "--addr", addr, "--port", str(port), "--config", cfg,
               "--steps", str(steps), "--eval-every", str(eval_every), "--out", out]
        for flag, v in (("--outer-lr", OUTER["lr"]), ("--outer-momentum", OUTER["momentum"])):
            if v is not None:
                cmd += [flag, str(v)]
        if names:
            cmd += ["--netns", names[r]]
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
        tail = "\n".join(errs).strip().splitlines()[-3:] or ["no output"]
        return {"config": cfg, "world": world, "error": " | ".join(tail)[:400]}
    finally:
        if os.path.exists(out):
            os.unlink(out)


def plot(results, path):
    """Held-out loss against bytes sent (log scale), one curve per configuration."""
    # Points after the first bytes are sent (a log axis has no zero).
    curves = [(r["config"], [(b, l) for _, l, b in r["curve"] if b > 0])
              for r in results if r.get("curve") and r["config"] != "none"]
    curves = [(n, c) for n, c in curves if c]
    if not curves:
        return
    W, H, L, R, T, B = 900, 560, 80, 250, 50, 60
    xs = [b for _, c in curves for b, _ in c]
    ys = [l for _, c in curves for _, l in c]
    x0, x1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
    y0, y1 = math.floor(min(ys) * 10) / 10, math.ceil(min(max(ys), 3.0) * 10) / 10
    px = lambda b: L + (math.log10(b) - x0) / (x1 - x0) * (W - L - R)
    py = lambda l: T + (y1 - min(l, y1)) / (y1 - y0) * (H - T - B)
    colours = ["#000000", "#e41a1c", "#377eb8", "#4daf4a", "#984ea3", "#ff7f00",
               "#a65628", "#f781bf", "#999999", "#1b9e77", "#d95f02", "#7570b3",
               "#66a61e", "#e6ab02", "#17becf"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="14">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2 - 120}" y="28" font-size="17">Held-out loss against bytes sent</text>']
    for e in range(x0, x1 + 1):
        x = px(10 ** e)
        out.append(f'<line x1="{x}" y1="{T}" x2="{x}" y2="{H - B}" stroke="#ddd"/>')
        out.append(f'<text x="{x - 16}" y="{H - B + 20}">1e{e}</text>')
    v = y0
    while v <= y1 + 1e-9:
        y = py(v)
        out.append(f'<line x1="{L}" y1="{y}" x2="{W - R}" y2="{y}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 40}" y="{y + 5}">{v:.1f}</text>')
        v += 0.2
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="black"/>')
    out.append(f'<text x="{(W - R + L) / 2 - 90}" y="{H - 15}">bytes sent by rank 0 (log scale)</text>')
    out.append(f'<text transform="rotate(-90)" x="{-(H / 2) - 80}" y="22">loss (nats per byte)</text>')
    for i, (name, c) in enumerate(curves):
        col = colours[i % len(colours)]
        pts = " ".join(f"{px(b):.1f},{py(l):.1f}" for b, l in c)
        dash = ' stroke-dasharray="6,3"' if name.startswith("stream") else ""
        width = 3 if name == "ddp" else 2
        out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="{width}"{dash}/>')
        b, l = c[-1]
        out.append(f'<circle cx="{px(b):.1f}" cy="{py(l):.1f}" r="4" fill="{col}"/>')
        ly = T + 10 + 22 * i
        out.append(f'<line x1="{W - R + 15}" y1="{ly}" x2="{W - R + 45}" y2="{ly}" stroke="{col}" stroke-width="3"{dash}/>')
        out.append(f'<text x="{W - R + 52}" y="{ly + 5}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def table(results, links):
    train = {r["config"]: r for r in results if r.get("kind") == "train"}
    timing = {(r["config"], r["link"]): r for r in results if r.get("kind") == "time"}
    ddp = train.get("ddp", {})
    ddp_bytes = ddp.get("bytes_sent") or 0
    ddp_loss = ddp["curve"][-1][1] if ddp.get("curve") else None
    rows = ["| configuration | bytes / inner step | x fewer than DDP | held-out loss | vs DDP | "
            + " | ".join(f"ms / step at {l}" for l in links) + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(links)]
    for cfg in CONFIGS:
        r = train.get(cfg)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"| {cfg} | error: {r['error'][:80]} |")
            continue
        per = r["bytes_sent"] / r["steps"]
        fewer = f"{ddp_bytes / r['bytes_sent']:.0f}" if r["bytes_sent"] and ddp_bytes else "-"
        loss = r["curve"][-1][1]
        vs = f"{100 * (loss / ddp_loss - 1):+.1f}%" if ddp_loss else "-"
        times = []
        for l in links:
            t = timing.get((cfg, l), {})
            times.append(f"{t['ms_per_step']:.1f}" if "ms_per_step" in t else t.get("error", "-")[:30])
        rows.append(f"| {cfg} | {per:,.0f} | {fewer} | {loss:.3f} | {vs} | " + " | ".join(times) + " |")
    return "\n".join(rows)


def driver(a):
    import torch

    import gradpack

    ddp_bench.NETLINK["tool"] = ddp_bench.netlink_tool(a.netlink)
    OUTER.update(lr=a.outer_lr, momentum=a.outer_momentum)
    configs = a.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; one of {', '.join(CONFIGS)}")
    links = [l for l in a.links.split(",") if l]
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": ddp_bench.cpu_name(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "gradpack_backend": gradpack.backend(), "world": a.world, "steps": a.steps,
            "time_steps": a.time_steps, "netlink": ddp_bench.NETLINK["tool"],
            "outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum}
    print(f"# DiLoCo benchmark, {meta['date']}: {meta['cpu']}, {meta['cores']} cores, "
          f"{a.world} ranks, torch {meta['torch']}, gradpack backend {meta['gradpack_backend']}",
          flush=True)
    results = []
    for cfg in configs:
        r = run_one(None, a.world, cfg, a.steps, a.eval_every)
        r["kind"] = "train"
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
    for link in links:
        names, why = ddp_bench.make_cluster(a.world, link)
        if names is None:
            print(f"SKIP timing at {link}: no emulated cluster ({why})", flush=True)
            continue
        try:
            for cfg in configs:
                r = run_one(names, a.world, cfg, a.time_steps, 0)
                r.update(kind="time", link=link)
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            ddp_bench.delete_cluster(a.world)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    if a.plot:
        plot([r for r in results if r.get("kind") == "train"], a.plot)
    print(table(results, links))


def ft_driver(a):
    """The rows under torchft (``--torchft``): a table, ``--out`` and ``--plot``."""
    import torch

    import diloco_ft

    configs = a.ft_configs.split(",")
    for c in configs:
        if c not in diloco_ft.FT_CONFIGS:
            sys.exit(f"unknown config {c!r}; one of {', '.join(diloco_ft.FT_CONFIGS)}")
    a.world = a.replicas
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": ddp_bench.cpu_name(),
            "cores": os.cpu_count(), "torch": torch.__version__, "replicas": a.replicas,
            "steps": a.steps, "sync_every": a.sync_every}
    print(f"# DiLoCo under torchft, {meta['date']}: {meta['cpu']}, {meta['cores']} cores, "
          f"{a.replicas} replicas, H = {a.sync_every}, {a.steps} inner steps", flush=True)
    results = diloco_ft.run(a, configs)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    if a.plot:
        diloco_ft.plot(results, a.plot)
    print(diloco_ft.table(results))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--links", default="100mbit,1gbit")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=500, help="inner steps of a training run")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--time-steps", type=int, default=100, help="inner steps of a timing run")
    ap.add_argument("--out", default="diloco_bench.json")
    ap.add_argument("--plot", default="diloco_bench.svg")
    ap.add_argument("--netlink", choices=["auto", "iproute2", "pyroute2"], default="auto")
    ap.add_argument("--outer-lr", type=float, default=None,
                    help="outer learning rate of the configurations that do not set one")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="outer Nesterov momentum of the configurations that do not set one")
    ap.add_argument("--torchft", action="store_true",
                    help="the rows under torchft instead (needs gradpack[ft]): torchft's own "
                         "float32 DiLoCo against gradpack's, and a replica that leaves")
    ap.add_argument("--ft-configs", default="torchft-fp32,fp32,int8,fp4,int8-away")
    ap.add_argument("--replicas", type=int, default=3, help="replicas of the --torchft rows")
    ap.add_argument("--sync-every", type=int, default=20, help="H of the --torchft rows")
    ap.add_argument("--kill-at", type=int, default=150,
                    help="inner step at which the last replica leaves (--torchft)")
    ap.add_argument("--away", type=int, default=100,
                    help="inner steps the others take before it is started again (--torchft)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--netns", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    ap.add_argument("--config", default="ddp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.netns:
            ddp_bench.enter_netns(a.netns)
        rank_main(a)
    elif a.torchft:
        ft_driver(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
