"""The native checkpoint format: a directory with ``config.json``, the weights as safetensors, and
optionally ``tokenizer.model``.

    <dir>/config.json                         ModelConfig fields + {"format": "grok1-jax-runner/1"}
    <dir>/model.safetensors.index.json        {"weight_map": {tensor name: file}}
    <dir>/model-00001-of-0000N.safetensors    tensors, <= max_shard_bytes per file
    <dir>/tokenizer.model                     optional tokenizer: a SentencePiece model, or
    <dir>/tokenizer.json, tokenizer.tok.json    a Hugging Face or Grok-2 (tiktoken) JSON one

Tensor names are parameter paths (``transformer/decoder_layer_0/moe/linear/w``); an int8 weight is
two tensors, ``.../w/weight`` (int8) and ``.../w/scales``. Every tensor keeps its stored dtype
(bf16 stays bf16). safetensors holds no code, and its header gives each tensor's offset, so a
reader slices tensors without reading whole files. Files are written here tensor by tensor
(header first, then the bytes streamed), so converting a 318 GB checkpoint never holds more than
one tensor's chunk in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import jax
import ml_dtypes
import numpy as np

from checkpoints.lazy import LazyQuantized, LazyTensor
from untrusted import (HEADER_BYTES, HEADERS_BYTES, CheckpointError, Spent, read_json,
                                   regular_file)
from model.config import ModelConfig
from model.host import host_copy
from model.sharding import path_str
from model.tree import STACKED, layer_name

FORMAT = "grok1-jax-runner/1"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"

_ST_DTYPES = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64", np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
    np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.int16): "I16",
}
_NP_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


# ---- config ------------------------------------------------------------------------------
def config_to_json(config: ModelConfig) -> dict:
    return {"format": FORMAT, **dataclasses.asdict(config)}


def config_from_json(data: dict, source: str) -> ModelConfig:
    if not isinstance(data, dict):
        raise CheckpointError(f"{source}: a config must be a JSON object, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    data = dict(data)
    ffn = data.pop("ffn_size", None)  # derived from emb_size and widening_factor; accepted when it agrees
    unknown = sorted(str(k)[:80] for k in set(data) - fields - {"format"})
    if unknown:
        raise CheckpointError(f"{source}: unknown config fields {unknown}")
    if data.get("variant") == "grok-2" and "activation" not in data:
        # A Grok-2 config that names no activation predates the field: Grok-2 is what sglang
        # computes, the erf GELU, its keys masked by position (the pad id 0 such files carry was
        # a default, never Grok-2's: docs/grok2.md §2, §11).
        data.update(activation="gelu_erf", pad_token=None)
    try:
        config = ModelConfig(**{k: v for k, v in data.items() if k in fields})
    except (TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"{source}: invalid config: {e}") from None
    if ffn is not None and ffn != config.ffn_size:
        raise CheckpointError(f"{source}: ffn_size {str(ffn)[:40]} differs from the width emb_size "
                              f"{config.emb_size} and widening_factor {config.widening_factor} give, "
                              f"{config.ffn_size}")
    return config


def load_config(path: str, checkpoint: bool = False) -> ModelConfig:
    """A config from a JSON file; with ``checkpoint`` (a checkpoint's own config.json) its
    ``format`` must be this project's."""
    data = read_json(path, "config")
    if checkpoint and isinstance(data, dict) and data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {str(data.get('format'))[:80]!r} is not this project's "
                              f"native format {FORMAT!r}")
    return config_from_json(data, path)


