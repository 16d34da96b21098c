"""Type stubs of the native module (the Rust part of the package). Use the functions
and classes of ``gradpack`` itself: they accept torch tensors and bytes-like frames and
convert them without copying before calling these."""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

HEADER_LEN: int

_F32 = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]
_Frame = Union[bytes, _U8]

class Error(ValueError): ...

class Codec:
    def __init__(self, spec: str) -> None: ...
    @property
    def spec(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def unbiased(self) -> bool: ...
    def bits_per_element(self, n: int) -> float: ...
    def max_encoded_len(self, n: int, checksum: bool = False) -> int: ...
    def error_bound(self, absmax: float) -> float: ...
    def encode(self, x: _F32, seed: int = 0, offset: int = 0, checksum: bool = False) -> bytes: ...

class ErrorFeedback:
    def __init__(
        self,
        codec: Union[str, Codec],
        n: int,
        beta: float = 1.0,
        gamma: float = 1.0,
        residual: str = "f32",
        allow_non_contractive: bool = False,
    ) -> None: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def memory_bytes(self) -> int: ...
    def __len__(self) -> int: ...
    def max_encoded_len(self, checksum: bool = False) -> int: ...
    def encode(self, grad: _F32, seed: int = 0, offset: int = 0, checksum: bool = False) -> bytes: ...
    def encode_into(
        self, grad: _F32, out: _U8, seed: int = 0, offset: int = 0, checksum: bool = False
    ) -> int: ...
    def residual(self) -> _F32: ...
    def set_residual(self, r: _F32) -> None: ...
    def reset(self) -> None: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class Tcp:
    @staticmethod
    def from_store(
        store: Any,
        rank: int,
        world: int,
        *,
        key: str = "gradpack/tcp",
        interface: Optional[str] = None,
        timeout: float = 300.0,
    ) -> Tcp: ...
    @staticmethod
    def from_mpi(comm: Any, *, interface: Optional[str] = None, timeout: float = 300.0) -> Tcp: ...
    @staticmethod
    def from_env(*, interface: Optional[str] = None, timeout: float = 300.0) -> Tcp: ...
    @property
    def rank(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def address(self) -> str: ...

class AllReduce:
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
        shared_memory: Optional[str] = None,
        host: Optional[List[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None: ...
    def run(self, x: _F32, out: Optional[_F32] = None, seed: int = 0) -> Dict[str, Any]: ...
    @property
    def strategy(self) -> str: ...
    @property
    def codec(self) -> Codec: ...
    @property
    def calls(self) -> int: ...
    def __len__(self) -> int: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class BucketGather:
    def __init__(
        self,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        *,
        op: str = "mean",
        tag: int = 0,
        shared_memory: Optional[str] = None,
        host: Optional[List[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None: ...
    def run(
        self, message: Any, segments: List[Tuple[int, int]], out: _F32, max_message: Optional[int] = ...
    ) -> Dict[str, Any]: ...
    @property
    def calls(self) -> int: ...

class Hierarchical:
    def __init__(
        self,
        codec: Union[str, Codec],
        length: int,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        nodes: Optional[List[int]] = None,
        *,
        node_codec: Union[str, Codec, None] = None,
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
        shared_memory: Optional[str] = None,
        host: Optional[List[int]] = None,
        shared_memory_timeout: float = 300.0,
        send_recv: Optional[Callable[[bytearray, int, int], Any]] = None,
        transport: Optional[Tcp] = None,
    ) -> None: ...
    def run(self, x: _F32, out: Optional[_F32] = None, seed: int = 0) -> Dict[str, Any]: ...
    @property
    def strategy(self) -> str: ...
    @property
    def codec(self) -> Codec: ...
    def __len__(self) -> int: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class OuterSync:
    def __init__(
        self,
        names: List[str],
        shapes: List[List[int]],
        params: List[_F32],
        rank: Optional[int] = None,
        world: Optional[int] = None,
        send: Optional[Callable[[bytearray, int], Any]] = None,
        recv: Optional[Callable[[int], Any]] = None,
        *,
        sync_every: int = 500,
        fragments: int = 1,
        assignment: Optional[List[int]] = None,
        delay: int = 0,
        alpha: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        codec: Union[str, Codec, None] = None,
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
    ) -> None: ...
    def due(self) -> Tuple[List[int], List[int]]: ...
    def step(self, params: Optional[List[_F32]] = None) -> Dict[str, int]: ...
    @property
    def fragments(self) -> List[List[int]]: ...
    @property
    def inner_step(self) -> int: ...
    def outer(self, i: int) -> _F32: ...
    def state_dict(self) -> Dict[str, Any]: ...
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

class PowerSgdBucket:
    def __init__(
        self,
        shapes: Any,
        rank: int = 2,
        warm_start: bool = True,
        feedback: bool = True,
        min_compression: float = 2.0,
        offsets: Optional[Any] = None,
        length: Optional[int] = None,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def p_len(self) -> int: ...
    @property
    def q_len(self) -> int: ...
    def p_step(self, m: _F32, seed: int, p: _F32) -> None: ...
    def q_step(self, m: _F32, p: _F32, q: _F32) -> None: ...
    def finish(self, m: _F32, p: _F32, q: _F32, out: Optional[_F32] = None) -> bool: ...
    def matrix_state(self, i: int) -> Tuple[Optional[_F32], _F32]: ...
    def set_matrix_state(self, i: int, q: Optional[_F32], residual: _F32) -> None: ...
    def reset(self) -> None: ...
    def save(self) -> bytes: ...
    def restore(self, blob: bytes) -> None: ...

def powersgd_matrix(shape: Any, rank: int = 2, min_compression: float = 2.0) -> Optional[Tuple[int, int, int]]: ...

class CodecProfile:
    spec: str
    bits_per_element: float
    encode_bytes_per_s: float
    decode_bytes_per_s: float
    decode_add_bytes_per_s: float
    def __init__(
        self,
        spec: str,
        bits_per_element: float,
        encode_bytes_per_s: float = ...,
        decode_bytes_per_s: float = ...,
        decode_add_bytes_per_s: float = ...,
    ) -> None: ...
    @property
    def ratio(self) -> float: ...

def encode(
    x: _F32, codec: Union[str, Codec], seed: int = 0, offset: int = 0, checksum: bool = False
) -> bytes: ...
def encode_into(
    x: _F32,
    out: _U8,
    codec: Union[str, Codec],
    seed: int = 0,
    offset: int = 0,
    checksum: bool = False,
) -> int: ...
def decode(frame: _Frame, max_elements: Optional[int] = None) -> _F32: ...
def decode_into(frame: _Frame, out: _F32) -> None: ...
def decode_add(frame: _Frame, acc: _F32) -> None: ...
def reduce_frames(frames: Sequence[_Frame], out: _F32, add: bool = False) -> None: ...
def inspect(frame: _Frame) -> Dict[str, Any]: ...
def frame_len(buf: _Frame) -> int: ...
def agree(
    rank: Optional[int],
    world: Optional[int],
    send: Optional[Callable[[bytearray, int], Any]],
    recv: Optional[Callable[[int], Any]],
    settings: str,
    *,
    tag: int = ...,
    send_recv: Optional[Callable[[bytearray, int, int], Any]] = ...,
    transport: Optional[Tcp] = ...,
) -> None: ...
def calibrate(codec: Union[str, Codec], elements: int = ..., budget_s: float = 0.2) -> CodecProfile: ...
def two_level_time(
    profile: CodecProfile,
    strategy: str,
    hierarchical: bool,
    nodes: int,
    per_node: int,
    intra_bandwidth: float,
    inter_bandwidth: float,
    elements: float,
    intra_latency: float = 0.0,
    inter_latency: float = 0.0,
    node_bits: float = 32.0,
    reduce_bytes_per_s: float = ...,
) -> float: ...
def allreduce_time(
    profile: CodecProfile,
    strategy: str,
    nodes: int,
    bandwidth: float,
    elements: float,
    latency: float = 0.0,
    reduce_bytes_per_s: float = ...,
) -> float: ...
def ring_time(
    profile: CodecProfile,
    nodes: int,
    bandwidth: float,
    elements: float,
    latency: float = 0.0,
    pieces: int = 1,
) -> float: ...
def best_strategy(
    profile: CodecProfile,
    nodes: int,
    bandwidth: float,
    elements: float,
    latency: float = 0.0,
    reduce_bytes_per_s: float = ...,
) -> Tuple[str, float]: ...
def break_even_bandwidth(
    profile: CodecProfile,
    nodes: int,
    elements: float,
    latency: float = 0.0,
    reduce_bytes_per_s: float = ...,
) -> float: ...
def parse_bandwidth(s: str) -> float: ...
def parse_duration(s: str) -> float: ...
def backend() -> str: ...
def splitmix64(z: int) -> int: ...
def rank_seed(codec: Union[str, Codec], seed: int, rank: int) -> int: ...
def chunk_range(n: int, p: int, c: int) -> Tuple[int, int]: ...
