"""Memory plan: what one device holds for a config, a mesh shape and a batch, before running.

Per device: weight bytes by dtype (each parameter's shard under the sharding rules), KV-memory
bytes per token and per slot (CONCEPTS.md: 2 x layers x KV heads x key_size x bytes, split over
the ``model`` axis; slots split over ``data``), and from a device-memory size, the largest batch x
context that fits. Works from shapes alone (``jax.eval_shape``), so Grok-1 on 8 GPUs can be
planned on a laptop.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec as P

from model.config import ModelConfig
from model.quant import QuantizedWeight8bit
from model.sharding import DEFAULT_RULES, KV_MEMORY_AXES, param_specs, spec_for

# Grok-1's release: scales grouped 8 ways along the contracting axis for the weights whose
# contracting axis is sharded over "model" (attention output, moe/linear_1), 1 group otherwise.
GROK1_SCALE_GROUPS = {"multi_head_attention/linear": 8, "moe/linear_1": 8}


@functools.lru_cache(maxsize=16)
def _float_shapes(config: ModelConfig):
    """The float32 parameters' shapes, from an abstract init (nothing allocated). Kept per config:
    tracing the init of Grok-1's 64 layers takes about a second, and every checkpoint load checks
    its tensors against these shapes (so do the plans)."""
    from model.transformer import init_params

    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def abstract_params(config: ModelConfig, *, quantized: bool = False, scale_dtype=jnp.bfloat16,
                    scale_groups: dict | None = None):
    """ShapeDtypeStructs of the parameters: float32, or int8 matrices as in the Grok-1 release."""
    shapes = _float_shapes(config)
    if not quantized:
        return jax.tree_util.tree_map(lambda leaf: leaf, shapes)  # the caller's own tree
    groups = GROK1_SCALE_GROUPS if scale_groups is None else scale_groups

    def to_int8(path, leaf):
        name = "/".join(str(k.key) for k in path)
        if not name.endswith("/w") or leaf.ndim < 2 or name.endswith("router/w"):
            return leaf
        g = next((n for key, n in groups.items() if name.endswith(key + "/w")), 1)
        g = g if leaf.shape[-2] % g == 0 else 1
        scales = leaf.shape[:-2] + (g, leaf.shape[-1])
        return QuantizedWeight8bit(weight=jax.ShapeDtypeStruct(leaf.shape, jnp.int8),
                                   scales=jax.ShapeDtypeStruct(scales, scale_dtype))

    return jax.tree_util.tree_map_with_path(to_int8, shapes)


def _shard_bytes(shape, dtype, spec: P, mesh) -> int:
    parts = 1
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if entry is not None:
            names = entry if isinstance(entry, tuple) else (entry,)
            parts *= math.prod(mesh.shape[n] for n in names)
    return int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize // parts


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass
class MemoryPlan:
    config: ModelConfig
    mesh_shape: tuple[int, int]
    batch_size: int
    weight_bytes_by_dtype: dict[str, int]  # per device
    total_weight_bytes: int  # the whole model, all devices together
    kv_bytes_per_token: int  # per device, for one token of one slot held on it
    kv_bytes_per_slot: int  # per device: one slot at full sequence_len
    kv_dtype: str
    device_memory: int | None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_dtype.values())

    @property
    def slots_per_device(self) -> int:
        return -(-self.batch_size // self.mesh_shape[0])

    @property
    def kv_bytes(self) -> int:
        """Per device, for ``batch_size`` slots at full ``sequence_len``."""
        return self.slots_per_device * self.kv_bytes_per_slot

    def free_bytes(self) -> int | None:
        if self.device_memory is None:
            return None
        return self.device_memory - self.weight_bytes

    def max_batch(self, context: int) -> int:
        """Largest batch (all devices) whose KV memory at ``context`` tokens fits beside the weights."""
        free = self.free_bytes()
        if free is None or free <= 0:
            return 0
        return (free // (self.kv_bytes_per_token * context)) * self.mesh_shape[0]

    def format(self) -> str:
        gib = _human
        c = self.config
        lines = [f"memory plan: mesh data={self.mesh_shape[0]} x model={self.mesh_shape[1]}, "
                 f"batch {self.batch_size}, sequence_len {c.sequence_len}, KV in {self.kv_dtype}",
                 f"  model: {c.num_params / 1e9:,.2f}B parameters, {gib(self.total_weight_bytes)} of weights "
                 f"({self.total_weight_bytes / 1e9:,.1f} GB) on all devices together",
                 "  per device:"]
        for dtype, n in sorted(self.weight_bytes_by_dtype.items()):
            lines.append(f"    weights {dtype:>8}: {gib(n)}")
        lines.append(f"    weights total  : {gib(self.weight_bytes)}")
        lines.append(f"    KV per token   : {self.kv_bytes_per_token:,} bytes (one slot)")
        lines.append(f"    KV per slot    : {gib(self.kv_bytes_per_slot)} at {c.sequence_len} tokens")
        lines.append(f"    KV for batch   : {gib(self.kv_bytes)} ({self.slots_per_device} slots on each device)")
        lines.append(f"    weights + KV   : {gib(self.weight_bytes + self.kv_bytes)}")
        if self.device_memory is not None:
            free = self.free_bytes()
            lines.append(f"  device memory {gib(self.device_memory)}: {gib(max(free, 0))} left for KV "
                         "(activations and XLA workspace need some of it too)")
            if free <= 0:
                lines.append("  the weights alone do not fit: use more devices on the model axis")
            else:
                lines.append("  largest batch (all devices) by context:")
                context = c.sequence_len
                while context >= 128:
                    lines.append(f"    context {context:>7,}: batch {self.max_batch(context):,}")
                    context //= 2
        return "\n".join(lines)


def memory_plan(config: ModelConfig, params=None, *, mesh_shape=(1, 1), batch_size: int = 1,
                device_memory: int | None = None, kv_dtype=None, rules: dict | None = None) -> MemoryPlan:
    """The plan for ``params`` (arrays or ShapeDtypeStructs; default: float32 from the config)."""
    rules = DEFAULT_RULES if rules is None else rules
    mesh = AbstractMesh(tuple(mesh_shape), ("data", "model"))
    params = abstract_params(config) if params is None else params
    specs = param_specs(params, rules, mesh)
    by_dtype: dict[str, int] = collections.defaultdict(int)
    total = 0
    leaves = jax.tree_util.tree_leaves(params)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(leaves, spec_leaves):
        by_dtype[jnp.dtype(leaf.dtype).name] += _shard_bytes(leaf.shape, leaf.dtype, spec, mesh)
        total += int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
    kv_dtype = jnp.dtype(config.dtype if kv_dtype is None else kv_dtype)
    kv_spec = P(None, *spec_for(KV_MEMORY_AXES[2:], rules))  # one layer's, one row's
    kv_token_shape = (1, config.num_kv_heads, 1, config.key_size)  # [B, K, S, H]
    per_token = 2 * config.num_layers * _shard_bytes(kv_token_shape, kv_dtype, kv_spec, mesh)
    if kv_dtype == jnp.int8:  # and a float32 scale a token and KV head (model.memory.QuantizedKV)
        per_token += 2 * config.num_layers * _shard_bytes(kv_token_shape[:3] + (1,), jnp.float32, kv_spec, mesh)
    return MemoryPlan(config, tuple(mesh_shape), batch_size, dict(by_dtype), total, per_token,
                      per_token * config.sequence_len, kv_dtype.name, device_memory)
