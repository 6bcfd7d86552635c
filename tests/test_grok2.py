"""Grok-2's forward: each field of the family against a plain numpy statement of its formulas
(tests/grok2_numpy.py), per layer and at the output, in fp32 and bf16; cached decode equals the
full forward; a mesh equals one device. The tiny Grok-2 has every Grok-2 field on at sizes where
each shows: positions past the attention temperature's length (8) and past YaRN's original
context (16), caps that bite."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from backends import XLA
from model import TINY_GROK2, forward, init_params, new_memory
from model.config import GROK_2
from model.layers import DecoderLayer, rope_frequencies
from model.transformer import LanguageModel, attention_mask, layers_apart, sown
from tests import grok2_numpy

T = 40  # past 8 (temperature) and 16 (YaRN's original context)


def grok2_params(config=TINY_GROK2, seed=0):
    """Random parameters with the router's logits large enough for its cap to bite."""
    params = init_params(config, jax.random.PRNGKey(seed))
    for layer in params["transformer"].values():
        layer["router"]["w"] = layer["router"]["w"] * 4.0
        layer["rms_norm_3"]["scale"] = layer["rms_norm_3"]["scale"] * 3.0  # the MoE/MLP steer the output
    return params


@pytest.fixture(scope="module")
def params():
    return grok2_params()


def tokens_of(seed, shape, vocab=TINY_GROK2.vocab_size):
    return np.asarray(jax.random.randint(jax.random.PRNGKey(seed), shape, 3, vocab))


def test_the_grok2_preset_is_the_released_model():
    """xai-org/grok-2's config.json (as sglang reads it): about 270B parameters, 115B active."""
    assert GROK_2.emb_size == 8192 and GROK_2.num_q_heads == 64 and GROK_2.num_kv_heads == 8
    assert GROK_2.ffn_size == 16384 and GROK_2.shared_ffn_size == 32768
    assert abs(GROK_2.num_params / 1e9 - 269.5) < 0.1 and abs(GROK_2.num_active_params / 1e9 - 114.9) < 0.1
    assert GROK_2.rope_scaling == "none" and GROK_2.rope_base == 208533496  # rope_type "original"
    assert (GROK_2.router_logit_cap, GROK_2.final_logit_cap, GROK_2.attn_logit_cap) == (30, 50, 30)
    assert GROK_2.attn_temperature_len == 1024 and not GROK_2.tie_embeddings


@pytest.mark.parametrize("scaling", ["yarn", "yarn_log"])
def test_rope_frequencies_follow_yarn(scaling):
    config = dataclasses.replace(TINY_GROK2, rope_scaling=scaling)
    got = np.asarray(rope_frequencies(config.key_size, config))
    want = grok2_numpy.inverse_frequencies(config)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    plain = grok2_numpy.inverse_frequencies(dataclasses.replace(config, rope_scaling="none"))
    assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / config.rope_scaling_factor), \
        "the fastest dimension keeps its frequency, the slowest is interpolated"


def test_each_layer_and_the_output_equal_the_numpy_statement_in_fp32(params):
    tokens = tokens_of(0, (T,))
    want_logits, want_layers = grok2_numpy.forward(jax.device_get(params), tokens, TINY_GROK2)
    positions = jnp.arange(T)[None]
    mask = attention_mask(jnp.asarray(tokens)[None], jnp.array([T]), TINY_GROK2.pad_token)
    layer = jax.jit(lambda p, h: DecoderLayer(TINY_GROK2, XLA()).apply(
        {"params": p}, (h, None), 0, positions, mask, mutable=["intermediates"]))
    h = grok2_numpy.embed(tokens, grok2_numpy.to_float64(jax.device_get(params)), TINY_GROK2)
    for i in range(TINY_GROK2.num_layers):
        _, state = layer(layers_apart(params)["transformer"][f"decoder_layer_{i}"], jnp.asarray(h[None], jnp.float32))
        for name in ("attn_out", "router_probs", "moe_out", "h_out"):
            got = np.asarray(state["intermediates"][name][0][0])
            want = want_layers[i][name]
            rel = np.abs(got - want).max() / np.abs(want).max()
            assert rel < 2e-5, f"layer {i} {name}: relative error {rel:.2e}"
        h = want_layers[i]["h_out"]  # teacher forcing
    got = np.asarray(forward(params, tokens[None], TINY_GROK2, backend=XLA()).logits[0])
    assert np.abs(got - want_logits).max() < 2e-4 * np.abs(want_logits).max()
    assert np.abs(want_logits).max() < TINY_GROK2.final_logit_cap


