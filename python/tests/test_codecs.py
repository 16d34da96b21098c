"""The numpy API: frames byte-identical to the Rust crate's (its golden vectors), round
trips and error bounds, error feedback, clear errors for bad input, and the GIL released
while a kernel runs."""

import os
import re
import sys
import threading
import time

import numpy as np
import pytest

import gradpack

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "vectors")


def golden_table():
    rows = []
    with open(os.path.join(VECTORS, "README.md")) as f:
        for line in f:
            m = re.match(r"^\| (\w+) \| `([^`]+)`.*\| (\d+) \| (\d+) \|$", line.strip())
            if m:
                rows.append((m[1], m[2], int(m[3]), int(m[4])))
    assert len(rows) >= 20, "the golden table of tests/vectors/README.md was not found"
    return rows


def read(name, dtype):
    return np.fromfile(os.path.join(VECTORS, name), dtype=dtype)


@pytest.mark.parametrize("name,spec,seed,offset", golden_table())
def test_frames_are_byte_identical_to_the_crates_golden_vectors(name, spec, seed, offset):
    for suffix, inp in (("", "input.f32"), (".nonfinite", "input-nonfinite.f32")):
        x = read(inp, "<f4")
        path = os.path.join(VECTORS, f"{name}{suffix}.gpk")
        if not os.path.exists(path):
            continue
        want = open(path, "rb").read()
        assert gradpack.encode(x, spec, seed=seed, offset=offset) == want
        out = gradpack.decode(want)
        expect = read(f"{name}{suffix}.out.f32", "<f4")
        assert out.dtype == np.float32 and out.shape == expect.shape
        assert np.array_equal(out.view(np.uint32), expect.view(np.uint32))
        sealed = os.path.join(VECTORS, f"{name}{suffix}.sealed")
        if os.path.exists(sealed):
            got = gradpack.encode(x, spec, seed=seed, offset=offset, checksum=True)
            assert got == open(sealed, "rb").read()
            assert np.array_equal(gradpack.decode(got).view(np.uint32), expect.view(np.uint32))


SPECS = ["identity", "fp16", "bf16", "fp8", "fp8:format=e5m2,scale=e8m0,block=32,rounding=stochastic",
         "fp4", "fp4:format=e3m0,scale=f32,block=14,rounding=stochastic", "codebook:block=4096",
         "chunktopk", "chunktopk:chunk=100,k=9",
         "int8", "int8:block=64,rounding=stochastic",
         "qsgd:bits=4,block=64", "sign", "ternary", "natural", "topk:ratio=0.01,values=fp16",
         "randk:ratio=0.05"]


def grad(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)


@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_within_the_codecs_error_bound(spec):
    x = grad(10_007)
    c = gradpack.Codec(spec)
    f = c.encode(x, seed=5)
    assert len(f) <= c.max_encoded_len(x.size)
    info = gradpack.inspect(f)
    assert info["elements"] == x.size and info["frame_len"] == len(f)
    assert gradpack.Codec(info["spec"]).name == c.name
    y = gradpack.decode(f)
    assert y.shape == (x.size,) and y.dtype == np.float32
    bound = c.error_bound(float(np.abs(x).max()))
    if np.isfinite(bound):
        assert float(np.abs(y - x).max()) <= bound
    # decode_into and decode_add agree with decode, bit for bit.
    out = np.full(x.size, np.nan, dtype=np.float32)
    gradpack.decode_into(f, out)
    assert np.array_equal(out.view(np.uint32), y.view(np.uint32))
    acc = np.ones(x.size, dtype=np.float32)
    gradpack.decode_add(f, acc)
    assert np.array_equal(acc, np.float32(1) + y)
    # The same seed gives the same frame; the frame length is read from its header alone.
    assert c.encode(x, seed=5) == f
    assert gradpack.frame_len(f + b"\0" * 9) == len(f)


def test_exact_codecs():
    x = grad(4099)
    assert np.array_equal(gradpack.decode(gradpack.encode(x, "identity")), x)
    want = x.astype(np.float16).astype(np.float32)  # round to nearest even
    with np.errstate(over="ignore"):
        assert np.array_equal(gradpack.decode(gradpack.encode(x, "fp16")), want)


def test_any_shape_is_read_flat_and_decoded_into_any_shape():
    x = grad(6 * 50).reshape(6, 50)
    f = gradpack.encode(x, "int8")
    assert gradpack.inspect(f)["elements"] == 300
    out = np.zeros((50, 6), dtype=np.float32)
    gradpack.decode_into(f, out)
    assert np.array_equal(out.reshape(-1), gradpack.decode(f))


@pytest.mark.parametrize("api", ["gradpack", "native"])
def test_torch_tensors_are_read_and_written_in_place(api):
    # The package's functions, and the native module's own (which read torch tensors
    # and buffers without the package's help).
    torch = pytest.importorskip("torch")
    g = gradpack if api == "gradpack" else gradpack._native
    t = torch.from_numpy(grad(5000))
    assert g.encode(t, "int8") == gradpack.encode(t.numpy(), "int8")
    p = torch.nn.Parameter(t.clone())  # requires_grad: read through a detached view
    assert g.encode(p, "fp16") == gradpack.encode(t, "fp16")
    out = torch.zeros(5000)
    g.decode_into(gradpack.encode(t, "fp16"), out)
    assert torch.equal(out, t.half().float())
    buf = torch.empty(gradpack.Codec("int8").max_encoded_len(5000), dtype=torch.uint8)
    n = g.encode_into(t, buf, "int8")
    assert bytes(buf[:n].numpy()) == gradpack.encode(t, "int8")
    assert np.array_equal(g.decode(buf[:n]), gradpack.decode(bytes(buf[:n].numpy())))
    f = bytearray(buf[:n].numpy().tobytes())
    assert np.array_equal(g.decode(f), g.decode(memoryview(f)))
    with pytest.raises(TypeError, match="float32"):
        g.encode(t.double(), "int8")
    with pytest.raises(ValueError, match="contiguous"):
        g.encode(t.reshape(50, 100).t(), "int8")
    with pytest.raises(TypeError, match="format"):
        g.encode(memoryview(bytearray(16)).cast("d"), "int8")


def test_encode_into_a_buffer_and_bytearray_frames():
    x = grad(1000)
    c = gradpack.Codec("sign")
    out = np.full(c.max_encoded_len(1000) + 10, 0xAB, dtype=np.uint8)
    n = c.encode_into(x, out)
    assert bytes(out[:n]) == c.encode(x)
    assert np.all(out[n:] == 0xAB)  # nothing written past the frame
    f = bytearray(out[:n].tobytes())
    assert np.array_equal(gradpack.decode(f), gradpack.decode(memoryview(f)))
    with pytest.raises(gradpack.Error, match="buffer"):
        c.encode_into(x, np.zeros(10, dtype=np.uint8))


