"""Hostile Hugging Face directories (issue 53): each kind of lie a file can tell is one
``CheckpointError`` on one line naming the file (and the tensor or key), raised before anything
large is read or allocated; ``grok-runner convert`` prints it and exits 2, never a traceback.
The directories are written here, tiny (tests/hf_writers.py)."""

import json
import os
import struct
import subprocess
import sys
import zipfile

import jax
import numpy as np
import pytest

from checkpoints import CheckpointError
from checkpoints.convert import convert
from checkpoints.restore import inspect
from checkpoints.torch_zip import open_torch_zip
from untrusted import JSON_BYTES, MAX_DIMENSION, SHOWN_CHARS, shown
from model import TINY, init_params
from tests.hf_writers import _write, hf_config, hf_tensors, write_torch_bin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "checkpoints", "austen-moe", "tokenizer.model")
Q_PROJ = "model.layers.0.attn.q_proj.weight"  # hpcai-tech's naming (tests/hf_writers.py)


@pytest.fixture(scope="module")
def tensors():
    return hf_tensors(init_params(TINY, jax.random.PRNGKey(53)), TINY, "hpcai")


def hf_dir(path, tensors, config=None, bin=False) -> str:
    """A Hugging Face directory of ``tensors`` (one file) and ``config`` (hpcai-tech's keys)."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config or hf_config(TINY, "hpcai"), f)
    if bin:
        write_torch_bin(os.path.join(path, "pytorch_model-00001-of-00001.bin"), tensors)
    else:
        _write(os.path.join(path, "model-00001-of-00001.safetensors"), tensors)
    return str(path)


def one_line(call, *words) -> str:
    """``call()``'s CheckpointError: one line of bounded length holding each of ``words``."""
    with pytest.raises(CheckpointError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message and len(message) < 4 * SHOWN_CHARS + 400, message[:500]
    for word in words:
        assert word in message, (word, message)
    return message


def test_shown_escapes_control_characters_and_cuts_long_text():
    assert shown("os\nsystem\x1b[2J") == "os\\nsystem\\x1b[2J"
    cut = shown("x" * 100_000)
    assert cut.startswith("x" * SHOWN_CHARS + "...") and "99,800 more characters" in cut
    assert shown("plain name") == "plain name"


EXPERT = "model.layers.0.moe_block.experts.1.linear.weight"


@pytest.mark.parametrize("bin", [False, True], ids=["safetensors", "bin"])
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("name", [Q_PROJ, EXPERT], ids=["q_proj", "expert"])
def test_a_matrix_of_another_rank_names_the_file_and_tensor(tensors, tmp_path, rank, bin, name):
    """A projection or an expert given as a vector or a 3-D array (a bare ValueError from the
    lazy transpose before): the converter's error names the file and the tensor."""
    bad = dict(tensors)
    w = tensors[name]
    bad[name] = w.reshape(-1) if rank == 1 else w.reshape(w.shape[0], -1, 2)
    src = hf_dir(tmp_path / "hf", bad, bin=bin)
    one_line(lambda: convert(src, str(tmp_path / "out"), tokenizer=TOKENIZER, progress=False),
             src, name.rsplit(".", 2)[0])
    assert not os.path.exists(tmp_path / "out" / "config.json")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_shard_of_another_rank_names_its_file(tmp_path, rank):
    """Grok-2's experts split over TP files: a shard given as a scalar or a vector cannot be
    joined (a bare ValueError or a ZeroDivisionError before)."""
    from model import TINY_GROK2

    tensors = hf_tensors(init_params(TINY_GROK2, jax.random.PRNGKey(7)), TINY_GROK2, "sglang")
    src = tmp_path / "hf"
    os.makedirs(src)
    with open(src / "config.json", "w") as f:
        json.dump(hf_config(TINY_GROK2, "sglang"), f)
    common, shards = {}, [{}, {}]
    for name, array in tensors.items():
        kind = name.rsplit(".", 2)[-2]
        if ".experts." in name and kind in ("w1", "w3", "w2"):
            for r, piece in enumerate(np.split(array, 2, axis=1 if kind == "w2" else 0)):
                shards[r][name] = np.ascontiguousarray(piece)
        else:
            common[name] = array
    w1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    shards[1][w1] = shards[1][w1].reshape(-1)[:1].reshape(()) if rank == 0 else shards[1][w1].reshape(-1)
    _write(str(src / "pytorch_model-00001-TP-common.safetensors"), common)
    for r, shard in enumerate(shards):
        _write(str(src / f"pytorch_model-00001-TP-{r:03d}.safetensors"), shard)
    one_line(lambda: inspect(str(src)), "TP-00", "w1")


@pytest.mark.parametrize("key, value", [("hidden_size", -32), ("head_dim", 10 ** 12), ("num_hidden_layers", 0),
                                        ("vocab_size", 10 ** 40), ("num_attention_heads", MAX_DIMENSION + 1),
                                        ("max_position_embeddings", -1)])
def test_a_config_size_out_of_range_names_the_key_before_any_arithmetic(tensors, tmp_path, key, value):
    """Sizes are checked before use (``hidden_size: -32`` reached ``math.sqrt``, ``head_dim:
    10**12`` an OverflowError while building the model)."""
    config = hf_config(TINY, "hpcai")
    config[key] = value
    src = hf_dir(tmp_path / "hf", tensors, config)
    message = one_line(lambda: inspect(src), "config.json", key, f"1 to {MAX_DIMENSION:,}")
    assert len(message) < 300


def test_a_config_json_with_an_integer_too_long_to_read_names_the_file(tensors, tmp_path):
    """Python refuses to read an integer of over 4,300 digits with a plain ValueError (not a JSON
    error): it escaped the JSON readers as a traceback."""
    src = hf_dir(tmp_path / "hf", tensors)
    text = open(os.path.join(src, "config.json")).read()
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write(text.replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ", \"was\": ", 1))
    one_line(lambda: inspect(src), "config.json", "not valid JSON")


