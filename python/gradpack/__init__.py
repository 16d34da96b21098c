"""gradpack: gradient compression for data-parallel training.

Codecs (fp16, bf16, int8, QSGD, sign, ternary, natural, top-k, random-k) turn a float32
gradient into a self-describing frame of bytes and back, with error feedback and a cost
model that says whether a codec pays on a given link. ``gradpack.torch`` holds a
communication hook for PyTorch DDP built on them.

Arrays: any C-contiguous float32 buffer is read in place, never copied: a numpy array,
a CPU torch tensor, or an object exposing the buffer protocol with format ``'f'``. Other
dtypes raise ``TypeError`` (convert with ``x.astype(numpy.float32)`` or ``t.float()``),
non-contiguous arrays and tensors on other devices raise ``ValueError`` (use
``numpy.ascontiguousarray(x)``, ``t.contiguous()``, ``t.cpu()``). Arrays of any shape are
read as flat. Frames are ``bytes``, ``bytearray``, ``memoryview``, or one-dimensional
uint8 numpy arrays or torch tensors.

The GIL is released while a kernel runs, so threads encoding different tensors run in
parallel. Every error gradpack itself detects (a corrupted frame, a bad spec, a buffer
of the wrong size) raises :class:`Error`, a ``ValueError`` carrying the crate's message.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._errors import Error
from ._native import (
    HEADER_LEN,
    AllReduce,
    BucketGather,
    Codec,
    CodecProfile,
    ErrorFeedback,
    Hierarchical,
    OuterSync,
    PowerSgdBucket,
    HookReducer,
    NamedState,
    SharedMemory,
    Tcp,
    Tuner,
    allreduce_time,
    backend,
    measure_link,
    two_level_time,
    best_strategy,
    break_even_bandwidth,
    parse_bandwidth,
    parse_duration,
    ring_time,
    tensor_codec,
)

__all__ = [
    "HEADER_LEN",
    "AllReduce",
    "BucketGather",
    "Codec",
    "Hierarchical",
    "HookReducer",
    "NamedState",
    "OuterSync",
    "CodecProfile",
    "Error",
    "ErrorFeedback",
    "PowerSgdBucket",
    "SharedMemory",
    "Tcp",
    "Tuner",
    "agree",
    "allreduce_time",
    "two_level_time",
    "backend",
    "best_strategy",
    "break_even_bandwidth",
    "calibrate",
    "decode",
    "decode_add",
    "decode_into",
    "encode",
    "encode_into",
    "frame_len",
    "inspect",
    "measure_link",
    "parse_bandwidth",
    "parse_duration",
    "powersgd_matrix",
    "reduce_frames",
    "ring_time",
    "tensor_codec",
]

__version__ = "0.1.0"

ArrayLike = Any
"""A float32 buffer: numpy array, CPU torch tensor, or a buffer-protocol object."""
FrameLike = Union[bytes, bytearray, memoryview, np.ndarray, Any]
"""A frame: bytes, bytearray, memoryview, or a 1-D uint8 numpy array or torch tensor."""


def _torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_view(x: Any, what: str, dtype_name: str) -> np.ndarray:
    import torch

    want = {"float32": torch.float32, "uint8": torch.uint8}[dtype_name]
    if x.device.type != "cpu":
        raise ValueError(
            f"{what} is on device {x.device}; gradpack reads host memory: pass {what}.cpu()"
            " (gradpack.torch's hook copies CUDA buckets to the host itself)"
        )
    if x.dtype != want:
        raise TypeError(
            f"{what} has dtype {x.dtype}; gradpack reads torch.{dtype_name} only"
            + (" (convert with t.float())" if dtype_name == "float32" else "")
        )
    if not x.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass {what}.contiguous()")
    return x.detach().numpy()


def _f32(x: ArrayLike, what: str = "x") -> np.ndarray:
    """`x` as a float32 numpy view (no copy), or the error that explains why not."""
    if isinstance(x, np.ndarray):
        return x
    if _torch_tensor(x):
        return _tensor_view(x, what, "float32")
    try:
        m = memoryview(x)
    except TypeError:
        raise TypeError(
            f"{what} must be a float32 numpy array, a CPU torch tensor or a buffer of"
            f" float32, not {type(x).__name__}"
        ) from None
    if m.format not in ("f", "<f", "=f", "@f"):
        raise TypeError(
            f"{what} is a buffer of format {m.format!r}; gradpack reads float32 ('f') only"
        )
    return np.asarray(m)


def _u64(v: Any, what: str) -> int:
    """``v`` as an unsigned 64-bit integer, or a clear error."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an int, not {type(v).__name__}")
    v = int(v)
    if not 0 <= v < 1 << 64:
        hint = f" (for a negative one, pass {what} % 2**64)" if v < 0 else ""
        raise ValueError(f"{what} must be in 0 .. 2**64 - 1, not {v}{hint}")
    return v


