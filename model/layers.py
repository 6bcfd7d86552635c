"""The layers of one Grok-1 decoder block, as Flax linen modules (docs/grok1.md §3.2–§3.6).

Parameter names and shapes follow the published Haiku tree exactly (``multi_head_attention/query/w``
``[D, N*H]``, ``moe/linear/w`` ``[E, D, F]``, ...), so a checkpoint maps onto it by name. Any weight
may be a float array or a ``QuantizedWeight8bit``, or held in a backend's own layout (its
``prepare``); the layers never look inside a weight: each is handed to the backend's operation
(``backends.Backend``: matmul, grouped matmul, attention), which dequantises where it must. The
backend is always an argument: ``model/`` imports nothing from ``backends/`` (which imports it).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model.config import ACTIVATIONS, ModelConfig
from model.quant import QuantizedWeight8bit, dequantize
from model.partitioning import constrain

RESIDUAL = ("batch", "seq", "act_embed")
CACHE = ("layers", "batch", "cache_kv_heads", "cache_sequence", "head_dim")  # KVMemory.k, .v



def _fan_in_normal(fan_in_axes: tuple[int, ...]):
    """Normal initialiser scaled by 1/sqrt(fan-in); only used for fresh (untrained) parameters."""

    def init(key, shape, dtype=jnp.float32):
        fan_in = math.prod(shape[a] for a in fan_in_axes)
        return jax.random.normal(key, shape, dtype) / math.sqrt(fan_in)

    return init


def held_in_layout(scope: nn.Module, name: str, shape: tuple[int, ...]):
    """The variable ``name`` where a backend holds it in its own layout (not an array: Flax checks
    the shapes of plain leaves only), after checking its logical shape; else None."""
    if not scope.has_variable("params", name):
        return None
    w = scope.get_variable("params", name)
    if isinstance(w, (jax.Array, np.ndarray, QuantizedWeight8bit)):
        return None
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{scope.scope.path_text}/{name}: held as {type(w).__name__} of shape {tuple(w.shape)}, "
                         f"the config needs {tuple(shape)}")
    return w


class Weight(nn.Module):
    """One weight ``w`` (float, int8, or in a backend's layout), like a bias-free Haiku ``Linear``
    without the matmul. Its one declaration: the shape (from the config), the logical axes (one
    per dimension, mapped to mesh axes by ``model.partitioning``'s rules) and the initialiser
    (fan-in scaled normal, float32)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    fan_in_axes: tuple[int, ...] = (-2,)

    @nn.compact
    def __call__(self):
        held = held_in_layout(self, "w", self.shape)
        if held is not None:
            return held
        return declare(self, "w", _fan_in_normal(self.fan_in_axes), self.shape, self.axes)


def declare(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str, ...]):
    """A float32 parameter of ``module`` with its logical axes attached (Flax's logical
    partitioning metadata: ``init`` returns them boxed, ``apply`` sees the plain array)."""
    if len(axes) != len(shape):
        raise ValueError(f"{module.scope.path_text}/{name}: {len(shape)} dimensions but axes {axes}")
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


class RMSNorm(nn.Module):
    """Grok-1 RMSNorm: float32 math, the scale multiplies directly (not ``1 + scale``), no bias."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = declare(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",))
        x32 = x.astype(jnp.float32)  # norms in float32
        ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return (scale.astype(jnp.float32) * x32 * jax.lax.rsqrt(ms + self.eps)).astype(x.dtype)


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, context: int):
    """The dimensions (pairs) between which YaRN blends: the one whose wavelength turns ``beta_fast``
    times over the original ``context`` (floored) to the one that turns ``beta_slow`` times (ceiled),
    clipped to ``[0, dim - 1]`` (docs/grok2.md §3; YaRN, arXiv 2309.00071, §3.2)."""
    def dimension(rotations):
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(dimension(beta_fast)), 0), min(math.ceil(dimension(beta_slow)), dim - 1)


def rope_frequencies(key_size: int, config: ModelConfig):
    """RoPE's inverse frequencies ``[H/2]`` float32: ``1 / base^(2i/H)`` (Grok-1), or with
    ``rope_scaling`` YaRN's blend of those and the interpolated ``1 / (factor * base^(2i/H))``:
    the original frequency for the fast dimensions (below the correction range), the
    interpolated one for the slow ones (above it), a linear ramp between; "yarn" blends the
    frequencies, "yarn_log" their logarithms (docs/grok2.md §3)."""
    h = key_size
    powers_h = config.rope_base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    original_h = 1.0 / powers_h
    if config.rope_scaling == "none":
        return original_h
    low, high = yarn_correction_range(config.rope_beta_fast, config.rope_beta_slow, h, config.rope_base,
                                      config.rope_original_context)
    if low == high:
        low -= 0.001  # no zero-width ramp
    ramp_h = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep_h = 1 - ramp_h  # the weight of the original frequency
    interpolated_h = 1.0 / (config.rope_scaling_factor * powers_h)
    if config.rope_scaling == "yarn":
        return interpolated_h * (1 - keep_h) + original_h * keep_h
    return jnp.exp(jnp.log(original_h) * keep_h + jnp.log(interpolated_h) * (1 - keep_h))


def rotary_embedding(x_BTnH, positions_BT, base: float, inv_freq_h=None):
    """Rotate-half (GPT-NeoX layout) RoPE over the full head dim, phases in float32 (docs/grok1.md §3.4);
    ``inv_freq_h`` (``rope_frequencies``) replaces ``1 / base^(2i/H)`` where given."""
    h = x_BTnH.shape[-1]
    if inv_freq_h is None:
        inv_freq_h = 1.0 / base ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    phase_BTh = positions_BT.astype(jnp.float32)[:, :, None] * inv_freq_h
    phase_BTH = jnp.concatenate([phase_BTh, phase_BTh], axis=-1)[:, :, None, :]  # [B,T,1,H]
    x32 = x_BTnH.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., h // 2:], x32[..., : h // 2]], axis=-1)
    return (x32 * jnp.cos(phase_BTH) + rotated * jnp.sin(phase_BTH)).astype(x_BTnH.dtype)


def attention_temperature(positions_BT, length: int):
    """Grok-2's factor on the capped attention logits of a query at position p: ``log2(p) /
    log2(length)`` past ``length``, 1 up to it (docs/grok2.md §4). ``[B, T]`` float32."""
    p_BT = positions_BT.astype(jnp.float32)
    return jnp.where(positions_BT > length, jnp.log2(jnp.maximum(p_BT, 1.0)) / math.log2(length), 1.0)


def gelu(x, activation: str):
    """The GeGLU's GELU (``ModelConfig.activation``): ``"gelu_tanh"``, the tanh approximation
    Grok-1's published code computes (``jax.nn.gelu``'s default); ``"gelu_erf"``, the exact
    ``x * Phi(x)`` of sglang's Grok-2 kernels (docs/grok2.md §2)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return jax.nn.gelu(x, approximate=activation == "gelu_tanh")


