"""Model configuration: one frozen, keyword-only, validated dataclass and its presets.

Field names follow the published Grok-1 code (``emb_size``, ``key_size``, ``num_q_heads``, ...)
so that a line here can be checked against it. Variants are made with ``dataclasses.replace``,
never by mutation; every construction is validated in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def ffn_size(emb_size: int, widening_factor: float) -> int:
    """Hidden size of one expert, exactly as Grok-1 computes it (docs/grok1.md §3.8).

    Two thirds of ``widening_factor * emb_size`` (GeGLU has two input matrices), rounded up to a
    multiple of 8: 32768 for Grok-1 (6144, 8), 344 for (64, 8).
    """
    size = int(widening_factor * emb_size) * 2 // 3
    return size + (-size) % 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a Grok-1-style mixture-of-experts decoder."""

    vocab_size: int
    emb_size: int
    key_size: int
    num_q_heads: int
    num_kv_heads: int
    num_layers: int
    widening_factor: float
    num_experts: int
    num_selected_experts: int
    sequence_len: int
    embedding_multiplier_scale: float
    output_multiplier_scale: float
    attn_output_multiplier: float
    pad_token: int = 0
    eos_token: int = 2
    bos_token: int = 1
    # Grok-1 fixed constants (docs/grok1.md §1), kept as fields so they are visible and checkable.
    rms_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    attn_logit_cap: float = 30.0
    # Activation dtype; softmax, norms, RoPE phases and the router always run in float32.
    fprop_dtype: str = "bfloat16"

    def __post_init__(self):
        positive = (
            "vocab_size", "emb_size", "key_size", "num_q_heads", "num_kv_heads", "num_layers",
            "num_experts", "num_selected_experts", "sequence_len",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        for name in ("widening_factor", "embedding_multiplier_scale", "output_multiplier_scale",
                     "attn_output_multiplier", "rms_norm_eps", "rope_base", "attn_logit_cap"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.key_size % 2:
            raise ValueError(f"ModelConfig.key_size must be even for rotary embeddings, got {self.key_size}")
        if self.num_selected_experts > self.num_experts:
            raise ValueError(
                f"ModelConfig.num_selected_experts ({self.num_selected_experts}) must be at most "
                f"num_experts ({self.num_experts})")
        for name in ("pad_token", "eos_token", "bos_token"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        if self.fprop_dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.fprop_dtype must be one of {sorted(_DTYPES)}, got {self.fprop_dtype!r}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dtype(self):
        """The activation dtype as a JAX dtype."""
        return _DTYPES[self.fprop_dtype]

    @property
    def ffn_size(self) -> int:
        return ffn_size(self.emb_size, self.widening_factor)

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (G in GQA); q head h uses KV head h // q_per_kv."""
        return self.num_q_heads // self.num_kv_heads

    def param_counts(self) -> dict[str, int]:
        """Parameter count by part, from the shapes the model declares."""
        d, h, f, e = self.emb_size, self.key_size, self.ffn_size, self.num_experts
        per_layer_attn = d * h * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        per_layer_moe = 3 * e * d * f
        return {
            "embedding": self.vocab_size * d,
            "attention": self.num_layers * per_layer_attn,
            "moe": self.num_layers * per_layer_moe,
            "router": self.num_layers * d * e,
            "norms": self.num_layers * 4 * d + d,
        }

    @property
    def num_params(self) -> int:
        return sum(self.param_counts().values())

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to."""
        counts = self.param_counts()
        inactive = counts["moe"] * (self.num_experts - self.num_selected_experts) // self.num_experts
        return self.num_params - inactive

    def kv_bytes_per_token(self, dtype=None) -> int:
        """KV-memory bytes one token occupies: 2 (K and V) x layers x KV heads x key_size x bytes;
        in int8 (``model.memory.QuantizedKV``) each vector of key_size bytes also has a float32 scale."""
        dtype = jnp.dtype(dtype if dtype is not None else self.dtype)
        vector = self.key_size + 4 if dtype == jnp.int8 else self.key_size * dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * vector


# Grok-1 as published (docs/grok1.md §1, run.py of xai-org/grok-1).
GROK_1 = ModelConfig(
    vocab_size=131072,
    emb_size=6144,
    key_size=128,
    num_q_heads=48,
    num_kv_heads=8,
    num_layers=64,
    widening_factor=8,
    num_experts=8,
    num_selected_experts=2,
    sequence_len=8192,
    embedding_multiplier_scale=78.38367176906169,
    output_multiplier_scale=0.5773502691896257,
    attn_output_multiplier=0.08838834764831845,
    pad_token=0,
    eos_token=2,
)

# The tiny model of the Grok-1 reference fixture (../shared/data/grok1_reference/results.json).
GROK_1_REFERENCE_TINY = ModelConfig(
    vocab_size=12288,
    emb_size=64,
    key_size=16,
    num_q_heads=16,
    num_kv_heads=8,
    num_layers=12,
    widening_factor=8,
    num_experts=8,
    num_selected_experts=2,
    sequence_len=128,
    embedding_multiplier_scale=8.0,
    output_multiplier_scale=0.5773502691896257,
    attn_output_multiplier=0.25,
)

# A very small model for unit tests: two layers, GQA 4:2, four experts top-2.
TINY = ModelConfig(
    vocab_size=256,
    emb_size=32,
    key_size=8,
    num_q_heads=4,
    num_kv_heads=2,
    num_layers=2,
    widening_factor=2,
    num_experts=4,
    num_selected_experts=2,
    sequence_len=64,
    embedding_multiplier_scale=32 ** 0.5,
    output_multiplier_scale=0.5773502691896257,
    attn_output_multiplier=8 ** -0.5,
    fprop_dtype="float32",
)

PRESETS = {"grok-1": GROK_1, "grok-1-reference-tiny": GROK_1_REFERENCE_TINY, "tiny": TINY}
