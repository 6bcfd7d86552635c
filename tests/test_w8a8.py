"""The w8a8 mode (``--quantize w8a8``): int8 weights multiplied by activations rounded to int8 per
block of 32 (llama.cpp's q8_0 dot) on the CPU kernels: the kernels against their reference, a row's
result independent of its neighbours, the layout and the backend's choice, and a runner in the
mode (cached decode equals its full forward; its error against Grok-1's exact int8 product)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from backends.cpu import CPU, build, ops as panel
from backends.cpu.calibration import Measurement, decide_w8a8
from model import TINY, forward, init_params
from model.quant import dequantize, quantize
from runner import InferenceRunner, ModelRunner, Request
from tests.helpers import first_layer

needs_kernel = pytest.mark.skipif(not build.available(), reason=f"CPU kernels: {build.unavailable_reason()}")


def _weight(rng, k, n, groups):
    return quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), groups=groups, scale_dtype=jnp.bfloat16)


def test_the_reference_rounds_each_block_of_a_row_to_int8():
    """``w8a8_reference`` on a case worked by hand: a block's scale is its largest magnitude / 127,
    its values rounded to nearest even, a zero block contributes nothing."""
    x = np.zeros((1, 64), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 1.5  # scale 1: 0.5 -> 0, 1.5 -> 2 (to even)
    weight = np.ones((64, 2), np.int8)
    weight[:, 1] = -1
    scales = np.array([[0.5, 2.0]], np.float32)
    got = panel.w8a8_reference(x, weight, scales)
    np.testing.assert_array_equal(got, [[(127 + 0 + 2) * 0.5, -(127 + 0 + 2) * 2.0]])


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("k, n, groups", [(64, 96, 1), (100, 37, 1), (256, 70, 4), (33, 5, 1)])
def test_w8a8_panel_matmul_equals_its_reference_and_a_row_does_not_depend_on_the_others(rows, k, n, groups):
    rng = np.random.default_rng(rows * 1000 + k)
    w = _weight(rng, k, n, groups)
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.1, 10, (rows, 1)).astype(np.float32)
    if rows:
        x[0, : min(k, 32)] = 0  # a zero block: scale 0
    held = panel.W8A8PanelWeight.of(w)
    kp = -(-k // 32) * 32
    assert held.panels.shape == (-(-n // 32), kp // 4, 32, 4) and held.comp.shape == (-(-n // 32), kp // 32, 32)
    assert held.shape == (k, n) and held.dtype == jnp.int8
    product = jax.jit(panel.w8a8_panel_matmul, static_argnums=4)
    got = np.asarray(product(jnp.asarray(x), held.panels, held.comp, held.scales, n))
    want = panel.w8a8_reference(x, np.asarray(w.weight), np.asarray(w.scales, np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max(initial=0))))
    for r in {0, rows // 2, rows - 1} if rows else ():  # alone, the same bits as among the others
        np.testing.assert_array_equal(np.asarray(product(jnp.asarray(x[r:r + 1]), held.panels, held.comp, held.scales,
                                                         n))[0], got[r])
    if rows:  # and not the exact product: the activations were rounded
        exact = x @ np.asarray(dequantize(w, jnp.float32))
        error = np.abs(got - exact).max() / np.abs(exact).max()
        assert 0 < error < 0.03, error


@needs_kernel
@pytest.mark.parametrize("sizes", [[0, 0, 0], [1, 0, 2], [13, 9, 0], [0, 40, 1]])
def test_grouped_w8a8_matmul_multiplies_each_group_by_its_expert(sizes):
    rng = np.random.default_rng(sum(sizes))
    experts, k, n = 3, 96, 40
    ws = [_weight(rng, k, n, 3) for _ in range(experts)]
    stacked = quantize(jnp.stack([dequantize(w, jnp.float32) for w in ws]), groups=3)
    held = panel.W8A8PanelWeight.of(stacked)
    rows = sum(sizes) + 2  # two rows past the groups: zeros
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = np.asarray(panel.grouped_w8a8_matmul(jnp.asarray(x), held.panels, held.comp, held.scales,
                                               jnp.asarray(sizes, jnp.int32), n))
    start = 0
    for e, size in enumerate(sizes):
        want = panel.w8a8_reference(x[start:start + size], np.asarray(stacked.weight[e]),
                                    np.asarray(stacked.scales[e], np.float32))
        np.testing.assert_allclose(got[start:start + size], want, rtol=1e-5, atol=1e-4)
        start += size
    np.testing.assert_array_equal(got[start:], 0)


@needs_kernel
def test_w8a8_reads_one_layer_of_a_stack_in_place():
    rng = np.random.default_rng(3)
    layers, experts, k, n = 3, 2, 48, 40
    stacked = quantize(jnp.asarray(rng.standard_normal((layers, experts, k, n)), jnp.float32))
    held = panel.W8A8PanelWeight.of(stacked)
    take = lambda *index: jax.tree_util.tree_map(lambda a: a[index], held)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((2, 5, k)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((6, k)), jnp.float32)
    sizes = jnp.array([2, 4], jnp.int32)
    plain_in = jax.jit(lambda x, h, layer: panel.w8a8_panel_matmul(x, h.panels, h.comp, h.scales, n, layer))
    grouped_in = jax.jit(lambda x, h, layer: panel.grouped_w8a8_matmul(x, h.panels, h.comp, h.scales, sizes, n, layer))
    expert_0 = jax.tree_util.tree_map(lambda a: a[:, 0], held)
    for layer in range(layers):
        one = take(layer, 0)
        np.testing.assert_array_equal(plain_in(x, expert_0, jnp.int32(layer)),
                                      panel.w8a8_panel_matmul(x, one.panels, one.comp, one.scales, n))
        both = take(layer)
        np.testing.assert_array_equal(grouped_in(rows, held, jnp.int32(layer)),
                                      panel.grouped_w8a8_matmul(rows, both.panels, both.comp, both.scales, sizes, n))


@needs_kernel
def test_w8a8_rejects_what_it_cannot_do():
    held = panel.W8A8PanelWeight.of(quantize(jnp.ones((64, 40), jnp.float32)))
    with pytest.raises(ValueError, match="float32 x, int8 quad panels"):
        panel.w8a8_panel_matmul(jnp.zeros((1, 64), jnp.bfloat16), held.panels, held.comp, held.scales, 40)
    with pytest.raises(ValueError, match="does not match quad panels"):
        panel.w8a8_panel_matmul(jnp.zeros((1, 65), jnp.float32), held.panels, held.comp, held.scales, 40)
    with pytest.raises(ValueError, match="n=65 is not the width"):
        panel.w8a8_panel_matmul(jnp.zeros((1, 64), jnp.float32), held.panels, held.comp, held.scales, 65)
    with pytest.raises(ValueError, match="G dividing K's 2 blocks"):
        panel.w8a8_panel_matmul(jnp.zeros((1, 64), jnp.float32), held.panels, held.comp,
                                jnp.zeros((2, 3, 32), jnp.float32), 40)
    assert panel.w8a8_fits(64, 2) and panel.w8a8_fits(33, 1) and not panel.w8a8_fits(96, 2)  # 48 rows a group
    with pytest.raises(ValueError, match="4 scale groups of K=64 are not whole blocks of 32"):
        panel.W8A8PanelWeight.of(quantize(jnp.ones((64, 40), jnp.float32), groups=4))


def test_the_calibration_takes_w8a8_only_where_it_beats_the_exact_int8_kernel():
    m = lambda kernel, xla: (Measurement("decode", 1, kernel, xla), Measurement("prefill", 256, kernel, xla))  # noqa: E731
    floats = m(1.0, 2.0)  # the float kernel twice XLA's speed
    faster = decide_w8a8("moe", m(1.0, 3.0), m(1.0, 2.0), floats)
    assert faster.w8a8 and faster.int8 and faster.kernel and "int8 x int8 kernel (" in faster.describe()
    slower = decide_w8a8("moe", m(1.0, 1.5), m(1.0, 2.0), floats)
    assert not slower.w8a8 and slower.int8 and slower.describe().startswith("moe: int8 kernel")
    too_slow = decide_w8a8("moe", m(1.0, 0.4), m(1.0, 0.4), floats)  # both slower than XLA's op
    assert not too_slow.w8a8 and not too_slow.int8


@needs_kernel
def test_prepare_holds_w8a8_weights_in_quads_where_their_groups_fit():
    params = init_params(TINY, jax.random.PRNGKey(0))
    from model.quant import quantize_params

    quantized = quantize_params(params)
    backend = CPU(on=frozenset({"moe", "projections"}), int8=frozenset({"moe", "projections"}),
                  w8a8=frozenset({"moe"}))
    held = first_layer(backend.prepare(quantized))
    assert isinstance(held["moe"]["linear"]["w"], panel.W8A8PanelWeight)
    assert isinstance(held["multi_head_attention"]["query"]["w"], panel.Int8PanelWeight)  # exact: not in w8a8
    assert TINY.emb_size == 32
    odd = quantize_params(params, groups=2)  # the experts' K of 32 in groups of 16: no whole blocks of 32
    assert isinstance(first_layer(backend.prepare(odd))["moe"]["linear"]["w"], panel.Int8PanelWeight)
    assert "moe (int8 x int8, " in backend.describe()
    with pytest.raises(ValueError, match="CPU\\(w8a8=...\\) must name operations of int8"):
        CPU(on=frozenset({"moe"}), int8=frozenset({"moe"}), w8a8=frozenset({"projections"}))


@needs_kernel
def test_a_w8a8_runner_decodes_as_its_full_forward_within_the_rounding_of_its_activations():
    """With every kernel (``backend="cpu"``): the experts and projections on the w8a8 kernels; the
    greedy tokens a runner decodes step by step are the argmax of its own full forward over the
    sequence at every position (a row's rounding does not depend on the others, so the prefill's
    many rows and the decode's one agree); its logits differ from the exact int8 product's by the
    activations' rounding, and only by that."""
    params = init_params(TINY, jax.random.PRNGKey(0))
    spec = ModelRunner(model=TINY, params=params, backend="cpu", quantize="w8a8")
    runner = InferenceRunner(runner=spec, batch_size=1, pad_sizes=(16,)).initialize(warmup=False)
    prompt = [5, 9, 13, 2, 7, 11]
    out = runner.generate([Request(prompt, temperature=0.0, max_len=8, ignore_eos=True)])[0].token_ids
    engine = runner.engine.executor
    moe = first_layer(engine.params)["moe"]["linear"]["w"]
    assert isinstance(getattr(moe, "stack", moe), panel.W8A8PanelWeight)
    assert "int8 x int8" in engine.backend_report()
    sequence = np.array([prompt + out], np.int32)
    logits = np.asarray(engine.forward(engine.params, sequence, np.array([sequence.shape[1]], np.int32)))
    assert logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out
    from model.quant import quantize_params

    exact = jax.tree_util.tree_map(lambda w: dequantize(w, jnp.float32), quantize_params(params),
                                   is_leaf=lambda x: hasattr(x, "scales"))
    want = np.asarray(forward(exact, sequence, TINY, backend=XLA()).logits)
    error = np.abs(logits - want).max() / np.abs(want).max()
    assert 0 < error < 0.05, error