def test_a_config_json_past_its_limit_is_refused_unread(tensors, tmp_path):
    src = hf_dir(tmp_path / "hf", tensors)
    with open(os.path.join(src, "config.json"), "a") as f:  # valid JSON still: trailing blanks
        f.truncate(JSON_BYTES + 1)
        f.seek(0, os.SEEK_END)
    with open(os.path.join(src, "config.json"), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(src, "config.json")) - 1)
        data = f.read(1)
    assert data == b"\0"  # sparse: nothing was written to make it
    one_line(lambda: inspect(src), "config.json", "JSON_BYTES")


def test_an_unexpected_tensor_with_a_huge_name_is_shown_cut(tensors, tmp_path):
    bad = dict(tensors)
    bad["model.extra." + "x" * 50_000] = np.zeros((2,), np.float32)
    src = hf_dir(tmp_path / "hf", bad)
    one_line(lambda: inspect(src), src, "model.extra.", "more characters")


def test_a_tiktoken_vocabulary_past_max_vocab_is_refused(tmp_path, monkeypatch):
    """A tiktoken file of 10 million entries ended in a MemoryError traceback: it lists at most
    MAX_VOCAB tokens (lowered here below the test vocabulary's 512)."""
    import untrusted
    from tests.tokenizer_files import write_tiktoken_json
    from tokenization import load_tokenizer

    path = write_tiktoken_json(tmp_path)
    monkeypatch.setattr(untrusted, "MAX_VOCAB", 300)
    with pytest.raises(ValueError, match=r"tokenizer\.tok\.json: regular_tokens lists .* more than MAX_VOCAB"):
        load_tokenizer(path)