def test_half_precision_inputs_are_widened_and_lossless_keeps_their_bits():
    rng = np.random.default_rng(5)
    g = (rng.standard_normal(5000) * 1e-3).astype(np.float32)
    g[::4] = 0.0  # a quarter +0.0: the zeros section
    h = g.astype(np.float16)
    f = gradpack.encode(h, "lossless:dtype=fp16")
    assert gradpack.decode(f).tobytes() == h.astype(np.float32).tobytes()
    assert len(f) < 2 * h.size * 0.8
    buf = np.zeros(gradpack.Codec("lossless:dtype=fp16").max_encoded_len(h.size), np.uint8)
    n = gradpack.Codec("lossless:dtype=fp16").encode_into(h, buf)
    assert bytes(buf[:n]) == f
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = g.astype(ml_dtypes.bfloat16)
    f = gradpack.encode(b, "lossless:dtype=bf16")
    assert gradpack.decode(f).tobytes() == b.astype(np.float32).tobytes()
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(g).to(torch.bfloat16)
    assert gradpack.encode(t, "lossless:dtype=bf16") == f
    # Values that are not of the codec's type are refused, never rounded.
    with pytest.raises(gradpack.Error, match="not a bf16 value"):
        gradpack.encode(g + 1e-3, "lossless:dtype=bf16")


