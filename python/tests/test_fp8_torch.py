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
CHUNK = 1 << 22  # 4 Mi patterns per step: 1024 steps


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
    # One pass makes each chunk's patterns, one compares the codes; only the few that
    # differ (NaNs, and E4M3's infinities) are looked at further.
    base = np.arange(CHUNK, dtype=np.uint32)
    for start in range(0, 1 << 32, CHUNK):
        x = (base + np.uint32(start)).view(np.float32)
        ours = codes(spec, x)
        theirs = torch.from_numpy(x).to(tdtype).view(torch.uint8).numpy()
        at = np.flatnonzero(ours != theirs)
        if at.size == 0:
            continue
        xs, o, t = x[at], ours[at], theirs[at]
        # NaN: any NaN code on both sides (payloads and signs of NaN differ by library).
        if fmt == "e4m3":
            our_nan = (o & 0x7F) == nan_code
            their_nan = (t & 0x7F) == nan_code
        else:
            our_nan = ((o & 0x7C) == 0x7C) & ((o & 0x03) != 0)
            their_nan = ((t & 0x7C) == 0x7C) & ((t & 0x03) != 0)
        differ = ~(our_nan & their_nan)
        if fmt == "e4m3":
            # Where they differ: ±Inf, which PyTorch saturates and gradpack makes NaN.
            assert np.all(np.isinf(xs[differ])), xs[differ][:8]
            assert np.all((t[differ] & 0x7F) == 0x7E)
            assert np.all(our_nan[differ])
            saturated += int(differ.sum())
        else:
            assert not differ.any(), (xs[differ][:8], o[differ][:8], t[differ][:8])
    if fmt == "e4m3":
        assert saturated == 2, "exactly +Inf and -Inf differ"
