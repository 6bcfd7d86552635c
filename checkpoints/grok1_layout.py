"""The original Grok-1 checkpoint layout: ``<dir>/ckpt-0/tensor{i:05d}_{shard:03d}``, one pickle per
parameter, matched by position only (GROK1.md §2, §7).

File ``i`` holds the i-th leaf of the reference's flattened parameter tree: the embedding, the final
norm, then 12 leaves per layer with layers in *string* order of their names (0, 1, 10, 11, 2, ...).
The files carry no names, so this module derives the name of every position from the config and
checks every shape and dtype against the declared parameters.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from checkpoints.safe_pickle import ArrayRecord, CheckpointError, QuantizedRecord, read_pickled_tensor
from model.config import ModelConfig
from model.quant import QuantizedWeight8bit

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


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Declared shape of every parameter path."""
    from model.transformer import init_params  # shapes only: evaluated abstractly

    shapes = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def set_path(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def load_original(ckpt_dir: str, config: ModelConfig, shard: int = 0) -> dict:
    """All parameters of an original-layout checkpoint as numpy arrays / ``QuantizedWeight8bit``.

    Reads every file fully into host memory (the checkpoint issue adds sharded, lazy restore).
    """
    if not os.path.isdir(os.path.join(ckpt_dir, "ckpt-0")):
        raise CheckpointError(f"{ckpt_dir}: not an original Grok-1 checkpoint (no ckpt-0/ directory)")
    shapes = expected_shapes(config)
    params: dict = {}
    for index, path in enumerate(original_leaf_paths(config)):
        file = tensor_file(ckpt_dir, index, shard)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (expected parameter {path})")
        record = read_pickled_tensor(file)
        weight = record.weight if isinstance(record, QuantizedRecord) else record
        if weight.shape != shapes[path]:
            raise CheckpointError(f"{file}: parameter {path} has shape {weight.shape}, "
                                  f"expected {shapes[path]}")
        set_path(params, path, _materialise(record))
    extra = tensor_file(ckpt_dir, len(shapes), shard)
    if os.path.exists(extra):
        raise CheckpointError(f"{extra}: unexpected tensor file beyond the {len(shapes)} parameters "
                              "of this config (wrong config?)")
    return params


def _materialise(record: ArrayRecord | QuantizedRecord):
    if isinstance(record, QuantizedRecord):
        return QuantizedWeight8bit(weight=record.weight.read(), scales=record.scales.read())
    return record.read()


def np_tree(tree):
    """Helper for tests: the tree with every leaf as a numpy array."""
    return jax.tree_util.tree_map(np.asarray, tree)
