"""The CPU backend: one CPU device, the C++ kernels where they were taken, and CPU layouts."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from backends.cpu import build, layout, ops
from backends.xla import XLA, attend, loop_grouped_matmul
from model.memory import write_kv

OPERATIONS = ("moe", "projections", "unembed", "attention", "sampling_cut", "logits_summary")
INT8_OPERATIONS = ("moe", "projections")  # those with a kernel for int8 weights


@dataclasses.dataclass(frozen=True)
class CPU(XLA):
    """XLA's operations on one CPU device, except those in ``on``, which run on the C++ kernels
    (``backends/cpu/ops.py``): ``moe`` (the grouped panel matmul), ``projections`` and ``unembed``
    (the panel matmul), ``attention`` (a decode step read in place from float32, bf16 or int8 caches),
    ``sampling_cut`` and ``logits_summary``; with ``attention`` every cache write is in place too
    (``ops.kv_write``). ``prepare`` splits the experts per expert (or packs
    them in panels with ``moe``), and packs the weights of the other panel operations; the panel
    operations read float32, bf16 or int8 weights (int8 widened in registers, never copied to
    float), float weights held in the activations' ``dtype``, and an int8 weight no kernel takes
    is dequantised to that dtype once, there."""

    on: frozenset = frozenset()
    grouped: str = "loop"
    # Operations of ``on`` ("moe", "projections") whose int8 weights the kernel reads as int8; an
    # int8 weight of any other operation is dequantised to float32 by ``prepare``.
    int8: frozenset = frozenset()
    # Operations of ``int8`` whose int8 weights multiply the activations rounded to int8 per block
    # of 32 (``ops.w8a8_panel_matmul``, llama.cpp's q8_0 dot: the ``--quantize w8a8`` mode), where
    # the weight's scale groups fit the blocks; not Grok-1's exact product.
    w8a8: frozenset = frozenset()
    # The activations' dtype: what ``prepare`` holds float weights in (the weight kernels take
    # float32 and bfloat16; ``runner.selection`` leaves them out for any other).
    dtype: str = "float32"
    # How the stack runs ("auto": "indexed" with the MoE kernel, else "unrolled"). "indexed": one
    # layer compiled, looped over the layer index, the kernels reading their layer of each
    # stacked weight in place (``take_layer``); XLA:CPU copies the slice of a stacked weight that
    # a dot reads, which for the attention projections on XLA's dot is a few MB a layer. Without
    # the MoE kernel the experts' dots would copy each layer's experts on every step, so the
    # layers are unrolled, each over its own buffers (measured: BENCHMARKS.md, "Scan over layers"
    # and "The CPU stack as one loop").
    layers: str = "auto"
    # Whether the KV cache is written in place (``ops.kv_write``, byte for byte) rather than by
    # XLA's scatter, and a prefill's blocks of keys read in place (``ops.kv_read``) rather than
    # sliced by XLA; None: where ``attention`` is taken. ``runner.selection`` sets it wherever the
    # kernels are built: neither is ever slower, and XLA:CPU's scatter into a bf16 stack, and its
    # slices of one, copy the whole stack every layer: the scatter made a bf16 batch-1 decode
    # 2.5x slower where the attention kernel itself measured a tie with XLA's (AMD EPYC, 2 cores:
    # 53 tokens/s against 131; docs/benchmarks-history.md, issue 52).
    kv_in_place: bool | None = None
    name = "cpu"

    def __post_init__(self):
        if self.layers == "auto":
            object.__setattr__(self, "layers", "indexed" if "moe" in self.on else "unrolled")
        if self.kv_in_place is None:
            object.__setattr__(self, "kv_in_place", "attention" in self.on)
        if self.layers == "indexed" and "moe" not in self.on:
            raise ValueError("CPU(layers='indexed') reads the experts from panels: it needs 'moe' in on")
        super().__post_init__()
        unknown = set(self.on) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"CPU(on=...): unknown operations {sorted(unknown)}, expected some of {OPERATIONS}")
        if not set(self.int8) <= set(self.on) & set(INT8_OPERATIONS):
            raise ValueError(f"CPU(int8=...) must name operations of on among {INT8_OPERATIONS}, got {sorted(self.int8)}")
        if not set(self.w8a8) <= set(self.int8):
            raise ValueError(f"CPU(w8a8=...) must name operations of int8 ({sorted(self.int8)}), "
                             f"got {sorted(self.w8a8)}")

    def describe(self) -> str:
        kernels = ", ".join(op for op in OPERATIONS if op in self.on) or "none"
        experts = "in panels" if "moe" in self.on else "split per expert"
        int8 = ", ".join(op + (" (int8 x int8, " + build.int8_dot() + ")" if op in self.w8a8 else "")
                         for op in INT8_OPERATIONS if op in self.int8)
        bf16 = ""
        if jnp.dtype(self.dtype) == jnp.bfloat16 and self.on & {"moe", "projections", "unembed"}:
            how = "AVX512-BF16 dot" if build.bf16_dot() else "widened to float32 (no AVX512-BF16)"
            bf16 = f"; bf16 weights: {how}"
        writes = "; KV cache written and read in place" if self.kv_in_place and "attention" not in self.on else ""
        return (f"cpu (on the C++ kernels: {kernels}; experts {experts}"
                f"{'; int8 weights read as int8: ' + int8 if int8 else ''}{bf16}{writes}; layers {self.layers})")

    def prepare(self, params):
        return layout.prepare(params, frozenset(self.on), frozenset(self.int8), self.dtype, self.layers,
                              frozenset(self.w8a8))

    def take_layer(self, w, layer):
        if isinstance(w, layout.PANELS):
            return layout.InLayer(w, layer)  # read in place by the kernel
        if isinstance(w, layout.Widened):
            return layout.Widened(super().take_layer(w.w, layer))
        return super().take_layer(w, layer)

    def matmul(self, x, w, dtype):
        w, layer = (w.stack, w.layer) if isinstance(w, layout.InLayer) else (w, None)
        if isinstance(w, ops.PanelWeight):
            return ops.panel_matmul(x.astype(jnp.float32), w.panels, w.width, layer).astype(dtype)
        if isinstance(w, ops.Bf16PanelWeight):
            return ops.bf16_panel_matmul(x.astype(jnp.float32), w.panels, w.width, layer).astype(dtype)
        if isinstance(w, ops.Int8PanelWeight):
            return ops.int8_panel_matmul(x.astype(jnp.float32), w.panels, w.scales, w.width,
                                         bf16=dtype == jnp.bfloat16, layer=layer).astype(dtype)
        if isinstance(w, ops.W8A8PanelWeight):
            return ops.w8a8_panel_matmul(x.astype(jnp.float32), w.panels, w.comp, w.scales, w.width,
                                         layer).astype(dtype)
        if isinstance(w, layout.Widened):  # what XLA:CPU makes of a bf16 dot, the weight widened once
            return jnp.einsum("...M,MN->...N", x.astype(dtype).astype(jnp.float32), w.w).astype(dtype)
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
        w, layer = (w.stack, w.layer) if isinstance(w, layout.InLayer) else (w, None)
        if isinstance(w, ops.PanelWeight):
            return ops.grouped_matmul(x_RK.astype(jnp.float32), w.panels, sizes_E, w.width, layer).astype(dtype)
        if isinstance(w, ops.Bf16PanelWeight):
            return ops.grouped_bf16_matmul(x_RK.astype(jnp.float32), w.panels, sizes_E, w.width, layer).astype(dtype)
        if isinstance(w, ops.Int8PanelWeight):
            return ops.grouped_int8_matmul(x_RK.astype(jnp.float32), w.panels, w.scales, sizes_E, w.width,
                                           bf16=dtype == jnp.bfloat16, layer=layer).astype(dtype)
        if isinstance(w, ops.W8A8PanelWeight):
            return ops.grouped_w8a8_matmul(x_RK.astype(jnp.float32), w.panels, w.comp, w.scales, sizes_E, w.width,
                                           layer).astype(dtype)
        if isinstance(w, layout.ExpertWeights):
            return loop_grouped_matmul(x_RK.astype(dtype), lambda x, e: w.matmul(x, e, dtype), sizes_E,
                                       w.shape[-1], dtype)
        return super().grouped_matmul(x_RK, w, sizes_E, dtype)

    def attention(self, q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT=None, layer=None, rows_BT=None):
        b, t, n, h = q_BTNH.shape
        kv_heads = k_BKSH.shape[-3]
        if "attention" in self.on and t == 1 and rows_BT is None and ops.decode_attention_fits(n, kv_heads, h):
            # a decode step read in place from the caches, the layer's of the stack too (XLA copies
            # the attended positions first, and dequantises an int8 cache into a float copy)
            q_BNH = q_BTNH[:, 0].astype(jnp.float32)
            temperature_B = None if temperature_BT is None else temperature_BT[:, 0]  # Grok-2's, a row's
            if k_BKSH.dtype in (jnp.float32, jnp.bfloat16):
                out_BNH = ops.decode_attention(q_BNH, k_BKSH, v_BKSH, mask_BTS[:, 0], scale, cap, temperature_B, layer)
                return out_BNH[:, None].astype(q_BTNH.dtype)
            if k_BKSH.dtype == jnp.int8:  # an int8 record (model.memory.QuantizedKV)
                out_BNH = ops.decode_attention_int8(q_BNH, k_BKSH, v_BKSH, mask_BTS[:, 0], scale, cap, temperature_B,
                                                    layer)
                return out_BNH[:, None].astype(q_BTNH.dtype)
        return super().attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, scale, cap, temperature_BT, layer, rows_BT)

    def decode_reads_live_keys(self, config) -> bool:
        # the decode kernel lists the allowed positions of each row and reads those alone
        return "attention" in self.on and ops.decode_attention_fits(config.num_q_heads, config.num_kv_heads,
                                                                    config.key_size)

    def kv_block(self, cache, layer, rows_G, start, size, dtype):
        if self.kv_in_place:
            # read in place: XLA:CPU slices a bf16 stack through a copy of the whole stack (as its
            # 16-bit patterns, ``backends.xla.moved_as_bits``) once a layer
            read = (lambda a: ops.kv_read(a, layer, rows_G, start, size)) if layer is not None else \
                (lambda a: ops.kv_read(a[None], 0, rows_G, start, size))
            return jax.tree_util.tree_map(read, cache).astype(dtype)
        return super().kv_block(cache, layer, rows_G, start, size, dtype)

    def copy_blocks(self, dst, src, valid_PJ, dst_row_PJ, dst_pos_PJ, src_row_PJ, src_pos_PJ, size):
        leaves = zip(jax.tree_util.tree_leaves(dst), jax.tree_util.tree_leaves(src))
        if self.kv_in_place and all(d.dtype == s.dtype for d, s in leaves):
            # in place, byte for byte: XLA:CPU's update of a bf16 pool (or stack) widens the whole
            # of it to float32 and back, every call
            rows = jnp.where(valid_PJ, dst_row_PJ, -1).reshape(-1)
            return jax.tree_util.tree_map(
                lambda d, s: ops.kv_copy_blocks(d, s, rows, dst_pos_PJ.reshape(-1), src_row_PJ.reshape(-1),
                                                src_pos_PJ.reshape(-1), size), dst, src)
        return super().copy_blocks(dst, src, valid_PJ, dst_row_PJ, dst_pos_PJ, src_row_PJ, src_pos_PJ, size)

    def write_kv(self, cache, layer, rows_BT, positions_BT, new_BTKH):
        if self.kv_in_place:
            # in place, byte for byte: XLA:CPU's scatter into a bf16 stack copies the whole stack
            # for every layer (bench config, batch 8, KV 512, 2-core Xeon: a bf16 decode step
            # 20 ms against 80; float32 and int8 the same either way)
            return write_kv(cache, layer, rows_BT, positions_BT, new_BTKH,
                            put=lambda full, x: ops.kv_write(full, layer, rows_BT, positions_BT, x))
        return super().write_kv(cache, layer, rows_BT, positions_BT, new_BTKH)

    def sampling_cut(self, scaled_BV, top_k_B, nucleus_p_B):
        if "sampling_cut" in self.on:
            return ops.filter_threshold(scaled_BV, top_k_B, nucleus_p_B)
        return super().sampling_cut(scaled_BV, top_k_B, nucleus_p_B)

    def logits_summary(self, logits_BV, top):
        if "logits_summary" in self.on:
            values, ids, lse = ops.logits_summary(logits_BV, top)
            return values, ids, lse, ids[:, 0]
        return super().logits_summary(logits_BV, top)
