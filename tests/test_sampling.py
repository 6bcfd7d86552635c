import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from backends.cpu import CPU, build, ops
from backends.xla import argmax
from runner.sampling import SampleSettings, filter_logits, sample_token

ON_KERNELS = CPU(on=frozenset({"sampling_cut", "logits_summary"}))
# the top-k/top-p cut: by sorting (the XLA backend), and on the CPU backend's kernel where it builds
CUTS = [XLA(), pytest.param(ON_KERNELS, marks=pytest.mark.skipif(not build.available(), reason="no sampling kernel"))]


def settings(b, temperature=1.0, nucleus_p=1.0, top_k=0, logprobs=0):
    return jax.tree_util.tree_map(jnp.asarray, SampleSettings.host(b, temperature=temperature, nucleus_p=nucleus_p,
                                                                   top_k=top_k, logprobs=logprobs))


def keys(b, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), b)


def test_temperature_zero_is_exact_argmax_and_never_nan():
    logits = jnp.array([[1.0, 3.0, 2.0, 3.0 - 1e-6], [1e30, -1e30, 0.0, 5.0]])
    out = sample_token(logits, settings(2, temperature=0.0), keys(2))
    np.testing.assert_array_equal(np.asarray(out.token_id), [1, 0])
    assert np.isfinite(np.asarray(out.logprob)).all() and np.isfinite(np.asarray(out.top_k_probs)).all()


@pytest.mark.parametrize("backend", CUTS)
def test_top_k_and_top_p_keep_the_right_sets(backend):
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda **kw: np.isfinite(np.asarray(filter_logits(logits, settings(1, **kw), backend)))[0].tolist()  # noqa: E731
    assert kept() == [True] * 4
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(nucleus_p=0.5) == [True, False, False, False]  # 0.5 alone reaches p
    assert kept(nucleus_p=0.6) == [True, True, False, False]
    assert kept(nucleus_p=0.9) == [True, True, True, False]
    assert kept(nucleus_p=1e-6) == [True, False, False, False]
    assert kept(nucleus_p=0.9, top_k=2) == [True, True, False, False]


def test_sampling_follows_the_tempered_distribution():
    logits = jnp.log(jnp.array([0.6, 0.3, 0.1]))[None].repeat(4000, axis=0)
    out = sample_token(logits, settings(4000), keys(4000, seed=1))
    freq = np.bincount(np.asarray(out.token_id), minlength=3) / 4000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.03)
    hot = sample_token(logits, settings(4000, temperature=100.0), keys(4000, seed=2))
    np.testing.assert_allclose(np.bincount(np.asarray(hot.token_id), minlength=3) / 4000, [1 / 3] * 3, atol=0.03)


def test_reported_probabilities_are_the_models():
    logits = jnp.log(jnp.array([[0.1, 0.7, 0.2]]))
    out = sample_token(logits, settings(1, temperature=0.0), keys(1))
    assert int(out.token_id[0]) == 1
    np.testing.assert_allclose(float(out.logprob[0]), np.log(0.7), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.top_k_token_ids[0]), [1, 2, 0])
    np.testing.assert_allclose(np.asarray(out.top_k_probs[0]), [0.7, 0.2, 0.1], rtol=1e-5)


def test_huge_logits_are_stable():
    logits = jnp.array([[1e4, 1e4 - 1.0, -1e4]])
    out = sample_token(logits, settings(1, temperature=0.5, nucleus_p=0.9), keys(1))
    assert int(out.token_id[0]) in (0, 1) and np.isfinite(float(out.logprob[0]))


def test_argmax_matches_jnp_argmax_including_ties():
    x = jax.random.normal(jax.random.PRNGKey(3), (6, 300))
    x = x.at[1, 7].set(9.0).at[1, 200].set(9.0)  # a tie: the first index wins
    x = x.at[2].set(-jnp.inf).at[2, 5].set(0.0)  # everything filtered but one
    x = x.at[3].set(1.0)  # all equal
    np.testing.assert_array_equal(np.asarray(argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))


