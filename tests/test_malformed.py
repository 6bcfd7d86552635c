"""Every malformed checkpoint file, config and flag is one clear error naming it: never a crash, a
hang, another exception or a silent wrong load. Each case of issue 18 is a test here, and a fuzz
test mutates valid files thousands of times, loading each in a subprocess so a crash is caught."""

import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from checkpoints import CheckpointError, load_original, restore, save
from checkpoints.native import INDEX, config_from_json
from checkpoints.safe_pickle import read_pickled_tensor
from model import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a segmentation fault there is a failure here, not a crash."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


LOAD_ONE = """
import sys
from checkpoints.safe_pickle import CheckpointError, read_pickled_tensor
try:
    read_pickled_tensor(sys.argv[1] if len(sys.argv) > 1 else {path!r})
    print("LOADED")
except CheckpointError as e:
    print("CheckpointError:", e)
"""


# ---- the pickle interpreter --------------------------------------------------------------------
PICKLES = {
    # a dict keyed by 300,000 nested tuples: hashing it crashed CPython (exit 139)
    "nested tuple key": b"\x80\x04})" + b"\x85" * 300000 + b"Ns.",
    "REDUCE on an empty stack": b"\x80\x04R.",
    "SETITEM on an empty stack": b"\x80\x04s.",
    "BUILD on an empty stack": b"\x80\x04b.",
    "MEMOIZE on an empty stack": b"\x80\x04\x94.",
    "STACK_GLOBAL on an empty stack": b"\x80\x04\x93.",
    "an unhashable key": b"\x80\x04}]Ns.",
    "invalid UTF-8": b"\x80\x04\x8c\x02\xff\xfe.",
    "a string of 2**62 bytes": b"\x80\x04\x8d" + (2**62).to_bytes(8, "little") + b".",
    "nested tuples at STOP": b"\x80\x04)" + b"\x85" * 100000 + b".",
    "a list that holds itself": b"\x80\x04]\x94h\x00a" * 50 + b".",
}


@pytest.mark.parametrize("name", list(PICKLES))
def test_a_malformed_pickle_is_a_checkpoint_error_naming_file_and_offset(tmp_path, name):
    path = tmp_path / "tensor00000_000"
    path.write_bytes(PICKLES[name])
    done = run_isolated(LOAD_ONE.format(path=str(path)))
    assert done.returncode == 0, f"{name}: the process died ({done.returncode}): {done.stderr[-500:]}"
    assert done.stdout.startswith(f"CheckpointError: {path}:"), (name, done.stdout, done.stderr[-500:])
    assert "byte offset" in done.stdout or "truncated" in done.stdout


def _array_pickle(shape, dtype="i1", payload=b"") -> bytes:
    """A protocol-2 numpy array pickle with the given shape and raw payload, built by hand."""
    def short(s: str) -> bytes:
        return b"X" + struct.pack("<I", len(s)) + s.encode()
    dims = b"(" + b"".join(b"\x8a" + bytes([len(d.to_bytes(16, "little", signed=True))]) +
                           d.to_bytes(16, "little", signed=True) for d in shape) + b"t"
    return (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
            + b"(K\x01" + dims + b"cnumpy\ndtype\n" + short(dtype) + b"K\x00K\x01\x87R(K\x03" + short("|")
            + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89B" + struct.pack("<I", len(payload)) + payload
            + b"tb.")


def test_the_hand_built_array_pickle_is_valid(tmp_path):
    path = tmp_path / "t"
    path.write_bytes(_array_pickle((2, 3), "i1", bytes(range(6))))
    record = read_pickled_tensor(str(path))
    np.testing.assert_array_equal(record.read(), np.arange(6, dtype=np.int8).reshape(2, 3))


@pytest.mark.parametrize("shape", [(2**32, 2**32), (2**100,), (2**63, 2)])
def test_sizes_are_python_integers_checked_against_the_bytes_present(tmp_path, shape):
    path = tmp_path / "t"
    path.write_bytes(_array_pickle(shape))  # 0 bytes of data: int64 arithmetic wrapped to 0 here
    with pytest.raises(CheckpointError, match=f"{path}: array of shape"):
        read_pickled_tensor(str(path))


