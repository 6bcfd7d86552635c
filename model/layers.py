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

from model.config import ModelConfig
from model.quant import dequantize
from model.sharding import constrain

RESIDUAL = ("batch", "seq", "act_embed")
CACHE = ("batch", "cache_sequence", "cache_kv_heads", "head_dim")

_MASKED = -1e30  # Grok-1: masked attention logits are set to -1e30
_MAX_SWITCH_ROWS = 32  # XLA:CPU compiles hundreds of unrolled switches slowly (and has crashed)


def _fan_in_normal(fan_in_axes: tuple[int, ...]):
    """Normal initialiser scaled by 1/sqrt(fan-in); only used for fresh (untrained) parameters."""

    def init(key, shape, dtype=jnp.float32):
        fan_in = math.prod(shape[a] for a in fan_in_axes)
        return jax.random.normal(key, shape, dtype) / math.sqrt(fan_in)

    return init


class Weight(nn.Module):
    """One weight ``w`` (float or int8), like a bias-free Haiku ``Linear`` without the matmul."""

    shape: tuple[int, ...]
    fan_in_axes: tuple[int, ...] = (-2,)

    @nn.compact
    def __call__(self):
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
    """Grouped-query attention with RoPE, Grok-1's logit soft-cap and an optional KV cache."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache=None):
        """``mask_BTS[b, t, s]`` says whether query t of row b may attend to key s.

        Without ``cache`` the keys are this chunk's own (S = T). With ``cache = (k_BSKH, v_BSKH)``
        the chunk's K/V are written at ``positions_BT`` first and the keys are the whole cache; the
        updated cache is returned.
        """
        c = self.config
        d, n, k, h, g = c.emb_size, c.num_q_heads, c.num_kv_heads, c.key_size, c.q_per_kv
        dtype = x_BTD.dtype
        b, t, _ = x_BTD.shape
        wq_DNH = dequantize(Weight((d, n * h), name="query")(), dtype).reshape(d, n, h)
        wk_DKH = dequantize(Weight((d, k * h), name="key")(), dtype).reshape(d, k, h)
        wv_DKH = dequantize(Weight((d, k * h), name="value")(), dtype).reshape(d, k, h)
        wo_ND = dequantize(Weight((n * h, d), name="linear")(), dtype)

        q_BTNH = constrain(jnp.einsum("BTD,DNH->BTNH", x_BTD, wq_DNH), ("batch", "seq", "act_heads", "head_dim"))
        k_BTKH = constrain(jnp.einsum("BTD,DKH->BTKH", x_BTD, wk_DKH), ("batch", "seq", "act_kv_heads", "head_dim"))
        v_BTKH = constrain(jnp.einsum("BTD,DKH->BTKH", x_BTD, wv_DKH), ("batch", "seq", "act_kv_heads", "head_dim"))
        # The same positions (cache step + t) rotate queries and keys.
        q_BTNH = rotary_embedding(q_BTNH, positions_BT, c.rope_base)
        k_BTKH = rotary_embedding(k_BTKH, positions_BT, c.rope_base)

        if cache is not None:
            k_BSKH, v_BSKH = cache
            rows_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
            # Scatter with mode="drop": a padded position past sequence_len is dropped, never
            # clamped onto valid entries (XLA's dynamic_update_slice would clamp).
            k_BSKH = k_BSKH.at[rows_BT, positions_BT].set(k_BTKH.astype(k_BSKH.dtype), mode="drop")
            v_BSKH = v_BSKH.at[rows_BT, positions_BT].set(v_BTKH.astype(v_BSKH.dtype), mode="drop")
            k_BSKH, v_BSKH = constrain(k_BSKH, CACHE), constrain(v_BSKH, CACHE)  # never resharded
            cache = (k_BSKH, v_BSKH)
            # Attend to the first S positions only (S = the mask's length: a bucket that covers
            # every row's valid positions), so a step reads the KV it needs, not the whole cache.
            s = mask_BTS.shape[-1]
            k_BSKH, v_BSKH = k_BSKH[:, :s].astype(dtype), v_BSKH[:, :s].astype(dtype)
        else:
            k_BSKH, v_BSKH = k_BTKH, v_BTKH

        # GQA: query head j uses KV head j // g (contiguous groups of g query heads).
        q_BTKGH = q_BTNH.reshape(b, t, k, g, h)
        logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH).astype(jnp.float32)
        # Grok-1: logits x attn_output_multiplier, then soft-capped at 30 * tanh(x / 30).
        logits_BKGTS = logits_BKGTS * c.attn_output_multiplier
        logits_BKGTS = c.attn_logit_cap * jnp.tanh(logits_BKGTS / c.attn_logit_cap)
        logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS, _MASKED)
        weights_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(dtype)  # softmax in float32
        out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", weights_BKGTS, v_BSKH)
        out_BTD = jnp.einsum("BTM,MD->BTD", out_BTKGH.reshape(b, t, n * h), wo_ND)
        return out_BTD, cache


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


class MoELayer(nn.Module):
    """Top-k mixture of GeGLU experts (GROK1.md §3.6).

    Experts are ``down(gelu_tanh(x @ linear) * (x @ linear_v))`` with ``linear_1`` as ``down``; the
    output is ``sum_j gate_j * expert_{idx_j}(x)`` with the raw (not renormalised) top-k router
    probabilities as gates. Two ways to compute it, equal up to float rounding:

    - ``"dense"``: every expert on every token, then a gate-weighted combine (the reference's
      choice): reads each expert's weights once, E/k times the FLOPs. Best once most experts are hit.
    - ``"switch"``: one expert application per (token, slot) row, the expert chosen at run time by
      ``lax.switch``: only the selected experts' weights are read. Best at small token counts
      (decode), where the weights, not the FLOPs, cost the time.

    ``"auto"`` picks ``switch`` while tokens x k is at most ``num_experts``, else ``dense``;
    BENCHMARKS.md has the measurement behind the threshold.
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
        # Grok-1: the gates are cast to bf16 before weighting the experts, in every fprop dtype.
        gates_BTk = gates_BTk.astype(dtype)
        x_MD = x_BTD.reshape(b * t, d)

        impl = self.impl
        if impl == "auto":
            impl = "switch" if b * t * top <= e else "dense"
        if impl == "switch":
            if b * t * top > _MAX_SWITCH_ROWS:
                raise ValueError(f"MoELayer impl 'switch' unrolls one switch per (token, slot) row and is "
                                 f"meant for decode: {b * t * top} rows is more than {_MAX_SWITCH_ROWS}")

            def expert(i, x_D):
                pick = lambda w: dequantize(jax.tree_util.tree_map(lambda a: a[i:i + 1], w), dtype)  # noqa: E731
                return _geglu(x_D[None, None], pick(w_gate), pick(w_up), pick(w_down))[0, 0]

            branches = [functools.partial(expert, i) for i in range(e)]
            idx_R = idx_BTk.reshape(-1)  # R = (token, slot) rows
            y_RD = jnp.stack([jax.lax.switch(idx_R[r], branches, x_MD[r // top]) for r in range(b * t * top)])
            out_BTD = jnp.sum(gates_BTk[..., None] * y_RD.reshape(b, t, top, d), axis=2)
        elif impl == "dense":
            x_EMD = jnp.broadcast_to(x_MD, (e, b * t, d))
            y_EMD = _geglu(x_EMD, dequantize(w_gate, dtype), dequantize(w_up, dtype), dequantize(w_down, dtype))
            # combine[m, e] = gate of expert e for token m (0 where not selected)
            combine_MkE = jax.nn.one_hot(idx_BTk.reshape(-1, top), e, dtype=dtype)
            combine_ME = jnp.einsum("Mk,MkE->ME", gates_BTk.reshape(-1, top), combine_MkE)
            out_BTD = jnp.einsum("ME,EMD->MD", combine_ME, y_EMD).reshape(b, t, d)
        else:
            raise ValueError(f"MoELayer.impl must be 'auto', 'switch' or 'dense', got {self.impl!r}")
        return out_BTD.astype(dtype)


class DecoderLayer(nn.Module):
    """One block with Grok-1's sandwich norms: norm -> attention -> norm -> residual, then the same
    around the MoE (GROK1.md §3.2). Intermediates are sown for parity tests."""

    config: ModelConfig
    moe_impl: str = "auto"

    @nn.compact
    def __call__(self, h_BTD, *, positions_BT, mask_BTS, cache=None):
        c = self.config
        attn_BTD, cache = MultiHeadAttention(c, name="multi_head_attention")(
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