# ---- writing -----------------------------------------------------------------------------
def flatten_tensors(params) -> list[tuple[str, object]]:
    """(on-disk name, array-like) for every tensor, int8 weights split into weight and scales, the
    stacked layers' split into one tensor a layer (``transformer/decoder_layer_<i>/...``)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(path)
        if name.startswith(STACKED):
            out += [(layer_name(name, i), leaf[i]) for i in range(leaf.shape[0])]
        else:
            out.append((name, leaf))
    return out


class SafetensorsWriter:
    """Writes one safetensors file whose tensors are known up front and streamed in order."""

    def __init__(self, path: str, tensors: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict):
        header, offset = {"__metadata__": metadata}, 0
        for name, shape, dtype in tensors:
            if np.dtype(dtype) not in _ST_DTYPES:
                raise CheckpointError(f"{name}: dtype {dtype} cannot be stored in safetensors")
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _ST_DTYPES[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.expected = [(name, header[name]["data_offsets"][1] - header[name]["data_offsets"][0])
                         for name, _, _ in tensors]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, array: np.ndarray, chunk_bytes: int = 64 << 20) -> None:
        want_name, want_size = self.expected.pop(0)
        assert name == want_name and array.nbytes == want_size, (name, want_name)
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8) if array.size else np.zeros(0, np.uint8)
        for start in range(0, flat.size, chunk_bytes):  # memmapped sources stream in chunks
            self.file.write(flat[start:start + chunk_bytes].tobytes())

    def close(self) -> None:
        assert not self.expected, f"tensors never written: {[n for n, _ in self.expected]}"
        self.file.close()


def save_tensors(directory: str, config: ModelConfig, tensors, *, tokenizer: str | None = None,
                 max_shard_bytes: int = 2 << 30, progress=None) -> None:
    """Write a native checkpoint from ``tensors``: (name, shape, dtype, read_fn) in order.

    ``read_fn()`` returns that tensor's numpy array (possibly a memmap); it is called once, when
    the tensor is written, so only one tensor is in flight at a time.
    """
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], [], 0
    for entry in tensors:
        nbytes = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    weight_map = {}
    metadata = {"format": FORMAT}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = SafetensorsWriter(os.path.join(directory, file), [e[:3] for e in shard], metadata)
        for name, shape, dtype, read in shard:
            array = read()
            if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
                raise CheckpointError(f"{name}: expected {shape} {dtype}, got {array.shape} {array.dtype}")
            writer.write(name, array)
            weight_map[name] = file
            if progress is not None:
                progress.update(array.nbytes)
        writer.close()
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": metadata, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config_to_json(config), f, indent=1)
    if tokenizer is not None:
        copy_tokenizer(tokenizer, directory)


def copy_tokenizer(path: str, directory: str) -> None:
    """``path`` into ``directory`` under its kind's name (``tokenization.FILES``), with the
    ``tokenizer_config.json`` beside a ``tokenizer.json`` (its BOS, EOS and chat template)."""
    from tokenization import load_tokenizer

    kind = load_tokenizer(path).kind
    name = {"sentencepiece": "tokenizer.model", "tokenizer.json": "tokenizer.json",
            "tiktoken": "tokenizer.tok.json"}[kind]
    with open(path, "rb") as src, open(os.path.join(directory, name), "wb") as dst:
        dst.write(src.read())
    extra = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if kind == "tokenizer.json" and os.path.isfile(extra):
        with open(extra, "rb") as src, open(os.path.join(directory, "tokenizer_config.json"), "wb") as dst:
            dst.write(src.read())


def save(directory: str, params, config: ModelConfig, *, tokenizer: str | None = None,
         max_shard_bytes: int = 2 << 30) -> None:
    """Save ``params`` (numpy or fully addressable JAX arrays) in the native format."""
    entries = []
    for name, leaf in flatten_tensors(params):
        entries.append((name, tuple(leaf.shape), np.dtype(leaf.dtype),
                        lambda leaf=leaf: np.asarray(jax.device_get(leaf))))
    save_tensors(directory, config, entries, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)


# ---- reading -----------------------------------------------------------------------------
def _is_count(x) -> bool:
    return type(x) is int and x >= 0  # bool is not a count


def read_header(path: str, spent: Spent | None = None) -> tuple[dict, int]:
    """Parse a safetensors header and check it: a JSON object of entries, each with a known
    ``dtype``, a ``shape`` of non-negative integers and two ``data_offsets`` inside the data
    section, exactly shape x dtype bytes apart, no two tensors' bytes overlapping. Return it and
    the offset where the data starts. At most ``HEADER_BYTES`` of header, and with ``spent`` (the
    checkpoint's, ``HEADERS_BYTES``) at most that much across its files."""
    regular_file(path, "safetensors file")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise CheckpointError(f"{path}: corrupted or truncated safetensors header "
                                      f"(claims {length} bytes, file has {size})")
            if length > HEADER_BYTES:
                raise CheckpointError(f"{path}: a safetensors header of {length:,} bytes is larger than "
                                      f"HEADER_BYTES ({HEADER_BYTES:,})")
            if spent is not None:
                spent.spend(path, length, "safetensors header")
            header = json.loads(f.read(length))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except CheckpointError:
        raise
    except (ValueError, RecursionError):  # bad JSON or text, or an integer of over 4,300 digits
        raise CheckpointError(f"{path}: corrupted safetensors header (not JSON)") from None
    except MemoryError:
        raise CheckpointError(f"{path}: a safetensors header of {length:,} bytes does not fit in memory") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header (a JSON {type(header).__name__}, not an object)")
    data_start = 8 + length
    data_size = size - data_start
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name[:200]!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise CheckpointError(f"{where}: an entry needs dtype, shape and data_offsets")
        dtype = _NP_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(f"{where} has unsupported dtype {str(info['dtype'])[:40]!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= 32 and all(_is_count(n) for n in shape)):
            raise CheckpointError(f"{where}: shape must be a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
            raise CheckpointError(f"{where}: data_offsets must be two non-negative integers")
        begin, stop = offsets
        need = math.prod(shape) * dtype.itemsize  # Python integers: never overflows
        if stop - begin != need:
            raise CheckpointError(f"{where} is corrupted: shape {shape} of {info['dtype']} needs {need} bytes, "
                                  f"its data_offsets [{begin}, {stop}] hold {stop - begin}")
        if stop > data_size:
            raise CheckpointError(f"{path}: truncated file: tensor {name[:200]!r} ends at byte {data_start + stop}, "
                                  f"the file has {size}")
        spans.append((begin, stop, name))
    furthest, holder = 0, None  # the end of the bytes claimed so far, and whose
    for begin, stop, name in sorted(s for s in spans if s[1] > s[0]):  # empty tensors overlap nothing
        if begin < furthest:
            raise CheckpointError(f"{path}: tensors {holder[:200]!r} and {name[:200]!r} overlap in the data section")
        furthest, holder = stop, name
    return header, data_start


def _lazy(path: str, name: str, info: dict, data_start: int) -> LazyTensor:
    dtype = _NP_DTYPES[info["dtype"]]
    shape = tuple(info["shape"])
    offset = data_start + info["data_offsets"][0]

    def read_slice(index, path=path, dtype=dtype, shape=shape, offset=offset):
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype)[index]
        return host_copy(np.memmap(path, dtype, "r", offset, shape)[index])

    def read_into(out, path=path, offset=offset):
        if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise ValueError(f"read_into needs a C-contiguous {shape} {dtype} array, got {out.shape} {out.dtype}")
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(view):  # one read returns at most ~2 GB (Linux)
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{path}: truncated file: tensor {name[:200]!r} ends past byte "
                                          f"{offset + done}")
                done += n

    return LazyTensor(f"{path}:{name}", shape, dtype, read_slice, read_into=read_into)


def open_native(directory: str) -> tuple[ModelConfig, dict, str | None]:
    """Config, ``{param path: LazyTensor | LazyQuantized}`` and the tokenizer path (or None)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config = load_config(os.path.join(directory, CONFIG), checkpoint=True)
    index_path = os.path.join(directory, INDEX)
    index = read_json(index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: corrupted index (weight_map must be an object of tensor name -> file)")
    headers, spent = {}, Spent(HEADERS_BYTES, "HEADERS_BYTES")
    tensors = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
            raise CheckpointError(f"{index_path}: tensor {name[:200]!r} maps to {str(file)[:80]!r}, not a file "
                                  "name in the checkpoint directory")
        path = os.path.join(directory, file)
        if file not in headers:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing (it holds tensor {name})")
            headers[file] = read_header(path, spent)
        header, data_start = headers[file]
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name} listed in the index is not in the file")
        tensors[name] = _lazy(path, name, header[name], data_start)
    params = {}
    for name, tensor in tensors.items():
        if name.endswith("/scales"):
            continue
        if name.endswith("/weight"):
            base = name[: -len("/weight")]
            scales = tensors.get(base + "/scales")
            if scales is None:
                raise CheckpointError(f"{directory}: int8 tensor {name} has no {base}/scales")
            params[base] = LazyQuantized(tensor, scales)
        else:
            params[name] = tensor
    orphans = [n for n in tensors if n.endswith("/scales") and n[: -len("/scales")] not in params]
    if orphans:
        raise CheckpointError(f"{directory}: scales without an int8 weight: {orphans}")
    from tokenization import find_tokenizer

    return config, params, find_tokenizer(directory)