def test_each_field_changes_the_output(params):
    """The statement is not vacuous: turning any one Grok-2 field off changes the logits."""
    tokens = tokens_of(1, (1, T))
    base = np.asarray(forward(params, tokens, TINY_GROK2, backend=XLA()).logits)
    for change in ({"rope_scaling": "none"}, {"attn_temperature_len": 0}, {"router_logit_cap": 0.0},
                   {"final_logit_cap": 0.0}, {"activation": "gelu_tanh"}):
        other = np.asarray(forward(params, tokens, dataclasses.replace(TINY_GROK2, **change), backend=XLA()).logits)
        assert np.abs(other - base).max() > 1e-3, change
    # the temperature changes nothing up to its length, RoPE scaling nothing at position 0
    no_temp = np.asarray(forward(params, tokens, dataclasses.replace(TINY_GROK2, attn_temperature_len=0),
                                 backend=XLA()).logits)
    np.testing.assert_allclose(no_temp[:, :9], base[:, :9], atol=1e-6)


def test_bf16_tracks_the_numpy_statement(params):
    """bf16 activations (weights cast to bf16) against the float64 statement of the same weights:
    at nine positions in ten the logits within 2% of their range (measured: 0.3-0.8%; a token
    whose top two experts are within bf16's rounding may take the other expert, and then its
    logits differ by more), at the median within 1%, and the same greedy token at most positions."""
    bf16 = dataclasses.replace(TINY_GROK2, fprop_dtype="bfloat16")
    cast = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), params)
    tokens = tokens_of(2, (T,))
    want, _ = grok2_numpy.forward(jax.device_get(jax.tree_util.tree_map(lambda w: w.astype(jnp.float32), cast)),
                                  tokens, TINY_GROK2)
    got = np.asarray(forward(cast, tokens[None], bf16, backend=XLA()).logits[0])
    error = np.abs(got - want).max(axis=-1) / (want.max() - want.min())
    assert np.mean(error < 0.02) >= 0.9 and np.median(error) < 0.01, np.round(error, 3)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def decode_all(params, tokens, prefill_len, config):
    memory = new_memory(config, tokens.shape[0])
    out = forward(params, tokens[:, :prefill_len], config, memory=memory, backend=XLA())
    logits, memory = [out.logits], out.memory
    for i in range(prefill_len, tokens.shape[1]):
        out = forward(params, tokens[:, i:i + 1], config, memory=memory, backend=XLA())
        logits.append(out.logits)
        memory = out.memory
    return np.concatenate([np.asarray(x) for x in logits], axis=1)


def test_cached_decode_equals_the_full_forward(params):
    tokens = tokens_of(3, (2, 48))
    full = np.asarray(forward(params, tokens, TINY_GROK2, backend=XLA()).logits)
    cached = decode_all(params, tokens, 5, TINY_GROK2)  # decode crosses 8, 16 and 32
    np.testing.assert_allclose(cached, full, atol=1e-4)


def test_id_0_is_a_token_like_any_other(params):
    """sglang masks Grok-2's keys by position alone: a sequence holding id 0 (``<|pad|>``, or a 0
    in an id prompt) gets the same logits from the full forward (scoring, echo) as through the
    cache (generation), and both equal the numpy statement's."""
    tokens = np.array(tokens_of(5, (2, 24)))
    tokens[:, [2, 3, 9, 17]] = 0
    full = np.asarray(forward(params, tokens, TINY_GROK2, backend=XLA()).logits)
    np.testing.assert_allclose(decode_all(params, tokens, 5, TINY_GROK2), full, atol=1e-4)
    want, _ = grok2_numpy.forward(jax.device_get(params), tokens[0], TINY_GROK2)
    assert np.abs(full[0] - want).max() < 2e-4 * np.abs(want).max()


