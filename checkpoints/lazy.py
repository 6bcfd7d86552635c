"""Lazily sliceable tensors: a checkpoint's arrays, read slice by slice, never whole unless asked.

Both on-disk formats produce a ``{path: LazyTensor | LazyQuantized}`` mapping; restore places each
entry onto its target sharding by reading, for each device, only that device's slice.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from untrusted import CheckpointError
from model.host import host_empty


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """An array on disk: its shape and dtype, and a function reading any slice of it."""

    source: str  # file (and tensor name) for error messages
    shape: tuple[int, ...]
    dtype: np.dtype
    read_slice: Callable[[tuple], np.ndarray]
    # A zero-copy view of the whole tensor (np.memmap), for streaming it to another file.
    mmap: Callable[[], np.ndarray] | None = None
    # Fills a C-contiguous array of the whole tensor's shape and dtype with its bytes, read
    # straight into it (no map of the file, no second copy): how whole tensors are restored.
    read_into: Callable[[np.ndarray], None] | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def stream(self) -> np.ndarray:
        """The whole tensor as a memory map where possible (bytes read as they are consumed)."""
        return self.mmap() if self.mmap is not None else self.read()

    def read(self, index: tuple | None = None) -> np.ndarray:
        index = tuple(slice(None) for _ in self.shape) if index is None else index
        if self.read_into is not None and whole(index, self.shape):
            out = host_empty(self.shape, self.dtype)
            self.read_into(out)
            return out
        return np.asarray(self.read_slice(index))


def whole(index: tuple, shape: tuple[int, ...]) -> bool:
    """Whether ``index`` (slices) covers all of ``shape``."""
    return all(b - a == n for (a, b), n in zip(_bounds(index, shape), shape))


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


# ---- views: one tensor of the model from tensors of a file, read slice by slice -------------------
def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """``index`` (slices with step 1, as ``jax.make_array_from_callback`` passes) as (start, stop)
    per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    bounds = []
    for s, n in zip(index, shape):
        if not isinstance(s, slice):
            raise TypeError(f"a lazy view reads slices, not {type(s).__name__}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("a lazy view reads contiguous slices")
        bounds.append((start, max(start, stop)))
    return bounds


def transposed(t: LazyTensor) -> LazyTensor:
    """A 2-D tensor stored ``[out, in]`` (PyTorch's Linear) as ``[in, out]``."""
    if len(t.shape) != 2:
        raise CheckpointError(f"{t.source}: a matrix was expected, got shape {t.shape}")

    def read_slice(index):
        (r0, r1), (c0, c1) = _bounds(index, t.shape[::-1])
        return t.read((slice(c0, c1), slice(r0, r1))).T

    return LazyTensor(f"{t.source} (transposed)", t.shape[::-1], t.dtype, read_slice)


def stacked(parts: list[LazyTensor], source: str) -> LazyTensor:
    """Equal tensors stacked on a new leading axis (one expert, or one layer, each):
    ``[len(parts), *shape]``. A read fills one buffer part by part: the parts' slices are never
    all held beside it."""
    shape, dtype = parts[0].shape, np.dtype(parts[0].dtype)
    for p in parts[1:]:
        if p.shape != shape or np.dtype(p.dtype) != dtype:
            raise CheckpointError(f"{p.source}: shape {p.shape} {np.dtype(p.dtype)} differs from {parts[0].source}'s "
                             f"{shape} {dtype}")

    def read_slice(index):
        (e0, e1), *rest = _bounds(index, (len(parts), *shape))
        rest = tuple(slice(a, b) for a, b in rest)
        out = host_empty((max(e1 - e0, 0), *(b - a for a, b in _bounds(rest, shape))), dtype)
        into = whole(rest, shape)
        for e in range(e0, e1):
            if into and parts[e].read_into is not None:
                parts[e].read_into(out[e - e0])
            else:
                out[e - e0] = parts[e].read(rest)
        return out

    return LazyTensor(source, (len(parts), *shape), dtype, read_slice)


def concatenated(parts: list[LazyTensor], axis: int, source: str) -> LazyTensor:
    """Tensors joined along ``axis`` (the shards of a tensor split for tensor parallelism); each
    read takes only the shards its slice overlaps."""
    first = parts[0]
    ndim, dtype = len(first.shape), np.dtype(first.dtype)
    if not -ndim <= axis < ndim:
        raise CheckpointError(f"{first.source}: a shard of shape {first.shape} cannot be joined along axis {axis}")
    axis = axis % ndim
    for p in parts[1:]:
        if (len(p.shape) != ndim or np.dtype(p.dtype) != dtype
                or p.shape[:axis] + p.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]):
            raise CheckpointError(f"{p.source}: shard of shape {p.shape} {np.dtype(p.dtype)} does not join "
                             f"{first.source}'s {first.shape} {dtype} along axis {axis}")
    starts = np.cumsum([0] + [p.shape[axis] for p in parts]).tolist()
    shape = first.shape[:axis] + (starts[-1],) + first.shape[axis + 1:]

    def read_slice(index):
        bounds = _bounds(index, shape)
        a0, a1 = bounds[axis]
        pieces = []
        for p, s0, s1 in zip(parts, starts, starts[1:]):
            lo, hi = max(a0, s0), min(a1, s1)
            if lo < hi or (a0 == a1 and not pieces):
                local = [slice(a, b) for a, b in bounds]
                local[axis] = slice(lo - s0, max(lo, hi) - s0)
                pieces.append(p.read(tuple(local)))
        return np.concatenate(pieces, axis=axis) if len(pieces) > 1 else pieces[0]

    return LazyTensor(source, shape, dtype, read_slice)
