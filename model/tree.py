"""Names of parameters in a pytree."""

from __future__ import annotations

import re


def path_str(path) -> str:
    """'/'-joined names of a pytree key path (dict keys and dataclass fields)."""
    parts = []
    for key in path:
        parts.append(str(getattr(key, "key", getattr(key, "name", key))))
    return "/".join(parts)


# The decoder layers' parameters are stacked on a leading axis under ``transformer/layers``
# (``model.transformer.Transformer`` scans them); checkpoints on disk, like Grok-1's own tree,
# name each layer's apart: ``transformer/decoder_layer_<i>/...``.
STACKED = "transformer/layers/"
_PER_LAYER = re.compile(r"transformer/decoder_layer_([0-9]+)/(.+)")


def layer_name(stacked_name: str, layer: int) -> str:
    """The on-disk name of layer ``layer`` of a stacked parameter (``transformer/layers/X`` ->
    ``transformer/decoder_layer_<layer>/X``)."""
    return f"transformer/decoder_layer_{layer}/{stacked_name[len(STACKED):]}"


def split_layer_name(name: str) -> tuple[str, int] | None:
    """``(stacked name, layer)`` of an on-disk per-layer name, else None."""
    m = _PER_LAYER.fullmatch(name)
    return None if m is None else (STACKED + m.group(2), int(m.group(1)))