def _frame(f: FrameLike) -> Union[bytes, np.ndarray]:
    if isinstance(f, bytes):
        return f
    if isinstance(f, np.ndarray):
        if f.dtype != np.uint8 or f.ndim != 1:
            raise TypeError(
                f"a frame array must be 1-D uint8, got {f.ndim}-D {f.dtype}"
            )
        return f
    if _torch_tensor(f):
        return _tensor_view(f, "frame", "uint8").reshape(-1)
    if isinstance(f, (bytearray, memoryview)):
        return np.frombuffer(f, dtype=np.uint8)
    raise TypeError(
        f"a frame must be bytes, bytearray, memoryview or a 1-D uint8 array, not {type(f).__name__}"
    )


def _bytes_out(out: Any) -> np.ndarray:
    if isinstance(out, np.ndarray):
        return out
    if _torch_tensor(out):
        return _tensor_view(out, "out", "uint8").reshape(-1)
    if isinstance(out, (bytearray, memoryview)):
        return np.frombuffer(out, dtype=np.uint8)
    raise TypeError(
        f"out must be a 1-D uint8 numpy array, a uint8 torch tensor or a bytearray, not {type(out).__name__}"
    )


def encode(
    x: ArrayLike,
    codec: Union[str, Codec],
    seed: int = 0,
    offset: int = 0,
    checksum: bool = False,
) -> bytes:
    """Encode the float32 array ``x`` (any shape, read flat) into a frame.

    ``seed`` drives stochastic rounding and random-k selection (the same seed gives the
    same frame on every CPU); ``offset`` is the global index of ``x``'s first element in
    its tensor when ``x`` is a chunk; ``checksum`` seals the payload with a CRC-32 that
    decoding verifies.
    """
    return _native.encode(_f32(x), codec, _u64(seed, "seed"), _u64(offset, "offset"), checksum)


def encode_into(
    x: ArrayLike,
    out: Any,
    codec: Union[str, Codec],
    seed: int = 0,
    offset: int = 0,
    checksum: bool = False,
) -> int:
    """Encode ``x`` into ``out`` (a uint8 numpy array, uint8 torch tensor or bytearray
    of at least ``Codec(codec).max_encoded_len(x.size)`` bytes) and return the frame
    length. Allocates nothing."""
    return _native.encode_into(_f32(x), _bytes_out(out), codec, _u64(seed, "seed"), _u64(offset, "offset"), checksum)


def decode(frame: FrameLike, max_elements: Optional[int] = None) -> np.ndarray:
    """Decode any frame into a new 1-D float32 array.

    A frame needs no configuration: its header names the codec and parameters. Frames
    claiming more than ``max_elements`` elements (default: the most a frame of its
    length can legitimately hold) are refused before anything is allocated.
    """
    return _native.decode(_frame(frame), max_elements)


def decode_into(frame: FrameLike, out: ArrayLike) -> None:
    """Decode any frame into ``out``, a writable C-contiguous float32 array (or CPU
    tensor) holding exactly the frame's element count, in any shape."""
    _native.decode_into(_frame(frame), _f32(out, "out"))


