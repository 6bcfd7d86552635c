"""Report (not assert) how this implementation compares with the Grok-1 reference fixture,
in fp32 and in bf16 activations.

    python -m bench.parity [--fixture ../shared/data/grok1_reference]
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from checkpoints import load_original
from backends import XLA
from model import GROK_1_REFERENCE_TINY, forward

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", default=os.path.join(HERE, "..", "..", "shared", "data", "grok1_reference"))
    args = parser.parse_args(argv)
    tokens = np.load(os.path.join(args.fixture, "tokens_full.npy"))
    print("| activations | reference file | max abs diff | mean abs diff | argmax agreement |")
    print("|---|---|---:|---:|---:|")
    for dtype, name in (("float32", "logits_full_fprop32.npy"), ("bfloat16", "logits_full.npy")):
        config = dataclasses.replace(GROK_1_REFERENCE_TINY, fprop_dtype=dtype)
        params = load_original(os.path.join(args.fixture, "ckpt"), config)
        got = np.asarray(forward(params, tokens, config, backend=XLA()).logits)
        want = np.load(os.path.join(args.fixture, name))
        diff = np.abs(got - want)
        agree = (got.argmax(-1) == want.argmax(-1)).mean()
        print(f"| {dtype} | {name} | {diff.max():.3g} | {diff.mean():.3g} | {agree:.1%} |")


if __name__ == "__main__":
    main()
