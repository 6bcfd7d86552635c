"""Expert weights held one array per expert, so that one expert is read in place.

An MoE weight is stored stacked, ``[E, K, N]``, as Grok-1 ships it. Reading only the experts a
token selected needs ``w[e]``; XLA:CPU materialises that slice as a copy before the dot (a read
and a write of the whole expert on every step, measured: BENCHMARKS.md), so on CPU the runner
splits each stacked weight once at load into an ``ExpertWeights`` of E separate buffers. Both
forms hold the same values and the model accepts either; checkpoints and the sharding rules keep
the stacked form, and a split weight takes its spec without the ``experts`` entry (so it cannot
be expert-sharded).
"""

from __future__ import annotations

import re

import flax.struct
import jax

from model.quant import QuantizedWeight8bit, is_quantized

MOE_WEIGHT = re.compile(r"(.*/)?moe/(linear|linear_v|linear_1)/w")


@flax.struct.dataclass
class ExpertWeights:
    """One MoE weight as E separate ``[K, N]`` arrays (float or ``QuantizedWeight8bit``)."""

    experts: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.experts), *self.experts[0].shape)


def expert(w, e: int):
    """Expert ``e`` of a stacked or split MoE weight (``e`` static)."""
    if isinstance(w, ExpertWeights):
        return w.experts[e]
    if is_quantized(w):
        return QuantizedWeight8bit(weight=w.weight[e], scales=w.scales[e])
    return w[e]


def split_experts(params):
    """``params`` with every stacked MoE weight replaced by its ``ExpertWeights`` (new buffers)."""
    from model.sharding import path_str

    def split(path, w):
        if not MOE_WEIGHT.fullmatch(path_str(path)) or isinstance(w, ExpertWeights):
            return w
        return ExpertWeights(tuple(expert(w, e) for e in range(w.shape[0])))

    return jax.tree_util.tree_map_with_path(
        split, params, is_leaf=lambda x: isinstance(x, (QuantizedWeight8bit, ExpertWeights)))
