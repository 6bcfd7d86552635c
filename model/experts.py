"""Expert weights held one array per expert, so that one expert is read in place.

An MoE weight is stored stacked, ``[E, K, N]``, as Grok-1 ships it. Reading only the experts a
token selected needs ``w[e]``; XLA:CPU materialises that slice as a copy before the dot (a read
and a write of the whole expert on every step, measured: BENCHMARKS.md), so on CPU the runner
splits each stacked weight once at load into an ``ExpertWeights`` of E separate buffers. Both
forms hold the same values and the model accepts either; checkpoints and the sharding rules keep
the stacked form, and a split weight takes its spec without the ``experts`` entry (so it cannot
be expert-sharded).

On one CPU device, float32 experts can instead be held in column panels (``split_experts(params,
panels=True)``: a ``panel.PanelWeight`` of all experts), multiplied by the C++ kernel of ``model/panel.py``: it
streams a panel front to back where XLA:CPU's dots of a few rows read weights at half the speed,
and it takes every expert's rows in one call (BENCHMARKS.md).
"""

from __future__ import annotations

import re

import flax.struct
import jax
import jax.numpy as jnp

from model import panel
from model.quant import QuantizedWeight8bit, dequantize, is_quantized

MOE_WEIGHT = re.compile(r"(.*/)?moe/(linear|linear_v|linear_1)/w")


# Down projections ([F, D] per expert) are held transposed, [D, F], and multiplied contracting
# both minor dimensions: XLA:CPU's matrix-vector product reads that layout about 1.7x faster
# (BENCHMARKS.md). Gate and up projections are fastest as stored.
TRANSPOSED = ("linear_1",)


@flax.struct.dataclass
class ExpertWeights:
    """One MoE weight ``[E, K, N]`` as E separate arrays: ``[K, N]`` each, or ``[N, K]`` each when
    ``transposed`` (float weights only; a ``QuantizedWeight8bit`` expert keeps its layout)."""

    experts: tuple
    transposed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        one = tuple(self.experts[0].shape)
        return (len(self.experts), *(one[::-1] if self.transposed else one))


def expert(w, e: int):
    """Expert ``e`` of a stacked MoE weight, or of a split one that is not transposed."""
    if isinstance(w, ExpertWeights):
        assert not w.transposed, "use expert_matmul for a transposed weight"
        return w.experts[e]
    if is_quantized(w):
        return QuantizedWeight8bit(weight=w.weight[e], scales=w.scales[e])
    return w[e]


def expert_matmul(x, w, e: int, dtype):
    """``x [..., K] @ W_e [K, N]`` in ``dtype``, for a stacked, split or transposed weight."""
    if isinstance(w, ExpertWeights) and w.transposed:
        return jax.lax.dot_general(x, w.experts[e].astype(dtype), (((x.ndim - 1,), (1,)), ((), ())))
    return x @ dequantize(expert(w, e), dtype)


def moe_weight_dtypes(params) -> set[str]:
    """The dtypes the MoE weights of ``params`` are held in ("int8" for ``QuantizedWeight8bit``)."""
    from model.sharding import path_str

    def dtype(w) -> str:
        if isinstance(w, ExpertWeights):
            return dtype(w.experts[0])
        return "int8" if is_quantized(w) else str(w.dtype)

    found = set()
    jax.tree_util.tree_map_with_path(
        lambda path, w: found.add(dtype(w)) if MOE_WEIGHT.fullmatch(path_str(path)) else None, params,
        is_leaf=lambda x: isinstance(x, (QuantizedWeight8bit, ExpertWeights, panel.PanelWeight)))
    return found


def split_experts(params, panels: bool = False):
    """``params`` with every stacked MoE weight replaced by its ``ExpertWeights`` (new buffers;
    float down projections transposed). With ``panels``, float32 weights become a ``panel.PanelWeight``
    instead, for ``model.panel``'s kernel (its caller checks ``panel.available()``)."""
    from model.sharding import path_str

    def split(path, w):
        name = path_str(path)
        if not MOE_WEIGHT.fullmatch(name) or isinstance(w, (ExpertWeights, panel.PanelWeight)):
            return w
        if panels and not is_quantized(w) and w.dtype == jnp.float32:
            return panel.PanelWeight.of(w)
        transpose = name.split("/")[-2] in TRANSPOSED and not is_quantized(w)
        experts = tuple(expert(w, e).T if transpose else expert(w, e) for e in range(w.shape[0]))
        return ExpertWeights(experts, transposed=transpose)

    return jax.tree_util.tree_map_with_path(
        split, params, is_leaf=lambda x: isinstance(x, (QuantizedWeight8bit, ExpertWeights, panel.PanelWeight)))
