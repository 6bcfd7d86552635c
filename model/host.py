"""Host arrays that JAX's CPU devices take over without a copy.

``jax.device_put`` (and ``jax.make_array_from_callback``) onto a CPU device keeps using a numpy
array's own memory when that memory starts on a 64-byte boundary, and copies it otherwise (jaxlib
0.10.2). numpy's own allocations start on a 16-byte one, so every restored weight used to be
copied once more after it was read: 1.1 GB of the bench config, 0.5-0.8 s of a start.
``host_empty`` gives an array that starts on such a boundary, so a weight read or laid out into it
is placed where it already is. On an accelerator the copy to the device happens either way.
"""

from __future__ import annotations

import mmap

import numpy as np

ALIGN = 64  # the start a CPU device adopts without copying
HUGE_PAGE = 2 << 20
SMALL = 1 << 20  # below this, numpy's own allocation (which advises no huge pages under 4 MB)


def host_empty(shape, dtype=np.float32, huge: bool = False) -> np.ndarray:
    """An uninitialised host array starting on a 64-byte boundary, in plain pages (4 KB), or
    with ``huge`` (from 2 MB on) in memory advised to use transparent huge pages where the OS
    offers them, starting on a 2 MB boundary: what the kernels' weights are held in. They stream
    weights: with 2 MB pages instead of 4 KB a 256 MB read went from 56 to 66 GB/s on the
    development machine (BENCHMARKS.md), since a stream then crosses far fewer page (and TLB)
    boundaries. Huge pages cost at the start, though: the OS compacts memory to find them. numpy
    advises them for every array from 4 MB on, and a restore into such arrays took 1.5x the time
    of one into plain pages (BENCHMARKS.md, "Start-up"); hence plain anonymous memory here."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if size >= SMALL:
        pad = HUGE_PAGE if huge and size >= HUGE_PAGE and advice is not None else 0
        try:  # page-aligned; with pad more, to start on a 2 MB boundary (huge pages are aligned)
            region = mmap.mmap(-1, size + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if pad:
                region.madvise(advice)
        except (OSError, ValueError, AttributeError):
            pass
        else:
            start = -np.frombuffer(region, np.uint8, count=1).ctypes.data % HUGE_PAGE if pad else 0
            return np.frombuffer(region, dtype, count=size // dtype.itemsize, offset=start).reshape(shape)
    raw = np.empty(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size].view(dtype).reshape(shape)


def host_copy(array, dtype=None) -> np.ndarray:
    """``array`` (any numpy array or view, a memory map) copied into ``host_empty``, cast to
    ``dtype`` on the way where given."""
    array = np.asarray(array)
    out = host_empty(array.shape, array.dtype if dtype is None else dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def adoptable(array: np.ndarray) -> bool:
    """Whether a CPU device takes ``array`` over as it is (C-contiguous, 64-byte aligned)."""
    return array.flags.c_contiguous and array.ctypes.data % ALIGN == 0