def decode_add(frame: FrameLike, acc: ArrayLike) -> None:
    """Decode any frame and add it element-wise into ``acc`` (the reduce step of a
    collective). The frame is fully validated first: on error ``acc`` is unchanged."""
    _native.decode_add(_frame(frame), _f32(acc, "acc"))


def reduce_frames(frames: Sequence[FrameLike], out: ArrayLike, add: bool = False) -> None:
    """Decode every frame of ``frames`` (frames of one tensor, of any codecs) and sum
    them into ``out`` in list order, in one pass over it: the same bits as
    ``decode_into`` of the first and ``decode_add`` of each of the others, but the
    output is written once instead of once per frame (the sum of an all-gather).

    With ``add=True`` every frame is added into ``out``. Every header, length and
    fixed-rate payload is checked before ``out`` is written; an error names the
    frame's position in the list.
    """
    _native.reduce_frames([_frame(f) for f in frames], _f32(out, "out"), add)


def inspect(frame: FrameLike) -> Dict[str, Any]:
    """Validate a frame's header and describe it.

    Returns a dict with ``codec``, ``spec``, ``elements``, ``payload_len``,
    ``frame_len``, ``seed``, ``offset``, ``nonfinite`` (the input held NaN or Inf),
    ``checksum`` (the payload is sealed) and ``bits_per_element``.
    """
    return _native.inspect(_frame(frame))


def agree(
    settings: Dict[str, Any],
    rank: Optional[int] = None,
    world: Optional[int] = None,
    send: Optional[Callable[[bytearray, int], Any]] = None,
    recv: Optional[Callable[[int], Any]] = None,
    *,
    tag: int = 0xFFFFFFFF,
    send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
    transport: Optional[Tcp] = None,
) -> None:
    """Check that every rank of ``world`` was made with the same ``settings`` (option
    name to value), over the message callables of :class:`AllReduce` (or its
    ``transport``, a :class:`Tcp`, in their place). Every rank sends
    its settings to every other and compares what each sends, so a difference raises
    :class:`Error` on every rank, naming the rank and the option (``seed=9``, say). One
    exchange of its own: call it at the same point on every rank."""
    words = " ".join(f"{k}={str(v).replace(' ', '')}" for k, v in settings.items())
    _native.agree(words, _opt_int(rank), _opt_int(world), send, recv, tag=int(tag),
                  send_recv=send_recv, transport=transport)


def _opt_int(v: Optional[int]) -> Optional[int]:
    return None if v is None else int(v)


def frame_len(buf: FrameLike) -> int:
    """The length of the frame at the start of ``buf``, from its header alone (which is
    checked): to cut a frame out of a longer buffer, such as a padded receive buffer."""
    return _native.frame_len(_frame(buf))


def calibrate(
    codec: Union[str, Codec], elements: int = 1 << 20, budget_s: float = 0.2
) -> CodecProfile:
    """Measure ``codec``'s encode, decode and decode_add speed on this CPU on a
    synthetic gradient of ``elements`` elements (best of repetitions for about
    ``budget_s`` seconds); the result feeds :func:`allreduce_time`."""
    return _native.calibrate(codec, elements, budget_s)


def powersgd_matrix(
    shape: Tuple[int, ...], rank: int = 2, min_compression: float = 2.0
) -> Optional[Tuple[int, int, int]]:
    """The ``(n, m, r)`` PowerSGD sends a tensor of ``shape`` as: ``n = shape[0]``
    rows, ``m`` the product of the other dimensions (a convolution's ``[out, in, kh,
    kw]`` is ``out x (in kh kw)``), rank ``r = min(rank, n, m)``; or ``None`` for a
    tensor of fewer than two dimensions or one that ``n m / ((n + m) r)`` says compresses
    less than ``min_compression`` times."""
    return _native.powersgd_matrix(list(shape), rank, min_compression)


