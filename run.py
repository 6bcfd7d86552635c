"""Command line: generate from a Grok-1-style checkpoint.

Until the runner lands (runner issue), this greedily decodes token ids with the model's own cached
forward pass; by default it runs the Grok-1 reference fixture, whose random weights repeat a token.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CHECKPOINT = os.path.join(HERE, "..", "shared", "data", "grok1_reference", "ckpt")
# "The answer to life the universe and everything is of course" in the Grok-1 tokenizer (GROK1.md §10)
DEFAULT_PROMPT_IDS = "422,3033,356,1180,333,9072,360,2175,391,359,1805"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT,
                        help="original-layout checkpoint directory (holding ckpt-0/)")
    parser.add_argument("--preset", default="grok-1-reference-tiny",
                        help="model config preset matching the checkpoint")
    parser.add_argument("--prompt-ids", default=DEFAULT_PROMPT_IDS, help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="activation dtype (float32 is much faster on CPU)")
    args = parser.parse_args(argv)

    from checkpoints import load_original
    from model import PRESETS, forward, new_memory

    if args.preset not in PRESETS:
        parser.error(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    if not os.path.isdir(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint!r} is not a directory")
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    except ValueError:
        parser.error(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    config = dataclasses.replace(PRESETS[args.preset], fprop_dtype=args.dtype)
    if args.max_tokens <= 0 or len(prompt) + args.max_tokens > config.sequence_len:
        parser.error(f"prompt ({len(prompt)}) + --max-tokens must be in (prompt, {config.sequence_len}]")

    start = time.perf_counter()
    params = load_original(args.checkpoint, config)
    memory = new_memory(config, 1)
    out = forward(params, [prompt], config, memory=memory, last_only=True)
    tokens = [int(out.logits[0, -1].argmax())]
    first = time.perf_counter()
    while len(tokens) < args.max_tokens:
        out = forward(params, [[tokens[-1]]], config, memory=out.memory)
        tokens.append(int(out.logits[0, -1].argmax()))
    end = time.perf_counter()
    print(",".join(map(str, tokens)))
    print(f"time to first token {first - start:.2f}s, {(len(tokens) - 1) / max(end - first, 1e-9):.1f} "
          "tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
