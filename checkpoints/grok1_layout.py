"""The original Grok-1 checkpoint layout: ``<dir>/ckpt-0/tensor{i:05d}_{shard:03d}``, one pickle per
parameter, matched by position only (docs/grok1.md §2, §7).

File ``i`` holds the i-th leaf of the reference's flattened parameter tree: the embedding, the final
norm, then 12 leaves per layer with layers in *string* order of their names (0, 1, 10, 11, 2, ...).
The files carry no names, so this module derives the name of every position from the config and
checks every shape and dtype against the declared parameters.
"""

from __future__ import annotations

import os

import numpy as np

from checkpoints.lazy import LazyQuantized, LazyTensor
from checkpoints.materialize import materialize, resolve_config
from checkpoints.safe_pickle import ArrayRecord, CheckpointError, QuantizedRecord, read_pickled_tensor
from model.config import ModelConfig

# The 12 leaves of one decoder layer, in the order Haiku flattens them (sorted names).
LAYER_LEAVES = (
    "moe/linear/w", "moe/linear_1/w", "moe/linear_v/w",
    "multi_head_attention/key/w", "multi_head_attention/linear/w",
    "multi_head_attention/query/w", "multi_head_attention/value/w",
    "rms_norm/scale", "rms_norm_1/scale", "rms_norm_2/scale", "rms_norm_3/scale",
    "router/w",
)


def original_leaf_paths(config: ModelConfig) -> list[str]:
    """Parameter path of every file index, e.g. ``transformer/decoder_layer_10/router/w``."""
    paths = ["language_model/in_out_embed/embeddings", "language_model/rms_norm/scale"]
    for layer in sorted(str(i) for i in range(config.num_layers)):  # string order, as jax sorts keys
        paths += [f"transformer/decoder_layer_{layer}/{leaf}" for leaf in LAYER_LEAVES]
    return paths


def tensor_file(ckpt_dir: str, index: int, shard: int = 0) -> str:
    return os.path.join(ckpt_dir, "ckpt-0", f"tensor{index:05d}_{shard:03d}")


def open_original(ckpt_dir: str, config, shard: int = 0) -> dict:
    """``{param path: LazyTensor | LazyQuantized}`` for an original-layout checkpoint.

    ``shard`` is the host shard suffix (``_000`` in the release; the reference reads the file of its
    process index). Nothing is unpickled: each file's opcode stream is interpreted and its arrays
    are memory-mapped, so a device later reads only its own slice.
    """
    config = resolve_config(config)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory does not exist")
    if not os.path.isdir(os.path.join(ckpt_dir, "ckpt-0")):
        raise CheckpointError(f"{ckpt_dir}: not an original Grok-1 checkpoint (no ckpt-0/ directory)")
    paths = original_leaf_paths(config)
    sources = {}
    for index, path in enumerate(paths):
        file = tensor_file(ckpt_dir, index, shard)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (expected parameter {path})")
        sources[path] = _lazy(read_pickled_tensor(file))
    extra = tensor_file(ckpt_dir, len(paths), shard)
    if os.path.exists(extra):
        raise CheckpointError(f"{extra}: unexpected tensor file beyond the {len(paths)} parameters "
                              "of this config (wrong config?)")
    return sources


def _lazy(record: ArrayRecord | QuantizedRecord):
    if isinstance(record, QuantizedRecord):
        return LazyQuantized(_lazy(record.weight), _lazy(record.scales))
    return LazyTensor(record.path, record.shape, record.dtype,
                      lambda index, record=record: np.array(record.memmap()[index]), record.memmap)


def load_original(ckpt_dir: str, config, shard: int = 0) -> dict:
    """All parameters as host numpy arrays / ``QuantizedWeight8bit``, shapes and dtypes checked.
    ``config``: a ``ModelConfig``, a preset name or a JSON file."""
    config = resolve_config(config)
    return materialize(open_original(ckpt_dir, config, shard), config, mesh=None, to_host=True)
