"""Convert a checkpoint to the native format, streaming tensor by tensor.

    grok-runner convert SRC DST [--config PRESET|JSON] [--tokenizer FILE]   (cli/convert.py)
    python -m checkpoints.convert SRC DST ...                               (the same command)

SRC is any layout ``checkpoints.restore.inspect`` reads: an original Grok-1 ``ckpt-0/`` (never
unpickled: see checkpoints/safe_pickle.py; it needs ``--config``), a Hugging Face directory of
Grok-1 or Grok-2 (transposed, stacked and joined as it is read), or a native one. DST receives
``config.json``, safetensors shards and the tokenizer. Every tensor's name, shape and dtype is
checked against the config before a byte is written.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from checkpoints.lazy import LazyQuantized
from checkpoints.native import save_tensors
from checkpoints.restore import inspect


def convert(src: str, dst: str, config=None, *, tokenizer: str | None = None, shard: int = 0,
            max_shard_bytes: int = 2 << 30, progress: bool = True) -> None:
    """``src`` (any layout) written to ``dst`` in the native format, with its tokenizer
    (``tokenizer``, else the one ``inspect`` finds), every check made before a byte is written."""
    inspected = inspect(src, config, tokenizer, shard=shard)
    config, sources, tokenizer = inspected.config, inspected.sources, inspected.tokenizer_path
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


if __name__ == "__main__":
    # ``python -m checkpoints.convert SRC DST``, the documented command before ``grok-runner
    # convert``, hands over to that command (the same process, flags and exit status), which
    # this package does not import: the command line is cli's, which imports this module.
    import os
    import sys

    os.execv(sys.executable, [sys.executable, "-m", "cli", "convert", *sys.argv[1:]])
