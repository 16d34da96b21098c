"""Accuracy of error feedback with and without momentum correction over several seeds,
in one process: the DDP benchmark's training (``ddp_bench.py``: the same MLP of 12.7 M
parameters, SGD at learning rate 0.01, batch 64 per rank, scikit-learn's digits) with
the ranks simulated one after another on one core, each parameter's gradient encoded
through its own ``gradpack.ErrorFeedback`` and the ranks' decodings summed in rank order
and averaged, as the hook's all-gather does; biases (and any parameter under the hook's
``min_compress_elements``, 16384) go as float32, as the hook sends them. Fast enough to
run many seeds where the benchmark runs one (about 2 to 6 minutes per run here).

    python bench/momentum_sim.py --configs fp32,sign,sign-mc,topk,topk-mc,topk-mc-from-25 --seeds 0,1,2

A configuration is ``fp32``, or a codec (``sign``; ``sign256``, sign with a scale per
256 elements where ``sign`` has one per 1024; ``topk``: top-k 1% with fp16 values) with
error feedback, followed by any of:

- ``-mc``: momentum correction, as ``GradpackState(momentum=0.9)``: each rank keeps the
  velocity ``u = g + 0.9 u`` and sends it, and the optimizer has no momentum;
- ``-mask``: with ``-mc``, deep gradient compression's momentum factor masking too (the
  velocity zeroed where the rank's frame sent the element);
- ``-from-N``: float32 before step N, as ``start_step=N``;
- ``-min-N``: parameters with fewer than N elements go as float32, as
  ``min_compress_elements=N`` (16384 by default);
- ``-global``: every compressed parameter of a rank through one error feedback, so that
  top-k selects over the whole model at once (each layer gets the share its magnitudes
  earn) instead of 1% of every parameter;
- ``-warm-N``: for ``topk``, deep gradient compression's warm-up of the density: 25%,
  6.25% and 1.5625% in three equal stages over the first N steps, then 1% (the
  residual carried from stage to stage).

Seed 0 is the benchmark's own initialisation and batch order: its accuracies match the
benchmark's to a test image or two (float summation order differs). Prints one line per
run and a table of the mean over seeds.
"""

import argparse
import sys
import time

from ddp_bench import MOMENTUM, data, model  # the benchmark's data, model and momentum


def parse(name):
    """(codec spec or None, momentum correction, masking, start step, warm-up steps,
    min_compress_elements, one selection over the model) of a configuration."""
    base, start, warm, least = name, 0, 0, 16384
    head, sep, n = base.rpartition("-from-")
    if sep and n.isdigit():
        base, start = head, int(n)
    head, sep, n = base.rpartition("-min-")
    if sep and n.isdigit():
        base, least = head, int(n)
    head, sep, n = base.rpartition("-warm-")
    if sep and n.isdigit():
        base, warm = head, int(n)
    whole = base.endswith("-global")
    base = base[: -len("-global")] if whole else base
    mask = base.endswith("-mask")
    base = base[: -len("-mask")] if mask else base
    mc = base.endswith("-mc")
    base = base[: -len("-mc")] if mc else base
    codec = {
        "fp32": None,
        "sign": "sign",
        "sign256": "sign:block=256",
        "topk": "topk:ratio=0.01,values=fp16",
    }.get(base, "?")
    if codec == "?" or (mask and not mc) or (warm and base != "topk") or (warm and whole):
        sys.exit(f"unknown configuration {name!r}")
    return codec, mc, mask, start, warm, least, whole


def density(step, warm):
    """Top-k's density at a step under a warm-up of ``warm`` steps (1% without one)."""
    if step >= warm:
        return 0.01
    return (0.25, 0.0625, 0.015625)[3 * step // warm]


def run(name, seed, steps, world, momentum=MOMENTUM, lr=0.01, batch=64):
    import torch

    import gradpack

    codec, mc, mask, start, warm, least, whole = parse(name)
    torch.set_num_threads(1)
    xs, ys, xt, yt = data()
    cut = len(xs)
    net = model(seed)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.0 if mc else momentum)
    feedback = [[gradpack.ErrorFeedback(codec, p.numel()) for p in params] for _ in range(world)] \
        if codec else None
    velocity = [[torch.zeros(p.numel()) for p in params] for _ in range(world)]
    ratio = 0.01
    # As the hook: one-dimensional parameters (biases) and those under
    # min_compress_elements (16384 by default) go as float32.
    packed = [p.dim() > 1 and p.numel() >= least for p in params]
    if whole and codec:
        together = [j for j in range(len(params)) if packed[j]]
        total = sum(params[j].numel() for j in together)
        feedback = [gradpack.ErrorFeedback(codec, total) for _ in range(world)]
    for s in range(steps):
        if warm and codec and s >= start and density(s, warm) != ratio:
            ratio = density(s, warm)
            spec = f"topk:ratio={ratio},values=fp16"
            for fr in feedback:
                for j, p in enumerate(params):
                    old = fr[j].residual()
                    fr[j] = gradpack.ErrorFeedback(spec, p.numel())
                    fr[j].set_residual(old)
        g = torch.Generator().manual_seed(s + 100000 * seed)
        idx = torch.randint(0, cut, (batch * world,), generator=g)
        sums = [torch.zeros(p.numel()) for p in params]
        for r in range(world):
            net.zero_grad()
            i = idx[r * batch:(r + 1) * batch]
            torch.nn.functional.cross_entropy(net(xs[i]), ys[i]).backward()
            flat = []
            for j, p in enumerate(params):
                grad = p.grad.reshape(-1)
                if mc:
                    u = velocity[r][j]
                    torch.add(grad, u, alpha=momentum, out=u)
                    grad = u
                if codec is None or s < start or not packed[j]:
                    sums[j] += grad
                    continue
                if whole:
                    flat.append(grad)
                    continue
                frame = feedback[r][j].encode(grad.numpy(), seed=s * 1000 + j * 10 + r)
                sent = torch.from_numpy(gradpack.decode(frame).copy())
                if mask:
                    velocity[r][j][sent != 0] = 0
                sums[j] += sent
            if flat:
                frame = feedback[r].encode(torch.cat(flat).numpy(), seed=s * 1000 + r)
                sent = torch.from_numpy(gradpack.decode(frame).copy())
                at = 0
                for j in together:
                    part = sent[at:at + params[j].numel()]
                    at += params[j].numel()
                    if mask:
                        velocity[r][j][part != 0] = 0
                    sums[j] += part
        for j, p in enumerate(params):
            p.grad = (sums[j] / world).reshape(p.shape)
        opt.step()
    with torch.no_grad():
        return (net(xt).argmax(1) == yt).float().mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="fp32,sign,sign-mc,topk,topk-mc")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    configs = args.configs.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    for c in configs:
        parse(c)
    acc = {}
    for c in configs:
        for seed in seeds:
            t0 = time.time()
            acc[c, seed] = run(c, seed, args.steps, args.world)
            print(f"{c} seed {seed}: {100 * acc[c, seed]:.1f}% ({time.time() - t0:.0f} s)",
                  flush=True)
    print("\n| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |")
    print("|---|" + "---:|" * (len(seeds) + 1))
    for c in configs:
        vals = [100 * acc[c, s] for s in seeds]
        print(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals)
              + f" | {sum(vals) / len(vals):.1f} |")


if __name__ == "__main__":
    main()
