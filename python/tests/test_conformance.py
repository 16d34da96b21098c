"""Exact conformance with the libraries users check gradpack against.

- ml_dtypes' casts (fp8 E4M3 and E5M2, fp4 E2M1): the code of every fp16 bit pattern (as
  f32), of every tie between two neighbouring codes and of values around the largest
  finite one, with no scale and through a block scale of 1, equal ml_dtypes' codes. The
  one documented difference: E4M3 saturates a finite overflow to ±448 (OCP's saturating
  conversion, as section 3.12 of the wire format says), where ml_dtypes' cast gives NaN.
- torchao's MX reference (``to_mx``): MXFP8 (E4M3, E5M2) and MXFP4 blocks of 32 give
  torchao's scale bytes and codes exactly under its ``RCEIL`` rule (NVIDIA's: the
  smallest 2^k with absmax <= FMAX * 2^k, which never clips a block's largest element),
  but in blocks whose scale is the subnormal 2^-127: there torchao flushes every element
  to zero and gradpack keeps them.
  Under the OCP MX 1.0 rule (torchao's default ``FLOOR``) gradpack's default scale byte
  is one higher exactly in the blocks whose largest mantissa exceeds FMAX's; with
  ``scale_rule=ocp`` gradpack follows that rule, and its scale bytes and codes equal
  torchao's ``FLOOR`` ones (the same exception).
- PyTorch's float8 casts: python/tests/test_fp8_torch.py, on all 2^32 f32 inputs.

ml_dtypes and torchao are test extras (``pip install ml_dtypes torchao``); where one is
missing its tests skip with one line.
"""

import numpy as np
import pytest

import gradpack

FMT = {  # format: (ml_dtypes type name, code mask, FMAX, FMAX's mantissa bits, spec)
    "e4m3": ("float8_e4m3fn", 0xFF, 448.0, "fp8:format=e4m3"),
    "e5m2": ("float8_e5m2", 0xFF, 57344.0, "fp8:format=e5m2"),
    "e2m1": ("float4_e2m1fn", 0x0F, 6.0, "fp4:format=e2m1"),
}


def payload(x, spec):
    frame = np.frombuffer(bytes(gradpack.encode(np.ascontiguousarray(x, np.float32), spec)), np.uint8)
    return frame[gradpack.HEADER_LEN :]


def every_fp16():
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def ties_and_edges(ml, t, fmax):
    """Every midpoint between two neighbouring finite codes (exact in f32), values just
    either side of each, and values around FMAX and beyond."""
    codes = np.arange(256 if t != "float4_e2m1fn" else 16, dtype=np.uint8)
    vals = np.sort(np.unique(codes.view(getattr(ml, t)).astype(np.float32)))
    vals = vals[np.isfinite(vals)]
    mid = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    big = np.float32(fmax) * (1 + np.arange(-64, 256, dtype=np.float32) / 128)
    edges = np.array([np.inf, -np.inf, 3.4e38, 1e-45, -1e-45, 0.0, -0.0], np.float32)
    return np.concatenate([mid, -mid, near, -near, big, -big, edges]).astype(np.float32)


def ml_codes(ml, t, mask, x):
    return x.astype(getattr(ml, t)).view(np.uint8) & mask


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_without_a_scale_is_ml_dtypes_cast(fmt):
    ml = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml_dtypes)")
    t, mask, fmax, spec = FMT[fmt]
    x = np.concatenate([every_fp16(), ties_and_edges(ml, t, fmax)])
    ours = payload(x, spec + ",scale=none")
    theirs = ml_codes(ml, t, mask, x)
    if fmt == "e4m3":
        our_nan, their_nan = (ours & 0x7F) == 0x7F, (theirs & 0x7F) == 0x7F
    else:
        our_nan = ((ours & 0x7C) == 0x7C) & ((ours & 0x03) != 0)
        their_nan = ((theirs & 0x7C) == 0x7C) & ((theirs & 0x03) != 0)
    differ = (ours != theirs) & ~(our_nan & their_nan)
    if fmt == "e5m2":
        assert not differ.any(), (x[differ][:8], ours[differ][:8], theirs[differ][:8])
        return
    # E4M3: only finite overflow (saturated to ±448 here, NaN in ml_dtypes) and ±Inf
    # (NaN on both sides, so not a difference) may differ.
    assert np.all(np.isfinite(x[differ])) and np.all(np.abs(x[differ]) > fmax), x[differ][:8]
    assert np.all((ours[differ] & 0x7F) == 0x7E) and np.all(their_nan[differ])
    assert np.all((ours[differ] >> 7) == np.signbit(x[differ]))
    assert differ.sum() > 100  # the overflow set was exercised


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_codes_through_a_block_scale_of_one_are_ml_dtypes_cast(fmt):
    # Blocks of 32 whose largest element is FMAX: the E8M0 scale is 2^0, so each code is
    # the conversion of the element itself (clamped to ±FMAX, as every scaled code is).
    ml = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml_dtypes)")
    t, mask, fmax, spec = FMT[fmt]
    x = np.concatenate([every_fp16(), ties_and_edges(ml, t, fmax)])
    x = x[np.isfinite(x)]
    x = np.clip(x, -fmax, fmax)
    x = np.concatenate([x, np.zeros((-len(x)) % 31, np.float32)]).reshape(-1, 31)
    blocks = np.concatenate([np.full((len(x), 1), fmax, np.float32), x], axis=1).reshape(-1)
    p = payload(blocks, spec + ",block=32,scale=e8m0")
    nb = len(blocks) // 32
    assert np.all(p[:nb] == 127), "every block's scale is 2^0"
    codes = p[nb:]
    if fmt == "e2m1":  # two codes a byte, the even element in the low nibble
        codes = np.stack([codes & 0x0F, codes >> 4], axis=1).reshape(-1)
    theirs = ml_codes(ml, t, mask, blocks)
    assert np.array_equal(codes, theirs), np.nonzero(codes != theirs)[0][:8]


