"""Hugging Face directories of the Grok family load to exactly the parameters of the same model in
the native format: Grok-2 (one file set, and split 8 ways for tensor parallelism), hpcai-tech's
and keyfan's Grok-1; recognised by their config.json; restored onto a mesh; converted; their
mistakes one error naming the file and tensor. The tiny models are written by tests/hf_writers.py."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from checkpoints import CheckpointError, restore, save
from checkpoints.convert import convert
from checkpoints.restore import inspect
from model import TINY, TINY_GROK2, init_params
from model.sharding import make_mesh
from tests.hf_writers import hf_config, write_hf

CASES = {"grok-2": (TINY_GROK2, "sglang", 0), "grok-2-tp8": (TINY_GROK2, "sglang", 8),
         "hpcai-grok-1": (TINY, "hpcai", 0), "keyfan-grok-1": (TINY, "keyfan", 0),
         "hpcai-grok-1-bin": (TINY, "hpcai", 0), "keyfan-grok-1-bin": (TINY, "keyfan", 0)}
TP_CONFIG = TINY_GROK2  # its experts' 24 hidden units split 8 ways: 3 a shard


def flat(tree):
    return {"/".join(str(k.key) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each case: the config, its params, its HF directory and the same model saved natively."""
    out = {}
    for case, (config, naming, tp) in CASES.items():
        params = init_params(config, jax.random.PRNGKey(len(case)))
        root = tmp_path_factory.mktemp(case)
        write_hf(root / "hf", params, config, naming, tp=tp, bin=case.endswith("-bin"))
        save(str(root / "native"), jax.device_get(params), config)
        out[case] = (config, params, root / "hf", root / "native")
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_each_layout_loads_exactly_the_native_parameters(models, case):
    config, params, hf, native = models[case]
    inspected = inspect(str(hf))
    assert inspected.layout == "huggingface" and inspected.config == config, "recognised from config.json alone"
    got, want = flat(restore(str(hf)).params), flat(restore(str(native)).params)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].dtype == want[name].dtype, name


