"""fp8 against PyTorch's own casts, on every one of the 2^32 f32 bit patterns.

With ``scale=none`` and nearest rounding, gradpack's E5M2 codes equal
``tensor.to(torch.float8_e5m2)`` for every input, NaN included (as NaN), and its E4M3
codes equal ``tensor.to(torch.float8_e4m3fn)`` for every input but two: ±Inf, which
PyTorch saturates to ±448 like any overflow and gradpack writes as NaN (E4M3 has no
infinity, and an overflow of the gradient must stay visible). Finite magnitudes past
448 saturate on both sides. Both halves of that statement are asserted."""

import numpy as np
import pytest

import gradpack

torch = pytest.importorskip("torch")

HEADER = 56
CHUNK = 1 << 26  # 64 Mi patterns per step: 64 steps


def codes(spec, x):
    frame = gradpack.encode(x, spec)
    return np.frombuffer(frame, dtype=np.uint8, offset=HEADER)


@pytest.mark.parametrize("fmt,dtype", [("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2")])
def test_every_f32_converts_as_pytorch_does(fmt, dtype):
    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    tdtype = getattr(torch, dtype)
    spec = f"fp8:format={fmt},scale=none"
    nan_code = 0x7F if fmt == "e4m3" else None
    saturated = 0
    for start in range(0, 1 << 32, CHUNK):
        bits = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        ours = codes(spec, x)
        theirs = torch.from_numpy(x).to(tdtype).view(torch.uint8).numpy()
        # NaN: any NaN code on both sides (payloads and signs of NaN differ by library).
        if fmt == "e4m3":
            our_nan = (ours & 0x7F) == nan_code
            their_nan = (theirs & 0x7F) == nan_code
        else:
            our_nan = ((ours & 0x7C) == 0x7C) & ((ours & 0x03) != 0)
            their_nan = ((theirs & 0x7C) == 0x7C) & ((theirs & 0x03) != 0)
        differ = (ours != theirs) & ~(our_nan & their_nan)
        if fmt == "e4m3":
            # Where they differ: ±Inf, which PyTorch saturates and gradpack makes NaN.
            assert np.all(np.isinf(x[differ])), x[differ][:8]
            assert np.all((theirs[differ] & 0x7F) == 0x7E)
            assert np.all(our_nan[differ])
            saturated += int(differ.sum())
        else:
            assert not differ.any(), (x[differ][:8], ours[differ][:8], theirs[differ][:8])
    if fmt == "e4m3":
        assert saturated == 2, "exactly +Inf and -Inf differ"
