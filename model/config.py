"""Model configuration: one frozen, keyword-only, validated dataclass and its presets.

Field names follow the published Grok-1 code (``emb_size``, ``key_size``, ``num_q_heads``, ...)
so that a line here can be checked against it. Variants are made with ``dataclasses.replace``,
never by mutation; every construction is validated in ``__post_init__``.

One family: Grok-1 and Grok-2 are the same decoder, and every way Grok-2 differs is a field whose
default is Grok-1's (docs/grok2.md): a shared dense MLP beside the experts, RoPE scaling, an
attention temperature past a length, soft caps on the router and the final logits, and an
output projection of its own. ``variant`` names which one a config is; the math reads the fields.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
VARIANTS = ("grok-1", "grok-2")
# RoPE scalings (docs/grok2.md §3): none; YaRN's blend of interpolated and original frequencies,
# linear ("yarn") or in log space ("yarn_log"), as sglang's ScalingRotaryEmbedding computes them
ROPE_SCALINGS = ("none", "yarn", "yarn_log")
# The GeGLU's GELU (docs/grok2.md §2): Grok-1's published code, ``jax.nn.gelu``'s tanh
# approximation; Grok-2 as sglang's kernels compute it, the exact erf form.
ACTIVATIONS = ("gelu_tanh", "gelu_erf")


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
    # The padding id: a forward without memory hides every key of this id, as Grok-1's reference
    # does (docs/grok1.md §3.1). None: keys are masked by position only, as sglang masks Grok-2's
    # (docs/grok2.md §11); the KV-memory paths always mask by position.
    pad_token: int | None = 0
    eos_token: int = 2
    bos_token: int = 1
    # Grok-1 fixed constants (docs/grok1.md §1), kept as fields so they are visible and checkable.
    rms_norm_eps: float = 1e-5
    rope_base: float = 10000.0
    attn_logit_cap: float = 30.0
    # Activation dtype; softmax, norms, RoPE phases and the router always run in float32.
    fprop_dtype: str = "bfloat16"
    # ---- the Grok family: Grok-1's values by default (docs/grok2.md) ----
    variant: str = "grok-1"
    # An expert's hidden size; 0: Grok-1's rule from widening_factor (``ffn_size``).
    expert_ffn_size: int = 0
    # A dense GeGLU MLP of this hidden size beside the experts, on the same normed input; the
    # layer's feed-forward output is then (mlp + moe) / sqrt(2) (Grok-2's residual_moe). 0: none.
    shared_ffn_size: int = 0
    # Soft caps ``cap * tanh(x / cap)`` on the router's logits (before the softmax) and on the
    # final logits (after output_multiplier_scale); 0: none.
    router_logit_cap: float = 0.0
    final_logit_cap: float = 0.0
    # Attention logits of a query at position p > attn_temperature_len are multiplied by
    # log2(p) / log2(attn_temperature_len), after the soft cap; 0: none.
    attn_temperature_len: int = 0
    # RoPE scaling (ROPE_SCALINGS): the frequencies for a context rope_scaling_factor times the
    # original one (rope_original_context), blended between beta_fast and beta_slow rotations.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_context: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    # Grok-1 unembeds with the embedding table; False: an output table of its own (``lm_head``).
    tie_embeddings: bool = True
    # The experts' and the shared MLP's GELU (ACTIVATIONS).
    activation: str = "gelu_tanh"

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
            if name == "pad_token" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelConfig.{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        if self.fprop_dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.fprop_dtype must be one of {sorted(_DTYPES)}, got {self.fprop_dtype!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"ModelConfig.variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("expert_ffn_size", "shared_ffn_size", "attn_temperature_len", "rope_original_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be an integer >= 0 (0: off), got {value!r}")
        for name in ("router_logit_cap", "final_logit_cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"ModelConfig.{name} must be a finite number >= 0 (0: no cap), got {value!r}")
        if self.attn_temperature_len == 1:
            raise ValueError("ModelConfig.attn_temperature_len must be 0 (off) or at least 2 (it divides by its log2)")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"ModelConfig.rope_scaling must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if self.rope_scaling != "none":
            if not (isinstance(self.rope_scaling_factor, (int, float)) and math.isfinite(self.rope_scaling_factor)
                    and self.rope_scaling_factor >= 1):
                raise ValueError(f"ModelConfig.rope_scaling_factor must be a number >= 1, got {self.rope_scaling_factor!r}")
            if self.rope_original_context <= 0:
                raise ValueError(f"ModelConfig.rope_scaling {self.rope_scaling!r} needs rope_original_context > 0, "
                                 f"got {self.rope_original_context!r}")
            for name in ("rope_beta_fast", "rope_beta_slow"):
                value = getattr(self, name)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                    raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dtype(self):
        """The activation dtype as a JAX dtype."""
        return _DTYPES[self.fprop_dtype]

    @property
    def ffn_size(self) -> int:
        """One expert's hidden size: ``expert_ffn_size``, else Grok-1's rule."""
        return self.expert_ffn_size or ffn_size(self.emb_size, self.widening_factor)

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (G in GQA); q head h uses KV head h // q_per_kv."""
        return self.num_q_heads // self.num_kv_heads

    def param_counts(self) -> dict[str, int]:
        """Parameter count by part, from the shapes the model declares."""
        d, h, f, e = self.emb_size, self.key_size, self.ffn_size, self.num_experts
        per_layer_attn = d * h * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        per_layer_moe = 3 * e * d * f
        counts = {
            "embedding": self.vocab_size * d * (1 if self.tie_embeddings else 2),
            "attention": self.num_layers * per_layer_attn,
            "moe": self.num_layers * per_layer_moe,
            "router": self.num_layers * d * e,
            "norms": self.num_layers * 4 * d + d,
        }
        if self.shared_ffn_size:
            counts["shared_mlp"] = self.num_layers * 3 * d * self.shared_ffn_size
        return counts

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

