"""Token sampling with per-slot settings: temperature, top-k, top-p (nucleus) and a per-slot key.

Settings are arrays with one entry per batch slot, so requests with different settings share one
compiled step (as in Grok-1's runner). First the logits are processed by the row's rules
(``Constraints``, in vLLM's order: the allowed-token mask of a structured output, banned stop ids
before ``min_tokens``, then the repetition, frequency and presence penalties over the row's token
history); a call whose rows have none skips that pass. Temperature 0 is then exact argmax (the
reference divides by it and gets NaN); everything else is temperature -> min-p -> top-k -> top-p
on the tempered distribution, then a Gumbel-max draw with the slot's own key. The top-k/top-p cut sorts each row,
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
import numpy as np

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
    min_p: jax.Array  # [B] float32 in [0, 1]; 0 = off
    repetition_penalty: jax.Array  # [B] float32 > 0; 1 = off
    frequency_penalty: jax.Array  # [B] float32; 0 = off
    presence_penalty: jax.Array  # [B] float32; 0 = off

    @classmethod
    def host(cls, batch_size: int, **values) -> "SampleSettings":
        """Numpy arrays of ``batch_size`` rows, each setting ``values[name]`` where given, else off
        (greedy: a free row's, or a padding row's)."""
        off = dict(temperature=0.0, nucleus_p=1.0, top_k=0, logprobs=-1, min_p=0.0, repetition_penalty=1.0,
                   frequency_penalty=0.0, presence_penalty=0.0)
        dtypes = {"top_k": np.int32, "logprobs": np.int32}
        return cls(**{name: np.full((batch_size,), values.get(name, value), dtypes.get(name, np.float32))
                      for name, value in off.items()})


@flax.struct.dataclass
class Constraints:
    """What a row's request rules out or penalises beyond its settings, by token id (``V``)."""

    counts: jax.Array  # [B, V] int32: times the row's request generated each token so far
    seen: jax.Array  # [B, V] bool: the tokens of its prompt (the repetition penalty counts them too)
    banned: jax.Array  # [B, S] int32: ids it may not sample now (-1: none): its stop ids before min_tokens
    # The allowed tokens of a structured output (``runner.grammar``): bit ``t % 32`` of word
    # ``t // 32``, applied where ``masked``.
    mask: jax.Array  # [B, ceil(V / 32)] uint32
    masked: jax.Array  # [B] bool


def unpack_mask(words_BW, vocab_size: int):
    """The ``[B, V]`` bool of a bitmask: token t is bit ``t % 32`` of word ``t // 32``."""
    bits = (words_BW[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(words_BW.shape[0], -1)[:, :vocab_size].astype(bool)


def process_logits(logits_BV, settings: SampleSettings, rules: Constraints):
    """The logits under each row's rules, in vLLM's order: the mask and the banned ids to -inf, then
    the repetition penalty (a logit of a token in the prompt or the output divided by it where
    positive, multiplied where not), then ``frequency x count`` and ``presence x (count > 0)``
    subtracted for the output's tokens."""
    b, v = logits_BV.shape
    out = jnp.where(rules.masked[:, None] & ~unpack_mask(rules.mask, v), -jnp.inf, logits_BV)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], rules.banned.shape)
    out = out.at[rows, jnp.where(rules.banned >= 0, rules.banned, v)].set(-jnp.inf, mode="drop")
    counts = rules.counts.astype(jnp.float32)
    penalty = settings.repetition_penalty[:, None]
    repeated = jnp.where(out > 0, out / penalty, out * penalty)
    out = jnp.where(rules.seen | (rules.counts > 0), repeated, out)
    return (out - settings.frequency_penalty[:, None] * counts
            - settings.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def needs_processing(settings: SampleSettings, rules: Constraints):
    """Whether any row has a rule for ``process_logits`` (else the call skips its pass)."""
    return jnp.any(rules.masked | jnp.any(rules.banned >= 0, axis=1) | (settings.repetition_penalty != 1)
                   | (settings.frequency_penalty != 0) | (settings.presence_penalty != 0))


@flax.struct.dataclass
class SampleOutput:
    token_id: jax.Array  # [B] int32
    # the rest is zero unless a row of the call asked for log-probabilities
    logprob: jax.Array  # [B] float32, log p(token) under the model
    top_k_token_ids: jax.Array  # [B, TOP_K] int32
    top_k_probs: jax.Array  # [B, TOP_K] float32


def filter_logits(logits_BV, settings: SampleSettings, backend=DEFAULT_BACKEND):
    """Tempered logits with everything below min-p (less likely than ``min_p`` x the most likely
    token), outside top-k or outside the nucleus set to -inf; the top-k/top-p cut is the backend's
    ``sampling_cut``."""
    temperature = jnp.maximum(settings.temperature, _MIN_TEMPERATURE)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temperature
    threshold_B = backend.sampling_cut(scaled_BV, settings.top_k, settings.nucleus_p)
    min_p_B = jnp.max(scaled_BV, axis=-1) + jnp.log(settings.min_p)  # -inf where off
    return jnp.where(scaled_BV >= jnp.maximum(threshold_B, min_p_B)[:, None], scaled_BV, -jnp.inf)


def sample_token(logits_BV, settings: SampleSettings, keys_B2, backend=DEFAULT_BACKEND,
                 rules: Constraints | None = None) -> SampleOutput:
    """One token per row; ``keys_B2`` are the rows' own PRNG keys for this draw, ``rules`` their
    ``Constraints`` (None: none). The top-k/top-p cut and the top tokens with the normaliser are
    the ``backend``'s (``backends.Backend``). Reported log-probabilities are the model's own."""
    raw_BV = logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = settings.temperature <= 0
    processed = None
    if rules is not None:
        # one pass over the rows when any has a rule; its argmax is then the greedy rows' token
        def process():
            out = process_logits(raw_BV, settings, rules)
            return out, argmax(out).astype(jnp.int32)

        needs = needs_processing(settings, rules)
        processed = jax.lax.cond(needs, process, lambda: (raw_BV, jnp.zeros(greedy_B.shape, jnp.int32)))
        logits_BV = processed[0]

    def draw():
        # The cut costs a pass over each row at least (a sort without the kernel): skip it when no row asks.
        filtered_BV = jax.lax.cond(
            jnp.any((settings.top_k > 0) | (settings.nucleus_p < 1) | (settings.min_p > 0)),
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
        top_logits, top_ids, lse_B, argmax_B = backend.logits_summary(raw_BV, top)
        return jnp.exp(top_logits - lse_B[:, None]), top_ids.astype(jnp.int32), lse_B, argmax_B.astype(jnp.int32)

    def bare():  # no row reports log-probabilities: the greedy rows' argmax alone
        b = raw_BV.shape[0]
        return (jnp.zeros((b, top), jnp.float32), jnp.zeros((b, top), jnp.int32), jnp.zeros((b,), jnp.float32),
                argmax(raw_BV).astype(jnp.int32))

    top_probs, top_ids, lse_B, argmax_B = jax.lax.cond(asked, summary, bare)
    if processed is not None:
        argmax_B = jnp.where(needs, processed[1], argmax_B)
    token_B = jnp.where(greedy_B, argmax_B, sampled_B).astype(jnp.int32)
    logprob_B = jnp.take_along_axis(raw_BV, token_B[:, None], axis=-1)[:, 0] - lse_B
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
