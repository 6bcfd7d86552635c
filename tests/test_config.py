import dataclasses

import pytest

from model import GROK_1, GROK_1_REFERENCE_TINY, TINY, ModelConfig, ffn_size


def test_ffn_size_matches_grok1_formula():
    assert ffn_size(6144, 8) == 32768
    assert ffn_size(64, 8) == 344
    assert GROK_1.ffn_size == 32768
    assert GROK_1_REFERENCE_TINY.ffn_size == 344


def test_grok1_parameter_count():
    assert abs(GROK_1.num_params - 315.68e9) / 315.68e9 < 1e-3
    counts = GROK_1.param_counts()
    assert abs(counts["moe"] - 309.24e9) / 309.24e9 < 1e-3
    assert abs(counts["attention"] - 5.64e9) / 5.64e9 < 1e-3
    # 2 of 8 experts per token: about 83.8e9 active (docs/grok1.md §1)
    assert abs(GROK_1.num_active_params - 83.8e9) / 83.8e9 < 2e-3


def test_grok1_kv_bytes():
    assert GROK_1.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2  # bf16
    assert GROK_1.kv_bytes_per_token() * 8192 == 2 * 2**30  # 2 GiB per 8192-token sequence
    assert GROK_1.kv_bytes_per_token("float32") == 2 * GROK_1.kv_bytes_per_token()


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GROK_1.emb_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ModelConfig(131072, 6144)  # type: ignore[misc]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_kv_heads": 3}, "num_q_heads"),
        ({"num_selected_experts": 5}, "num_selected_experts"),
        ({"emb_size": 0}, "emb_size"),
        ({"key_size": 7}, "key_size"),
        ({"eos_token": 10**6}, "eos_token"),
        ({"fprop_dtype": "int8"}, "fprop_dtype"),
        ({"attn_output_multiplier": float("nan")}, "attn_output_multiplier"),
        ({"num_layers": 2.5}, "num_layers"),
        ({"activation": "gelu_new"}, "activation"),
        ({"pad_token": -1}, "pad_token"),
        ({"pad_token": True}, "pad_token"),
    ],
)
def test_config_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **change)
