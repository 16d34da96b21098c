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

from typing import Any, Callable, Dict, Optional

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
    calibrate,
    decode,
    decode_add,
    decode_into,
    encode,
    encode_into,
    frame_len,
    inspect,
    measure_link,
    powersgd_matrix,
    reduce_frames,
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


