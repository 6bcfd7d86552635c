"""Prompt-lookup speculation's device rules against plain statements of them: the n-gram draft,
and verification that keeps plain decoding's distribution exactly (a statistical test on a tiny
vocabulary) and its greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.speculative import ngram_draft, verify


def reference_draft(history, k, max_n=3, min_n=1):
    """The plain rule: the longest n whose last n tokens occurred earlier, and what followed their
    most recent earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(history) < n + 1:
            continue
        last = history[-n:]
        for j in range(len(history) - n - 1, -1, -1):
            if history[j: j + n] == last:
                out = history[j + n: j + n + k]
                return out + [-1] * (k - len(out)), len(out)
    return [-1] * k, 0


def test_ngram_draft_matches_the_plain_rule():
    rng = np.random.default_rng(0)
    s, k = 24, 4
    rows = [[5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2], [9], [4, 4, 4, 4], [1, 2, 3, 4]]
    rows += [rng.integers(0, 4, rng.integers(1, s)).tolist() for _ in range(40)]  # small alphabet: many matches
    history = np.full((len(rows), s), 0, np.int32)
    for i, row in enumerate(rows):
        history[i, : len(row)] = row
        history[i, len(row):] = rng.integers(0, 4, s - len(row))  # past the length: never read
    lengths = np.array([len(r) for r in rows], np.int32)
    draft, count = jax.jit(ngram_draft, static_argnums=(2,))(history, lengths, k)
    for i, row in enumerate(rows):
        want, n = reference_draft(row, k)
        assert np.asarray(draft)[i].tolist() == want and int(count[i]) == n, (row, draft[i], count[i])
    assert np.asarray(draft)[0].tolist() == [8, 5, 6, 7]  # "5 6 7" came before, then "8 5 6 7"


def test_greedy_verification_keeps_the_argmax_prefix():
    probs = jnp.array([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]] * 3)  # [3, k + 1 = 3, V = 3]
    draft = jnp.array([[1, 0], [1, 2], [2, 0]])
    accepted, nxt = verify(probs, draft, jnp.array([2, 2, 2]), jnp.ones((3,), bool), jax.random.split(
        jax.random.PRNGKey(0), 3))
    assert accepted.tolist() == [2, 1, 0] and nxt.tolist() == [2, 0, 1]
    accepted, nxt = verify(probs[:1], draft[:1], jnp.array([1]), jnp.ones((1,), bool), jax.random.split(
        jax.random.PRNGKey(0), 1))
    assert accepted.tolist() == [1] and nxt.tolist() == [0]  # a one-token draft: then the argmax after it


def test_sampled_verification_keeps_the_target_distribution():
    """On a 4-token vocabulary with fixed targets for two positions: the first emitted token has
    distribution p0, and the second, given the first was the draft token, p1 (as without a draft)."""
    p = jnp.array([[0.1, 0.4, 0.3, 0.2], [0.25, 0.05, 0.5, 0.2], [0.7, 0.1, 0.1, 0.1]])
    n = 40000
    draft = jnp.tile(jnp.array([[1, 3]]), (n, 1))
    probs = jnp.tile(p[None], (n, 1, 1))
    accepted, nxt = jax.jit(verify)(probs, draft, jnp.full((n,), 2), jnp.zeros((n,), bool),
                                    jax.random.split(jax.random.PRNGKey(1), n))
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    first = np.where(accepted >= 1, 1, nxt)  # the first token out of each call
    np.testing.assert_allclose(np.bincount(first, minlength=4) / n, p[0], atol=0.01)
    took = accepted >= 1
    second = np.where(accepted[took] >= 2, 3, nxt[took])
    np.testing.assert_allclose(np.bincount(second, minlength=4) / took.sum(), p[1], atol=0.015)
    both = accepted == 2  # after a fully kept draft the third token comes from p2
    np.testing.assert_allclose(np.bincount(nxt[both], minlength=4) / both.sum(), p[2], atol=0.03)
    assert 0.3 < took.mean() < 0.5  # the draft's first token is kept with p0(1) = 0.4


def test_no_draft_samples_the_first_position():
    p = jnp.array([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    accepted, nxt = verify(p, jnp.array([[-1]]), jnp.array([0]), jnp.zeros((1,), bool),
                           jax.random.split(jax.random.PRNGKey(2), 1))
    assert accepted.tolist() == [0] and nxt.tolist() == [1]
