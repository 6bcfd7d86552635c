"""The backends the model's tests run on: the pure-JAX one both ways its MoE runs, and the CPU
backend with and without its C++ kernels (skipped where they cannot be built). Between them both
ways the decoder stack runs: "xla" scans the stacked layers (the default), "xla-loop" unrolls
them; "cpu" unrolls its own layouts (its way without the MoE kernel), "cpu-kernels" loops over the
layer index with each kernel reading its layer of the stacked weights in place ("indexed", its way
with the MoE kernel)."""

import pytest

from backends import XLA
from backends.cpu import CPU, OPERATIONS, build

NAMES = ["xla", "xla-loop", "cpu", "cpu-kernels"]


def backend(name: str):
    if name == "xla":
        return XLA()  # the MoE on jax.lax.ragged_dot, as on accelerators
    if name == "xla-loop":
        return XLA(grouped="loop", layers="unrolled")
    if name == "cpu":
        return CPU()  # experts split per expert, each layer apart, XLA's ops
    if name == "cpu-kernels":
        if not build.available():
            pytest.skip(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
        return CPU(on=frozenset(OPERATIONS))  # layers "indexed"
    raise ValueError(name)


def arranged(params, name: str):
    """(backend, params in its layout) for the backend called ``name``."""
    chosen = backend(name)
    return chosen, chosen.prepare(params)