class MultiHeadAttention(nn.Module):
    """Grouped-query attention with RoPE, Grok-1's logit soft-cap and an optional KV cache; the
    projections and the attention itself are the backend's."""

    config: ModelConfig
    backend: object  # what runs the matmuls and the attention (a backends.Backend, passed in)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, mask_BTS, cache=None, layer=0, rows_BT=None):
        """``mask_BTS[b, t, s]`` says whether query t of row b may attend to key s.

        Without ``cache`` the keys are this chunk's own (S = T). With ``cache = (k, v)``, every
        layer's ``[L, B, K, S, H]`` (positions fourth: a step reads them without a transpose), the
        chunk's K/V are written into layer ``layer`` (an int, or the scan's traced index) at
        ``positions_BT`` first and the keys are that layer's whole cache; the updated stack is
        returned. Query (b, t) writes and reads cache row b, or with ``rows_BT`` row ``rows_BT[b,
        t]`` (a packed prefill: several requests' chunks in one row of tokens; a row past the
        cache's is padding, written nowhere).
        """
        c, backend = self.config, self.backend
        d, n, k, h = c.emb_size, c.num_q_heads, c.num_kv_heads, c.key_size
        dtype = x_BTD.dtype
        b, t, _ = x_BTD.shape
        wq = Weight((d, n * h), ("embed", "q_heads"), name="query")()
        wo = Weight((n * h, d), ("q_heads", "embed"), name="linear")()
        q_BTNH = constrain(backend.matmul(x_BTD, wq, dtype).reshape(b, t, n, h),
                           ("batch", "seq", "act_heads", "head_dim"))
        k_BTKH = constrain(backend.matmul(x_BTD, Weight((d, k * h), ("embed", "kv_heads"), name="key")(), dtype).reshape(b, t, k, h),
                           ("batch", "seq", "act_kv_heads", "head_dim"))
        v_BTKH = constrain(backend.matmul(x_BTD, Weight((d, k * h), ("embed", "kv_heads"), name="value")(), dtype).reshape(b, t, k, h),
                           ("batch", "seq", "act_kv_heads", "head_dim"))
        # The same positions (cache step + t) rotate queries and keys.
        inv_freq_h = None if c.rope_scaling == "none" else rope_frequencies(h, c)
        q_BTNH = rotary_embedding(q_BTNH, positions_BT, c.rope_base, inv_freq_h)
        k_BTKH = rotary_embedding(k_BTKH, positions_BT, c.rope_base, inv_freq_h)

        if cache is not None:
            written_BT = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t)) if rows_BT is None else rows_BT
            # a scatter that drops a padded position past sequence_len; an int8 cache quantises
            # the chunk's K/V as it writes them, so the chunk attends to them as rounded too
            cache = tuple(backend.write_kv(full, layer, written_BT, positions_BT, new)
                          for full, new in zip(cache, (k_BTKH, v_BTKH)))
            cache = jax.tree_util.tree_map(lambda x: constrain(x, CACHE), cache)  # never resharded
            # The backend reads layer ``layer`` of the stack, and of it the first S positions only
            # (S = the mask's length: a bucket that covers every row's valid positions).
            k_BKSH, v_BKSH, read = *cache, layer
        else:
            k_BKSH, v_BKSH, read = k_BTKH.transpose(0, 2, 1, 3), v_BTKH.transpose(0, 2, 1, 3), None

        temperature_BT = attention_temperature(positions_BT, c.attn_temperature_len) if c.attn_temperature_len else None
        out_BTNH = backend.attention(q_BTNH, k_BKSH, v_BKSH, mask_BTS, c.attn_output_multiplier, c.attn_logit_cap,
                                     temperature_BT, layer=read, rows_BT=rows_BT)
        out_BTD = backend.matmul(out_BTNH.reshape(b, t, n * h), wo, dtype)
        return out_BTD, cache