# Grok-2 as released (xai-org/grok-2's config.json, as sglang reads it: docs/grok2.md). Its
# config asks for rope_type "original" with a scaling factor of 16 over 8192 positions: sglang's
# "original" keeps the unscaled frequencies, so RoPE is plain here too (the factor is recorded).
GROK_2 = ModelConfig(
    variant="grok-2",
    vocab_size=131072,
    emb_size=8192,
    key_size=128,
    num_q_heads=64,
    num_kv_heads=8,
    num_layers=64,
    widening_factor=3,  # ffn_size(8192, 3) = 16384, its experts' moe_intermediate_size
    shared_ffn_size=32768,
    num_experts=8,
    num_selected_experts=2,
    sequence_len=131072,
    embedding_multiplier_scale=90.50966799187809,
    output_multiplier_scale=0.5,
    attn_output_multiplier=0.08838834764831845,  # key_size ** -0.5
    rope_base=208533496.0,
    rope_original_context=8192,
    rope_scaling_factor=16.0,
    rope_beta_fast=8.0,
    rope_beta_slow=1.0,
    router_logit_cap=30.0,
    final_logit_cap=50.0,
    attn_temperature_len=1024,
    tie_embeddings=False,
    activation="gelu_erf",  # sglang's kernels (docs/grok2.md §2)
    pad_token=None,  # its config names none; <|pad|> is a tokenizer's token like another
    bos_token=1,
    eos_token=2,
)

# A very small Grok-2 for tests: every Grok-2 field on, at sizes where each shows within 64
# positions (temperature past 8, YaRN over an original context of 16) and the caps bite.
TINY_GROK2 = dataclasses.replace(
    TINY,
    variant="grok-2",
    widening_factor=1,  # experts of 24
    shared_ffn_size=40,
    rope_base=1000.0,
    rope_scaling="yarn",
    rope_scaling_factor=4.0,
    rope_original_context=16,
    rope_beta_fast=8.0,
    rope_beta_slow=1.0,
    router_logit_cap=2.0,
    final_logit_cap=5.0,
    attn_logit_cap=3.0,
    attn_temperature_len=8,
    tie_embeddings=False,
    activation="gelu_erf",
    pad_token=None,
)

PRESETS = {"grok-1": GROK_1, "grok-1-reference-tiny": GROK_1_REFERENCE_TINY, "tiny": TINY,
           "grok-2": GROK_2, "tiny-grok-2": TINY_GROK2}
