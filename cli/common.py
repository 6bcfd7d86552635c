"""What the subcommands that load a model share: joining the hosts, the start-up's reports, the
checks that need no weights."""

from __future__ import annotations

import os
import sys


def start_jax(parser, args) -> None:
    """Join the other processes (several hosts); on several, JAX's persistent compilation cache."""
    import jax

    if args.coordinator == "auto":
        jax.distributed.initialize()  # Cloud TPU, SLURM, ...: JAX finds the cluster itself
    elif args.coordinator or args.num_processes:
        if not (args.coordinator and args.num_processes and args.process_id is not None):
            parser.error("several hosts need --coordinator, --num-processes and --process-id (or their env vars)")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if args.compile_cache != "off" and jax.process_count() > 1:
        # several hosts compile (the store of compiled steps is one process's): JAX's persistent
        # cache then skips XLA's part of it on a second start
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.compile_cache, "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def compile_cache_of(args):
    """The directory of compiled steps for ``--compile-cache`` (None: off)."""
    return None if args.compile_cache == "off" else args.compile_cache


def checkpoint_of(parser, args) -> str:
    """``--checkpoint``, or the model shipped with the package."""
    from runner.runner import default_checkpoint

    if args.checkpoint is None:
        checkpoint = default_checkpoint()
        if checkpoint is None:
            parser.error("the shipped model (checkpoints/austen-moe/) is missing from this installation: "
                         "pass --checkpoint DIR")
        return checkpoint
    if not os.path.isdir(args.checkpoint):
        parser.error(f"argument --checkpoint: {args.checkpoint!r} is not a directory")
    return args.checkpoint


def inspect_checkpoint(checkpoint: str, args, need_tokenizer: bool):
    """The checkpoint's layout, config and tokenizer from its headers (``checkpoints.restore.inspect``),
    in seconds, before JAX starts any device work; ``SystemExit(2)`` with one line saying what to
    pass if anything is missing or wrong."""
    from checkpoints import CheckpointError
    from checkpoints.restore import inspect

    try:
        return inspect(checkpoint, args.config, args.tokenizer, need_tokenizer=need_tokenizer)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def report(runner) -> None:
    """The backend, each CPU kernel's choice and the KV cache, on stderr."""
    for line in runner.backend_report().splitlines():
        print(line if line.startswith("backend:") else f"  kernel {line}", file=sys.stderr)
    print(runner.kv_report(), file=sys.stderr)
