"""DiLoCo under torchft, the rows of ``diloco_bench.py --torchft``: torchft's own DiLoCo
in float32 against gradpack's under the same kind of torchft ``Manager``, and gradpack's
with a replica that leaves for ``--away`` inner steps and comes back.

Every configuration trains the model of ``diloco_bench.py`` (the byte-level transformer,
AdamW inner optimizer) on ``--world`` replica processes (a torchft replica group of one
each; the lighthouse in the driver, on 127.0.0.1), ``--sync-every`` inner steps per
outer round, outer Nesterov SGD (lr 0.7, momentum 0.9) in both libraries, the managers
made with ``init_sync=False``. Replica ``r`` draws the batch of inner step ``s`` from
the seed ``s * world + r``, so a replica that is healed draws what it would have drawn.
Replica 0 evaluates the held-out loss at every outer round.

Bytes per sync are those one replica sends: gradpack counts its envelopes and frames;
torchft's float32 sync is counted as the ring's 2 (n - 1) / n of the float32 parameters
(what gloo's ring all-reduce sends, n the replicas in the quorum).
"""

import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import diloco_bench  # noqa: E402  (the model and the data)
import elastic_diloco  # noqa: E402  (the managers and the kill-and-restart driver)

# name: (description, codec or None for torchft's own DiLoCo, whether a replica leaves)
FT_CONFIGS = {
    "torchft-fp32": ("torchft's DiLoCo, float32", None, False),
    "fp32": ("gradpack DiLoCo, float32", "identity", False),
    "int8": ("gradpack DiLoCo, int8", "int8", False),
    "fp4": ("gradpack DiLoCo, 4-bit float E3M0", "fp4:format=e3m0", False),
    "int8-away": ("gradpack DiLoCo, int8, the last replica away", "int8", True),
}


def replica(rid, lighthouse, a, out_dir, restarted, progress, kill_at):
    """One replica of configuration ``a.config``: trains to inner step ``a.steps`` and
    saves its parameters, replica 0's loss curve, the bytes it sent and its events."""
    import numpy as np
    import torch

    import gradpack.torch as gpt

    torch.set_num_threads(1)
    _, codec, _ = FT_CONFIGS[a.config]
    data = torch.from_numpy(np.frombuffer(diloco_bench.corpus(), dtype=np.uint8).astype(np.int64))
    cut = int(0.9 * len(data))
    train, held = data[:cut], data[cut:]
    g = torch.Generator().manual_seed(99)
    C = diloco_bench.CONTEXT
    starts = torch.randint(0, len(held) - C - 1, (64,), generator=g)
    ex = torch.stack([held[s:s + C] for s in starts])
    ey = torch.stack([held[s + 1:s + C + 1] for s in starts])
    net = diloco_bench.make_model()
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=diloco_bench.LR, weight_decay=0.0)
    manager, _store = elastic_diloco.replica_manager(rid, lighthouse, 60.0, init_sync=False)
    elastic_diloco.started(rid, progress, restarted)
    # Where the others were when this replica was ready to join (its manager up).
    ready_at = min(progress[:-1]) if restarted else 0
    sent = [0.0]
    if codec is None:
        from torchft.local_sgd import DiLoCo

        outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = DiLoCo(manager, [net], opt, outer, sync_every=a.sync_every)
        diloco.__enter__()
        done = [0]

        def step():
            return done[0]
    else:
        diloco = gpt.DiLoCo(net, opt, a.sync_every, codec, manager=manager, timeout=30.0)

        def step():
            return diloco.inner_step

    def held_loss():
        with torch.no_grad():
            out = net(ex)
            return torch.nn.functional.cross_entropy(out.reshape(-1, 256), ey.reshape(-1)).item()

    curve = []
    t0 = time.perf_counter()
    while step() < a.steps:
        s = step()
        if rid == len(progress) - 1 and not restarted and s == kill_at:
            os._exit(3)  # a crash
        if rid == 0 and s % a.sync_every == 0:
            curve.append([s, held_loss(), diloco.bytes_sent if codec else sent[0]])
        gen = torch.Generator().manual_seed(s * len(progress) + rid)
        st = torch.randint(0, len(train) - C - 1, (diloco_bench.BATCH,), generator=gen)
        x = torch.stack([train[i:i + C] for i in st])
        y = torch.stack([train[i + 1:i + C + 1] for i in st])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()  # both libraries sync in the optimizer's step hook
        if codec is None:
            done[0] += 1
            if done[0] % a.sync_every == 0:
                n = manager.num_participants()
                sent[0] += 2 * (n - 1) / n * 4 * params
        progress[rid] = step()
    elapsed = time.perf_counter() - t0
    end = dict(params=[p.detach().clone() for p in net.parameters()], curve=curve,
               bytes=diloco.bytes_sent if codec else sent[0], params_count=params,
               ms_per_step=1000 * elapsed / a.steps, ready_at=ready_at)
    if rid == 0:
        curve.append([a.steps, held_loss(), end["bytes"]])
        end["loss"] = curve[-1][1]
    if codec is None:
        diloco.__exit__(None, None, None)
    else:
        end["stats"] = diloco.elastic_stats()
        end["syncs"] = diloco.syncs
        diloco.close()
    torch.save(end, os.path.join(out_dir, f"replica{rid}.pt"))
    manager.shutdown(wait=False)


