"""Restore parameters onto a mesh: each device reads only its own slice of each tensor.

``restore(dir, mesh=..., dtype=...)`` opens a native checkpoint (``config.json`` of this
project's format), a Hugging Face directory of a Grok model (``config.json`` in Hugging Face's
terms: ``checkpoints.hf_layout``) or an original Grok-1 one (``ckpt-0/``, with ``config=`` a preset
name, a JSON file or a ``ModelConfig``): the format dispatch. The tensors are checked and placed
by ``checkpoints.materialize``.
"""

from __future__ import annotations

import dataclasses
import os

from jax.sharding import Mesh

from checkpoints.grok1_layout import open_original
from checkpoints.hf_layout import config_from_hf, is_hf_config, open_hf
from checkpoints.materialize import (_nest, _placeholder, check_sources, check_tokenizer, config_differences,
                                     materialize, resolve_config, stack_layers)
from checkpoints.native import CONFIG, FORMAT, open_native
from checkpoints.safe_pickle import CheckpointError
from untrusted import read_json
from model.config import ModelConfig

@dataclasses.dataclass
class Restored:
    config: ModelConfig
    params: dict
    tokenizer_path: str | None


TOKENIZER = "tokenizer.model"
WHERE_GROK1_TOKENIZER = ("Grok-1's tokenizer.model ships in the code repository, "
                         "https://github.com/xai-org/grok-1, not with the weights")


def find_tokenizer(directory: str) -> str | None:
    """An original checkpoint's SentencePiece model: ``tokenizer.model`` beside ``ckpt-0/``, else one
    level up (where Grok-1's code repository keeps it when the weights are downloaded into its
    ``checkpoints/``). A native checkpoint holds its own (``open_native``). Whatever holds the
    name counts (``check_tokenizer`` then refuses anything but a regular file, naming it)."""
    for candidate in (directory, os.path.dirname(os.path.abspath(directory))):
        path = os.path.join(candidate, TOKENIZER)
        if os.path.lexists(path):
            return path
    return None


@dataclasses.dataclass
class Inspected:
    """What a checkpoint is, read from its headers alone: its layout ("native", "huggingface" or "original"), its
    config, its parameters as ShapeDtypeStructs and its tokenizer (checked against the vocabulary)."""
    layout: str
    config: ModelConfig
    params: dict
    tokenizer_path: str | None
    sources: dict = dataclasses.field(repr=False)  # the lazy tensors, for ``materialize``


def _agreed(directory: str, stored: ModelConfig, passed: ModelConfig | None, says: str) -> ModelConfig:
    """The config a checkpoint stores, which one passed in (if any) must equal."""
    if passed is not None and passed != stored:
        raise CheckpointError(f"{directory}: config.json {says} the config passed in: "
                              f"{config_differences(stored, passed)} (checkpoint != passed)")
    return stored


def inspect(directory: str, config=None, tokenizer: str | None = None, *, need_tokenizer: bool = False,
            shard: int = 0) -> Inspected:
    """Every check that needs no weights, in seconds: the layout, the config (stored or passed: a
    preset name, a JSON file or a ``ModelConfig``; both must agree), each tensor's name, shape and
    dtype from the headers, and the tokenizer (``tokenizer``, else ``find_tokenizer``) against the
    config's vocabulary; with ``need_tokenizer``, a missing one is an error saying what to pass.
    ``CheckpointError`` naming the file otherwise."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    passed = None if config is None else resolve_config(config)  # resolved once, here
    config_json = os.path.join(directory, CONFIG)
    has_config = os.path.exists(config_json)
    stored_json = read_json(config_json, "config") if has_config else None
    if has_config and not (isinstance(stored_json, dict) and stored_json.get("format") == FORMAT) \
            and is_hf_config(stored_json):
        layout = "huggingface"
        config = _agreed(directory, config_from_hf(stored_json, config_json), passed, "describes another model than")
        sources = open_hf(directory, config)
        from tokenization import find_tokenizer as tokenizer_in

        tokenizer_path = tokenizer_in(directory)
    elif has_config:
        layout = "native"
        stored, sources, tokenizer_path = open_native(directory)
        config = _agreed(directory, stored, passed, "differs from")
    elif os.path.isdir(os.path.join(directory, "ckpt-0")):
        layout = "original"
        if passed is None:
            raise CheckpointError(f"{directory}: an original Grok-1 checkpoint (ckpt-0/) stores no config; "
                                  "pass --config grok-1 (a preset name or a JSON file)")
        config = passed
        sources = open_original(directory, config, shard)
        tokenizer_path = find_tokenizer(directory)
    else:
        raise CheckpointError(f"{directory}: neither a native checkpoint (config.json), a Hugging Face one (its "
                              "config.json and safetensors) nor an original Grok-1 one (ckpt-0/)")
    check_sources(sources, config)
    tokenizer_path = tokenizer or tokenizer_path
    if tokenizer_path is None and need_tokenizer:
        where = f"; {WHERE_GROK1_TOKENIZER}" if layout == "original" else ""
        named = TOKENIZER if layout == "original" else "tokenizer (tokenizer.model, tokenizer.tok.json, tokenizer.json)"
        raise CheckpointError(f"{directory}: no {named} in it{' or its parent directory' if layout == 'original' else ''}: "
                              f"pass --tokenizer PATH{where}")
    check_tokenizer(tokenizer_path, config)
    params = _nest({name: _placeholder(source) for name, source in stack_layers(sources).items()})
    return Inspected(layout, config, params, tokenizer_path, sources)


def restore(directory: str, *, mesh: Mesh | None = None, dtype=None, dequantize: bool = False,
            config=None, rules: dict | None = None, tokenizer: str | None = None, shard: int = 0,
            progress: bool | None = None, abstract: bool = False) -> Restored:
    """Restore a native or original-layout checkpoint onto ``mesh`` (default: one device), after
    ``inspect``'s checks; with ``abstract``, the parameters' shapes and dtypes only, nothing read."""
    inspected = inspect(directory, config, tokenizer, shard=shard)
    config = inspected.config
    params = materialize(inspected.sources, config, mesh=mesh, dtype=dtype, dequantize=dequantize,
                         rules=rules, progress=progress, abstract=abstract)
    return Restored(config, params, inspected.tokenizer_path)


def abstract_checkpoint(directory: str, config=None) -> tuple[ModelConfig, dict]:
    """The config and ShapeDtypeStruct tree of a checkpoint, read from headers only (for planning)."""
    inspected = inspect(directory, config)
    return inspected.config, inspected.params