def test_draw_is_jax_random_categorical_and_a_mixed_batch_keeps_each_rows_rule():
    logits = jax.random.normal(jax.random.PRNGKey(4), (5, 50)) * 2
    k = keys(5, seed=9)
    want = jax.vmap(jax.random.categorical)(k, logits / 0.7)
    np.testing.assert_array_equal(np.asarray(sample_token(logits, settings(5, temperature=0.7), k).token_id),
                                  np.asarray(want))
    mixed = settings(5, temperature=0.7).replace(temperature=jnp.array([0.7, 0.0, 0.7, 0.0, 0.7]))
    got = np.asarray(sample_token(logits, mixed, k).token_id)
    np.testing.assert_array_equal(got[[0, 2, 4]], np.asarray(want)[[0, 2, 4]])
    np.testing.assert_array_equal(got[[1, 3]], np.asarray(jnp.argmax(logits, axis=-1))[[1, 3]])


@pytest.mark.parametrize("backend", CUTS)
def test_top_p_of_one_cuts_nothing(backend):
    """p = 1 is off: float32's running sum of the probabilities reaches 1 long before the tail."""
    logits = -jnp.array([[0.0] + list(range(20, 29))])  # all but the first have probability < 3e-9
    kept = np.isfinite(np.asarray(filter_logits(logits, settings(1, top_k=3), backend)))[0]
    assert kept.tolist() == [True] * 3 + [False] * 7
    assert np.isfinite(np.asarray(filter_logits(logits, settings(1, nucleus_p=1.0, top_k=0), backend))).all()


