import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from model import TINY, QuantizedWeight8bit, dequantize, forward, quantize


def test_quantize_error_is_within_half_a_scale():
    w = jax.random.normal(jax.random.PRNGKey(1), (3, 64, 40)) * jnp.linspace(0.1, 5.0, 40)
    for groups in (1, 4, 8):
        q = jitted_quantize(w, groups=groups)
        assert q.weight.dtype == jnp.int8 and q.scales.shape == (3, groups, 40)
        err = np.abs(np.asarray(jax.jit(dequantize, static_argnums=1)(q, jnp.float32)) - np.asarray(w))
        err = err.reshape(3, groups, 64 // groups, 40)
        scale = np.asarray(q.scales.astype(jnp.float32))[:, :, None, :]
        # int8 rounding: half a scale; a bf16 scale rounded down can clip by 2**-8 of the max
        bound = 0.5 * scale + 2.0**-8 * 127 * scale
        assert np.all(err <= bound)
        # and relative to each channel's range it is small
        assert float(err.max() / np.abs(np.asarray(w)).max()) < 1 / 127


def test_grouped_scales_apply_to_their_block_of_the_contracting_axis():
    weight = jnp.ones((4, 2), jnp.int8)
    scales = jnp.array([[1.0, 10.0], [2.0, 20.0]], jnp.bfloat16)  # G=2 groups over K=4
    w = dequantize(QuantizedWeight8bit(weight=weight, scales=scales), jnp.float32)
    np.testing.assert_array_equal(np.asarray(w), [[1, 10], [1, 10], [2, 20], [2, 20]])


def test_quantize_rejects_bad_groups():
    with pytest.raises(ValueError, match="groups"):
        quantize(jnp.ones((6, 4)), groups=4)


jitted_quantize = jax.jit(quantize, static_argnames="groups")  # one compile a shape, not one an eager op


def quantize_params(params, groups=1):
    """Every matrix of the model quantised (norms and embedding stay float, as in Grok-1)."""

    def maybe(path, leaf):
        name = path[-1].key
        return jitted_quantize(leaf, groups=groups) if name == "w" and leaf.ndim >= 2 else leaf

    return jax.tree_util.tree_map_with_path(maybe, params)


def test_int8_weights_are_accepted_wherever_float_weights_are(tiny_params):
    qparams = quantize_params(tiny_params, groups=2)
    deq = jax.tree_util.tree_map(
        lambda w: dequantize(w, jnp.float32) if isinstance(w, QuantizedWeight8bit) else w,
        qparams, is_leaf=lambda x: isinstance(x, QuantizedWeight8bit))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 4), 1, TINY.vocab_size)  # batch 3
    for backend in (XLA(grouped="ragged"), XLA(grouped="loop")):
        a = forward(qparams, tokens, TINY, backend=backend).logits
        b = forward(deq, tokens, TINY, backend=backend).logits
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
