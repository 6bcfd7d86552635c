"""Restore parameters onto a mesh: each device reads only its own slice of each tensor.

``restore(dir, mesh=..., dtype=...)`` opens a native checkpoint (``config.json``) or an original
Grok-1 one (``ckpt-0/``, with ``config=`` a preset name, a JSON file or a ``ModelConfig``): the
format dispatch. The tensors are checked and placed by ``checkpoints.materialize``.
"""

from __future__ import annotations

import dataclasses
import os

from jax.sharding import Mesh

from checkpoints.grok1_layout import open_original
from checkpoints.materialize import (_nest, _placeholder, check_sources, check_tokenizer, config_differences,
                                     materialize, resolve_config)
from checkpoints.native import CONFIG, open_native
from checkpoints.safe_pickle import CheckpointError
from model.config import ModelConfig

@dataclasses.dataclass
class Restored:
    config: ModelConfig
    params: dict
    tokenizer_path: str | None


def restore(directory: str, *, mesh: Mesh | None = None, dtype=None, dequantize: bool = False,
            config=None, rules: dict | None = None, tokenizer: str | None = None, shard: int = 0,
            progress: bool | None = None) -> Restored:
    """Restore a native or original-layout checkpoint onto ``mesh`` (default: one device)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    if os.path.exists(os.path.join(directory, CONFIG)):
        stored, sources, tokenizer_path = open_native(directory)
        if config is not None and resolve_config(config) != stored:
            raise CheckpointError(f"{directory}: config.json differs from the config passed in: "
                                  f"{config_differences(stored, resolve_config(config))} (checkpoint != passed)")
        config = stored
    elif os.path.isdir(os.path.join(directory, "ckpt-0")):
        if config is None:
            raise CheckpointError(f"{directory}: an original Grok-1 checkpoint stores no config; pass "
                                  "config= a preset name or a JSON file")
        config = resolve_config(config)
        sources = open_original(directory, config, shard)
        tokenizer_path = None
    else:
        raise CheckpointError(f"{directory}: neither a native checkpoint (config.json) nor an original "
                              "Grok-1 one (ckpt-0/)")
    tokenizer_path = tokenizer or tokenizer_path
    check_tokenizer(tokenizer_path, config)
    params = materialize(sources, config, mesh=mesh, dtype=dtype, dequantize=dequantize, rules=rules,
                         progress=progress)
    return Restored(config, params, tokenizer_path)


def abstract_checkpoint(directory: str, config=None) -> tuple[ModelConfig, dict]:
    """The config and ShapeDtypeStruct tree of a checkpoint, read from headers only (for planning)."""
    if os.path.exists(os.path.join(directory, CONFIG)):
        config, sources, _ = open_native(directory)
    elif config is not None:
        config = resolve_config(config)
        sources = open_original(directory, config)
    else:
        raise CheckpointError(f"{directory}: not a native checkpoint; pass a config for the original layout")
    check_sources(sources, config)
    return config, _nest({name: _placeholder(source) for name, source in sources.items()})
