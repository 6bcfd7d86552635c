"""``grok-runner convert SRC DST``: a checkpoint to the native format.

SRC is an original Grok-1 checkpoint (``ckpt-0/tensor*_000``, never unpickled:
checkpoints/safe_pickle.py; with ``--config grok-1``), a Hugging Face directory of Grok-1 or
Grok-2 (its config.json says which), or a native one. DST receives ``config.json``, safetensors
shards and the tokenizer (``--tokenizer``, else SRC's: tokenizer.model, tokenizer.tok.json or
tokenizer.json; for ckpt-0/, beside it or one directory up). Every tensor's name, shape and dtype
is checked against the config before a byte is written, and streamed tensor by tensor.
"""

from __future__ import annotations

import argparse
import sys

from cli import flags


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory: original (ckpt-0/), Hugging Face or native")
    p.add_argument("dst", help="native checkpoint directory to write")
    p.add_argument("--config", help="a preset name (e.g. grok-1) or a JSON file: needed for ckpt-0/, which "
                   "stores none; checked against the config SRC stores otherwise")
    p.add_argument("--tokenizer", help="tokenizer to ship with the checkpoint (default: SRC's)")
    p.add_argument("--shard", type=flags.bounded(int, 0, None, "an integer >= 0"), default=0,
                   help="host shard suffix to read (default 0)")
    p.add_argument("--max-shard-gb", type=flags.bounded(float, 0.001, None, "a number of GiB > 0"), default=2.0,
                   help="size of each safetensors file (default 2)")
    return p


def convert(argv, prog: str) -> int:
    args = parser(prog).parse_args(argv)
    from checkpoints import CheckpointError
    from checkpoints.convert import convert as convert_checkpoint
    try:
        convert_checkpoint(args.src, args.dst, args.config, tokenizer=args.tokenizer,
                           shard=args.shard, max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dst}", file=sys.stderr)
    return 0
