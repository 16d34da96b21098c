#!/usr/bin/env python3
"""An independent decoder of gradpack wire format v1, written from docs/wire-format.md
alone (no Rust code consulted), run against the golden vectors.

It checks that the specification is complete: every golden frame in tests/vectors must
decode to the stored output (bit for bit, NaNs included), and corrupted copies
must be rejected where the spec says so. Pure standard library (zlib's CRC-32 is a
second implementation of the header checksum).

Usage: python3 tests/spec_decoder.py            (exit 0 on success)
"""

import math
import os
import struct
import sys
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
VECTORS = os.path.join(HERE, "vectors")
M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


class Reject(Exception):
    pass


# ---------------------------------------------------------------- f32 helpers (spec 1)

def f32_bits(x):
    """Round a Python float to the nearest f32 (single rounding) and return its bits."""
    if math.isnan(x):
        return 0x7FC00000
    if math.isinf(x):
        return 0x7F800000 | (0x80000000 if x < 0 else 0)
    try:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:  # rounds beyond f32::MAX
        return 0x7F800000 | (0x80000000 if x < 0 else 0)


def bits_f32(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def is_nan(b):
    return (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF) != 0


def f16_to_f32_bits(h):  # spec 3.2
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0x1F:
        return sign | 0x7F800000 | ((0x400000 | (man << 13)) if man else 0)
    if exp == 0:
        return f32_bits(math.ldexp(man, -24) * (-1 if sign else 1)) if man else sign
    return sign | ((exp - 15 + 127) << 23) | (man << 13)


def step_bits(p, at, nb):
    """The `nb` f32 steps (spec 2.1) starting at payload byte `at`, as bits; ±Inf is
    rejected."""
    steps = list(struct.unpack_from("<%dI" % nb, p, at))
    if any(s & 0x7FFFFFFF == 0x7F800000 for s in steps):
        raise Reject("infinite step")
    return steps


def times_step(code, s):
    """`code * step` in f32 (spec 2.1): a NaN step gives its own bits, quieted."""
    if is_nan(s):
        return s | 0x00400000
    return f32_bits(code * bits_f32(s))


def value_section(vt, k):
    """Bytes of k sparse values (spec 3.9): int8 adds an f32 step per 256 values."""
    return [4 * k, 2 * k, 2 * k, k + 4 * (-(-k // 256))][vt]


def value_bits(p, vt, j, k):
    """Value j of k in a sparse payload (spec 3.9): f32, f16 (3.2), bf16 (3.3), or int8
    with a step per block of 256 values (as 3.4)."""
    if vt == 0:
        return struct.unpack_from("<I", p, 4 * j)[0]
    if vt == 3:
        step = step_bits(p, 4 * (j // 256), 1)[0]
        code = struct.unpack_from("<b", p, 4 * (-(-k // 256)) + j)[0]
        return times_step(code, step)
    h, = struct.unpack_from("<H", p, 2 * j)
    return f16_to_f32_bits(h) if vt == 1 else h << 16


# ---------------------------------------------------------------- spec 2.2, 2.3

def stream_value(buf, start, j, w):
    """Value j of width w of the LSB-first bit stream starting at byte `start`."""
    v = 0
    for k in range(w):
        s = j * w + k
        v |= ((buf[start + s // 8] >> (s % 8)) & 1) << k
    return v


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def lowbias32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def draw(seed, stream, g):
    lo, hi = g & M32, g >> 32
    key = splitmix64(seed ^ stream ^ ((hi * 0x9E3779B97F4A7C15) & M64)) & M32
    return lowbias32(lo ^ key)


SELECT = 0xD1B54A32D192ED03
STRATA = 0x6A09E667F3BCC909


# ---------------------------------------------------------------- decoder

def decode(frame):
    """Return (elements, list of f32 bit patterns, flags) or raise Reject."""
    if len(frame) < 5 or frame[0:4] != b"GPAK":
        raise Reject("magic")
    if frame[4] != 1:
        raise Reject("version")
    if len(frame) < 56:
        raise Reject("truncated header")
    if zlib.crc32(frame[0:52]) != struct.unpack_from("<I", frame, 52)[0]:
        raise Reject("header crc")
    codec = frame[5]
    flags, = struct.unpack_from("<H", frame, 6)
    n, plen, seed, offset = struct.unpack_from("<QQQQ", frame, 8)
    params = frame[40:52]
    if codec > 15:
        raise Reject("codec id")
    if flags & ~7:
        raise Reject("reserved flags")
    if offset + n > M64:
        raise Reject("offset overflow")
    trailer = 4 if flags & 2 else 0
    if len(frame) != 56 + plen + trailer:
        raise Reject("frame length")
    p = frame[56:56 + plen]
    if trailer and zlib.crc32(p) != struct.unpack_from("<I", frame, 56 + plen)[0]:
        raise Reject("payload crc")

    def zero_from(k, to=12):
        if any(params[k:to]):
            raise Reject("unused params")

    def scale_rule(e8m0):  # byte 11 (3.12, 3.13): 0 rceil, 1 ocp with an E8M0 scale
        if params[11] not in ((0, 1) if e8m0 else (0,)):
            raise Reject("scale_rule")

    def want_len(L):
        if plen != L:
            raise Reject("payload length")

    def block():
        b, = struct.unpack_from("<I", params, 0)
        if not 1 <= b <= 1 << 24:
            raise Reject("block")
        return b

    def padding(start, count, w):
        used = count * w % 8
        if used and (p[start + (count * w + 7) // 8 - 1] >> used):
            raise Reject("padding")

    if flags & 4:  # the entropy stage (spec 3.17): undo it, then read the frame as usual
        p, plen = unstage(codec, params, block(), n, p, plen)

    out = [0] * n
    if codec == 0:  # identity
        zero_from(0)
        if seed:
            raise Reject("seed")
        want_len(4 * n)
        out = [struct.unpack_from("<I", p, 4 * i)[0] for i in range(n)]
    elif codec in (1, 2):  # fp16, bf16
        zero_from(0)
        if seed:
            raise Reject("seed")
        want_len(2 * n)
        for i in range(n):
            h, = struct.unpack_from("<H", p, 2 * i)
            out[i] = f16_to_f32_bits(h) if codec == 1 else h << 16
    elif codec == 3:  # int8
        b = block()
        if params[4] not in (0, 1):
            raise Reject("rounding")
        zero_from(5)
        if params[4] == 0 and seed:
            raise Reject("seed")
        nb = -(-n // b)
        want_len(4 * nb + n)
        steps = step_bits(p, 0, nb)
        for i in range(n):
            code = struct.unpack_from("<b", p, 4 * nb + i)[0]
            out[i] = times_step(code, steps[i // b])
    elif codec in (4, 6):  # qsgd, ternary
        b = block()
        bits = params[4] if codec == 4 else 2
        if codec == 4:
            if bits not in (2, 4, 8):
                raise Reject("bits")
            zero_from(5)
        else:
            zero_from(4)
        nb = -(-n // b)
        want_len(4 * nb + (n * bits + 7) // 8)
        padding(4 * nb, n, bits)
        steps = step_bits(p, 0, nb)
        for i in range(n):
            c = stream_value(p, 4 * nb, i, bits)
            level = c & ((1 << (bits - 1)) - 1)
            v = times_step(level, steps[i // b])
            out[i] = v ^ 0x80000000 if c >> (bits - 1) else v
    elif codec == 5:  # sign
        b = block()
        zero_from(4)
        if seed:
            raise Reject("seed")
        nb = -(-n // b)
        want_len(4 * nb + (n + 7) // 8)
        padding(4 * nb, n, 1)
        steps = step_bits(p, 0, nb)
        for i in range(n):
            s = steps[i // b]
            out[i] = s ^ 0x80000000 if stream_value(p, 4 * nb, i, 1) else s
    elif codec == 7:  # natural
        b = block()
        zero_from(4)
        nb = -(-n // b)
        want_len(nb + n)
        for R in p[:nb]:
            if R < 104 and R != 255:
                raise Reject("reference byte")
        for i in range(n):
            R = p[i // b]
            c = p[nb + i]
            if R == 255:
                out[i] = 0x7FC00000
                continue
            m = c & 0x7F
            v = f32_bits(math.ldexp(1.0, R - 127 - 127 + m)) if m else 0
            out[i] = v | (0x80000000 if c & 0x80 else 0)
    elif codec == 11:  # fp8 (spec 3.12)
        b = block()
        fmt, scale, rnd = params[4], params[5], params[6]
        if fmt not in (0, 1) or scale not in (0, 1, 2) or rnd not in (0, 1):
            raise Reject("fp8 params")
        if scale == 2 and b != 1:
            raise Reject("block")
        zero_from(7, 11)
        scale_rule(scale == 1)
        if rnd == 0 and seed:
            raise Reject("seed")
        nb = -(-n // b)
        sb = (4, 1, 0)[scale]
        want_len(sb * nb + n)
        mb, bias = (3, 7) if fmt == 0 else (2, 15)

        def fp8_bits(c):  # the code's value as f32 bits (spec 3.12)
            sign = 0x80000000 if c & 0x80 else 0
            e, f = (c & 0x7F) >> mb, c & ((1 << mb) - 1)
            if (fmt == 0 and c & 0x7F == 0x7F) or (fmt == 1 and e == 31 and f):
                return sign | 0x7FC00000
            if fmt == 1 and e == 31:
                return sign | 0x7F800000
            if e == 0:
                v = math.ldexp(f, 1 - bias - mb)
            else:
                v = math.ldexp((1 << mb) + f, e - bias - mb)
            return sign | f32_bits(v)

        scales = []
        for k in range(nb):
            if scale == 0:
                s, = struct.unpack_from("<I", p, 4 * k)
                if s >> 31 or s == 0x7F800000:
                    raise Reject("fp8 scale")
            elif scale == 1:
                s = 0x7FC00000 if p[k] == 0xFF else f32_bits(math.ldexp(1.0, p[k] - 127))
            else:
                s = None
            scales.append(s)
        codes = p[sb * nb:]
        if scale != 2:
            for c in codes:
                if (fmt == 0 and c & 0x7F == 0x7F) or (fmt == 1 and c & 0x7C == 0x7C):
                    raise Reject("special code in a scaled fp8 frame")
        for i in range(n):
            v = fp8_bits(codes[i])
            s = scales[i // b]
            if s is None:
                out[i] = v
            elif is_nan(s):
                out[i] = s | 0x00400000
            else:
                out[i] = f32_bits(bits_f32(v) * bits_f32(s))
    elif codec == 12:  # fp4 (spec 3.13)
        b = block()
        fmt, scale, rnd = params[4], params[5], params[6]
        if fmt not in (0, 1) or scale not in (0, 1, 2) or rnd not in (0, 1) or b % 2:
            raise Reject("fp4 params")
        if scale == 2:
            g, = struct.unpack_from("<I", bytes(params), 7)
            gf = bits_f32(g)
            if is_nan(g) or gf < 2.0 ** -126 or math.isinf(bits_f32(f32_bits(448.0 * gf))):
                raise Reject("fp4 frame scale")
        else:
            zero_from(7, 11)
        scale_rule(scale == 0)
        if rnd == 0 and seed:
            raise Reject("seed")
        nb = -(-n // b)
        sb = (1, 4, 1)[scale]
        want_len(sb * nb + (n + 1) // 2)
        padding(sb * nb, n, 4)
        mb, bias = (1, 1) if fmt == 0 else (0, 3)
        scales = []
        for k in range(nb):
            if scale == 1:
                s, = struct.unpack_from("<I", p, 4 * k)
                if s >> 31 or s == 0x7F800000:
                    raise Reject("fp4 scale")
            elif scale == 2:  # E4M3 (3.12's value) times the frame scale
                v = p[k]
                if v & 0x80:
                    raise Reject("fp4 E4M3 scale")
                if v == 0x7F:
                    s = 0x7FC00000
                else:
                    e, f = v >> 3, v & 7
                    val = math.ldexp(f, -9) if e == 0 else math.ldexp(8 + f, e - 10)
                    s = f32_bits(val * gf)
            else:
                s = 0x7FC00000 if p[k] == 0xFF else f32_bits(math.ldexp(1.0, p[k] - 127))
            scales.append(s)
        for i in range(n):
            c = stream_value(p, sb * nb, i, 4)
            e, f = (c & 7) >> mb, c & ((1 << mb) - 1)
            v = math.ldexp(f, 1 - bias - mb) if e == 0 else math.ldexp((1 << mb) + f, e - bias - mb)
            s = scales[i // b]
            if is_nan(s):
                out[i] = s | 0x00400000
            else:
                out[i] = f32_bits((-v if c & 8 else v) * bits_f32(s))
    elif codec == 13:  # codebook (spec 3.14)
        b = block()
        zero_from(4)
        if seed:
            raise Reject("seed")
        nb = -(-n // b)
        want_len(1024 * nb + n)
        books = step_bits(p, 0, 256 * nb)  # f32 entries; ±Inf rejected as for steps
        for i in range(n):
            out[i] = books[256 * (i // b) + p[1024 * nb + i]]  # the entry's bits
    elif codec == 14:  # chunktopk (spec 3.15)
        out = chunktopk_decode(p, params, n, seed, flags)
    elif codec == 15:  # lossless (spec 3.16)
        dtype, zeros = params[0], params[1]
        if dtype > 2:
            raise Reject("lossless dtype")
        if zeros > 1:
            raise Reject("lossless zeros flag")
        zero_from(2)
        if seed:
            raise Reject("seed")
        exps, at, alphabet = entropy_block(p, n, 1)
        if dtype == 2 and any(e > 31 for e in alphabet):
            raise Reject("fp16 exponent above 31")
        # Plane entry of each element (None: +0.0, the zero symbol, no entry).
        entry, m = list(range(n)), n
        if zeros:
            if plen < at + 32:
                raise Reject("zeros section short")
            counts = struct.unpack_from("<4Q", p, at)
            at += 32
            zsym = 31 if dtype == 2 else 255
            q = max((n + 3) // 4, 1)
            k = 0
            for i in range(n):
                if i % q == 0 and i and k != counts[i // q - 1]:
                    raise Reject("zeros section: count before a quarter")
                if exps[i] == zsym:
                    entry[i] = None
                else:
                    entry[i] = k
                    k += 1
            starts = [0] + list(counts[:3])
            for j in range(4):
                lo, hi = min(j * q, n), min((j + 1) * q, n)
                if starts[j] > counts[j] or counts[j] - starts[j] > hi - lo:
                    raise Reject("zeros section: counts")
            if k != counts[3]:
                raise Reject("zeros section: total")
            m = k
        if dtype == 0:
            want_len(at + 3 * m)
            for i in range(n):
                if entry[i] is None:
                    out[i] = 0
                    continue
                k = entry[i]
                lo, = struct.unpack_from("<H", p, at + 2 * k)
                t = p[at + 2 * m + k]
                out[i] = ((t & 0x80) << 24) | (exps[i] << 23) | ((t & 0x7F) << 16) | lo
        elif dtype == 1:
            want_len(at + m)
            for i in range(n):
                if entry[i] is None:
                    out[i] = 0
                    continue
                t = p[at + entry[i]]
                out[i] = ((t & 0x80) << 24) | (exps[i] << 23) | ((t & 0x7F) << 16)
        else:
            want_len(at + m + (3 * m + 7) // 8)
            padding(at + m, m, 3)
            lows = at + m
            for i in range(n):
                if entry[i] is None:
                    out[i] = 0
                    continue
                k = entry[i]
                t = p[at + k]
                bit = 3 * k
                two = p[lows + bit // 8] | ((p[lows + bit // 8 + 1] << 8) if lows + bit // 8 + 1 < plen else 0)
                low = (two >> (bit % 8)) & 7
                h = ((t & 0x80) << 8) | (exps[i] << 10) | ((t & 0x7F) << 3) | low
                out[i] = f16_to_f32_bits(h)
    elif codec == 8:  # topk
        k, = struct.unpack_from("<Q", params, 0)
        vt, w, coding = params[8], params[9], params[10]
        if n > 1 << 32 or k > n or vt not in (0, 1, 2, 3) or coding not in (0, 1, 2):
            raise Reject("topk params")
        if coding == 0 and (w > 32 or (k == 0 and w != 0)):
            raise Reject("topk width")
        if coding == 1 and (w > 31 or (k == 0 and w != 0)):
            raise Reject("topk rice parameter")
        if coding == 2 and w != 0:
            raise Reject("topk bitmap byte 9")
        zero_from(11)
        if seed:
            raise Reject("seed")
        at = value_section(vt, k)
        idx = []
        if coding == 0:  # fixed-width gaps
            want_len(at + (k * w + 7) // 8)
            padding(at, k, w)
            gaps = [stream_value(p, at, j, w) for j in range(k)]
        elif coding == 1:  # Rice: q zero bits, a one bit, then w low bits
            rmax = 0 if k == 0 else k * (w + 1) + ((n - k) >> w)
            if not at + (k * (w + 1) + 7) // 8 <= plen <= at + (rmax + 7) // 8:
                raise Reject("payload length")
            bits = (plen - at) * 8
            bit = lambda s: (p[at + s // 8] >> (s % 8)) & 1
            s, gaps = 0, []
            for j in range(k):
                q = 0
                while s < bits and not bit(s):
                    q, s = q + 1, s + 1
                if s + 1 + w > bits:
                    raise Reject("rice stream ends")
                s += 1
                r = sum(bit(s + b) << b for b in range(w))
                s += w
                gaps.append((q << w) | r)
            if (s + 7) // 8 != plen - at or any(bit(t) for t in range(s, bits)):
                raise Reject("rice trailing bits")
        else:  # bitmap
            want_len(at + (n + 7) // 8)
            if any((p[at + t // 8] >> (t % 8)) & 1 for t in range(n, (n + 7) // 8 * 8)):
                raise Reject("bitmap padding")
            idx = [i for i in range(n) if (p[at + i // 8] >> (i % 8)) & 1]
            if len(idx) != k:
                raise Reject("bitmap count")
        if coding != 2:
            prev = -1
            for g in gaps:
                i = prev + 1 + g
                if i >= n:
                    raise Reject("index")
                idx.append(i)
                prev = i
        for j, i in enumerate(idx):
            out[i] = value_bits(p, vt, j, k)
    elif codec == 9:  # randk
        t, = struct.unpack_from("<Q", params, 0)
        vt, sc = params[8], params[9]
        if not 1 <= t <= 1 << 32 or vt not in (0, 1, 2) or sc not in (0, 1):
            raise Reject("randk params")
        sel = params[10]
        if sel not in (0, 1):
            raise Reject("randk select")
        zero_from(11)
        vb = 4 if vt == 0 else 2
        if plen % vb or plen // vb > n:
            raise Reject("payload length")
        if sel == 0:
            kept = [i for i in range(n) if draw(seed, SELECT, offset + i) < t]
        else:
            # Stratum j covers [b(j), b(j + 1)) and keeps one draw-chosen element.
            def b(j):
                return (j << 32) // t
            j = ((offset + 1) * t - 1) >> 32
            assert b(j) <= offset < b(j + 1)
            kept = []
            while b(j) < offset + n:
                g = b(j) + ((draw(seed, STRATA, j) * (b(j + 1) - b(j))) >> 32)
                if offset <= g < offset + n:
                    kept.append(g - offset)
                j += 1
        if len(kept) != plen // vb:
            raise Reject("kept count")
        if flags & 1:
            out = [0x7FC00000] * n
        else:
            for j, i in enumerate(kept):
                out[i] = value_bits(p, vt, j, len(kept))
    elif codec == 10:  # dct
        out = dct_decode(p, params, n, seed)
    return n, out, flags


# ---------------------------------------------------------------- chunktopk (spec 3.15)

def unstage(codec, params, b, n, p, plen):
    """The payload of a staged frame (spec 3.17) with its code section decoded, and its
    length."""
    if codec in (3, 5, 6, 7, 13):
        sb, bits = {3: (4, 8), 5: (4, 1), 6: (4, 2), 7: (1, 8), 13: (1024, 8)}[codec]
    elif codec == 4 and params[4] in (2, 4, 8):
        sb, bits = 4, params[4]
    elif codec == 11 and params[5] < 3:
        sb, bits = (4, 1, 0)[params[5]], 8
    elif codec == 12 and params[5] < 3:
        sb, bits = (1, 4, 1)[params[5]], 4
    else:
        raise Reject("ENTROPY flag on a codec without the stage, or bad params")
    per_byte = 8 // math.gcd(8, bits)
    unit = b * per_byte // math.gcd(b, per_byte)
    a = unit * bits // 8
    if a > 4096:
        raise Reject("stage unit over 4096 code bytes")
    sl = -(-n // b) * sb
    C = -(-n * bits // 8)
    if not sl + 1 <= plen <= sl + 1 + C:
        raise Reject("staged payload length")
    codes, used, alphabet = entropy_block(p[sl:], C, a)
    if sl + used != plen:
        raise Reject("bytes after the entropy block")
    if codec == 11 and params[5] != 2:
        mask = 0x7F if params[4] == 0 else 0x7C
        if any(c & mask == mask for c in alphabet):
            raise Reject("a NaN or Inf code in a scaled frame's entropy block")
    return p[:sl] + bytes(codes), sl + C


def entropy_block(p, n, a):
    """The n symbols of the entropy block at the start of p with alignment a, its length,
    and the symbols it has codes for (3.16)."""
    if not p:
        raise Reject("entropy block empty")
    if p[0] == 0:
        if len(p) < 1 + n:
            raise Reject("stored block short")
        return list(p[1:1 + n]), 1 + n, set(p[1:1 + n])
    if p[0] == 1:
        if len(p) < 2:
            raise Reject("one-symbol block short")
        return [p[1]] * n, 2, {p[1]} if n else set()
    if p[0] != 2:
        raise Reject("entropy mode")
    if len(p) < 145:
        raise Reject("Huffman header short")
    lens = [(p[1 + s // 2] >> (4 * (s % 2))) & 15 for s in range(256)]
    if max(lens) > 11 or sum(1 for l in lens if l) < 2:
        raise Reject("code lengths")
    if sum(2.0 ** -l for l in lens if l) != 1.0:
        raise Reject("not a complete prefix code")
    # Canonical codes, as (length, value) -> symbol.
    codes, code, prev = {}, 0, 0
    for sym_len, sym in sorted((l, s) for s, l in enumerate(lens) if l):
        code <<= sym_len - prev
        prev = sym_len
        codes[(sym_len, code)] = sym
        code += 1
    sizes = struct.unpack_from("<4I", p, 129)
    if 145 + sum(sizes) > len(p):
        raise Reject("stream lengths")
    q, out, at = -(-(-(-n // 4)) // a) * a, [], 145
    for j in range(4):
        stream = p[at:at + sizes[j]]
        bit = 0
        for _ in range(min((j + 1) * q, n) - min(j * q, n)):
            v, l = 0, 0
            while (l, v) not in codes:
                if l == 11 or bit >= 8 * len(stream):
                    raise Reject("stream ends early")
                v = (v << 1) | (stream[bit // 8] >> (bit % 8)) & 1
                bit += 1
                l += 1
            out.append(codes[(l, v)])
        if -(-bit // 8) != len(stream):
            raise Reject("bytes after the last code")
        if bit % 8 and stream[-1] >> (bit % 8):
            raise Reject("padding")
        at += sizes[j]
    return out, at, {s for s, l in enumerate(lens) if l}


def chunk_record(c, K):
    """(kc, L, U, bytes) of the record of a chunk of c elements."""
    kc = min(K, c)
    L = 0
    while kc << (L + 1) <= c:
        L += 1
    U = kc + ((c - 1) >> L)
    return kc, L, U, 4 + (kc * L + U + 2 * kc + 7) // 8


def chunktopk_decode(p, params, n, seed, flags):
    C, K = struct.unpack_from("<II", params, 0)
    if any(params[8:]):
        raise Reject("unused params")
    if seed:
        raise Reject("seed")
    if not 1 <= C <= 65536 or not 1 <= K <= C:
        raise Reject("chunktopk chunk or k")
    full, rest = divmod(n, C)
    L_total = full * chunk_record(C, K)[3] + (chunk_record(rest, K)[3] if rest else 0)
    if len(p) != L_total:
        raise Reject("payload length")
    out = [0] * n  # unsent elements are +0 (a NaN or Inf is always kept)
    levels = (-3.0, -1.0, 1.0, 3.0)
    at = 0
    for start in range(0, n, C):
        c = min(C, n - start)
        kc, L, U, size = chunk_record(c, K)
        rec = p[at:at + size]
        s, = struct.unpack_from("<f", rec, 0)
        body = int.from_bytes(rec[4:], "little")
        total = kc * L + U + 2 * kc
        if body >> total:
            raise Reject("chunktopk padding")
        lows = [(body >> (i * L)) & ((1 << L) - 1) for i in range(kc)]
        upper = (body >> (kc * L)) & ((1 << U) - 1)
        ones = [b for b in range(U) if upper >> b & 1]
        if len(ones) != kc:
            raise Reject("chunktopk upper bits")
        last = -1
        for i, b in enumerate(ones):
            pos = ((b - i) << L) | lows[i]
            if pos >= c or pos <= last:
                raise Reject("chunktopk positions")
            last = pos
            code = (body >> (kc * L + U + 2 * i)) & 3
            out[start + pos] = f32_bits(s * levels[code])  # one rounding; NaN as 0x7FC00000
        at += size
    return out


# ---------------------------------------------------------------- dct (spec 3.11)

def f32_round(x):
    """A Python float rounded to f32, as a float (NaN and ±Inf kept)."""
    if math.isnan(x) or math.isinf(x):
        return x
    return bits_f32(f32_bits(x))


def fadd(a, b):  # one f32 addition: exact in f64 then one rounding (2p + 2 <= 53)
    return f32_round(a + b)


def fmul(a, b):
    return f32_round(a * b)


BASIS = {}


def basis(N):
    """B_N as a list of rows, by the reduction of spec 3.11."""
    if N not in BASIS:
        rows = []
        for k in range(N):
            s = math.sqrt((1.0 if k == 0 else 2.0) / N)
            row = []
            for n in range(N):
                m = ((2 * n + 1) * k) % (4 * N)
                if m > 2 * N:
                    m = 4 * N - m
                sign = 1.0
                if m > N:
                    m, sign = 2 * N - m, -1.0
                if 2 * m <= N:
                    c = math.cos(math.pi * m / (2 * N))
                else:
                    c = math.sin(math.pi * (N - m) / (2 * N))
                row.append(f32_round(s * sign * c))
            rows.append(row)
        BASIS[N] = rows
    return BASIS[N]


def dct_decode(p, params, n, seed):
    W, = struct.unpack_from("<I", params, 0)
    k, = struct.unpack_from("<H", params, 4)
    c, vt = params[6], params[7]
    if params[8] > 2:  # the encoder's transform: 0 direct, 1 factorised, 2 Lee; decoded alike
        raise Reject("dct transform")
    if any(params[9:]):
        raise Reject("unused params")
    if seed:
        raise Reject("seed")
    if vt > 3:
        raise Reject("dct values")
    if not 1 <= c <= 64:
        raise Reject("dct chunk")
    T = c if W == 0 else c * c
    if not 1 <= k <= T:
        raise Reject("dct k")
    if W and n % W:
        raise Reject("dct rows")
    R, L, H = (1, n, 1) if W == 0 else (n // W, W, c)
    ib = 1 if H * c <= 256 else 2
    tiles = [(u * H * L + v * c, min(H, R - u * H), min(c, L - v * c))
             for u in range(-(-R // H)) for v in range(-(-L // c))]
    vbytes = lambda kt: [4 * kt, 2 * kt, 4 + (kt + 7) // 8, (kt + 7) // 8][vt]
    total = (4 if vt == 3 else 0) + sum(min(k, h * w) * ib + vbytes(min(k, h * w))
                                        for _, h, w in tiles)
    if len(p) != total:
        raise Reject("payload length")
    at = 0
    frame_scale = None
    if vt == 3:
        frame_scale = struct.unpack_from("<f", p, 0)[0]
        at = 4
    parsed = []
    for first, h, w in tiles:  # validate everything before decoding
        kt = min(k, h * w)
        scale = frame_scale
        if vt == 2:
            scale = struct.unpack_from("<f", p, at)[0]
            at += 4
        pos = [p[at + j] if ib == 1 else struct.unpack_from("<H", p, at + 2 * j)[0]
               for j in range(kt)]
        at += kt * ib
        if any(q >= h * w for q in pos) or any(a >= b for a, b in zip(pos, pos[1:])):
            raise Reject("dct positions")
        if vt == 0:
            vals = list(struct.unpack_from("<%df" % kt, p, at))
        elif vt == 1:
            vals = [bits_f32(f16_to_f32_bits(h16))
                    for h16 in struct.unpack_from("<%dH" % kt, p, at)]
        else:
            nb = (kt + 7) // 8
            if kt % 8 and p[at + nb - 1] >> (kt % 8):
                raise Reject("padding")
            vals = [-scale if (p[at + j // 8] >> (j % 8)) & 1 else scale for j in range(kt)]
        at += vbytes(kt) - (4 if vt == 2 else 0)
        parsed.append((first, h, w, list(zip(pos, vals))))
    out = [0] * n
    for first, h, w, kept in parsed:
        Bh, Bw = basis(h), basis(w)
        t = [[0.0] * w for _ in range(h)]
        for q, v in kept:
            a, b = divmod(q, w)
            for i in range(h):
                t[i][b] = fadd(t[i][b], fmul(v, Bh[a][i]))
        for i in range(h):
            for j in range(w):
                x = 0.0
                for b in range(w):
                    x = fadd(x, fmul(t[i][b], Bw[b][j]))
                out[first + i * L + j] = 0x7FC00000 if math.isnan(x) else f32_bits(x)
    return out


def seal(frame):
    """Section 1.3: set PAYLOAD_CRC, re-checksum the header, append the payload CRC."""
    g = bytearray(frame)
    flags, = struct.unpack_from("<H", g, 6)
    struct.pack_into("<H", g, 6, flags | 2)
    struct.pack_into("<I", g, 52, zlib.crc32(bytes(g[0:52])))
    return bytes(g) + struct.pack("<I", zlib.crc32(frame[56:]))


def flip(frame, bit):
    """`frame` with one bit flipped."""
    g = bytearray(frame)
    g[bit // 8] ^= 1 << (bit % 8)
    return bytes(g)


def main():
    names = sorted(f for f in os.listdir(VECTORS) if f.endswith(".gpk"))
    if not names:
        print("no golden vectors found", file=sys.stderr)
        return 1
    failed = 0
    checked = 0
    for name in names:
        frame = open(os.path.join(VECTORS, name), "rb").read()
        expected_raw = open(os.path.join(VECTORS, name[:-4] + ".out.f32"), "rb").read()
        expected = list(struct.unpack("<%dI" % (len(expected_raw) // 4), expected_raw))
        try:
            n, got, flags = decode(frame)
        except Reject as e:
            print("FAIL %s: rejected (%s)" % (name, e))
            failed += 1
            continue
        bad = [i for i in range(n) if got[i] != expected[i]]
        if n != len(expected) or bad:
            i = bad[0] if bad else 0
            print("FAIL %s: element %d: spec decoder %#010x, gradpack %#010x" % (name, i, got[i], expected[i]))
            failed += 1
        if (".nonfinite" in name) != bool(flags & 1):
            print("FAIL %s: NONFINITE flag %d" % (name, flags & 1))
            failed += 1
        # Sealed, it decodes to the same bits, and gradpack wrote the same seal.
        sealed = seal(frame)
        if decode(sealed)[1] != got:
            print("FAIL %s: sealed frame decodes differently" % name)
            failed += 1
        sealed_path = os.path.join(VECTORS, name[:-4] + ".sealed")
        if os.path.exists(sealed_path) and open(sealed_path, "rb").read() != sealed:
            print("FAIL %s: gradpack's sealed frame differs from section 1.3" % name)
            failed += 1
        # Payload flips of a sealed frame, truncations and header bit flips must be
        # rejected.
        bad_frames = [("sealed-frame bit %d" % bit, flip(sealed, bit))
                      for bit in range(56 * 8, len(sealed) * 8, 5)]
        bad_frames += [("a cut to %d bytes" % cut, frame[:cut])
                       for cut in (0, 4, 55, len(frame) - 1)]
        bad_frames += [("header bit %d" % bit, flip(frame, bit)) for bit in range(0, 56 * 8, 7)]
        if ".nan_steps" in name:  # spec 2.1: a step of ±Inf is refused
            for inf in (0x7F800000, 0xFF800000):
                bad_frames.append(("an infinite step", frame[:56] + struct.pack("<I", inf) + frame[60:]))
        for what, g in bad_frames:
            try:
                decode(g)
                print("FAIL %s: accepted %s" % (name, what))
                failed += 1
            except Reject:
                pass
        checked += 1
    print("spec-decoder: %d passed, %d failed" % (checked - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
