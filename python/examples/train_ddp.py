"""Train an MLP on scikit-learn's digits with PyTorch DDP on 2 CPU processes (gloo), its
gradients sent through gradpack's communication hook.

    python examples/train_ddp.py                       # top-k 1% with error feedback
    python examples/train_ddp.py --codec int8 --ranks 4
    python examples/train_ddp.py --codec auto --bandwidth 1Gbit/s
"""

import argparse
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpack.torch as gpt


def main(rank, world, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    d = load_digits()
    x = torch.from_numpy((d.data / 16).astype(np.float32))
    y = torch.from_numpy(d.target)
    train, test = slice(0, 1437), slice(1437, None)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    model = DDP(net)
    # The three lines gradpack adds to a DDP script:
    state = gpt.GradpackState(codec=args.codec, bandwidth=args.bandwidth, model=model,
                              min_compress_elements=4096)
    model.register_comm_hook(state, gpt.gradpack_hook)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 1437, (32 * world,), generator=g)[rank * 32:(rank + 1) * 32]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[train][idx]), y[train][idx])
        loss.backward()
        opt.step()
    if rank == 0:
        with torch.no_grad():
            acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        # codec='auto' has chosen per bucket (its plan); otherwise the codec is fixed.
        sent = "; ".join(f"bucket {r['bucket']} {r['codec']} by {r['strategy']}"
                         for r in state.plan() if r["chosen"]) or state.codec_for(64 * 512).spec
        print(f"{world} ranks, {args.steps} steps, large tensors sent as {sent}: "
              f"loss {loss.item():.3f}, test accuracy {100 * acc:.1f}%")
        # A checkpoint keeps the hook's residuals beside the model and optimizer.
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(),
                    "gradpack": state.state_dict()}, os.devnull)
    # The hook's group first (a barrier, then torn down), then torch's: a rank that
    # tears its connections down while a peer's last messages are in flight can make
    # gloo abort the process at exit.
    state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", default="topk:ratio=0.01,values=fp16")
    ap.add_argument("--bandwidth", default=None, help="the link, for --codec auto")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
