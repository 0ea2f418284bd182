"""Tensor wire codec: raw bytes + dtype + shape, in chunks, checked against what was declared."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shared.errors import Reason, VisorError

DTYPES: dict[str, np.dtype[np.generic]] = {
    "uint8": np.dtype(np.uint8),
    "float16": np.dtype(np.float16),
}
# Visual-token compression profiles a request may name (core/compression.py defines them).
PROFILES = ("none", "low-latency", "balanced", "high-precision")
CHUNK_BYTES = 1 << 20  # 1 MiB pieces keep every message far below gRPC's 4 MiB default


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a tensor must be: checked before and after its bytes arrive."""

    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]  # C-order shape

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(DTYPES[self.dtype].itemsize)


def chunks(array: np.ndarray, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Yields the array's C-order bytes in pieces of at most `size`."""
    view = memoryview(np.ascontiguousarray(array).data).cast("B")
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])


class TensorAssembler:
    """Collects one tensor's chunks and refuses anything that does not match its spec."""

    def __init__(self, spec: TensorSpec) -> None:
        if spec.dtype not in DTYPES:
            raise VisorError(
                Reason.INVALID_REQUEST, f"tensor dtype must be one of {sorted(DTYPES)}"
            )
        self.spec = spec
        self._buf = bytearray()

    def add(self, data: bytes) -> None:
        if len(self._buf) + len(data) > self.spec.num_bytes:
            raise VisorError(Reason.INVALID_REQUEST, "tensor bytes exceed the declared shape")
        self._buf += data

    @property
    def complete(self) -> bool:
        return len(self._buf) == self.spec.num_bytes

    def array(self) -> np.ndarray:
        if not self.complete:
            raise VisorError(
                Reason.INVALID_REQUEST, "tensor bytes fall short of the declared shape"
            )
        flat: np.ndarray = np.frombuffer(bytes(self._buf), dtype=DTYPES[self.spec.dtype])
        return flat.reshape(self.spec.shape)
