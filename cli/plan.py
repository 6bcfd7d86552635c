"""``grok-runner plan``: the per-device memory plan of a preset or a checkpoint on a mesh, from
headers alone (nothing is loaded): weights by dtype, KV bytes a token and a slot, and with
``--device-memory`` the largest batch at each context length; then the steps a server of it
compiles before it serves (for ``serve``'s scheduling flags: --batch-size, --pad-sizes, ...),
and with ``--compile-estimate`` their compile time estimated by compiling the largest of them
here on abstract shapes (minutes for Grok-1's 64 layers on a laptop CPU).

    grok-runner plan --preset grok-1 --mesh 1,8 --device-memory 141
    grok-runner plan --preset grok-2 --mesh 1,8 --device-memory 141 --kv-dtype int8
    grok-runner plan --checkpoint DIR --batch-size 16 --kv-dtype int8
    grok-runner plan --preset grok-1 --batch-size 8 --compile-estimate

A preset's weights are planned as released: Grok-1's int8 (bf16 scales), Grok-2's bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from cli import flags


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.plan(p)
    flags.checkpoint(p)
    p.add_argument("--mesh", type=flags.mesh_shape, default=(1, 1), help="device mesh DATA,MODEL (default 1,1)")
    p.add_argument("--batch-size", type=flags.bounded(int, 1, 1 << 16, "an integer >= 1"), default=1,
                   help="decode slots (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activation dtype (default: the config's)")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                   help="what the KV cache holds (default: the activation dtype)")
    p.add_argument("--weight-dtype", choices=["int8", "bfloat16", "float32"], default=None,
                   help="a preset's weights (default: as released: Grok-1 int8, Grok-2 bfloat16)")
    flags.pad_sizes_flag(p)
    flags.scheduling(p)
    flags.speculative(p, "the most draft tokens a speculative step verifies (its decode steps are compiled "
                      "only if > 0; default 0)")
    p.add_argument("--compile-estimate", action="store_true",
                   help="compile the largest prefill and decode step here, from abstract shapes (nothing "
                   "allocated), and estimate what compiling every step would take on this machine")
    return p


def plan(argv, prog: str) -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    from checkpoints import CheckpointError
    from checkpoints.restore import abstract_checkpoint
    from model import PRESETS
    from model.plan import abstract_params, memory_plan
    import jax
    import jax.numpy as jnp

    if args.preset:
        if args.preset not in PRESETS:
            p.error(f"argument --preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
        config = PRESETS[args.preset]
        weights = args.weight_dtype or ("int8" if config.variant == "grok-1" else "bfloat16")
        params = abstract_params(config, quantized=weights == "int8")
        if weights == "bfloat16":
            params = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16), params)
    elif args.checkpoint:
        try:
            config, params = abstract_checkpoint(args.checkpoint, args.config)
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        p.error("the plan needs --preset NAME or --checkpoint DIR")
    if args.dtype:
        config = dataclasses.replace(config, fprop_dtype=args.dtype)
    memory = None if args.device_memory is None else int(args.device_memory * 2**30)
    try:
        result = memory_plan(config, params, mesh_shape=args.mesh, batch_size=args.batch_size,
                             device_memory=memory, kv_dtype=args.kv_dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.format())
    from runner import compiled

    try:
        planned = compiled.steps(config, args.batch_size, pad_sizes=args.pad_sizes,
                                 max_num_batched_tokens=args.max_num_batched_tokens, decode_steps=args.decode_steps,
                                 speculative=args.speculative, score_prompts=args.max_scored_tokens != 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"a server of batch {args.batch_size} compiles {planned.describe()}")
    if not args.speculative and len(planned.kv_buckets) > 1:
        live = compiled.steps(config, args.batch_size, pad_sizes=args.pad_sizes,
                              max_num_batched_tokens=args.max_num_batched_tokens, decode_steps=args.decode_steps,
                              score_prompts=args.max_scored_tokens != 0, live_keys=True)
        print(f"  ({live.count} on the CPU backend with its attention kernel, whose decode reads the live "
              "positions only: one decode step for every KV length)")
    if args.compile_estimate:
        print(compiled.estimate(config, params, planned, args.batch_size, args.kv_dtype).describe())
    return 0