class MoELayer(nn.Module):
    """Top-k mixture of GeGLU experts (docs/grok1.md §3.6).

    Experts are ``down(gelu(x @ linear) * (x @ linear_v))`` with ``linear_1`` as ``down`` (the
    config's ``activation``; Grok-1's tanh-approximated); the
    output is ``sum_j gate_j * expert_{idx_j}(x)`` with the raw (not renormalised) top-k router
    probabilities as gates. One way to compute it (``moe``): route, sort the (token, expert)
    pairs by expert, three grouped matmuls of the backend, combine. Each expert computes exactly
    the rows routed to it. Tokens that are not ``valid_BT`` (padding past a row's length, a free
    slot's row) are routed to no expert: they cost nothing in the MoE and their output is 0.
    """

    config: ModelConfig
    backend: object  # what runs the matmuls and the attention (a backends.Backend, passed in)

    @nn.compact
    def __call__(self, x_BTD, probs_BTE, valid_BT=None):
        c = self.config
        d, f, e, top = c.emb_size, c.ffn_size, c.num_experts, c.num_selected_experts
        dtype = x_BTD.dtype
        b, t, _ = x_BTD.shape
        weights = (Weight((e, d, f), ("experts", "embed", "mlp"), name="linear")(),
                   Weight((e, d, f), ("experts", "embed", "mlp"), name="linear_v")(),
                   Weight((e, f, d), ("experts", "mlp", "embed"), name="linear_1")())
        gates_BTk, idx_BTk = jax.lax.top_k(probs_BTE, top)
        # Grok-1 casts the gates to bf16; here they take the activation dtype (equal in bf16 mode,
        # and exact in fp32: the reference's own fp32 h_out is closer this way, see README).
        gates_Mk = gates_BTk.astype(dtype).reshape(b * t, top)
        valid_M = None if valid_BT is None else valid_BT.reshape(b * t)
        out_MD = moe(x_BTD.reshape(b * t, d), gates_Mk, idx_BTk.reshape(b * t, top), weights, self.backend, dtype,
                     valid_M, activation=c.activation)
        return out_MD.reshape(b, t, d).astype(dtype)


