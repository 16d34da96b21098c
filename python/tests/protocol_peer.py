"""An independent rank of gradpack's collective protocol, written from section 6 of
docs/wire-format.md alone.

It shares no code with the crate beyond the frame codec (``gradpack.encode``,
``decode`` and ``decode_add``, sections 1 to 3): the envelope and its CRC-32C, the
chunks and pieces, the message schedule, the seeds, the error feedback, the sums, the
majority vote, the mean, and the receiver's checks are all here, in plain Python and
numpy. test_protocol_peer.py runs it as one or two ranks of worlds whose other ranks
are gradpack's own (``gradpack.AllReduce``, and for section 6.9 ``BucketPeer`` among
``gradpack.BucketGather`` ranks) and checks every output bit for bit.
"""

import struct
from collections import deque
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import gradpack

# ---------------------------------------------------------------------- checksums


def _crc32c_table() -> List[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli), reflected, initial value and final XOR 0xFFFFFFFF;
    ``crc`` continues a previous value."""
    c = crc ^ 0xFFFFFFFF
    t = _CRC32C
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283

# ---------------------------------------------------------------------- numbers

_M64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def chunk_range(n: int, p: int, c: int) -> Tuple[int, int]:
    q, m = divmod(n, p)
    start = c * q + min(c, m)
    return start, start + q + (1 if c < m else 0)


# ---------------------------------------------------------------------- envelope

MAGIC = b"GPKE"
VERSION = 2
PHASES = ("reduce-scatter", "ring all-gather", "frame all-gather")


class ProtocolError(Exception):
    """A message or frame that section 6 says to reject."""


def envelope(sender: int, call: int, tag: int, hop: int, chunk: int, phase: int, frame: bytes) -> bytes:
    head = MAGIC + struct.pack("<IQIIIB", sender, call, tag, hop, chunk, phase) + bytes([VERSION, 0, 0])
    assert len(head) == 32
    return head + struct.pack("<I", crc32c(frame, crc32c(head))) + frame


def parse(msg: bytes) -> Tuple[Tuple[int, int, int, int, int, int], bytes]:
    """((sender, call, tag, hop, chunk, phase), frame), or ProtocolError."""
    if len(msg) < 36:
        raise ProtocolError(f"message of {len(msg)} bytes")
    if msg[:4] != MAGIC or msg[30:32] != b"\0\0":
        raise ProtocolError("bad magic or reserved bytes")
    if msg[29] != VERSION:
        raise ProtocolError(f"envelope version {msg[29]}")
    (stored,) = struct.unpack_from("<I", msg, 32)
    if stored != crc32c(msg[36:], crc32c(msg[:32])):
        raise ProtocolError("envelope CRC-32C")
    fields = struct.unpack_from("<IQIIIB", msg, 4)
    return fields, bytes(msg[36:])


# ---------------------------------------------------------------------- the rank


class Endpoint:
    """A rank's messages (sections 6.1 and 6.6): envelopes out, the expected place in,
    stale messages dropped and early ones kept."""

    def __init__(self, rank: int, world: int, send: Callable[[bytes, int], None],
                 recv: Callable[[int], bytes], tag: int) -> None:
        self.rank, self.world, self.send, self.recv, self.tag = rank, world, send, recv, tag
        self.calls = 0
        self.early: Dict[int, deque] = {q: deque() for q in range(world)}

    def post(self, to: int, call: int, hop: int, chunk: int, phase: int, frame: bytes) -> None:
        self.send(envelope(self.rank, call, self.tag, hop, chunk, phase, frame), to)

    def expect(self, frm: int, call: int, hop: int, chunk: int, phase: int) -> bytes:
        while True:
            msg = self.early[frm].popleft() if self.early[frm] else self.recv(frm)
            (sender, c, tag, h, ch, ph), frame = parse(msg)
            if sender != frm:
                raise ProtocolError(f"message from {frm} names sender {sender}")
            if (c, h) < (call, hop):
                continue  # stale
            if (c, h) > (call, hop):
                self.early[frm].appendleft(msg)
                raise ProtocolError(f"rank {frm} is at call {c} hop {h}")
            if (tag, ph, ch) != (self.tag, phase, chunk):
                raise ProtocolError(f"tag/phase/chunk {(tag, ph, ch)}, expected {(self.tag, phase, chunk)}")
            return frame


def frames_of(msg: bytes, lengths: List[int]) -> List[bytes]:
    """Section 6.9: a message split into whole frames of these element counts, or
    ProtocolError."""
    frames, at = [], 0
    for i, n in enumerate(lengths):
        if len(msg) - at < 56:
            raise ProtocolError(f"{i} frames where the bucket has {len(lengths)}")
        flags, elements, payload_len = struct.unpack_from("<HQQ", msg, at + 6)
        end = at + 56 + payload_len + (4 if flags & 2 else 0)
        if end > len(msg) or elements != n:
            raise ProtocolError(f"frame {i}: {elements} elements, {end - at} bytes")
        frames.append(bytes(msg[at:end]))
        at = end
    if at != len(msg):
        raise ProtocolError(f"{len(msg) - at} bytes after the last frame")
    return frames


class BucketPeer(Endpoint):
    """One rank of the bucket all-gather (section 6.9)."""

    def __init__(self, rank: int, world: int, send: Callable[[bytes, int], None],
                 recv: Callable[[int], bytes], op: str = "mean", tag: int = 0) -> None:
        super().__init__(rank, world, send, recv, tag)
        self.op = op

    def run(self, message: bytes, segments: List[Tuple[int, int]], out: np.ndarray) -> None:
        call = self.calls
        self.calls += 1
        p, r = self.world, self.rank
        lengths = [m for _, m in segments]
        msgs = {r: bytes(message)}
        split = {r: frames_of(msgs[r], lengths)}
        for s in range(p - 1):
            sq, rq = (r - s) % p, (r - s - 1) % p
            self.post((r + 1) % p, call, s, sq, 2, msgs[sq])
            msgs[rq] = self.expect((r - 1) % p, call, s, rq, 2)
            split[rq] = frames_of(msgs[rq], lengths)
        for i, (a, m) in enumerate(segments):
            seg = out[a : a + m]
            seg[:] = gradpack.decode(split[0][i])
            for q in range(1, p):
                gradpack.decode_add(split[q][i], seg)
            if self.op == "mean" and p > 1:
                seg /= np.float32(p)


class Peer(Endpoint):
    """One rank of the all-reduce (section 6.3), over ``send(msg: bytes, to)`` and
    ``recv(frm) -> bytes``."""

    def __init__(
        self,
        codec: str,
        n: int,
        rank: int,
        world: int,
        send: Callable[[bytes, int], None],
        recv: Callable[[int], bytes],
        strategy: str,
        op: str = "mean",
        feedback: str = "none",
        pieces: int = 1,
        checksum: bool = True,
        tag: int = 0,
        beta: float = 1.0,
        gamma: float = 1.0,
    ) -> None:
        assert strategy in ("ring", "fp32-ring", "allgather", "majority", "twoshot")
        if strategy == "fp32-ring":
            codec, feedback = "identity", "none"
        super().__init__(rank, world, send, recv, tag)
        self.codec, self.n = codec, n
        self.strategy, self.op, self.feedback = strategy, op, feedback
        self.k = pieces if strategy in ("ring", "fp32-ring", "twoshot") else 1
        self.checksum = checksum
        self.beta, self.gamma = np.float32(beta), np.float32(gamma)
        self.residual: Dict[object, np.ndarray] = {}
        # The codec's id byte, from a frame of its own (section 1, byte 5).
        self.codec_id = gradpack.encode(np.zeros(0, np.float32), codec)[5]
        self.randk = codec.split(":")[0] == "randk"

    # -- seeds, pieces, encoding

    def rank_seed(self, seed: int, q: int) -> int:
        return seed if self.randk else splitmix64(seed ^ splitmix64(q + 1))

    def piece(self, c: int, j: int) -> Tuple[int, int]:
        a, b = chunk_range(self.n, self.world, c)
        s, e = chunk_range(b - a, self.k, j)
        return a + s, a + e

    def fed(self, site: object, own: bool) -> bool:
        if self.feedback == "none":
            return False
        return not own or self.feedback == "worker+owner"

    def encode(self, y: np.ndarray, seed: int, offset: int, site: object, fed: bool) -> bytes:
        if not fed:
            return gradpack.encode(y, self.codec, seed=seed, offset=offset, checksum=self.checksum)
        e = self.residual.get(site)
        if e is None:
            e = np.zeros(y.size, np.float32)
        v = self.beta * e + self.gamma * y  # two products, then their sum, in f32
        frame = gradpack.encode(v, self.codec, seed=seed, offset=offset, checksum=self.checksum)
        d = gradpack.decode(frame)
        with np.errstate(invalid="ignore", over="ignore"):
            r = v - d
        bad = ~np.isfinite(r)
        r[bad] = np.where(np.isfinite(v[bad]), v[bad], np.float32(0))
        self.residual[site] = r.astype(np.float32)
        return frame

    # -- messages

    def check(self, frame: bytes, start: int, end: int, encoder: int, seed: int) -> None:
        """Section 6.4 (the frame's own validity is the decoder's)."""
        if len(frame) < 56 or frame[:4] != b"GPAK":
            raise ProtocolError("not a frame")
        elements, _, fseed, offset = struct.unpack_from("<QQQQ", frame, 8)
        if frame[5] != self.codec_id:
            raise ProtocolError(f"codec {frame[5]}")
        if (offset, elements) != (start, end - start):
            raise ProtocolError(f"frame at {offset} of {elements}, expected {start} of {end - start}")
        if fseed != 0 and fseed != self.rank_seed(seed, encoder):
            raise ProtocolError(f"seed of rank {encoder}")

    # -- the call

    def run(self, x: np.ndarray, seed: int) -> np.ndarray:
        call = self.calls
        self.calls += 1
        x = np.ascontiguousarray(x, np.float32)
        assert x.size == self.n
        out = np.zeros(self.n, np.float32)
        if self.strategy in ("ring", "fp32-ring"):
            self.ring(x, out, seed, call)
        elif self.strategy == "twoshot":
            self.two_shot(x, out, seed, call)
        else:
            self.gather(x, out, seed, call)
        if self.op == "mean" and self.world > 1:
            out /= np.float32(self.world)
        return out

    def ring(self, x: np.ndarray, out: np.ndarray, seed: int, call: int) -> None:
        p, r, k = self.world, self.rank, self.k
        right, left = (r + 1) % p, (r - 1) % p
        mine = self.rank_seed(seed, r)
        for s in range(p - 1):
            cs, cr = (r - s - 1) % p, (r - s - 2) % p

            def post(j: int) -> None:
                a, b = self.piece(cs, j)
                src = x if s == 0 else out
                site = cs * k + j
                frame = self.encode(src[a:b].copy(), mine, a, site, self.fed(site, False))
                self.post(right, call, s * k + j, cs * k + j, 0, frame)

            post(0)
            for j in range(k):
                if j + 1 < k:
                    post(j + 1)
                frame = self.expect(left, call, s * k + j, cr * k + j, 0)
                a, b = self.piece(cr, j)
                self.check(frame, a, b, left, seed)
                out[a:b] = x[a:b]
                gradpack.decode_add(frame, out[a:b])
        fwd = []
        for j in range(k):
            a, b = self.piece(r, j)
            src = x if p == 1 else out
            site = r * k + j
            frame = self.encode(src[a:b].copy(), mine, a, site, self.fed(site, True))
            out[a:b] = gradpack.decode(frame)
            fwd.append(frame)
        for s in range(p - 1):
            cs, cr = (r - s) % p, (r - s - 1) % p
            nxt: List[Optional[bytes]] = [None] * k

            def fw(j: int) -> None:
                self.post(right, call, (p - 1 + s) * k + j, cs * k + j, 1, fwd[j])

            fw(0)
            for j in range(k):
                if j + 1 < k:
                    fw(j + 1)
                frame = self.expect(left, call, (p - 1 + s) * k + j, cr * k + j, 1)
                a, b = self.piece(cr, j)
                self.check(frame, a, b, cr, seed)  # the chunk's owner encoded it
                out[a:b] = gradpack.decode(frame)
                nxt[j] = frame
            fwd = nxt  # type: ignore[assignment]

    def two_shot(self, x: np.ndarray, out: np.ndarray, seed: int, call: int) -> None:
        p, r, k = self.world, self.rank, self.k
        mine = self.rank_seed(seed, r)
        others = [q for q in range(p) if q != r]
        for j in range(k):  # 1. scatter: every piece to its owner before any receive
            for s in range(1, p):
                c = (r + s) % p
                a, b = self.piece(c, j)
                site = c * k + j
                frame = self.encode(x[a:b].copy(), mine, a, site, self.fed(site, False))
                self.post(c, call, j, c * k + j, 6, frame)
        for j in range(k):  # 2. the owner's sum, re-encoded once and sent to every rank
            a, b = self.piece(r, j)
            got = []
            for q in others:
                frame = self.expect(q, call, j, r * k + j, 6)
                self.check(frame, a, b, q, seed)
                got.append(frame)
            out[a:b] = x[a:b]
            for frame in got:
                gradpack.decode_add(frame, out[a:b])
            site = r * k + j
            frame = self.encode(out[a:b].copy(), mine, a, site, self.fed(site, True))
            for s in range(1, p):
                self.post((r + s) % p, call, k + j, r * k + j, 7, frame)
            out[a:b] = gradpack.decode(frame)
        for j in range(k):  # 3. every owner's frame decoded into place
            for q in others:
                a, b = self.piece(q, j)
                frame = self.expect(q, call, k + j, q * k + j, 7)
                self.check(frame, a, b, q, seed)
                out[a:b] = gradpack.decode(frame)

    def gather(self, x: np.ndarray, out: np.ndarray, seed: int, call: int) -> None:
        p, r, n = self.world, self.rank, self.n
        right, left = (r + 1) % p, (r - 1) % p
        frames = {r: self.encode(x.copy(), self.rank_seed(seed, r), 0, "whole", self.fed("whole", False))}
        for s in range(p - 1):
            sq, rq = (r - s) % p, (r - s - 1) % p
            self.post(right, call, s, sq, 2, frames[sq])
            frame = self.expect(left, call, s, rq, 2)
            self.check(frame, 0, n, rq, seed)
            frames[rq] = frame
        if self.strategy == "allgather":
            out[:] = gradpack.decode(frames[0])
            for q in range(1, p):
                gradpack.decode_add(frames[q], out)
            return
        votes = np.zeros(n, np.int64)
        m = np.zeros(n, np.float32)
        for q in range(p):
            d = gradpack.decode(frames[q])
            votes += (d > 0).astype(np.int64) - (d < 0).astype(np.int64)
            m = m + np.abs(d)
        with np.errstate(invalid="ignore"):
            out[:] = np.where(votes > 0, m, np.where(votes < 0, -m, m * np.float32(0)))
