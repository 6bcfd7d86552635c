"""Token sampling with per-slot settings: temperature, top-k, top-p (nucleus) and a per-slot key.

Settings are arrays with one entry per batch slot, so requests with different settings share one
compiled step (as in Grok-1's runner). Temperature 0 is exact argmax (the reference divides by it
and gets NaN); everything else is temperature -> top-k -> top-p on the tempered, max-subtracted
distribution, then a Gumbel-max draw with the slot's own key. The top-k/top-p cut sorts each row,
or, with ``kernel=True`` (the runner on one CPU device), finds the same cut with a radix select
(``model.panel.filter_threshold``): XLA:CPU's sort of 32 rows of 32768 logits costs 190 ms. The
kernels also find the reported top tokens and the normaliser in one pass (``logits_summary``).

Reported probabilities are those of the model itself (softmax of the raw logits, temperature 1):
the chosen token's log-probability and the ``TOP_K`` most likely alternatives, like the
reference's top-8.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from model import panel

TOP_K = 20  # alternatives reported per token: the most the OpenAI API asks for (the reference reports 8)
_MIN_TEMPERATURE = 1e-6


@flax.struct.dataclass
class SampleSettings:
    temperature: jax.Array  # [B] float32; 0 = greedy
    nucleus_p: jax.Array  # [B] float32 in (0, 1]; 1 = off
    top_k: jax.Array  # [B] int32; 0 = off

    @classmethod
    def zeros(cls, batch_size: int) -> "SampleSettings":
        return cls(temperature=jnp.zeros((batch_size,), jnp.float32),
                   nucleus_p=jnp.ones((batch_size,), jnp.float32),
                   top_k=jnp.zeros((batch_size,), jnp.int32))


@flax.struct.dataclass
class SampleOutput:
    token_id: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32, log p(token) under the model
    top_k_token_ids: jax.Array  # [B, TOP_K] int32
    top_k_probs: jax.Array  # [B, TOP_K] float32


def filter_logits(logits_BV, settings: SampleSettings, kernel: bool = False):
    """Tempered logits with everything outside top-k and the nucleus set to -inf; ``kernel`` finds
    the cut on the CPU kernel instead of sorting."""
    temperature = jnp.maximum(settings.temperature, _MIN_TEMPERATURE)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    if kernel:
        threshold_B = panel.filter_threshold(scaled_BV, settings.top_k, settings.nucleus_p)
    else:
        threshold_B = sorted_threshold(scaled_BV, settings)
    return jnp.where(scaled_BV >= threshold_B[:, None], scaled_BV, -jnp.inf)


def sorted_threshold(scaled_BV, settings: SampleSettings):
    """The smallest tempered logit that top-k then top-p keep, by sorting each row: the reference
    rule. Top-p keeps a token while the mass of the tokens before it, in the softmax of the top-k
    survivors, is below p; the most likely token always survives (p -> 0 is argmax)."""
    v = scaled_BV.shape[-1]
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)  # descending
    k_B = jnp.where(settings.top_k > 0, jnp.minimum(settings.top_k, v), v)
    kth_B = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)[:, 0]
    # nucleus over the top-k survivors: keep a token while the mass before it is below p
    in_top_k_BV = jnp.arange(v)[None, :] < k_B[:, None]
    shifted_BV = jnp.where(in_top_k_BV, sorted_BV - sorted_BV[:, :1], -jnp.inf)  # max-subtracted
    probs_BV = jax.nn.softmax(shifted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # p >= 1 is off: float32's cumulative sum reaches 1 before the tail does and would cut it
    keep_BV = ((mass_before_BV < settings.nucleus_p[:, None]) | (settings.nucleus_p[:, None] >= 1)) & in_top_k_BV
    keep_BV = keep_BV.at[:, 0].set(True)  # the most likely token always survives (p -> 0 is argmax)
    last_kept_B = jnp.sum(keep_BV, axis=-1) - 1
    threshold_B = jnp.take_along_axis(sorted_BV, last_kept_B[:, None], axis=-1)[:, 0]
    return jnp.maximum(threshold_B, kth_B)


def argmax(x_BV):
    """``jnp.argmax`` over the last axis (first index among ties), as two plain reductions:
    XLA:CPU runs the single (value, index) reduction of ``jnp.argmax`` 3-4x slower."""
    v = x_BV.shape[-1]
    first_B = jnp.min(jnp.where(x_BV == jnp.max(x_BV, axis=-1, keepdims=True), jnp.arange(v), v), axis=-1)
    return jnp.minimum(first_B, v - 1)  # a row of NaNs has no maximum: its last index, never out of range


def sample_token(logits_BV, settings: SampleSettings, keys_B2, kernel: bool = False,
                 summary_kernel: bool | None = None) -> SampleOutput:
    """One token per row; ``keys_B2`` are the rows' own PRNG keys for this draw. ``kernel``: cut
    top-k/top-p on the CPU kernel (``filter_logits``); ``summary_kernel`` (default: as ``kernel``):
    find the top tokens and the normaliser on it (``model.panel.logits_summary``)."""
    summary_kernel = kernel if summary_kernel is None else summary_kernel
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = settings.temperature <= 0

    def draw():
        # The cut costs a pass over each row at least (a sort without the kernel): skip it when no row asks.
        filtered_BV = jax.lax.cond(
            jnp.any((settings.top_k > 0) | (settings.nucleus_p < 1)),
            lambda: filter_logits(logits_BV, settings, kernel),
            lambda: logits_BV / jnp.maximum(settings.temperature, _MIN_TEMPERATURE)[:, None])
        # jax.random.categorical's own Gumbel-max draw, with the faster argmax
        gumbel_BV = jax.vmap(lambda key: jax.random.gumbel(key, logits_BV.shape[-1:], jnp.float32))(keys_B2)
        return argmax(filtered_BV + gumbel_BV)

    # The noise costs as much as the rest of sampling; a batch of greedy rows never draws it.
    sampled_B = jax.lax.cond(jnp.all(greedy_B), lambda: jnp.zeros(greedy_B.shape, jnp.int32), draw)
    top = min(TOP_K, logits_BV.shape[-1])
    if summary_kernel:  # the top 8 and the normaliser in one pass: XLA:CPU's top-8 alone took 1.6 ms at batch 32
        top_logits, top_ids, lse_B = panel.logits_summary(logits_BV, top)
        argmax_B = top_ids[:, 0]
    else:
        top_logits, top_ids = jax.lax.top_k(logits_BV, top)
        lse_B = jax.nn.logsumexp(logits_BV, axis=-1)
        argmax_B = argmax(logits_BV)
    token_B = jnp.where(greedy_B, argmax_B, sampled_B).astype(jnp.int32)
    return SampleOutput(
        token_id=token_B,
        logprob=jnp.take_along_axis(logits_BV, token_B[:, None], axis=-1)[:, 0] - lse_B,
        top_k_token_ids=top_ids.astype(jnp.int32),
        top_k_probs=jnp.exp(top_logits - lse_B[:, None]),
    )
