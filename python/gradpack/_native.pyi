"""
gradpack's codecs, frames, error feedback, collectives and cost model (the native part
of the `gradpack` Python package).
"""

from _typeshed import Incomplete, SupportsGetItem
from typing import Any, Final, SupportsFloat, SupportsIndex, final

__all__ = ["HEADER_LEN", "AllReduce", "BucketGather", "Codec", "CodecProfile", "ErrorFeedback", "Hierarchical", "HookReducer", "ModelSelection", "Momentum", "NamedState", "OuterSync", "PowerSgdBucket", "PowerSgdByName", "SharedMemory", "Tcp", "TensorGather", "Tuner", "agree", "allreduce_time", "backend", "best_strategy", "break_even_bandwidth", "calibrate", "chunk_range", "decode", "decode_add", "decode_into", "default_strategy", "encode", "encode_into", "frame_len", "inspect", "mean_over_ranks", "measure_link", "parse_bandwidth", "parse_duration", "powersgd_matrix", "rank_seed", "reduce_frames", "ring_time", "splitmix64", "tensor_codec", "tensor_seed", "two_level_time", "wants_feedback"]

HEADER_LEN: Final[int]
"""
Size in bytes of every frame header.
"""

@final
class AllReduce:
    """
    gradpack's compressed all-reduce of one tensor of ``length`` elements, on rank
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
    def __len__(self, /) -> int: ...
    def __new__(cls, /, codec: Any, length: SupportsIndex, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, strategy: str = "auto", op: str = "mean", feedback: str = "none", pieces: SupportsIndex = 1, checksum: bool = True, tag: SupportsIndex = 0, bandwidth: SupportsFloat | SupportsIndex = 10e9, latency: SupportsFloat | SupportsIndex = 10e-6, beta: SupportsFloat | SupportsIndex = 1.0, gamma: SupportsFloat | SupportsIndex = 1.0, residual: str = "f32", allow_non_contractive: bool = False, shared_memory: Any | None = None, host: SupportsGetItem[int, SupportsIndex] | None = None, shared_memory_timeout: SupportsFloat | SupportsIndex = 300.0, send_recv: Any | None = None, transport: Tcp | None = None) -> AllReduce: ...
    def __repr__(self, /) -> str: ...
    @property
    def calls(self, /) -> int:
        """
        Calls made so far on this all-reduce's message stream.
        """
    @property
    def codec(self, /) -> Codec:
        """
        The codec.
        """
    def load_state_dict(self, /, state: Any) -> None:
        """
        Restore a state saved by `state_dict`; the next `run` continues bit for bit.
        """
    def run(self, /, x: Any, out: Any | None = None, seed=0) -> dict:
        """
        One all-reduce of `x` (a float32 array of `len(self)` elements) into `out`, or in
        place when `out` is None. `seed` seeds the step's random draws and must be the
        same on every rank (change it every step). Every rank must call `run` the same
        number of times, in the same order as its other all-reduces on the same peers.
        Returns what this rank did: `strategy`, `bytes_sent`, `messages`.
        """
    def state_dict(self, /) -> dict:
        """
        This rank's error-feedback residuals (strategy and codec with them), to restore
        with `load_state_dict` into an all-reduce made with the same arguments.
        """
    @property
    def strategy(self, /) -> str:
        """
        The strategy this all-reduce runs (the cost model's choice for "auto").
        """

@final
class BucketGather:
    """
    The all-gather of a bucket of tensors that the caller encodes, each tensor with a
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
    def __new__(cls, /, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, op: str = "mean", tag: SupportsIndex = 0, shared_memory: Any | None = None, host: SupportsGetItem[int, SupportsIndex] | None = None, shared_memory_timeout: SupportsFloat | SupportsIndex = 300.0, send_recv: Any | None = None, transport: Tcp | None = None) -> BucketGather: ...
    def __repr__(self, /) -> str: ...
    @property
    def calls(self, /) -> int:
        """
        Calls of `run` so far.
        """
    def encode_run(self, /, x: Any, parts: SupportsGetItem[int, tuple[SupportsIndex, SupportsIndex, Any, Any, ErrorFeedback | None]], *, seed, step, checksum: bool = False) -> dict:
        """
        Encode each of `parts` into one message and run it: a part is `(start, length,
        codec, key, feedback)`, the tensor `x[start : start + length]` encoded with
        `codec` (through the `ErrorFeedback` `feedback` when not None) and the seed the
        crate derives from `seed`, `step`, the tensor's `key` and this rank; each part's
        sum or mean over the ranks is written back into `x`. All in the crate with the
        GIL released; the message and a peer's are bounded by the parts' longest frames.
        """
    def run(self, /, message: Any, segments: SupportsGetItem[int, tuple[SupportsIndex, SupportsIndex]], out: Any, max_message: SupportsIndex | None = None) -> dict:
        """
        Gather every rank's `message` (its frames for the tensors at `segments` of `out`,
        `(start, length)` pairs, concatenated in that order) and set each segment of `out`
        to the sum (or mean) of the ranks' frames for it, in rank order; `max_message`
        bounds every rank's message. Returns this rank's `strategy`, `bytes_sent` and
        `messages`.
        """

@final
class Codec:
    """
    A codec and its parameters, parsed from a spec string.

    Specs are ``name`` or ``name:key=value,...``: ``'fp16'``, ``'bf16'``,
    ``'fp8:format=e4m3,block=128'`` (OCP 8-bit floats, E4M3 or E5M2, with an f32 or
    E8M0 scale per block, or ``scale=none``), ``'int8:block=256,rounding=stochastic'``, ``'qsgd:bits=4'``, ``'sign'``,
    ``'ternary'``, ``'natural'``, ``'topk:ratio=0.01,values=fp16'``,
    ``'randk:ratio=0.01'``, ``'dct:chunk=64,k=4'`` (a DCT per tile of ``chunk``
    elements, its ``k`` largest coefficients kept; ``width=`` for 2-D tiles),
    ``'identity'`` (float32). Parameters not given take their defaults; :attr:`spec`
    spells them all out.
    """
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self, /) -> int: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __new__(cls, /, spec: Any) -> Codec: ...
    def __reduce__(self, /) -> tuple[type, tuple[str]]:
        """
        Pickles as its spec.
        """
    def __repr__(self, /) -> str: ...
    def __str__(self, /) -> str: ...
    def bits_per_element(self, /, n: SupportsIndex) -> float:
        """
        Bits per element on the wire for a tensor of `n` elements, header included.
        """
    def encode(self, /, x: Any, seed=0, offset=0, checksum: bool = False) -> bytes:
        """
        Encode `x`; see `gradpack.encode`.
        """
    def encode_into(self, /, x: Any, out: Any, seed=0, offset=0, checksum: bool = False) -> int:
        """
        Encode `x` into the uint8 buffer `out`; see `gradpack.encode_into`.
        """
    def error_bound(self, /, absmax: SupportsFloat | SupportsIndex) -> float:
        """
        The largest error of one decoded element for inputs with absolute maximum
        `absmax` (infinite for codecs that drop elements).
        """
    def max_encoded_len(self, /, n: SupportsIndex, checksum: bool = False) -> int:
        """
        The longest frame `n` elements can encode to (a buffer this long always
        suffices), plus 4 bytes with `checksum`.
        """
    @property
    def name(self, /) -> str:
        """
        The codec's name (`'int8'`, `'topk'`, ...).
        """
    @property
    def spec(self, /) -> str:
        """
        The canonical spec, every parameter spelled out; parses back to an equal codec.
        """
    @property
    def unbiased(self, /) -> bool:
        """
        Whether decode(encode(x)) equals x in expectation.
        """

