"""The panel kernel (model/panel.py): packing, the product against XLA's, its errors, and when the
runner uses it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import TINY, forward, init_params, panel
from model.experts import ExpertWeights
from model.sharding import make_mesh
from runner import ModelRunner

needs_kernel = pytest.mark.skipif(not panel.available(), reason=f"panel kernel: {panel.unavailable_reason()}")


def test_pack_round_trips_and_pads_with_zeros():
    w = np.arange(5 * 37, dtype=np.float32).reshape(5, 37)
    packed = panel.pack(w)
    assert packed.shape == (2, 5, panel.PANEL)
    assert np.array_equal(panel.unpack(packed, 37), w)
    assert not packed[1, :, 37 - panel.PANEL:].any()  # columns past N are zero


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 13, 40])
@pytest.mark.parametrize("k, n", [(64, 96), (33, 37), (7, 5)])
def test_panel_matmul_equals_xla(rows, k, n):
    key = jax.random.PRNGKey(rows * 100 + n)
    x = jax.random.normal(key, (rows, k))
    w = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (k, n)))
    got = jax.jit(panel.panel_matmul, static_argnums=2)(x, jnp.asarray(panel.pack(w)), n)
    np.testing.assert_allclose(got, np.asarray(x) @ w, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_panel_matmul_keeps_leading_dimensions():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 16))
    w = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (16, 40)))
    got = panel.panel_matmul(x, jnp.asarray(panel.pack(w)), 40)
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(got, np.asarray(x) @ w, rtol=1e-5, atol=1e-5)


def test_panel_matmul_rejects_what_it_cannot_do():
    panels = jnp.zeros((2, 16, panel.PANEL), jnp.float32)
    with pytest.raises(ValueError, match="float32 only"):
        panel.panel_matmul(jnp.zeros((1, 16), jnp.bfloat16), panels, 40)
    with pytest.raises(ValueError, match="does not match panels"):
        panel.panel_matmul(jnp.zeros((1, 15), jnp.float32), panels, 40)
    with pytest.raises(ValueError, match="n=65 is not the width"):
        panel.panel_matmul(jnp.zeros((1, 16), jnp.float32), panels, 65)


@needs_kernel
def test_embedding_in_panels_gives_the_same_logits_and_rows():
    config = dataclasses.replace(TINY, vocab_size=333)  # not a multiple of 32: a ragged last panel
    params = init_params(config, jax.random.PRNGKey(0))
    packed = panel.pack_embedding(params)
    table = packed["language_model"]["in_out_embed"]["embeddings"]
    assert isinstance(table, panel.PanelTable) and table.shape == (333, config.emb_size)
    ids = jnp.array([[0, 31, 32, 332], [5, 64, 300, 1]])
    np.testing.assert_array_equal(table.lookup(ids), params["language_model"]["in_out_embed"]["embeddings"][ids])
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 9), 1, 333))
    np.testing.assert_allclose(forward(packed, tokens, config).logits, forward(params, tokens, config).logits,
                               atol=1e-4, rtol=1e-4)


@needs_kernel
def test_embedding_panels_of_the_wrong_vocabulary_are_rejected():
    params = panel.pack_embedding(init_params(TINY, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="panels hold a"):
        forward(params, np.ones((1, 3), np.int32), dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 32))


def _moe_weight(engine):
    return engine.params["transformer"]["decoder_layer_0"]["moe"]["linear"]["w"]


@needs_kernel
def test_runner_holds_float32_experts_in_panels_on_one_cpu_device():
    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params)
    engine.initialize()
    w = _moe_weight(engine)
    assert isinstance(w, ExpertWeights) and w.width == TINY.ffn_size
    assert w.shape == (TINY.num_experts, TINY.emb_size, TINY.ffn_size)
    assert isinstance(engine.params["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)


def test_runner_keeps_xla_dots_where_the_kernel_does_not_apply():
    params = init_params(TINY, jax.random.PRNGKey(0))
    off = ModelRunner(model=TINY, params=params, expert_panels=False)
    off.initialize()
    assert _moe_weight(off).width is None
    bf16 = ModelRunner(model=dataclasses.replace(TINY, fprop_dtype="bfloat16"), params=params)
    bf16.initialize()
    assert _moe_weight(bf16).width is None
    mesh = make_mesh((1, 2), jax.devices()[:2])
    sharded = ModelRunner(model=TINY, params=params, mesh=mesh)
    sharded.initialize()
    assert _moe_weight(sharded).width is None
    assert not isinstance(sharded.params["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)
    with pytest.raises(ValueError, match="one CPU device"):
        ModelRunner(model=TINY, params=params, mesh=mesh, expert_panels=True).initialize()
    with pytest.raises(ValueError, match="needs the experts split"):
        ModelRunner(model=TINY, params=params, split_experts=False, expert_panels=True).initialize()


def test_without_the_kernel_the_runner_keeps_xla_dots(monkeypatch):
    monkeypatch.setattr(panel, "_build", lambda: "no C++ compiler found (test)")
    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params)
    engine.initialize()
    assert _moe_weight(engine).width is None
    assert not isinstance(engine.params["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)
    with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
        ModelRunner(model=TINY, params=params, expert_panels=True).initialize()
