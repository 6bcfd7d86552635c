"""Every parameter's sharding, from the logical axes its layer declares, and the mesh.

A weight is declared once, in the layer that uses it: its shape from the config, its logical
axes and its initialiser (``model.layers.Weight``; the norms' scales and the embedding alike).
``declared_params(config)`` reads those declarations back from an abstract init, and from them
come the initial parameters, the abstract shapes (``model.plan``), the checkpoint checks
(``checkpoints.materialize``) and the specs here: ``param_specs`` maps each leaf's axes through
the rules (``model.partitioning.DEFAULT_RULES``, Grok-1's layout) to mesh axes. A leaf that no
layer declares is an error, never silently replicated, and so is a dimension that its mesh axes
do not divide.

A ``QuantizedWeight8bit`` takes its weight's spec; its scales ``[..., G, N]`` take the same spec
with the contracting-axis entry applied to G only where the mesh divides G (else G is replicated),
so scale groups work on any mesh, unlike the reference's (which needs exactly 8 model devices).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.partitioning import (DEFAULT_RULES, EXPERT_PARALLEL_RULES, KV_MEMORY_AXES, MESH_AXES,  # noqa: F401
                                activation_sharding, axis_size, constrain, spec_for)
from model.quant import QuantizedWeight8bit
from model.tree import path_str


def make_mesh(shape: tuple[int, int] = (1, 1), devices=None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all devices, all processes)."""
    devices = jax.devices() if devices is None else list(devices)
    data, model = shape
    if data <= 0 or model <= 0:
        raise ValueError(f"mesh shape {shape}: data and model must be positive")
    if data * model != len(devices):
        hint = ""
        if devices and devices[0].platform == "cpu" and data * model > len(devices):
            hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={data * model} makes "
                    f"{data * model} devices")
        raise ValueError(f"mesh shape {shape} needs data x model = {data * model} devices, and "
                         f"{len(devices)} {'is' if len(devices) == 1 else 'are'} given{hint}")
    return Mesh(np.array(devices).reshape(data, model), MESH_AXES)


@functools.lru_cache(maxsize=None)
def _declared_axes() -> dict[str, tuple[str, ...]]:
    """Logical axes by path (the layers' stacked under ``transformer/layers``), as the layers declare them."""
    from model.config import TINY_GROK2
    from model.transformer import declared_params

    # the tiny Grok-2 declares every parameter any variant has (the shared MLP, the output table)
    return {path: axes for path, (_, axes) in declared_params(TINY_GROK2, num_layers=1).items()}


def logical_axes(path: str) -> tuple[str, ...]:
    """The logical axes the model's layers declare for the parameter at ``path``."""
    axes = _declared_axes().get(path)
    if axes is None:
        raise ValueError(f"parameter {path!r} is declared by no layer of the model (model/layers.py)")
    return axes


def check_divisible(name: str, shape, spec: P, mesh: Mesh) -> None:
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        if size % axis_size(mesh, entry):
            raise ValueError(
                f"{name}: dimension {dim} of size {size} is not divisible by mesh axis {entry!r} "
                f"of size {axis_size(mesh, entry)} (mesh {dict(mesh.shape)})")


def param_specs(params, rules: dict | None = None, mesh: Mesh | None = None):
    """PartitionSpecs shaped like ``params`` (arrays or ShapeDtypeStructs, int8 or float).

    With ``mesh``, every dimension is checked against its mesh axes and quantisation scale groups
    that the mesh does not divide are replicated. ``params`` is the canonical pytree: a backend's
    own layout (``backends``) is derived after placement and never sharded by these rules.
    """
    rules = DEFAULT_RULES if rules is None else rules

    def leaf_spec(name, axes, leaf):
        spec = spec_for(axes, rules)
        if not isinstance(leaf, QuantizedWeight8bit):
            if mesh is not None:
                check_divisible(name, leaf.shape, spec, mesh)
            return spec
        if mesh is not None:
            check_divisible(name, leaf.weight.shape, spec, mesh)
        entries = list(spec) + [None] * (leaf.weight.ndim - len(spec))
        groups = leaf.scales.shape[-2]
        if mesh is None or groups % axis_size(mesh, entries[-2]):
            entries[-2] = None
        return QuantizedWeight8bit(weight=spec, scales=P(*entries))

    def spec_at(path, leaf):
        name = path_str(path)
        return leaf_spec(name, logical_axes(name), leaf)

    return jax.tree_util.tree_map_with_path(
        spec_at, params, is_leaf=lambda x: isinstance(x, QuantizedWeight8bit))


def param_shardings(params, mesh: Mesh, rules: dict | None = None):
    """NamedShardings shaped like ``params``."""
    specs = param_specs(params, rules, mesh)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def memory_specs(memory, rules: dict | None = None, mesh: Mesh | None = None):
    """Specs for a ``KVMemory``: batch over data, KV heads over model, never resharded per step."""
    rules = DEFAULT_RULES if rules is None else rules
    kv = spec_for(KV_MEMORY_AXES, rules)
    step = spec_for(("batch",), rules)
    if mesh is not None:
        check_divisible("KVMemory.k", memory.k.shape, kv, mesh)
    return type(memory)(k=jax.tree_util.tree_map(lambda _: kv, memory.k),  # an int8 record: both leaves
                        v=jax.tree_util.tree_map(lambda _: kv, memory.v), step=step)


