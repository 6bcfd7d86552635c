"""The layers of one Grok-1 decoder block, as Flax linen modules (GROK1.md §3.2–§3.6).

Parameter names and shapes follow the published Haiku tree exactly (``multi_head_attention/query/w``
``[D, N*H]``, ``moe/linear/w`` ``[E, D, F]``, ...), so a checkpoint maps onto it by name. Any weight
may be a float array or a ``QuantizedWeight8bit``; it is dequantised inside the computation.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from model import panel
from model.config import ModelConfig
from model.experts import ExpertWeights, expert_matmul
from model.quant import dequantize
from model.sharding import constrain

RESIDUAL = ("batch", "seq", "act_embed")
CACHE = ("batch", "cache_kv_heads", "cache_sequence", "head_dim")

_MASKED = -1e30  # Grok-1: masked attention logits are set to -1e30


def _fan_in_normal(fan_in_axes: tuple[int, ...]):
    """Normal initialiser scaled by 1/sqrt(fan-in); only used for fresh (untrained) parameters."""

    def init(key, shape, dtype=jnp.float32):
        fan_in = math.prod(shape[a] for a in fan_in_axes)
        return jax.random.normal(key, shape, dtype) / math.sqrt(fan_in)

    return init


class Weight(nn.Module):
    """One weight ``w`` (float, int8, or an MoE weight split per expert), like a bias-free Haiku
    ``Linear`` without the matmul."""

    shape: tuple[int, ...]
    fan_in_axes: tuple[int, ...] = (-2,)

    @nn.compact
    def __call__(self):
        if self.has_variable("params", "w"):
            w = self.get_variable("params", "w")
            if isinstance(w, (ExpertWeights, panel.PanelWeight)):  # Flax checks plain leaves only
                if w.shape != tuple(self.shape):
                    held = "split expert" if isinstance(w, ExpertWeights) else "panel"
                    raise ValueError(f"{self.scope.path_text}/w: {held} weights have shape "
                                     f"{w.shape}, the config needs {tuple(self.shape)}")
                return w
        return self.param("w", _fan_in_normal(self.fan_in_axes), self.shape, jnp.float32)


class RMSNorm(nn.Module):
    """Grok-1 RMSNorm: float32 math, the scale multiplies directly (not ``1 + scale``), no bias."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)  # norms in float32
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return (scale.astype(jnp.float32) * x32 * jax.lax.rsqrt(ms + self.eps)).astype(x.dtype)


def rotary_embedding(x_BTnH, positions_BT, base: float):
    """Rotate-half (GPT-NeoX layout) RoPE over the full head dim, phases in float32 (GROK1.md §3.4)."""
    h = x_BTnH.shape[-1]
    inv_freq_h = 1.0 / base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    phase_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_h
    phase_BTH = jnp.concatenate([phase_BTh, phase_BTh], axis=-1)[:, :, None, :]  # [B,T,1,H]
    x32 = x_BTnH.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., h // 2:], x32[..., : h // 2]], axis=-1)
    return (x32 * jnp.cos(phase_BTH) + rotated * jnp.sin(phase_BTH)).astype(x_BTnH.dtype)


