"""Logical axes to mesh axes: the rules table, and the activation constraints the layers apply.

``DEFAULT_RULES`` maps logical axes to the mesh axes ``data`` and ``model`` following Grok-1's own
layout (docs/grok1.md §6). The layers pin their activations with ``constrain`` while an
``activation_sharding`` block is active; the parameters' specs are ``model.sharding``'s, from the
axes each weight declares where the layers declare it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

# Grok-1's layout (docs/grok1.md §6). Values are a mesh axis, a tuple of mesh axes, or None.
DEFAULT_RULES: dict[str, object] = {
    "vocab": None,
    "embed_table": ("data", "model"),
    "embed": "data",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": None,
    "layers": None,  # the stacked layers' axis (the scan's), and the KV memory's: never sharded
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

KV_MEMORY_AXES = ("layers", "batch", "cache_kv_heads", "cache_sequence", "head_dim")  # KVMemory is [L, B, K, S, H]


def spec_for(axes: tuple[str, ...], rules: dict) -> P:
    missing = [a for a in axes if a not in rules]
    if missing:
        raise ValueError(f"sharding rules have no entry for logical axes {missing}")
    return P(*(rules[a] for a in axes))


def axis_size(mesh: Mesh, entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


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
        if entry is not None and size % axis_size(mesh, entry):
            entry = None
        entries.append(entry)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*entries)))
