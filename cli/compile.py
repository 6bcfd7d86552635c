"""``grok-runner compile``: every step ``grok-runner serve`` with the same flags builds, compiled
into --compile-cache from the checkpoint's headers alone (no weight is read, nothing is allocated),
so that a deployment fills the store while the weights are still being copied and its first
``serve`` loads every step instead of compiling it. It takes serve's flags (the store is keyed by
them) and the XLA backend: pass --backend xla on one CPU device, whose default CPU backend lays
out the weights themselves.

    grok-runner compile --checkpoint DIR --batch-size 8 --backend xla
    grok-runner serve --checkpoint DIR --batch-size 8 --backend xla     # loads them
"""

from __future__ import annotations

import sys

from cli import STARTED
from cli.common import checkpoint_of, inspect_checkpoint, start_jax
from cli.serve import parser as serve_parser
from cli.serve import runner_of


def compile_ahead(argv, prog: str) -> int:
    p = serve_parser(prog)
    p.description = __doc__
    args = p.parse_args(argv)
    if args.compile_cache == "off":
        p.error("argument --compile-cache: 'off' leaves nowhere to compile into")
    checkpoint = checkpoint_of(p, args)
    try:
        inspected = inspect_checkpoint(checkpoint, args, need_tokenizer=False)
    except SystemExit as e:
        return e.code
    start_jax(p, args)
    from checkpoints import CheckpointError
    from runner.startup import stderr_startup

    startup = stderr_startup(STARTED)
    startup.mark("imports", STARTED)
    try:
        done = runner_of(args, checkpoint, inspected.tokenizer_path).compile_ahead(startup)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"{done['compiled']} steps compiled into {args.compile_cache} ({done['loaded']} were stored already): "
          f"`serve` with the same flags loads them", flush=True)
    return 0