def test_a_fifo_in_place_of_a_tensor_file_is_an_error_not_a_hang(tmp_path):
    path = tmp_path / "tensor00000_000"
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        read_pickled_tensor(str(path))


# ---- the safetensors reader --------------------------------------------------------------------
@pytest.fixture
def native(tiny_params, tmp_path):
    save(str(tmp_path), jax.tree_util.tree_map(np.asarray, tiny_params), TINY)
    return tmp_path


def _shard(directory):
    return next(directory.glob("*.safetensors"))


def rewrite_header(path, fn):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = fn(json.loads(data[8:8 + length]))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (length - len(raw)) if len(raw) <= length else b""
    if len(raw) != length:  # keep the data where it was: the header must not grow
        raise AssertionError("the edited header is longer than the original")
    path.write_bytes(data[:8] + raw + data[8 + length:])


def _entries(header):
    return {k: v for k, v in header.items() if k != "__metadata__"}


def test_overlapping_data_offsets_are_refused(native):
    """Aliasing one norm onto another loaded silently and changed the model's output."""
    def alias(header):
        names = [n for n in _entries(header) if n.endswith("rms_norm/scale")]
        header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]
        return header
    rewrite_header(_shard(native), alias)
    with pytest.raises(CheckpointError, match="overlap in the data section"):
        restore(str(native))


@pytest.mark.parametrize("edit, message", [
    (lambda h: {**h, next(iter(_entries(h))): {**h[next(iter(_entries(h)))], "data_offsets": [-4, 0]}},
     "data_offsets must be two non-negative integers"),
    (lambda h: [1, 2, 3], "a JSON list, not an object"),
    (lambda h: {**h, next(iter(_entries(h))): {"dtype": "F32", "shape": [1]}}, "needs dtype, shape and data_offsets"),
    (lambda h: {**h, next(iter(_entries(h))): {**h[next(iter(_entries(h)))], "data_offsets": [0, 4, 8]}},
     "data_offsets must be two"),
    (lambda h: {**h, next(iter(_entries(h))): {**h[next(iter(_entries(h)))], "shape": "32"}},
     "shape must be a list of non-negative integers"),
    (lambda h: {**h, next(iter(_entries(h))): {**h[next(iter(_entries(h)))], "dtype": ["F32"]}},
     "unsupported dtype"),
])
def test_a_malformed_safetensors_header_names_the_file(native, edit, message):
    rewrite_header(_shard(native), edit)
    with pytest.raises(CheckpointError, match=message) as e:
        restore(str(native))
    assert str(_shard(native)) in str(e.value)


def test_an_index_whose_weight_map_is_not_an_object(native):
    (native / INDEX).write_text(json.dumps({"weight_map": ["a", "b"]}))
    with pytest.raises(CheckpointError, match="weight_map must be an object"):
        restore(str(native))
    (native / INDEX).write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="not a file name in the checkpoint directory"):
        restore(str(native))


@pytest.mark.parametrize("text, message", [("[]", "must be a JSON object, got list"),
                                           ("null", "must be a JSON object, got NoneType"),
                                           ('{"format": "llama.cpp/gguf"}', "is not this project's native format")])
