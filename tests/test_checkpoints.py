"""Checkpoints: native save/restore, the original-layout importer, the converter, sharded restore
and the errors each bad input must raise."""

import dataclasses
import json
import os
import pickle
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import CheckpointError, open_native, restore, save
from checkpoints.convert import convert
from cli.main import main as command
from checkpoints.lazy import LazyTensor
from checkpoints.materialize import materialize
from backends import XLA
from model import GROK_1_REFERENCE_TINY, TINY, QuantizedWeight8bit, forward
from model.quant import dequantize
from model.sharding import make_mesh
from model.transformer import layers_apart
from tests.test_quant import quantize_params

FIXTURE = dataclasses.replace(GROK_1_REFERENCE_TINY, fprop_dtype="float32")


def leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def assert_trees_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


@pytest.fixture(scope="module")
def converted(reference_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("native") / "fixture"
    convert(str(reference_dir / "ckpt"), str(dst), "grok-1-reference-tiny", progress=False)
    return dst


@pytest.fixture(scope="module")
def imported(reference_dir):
    return restore(str(reference_dir / "ckpt"), config=FIXTURE)


def test_native_round_trip_keeps_dtypes(tiny_params, tmp_path):
    params = quantize_params(tiny_params, groups=2)
    params["transformer"]["layers"]["rms_norm"]["scale"] = (
        params["transformer"]["layers"]["rms_norm"]["scale"].astype(jnp.bfloat16))
    save(str(tmp_path), params, TINY, max_shard_bytes=20_000)  # forces several files
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    restored = restore(str(tmp_path))
    assert restored.config == TINY and restored.tokenizer_path is None
    assert_trees_equal(restored.params, params)


def test_imported_and_converted_fixture_are_identical(reference_dir, converted, imported):
    native = restore(str(converted))
    assert native.config == GROK_1_REFERENCE_TINY
    assert_trees_equal(native.params, imported.params)
    tokens = np.load(reference_dir / "tokens_full.npy")
    a = forward(imported.params, tokens, FIXTURE, backend=XLA()).logits
    b = forward(native.params, tokens, FIXTURE, backend=XLA()).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_restore_on_one_cpu_device_reads_each_weight_once(tiny_params, tmp_path, monkeypatch):
    """Every float weight is read from the file straight into the memory its device array then
    uses (no copy after the read), and holds what was saved."""
    import checkpoints.lazy
    import model.host

    save(str(tmp_path), tiny_params, TINY, max_shard_bytes=20_000)
    allocated = []

    def recording(shape, dtype=np.float32, huge=False):
        out = model.host.host_empty(shape, dtype, huge)
        allocated.append(out)
        return out

    monkeypatch.setattr(checkpoints.lazy, "host_empty", recording)
    restored = restore(str(tmp_path), mesh=make_mesh((1, 1), jax.devices()[:1]))
    read = {a.ctypes.data for a in allocated}
    for path, leaf in leaves(restored.params):
        assert leaf.unsafe_buffer_pointer() in read, path
    assert_trees_equal(restored.params, tiny_params)


def test_a_stacked_tensor_reads_whole_parts_and_slices_alike(tmp_path):
    """The stacked layers read their parts straight into the stack when a read covers each part
    whole, and slice by slice otherwise: both give the same values."""
    from checkpoints.lazy import stacked
    from checkpoints.native import _lazy

    rng = np.random.default_rng(0)
    parts, arrays = [], []
    for i in range(3):
        a = rng.standard_normal((5, 7)).astype(np.float32)
        file = tmp_path / f"{i}.bin"
        file.write_bytes(b"x" * 13 + a.tobytes())  # the data at an odd offset
        parts.append(_lazy(str(file), f"w{i}", {"dtype": "F32", "shape": [5, 7], "data_offsets": [0, a.nbytes]}, 13))
        arrays.append(a)
    stack = stacked(parts, "stack")
    np.testing.assert_array_equal(stack.read(), np.stack(arrays))
    np.testing.assert_array_equal(stack.read((slice(1, 3),)), np.stack(arrays)[1:3])
    np.testing.assert_array_equal(stack.read((slice(0, 3), slice(2, 4), slice(1, 6))), np.stack(arrays)[:, 2:4, 1:6])
    (tmp_path / "2.bin").write_bytes(b"x" * 13 + arrays[2].tobytes()[:40])  # cut short after it was opened
    with pytest.raises(CheckpointError, match="2.bin.*truncated"):
        stack.read()


@pytest.mark.parametrize("shape", [(1, 1), (1, 8), (2, 4)])
def test_restore_onto_meshes_gives_identical_logits(reference_dir, converted, imported, shape):
    mesh = make_mesh(shape, jax.devices()[: shape[0] * shape[1]])
    restored = restore(str(converted), mesh=mesh, dtype=jnp.float32)
    q = restored.params["transformer"]["layers"]["moe"]["linear_1"]["w"]  # every layer's, stacked
    assert q.weight.sharding.mesh.shape == mesh.shape
    assert q.weight.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", "data")
    tokens = np.load(reference_dir / "tokens_full.npy")
    want = np.asarray(forward(imported.params, tokens, FIXTURE, backend=XLA()).logits)
    with jax.set_mesh(mesh):
        got = np.asarray(forward(restored.params, tokens, FIXTURE, backend=XLA()).logits)
    # Sharded contractions sum in another order; through 12 layers of random int8 weights that
    # moves logits of magnitude ~16 by up to ~6e-5 (the reference itself differs from an exact
    # re-implementation by as much). Equal up to that, and the same argmax everywhere.
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_each_device_reads_only_its_own_slice():
    from checkpoints.materialize import disk_shapes

    reads = []
    sources = {}
    for name, shape in disk_shapes(FIXTURE).items():
        sources[name] = LazyTensor(name, shape, np.dtype(np.float32),
                                   lambda index, shape=shape: np.zeros(shape, np.float32)[index])
    name = "transformer/decoder_layer_0/moe/linear/w"
    full = np.arange(8 * 64 * 344, dtype=np.float32).reshape(8, 64, 344)
    sources[name] = LazyTensor(name, full.shape, full.dtype, lambda index: reads.append(index) or full[index])
    mesh = make_mesh((2, 4))
    params = materialize(sources, FIXTURE, mesh=mesh)
    w = params["transformer"]["layers"]["moe"]["linear"]["w"]  # layer 0's file, stacked with the others
    np.testing.assert_array_equal(np.asarray(w[0]), full)
    assert len(reads) == 8
    for index in reads:  # P(None, None, "data", "model"): 64/2 rows x 344/4 columns per device
        assert full[index].shape == (8, 32, 86)


def test_dequantize_and_cast_at_load(converted, imported):
    restored = restore(str(converted), mesh=make_mesh((2, 4)), dequantize=True)
    w = restored.params["transformer"]["layers"]["multi_head_attention"]["linear"]["w"]
    q = imported.params["transformer"]["layers"]["multi_head_attention"]["linear"]["w"]
    assert w.dtype == jnp.float32 and not isinstance(w, QuantizedWeight8bit)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(dequantize(q, jnp.float32)))
    bf16 = restore(str(converted), dtype=jnp.bfloat16)
    emb = bf16.params["language_model"]["in_out_embed"]["embeddings"]
    assert emb.dtype == jnp.bfloat16