def _rewritten(path, members):
    """The archive at ``path`` rewritten with ``members`` ([(name, bytes)], in order, stored)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data)


def test_a_bin_member_whose_bytes_lie_past_the_end_is_refused(tmp_path):
    """A storage whose central-directory size (and the pickle's element count) claim more bytes
    than the file holds: np.memmap's error without the file's name before."""
    path = str(tmp_path / "pytorch_model.bin")
    numel = 250_004
    write_torch_bin(path, {"w": np.zeros((numel,), np.float32)})
    with zipfile.ZipFile(path) as z:
        members = [(info.filename, z.read(info)) for info in z.infolist()]
    members = [(n, b"\0" * 16 if n == "pytorch_model/data/0" else d) for n, d in members]
    _rewritten(path, members)
    blob = bytearray(open(path, "rb").read())
    entry = blob.find(b"PK\x01\x02")
    while entry >= 0:  # the storage's central-directory entry: both sizes patched to the pickle's claim
        name_len = struct.unpack("<H", blob[entry + 28:entry + 30])[0]
        if blob[entry + 46:entry + 46 + name_len] == b"pytorch_model/data/0":
            blob[entry + 20:entry + 28] = struct.pack("<II", numel * 4, numel * 4)
            break
        entry = blob.find(b"PK\x01\x02", entry + 46)
    assert entry >= 0
    open(path, "wb").write(bytes(blob))
    one_line(lambda: open_torch_zip(path), path, "pytorch_model/data/0", "past the end of the file")


def test_a_bin_with_a_member_twice_is_refused(tmp_path):
    path = str(tmp_path / "pytorch_model.bin")
    write_torch_bin(path, {"w": np.zeros((2, 2), np.float32)})
    with zipfile.ZipFile(path) as z:
        members = [(info.filename, z.read(info)) for info in z.infolist()]
    with pytest.warns(UserWarning, match="Duplicate name"):
        _rewritten(path, members + [("pytorch_model/data/0", b"\1" * 16)])
    one_line(lambda: open_torch_zip(path), path, "pytorch_model/data/0", "more than once")


def test_a_global_named_with_a_newline_is_shown_escaped_on_one_line(tmp_path):
    """STACK_GLOBAL takes its names from strings, which may hold a newline: printed raw, it
    forged a second log line."""
    def text(s):
        data = s.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE

    stream = b"\x80\x04" + text("os\nerror: INJECTED") + text("system") + b"\x93."
    path = str(tmp_path / "pytorch_model.bin")
    _rewritten(path, [("pytorch_model/data.pkl", stream)])
    one_line(lambda: open_torch_zip(path), path, "refusing global os\\nerror: INJECTED.system")


def test_convert_prints_one_error_line_and_exits_2(tensors, tmp_path):
    bad = dict(tensors)
    bad[Q_PROJ] = tensors[Q_PROJ].reshape(-1)
    src = hf_dir(tmp_path / "hf", bad, bin=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "run.py"), "convert", src, str(tmp_path / "out"),
                           "--tokenizer", TOKENIZER], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    assert src in lines[0] and "q_proj" in lines[0]


def test_a_pickle_memoising_without_end_is_refused_at_the_limit(tmp_path):
    """36 MB of MEMOIZE opcodes grew the memo table without bound: at MAX_MEMO it stops."""
    from checkpoints.safe_pickle import read_pickled_tensor
    from untrusted import MAX_MEMO

    path = tmp_path / "tensor00000_000"
    path.write_bytes(b"\x80\x04N" + b"\x94" * (MAX_MEMO + 1) + b".")  # None, memoised again and again
    one_line(lambda: read_pickled_tensor(str(path)), str(path), "MAX_MEMO")


def test_headers_are_bounded_across_the_files_of_a_checkpoint(tensors, tmp_path, monkeypatch):
    """Each file's header passed its own cap and all were kept: their sum is bounded too
    (HEADERS_BYTES, lowered here to what two of these small files exceed)."""
    import checkpoints.hf_layout

    src = hf_dir(tmp_path / "hf", tensors)
    names = list(tensors)
    os.remove(os.path.join(src, "model-00001-of-00001.safetensors"))
    for n in range(2):
        _write(os.path.join(src, f"model-0000{n + 1}-of-00002.safetensors"), {k: tensors[k] for k in names[n::2]})
    inspect(src)  # within the real limit
    sizes = [struct.unpack("<Q", open(os.path.join(src, f"model-0000{n + 1}-of-00002.safetensors"), "rb").read(8))[0]
             for n in range(2)]
    monkeypatch.setattr(checkpoints.hf_layout, "HEADERS_BYTES", sizes[0] + sizes[1] // 2)
    one_line(lambda: inspect(src), "model-00002-of-00002.safetensors", "HEADERS_BYTES")