class MultiHeadAttention(nn.Module):
    """Grouped-query attention with RoPE, Grok-1's logit soft-cap and an optional KV cache.
    ``decode_kernel``: a decode step's attention on the CPU kernel (``panel.decode_attention``,
    float32 caches), where the runner chose it."""

    config: ModelConfig
    decode_kernel: bool = False

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache=None):
        """``mask_BTS[b, t, s]`` says whether query t of row b may attend to key s.

        Without ``cache`` the keys are this chunk's own (S = T). With ``cache = (k_BKSH, v_BKSH)``
        (positions third: a step reads them without a transpose) the chunk's K/V are written at
        ``positions_BT`` first and the keys are the whole cache; the updated cache is returned.
        """
        c = self.config
        d, n, k, h = c.emb_size, c.num_q_heads, c.num_kv_heads, c.key_size
        dtype = x_BTD.dtype
        b, t, _ = x_BTD.shape
        wq = Weight((d, n * h), name="query")()
        wo = Weight((n * h, d), name="linear")()
        q_BTNH = constrain(_project(x_BTD, wq, dtype).reshape(b, t, n, h), ("batch", "seq", "act_heads", "head_dim"))
        k_BTKH = constrain(_project(x_BTD, Weight((d, k * h), name="key")(), dtype).reshape(b, t, k, h),
                           ("batch", "seq", "act_kv_heads", "head_dim"))
        v_BTKH = constrain(_project(x_BTD, Weight((d, k * h), name="value")(), dtype).reshape(b, t, k, h),
                           ("batch", "seq", "act_kv_heads", "head_dim"))
        # The same positions (cache step + t) rotate queries and keys.
        q_BTNH = rotary_embedding(q_BTNH, positions_BT, c.rope_base)
        k_BTKH = rotary_embedding(k_BTKH, positions_BT, c.rope_base)

        if cache is not None:
            k_BKSH, v_BKSH = cache
            rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
            # Scatter with mode="drop": a padded position past sequence_len is dropped, never
            # clamped onto valid entries (XLA's dynamic_update_slice would clamp).
            k_BKSH = k_BKSH.at[rows_BT, :, positions_BT].set(k_BTKH.astype(k_BKSH.dtype), mode="drop")
            v_BKSH = v_BKSH.at[rows_BT, :, positions_BT].set(v_BTKH.astype(v_BKSH.dtype), mode="drop")
            k_BKSH, v_BKSH = constrain(k_BKSH, CACHE), constrain(v_BKSH, CACHE)  # never resharded
            cache = (k_BKSH, v_BKSH)
            if (t == 1 and self.decode_kernel and k_BKSH.dtype == jnp.float32
                    and panel.decode_attention_fits(n, k, h)):
                # a decode step on the runner's CPU kernel: read the caches in place
                out_BNH = panel.decode_attention(q_BTNH[:, 0].astype(jnp.float32), k_BKSH, v_BKSH, mask_BTS[:, 0],
                                                 c.attn_output_multiplier, c.attn_logit_cap)
                return _project(out_BNH.reshape(b, 1, n * h).astype(dtype), wo, dtype), cache
            # Attend to the first S positions only (S = the mask's length: a bucket that covers
            # every row's valid positions), so a step reads the KV it needs, not the whole cache.
            s = mask_BTS.shape[-1]
            k_BKSH, v_BKSH = k_BKSH[:, :, :s].astype(dtype), v_BKSH[:, :, :s].astype(dtype)
        else:
            k_BKSH, v_BKSH = k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3)

        out_BTNH = attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, c)
        out_BTD = _project(out_BTNH.reshape(b, t, n * h), wo, dtype)
        return out_BTD, cache


def attend(q_BTNH, k_BKSH, v_BKSH, mask_BTS, c: ModelConfig):
    """Grouped-query attention of queries ``q [B, T, N, H]`` (rotated) over keys and values
    ``[B, K, S, H]`` where ``mask [B, T, S]`` allows: ``[B, T, N, H]`` in q's dtype."""
    b, t, n, h = q_BTNH.shape
    k, g, dtype = k_BKSH.shape[1], n // k_BKSH.shape[1], q_BTNH.dtype
    # GQA: query head j uses KV head j // g (contiguous groups of g query heads).
    q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
    logits_BKGTS = jnp.einsum("BTKGH,BKSH->BKGTS", q_BTKGH, k_BKSH).astype(jnp.float32)
    # Grok-1: logits x attn_output_multiplier, then soft-capped at 30 * tanh(x / 30).
    logits_BKGTS = logits_BKGTS * c.attn_output_multiplier
    logits_BKGTS = c.attn_logit_cap * jnp.tanh(logits_BKGTS / c.attn_logit_cap)
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _MASKED)
    weights_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(dtype)  # softmax in float32
    # per (row, KV head) a plain [G*T, S] @ [S, H] matmul; the small result is transposed after
    out_BTKGH = jnp.einsum("BKGTS,BKSH->BKGTH", weights_BKGTS, v_BKSH).transpose(0, 3, 1, 2, 4)
    return out_BTKGH.reshape(b, t, n, h)