def test_a_malicious_tensor_file_is_refused_and_never_runs(reference_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_dir / "ckpt", ckpt)
    marker = tmp_path / "pwned"
    victim = ckpt / "ckpt-0" / "tensor00007_000"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    victim.write_bytes(pickle.dumps(Evil(), protocol=4))
    with pytest.raises(CheckpointError, match=r"tensor00007_000: refusing global (posix|os)\.system"):
        restore(str(ckpt), config=FIXTURE)
    assert not marker.exists()


# ---- errors --------------------------------------------------------------------------------
def test_missing_directory_and_files(reference_dir, converted, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        restore(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="neither a native"):
        restore(str(tmp_path))
    with pytest.raises(CheckpointError, match="stores no config"):
        restore(str(reference_dir / "ckpt"))
    ckpt = tmp_path / "orig"
    shutil.copytree(reference_dir / "ckpt", ckpt)
    (ckpt / "ckpt-0" / "tensor00042_000").unlink()
    with pytest.raises(CheckpointError, match=r"tensor00042_000: missing \(expected parameter transformer/"):
        restore(str(ckpt), config=FIXTURE)
    native = tmp_path / "native"
    shutil.copytree(converted, native)
    (native / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors: missing"):
        restore(str(native))


def test_wrong_config_for_original_layout(reference_dir):
    fewer = dataclasses.replace(FIXTURE, num_layers=11)
    with pytest.raises(CheckpointError, match="unexpected tensor file"):
        restore(str(reference_dir / "ckpt"), config=fewer)
    wider = dataclasses.replace(FIXTURE, vocab_size=4096)
    with pytest.raises(CheckpointError, match=r"in_out_embed/embeddings.*expected \(4096, 64\), found \(12288, 64\)"):
        restore(str(reference_dir / "ckpt"), config=wider)


def edit_index(directory, fn):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    fn(index["weight_map"])
    path.write_text(json.dumps(index))


def test_missing_and_unexpected_tensors_are_named(tiny_params, tmp_path):
    save(str(tmp_path / "a"), tiny_params, TINY)
    edit_index(tmp_path / "a", lambda m: m.pop("transformer/decoder_layer_1/router/w"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['transformer/decoder_layer_1/router/w'\]"):
        restore(str(tmp_path / "a"))
    extra = dict(tiny_params, extra={"bias": jnp.zeros(3)})
    save(str(tmp_path / "b"), extra, TINY)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['extra/bias'\]"):
        restore(str(tmp_path / "b"))


def test_shape_and_dtype_mismatches_name_tensor_expected_and_found(tiny_params, tmp_path):
    bad = layers_apart(tiny_params)  # as a file names them: one tensor a layer
    bad["transformer"]["decoder_layer_0"]["router"]["w"] = jnp.zeros((TINY.emb_size, 3))
    save(str(tmp_path / "shape"), bad, TINY)
    with pytest.raises(CheckpointError, match=r"decoder_layer_0/router/w .*shape mismatch, expected \(32, 4\), found \(32, 3\)"):
        restore(str(tmp_path / "shape"))
    bad = layers_apart(tiny_params)  # one layer's tensor in another dtype than the others': not one stack
    bad["transformer"]["decoder_layer_1"]["router"]["w"] = bad["transformer"]["decoder_layer_1"]["router"]["w"].astype(
        jnp.bfloat16)
    save(str(tmp_path / "layers"), bad, TINY)
    with pytest.raises(CheckpointError, match=r"decoder_layer_1/router/w.*bfloat16 differs from .*decoder_layer_0/router/w"):
        restore(str(tmp_path / "layers"))
    bad = jax.tree_util.tree_map(lambda x: x, tiny_params)
    bad["language_model"]["rms_norm"]["scale"] = jnp.ones(TINY.emb_size, jnp.int8)
    save(str(tmp_path / "dtype"), bad, TINY)
    with pytest.raises(CheckpointError, match=r"language_model/rms_norm/scale .*dtype mismatch, expected a float dtype, found int8"):
        restore(str(tmp_path / "dtype"))


def test_truncated_and_corrupted_files(tiny_params, tmp_path):
    save(str(tmp_path / "t"), tiny_params, TINY)
    data_file = tmp_path / "t" / "model-00001-of-00001.safetensors"
    raw = data_file.read_bytes()
    data_file.write_bytes(raw[:-100])
    with pytest.raises(CheckpointError, match="truncated file"):
        restore(str(tmp_path / "t"))
    data_file.write_bytes(raw[:8] + b"\x00garbage" + raw[16:])
    with pytest.raises(CheckpointError, match="corrupted safetensors header"):
        restore(str(tmp_path / "t"))
    data_file.write_bytes(b"\xff" * 8 + raw[8:])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        restore(str(tmp_path / "t"))
    (tmp_path / "t" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config is not valid JSON"):
        restore(str(tmp_path / "t"))


def test_tokenizer_vocabulary_must_match_the_config(tiny_params, tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    save(str(tmp_path / "ckpt"), tiny_params, TINY, tokenizer=str(tmp_path / "sp.model"))
    with pytest.raises(CheckpointError, match="300 pieces but the config's vocab_size is 256"):
        restore(str(tmp_path / "ckpt"))
    config, _, tokenizer = open_native(str(tmp_path / "ckpt"))
    assert tokenizer.endswith("tokenizer.model") and config == TINY


def test_convert_cli_reports_errors(reference_dir, tmp_path, capsys):
    assert command(["convert", str(reference_dir / "ckpt"), str(tmp_path / "out"), "--config", "no-such"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dataclasses.asdict(GROK_1_REFERENCE_TINY)))
    assert command(["convert", str(reference_dir / "ckpt"), str(tmp_path / "out"), "--config", str(cfg)]) == 0
    assert restore(str(tmp_path / "out")).config == GROK_1_REFERENCE_TINY


def test_python_m_checkpoints_convert_is_the_convert_command(tiny_params, tmp_path):
    """The documented command before ``grok-runner convert`` exited 0 and wrote nothing."""
    import subprocess
    import sys

    from tests.helpers import REPO
    from tests.test_command import CPU_ENV

    save(str(tmp_path / "src"), jax.device_get(tiny_params), TINY)
    done = subprocess.run([sys.executable, "-m", "checkpoints.convert", str(tmp_path / "src"), str(tmp_path / "dst")],
                          cwd=REPO, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"wrote {tmp_path / 'dst'}" in done.stderr, done.stderr
    restored = restore(str(tmp_path / "dst"))
    assert restored.config == TINY
    assert_trees_equal(restored.params, tiny_params)
    done = subprocess.run([sys.executable, "-m", "checkpoints.convert", str(tmp_path / "nowhere"), str(tmp_path / "x")],
                          cwd=REPO, env=CPU_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "checkpoint directory does not exist" in done.stderr, done.stderr
    assert not (tmp_path / "x").exists()
