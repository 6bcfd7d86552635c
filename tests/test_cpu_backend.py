"""The CPU backend (backends/cpu): its build, the panel layout, each kernel against XLA's op, its
errors, and when the runner takes it."""

import dataclasses
import mmap
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from backends.cpu import CPU, OPERATIONS, build, ops as panel
from backends.cpu.layout import ExpertWeights, Widened, prepare
from model import TINY, forward, init_params
from model.memory import new_memory
from model.quant import QuantizedWeight8bit, dequantize, quantize
from model.sharding import make_mesh, path_str
from runner import Executor, ModelRunner
from tests.helpers import first_layer
from tests.test_quant import quantize_params

needs_kernel = pytest.mark.skipif(not build.available(), reason=f"CPU kernels: {build.unavailable_reason()}")


def test_the_kernels_build_where_there_is_a_compiler():
    """Every kernel test below skips without the kernels; where a C++ compiler exists (CI has
    g++), a failed build must fail here instead of skipping them silently."""
    if build._compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    assert build.available(), build.unavailable_reason()


def test_a_failed_build_says_which_source_and_leaves_no_library(tmp_path):
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` command")
    reason = build._compile(false, tmp_path / "kernels.so")
    assert reason.startswith("building panel_matmul.cc") and "sampling.cc: exit status 1" in reason
    assert list(tmp_path.iterdir()) == []


def test_pack_round_trips_and_pads_with_zeros():
    w = np.arange(5 * 37, dtype=np.float32).reshape(5, 37)
    packed = panel.pack(w)
    assert packed.shape == (2, 5, panel.PANEL)
    assert np.array_equal(panel.unpack(packed, 37), w)
    assert not packed[1, :, 37 - panel.PANEL:].any()  # columns past N are zero
    stacked = panel.PanelWeight.of(np.stack([w, 2 * w, 3 * w]))  # experts: one pack each
    assert stacked.panels.shape == (3, 2, 5, panel.PANEL) and stacked.shape == (3, 5, 37)
    assert np.array_equal(stacked.panels[2], panel.pack(3 * w))


def test_large_packs_start_on_a_huge_page_boundary():
    w = np.random.default_rng(0).standard_normal((1024, 1000)).astype(np.float32)  # 4 MB packed
    packed = panel.pack(w)
    assert np.array_equal(panel.unpack(packed, 1000), w)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert packed.ctypes.data % (2 << 20) == 0


def _grouped_reference(x, w, sizes):
    out, start = np.zeros((x.shape[0], w.shape[-1]), np.float32), 0
    for e, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[e]
        start += size
    return out


@needs_kernel
@pytest.mark.parametrize("sizes", [[0, 0, 0, 0], [1, 0, 0, 1], [3, 0, 5, 1], [13, 9, 0, 21], [0, 40, 0, 0]])
@pytest.mark.parametrize("k, n", [(64, 96), (33, 37)])
def test_grouped_matmul_multiplies_each_group_by_its_expert(sizes, k, n):
    rows = sum(sizes) + 3  # rows past the last group come out zero
    key = jax.random.PRNGKey(sum(sizes) * 7 + n)
    x = np.asarray(jax.random.normal(key, (rows, k)))
    w = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (4, k, n)))
    grouped = jax.jit(panel.grouped_matmul, static_argnums=3)
    got = grouped(x, jnp.asarray(panel.pack(w)), jnp.array(sizes, jnp.int32), n)
    np.testing.assert_allclose(got, _grouped_reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the other rows of its group (batch invariance)
    if sizes[2] == 5:
        alone = grouped(x[3:4], jnp.asarray(panel.pack(w)), jnp.array([0, 0, 1, 0], jnp.int32), n)
        np.testing.assert_array_equal(got[3:4], alone)


def test_grouped_matmul_rejects_what_it_cannot_do():
    panels = jnp.zeros((4, 2, 16, panel.PANEL), jnp.float32)
    sizes = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="float32 only"):
        panel.grouped_matmul(jnp.zeros((3, 16), jnp.bfloat16), panels, sizes, 40)
    with pytest.raises(ValueError, match="does not match expert panels"):
        panel.grouped_matmul(jnp.zeros((3, 15), jnp.float32), panels, sizes, 40)
    with pytest.raises(ValueError, match="one entry per expert"):
        panel.grouped_matmul(jnp.zeros((3, 16), jnp.float32), panels, jnp.zeros((3,), jnp.int32), 40)
    with pytest.raises(ValueError, match="n=65 is not the width"):
        panel.grouped_matmul(jnp.zeros((3, 16), jnp.float32), panels, sizes, 65)


@needs_kernel
def test_grouped_matmul_fails_on_sizes_past_its_rows():
    panels = jnp.zeros((4, 2, 16, panel.PANEL), jnp.float32)
    with pytest.raises(Exception, match="sum to at most R"):
        panel.grouped_matmul(jnp.zeros((3, 16), jnp.float32), panels, jnp.array([2, 0, 2, 0], jnp.int32),
                             40).block_until_ready()


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


def _int8_weight(key, shape, groups):
    return quantize(jax.random.normal(key, shape), groups=groups, scale_dtype=jnp.bfloat16)


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 8, 9, 13, 40])
@pytest.mark.parametrize("k, n, groups", [(64, 96, 1), (64, 37, 4), (33, 5, 3), (96, 70, 8)])
def test_int8_panel_matmul_equals_the_product_by_the_dequantised_weight(rows, k, n, groups):
    key = jax.random.PRNGKey(rows * 100 + n)
    x = jax.random.normal(key, (rows, k))
    w = _int8_weight(jax.random.fold_in(key, 1), (k, n), groups)
    held = panel.Int8PanelWeight.of(w)
    assert held.panels.dtype == jnp.int8 and held.scales.shape == (-(-n // 32), groups, 32) and held.shape == (k, n)
    got = jax.jit(panel.int8_panel_matmul, static_argnums=3)(x, held.panels, held.scales, n)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(dequantize(w, jnp.float32)), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("sizes", [[0, 0, 0], [1, 0, 2], [13, 9, 0], [0, 40, 1]])
def test_grouped_int8_matmul_multiplies_each_group_by_its_int8_expert(sizes):
    k, n = 48, 70
    w = _int8_weight(jax.random.PRNGKey(0), (3, k, n), 2)
    x = jax.random.normal(jax.random.PRNGKey(1), (sum(sizes) + 2, k))  # 2 rows past the last group
    held = panel.Int8PanelWeight.of(w)
    got = panel.grouped_int8_matmul(x, held.panels, held.scales, jnp.asarray(sizes, jnp.int32), n)
    np.testing.assert_allclose(got, _grouped_reference(np.asarray(x), np.asarray(dequantize(w, jnp.float32)), sizes),
                               rtol=1e-5, atol=1e-5)


def test_int8_panel_matmul_rejects_what_it_cannot_do():
    panels, scales = jnp.zeros((2, 16, panel.PANEL), jnp.int8), jnp.ones((2, 4, panel.PANEL), jnp.float32)
    with pytest.raises(ValueError, match="int8 panels and float32 scales"):
        panel.int8_panel_matmul(jnp.zeros((1, 16)), panels.astype(jnp.float32), scales, 40)
    with pytest.raises(ValueError, match="do not match int8 panels"):
        panel.int8_panel_matmul(jnp.zeros((1, 16)), panels, jnp.ones((2, 3, panel.PANEL)), 40)  # 3 does not divide 16
    with pytest.raises(ValueError, match="n=65 is not the width"):
        panel.int8_panel_matmul(jnp.zeros((1, 16)), panels, scales, 65)


@needs_kernel
def test_int8_weights_run_on_the_int8_kernels_without_a_float_copy():
    """backend='cpu' with int8 experts and projections (Grok-1's grouped scales): the kernels read
    them as int8, and the logits are the dequantised model's up to float32 rounding."""
    params = quantize_params(init_params(TINY, jax.random.PRNGKey(0)), groups=2)
    engine = ModelRunner(model=TINY, params=params, backend="cpu")
    engine = Executor.create(engine)
    assert engine.selection.backend.int8 == {"moe", "projections"}
    assert "int8 weights read as int8: moe, projections" in engine.backend_report()
    layer = first_layer(engine.params)
    for w in (layer["moe"]["linear"]["w"], layer["moe"]["linear_1"]["w"], layer["multi_head_attention"]["query"]["w"]):
        assert isinstance(w, panel.Int8PanelWeight) and w.panels.dtype == jnp.int8
    floats = [a for a in jax.tree_util.tree_leaves(engine.params) if a.dtype == jnp.float32 and a.size >= 8 * 32 * 32]
    assert sum(a.size for a in floats) <= TINY.vocab_size * TINY.emb_size + 4 * TINY.num_layers * TINY.emb_size * 64
    deq = ModelRunner(model=TINY, params=jax.tree_util.tree_map(
        lambda w: dequantize(w, jnp.float32), params, is_leaf=lambda x: isinstance(x, QuantizedWeight8bit)),
        backend="xla")
    deq = Executor.create(deq)
    tokens, lengths = np.array([[5, 9, 13, 2, 7], [3, 4, 0, 0, 0]], np.int32), np.array([5, 2], np.int32)
    np.testing.assert_allclose(engine.forward(engine.params, tokens, lengths), deq.forward(deq.params, tokens, lengths),
                               atol=1e-4, rtol=1e-4)


@needs_kernel
def test_int8_weights_no_kernel_takes_are_dequantised_once():
    params = quantize_params(init_params(TINY, jax.random.PRNGKey(0)))
    held = CPU(on=frozenset({"moe"}), int8=frozenset({"moe"})).prepare(params)
    layer = first_layer(held)
    assert isinstance(layer["moe"]["linear"]["w"], panel.Int8PanelWeight)
    query = layer["multi_head_attention"]["query"]["w"]
    assert isinstance(query, jax.Array) and query.dtype == jnp.float32
    np.testing.assert_array_equal(query, dequantize(params["transformer"]["layers"]["multi_head_attention"]
                                                    ["query"]["w"], jnp.float32)[0])
    floats = CPU(on=frozenset({"moe"})).prepare(params)  # the kernel, on the float32 copy
    assert isinstance(first_layer(floats)["moe"]["linear"]["w"], panel.PanelWeight)
    with pytest.raises(ValueError, match="CPU\\(int8=...\\) must name operations of on"):
        CPU(on=frozenset({"moe"}), int8=frozenset({"projections"}))


@needs_kernel
def test_float_weights_quantised_at_load_run_as_int8():
    from model.quant import quantize_params as quantize_at_load

    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params, backend="cpu", quantize="int8")
    engine = Executor.create(engine)
    assert isinstance(_moe_weight(engine), panel.Int8PanelWeight)
    assert isinstance(_moe_weight_of(params), jax.Array)  # the caller's tree is untouched
    quantized = quantize_at_load(params)
    q = _moe_weight_of(quantized)
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (TINY.num_experts, 1, TINY.ffn_size)
    assert isinstance(quantized["transformer"]["layers"]["router"]["w"], jax.Array)  # the router stays float
    tokens, lengths = np.array([[5, 9, 13, 2, 7]], np.int32), np.array([5], np.int32)
    got = np.asarray(engine.forward(engine.params, tokens, lengths))
    deq = jax.tree_util.tree_map(lambda w: dequantize(w, jnp.float32), quantized,
                                 is_leaf=lambda x: isinstance(x, QuantizedWeight8bit))
    np.testing.assert_allclose(got, forward(deq, tokens, TINY, backend=XLA()).logits, atol=1e-4, rtol=1e-4)
    floats = np.asarray(forward(params, tokens, TINY, backend=XLA()).logits)
    assert 0 < np.abs(got - floats).max() < 0.05 * np.abs(floats).max()  # the int8 rounding, and only that
    with pytest.raises(ValueError, match="quantize must be one of \\(None, 'int8', 'w8a8'\\), got 'int4'"):
        Executor.create(ModelRunner(model=TINY, params=params, quantize="int4"))


def test_panel_matmul_rejects_what_it_cannot_do():
    panels = jnp.zeros((2, 16, panel.PANEL), jnp.float32)
    with pytest.raises(ValueError, match="float32 only"):
        panel.panel_matmul(jnp.zeros((1, 16), jnp.bfloat16), panels, 40)
    with pytest.raises(ValueError, match="does not match panels"):
        panel.panel_matmul(jnp.zeros((1, 15), jnp.float32), panels, 40)
    with pytest.raises(ValueError, match="n=65 is not the width"):
        panel.panel_matmul(jnp.zeros((1, 16), jnp.float32), panels, 65)


@needs_kernel
def test_embedding_and_attention_in_panels_give_the_same_logits_and_rows():
    config = dataclasses.replace(TINY, vocab_size=333)  # not a multiple of 32: a ragged last panel
    params = init_params(config, jax.random.PRNGKey(0))
    backend = CPU(on=frozenset({"projections", "unembed"}))
    packed = backend.prepare(params)
    table = packed["language_model"]["in_out_embed"]["embeddings"]
    query = first_layer(packed)["multi_head_attention"]["query"]["w"]
    assert isinstance(query, panel.PanelWeight) and query.shape == (config.emb_size, config.num_q_heads * config.key_size)
    assert isinstance(table, panel.PanelTable) and table.shape == (333, config.emb_size)
    ids = jnp.array([[0, 31, 32, 332], [5, 64, 300, 1]])
    np.testing.assert_array_equal(table.lookup(ids), params["language_model"]["in_out_embed"]["embeddings"][ids])
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 9), 1, 333))
    np.testing.assert_allclose(forward(packed, tokens, config, backend=backend).logits,
                               forward(params, tokens, config, backend=XLA()).logits, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_embedding_panels_of_the_wrong_vocabulary_are_rejected():
    backend = CPU(on=frozenset({"unembed"}))
    params = backend.prepare(init_params(TINY, jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="held as PanelTable of shape"):
        forward(params, np.ones((1, 3), np.int32), dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 32),
                backend=backend)


def test_the_canonical_parameters_are_left_as_they_are():
    """prepare makes new leaves: the canonical pytree (what checkpoints and sharding see) is unchanged."""
    params = init_params(TINY, jax.random.PRNGKey(0))
    before = jax.tree_util.tree_map(np.asarray, params)
    CPU().prepare(params)
    if build.available():
        CPU(on=frozenset(OPERATIONS)).prepare(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.asarray, params))


def _moe_weight(engine):
    return _moe_weight_of(engine.params)


@needs_kernel
def test_backend_cpu_holds_float32_weights_in_panels_on_one_cpu_device():
    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params, backend="cpu")
    engine = Executor.create(engine)
    assert engine.selection.backend == CPU(on=frozenset(OPERATIONS)), engine.backend_report()
    assert all(choice.kernel for choice in engine.selection.choices.values())
    assert engine.backend_report().startswith("backend: cpu (on the C++ kernels: moe, projections")
    w = _moe_weight(engine)
    assert isinstance(w, panel.PanelWeight) and w.width == TINY.ffn_size
    assert w.shape == (TINY.num_experts, TINY.emb_size, TINY.ffn_size)
    assert isinstance(engine.params["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)
    attention = first_layer(engine.params)["multi_head_attention"]
    assert all(isinstance(attention[name]["w"], panel.PanelWeight) for name in ("query", "key", "value", "linear"))


def test_backend_xla_keeps_the_canonical_parameters():
    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params, backend="xla")
    engine = Executor.create(engine)
    assert engine.selection.backend == XLA(grouped="loop")  # on CPU: ragged_dot would run every expert
    assert engine.backend_report() == ("backend: xla (the MoE's grouped matmul: a loop of dots per expert; layers scan) "
                                       "(backend='xla')")
    assert not isinstance(_moe_weight(engine), (ExpertWeights, panel.PanelWeight))


def test_auto_keeps_xla_ops_where_a_kernel_does_not_apply():
    params = init_params(TINY, jax.random.PRNGKey(0))
    wide = dataclasses.replace(TINY, key_size=160)
    heads = ModelRunner(model=wide, params=init_params(wide, jax.random.PRNGKey(0)), calibration_tokens=8,
                        backend="auto")
    heads = Executor.create(heads)
    assert "attention: XLA (it needs head sizes up to 128" in heads.backend_report()
    mesh = make_mesh((1, 2), jax.devices()[:2])
    sharded = ModelRunner(model=TINY, params=params, mesh=mesh, backend="auto")
    sharded = Executor.create(sharded)
    assert sharded.selection.backend == XLA(grouped="loop")
    assert "auto: the mesh has 2 cpu devices" in sharded.backend_report()
    assert not isinstance(_moe_weight(sharded), ExpertWeights)
    with pytest.raises(ValueError, match="backend='cpu' runs on one CPU device; the mesh has 2 cpu devices"):
        Executor.create(ModelRunner(model=TINY, params=params, mesh=mesh, backend="cpu"))
    # experts partly int8 are not packed: asking for every kernel is an error, not a no-op
    mixed = jax.tree_util.tree_map_with_path(
        lambda path, w: quantize(w) if "moe/linear/" in path_str(path) else w, params)
    with pytest.raises(ValueError, match="moe needs experts all float or all int8, and these are float32, int8"):
        Executor.create(ModelRunner(model=TINY, params=mixed, backend="cpu"))
    with pytest.raises(ValueError, match="backend must be one of"):
        Executor.create(ModelRunner(model=TINY, params=params, backend="gpu"))


def test_without_the_kernels_the_cpu_backend_keeps_xla_ops(monkeypatch):
    monkeypatch.setattr(build, "_build", lambda: "no C++ compiler found (test)")
    params = init_params(TINY, jax.random.PRNGKey(0))
    engine = ModelRunner(model=TINY, params=params, backend="auto")
    engine = Executor.create(engine)
    assert engine.selection.backend == CPU() and not engine.selection.backend.kv_in_place
    assert isinstance(_moe_weight(engine), ExpertWeights)
    assert "moe: XLA (it needs no C++ compiler found (test))" in engine.backend_report()
    with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
        Executor.create(ModelRunner(model=TINY, params=params, backend="cpu"))


def test_prepare_without_kernels_splits_experts_and_packs_nothing():
    params = init_params(TINY, jax.random.PRNGKey(0))
    split = prepare(params, frozenset())
    assert isinstance(_moe_weight_of(split), ExpertWeights)
    down = first_layer(split)["moe"]["linear_1"]["w"]
    assert down.transposed and down.shape == (TINY.num_experts, TINY.ffn_size, TINY.emb_size)
    assert not isinstance(split["language_model"]["in_out_embed"]["embeddings"], panel.PanelTable)


def _moe_weight_of(params):
    """Layer 0's first MoE weight: of the CPU backend's layout (each layer apart), or canonical (stacked)."""
    return first_layer(params)["moe"]["linear"]["w"]


def _attention_reference(q, k, v, mask, scale, cap):
    b, n, h = q.shape
    kv = k.shape[1]
    s = mask.shape[1]
    logits = np.einsum("bkgh,bksh->bkgs", q.reshape(b, kv, n // kv, h), k[:, :, :s]) * scale
    logits = np.where(mask[:, None, None], cap * np.tanh(logits / cap), -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", weights, v[:, :, :s]).reshape(b, n, h)


@needs_kernel
@pytest.mark.parametrize("b, n, kv, h, s_max, s", [(3, 8, 2, 64, 40, 33), (2, 4, 4, 24, 20, 20), (1, 6, 1, 128, 300, 257),
                                                   (2, 4, 2, 7, 9, 9)])
def test_decode_attention_equals_the_softmax_over_allowed_keys(b, n, kv, h, s_max, s):
    rng = np.random.default_rng(s)
    q = rng.standard_normal((b, n, h)).astype(np.float32) * 20  # large logits: the soft-cap matters
    k, v = (rng.standard_normal((b, kv, s_max, h)).astype(np.float32) for _ in range(2))
    mask = rng.random((b, s)) < 0.7  # holes, not only a prefix
    mask[:, 0] = True
    got = jax.jit(panel.decode_attention, static_argnums=(4, 5))(q, k, v, mask, 0.125, 30.0)
    np.testing.assert_allclose(got, _attention_reference(q, k, v, mask, 0.125, 30.0), rtol=1e-5, atol=1e-5)
    # positions past S are never read: garbage there changes nothing
    k[:, :, s:], v[:, :, s:] = np.nan, np.nan
    np.testing.assert_array_equal(panel.decode_attention(q, k, v, mask, 0.125, 30.0), got)
    mask[0] = False  # a row with no key allowed gets zeros
    assert not np.asarray(panel.decode_attention(q, k, v, mask, 0.125, 30.0))[0].any()


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_decode_attention_reads_one_layer_of_the_stack_in_place(kind):
    """Handed every layer's cache ``[L, B, K, S_max, H]`` and a layer (traced, as the scan's index
    is), the kernels read exactly that layer: what they give for the layer's own array. A layer
    past the stack is an error, never a read out of bounds."""
    from model import quantize_kv

    rng = np.random.default_rng(3)
    layers, b, n, kv, h, s_max = 3, 2, 8, 2, 64, 24
    q = jnp.asarray(rng.standard_normal((b, n, h)) * 5, jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((layers, b, kv, s_max, h)), jnp.float32) for _ in range(2))
    if kind == "int8":
        k, v, attend_ = quantize_kv(k), quantize_kv(v), panel.decode_attention_int8
    else:
        k, v, attend_ = k.astype(kind), v.astype(kind), panel.decode_attention
    mask = jnp.asarray(rng.random((b, 20)) < 0.8).at[:, 0].set(True)
    read = jax.jit(lambda k, v, layer: attend_(q, k, v, mask, 0.125, 30.0, layer=layer))
    for layer in range(layers):
        alone = jax.tree_util.tree_map(lambda a: a[layer], (k, v))
        want = attend_(q, *alone, mask, 0.125, 30.0)
        np.testing.assert_array_equal(read(k, v, jnp.int32(layer)), want)
        assert np.abs(np.asarray(want) - np.asarray(attend_(q, *jax.tree_util.tree_map(
            lambda a: a[(layer + 1) % layers], (k, v)), mask, 0.125, 30.0))).max() > 1e-3  # the layers differ
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(read(k, v, jnp.int32(layers)))


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_panel_product_reads_one_layer_of_the_stack_in_place(kind):
    """Handed every layer's weight (``[L, ...]`` panels) and a traced layer index, the plain and
    the grouped products equal those by that layer's own panels, and inside a loop over the
    layers the compiled program never copies a layer's panels out of the stack (XLA:CPU copies
    the slice that an operation reads, which made a scanned decode step 5x slower)."""
    rng = np.random.default_rng(5)
    layers, experts, k, n = 3, 4, 48, 40
    w = rng.standard_normal((layers, experts, k, n)).astype(np.float32)
    if kind == "int8":
        held = panel.Int8PanelWeight.of(quantize(jnp.asarray(w)))
        plain = lambda x, h, layer=None: panel.int8_panel_matmul(x, h.panels, h.scales, n, layer=layer)
        grouped = lambda x, h, sizes, layer=None: panel.grouped_int8_matmul(x, h.panels, h.scales, sizes, n, layer=layer)
    else:
        held = (panel.PanelWeight if kind == "float32" else panel.Bf16PanelWeight).of(w)
        plain_of = panel.panel_matmul if kind == "float32" else panel.bf16_panel_matmul
        grouped_of = panel.grouped_matmul if kind == "float32" else panel.grouped_bf16_matmul
        plain = lambda x, h, layer=None: plain_of(x, h.panels, n, layer=layer)
        grouped = lambda x, h, sizes, layer=None: grouped_of(x, h.panels, sizes, n, layer=layer)
    take = lambda h, *index: jax.tree_util.tree_map(lambda a: a[index], h)
    x = jnp.asarray(rng.standard_normal((2, 5, k)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((7, k)), jnp.float32)
    sizes = jnp.array([3, 0, 4, 0], jnp.int32)
    plain_in = jax.jit(lambda x, h, layer: plain(x, h, layer))
    grouped_in = jax.jit(lambda x, h, layer: grouped(x, h, sizes, layer))
    for layer in range(layers):
        expert_0 = jax.tree_util.tree_map(lambda a: a[:, 0], held)  # a plain weight a layer: [L, ...]
        np.testing.assert_array_equal(plain_in(x, expert_0, jnp.int32(layer)), plain(x, take(held, layer, 0)))
        np.testing.assert_array_equal(grouped_in(rows, held, jnp.int32(layer)), grouped(rows, take(held, layer), sizes))
    assert np.abs(np.asarray(plain(x, take(held, 0, 0)) - plain(x, take(held, 1, 0)))).max() > 1e-2  # layers differ

    def loop(rows, held):
        body = lambda h, layer: (h * jnp.tanh(grouped(h, held, sizes, layer)).mean(-1, keepdims=True), None)
        return jax.lax.scan(body, rows, jnp.arange(layers, dtype=jnp.int32))[0]

    one_layer = tuple(held.panels.shape[1:])
    hlo = jax.jit(loop).lower(rows, held).compile().as_text()
    copied = [line for line in hlo.splitlines() if "custom-call" not in line and "parameter(" not in line
              and f"[{','.join(map(str, one_layer))}]" in line]
    assert not copied, copied


@needs_kernel
def test_the_cpu_backend_loops_over_the_layer_index_where_the_moe_kernel_holds_the_experts():
    """With the MoE kernel the stack is one compiled loop over the layer index ("indexed"), the
    weights held stacked in panels; without it, each layer is unrolled over its own buffers (a
    loop would copy each layer's experts out on every step); the choice is in the backend's line."""
    assert CPU(on=frozenset({"moe"})).layers == "indexed" and CPU().layers == "unrolled"
    assert "layers indexed" in CPU(on=frozenset(OPERATIONS)).describe()
    with pytest.raises(ValueError, match="needs 'moe'"):
        CPU(on=frozenset({"attention"}), layers="indexed")
    params = init_params(TINY, jax.random.PRNGKey(0))
    held = CPU(on=frozenset({"moe", "projections"})).prepare(params)
    stack = held["transformer"]["layers"]
    assert isinstance(stack["moe"]["linear"]["w"], panel.PanelWeight)
    assert stack["moe"]["linear"]["w"].shape == (TINY.num_layers, TINY.num_experts, TINY.emb_size, TINY.ffn_size)
    assert isinstance(stack["multi_head_attention"]["query"]["w"], panel.PanelWeight)
    widened = CPU(on=frozenset({"moe"}), dtype="bfloat16").prepare(params)["transformer"]["layers"]
    query = widened["multi_head_attention"]["query"]["w"]  # on XLA's dot: float32 holding the bf16 values
    assert isinstance(query, Widened) and query.w.dtype == jnp.float32
    np.testing.assert_array_equal(query.w, params["transformer"]["layers"]["multi_head_attention"]["query"]["w"]
                                  .astype(jnp.bfloat16).astype(jnp.float32))


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_indexed_stack_gives_the_unrolled_stacks_logits(dtype):
    """The same model, kernels and weights, the layers looped over their index or unrolled: the
    same logits up to the rounding of a different program (bf16: within 2 bf16 steps)."""
    config = dataclasses.replace(TINY, fprop_dtype=dtype)
    params = init_params(config, jax.random.PRNGKey(2))
    tokens = jnp.array([[3, 5, 7, 9], [2, 4, 6, 0]], jnp.int32)
    logits = {}
    for layers in ("indexed", "unrolled"):
        backend = CPU(on=frozenset({"moe", "attention"}), dtype=dtype, layers=layers)
        held = backend.prepare(params)
        first = forward(held, tokens, config, memory=new_memory(config, 2), lengths=jnp.array([4, 3]), backend=backend)
        step = forward(held, jnp.array([[11], [12]]), config, memory=first.memory, backend=backend)
        logits[layers] = np.concatenate([np.asarray(first.logits, np.float32).reshape(-1),
                                         np.asarray(step.logits, np.float32).reshape(-1)])
    scale = np.abs(logits["unrolled"]).max()
    tolerance = 1e-5 * scale if dtype == "float32" else 2 * 2.0 ** (np.floor(np.log2(scale)) - 7)
    assert np.abs(logits["indexed"] - logits["unrolled"]).max() <= tolerance


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_cache_write_equals_the_scatter_and_is_in_place(kind):
    """The backend's cache write (``ops.kv_write``, the stack aliased to the result) writes what
    ``model.memory.write_kv`` writes, bit for bit: the layer's rows at their positions, a position
    past the cache dropped, every other layer untouched; a donated stack is written
    where it lies. A layer past the stack is an error."""
    from model.memory import quantize_kv, write_kv

    rng = np.random.default_rng(5)
    layers, b, kv, s_max, h, t = 3, 4, 2, 16, 8, 3
    stack = jnp.asarray(rng.standard_normal((layers, b, kv, s_max, h)), jnp.float32)
    stack = quantize_kv(stack) if kind == "int8" else stack.astype(kind)
    new = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
    rows = jnp.asarray([[0] * t, [2] * t, [3] * t, [1] * t], jnp.int32)
    positions = jnp.asarray([[0, 1, 2], [13, 14, 15], [14, 15, 16], [4, 5, 99]], jnp.int32)  # some past the cache: dropped
    # in place with the attention kernel, and without it where asked (runner.selection asks
    # wherever the kernels are built: the write is never slower than XLA's scatter)
    assert CPU(on=frozenset({"attention"})).kv_in_place and not CPU(on=frozenset({"moe"})).kv_in_place
    backend = CPU(on=frozenset({"moe"}), kv_in_place=True)
    assert "KV cache written and read in place" in backend.describe()
    for layer in range(layers):
        want = write_kv(stack, layer, rows, positions, new)
        got = jax.jit(backend.write_kv)(stack, jnp.int32(layer), rows, positions, new)
        for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g.view(np.uint16) if g.dtype == jnp.bfloat16 else g),
                                          np.asarray(w.view(np.uint16) if w.dtype == jnp.bfloat16 else w))
        assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(got)[0]),
                                  np.asarray(jax.tree_util.tree_leaves(stack)[0]))  # something was written

    donated = jax.tree_util.tree_map(jnp.copy, stack)
    where = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(donated)]
    written = jax.jit(backend.write_kv, donate_argnums=0)(donated, jnp.int32(1), rows, positions, new)
    assert [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(written)] == where
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(backend.write_kv)(stack, jnp.int32(layers), rows, positions, new))


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_block_of_keys_read_in_place_equals_xlas_slice(kind):
    """The backend's read of a block of cache rows (``ops.kv_read``, a prefill's attention reading
    the stack in place) gives what XLA's slice and gather give, bit for bit: any layer (a traced
    index), rows in any order and repeated, a start clamped as ``dynamic_slice`` clamps it; a
    stack of one layer's cache without the layer too. A layer past the stack is an error."""
    from backends import XLA
    from model.memory import quantize_kv

    rng = np.random.default_rng(7)
    layers, b, kv, s_max, h = 3, 4, 2, 24, 8
    stack = jnp.asarray(rng.standard_normal((layers, b, kv, s_max, h)), jnp.float32)
    stack = quantize_kv(stack) if kind == "int8" else stack.astype(kind)
    backend = CPU(on=frozenset({"moe"}), kv_in_place=True)
    assert "KV cache written and read in place" in backend.describe()
    bits = lambda a: np.asarray(a.view(np.uint16) if a.dtype == jnp.bfloat16 else a)  # noqa: E731
    dtype = jnp.float32 if kind == "int8" else jnp.dtype(kind)
    for rows, start, size in (([2, 0, 3], 8, 8), ([1, 1], 0, 24), ([3], 20, 8), ([0, 2], 4, 4)):
        rows = jnp.asarray(rows, jnp.int32)
        for layer in range(layers):
            read = lambda cache, layer, be: be.kv_block(cache, layer, rows, start, size, dtype)  # noqa: E731
            want = jax.jit(read, static_argnums=2)(stack, jnp.int32(layer), XLA())
            got = jax.jit(read, static_argnums=2)(stack, jnp.int32(layer), backend)
            assert got.shape == want.shape == (len(rows), kv, size, h) and got.dtype == want.dtype
            np.testing.assert_array_equal(bits(got), bits(want))
        one = jax.tree_util.tree_map(lambda a: a[1], stack)
        want = XLA().kv_block(one, None, rows, start, size, dtype)
        np.testing.assert_array_equal(bits(backend.kv_block(one, None, rows, start, size, dtype)), bits(want))
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(jax.jit(backend.kv_block, static_argnums=(4, 5))(
            stack, jnp.int32(layers), jnp.asarray([0], jnp.int32), 0, 8, dtype))


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_blocks_copied_between_the_slots_and_the_pool_in_place_equal_xlas_copy(kind):
    """The backend's block copy (``ops.kv_copy_blocks``: the prefix pool read into slots, slots
    saved into it) copies what XLA's loop copies, bit for bit, both ways, only the valid blocks,
    every layer; a donated destination is written where it lies."""
    from backends import XLA
    from model.memory import quantize_kv

    rng = np.random.default_rng(9)
    layers, slots, kv, s_max, h, blocks, size = 3, 4, 2, 32, 8, 6, 8
    make = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    cast = (lambda a: quantize_kv(a)) if kind == "int8" else (lambda a: a.astype(kind))  # noqa: E731
    stack = (cast(make(layers, slots, kv, s_max, h)), cast(make(layers, slots, kv, s_max, h)))
    pool = (cast(make(layers, blocks, kv, size, h)), cast(make(layers, blocks, kv, size, h)))
    backend = CPU(on=frozenset({"moe"}), kv_in_place=True)
    valid = jnp.asarray([[True, True, False, False], [False, True, True, False], [False, False, False, False]])
    slot_PJ = jnp.broadcast_to(jnp.asarray([[2], [0], [3]], jnp.int32), valid.shape)
    pos_PJ = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32) * size, valid.shape)
    block_PJ = jnp.asarray([[4, 1, 0, 0], [5, 3, 2, 0], [0, 0, 0, 0]], jnp.int32)
    zero_PJ = jnp.zeros_like(block_PJ)
    copies = {"into slots": lambda be, d, s: be.copy_blocks(d, s, valid, slot_PJ, pos_PJ, block_PJ, zero_PJ, size),
              "into the pool": lambda be, d, s: be.copy_blocks(d, s, valid, block_PJ, zero_PJ, slot_PJ, pos_PJ, size)}
    for what, (dst, src) in (("into slots", (stack, pool)), ("into the pool", (pool, stack))):
        copy = copies[what]
        want = jax.jit(copy, static_argnums=0)(XLA(), dst, src)
        got = jax.jit(copy, static_argnums=0)(backend, dst, src)
        for w, g, d in zip(*(jax.tree_util.tree_leaves(x) for x in (want, got, dst))):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(np.asarray(g.view(np.uint16) if g.dtype == jnp.bfloat16 else g),
                                          np.asarray(w.view(np.uint16) if w.dtype == jnp.bfloat16 else w), what)
            assert not np.array_equal(np.asarray(w), np.asarray(d))  # something was copied
        donated = jax.tree_util.tree_map(jnp.copy, dst)
        where = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(donated)]
        written = jax.jit(copy, static_argnums=0, donate_argnums=1)(backend, donated, src)
        assert [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(written)] == where


@needs_kernel
@pytest.mark.parametrize("b, n, kv, h, s_max, s", [(3, 8, 2, 64, 40, 33), (1, 6, 1, 128, 300, 257), (2, 4, 2, 7, 9, 9)])
def test_decode_attention_reads_an_int8_cache_as_its_dequantised_values(b, n, kv, h, s_max, s):
    """The int8 kernel applies each key's scale to its logit and each value's to its weight: the
    attention over the dequantised cache, as XLA's op computes it from the same record."""
    from backends.xla import attend
    from model import quantize_kv

    rng = np.random.default_rng(s)
    q = rng.standard_normal((b, n, h)).astype(np.float32) * 20
    k, v = (quantize_kv(jnp.asarray(rng.standard_normal((b, kv, s_max, h)) * rng.uniform(0.1, 3, (b, kv, s_max, 1)),
                                    jnp.float32)) for _ in range(2))
    k = k.replace(scales=k.scales.at[0, 0, 1].set(0.0))  # an all-zero key: scale 0
    mask = rng.random((b, s)) < 0.7
    mask[:, 0] = True
    got = jax.jit(panel.decode_attention_int8, static_argnums=(4, 5))(q, k, v, mask, 0.125, 30.0)
    want = _attention_reference(q, np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)), mask, 0.125, 30.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    xla = attend(jnp.asarray(q)[:, None], k, v, jnp.asarray(mask)[:, None], 0.125, 30.0)[:, 0]
    np.testing.assert_allclose(xla, want, rtol=1e-5, atol=1e-5)
    # positions past S are never read
    poisoned = [x.replace(scales=x.scales.at[:, :, s:].set(np.nan)) for x in (k, v)]
    np.testing.assert_array_equal(panel.decode_attention_int8(q, *poisoned, mask, 0.125, 30.0), got)
    with pytest.raises(ValueError, match="int8 values with float32 scales"):
        panel.decode_attention_int8(q, k.replace(values=k.values.astype(jnp.int32)), v, mask, 1.0, 30.0)
    with pytest.raises(ValueError, match="do not match"):
        panel.decode_attention_int8(q, k.replace(scales=k.scales[..., 0]), v, mask, 1.0, 30.0)


@needs_kernel
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
def test_decode_attention_takes_each_rows_temperature(cache):
    """Grok-2's attention temperature: row b's capped logits times t[b], on every cache kind, as
    XLA's op computes it; t = 1 is the plain kernel exactly."""
    from backends.xla import attend
    from model import quantize_kv

    b, n, kv, h, s_max, s = 3, 8, 2, 64, 40, 33
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, n, h)).astype(np.float32) * 20
    k, v = (jnp.asarray(rng.standard_normal((b, kv, s_max, h)), jnp.float32) for _ in range(2))
    if cache == "int8":
        k, v = quantize_kv(k), quantize_kv(v)
        kernel = panel.decode_attention_int8
    else:
        k, v = k.astype(cache), v.astype(cache)
        kernel = panel.decode_attention
    mask = rng.random((b, s)) < 0.7
    mask[:, 0] = True
    t = np.array([1.0, 1.37, 2.2], np.float32)
    got = jax.jit(kernel, static_argnums=(4, 5))(q, k, v, mask, 0.125, 30.0, t)
    q_in = jnp.asarray(q)[:, None]
    want = attend(q_in.astype(jnp.float32), k, v, jnp.asarray(mask)[:, None], 0.125, 30.0, jnp.asarray(t)[:, None])[:, 0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    plain = kernel(q, k, v, mask, 0.125, 30.0)
    np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(plain)[0])
    assert np.abs(np.asarray(got)[2] - np.asarray(plain)[2]).max() > 1e-3
    with pytest.raises(ValueError, match="temperature must be"):
        kernel(q, k, v, mask, 0.125, 30.0, t[:2])


def test_decode_attention_rejects_what_it_cannot_do():
    q, k, mask = jnp.zeros((2, 8, 64)), jnp.zeros((2, 2, 16, 64)), jnp.ones((2, 16), bool)
    with pytest.raises(ValueError, match="float32 queries and float32 or bf16 caches"):
        panel.decode_attention(q.astype(jnp.bfloat16), k, k, mask, 1.0, 30.0)
    with pytest.raises(ValueError, match="float32 queries and float32 or bf16 caches"):
        panel.decode_attention(q, k, k.astype(jnp.bfloat16), mask, 1.0, 30.0)
    with pytest.raises(ValueError, match="do not match"):
        panel.decode_attention(q, k, k, jnp.ones((2, 17), bool), 1.0, 30.0)
    with pytest.raises(ValueError, match="do not match"):
        panel.decode_attention(jnp.zeros((2, 7, 64)), k, k, mask, 1.0, 30.0)
    with pytest.raises(ValueError, match="head sizes up to 128"):
        panel.decode_attention(jnp.zeros((2, 8, 144)), jnp.zeros((2, 2, 16, 144)), jnp.zeros((2, 2, 16, 144)), mask,
                               1.0, 30.0)


@needs_kernel
def test_decode_on_the_attention_kernel_compiles_one_kv_length():
    """The decode kernel reads each row's live positions alone, so a runner on it compiles one
    decode variant over the whole cache, where XLA's attention keeps one a KV bucket; a
    speculative runner (its verify steps attend through XLA) keeps the buckets too. Its tokens are
    XLA's."""
    from runner import InferenceRunner, Request
    from runner.runner import default_kv_buckets

    config = dataclasses.replace(TINY, sequence_len=300)  # KV buckets 64, 256, 300
    params = init_params(config, jax.random.PRNGKey(0))

    def started(backend, **fields):
        return InferenceRunner(runner=ModelRunner(model=config, params=params, backend=backend), batch_size=2,
                               **fields).initialize(warmup=False)

    kernel, xla = started("cpu"), started("xla")
    assert "attention" in kernel.engine.executor.selection.backend.on
    assert [kv for kv, *_ in kernel.engine.variants(False)[1]] == [config.sequence_len]
    buckets = default_kv_buckets(config.sequence_len)
    assert len(buckets) > 1 and [kv for kv, *_ in xla.engine.variants(False)[1]] == list(buckets)
    assert {kv for kv, *_ in started("cpu", speculative=2).engine.variants(False)[1]} == set(buckets)
    requests = [Request(prompt=[5, 9, 13, 2] * (i + 1), max_len=70, temperature=0.0, ignore_eos=True,
                        request_id=f"r{i}") for i in range(2)]
    assert [c.token_ids for c in kernel.generate(requests)] == [c.token_ids for c in xla.generate(requests)]