@final
class CodecProfile:
    """
    A codec's size on the wire and speed on this CPU, as the cost model uses them.
    Speeds are bytes of float32 input per second.
    """
    def __new__(cls, /, spec: str, bits_per_element: SupportsFloat | SupportsIndex, encode_bytes_per_s: SupportsFloat | SupportsIndex = ..., decode_bytes_per_s: SupportsFloat | SupportsIndex = ..., decode_add_bytes_per_s: SupportsFloat | SupportsIndex = ...) -> CodecProfile: ...
    def __repr__(self, /) -> str: ...
    @property
    def bits_per_element(self, /) -> float: ...
    @bits_per_element.setter
    def bits_per_element(self, /, value: SupportsFloat | SupportsIndex) -> None: ...
    @property
    def decode_add_bytes_per_s(self, /) -> float: ...
    @decode_add_bytes_per_s.setter
    def decode_add_bytes_per_s(self, /, value: SupportsFloat | SupportsIndex) -> None: ...
    @property
    def decode_bytes_per_s(self, /) -> float: ...
    @decode_bytes_per_s.setter
    def decode_bytes_per_s(self, /, value: SupportsFloat | SupportsIndex) -> None: ...
    @property
    def encode_bytes_per_s(self, /) -> float: ...
    @encode_bytes_per_s.setter
    def encode_bytes_per_s(self, /, value: SupportsFloat | SupportsIndex) -> None: ...
    @property
    def ratio(self, /) -> float:
        """
        Compression ratio against float32.
        """
    @property
    def spec(self, /) -> str: ...
    @spec.setter
    def spec(self, /, value: str) -> None: ...

@final
class ErrorFeedback:
    """
    Error feedback for one tensor of ``n`` elements.

    Each :meth:`encode` sends ``beta * residual + gamma * grad`` and keeps what the codec
    dropped as the next residual, in the same pass as the encode. Codecs that are not
    contractive (random-k with ``scale=unbiased``, QSGD with few levels per block) make
    the residual grow and are refused unless ``allow_non_contractive``. ``residual``
    is ``'f32'`` (exact) or ``'bf16'`` (half the memory; fixed-rate codecs only).

    The state survives a checkpoint: :meth:`state_dict` returns plain values (a
    versioned, checksummed blob inside) that :meth:`load_state_dict` restores bit for
    bit.
    """
    def __len__(self, /) -> int: ...
    def __new__(cls, /, codec: Any, n: SupportsIndex, beta: SupportsFloat | SupportsIndex = 1.0, gamma: SupportsFloat | SupportsIndex = 1.0, residual: str = "f32", allow_non_contractive: bool = False) -> ErrorFeedback: ...
    def __repr__(self, /) -> str: ...
    @property
    def codec(self, /) -> Codec:
        """
        The codec.
        """
    def encode(self, /, grad: Any, seed=0, offset=0, checksum: bool = False) -> bytes:
        """
        Encode `grad` plus the residual, and keep the new residual.
        """
    def encode_into(self, /, grad: Any, out: Any, seed=0, offset=0, checksum: bool = False) -> int:
        """
        Encode into the uint8 array `out` (at least `max_encoded_len()` bytes); returns
        the frame length.
        """
    def load_state_dict(self, /, state: Any) -> None:
        """
        Restore a state saved by `state_dict` (same codec and length); bit-identical.
        """
    def max_encoded_len(self, /, checksum: bool = False) -> int:
        """
        The longest frame `encode` can return (plus 4 bytes with `checksum`).
        """
    @property
    def memory_bytes(self, /) -> int:
        """
        Bytes of residual state.
        """
    def reset(self, /) -> None:
        """
        Zero the residual.
        """
    def residual(self, /) -> Incomplete:
        """
        A copy of the residual as float32.
        """
    def set_residual(self, /, r: Any) -> None:
        """
        Replace the residual with the float32 array `r` of `len(self)` elements (rounded
        to bf16 for a bf16 residual).
        """
    def state_dict(self, /) -> dict:
        """
        The state as a dict of plain values (format tag, codec spec, length, and a
        versioned, checksummed blob), for `torch.save` or pickle.
        """

