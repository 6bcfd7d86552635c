"""A decode step's attention alone, every layer of the bench config: the CPU kernel against XLA's
op, over float32 and int8 caches (``model.memory.QuantizedKV``), at a few context lengths.

    python -m bench.attention [--batch 8] [--contexts 256,1024,2048] [--repeats 15]

Each way attends ``num_layers`` distinct caches of ``sequence_len`` positions over their first
``context`` (a decode step's shapes); the ways are timed taking turns, call by call, and the
medians printed in ms for all layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from backends.cpu import ops
from backends.xla import attend
from bench.common import BENCH, cpu
from model import quantize_kv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    c, b = BENCH, args.batch
    scale, cap = c.attn_output_multiplier, c.attn_logit_cap
    rng = np.random.default_rng(0)
    shape = (b, c.num_kv_heads, c.sequence_len, c.key_size)
    floats = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2 * c.num_layers)]
    caches = {"float32": floats, "int8": [quantize_kv(x) for x in floats]}
    q = jnp.asarray(rng.standard_normal((b, c.num_q_heads, c.key_size)), jnp.float32)
    print(f"CPU: {cpu()}; batch {b}, {c.num_layers} layers, {c.num_q_heads} query / {c.num_kv_heads} KV heads of "
          f"{c.key_size}; ms for all layers (median of {args.repeats})")
    print("| context | float32 kernel | float32 XLA | int8 kernel | int8 XLA (a dequantised copy) |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.contexts.split(",")):
        mask = jnp.ones((b, n), bool)

        def layers(one):
            return jax.jit(lambda q, kv: sum(one(q, kv[2 * i], kv[2 * i + 1]) for i in range(c.num_layers)))

        kernel = {"float32": ops.decode_attention, "int8": ops.decode_attention_int8}
        ways = {}
        for kv in ("float32", "int8"):
            ways[f"{kv} kernel"] = (layers(lambda q, k, v, f=kernel[kv]: f(q, k, v, mask, scale, cap)), caches[kv])
            ways[f"{kv} xla"] = (layers(lambda q, k, v: attend(q[:, None], k, v, mask[:, None], scale, cap)[:, 0]),
                                 caches[kv])
        times = {name: [] for name in ways}
        for fn, kv in ways.values():
            jax.block_until_ready(fn(q, kv))
        for _ in range(args.repeats):
            for name, (fn, kv) in ways.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(q, kv))
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"| {n} | {ms['float32 kernel']:.1f} | {ms['float32 xla']:.1f} | {ms['int8 kernel']:.1f} | "
              f"{ms['int8 xla']:.1f} |")


if __name__ == "__main__":
    main()