def run(a, configs):
    """Every configuration of ``configs``, one after the other: a list of results."""
    results = []
    for cfg in configs:
        a.config = cfg
        desc, _, away = FT_CONFIGS[cfg]
        t0 = time.perf_counter()
        try:
            ends, same = elastic_diloco.run(a, away, target=replica, world=a.world)
        except (OSError, RuntimeError) as e:  # a replica that did not save its result
            results.append({"config": cfg, "error": str(e)[:300]})
            continue
        r0 = ends[0]
        syncs = a.steps // a.sync_every
        res = {"config": cfg, "description": desc, "world": a.world, "steps": a.steps,
               "sync_every": a.sync_every, "params": r0["params_count"],
               "bytes_per_sync": r0["bytes"] / syncs, "loss": r0["loss"],
               "identical": same, "curve": r0["curve"], "seconds": time.perf_counter() - t0}
        if away:
            res.update(kill_at=a.kill_at, away=a.away, ready_at=ends[-1]["ready_at"])
            res["events"] = [[(ev["step"], ev["event"]) for ev in e["stats"]["events"]]
                             for e in ends]
        results.append(res)
        print({k: v for k, v in res.items() if k != "curve"}, flush=True)
    return results


def table(results):
    by = {r["config"]: r for r in results}
    base = by.get("torchft-fp32", {})
    rows = ["| configuration | bytes / sync (one replica) | x fewer than torchft's | "
            "held-out loss | vs torchft's | replicas identical |",
            "|---|---:|---:|---:|---:|---|"]
    for cfg in FT_CONFIGS:
        r = by.get(cfg)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"| {cfg} | error: {r['error'][:80]} |")
            continue
        fewer = (f"{base['bytes_per_sync'] / r['bytes_per_sync']:.2f}"
                 if base.get("bytes_per_sync") else "-")
        vs = f"{100 * (r['loss'] / base['loss'] - 1):+.2f}%" if base.get("loss") else "-"
        name = cfg
        if "kill_at" in r:
            healed = [s for s, ev in r["events"][-1] if ev == "healed"]
            name += (f" (left at {r['kill_at']}, restarted at {r['kill_at'] + r['away']}, "
                     f"ready at {r['ready_at']}, healed at {healed})")
        rows.append(f"| {name} | {r['bytes_per_sync']:,.0f} | {fewer} | {r['loss']:.4f} | "
                    f"{vs} | {r['identical']} |")
    return "\n".join(rows)


def plot(results, path):
    """Held-out loss against inner steps, one curve per configuration; the window when
    a replica was away is shaded."""
    curves = [(r["config"], r["curve"]) for r in results if r.get("curve")]
    if not curves:
        return
    W, H, L, R, T, B = 900, 560, 80, 230, 50, 60
    steps = max(s for _, c in curves for s, _, _ in c)
    ys = [l for _, c in curves for s, l, _ in c if s > 0]
    y0, y1 = math.floor(min(ys) * 5) / 5, math.ceil(min(max(ys), 4.0) * 5) / 5
    px = lambda s: L + s / steps * (W - L - R)
    py = lambda l: T + (y1 - min(l, y1)) / (y1 - y0) * (H - T - B)
    colours = {"torchft-fp32": "#000000", "fp32": "#377eb8", "int8": "#4daf4a",
               "fp4": "#ff7f00", "int8-away": "#e41a1c"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="14">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="28" font-size="17">DiLoCo under torchft: held-out loss of '
           f'replica 0, {results[0].get("world", 3)} replicas</text>']
    for r in results:
        if "kill_at" in r:
            # Away from the kill to the quorum that healed it (the step after the heal).
            healed = [s for s, ev in r["events"][-1] if ev == "healed"]
            back = healed[0] + 1 if healed else r["kill_at"] + r["away"]
            x0, x1 = px(r["kill_at"]), px(min(back, steps))
            out.append(f'<rect x="{x0:.1f}" y="{T}" width="{x1 - x0:.1f}" height="{H - T - B}" '
                       f'fill="#fbe3e3"/>')
            out.append(f'<text x="{x0 + 4:.1f}" y="{T + 18}" fill="#b00">a replica away</text>')
            out.append(f'<text x="{x0 + 4:.1f}" y="{T + 36}" fill="#b00">({r["kill_at"]} to '
                       f'{back})</text>')
    for s in range(0, steps + 1, 100):
        out.append(f'<line x1="{px(s)}" y1="{T}" x2="{px(s)}" y2="{H - B}" stroke="#ddd"/>')
        out.append(f'<text x="{px(s) - 12}" y="{H - B + 20}">{s}</text>')
    v = y0
    while v <= y1 + 1e-9:
        out.append(f'<line x1="{L}" y1="{py(v)}" x2="{W - R}" y2="{py(v)}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 40}" y="{py(v) + 5}">{v:.1f}</text>')
        v += 0.2
    out.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" '
               f'stroke="black"/>')
    out.append(f'<text x="{(W - R + L) / 2 - 40}" y="{H - 15}">inner step</text>')
    out.append(f'<text transform="rotate(-90)" x="{-(H / 2) - 80}" y="22">loss (nats per '
               f'byte)</text>')
    # torchft's curve last, dashed on top of the ones it matches.
    for i, (name, c) in sorted(enumerate(curves), key=lambda e: e[1][0] == "torchft-fp32"):
        col = colours.get(name, "#999999")
        pts = " ".join(f"{px(s):.1f},{py(l):.1f}" for s, l, _ in c)
        dash = ' stroke-dasharray="7,4"' if name == "torchft-fp32" else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{col}" stroke-width="2"'
                   f'{dash}/>')
        ly = T + 10 + 24 * i
        out.append(f'<line x1="{W - R + 15}" y1="{ly}" x2="{W - R + 45}" y2="{ly}" '
                   f'stroke="{col}" stroke-width="3"{dash}/>')
        out.append(f'<text x="{W - R + 52}" y="{ly + 5}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
