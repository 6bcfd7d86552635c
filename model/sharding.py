"""Logical axes of every parameter and one rules table mapping them to the mesh axes.

Every parameter leaf declares its logical axes here, by its Grok-1 path; ``DEFAULT_RULES`` maps
logical axes to the mesh axes ``data`` and ``model`` following Grok-1's own layout (GROK1.md §6):
d_model of the weights over ``data``, heads and the FFN width over ``model``, the embedding
table's d_model over both. A leaf that matches no declaration is an error, never silently
replicated, and so is a dimension that its mesh axes do not divide.

A ``QuantizedWeight8bit`` takes its weight's spec; its scales ``[..., G, N]`` take the same spec
with the contracting-axis entry applied to G only where the mesh divides G (else G is replicated),
so scale groups work on any mesh, unlike the reference's (which needs exactly 8 model devices).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model.quant import QuantizedWeight8bit

MESH_AXES = ("data", "model")

# (path pattern, logical axes); the pattern is matched against the whole "/"-joined path.
PARAM_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"language_model/in_out_embed/embeddings", ("vocab", "embed_table")),
    (r"language_model/rms_norm/scale", ("norm",)),
    (r".*/multi_head_attention/query/w", ("embed", "q_heads")),
    (r".*/multi_head_attention/(key|value)/w", ("embed", "kv_heads")),
    (r".*/multi_head_attention/linear/w", ("q_heads", "embed")),
    (r".*/router/w", ("embed", "router_experts")),
    (r".*/moe/(linear|linear_v)/w", ("experts", "embed", "mlp")),
    (r".*/moe/linear_1/w", ("experts", "mlp", "embed")),
    (r".*/rms_norm(_[0-9]+)?/scale", ("norm",)),
)

# Grok-1's layout (GROK1.md §6). Values are a mesh axis, a tuple of mesh axes, or None.
DEFAULT_RULES: dict[str, object] = {
    "vocab": None,
    "embed_table": ("data", "model"),
    "embed": "data",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": None,
    "router_experts": None,
    "norm": None,
    # KV memory
    "batch": "data",
    "cache_sequence": None,
    "cache_kv_heads": "model",
    "head_dim": None,
    # activations, constrained at block boundaries only (Grok-1: d_model over "model")
    "seq": None,
    "act_embed": "model",
    "act_heads": "model",
    "act_kv_heads": "model",
    "act_vocab": "model",
}

# Expert parallelism: experts over ``model``, each expert's FFN whole on its device.
EXPERT_PARALLEL_RULES = {**DEFAULT_RULES, "experts": "model", "mlp": None}

KV_MEMORY_AXES = ("batch", "cache_kv_heads", "cache_sequence", "head_dim")  # KVMemory is [B, K, S, H]


def make_mesh(shape: tuple[int, int] = (1, 1), devices=None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all devices, all processes)."""
    devices = jax.devices() if devices is None else list(devices)
    data, model = shape
    if data <= 0 or model <= 0 or data * model != len(devices):
        raise ValueError(f"mesh shape {shape} needs data x model = {len(devices)} devices")
    return Mesh(np.array(devices).reshape(data, model), MESH_AXES)


def logical_axes(path: str) -> tuple[str, ...]:
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, path):
            return axes
    raise ValueError(f"parameter {path!r} has no logical-axes declaration in model/sharding.py")


def spec_for(axes: tuple[str, ...], rules: dict) -> P:
    missing = [a for a in axes if a not in rules]
    if missing:
        raise ValueError(f"sharding rules have no entry for logical axes {missing}")
    return P(*(rules[a] for a in axes))


def _axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def check_divisible(name: str, shape, spec: P, mesh: Mesh) -> None:
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        if size % _axis_size(mesh, entry):
            raise ValueError(
                f"{name}: dimension {dim} of size {size} is not divisible by mesh axis {entry!r} "
                f"of size {_axis_size(mesh, entry)} (mesh {dict(mesh.shape)})")


def path_str(path) -> str:
    """'/'-joined names of a pytree key path (dict keys and dataclass fields)."""
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "name", key))))
    return "/".join(parts)


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
        if mesh is None or groups % _axis_size(mesh, entries[-2]):
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
    step = spec_for(KV_MEMORY_AXES[:1], rules)
    if mesh is not None:
        check_divisible("KVMemory.k", memory.k[0].shape, kv, mesh)
    return type(memory)(k=tuple(kv for _ in memory.k), v=tuple(kv for _ in memory.v), step=step)


# ---- activation constraints -----------------------------------------------------------------
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: dict | None = None):
    """Within this block, ``constrain`` pins activations to ``mesh`` by ``rules`` (used while tracing).

    Scoped to the caller's own traced functions: no global JAX state is changed.
    """
    token = _ACTIVE.set((mesh, DEFAULT_RULES if rules is None else rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, axes: tuple):
    """Constrain ``x`` to the logical ``axes`` when an ``activation_sharding`` block is active.

    A dimension its mesh axes do not divide (a batch of 1 over two data shards) is replicated.
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    entries = []
    for size, axis in zip(x.shape, axes):
        entry = None if axis is None else spec_for((axis,), rules)[0]
        if entry is not None and size % _axis_size(mesh, entry):
            entry = None
        entries.append(entry)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))
