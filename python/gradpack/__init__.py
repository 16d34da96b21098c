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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._errors import Error
from ._native import (
    HEADER_LEN,
    CodecProfile,
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


class Codec:
    """A codec and its parameters, parsed from a spec string.

    Specs are ``name`` or ``name:key=value,...``: ``'fp16'``, ``'bf16'``,
    ``'fp8:format=e4m3,block=128'`` (OCP 8-bit floats, E4M3 or E5M2, with an f32 or
    E8M0 scale per block, or ``scale=none``), ``'int8:block=256,rounding=stochastic'``, ``'qsgd:bits=4'``, ``'sign'``,
    ``'ternary'``, ``'natural'``, ``'topk:ratio=0.01,values=fp16'``,
    ``'randk:ratio=0.01'``, ``'dct:chunk=64,k=4'`` (a DCT per tile of ``chunk``
    elements, its ``k`` largest coefficients kept; ``width=`` for 2-D tiles),
    ``'identity'`` (float32). Parameters not given take their defaults; :attr:`spec`
    spells them all out.
    """

    __slots__ = ("_c",)

    def __init__(self, spec: Union[str, "Codec"]) -> None:
        self._c = spec._c if isinstance(spec, Codec) else _native.Codec(spec)

    @property
    def spec(self) -> str:
        """The canonical spec with every parameter; parses back to an equal codec."""
        return self._c.spec

    @property
    def name(self) -> str:
        """The codec's name: ``'int8'``, ``'topk'``, ..."""
        return self._c.name

    @property
    def unbiased(self) -> bool:
        """Whether ``decode(encode(x))`` equals ``x`` in expectation."""
        return self._c.unbiased

    def bits_per_element(self, n: int) -> float:
        """Bits per element on the wire for ``n`` elements, header included."""
        return self._c.bits_per_element(n)

    def max_encoded_len(self, n: int, checksum: bool = False) -> int:
        """The longest frame ``n`` elements encode to (+4 bytes with ``checksum``)."""
        return self._c.max_encoded_len(n, checksum)

    def error_bound(self, absmax: float) -> float:
        """Largest error of one decoded element for inputs of absolute maximum
        ``absmax`` (infinite for codecs that drop elements)."""
        return self._c.error_bound(absmax)

    def encode(
        self, x: ArrayLike, seed: int = 0, offset: int = 0, checksum: bool = False
    ) -> bytes:
        """Encode ``x``; see :func:`encode`."""
        return self._c.encode(_f32(x), _u64(seed, "seed"), _u64(offset, "offset"), checksum)

    def encode_into(
        self,
        x: ArrayLike,
        out: Any,
        seed: int = 0,
        offset: int = 0,
        checksum: bool = False,
    ) -> int:
        """Encode ``x`` into the uint8 buffer ``out``; see :func:`encode_into`."""
        return _native.encode_into(_f32(x), _bytes_out(out), self._c, _u64(seed, "seed"), _u64(offset, "offset"), checksum)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self._c == other._c

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"Codec({self.spec!r})"

    def __str__(self) -> str:
        return self.spec

    def __reduce__(self):
        return (Codec, (self.spec,))


def _codec(codec: Union[str, Codec]) -> Any:
    if isinstance(codec, Codec):
        return codec._c
    if isinstance(codec, str):
        return codec
    raise TypeError(
        f"codec must be a spec string such as 'int8' or a gradpack.Codec, not {type(codec).__name__}"
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
    return _native.encode(_f32(x), _codec(codec), _u64(seed, "seed"), _u64(offset, "offset"), checksum)


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
    return _native.encode_into(_f32(x), _bytes_out(out), _codec(codec), _u64(seed, "seed"), _u64(offset, "offset"), checksum)


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
    return _native.calibrate(_codec(codec), elements, budget_s)


class ErrorFeedback:
    """Error feedback for one tensor of ``n`` elements.

    Each :meth:`encode` sends ``beta * residual + gamma * grad`` and keeps what the codec
    dropped as the next residual, in the same pass as the encode. Codecs that are not
    contractive (random-k with ``scale=unbiased``, QSGD with few levels per block) make
    the residual grow and are refused unless ``allow_non_contractive``. ``residual``
    is ``'f32'`` (exact) or ``'bf16'`` (half the memory; fixed-rate codecs only).

    The state survives a checkpoint: :meth:`state_dict` returns plain values (a
    versioned, checksummed blob inside) that :meth:`load_state_dict` restores bit for
    bit.
    """

    __slots__ = ("_ef",)

    def __init__(
        self,
        codec: Union[str, Codec],
        n: int,
        beta: float = 1.0,
        gamma: float = 1.0,
        residual: str = "f32",
        allow_non_contractive: bool = False,
    ) -> None:
        self._ef = _native.ErrorFeedback(
            _codec(codec), n, beta, gamma, residual, allow_non_contractive
        )

    @property
    def codec(self) -> Codec:
        """The codec."""
        c = Codec.__new__(Codec)
        c._c = self._ef.codec
        return c

    @property
    def memory_bytes(self) -> int:
        """Bytes of residual state."""
        return self._ef.memory_bytes

    def __len__(self) -> int:
        return len(self._ef)

    def max_encoded_len(self, checksum: bool = False) -> int:
        """The longest frame :meth:`encode` can return (+4 bytes with ``checksum``)."""
        return self._ef.max_encoded_len(checksum)

    def encode(
        self, grad: ArrayLike, seed: int = 0, offset: int = 0, checksum: bool = False
    ) -> bytes:
        """Encode ``grad`` (``n`` elements) plus the residual; keep the new residual."""
        return self._ef.encode(_f32(grad, "grad"), _u64(seed, "seed"), _u64(offset, "offset"), checksum)

    def encode_into(
        self,
        grad: ArrayLike,
        out: Any,
        seed: int = 0,
        offset: int = 0,
        checksum: bool = False,
    ) -> int:
        """As :meth:`encode`, into the uint8 buffer ``out``; returns the frame length."""
        return self._ef.encode_into(_f32(grad, "grad"), _bytes_out(out), _u64(seed, "seed"), _u64(offset, "offset"), checksum)

    def residual(self) -> np.ndarray:
        """A float32 copy of the residual."""
        return self._ef.residual()

    def set_residual(self, r: ArrayLike) -> None:
        """Replace the residual with the float32 array ``r`` of ``len(self)`` elements
        (rounded to bf16 for a bf16 residual), e.g. to move residuals to a new layout."""
        self._ef.set_residual(_f32(r, "residual"))

    def reset(self) -> None:
        """Zero the residual."""
        self._ef.reset()

    def state_dict(self) -> Dict[str, Any]:
        """The state as plain values: ``format``, ``codec``, ``len`` and ``blob``."""
        return self._ef.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same codec and length, bit for bit."""
        self._ef.load_state_dict(state)

    def __repr__(self) -> str:
        return repr(self._ef)


def _shared_arg(shared_memory: Union[None, str, SharedMemory]) -> Any:
    """The native form of a ``shared_memory`` argument (a name, or the native
    :class:`SharedMemory` itself)."""
    return shared_memory


class _Collective:
    """What :class:`AllReduce` and :class:`Hierarchical` share: a native collective in
    ``_ar``."""

    __slots__ = ("_ar",)

    def run(self, x: ArrayLike, out: Optional[ArrayLike] = None, seed: int = 0) -> Dict[str, Any]:
        """All-reduce ``x`` into ``out``, or in place when ``out`` is None. ``seed`` must
        be the same on every rank and change every step. Returns this rank's
        ``strategy``, ``bytes_sent`` and ``messages``."""
        if out is None:
            return self._ar.run(_f32(x, "x"), None, _u64(seed, "seed"))
        return self._ar.run(_f32(x, "x"), _f32(out, "out"), _u64(seed, "seed"))

    @property
    def strategy(self) -> str:
        """The strategy run (between nodes for :class:`Hierarchical`; the cost model's
        choice when made with ``"auto"``)."""
        return self._ar.strategy

    @property
    def codec(self) -> Codec:
        """The codec (between nodes for :class:`Hierarchical`)."""
        c = Codec.__new__(Codec)
        c._c = self._ar.codec
        return c

    def __len__(self) -> int:
        return len(self._ar)

    def state_dict(self) -> Dict[str, Any]:
        """The error-feedback residuals (and the strategy), as plain values."""
        return self._ar.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a collective made with the same arguments;
        the next :meth:`run` continues bit for bit."""
        self._ar.load_state_dict(state)

    def __repr__(self) -> str:
        return repr(self._ar)


class AllReduce(_Collective):
    """gradpack's compressed all-reduce of one tensor of ``length`` elements, on rank
    ``rank`` of ``world``, over gradpack's native transport (``transport=``, a
    :class:`Tcp`: no message passes through Python, and ``rank`` and ``world`` are the
    transport's) or over any message transport you give as two callables:

    - ``send(msg: bytearray, to: int)`` hands ``msg`` (a copy of its own, which the
      callable may keep) to rank ``to`` and must return without waiting for ``to`` to
      receive it (all ranks send before they receive);
    - ``recv(frm: int)`` returns the next message from rank ``frm`` (bytes, bytearray or
      a 1-D uint8 array), in the order ``frm`` sent them;
    - optionally ``send_recv(msg: bytearray, to: int, frm: int)``: both at once,
      returning the message from ``frm``, where ``to`` gets ``msg`` (the ring's and the
      all-gather's steps). Give it when the transport moves both ways at once only if
      the receive is posted before the send: torch's gloo point-to-point does (posted
      after, the two directions of a step took twice as long on a shaped link), so
      :mod:`gradpack.torch` exchanges the lengths first, then posts the receive. If it
      takes a keyword ``size``, the ring passes ``size=`` the length the message from
      ``frm`` must have wherever the codec fixes it (every fixed-rate codec), so that
      the receive can be posted at once. A message of another length must raise (or be
      received whole and returned); gloo aborts the process when a message is longer
      than the receive posted for it, so a transport over gloo should honour ``size``
      only while every rank's all-reduce is made alike and no call has failed.
    - ``recv`` and ``send_recv`` that take a keyword ``limit`` are passed the most bytes
      the collective expects from ``frm``: a transport that learns a message's length
      before its bytes should raise when the length is above it, before allocating (a
      damaged length must not take the machine's memory). A returned message longer than
      ``limit`` fails the call either way.

    The algorithms are the Rust crate's, the same that MPI and the in-process transport
    run: ``strategy`` ``"ring"`` (a compressed reduce-scatter and all-gather, ``pieces``
    per chunk pipelined, error feedback at the ``"worker"`` or ``"worker+owner"``),
    ``"allgather"`` (each rank's frame to every rank, summed in one fused pass),
    ``"twoshot"`` (each chunk encoded once for its owner, summed there and re-encoded
    once, then sent to every rank: two steps of latency, the ring's bytes),
    ``"majority"`` (sign vote), ``"fp32-ring"``, or ``"auto"`` (the cost model's choice
    for links of ``bandwidth`` bit/s and ``latency`` s). Every rank ends each
    :meth:`run` with the same output to the bit. Every message carries an envelope
    (call, hop, tag, sender) and is checked on arrival, so a message from another call
    or another all-reduce (give each its own ``tag``) is an error, not a wrong sum.
    Kernels run with the GIL released; it is taken only to call ``send`` and ``recv``.
    An exception raised by either ends the call with :class:`Error` naming the peer.

    ``shared_memory`` (a name: letters, digits, ``-``, ``_``; the same on the ranks of a
    host and new for each collective) sends the messages between the ranks ``host`` (the
    ranks of this host, this one among them) through shared-memory rings instead of the
    callables: two copies per message, no socket. Every rank of ``host`` must pass the
    same name and list; the others use the callables. Construction waits up to
    ``shared_memory_timeout`` seconds for the host's other ranks, and so does a receive.
    A :class:`SharedMemory` instead of a name shares its rings with other collectives
    (then leave ``host`` out).
    """

    __slots__ = ()

    def __init__(
        self,
        codec: Union[str, Codec],
        length: int,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        *,
        strategy: str = "auto",
        op: str = "mean",
        feedback: str = "none",
        pieces: int = 1,
        checksum: bool = True,
        tag: int = 0,
        bandwidth: float = 10e9,
        latency: float = 10e-6,
        beta: float = 1.0,
        gamma: float = 1.0,
        residual: str = "f32",
        allow_non_contractive: bool = False,
        shared_memory: Union[None, str, SharedMemory] = None,
        host: Optional[Sequence[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None:
        self._ar = _native.AllReduce(
            _codec(codec),
            length,
            _opt_int(rank),
            _opt_int(world),
            send,
            recv,
            strategy=strategy,
            op=op,
            feedback=feedback,
            pieces=pieces,
            checksum=checksum,
            tag=tag,
            bandwidth=bandwidth,
            latency=latency,
            beta=beta,
            gamma=gamma,
            residual=residual,
            allow_non_contractive=allow_non_contractive,
            shared_memory=_shared_arg(shared_memory),
            host=None if host is None else [int(r) for r in host],
            shared_memory_timeout=float(shared_memory_timeout),
            send_recv=send_recv,
            transport=transport,
        )

    @property
    def calls(self) -> int:
        """Calls of :meth:`run` so far."""
        return self._ar.calls


class BucketGather:
    """The all-gather of a bucket of tensors that the caller encodes, each tensor with a
    codec of its own, on rank ``rank`` of ``world``, over the same message callables as
    :class:`AllReduce` (``send``, ``recv`` and optionally ``send_recv``, or
    ``transport``; and its ``shared_memory``, ``host`` and ``shared_memory_timeout``).

    Where :class:`AllReduce` owns one tensor's codec, seeds and residuals, here the
    caller encodes (with :meth:`Codec.encode_into` or :meth:`ErrorFeedback.encode_into`,
    so residuals can stay per parameter) and the crate moves and sums: each rank's
    message (its frames for the bucket's tensors, concatenated in order) travels round
    the ring as the ``"allgather"`` strategy's frames do, and each tensor's frames are
    summed into its place in rank order in one fused pass (:func:`reduce_frames`), so
    every rank ends with the same bits. ``op`` is ``"mean"`` or ``"sum"``; give each
    collective on the same peers its own ``tag``. Kernels run with the GIL released.
    """

    __slots__ = ("_g",)

    def __init__(
        self,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        *,
        op: str = "mean",
        tag: int = 0,
        shared_memory: Union[None, str, SharedMemory] = None,
        host: Optional[Sequence[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None:
        self._g = _native.BucketGather(
            _opt_int(rank),
            _opt_int(world),
            send,
            recv,
            op=op,
            tag=tag,
            shared_memory=_shared_arg(shared_memory),
            host=None if host is None else [int(r) for r in host],
            shared_memory_timeout=float(shared_memory_timeout),
            send_recv=send_recv,
            transport=transport,
        )

    def run(
        self,
        message: FrameLike,
        segments: Sequence[Tuple[int, int]],
        out: ArrayLike,
        max_message: Optional[int] = None,
    ) -> Dict[str, Any]:
        """Gather every rank's ``message``: whole frames, one per ``(start, length)`` of
        ``segments`` (in that order, each of its segment's length), concatenated. Then
        ``out[start : start + length]`` of each segment is set to the sum (or mean) of
        the ranks' frames for it, in rank order; the rest of ``out`` (float32) is left as
        it is. Every rank passes the same segments. A peer's message that does not split
        into such frames raises :class:`Error` naming the rank that made it.
        ``max_message`` bounds every rank's message (the same on every rank: the sum of
        the codecs' ``max_encoded_len`` for the segments, say); a peer's message
        announced longer is refused before anything is allocated for it (``None``: what
        any codec can write, far looser). Returns this rank's ``strategy``,
        ``bytes_sent`` and ``messages``."""
        segs = [(int(a), int(n)) for a, n in segments]
        bound = None if max_message is None else int(max_message)
        return self._g.run(_frame(message), segs, _f32(out, "out"), bound)

    def encode_run(
        self,
        x: ArrayLike,
        parts: Sequence[Tuple[int, int, Union[str, Codec], int, Optional["ErrorFeedback"]]],
        *,
        seed: int,
        step: int,
        checksum: bool = False,
    ) -> Dict[str, Any]:
        """Encode and gather in one call, in the crate with the GIL released: each
        ``(start, length, codec, key, feedback)`` of ``parts`` is the tensor
        ``x[start : start + length]`` (float32, written in place), encoded with ``codec``
        through the :class:`ErrorFeedback` ``feedback`` (or none) and a seed the crate
        derives from ``seed``, ``step``, the tensor's ``key`` (an int that names it, the
        same on every rank) and the rank; the frames are one message, gathered as
        :meth:`run` does, and each part's sum or mean over the ranks is written back into
        ``x``. ``checksum`` seals each frame with a CRC-32. Every rank passes the same
        parts (codecs and ranges)."""
        mask = (1 << 64) - 1
        ps = [
            (int(a), int(n), Codec(c)._c, int(k) & mask, None if fb is None else fb._ef)
            for a, n, c, k, fb in parts
        ]
        return self._g.encode_run(
            _f32(x, "x"), ps, seed=int(seed) & mask, step=int(step) & mask, checksum=bool(checksum)
        )

    @property
    def calls(self) -> int:
        """Calls of :meth:`run` so far."""
        return self._g.calls

    def __repr__(self) -> str:
        return repr(self._g)


class Hierarchical(_Collective):
    """gradpack's two-level all-reduce (the Rust crate's
    ``gradpack::collective::Hierarchical``) of one tensor of ``length`` elements on rank
    ``rank`` of ``world``, over the same two message callables as :class:`AllReduce`
    (or its ``transport``).

    ``nodes`` gives the node of every rank (``0 .. N``). Inside a node the ranks
    reduce-scatter the tensor in float32 (``node_codec="bf16"`` or ``"fp16"`` to halve
    it), each node's ranks then all-reduce their shards between nodes with ``codec``
    (``strategy``, ``feedback``, ``pieces`` as for :class:`AllReduce`; error feedback on
    this leg only), side by side, and all-gather the result inside the node. Every rank
    ends with the same bits; nodes may differ in size.

    ``shared_memory`` (a name, as for :class:`AllReduce`) reduces inside a node through
    shared memory, the node's ranks being one host's (``host`` to name them otherwise):
    with the float32 node codec, in place in a stage of up to 4 MiB per rank (in rounds,
    no frames: the same bits); with bf16 or fp16, by frames through shared-memory rings.
    The legs between nodes use the callables. A :class:`SharedMemory` (made with a
    ``stage`` for the reduction in place) shares its memory with other collectives.
    """

    __slots__ = ()

    def __init__(
        self,
        codec: Union[str, Codec],
        length: int,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        nodes: Optional[Sequence[int]] = None,
        *,
        node_codec: Union[str, Codec] = "identity",
        strategy: str = "auto",
        op: str = "mean",
        feedback: str = "none",
        pieces: int = 1,
        checksum: bool = True,
        tag: int = 0,
        bandwidth: float = 10e9,
        latency: float = 10e-6,
        beta: float = 1.0,
        gamma: float = 1.0,
        residual: str = "f32",
        allow_non_contractive: bool = False,
        shared_memory: Union[None, str, SharedMemory] = None,
        host: Optional[Sequence[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None:
        self._ar = _native.Hierarchical(
            _codec(codec), length, _opt_int(rank), _opt_int(world), send, recv,
            None if nodes is None else [int(k) for k in nodes],
            node_codec=_codec(node_codec), strategy=strategy, op=op, feedback=feedback,
            pieces=pieces, checksum=checksum, tag=tag, bandwidth=bandwidth, latency=latency,
            beta=beta, gamma=gamma, residual=residual,
            allow_non_contractive=allow_non_contractive,
            shared_memory=_shared_arg(shared_memory),
            host=None if host is None else [int(r) for r in host],
            shared_memory_timeout=float(shared_memory_timeout),
            send_recv=send_recv,
            transport=transport,
        )


class OuterSync:
    """DiLoCo's outer synchronisation on rank ``rank`` of ``world`` (the Rust crate's
    ``gradpack::outer::OuterSync``), over the same two message callables as
    :class:`AllReduce` (or its ``transport``). :class:`gradpack.torch.DiLoCo` drives it
    for a PyTorch model.

    It keeps an outer copy of the tensors ``names`` of ``shapes`` in float32, starting
    from ``params`` (the same on every rank). Call :meth:`step` after every inner
    optimizer step. Every ``sync_every`` steps it all-reduces the mean of the
    pseudo-gradients ``outer - local`` with ``codec`` (and error feedback: ``feedback``
    ``"worker"``), takes a step of outer SGD (``outer_lr``, Nesterov ``outer_momentum``;
    ``outer_momentum=0`` for none), and writes the new outer parameters into the
    parameters: ``local = alpha * local + (1 - alpha) * outer``. With ``fragments`` P the
    tensors are split into P fragments (in order, by size, or by ``assignment``) synced
    at staggered steps; with ``delay`` tau each fragment's all-reduce starts tau steps
    before its sync point and runs on a communication thread meanwhile. Every rank ends
    each outer step with the same outer parameters, to the bit.
    """

    __slots__ = ("_s",)

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        params: Sequence[ArrayLike],
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        *,
        sync_every: int = 500,
        fragments: int = 1,
        assignment: Optional[Sequence[int]] = None,
        delay: int = 0,
        alpha: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        codec: Union[str, Codec] = "identity",
        feedback: str = "none",
        strategy: str = "auto",
        pieces: int = 1,
        checksum: bool = True,
        seed: int = 0,
        bandwidth: float = 10e9,
        latency: float = 10e-6,
        beta: float = 1.0,
        gamma: float = 1.0,
        residual: str = "f32",
        allow_non_contractive: bool = False,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None:
        self._s = _native.OuterSync(
            list(names),
            [list(s) for s in shapes],
            [_f32(x, f"params[{i}]") for i, x in enumerate(params)],
            _opt_int(rank),
            _opt_int(world),
            send,
            recv,
            sync_every=sync_every,
            fragments=fragments,
            assignment=None if assignment is None else list(assignment),
            delay=delay,
            alpha=alpha,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            codec=_codec(codec),
            feedback=feedback,
            strategy=strategy,
            pieces=pieces,
            checksum=checksum,
            seed=_u64(seed, "seed"),
            bandwidth=bandwidth,
            latency=latency,
            beta=beta,
            gamma=gamma,
            residual=residual,
            allow_non_contractive=allow_non_contractive,
            send_recv=send_recv,
            transport=transport,
        )

    def due(self) -> Tuple[List[int], List[int]]:
        """``(send, apply)``: the fragments whose pseudo-gradients the next :meth:`step`
        forms, and those whose outer step it applies. Only their tensors are read or
        written; both empty means :meth:`step` may be called with no parameters."""
        return self._s.due()

    def step(self, params: Optional[Sequence[ArrayLike]] = None) -> Dict[str, int]:
        """After an inner step: the parameters (float32, one per tensor, written in
        place), or ``None`` when :meth:`due` is empty. Returns ``sent``, ``applied``,
        ``bytes_sent`` and ``messages``."""
        if params is None:
            return self._s.step(None)
        return self._s.step([_f32(x, f"params[{i}]") for i, x in enumerate(params)])

    @property
    def fragments(self) -> List[List[int]]:
        """The tensors of every fragment."""
        return self._s.fragments

    @property
    def inner_step(self) -> int:
        """Inner steps so far."""
        return self._s.inner_step

    def outer(self, i: int) -> np.ndarray:
        """A copy of tensor ``i``'s outer parameters, flat."""
        return self._s.outer(i)

    def state_dict(self) -> Dict[str, Any]:
        """Step, outer copy, momentum, residuals and results not yet applied."""
        return self._s.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (with the model of the same step, training goes
        on bit for bit)."""
        self._s.load_state_dict(state)

    def __repr__(self) -> str:
        return repr(self._s)


def powersgd_matrix(
    shape: Tuple[int, ...], rank: int = 2, min_compression: float = 2.0
) -> Optional[Tuple[int, int, int]]:
    """The ``(n, m, r)`` PowerSGD sends a tensor of ``shape`` as: ``n = shape[0]``
    rows, ``m`` the product of the other dimensions (a convolution's ``[out, in, kh,
    kw]`` is ``out x (in kh kw)``), rank ``r = min(rank, n, m)``; or ``None`` for a
    tensor of fewer than two dimensions or one that ``n m / ((n + m) r)`` says compresses
    less than ``min_compression`` times."""
    return _native.powersgd_matrix(list(shape), rank, min_compression)


class PowerSgdBucket:
    """PowerSGD (Vogels et al., 2019) for one bucket of matrices, whose two all-reduces
    the caller runs: step by step as below, or all in the crate with :meth:`exchange`
    on two :class:`AllReduce` (what ``gradpack.torch`` does).

    ``shapes`` lists each matrix's ``(n, m, r)`` (see :func:`powersgd_matrix`); the
    bucket's gradient is their row-major elements back to back, or, with ``offsets``
    (one per matrix, ascending) and ``length``, a buffer of ``length`` elements holding
    each matrix at its offset among other tensors, which the steps leave alone. One
    step, on every rank with the same ``seed``::

        b.p_step(m, seed, p)        # m becomes grad + residual; p = M Q (this rank's)
        # all-reduce p, divide by the world size
        b.q_step(m, p, q)           # orthonormalise p in place; q = M^T P
        # all-reduce q, divide by the world size
        ok = b.finish(m, p, q, out) # out = P Q^T; residual = M - out; Q kept
                                    # (out=None: the result replaces M in m)

    Every rank gets the same ``out`` to the bit when the all-reduces give every rank the
    same bits. ``warm_start`` reuses each matrix's last ``Q``; ``feedback`` keeps what was
    not sent. ``finish`` returns ``False`` and fills ``out`` with NaN when a factor was
    not finite (a gradient overflowed on some rank); the residuals then keep their
    values and the next step draws a fresh ``Q``. Arrays are float32 and are read and
    written in place. The state is saved whole (:meth:`save`) or per matrix
    (:meth:`matrix_state`), so it can follow a parameter into another bucket.
    """

    __slots__ = ("_b",)

    def __init__(
        self,
        shapes: Any,
        rank: int = 2,
        warm_start: bool = True,
        feedback: bool = True,
        min_compression: float = 2.0,
        offsets: Optional[Any] = None,
        length: Optional[int] = None,
    ) -> None:
        self._b = _native.PowerSgdBucket(
            [tuple(int(v) for v in s) for s in shapes],
            rank,
            warm_start,
            feedback,
            min_compression,
            None if offsets is None else [int(o) for o in offsets],
            None if length is None else int(length),
        )

    def __len__(self) -> int:
        return len(self._b)

    @property
    def p_len(self) -> int:
        """Elements of the first all-reduce (every matrix's ``P``, ``n r`` each)."""
        return self._b.p_len

    @property
    def q_len(self) -> int:
        """Elements of the second all-reduce (every matrix's ``Q``, ``m r`` each)."""
        return self._b.q_len

    def p_step(self, m: ArrayLike, seed: int, p: ArrayLike) -> None:
        """Step 1: ``m`` becomes ``M`` (gradient plus residual); ``p`` gets ``M Q``."""
        self._b.p_step(_f32(m, "m"), seed & ((1 << 64) - 1), _f32(p, "p"))

    def exchange(
        self,
        m: ArrayLike,
        seed: int,
        plain: Sequence[Tuple[int, int]],
        first: "AllReduce",
        second: "AllReduce",
    ) -> bool:
        """A whole step over the ranks, in the crate with no Python between its parts:
        :meth:`p_step`, the float32 all-reduce ``first`` of every matrix's ``P`` followed
        by the ``(start, length)`` ranges ``plain`` of ``m`` (tensors sent as float32,
        written back with their mean), :meth:`q_step`, the all-reduce ``second`` of
        ``Q``, and :meth:`finish` in place. ``first`` and ``second`` are
        :class:`AllReduce` of ``"identity"`` with ``op="mean"``, of :attr:`p_len` plus the
        ranges' elements and of :attr:`q_len` elements. Returns :meth:`finish`'s flag."""
        return self._b.exchange(
            _f32(m, "m"), seed & ((1 << 64) - 1), [(int(a), int(n)) for a, n in plain],
            first._ar, second._ar,
        )

    def q_step(self, m: ArrayLike, p: ArrayLike, q: ArrayLike) -> None:
        """Step 2: ``p`` (the mean over ranks) is orthonormalised in place; ``q`` gets
        ``M^T P``."""
        self._b.q_step(_f32(m, "m"), _f32(p, "p"), _f32(q, "q"))

    def finish(
        self, m: ArrayLike, p: ArrayLike, q: ArrayLike, out: Optional[ArrayLike] = None
    ) -> bool:
        """Step 3: ``q`` is the mean over ranks; ``out`` (or ``m`` itself when ``out``
        is ``None``) gets ``P Q^T`` in the matrices' places. ``False`` (and the result all
        NaN) if the factors were not finite."""
        return self._b.finish(
            _f32(m, "m"), _f32(p, "p"), _f32(q, "q"), None if out is None else _f32(out, "out")
        )

    def matrix_state(self, i: int) -> Tuple[Optional[np.ndarray], np.ndarray]:
        """Matrix ``i``'s warm-start ``Q`` (``m r`` float32, or ``None`` if it has none
        yet) and residual (``n m``; empty without feedback), as copies."""
        return self._b.matrix_state(i)

    def set_matrix_state(self, i: int, q: Optional[ArrayLike], residual: ArrayLike) -> None:
        """Set matrix ``i``'s state as :meth:`matrix_state` gave it."""
        self._b.set_matrix_state(
            i, None if q is None else _f32(q, "q"), _f32(residual, "residual")
        )

    def reset(self) -> None:
        """Zero the residuals; draw a fresh ``Q`` at the next step."""
        self._b.reset()

    def save(self) -> bytes:
        """The state (every ``Q`` and whether it is set, the residuals) as a versioned,
        checksummed blob."""
        return self._b.save()

    def restore(self, blob: bytes) -> None:
        """Restore a :meth:`save` blob of a bucket of the same matrices and settings."""
        self._b.restore(bytes(blob))

    def __repr__(self) -> str:
        return repr(self._b)
