"""Properties that catch the classic bugs of a cached transformer (tiny config, fp32)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from backends.cpu.layout import ExpertWeights
from backends.xla import group_rows
from model import TINY, KVMemory, forward, init_params, new_memory
from model.layers import PAIRWISE_ROWS, MoELayer, by_expert, rotary_embedding
from model.quant import dequantize
from tests.backends import NAMES, arranged
from tests.test_quant import quantize_params

ATOL = 1e-4


def random_tokens(seed, shape, vocab=TINY.vocab_size):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 1, vocab))


def decode_all(params, tokens, prefill_len, config=TINY, batch_rows=None, backend=XLA()):
    """Prefill ``prefill_len`` tokens into a fresh memory, then decode the rest one at a time."""
    b, t = tokens.shape
    memory = new_memory(config, b)
    out = forward(params, tokens[:, :prefill_len], config, memory=memory, backend=backend)
    logits = [out.logits]
    memory = out.memory
    for i in range(prefill_len, t):
        out = forward(params, tokens[:, i:i + 1], config, memory=memory, backend=backend)
        logits.append(out.logits)
        memory = out.memory
    return np.concatenate([np.asarray(x) for x in logits], axis=1), memory


def test_cached_decode_equals_full_forward(tiny_params):
    tokens = random_tokens(0, (2, 20))
    full = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    cached, memory = decode_all(tiny_params, tokens, prefill_len=7)
    assert np.abs(cached - full).max() <= ATOL
    np.testing.assert_array_equal(np.asarray(memory.step), [20, 20])


def test_chunked_prefill_with_padding_equals_full_forward(tiny_params):
    tokens = random_tokens(1, (1, 13))
    full = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    memory = new_memory(TINY, 1)
    # chunk 1: 8 real tokens; chunk 2: 5 real tokens right-padded to 8
    out1 = forward(tiny_params, tokens[:, :8], TINY, memory=memory, backend=XLA())
    padded = np.zeros((1, 8), np.int32)
    padded[0, :5] = tokens[0, 8:]
    out2 = forward(tiny_params, padded, TINY, memory=out1.memory, lengths=[5], backend=XLA())
    assert int(out2.memory.step[0]) == 13
    np.testing.assert_allclose(np.asarray(out1.logits), full[:, :8], atol=ATOL)
    np.testing.assert_allclose(np.asarray(out2.logits)[:, :5], full[:, 8:], atol=ATOL)
    # decoding on from the padded prefill still equals the full forward
    longer = np.concatenate([tokens, random_tokens(2, (1, 1))], axis=1)
    out3 = forward(tiny_params, longer[:, 13:], TINY, memory=out2.memory, backend=XLA())
    np.testing.assert_allclose(np.asarray(out3.logits)[:, 0],
                               np.asarray(forward(tiny_params, longer, TINY, backend=XLA()).logits)[:, 13], atol=ATOL)


def test_rows_are_independent(tiny_params):
    tokens = random_tokens(3, (3, 10))
    lengths = np.array([10, 6, 8])
    base = np.asarray(forward(tiny_params, tokens, TINY, lengths=lengths, backend=XLA()).logits)
    other = tokens.copy()
    other[1] = random_tokens(4, (10,))
    changed = np.asarray(forward(tiny_params, other, TINY, lengths=[10, 3, 8], backend=XLA()).logits)
    for i in (0, 2):
        np.testing.assert_allclose(changed[i], base[i], atol=1e-6)
    # with memory: rows at different steps, row 1 rewritten, rows 0 and 2 unchanged
    memory = new_memory(TINY, 3)
    out = forward(tiny_params, tokens, TINY, memory=memory, lengths=lengths, backend=XLA())
    out_b = forward(tiny_params, other, TINY, memory=memory, lengths=[10, 3, 8], backend=XLA())
    for i in (0, 2):
        np.testing.assert_allclose(np.asarray(out_b.logits[i]), np.asarray(out.logits[i]), atol=1e-6)
        for layer in range(TINY.num_layers):
            np.testing.assert_array_equal(np.asarray(out_b.memory.k[layer, i]),
                                          np.asarray(out.memory.k[layer, i]))
    np.testing.assert_array_equal(np.asarray(out_b.memory.step), [10, 3, 8])


def test_right_padding_never_changes_real_positions(tiny_params):
    tokens = random_tokens(5, (1, 7))
    real = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    padded = np.concatenate([tokens, np.zeros((1, 9), np.int32)], axis=1)
    # padding by token id (as the reference) and by explicit length give the same real positions
    by_id = np.asarray(forward(tiny_params, padded, TINY, backend=XLA()).logits)[:, :7]
    garbage = np.concatenate([tokens, random_tokens(6, (1, 9))], axis=1)
    by_len = np.asarray(forward(tiny_params, garbage, TINY, lengths=[7], backend=XLA()).logits)[:, :7]
    np.testing.assert_allclose(by_id, real, atol=1e-5)
    np.testing.assert_allclose(by_len, real, atol=1e-5)


def test_grok1s_full_forward_hides_id_0_keys_and_the_cache_masks_by_position(tiny_params):
    """docs/grok1.md §13. Grok-1's reference masks every key whose token is the pad id (0) in a
    forward without memory, and this ``forward`` does: what id 0 embeds to reaches no other
    position (only its own query and the logit of id 0 itself, the tied table's row, read it).
    The KV-cache paths (prefill, decode) mask by position: they attend to it like any token,
    computing exactly what the full forward of a config without a pad id computes."""
    tokens = np.array(random_tokens(7, (2, 16)))
    tokens[:, 6] = 0
    other = jax.tree_util.tree_map(lambda x: x, tiny_params)
    table = other["language_model"]["in_out_embed"]["embeddings"]
    other["language_model"]["in_out_embed"]["embeddings"] = table.at[0].set(
        jax.random.normal(jax.random.PRNGKey(8), table.shape[1:]))
    full = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    full_other = np.asarray(forward(other, tokens, TINY, backend=XLA()).logits)
    np.testing.assert_allclose(full_other[:, 7:, 1:], full[:, 7:, 1:], atol=1e-6)  # key 6 is hidden
    assert np.abs(full_other[:, 6] - full[:, 6]).max() > 1e-2  # its own query is computed (on keys 0-5)

    cached, _ = decode_all(tiny_params, tokens, 4)
    np.testing.assert_allclose(cached[:, :6], full[:, :6], atol=ATOL)  # before the 0 nothing differs
    assert np.abs(cached[:, 6:] - full[:, 6:]).max() > 1e-2  # from it on the cache sees its key
    by_position = np.asarray(forward(tiny_params, tokens, dataclasses.replace(TINY, pad_token=None),
                                     backend=XLA()).logits)
    np.testing.assert_allclose(cached, by_position, atol=ATOL)
    cached_other, _ = decode_all(other, tokens, 4)
    assert np.abs(cached_other[:, 7:, 1:] - cached[:, 7:, 1:]).max() > 1e-2


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads(tiny_params):
    g = TINY.q_per_kv
    mha = dataclasses.replace(TINY, num_kv_heads=TINY.num_q_heads)
    params = jax.tree_util.tree_map(lambda x: x, tiny_params)
    attn = params["transformer"]["layers"]["multi_head_attention"]  # every layer's, stacked
    for name in ("key", "value"):
        w = attn[name]["w"].reshape(TINY.num_layers, TINY.emb_size, TINY.num_kv_heads, TINY.key_size)
        # query head j uses KV head j // g: repeat each KV head g times, contiguously
        attn[name] = {"w": jnp.repeat(w, g, axis=2).reshape(TINY.num_layers, TINY.emb_size, -1)}
    tokens = random_tokens(7, (2, 11))
    np.testing.assert_allclose(np.asarray(forward(params, tokens, mha, backend=XLA()).logits),
                               np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits), atol=1e-5)


def test_attention_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.PRNGKey(8), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.PRNGKey(9), (1, 1, 1, 16))
    def score(m, n):
        qm = rotary_embedding(q, jnp.array([[m]]), 10000.0)
        kn = rotary_embedding(k, jnp.array([[n]]), 10000.0)
        return float(jnp.sum(qm * kn))
    for m, n in [(5, 2), (40, 3), (7, 7)]:
        for shift in (1, 17, 100):
            assert abs(score(m, n) - score(m + shift, n + shift)) < 1e-4
    assert abs(score(5, 2) - score(6, 2)) > 1e-3  # and they do depend on the distance


def test_rope_is_rotate_half_on_the_full_head():
    x = jnp.arange(1, 5, dtype=jnp.float32).reshape(1, 1, 1, 4)
    y = rotary_embedding(x, jnp.array([[1]]), 10000.0)
    # inv_freq = [1, 1/100]; pairs (x0, x2) and (x1, x3) rotate by 1 and 0.01 radians
    c0, s0, c1, s1 = np.cos(1), np.sin(1), np.cos(0.01), np.sin(0.01)
    expected = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
    np.testing.assert_allclose(np.asarray(y).ravel(), expected, rtol=1e-6)


def slow_moe(x_MD, probs_ME, params, top):
    """Per-token loop over the selected experts, straight from the definition."""
    w = {name: np.asarray(dequantize(params[name]["w"], jnp.float32))
         for name in ("linear", "linear_v", "linear_1")}
    out = np.zeros_like(x_MD)
    for m in range(x_MD.shape[0]):
        chosen = np.argsort(-probs_ME[m], kind="stable")[:top]
        for e in chosen:
            gate = x_MD[m] @ w["linear"][e]
            gelu = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
            out[m] += probs_ME[m, e] * ((gelu * (x_MD[m] @ w["linear_v"][e])) @ w["linear_1"][e])
    return out


@pytest.mark.parametrize("rows", [1, 16, PAIRWISE_ROWS, PAIRWISE_ROWS + 1, 777])
@pytest.mark.parametrize("experts", [1, 8])
def test_rows_by_expert_are_in_the_order_of_a_stable_sort(rows, experts):
    """``by_expert`` (no sort: XLA:CPU cannot serialise a program that ran one) orders rows as a
    stable argsort by expert would, rows of the unused expert E last, and counts each expert's,
    both ways it counts (pairs of rows, cumulative sums)."""
    rng = np.random.default_rng(rows * 10 + experts)
    for expert_R in (rng.integers(0, experts + 1, rows), np.full(rows, experts), np.zeros(rows)):
        expert_R = expert_R.astype(np.int32)
        order_R, sizes_E = jax.jit(by_expert, static_argnums=1)(jnp.asarray(expert_R), experts)
        np.testing.assert_array_equal(order_R, np.argsort(expert_R, kind="stable"))
        np.testing.assert_array_equal(sizes_E, np.bincount(expert_R, minlength=experts + 1)[:experts])


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("experts, top", [(4, 2), (1, 1), (3, 3)])
def test_moe_equals_per_token_loop(quantized, name, experts, top):
    config = dataclasses.replace(TINY, num_experts=experts, num_selected_experts=top)
    x = jax.random.normal(jax.random.PRNGKey(10), (2, 5, config.emb_size))
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(11), (2, 5, experts)) * 3)
    params = nn.meta.unbox(MoELayer(config, XLA()).init(jax.random.PRNGKey(12), x, probs)["params"])
    if quantized:
        params = quantize_params(params, groups=4)
    backend, used = arranged({"moe": params}, name)
    got = np.asarray(MoELayer(config, backend).apply({"params": used["moe"]}, x, probs)).reshape(10, -1)
    want = slow_moe(np.asarray(x).reshape(10, -1), np.asarray(probs).reshape(10, -1), params, top)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_grouped_moe_loops_when_one_expert_gets_more_than_a_group(name):
    """All 40 tokens routed to experts 0 and 1: their 40 rows exceed one dot of the loop
    (``group_rows``), so the on-device loop runs, and the six idle experts are skipped."""
    config = dataclasses.replace(TINY, num_experts=8, num_selected_experts=2)
    assert group_rows(80, 8) < 40
    x = jax.random.normal(jax.random.PRNGKey(13), (4, 10, config.emb_size))
    logits = jax.random.normal(jax.random.PRNGKey(14), (4, 10, 8)).at[..., :2].add(20.0)
    probs = jax.nn.softmax(logits)
    params = nn.meta.unbox(MoELayer(config, XLA()).init(jax.random.PRNGKey(15), x, probs)["params"])
    backend, used = arranged({"moe": params}, name)
    got = np.asarray(MoELayer(config, backend).apply({"params": used["moe"]}, x, probs)).reshape(40, -1)
    want = slow_moe(np.asarray(x).reshape(40, -1), np.asarray(probs).reshape(40, -1), params, 2)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_tokens_past_their_rows_length_reach_no_expert(name):
    """Padding and free slots' rows are routed to no expert: valid tokens get the per-token
    definition, the others exactly 0, even where the only experts they pick hold NaN weights
    (computing any of their rows would spread the NaN). Not with NaNs on ragged_dot: XLA:CPU
    lowers it to every expert on every row, masked (0 x NaN is NaN); the backends of CPU
    serving skip an expert with no rows."""
    config = dataclasses.replace(TINY, num_experts=8, num_selected_experts=2)
    x = jax.random.normal(jax.random.PRNGKey(16), (3, 6, config.emb_size))
    valid = jnp.arange(6)[None, :] < jnp.array([6, 2, 0])[:, None]  # a full row, a padded one, a free one
    # valid tokens pick experts 0 and 1, the others 6 and 7
    logits = jax.random.normal(jax.random.PRNGKey(17), (3, 6, 8))
    probs = jax.nn.softmax(jnp.where(valid[..., None], logits.at[..., :2].add(20.0), logits.at[..., 6:].add(20.0)))
    params = nn.meta.unbox(MoELayer(config, XLA()).init(jax.random.PRNGKey(18), x, probs)["params"])
    if name != "xla":
        params = jax.tree_util.tree_map(lambda w: w.at[6:].set(jnp.nan), params)
    backend, used = arranged({"moe": params}, name)
    got = np.asarray(MoELayer(config, backend).apply({"params": used["moe"]}, x, probs, valid)).reshape(18, -1)
    keep = np.asarray(valid).reshape(18)
    want = slow_moe(np.asarray(x).reshape(18, -1)[keep], np.asarray(probs).reshape(18, -1)[keep], params, 2)
    np.testing.assert_allclose(got[keep], want, atol=1e-4, rtol=1e-4)
    assert np.all(got[~keep] == 0)


def test_weights_held_in_a_layout_of_the_wrong_shape_are_rejected(tiny_params):
    backend, split = arranged(tiny_params, "cpu")
    layer = split["transformer"]["decoder_layer_0"]["moe"]["linear"]  # layer 0's experts, held apart
    layer["w"] = ExpertWeights(layer["w"].experts[:-1])  # one expert short
    with pytest.raises(ValueError, match="held as ExpertWeights of shape"):
        forward(split, random_tokens(1, (1, 3)), TINY, backend=backend)
    backend, packed = arranged(tiny_params, "cpu-kernels")
    stack = packed["transformer"]["layers"]["moe"]["linear"]  # every layer's experts in panels, stacked
    stack["w"] = dataclasses.replace(stack["w"], panels=stack["w"].panels[:, :-1])  # one expert short
    with pytest.raises(ValueError, match="held as InLayer of shape"):
        forward(packed, random_tokens(1, (1, 3)), TINY, backend=backend)


@pytest.mark.parametrize("name", NAMES)
def test_every_backend_gives_the_same_logits_and_cache(tiny_params, name):
    tokens = random_tokens(16, (3, 7))
    backend, used = arranged(tiny_params, name)
    want = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    np.testing.assert_allclose(np.asarray(forward(used, tokens, TINY, backend=backend).logits), want, atol=1e-5)
    cached, _ = decode_all(used, tokens, prefill_len=3, backend=backend)
    np.testing.assert_allclose(cached, want, atol=ATOL)


def test_batch_above_one_with_int8_weights(tiny_params):
    """The reference crashes here (docs/grok1.md §8.5); each row must equal its batch-1 run."""
    qparams = quantize_params(tiny_params, groups=2)
    tokens = random_tokens(13, (4, 9))
    batched = np.asarray(forward(qparams, tokens, TINY, backend=XLA()).logits)
    for i in range(4):
        np.testing.assert_allclose(batched[i], np.asarray(forward(qparams, tokens[i:i + 1], TINY, backend=XLA()).logits)[0],
                                   atol=1e-5)
    cached, _ = decode_all(qparams, tokens, prefill_len=4)
    np.testing.assert_allclose(cached, batched, atol=ATOL)


def test_bf16_activations_track_fp32(tiny_params):
    bf16 = dataclasses.replace(TINY, fprop_dtype="bfloat16")
    tokens = random_tokens(14, (2, 12))
    a = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    b = np.asarray(forward(tiny_params, tokens, bf16, backend=XLA()).logits)
    assert np.isfinite(b).all()
    assert np.abs(a - b).mean() < 0.05 * np.abs(a).mean()
    cached, memory = decode_all(tiny_params, tokens, 5, config=bf16)
    assert memory.k.dtype == jnp.bfloat16 and np.isfinite(cached).all()


def test_memory_overflow_is_an_error_before_the_call(tiny_params):
    memory = new_memory(TINY, 2, sequence_len=8)
    out = forward(tiny_params, random_tokens(15, (2, 6)), TINY, memory=memory, backend=XLA())
    with pytest.raises(ValueError, match="overflow.*sequence_len is 8"):
        forward(tiny_params, random_tokens(16, (2, 3)), TINY, memory=out.memory, backend=XLA())
    # padding past the end is fine as long as the real tokens fit: 2 real of a 4-token chunk
    out2 = forward(tiny_params, random_tokens(17, (2, 4)), TINY, memory=out.memory, lengths=[2, 2], backend=XLA())
    np.testing.assert_array_equal(np.asarray(out2.memory.step), [8, 8])


def test_padding_past_the_end_is_dropped_not_clamped(tiny_params):
    """Inside jit the overflow check cannot run; pad positions past S must not overwrite valid ones."""
    tokens = random_tokens(18, (1, 8))
    memory = new_memory(TINY, 1, sequence_len=8)
    step = jax.jit(lambda p, t, m, n: forward(p, t, TINY, memory=m, lengths=n, backend=XLA()))
    first = step(tiny_params, tokens[:, :6], memory, jnp.array([6]))
    chunk = np.concatenate([tokens[:, 6:8], random_tokens(19, (1, 4))], axis=1)  # 2 real + 4 pad
    second = step(tiny_params, chunk, first.memory, jnp.array([2]))
    for layer in range(TINY.num_layers):
        np.testing.assert_array_equal(np.asarray(second.memory.k[layer, 0, :, :6]),
                                      np.asarray(first.memory.k[layer, 0, :, :6]))
    full = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    np.testing.assert_allclose(np.asarray(second.logits)[:, :2], full[:, 6:8], atol=ATOL)


def test_any_batch_size_and_last_only(tiny_params):
    for b in (1, 5):
        tokens = random_tokens(20 + b, (b, 6))
        lengths = np.arange(b) % 6 + 1
        full = np.asarray(forward(tiny_params, tokens, TINY, lengths=lengths, backend=XLA()).logits)
        last = np.asarray(forward(tiny_params, tokens, TINY, lengths=lengths, last_only=True, backend=XLA()).logits)
        np.testing.assert_allclose(last[:, 0], full[np.arange(b), lengths - 1], atol=1e-5)


def test_forward_under_a_mesh_matches_single_device(tiny_params):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tokens = random_tokens(30, (4, 8))
    want = np.asarray(forward(tiny_params, tokens, TINY, backend=XLA()).logits)
    sharded_tokens = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    memory = jax.device_put(new_memory(TINY, 4), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda p, t, m: forward(p, t, TINY, memory=m, backend=XLA()))(tiny_params, sharded_tokens, memory)
    np.testing.assert_allclose(np.asarray(got.logits), want, atol=1e-5)
    assert isinstance(got.memory, KVMemory)


def test_init_params_shapes_follow_grok1_names():
    params = jax.eval_shape(lambda: init_params(TINY, jax.random.PRNGKey(0)))
    layer = params["transformer"]["layers"]  # Grok-1's decoder_layer_<i>, stacked over the layers
    assert set(params["transformer"]) == {"layers"}
    d, f, e, n = TINY.emb_size, TINY.ffn_size, TINY.num_experts, TINY.num_layers
    assert layer["moe"]["linear"]["w"].shape == (n, e, d, f)
    assert layer["moe"]["linear_1"]["w"].shape == (n, e, f, d)
    assert layer["multi_head_attention"]["query"]["w"].shape == (n, d, TINY.num_q_heads * TINY.key_size)
    assert layer["router"]["w"].shape == (n, d, e)
    assert params["language_model"]["in_out_embed"]["embeddings"].shape == (TINY.vocab_size, d)
    assert set(layer) == {"moe", "multi_head_attention", "router", "rms_norm", "rms_norm_1",
                          "rms_norm_2", "rms_norm_3"}


def test_the_moe_on_ragged_dot_has_the_gradient_of_every_expert_on_every_token():
    """Training runs the MoE on jax.lax.ragged_dot: its gradient must be that of the plain
    definition (every expert on every token, combined by the top-k gates)."""
    config = dataclasses.replace(TINY, num_experts=4, num_selected_experts=2)
    x = jax.random.normal(jax.random.PRNGKey(20), (2, 6, config.emb_size))
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(21), (2, 6, 4)) * 3)
    params = nn.meta.unbox(MoELayer(config, XLA()).init(jax.random.PRNGKey(22), x, probs)["params"])

    def dense(p, x):
        gates, idx = jax.lax.top_k(probs, 2)
        combine = jnp.einsum("BTk,BTkE->BTE", gates, jax.nn.one_hot(idx, 4))
        hidden = jax.nn.gelu(jnp.einsum("BTD,EDF->BTEF", x, p["linear"]["w"]), approximate=True) * jnp.einsum(
            "BTD,EDF->BTEF", x, p["linear_v"]["w"])
        return jnp.einsum("BTE,BTED->BTD", combine, jnp.einsum("BTEF,EFD->BTED", hidden, p["linear_1"]["w"]))

    def ragged(p, x):
        return MoELayer(config, XLA(grouped="ragged")).apply({"params": p}, x, probs)

    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))  # noqa: E731
    got = jax.jit(jax.grad(loss(ragged), argnums=(0, 1)))(params, x)  # jitted: one compile, not one an op
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1)))(params, x)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), got, want)


@pytest.mark.parametrize("queries", [64, 256])
def test_blocked_attention_equals_the_dense_one(queries):
    """A long chunk's attention, block by block with its causal and past-the-rows key blocks
    skipped, equals the dense one: rows at other cache positions, padding queries, a row that
    sees no key (finite output)."""
    from backends.xla import attend_blocked, attend_dense

    rng = np.random.default_rng(0)
    b, t, n, kv_heads, h, s = 3, 512, 8, 2, 16, 1024
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, kv_heads, 2048, h)), jnp.float32) for _ in range(2))
    step, length = np.array([300, 0, 0]), np.array([400, 100, 0])
    query_pos, key_pos = step[:, None] + np.arange(t)[None], np.arange(s)
    mask = ((key_pos[None, None] <= query_pos[:, :, None]) & (key_pos[None, None] < (step + length)[:, None, None])
            & (np.arange(t)[None, :, None] < length[:, None, None]))
    dense = np.asarray(attend_dense(q, k, v, jnp.asarray(mask), 0.125, 30.0))
    blocked = np.asarray(jax.jit(attend_blocked, static_argnums=(4, 5, 6))(q, k, v, jnp.asarray(mask), 0.125, 30.0,
                                                                           queries))
    real = np.arange(t)[None, :] < length[:, None]
    np.testing.assert_allclose(blocked[real], dense[real], atol=1e-5)
    assert np.isfinite(blocked).all()


@pytest.mark.parametrize("name", NAMES)
def test_a_packed_prefill_equals_each_chunk_alone(tiny_params, name):
    """Chunks of three requests packed into one row of tokens (rows_BT, positions_BT), padding
    between and after them, write each slot's cache and give each chunk's last logits exactly as
    the chunk computed alone in its own memory row: a first chunk, a second chunk after one already
    in its slot, and a chunk long enough to take attention's blocked path."""
    from model.transformer import LanguageModel

    backend, used = arranged(tiny_params, name)
    slots, s = 4, 2048
    prompts = {2: random_tokens(40, (9,)), 0: random_tokens(41, (12,)), 3: random_tokens(42, (300,))}
    earlier = {0: 5}  # slot 0's first 5 tokens are already in its cache; its chunk is the other 7
    memory = new_memory(TINY, slots, s)
    alone = {}
    for slot, ids in prompts.items():
        row = new_memory(TINY, 1, s)
        start = earlier.get(slot, 0)
        if start:
            row = forward(used, ids[None, :start], TINY, memory=row, backend=backend).memory
            memory = memory.replace(k=memory.k.at[:, slot].set(row.k[:, 0]), v=memory.v.at[:, slot].set(row.v[:, 0]),
                                    step=memory.step.at[slot].set(start))
        alone[slot] = forward(used, ids[None, start:], TINY, memory=row, backend=backend)
    tokens, rows, positions, last = [], [], [], []
    for slot, ids in prompts.items():
        start = earlier.get(slot, 0)
        tokens += list(ids[start:]) + [0] * 3  # padding between chunks
        rows += [slot] * (len(ids) - start) + [slots] * 3
        positions += list(range(start, len(ids))) + [0] * 3
        last.append(len(tokens) - 4)
    pad = 512 - len(tokens)
    tokens, rows, positions = (np.array(x + [fill] * pad, np.int32)[None]
                               for x, fill in ((tokens, 0), (rows, slots), (positions, 0)))
    packed = jax.jit(lambda p, m: LanguageModel(TINY, backend).apply(
        {"params": p}, tokens, m, None, False, None, rows, positions, np.array(last)))(used, memory)
    for i, (slot, ids) in enumerate(prompts.items()):
        np.testing.assert_allclose(np.asarray(packed.logits)[0, i], np.asarray(alone[slot].logits)[0, -1], atol=ATOL)
        n = len(ids)
        for got, want in ((packed.memory.k, alone[slot].memory.k), (packed.memory.v, alone[slot].memory.v)):
            np.testing.assert_allclose(np.asarray(got)[:, slot, :, :n], np.asarray(want)[:, 0, :, :n], atol=ATOL)
    untouched = np.asarray(packed.memory.k)[:, 1]
    assert not untouched.any()  # slot 1 holds no chunk: nothing was written there
