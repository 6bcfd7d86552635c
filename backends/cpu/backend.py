"""The CPU backend: one CPU device, the C++ kernels where they were taken, and CPU layouts."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from backends.cpu import layout, ops
from backends.xla import XLA, attend, loop_grouped_matmul

OPERATIONS = ("moe", "projections", "unembed", "attention", "sampling_cut", "logits_summary")


@dataclasses.dataclass(frozen=True)
class CPU(XLA):
    """XLA's operations on one CPU device, except those in ``on``, which run on the C++ kernels
    (``backends/cpu/ops.py``): ``moe`` (the grouped panel matmul), ``projections`` and ``unembed``
    (the panel matmul), ``attention`` (a decode step read in place from float32 or int8 caches),
    ``sampling_cut`` and ``logits_summary``. ``prepare`` splits the experts per expert (or packs
    them in panels with ``moe``), and packs the weights of the other panel operations."""

    on: frozenset = frozenset()
    grouped: str = "loop"
    name = "cpu"

    def __post_init__(self):
        super().__post_init__()
        unknown = set(self.on) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"CPU(on=...): unknown operations {sorted(unknown)}, expected some of {OPERATIONS}")

    def describe(self) -> str:
        kernels = ", ".join(op for op in OPERATIONS if op in self.on) or "none"
        experts = "in panels" if "moe" in self.on else "split per expert"
        return f"cpu (on the C++ kernels: {kernels}; experts {experts})"

    def prepare(self, params):
        return layout.prepare(params, frozenset(self.on))

    def matmul(self, x, w, dtype):
        if isinstance(w, ops.PanelWeight):
            return ops.panel_matmul(x.astype(jnp.float32), w.panels, w.width).astype(dtype)
        return super().matmul(x, w, dtype)

    def embed(self, table, tokens, dtype):
        if isinstance(table, ops.PanelTable):
            return table.lookup(tokens).astype(dtype)
        return super().embed(table, tokens, dtype)

    def unembed(self, h, table, dtype):
        if isinstance(table, ops.PanelTable):
            return table.unembed(h).astype(dtype)
        return super().unembed(h, table, dtype)

    def grouped_matmul(self, x_RK, w, sizes_E, dtype):
        if isinstance(w, ops.PanelWeight):
            return ops.grouped_matmul(x_RK.astype(jnp.float32), w.panels, sizes_E, w.width).astype(dtype)
        if isinstance(w, layout.ExpertWeights):
            return loop_grouped_matmul(x_RK.astype(dtype), lambda x, e: w.matmul(x, e, dtype), sizes_E,
                                       w.shape[-1], dtype)
        return super().grouped_matmul(x_RK, w, sizes_E, dtype)

    def attention(self, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap):
        b, t, n, h = q_BTNH.shape
        if "attention" in self.on and t == 1 and ops.decode_attention_fits(n, k_BKSH.shape[1], h):
            # a decode step read in place from the caches (XLA copies the attended positions
            # first, and dequantises an int8 cache into a float copy)
            q_BNH = q_BTNH[:, 0].astype(jnp.float32)
            if k_BKSH.dtype == jnp.float32:
                out_BNH = ops.decode_attention(q_BNH, k_BKSH, v_BKSH, mask_BTS[:, 0], scale, cap)
                return out_BNH[:, None].astype(q_BTNH.dtype)
            if k_BKSH.dtype == jnp.int8:  # an int8 record (model.memory.QuantizedKV)
                out_BNH = ops.decode_attention_int8(q_BNH, k_BKSH, v_BKSH, mask_BTS[:, 0], scale, cap)
                return out_BNH[:, None].astype(q_BTNH.dtype)
        return attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap)

    def sampling_cut(self, scaled_BV, top_k_B, nucleus_p_B):
        if "sampling_cut" in self.on:
            return ops.filter_threshold(scaled_BV, top_k_B, nucleus_p_B)
        return super().sampling_cut(scaled_BV, top_k_B, nucleus_p_B)

    def logits_summary(self, logits_BV, top):
        if "logits_summary" in self.on:
            values, ids, lse = ops.logits_summary(logits_BV, top)
            return values, ids, lse, ids[:, 0]
        return super().logits_summary(logits_BV, top)
