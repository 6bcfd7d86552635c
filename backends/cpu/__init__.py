"""The CPU backend: C++ kernels for one CPU device, their build and cache, and the CPU layouts.

- ``build``: the compiler, the cache keyed by the CPU, registration with XLA's FFI;
- ``ops``: the kernels as JAX operations, and the column-panel layout they read;
- ``layout``: the backend's layouts of the canonical parameters (experts split, panels);
- ``calibration``: each kernel timed against XLA's op on the CPU at hand, cached;
- ``backend``: ``CPU``, the backend itself.
"""

from backends.cpu.backend import CPU, OPERATIONS

__all__ = ["CPU", "OPERATIONS"]
