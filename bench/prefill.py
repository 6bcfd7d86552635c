"""One prefill call of the bench config by its shape: rows x bucket, and the KV bucket it attends
over, each row a first chunk of real tokens. Medians of ``--repeats`` calls, ms per call and per
token (compare ``python -m bench.moe --tokens 256,1024``: the MoE's share of it).

    python -m bench.prefill [--shapes 1x1024x1024,1x256x2048,...] [--repeats 3]
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

SHAPES = "1x1024x1024,1x1024x2048,1x256x256,1x256x1024,1x256x2048,2x256x1024,4x64x256,8x64x256"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="ROWSxBUCKETxKV_LEN, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    model = ModelRunner(model=BENCH, params=init_params(BENCH, jax.random.PRNGKey(0)))
    model = Executor.create(model, batch_size=8)
    rng = np.random.default_rng(0)
    print(f"{cpu()}; bench config, batch 8, medians of {args.repeats}")
    print("| rows x bucket | KV bucket | ms | ms / token |\n|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        rows, bucket, kv_len = (int(x) for x in shape.split("x"))
        batch = empty_batch(rows, bucket, 8, vocab_size=BENCH.vocab_size)
        for i in range(rows):
            batch.slots[i], batch.lengths[i], batch.first[i] = i, bucket, True
            batch.tokens[i] = rng.integers(4, BENCH.vocab_size, bucket)
        jax.block_until_ready(model.prefill_memory(batch, kv_len))  # compiles
        took = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready((model.prefill_memory(batch, kv_len), model.state))
            took.append(time.perf_counter() - start)
        ms = statistics.median(took) * 1e3
        print(f"| {rows} x {bucket} | {kv_len} | {ms:.0f} | {ms / (rows * bucket):.2f} |", flush=True)


if __name__ == "__main__":
    main()