def _reference_threshold(x, k, p):
    """The sorted rule in float64: the smallest logit that top-k then top-p keep."""
    top = np.sort(x[~np.isnan(x)].astype(np.float64))[::-1]
    top = top[:k] if 0 < k < len(top) else top
    probs = np.exp(top - top[0])
    probs /= probs.sum()
    keep = (np.cumsum(probs) - probs < p) | (p >= 1)
    keep[0] = True
    return top[keep.sum() - 1]  # the kept tokens are a prefix of the sorted row


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
@pytest.mark.parametrize("v", [5, 16, 300, 32768])
def test_kernel_cut_equals_the_sorted_rule(v):
    rng = np.random.default_rng(v)
    b = 24
    x = rng.standard_normal((b, v)).astype(np.float32) * rng.choice([0.3, 3.0, 12.0], (b, 1)).astype(np.float32)
    x[::3] = np.round(x[::3])  # many ties, also at the k-th logit and at the cut
    x[1, : v // 2] = -np.inf
    x[2, 0] = np.nan  # never kept, never counted
    k = rng.integers(0, v + 2, b).astype(np.int32)
    k[::2] = 0
    k[3] = 1
    p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1, 1e-6], b).astype(np.float32)
    got = np.asarray(jax.jit(ops.filter_threshold)(x, k, p))
    for r in range(b):
        want = _reference_threshold(x[r], k[r], p[r])
        assert ((x[r] >= got[r]) == (x[r] >= want)).all(), (r, k[r], p[r], got[r], want)
    assert not np.isfinite(got).all() or (x >= got[:, None]).sum(1).min() >= 1


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
def test_kernel_cut_of_rows_without_a_finite_maximum():
    x = np.full((3, 40), -np.inf, np.float32)
    x[1, 7] = np.inf
    x[2, :] = np.nan
    got = np.asarray(ops.filter_threshold(x, np.array([2, 0, 0], np.int32), np.full(3, 0.5, np.float32)))
    assert got[0] == -np.inf and got[1] == np.inf and got[2] == -np.inf
    with pytest.raises(ValueError, match="do not match"):
        ops.filter_threshold(x, np.zeros(2, np.int32), np.ones(3, np.float32))


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
def test_kernel_and_sort_draw_the_same_tokens():
    logits = jax.random.normal(jax.random.PRNGKey(5), (16, 3000)) * 4
    s = settings(16, temperature=0.8, nucleus_p=0.9).replace(top_k=jnp.arange(16) * 7)
    k = keys(16, seed=11)
    sorted_draw, kernel_draw = (np.asarray(sample_token(logits, s, k, kernel).token_id) for kernel in (XLA(), ON_KERNELS))
    np.testing.assert_array_equal(kernel_draw, sorted_draw)


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
@pytest.mark.parametrize("v, top", [(3, 3), (17, 8), (300, 8), (32768, 8)])
def test_kernel_summary_equals_top_k_and_logsumexp(v, top):
    rng = np.random.default_rng(v)
    x = rng.standard_normal((6, v)).astype(np.float32) * 5
    x[1] = np.round(x[1])  # ties: lower ids first
    x[2, : v - 1] = -np.inf  # fewer numbers than the top asks for
    x[3] = 2.0  # all equal
    x[4, v // 2] = 80.0  # one dominant logit
    vals, ids, lse = jax.jit(ops.logits_summary, static_argnums=1)(x, top)
    want_vals, want_ids = jax.lax.top_k(x, top)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(vals, want_vals)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    np.testing.assert_array_equal(ids[:, 0], np.asarray(jnp.argmax(x, axis=-1)))


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
def test_kernel_summary_of_rows_without_a_finite_maximum():
    x = np.full((4, 20), -np.inf, np.float32)
    x[1, 3] = np.inf
    x[2, 5] = np.nan  # NaN ranks as -inf and makes the lse NaN
    x[3, :] = 1.0
    x[3, 0] = np.nan
    vals, ids, lse = ops.logits_summary(x, 4)
    assert np.asarray(ids)[0].tolist() == [0, 1, 2, 3] and np.asarray(lse)[0] == -np.inf
    assert np.asarray(ids)[1, 0] == 3 and np.asarray(lse)[1] == np.inf
    assert np.isnan(np.asarray(lse)[2]) and np.asarray(ids)[2].tolist() == [0, 1, 2, 3]
    assert np.asarray(ids)[3].tolist() == [1, 2, 3, 4] and np.isnan(np.asarray(lse)[3])
    with pytest.raises(ValueError, match="1 <= top <= V"):
        ops.logits_summary(x, 21)


@pytest.mark.skipif(not build.available(), reason="no sampling kernel")
def test_sample_token_on_the_kernels_reports_what_xla_does():
    logits = jax.random.normal(jax.random.PRNGKey(6), (8, 5000)) * 3
    s = settings(8, temperature=0.0).replace(temperature=jnp.array([0.0, 0.7] * 4), nucleus_p=jnp.full((8,), 0.9))
    k = keys(8, seed=12)
    xla, kern = (sample_token(logits, s, k, kernel) for kernel in (XLA(), ON_KERNELS))
    np.testing.assert_array_equal(kern.token_id, xla.token_id)
    np.testing.assert_array_equal(kern.top_k_token_ids, xla.top_k_token_ids)
    np.testing.assert_allclose(kern.logprob, xla.logprob, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kern.top_k_probs, xla.top_k_probs, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_call_without_logprobs_draws_the_same_tokens_and_reports_nothing(temperature):
    """No row asks for log-probabilities: the summary (normaliser, top tokens) is skipped, and
    the tokens are those of a call that computes it."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (6, 300)) * 3
    asked = sample_token(logits, settings(6, temperature=temperature, top_k=40), keys(6, 1))
    bare = sample_token(logits, settings(6, temperature=temperature, top_k=40, logprobs=-1), keys(6, 1))
    np.testing.assert_array_equal(np.asarray(bare.token_id), np.asarray(asked.token_id))
    assert not np.asarray(bare.top_k_probs).any() and np.asarray(asked.top_k_probs).all()
    want = jax.nn.log_softmax(logits)[jnp.arange(6), asked.token_id]
    np.testing.assert_allclose(np.asarray(asked.logprob), np.asarray(want), rtol=1e-5, atol=1e-5)
