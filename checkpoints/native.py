"""The native checkpoint format: a directory with ``config.json``, the weights as safetensors, and
optionally ``tokenizer.model``.

    <dir>/config.json                         ModelConfig fields + {"format": "grok1-jax-runner/1"}
    <dir>/model.safetensors.index.json        {"weight_map": {tensor name: file}}
    <dir>/model-00001-of-0000N.safetensors    tensors, <= max_shard_bytes per file
    <dir>/tokenizer.model                     optional SentencePiece model

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
import os
import struct

import jax
import ml_dtypes
import numpy as np

from checkpoints.lazy import LazyQuantized, LazyTensor
from checkpoints.safe_pickle import CheckpointError
from model.config import ModelConfig
from model.sharding import path_str

FORMAT = "grok1-jax-runner/1"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.model"

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
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - fields - {"format"})
    if unknown:
        raise CheckpointError(f"{source}: unknown config fields {unknown}")
    try:
        return ModelConfig(**{k: v for k, v in data.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid config: {e}") from None


def load_config(path: str) -> ModelConfig:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read config ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: config is not valid JSON ({e})") from None
    return config_from_json(data, path)


# ---- writing -----------------------------------------------------------------------------
def flatten_tensors(params) -> list[tuple[str, object]]:
    """(name, array-like) for every tensor, int8 weights split into weight and scales."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [(path_str(path), leaf) for path, leaf in flat]


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
        with open(tokenizer, "rb") as src, open(os.path.join(directory, TOKENIZER), "wb") as dst:
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
def read_header(path: str) -> tuple[dict, int]:
    """Parse a safetensors header; return it and the offset where the data starts."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, 100 << 20):
                raise CheckpointError(f"{path}: corrupted or truncated safetensors header "
                                      f"(claims {length} bytes, file has {size})")
            header = json.loads(f.read(length))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupted safetensors header (not JSON)") from None
    data_start = 8 + length
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, stop = info["data_offsets"]
        dtype = _NP_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        if stop - begin != int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name} is corrupted (size does not match its shape)")
        end = max(end, stop)
    if data_start + end > size:
        raise CheckpointError(f"{path}: truncated file: its header needs {data_start + end} bytes, "
                              f"the file has {size}")
    return header, data_start


def _lazy(path: str, name: str, info: dict, data_start: int) -> LazyTensor:
    dtype = _NP_DTYPES[info["dtype"]]
    shape = tuple(info["shape"])
    offset = data_start + info["data_offsets"][0]

    def read_slice(index, path=path, dtype=dtype, shape=shape, offset=offset):
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype)[index]
        return np.array(np.memmap(path, dtype, "r", offset, shape)[index])

    return LazyTensor(f"{path}:{name}", shape, dtype, read_slice)


def open_native(directory: str) -> tuple[ModelConfig, dict, str | None]:
    """Config, ``{param path: LazyTensor | LazyQuantized}`` and the tokenizer path (or None)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    config = load_config(os.path.join(directory, CONFIG))
    index_path = os.path.join(directory, INDEX)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{index_path}: corrupted index (no weight_map)") from None
    headers = {}
    tensors = {}
    for name, file in weight_map.items():
        path = os.path.join(directory, file)
        if file not in headers:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing (it holds tensor {name})")
            headers[file] = read_header(path)
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
    tokenizer = os.path.join(directory, TOKENIZER)
    return config, params, tokenizer if os.path.exists(tokenizer) else None