def test_wrong_dtypes_layouts_and_types_are_clear_errors():
    x64 = np.zeros(10)
    with pytest.raises(TypeError, match="float64.*float32"):
        gradpack.encode(x64, "int8")
    with pytest.raises(TypeError, match="float32"):
        gradpack.encode(np.zeros(10, dtype=">f4"), "int8")  # big-endian
    with pytest.raises(ValueError, match="C-contiguous"):
        gradpack.encode(np.zeros((10, 10), dtype=np.float32)[:, 1], "int8")
    with pytest.raises(ValueError, match="C-contiguous"):
        gradpack.encode(np.zeros((10, 10), dtype=np.float32, order="F"), "int8")
    with pytest.raises(TypeError, match="list"):
        gradpack.encode([1.0, 2.0], "int8")
    with pytest.raises(TypeError, match="format"):
        gradpack.encode(b"abcd", "int8")  # bytes are not float32
    with pytest.raises(TypeError, match="codec"):
        gradpack.encode(np.zeros(3, dtype=np.float32), 8)
    with pytest.raises(gradpack.Error, match="unknown codec"):
        gradpack.Codec("int7")
    with pytest.raises(TypeError, match="frame"):
        gradpack.decode("not bytes")
    with pytest.raises(TypeError, match="uint8"):
        gradpack.decode(np.zeros(100, dtype=np.float32))
    f = gradpack.encode(grad(100), "int8")
    ro = np.zeros(100, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writ"):
        gradpack.decode_into(f, ro)
    with pytest.raises(gradpack.Error):
        gradpack.decode_into(f, np.zeros(99, dtype=np.float32))
    assert issubclass(gradpack.Error, ValueError)


def test_corrupt_and_truncated_frames_raise_gradpack_error_and_leave_acc_alone():
    x = grad(3000)
    for checksum in (False, True):
        f = bytearray(gradpack.encode(x, "int8", checksum=checksum))
        acc = np.ones(3000, dtype=np.float32)
        for cut in (0, 10, gradpack.HEADER_LEN, len(f) - 1):
            with pytest.raises(gradpack.Error):
                gradpack.decode_add(bytes(f[:cut]), acc)
        g = bytearray(f)
        g[3] ^= 0x40  # magic
        with pytest.raises(gradpack.Error, match="magic"):
            gradpack.decode(bytes(g))
        g = bytearray(f)
        g[20] ^= 1  # inside the header: its CRC catches it
        with pytest.raises(gradpack.Error, match="checksum"):
            gradpack.decode_add(bytes(g), acc)
        if checksum:
            g = bytearray(f)
            g[len(g) // 2] ^= 1  # inside the payload
            with pytest.raises(gradpack.Error, match="checksum"):
                gradpack.decode_add(bytes(g), acc)
        assert np.all(acc == 1.0)
    with pytest.raises(gradpack.Error):
        gradpack.decode(gradpack.encode(x, "int8"), max_elements=100)


def test_error_feedback_keeps_the_sum_and_survives_a_state_dict():
    n, steps = 20_000, 6
    ef = gradpack.ErrorFeedback("topk:ratio=0.01,values=fp16", n)
    twin = gradpack.ErrorFeedback("topk:ratio=0.01,values=fp16", n)
    sent = np.zeros(n, dtype=np.float64)
    total = np.zeros(n, dtype=np.float64)
    for s in range(steps):
        g = grad(n, s)
        total += g
        f = ef.encode(g, seed=s)
        sent += gradpack.decode(f)
        if s == 2:
            twin.load_state_dict(ef.state_dict())
        elif s > 2:
            assert twin.encode(g, seed=s) == f  # restored: continues identically
    # Everything not yet sent is in the residual (fp16 values: rounding left there too).
    np.testing.assert_allclose(sent + ef.residual(), total, rtol=0, atol=1e-4 * np.abs(total).max())
    state = ef.state_dict()
    assert state["codec"] == ef.codec.spec and state["len"] == n
    bad = dict(state, blob=state["blob"][:-1] + bytes([state["blob"][-1] ^ 1]))
    with pytest.raises(gradpack.Error):
        twin.load_state_dict(bad)
    other = gradpack.ErrorFeedback("int8", n)
    with pytest.raises(gradpack.Error):
        other.load_state_dict(state)
    ef.set_residual(np.zeros(n, dtype=np.float32))
    assert not ef.residual().any()
    with pytest.raises(gradpack.Error):
        ef.set_residual(np.zeros(n - 1, dtype=np.float32))
    with pytest.raises(gradpack.Error):
        ef.encode(np.zeros(n + 1, dtype=np.float32))
    with pytest.raises(gradpack.Error, match="contractive"):
        gradpack.ErrorFeedback("randk:ratio=0.1,scale=unbiased", 100)


def test_cost_model():
    p = gradpack.CodecProfile("int8", 8.5)
    fp32 = gradpack.CodecProfile("identity", 32)
    t8 = gradpack.allreduce_time(p, "ring", 4, 10e9, 1e7)
    t32 = gradpack.allreduce_time(fp32, "fp32-ring", 4, 10e9, 1e7)
    # Infinitely fast compute, no latency: bytes only, 2 (p - 1)/p * elements * bits / 8.
    assert t32 == pytest.approx(2 * 3 / 4 * 1e7 * 32 / 10e9)
    assert t8 == pytest.approx(t32 * 8.5 / 32)
    assert gradpack.best_strategy(p, 4, 10e9, 1e7)[0] == "ring"
    assert gradpack.break_even_bandwidth(p, 4, 1e7) == float("inf")
    measured = gradpack.calibrate("int8", 1 << 16, 0.02)
    assert measured.encode_bytes_per_s > 0 and measured.bits_per_element > 8
    assert 0 < gradpack.break_even_bandwidth(measured, 4, 1e7, 50e-6) < float("inf")
    assert gradpack.parse_bandwidth("10Gbit/s") == 10e9
    assert gradpack.parse_duration("50us") == pytest.approx(50e-6)
    with pytest.raises(ValueError):
        gradpack.parse_bandwidth("fast")
    with pytest.raises(ValueError):
        gradpack.allreduce_time(p, "tree", 4, 10e9, 1e7)
    with pytest.raises(ValueError):
        gradpack.CodecProfile("x", -1)
    # The pipelined ring: one piece is the ring; more pieces hide the smaller of compute
    # and transfer behind the larger, never below the larger alone.
    one = gradpack.ring_time(measured, 4, 10e9, 1e7, 50e-6, 1)
    assert one == pytest.approx(gradpack.allreduce_time(measured, "ring", 4, 10e9, 1e7, 50e-6))
    four = gradpack.ring_time(measured, 4, 10e9, 1e7, 50e-6, 4)
    assert four < one
    xfer = 2 * 3 / 4 * 1e7 * measured.bits_per_element / 10e9
    assert four > xfer
    with pytest.raises(ValueError, match="pieces"):
        gradpack.ring_time(measured, 4, 10e9, 1e7, 0.0, 0)


def test_the_gil_is_released_while_a_kernel_runs():
    # While one thread is inside a long encode, another thread must keep running Python
    # code. With the GIL held for the call, the counting thread stops for the whole
    # kernel: its largest pause covered 69-83% of each call with a build that kept the
    # GIL (the rest is the wrapper's Python), and 11-30% with this one, on a loaded
    # machine. One call in five with no pause over half of it suffices.
    # (A property of the call, not a speed.)
    x = grad(1 << 24)
    c = gradpack.Codec("qsgd:bits=4,block=64")
    out = np.empty(c.max_encoded_len(x.size), dtype=np.uint8)
    stamps = []
    done = threading.Event()

    def count():
        while not done.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.01)
        windows = []
        for _ in range(5):
            t0 = time.perf_counter()
            c.encode_into(x, out, seed=1)
            windows.append((t0, time.perf_counter()))
        done.set()
        t.join()
    finally:
        sys.setswitchinterval(old)
    fractions = []
    for a, b in windows:
        inside = [s for s in stamps if a < s < b]
        gap = float(np.diff([a] + inside + [b]).max())
        fractions.append(gap / (b - a))
    assert max(b - a for a, b in windows) > 5e-3, "encode too short to tell"
    assert min(fractions) < 0.5, f"the other thread stalled through the encode: {fractions}"


def test_powersgd_bucket_two_ranks_agree_and_project_onto_the_mean():
    # Two simulated ranks drive their buckets with all-reduces done here in numpy. Both
    # end with the same bits; the result is P P^T mean(M) with P orthonormal (the
    # definition, since Q = mean(M)^T P), and each residual is M - result.
    shapes = [(40, 24, 2), (16, 30, 2)]
    n = sum(a * b for a, b, _ in shapes)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    bs = [gradpack.PowerSgdBucket(shapes, rank=2) for _ in range(2)]
    assert (len(bs[0]), bs[0].p_len, bs[0].q_len) == (n, 2 * 56, 2 * 54)
    ms = [g.copy() for g in grads]
    ps = [np.zeros(bs[0].p_len, np.float32) for _ in range(2)]
    for b, m, p in zip(bs, ms, ps):
        b.p_step(m, 7, p)
    pm = [(ps[0] + ps[1]) / np.float32(2) for _ in range(2)]
    qs = [np.zeros(bs[0].q_len, np.float32) for _ in range(2)]
    for b, m, p, q in zip(bs, ms, pm, qs):
        b.q_step(m, p, q)
    assert np.array_equal(pm[0], pm[1])
    qm = (qs[0] + qs[1]) / np.float32(2)
    outs = [np.zeros(n, np.float32) for _ in range(2)]
    for b, m, p, o in zip(bs, ms, pm, outs):
        assert b.finish(m, p, qm, o)
    assert np.array_equal(outs[0], outs[1])
    mean = (grads[0].astype(np.float64) + grads[1]) / 2
    at = pat = 0
    for i, (r, c, k) in enumerate(shapes):
        P = pm[0][pat : pat + r * k].reshape(r, k).astype(np.float64)
        assert np.allclose(P.T @ P, np.eye(k), atol=1e-5)
        want = P @ P.T @ mean[at : at + r * c].reshape(r, c)
        got = outs[0][at : at + r * c].reshape(r, c)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        for b, m in zip(bs, ms):
            q, e = b.matrix_state(i)
            assert q is not None and q.size == c * k
            assert np.array_equal(e, m[at : at + r * c] - outs[0][at : at + r * c])
        at, pat = at + r * c, pat + r * k
    # The whole state through a blob, and steps out of order.
    c = gradpack.PowerSgdBucket(shapes, rank=2)
    c.restore(bs[0].save())
    assert c.save() == bs[0].save()
    with pytest.raises(gradpack.Error, match="before"):
        c.q_step(ms[0], pm[0], qs[0])
    with pytest.raises(gradpack.Error, match="rank"):
        gradpack.PowerSgdBucket([(40, 24, 3)], rank=2)
    assert gradpack.powersgd_matrix((256, 64), 2) == (256, 64, 2)
    assert gradpack.powersgd_matrix((64, 3, 3, 3), 4) == (64, 27, 4)
    assert gradpack.powersgd_matrix((256,), 2) is None
    assert gradpack.powersgd_matrix((10, 10), 4) is None


def test_powersgd_bucket_at_offsets_works_in_place_and_leaves_other_tensors():
    # The matrices inside a larger buffer (as in a DDP bucket, between biases): the same
    # result as the back-to-back bucket, written over the buffer, the rest untouched.
    shapes = [(30, 20, 2), (12, 25, 2)]
    na, nb = 600, 300
    g = np.random.default_rng(1).standard_normal(na + nb).astype(np.float32)
    dense = gradpack.PowerSgdBucket(shapes)
    m = g.copy()
    p, q, out = np.zeros(dense.p_len, np.float32), np.zeros(dense.q_len, np.float32), np.zeros(na + nb, np.float32)
    dense.p_step(m, 3, p)
    dense.q_step(m, p, q)
    assert dense.finish(m, p, q, out)
    buf = np.full(4 + na + 2 + nb + 5, -1.5, np.float32)
    buf[4 : 4 + na], buf[6 + na : 6 + na + nb] = g[:na], g[na:]
    spread = gradpack.PowerSgdBucket(shapes, offsets=[4, 6 + na], length=buf.size)
    assert len(spread) == buf.size
    spread.p_step(buf, 3, p)
    spread.q_step(buf, p, q)
    assert spread.finish(buf, p, q)
    assert np.array_equal(buf[4 : 4 + na], out[:na]) and np.array_equal(buf[6 + na : 6 + na + nb], out[na:])
    assert (buf[:4] == -1.5).all() and (buf[4 + na : 6 + na] == -1.5).all() and (buf[-5:] == -1.5).all()
    with pytest.raises(ValueError, match="offsets"):
        gradpack.PowerSgdBucket(shapes, offsets=[4])
    with pytest.raises(gradpack.Error, match="overlaps"):
        gradpack.PowerSgdBucket(shapes, offsets=[0, 10], length=buf.size)


def test_reduce_frames_is_the_sequential_sum_to_the_bit():
    rng = np.random.default_rng(5)
    n = 5000
    for specs in (["int8"] * 8, ["fp16", "topk:ratio=0.05", "sign", "int8:block=64"]):
        frames = [
            gradpack.encode(rng.standard_normal(n).astype(np.float32), s, seed=q)
            for q, s in enumerate(specs)
        ]
        want = np.empty(n, np.float32)
        gradpack.decode_into(frames[0], want)
        for f in frames[1:]:
            gradpack.decode_add(f, want)
        out = np.full(n, np.nan, np.float32)
        # bytes and uint8 arrays mixed in one list
        gradpack.reduce_frames([frames[0]] + [np.frombuffer(f, np.uint8) for f in frames[1:]], out)
        assert out.view(np.uint32).tolist() == want.view(np.uint32).tolist()
        acc = np.ones(n, np.float32)
        gradpack.reduce_frames(frames, acc, add=True)
        ref = np.ones(n, np.float32)
        for f in frames:
            gradpack.decode_add(f, ref)
        assert acc.view(np.uint32).tolist() == ref.view(np.uint32).tolist()


def test_reduce_frames_names_the_bad_frame_and_leaves_out_alone():
    x = np.linspace(-1, 1, 300, dtype=np.float32)
    good = gradpack.encode(x, "int8")
    short = gradpack.encode(x[:299], "int8")
    out = np.full(300, 7.0, np.float32)
    with pytest.raises(gradpack.Error, match=r"^frame 2: "):
        gradpack.reduce_frames([good, good, short], out)
    assert (out == 7.0).all()
    with pytest.raises(TypeError, match="a frame must be"):
        gradpack.reduce_frames([good, 3], out)


class _Mailboxes:
    """An in-process transport for `gradpack.AllReduce`: one queue per (sender,
    receiver) pair; `recv` gives up after `timeout` seconds."""

    def __init__(self, world, timeout=20.0):
        import queue

        self.q = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
        self.timeout = timeout

    def send_of(self, rank):
        def send(msg, to):
            self.q[(rank, to)].put(bytes(msg))

        return send

    def recv_of(self, rank):
        def recv(frm):
            return self.q[(frm, rank)].get(timeout=self.timeout)

        return recv


def _on_threads(world, body):
    """``body(r)`` for every rank ``r`` on a thread of its own; each rank's exception or
    None."""
    errors = [None] * world

    def rank_main(r):
        try:
            body(r)
        except BaseException as e:  # reported by the test
            errors[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _run_ranks(world, make, steps, n, timeout=20.0):
    """Run `steps` all-reduces on `world` threads; each rank's output per step."""
    box = _Mailboxes(world, timeout)
    ars = [make(r, box.send_of(r), box.recv_of(r)) for r in range(world)]
    return (ars,) + _steps_on(ars, steps, n)


def _steps_on(ars, steps, n):
    """`steps` runs of every rank's collective `ars[r]` on a thread of its own, rank r's
    input of step s a function of (r, s); each rank's output per step, and each rank's
    exception or None."""
    world = len(ars)
    outs = [[None] * steps for _ in range(world)]

    def body(r):
        for s in range(steps):
            x = np.sin(np.arange(n, dtype=np.float32) * (0.01 * (r + 1)) + s).astype(np.float32)
            out = np.empty(n, np.float32)
            ars[r].run(x, out, seed=1000 + s)
            outs[r][s] = out

    return outs, _on_threads(world, body)


@pytest.mark.parametrize(
    "codec,strategy,feedback,pieces",
    [
        ("int8", "ring", "worker+owner", 2),
        ("topk:ratio=0.05,values=fp16", "allgather", "worker", 1),
        ("sign", "majority", "worker", 1),
        ("fp16", "fp32-ring", "none", 1),
        ("int8", "auto", "none", 1),
    ],
)
def test_allreduce_over_python_callables_is_identical_on_every_rank(codec, strategy, feedback, pieces):
    world, n, steps = 3, 10_001, 3

    def make(r, send, recv):
        return gradpack.AllReduce(
            codec, n, r, world, send, recv, strategy=strategy, feedback=feedback, pieces=pieces
        )

    ars, outs, errors = _run_ranks(world, make, steps, n)
    assert errors == [None] * world, errors
    for s in range(steps):
        for r in range(1, world):
            assert outs[r][s].view(np.uint32).tolist() == outs[0][s].view(np.uint32).tolist()
    # The mean of the inputs, within the codec's error (majority: the sign only).
    exact = np.mean(
        [np.sin(np.arange(n, dtype=np.float32) * (0.01 * (r + 1)) + steps - 1) for r in range(world)],
        axis=0,
    )
    got = outs[0][steps - 1]
    if strategy == "majority":
        agree = np.mean(np.sign(got[exact != 0]) == np.sign(exact[exact != 0]))
        assert agree > 0.6
    elif codec.startswith("topk"):
        assert np.isfinite(got).all()
    else:
        assert np.max(np.abs(got - exact)) < (0.05 if codec == "int8" else 1e-3)
    assert ars[0].calls == steps
    assert all(a.strategy == ars[0].strategy for a in ars)


def test_bucket_gather_sums_each_tensor_in_rank_order_on_every_rank():
    # A bucket of four tensors with codecs of their own (one empty, one sparse, one with
    # error feedback) and gaps left untouched between them.
    world, n = 3, 5000
    parts = [(3, 1200, "int8"), (1210, 0, "fp16"), (1215, 900, "topk:ratio=0.05"), (2200, 2700, "fp8")]
    segments = [(a, m) for a, m, _ in parts]

    def inputs(r):
        return np.sin(np.arange(n, dtype=np.float32) * (0.013 * (r + 1))).astype(np.float32)

    def message(r, feedback):
        x = inputs(r)
        frames = []
        for (a, m, spec), ef in zip(parts, feedback):
            c = gradpack.Codec(spec)
            if ef is None:
                frames.append(bytes(c.encode(x[a : a + m], seed=r + 1, checksum=True)))
            else:
                buf = np.empty(c.max_encoded_len(m, True), np.uint8)
                k = ef.encode_into(x[a : a + m], buf, seed=r + 1, checksum=True)
                frames.append(buf[:k].tobytes())
        return b"".join(frames), frames

    box = _Mailboxes(world)
    gs = [gradpack.BucketGather(r, world, box.send_of(r), box.recv_of(r), tag=7) for r in range(world)]
    feedback = [[None, None, gradpack.ErrorFeedback("topk:ratio=0.05", 900), None] for _ in range(world)]
    outs = [np.full(n, -2.0, np.float32) for _ in range(world)]
    frames = [None] * world
    msgs = [None] * world
    for r in range(world):
        msgs[r], frames[r] = message(r, feedback[r])

    def body(r):
        st = gs[r].run(msgs[r], segments, outs[r])
        assert st["messages"] == world - 1 and st["strategy"] == "allgather"

    assert _on_threads(world, body) == [None] * world
    for r in range(1, world):
        assert outs[r].view(np.uint32).tolist() == outs[0].view(np.uint32).tolist()
    # The definition: each tensor's frames decoded and summed in rank order, then / world.
    want = np.full(n, -2.0, np.float32)
    for i, (a, m, _) in enumerate(parts):
        gradpack.reduce_frames([frames[q][i] for q in range(world)], want[a : a + m])
        want[a : a + m] /= np.float32(world)
    assert outs[0].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert gs[0].calls == 1


def test_bucket_gather_encodes_and_runs_in_one_call_as_the_caller_would():
    # encode_run: the crate encodes each part (its seed from the state's, the step and
    # the part's key; top-k through its residual) and gathers: the bits of the caller
    # encoding with those seeds and running the gather, residuals alike.
    world, n = 3, 1200
    parts = [(0, 900, "topk:ratio=0.05"), (900, 200, "int8"), (1100, 100, "identity")]
    sm = gradpack._native.splitmix64

    def seed(c, step, key, r):
        return gradpack._native.rank_seed(gradpack.Codec(c), sm(5 ^ sm(step) ^ sm(key)), r)

    box = _Mailboxes(world)
    ga = [gradpack.BucketGather(r, world, box.send_of(r), box.recv_of(r), tag=3) for r in range(world)]
    gb = [gradpack.BucketGather(r, world, box.send_of(r), box.recv_of(r), tag=4) for r in range(world)]
    efa = [gradpack.ErrorFeedback("topk:ratio=0.05", 900) for _ in range(world)]
    efb = [gradpack.ErrorFeedback("topk:ratio=0.05", 900) for _ in range(world)]
    rng = np.random.default_rng(1)
    for step in range(3):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        a = [x.copy() for x in xs]
        b = [x.copy() for x in xs]

        def body(r):
            ps = [(s, m, c, 10 + i, efa[r] if i == 0 else None) for i, (s, m, c) in enumerate(parts)]
            ga[r].encode_run(a[r], ps, seed=5, step=step, checksum=True)
            frames = []
            for i, (s, m, c) in enumerate(parts):
                coder = efb[r] if i == 0 else gradpack.Codec(c)
                buf = np.empty(gradpack.Codec(c).max_encoded_len(m, True), np.uint8)
                k = coder.encode_into(xs[r][s : s + m], buf, seed=seed(c, step, 10 + i, r), checksum=True)
                frames.append(buf[:k].tobytes())
            gb[r].run(b"".join(frames), [(s, m) for s, m, _ in parts], b[r])

        assert _on_threads(world, body) == [None] * world
        for r in range(world):
            assert a[r].view(np.uint32).tolist() == b[r].view(np.uint32).tolist()
            assert a[r].view(np.uint32).tolist() == a[0].view(np.uint32).tolist()
            assert (efa[r].residual() == efb[r].residual()).all()
    # A part whose feedback is for another length raises, and the call is still taken.
    g = gradpack.BucketGather(0, 1, box.send_of(0), box.recv_of(0))
    with pytest.raises(gradpack.Error, match="error feedback"):
        g.encode_run(np.zeros(10, np.float32), [(0, 10, "topk:ratio=0.05", 1, efa[0])], seed=0, step=0)
    assert g.calls == 1


def test_bucket_gather_refuses_a_message_that_does_not_fit_the_segments():
    box = _Mailboxes(2, timeout=2.0)
    g = gradpack.BucketGather(0, 2, box.send_of(0), box.recv_of(0))
    f = gradpack.Codec("fp16").encode(np.ones(10, np.float32))
    out = np.zeros(10, np.float32)
    with pytest.raises(gradpack.Error, match="11 elements|not inside"):
        g.run(f, [(0, 11)], out)
    with pytest.raises(gradpack.Error, match="1 frames"):
        g.run(f, [(0, 10), (10, 0)], out)
    assert not out.any() and g.calls == 2


def test_a_send_recv_callable_takes_the_steps_that_send_and_receive_together():
    # The ring with one piece and the all-gather hand each step's send and receive to
    # send_recv when it is given (gloo needs the receive posted first); same bits.
    world, n = 3, 5001
    for strategy, together in [("ring", 2 * (world - 1)), ("allgather", world - 1)]:
        calls = [0] * world

        def make(r, send, recv, use=True):
            def send_recv(msg, to, frm):
                calls[r] += 1
                send(msg, to)
                return recv(frm)

            return gradpack.AllReduce("int8", n, r, world, send, recv, strategy=strategy,
                                      send_recv=send_recv if use else None)

        _, outs, errors = _run_ranks(world, make, 2, n)
        assert errors == [None] * world, errors
        assert calls == [2 * together] * world
        _, plain, errors = _run_ranks(world, lambda r, s, v: make(r, s, v, use=False), 2, n)
        assert errors == [None] * world
        for r in range(world):
            for k in range(2):
                assert outs[r][k].view(np.uint32).tolist() == plain[r][k].view(np.uint32).tolist()
    with pytest.raises(TypeError, match="send_recv must be callable"):
        gradpack.AllReduce("int8", n, 0, 2, print, print, send_recv=3)


def test_a_send_recv_callable_with_size_is_told_the_lengths_of_fixed_rate_messages():
    # A send_recv that takes ``size`` gets the length of the message it receives on every
    # ring step of a fixed-rate codec (and None for top-k, whose
    # lengths depend on the values); one without it is called as before. Same bits.
    world, n = 3, 5001
    for spec, told in [("int8", True), ("fp8", True), ("topk:ratio=0.05", False)]:
        sizes = [[] for _ in range(world)]

        def make(r, send, recv, sized=True):
            def with_size(msg, to, frm, size=None):
                send(msg, to)
                got = recv(frm)
                sizes[r].append((size, len(got)))
                return got

            def without(msg, to, frm):
                send(msg, to)
                return recv(frm)

            return gradpack.AllReduce(spec, n, r, world, send, recv, strategy="ring",
                                      send_recv=with_size if sized else without)

        _, outs, errors = _run_ranks(world, make, 2, n)
        assert errors == [None] * world, errors
        for r in range(world):
            assert len(sizes[r]) == 2 * 2 * (world - 1)
            for size, got in sizes[r]:
                assert size == (got if told else None), (spec, size, got)
        _, plain, errors = _run_ranks(world, lambda r, s, v: make(r, s, v, sized=False), 2, n)
        assert errors == [None] * world
        for r in range(world):
            for k in range(2):
                assert outs[r][k].view(np.uint32).tolist() == plain[r][k].view(np.uint32).tolist()


def test_allreduce_state_dict_continues_bit_for_bit():
    world, n = 3, 4000

    def make(r, send, recv):
        return gradpack.AllReduce("int8", n, r, world, send, recv, strategy="ring", feedback="worker+owner")

    ars, outs, errors = _run_ranks(world, make, 4, n)
    assert errors == [None] * world
    # Again for two steps, save, then restore into fresh all-reduces for the last two.
    box = _Mailboxes(world)
    first = [make(r, box.send_of(r), box.recv_of(r)) for r in range(world)]

    def two(ars_, start):
        res = [[None, None] for _ in range(world)]

        def go(r):
            for s in range(start, start + 2):
                x = np.sin(np.arange(n, dtype=np.float32) * (0.01 * (r + 1)) + s).astype(np.float32)
                res[r][s - start] = ars_[r].run(x, seed=1000 + s) and x

        ts = [threading.Thread(target=go, args=(r,)) for r in range(world)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        return res

    two(first, 0)
    saved = [a.state_dict() for a in first]
    box2 = _Mailboxes(world)
    second = [make(r, box2.send_of(r), box2.recv_of(r)) for r in range(world)]
    for a, st in zip(second, saved):
        a.load_state_dict(st)
    res = two(second, 2)
    for r in range(world):
        for k in range(2):
            assert res[r][k].view(np.uint32).tolist() == outs[r][2 + k].view(np.uint32).tolist()


def test_allreduce_transport_failures_are_errors_naming_the_peer():
    world, n = 3, 1000

    def make(r, send, recv):
        if r == 2:
            def broken(msg, to):
                raise ConnectionError("link down")

            send = broken
        return gradpack.AllReduce("int8", n, r, world, send, recv, strategy="ring")

    _, _, errors = _run_ranks(world, make, 1, n, timeout=2.0)
    assert isinstance(errors[2], gradpack.Error) and "link down" in str(errors[2])
    # The others time out in recv (queue.Empty), reported as a transport error.
    assert all(isinstance(e, gradpack.Error) for e in errors), errors
    with pytest.raises(TypeError, match="send must be callable"):
        gradpack.AllReduce("int8", n, 0, 2, 5, lambda f: b"")
    with pytest.raises(TypeError, match="needs rank, world and the callables send and recv"):
        gradpack.AllReduce("int8", n, 0, 2, None, lambda f: b"")
    with pytest.raises(ValueError, match='strategy "tree"'):
        gradpack.AllReduce("int8", n, 0, 2, print, print, strategy="tree")


def test_a_flushing_framework_changes_no_frame_or_decode():
    # torch.set_flush_denormal(True) sets the thread's flush-to-zero and
    # subnormals-are-zero bits (threads made later inherit them); gradpack computes with
    # subnormals kept whatever the caller set, so frames and decodes are those of the
    # standard mode, and the caller's mode is left as it was.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    n = 4099
    bits = rng.integers(1, 0x007FFFFF, n).astype(np.uint32)  # subnormals
    x = bits.view(np.float32) * np.where(rng.random(n) < 0.5, -1, 1).astype(np.float32)
    x[::3] = rng.standard_normal(n)[::3].astype(np.float32) * np.float32(1e-37)
    x[1::5] = rng.standard_normal(n)[1::5].astype(np.float32)
    acc0 = x[::-1].copy()
    specs = ["identity", "fp16", "bf16", "int8", "qsgd:bits=4,block=64", "sign",
             "natural", "topk:ratio=0.1,values=fp16", "randk:ratio=0.2,values=bf16",
             "dct:chunk=64,k=4"]

    def run():
        out = []
        for s in specs:
            frame = gradpack.encode(x, s, seed=9)
            acc = acc0.copy()
            gradpack.decode_add(frame, acc)
            summed = np.zeros(n, np.float32)
            gradpack.reduce_frames([frame, gradpack.encode(acc0, s, seed=4)], summed)
            ef = gradpack.ErrorFeedback("int8", n)
            fb = [bytes(ef.encode(x, seed=k)) for k in range(2)]
            out.append((bytes(frame), gradpack.decode(frame).view(np.uint32).tobytes(),
                        acc.view(np.uint32).tobytes(), summed.view(np.uint32).tobytes(), fb,
                        ef.residual().view(np.uint32).tobytes()))
        return out

    want = run()
    tiny = np.array([1e-39], np.float32)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert (tiny * np.float32(0.5))[0] == 0.0, "the mode really flushes (numpy too)"
        got = run()
        still = (tiny * np.float32(0.5))[0] == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert still, "the caller's mode was restored"
    for s, w, g in zip(specs, want, got):
        assert w == g, s


def test_a_bad_seed_is_a_clear_error():
    x = np.ones(8, np.float32)
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match="seed must be in 0 .. 2\\*\\*64 - 1"):
            gradpack.encode(x, "int8", seed=bad)
        with pytest.raises(ValueError, match="seed"):
            gradpack.ErrorFeedback("int8", 8).encode(x, seed=bad)
    with pytest.raises(ValueError, match="seed % 2\\*\\*64"):
        gradpack.Codec("int8").encode(x, seed=-5)
    with pytest.raises(ValueError, match="offset"):
        gradpack.encode(x, "int8", offset=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        gradpack.encode(x, "int8", seed=1.5)
    # The largest seed works, and a numpy integer is an int.
    gradpack.encode(x, "int8", seed=(1 << 64) - 1)
    gradpack.encode(x, "int8", seed=np.uint64(7))


def test_python_names_its_own_option_for_non_contractive_codecs():
    with pytest.raises(gradpack.Error) as e:
        gradpack.ErrorFeedback("randk:ratio=0.1,scale=unbiased", 100)
    assert "allow_non_contractive=True" in str(e.value)
    assert "FeedbackOptions" not in str(e.value)
    gradpack.ErrorFeedback("randk:ratio=0.1,scale=unbiased", 100, allow_non_contractive=True)


def test_the_codec_help_names_every_codec():
    doc = gradpack.Codec.__doc__
    for name in ("identity", "fp16", "bf16", "int8", "qsgd", "sign", "ternary", "natural",
                 "topk", "randk", "dct"):
        assert f"'{name}" in doc, name


def test_collectives_sharing_one_shared_memory_give_the_callables_bits():
    # Three ranks on threads, each with one gradpack.SharedMemory (rings and a stage)
    # that an int8 ring, a float32 ring and a two-level all-reduce share, taking turns;
    # the same steps through the callables alone give the same bits.
    world, n, steps = 3, 5_003, 2
    nodes = [0, 0, 1]
    name = "gptest-" + os.urandom(4).hex()

    def turns(shared):
        box = _Mailboxes(world, 20.0)
        outs = [[] for _ in range(world)]

        def rank_main(r):
            kw = {}
            if shared:
                kw["shared_memory"] = gradpack.SharedMemory(
                    name + "-" + shared, r, world, list(range(world)), timeout=20.0,
                    stage=1 << 12,
                )
                assert kw["shared_memory"].host == [0, 1, 2]
                assert kw["shared_memory"].staged
            send, recv = box.send_of(r), box.recv_of(r)
            cols = [
                gradpack.AllReduce("int8", n, r, world, send, recv, strategy="ring",
                                   feedback="worker+owner", tag=1, **kw),
                gradpack.AllReduce("identity", n, r, world, send, recv,
                                   strategy="fp32-ring", tag=2, **kw),
                gradpack.Hierarchical("int8", n, r, world, send, recv, nodes,
                                      strategy="ring", tag=3, **kw),
            ]
            for s in range(steps):
                for k, c in enumerate(cols + cols[:1]):
                    x = np.cos(np.arange(n, dtype=np.float32) * 0.01 * (r + 1) + s + k)
                    out = np.empty(n, np.float32)
                    c.run(x.astype(np.float32), out, seed=500 + s)
                    outs[r].append(out.view(np.uint32).tolist())

        errors = _on_threads(world, rank_main)
        assert errors == [None] * world, errors
        return outs

    want = turns(None)
    assert turns("a") == want
    with pytest.raises(ValueError, match="host"):
        gradpack.AllReduce("int8", n, 0, 1, lambda m, t: None, lambda f: b"",
                           shared_memory=gradpack.SharedMemory(name + "-b", 0, 1, [0]),
                           host=[0])
    with pytest.raises(TypeError, match="shared_memory"):
        gradpack.AllReduce("int8", n, 0, 1, lambda m, t: None, lambda f: b"",
                           shared_memory=3)


class _Store:
    """What :meth:`gradpack.Tcp.from_store` needs of a store (``set``, and a ``get`` that
    waits for the key), shared by the threads of a test's ranks."""

    def __init__(self):
        self.d = {}
        self.c = threading.Condition()

    def set(self, k, v):
        with self.c:
            self.d[k] = v.encode() if isinstance(v, str) else bytes(v)
            self.c.notify_all()

    def get(self, k):
        with self.c:
            if not self.c.wait_for(lambda: k in self.d, timeout=20):
                raise TimeoutError(k)
            return self.d[k]


class _MpiComm:
    """What :meth:`gradpack.Tcp.from_mpi` needs of an mpi4py communicator, for threads."""

    def __init__(self, shared, rank):
        self.shared, self.rank = shared, rank

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.shared["world"]

    def allgather(self, obj):
        s = self.shared
        s["items"][self.rank] = obj
        s["barrier"].wait()
        return list(s["items"])


def _tcps(world, how="store"):
    """A :class:`gradpack.Tcp` per rank on the loopback, made on threads."""
    tcps = [None] * world
    store = _Store()
    shared = {"world": world, "items": [None] * world, "barrier": threading.Barrier(world)}

    def body(r):
        if how == "store":
            tcps[r] = gradpack.Tcp.from_store(store, r, world, key="t", interface="lo",
                                              timeout=20)
        else:
            tcps[r] = gradpack.Tcp.from_mpi(_MpiComm(shared, r), interface="127.0.0.1",
                                            timeout=20)

    assert _on_threads(world, body) == [None] * world
    return tcps


@pytest.mark.parametrize("how", ["store", "mpi"])
def test_collectives_over_the_native_transport_give_the_callables_bits(how):
    # gradpack.Tcp made through a store and through an MPI-style allgather: the ring with
    # both error-feedback sites, the all-gather, the sign vote and the two-level
    # all-reduce give the bits of the same collectives over Python callables, and an
    # agreement passes, every collective sharing one set of connections per rank.
    world, n, steps = 3, 10_001, 3
    tcps = _tcps(world, how)
    assert [t.rank for t in tcps] == [0, 1, 2] and all(t.world == 3 for t in tcps)
    assert all(t.address.startswith("127.0.0.1:") for t in tcps), tcps
    cases = [
        dict(codec="int8", strategy="ring", feedback="worker+owner", pieces=2),
        dict(codec="topk:ratio=0.05,values=fp16", strategy="allgather", feedback="worker"),
        dict(codec="sign", strategy="majority", feedback="worker"),
    ]
    for tag, kw in enumerate(cases):
        _, ref, errors = _run_ranks(
            world, lambda r, send, recv, kw=kw: gradpack.AllReduce(
                kw["codec"], n, r, world, send, recv, tag=tag,
                **{k: v for k, v in kw.items() if k != "codec"}), steps, n)
        assert errors == [None] * world, errors
        ars = [gradpack.AllReduce(kw["codec"], n, transport=tcps[r], tag=tag,
                                  **{k: v for k, v in kw.items() if k != "codec"})
               for r in range(world)]
        outs, errors = _steps_on(ars, steps, n)
        assert errors == [None] * world, errors
        for r in range(world):
            for s in range(steps):
                assert outs[r][s].tobytes() == ref[r][s].tobytes(), (kw, r, s)
    # The two-level all-reduce, nodes {0, 1} and {2}.
    nodes = [0, 0, 1]
    _, ref, errors = _run_ranks(world, lambda r, send, recv: gradpack.Hierarchical(
        "int8", n, r, world, send, recv, nodes, feedback="worker", tag=9), steps, n)
    assert errors == [None] * world, errors
    hs = [gradpack.Hierarchical("int8", n, nodes=nodes, transport=tcps[r], feedback="worker",
                                tag=9) for r in range(world)]
    outs, errors = _steps_on(hs, steps, n)
    assert errors == [None] * world, errors
    assert all(outs[r][s].tobytes() == ref[r][s].tobytes()
               for r in range(world) for s in range(steps))
    errs = _on_threads(world, lambda r: gradpack.agree({"seed": 1}, transport=tcps[r]))
    assert errs == [None] * world, errs
    errs = _on_threads(world, lambda r: gradpack.agree({"seed": r // 2},
                                                       transport=tcps[r], tag=7))
    assert all(isinstance(e, gradpack.Error) and "seed=" in str(e) for e in errs), errs


def test_native_transport_arguments_are_checked():
    (t,) = _tcps(1)
    send, recv = (lambda m, to: None), (lambda frm: b"")
    with pytest.raises(TypeError, match="not both"):
        gradpack.AllReduce("int8", 10, send=send, recv=recv, transport=t)
    with pytest.raises(ValueError, match="rank 1 but the transport's is 0"):
        gradpack.AllReduce("int8", 10, 1, transport=t)
    with pytest.raises(TypeError, match="needs rank, world"):
        gradpack.BucketGather()
    with pytest.raises(TypeError, match="nodes"):
        gradpack.Hierarchical("int8", 10, transport=t)
    with pytest.raises(gradpack.Error, match="no interface"):
        gradpack.Tcp.from_store(_Store(), 0, 1, interface="no-such-if0")
    with pytest.raises(ValueError, match="rank 2 of a world of 2"):
        gradpack.Tcp.from_store(_Store(), 2, 2, interface="lo")
    with pytest.raises(ValueError, match="timeout"):
        gradpack.Tcp.from_store(_Store(), 0, 1, interface="lo", timeout=0)
    # A store entry that is not gradpack's is refused before any connection.
    s = _Store()
    s.set("bad/1", "hello")
    errs = [None]

    def rank0():
        try:
            gradpack.Tcp.from_store(s, 0, 2, key="bad", interface="lo", timeout=5)
        except ValueError as e:
            errs[0] = e

    th = threading.Thread(target=rank0)
    th.start()
    th.join(30)
    assert errs[0] is not None and "not gradpack's" in str(errs[0]), errs
    # A world of one: the collectives run with no connection.
    ar = gradpack.AllReduce("int8", 10, transport=t)
    x = np.ones(10, np.float32)
    ar.run(x)
    assert repr(t).startswith("Tcp(rank=0 of 1")


def test_the_crates_tuner_from_python_measures_decides_saves_and_restarts():
    # gradpack.Tuner is the crate's measured auto (the hook's): float32 first, then the
    # model's best; the fastest time is kept, float32 on a tie; a saved plan restores
    # decided; a restarted plan measures again from float32.
    profiles = [gradpack.CodecProfile(s, 32.0, 4e9, 6e9, 5e9) for s in ("identity", "int8", "fp16")]
    layout = [("fc.weight", [512, 512]), ("fc.bias", [512])]

    def make():
        return gradpack.Tuner(1, profiles, ["int8", "fp16"], bandwidth=1e9, trials=2, trial_steps=1)

    def never(*_):
        raise AssertionError("one rank sends nothing")

    t = make()
    seen, times, failed = [], {}, False
    while len(seen) < 10:
        codec, route, trial = t.next(0, layout)
        if trial is None:
            break
        seen.append((codec, route))
        if len(seen) == 2 and not failed:
            t.restart(trial)  # its reduction failed: measured again from float32
            seen, failed = [], True
            continue
        times[(codec, route)] = 1.0 if route == "fp32" else 0.5
        t.record(trial, times[(codec, route)], 0, 1, never, never)
    assert seen[0] == ("identity", "fp32") and len(seen) == 3
    rows = t.plan()
    assert [r["chosen"] for r in rows].count(True) == 1
    kept = next(r for r in rows if r["chosen"])
    assert kept["measured_ms"] == 0.5e3 and kept["strategy"] != "all-reduce"
    assert kept["codec"] in t.table()
    assert t.choice_of("fc.weight") == (codec, route)
    u = make()
    u.restore(t.save())
    assert u.next(0, layout) == (codec, route, None)
    with pytest.raises(gradpack.Error):
        u.restore(b"GPTU" + bytes(40))
    assert gradpack.tensor_codec("int8", [512]) == "identity"
    assert gradpack.tensor_codec("int8", [512, 512]) == gradpack.Codec("int8").spec


def test_the_package_classes_are_the_native_ones():
    # The Python API is declared once, in the native module: the package re-exports its
    # classes (their docs and the generated stubs are the native ones).
    from gradpack import _native
    for name in ("Codec", "ErrorFeedback", "AllReduce", "BucketGather", "Hierarchical",
                 "OuterSync", "PowerSgdBucket", "HookReducer", "NamedState", "Tuner",
                 "encode", "encode_into", "decode", "decode_into", "decode_add",
                 "reduce_frames", "inspect", "frame_len", "calibrate", "powersgd_matrix"):
        assert getattr(gradpack, name) is getattr(_native, name), name
        assert getattr(gradpack, name).__doc__, name
    import pickle
    c = gradpack.Codec("int8")
    assert pickle.loads(pickle.dumps(c)) == c == gradpack.Codec(c)
    assert {c: 1}[gradpack.Codec("int8:block=256")] == 1
    assert c != gradpack.Codec("fp16") and c != "int8"
    with pytest.raises(TypeError, match="spec string"):
        gradpack.Codec(3)
    # A PowerSGD shape may be a list; one of another length is refused.
    assert len(gradpack.PowerSgdBucket([[4, 3, 2]])) == 12
    with pytest.raises(ValueError, match="n, m, r"):
        gradpack.PowerSgdBucket([[4, 3]])


def _outer_run(world, members, steps, fail_at=None, timeout=20.0):
    """DiLoCo's outer sync (int8 with error feedback, a sync every 3 steps) of the
    members ``members`` of a world of ``world`` on threads (a rank not listed never
    comes: the first sync fails on the others). With ``fail_at``, the members re-form
    over a world of ``len(members)`` when the sync fails and heal. Each member's
    parameters, outer copy and heal result."""
    names, shapes = ["w", "b"], [(30, 20), (30,)]
    start = [np.linspace(-1, 1, 600, dtype=np.float32).reshape(30, 20),
             np.linspace(0, 0.5, 30, dtype=np.float32)]
    box, after = _Mailboxes(world, timeout), _Mailboxes(len(members), timeout)
    out = {}

    def member(r):
        params = [p.copy() for p in start]
        sync = gradpack.OuterSync(names, shapes, params, r, world, box.send_of(r),
                                  box.recv_of(r), sync_every=3, codec="int8",
                                  feedback="worker", strategy="ring")
        heal = None
        for s in range(1, steps + 1):
            for p in params:
                p -= np.float32(0.01) * np.sin(p * (s + 3 * r + 1)).astype(np.float32)
            try:
                sync.step(params)
            except gradpack.Error:
                assert s == fail_at and heal is None, s
                sync.reform(r, len(members), after.send_of(r), after.recv_of(r))
                heal = sync.heal(params)
        out[r] = (params, [sync.outer(i) for i in range(2)], heal)

    errors = _on_threads(len(members), lambda i: member(members[i]))
    assert errors == [None] * len(members), errors
    return out


def test_an_outer_sync_re_formed_after_a_member_left_heals_with_the_bits_of_the_smaller_world():
    # Member 2 of 3 never comes: the first sync fails on 0 and 1, who re-form over a
    # world of two and heal, which runs the sync again. Their states are then those of
    # a world of two from the start, to the bit.
    got = _outer_run(3, [0, 1], 9, fail_at=3, timeout=1.0)
    want = _outer_run(2, [0, 1], 9)
    for r in (0, 1):
        heal = got[r][2]
        assert heal["retried"] == [(0, 2)] and heal["applied"] == 1, heal
        assert heal["healed"] == [] and not heal["was_healed"] and heal["dropped"] == []
        for a, b in zip(got[r][0] + got[r][1], want[r][0] + want[r][1]):
            assert a.tobytes() == b.ravel().tobytes()
    # Steps are refused between re-forming and healing, and a bad heal is refused.
    box = _Mailboxes(1)
    params = [np.zeros((2, 2), np.float32)]
    sync = gradpack.OuterSync(["w"], [(2, 2)], params, 0, 1, box.send_of(0), box.recv_of(0))
    sync.reform(0, 1, box.send_of(0), box.recv_of(0))
    with pytest.raises(gradpack.Error, match="heal"):
        sync.step(params)
    with pytest.raises((ValueError, gradpack.Error)):
        sync.heal([np.zeros(3, np.float32)])
    assert sync.heal(params)["source"] == 0
    sync.step(params)
