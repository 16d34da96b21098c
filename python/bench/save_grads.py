"""Save real gradients as .npy for ``gradpack report --input``.

Two models of the crate's benchmarks, trained on one CPU thread from their seeds:

- ``mlp``: the digits MLP of ``ddp_bench.py`` (64 -> 2500 -> 2500 -> 2500 -> 10,
  12.7 M parameters), SGD with momentum 0.9, lr 0.01, batches of 64;
- ``lm``: the byte-level transformer of ``diloco_bench.py`` (0.47 M parameters), AdamW
  2e-3, batches of 16 windows of 64 bytes.

For each model the gradient (every parameter's, flattened in the model's order, float32)
of the steps given by ``--steps`` is written to ``OUT/MODEL-stepN.npy``; with
``--bf16`` also as bfloat16 bits (``uint16``, ``MODEL-stepN.bf16.npy``), the gradient a
bf16 training run would send.

    python python/bench/save_grads.py --out target/grads
    gradpack report --input target/grads/lm-step1.npy --input target/grads/lm-step50.npy ...
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def flat_grad(net):
    import torch

    return torch.cat([p.grad.reshape(-1) for p in net.parameters()]).detach()


def save(out, name, g, bf16):
    import numpy as np
    import torch

    path = os.path.join(out, name + ".npy")
    np.save(path, g.numpy().astype(np.float32))
    print(path, g.numel())
    if bf16:
        bits = g.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        np.save(os.path.join(out, name + ".bf16.npy"), bits)


def mlp(steps, out, bf16):
    import torch
    import ddp_bench

    xtr, ytr, _, _ = ddp_bench.data()
    net = ddp_bench.model(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    for step in range(1, max(steps) + 1):
        idx = torch.randint(0, len(xtr), (64,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
        if step in steps:
            save(out, "mlp-step%d" % step, flat_grad(net), bf16)
        opt.step()


def lm(steps, out, bf16):
    import numpy as np
    import torch
    import diloco_bench as d

    data = torch.from_numpy(np.frombuffer(d.corpus(), dtype=np.uint8).astype(np.int64))
    net = d.make_model()
    opt = torch.optim.AdamW(net.parameters(), lr=d.LR, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    for step in range(1, max(steps) + 1):
        starts = torch.randint(0, len(data) - d.CONTEXT - 1, (d.BATCH,), generator=g)
        x = torch.stack([data[s:s + d.CONTEXT] for s in starts])
        y = torch.stack([data[s + 1:s + d.CONTEXT + 1] for s in starts])
        opt.zero_grad()
        logits = net(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()
        if step in steps:
            save(out, "lm-step%d" % step, flat_grad(net), bf16)
        opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="target/grads")
    ap.add_argument("--steps", default="1,50,200",
                    help="comma-separated steps whose gradients are saved")
    ap.add_argument("--models", default="mlp,lm")
    ap.add_argument("--bf16", action="store_true", help="also save bfloat16 bits")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    steps = {int(s) for s in a.steps.split(",")}
    for m in a.models.split(","):
        {"mlp": mlp, "lm": lm}[m](steps, a.out, a.bf16)


if __name__ == "__main__":
    main()