@final
class Hierarchical:
    """
    gradpack's two-level all-reduce (the Rust crate's
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
    def __len__(self, /) -> int: ...
    def __new__(cls, /, codec: Any, length: SupportsIndex, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, nodes: SupportsGetItem[int, SupportsIndex] | None = None, *, node_codec: Any | None = None, strategy: str = "auto", op: str = "mean", feedback: str = "none", pieces: SupportsIndex = 1, checksum: bool = True, tag: SupportsIndex = 0, bandwidth: SupportsFloat | SupportsIndex = 10e9, latency: SupportsFloat | SupportsIndex = 10e-6, beta: SupportsFloat | SupportsIndex = 1.0, gamma: SupportsFloat | SupportsIndex = 1.0, residual: str = "f32", allow_non_contractive: bool = False, shared_memory: Any | None = None, host: SupportsGetItem[int, SupportsIndex] | None = None, shared_memory_timeout: SupportsFloat | SupportsIndex = 300.0, send_recv: Any | None = None, transport: Tcp | None = None) -> Hierarchical: ...
    def __repr__(self, /) -> str: ...
    @property
    def codec(self, /) -> Codec:
        """
        The codec between nodes.
        """
    def load_state_dict(self, /, state: Any) -> None:
        """
        Restore a `state_dict`.
        """
    def run(self, /, x: Any, out: Any | None = None, seed=0) -> dict:
        """
        One all-reduce of `x` into `out`, or in place when `out` is None (as
        `AllReduce.run`).
        """
    def state_dict(self, /) -> dict:
        """
        The residuals of the streams between nodes.
        """
    @property
    def strategy(self, /) -> str:
        """
        The strategy of the streams between nodes.
        """

@final
class HookReducer:
    """
    The PyTorch hook's reducer, the crate's `sync::BucketReducer`: it decides each
    bucket's configuration (the float32 warm-up, the codec's default strategy, or
    measured `auto`'s `Tuner`), each tensor's codec (small tensors and vectors as
    float32, `dct_2d`), which matrices go as PowerSGD factors, and runs the bucket by the
    crate's collectives with their error feedback: the all-gather per tensor (residuals
    by tensor name), the ring, two-shot, majority vote or two-level all-reduce per bucket
    layout, PowerSGD's exchange, or one top-k over the model (`selection="model"`). It
    keeps that state and saves it by name.

    `codec` is the fixed codec, or None for measured `auto` (the `Tuner` passed to each
    call decides); `strategy` the strategy of a fixed codec (None: the crate's default
    for the codec at the world's size). `feedback` forces error feedback on or off
    (None: the crate's default per codec). `powersgd` is `(rank, warm_start, feedback,
    min_compression, start_step)` or None; `selection` the model's tensor names in order
    for one top-k over the model. Buckets of steps before `start_step` go as float32.
    """
    def __new__(cls, /, codec: Any | None, *, strategy: str | None = None, feedback: bool | None = None, seed: SupportsIndex = 0, checksum: bool = False, pieces: SupportsIndex = 1, small_below: SupportsIndex = 16384, dct_2d: bool = False, start_step: SupportsIndex = 0, node_codec: str = "identity", powersgd: tuple[SupportsIndex, bool, bool, SupportsFloat | SupportsIndex, SupportsIndex] | None = None, selection: SupportsGetItem[int, str] | None = None) -> HookReducer: ...
    def __repr__(self, /) -> str: ...
    def config(self, /, index: SupportsIndex, step: SupportsIndex, world: SupportsIndex, layout: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex]]], staging: SupportsFloat | SupportsIndex | None = None, tuner: Tuner | None = None) -> tuple[str, str, int | None]:
        """
        The configuration bucket `index` (its tensors `layout`, `(name, shape)` each)
        goes by at `step` on `world` ranks: `(codec spec or "mixed", route, trial)`.
        Route `"fp32"` is a float32 all-reduce of the whole bucket (the front end may run
        it on a transport of its own); `"powersgd"` sends the bucket's matrices as
        PowerSGD factors. `trial` is measured `auto`'s plan number while it is measured
        (record the bucket's time with `tuner.record`), else None. `staging` is bytes/s
        of a copy to the host and back, for a bucket on a device.
        """
    def connect(self, /, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, send_recv: Any | None = None, transport: Tcp | None = None, shared_memory: SharedMemory | None = None, node_memory: SharedMemory | None = None, nodes: SupportsGetItem[int, SupportsIndex] | None = None) -> None:
        """
        The transport of the collectives to come (as `gradpack.AllReduce`'s), the shared
        memory of this host's ranks (`shared_memory`) and of this host's ranks in this
        rank's node (`node_memory`, for the two-level all-reduce, which needs `nodes`).
        Collectives made before are dropped.
        """
    def disconnect(self, /) -> None:
        """
        Drop the transport and every collective made on it (the state stays: residuals,
        PowerSGD's and the rings' saved states); `connect` again before the next bucket.
        """
    def holds_state(self, /) -> bool:
        """
        Whether there is state to save by tensor name: a residual, a PowerSGD state, or a
        ring with error feedback.
        """
    def plain(self, /, layout: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex], SupportsIndex]], codec: str, route: str, step: SupportsIndex, tuner: Tuner | None = None) -> bool:
        """
        Whether a bucket of configuration `(codec, route)` is a float32 all-reduce of the
        whole bucket (stage a float64 bucket as it is, then).
        """
    def reduce(self, /, x: Any, index: SupportsIndex, step: SupportsIndex, layout: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex], SupportsIndex]], codec: str, route: str, tuner: Tuner | None = None) -> bool:
        """
        Reduce the bucket `x` (flat; `layout` its tensors, `(name, shape, key)` each, laid
        end to end) of `step` by configuration `(codec, route)` from `config`, into its
        mean over the ranks, with the GIL released. Returns False, and leaves `x` as it
        is, when the bucket is a float32 all-reduce for the front end to run (a float64
        bucket's always is); a float32 `x` otherwise. Every rank calls it for the same
        buckets in the same order.
        """
    def reduce_model(self, /, buckets: SupportsGetItem[int, tuple[Any, SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex], SupportsIndex]]]], step: SupportsIndex) -> None:
        """
        `selection` over the model: a step's `buckets` (`(x, layout)` each, `x` flat
        float32) reduced together, one top-k over every compressed tensor in the model's
        order with its error feedback, the others as float32 frames, in one all-gather;
        each `x` then holds its mean over the ranks.
        """
    def residuals(self, /) -> dict:
        """
        Every tensor's error-feedback residual by name (float32 copies).
        """
    def restore_state(self, /, state: NamedState) -> None:
        """
        Take up a `NamedState`'s residuals, PowerSGD state and rings, each used when its
        tensor or layout next comes; the collectives made so far are dropped. PowerSGD
        state for a reducer without PowerSGD is refused, changing nothing.
        """
    @property
    def rings_made(self, /) -> int:
        """
        How many ring, two-shot, majority and two-level all-reduces are made now (one per
        bucket layout in use).
        """
    def save_state(self, /, settings: SupportsGetItem[int, tuple[str, str]], step: SupportsIndex, velocities: dict, plan: SupportsGetItem[int, SupportsIndex] | None) -> bytes:
        """
        The state as the crate's named-state blob: `settings` (`(key, value)` pairs),
        `step`, momentum's `velocities` (name to float32 array) and measured auto's
        `plan` beside this reducer's residuals, PowerSGD state and rings.
        """

@final
class ModelSelection:
    """
    One top-k over every compressed tensor of a step's buckets, in the model's order,
    for a framework that reduces in buckets of its own (the PyTorch hook's
    `selection="model"`).

    `codec` is a `topk` codec; `feedback` keeps one error feedback over the selected
    vector; `order` names the model's tensors in its order (a name not among them goes
    after the named ones, in the order it comes). Tensors of fewer than `small_below`
    elements, and vectors, go as float32 frames beside the selection (with `dct_2d` as
    in `tensor_codec`). Residuals are kept by tensor name, so a regrouping of the buckets
    carries each tensor's residual over.
    """
    def __new__(cls, /, codec: Any, order: SupportsGetItem[int, str], *, feedback: bool = True, small_below: SupportsIndex = 0, dct_2d: bool = False) -> ModelSelection: ...
    def __repr__(self, /) -> str: ...
    def reduce(self, /, gather: BucketGather, buckets: SupportsGetItem[int, tuple[Any, SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex], SupportsIndex]]]], *, seed: SupportsIndex, step: SupportsIndex, checksum: bool = False) -> dict:
        """
        Reduce a step's `buckets` together: each `(x, tensors)`, `x` a flat float32
        array and `tensors` its `(name, shape, key)` laid end to end (`key` seeds the
        tensor's frame when it goes as float32). Every rank passes its buckets of the same
        step, in any grouping and order. The message goes by `gather`; each `x` then holds
        its mean over the ranks. Seeds from `seed`, `step` and the rank; sealed with a
        payload CRC-32 when `checksum`. Returns the call's statistics.
        """
    def residuals(self, /) -> dict:
        """
        Every tensor's residual by name (float32 copies).
        """
    def restore(self, /, residuals: dict) -> None:
        """
        Replace every residual with `residuals` (name to float32 array), each taken up
        when its tensor next comes.
        """

@final
class Momentum:
    """
    Momentum correction by tensor name, for a framework that regroups its buckets: each
    rank keeps a float32 velocity per tensor, `u = momentum * u + g`, and sends it in
    place of the gradient (give the optimizer no momentum of its own). The sync engine's
    `momentum` option updates with the same arithmetic.
    """
    def __new__(cls, /, momentum: SupportsFloat | SupportsIndex) -> Momentum: ...
    def __repr__(self, /) -> str: ...
    def apply(self, /, x: Any, tensors: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex]]]) -> None:
        """
        One step on a bucket: `x` (flat float32) holds the gradients of `tensors`
        (`(name, shape)` each) laid end to end, and each is replaced by its tensor's new
        velocity (zero before a tensor's first step). With the GIL released.
        """
    def restore(self, /, velocities: dict) -> None:
        """
        Replace every velocity with `velocities` (name to float32 array).
        """
    def velocities(self, /) -> dict:
        """
        Every velocity by name (float32 copies).
        """

@final
class NamedState:
    """
    What a front end that forms its own buckets carries across steps, by tensor name, as
    one saved blob that any front end reads (the crate's `sync::NamedState`; the PyTorch
    hook's `state_dict` holds one): `settings` (`(key, value)` pairs), the `step`, the
    error-feedback `residuals`, momentum's `velocities` and PowerSGD's `low_rank` state
    (`(q or None, residual)`) by name, the saved `collectives` that run on a whole
    bucket (by their tensors' names joined with `,`, a list of blobs each) and measured
    auto's `plan` (a `Tuner` blob, or None).
    """
    def __new__(cls, /, settings: SupportsGetItem[int, tuple[str, str]] = ..., step: SupportsIndex = 0, residuals: dict | None = None, velocities: dict | None = None, low_rank: dict | None = None, collectives: dict | None = None, plan: SupportsGetItem[int, SupportsIndex] | None = None) -> NamedState: ...
    def __repr__(self, /) -> str: ...
    def check(self, /, mine: SupportsGetItem[int, tuple[str, str]]) -> None:
        """
        Raise unless the state was saved with each of `mine` (`(key, value)` pairs),
        naming the first that differs or is missing.
        """
    @property
    def collectives(self, /) -> dict: ...
    @staticmethod
    def load(blob: bytes) -> NamedState:
        """
        Read a blob written by `save` (by any front end); a damaged one raises.
        """
    @property
    def low_rank(self, /) -> dict: ...
    @property
    def plan(self, /) -> bytes | None: ...
    @property
    def residuals(self, /) -> dict: ...
    def save(self, /) -> bytes:
        """
        The state as one blob: versioned, with a CRC-32.
        """
    @property
    def settings(self, /) -> list[tuple[str, str]]: ...
    @property
    def step(self, /) -> int: ...
    @property
    def velocities(self, /) -> dict: ...

@final
class OuterSync:
    """
    DiLoCo's outer synchronisation on rank ``rank`` of ``world`` (the Rust crate's
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
    def __new__(cls, /, names: SupportsGetItem[int, str], shapes: SupportsGetItem[int, SupportsGetItem[int, SupportsIndex]], params: SupportsGetItem[int, Any], rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, sync_every: SupportsIndex = 500, fragments: SupportsIndex = 1, assignment: SupportsGetItem[int, SupportsIndex] | None = None, delay: SupportsIndex = 0, alpha: SupportsFloat | SupportsIndex = 0.0, outer_lr: SupportsFloat | SupportsIndex = 0.7, outer_momentum: SupportsFloat | SupportsIndex = 0.9, nesterov: bool = True, codec: Any | None = None, feedback: str = "none", strategy: str = "auto", pieces: SupportsIndex = 1, checksum: bool = True, seed=0, bandwidth: SupportsFloat | SupportsIndex = 10e9, latency: SupportsFloat | SupportsIndex = 10e-6, beta: SupportsFloat | SupportsIndex = 1.0, gamma: SupportsFloat | SupportsIndex = 1.0, residual: str = "f32", allow_non_contractive: bool = False, send_recv: Any | None = None, transport: Tcp | None = None) -> OuterSync: ...
    def __repr__(self, /) -> str: ...
    def due(self, /) -> tuple[list[int], list[int]]:
        """
        What the next `step` does: `(send, apply)`, the fragments whose pseudo-gradients
        it forms and those whose outer step it applies. Only their tensors are read or
        written.
        """
    @property
    def fragments(self, /) -> list[list[int]]:
        """
        The tensors of every fragment, in layout order.
        """
    def heal(self, /, params: SupportsGetItem[int, Any]) -> dict:
        """
        Make the members' states one again after :meth:`reform` (a collective call of
        every member, with its parameters: float32 arrays, one per tensor). The member
        with the newest state sends it, bit for bit, to each member whose state differs
        (their parameters become the outer copy, their residuals zero), and every sync
        that failed runs again among the members that hold its pseudo-gradient. Returns
        `source`, `healed` (ranks), `was_healed`, `retried` (fragment and the members
        its mean is over), `dropped` (fragments no member could send), `applied` and
        `bytes_sent`.
        """
    @property
    def inner_step(self, /) -> int:
        """
        Inner steps taken so far.
        """
    def load_state_dict(self, /, state: Any) -> None:
        """
        Restore a state saved by `state_dict`; with the model of the same step, training
        continues bit for bit.
        """
    def outer(self, /, i: SupportsIndex) -> Incomplete:
        """
        A copy of the outer parameters of tensor `i` (a flat float32 array).
        """
    def reform(self, /, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, send_recv: Any | None = None, transport: Tcp | None = None) -> None:
        """
        Move onto the transport of a new membership (the members that remain and those
        that join; the same arguments as the constructor's), keeping this member's state;
        then every member calls :meth:`heal`, and steps are refused until it has. A member
        that joins makes a new synchroniser and calls :meth:`heal` too. The former
        transport is closed. Nothing changes on an error.
        """
    def state_dict(self, /) -> dict:
        """
        The state (step, outer copy, momentum, residuals, results not yet applied), to
        restore with `load_state_dict` into a synchroniser made with the same arguments
        on the same rank. Waits for the all-reduces in flight.
        """
    def step(self, /, params: SupportsGetItem[int, Any] | None = None) -> dict:
        """
        Call after every inner step with the rank's parameters (float32 arrays, one per
        tensor; `None` when `due()` is empty). Returns `sent`, `applied`, `bytes_sent` and
        `messages` (those of the applied fragments).
        """

@final
class PowerSgdBucket:
    """
    PowerSGD (Vogels et al., 2019) for one bucket of matrices, whose two all-reduces
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
    def __len__(self, /) -> int: ...
    def __new__(cls, /, shapes: SupportsGetItem[int, SupportsGetItem[int, SupportsIndex]], rank: SupportsIndex = 2, warm_start: bool = True, feedback: bool = True, min_compression: SupportsFloat | SupportsIndex = 2.0, offsets: SupportsGetItem[int, SupportsIndex] | None = None, length: SupportsIndex | None = None) -> PowerSgdBucket: ...
    def __repr__(self, /) -> str: ...
    def exchange(self, /, m: Any, seed, plain: SupportsGetItem[int, tuple[SupportsIndex, SupportsIndex]], first: AllReduce, second: AllReduce) -> bool:
        """
        A whole step over the ranks: `p_step`, the float32 all-reduce `first` of every
        matrix's P followed by the tensors `plain` (`(start, length)` ranges of `m` that go
        as float32, written back with their mean), `q_step`, the all-reduce `second` of Q,
        and `finish` in place, all in the crate with the GIL released. `first` and
        `second` are float32 mean all-reduces of `p_len` plus the ranges' elements and of
        `q_len` elements. Returns `finish`'s flag.
        """
    def finish(self, /, m: Any, p: Any, q: Any, out: Any | None = None) -> bool:
        """
        Step 3: `q` is the mean over ranks; `out` (or `m` itself when `out` is None)
        gets P Q^T, the residuals and the warm start are kept. False (and the result all
        NaN) if the factors were not finite.
        """
    def matrix_state(self, /, i: SupportsIndex) -> tuple[Incomplete | None, Incomplete]:
        """
        Matrix `i`'s state: (its warm-start Q as float32, or None; its residual).
        """
    @property
    def p_len(self, /) -> int:
        """
        Elements of the first all-reduce (every matrix's P).
        """
    def p_step(self, /, m: Any, seed, p: Any) -> None:
        """
        Step 1: `m` (this rank's gradients of the bucket) becomes M = m + residual and
        `p` gets this rank's P = M Q.
        """
    @property
    def q_len(self, /) -> int:
        """
        Elements of the second all-reduce (every matrix's Q).
        """
    def q_step(self, /, m: Any, p: Any, q: Any) -> None:
        """
        Step 2: `p` is the mean over ranks; orthonormalised in place, and `q` gets this
        rank's Q = M^T P.
        """
    def reset(self, /) -> None:
        """
        Zero the residuals and draw a fresh Q at the next step.
        """
    def restore(self, /, blob: bytes) -> None:
        """
        Restore a blob of `save` from a bucket of the same matrices and settings.
        """
    def save(self, /) -> bytes:
        """
        The state as a versioned, checksummed blob.
        """
    def set_matrix_state(self, /, i: SupportsIndex, q: Any | None, residual: Any) -> None:
        """
        Set matrix `i`'s state as `matrix_state` gave it.
        """

@final
class PowerSgdByName:
    """
    PowerSGD over a framework's own buckets: one `PowerSgdBucket` per set of matrix names,
    each matrix's warm-start Q and residual following it by name when the buckets
    regroup. The settings are `PowerSgdBucket`'s.
    """
    def __new__(cls, /, rank: SupportsIndex = 2, warm_start: bool = True, feedback: bool = True, min_compression: SupportsFloat | SupportsIndex = 2.0) -> PowerSgdByName: ...
    def __repr__(self, /) -> str: ...
    def exchange(self, /, names: SupportsGetItem[int, str], shapes: SupportsGetItem[int, tuple[SupportsIndex, SupportsIndex, SupportsIndex]], offsets: SupportsGetItem[int, SupportsIndex], m: Any, seed: SupportsIndex, step: SupportsIndex, plain: SupportsGetItem[int, tuple[SupportsIndex, SupportsIndex]], first: AllReduce, second: AllReduce) -> bool:
        """
        A whole PowerSGD step on the bucket `m` (flat float32) whose matrices `names` are
        `shapes` (`(n, m, r)` each) at `offsets`: their bucket's state (made, and filled
        by name, when this set of names is new), then `PowerSgdBucket.exchange` with the
        seed the crate derives from `seed`, `step` and the names, the float32 ranges
        `plain` and the all-reduces `first` and `second`. Returns its flag (False: the
        factors were not finite).
        """
    def restore(self, /, states: dict) -> None:
        """
        Replace every matrix's state with `states` (name to `(q or None, residual)`),
        each taken up when its bucket next forms.
        """
    def states(self, /) -> dict:
        """
        Every matrix's state by name: `(q, residual)` float32 arrays (`q` None when
        unset).
        """

@final
class SharedMemory:
    """
    Shared-memory rings (and, with `stage` bytes, a stage for the two-level all-reduce's
    reduction in place) between the ranks `host` of one host (this rank, `rank` of
    `world`, among them), under the name `name` (letters, digits, `-`, `_`; the same on
    the ranks of the host, new for each set). Each ring holds `capacity` bytes (a
    multiple of 64, default 1 MiB; the same on the host's ranks): a longer message streams
    through it. Construction waits up to `timeout` seconds for the host's other ranks.
    `job` (an integer below 2**64, the same on the host's ranks, drawn anew for each job)
    is recorded in each rank's file: a peer's file of another job is refused, so two jobs
    that picked one name fail at set-up instead of pairing their ranks.

    Pass it as `shared_memory=` to any number of `AllReduce`, `BucketGather` and
    `Hierarchical` collectives of this rank: they share its memory (1 MiB per other rank
    of the host, plus the stage) instead of mapping their own, which a job with a
    collective per bucket of a large model would multiply past a container's `/dev/shm`
    (often 64 MiB). Collectives that share one must run one at a time, in the same order
    on every rank of the host (as the PyTorch hook runs its buckets).
    """
    def __new__(cls, /, name: str, rank: SupportsIndex, world: SupportsIndex, host: SupportsGetItem[int, SupportsIndex], *, timeout: SupportsFloat | SupportsIndex = 300.0, stage: SupportsIndex = 0, capacity: SupportsIndex | None = None, job: SupportsIndex = 0) -> SharedMemory: ...
    def __repr__(self, /) -> str: ...
    @property
    def host(self, /) -> list[int]:
        """
        The ranks of this host, ascending.
        """
    @property
    def staged(self, /) -> bool:
        """
        Whether it has a stage (for the two-level all-reduce's reduction in place).
        """

@final
class Tcp:
    """
    gradpack's native transport between ranks on any hosts: one TCP connection per pair
    of ranks, made once, that every collective of this rank made with it (`transport=`)
    shares. No message of a collective passes through Python: the collectives send and
    receive from Rust with the GIL released.

    Made by one of its constructors, which exchange the ranks' listening addresses and a
    job token (drawn at random by rank 0) and then connect every pair: `from_store`
    (through a `torch.distributed` store), `from_mpi` (one `allgather` on an mpi4py
    communicator) or `from_env` (torchrun's `MASTER_ADDR`, `MASTER_PORT`, `RANK` and
    `WORLD_SIZE`, with rank 0 listening on `MASTER_PORT` to hand the addresses out). A
    connection whose handshake carries another token, world or rank is refused and
    reported on standard error, and set-up goes on.

    `interface` names the interface to listen on (a name such as `"eth0"`, or an
    address); without it, `GRADPACK_SOCKET_IFNAME` does if set, else the constructor's
    default (its docs say which). `timeout` (seconds) bounds set-up, each receive and
    each queued send: a peer that sends nothing for that long, or whose connection
    closes, is an error on this rank, never a hang. Collectives sharing one `Tcp` must
    run one at a time, in the same order on every rank (give each its own `tag`).
    """
    def __repr__(self, /) -> str: ...
    @property
    def address(self, /) -> str:
        """
        The address this rank listened on for its peers (`"ip:port"`).
        """
    @staticmethod
    def from_env(*, interface: str | None = None, timeout: SupportsFloat | SupportsIndex = 300.0) -> Tcp:
        """
        The ranks of a job started by torchrun (or anything that sets `MASTER_ADDR`,
        `MASTER_PORT`, `RANK` and `WORLD_SIZE`): rank 0 listens on `MASTER_PORT`, which must
        be free (not the port of torch's own store: give this job another), collects the
        addresses and hands them out. Default interface: the one this host reaches
        `MASTER_ADDR` from.
        """
    @staticmethod
    def from_mpi(comm: Any, *, interface: str | None = None, timeout: SupportsFloat | SupportsIndex = 300.0) -> Tcp:
        """
        Every rank of the mpi4py communicator `comm` (its `Get_rank()` and `Get_size()`),
        the addresses exchanged by one `comm.allgather`. Default interface: the address
        this host's name resolves to.
        """
    @staticmethod
    def from_store(store: Any, rank: SupportsIndex, world: SupportsIndex, *, key: str = "gradpack/tcp", interface: str | None = None, timeout: SupportsFloat | SupportsIndex = 300.0) -> Tcp:
        """
        Rank `rank` of `world` through a `torch.distributed` store (the one
        `init_process_group` made: `torch.distributed.distributed_c10d._get_default_store()`,
        or any `TCPStore`): each rank sets `key/<rank>` to its address and reads the
        others'. `key` must be new for each set of connections (a job's random token, say).
        Default interface: the one this host reaches the store's host from.
        """
    @property
    def rank(self, /) -> int:
        """
        This rank.
        """
    @property
    def world(self, /) -> int:
        """
        The number of ranks.
        """

@final
class TensorGather:
    """
    A bucket's all-gather, each tensor with its own codec and its error feedback kept by
    tensor name (so a regrouping of the buckets keeps each tensor's residual). Error
    feedback as `wants_feedback(codec, feedback)` says.
    """
    def __new__(cls, /, feedback: bool | None = None) -> TensorGather: ...
    def __repr__(self, /) -> str: ...
    def reduce(self, /, gather: BucketGather, x: Any, tensors: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex], SupportsIndex, Any | None]], *, seed: SupportsIndex, step: SupportsIndex, checksum: bool = False) -> dict:
        """
        Reduce the bucket `x` (flat float32): `tensors` are its `(name, shape, key,
        codec)` laid end to end (`codec` `None`: left as it is). Each goes with its codec
        through its residual where error feedback is on, seeded from `seed`, `step`, its
        `key` and the rank; the frames go as one message by `gather`, and each tensor's
        mean over the ranks is written back. Returns the call's statistics.
        """
    def residuals(self, /) -> dict:
        """
        Every residual by name (float32 copies).
        """
    def restore(self, /, residuals: dict) -> None:
        """
        Replace every residual with `residuals` (name to float32 array), each taken up
        when its tensor next goes with error feedback.
        """

@final
class Tuner:
    """
    Measured `auto`: per bucket, float32 and the configurations (codec and route) the
    cost model ranks fastest, measured in turn on the real bucket; every rank keeps the
    one with the smallest mean of the ranks' best times, float32 on a tie, so none
    measured slower than float32 is ever kept.

    `profiles` are the measured speeds of every candidate and of `"identity"` (every rank
    passes the same: average them over the ranks). `routes` are those tried besides
    float32: `"allgather"`, `"ring"`, `"twoshot"`, `"hierarchical"` (which needs `nodes`, the node of
    every rank). `bandwidth` (bit/s) and `latency` (s) are the link between ranks (between
    nodes, with `nodes`); `intra_bandwidth` and `intra_latency` the link inside a node.
    Tensors of fewer than `small_below` elements, and vectors, go as float32 by the
    all-gather; `dct_2d` sends a `dct` codec of `width=0` in tiles of each matrix's rows.
    `trials` configurations are measured besides float32, `trial_steps` steps each.
    """
    def __new__(cls, /, world: SupportsIndex, profiles: SupportsGetItem[int, CodecProfile], candidates: SupportsGetItem[int, str], *, routes: SupportsGetItem[int, str] = ..., bandwidth: SupportsFloat | SupportsIndex, latency: SupportsFloat | SupportsIndex = 50e-6, intra_bandwidth: SupportsFloat | SupportsIndex = 40e9, intra_latency: SupportsFloat | SupportsIndex = 5e-6, nodes: SupportsGetItem[int, SupportsIndex] | None = None, small_below: SupportsIndex = 16384, dct_2d: bool = False, trials: SupportsIndex = 2, trial_steps: SupportsIndex = 2) -> Tuner: ...
    def choice_of(self, /, name: str) -> tuple[str, str] | None:
        """
        The configuration decided for the tensor `name`: `(codec spec, route)`, or
        `None`.
        """
    def decided(self, /) -> bool:
        """
        Whether every bucket's plan (as of its last :meth:`next`) is decided.
        """
    def modelled(self, /, codec: str, route: str, layout: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex]]], staging: SupportsFloat | SupportsIndex | None = None) -> float:
        """
        The modelled time (s) of a bucket (`(name, shape)` of each tensor) with `codec`
        by `route`, plus the copies to the host and back at `staging` bytes/s if given.
        """
    def modelled_best(self, /, elements: SupportsIndex) -> str:
        """
        The candidate the model ranks fastest for a tensor of `elements` elements.
        """
    def next(self, /, bucket: SupportsIndex, layout: SupportsGetItem[int, tuple[str, SupportsGetItem[int, SupportsIndex]]], staging: SupportsFloat | SupportsIndex | None = None) -> tuple[str, str, int | None]:
        """
        The configuration bucket `bucket` (a list of `(name, shape)` of its tensors, in
        order) goes by this step: `(codec spec or "mixed", route, trial)`, `trial` being
        the plan's number to pass to :meth:`record` with the time, or `None` once the
        plan is decided. `staging`: bytes/s of a copy to the host and back, for a bucket
        that lives on a device.
        """
    def plan(self, /) -> list[dict]:
        """
        The plan of the buckets as of their last :meth:`next`: one dict per bucket and
        configuration tried, with ``bucket``, ``tensors``, ``elements``, ``codec``
        (``"float32"`` for the float32 all-reduce), ``strategy`` (``"all-reduce"`` for
        it), ``modelled_ms``, ``measured_ms`` (the mean of the ranks' best; ``None``
        until measured) and ``chosen``.
        """
    def record(self, /, trial: SupportsIndex, seconds: SupportsFloat | SupportsIndex, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, tag: SupportsIndex = ..., send_recv: Any | None = None, transport: Tcp | None = None) -> bool:
        """
        Record `seconds`, the time of a trial of plan `trial`. After the plan's last
        trial this is a collective on the transport given (as for :func:`gradpack.agree`):
        the ranks share their times and keep the fastest configuration. Returns whether
        the plan is decided now.
        """
    def restart(self, /, trial: SupportsIndex) -> None:
        """
        Measure plan `trial` again from its first configuration, forgetting its times:
        call it on every rank when a trial's reduction failed (a failed sharing of the
        times restarts its plan by itself).
        """
    def restore(self, /, blob: bytes) -> None:
        """
        Restore a :meth:`save` (a damaged blob raises and changes nothing).
        """
    def save(self, /) -> bytes:
        """
        The decided plans and each tensor's choice, as the crate's versioned,
        checksummed blob.
        """
    def table(self, /) -> str:
        """
        :meth:`plan` as a text table, the chosen rows marked with ``*``.
        """
    def time(self, /, codec: str, route: str, elements: SupportsIndex) -> float:
        """
        The cost model's time (s) of an all-reduce of `elements` elements with `codec`
        by `route`.
        """

def agree(settings: str, rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, tag: SupportsIndex = ..., send_recv: Any | None = None, transport: Tcp | None = None) -> None:
    """
    Check that every rank of `world` passes the same `settings` (`key=value` words
    separated by spaces), over the message callables of the collectives: each rank sends
    its settings to every other and compares what each sends, so a difference raises on
    every rank, naming the rank and the option. One exchange of its own.
    """

def allreduce_time(profile: CodecProfile, strategy: str, nodes: SupportsIndex, bandwidth: SupportsFloat | SupportsIndex, elements: SupportsFloat | SupportsIndex, latency: SupportsFloat | SupportsIndex = 0.0, reduce_bytes_per_s: SupportsFloat | SupportsIndex = ...) -> float:
    """
    Modelled seconds to all-reduce `elements` float32 values on `nodes` ranks joined by
    links of `bandwidth` bit/s and `latency` seconds per message, by `strategy`
    (`'fp32-ring'`, `'ring'`, `'allgather'`, `'majority'`, `'twoshot'`) with `profile`'s codec
    (the fp32 ring sums at `reduce_bytes_per_s`).
    """

def backend() -> str:
    """
    The SIMD backend the kernels run on (`'avx512'`, `'avx2'`, `'neon'` or `'scalar'`).
    """

def best_strategy(profile: CodecProfile, nodes: SupportsIndex, bandwidth: SupportsFloat | SupportsIndex, elements: SupportsFloat | SupportsIndex, latency: SupportsFloat | SupportsIndex = 0.0, reduce_bytes_per_s: SupportsFloat | SupportsIndex = ...) -> tuple[str, float]:
    """
    The fastest of the compressed ring, the two-shot (not for sparse codecs: top-k,
    random-k, chunked top-k) and the all-gather for `profile`'s codec: returns
    `(strategy name, modelled seconds)`.
    """

def break_even_bandwidth(profile: CodecProfile, nodes: SupportsIndex, elements: SupportsFloat | SupportsIndex, latency: SupportsFloat | SupportsIndex = 0.0, reduce_bytes_per_s: SupportsFloat | SupportsIndex = ...) -> float:
    """
    The link bandwidth (bit/s) below which `profile`'s codec all-reduces faster than a
    plain fp32 ring (infinite: always; 0: never).
    """

def calibrate(codec: Any, elements: SupportsIndex = ..., budget_s: SupportsFloat | SupportsIndex = 0.2) -> CodecProfile:
    """
    Measure ``codec``'s encode, decode and decode_add speed on this CPU on a
    synthetic gradient of ``elements`` elements (best of repetitions for about
    ``budget_s`` seconds); the result feeds :func:`allreduce_time`.
    """

def chunk_range(n: SupportsIndex, p: SupportsIndex, c: SupportsIndex) -> tuple[int, int]:
    """
    `(start, stop)` of chunk `c` when `n` elements are split into `p` chunks (sizes differ
    by at most one, larger first), as the crate's collectives split them.
    """

def decode(frame: Any, max_elements: SupportsIndex | None = None) -> Incomplete:
    """
    Decode any frame into a new 1-D float32 array.

    A frame needs no configuration: its header names the codec and parameters. Frames
    claiming more than ``max_elements`` elements (default: the most a frame of its
    length can legitimately hold) are refused before anything is allocated.
    """

def decode_add(frame: Any, acc: Any) -> None:
    """
    Decode any frame and add it element-wise into ``acc`` (the reduce step of a
    collective). The frame is fully validated first: on error ``acc`` is unchanged.
    """

def decode_into(frame: Any, out: Any) -> None:
    """
    Decode any frame into ``out``, a writable C-contiguous float32 array (or CPU
    tensor) holding exactly the frame's element count, in any shape.
    """

def default_strategy(codec: Any, world: SupportsIndex) -> str:
    """
    The strategy a fixed `codec` runs by at `world` ranks when none is named:
    `"fp32-ring"` for `"identity"`, `"ring"` from 3 ranks up for the quantisers (`fp16`,
    `bf16`, `int8`, `qsgd`, `natural`, `ternary`, `fp8`, `fp4`, `codebook`), else
    `"allgather"`.
    """

def encode(x: Any, codec: Any, seed=0, offset=0, checksum: bool = False) -> bytes:
    """
    Encode the float32 array ``x`` (any shape, read flat) into a frame. A bfloat16 or
    float16 tensor or array is widened to float32 first (exactly: with
    ``lossless:dtype=bf16`` or ``dtype=fp16`` its frame decodes to the same values).

    ``seed`` drives stochastic rounding and random-k selection (the same seed gives the
    same frame on every CPU); ``offset`` is the global index of ``x``'s first element in
    its tensor when ``x`` is a chunk; ``checksum`` seals the payload with a CRC-32 that
    decoding verifies.
    """

def encode_into(x: Any, out: Any, codec: Any, seed=0, offset=0, checksum: bool = False) -> int:
    """
    Encode ``x`` into ``out`` (a uint8 numpy array, uint8 torch tensor or bytearray
    of at least ``Codec(codec).max_encoded_len(x.size)`` bytes) and return the frame
    length. Allocates nothing.
    """

def frame_len(buf: Any) -> int:
    """
    The length of the frame at the start of ``buf``, from its header alone (which is
    checked): to cut a frame out of a longer buffer, such as a padded receive buffer.
    """

def inspect(frame: Any) -> dict:
    """
    Validate a frame's header and describe it.

    Returns a dict with ``codec``, ``spec``, ``elements``, ``payload_len``,
    ``frame_len``, ``seed``, ``offset``, ``nonfinite`` (the input held NaN or Inf),
    ``checksum`` (the payload is sealed) and ``bits_per_element``.
    """

def mean_over_ranks(values: SupportsGetItem[int, SupportsFloat | SupportsIndex], rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, tag: SupportsIndex = ..., send_recv: Any | None = None, transport: Tcp | None = None) -> list[float]:
    """
    The mean over the ranks of each rank's `values` (every rank passes as many): each
    rank's values sent to every other and summed in rank order, so every rank gets the
    same bits (as the tuner shares its times). A collective on the transport given.
    """

def measure_link(rank: SupportsIndex | None = None, world: SupportsIndex | None = None, send: Any | None = None, recv: Any | None = None, *, small: SupportsIndex = 1024, large: SupportsIndex = 4194304, repeats: SupportsIndex = 5, tag: SupportsIndex = ..., send_recv: Any | None = None, transport: Tcp | None = None) -> tuple[float, float]:
    """
    Estimate the link between the ranks as `(bandwidth bit/s, latency s)` by timing
    float32 ring all-reduces of `small` and `large` elements over the transport (the best
    of `repeats` each) and solving the ring's model for both; the times are averaged over
    the ranks, so every rank returns the same figures (pass them to `Tuner` or the cost
    model). A collective on the transport given, with the GIL released.
    """

def parse_bandwidth(s: str) -> float:
    """
    Parse a bandwidth such as `'10Gbit/s'`, `'1.25GB/s'` or `'100Mbps'` into bit/s.
    """

def parse_duration(s: str) -> float:
    """
    Parse a duration such as `'50us'`, `'1.5ms'` or `'2s'` into seconds.
    """

def powersgd_matrix(shape: SupportsGetItem[int, SupportsIndex], rank: SupportsIndex = 2, min_compression: SupportsFloat | SupportsIndex = 2.0) -> tuple[int, int, int] | None:
    """
    The ``(n, m, r)`` PowerSGD sends a tensor of ``shape`` as: ``n = shape[0]``
    rows, ``m`` the product of the other dimensions (a convolution's ``[out, in, kh,
    kw]`` is ``out x (in kh kw)``), rank ``r = min(rank, n, m)``; or ``None`` for a
    tensor of fewer than two dimensions or one that ``n m / ((n + m) r)`` says compresses
    less than ``min_compression`` times.
    """

def rank_seed(codec: Any, seed: SupportsIndex, rank: SupportsIndex) -> int:
    """
    The seed rank `rank` encodes with when a step's seed is `seed`: the same on every rank
    for random-k (all ranks keep the same indices), else mixed with the rank.
    """

def reduce_frames(frames: Any, out: Any, add: bool = False) -> None:
    """
    Decode every frame of ``frames`` (frames of one tensor, of any codecs) and sum
    them into ``out`` in list order, in one pass over it: the same bits as
    ``decode_into`` of the first and ``decode_add`` of each of the others, but the
    output is written once instead of once per frame (the sum of an all-gather).

    With ``add=True`` every frame is added into ``out``. Every header, length and
    fixed-rate payload is checked before ``out`` is written; an error names the
    frame's position in the list.
    """

def ring_time(profile: CodecProfile, nodes: SupportsIndex, bandwidth: SupportsFloat | SupportsIndex, elements: SupportsFloat | SupportsIndex, latency: SupportsFloat | SupportsIndex = 0.0, pieces: SupportsIndex = 1) -> float:
    """
    The modelled time in seconds of the compressed ring all-reduce of `elements` on
    `nodes` ranks whose chunks go as `pieces` frames each (a pipelined ring: a piece is
    encoded while the one before it is on the link), on links of `bandwidth` bit/s and
    `latency` s, with the speeds and bits of `profile`. With one piece it is
    `allreduce_time(profile, "ring", ...)`.
    """

def splitmix64(z: SupportsIndex) -> int:
    """
    The splitmix64 finaliser the crate derives every seed with.
    """

def tensor_codec(codec: str, shape: SupportsGetItem[int, SupportsIndex], small_below: SupportsIndex = 16384, dct_2d: bool = False) -> str:
    """
    The spec of the codec a tensor of `shape` is sent with when its bucket's codec is
    `codec`: float32 (``"identity"``) for tensors of fewer than `small_below` elements
    and for vectors; with `dct_2d`, a `dct` codec of `width=0` with each matrix's row
    length as its width (2-D tiles).
    """

def tensor_seed(codec: Any, base: SupportsIndex, step: SupportsIndex, key: SupportsIndex, rank: SupportsIndex) -> int:
    """
    The seed rank `rank` encodes a tensor with at step `step`: splitmix64 of `base` mixed
    with the step's and the tensor's `key`'s own splitmix64, then :func:`rank_seed` (what
    :meth:`BucketGather.encode_run` derives for each part).
    """

def two_level_time(profile: CodecProfile, strategy: str, hierarchical: bool, nodes: SupportsIndex, per_node: SupportsIndex, intra_bandwidth: SupportsFloat | SupportsIndex, inter_bandwidth: SupportsFloat | SupportsIndex, elements: SupportsFloat | SupportsIndex, intra_latency: SupportsFloat | SupportsIndex = 0.0, inter_latency: SupportsFloat | SupportsIndex = 0.0, node_bits: SupportsFloat | SupportsIndex = 32.0, reduce_bytes_per_s: SupportsFloat | SupportsIndex = ...) -> float:
    """
    Modelled seconds of an all-reduce of `elements` float32 values on `nodes` nodes of
    `per_node` ranks: links of `intra_bandwidth` bit/s (`intra_latency` s) inside a node,
    and each node's uplink of `inter_bandwidth` (`inter_latency`), shared by its ranks'
    streams. `hierarchical`: the two-level all-reduce (`node_bits` per element inside a
    node: 32, or 16 for bf16), else the flat one, by `strategy` with `profile`'s codec.
    """

def wants_feedback(codec: Any, choice: bool | None = None) -> bool:
    """
    Whether a tensor sent with `codec` gets error feedback: never for `"identity"`;
    `choice` when given; else exactly for `topk`, `chunktopk` and `sign`, which drop or
    flatten so much of each step's gradient that training needs the residual back.
    """