def moe(x_MD, gates_Mk, idx_Mk, weights, backend, dtype, valid_M=None, *, activation: str = "gelu_tanh"):
    """``sum_j gate_j * expert_{idx_j}(x)`` for ``weights = (gate, up, down)``, stacked ``[E, ., .]``
    (or in the backend's layout).

    The (token, slot) pairs in a stable order by expert (``by_expert``) list each expert's rows
    contiguously (``R = M * k`` rows, ``sizes_E`` of them per expert); the backend's ``grouped_matmul`` runs
    each group by its own expert; the gated rows are added back to their tokens. Each token's
    result depends on its own rows only. A token not in ``valid_M`` (``[M]`` bool; default all)
    takes the out-of-range expert E: its rows sort last, past every group, so no expert computes
    them (an expert none of the valid tokens picked is never read) and its result is 0.
    ``[M, D]`` float32.
    """
    m, d = x_MD.shape
    top = idx_Mk.shape[1]
    gate, up, down = weights
    num_experts = gate.shape[0]
    expert_R = idx_Mk.reshape(-1)  # a token picks an expert at most once
    if valid_M is not None:
        expert_R = jnp.where(jnp.repeat(valid_M, top), expert_R, num_experts)
    order_R, sizes_E = by_expert(expert_R, num_experts)
    tok_R = order_R // top
    x_RD = x_MD[tok_R]
    hidden_RF = (gelu(backend.grouped_matmul(x_RD, gate, sizes_E, dtype), activation)
                 * backend.grouped_matmul(x_RD, up, sizes_E, dtype))
    y_RD = backend.grouped_matmul(hidden_RF, down, sizes_E, dtype)
    y_RD = y_RD.astype(jnp.float32) * gates_Mk.reshape(-1)[order_R][:, None].astype(jnp.float32)
    return jnp.zeros((m, d), jnp.float32).at[tok_R].add(y_RD)


PAIRWISE_ROWS = 64  # by_expert's cheaper way up to here (2-core EPYC, per layer: 16 rows 10 us against 51)


def by_expert(expert_R, num_experts: int):
    """The order of a stable sort of ``expert_R`` (``[R]`` ints in ``[0, E]``; E: no expert) and
    each expert's count ``sizes_E``, without a sort: a row's place is the number of rows of a
    lower expert plus those of its own expert before it; counted from every pair of rows up to
    ``PAIRWISE_ROWS`` (a decode step's), else from a cumulative sum of one-hot rows ``[R, E + 1]``
    (a prefill's; 8,192 rows: 0.45 ms against ``argsort``'s 1.2). XLA:CPU (jaxlib 0.10.2) turns a
    sort's comparator into a native ``LessThan`` the first time the program runs, and then cannot
    serialise the program (``UNIMPLEMENTED: `LessThan` is not serializable``)."""
    rows = expert_R.shape[0]
    row_R = jnp.arange(rows, dtype=jnp.int32)
    if rows <= PAIRWISE_ROWS:
        other, this = expert_R[None, :], expert_R[:, None]
        place_R = jnp.sum((other < this) | ((other == this) & (row_R[None, :] < row_R[:, None])), axis=1,
                          dtype=jnp.int32)
        counts_E = jnp.sum(this == jnp.arange(num_experts, dtype=expert_R.dtype), axis=0, dtype=jnp.int32)
    else:
        onehot_RE = (expert_R[:, None] == jnp.arange(num_experts + 1, dtype=expert_R.dtype)).astype(jnp.int32)
        before_R = jnp.sum(jnp.cumsum(onehot_RE, axis=0) * onehot_RE, axis=1) - 1
        counts_E = jnp.sum(onehot_RE, axis=0)
        place_R = (jnp.cumsum(counts_E) - counts_E)[expert_R] + before_R
        counts_E = counts_E[:num_experts]
    return jnp.zeros((rows,), jnp.int32).at[place_R].set(row_R, unique_indices=True), counts_E