def test_a_config_json_that_is_not_ours(native, text, message):
    (native / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        restore(str(native))


@pytest.mark.parametrize("which", ["config.json", "safetensors"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_an_error_not_a_hang(native, which):
    path = native / "config.json" if which == "config.json" else _shard(native)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        restore(str(native))


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.tok.json", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["a directory", "a broken link"])
def test_a_tokenizers_name_on_what_is_not_a_file_is_an_error_naming_it(native, name, kind):
    """Not skipped as if absent (the command would then say the checkpoint has no tokenizer):
    refused, named, before a tensor is read."""
    from checkpoints.restore import inspect

    path = native / name
    path.mkdir() if kind == "a directory" else path.symlink_to(native / "nowhere")
    message = "tokenizer is a directory, not a regular file" if kind == "a directory" else "cannot read tokenizer"
    with pytest.raises(CheckpointError, match=f"{path}: {message}"):
        inspect(str(native))


def test_a_directory_for_grok1s_tokenizer_beside_ckpt0_is_an_error_naming_it(reference_dir, tmp_path):
    (tmp_path / "ckpt-0").symlink_to(reference_dir / "ckpt" / "ckpt-0")
    (tmp_path / "tokenizer.model").mkdir()
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'tokenizer.model'}: tokenizer is a directory"):
        restore(str(tmp_path), config="grok-1-reference-tiny")


# ---- configs ------------------------------------------------------------------------------------
def test_load_original_takes_a_preset_a_json_file_or_a_config(reference_dir, tmp_path):
    from checkpoints.native import config_to_json
    from model import GROK_1_REFERENCE_TINY

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(config_to_json(GROK_1_REFERENCE_TINY)))
    by_path = load_original(str(reference_dir / "ckpt"), str(path))
    by_name = load_original(str(reference_dir / "ckpt"), "grok-1-reference-tiny")
    assert jax.tree_util.tree_structure(by_path) == jax.tree_util.tree_structure(by_name)


def test_ffn_size_in_json_is_accepted_when_it_is_the_derived_width():
    data = {k: v for k, v in vars(TINY).items()}
    assert config_from_json({**data, "ffn_size": TINY.ffn_size}, "c.json") == TINY
    with pytest.raises(CheckpointError, match=f"ffn_size 100 differs .* {TINY.ffn_size}"):
        config_from_json({**data, "ffn_size": 100}, "c.json")


def test_a_config_mismatch_names_each_field_with_both_values(native):
    other = TINY.__class__(**{**vars(TINY), "num_layers": TINY.num_layers + 1, "rope_base": 5.0})
    with pytest.raises(CheckpointError, match=r"num_layers 2 != 3, .*rope_base 10000.0 != 5.0"):
        restore(str(native), config=other)


# ---- run.py -------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--max-tokens", "-1"], "--max-tokens"), (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"), (["--top-k", "-1"], "--top-k"), (["--seed", "-1"], "--seed"),
    (["--prompt", ""], "--prompt"), (["--top-k", "3000000000"], "--top-k"), (["--batch-size", "0"], "--batch-size"),
    (["--mesh", "1,x"], "--mesh"), (["--mesh", "0,1"], "--mesh"),
])
def test_an_invalid_flag_is_one_error_line_and_exit_2_before_loading(flags, named):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "run.py", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-800:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("run.py: error: ") and named in last, done.stderr[-800:]
    assert "Traceback" not in done.stderr and "restore" not in done.stderr  # nothing was loaded


def test_a_mesh_on_too_few_devices_says_how_many_it_needs_and_how_to_get_them():
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "run.py", "--mesh", "1,8", "--max-tokens", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "needs data x model = 8 devices, and 1 is given" in done.stderr
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in done.stderr


