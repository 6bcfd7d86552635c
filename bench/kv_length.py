"""A decode step against the KV length it attends over, the live positions fixed: whether a
backend's attention reads only the live positions (``Backend.decode_reads_live_keys``).

    python -m bench.kv_length [--dtypes float32,bfloat16] [--repeats 60]

The bench config, the CPU backend with every kernel on, a decode forward of batch 1 and 8 with
50 or 200 live positions a row, over KV lengths 64, 256 and 2,048 (where they hold the live
ones). Medians of ``--repeats`` steps, ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from bench.common import BENCH, cpu


def step_ms(config, backend, params, batch: int, live: int, kv: int, repeats: int) -> float:
    from model import forward, new_memory

    step = jax.jit(lambda p, t, m: forward(p, t, config, memory=m, backend=backend, kv_len=kv), donate_argnums=2)
    memory = new_memory(config, batch).replace(step=jnp.full((batch,), live, jnp.int32))
    tokens = jnp.zeros((batch, 1), jnp.int32)
    compiled = step.lower(params, tokens, memory).compile()
    took = []
    for _ in range(repeats):
        began = time.perf_counter()
        out = compiled(params, tokens, memory)
        jax.block_until_ready(out.logits)
        took.append(time.perf_counter() - began)
        memory = out.memory.replace(step=jnp.full((batch,), live, jnp.int32))
    return statistics.median(took) * 1e3


def main(argv=None) -> None:
    from backends.cpu.backend import CPU
    from model import init_params

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=60)
    args = p.parse_args(argv)
    print(f"{cpu()}; bench config, CPU kernels on, medians of {args.repeats} steps, ms")
    print("| dtype | batch | live | kv 64 | kv 256 | kv 2,048 |\n|---|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        config = dataclasses.replace(BENCH, fprop_dtype=dtype)
        backend = CPU(on=frozenset({"moe", "projections", "unembed", "attention"}), dtype=dtype)
        params = backend.prepare(init_params(config, jax.random.PRNGKey(0)))
        for batch in (1, 8):
            for live in (50, 200):
                cells = [f"{step_ms(config, backend, params, batch, live, kv, args.repeats):.2f}" if kv > live else "-"
                         for kv in (64, 256, 2048)]
                print(f"| {dtype} | {batch} | {live} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
