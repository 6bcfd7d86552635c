"""One prefill call of the bench config by its shape: rows first chunks of real tokens, each
``chunk`` long, packed into one call. Medians of ``--repeats`` calls, ms per call and per token
(compare ``python -m bench.moe --tokens 256,1024``: the MoE's share of it).

    python -m bench.prefill [--shapes 1x512,8x64,...] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from bench.common import BENCH, cpu
from model import init_params
from runner import Executor, ModelRunner
from runner.batches import empty_batch

SHAPES = "1x16,1x64,1x256,1x512,2x256,4x64,8x64"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="ROWSxCHUNK, comma-separated: ROWS chunks of CHUNK tokens packed in one call")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    model = ModelRunner(model=BENCH, params=init_params(BENCH, jax.random.PRNGKey(0)))
    model = Executor.create(model, batch_size=8)
    rng = np.random.default_rng(0)
    print(f"{cpu()}; bench config, batch 8, medians of {args.repeats}")
    print("| rows x chunk | ms | ms / token |\n|---|---:|---:|")
    for shape in args.shapes.split(","):
        rows, bucket = (int(x) for x in shape.split("x"))
        batch = empty_batch(8, rows * bucket, 8, vocab_size=BENCH.vocab_size)  # rows chunks packed
        for i in range(rows):
            batch.slots[i], batch.lengths[i], batch.first[i], batch.offset[i] = i, bucket, True, i * bucket
            batch.row[i * bucket: (i + 1) * bucket] = i
        batch.tokens[:] = rng.integers(4, BENCH.vocab_size, rows * bucket)
        jax.block_until_ready(model.prefill_memory(batch))  # compiles
        took = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready((model.prefill_memory(batch), model.state))
            took.append(time.perf_counter() - start)
        ms = statistics.median(took) * 1e3
        print(f"| {rows} x {bucket} | {ms:.0f} | {ms / (rows * bucket):.2f} |", flush=True)


if __name__ == "__main__":
    main()
