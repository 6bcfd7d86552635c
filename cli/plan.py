"""``grok-runner plan``: the per-device memory plan of a preset or a checkpoint on a mesh, from
headers alone (nothing is loaded): weights by dtype, KV bytes a token and a slot, and with
``--device-memory`` the largest batch at each context length.

    grok-runner plan --preset grok-1 --mesh 1,8 --device-memory 141
    grok-runner plan --checkpoint DIR --batch-size 16 --kv-dtype int8
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
    return p


def plan(argv, prog: str) -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    from checkpoints import CheckpointError
    from checkpoints.restore import abstract_checkpoint
    from model import PRESETS
    from model.plan import abstract_params, memory_plan

    if args.preset:
        if args.preset not in PRESETS:
            p.error(f"argument --preset: expected one of {sorted(PRESETS)}, got {args.preset!r}")
        config = PRESETS[args.preset]
        params = abstract_params(config, quantized=True)
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
    return 0