@pytest.mark.parametrize("case", ["grok-2-tp8", "keyfan-grok-1"])
def test_a_sharded_restore_reads_each_devices_slice(models, case):
    config, params, hf, native = models[case]
    mesh = make_mesh((2, 4))
    got = restore(str(hf), mesh=mesh)
    experts = got.params["transformer"]["layers"]["moe"]["linear_1"]["w"]
    assert len(experts.sharding.device_set) == 8
    want = flat(restore(str(native)).params)
    for name, value in flat(got.params).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_bf16_files_keep_their_dtype_and_cast_at_load(tmp_path):
    params = init_params(TINY_GROK2, jax.random.PRNGKey(3))
    write_hf(tmp_path / "hf", params, TINY_GROK2, "sglang", tp=8, dtype="bfloat16")
    got = flat(restore(str(tmp_path / "hf")).params)
    want = flat(jax.tree_util.tree_map(lambda w: np.asarray(w).astype(ml_dtypes.bfloat16), params))
    for name in want:
        assert got[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    as_f32 = flat(restore(str(tmp_path / "hf"), dtype=np.float32).params)
    assert all(v.dtype == np.float32 for v in as_f32.values())


@pytest.mark.parametrize("case", ["grok-2-tp8", "hpcai-grok-1"])
def test_convert_writes_the_native_format(models, case, tmp_path):
    config, params, hf, native = models[case]
    convert(str(hf), str(tmp_path / "out"), progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["format"]
    converted = restore(str(tmp_path / "out"))
    assert converted.config == config
    want = flat(restore(str(native)).params)
    for name, value in flat(converted.params).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def copy_of(models, case, tmp_path):
    target = tmp_path / case
    shutil.copytree(models[case][2], target)
    return target


def test_a_missing_tp_shard_names_the_tensor_and_the_ranks(models, tmp_path):
    hf = copy_of(models, "grok-2-tp8", tmp_path)
    os.remove(hf / "pytorch_model-00001-TP-003.safetensors")
    with pytest.raises(CheckpointError, match=r"block_sparse_moe\.experts\.0\.w1\.weight.*ranks \[0, 1, 2, 4, 5, 6, 7\]"):
        inspect(str(hf))


def test_a_missing_tensor_names_it(models, tmp_path):
    hf = copy_of(models, "keyfan-grok-1", tmp_path)
    from checkpoints.native import read_header
    from tests.hf_writers import _write

    for path in hf.glob("*.safetensors"):
        header, _ = read_header(str(path))
        if "transformer.decoder_layer.1.router.weight" in header:
            from checkpoints.native import _lazy
            kept = {n: _lazy(str(path), n, info, _).read() for n, info in header.items()
                    if n not in ("__metadata__", "transformer.decoder_layer.1.router.weight")}
            _write(str(path), kept)
    with pytest.raises(CheckpointError, match=r"missing tensor 'transformer\.decoder_layer\.1\.router\.weight'"):
        inspect(str(hf))


def test_a_wrong_shape_names_the_file_and_tensor(models, tmp_path):
    config = dict(hf_config(TINY, "hpcai"), intermediate_size=TINY.ffn_size + 8)  # the files disagree
    hf = copy_of(models, "hpcai-grok-1", tmp_path)
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"moe/linear/w .*model-0000[12]-of-00002\.safetensors:model\.layers\.0"
                                              r"\.moe_block\.experts\.0\.linear\.weight.*shape mismatch"):
        inspect(str(hf))


def test_an_extra_tensor_and_an_unsupported_feature_are_errors(models, tmp_path):
    hf = copy_of(models, "grok-2", tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\..* are not parameters of this config"):
        inspect(str(hf))
    (hf / "config.json").write_text(json.dumps(dict(config, sliding_window_size=4096)))
    with pytest.raises(CheckpointError, match="sliding_window_size 4096 is not supported"):
        inspect(str(hf))
    (hf / "config.json").write_text(json.dumps(dict(config, rope_type="dynamic")))
    with pytest.raises(CheckpointError, match="rope_type 'dynamic' is not supported"):
        inspect(str(hf))


def test_grok2s_released_config_is_the_preset():
    """The release's config.json keys, as sglang-jax's Grok-2 scripts give them, read to GROK_2."""
    from checkpoints.hf_layout import config_from_hf
    from model.config import GROK_2

    released = {
        "architectures": ["Grok1ForCausalLM"], "embedding_multiplier_scale": 90.50966799187809,
        "output_multiplier_scale": 0.5, "vocab_size": 131072, "hidden_size": 8192, "intermediate_size": 32768,
        "moe_intermediate_size": 16384, "max_position_embeddings": 131072, "num_experts_per_tok": 2,
        "num_local_experts": 8, "residual_moe": True, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 64, "head_dim": 128, "rms_norm_eps": 1e-05, "final_logit_softcapping": 50,
        "attn_logit_softcapping": 30.0, "router_logit_softcapping": 30.0, "rope_theta": 208533496,
        "attn_temperature_len": 1024, "sliding_window_size": -1, "global_attn_every_n": 1, "model_type": "git",
        "torch_dtype": "bfloat16", "rope_type": "original", "original_max_position_embeddings": 8192,
        "scaling_factor": 16.0, "extrapolation_factor": 1.0, "attn_factor": 1.0, "beta_fast": 8, "beta_slow": 1}
    assert config_from_hf(released, "config.json") == GROK_2


def test_the_gelu_and_the_pad_mask_follow_the_variant():
    """Grok-2 is read as sglang computes it: the erf GELU, no key masked by its id whatever its
    pad_token_id (docs/grok2.md §2, §11); Grok-1 keeps the tanh GELU and masks by the pad id its
    config names, by position where it names none."""
    from checkpoints.hf_layout import config_from_hf
    from checkpoints.native import config_from_json, config_to_json

    grok2 = config_from_hf(dict(hf_config(TINY_GROK2, "sglang"), pad_token_id=0), "config.json")
    assert (grok2.activation, grok2.pad_token) == ("gelu_erf", None)
    for naming in ("hpcai", "keyfan"):
        grok1 = hf_config(TINY, naming)
        assert config_from_hf(grok1, "config.json") == TINY  # gelu_tanh, pad_token 0
        del grok1["pad_token_id"]
        assert config_from_hf(grok1, "config.json").pad_token is None
    # a native config.json written before the field: Grok-2's is read as Grok-2, Grok-1's as it was
    old = config_to_json(TINY_GROK2)
    del old["activation"]
    assert config_from_json(dict(old, pad_token=0), "config.json") == TINY_GROK2
    old = config_to_json(TINY)
    del old["activation"]
    assert config_from_json(old, "config.json") == TINY


def test_a_bin_file_is_read_without_unpickling(tmp_path):
    """A .bin whose pickle names any other global (here os.system) is refused before anything runs,
    naming the file and the global; nothing is ever unpickled."""
    from tests.hf_writers import write_torch_bin

    path = tmp_path / "pytorch_model.bin"
    write_torch_bin(str(path), {"w": np.zeros((2, 2), np.float32)})
    from checkpoints.torch_zip import open_torch_zip

    assert open_torch_zip(str(path))["w"].shape == (2, 2)
    import zipfile

    with zipfile.ZipFile(path) as z:
        stream = z.read("pytorch_model/data.pkl")
    evil = stream.replace(b"ctorch._utils\n_rebuild_tensor_v2\n", b"cos\nsystem\n")
    with zipfile.ZipFile(tmp_path / "evil.bin", "w") as z:
        z.writestr("pytorch_model/data.pkl", evil)
        z.writestr("pytorch_model/data/0", b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"evil\.bin.*refusing global os\.system"):
        open_torch_zip(str(tmp_path / "evil.bin"))
    (tmp_path / "legacy.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(CheckpointError, match="legacy"):
        open_torch_zip(str(tmp_path / "legacy.bin"))


def test_a_corrupted_bin_is_an_error_naming_it_never_a_crash(tmp_path):
    """Bytes of the pickle flipped, cut or inserted: a CheckpointError naming the file, or (a flip
    that keeps it well formed) a load; never another exception."""
    import random
    import zipfile

    from checkpoints.torch_zip import open_torch_zip
    from tests.hf_writers import write_torch_bin

    good = tmp_path / "good.bin"
    write_torch_bin(str(good), {"a.weight": np.ones((4, 3), np.float32), "b": np.zeros(5, ml_dtypes.bfloat16)})
    with zipfile.ZipFile(good) as z:
        members = {name: z.read(name) for name in z.namelist()}
    stream = members["pytorch_model/data.pkl"]
    rng = random.Random(0)
    for i in range(300):
        data = bytearray(stream)
        where = rng.randrange(len(data))
        kind = i % 3
        if kind == 0:
            data[where] = rng.randrange(256)
        elif kind == 1:
            del data[where:]
        else:
            data[where:where] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        path = tmp_path / f"bad{i}.bin"
        with zipfile.ZipFile(path, "w") as z:
            for name, content in members.items():
                z.writestr(name, bytes(data) if name.endswith("data.pkl") else content)
        try:
            for tensor in open_torch_zip(str(path)).values():
                tensor.read()
        except CheckpointError as e:
            assert str(path) in str(e)
