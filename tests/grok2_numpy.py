"""Grok-2's forward as a plain numpy statement of its formulas, independent of ``model/``.

Written from sglang's Grok-2 (python/sglang/srt/models/grok.py: ``Grok1DecoderLayer``,
``Grok1MoE``, ``Grok1MLP``, ``ScalingRotaryEmbedding``; the attention kernels' ``logit_cap`` and
``xai_temperature_len``; ``LogitsProcessor``'s ``final_logit_softcapping``) and YaRN (arXiv
2309.00071, §3.2), as docs/grok2.md states them. One row, float64 throughout, parameters as the
native tree holds them (``[in, out]`` matrices, experts stacked ``[E, in, out]``). Keys are
masked by position alone, as sglang's attention masks them: no token id is padding. The GELU is
the config's ``activation`` (``gelu``: Grok-2's is erf, and where that was read).
"""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x, activation):
    """Grok-2's GELU is the exact erf form: what sglang runs, not what it declares. Its Grok1MLP
    declares ``GeluAndMul(approximate="tanh")`` but calls ``gelu_and_mul_triton``, whose kernel
    computes ``0.5 * (1 + erf(x / sqrt 2)) * x`` (srt/layers/elementwise.py); Grok1MoE passes
    ``activation="gelu"`` to FusedMoE, which runs sgl_kernel's ``gelu_and_mul``, erf too
    (srt/layers/moe/fused_moe_triton/fused_moe.py, sgl-kernel csrc/elementwise/activation.cu).
    sglang-jax computes the tanh form in both (``jax.nn.gelu``'s default). Grok-1's published
    code: tanh (``jax.nn.gelu``)."""
    if activation == "gelu_erf":
        return 0.5 * x * (1 + _erf(x / math.sqrt(2)))
    assert activation == "gelu_tanh", activation
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def cap(x, c):
    return c * np.tanh(x / c) if c else x


def inverse_frequencies(c):
    """RoPE's frequencies over a head of key_size dimensions, YaRN-scaled as the config says."""
    h = c.key_size
    powers = c.rope_base ** (np.arange(0, h, 2) / h)
    original = 1 / powers
    if c.rope_scaling == "none":
        return original
    interpolated = 1 / (c.rope_scaling_factor * powers)

    def correction_dim(rotations):  # the dimension whose wavelength turns `rotations` times
        return h * math.log(c.rope_original_context / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_base))

    low = max(math.floor(correction_dim(c.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(c.rope_beta_slow)), h - 1)
    if low == high:
        low -= 0.001
    keep = 1 - np.clip((np.arange(h // 2) - low) / (high - low), 0, 1)  # weight of the original
    if c.rope_scaling == "yarn":
        return interpolated * (1 - keep) + original * keep
    return np.exp(np.log(original) * keep + np.log(interpolated) * (1 - keep))


def rope(x, positions, inv_freq):
    """Rotate-half RoPE of ``x [T, heads, H]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    angle = positions[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x, p, positions, c):
    t = x.shape[0]
    n, k, h = c.num_q_heads, c.num_kv_heads, c.key_size
    q = (x @ p["query"]["w"]).reshape(t, n, h)
    key = (x @ p["key"]["w"]).reshape(t, k, h)
    value = (x @ p["value"]["w"]).reshape(t, k, h)
    inv_freq = inverse_frequencies(c)
    q, key = rope(q, positions, inv_freq), rope(key, positions, inv_freq)
    out = np.zeros((t, n, h))
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    for head in range(n):
        kv = head // (n // k)
        logits = cap(q[:, head] @ key[:, kv].T * c.attn_output_multiplier, c.attn_logit_cap)
        if c.attn_temperature_len:
            length = c.attn_temperature_len
            factor = np.where(positions > length, np.log2(np.maximum(positions, 1)) / math.log2(length), 1.0)
            logits = logits * factor[:, None]
        logits = np.where(causal, logits, -np.inf)
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        out[:, head] = (weights / weights.sum(axis=-1, keepdims=True)) @ value[:, kv]
    return out.reshape(t, n * h) @ p["linear"]["w"]


def geglu(x, gate, up, down, activation):
    return (gelu(x @ gate, activation) * (x @ up)) @ down


def moe(x, p, router_w, c):
    probs = []
    out = np.zeros_like(x)
    for i, row in enumerate(x):
        logits = cap(row @ router_w, c.router_logit_cap)
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        probs.append(prob)
        for e in np.argsort(-prob, kind="stable")[: c.num_selected_experts]:  # gates: raw probabilities
            out[i] += prob[e] * geglu(row, p["linear"]["w"][e], p["linear_v"]["w"][e], p["linear_1"]["w"][e],
                                      c.activation)
    return out, np.stack(probs)


def layer(h, p, positions, c):
    """One decoder layer: ``(h_out, {name: intermediate})``."""
    eps = c.rms_norm_eps
    attn = attention(rms_norm(h, p["rms_norm"]["scale"], eps), p["multi_head_attention"], positions, c)
    h = h + rms_norm(attn, p["rms_norm_1"]["scale"], eps)
    x = rms_norm(h, p["rms_norm_2"]["scale"], eps)
    ffn, probs = moe(x, p["moe"], p["router"]["w"], c)
    if c.shared_ffn_size:
        mlp = p["mlp"]
        ffn = (geglu(x, mlp["linear"]["w"], mlp["linear_v"]["w"], mlp["linear_1"]["w"], c.activation) + ffn) / math.sqrt(2)
    h = h + rms_norm(ffn, p["rms_norm_3"]["scale"], eps)
    return h, {"attn_out": attn, "router_probs": probs, "moe_out": ffn, "h_out": h}


def embed(tokens, params, c):
    return params["language_model"]["in_out_embed"]["embeddings"][tokens] * c.embedding_multiplier_scale


def unembed(h, params, c):
    head = params["language_model"]
    table = head["in_out_embed" if c.tie_embeddings else "lm_head"]["embeddings"]
    logits = rms_norm(h, head["rms_norm"]["scale"], c.rms_norm_eps) @ table.T * c.output_multiplier_scale
    return cap(logits, c.final_logit_cap)


def _layer(stacked, i):
    """Layer ``i`` of the model's stacked layer parameters (every leaf ``[L, ...]``)."""
    return {k: _layer(v, i) for k, v in stacked.items()} if isinstance(stacked, dict) else stacked[i]


def forward(params, tokens, c):
    """Logits ``[T, V]`` of one row of tokens at positions 0..T-1, and each layer's intermediates."""
    params = to_float64(params)
    positions = np.arange(len(tokens))
    h = embed(np.asarray(tokens), params, c)
    layers = []
    for i in range(c.num_layers):
        h, inter = layer(h, _layer(params["transformer"]["layers"], i), positions, c)
        layers.append(inter)
    return unembed(h, params, c), layers


def to_float64(tree):
    if isinstance(tree, dict):
        return {k: to_float64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)
