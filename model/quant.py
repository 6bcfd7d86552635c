"""int8 weights as Grok-1 ships them: ``QuantizedWeight8bit`` and the ``quantize`` helper.

A quantized weight is an int8 tensor ``weight [..., K, N]`` and ``scales [..., G, N]``: symmetric,
per output channel (N), with the contracting axis K optionally split into G equal groups, each with
its own scale (docs/grok1.md §4). Its effective value is

    W[..., g*K/G:(g+1)*K/G, :] = weight[..., block g, :] * scales[..., g, :]

Unlike the reference, which relies on ``shard_map`` handing each device a scale block of K-extent
one (so G must equal the model-axis size), the groups are applied by an explicit reshape: any G that
divides K works on any mesh.
"""

from __future__ import annotations

import re

import flax.struct
import jax
import jax.numpy as jnp

from model.tree import path_str


@flax.struct.dataclass
class QuantizedWeight8bit:
    """An int8 weight with float scales; a pytree of two leaves (``weight``, then ``scales``)."""

    weight: jax.Array  # int8 [..., K, N]
    scales: jax.Array  # [..., G, N], G divides K; bf16 in Grok-1

    @property
    def shape(self):
        return self.weight.shape

    @property
    def ndim(self):
        return self.weight.ndim

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-2]

    def astype(self, dtype) -> jax.Array:
        """The weight's value in ``dtype`` (``dequantize``): a backend treats a float weight and an
        int8 one alike, ``w.astype(dtype)``, without knowing this type."""
        return dequantize(self, dtype)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight8bit)


def dequantize(w, dtype) -> jax.Array:
    """The weight's value in ``dtype``; a float weight is only cast.

    The product is taken in ``dtype``: in bf16 it is rounded as the reference rounds it; in fp32 it
    is exact, as in the reference's fp32 mode (int8 times the bf16 scale, no rounding to bf16).
    """
    if not is_quantized(w):
        return w.astype(dtype)
    *lead, k, n = w.weight.shape
    groups = w.scales.shape[-2]
    assert w.scales.shape == (*lead, groups, n) and k % groups == 0, (
        f"scales {w.scales.shape} do not match weight {w.weight.shape}")
    grouped = w.weight.reshape(*lead, groups, k // groups, n).astype(dtype)  # [..., G, K/G, N]
    return (grouped * w.scales.astype(dtype)[..., :, None, :]).reshape(*lead, k, n)


def quantize(w, *, groups: int = 1, scale_dtype=jnp.bfloat16) -> QuantizedWeight8bit:
    """Symmetric int8 quantisation of ``w [..., K, N]`` per output channel, in ``groups`` along K.

    Scales are rounded to ``scale_dtype`` first and the weight is quantised against the rounded
    scales, so the only error left is the int8 rounding: at most half a scale per element (plus a
    clip of at most 2**-8 relative where a bf16 scale rounded down).
    """
    w = jnp.asarray(w, jnp.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize needs a weight of rank >= 2, got shape {w.shape}")
    *lead, k, n = w.shape
    if not isinstance(groups, int) or groups <= 0 or k % groups:
        raise ValueError(f"quantize: groups must be a positive divisor of K={k}, got {groups!r}")
    grouped = w.reshape(*lead, groups, k // groups, n)
    amax = jnp.max(jnp.abs(grouped), axis=-2)  # [..., G, N]
    scales = (jnp.where(amax > 0, amax, 1.0) / 127.0).astype(scale_dtype)
    q = jnp.round(grouped / scales.astype(jnp.float32)[..., :, None, :])
    weight = jnp.clip(q, -127, 127).astype(jnp.int8).reshape(*lead, k, n)
    return QuantizedWeight8bit(weight=weight, scales=scales)


# ModelRunner.quantize's values: none, int8 weights (Grok-1's exact product), or int8 weights that the
# CPU kernels may multiply by activations rounded to int8 (backends/cpu/ops.py, w8a8_panel_matmul)
QUANTIZE = (None, "int8", "w8a8")

# The weights Grok-1 ships in int8: the experts' and the attention projections' (docs/grok1.md §4)
QUANTIZABLE = re.compile(r"(.*/)?(moe/(linear|linear_v|linear_1)|multi_head_attention/(query|key|value|linear))/w")


def quantize_params(params, *, groups: int = 1, scale_dtype=jnp.float32):
    """``params`` with every float weight that Grok-1 ships in int8 (``QUANTIZABLE``: the experts
    and the attention projections) quantised by ``quantize`` (per output channel; float32 scales
    by default, so the only error is the int8 rounding). Weights already int8 and all other
    leaves are unchanged."""
    def one(path, w):
        if is_quantized(w) or not QUANTIZABLE.fullmatch(path_str(path)):
            return w
        return quantize(w, groups=groups, scale_dtype=scale_dtype)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)