def _project(x_BTM, w, dtype):
    """``x @ w`` for a float, int8 or panel (``panel.PanelWeight``, float32) weight ``[M, N]``."""
    if isinstance(w, panel.PanelWeight):
        return panel.panel_matmul(x_BTM.astype(jnp.float32), w.panels, w.width).astype(dtype)
    return jnp.einsum("BTM,MN->BTN", x_BTM, dequantize(w, dtype))


def _batched(x, w):
    """``x [E, ..., K] @ w [E, K, N]`` as one dot with E as a batch dimension.

    XLA:CPU runs this straight off the stored weights; an einsum that puts E among the free
    dimensions ("MD,EDF->MEF") transposes every expert's weights first (8x slower measured).
    """
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (w.ndim - 2,)), ((0,), (0,))))


def _geglu(x_E_D, w_gate, w_up, w_down):
    """GeGLU experts batched over E: down(gelu_tanh(x W_gate) * (x W_up))."""
    hidden = jax.nn.gelu(_batched(x_E_D, w_gate), approximate=True) * _batched(x_E_D, w_up)
    return _batched(hidden, w_down)


def _expert_geglu(x, weights, e: int, dtype):
    """Expert ``e`` of the (stacked or split) ``weights = (gate, up, down)`` on ``x [..., D]``."""
    gate, up, down = weights
    hidden = jax.nn.gelu(expert_matmul(x, gate, e, dtype), approximate=True) * expert_matmul(x, up, e, dtype)
    return expert_matmul(hidden, down, e, dtype)


