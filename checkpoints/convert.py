"""Convert an original Grok-1 checkpoint to the native format, streaming tensor by tensor.

    grok-runner convert SRC DST --config PRESET|JSON [--tokenizer tokenizer.model]   (cli/convert.py)

SRC holds ``ckpt-0/tensor*_000`` (never unpickled: see checkpoints/safe_pickle.py); DST receives
``config.json``, safetensors shards and, with ``--tokenizer``, ``tokenizer.model``. Every tensor's
name, shape and dtype is checked against the config before a byte is written.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from checkpoints.grok1_layout import open_original
from checkpoints.lazy import LazyQuantized
from checkpoints.native import save_tensors
from checkpoints.materialize import check_sources, check_tokenizer, resolve_config


def convert(src: str, dst: str, config, *, tokenizer: str | None = None, shard: int = 0,
            max_shard_bytes: int = 2 << 30, progress: bool = True) -> None:
    config = resolve_config(config)
    sources = open_original(src, config, shard)
    check_sources(sources, config)
    check_tokenizer(tokenizer, config)
    entries = []
    for name, source in sources.items():
        parts = ([(name + "/weight", source.weight), (name + "/scales", source.scales)]
                 if isinstance(source, LazyQuantized) else [(name, source)])
        for tensor_name, lazy in parts:
            entries.append((tensor_name, lazy.shape, np.dtype(lazy.dtype), lazy.stream))
    total = sum(s.nbytes for s in sources.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
        save_tensors(dst, config, entries, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                     progress=bar)
