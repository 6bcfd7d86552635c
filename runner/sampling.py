"""Token sampling with per-slot settings: temperature, top-k, top-p (nucleus) and a per-slot key.

Settings are arrays with one entry per batch slot, so requests with different settings share one
compiled step (as in Grok-1's runner). Temperature 0 is exact argmax (the reference divides by it
and gets NaN); everything else is temperature -> top-k -> top-p on the tempered, max-subtracted
distribution, then a Gumbel-max draw with the slot's own key. The top-k/top-p cut sorts each row,
or, on the CPU backend where its kernel was taken, finds the same cut with a radix select
(``backends/cpu``): XLA:CPU's sort of 32 rows of 32768 logits costs 190 ms. The backend also finds
the reported top tokens and the normaliser (``logits_summary``, one pass on the CPU kernel).

Reported probabilities are those of the model itself (softmax of the raw logits, temperature 1):
the chosen token's log-probability and the ``TOP_K`` most likely alternatives, like the
reference's top-8. They cost a pass over each row (the normaliser, the top tokens), so a call
computes them only when one of its rows asks (``SampleSettings.logprobs``); otherwise greedy rows
take a plain argmax.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from backends import XLA
from backends.xla import argmax
from runner.requests import MAX_LOGPROBS

TOP_K = MAX_LOGPROBS  # alternatives reported per token: the most the OpenAI API asks for (the reference reports 8)
_MIN_TEMPERATURE = 1e-6
DEFAULT_BACKEND = XLA()


@flax.struct.dataclass
class SampleSettings:
    temperature: jax.Array  # [B] float32; 0 = greedy
    nucleus_p: jax.Array  # [B] float32 in (0, 1]; 1 = off
    top_k: jax.Array  # [B] int32; 0 = off
    logprobs: jax.Array  # [B] int32: alternatives the row reports; -1 = no log-probabilities at all

    @classmethod
    def zeros(cls, batch_size: int) -> "SampleSettings":
        return cls(temperature=jnp.zeros((batch_size,), jnp.float32),
                   nucleus_p=jnp.ones((batch_size,), jnp.float32),
                   top_k=jnp.zeros((batch_size,), jnp.int32),
                   logprobs=jnp.full((batch_size,), -1, jnp.int32))


@flax.struct.dataclass
class SampleOutput:
    token_id: jax.Array  # [B] int32
    # the rest is zero unless a row of the call asked for log-probabilities
    logprob: jax.Array  # [B] float32, log p(token) under the model
    top_k_token_ids: jax.Array  # [B, TOP_K] int32
    top_k_probs: jax.Array  # [B, TOP_K] float32


def filter_logits(logits_BV, settings: SampleSettings, backend=DEFAULT_BACKEND):
    """Tempered logits with everything outside top-k and the nucleus set to -inf; the cut is the
    backend's ``sampling_cut``."""
    temperature = jnp.maximum(settings.temperature, _MIN_TEMPERATURE)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    threshold_B = backend.sampling_cut(scaled_BV, settings.top_k, settings.nucleus_p)
    return jnp.where(scaled_BV >= threshold_B[:, None], scaled_BV, -jnp.inf)


def sample_token(logits_BV, settings: SampleSettings, keys_B2, backend=DEFAULT_BACKEND) -> SampleOutput:
    """One token per row; ``keys_B2`` are the rows' own PRNG keys for this draw. The top-k/top-p
    cut and the top tokens with the normaliser are the ``backend``'s (``backends.Backend``)."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = settings.temperature <= 0

    def draw():
        # The cut costs a pass over each row at least (a sort without the kernel): skip it when no row asks.
        filtered_BV = jax.lax.cond(
            jnp.any((settings.top_k > 0) | (settings.nucleus_p < 1)),
            lambda: filter_logits(logits_BV, settings, backend),
            lambda: logits_BV / jnp.maximum(settings.temperature, _MIN_TEMPERATURE)[:, None])
        # jax.random.categorical's own Gumbel-max draw, with the faster argmax
        gumbel_BV = jax.vmap(lambda key: jax.random.gumbel(key, logits_BV.shape[-1:], jnp.float32))(keys_B2)
        return argmax(filtered_BV + gumbel_BV)

    # The noise costs as much as the rest of sampling; a batch of greedy rows never draws it.
    sampled_B = jax.lax.cond(jnp.all(greedy_B), lambda: jnp.zeros(greedy_B.shape, jnp.int32), draw)
    top = min(TOP_K, logits_BV.shape[-1])

    asked = jnp.any(settings.logprobs >= 0)

    def summary():
        top_logits, top_ids, lse_B, argmax_B = backend.logits_summary(logits_BV, top)
        return jnp.exp(top_logits - lse_B[:, None]), top_ids.astype(jnp.int32), lse_B, argmax_B.astype(jnp.int32)

    def bare():  # no row reports log-probabilities: the greedy rows' argmax alone
        b = logits_BV.shape[0]
        return (jnp.zeros((b, top), jnp.float32), jnp.zeros((b, top), jnp.int32), jnp.zeros((b,), jnp.float32),
                argmax(logits_BV).astype(jnp.int32))

    top_probs, top_ids, lse_B, argmax_B = jax.lax.cond(asked, summary, bare)
    token_B = jnp.where(greedy_B, argmax_B, sampled_B).astype(jnp.int32)
    logprob_B = jnp.take_along_axis(logits_BV, token_B[:, None], axis=-1)[:, 0] - lse_B
    return SampleOutput(token_id=token_B, logprob=jnp.where(asked, logprob_B, 0.0), top_k_token_ids=top_ids,
                        top_k_probs=top_probs)


@flax.struct.dataclass
class PromptScores:
    """Each prompt position of a prefill chunk scored: the log-probability of the token that
    follows it (``targets``), and the ``TOP_K`` most likely tokens there."""

    logprob: jax.Array  # [P, T] float32 (0 where a position has no target)
    top_ids: jax.Array  # [P, T, TOP_K] int32
    top_probs: jax.Array  # [P, T, TOP_K] float32


def score_positions(logits_PTV, targets_PT, backend=DEFAULT_BACKEND) -> PromptScores:
    """``PromptScores`` of every position of ``logits_PTV``: one summary pass over its rows (the
    backend's ``logits_summary``, no sort over the vocabulary on the host)."""
    p, t, v = logits_PTV.shape
    flat = logits_PTV.reshape(p * t, v).astype(jnp.float32)
    top_logits, top_ids, lse, _ = backend.logits_summary(flat, min(TOP_K, v))
    chosen = jnp.take_along_axis(flat, jnp.maximum(targets_PT.reshape(-1, 1), 0), axis=-1)[:, 0] - lse
    return PromptScores(logprob=jnp.where(targets_PT >= 0, chosen.reshape(p, t), 0.0),
                        top_ids=top_ids.astype(jnp.int32).reshape(p, t, -1),
                        top_probs=jnp.exp(top_logits - lse[:, None]).reshape(p, t, -1))