def test_a_mesh_equals_one_device(params):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from model.sharding import param_shardings

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    tokens = tokens_of(4, (4, 24))
    want = np.asarray(forward(params, tokens, TINY_GROK2, backend=XLA()).logits)
    sharded = jax.device_put(params, param_shardings(params, mesh))
    assert sharded["transformer"]["layers"]["mlp"]["linear"]["w"].sharding.spec[2] == "model"  # split like the experts
    memory = jax.device_put(new_memory(TINY_GROK2, 4), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        step = jax.jit(lambda p, t, m: forward(p, t, TINY_GROK2, memory=m, backend=XLA()))
        got = step(sharded, jax.device_put(tokens, NamedSharding(mesh, P("data", None))), memory)
    np.testing.assert_allclose(np.asarray(got.logits), want, atol=1e-5)


def test_the_model_declares_grok2s_parameters():
    shapes = jax.eval_shape(lambda: init_params(TINY_GROK2, jax.random.PRNGKey(0)))
    c = TINY_GROK2
    layers = shapes["transformer"]["layers"]  # every layer's, stacked
    assert layers["mlp"]["linear"]["w"].shape == (c.num_layers, c.emb_size, c.shared_ffn_size)
    assert layers["mlp"]["linear_1"]["w"].shape == (c.num_layers, c.shared_ffn_size, c.emb_size)
    assert layers["moe"]["linear"]["w"].shape == (c.num_layers, c.num_experts, c.emb_size, 24)
    assert shapes["language_model"]["lm_head"]["embeddings"].shape == (c.vocab_size, c.emb_size)
    assert "lm_head" not in jax.eval_shape(
        lambda: init_params(dataclasses.replace(c, tie_embeddings=True), jax.random.PRNGKey(0)))["language_model"]


def test_whole_model_intermediates_agree_through_the_language_model(params):
    """The same check through ``LanguageModel`` (positions from the memory's steps), one layer deep."""
    tokens = tokens_of(5, (T,))
    _, want_layers = grok2_numpy.forward(jax.device_get(params), tokens, TINY_GROK2)
    _, state = LanguageModel(TINY_GROK2, XLA()).apply({"params": params}, jnp.asarray(tokens)[None],
                                                       mutable=["intermediates"])
    got = np.asarray(sown(state["intermediates"], "h_out")[1][0])
    want = want_layers[1]["h_out"]
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_the_plan_of_grok2_on_eight_h200s(capsys):
    """``grok-runner plan --preset grok-2``: bf16 weights as released, KV a token, the largest batch
    at 131,072 and 8,192 tokens, in bf16 and int8 KV."""
    from cli.main import main

    assert main(["plan", "--preset", "grok-2", "--mesh", "1,8", "--device-memory", "141"]) == 0
    out = capsys.readouterr().out
    assert "weights bfloat16: 62.76 GiB" in out and "KV per token   : 32,768 bytes" in out
    assert "context 131,072: batch 19" in out and "context   8,192: batch 312" in out
    assert main(["plan", "--preset", "grok-2", "--mesh", "1,8", "--device-memory", "141", "--kv-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "KV per token   : 16,896 bytes" in out and "context 131,072: batch 37" in out


def test_at_grok2s_own_lengths_past_1024_positions():
    """The temperature at its released length (1024) and YaRN over an original context of 1024,
    through 1280 positions: the long prompt's blocked attention (256 queries a block) applies each
    query's temperature, and the logits equal the numpy statement's."""
    config = dataclasses.replace(TINY_GROK2, sequence_len=2048, attn_temperature_len=1024, rope_base=208533496.0,
                                 rope_original_context=1024, rope_scaling_factor=2.0)
    params = grok2_params(config, seed=5)
    tokens = tokens_of(6, (1280,))
    want, _ = grok2_numpy.forward(jax.device_get(params), tokens, config)
    got = np.asarray(forward(params, tokens[None], config, backend=XLA()).logits[0])
    assert np.abs(got - want).max() < 2e-4 * np.abs(want).max()
    plain = np.asarray(forward(params, tokens[None], dataclasses.replace(config, attn_temperature_len=0),
                               backend=XLA()).logits[0])
    np.testing.assert_allclose(plain[:1025], got[:1025], atol=1e-5)  # 1 up to position 1024
    assert np.abs(plain[1100:] - got[1100:]).max() > 1e-3