@pytest.mark.slow
def test_crlf_prompts_lose_the_cr_and_ctrl_c_ends_with_the_summary_and_exit_130(tmp_path):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    crlf = subprocess.run([sys.executable, "run.py", "--max-tokens", "2", "--temperature", "0"], cwd=ROOT, env=env,
                          input="It is a truth\r\nEmma\r\n", capture_output=True, text=True, timeout=300)
    assert crlf.returncode == 0 and "\r" not in crlf.stdout and "[0] It is a truth" in crlf.stdout
    # Ctrl-C while prompts are still generated, whatever the machine's speed: 400 prompts of 200
    # tokens print far more than a pipe holds (64 KiB), so the command blocks writing until the
    # test reads on and cannot finish first (one streamed prompt of 200 tokens could: the kernels
    # decode it in a fifth of a second, less than a loaded machine may take to send the signal)
    (tmp_path / "prompts.txt").write_text("It is\n" * 400)
    with open(tmp_path / "prompts.txt") as prompts:
        job = subprocess.Popen([sys.executable, "run.py", "--max-tokens", "200"], cwd=ROOT, env=env, stdin=prompts,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.read(5) == "[0] I"  # the first prompt's text
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 130 and "Traceback" not in err and "interrupted: time to first token" in err


# ---- fuzz ---------------------------------------------------------------------------------------
FUZZ = """
import os, random, sys, json, struct
import numpy as np
from checkpoints.safe_pickle import CheckpointError, read_pickled_tensor
from checkpoints.native import read_header
seeds, kind, source, scratch = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
base = open(source, "rb").read()
for seed in range(seeds, seeds + int(sys.argv[5])):
    rng = random.Random(seed)
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        how = rng.choice(["truncate", "flip", "insert", "huge", "nest", "delete"])
        limit = len(data) if kind == "pickle" else min(len(data), 8 + struct.unpack("<Q", base[:8])[0])
        at = rng.randrange(max(1, limit))
        if how == "truncate":
            del data[rng.randrange(len(data) + 1):]
        elif how == "flip":
            if data: data[min(at, len(data) - 1)] = rng.randrange(256)
        elif how == "insert":
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif how == "huge":
            data[at:at + 8] = rng.choice([2**63 - 1, 2**62, 2**32, 2**31]).to_bytes(8, "little")
        elif how == "nest":
            data[at:at] = rng.choice([b"(", b")", b"]", b"}", b"\\x85", b"[", b"{"]) * rng.randint(10, 5000)
        else:
            del data[at:at + rng.randint(1, 16)]
    path = os.path.join(scratch, f"case{seed}")
    open(path, "wb").write(bytes(data))
    print(f"CASE {seed}", flush=True)
    try:
        if kind == "pickle":
            record = read_pickled_tensor(path)
            for r in (record.weight, record.scales) if hasattr(record, "scales") else (record,):
                r.read()
        else:
            header, start = read_header(path)
        print("LOADED", flush=True)
    except CheckpointError:
        print("REFUSED", flush=True)
    except BaseException as e:
        print(f"OTHER {type(e).__name__}: {str(e)[:200]}", flush=True)
    os.unlink(path)
print("DONE", flush=True)
"""


def fuzz(kind: str, source: str, scratch: str, cases: int, per_process: int = 500) -> dict:
    outcomes = {"LOADED": 0, "REFUSED": 0}
    for first in range(0, cases, per_process):
        done = subprocess.run(
            [sys.executable, "-c", FUZZ, str(first), kind, source, scratch, str(min(per_process, cases - first))],
            cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""), capture_output=True, text=True,
            timeout=600)
        lines = done.stdout.splitlines()
        last_case = next((line for line in reversed(lines) if line.startswith("CASE")), None)
        assert done.returncode == 0 and lines and lines[-1] == "DONE", (
            f"{kind} fuzz: the process died ({done.returncode}) at {last_case}: {done.stderr[-800:]}")
        others = [line for line in lines if line.startswith("OTHER")]
        assert not others, f"{kind} fuzz: not a CheckpointError: {others[:5]}"
        for outcome in outcomes:
            outcomes[outcome] += lines.count(outcome)
    assert sum(outcomes.values()) == cases
    return outcomes


@pytest.fixture(scope="module")
def fuzz_sources(tmp_path_factory, tiny_params):
    """A float array pickle, an int8 one, and a safetensors file of the tiny model."""
    d = tmp_path_factory.mktemp("fuzz")
    for protocol in (2, 4):
        (d / f"f32-p{protocol}").write_bytes(pickle.dumps(np.arange(24, dtype=np.float32).reshape(4, 6), protocol))
    (d / "i8").write_bytes(pickle.dumps(np.arange(-12, 12, dtype=np.int8).reshape(2, 12), 4))
    save(str(d / "native"), jax.tree_util.tree_map(np.asarray, tiny_params), TINY)
    return d


@pytest.mark.parametrize("source, cases", [("f32-p2", 500), ("f32-p4", 500), ("i8", 500), ("safetensors", 1000)])
def test_fuzzed_files_load_cleanly_or_are_refused(fuzz_sources, tmp_path, source, cases):
    path = next((fuzz_sources / "native").glob("*.safetensors")) if source == "safetensors" else fuzz_sources / source
    outcomes = fuzz("safetensors" if source == "safetensors" else "pickle", str(path), str(tmp_path), cases)
    assert outcomes["REFUSED"] > cases // 2  # most mutations break the file, and are refused


@pytest.mark.slow
@pytest.mark.parametrize("source", ["f32-p4", "safetensors"])
def test_fuzzed_files_many_more(fuzz_sources, tmp_path, source):
    path = next((fuzz_sources / "native").glob("*.safetensors")) if source == "safetensors" else fuzz_sources / source
    fuzz("safetensors" if source == "safetensors" else "pickle", str(path), str(tmp_path), 20000)
