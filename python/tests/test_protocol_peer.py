"""A second implementation of the collective protocol (protocol_peer.py, written from
the spec alone) takes part in worlds of gradpack ranks: one peer among 3 ranks, two
among 4, over in-process mailboxes. Ring (with pieces, error feedback at the workers and
owners, empty chunks), the frame all-gather, the sign majority vote and the fp32 ring;
three calls each (so residuals carry over); every rank's output equals, bit for bit,
that of a world of gradpack ranks only. And the peer's checks catch what the spec says
to reject."""

import os
import queue
import sys
import threading

import numpy as np
import pytest

import gradpack

sys.path.insert(0, os.path.dirname(__file__))
import protocol_peer as pp  # noqa: E402

CASES = [
    # codec, strategy, feedback, pieces, op
    ("int8", "ring", "worker+owner", 1, "mean"),
    ("int8:rounding=stochastic", "ring", "worker", 2, "sum"),
    ("fp16", "ring", "none", 3, "mean"),
    ("topk:ratio=0.1,values=fp16", "ring", "worker+owner", 1, "sum"),
    ("qsgd:bits=8,block=64", "ring", "none", 1, "mean"),
    ("dct:chunk=16,k=3", "ring", "none", 2, "mean"),
    ("fp16", "allgather", "worker", 1, "mean"),
    ("topk:ratio=0.1,values=fp16", "allgather", "worker", 1, "sum"),
    ("randk:ratio=0.3,values=f32", "allgather", "none", 1, "mean"),
    ("natural", "allgather", "none", 1, "sum"),
    ("sign", "majority", "worker", 1, "mean"),
    ("identity", "fp32-ring", "none", 2, "sum"),
    ("int8", "twoshot", "worker+owner", 1, "mean"),
    ("fp8", "twoshot", "worker", 2, "sum"),
    ("topk:ratio=0.1,values=fp16", "twoshot", "none", 3, "mean"),
]


def on_ranks(world, body):
    """``body(r, send, recv)`` on a thread per rank over in-process mailboxes; each
    rank's result, after asserting that none raised."""
    boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
    results = [None] * world
    errors = []

    def rank_main(r):
        try:
            def send(msg, to):
                boxes[(r, to)].put(bytes(msg))

            def recv(frm):
                return boxes[(frm, r)].get(timeout=30)

            results[r] = body(r, send, recv)
        except BaseException as e:  # reported by the test
            errors.append((r, repr(e)))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def world_run(case, n, world, peers, steps=3):
    """Outputs per rank and step; ranks in ``peers`` are protocol_peer.Peer."""
    codec, strategy, feedback, pieces, op = case

    def body(r, send, recv):
        kw = dict(strategy=strategy, op=op, feedback=feedback, pieces=pieces, tag=5)
        if r in peers:
            ar = pp.Peer(codec, n, r, world, send, recv, **kw)
        else:
            ar = gradpack.AllReduce(codec, n, r, world, send, recv, **kw)
        rng = np.random.default_rng(100 + r)
        outs = []
        for step in range(steps):
            x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
            if r in peers:
                out = ar.run(x, seed=1000 + step)
            else:
                out = np.empty(n, np.float32)
                ar.run(x, out, seed=1000 + step)
            outs.append(out.view(np.uint32).copy())
        return outs

    return on_ranks(world, body)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-k{c[3]}")
@pytest.mark.parametrize("world,peers", [(3, {1}), (4, {0, 2})])
def test_an_independent_peer_gives_the_same_bits(case, world, peers):
    for n in (1001, 2):  # 2: fewer elements than ranks, so some chunks are empty
        want = world_run(case, n, world, set())
        got = world_run(case, n, world, peers)
        for r in range(world):
            for step in range(3):
                assert np.array_equal(want[r][step], got[r][step]), (r, step, n)
        for r in range(1, world):
            assert all(np.array_equal(got[0][s], got[r][s]) for s in range(3))


def test_the_peer_rejects_what_the_spec_rejects():
    frame = gradpack.encode(np.ones(4, np.float32), "int8")
    msg = pp.envelope(1, 7, 0, 2, 3, 0, frame)
    assert pp.parse(msg)[0] == (1, 7, 0, 2, 3, 0)
    for at in (0, 20, 29, 33, 40, len(msg) - 1):
        bad = bytearray(msg)
        bad[at] ^= 1
        with pytest.raises(pp.ProtocolError):
            pp.parse(bytes(bad))
    # The envelope binds the frame: another frame behind the same envelope fails.
    other = gradpack.encode(np.full(4, 2, np.float32), "int8")
    with pytest.raises(pp.ProtocolError, match="CRC"):
        pp.parse(msg[:36] + other)


BUCKET = [  # (start, length, codec, sealed): gaps between, an empty tensor, a sparse one
    (2, 700, "int8", True),
    (705, 0, "fp16", False),
    (710, 333, "topk:ratio=0.1,values=fp16", False),
    (1050, 9, "identity", True),
    (1060, 1500, "fp8", True),
]


def bucket_run(world, peers, op, steps=3, n=2600):
    """Outputs per rank and step of the bucket all-gather (section 6.9); ranks in
    ``peers`` are protocol_peer.BucketPeer."""
    segments = [(a, m) for a, m, _, _ in BUCKET]

    def body(r, send, recv):
        if r in peers:
            g = pp.BucketPeer(r, world, send, recv, op=op, tag=9)
        else:
            g = gradpack.BucketGather(r, world, send, recv, op=op, tag=9)
        rng = np.random.default_rng(300 + r)
        outs = []
        for step in range(steps):
            x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
            msg = b"".join(
                gradpack.encode(x[a : a + m], c, seed=step * 31 + r, checksum=sealed)
                for a, m, c, sealed in BUCKET
            )
            out = np.full(n, 7.5, np.float32)
            g.run(msg, segments, out)
            outs.append(out.view(np.uint32).copy())
        return outs

    return on_ranks(world, body)


@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("world,peers", [(2, {0}), (3, {1}), (4, {0, 2})])
def test_an_independent_peer_joins_the_bucket_all_gather(world, peers, op):
    want = bucket_run(world, set(), op)
    got = bucket_run(world, peers, op)
    for r in range(world):
        for step in range(3):
            assert np.array_equal(want[r][step], got[r][step]), (r, step)
            assert np.array_equal(got[0][step], got[r][step])
    # Outside the segments nothing was written.
    assert got[0][0].view(np.float32)[0] == np.float32(7.5)


def test_the_bucket_peer_rejects_messages_that_do_not_fit():
    f = gradpack.encode(np.ones(5, np.float32), "fp16", checksum=True)
    assert len(pp.frames_of(f + f, [5, 5])) == 2
    for msg, lengths in [(f, [5, 5]), (f + f, [5]), (f, [4]), (f[:-1], [5])]:
        with pytest.raises(pp.ProtocolError):
            pp.frames_of(msg, lengths)