class DenseMLP(nn.Module):
    """Grok-2's shared MLP beside the experts: the experts' GeGLU, ``linear_1(gelu(x @ linear)
    * (x @ linear_v))``, dense, of hidden size ``shared_ffn_size`` (docs/grok2.md §2)."""

    config: ModelConfig
    backend: object

    @nn.compact
    def __call__(self, x_BTD):
        d, f, dtype, backend = self.config.emb_size, self.config.shared_ffn_size, x_BTD.dtype, self.backend
        gate = backend.matmul(x_BTD, Weight((d, f), ("embed", "mlp"), name="linear")(), dtype)
        up = backend.matmul(x_BTD, Weight((d, f), ("embed", "mlp"), name="linear_v")(), dtype)
        return backend.matmul(gelu(gate, self.config.activation) * up,
                              Weight((f, d), ("mlp", "embed"), name="linear_1")(), dtype)


class DecoderLayer(nn.Module):
    """One block with Grok-1's sandwich norms: norm -> attention -> norm -> residual, then the same
    around the MoE (docs/grok1.md §3.2); with ``shared_ffn_size``, around (mlp + moe) / sqrt(2)
    (Grok-2, docs/grok2.md §2). Intermediates are sown for parity tests."""

    config: ModelConfig
    backend: object  # what runs the matmuls and the attention (a backends.Backend, passed in)

    @nn.compact
    def __call__(self, carry, layer, positions_BT, mask_BTS, valid_BT=None, rows_BT=None):
        """``carry = (h_BTD, cache)``: the residual stream and every layer's ``(k, v)``
        (``model.memory.KVMemory``; None without memory), of which this block writes and reads
        layer ``layer``. Returns the new carry and None: the signature of a step of ``nn.scan``
        (``model.transformer.Transformer``)."""
        h_BTD, cache = carry
        c = self.config
        attn_BTD, cache = MultiHeadAttention(c, self.backend, name="multi_head_attention")(
            RMSNorm(c.rms_norm_eps, name="rms_norm")(h_BTD), positions_BT, mask_BTS, cache, layer, rows_BT)
        self.sow("intermediates", "attn_out", attn_BTD)
        h_BTD = constrain(h_BTD + RMSNorm(c.rms_norm_eps, name="rms_norm_1")(attn_BTD), RESIDUAL)

        x_BTD = RMSNorm(c.rms_norm_eps, name="rms_norm_2")(h_BTD)
        w_router = Weight((c.emb_size, c.num_experts), ("embed", "router_experts"), name="router")()
        # Router in float32: logits and softmax over all experts (Grok-1 keeps it float32).
        router_logits = jnp.einsum("BTD,DE->BTE", x_BTD.astype(jnp.float32),
                                   dequantize(w_router, jnp.float32))
        if c.router_logit_cap:  # Grok-2: soft-capped before the softmax
            router_logits = c.router_logit_cap * jnp.tanh(router_logits / c.router_logit_cap)
        probs_BTE = jax.nn.softmax(router_logits, axis=-1)
        self.sow("intermediates", "router_probs", probs_BTE)
        moe_BTD = MoELayer(c, self.backend, name="moe")(x_BTD, probs_BTE, valid_BT)
        if c.shared_ffn_size:
            mlp_BTD = DenseMLP(c, self.backend, name="mlp")(x_BTD)
            self.sow("intermediates", "mlp_out", mlp_BTD)
            moe_BTD = ((mlp_BTD.astype(jnp.float32) + moe_BTD.astype(jnp.float32))
                       / math.sqrt(2)).astype(moe_BTD.dtype)
        self.sow("intermediates", "moe_out", moe_BTD)
        h_BTD = constrain(h_BTD + RMSNorm(c.rms_norm_eps, name="rms_norm_3")(moe_BTD), RESIDUAL)
        self.sow("intermediates", "h_out", h_BTD)
        return (h_BTD, cache), None
