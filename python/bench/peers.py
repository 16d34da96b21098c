"""gradpack's encode and decode against the libraries users compare it with, on one
thread: ml_dtypes' fp8 casts, torch's float8 casts and ``quantize_per_tensor`` (int8),
and torchao's MX reference (``to_mx`` / ``to_dtype``, MXFP8 and MXFP4 with blocks of
32). Each row times the same conversion both ways on the same input (a Gaussian
gradient) in the same run, beside a memcpy of the f32 input as the baseline, and prints
GB/s of f32 input and the ratio gradpack / peer (above 1: gradpack is faster).

    python python/bench/peers.py                  # 64 Ki elements
    python python/bench/peers.py --elements 1048576

What each pair computes is the same to the bit (python/tests/test_conformance.py and
test_fp8_torch.py): the peers' bytes are checked here too before anything is timed, but
int8, whose scale rule is torch's own (per tensor), is timed only.
"""

import argparse
import os
import platform
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread, before gradpack starts its pool

import numpy as np  # noqa: E402

import gradpack  # noqa: E402


def best(f, n_bytes, budget=0.3):
    """GB/s of ``f`` (bytes of f32 input per second): the best of rounds of about
    ``budget / 5`` seconds each."""
    f()
    reps, t = 1, 0.0
    while t < 0.01:
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        t = time.perf_counter() - t0
        reps *= 2
    reps = max(1, int(reps * (budget / 5) / max(t, 1e-9) / 2))
    fastest = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        fastest = min(fastest, (time.perf_counter() - t0) / reps)
    return n_bytes / fastest / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 16)
    a = ap.parse_args()
    n = a.elements - a.elements % 32
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    nb = 4 * n
    out = np.empty_like(x)
    rows = []
    copy = best(lambda: np.copyto(out, x), nb)

    def codec(spec):
        frame = bytes(gradpack.encode(x, spec))
        buf = np.empty(len(frame), np.uint8)
        c = gradpack.Codec(spec)
        enc = best(lambda: c.encode_into(x, buf), nb)
        dec = best(lambda: gradpack.decode_into(frame, out), nb)
        return frame, enc, dec

    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
        print("SKIP: ml_dtypes is not installed")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
        print("SKIP: torch is not installed")

    for fmt, mlt, tt in [("e4m3", "float8_e4m3fn", "float8_e4m3fn"), ("e5m2", "float8_e5m2", "float8_e5m2")]:
        spec = f"fp8:format={fmt},scale=none"
        frame, enc, dec = codec(spec)
        codes = np.frombuffer(frame, np.uint8)[gradpack.HEADER_LEN :]
        if ml_dtypes is not None:
            t = getattr(ml_dtypes, mlt)
            assert np.array_equal(x.astype(t).view(np.uint8), codes)
            lo = x.astype(t)
            pe = best(lambda: x.astype(t), nb)
            pd = best(lambda: lo.astype(np.float32), nb)
            rows.append((f"fp8 {fmt}, no scale", "ml_dtypes astype", enc, pe, dec, pd))
        if torch is not None:
            tx, td = torch.from_numpy(x), getattr(torch, tt)
            assert np.array_equal(tx.to(td).view(torch.uint8).numpy(), codes)
            lo_t = tx.to(td)
            pe = best(lambda: tx.to(td), nb)
            pd = best(lambda: lo_t.to(torch.float32), nb)
            rows.append((f"fp8 {fmt}, no scale", "torch .to(float8)", enc, pe, dec, pd))
    if torch is not None:
        try:
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        except ImportError:
            print("SKIP: torchao is not installed")
        else:
            tx = torch.from_numpy(x)
            rceil = ScaleCalculationMode.RCEIL
            for name, spec, td in [
                ("MXFP8 e4m3", "fp8:format=e4m3,block=32,scale=e8m0", torch.float8_e4m3fn),
                ("MXFP4 e2m1", "fp4:format=e2m1,block=32,scale=e8m0", torch.float4_e2m1fn_x2),
            ]:
                frame, enc, dec = codec(spec)
                s, d = to_mx(tx, td, 32, scaling_mode=rceil)
                p = np.frombuffer(frame, np.uint8)[gradpack.HEADER_LEN :]
                assert np.array_equal(p[: n // 32], s.view(torch.uint8).numpy().reshape(-1))
                pe = best(lambda: to_mx(tx, td, 32, scaling_mode=rceil), nb)
                pd = best(lambda: to_dtype(d, s, td, 32, torch.float32), nb)
                rows.append((name + ", blocks of 32", "torchao to_mx RCEIL", enc, pe, dec, pd))
        frame, enc, dec = codec("int8")
        tx = torch.from_numpy(x)

        def per_tensor():  # its scale from the absmax, as gradpack's from each block's
            return torch.quantize_per_tensor(tx, float(tx.abs().max()) / 127, 0, torch.qint8)

        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized tensors are deprecated
            q = per_tensor()
            pe = best(per_tensor, nb)
        pd = best(lambda: q.dequantize(), nb)
        rows.append(("int8 (gradpack: a scale per 256)", "torch absmax + quantize_per_tensor", enc, pe, dec, pd))

    print(f"{n} f32 elements, one thread, {platform.processor() or platform.machine()}, "
          f"backend {gradpack.backend()}; memcpy {copy:.1f} GB/s (GB/s of f32 input)")
    print("| codec | peer | gradpack encode | peer | ratio | gradpack decode | peer | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, peer, enc, pe, dec, pd in rows:
        print(f"| {name} | {peer} | {enc:.1f} | {pe:.2f} | {enc / pe:.1f}x | {dec:.1f} | {pd:.2f} | {dec / pd:.1f}x |")


if __name__ == "__main__":
    main()