def mantissa(v):
    return np.asarray(v, np.float32).view(np.uint32) & 0x7FFFFF


def gradients(n_blocks):
    """Blocks of 32 from a Gaussian, a Student-t with 3 degrees of freedom, tiny values
    (subnormal scales), and blocks with zeros."""
    rng = np.random.default_rng(7)
    g = rng.standard_normal(n_blocks * 32).astype(np.float32)
    t = rng.standard_t(3, n_blocks * 32).astype(np.float32)
    tiny = (rng.standard_normal(n_blocks * 32) * 1e-38).astype(np.float32)
    z = g.copy()
    z[: len(z) // 2] = 0
    return np.concatenate([g, t * 100, tiny, z])


def torchao_mx(fmt):
    """torch, torchao's ``to_mx`` and ``ScaleCalculationMode``, and the torch dtype of
    ``fmt``; the test skips where one of them is missing."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
             "e2m1": getattr(torch, "float4_e2m1fn_x2", None)}[fmt]
    if dtype is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    return torch, to_mx, ScaleCalculationMode, dtype


def ours_and_torchao(fmt, x, rule, mode):
    """MX blocks of 32 of ``x`` with E8M0 scales by gradpack (``rule``: the spec's suffix)
    and by torchao (``mode``: its scaling mode's name): each one's scale bytes and codes
    (a row of code bytes per block)."""
    torch, to_mx, ScaleCalculationMode, dtype = torchao_mx(fmt)
    p = payload(x, FMT[fmt][3] + ",block=32,scale=e8m0" + rule)
    nb = len(x) // 32
    per = (len(p) - nb) // nb  # codes a block: 32 bytes, or 16 of two fp4 codes
    s, d = to_mx(torch.from_numpy(x), dtype, 32,
                 scaling_mode=getattr(ScaleCalculationMode, mode))
    theirs = (s.view(torch.uint8).numpy().reshape(-1),
              d.view(torch.uint8).numpy().reshape(nb, per))
    return (p[:nb], p[nb:].reshape(nb, per)), theirs


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_mx_blocks_are_torchao_rceil_and_one_above_its_floor_where_the_mantissa_is_larger(fmt):
    _, _, fmax, spec = FMT[fmt]
    x = gradients(4096)
    nb = len(x) // 32
    (ours_s, ours_c), (theirs_s, theirs_c) = ours_and_torchao(fmt, x, "", "RCEIL")
    assert np.array_equal(ours_s, theirs_s)
    sub = ours_s == 0  # the scale 2^-127, a subnormal f32
    assert np.array_equal(ours_c[~sub], theirs_c[~sub])
    # Under the subnormal scale torchao's reference flushes every element to zero;
    # gradpack divides by it and keeps them, never further from x than zero is.
    mag = 0x77 if fmt == "e2m1" else 0x7F
    assert not np.any(theirs_c[sub] & mag)
    back = gradpack.decode(bytes(gradpack.encode(x, spec + ",block=32,scale=e8m0")))
    xs, bs = x.reshape(nb, 32)[sub], back.reshape(nb, 32)[sub]
    assert np.all(np.abs(bs - xs) <= np.abs(xs)) and np.any(np.abs(bs - xs) < np.abs(xs))
    _, (floor, _) = ours_and_torchao(fmt, x, "", "FLOOR")
    absmax = np.abs(x).reshape(-1, 32).max(axis=1)
    larger = (mantissa(absmax) > mantissa(fmax)) & (absmax > 0)
    # Blocks above the smallest scale: there both rules clamp to 2^-127.
    normal = ours_s > 0
    assert np.array_equal(ours_s[normal & larger], floor[normal & larger] + 1)
    assert np.array_equal(ours_s[normal & ~larger], floor[normal & ~larger])
    assert 0.1 < larger[normal].mean() < 0.5  # both kinds of block were exercised


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_mx_blocks_with_scale_rule_ocp_are_torchao_floor(fmt):
    # scale_rule=ocp: the OCP MX 1.0 rule, torchao's default FLOOR; scale bytes and codes
    # equal torchao's (whose largest quotients are clamped to FMAX too), but in blocks
    # whose scale is the subnormal 2^-127, where torchao flushes the elements to zero.
    fmax = FMT[fmt][2]
    x = gradients(4096)
    (ours_s, ours_c), (theirs_s, theirs_c) = ours_and_torchao(fmt, x, ",scale_rule=ocp", "FLOOR")
    assert np.array_equal(ours_s, theirs_s), np.nonzero(ours_s != theirs_s)[0][:8]
    sub = ours_s == 0
    assert np.array_equal(ours_c[~sub], theirs_c[~sub])
    # The clamp was exercised: blocks whose largest element is clipped to FMAX.
    absmax = np.abs(x).reshape(-1, 32).max(axis=1)
    clipped = (mantissa(absmax) > mantissa(fmax)) & ~sub & (absmax > 0)
    assert 0.1 < clipped.mean() < 0.5
