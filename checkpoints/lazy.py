"""Lazily sliceable tensors: a checkpoint's arrays, read slice by slice, never whole unless asked.

Both on-disk formats produce a ``{path: LazyTensor | LazyQuantized}`` mapping; restore places each
entry onto its target sharding by reading, for each device, only that device's slice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """An array on disk: its shape and dtype, and a function reading any slice of it."""

    source: str  # file (and tensor name) for error messages
    shape: tuple[int, ...]
    dtype: np.dtype
    read_slice: Callable[[tuple], np.ndarray]
    # A zero-copy view of the whole tensor (np.memmap), for streaming it to another file.
    mmap: Callable[[], np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def stream(self) -> np.ndarray:
        """The whole tensor as a memory map where possible (bytes read as they are consumed)."""
        return self.mmap() if self.mmap is not None else self.read()

    def read(self, index: tuple | None = None) -> np.ndarray:
        index = tuple(slice(None) for _ in self.shape) if index is None else index
        return np.asarray(self.read_slice(index))


@dataclasses.dataclass(frozen=True)
class LazyQuantized:
    """A ``QuantizedWeight8bit`` on disk."""

    weight: LazyTensor
    scales: LazyTensor

    @property
    def shape(self):
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes


def dequantized_slice(q: LazyQuantized, index: tuple, dtype) -> np.ndarray:
    """``(weight * scales)[index]`` for one device's slice, reading only the scales it needs."""
    shape = q.weight.shape
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    weight = q.weight.read(index).astype(np.float32)
    k = shape[-2]
    groups = q.scales.shape[-2]
    rows = np.arange(k)[index[-2]]  # the contracting-axis rows of this slice
    group_of_row = rows // (k // groups)
    g0, g1 = int(group_of_row.min(initial=0)), int(group_of_row.max(initial=0)) + 1
    scales = q.scales.read(index[:-2] + (slice(g0, g1), index[-1])).astype(np.float32)
    expanded = np.take(scales, group_of_row - g0, axis=-2)  # [..., rows, N]
    return (weight * expanded).astype(dtype)