def group_size(tokens: int, config: ModelConfig) -> int:
    """Rows per expert matmul in the ``grouped`` MoE: an expert's expected share of the
    ``tokens x k`` rows, rounded up to a multiple of 4 (at least 4, at most ``tokens``). A fuller
    expert loops, reading its weights again; padding rows cost compute. Measured at decode on
    the benchmark config, one share beat two (batch 32: 63-66 ms against 72-80 ms a step with
    the panel kernel; batch 8 within noise)."""
    rows = tokens * config.num_selected_experts  # over num_experts experts, 4 at a time
    return min(tokens, max(4, -(-rows // (4 * config.num_experts)) * 4))


class MoELayer(nn.Module):
    """Top-k mixture of GeGLU experts (GROK1.md §3.6).

    Experts are ``down(gelu_tanh(x @ linear) * (x @ linear_v))`` with ``linear_1`` as ``down``; the
    output is ``sum_j gate_j * expert_{idx_j}(x)`` with the raw (not renormalised) top-k router
    probabilities as gates. Two ways to compute it, equal up to float rounding:

    - ``"dense"``: every expert on every token, then a gate-weighted combine (the reference's
      choice): reads each expert's weights once and does E/k times the FLOPs. Differentiable
      (training uses it).
    - ``"grouped"``: for each expert, only the tokens routed to it, gathered into matmuls of
      ``group_size`` rows (a loop on device while more remain); an expert no token selected is
      skipped, its weights never read. The needed FLOPs up to padding, and at decode only the
      selected experts' bytes. Inference only (the loop has no reverse-mode gradient).

    ``"auto"`` picks ``grouped`` when the weights are split per expert (``ExpertWeights``) or in
    panels (``panel.PanelWeight``), the runner's CPU layouts, or for a single token; else
    ``dense``, which reads stacked weights in place (XLA:CPU copies a stacked expert it slices
    out). ``python -m bench.moe`` measures the combinations (BENCHMARKS.md). In panels both run
    on ``panel.grouped_matmul``: ``grouped`` as one call per weight for all experts' rows,
    exactly the routed rows with no padding; ``dense`` with every token in every expert's group.
    """

    config: ModelConfig
    impl: str = "auto"

    @nn.compact
    def __call__(self, x_BTD, probs_BTE):
        c = self.config
        d, f, e, top = c.emb_size, c.ffn_size, c.num_experts, c.num_selected_experts
        dtype = x_BTD.dtype
        b, t, _ = x_BTD.shape
        w_gate = Weight((e, d, f), name="linear")()
        w_up = Weight((e, d, f), name="linear_v")()
        w_down = Weight((e, f, d), name="linear_1")()

        gates_BTk, idx_BTk = jax.lax.top_k(probs_BTE, top)
        # Grok-1 casts the gates to bf16; here they take the activation dtype (equal in bf16 mode,
        # and exact in fp32: the reference's own fp32 h_out is closer this way, see README).
        gates_Mk = gates_BTk.astype(dtype).reshape(b * t, top)
        idx_Mk = idx_BTk.reshape(b * t, top)
        x_MD = x_BTD.reshape(b * t, d)
        split = isinstance(w_gate, ExpertWeights)
        panels = [isinstance(w, panel.PanelWeight) for w in (w_gate, w_up, w_down)]
        if any(panels) and not all(panels):
            raise ValueError(f"{self.scope.path_text}: either all or none of the expert weights must be "
                             f"in panels, got {[type(w).__name__ for w in (w_gate, w_up, w_down)]}")

        impl = self.impl
        if impl == "auto":
            impl = "grouped" if split or all(panels) or b * t == 1 else "dense"
        if impl not in ("grouped", "dense"):
            raise ValueError(f"MoELayer.impl must be 'auto', 'grouped' or 'dense', got {self.impl!r}")
        if all(panels):
            out_MD = _panel_moe(x_MD, gates_Mk, idx_Mk, (w_gate, w_up, w_down), e, impl == "dense")
        elif impl == "grouped":
            out_MD = _grouped_moe(x_MD, gates_Mk, idx_Mk, (w_gate, w_up, w_down), e,
                                  group_size(b * t, c), dtype)
        else:
            # combine[m, e] = gate of expert e for token m (0 where not selected)
            combine_ME = jnp.einsum("Mk,MkE->ME", gates_Mk, jax.nn.one_hot(idx_Mk, e, dtype=dtype))
            if split:  # one plain matmul per expert buffer
                y_EMD = jnp.stack([_expert_geglu(x_MD, (w_gate, w_up, w_down), i, dtype) for i in range(e)])
            else:
                x_EMD = jnp.broadcast_to(x_MD, (e, b * t, d))
                y_EMD = _geglu(x_EMD, *(dequantize(w, dtype) for w in (w_gate, w_up, w_down)))
            out_MD = jnp.einsum("ME,EMD->MD", combine_ME, y_EMD)
        return out_MD.reshape(b, t, d).astype(dtype)


def _grouped_moe(x_MD, gates_Mk, idx_Mk, weights, num_experts: int, rows: int, dtype):
    """``sum_j gate_j * expert_{idx_j}(x)`` computing each expert on its own tokens only.

    One stable sort of the (token, slot) pairs by expert lists each expert's tokens contiguously;
    per expert (a static loop) they are taken ``rows`` at a time into one matmul each, in a
    ``fori_loop`` with a data-dependent trip count (a ``cond`` where one group holds every token),
    so an expert no token chose is skipped. Padding rows of a group add exactly zero. Each
    token's result depends on its own row only.
    """
    m, d = x_MD.shape
    top = idx_Mk.shape[1]
    groups = -(-m // rows)
    expert_P = idx_Mk.reshape(-1)  # P = (token, slot) pairs; a token picks an expert at most once
    order_P = jnp.argsort(expert_P, stable=True).astype(jnp.int32)
    counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_P].add(1)
    starts_E = jnp.cumsum(counts_E) - counts_E
    order_P = jnp.pad(order_P, (0, groups * rows))  # every group's slice stays in bounds
    gates_P = gates_Mk.reshape(-1)
    out_MD = jnp.zeros((m, d), jnp.float32)
    for i in range(num_experts):
        def group(g, out_MD, i=i):
            pair_R = jax.lax.dynamic_slice_in_dim(order_P, starts_E[i] + g * rows, rows)
            real_R = g * rows + jnp.arange(rows) < counts_E[i]
            tok_R = jnp.where(real_R, pair_R // top, 0)
            # taken here, inside the cond or loop: a stacked expert's slice (a copy) is made only if it runs
            y_RD = _expert_geglu(x_MD[tok_R], weights, i, dtype)
            y_RD = jnp.where(real_R[:, None], gates_P[pair_R][:, None] * y_RD, 0)
            return out_MD.at[tok_R].add(y_RD.astype(jnp.float32))

        if groups == 1:  # a cond, not a loop: XLA hoisted a one-group loop's body and ran every expert
            out_MD = jax.lax.cond(counts_E[i] > 0, functools.partial(group, 0), lambda out: out, out_MD)
        else:  # one body for all groups keeps the compile time of a layer down
            out_MD = jax.lax.fori_loop(0, -(-counts_E[i] // rows), group, out_MD)
    return out_MD


def _panel_moe(x_MD, gates_Mk, idx_Mk, weights, num_experts: int, dense: bool):
    """The MoE on experts in panels (``panel.PanelWeight``): each weight is one
    ``panel.grouped_matmul`` over the rows of every expert at once (float32).

    ``grouped``: the (token, slot) pairs sorted by expert (a stable sort) are the rows, so an
    expert gets exactly its tokens, one no token chose is never read, and each expert's weight is
    read once however many rows it has. ``dense``: every token is a row of every expert's group,
    combined by the gates after. Each token's result depends on its own rows only.
    """
    m, d = x_MD.shape
    top = idx_Mk.shape[1]
    gate, up, down = weights
    x_MD = x_MD.astype(jnp.float32)

    def geglu(x_RD, sizes_E):
        hidden = (jax.nn.gelu(panel.grouped_matmul(x_RD, gate.panels, sizes_E, gate.width), approximate=True)
                  * panel.grouped_matmul(x_RD, up.panels, sizes_E, up.width))
        return panel.grouped_matmul(hidden, down.panels, sizes_E, down.width)

    if dense:
        y_EMD = geglu(jnp.tile(x_MD, (num_experts, 1)), jnp.full((num_experts,), m, jnp.int32))
        combine_ME = jnp.einsum("Mk,MkE->ME", gates_Mk.astype(jnp.float32),
                                jax.nn.one_hot(idx_Mk, num_experts, dtype=jnp.float32))
        return jnp.einsum("ME,EMD->MD", combine_ME, y_EMD.reshape(num_experts, m, d))
    expert_P = idx_Mk.reshape(-1)  # P = (token, slot) pairs; a token picks an expert at most once
    order_R = jnp.argsort(expert_P, stable=True)
    sizes_E = jnp.zeros((num_experts,), jnp.int32).at[expert_P].add(1)
    tok_R = order_R // top
    y_RD = geglu(x_MD[tok_R], sizes_E) * gates_Mk.reshape(-1)[order_R][:, None].astype(jnp.float32)
    return jnp.zeros((m, d), jnp.float32).at[tok_R].add(y_RD)


class DecoderLayer(nn.Module):
    """One block with Grok-1's sandwich norms: norm -> attention -> norm -> residual, then the same
    around the MoE (GROK1.md §3.2). Intermediates are sown for parity tests."""

    config: ModelConfig
    moe_impl: str = "auto"
    attention_kernel: bool = False

    @nn.compact
    def __call__(self, h_BTD, *, positions_BT, mask_BTS, cache=None):
        c = self.config
        attn_BTD, cache = MultiHeadAttention(c, self.attention_kernel, name="multi_head_attention")(
            RMSNorm(c.rms_norm_eps, name="rms_norm")(h_BTD), positions_BT, mask_BTS, cache)
        self.sow("intermediates", "attn_out", attn_BTD)
        h_BTD = constrain(h_BTD + RMSNorm(c.rms_norm_eps, name="rms_norm_1")(attn_BTD), RESIDUAL)

        x_BTD = RMSNorm(c.rms_norm_eps, name="rms_norm_2")(h_BTD)
        w_router = Weight((c.emb_size, c.num_experts), name="router")()
        # Router in float32: logits and softmax over all experts (Grok-1 keeps it float32).
        router_logits = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32),
                                   dequantize(w_router, jnp.float32))
        probs_BTE = jax.nn.softmax(router_logits, axis=-1)
        self.sow("intermediates", "router_probs", probs_BTE)
        moe_BTD = MoELayer(c, self.moe_impl, name="moe")(x_BTD, probs_BTE)
        self.sow("intermediates", "moe_out", moe_BTD)
        h_BTD = constrain(h_BTD + RMSNorm(c.rms_norm_eps, name="rms_norm_3")(moe_BTD), RESIDUAL)
        self.sow("intermediates", "h_out", h_BTD)
        return h_BTD, cache
