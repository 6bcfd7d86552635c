"""Prompt-lookup (n-gram) speculative decoding: the two device-side rules (issue 25, item 2).

Grok-1 has no draft model, but a continuation that repeats or edits its context drafts itself:
the tokens that followed the most recent earlier occurrence of the request's last n tokens are
likely to follow again. One forward over the k drafted positions costs about one decode step
while the step is bound by reading the weights, so every accepted draft token is a token for
free.

Both rules are pure JAX over a batch of rows, so they run where the tokens are (a token history
in the decode state) and the host never proposes stale drafts:

- ``ngram_draft``: each row's draft, from its token history alone (-1 marks an unknown token:
  it never matches).
- ``verify``: which drafted tokens a row keeps, and the token that follows them, such that the
  kept tokens have exactly the distribution plain decoding would give them: a greedy row keeps a
  draft token while it is the argmax; a sampled row keeps draft token d with probability p(d)
  (the draft is a point mass, so min(1, p/q) = p), and at the first rejected position samples
  from p with d removed, renormalised (the residual max(0, p - q) normalised); after a fully
  accepted draft it samples the next position from p itself.

The engine's speculative step (``runner.engine.speculate``) drafts, verifies in one forward with
the cache, rolls the row's ``step`` back past what it kept and adapts each row's draft length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ngram_draft(history_BS, length_B, k: int, max_n: int = 3, min_n: int = 1):
    """Each row's draft of up to ``k`` tokens: for the longest n in ``[min_n, max_n]`` whose last
    n tokens (of the row's first ``length_B`` history tokens) occurred earlier, the tokens that
    followed their most recent earlier occurrence that is followed by k tokens, or if none is,
    their most recent earlier occurrence. Returns (draft ``[B, k]`` int32, padded with
    -1; its length ``[B]`` int32, 0 where nothing matched)."""
    b, s = history_BS.shape
    positions = jnp.arange(s)
    draft = jnp.full((b, k), -1, jnp.int32)
    count = jnp.zeros((b,), jnp.int32)
    for n in range(min_n, max_n + 1):  # longer n-grams later: they win where they match
        # the row's last n tokens
        last = jnp.take_along_axis(history_BS, jnp.clip(length_B[:, None] - n + jnp.arange(n), 0, s - 1), axis=1)
        match = jnp.ones((b, s), bool)
        for i in range(n):  # window starting at j equals the last n tokens
            shifted = jnp.pad(history_BS[:, i:], ((0, 0), (0, i)), constant_values=-1)
            match &= shifted == last[:, i: i + 1]
        # an earlier occurrence (not the last n tokens themselves): one followed by a token
        match &= positions[None, :] < (length_B - n)[:, None]
        # the most recent followed by k tokens, else the most recent (in a run of one repeated
        # token, the occurrence just before the end is followed by one token only)
        full = jnp.max(jnp.where(match & (positions[None, :] <= (length_B - n - k)[:, None]), positions[None, :], -1),
                       axis=1)
        best = jnp.where(full >= 0, full, jnp.max(jnp.where(match, positions[None, :], -1), axis=1))
        found = best >= 0
        start = best + n
        available = jnp.minimum(k, length_B - start)
        idx = jnp.clip(start[:, None] + jnp.arange(k), 0, s - 1)
        candidate = jnp.where(jnp.arange(k)[None, :] < available[:, None],
                              jnp.take_along_axis(history_BS, idx, axis=1), -1)
        draft = jnp.where(found[:, None], candidate, draft)
        count = jnp.where(found, available, count)
    return draft.astype(jnp.int32), count.astype(jnp.int32)


def verify(probs_BKV, draft_BK, count_B, greedy_B, keys_B2, argmax_BT=None):
    """The tokens a row keeps from its draft and the one after them.

    ``probs_BKV`` are the target distributions at the row's k + 1 positions (position i predicts
    the token after draft token i - 1; position 0 the first new token), after the row's own
    sampling rules; ``draft_BK`` its draft (``count_B`` real tokens); ``greedy_B`` rows keep
    argmax (``argmax_BT``, the raw logits' where given: exactly plain greedy decoding's token, else
    the probabilities'); ``keys_B2`` one PRNG key a row for this call. Returns (accepted ``[B]``
    int32: draft tokens kept, the next ``[B]`` int32: the token after them)."""
    b, k1, v = probs_BKV.shape
    k = k1 - 1
    uniform_key, residual_key, free_key = (jax.vmap(lambda key: jax.random.split(key, 3))(keys_B2)
                                           .transpose(1, 0, 2))
    safe_draft = jnp.clip(draft_BK, 0, v - 1)
    p_draft = jnp.take_along_axis(probs_BKV[:, :k], safe_draft[..., None], axis=-1)[..., 0]  # [B, k]
    argmax_BK = jnp.argmax(probs_BKV, axis=-1) if argmax_BT is None else argmax_BT  # [B, k + 1]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(uniform_key)
    keep = jnp.where(greedy_B[:, None], argmax_BK[:, :k] == draft_BK, u < p_draft)
    keep &= jnp.arange(k)[None, :] < count_B[:, None]
    accepted = jnp.argmin(jnp.concatenate([keep, jnp.zeros((b, 1), bool)], axis=1), axis=1)  # first False
    at = accepted  # the position whose distribution gives the next token
    p_at = jnp.take_along_axis(probs_BKV, at[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = at < count_B  # the draft token at `at` was refused: sample from p without it
    refused = jnp.take_along_axis(safe_draft, jnp.minimum(at, k - 1)[:, None], axis=1)[:, 0] if k else at
    residual = jnp.where(rejected[:, None] & (jnp.arange(v)[None, :] == refused[:, None]), 0.0, p_at)
    sampled = jax.vmap(lambda key, p: jax.random.categorical(key, jnp.log(p)))(
        jnp.where(rejected[:, None], residual_key, free_key), residual)
    greedy_next = jnp.take_along_axis(argmax_BK, at[:, None], axis=1)[:, 0]
    return accepted.astype(jnp.int32), jnp.where(greedy_B, greedy_next, sampled).astype(jnp.int32)
